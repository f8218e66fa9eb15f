"""The compressed all_reduce of a group over hosts: the hierarchical all_reduce, exact within
each host, whose shares cross between hosts as 16-bit floats (ops/compress.py).

Along a rail of H hosts a share is cut in H blocks. Step one, an all_to_all: each host sends
block j, encoded, to the rail's rank j, which adds what it received to its own block in the
input's precision. Step two, an all-gather: each rank encodes its summed block once and every
rank of the rail, the owner included, decodes the same words. Every rank thus holds the same
values, and a host's link carries half the bytes of the exact crossing (a quarter from
float64): (H-1)/H of a share each way per step, in 16 bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ops import ReduceOp
from ..ops.compress import WORD, Codec, words_for
from .base import P2P, offsets_of, split_counts
from .hierarchical import Crossing, all_reduce_cost, hierarchical_all_reduce, naming, time_left
from .prices import COPY, Link, LocalPrice, RailPrice, Shape


class CompressedCrossing(Crossing):
    """The two steps above; a piece's state is (its rail's Work or None, its block bounds,
    the words received)."""

    steps = 2

    def __init__(self, codec: Codec) -> None:
        super().__init__(ReduceOp.SUM)
        self.codec = codec

    def itemsize(self, data: np.ndarray) -> int:
        return WORD.itemsize

    def step(self, k: int, rail: Any, share: np.ndarray, state: Any, pipelined: bool, p2p: P2P) -> Any:
        codec, me = self.codec, rail.rank
        if k == 0:
            offs = offsets_of(split_counts(share.size, rail.size))
            width = words_for(max(b - a for a, b in zip(offs[:-1], offs[1:])))
            sent = np.zeros((rail.size, width), WORD)  # a shorter block's padding: zeros, not old memory
            for j in range(rail.size):
                if j != me:
                    codec.encode(share[offs[j]:offs[j + 1]], sent[j, :words_for(offs[j + 1] - offs[j])])
            got = np.empty_like(sent)
            work = rail.all_to_all_single(got, sent, async_op=pipelined, timeout=time_left(p2p))
            return work if pipelined else None, offs, got
        work, offs, got = state
        if work is not None:
            work.wait(time_left(p2p))
        mine = share[offs[me]:offs[me + 1]]
        n = words_for(mine.size)
        for j in range(rail.size):  # the rail's ranks are its hosts, in order
            if j != me:
                codec.decode(got[j, :n], mine, add=True)
        words = np.zeros(got.shape[1], WORD)
        codec.encode(mine, words[:n])
        work = rail.all_gather_into_tensor(got, words, async_op=pipelined, timeout=time_left(p2p))
        return work if pipelined else None, offs, got

    def finish(self, rail: Any, share: np.ndarray, state: Any, p2p: P2P) -> None:
        work, offs, got = state
        if work is not None:
            work.wait(time_left(p2p))
        for j in range(rail.size):
            codec_words = got[j, :words_for(offs[j + 1] - offs[j])]
            self.codec.decode(codec_words, share[offs[j]:offs[j + 1]])


@naming
def compressed_all_reduce(p2p: P2P, data: np.ndarray, op: ReduceOp, src: np.ndarray | None,
                          codec: Codec) -> None:
    """A SUM or AVG (finished by the caller) of float32/float64 `data` on a group over hosts."""
    hierarchical_all_reduce(p2p, data, op, src, CompressedCrossing(codec))


CASTS = 3
"""Passes over a share's bytes the casts cost: encoding it, decoding and adding what came, and
decoding the result (each block's encode and decode is a fraction of one)."""


def compressed_cost(s: Shape, m: int, local: LocalPrice, rail: RailPrice, link: Link | None = None,
                    itemsize: int = 4) -> float:
    """The hierarchical all_reduce's price with its crossing in two steps that each move
    (H-1)/H of a share in 16 bits (an all_to_all, then an all-gather), plus the casts."""
    def across(m_k: int) -> float:
        share = m_k // s.rails
        wire = share * WORD.itemsize // itemsize
        return (rail("all_to_all", s.hosts, wire, s.nic_share)
                + rail("all_gather", s.hosts, wire, s.nic_share) + CASTS * local(COPY, 1, share))
    return all_reduce_cost(s, m, local, rail, link, across, WORD.itemsize / itemsize)
