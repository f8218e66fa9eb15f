"""A group's shared-memory setup, collectively as the group is made.

Every member agrees on the group's links (so every rank prices the same tier), and a group on
one host gets its shared segment (the direct path's one shot) and, where every rank can read
every peer's memory, single copy.
"""

from __future__ import annotations

import errno
import functools
from typing import TYPE_CHECKING

import numpy as np

from .. import log
from ..algorithms.ordered import by_world_rank
from ..algorithms.recursive_doubling import recursive_doubling_all_reduce
from ..algorithms.tree import binomial_broadcast
from ..errors import TensorwireWarning
from ..ops import ReduceOp
from ..transport import cma, shm_budget, shm_segments
from ..transport.segment import DirectPath, GroupSegment
from .context import mix_context

if TYPE_CHECKING:
    from .group import Group

_log = log.get("COLL")
_SPACE_ERRNOS = (*shm_budget.SPACE_ERRORS, errno.EMFILE, errno.ENFILE)
"""Why a ring could not be made that is a shortfall worth a warning; others (a peer that only
shares a host name, not /dev/shm) are how tensorwire finds out who shares memory at all."""


def setup_direct(group: Group, check_order: bool = False) -> None:
    """Collectively: agree on the group's links (so every rank prices the same tier) and
    give a group on one host its shared segment (the one-shot path), as large as /dev/shm
    allows; warn once of what /dev/shm could not hold (shm_budget). The exchange also checks
    that the members list the group in one order (new_group's contexts come from its members
    alone); with `check_order` it is made over TCP too, for that alone."""
    cfg = group.runtime.config
    tcp = cfg.transport == "tcp"
    if group.size < 2 or tcp and not check_order:
        return
    table = np.zeros((group.size, 6), dtype=np.uint64)  # each rank's row, gathered by a MAX
    if not tcp:
        table[group.rank] = _shm_facts(group)
    # by world rank: a member that listed the group in another order meets the others, and
    # its order's digest (the call's aux) fails their check instead of a wait nobody ends
    rows = table[:1 if tcp else None].reshape(-1)
    group.queue.run_internal("group setup", lambda call: recursive_doubling_all_reduce(
        by_world_rank(call, group.ranks), rows, ReduceOp.MAX), mix_context(*group.ranks))
    if tcp:
        return
    group.all_local = bool(table[:, 0].all())
    group.one_host = bool(table[:, 1].all())
    used = table[:, 4][table[:, 4] > 0]
    if len(used):
        group.ring_bytes = int(used.min())  # what the tuner prices memory traffic with, alike everywhere
    short = shm_budget.Shortfall(local=int(table[:, 5].max()), ring=cfg.shm_ring_bytes,
                                 ring_used=int(used.min()) if len(used) else 0,
                                 rings=int(table[:, 5].sum() - group.size), refused=int(table[:, 2].sum()),
                                 ring_errno=int(table[:, 3].max()))
    want = cfg.direct_slot(group.size)
    if group.one_host and want > 0:
        short.slot, short.size = want, group.size
        short.slot_used, short.slot_errno = _setup_segment(group, want)
    told = group.runtime.shm_told
    news = {"rings"} if short.rings_short else set()
    news |= {"segment"} if short.slot_short else set()
    if news - told and group.rank == 0:
        log.warn(short.describe(f"rank {group.runtime.rank}: group {group.name}", "rings" not in told),
                 TensorwireWarning)
    told |= news



def _shm_facts(group: Group) -> tuple[int, ...]:
    """This rank's row of the group's shared-memory facts: (every peer through rings, every
    peer on this host, rings toward peers on this host it could not make, why (errno),
    the ring its rings grow to, members on this host). Rings are made as pairs first talk
    (transport/wiring.py): a peer counts as through rings unless its pair fell back."""
    engine, me = group.engine, group.runtime.rank
    peers = [w for w in group.ranks if w != me]
    shm = [w for w in peers if engine.planned_kind(w) == "shm" and w not in engine.shm_refused]
    host = sum(w in engine.host_peers for w in peers)
    refused = [engine.shm_refused[w] for w in peers if engine.shm_refused.get(w) in _SPACE_ERRNOS]
    if host and not shm and engine.ring_max == 0:  # no room for rings at all: planned so at init
        refused = [errno.ENOSPC] * host
    return (int(len(shm) == len(peers)), int(host == len(peers)), len(refused), max(refused, default=0),
            engine.ring_max if shm else 0, host + 1)



def _setup_segment(group: Group, slot: int) -> tuple[int, int]:
    """Rank 0 makes the segment, as large as fits up to `slot` a rank, the others map it;
    the group uses it only if every rank did. Its name is unlinked once every rank mapped it
    or gave up, and by the others where rank 0 was lost before it could: nothing of it is left
    in /dev/shm (a job killed whole leaves it to the next start, shm_segments.remove_stale).
    (the slot it got, errno why it is smaller)"""
    prefix = f"tw-{group.runtime.info.job_id[:24]}-g{group.ctx}"
    try:
        return _map_segment(group, slot, prefix)
    except BaseException:
        if group.rank and group.ranks[0] in group.engine.lost:
            shm_segments.unlink_prefixed(prefix)
        raise


def _map_segment(group: Group, slot: int, prefix: str) -> tuple[int, int]:
    offer = np.zeros(4, dtype=np.uint64)  # (name token, nonce, slot, errno) of rank 0's segment
    seg = None
    if group.rank == 0:
        seg, why = shm_budget.shrinking(functools.partial(GroupSegment.create, prefix, group.size),
                                        shm_budget.plan_slot(shm_budget.usage()[1], group.size, slot),
                                        shm_budget.SLOT_FLOOR)
        offer[:] = (int(seg.name.rsplit("-", 1)[1], 16), seg.nonce, seg.slot_bytes, why) if seg \
            else (0, 0, 0, why)
    verdict = np.zeros(1, dtype=np.uint8)
    try:
        group.queue.run_internal("group setup", lambda call: binomial_broadcast(call, offer, 0))
        if seg is None and offer[0]:
            try:
                seg = GroupSegment(f"{prefix}-{int(offer[0]):08x}", group.size, int(offer[2]), False)
                if seg.nonce != int(offer[1]):
                    seg.close()
                    seg = None
            except OSError as exc:
                _log.info("rank %d: group %s: cannot map its segment (%s)", group.runtime.rank, group.name,
                          exc)
                seg = None
        verdict[0] = seg is not None
        if seg is not None:
            direct = DirectPath(seg, group.rank, group.engine, group.ctx, group.ranks)
            direct.offer_single_copy(_single_copy_refused(group.runtime.config.single_copy))
            direct.crowded = group.runtime.config.single_copy == "1" and group.engine.oversubscribed
        group.queue.run_internal("group setup",
                                 lambda call: recursive_doubling_all_reduce(call, verdict, ReduceOp.MIN))
    finally:
        if seg is not None and group.rank == 0:
            seg.unlink()  # everyone mapped it, gave up or failed: nothing is left in /dev/shm
    if verdict[0] and seg is not None:
        group.direct = direct
        _setup_single_copy(group, direct)
    elif seg is not None:
        seg.close()
    return int(offer[2]), int(offer[3])



def _setup_single_copy(group: Group, direct: DirectPath) -> None:
    """Collectively: single copy where every rank can read every peer's memory."""
    why = direct.offered or direct.probe_single_copy()
    verdict = np.array([not why], dtype=np.uint8)
    group.queue.run_internal("group setup",
                             lambda call: recursive_doubling_all_reduce(call, verdict, ReduceOp.MIN))
    if verdict[0]:
        direct.enable_single_copy()
    elif why:
        _log.info("rank %d: group %s: no single copy (%s)", group.runtime.rank, group.name, why)


def _single_copy_refused(setting: str) -> str:
    """Why this rank offers no single copy to a new group; '' if it does."""
    if setting == "0":
        return "TENSORWIRE_SINGLE_COPY=0"
    return cma.allow_peers()
