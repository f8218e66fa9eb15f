"""Large TCP messages moved by pump threads (TENSORWIRE_SOCKET_THREADS) and split over several
streams (TENSORWIRE_NSOCKS): the same bits as the rank's own thread moving every byte, a rank
killed mid-stream is PeerLostError on the others within seconds, and destroy() leaves no thread."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cluster import Cluster, RankFailure

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
