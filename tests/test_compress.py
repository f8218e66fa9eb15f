"""The compressed all_reduce (`compress="bf16"` / `"fp16"`): the codecs' rounding bound (property
based), the argument errors and the exact result on one host (a shared cluster), the price
`tensorwire plan` gives it. Across emulated hosts: tests/compress_job.py, which
tests/test_multihost.py runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from compress_job import floor, rounding
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import tensorwire as tw
from tensorwire.errors import InvalidArgumentError
from tensorwire.ops.compress import CODECS, words_for

pytestmark = pytest.mark.timeout(60)


# -- the codecs, in this process --------------------------------------------------------------

def _arrays(dtype: type) -> st.SearchStrategy[np.ndarray]:
    width = 32 if dtype is np.float32 else 64
    values = st.floats(allow_nan=False, allow_infinity=False, width=width)  # the whole range
    return hnp.arrays(dtype, st.integers(0, 64), elements=values)


@settings(max_examples=150, deadline=None)
@example("fp16", np.array([2.22507386e-309]))  # a float64 subnormal: its scale is beyond 2.0 ** 1024
@example("bf16", np.array([3.4028e38], np.float32))  # rounded up to 2**128 (inf) before it saturated
@example("fp16", np.array([3.4028e38], np.float32))  # ... to 2**15 at scale 2**113, the same
@example("bf16", np.array([3e-300, 6e-300]))  # below float32's range: flushed to 0 before it was scaled up
@given(st.sampled_from(sorted(CODECS)), st.sampled_from([np.float32, np.float64]).flatmap(_arrays))
def test_codec_round_trip_within_its_unit(name: str, x: np.ndarray) -> None:
    """encode then decode loses at most the codec's unit roundoff of each value (plus the floor
    near zero), wherever the values lie in their dtype's range: float16 pieces are scaled."""
    codec = CODECS[name]
    words = np.empty(words_for(x.size), np.uint16)
    codec.encode(x, words)
    back = np.zeros_like(x)
    codec.decode(words, back)
    peak = float(np.abs(x).max()) if x.size else 0.0
    limit = rounding(codec, x.dtype) * np.abs(x) + floor(codec, peak, x.dtype)
    assert np.all(np.abs(back - x) <= limit), (name, x, back)
    again = np.ones_like(x)
    codec.decode(words, again, add=True)
    assert np.array_equal(again, back + 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("finite", [1e6, 1e-6, 3e38])
def test_special_values_cross_as_they_are(dtype: type, finite: float) -> None:
    """inf and NaN cross as they are, and the piece's finite values keep their bound (a float16
    piece with an inf or NaN went unscaled: 1e6 became inf, 1e-6 lost 1.3 %)."""
    for name, codec in CODECS.items():
        x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, finite, -finite / 3], dtype)
        words = np.empty(words_for(x.size), np.uint16)
        codec.encode(x, words)
        back = np.empty_like(x)
        codec.decode(words, back)
        assert np.isnan(back[0]) and list(back[1:5]) == [np.inf, -np.inf, 0.0, 0.0], name
        assert np.signbit(back[4]), name
        assert np.all(np.abs(back[5:] - x[5:]) <= rounding(codec, x.dtype) * np.abs(x[5:])), (name, back)


def test_bfloat16_bits_without_ml_dtypes_match_it() -> None:
    """The fallback rounding on the bits (no ml_dtypes) gives ml_dtypes' words, NaNs included."""
    from tensorwire.ops import compress

    x = np.random.default_rng(3).standard_normal(4096).astype(np.float32) * 1e3
    x[:4] = [np.nan, np.float32(3.3895314e38), 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8]  # ties to even
    mine = np.empty(x.size, np.uint16)
    compress._bf16_bits(x, mine)
    theirs = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert np.isnan(mine[:1].view(ml_dtypes.bfloat16).astype(np.float32)[0])
    assert np.array_equal(mine[1:], theirs[1:])


# -- arguments and one host, on a shared cluster -------------------------------------------------

def _outcome(fn: Callable[[], Any]) -> str | None:
    try:
        fn()
    except InvalidArgumentError as exc:
        return str(exc)
    return None


def rank_bad_arguments() -> list[str | None]:
    """Each bad call on a fresh group (an argument error aborts its group on every rank)."""
    cases = [
        (np.arange(8, dtype=np.int32), "bf16", tw.ReduceOp.SUM),
        (np.ones(8, np.float16), "fp16", tw.ReduceOp.SUM),
        (np.ones(8, ml_dtypes.bfloat16), "bf16", tw.ReduceOp.SUM),
        (np.ones(8, np.float32), "int8", tw.ReduceOp.SUM),
        (np.ones(8, np.float32), "bf16", tw.ReduceOp.MAX),
    ]
    out = []
    for x, compress, op in cases:
        g = tw.new_group()
        tw.barrier(timeout=30)
        out.append(_outcome(functools.partial(g.all_reduce, x, op, compress=compress)))
    return out


def test_bad_arguments_are_errors_naming_what(get_cluster: Callable[..., Any]) -> None:
    results = get_cluster(2, "shm").run(rank_bad_arguments)
    for rank, msgs in enumerate(results):
        assert all(m is not None and f"rank {rank}" in m for m in msgs), msgs
        ints, half, bf16, value, op = msgs
        assert "int32" in ints and "compresses float32 and float64 only" in ints
        assert "float16" in half and "16 bits already" in half
        assert "bfloat16" in bf16 and "16 bits already" in bf16
        assert "compress='int8'" in value and "'bf16'" in value
        assert "SUM and AVG only" in op and "MAX" in op


def rank_compress_differs() -> str:
    """Rank 0 asks for bf16, the others for nothing, on a fresh group (the mismatch aborts it)."""
    g = tw.new_group()
    try:
        g.all_reduce(np.ones(64, np.float32), compress="bf16" if tw.get_rank() == 0 else None, timeout=20)
    except tw.CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_differ_in_compress_are_a_mismatch(get_cluster: Callable[..., Any]) -> None:
    """compress= is part of the call every rank must make alike (the paths differ across hosts)."""
    for rank, msg in enumerate(get_cluster(2, "shm").run(rank_compress_differs)):
        # seen here, or reported by the other rank first
        assert "all_reduce #1" in msg and "compress=" in msg, msg
        assert msg.startswith(f"rank {rank}: ") or msg.endswith(f"; seen on rank {rank}]"), msg


def rank_one_host() -> dict[str, Any]:
    r, n = tw.get_rank(), tw.get_world_size()
    data = np.random.default_rng(7).standard_normal((n, 5000))
    exact = data[r].astype(np.float32)
    tw.all_reduce(exact)
    got = {}
    for compress in CODECS:
        x = data[r].astype(np.float32)
        out = np.empty_like(x)
        tw.all_reduce(x, tw.ReduceOp.AVG, out=out, compress=compress)
        y = data[r].astype(np.float32)
        tw.all_reduce(y, compress=compress)
        got[compress] = (np.array_equal(y, exact), np.allclose(out, exact / n, rtol=1e-6),
                         np.array_equal(x, data[r].astype(np.float32)),
                         tw.world().choices.get(("all_reduce", x.nbytes, compress)))
    return got


def test_one_host_is_exact(get_cluster: Callable[..., Any]) -> None:
    """On one host nothing crosses between hosts: compress= leaves the sum exact, bit for bit
    the uncompressed one, and the choice says so (False: not compressed)."""
    for got in get_cluster(2, "shm").run(rank_one_host):
        assert got == {c: (True, True, True, False) for c in CODECS}, got


def test_plan_prices_the_compressed_path() -> None:
    """`tensorwire plan --hosts` prices compress= beside the exact algorithms: on 1 Gbit/s links
    between hosts of 4 ranks, about half the exact hierarchical all_reduce (half the bytes
    cross, plus the casts), float64 (a quarter of the bytes) less."""
    from tensorwire.tools import plan

    lines: list[str] = []
    assert plan.main(["all_reduce", "64MiB", "--hosts", "2", "--per-host", "4", "--tier", "shm,g1=50:0.119",
                      "--no-probe"], lines.append) == 0
    unit = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
    rows = [line.split() for line in lines if line.startswith("    ") and "crossover" not in line]
    seconds = {row[0]: float(row[1]) * unit[row[2]] for row in rows if row[1] != "-"}
    assert any("compress='bf16' or 'fp16'" in line for line in lines), lines
    assert 0.4 < seconds["float32"] / seconds["hierarchical"] < 0.7, lines
    assert seconds["float64"] < seconds["float32"], lines


