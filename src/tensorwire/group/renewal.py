"""Renewal: a group goes on after a call that a member refused while others ran it.

A call every member refused (a local argument error: execution.CallQueue.refuse) left nothing
in flight and fails alone. Where some member ran it instead, its messages may be half-delivered
and its shared slots half-written, so it fails on every member that had not finished it, and
the group is aborted as after any failed call. Each member's next call (or a later call it
made before it learned of the refusal, as that call fails) then renews the group in place:
the members agree that nobody was lost (transport/agreement.py) and on the last call any of
them made, and the group goes on under a new context (what the failed call left in flight is
dropped with the old one: Engine.retire), with a new shared segment and its plans made
afresh. The calls a member made past the refused one before it learned of it (a broadcast's
root needs nothing back) fail on the members that had not made them yet, so every member
fails the same calls. Until the renewal, the group's point-to-point calls made after the
failed call raise an AbortedError quoting the refusal (those made before it go on:
Failures.covering). A member lost meanwhile ends it: the group stays aborted, for shrink();
so does a renewal that times out, whose member tells the others so that they fail at once
(Agreement.abandon). See docs/design/failures.md#renewing-a-group-after-a-refused-call.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .. import log
from ..errors import CLEAN_GROUP, AbortedError, TimeoutError
from ..transport.agreement import Agreement
from .context import mix_context

if TYPE_CHECKING:
    from .group import Group

_log = log.get("COLL")
RENEW = 0x524E4557  # "RENW", mixed into the contexts a renewal derives
_HINT = ("every member's next call on the group renews it after a refused call; is one blocked outside "
         "tensorwire, or in a call of another group?")


def renew(group: Group, timeout: float | None) -> None:
    """Renew `group` (aborted because a member refused a call others ran) in place, with
    every member; raise its abort if a member was lost (the group stays aborted: shrink).
    Calls that another member made on the old context and this one has yet to make are
    counted in `group.queue.doomed`: they fail here without running."""
    engine, queue, ctx = group.engine, group.queue, group.ctx
    seq, error = engine.aborted[ctx]
    limit = group.timeout if timeout is None else timeout
    engine.renewable.discard(ctx)  # one try: a renewal that fails leaves the group aborted
    what = f"renewal of group {group.name} after its call #{seq - queue.internal}"
    agreement = Agreement(engine, group.ranks, mix_context(ctx, RENEW, seq), what, queue.seq, _HINT)
    try:
        failed = agreement.decide(time.perf_counter() + limit, limit)
    except TimeoutError as exc:  # the others are told, so that they need not time out in turn
        stays = TimeoutError(f"{exc} The group stays aborted ({CLEAN_GROUP}). The refused "
                             f"call: {error}")
        agreement.abandon(AbortedError(str(stays)))
        engine.stays_aborted(ctx, stays)
        raise stays from None
    except AbortedError as exc:  # a member gave up (abandon): its error says why
        engine.stays_aborted(ctx, exc)
        raise
    if failed:
        _log.warning("rank %d: group %s stays aborted: rank(s) %s failed", engine.rank, group.name,
                     sorted(failed))
        raise error
    engine.retire(ctx, error)
    engine.refusals.pop(ctx, None)
    queue.doomed, queue.doom, queue.seq = agreement.note - queue.seq, error, agreement.note
    try:
        group.renew(mix_context(ctx, RENEW, seq, *group.ranks))  # the agreement's context is retired
    except BaseException as exc:  # the new segment's setup failed: so does every member's
        group.abort(exc)
        raise
    _log.info("rank %d: %s done", engine.rank, what)
