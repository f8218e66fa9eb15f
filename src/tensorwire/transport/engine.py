"""The progress engine: message matching, request progress, waiting, and failure detection.

One engine per process owns one channel per peer it talks to (world ranks), made on first use
(transport/wiring.py), and all requests of all groups.
Whoever waits drives progress for everybody (as in MPI), so a rank blocked in one receive still
drains the rings and sockets that its peers need drained: no rank can deadlock another through
full buffers. Waiting spins briefly, then yields, then sleeps on the peers' sockets; sleeping on
the sockets is also how a closed connection, i.e. a dead peer, is noticed at once.
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from .. import log
from ..errors import (
    AbortedError,
    CollectiveMismatchError,
    InvalidArgumentError,
    PeerLostError,
    ResourceError,
    TensorwireError,
    TimeoutError,
    retold,
)
from ..ops import ReduceOp, dtype_from_code
from .requests import ControlSink, Discard, RecvRequest, Request, SendRequest, Sink, Unexpected, deliver
from .tcp import PeerClosed
from .wire import Fingerprint, Header, Kind, coll_label, differences
from .wiring import PendingChannel

_log = log.get("TRANSPORT")
_init_log = log.get("INIT")  # decisions taken once, at init
_ERROR_CLASSES = {cls.__name__: cls for cls in (CollectiveMismatchError, PeerLostError, TimeoutError,
                                                AbortedError, InvalidArgumentError, ResourceError,
                                                TensorwireError)}


def _dtype_label(code: int) -> str:
    try:
        return str(dtype_from_code(code))
    except Exception:  # an unknown code is itself the finding
        return f"dtype#{code}"


def _op_label(code: int) -> str:
    try:
        return ReduceOp(code).name
    except ValueError:
        return f"op#{code}"


_EMPTY = np.empty(0, dtype=np.uint8)
_LAST_DATA_KIND = int(max(Kind.P2P, Kind.COLL))  # kinds above it are control messages
DEFAULT_SPIN_US = 50.0
_YIELD_S = 0.02  # after spinning, yield the CPU for this long before sleeping
_SLEEP_MAX_S = 0.001  # longest single sleep: bounds the wake-up delay for shared-memory data
_RELEASE_PARKED_S = 0.1
"""A waiter idle this long stages the messages parked in its rings (shm.PARK_BYTES) and those
left in their senders' memory (shm.REMOTE_BYTES), whatever they wait for: a parked sender may
be the one this wait depends on, through a third rank, or two ranks may both send first."""
_BG_GRACE_S = 0.005  # the background thread leaves pending requests this long to a waiter
_BG_LOOK_MAX_S = 0.04  # its longest pause between looks while waits keep coming
_BG_PARK_S = 1.0  # it sleeps until woken once this long has passed without a pending request
_BG_PRUNE = 256  # finished requests the set may hold before a registration drops them
_LIVENESS_S = 0.2
"""How often an idle waiter looks whether peers it has no connection to are still alive (their
processes, where they run on this machine): a rank that died before anyone talked to it fails
the calls that wait for it within this, not at their timeout."""
LEFT = "it left the job"
"""What a departed peer's PeerLostError says (also as other ranks report it)."""
_WHY_LEFT_S = 1.0  # how long a call that lost a departed peer looks for the reason it left
_NOTICES_S = 1.0  # how long close() tries to deliver the aborts this rank sent
_ASK_S, _MISSING_S = 0.5, 1.0  # a timed-out call's wait for the members' answers, then for another's abort
_NOT_IN = "Not in this call"
_STATES_MAX = 4096
_REPORTED = "[reported by rank"


class Engine:
    def __init__(self, rank: int, world_size: int, spin_us: float | None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.channels: dict[int, object] = {}
        self.lock = threading.RLock()
        self.posted: dict[tuple, deque[RecvRequest]] = {}
        self.unexpected: dict[tuple, deque[Unexpected]] = {}
        self.staged_bytes = 0  # payload that arrived before its receive and was buffered (a 2nd copy)
        self.lost: dict[int, str] = {}  # peers we can no longer talk to, and why
        self.crashed: set[int] = set()  # ...of which those that vanished without a goodbye
        self.departed: set[int] = set()  # peers that said goodbye (their channel is still drained)
        self.current: dict[int, object] = {}  # ctx -> the collective call the group is running
        self.states: dict[tuple[int, int], int] = {}  # (ctx, peer) -> the call it said it runs (missing())
        self.deferred_aborts: list[tuple] = []
        self._notices: list[SendRequest] = []  # the aborts this rank sent (close() delivers them)
        self.aborted: dict[int, tuple[int, BaseException]] = {}  # ctx -> (first failing call, why)
        self.children: dict[int, list[int]] = {}  # ctx -> the groups that fail with it (a hierarchy's)
        self.retired: set[int] = set()  # contexts never used again (shrunk groups): arrivals dropped
        self._spin_fixed = spin_us is not None
        self.spin_s = (DEFAULT_SPIN_US if spin_us is None else spin_us) * 1e-6
        self.oversubscribed = False  # more ranks on this machine than usable cores (adapt_to_machine)
        self.host_peers: set[int] = set()  # peers on this host (sharing /dev/shm), rings or not
        self.shm_refused: dict[int, int] = {}  # host peers without rings: the errno why (0: the peer's)
        self.cores = len(os.sched_getaffinity(0))  # usable cores, counted before any binding
        self._unbound: set[int] | None = None  # the cores to give back at close, where bound
        self._sockets: list = []
        self._channel_list: list = []
        self._tick = 0
        self._bg: threading.Thread | None = None
        self._bg_wakeup = threading.Condition(self.lock)
        self._background: set[Request] = set()
        self._bg_parked = False  # the background thread sleeps until a request wakes it
        self._waits = 0  # waits begun by any thread: while they keep coming, the thread looks less often
        self._foreground = 0  # threads inside wait(), each driving progress for everyone
        self._closed = False
        self.wiring = None  # makes channels on first use (transport/wiring.py); None: only add_channel
        self.link_errors: dict[int, BaseException] = {}  # peers that could not be connected, and why
        self._next_liveness = 0.0

    def add_channel(self, peer: int, channel) -> None:
        self.channels[peer] = channel
        self._channel_list = list(self.channels.values())
        self._watch_sockets()

    def planned_kind(self, peer: int) -> str:
        """The channel a pair with `peer` has, or will have once it talks: 'shm' or 'tcp'."""
        channel = self.channels.get(peer)
        if channel is not None and channel.kind != "pending":
            return channel.kind
        return self.wiring.planned_kind(peer) if self.wiring is not None else "tcp"

    @property
    def ring_max(self) -> int:
        """How large this rank's rings may grow (0: no rings; wiring.Wiring.ring_max)."""
        return self.wiring.ring_max if self.wiring is not None else 0

    def channel(self, peer: int):
        """The channel to `peer`, started now if there is none (call under the lock)."""
        channel = self.channels.get(peer)
        if channel is None:
            channel = self._connect(peer)
        return channel

    def _connect(self, peer: int):
        if self.wiring is None:
            raise KeyError(f"rank {self.rank}: no channel to rank {peer}")
        channel = PendingChannel(peer)
        self.add_channel(peer, channel)
        self.wiring.want(peer)
        return channel

    def install(self, peer: int, channel) -> bool:
        """The wiring connected `peer`: `channel` takes the place of its PendingChannel (and what
        was posted to that goes out first, in order). False if the peer is no longer wanted."""
        with self.lock:
            if self._closed or peer in self.lost:
                return False
            pending = self.channels.get(peer)
            self.add_channel(peer, channel)
            try:
                for req, control in getattr(pending, "queue", ()):
                    if not req.done:
                        (channel.post_control if control else channel.post)(req)
                channel.flush()
            except PeerClosed as exc:
                self._peer_lost(peer, str(exc))
        return True

    def peer_unreachable(self, peer: int, reason: str, error: BaseException | None = None) -> None:
        """The wiring could not connect `peer`: lost (`reason`: its process or host is gone, as
        if its connection had closed), or failing with `error` (another secret, a refusal):
        what waits for it fails so. A ResourceError (no descriptor, here or there) fails what
        waits now and leaves the peer to be dialed again by the next message."""
        with self.lock:
            if peer in self.lost or self._closed:
                return
            if error is None:
                self._peer_lost(peer, reason)
                return
            channel = self.channels.get(peer)
            if isinstance(error, ResourceError):
                if channel is not None and channel.kind == "pending":
                    del self.channels[peer]
                    self._channel_list = list(self.channels.values())
            else:
                self.link_errors[peer] = error
                self.lost[peer] = str(error)
            for req in channel.pending() if channel is not None else ():
                req.fail(error)
            for key in [k for k in self.posted if k[0] == peer]:
                for req in self.posted.pop(key):
                    req.fail(error)

    def check_unconnected(self, watch: Iterable[int]) -> None:
        """Every _LIVENESS_S at most: the members of `watch` this rank has no connection to and
        whose process it can see (same machine) that exited are lost (see _LIVENESS_S)."""
        now = time.perf_counter()
        if now < self._next_liveness or self.wiring is None:
            return
        self._next_liveness = now + _LIVENESS_S
        for peer in watch:
            if peer != self.rank and peer not in self.channels and peer not in self.lost:
                why = self.wiring.gone(peer)
                if why:
                    with self.lock:
                        self._peer_lost(peer, why)

    def _watch_sockets(self) -> None:
        """The sockets a sleeping waiter selects on: those of live peers. A lost peer's socket
        stays readable (at EOF) forever and would turn every sleep into a spin: one survivor
        idle for 2 s in a receive woke 71750 times (0.66 s of CPU) instead of 1592 (0.10 s)."""
        self._sockets = [s for c in self._channel_list if c.peer not in self.lost for s in c.sockets]

    # -- posting ----------------------------------------------------------------------------
    def isend(self, peer: int, header: Header, payload: np.ndarray, what: str,
              wire_header: bytes | None = None) -> SendRequest:
        req = SendRequest(peer, header, payload, what, wire_header)
        with self.lock:
            if peer == self.rank:
                self._self_deliver(req)
                return req
            if (self.aborted or self.lost) and self._fail_if_unusable(req):
                return req
            channel = self.channels.get(peer) or self._connect(peer)
            channel.post(req)
            try:
                if header.kind == Kind.P2P:
                    # Sends only: a message read now, before its receive is posted (a sendrecv
                    # posts its send first), would be staged and copied twice. Waiters read.
                    channel.flush()
                else:  # a collective reads too: what arrived is vetted before this call can end
                    channel.progress()
            except PeerClosed as exc:
                self._peer_lost(peer, str(exc))
        return req

    def irecv(self, peer: int, header: Header, dst: np.ndarray, reduce_op: ReduceOp | None,
              what: str, base: np.ndarray | None = None) -> RecvRequest:
        req = RecvRequest(peer, header, dst, reduce_op, what, base)
        with self.lock:
            key = (peer, header.key)
            queue = self.unexpected.get(key)
            error = self.abort_error(header) if self.aborted else None
            if error is not None:
                req.fail(error)
            elif not queue and peer in self.lost:
                # A message that already arrived is delivered even if its sender has left since.
                req.fail(self.lost_error(peer))
            elif queue:
                msg = queue.popleft()
                if not queue:
                    del self.unexpected[key]
                if self._check(req, msg.header):
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
                    # for the background thread to watch (a quarter of a small sendrecv's time
                    # at n=2).
                    try:
                        self.channels[peer].progress()
                    except PeerClosed as exc:
                        self._peer_lost(peer, str(exc))
        return req

    def send_now(self, peer: int, wire_header: bytes, payload: np.ndarray) -> bool:
        """A small point-to-point message written whole into `peer`'s ring now, with no
        request (ShmChannel.put_now): the request and its posting were half a small send's
        time. False: post it the general way (`isend`)."""
        channel = self.channels.get(peer)
        put = getattr(channel, "put_now", None)  # shared-memory channels only
        if put is None or self.aborted or self.lost:
            return False
        with self.lock:
            return self.channels.get(peer) is channel and put(wire_header, payload)

    def recv_now(self, peer: int, header: Header, wire_header: bytes, dst: np.ndarray, spin: bool) -> bool:
        """A point-to-point receive taken straight from `peer`'s ring where its message is the
        next one there and no earlier one waits for it (ShmChannel.take_now), spinning up to
        the waiters' spin time for it to come (`spin`: a blocking receive). Other channels are
        not driven meanwhile; False: receive the general way (`irecv`), which drives them all,
        parks, stages, and notices lost peers and aborts."""
        channel = self.channels.get(peer)
        take = getattr(channel, "take_now", None)
        if take is None:
            return False
        key = (peer, header.key)
        until = 0.0
        while True:
            with self.lock:
                if self.aborted or self.lost or self.posted.get(key) or self.unexpected.get(key) \
                        or self.channels.get(peer) is not channel:
                    return False
                taken = take(wire_header, dst)
            if taken is not None:
                return taken
            if not spin:
                return False
            now = time.perf_counter()
            if not until:  # spin only where no send of this process waits to be pushed meanwhile
                if any(c.queued() for c in self._channel_list):
                    return False
                until = now + self.spin_s
            elif now > until:
                return False

    def _self_deliver(self, req: SendRequest) -> None:
        """A message to oneself goes straight through matching, never through a channel."""
        sink = self.match(self.rank, req.header)
        if sink.nbytes:
            sink.write(req.payload)
        sink.finish()
        req.sent = req.payload.nbytes
        req.done = True

    def abort_error(self, header: Header) -> BaseException | None:
        """The abort that covers this message: its group failed at or before its call
        (point-to-point messages belong to no call: any abort of the group covers them)."""
        entry = self.aborted.get(header.ctx)
        if entry is None or (header.kind == Kind.COLL and header.seq < entry[0]):
            return None
        return entry[1]

    def _fail_if_unusable(self, req: Request) -> bool:
        error = self.abort_error(req.header)
        if error is not None:
            req.fail(error)
        elif req.peer in self.lost:
            req.fail(self.lost_error(req.peer))
        return req.done

    # -- matching (called by channels when a header arrives) --------------------------------
    def match(self, peer: int, header: Header, remote: bool = False) -> Sink:
        """The sink for an arriving message: its posted receive, else a new unexpected one
        (`remote`: its payload stays in the sender's memory until a receive takes it)."""
        if header.kind > _LAST_DATA_KIND:
            return self._control(peer, header)
        if self.retired and header.ctx in self.retired:
            return Discard(header.nbytes)  # a shrunk group's traffic, still in flight
        key = (peer, header.key)
        queue = self.posted.get(key)
        if queue:
            req = queue.popleft()
            if not queue:
                del self.posted[key]
            if self._check(req, header):
                return req
            return Discard(header.nbytes)
        msg = Unexpected(header, remote)
        if not remote:
            self.staged_bytes += header.nbytes
        self.unexpected.setdefault(key, deque()).append(msg)
        if header.kind == Kind.COLL:
            call = self.current.get(header.ctx)
            if call is not None and header.seq <= call.seq:
                self._vet(peer, header, call)
        return msg

    def may_park(self, peer: int, header: Header) -> bool:
        """May a large message from `peer` wait in its ring for its receive (shm.PARK_BYTES)?
        Not if its receive is posted, nor a collective's message for an earlier call (vetted
        now: that call differed), nor while a receive from that peer for another message would
        wait behind it. A waiter idle for _RELEASE_PARKED_S releases it anyway
        (`release_parked`): a rank waiting on a third one, or two ranks that both send before
        they receive, cannot wait on a parked message forever."""
        if self.posted.get((peer, header.key)) or (self.retired and header.ctx in self.retired):
            return False
        if header.kind == Kind.COLL:
            call = self.current.get(header.ctx)
            if call is not None and header.seq < call.seq:
                return False
        return not any(p == peer for p, _ in self.posted)

    def release_parked(self) -> None:
        """Stage every parked message (and vet it), and every unexpected one still in its
        sender's memory, whose sender waits for it: called by waiters idle for _RELEASE_PARKED_S."""
        with self.lock:
            for channel in self._channel_list:
                if getattr(channel, "parked", None) is not None:
                    channel.release = True
            for queue in self.unexpected.values():
                for msg in queue:
                    self.staged_bytes += msg.stage()
            self.progress()

    def _control(self, peer: int, header: Header) -> Sink:
        if header.kind == Kind.ABORT:
            return ControlSink(header.nbytes, lambda raw: self._on_abort(peer, header.ctx, header.seq, raw))
        if header.kind == Kind.BYE:
            return ControlSink(0, lambda raw: self.departed.add(peer))
        if header.kind == Kind.QUERY:
            return ControlSink(0, lambda raw: self._answer_query(peer, header.ctx))
        if header.kind == Kind.STATE:
            return ControlSink(0, lambda raw: self._on_state(peer, header))
        raise ValueError(f"rank {self.rank}: unknown message kind {header.kind} from rank {peer}")

    def _vet(self, peer: int, header: Header, call) -> None:
        """A message for the call this rank is in must carry its fingerprint, whatever its step;
        one for an earlier call arrived after this rank finished it, so that call differed.

        The abort then starts at that earlier call: its sender may still be in it, waiting for
        this rank to take the rest (a 4 MiB broadcast to a rank that thought itself the root,
        over TCP with send buffers smaller than the message), and an abort of the later calls
        only would leave it to time out."""
        if header.seq == call.seq:
            if header.fp == call.fp or not differences(call.fp, header.fp, _dtype_label, _op_label):
                return
            error = self.mismatch_error(call.what, call.fp, header.fp, peer)
        else:
            error = CollectiveMismatchError(
                f"rank {self.rank}: rank {peer} sent data for call #{header.seq} on group "
                f"{call.group.name} ({coll_label(header.fp.coll)}) that this rank finished without "
                f"needing it: the ranks called different collectives or roots there (this rank is now "
                f"at {call.what})")
        self.deferred_aborts.append((header.ctx, header.seq, tuple(call.group.ranks), error))

    def query_peers(self, ctx: int, members: Iterable[int]) -> None:
        """Ask the members which call of group `ctx` they are in; the answers are vetted like
        arriving messages. This catches disagreements in which no message ever crosses (a
        reduce to different roots), so they end as a mismatch instead of a timeout."""
        with self.lock:
            for peer in members:
                if peer != self.rank and peer not in self.lost and peer in self.channels:
                    header = Header(Kind.QUERY, ctx, 0, 0, 0, Fingerprint(0))
                    self.channels[peer].post_control(SendRequest(peer, header, _EMPTY, "query"))

    def _answer_query(self, peer: int, ctx: int) -> None:
        call = self.current.get(ctx)
        seq, fp = (call.seq, call.fp) if call is not None else (0, Fingerprint(0))
        self.channels[peer].post_control(SendRequest(peer, Header(Kind.STATE, ctx, seq, 0, 0, fp), _EMPTY,
                                                     "state"))

    def _note_state(self, ctx: int, peer: int, seq: int) -> None:
        """What a peer said (or showed, by an abort) it runs of group `ctx`, for missing():
        only answers to a question just asked matter, so the notes are dropped when many."""
        if len(self.states) >= _STATES_MAX:
            self.states.clear()
        self.states[(ctx, peer)] = max(seq, self.states.get((ctx, peer), 0))

    def _on_state(self, peer: int, header: Header) -> None:
        self._note_state(header.ctx, peer, header.seq)
        call = self.current.get(header.ctx)
        if call is not None and header.seq == call.seq:
            self._vet(peer, header, call)

    def adapt_to_machine(self, machine_ranks: int, index: int, bind: bool) -> None:
        """Wait, and sit, as the ranks that share this machine's cores need. The ranks are
        those that share its cores, whatever host name each has (the emulated hosts of the
        multi-host test bed share one kernel: topo.machine_id); `index` is this rank's
        among them (negative: unknown).

        With more ranks than cores, a spinning waiter only keeps the rank it waits for off
        the CPU: waiters yield at once instead (unless TENSORWIRE_SPIN_US says). With `bind`
        (TENSORWIRE_BIND=1, as MPI's --bind-to core) such a rank is also bound to one core,
        round robin by `index`, which puts ring neighbours on different cores (they beat
        neighbours on one core by 1.3-1.6x). A trade, hence off by default: at n=4 on 2 cores
        (4 launches each way, alternated, 2026-11-26) bound ranks ran the ring shift
        (sendrecv) at 0.72-0.89x the unbound time from 8 B to 128 KiB, but the one-shot
        alltoall and reduce_scatter at 1.11-1.25x up to 128 KiB, the barrier at 1.15x and
        sendrecvs of 2-32 MiB at 1.12-1.31x. Threads that exist already (torch's pools, if
        made before init) keep their placement; close() gives the cores back."""
        usable = sorted(os.sched_getaffinity(0))
        self.cores = cores = len(usable)
        self.oversubscribed = machine_ranks > cores
        if self.oversubscribed and not self._spin_fixed:
            self.spin_s = 0.0
        waiting = ("oversubscribed, waiters yield at once instead of spinning" if self.oversubscribed
                   else f"waiters spin up to {self.spin_s * 1e6:g} us before yielding")
        if self.oversubscribed and cores > 1 and bind:
            if index < 0:
                waiting += "; not bound to a core (this rank's index on the machine is unknown)"
            else:
                core = usable[index % cores]
                try:
                    os.sched_setaffinity(0, {core})
                    self._unbound = set(usable)
                    waiting += f"; bound to core {core} (TENSORWIRE_BIND)"
                except OSError as exc:
                    waiting += f"; could not bind to core {core} ({exc})"
        _init_log.info("rank %d: %d rank(s) on this machine, %d usable cores: %s",
                       self.rank, machine_ranks, cores, waiting)

    def enter_call(self, ctx: int, call) -> bool:
        """Note the call a group is running, and vet what already arrived for it or before it;
        False if there was nothing to vet (so nothing can have aborted the group here)."""
        self.current[ctx] = call
        if not self.unexpected and not self.deferred_aborts:
            return False  # the common case, without the lock: what arrives next is vetted on arrival
        with self.lock:
            for (peer, key), queue in list(self.unexpected.items()):
                if key[0] == ctx and key[1] == Kind.COLL and key[2] <= call.seq and queue:
                    self._vet(peer, queue[0].header, call)
            self._rundeferred_aborts()
        return True

    def _rundeferred_aborts(self) -> None:
        while self.deferred_aborts:
            ctx, seq, members, error = self.deferred_aborts.pop(0)
            self.abort_group(ctx, seq, members, error)

    def _check(self, req: RecvRequest, got: Header) -> bool:
        """Fingerprint and size of an arriving message against the posted receive."""
        want = req.header
        if want.fp != got.fp and differences(want.fp, got.fp, _dtype_label, _op_label):
            req.fail(self.mismatch_error(req.what, want.fp, got.fp, req.peer))
            return False
        if got.nbytes != want.nbytes:
            req.fail(CollectiveMismatchError(
                f"rank {self.rank}: {req.what}: rank {req.peer} sent {got.nbytes} bytes where this rank "
                f"expected {want.nbytes} (message sizes differ: check counts and dtypes on every rank)"))
            return False
        return True

    def mismatch_error(self, what: object, mine: Fingerprint, theirs: Fingerprint,
                       peer: int) -> CollectiveMismatchError:
        diffs = differences(mine, theirs, _dtype_label, _op_label)
        return CollectiveMismatchError(
            f"rank {self.rank}: {what}: rank {peer} made a different call at the same point: "
            f"{'; '.join(diffs)} (this rank vs rank {peer})")

    # -- failures ---------------------------------------------------------------------------
    def arrived_from(self, ctx: int, tag: int, peers: Iterable[int]) -> int | None:
        """The first of `peers` whose point-to-point message with `tag` on group `ctx` has
        arrived (after one round of progress), or None; raises if the group was aborted or
        every one of them is gone (MPI_ANY_SOURCE's probe)."""
        key = (ctx, int(Kind.P2P), 0, int(tag))
        with self.lock:
            self.progress()
            for peer in peers:
                if self.unexpected.get((peer, key)):
                    return peer
                parked = getattr(self.channels.get(peer), "parked", None)  # arrived, left in its ring
                if parked is not None and parked.key == key:
                    return peer
            entry = self.aborted.get(ctx)
            if entry is not None:
                raise entry[1]
            if all(peer in self.lost for peer in peers):
                raise PeerLostError(f"rank {self.rank}: receive from any rank (tag {tag}): every "
                                    f"sender is gone")
        return None

    def lost_error(self, peer: int) -> BaseException:
        error = self.link_errors.get(peer)
        if error is not None:
            return error
        return PeerLostError(f"rank {self.rank}: lost rank {peer}: {self.lost[peer]}", peer=peer)

    def _peer_lost(self, peer: int, reason: str) -> None:
        """The peer's socket closed. After a goodbye that is an orderly exit: what it sent before
        is still delivered, and only requests that need more of it fail. Without one it crashed,
        which dooms every group it belongs to (see check_group)."""
        if peer in self.lost or self._closed:
            return
        channel = self.channels.get(peer)
        if peer not in self.departed:
            self._read_goodbye(channel)
        if peer in self.departed:
            reason = f"{LEFT} (called destroy() or exited) before this exchange finished"
            self._drain(channel)
        else:
            self.crashed.add(peer)
            _log.warning("lost rank %d: %s", peer, reason)
        self.lost[peer] = reason
        self._watch_sockets()
        err = self.lost_error(peer)
        if channel is not None:
            for req in channel.pending():
                req.fail(err)
        for key in [k for k in self.posted if k[0] == peer]:  # nothing more can match them
            for req in self.posted.pop(key):
                req.fail(err)

    def missing(self, error: BaseException, ctx: int, seq: int, members: Iterable[int]) -> BaseException:
        """`error`, a timeout of call `seq` of group `ctx`, saying which members are not in the
        call: this rank asks the members it is connected to which call they run (their answers
        within _ASK_S; one that does not answer is not inside tensorwire: busy, blocked or
        stopped). Where every one asked is in the call too, this rank only waited for ranks
        that wait themselves, and for up to _MISSING_S it raises the abort of a rank that
        could say who is missing. A rank of 64 (16 emulated hosts x 4) that slept through an
        all_reduce: all 63 others timed out after 5 s, naming 13 different ranks they waited
        for; the sleeper was named by the few that waited for it directly."""
        if _NOT_IN in str(error) or _REPORTED in str(error):
            return error
        with self.lock:
            asked = [p for p in members if p != self.rank and p not in self.lost
                     and getattr(self.channels.get(p), "kind", "pending") != "pending"]
            for p in asked:
                self.states.pop((ctx, p), None)
            self.query_peers(ctx, asked)
        until = time.perf_counter() + _ASK_S
        while any((ctx, p) not in self.states for p in asked) and time.perf_counter() < until:
            self._look()
        # a member that left meanwhile, or sent an abort of this call, was in it and failed
        behind = [(p, self.states.get((ctx, p))) for p in asked
                  if p not in self.lost and self.states.get((ctx, p), -1) < seq]
        if behind:
            text = "; ".join(f"rank {p} did not answer (not inside a tensorwire call: busy, blocked or "
                             "stopped)" if at is None else f"rank {p} is at call #{at} of the group"
                             for p, at in behind)
            return retold(error, f"{error} {_NOT_IN}: {text}.")
        return self._abort_saying(ctx, seq, _MISSING_S, lambda why: _NOT_IN in why) or error

    def _look(self) -> None:
        """One round of progress with the sockets read (control messages: answers, aborts,
        goodbyes), then a short sleep: the error paths' waits for what other ranks say."""
        with self.lock:
            self.progress()
            self._poll_sockets()
        time.sleep(_SLEEP_MAX_S)

    def why_left(self, error: PeerLostError, ctx: int, seq: int) -> BaseException:
        """Why a peer that left in the middle of call `seq` of group `ctx` left, where this rank
        can learn it within _WHY_LEFT_S: such a peer mostly left because the call failed there,
        and the abort that says why (a mismatch, a bad argument, a crash elsewhere) is on its way
        to every member, behind the goodbye on some sockets and ahead of it on others. `error`
        where no other reason comes (a departure other ranks report is none). 64 ranks on 16
        emulated hosts, one calling broadcast against everyone's all_reduce of 4 MB, each
        exiting as it raised: 56 of 64 said only that some rank had left the job."""
        if LEFT not in str(error):
            return error
        return self._abort_saying(ctx, seq, _WHY_LEFT_S, lambda why: LEFT not in why) or error

    def _abort_saying(self, ctx: int, seq: int, seconds: float,
                      says: Callable[[str], bool]) -> BaseException | None:
        """The abort of call `seq` of group `ctx` whose message `says` what is wanted, once it
        arrives within `seconds` (None if none does)."""
        until = time.perf_counter() + seconds
        while True:
            self._look()
            entry = self.aborted.get(ctx)
            if entry is not None and seq >= entry[0] and says(str(entry[1])):
                return entry[1]
            if time.perf_counter() >= until:
                return None

    def _read_goodbye(self, channel) -> None:
        """Read what a closed socket still holds, its peer's goodbye among it: a send to a peer
        that has just left fails before the goodbye waiting behind it is read (a channel pushes,
        then pulls), and would make the peer's orderly exit a crash. 16 x 4 emulated hosts:
        a rank's query to a host peer that had finished its last call and left failed that
        rank's call (`lost rank 40: send failed: [Errno 32] Broken pipe`), and with it the job."""
        for stream in getattr(channel, "streams", None) or [getattr(channel, "stream", None)]:
            try:
                while stream is not None and stream.pull():
                    pass
            except PeerClosed:
                pass

    def _drain(self, channel) -> None:
        """Deliver whatever a departed peer left in its shared-memory ring."""
        try:
            while channel is not None and channel.progress():
                pass
        except PeerClosed:
            pass

    def abort_group(self, ctx: int, seq: int, members: Iterable[int], error: BaseException) -> None:
        """Fail call `seq` of a group and every later one, here and on every member.

        Earlier calls are left alone: a slower member may still be finishing them, and their
        messages may arrive after the abort, which travels on the control path.

        Over TCP a notice queues behind what is left of the failed call's sends (the stream
        must stay framed), and the raise returns control to a caller that may not call again
        for a while: the background thread delivers what the kernel did not take at once. With
        256 KiB send buffers, a 4 MiB broadcast whose ranks disagreed on the root left its
        notice behind 70-340 KB of payload: the tcp3 broadcast-root cases of test_errors timed
        out in 13 of 15 runs, in 3 with this delivery, in none with _vet's abort from the call
        that differed."""
        with self.lock:
            if not self.fail_locally(ctx, seq, error):
                return
            text = f"{type(error).__name__}\n{error}".encode()
            payload = np.frombuffer(text, dtype=np.uint8)
            notices = []
            for peer in members:  # connecting where needed: a member may wait for no one it is connected to
                unreachable = self.wiring is None and peer not in self.channels
                if peer == self.rank or peer in self.lost or unreachable:
                    continue
                header = Header(Kind.ABORT, ctx, seq, 0, len(payload), Fingerprint(0))
                notices.append(SendRequest(peer, header, payload, "abort"))
                self.channel(peer).post_control(notices[-1])
            self._poll_sockets()
            self._notices = [n for n in self._notices if not n.done] + notices
            for notice in notices:
                self.watch_in_background(notice)

    def _on_abort(self, peer: int, ctx: int, seq: int, raw: bytes) -> None:
        self._note_state(ctx, peer, seq)  # it ran call seq
        name, _, message = raw.decode(errors="replace").partition("\n")
        if ctx in self.aborted:
            return
        cls = _ERROR_CLASSES.get(name, AbortedError)
        self.fail_locally(ctx, seq, cls(f"{message} {_REPORTED} {peer}; seen on rank {self.rank}]"))

    def fail_locally(self, ctx: int, seq: int, error: BaseException) -> bool:
        """Fail call `seq` of a group and every later one on this rank only, and every call of
        its children (the sub-groups a hierarchical algorithm runs its phases on: a rank may
        wait in one of them while the abort comes for the group); False if the group had
        already failed."""
        with self.lock:
            if ctx in self.aborted:
                return False
            self.aborted[ctx] = (seq, error)
            self._fail_ctx(ctx, seq, error)
            for child in self.children.get(ctx, ()):
                self.fail_locally(child, 0, error)
            return True

    def _fail_ctx(self, ctx: int, seq: int, err: BaseException) -> None:
        def covered(header: Header) -> bool:
            return header.ctx == ctx and (header.kind == Kind.P2P or
                                          (header.kind == Kind.COLL and header.seq >= seq))

        for queue in list(self.posted.values()):
            for req in queue:
                if covered(req.header):
                    req.fail(err)
        for channel in self._channel_list:
            for req in channel.pending():
                if covered(req.header):
                    req.fail(err)

    def retire(self, ctx: int, error: BaseException) -> None:
        """Forget a group that will never run again (it was shrunk): fail what is still posted
        for it, drop what arrived for it (releasing senders whose payload waits in their own
        memory) and every later arrival. Its entry in `aborted` stays, so calls on it still
        raise. Without this, a failed call's messages from the survivors (megabytes, staged)
        stayed queued forever and kept every later call off the planned fast path, which
        runs only while nothing unexpected is queued."""
        with self.lock:
            self.retired.add(ctx)
            for child in self.children.pop(ctx, ()):  # a hierarchy's groups go with it
                self.retire(child, error)
            self.current.pop(ctx, None)
            self.deferred_aborts = [d for d in self.deferred_aborts if d[0] != ctx]
            for key in [k for k in self.posted if k[1][0] == ctx]:
                for req in self.posted.pop(key):
                    req.fail(error)
            for key in [k for k in self.unexpected if k[1][0] == ctx]:
                for msg in self.unexpected.pop(key):
                    if msg.source is not None and key[0] not in self.lost:
                        msg.source.discard()

    def poll_peers(self) -> None:
        """One round of progress and a look at every socket: a peer that died is known now."""
        with self.lock:
            self.progress()
            self._poll_sockets()

    # -- progress ---------------------------------------------------------------------------
    def progress(self) -> bool:
        """One pass over every channel; True if any byte moved."""
        moved = False
        for channel in self._channel_list:
            if channel.peer in self.lost:
                continue
            try:
                if channel.progress():
                    moved = True
            except PeerClosed as exc:
                self._peer_lost(channel.peer, str(exc))
        self._tick += 1
        if self._tick & 255 == 0:
            self._poll_sockets()
        if self.deferred_aborts:  # found inside a channel's read: act on it outside of it
            self._rundeferred_aborts()
        return moved

    def _poll_sockets(self) -> None:
        for channel in self._channel_list:
            if channel.peer in self.lost:
                continue
            try:
                channel.poll_socket()
            except PeerClosed as exc:
                self._peer_lost(channel.peer, str(exc))

    def wait(self, reqs: Sequence[Request], *, deadline: float, ctx: int, seq: int, watch: Iterable[int],
             what: object, cross_check: Callable[[], None] | None = None) -> None:
        """Drive progress until every request is done; raise the first failure.

        `watch` are the world ranks whose loss dooms this wait (the group's members): a
        collective cannot finish once any member is gone, even if we wait on someone else.
        `cross_check` runs when idle, to spot peers that entered this call another way.
        """
        pending = [r for r in reqs if not r.done]
        if pending:  # else all finished as they were posted (a small send into a ring)
            self._drive(pending, deadline, ctx, seq, watch, what, cross_check)
        for r in reqs:
            if r.error is not None:
                raise r.error

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

    def check_group(self, ctx: int, seq: int, watch: Iterable[int]) -> None:
        """Raise if the group was aborted or one of its members crashed.

        A member that left in order is not fatal by itself: it may have finished its part of
        the call; if it had not, the request waiting on it fails instead."""
        entry = self.aborted.get(ctx)
        if entry is not None and seq >= entry[0]:
            raise entry[1]
        if self.crashed:
            for peer in watch:
                if peer in self.crashed:
                    raise self.lost_error(peer)

    def sleep_on_sockets(self, seconds: float) -> None:
        """Sleep until a socket is readable (data, a control message, a closed peer) or `seconds`."""
        with self.lock:
            self._poll_sockets()
        try:
            select.select(self._sockets, [], [], seconds)
        except (OSError, ValueError):
            time.sleep(seconds)
        with self.lock:
            self._poll_sockets()

    def _timeout(self, pending: Sequence[Request], what: object) -> TimeoutError:
        waits = sorted({r.peer for r in pending})
        detail = "; ".join(f"rank {r.peer}: {r.progress_text()}" for r in pending[:4])
        return TimeoutError(
            f"rank {self.rank}: {what} timed out waiting for rank(s) {', '.join(map(str, waits))} "
            f"({detail}). The peer is stuck, slower than the timeout, or never called this operation.")

    # -- background progress for user isend/irecv --------------------------------------------
    def watch_in_background(self, req: Request) -> None:
        """Keep `req` progressing while nobody waits on it (async point-to-point).

        The thread is woken only from its long sleep: while requests keep coming it looks for
        them every _BG_GRACE_S by itself. Waking it per request cost a small receive about 8 us
        (a futex wake, then the thread taking the GIL and, at 2 ranks on 2 cores, the peer's core)."""
        if req.done:
            return
        with self.lock:
            background = self._background
            background.add(req)
            if len(background) > _BG_PRUNE:
                self._background = {r for r in background if not r.done}
            if self._bg is None:
                self._bg = threading.Thread(target=self._background_loop, name="tensorwire-progress",
                                            daemon=True)
                self._bg.start()
            elif self._bg_parked:
                self._bg_wakeup.notify()

    def _background_loop(self) -> None:
        """Drive progress for requests nobody has waited on for _BG_GRACE_S. Most isend/irecv
        are waited on at once, and the waiter drives everything itself: a thread woken for each
        of them would only take the GIL, and on a busy host a core, from the ranks. While waits
        keep coming it looks ever less often (up to _BG_LOOK_MAX_S): each look takes the GIL
        from a spinning waiter, and half the sendrecv calls over 50 us at n=2 were such looks."""
        quiet_since = None  # when pending requests were first seen without a waiter
        stalled_since = None  # when its own progress last stopped moving anything
        period = _BG_GRACE_S
        seen = -1
        idle_since = time.perf_counter()
        while True:
            with self.lock:
                self._background = {r for r in self._background if not r.done}
                if self._closed:
                    return
                now = time.perf_counter()
                busy = self._waits != seen or self._foreground
                seen = self._waits
                period = min(2 * period, _BG_LOOK_MAX_S) if busy else _BG_GRACE_S
                if not self._background:
                    quiet_since = None
                    if now - idle_since < _BG_PARK_S:
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
                elif now - stalled_since >= _RELEASE_PARKED_S:  # as an idle waiter does: sends
                    stalled_since = None  # that wait for each other, with nobody waiting here
                    self.release_parked()
            if not moved:
                try:
                    select.select(self._sockets, [], [], 200e-6)
                except (OSError, ValueError):
                    time.sleep(200e-6)

    # -- shutdown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Say goodbye to every peer (best effort, never blocking), then close the channels;
        first, for up to _NOTICES_S, deliver the aborts this rank sent: a rank that raised a
        mismatch and exited at once had left most of its notices unsent (those to peers it was
        not connected to yet, or queued behind the failed call's bytes), and the others then
        learnt only that it had left (64 ranks on 16 emulated hosts: 54 of 64)."""
        until = time.perf_counter() + _NOTICES_S
        while any(not n.done for n in self._notices) and time.perf_counter() < until:
            self._look()
        if self.wiring is not None:
            self.wiring.close()  # no channel is installed after this
        with self.lock:
            self._closed = True
            self._bg_wakeup.notify_all()  # a parked thread or one between looks: both see _closed
            empty = np.empty(0, dtype=np.uint8)
            for channel in self._channel_list:
                if channel.peer not in self.lost and channel.kind != "pending":
                    try:
                        channel.flush()  # acknowledgements a peer's send may wait for
                    except PeerClosed:
                        pass
                    bye = Header(Kind.BYE, 0, 0, 0, 0, Fingerprint(0))
                    channel.post_control(SendRequest(channel.peer, bye, empty, "goodbye"))
                    try:
                        channel.poll_socket()
                    except PeerClosed:
                        pass
            for channel in self._channel_list:
                channel.close()
            self.channels.clear()
            self._channel_list = []
            self._sockets = []
        if self._unbound is not None:  # a runtime made after this one counts the cores afresh
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self._unbound)
            self._unbound = None


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
        if idle < self.spin_s + _YIELD_S:
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
        if not self.released and idle >= _RELEASE_PARKED_S:
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
