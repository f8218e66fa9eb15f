"""Compression of an all_reduce's pieces between hosts: 16-bit floats on the wire, sums in the
input's precision.

A piece crosses as 16-bit words: its values, each rounded to nearest even in bfloat16 or
float16, then one word holding the piece's power-of-two scale (an int16 exponent). The scale
keeps a piece inside float16's narrow range (its largest value lands just under 2**15) and
float64's inside bfloat16's (scaled down past 2**127, up below float32's normal range); float32
into bfloat16 needs none (same exponent range) and sends exponent 0. The receiver decodes into
the input's dtype and adds there, so only the rounding of what crosses is lost, never precision
in the sums (docs/multihost.md#compressed-all_reduce derives the bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError
from .dtypes import load_ml_dtypes
from .reduce_op import ReduceOp

WORD = np.dtype(np.uint16)
"""What crosses: the 16-bit floats as raw words, so no 16-bit float dtype is needed to move them."""
COMPRESSIBLE = (np.dtype(np.float32), np.dtype(np.float64))
LIMIT = 1100
"""The largest |exponent| of a scale: float64's whole range, subnormals included, minus a
16-bit format's top (scales are applied with ldexp, so no power of two is formed)."""
OPS = (ReduceOp.SUM, ReduceOp.AVG)
"""Sums only: the bound is a sum's, and MIN/MAX/PRODUCT gain nothing a rounding could justify."""


@dataclass(frozen=True)
class Codec:
    """One 16-bit format: `unit` its unit roundoff (round to nearest: |fl(x) - x| <= unit |x|),
    `top` the exponent a scaled piece's largest value stays below (2**top), `scales_float32`
    whether float32 pieces need scaling too (float64 ones always may), `bottom` the exponent
    below which a piece's largest value is scaled up to the top (float16, whose subnormals
    start at 2**-14: every piece; bfloat16: below 2**-121, where its subnormals' step would
    exceed the unit roundoff of that value); in between a piece crosses unscaled."""

    name: str
    unit: float
    top: int
    scales_float32: bool
    bottom: int
    below_top: int  # the bits of its largest value below 2**top

    def scaled(self, dtype: np.dtype) -> bool:
        return self.scales_float32 or dtype == np.float64

    def exponent(self, peak: float) -> int:
        """The power of two a scaled piece is divided by before rounding, from its largest finite
        |value| (0 where it holds no finite non-zero value)."""
        if peak == 0.0:
            return 0
        e = math.frexp(peak)[1]
        return max(-LIMIT, min(LIMIT, e - self.top)) if e > self.top or e < self.bottom else 0

    def encode(self, values: np.ndarray, words: np.ndarray) -> None:
        """`values` (float32/64) into `words` (uint16, one longer: the scale's exponent last).
        inf and NaN cross as they are; a finite value that rounds past the largest one the
        input's dtype holds once decoded crosses as the largest (saturates), as the exact sum of
        such values would be finite."""
        scaled = bool(values.size) and self.scaled(values.dtype)
        peak = _peak(values) if scaled else 0.0
        e = self.exponent(peak) if scaled else 0
        words[-1] = np.array(e, dtype=np.int16).view(np.uint16)
        narrow = values
        with np.errstate(invalid="ignore", over="ignore"):  # NaN and inf cross as they are, unremarked
            if e or (values.dtype == np.float64 and self.name == "bf16"):
                # bfloat16 rounds from float32's bits; float16 from either (one rounding)
                kind = np.float32 if self.name == "bf16" else values.dtype
                narrow = np.ldexp(values, -e).astype(kind, copy=False) if e else values.astype(kind)
            self._round(narrow, words[:-1])
        # the dtype's last binade may round up to the next power of two, which it lacks: such
        # values cross as the largest below it (bfloat16 unscaled: float32's own top, found from
        # the words, which is cheaper than the input's peak)
        ceiling = self.below_top if scaled else _BF16_LARGEST
        if scaled:
            may_overflow = peak >= _LAST_BINADE[values.dtype]
        else:
            may_overflow = bool(values.size) and int(np.bitwise_and(words[:-1], 0x7FFF).max()) > ceiling
        if may_overflow:
            over = ((words[:-1] & 0x7FFF) > ceiling) & np.isfinite(values)
            words[:-1][over] = (words[:-1][over] & 0x8000) | ceiling

    def decode(self, words: np.ndarray, out: np.ndarray, add: bool = False) -> None:
        """`words` (as `encode` wrote them) into `out` (float32/64), or added to it: one pass
        where the 16-bit dtype exists (numpy's float16, ml_dtypes' bfloat16)."""
        e = int(words[-1:].view(np.int16)[0])
        narrow = self._as_float(words[:-1])
        if narrow is None:  # bfloat16 without ml_dtypes: its bits are a float32's high half
            narrow = np.left_shift(words[:-1], 16, dtype=np.uint32).view(np.float32)
        if e:
            with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN cross as they are
                narrow = np.ldexp(narrow.astype(out.dtype, copy=False), e)
        if add:
            np.add(out, narrow, out=out, dtype=out.dtype)
        else:
            np.copyto(out, narrow, casting="same_kind")

    def _round(self, values: np.ndarray, words: np.ndarray) -> None:
        narrow = self._as_float(words)
        if narrow is not None:
            np.copyto(narrow, values, casting="same_kind")
        else:
            _bf16_bits(values, words)

    def _as_float(self, words: np.ndarray) -> np.ndarray | None:
        """`words` viewed as the 16-bit float they hold; None for bfloat16 without ml_dtypes."""
        if self.name == "fp16":
            return words.view(np.float16)
        if not load_ml_dtypes():
            return None
        import ml_dtypes
        return words.view(ml_dtypes.bfloat16)


_LAST_BINADE = {np.dtype(np.float32): 2.0 ** 127, np.dtype(np.float64): 2.0 ** 1023}
"""Where each input dtype's last binade starts: rounding there may reach 2**128 (2**1024)."""
_BF16_LARGEST = 0x7F7F


def _peak(values: np.ndarray) -> float:
    """The largest finite |value| of a non-empty piece (0 where none is)."""
    peak = max(float(values.max()), -float(values.min()))
    if math.isfinite(peak):
        return peak
    finite = values[np.isfinite(values)]  # inf or NaN among them: they cross as they are
    return float(np.abs(finite).max()) if finite.size else 0.0


def _bf16_bits(values: np.ndarray, words: np.ndarray) -> None:
    """float32 -> bfloat16 rounded to nearest even on the bits (what ml_dtypes does, without it):
    add 0x7FFF plus the lowest kept bit, keep the high half; NaNs stay NaN (quiet)."""
    bits = values.view(np.uint32)
    t = bits >> 16
    t &= 1
    t += 0x7FFF
    t += bits
    t >>= 16
    np.copyto(words, t, casting="unsafe")
    nan = np.isnan(values)
    if nan.any():
        words[nan] = (bits[nan] >> 16) | 0x0040


CODECS = {
    "bf16": Codec("bf16", 2.0 ** -8, 127, scales_float32=False, bottom=-120, below_top=0x7EFF),
    "fp16": Codec("fp16", 2.0 ** -11, 15, scales_float32=True, bottom=15, below_top=0x77FF),
}
"""bfloat16: 8 significant bits, float32's range; float16: 11 bits, largest finite 65504."""


def codec_for(compress: object, dtype: np.dtype, op: ReduceOp, *, rank: int, collective: str) -> Codec:
    """The codec `compress=` names for a call of this dtype and op, or InvalidArgumentError
    saying which of the three does not fit."""
    head = f"rank {rank}: {collective}: compress={compress!r}"
    codec = CODECS.get(compress) if isinstance(compress, str) else None
    if codec is None:
        raise InvalidArgumentError(f"{head} is not a compression; use one of {', '.join(map(repr, CODECS))} "
                                   f"or None")
    if dtype not in COMPRESSIBLE:
        why = ("is 16 bits already" if dtype.itemsize == 2 and dtype.kind in "fV" else
               "is not a float: sums of integers stay exact" if dtype.kind in "biu" else "is not supported")
        raise InvalidArgumentError(f"{head} compresses float32 and float64 only; the tensor's dtype "
                                   f"{dtype} {why}")
    if op not in OPS:
        raise InvalidArgumentError(f"{head} supports SUM and AVG only, got {op.name}")
    return codec


def words_for(count: int) -> int:
    """The 16-bit words `count` values cross in (their scale's word included)."""
    return count + 1
