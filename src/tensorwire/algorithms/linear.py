"""Linear gather and scatter: the root exchanges with every other rank directly, all at once."""

from __future__ import annotations

import numpy as np

from .base import P2P
from .registry import Algorithm, Link, register


def linear_gather(p2p: P2P, send: np.ndarray, recv_blocks: list[np.ndarray] | None, root: int) -> None:
    """The root posts all receives at once; order of arrival does not matter."""
    if p2p.rank != root:
        p2p.wait(p2p.isend(root, send, 0))
        return
    assert recv_blocks is not None
    reqs = [p2p.irecv(peer, recv_blocks[peer], 0) for peer in range(p2p.size) if peer != root]
    if recv_blocks[root] is not send:
        np.copyto(recv_blocks[root], send)
    p2p.wait(*reqs)


def linear_scatter(p2p: P2P, send_blocks: list[np.ndarray] | None, recv: np.ndarray, root: int) -> None:
    if p2p.rank != root:
        p2p.wait(p2p.irecv(root, recv, 0))
        return
    assert send_blocks is not None
    reqs = [p2p.isend(peer, send_blocks[peer], 0) for peer in range(p2p.size) if peer != root]
    if send_blocks[root] is not recv:
        np.copyto(recv, send_blocks[root])
    p2p.wait(*reqs)


def _linear_cost(n: int, nbytes: int, link: Link) -> float:
    """The root handles n-1 messages of nbytes/n each, serialised on its link."""
    return (n - 1) * (link.alpha + nbytes / n * link.beta)


register(Algorithm("linear", "gather", linear_gather, _linear_cost))
register(Algorithm("linear", "scatter", linear_scatter, _linear_cost))
