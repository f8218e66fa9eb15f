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

import functools
import os
import sys
from typing import Any

import numpy as np

from ..buffers import PIECE, copy
from ..config import Config
from ..errors import CollectiveMismatchError, InvalidArgumentError
from ..ops import ReduceOp, Reduction, apply_to, finalize, reduction_kernel, writes_where_told
from ..transport import cma, pages
from ..transport.engine import Backoff, Engine
from ..transport.shm import GroupSegment
from ..transport.wire import Fingerprint
from .registry import Algorithm, Link, register

_CACHED = 64  # views and fingerprint words kept per group (cleared when full)
_PRESPIN = 200  # flag polls before the first health check (~20 us)
_PREYIELD = 16
"""Where ranks share cores: yields in a bare loop before a flag wait sets up its Backoff. The
Backoff's setup and rounds are Python that the rank being waited for does not get to run: at
n=4 on 2 cores the one-shot collectives took 0.58-0.85x their time up to 128 KiB with it (4
launches each way); 4 or 64 did as well as 16."""
_WRITTEN, _READ = 1, 2
"""Words of a control line beside the flag: how far this rank is through a streamed call, as
(seq << _CHUNK_BITS) + pieces written into its slot, and + pieces read from every source.
Numbered by call, they never need resetting, and a peer still in an earlier call reads as behind."""
_CHUNK_BITS = 24
_PID, _HOME = 3, 4
"""Words of a control line set once, at the group's setup: the rank's process id, and where
its own _PID word lies in its memory (0: it offers no single copy). A peer that reads that
word through cross-memory attach knows it may read this rank's buffers (algorithms/single_copy.py)."""
STREAM_CHUNK = 512 << 10
"""A broadcast, all_gather block or all_to_all send that does not fit a rank's slot streams
through it in pieces of up to this size (whole pages): readers copy one piece out while its
source copies the next in, and a message of any size fits, the source refilling its slot as
the slowest reader empties it. Measured at n=2 (interleaved, 40 calls): 512 KiB pieces beat
128 and 256 KiB ones by 8-20% at 4 MiB for all three; where a message fits the slot, the one
shot was as fast or faster (all_to_all 512 KiB: 80 against 192-215 us streamed)."""
_MESSAGE = 5
"""Words of a control line with the (seq, fingerprint) of the last call this rank ran on the
message path (`DirectPath.stamp`): the next call through the segment checks them."""
_STAMP = 8
"""Word of a control line where the per-parity (seq, fingerprint) stamps start: the line's
second cache line, so that writing them does not steal the flag's line from a peer spinning
on it (each such store cost a coherence round trip; now only the flag store does)."""


def _fp_words(fp: Fingerprint) -> tuple[int, int]:
    """Two words; the op parameter (aux) is folded to 32 bits: enough to tell factors apart."""
    a = fp.coll | fp.dtype << 8 | fp.op << 16 | ((fp.root + 1) & 0xFFFFFF) << 24
    aux32 = (fp.aux ^ fp.aux >> 32) & 0xFFFFFFFF
    return a, ((fp.count + 1) & 0xFFFFFFFF) | aux32 << 32


def _fp_from_words(a: int, b: int) -> Fingerprint:
    return Fingerprint(a & 0xFF, a >> 8 & 0xFF, a >> 16 & 0xFF, (a >> 24 & 0xFFFFFF) - 1,
                       (b & 0xFFFFFFFF) - 1, b >> 32)


class DirectPath:
    """The direct path of one group on this rank: which slot is next, and how to wait."""

    def __init__(self, seg: GroupSegment, rank: int, engine: Engine, ctx: int, members: list[int]) -> None:
        self.seg = seg
        self.rank = rank
        self.size = seg.size
        self.everyone = tuple(range(self.size))
        self.others = tuple(r for r in self.everyone if r != rank)
        self.onward = tuple((rank + k) % self.size for k in range(1, self.size))
        """The others, starting past this rank: ranks that each visit their peers in this order
        spread over them instead of all starting at rank 0."""
        self.engine = engine
        self.ctx = ctx
        self.members = tuple(members)
        self.slot_bytes = seg.slot_bytes
        self.words = seg.words
        self.flags = tuple(seg.lines)  # word index of each rank's flag (its control line)
        self.own = self.flags[rank]
        self.parity = 1
        self.prev_seq = 0
        self.prev_fp = (0, 0)
        self._last_fp: Fingerprint | None = None  # the fingerprint prev_fp's words are of
        self.prev_name = ""  # the previous call's collective (its number is prev_seq)
        self.settled = True  # every rank is known to be past the previous call, its fingerprint checked
        self.message: tuple[int, int, int, str] | None = None  # a message-path call to check (stamp)
        self._fp_words: dict[Fingerprint, tuple[int, int]] = {}
        self._views: dict[tuple, tuple] = {}
        self.single_copy = False  # see offer_single_copy
        self.crowded = False
        """Ranks outnumber cores (and TENSORWIRE_SINGLE_COPY is not `force`): only the single
        copy algorithms that declare `single_copy_crowded` run (see Algorithm)."""
        self.offered = "not yet"  # why this rank offers no single copy ('' if it does)
        self.pids: tuple[int, ...] = ()
        self.reader = cma.Reader()
        self.kept: np.ndarray | None = None  # single copy's in-place fold keeps its own piece here
        self.folded: np.ndarray | None = None  # single copy's reduce: a non-root's folded block
        self.huge_eighths = pages.UNKNOWN  # in single copy's last call, the least of its sources' (pages.py)

    def offer_single_copy(self, why_not: str) -> None:
        """Publish this process's id, and (unless `why_not` says why not) where peers can test
        reading its memory. Collective: every rank offers before any probes."""
        self.offered = why_not
        line = self.own
        self.words[line + _PID] = os.getpid()
        self.words[line + _HOME] = 0 if why_not else self.seg.bytes.ctypes.data + 8 * (line + _PID)

    def probe_single_copy(self) -> str:
        """'' if this rank can read every peer's memory (once all offered); else why not."""
        for r in self.others:
            line = self.flags[r]
            pid, home = self.words[line + _PID], self.words[line + _HOME]
            if not home:
                return f"rank {self.members[r]} cannot offer it"
            why = cma.can_read(pid, home, pid)
            if why:
                return f"reading rank {self.members[r]}'s memory: {why}"
        return ""

    def enable_single_copy(self) -> None:
        self.single_copy = True
        self.pids = tuple(self.words[line + _PID] for line in self.flags)

    def views(self, dtype: np.dtype, count: int, offset: int = 0) -> tuple[tuple[np.ndarray, ...], ...]:
        """Per parity, every rank's slot as `count` elements of `dtype` from byte `offset`.

        Cached: making a numpy view costs about as much as a whole small all_reduce's copy."""
        key = (dtype, count, offset)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= _CACHED:
                self._views.clear()
            end = offset + count * dtype.itemsize
            views = self._views[key] = tuple(
                tuple(self.seg.slots[r][p][offset:end].view(dtype) for r in self.everyone) for p in (0, 1))
        return views

    def grid(self, dtype: np.dtype, count: int, offset: int) -> tuple[np.ndarray, ...]:
        """Per parity, the same `count` elements from byte `offset` of every rank's slot as the
        rows of one array: the slots lie at one stride, so what a rank takes from all of them
        is one numpy copy instead of one per rank. Cached as `views`."""
        key = (dtype, count, offset, "grid")
        grids = self._views.get(key)
        if grids is None:
            if len(self._views) >= _CACHED:
                self._views.clear()
            stride = self.seg.rank_stride
            grids = self._views[key] = tuple(  # type: ignore[assignment]
                np.lib.stride_tricks.as_strided(self.seg.slots[0][p][offset:].view(dtype),
                                                (self.size, count), (stride, dtype.itemsize))
                for p in (0, 1))
        return grids  # type: ignore[return-value]

    def words_of(self, fp: Fingerprint) -> tuple[int, int]:
        """`fp` as stamped, remembered as the last one published."""
        ab = self._fp_words.get(fp)
        if ab is None:
            if len(self._fp_words) >= _CACHED:
                self._fp_words.clear()
            ab = self._fp_words[fp] = _fp_words(fp)
        self._last_fp = fp
        self.prev_fp = ab
        return ab

    # -- the protocol -----------------------------------------------------------------------------
    def enter(self, call) -> int:
        """Take the next slot parity, once every rank is past the call that last used it.

        Unless this rank already saw everyone publish the previous call (then it is settled),
        that call's fingerprints are checked here too: a rank that returned without waiting
        (a broadcast root) learns of a mismatch now."""
        self.parity ^= 1
        if self.message is not None:
            self._check_message(call)
        if not self.settled:
            self._wait(call, self.everyone, self.prev_seq)
            words, flags = self.words, self.flags
            base = _STAMP + (self.parity ^ 1) * 3
            for r in self.everyone:
                line = flags[r] + base
                if words[line] == self.prev_seq and (words[line + 1], words[line + 2]) != self.prev_fp:
                    theirs = _fp_from_words(words[line + 1], words[line + 2])
                    prev = f"{self.prev_name} #{self.prev_seq} on group {call.group.name}"
                    raise self.engine.mismatch_error(
                        f"{prev} (found at {call.what})",
                        _fp_from_words(*self.prev_fp), theirs, self.members[r])
            self.settled = True
        return self.parity

    def stamp(self, call) -> None:
        """Note a call that ran on the message path where every rank can read it, waiting for
        no one; the next call through the segment checks the peers' notes (`_check_message`).
        In a chain broadcast to different roots (rank 0 sends to 1, while 1 and 2 agree on
        root 1: 1 -> 2 -> 0) every message a rank receives comes from a rank that agrees with
        it, and a barrier through the segment after it returned everywhere, the mismatch unseen."""
        a, b = _fp_words(call.fp)  # not words_of: prev_fp is the last call through the segment
        line = self.own + _MESSAGE
        self.words[line + 1], self.words[line + 2] = a, b
        self.words[line] = call.seq  # last: the fingerprint above is this call's
        self.message = (call.seq, a, b, call.what)

    def _check_message(self, call) -> None:
        """Raise if a peer noted this rank's last message-path call with another fingerprint.
        Every rank notes it before it enters this call, so the last to enter sees all notes."""
        seq, a, b, what = self.message  # type: ignore[misc]
        self.message = None
        words = self.words
        for r in self.others:
            line = self.flags[r] + _MESSAGE
            if words[line] == seq and (words[line + 1], words[line + 2]) != (a, b):
                raise self.engine.mismatch_error(f"{what} (found at {call.what})", _fp_from_words(a, b),
                                                 _fp_from_words(words[line + 1], words[line + 2]),
                                                 self.members[r])

    def publish(self, call, parity: int, ranks: tuple[int, ...] = ()) -> None:
        """Publish this rank's slot and fingerprint for `call`; then wait for `ranks` (`everyone`
        or others) to publish it too, and check they called the same thing. One method for
        both halves: this pair is most of a small call's protocol."""
        fp = call.fp
        # a repeated call (the same fingerprint object) skips the hashing
        a, b = self.prev_fp if fp is self._last_fp else self.words_of(fp)
        words, seq = self.words, call.seq
        off = _STAMP + 3 * parity
        at = self.own + off
        words[at] = seq
        words[at + 1] = a
        words[at + 2] = b
        words[self.own] = seq  # last: publishes the data and the fingerprint above
        self.prev_seq = seq
        self.prev_name = call.name
        if not ranks:
            self.settled = False
            return
        flags = self.flags
        everyone = ranks is self.everyone
        if everyone:
            ranks = self.others  # this rank's own flag is set
        for r in ranks:
            if words[flags[r]] < seq:
                self._wait(call, ranks, seq)
                break
        for r in ranks:
            at = flags[r] + off
            if words[at] != seq or words[at + 1] != a or words[at + 2] != b:
                raise self._mismatch_with(call, r)
        self.settled = everyone

    def _wait(self, call, ranks: tuple[int, ...], seq: int) -> None:
        words, flags = self.words, self.flags
        # poll flags only, no bookkeeping: a running peer is a microsecond away (unless ranks
        # share cores: then the engine does not spin and neither does this)
        spins = _PRESPIN if self.engine.spin_s else 0
        yields = 0 if spins else _PREYIELD
        for r in ranks:
            line = flags[r]
            while words[line] < seq and spins:
                spins -= 1
            while words[line] < seq and yields:
                yields -= 1
                os.sched_yield()
            if words[line] < seq:
                break
        else:
            return
        pending = [r for r in ranks if words[flags[r]] < seq]
        backoff = Backoff(self.engine, call.started().deadline, self.ctx, call.seq, self.members,
                          functools.partial(self.cross_check, call))
        lost = self.engine.lost
        while pending:
            pending = [r for r in pending if words[flags[r]] < seq]
            if pending:
                backoff.idle(functools.partial(self._timeout, call, pending))
                for r in pending:
                    # gone, and (re-read after the loss was noticed) never entered this call
                    if self.members[r] in lost and words[flags[r]] < seq:
                        raise self.engine.lost_error(self.members[r])

    def check_stamp(self, call, r: int, parity: int, ab: tuple[int, int]) -> None:
        """Raise if rank r stamped `call`'s number on its slot of `parity` with another call."""
        words, base = self.words, self.flags[r] + _STAMP + parity * 3
        if words[base] == call.seq and (words[base + 1], words[base + 2]) != ab:
            raise self._mismatch_with(call, r)

    def await_progress(self, call, r: int, word: int, target: int, parity: int, ab: tuple[int, int],
                       backoff: Backoff | None) -> Backoff | None:
        """Wait until rank r's progress `word` (_WRITTEN, _READ) reaches `target`. A rank that
        published this call with another fingerprint called something else: that is raised,
        not waited out. Returns the call's Backoff (made on the first wait that has to back
        off, reset on each later one)."""
        words = self.words
        at = self.flags[r] + word
        spins = _PRESPIN if self.engine.spin_s else 0
        while words[at] < target and spins:
            spins -= 1
        if words[at] >= target:
            return backoff
        if backoff is None:
            backoff = Backoff(self.engine, call.started().deadline, self.ctx, call.seq, self.members,
                              functools.partial(self.cross_check, call))
        else:
            backoff.reset()
        flag, seq, lost, peer = self.flags[r], call.seq, self.engine.lost, self.members[r]
        while words[at] < target:
            if words[flag] >= seq:
                self.check_stamp(call, r, parity, ab)
            backoff.idle(functools.partial(self._timeout, call, [r]))
            if peer in lost and words[at] < target:
                raise self.engine.lost_error(peer)
        return backoff

    def mark_read(self, call, steps: int) -> None:
        """This rank has read `steps` steps of every source in `call` (its _READ progress word)."""
        self.words[self.own + _READ] = (call.seq << _CHUNK_BITS) + steps

    def await_readers(self, call, readers: tuple[int, ...], steps: int, parity: int, ab: tuple[int, int],
                      backoff: Backoff | None) -> Backoff | None:
        """Wait until every one of `readers` has read `steps` steps of `call` (see await_progress)."""
        target = (call.seq << _CHUNK_BITS) + steps
        for r in readers:
            backoff = self.await_progress(call, r, _READ, target, parity, ab, backoff)
        return backoff

    def _mismatch_with(self, call, r: int) -> CollectiveMismatchError:
        words, line = self.seg.words, self.seg.lines[r]
        for parity in (0, 1):
            base = line + _STAMP + parity * 3
            if words[base] == call.seq:
                theirs = _fp_from_words(words[base + 1], words[base + 2])
                mine = _fp_from_words(*_fp_words(call.fp))  # compared as stored: aux folded
                return self.engine.mismatch_error(call.what, mine, theirs, self.members[r])
        return CollectiveMismatchError(
            f"rank {self.engine.rank}: {call.what}: group rank {r} is out of step with this rank "
            f"(it published call #{words[line]})")

    def _timeout(self, call, pending: list[int]):
        from ..errors import TimeoutError

        world = [self.members[r] for r in pending]
        return TimeoutError(
            f"rank {self.engine.rank}: {call.what} timed out waiting for rank(s) "
            f"{', '.join(map(str, world))} to enter it (shared-memory path). The peer is stuck, "
            f"slower than the timeout, or never called this operation.")

    def cross_check(self, call) -> None:
        """A peer that sent messages for this call took the message path: it called otherwise."""
        for (peer, key), queue in list(self.engine.unexpected.items()):
            if key[0] == self.ctx and key[2] == call.seq and queue:
                raise self.engine.mismatch_error(call.what, call.fp, queue[0].header.fp, peer)

    def published(self, seq: int, fp: Fingerprint) -> list[tuple[int, Fingerprint]]:
        """(group rank, fingerprint) of peers that entered call `seq` through this path, or
        ran it on the message path (`stamp`) as something other than `fp`."""
        out = []
        words = self.seg.words
        mine = _fp_words(fp)
        for r, line in enumerate(self.seg.lines):
            if r == self.rank:
                continue
            for parity in (0, 1):
                base = line + _STAMP + parity * 3
                if words[base] == seq:
                    out.append((r, _fp_from_words(words[base + 1], words[base + 2])))
            base = line + _MESSAGE
            if words[base] == seq and (words[base + 1], words[base + 2]) != mine:
                out.append((r, _fp_from_words(words[base + 1], words[base + 2])))
        return out


def _into(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[...] = src, where copies larger than a piece go through buffers.copy: one memcpy of
    a MiB into a slot that a peer has just read ran 4.8x slower (see buffers.PIECE)."""
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
    only where the calls' overhead outweighs reduce's slower passes: float32 sums, one call
    against n - 1, 2.1 -> 1.0 us at 8 slots of 8 B, 7.7 -> 7.4 at 32 KiB; 16 slots 4.2 -> 1.1
    and 16.1 -> 13.5; at 3-4 slots no faster, and rows of 256 KiB and more 1.1-1.6x slower."""
    return (n > 4 and count > 1 and count * dtype.itemsize <= 2048 * n and type(kernel) is np.ufunc
            and dtype.num <= 23 and dtype.kind in "biufc")


def _fold_grid(grid: np.ndarray, out: np.ndarray, kernel: Any) -> None:
    """_fold, where grid_folds said so."""
    kernel.reduce(grid, axis=0, dtype=out.dtype, out=out)


def _finalized(red: Reduction | None) -> Reduction | None:
    """`red` where a plan's run must finalize it after the fold (AVG, PREMUL_SUM), else None."""
    return red if red is not None and red.op in (ReduceOp.AVG, ReduceOp.PREMUL_SUM) else None


class AllReducePlan:
    """One all_reduce signature (dtype, count, reduction) on the direct path with everything
    looked up once: per parity this rank's slot and every rank's, the kernel, the
    finalization. A small all_reduce is mostly such lookups; a planned one skips them (see
    Collectives.all_reduce)."""

    __slots__ = ("dp", "slots", "kernel", "red", "general", "big", "grids")

    def __init__(self, dp: DirectPath, dtype: np.dtype, count: int, op: ReduceOp,
                 red: Reduction | None = None) -> None:
        """`red`: the reduction whose AVG or PREMUL_SUM `run` finalizes (None: the caller does)."""
        self.dp = dp
        self.kernel = reduction_kernel(op, dtype)
        self.red = _finalized(red)
        # the slots' way, unless the message streams or the kernel only reduces in place
        self.general = count * dtype.itemsize > dp.slot_bytes or not writes_where_told(self.kernel)
        self.slots = () if self.general else tuple(  # (mine, first, second, the rest) per parity
            (v[dp.rank], v[0], v[1], v[2:]) for v in dp.views(dtype, count))
        self.big = count * dtype.itemsize > PIECE  # copied in through buffers.copy (see _into)
        self.grids = dp.grid(dtype, count, 0) \
            if not self.general and grid_folds(self.kernel, dtype, dp.size, count) else ()

    def run(self, call, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The all_reduce body for arrays of the signature, any shapes, in any overlap (the
        slots' way copies src in first; the stream folds in place where they overlap at all):
        dst = the fold of every rank's src in rank order, the same bits on every rank; dst
        returned. One frame for the whole slot path: it is most of a small call."""
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
                kernel(first, second, flat)
                for v in rest:
                    kernel(flat, v, flat)
        if self.red is not None:
            finalize(flat, self.red, self.dp.size)
        return dst

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


class TensorPlan:
    """One signature (dtype, count) of a single-tensor all_gather, all_to_all or reduce_scatter
    whose input fits the slot, with everything looked up once (as AllReducePlan): the input
    goes into this rank's slot in one copy, and what this rank takes from every slot comes out
    of one grid (see DirectPath.grid): one copy into the output, or one fold per slot in rank
    order. The same protocol and bytes as the list forms below, with a few numpy calls instead
    of one per block."""

    __slots__ = ("collective", "dp", "mine", "grids", "rows", "shape", "kernel", "red", "one_call", "cells")

    def __init__(self, dp: DirectPath, collective: str, dtype: np.dtype, count: int,
                 red: Reduction | None = None) -> None:
        self.collective = collective
        self.dp = dp
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

    def run(self, call, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Collectives' body for contiguous arrays of the planned signature; `dst` returned."""
        dp = self.dp
        p = dp.enter(call)
        _into(self.mine[p], src if src.ndim == 1 else src.reshape(-1))
        dp.publish(call, p, dp.everyone)
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
    """The unplanned entry (Collectives' _all_reduce finalizes)."""
    AllReducePlan(call.group.direct, data.dtype, data.size, op).run(call, data if src is None else src, data)


class ReducePlan:
    """One reduce signature (dtype, count, reduction, root) whose input fits the slot, on the
    direct path with its slots looked up once (as AllReducePlan): every rank copies its input
    into its slot and publishes it; the root waits for everyone and folds the slots in rank
    order into its output."""

    __slots__ = ("dp", "root", "slots", "kernel", "red", "grids")

    def __init__(self, dp: DirectPath, dtype: np.dtype, count: int, op: ReduceOp, root: int,
                 red: Reduction | None = None) -> None:
        """`red`: the reduction whose AVG or PREMUL_SUM `run` finalizes (None: the caller does)."""
        self.dp = dp
        self.root = root
        self.slots = tuple((v[dp.rank], v) for v in dp.views(dtype, count))  # (mine, all) per parity
        self.kernel = reduction_kernel(op, dtype)
        self.red = _finalized(red)
        self.grids = dp.grid(dtype, count, 0) if grid_folds(self.kernel, dtype, dp.size, count) else ()

    def run(self, call, src: np.ndarray, acc: np.ndarray) -> np.ndarray:
        """The reduce body for arrays of the signature (`acc`: the root's output, else `src`);
        `acc` returned."""
        dp = self.dp
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


class BroadcastPlan:
    """One broadcast signature (dtype, count, root) whose data fits the slot, on the direct path
    with the root's slot looked up once (as AllReducePlan): the root copies its input into its
    slot and publishes it, then fills its output (where that is apart) from the slot, so that
    an output overlapping the input is no matter; the others wait for the root's flag and copy
    the slot out."""

    __slots__ = ("dp", "root", "slots")

    def __init__(self, dp: DirectPath, dtype: np.dtype, count: int, root: int) -> None:
        self.dp = dp
        self.root = root
        self.slots = tuple(v[root] for v in dp.views(dtype, count))  # the root's slot per parity

    def run(self, call, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The broadcast body for arrays of the signature (`src` is read on the root only);
        `dst` returned."""
        dp = self.dp
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


class GatherPlan:
    """One gather signature (dtype, count, root) on the direct path with the slots looked up
    once (as BroadcastPlan), the protocol of direct_gather: every other rank copies its block
    into its slot and publishes it; the root waits for everyone and copies each slot out. The
    list form's per-block lookups are most of a small gather otherwise: 31 us at 8 ranks on
    16 cores where a single-tensor all_gather took 13."""

    __slots__ = ("dp", "root", "mine", "theirs")

    def __init__(self, dp: DirectPath, dtype: np.dtype, count: int, root: int) -> None:
        self.dp = dp
        self.root = root
        views = dp.views(dtype, count)
        self.mine = tuple(v[dp.rank] for v in views)
        self.theirs = tuple(tuple((r, v[r]) for r in dp.others) for v in views)  # the root's reads

    def run(self, call, send: np.ndarray, blocks: list[np.ndarray] | None) -> None:
        """The gather body (`blocks`: the root's outputs, any shapes, None elsewhere). The root
        fills its own block first: `send` may lie in another block."""
        dp = self.dp
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
        for r, view in self.theirs[p]:
            out = blocks[r]
            _into(out if out.ndim == 1 else out.reshape(-1), view)


class ScatterPlan:
    """One scatter signature (dtype, count, root) on the direct path with the root's slot
    looked up once, the protocol and layout of direct_scatter (its table included, which an
    unplanned peer reads): the root copies every other rank's block into its slot; each rank
    copies its own out."""

    __slots__ = ("dp", "root", "table", "cells", "mine")

    def __init__(self, dp: DirectPath, dtype: np.dtype, count: int, root: int) -> None:
        self.dp = dp
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

    def run(self, call, blocks: list[np.ndarray] | None, recv: np.ndarray) -> None:
        """The scatter body (`blocks`: the root's inputs, any shapes, None elsewhere)."""
        dp = self.dp
        p = dp.enter(call)
        flat = recv if recv.ndim == 1 else recv.reshape(-1)
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


def direct_reduce(call, data: np.ndarray, acc: np.ndarray, op: ReduceOp, root: int) -> None:
    """The unplanned entry (Collectives' _reduce finalizes)."""
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
        chunk = min(STREAM_CHUNK, share // 4096 * 4096 or share // 64 * 64)  # pages: see shm._SLOT_SHIFT
        if -(-nbytes // chunk) >> _CHUNK_BITS:
            raise InvalidArgumentError(
                f"{call.what}: {nbytes} bytes is more than {1 << _CHUNK_BITS} pieces of "
                f"{chunk} bytes through this group's shared-memory slot (raise TENSORWIRE_SHM_DIRECT)")
        self.dp, self.call, self.chunk = dp, call, chunk
        self.step = chunk * width
        self.ring = dp.slot_bytes // self.step
        self.pieces = range(0, nbytes, chunk)
        self.parity = p = dp.enter(call)
        dp.publish(call, p)
        self.ab = dp.prev_fp
        self.base = call.seq << _CHUNK_BITS
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
        dp.words[dp.own + _WRITTEN] = self.base + c + 1

    def read(self, c: int, source: int, piece: np.ndarray, stream: int = 0) -> None:
        """Piece c of `source`'s stream number `stream` out of its slot, once it is there."""
        piece[...] = self.piece(c, source, piece.size, stream)

    def piece(self, c: int, source: int, nbytes: int, stream: int = 0) -> np.ndarray:
        """The bytes of piece c of `source`'s stream `stream` in its slot, once they are there."""
        dp = self.dp
        if source != dp.rank:
            self.backoff = dp.await_progress(self.call, source, _WRITTEN, self.base + c + 1, self.parity,
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
    dp.publish(call, dp.enter(call), dp.everyone)


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
    # (the all_reduce folds each piece while it is in cache, and its arrays' memory traffic,
    # one read and one write a byte, is small beside the n reads and n-1 folds: 4-64 MiB
    # measured 0.75-1.38x the one-shot formula at n=4 (`--algo all` and the shm-n4 sweep) and
    # 0.61-0.75x at n=2; priced like a broadcast's streamed bytes, 0.66-0.99x at n=4). The
    # pieces are copied while in cache, at the one-shot β; what misses the host's cache is
    # priced by the tuner on top (tuner.spill). A factor of 2.5 β a streamed byte, from before
    # copies ran in pieces (buffers.PIECE) and before that term, counted memory twice.
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
    Priced with the default slot: TENSORWIRE_SHM_DIRECT is not seen. (A flag round per slot
    refill, half as many for a single stream, had priced the shm-n4 sweep of 2026-11-25 at
    0.4-0.8 of its time at 4-64 MiB; re-priced per step, the choice's prediction was within
    ±30% at 25 of 48 sizes instead of 24, no choice changed. Where ranks outnumber cores a
    handover still costs more than the one shot's flag round: priced at two, the broadcast
    would move to the binomial tree, which measured 1.3-2x slower there and is itself priced
    at half its time.)"""
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


_CROWDED_BELOW = {"gather": sys.maxsize, "scatter": sys.maxsize, "broadcast": 1 << 20, "reduce": 1 << 20}
"""Where ranks outnumber cores, the rooted one shots stay out below these sizes (see
Algorithm.crowded_below): measured losing at 16 B-16 KiB for gather and scatter, at 16 B-256
KiB for broadcast and reduce, and winning from 1 MiB for broadcast."""

for _collective, _run in _RUN.items():
    _cost = (_streamed if _collective in _STREAMED else _cost_of)(_collective)
    register(Algorithm("direct", _collective, _run, _cost, needs_direct=True,
                       copies=0 if _collective == "all_reduce" else 1,
                       crowded_below=_CROWDED_BELOW.get(_collective, 0),
                       out_of_place=_collective == "all_reduce",
                       slot_need=_SLOT_NEED.get(_collective)))
