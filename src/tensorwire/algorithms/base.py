"""What an algorithm sees: group-relative point-to-point steps, never sockets or headers."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..ops import ReduceOp


class Request(Protocol):
    done: bool


class P2P(Protocol):
    """One collective call's view of its group (implemented by group.CollectiveCall).

    `step` tags a message within the call; the call supplies the group, sequence number and
    fingerprint. Messages between the same two ranks with the same step arrive in order.
    """

    rank: int
    size: int

    def isend(self, peer: int, data: np.ndarray, step: int) -> Request: ...

    def irecv(self, peer: int, data: np.ndarray, step: int, reduce: ReduceOp | None = None) -> Request: ...

    def wait(self, *reqs: Request) -> None: ...


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
