"""The direct path's compiled bodies (transport/_native.c) against their Python reference.

Their folds, bit for bit against the numpy kernels the Python path applies, on any bytes;
arguments that would read or write out of bounds refused with an exception; the setting's
three values, with the module present and missing. The collectives, errors and soak run on both
paths elsewhere (the `shm-python` worlds of test_collectives and test_errors, test_soak)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cluster import Cluster
from conftest import PYTHON
from tensorwire.algorithms.direct_plans import COMPILED_PLANS
from tensorwire.ops import ReduceOp
from tensorwire.ops.kernels import reduction_kernel
from tensorwire.transport import native
from tensorwire.transport.segment import GroupSegment

_native = pytest.importorskip("tensorwire.transport._native", reason="the compiled module was not built")

DTYPES = [np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
                                np.uint64, np.float32, np.float64)]
OPS = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
SLOT = 4096
FOLD_SLOT = 64 << 10  # past 8 KiB a fold spreads over the ranks' parts (_native.c SPREAD_FROM)


def _segment(n: int, slot: int = SLOT) -> GroupSegment:
    seg = GroupSegment.create("tw-test-native", n, slot)
    seg.unlink()  # the mapping lasts as long as its views
    return seg


def _path(seg: GroupSegment, rank: int = 0) -> object:
    return native.path(_native, seg, tuple(seg.lines), rank, GroupSegment.nbytes(seg.size, 0), 0.0, 0)


@settings(max_examples=300, deadline=None)
@example(dtype=np.dtype(np.float32), op=ReduceOp.PRODUCT, n=5, count=2, parts=0, rank=0, parity=0, seed=1,
         specials=True)
@example(dtype=np.dtype(np.float32), op=ReduceOp.SUM, n=3, count=136, parts=0, rank=0, parity=0, seed=1,
         specials=True)
@example(dtype=np.dtype(np.float32), op=ReduceOp.SUM, n=2, count=1, parts=32, rank=1, parity=0, seed=1,
         specials=False)
@example(dtype=np.dtype(np.int64), op=ReduceOp.SUM, n=3, count=2, parts=32, rank=2, parity=1, seed=1,
         specials=False)
@example(dtype=np.dtype(np.uint8), op=ReduceOp.BXOR, n=5, count=4, parts=32, rank=4, parity=0, seed=1,
         specials=False)
@given(dtype=st.sampled_from(DTYPES), op=st.sampled_from(OPS), n=st.integers(1, 6),
       count=st.integers(1, SLOT // 8), parts=st.one_of(st.just(0), st.integers(1, 40)),
       rank=st.integers(0, 5), parity=st.integers(0, 1), seed=st.integers(0, 2 ** 32 - 1),
       specials=st.booleans())
def test_folds_are_bit_for_bit_numpys(dtype, op, n, count, parts, rank, parity, seed, specials) -> None:
    """Every fold the C code has gives the bits of the numpy kernel folding the slots in rank
    order, as the Python bodies do: wrapping integers, infinities, NaNs, signed zeros; also where
    each rank folds its own part first (`parts`: counts of n parts of whole 64s and a rest,
    whose rest was once lost). Where
    two NaNs meet, which one's sign and payload numpy keeps depends on the element's place in
    its vector loop (on an AVX-512 machine the first operand's, but the second's in the rest
    after the last full vector), so there the fold's result must only be NaN; everywhere else
    (one NaN operand included) the bits must match (docs/design/native.md)."""
    code = native.fold_code(op, dtype)
    if not code:
        assert dtype.kind == "f" and op not in (ReduceOp.SUM, ReduceOp.PRODUCT)
        return
    if parts:
        count = min(64 * parts * n + count % n, FOLD_SLOT // dtype.itemsize)
    rank %= n
    seg = _segment(n, FOLD_SLOT)
    try:
        rng = np.random.default_rng(seed)
        slots = [seg.slots[r][parity][:count * dtype.itemsize].view(dtype) for r in range(n)]
        for s in slots:
            s.view(np.uint8)[...] = rng.integers(0, 256, s.nbytes, dtype=np.uint8)
            if specials and dtype.kind == "f":
                s[rng.integers(0, count, 3)] = rng.choice([np.inf, -np.inf, np.nan, 0.0, -0.0], 3)
        want = slots[0].copy()
        met = np.zeros(count, dtype=bool)  # where a fold step had a NaN on both sides
        if n > 1:
            kernel = reduction_kernel(op, dtype)
            with np.errstate(all="ignore"):
                met |= np.isnan(slots[0]) & np.isnan(slots[1])
                kernel(slots[0], slots[1], want)
                for s in slots[2:]:
                    met |= np.isnan(want) & np.isnan(s)
                    kernel(want, s, want)
        got = np.full(count, 7, dtype=dtype)
        _path(seg, rank).fold(parity, got, code)
        assert np.isnan(got[met]).all()
        got, want = got[~met], want[~met]
        assert got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes()
    finally:
        seg.close()


def test_what_would_leave_the_segment_is_refused() -> None:
    """Buffers larger than a slot, read-only outputs, unknown folds, parities and roots, a
    root's list of the wrong length, a scatter table pointing past the slot, a layout that does
    not fit the segment, a Path never set up: exceptions, never a stray write."""
    seg = _segment(2)
    try:
        path = _path(seg)
        code = native.fold_code(ReduceOp.SUM, np.dtype(np.float32))
        small = np.zeros(4, np.float32)
        with pytest.raises(ValueError, match="do not fit"):
            path.fold(0, np.zeros(SLOT // 4 + 1, np.float32), code)
        with pytest.raises(ValueError, match="parity"):
            path.fold(2, small, code)
        with pytest.raises(ValueError, match="no fold"):
            path.fold(0, small, 0)
        small.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            path.fold(0, small, code)
        with pytest.raises(ValueError, match="root"):
            path.reduce(1, 0, 0, "reduce", np.zeros(4, np.float32), np.zeros(4, np.float32), code, 2)
        with pytest.raises(ValueError, match="whom"):
            path.round(1, 0, 0, "barrier", 5)
        with pytest.raises(ValueError, match="differ in size"):
            path.all_reduce(1, 0, 0, "all_reduce", np.zeros(4, np.float32), np.zeros(5, np.float32), code)
        block = np.zeros(4, np.float32)
        with pytest.raises(ValueError, match="list of 2"):
            path.gather(1, 0, 0, "gather", block, [block], 0)
        with pytest.raises(ValueError, match="within the slot"):
            path.scatter(1, 0, 0, "scatter", [block, block], block, 0, np.array([0, SLOT - 8], np.uint64))
        with pytest.raises(ValueError, match="leaves the"):
            path.exchange(1, 0, 0, "all_gather", block, block, SLOT - 8, 16, 0)
        with pytest.raises(ValueError, match="dst has 16 bytes where 32"):
            path.exchange(1, 0, 0, "all_gather", block, block, 0, 16, 0)
        assert (path.parity, path.prev_seq) == (1, 0)  # nothing refused entered or published
        with pytest.raises(ValueError, match="does not fit"):
            _native.Path(seg.bytes, tuple(seg.lines), 0, GroupSegment.nbytes(2, 0), SLOT * 2, 0, 0)
        with pytest.raises(RuntimeError, match="not set up"):
            _native.Path.__new__(_native.Path).fold(0, np.zeros(4, np.float32), code)
    finally:
        seg.close()


def test_a_lone_publisher_hands_the_wait_back_and_a_stranger_is_named() -> None:
    """Rank 0 of two publishes while rank 1 has not: PENDING after the spin, for Python to wait
    out; once rank 1 stamps the call with another fingerprint, the round names rank 1."""
    seg = _segment(2)
    try:
        me, peer = _path(seg, 0), _path(seg, 1)
        assert me.round(1, 11, 12, "barrier", -1) == native.PENDING
        assert peer.round(1, 11, 99, "broadcast", -2) == native.DONE  # the same call number, another call
        assert me.round(1, 11, 12, "barrier", -1) == 1
        assert me.settle() == 1
        assert peer.settle() == 0
    finally:
        seg.close()


def test_a_body_enters_only_where_nothing_waits_or_is_to_be_vetted() -> None:
    """A compiled body takes the next parity itself, and hands the entry back untouched
    (NOT_ENTERED) while the previous call is unsettled (a peer not there yet) or a
    message-path call's notes are to be checked; it notes the call it publishes."""
    seg = _segment(2)
    try:
        me, peer = _path(seg, 0), _path(seg, 1)
        code = native.fold_code(ReduceOp.SUM, np.dtype(np.float32))
        x, y = np.ones(4, np.float32), np.zeros(4, np.float32)
        assert me.round(1, 11, 12, "broadcast", -2) == native.DONE  # a root's call: nobody waited for
        assert (me.parity, me.settled, me.prev_seq, me.prev_name) == (1, 0, 1, "broadcast")
        assert me.all_reduce(2, 21, 22, "all_reduce", x, y, code) == native.NOT_ENTERED
        assert (me.parity, me.prev_seq) == (1, 1)
        assert peer.round(1, 11, 12, "broadcast", 0) == native.DONE
        assert me.all_reduce(2, 21, 22, "all_reduce", x, y, code) == native.PENDING  # entered: rank 1 is late
        assert (me.parity, me.settled, me.prev_seq, me.prev_a, me.prev_b) == (0, 0, 2, 21, 22)
        assert peer.all_reduce(2, 21, 22, "all_reduce", 2 * x, y, code) == native.DONE
        assert y.tolist() == [3.0] * 4 and peer.settled == 1
        peer.unvetted = 1
        assert peer.broadcast(3, 31, 32, "broadcast", x, x, 0) == native.NOT_ENTERED
        assert peer.parity == 0
    finally:
        seg.close()


_SETTING = textwrap.dedent("""
    import logging, sys
    if sys.argv[1] == "missing":
        sys.modules["tensorwire.transport._native"] = None  # as where it was not built
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from tensorwire.transport import native
    for _ in range(2):
        try:
            print("module" if native.module(sys.argv[2]) is not None else "python")
        except ImportError as exc:
            print("ImportError:", exc)
""")


@pytest.mark.parametrize("built, want, says", [
    ("built", "auto", ["module", "module"]),
    ("built", "0", ["python", "python"]),
    ("built", "1", ["module", "module"]),
    ("missing", "auto", ["python", "python"]),
    ("missing", "0", ["python", "python"]),
    ("missing", "1", ["ImportError", "ImportError"]),
])
def test_the_setting_chooses_and_a_missing_module_is_said_once(built: str, want: str,
                                                               says: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-c", _SETTING, built, want], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert [line.split(":")[0] for line in proc.stdout.splitlines()] == says
    warned = proc.stderr.count("compiled module was not built")
    assert warned == (1 if (built, want) == ("missing", "auto") else 0), proc.stderr
    if says[0] == "ImportError":
        assert "TENSORWIRE_NATIVE=1" in proc.stdout


def test_a_bad_setting_is_named() -> None:
    from tensorwire.config import Config
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TENSORWIRE_NATIVE", "yes")
        with pytest.raises(ValueError, match="TENSORWIRE_NATIVE='yes'"):
            Config.from_env()


def rank_planned(seed: int, dtype: str, count: int, calls: int) -> dict:
    """Every collective the compiled bodies run, on the direct path, called again and again
    with new data (the second call of a signature on is planned): the results' bytes per
    collective and call, and whether this rank ran the compiled bodies."""
    import tensorwire as tw
    from tensorwire.tuning import tuner

    g = tw.world()
    n, me = g.size, g.rank
    rng = np.random.default_rng([seed, me])
    xs = [(rng.standard_normal(count) * 100).astype(dtype) for _ in range(calls)]
    y = np.empty_like(xs[0])
    big = np.empty(n * count, dtype)
    blocks = [np.empty_like(y) for _ in range(n)]
    op = ReduceOp.MAX if np.dtype(dtype).kind in "iu" else ReduceOp.SUM
    spread = lambda x: np.concatenate([x + r for r in range(n)])  # noqa: E731 - block r for rank r
    runs = {
        "all_reduce": lambda x: tw.all_reduce(x, out=y),
        "reduce": lambda x: tw.reduce(x, 1, op, out=y),
        "broadcast": lambda x: tw.broadcast(x, n - 1, out=y),
        "gather": lambda x: tw.gather(x, blocks if me == 0 else None, 0),
        "scatter": lambda x: tw.scatter(y, [x + r for r in range(n)] if me == n - 1 else None, n - 1),
        "barrier": lambda x: tw.barrier(),
        "all_gather": lambda x: tw.all_gather_into_tensor(big, x),
        "reduce_scatter": lambda x: tw.reduce_scatter_tensor(y, spread(x), op),
        "all_to_all": lambda x: tw.all_to_all_single(big, spread(x)),
    }
    out: dict[str, list[bytes]] = {}
    for coll, run in runs.items():
        with tuner.override(g, coll, "direct"):
            for x in xs:
                y[...] = big[...] = 0
                run(x)
                if coll == "gather":  # the root's blocks; elsewhere unwritten
                    out.setdefault(coll, []).append(b"".join(b.tobytes() for b in blocks) if me == 0 else b"")
                else:
                    whole = big if coll in ("all_gather", "all_to_all") else y
                    out.setdefault(coll, []).append(whole.tobytes())
    return {"native": g.direct is not None and g.direct.native is not None, "bytes": out}


@pytest.mark.parametrize("dtype, count", [("float32", 3), ("float64", 100), ("int32", 7), ("uint8", 64),
                                          ("float32", 4097)])  # 16 KiB: folds spread, parts of 64 and a rest
def test_both_paths_give_the_same_bytes(get_cluster, dtype: str, count: int) -> None:
    """The same calls on two ranks (rooted one shots need a core a rank) with the compiled
    bodies and with the Python ones, every collective on the direct path: the same bytes, call
    for call, on every rank (each world running the bodies it was set to), and the right ones
    (numpy's, in rank order)."""
    n, seen = 2, {}
    for transport in ("shm", PYTHON):
        results = get_cluster(n, transport).run(rank_planned, 7, dtype, count, 6, timeout=60)
        assert [r["native"] for r in results] == [transport == "shm"] * n
        seen[transport] = [r["bytes"] for r in results]
    for r in range(n):
        for coll, calls in seen["shm"][r].items():
            assert calls == seen[PYTHON][r][coll], f"rank {r}: {coll}"
    rngs = [np.random.default_rng([7, r]) for r in range(n)]
    xs = [[(g.standard_normal(count) * 100).astype(dtype) for _ in range(6)] for g in rngs]
    op = np.maximum if np.dtype(dtype).kind in "iu" else np.add
    for k in range(6):
        mine = [x[k] for x in xs]
        for r, got in enumerate(seen["shm"]):
            assert got["all_reduce"][k] == (mine[0] + mine[1]).tobytes()
            assert got["broadcast"][k] == mine[n - 1].tobytes()
            assert got["scatter"][k] == (mine[n - 1] + r).tobytes()
            assert got["all_gather"][k] == b"".join(m.tobytes() for m in mine)
            assert got["all_to_all"][k] == b"".join((m + r).tobytes() for m in mine)
            assert got["reduce_scatter"][k] == op(mine[0] + r, mine[1] + r).tobytes()
        assert seen["shm"][1]["reduce"][k] == op(mine[0], mine[1]).tobytes()
        assert seen["shm"][0]["gather"][k] == b"".join(m.tobytes() for m in mine)


def rank_frames(t: float, calls: int) -> dict:
    """The fewest Python frames a planned call of each collective (and a sendrecv of a pair of
    routes used before) entered, out of `calls` (none where the compiled caller ran it whole: a
    call whose peer was late takes a few), in the forms users write them, keywords included;
    the same for an async call (the caller hands those to Python); whether each result was
    right; what each collective's plan says it runs (Plans.chosen)."""
    import tensorwire as tw
    from tensorwire.tuning import tuner

    g = tw.world()
    n, me = g.size, g.rank
    x, y = np.full(4, me + 1, np.float32), np.empty(4, np.float32)
    big, spread = np.empty(4 * n, np.float32), np.repeat(np.arange(n, dtype=np.float32), 4) + me
    blocks = [np.full(4, r + 10, np.float32) for r in range(n)]
    total = n * (n + 1) / 2
    runs = {  # collective: (the call, whether its result is right)
        "all_reduce": (lambda: g.all_reduce(x, out=y), lambda: (y == total).all()),
        "reduce": (lambda: g.reduce(x, dst=n - 1, op=ReduceOp.SUM, out=y, timeout=t),
                   lambda: me != n - 1 or (y == total).all()),
        "broadcast": (lambda: g.broadcast(x.copy() if me else x, src=0, out=y), lambda: (y == 1).all()),
        "gather": (lambda: g.gather(x, gather_list=blocks if me == 0 else None, dst=0),
                   lambda: me != 0 or all((b == r + 1).all() for r, b in enumerate(blocks))),
        "scatter": (lambda: g.scatter(y, blocks if me == n - 1 else None, n - 1, timeout=t),
                    lambda: (y == me + 10).all()),
        "barrier": (lambda: g.barrier(timeout=t), lambda: True),
        "all_gather_into_tensor": (lambda: g.all_gather_into_tensor(big, x),
                                   lambda: (big == np.repeat(np.arange(1, n + 1), 4)).all()),
        "reduce_scatter_tensor": (lambda: g.reduce_scatter_tensor(y, spread, op=ReduceOp.SUM),
                                  lambda: (y == n * me + n * (n - 1) / 2).all()),
        "all_to_all_single": (lambda: g.all_to_all_single(big, spread, timeout=t),
                              lambda: (big == np.repeat(np.arange(n), 4) + me).all()),
        "sendrecv": (lambda: g.sendrecv(x, (me + 1) % n, y, (me - 1) % n, 0, t),
                     lambda: (y == (me - 1) % n + 1).all()),
    }
    frames = [0]

    def count(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code not in ours:
            frames[0] += 1

    ours = {run.__code__ for run, _ in runs.values()}

    out = {}
    tuned = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
             "all_to_all_single": "all_to_all"}
    for coll, (run, right) in runs.items():
        fewest, ok = [], True
        blocks[:] = [np.full(4, r + 10, np.float32) for r in range(n)]  # a gather wrote them
        one_shot = tuner.override(g, tuned.get(coll, coll), "direct") if coll != "sendrecv" else None
        with one_shot or contextlib.nullcontext():
            # sendrecv: both ranks in at once and more calls, since a receive that outwaits its
            # spin (a peer descheduled on a crowded machine) finishes in Python
            for i in range(calls * 5 if coll == "sendrecv" else calls):
                if coll == "sendrecv":
                    g.barrier()
                frames[0] = 0
                sys.setprofile(count)
                run()
                sys.setprofile(None)
                ok = ok and bool(right())
                if i >= 2:  # the first checked, the second planned, then every call as the plan ran it
                    fewest.append(frames[0])
            chosen = sorted({type(c).__name__ if type(c).__name__ != "Algorithm" else c.name
                             for c in g.plans.chosen.values()})
        out[coll] = {"fewest": min(fewest), "right": ok, "chosen": chosen}
    work = g.all_reduce(x, out=y, async_op=True)
    work.wait()
    frames[0] = 0
    sys.setprofile(count)
    g.all_reduce(x, out=y, async_op=True).wait()
    sys.setprofile(None)
    compiled = type(g.all_reduce).__name__ == "builtin_function_or_method"
    return {"colls": out, "async": frames[0], "compiled": compiled}


def _frames_of(get_cluster: Any, transport: str, fn: Any, *args: Any) -> list:
    """`fn(*args)` on 2 ranks. With the compiled module (shm), on a cluster of its own whose
    waits spin 5 ms in C before Python takes them (TENSORWIRE_SPIN_US): on a loaded machine a
    peer that lost its core for longer would send every call's wait, and its frames, to Python."""
    if transport != "shm":
        return get_cluster(2, transport).run(fn, *args, timeout=120)
    cluster = Cluster(2, {"TENSORWIRE_SPIN_US": "5000"})
    try:
        return cluster.run(fn, *args, timeout=120)
    finally:
        cluster.close()


def test_the_compiled_caller_runs_planned_calls_whole(get_cluster) -> None:
    """With the compiled module, a planned one-shot call of every collective the caller takes,
    and a sendrecv on one host, enter no Python frame at all (group/planned.py,
    Plans._compile; p2p.sendrecv), in positional and keyword forms, with and without a timeout;
    async calls still go through Python. Without it, every call runs the Python functions.
    Results right either way (_frames_of)."""
    for transport in ("shm", PYTHON):
        for rank, result in enumerate(_frames_of(get_cluster, transport, rank_frames, 30.0, 40)):
            assert result["compiled"] == (transport == "shm")
            assert result["async"] > 0
            for coll, seen in result["colls"].items():
                assert seen["right"], (transport, rank, coll)
                if coll != "sendrecv":  # the one shot's plan, or (barrier) its algorithm
                    assert len(seen["chosen"]) == 1 and (
                        seen["chosen"][0] in {c.__name__ for c in COMPILED_PLANS} | {"direct"}), seen
                if transport == "shm":
                    assert seen["fewest"] == 0, (rank, coll, seen)
                else:
                    assert seen["fewest"] > 0, (rank, coll, seen)


def rank_moves_frames(calls: int) -> dict:
    """As rank_frames, for the single copy calls the compiled caller runs whole (single copy
    forced): broadcast in place and out of place, all_gather_into_tensor out of place and in
    place (the input the rank's own block of the output), all_to_all_single, gather (the root's
    own block the tensor itself, and not) and scatter; and an all_gather_into_tensor whose input
    overlaps two blocks of its output, which the Python path takes (it copies the input apart)."""
    import tensorwire as tw
    from tensorwire.tuning import tuner

    g = tw.world()
    n, me = g.size, g.rank
    if not g.direct.single_copy:
        return {"skip": g.direct.offered or "no single copy"}
    k = 1024
    x = np.arange(k, dtype=np.float32) + 1000 * (me + 1)
    want = np.concatenate([np.arange(k, dtype=np.float32) + 1000 * (r + 1) for r in range(n)])
    out, y, whole = np.empty(n * k, np.float32), np.empty(k, np.float32), np.empty(n * k, np.float32)
    mine = whole[me * k:(me + 1) * k]
    blocks = [np.empty(k, np.float32) for _ in range(n)]
    sources = [np.full(k, 7 * r + me, np.float32) for r in range(n)]
    sent = np.concatenate(sources)
    shifted = np.empty((n + 1) * k, np.float32)

    def in_place_all_gather() -> None:
        mine[:] = x
        g.all_gather_into_tensor(whole, mine)

    def overlapping_all_gather() -> None:
        shifted[k // 2:k // 2 + k] = x  # the input: half in the output's block 0, half in block 1
        g.all_gather_into_tensor(shifted[:n * k], shifted[k // 2:k // 2 + k])

    def gather_own() -> None:
        blocks[0][:] = x
        g.gather(blocks[0] if me == 0 else x, blocks if me == 0 else None, 0)

    runs = {  # (collective the tuner forces, the call, whether its result is right)
        "broadcast": ("broadcast", lambda: g.broadcast(x.copy() if me else x, 0, out=y),
                      lambda: (y == want[:k]).all()),
        "broadcast in place": ("broadcast", lambda: (y.__setitem__(slice(None), x), g.broadcast(y, 0)),
                               lambda: (y == want[:k]).all()),
        "all_gather": ("all_gather", lambda: g.all_gather_into_tensor(out, x), lambda: (out == want).all()),
        "all_gather in place": ("all_gather", in_place_all_gather, lambda: (whole == want).all()),
        "all_to_all": ("all_to_all", lambda: g.all_to_all_single(out, sent),
                       lambda: all((out[r * k:(r + 1) * k] == 7 * me + r).all() for r in range(n))),
        "gather": ("gather", lambda: g.gather(x, blocks if me == 0 else None, 0),
                   lambda: me != 0 or (np.concatenate(blocks) == want).all()),
        "gather own block": ("gather", gather_own, lambda: me != 0 or (np.concatenate(blocks) == want).all()),
        "scatter": ("scatter", lambda: g.scatter(y, sources if me == n - 1 else None, n - 1),
                    lambda: (y == 7 * me + n - 1).all()),
        "overlapping": ("all_gather", overlapping_all_gather, lambda: (shifted[:n * k] == want).all()),
    }
    frames = [0]

    def count(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code not in ours:
            frames[0] += 1

    ours = {run.__code__ for _, run, _ in runs.values()} | {
        f.__code__ for f in (in_place_all_gather, overlapping_all_gather, gather_own)}
    result = {}
    for name, (collective, run, right) in runs.items():
        fewest, ok = [], True
        with tuner.override(g, collective, "single_copy"):
            for i in range(calls):
                frames[0] = 0
                sys.setprofile(count)
                run()
                sys.setprofile(None)
                ok = ok and bool(right())
                if i >= 2:
                    fewest.append(frames[0])
        result[name] = {"fewest": min(fewest), "right": ok}
    return result


def test_the_compiled_caller_runs_single_copy_calls_whole(get_cluster) -> None:
    """A planned single copy broadcast, all_gather, all_to_all, gather and scatter enter no
    Python frame (Plans._compile, moves_plan in _native.c) where the compiled module is built,
    whatever the placement; an input that overlaps its output elsewhere than the rank's own
    block goes to Python, which copies it apart first. Results right on both paths (_frames_of)."""
    for transport in ("shm", PYTHON):
        for rank, result in enumerate(_frames_of(get_cluster, transport, rank_moves_frames, 30)):
            if "skip" in result:
                pytest.skip(result["skip"])
            for name, seen in result.items():
                assert seen["right"], (transport, rank, name)
                expect_none = transport == "shm" and name != "overlapping"
                assert (seen["fewest"] == 0) == expect_none, (transport, rank, name, seen)


def test_the_ring_loops_write_and_read_records_as_the_python_ones() -> None:
    """ring_put and ring_take on a real ring: the record lies where ShmChannel._put writes it
    (header, padded payload, the head moved past them), reads back once, in order; a header
    that differs is False, an empty ring None; a record that would overrun the reader is left
    to the general path (False); bad layouts are refused."""
    from tensorwire.transport.shm_segments import CTRL_BYTES, Ring

    cap = 1024
    ring = Ring.create("tw-test-native-ring", cap)
    ring.unlink()
    try:
        head = [b"h" * 63 + bytes([i]) for i in range(8)]
        put = lambda h, p: _native.ring_put(ring.bytes, CTRL_BYTES, cap, h, p)  # noqa: E731
        take = lambda h, d: _native.ring_take(ring.bytes, CTRL_BYTES, cap, h, d, 0)  # noqa: E731
        out = np.zeros(100, np.uint8)
        assert take(head[0], out) is None  # nothing there yet
        assert put(head[0], np.arange(100, dtype=np.uint8))
        assert ring.words[0] == 64 + 128 and bytes(ring.raw[:64]) == head[0]
        assert bytes(ring.raw[64:164]) == bytes(range(100))
        assert take(head[1], out) is False  # another message comes first
        assert take(head[0], out) is True and out.tobytes() == bytes(range(100))
        assert ring.words[8] == 64 + 128 and take(head[0], out) is None
        assert put(head[2], b"") and take(head[2], np.zeros(0, np.uint8)) is True
        big = np.ones(cap, np.uint8)
        assert put(head[3], big) is False  # more than the ring holds
        for i in range(4):  # records of 256 from 256 to the end, then at 0, behind the reader
            assert put(head[4], np.full(192, i, np.uint8))
        assert ring.words[0] == 1280 and bytes(ring.raw[:64]) == head[4]
        assert put(head[5], np.zeros(192, np.uint8)) is False  # over the unread record at 256
        assert put(head[5], np.zeros(0, np.uint8)) is False
        with pytest.raises(ValueError, match="64 bytes"):
            put(b"short", big)
        with pytest.raises(ValueError, match="does not fit"):
            _native.ring_put(ring.bytes, CTRL_BYTES, cap * 2, head[0], big)
        ro = np.zeros(4, np.uint8)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            take(head[4], ro)
    finally:
        ring.close()


def test_a_record_whose_payload_passes_the_rings_end_wraps_to_its_start() -> None:
    """A record whose header is the ring's last 64 bytes but a few goes whole through the
    compiled put and take: the payload's first part up to the ring's end, the rest from its
    start, the head past the padded whole; Python's take reads the same bytes back."""
    from tensorwire.transport.shm import ShmChannel
    from tensorwire.transport.shm_segments import CTRL_BYTES, Ring

    cap = 1024
    ring = Ring.create("tw-test-native-wrap", cap)
    ring.unlink()
    try:
        header = b"w" * 64
        put = lambda p: _native.ring_put(ring.bytes, CTRL_BYTES, cap, header, p)  # noqa: E731
        for _ in range(3):  # records of 256: the head and the tail at 768
            assert put(np.zeros(192, np.uint8))
            assert _native.ring_take(ring.bytes, CTRL_BYTES, cap, header, np.zeros(192, np.uint8), 0) is True
        payload = np.arange(300, dtype=np.uint16).astype(np.uint8)
        for take in (lambda d: _native.ring_take(ring.bytes, CTRL_BYTES, cap, header, d, 0),
                     lambda d: ShmChannel._take(ring, header, d)):
            start = ring.words[0]
            assert put(payload)
            at = start % cap + 64
            assert ring.words[0] == start + 64 + 320 and bytes(ring.raw[at - 64:at]) == header
            assert bytes(ring.raw[at:cap]) == payload[:cap - at].tobytes()
            assert bytes(ring.raw[:300 - (cap - at)]) == payload[cap - at:].tobytes()
            out = np.zeros(300, np.uint8)
            assert take(out) is True and np.array_equal(out, payload) and ring.words[8] == ring.words[0]
            for n in (192, 320):  # back to 768 for the next reader: records of 256 and 384
                assert put(np.zeros(n, np.uint8)) and take(np.zeros(n, np.uint8)) is True
            assert ring.words[0] % cap == 768, ring.words[0] % cap
    finally:
        ring.close()


def test_ring_take_spins_for_its_record_and_takes_any_array() -> None:
    """A take that may spin waits (without the interpreter lock: a thread of this process
    writes meanwhile) for the record and takes it; on a ring left empty it gives up after its
    spin. Payloads and destinations are any C-contiguous arrays, read as their bytes."""
    from tensorwire.transport.shm_segments import CTRL_BYTES, Ring

    cap = 1024
    ring = Ring.create("tw-test-native-spin", cap)
    ring.unlink()
    try:
        header = b"s" * 64
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        got = np.zeros((2, 3), np.float32)
        t0 = time.perf_counter()
        assert _native.ring_take(ring.bytes, CTRL_BYTES, cap, header, got, 3_000_000) is None
        assert time.perf_counter() - t0 >= 0.003
        writer = threading.Timer(0.005, _native.ring_put, (ring.bytes, CTRL_BYTES, cap, header, x))
        writer.start()
        assert _native.ring_take(ring.bytes, CTRL_BYTES, cap, header, got, 10_000_000_000) is True
        writer.join()
        assert got.tobytes() == x.tobytes()
    finally:
        ring.close()


def test_a_list_passes_the_compiled_check_only_as_arrays_of_the_same_dtype_and_size() -> None:
    """blocks_like: True only for a list of arrays of like's exact type, dtype and size,
    C-contiguous and (where asked) writable; anything else goes to the Python checks, which
    accept what they accept (a list of torch tensors) and name the rest."""
    like = np.ones(4, np.float32)
    ok = [np.zeros(4, np.float32), np.zeros((2, 2), np.float32)]
    assert _native.blocks_like(ok, like, True) and _native.blocks_like([], like, True)
    ro = np.zeros(4, np.float32)
    ro.flags.writeable = False
    assert _native.blocks_like([ro], like, False) and not _native.blocks_like([ro], like, True)
    for bad in ([np.zeros(4, np.int32)],  # same bytes, another dtype
                [np.zeros(4, np.float32).astype(">f4")],  # another byte order
                [np.zeros(8, np.float32)[::2]],  # not contiguous
                [np.zeros(5, np.float32)], [np.zeros(2, np.float64)],
                [np.zeros(4, np.float32).view(np.matrix)], [memoryview(np.zeros(4, np.float32))],
                [bytearray(16)], [None], (np.zeros(4, np.float32),)):
        assert not _native.blocks_like(bad, like, False), bad
    bf16 = np.zeros(4, ml_dtypes.bfloat16)  # numpy gives no buffer format for it
    assert not _native.blocks_like([bf16], bf16, False)


def test_ring_sendrecv_puts_then_takes_as_the_two_loops_do() -> None:
    """ring_sendrecv: the record put into one ring as ring_put writes it, then the one at the
    other's tail taken as ring_take takes it; 1 where nothing is there to take, 0 where the
    put does not fit (nothing taken then), -1 with nothing done for buffers the general path
    names (a non-contiguous payload, a read-only dst)."""
    from tensorwire.transport.shm_segments import CTRL_BYTES, Ring

    cap = 1024
    a, b = Ring.create("tw-test-native-sr-a", cap), Ring.create("tw-test-native-sr-b", cap)
    a.unlink()
    b.unlink()
    try:
        h = b"x" * 64

        def sendrecv(payload, dst) -> int:
            return _native.ring_sendrecv(a.bytes, CTRL_BYTES, cap, h, payload, b.bytes, CTRL_BYTES, cap, h,
                                         dst, 0)

        got = np.zeros(3, np.int32)
        assert sendrecv(np.arange(3, dtype=np.int32), got) == 1  # sent; b is empty
        assert _native.ring_take(a.bytes, CTRL_BYTES, cap, h, got, 0) is True and got.tolist() == [0, 1, 2]
        assert _native.ring_put(b.bytes, CTRL_BYTES, cap, h, np.full(3, 7, np.int32))
        assert sendrecv(np.full(3, 5, np.int32), got) == 2 and got.tolist() == [7, 7, 7]
        assert a.words[0] == 2 * 128 and b.words[8] == 128  # a: two records put; b: one taken
        ro = np.zeros(3, np.int32)
        ro.flags.writeable = False
        assert sendrecv(np.zeros(6, np.int32)[::2], got) == -1 and sendrecv(got, ro) == -1
        assert a.words[0] == 2 * 128  # nothing put
        assert sendrecv(np.zeros(cap, np.uint8), got) == 0
    finally:
        a.close()
        b.close()


def rank_out_on_some_ranks(counts: tuple[int, ...]) -> list[str]:
    """reduce, broadcast and all_reduce of float32, each three times where only one rank
    passes out= (the root; for all_reduce rank 1), in both orders: out= first then in place,
    and in place first then out=; and gather (its list only on the root). Sizes: `counts`, and
    those where the tuner's choice for a call run whole in C differs from one run from Python
    (the calls were refused as a mismatch there: a rank's first call of a signature ran the one,
    its repeats the other). What failed, or nothing."""
    import tensorwire as tw
    from tensorwire.tuning import tuner

    g = tw.world()
    me, n = g.rank, g.size
    failed: list[str] = []
    for coll in ("reduce", "broadcast", "all_reduce", "gather"):
        differ = [m // 4 for m in (1 << k for k in range(10, 23))
                  if tuner.decide(g, coll, m, compiled=True).choice.name
                  != tuner.decide(g, coll, m, compiled=False).choice.name]
        for count in (*counts, *differ[:2]):
            for first in (True, False):
                for i in range(3):
                    x = np.full(count, me + 1, np.float32)
                    out = np.zeros(count, np.float32) if me == 1 and (i == 0) == first else None
                    try:
                        if coll == "reduce":
                            g.reduce(x, dst=1, out=out)
                            got = x if out is None else out
                        elif coll == "broadcast":
                            g.broadcast(x, src=0, out=out)
                            got = x if out is None else out
                        elif coll == "all_reduce":
                            g.all_reduce(x, out=out)
                            got = x if out is None else out
                        else:
                            blocks = [np.zeros(count, np.float32) for _ in range(n)] if me == 1 else None
                            g.gather(x, blocks, dst=1)
                            got = blocks[0] if blocks is not None else x
                        summed = coll in ("reduce", "all_reduce")
                        want = n * (n + 1) / 2 if summed else 1.0
                        if me == 0 and coll == "reduce":
                            want = 1.0  # its input, kept
                        if not (got == want).all():
                            failed.append(f"{coll} {count}, out= first {first}, call {i}: {got[:1]}")
                    except Exception as exc:  # noqa: BLE001 - the finding
                        failed.append(f"{coll} {count}, out= first {first}, call {i}: {exc}")
    return failed


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["shm", PYTHON])
def test_out_on_some_ranks_only_runs_alike_everywhere(tmp_path, transport) -> None:
    """A call the same on every rank but for out= (given on one rank only: the root) is never
    refused: each rank's first call of a signature and its repeats ran algorithms the tuner
    priced apart (from Python, and whole in C), so where those differed a rank whose signature
    was new (out= or not) ran the one and a rank repeating its own the other, and the call
    failed as a mismatch naming nothing ('reduce #2 ... made a different call at the same
    point: '). Now one choice serves every call (tuner.select)."""
    links = {"shm": (8.79, 5.96), "shm_one_way": (8.79, 9.42), "direct": (2.77, 23.1), "cma": (2.93, 20.1),
             "direct_compiled": (0.601, 29.8), "cma_compiled": (1.31, 20.1), "busy": (10.1, 6.39),
             "busy_ring": (10.1, 6.37), "busy_pairs": (9.96, 6.39)}  # a 2-vCPU VM's, as calibrated
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({k: {"alpha_us": a, "bandwidth_GBps": b, "reduce_GBps": 14.9}
                                for k, (a, b) in links.items()}))
    env = {"TENSORWIRE_TUNING_FILE": str(path)} | ({"TENSORWIRE_NATIVE": "0"} if transport == PYTHON else {})
    cluster = Cluster(2, env)
    try:
        failed = cluster.run(rank_out_on_some_ranks, (100_000, 131_072), timeout=240)
    finally:
        cluster.close()
    assert failed == [[], []], failed
