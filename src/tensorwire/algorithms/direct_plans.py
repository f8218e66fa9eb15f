"""The one-shot path's plans: one call signature (collective, dtype, count, op, root) on a
group's segment with everything looked up once (the slots' views, the kernel, the
finalization), and what the compiled caller needs to run a plan's calls whole
(`compiled_call`, `after`). The checked collectives make them (group/planned.py), and so do the
direct algorithm's entries for unplanned calls (shm_direct.py)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..buffers import PIECE, copy
from ..ops import ReduceOp, Reduction
from ..ops.finalize import finalize
from ..ops.kernels import fold, reduction_kernel, ufunc_of, writes_where_told
from ..transport import native
from ..transport.segment import DirectPath
from ..transport.wire import Fingerprint
from .base import DirectCall
from .direct_streams import stream_all_reduce


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src, where copies larger than a piece go through buffers.copy: glibc's memcpy
    of a MiB or more is slow into a slot a peer has just read (docs/design/buffers.md#pieces)."""
    if src.nbytes > PIECE:
        copy(dst, src)
    else:
        dst[...] = src


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
    """fold, where grid_folds said so (inf and NaN are results, as the kernel's)."""
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
        self.fp: Fingerprint | None = None
        self.ab = (0, 0)

    def words(self, call: DirectCall) -> tuple[int, int]:
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
        self.big = count * dtype.itemsize > PIECE  # copied in through buffers.copy (see copy_into)
        self.grids = dp.grid(dtype, count, 0) \
            if not self.general and grid_folds(self.kernel, dtype, dp.size, count) else ()
        self.code = _native_fold(dp, op, dtype) if not self.general and not self.big else 0

    def run(self, call: DirectCall, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The all_reduce body for arrays of the signature, any shapes, in any overlap (the
        slots' way copies src in first; the stream folds in place where they overlap at all):
        dst = the fold of every rank's src in rank order, the same bits on every rank; dst
        returned. One frame for the whole slot path: it is most of a small call."""
        if self.code:  # one C call (see transport/native.py), unless it hands something back
            dp = self.dp
            a, b = self.words(call)
            status = dp.native.all_reduce(call.seq, a, b, call.name, src, dst, self.code)
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

    def after(self, call: DirectCall, status: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The rest of run's compiled body, given its `status`; `dst` returned."""
        dp = self.dp
        st = dp.native
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

    def _fold_apart(self, call: DirectCall, src: np.ndarray, dst: np.ndarray) -> None:
        """run's way for a message larger than the slot, or a kernel that takes no third array."""
        dp = self.dp
        if dst.nbytes > dp.slot_bytes:
            if src is not dst and np.may_share_memory(src, dst):
                copy(dst, src)
                src = dst
            stream_all_reduce(dp, call, src, dst, self.kernel)
            return
        p = dp.enter(call)
        views = dp.views(dst.dtype, dst.size)[p]
        copy_into(views[dp.rank], src)
        dp.publish(call, p, dp.everyone)
        fold(views, dst, self.kernel)


class TensorPlan(_Stamped):
    """One signature (dtype, count) of a single-tensor all_gather, all_to_all or reduce_scatter
    whose input fits the slot, with everything looked up once (as AllReducePlan): the input
    goes into this rank's slot in one copy, and what this rank takes from every slot comes out
    of one grid (see DirectPath.grid): one copy into the output, or one fold per slot in rank
    order. The same protocol and bytes as the list forms (shm_direct.py), with a few numpy calls
    instead of one per block."""

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

    def run(self, call: DirectCall, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Collectives' body for contiguous arrays of the planned signature; `dst` returned."""
        dp = self.dp
        if self.compiled:
            st = dp.native
            a, b = self.words(call)
            status = st.exchange(call.seq, a, b, call.name, src, dst, self.offset, self.block, self.code)
            return dst if status == native.DONE and self.red is None else self.after(call, status, src, dst)
        p = dp.enter(call)
        copy_into(self.mine[p], src if src.ndim == 1 else src.reshape(-1))
        dp.publish(call, p, dp.everyone)
        return self._out(p, dst)

    def after(self, call: DirectCall, status: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The rest of run's compiled body, given its `status`; `dst` returned."""
        dp = self.dp
        st = dp.native
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

    def run_blocks(self, call: DirectCall, blocks: list[np.ndarray], dst: np.ndarray) -> np.ndarray:
        """reduce_scatter's list form: block r into place r of this rank's slot (where run
        copies the single tensor in one piece), then as run; `dst` returned."""
        dp = self.dp
        p = dp.enter(call)
        for cell, block in zip(self.cells[p], blocks):
            copy_into(cell, block if block.ndim == 1 else block.reshape(-1))
        dp.publish(call, p, dp.everyone)
        return self._reduced(p, dst)

    def _reduced(self, p: int, dst: np.ndarray) -> np.ndarray:
        """dst = this rank's block of every slot of parity p, folded in rank order and finalized."""
        flat = dst if dst.ndim == 1 else dst.reshape(-1)
        if self.one_call:
            _fold_grid(self.grids[p], flat, self.kernel)
        else:
            fold(self.rows[p], flat, self.kernel)
        finalize(flat, self.red, self.dp.size)  # type: ignore[arg-type]
        return dst

    def run_list(self, call: DirectCall, src: np.ndarray, outs: list[np.ndarray]) -> None:
        """all_gather's list form: row r of the grid into outs[r] (contiguous, any shapes), one
        copy each; `src` is in this rank's slot before any output is written."""
        dp = self.dp
        p = dp.enter(call)
        copy_into(self.mine[p], src if src.ndim == 1 else src.reshape(-1))
        dp.publish(call, p, dp.everyone)
        for out, row in zip(outs, self.rows[p]):
            copy_into(out if out.ndim == 1 else out.reshape(-1), row)


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

    def run(self, call: DirectCall, src: np.ndarray, acc: np.ndarray) -> np.ndarray:
        """The reduce body for arrays of the signature (`acc`: the root's output, else `src`);
        `acc` returned."""
        dp = self.dp
        if self.code:
            a, b = self.words(call)
            status = dp.native.reduce(call.seq, a, b, call.name, src, acc, self.code, self.root)
            return acc if status == native.DONE and self.red is None else self.after(call, status, src, acc)
        p = dp.enter(call)
        mine, views = self.slots[p]
        copy_into(mine, src if src.ndim == 1 else src.reshape(-1))
        if dp.rank != self.root:
            dp.publish(call, p)
            return acc
        dp.publish(call, p, dp.everyone)
        flat = acc if acc.ndim == 1 else acc.reshape(-1)
        if self.grids:
            _fold_grid(self.grids[p], flat, self.kernel)
        else:
            fold(views, flat, self.kernel)
        if self.red is not None:
            finalize(flat, self.red, dp.size)
        return acc

    def after(self, call: DirectCall, status: int, src: np.ndarray, acc: np.ndarray) -> np.ndarray:
        """The rest of run's compiled body, given its `status`; `acc` returned."""
        dp = self.dp
        st = dp.native
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

    def run(self, call: DirectCall, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The broadcast body for arrays of the signature (`src` is read on the root only);
        `dst` returned."""
        dp = self.dp
        if self.native:
            a, b = self.words(call)
            status = dp.native.broadcast(call.seq, a, b, call.name, src, dst, self.root)
            return dst if status == native.DONE else self.after(call, status, src, dst)
        p = dp.enter(call)
        slot = self.slots[p]
        if dp.rank == self.root:
            copy_into(slot, src if src.ndim == 1 else src.reshape(-1))
            dp.publish(call, p)
            if dst is src:
                return dst
        else:
            dp.publish(call, p, (self.root,))
        copy_into(dst if dst.ndim == 1 else dst.reshape(-1), slot)
        return dst

    def after(self, call: DirectCall, status: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The rest of run's compiled body, given its `status`; `dst` returned."""
        dp = self.dp
        st = dp.native
        a, b = self.words(call)
        if dp.resume(call, status, self.whom, st.broadcast, call.seq, a, b, call.name, src, dst, self.root):
            copy_into(dst.reshape(-1), self.slots[st.parity])
        return dst

    def compiled_call(self) -> tuple[int, tuple] | None:
        """See AllReducePlan.compiled_call."""
        return (self.root, (self.root,)) if self.native else None


class GatherPlan(_Stamped):
    """One gather signature (dtype, count, root) on the direct path with the slots looked up
    once (as BroadcastPlan), the protocol of shm_direct.direct_gather: every other rank copies
    its block into its slot and publishes it; the root waits for everyone and copies each slot
    out. The list form's per-block lookups are most of a small gather otherwise."""

    __slots__ = ("root", "mine", "theirs", "native")

    def __init__(self, dp: DirectPath, dtype: np.dtype, count: int, root: int) -> None:
        super().__init__(dp)
        self.root = root
        views = dp.views(dtype, count)
        self.mine = tuple(v[dp.rank] for v in views)
        self.theirs = tuple(tuple((r, v[r]) for r in dp.others) for v in views)  # the root's reads
        self.native = dp.native is not None and count * dtype.itemsize <= PIECE

    def run(self, call: DirectCall, send: np.ndarray, blocks: list[np.ndarray] | None) -> None:
        """The gather body (`blocks`: the root's outputs, any shapes, None elsewhere). The root
        fills its own block first: `send` may lie in another block."""
        dp = self.dp
        if self.native:
            a, b = self.words(call)
            status = dp.native.gather(call.seq, a, b, call.name, send, blocks, self.root)
            if status != native.DONE:
                self.after(call, status, send, blocks)
            return
        p = dp.enter(call)
        flat = send if send.ndim == 1 else send.reshape(-1)
        if blocks is None:
            copy_into(self.mine[p], flat)
            dp.publish(call, p)
            return
        own = blocks[self.root]
        if own is not send:
            copy_into(own if own.ndim == 1 else own.reshape(-1), flat)
        dp.publish(call, p, dp.everyone)
        self._copy_out(p, blocks)

    def after(self, call: DirectCall, status: int, send: np.ndarray, blocks: list[np.ndarray] | None) -> None:
        """The rest of run's compiled body, given its `status`."""
        dp = self.dp
        st = dp.native
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
            copy_into(out if out.ndim == 1 else out.reshape(-1), view)


class ScatterPlan(_Stamped):
    """One scatter signature (dtype, count, root) on the direct path with the root's slot
    looked up once, the protocol and layout of shm_direct.direct_scatter (its table included,
    which an unplanned peer reads): the root copies every other rank's block into its slot; each rank
    copies its own out."""

    __slots__ = ("root", "table", "cells", "mine", "native")

    def __init__(self, dp: DirectPath, dtype: np.dtype, count: int, root: int) -> None:
        super().__init__(dp)
        self.root = root
        nbytes = count * dtype.itemsize
        readers = tuple(r for r in dp.everyone if r != root)  # direct_scatter's order
        starts = {r: scatter_table(dp.size) + i * nbytes for i, r in enumerate(readers)}
        slots = [dp.seg.slots[root][p] for p in (0, 1)]
        self.table = tuple((s[:8 * dp.size].view(np.uint64), np.array(
            [starts.get(r, 0) for r in dp.everyone], dtype=np.uint64)) for s in slots)
        cells = tuple({r: s[at:at + nbytes].view(dtype) for r, at in starts.items()} for s in slots)
        self.cells = tuple(tuple(c.items()) for c in cells)
        self.mine = tuple(c.get(dp.rank) for c in cells)  # None on the root
        self.native = dp.native is not None and nbytes <= PIECE

    def run(self, call: DirectCall, blocks: list[np.ndarray] | None, recv: np.ndarray) -> None:
        """The scatter body (`blocks`: the root's inputs, any shapes, None elsewhere)."""
        dp = self.dp
        if self.native:
            a, b = self.words(call)
            status = dp.native.scatter(call.seq, a, b, call.name, blocks, recv, self.root, self.table[0][1])
            if status != native.DONE:
                self.after(call, status, blocks, recv)
            return
        flat = recv if recv.ndim == 1 else recv.reshape(-1)
        p = dp.enter(call)
        if blocks is None:
            dp.publish(call, p, (self.root,))
            copy_into(flat, self.mine[p])  # type: ignore[arg-type]
            return
        table, starts = self.table[p]
        table[...] = starts
        for r, cell in self.cells[p]:
            block = blocks[r]
            copy_into(cell, block if block.ndim == 1 else block.reshape(-1))
        dp.publish(call, p)
        own = blocks[self.root]
        if own is not recv:
            copy_into(flat, own if own.ndim == 1 else own.reshape(-1))

    def after(self, call: DirectCall, status: int, blocks: list[np.ndarray] | None, recv: np.ndarray) -> None:
        """The rest of run's compiled body, given its `status`."""
        dp = self.dp
        st = dp.native
        a, b = self.words(call)
        starts = self.table[0][1]  # the same offsets on either parity
        if dp.resume(call, status, () if blocks is not None else (self.root,), st.scatter, call.seq, a, b,
                     call.name, blocks, recv, self.root, starts):
            copy_into(recv if recv.ndim == 1 else recv.reshape(-1), self.mine[st.parity])

    def compiled_call(self) -> tuple[int, tuple] | None:
        """See AllReducePlan.compiled_call."""
        return (self.root, (self.root, self.table[0][1])) if self.native else None


COMPILED_PLANS = (AllReducePlan, ReducePlan, BroadcastPlan, GatherPlan, ScatterPlan, TensorPlan)
"""The plans whose calls the compiled caller can run whole (their `compiled_call`)."""


def scatter_table(n: int) -> int:
    """Bytes at the head of a scattering root's slot: where each rank's block starts."""
    return -(-8 * n // 64) * 64
