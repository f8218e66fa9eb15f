"""Collectives through a group's shared segment on one host: in one shot where a message fits a
rank's slot, streamed through the slots in pieces where it does not (all_reduce, broadcast,
all_gather, all_to_all).

Every rank copies its contribution into its own slot once and publishes a flag; readers take
what they need straight out of the other ranks' slots. There are no per-peer messages, no
headers and no matching: a small all_reduce costs one copy in, one flag store, one wait and
n-1 reductions. Every rank reduces the slots in rank order, so all ranks get bitwise the same
result. Fingerprints live beside the flags, so a mismatched call is still caught here.

Here: each collective's entry for a call no plan runs, the costs and the registration; the
plans of repeated signatures are in direct_plans.py, the streams in direct_streams.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..buffers import copy
from ..config import Config
from ..ops import ReduceOp
from ..ops.kernels import fold, reduction_kernel
from ..transport import native
from ..transport.segment import DirectPath
from .base import DirectCall
from .direct_plans import AllReducePlan, BroadcastPlan, ReducePlan, copy_into, scatter_table
from .direct_streams import STREAM_CHUNK, stream_all_gather, stream_all_to_all, stream_broadcast
from .prices import Link
from .registry import Algorithm, register

_UNPLANNED = 64  # signatures whose plan a group's unplanned all_reduces keep (cleared when full)


def _publish_all(dp: DirectPath, call: DirectCall, arrays: list[np.ndarray]) -> tuple[int, tuple[np.ndarray,
                 ...]]:
    """Enter, copy `arrays` (one dtype) back to back into this rank's slot, publish, wait for
    everyone; the slots of this call as one typed view each."""
    p = dp.enter(call)
    views = dp.views(arrays[0].dtype, sum(a.size for a in arrays))[p]
    mine = views[dp.rank]
    if len(arrays) == 1:
        copy_into(mine, arrays[0])
    else:
        offset = 0
        for a in arrays:
            copy_into(mine[offset:offset + a.size], a)
            offset += a.size
    dp.publish(call, p, dp.everyone)
    return p, views


def direct_all_reduce(call: DirectCall, data: np.ndarray, op: ReduceOp,
                      src: np.ndarray | None = None) -> None:
    """The unplanned entry (group/bodies.py's all_reduce finalizes), with the group's plan of
    the signature (Group.direct_plans, up to _UNPLANNED of them: the path itself holding them
    would make a cycle, and a destroyed group's segment would wait for the garbage collector)."""
    group = call.group
    plans = group.direct_plans
    key = (data.dtype, data.size, op)
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= _UNPLANNED:
            plans.clear()
        plan = plans[key] = AllReducePlan(group.direct, data.dtype, data.size, op)
    plan.run(call, data if src is None else src, data)


def direct_reduce(call: DirectCall, data: np.ndarray, acc: np.ndarray, op: ReduceOp, root: int) -> None:
    """The unplanned entry (group/bodies.py's reduce finalizes)."""
    ReducePlan(call.group.direct, data.dtype, data.size, op, root).run(call, data, acc)


def direct_broadcast(call: DirectCall, data: np.ndarray, root: int) -> None:
    dp = call.group.direct
    if data.nbytes > dp.slot_bytes:
        stream_broadcast(dp, call, data.view(np.uint8), root)
        return
    BroadcastPlan(dp, data.dtype, data.size, root).run(call, data, data)


def direct_gather(call: DirectCall, send: np.ndarray, blocks: list[np.ndarray] | None, root: int) -> None:
    """Every other rank copies its block into its slot; the root copies each out of the slots
    (the one-shot reduce without the fold). Blocks may differ in size (gatherv): the root
    knows them all."""
    dp = call.group.direct
    p = dp.enter(call)
    if dp.rank != root:
        copy_into(dp.seg.slots[dp.rank][p][:send.nbytes], send.view(np.uint8))
        dp.publish(call, p)
        return
    dp.publish(call, p, dp.everyone)
    assert blocks is not None
    for r in dp.others:
        blocks[r].view(np.uint8)[...] = dp.seg.slots[r][p][:blocks[r].nbytes]
    if blocks[root] is not send:
        copy(blocks[root], send)


def direct_scatter(call: DirectCall, blocks: list[np.ndarray] | None, recv: np.ndarray, root: int) -> None:
    """The root copies every other rank's block into its slot after a table of where each
    starts (blocks may differ in size: scatterv, whose counts only the root's list shows
    here); each rank copies its own out (the one-shot broadcast, a block each)."""
    dp = call.group.direct
    p = dp.enter(call)
    slot = dp.seg.slots[root][p]
    table = slot[:8 * dp.size].view(np.uint64)
    if dp.rank == root:
        assert blocks is not None
        at = scatter_table(dp.size)
        for r in dp.others:
            table[r] = at
            copy_into(slot[at:at + blocks[r].nbytes], blocks[r].view(np.uint8))
            at += blocks[r].nbytes
        dp.publish(call, p)
        if blocks[root] is not recv:
            copy(recv, blocks[root])
        return
    dp.publish(call, p, (root,))
    at = int(table[dp.rank])
    recv.view(np.uint8)[...] = slot[at:at + recv.nbytes]


def direct_barrier(call: DirectCall) -> None:
    dp = call.group.direct
    st = dp.native
    if st is None:
        dp.publish(call, dp.enter(call), dp.everyone)
        return
    a, b = dp.stamp_words(call)
    status = st.barrier(call.seq, a, b, call.name)
    if status != native.DONE:
        barrier_after(call, status)


def barrier_after(call: DirectCall, status: int) -> None:
    """The rest of direct_barrier's compiled body, given its `status` (also the compiled
    caller's, transport/_caller.c)."""
    dp = call.group.direct
    a, b = dp.stamp_words(call)
    dp.resume(call, status, dp.everyone, dp.native.barrier, call.seq, a, b, call.name)


def direct_all_gather(call: DirectCall, blocks: list[np.ndarray]) -> None:
    dp = call.group.direct
    if blocks[0].nbytes > dp.slot_bytes:
        stream_all_gather(dp, call, [b.view(np.uint8) for b in blocks])
        return
    _, views = _publish_all(dp, call, [blocks[dp.rank]])
    for r, out in enumerate(blocks):
        if r != dp.rank:
            out[...] = views[r]


def direct_reduce_scatter(call: DirectCall, blocks: list[np.ndarray], out: np.ndarray, op: ReduceOp) -> None:
    """Every rank publishes all its blocks; rank r folds block r of every slot, in rank order."""
    dp = call.group.direct
    p, _ = _publish_all(dp, call, blocks)
    offset = sum(b.nbytes for b in blocks[:dp.rank])
    fold(dp.views(out.dtype, out.size, offset)[p], out, reduction_kernel(op, out.dtype))


def direct_all_to_all(call: DirectCall, sends: list[np.ndarray], recvs: list[np.ndarray]) -> None:
    """Equal blocks only: block `rank` of peer r's slot is ours (one shot), or our stream of
    theirs (streamed, when the sends do not fit the slot)."""
    dp = call.group.direct
    if sends[0].nbytes * dp.size > dp.slot_bytes:
        stream_all_to_all(dp, call, [b.view(np.uint8) for b in sends], [b.view(np.uint8) for b in recvs])
        return
    p, _ = _publish_all(dp, call, sends)
    block = sends[0].size
    views = dp.views(sends[0].dtype, block * dp.size)[p]
    start = dp.rank * block
    for r, out in enumerate(recvs):
        out[...] = views[r][start:start + block]


# Cost: one flag round (α), the bytes copied into the slot and read out of slots (β), and the
# bytes reduced (γ), as multiples of m (the collective's size as nccl-tests counts it).
_VOLUMES = {  # collective: (copied in, read, reduced) as functions of n
    "all_reduce": (lambda n: 1, lambda n: n, lambda n: n - 1),
    "reduce": (lambda n: 1, lambda n: n, lambda n: n - 1),
    "broadcast": (lambda n: 1, lambda n: 1, lambda n: 0),
    "barrier": (lambda n: 0, lambda n: 0, lambda n: 0),
    "all_gather": (lambda n: 1 / n, lambda n: 1, lambda n: 0),
    "reduce_scatter": (lambda n: 1, lambda n: 1, lambda n: (n - 1) / n),
    "all_to_all": (lambda n: 1, lambda n: 1, lambda n: 0),
    # the blocks into the slots, then out at the root; the root's copy in, then each block out
    "gather": (lambda n: 1 / n, lambda n: (n - 1) / n, lambda n: 0),
    "scatter": (lambda n: (n - 1) / n, lambda n: 1 / n, lambda n: 0),
}
_RUN: dict[str, Callable[..., Any]] = {
    "all_reduce": direct_all_reduce, "reduce": direct_reduce, "broadcast": direct_broadcast,
    "barrier": direct_barrier, "all_gather": direct_all_gather,
    "reduce_scatter": direct_reduce_scatter, "all_to_all": direct_all_to_all,
    "gather": direct_gather, "scatter": direct_scatter}


# What does not fit a slot streams through it, given room for a 64-byte piece per stream
_SLOT_NEED = {"all_reduce": lambda n, m: min(m, 64), "broadcast": lambda n, m: min(m, 64),
              "all_gather": lambda n, m: min(-(-m // n), 64), "all_to_all": lambda n, m: min(m, 64 * (n - 1)),
              "scatter": lambda n, m: scatter_table(n) + m}  # gather: a block of up to m (gatherv)


def volume_cost(copied, read, reduced, rounds: int = 1):
    """A one-host cost: `rounds` flag rounds (α) and what every rank copies in, reads and
    reduces, as functions of n giving multiples of m."""
    def cost(n: int, m: int, link: Link) -> float:
        return rounds * link.alpha + (copied(n) + read(n)) * m * link.beta + reduced(n) * m * link.gamma
    return cost


def _cost_of(collective: str):
    return volume_cost(*_VOLUMES[collective])


_STREAMED = {  # collective: (what decides one shot or streamed, bytes one source streams,
    # bytes one rank copies) as fractions of m, and how many streams a source's steps carry
    # (direct_streams' width: one per reader for all_to_all); None: the rest costs what it does in one shot
    # (the all_reduce folds each piece while it is in cache, and its arrays' memory traffic
    # is small beside the n reads and n-1 folds). The pieces are copied while in cache, at
    # the one-shot β; what misses the host's cache is priced by the tuner on top
    # (cost_model.spill); docs/design/segment.md#pricing-streamed-calls.
    "all_reduce": (lambda n: 1, lambda n: 1, None, lambda n: 1),
    "broadcast": (lambda n: 1, lambda n: 1, lambda n: 1, lambda n: 1),
    "all_gather": (lambda n: 1 / n, lambda n: 1 / n, lambda n: 1, lambda n: 1),  # per block
    "all_to_all": (lambda n: 1, lambda n: (n - 1) / n, lambda n: (2 * n - 1) / n,  # own block, in, out
                   lambda n: n - 1),
}


def _streamed(collective: str):
    """The cost of a collective that streams what does not fit the slot: the one shot of a full
    slot, then one flag round per step handed over beyond it (direct_streams: a step holds a piece of
    each of a source's streams, and the source refills its slot a step at a time as the slowest
    reader empties it) and every rank's copies of the rest, overlapping with the other ranks'.
    Priced with the default slot: TENSORWIRE_SHM_DIRECT is not seen
    (docs/design/segment.md#pricing-streamed-calls)."""
    one_shot = _cost_of(collective)
    decides, streamed, copied, width = _STREAMED[collective]

    def cost(n: int, m: int, link: Link) -> float:
        slot = Config().direct_slot(n)
        if decides(n) * m <= slot:
            return one_shot(n, m, link)
        full = int(slot / decides(n))  # the largest one shot: what streams beyond it overlaps
        step = min(STREAM_CHUNK * max(width(n), 1), slot)
        handovers = max(-(-int(streamed(n) * m) // step) - slot // step, 0)
        rest = (one_shot(n, m, link) - one_shot(n, full, link) if copied is None
                else copied(n) * (m - full) * link.beta)
        return one_shot(n, full, link) + handovers * link.alpha + rest
    return cost


for _collective, _run in _RUN.items():
    _cost = (_streamed if _collective in _STREAMED else _cost_of)(_collective)
    register(Algorithm("direct", _collective, _run, _cost, needs_direct=True,
                       copies=0 if _collective == "all_reduce" else 1,
                       out_of_place=_collective == "all_reduce",
                       slot_need=_SLOT_NEED.get(_collective)))
