"""Large TCP messages moved by pump threads (TENSORWIRE_SOCKET_THREADS) and split over several
streams (TENSORWIRE_NSOCKS): the same bits as the rank's own thread moving every byte, a rank
killed mid-stream is PeerLostError on the others within seconds, and destroy() leaves no thread."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cluster import Cluster, RankFailure
from tensorwire.errors import AbortedError
from tensorwire.transport.channel import PeerClosed
from tensorwire.transport.engine import Engine
from tensorwire.transport.pumps import PUMP_BYTES
from tensorwire.transport.requests import SendRequest
from tensorwire.transport.tcp import SPLIT_BYTES, SocketStream, TcpChannel, parts_of, split
from tensorwire.transport.wire import P2P_FINGERPRINT, Header, Kind

# (streams per pair, pump threads): the rank's thread alone; pumps on one stream (a send and a
# receive of one socket side by side, folds in a pump); pumps on three streams, fewer threads
# than parts (the rank's thread moves what no idle pump takes)
SETTINGS = [(1, 0), (1, 2), (3, 4)]
_MIB = 1 << 20


def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).view(np.uint8).tobytes())
    return h.hexdigest()


def _exercise() -> dict[str, Any]:
    """Every path a large TCP part takes: folding receives (all_reduce, reduce_scatter), plain
    receives into the destination (broadcast, all_gather, sendrecv), a message that arrives before
    its receive is posted, odd sizes (parts that end off a 64-byte boundary)."""
    import tensorwire as tw

    rank, size = tw.get_rank(), tw.get_world_size()
    out: dict[str, Any] = {}
    for count in (3 * _MIB // 4 + 3, 9 * _MIB // 4 + 1):  # 3 MiB and 9 MiB of float32, odd counts
        x = np.random.default_rng(rank).standard_normal(count).astype(np.float32)
        ref = sum(np.random.default_rng(r).standard_normal(count).astype(np.float32).astype(np.float64)
                  for r in range(size))
        y = x.copy()
        tw.all_reduce(y)
        assert np.allclose(y, ref, rtol=1e-5, atol=1e-4), f"all_reduce of {count} floats is wrong"
        z = np.empty_like(x)
        tw.all_reduce(x, out=z)
        assert np.array_equal(y, z), "out-of-place all_reduce differs from in-place"
        b = np.full(count, float(rank), np.float64)
        tw.broadcast(b, src=1)
        assert (b == 1.0).all()
        g = np.empty((size, count), np.float32)
        tw.all_gather_into_tensor(g, x)
        for r in range(size):
            assert np.array_equal(g[r], np.random.default_rng(r).standard_normal(count).astype(np.float32))
        rs = np.empty(2 * _MIB // 4 + 5, np.float32)
        tw.reduce_scatter_tensor(rs, np.tile(np.arange(len(rs), dtype=np.float32) + rank, size))
        assert np.array_equal(rs, size * np.arange(len(rs), dtype=np.float32) + sum(range(size)))
        out[f"all_reduce {count}"] = _digest(y)
    # a message that arrives whole before its receive is posted (kept, then copied)
    late = np.empty(5 * _MIB + 7, np.uint8)
    right, left = (rank + 1) % size, (rank - 1) % size
    work = tw.isend(np.full(len(late), rank, np.uint8), right)
    tw.barrier()
    time.sleep(0.2)
    tw.recv(late, left)
    work.wait()
    assert (late == left).all()
    out["pumps"] = [t.name for t in threading.enumerate() if t.name == "tensorwire-pump"]
    pumps = tw.world().runtime.engine.pumps
    out["threads"] = 0 if pumps is None else pumps.threads
    return out


@pytest.mark.timeout(240)
def test_results_identical_across_streams_and_threads() -> None:
    """Each setting runs the same calls on 3 ranks over TCP: every result checked, the reduced
    bits identical across settings, and where pumps are on they ran (their threads exist)."""
    digests = []
    for nsocks, threads in SETTINGS:
        cluster = Cluster(3, {"TENSORWIRE_TRANSPORT": "tcp", "TENSORWIRE_NSOCKS": str(nsocks),
                              "TENSORWIRE_SOCKET_THREADS": str(threads)})
        try:
            results = cluster.run(_exercise, timeout=150)
        finally:
            cluster.close()
        for res in results:
            assert res["threads"] == threads
            if threads:
                assert res["pumps"], f"{nsocks} stream(s), {threads} threads: no pump thread ever ran"
            else:
                assert not res["pumps"]
        digests.append({k: v for k, v in results[0].items() if k.startswith("all_reduce")})
        assert all({k: v for k, v in r.items() if k.startswith("all_reduce")} == digests[-1] for r in results)
    assert all(d == digests[0] for d in digests), digests


def test_messages_are_split_into_parts_a_pump_takes() -> None:
    """With pump threads a message goes over as many of a pair's streams as it has PUMP_BYTES, so
    every part of a split one is a pump's and a stream more never means fewer parts; without,
    over all of them from SPLIT_BYTES. The parts cover it in order from multiples of 64 bytes."""
    sizes = [0, 1, 63, 64, SPLIT_BYTES - 1, SPLIT_BYTES, PUMP_BYTES, 2 * PUMP_BYTES - 1, 2 * PUMP_BYTES,
             2 * PUMP_BYTES + 3, 3 * PUMP_BYTES + 65, 4 * PUMP_BYTES, 9 * PUMP_BYTES + 1, 64 * PUMP_BYTES]
    for nbytes in sizes:
        counts = []
        for streams in range(1, 9):
            pumped = parts_of(nbytes, streams, True)
            assert pumped == (1 if nbytes < SPLIT_BYTES else max(1, min(streams, nbytes // PUMP_BYTES)))
            assert parts_of(nbytes, streams, False) == (1 if nbytes < SPLIT_BYTES else streams)
            for count in {pumped, parts_of(nbytes, streams, False)}:
                parts = split(nbytes, count)
                assert len(parts) == count and parts[0][0] == 0 and parts[-1][1] == nbytes, parts
                assert all(a[1] == b[0] > a[0] and b[0] % 64 == 0 for a, b in zip(parts, parts[1:])), parts
            assert pumped == 1 or all(end - start >= PUMP_BYTES for start, end in split(nbytes, pumped))
            counts.append(pumped)
        assert counts == sorted(counts), (nbytes, counts)


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:  # the receiver closed the pair on a bad count
        pass


def test_the_receiver_splits_as_the_count_after_the_header_says() -> None:
    """A large message's header is followed by the count of its parts, which decides what each
    stream carries: 2 parts over 3 streams arrive whole; a count of none or of more parts than
    the pair has streams closes the pair as a malformed stream, naming the count."""
    nbytes = 2 * PUMP_BYTES + 3
    payload = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    header = Header(Kind.P2P, 0, 1, 7, nbytes, P2P_FINGERPRINT).pack()
    for count in (2, 0, 4, 2**32 - 1):
        engine = Engine(0, 2, 0)
        pairs = [socket.socketpair() for _ in range(3)]
        channel = TcpChannel([SocketStream(a, 1, engine, 4096, 1 << 30) for a, _ in pairs])
        engine.add_channel(1, channel)
        (s0, e0), (s1, e1) = split(nbytes, 2)
        whole = struct.pack("<I", 0)  # each part's trailer word
        senders = [threading.Thread(target=_send_quietly, args=(pairs[0][1], header + struct.pack("<I", count)
                                                                + payload[s0:e0].tobytes() + whole)),
                   threading.Thread(target=_send_quietly,
                                    args=(pairs[1][1], payload[s1:e1].tobytes() + whole))]
        for t in senders:
            t.start()
        error, arrived, deadline = "", None, time.monotonic() + 20
        try:
            while arrived is None and time.monotonic() < deadline:
                try:
                    channel.progress()
                except PeerClosed as exc:
                    error = str(exc)
                    break
                msgs = [m for q in engine.unexpected.values() for m in q if m.received == m.nbytes]
                arrived = msgs[0].buf if msgs else None
        finally:
            for a, b in pairs:
                a.close()
                b.close()
            for t in senders:
                t.join(5)
        if count == 2:
            assert arrived is not None and np.array_equal(arrived, payload), error
        else:
            assert arrived is None and f"in {count} parts over 3 streams" in error, (count, error)


@pytest.mark.parametrize("streams", [1, 3])
@pytest.mark.parametrize("aborted", [False, True])
def test_a_message_whose_group_aborted_on_its_way_arrives_void(streams: int, aborted: bool) -> None:
    """A 4 MiB send the kernel took only part of fails as its group aborts (what a send that
    timed out partway does), and its caller writes over the buffer: the rest still goes, to
    keep the streams framed, and the receiver is told the message is void (its trailers say
    so), over one stream and split over three; a send that was not failed arrives whole. What
    its request says went counts every stream's part (a timeout's message quotes it)."""
    nbytes = 4 * _MIB
    pairs = [socket.socketpair() for _ in range(streams)]
    for a, b in pairs:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    sender, receiver = Engine(0, 2, 0), Engine(1, 2, 0)
    out = TcpChannel([SocketStream(a, 1, sender, 4096, 1 << 30) for a, _ in pairs])
    inn = TcpChannel([SocketStream(b, 0, receiver, 4096, 1 << 30) for _, b in pairs])
    sender.add_channel(1, out)
    receiver.add_channel(0, inn)
    payload = np.full(nbytes, 7, np.uint8)
    header = Header(Kind.P2P, 0, 1, 3, nbytes, P2P_FINGERPRINT)
    req = SendRequest(1, header, payload, "send to rank 1 (tag 3)")
    try:
        out.post(req)
        out.progress()
        assert not req.done and 0 < req.sent < nbytes, req.progress_text()  # (split: it said 0 sent)
        if aborted:
            req.fail(AbortedError("the group was aborted"))
            payload[:] = 0xFF
        deadline = time.monotonic() + 20
        arrived = []
        while not arrived and time.monotonic() < deadline:
            out.progress()
            inn.progress()
            arrived = [m for q in receiver.unexpected.values() for m in q if m.complete and not m.trailers]
    finally:
        for a, b in pairs:
            a.close()
            b.close()
    assert arrived and arrived[0].void == aborted, arrived
    assert aborted or (arrived[0].buf == 7).all()


def test_a_receive_posted_before_the_trailer_came_waits_for_it() -> None:
    """A message whose payload is in but whose trailer word is not yet: a receive posted then
    waits for the trailer, and a void one fails it (it took the message at once as whole)."""
    n = SPLIT_BYTES
    a, b = socket.socketpair()
    engine = Engine(1, 2, 0)
    channel = TcpChannel(SocketStream(a, 0, engine, 4096, 1 << 30))
    engine.add_channel(0, channel)
    header = Header(Kind.P2P, 0, 1, 3, n, P2P_FINGERPRINT)
    sender = threading.Thread(target=b.sendall, args=(header.pack() + b"\xff" * n,))
    sender.start()  # (more than a socket pair's buffers hold)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(m.received == n for q in engine.unexpected.values()
                                                      for m in q):
            channel.progress()
        sender.join(10)
        req = engine.irecv(0, header, np.zeros(n, np.uint8), None, "recv from rank 0 (tag 3)")
        assert not req.done
        b.sendall(struct.pack("<I", 0x44494F56))  # the void word
        while time.monotonic() < deadline and not req.done:
            channel.progress()
    finally:
        a.close()
        b.close()
    assert req.done and req.void and isinstance(req.error, AbortedError), (req.done, req.void, req.error)


def _thresholds() -> dict[str, Any]:
    """Messages of sizes about the split's and the pumps' thresholds, each way between two ranks
    into a posted receive, and folded by a reduce: first as the job's settings have it, then with
    pump threads on rank 0 only (the two then split their messages by different rules)."""
    import tensorwire as tw
    from tensorwire.transport.pumps import Pumps

    rank = tw.get_rank()
    peer = 1 - rank
    engine = tw.world().runtime.engine
    threads = 0 if engine.pumps is None else engine.pumps.threads
    for mixed in (False, True):
        if mixed and rank == 0 and engine.pumps is None:
            engine.pumps = Pumps(2)  # closed with the engine
        tw.barrier()
        for nbytes in (SPLIT_BYTES - 1, SPLIT_BYTES, _MIB - 1, _MIB, 2 * _MIB - 1, 2 * _MIB + 3,
                       3 * _MIB + 65, 4 * _MIB):
            mine = np.random.default_rng(nbytes + rank).integers(0, 256, nbytes, dtype=np.uint8)
            theirs = np.random.default_rng(nbytes + peer).integers(0, 256, nbytes, dtype=np.uint8)
            got = np.empty(nbytes, np.uint8)
            work = tw.isend(mine, peer)
            tw.recv(got, peer)
            work.wait()
            assert np.array_equal(got, theirs), f"{nbytes} bytes from rank {peer} arrived changed ({mixed=})"
            total = mine.copy()
            tw.reduce(total, dst=0)
            if rank == 0:
                assert np.array_equal(total, mine + theirs), f"reduce of {nbytes} bytes wrong ({mixed=})"
    return {"threads": threads, "pumps": any(t.name == "tensorwire-pump" for t in threading.enumerate())}


@pytest.mark.parametrize("threads", [0, 2])
def test_messages_about_the_thresholds_arrive_intact_over_four_streams(threads: int) -> None:
    """Four streams a pair, with and without pump threads, and with them on one side only:
    messages just under, at and over the sizes where they are split and where a pump takes a part
    arrive as sent."""
    cluster = Cluster(2, {"TENSORWIRE_TRANSPORT": "tcp", "TENSORWIRE_NSOCKS": "4",
                          "TENSORWIRE_SOCKET_THREADS": str(threads)})
    try:
        results = cluster.run(_thresholds, timeout=60)
    finally:
        cluster.close()
    assert [r["threads"] for r in results] == [threads, threads], results
    assert results[0]["pumps"] and results[1]["pumps"] == bool(threads), results


def _killed_mid_stream(report_dir: str) -> None:
    import tensorwire as tw

    rank = tw.get_rank()
    x = np.ones(4 * _MIB, np.float32)  # 16 MiB: every part of the ring a pumped one
    tw.barrier()
    if rank == 1:
        threading.Timer(0.3, os._exit, args=(3,)).start()
    t0 = time.monotonic()
    error = ""
    died = 0.0
    try:
        while time.monotonic() - t0 < 60:
            tw.all_reduce(x, op=tw.ReduceOp.MAX)
    except tw.PeerLostError as exc:
        error, died = str(exc), time.monotonic() - t0
    tw.destroy()
    time.sleep(0.1)
    left = [t.name for t in threading.enumerate() if t.name.startswith("tensorwire")]
    Path(report_dir, f"{rank}.json").write_text(json.dumps({"error": error, "after": died, "left": left}))


@pytest.mark.timeout(120)
def test_a_rank_killed_mid_stream_fails_the_others_and_leaves_no_thread(tmp_path: Path) -> None:
    """Rank 1 exits while the ring's 16 MiB all_reduce has pump threads sending and folding: ranks
    0 and 2 raise PeerLostError naming it within seconds (the timeout is 30 s), and after destroy()
    no tensorwire thread is left."""
    cluster = Cluster(3, {"TENSORWIRE_TRANSPORT": "tcp", "TENSORWIRE_SOCKET_THREADS": "2"})
    try:
        with pytest.raises(RankFailure) as failure:
            cluster.run(_killed_mid_stream, str(tmp_path), timeout=90)
        assert set(failure.value.errors) == {1}, failure.value
    finally:
        cluster.close()
    for rank in (0, 2):
        res = json.loads((tmp_path / f"{rank}.json").read_text())
        assert "rank 1" in res["error"], res
        assert res["after"] < 10.0, res
        assert res["left"] == [], res


_LEFT_BEFORE_READ = """
import os, sys, time, numpy as np, tensorwire as tw
w = tw.init(timeout=15)
n, left = 2_000_000, sys.argv[1]
if w.rank == 0:  # the message fits the kernels' buffers of 8 streams: the send is done at once
    tw.send(np.arange(n, dtype=np.float64), dst=1, tag=3)
    tw.destroy()
    open(left, "w").close()
else:
    until = time.monotonic() + 10
    while not os.path.exists(left) and time.monotonic() < until:
        time.sleep(0.01)
    assert os.path.exists(left), "rank 0 did not leave"
    got = np.empty(n, np.float64)
    tw.recv(got, src=0, tag=3)
    assert (got == np.arange(n)).all()
    tw.destroy()
print(f"rank {w.rank}: LEFT OK", flush=True)
"""


@pytest.mark.timeout(60)
def test_a_message_sent_before_its_sender_left_arrives_whole(tmp_path: Path) -> None:
    """Its receiver's pump threads took the parts on the other streams as the goodbye came, and
    were stopped short: the receive waited out its timeout with 2-8 MB of 16 missing."""
    import subprocess
    import sys

    script = tmp_path / "left.py"
    script.write_text(_LEFT_BEFORE_READ)
    env = {**os.environ, "TENSORWIRE_TRANSPORT": "tcp", "TENSORWIRE_NSOCKS": "8",
           "TENSORWIRE_SOCKET_THREADS": "16"}
    proc = subprocess.run([sys.executable, "-m", "tensorwire", "run", "-n", "2", str(script),
                           str(tmp_path / "left")], env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0 and proc.stdout.count("LEFT OK") == 2, proc.stdout + proc.stderr[-3000:]
