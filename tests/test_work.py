"""Work handles: completion across threads, timeouts, errors and callbacks (the event is lazy)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

import tensorwire as tw
from conftest import PYTHON
from tensorwire.errors import InvalidArgumentError, TimeoutError
from tensorwire.work import Work

pytestmark = pytest.mark.timeout(30)


def test_waiters_on_other_threads_wake_when_it_finishes() -> None:
    work = Work("job", 0)
    seen: list[object] = []

    def waiter() -> None:
        work.wait(10)
        seen.append(work.result())

    threads = [threading.Thread(target=waiter) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.05)  # most of them block before the finish
    assert not work.is_completed() and not seen
    work.finish("answer")
    for t in threads:
        t.join(10)
    assert seen == ["answer"] * 8 and work.is_completed() and work.is_success()


def test_finish_racing_with_waiters_never_loses_a_wakeup() -> None:
    for _ in range(300):
        work = Work("race", 0)
        t = threading.Thread(target=work.finish, args=(1,))
        t.start()
        assert work.wait(5) is True
        t.join()


def test_wait_times_out_and_can_wait_again() -> None:
    work = Work("slow job", 3)
    with pytest.raises(TimeoutError, match=r"rank 3: slow job not complete after 0.05 s"):
        work.wait(0.05)
    work.finish()
    assert work.wait(0.05) is True


def test_a_wait_beyond_what_a_thread_can_wait_has_no_limit_and_a_bad_one_is_named() -> None:
    """A timeout too large for a thread's wait (1e12 s) means none (it raised OverflowError);
    a negative, NaN or non-number one is the caller's error, naming the operation."""
    work = Work("long job", 2)
    threading.Timer(0.05, work.finish, args=("done",)).start()
    assert work.wait(1e12) is True and work.result() == "done"
    with pytest.raises(TimeoutError, match=r"rank 2: job not complete after 0.05 s"):
        Work("job", 2).wait(Fraction(1, 20))  # any real number (its format said TypeError)
    for bad in (-1, float("nan"), "10", True):
        with pytest.raises(InvalidArgumentError, match=r"rank 2: job: wait.s timeout must be None or"):
            Work("job", 2).wait(bad)


def test_error_is_raised_on_every_wait() -> None:
    work = Work("doomed", 0)
    work.finish(exc=ValueError("bad"))
    for _ in range(2):
        with pytest.raises(ValueError, match="bad"):
            work.wait()
    assert work.is_completed() and not work.is_success() and isinstance(work.exception(), ValueError)


def test_a_callback_that_raises_is_printed_and_the_others_run(capsys: pytest.CaptureFixture[str]) -> None:
    work = Work("all_reduce #3 on group world", 1)
    calls: list[str] = []
    work.add_done_callback(lambda w: 1 / 0)
    work.add_done_callback(lambda w: calls.append("second"))
    work.finish(7)
    work.add_done_callback(lambda w: [][1])
    assert calls == ["second"] and work.result() == 7
    err = capsys.readouterr().err
    assert "rank 1: a done-callback of all_reduce #3 on group world raised (ignored)" in err, err
    assert "ZeroDivisionError" in err and "IndexError" in err, err


_RAISED = {"error": ZeroDivisionError, "exit": SystemExit, "interrupt": KeyboardInterrupt}


def rank_raising_callback(kind: str) -> list[float]:
    """A done-callback raises on the group's worker: the async calls behind it still complete
    (they waited for a waiter to run them: the worker had died)."""
    first = tw.all_reduce(np.ones(8, np.float32), async_op=True)

    def callback(work: Work) -> None:
        if threading.current_thread() is not threading.main_thread():  # the worker's (added in time)
            raise _RAISED[kind]

    first.add_done_callback(callback)
    first.wait(timeout=20)
    time.sleep(0.2)  # the worker ran the callback
    later = [np.ones(8, np.float32) for _ in range(3)]
    works = [tw.all_reduce(x, async_op=True) for x in later]
    deadline = time.monotonic() + 20
    while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
        time.sleep(0.01)  # nobody waits: the worker alone runs them
    return [float(x[0]) for x in later] if all(w.is_completed() for w in works) else []


@pytest.mark.parametrize("kind", list(_RAISED))
def test_a_raising_callback_leaves_the_groups_worker_running(get_cluster: Callable[..., Any],
                                                              kind: str) -> None:
    """SystemExit and KeyboardInterrupt too: they ended the worker, and nothing ran the calls."""
    assert get_cluster(2, "shm").run(rank_raising_callback, kind) == [[2.0, 2.0, 2.0]] * 2


def rank_callback_waits_for_a_later_call() -> tuple[str, float]:
    """A's done-callback, on the group's worker, waits with a timeout for B, queued behind A."""
    a, b = np.ones(1 << 22, np.float64), np.ones(8, np.float64)
    seen: dict[str, str] = {}
    ran = threading.Event()

    def callback(work: Work) -> None:
        try:
            later.wait(timeout=3.0)
            seen["b"] = f"ok {b[0]:g}"
        except Exception as exc:  # noqa: BLE001 - reported to the test
            seen["b"] = f"{type(exc).__name__}: {exc}"
        ran.set()

    first = tw.all_reduce(a, async_op=True)
    later = tw.all_reduce(b, async_op=True)
    t0 = time.monotonic()
    first.add_done_callback(callback)
    first.wait(20)
    ran.wait(20)
    return seen.get("b", "not run"), time.monotonic() - t0


def test_a_callback_waits_with_a_timeout_for_a_call_queued_behind_it(get_cluster: Callable[..., Any]) -> None:
    """The worker ran the callback and so not B: a wait without a timeout ran B itself, one
    with a timeout waited it out and failed. Another worker takes the queued calls now."""
    for outcome, took in get_cluster(2, "shm").run(rank_callback_waits_for_a_later_call):
        assert outcome == "ok 2" and took < 2.5, (outcome, took)


def rank_callback_call_overlaps_a_planned_one() -> list[str]:
    """Rank 0's program makes a small all_reduce it made before (a planned call) as a finished
    call's done-callback makes one on the same group 0.2 s later; rank 1's callback makes its
    call 0.4 s on and its program 0.6 s on: rank 1's callback call pairs with rank 0's program
    call, which rank 0's callback call overlaps."""
    g = tw.new_group()
    b = np.ones(4)
    for _ in range(3):
        g.all_reduce(b)
    seen: list[str] = []
    ran = threading.Event()

    def attempt(call: Callable[[], Any]) -> None:
        try:
            call()
            seen.append("ok")
        except tw.TensorwireError as exc:
            seen.append(f"{type(exc).__name__}: {exc}")

    def callback(work: Work) -> None:
        time.sleep(0.2 if g.rank == 0 else 0.4)  # rank 0's program call still waits then
        attempt(lambda: g.all_reduce(np.ones(4)))
        ran.set()

    first = g.all_reduce(np.ones(4), async_op=True)
    first.add_done_callback(callback)
    while not first.is_completed():
        time.sleep(0.001)
    if g.rank == 1:
        time.sleep(0.6)
    attempt(lambda: g.all_reduce(b))
    ran.wait(10)
    attempt(lambda: g.all_reduce(b))
    g.destroy()
    return seen


@pytest.mark.parametrize("transport", ["shm", PYTHON])
def test_a_callbacks_call_overlapping_a_planned_call_fails_the_group(get_cluster: Callable[..., Any],
                                                                      transport: str) -> None:
    """docs/torch.md#threads: a call made while one of the other kind is in flight aborts the
    group. A planned call was never counted in flight: every call returned, two of them with
    another call's data, and nothing was said on any rank."""
    for seen in get_cluster(2, transport).run(rank_callback_call_overlaps_a_planned_one):
        assert any(s.startswith("InvalidArgumentError") and "done-callback while calls the program made" in s
                   for s in seen), seen
        assert seen[-1] != "ok", seen  # the group's next call, whatever returned before


def test_an_exit_in_a_callback_on_the_main_thread_goes_on_up() -> None:
    work = Work("job", 0)
    work.finish(1)
    with pytest.raises(SystemExit):
        work.add_done_callback(lambda w: sys.exit(3))


def test_callbacks_run_once_whether_added_before_or_after_finish() -> None:
    work = Work("job", 0)
    calls: list[str] = []
    work.add_done_callback(lambda w: calls.append(f"before {w.result()}"))
    work.finish(7)
    work.add_done_callback(lambda w: calls.append(f"after {w.result()}"))
    assert calls == ["before 7", "after 7"]


def test_the_library_finishes_a_work_and_reads_done_publicly() -> None:
    """The group's queue, point-to-point and the device paths end a Work with finish() (as
    torch's Work::finish) and look at `done`, not at its private state."""
    work = Work("all_reduce #1 on group world", 0)
    assert not work.done and not work.is_completed()
    work.finish(exc=ValueError("bad"))
    assert work.done and work.is_completed() and not work.is_success()
    assert isinstance(work.exception(), ValueError)
