"""Argument checks, views and fingerprints of the collectives.

Arguments are checked on the calling rank before anything is sent; an error aborts the group
so the other ranks raise it too rather than wait for a rank that will never come. Disagreements
only visible across ranks (collective, count, dtype, op, root) travel in every message's
fingerprint and are caught by the receiver before payload reaches a user buffer. The views
here are the per-call part of those checks that the planned path repeats, and the copies
that keep an input apart from the outputs an algorithm writes.
"""

from __future__ import annotations

import math
import numbers
import operator
import reprlib
import struct
import sys
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from .. import buffers
from ..algorithms.base import blocks_of
from ..buffers import address, as_array, copy
from ..errors import InvalidArgumentError, NotInitializedError
from ..ops import ReduceOp, Reduction
from ..ops.dtypes import dtype_code
from ..ops.reduce_op import as_reduction
from ..ops.validation import check_op_dtype
from ..transport.wire import Coll, Fingerprint

if TYPE_CHECKING:
    from .group import Group

_CHECKED: dict[tuple[ReduceOp, np.dtype], Reduction] = {}  # (op, dtype) pairs already validated
_CODES: dict[np.dtype, int] = {}
_FINGERPRINTS: dict[tuple, Fingerprint] = {}  # building a NamedTuple costs more than finding one


def check_member(group: Group, what: str) -> None:
    if group.runtime.closed:
        raise NotInitializedError(group.runtime.ended(f"{what} on group {group.name}"))
    if group.destroyed:
        raise NotInitializedError(f"rank {group.runtime.rank}: {what} on group {group.name}: the group's "
                                  f"destroy() was called on this rank; make a new group")
    if group.rank < 0:
        raise InvalidArgumentError(f"rank {group.runtime.rank}: {what}: this rank is not a member of "
                                   f"group {group.name} (ranks {group.ranks})")


def array(group: Group, obj: Any, what: str, *, writable: bool, name: str = "tensor") -> np.ndarray:
    try:
        return as_array(obj, writable=writable, rank=group.runtime.rank, collective=what, name=name)
    except InvalidArgumentError as exc:
        group.fail_fast(exc)
        raise  # unreachable: fail_fast raises


def invalid(group: Group, what: str, message: str, *, collective: bool = True) -> NoReturn:
    """Refuse call `what` for a bad argument: a collective on every member (group.fail_fast),
    a point-to-point call or a wait on its caller only."""
    error = InvalidArgumentError(f"rank {group.runtime.rank}: {what}: {message}")
    if collective:
        group.fail_fast(error)
    raise error


def limit_of(group: Group, timeout: float | None, what: str, *, collective: bool = True,
             poll: bool = False) -> float:
    """The seconds a call may wait: its `timeout=`, a positive finite number of seconds (0 too
    where it may `poll`: a Work's wait), else the group's. A bad one fails a collective on every
    member (as any argument), a point-to-point call or a wait on its caller only."""
    if timeout is None:
        return group.timeout
    if type(timeout) is float and 0.0 < timeout < math.inf:  # the common case, cheaply
        return timeout
    if isinstance(timeout, numbers.Real) and not isinstance(timeout, bool) \
            and (timeout >= 0.0 if poll else timeout > 0.0) and timeout < math.inf \
            and timeout <= sys.float_info.max:  # an int past it: float() would raise OverflowError
        return float(timeout)
    invalid(group, what, f"timeout must be a positive, finite number of seconds, got {reprlib.repr(timeout)}",
            collective=collective)


def is_rank(value: Any) -> bool:
    """An int or a numpy integer, not a bool: what a rank argument may be (a plan or a route
    is looked up by an int only where this holds: 1.0 and True hash as 1)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_root(group: Group, root: int, what: str, name: str, *, collective: bool = True) -> int:
    """`root`, the argument `name` of call `what` (a collective's root, a point-to-point call's
    peer), as a rank of `group`; a bad one refused as `invalid` refuses it."""
    check_member(group, what)
    if not is_rank(root):
        invalid(group, what, f"{name} must be an int (a rank of group {group.name}), got {root!r}",
                collective=collective)
    if not 0 <= root < group.size:
        invalid(group, what, f"{name}={root} is out of range for group {group.name} of size {group.size}",
                collective=collective)
    return int(root)


def reduction(group: Group, op: Any, dtype: np.dtype, what: str) -> Reduction:
    cached = _CHECKED.get((op, dtype)) if isinstance(op, ReduceOp) else None
    if cached is not None:
        return cached
    try:
        red = as_reduction(op, rank=group.runtime.rank, collective=what)
        check_op_dtype(red, dtype, rank=group.runtime.rank, collective=what)
    except InvalidArgumentError as exc:
        group.fail_fast(exc)
    except (ValueError, TypeError) as exc:
        group.fail_fast(InvalidArgumentError(f"rank {group.runtime.rank}: {what}: {exc}"))
    if isinstance(op, ReduceOp):
        _CHECKED[(op, dtype)] = red
    return red


def same_dtype(group: Group, arrays: Sequence[np.ndarray], what: str) -> np.dtype:
    dtypes = {a.dtype for a in arrays}
    if len(dtypes) > 1:
        invalid(group, what, f"all tensors must share one dtype, got {sorted(map(str, dtypes))}")
    return arrays[0].dtype


def array_list(group: Group, objs: Sequence[Any] | None, what: str, name: str, *, writable: bool,
               like: np.ndarray | None = None, uneven: bool = False) -> list[np.ndarray]:
    """One array per rank; with `like`, each must match its dtype and element count (`uneven`:
    only this rank's, the others' counts being theirs)."""
    if objs is None or len(objs) != group.size:
        got = "None" if objs is None else str(len(objs))
        invalid(group, what, f"{name} must hold one tensor per rank ({group.size}), got {got}")
    arrays = [array(group, o, what, writable=writable, name=f"{name}[{i}]") for i, o in enumerate(objs)]
    if like is not None:
        same_dtype(group, [like, *arrays], what)
        for i, a in enumerate(arrays):
            if a.size != like.size and (not uneven or i == group.rank):
                mine = " (this rank's; the other ranks' may differ)" if uneven else ""
                invalid(group, what, f"{name}[{i}] has {a.size} elements{mine}, expected {like.size}")
    return arrays


def fingerprint(coll: Coll, dtype: np.dtype | None = None, op: Reduction | None = None, root: int = -1,
                count: int = -1, counts: list[int] | None = None, variant: str = "") -> Fingerprint:
    """`counts`: a vector collective's per-rank counts, which every rank must pass alike: the
    one-shot path lays blocks out by them without messages whose sizes would tell (a
    gatherv whose ranks disagreed on them with the same total returned a stale element).
    `variant`: how the call runs where every rank must choose alike (all_reduce's compress=)."""
    digest = 0 if counts is None else zlib.crc32(struct.pack(f"<{len(counts)}q", *counts))
    if variant:
        digest ^= zlib.crc32(variant.encode())
    key = (coll, dtype, root, count, digest) if op is None else \
        (coll, dtype, root, count, digest, op.op, op.factor)
    fp = _FINGERPRINTS.get(key)
    if fp is not None:
        return fp
    code = 0
    if dtype is not None:
        known = _CODES.get(dtype)
        if known is None:
            known = _CODES[dtype] = dtype_code(dtype)
        code = known
    if op is None:
        fp = Fingerprint(coll, code, 0, root, count, digest)
    else:
        aux = 0 if op.factor is None else struct.unpack("<Q", struct.pack("<d", op.factor))[0]
        fp = Fingerprint(coll, code, op.op, root, count, aux ^ digest)
    if len(_FINGERPRINTS) >= 4096:
        _FINGERPRINTS.clear()
    _FINGERPRINTS[key] = fp
    return fp


def check_counts(group: Group, counts: Sequence[int], what: str, name: str = "counts",
                 alike: str = " (the same on every rank)") -> list[int]:
    """Per-rank counts, or split sizes: anything but one integer per member fails the call on
    every member."""
    try:
        out = [operator.index(c) for c in counts]
    except TypeError:
        out = []
    if len(out) != group.size or any(c < 0 for c in out):
        shown = counts if isinstance(counts, (list, tuple)) else repr(counts)
        invalid(group, what, f"{name} must be {group.size} non-negative integers{alike}, got {shown}")
    return out


def split_rows(group: Group, arr: np.ndarray, sizes: Sequence[int] | None, what: str,
               name: str) -> list[np.ndarray]:
    rows = arr.shape[0] if arr.ndim else 1
    row = arr.size // rows if rows else 0
    if sizes is None:
        if rows % group.size:
            invalid(group, what, f"{name} has {rows} rows, not divisible by the group size {group.size}; "
                    f"pass split sizes")
        sizes = [rows // group.size] * group.size
    sizes = check_counts(group, sizes, what, f"{name} split sizes", "")
    if sum(sizes) != rows:
        invalid(group, what, f"{name} split sizes {list(sizes)} sum to {sum(sizes)}, "
                f"{name} has {rows} rows")
    return blocks_of(arr.reshape(-1), [s * row for s in sizes])


# -- views of checked arguments ---------------------------------------------------------------------
def usable(a: np.ndarray, writable: bool) -> bool:
    """The per-call part of as_array's checks, for an array whose dtype was accepted before."""
    flags = a.flags
    return flags.c_contiguous and (flags.writeable or not writable)


def planned(obj: Any, async_op: bool) -> np.ndarray | None:
    """What a planned path runs on: a numpy array itself, or the view `as_array` made of a
    small torch tensor before (buffers.seen_torch_view) in a synchronous call (an async
    call's Work would return the view, not the tensor); else None (the checked path)."""
    if type(obj) is np.ndarray:
        return obj
    return None if async_op else buffers.seen_torch_view(obj)


def fits_out(tensor: np.ndarray, out: np.ndarray | None) -> bool:
    """`out` (from planned) can take a planned out-of-place result of `tensor`: the per-call
    part of the checks (an array of the same dtype and count, contiguous and writable)."""
    return (out is not None and usable(out, True) and out.dtype == tensor.dtype
            and out.size == tensor.size)


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Exactly the same bytes (an in-place call)? The bounds test first: it costs about as
    much as reading one address."""
    return np.may_share_memory(a, b) and a.nbytes == b.nbytes and address(a) == address(b)


def flats(arrays: list[np.ndarray]) -> list[np.ndarray]:
    return [buffers.flat(a) for a in arrays]


def apart(ins: list[np.ndarray], outs: list[np.ndarray],
          allowed: tuple[int, int] | None = None) -> list[np.ndarray]:
    """`ins`, copied where any shares memory with any of `outs` (but for ins[a] being exactly
    outs[b], `allowed` = (a, b): the in-place call every algorithm of that collective handles).
    The algorithms write outputs while inputs are still to be sent or read by peers: in place
    or shifted, all_to_all (pairwise exchange and Bruck at n=3, single copy), reduce_scatter
    (pairwise, single copy, ring, rank-ordered) and gather (linear, the one shot) returned
    wrong results silently."""
    if allowed is None and all(a.base is None for a in ins) and all(b.base is None for b in outs):
        shared = not {id(a) for a in ins}.isdisjoint(id(b) for b in outs)  # owners: only if the same
    elif allowed is None and len(ins) * len(outs) > _PAIRS:
        shared = _ranges_meet(ins, outs)
    else:
        shared = any(np.may_share_memory(a, b) and not ((i, j) == allowed and same_memory(a, b))
                     for i, a in enumerate(ins) for j, b in enumerate(outs))
    return [x.copy() for x in ins] if shared else ins


_PAIRS = 16
"""Beyond this many pairs of views, `_ranges_meet` rather than a bounds test per pair (see
docs/design/groups.md#aliasing)."""


def _ranges_meet(ins: list[np.ndarray], outs: list[np.ndarray]) -> bool:
    """Does the address range of any of the contiguous `ins` meet one of `outs`'? In order of
    address: a range meets the other side's if it starts before the furthest end seen there."""
    spans = sorted((address(a), a.nbytes, side) for side, arrays in enumerate((ins, outs))
                   for a in arrays if a.nbytes)
    ends = [0, 0]  # the furthest end so far of an input's range and of an output's
    for start, size, side in spans:
        if start < ends[1 - side]:
            return True
        ends[side] = max(ends[side], start + size)
    return False


def input_apart(outs: list[np.ndarray], mine: int, inp: np.ndarray) -> np.ndarray | None:
    """`inp`, flat, where it shares no memory with any of the flat `outs`: the run reads it
    there (peers may, single copy); else None, outs[mine] filled from it first unless it is
    `inp` itself, as a peer reading `inp` must not see it change while this rank fills `outs`."""
    if outs[mine] is inp:
        return None
    if not any(np.may_share_memory(o, inp) for o in outs):
        return buffers.flat(inp)
    if not same_memory(outs[mine], inp):
        copy(outs[mine], buffers.flat(inp))
    return None


def planned_list(objs: Any, like: np.ndarray, n: int, writable: bool, async_op: bool,
                 compiled: Any = None) -> list[np.ndarray] | None:
    """What a planned gather or scatter runs on for `objs` (see planned): a list of n arrays
    of like's dtype and size, contiguous (and writable), else None. The per-call part of
    array_list's checks; a list of arrays passes them in one call where `compiled` (the
    engine's compiled module) is given."""
    if type(objs) is not list or len(objs) != n:
        return None
    if compiled is not None and compiled.blocks_like(objs, like, writable):
        return objs
    arrays = [planned(o, async_op) for o in objs]
    if all(a is not None and a.dtype == like.dtype and a.size == like.size and usable(a, writable)
           for a in arrays):
        return arrays  # type: ignore[return-value]
    return None

