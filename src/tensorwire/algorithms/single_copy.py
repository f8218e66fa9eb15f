"""Single copy on one host: readers copy large messages straight out of their source's buffer.

A broadcast, all_gather, all_to_all, gather or scatter on the direct path moves every byte
twice, into the source's slot and out of it (one shot or streamed). Here a source publishes the
addresses of its buffers in its slot instead, each reader copies what it needs directly out of
the source process (cross-memory attach, transport/cma.py) and then marks itself done in its
progress word; a source returns only once its readers are done, as its buffer must not change
under them. Two flag rounds, and one copy of each byte received. Mismatched calls are caught as
on the direct path: every rank publishes its fingerprint first, and a source waiting for a
reader checks what that reader published.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..buffers import address, copy, flat, huge_zeros
from ..errors import PeerLostError
from ..ops import ReduceOp
from ..ops.kernels import reduction_kernel, writes_where_told
from ..transport import cma, native, pages
from ..transport.cma import BOUNCE, ProcessGone
from ..transport.segment import CHUNK_BITS, READ, DirectPath
from .base import DirectCall, blocks_of, split_counts
from .registry import Algorithm, register
from .shm_direct import volume_cost

_WORD = np.dtype(np.uint64)
_PIECE = BOUNCE
"""Bytes of a block folded at a time: each peer's piece is read into the bounce buffer."""


def _offer(dp: DirectPath, call: DirectCall, spans: list[tuple[int, int]], read: bool = True) -> int:
    """Enter, publish the addresses of the buffers at `spans` ((address, bytes) each: one per
    reader, or one for all) and, where peers `read` them, how much of them lies in huge pages,
    and wait for every rank to publish theirs; the call's slot parity."""
    p = dp.enter(call)
    count = len(spans)
    table = dp.views(_WORD, count + 1)[p][dp.rank]
    for i, (at, _) in enumerate(spans):
        table[i] = at
    table[count] = _eighths(spans, read)
    dp.publish(call, p, dp.everyone)
    dp.shares_at = (p, count)
    return p


def _eighths(spans: list[tuple[int, int]], read: bool) -> int:
    """The share of `spans` in huge pages that a rank publishes where peers `read` them."""
    return pages.scanner().eighths(spans) if read else pages.UNKNOWN


def _spans(arrays: list[np.ndarray]) -> list[tuple[int, int]]:
    return [(address(a), a.nbytes) for a in arrays]


def _block_spans(flat: np.ndarray, counts: list[int]) -> list[tuple[int, int]]:
    """_spans of blocks_of(flat, counts), from one address."""
    at, size, out = address(flat), flat.dtype.itemsize, []
    for c in counts:
        out.append((at, c * size))
        at += c * size
    return out


def _fetch(dp: DirectPath, p: int, source: int, index: int, dst: np.ndarray) -> None:
    """Copy buffer `index` of the table `source` published into `dst`."""
    remote = int(dp.views(_WORD, dp.size)[p][source][index])
    dp.reader.read_into(dst, dp.pids[source], remote)


def _finish(dp: DirectPath, call: DirectCall, p: int, readers: tuple[int, ...]) -> None:
    """Mark this rank's reads done; wait until `readers` are done with this rank's buffers."""
    dp.mark_read(call, 1)
    dp.await_readers(call, readers, 1, p, dp.prev_fp, None)


Reads = tuple
"""What a rank reads in a single copy call: (source, index, dst) after one another, flat (one
tuple to hand to C): buffer `index` of the table `source` published, into dst."""
Moves = tuple[list[tuple[int, int]], Reads, tuple[int, ...], tuple[np.ndarray, np.ndarray] | None, bool]
"""_move's arguments after the call: spans, reads, readers, local, read."""


def _move(dp: DirectPath, call: DirectCall, spans: list[tuple[int, int]], reads: Reads, readers: tuple[int,
          ...],
          local: tuple[np.ndarray, np.ndarray] | None = None, read: bool = True,
          status: int = native.NOT_ENTERED) -> None:
    """The bodies that only move bytes: offer `spans` (_offer), copy in `reads`, fill `local`
    (dst, src), mark this rank's reads done and wait until `readers` are done with its
    buffers. In one C call where the module is built (Path.single_copy, or the compiled
    caller's, which hands back its `status`); Python takes over wherever it hands back."""
    if dp.native is None:
        p = _offer(dp, call, spans, read)
    else:
        status = _moved(dp, call, spans, reads, readers, local, read, status)
        if status == native.DONE:
            return
        p = dp.st.parity
        if status == native.COPIED:
            dp.await_readers(call, readers, 1, p, dp.prev_fp, None)
            return
    for at in range(0, len(reads), 3):
        if reads[at + 2].nbytes:
            _fetch(dp, p, *reads[at:at + 3])
    if local is not None:
        copy(*local)
    _finish(dp, call, p, readers)


def _moved(dp: DirectPath, call: DirectCall, spans: list[tuple[int, int]], reads: Reads, readers: tuple[int,
           ...],
           local: tuple[np.ndarray, np.ndarray] | None, read: bool, status: int) -> int:
    """_move's compiled body (unless the compiled caller ran it: its `status`), its entry and
    publish round finished here where it hands them back; its status (DONE, SETTLED or
    COPIED)."""
    if status == native.NOT_ENTERED:
        path = dp.native
        a, b = dp.stamp_words(call)
        whom = -1 if readers is dp.others else readers[0] if readers else -2
        args = (call.seq, a, b, call.name, (*[at for at, _ in spans], _eighths(spans, read)), dp.pids, reads,
                whom, local, alias_window(dp))
        status = path.single_copy(*args)
        if status == native.NOT_ENTERED:
            dp.settle_previous(call)
            status = path.single_copy(*args)
    dp.shares_at = (dp.st.parity, len(spans))
    if status == native.PENDING or status >= 0:
        dp.resume(call, status, dp.everyone)  # raises the mismatch, or waits for everyone
        return native.SETTLED
    return status


def alias_window(dp: DirectPath) -> int:
    """The window of offsets whose reads the compiled bodies hand back (cma.ALIAS_WINDOW where
    this CPU is slow there, else 0), learnt once."""
    if dp.alias_window is None:
        dp.alias_window = cma.ALIAS_WINDOW if cma.aliasing_is_slow() else 0
    return dp.alias_window


def _all_gather_args(dp: DirectPath, blocks: list[np.ndarray], src: np.ndarray | None) -> Moves:
    """_move's arguments of single_copy_all_gather."""
    me = dp.rank
    reads = tuple(x for r in dp.onward for x in (r, 0, blocks[r]))
    if src is None:
        return [(address(blocks[me]), blocks[me].nbytes)], reads, dp.others, None, True
    return [(address(src), src.nbytes)], reads, dp.others, (blocks[me], src), True


def single_copy_all_gather(call: DirectCall, blocks: list[np.ndarray], src: np.ndarray | None) -> None:
    """Peers read this rank's input where it is apart (see single_copy_broadcast)."""
    dp = call.group.direct
    _move(dp, call, *_all_gather_args(dp, blocks, src))


def _all_to_all_args(dp: DirectPath, sends: list[np.ndarray], recvs: list[np.ndarray]) -> Moves:
    me = dp.rank
    return (_spans(sends), tuple(x for r in dp.onward for x in (r, me, recvs[r])), dp.others,
            (recvs[me], sends[me]), True)


def single_copy_all_to_all(call: DirectCall, sends: list[np.ndarray], recvs: list[np.ndarray]) -> None:
    dp = call.group.direct
    _move(dp, call, *_all_to_all_args(dp, sends, recvs))


def _broadcast_args(dp: DirectPath, data: np.ndarray, root: int, src: np.ndarray | None) -> Moves:
    if dp.rank != root:
        return [(address(data), data.nbytes)], (root, 0, data), (), None, False
    if src is None:
        return [(address(data), data.nbytes)], (), dp.others, None, True
    return [(address(src), src.nbytes)], (), dp.others, (data, src), True


def single_copy_broadcast(call: DirectCall, data: np.ndarray, root: int, src: np.ndarray | None) -> None:
    """The root publishes its input (`src` where apart: lines it has not just written, which
    peers read faster than its freshly filled output) and fills its output meanwhile."""
    dp = call.group.direct
    _move(dp, call, *_broadcast_args(dp, data, root, src))


def _gather_args(dp: DirectPath, send: np.ndarray, blocks: list[np.ndarray] | None, root: int) -> Moves:
    spans = [(address(send), send.nbytes)]
    if dp.rank != root:
        return spans, (), (root,), None, True
    assert blocks is not None
    return (spans, tuple(x for r in dp.onward for x in (r, 0, blocks[r])), (),
            None if blocks[root] is send else (blocks[root], send), False)


def single_copy_gather(call: DirectCall, send: np.ndarray, blocks: list[np.ndarray] | None,
                       root: int) -> None:
    """The root reads every other rank's input; each of them returns once it has (blocks may
    differ in size: gatherv, whose sizes only the root's list shows)."""
    dp = call.group.direct
    _move(dp, call, *_gather_args(dp, send, blocks, root))


def _scatter_args(dp: DirectPath, blocks: list[np.ndarray] | None, recv: np.ndarray, root: int) -> Moves:
    if dp.rank == root:
        assert blocks is not None
        return _spans(blocks), (), dp.others, None if blocks[root] is recv else (recv, blocks[root]), True
    return [(0, 0)] * dp.size, (root, dp.rank, recv), (), None, False  # the table's shape: the root's is read


def single_copy_scatter(call: DirectCall, blocks: list[np.ndarray] | None, recv: np.ndarray,
                        root: int) -> None:
    """Every other rank reads its block out of the root's list; the root returns once they
    have (scatterv as gatherv above)."""
    dp = call.group.direct
    _move(dp, call, *_scatter_args(dp, blocks, recv, root))


# The compiled caller's single copy calls (group/planned.py): their kinds (_native.h's MOVE_*)
# by the API's name, and how each finishes in Python what its body handed back, on the
# caller's arrays x and y (as moves_plan in _native.c takes them).
MOVES = {"broadcast": 0, "all_gather_into_tensor": 1, "all_to_all_single": 2, "gather": 3, "scatter": 4}
MOVED = {"broadcast": "broadcast", "all_gather_into_tensor": "all_gather", "all_to_all_single": "all_to_all",
         "gather": "gather", "scatter": "scatter"}


def _planned_args(what: str, dp: DirectPath, root: int, x: Any, y: Any) -> Moves:
    n, me = dp.size, dp.rank
    if what == "broadcast":  # the tensor and the output (the tensor itself in place)
        return _broadcast_args(dp, flat(y), root, flat(x) if me == root and y is not x else None)
    if what == "gather":  # the tensor and the root's list
        return _gather_args(dp, flat(x), None if me != root else [flat(b) for b in y], root)
    if what == "scatter":  # the root's list and the tensor
        return _scatter_args(dp, None if me != root else [flat(b) for b in x], flat(y), root)
    out = flat(y)
    if what == "all_to_all_single":  # input and output
        count = x.size // n
        return _all_to_all_args(dp, blocks_of(flat(x), [count] * n), blocks_of(out, [count] * n))
    blocks = blocks_of(out, [x.size] * n)  # all_gather_into_tensor: input and output
    return _all_gather_args(dp, blocks, None if address(x) == address(blocks[me]) else flat(x))


def planned_tail(what: str, root: int) -> Callable[..., None]:
    """The tail of a compiled caller's single copy call of `what` (Plans.finish)."""
    def tail(call: DirectCall, status: int, x: Any, y: Any = None) -> None:
        dp = call.group.direct
        spans, reads, readers, local, read = _planned_args(what, dp, root, x, y)
        _move(dp, call, spans, reads, readers, local, read, status)
    return _lost_if_gone(tail)


def _lost_if_gone(run):
    """`run`, raising PeerLostError naming the rank whose process vanished under a read (the
    socket that would tell may not have closed yet)."""
    @functools.wraps(run)
    def guarded(call: DirectCall, *args):
        try:
            return run(call, *args)
        except ProcessGone as exc:
            dp = call.group.direct
            peer = dp.members[dp.pids.index(exc.pid)] if exc.pid in dp.pids else None
            raise PeerLostError(f"rank {dp.engine.rank}: {call.what}: lost rank {peer}: its process "
                                f"{exc.pid} is gone (reading its memory failed)", peer=peer) from exc
    return guarded


def _fold_block(dp: DirectPath, p: int, index: int, own: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
    """out = the fold, in rank order, of buffer `index` of every rank's table (`own` here).

    Piece by piece: rank 0's piece lands in `out`, then each other rank's is folded in, a
    peer's read into the bounce buffer (placed well for the source) while `out` is in cache."""
    if not out.size:
        return
    kernel, dtype, me = reduction_kernel(op, out.dtype), out.dtype, dp.rank
    step = _PIECE // dtype.itemsize
    # In place, out takes rank 0's piece before this rank's turn. A later rank keeps its piece
    # aside until then, in a buffer of the group's (not one per call); rank 1, with a kernel
    # that writes where it is told, folds rank 0's piece into its own instead (x0 op x1, still
    # in rank order) and copies nothing (docs/design/internals.md, "Memory").
    onto_own = me == 1 and address(own) == address(out) and writes_where_told(kernel)
    in_place = me > 0 and not onto_own and np.may_share_memory(own, out)
    if in_place and dp.kept is None:
        dp.kept = np.empty(_PIECE, np.uint8)
    remotes = [int(t[index]) for t in dp.views(_WORD, dp.size)[p]]
    for lo in range(0, out.size, step):
        acc, mine = out[lo:lo + step], own[lo:lo + step]
        if in_place:
            mine = dp.kept[:mine.nbytes].view(dtype)  # type: ignore[index]
            copy(mine, own[lo:lo + step])
        at = lo * dtype.itemsize
        if me == 0:
            if address(acc) != address(mine):
                copy(acc, mine)
        elif onto_own:
            kernel(dp.reader.fetch(dp.pids[0], remotes[0] + at, acc.nbytes).view(dtype), acc, acc)
        else:
            dp.reader.read_into(acc, dp.pids[0], remotes[0] + at)
        for r in dp.everyone[1:]:
            if r == me and onto_own:
                continue
            theirs = mine if r == me else dp.reader.fetch(dp.pids[r], remotes[r] + at, acc.nbytes).view(dtype)
            kernel(acc, theirs, acc)


def single_copy_reduce_scatter(call: DirectCall, blocks: list[np.ndarray], out: np.ndarray,
                               op: ReduceOp) -> None:
    dp = call.group.direct
    p = _offer(dp, call, _spans(blocks))
    _fold_block(dp, p, dp.rank, blocks[dp.rank], out, op)
    _finish(dp, call, p, dp.others)


def single_copy_all_reduce(call: DirectCall, data: np.ndarray, op: ReduceOp,
                           src: np.ndarray | None = None) -> None:
    """A reduce-scatter (each rank folds its block out of every rank's input), then an
    all_gather (each rank reads the others' folded blocks): 2(n-1)/n of m read per rank and
    (n-1)/n of it folded, against the one shot's m copied and n m read and folded."""
    dp = call.group.direct
    counts = split_counts(data.size, dp.size)
    outs = blocks_of(data, counts)
    ins = outs if src is None else blocks_of(src, counts)
    spans = _block_spans(data, counts)
    p = _offer(dp, call, (spans if src is None else _block_spans(src, counts)) + spans)
    me = dp.rank
    _fold_block(dp, p, me, ins[me], outs[me], op)
    dp.mark_read(call, 1)  # this rank's block is final, and it reads no input any more
    table, ab, backoff = dp.views(_WORD, 2 * dp.size)[p], dp.prev_fp, None
    for r in dp.onward:
        # rank r's block of this rank's data is its input until rank r has folded it
        backoff = dp.await_progress(call, r, READ, (call.seq << CHUNK_BITS) + 1, p, ab, backoff)
        if outs[r].size:
            dp.reader.read_into(outs[r], dp.pids[r], int(table[r][dp.size + r]))
    dp.mark_read(call, 2)
    dp.await_readers(call, dp.others, 2, p, ab, backoff)


def _scratch(dp: DirectPath, nbytes: int) -> np.ndarray:
    """The group's buffer for a non-root's folded block, kept: a fresh one per call would be
    faulted in, zeroed and read out of 4 KiB pages."""
    if dp.folded is None or dp.folded.nbytes < nbytes:
        dp.folded = huge_zeros(nbytes)
    return dp.folded[:nbytes]


def single_copy_reduce(call: DirectCall, data: np.ndarray, acc: np.ndarray, op: ReduceOp, root: int) -> None:
    """single_copy_all_reduce's reduce-scatter (each rank folds its block out of every rank's
    `data`, kept), then the root alone reads the folded blocks into `acc`: the root reads what an
    all_reduce's ranks read, the others half. A reduce by messages sends the root every byte
    in n - 1 messages (linear) or log2 n rounds of whole buffers (binomial), much slower
    (docs/design/segment.md#single-copy)."""
    dp = call.group.direct
    me, n = dp.rank, dp.size
    counts = split_counts(data.size, n)
    outs = blocks_of(acc, counts) if me == root else None
    folded = outs[me] if outs is not None else _scratch(dp, counts[me] * data.itemsize).view(data.dtype)
    p = _offer(dp, call, _block_spans(data, counts) + _spans([folded]))
    _fold_block(dp, p, me, blocks_of(data, counts)[me], folded, op)
    dp.mark_read(call, 1)  # this rank's block is folded, and it reads no input any more
    if outs is None:
        dp.await_readers(call, (root,), 2, p, dp.prev_fp, None)  # until the root has read `folded`
        return
    table, ab, backoff = dp.views(_WORD, n + 1)[p], dp.prev_fp, None
    for r in dp.onward:
        backoff = dp.await_progress(call, r, READ, (call.seq << CHUNK_BITS) + 1, p, ab, backoff)
        if outs[r].size:
            dp.reader.read_into(outs[r], dp.pids[r], int(table[r][n]))
    dp.mark_read(call, 2)


def _slot_need(words: int) -> Callable[[int, int], int]:
    """The slot bytes of a collective whose table holds `words` words per rank."""
    return lambda n, m: 8 * (words * n + 1)


# Cost, with the host's `cma` link (probes.measure_cma): two flag rounds (α) and the bytes
# a rank reads out of its peers (β, a read across processes); an all_to_all also copies its
# own block, a local pass priced at γ as pairwise exchange prices it. The all_gather's copy of
# its own block (out of place) is left out on purpose: see docs/design/cost-model.md, "Single copy's reads".
_NOTHING = lambda n: 0  # noqa: E731
# A broadcast's readers each read all of m. Out of place they read the root's input, not the
# output it fills meanwhile: lines a core has just written are read from the other core at
# half speed or worse (docs/design/segment.md#single-copy). A root whose input was itself just
# written pays that too, as the slots' readers always do.
_READ_ONCE = lambda n: (n - 1) / n  # noqa: E731
# The reductions' reads cost more: they land in the bounce buffer a MiB at a time and are
# folded from there (docs/design/segment.md#single-copy).
_FOLD_READ = lambda n: 1.5 * _READ_ONCE(n)  # noqa: E731
_FOLDED = lambda n: (n - 1) / n  # noqa: E731
_RUNS = {  # collective: (run, cost, table words per rank)
    "broadcast": (single_copy_broadcast, volume_cost(_NOTHING, lambda n: 1, _NOTHING, rounds=2), 1),
    "all_gather": (single_copy_all_gather, volume_cost(_NOTHING, _READ_ONCE, _NOTHING, rounds=2), 1),
    "all_to_all": (single_copy_all_to_all, volume_cost(_NOTHING, _READ_ONCE, lambda n: 1 / n, rounds=2), 1),
    "reduce_scatter": (single_copy_reduce_scatter, volume_cost(_NOTHING, _FOLD_READ, _FOLDED, rounds=2), 1),
    "all_reduce": (single_copy_all_reduce,
                   volume_cost(_NOTHING, lambda n: 2 * _FOLD_READ(n), _FOLDED, rounds=3), 2),
    "reduce": (single_copy_reduce, volume_cost(_NOTHING, lambda n: 2 * _FOLD_READ(n), _FOLDED, rounds=3), 2),
    # a gather's root reads every other block, then copies its own; a scatter's readers read
    # their own while its root copies its own
    "gather": (single_copy_gather, volume_cost(_NOTHING, _READ_ONCE, lambda n: 1 / n, rounds=2), 1),
    "scatter": (single_copy_scatter, volume_cost(_NOTHING, lambda n: 1 / n, _NOTHING, rounds=2), 1),
}
# The reduce from 3 ranks, and where ranks outnumber cores only when TENSORWIRE_ALGO names it:
# its root reads what an all_reduce's ranks read, which at 2 ranks is no less than the one
# message a linear reduce folds, and where the others' folds wait for cores the root waits
# too; a message's price at those sizes is well above what it measures, so the tuner would
# take it (docs/design/segment.md#single-copy).
_ONLY: dict[str, dict[str, Any]] = {"reduce": {"eligible": lambda n, m: n >= 3, "named_where_crowded": True}}
for _collective, (_run, _cost, _words) in _RUNS.items():
    register(Algorithm("single_copy", _collective, _lost_if_gone(_run), _cost, needs_direct=True,
                       copies=1,
                       needs_single_copy=True,
                       single_copy_crowded=_collective in ("all_reduce", "reduce", "reduce_scatter"),
                       out_of_place=_collective in ("all_reduce", "broadcast", "all_gather"),
                       slot_need=_slot_need(_words), **_ONLY.get(_collective, {})))
