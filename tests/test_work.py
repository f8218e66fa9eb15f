"""Work handles: completion across threads, timeouts, errors and callbacks (the event is lazy)."""

from __future__ import annotations

import threading
import time

import pytest

from tensorwire.errors import TimeoutError
from tensorwire.work import Work, completed_work

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
    work._finish("answer")
    for t in threads:
        t.join(10)
    assert seen == ["answer"] * 8 and work.is_completed() and work.is_success()


def test_finish_racing_with_waiters_never_loses_a_wakeup() -> None:
    for _ in range(300):
        work = Work("race", 0)
        t = threading.Thread(target=work._finish, args=(1,))
        t.start()
        assert work.wait(5) is True
        t.join()


def test_wait_times_out_and_can_wait_again() -> None:
    work = Work("slow job", 3)
    with pytest.raises(TimeoutError, match=r"rank 3: slow job not complete after 0.05 s"):
        work.wait(0.05)
    work._finish()
    assert work.wait(0.05) is True


def test_error_is_raised_on_every_wait() -> None:
    work = Work("doomed", 0)
    work._finish(exc=ValueError("bad"))
    for _ in range(2):
        with pytest.raises(ValueError, match="bad"):
            work.wait()
    assert work.is_completed() and not work.is_success() and isinstance(work.exception(), ValueError)


def test_callbacks_run_once_whether_added_before_or_after_finish() -> None:
    work = Work("job", 0)
    calls: list[str] = []
    work.add_done_callback(lambda w: calls.append(f"before {w.result()}"))
    work._finish(7)
    work.add_done_callback(lambda w: calls.append(f"after {w.result()}"))
    assert calls == ["before 7", "after 7"]
    assert completed_work("done", 0, 5).result() == 5
