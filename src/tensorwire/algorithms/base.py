"""What an algorithm sees: group-relative point-to-point steps, never sockets or headers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np

from ..buffers import address
from ..ops import ReduceOp
from .prices import Link

if TYPE_CHECKING:
    from ..transport.segment import DirectPath
    from ..transport.wire import Fingerprint


class Request(Protocol):
    done: bool


R = TypeVar("R", bound=Request)
"""A P2P's own request type: it waits only on the requests it made."""


class P2P(Protocol[R]):
    """One collective call's view of its group (implemented by group.CollectiveCall).

    `step` tags a message within the call; the call supplies the group, sequence number and
    fingerprint. Messages between the same two ranks with the same step arrive in order.
    """

    rank: int
    size: int

    @property
    def link(self) -> Link:
        """The group's link constants, which the tuner priced the call with: an algorithm that
        sizes its steps by them (chain.segment_count) gets the same on every rank."""

    @property
    def fp(self) -> Fingerprint | None:
        """The call's fingerprint, the same on every member: what an algorithm may decide its
        schedule by where the ranks' own arguments differ (bruck's vector all_to_all); None for
        a caller with no collective call behind it."""

    def isend(self, peer: int, data: np.ndarray, step: int) -> R: ...

    def irecv(self, peer: int, data: np.ndarray, step: int, reduce: ReduceOp | None = None,
              base: np.ndarray | None = None) -> R:
        """With `reduce`, the payload is reduced into `data` (or, with `base`, data = base op
        payload) as it arrives."""

    def wait(self, *reqs: R) -> None: ...

    def exchange_now(self, dst: int | None, send: np.ndarray | None, src: int, recv: np.ndarray, step: int,
                     reduce: ReduceOp | None = None, base: np.ndarray | None = None) -> tuple[bool, bool]:
        """A small exchange (or, with `send` None, a receive) done at once where the transport
        can, with no request: (sent, received); what is not done is left to isend/irecv.
        (False, False) is always correct."""


class DirectGroup(Protocol):
    """What the one-shot and single-copy paths use of a call's group."""

    name: str
    direct_plans: dict[tuple, Any]
    """The plans of unplanned all_reduces' signatures (shm_direct.direct_all_reduce)."""

    @property
    def direct(self) -> DirectPath:
        """The group's shared segment: these paths' algorithms are registered `needs_direct`,
        so it is there wherever they run."""


class DirectCall(Protocol):
    """What the one-shot path (shm_direct.py, direct_plans.py, direct_streams.py) and single
    copy (single_copy.py) use of a call in place of P2P's messages (implemented by
    group.CollectiveCall): the group's segment, the call's number and fingerprint (stamped
    beside its flag), its name and label for errors, and its deadline, which such a call
    starts only once it waits."""

    seq: int
    fp: Fingerprint
    name: str

    @property
    def group(self) -> DirectGroup: ...

    @property
    def what(self) -> str: ...

    def number(self, seq: int) -> int:
        """The user's number of the group's call `seq` (errors name it)."""

    def started(self) -> DirectCall:
        """The call with its deadline running."""


def exchange(p2p: P2P, dst: int, send: np.ndarray, src: int, recv: np.ndarray, step: int,
             reduce: ReduceOp | None = None, base: np.ndarray | None = None) -> None:
    """One step: `send` to dst, `recv` from src (reduced into it with `reduce`). The receive is
    posted first, so the peer's bytes go straight from the ring or socket into `recv`: posted
    after the send (whose progress already drains the channel) they would often arrive
    unexpected and take a detour through a fresh buffer and a second copy. A small step often
    needs neither request (`exchange_now`)."""
    sent, received = p2p.exchange_now(dst, send, src, recv, step, reduce, base)
    if received:
        return
    recv_req = p2p.irecv(src, recv, step, reduce, base)
    if sent:
        p2p.wait(recv_req)
    else:
        p2p.wait(recv_req, p2p.isend(dst, send, step))


def receive(p2p: P2P, src: int, recv: np.ndarray, step: int, reduce: ReduceOp | None = None,
            base: np.ndarray | None = None) -> None:
    """A blocking receive: taken at once where it is small and comes soon (`exchange_now`),
    else posted and waited for."""
    if not p2p.exchange_now(None, None, src, recv, step, reduce, base)[1]:
        p2p.wait(p2p.irecv(src, recv, step, reduce, base))


def split_counts(total: int, parts: int) -> list[int]:
    """Near-equal split: the first `total % parts` parts get one more element."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def blocks_of(flat: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    """Consecutive views of `flat` with the given element counts (no copies)."""
    out, start = [], 0
    for c in counts:
        out.append(flat[start:start + c])
        start += c
    return out


def offsets_of(counts: list[int]) -> list[int]:
    """Prefix sums: block i spans elements [offsets[i], offsets[i + 1]) of a packed buffer."""
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def contiguous_span(blocks: list[np.ndarray], writable: bool = True) -> np.ndarray | None:
    """One flat view over `blocks` when they lie back to back in one array, else None.

    The single-tensor and vector forms of a collective (all_gather_into_tensor, all_gatherv,
    reduce_scatter_tensor) hand algorithms consecutive views of one buffer; an algorithm that
    moves ranges of blocks as single messages can then work in that buffer instead of staging
    through a scratch copy. Empty blocks occupy no bytes and may point anywhere.
    """
    ref = None
    addr = total = 0
    for b in blocks:
        if b.nbytes == 0:
            continue
        if ref is None:
            ref, addr = b, address(b)
        if b.dtype != ref.dtype or not b.flags.c_contiguous or address(b) != addr + total:
            return None
        total += b.nbytes
    if ref is None:
        return blocks[0].reshape(-1)[:0]
    owner = ref
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    if not owner.flags.c_contiguous or (writable and not owner.flags.writeable):
        return None
    start = addr - address(owner)
    if start < 0 or start + total > owner.nbytes:
        return None
    return owner.reshape(-1).view(np.uint8)[start:start + total].view(ref.dtype)


def packed(blocks: list[np.ndarray]) -> np.ndarray:
    """The blocks back to back in a new buffer (or the span they already form, read-only use)."""
    span = contiguous_span(blocks, writable=False)
    if span is not None:
        return span
    out = np.empty(sum(b.size for b in blocks), dtype=blocks[0].dtype)
    start = 0
    for b in blocks:
        out[start:start + b.size] = b
        start += b.size
    return out
