"""The protocol of a single-host group's shared segment: slots, flags, stamps and waits.

Every rank of the group has a control line and two data slots in one segment
(`GroupSegment`). A call takes the next slot parity once every rank is past the call that last
used it (`DirectPath.enter`), fills its slot, stamps the call's number and fingerprint beside
its flag and stores the flag (`publish`); readers that see the flag see the data (x86-64 store
order). The schedules built on it live in algorithms/shm_direct.py (its plans in direct_plans.py,
its streams in direct_streams.py) and algorithms/single_copy.py; docs/design/segment.md tells
the numbers behind the constants.
"""

from __future__ import annotations

import functools
import os
import secrets
import time
from typing import Any

import numpy as np

from ..errors import CollectiveMismatchError, TimeoutError
from . import cma, native, pages
from .backoff import PREYIELD, Backoff
from .engine import Engine
from .shm_segments import CTRL_BYTES, Segment
from .wire import Fingerprint

_LINE = 128  # a rank's control line: two cache lines, as x86 prefetches pairs
SLOT_SHIFT = 2048
"""Slots start half a page in: glibc's memcpy runs many times slower where the destination lies
1-31 bytes past the source modulo 4096, and no common buffer (mmap'd: 16, torch: 64, page
aligned: 0) is near that window of a half-page offset, either way (docs/design/segment.md)."""


class GroupSegment(Segment):
    """One shared segment per single-host group for the one-shot small-message path.

    Per rank: a 128-byte control line [flag; on its second cache line, per slot parity: seq,
    fp word a, fp word b] and
    two data slots of `slot_bytes`. A rank fills its slot, writes that slot's seq/fingerprint,
    then stores `flag = seq`; readers that see the flag see the data (x86-64 store order).
    Slots alternate, and a rank only refills a slot after every rank has published a later
    flag, so nobody can still be reading it: no lock and no second handshake are needed.
    """

    def __init__(self, name: str, size: int, slot_bytes: int, create: bool, nonce: int = 0) -> None:
        super().__init__(name, self.nbytes(size, slot_bytes), create, nonce)
        self.size = size
        self.slot_bytes = slot_bytes
        base = self.nbytes(size, 0)
        self.rank_stride = 2 * slot_bytes  # from a rank's slot of one parity to the next rank's
        self.slots = [[self.bytes[base + (r * 2 + p) * slot_bytes: base + (r * 2 + p + 1) * slot_bytes]
                       for p in (0, 1)] for r in range(size)]
        self.lines = [(CTRL_BYTES + r * _LINE) // 8 for r in range(size)]  # word index of each control line

    @staticmethod
    def nbytes(size: int, slot_bytes: int) -> int:
        """Control page, a control line per rank (whole pages), the slots' shift, two slots per rank."""
        return CTRL_BYTES + (size * _LINE + 4095) // 4096 * 4096 + SLOT_SHIFT + size * 2 * slot_bytes

    @classmethod
    def create(cls, prefix: str, size: int, slot_bytes: int) -> GroupSegment:
        return cls(cls.unique_name(prefix), size, slot_bytes, True, secrets.randbits(63))

    def close(self) -> None:
        self.slots = []
        super().close()


_CACHED = 64  # views and fingerprint words kept per group (cleared when full)
_PRESPIN = 200  # flag polls before the first health check (~20 us)
_END_WAIT_S = 0.1  # how long a group's end waits for peers still to publish its last call
_PRESPIN_S = 20e-6  # the same spell in the compiled bodies (transport/native.py)
WRITTEN, READ = 1, 2
"""Words of a control line beside the flag: how far this rank is through a streamed call, as
(seq << CHUNK_BITS) + pieces written into its slot, and + pieces read from every source.
Numbered by call, they never need resetting, and a peer still in an earlier call reads as behind."""
CHUNK_BITS = 24
_PID, _HOME = 3, 4
"""Words of a control line set once, at the group's setup: the rank's process id, and where
its own _PID word lies in its memory (0: it offers no single copy). A peer that reads that
word through cross-memory attach knows it may read this rank's buffers (algorithms/single_copy.py)."""
_MESSAGE = 5
"""Words of a control line with the (seq, fingerprint) of the last call this rank ran on the
message path (`DirectPath.stamp`): the next call through the segment checks them."""
_STAMP = 8
"""Word of a control line where the per-parity (seq, fingerprint) stamps start: the line's
second cache line, so that writing them does not steal the flag's line from a peer spinning
on it (a coherence round trip per store)."""


def _fp_words(fp: Fingerprint) -> tuple[int, int]:
    """Two words; the op parameter (aux) is folded to 32 bits: enough to tell factors apart."""
    a = fp.coll | fp.dtype << 8 | fp.op << 16 | ((fp.root + 1) & 0xFFFFFF) << 24
    aux32 = (fp.aux ^ fp.aux >> 32) & 0xFFFFFFFF
    return a, ((fp.count + 1) & 0xFFFFFFFF) | aux32 << 32


def _fp_from_words(a: int, b: int) -> Fingerprint:
    return Fingerprint(a & 0xFF, a >> 8 & 0xFF, a >> 16 & 0xFF, (a >> 24 & 0xFFFFFF) - 1,
                       (b & 0xFFFFFFFF) - 1, b >> 32)


class State:
    """The protocol's state on the Python path; a compiled Path holds the same fields itself,
    so that a planned call is one C call (transport/native.py)."""

    __slots__ = ("parity", "settled", "unvetted", "prev_seq", "prev_a", "prev_b", "prev_name")

    def __init__(self) -> None:
        self.parity = 1  # the slot parity of the last call entered
        self.settled = 1  # every rank is known to be past that call, its fingerprint checked
        self.unvetted = 0  # a message-path call's notes to check before the next entry (stamp)
        self.prev_seq = 0  # the last call published
        self.prev_a = self.prev_b = 0  # its fingerprint's words
        self.prev_name = ""  # its collective


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
        self.message: tuple[int, int, int, str] | None = None  # a message-path call to check (stamp)
        self._fp_words: dict[Fingerprint, tuple[int, int]] = {}
        self._last_fp: Fingerprint | None = None  # the fingerprint last looked up (stamp_words)
        self._last_ab = (0, 0)
        self._views: dict[tuple, tuple] = {}
        self.single_copy = False  # see offer_single_copy
        self.crowded = False
        """Ranks outnumber cores (and TENSORWIRE_SINGLE_COPY is not `force`): only the single
        copy algorithms that declare `single_copy_crowded` run (see Algorithm)."""
        self.offered = "not yet"  # why this rank offers no single copy ('' if it does)
        self.pids: tuple[int, ...] = ()
        self.reader = cma.Reader(engine.native)
        self.alias_window: int | None = None  # cma.ALIAS_WINDOW where the CPU is slow there, else 0
        self.kept: np.ndarray | None = None  # single copy's in-place fold keeps its own piece here
        self.folded: np.ndarray | None = None  # single copy's reduce: a non-root's folded block
        self.shares_at: tuple[int, int] | None = None
        """Single copy's last call: its slot parity and the word of each rank's table that holds
        the share of its buffers in huge pages (huge_eighths)."""
        self.native = native.path(engine.native, seg, self.flags, rank, GroupSegment.nbytes(self.size, 0),
                                  _PRESPIN_S if engine.spin_s else 0.0, PREYIELD, engine.spin_s)
        """The compiled bodies over this segment, or None: the engine runs the Python ones."""
        self.st = self.native if self.native is not None else State()
        """The protocol's state: the compiled Path's own where there is one (see State)."""

    @property
    def prev_fp(self) -> tuple[int, int]:
        """The fingerprint words of the last call published."""
        return self.st.prev_a, self.st.prev_b

    @property
    def huge_eighths(self) -> int:
        """In single copy's last call, the least share of huge pages of any source (pages.py):
        read before the next call enters (what the tuner learns after each, tuner.PageDependent)."""
        if self.shares_at is None:
            return pages.UNKNOWN
        p, word = self.shares_at
        return int(min(t[word] for t in self.views(np.dtype(np.uint64), word + 1)[p]))

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
            # strided as bytes, then viewed: as_strided loses a dtype whose type string numpy
            # cannot read back (ml_dtypes' float8_e5m2, '<f1')
            shape = (self.size, count * dtype.itemsize)
            grids = self._views[key] = tuple(
                np.lib.stride_tricks.as_strided(self.seg.slots[0][p][offset:], shape, (stride, 1)).view(dtype)
                for p in (0, 1))
        return grids

    def words_of(self, fp: Fingerprint) -> tuple[int, int]:
        """`fp` as stamped (cached)."""
        ab = self._fp_words.get(fp)
        if ab is None:
            if len(self._fp_words) >= _CACHED:
                self._fp_words.clear()
            ab = self._fp_words[fp] = _fp_words(fp)
        return ab

    # -- the protocol -----------------------------------------------------------------------------
    def enter(self, call) -> int:
        """Take the next slot parity, once every rank is past the call that last used it
        (settle_previous)."""
        st = self.st
        if st.unvetted or not st.settled:
            self.settle_previous(call)
        st.parity ^= 1
        return st.parity

    def settle_previous(self, call) -> None:
        """Before `call` enters: check the peers' notes of a message-path call (stamp), and
        unless this rank already saw everyone publish the previous call, wait until they have
        and check its fingerprints: a rank that returned without waiting (a broadcast root)
        learns of a mismatch now. A compiled body does this itself where nothing has to wait
        or be explained, and hands it back here otherwise (native.NOT_ENTERED)."""
        st = self.st
        if st.unvetted:
            self._check_message(call)
        if st.settled or (self.native is not None and self.native.settle() == native.DONE):
            return
        self._wait(call, self.everyone, st.prev_seq)
        error = self._differs(st.prev_seq, _STAMP + st.parity * 3, (st.prev_a, st.prev_b),
                              f"{st.prev_name} #{call.number(st.prev_seq)} on group {call.group.name} "
                              f"(found at {call.what})")
        if error is not None:
            raise error
        st.settled = 1

    def last_call_mismatch(self, group: str, internal: int) -> CollectiveMismatchError | None:
        """As the group ends on this rank: a peer that made its last call as another, where
        this rank returned from it without checking (a broadcast's or scatter's root waits for
        no one); else None. Through the segment the peers' publications tell it, on the message
        path their notes (`stamp`); it waits up to _END_WAIT_S for peers still to make it.
        Ranks that each thought themselves the root of a group's last broadcast received
        nothing and checked nothing: this is where they learn of it. `group` and `internal`
        (the group's own calls) label that call."""
        st = self.st
        end = time.monotonic() + _END_WAIT_S
        if st.unvetted and self.message is not None:  # the last call ran on the message path
            seq, a, b, what = self.message
            return self._differs(seq, _MESSAGE, (a, b), f"{what} (found as the group ended)", end)
        if st.settled or not st.prev_seq:
            return None
        label = f"{st.prev_name} #{st.prev_seq - internal} on group {group} (found as the group ended)"
        return self._differs(st.prev_seq, _STAMP + st.parity * 3, (st.prev_a, st.prev_b), label, end)

    def _differs(self, seq: int, at: int, mine: tuple[int, int], label: str,
                 end: float = 0.0) -> CollectiveMismatchError | None:
        """The mismatch with a peer whose words at `at` (seq and fingerprint) note call `seq`
        as another than `mine`, waiting until `end` (monotonic) for peers not there yet."""
        words, flags = self.words, self.flags
        for r in self.others:
            while words[flags[r] + at] < seq and time.monotonic() < end:
                time.sleep(0.001)
            line = flags[r] + at
            if words[line] == seq and (words[line + 1], words[line + 2]) != mine:
                return self.engine.mismatch_error(label, _fp_from_words(*mine),
                                                  _fp_from_words(words[line + 1], words[line + 2]),
                                                  self.members[r])
        return None

    def stamp(self, call) -> None:
        """Note a call that ran on the message path where every rank can read it, waiting for
        no one; the next call through the segment checks the peers' notes (`_check_message`).
        In a chain broadcast to different roots (rank 0 sends to 1, while 1 and 2 agree on
        root 1: 1 -> 2 -> 0) every message a rank receives comes from a rank that agrees with
        it, and a barrier through the segment after it returned everywhere, the mismatch unseen."""
        a, b = self.words_of(call.fp)
        line = self.own + _MESSAGE
        self.words[line + 1], self.words[line + 2] = a, b
        self.words[line] = call.seq  # last: the fingerprint above is this call's
        self.message = (call.seq, a, b, call.what)
        self.st.unvetted = 1

    def _check_message(self, call) -> None:
        """Raise if a peer noted this rank's last message-path call with another fingerprint.
        Every rank notes it before it enters this call, so the last to enter sees all notes."""
        seq, a, b, what = self.message  # type: ignore[misc]
        self.message = None
        self.st.unvetted = 0
        error = self._differs(seq, _MESSAGE, (a, b), f"{what} (found at {call.what})")
        if error is not None:
            raise error

    def stamp_words(self, call) -> tuple[int, int]:
        """The fingerprint words `call` publishes; a repeated call (the same fingerprint
        object) skips the hashing."""
        fp = call.fp
        if fp is not self._last_fp:
            self._last_fp, self._last_ab = fp, self.words_of(fp)
        return self._last_ab

    def publish(self, call, parity: int, ranks: tuple[int, ...] = ()) -> None:
        """Publish this rank's slot and fingerprint for `call`; then wait for `ranks` (`everyone`,
        one rank, or none) to publish it too, and check they called the same thing. One method
        for both halves: this pair is most of a small call's protocol."""
        fp = call.fp  # stamp_words, inline: this runs in every small call
        if fp is not self._last_fp:
            self._last_fp, self._last_ab = fp, self.words_of(fp)
        a, b = self._last_ab
        if self.native is not None:
            whom = -1 if ranks is self.everyone else ranks[0] if ranks else -2
            status = self.native.round(call.seq, a, b, call.name, whom)
            if status != native.DONE:
                self.resume(call, status, ranks)
            return
        words, seq, st = self.words, call.seq, self.st
        at = self.own + _STAMP + 3 * parity
        words[at] = seq
        words[at + 1] = a
        words[at + 2] = b
        words[self.own] = seq  # last: publishes the data and the fingerprint above
        st.prev_seq, st.prev_a, st.prev_b, st.prev_name = seq, a, b, call.name
        if ranks:
            self._settle(call, parity, ranks)
        else:
            st.settled = 0

    def withdraw(self, seq: int) -> None:
        """Take back this rank's publication of call `seq`, which failed here (it aborts the
        group): a member that makes the call later then waits, reads the abort and raises it,
        instead of completing on the share of a rank that gave up. Earlier calls stay
        published, so no peer waits for those."""
        if self.words[self.own] >= seq:
            self.words[self.own] = seq - 1

    def resume(self, call, status: int, ranks: tuple[int, ...], *again: Any) -> bool:
        """Take over from a compiled body of `call` that waits for `ranks`, given its `status`.
        Where it did not enter (NOT_ENTERED), the previous call is settled here and the body
        run again (`again`: it and its arguments). Where it handed the wait back (a peer not
        there within its spin), the wait and the checks run in Python; True then, and the
        caller finishes the body. A peer that published another call is raised as the
        mismatch."""
        if status == native.NOT_ENTERED:
            self.settle_previous(call)
            status = again[0](*again[1:])
        if status == native.DONE:
            return False
        if status >= 0:
            raise self._mismatch_with(call, status)
        self._settle(call, self.st.parity, ranks)
        return True

    def _settle(self, call, parity: int, ranks: tuple[int, ...]) -> None:
        """publish's second half: wait for `ranks` to publish `call`, check their stamps."""
        words, flags, seq = self.words, self.flags, call.seq
        a, b = self.st.prev_a, self.st.prev_b
        off = _STAMP + 3 * parity
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
        self.st.settled = everyone

    def _wait(self, call, ranks: tuple[int, ...], seq: int) -> None:
        words, flags = self.words, self.flags
        # poll flags only, no bookkeeping: a running peer is a microsecond away (unless ranks
        # share cores: then the engine does not spin and neither does this)
        spins = _PRESPIN if self.engine.spin_s else 0
        yields = 0 if spins else PREYIELD
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
                        raise self._lost(call, self.members[r])

    def check_stamp(self, call, r: int, parity: int, ab: tuple[int, int]) -> None:
        """Raise if rank r stamped `call`'s number on its slot of `parity` with another call."""
        words, base = self.words, self.flags[r] + _STAMP + parity * 3
        if words[base] == call.seq and (words[base + 1], words[base + 2]) != ab:
            raise self._mismatch_with(call, r)

    def await_progress(self, call, r: int, word: int, target: int, parity: int, ab: tuple[int, int],
                       backoff: Backoff | None) -> Backoff | None:
        """Wait until rank r's progress `word` (WRITTEN, READ) reaches `target`. A rank that
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
                raise self._lost(call, peer)
        return backoff

    def _lost(self, call, peer: int) -> BaseException:
        """What a call that waited for lost `peer` raises: a peer that left mostly left because
        the call failed there: a member that published this call as another is that reason
        (the one that left saw it too), else the abort that says why may come just behind
        (why_left)."""
        mine = self.stamp_words(call)
        for r in self.others:
            for parity in (0, 1):
                self.check_stamp(call, r, parity, mine)  # raises that mismatch
        return self.engine.why_left(self.engine.lost_error(peer), self.ctx, call.seq)

    def mark_read(self, call, steps: int) -> None:
        """This rank has read `steps` steps of every source in `call` (its READ progress word)."""
        self.words[self.own + READ] = (call.seq << CHUNK_BITS) + steps

    def await_readers(self, call, readers: tuple[int, ...], steps: int, parity: int, ab: tuple[int, int],
                      backoff: Backoff | None) -> Backoff | None:
        """Wait until every one of `readers` has read `steps` steps of `call` (see await_progress)."""
        target = (call.seq << CHUNK_BITS) + steps
        for r in readers:
            backoff = self.await_progress(call, r, READ, target, parity, ab, backoff)
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
            f"(it published call #{call.number(words[line])})")

    def _timeout(self, call, pending: list[int]):
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
