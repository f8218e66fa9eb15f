"""Work handles returned by async operations (torch.distributed's `Work`, MPI's request)."""

from __future__ import annotations

import numbers
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any, cast

from .errors import InvalidArgumentError, TimeoutError

_guard = threading.Lock()
"""Guards every Work's lazily made event and its callbacks: both are rare, and a lock plus an
event per Work cost more than a whole small send (point-to-point makes a Work per message)."""


def wait_limit(timeout: Any, rank: int, what: str) -> float | None:
    """A Work's wait's `timeout`: None, or seconds of 0 or more; beyond what a thread can wait
    (threading.TIMEOUT_MAX, some 292 years) it means no limit, as None does."""
    if timeout is None:
        return None
    if isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = cast(float, timeout)  # a Real compares as a float does (typeshed's Real lacks >=)
        if seconds >= 0:
            return None if seconds > threading.TIMEOUT_MAX else float(seconds)
    raise InvalidArgumentError(f"rank {rank}: {what}: wait's timeout must be None or seconds of 0 or more, "
                               f"got {timeout!r}")


class Work:
    """Completes once; `wait()` re-raises the operation's exception on the waiting thread."""

    progresses = True
    """Whether it completes on its own: a collective's, on its group's worker; a point-to-point
    one (False) only while somebody waits on it or polls it with `is_completed()`, as an MPI
    request does."""

    def __init__(self, what: str, rank: int) -> None:
        self.what = what
        self.rank = rank
        self.done = False
        """Finished, successfully or not (is_completed, as an attribute for the library's loops)."""
        self._exc: BaseException | None = None
        self._result: Any = None
        self._event: threading.Event | None = None  # made by the first waiter that must block
        self._callbacks: list[Callable[[Work], None]] = []

    def finish(self, result: Any = None, exc: BaseException | None = None) -> None:
        """The library's, as torch's Work::finish: the operation ended with `result`, or
        failed with `exc`; waiters wake and the done-callbacks run, on this thread."""
        self._result, self._exc = result, exc
        with _guard:
            self.done = True
            event, callbacks, self._callbacks = self._event, self._callbacks, []
        if event is not None:
            event.set()
        for cb in callbacks:
            self._call(cb)

    def add_done_callback(self, cb: Callable[[Work], None]) -> None:
        """Call `cb(work)` once done (now, on this thread, if it is): on the thread that
        finished it, a group's worker for a collective. What `cb` raises is printed to stderr
        and goes no further (as concurrent.futures does): the calls queued behind go on (a
        SystemExit or KeyboardInterrupt raised on the main thread goes on up). A `wait()` on
        another thread may return before the callbacks have run."""
        with _guard:
            if not self.done:
                self._callbacks.append(cb)
                return
        self._call(cb)

    def _call(self, cb: Callable[[Work], None]) -> None:
        try:
            cb(self)
        except BaseException as exc:  # the callback's error, not the operation's
            # an exit or a Ctrl-C acts on the main thread only: elsewhere it would end the group's worker
            if isinstance(exc, (KeyboardInterrupt, SystemExit)) and \
                    threading.current_thread() is threading.main_thread():
                raise
            print(f"tensorwire: rank {self.rank}: a done-callback of {self.what} raised (ignored):",
                  file=sys.stderr, flush=True)
            traceback.print_exc()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (or `timeout` seconds); raise the operation's error if it failed."""
        if not self.done:
            limit = wait_limit(timeout, self.rank, self.what)
            with _guard:
                if not self.done and self._event is None:
                    self._event = threading.Event()
                event = None if self.done else self._event
            if event is not None and not event.wait(limit):
                raise TimeoutError(f"rank {self.rank}: {self.what} not complete after {limit:g} s")
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        return self.done

    def is_success(self) -> bool:
        return self.done and self._exc is None

    def exception(self) -> BaseException | None:
        return self._exc

    def result(self) -> Any:
        """The operation's outputs (after `wait()`)."""
        self.wait()
        return self._result

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        return f"<Work {self.what} {state}>"
