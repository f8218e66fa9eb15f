"""Direct (linear) algorithms: every rank talks to the root, or to every other rank pairwise."""

from __future__ import annotations

import numpy as np

from .base import P2P


def direct_gather(p2p: P2P, send: np.ndarray, recv_blocks: list[np.ndarray] | None, root: int) -> None:
    """The root posts all receives at once; order of arrival does not matter."""
    if p2p.rank != root:
        p2p.wait(p2p.isend(root, send, 0))
        return
    assert recv_blocks is not None
    reqs = [p2p.irecv(peer, recv_blocks[peer], 0) for peer in range(p2p.size) if peer != root]
    if recv_blocks[root] is not send:
        np.copyto(recv_blocks[root], send)
    p2p.wait(*reqs)


def direct_scatter(p2p: P2P, send_blocks: list[np.ndarray] | None, recv: np.ndarray, root: int) -> None:
    if p2p.rank != root:
        p2p.wait(p2p.irecv(root, recv, 0))
        return
    assert send_blocks is not None
    reqs = [p2p.isend(peer, send_blocks[peer], 0) for peer in range(p2p.size) if peer != root]
    if send_blocks[root] is not recv:
        np.copyto(recv, send_blocks[root])
    p2p.wait(*reqs)


def pairwise_all_to_all(p2p: P2P, send_blocks: list[np.ndarray], recv_blocks: list[np.ndarray]) -> None:
    """Step s: send to rank+s, receive from rank-s; one partner pair per step, n-1 steps."""
    n, r = p2p.size, p2p.rank
    np.copyto(recv_blocks[r], send_blocks[r])
    for s in range(1, n):
        dst, src = (r + s) % n, (r - s) % n
        p2p.wait(p2p.isend(dst, send_blocks[dst], s), p2p.irecv(src, recv_blocks[src], s))


def dissemination_barrier(p2p: P2P) -> None:
    """ceil(log2 n) rounds of empty messages at distance 1, 2, 4, ..."""
    n, r = p2p.size, p2p.rank
    empty = np.empty(0, dtype=np.uint8)
    dist, step = 1, 0
    while dist < n:
        p2p.wait(p2p.isend((r + dist) % n, empty, step), p2p.irecv((r - dist) % n, empty, step))
        dist <<= 1
        step += 1
