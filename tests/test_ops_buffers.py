"""The bottom layer alone: op/dtype validation, reduction kernels, and zero-copy views."""

from __future__ import annotations

import array
import os
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tensorwire import buffers
from tensorwire.buffers import HUGE_PAGE, PIECE, as_array, byte_view, copy, flat, huge_zeros, like_torch
from tensorwire.errors import InvalidArgumentError
from tensorwire.ops import ReduceOp, Reduction, premul_sum, torch_kernels
from tensorwire.ops.carriers import carrier
from tensorwire.ops.dtypes import (
    check_dtype,
    dtype_code,
    dtype_from_code,
    dtype_from_name,
    dtype_name,
    lookup,
)
from tensorwire.ops.finalize import finalize
from tensorwire.ops.kernels import reduce_into, reduction_kernel
from tensorwire.ops.reduce_op import as_reduction
from tensorwire.ops.reference import reference
from tensorwire.ops.validation import check_op_dtype

ml_dtypes = pytest.importorskip("ml_dtypes")
torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.timeout(60),
    # random bit patterns overflow and meet NaNs on purpose; numpy's warnings about it are noise here
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:.*(matrix subclass|ComplexHalf).*"),
]

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOAT8 = [
    np.dtype(getattr(ml_dtypes, n))
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
              "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3")
    if hasattr(ml_dtypes, n)
]
INTS = [np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
                              np.uint64)]
FLOATS = [np.dtype(t) for t in (np.float16, np.float32, np.float64, np.longdouble)]
COMPLEX = [np.dtype(t) for t in (np.complex64, np.complex128, np.clongdouble)]
ALL_DTYPES = [np.dtype(np.bool_), *INTS, *FLOATS, *COMPLEX, BF16, *FLOAT8]
PLAIN_OPS = [op for op in ReduceOp if op is not ReduceOp.PREMUL_SUM]


def _red(op: ReduceOp) -> Reduction:
    return premul_sum(0.5) if op is ReduceOp.PREMUL_SUM else Reduction(op)


def _category(dt: np.dtype) -> str:
    if dt == np.bool_:
        return "b"
    if dt in INTS:
        return "i" if dt.kind == "i" else "u"
    if dt in COMPLEX:
        return "c"
    return "f"


ACCEPTED = {  # the documented table: op -> categories it is defined for
    ReduceOp.SUM: "biufc",
    ReduceOp.AVG: "iufc",
    ReduceOp.PRODUCT: "biufc",
    ReduceOp.MIN: "biuf",
    ReduceOp.MAX: "biuf",
    ReduceOp.BAND: "biu",
    ReduceOp.BOR: "biu",
    ReduceOp.BXOR: "biu",
    ReduceOp.PREMUL_SUM: "iufc",
}


# --------------------------------------------------------------------------- op / dtype table

@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("op", list(ReduceOp), ids=lambda o: o.name)
def test_check_op_dtype_table(op: ReduceOp, dt: np.dtype) -> None:
    if _category(dt) in ACCEPTED[op]:
        check_op_dtype(_red(op), dt, rank=3, collective="all_reduce")
        return
    with pytest.raises(InvalidArgumentError) as info:
        check_op_dtype(_red(op), dt, rank=3, collective="all_reduce")
    msg = str(info.value)
    assert msg.startswith("rank 3: all_reduce: "), msg
    assert op.name in msg and dt.name in msg, msg


def test_check_op_dtype_example_message() -> None:
    with pytest.raises(InvalidArgumentError, match=r"^rank 2: all_reduce: BAND is not defined for float32 "
                                                   r"\(bitwise ops need integer or bool dtypes\)$"):
        check_op_dtype(Reduction(ReduceOp.BAND), np.float32, rank=2, collective="all_reduce")


@pytest.mark.parametrize("bad", [np.dtype(object), np.dtype("U3"), np.dtype("S2"), np.dtype([("a", "i4")]),
                                 np.dtype("M8[s]"), np.dtype("m8[s]"), np.dtype(">f4"), np.dtype("V4")],
                         ids=str)
def test_unsupported_dtypes_rejected(bad: np.dtype) -> None:
    with pytest.raises(InvalidArgumentError, match=r"^rank 1: reduce: tensor has unsupported dtype"):
        check_op_dtype(Reduction(ReduceOp.SUM), bad, rank=1, collective="reduce")
    with pytest.raises(InvalidArgumentError):
        dtype_code(bad)


# --------------------------------------------------------------------------- reduce_into vs numpy

def _int_expected(op: ReduceOp, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Python big-int arithmetic wrapped to the dtype: independent of the ufunc under test."""
    bits = a.dtype.itemsize * 8
    fn = {
        ReduceOp.SUM: lambda x, y: x + y, ReduceOp.AVG: lambda x, y: x + y,
        ReduceOp.PREMUL_SUM: lambda x, y: x + y, ReduceOp.PRODUCT: lambda x, y: x * y,
        ReduceOp.MIN: min, ReduceOp.MAX: max, ReduceOp.BAND: lambda x, y: x & y,
        ReduceOp.BOR: lambda x, y: x | y, ReduceOp.BXOR: lambda x, y: x ^ y,
    }[op]
    out = []
    for x, y in zip(a.ravel().tolist(), b.ravel().tolist()):
        v = fn(x, y) % (1 << bits)
        if a.dtype.kind == "i" and v >= 1 << (bits - 1):
            v -= 1 << bits
        out.append(v)
    return np.array(out, dtype=a.dtype).reshape(a.shape)


def _bool_expected(op: ReduceOp, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    fn = {ReduceOp.SUM: lambda x, y: x or y, ReduceOp.PRODUCT: lambda x, y: x and y,
          ReduceOp.MIN: lambda x, y: x and y, ReduceOp.MAX: lambda x, y: x or y,
          ReduceOp.BAND: lambda x, y: x and y, ReduceOp.BOR: lambda x, y: x or y,
          ReduceOp.BXOR: lambda x, y: x != y}[op]
    return np.array([fn(x, y) for x, y in zip(a.ravel().tolist(), b.ravel().tolist())],
                    dtype=bool).reshape(a.shape)


def _float_expected(op: ReduceOp, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Computed in (c)longdouble/float64 and rounded once to the dtype."""
    wide = np.clongdouble if a.dtype.kind == "c" else np.longdouble
    x, y = a.astype(wide), b.astype(wide)
    with np.errstate(all="ignore"):
        if op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM):
            r = x + y
        elif op is ReduceOp.PRODUCT:
            r = x * y
        elif op is ReduceOp.MIN:
            r = np.where(np.isnan(x) | np.isnan(y), np.nan, np.where(x <= y, x, y))
        else:
            r = np.where(np.isnan(x) | np.isnan(y), np.nan, np.where(x >= y, x, y))
        return r.astype(a.dtype)


def _assert_float_close(got: np.ndarray, want: np.ndarray) -> None:
    wide = np.clongdouble if got.dtype.kind == "c" else np.float64
    g, w = got.astype(wide), want.astype(wide)
    if got.dtype in (BF16, *FLOAT8) or got.dtype == np.float16:
        rtol = 2.0 ** -6
    elif got.dtype in (np.float32, np.complex64):
        rtol = 2.0 ** -22
    else:
        rtol = 2.0 ** -50
    if got.dtype.kind != "c":
        np.testing.assert_allclose(g, w, rtol=rtol, atol=0, equal_nan=True)
        return
    # Complex: part by part, within rtol of the whole value's magnitude (a part may cancel).
    # assert_allclose on complex values demands both parts equal wherever either is infinite,
    # and two correct products of huge factors can differ in the last bit of the finite part.
    for gp, wp in ((g.real, w.real), (g.imag, w.imag)):
        inf = np.isinf(gp) | np.isinf(wp)
        np.testing.assert_array_equal(gp[inf], wp[inf])
        scale = np.where(np.isfinite(np.abs(w)), np.abs(w), np.abs(wp))  # the other part inf or nan
        with np.errstate(invalid="ignore"):
            close = (gp == wp) | (np.abs(gp - wp) <= rtol * scale) | (np.isnan(gp) & np.isnan(wp))
        assert close[~inf].all(), f"got {got!r}, want {want!r}"


SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6)


def _values(dt: np.dtype, shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    if dt in (BF16, *FLOAT8):  # every bit pattern: NaN, inf, subnormals included
        raw = np.dtype(np.uint16) if dt.itemsize == 2 else np.dtype(np.uint8)
        return hnp.arrays(raw, shape).map(lambda a: a.view(dt))
    if dt in (np.longdouble, np.clongdouble):
        base = np.float64 if dt == np.longdouble else np.complex128
        return hnp.arrays(base, shape).map(lambda a: a.astype(dt))
    return hnp.arrays(dt, shape)


ACCEPTED_PAIRS = [(op, dt) for op in ReduceOp for dt in ALL_DTYPES if _category(dt) in ACCEPTED[op]]


@pytest.mark.parametrize(("op", "dt"), ACCEPTED_PAIRS, ids=[f"{o.name}-{d}" for o, d in ACCEPTED_PAIRS])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_reduce_into_matches_numpy(op: ReduceOp, dt: np.dtype, data: st.DataObject) -> None:
    shape = data.draw(SHAPES)
    a = data.draw(_values(dt, shape))
    b = data.draw(_values(dt, shape))
    if dt.kind == "c" and op is ReduceOp.PRODUCT:
        # numpy's complex product overflows in its intermediates (a·c − b·d) short of the
        # range's end, and turns some overflows into nan: numpy's arithmetic, which the
        # reduction calls, against a reference computed exactly (found by hypothesis:
        # (1e154+1e154j)² gave nan+infj for 0+infj)
        limit = np.sqrt(np.finfo(dt).max) / 4
        parts = np.abs(np.concatenate([a.reshape(-1).view(a.real.dtype), b.reshape(-1).view(b.real.dtype)]))
        with np.errstate(invalid="ignore"):
            assume(not (parts >= limit).any())
    dst = a.copy()
    reduce_into(dst, b, op)
    assert dst.dtype == dt and dst.shape == shape
    cat = _category(dt)
    if cat == "b":
        np.testing.assert_array_equal(dst, _bool_expected(op, a, b))
    elif cat in "iu":
        np.testing.assert_array_equal(dst, _int_expected(op, a, b))
    else:
        _assert_float_close(dst, _float_expected(op, a, b))


@pytest.mark.parametrize("dt", [np.dtype(np.float32), np.dtype(np.int32), np.dtype(np.float16), BF16],
                         ids=str)
def test_reduce_into_does_not_allocate(dt: np.dtype) -> None:
    dst = np.ones(1 << 18, dt)
    src = np.ones(1 << 18, dt)
    reduce_into(dst[:16], src[:16], ReduceOp.SUM)  # warm the table
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        reduce_into(dst, src, ReduceOp.SUM)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10, f"reduce_into allocated {peak} bytes"


def test_reduce_into_unaligned_readonly_source() -> None:
    """Transports hand over a slice of a received uint8 buffer: possibly unaligned and read-only."""
    raw = np.zeros(4 * 64 + 1, np.uint8)
    src = raw[1:].view(np.float32)
    src_vals = np.arange(64, dtype=np.float32)
    raw[1:] = src_vals.view(np.uint8)
    raw.flags.writeable = False
    dst = np.ones(64, np.float32)
    reduce_into(dst, src, ReduceOp.SUM)
    np.testing.assert_array_equal(dst, src_vals + 1)


def test_e8m0_product_rounds_the_exact_product_once() -> None:
    """float8_e8m0fnu spans float32's exponents: its products below 2**-149 are the dtype's
    rounding of the exact value (its smallest, with ml_dtypes >= 0.7 and torch), not the NaN
    that a float32 intermediate's 0 becomes. Found by hypothesis in CI."""
    dt = np.dtype(ml_dtypes.float8_e8m0fnu)
    bits = np.array([0, 0, 1, 60, 127, 254, 200, 255], np.uint8)
    other = np.array([0, 127, 5, 60, 128, 254, 200, 127], np.uint8)
    a, b = bits.view(dt), other.view(dt)
    got = a.copy()
    reduce_into(got, b, ReduceOp.PRODUCT)
    want = (a.astype(np.float64) * b.astype(np.float64)).astype(dt)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    out = np.empty_like(a)
    reduction_kernel(ReduceOp.PRODUCT, dt)(a, b, out)
    np.testing.assert_array_equal(out.view(np.uint8), got.view(np.uint8))


def test_reduce_into_invalid_pair_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="BAND"):
        reduce_into(np.zeros(2, np.float32), np.zeros(2, np.float32), ReduceOp.BAND)
    with pytest.raises(InvalidArgumentError, match="unsupported dtype"):
        reduce_into(np.zeros(2, object), np.zeros(2, object), ReduceOp.SUM)


# --------------------------------------------------------------------------- torch kernels for 16-bit floats

@pytest.mark.parametrize("dt", [np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX],
                         ids=lambda o: o.name)
def test_torch_kernel_agrees_with_numpy(op: ReduceOp, dt: np.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(int(op) + dt.itemsize)
    n = 3 * torch_kernels.TORCH_KERNEL_MIN_ELEMENTS
    a = rng.integers(0, 1 << 16, n, dtype=np.uint16).view(dt)
    b = rng.integers(0, 1 << 16, n, dtype=np.uint16).view(dt)
    b.flags.writeable = False  # received data is read-only
    fast = a.copy()
    reduce_into(fast, b, op)
    monkeypatch.setattr(torch_kernels, "TORCH_KERNEL_MIN_ELEMENTS", 1 << 62)
    slow = a.copy()
    with np.errstate(all="ignore"):
        reduce_into(slow, b, op)
    f64, s64 = fast.astype(np.float64), slow.astype(np.float64)
    assert np.array_equal(np.isnan(f64), np.isnan(s64))
    ok = ~np.isnan(f64)
    if op in (ReduceOp.SUM, ReduceOp.PRODUCT):
        assert np.array_equal(fast.view(np.uint16)[ok], slow.view(np.uint16)[ok])
    else:  # equal values; the sign of an equal zero may differ
        assert np.array_equal(f64[ok], s64[ok])


@pytest.mark.parametrize("dt", [np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("red", [Reduction(ReduceOp.AVG), premul_sum(1 / 3)], ids=str)
def test_torch_finalize_agrees_with_numpy(red: Reduction, dt: np.dtype,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(7)
    base = (rng.standard_normal(2 * torch_kernels.TORCH_KERNEL_MIN_ELEMENTS) * 100).astype(dt)
    fast = base.copy()
    finalize(fast, red, 3)
    monkeypatch.setattr(torch_kernels, "TORCH_KERNEL_MIN_ELEMENTS", 1 << 62)
    slow = base.copy()
    finalize(slow, red, 3)
    assert np.array_equal(fast.view(np.uint16), slow.view(np.uint16))


# --------------------------------------------------------------------------- carriers (torch-only dtypes)

CARRIED = ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]


def _as_carrier(t: torch.Tensor) -> np.ndarray:
    """A tensor's memory as a numpy array of its carrier (what as_array makes without ml_dtypes)."""
    size_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.dtype.itemsize]
    return t.view(size_int).numpy().view(carrier(str(t.dtype).removeprefix("torch.")))


@pytest.mark.parametrize("name", CARRIED)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX],
                         ids=lambda o: o.name)
def test_carrier_kernels_agree_with_ml_dtypes(op: ReduceOp, name: str) -> None:
    """A carrier reduces through torch what ml_dtypes reduces through numpy, bit for bit (but
    for NaN payloads and the sign of equal zeros in MIN/MAX): ranks with and without ml_dtypes
    agree."""
    rng = np.random.default_rng(int(op) + len(name))
    tdtype = getattr(torch, name)
    a, b = (torch.from_numpy((rng.standard_normal(1000) * 8).astype(np.float32)).to(tdtype) for _ in "ab")
    ml = np.dtype(getattr(ml_dtypes, name))
    want = a.view(torch.uint8).numpy().view(ml).copy()
    reduce_into(want, b.view(torch.uint8).numpy().view(ml), op)
    got = _as_carrier(a.clone())
    src = _as_carrier(b)
    src.flags.writeable = False  # received data is read-only
    reduce_into(got, src, op)
    g64, w64 = torch.frombuffer(got, dtype=tdtype).double().numpy(), want.astype(np.float64)
    assert np.array_equal(np.isnan(g64), np.isnan(w64))
    assert np.array_equal(g64[~np.isnan(g64)], w64[~np.isnan(w64)])
    # kernels take three arrays (out = a op b): the one-shot path folds two slots into a third
    out = _as_carrier(torch.zeros(1000, dtype=tdtype))
    reduction_kernel(op, got.dtype)(_as_carrier(a), src, out)
    assert np.array_equal(out.view(np.uint8), got.view(np.uint8))


@pytest.mark.parametrize("name", CARRIED)
@pytest.mark.parametrize("red", [Reduction(ReduceOp.AVG), premul_sum(1 / 3)], ids=str)
def test_carrier_finalize_agrees_with_ml_dtypes(red: Reduction, name: str) -> None:
    tdtype = getattr(torch, name)
    t = torch.from_numpy((np.random.default_rng(3).standard_normal(500) * 50).astype(np.float32)).to(tdtype)
    ml = np.dtype(getattr(ml_dtypes, name))
    want = t.view(torch.uint8).numpy().view(ml).copy()
    finalize(want, red, 3)
    got = _as_carrier(t.clone())
    finalize(got, red, 3)
    g64, w64 = torch.frombuffer(got, dtype=tdtype).double().numpy(), want.astype(np.float64)
    assert np.array_equal(g64, w64, equal_nan=True)


@pytest.mark.parametrize("red", [Reduction(ReduceOp.SUM), Reduction(ReduceOp.PRODUCT),
                                 Reduction(ReduceOp.AVG), premul_sum(0.25)], ids=str)
def test_complex32_computes_in_complex64(red: Reduction) -> None:
    """complex32 has no numpy type at all: its carrier reduces in complex64 and rounds back."""
    rng = np.random.default_rng(5)
    xs = [torch.from_numpy((rng.standard_normal(64) + 1j * rng.standard_normal(64)).astype(np.complex64))
          .to(torch.complex32) for _ in range(3)]
    got = reference([_as_carrier(x) for x in xs], red)
    want = xs[0].to(torch.complex64)
    for x in xs[1:]:
        want = (want * x.to(torch.complex64) if red.op is ReduceOp.PRODUCT else want + x.to(torch.complex64))
        want = want.to(torch.complex32).to(torch.complex64)
    if red.op is ReduceOp.AVG:
        want = (want / 3).to(torch.complex32).to(torch.complex64)
    elif red.op is ReduceOp.PREMUL_SUM:
        want = (want * 0.25).to(torch.complex32).to(torch.complex64)
    assert torch.equal(torch.frombuffer(got, dtype=torch.complex32).to(torch.complex64), want)


def test_carriers_registry() -> None:
    """Carriers share ml_dtypes' codes and names (the wire agrees across installs), refuse what
    their category does not define with torch's name for the dtype, and stay apart from
    numpy's own structured dtypes."""
    for name in CARRIED:
        dt, ml = carrier(name), np.dtype(getattr(ml_dtypes, name))
        assert dt is carrier(name) and dt.itemsize == ml.itemsize
        assert dtype_code(dt) == dtype_code(ml) and dtype_name(dt) == dtype_name(ml)
    c32 = carrier("complex32")
    assert dtype_code(c32) == 25 and dtype_from_code(25) == c32 and lookup(c32).category == "c"
    with pytest.raises(InvalidArgumentError, match=r"BAND is not defined for torch\.bfloat16"):
        check_op_dtype(Reduction(ReduceOp.BAND), carrier("bfloat16"), rank=0, collective="all_reduce")
    with pytest.raises(InvalidArgumentError, match=r"MAX is not defined for torch\.complex32"):
        check_op_dtype(Reduction(ReduceOp.MAX), c32, rank=0, collective="all_reduce")
    assert carrier("float4_e2m1fn_x2") is None
    with pytest.raises(InvalidArgumentError, match="structured"):
        check_dtype(np.dtype([("bfloat16", "=u2")]))  # a user's own record type is not a carrier
    empty = _as_carrier(torch.zeros(0, dtype=torch.bfloat16))
    reduce_into(empty, empty, ReduceOp.SUM)  # nothing to do, and no error
    finalize(empty, Reduction(ReduceOp.AVG), 2)


def test_torch_dtypes_without_ml_dtypes(tmp_path: object) -> None:
    """A plain `pip install tensorwire[torch]`: ml_dtypes cannot be imported, and still every torch
    dtype that torch computes is viewed (a carrier where numpy has no type) and reduced."""
    from test_torch_backend import TORCH_DTYPES, without_ml_dtypes

    code = f"""
import numpy as np, torch
from tensorwire.buffers import as_array
from tensorwire.ops import ReduceOp, Reduction
from tensorwire.ops.reference import reference
for name in {TORCH_DTYPES!r}:
    dtype = getattr(torch, name)
    xs = [(torch.arange(6, dtype=torch.float64) % 3 + k).to(dtype) for k in range(3)]
    views = [as_array(x, writable=True, rank=0, collective="all_reduce") for x in xs]
    views[0][0] = views[1][1]  # the views are the tensors' memory
    assert xs[0][0] == xs[1][1], name
    folded = reference(views, Reduction(ReduceOp.MAX if name == "bool" else ReduceOp.SUM))
    wide = torch.complex128 if dtype.is_complex else torch.float64
    got = torch.from_numpy(folded.view(np.uint8)).view(dtype).to(wide)
    x0, x1, x2 = (x.to(wide) for x in xs)
    want = ((x0 + x1).to(dtype).to(wide) + x2).to(dtype).to(wide)  # rounded as the dtype rounds each step
    assert torch.equal(got, want), (name, got, want)
import sys
assert sys.modules.get("ml_dtypes") is None
"""
    env = dict(os.environ, PYTHONPATH=without_ml_dtypes(tmp_path))  # type: ignore[arg-type]
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=env)


# --------------------------------------------------------------------------- finalize

def test_finalize_avg_float_and_int() -> None:
    f = np.array([3.0, -6.0, 1.0], np.float32)
    finalize(f, Reduction(ReduceOp.AVG), 3)
    np.testing.assert_array_equal(f, np.array([1.0, -2.0, 1 / 3], np.float32))
    i = np.array([7, -7, 6, 0], np.int32)
    finalize(i, Reduction(ReduceOp.AVG), 2)
    np.testing.assert_array_equal(i, [3, -4, 3, 0])  # floor division
    u = np.array([255, 9], np.uint8)
    finalize(u, Reduction(ReduceOp.AVG), 300)  # group larger than the dtype's range
    np.testing.assert_array_equal(u, [0, 0])
    s = np.array([-5, 5], np.int8)
    finalize(s, Reduction(ReduceOp.AVG), 1000)
    np.testing.assert_array_equal(s, [-1, 0])
    c = np.array([2 + 4j], np.complex64)
    finalize(c, Reduction(ReduceOp.AVG), 2)
    np.testing.assert_array_equal(c, [1 + 2j])


def test_finalize_avg_low_precision_uses_float32_divisor() -> None:
    """float16 cannot represent 3001 nor e4m3 17; the divisor must not be rounded to them."""
    h = np.array([12004.0], np.float16)
    h0 = np.float32(h[0])
    finalize(h, Reduction(ReduceOp.AVG), 3001)
    assert h[0] == np.float16(h0 / np.float32(3001))
    assert h[0] != np.float16(h0 / np.float32(np.float16(3001)))  # what a float16 divisor would give
    e = np.array([136.0], np.float32).astype(FLOAT8[0])
    e0 = np.float32(e[0])
    finalize(e, Reduction(ReduceOp.AVG), 17)
    assert e[0] == e.dtype.type(e0 / np.float32(17))


def test_finalize_premul_sum() -> None:
    f = np.array([2.0, -4.0], np.float64)
    finalize(f, premul_sum(0.25), 8)
    np.testing.assert_array_equal(f, [0.5, -1.0])
    i = np.array([100, -3, 127], np.int8)
    finalize(i, premul_sum(2.0), 4)  # integral factor: exact wrapping integer multiply
    np.testing.assert_array_equal(i, np.array([200, -6, 254]).astype(np.int8))
    j = np.array([7, -7, 10], np.int32)
    finalize(j, premul_sum(0.5), 4)  # fractional: float64 product truncated toward zero
    np.testing.assert_array_equal(j, [3, -3, 5])
    b = np.array([1.5], BF16)
    finalize(b, premul_sum(2.0), 2)
    assert float(b[0]) == 3.0


def test_finalize_other_ops_noop_and_errors() -> None:
    x = np.array([5, 6], np.int64)
    for op in PLAIN_OPS:
        if op is not ReduceOp.AVG:
            finalize(x, Reduction(op), 4)
    np.testing.assert_array_equal(x, [5, 6])
    with pytest.raises(InvalidArgumentError):
        finalize(np.ones(2, bool), Reduction(ReduceOp.AVG), 2)
    with pytest.raises(InvalidArgumentError):
        finalize(np.ones(2, np.float32), Reduction(ReduceOp.AVG), 0)


# --------------------------------------------------------------------------- reference

def test_reference_folds_in_rank_order_and_keeps_inputs() -> None:
    arrays = [np.array(v, np.float32) for v in ([1.0, 8.0], [2.0, 2.0], [3.0, -1.0])]
    copies = [a.copy() for a in arrays]
    np.testing.assert_array_equal(reference(arrays, Reduction(ReduceOp.SUM)), [6.0, 9.0])
    np.testing.assert_array_equal(reference(arrays, Reduction(ReduceOp.AVG)), [2.0, 3.0])
    np.testing.assert_array_equal(reference(arrays, Reduction(ReduceOp.MAX)), [3.0, 8.0])
    np.testing.assert_array_equal(reference(arrays, premul_sum(0.5)), [3.0, 4.5])
    for a, c in zip(arrays, copies):
        np.testing.assert_array_equal(a, c)
    # fold-left order is visible in float32 rounding: (1e8 + 1) + -1e8 != 1e8 + (1 + -1e8) generally
    big = [np.array([1e8], np.float32), np.array([1.0], np.float32), np.array([-1e8], np.float32)]
    expect = (np.float32(1e8) + np.float32(1.0)) + np.float32(-1e8)
    assert reference(big, Reduction(ReduceOp.SUM))[0] == expect


def test_reference_integer_avg_and_shape_checks() -> None:
    arrays = [np.array([[1, -2]], np.int16), np.array([[2, -3]], np.int16)]
    out = reference(arrays, Reduction(ReduceOp.AVG))
    assert out.shape == (1, 2) and out.dtype == np.int16
    np.testing.assert_array_equal(out, [[1, -3]])
    with pytest.raises(InvalidArgumentError):
        reference([np.zeros(2), np.zeros(3)], Reduction(ReduceOp.SUM))
    with pytest.raises(InvalidArgumentError):
        reference([], Reduction(ReduceOp.SUM))
    with pytest.raises(InvalidArgumentError, match="BOR"):
        reference([np.zeros(2)], Reduction(ReduceOp.BOR))


# --------------------------------------------------------------------------- as_reduction

@pytest.mark.parametrize(("text", "op"), [
    ("sum", ReduceOp.SUM), ("AVG", ReduceOp.AVG), ("prod", ReduceOp.PRODUCT), ("Product", ReduceOp.PRODUCT),
    ("min", ReduceOp.MIN), ("MAX", ReduceOp.MAX), ("band", ReduceOp.BAND), ("bor", ReduceOp.BOR),
    ("bXor", ReduceOp.BXOR), (" Sum ", ReduceOp.SUM),
])
def test_as_reduction_strings(text: str, op: ReduceOp) -> None:
    assert as_reduction(text) == Reduction(op)


def test_as_reduction_ours_and_errors() -> None:
    assert as_reduction(ReduceOp.MIN) == Reduction(ReduceOp.MIN)
    r = premul_sum(0.125)
    assert as_reduction(r) is r
    assert as_reduction(4) == Reduction(ReduceOp.MAX)
    with pytest.raises(InvalidArgumentError, match="premul_sum"):
        as_reduction(ReduceOp.PREMUL_SUM, rank=1, collective="all_reduce")
    with pytest.raises(InvalidArgumentError, match=r"^rank 1: reduce: unknown reduce op 'mean'"):
        as_reduction("mean", rank=1, collective="reduce")
    with pytest.raises(InvalidArgumentError):
        as_reduction(3.5)
    with pytest.raises(InvalidArgumentError):
        as_reduction(True)
    with pytest.raises(InvalidArgumentError):
        Reduction(ReduceOp.SUM, 2.0)
    with pytest.raises(InvalidArgumentError):
        premul_sum(1j)  # type: ignore[arg-type]


def test_as_reduction_torch() -> None:
    import torch.distributed as dist

    names = {"SUM": ReduceOp.SUM, "AVG": ReduceOp.AVG, "PRODUCT": ReduceOp.PRODUCT, "MIN": ReduceOp.MIN,
             "MAX": ReduceOp.MAX, "BAND": ReduceOp.BAND, "BOR": ReduceOp.BOR, "BXOR": ReduceOp.BXOR}
    for name, op in names.items():
        assert as_reduction(getattr(dist.ReduceOp, name)) == Reduction(op)
        assert as_reduction(dist.ReduceOp(getattr(dist.ReduceOp, name))) == Reduction(op)
    assert as_reduction(dist._make_nccl_premul_sum(0.25)) == premul_sum(0.25)
    assert as_reduction(dist._make_nccl_premul_sum(torch.tensor([0.5]))) == premul_sum(0.5)
    with pytest.raises(InvalidArgumentError, match="PREMUL_SUM"):
        as_reduction(dist.ReduceOp.PREMUL_SUM, rank=0, collective="all_reduce")


# --------------------------------------------------------------------------- dtype codes and names

def test_dtype_codes_unique_and_roundtrip() -> None:
    codes = [dtype_code(dt) for dt in ALL_DTYPES]
    assert len(set(codes)) == len(codes)
    assert all(0 <= c < 256 for c in codes)
    for dt, c in zip(ALL_DTYPES, codes):
        assert dtype_from_code(c) == dt
        assert dtype_from_name(dtype_name(dt)) == dt
        assert dtype_from_name(dt.name) == dt
    assert dtype_code(np.dtype("q")) == dtype_code(np.int64) == 7  # platform aliases share a code
    with pytest.raises(InvalidArgumentError):
        dtype_from_code(999)


def test_dtype_names() -> None:
    expected = {np.float32: "float", np.float64: "double", np.float16: "half", BF16: "bfloat16",
                np.int8: "int8", np.uint8: "uint8", np.int32: "int32", np.uint32: "uint32",
                np.int64: "int64", np.uint64: "uint64"}
    for dt, name in expected.items():
        assert dtype_name(dt) == name
    assert dtype_from_name("float") == np.float32  # nccl-tests meaning, not numpy's float64
    assert dtype_from_name("float32") == np.float32
    assert dtype_from_name("f8") == np.float64
    assert dtype_from_name("bf16") == BF16
    assert dtype_from_name("torch.bfloat16") == BF16
    assert dtype_from_name("f8e4m3") == np.dtype(ml_dtypes.float8_e4m3fn)
    with pytest.raises(InvalidArgumentError):
        dtype_from_name("object")
    with pytest.raises(InvalidArgumentError):
        dtype_from_name("nonsense")


def test_importing_does_not_import_torch_or_ml_dtypes() -> None:
    code = ("import sys, tensorwire.ops.reference, tensorwire.ops.carriers, tensorwire.buffers; "
            "assert 'torch' not in sys.modules and 'ml_dtypes' not in sys.modules, "
            "[m for m in ('torch', 'ml_dtypes') if m in sys.modules]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


# --------------------------------------------------------------------------- as_array

def _view(obj: object, writable: bool = True) -> np.ndarray:
    return as_array(obj, writable=writable, rank=2, collective="all_reduce")


def test_as_array_numpy_zero_copy_any_shape() -> None:
    for arr in (np.zeros((2, 3), np.float32), np.zeros((), np.int64), np.zeros((0, 4), BF16)):
        v = _view(arr)
        assert v is arr or np.shares_memory(v, arr) or arr.size == 0
    m = np.asmatrix(np.zeros((2, 2)))
    v = _view(m)
    assert type(v) is np.ndarray
    v[0, 0] = 3
    assert m[0, 0] == 3


@pytest.mark.parametrize("tdtype", ["float32", "bfloat16", "bool", "int64", "float16", "complex64", "uint8",
                                    "float8_e4m3fn"])
def test_as_array_torch_shares_memory(tdtype: str) -> None:
    t = torch.zeros((2, 3), dtype=getattr(torch, tdtype))
    v = _view(t)
    assert v.shape == (2, 3) and v.flags.c_contiguous
    v[1, 2] = 1
    assert t[1, 2].item() == 1
    wide = t.to(torch.complex128) if t.is_complex() else t.double()
    assert torch.count_nonzero(wide).item() == 1
    if tdtype == "bfloat16":
        assert v.dtype == BF16


def test_as_array_torch_scalar_empty_and_grad() -> None:
    t = torch.zeros((), dtype=torch.bfloat16)
    v = _view(t)
    assert v.shape == ()
    v[()] = 2.5
    assert t.item() == 2.5
    assert _view(torch.zeros(0, 5)).shape == (0, 5)
    p = torch.nn.Parameter(torch.zeros(3))
    v = _view(p)
    v[0] = 4
    assert p[0].item() == 4


def test_as_array_buffer_protocol_zero_copy() -> None:
    b = bytearray(8)
    v = _view(b)
    assert v.dtype == np.uint8
    v[3] = 9
    assert b[3] == 9
    buf = bytearray(16)
    mv = memoryview(buf).cast("i")
    v = _view(mv)
    assert v.dtype == np.int32 and v.shape == (4,)
    v[1] = -2
    assert mv[1] == -2
    a = array.array("d", [1.0, 2.0])
    v = _view(a)
    assert v.dtype == np.float64
    v[1] = 5.0
    assert a[1] == 5.0
    assert _view(bytearray()).shape == (0,)
    ro = _view(b"abc", writable=False)
    assert ro.tolist() == [97, 98, 99]


class _DLPackOnly:
    """A producer that offers DLPack and nothing else (no buffer protocol, not a torch tensor)."""

    def __init__(self, inner: object) -> None:
        self._inner = inner

    def __dlpack__(self, **kwargs: object) -> object:
        return self._inner.__dlpack__(**kwargs)  # type: ignore[attr-defined]

    def __dlpack_device__(self) -> object:
        return self._inner.__dlpack_device__()  # type: ignore[attr-defined]


def test_as_array_dlpack_zero_copy() -> None:
    t = torch.arange(4, dtype=torch.int32)
    v = _view(_DLPackOnly(t))
    v[0] = 42
    assert t[0].item() == 42
    n = np.zeros(3)
    assert np.shares_memory(_view(_DLPackOnly(n), writable=False), n)


@pytest.mark.parametrize(
    ("obj", "pattern"),
    [
        (np.zeros((4, 4))[:, 1], "not C-contiguous.*ascontiguousarray"),
        (np.zeros(3, object), "unsupported dtype object"),
        (np.array(["a"]), "unsupported dtype <U1"),
        (np.zeros(2, [("a", "i4")]), "unsupported dtype"),
        (np.zeros(2, "M8[s]"), "unsupported dtype datetime64"),
        (np.zeros(2, ">f4"), "byte order"),
        ([1, 2, 3], "type builtins.list is not supported"),
        (3.0, "type builtins.float is not supported"),
        (b"abc", "read-only"),
        (memoryview(bytearray(4)).toreadonly(), "read-only"),
        (array.array("u", "ab"), "unsupported dtype|cannot read"),
        (np.zeros(2, ml_dtypes.int4), "unsupported dtype int4 \\(this ml_dtypes type is not supported"),
    ],
    ids=["strided", "object", "str", "structured", "datetime", "big-endian", "list", "float", "bytes",
         "ro-memoryview", "array-u", "int4"],
)
def test_as_array_rejections(obj: object, pattern: str) -> None:
    with pytest.raises(InvalidArgumentError, match=r"^rank 2: all_reduce: (.|\n)*(" + pattern + ")"):
        _view(obj)


def test_torch_views_are_kept_by_memory() -> None:
    """A small tensor's view is made once: again for the same memory, dtype and shape, whichever
    tensor object shows it (planned collectives find it through seen_torch_view)."""
    t = torch.zeros(4)
    v = _view(t)
    assert _view(t) is v and buffers.seen_torch_view(t) is v
    assert buffers.seen_torch_view(t.view(-1)) is v and buffers.seen_torch_view(t[:]) is v
    assert buffers.seen_torch_view(t.view(2, 2)) is None  # another shape: another view
    p = torch.nn.Parameter(torch.zeros(3))
    assert buffers.seen_torch_view(p) is None and _view(p) is buffers.seen_torch_view(p)
    big = torch.zeros(buffers.VIEWED_BYTES // 4 + 1)
    assert _view(big) is not _view(big) and buffers.seen_torch_view(big) is None
    assert buffers.seen_torch_view(np.zeros(4)) is None and buffers.seen_torch_view(bytearray(4)) is None
    for _ in range(3 * buffers._VIEWS_MAX):  # bounded however many tensors pass
        _view(torch.zeros(2))
    assert len(buffers._VIEWS) <= buffers._VIEWS_MAX


def test_torch_views_follow_the_tensor() -> None:
    """A kept view is used only while it is exactly the tensor's memory: after set_, resize_,
    `.data =` or a transposition the tensor is looked at afresh, and lazy conjugate/negative
    views of kept memory are refused as they are the first time."""
    t = torch.zeros(4)
    v = _view(t)
    t.set_(torch.ones(4))
    assert buffers.seen_torch_view(t) is None
    assert _view(t) is not v and _view(t)[0] == 1
    t.resize_(2)
    assert _view(t).shape == (2,)
    t.data = torch.zeros(4, dtype=torch.float64)
    assert _view(t).dtype == np.float64
    sq = torch.zeros(3, 3)
    _view(sq)
    assert buffers.seen_torch_view(sq.t()) is None  # x.t() of a square x: x's address, dtype and shape
    with pytest.raises(InvalidArgumentError, match="not contiguous"):
        _view(sq.t())
    z = torch.tensor([1 + 2j], dtype=torch.complex64)
    _view(z)
    _view(z.imag)  # one element: contiguous, and kept
    for lazy in (z.conj(), z.conj().imag, torch._neg_view(z)):
        assert buffers.seen_torch_view(lazy) is None
        with pytest.raises(InvalidArgumentError, match="conjugate/negative"):
            _view(lazy)


def test_a_tensor_a_call_viewed_stays_resizable_and_its_kept_view_lets_go() -> None:
    """Viewing a tensor leaves its storage resizable (torch's first FSDP frees parameters by
    resizing theirs to 0); once resized away, its kept view serves no tensor that takes its old
    address (it would show memory no longer the tensor's)."""
    import ctypes

    t = torch.ones(4)
    v = _view(t)
    old = t.data_ptr()
    t.untyped_storage().resize_(0)
    at_old = torch.frombuffer((ctypes.c_char * 16).from_address(old), dtype=torch.float32)  # not read
    assert at_old.data_ptr() == old and buffers.seen_torch_view(at_old) is None
    t.untyped_storage().resize_(16)
    t.fill_(2.0)
    assert _view(t)[0] == 2.0 and v.base is not None


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                   "float8_e8m0fnu", "bfloat16"])
def test_torch_16_and_8_bit_floats_view_as_their_ml_dtypes(dtype: str) -> None:
    """Each torch float of 8 or 16 bits views as its ml_dtypes type, writes landing in the tensor
    (float8_e5m2's typestr '<f1' is one numpy cannot read back)."""
    pytest.importorskip("ml_dtypes")
    t = torch.full((3,), 2.0, dtype=getattr(torch, dtype))
    a = _view(t)
    assert a.dtype.name == dtype and a.shape == (3,) and float(a[0]) == 2.0
    a[1] = a[0] * 2
    assert float(t[1]) == 4.0


def test_as_array_rejects_read_only_numpy_only_when_writing() -> None:
    a = np.zeros(3)
    a.flags.writeable = False
    assert _view(a, writable=False) is a
    with pytest.raises(InvalidArgumentError, match="read-only"):
        _view(a)


@pytest.mark.parametrize("make", [lambda: torch.zeros(3, 3).t(), lambda: torch.zeros(2, device="meta"),
                                  lambda: torch.zeros(2, 2).to_sparse(),
                                  lambda: torch.zeros(2, dtype=torch.complex64).conj(),
                                  lambda: torch.empty(2, dtype=torch.float4_e2m1fn_x2)],
                         ids=["non-contiguous", "other-device", "sparse", "conj", "float4"])
def test_as_array_torch_rejections(make: object) -> None:
    t = make()  # type: ignore[operator]
    with pytest.raises(InvalidArgumentError, match=r"^rank 2: all_reduce: tensor "):
        _view(t)


# --------------------------------------------------------------------------- flat / byte_view / like_torch

def test_flat_and_byte_view_never_copy() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    f = flat(a)
    assert f.shape == (12,) and np.shares_memory(f, a)
    bv = byte_view(a)
    assert bv.dtype == np.uint8 and bv.shape == (48,) and np.shares_memory(bv, a)
    bv[:4] = np.frombuffer(np.float32(7).tobytes(), np.uint8)
    assert a[0, 0] == 7
    s = np.zeros((), np.int16)
    assert flat(s).shape == (1,) and byte_view(s).shape == (2,)
    e = np.zeros((0, 3), BF16)
    assert byte_view(e).shape == (0,)
    h = np.ones(3, BF16)
    assert byte_view(h).shape == (6,) and np.shares_memory(byte_view(h), h)
    with pytest.raises(InvalidArgumentError):
        flat(np.zeros((4, 4))[:, 0])
    with pytest.raises(InvalidArgumentError):
        byte_view(np.zeros((4, 4))[:, 0])


@pytest.mark.parametrize("tdtype", ["float32", "bfloat16", "bool", "int64"])
def test_like_torch_zero_copy(tdtype: str) -> None:
    template = torch.zeros(1, dtype=getattr(torch, tdtype))
    arr = _view(torch.zeros(4, dtype=getattr(torch, tdtype)))  # a numpy array of the matching dtype
    out = like_torch(template, arr)
    assert out.dtype == template.dtype and tuple(out.shape) == (4,)
    arr[2] = 1
    assert out[2].item() == 1
    with pytest.raises(InvalidArgumentError):
        like_torch(template, np.zeros(4, np.complex128))


@pytest.mark.parametrize("nbytes", [4096, 16 << 10, (64 << 10) + 24, 300 << 10, PIECE + 24,
                                    2 * PIECE + 4096 + 8])
@pytest.mark.parametrize("shift", [0, 8, 16, 24, 31, 32, 48, 2048, 4088])
def test_copy_is_bitwise_at_every_offset(nbytes: int, shift: int) -> None:
    """copy() takes a vector loop where memcpy meets its slow window (1-31 bytes past the source
    modulo 4096), and copies larger than a PIECE in pieces (the last one short): the bytes must
    come out identical, NaN payloads and -0.0 included."""
    rng = np.random.default_rng(shift + nbytes)
    pool = np.zeros(3 * nbytes + 16384, np.uint8)
    src_at = (-pool.ctypes.data) % 4096 + 4096  # page-aligned source
    dst_at = src_at + (nbytes + 4095) // 4096 * 4096 + 4096 + shift
    for dt in (np.uint8, np.float32, np.float64):
        count = nbytes // np.dtype(dt).itemsize
        src = pool[src_at:src_at + count * np.dtype(dt).itemsize].view(dt)
        dst = pool[dst_at:dst_at + src.nbytes].view(dt)
        src.view(np.uint8)[...] = rng.integers(0, 256, src.nbytes, dtype=np.uint8)
        if dt is not np.uint8:
            src[:2] = [-0.0, np.nan]
        copy(dst, src)
        assert (dst.ctypes.data - src.ctypes.data) % 4096 == shift
        assert dst.tobytes() == src.tobytes()
    cast = np.zeros(count, np.float64)  # a different dtype still casts, as np.copyto does
    copy(cast, np.arange(count, dtype=np.int32))
    assert cast[-1] == count - 1


def _mapping(address: int) -> tuple[int, int, list[str]]:
    """The start, end and VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = (lo, hi) if lo <= address < hi else None
            elif inside and head == "VmFlags:":
                return (*inside, line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("nbytes", [0, 1, 4096, HUGE_PAGE - 1, 3 * HUGE_PAGE + 5])
def test_huge_zeros_are_aligned_zeroed_private_and_advised(nbytes: int) -> None:
    """The bench's buffers and the calibration's huge-page reads: 2 MiB aligned, zero, writable,
    independent of each other, advised for huge pages (VmFlags `hg`) in a private mapping (a
    shared one would follow shmem's huge page setting, `never` by default) that holds every
    huge page the buffer touches whole (one reaching past the mapping stays in 4 KiB pages)."""
    a, b = huge_zeros(nbytes), huge_zeros(nbytes)
    assert a.dtype == np.uint8 and a.shape == (nbytes,) and a.flags.writeable and a.flags.c_contiguous
    assert a.ctypes.data % HUGE_PAGE == 0 and not a.any()
    if nbytes:
        a[:] = 7
        assert not b.any() and (a == 7).all()
        _, end, flags = _mapping(a.ctypes.data)
        assert "hg" in flags and "sh" not in flags, flags
        assert end >= a.ctypes.data + -(-nbytes // HUGE_PAGE) * HUGE_PAGE


@pytest.mark.parametrize("shift", [1000, -1000, 16, -16])
def test_copy_between_overlapping_arrays(shift: int) -> None:
    """copy() of arrays that overlap, past PIECE and in the slow window alike: the source as it
    was (pieces front to back would re-read what an earlier piece overwrote)."""
    n = 3 * PIECE + 5
    buf = (np.arange(n + 2 * abs(shift)) % 251).astype(np.uint8)
    dst = buf[abs(shift):abs(shift) + n]
    src = buf[abs(shift) + shift:abs(shift) + shift + n]
    want = src.copy()
    copy(dst, src)
    assert np.array_equal(dst, want)


def test_page_scanner_counts_huge_pages() -> None:
    """What single copy's sources report (transport/pages.py): eighths of a buffer in huge pages,
    rounded down, 8 for nothing at all; a span counted twice (an in-place call) keeps the share;
    UNKNOWN where the kernel cannot tell or no page is there yet, and answers kept for a moment
    (pages.KEEP_S)."""
    import mmap

    from tensorwire.transport import pages

    scanner = pages.PageScanner()
    huge = huge_zeros(4 * HUGE_PAGE)
    huge[:] = 1
    whole = (huge.ctypes.data, huge.nbytes)
    got = scanner.eighths([whole])
    if got == pages.UNKNOWN:
        pytest.skip("the kernel has no PAGEMAP_SCAN (Linux 6.7+)")
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        if "[never]" in f.read():
            pytest.skip("transparent huge pages are off")
    region = mmap.mmap(-1, 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_NOHUGEPAGE)
    small = np.frombuffer(region, np.uint8)
    small[:] = 1
    part = (small.ctypes.data, small.nbytes)
    assert got == 8 and scanner.eighths([part]) == 0 and scanner.eighths([]) == 8
    # three huge pages' worth and one small-paged: 6/8; 16 MiB huge (counted twice) and 4 small: 6/8
    three = (huge.ctypes.data, 3 * HUGE_PAGE)
    assert scanner.eighths([three, (small.ctypes.data, HUGE_PAGE)]) == 6
    assert scanner.eighths([whole, whole, part]) == 8 * 16 // 20
    # an unaligned piece of a huge page is huge throughout
    assert scanner.eighths([(huge.ctypes.data + 100, 1000)]) == 8
    blind = pages.PageScanner()
    blind._ioctl = None
    assert blind.eighths([whole]) == pages.UNKNOWN
    # pages not there yet (or only the zero page, read and never written) are left out: an
    # output its peers read once this rank has written it is counted by what it becomes
    fresh = huge_zeros(2 * HUGE_PAGE)
    span = (fresh.ctypes.data, fresh.nbytes)
    assert scanner.eighths([span]) == pages.UNKNOWN
    assert int(fresh.sum()) == 0 and pages.PageScanner().eighths([span]) == pages.UNKNOWN
    assert pages.PageScanner().eighths([span, part]) == 0  # only the small pages are there
    fresh[:HUGE_PAGE] = 1
    assert pages.PageScanner().eighths([span]) == 8


def test_a_forked_child_scans_its_own_pages() -> None:
    """pages.scanner() keeps /proc/self/pagemap open, which names the process that opened it:
    a forked child must open its own (or it would report its parent's pages)."""
    from tensorwire.transport import pages

    def opened(scanner: pages.PageScanner) -> str:
        return os.readlink(f"/proc/self/fd/{scanner._fd}")

    assert pages.scanner() is pages.scanner()
    assert opened(pages.scanner()) == f"/proc/{os.getpid()}/pagemap"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: whatever happens, it leaves here
        try:
            os.write(write, opened(pages.scanner()).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        assert os.read(read, 200).decode() == f"/proc/{pid}/pagemap"
    finally:
        os.close(read)
        os.waitpid(pid, 0)


def test_address_is_numpy_s_for_every_kind_of_array() -> None:
    """buffers.address reads through ctypes where it can and falls back to numpy's address
    elsewhere: the same number either way."""
    a = np.arange(100, dtype=np.float32)
    frozen = a[3:].view()
    frozen.flags.writeable = False
    for x in (a, a[10:], a[:0], a[::-2], frozen, np.frombuffer(b"abcd", np.uint8), a.reshape(10, 10)[2:]):
        assert buffers.address(x) == x.ctypes.data
