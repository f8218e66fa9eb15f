"""Single copy on one host: readers copy large messages straight out of their source's buffer.

An all_gather or all_to_all on the direct path moves every byte twice, into the source's slot
and out of it (one shot or streamed). Here a source publishes the addresses of its buffers in
its slot instead, each reader copies what it needs directly out of the source process
(cross-memory attach, transport/cma.py) and then marks itself done in its progress word; a
source returns only once its readers are done, as its buffer must not change under them. Two
flag rounds, and one copy of each byte received. Mismatched calls are caught as on the direct
path: every rank publishes its fingerprint first, and a source waiting for a reader checks
what that reader published.
"""

from __future__ import annotations

import numpy as np

from ..buffers import copy
from .registry import Algorithm, register
from .shm_direct import MEMORY_COST, DirectPath, volume_cost

_WORD = np.dtype(np.uint64)


def _offer(dp: DirectPath, call, buffers: list[np.ndarray], wait_for: tuple[int, ...]) -> int:
    """Enter, publish the addresses of `buffers` (one per reader, or one for all), and wait
    for `wait_for` to publish theirs; the call's slot parity."""
    p = dp.enter(call)
    table = dp.views(_WORD, dp.size)[p][dp.rank]
    for i, b in enumerate(buffers):
        table[i] = b.ctypes.data
    dp.publish(call, p, wait_for)
    return p


def _fetch(dp: DirectPath, p: int, source: int, index: int, dst: np.ndarray) -> None:
    """Copy buffer `index` of the table `source` published into `dst`."""
    remote = int(dp.views(_WORD, dp.size)[p][source][index])
    dp.reader.read_into(dst, dp.pids[source], remote)


def _finish(dp: DirectPath, call, p: int, readers: tuple[int, ...]) -> None:
    """Mark this rank's reads done; wait until `readers` are done with this rank's buffers."""
    dp.mark_read(call, 1)
    dp.await_readers(call, readers, 1, p, dp.prev_fp, None)


def single_copy_all_gather(call, blocks: list[np.ndarray]) -> None:
    dp = call.group.direct
    p = _offer(dp, call, [blocks[dp.rank]], dp.everyone)
    for r in dp.onward:
        _fetch(dp, p, r, 0, blocks[r])
    _finish(dp, call, p, dp.others)


def single_copy_all_to_all(call, sends: list[np.ndarray], recvs: list[np.ndarray]) -> None:
    dp = call.group.direct
    p = _offer(dp, call, sends, dp.everyone)
    copy(recvs[dp.rank], sends[dp.rank])
    for r in dp.onward:
        _fetch(dp, p, r, dp.rank, recvs[r])
    _finish(dp, call, p, dp.others)


# Cost: two flag rounds, this rank's own all_to_all block copied and the bytes it reads out
# of its peers, each at the price of a byte that does not stay in cache (MEMORY_COST). So
# priced, single copy is chosen from 1-2 MiB at n=2; measured interleaved (15 calls each),
# the slots' one shot was faster below (all_to_all 512 KiB: 246 against 438 us single copy),
# single copy above (all_gather 8 MiB in place: 532 against 771 us; 64 MiB: 4.46 against
# 14.1 ms streamed; all_to_all 8 MiB: 1.65 against 1.95 ms).
_NOTHING = lambda n: 0  # noqa: E731
# Not for broadcast: the streamed broadcast already copies each byte once per rank (the root
# in, each reader out), and at n=2 (interleaved, 15 calls each) it was as fast or faster:
# 4 MiB 406 against 442 us, 64 MiB 6.97 against 7.02 ms.
_RUNS = {
    "all_gather": (single_copy_all_gather, _NOTHING),
    "all_to_all": (single_copy_all_to_all, lambda n: MEMORY_COST / n),
}
for _collective, (_run, _copied) in _RUNS.items():
    register(Algorithm("single_copy", _collective, _run,
                       volume_cost(_copied, lambda n: MEMORY_COST * (n - 1) / n, _NOTHING, rounds=2),
                       needs_direct=True, needs_single_copy=True, slot_need=lambda n, m: 8 * n))
