"""This rank's rings toward its peers on the host: made within its share of /dev/shm, offered
in a pair's setup, and the peer's mapped (transport/wiring.py sets pairs up with them).

Each side of a pair creates the ring it writes, small at first (shm_budget.INITIAL_RING) and
grown with the traffic by the channel (`PairRings.source`), and offers its name, nonce and,
unless this process refuses reads of its memory, the address the peer may probe to read it
across processes (cma.can_read).
"""

from __future__ import annotations

import errno
import functools
import os

from .. import limits, log
from ..config import size_text
from ..errors import TensorwireWarning
from . import cma, shm_budget
from .shm_segments import Ring

_log = log.get("TRANSPORT")


class PairRings:
    """The rings of one rank: how large they may grow (`ring_max`), the /dev/shm they hold
    (`budget`), and whether peers may read this process's memory (`reads_refused`)."""

    def __init__(self, job_id: str, rank: int, reads_refused: str) -> None:
        self.prefix = f"tw-{job_id[:24]}-{rank}-"  # the names of the rings this rank writes
        self.rank = rank
        self.budget = shm_budget.RingBudget(0)
        self.ring_max = 0  # how large rings may grow (shm_budget.plan_rings); 0: none (TCP)
        self.first = shm_budget.INITIAL_RING  # the size a pair's rings start at
        self.reads_refused = reads_refused  # why peers may not read this process's memory ('': they may)
        self._warned = False  # of /dev/shm refusing a ring the plan allowed (once a process)

    def start(self, share: int, local: int, ring_bytes: int) -> None:
        """Take at most `share` bytes of /dev/shm among `local` ranks of this host, rings of up
        to `ring_bytes` (TENSORWIRE_SHM_RING)."""
        self.budget = shm_budget.RingBudget(share)
        self.ring_max = shm_budget.plan_rings(share, local, ring_bytes) if share else 0
        self.first = min(ring_bytes, shm_budget.INITIAL_RING)
        self.reads_refused = self.reads_refused or cma.allow_peers()
        if self.reads_refused and self.ring_max:
            _log.info("rank %d: peers will not read this process's memory (%s): large point-to-point "
                      "messages go through the rings", self.rank, self.reads_refused)

    def make(self, peer: int, capacity: int, floor: int) -> tuple[Ring | None, int]:
        """The ring this rank writes toward `peer`: `capacity` bytes, or less down to `floor`
        where this rank's share of /dev/shm (or /dev/shm itself) has less room; (None, errno)
        where even `floor` does not fit. The plan (plan_rings) was warned of at init, when it
        fell short; /dev/shm refusing what the plan allowed (another program took its space
        since) is warned of once a process."""
        made, why, size, by_tmpfs = None, 0, capacity, False
        while size >= floor:
            if self.budget.take(Ring.nbytes(size)):
                made, why = shm_budget.shrinking(functools.partial(Ring.create, f"{self.prefix}{peer}"),
                                                 size, floor)
                self.budget.give(Ring.nbytes(size) - (Ring.nbytes(made.capacity) if made is not None else 0))
                by_tmpfs = why != 0
                break
            why = errno.ENOSPC  # this rank's share is taken
            size = shm_budget.halve(size, floor) if size > floor else floor - 1
        if made is None or made.capacity < capacity:
            refused = by_tmpfs and not self._warned
            text = (f"a ring toward rank {peer} of {size_text(made.capacity)} instead of "
                    f"{size_text(capacity)}" if made is not None else
                    f"no ring toward rank {peer} ({os.strerror(why) if why else 'refused'}): that pair talks "
                    f"over TCP")
            if refused:
                self._warned = True
                total, free = shm_budget.usage()
                cause = (limits.memory_error(OSError(why, os.strerror(why)),  # address space, not /dev/shm
                                             f"mapping a ring toward rank {peer}", "raise the limit")
                         if why == errno.ENOMEM else None)
                said = (f"{cause}, so {text}" if cause is not None else
                        f"/dev/shm holds {size_text(total)} ({size_text(free)} free "
                        f"now): it refused a ring that fit what tensorwire planned at init (another program "
                        f"took its space since?), so {text}")
                log.warn(f"rank {self.rank}: {said}. Results are unchanged, large messages are slower "
                         f"(docs/limits.md)", TensorwireWarning)
            else:
                _log.info("rank %d: %s (this rank's rings hold %s of their share of %s)", self.rank, text,
                          size_text(self.budget.used), size_text(self.budget.limit))
        return made, why

    def source(self, peer: int) -> RingGrower:
        """Where the channel to `peer` gets larger rings (shm.RingSource)."""
        return RingGrower(self, peer)

    def offer(self, ring: Ring | None) -> dict | None:
        """What the peer needs to map `ring`, and to probe reading this process's memory."""
        if ring is None:
            return None
        offer = {"name": ring.name, "nonce": ring.nonce, "capacity": ring.capacity}
        if not self.reads_refused:  # the peer may read this process's memory: it tries
            offer.update(pid=os.getpid(), probe=ring.nonce_address)
        return offer

    def map(self, offer: dict | None) -> tuple[Ring | None, int, int]:
        """(their ring mapped, or None; the errno why not; their pid where this process can read
        their memory, else 0)."""
        if not offer:
            return None, 0, 0
        if not isinstance(offer, dict) or type(offer.get("name")) is not str or \
                any(type(offer.get(k)) is not int for k in ("capacity", "nonce")) or \
                any(type(offer.get(k, 0)) is not int for k in ("pid", "probe")) or offer["capacity"] <= 0:
            raise ValueError(f"a ring offer that is not one: {str(offer)[:80]}")
        try:
            ring = Ring(offer["name"], offer["capacity"], create=False)
        except OSError as exc:
            return None, exc.errno or 0, 0
        if ring.nonce != offer["nonce"]:  # not the ring it made: another /dev/shm that shares the name
            ring.close()
            return None, 0, 0
        ring.unlink()  # mapped by the one rank that needs its name: its maker dying now leaves nothing
        pid = 0
        if offer.get("pid"):
            why = cma.can_read(offer["pid"], offer["probe"], offer["nonce"])
            if why:
                _log.info("rank %d cannot read rank %s's memory (%s)", self.rank, offer.get("rank", "?"), why)
            else:
                pid = offer["pid"]
        return ring, 0, pid

    def discard(self, ring: Ring) -> None:
        """Unlink and drop a ring of a pair that is not set up after all (its budget back if ours)."""
        ring.unlink()
        if ring.name.startswith(self.prefix):
            self.budget.give(Ring.nbytes(ring.capacity))
        ring.close()


class RingGrower:
    """The further rings of one pair's out direction (shm.RingSource): larger ones as messages
    grow (at least twice the first size), or a smaller one to give /dev/shm back (ShmChannel.shrink)."""

    def __init__(self, rings: PairRings, peer: int) -> None:
        self.rings, self.peer = rings, peer

    def make(self, capacity: int) -> Ring | None:
        ring, _ = self.rings.make(self.peer, capacity, min(capacity, 2 * shm_budget.INITIAL_RING))
        return ring

    def release(self, capacity: int) -> None:
        self.rings.budget.give(Ring.nbytes(capacity))
