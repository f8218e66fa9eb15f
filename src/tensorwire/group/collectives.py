"""Every collective as a method of Group: check arguments, fingerprint, pick an algorithm, run.

Arguments are checked on the calling rank before anything is sent; an error aborts the group
so the other ranks raise it too rather than wait for a rank that will never come. Disagreements
only visible across ranks (collective, count, dtype, op, root) travel in every message's
fingerprint and are caught by the receiver before payload reaches a user buffer.
"""

from __future__ import annotations

import pickle
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import buffers
from ..algorithms.base import blocks_of
from ..algorithms.shm_direct import (
    AllReducePlan,
    BroadcastPlan,
    GatherPlan,
    ReducePlan,
    ScatterPlan,
    TensorPlan,
)
from ..buffers import address, as_array, byte_view, copy
from ..errors import InvalidArgumentError
from ..gpu import is_device_buffer as _on_device
from ..ops import ReduceOp, Reduction, as_reduction, check_op_dtype, dtype_code, finalize
from ..transport.wire import Coll, Fingerprint
from ..tuning import tuner
from ..work import Work

if TYPE_CHECKING:
    from .group import CollectiveCall, Group, P2PRoute


_CHECKED: dict[tuple[ReduceOp, np.dtype], Reduction] = {}  # (op, dtype) pairs already validated
_CODES: dict[np.dtype, int] = {}
_FINGERPRINTS: dict[tuple, Fingerprint] = {}  # building a NamedTuple costs more than finding one
_BARRIER = Fingerprint(Coll.BARRIER, 0, 0, -1, -1)


_PLANS = 256  # checked call signatures kept per group


def _usable(a: np.ndarray, writable: bool) -> bool:
    """The per-call part of as_array's checks, for an array whose dtype was accepted before."""
    flags = a.flags
    return flags.c_contiguous and (flags.writeable or not writable)


def _planned(obj: Any, async_op: bool) -> np.ndarray | None:
    """What a planned path runs on: a numpy array itself, or the view `as_array` made of a
    small torch tensor before (buffers.seen_torch_view) in a synchronous call (an async
    call's Work would return the view, not the tensor); else None (the checked path)."""
    if type(obj) is np.ndarray:
        return obj
    return None if async_op else buffers.seen_torch_view(obj)


def _fits_out(tensor: np.ndarray, out: np.ndarray | None) -> bool:
    """`out` (from _planned) can take a planned out-of-place result of `tensor`: the per-call
    part of the checks (an array of the same dtype and count, contiguous and writable)."""
    return (out is not None and _usable(out, True) and out.dtype == tensor.dtype
            and out.size == tensor.size)


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Exactly the same bytes (an in-place call)? The bounds test first: it costs about as
    much as reading one address."""
    return np.may_share_memory(a, b) and a.nbytes == b.nbytes and address(a) == address(b)


def _flats(arrays: list[np.ndarray]) -> list[np.ndarray]:
    return [buffers.flat(a) for a in arrays]


def _all_reduce(call: CollectiveCall, src: np.ndarray, dst: np.ndarray, red: Reduction, result: Any) -> Any:
    group = call.group
    flat = buffers.flat(dst)
    apart = None if dst is src else _input_apart([flat], 0, src)
    if group.size > 1 and flat.size:
        tuner.select(group, "all_reduce", flat.nbytes).run(call, flat, red.op, apart)
    elif apart is not None:
        copy(flat, apart)
    finalize(flat, red, group.size)
    return result


_SELECT = object()  # a body's `run` argument: ask the tuner (unplanned calls)


def _apart(ins: list[np.ndarray], outs: list[np.ndarray],
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
        shared = any(np.may_share_memory(a, b) and not ((i, j) == allowed and _same_memory(a, b))
                     for i, a in enumerate(ins) for j, b in enumerate(outs))
    return [x.copy() for x in ins] if shared else ins


_PAIRS = 16
"""Beyond this many pairs of views, `_ranges_meet` rather than a bounds test per pair: a
list-form all_to_all checks n x n pairs at 0.2 us each; reading an address costs about as
much (buffers.address), and the sort little."""


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


def _input_apart(outs: list[np.ndarray], mine: int, inp: np.ndarray) -> np.ndarray | None:
    """`inp`, flat, where it shares no memory with any of the flat `outs`: the run reads it
    there (peers may, single copy); else None, outs[mine] filled from it first unless it is
    `inp` itself, as a peer reading `inp` must not see it change while this rank fills `outs`."""
    if not any(np.may_share_memory(o, inp) for o in outs):
        return buffers.flat(inp)
    if not _same_memory(outs[mine], inp):
        copy(outs[mine], buffers.flat(inp))
    return None


def _broadcast(call: CollectiveCall, data: np.ndarray, target: np.ndarray, root: int, result: Any,
               run: Any) -> Any:
    """`run`: the planned algorithm's run function (None: nothing to send), or _SELECT."""
    group = call.group
    flat = buffers.flat(target)
    src = _input_apart([flat], 0, data) if group.rank == root and target is not data else None
    if run is _SELECT:
        run = tuner.select(group, "broadcast", flat.nbytes).run if group.size > 1 else None
    if run is not None:
        run(call, flat, root, src)
    elif src is not None:
        copy(flat, src)
    return result


def _reduce(call: CollectiveCall, src: np.ndarray, target: np.ndarray, red: Reduction, root: int, result: Any,
            run: Any) -> Any:
    """`run` as for _broadcast; `target` is `src` except on the root of an out-of-place call."""
    group = call.group
    data, acc = buffers.flat(src), buffers.flat(target)
    if run is _SELECT:
        run = tuner.select(group, "reduce", data.nbytes).run if group.size > 1 else None
    if run is not None:
        run(call, data, acc, red.op, root)
    elif acc is not data:
        copy(acc, data)
    if group.rank == root:
        finalize(acc, red, group.size)
    return result


def _all_gather(call: CollectiveCall, inp: np.ndarray, outs: list[np.ndarray], even: bool, result: Any,
                run: Any) -> Any:
    """`outs[rank]` may be `inp` itself (in place); `even`: equal blocks (the one-shot path and
    the size the tuner prices need them); `run` as for _broadcast."""
    group = call.group
    flats = _flats(outs)
    src = _input_apart(flats, group.rank, inp)
    if run is _SELECT:
        run = tuner.select(group, "all_gather", sum(f.nbytes for f in flats), even).run
    if run is not None:
        run(call, flats, src)
    elif src is not None:
        copy(flats[group.rank], src)
    return result


def _planned_list(objs: Any, like: np.ndarray, n: int, writable: bool,
                  async_op: bool) -> list[np.ndarray] | None:
    """What a planned gather or scatter runs on for `objs` (see _planned): a list of n arrays
    of like's dtype and size, contiguous (and writable), else None. The per-call part of
    _list's checks."""
    if type(objs) is not list or len(objs) != n:
        return None
    arrays = [_planned(o, async_op) for o in objs]
    if all(a is not None and a.dtype == like.dtype and a.size == like.size and _usable(a, writable)
           for a in arrays):
        return arrays  # type: ignore[return-value]
    return None


def _gather(call: CollectiveCall, send: np.ndarray, blocks: list[np.ndarray] | None, root: int, result: Any,
            run: Any) -> Any:
    """`blocks`: the root's flat outputs (None elsewhere); `run` as for _broadcast."""
    group = call.group
    if blocks is not None:
        send = _apart([send], blocks, (0, root))[0]
    if run is _SELECT:
        run = tuner.select(group, "gather", send.nbytes * group.size).run
    run(call, send, blocks, root)
    return result


def _scatter(call: CollectiveCall, blocks: list[np.ndarray] | None, recv: np.ndarray, root: int, result: Any,
             run: Any) -> Any:
    """`blocks`: the root's flat inputs (None elsewhere); `run` as for _broadcast."""
    group = call.group
    if blocks is not None:
        blocks = _apart(blocks, [recv], (root, 0))
    if run is _SELECT:
        run = tuner.select(group, "scatter", recv.nbytes * group.size).run
    run(call, blocks, recv, root)
    return result


def _all_to_all(call: CollectiveCall, ins: list[np.ndarray], outs: list[np.ndarray], even: bool, result: Any,
                run: Any) -> Any:
    """`even`: equal blocks (uneven splits have no size every rank agrees on, so the tuner
    prices them all alike, as size 0); `run` as for _broadcast."""
    group = call.group
    sends, recvs = _flats(ins), _flats(outs)
    if run is _SELECT:
        run = tuner.select(group, "all_to_all", sum(b.nbytes for b in sends) if even else 0, even).run
    if run is not None:
        run(call, sends, recvs)
    return result


def _reduce_scatter(call: CollectiveCall, blocks: list[np.ndarray], out: np.ndarray, red: Reduction,
                    even: bool, result: Any, run: Any) -> Any:
    """`blocks`: flat; `even`: equal blocks (see _all_gather); `run` as for _broadcast."""
    group = call.group
    flat = buffers.flat(out)
    blocks = _apart(blocks, [flat], (group.rank, 0))
    if run is _SELECT:
        run = tuner.select(group, "reduce_scatter", sum(b.nbytes for b in blocks), even).run
    run(call, blocks, flat, red.op)
    finalize(flat, red, group.size)
    return result


def _no_op(call: CollectiveCall) -> None:
    pass


class Collectives:
    """Mixed into Group; `self` is always a Group."""

    # -- helpers --------------------------------------------------------------------------------
    def _arr(self: Group, obj: Any, what: str, *, writable: bool, name: str = "tensor") -> np.ndarray:
        try:
            return as_array(obj, writable=writable, rank=self.runtime.rank, collective=what, name=name)
        except InvalidArgumentError as exc:
            self.fail_fast(exc)
            raise  # unreachable: fail_fast raises

    def _invalid(self: Group, what: str, message: str) -> None:
        self.fail_fast(InvalidArgumentError(f"rank {self.runtime.rank}: {what}: {message}"))

    def _root(self: Group, root: int, what: str, name: str) -> int:
        self._check_member(what)
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            self._invalid(what, f"{name}={root} is out of range for group {self.name} of size {self.size}")
        return int(root)

    def _reduction(self: Group, op: Any, dtype: np.dtype, what: str) -> Reduction:
        cached = _CHECKED.get((op, dtype)) if isinstance(op, ReduceOp) else None
        if cached is not None:
            return cached
        try:
            red = as_reduction(op, rank=self.runtime.rank, collective=what)
            check_op_dtype(red, dtype, rank=self.runtime.rank, collective=what)
        except InvalidArgumentError as exc:
            self.fail_fast(exc)
        except (ValueError, TypeError) as exc:
            self.fail_fast(InvalidArgumentError(f"rank {self.runtime.rank}: {what}: {exc}"))
        if isinstance(op, ReduceOp):
            _CHECKED[(op, dtype)] = red
        return red

    def _same_dtype(self: Group, arrays: Sequence[np.ndarray], what: str) -> np.dtype:
        dtypes = {a.dtype for a in arrays}
        if len(dtypes) > 1:
            self._invalid(what, f"all tensors must share one dtype, got {sorted(map(str, dtypes))}")
        return arrays[0].dtype

    def _list(self: Group, objs: Sequence[Any] | None, what: str, name: str, *, writable: bool,
              like: np.ndarray | None = None) -> list[np.ndarray]:
        """One array per rank; with `like`, each must match its dtype and element count."""
        if objs is None or len(objs) != self.size:
            got = "None" if objs is None else str(len(objs))
            self._invalid(what, f"{name} must hold one tensor per rank ({self.size}), got {got}")
        arrays = [self._arr(o, what, writable=writable, name=f"{name}[{i}]") for i, o in enumerate(objs)]
        if like is not None:
            self._same_dtype([like, *arrays], what)
            for i, a in enumerate(arrays):
                if a.size != like.size:
                    self._invalid(what, f"{name}[{i}] has {a.size} elements, expected {like.size}")
        return arrays

    @staticmethod
    def _fp(coll: Coll, dtype: np.dtype | None = None, op: Reduction | None = None, root: int = -1,
            count: int = -1, counts: list[int] | None = None) -> Fingerprint:
        """`counts`: a vector collective's per-rank counts, which every rank must pass alike: the
        one-shot path lays blocks out by them without messages whose sizes would tell (a
        gatherv whose ranks disagreed on them with the same total returned a stale element)."""
        digest = 0 if counts is None else zlib.crc32(struct.pack(f"<{len(counts)}q", *counts))
        key = (coll, dtype, root, count, digest) if op is None else \
            (coll, dtype, root, count, digest, op.op, op.factor)
        fp = _FINGERPRINTS.get(key)
        if fp is not None:
            return fp
        code = 0
        if dtype is not None:
            code = _CODES.get(dtype)
            if code is None:
                code = _CODES[dtype] = dtype_code(dtype)
        if op is None:
            fp = Fingerprint(coll, code, 0, root, count, digest)
        else:
            aux = 0 if op.factor is None else struct.unpack("<Q", struct.pack("<d", op.factor))[0]
            fp = Fingerprint(coll, code, op.op, root, count, aux ^ digest)
        if len(_FINGERPRINTS) >= 4096:
            _FINGERPRINTS.clear()
        _FINGERPRINTS[key] = fp
        return fp

    # -- reductions -------------------------------------------------------------------------------
    def all_reduce(self: Group, tensor: Any, op: Any = ReduceOp.SUM, *, out: Any = None,
                   async_op: bool = False, timeout: float | None = None) -> Any:
        """Reduce `tensor` over the group; in place, or into `out` leaving `tensor` untouched."""
        what = "all_reduce"
        # The hot path of small all_reduces (gradient norms, loss values, flags): a signature
        # (dtype, count, op, in/out of place) whose checks passed before only needs its arrays'
        # flags re-checked, and on the direct path runs with everything else looked up already:
        # most of a small call's Python time.
        src = _planned(tensor, async_op)
        if src is not None and (type(op) is ReduceOp or type(op) is Reduction):
            plan = self.plans.get((what, src.dtype, src.size, op, out is None))
            if plan is not None:
                flags = src.flags
                if out is None:
                    ok, dst = flags.c_contiguous and flags.writeable, src
                else:
                    dst = _planned(out, async_op)
                    ok = flags.c_contiguous and _fits_out(src, dst)
                if ok:
                    call, run, red = plan
                    result = tensor if out is None else out
                    if run is None:
                        return self._submit_planned(call, _all_reduce, False, async_op, timeout,
                                                    src, dst, red, result)
                    done = self._submit_planned(call, run, True, async_op, timeout, src, dst)
                    return done if async_op else result
        if _on_device(tensor):
            return self.device.all_reduce(tensor, op, out, async_op, timeout)
        self._check_member(what)
        src = self._arr(tensor, what, writable=out is None)
        dst = src if out is None else self._arr(out, what, writable=True, name="out")
        if dst is not src and (dst.dtype != src.dtype or dst.size != src.size):
            self._invalid(what, f"out has {dst.size} x {dst.dtype}, tensor {src.size} x {src.dtype}")
        red = self._reduction(op, src.dtype, what)
        fp = self._fp(Coll.ALL_REDUCE, src.dtype, red, count=src.size)
        if src is _planned(tensor, False) and (out is None or dst is _planned(out, False)) \
                and red.factor is None and type(op) in (ReduceOp, Reduction) and len(self.plans) < _PLANS:
            self.plans[(what, src.dtype, src.size, op, out is None)] = self._all_reduce_plan(src, fp, red)
        return self._submit(fp, what, _all_reduce, async_op, timeout, src, dst, red,
                            out if out is not None else tensor)

    def _all_reduce_plan(self: Group, src: np.ndarray, fp: Fingerprint, red: Reduction) -> tuple:
        """(call, the direct path's run or None, reduction) for repeats of this signature (see
        _submit_planned): where the tuner picks the direct path, its AllReducePlan's run, with
        nothing left to look up per call; else None, for the general body."""
        call = self.planned_call(fp, "all_reduce")
        if self.size > 1 and src.size and tuner.select(self, "all_reduce", src.nbytes).name == "direct":
            return call, AllReducePlan(self.direct, src.dtype, src.size, red.op, red).run, red
        return call, None, red

    def _remember(self: Group, key: tuple, fp: Fingerprint, what: str, collective: str, nbytes: int,
                  *extra: Any, one_rank: bool = False,
                  whole: tuple[int, Callable[[], Callable[..., Any]]] | None = None) -> None:
        """Plan a signature whose checks passed, for the planned path at the top of its method:
        (call, on the direct path?, the chosen algorithm's run or None where nothing moves,
        *extra). `one_rank`: the algorithm has work even on a single rank. `whole`: (bytes a
        rank puts in its slot, the factory of a plan's run) of a call the direct path's one
        shot can run from a plan that takes the arrays themselves (TensorPlan, ReducePlan,
        BroadcastPlan): where the tuner picks that path and the bytes fit the slot, the run is
        the plan's, and the last of `extra` (what only the general body needs) is None."""
        if len(self.plans) < _PLANS:
            alg = tuner.select(self, collective, nbytes) if self.size > 1 or one_rank else None
            run = None if alg is None else alg.run
            if whole is not None and alg is not None and alg.name == "direct" \
                    and whole[0] <= self.direct.slot_bytes:
                run = whole[1]()
                extra = (*extra[:-1], None)
            self.plans[key] = (self.planned_call(fp, what), alg is not None and alg.needs_direct, run, *extra)

    def reduce(self: Group, tensor: Any, dst: int = 0, op: Any = ReduceOp.SUM, *, out: Any = None,
               async_op: bool = False, timeout: float | None = None) -> Any:
        """Reduce onto rank `dst` (in place, or into `out` there); other ranks' inputs are kept."""
        what = "reduce"
        mine = self.rank == dst
        data = _planned(tensor, async_op)
        if data is not None and (type(op) is ReduceOp or type(op) is Reduction):  # see all_reduce
            plan = self.plans.get((what, data.dtype, data.size, dst, op, out is None))
            if plan is not None:
                if not mine or out is None:
                    ok, acc = _usable(data, mine), data
                else:
                    acc = _planned(out, async_op)
                    ok = _usable(data, False) and _fits_out(data, acc)
                if ok:
                    call, direct, run, red = plan
                    result = out if mine and out is not None else tensor
                    if red is not None:
                        return self._submit_planned(call, _reduce, direct, async_op, timeout, data, acc, red,
                                                    dst, result, run)
                    done = self._submit_planned(call, run, True, async_op, timeout, data, acc)  # ReducePlan
                    return done if async_op else result
        if _on_device(tensor):
            return self.device.reduce(tensor, dst, op, out, async_op, timeout)
        root = self._root(dst, what, "dst")
        src = self._arr(tensor, what, writable=out is None and self.rank == root)
        target = src
        if self.rank == root and out is not None:
            target = self._arr(out, what, writable=True, name="out")
            if target.dtype != src.dtype or target.size != src.size:
                self._invalid(what, f"out has {target.size} x {target.dtype}, "
                                    f"tensor {src.size} x {src.dtype}")
        red = self._reduction(op, src.dtype, what)
        fp = self._fp(Coll.REDUCE, src.dtype, red, root, src.size)
        result = out if (out is not None and self.rank == root) else tensor
        if src is _planned(tensor, False) and (target is src or target is _planned(out, False)) \
                and red.factor is None and type(op) in (ReduceOp, Reduction):
            self._remember((what, src.dtype, src.size, dst, op, out is None), fp, what, what, src.nbytes,
                           red, whole=(src.nbytes, lambda: ReducePlan(self.direct, src.dtype, src.size,
                                                                      red.op, root, red).run))
        return self._submit(fp, what, _reduce, async_op, timeout, src, target, red, root, result, _SELECT)

    def reduce_scatter(self: Group, output: Any, input_list: Sequence[Any], op: Any = ReduceOp.SUM, *,
                       async_op: bool = False, timeout: float | None = None) -> Any:
        """Rank r gets the reduction of everybody's input_list[r]."""
        what = "reduce_scatter"
        data = _planned(output, async_op)
        if data is not None and (type(op) is ReduceOp or type(op) is Reduction):  # see all_reduce
            plan = self.plans.get((what, data.dtype, data.size, op))
            blocks = None if plan is None else _planned_list(input_list, data, self.size, False, async_op)
            if blocks is not None and _usable(data, True):
                call, direct, run, red, general = plan
                if general is None:  # its TensorPlan
                    done = self._submit_planned(call, run, True, async_op, timeout, blocks, data)
                    return done if async_op else output
                return self._submit_planned(call, _reduce_scatter, direct, async_op, timeout, _flats(blocks),
                                            data, red, True, output, run)
        if _on_device(output):
            return self.device.reduce_scatter(output, input_list, op, async_op, timeout)
        self._check_member(what)
        out = self._arr(output, what, writable=True, name="output")
        blocks = self._list(input_list, what, "input_list", writable=False, like=out)
        red = self._reduction(op, out.dtype, what)
        fp = self._fp(Coll.REDUCE_SCATTER, out.dtype, red, count=out.size)
        if out is _planned(output, False) and red.factor is None and type(op) in (ReduceOp, Reduction) \
                and all(a is _planned(b, False) for a, b in zip(blocks, input_list)):
            total = out.nbytes * self.size
            self._remember((what, out.dtype, out.size, op), fp, what, "reduce_scatter", total, red, True,
                           one_rank=True, whole=(total, lambda: TensorPlan(
                               self.direct, what, out.dtype, out.size * self.size, red).run_blocks))
        return self._submit(fp, what, _reduce_scatter, async_op, timeout, _flats(blocks), out, red, True,
                            output, _SELECT)

    def reduce_scatter_tensor(self: Group, output: Any, input: Any, op: Any = ReduceOp.SUM, *,
                              async_op: bool = False, timeout: float | None = None) -> Any:
        """Single-tensor form: `input` is size x output.numel(), rank r gets block r reduced."""
        what = "reduce_scatter_tensor"
        inp, out = _planned(input, async_op), _planned(output, async_op)
        if inp is not None and out is not None \
                and (type(op) is ReduceOp or type(op) is Reduction):  # a checked signature: see all_reduce
            plan = self.plans.get((what, inp.dtype, inp.size, out.size, op))
            if plan is not None and out.dtype == inp.dtype and _usable(inp, False) and _usable(out, True):
                call, direct, run, red, counts = plan
                if counts is not None:
                    return self._submit_planned(call, _reduce_scatter, direct, async_op, timeout,
                                                blocks_of(inp.reshape(-1), counts), out, red, True, output,
                                                run)
                done = self._submit_planned(call, run, True, async_op, timeout, inp, out)
                return done if async_op else output
        if _on_device(output):
            return self.device.reduce_scatter_tensor(output, input, op, async_op, timeout)
        self._check_member(what)
        out = self._arr(output, what, writable=True, name="output")
        inp = self._arr(input, what, writable=False, name="input")
        self._same_dtype([out, inp], what)
        if inp.size != out.size * self.size:
            self._invalid(what, f"input has {inp.size} elements, expected size x output = "
                                f"{self.size} x {out.size}")
        counts = [out.size] * self.size
        red = self._reduction(op, out.dtype, what)
        fp = self._fp(Coll.REDUCE_SCATTER, out.dtype, red, count=out.size)
        if inp is _planned(input, False) and out is _planned(output, False) and red.factor is None \
                and type(op) in (ReduceOp, Reduction):
            self._remember((what, inp.dtype, inp.size, out.size, op), fp, what, "reduce_scatter", inp.nbytes,
                           red, counts, one_rank=True,
                           whole=(inp.nbytes, lambda: TensorPlan(self.direct, "reduce_scatter", inp.dtype,
                                                                 inp.size, red).run))
        return self._submit(fp, what, _reduce_scatter, async_op, timeout, blocks_of(inp.reshape(-1), counts),
                            out, red, True, output, _SELECT)

    def reduce_scatterv(self: Group, output: Any, input: Any, counts: Sequence[int], op: Any = ReduceOp.SUM,
                        *, async_op: bool = False, timeout: float | None = None) -> Any:
        """Vector form: rank r gets `counts[r]` reduced elements; `input` holds sum(counts)."""
        what = "reduce_scatterv"
        if _on_device(output):
            return self.device.reduce_scatterv(output, input, counts, op, async_op, timeout)
        self._check_member(what)
        counts = self._counts(counts, what)
        out = self._arr(output, what, writable=True, name="output")
        inp = self._arr(input, what, writable=False, name="input")
        self._same_dtype([out, inp], what)
        if inp.size != sum(counts) or out.size != counts[self.rank]:
            self._invalid(what, f"input has {inp.size} elements (want sum(counts)={sum(counts)}), output "
                                f"{out.size} (want counts[{self.rank}]={counts[self.rank]})")
        red = self._reduction(op, out.dtype, what)
        return self._submit(self._fp(Coll.REDUCE_SCATTERV, out.dtype, red, count=-1, counts=counts), what,
                            _reduce_scatter, async_op, timeout, blocks_of(inp.reshape(-1), counts), out, red,
                            False, output, _SELECT)

    # -- data movement ------------------------------------------------------------------------------
    def broadcast(self: Group, tensor: Any, src: int = 0, *, out: Any = None, async_op: bool = False,
                  timeout: float | None = None) -> Any:
        """Rank `src`'s tensor to everyone: in place, or into `out` (then `tensor` is only read)."""
        what = "broadcast"
        data = _planned(tensor, async_op)
        if data is not None:  # a checked signature: see all_reduce
            plan = self.plans.get((what, data.dtype, data.size, src, out is None))
            if plan is not None:
                if out is None:
                    ok, dst = _usable(data, self.rank != src), data
                else:
                    dst = _planned(out, async_op)
                    ok = _usable(data, False) and _fits_out(data, dst)
                if ok:
                    call, direct, run, root = plan
                    result = tensor if out is None else out
                    if root is not None:
                        return self._submit_planned(call, _broadcast, direct, async_op, timeout, data, dst,
                                                    root, result, run)
                    done = self._submit_planned(call, run, True, async_op, timeout, data, dst)  # its Plan
                    return done if async_op else result
        if _on_device(tensor):
            return self.device.broadcast(tensor, src, out, async_op, timeout)
        root = self._root(src, what, "src")
        data = self._arr(tensor, what, writable=out is None and self.rank != root)
        target = data if out is None else self._arr(out, what, writable=True, name="out")
        if target is not data and (target.dtype != data.dtype or target.size != data.size):
            self._invalid(what, f"out has {target.size} x {target.dtype}, tensor {data.size} x {data.dtype}")
        fp = self._fp(Coll.BROADCAST, data.dtype, root=root, count=data.size)
        result = tensor if out is None else out
        if data is _planned(tensor, False) and target is (data if out is None else _planned(out, False)):
            self._remember((what, data.dtype, data.size, src, out is None), fp, what, what, target.nbytes,
                           root, whole=(data.nbytes, lambda: BroadcastPlan(self.direct, data.dtype, data.size,
                                                                           root).run))
        return self._submit(fp, what, _broadcast, async_op, timeout, data, target, root, result, _SELECT)

    def all_gather(self: Group, tensor_list: Sequence[Any], tensor: Any, *, async_op: bool = False,
                   timeout: float | None = None) -> Any:
        """tensor_list[r] receives rank r's tensor (list form; no staging copy)."""
        what = "all_gather"
        data = _planned(tensor, async_op)
        if data is not None:  # a checked signature: see all_reduce
            plan = self.plans.get((what, data.dtype, data.size))
            blocks = None if plan is None else _planned_list(tensor_list, data, self.size, True, async_op)
            if blocks is not None and _usable(data, False):
                call, direct, run, general = plan
                if general is None:  # its TensorPlan
                    done = self._submit_planned(call, run, True, async_op, timeout, data, blocks)
                    return done if async_op else tensor_list
                return self._submit_planned(call, _all_gather, direct, async_op, timeout, data, blocks, True,
                                            tensor_list, run)
        if _on_device(tensor):
            return self.device.all_gather(tensor_list, tensor, async_op, timeout)
        self._check_member(what)
        inp = self._arr(tensor, what, writable=False)
        outs = self._list(tensor_list, what, "tensor_list", writable=True, like=inp)
        fp = self._fp(Coll.ALL_GATHER, inp.dtype, count=inp.size)
        if inp is _planned(tensor, False) and all(a is _planned(o, False) for a, o in zip(outs, tensor_list)):
            self._remember((what, inp.dtype, inp.size), fp, what, "all_gather", inp.nbytes * self.size, True,
                           whole=(inp.nbytes, lambda: TensorPlan(self.direct, "all_gather", inp.dtype,
                                                                 inp.size).run_list))
        return self._submit(fp, what, _all_gather, async_op, timeout, inp, outs, True, tensor_list, _SELECT)

    def all_gather_into_tensor(self: Group, output: Any, input: Any, *, async_op: bool = False,
                               timeout: float | None = None) -> Any:
        """Single-tensor form: output is size x input, rank r's input lands in block r."""
        what = "all_gather_into_tensor"
        inp, out = _planned(input, async_op), _planned(output, async_op)
        if inp is not None and out is not None:  # a checked signature: see all_reduce
            plan = self.plans.get((what, inp.dtype, inp.size, out.size))
            if plan is not None and out.dtype == inp.dtype and _usable(inp, False) and _usable(out, True):
                call, direct, run, counts = plan
                if counts is not None:
                    return self._submit_planned(call, _all_gather, direct, async_op, timeout, inp,
                                                blocks_of(out.reshape(-1), counts), True, output, run)
                done = self._submit_planned(call, run, True, async_op, timeout, inp, out)
                return done if async_op else output
        if _on_device(output):
            return self.device.all_gather_into_tensor(output, input, async_op, timeout)
        self._check_member(what)
        inp = self._arr(input, what, writable=False, name="input")
        out = self._arr(output, what, writable=True, name="output")
        self._same_dtype([out, inp], what)
        if out.size != inp.size * self.size:
            self._invalid(what, f"output has {out.size} elements, expected size x input = "
                                f"{self.size} x {inp.size}")
        counts = [inp.size] * self.size
        outs = blocks_of(out.reshape(-1), counts)
        fp = self._fp(Coll.ALL_GATHER, inp.dtype, count=inp.size)
        if inp is _planned(input, False) and out is _planned(output, False):
            self._remember((what, inp.dtype, inp.size, out.size), fp, what, "all_gather", out.nbytes, counts,
                           whole=(inp.nbytes, lambda: TensorPlan(self.direct, "all_gather", inp.dtype,
                                                                 inp.size).run))
        return self._submit(fp, what, _all_gather, async_op, timeout, inp, outs, True, output, _SELECT)

    def all_gatherv(self: Group, output: Any, input: Any, counts: Sequence[int], *, async_op: bool = False,
                    timeout: float | None = None) -> Any:
        """Vector form: rank r contributes counts[r] elements; output holds sum(counts)."""
        what = "all_gatherv"
        if _on_device(output):
            return self.device.all_gatherv(output, input, counts, async_op, timeout)
        self._check_member(what)
        counts = self._counts(counts, what)
        inp = self._arr(input, what, writable=False, name="input")
        out = self._arr(output, what, writable=True, name="output")
        self._same_dtype([out, inp], what)
        if inp.size != counts[self.rank] or out.size != sum(counts):
            self._invalid(what, f"input has {inp.size} elements (want counts[{self.rank}]="
                                f"{counts[self.rank]}), output {out.size} (want sum(counts)={sum(counts)})")
        outs = blocks_of(out.reshape(-1), counts)
        return self._submit(self._fp(Coll.ALL_GATHERV, inp.dtype, counts=counts), what, _all_gather, async_op,
                            timeout, inp, outs, False, output, _SELECT)

    def gather(self: Group, tensor: Any, gather_list: Sequence[Any] | None = None, dst: int = 0, *,
               async_op: bool = False, timeout: float | None = None) -> Any:
        """gather_list (on rank dst only) receives every rank's tensor."""
        what = "gather"
        data = _planned(tensor, async_op)
        if data is not None:  # a checked signature: see all_reduce
            plan = self.plans.get((what, data.dtype, data.size, dst))
            blocks = None if self.rank != dst else _planned_list(gather_list, data, self.size, True, async_op)
            if plan is not None and _usable(data, False) and (self.rank != dst or blocks is not None):
                call, direct, run, root = plan
                if root is None:  # its GatherPlan
                    done = self._submit_planned(call, run, True, async_op, timeout, data, blocks)
                    return done if async_op else gather_list
                return self._submit_planned(call, _gather, direct, async_op, timeout, buffers.flat(data),
                                            None if blocks is None else _flats(blocks), dst, gather_list, run)
        if _on_device(tensor):
            return self.device.gather(tensor, gather_list, dst, async_op, timeout)
        root = self._root(dst, what, "dst")
        inp = self._arr(tensor, what, writable=False)
        outs = None
        if self.rank == root:
            outs = self._list(gather_list, what, "gather_list", writable=True, like=inp)
        fp = self._fp(Coll.GATHER, inp.dtype, root=root, count=inp.size)
        if inp is _planned(tensor, False) and (
                outs is None or all(a is _planned(o, False) for a, o in zip(outs, gather_list))):  # type: ignore[arg-type]
            self._remember((what, inp.dtype, inp.size, root), fp, what, "gather", inp.nbytes * self.size,
                           root, one_rank=True, whole=(inp.nbytes, lambda: GatherPlan(
                               self.direct, inp.dtype, inp.size, root).run))
        return self._submit(fp, what, _gather, async_op, timeout, buffers.flat(inp),
                            None if outs is None else _flats(outs), root, gather_list, _SELECT)

    def scatter(self: Group, tensor: Any, scatter_list: Sequence[Any] | None = None, src: int = 0, *,
                async_op: bool = False, timeout: float | None = None) -> Any:
        """Rank r's tensor receives scatter_list[r] of rank src."""
        what = "scatter"
        data = _planned(tensor, async_op)
        if data is not None:  # a checked signature: see all_reduce
            plan = self.plans.get((what, data.dtype, data.size, src))
            blocks = None if self.rank != src else \
                _planned_list(scatter_list, data, self.size, False, async_op)
            if plan is not None and _usable(data, True) and (self.rank != src or blocks is not None):
                call, direct, run, root = plan
                if root is None:  # its ScatterPlan
                    done = self._submit_planned(call, run, True, async_op, timeout, blocks, data)
                    return done if async_op else tensor
                return self._submit_planned(call, _scatter, direct, async_op, timeout,
                                            None if blocks is None else _flats(blocks), buffers.flat(data),
                                            src, tensor, run)
        if _on_device(tensor):
            return self.device.scatter(tensor, scatter_list, src, async_op, timeout)
        root = self._root(src, what, "src")
        out = self._arr(tensor, what, writable=True)
        ins = None
        if self.rank == root:
            ins = self._list(scatter_list, what, "scatter_list", writable=False, like=out)
        fp = self._fp(Coll.SCATTER, out.dtype, root=root, count=out.size)
        if out is _planned(tensor, False) and (
                ins is None or all(a is _planned(i, False) for a, i in zip(ins, scatter_list))):  # type: ignore[arg-type]
            self._remember((what, out.dtype, out.size, root), fp, what, "scatter", out.nbytes * self.size,
                           root, one_rank=True, whole=(out.nbytes * self.size, lambda: ScatterPlan(
                               self.direct, out.dtype, out.size, root).run))
        return self._submit(fp, what, _scatter, async_op, timeout, None if ins is None else _flats(ins),
                            buffers.flat(out), root, tensor, _SELECT)

    def gatherv(self: Group, output: Any, input: Any, counts: Sequence[int], dst: int = 0, *,
                async_op: bool = False, timeout: float | None = None) -> Any:
        """Vector gather: rank r sends counts[r] elements; `output` (rank dst) holds sum(counts)."""
        what = "gatherv"
        if _on_device(input):
            return self.device.gatherv(output, input, counts, dst, async_op, timeout)
        root = self._root(dst, what, "dst")
        counts = self._counts(counts, what)
        inp = self._arr(input, what, writable=False, name="input")
        if inp.size != counts[self.rank]:
            self._invalid(what, f"input has {inp.size} elements, counts[{self.rank}]={counts[self.rank]}")
        outs = None
        if self.rank == root:
            out = self._arr(output, what, writable=True, name="output")
            self._same_dtype([out, inp], what)
            if out.size != sum(counts):
                self._invalid(what, f"output has {out.size} elements, sum(counts)={sum(counts)}")
            outs = blocks_of(out.reshape(-1), counts)

        def body(call: CollectiveCall) -> Any:
            send = inp.reshape(-1) if outs is None else _apart([inp.reshape(-1)], outs, (0, root))[0]
            tuner.run(self, call, "gather", sum(counts) * inp.itemsize, send, outs, root)
            return output

        return self._submit(self._fp(Coll.GATHERV, inp.dtype, root=root, counts=counts), what, body, async_op,
                            timeout)

    def scatterv(self: Group, output: Any, input: Any, counts: Sequence[int], src: int = 0, *,
                 async_op: bool = False, timeout: float | None = None) -> Any:
        """Vector scatter: rank r receives counts[r] elements of rank src's `input`."""
        what = "scatterv"
        if _on_device(output):
            return self.device.scatterv(output, input, counts, src, async_op, timeout)
        root = self._root(src, what, "src")
        counts = self._counts(counts, what)
        out = self._arr(output, what, writable=True, name="output")
        if out.size != counts[self.rank]:
            self._invalid(what, f"output has {out.size} elements, counts[{self.rank}]={counts[self.rank]}")
        ins = None
        if self.rank == root:
            inp = self._arr(input, what, writable=False, name="input")
            self._same_dtype([out, inp], what)
            if inp.size != sum(counts):
                self._invalid(what, f"input has {inp.size} elements, sum(counts)={sum(counts)}")
            ins = blocks_of(inp.reshape(-1), counts)

        def body(call: CollectiveCall) -> Any:
            sends = None if ins is None else _apart(ins, [out], (root, 0))
            tuner.run(self, call, "scatter", sum(counts) * out.itemsize, sends, out.reshape(-1), root)
            return output

        # the total is in the fingerprint: ranks whose counts sum differently fail as a mismatch
        # (they could not even agree on the algorithm: tree._scatter_cost depends on it)
        return self._submit(self._fp(Coll.SCATTERV, out.dtype, root=root, count=sum(counts), counts=counts),
                            what, body, async_op, timeout)

    def all_to_all(self: Group, output_list: Sequence[Any], input_list: Sequence[Any], *,
                   async_op: bool = False, timeout: float | None = None) -> Any:
        """output_list[r] receives rank r's input_list[this rank]; sizes may differ per pair."""
        what = "all_to_all"
        if _on_device(output_list[0] if output_list else None):
            return self.device.all_to_all(output_list, input_list, async_op, timeout)
        self._check_member(what)
        ins = self._list(input_list, what, "input_list", writable=False)
        outs = self._list(output_list, what, "output_list", writable=True)
        dtype = self._same_dtype(ins + outs, what)
        ins = _apart(ins, outs)
        return self._all_to_all(what, output_list, ins, outs, dtype, async_op, timeout, Coll.ALL_TO_ALLV, -1)

    def all_to_all_single(self: Group, output: Any, input: Any,
                          output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None, *, async_op: bool = False,
                          timeout: float | None = None) -> Any:
        """Split sizes count rows of dim 0 (as torch does); without them, equal blocks."""
        what = "all_to_all_single"
        inp, out = _planned(input, async_op), _planned(output, async_op)
        if inp is not None and out is not None and input_split_sizes is None \
                and output_split_sizes is None:  # a checked signature: see all_reduce
            plan = self.plans.get((what, inp.dtype, inp.shape, out.shape))
            if plan is not None and out.dtype == inp.dtype and _usable(inp, False) and _usable(out, True):
                call, direct, run, counts = plan
                if counts is None:  # the one shot through the slots: in place is fine there
                    done = self._submit_planned(call, run, True, async_op, timeout, inp, out)
                    return done if async_op else output
                if not np.may_share_memory(inp, out):
                    return self._submit_planned(call, _all_to_all, direct, async_op, timeout,
                                                blocks_of(inp.reshape(-1), counts),
                                                blocks_of(out.reshape(-1), counts), True, output, run)
        if _on_device(output):
            return self.device.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                                   async_op, timeout)
        self._check_member(what)
        inp = self._arr(input, what, writable=False, name="input")
        out = self._arr(output, what, writable=True, name="output")
        dtype = self._same_dtype([inp, out], what)
        if np.may_share_memory(inp, out):
            inp = inp.copy()  # see _apart: not planned, so the check above repeats for each call
        ins = self._split(inp, input_split_sizes, what, "input")
        outs = self._split(out, output_split_sizes, what, "output")
        even = input_split_sizes is None and output_split_sizes is None
        coll, count = (Coll.ALL_TO_ALL, inp.size) if even else (Coll.ALL_TO_ALLV, -1)
        if even and inp is _planned(input, False) and out is _planned(output, False) \
                and ins[self.rank].size == outs[self.rank].size:  # so every block has that size
            self._remember((what, inp.dtype, inp.shape, out.shape), self._fp(coll, dtype, count=count), what,
                           "all_to_all", inp.nbytes, [b.size for b in ins],
                           one_rank=True,  # on one rank the algorithm copies the block
                           whole=(inp.nbytes, lambda: TensorPlan(self.direct, "all_to_all", inp.dtype,
                                                                 inp.size).run))
        return self._all_to_all(what, output, ins, outs, dtype, async_op, timeout, coll, count)

    def _split(self: Group, arr: np.ndarray, sizes: Sequence[int] | None, what: str,
               name: str) -> list[np.ndarray]:
        rows = arr.shape[0] if arr.ndim else 1
        row = arr.size // rows if rows else 0
        if sizes is None:
            if rows % self.size:
                self._invalid(what, f"{name} has {rows} rows, not divisible by the group size {self.size}; "
                                    f"pass split sizes")
            sizes = [rows // self.size] * self.size
        sizes = self._counts(sizes, what)
        if sum(sizes) != rows:
            self._invalid(what, f"{name} split sizes {list(sizes)} sum to {sum(sizes)}, "
                                f"{name} has {rows} rows")
        return blocks_of(arr.reshape(-1), [s * row for s in sizes])

    def _all_to_all(self: Group, what: str, result: Any, ins: list[np.ndarray], outs: list[np.ndarray],
                    dtype: np.dtype, async_op: bool, timeout: float | None, coll: Coll, count: int) -> Any:
        if ins[self.rank].size != outs[self.rank].size:
            self._invalid(what, f"this rank sends itself {ins[self.rank].size} elements but expects "
                                f"{outs[self.rank].size}")

        fp = self._fp(coll, dtype, count=count)
        return self._submit(fp, what, _all_to_all, async_op, timeout, ins, outs, coll == Coll.ALL_TO_ALL,
                            result, _SELECT)

    def barrier(self: Group, *, async_op: bool = False, timeout: float | None = None) -> Any:
        """Returns once every rank of the group has entered it."""
        plan = self.plans.get("barrier")
        if plan is None:
            self._check_member("barrier")
            alg = tuner.select(self, "barrier", 0) if self.size > 1 else None
            plan = self.plans["barrier"] = (self.planned_call(_BARRIER, "barrier"),
                                            _no_op if alg is None else alg.run,
                                            alg is not None and alg.needs_direct)
        call, body, direct = plan
        return self._submit_planned(call, body, direct, async_op, timeout)

    def _counts(self: Group, counts: Sequence[int], what: str) -> list[int]:
        out = [int(c) for c in counts]
        if len(out) != self.size or any(c < 0 for c in out):
            self._invalid(what, f"counts must be {self.size} non-negative integers, got {list(counts)}")
        return out

    # -- point-to-point -----------------------------------------------------------------------------
    def _p2p_host(self: Group, tensor: Any, sending: bool, peer: int,
                  tag: int) -> tuple[np.ndarray, P2PRoute]:
        """A host buffer's bytes and its message's route."""
        data = byte_view(as_array(tensor, writable=not sending, rank=self.runtime.rank,
                                  collective="send" if sending else "recv"))
        return data, self._p2p_route(sending, peer, tag, data.nbytes)

    def isend(self: Group, tensor: Any, dst: int, tag: int = 0) -> Any:
        """Non-blocking send; the returned Work completes once the data left this process's hands."""
        if _on_device(tensor):
            return self.device.isend(tensor, dst, tag)
        data, route = self._p2p_host(tensor, True, dst, tag)
        if self.engine.send_now(route.peer, route.wire, data):
            return route.done
        req = self.engine.isend(route.peer, route.header, data, route.label, route.wire)
        return self._p2p_work(req, route)

    def irecv(self: Group, tensor: Any, src: int, tag: int = 0) -> Any:
        """Non-blocking receive into `tensor` (its size must equal the message's)."""
        if _on_device(tensor):
            return self.device.irecv(tensor, src, tag)
        data, route = self._p2p_host(tensor, False, src, tag)
        if self.engine.recv_now(route.peer, route.header, route.wire, data, False):
            return route.done
        return self._p2p_work(self.engine.irecv(route.peer, route.header, data, None, route.label), route)

    def irecv_any(self: Group, tensor: Any, tag: int = 0, timeout: float | None = None) -> Work:
        """Non-blocking receive from whichever member sends first (MPI_ANY_SOURCE); the Work's
        result() is the sender's group rank. A helper thread waits for the first sender."""
        if _on_device(tensor):
            return self.device.irecv_any(tensor, tag, timeout)
        data = as_array(tensor, writable=True, rank=self.runtime.rank, collective="recv")
        work = Work(f"recv from any rank (tag {tag}) on group {self.name}", self.runtime.rank)

        def find_and_receive() -> None:
            try:
                src = self.probe_any(tag, timeout)
                self.recv(data, src, tag, timeout)
            except BaseException as exc:  # handed to whoever waits on the Work
                work._finish(exc=exc)
            else:
                work._finish(src)

        threading.Thread(target=find_and_receive, daemon=True, name="tensorwire-recv-any").start()
        return work

    def send(self: Group, tensor: Any, dst: int, tag: int = 0, timeout: float | None = None) -> None:
        if _on_device(tensor):
            self.device.isend(tensor, dst, tag).wait(self.timeout if timeout is None else timeout)
            return
        data, route = self._p2p_host(tensor, True, dst, tag)
        if not self.engine.send_now(route.peer, route.wire, data):
            self._p2p_wait(self.engine.isend(route.peer, route.header, data, route.label, route.wire),
                           timeout=timeout)

    def recv(self: Group, tensor: Any, src: int, tag: int = 0, timeout: float | None = None) -> int:
        if _on_device(tensor):
            self.device.irecv(tensor, src, tag).wait(self.timeout if timeout is None else timeout)
            return src
        data, route = self._p2p_host(tensor, False, src, tag)
        if not self.engine.recv_now(route.peer, route.header, route.wire, data, True):
            self._p2p_wait(self.engine.irecv(route.peer, route.header, data, None, route.label),
                           timeout=timeout)
        return src

    def sendrecv(self: Group, send: Any, dst: int, recv: Any, src: int, tag: int = 0,
                 timeout: float | None = None) -> int:
        """Send `send` to `dst` and receive into `recv` from `src` at once (MPI_Sendrecv): no
        ordering between the two can deadlock, as a blocking send before a blocking receive
        can on every rank of a ring. Returns `src`."""
        if _on_device(send) or _on_device(recv):
            for buf, what in ((send, "send"), (recv, "recv")):  # both good before anything is sent
                if _on_device(buf):
                    self.device.check_p2p(buf, what)
                else:
                    as_array(buf, writable=what == "recv", rank=self.runtime.rank, collective="sendrecv")
            deadline = time.perf_counter() + (self.timeout if timeout is None else timeout)
            for work in [self.isend(send, dst, tag), self.irecv(recv, src, tag)]:
                work.wait(max(0.0, deadline - time.perf_counter()))
            return src
        out, out_route = self._p2p_host(send, True, dst, tag)
        into, in_route = self._p2p_host(recv, False, src, tag)
        sent = self.engine.send_now(out_route.peer, out_route.wire, out)
        reqs = [] if sent else [self.engine.isend(out_route.peer, out_route.header, out, out_route.label,
                                                  out_route.wire)]
        if not self.engine.recv_now(in_route.peer, in_route.header, in_route.wire, into, True):
            reqs.append(self.engine.irecv(in_route.peer, in_route.header, into, None, in_route.label))
        if reqs:
            self._p2p_wait(*reqs, timeout=timeout)
        return src

    # -- Python objects -----------------------------------------------------------------------------
    def _object_sizes(self: Group, payload: np.ndarray, timeout: float | None) -> list[int]:
        sizes = np.zeros(self.size, dtype=np.int64)
        self.all_gather_into_tensor(sizes, np.array([payload.size], dtype=np.int64), timeout=timeout)
        return [int(s) for s in sizes]

    def all_gather_object(self: Group, object_list: list[Any], obj: Any, *,
                          timeout: float | None = None) -> list[Any]:
        """object_list[r] = rank r's obj (pickled; the object list must have `size` slots)."""
        payload = _pickle(obj)
        sizes = self._object_sizes(payload, timeout)
        buf = np.empty(sum(sizes), dtype=np.uint8)
        self.all_gatherv(buf, payload, sizes, timeout=timeout)
        object_list[:] = [pickle.loads(b) for b in blocks_of(buf, sizes)]
        return object_list

    def gather_object(self: Group, obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, *,
                      timeout: float | None = None) -> list[Any] | None:
        payload = _pickle(obj)
        sizes = self._object_sizes(payload, timeout)
        buf = np.empty(sum(sizes) if self.rank == dst else 0, dtype=np.uint8)
        self.gatherv(buf, payload, sizes, dst, timeout=timeout)
        if self.rank == dst and object_gather_list is not None:
            object_gather_list[:] = [pickle.loads(b) for b in blocks_of(buf, sizes)]
        return object_gather_list

    def broadcast_object_list(self: Group, object_list: list[Any], src: int = 0, *,
                              timeout: float | None = None) -> list[Any]:
        """Replace object_list's items on every rank with those of rank src."""
        payload = _pickle(list(object_list)) if self.rank == src else np.empty(0, dtype=np.uint8)
        size = np.array([payload.size], dtype=np.int64)
        self.broadcast(size, src, timeout=timeout)
        if self.rank != src:
            payload = np.empty(int(size[0]), dtype=np.uint8)
        self.broadcast(payload, src, timeout=timeout)
        if self.rank != src:
            object_list[:] = pickle.loads(payload)
        return object_list

    def scatter_object_list(self: Group, scatter_object_output_list: list[Any],
                            scatter_object_input_list: Sequence[Any] | None = None, src: int = 0, *,
                            timeout: float | None = None) -> list[Any]:
        """scatter_object_output_list[0] = rank src's scatter_object_input_list[this rank]."""
        if self.rank == src:
            if scatter_object_input_list is None or len(scatter_object_input_list) != self.size:
                self._invalid("scatter_object_list", f"needs {self.size} input objects on rank {src}")
            payloads = [_pickle(o) for o in scatter_object_input_list]
            sizes = np.array([p.size for p in payloads], dtype=np.int64)
            buf = np.concatenate(payloads)
        else:
            sizes, buf = np.zeros(self.size, dtype=np.int64), np.empty(0, dtype=np.uint8)
        self.broadcast(sizes, src, timeout=timeout)
        mine = np.empty(int(sizes[self.rank]), dtype=np.uint8)
        self.scatterv(mine, buf, [int(s) for s in sizes], src, timeout=timeout)
        scatter_object_output_list[:1] = [pickle.loads(mine)]
        return scatter_object_output_list


def _pickle(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8).copy()

