"""How much of /dev/shm tensorwire takes, and what it says when it gets less than it wanted.

tmpfs hands pages out on first touch: a segment larger than the space left maps fine and its
first write past that space is a SIGBUS (a 4-rank job on a 16 MiB /dev/shm lost two ranks so).
Every segment is reserved whole when it is made (`shm_segments.reserve`), and sized to fit first: of the
free space it finds, tensorwire takes at most half (the rest is the application's: PyTorch's
DataLoader passes its batches through /dev/shm too), halving rings and one-shot slots down to
their floors before anything fails. What still does not fit falls back: a pair without rings
talks over TCP, a group without a segment takes the message path. docs/design/shm-degradation.md
has the reasoning and the measurements.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .. import log
from ..config import size_text
from ..limits import translate, typical_peers
from .segment import GroupSegment
from .shm_segments import SHM_DIR, Ring, remove_stale

RING_FLOOR = 256 << 10
"""The smallest ring worth having: a large message through a smaller one waits for its reader
once per ring's worth, and where ranks share cores each wait is a turn of the scheduler
(docs/design/memory.md). Below it a host's pairs talk over TCP instead."""
SLOT_FLOOR = 64 << 10
"""The smallest one-shot slot (the default for groups of more than 64 ranks): the tuner prices
a call streamed through small slots as it costs, so it is never worse than the message path."""
SHARE = 2
"""Of the free space it finds, tensorwire plans to take at most 1/SHARE."""
T = TypeVar("T")
SPACE_ERRORS = (errno.ENOSPC, errno.ENOMEM)
"""Errors of a segment that did not fit (tmpfs full, memory cgroup full): worth a smaller try."""


def usage(path: str = SHM_DIR) -> tuple[int, int]:
    """(size, free bytes) of the file system under `path`; (0, 0) where there is none."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 0, 0
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def free_at_start(path: str = SHM_DIR) -> int:
    """The free bytes of `path` a job plans its rings with, read once the segments of jobs
    that died before unlinking theirs are removed (shm_segments.remove_stale)."""
    removed, freed = remove_stale(path)
    if removed:
        log.get("INIT").info("removed %d segment(s) of exited processes from %s (%s)", removed, path,
                             size_text(freed))
    return usage(path)[1]


def _inodes_left(path: str = SHM_DIR) -> int:
    try:
        return os.statvfs(path).f_favail
    except OSError:
        return -1


def halve(nbytes: int, floor: int) -> int:
    return max(floor, nbytes // 2 // 4096 * 4096)


INITIAL_RING = 64 << 10
"""The ring a pair of ranks on one host starts with (transport/wiring.py): enough for the small
messages most pairs only ever exchange (docs/design/memory.md); a larger message makes
its writer move to a larger one (shm.ShmChannel), up to TENSORWIRE_SHM_RING."""


class RingBudget:
    """The bytes of /dev/shm this rank's rings may take: its share of half of what was free at
    init (`ring_share`). Every ring a rank writes is taken from it when made and given back
    when left, so a host's rings never take more than half, whatever pairs end up talking."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.used = max(0, self.used - nbytes)


def ring_share(free: int, local: int, world: int = 0, slot: int = 0) -> int:
    """One rank's share of /dev/shm for the rings it writes: half of `free` (read before any
    segment of the job exists), less the world group's segment where the job is on this host
    alone (`world` ranks, `slot` each: its rank 0 makes it, planned as plan_slot does), over the
    `local` ranks of this host."""
    budget = free // SHARE
    if world and slot:
        budget -= GroupSegment.nbytes(world, plan_slot(free, world, slot))
    return max(0, budget // max(local, 1))


def plan_rings(share: int, local: int, capacity: int) -> int:
    """How large a rank's rings may grow within its `share` (ring_share) among `local` ranks
    of a host: `capacity` (TENSORWIRE_SHM_RING), or less, halved down to RING_FLOOR, where the
    share cannot hold that toward the peers it typically talks to (limits.typical_peers) while
    every other local peer keeps a first ring; the first ring's size where even RING_FLOOR
    does not fit; 0 (no rings: TCP) where the first rings toward every local peer do not fit.
    Ranks of a host read their free space alike before any ring exists, so they plan alike."""
    peers = local - 1
    first = min(capacity, INITIAL_RING)
    if peers <= 0:
        return capacity
    if peers * Ring.nbytes(first) > share:
        return 0
    busy = typical_peers(local)
    size = capacity
    while size > first and busy * Ring.nbytes(size) + (peers - busy) * Ring.nbytes(first) > share:
        size = halve(size, RING_FLOOR) if size > RING_FLOOR else first
    return size


def rings_bytes(local: int, capacity: int) -> int:
    """Every ring between `local` ranks of a host: one per direction per pair."""
    return local * (local - 1) * Ring.nbytes(capacity)


def plan_slot(free: int, size: int, slot: int) -> int:
    """The one-shot slot of a group of `size` whose segment takes at most 1/SHARE of `free`."""
    while slot > SLOT_FLOOR and GroupSegment.nbytes(size, slot) > free // SHARE:
        slot = halve(slot, SLOT_FLOOR)
    return slot


def shrinking(make: Callable[[int], T], nbytes: int, floor: int) -> tuple[T | None, int]:
    """make(nbytes), halved while tmpfs says there is no room (another job may have taken space
    since it was planned), down to `floor`; (None, errno) where even that failed, else (what
    make returned, the errno that shrank it or 0)."""
    why = 0
    while True:
        try:
            return make(nbytes), why
        except OSError as exc:
            why = exc.errno or 0
            if why not in SPACE_ERRORS or nbytes <= floor:
                return None, why
            nbytes = halve(nbytes, floor)


def _setting(nbytes: int) -> str:
    for unit, shift in (("G", 30), ("M", 20)):
        if nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift}{unit}"
    return f"{nbytes >> 10}K"


_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)


@dataclass
class Shortfall:
    """What a group got of what it asked for in /dev/shm (agreed by its members)."""

    local: int  # the most ranks of the group on one host
    ring: int  # configured ring capacity
    ring_used: int  # the smallest ring any member writes (0: none)
    rings: int  # rings the group's members on one host wanted (one per direction per pair)
    refused: int  # of those, rings that could not be made: their pairs talk over TCP
    ring_errno: int  # why (the largest errno any member saw)
    slot: int = 0  # configured one-shot slot (0: none asked for)
    slot_used: int = 0  # the slot it got (0: none)
    slot_errno: int = 0
    size: int = 0  # ranks of the group, for the one-shot segment

    @property
    def rings_short(self) -> bool:
        return bool(self.refused) or 0 < self.ring_used < self.ring

    @property
    def slot_short(self) -> bool:
        return self.slot > 0 and self.slot_used < self.slot

    def wanted(self) -> int:
        return rings_bytes(self.local, self.ring) + (GroupSegment.nbytes(self.size, self.slot)
                                                     if self.slot else 0)

    def describe(self, where: str, rings: bool = True) -> str:
        """One warning: what /dev/shm holds, what was wanted, what tensorwire does instead,
        and the fix. Without `rings`, only the segment (the rings were told already)."""
        total, free = usage()
        got = []
        if rings and 0 < self.ring_used < self.ring:
            got.append(f"rings of {size_text(self.ring_used)} instead of {size_text(self.ring)} (large "
                       f"messages between ranks of a host move in smaller pieces)")
        if rings and self.refused:
            got.append(f"TCP for the pairs of ranks whose rings did not fit ({self.refused} of {self.rings} "
                       f"rings: {os.strerror(self.ring_errno) if self.ring_errno else 'no ring'})")
        if self.slot_short and self.slot_used:
            got.append(f"one-shot slots of {size_text(self.slot_used)} instead of {size_text(self.slot)} "
                       f"(collectives past that size stream through them)")
        elif self.slot_short:
            got.append("no one-shot segment: its collectives take the message path"
                       + (f" ({os.strerror(self.slot_errno)})" if self.slot_errno else ""))
        told = (self.ring_errno, self.slot_errno) if rings else (self.slot_errno,)
        descriptors = next((e for e in told if e in _DESCRIPTORS), 0)
        if descriptors:  # not /dev/shm's space: the file descriptors a segment needs a moment
            cause = translate(OSError(descriptors, os.strerror(descriptors)), where)
            return f"{cause}; so it uses {'; '.join(got)}. Results are unchanged, large messages are slower"
        wanted = self.wanted()
        suggest = 64 << 20
        while suggest < SHARE * wanted:
            suggest *= 2
        settings = []
        if rings and self.ring_used and self.ring_used < self.ring:
            settings.append(f"TENSORWIRE_SHM_RING={_setting(self.ring_used)}")
        if self.slot_used and self.slot_short:
            settings.append(f"TENSORWIRE_SHM_DIRECT={_setting(self.slot_used)}")
        fell_back = (rings and self.refused) or (self.slot_short and not self.slot_used)
        inodes = " and no inodes left (its nr_inodes)" if _inodes_left() == 0 else ""
        return (f"{where}: /dev/shm holds {size_text(total)} ({size_text(free)} free now{inodes}); "
                f"tensorwire wanted about {size_text(wanted)} for {self.local} rank(s) on a host and takes "
                f"at most half of what is free, so it uses {'; '.join(got)}. Results are unchanged, large "
                f"messages are slower. Fix: let /dev/shm have {size_text(suggest)} free (docker run "
                f"--shm-size={_setting(suggest).lower()}, or Kubernetes an emptyDir of medium Memory on "
                f"/dev/shm)" + (f", or set {' '.join(settings)} to ask for what fits (no warning)"
                                if settings and not fell_back else "") + " (docs/limits.md)")
