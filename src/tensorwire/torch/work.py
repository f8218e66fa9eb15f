"""`TensorwireWork`: a torch `dist.Work` over one or more tensorwire Work handles.

One torch-level operation may be several tensorwire calls (a coalesced all-reduce of mixed
dtypes, a non-contiguous output staged through a contiguous copy); the torch Work completes
when all of them have, after its `finish` step (copying staged results back) has run.

Errors. `wait()` re-raises tensorwire's own exception (PeerLostError, CollectiveMismatchError,
TimeoutError, ...). The future from `get_future()` never carries a Python exception object:
torch rethrows a future's error on whatever C++ thread waits on it (DDP's reducer, inside
backward), and an error holding a Python object there was seen to crash the process. Instead
the raw future always completes with the outputs and the future handed out is a `.then()` of
it whose callback raises on failure: torch turns an exception raised in a `then` callback into
a plain C++ error carrying the message, which is safe to rethrow anywhere. DDP then raises a
RuntimeError with tensorwire's message out of `loss.backward()`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ..errors import TimeoutError as TwTimeoutError
from ..work import Work as TwWork

_WAITERS: set[threading.Thread] = set()  # futures' helper threads still running
_WAITERS_LOCK = threading.Lock()


def join_waiters(grace: float) -> list[threading.Thread]:
    """Wait up to `grace` s for the futures' helper threads to end (shutdown failed their
    receives; they run the futures' callbacks): a daemon thread still running at interpreter
    exit is killed as it next takes the GIL, which aborts the process where that happens
    inside C++ (torch's futures and Works). Returns those still running."""
    until = time.monotonic() + grace
    with _WAITERS_LOCK:
        threads = [t for t in _WAITERS if t is not threading.current_thread()]
    for thread in threads:
        thread.join(max(0.0, until - time.monotonic()))
    return [t for t in threads if t.is_alive()]


def seconds(timeout: Any) -> float | None:
    """torch passes timedelta (0 or negative: none, as beyond what a thread can wait);
    Python callers may pass seconds."""
    if timeout is None:
        return None
    s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return s if 0 < s <= threading.TIMEOUT_MAX else None


class TensorwireWork(dist.Work):
    """Completes when every part has; `wait()` raises tensorwire's error of the first failed part."""

    def __init__(self, parts: Sequence[TwWork], outputs: Any, what: str, *,
                 finish: Callable[[], None] | None = None, timeout: float | None = None,
                 source_rank: int | Callable[[], int] = -1) -> None:
        super().__init__()
        self._parts = list(parts)
        self._outputs = outputs
        self._what = what
        self._finish_fn = finish
        self._timeout = timeout
        self._source_rank_value = source_rank
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._exc: BaseException | None = None
        self._pending = len(self._parts)
        self._raw_future: torch.futures.Future | None = None
        self._future: torch.futures.Future | None = None
        self._waiter: threading.Thread | None = None
        self._cuda_done: tuple[torch.cuda.Event, torch.device] | None = None
        if not self._parts:
            self._complete()
        for part in self._parts:
            part.add_done_callback(self._part_done)

    @classmethod
    def failed(cls, exc: BaseException, outputs: Any, what: str) -> TensorwireWork:
        work = cls([], outputs, what)
        work._exc = exc
        return work

    # -- completion ---------------------------------------------------------------------------
    def _part_done(self, part: TwWork) -> None:
        with self._lock:
            if self._exc is None and part.exception() is not None:
                self._exc = part.exception()
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._complete()

    def _complete(self) -> None:
        # CUDA parts: the copies back and the future's events go on the stream their GPU work
        # went on, after it, and a caller's wait() waits for all of that (_cuda_done)
        stream = next((s for p in self._parts if (s := getattr(p, "stream", None)) is not None), None)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            if self._exc is None and self._finish_fn is not None:
                try:
                    self._finish_fn()
                except BaseException as exc:  # handed to whoever waits
                    self._exc = exc
            if stream is not None:
                self._cuda_done = (torch.cuda.Event(), stream.device)
                self._cuda_done[0].record(stream)
            with self._lock:
                self._done.set()
                fut = self._raw_future
            if fut is not None:
                fut.set_result(self._outputs)

    # -- torch's Work interface ---------------------------------------------------------------
    def wait(self, timeout: Any = None) -> bool:
        """Block until done; raise the operation's tensorwire error if it failed.

        A timeout (timedelta or seconds) bounds this wait only: the operation stays pending.
        """
        limit = seconds(timeout)
        if not self._done.is_set():
            for part in self._parts:
                try:
                    # A point-to-point part progresses only while somebody waits on it.
                    # collectives enforce their own deadline; p2p waits bound themselves here
                    own = self._timeout if _needs_waiter(part) else None
                    part.wait(limit if limit is not None else own)
                except TwTimeoutError:
                    if not part.is_completed():
                        if limit is not None:  # this wait's bound, not the operation's: it goes on
                            raise self._pending_after(limit, part) from None
                        raise
                except BaseException:
                    pass  # recorded by _part_done; raised below once everything settled
            if not self._done.wait(limit):
                raise self._pending_after(limit)
        if self._exc is not None:
            raise self._exc
        self.synchronize()
        return True

    def _pending_after(self, limit: float | None, part: TwWork | None = None) -> TwTimeoutError:
        """A wait's own bound ran out: the operation goes on (a later wait may see it done)."""
        what = self._what if part is None else f"rank {part.rank}: {part.what}"
        return TwTimeoutError(f"{what} not complete after {limit:g} s (it stays pending: wait again)")

    def get_future(self) -> torch.futures.Future:
        """A future whose value is the list of output tensors (what DDP's comm hooks expect)."""
        with self._lock:
            if self._future is None:
                raw: torch.futures.Future = _future(self._outputs)
                self._raw_future = raw
                self._future = raw.then(self._check)
                done = self._done.is_set()
                needs_driver = not done and any(_needs_waiter(p) for p in self._parts)
            else:
                return self._future
        if done:  # the future's events go on the current stream: after the call's GPU work
            self.synchronize()
            raw.set_result(self._outputs)
        elif needs_driver:
            self._waiter = threading.Thread(target=self._drive, daemon=True,
                                            name="tensorwire-torch-p2p-future")
            with _WAITERS_LOCK:
                _WAITERS.add(self._waiter)
            self._waiter.start()
        return self._future

    def _check(self, fut: torch.futures.Future) -> Any:
        if self._exc is not None:
            raise RuntimeError(f"{type(self._exc).__name__}: {self._exc}")
        return fut.value()

    def _drive(self) -> None:
        try:
            self.wait()
        except BaseException:
            pass  # carried by the future
        finally:
            with _WAITERS_LOCK:
                _WAITERS.discard(threading.current_thread())

    def is_completed(self) -> bool:
        if not self._done.is_set() and self._parts and all(p.is_completed() for p in self._parts):
            self._drive()  # point-to-point parts finish their bookkeeping on wait
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._exc is None

    def exception(self) -> BaseException | None:
        return self._exc

    def result(self) -> Any:
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        """Make the current stream wait for CUDA outputs (what NCCL's Work does); else nothing."""
        if self._done.is_set() and self._cuda_done is not None:
            event, device = self._cuda_done
            torch.cuda.current_stream(device).wait_event(event)

    def source_rank(self) -> int:
        """The sender of a receive; for a receive from any rank, known once it completed."""
        value = self._source_rank_value
        if value == -1:
            _not_a_receive()
        return value() if callable(value) else value

    _source_rank = source_rank

    def __repr__(self) -> str:
        state = "failed" if self._exc is not None else "done" if self._done.is_set() else "pending"
        return f"<TensorwireWork {self._what} {state}>"


def finished(part: TwWork) -> bool:
    """A host part that completed, successfully, as it was posted: a CompletedWork serves it,
    without a TensorwireWork's lock, event and callback.
    A point-to-point part counts as done only once waited on, which takes its error."""
    return part.done and part.exception() is None and getattr(part, "stream", None) is None


def _needs_waiter(part: TwWork) -> bool:
    """Collective parts complete on their group's worker; point-to-point ones need a waiter."""
    return not part.progresses


def _future(outputs: Any) -> torch.futures.Future:
    """A future for `outputs`, CUDA-aware where they are on a GPU: its value then carries
    events, and whoever waits on it or chains to it waits for them on its current stream."""
    devices = sorted({t.device.index for t in _tensors(outputs) if t.is_cuda})
    return torch.futures.Future(devices=[torch.device("cuda", d) for d in devices] or None)


def _tensors(outputs: Any) -> list[torch.Tensor]:
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    if isinstance(outputs, (list, tuple)):
        return [t for o in outputs for t in _tensors(o)]
    return []


class CompletedWork(dist.Work):
    """What a call that finished as it was made returns: nothing to track but its outputs (a
    process group reuses one for its synchronous collectives while nobody keeps it:
    ProcessGroupTensorwire._completed)."""

    def __init__(self, outputs: Any, source: int = -1) -> None:
        super().__init__()
        self.outputs = outputs
        self.source = source  # the sender, for a receive

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = _future(self.outputs)
        fut.set_result(self.outputs)  # CUDA outputs: after their work, queued on the current stream
        return fut

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def result(self) -> Any:
        return self.outputs

    def synchronize(self) -> None:
        pass

    def source_rank(self) -> int:
        if self.source == -1:
            _not_a_receive()
        return self.source

    _source_rank = source_rank


def _not_a_receive() -> NoReturn:
    raise RuntimeError("sourceRank() may only be called on work objects that correspond to a recv or "
                       "recv-from-any call")  # torch's words

