"""The direct path's compiled bodies (transport/_native.c) against their Python reference.

Their folds, bit for bit against the numpy kernels the Python path applies, on any bytes;
arguments that would read or write out of bounds refused with an exception; the setting's
three values, with the module present and missing. The collectives, errors and soak run on both
paths elsewhere (the `shm-python` worlds of test_collectives and test_errors, test_soak)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorwire.ops import ReduceOp
from tensorwire.ops.kernels import reduction_kernel
from tensorwire.transport import native
from tensorwire.transport.segment import GroupSegment

_native = pytest.importorskip("tensorwire.transport._native", reason="the compiled module was not built")

DTYPES = [np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
                                np.uint64, np.float32, np.float64)]
OPS = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
SLOT = 4096


def _segment(n: int) -> GroupSegment:
    seg = GroupSegment.create("tw-test-native", n, SLOT)
    seg.unlink()  # the mapping lasts as long as its views
    return seg


def _path(seg: GroupSegment, rank: int = 0) -> object:
    return native.path("1", seg, tuple(seg.lines), rank, GroupSegment.nbytes(seg.size, 0), 0.0, 0)


@settings(max_examples=300, deadline=None)
@given(dtype=st.sampled_from(DTYPES), op=st.sampled_from(OPS), n=st.integers(1, 6),
       count=st.integers(1, SLOT // 8), parity=st.integers(0, 1), seed=st.integers(0, 2 ** 32 - 1),
       specials=st.booleans())
def test_folds_are_bit_for_bit_numpys(dtype, op, n, count, parity, seed, specials) -> None:
    """Every fold the C code has gives the bits of the numpy kernel folding the slots in rank
    order, as the Python bodies do: wrapping integers, infinities, NaNs, signed zeros."""
    code = native.fold_code(op, dtype)
    if not code:
        assert dtype.kind == "f" and op not in (ReduceOp.SUM, ReduceOp.PRODUCT)
        return
    seg = _segment(n)
    try:
        rng = np.random.default_rng(seed)
        slots = [seg.slots[r][parity][:count * dtype.itemsize].view(dtype) for r in range(n)]
        for s in slots:
            s.view(np.uint8)[...] = rng.integers(0, 256, s.nbytes, dtype=np.uint8)
            if specials and dtype.kind == "f":
                s[rng.integers(0, count, 3)] = rng.choice([np.inf, -np.inf, np.nan, 0.0, -0.0], 3)
        want = slots[0].copy()
        if n > 1:
            kernel = reduction_kernel(op, dtype)
            with np.errstate(all="ignore"):
                kernel(slots[0], slots[1], want)
                for s in slots[2:]:
                    kernel(want, s, want)
        got = np.full(count, 7, dtype=dtype)
        _path(seg).fold(parity, got, code)
        assert got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes()
    finally:
        seg.close()


def test_what_would_leave_the_segment_is_refused() -> None:
    """Buffers larger than a slot, read-only outputs, unknown folds, parities and roots, a
    layout that does not fit the segment, a Path never set up: exceptions, never a stray write."""
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
            path.reduce(1, 0, 0, 0, np.zeros(4, np.float32), np.zeros(4, np.float32), code, 2)
        with pytest.raises(ValueError, match="whom"):
            path.round(1, 0, 0, 0, 5)
        with pytest.raises(ValueError, match="differ in size"):
            path.all_reduce(1, 0, 0, 0, np.zeros(4, np.float32), np.zeros(5, np.float32), code)
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
        assert me.round(1, 1, 11, 12, -1) == native.PENDING
        assert peer.round(1, 1, 11, 99, -2) == native.DONE  # rank 1: the same call number, another call
        assert me.round(1, 1, 11, 12, -1) == 1
        assert me.settle(1, 1, 11, 12) == 1
        assert peer.settle(1, 1, 11, 99) == 0
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
