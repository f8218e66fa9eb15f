"""What each collective runs, in order, as body(call, ...) on the group's execution queue.

A body gets checked, flat arrays; it asks the tuner for an algorithm unless its plan chose one
already (`run`), keeps inputs apart from outputs the algorithm writes, and finalizes reductions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .. import buffers
from ..algorithms.compressed import compressed_all_reduce
from ..buffers import copy
from ..ops import Reduction
from ..ops.compress import Codec
from ..ops.finalize import finalize
from ..tuning import tuner
from .arguments import apart, flats, input_apart

if TYPE_CHECKING:
    from .calls import CollectiveCall

SELECT = object()  # a body's `run` argument: ask the tuner (unplanned calls)


def all_reduce(call: CollectiveCall, src: np.ndarray, dst: np.ndarray, red: Reduction, result: Any,
               codec: Codec | None = None) -> Any:
    """`codec`: compress= asked for, which only a group over hosts has a use for."""
    group = call.group
    flat = buffers.flat(dst)
    apart = None if dst is src else input_apart([flat], 0, src)
    if group.size > 1 and flat.size:
        if codec is not None and tuner.compresses(group, flat.nbytes, codec, flat.itemsize):
            compressed_all_reduce(call, flat, red.op, apart, codec)
        else:
            tuner.select(group, "all_reduce", flat.nbytes).run(call, flat, red.op, apart)
    elif group.size > 1:  # nothing to reduce; the call still meets the others (its fingerprint)
        tuner.select(group, "barrier", 0).run(call)
    elif apart is not None:
        copy(flat, apart)
    finalize(flat, red, group.size)
    return result


def broadcast(call: CollectiveCall, data: np.ndarray, target: np.ndarray, root: int, result: Any,
              run: Any) -> Any:
    """`run`: the planned algorithm's run function (None: nothing to send), or SELECT."""
    group = call.group
    flat = buffers.flat(target)
    src = input_apart([flat], 0, data) if group.rank == root and target is not data else None
    if run is SELECT:
        run = tuner.select(group, "broadcast", flat.nbytes).run if group.size > 1 else None
    if run is not None:
        run(call, flat, root, src)
    elif src is not None:
        copy(flat, src)
    return result


def reduce(call: CollectiveCall, src: np.ndarray, target: np.ndarray, red: Reduction, root: int, result: Any,
           run: Any) -> Any:
    """`run` as for broadcast; `target` is `src` except on the root of an out-of-place call."""
    group = call.group
    data, acc = buffers.flat(src), buffers.flat(target)
    if run is SELECT:
        run = tuner.select(group, "reduce", data.nbytes).run if group.size > 1 else None
    if run is not None:
        run(call, data, acc, red.op, root)
    elif acc is not data:
        copy(acc, data)
    if group.rank == root:
        finalize(acc, red, group.size)
    return result


def all_gather(call: CollectiveCall, inp: np.ndarray, outs: list[np.ndarray], even: bool, result: Any,
               run: Any) -> Any:
    """`outs[rank]` may be `inp` itself (in place); `even`: equal blocks (the one-shot path and
    the size the tuner prices need them); `run` as for broadcast."""
    group = call.group
    blocks = flats(outs)
    src = input_apart(blocks, group.rank, inp)
    if run is SELECT:
        run = tuner.select(group, "all_gather", sum(f.nbytes for f in blocks), even).run
    if run is not None:
        run(call, blocks, src)
    elif src is not None:
        copy(blocks[group.rank], src)
    return result


def gather(call: CollectiveCall, send: np.ndarray, blocks: list[np.ndarray] | None, root: int, result: Any,
           run: Any) -> Any:
    """`blocks`: the root's flat outputs (None elsewhere); `run` as for broadcast."""
    group = call.group
    if blocks is not None:
        send = apart([send], blocks, (0, root))[0]
    if run is SELECT:
        run = tuner.select(group, "gather", send.nbytes * group.size).run
    run(call, send, blocks, root)
    return result


def scatter(call: CollectiveCall, blocks: list[np.ndarray] | None, recv: np.ndarray, root: int, result: Any,
            run: Any) -> Any:
    """`blocks`: the root's flat inputs (None elsewhere); `run` as for broadcast."""
    group = call.group
    if blocks is not None:
        blocks = apart(blocks, [recv], (root, 0))
    if run is SELECT:
        run = tuner.select(group, "scatter", recv.nbytes * group.size).run
    run(call, blocks, recv, root)
    return result


def all_to_all(call: CollectiveCall, ins: list[np.ndarray], outs: list[np.ndarray], even: bool, result: Any,
               run: Any) -> Any:
    """`even`: equal blocks (uneven splits have no size every rank agrees on, so the tuner
    prices them all alike, as size 0); `run` as for broadcast."""
    group = call.group
    sends, recvs = flats(ins), flats(outs)
    if run is SELECT:
        run = tuner.select(group, "all_to_all", sum(b.nbytes for b in sends) if even else 0, even).run
    if run is not None:
        run(call, sends, recvs)
    return result


def reduce_scatter(call: CollectiveCall, blocks: list[np.ndarray], out: np.ndarray, red: Reduction,
                   even: bool, result: Any, run: Any) -> Any:
    """`blocks`: flat; `even`: equal blocks (see all_gather); `run` as for broadcast."""
    group = call.group
    flat = buffers.flat(out)
    blocks = apart(blocks, [flat], (group.rank, 0))
    if run is SELECT:
        run = tuner.select(group, "reduce_scatter", sum(b.nbytes for b in blocks), even).run
    run(call, blocks, flat, red.op)
    finalize(flat, red, group.size)
    return result


def no_op(call: CollectiveCall) -> None:
    pass
