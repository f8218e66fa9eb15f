"""Work handles returned by async operations (torch.distributed's `Work`, MPI's request)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .errors import TimeoutError


class Work:
    """Completes once; `wait()` re-raises the operation's exception on the waiting thread."""

    def __init__(self, what: str, rank: int) -> None:
        self.what = what
        self.rank = rank
        self._event = threading.Event()
        self._exc: BaseException | None = None
        self._result: Any = None
        self._callbacks: list[Callable[[Work], None]] = []
        self._lock = threading.Lock()

    def _finish(self, result: Any = None, exc: BaseException | None = None) -> None:
        with self._lock:
            self._result, self._exc = result, exc
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def add_done_callback(self, cb: Callable[[Work], None]) -> None:
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(cb)
                return
        cb(self)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done (or `timeout` seconds); raise the operation's error if it failed."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"rank {self.rank}: {self.what} not complete after {timeout:g} s")
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        return self._event.is_set()

    def is_success(self) -> bool:
        return self._event.is_set() and self._exc is None

    def exception(self) -> BaseException | None:
        return self._exc

    def result(self) -> Any:
        """The operation's outputs (after `wait()`)."""
        self.wait()
        return self._result

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        return f"<Work {self.what} {state}>"


def completed_work(what: str, rank: int, result: Any = None) -> Work:
    work = Work(what, rank)
    work._finish(result)
    return work
