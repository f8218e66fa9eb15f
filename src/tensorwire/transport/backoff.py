"""Waiting for peers: the Backoff every wait ends in, and the bounds of the bare loops that run
before one (docs/design/waiting.md)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import Engine

_YIELD_S = 0.02  # after spinning, yield the CPU for this long before sleeping
PREYIELD = 16
"""Where ranks share cores: yields in a bare loop before a wait for a flag or a ring's next
record sets up its Backoff, whose setup and rounds are Python that the rank being waited for
does not get to run (docs/design/waiting.md)."""
_SLEEP_MAX_S = 0.001  # longest single sleep: bounds the wake-up delay for shared-memory data
RELEASE_PARKED_S = 0.1
"""A waiter idle this long stages the messages parked in its rings (shm.PARK_BYTES) and those
left in their senders' memory (shm.REMOTE_BYTES), whatever they wait for: a parked sender may
be the one this wait depends on, through a third rank, or two ranks may both send first."""


class Backoff:
    """How every waiter in tensorwire waits: spin, then yield the CPU, then sleep on the sockets.

    Spinning keeps the fast path fast when the peer is running on another core; yielding lets
    an oversubscribed peer (more ranks than cores) run; sleeping on the peers' sockets stops
    burning CPU yet wakes at once for TCP data, control messages and dead peers. The group's
    health (lost members, abort) and the deadline are checked whenever the waiter is idle.
    """

    def __init__(self, engine: Engine, deadline: float, ctx: int, seq: int, watch: tuple[int, ...],
                 cross_check: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.deadline = deadline
        self.ctx = ctx
        self.seq = seq
        self.watch = watch
        self.cross_check = cross_check
        self.spin_s = engine.spin_s
        self.reset()

    def reset(self) -> None:
        self.since = time.perf_counter()
        self.sleep = 50e-6
        self.checks = 0
        self.queried = False
        self.released = False

    def idle(self, timeout_error: Callable[[], BaseException]) -> None:
        now = time.perf_counter()
        idle = now - self.since
        self.checks += 1
        pumps = self.engine.pumps  # while pump threads run, a spinning waiter would hold the
        # interpreter lock they need between their system calls: it sleeps at once instead
        if idle < self.spin_s + _YIELD_S and not (pumps is not None and pumps.busy):
            # spinning or yielding: the group's health and the deadline every so many rounds,
            # which cost more than a round (with ranks outnumbering cores, what a waiter
            # spends in a round is taken from the rank it waits for)
            if self.checks & (63 if idle < self.spin_s else 15) == 0:
                self.engine.check_group(self.ctx, self.seq, self.watch)
                if now > self.deadline:
                    raise timeout_error()
            if idle >= self.spin_s:
                os.sched_yield()
            return
        self.engine.check_group(self.ctx, self.seq, self.watch)
        if now > self.deadline:
            raise timeout_error()
        if not self.released and idle >= RELEASE_PARKED_S:
            self.released = True
            self.engine.release_parked()
        if self.cross_check is not None:
            self.cross_check()
        if not self.queried:
            self.queried = True
            self.engine.query_peers(self.ctx, self.watch)
        self.engine.check_unconnected(self.watch)
        self.engine.sleep_on_sockets(min(self.sleep, max(0.0, self.deadline - now)))
        self.engine.check_group(self.ctx, self.seq, self.watch)
        self.sleep = min(self.sleep * 2, _SLEEP_MAX_S)
