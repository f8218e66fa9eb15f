"""The progress engine: message matching, request progress and waiting.

One engine per process owns one channel per peer it talks to (world ranks), made on first use
(transport/wiring.py), and all requests of all groups.
Whoever waits drives progress for everybody (as in MPI), so a rank blocked in one receive still
drains the rings and sockets that its peers need drained: no rank can deadlock another through
full buffers. Waiting spins briefly, then yields, then sleeps on the peers' sockets; sleeping on
the sockets is also how a closed connection, i.e. a dead peer, is noticed at once; what
follows a failure is the engine's other half (transport/failures.py).
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from .. import limits, log
from ..errors import AbortedError, ResourceError, TensorwireWarning, TimeoutError
from ..ops import ReduceOp
from . import native
from .backoff import PREYIELD, RELEASE_PARKED_S, Backoff
from .channel import Channel, PeerClosed, PendingChannel
from .failures import Failures, unanswered_ms
from .pumps import Pumps, pump_threads, streams_per_pair
from .requests import P2P_SEQ, Discard, RecvRequest, Request, SendRequest, Sink, Unexpected, deliver
from .tcp import SPLIT_BYTES, drain, unsent_bytes
from .wire import Fingerprint, Header, Kind, ctx_of

if TYPE_CHECKING:
    from .requests import DeviceSource, DeviceTarget
    from .wiring import Wiring

_log = log.get("TRANSPORT")
_init_log = log.get("INIT")  # decisions taken once, at init
_EMPTY = np.empty(0, dtype=np.uint8)
_LAST_DATA_KIND = int(max(Kind.P2P, Kind.COLL))  # kinds above it are control messages
DEFAULT_SPIN_US = 50.0
_BG_GRACE_S = 0.005  # the background thread leaves pending requests this long to a waiter
_BG_LOOK_MAX_S = 0.04  # its longest pause between looks while waits keep coming
_BG_PARK_S = 1.0  # it sleeps until woken once this long has passed without a pending request
_BG_PRUNE = 256  # finished requests the set may hold before a registration drops them
_WATCH_S = 0.1  # while peers are watched (watch_peers), the background thread looks this often
_GLANCE = 64  # calls that never wait between two rounds of progress (glance)
_NOTICES_S = 1.0  # how long close() tries to deliver the aborts this rank sent
_BG_JOIN_S = 1.0  # how long close() waits for the background thread to end
_NOT_READING_S, _ANSWERED_MS = 0.5, 100  # close(): a peer that acknowledged within 100 ms does not read
_SEND_GRACE_S = 1.0
"""How long close() drives the sends nobody waited for (an isend not waited on) to their end: over
shared memory a large one ends only once its receiver has read it out of this process's memory."""


class Engine(Failures):
    """One per process: the channels to its peers and the requests of all its groups."""

    __slots__ = ("until_glance",)  # a slot: the compiled caller counts it down (group/planned.py)

    def __init__(self, rank: int, world_size: int, spin_us: float | None, compiled: str = "auto") -> None:
        """`compiled`: whether to run the compiled inner loops (Config.native; transport/native.py)."""
        super().__init__()
        self.rank = rank
        self.world_size = world_size
        self.native = native.module(compiled)
        """The compiled inner loops (transport/_native.c), or None: the Python ones."""
        self.channels: dict[int, Channel] = {}
        self.lock = threading.RLock()
        self.posted: dict[tuple, deque[RecvRequest]] = {}
        self.unexpected: dict[tuple, deque[Unexpected]] = {}
        self.staged_bytes = 0  # payload that arrived before its receive and was buffered (a 2nd copy)
        self.held = 0  # of it, about how much is buffered now (recounted where it passes held_limit)
        self.held_limit = 0  # Config.held_limit (0: no bound), set with the runtime
        self.dropped: set[int] = set()  # groups a message was dropped from (held_limit): every later one too
        self.releases = 0  # waits that grew idle enough to stage what was parked (release_parked)
        self._spin_fixed = spin_us is not None
        self.spin_s = (DEFAULT_SPIN_US if spin_us is None else spin_us) * 1e-6
        self.oversubscribed = False  # more ranks on this machine than usable cores (adapt_to_machine)
        self.host_peers: set[int] = set()  # peers on this host (sharing /dev/shm), rings or not
        self.shm_refused: dict[int, int] = {}  # host peers without rings: the errno why (0: the peer's)
        self.cores = len(os.sched_getaffinity(0))  # the cores this machine's ranks spread over
        self.machine_ranks = 1  # the ranks that share them, this one included (adapt_to_machine)
        self._unbound: set[int] | None = None  # the cores to give back at close, where bound
        self._sockets: list = []
        self.channel_list: list[Channel] = []
        self._tick = 0
        self._bg: threading.Thread | None = None
        self._bg_refused = False  # the background thread could not start (said once)
        self.refused_as_posted = 0
        self._bg_wakeup = threading.Condition(self.lock)
        self._background: set[Request] = set()
        self._bg_parked = False  # the background thread sleeps until a request wakes it
        self._watch_until = 0.0  # the background thread looks at the peers until then (watch_peers)
        self._next_look = 0.0
        self._waits = 0  # waits begun by any thread: while they keep coming, the thread looks less often
        self.until_glance = _GLANCE  # calls that never wait left before the next glance()
        self._foreground = 0  # threads inside wait(), each driving progress for everyone
        self.closed = False
        self.wiring: Wiring | None = None  # makes channels on first use; None: only add_channel
        self.pumps: Pumps | None = None  # threads for large TCP parts (adapt_to_machine)
        self.nsocks = 1  # TCP streams this rank offers a pair (adapt_to_machine)

    def add_channel(self, peer: int, channel: Channel) -> None:
        self.channels[peer] = channel
        self.channel_list = list(self.channels.values())
        self.watch_sockets()

    def planned_kind(self, peer: int) -> str:
        """The channel a pair with `peer` has, or will have once it talks: 'shm' or 'tcp'."""
        channel = self.channels.get(peer)
        if channel is not None and channel.kind != "pending":
            return channel.kind
        return self.wiring.planned_kind(peer) if self.wiring is not None else "tcp"

    @property
    def ring_max(self) -> int:
        """How large this rank's rings may grow (0: no rings; pair_rings.PairRings.ring_max)."""
        return self.wiring.rings.ring_max if self.wiring is not None else 0

    def channel(self, peer: int) -> Channel:
        """The channel to `peer`, started now if there is none (call under the lock)."""
        channel = self.channels.get(peer)
        if channel is None:
            channel = self._connect(peer)
        return channel

    def _connect(self, peer: int) -> Channel:
        if self.wiring is None:
            raise KeyError(f"rank {self.rank}: no channel to rank {peer}")
        channel = PendingChannel(peer)
        self.add_channel(peer, channel)
        self.wiring.want(peer)
        return channel

    def reach(self, peers: Iterable[int]) -> None:
        """Start wiring those of `peers` that have no channel yet, in the background: a first
        message to one then finds its channel made, or on its way, while this rank worked."""
        if self.wiring is None:
            return
        with self.lock:
            for peer in peers:
                if peer != self.rank and peer not in self.channels and peer not in self.lost:
                    self._connect(peer)

    def connecting(self, peer: int) -> bool:
        """Whether the pair with `peer` is being wired (asked for, neither connected nor lost)."""
        channel = self.channels.get(peer)
        return channel is not None and channel.kind == "pending" and peer not in self.lost

    def install(self, peer: int, channel: Channel) -> bool:
        """The wiring connected `peer`: `channel` takes the place of its PendingChannel (and what
        was posted to that goes out first, in order). False if the peer is no longer wanted."""
        with self.lock:
            if self.closed or peer in self.lost:
                return False
            pending = self.channels.get(peer)
            self.add_channel(peer, channel)
            try:
                for req, control in pending.queue if pending is not None else ():
                    if not req.done:
                        (channel.post_control if control else channel.post)(req)
                channel.flush()
            except PeerClosed as exc:
                self.peer_lost(peer, str(exc))
        return True

    def watch_sockets(self) -> None:
        """The sockets a sleeping waiter selects on: those of live peers. A lost peer's socket
        stays readable (at EOF) forever and would turn every sleep into a spin."""
        self._sockets = [s for c in self.channel_list if c.peer not in self.lost for s in c.sockets]

    # -- posting ----------------------------------------------------------------------------
    def isend(self, peer: int, header: Header, payload: np.ndarray, what: object,
              wire_header: bytes | None = None, waking: bool = False, seq: int = P2P_SEQ) -> SendRequest:
        """`waking`: over the pair's socket even where a ring joins them, so that a peer asleep
        on its sockets wakes for it at once (a ring's data is seen at its next poll); for a
        message below SPLIT_BYTES, which no stream splits (a larger one goes the usual way).
        `seq`: a point-to-point message's place among its group's calls (requests.P2P_SEQ)."""
        req = SendRequest(peer, header, payload, what, wire_header, seq)
        with self.lock:
            if peer == self.rank:
                self._self_deliver(req)
                return req
            if (self.aborted or self.lost) and self.fail_if_unusable(req):
                return req
            channel = self.channels.get(peer) or self._connect(peer)
            try:
                if waking and payload.nbytes < SPLIT_BYTES:
                    channel.post_control(req)
                    channel.poll_socket()
                    return req
                channel.post(req)
                if header.kind == Kind.P2P:
                    # Sends only: a message read now, before its receive is posted (a sendrecv
                    # posts its send first), would be staged and copied twice. Waiters read.
                    channel.flush()
                else:  # a collective reads too: what arrived is vetted before this call can end
                    channel.progress()
            except PeerClosed as exc:
                self.peer_lost(peer, str(exc))
        return req

    def isend_device(self, peer: int, header: Header, body: bytes, source: DeviceSource, what: object,
                     seq: int = P2P_SEQ) -> SendRequest | None:
        """A CUDA buffer's send as its descriptor `body` (gpu/p2p.py) where shared memory joins
        this rank to `peer`: the receiver copies it device to device, then acknowledges
        (ShmChannel._offer_device). None where no such channel is up yet: stage it."""
        with self.lock:
            channel = self.channels.get(peer)
            if peer == self.rank or channel is None or channel.kind != "shm" or peer in self.lost:
                return None
            req = SendRequest(peer, header, _EMPTY, what, seq=seq)
            req.device_body, req.holds = body, source
            if self.aborted and self.fail_if_unusable(req):
                return req
            try:
                channel.post(req)
                channel.flush()
            except PeerClosed as exc:
                self.peer_lost(peer, str(exc))
        return req

    def irecv(self, peer: int, header: Header, dst: np.ndarray, reduce_op: ReduceOp | None,
              what: object, base: np.ndarray | None = None, seq: int = P2P_SEQ,
              device: DeviceTarget | None = None) -> RecvRequest:
        """`device`: a receive into device memory (a device message lands there, any other in
        `dst`: RecvRequest.device)."""
        req = RecvRequest(peer, header, dst, reduce_op, what, base, seq)
        if device is not None:
            req.device = device
        with self.lock:
            key = (peer, header.key)
            queue = self.unexpected.get(key)
            error = self.abort_error(req) if self.aborted else None
            if error is not None:
                req.fail(error)
            elif not queue and peer in self.lost:
                # A message that already arrived is delivered even if its sender has left since.
                req.fail(self.lost_error(peer))
            elif not queue and self.p2p_ended and (header.ctx, peer) in self.p2p_ended \
                    and header.kind == Kind.P2P:
                req.fail(self.p2p_ended_error(req, self.p2p_ended[(header.ctx, peer)]))
            elif queue:
                msg = queue.popleft()
                if not queue:
                    del self.unexpected[key]
                if msg.buf is not None:
                    self.held -= msg.nbytes
                if self.check_arrival(req, msg.header):
                    if msg.complete:
                        deliver(msg, req)
                    else:
                        msg.waiter = req
                elif msg.source is not None:  # the receive failed: release the sender anyway
                    msg.source.discard()
            else:
                self.posted.setdefault(key, deque()).append(req)
                if peer != self.rank and peer not in self.channels:
                    self._connect(peer)  # its sender's loss, or an abort, must reach this wait
                elif header.kind == Kind.P2P and peer != self.rank:
                    # A message already in the ring or socket is read now, straight into `dst`:
                    # the receive is then done as posted, with no wait to drive nor a request
                    # for the background thread to watch.
                    try:
                        self.channels[peer].progress()
                    except PeerClosed as exc:
                        self.peer_lost(peer, str(exc))
        return req

    def send_now(self, peer: int, wire_header: bytes, payload: np.ndarray) -> bool:
        """A small point-to-point message handed whole to `peer`'s ring or socket now, with no
        request to make, post and wait for (ShmChannel.put_now, TcpChannel.put_now). False:
        post it the general way (`isend`)."""
        channel = self.channels.get(peer)
        if channel is None or not channel.sends_now or (self.lost and peer in self.lost) \
                or (self.aborted and ctx_of(wire_header) in self.aborted):  # this group's and peer's only
            return False
        with self.lock:
            if self.channels.get(peer) is not channel:
                return False
            try:
                return channel.put_now(wire_header, payload)
            except PeerClosed as exc:  # the general way then fails as every send to a lost peer
                self.peer_lost(peer, str(exc))
                return False

    def recv_now(self, peer: int, key: tuple, wire_header: bytes, dst: np.ndarray, spin: bool,
                 what: str = "") -> bool:
        """A point-to-point receive taken straight from `peer`'s ring where its message is the
        next one there and no earlier one waits for it (ShmChannel.take_now; `key`: its
        matching key, (peer, header.key)), spinning up to the waiters' spin time for it to
        come (`spin`: a blocking receive, where no send of this process waits to be pushed
        meanwhile); given the receive's label `what`, also a large message left in its
        sender's memory (ShmChannel.take_read). Nothing else is driven meanwhile, and the lock
        is held: False: receive the general way (`irecv`), which drives everything, parks,
        stages, and notices lost peers and aborts."""
        channel = self.channels.get(peer)
        if channel is None or not channel.takes_now:
            return False
        with self.lock:
            if (self.aborted and key[1][0] in self.aborted) or (self.lost and peer in self.lost) \
                    or (self.dropped and key[1][0] in self.dropped) \
                    or self.posted.get(key) or self.unexpected.get(key) \
                    or self.channels.get(peer) is not channel:
                return False
            try:
                taken = channel.take_now(wire_header, dst)
                if taken:
                    return True
                may_spin = spin and self.spin_s and not any(c.queued() for c in self.channel_list)
                if what and 0 < channel.read_bytes <= dst.nbytes:  # maybe left in its sender's memory
                    taken = channel.take_read(wire_header, dst, what, self.spin_s if may_spin else 0.0)  # type: ignore[attr-defined]  # a ShmChannel
                    if taken is None:  # nothing came within the spin: the general way
                        return False
                    if taken is False:  # another record first: an inline message maybe
                        taken = channel.take_now(wire_header, dst)
                if taken is None and may_spin:
                    taken = channel.take_now(wire_header, dst, self.spin_s)
                if taken is None and spin and not self.spin_s:
                    taken = self._take_yielding(channel, wire_header, dst)
            except PeerClosed as exc:  # the general way then fails as every receive from a lost peer
                self.peer_lost(peer, str(exc))
                return False
        return bool(taken)

    def _take_yielding(self, channel: Channel, wire_header: bytes, dst: np.ndarray) -> bool | None:
        """Where ranks share cores (waiters do not spin): take_now after each of up to PREYIELD
        yields of the core, while no send of this process waits to be pushed."""
        if not self.oversubscribed or any(c.queued() for c in self.channel_list):
            return None
        taken = None
        for _ in range(PREYIELD):
            os.sched_yield()
            taken = channel.take_now(wire_header, dst)
            if taken is not None:
                break
        return taken

    def recv_yielding(self, peer: int, key: tuple, wire_header: bytes, dst: np.ndarray, what: str) -> bool:
        """recv_now where ranks share cores, for a receive whose spin is over (a sendrecv's
        compiled exchange): its yields alone; False elsewhere."""
        if self.spin_s or not self.oversubscribed:
            return False
        return self.recv_now(peer, key, wire_header, dst, True, what)

    def sendrecv_now(self, to: int, out_header: bytes, payload: np.ndarray, frm: int, key: tuple,
                     in_header: bytes, dst: np.ndarray) -> tuple[bool, bool]:
        """send_now, then a blocking recv_now: a small MPI_Sendrecv's common case, under one
        lock and in one compiled call where both go through rings (ShmChannel.exchange_now).
        (sent, received); what is not done is posted the general way."""
        with self.lock:
            out, inn = self.channels.get(to), self.channels.get(frm)
            if out is None or inn is None or (self.aborted and key[1][0] in self.aborted) \
                    or (self.dropped and key[1][0] in self.dropped) \
                    or (self.lost and (to in self.lost or frm in self.lost)):
                return False, False
            if out.direct and inn.direct and not (self.posted.get(key) or self.unexpected.get(key)):
                done = out.exchange_now(out_header, payload, inn, in_header, dst, self.spin_s)  # type: ignore[attr-defined]  # a ShmChannel
                if done is not None:
                    return done
        # one by one (sockets, no compiled loops, or an earlier receive for that peer and tag first)
        flags, into = payload.flags, dst.flags
        if not (flags.c_contiguous and into.c_contiguous and into.writeable):
            return False, False
        sent = self.send_now(to, out_header, payload)
        return sent, sent and self.recv_now(frm, key, in_header, dst, True)

    def sendrecv_read(self, to: int, header: Header, what: str, payload: np.ndarray, frm: int, key: tuple,
                      in_header: bytes, in_what: str, dst: np.ndarray,
                      seq: int) -> tuple[SendRequest | None, bool] | None:
        """A large MPI_Sendrecv through shared memory where each rank reads the other's buffer
        in one compiled call (ShmChannel.exchange_read); `payload` flat uint8. (the send where
        it waits for its reader's acknowledgement, else None; whether the receive is done);
        None: nothing done, both go the general way."""
        with self.lock:
            out, inn = self.channels.get(to), self.channels.get(frm)
            if out is None or inn is None or not (out.direct and inn.direct) or header.ctx in self.aborted \
                    or header.ctx in self.dropped \
                    or to in self.lost or frm in self.lost or self.posted.get(key) \
                    or self.unexpected.get(key) or not (dst.flags.writeable and dst.flags.c_contiguous):
                return None
            req = SendRequest(to, header, payload, what, seq=seq)
            spin = 0.0 if any(c.queued() for c in self.channel_list) else self.spin_s  # as recv_now's
            sent, taken = out.exchange_read(req, inn, in_header, in_what, dst, spin)  # type: ignore[attr-defined]  # a ShmChannel
        if not sent:
            return None
        return (None if req.done else req), taken

    def await_read(self, req: SendRequest) -> None:
        """Spin up to the waiters' spin time for the acknowledgement of a blocking send that its
        receiver reads out of this process's memory (REMOTE), where it is the next record from
        that peer (ShmChannel.take_ack): the reader is usually at it already, and the general
        wait's rounds take longer to notice it."""
        if req.done or req.descriptor is None or not self.spin_s or req.header.kind != Kind.P2P:
            return
        with self.lock:
            channel = self.channels.get(req.peer)
            if channel is not None and channel.direct and not req.done:
                try:
                    channel.take_ack(req, self.spin_s)  # type: ignore[attr-defined]  # a ShmChannel
                except PeerClosed as exc:
                    self.peer_lost(req.peer, str(exc))

    def _self_deliver(self, req: SendRequest) -> None:
        """A message to oneself goes straight through matching, never through a channel."""
        sink = self.match(self.rank, req.header)
        if sink.nbytes:
            sink.write(req.payload)
        sink.finish()
        req.sent = req.payload.nbytes
        req.done = True

    # -- matching (called by channels when a header arrives) --------------------------------
    def match(self, peer: int, header: Header, remote: bool = False) -> Sink:
        """The sink for an arriving message: its posted receive, else a new unexpected one
        (`remote`: its payload stays in the sender's memory until a receive takes it)."""
        if header.kind > _LAST_DATA_KIND:
            return self.control_sink(peer, header)
        if self.retired and header.ctx in self.retired:
            return Discard(header.nbytes)  # a shrunk group's traffic, still in flight
        if self.dropped and header.ctx in self.dropped:  # after a dropped message none may match a
            return Discard(header.nbytes)  # receive (it would take the dropped one's place)
        key = (peer, header.key)
        queue = self.posted.get(key)
        if queue:
            req = queue.popleft()
            if not queue:
                del self.posted[key]
            if self.check_arrival(req, header):
                return req
            return Discard(header.nbytes)
        if not remote:
            self.held += header.nbytes
            if self.held_limit and self.held > self.held_limit and self._holds_too_much(peer, header):
                return Discard(header.nbytes)
        try:
            msg = Unexpected(header, remote)
        except MemoryError as exc:
            if not remote:
                self.held -= header.nbytes
            self._drop(peer, header, self._cannot_hold(exc, peer, header))
            return Discard(header.nbytes)  # read past it: the stream stays framed
        if not remote:
            self.staged_bytes += header.nbytes
        self.unexpected.setdefault(key, deque()).append(msg)
        if header.kind == Kind.COLL:
            heapq.heappush(self.unvetted.setdefault(header.ctx, []), (header.seq, peer, header.key))
            call = self.current_call(header.ctx)
            if call is not None and header.seq <= call.seq:
                self.vet(peer, header, call)
        return msg

    def _holds_too_much(self, peer: int, header: Header) -> bool:
        """Whether the buffered messages (recounted) and this one, from `peer`, pass held_limit:
        if so its group is failed (once the channel's read is over) with a ResourceError that
        names the limit, on this rank and the sender; a sender far ahead of its receiver would
        otherwise fill the host's memory."""
        held = sum(m.nbytes for q in self.unexpected.values() for m in q if m.buf is not None)
        self.held = held + header.nbytes
        if self.held <= self.held_limit:
            return False
        self.held = held
        self._drop(peer, header, ResourceError(
            f"rank {self.rank}: holds {held} bytes of messages that came before their receives or calls "
            f"were made here; the next, {header.nbytes} bytes from rank {peer} ({_label(header)}), would "
            f"pass TENSORWIRE_HELD_BYTES={self.held_limit}: it is dropped and the group aborted. A rank "
            f"that sends far more than its peer takes (sends without receives, calls far ahead) would "
            f"otherwise fill this host's memory; post the receives sooner, or raise the limit"))
        return True

    def _cannot_hold(self, exc: MemoryError, peer: int, header: Header) -> ResourceError:
        """The error of a message that came before its receive or call and finds no memory to
        wait in."""
        call = self.current_call(header.ctx)
        group = "" if call is None else f" on group {call.group.name}"
        return limits.memory_error(
            exc, f"rank {self.rank}", f"the {header.nbytes} bytes from rank {peer} ({_label(header)}){group} "
                                      f"came before their receive or call was made here and cannot be held: "
                                      f"they are dropped and the group aborted; post the receive sooner, or "
                                      f"raise the limit")

    def _drop(self, peer: int, header: Header, error: ResourceError) -> None:
        """Fail the group of a message from `peer` that this rank cannot hold, here and on its
        members (once the channel's read is over); no later message of the group may match a
        receive (it would take the dropped one's place)."""
        call = self.current_call(header.ctx)
        members = tuple(call.group.ranks) if call is not None else (peer,)
        self.deferred_aborts.append((header.ctx, 0, members, error, False))
        self.dropped.add(header.ctx)

    def may_park(self, peer: int, header: Header) -> bool:
        """May a large message from `peer` wait in its ring for its receive (shm.PARK_BYTES)?
        Not if its receive is posted, nor a collective's message for an earlier call (vetted
        now: that call differed), nor while a receive from that peer for another message would
        wait behind it, nor once the peer left (its ring is read to its end now). A waiter idle
        for RELEASE_PARKED_S releases it anyway (`release_parked`): a rank waiting on a third
        one, or two ranks that both send before they receive, cannot wait on a parked message
        forever."""
        if self.posted.get((peer, header.key)) or (self.retired and header.ctx in self.retired) \
                or peer in self.departed:
            return False
        if header.kind == Kind.COLL:
            call = self.current_call(header.ctx)
            if call is not None and header.seq < call.seq:
                return False
        return not any(p == peer for p, _ in self.posted)

    def release_parked(self) -> None:
        """Stage every parked message (and vet it), and every unexpected one still in its
        sender's memory, whose sender waits for it: called by waiters idle for RELEASE_PARKED_S."""
        with self.lock:
            self.releases += 1
            for channel in self.channel_list:
                if channel.parked is not None:
                    channel.release = True
            for key, queue in list(self.unexpected.items()):
                for msg in list(queue):
                    try:
                        staged = msg.stage()
                    except MemoryError as exc:  # dropped, its sender released, as in match
                        queue.remove(msg)
                        msg.source.discard()  # type: ignore[union-attr]  # only a remote one stages
                        self._drop(key[0], msg.header, self._cannot_hold(exc, key[0], msg.header))
                        continue
                    self.staged_bytes += staged
                    self.held += staged
                if not queue:
                    del self.unexpected[key]
            self.progress()

    def adapt_to_machine(self, machine_ranks: int, index: int, bind: bool,
                         socket_threads: int | None = None, nsocks: int | None = 1,
                         sharing: int | None = None) -> None:
        """Wait, and sit, as the ranks that share this machine's cores need. The ranks are
        those that share its cores, whatever host name each has (the emulated hosts of the
        multi-host test bed share one kernel: topology.machine_id); `index` is this rank's
        among them (negative: unknown); `sharing` how many of them, this one included, may run
        on this rank's cores (processes.core_sharers; None: all of them). Ranks a launcher
        bound apart count as the cores they spread over.

        With more ranks than cores, a spinning waiter only keeps the rank it waits for off
        the CPU: waiters yield at once instead (unless TENSORWIRE_SPIN_US says). With `bind`
        (TENSORWIRE_BIND=1, as MPI's --bind-to core) such a rank is also bound to one core,
        round robin by `index`, which puts ring neighbours on different cores. A trade, hence
        off by default (docs/design/waiting.md#binding-tensorwire_bind). Threads that exist
        already (torch's pools, if made before init) keep their placement; close() gives the
        cores back. `socket_threads` (TENSORWIRE_SOCKET_THREADS; None: by the cores each rank
        has) sizes the pool of threads that move large TCP parts, `nsocks` (TENSORWIRE_NSOCKS;
        None: likewise) the streams this rank offers a pair."""
        usable = sorted(os.sched_getaffinity(0))
        sharing = machine_ranks if sharing is None else max(1, min(sharing, machine_ranks))
        self.cores = cores = len(usable) * machine_ranks // sharing
        self.nsocks = streams_per_pair(nsocks, cores, machine_ranks, self.world_size - 1)
        threads = pump_threads(socket_threads, cores, machine_ranks, self.nsocks)
        if threads and self.pumps is None:
            self.pumps = Pumps(threads)
        self.machine_ranks = machine_ranks
        self.oversubscribed = machine_ranks > cores
        if self.oversubscribed and not self._spin_fixed:
            self.spin_s = 0.0
        waiting = ("oversubscribed, waiters yield at once instead of spinning" if self.oversubscribed
                   else f"waiters spin up to {self.spin_s * 1e6:g} us before yielding")
        if sharing < machine_ranks:
            waiting += f"; {sharing} of them may run on this rank's {len(usable)} core(s)"
        if self.oversubscribed and len(usable) > 1 and bind:
            if index < 0:
                waiting += "; not bound to a core (this rank's index on the machine is unknown)"
            else:
                core = usable[index % len(usable)]
                try:
                    os.sched_setaffinity(0, {core})
                    self._unbound = set(usable)
                    waiting += f"; bound to core {core} (TENSORWIRE_BIND)"
                except OSError as exc:
                    waiting += f"; could not bind to core {core} ({exc})"
        _init_log.info("rank %d: %d rank(s) on this machine, %d usable cores: %s; %s",
                       self.rank, machine_ranks, cores, waiting,
                       f"{threads} thread(s) move large TCP messages" if threads
                       else "this rank's thread moves every TCP byte")

    # -- failures ---------------------------------------------------------------------------
    def poll_peers(self) -> None:
        """One round of progress and a look at every socket (shared memory's control messages
        come through its sockets too): a peer that died, or an abort it sent, is known now."""
        with self.lock:
            self.progress()
            self.poll_sockets()

    # -- progress ---------------------------------------------------------------------------
    def progress(self) -> bool:
        """One pass over every channel; True if any byte moved."""
        moved = False
        for channel in self.channel_list:
            if channel.peer in self.lost:
                continue
            try:
                if channel.progress():
                    moved = True
            except PeerClosed as exc:
                self.peer_lost(channel.peer, str(exc))
        self._tick += 1
        if self._tick & 255 == 0:
            self.poll_sockets()
        if self.deferred_aborts:  # found inside a channel's read: act on it outside of it
            self.run_deferred_aborts()
        return moved

    def poll_peer(self, peer: int) -> None:
        """One round of progress and a look at the socket of `peer`'s channel alone (what came
        behind a message just received from it: an abort of the call that sent it)."""
        with self.lock:
            channel = self.channels.get(peer)
            if channel is None or peer in self.lost:
                return
            try:
                channel.progress()
                channel.poll_socket()
            except PeerClosed as exc:
                self.peer_lost(peer, str(exc))
            if self.deferred_aborts:
                self.run_deferred_aborts()

    def poll_sockets(self) -> None:
        for channel in self.channel_list:
            if channel.peer in self.lost:
                continue
            try:
                channel.poll_socket()
            except PeerClosed as exc:
                self.peer_lost(channel.peer, str(exc))

    def withdraw(self, reqs: Iterable[Request]) -> bool:
        """Take back the receives among `reqs` that no message has matched yet (a blocking
        receive that timed out): else the next message of their key would land in a buffer
        its caller was told was never filled, and a later receive of that key would wait in
        vain. False where an unfinished one cannot be taken back: a send (its message may be
        on its way, or wait in its sender's memory for a reader), or a receive whose message
        had begun to arrive; its peer would get a message its caller was told had failed."""
        whole = True
        with self.lock:
            for req in reqs:
                if req.done:
                    continue
                key = (req.peer, req.header.key)
                queue = self.posted.get(key)
                if queue and isinstance(req, RecvRequest) and req in queue:
                    queue.remove(req)
                    if not queue:
                        del self.posted[key]
                else:
                    whole = False
        return whole

    def wait(self, reqs: Sequence[Request], *, deadline: float, ctx: int, seq: int, watch: Iterable[int],
             what: object, cross_check: Callable[[], None] | None = None) -> None:
        """Drive progress until every request is done; raise the first failure.

        `watch` are the world ranks whose crash dooms this wait (the group's members): even one
        it does not wait for, unless the call ends soon after (Failures.check_group).
        `cross_check` runs when idle, to spot peers that entered this call another way.
        """
        pending = [r for r in reqs if not r.done]
        was_closed = self.closed
        if pending and not (self.refused_as_posted and any(type(r.error) is ResourceError for r in reqs)):
            # (one refused as it was posted, for a limit, fails the wait at once: its peer's part
            # may have been refused alike: TcpChannel.post)
            try:
                self._drive(pending, deadline, ctx, seq, watch, what, cross_check)
            except AbortedError:
                if self.closed:
                    raise self.closed_error(what) from None
                raise
        else:  # all finished as posted (small sends)
            self.until_glance -= 1
            if not self.until_glance:
                self.glance()
        for r in reqs:
            if r.error is not None:
                if self.closed and not was_closed and isinstance(r, SendRequest):  # close() failed it
                    raise self.closed_error(what) from None
                raise self._void_error(r, deadline) if r.void else r.error
        error = self.covering(ctx, seq) if self.aborted else None
        if error is not None:  # found while driving, after this wait's messages came
            raise error

    def _void_error(self, req: Request, deadline: float) -> BaseException:
        """The abort that made `req`'s message void, which its sender sent right behind it:
        waited for up to _NOTICES_S (the sender may be gone: then the message says it)."""
        until = min(deadline, time.perf_counter() + _NOTICES_S)
        while True:
            with self.lock:
                self.poll_peers()
                error = self.abort_error(req)
            if error is not None:
                return error
            if time.perf_counter() > until:
                return AbortedError(f"rank {self.rank}: {req.error}")
            self.sleep_on_sockets(0.002)

    def glance(self) -> None:
        """One round of progress and of the sockets, which callers make every _GLANCE calls
        that never wait (counting `until_glance` down): a rank whose calls end as posted (a
        broadcast's root) still reads what comes for it, an abort above all, within that many
        calls instead of when its link is full."""
        self.until_glance = _GLANCE
        self.poll_peers()

    def _drive(self, pending: list[Request], deadline: float, ctx: int, seq: int, watch: Iterable[int],
               what: object, cross_check: Callable[[], None] | None) -> None:
        backoff = None  # made when first idle: most waits end in the first round of progress
        with self.lock:
            self._foreground += 1  # the background thread stands back: this waiter drives everything
            self._waits += 1
        try:
            while pending:
                with self.lock:
                    moved = self.progress()
                    pending[:] = [r for r in pending if not r.done]  # in place: `timeout` names it
                if not pending:
                    break
                if backoff is None:
                    backoff = Backoff(self, deadline, ctx, seq, tuple(watch), cross_check)
                    timeout = functools.partial(self._timeout, pending, what)
                if moved:
                    backoff.reset()
                else:
                    backoff.idle(timeout)
        finally:
            with self.lock:
                self._foreground -= 1

    def sleep_on_sockets(self, seconds: float) -> None:
        """Sleep until a socket is readable (data, a control message, a closed peer), one with
        sends queued can take more, or `seconds`."""
        with self.lock:
            self.poll_sockets()
        self._select(seconds)
        with self.lock:
            self.poll_sockets()

    def _select(self, seconds: float) -> None:
        """Sleep on the sockets, or, while pump threads run, on their finishing too (leaving out
        the sockets they read, which are readable all along)."""
        pumps = self.pumps
        writers = [s for c in self.channel_list if c.peer not in self.lost for s in c.blocked_writers()]
        try:
            if pumps is not None and pumps.busy:
                ready, _, _ = select.select(
                    [s for s in self._sockets if s not in pumps.receiving] + [pumps.fd], writers, [], seconds)
                if pumps.fd in ready:
                    pumps.drain()
            else:
                select.select(self._sockets, writers, [], seconds)
        except (OSError, ValueError):
            time.sleep(seconds)

    def _timeout(self, pending: Sequence[Request], what: object) -> TimeoutError:
        waits = sorted({r.peer for r in pending})
        detail = "; ".join(r.progress_text() for r in pending[:4])
        return TimeoutError(
            f"rank {self.rank}: {what} timed out waiting for rank(s) {', '.join(map(str, waits))} "
            f"({detail}). The peer is stuck, slower than the timeout, or never called this operation.")

    # -- background progress for user isend/irecv --------------------------------------------
    def watch_in_background(self, req: Request) -> None:
        """Keep `req` progressing while nobody waits on it (async point-to-point).

        The thread is woken only from its long sleep: while requests keep coming it looks for
        them every _BG_GRACE_S by itself, as a wake per request (a futex wake, then the thread
        taking the GIL and maybe the peer's core) costs a small receive much of its time."""
        if req.done:
            return
        with self.lock:
            background = self._background
            background.add(req)
            if len(background) > _BG_PRUNE:
                self._background = {r for r in background if not r.done}
            self._wake_background()

    def watch_peers(self, seconds: float) -> None:
        """Have the background thread look at the peers every _WATCH_S for at least `seconds`,
        with no request pending: a kernel waiting for peers on the GPU (gpu/device_flags.py)
        stops only when told (Failures.alarms), while this process may be blocked anywhere,
        in a synchronize or a full launch queue. Cheap to call per launch: the lock is taken
        only where the watch ends sooner."""
        until = time.perf_counter() + seconds
        if until <= self._watch_until:
            return
        with self.lock:
            self._watch_until = until + _BG_PARK_S  # the next calls within a second skip the lock
            self._wake_background()

    def _wake_background(self) -> None:
        """Start the background thread, or wake it from its long sleep (the lock held)."""
        if self.closed:
            return
        if self._bg is None:
            thread = threading.Thread(target=self._background_loop, name="tensorwire-progress", daemon=True)
            try:
                limits.start_thread(thread, f"rank {self.rank}: its progress thread")
            except ResourceError as exc:  # requests then move while a call of this rank waits
                if not self._bg_refused:
                    self._bg_refused = True
                    log.warn(f"{exc}; async point-to-point moves only while a call waits", TensorwireWarning)
                return
            self._bg = thread
        elif self._bg_parked:
            self._bg_wakeup.notify()

    def _background_loop(self) -> None:
        """Drive progress for requests nobody has waited on for _BG_GRACE_S. Most isend/irecv
        are waited on at once, and the waiter drives everything itself: a thread woken for each
        of them would only take the GIL, and on a busy host a core, from the ranks. While waits
        keep coming it looks ever less often (up to _BG_LOOK_MAX_S): each look takes the GIL
        from a spinning waiter (docs/design/waiting.md#the-background-thread). While the peers
        are watched (watch_peers) it also looks at the sockets every _WATCH_S, where aborts and
        lost peers show: only there, as reading a ring may make CUDA calls (a device message's
        copy), which another thread's graph capture forbids."""
        quiet_since = None  # when pending requests were first seen without a waiter
        stalled_since = None  # when its own progress last stopped moving anything
        period = _BG_GRACE_S
        seen = -1
        idle_since = time.perf_counter()
        while True:
            with self.lock:
                self._background = {r for r in self._background if not r.done}
                if self.closed:
                    return
                now = time.perf_counter()
                watching = now < self._watch_until
                if watching and now >= self._next_look and not self._foreground:
                    self._next_look = now + _WATCH_S  # (a waiter in the foreground looks itself)
                    self.poll_sockets()  # no ring progress: a capture may be under way (device_flags)
                    if self.deferred_aborts:
                        self.run_deferred_aborts()
                busy = self._waits != seen or self._foreground
                seen = self._waits
                period = min(2 * period, _BG_LOOK_MAX_S) if busy else _BG_GRACE_S
                if not self._background:
                    quiet_since = None
                    if watching:
                        idle_since = now
                        self._bg_wakeup.wait(_WATCH_S)
                    elif now - idle_since < _BG_PARK_S:
                        self._bg_wakeup.wait(period)
                    else:  # point-to-point has gone quiet: sleep until a request comes
                        self._bg_parked = True
                        self._bg_wakeup.wait()
                        self._bg_parked = False
                        idle_since, period = time.perf_counter(), _BG_GRACE_S
                    continue
                idle_since = now
                if busy:
                    quiet_since = stalled_since = None  # waiters drive progress: look again later
                elif quiet_since is None:
                    quiet_since = now
                if quiet_since is None or now - quiet_since < _BG_GRACE_S:
                    self._bg_wakeup.wait(period)
                    continue
                moved = self.progress()
                if moved:
                    stalled_since = None
                elif stalled_since is None:
                    stalled_since = now
                elif now - stalled_since >= RELEASE_PARKED_S:  # as an idle waiter does: sends
                    stalled_since = None  # that wait for each other, with nobody waiting here
                    self.release_parked()
            if not moved:
                self._select(200e-6)

    # -- shutdown ---------------------------------------------------------------------------
    def let_go_in_fork(self) -> None:
        """In a process forked from this rank's: close its copies of the rank's sockets, which
        would keep the rank's connections open after the rank itself died (its peers would not
        learn of it while the fork lives). Only the descriptors: the parent's connections stay."""
        socks = [s for channel in self.channels.values() for s in channel.sockets]
        if self.wiring is not None:
            socks += self.wiring.listeners
        for sock in socks:
            try:
                sock.close()
            except OSError:
                pass

    def _settle(self) -> None:
        """Before the sockets close (the lock held): wait until each peer's kernel has what this
        rank sent it, reading and dropping what comes meanwhile. A socket closed with bytes unread,
        or one that bytes reach after it closed, resets the connection, and the reset throws away
        what it had not delivered yet (docs/design/failures.md#closing-engine_settle). Bounded:
        TENSORWIRE_PEER_TIMEOUT while a peer answers nothing (an outage), _NOT_READING_S while it
        answers but does not read (its receive window closed)."""
        cfg = self.wiring.cfg if self.wiring is not None else None
        start = time.perf_counter()
        until = start + (cfg.peer_timeout if cfg is not None else 0.0)
        while True:
            waiting = []
            for channel in self.channel_list:
                if channel.peer in self.lost or channel.kind == "pending":
                    continue
                with contextlib.suppress(PeerClosed):
                    channel.flush()
                for sock in channel.sockets:
                    if drain(sock) and unsent_bytes(sock) and (time.perf_counter() - start < _NOT_READING_S
                                                               or unanswered_ms(sock) >= _ANSWERED_MS):
                        waiting.append(sock)
            if not waiting or time.perf_counter() >= until:
                return
            poller = select.poll()  # (select() cannot take descriptors from 1024)
            for sock in waiting:
                poller.register(sock, select.POLLIN)
            poller.poll(20)

    def _drive_while(self, pending: Callable[[], object], seconds: float) -> None:
        """Make progress while `pending()` is true, for up to `seconds`."""
        until = time.perf_counter() + seconds
        while pending() and time.perf_counter() < until:
            self.look()

    def _unfinished_sends(self, ctx: int | None = None) -> list[SendRequest]:
        """The point-to-point messages this rank posted (on group `ctx`, or any) that have not
        left its hands."""
        with self.lock:
            return [req for channel in self.channel_list if channel.peer not in self.lost
                    for req in channel.pending() if not req.done and req.header.kind == Kind.P2P
                    and ctx in (None, req.header.ctx)]

    def finish_sends(self, ctx: int) -> set[int]:
        """Drive the point-to-point sends of group `ctx` nobody waited for, for up to
        _SEND_GRACE_S (a destroyed group's): the peers some of them are still on their way to."""
        self._drive_while(lambda: self._unfinished_sends(ctx), _SEND_GRACE_S)
        return {req.peer for req in self._unfinished_sends(ctx)}

    def close(self) -> None:
        """Say goodbye to every peer, wait until their kernels have what this rank sent
        (`_settle`: at once on a healthy link), then close the channels; a point-to-point send
        nobody waited for gets _SEND_GRACE_S to finish first, and fails after;
        first, for up to _NOTICES_S, deliver the aborts this rank sent: a rank that raises and
        exits at once would leave most of them unsent (to peers it was not connected to yet, or
        queued behind the failed call's bytes), and the others learn only that it left."""
        self._drive_while(lambda: any(not n.done for n in self.notices), _NOTICES_S)
        self._drive_while(self._unfinished_sends, _SEND_GRACE_S)
        if self.wiring is not None:
            self.wiring.close()  # no channel is installed after this
        with self.lock:
            self.closed = True
            self._background = set()  # the requests (and the Works they hold) are let go here
            self._bg_wakeup.notify_all()  # a parked thread or one between looks: both see _closed
            note = self.goodbye_note()
            for channel in self.channel_list:
                if channel.peer not in self.lost and channel.kind != "pending":
                    try:
                        channel.flush()  # acknowledgements a peer's send may wait for
                    except PeerClosed:
                        pass
                    bye = Header(Kind.BYE, 0, 0, 0, note.size, Fingerprint(0))
                    channel.post_control(SendRequest(channel.peer, bye, note, "goodbye"))
                    try:
                        channel.poll_socket()
                    except PeerClosed:
                        pass
            self._settle()
            unfinished = self._unfinished_sends()
            for channel in self.channel_list:
                channel.close()
            for req in unfinished:  # no one would finish them now
                read = " (a receive it posts may still read the buffer while this process runs)" \
                    if req.descriptor is not None else ""
                req.fail(AbortedError(
                    f"rank {self.rank}: {req.what}: tensorwire.destroy() was called with it unfinished: "
                    f"rank {req.peer} had not taken it {_SEND_GRACE_S:g} s later{read}"))
            for queue in self.posted.values():  # receives nobody will complete now
                for posted in queue:
                    posted.fail(AbortedError(f"rank {self.rank}: {posted.what}: tensorwire shut down "
                                             f"(destroy()) while it was posted"))
            self.posted.clear()
            if self.pumps is not None:
                self.pumps.close()
                self.pumps = None
            self.channels.clear()
            self.channel_list = []
            self._sockets = []
        if self._unbound is not None:  # a runtime made after this one counts the cores afresh
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self._unbound)
            self._unbound = None
        bg = self._bg
        if bg is not None and bg is not threading.current_thread():
            # a daemon thread still running at interpreter exit is killed as it next takes the
            # GIL, which aborts the process where that is inside C++ (torch frees a Work so)
            bg.join(_BG_JOIN_S)


def _label(header: Header) -> str:
    """A message named by what it is for: 'call #3' or 'point-to-point, tag 6'."""
    return f"call #{header.seq}" if header.kind == Kind.COLL else f"point-to-point, tag {header.tag}"
