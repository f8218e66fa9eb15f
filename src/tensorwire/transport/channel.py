"""What the progress engine needs from the channel to one peer, and what a channel needs from it.

Every peer the engine talks to has one `Channel`: shared-memory rings (shm.ShmChannel, which
also reads large point-to-point payloads across processes, cma.py), sockets (tcp.TcpChannel),
or a `PendingChannel` while the wiring connects the pair. The fast paths only some channels
have are declared here with the answer "none", so the engine reads an attribute, never probes.
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np

from .requests import Request, SendRequest, Sink
from .wire import Header

if TYPE_CHECKING:
    from .pumps import Pumps
    from .tcp import SocketStream


class PeerClosed(Exception):
    """Raised inside a channel when its socket reached EOF or broke."""


class ChannelOwner(Protocol):
    """The engine as its channels see it: where arriving messages go."""

    rank: int
    pumps: Pumps | None
    """The threads that move large TCP parts (None: the rank's own thread moves every byte)."""
    native: ModuleType | None
    """The compiled inner loops (transport/native.py), or None."""
    refused_as_posted: int
    """Sends a channel failed as they were posted, for a limit (TcpChannel.post)."""
    departed: set[int]
    """Peers that said goodbye: they read nothing more."""

    def match(self, peer: int, header: Header, remote: bool = False) -> Sink:
        """The sink for an arriving message (`remote`: its payload stays in the sender's memory)."""

    def may_park(self, peer: int, header: Header) -> bool:
        """May a large message wait in its ring for its receive (shm.PARK_BYTES)?"""

    def watch_in_background(self, req: Request) -> None:
        """Keep `req` progressing while nobody waits on it."""


class Channel(ABC):
    """Everything to one peer: posting, progress both ways, and what the engine reads at a loss."""

    kind: ClassVar[str]
    """'shm', 'tcp' or 'pending'."""
    direct: ClassVar[bool] = False
    """`exchange_now` works (a shared-memory ring): the engine calls it only then."""
    read_bytes = 0
    """A receive from this size may find its message in the peer's memory, `take_read` reading it
    there (shared memory, the compiled loops, the peer readable); 0: never."""
    sends_now: ClassVar[bool] = False
    """`put_now` works (a ring, or sockets): a small message handed over whole, with no request."""
    takes_now: ClassVar[bool] = False
    """`take_now` works (a ring, or sockets): a small message read straight into place, with no request."""
    peer: int
    sockets: Sequence[socket.socket] = ()
    """What a sleeping waiter selects on: data, control messages and a closed peer wake it."""
    streams: Sequence[SocketStream] = ()
    """The pair's socket streams: what a closed one still holds is read at its peer's loss (a goodbye)."""
    queue: Sequence[tuple[SendRequest, bool]] = ()
    """What was posted before the pair was connected, in order, as (request, control message?)."""
    parked: Header | None = None
    """The header of a large message left in the channel until its receive is posted (shm.PARK_BYTES)."""
    release: bool = False
    """Stage the parked message at the next progress (Engine.release_parked)."""

    @abstractmethod
    def post(self, req: SendRequest) -> None:
        """Queue a data message, after every one posted before."""

    @abstractmethod
    def post_control(self, req: SendRequest) -> None:
        """Queue a control message (abort, goodbye, query) on the socket."""

    @abstractmethod
    def progress(self) -> bool:
        """Write what the peer can take and read what arrived; True if any byte moved."""

    @abstractmethod
    def flush(self) -> None:
        """Hand queued sends on, reading nothing."""

    @abstractmethod
    def poll_socket(self) -> bool:
        """Push and read the socket (control messages, a closed peer)."""

    @abstractmethod
    def queued(self) -> bool:
        """Sends this process has yet to hand on."""

    @abstractmethod
    def pending(self) -> list[SendRequest]:
        """Sends not finished yet."""

    @abstractmethod
    def close(self) -> None:
        """Release the channel's sockets and memory."""

    def blocked_writers(self) -> list[socket.socket]:
        """The sockets whose queued sends wait for room in the kernel: a sleeping waiter also
        wakes when one can take more (none where sends go through a ring)."""
        return []

    def put_now(self, wire_header: bytes, payload: np.ndarray) -> bool:
        """Write a small point-to-point message whole, with no request; False: post it instead."""
        return False

    def take_now(self, wire_header: bytes, dst: np.ndarray, spin_s: float = 0.0) -> bool | None:
        """Read the next message straight into `dst` if it is `wire_header`'s, waiting for it
        up to `spin_s`; None: not there yet, False: receive the general way."""
        return False


class PendingChannel(Channel):
    """A peer's place in the engine while the wiring connects to it: keeps what is posted, in
    order, for the channel that replaces it (Engine.install)."""

    kind = "pending"

    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.queue: list[tuple[SendRequest, bool]] = []

    def post(self, req: SendRequest) -> None:
        self.queue.append((req, False))

    def post_control(self, req: SendRequest) -> None:
        self.queue.append((req, True))

    def progress(self) -> bool:
        return False

    def flush(self) -> None:
        pass

    def poll_socket(self) -> bool:
        return False

    def pending(self) -> list[SendRequest]:
        return [req for req, _ in self.queue]

    def queued(self) -> bool:
        return bool(self.queue)

    def close(self) -> None:
        self.queue.clear()
