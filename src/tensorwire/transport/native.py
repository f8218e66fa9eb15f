"""The compiled inner loops of small calls on one host (transport/_native.c, and the caller
above them in _caller.c), where the install built them.

The C code runs the publish-and-wait round of every direct-path body (DirectPath.publish) and
the whole one-shot all_reduce, reduce, broadcast, gather, scatter, single-tensor all_gather,
reduce_scatter and all_to_all of a planned call and the barrier, entry included (its Path
holds the protocol's state: DirectPath.st), and the single copy bodies that only move bytes
(algorithms/single_copy.py); its Caller runs such a planned call from the group's API down,
numbering included, in one C call (group/planned.py); and a small point-to-point message's
ring record (ShmChannel.put_now, take_now): the same protocol, layout and fold order as
DirectPath and the plans in algorithms/direct_plans.py and single_copy.py, which stay the
reference and run everything the C code hands back: a peer that does not arrive
within the spin budget, a mismatch to explain, a dtype or op it does not fold.
TENSORWIRE_NATIVE=0 runs the Python reference only; 1 makes a missing module an error; auto
(the default) uses the module where it was built and says once where it was not.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from .. import log
from ..errors import TensorwireWarning
from ..ops import ReduceOp

DONE, PENDING, NOT_ENTERED, SETTLED, COPIED = -1, -2, -3, -4, -5
"""A compiled body's status besides a group rank (whose stamp differs): finished; published,
the wait handed back to Python; nothing done, the entry handed back (DirectPath.settle_previous);
and of a single copy body (algorithms/single_copy.py): everyone published, the reads handed
back; read, the wait for the readers handed back."""

_DTYPES = {np.dtype(t).num: code for code, t in enumerate(
    (np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
     np.float32, np.float64), start=1)}
_FLOATS = frozenset({np.dtype(np.float32).num, np.dtype(np.float64).num})
_OPS = {ReduceOp.SUM: 1, ReduceOp.AVG: 1, ReduceOp.PREMUL_SUM: 1, ReduceOp.PRODUCT: 2, ReduceOp.MIN: 3,
        ReduceOp.MAX: 4, ReduceOp.BAND: 5, ReduceOp.BOR: 6, ReduceOp.BXOR: 7}
"""AVG and PREMUL_SUM fold as SUM; the caller finalizes them, as on the Python path."""
_FLOAT_OPS = frozenset({1, 2})
"""Floats fold natively by sum and product only: numpy's minimum and maximum choose among NaNs
and signed zeros by rules a C comparison would not copy bit for bit."""

_loaded: ModuleType | None = None
_tried = False


def module(want: str) -> ModuleType | None:
    """The compiled module for setting `want` (Config.native): None where it is '0', or 'auto'
    and the module was not built."""
    global _loaded, _tried
    if want == "0":
        return None
    if not _tried:
        _tried = True
        try:
            from . import _native  # type: ignore[attr-defined]
            _loaded = _native
        except ImportError as exc:
            if want == "1":
                raise ImportError(f"TENSORWIRE_NATIVE=1, but tensorwire's compiled module is missing "
                                  f"({exc}); reinstall with a C compiler and the Python headers") from exc
            log.warn(f"tensorwire's compiled module was not built ({exc}): small calls on one host run "
                     f"their Python inner loops, which are slower (TENSORWIRE_NATIVE=0 silences this)",
                     TensorwireWarning)
    if _loaded is None and want == "1":
        raise ImportError("TENSORWIRE_NATIVE=1, but tensorwire's compiled module is missing")
    return _loaded


def fold_code(op: ReduceOp, dtype: np.dtype) -> int:
    """The C fold of `op` over `dtype` in native byte order; 0 where only Python folds it."""
    code = _DTYPES.get(dtype.num, 0) if dtype.isnative else 0
    op_code = _OPS.get(op, 0)
    if not code or not op_code or (dtype.num in _FLOATS and op_code not in _FLOAT_OPS):
        return 0
    return code * 8 + op_code



def path(mod: ModuleType | None, seg: Any, lines: tuple[int, ...], rank: int, slots_at: int, spin_s: float,
         yields: int, wait_s: float = 0.0) -> Any:
    """A compiled Path over `seg` (a GroupSegment) for this rank, or None where `mod` (the
    engine's `module`) is. Its bodies spin `spin_s` for a peer before they hand the wait to
    Python; the single copy ones `wait_s`, as long as Python's waits spin (design/native.md,
    "Single copy's planned calls")."""
    if mod is None:
        return None
    return mod.Path(seg.bytes, lines, rank, slots_at, seg.slot_bytes, int(spin_s * 1e9), yields,
                    int(wait_s * 1e9))
