"""How long a waiter yields before it sleeps (transport/engine.py's Backoff): the policy alone,
on an engine stand-in whose waiting does nothing."""

from __future__ import annotations

import time
from types import SimpleNamespace

from tensorwire.transport import engine as eng


def _engine(oversubscribed: bool) -> SimpleNamespace:
    def nothing(*_: object) -> None:
        return None
    return SimpleNamespace(spin_s=0.0 if oversubscribed else 50e-6, oversubscribed=oversubscribed, pumps=None,
                           slow_link=0, last_link_wait_long=False, check_group=nothing, query_peers=nothing,
                           check_unconnected=nothing, sleep_on_sockets=nothing, release_parked=nothing)


def _wait(engine: SimpleNamespace, seconds: float, woken: bool) -> eng.Backoff:
    """A wait that lasted `seconds` (its start moved back), as Engine._drive runs one."""
    b = eng.Backoff(engine, time.perf_counter() + 60, 1, 1, (0,), woken=woken)  # type: ignore[arg-type]
    b.since -= seconds
    b.idle(lambda: TimeoutError())
    return b


def _yields(engine: SimpleNamespace) -> tuple[float, float]:
    """What a new wait for TCP peers, and one for others, would yield."""
    return _wait(engine, 0.0, True).yield_s, _wait(engine, 0.0, False).yield_s


def test_long_waits_for_tcp_shorten_the_yield_where_ranks_share_cores() -> None:
    e = _engine(oversubscribed=True)
    for _ in range(3):
        _wait(e, 2 * eng._YIELD_BRIEF_S, False)  # long waits on shared memory: not a slow link
    assert e.slow_link == 0 and _yields(e) == (eng._YIELD_S, eng._YIELD_S)
    for _ in range(eng._SLOW_LINK_WAITS + 3):
        _wait(e, 2 * eng._YIELD_BRIEF_S, True)
    assert e.slow_link == eng._SLOW_LINK_WAITS  # capped: as many short waits for TCP undo it
    seen = []
    for _ in range(eng._SLOW_LINK_WAITS + 1):
        seen.append(_wait(e, 0.0, False).yield_s)  # waits on shared memory do not count down
        seen.append(_wait(e, 0.0, True).yield_s)
    # the first wait for TCP follows a long one: the count goes down from the second on
    assert seen == [eng._YIELD_BRIEF_S, 0.0] * eng._SLOW_LINK_WAITS + [eng._YIELD_BRIEF_S, eng._YIELD_S], seen
    assert e.slow_link == 0 and _yields(e) == (eng._YIELD_S, eng._YIELD_S)


def test_spare_cores_keep_the_full_yield() -> None:
    e = _engine(oversubscribed=False)
    for _ in range(3):
        _wait(e, 2 * eng._YIELD_BRIEF_S, True)
    assert e.slow_link == 3 and _yields(e) == (eng._YIELD_S, eng._YIELD_S)
