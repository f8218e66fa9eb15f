"""Point-to-point calls of a Group: send, recv, their async forms, sendrecv, probe_any.

They belong to no collective call: no sequence number. Their header's fingerprint carries the
message's dtype and element count, so a receive that differs from its send in either fails on
the receiver before a byte lands, and aborts the group so the sender learns it too (its send
if still in flight, else its next call on the group). A message's (peer, tag, size, dtype)
route is kept per group, as its checks and header are most of a small message's time. A
device buffer is staged through the group's device collectives.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple, overload

import numpy as np

from ..buffers import as_array, byte_view
from ..errors import (
    CLEAN_GROUP,
    AbortedError,
    CollectiveMismatchError,
    InvalidArgumentError,
    PeerLostError,
    ResourceError,
    TimeoutError,
    in_call,
    retold,
)
from ..gpu import is_device_buffer as _on_device
from ..transport.requests import P2P_SEQ, RecvRequest, Request
from ..transport.shm import REMOTE_BYTES
from ..transport.shm_segments import CTRL_BYTES
from ..transport.wire import Coll, Header, Kind
from ..work import Work
from .arguments import check_member, check_root, fingerprint, limit_of

if TYPE_CHECKING:
    from ..transport.requests import DeviceTarget
    from .group import Group

P2P_ROUTES = 256  # point-to-point routes kept per group (cleared when full)


class P2PRoute(NamedTuple):
    peer: int  # world rank
    header: Header
    wire: bytes  # the header packed
    key: tuple  # its matching key, as the engine files it: (peer, header.key)
    label: str
    done: Work  # what a message of this route that completed as it was posted returns
    dtype: np.dtype


def _host(group: Group, tensor: Any, sending: bool, peer: int, tag: int,
          call: str | None = None) -> tuple[np.ndarray, P2PRoute]:
    """A host buffer as a C-contiguous array (what a ring takes whole: Engine.send_now,
    recv_now; byte_view for the rest) and its message's route; a buffer refused is named with
    the call as made (`call`: sendrecv, else send or recv), its peer and tag."""
    what = call or ("send" if sending else "recv")
    try:
        arr = as_array(tensor, writable=not sending, rank=group.runtime.rank, collective=what)
    except InvalidArgumentError as exc:
        head = f"rank {group.runtime.rank}: {what}: "
        message = (f"{call}: " if call else "") + _label(group, sending, peer, tag)
        raise retold(exc, f"rank {group.runtime.rank}: {message}: {str(exc).removeprefix(head)}") from None
    return arr, route_of(group, sending, peer, tag, arr.nbytes, arr.dtype)


def route_of(group: Group, sending: bool, peer: int, tag: int, nbytes: int, dtype: np.dtype) -> P2PRoute:
    """The route of a message of `nbytes` bytes of `dtype` (a host buffer's, or a device
    buffer's: gpu/p2p.py): kept per size, its dtype checked apart."""
    found = group.p2p_routes.get((sending, peer, tag, nbytes)) if type(peer) is int and type(tag) is int \
        else None  # (another type checked by _route: 1.0 and True would find peer 1's)
    if found is None or found.dtype is not dtype:
        found = _route(group, sending, peer, tag, nbytes, dtype)
    return found


def isend(group: Group, tensor: Any, dst: int, tag: int = 0) -> Any:
    """Non-blocking send; the returned Work completes once the data left this process's hands."""
    if _on_device(tensor):
        return group.device.isend(tensor, dst, tag)
    data, route = _host(group, tensor, True, dst, tag)
    if group.engine.send_now(route.peer, route.wire, data):
        return route.done
    req = group.engine.isend(route.peer, route.header, byte_view(data), route.label, route.wire,
                             seq=position(group))
    return _work(group, req, route)


def irecv(group: Group, tensor: Any, src: int, tag: int = 0) -> Any:
    """Non-blocking receive into `tensor` (its size must equal the message's)."""
    if _on_device(tensor):
        return group.device.irecv(tensor, src, tag)
    return receive(group, tensor, src, tag)


def receive(group: Group, tensor: Any, src: int, tag: int, device: DeviceTarget | None = None) -> Any:
    """irecv of a host buffer. `device`: of a receive into device memory, whose pinned host
    buffer `tensor` is (gpu/collectives.py): a device message lands there instead
    (RecvRequest.device)."""
    data, found = _host(group, tensor, False, src, tag)
    if group.engine.recv_now(found.peer, found.key, found.wire, data, False):
        if data.nbytes >= _VET_BYTES:  # checked here too: no call on the small-message path
            _vet_received(group, found.peer, data.nbytes)
        return found.done
    req = group.engine.irecv(found.peer, found.header, byte_view(data), None, found.label,
                             seq=position(group), device=device)
    return _work(group, req, found)


_ANY_HERE_BYTES = 64 << 10
"""A receive from any member of up to this size whose message is there already takes it as it
is posted (it is in whole, or nearly); a larger one waits for its Work's wait or poll."""


def irecv_any(group: Group, tensor: Any, tag: int = 0, timeout: float | None = None) -> Work:
    """Non-blocking receive from whichever member sends first (MPI_ANY_SOURCE); the Work's
    result() is the sender's group rank. It completes while someone waits on it or polls it
    (a small message there already at once); such receives of one tag take messages in the
    order they were posted, and waiting on one completes those posted before it. `timeout`:
    it fails with TimeoutError that long after it was posted; without one it waits as an
    irecv's Work does, bounded by each wait()."""
    check_member(group, "recv from any rank")
    _check_tag(group, tag, "recv from any rank")
    if _on_device(tensor):
        return group.device.irecv_any(tensor, tag, timeout)
    data = as_array(tensor, writable=True, rank=group.runtime.rank, collective="recv")
    limit = limit_of(group, timeout, "recv from any rank", collective=False)
    work = AnySourceWork(group, data, tag, timeout, limit)
    group.any_source_turns.post(work)
    if data.nbytes <= _ANY_HERE_BYTES:
        work.is_completed()
    return work


class AnySourceWork(Work):
    """A receive from any member: its Work, driven by whoever waits on it or polls it
    (AnySourceTurns.drive), as a point-to-point Work is."""

    progresses = False

    def __init__(self, group: Group, data: np.ndarray, tag: int, timeout: float | None, limit: float) -> None:
        super().__init__(_any_label(group, tag), group.runtime.rank)
        self.group, self.data, self.tag, self.timeout, self.limit = group, data, tag, timeout, limit
        self.deadline = math.inf if timeout is None else time.monotonic() + limit  # its own, if given

    def take(self, until: float) -> int | None:
        """Find the sender of the next message of this tag and receive it; None where none came
        by `until` (a TimeoutError past this receive's own deadline)."""
        src = _probe_any(self.group, self.tag, self.deadline, self.limit, until)
        if src is not None:
            self.group.recv(self.data, src, self.tag, self.timeout)
        return src

    def wait(self, timeout: float | None = None) -> bool:
        if not self.done:
            if timeout is not None:  # a bad one fails this wait, not the Work
                limit_of(self.group, timeout, self.what, collective=False, poll=True)
            waited = self.limit if timeout is None else timeout  # (the group's timeout, or its own)
            self.group.any_source_turns.drive(self, time.monotonic() + waited)
            if not self.done:
                raise TimeoutError(f"rank {self.rank}: {self.what} not complete after {float(waited):g} s"
                                   f"{_other_tags(self.group, set(self.group.ranks), self.tag)}")
        return super().wait(0)

    def is_completed(self) -> bool:
        """Also one look for its message (as MPI_Test)."""
        if not self.done:
            self.group.any_source_turns.drive(self, time.monotonic())
        return self.done


def send(group: Group, tensor: Any, dst: int, tag: int = 0, timeout: float | None = None) -> None:
    if timeout is not None:  # checked here: the fast path waits for nothing (no call on the hot path)
        timeout = limit_of(group, timeout, "send", collective=False)
    if _on_device(tensor):
        group.device.isend(tensor, dst, tag).wait(group.timeout if timeout is None else timeout)
        return
    data, route = _host(group, tensor, True, dst, tag)
    engine = group.engine
    if not engine.send_now(route.peer, route.wire, data):
        req = engine.isend(route.peer, route.header, byte_view(data), route.label, route.wire,
                           seq=position(group))
        engine.await_read(req)
        _wait(group, req, timeout=timeout)


def recv(group: Group, tensor: Any, src: int, tag: int = 0, timeout: float | None = None) -> int:
    if timeout is not None:  # checked here: the fast path waits for nothing (no call on the hot path)
        timeout = limit_of(group, timeout, "recv", collective=False)
    if _on_device(tensor):
        group.device.irecv(tensor, src, tag).wait(group.timeout if timeout is None else timeout)
        return src
    data, route = _host(group, tensor, False, src, tag)
    if not group.engine.recv_now(route.peer, route.key, route.wire, data, True, route.label):
        _wait(group, group.engine.irecv(route.peer, route.header, byte_view(data), None, route.label,
                                        seq=position(group)), timeout=timeout)
    if data.nbytes >= _VET_BYTES:  # checked here too: no call on the small-message path
        _vet_received(group, route.peer, data.nbytes)
    return src


_VET_BYTES = 256 << 10
"""A receive from this size on looks for an abort that came behind its message: its sender's
send failed partway (timed out, interrupted), and what arrived, or was read out of the sender's
memory, may be torn or written after the failure."""


def _vet_received(group: Group, peer: int, nbytes: int) -> None:
    if nbytes < _VET_BYTES:
        return
    engine = group.engine
    engine.poll_peer(peer)
    aborted = engine.aborted.get(group.ctx)
    if aborted is not None:
        raise aborted[1]


def sendrecv(group: Group, send: Any, dst: int, recv: Any, src: int, tag: int = 0,
             timeout: float | None = None) -> int:
    """Send `send` to `dst` and receive into `recv` from `src` at once (MPI_Sendrecv): no
    ordering between the two can deadlock, as a blocking send before a blocking receive
    can on every rank of a ring. `send` and `recv` may be one buffer or overlap (the send then
    leaves from a copy, as MPI_Sendrecv_replace's). Returns `src`. Its arguments are checked
    before either message moves."""
    if timeout is not None:  # (the other arguments of a pair used before: checked as it was made)
        timeout = limit_of(group, timeout, "sendrecv", collective=False)
    if type(send) is np.ndarray and type(recv) is np.ndarray and type(dst) is int and type(src) is int \
            and type(tag) is int:  # (other types: checked by _check_peers)
        viewed = send.base is not None or recv.base is not None  # else each owns its memory
        if send is recv or viewed and np.may_share_memory(send, recv):
            send = send.copy()  # the receive may land before the send has left
        # arrays of a pair of routes used before: their dtypes passed the checks then, and the
        # engine sends nothing unless both buffers are C-contiguous (and the receive's
        # writable); what it did not send takes the checked way below
        pair = group.p2p_pairs.get((dst, src, tag, send.nbytes, recv.nbytes))
        if pair is not None and send.dtype is pair[0].dtype and recv.dtype is pair[1].dtype:
            out, inn = pair
            if send.nbytes >= REMOTE_BYTES and send.flags.c_contiguous and \
                    _read_each_other(group, send, out, recv, inn, timeout):
                _vet_received(group, inn.peer, recv.nbytes)
                return src
            sent, taken = group.engine.sendrecv_now(out.peer, out.wire, send, inn.peer, inn.key, inn.wire,
                                                    recv)
            if sent:
                if not taken:
                    _finish(group, send, out, recv, inn, True, timeout)
                _vet_received(group, inn.peer, recv.nbytes)
                return src
    elif _on_device(send) or _on_device(recv):
        _check_peers(group, dst, src, tag)
        views = {}  # the CUDA buffers as torch tensors (CuPy's too)
        for buf, what in ((send, "send"), (recv, "recv")):  # both good before anything is sent
            if _on_device(buf):
                views[what] = group.device.check_p2p(buf, what)
            else:
                as_array(buf, writable=what == "recv", rank=group.runtime.rank, collective="sendrecv")
        if len(views) == 2 and _overlap(views["send"], views["recv"]):
            send = views["send"].clone()
        deadline = time.perf_counter() + (group.timeout if timeout is None else timeout)
        for work in [group.irecv(recv, src, tag), group.isend(send, dst, tag)]:  # the receive first (_finish)
            work.wait(max(0.0, deadline - time.perf_counter()))
        return src
    _check_peers(group, dst, src, tag)
    data, out = _host(group, send, True, dst, tag, "sendrecv")
    into, inn = _host(group, recv, False, src, tag, "sendrecv")
    if np.may_share_memory(data, into):
        data = data.copy()
    if len(group.p2p_pairs) >= P2P_ROUTES:
        group.forget_pairs()
    group.p2p_pairs[(dst, src, tag, data.nbytes, into.nbytes)] = (out, inn)
    if group.plans.caller is not None and into.nbytes < _VET_BYTES:  # its sendrecv takes the pair's next
        # calls whole (a large receive is vetted here)
        group.plans.caller.add_pair(dst, src, tag, data.nbytes, into.nbytes, out.dtype, inn.dtype, out, inn,
                                    REMOTE_BYTES, CTRL_BYTES, _finish)
    if not (data.nbytes >= REMOTE_BYTES and data.flags.c_contiguous and
            _read_each_other(group, data, out, into, inn, timeout)):
        sent, taken = group.engine.sendrecv_now(out.peer, out.wire, data, inn.peer, inn.key, inn.wire, into)
        if not taken:
            _finish(group, data, out, into, inn, sent, timeout)
    _vet_received(group, inn.peer, into.nbytes)
    return src


def _check_peers(group: Group, dst: Any, src: Any, tag: Any) -> None:
    """sendrecv's peers and tag, named as its own (its routes would name a send and a recv)."""
    check_root(group, dst, "sendrecv", "dst", collective=False)
    check_root(group, src, "sendrecv", "src", collective=False)
    _check_tag(group, tag, "sendrecv")


def _overlap(a: Any, b: Any) -> bool:
    """Whether two tensors of one device share any byte."""
    x, y = a.data_ptr(), b.data_ptr()
    return a.device == b.device and x < y + b.numel() * b.element_size() and \
        y < x + a.numel() * a.element_size()


def _finish(group: Group, data: np.ndarray, out: P2PRoute, into: np.ndarray, inn: P2PRoute,
            sent: bool | Request, timeout: float | None, taken: bool = False) -> None:
    """sendrecv's messages that did not go at once (Engine.sendrecv_now, sendrecv_read): posted,
    the receive first (a message that comes while the send is posted lands in place, not
    staged), waited for. `sent`: True, or the send still waiting for its reader."""
    engine, seq = group.engine, position(group)
    if not taken and sent is True:
        taken = engine.recv_yielding(inn.peer, inn.key, inn.wire, into, inn.label)
        if taken:
            return
    reqs: list[Request] = [] if taken else \
        [engine.irecv(inn.peer, inn.header, byte_view(into), None, inn.label, seq=seq)]
    if isinstance(sent, Request):
        reqs.append(sent)
    elif not sent:
        reqs.append(engine.isend(out.peer, out.header, byte_view(data), out.label, out.wire, seq=seq))
    _wait(group, *reqs, timeout=timeout)


def _read_each_other(group: Group, data: np.ndarray, out: P2PRoute, into: np.ndarray, inn: P2PRoute,
                     timeout: float | None) -> bool:
    """A large sendrecv (from REMOTE_BYTES, C-contiguous) where each rank reads the other's
    buffer, in one compiled call where nothing else is in the way (Engine.sendrecv_read); what
    did not finish there is waited for. False: nothing done."""
    engine = group.engine
    if engine.native is None:  # the exchange is the compiled loops' (TENSORWIRE_NATIVE=0: the general way)
        return False
    done = engine.sendrecv_read(out.peer, out.header, out.label, byte_view(data), inn.peer, inn.key, inn.wire,
                                inn.label, into, position(group))
    if done is None:
        return False
    sent, taken = done
    if sent is not None or not taken:
        _finish(group, data, out, into, inn, True if sent is None else sent, timeout, taken)
    return True


def position(group: Group) -> int:
    """Where a point-to-point message posted now stands among the group's calls: after the
    last one it made (an abort of a later call leaves it alone where the group renews itself:
    Failures.covering)."""
    return P2P_SEQ + group.queue.seq


def _route(group: Group, sending: bool, peer: int, tag: int, nbytes: int, dtype: np.dtype) -> P2PRoute:
    """Where a point-to-point message goes and how it is labelled, kept per (direction,
    peer, tag, size) with its dtype: the checks, the header and its wire form, and the label
    are most of a small message's time otherwise."""
    world = group.ranks[check_root(group, peer, "send" if sending else "recv", "peer", collective=False)]
    _check_tag(group, tag, "send" if sending else "recv")
    if len(group.p2p_routes) >= P2P_ROUTES:
        group.p2p_routes.clear()
    fp = fingerprint(Coll.P2P, dtype, count=nbytes // dtype.itemsize)
    header = Header(Kind.P2P, group.ctx, 0, tag, nbytes, fp)
    label = _label(group, sending, peer, tag)
    made = group.p2p_routes[(sending, peer, tag, nbytes)] = P2PRoute(
        world, header, header.pack(), (world, header.key), label, _Done(label, group.runtime.rank), dtype)
    return made


def _label(group: Group, sending: bool, peer: int, tag: int) -> str:
    """How errors and logs name a message: 'send to rank 1 (tag 3) on group world'."""
    return f"{'send to' if sending else 'recv from'} rank {peer} (tag {tag}) on group {group.name}"


def _check_tag(group: Group, tag: Any, what: str) -> None:
    if not isinstance(tag, (int, np.integer)) or not -1 << 63 <= tag < 1 << 63:
        raise InvalidArgumentError(f"rank {group.runtime.rank}: {what} on group {group.name}: tag {tag!r} is "
                                   f"not an integer of 64 bits")


def probe_any(group: Group, tag: int = 0, timeout: float | None = None) -> int:
    """Wait until a point-to-point message with `tag` from any member has arrived; its
    sender's group rank (receive from it next). MPI_Probe with MPI_ANY_SOURCE."""
    check_member(group, "recv from any rank")
    _check_tag(group, tag, "recv from any rank")
    limit = limit_of(group, timeout, "probe_any", collective=False)
    return _probe_any(group, tag, time.monotonic() + limit, limit)


def iprobe_any(group: Group, tag: int = 0) -> int | None:
    """Whether a point-to-point message with `tag` from any member has arrived, without
    waiting: its sender's group rank (receive from it next), or None. MPI_Iprobe with
    MPI_ANY_SOURCE."""
    check_member(group, "recv from any rank")
    _check_tag(group, tag, "recv from any rank")
    return _arrived(group, tag)


@overload
def _probe_any(group: Group, tag: int, deadline: float, limit: float) -> int: ...
@overload
def _probe_any(group: Group, tag: int, deadline: float, limit: float, until: float) -> int | None: ...
def _probe_any(group: Group, tag: int, deadline: float, limit: float, until: float = math.inf) -> int | None:
    """Wait for a message of `tag` from any member: spinning as long as the engine spins for a
    message, then in sleeps growing to 1 ms; None once `until` passed (a TimeoutError past
    `deadline`)."""
    spin_until = time.monotonic() + group.engine.spin_s
    pause = 20e-6
    while True:
        if time.monotonic() > deadline:  # before a look: a receive past its time takes nothing
            raise _nothing_came(group, tag, limit)
        ended = _ended(group, tag)
        if ended is not None:
            raise ended
        src = _arrived(group, tag)
        if src is not None:
            return src
        now = time.monotonic()
        if now >= until:
            return None
        if now > spin_until:
            time.sleep(min(pause, until - now))
            pause = min(pause * 2, 1e-3)


def _arrived(group: Group, tag: int) -> int | None:
    """The group rank of a member whose message of `tag` has arrived, this rank's own to itself
    too (as MPI_ANY_SOURCE), looking first at the members after the last one found (one busy
    sender does not starve the others); else None."""
    turns = group.any_source_turns
    order = ((turns.last + k) % group.size for k in range(1, group.size + 1))
    peers = {group.ranks[r]: r for r in order}
    world = group.engine.arrived_from(group.ctx, tag, peers, group.name)
    if world is None:
        return None
    turns.last = peers[world]
    return peers[world]


def _any_label(group: Group, tag: int) -> str:
    return f"recv from any rank (tag {tag}) on group {group.name}"


def _nothing_came(group: Group, tag: int, limit: float) -> TimeoutError:
    return TimeoutError(f"rank {group.runtime.rank}: {_any_label(group, tag)}: no message arrived within "
                        f"{limit:g} s{_other_tags(group, set(group.ranks), tag)}")


def _other_tags(group: Group, peers: set[int], tag: int) -> str:
    """What a receive of `tag` that waited in vain can say: the messages from `peers` (world
    ranks) on its group with other tags that arrived and wait for a receive (the two sides'
    tags most often differ then); '' where there are none."""
    engine = group.engine
    with engine.lock:
        came = sorted({(group.group_rank(peer), key[3]) for (peer, key), queue in engine.unexpected.items()
                       if queue and peer in peers and key[:2] == (group.ctx, Kind.P2P) and key[3] != tag})
    if not came:
        return ""
    listed = ", ".join(f"tag {t} from rank {r}" for r, t in came[:4]) + (", ..." if len(came) > 4 else "")
    return f" (messages with other tags came and wait for their receives: {listed}; do the tags of the " \
        f"send and the receive differ?)"


def _with_tags(group: Group, reqs: tuple[Request, ...], exc: BaseException) -> BaseException:
    """`exc`, which ended a wait for `reqs`, with what `_other_tags` says of its receives."""
    for req in reqs:
        if isinstance(req, RecvRequest) and req.header.kind == Kind.P2P:
            hint = _other_tags(group, {req.peer}, req.header.tag)
            if hint:
                return retold(exc, f"{exc}{hint}")
    return exc


def _ended(group: Group, tag: int) -> AbortedError | None:
    """Why a receive from any member waits no longer: destroy() of tensorwire or the group."""
    if group.runtime.closed or group.destroyed:
        why = "tensorwire shut down (destroy())" if group.runtime.closed else "its group was destroyed"
        return AbortedError(f"rank {group.runtime.rank}: {_any_label(group, tag)}: {why} while it was posted")
    return None


class AnySourceTurns:
    """Receives from any member of one tag take messages in the order they were posted (MPI
    matches them so): waiting on one first completes those posted before it. A probe looks
    first at the members after the last one it found, so that one busy sender does not
    starve the others."""

    def __init__(self) -> None:
        self.last = 0  # group rank whose message was found last
        self._posted: dict[int, collections.deque[AnySourceWork]] = {}
        # per tag: one thread completes its receives at a time (re-entered by a done-callback
        # that waits on another)
        self._drivers: dict[int, threading.RLock] = {}
        self._lock = threading.Lock()

    def post(self, work: AnySourceWork) -> None:
        with self._lock:
            queue = self._posted.setdefault(work.tag, collections.deque())
            driver = self._drivers.setdefault(work.tag, threading.RLock())
        queue.append(work)
        if driver.acquire(blocking=False):  # receives past their time that nobody waited on end here
            try:
                now = time.monotonic()
                for late in [w for w in list(queue) if w.deadline < now]:  # list(): one step (others append)
                    queue.remove(late)
                    late.finish(exc=_nothing_came(late.group, late.tag, late.limit))
            finally:
                driver.release()

    def drive(self, work: AnySourceWork, until: float) -> None:
        """Complete the receives of `work`'s tag in the order they were posted, up to `work`,
        until `until` (monotonic seconds)."""
        driver = self._drivers[work.tag]
        if not driver.acquire(timeout=max(0.0, min(until - time.monotonic(), threading.TIMEOUT_MAX))):
            return
        try:
            queue = self._posted[work.tag]
            while not work.done:
                head = queue[0]
                try:
                    src = head.take(until)
                except Exception as exc:  # handed to whoever waits on that receive's Work
                    queue.popleft()
                    head.finish(exc=exc)
                    continue
                if src is None:
                    return
                queue.popleft()
                head.finish(src)
        finally:
            driver.release()


def _wait(group: Group, *reqs: Request, timeout: float | None, blocking: bool = True) -> None:
    """Wait for `reqs`. A blocking call that times out takes its receives back (Engine.withdraw);
    a Work's wait leaves them posted, to be waited on again."""
    t = limit_of(group, timeout, str(reqs[0].what), collective=False, poll=not blocking)
    engine = group.engine
    ctx = group.ctx
    with engine.lock:  # what this rank answers a peer that asks where it is (Failures.missing)
        engine.p2p_waits[ctx] = engine.p2p_waits.get(ctx, 0) + 1
    try:
        engine.wait(reqs, deadline=time.perf_counter() + t, ctx=group.ctx, seq=reqs[0].seq,
                    watch=tuple(r.peer for r in reqs), what=reqs[0].what)
    except PeerLostError as exc:  # named with the message it ended ('recv from rank 2 (tag 0) ...')
        named = _with_tags(group, reqs, in_call(exc, next((r.what for r in reqs if r.error is exc),
                                                          reqs[0].what)))
        if named is exc:
            raise
        raise named from exc
    except CollectiveMismatchError as exc:  # a receive that differs from its send: the sender,
        if group.ctx not in group.engine.aborted:  # whose send may have returned, learns it
            group.abort(exc)  # from the abort
        raise
    except (TimeoutError, ResourceError, KeyboardInterrupt, SystemExit) as exc:  # an interrupted receive
        # takes them back too, as does one whose send could not go (a limit)
        told = _with_tags(group, reqs, exc) if isinstance(exc, TimeoutError) else exc
        if blocking and not engine.withdraw(reqs) and group.ctx not in engine.aborted:
            # a message partly moved: its peer must fail rather than get it (or the rest of it)
            rank = group.runtime.rank
            group.abort(told if isinstance(exc, (TimeoutError, ResourceError)) else AbortedError(
                f"rank {rank}: {reqs[0].what} was interrupted on rank {rank} ({type(exc).__name__}) with its "
                f"message partly moved: the group is aborted; {CLEAN_GROUP}"))
        if told is exc:
            raise
        raise told from None
    finally:
        with engine.lock:
            engine.p2p_waits[ctx] -= 1
            if not engine.p2p_waits[ctx]:
                del engine.p2p_waits[ctx]


def _work(group: Group, req: Request, route: P2PRoute) -> Work:
    if req.done and req.error is None:  # a small send, already in the ring or the socket,
        # or a receive whose message had arrived
        if isinstance(req, RecvRequest):
            _vet_received(group, req.peer, req.nbytes)
        return route.done
    group.engine.watch_in_background(req)
    return P2PWork(group, req)


class _Done(Work):
    """A request that completed as it was posted: nothing to drive, wait or watch."""

    def __init__(self, what: str, rank: int) -> None:
        super().__init__(what, rank)
        self.done = True


class P2PWork(Work):
    """A point-to-point request as a Work: waiting drives the engine instead of a worker."""

    progresses = False

    def __init__(self, group: Group, req: Request) -> None:
        super().__init__(req.what, group.runtime.rank)
        self._group = group
        self._req = req

    def wait(self, timeout: float | None = None) -> bool:
        if not self.done:
            req = self._req
            busy = not req.done or req.error is not None  # else nothing to drive nor raise
            if busy and timeout is not None:  # a bad one fails this wait, not the Work
                limit_of(self._group, timeout, str(req.what), collective=False, poll=True)
            try:
                if busy:
                    _wait(self._group, req, timeout=timeout, blocking=False)
                if isinstance(req, RecvRequest):
                    _vet_received(self._group, req.peer, req.nbytes)
            except BaseException as exc:
                if isinstance(exc, (TimeoutError, KeyboardInterrupt)) and not req.done:
                    raise  # still pending (as MPI_Wait's request after a signal): the caller may wait again
                self.finish(exc=exc)
                raise
            self.finish()
            return True
        return super().wait(0)

    def is_completed(self) -> bool:
        """Also one round of progress (as MPI_Test): a caller that polls moves its transfer;
        once it is done, the Work finishes as a wait would (its error, its callbacks)."""
        req = self._req
        if not req.done:
            engine = self._group.engine
            with engine.lock:
                engine.progress()
        if req.done and not self.done:
            try:
                self.wait(0)
            except Exception:  # noqa: BLE001 - kept by the Work: exception(), wait()
                pass
        return req.done
