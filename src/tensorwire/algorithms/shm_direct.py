"""Collectives through a group's shared segment on one host: in one shot where a message fits a
rank's slot, streamed through the slots in pieces where it does not (all_reduce, broadcast,
all_gather, all_to_all).

Every rank copies its contribution into its own slot once and publishes a flag; readers take
what they need straight out of the other ranks' slots. There are no per-peer messages, no
headers and no matching: a small all_reduce costs one copy in, one flag store, one wait and
n-1 reductions. Every rank reduces the slots in rank order, so all ranks get bitwise the same
result. Fingerprints live beside the flags, so a mismatched call is still caught here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..buffers import PIECE, copy
from ..config import Config
from ..errors import InvalidArgumentError
from ..ops import ReduceOp, Reduction
from ..ops.finalize import finalize
from ..ops.kernels import apply_to, reduction_kernel, ufunc_of, writes_where_told
from ..transport import native
from ..transport.engine import Backoff
from ..transport.segment import CHUNK_BITS, WRITTEN, DirectPath
from .prices import Link
from .registry import Algorithm, register

STREAM_CHUNK = 512 << 10
"""A broadcast, all_gather block or all_to_all send that does not fit a rank's slot streams
through it in pieces of up to this size (whole pages): readers copy one piece out while its
source copies the next in, and a message of any size fits, the source refilling its slot as
the slowest reader empties it (docs/design/segment.md)."""
_UNPLANNED = 64  # signatures whose plan a group's unplanned all_reduces keep (cleared when full)


def _into(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src, where copies larger than a piece go through buffers.copy: glibc's memcpy
    of a MiB or more is slow into a slot a peer has just read (docs/design/buffers.md#pieces)."""
    if src.nbytes > PIECE:
        copy(dst, src)
    else:
        dst[...] = src


def _fold(views: tuple[np.ndarray, ...], out: np.ndarray, kernel: Any) -> None:
    """out = slot_0 op slot_1 op ... in rank order (the same bits on every rank); `kernel`
    is the op's reduction_kernel."""
    apply_to(kernel, out, views[0], views[1])  # the first two slots in one call, no copy first
    if len(views) > 2:
        for v in views[2:]:
            kernel(out, v, out)


def grid_folds(kernel: Any, dtype: np.dtype, n: int, count: int) -> bool:
    """Fold n slots of `count` in one `kernel.reduce` down their grid (DirectPath.grid) instead
    of n - 1 calls? Bit for bit the same for a numpy ufunc on a numpy type: numpy's reduce runs
    the rows as its outer loop, one elementwise pass per row in rank order (only a reduction
    along the contiguous axis sums pairwise, which rows of one element would make it). Faster
    only where the calls' overhead outweighs reduce's slower passes: more than 4 short rows
    (docs/design/segment.md#folding-down-the-grid)."""
    return (n > 4 and count > 1 and count * dtype.itemsize <= 2048 * n and ufunc_of(kernel) is not None
            and dtype.num <= 23 and dtype.kind in "biufc")


def _fold_grid(grid: np.ndarray, out: np.ndarray, kernel: Any) -> None:
    """_fold, where grid_folds said so (inf and NaN are results, as the kernel's)."""
    try:
        ufunc_of(kernel).reduce(grid, axis=0, dtype=out.dtype, out=out)  # type: ignore[union-attr]
    except (FloatingPointError, RuntimeWarning):  # raised once the output is whole
        pass


def _native_fold(dp: DirectPath, op: ReduceOp, dtype: np.dtype) -> int:
    """The compiled fold of a plan's signature where dp has the compiled bodies, else 0."""
    return native.fold_code(op, dtype) if dp.native is not None else 0


class _Stamped:
    """A plan on the segment `dp`, with its fingerprint words looked up once for the
    fingerprint its calls carry."""

    __slots__ = ("dp", "fp", "ab")

    def __init__(self, dp: DirectPath) -> None:
        self.dp = dp
        self.fp = None
        self.ab = (0, 0)

    def words(self, call) -> tuple[int, int]:
        """The words `call`'s fingerprint stamps on the segment (a plan's calls share one
        fingerprint: looked up again only where it changed)."""
        fp = call.fp
        if fp is not self.fp:
            self.fp, self.ab = fp, self.dp.words_of(fp)
        return self.ab


def _finalized(red: Reduction | None) -> Reduction | None:
    """`red` where a plan's run must finalize it after the fold (AVG, PREMUL_SUM), else None."""
    return red if red is not None and red.op in (ReduceOp.AVG, ReduceOp.PREMUL_SUM) else None


class AllReducePlan(_Stamped):
    """One all_reduce signature (dtype, count, reduction) on the direct path with everything
    looked up once: per parity this rank's slot and every rank's, the kernel, the
    finalization. A small all_reduce is mostly such lookups; a planned one skips them (see
    group/collectives.py all_reduce)."""

    __slots__ = ("slots", "kernel", "first", "red", "general", "big", "grids", "code")

    def __init__(self, dp: DirectPath, dtype: np.dtype, count: int, op: ReduceOp,
                 red: Reduction | None = None) -> None:
        """`red`: the reduction whose AVG or PREMUL_SUM `run` finalizes (None: the caller does)."""
        super().__init__(dp)
        self.kernel = reduction_kernel(op, dtype)
        raw = ufunc_of(self.kernel)  # the first fold calls a numpy ufunc itself where it can
        self.first = self.kernel if raw is None or raw in (np.minimum, np.maximum) else raw
        self.red = _finalized(red)
        # the slots' way, unless the message streams or the kernel only reduces in place
        self.general = count * dtype.itemsize > dp.slot_bytes or not writes_where_told(self.kernel)
        self.slots = () if self.general else tuple(  # (mine, first, second, the rest) per parity
            (v[dp.rank], v[0], v[1], v[2:]) for v in dp.views(dtype, count))
        self.big = count * dtype.itemsize > PIECE  # copied in through buffers.copy (see _into)
        self.grids = dp.grid(dtype, count, 0) \
            if not self.general and grid_folds(self.kernel, dtype, dp.size, count) else ()
        self.code = _native_fold(dp, op, dtype) if not self.general and not self.big else 0

    def run(self, call, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The all_reduce body for arrays of the signature, any shapes, in any overlap (the
        slots' way copies src in first; the stream folds in place where they overlap at all):
        dst = the fold of every rank's src in rank order, the same bits on every rank; dst
        returned. One frame for the whole slot path: it is most of a small call."""
        if self.code:  # one C call (see transport/native.py), unless it hands something back
            dp = self.dp
            a, b = self.words(call)
            status = dp.st.all_reduce(call.seq, a, b, call.name, src, dst, self.code)
            return dst if status == native.DONE and self.red is None else self.after(call, status, src, dst)
        flat = dst if dst.ndim == 1 else dst.reshape(-1)
        if src.ndim != 1:
            src = src.reshape(-1)
        if self.general:
            self._fold_apart(call, src, flat)
        else:
            dp, kernel = self.dp, self.kernel
            p = dp.enter(call)
            mine, first, second, rest = self.slots[p]
            if self.big:
                copy(mine, src)
            else:
                mine[...] = src
            dp.publish(call, p, dp.everyone)
            if self.grids:
                _fold_grid(self.grids[p], flat, kernel)
            else:
                try:
                    self.first(first, second, flat)
                except (FloatingPointError, RuntimeWarning):  # the raw ufunc's, once flat is whole
                    pass
                for v in rest:
                    kernel(flat, v, flat)
        if self.red is not None:
            finalize(flat, self.red, self.dp.size)
        return dst

    def after(self, call, status: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The rest of run's compiled body, given its `status`; `dst` returned."""
        dp = self.dp
        st = dp.st
        a, b = self.words(call)
        if dp.resume(call, status, dp.everyone, st.all_reduce, call.seq, a, b, call.name, src, dst,
                     self.code):
            st.fold(st.parity, dst, self.code)
        if self.red is not None:
            finalize(dst.reshape(-1), self.red, dp.size)
        return dst

    def compiled_call(self) -> tuple[int, tuple] | None:
        """(root, the body's arguments after the arrays) where the compiled caller can run this
        plan's calls whole (transport/_caller.c), else None."""
        return (-1, (self.code,)) if self.code and self.red is None else None

    def _fold_apart(self, call, src: np.ndarray, dst: np.ndarray) -> None:
        """run's way for a message larger than the slot, or a kernel that takes no third array."""
        dp = self.dp
        if dst.nbytes > dp.slot_bytes:
            if src is not dst and np.may_share_memory(src, dst):
                copy(dst, src)
                src = dst
            _stream_all_reduce(dp, call, src, dst, self.kernel)
            return
        p = dp.enter(call)
        views = dp.views(dst.dtype, dst.size)[p]
        _into(views[dp.rank], src)
        dp.publish(call, p, dp.everyone)
        _fold(views, dst, self.kernel)


class TensorPlan(_Stamped):
    """One signature (dtype, count) of a single-tensor all_gather, all_to_all or reduce_scatter
    whose input fits the slot, with everything looked up once (as AllReducePlan): the input
    goes into this rank's slot in one copy, and what this rank takes from every slot comes out
    of one grid (see DirectPath.grid): one copy into the output, or one fold per slot in rank
    order. The same protocol and bytes as the list forms below, with a few numpy calls instead
    of one per block."""

    __slots__ = ("collective", "mine", "grids", "rows", "shape", "kernel", "red", "one_call", "cells",
                 "compiled", "offset", "block", "code")

    def __init__(self, dp: DirectPath, collective: str, dtype: np.dtype, count: int,
                 red: Reduction | None = None) -> None:
        super().__init__(dp)
        self.collective = collective
        block = count if collective == "all_gather" else count // dp.size
        self.mine = tuple(v[dp.rank] for v in dp.views(dtype, count))
        offset = 0 if collective == "all_gather" else dp.rank * block * dtype.itemsize  # this rank's block
        self.grids = dp.grid(dtype, block, offset)
        self.rows = tuple(tuple(g) for g in self.grids) \
            if red is not None or collective == "all_gather" else ()  # folded, or copied out, row by row
        self.shape = (dp.size, block)
        self.red = red
        self.kernel = None if red is None else reduction_kernel(red.op, dtype)
        self.one_call = red is not None and grid_folds(self.kernel, dtype, dp.size, block)
        self.cells = tuple(tuple(m[i * block:(i + 1) * block] for i in range(dp.size)) for m in self.mine) \
            if collective == "reduce_scatter" else ()  # where run_blocks puts each block
        self.offset, self.block = offset, block * dtype.itemsize  # run's compiled body: Path.exchange
        self.code = 0 if red is None else _native_fold(dp, red.op, dtype)
        self.compiled = dp.native is not None and count * dtype.itemsize <= PIECE \
            and (red is None or self.code > 0)

    def run(self, call, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Collectives' body for contiguous arrays of the planned signature; `dst` returned."""
        dp = self.dp
        if self.compiled:
            st = dp.st
            a, b = self.words(call)
            status = st.exchange(call.seq, a, b, call.name, src, dst, self.offset, self.block, self.code)
            return dst if status == native.DONE and self.red is None else self.after(call, status, src, dst)
        p = dp.enter(call)
        _into(self.mine[p], src if src.ndim == 1 else src.reshape(-1))
        dp.publish(call, p, dp.everyone)
        return self._out(p, dst)

    def after(self, call, status: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The rest of run's compiled body, given its `status`; `dst` returned."""
        dp = self.dp
        st = dp.st
        a, b = self.words(call)
        if dp.resume(call, status, dp.everyone, st.exchange, call.seq, a, b, call.name, src, dst, self.offset,
                     self.block, self.code):
            return self._out(st.parity, dst)
        if self.red is not None:
            finalize(dst if dst.ndim == 1 else dst.reshape(-1), self.red, dp.size)
        return dst

    def compiled_call(self) -> tuple[int, tuple] | None:
        """See AllReducePlan.compiled_call."""
        return (-1, (self.offset, self.block, self.code)) \
            if self.compiled and _finalized(self.red) is None else None

    def _out(self, p: int, dst: np.ndarray) -> np.ndarray:
        """What this rank takes from every slot of parity p once all are published; `dst` returned."""
        if self.kernel is None:
            dst.reshape(self.shape)[...] = self.grids[p]
            return dst
        return self._reduced(p, dst)

    def run_blocks(self, call, blocks: list[np.ndarray], dst: np.ndarray) -> np.ndarray:
        """reduce_scatter's list form: block r into place r of this rank's slot (where run
        copies the single tensor in one piece), then as run; `dst` returned."""
        dp = self.dp
        p = dp.enter(call)
        for cell, block in zip(self.cells[p], blocks):
            _into(cell, block if block.ndim == 1 else block.reshape(-1))
        dp.publish(call, p, dp.everyone)
        return self._reduced(p, dst)

    def _reduced(self, p: int, dst: np.ndarray) -> np.ndarray:
        """dst = this rank's block of every slot of parity p, folded in rank order and finalized."""
        flat = dst if dst.ndim == 1 else dst.reshape(-1)
        if self.one_call:
            _fold_grid(self.grids[p], flat, self.kernel)
        else:
            _fold(self.rows[p], flat, self.kernel)
        finalize(flat, self.red, self.dp.size)  # type: ignore[arg-type]
        return dst

    def run_list(self, call, src: np.ndarray, outs: list[np.ndarray]) -> None:
        """all_gather's list form: row r of the grid into outs[r] (contiguous, any shapes), one
        copy each; `src` is in this rank's slot before any output is written."""
        dp = self.dp
        p = dp.enter(call)
        _into(self.mine[p], src if src.ndim == 1 else src.reshape(-1))
        dp.publish(call, p, dp.everyone)
        for out, row in zip(outs, self.rows[p]):
            _into(out if out.ndim == 1 else out.reshape(-1), row)


def _publish_all(dp: DirectPath, call, arrays: list[np.ndarray]) -> tuple[int, tuple[np.ndarray, ...]]:
    """Enter, copy `arrays` (one dtype) back to back into this rank's slot, publish, wait for
    everyone; the slots of this call as one typed view each."""
    p = dp.enter(call)
    views = dp.views(arrays[0].dtype, sum(a.size for a in arrays))[p]
    mine = views[dp.rank]
    if len(arrays) == 1:
        _into(mine, arrays[0])
    else:
        offset = 0
        for a in arrays:
            _into(mine[offset:offset + a.size], a)
            offset += a.size
    dp.publish(call, p, dp.everyone)
    return p, views


def direct_all_reduce(call, data: np.ndarray, op: ReduceOp, src: np.ndarray | None = None) -> None:
    """The unplanned entry (group/bodies.py's all_reduce finalizes), with the group's plan of
    the signature (Group.direct_plans, up to _UNPLANNED of them: the path itself holding them
    would make a cycle, and a destroyed group's segment would wait for the garbage collector)."""
    group = call.group
    plans = group.direct_plans
    key = (data.dtype, data.size, op)
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= _UNPLANNED:
            plans.clear()
        plan = plans[key] = AllReducePlan(group.direct, data.dtype, data.size, op)
    plan.run(call, data if src is None else src, data)


class ReducePlan(_Stamped):
    """One reduce signature (dtype, count, reduction, root) whose input fits the slot, on the
    direct path with its slots looked up once (as AllReducePlan): every rank copies its input
    into its slot and publishes it; the root waits for everyone and folds the slots in rank
    order into its output."""

    __slots__ = ("root", "slots", "kernel", "red", "grids", "code")

    def __init__(self, dp: DirectPath, dtype: np.dtype, count: int, op: ReduceOp, root: int,
                 red: Reduction | None = None) -> None:
        """`red`: the reduction whose AVG or PREMUL_SUM `run` finalizes (None: the caller does)."""
        super().__init__(dp)
        self.root = root
        self.slots = tuple((v[dp.rank], v) for v in dp.views(dtype, count))  # (mine, all) per parity
        self.kernel = reduction_kernel(op, dtype)
        self.red = _finalized(red)
        self.grids = dp.grid(dtype, count, 0) if grid_folds(self.kernel, dtype, dp.size, count) else ()
        self.code = _native_fold(dp, op, dtype) if count * dtype.itemsize <= PIECE else 0

    def run(self, call, src: np.ndarray, acc: np.ndarray) -> np.ndarray:
        """The reduce body for arrays of the signature (`acc`: the root's output, else `src`);
        `acc` returned."""
        dp = self.dp
        if self.code:
            a, b = self.words(call)
            status = dp.st.reduce(call.seq, a, b, call.name, src, acc, self.code, self.root)
            return acc if status == native.DONE and self.red is None else self.after(call, status, src, acc)
        p = dp.enter(call)
        mine, views = self.slots[p]
        _into(mine, src if src.ndim == 1 else src.reshape(-1))
        if dp.rank != self.root:
            dp.publish(call, p)
            return acc
        dp.publish(call, p, dp.everyone)
        flat = acc if acc.ndim == 1 else acc.reshape(-1)
        if self.grids:
            _fold_grid(self.grids[p], flat, self.kernel)
        else:
            _fold(views, flat, self.kernel)
        if self.red is not None:
            finalize(flat, self.red, dp.size)
        return acc

    def after(self, call, status: int, src: np.ndarray, acc: np.ndarray) -> np.ndarray:
        """The rest of run's compiled body, given its `status`; `acc` returned."""
        dp = self.dp
        st = dp.st
        a, b = self.words(call)
        mine = dp.rank == self.root
        if dp.resume(call, status, dp.everyone if mine else (), st.reduce, call.seq, a, b, call.name, src,
                     acc, self.code, self.root):
            st.fold(st.parity, acc, self.code)
        if mine and self.red is not None:
            finalize(acc.reshape(-1), self.red, dp.size)
        return acc

    def compiled_call(self) -> tuple[int, tuple] | None:
        """See AllReducePlan.compiled_call."""
        return (self.root, (self.code, self.root)) if self.code and self.red is None else None


class BroadcastPlan(_Stamped):
    """One broadcast signature (dtype, count, root) whose data fits the slot, on the direct path
    with the root's slot looked up once (as AllReducePlan): the root copies its input into its
    slot and publishes it, then fills its output (where that is apart) from the slot, so that
    an output overlapping the input is no matter; the others wait for the root's flag and copy
    the slot out."""

    __slots__ = ("root", "slots", "native", "whom")

    def __init__(self, dp: DirectPath, dtype: np.dtype, count: int, root: int) -> None:
        super().__init__(dp)
        self.root = root
        self.slots = tuple(v[root] for v in dp.views(dtype, count))  # the root's slot per parity
        self.native = dp.native is not None and count * dtype.itemsize <= PIECE
        self.whom = () if dp.rank == root else (root,)  # whom this rank waits for

    def run(self, call, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The broadcast body for arrays of the signature (`src` is read on the root only);
        `dst` returned."""
        dp = self.dp
        if self.native:
            a, b = self.words(call)
            status = dp.st.broadcast(call.seq, a, b, call.name, src, dst, self.root)
            return dst if status == native.DONE else self.after(call, status, src, dst)
        p = dp.enter(call)
        slot = self.slots[p]
        if dp.rank == self.root:
            _into(slot, src if src.ndim == 1 else src.reshape(-1))
            dp.publish(call, p)
            if dst is src:
                return dst
        else:
            dp.publish(call, p, (self.root,))
        _into(dst if dst.ndim == 1 else dst.reshape(-1), slot)
        return dst

    def after(self, call, status: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The rest of run's compiled body, given its `status`; `dst` returned."""
        dp = self.dp
        st = dp.st
        a, b = self.words(call)
        if dp.resume(call, status, self.whom, st.broadcast, call.seq, a, b, call.name, src, dst, self.root):
            _into(dst.reshape(-1), self.slots[st.parity])
        return dst

    def compiled_call(self) -> tuple[int, tuple] | None:
        """See AllReducePlan.compiled_call."""
        return (self.root, (self.root,)) if self.native else None


class GatherPlan(_Stamped):
    """One gather signature (dtype, count, root) on the direct path with the slots looked up
    once (as BroadcastPlan), the protocol of direct_gather: every other rank copies its block
    into its slot and publishes it; the root waits for everyone and copies each slot out. The
    list form's per-block lookups are most of a small gather otherwise."""

    __slots__ = ("root", "mine", "theirs", "native")

    def __init__(self, dp: DirectPath, dtype: np.dtype, count: int, root: int) -> None:
        super().__init__(dp)
        self.root = root
        views = dp.views(dtype, count)
        self.mine = tuple(v[dp.rank] for v in views)
        self.theirs = tuple(tuple((r, v[r]) for r in dp.others) for v in views)  # the root's reads
        self.native = dp.native is not None and count * dtype.itemsize <= PIECE

    def run(self, call, send: np.ndarray, blocks: list[np.ndarray] | None) -> None:
        """The gather body (`blocks`: the root's outputs, any shapes, None elsewhere). The root
        fills its own block first: `send` may lie in another block."""
        dp = self.dp
        if self.native:
            a, b = self.words(call)
            status = dp.st.gather(call.seq, a, b, call.name, send, blocks, self.root)
            if status != native.DONE:
                self.after(call, status, send, blocks)
            return
        p = dp.enter(call)
        flat = send if send.ndim == 1 else send.reshape(-1)
        if blocks is None:
            _into(self.mine[p], flat)
            dp.publish(call, p)
            return
        own = blocks[self.root]
        if own is not send:
            _into(own if own.ndim == 1 else own.reshape(-1), flat)
        dp.publish(call, p, dp.everyone)
        self._copy_out(p, blocks)

    def after(self, call, status: int, send: np.ndarray, blocks: list[np.ndarray] | None) -> None:
        """The rest of run's compiled body, given its `status`."""
        dp = self.dp
        st = dp.st
        a, b = self.words(call)
        whom = () if blocks is None else dp.everyone
        if dp.resume(call, status, whom, st.gather, call.seq, a, b, call.name, send, blocks, self.root):
            self._copy_out(st.parity, blocks)  # type: ignore[arg-type]

    def compiled_call(self) -> tuple[int, tuple] | None:
        """See AllReducePlan.compiled_call."""
        return (self.root, (self.root,)) if self.native else None

    def _copy_out(self, p: int, blocks: list[np.ndarray]) -> None:
        """The root's last step: every other rank's slot of parity p into its block."""
        for r, view in self.theirs[p]:
            out = blocks[r]
            _into(out if out.ndim == 1 else out.reshape(-1), view)


class ScatterPlan(_Stamped):
    """One scatter signature (dtype, count, root) on the direct path with the root's slot
    looked up once, the protocol and layout of direct_scatter (its table included, which an
    unplanned peer reads): the root copies every other rank's block into its slot; each rank
    copies its own out."""

    __slots__ = ("root", "table", "cells", "mine", "native")

    def __init__(self, dp: DirectPath, dtype: np.dtype, count: int, root: int) -> None:
        super().__init__(dp)
        self.root = root
        nbytes = count * dtype.itemsize
        readers = tuple(r for r in dp.everyone if r != root)  # direct_scatter's order
        starts = {r: _scatter_table(dp.size) + i * nbytes for i, r in enumerate(readers)}
        slots = [dp.seg.slots[root][p] for p in (0, 1)]
        self.table = tuple((s[:8 * dp.size].view(np.uint64), np.array(
            [starts.get(r, 0) for r in dp.everyone], dtype=np.uint64)) for s in slots)
        cells = tuple({r: s[at:at + nbytes].view(dtype) for r, at in starts.items()} for s in slots)
        self.cells = tuple(tuple(c.items()) for c in cells)
        self.mine = tuple(c.get(dp.rank) for c in cells)  # None on the root
        self.native = dp.native is not None and nbytes <= PIECE

    def run(self, call, blocks: list[np.ndarray] | None, recv: np.ndarray) -> None:
        """The scatter body (`blocks`: the root's inputs, any shapes, None elsewhere)."""
        dp = self.dp
        if self.native:
            a, b = self.words(call)
            status = dp.st.scatter(call.seq, a, b, call.name, blocks, recv, self.root, self.table[0][1])
            if status != native.DONE:
                self.after(call, status, blocks, recv)
            return
        flat = recv if recv.ndim == 1 else recv.reshape(-1)
        p = dp.enter(call)
        if blocks is None:
            dp.publish(call, p, (self.root,))
            _into(flat, self.mine[p])  # type: ignore[arg-type]
            return
        table, starts = self.table[p]
        table[...] = starts
        for r, cell in self.cells[p]:
            block = blocks[r]
            _into(cell, block if block.ndim == 1 else block.reshape(-1))
        dp.publish(call, p)
        own = blocks[self.root]
        if own is not recv:
            _into(flat, own if own.ndim == 1 else own.reshape(-1))

    def after(self, call, status: int, blocks: list[np.ndarray] | None, recv: np.ndarray) -> None:
        """The rest of run's compiled body, given its `status`."""
        dp = self.dp
        st = dp.st
        a, b = self.words(call)
        starts = self.table[0][1]  # the same offsets on either parity
        if dp.resume(call, status, () if blocks is not None else (self.root,), st.scatter, call.seq, a, b,
                     call.name, blocks, recv, self.root, starts):
            _into(recv if recv.ndim == 1 else recv.reshape(-1), self.mine[st.parity])  # type: ignore[arg-type]

    def compiled_call(self) -> tuple[int, tuple] | None:
        """See AllReducePlan.compiled_call."""
        return (self.root, (self.root, self.table[0][1])) if self.native else None


COMPILED_PLANS = (AllReducePlan, ReducePlan, BroadcastPlan, GatherPlan, ScatterPlan, TensorPlan)
"""The plans whose calls the compiled caller can run whole (their `compiled_call`)."""


def direct_reduce(call, data: np.ndarray, acc: np.ndarray, op: ReduceOp, root: int) -> None:
    """The unplanned entry (group/bodies.py's reduce finalizes)."""
    ReducePlan(call.group.direct, data.dtype, data.size, op, root).run(call, data, acc)


def direct_broadcast(call, data: np.ndarray, root: int) -> None:
    dp = call.group.direct
    if data.nbytes > dp.slot_bytes:
        _stream_broadcast(dp, call, data.view(np.uint8), root)
        return
    BroadcastPlan(dp, data.dtype, data.size, root).run(call, data, data)


class _Stream:
    """One streamed call: each source's bytes pass through its slot as a ring of steps. Step c
    holds piece c of each of the source's `width` streams (one per reader for all_to_all) and
    goes to position c % ring once every reader has read step c - ring; each rank counts the
    steps it wrote and the steps it read (of every source) in its progress words. Every rank
    publishes its flag on entry, so a waiting rank can check what a peer called."""

    def __init__(self, dp: DirectPath, call, nbytes: int, width: int = 1) -> None:
        share = dp.slot_bytes // width
        chunk = min(STREAM_CHUNK, share // 4096 * 4096 or share // 64 * 64)  # pages: see segment.SLOT_SHIFT
        if -(-nbytes // chunk) >> CHUNK_BITS:
            raise InvalidArgumentError(
                f"{call.what}: {nbytes} bytes is more than {1 << CHUNK_BITS} pieces of "
                f"{chunk} bytes through this group's shared-memory slot (raise TENSORWIRE_SHM_DIRECT)")
        self.dp, self.call, self.chunk = dp, call, chunk
        self.step = chunk * width
        self.ring = dp.slot_bytes // self.step
        self.pieces = range(0, nbytes, chunk)
        self.parity = p = dp.enter(call)
        dp.publish(call, p)
        self.ab = dp.prev_fp
        self.base = call.seq << CHUNK_BITS
        self.backoff: Backoff | None = None

    def write(self, c: int, pieces: tuple[np.ndarray, ...], readers: tuple[int, ...]) -> None:
        """Step c (piece c of each stream) into this rank's slot, once `readers` have read
        step c - ring."""
        dp = self.dp
        if c >= self.ring:
            self.backoff = dp.await_readers(self.call, readers, c - self.ring + 1, self.parity, self.ab,
                                            self.backoff)
        at, slot = c % self.ring * self.step, dp.seg.slots[dp.rank][self.parity]
        for piece in pieces:
            slot[at:at + piece.size] = piece
            at += self.chunk
        dp.words[dp.own + WRITTEN] = self.base + c + 1

    def read(self, c: int, source: int, piece: np.ndarray, stream: int = 0) -> None:
        """Piece c of `source`'s stream number `stream` out of its slot, once it is there."""
        piece[...] = self.piece(c, source, piece.size, stream)

    def piece(self, c: int, source: int, nbytes: int, stream: int = 0) -> np.ndarray:
        """The bytes of piece c of `source`'s stream `stream` in its slot, once they are there."""
        dp = self.dp
        if source != dp.rank:
            self.backoff = dp.await_progress(self.call, source, WRITTEN, self.base + c + 1, self.parity,
                                             self.ab, self.backoff)
            if c == 0:  # its stamps were published before its first piece
                dp.check_stamp(self.call, source, self.parity, self.ab)
        at = c % self.ring * self.step + stream * self.chunk
        return dp.seg.slots[source][self.parity][at:at + nbytes]

    def done_reading(self, c: int) -> None:
        self.dp.mark_read(self.call, c + 1)


def _stream_broadcast(dp: DirectPath, call, raw: np.ndarray, root: int) -> None:
    stream = _Stream(dp, call, raw.size)
    chunk = stream.chunk
    for c, lo in enumerate(stream.pieces):
        if dp.rank == root:
            stream.write(c, (raw[lo:lo + chunk],), dp.others)
        else:
            stream.read(c, root, raw[lo:lo + chunk])
            stream.done_reading(c)


def _stream_all_gather(dp: DirectPath, call, raws: list[np.ndarray]) -> None:
    """Every rank a source of its block: write piece c of it, then read piece c of the others'."""
    stream = _Stream(dp, call, raws[0].size)
    chunk, me = stream.chunk, dp.rank
    for c, lo in enumerate(stream.pieces):
        stream.write(c, (raws[me][lo:lo + chunk],), dp.others)
        for r in dp.others:
            stream.read(c, r, raws[r][lo:lo + chunk])
        stream.done_reading(c)


def _stream_all_reduce(dp: DirectPath, call, src: np.ndarray, dst: np.ndarray, kernel: Any) -> None:
    """Every rank a source of its whole input: write piece c of it, then fold piece c of every
    slot, in rank order, into the same piece of the result (dst may be src: piece c of src is
    in the slot before it is overwritten)."""
    stream = _Stream(dp, call, src.nbytes)
    chunk, dtype, size = stream.chunk, src.dtype, src.itemsize
    raw = src.view(np.uint8)
    for c, lo in enumerate(stream.pieces):
        piece = raw[lo:lo + chunk]
        stream.write(c, (piece,), dp.others)
        _fold(tuple(stream.piece(c, r, piece.size).view(dtype) for r in dp.everyone),
              dst[lo // size:(lo + piece.size) // size], kernel)
        stream.done_reading(c)


def direct_gather(call, send: np.ndarray, blocks: list[np.ndarray] | None, root: int) -> None:
    """Every other rank copies its block into its slot; the root copies each out of the slots
    (the one-shot reduce without the fold). Blocks may differ in size (gatherv): the root
    knows them all."""
    dp = call.group.direct
    p = dp.enter(call)
    if dp.rank != root:
        _into(dp.seg.slots[dp.rank][p][:send.nbytes], send.view(np.uint8))
        dp.publish(call, p)
        return
    dp.publish(call, p, dp.everyone)
    assert blocks is not None
    for r in dp.others:
        blocks[r].view(np.uint8)[...] = dp.seg.slots[r][p][:blocks[r].nbytes]
    if blocks[root] is not send:
        copy(blocks[root], send)


def _scatter_table(n: int) -> int:
    """Bytes at the head of a scattering root's slot: where each rank's block starts."""
    return -(-8 * n // 64) * 64


def direct_scatter(call, blocks: list[np.ndarray] | None, recv: np.ndarray, root: int) -> None:
    """The root copies every other rank's block into its slot after a table of where each
    starts (blocks may differ in size: scatterv, whose counts only the root's list shows
    here); each rank copies its own out (the one-shot broadcast, a block each)."""
    dp = call.group.direct
    p = dp.enter(call)
    slot = dp.seg.slots[root][p]
    table = slot[:8 * dp.size].view(np.uint64)
    if dp.rank == root:
        assert blocks is not None
        at = _scatter_table(dp.size)
        for r in dp.others:
            table[r] = at
            _into(slot[at:at + blocks[r].nbytes], blocks[r].view(np.uint8))
            at += blocks[r].nbytes
        dp.publish(call, p)
        if blocks[root] is not recv:
            copy(recv, blocks[root])
        return
    dp.publish(call, p, (root,))
    at = int(table[dp.rank])
    recv.view(np.uint8)[...] = slot[at:at + recv.nbytes]


def direct_barrier(call) -> None:
    dp = call.group.direct
    st = dp.native
    if st is None:
        dp.publish(call, dp.enter(call), dp.everyone)
        return
    a, b = dp.stamp_words(call)
    status = st.barrier(call.seq, a, b, call.name)
    if status != native.DONE:
        barrier_after(call, status)


def barrier_after(call, status: int) -> None:
    """The rest of direct_barrier's compiled body, given its `status` (also the compiled
    caller's, transport/_caller.c)."""
    dp = call.group.direct
    a, b = dp.stamp_words(call)
    dp.resume(call, status, dp.everyone, dp.native.barrier, call.seq, a, b, call.name)


def direct_all_gather(call, blocks: list[np.ndarray]) -> None:
    dp = call.group.direct
    if blocks[0].nbytes > dp.slot_bytes:
        _stream_all_gather(dp, call, [b.view(np.uint8) for b in blocks])
        return
    _, views = _publish_all(dp, call, [blocks[dp.rank]])
    for r, out in enumerate(blocks):
        if r != dp.rank:
            out[...] = views[r]


def direct_reduce_scatter(call, blocks: list[np.ndarray], out: np.ndarray, op: ReduceOp) -> None:
    """Every rank publishes all its blocks; rank r folds block r of every slot, in rank order."""
    dp = call.group.direct
    p, _ = _publish_all(dp, call, blocks)
    offset = sum(b.nbytes for b in blocks[:dp.rank])
    _fold(dp.views(out.dtype, out.size, offset)[p], out, reduction_kernel(op, out.dtype))


def _stream_all_to_all(dp: DirectPath, call, sends: list[np.ndarray], recvs: list[np.ndarray]) -> None:
    """Every rank a source of n-1 streams, one per reader: rank s's stream k is for rank
    s + 1 + k (mod n), so reader r finds its own at k = r - s - 1 (mod n)."""
    n, me = dp.size, dp.rank
    copy(recvs[me], sends[me])
    stream = _Stream(dp, call, sends[0].size, n - 1)
    chunk = stream.chunk
    readers = dp.onward
    for c, lo in enumerate(stream.pieces):
        stream.write(c, tuple(sends[r][lo:lo + chunk] for r in readers), readers)
        for s in readers:
            stream.read(c, s, recvs[s][lo:lo + chunk], (me - s - 1) % n)
        stream.done_reading(c)


def direct_all_to_all(call, sends: list[np.ndarray], recvs: list[np.ndarray]) -> None:
    """Equal blocks only: block `rank` of peer r's slot is ours (one shot), or our stream of
    theirs (streamed, when the sends do not fit the slot)."""
    dp = call.group.direct
    if sends[0].nbytes * dp.size > dp.slot_bytes:
        _stream_all_to_all(dp, call, [b.view(np.uint8) for b in sends], [b.view(np.uint8) for b in recvs])
        return
    p, _ = _publish_all(dp, call, sends)
    block = sends[0].size
    views = dp.views(sends[0].dtype, block * dp.size)[p]
    start = dp.rank * block
    for r, out in enumerate(recvs):
        out[...] = views[r][start:start + block]


# Cost: one flag round (α), the bytes copied into the slot and read out of slots (β), and the
# bytes reduced (γ), as multiples of m (the collective's size as nccl-tests counts it).
_VOLUMES = {  # collective: (copied in, read, reduced) as functions of n
    "all_reduce": (lambda n: 1, lambda n: n, lambda n: n - 1),
    "reduce": (lambda n: 1, lambda n: n, lambda n: n - 1),
    "broadcast": (lambda n: 1, lambda n: 1, lambda n: 0),
    "barrier": (lambda n: 0, lambda n: 0, lambda n: 0),
    "all_gather": (lambda n: 1 / n, lambda n: 1, lambda n: 0),
    "reduce_scatter": (lambda n: 1, lambda n: 1, lambda n: (n - 1) / n),
    "all_to_all": (lambda n: 1, lambda n: 1, lambda n: 0),
    # the blocks into the slots, then out at the root; the root's copy in, then each block out
    "gather": (lambda n: 1 / n, lambda n: (n - 1) / n, lambda n: 0),
    "scatter": (lambda n: (n - 1) / n, lambda n: 1 / n, lambda n: 0),
}
_RUN = {"all_reduce": direct_all_reduce, "reduce": direct_reduce, "broadcast": direct_broadcast,
        "barrier": direct_barrier, "all_gather": direct_all_gather,
        "reduce_scatter": direct_reduce_scatter, "all_to_all": direct_all_to_all,
        "gather": direct_gather, "scatter": direct_scatter}


# What does not fit a slot streams through it, given room for a 64-byte piece per stream
_SLOT_NEED = {"all_reduce": lambda n, m: min(m, 64), "broadcast": lambda n, m: min(m, 64),
              "all_gather": lambda n, m: min(-(-m // n), 64), "all_to_all": lambda n, m: min(m, 64 * (n - 1)),
              "scatter": lambda n, m: _scatter_table(n) + m}  # gather: a block of up to m (gatherv)


def volume_cost(copied, read, reduced, rounds: int = 1):
    """A one-host cost: `rounds` flag rounds (α) and what every rank copies in, reads and
    reduces, as functions of n giving multiples of m."""
    def cost(n: int, m: int, link: Link) -> float:
        return rounds * link.alpha + (copied(n) + read(n)) * m * link.beta + reduced(n) * m * link.gamma
    return cost


def _cost_of(collective: str):
    return volume_cost(*_VOLUMES[collective])


_STREAMED = {  # collective: (what decides one shot or streamed, bytes one source streams,
    # bytes one rank copies) as fractions of m, and how many streams a source's steps carry
    # (_Stream's width: one per reader for all_to_all); None: the rest costs what it does in one shot
    # (the all_reduce folds each piece while it is in cache, and its arrays' memory traffic
    # is small beside the n reads and n-1 folds). The pieces are copied while in cache, at
    # the one-shot β; what misses the host's cache is priced by the tuner on top
    # (cost_model.spill); docs/design/segment.md#pricing-streamed-calls.
    "all_reduce": (lambda n: 1, lambda n: 1, None, lambda n: 1),
    "broadcast": (lambda n: 1, lambda n: 1, lambda n: 1, lambda n: 1),
    "all_gather": (lambda n: 1 / n, lambda n: 1 / n, lambda n: 1, lambda n: 1),  # per block
    "all_to_all": (lambda n: 1, lambda n: (n - 1) / n, lambda n: (2 * n - 1) / n,  # own block, in, out
                   lambda n: n - 1),
}


def _streamed(collective: str):
    """The cost of a collective that streams what does not fit the slot: the one shot of a full
    slot, then one flag round per step handed over beyond it (_Stream: a step holds a piece of
    each of a source's streams, and the source refills its slot a step at a time as the slowest
    reader empties it) and every rank's copies of the rest, overlapping with the other ranks'.
    Priced with the default slot: TENSORWIRE_SHM_DIRECT is not seen
    (docs/design/segment.md#pricing-streamed-calls)."""
    one_shot = _cost_of(collective)
    decides, streamed, copied, width = _STREAMED[collective]

    def cost(n: int, m: int, link: Link) -> float:
        slot = Config().direct_slot(n)
        if decides(n) * m <= slot:
            return one_shot(n, m, link)
        full = int(slot / decides(n))  # the largest one shot: what streams beyond it overlaps
        step = min(STREAM_CHUNK * max(width(n), 1), slot)
        handovers = max(-(-int(streamed(n) * m) // step) - slot // step, 0)
        rest = (one_shot(n, m, link) - one_shot(n, full, link) if copied is None
                else copied(n) * (m - full) * link.beta)
        return one_shot(n, full, link) + handovers * link.alpha + rest
    return cost


for _collective, _run in _RUN.items():
    _cost = (_streamed if _collective in _STREAMED else _cost_of)(_collective)
    register(Algorithm("direct", _collective, _run, _cost, needs_direct=True,
                       copies=0 if _collective == "all_reduce" else 1,
                       out_of_place=_collective == "all_reduce",
                       slot_need=_SLOT_NEED.get(_collective)))
