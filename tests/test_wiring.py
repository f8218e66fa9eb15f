"""Wiring on demand (transport/wiring.py, connect.py): pairs connect on first use, from either
side or both at once; a peer nobody talked to that died fails whoever needs it within
seconds; what a rank holds grows with the peers it talks to, and its bootstrap costs a fixed
number of store requests; several TCP streams per pair (TENSORWIRE_NSOCKS) carry every
collective right. Real processes, sockets and shared memory throughout."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_collectives import _expect, _Log, _pattern, rank_large

import tensorwire as tw
from cluster import Cluster
from tensorwire import auth, limits
from tensorwire.config import Config
from tensorwire.transport.engine import Engine
from tensorwire.transport.shm_segments import Ring
from tensorwire.transport.wiring import Wiring

ROOT = Path(__file__).resolve().parent.parent


def _launch(tmp_path: Path, code: str, n: int, env: dict[str, str] | None = None,
            timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], dict[int, list[dict]]]:
    """`tensorwire run -n N` of a job whose ranks print JSON lines prefixed with @@; (the
    launcher's result, each rank's lines)."""
    script = tmp_path / "job.py"
    prelude = ("import json, os, sys, time\nimport numpy as np\nimport tensorwire as tw\n"
               "def report(**kw):\n    print('@@' + json.dumps(kw), flush=True)\n")
    script.write_text(prelude + textwrap.dedent(code))
    full = {**os.environ, "TENSORWIRE_CALIBRATE": "0", "TENSORWIRE_TIMEOUT": "60", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "tensorwire", "run", "-n", str(n), str(script)],
                          capture_output=True, text=True, timeout=timeout, env=full)
    lines: dict[int, list[dict]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("@@"):
            msg = json.loads(line[2:])
            lines.setdefault(msg["rank"], []).append(msg)
    return proc, lines


_ALL_AT_ONCE = """
world = tw.init()
r, n = world.rank, world.size
before = sorted(world.runtime.engine.channels)
# every rank sends to and receives from every other at once: most pairs are dialed from both sides
sends = [world.isend(np.full(1000, r * 100 + p, np.int32), p) for p in range(n) if p != r]
got = {}
for p in range(n):
    if p != r:
        got[p] = np.empty(1000, np.int32)
        world.recv(got[p], p)
for s in sends:
    s.wait()
ok = all((got[p] == p * 100 + r).all() for p in got)
engine = world.runtime.engine
links = {p: [c.sockets[0].getsockname()[1], c.sockets[0].getpeername()[1]]
         for p, c in engine.channels.items()}
held = sum(len(c.sockets) for c in engine.channels.values())
world.barrier()

def count_sockets():
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))

# a dial that lost the crossing is closed by the wiring thread as its answer arrives: wait for
# that a moment (a socket that stays is a leak)
deadline = time.monotonic() + 3.0
while (sockets := count_sockets()) > held + 2 and time.monotonic() < deadline:
    time.sleep(0.05)
report(rank=r, ok=bool(ok), before=before, links=links, sockets=sockets, held=held,
       kinds=sorted({c.kind for c in engine.channels.values()}))
tw.destroy()
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_both_sides_connect_at_once(tmp_path: Path, transport: str) -> None:
    """Every pair is dialed from both ends at the same moment: each ends with one connection
    (both ranks name the same two ports), the data arrives, and no socket is left over but the
    channels', the listener and the store's."""
    n = 6
    env = {"TENSORWIRE_TRANSPORT": "tcp" if transport == "tcp" else "auto"}
    proc, lines = _launch(tmp_path, _ALL_AT_ONCE, n, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r: msgs[-1] for r, msgs in lines.items()}
    assert sorted(results) == list(range(n)), proc.stderr[-3000:]
    assert any(len(res["before"]) < n - 1 for res in results.values())  # init did not connect everything
    for r, res in results.items():
        assert res["ok"], res
        assert res["kinds"] == [transport]
        assert sorted(int(p) for p in res["links"]) == [p for p in range(n) if p != r]
        for p, (mine, theirs) in res["links"].items():
            assert results[int(p)]["links"][str(r)] == [theirs, mine], (r, p)  # one connection per pair
        assert res["sockets"] == res["held"] + 2, res  # + the listener and the store client


_DIES_UNTOUCHED = """
world = tw.init()
r, n = world.rank, world.size
victim = n - 1
engine = world.runtime.engine
report(rank=r, phase="init", peers=sorted(engine.channels))  # before a rank ahead dials for the barrier
survivors = world.new_group(range(victim))  # to leave together: a rank that exits early is lost too
world.barrier()
if r == victim:
    time.sleep(0.3)  # let the others finish the barrier: a crash inside it would fail it
    os._exit(3)
time.sleep(1.5)  # the victim is gone before anyone calls anything
def attempt(fn, *a, **k):
    t0 = time.monotonic()
    try:
        fn(*a, **k)
    except tw.TensorwireError as exc:
        return {"type": type(exc).__name__, "msg": str(exc), "t": time.monotonic() - t0}
    return {"type": None, "t": time.monotonic() - t0}
if r == 0:  # a receive from it: the connection is refused (or its process is seen gone)
    p2p = attempt(world.recv, np.empty(4, np.float32), victim)
else:
    p2p = None
coll = attempt(world.all_reduce, np.ones(256, np.float32))
report(rank=r, phase="after", p2p=p2p, coll=coll)
survivors.barrier(timeout=30)
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_peer_nobody_talked_to_dies(tmp_path: Path, transport: str) -> None:
    """The last of 8 ranks dies before any rank but its init partners talked to it: rank 0 (not
    one of them) gets a PeerLostError naming it from a receive, and every survivor from the next
    all_reduce on the world, within seconds (the timeout is 60 s): by its refused connection
    (TCP) or by its process gone (one host, the shared-memory path)."""
    n = 8
    env = {"TENSORWIRE_TRANSPORT": "tcp" if transport == "tcp" else "auto"}
    proc, lines = _launch(tmp_path, _DIES_UNTOUCHED, n, env)
    assert proc.returncode != 0
    init = {r: msgs[0] for r, msgs in lines.items()}
    after = {r: msgs[-1] for r, msgs in lines.items() if msgs[-1]["phase"] == "after"}
    assert sorted(after) == list(range(n - 1)), proc.stderr[-3000:]
    assert n - 1 not in init[0]["peers"]  # rank 0 never talked to the victim
    for r, res in after.items():
        for what in ("p2p", "coll") if r == 0 else ("coll",):
            out = res[what]
            assert out["type"] == "PeerLostError", (r, what, out)
            assert f"lost rank {n - 1}" in out["msg"] or f"rank {n - 1}" in out["msg"], out
            assert out["t"] < 10.0, (r, what, out)


def _scale_module() -> Any:
    spec = importlib.util.spec_from_file_location("wiring_scale", ROOT / "bench" / "wiring_scale.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.timeout(300)
def test_the_engine_says_which_pairs_are_being_wired() -> None:
    """What the probe waits on before its rounds (probes.wire_partners): a pair asked for and
    neither connected nor lost."""
    from tensorwire.transport.channel import PendingChannel
    from tensorwire.transport.engine import Engine

    engine = Engine(0, 3, 0)
    engine.add_channel(1, PendingChannel(1))
    assert engine.connecting(1) and not engine.connecting(2)  # rank 2: never asked for
    engine.lost[1] = "gone"
    assert not engine.connecting(1)


def test_what_a_rank_holds_grows_with_its_peers_not_the_job() -> None:
    """24 ranks on one host (on 2 cores), init, a barrier, a checked 1 MiB all_reduce and an
    exchange with the ring neighbours: every rank holds connections to the peers it talked to
    (the typical few, not 23), the descriptors those take and no more, one ring it writes per
    shared-memory connection, and its bootstrap cost at most 5 store requests (a fixed number:
    roster, card, cards), against a store this test hosts and counts."""
    n = 24
    job = _scale_module().measure(n, talk="neighbours", timeout=240)
    assert not any(job["codes"]), job["codes"]
    reports = job["reports"]
    most = limits.typical_peers(n) + 2
    for rep in reports:
        conns = sum(rep["channels"].values())
        assert rep["ok"], rep
        assert conns <= most < n - 1, rep
        # the channels', the listener, the store client, and at most one dial still being
        # resolved (two ranks that dialed each other at once: the loser is closed by its peer)
        assert rep["sockets"] <= conns + 3, rep
        assert rep["fds"] <= rep["sockets"] + 12, rep  # stdio, pipes, the wiring's eventfd and spare
        assert rep["ring_bytes"] <= rep["channels"].get("shm", 0) * Ring.nbytes(4 << 20), rep
    assert len(job["store"]) == n
    assert max(s["total"] for s in job["store"]) <= 5, job["store"]


@pytest.mark.timeout(300)
def test_running_out_of_descriptors_later_names_the_limit() -> None:
    """48 ranks under `ulimit -n 45`: init needs far fewer (the peers a rank typically talks
    to), but a message to every rank needs 47 connections. The ranks that run out say so,
    naming the limit, whether dialing or accepting (the dialer is told), and every rank ends
    with an error before its timeout (60 s) could end it: never a hang."""
    job = _scale_module().measure(48, ulimit=45, talk="all", timeout=200, env={"TENSORWIRE_TIMEOUT": "60"})
    reports = job["reports"]
    assert all(job["codes"]) and all(r.get("error") for r in reports), reports
    named = [r for r in reports if r["error"] == "ResourceError"]
    assert named and all("out of file descriptors (ulimit -n is 45" in r["msg"] for r in named), named
    assert all(r["error"] in ("ResourceError", "PeerLostError", "AbortedError") for r in reports), reports
    assert max(r.get("t", 0) for r in reports) < 60, reports  # none waited out the timeout


def rank_other_collectives() -> dict:
    """What rank_large leaves out, past the size messages are split over streams from."""
    g = tw.world()
    n, me = g.size, g.rank
    log = _Log()
    count = 200_003  # 800 KB of float32 per block
    blocks = [_pattern(count, r, np.float32) for r in range(n)]
    out = [np.empty(count, np.float32) for _ in range(n)]
    log.case()
    tw.all_gather(out, blocks[me])
    log.same("large all_gather (list)", np.stack(out), np.stack(blocks))
    gathered = [np.empty(count, np.float32) for _ in range(n)] if me == 1 else None
    log.case()
    tw.gather(blocks[me], gathered, dst=1)
    if me == 1:
        log.same("large gather", np.stack(gathered), np.stack(blocks))
    got = np.empty(count, np.float32)
    log.case()
    tw.scatter(got, [_pattern(count, 1000 + r, np.float32) for r in range(n)] if me == 0 else None, src=0)
    log.same("large scatter", got, _pattern(count, 1000 + me, np.float32))
    big = np.empty(3 << 20, np.uint8)
    sent = tw.isend(_pattern(3 << 20, me, np.uint8), (me + 1) % n, tag=9)
    log.case()
    tw.recv(big, (me - 1) % n, tag=9)
    sent.wait()
    log.same("large send/recv", big, _pattern(3 << 20, (me - 1) % n, np.uint8))
    log.case()
    tw.barrier()
    engine = g.runtime.engine
    log.extra["streams"] = sorted({len(c.sockets) for c in engine.channels.values()})
    return log.result()


@pytest.mark.timeout(300)
def test_every_collective_over_several_streams() -> None:
    """TENSORWIRE_NSOCKS=4 over TCP: every collective and point-to-point message past the split
    size checked bitwise against numpy (uneven sizes, parts arriving in any order, folding
    receives staging parts), every pair on 4 streams."""
    cluster = Cluster(3, {"TENSORWIRE_TRANSPORT": "tcp", "TENSORWIRE_NSOCKS": "4"})
    try:
        _expect(cluster.run(rank_large, timeout=200), 9)
        results = cluster.run(rank_other_collectives, timeout=200)
        _expect(results, 5)
        assert all(res["streams"] == [4] for res in results), results
    finally:
        cluster.close()


@pytest.mark.parametrize("peer_timeout", [1.0, 2.5, 10.0, 60.0])
def test_keepalive_lives_through_outages_shorter_than_the_peer_timeout(peer_timeout: float) -> None:
    """An idle connection's kernel gives up after KEEPCNT unanswered probes KEEPINTVL apart, the
    first at most KEEPIDLE into an outage: it lives through one shorter than
    TENSORWIRE_PEER_TIMEOUT (a connection idle before a 6.6 s cut was lost under the default
    10 s) and ends within two probe intervals more."""
    import socket

    from tensorwire.config import Config
    from tensorwire.transport.tcp import tune_socket

    with socket.socket() as sock:
        tune_socket(sock, Config(peer_timeout=peer_timeout))
        idle, interval, count = (sock.getsockopt(socket.IPPROTO_TCP, opt)
                                 for opt in (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT))
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert count * interval >= peer_timeout, (idle, interval, count)
        assert idle + count * interval <= math.ceil(peer_timeout) + 2 * interval, (idle, interval, count)
        assert interval == max(1, math.ceil(peer_timeout) // 5)


@pytest.mark.timeout(60)
def test_a_pair_on_one_host_connects_over_loopback_not_its_address() -> None:
    """Two ranks of one host that advertised a non-loopback address (127.0.0.2 stands in for
    a NIC's): their shared-memory pair's socket, which carries the aborts and goodbyes, goes
    through the loopback listener, so it outlives the host's address (a failed NIC would take
    a socket at the address with it: the peer was named lost instead of its abort heard). A
    peer in another network namespace, or on another host, is dialed at its address."""
    address, secret = "127.0.0.2", auth.Secret(b"s" * 32, "test")
    engines = [Engine(r, 2, 0) for r in (0, 1)]
    for engine in engines:
        engine.wiring = Wiring(engine, Config(), "job", secret, address, ("host", "machine"), 2)
    cards = {r: {"addr": address, "port": e.wiring.port, "loopback": e.wiring.loopback_port,
                 "netns": e.wiring.netns, "host": "host", "machine": "machine"}
             for r, e in enumerate(engines)}
    try:
        for engine in engines:
            engine.wiring.learn(cards)
            engine.wiring.start(8 << 20, 2)
        with engines[1].lock:
            engines[1].channel(0)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(
                getattr(e.channels.get(1 - r), "kind", "pending") != "pending"
                for r, e in enumerate(engines)):
            time.sleep(0.005)
        dialed = engines[1].channels[0]
        assert dialed.kind == "shm", dialed.kind
        assert dialed.sockets[0].getpeername() == ("127.0.0.1", engines[0].wiring.loopback_port)
        wiring = engines[1].wiring
        wiring.cards[0] = {**cards[0], "netns": "another"}
        assert wiring.address(0) == (address, engines[0].wiring.port)
        wiring.cards[0] = {**cards[0], "host": "another host"}
        assert wiring.address(0) == (address, engines[0].wiring.port)
    finally:
        for engine in engines:
            engine.close()
