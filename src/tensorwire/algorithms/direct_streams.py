"""The direct path's calls whose message does not fit a rank's slot of the group's segment:
streamed through it in pieces (broadcast, all_gather, all_reduce, all_to_all)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..buffers import copy
from ..errors import InvalidArgumentError
from ..ops.kernels import fold
from ..transport.backoff import Backoff
from ..transport.segment import CHUNK_BITS, WRITTEN, DirectPath
from .base import DirectCall

STREAM_CHUNK = 512 << 10
"""A broadcast, all_gather block or all_to_all send that does not fit a rank's slot streams
through it in pieces of up to this size (whole pages): readers copy one piece out while its
source copies the next in, and a message of any size fits, the source refilling its slot as
the slowest reader empties it (docs/design/segment.md)."""


class _Stream:
    """One streamed call: each source's bytes pass through its slot as a ring of steps. Step c
    holds piece c of each of the source's `width` streams (one per reader for all_to_all) and
    goes to position c % ring once every reader has read step c - ring; each rank counts the
    steps it wrote and the steps it read (of every source) in its progress words. Every rank
    publishes its flag on entry, so a waiting rank can check what a peer called."""

    def __init__(self, dp: DirectPath, call: DirectCall, nbytes: int, width: int = 1) -> None:
        share = dp.slot_bytes // width
        chunk = min(STREAM_CHUNK, share // 4096 * 4096 or share // 64 * 64)  # pages: see segment.SLOT_SHIFT
        if -(-nbytes // chunk) >> CHUNK_BITS:
            raise InvalidArgumentError(
                f"{call.what}: {nbytes} bytes is more than {1 << CHUNK_BITS} pieces of "
                f"{chunk} bytes through this group's shared-memory slot (raise TENSORWIRE_SHM_DIRECT)")
        self.dp, self.call, self.chunk = dp, call, chunk
        self.step = chunk * width
        self.ring = dp.slot_bytes // self.step
        self.pieces = range(0, nbytes, chunk)
        self.parity = p = dp.enter(call)
        dp.publish(call, p)
        self.ab = dp.prev_fp
        self.base = call.seq << CHUNK_BITS
        self.backoff: Backoff | None = None

    def write(self, c: int, pieces: tuple[np.ndarray, ...], readers: tuple[int, ...]) -> None:
        """Step c (piece c of each stream) into this rank's slot, once `readers` have read
        step c - ring."""
        dp = self.dp
        if c >= self.ring:
            self.backoff = dp.await_readers(self.call, readers, c - self.ring + 1, self.parity, self.ab,
                                            self.backoff)
        at, slot = c % self.ring * self.step, dp.seg.slots[dp.rank][self.parity]
        for piece in pieces:
            slot[at:at + piece.size] = piece
            at += self.chunk
        dp.words[dp.own + WRITTEN] = self.base + c + 1

    def read(self, c: int, source: int, piece: np.ndarray, stream: int = 0) -> None:
        """Piece c of `source`'s stream number `stream` out of its slot, once it is there."""
        piece[...] = self.piece(c, source, piece.size, stream)

    def piece(self, c: int, source: int, nbytes: int, stream: int = 0) -> np.ndarray:
        """The bytes of piece c of `source`'s stream `stream` in its slot, once they are there."""
        dp = self.dp
        if source != dp.rank:
            self.backoff = dp.await_progress(self.call, source, WRITTEN, self.base + c + 1, self.parity,
                                             self.ab, self.backoff)
            if c == 0:  # its stamps were published before its first piece
                dp.check_stamp(self.call, source, self.parity, self.ab)
        at = c % self.ring * self.step + stream * self.chunk
        return dp.seg.slots[source][self.parity][at:at + nbytes]

    def done_reading(self, c: int) -> None:
        self.dp.mark_read(self.call, c + 1)


def stream_broadcast(dp: DirectPath, call: DirectCall, raw: np.ndarray, root: int) -> None:
    stream = _Stream(dp, call, raw.size)
    chunk = stream.chunk
    for c, lo in enumerate(stream.pieces):
        if dp.rank == root:
            stream.write(c, (raw[lo:lo + chunk],), dp.others)
        else:
            stream.read(c, root, raw[lo:lo + chunk])
            stream.done_reading(c)


def stream_all_gather(dp: DirectPath, call: DirectCall, raws: list[np.ndarray]) -> None:
    """Every rank a source of its block: write piece c of it, then read piece c of the others'."""
    stream = _Stream(dp, call, raws[0].size)
    chunk, me = stream.chunk, dp.rank
    for c, lo in enumerate(stream.pieces):
        stream.write(c, (raws[me][lo:lo + chunk],), dp.others)
        for r in dp.others:
            stream.read(c, r, raws[r][lo:lo + chunk])
        stream.done_reading(c)


def stream_all_reduce(dp: DirectPath, call: DirectCall, src: np.ndarray, dst: np.ndarray,
                      kernel: Any) -> None:
    """Every rank a source of its whole input: write piece c of it, then fold piece c of every
    slot, in rank order, into the same piece of the result (dst may be src: piece c of src is
    in the slot before it is overwritten)."""
    stream = _Stream(dp, call, src.nbytes)
    chunk, dtype, size = stream.chunk, src.dtype, src.itemsize
    raw = src.view(np.uint8)
    for c, lo in enumerate(stream.pieces):
        piece = raw[lo:lo + chunk]
        stream.write(c, (piece,), dp.others)
        fold(tuple(stream.piece(c, r, piece.size).view(dtype) for r in dp.everyone),
              dst[lo // size:(lo + piece.size) // size], kernel)
        stream.done_reading(c)


def stream_all_to_all(dp: DirectPath, call: DirectCall, sends: list[np.ndarray],
                      recvs: list[np.ndarray]) -> None:
    """Every rank a source of n-1 streams, one per reader: rank s's stream k is for rank
    s + 1 + k (mod n), so reader r finds its own at k = r - s - 1 (mod n)."""
    n, me = dp.size, dp.rank
    copy(recvs[me], sends[me])
    stream = _Stream(dp, call, sends[0].size, n - 1)
    chunk = stream.chunk
    readers = dp.onward
    for c, lo in enumerate(stream.pieces):
        stream.write(c, tuple(sends[r][lo:lo + chunk] for r in readers), readers)
        for s in readers:
            stream.read(c, s, recvs[s][lo:lo + chunk], (me - s - 1) % n)
        stream.done_reading(c)
