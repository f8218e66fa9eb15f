"""Multi-host tests: real jobs across emulated hosts built by scripts/netns_cluster.py.

Each host is a network namespace with its own hostname (UTS namespace), joined to the others
through a veth and a bridge; ranks on different hosts therefore talk TCP over 10.77.0.0/24,
ranks on one host shared memory. These tests need root (CAP_NET_ADMIN + CAP_SYS_ADMIN),
iproute2 and unshare; without them every test is skipped with the reason the probe gave.
Every test also asserts that the testbed removed its namespaces (twtb-<pid>-*).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "netns_cluster.py"

# One job script, several modes (argv[1]); written to tmp_path by the `job` fixture.
JOB = textwrap.dedent('''\
    import os, socket, sys, time
    import numpy as np
    import tensorwire as tw


    def say(text):
        print(text, flush=True)  # the launcher relays whole lines, so ranks never interleave

    def finish():
        tw.barrier()  # leaving right after is fine: peers still get what this rank sent

    def collectives():
        r, n = tw.get_rank(), tw.get_world_size()
        host = socket.gethostname()
        rng = np.random.default_rng(1234)  # same numbers on every rank; rank r uses row r
        data = rng.standard_normal((n, 1000))
        x = data[r].copy()
        tw.all_reduce(x)
        assert np.allclose(x, data.sum(axis=0)), "all_reduce small"
        big = rng.integers(-1000, 1000, size=(n, 100_000), dtype=np.int64)  # 800 KB: ring path
        y = big[r].copy()
        tw.all_reduce(y)
        assert np.array_equal(y, big.sum(axis=0)), "all_reduce large"
        m = data[r].copy()
        tw.all_reduce(m, op=tw.ReduceOp.MAX)
        assert np.array_equal(m, data.max(axis=0)), "all_reduce max"
        out = [np.empty(1000) for _ in range(n)]
        tw.all_gather(out, data[r])
        for i in range(n):
            assert np.array_equal(out[i], data[i]), f"all_gather block {i}"
        for root in sorted({0, n - 1}):
            b = data[root].copy() if r == root else np.zeros(1000)
            tw.broadcast(b, src=root)
            assert np.array_equal(b, data[root]), f"broadcast from {root}"
        k = 3
        send = (np.arange(n * k) + 1000 * r).astype(np.float32)
        recv = np.empty(n * k, dtype=np.float32)
        tw.all_to_all_single(recv, send)
        want = np.concatenate([np.arange(r * k, r * k + k) + 1000 * j for j in range(n)]).astype(np.float32)
        assert np.array_equal(recv, want), "all_to_all_single"
        t = time.perf_counter()
        tw.barrier()
        say(f"COLLECTIVES OK rank {r}/{n} host {host} barrier {time.perf_counter() - t:.4f}")

    def bandwidth():
        r = tw.get_rank()
        nbytes = 4 << 20
        x = np.arange(nbytes // 8, dtype=np.float64) if r == 0 else np.zeros(nbytes // 8)
        tw.barrier()
        t = time.perf_counter()
        tw.broadcast(x, src=0)
        tw.barrier()
        dt = time.perf_counter() - t
        assert np.array_equal(x, np.arange(nbytes // 8, dtype=np.float64)), "broadcast 4 MiB"
        say(f"BROADCAST rank {r} {nbytes} bytes {dt:.4f} s")

    def latency():
        r = tw.get_rank()
        x = np.ones(1)
        times = []
        for _ in range(21):
            t = time.perf_counter()
            tw.all_reduce(x)
            times.append(time.perf_counter() - t)
        say(f"LATENCY rank {r} median {sorted(times)[10]:.6f} s")

    def loop(seconds):
        """Small all_reduces until rank 0 says stop (so all ranks run the same count)."""
        r = tw.get_rank()
        x = np.ones(1 << 12)
        try:
            # Inside the try: the fault fires on rank 0's READY, which can come before
            # the other ranks have left this barrier.
            tw.barrier()
            if r == 0:
                say("READY")
            stop_at = time.time() + seconds
            while True:
                x[:] = 1
                x[-1] = 1 if (r == 0 and time.time() > stop_at) else 0
                tw.all_reduce(x)
                if x[-1] > 0:
                    break
        except tw.TensorwireError as e:
            say(f"FAILED rank {r} at {time.time():.3f} {type(e).__name__}: {e}")
            sys.exit(3)
        say(f"SURVIVED rank {r}")

    def last_call_in_an_outage():
        """The job's last calls, a send and a barrier, made while a link is down (the bed
        restores it within the peer timeout); then every rank leaves."""
        r, n = tw.get_rank(), tw.get_world_size()
        tw.barrier()
        if r == 0:
            say("READY")
        time.sleep(0.5)
        x = np.arange(1 << 18, dtype=np.float32)
        try:
            if r == 0:
                tw.send(x, n - 1, tag=5)
            elif r == n - 1:
                y = np.empty_like(x)
                tw.recv(y, 0, tag=5)
                assert np.array_equal(x, y), "the message across the outage"
            tw.barrier()
        except tw.TensorwireError as e:
            say(f"FAILED rank {r} {type(e).__name__}: {e}")
            sys.exit(3)
        say(f"SURVIVED rank {r}")
        tw.destroy()  # at once: no call after it
        sys.exit(0)

    def cut(late):
        """Rank 0 sends the last rank more than the sockets' buffers hold, which it reads only
        `late` seconds later (its receive window closed meanwhile, its kernel still answering).
        Then all_reduces until host 1 is cut off; then a shrink to the ranks still reachable
        and a checked all_reduce on them (ranks on both sides of the cut do the same)."""
        r, n = tw.get_rank(), tw.get_world_size()
        data = np.arange(4 << 20, dtype=np.float64)  # 32 MiB
        if r == 0:
            tw.send(data, dst=n - 1)
        elif r == n - 1:
            time.sleep(late)
            got = np.empty_like(data)
            tw.recv(got, src=0)
            assert np.array_equal(got, data), "32 MiB read late"
        x = np.ones(1 << 12)
        tw.all_reduce(x)
        try:
            tw.barrier()  # rank 0 may leave it, and the cut come, while others are still in it
            if r == 0:
                say("READY")
            while True:
                tw.all_reduce(x)
        except tw.TensorwireError as e:
            say(f"FAILED rank {r} at {time.time():.3f} {type(e).__name__}: {e}")
        new = tw.shrink()
        y = np.full(1000, r + 1.0)
        new.all_reduce(y)
        assert np.all(y == sum(w + 1.0 for w in new.ranks)), ("all_reduce after shrink", y[:4])
        say(f"SHRUNK rank {r} at {time.time():.3f} to {new.ranks}: all_reduce ok")

    mode = sys.argv[1]
    tw.init()
    if mode == "collectives":
        collectives()
    elif mode == "shaped":
        collectives()
        bandwidth()
    elif mode == "latency":
        collectives()
        latency()
    elif mode == "cut":
        cut(float(sys.argv[2]))
    elif mode == "last-call-in-an-outage":
        last_call_in_an_outage()
    elif mode == "loop":
        loop(float(sys.argv[2]))
    elif mode == "sysctl":
        for key in sys.argv[2:]:
            with open("/proc/sys/" + key.replace(".", "/")) as f:
                say(f"SYSCTL rank {tw.get_rank()} {key}={f.read().strip()}")
        tw.barrier()
    elif mode == "links":
        from tensorwire.tuning import tuner
        table = tuner.table_for(tw.world().runtime)
        tcp = table.link("tcp")
        say(f"LINKS rank {tw.get_rank()} busy_ring {table.sources.get('busy_ring')} "
            f"tcp {1e-9 / tcp.beta:.4f} GB/s checked {table.extra.get('checked')!r}")
        tw.barrier()
    elif mode == "fail":
        if tw.get_rank() == 1:
            sys.exit(7)
        tw.barrier()
    elif mode == "early-leave":
        r, n = tw.get_rank(), tw.get_world_size()
        if r == n - 1:
            time.sleep(1.0)   # the last rank is late to the gather
        x = np.full(4, float(r))
        out = [np.empty(4) for _ in range(n)] if r == 0 else None
        tw.gather(x, out, dst=0)  # rank 1's part is done once its block is sent...
        if r == 0:
            assert [float(o[0]) for o in out] == list(range(n))
            say("GATHER OK")
        tw.destroy()              # ...so it leaves at once: the others must still finish
        sys.exit(0)
    finish()
''')


@dataclass
class BedResult:
    code: int
    out: str
    pid: int
    elapsed: float

    def lines(self, pattern: str) -> list[re.Match[str]]:
        rx = re.compile(pattern)
        return [m for m in (rx.search(line) for line in self.out.splitlines()) if m]


def _namespaces() -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _assert_cleaned(pid: int) -> None:
    left = [ns for ns in _namespaces() if ns.startswith(f"twtb-{pid}-")]
    assert not left, f"the testbed (pid {pid}) left namespaces behind: {left}"


def _command(args: list[str], job: list[str]) -> list[str]:
    return [sys.executable, str(SCRIPT), *args, "--", *job]


def _stop(proc: subprocess.Popen[str]) -> str:
    """SIGTERM the testbed (it forwards it to every host and cleans up); its remaining output."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=25)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out or ""


def run_bed(args: list[str], job: list[str], timeout: float = 60.0) -> BedResult:
    """Run the testbed to completion; always checks that it cleaned up after itself."""
    env = dict(os.environ, TENSORWIRE_TIMEOUT=os.environ.get("TENSORWIRE_TIMEOUT", "30"))
    t0 = time.monotonic()
    proc = subprocess.Popen(_command(args, job), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = _stop(proc)
        _assert_cleaned(proc.pid)
        pytest.fail(f"testbed did not finish within {timeout:g} s:\n{out}")
    except BaseException:  # e.g. pytest-timeout or Ctrl-C: never leave a testbed running
        _stop(proc)
        raise
    result = BedResult(proc.returncode, out, proc.pid, time.monotonic() - t0)
    _assert_cleaned(proc.pid)
    assert "cleaned up: namespaces" in out, out
    return result


@pytest.fixture(scope="module")
def support() -> dict[str, object]:
    if not sys.platform.startswith("linux"):
        pytest.skip("network namespaces are Linux only")
    try:
        done = subprocess.run([sys.executable, str(SCRIPT), "--check-support", "--json"],
                              capture_output=True, text=True, timeout=60)
        info = json.loads(done.stdout)
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot probe for network namespaces: {exc}")
    if not info.get("netns"):
        pytest.skip(f"cannot build network namespaces here (needs root, iproute2, unshare): {info['reason']}")
    return info


@pytest.fixture
def job(tmp_path: Path) -> str:
    path = tmp_path / "multihost_job.py"
    path.write_text(JOB)
    return str(path)


def _check_collectives(res: BedResult, hosts: int, nproc: int, tcp: bool = False) -> None:
    assert res.code == 0, res.out
    world = hosts * nproc
    ok = {int(m.group(1)): m.group(3) for m in res.lines(r"COLLECTIVES OK rank (\d+)/(\d+) host (\S+)")}
    assert sorted(ok) == list(range(world)), res.out
    for r, host in ok.items():
        assert host == f"twhost-{r // nproc}", f"rank {r} ran on {host}"
    # Every rank advertised its host's testbed address, never loopback.
    adv = {int(m.group(1)): m.group(2)
           for m in res.lines(r"rank (\d+)/\d+ from \S+, store \S+, advertising ([^,\s]+)")}
    assert sorted(adv) == list(range(world)), res.out
    for r, addr in adv.items():
        assert addr == f"10.77.0.{r // nproc + 1}", f"rank {r} advertised {addr}"
    # Shared memory exactly within a host (unless TCP is forced), TCP across hosts.
    for m in res.lines(r"rank (\d+) wired: shm peers \[([\d, ]*)\], tcp peers \[([\d, ]*)\]"):
        r = int(m.group(1))
        shm = {int(v) for v in m.group(2).replace(",", " ").split()}
        tcp_peers = {int(v) for v in m.group(3).replace(",", " ").split()}
        same = {r // nproc * nproc + j for j in range(nproc)} - {r}
        assert shm == (set() if tcp else same), m.group(0)
        assert tcp_peers == set(range(world)) - {r} - shm, m.group(0)
    assert len(res.lines(r"transport ok: rank \d+")) == world, res.out
    assert "transport check FAILED" not in res.out
    # The emulated hosts share this machine's cores: every rank counts all of them, so that
    # ranks outnumbering the cores yield instead of spinning, as on one host.
    machine = {int(m.group(1)): int(m.group(2))
               for m in res.lines(r"rank (\d+): (\d+) rank\(s\) on this machine")}
    assert machine == {r: world for r in range(world)}, res.out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("hosts,nproc", [(2, 1), (2, 2), (3, 1), (3, 2)])
def test_collectives_across_hosts(support: dict, job: str, hosts: int, nproc: int) -> None:
    res = run_bed(["--hosts", str(hosts), "-n", str(nproc), "--check-transport"], [job, "collectives"])
    _check_collectives(res, hosts, nproc)


TOPOLOGY_JOB = str(ROOT / "tests" / "topology_job.py")


def _job_ok(res: BedResult, world: int) -> int:
    """Every rank finished the topology job with the same number of checked cases; that number."""
    assert res.code == 0, res.out
    done = {int(m.group(1)): int(m.group(2)) for m in res.lines(r"JOB OK rank (\d+) cases (\d+)")}
    assert sorted(done) == list(range(world)) and len(set(done.values())) == 1, res.out
    return done[0]


@pytest.mark.timeout(240)
def test_every_collective_op_and_dtype_block_and_cyclic(support: dict) -> None:
    """2 hosts x 3 ranks, numbered by blocks (the world) and cyclically (rank r on host r mod
    2): what the topology says, then every eligible algorithm of every collective forced (flat
    ones in the topology's order, hierarchical ones over host groups and rails), every (op,
    dtype) pair of the reductions, every dtype moved, a pipelined all_reduce; against numpy."""
    res = run_bed(["--hosts", "2", "-n", "3"], [TOPOLOGY_JOB, "topology", "matrix"], timeout=220)
    assert len(res.lines(r"TOPOLOGY OK rank \d+")) == 6, res.out
    assert _job_ok(res, 6) > 1500, res.out


@pytest.mark.timeout(180)
def test_every_algorithm_in_topology_order_on_three_hosts(support: dict) -> None:
    """3 hosts x 2 ranks: rails of three, recursive patterns folding a non-power of two."""
    res = run_bed(["--hosts", "3", "-n", "2"], [TOPOLOGY_JOB, "topology", "algos"], timeout=160)
    assert _job_ok(res, 6) > 150, res.out


@pytest.mark.timeout(90)
def test_groups_with_uneven_hosts_run_hierarchically(support: dict) -> None:
    """2 hosts x 3 ranks, groups of 3 + 1 and (numbered out of order) 3 + 2 ranks: the
    hierarchical all_reduces, broadcast, reduce and barrier are eligible, all_gather's and
    reduce_scatter's are not, and every eligible algorithm, every root, the hierarchical
    reductions for every (op, dtype) pair and a pipelined all_reduce agree with numpy."""
    res = run_bed(["--hosts", "2", "-n", "3"], [TOPOLOGY_JOB, "uneven"], timeout=80)
    assert res.code == 0, res.out
    done = {int(m.group(1)): int(m.group(2)) for m in res.lines(r"JOB OK rank (\d+) cases (\d+)")}
    assert sorted(done) == list(range(6)) and min(done.values()) > 250, res.out


@pytest.mark.timeout(90)
def test_hierarchical_mismatch_fails_every_rank_naming_the_call(support: dict) -> None:
    res = run_bed(["--hosts", "2", "-n", "2", "--timeout", "30"], [TOPOLOGY_JOB, "mismatch"])
    _job_ok(res, 4)
    assert len(res.lines(r"MISMATCH OK rank \d+ (count|algorithm|op|compress)")) == 16, res.out
    for found in res.lines(r"MISMATCH OK rank \d+ (?:op|compress): (.*)"):  # the phases tell their caller's
        said = found.group(1)
        assert "phase of differs" in said or "that call differs" in said or (  # or the call itself does
            "(hierarchical)" not in said and re.search(r"op (SUM vs AVG|AVG vs SUM)|compress=", said)), said


def test_one_ranks_refusal_of_a_hierarchical_call_leaves_the_group_usable(support: dict) -> None:
    res = run_bed(["--hosts", "2", "-n", "2", "--timeout", "30"], [TOPOLOGY_JOB, "refusal"])
    _job_ok(res, 4)
    assert len(res.lines(r"REFUSAL OK rank \d+")) == 4, res.out


@pytest.mark.timeout(90)
def test_compressed_all_reduce_across_hosts(support: dict) -> None:
    """compress= bf16 and fp16 of float32 and float64, SUM and AVG, on 2 hosts x 2 ranks and
    on groups of one rank per host and of hosts holding 2 and 1: every element within the
    documented bound, every rank's result the same bits (tests/compress_job.py); and the
    TUNING log says the compressed path ran."""
    env = ["TENSORWIRE_CALIBRATE=0", "TENSORWIRE_DEBUG=INFO", "TENSORWIRE_DEBUG_SUBSYS=TUNING"]
    res = run_bed(["--hosts", "2", "-n", "2", *(a for e in env for a in ("--env", e))],
                  [str(ROOT / "tests" / "compress_job.py")], timeout=80)
    assert res.code == 0, res.out
    done = {int(m.group(1)): int(m.group(2)) for m in res.lines(r"COMPRESS OK rank (\d+) cases (\d+)")}
    assert done == {0: 25, 1: 17, 2: 25, 3: 9}, res.out
    chose = res.lines(r"all_reduce \d+ B compress=(bf16|fp16) on (\d) ranks of group \S+ over 2 hosts: "
                      r"compressed [^,]+, exact \S+ [^-]+ -> compressed")
    assert {m.groups() for m in chose} == {(c, w) for c in ("bf16", "fp16") for w in "234"}, res.out


@pytest.mark.timeout(90)
def test_topo_command_across_hosts(support: dict) -> None:
    """`tensorwire topo` as the job: rank 0 prints the hosts, their ranks and interfaces, and
    the orders; TENSORWIRE_DEBUG_SUBSYS=GRAPH logs the world group's layout on every rank."""
    res = run_bed(["--hosts", "2", "-n", "2", "--env", "TENSORWIRE_DEBUG=INFO", "--env",
                   "TENSORWIRE_DEBUG_SUBSYS=GRAPH"], ["-m", "tensorwire", "topo"])
    assert res.code == 0, res.out
    for want in (r"\[twhost-0\] 4 rank\(s\) on 2 host\(s\), 1 machine\(s\)",
                 r"host 0: twhost-0 \(machine \w+\), ranks 0-1",
                 r"host 1: twhost-1 \(machine \w+\), ranks 2-3",
                 r"rank 3 +pid \d+ +cores [\d,-]+ +numa \S+ +eth0 10\.77\.0\.2",
                 r"pairs by tier: (numa|host) 2, net 4",
                 r"ring order: 0 1 2 3", r"tree order from rank 0: 0 1 2 3",
                 r"hierarchy: 2 hosts x 2 ranks; rails \[0 2\] \[1 3\]"):
        assert res.lines(want), (want, res.out)
    graph = res.lines(r"tensorwire\.GRAPH\] group world: 4 ranks on 2 hosts \[0 1\] \[2 3\]; ring 0 1 2 3")
    assert len(graph) == 4, res.out


@pytest.mark.timeout(90)
def test_forced_tcp_and_socket_ifname(support: dict, job: str) -> None:
    """--tcp: TCP within a host too; TENSORWIRE_SOCKET_IFNAME=eth0 picks the testbed address."""
    res = run_bed(["--hosts", "2", "-n", "2", "--tcp", "--check-transport",
                   "--env", "TENSORWIRE_SOCKET_IFNAME=eth0"], [job, "collectives"])
    _check_collectives(res, 2, 2, tcp=True)


@pytest.mark.timeout(90)
def test_master_addr_by_name(support: dict, job: str) -> None:
    """Every host's /etc/hosts names all hosts: --master-addr twhost-0 works like the address."""
    res = run_bed(["--hosts", "2", "-n", "2", "--master-by-name", "--check-transport"], [job, "collectives"])
    _check_collectives(res, 2, 2)
    assert "store tcp://twhost-0:29500" in res.out, res.out


@pytest.mark.timeout(90)
def test_master_hostname_mapped_to_loopback_on_its_own_host(support: dict, job: str) -> None:
    res = run_bed(["--hosts", "2", "-n", "1", "--master-by-name", "--loopback-hostname", "--timeout", "5",
                   "--job-timeout", "40", "--check-transport"], [job, "collectives"])
    _check_collectives(res, 2, 1)


@pytest.mark.timeout(90)
def test_rate_limited_links(support: dict, job: str) -> None:
    if not support.get("tbf"):
        pytest.skip(f"no tbf qdisc here: {support.get('tbf_reason')}")
    res = run_bed(["--hosts", "2", "-n", "1", "--rate", "100mbit", "--check-transport"], [job, "shaped"])
    _check_collectives(res, 2, 1)
    # 4 MiB through a 100 Mbit/s link takes >= 0.33 s (an unshaped veth: a few ms).
    times = [float(m.group(1)) for m in res.lines(r"BROADCAST rank \d+ \d+ bytes ([\d.]+) s")]
    assert len(times) == 2, res.out
    assert min(times) > 0.25, f"4 MiB crossed a 100mbit link in {min(times):.3f} s: not shaped?\n{res.out}"
    sent = [int(m.group(1))
            for m in res.lines(r"twhost-0 \(10\.77\.0\.1\): exit code 0; tc sent (\d+) bytes")]
    assert sent and sent[0] > 4 << 20, res.out


@pytest.mark.timeout(120)
def test_a_cache_from_faster_links_is_measured_again(support: dict, job: str, tmp_path) -> None:
    """Emulated hosts keep their names whatever their links: an entry cached over unshaped links
    prices a 100 Mbit/s bed's TCP 100x too cheap. Its busy ring, now that much slower across
    hosts, sends the next job to measure again (on one host a slower ring keeps the entry: the
    host may be busy this instant)."""
    if not support.get("tbf"):
        pytest.skip(f"no tbf qdisc here: {support.get('tbf_reason')}")
    cache = ["--env", f"TENSORWIRE_CACHE_DIR={tmp_path}"]
    fast = run_bed(["--hosts", "2", "-n", "1", *cache], [job, "links"])
    assert fast.code == 0 and len(fast.lines(r"LINKS rank \d+ busy_ring calibrated")) == 2, fast.out
    # Where other processes took cores during its probe, the entry is untrusted and the next job
    # re-probes without reading it, so without a check and its reason: mark it trusted, as one
    # measured on a quiet machine would be (its constants stay those of the unshaped links).
    [path] = tmp_path.glob("links-*.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), "trusted": True}))
    slow = run_bed(["--hosts", "2", "-n", "1", "--rate", "100mbit", *cache], [job, "links"])
    assert slow.code == 0, slow.out
    found = slow.lines(r"LINKS rank \d+ busy_ring (\S+) tcp ([\d.]+) GB/s checked '(.*)'")
    assert len(found) == 2, slow.out
    assert all(m.group(1) == "calibrated" and "busy_ring β" in m.group(3) for m in found), slow.out
    assert all(float(m.group(2)) < 0.05 for m in found), slow.out  # 100 Mbit/s: 0.0125 GB/s


@pytest.mark.timeout(90)
def test_the_probe_over_a_slow_link_fits_the_timeout(support: dict, job: str, tmp_path) -> None:
    """Init's probe sized its busy rounds for fast links (2 MiB a round from every rank): 2 hosts
    x 2 ranks over 20 Mbit/s links took 57 s to start, past a 30 s TENSORWIRE_TIMEOUT (every
    rank: 'calibration probe ... timed out'). The rounds are cut to the links the pairs measured."""
    if not support.get("tbf"):
        pytest.skip(f"no tbf qdisc here: {support.get('tbf_reason')}")
    cache = ["--env", f"TENSORWIRE_CACHE_DIR={tmp_path}"]
    res = run_bed(["--hosts", "2", "-n", "2", "--rate", "20mbit", *cache], [job, "links"], timeout=80)
    assert res.code == 0, res.out
    found = res.lines(r"LINKS rank \d+ busy_ring calibrated tcp ([\d.]+) GB/s")
    assert len(found) == 4 and all(float(m.group(1)) < 0.005 for m in found), res.out  # 20 Mbit/s: 0.0025


@pytest.mark.timeout(90)
def test_sysctls_set_in_every_host_and_nowhere_else(support: dict, job: str) -> None:
    """--sysctl sets a net.* setting in each host's own network stack; this machine's stays."""
    key = "net.ipv4.tcp_slow_start_after_idle"
    path = Path("/proc/sys/net/ipv4/tcp_slow_start_after_idle")
    before = path.read_text().strip()
    wanted = "0" if before != "0" else "1"
    res = run_bed(["--hosts", "2", "--sysctl", f"{key}={wanted}"], [job, "sysctl", key])
    assert res.code == 0, res.out
    seen = {int(m.group(1)): m.group(2) for m in res.lines(rf"SYSCTL rank (\d+) {key}=(\S+)")}
    assert seen == {0: wanted, 1: wanted}, res.out
    assert path.read_text().strip() == before


@pytest.mark.timeout(90)
def test_delayed_links(support: dict, job: str) -> None:
    if not support.get("netem"):
        pytest.skip(f"this kernel has no netem qdisc, so --delay cannot be emulated: "
                    f"{support.get('netem_reason')}")
    res = run_bed(["--hosts", "2", "-n", "1", "--rate", "100mbit", "--delay", "1ms", "--check-transport"],
                  [job, "latency"])
    _check_collectives(res, 2, 1)
    medians = [float(m.group(1)) for m in res.lines(r"LATENCY rank \d+ median ([\d.]+) s")]
    assert len(medians) == 2, res.out
    # 2 ranks: one exchange, 1 ms each way.
    assert min(medians) >= 0.0009, f"all_reduce took {min(medians) * 1e3:.3f} ms over a 1 ms link\n{res.out}"


@pytest.mark.timeout(90)
def test_host_crash_fails_the_others_with_peer_lost(support: dict, job: str) -> None:
    """Host 1 dies (launcher and ranks SIGKILLed mid-job): the other hosts' ranks raise
    PeerLostError naming a rank within seconds, and the testbed still cleans up."""
    res = run_bed(["--hosts", "3", "-n", "1", "--kill-host", "1", "--kill-when", "^READY$"],
                  [job, "loop", "40"])
    assert res.code != 0, res.out
    injected = res.lines(r"fault injection at t=[\d.]+ s \(wall ([\d.]+)\): twhost-1: host crash")
    assert injected, res.out
    t_kill = float(injected[0].group(1))
    failed = {}
    for line in res.out.splitlines():
        m = re.match(r"\[(twhost-\d)\] FAILED rank (\d+) at ([\d.]+) (\w+): (.*)", line)
        if m:
            failed[m.group(1)] = (float(m.group(3)), m.group(4), m.group(5))
    assert set(failed) == {"twhost-0", "twhost-2"}, res.out
    for host, (when, kind, message) in failed.items():
        assert kind == "PeerLostError", f"{host}: {kind}: {message}"
        assert re.search(r"lost rank \d+", message), f"{host}: {message}"
        assert when - t_kill < 15, f"{host} noticed the crash only after {when - t_kill:.1f} s"
    assert "twhost-1 (10.77.0.2): killed by SIGKILL" in res.out, res.out
    assert res.elapsed < 60, res.out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["link", "address"])
def test_host_cut_off_silently_is_lost_in_the_peer_timeout_and_shrunk_away(support: dict, job: str,
                                                                            mode: str) -> None:
    """TENSORWIRE_PEER_TIMEOUT is 2 s here (the calls' timeout 30 s). First a live rank that
    reads 32 MiB sent to it 3 s late is not lost (its sender waits on a closed receive window,
    whose probes the reader's kernel answers). Then host 1's link goes down mid-job, or its
    address goes (a failed NIC): no reset ever reaches anyone. Within the peer timeout every
    rank raises PeerLostError naming a rank of the other host, never one of its own (host 1's
    ranks dialed each other over loopback, not the address that went), shrinks the world to
    the ranks of its own host, and an all_reduce there is right."""
    peer_timeout = 2.0
    res = run_bed(["--hosts", "2", "-n", "2", "--kill-host", "1", "--kill-mode", mode, "--kill-when",
                   "^READY$", "--env", f"TENSORWIRE_PEER_TIMEOUT={peer_timeout:g}"], [job, "cut", "3"],
                  timeout=80)
    injected = res.lines(r"fault injection at t=[\d.]+ s \(wall ([\d.]+)\): twhost-1: (link down|address)")
    assert injected, res.out
    t_cut = float(injected[0].group(1))
    failed = {int(m.group(1)): (float(m.group(2)), m.group(3), m.group(4))
              for m in res.lines(r"FAILED rank (\d+) at ([\d.]+) (\w+): (.*)")}
    shrunk = {int(m.group(1)): (float(m.group(2)), m.group(3))
              for m in res.lines(r"SHRUNK rank (\d+) at ([\d.]+) to (\[[\d, ]*\]): all_reduce ok")}
    assert sorted(failed) == sorted(shrunk) == [0, 1, 2, 3], res.out
    for r, (when, kind, message) in failed.items():
        other = {2, 3} if r < 2 else {0, 1}
        assert kind == "PeerLostError", f"rank {r}: {kind}: {message}"
        named = {int(w) for w in re.findall(r"lost rank (\d+)", message)}
        assert named and named <= other, f"rank {r}: {message}"
        if "stopped answering" in message:  # the host's other rank named with it (it was not)
            mates = re.search(r"its host \([\d.]+, with rank\(s\) ([\d, ]+)\)", message)
            with_it = {int(w) for w in mates.group(1).split(", ")} if mates else set()
            assert named | with_it == other, f"rank {r}: {message}"
        # a loaded machine may add a few seconds; the calls' own timeout (30 s) would be far later
        assert when - t_cut < peer_timeout + 7, f"rank {r} noticed the cut only after {when - t_cut:.1f} s"
    for r, (when, ranks) in shrunk.items():
        assert ranks == ("[0, 1]" if r < 2 else "[2, 3]"), f"rank {r} shrunk to {ranks}"
        assert when - t_cut < 2 * peer_timeout + 10, f"rank {r} shrunk only after {when - t_cut:.1f} s"
    assert res.code == 0, res.out


@pytest.mark.timeout(90)
def test_an_outage_shorter_than_the_peer_timeout_is_lived_through(support: dict, job: str) -> None:
    """Host 1's link is down 2.5 s of a 4 s TENSORWIRE_PEER_TIMEOUT while all_reduces have
    data in flight: every rank goes on. TCP's backoff had the next retransmission seconds after
    the link's return, past the timeout, and the host was taken for lost (a tester: 9 s of
    10 failed 3 runs of 3); tensorwire's connections retransmit at least every second where the
    kernel allows (Linux 6.15's TCP_RTO_MAX_MS)."""
    probe = socket.socket()
    try:
        probe.setsockopt(socket.IPPROTO_TCP, 44, 1000)  # TCP_RTO_MAX_MS
    except OSError:
        pytest.skip("this kernel has no TCP_RTO_MAX_MS: an outage is lived through as its backoff allows")
    finally:
        probe.close()
    bed = ["--hosts", "2", "-n", "1", "--kill-host", "1", "--kill-mode", "link", "--kill-when", "^READY$",
           "--restore-after", "2.5", "--env", "TENSORWIRE_PEER_TIMEOUT=4"]
    res = run_bed(bed, [job, "loop", "10"], timeout=80)
    assert res.lines(r"twhost-1: link up again"), res.out
    assert len(res.lines(r"SURVIVED rank \d")) == 2 and res.code == 0, res.out


@pytest.mark.timeout(90)
def test_an_outage_during_init_shorter_than_the_peer_timeout_is_lived_through(support: dict,
                                                                              job: str) -> None:
    """Host 1's link goes down for 4 s as the ranks have their addresses and dial each other: a
    dial answered 'no route to host' is tried again until TENSORWIRE_PEER_TIMEOUT (10 s) has
    passed since the first, and the job goes on. Before, init raised PeerLostError ('its host
    does not answer') at the first such answer, ~3 s in (a tester: 3 runs of 3)."""
    bed = ["--hosts", "2", "-n", "2", "--kill-host", "1", "--kill-mode", "link",
           "--kill-when", "gathered 4 cards", "--restore-after", "4",
           "--env", "TENSORWIRE_DEBUG=INFO", "--env", "TENSORWIRE_DEBUG_SUBSYS=INIT"]
    res = run_bed(bed, [job, "loop", "1"], timeout=80)
    assert res.lines(r"twhost-1: link up again"), res.out
    assert len(res.lines(r"SURVIVED rank \d")) == 4 and res.code == 0, res.out


@pytest.mark.timeout(90)
def test_a_last_call_made_in_an_outage_reaches_every_rank(support: dict, job: str) -> None:
    """Host 3's link is down 4 s (of a 10 s peer timeout) while the job makes its last calls,
    then every rank leaves: a rank that finished first closed while its message to host 3 waited
    for the link, and the reset of that close threw it away: 'lost rank 2: Connection reset by
    peer' (a tester, 4 runs of 8; 3 of 5 here before close() waited for its peers' kernels)."""
    bed = ["--hosts", "4", "-n", "1", "--kill-host", "3", "--kill-mode", "link", "--kill-when", "^READY$",
           "--restore-after", "4"]
    res = run_bed(bed, [job, "last-call-in-an-outage"], timeout=80)
    assert res.lines(r"twhost-3: link up again"), res.out
    assert len(res.lines(r"SURVIVED rank \d")) == 4 and res.code == 0, res.out


def test_the_retransmission_cap_leaves_the_verdict_to_tensorwire() -> None:
    """The kernel gives up on a connection after tcp_retries2 retransmissions whose timeout
    doubles up to the cap: the cap must leave that later than TENSORWIRE_PEER_TIMEOUT and the
    two looks after it, or a longer outage than the cap's floor would end connections first."""
    from tensorwire.transport import tcp

    if tcp._proc_text("tcp_retries2") == "15":  # the default: 14.4 s of kernel patience at 1 s
        assert tcp._rto_max_ms(10.0) == 1000
    caps = [tcp._rto_max_ms(float(t)) for t in (1, 4, 10, 20, 60, 300)]
    assert caps == sorted(caps) and caps[-1] > 10_000, caps


@pytest.mark.timeout(90)
def test_launcher_killed_alone_fails_the_job(support: dict, job: str) -> None:
    res = run_bed(["--hosts", "2", "-n", "1", "--kill-host", "1", "--kill-mode", "launcher",
                   "--kill-when", "^READY$", "--job-timeout", "40"], [job, "loop", "4"])
    assert "SURVIVED rank 1" not in res.out, res.out
    assert res.lines(r"\[twhost-0\] FAILED rank 0 at [\d.]+ PeerLostError"), res.out


@pytest.mark.timeout(90)
def test_failing_rank_gives_worst_exit_code_and_cleans_up(support: dict, job: str) -> None:
    res = run_bed(["--hosts", "2", "-n", "1", "--grace", "2"], [job, "fail"])
    assert res.code == 7, res.out
    assert "twhost-1 (10.77.0.2): exit code 7" in res.out, res.out


@pytest.mark.timeout(90)
def test_job_timeout_terminates_every_host(support: dict, job: str) -> None:
    res = run_bed(["--hosts", "2", "-n", "1", "--job-timeout", "4"], [job, "loop", "60"])
    assert res.code == 124, res.out
    assert res.elapsed < 30, res.out


def _start_until_ready(job: str) -> tuple[subprocess.Popen[str], list[str]]:
    """A 2-host x 2-rank testbed running a long job, returned once rank 0 printed READY."""
    proc = subprocess.Popen(_command(["--hosts", "2", "-n", "2"], [job, "loop", "60"]), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 45
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == "[twhost-0] READY" or time.monotonic() > deadline:
                break
        assert any(line.strip() == "[twhost-0] READY" for line in lines), "".join(lines)
        mine = [ns for ns in _namespaces() if ns.startswith(f"twtb-{proc.pid}-")]
        assert len(mine) == 3, f"expected a bridge and 2 host namespaces while running, got {mine}"
    except BaseException:
        _stop(proc)
        raise
    return proc, lines


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_cleans_up(support: dict, job: str, sig: signal.Signals) -> None:
    """Ctrl-C (or a kill) of the testbed mid-job: hosts are stopped, namespaces removed."""
    proc, lines = _start_until_ready(job)
    try:
        t0 = time.monotonic()
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
        lines.append(out)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            _stop(proc)
    text = "".join(lines)
    assert proc.returncode == 128 + sig, text
    assert took < 15, f"took {took:.1f} s to stop\n{text}"
    _assert_cleaned(proc.pid)


def _processes_in(ns: str) -> list[str]:
    done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20)
    return done.stdout.split()


@pytest.mark.timeout(90)
def test_sigkilled_testbed_stops_its_hosts_and_cleanup_removes_the_rest(support: dict, job: str) -> None:
    """SIGKILL cannot be caught: the launchers still get SIGTERM (parent-death signal) and stop
    their ranks; the namespaces stay until `--cleanup`, which finds them by their dead pid."""
    proc, _ = _start_until_ready(job)
    prefix = f"twtb-{proc.pid}-"
    try:
        proc.kill()
        proc.communicate(timeout=20)
        mine = [ns for ns in _namespaces() if ns.startswith(prefix)]
        assert len(mine) == 3, mine
        deadline = time.monotonic() + 20
        while any(_processes_in(ns) for ns in mine) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_processes_in(ns) for ns in mine), "hosts kept running after the testbed died"
        done = subprocess.run([sys.executable, str(SCRIPT), "--cleanup"], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        _assert_cleaned(proc.pid)
        etc = os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []
        assert not [d for d in etc if d.startswith(prefix)], etc
    finally:
        for ns in _namespaces():
            if ns.startswith(prefix):
                for pid in _processes_in(ns):
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
                subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=20)


@pytest.mark.timeout(90)
def test_cleanup_removes_only_dead_testbeds(support: dict) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale, live = f"twtb-{dead.pid}-h0", f"twtb-{os.getpid()}-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=20)
    try:
        subprocess.run(["ip", "netns", "add", live], check=True, timeout=20)
        done = subprocess.run([sys.executable, str(SCRIPT), "--cleanup"], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        names = _namespaces()
        assert stale not in names, done.stderr
        assert live in names, done.stderr  # its owner (this process) still runs
    finally:
        for ns in (stale, live):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=20)


@pytest.mark.timeout(60)
def test_usage_errors() -> None:
    """Bad options are refused before anything is built (no root needed)."""
    for args in (["--hosts", "0"], ["--kill-host", "1"], ["--rate", "fast"], [],
                 ["--sysctl", "kernel.pid_max=99999"], ["--sysctl", "net.ipv4.tcp_slow_start_after_idle"]):
        done = subprocess.run([sys.executable, str(SCRIPT), *args, *(["--", "x.py"] if args else [])],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, (args, done.stderr)
        assert "error:" in done.stderr, (args, done.stderr)


@pytest.mark.timeout(90)
def test_leaving_after_own_part_is_done(support: dict, job: str) -> None:
    res = run_bed(["--hosts", "3", "-n", "1"], [job, "early-leave"])
    assert "GATHER OK" in res.out and res.code == 0, res.out
