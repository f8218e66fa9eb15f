"""The topology model, the orders algorithms run in, hierarchical pricing, and `tensorwire topo`.

Across real (emulated) hosts the same machinery is checked in test_multihost.py; here: the
model built from cards, the orders as data (how often each pattern crosses between hosts), a
real one-host group given a layout of two "hosts" (the orders and the hierarchical algorithms
over real transports, where the test bed cannot be built), and the command.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import tensorwire as tw
from cluster import Cluster
from tensorwire.algorithms.ordered import ROOTED, arrange
from tensorwire.algorithms.prices import Link, Shape
from tensorwire.algorithms.registry import COLLECTIVES, algorithms_for
from tensorwire.config import Config
from tensorwire.transport.processes import core_sharers
from tensorwire.tuning import cost_model, topology, tuner

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parent.parent


def card(host: str, machine: str = "m0", pid: int = 1, cores: str = "0-1", numa: tuple = (0,),
         ifname: str = "eth0") -> dict:
    return {"addr": "10.0.0.1", "host": host, "machine": machine, "pid": pid, "ifname": ifname,
            "cores": cores, "numa": list(numa), "gpu": None}


def cyclic_topology(hosts: int, per: int) -> topology.Topology:
    """World rank r on host r mod `hosts` (Slurm's cyclic distribution)."""
    return topology.Topology.from_cards({r: card(f"h{r % hosts}", pid=r) for r in range(hosts * per)})


def test_cpulists_round_trip() -> None:
    assert topology.parse_cpulist("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert topology.format_cpulist([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert topology.parse_cpulist("") == [] and topology.format_cpulist([]) == ""


def test_ranks_that_may_share_a_core_are_counted_per_machine() -> None:
    """core_sharers: the ranks of this rank's machine whose cores meet its own, itself included."""
    cards = {0: {"machine": "m", "cores": "0"}, 1: {"machine": "m", "cores": "1"},
             2: {"machine": "m", "cores": "0-1"}, 3: {"machine": "other", "cores": "0"}}
    assert [core_sharers(cards, r) for r in range(4)] == [2, 2, 3, 1]


def test_numa_nodes_from_sysfs(tmp_path: Path) -> None:
    for node, cpus in ((0, "0-3"), (1, "4-7")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus + "\n")
    assert topology.numa_nodes([1, 2], str(tmp_path)) == [0]
    assert topology.numa_nodes([3, 4], str(tmp_path)) == [0, 1]
    assert topology.numa_nodes([9], str(tmp_path)) == []


def test_hosts_are_host_name_and_kernel() -> None:
    """Emulated hosts (one kernel, own host names) are hosts of one machine; two machines that
    share a host name are two hosts."""
    t = topology.Topology.from_cards({0: card("a", "k1", 10), 1: card("b", "k1", 11), 2: card("a", "k2", 12),
                                  3: card("a", "k1", 13, numa=(1,))})
    assert t.hosts == [(0, 3), (1,), (2,)] and t.host_of == [0, 1, 2, 0]
    assert t.machine_of == [0, 0, 1, 0]
    assert t.near(0) == (3,) and t.same_host(0, 3) and not t.same_host(0, 2)
    assert t.tier(0, 0) == "self" and t.tier(0, 1) == "net" and t.tier(0, 2) == "net"
    assert t.tier(0, 3) == "host"  # bound to different NUMA nodes
    same_node = topology.Topology.from_cards({0: card("a", pid=1), 1: card("a", pid=2)})
    assert same_node.tier(0, 1) == "numa"
    spans = topology.Topology.from_cards({0: card("a", pid=1, numa=(0, 1)), 1: card("a", pid=2, numa=(0, 1))})
    assert spans.tier(0, 1) == "host"  # unbound ranks share no one node


def test_local_card_describes_this_process() -> None:
    c = topology.local_card("127.0.0.1")
    assert c["host"] and c["machine"] == topology.machine_id() and c["pid"] == os.getpid()
    assert c["ifname"] == "lo" and set(topology.parse_cpulist(c["cores"])) == os.sched_getaffinity(0)
    assert c["gpu"] is None or "index" in c["gpu"]
    json.dumps(c)  # published as JSON


def crossings(order: tuple[int, ...], host_of: list[int], edges: list[tuple[int, int]]) -> int:
    """How many of the pattern's edges (between virtual ranks) join ranks on different hosts."""
    return sum(host_of[order[a]] != host_of[order[b]] for a, b in edges)


def binomial_edges(n: int) -> list[tuple[int, int]]:
    """(parent, child) of a binomial tree rooted at virtual rank 0 (algorithms/tree.py)."""
    return [(v - (v & -v), v) for v in range(1, n)]


@pytest.mark.parametrize("hosts,per", [(2, 4), (4, 2), (3, 4), (2, 3)])
def test_orders_cross_between_hosts_as_little_as_they_can(hosts: int, per: int) -> None:
    """Whatever the numbering, the ring crosses once per host, a binomial tree from any root
    reaches each other host once (hosts of a power of two), and recursive doubling's first
    rounds stay within hosts; numbered as they come, cyclic placement crossed at every hop."""
    t = cyclic_topology(hosts, per)
    n = hosts * per
    layout = t.layout(range(n))
    assert layout is not None and layout.shape == Shape(hosts, per, per)
    ring = [(v, (v + 1) % n) for v in range(n)]
    assert crossings(layout.ring, t.host_of, ring) == hosts
    assert crossings(tuple(range(n)), t.host_of, ring) == n  # the order the numbering gives
    for root in range(n):
        order = layout.rooted(root)
        assert order[0] == root and sorted(order) == list(range(n))
        if per & (per - 1) == 0:
            assert crossings(order, t.host_of, binomial_edges(n)) == hosts - 1, (root, order)
    if n & (n - 1) == 0:
        for k in range(per.bit_length() - 1):  # partners at distance 2^k < per: one host
            assert crossings(layout.ring, t.host_of, [(v, v ^ (1 << k)) for v in range(n)]) == 0


def test_layouts_without_rails() -> None:
    t = topology.Topology.from_cards({0: card("a"), 1: card("a"), 2: card("b")})
    assert t.layout([0, 1]) is None  # one host
    assert t.layout([0, 2]).shape is None  # one rank per host: nothing to do within hosts
    uneven = t.layout([0, 1, 2])
    assert uneven is not None and uneven.ring == (0, 1, 2)
    assert uneven.shape == Shape(2, 2, 1.0, least=1) and not uneven.shape.uniform
    assert uneven.rails == ((0, 2), (1,)) and uneven.shape.rails == 1
    assert "rails every host has [0 2]" in uneven.describe_hierarchy()
    two_nics = topology.Topology.from_cards({0: card("a", ifname="ib0"), 1: card("a", ifname="ib1"),
                                         2: card("b", ifname="ib0"), 3: card("b", ifname="ib1")})
    assert two_nics.layout(range(4)).shape.nic_share == 1.0  # a rail per interface


def test_identity_orders_leave_algorithms_alone() -> None:
    """One host, or hosts numbered together: nothing is added to a call."""
    block = topology.Topology.from_cards({r: card(f"h{r // 2}", pid=r) for r in range(4)}).layout(range(4))
    cyclic = cyclic_topology(2, 2).layout(range(4))
    for coll in COLLECTIVES:
        for alg in algorithms_for(coll).values():
            plain = not alg.reorder or alg.needs_direct
            assert arrange(alg, None) is alg
            assert (arrange(alg, cyclic) is alg) == plain, (coll, alg.name)
            if coll not in ROOTED:  # rooted ones look at their root's order as they are called
                assert arrange(alg, block) is alg, (coll, alg.name)


def test_hierarchy_priced_against_the_flat_algorithms() -> None:
    """64 MiB all_reduce over 2 hosts x 4 ranks, 1 Gbit/s between them: a flat ring carries
    2 (n-1)/n of it across each host link, the hierarchy once, pipelined; small calls are left
    to the leaders' variant, one message per host between hosts."""
    table = cost_model.LinkTable({"shm": cost_model.DEFAULT_LINKS["shm"],
                             "tcp": Link("tcp", 60e-6, 1 / 0.119e9, 1 / 7.5e9)}, {})
    local, rail = cost_model.phase_prices(table, Config())
    shape = Shape(2, 4, 4)
    m = 64 << 20
    flat = algorithms_for("all_reduce")["ring"].cost(8, m, table.link("tcp"))
    hier = algorithms_for("all_reduce")["hierarchical"].phases(shape, m, local, rail)
    assert 0.56 < hier < 0.7 < 0.98 < flat, (hier, flat)
    # small calls: shares of a few bytes would run their host phases through the vector forms
    rails = algorithms_for("all_reduce")["hierarchical"]
    assert not rails.eligible(8, (8 << 10) - 1) and rails.eligible(8, 8 << 10)
    assert algorithms_for("all_reduce")["hierarchical_leaders"].phases(shape, 8, local, rail) < 1e-3
    for coll in ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "barrier"):
        for alg in algorithms_for(coll).values():
            if alg.phases is not None:
                costs = [alg.phases(Shape(h, p, p), b, local, rail) for h, p in ((2, 2), (8, 4), (64, 8))
                         for b in (0, 8, 1 << 20, 1 << 30)]
                assert all(0 <= c < float("inf") for c in costs), (coll, alg.name, costs)


def test_host_phases_pay_the_wake_up_where_ranks_share_cores() -> None:
    """Where the busy probe found a step costs far more than the rail's α (ranks sharing cores:
    421 against 28 µs on emulated hosts on 2 vCPUs), each host phase pays the difference; a
    table without busy links (a cluster priced by `tensorwire plan`) prices as before."""
    tcp = Link("tcp", 28e-6, 1 / 0.119e9, 1 / 7.5e9)
    links = {"shm": cost_model.DEFAULT_LINKS["shm"], "tcp": tcp}
    quiet, _ = cost_model.phase_prices(cost_model.LinkTable(links, {}), Config())
    busy = {cost_model.BUSY: Link(cost_model.BUSY, 421e-6, 1 / 0.0565e9, 1 / 3.49e9)}
    table = cost_model.LinkTable({**links, **busy}, {}, extra={"busy_tier": "tcp"})
    crowded, rail = cost_model.phase_prices(table, Config())
    for coll in ("all_gather", "reduce_scatter", "broadcast", "reduce", "all_reduce"):
        for nbytes in (64, 1 << 20):
            assert crowded(coll, 2, nbytes) - quiet(coll, 2, nbytes) == pytest.approx(421e-6 - 28e-6), coll
        assert crowded(coll, 1, 64) == quiet(coll, 1, 64) == 0.0
    shape = Shape(4, 2, 2)
    gather = algorithms_for("all_gather")["hierarchical"]
    assert gather.phases(shape, 64, crowded, rail) > gather.phases(shape, 64, quiet, rail) + 421e-6


# -- a real group given a layout of two "hosts" ------------------------------------------------------

def two_hosts() -> tw.Group:
    """A group of this one-host job's 4 ranks told that ranks 0, 2 and 1, 3 are two hosts."""
    g = tw.new_group([0, 1, 2, 3], name="two")
    g._layout = topology.Topology.from_cards({r: card(f"h{r % 2}", pid=r) for r in range(4)}).layout(range(4))
    g.choices.clear()
    return g


def rank_orders_and_hierarchy_on_one_host() -> tuple[int, list]:
    """Every algorithm of every collective on a one-host group of 4 told that its ranks 0, 2
    and 1, 3 are two hosts: the flat ones then run in that layout's order, the hierarchical
    ones over host groups and rails of real shared-memory groups."""
    import topology_job

    g = two_hosts()
    topology_job._GROUPS[:] = [("two", g)]
    cases = [0]
    topology_job.algos(cases)
    return cases[0], sorted(topology_job.RAN)


@pytest.fixture(scope="module")
def four() -> Cluster:
    c = Cluster(4)
    yield c
    c.close()


def test_orders_and_hierarchy_over_real_transports(four: Cluster) -> None:
    results = four.run(rank_orders_and_hierarchy_on_one_host, timeout=110)
    cases, ran = results[0]
    assert all(res == results[0] for res in results) and cases > 80, results
    hierarchical = {coll for coll, name in ran if name == "hierarchical"}
    assert hierarchical == {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
                            "all_to_all_single", "barrier"}, ran
    assert ("all_reduce", "hierarchical_leaders") in ran and ("all_gather", "ring") in ran, ran


def rank_uneven_hosts_on_one_host(hosts: list[int]) -> tuple[int, list]:
    """Every algorithm of every collective on a one-host group of 4 told that rank r is on
    host hosts[r]: hosts of different numbers of ranks."""
    import topology_job

    g = tw.new_group([0, 1, 2, 3], name="uneven")
    cards = {r: card(f"h{hosts[r]}", pid=r) for r in range(4)}
    g._layout = topology.Topology.from_cards(cards).layout(range(4))
    g.choices.clear()
    topology_job._GROUPS[:] = [("uneven", g)]
    topology_job.RAN.clear()
    cases = [0]
    topology_job.algos(cases)
    empty = np.empty(0, np.float32)
    with tuner.override(g, "all_gather", "hierarchical_leaders"):
        g.all_gather_into_tensor(empty, empty)
    with tuner.override(g, "reduce_scatter", "hierarchical_leaders"):
        g.reduce_scatter_tensor(empty, empty)
    return cases[0], sorted(topology_job.RAN)


@pytest.mark.parametrize("hosts", [[0, 0, 0, 1], [0, 1, 0, 0]], ids=["block", "apart"])
def test_uneven_hosts_gather_and_scatter_through_their_leaders(four: Cluster, hosts: list[int]) -> None:
    """3 + 1 ranks: the rails' all_gather and reduce_scatter need as many ranks on every host;
    the leaders' variants (within each host onto its first rank, between hosts on rail 0, back
    within each host) run there, with the host's blocks together (block) or apart in the
    output, every dtype and op of topology_job checked."""
    results = four.run(rank_uneven_hosts_on_one_host, hosts, timeout=110)
    cases, ran = results[0]
    assert all(res == results[0] for res in results) and cases > 50, results
    leaders = {("all_gather", "hierarchical_leaders"), ("reduce_scatter", "hierarchical_leaders")}
    assert leaders <= set(ran), ran
    assert ("all_gather", "hierarchical") not in ran and ("reduce_scatter", "hierarchical") not in ran, ran


def forced_hierarchy_and_uneven_blocks() -> tuple[list, list, list, str]:
    """What the list-form all_to_all and all_gatherv (blocks that may differ) and an even
    all_to_all_single return under TENSORWIRE_ALGO forcing their hierarchical variants."""
    g, r = two_hosts(), tw.get_rank()
    outs = [np.empty(3) for _ in range(4)]
    g.all_to_all(outs, [np.full(3, 10.0 * r + d) for d in range(4)])
    counts = [1, 2, 3, 4]
    gathered = np.empty(10)
    g.all_gatherv(gathered, np.full(counts[r], float(r)), counts)
    single = np.empty(8)
    g.all_to_all_single(single, np.arange(8.0) + 100 * r)
    return [o[0] for o in outs], gathered.tolist(), single.tolist(), tuner.select(g, "all_to_all", 64).name


def test_forcing_hierarchical_leaves_calls_with_uneven_blocks_free() -> None:
    """Blocks that may differ run no hierarchy: forcing it leaves such calls to the flat
    algorithms (it left them none, an error), and binds the even form."""
    c = Cluster(4, env={"TENSORWIRE_ALGO": "alltoall:hierarchical,allgather:hierarchical"})
    try:
        results = c.run(forced_hierarchy_and_uneven_blocks, timeout=60)
    finally:
        c.close()
    for r, (lists, gathered, single, chosen) in enumerate(results):
        assert lists == [10.0 * q + r for q in range(4)] and gathered == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
        assert single == [x + 2 * r for q in range(4) for x in (100.0 * q, 100.0 * q + 1)]
        assert chosen == "hierarchical"


def rank_topology() -> dict:
    t = tw.topology()
    return {"hosts": t.hosts, "tier": t.tier(0, 1), "layout": tw.world().layout, "me": t.ranks[tw.get_rank()]}


def test_topology_seen_from_a_job(four: Cluster) -> None:
    results = four.run(rank_topology)
    for r, res in enumerate(results):
        assert res["hosts"] == [(0, 1, 2, 3)] and res["tier"] in ("numa", "host") and res["layout"] is None
        assert res["me"].rank == r and res["me"].address == "127.0.0.1" and res["me"].interface == "lo"
    assert len({res["me"].pid for res in results}) == 4


def test_topo_command() -> None:
    env = dict(os.environ, TENSORWIRE_TIMEOUT="60")
    done = subprocess.run([sys.executable, "-m", "tensorwire", "topo", "--np", "2"], capture_output=True,
                          text=True, timeout=100, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "2 rank(s) on 1 host(s)", done.stdout
    assert any(line.startswith("host 0: ") and line.endswith("ranks 0-1") for line in lines), done.stdout
    assert sum(" lo 127.0.0.1" in line for line in lines) == 2, done.stdout
    assert "orders: one host: the ring and trees follow rank order" in lines, done.stdout
    # what rank 0 knows of its host's wiring: the transport, cores against ranks, /dev/shm
    assert any(line.startswith("transport: shm within a host, tcp across; over TCP ") for line in lines)
    assert any(re.match(r"rank 0's machine: \d+ usable core\(s\) for its 2 rank\(s\), waiting ranks .*; "
                        r"/dev/shm .* free of ", line) for line in lines), done.stdout
    done = subprocess.run([sys.executable, "-m", "tensorwire", "topo", "--json"], capture_output=True,
                          text=True, timeout=100, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["world_size"] == 1 and doc["ranks"][0]["pid"] > 0 and doc["hosts"][0]["ranks"] == [0]
    assert doc["rank0_host"]["cores"] >= 1 and doc["rank0_host"]["dev_shm_bytes"] > 0, doc
    assert doc["rank0_host"]["machine_ranks"] == 1, doc


def test_plan_prices_a_cluster_flat_against_hierarchical(capsys) -> None:
    """`tensorwire plan --hosts H --per-host L`: the flat algorithms at the slower tier's price,
    the hierarchical ones by their phases, the cheapest marked, the crossovers between them."""
    from tensorwire.tools import cli

    args = ["plan", "all_reduce", "64MiB", "--hosts", "2", "--per-host", "4", "--tier",
            "shm=2:9,eth1g=60:0.119"]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert text.startswith("all_reduce of 64 MiB on 8 ranks: 2 hosts x 4 ranks, shm within a host, eth1g "
                           "between hosts (4 rank(s) per host link)"), text
    rows = {line.split()[0]: line for line in text.splitlines()
            if line.startswith("    ") and "crossover" not in line}
    assert "<- cheapest" in rows["hierarchical"] and "x1." in rows["ring"], text
    assert "one-host shared-memory path only" in rows["direct"], text
    assert "crossover: hierarchical_leaders -> hierarchical at" in text, text
    assert cli.main(["plan", "all_reduce", "1M", "--hosts", "2", "--tier", "shm"]) == 2
    assert "two tiers" in capsys.readouterr().err
    assert cli.main(["plan", "broadcast", "1M", "--hosts", "4", "--per-host", "1", "--tier",
                     "shm=2:9,tcp=30:1"]) == 0
    assert "needs several hosts of several ranks" in capsys.readouterr().out


def test_pieces_follow_the_link() -> None:
    """The pipelined all_reduce cuts 64 MiB into 8 pieces over the test bed's link (α 0.19 ms,
    0.112 GB/s), into one where α is large against what a piece moves; every rank cuts alike."""
    from tensorwire.algorithms import hierarchical

    count = (64 << 20) // 4
    bed = Link("tcp", 191e-6, 1 / 0.112e9, 1 / 7.5e9)
    assert len(hierarchical.pieces(count, 4, 4, bed)) == 8
    assert len(hierarchical.pieces(count, 4, 4, replace(bed, alpha=23e-3))) == 1
    assert len(hierarchical.pieces(count, 4, 4)) == 8 and len(hierarchical.pieces(1000, 4, 4, bed)) == 1
    ranges = hierarchical.pieces(count + 3, 4, 4, bed)
    assert ranges[0][0] == 0 and ranges[-1][1] == count + 3
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
