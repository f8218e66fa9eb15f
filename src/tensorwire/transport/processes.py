"""Telling a peer's process apart from a later one with the same pid, and whether it still runs.

A rank that died before anyone talked to it has no connection to close: its peers on the same
machine, in the same pid namespace, watch its process instead (wiring.Wiring.gone).
"""

from __future__ import annotations

import os


def process_start() -> int:
    """This process's start time (clock ticks after boot): with its pid, what tells it apart
    from a later process that reuses the pid."""
    return start_of(os.getpid())


def start_of(pid: int) -> int:
    """`pid`'s start time; -1 where it has exited (a zombie counts as exited) or is not there."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return -1
    fields = stat[stat.rfind(b")") + 2:].split()
    return -1 if fields[0] in (b"Z", b"X") else int(fields[19])


def pid_namespace() -> str:
    """Which pid namespace this process sees pids in ('' where unknown): pids of ranks in other
    namespaces (containers) cannot be checked from here."""
    try:
        st = os.stat("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}"
