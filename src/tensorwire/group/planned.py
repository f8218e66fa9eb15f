"""A group's planned calls: the fast path of repeated small calls.

A call whose signature (collective, dtype, count, op, root, in/out of place) passed its checks
before only needs its arrays' flags re-checked, and on the direct path runs with everything
else looked up already: most of a small call's Python time. The collectives look their plan
up at their top (`group.plans.get(key)`, a dict lookup), remember one after a checked call,
and submit through `Plans.submit`; gpu/planned.py's small device all_reduce does the same.
A plan is bound to the group's segment: where the group renews itself before the call
(renewal.py), `Plans.submit` returns REPLAN, and the collective takes its checked path.
Where the compiled module is built, each plan of the one-shot path also goes to the group's
compiled caller (`Plans._compile`), which runs its calls whole before any Python runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from threading import get_ident
from typing import TYPE_CHECKING, Any

import numpy as np

from ..algorithms import single_copy
from ..algorithms.direct_plans import COMPILED_PLANS, AllReducePlan
from ..algorithms.registry import Algorithm
from ..algorithms.shm_direct import barrier_after
from ..errors import InvalidArgumentError, retold
from ..ops import Reduction
from ..transport import pages
from ..transport.wire import Coll, Fingerprint
from ..tuning import tuner
from .arguments import limit_of
from .bodies import no_op
from .calls import CollectiveCall

if TYPE_CHECKING:
    from ..transport.segment import DirectPath
    from .execution import CallQueue
    from .group import Group

_PLANS = 256  # checked call signatures kept per group
REPLAN = object()
"""What Plans.submit returns for a plan the group's renewal made stale: take the checked path."""
_BARRIER = Fingerprint(Coll.BARRIER, 0, 0, -1, -1)
_COLLECTIVE_OF = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
                  "all_to_all_single": "all_to_all"}
"""The tuner's collective of an API name the compiled caller takes, where the names differ."""
Chosen = Any
"""What a plan's run runs: the tuner's choice (an Algorithm or a PageDependent), a one-shot
plan (direct_plans.COMPILED_PLANS), or None (a call for the general body, or nothing to move)."""


class Plans(dict):
    """Checked call signatures -> their plans: (call, on the direct path?, run, *extra), or
    for all_reduce (call, the direct path's run or None, reduction); "barrier" -> (call,
    run, on the direct path?). A dict, so that taking a plan costs one lookup."""

    __slots__ = ("group", "queue", "engine", "ctx", "caller", "chosen", "priced_in_c")

    def __init__(self, group: Group, queue: CallQueue) -> None:
        super().__init__()
        self.group = group
        self.queue = queue
        self.engine = group.engine
        self.ctx = group.ctx
        self.caller: Any = None
        """The compiled caller (transport/_caller.c), where Group made one: it runs the
        planned one-shot calls it was given (`_compile`) from the group's API in one C call."""
        self.chosen: dict[Any, Chosen] = {}
        """What each plan's run runs: what the compiled caller may take from it."""
        self.priced_in_c: frozenset[str] = frozenset()
        """The collectives (tuner's names) the compiled caller takes in some API form, but the
        barrier, chosen once: the tuner prices every call of them as the caller runs them."""

    def take(self, caller: Any, names: tuple[str, ...]) -> None:
        """Plan for `caller`, the compiled caller of the API names `names`."""
        self.caller = caller
        self.priced_in_c = frozenset(_COLLECTIVE_OF.get(n, n) for n in names) - {"barrier"}

    def clear(self) -> None:
        super().clear()
        self.chosen.clear()
        if self.caller is not None:
            self.caller.clear()

    def _keep(self, key: Any, plan: tuple, chosen: Chosen) -> None:
        self[key] = plan
        self.chosen[key] = chosen
        if self.caller is not None:
            self._compile(key, plan, chosen)

    def recompile(self) -> None:
        """Give the compiled caller every plan afresh (a PageDependent plan now runs its other
        choice)."""
        if self.caller is not None:
            self.caller.clear()
            for key, plan in self.items():
                self._compile(key, plan, self.chosen[key])

    def _compile(self, key: Any, plan: tuple, chosen: Chosen) -> None:
        """Give the compiled caller a plan whose calls it can run whole: a barrier on the
        direct path, a plan of COMPILED_PLANS of a collective the caller takes, or single
        copy's own run of a broadcast, all_gather_into_tensor, all_to_all_single, gather or
        scatter (single_copy.MOVES), matched by the key collectives.py made it under."""
        dp, native = self.group.direct, self.engine.native
        if dp is None or dp.native is None or native is None or self.queue.phase_of:  # see CallQueue.phase_of
            return
        call = plan[0]
        a, b = dp.words_of(call.fp)
        dependent = chosen if isinstance(chosen, tuner.PageDependent) else None
        if dependent is not None:  # compiled as what it runs now; it learns its sources' pages in C
            chosen = dependent.current()
        algorithm = chosen.name if isinstance(chosen, Algorithm) else None
        if key == "barrier":
            if algorithm == "direct":
                self.caller.add("barrier", None, 0, 0, -1, None, True, dp.native, call, self.ctx, a, b,
                                barrier_after)
            return
        what = key[0]
        spec = chosen.compiled_call() if isinstance(chosen, COMPILED_PLANS) else None
        moves = what in single_copy.MOVES and dp.single_copy and algorithm == "single_copy"
        if (spec is None and not moves) or what not in native.COMPILED_CALLS:
            return
        rooted = what in ("broadcast", "gather", "scatter")
        root, extra = spec if spec is not None else (key[3] if rooted else -1, ())
        dtype = key[1]
        nbytes = out_bytes = dtype.itemsize * math.prod(key[2]) if what == "all_to_all_single" \
            else dtype.itemsize * key[2]
        op, inplace = None, True
        if what == "all_to_all_single":  # (.., input's shape, output's)
            out_bytes = dtype.itemsize * math.prod(key[3])
        elif what in ("all_gather_into_tensor", "reduce_scatter_tensor"):  # (.., output's count[, op])
            out_bytes = dtype.itemsize * key[3]
            op = key[4] if len(key) > 4 else None
        elif what in ("all_reduce", "reduce"):  # (..[, root], op, in place)
            op, inplace = key[-2], key[-1]
        elif what == "broadcast":  # (.., root, in place)
            inplace = key[-1]
        if moves:  # a page-dependent plan's table carries its share of huge pages, as _offer's
            tail = single_copy.planned_tail(what, root)
            self.caller.add_moves(what, dtype, nbytes, out_bytes, root, op, inplace, dp.native, call,
                                  self.ctx, a, b, tail, single_copy.MOVES[what], root, dp.pids,
                                  single_copy.alias_window(dp), pages.UNKNOWN if dependent is None
                                  else native.PAGES_SCAN, None if dependent is None
                                  else dependent.learned)
            return
        assert isinstance(chosen, COMPILED_PLANS)  # (spec is not None)
        chosen.words(call)
        self.caller.add(what, dtype, nbytes, out_bytes, root, op, inplace, dp.native, call, self.ctx, a, b,
                        chosen.after, *extra)

    def call(self, fp: Fingerprint, what: str) -> CollectiveCall:
        """A reusable call object for a plan (`submit` numbers it per call)."""
        return CollectiveCall(self.group, 0, fp, what, self.group.timeout)

    def remember_all_reduce(self, key: tuple, src: np.ndarray, fp: Fingerprint, red: Reduction) -> None:
        """Plan a checked all_reduce: (call, the direct path's run or None, reduction). Where
        the tuner picks the direct path, its AllReducePlan's run, with nothing left to look
        up per call; else None, for the general body. A signature planned already is kept:
        the checked path also runs for calls the planned path does not take (an async call
        on a torch tensor), and planning again would cost them more than the call."""
        if len(self) >= _PLANS or key in self:
            return
        group = self.group
        call = self.call(fp, "all_reduce")
        if group.size > 1 and src.size and self._select("all_reduce", "all_reduce",
                                                        src.nbytes).name == "direct" \
                and group.direct is not None:  # (the direct path: there is one)
            plan = AllReducePlan(group.direct, src.dtype, src.size, red.op, red)
            self._keep(key, (call, self._named(plan.run), red), plan)
        else:
            self._keep(key, (call, None, red), None)

    def remember(self, key: tuple, fp: Fingerprint, what: str, collective: str, nbytes: int,
                 *extra: Any, one_rank: bool = False,
                 whole: tuple[int, Callable[[DirectPath], Callable[..., Any]]] | None = None) -> None:
        """Plan a signature whose checks passed, for the planned path at the top of its
        collective: (call, on the direct path?, the chosen algorithm's run or None where
        nothing moves, *extra). `one_rank`: the algorithm has work even on a single rank.
        `whole`: (bytes a rank puts in its slot, the factory of a plan's bound run on a direct
        path) of a call the direct path's one shot can run from a plan that takes the arrays
        themselves (TensorPlan, ReducePlan, BroadcastPlan): where the tuner picks that path and the bytes
        fit the slot, the run is the plan's, and the last of `extra` (what only the general
        body needs) is None. A signature planned already is kept (see remember_all_reduce)."""
        if len(self) >= _PLANS or key in self:
            return
        group = self.group
        alg = self._select(what, collective, nbytes) if group.size > 1 or one_rank else None
        run, chosen = (None, None) if alg is None else (alg.run, alg)
        direct = group.direct
        if whole is not None and alg is not None and alg.name == "direct" and direct is not None \
                and whole[0] <= direct.slot_bytes:
            bound = whole[1](direct)
            run, chosen = self._named(bound), bound.__self__  # type: ignore[attr-defined]  # a bound method
            extra = (*extra[:-1], None)
        self._keep(key, (self.call(fp, what), alg is not None and alg.needs_direct, run, *extra), chosen)

    def remember_barrier(self) -> tuple:
        """Plan the group's barrier: (call, run, on the direct path?)."""
        alg = self._select("barrier", "barrier", 0) if self.group.size > 1 else None
        self._keep("barrier", (self.call(_BARRIER, "barrier"), no_op if alg is None else alg.run,
                               alg is not None and alg.needs_direct), alg)
        return self["barrier"]

    def _select(self, what: str, collective: str, nbytes: int) -> Algorithm | tuner.PageDependent:
        """tuner.select for the call `what` about to be made; where no algorithm may run it
        (TENSORWIRE_ALGO forcing one that cannot), that call is refused on every member, named
        as errors name calls ('rank 0: broadcast #1 on group world: ...')."""
        try:
            return tuner.select(self.group, collective, nbytes)
        except InvalidArgumentError as exc:
            head = f"rank {self.group.runtime.rank}: "
            self.group.fail_fast(retold(exc, f"{head}{what}: {str(exc).removeprefix(head)}"))

    def _named(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """A one-shot plan's run, which notes that `direct` ran its call where the COLL log has
        a line per call (as the tuner's algorithms do: tuner.noting)."""
        return tuner.noting(run, "direct") if self.queue.logged else run

    def submit(self, call: CollectiveCall, body: Callable[..., Any], direct: bool, async_op: bool,
               timeout: float | None, result: Any, *args: Any) -> Any:
        """CallQueue.submit for a planned call, given the plan's own call object: its Work where
        `async_op`, else `result` (the caller's output object), or REPLAN. A body that can run
        inline, with nothing arrived that must be vetted first, reuses that object: the setup
        saved is a fifth of a small call's time. A body of the direct path starts its deadline
        only if it has to wait; one of the message path runs so only in a group without a
        segment (else the segment must be stamped with the call, CallQueue._run)."""
        engine = self.engine
        if timeout is not None:
            limit_of(self.group, timeout, call.name)
        if direct:  # a one-shot body reads no ring nor socket (a message-path call's wait glances)
            engine.until_glance -= 1
            if not engine.until_glance:
                engine.glance()
        queue = self.queue
        entry = queue.entry
        # where nothing stands in the way, the call takes the group (CallQueue.enter); a call of
        # another thread that took it meanwhile (a compiled one: `busy`) leaves it to that one
        taken = not (async_op or not (direct or self.group.direct is None) or queue.busy or queue.pending
                     or entry or queue.doomed or engine.unexpected or queue.phase_of or queue.callbacks
                     or queue.logged or engine.deferred_aborts
                     or (engine.refusals and self.ctx in engine.refusals)
                     or (engine.aborted and self.ctx in engine.aborted)) \
            and entry.setdefault(0, me := get_ident()) == me
        if taken and queue.busy:
            del entry[0]
            taken = False
        if not taken:
            ctx = self.ctx
            queue.settle(timeout, call.name)
            if self.ctx != ctx:  # renewed: the plan was bound to the old segment
                return REPLAN
            done = queue.submit(call.fp, call.name, body, async_op, timeout, *args)
            return done if async_op else result
        queue.busy = True  # from here a call of another thread finds the group taken (CallQueue.enter)
        queue.current = call
        try:
            queue.seq = call.seq = queue.seq + 1
            call.timeout = self.group.timeout if timeout is None else timeout
            call.deadline = 0.0
            if not direct:
                call.start()
            engine.current[self.ctx] = call.ref
            # CPython calls body(call, *args) its slow way, so the usual arities are spelt
            # out: two arrays (most planned bodies), none (a barrier)
            if len(args) == 2:
                a, b = args
                body(call, a, b)
            elif args:
                body(call, *args)
            else:
                body(call)
            if queue.overlap is not None:
                queue.check_alone()
            return result
        except Exception as exc:
            error = _failure(queue, call, exc)
            if error is exc:
                raise
            raise error from exc
        except BaseException as exc:
            queue.interrupted(call, exc)
            raise
        finally:
            queue.busy = False  # CallQueue._release, inline: no call on the hottest path
            del entry[0]
            if queue.pending:
                queue.wake()

    def finish(self, call: CollectiveCall, tail: Callable[..., Any], status: int | BaseException,
               *arrays: Any) -> Any:
        """The rest of a call the compiled caller numbered and began: its body handed back
        `status` (transport/native.py) or raised it; `tail(call, status, *arrays)` finishes it
        as `submit`'s body would."""
        queue = self.queue
        try:
            if isinstance(status, BaseException):
                raise status
            done = tail(call, status, *arrays)
            if queue.overlap is not None:
                queue.check_alone()
            return done
        except Exception as exc:
            error = _failure(queue, call, exc)
            if error is exc:
                raise
            raise error from exc
        except BaseException as exc:
            queue.interrupted(call, exc)
            raise
        finally:
            queue.busy = False
            queue.compiled = None  # the compiled caller took the group for the call
            if queue.pending:
                queue.wake()


def _failure(queue: CallQueue, call: CollectiveCall, exc: Exception) -> BaseException:
    """What a planned call's body that raised `exc` raises (CallQueue.failed)."""
    return queue.out_of_memory(call, exc) if isinstance(exc, MemoryError) else queue.failed(call, exc)
