"""Wiring on demand: a rank connects to a peer when it first sends to it or waits for it.

Every rank listens on the address it advertised at init (connect.py). The first message to a
peer, or the first receive posted for it, finds no channel: the engine puts a `PendingChannel`
in its place, which holds what is posted meanwhile, and asks this module's thread to connect.
The thread dials the peer, both sides run the job's handshake (handshake.py), set the pair up
in a short exchange of messages and install the channel in their engines; what the pending
channel held goes out first. Descriptors and /dev/shm then grow with the peers a rank talks
to, not with the job (docs/design/wiring.md).

The thread runs beside the application: it accepts and sets up the pairs peers start while
this rank computes, so a peer never waits for this rank to call tensorwire before it can
connect (and an abort reaches a rank that is not inside a call).

Either side may start; where both do at once, the lower rank's dial wins: the higher rank
accepts it and drops its own, the lower answers the higher's with "crossed" and the higher
waits for the other. Pairs on one host (same host name and machine, TENSORWIRE_TRANSPORT not
`tcp`) make their rings in the exchange (pair_rings.py) and use shared memory only if both
sides mapped the other's ring and read its nonce. TCP pairs open TENSORWIRE_NSOCKS streams.
A pair on one host (and network namespace) dials a second listener on loopback, so its socket,
which carries the ring pair's control messages (aborts, goodbyes), outlives the host's address.

A dial that nobody answers at the address (refused: the process is gone) or whose host never
answers (within TENSORWIRE_PEER_TIMEOUT) makes the peer lost: whatever waits for it fails with a
PeerLostError naming it, within seconds, as if its connection had closed.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import itertools
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import auth, limits, log
from ..config import Config
from ..errors import RendezvousError, ResourceError, TensorwireError
from .channel import Channel
from .handshake import HELLO, Dial, Incoming, Messages, Refused, Retry, Unreachable, job_hash
from .pair_rings import PairRings
from .processes import namespace, start_of
from .shm import ShmChannel
from .shm_segments import Ring
from .tcp import SocketStream, TcpChannel, size_buffers, tune_socket

if TYPE_CHECKING:
    from .engine import Engine

_log = log.get("TRANSPORT")
_RETRY_S = 0.05  # first pause before dialing again after a dial that may succeed next time
_RETRY_MAX_S = 1.0
_CROSSED_WAIT_S = 1.0
"""How long a rank whose dial was crossed waits for the other rank's before it dials again (the
other may have given its own up, short of descriptors; a dial still under way crosses again)."""
_SHED_S = 0.1  # how long the listener rests when no descriptor is left to accept with
_POLLIN, _POLLOUT = select.POLLIN, select.POLLOUT
_LOOPBACK = "127.0.0.1"


class _Out:
    """A connection this rank dials to `peer`: the pair's first socket (`index` 0), which
    carries the setup exchange, or one of its further TCP streams."""

    def __init__(self, wiring: Wiring, peer: int, addr: tuple[str, int], index: int, pair: int) -> None:
        self.peer, self.index, self.pair = peer, index, pair
        hello = HELLO.pack(wiring.rank, peer, wiring.engine.world_size, wiring.job)
        self.dial = Dial(peer, addr, hello, wiring.secret, wiring.cfg.auth_timeout,
                         wiring.cfg.peer_timeout, wiring.who, functools.partial(size_buffers, cfg=wiring.cfg))
        self.sock = self.dial.sock
        self.msgs: Messages | None = None
        self.ring: Ring | None = None  # the ring this rank writes (index 0, a pair on one host)
        self.answer: dict | None = None
        self.theirs: Ring | None = None
        self.pid = 0  # the peer's, where this process can read its memory
        self.streams: list[_Out] = []
        self.joined = 0
        self.expires = self.dial.expires


def _count(msg: dict, key: str, default: int) -> int:
    """An integer of a peer's setup message; a ValueError where it holds something else."""
    value = msg.get(key, default)
    if type(value) is not int:
        raise ValueError(f"{key}: {str(value)[:40]!r} is not an integer")
    return value


class _In:
    """A connection from rank `peer` that proved the secret, while its pair is set up."""

    def __init__(self, inc: Incoming) -> None:
        self.sock, self.peer, self.addr = inc.sock, inc.rank, inc.addr
        self.msgs = Messages(inc.sock)
        self.pair = -1
        self.ring: Ring | None = None
        self.theirs: Ring | None = None
        self.pid = 0
        self.reads = False  # the dialer can read this process's memory
        self.streams: list[tuple[int, socket.socket]] = []  # (index, socket): the order the dialer numbered
        self.want_streams = 1
        self.final = False  # waiting for the dialer's last word on the rings
        self.expires = time.monotonic()
        self.reject = ""  # answer every offer with this error (no descriptor was left for it)


class Wiring:
    """The listener and the thread that connects this rank to its peers on demand.

    `cards` (`learn`): every peer's address and port, and where it runs; `want(peer)` (called
    by the engine under its lock) asks for a connection. The thread installs channels in the
    engine (`Engine.install`) and reports peers it cannot reach (`Engine.peer_unreachable`)."""

    def __init__(self, engine: Engine, cfg: Config, job_id: str, secret: auth.Secret, address: str,
                 where: tuple[str, str], world_size: int) -> None:
        self.engine, self.cfg, self.job_id, self.secret = engine, cfg, job_id, secret
        self.rank = engine.rank
        self.who = f"rank {self.rank}"
        self.where = list(where)  # (host name, machine): who shares /dev/shm with this rank
        self.job = job_hash(job_id)
        self.cards: dict[int, dict[str, Any]] = {}
        self.procs: dict[int, tuple[int, int]] = {}  # peers whose process this rank can watch: (pid, start)
        self.rings = PairRings(job_id, self.rank,
                               "TENSORWIRE_SINGLE_COPY=0" if cfg.single_copy == "0" else "")  # see start()
        self.netns = namespace("net")
        self.listener = self._listen(address, world_size)
        loopback = cfg.transport != "tcp" and address != _LOOPBACK  # what this host's pairs dial (address())
        self.loopback = self._listen_loopback(world_size) if loopback else None
        self.listeners = [self.listener, *([self.loopback] if self.loopback is not None else [])]
        for listener in self.listeners:  # a congestion control the kernel refuses fails init
            tune_socket(listener, cfg)  # (accepted sockets inherit the listener's settings)
        self.port = self.listener.getsockname()[1]
        self.loopback_port = self.loopback.getsockname()[1] if self.loopback is not None else 0
        self._want: deque[int] = deque()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._spare: int | None = _spare_descriptor()
        self._poll = select.poll()
        self._handlers: dict[int, Callable[[], None]] = {}
        self._out: dict[int, _Out] = {}  # dials of pairs being set up, by peer
        self._streams: dict[int, _Out] = {}  # further streams being dialed, by descriptor
        self._in: dict[int, _In] = {}  # incoming pairs being set up, by peer
        self._joining: dict[int, _In] = {}  # incoming streams before they named their pair, by descriptor
        self._auth: auth.Pending[Incoming] = auth.Pending()  # unauthenticated
        self._later: dict[int, float] = {}  # peer -> when to dial it (again)
        self._tries: dict[int, int] = {}
        self._dialing_since: dict[int, float] = {}  # peer -> when this rank first dialed it (not yet joined)
        self._pairs = itertools.count(1)
        self._listening_again = 0.0
        self._resting: list[socket.socket] = []  # listeners that wait for it to accept again
        self._refused = auth.Refusals(f"rank {self.rank} (listening on port {self.port})")
        self._closing = False
        self._thread: threading.Thread | None = None

    # -- what the engine and init see ---------------------------------------------------------
    @property
    def nsocks(self) -> int:
        """TCP streams this rank offers a pair (TENSORWIRE_NSOCKS, resolved by the engine)."""
        return self.engine.nsocks

    def learn(self, cards: dict[int, dict[str, Any]]) -> None:
        """Where the ranks of `cards` listen and run (topology.local_card and connect.py's fields)."""
        me = self.cards.get(self.rank) or cards.get(self.rank) or {}
        for r, card in cards.items():
            self.cards[r] = card
            if r != self.rank and self.local(card):
                self.engine.host_peers.add(r)
            if (r != self.rank and card.get("machine") == me.get("machine") and card.get("pidns")
                    and card.get("pidns") == me.get("pidns") and card.get("start", -1) > 0):
                self.procs[r] = (int(card["pid"]), int(card["start"]))

    def local(self, card: dict[str, Any]) -> bool:
        """Whether a rank of this card shares /dev/shm with this one (and may, by the settings)."""
        return self.cfg.transport != "tcp" and [card.get("host"), card.get("machine")] == self.where

    def planned_kind(self, peer: int) -> str:
        """'shm' where a pair with `peer` will use rings (unless /dev/shm turns it down), else 'tcp'."""
        card = self.cards.get(peer)
        return "shm" if card is not None and self.local(card) and self.rings.ring_max > 0 else "tcp"

    def address(self, peer: int) -> tuple[str, int]:
        """Where to dial `peer`: its loopback listener where it shares this host and network
        namespace (a connection the host's address cannot take with it), else its address."""
        card = self.cards[peer]
        if self.local(card) and card.get("loopback") and self.netns and card.get("netns") == self.netns:
            return _LOOPBACK, int(card["loopback"])
        return card["addr"], int(card["port"])

    def sharing_address(self, peer: int) -> list[int]:
        """The other ranks that listen at `peer`'s address (its host's), this one not among them."""
        addr = self.cards.get(peer, {}).get("addr")
        return [r for r, card in sorted(self.cards.items())
                if r not in (peer, self.rank) and addr is not None and card.get("addr") == addr]

    def gone(self, peer: int) -> str:
        """Why `peer`'s process is known to have exited ('' if it is not, or cannot be watched)."""
        proc = self.procs.get(peer)
        if proc is None or start_of(proc[0]) == proc[1]:
            return ""
        return f"its process (pid {proc[0]}) exited"

    def start(self, share: int, local: int) -> None:
        """Serve and connect from now on, this rank's rings taking at most `share` bytes of
        /dev/shm among its `local` ranks of this host (shm_budget.ring_share)."""
        self.rings.start(share, local, self.cfg.shm_ring_bytes)
        for listener in self.listeners:
            self._serve(listener)
        self._register(self._wake, self._on_wake)
        thread = threading.Thread(target=self._run, name="tensorwire-wiring", daemon=True)
        limits.start_thread(thread, f"rank {self.rank}: its wiring thread")
        self._thread = thread

    def want(self, peer: int) -> None:
        """Connect to `peer` (the engine holds a PendingChannel for it meanwhile)."""
        if self._closing:
            return
        self._want.append(peer)
        with contextlib.suppress(OSError, ValueError):
            os.eventfd_write(self._wake, 1)

    def shrink_rings(self) -> None:
        """Every ring this rank writes back to its first size, giving back the /dev/shm that a
        burst of large messages (calibration's) grew them to; they grow again with the traffic."""
        with self.engine.lock:
            for channel in self.engine.channel_list:
                if isinstance(channel, ShmChannel):
                    channel.shrink(self.rings.first)

    def close(self) -> None:
        """Stop connecting: no channel is installed after this returns."""
        self._closing = True
        with contextlib.suppress(OSError, ValueError):
            os.eventfd_write(self._wake, 1)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
        if thread is None or not thread.is_alive():
            self._release_all()

    # -- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._closing:
                now = time.monotonic()
                wake = self._next_wake(now)
                timeout = None if wake is None else max(0, int((wake - now) * 1000) + 1)
                for fd, _events in self._poll.poll(timeout):
                    handler = self._handlers.get(fd)
                    if handler is not None and not self._closing:
                        handler()
                self._on_time(time.monotonic())
        except BaseException as exc:  # the wiring itself broke: whatever waits for a pair must hear it
            _log.error("rank %d: the wiring thread failed: %r", self.rank, exc)
            error = exc if isinstance(exc, TensorwireError) else TensorwireError(
                f"rank {self.rank}: connecting to peers failed: {exc!r}")
            for peer in {*self._out, *self._in, *self._later, *self._want}:
                self.engine.peer_unreachable(peer, str(error), error)
        finally:
            self._release_all()

    def _register(self, fd: int, handler: Callable[[], None], events: int = _POLLIN) -> None:
        self._handlers[fd] = handler
        self._poll.register(fd, events)

    def _forget(self, sock: socket.socket) -> None:
        """Stop watching `sock` and close it (unregistered first: its number is reused at once)."""
        with contextlib.suppress(OSError, ValueError):
            fd = sock.fileno()
            if fd >= 0:
                self._handlers.pop(fd, None)
                with contextlib.suppress(KeyError):
                    self._poll.unregister(fd)
        with contextlib.suppress(OSError):
            sock.close()

    def _hand_over(self, sock: socket.socket) -> socket.socket:
        """Stop watching `sock`: it becomes a channel's."""
        fd = sock.fileno()
        self._handlers.pop(fd, None)
        with contextlib.suppress(KeyError):
            self._poll.unregister(fd)
        return sock

    def _next_wake(self, now: float) -> float | None:
        times = [*self._later.values()]
        times += [o.expires for o in self._out.values()] + [o.expires for o in self._streams.values()]
        oldest = self._auth.oldest()
        times += [oldest.expires] if oldest is not None else []
        times += [i.expires for i in self._in.values()]
        times += [i.expires for i in self._joining.values()]
        if self._listening_again:
            times.append(self._listening_again)
        return min(times, default=None)

    def _on_wake(self) -> None:
        with contextlib.suppress(OSError):
            os.eventfd_read(self._wake)
        while self._want:
            peer = self._want.popleft()
            if peer not in self._out and peer not in self._in and peer not in self._later:
                self._dial(peer)

    def _on_time(self, now: float) -> None:
        for peer in [p for p, t in self._later.items() if t <= now]:
            del self._later[peer]
            if peer not in self._out and peer not in self._in:
                self._dial(peer)
        for out in [o for o in self._out.values() if o.expires <= now]:
            self._attempt(out, functools.partial(out.dial.expired, now))
        for out in [o for o in self._streams.values() if o.expires <= now]:
            self._attempt(out, functools.partial(out.dial.expired, now))
        while (inc := self._auth.oldest()) is not None and inc.expires <= now:
            self._drop(inc, f"did not authenticate within {self.cfg.auth_timeout:g} s "
                            f"(TENSORWIRE_AUTH_TIMEOUT)")
        for link in [i for i in (*self._in.values(), *self._joining.values()) if i.expires <= now]:
            self._abandon_in(link, f"rank {link.peer} set up no pair within {self.cfg.auth_timeout:g} s")
        if self._listening_again and self._listening_again <= now:
            self._listening_again = 0.0
            while self._resting:
                self._serve(self._resting.pop())

    # -- dialing ------------------------------------------------------------------------------
    def _dial(self, peer: int) -> None:
        channel = self.engine.channels.get(peer)
        if self._closing or peer in self.engine.lost or (channel is not None and channel.kind != "pending"):
            return
        card = self.cards.get(peer)
        if card is None:
            self.engine.peer_unreachable(peer, "", RendezvousError(
                f"rank {self.rank}: rank {peer} is not among the ranks this rank knows the address of"))
            return
        self._dialing_since.setdefault(peer, time.monotonic())
        self._start_out(peer, self.address(peer), 0, next(self._pairs))

    def _start_out(self, peer: int, addr: tuple[str, int], index: int, pair: int,
                   primary: _Out | None = None) -> None:
        try:
            out = _Out(self, peer, addr, index, pair)
        except (Refused, Unreachable, Retry) as exc:
            self._failed_dial(peer, exc, primary)
            return
        except TensorwireError as exc:
            self._give_up(peer, exc, primary)
            return
        if index == 0:
            self._out[peer] = out
        else:
            assert primary is not None
            primary.streams.append(out)
            self._streams[out.sock.fileno()] = out
        self._register(out.sock.fileno(), lambda: self._attempt(out, functools.partial(self._on_out, out)),
                       _POLLOUT)

    def _attempt(self, out: _Out, step: Callable[[], None]) -> None:
        primary = out if out.index == 0 else self._out.get(out.peer)
        try:
            step()
        except (Refused, Unreachable, Retry) as exc:
            self._failed_dial(out.peer, exc, primary)
        except ConnectionError as exc:
            self._failed_dial(out.peer, Retry(str(exc)), primary)
        except (TensorwireError, OSError) as exc:
            what = f"{self.who}: connecting to rank {out.peer}"
            error = exc if isinstance(exc, TensorwireError) else limits.translate(exc, what)
            self._give_up(out.peer, error or TensorwireError(f"{what}: {exc}"), primary)
        except ValueError as exc:  # a malformed answer
            self._give_up(out.peer, RendezvousError(f"{self.who}: connecting to rank {out.peer}: its answer "
                                                    f"was not understood ({exc})"), primary)

    def _on_out(self, out: _Out) -> None:
        if out.msgs is None:
            if not out.dial.step():
                if not out.dial.connecting:
                    self._poll.modify(out.sock, _POLLIN)
                out.expires = out.dial.expires
                return
            self._poll.modify(out.sock, _POLLIN)
            out.msgs = Messages(out.sock)
            out.expires = time.monotonic() + self.cfg.auth_timeout
            if out.index:
                out.msgs.send({"op": "stream", "pair": out.pair, "index": out.index})
                return
            card = self.cards[out.peer]
            if self.local(card) and self.rings.ring_max:
                out.ring, why = self.rings.make(out.peer, self.rings.first, self.rings.first)
                if out.ring is None:
                    self.engine.shm_refused[out.peer] = why
            out.msgs.send({"op": "pair", "pair": out.pair, "where": self.where,
                           "ring": self.rings.offer(out.ring), "streams": self.nsocks})
            return
        msg = out.msgs.receive()
        if msg is None:
            return
        if out.index:
            if not msg.get("ok"):
                raise Retry(f"it did not take stream {out.index}: {msg.get('why')}")
            primary = self._out.get(out.peer)
            del self._streams[out.sock.fileno()]
            self._hand_over(out.sock)
            if primary is not None:
                primary.joined += 1
                self._maybe_install_out(primary)
            return
        if out.answer is None:
            self._answered(out, msg)

    def _answered(self, out: _Out, msg: dict) -> None:
        peer = out.peer
        if not msg.get("ok"):
            why = msg.get("why", "")
            self._drop_out(out)
            if why == "crossed":  # its own dial to this rank wins: wait for it (dial again if it never comes)
                self._later[peer] = time.monotonic() + _CROSSED_WAIT_S
                return
            text = msg.get("text", why)
            error: TensorwireError = ResourceError(text) if why == "descriptors" else \
                RendezvousError(f"{self.who}: rank {peer} refused a connection from this rank: {text}")
            self.engine.peer_unreachable(peer, "", error)
            return
        out.answer = msg
        out.expires = time.monotonic() + self.cfg.auth_timeout
        self._hand_over(out.sock)  # nothing more to read here: what the peer sends next is the channel's
        if out.ring is not None:
            out.ring.unlink()  # the peer mapped it or gave up: the name is no longer needed
        if out.ring is not None and msg.get("mapped") and msg.get("ring"):
            out.theirs, why, out.pid = self.rings.map(msg["ring"])
            if out.theirs is None:
                self.engine.shm_refused[peer] = why
            out.msgs.send({"mapped": out.theirs is not None, "reads": out.pid != 0})  # type: ignore[union-attr]
        elif out.ring is not None and self.local(self.cards[peer]):
            self.engine.shm_refused.setdefault(peer, 0)  # the peer made no ring (shm_refused there)
        shm = out.theirs is not None
        streams = 1 if shm else max(1, min(_count(msg, "streams", 1), self.nsocks))
        for index in range(1, streams):
            self._start_out(peer, self.address(peer), index, out.pair, out)
        self._maybe_install_out(out)

    def _maybe_install_out(self, out: _Out) -> None:
        if out.answer is None or out.joined < len(out.streams) or self._out.get(out.peer) is not out:
            return
        want = 1 if out.theirs is not None else max(1, min(_count(out.answer, "streams", 1), self.nsocks))
        if out.joined < want - 1:
            return
        del self._out[out.peer]
        self._tries.pop(out.peer, None)
        self._dialing_since.pop(out.peer, None)
        socks = [out.sock, *(s.sock for s in out.streams)]
        if out.theirs is not None:
            assert out.ring is not None
            self._install(out.peer, socks, out.ring, out.theirs, out.pid, bool(out.answer.get("reads")))
        else:
            if out.ring is not None:
                self.rings.discard(out.ring)
            self._install(out.peer, socks)

    def _failed_dial(self, peer: int, exc: Exception, primary: _Out | None) -> None:
        if primary is not None:
            self._drop_out(primary)
        if isinstance(exc, Refused):
            self.engine.peer_unreachable(peer, f"nobody listens at its address any more: it exited or left "
                                               f"the job ({exc})")
        elif isinstance(exc, Unreachable) and \
                time.monotonic() - self._dialing_since.get(peer, 0.0) >= self.cfg.peer_timeout:
            self.engine.peer_unreachable(peer, f"its host does not answer ({exc})")
        else:  # (unreachable for less than TENSORWIRE_PEER_TIMEOUT: an outage that may end)
            tries = self._tries[peer] = self._tries.get(peer, 0) + 1
            _log.info("rank %d: connecting to rank %d: %s; trying again", self.rank, peer, exc)
            self._later[peer] = time.monotonic() + min(_RETRY_S * 2 ** (tries - 1), _RETRY_MAX_S)

    def _give_up(self, peer: int, error: TensorwireError, primary: _Out | None) -> None:
        if primary is not None:
            self._drop_out(primary)
        self.engine.peer_unreachable(peer, "", error)

    def _drop_out(self, out: _Out) -> None:
        if self._out.get(out.peer) is out:
            del self._out[out.peer]
        for s in out.streams:
            self._streams.pop(s.sock.fileno(), None)
            self._forget(s.sock)
        self._forget(out.sock)
        for ring in (out.ring, out.theirs):
            if ring is not None:
                self.rings.discard(ring)
        out.ring = out.theirs = None

    # -- accepting ----------------------------------------------------------------------------
    def _serve(self, listener: socket.socket) -> None:
        self._register(listener.fileno(), functools.partial(self._on_listener, listener))

    def _on_listener(self, listener: socket.socket) -> None:
        for _ in range(auth.ACCEPT_BATCH):  # then the ready sockets, before the next batch
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE):
                    raise
                self._shed(exc, listener)
                return
            self._admit(sock, f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr))

    def _admit(self, sock: socket.socket, addr: str, reject: str = "") -> None:
        sock.setblocking(False)
        inc = Incoming(sock, addr, self.secret, self.job, self.rank, self.cfg.auth_timeout)
        fd = sock.fileno()
        self._auth.add(inc, inc.side)
        self._register(fd, lambda: self._on_incoming(fd, inc, reject))
        self._on_incoming(fd, inc, reject)  # a dialer's first message is often there already
        surplus = self._auth.surplus(limits.pending_bound(self.cfg.auth_pending), inc)
        if surplus is not None:
            self._drop(*surplus)

    def _shed(self, exc: OSError, listener: socket.socket) -> None:
        """No descriptor left to accept with: raise the soft limit where the hard one allows,
        else take the one held spare to tell the dialer, which then raises the error."""
        error = limits.translate(exc, f"rank {self.rank}: accepting a connection") or ResourceError(str(exc))
        if exc.errno == errno.EMFILE and limits.raise_soft_limit():
            return
        _log.warning("%s", error)
        self._handlers.pop(listener.fileno(), None)
        self._poll.unregister(listener.fileno())
        self._resting.append(listener)
        self._listening_again = time.monotonic() + _SHED_S
        if self._spare is None:
            return
        os.close(self._spare)
        self._spare = None
        try:
            sock, addr = listener.accept()
        except OSError:
            self._spare = _spare_descriptor()
            return
        self._admit(sock, str(addr), reject=str(error))

    def _drop(self, inc: Incoming, reason: str) -> None:
        self._auth.discard(inc)
        self._refused(inc.addr, reason)
        self._forget(inc.sock)

    def _turn_away(self, inc: Incoming, why: str, text: str) -> None:
        """Refuse an authenticated dial, logging `why` and telling the dialer `text` (as a setup
        answer: its dial then fails with it instead of trying again)."""
        with contextlib.suppress(OSError, ConnectionError):
            Messages(inc.sock).send({"ok": False, "why": "refused", "text": text})
        self._refused(inc.addr, why)
        self._forget(inc.sock)

    def _on_incoming(self, fd: int, inc: Incoming, reject: str) -> None:
        try:
            if not inc.step():
                return
        except (OSError, auth.HandshakeFailed) as exc:
            self._drop(inc, str(exc) or type(exc).__name__)
            return
        self._auth.discard(inc)
        size = self.engine.world_size
        if inc.world_size != size or not 0 <= inc.rank < size:
            self._turn_away(inc, f"rank {inc.rank} of a world of {inc.world_size} (this one has {size})",
                            f"it is rank {self.rank} of {size} ranks; this rank dialed as rank {inc.rank} "
                            f"of {inc.world_size}")
            return
        if inc.rank == self.rank:
            self._turn_away(inc, f"a connection that claims to be rank {inc.rank}, this rank",
                            f"this rank dialed as rank {inc.rank}, its own rank (two processes were "
                            f"given rank {inc.rank}?)")
            return
        link = _In(inc)
        link.reject = reject
        link.expires = time.monotonic() + self.cfg.auth_timeout
        self._joining[fd] = link
        self._handlers[fd] = lambda: self._on_in(link)

    def _on_in(self, link: _In) -> None:
        try:
            msg = link.msgs.receive()
            if msg is None:
                return
            if link.final:
                self._finished(link, msg)
            elif msg.get("op") == "pair":
                self._offered(link, msg)
            elif msg.get("op") == "stream":
                self._stream_joined(link, msg)
            else:
                raise ConnectionError(f"an unknown setup message {str(msg)[:80]}")
        except (OSError, ValueError) as exc:
            self._abandon_in(link, f"rank {link.peer}'s pair setup failed: {exc}")

    def _offered(self, link: _In, msg: dict) -> None:
        peer = link.peer
        self._joining.pop(link.sock.fileno(), None)
        if link.reject:
            link.msgs.send({"ok": False, "why": "descriptors",
                            "text": f"rank {self.rank} could not accept the connection from rank {peer}: "
                                    f"{link.reject}"})
            self._forget(link.sock)
            if self._spare is None:
                self._spare = _spare_descriptor()
            return
        channel = self.engine.channels.get(peer)
        if peer in self.engine.lost:
            link.msgs.send({"ok": False, "why": "lost",
                            "text": f"rank {self.rank} counts rank {peer} as lost "
                                    f"({self.engine.lost[peer]})"})
            self._forget(link.sock)
            return
        if channel is not None and channel.kind != "pending":
            link.msgs.send({"ok": False, "why": "have",
                            "text": f"rank {self.rank} is connected to a rank {peer} already: do two "
                                    f"processes claim that rank?"})
            self._forget(link.sock)
            return
        mine = self._out.get(peer)
        if mine is not None:
            if self.rank < peer:  # this rank's dial wins
                link.msgs.send({"ok": False, "why": "crossed"})
                self._forget(link.sock)
                return
            self._drop_out(mine)
        pair, streams = _count(msg, "pair", 0), _count(msg, "streams", 1)  # before anything is made for it
        self._later.pop(peer, None)
        self._dialing_since.pop(peer, None)
        old = self._in.pop(peer, None)
        if old is not None:
            self._abandon_in(old, "")
        link.pair = pair
        self._in[peer] = link
        link.expires = time.monotonic() + self.cfg.auth_timeout
        local = self.cfg.transport != "tcp" and msg.get("where") == self.where
        if local:
            self.engine.host_peers.add(peer)
        their_ring = msg.get("ring") if local else None
        if their_ring is not None:
            link.theirs, why, link.pid = self.rings.map(their_ring)
            if link.theirs is None:
                self.engine.shm_refused[peer] = why
            elif self.rings.ring_max:
                link.ring, why = self.rings.make(peer, self.rings.first, self.rings.first)
                if link.ring is None:
                    self.engine.shm_refused[peer] = why
        elif local:
            self.engine.shm_refused.setdefault(peer, 0)
        if link.theirs is not None and link.ring is None:
            self.rings.discard(link.theirs)
            link.theirs = None
        shm = link.ring is not None
        link.want_streams = 1 if shm else max(1, min(streams, self.nsocks))
        link.msgs.send({"ok": True, "mapped": link.theirs is not None, "reads": link.pid != 0,
                        "ring": self.rings.offer(link.ring), "streams": link.want_streams})
        link.final = shm
        if not shm:
            self._maybe_install_in(link)

    def _finished(self, link: _In, msg: dict) -> None:
        """The dialer's last word on the rings: whether it mapped this rank's."""
        link.final = False
        assert link.ring is not None and link.theirs is not None
        link.ring.unlink()
        if not msg.get("mapped"):
            self.engine.shm_refused.setdefault(link.peer, 0)
            self.rings.discard(link.ring)
            self.rings.discard(link.theirs)
            link.ring = link.theirs = None
            link.want_streams = 1
        link.reads = bool(msg.get("reads"))
        self._maybe_install_in(link)

    def _stream_joined(self, link: _In, msg: dict) -> None:
        fd = link.sock.fileno()
        self._joining.pop(fd, None)
        primary = self._in.get(link.peer)
        if primary is None or primary.pair != msg.get("pair") \
                or len(primary.streams) >= primary.want_streams - 1:
            link.msgs.send({"ok": False, "why": "no such pair being set up"})
            self._forget(link.sock)
            return
        link.msgs.send({"ok": True})
        primary.streams.append((_count(msg, "index", 0), self._hand_over(link.sock)))
        self._maybe_install_in(primary)

    def _maybe_install_in(self, link: _In) -> None:
        if link.final or len(link.streams) < link.want_streams - 1 or self._in.get(link.peer) is not link:
            return
        del self._in[link.peer]
        socks = [self._hand_over(link.sock), *(sock for _, sock in sorted(link.streams, key=lambda s: s[0]))]
        if link.ring is not None and link.theirs is not None:
            self._install(link.peer, socks, link.ring, link.theirs, link.pid, link.reads)
        else:
            self._install(link.peer, socks)

    def _abandon_in(self, link: _In, why: str) -> None:
        if why:
            _log.info("rank %d: %s", self.rank, why)
        self._joining.pop(link.sock.fileno(), None)
        if self._in.get(link.peer) is link:
            del self._in[link.peer]
            channel = self.engine.channels.get(link.peer)
            wanted = channel is not None and channel.kind == "pending"
            if wanted and link.peer not in self._out:  # this rank waits for the pair: dial it itself
                self._later.setdefault(link.peer, time.monotonic() + _RETRY_S)
        for sock in (link.sock, *(sock for _, sock in link.streams)):
            self._forget(sock)
        for ring in (link.ring, link.theirs):
            if ring is not None:
                self.rings.discard(ring)
        link.ring = link.theirs = None

    # -- channels -----------------------------------------------------------------------------
    def _install(self, peer: int, socks: list[socket.socket], out: Ring | None = None,
                 inn: Ring | None = None, pid: int = 0, reads: bool = False) -> None:
        engine, cfg = self.engine, self.cfg
        try:
            for sock in socks:
                tune_socket(sock, cfg)
        except TensorwireError as exc:
            for sock in socks:
                sock.close()
            engine.peer_unreachable(peer, "", exc)
            return
        streams = [SocketStream(sock, peer, engine, cfg.tcp_chunk_bytes, cfg.max_message) for sock in socks]
        if out is not None and inn is not None:
            channel: Channel = ShmChannel(streams[0], out, inn, engine, pid, reads, self.rings.source(peer),
                                      self.rings.ring_max)
        else:
            channel = TcpChannel(streams)
        if not engine.install(peer, channel):
            channel.close()
            return
        _log.info("rank %d connected to rank %d (%s%s)", self.rank, peer, channel.kind,
                  f", {len(streams)} streams" if len(streams) > 1 else "")

    def _release_all(self) -> None:
        for out in [*self._out.values()]:
            self._drop_out(out)
        for link in [*self._in.values(), *self._joining.values()]:
            self._abandon_in(link, "")
        for inc in self._auth:
            self._auth.discard(inc)
            with contextlib.suppress(OSError):
                inc.sock.close()
        for listener in self.listeners:
            with contextlib.suppress(OSError):
                listener.close()
        for fd in (self._wake, self._spare):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake, self._spare = -1, None

    @staticmethod
    def _listen(address: str, world_size: int) -> socket.socket:
        try:
            sock = socket.create_server((address, 0), backlog=max(world_size, 16))
        except OSError as exc:
            raise limits.translate(exc, f"listening on {address}") or \
                RendezvousError(f"cannot listen on {address}: {exc}") from exc
        sock.setblocking(False)
        return sock

    def _listen_loopback(self, world_size: int) -> socket.socket | None:
        """The listener for this host's pairs (None where loopback cannot be listened on: they
        dial the address then)."""
        try:
            return self._listen(_LOOPBACK, world_size)
        except TensorwireError as exc:
            _log.info("rank %d: pairs on this host dial its address: %s", self.rank, exc)
            return None


def _spare_descriptor() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
