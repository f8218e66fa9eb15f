"""The engine's failure half: lost peers, aborted groups, and calls that differ between ranks.

A peer is lost when its connection closes: after its goodbye that is an orderly exit, without
one a crash that dooms every group it belongs to. A host that dies silently (no reset ever
comes) fails its connections within TENSORWIRE_PEER_TIMEOUT (tcp.tune_socket): a crash too.
A call that fails on one rank is aborted on every member through control messages
(transport/agreement.py agrees on who failed, for shrink). Each arriving collective message is
vetted against the call this rank runs, so ranks that called different things fail with a
mismatch instead of waiting for a timeout.
"""

from __future__ import annotations

import errno
import heapq
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from .. import log
from ..errors import (
    AbortedError,
    CollectiveMismatchError,
    InvalidArgumentError,
    PeerLostError,
    Relayed,
    ResourceError,
    TensorwireError,
    TimeoutError,
    retold,
)
from .channel import Channel, PeerClosed
from .requests import P2P_SEQ, ControlSink, RecvRequest, Request, SendRequest, Sink, Unexpected
from .wire import BYE_NOTE_BYTES, Fingerprint, Header, Kind, coll_label, differences

if TYPE_CHECKING:
    from .wiring import Wiring

_log = log.get("TRANSPORT")
_LOOK_S = 0.001  # the error paths' pause between looks at what other ranks say
_EMPTY = np.empty(0, dtype=np.uint8)
_ERROR_CLASSES = {cls.__name__: cls for cls in (CollectiveMismatchError, PeerLostError, TimeoutError,
                                                AbortedError, InvalidArgumentError, ResourceError,
                                                TensorwireError)}


_LIVENESS_S = 0.2
"""How often an idle waiter looks whether peers it has no connection to are still alive (their
processes, where they run on this machine): a rank that died before anyone talked to it fails
the calls that wait for it within this, not at their timeout."""

_CRASH_GRACE_S = 1.0
"""How long a call goes on after a member crashed that it does not wait for: that member may
have finished its part (it exited right after), and a member that waits for it fails at once
and aborts the group; past this the call fails here too (that member may not know yet)."""
_PEER_SILENT = "its host{} stopped answering for TENSORWIRE_PEER_TIMEOUT={:g} s (down or cut off: {})"


def unanswered_ms(sock: socket.socket) -> int:
    """How long `sock`'s peer has not acknowledged anything while this end waits for it to
    (data in flight, or probes unanswered), in ms, from TCP_INFO; 0 where it waits for nothing.

    A live peer that does not read (its receive window closed) answers window probes from its
    kernel, which rate-limits those answers: one unanswered probe is no sign, two are
    (docs/design/shrink.md)."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return 0
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 64)
    except OSError:
        return 0
    probes = raw[3]  # struct tcp_info: tcpi_probes; tcpi_unacked at 24, tcpi_last_ack_recv at 56
    unacked = int.from_bytes(raw[24:28], sys.byteorder)
    return int.from_bytes(raw[56:60], sys.byteorder) if unacked or probes >= 2 else 0


LEFT = "it left the job"
"""What a departed peer's PeerLostError says (also as other ranks report it)."""
_LEFT_DATA_S = 2.0  # how long the last bytes exchanged with a departed peer may take to settle
_WHY_LEFT_S = 1.0  # how long a call that lost a departed peer looks for the reason it left
_ASK_S, _MISSING_S = 0.5, 1.0  # a timed-out call's wait for the members' answers, then for another's abort
_NOT_IN = "Not in this call"
_IN_P2P = 1  # a STATE answer's tag: the replier waits in a point-to-point call
_STATES_MAX = 4096
_REPORTED = "[reported by rank"
_DATA = (Kind.P2P, Kind.COLL)  # the messages an abort fails
REFUSAL, RENEWED, DESTROYED, DESTROYED_ALL_SENT = 1, 2, 3, 4
"""An ABORT header's tags: a refusal (one call failed on every member, the group lives on), an
abort because a member refused a call this rank ran (the group renews itself at its next
call: group/renewal.py), and a member's destroy() of the group (`tell_destroyed`), with
(DESTROYED) or without (DESTROYED_ALL_SENT) point-to-point messages of it still on their way."""


def notice_text(error: BaseException) -> bytes:
    """What an abort notice carries of `error` (Failures._reported reads it): 'Name\nmessage',
    or 'Name@origin\nmessage' for an error passed on as rank `origin` reported it, so that it
    names its first reporter once."""
    relayed = error.relayed if isinstance(error, TensorwireError) else None
    if relayed is not None and relayed.text == str(error):
        return f"{type(error).__name__}@{relayed.origin}\n{relayed.message}".encode()
    return f"{type(error).__name__}\n{error}".encode()


_NO_HEAP: list[tuple[int, int, tuple]] = []  # a group with nothing to vet (never pushed to: see enter_call)


class Failures:
    """What the engine knows and does about failures; the engine (engine.Engine) derives from it
    and provides the channels, the matching queues, and progress (`progress`, `poll_sockets`,
    `poll_peers`, `watch_sockets`, `channel`, `watch_in_background`)."""

    rank: int
    lock: threading.RLock
    channels: dict[int, Channel]
    channel_list: list[Channel]
    posted: dict[tuple, deque[RecvRequest]]
    unexpected: dict[tuple, deque[Unexpected]]
    wiring: Wiring | None
    closed: bool

    if TYPE_CHECKING:  # provided by engine.Engine
        def channel(self, peer: int) -> Channel: ...
        def watch_sockets(self) -> None: ...
        def poll_sockets(self) -> None: ...
        def poll_peers(self) -> None: ...
        def progress(self) -> bool: ...
        def watch_in_background(self, req: Request) -> None: ...

    def __init__(self) -> None:
        self.lost: dict[int, str] = {}  # peers we can no longer talk to, and why
        self.crashed: dict[int, float] = {}  # ...of which those that vanished without a goodbye: when seen
        self.departed: set[int] = set()  # peers that said goodbye (their channel is still drained)
        self.goodbye_notes: dict[int, str] = {}  # what their goodbyes said (the ranks they had lost)
        self.link_errors: dict[int, BaseException] = {}  # peers that could not be connected, and why
        self.current: dict[int, Callable[[], object]] = {}
        """ctx -> the collective call the group is running, weakly (its group's queue holds it):
        a group nothing else refers to is collected, and its shared segment with it."""
        self.states: dict[tuple[int, int], int] = {}  # (ctx, peer) -> the call it said it runs (missing())
        self.in_p2p: set[tuple[int, int]] = set()  # (ctx, peer): it said it waits in a point-to-point call
        self.p2p_waits: dict[int, int] = {}  # ctx -> threads waiting in its point-to-point calls (p2p.py)
        self.unvetted: dict[int, list[tuple[int, int, tuple]]] = {}
        """ctx -> a heap of (seq, peer, key) of the collective messages queued unexpected (some
        since taken): entering a call vets those for it or before it without a scan of the rest,
        which a peer running ahead (a reduce's leaf) makes long."""
        self.deferred_aborts: list[tuple] = []
        self.notices: list[SendRequest] = []  # the aborts this rank sent (close() delivers them)
        self.aborted: dict[int, tuple[int, BaseException]] = {}  # ctx -> (first failing call, why)
        self.renewable: set[int] = set()  # aborted groups that renew at their next call (RENEWED)
        self.children: dict[int, list[int]] = {}  # ctx -> the groups that fail with it (a hierarchy's)
        self.alarms: dict[int, Callable[[int | None], None]] = {}
        """ctx -> told when the group fails (None) or any rank is lost (its rank): GPU kernels that
        wait for peers with no host in the loop stop waiting (gpu/device_flags.py)."""
        self.retired: set[int] = set()  # contexts never used again (shrunk groups): arrivals dropped
        self.destroyed: dict[int, tuple[int, BaseException]] = {}
        """ctx -> (the first call a member that destroyed the group never makes, what that call
        raises here): told by that member (`tell_destroyed`), dropped as this rank retires it."""
        self.p2p_ended: dict[tuple[int, int], BaseException] = {}
        """(ctx, member) -> what a point-to-point receive from that member on the group raises: it
        destroyed the group with nothing of it left to send here (`_end_p2p`)."""
        self._ending_p2p: list[tuple[int, int, BaseException]] = []  # told while reading: _end_p2p
        self.refusals: dict[int, dict[int, dict[int, BaseException]]] = {}
        """ctx -> call -> {world rank: why}: the members that refused that call of the group (a local
        argument error, before they sent anything), this rank among them or not (`refuse`)."""
        self._next_liveness = 0.0
        self._silent: dict[int, float] = {}  # peer -> when check_silent first saw it unanswering

    # -- lost peers ---------------------------------------------------------------------------
    def lost_error(self, peer: int) -> BaseException:
        error = self.link_errors.get(peer)
        if error is not None:
            return error
        return PeerLostError(f"rank {self.rank}: lost rank {peer}: {self.lost[peer]}", peer=peer)

    def peer_lost(self, peer: int, reason: str) -> None:
        """The peer's socket closed. After a goodbye that is an orderly exit: what it sent before
        is still delivered, and only requests that need more of it fail. Without one it crashed,
        which dooms every group it belongs to (see check_group)."""
        if peer in self.lost or self.closed:
            return
        channel = self.channels.get(peer)
        if peer not in self.departed:
            self._read_goodbye(channel)
        if peer in self.departed:
            note = self.goodbye_notes.get(peer)
            reason = f"{LEFT} (called destroy() or exited) before this exchange finished" + \
                (f"; {note}" if note else "")
            until = time.perf_counter() + _LEFT_DATA_S
            for stream in channel.streams if channel is not None else ():
                stream.finish_with_departed(until)  # its last message's parts on the other streams
            self._drain(channel)
        else:
            if f"[Errno {errno.ETIMEDOUT}]" in reason and self.wiring is not None:  # keepalive (tune_socket)
                reason = self._host_silent(peer, reason)
            self.crashed[peer] = time.perf_counter()
            _log.warning("lost rank %d: %s", peer, reason)
        self.lost[peer] = reason
        self.watch_sockets()
        for alarm in list(self.alarms.values()):
            alarm(peer)
        err = self.lost_error(peer)
        if channel is not None:
            for stream in channel.streams:
                stream.stop_pumps()
            for req in channel.pending():
                req.fail(err)
        for key in [k for k in self.posted if k[0] == peer]:  # nothing more can match them
            for recv in self.posted.pop(key):
                recv.fail(err)

    def goodbye_note(self) -> np.ndarray:
        """What this rank's goodbye tells its peers: the ranks it had lost without a goodbye,
        and why, so that a peer that loses this one for leaving can name the rank really gone."""
        gone = [f"rank {p} ({self.lost[p]})" for p in sorted(self.crashed) if p in self.lost]
        text = f"it had lost {', '.join(gone)}" if gone else ""
        return np.frombuffer(text.encode()[:BYE_NOTE_BYTES], np.uint8)

    def _on_goodbye(self, peer: int, raw: bytes) -> None:
        self.departed.add(peer)
        if raw:
            self.goodbye_notes[peer] = bytes(raw).decode(errors="replace")

    def _read_goodbye(self, channel: Channel | None) -> None:
        """Read what a closed socket still holds, its peer's goodbye among it: a send to a peer
        that has just left fails before the goodbye waiting behind it is read (a channel pushes,
        then pulls), and would make the peer's orderly exit a crash (docs/design/failures.md)."""
        for stream in channel.streams if channel is not None else ():
            try:
                while stream.pull():
                    pass
            except PeerClosed:
                pass

    def _drain(self, channel: Channel | None) -> None:
        """Deliver whatever a departed peer left in its shared-memory ring."""
        try:
            while channel is not None and channel.progress():
                pass
        except PeerClosed:
            pass

    def peer_unreachable(self, peer: int, reason: str, error: BaseException | None = None) -> None:
        """The wiring could not connect `peer`: lost (`reason`: its process or host is gone, as
        if its connection had closed), or failing with `error` (another secret, a refusal):
        what waits for it fails so. A ResourceError (no descriptor, here or there) fails what
        waits now and leaves the peer to be dialed again by the next message."""
        with self.lock:
            if peer in self.lost or self.closed:
                return
            if error is None:
                self.peer_lost(peer, reason)
                return
            channel = self.channels.get(peer)
            if isinstance(error, ResourceError):
                if channel is not None and channel.kind == "pending":
                    del self.channels[peer]
                    self.channel_list = list(self.channels.values())
            else:
                self.link_errors[peer] = error
                self.lost[peer] = str(error)
            for req in channel.pending() if channel is not None else ():
                req.fail(error)
            for key in [k for k in self.posted if k[0] == peer]:
                for recv in self.posted.pop(key):
                    recv.fail(error)

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
                        self.peer_lost(peer, why)
        self.check_silent(now)

    def check_silent(self, now: float) -> None:
        """The peers whose host acknowledged nothing this rank waits for in
        TENSORWIRE_PEER_TIMEOUT, seen so at two looks in a row, are lost. The kernel's keepalive
        covers connections with nothing in flight (tcp.tune_socket) but sends nothing while data
        waits for an acknowledgement; and TCP_USER_TIMEOUT, which would, also ends connections
        whose peer is alive but not reading (its receive window closed) for that long."""
        assert self.wiring is not None
        limit_ms = self.wiring.cfg.peer_timeout * 1000
        with self.lock:
            for channel in self.channel_list:
                peer = channel.peer
                if peer in self.lost:
                    continue
                waited = max((unanswered_ms(sock) for sock in channel.sockets), default=0)
                if waited < limit_ms or (channel.kind == "shm" and peer in self.wiring.procs
                                         and not self.wiring.gone(peer)):
                    # (a rank whose rings this one shares and whose process runs is no silent
                    # host: its socket went quiet with an address this host lost)
                    self._silent.pop(peer, None)
                elif now - self._silent.setdefault(peer, now) >= _LIVENESS_S:  # not a probe just sent
                    why = f"nothing acknowledged for {waited / 1000:.1f} s"
                    self.peer_lost(peer, self._host_silent(peer, why))

    def _host_silent(self, peer: int, why: str) -> str:
        """Why `peer` is lost, its host silent: the ranks that listen at its address go with it."""
        assert self.wiring is not None
        others = ", ".join(map(str, self.wiring.sharing_address(peer)))
        there = f" ({self.wiring.cards[peer]['addr']}, with rank(s) {others})" if others else ""
        return _PEER_SILENT.format(there, self.wiring.cfg.peer_timeout, why)

    def closed_error(self, what: object = None) -> AbortedError:
        """Why a call another thread waited in ended: this rank shut down (Engine.wait names the call)."""
        call = f"{what}: " if what is not None else ""
        return AbortedError(f"rank {self.rank}: {call}tensorwire shut down (destroy() on another thread) "
                            f"while it waited")

    def check_group(self, ctx: int, seq: int, watch: Iterable[int]) -> None:
        """Raise if the group was aborted, a member refused this call (which then fails the
        group: this rank runs it), or one of its members crashed _CRASH_GRACE_S ago (the requests
        that wait for a crashed member failed when it was lost).

        A member that left in order is not fatal by itself: it may have finished its part of
        the call; if it had not, the request waiting on it fails instead."""
        if self.deferred_aborts:  # found while reading a channel (a refusal of the call this rank runs)
            self.run_deferred_aborts()
        if self._ending_p2p:
            self._end_p2p()
        error = self.covering(ctx, seq) if self.aborted else None
        if error is not None:
            raise error
        gone = self.destroyed.get(ctx) if self.destroyed else None
        if gone is not None and gone[0] <= seq < P2P_SEQ:  # (its point-to-point messages may be on their way)
            raise gone[1]
        if self.closed:  # a send another thread waits on (destroy() fails posted receives itself)
            raise self.closed_error()
        refused = self.refusals.get(ctx, {}).get(seq) if self.refusals else None
        if refused and self.rank not in refused:  # a member refused the call this rank runs
            error = next(iter(refused.values()))
            self.abort_group(ctx, seq, watch, error, renew=True)
            raise error
        if self.crashed:
            doomed = time.perf_counter() - _CRASH_GRACE_S
            for peer in watch:
                if self.crashed.get(peer, doomed) < doomed:
                    raise self.lost_error(peer)

    # -- vetting: did every rank make the same call? ------------------------------------------
    def enter_call(self, ctx: int, call) -> bool:
        """Note the call a group is running, and vet what already arrived for it or before it;
        False if there was nothing to vet (so nothing can have aborted the group here)."""
        self.current[ctx] = call.ref
        heap = self.unvetted.get(ctx, _NO_HEAP)
        if not (heap and heap[0][0] <= call.seq) and not self.deferred_aborts:
            return False  # the common case, without the lock: what arrives next is vetted on arrival
        with self.lock:
            seen = set()
            held = []  # this call's messages: still queued when the next call enters, they were not needed
            while heap and heap[0][0] <= call.seq:
                entry = heapq.heappop(heap)
                queue = self.unexpected.get(entry[1:])
                if queue and entry not in seen:
                    seen.add(entry)
                    self.vet(entry[1], queue[0].header, call)
                    if entry[0] == call.seq:
                        held.append(entry)
            for entry in held:
                heapq.heappush(heap, entry)
            self.run_deferred_aborts()
        return True

    def current_call(self, ctx: int):
        """The call group `ctx` is running (or ran last); None if none or the group is gone."""
        ref = self.current.get(ctx)
        return None if ref is None else ref()

    def run_deferred_aborts(self) -> None:
        with self.lock:  # a waiter's check_group and the progress of another thread both run them
            while self.deferred_aborts:
                ctx, seq, members, error, renew = self.deferred_aborts.pop(0)
                self.abort_group(ctx, seq, members, error, renew)

    def check_arrival(self, req: RecvRequest, got: Header) -> bool:
        """Fingerprint and size of an arriving message against the posted receive."""
        want = req.header
        if want.fp != got.fp and differences(want.fp, got.fp):
            req.fail(self.mismatch_error(req.what, want.fp, got.fp, req.peer))
            return False
        if got.nbytes != want.nbytes:
            req.fail(CollectiveMismatchError(
                f"rank {self.rank}: {req.what}: rank {req.peer} sent {got.nbytes} bytes where this rank "
                f"expected {want.nbytes} (message sizes differ: check counts and dtypes on every rank)"))
            return False
        return True

    def vet(self, peer: int, header: Header, call) -> None:
        """A message for the call this rank is in must carry its fingerprint, whatever its step;
        one for an earlier call arrived after this rank finished it, so that call differed.

        The abort then starts at that earlier call: its sender may still be in it, waiting for
        this rank to take the rest (a 4 MiB broadcast to a rank that thought itself the root,
        over TCP with send buffers smaller than the message), and an abort of the later calls
        only would leave it to time out."""
        if header.seq == call.seq:
            if header.fp == call.fp or not differences(call.fp, header.fp):
                return
            error = self.mismatch_error(call.what, call.fp, header.fp, peer)
        else:
            error = CollectiveMismatchError(
                f"rank {self.rank}: rank {peer} sent data for call #{call.number(header.seq)} on group "
                f"{call.group.name} ({coll_label(header.fp.coll)}) that this rank finished without "
                f"needing it: the ranks called different collectives or roots there (this rank is now "
                f"at {call.what})")
        self.deferred_aborts.append((header.ctx, header.seq, tuple(call.group.ranks), error, False))

    def mismatch_error(self, what: object, mine: Fingerprint, theirs: Fingerprint,
                       peer: int) -> CollectiveMismatchError:
        diffs = differences(mine, theirs)
        if not diffs:  # the same arguments, run another way: the ranks chose differently
            return CollectiveMismatchError(
                f"rank {self.rank}: {what}: rank {peer} made the same call but ran it another way "
                f"(the ranks chose different algorithms or paths for it: a tensorwire bug, please "
                f"report it)")
        return CollectiveMismatchError(
            f"rank {self.rank}: {what}: rank {peer} made a different call at the same point: "
            f"{'; '.join(diffs)} (this rank vs rank {peer})")

    def control_sink(self, peer: int, header: Header) -> Sink:
        if header.kind == Kind.ABORT:
            on = {REFUSAL: self._on_refusal, DESTROYED: self._on_destroyed,
                  DESTROYED_ALL_SENT: self._on_destroyed}.get(header.tag, self._on_abort)
            return ControlSink(header.nbytes, lambda raw: on(peer, header.ctx, header.seq, raw, header.tag))
        if header.kind == Kind.BYE:
            return ControlSink(header.nbytes, lambda raw: self._on_goodbye(peer, raw))
        if header.kind == Kind.QUERY:
            return ControlSink(0, lambda raw: self._answer_query(peer, header.ctx))
        if header.kind == Kind.STATE:
            return ControlSink(0, lambda raw: self._on_state(peer, header))
        raise ValueError(f"rank {self.rank}: unknown message kind {header.kind} from rank {peer}")

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
        call = self.current_call(ctx)
        seq, fp = (call.seq, call.fp) if call is not None else (0, Fingerprint(0))
        header = Header(Kind.STATE, ctx, seq, _IN_P2P if self.p2p_waits.get(ctx) else 0, 0, fp)
        self.channels[peer].post_control(SendRequest(peer, header, _EMPTY, "state"))

    def _note_state(self, ctx: int, peer: int, seq: int) -> None:
        """What a peer said (or showed, by an abort) it runs of group `ctx`, for missing():
        only answers to a question just asked matter, so the notes are dropped when many."""
        if len(self.states) >= _STATES_MAX:
            self.states.clear()
        self.states[(ctx, peer)] = max(seq, self.states.get((ctx, peer), 0))

    def _on_state(self, peer: int, header: Header) -> None:
        self._note_state(header.ctx, peer, header.seq)
        (self.in_p2p.add if header.tag == _IN_P2P else self.in_p2p.discard)((header.ctx, peer))
        call = self.current_call(header.ctx)
        if call is not None and header.seq == call.seq:
            self.vet(peer, header, call)

    # -- aborts -------------------------------------------------------------------------------
    def stays_aborted(self, ctx: int, error: BaseException) -> None:
        """Group `ctx`'s renewal failed (group/renewal.py): it stays aborted, and its later
        calls raise `error`, which says why, instead of the refusal it was aborted for."""
        with self.lock:
            self.renewable.discard(ctx)
            self.aborted[ctx] = (self.aborted[ctx][0], error)

    def covering(self, ctx: int, seq: int) -> BaseException | None:
        """The abort of group `ctx` that covers its call `seq`: one of that call or an earlier
        one. A point-to-point message (seq P2P_SEQ + n, posted after the group's call n) is
        covered by any abort, except one after which the group renews itself: that covers only
        those posted after the failed call, as every member of a renewed group fails the same
        calls, and a message posted before it may be its peer's part of a completed exchange."""
        entry = self.aborted.get(ctx)
        if entry is None:
            return None
        if seq >= P2P_SEQ and ctx in self.renewable:
            return self._until_renewed(entry[1]) if seq - P2P_SEQ >= entry[0] else None
        return entry[1] if seq >= entry[0] else None

    def _until_renewed(self, refusal: BaseException) -> AbortedError:
        """What a point-to-point call between a refused call and its group's renewal raises:
        the refusal itself would read as this call's own mistake."""
        error = AbortedError(
            f"rank {self.rank}: a point-to-point call on a group that renews itself after a call "
            f"a member refused: the group's point-to-point calls fail until this rank's next "
            f"collective call on it renews it (every member's does). The refused call: {refusal}")
        error.__cause__ = refusal
        return error

    def abort_error(self, req: Request) -> BaseException | None:
        """The abort that covers this request (`covering`)."""
        header = req.header
        return self.covering(header.ctx, header.seq if header.kind == Kind.COLL else req.seq)

    def fail_if_unusable(self, req: Request) -> bool:
        error = self.abort_error(req)
        if error is not None:
            req.fail(error)
        elif req.peer in self.lost:
            req.fail(self.lost_error(req.peer))
        return req.done

    def abort_group(self, ctx: int, seq: int, members: Iterable[int], error: BaseException,
                    renew: bool = False) -> None:
        """Fail call `seq` of a group and every later one, here and on every member; `renew`:
        because a member refused that call, so the group renews itself (group/renewal.py).

        Earlier calls are left alone: a slower member may still be finishing them, and their
        messages may arrive after the abort, which travels on the control path.

        Over TCP a notice queues behind what is left of the failed call's sends (the stream
        must stay framed), and the raise returns control to a caller that may not call again
        for a while: the background thread delivers what the kernel did not take at once
        (docs/design/failures.md)."""
        with self.lock:
            if self.fail_locally(ctx, seq, error, renew):
                self._tell(ctx, seq, members, notice_text(error), RENEWED if renew else 0)

    def tell_destroyed(self, ctx: int, seq: int, members: Iterable[int], text: str,
                       sending: Iterable[int] = ()) -> None:
        """This rank destroyed group `ctx` before its call `seq`: the members this rank is
        connected to are told (`text`: 'rank 0 destroyed group G after its call #2'), so that a
        call of theirs that waits for it fails at once (check_group) instead of at its timeout,
        and so does a point-to-point receive from this rank, except at the members in `sending`
        (this rank's sends to them on the group are not all out yet). No connection is made for
        it: a destroy after a group's last call costs no round trip."""
        sending = set(sending)
        with self.lock:
            connected = [p for p in members if p in self.channels and self.channels[p].kind != "pending"]
            for tag, told in ((DESTROYED, [p for p in connected if p in sending]),
                              (DESTROYED_ALL_SENT, [p for p in connected if p not in sending])):
                if told:
                    self._tell(ctx, seq, told, text.encode(), tag)

    def _on_destroyed(self, peer: int, ctx: int, seq: int, raw: bytes, tag: int) -> None:
        if ctx in self.retired:
            return
        text = bytes(raw).decode(errors="replace")
        error = PeerLostError(f"rank {self.rank}: {text}", peer=peer)
        known = self.destroyed.get(ctx)
        if known is None or seq < known[0]:
            self.destroyed[ctx] = (seq, error)
        if tag == DESTROYED_ALL_SENT:  # after what is still in its ring is read (_end_p2p)
            self._ending_p2p.append((ctx, peer, error))

    def _end_p2p(self) -> None:
        """Fail the point-to-point receives of a group from a member that destroyed it, once its
        channel delivered what it had sent (over TCP that came before the notice; over shared
        memory it may still wait in the ring, which is read here, outside the socket's read)."""
        with self.lock:
            while self._ending_p2p:
                ctx, peer, error = self._ending_p2p.pop(0)
                if ctx in self.retired:
                    continue
                self._drain(self.channels.get(peer))
                self.p2p_ended[(ctx, peer)] = error
                for key in [k for k in self.posted if k[0] == peer and k[1][:2] == (ctx, Kind.P2P)]:
                    for req in self.posted.pop(key):
                        req.fail(self.p2p_ended_error(req, error))

    def p2p_ended_error(self, req: RecvRequest, error: BaseException) -> PeerLostError:
        """What a receive from a member that destroyed its group raises (`error`: the notice's)."""
        return PeerLostError(f"{error}; no message of it is left for rank {self.rank}",
                             peer=req.peer)

    def _tell(self, ctx: int, seq: int, members: Iterable[int], text: bytes, tag: int) -> None:
        """An ABORT notice (`tag`: 0, REFUSAL or DESTROYED) of call `seq` of group `ctx` to every
        member, `text` its payload."""
        payload = np.frombuffer(text, dtype=np.uint8)
        notices = []
        for peer in members:  # connecting where needed: a member may wait for no one it is connected to
            unreachable = self.wiring is None and peer not in self.channels
            if peer == self.rank or peer in self.lost or unreachable:
                continue
            header = Header(Kind.ABORT, ctx, seq, tag, len(payload), Fingerprint(0))
            notices.append(SendRequest(peer, header, payload, "abort"))
            self.channel(peer).post_control(notices[-1])
        self.poll_sockets()
        self.notices = [n for n in self.notices if not n.done] + notices
        for notice in notices:
            self.watch_in_background(notice)

    def _reported(self, peer: int, raw: bytes) -> TensorwireError:
        """The error a peer's notice carries ('Name\nmessage', or 'Name@origin\nmessage' where
        that peer passes on what rank `origin` reported to it), named as reported."""
        head, _, message = raw.decode(errors="replace").partition("\n")
        name, _, origin = head.partition("@")
        cls = _ERROR_CLASSES.get(name, AbortedError)
        first = int(origin) if origin.isdigit() else peer
        error = cls(f"{message} {_REPORTED} {first}; seen on rank {self.rank}]")
        error.relayed = Relayed(first, message, str(error), self.rank)
        return error

    def _on_abort(self, peer: int, ctx: int, seq: int, raw: bytes, tag: int) -> None:
        self._note_state(ctx, peer, seq)  # it ran call seq
        known = self.aborted.get(ctx)
        if known is None or seq < known[0]:  # (an earlier call's abort replaces: fail_locally)
            self.fail_locally(ctx, seq, self._reported(peer, raw), tag == RENEWED)

    # -- refusals: a call that fails on every member, the group living on ---------------------
    def refuse(self, ctx: int, seq: int, members: Iterable[int], error: BaseException) -> None:
        """This rank refused call `seq` of group `ctx` (a local argument error, found before it
        sent anything): the members are told, and the group lives on if each of them refused
        that call too (`refused_by`); any that ran it instead fails the group, which then renews
        itself (`_on_refusal`, group/renewal.py)."""
        with self.lock:
            self.refusals.setdefault(ctx, {}).setdefault(seq, {})[self.rank] = error
            self._tell(ctx, seq, members, notice_text(error), REFUSAL)

    def _on_refusal(self, peer: int, ctx: int, seq: int, raw: bytes, tag: int) -> None:
        if ctx in self.aborted:
            return
        error = self._reported(peer, raw)
        call = self.current_call(ctx)
        if call is not None and call.seq >= seq:  # this rank runs or ran that call: the group fails
            self.deferred_aborts.append((ctx, seq, tuple(call.group.ranks), error, True))
        else:  # still to come here: refused too (refused_by), or failed as it starts (the group's queue)
            self.refusals.setdefault(ctx, {}).setdefault(seq, {})[peer] = error

    def refused_by(self, ctx: int, seq: int) -> dict[int, BaseException]:
        """The members known to have refused call `seq` of group `ctx`, after a round of progress."""
        with self.lock:
            self.poll_peers()
            return self.refusals.get(ctx, {}).get(seq, {})

    def settle_refusal(self, ctx: int, seq: int) -> None:
        """Forget call `seq` of group `ctx`: every member refused it."""
        with self.lock:
            calls = self.refusals.get(ctx, {})
            calls.pop(seq, None)
            if not calls:
                self.refusals.pop(ctx, None)

    def fail_locally(self, ctx: int, seq: int, error: BaseException, renew: bool = False) -> bool:
        """Fail call `seq` of a group and every later one on this rank only, and every call of
        its children (the sub-groups a hierarchical algorithm runs its phases on: a rank may
        wait in one of them while the abort comes for the group); False if the group had
        already failed at this call or an earlier one. An abort of an earlier call than the one
        known replaces it (a member that ran ahead aborted a later call first: this rank's
        call in between would wait for a reason that never covers it). `renew`: it renews
        itself at its next call (abort_group)."""
        with self.lock:
            known = self.aborted.get(ctx)
            fatal = known is not None and ctx not in self.renewable
            if known is not None and (seq >= known[0] or renew and fatal):
                return False  # (a refusal does not make a failed group renew itself)
            self.aborted[ctx] = (seq, error)
            if renew:
                self.renewable.add(ctx)
            else:
                self.renewable.discard(ctx)
                if not fatal and ctx in self.alarms:
                    self.alarms[ctx](None)
            self._fail_ctx(ctx)
            for child in self.children.get(ctx, ()):
                if known is not None:  # replaced: its phases fail with this reason too
                    self.aborted.pop(child, None)
                self.fail_locally(child, 0, error)
            return True

    def _fail_ctx(self, ctx: int) -> None:
        """Fail the requests of group `ctx` its abort covers, each with the error it covers them
        with (`covering`: a point-to-point one of a renewing group says so)."""
        def covering(req: Request) -> BaseException | None:
            header = req.header
            return self.abort_error(req) if header.ctx == ctx and header.kind in _DATA else None

        for queue in list(self.posted.values()):
            for recv in queue:
                error = covering(recv)
                if error is not None:
                    recv.fail(error)
        for channel in self.channel_list:
            for req in channel.pending():
                error = covering(req)
                if error is not None:
                    req.fail(error)

    def retire(self, ctx: int, error: BaseException) -> None:
        """Forget a group that will never run again (it was shrunk): fail what is still posted
        for it, drop what arrived for it (releasing senders whose payload waits in their own
        memory) and every later arrival. Its entry in `aborted` stays, so calls on it still
        raise. Else a failed call's messages from the survivors would stay queued forever and
        keep every later call off the planned fast path, which runs only while nothing
        unexpected is queued."""
        with self.lock:
            self.retired.add(ctx)
            self.renewable.discard(ctx)
            self.destroyed.pop(ctx, None)
            for key in [k for k in self.p2p_ended if k[0] == ctx]:
                del self.p2p_ended[key]
            alarm = self.alarms.pop(ctx, None)
            if alarm is not None:
                alarm(None)
            for child in self.children.pop(ctx, ()):  # a hierarchy's groups go with it
                self.retire(child, error)
            self.current.pop(ctx, None)
            self.unvetted.pop(ctx, None)
            self.deferred_aborts[:] = [d for d in self.deferred_aborts if d[0] != ctx]  # one list for life
            for key in [k for k in self.posted if k[1][0] == ctx]:
                for req in self.posted.pop(key):
                    req.fail(error)
            for key in [k for k in self.unexpected if k[1][0] == ctx]:
                for msg in self.unexpected.pop(key):
                    if msg.source is not None and key[0] not in self.lost:
                        msg.source.discard()

    # -- telling why a call failed -----------------------------------------------------------
    def arrived_from(self, ctx: int, tag: int, peers: Iterable[int], group_name: str) -> int | None:
        """The first of `peers` whose point-to-point message with `tag` on group `ctx` has
        arrived (after one round of progress), or None; raises if the group was aborted or
        every one of them but this rank is gone (MPI_ANY_SOURCE's probe)."""
        key = (ctx, int(Kind.P2P), 0, int(tag))
        with self.lock:
            self.progress()
            for peer in peers:
                if self.unexpected.get((peer, key)):
                    return peer
                channel = self.channels.get(peer)  # arrived, left in its ring:
                if channel is not None and channel.parked is not None and channel.parked.key == key:
                    return peer
            entry = self.aborted.get(ctx)
            if entry is not None:
                raise entry[1]
            others = [peer for peer in peers if peer != self.rank]
            if others and all(peer in self.lost for peer in others):
                gone = "; ".join(f"lost rank {peer}: {self.lost[peer]}" for peer in others)
                raise PeerLostError(f"rank {self.rank}: recv from any rank (tag {tag}) on group "
                                    f"{group_name}: every sender is gone ({gone})", peer=others[0])
        return None

    def missing(self, error: BaseException, ctx: int, seq: int, members: Iterable[int],
                internal: int = 0) -> BaseException:
        """`error`, a timeout of call `seq` of group `ctx`, saying which members are not in the
        call: this rank asks the members it is connected to which call they run (their answers
        within _ASK_S; one that does not answer is not inside tensorwire: busy, blocked or
        stopped). Where every one asked is in the call too, this rank only waited for ranks
        that wait themselves, and for up to _MISSING_S it raises the abort of a rank that
        could say who is missing (docs/design/failures.md). `internal`: the group's own calls,
        left out of the numbers shown (they count the user's calls)."""
        if _NOT_IN in str(error) or _REPORTED in str(error):
            return error
        with self.lock:
            asked = [p for p in members if p != self.rank and p not in self.lost
                     and p in self.channels and self.channels[p].kind != "pending"]
            for p in asked:
                self.states.pop((ctx, p), None)
                self.in_p2p.discard((ctx, p))
            self.query_peers(ctx, asked)
        until = time.perf_counter() + _ASK_S
        while any((ctx, p) not in self.states for p in asked) and time.perf_counter() < until:
            self.look()
        # a member that left meanwhile, or sent an abort of this call, was in it and failed
        behind = [(p, self.states.get((ctx, p))) for p in asked
                  if p not in self.lost and self.states.get((ctx, p), -1) < seq]
        if behind:
            text = "; ".join(self._where(ctx, p, at, internal) for p, at in behind)
            return retold(error, f"{error} {_NOT_IN}: {text}.")
        return self._abort_saying(ctx, seq, _MISSING_S, lambda why: _NOT_IN in why) or error

    def _where(self, ctx: int, peer: int, at: int | None, internal: int) -> str:
        """What member `peer` answered about where it is (missing()): `at`, the call of group
        `ctx` it runs or ran last (the group's `internal` calls not counted), None: no answer."""
        if at is None:
            return (f"rank {peer} did not answer (not inside a tensorwire call: busy, blocked or stopped; "
                    f"or its answer waits behind data on a link slower than the timeout)")
        if (ctx, peer) in self.in_p2p:
            last = f"call #{at - internal}" if at > internal else "none yet"
            return f"rank {peer} waits in a point-to-point call of the group (its last collective: {last})"
        if at > internal:
            return f"rank {peer} is at call #{at - internal} of the group"
        return f"rank {peer} has made no call of the group yet"

    def look(self) -> None:
        """One round of progress with the sockets read (control messages: answers, aborts,
        goodbyes), then a short sleep: the error paths' waits for what other ranks say."""
        self.poll_peers()
        time.sleep(_LOOK_S)

    def why_left(self, error: BaseException, ctx: int, seq: int) -> BaseException:
        """Why a peer that left in the middle of call `seq` of group `ctx` left, where this rank
        can learn it within _WHY_LEFT_S: such a peer mostly left because the call failed there,
        and the abort that says why (a mismatch, a bad argument, a crash elsewhere) is on its way
        to every member, behind the goodbye on some sockets and ahead of it on others. `error`
        where no other reason comes (a departure other ranks report is none)."""
        if LEFT not in str(error):
            return error
        return self._abort_saying(ctx, seq, _WHY_LEFT_S, lambda why: LEFT not in why) or error

    def _abort_saying(self, ctx: int, seq: int, seconds: float,
                      says: Callable[[str], bool]) -> BaseException | None:
        """The abort of call `seq` of group `ctx` whose message `says` what is wanted, once it
        arrives within `seconds` (None if none does)."""
        until = time.perf_counter() + seconds
        while True:
            self.look()
            error = self.covering(ctx, seq)
            if error is not None and says(str(error)):
                return error
            if time.perf_counter() >= until:
                return None
