"""Telling a peer's process apart from a later one with the same pid, whether it still runs,
and which ranks may run on its cores.

A rank that died before anyone talked to it has no connection to close: its peers on the same
machine, in the same pid namespace, watch its process instead (wiring.Wiring.gone).
"""

from __future__ import annotations

import os
from typing import Any


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


def namespace(kind: str) -> str:
    """Which `kind` namespace ('pid', 'net') this process is in ('' where unknown): pids of
    ranks in another pid namespace cannot be checked from here, nor their loopback reached
    from another network namespace (a container each)."""
    try:
        st = os.stat(f"/proc/self/ns/{kind}")
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}"


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' (the kernel's cpulist format) -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def core_sharers(cards: dict[int, dict[str, Any]], rank: int) -> int:
    """How many ranks of this rank's machine, itself included, may run on one of its cores
    (the cards' affinities): those a waiter spinning on its core could keep off the CPU.
    Ranks a launcher bound to cores of their own (mpirun's --bind-to core) share none."""
    me = cards[rank]
    mine = set(parse_cpulist(me["cores"]))
    return sum(1 for c in cards.values()
               if c["machine"] == me["machine"] and not mine.isdisjoint(parse_cpulist(c["cores"])))
