"""How many flows a flat algorithm puts on a host's link at once (crossing.py), and how the
tuner and `tensorwire plan` price flat algorithms across hosts with it.

The traced patterns are checked against real runs: every flat algorithm's sends on a real
5-rank world are the trace's, message for message."""

from __future__ import annotations

import pytest

import tensorwire as tw
from cluster import Cluster
from tensorwire.algorithms.prices import Link
from tensorwire.algorithms.registry import COLLECTIVES, algorithms_for
from tensorwire.config import Config
from tensorwire.tuning import cost_model, crossing, pricing, topology, tuner
from tensorwire.tuning.cost_model import BUSY, BUSY_RING, Links, LinkTable

pytestmark = pytest.mark.timeout(120)


def flat(collective: str) -> dict:
    return {name: a for name, a in algorithms_for(collective).items()
            if a.phases is None and not a.needs_direct}


def test_shares_of_the_known_patterns() -> None:
    """4 hosts x 4 ranks, numbered host by host. A ring crosses once per host per step; a
    pairwise exchange from every rank of a host whose partner is elsewhere, P(n - P) / (n - 1)
    on average; recursive doubling's all_reduce from all 4 in its two steps across hosts,
    each round priced at least at one flow (its steps within hosts): (1 + 1 + 4 + 4) / 4; the
    rooted linear algorithms and the trees are bound by one rank's link."""
    counts, nics = (4,) * 4, (1,) * 4

    def share(coll: str, name: str) -> float:
        return crossing.algorithm_share(algorithms_for(coll)[name], counts, nics)

    for coll in ("all_reduce", "all_gather", "reduce_scatter"):
        assert share(coll, "ring") == 1.0
    assert share("all_to_all", "pairwise") == pytest.approx(4 * 12 / 15)
    assert share("reduce_scatter", "pairwise") == pytest.approx(4 * 12 / 15)
    assert share("all_reduce", "recursive_doubling") == pytest.approx(10 / 4)
    # recursive doubling's all_gather: the step of distance d moves d blocks, crossing from
    # all 4 where d >= 4: (1 + 2 + 4*4 + 8*4) / (1 + 2 + 4 + 8)
    assert share("all_gather", "recursive_doubling") == pytest.approx(51 / 15)
    for coll, name in (("broadcast", "binomial"), ("broadcast", "chain"), ("gather", "linear"),
                       ("scatter", "linear"), ("reduce", "linear"), ("all_reduce", "tree")):
        assert share(coll, name) == 1.0, (coll, name)
    # two interfaces a host: the pairwise exchange's 1, 2, 3, 4 x 9, 3, 2, 1 flows a step over
    # two links each, a step never below one flow
    assert crossing.algorithm_share(algorithms_for("all_to_all")["pairwise"], counts, (2,) * 4) == \
        pytest.approx((1 + 1 + 1.5 + 9 * 2 + 1.5 + 1 + 1) / 15)
    # one rank a host: nothing shares
    assert all(crossing.algorithm_share(a, (1,) * 6, (1,) * 6) == 1.0
               for c in COLLECTIVES for a in flat(c).values())


def test_every_flat_algorithm_traces_and_shares_at_least_one_flow() -> None:
    for n in (2, 3, 5, 8):
        for coll in COLLECTIVES:
            for name, alg in flat(coll).items():
                msgs = crossing.trace(coll, name, n)
                assert msgs or coll == "barrier", (coll, name, n)
                # counts sent ahead (the trees' gather and scatter) read as the traced blocks'
                assert all(b <= n * crossing._BLOCK * 4 for *_, b in msgs), (coll, name, n)
                counts = (n // 2, n - n // 2)
                assert crossing.algorithm_share(alg, counts, (1, 1)) >= 1.0, (coll, name, n)


def test_rounds_follow_causality() -> None:
    """A binomial broadcast from 0 over 8 ranks: 0 sends to 4, 2, 1 in its first round; 4 can
    only send after its receive, one round later, 2 and 6 after theirs."""
    msgs = crossing.trace("broadcast", "binomial", 8)
    round_of = {(src, dst): t for t, src, dst, _ in msgs}
    assert {round_of[(0, 4)], round_of[(0, 2)], round_of[(0, 1)]} == {0}
    assert round_of[(4, 6)] == round_of[(4, 5)] == 1 and round_of[(6, 7)] == 2


def test_the_probe_patterns_share() -> None:
    """The busy probe's shifts by 1, 2, 4 over 2 hosts of 4 ranks: 1, 2 and 4 ranks of a host
    cross; its ring one. Placed cyclically (rank r on host r mod 2) every shift by an odd
    distance crosses from all 4, the ring too."""
    block = crossing.block((4, 4))
    assert crossing.probe_shares(block, (1, 1)) == (pytest.approx(7 / 3), 1.0)
    cyclic = tuple(r % 2 for r in range(8))
    shifting, ring = crossing.probe_shares(cyclic, (1, 1))
    assert ring == 4.0 and shifting == pytest.approx((4 + 1 + 1) / 3)


def test_scaled_layouts_keep_at_most_the_traced_ranks() -> None:
    assert crossing.scaled((4,) * 16, (1,) * 16) == ((4,) * 8, (1,) * 8)
    assert crossing.scaled((64, 64), (4, 4)) == ((16, 16), (1, 1))
    assert crossing.scaled((3, 5), (1, 1)) == ((3, 5), (1, 1))


def test_the_tuner_prices_flat_algorithms_with_their_share() -> None:
    """Across hosts, each flat algorithm's β counts the flows it puts on a host link; the busy
    links the probe measured across hosts are first brought back to one flow."""
    layout = topology.Layout(((0, 1, 2, 3), (4, 5, 6, 7)), (1, 1))
    spread = cost_model.spread_of(layout)
    tcp = Link("tcp", 60e-6, 1 / 0.119e9, 1 / 7.5e9)
    algs = list(flat("all_gather").values())
    m = 16 << 20
    alone = dict((name, t) for t, name, _ in cost_model.price(algs, 8, m, Links(tcp)))
    shared = dict((name, t) for t, name, _ in cost_model.price(algs, 8, m, Links(tcp, spread=spread)))
    assert shared["ring"] == alone["ring"]
    assert shared["recursive_doubling"] > 2 * alone["recursive_doubling"]
    assert cost_model.price(algs, 8, m, Links(tcp, spread=spread))[0][1] == "ring"
    busy = Link(BUSY, 400e-6, 1 / 0.051e9, 1 / 4e9)
    ring = Link(BUSY_RING, 400e-6, 1 / 0.11e9, 1 / 4e9)
    table = LinkTable({"tcp": tcp, BUSY: busy, BUSY_RING: ring},
                            {BUSY: "calibrated", BUSY_RING: "calibrated"},
                            extra={"busy_tier": "tcp"})
    per = cost_model.per_flow(table, layout)
    assert per.links[BUSY].beta == pytest.approx(busy.beta * 3 / 7)
    assert per.links[BUSY_RING] == ring and per.extra["busy_flows"][BUSY] == pytest.approx(7 / 3)
    assert cost_model.per_flow(table, None) is table
    given = LinkTable(table.links, {BUSY: "file", BUSY_RING: "file"}, extra=table.extra)
    assert cost_model.per_flow(given, layout) is given  # constants the user gave are taken as they are


def test_plan_prices_flat_algorithms_with_their_share(capsys) -> None:
    """16 MiB all_gather over 4 hosts of 4 ranks at 25 Gb/s: recursive doubling moves its
    largest blocks from every rank of a host at once, so the ring (one flow a host) is the
    cheaper flat one, and a pairwise all_to_all costs about 3.2 times its lone price."""
    from tensorwire.tools import cli

    assert cli.main(["plan", "all_gather", "16MiB", "--hosts", "4", "--per-host", "4", "--tier",
                     "shm=2:9,eth25g=30:3.1"]) == 0
    text = capsys.readouterr().out
    rows = {line.split()[0]: line for line in text.splitlines()
            if line.startswith("    ") and "crossover" not in line}
    assert "x3." in rows["recursive_doubling"] and "x1.0" in rows["ring"], text
    assert "(3.4 flows a host link)" in rows["recursive_doubling"] and "flows" not in rows["ring"], text
    local = pricing.Tier("shm", Link("shm", 2e-6, 1 / 9e9, 1 / 7.5e9), "given")
    net = pricing.Tier("net", Link("net", 30e-6, 1 / 3.1e9, 1 / 7.5e9), "given")
    priced = pricing.cluster_prices("all_to_all", 16 << 20, 4, 4, 1, local, net, Config())
    rows = {name: t for t, name, _ in priced}
    lone = algorithms_for("all_to_all")["pairwise"].cost(16, 16 << 20, net.link)
    assert rows["pairwise"] == pytest.approx(lone + (4 * 12 / 15 - 1) * 15 / 16 * (16 << 20) * net.link.beta)


# -- the trace against a real run ------------------------------------------------------------------

def rank_sends_of_every_flat_algorithm() -> list[str]:
    """Run every flat algorithm of every collective on this world (blocks of the trace's size),
    recording each send, and compare with the trace's sends from this rank."""
    import numpy as np

    from tensorwire.group import calls as group_mod

    g = tw.world()
    n, me = g.size, g.rank
    sent: list[tuple[int, int]] = []
    original, original_exchange = group_mod.CollectiveCall.isend, group_mod.CollectiveCall.exchange_now

    def isend(self, peer, data, step):
        sent.append((peer, data.nbytes))
        return original(self, peer, data, step)

    def exchange_now(self, dst, send, *args):
        done = original_exchange(self, dst, send, *args)
        if done[0]:  # else its send is posted through isend
            sent.append((dst, send.nbytes))
        return done

    block = crossing._BLOCK

    def full() -> np.ndarray:
        return np.ones(n * block, np.float32)

    def one() -> np.ndarray:
        return np.ones(block, np.float32)

    calls = {
        "all_reduce": lambda: g.all_reduce(full()),
        "broadcast": lambda: g.broadcast(full(), 0),
        "reduce": lambda: g.reduce(full(), 0),
        "all_gather": lambda: g.all_gather_into_tensor(full(), one()),
        "reduce_scatter": lambda: g.reduce_scatter_tensor(one(), full()),
        "all_to_all": lambda: g.all_to_all_single(full(), full()),
        "gather": lambda: g.gather(one(), [one() for _ in range(n)] if me == 0 else None, 0),
        "scatter": lambda: g.scatter(one(), [one() for _ in range(n)] if me == 0 else None, 0),
        "barrier": lambda: g.barrier(),
    }
    wrong = []
    group_mod.CollectiveCall.isend, group_mod.CollectiveCall.exchange_now = isend, exchange_now
    try:
        for coll in COLLECTIVES:
            for name in flat(coll):
                with tuner.override(g, coll, name):
                    sent.clear()
                    calls[coll]()
                    got = sorted(sent)
                want = sorted((dst, b) for _, src, dst, b in crossing.trace(coll, name, n) if src == me)
                if got != want:
                    wrong.append(f"{coll} {name}: sent {got}, traced {want}")
    finally:
        group_mod.CollectiveCall.isend, group_mod.CollectiveCall.exchange_now = original, original_exchange
    return wrong


def test_traces_are_what_the_algorithms_send() -> None:
    c = Cluster(5, env={"TENSORWIRE_TRANSPORT": "tcp"})
    try:
        for rank, wrong in enumerate(c.run(rank_sends_of_every_flat_algorithm)):
            assert not wrong, f"rank {rank}: " + "\n".join(wrong)
    finally:
        c.close()
