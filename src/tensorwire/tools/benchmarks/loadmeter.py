"""Foreign CPU load: how much CPU processes outside the benchmark used while it was timing.

On a small shared machine another user's build can double a collective's time. The meter
reads every process's CPU ticks from /proc/<pid>/stat before and after a timed loop and sums
the growth of the processes that are not the job's: not its ranks, not their ancestors (the
shell, pytest) and not the descendants of the job's owner (the launcher, or the process that
`--compare` started the launches from, named by TENSORWIRE_BENCH_OWNER). Kernel threads are
left out, and so is a process that only became foreign during the loop (a child of ours that
was orphaned): its earlier CPU time is not the loop's. A cell is contaminated when the foreign
CPU time exceeds 30 ms plus 5% of the timed wall time. Resolution: one clock tick per process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable

OWNER_ENV = "TENSORWIRE_BENCH_OWNER"
_KTHREADD = 2


def contaminated(foreign_s: float, wall_s: float) -> bool:
    return foreign_s > 0.03 + 0.05 * wall_s


def busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def wait_quiet(limit_s: float, threshold: float = 0.3) -> float:
    """Wait (at most limit_s) until the machine's busy CPU stays under `threshold` cores for
    three 1-second windows; returns the last window's busy cores."""
    end, quiet, busy = time.monotonic() + limit_s, 0, 0.0
    while quiet < 3 and time.monotonic() < end:
        b0, t0 = busy_seconds(), time.monotonic()
        time.sleep(1.0)
        busy = (busy_seconds() - b0) / (time.monotonic() - t0)
        quiet = quiet + 1 if busy < threshold else 0
    return busy


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(parent pid, CPU ticks of the process and of its reaped children, start time in ticks)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces
    return int(fields[1]), sum(int(v) for v in fields[11:15]), int(fields[19])


def _uptime_ticks(hz: int) -> int:
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * hz)


def _table() -> dict[int, tuple[int, int, int]]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                out[int(name)] = st
    return out


class ForeignLoad:
    """start() / stop() around a timed loop; stop() returns foreign CPU seconds, `top` names
    the three biggest foreign consumers of the last interval."""

    def __init__(self, ours: Iterable[int]) -> None:
        roots = set(ours)
        owner = os.environ.get(OWNER_ENV, "")
        if owner.isdigit():
            roots.add(int(owner))
        table = _table()
        self._roots = frozenset(roots)
        self._exclude = set(roots) | {0, 1, _KTHREADD}
        for pid in roots:  # ancestors: whoever started the job
            while pid in table and pid > 1:
                pid = table[pid][0]
                self._exclude.add(pid)
        self._hz = os.sysconf("SC_CLK_TCK")
        self._since = 0
        self._before: dict[tuple[int, int], int] = {}
        self.top: list[tuple[int, float, str]] = []

    def _foreign(self) -> dict[tuple[int, int], int]:
        """CPU ticks of every foreign process, keyed by (pid, start time): pids get reused."""
        table = _table()
        out = {}
        for pid, (ppid, ticks, started) in table.items():
            if pid in self._exclude or ppid == _KTHREADD:
                continue
            up = ppid
            while up > 1 and up not in self._roots and up in table:
                up = table[up][0]
            if up not in self._roots:
                out[(pid, started)] = ticks
        return out

    def start(self) -> None:
        self._since = _uptime_ticks(self._hz) - 1
        self._before = self._foreign()

    def stop(self) -> float:
        grown = {}
        for (pid, started), ticks in self._foreign().items():
            if (pid, started) in self._before:
                grown[pid] = ticks - self._before[(pid, started)]
            elif started >= self._since:  # born during the loop: all its CPU is the loop's
                grown[pid] = ticks
        grown = {pid: d for pid, d in grown.items() if d > 0}
        self.top = [(pid, grown[pid] / self._hz, _cmdline(pid))
                    for pid in sorted(grown, key=grown.__getitem__, reverse=True)[:3]]
        return sum(grown.values()) / self._hz


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:80]
    except OSError:
        return "?"


def job_meter(rank_pids: Iterable[int]) -> ForeignLoad | None:
    """A meter for a job whose ranks are `rank_pids` (their parents count as the job's owner
    when no owner is named); None where there is no /proc."""
    if not os.path.isdir("/proc/self"):
        return None
    pids = set(rank_pids)
    parents = {st[0] for st in map(_stat, pids) if st is not None}
    if os.environ.get(OWNER_ENV, "").isdigit():
        parents = set()
    return ForeignLoad(pids | parents)
