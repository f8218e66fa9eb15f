"""A group's ordered execution: sequence numbers, and who runs each call.

Collectives of one group run in the order they were called, on every rank. A blocking call
runs inline on the caller's thread when nothing is queued (no thread hop on the fast path);
async calls, and blocking calls queued behind them, run on the group's worker thread, or on
the thread that waits for them if the worker has not started them yet (`run_until`).
Any failure of a collective aborts the group on every member (as NCCL aborts a
communicator): a group whose messages may be half-delivered is never reused silently. A call
that every member refused before sending anything (`refuse`: a local argument error) left
nothing in flight, and fails alone; one that some member refused and others ran fails on
every member, and the group renews itself at the next call (renewal.py).
"""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

from .. import limits, log
from ..errors import (
    CLEAN_GROUP,
    AbortedError,
    InvalidArgumentError,
    PeerLostError,
    ResourceError,
    TimeoutError,
    called,
    in_call,
    naming_call,
)
from ..transport.wire import Coll, Fingerprint
from ..work import Work
from . import call_log
from .arguments import limit_of
from .calls import CollectiveCall
from .renewal import renew

if TYPE_CHECKING:
    from .group import Group


_log = log.get("COLL")
_MISSES = 8  # calls the worker was woken for and found run by their callers before it looks by itself
_LOOK_S, _LOOK_MAX_S = 0.001, 0.002  # its first and longest pause between looks
_PARK_S = 1.0  # it sleeps until woken once no call was queued for this long
_callbacks = threading.local()  # `active`: this thread runs a finished call's done-callbacks
_RUNNING_CALLBACKS: list[int] = []
"""The threads running finished calls' done-callbacks now, in any group: while there are any,
no call takes a planned fast path (Plans.submit, the compiled caller), so that each is counted
as the program's or a callback's (CallQueue.in_flight) and the two kinds' overlap is seen."""
os.register_at_fork(after_in_child=_RUNNING_CALLBACKS.clear)  # a fork has none of those threads


class CallQueue:
    """One group's calls, numbered in call order and run one at a time in that order."""

    # slots: the compiled caller reads and writes these where they lie (group/planned.py);
    # `logged` is read on the planned path (Plans.submit)
    __slots__ = ("seq", "busy", "doomed", "current", "logged", "compiled", "overlap", "__dict__",
                 "__weakref__")

    def __init__(self, group: Group) -> None:
        self.group = group
        self.engine = group.engine
        self.seq = 0  # the last call's sequence number
        self.internal = 0  # how many of them were the group's own (internal_call)
        self.raised = 0
        """The last call whose failure this rank raised (or caused): an abort of a call after it
        that this rank returned from is told as the group ends (Group._report_last_call)."""
        self.current: CollectiveCall | None = None  # the last call run: the engine notes it weakly
        self.busy = False  # a call is running (inline, on the worker, or on a waiter)
        self.pending: deque[tuple[CollectiveCall, Callable[..., Any], tuple, QueuedWork]] = deque()
        self.wrap: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None  # see wrapping
        self._cv = threading.Condition()
        self._worker: threading.Thread | None = None
        self._stopping = False
        self.wake_worker = True  # a queued call wakes the worker; False while it looks by itself (_work_loop)
        self.submitted = 0  # calls queued so far: the worker's looks tell from it whether calls still come
        self.doomed = 0
        """Calls to fail without running (with `doom`): after a renewal, those another member
        made on the old context before it learned of a refusal (renewal.py)."""
        self.doom: BaseException | None = None
        self.in_flight = [0, 0]
        """Calls submitted and not finished: made by the program, made in done-callbacks (_interleaved)."""
        self.callbacks = _RUNNING_CALLBACKS  # read where the planned paths are decided
        self.entry: dict[int, int] = {}
        """{0: the ident of the thread whose call is entering the group (numbered, queued) or
        runs inline on it}, taken in one atomic step (`enter`), so that a call another thread
        makes meanwhile is seen (`_overlapped`)."""
        self.compiled: int | None = None
        """The ident of the thread whose call the compiled caller runs: it takes the group so,
        with `busy`, where it found `entry` empty (the GIL held from its check on)."""
        self.runner: int | None = None
        """The ident of the thread that runs a queued call now (the worker, or a waiter:
        `run_until`): a call it makes meanwhile is made inside that one (`enter`)."""
        self.overlap: InvalidArgumentError | None = None
        """What `_overlapped` raised: the call that had the group then fails with it too as it
        returns (`check_alone`), even where its peers completed it."""
        self.logged = log.per_call(_log)
        """The COLL log has a line per call (call_log.py): every call comes through `_run`, as
        the planned path (Plans.submit) and the compiled caller (its clear_to_run) see here."""
        self.phase_of = 0
        """While a hierarchical call runs its phases on this group (one of its hierarchy's), that
        call's wire.phase_digest, mixed into each call's fingerprint here (Plans.submit and
        Plans._compile send such calls here)."""

    def submit(self, fp: Fingerprint, what: str, body: Callable[..., Any], async_op: bool,
               timeout: float | None, *args: Any) -> Any:
        """Give the call its sequence number now (call order is the contract), run it in order
        as body(call, *args)."""
        group = self.group
        limit = limit_of(group, timeout, what)
        self.enter(what)
        try:
            if self._unsettled():
                self._settle(timeout, True)
            origin = 1 if getattr(_callbacks, "active", False) else 0
            with self._cv:
                # a call running uncounted took a planned path, before any callbacks ran: the program's
                running = self.busy and not any(self.in_flight) and self.current is not None
                clash = self.in_flight[1 - origin] or (origin and running)
                if not clash:
                    self.in_flight[origin] += 1
            if clash:
                self._interleaved(what, origin, self.current.seq if running else None)  # type: ignore[union-attr]
            self.seq += 1
            if self.phase_of:
                fp = fp._replace(aux=fp.aux ^ self.phase_of)
            call = CollectiveCall(group, self.seq, fp, what, limit)
            aborted = self.engine.aborted.get(group.ctx)
            if aborted is not None and call.seq >= aborted[0]:
                self._finished(origin)
                self.raised = call.seq
                raise aborted[1]
            if self.wrap is not None:
                body = self.wrap(body)
            # Only the thread that entered enqueues, and the worker marks itself busy before it
            # pops, so an empty queue and an idle worker seen here mean nothing else can run now.
            if not async_op and not self.pending and not self.busy:
                self.busy = True
                try:
                    result = self._run(call, body, args)
                    if self.overlap is not None:
                        self.check_alone()
                    return result
                finally:
                    self._finished(origin)
                    self._release()
            work = QueuedWork(self, call.what, origin)
            refused: ResourceError | None = None
            with self._cv:
                self.pending.append((call, body, args, work))
                self.submitted += 1
                if self._worker is None or self._worker is threading.current_thread():
                    # none yet (or it ended), or its own completion callbacks queue this (a torch
                    # future's then-callback that waits for it: PowerSGD's hook): a new worker takes over
                    try:
                        self._start_worker()
                    except ResourceError as exc:  # no memory for a thread: the call fails on every member
                        self.pending.pop()
                        refused = exc
                elif self.wake_worker:
                    self._cv.notify_all()
            if refused is not None:
                self._finished(origin)
                self.group.abort(refused, call.seq)
                raise refused
        finally:  # ran, or queued: the group is another thread's to enter while this one waits
            del self.entry[0]
        if async_op:
            return work
        return work.result()

    def enter(self, what: str) -> None:
        """Take the group for this thread's call `what` until it runs inline or is queued (the
        caller gives it back: `del entry[0]`). Another thread's call in it meanwhile is an
        error (`_overlapped`), and so is this thread's own (`_reentered`)."""
        me = threading.get_ident()
        owner = self.entry.get(0)
        if owner is None:  # nobody else puts this thread's ident there: equal, it is this call's
            owner = self.entry.setdefault(0, me)
            if owner == me:
                # read once this call holds `entry`: no compiled call starts since
                owner = self.compiled if self.runner != me else me
                if owner is None:
                    return
                del self.entry[0]
        if owner == me:
            self._reentered(what)
        self._overlapped(what, owner)

    def _reentered(self, what: str) -> NoReturn:
        """Call `what` entered the group on the thread whose call of it was entering or running
        there (a signal handler's call, or a finalizer's, made inside that call): it could run
        only once that call returned, which waits beneath it. The group is aborted on every
        member, as for another thread's call (`_overlapped`): the call beneath is half done
        here while its peers go on, and fails with this error as it returns."""
        current, name = self.current, self.group.name
        inside = current.what if self.busy and current is not None else f"a call on group {name}"
        error = InvalidArgumentError(
            f"rank {self.group.runtime.rank}: {what} on group {name} was called on thread "
            f"{_thread_named(threading.get_ident())} while that thread was already inside {inside} "
            f"(re-entered, e.g. from a signal handler): it could run only once that call returned, "
            f"which waits beneath it; the group is aborted. Make no call on a group from a signal "
            f"handler or finalizer while the program may be inside one (set a flag there, and call after)")
        self._abort_both(error, None)

    def _overlapped(self, what: str, owner: int) -> NoReturn:
        """Call `what` entered the group on this thread while thread `owner`'s call was entering
        it or running inline: the two threads' calls are numbered in the order they happened
        to come here, which other ranks need not share, so ranks may pair one thread's call
        with the other's and return its data. The group is aborted on every member from the
        last call numbered here (the other thread's, if numbered: its peers then fail it rather
        than complete it on this rank's share), as for a done-callback's call (`_interleaved`)
        where one of the two is that."""
        seq = self.seq or None
        in_callbacks = getattr(_callbacks, "active", False)
        if in_callbacks or owner in _RUNNING_CALLBACKS:
            self._interleaved(what, 1 if in_callbacks else 0, seq)
        here, there = _thread_named(threading.get_ident()), _thread_named(owner)
        error = InvalidArgumentError(
            f"rank {self.group.runtime.rank}: {what} on group {self.group.name} was called on thread {here} "
            f"while a call of thread {there} was in progress on it: the ranks may pair the two threads' "
            f"calls differently; the group is aborted. Call a group's collectives from one thread at a time "
            f"(a lock around them), or give each thread a group of its own (new_group of the same ranks)")
        self._abort_both(error, seq)

    def check_alone(self) -> None:
        """The call that had the group as another thread's came (`overlap`) returns: it fails
        with that one's error, as the ranks may have paired it with the other's, and a peer's
        share may have completed it before the abort reached this rank's wait."""
        error, self.overlap = self.overlap, None
        if self.pending:  # (the compiled caller leaves the wake to this)
            self.wake()
        if error is not None:
            raise error

    def _start_worker(self) -> None:
        """A worker thread for the queued calls (the lock held); one that is in its calls'
        done-callbacks ends once they return (_serve)."""
        if self._worker is None:
            weakref.finalize(self, _wake, self._cv, os.getpid())
        worker = threading.Thread(target=_work_loop, args=(weakref.ref(self), self._cv),
                                  daemon=True, name=f"tensorwire-group-{self.group.name}")
        limits.start_thread(worker, f"rank {self.group.runtime.rank}: group {self.group.name}'s worker")
        self._worker = worker

    def hand_over(self) -> None:
        """Where the worker itself waits (a done-callback waiting for a call queued behind
        it), another takes the queued calls meanwhile."""
        with self._cv:
            if self._worker is threading.current_thread() and self.pending and not self._stopping:
                self._start_worker()

    def _finished(self, origin: int) -> None:
        with self._cv:
            self.in_flight[origin] -= 1

    def _interleaved(self, what: str, origin: int, running: int | None) -> NoReturn:
        """A call made in a finished call's done-callbacks (a torch future's then()) while calls
        the program made are in flight, or the reverse: their order depends on timing, so the
        ranks may pair different calls. The group is aborted on every member instead, from the
        program's call that runs where known (`running`: a peer may have paired it with its own
        callback's)."""
        rank = self.group.runtime.rank
        made = ("in a Work's done-callback while calls the program made",
                "by the program while calls made in a Work's done-callback")[1 - origin]
        error = InvalidArgumentError(
            f"rank {rank}: {what} on group {self.group.name} was made {made} are in flight on it: the ranks "
            f"may order such calls differently; the group is aborted. Wait until the callbacks' calls are "
            f"done before the next call, or make them on another group (torch: PowerSGD's hook with several "
            f"DDP buckets does this: use one bucket, bucket_cap_mb above the gradients' size)")
        self._abort_both(error, running)

    def _abort_both(self, error: InvalidArgumentError, seq: int | None) -> NoReturn:
        """Of two calls the ranks may pair differently: abort the group from call `seq`, or from
        the first call still in flight here (running or queued) where that is earlier, as a peer
        may have paired it differently too and would otherwise wait for it until this rank left;
        and fail the one that has the group as it returns (`check_alone`) as well as this one."""
        with self._cv:
            flying = [c.seq for c, *_ in self.pending]
        if self.busy and self.current is not None:
            flying.append(self.current.seq)
        if flying and (seq is None or min(flying) < seq):
            seq = min(flying)
        self.overlap = error
        self.group.abort(error, seq)
        raise error

    def refuse(self, error: Exception) -> NoReturn:
        """A local argument error (or failed allocation) in the call about to be made, found
        before it sent anything: the call takes its number and fails here, and every member is
        told, so peers raise it too instead of waiting for this rank. The group lives on if
        every member refused that call too (its next call here waits until they all said so:
        `_after_refusals`); where a member ran it instead, the group renews itself (renewal.py)."""
        group = self.group
        self.enter(called(error, group.runtime.rank))
        try:
            try:
                self._settle(None, False)  # earlier calls' refusals, a renewal
            except Exception:  # noqa: BLE001 - the group stays failed; this call's own error says more
                pass
            if self.doomed:
                self.doomed -= 1
                raise error from None  # one error: not also the one it was made from (as_array's)
            self.seq += 1  # numbered, aborted group or not: a renewal counts the calls made
            self.raised = self.seq
            error = naming_call(error, group.runtime.rank, self.seq - self.internal, group.name)  # type: ignore[assignment]
            if group.ctx not in self.engine.aborted:
                self.engine.refuse(group.ctx, self.seq, group.ranks, error)
            raise error from None
        finally:
            del self.entry[0]

    def settle(self, timeout: float | None, what: str) -> None:
        """Before call `what` is numbered: what a refusal left to do (`_settle`), if anything,
        as part of the call (`enter`: a renewal numbers calls)."""
        if self._unsettled():
            self.enter(what)
            try:
                self._settle(timeout, True)
            finally:
                del self.entry[0]

    def _unsettled(self) -> bool:
        """Whether a refusal left something to do before the next call (`_settle`)."""
        engine = self.engine
        return bool((engine.refusals and self.group.ctx in engine.refusals) or engine.renewable
                    or self.doomed)

    def _settle(self, timeout: float | None, numbering: bool) -> None:
        """Before a call: settle the refusals of this group's calls up to it (`numbering`: the
        call about to be numbered among them), renew the group if a member refused a call
        others ran, and fail the call here if another member made it on the old context
        already (`doomed`)."""
        group, engine = self.group, self.engine
        if engine.refusals and group.ctx in engine.refusals:
            self._after_refusals(timeout, self.seq + numbering)
        # only once this rank made the failed call, which fails with the abort as it is numbered,
        # as on the others (their next call may never come); calls before it run as they were
        if group.ctx in engine.renewable and engine.aborted[group.ctx][0] <= self.seq \
                and not (self.busy or self.pending):
            renew(group, timeout)
        if self.doomed and numbering:
            self.doomed -= 1
            raise self.doom  # type: ignore[misc]

    def _after_refusals(self, timeout: float | None, upto: int) -> None:
        """For each call of this group up to `upto` a member refused: where this rank refused it
        too, wait until every member refused it (the group goes on) or one ran it (the group
        renews); where this rank ran it, fail the group so that it renews; where this rank is
        about to make it, refuse it too (nothing was sent)."""
        group, engine = self.group, self.engine
        for seq in sorted(engine.refusals.get(group.ctx, {})):
            if seq > upto:
                break  # a later call, which this rank has yet to reach
            notes = engine.refused_by(group.ctx, seq)
            if group.runtime.rank not in notes:
                error = next(iter(notes.values()))
                if seq <= self.seq:  # ran it: a sender finished before the refusal came
                    engine.settle_refusal(group.ctx, seq)
                    engine.abort_group(group.ctx, seq, group.ranks, error, renew=True)
                    return
                self.seq += 1
                engine.refuse(group.ctx, self.seq, group.ranks, error)
                raise error
            limit = group.timeout if timeout is None else timeout
            deadline = time.perf_counter() + limit
            while any(r not in notes for r in group.ranks) and group.ctx not in engine.aborted:
                engine.check_group(group.ctx, seq, group.ranks)
                if time.perf_counter() > deadline:
                    waits = ", ".join(str(r) for r in group.ranks if r not in notes)
                    raise TimeoutError(f"rank {group.runtime.rank}: the next call on group {group.name} "
                                       f"waited {limit:g} s for rank(s) {waits} to refuse or run call "
                                       f"#{seq - self.internal} too, which this rank refused")
                engine.look()
                notes = engine.refused_by(group.ctx, seq)
            engine.settle_refusal(group.ctx, seq)

    def internal_call(self, what: str, aux: int = 0) -> CollectiveCall:
        """A call for the group's own bookkeeping; it takes a sequence number like any other,
        but is not counted among the user's (CollectiveCall.number). `aux`: what the members
        must agree on besides (the group's order, as its setup checks it)."""
        self.seq += 1
        self.internal += 1
        call = CollectiveCall(self.group, self.seq, Fingerprint(Coll.SETUP, aux=aux), what,
                              self.group.timeout)
        call.start()
        return call

    def run_internal(self, what: str, body: Callable[[CollectiveCall], Any], aux: int = 0) -> Any:
        """Run `body` as one of the group's own calls (internal_call), entered and failing as
        any call does (_run): peers asking which call it runs are told, every member aborted
        where it fails, a timeout naming the members not in it (one that never called new_group)."""
        return self._run(self.internal_call(what, aux), body, ())

    @contextmanager
    def wrapping(self, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
        """Calls submitted meanwhile run as wrap(body): a staged device call's host collective
        must start only once its data has reached the host, and queue its copy back as it ends,
        wherever (whichever thread) the body runs."""
        self.wrap = wrap
        try:
            yield
        finally:
            self.wrap = None

    def _release(self) -> None:
        """An inline call ended: the worker may take what was queued behind it meanwhile."""
        self.busy = False
        if self.pending:
            self.wake()

    def wake(self) -> None:
        """Wake the worker for a queued call, unless it looks for them by itself."""
        with self._cv:
            if self.wake_worker:
                self._cv.notify_all()

    def _run(self, call: CollectiveCall, body: Callable[..., Any], args: tuple) -> Any:
        group = self.group
        call.start()
        self.current = call
        try:
            if self.engine.enter_call(group.ctx, call):
                aborted = self.engine.aborted.get(group.ctx)
                if aborted is not None and call.seq >= aborted[0]:
                    raise aborted[1]  # entering revealed a mismatch with an earlier or this call
            result = body(call, *args)
            direct = group.direct
            if direct is not None and direct.st.prev_seq != call.seq:
                direct.stamp(call)  # it ran on the message path
            if self.logged:
                call_log.ran(call)
            return result
        except MemoryError as exc:
            raise self.out_of_memory(call, exc) from exc
        except Exception as exc:
            error = self.failed(call, exc)
            if error is exc:
                raise
            raise error from exc
        except BaseException as exc:
            self.interrupted(call, exc)
            raise

    def interrupted(self, call: CollectiveCall, exc: BaseException) -> None:
        """A call left half done by what is no error of the call (KeyboardInterrupt, SystemExit):
        its peers may wait for this rank's part, or take its next call for this one. The group
        is aborted, on every member, with an AbortedError that says so; `exc` itself goes on."""
        rank = self.group.runtime.rank
        try:
            self.group.abort(AbortedError(f"rank {rank}: {call.what} was interrupted on rank {rank} "
                                          f"({type(exc).__name__}): the group is aborted; {CLEAN_GROUP}"),
                             call.seq)
        except Exception as exc2:  # noqa: BLE001 - best effort: `exc` is what the caller must see
            _log.warning("rank %d: group %s not aborted after %s: %s", rank, self.group.name,
                         type(exc).__name__, exc2)

    def failed(self, call: CollectiveCall, exc: Exception) -> BaseException:
        """Whatever broke, the peers must not wait for this rank: the group is aborted with the
        error, a lost peer's named with the call (the engine's knows the peer, not the call), a
        timeout's with the members not in the call (Engine.missing)."""
        group = self.group
        error: BaseException = in_call(exc, call.what) if isinstance(exc, PeerLostError) else exc
        phase = any(group.ctx in kids for kids in self.engine.children.values())  # named by its parent's call
        if isinstance(exc, TimeoutError):
            if phase:  # its caller's call asks the whole group who is missing, then aborts it and this
                return error
            error = self.engine.missing(exc, group.ctx, call.seq, group.ranks, self.internal)
        group.abort(error, call.seq)
        engine = self.engine
        if group.ctx in engine.renewable and call.seq > engine.aborted[group.ctx][0] and not self.pending \
                and threading.current_thread() is not self._worker:  # the caller: nothing queues meanwhile
            try:  # it ran past a call a member refused: its next call is this one, as the others'
                renew(group, call.timeout)
            except Exception as exc2:  # noqa: BLE001 - the group stays aborted: its error says why
                _log.info("rank %d: group %s not renewed: %s", engine.rank, group.name, exc2)
                return exc2
        return error

    def out_of_memory(self, call: CollectiveCall, exc: MemoryError) -> ResourceError:
        """A call that could not allocate: the error names the limits, and every member gets it."""
        error = limits.memory_error(exc, f"rank {self.group.runtime.rank}: {call.what}")
        self.group.abort(error, call.seq)
        return error

    def run_until(self, work: Work) -> None:
        """Run the queued calls up to `work` on this (the waiting) thread while the worker has
        not taken them: a small async call waited for at once then costs no thread wake-ups
        (see docs/design/groups.md#stealing)."""
        while not work.done:
            with self._cv:
                if self.busy or not self.pending or self._stopping:
                    return  # the worker has it, or it is done: wait the usual way
                self.busy = True  # as the worker does: see submit
                queued = self.pending.popleft()
            _finish_in_callbacks(self._run_queued(*queued))

    def _run_queued(self, call: CollectiveCall, body: Callable[..., Any], args: tuple,
                    work: QueuedWork) -> Callable[[], None]:
        """Run a queued call; returns what finishes its Work, for the runner to call once it let
        go of the call: a waiter may drop the group as it wakes, and be right to expect it
        collected."""
        self.runner = threading.get_ident()
        try:
            result = self._run(call, body, args)
            if self.overlap is not None:
                self.check_alone()
        except BaseException as exc:  # handed to whoever waits on the Work
            return functools.partial(work.finish, exc=exc)
        else:
            return functools.partial(work.finish, result)
        finally:
            self.runner = None
            with self._cv:
                self.in_flight[work.origin] -= 1
                self.busy = False
                if self.pending and self.wake_worker:
                    self._cv.notify_all()

    def stop_worker(self, grace: float, why: str) -> None:
        """End the worker thread before the interpreter finalizes: a daemon thread that is
        still inside a C++ call then (a torch op in an abandoned async collective) aborts the
        whole process. Queued calls fail; the running one gets `grace` seconds to finish, as
        does one another thread of the program runs (nothing else would end it once this
        rank's connections close)."""
        group = self.group
        with self._cv:
            self._stopping = True
            worker = self._worker  # read before it can end (and clear it)
            dropped = list(self.pending)
            self.pending.clear()
            self._cv.notify_all()
        rank = group.runtime.rank
        for call, _body, _args, work in dropped:
            work.finish(exc=AbortedError(f"rank {rank}: {call.what} was still queued when {why}"))
        if worker is threading.current_thread():
            return
        if worker is not None:
            worker.join(grace)
            if worker.is_alive():
                self.engine.fail_locally(group.ctx, 0, AbortedError(
                    f"rank {rank}: {self._running()}: {why} while the group's worker ran it (an async call)"))
                worker.join(grace)
        if self.busy:  # a call the program runs on another thread
            self._await_idle(grace)
            if self.busy:
                self.engine.fail_locally(group.ctx, 0, AbortedError(
                    f"rank {rank}: {self._running()}: {why} while it ran (destroy() on another thread)"))
                self._await_idle(grace)

    def _running(self) -> str:
        """The call that runs now, as errors name it."""
        current = self.current
        return current.what if current is not None else f"a call on group {self.group.name}"

    def _await_idle(self, seconds: float) -> None:
        until = time.monotonic() + seconds
        while self.busy and time.monotonic() < until:
            time.sleep(0.005)


def _work_loop(ref: weakref.ref[CallQueue], cv: threading.Condition) -> None:
    """A group's worker thread (_serve); however it ends, the next queued call starts another."""
    try:
        _serve(ref, cv)
    finally:
        queue = ref()
        if queue is not None:
            with cv:
                if queue._worker is threading.current_thread():
                    queue._worker = None


def _serve(ref: weakref.ref[CallQueue], cv: threading.Condition) -> None:
    """A group's worker thread. It holds the group only while it runs a call of it, so a
    group nobody refers to any more is collected (and its finalizer wakes this to end).

    A queued call wakes it (this thread then takes the GIL the caller needs back as its call
    returns) until it found,
    _MISSES times in a row, that the caller had run the call itself (an async call waited
    for at once: run_until). From then on it looks for queued calls by itself, every
    _LOOK_S, less often while it finds none, up to _LOOK_MAX_S: a call left to it (its
    caller went on with other work) makes calls wake it again, and _PARK_S without any call
    queued puts it back to sleep until one comes (docs/design/groups.md#the-worker)."""
    look: float | None = None  # seconds between looks; None: asleep until a call wakes it
    misses = 0
    quiet_since = 0.0
    while True:
        with cv:
            queue = ref()
            looked = False  # the call it takes was found by a look, not woken for
            while queue is not None and (not queue.pending or queue.busy):
                if queue._stopping:
                    return
                seen = queue.submitted
                queue = None
                woken = cv.wait(look)
                queue = ref()
                if queue is None:
                    return
                looked = not woken
                now = time.perf_counter()
                if woken:
                    misses = misses + 1 if queue.busy or not queue.pending else 0
                    if misses >= _MISSES and look is None:
                        queue.wake_worker, look, quiet_since = False, _LOOK_S, now
                elif queue.submitted != seen:  # calls came, and their callers ran them
                    quiet_since, look = now, min(2 * look, _LOOK_MAX_S)  # type: ignore[operator]
                elif now - quiet_since >= _PARK_S:
                    queue.wake_worker, look, misses = True, None, 0
                else:
                    look = min(2 * look, _LOOK_MAX_S)  # type: ignore[operator]
            if queue is None:
                return
            if looked:  # a call its caller left to this thread: calls wake it again
                queue.wake_worker, look, misses = True, None, 0
            queue.busy = True  # before the pop: see submit
            queued = queue.pending.popleft()
        finish = queue._run_queued(*queued)
        del queue, queued
        _finish_in_callbacks(finish)
        del finish
        queue = ref()
        if queue is None or queue._worker is not threading.current_thread():
            return  # its callbacks handed the group to another worker (CallQueue.submit)
        del queue


def _finish_in_callbacks(finish: Callable[[], None]) -> None:
    """Finish a call's Work: its done-callbacks run, and the calls they make count as theirs."""
    outer = getattr(_callbacks, "active", False)
    _callbacks.active = True
    me = threading.get_ident()
    try:
        _RUNNING_CALLBACKS.append(me)
        finish()
    finally:
        if me in _RUNNING_CALLBACKS:  # (an interrupt may have come before the append)
            _RUNNING_CALLBACKS.remove(me)
        _callbacks.active = outer


def _thread_named(ident: int) -> str:
    """A thread as errors name it: its name and ident."""
    named = next((t.name for t in threading.enumerate() if t.ident == ident), None)
    return f"{ident}" if named is None else f"{named!r} ({ident})"


def _wake(cv: threading.Condition, pid: int) -> None:
    if os.getpid() != pid:  # a forked child: no worker here, and the lock may be held for good
        return
    with cv:
        cv.notify_all()


class QueuedWork(Work):
    """A queued call's Work: whoever waits for it without a time limit runs it if the worker
    has not started it yet (CallQueue.run_until)."""

    def __init__(self, queue: CallQueue, what: str, origin: int) -> None:
        super().__init__(what, queue.group.runtime.rank)
        self._queue: CallQueue | None = queue
        self.origin = origin  # CallQueue.in_flight's index

    def wait(self, timeout: float | None = None) -> bool:
        queue = self._queue
        if queue is not None and not self.done:
            if timeout is None:
                queue.run_until(self)
            else:
                queue.hand_over()
        return super().wait(timeout)

    def finish(self, result: Any = None, exc: BaseException | None = None) -> None:
        self._queue = None  # nothing left to run: a finished Work keeps no group alive
        super().finish(result, exc)
