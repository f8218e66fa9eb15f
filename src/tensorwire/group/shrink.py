"""Shrink: after a rank fails, the survivors agree on who failed and go on in a new group.

ULFM's MPI_Comm_shrink, NCCL's ncclCommShrink. Every surviving member calls `Group.shrink()`;
they agree on the failed set even if more ranks die meanwhile (transport/agreement.py) and get a
new group of the survivors, ranked in their old order, with a context of its own (and, on one
host, a new shared segment and single copy). The shrunk group stays aborted and its context is
retired in the engine: what its failed call left queued is dropped, and whatever of it is still
in flight is discarded on arrival. A group in which nothing failed (and that is not aborted)
stays usable beside its equivalent new one.

A rank that dies after the decision makes the new group's first call fail, so shrink ends with
a barrier on the new group and, if that fails, shrinks the new group within the same deadline,
exactly as a member that got it back would by calling its shrink().

A member that stopped answering without its connection closing (its host down or cut off) is
lost within TENSORWIRE_PEER_TIMEOUT (tcp.tune_socket, failures.Failures.check_silent), which
ends the wait for its report. A shrink that times out (a live member that has not called it yet) can be called
again: it resumes the same agreement, which the late member's first call joins.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from .. import log
from ..errors import AbortedError, PeerLostError, TimeoutError
from ..transport.agreement import Agreement
from ..transport.engine import Engine
from .arguments import check_member, limit_of
from .context import mix_context

if TYPE_CHECKING:
    from .group import Group

_log = log.get("COLL")
SHRINK = 0x5348524B  # "SHRK", mixed into the contexts a shrink derives
_PENDING: weakref.WeakKeyDictionary[Group, tuple[int, Agreement]] = weakref.WeakKeyDictionary()
"""A group's shrink that timed out in its agreement: the shrink's count and that agreement."""


def shrink_group(group: Group, timeout: float | None = None, *, majority: bool = False) -> Group:
    """After a member failed: a new group of the surviving members, ranked in their old
    order, agreed on by all of them (MPI_Comm_shrink). Every live member must call it;
    this group stays aborted. Called where nothing failed, it returns an equivalent group
    (same members, a new context) and leaves this one usable. `timeout` (default: the
    group's) bounds the whole of it; after a TimeoutError it can be called again, and goes on
    where it stopped. `majority`: the survivors must be more than half of the members, or half
    with its first: of the two sides of a network partition, one goes on and the other raises
    (without it, each shrinks to itself). See docs/failures.md."""
    check_member(group, "shrink")
    members = list(group.ranks)
    limit = limit_of(group, timeout, "shrink", collective=False)
    deadline = time.perf_counter() + limit
    engine = group.engine
    count, agreement = _PENDING.pop(group, (group.shrinks + 1, None))
    ranks, ctx, name, next_seq = list(group.ranks), group.ctx, group.name, group.queue.seq + 1
    while True:
        if agreement is None:
            agreement = Agreement(engine, ranks, mix_context(ctx, SHRINK, count), f"shrink of group {name}")
        try:
            failed = agreement.decide(deadline, limit)
        except TimeoutError:
            if ctx == group.ctx:
                _PENDING[group] = count, agreement
            raise
        agreement = None
        if ctx == group.ctx:
            group.shrinks = count
        survivors = [w for w in ranks if w not in failed]
        if failed or ctx in engine.aborted:
            _retire(engine, ctx, next_seq, ranks, name, failed)
        if majority and not (2 * len(survivors) > len(members) or
                             2 * len(survivors) == len(members) and members[0] in survivors):
            raise AbortedError(
                f"rank {engine.rank}: shrink of group {group.name} (majority=True): the survivors, world "
                f"ranks {survivors}, are not a majority of its {len(members)} members (or half with its "
                f"first, rank {members[0]}); the others may have gone on without them (a network partition)")
        new_ctx = mix_context(ctx, SHRINK, count, *survivors)
        new_name = _shrunk_name(group.runtime.shrunk, name)
        _log.info("rank %d: group %s shrunk to %s (ranks %s; failed: %s)", engine.rank, name, new_name,
                  survivors, sorted(failed) or "none")
        try:
            new = group.derive(survivors, new_ctx, new_name)
            new.barrier(timeout=max(0.0, deadline - time.perf_counter()))  # every survivor is in
            return new
        except (PeerLostError, AbortedError) as exc:
            engine.abort_group(new_ctx, 1, survivors, exc)  # members still setting it up stop too
            if time.perf_counter() > deadline:
                raise
            _log.warning("rank %d: new group %s failed at once (%s); shrinking it", engine.rank,
                         new_name, exc)
            ranks, ctx, name, next_seq, count = survivors, new_ctx, new_name, 1, 1


def _shrunk_name(shrunk: dict[str, int], name: str) -> str:
    """`world` -> `world.shrink1` -> `world.shrink2`, numbered along the line of groups shrunk
    from `world` in this process (`shrunk`: the runtime's counts): one suffix however often
    a group shrinks, and a second shrink of `world` is not named as the first's shrink."""
    base, dot, last = name.rpartition(".shrink")
    line = base if dot and last.isdigit() else name
    shrunk[line] = shrunk.get(line, 0) + 1
    return f"{line}.shrink{shrunk[line]}"


def _retire(engine: Engine, ctx: int, seq: int, ranks: Sequence[int], name: str,
            failed: Iterable[int]) -> None:
    """The shrunk group fails from its next call on, here and on members that have not noticed
    yet (they may be waiting for this rank), and its context is retired."""
    lost = ", ".join(map(str, sorted(failed))) or "none"
    error = AbortedError(f"rank {engine.rank}: group {name} was shrunk (failed ranks: {lost}); use the "
                         "group shrink() returned")
    engine.abort_group(ctx, seq, ranks, error)  # a no-op where it failed already
    engine.retire(ctx, engine.aborted[ctx][1])


