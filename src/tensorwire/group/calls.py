"""The call adapter: one collective's point-to-point view of its group (algorithms.base.P2P).

Algorithms see a call, never a group: its rank and size, messages tagged with the call's
context, sequence number and fingerprint, and waits bounded by the call's deadline.
"""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING

import numpy as np

from ..algorithms.hierarchical import Hierarchy
from ..algorithms.prices import Link
from ..buffers import byte_view
from ..errors import PeerLostError
from ..ops import ReduceOp
from ..ops.kernels import reduce_into, reduce_to
from ..transport.requests import SENT, Request
from ..transport.wire import Coll, Fingerprint, Header, Kind, pack_header
from ..tuning import tuner

if TYPE_CHECKING:
    from .group import Group


_COLL = int(Kind.COLL)
_SCRATCH_BYTES = 16 << 10  # the largest reducing receive exchange_now takes through a scratch array


class CollectiveCall:
    """One collective's point-to-point view of its group (implements algorithms.base.P2P, and
    DirectCall for the paths through the group's segment)."""

    __slots__ = ("group", "rank", "size", "seq", "fp", "name", "timeout", "deadline", "ref", "algo",
                 "__weakref__")

    def __init__(self, group: Group, seq: int, fp: Fingerprint, name: str, timeout: float) -> None:
        self.group = group
        self.rank = group.rank
        self.size = group.size
        self.seq = seq
        self.fp = fp
        self.name = name
        self.timeout = timeout
        self.deadline = 0.0
        self.ref = weakref.ref(self)  # how the engine notes it (Engine.current): never keeping a group alive
        self.algo = ""  # the algorithm that ran it, where the COLL log's line per call asks (tuner.noting)

    @property
    def what(self) -> str:
        """The label errors use: 'all_reduce #12 on group world', the user's 12th call on the
        group (built only when needed); the group's own calls are labelled apart."""
        if self.fp.coll == Coll.SETUP:
            return f"{self.name} (the group's internal call {self.seq}) on group {self.group.name}"
        return f"{self.name} #{self.number(self.seq)} on group {self.group.name}"

    def number(self, seq: int) -> int:
        """The user's number of this group's call `seq`: its calls counted from 1, without the
        group's own (shared-memory setup, calibration), which take sequence numbers too."""
        return seq - self.group.queue.internal

    def __str__(self) -> str:
        return self.what

    def start(self) -> None:
        self.deadline = time.perf_counter() + self.timeout

    def started(self) -> CollectiveCall:
        """The call with its deadline running (a direct-path call starts it when it first waits)."""
        if not self.deadline:
            self.start()
        return self

    def _header(self, step: int, nbytes: int) -> Header:
        return Header(Kind.COLL, self.group.ctx, self.seq, step, nbytes, self.fp)

    def isend(self, peer: int, data: np.ndarray, step: int) -> Request:
        """A small message goes to its ring or socket at once where it can (Engine.send_now)."""
        payload = byte_view(data)
        group = self.group
        world, engine = group.ranks[peer], group.engine
        if engine.send_now(world, pack_header(_COLL, group.ctx, self.seq, step, payload.nbytes, self.fp),
                           payload):
            return SENT
        return engine.isend(world, self._header(step, payload.nbytes), payload, self)

    def isend_waking(self, peer: int, data: np.ndarray, step: int) -> Request:
        """A message over the pair's socket, which wakes a peer asleep on its sockets at once
        (Engine.isend's `waking`): for waits that sleep rather than spin."""
        payload = byte_view(data)
        header = self._header(step, payload.nbytes)
        return self.group.engine.isend(self.group.ranks[peer], header, payload, self, waking=True)

    def irecv(self, peer: int, data: np.ndarray, step: int, reduce: ReduceOp | None = None,
              base: np.ndarray | None = None) -> Request:
        dst = data.reshape(-1) if reduce is not None else byte_view(data)
        return self.group.engine.irecv(self.group.ranks[peer], self._header(step, data.nbytes),
                                       dst, reduce, self, base)

    def exchange_now(self, dst: int | None, send: np.ndarray | None, src: int, recv: np.ndarray, step: int,
                     reduce: ReduceOp | None = None, base: np.ndarray | None = None) -> tuple[bool, bool]:
        """The send handed whole to its ring or socket and the peer's message taken straight
        from its own, spinning briefly for it (Engine.sendrecv_now, or recv_now where `send` is
        None); with `reduce` it lands in a scratch array and is folded from there, where it is
        small (a larger one is folded as it arrives, with no scratch nor second pass)."""
        if reduce is not None and recv.nbytes > _SCRATCH_BYTES:
            return False, False
        ranks, ctx, seq, fp, engine = self.group.ranks, self.group.ctx, self.seq, self.fp, self.group.engine
        into = recv if reduce is None else np.empty(recv.shape, recv.dtype)
        peer = ranks[src]
        key = (peer, (ctx, _COLL, seq, step))  # Header.key's, as the engine files messages
        inn = pack_header(_COLL, ctx, seq, step, recv.nbytes, fp)
        if send is None:
            sent = False
            received = into.flags.c_contiguous and engine.recv_now(peer, key, inn, into, True)
        else:
            payload = byte_view(send)
            out = pack_header(_COLL, ctx, seq, step, payload.nbytes, fp)
            to = ranks[dst]  # type: ignore[index]
            sent, received = engine.sendrecv_now(to, out, payload, peer, key, inn, into)
        if received and reduce is not None:
            if base is None:
                reduce_into(recv.reshape(-1), into.reshape(-1), reduce)
            else:
                reduce_to(recv.reshape(-1), base.reshape(-1), into.reshape(-1), reduce)
        return sent, received

    @property
    def link(self) -> Link:
        """The group's link constants, as the tuner priced this call with them."""
        return tuner.link_of(self.group)

    @property
    def hierarchy(self) -> Hierarchy:
        """The group's host group and rail for this rank (hierarchical algorithms only)."""
        return self.group.hierarchy()

    def wait(self, *reqs: Request) -> None:
        direct = self.group.direct
        try:
            self.group.engine.wait(reqs, deadline=self.deadline, ctx=self.group.ctx, seq=self.seq,
                                   watch=self.group.ranks,
                                   what=self, cross_check=None if direct is None else self._cross_check)
        except PeerLostError as exc:
            why = self.group.engine.why_left(exc, self.group.ctx, self.seq)
            if why is exc:
                raise
            raise why from exc

    def _cross_check(self) -> None:
        """A peer that entered this call through the shared-memory path, or ran it on the
        message path as something else."""
        for r, theirs in self.group.direct.published(self.seq, self.fp):  # type: ignore[union-attr]
            raise self.group.engine.mismatch_error(self.what, self.fp, theirs, self.group.ranks[r])
