"""Inputs every library starts from and the element-by-element check of what it produced.

The same patterns and the same numpy reference check tensorwire's results in `tensorwire bench`
and Gloo's and Open MPI's in the peer runners, so a baseline that computes something else is
caught exactly as tensorwire would be.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

PATTERN_LEN = 1021
"""Inputs repeat with this (prime) period, so blocks at power-of-two offsets hold different data."""
CHECK_CHUNK = 1 << 20
"""Elements compared per step: the reference never needs more than a few chunks of memory."""


def pattern(dtype: np.dtype, op: str, rank: int) -> np.ndarray:
    """One period of rank `rank`'s input: small integers, exact in every supported dtype.

    Sums stay within +-4n and products are powers of two, so the reduction result does not
    depend on the order in which ranks are combined, and every dtype can hold it.
    """
    k = np.arange(PATTERN_LEN, dtype=np.int64)
    if op == "prod":
        v = 1 + ((k + 3 * rank) % 7 == 0).astype(np.int64)
    else:
        v = (5 * k + 3 * rank) % 9
        if dtype.kind != "u":
            v = v - 4
    if dtype.kind in "iu":
        return v.astype(dtype)
    return v.astype(np.float64).astype(dtype)


def fill(buf: np.ndarray, pat: np.ndarray, start: int = 0) -> None:
    """buf[j] = pat[(start + j) % len(pat)], without temporaries of buf's size."""
    size = buf.size
    if size == 0:
        return
    period = pat.size
    rolled = np.roll(pat, -(start % period))
    whole = size // period
    if whole:
        buf[:whole * period].reshape(whole, period)[...] = rolled
    rest = size - whole * period
    if rest:
        buf[whole * period:] = rolled[:rest]


def segment(pat: np.ndarray, start: int, length: int) -> np.ndarray:
    out = np.empty(length, dtype=pat.dtype)
    fill(out, pat, start)
    return out


def count_wrong(actual: np.ndarray, expected: np.ndarray) -> int:
    """Elements of `actual` that differ from `expected` (NaN equals NaN; -0.0 equals 0.0)."""
    a, e = np.asarray(actual).reshape(-1), np.asarray(expected).reshape(-1)
    if a.size != e.size:
        raise ValueError(f"count_wrong: {a.size} elements against {e.size} expected")
    if a.dtype.kind in "iub":
        return int(np.count_nonzero(a != e))
    if a.dtype.itemsize < 4 or a.dtype.kind == "V" or a.dtype.type.__module__.startswith("ml_dtypes"):
        a, e = a.astype(np.float32), e.astype(np.float32)  # half, bfloat16: exact in float32
    differ = a != e
    if a.dtype.kind in "fc":
        differ &= ~(np.isnan(a) & np.isnan(e))
    return int(np.count_nonzero(differ))


@dataclass(frozen=True)
class Piece:
    """Part of the expected output: out[at:at+length] = input_src[start:start+length] of one rank,
    or the reduction over all ranks when `src` is None."""

    at: int
    length: int
    src: int | None
    start: int


def expected_pieces(coll: str, rank: int, n: int, root: int, param: int) -> list[Piece]:
    """What this rank's receive buffer must hold after the collective (nothing for non-roots
    of reduce and gather, whose receive buffers nccl-tests does not check either)."""
    c = param
    if coll == "all_reduce":
        return [Piece(0, c, None, 0)]
    if coll == "broadcast":
        return [Piece(0, c, root, 0)]
    if coll == "reduce":
        return [Piece(0, c, None, 0)] if rank == root else []
    if coll == "all_gather" or (coll == "gather" and rank == root):
        return [Piece(r * c, c, r, 0) for r in range(n)]
    if coll == "gather":
        return []
    if coll == "reduce_scatter":
        return [Piece(0, c, None, rank * c)]
    if coll == "alltoall":
        return [Piece(r * c, c, r, rank * c) for r in range(n)]
    if coll == "scatter":
        return [Piece(0, c, root, rank * c)]
    if coll == "sendrecv":
        return [Piece(0, c, (rank - 1) % n, 0)]
    return []


def check_result(out: np.ndarray, pieces: Sequence[Piece], patterns: Sequence[np.ndarray],
                 reduction: Any) -> int:
    """Wrong elements of `out` against the pieces, built chunk by chunk (bounded memory)."""
    from ...ops.reference import reference

    wrong = 0
    for piece in pieces:
        for off in range(0, piece.length, CHECK_CHUNK):
            m = min(CHECK_CHUNK, piece.length - off)
            if piece.src is None:
                want = reference([segment(p, piece.start + off, m) for p in patterns], reduction)
            else:
                want = segment(patterns[piece.src], piece.start + off, m)
            wrong += count_wrong(out[piece.at + off:piece.at + off + m], want)
    return wrong
