"""A real multi-process tensorwire world for tests: N spawned ranks that run test functions.

Starting processes is the slow part of a test, so a `Cluster` keeps its ranks alive and runs
many functions on them: `cluster.run(fn, *args)` calls `fn(*args)` on every rank (after
`tensorwire.init`) and returns the per-rank results, or raises `RankFailure` carrying every
rank's traceback. `fn` must be importable (a module-level function of a test module).
A rank that dies or stops answering fails the run within its timeout; the cluster is then
marked broken and the next user starts a fresh one.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any


class RankFailure(AssertionError):
    def __init__(self, errors: dict[int, str]) -> None:
        self.errors = errors
        text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        super().__init__(f"{len(errors)} rank(s) failed:\n{text}")


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports the kernel picked, all held at once so none repeats.

    Ask for every port a test needs here rather than using port+1, port+2: Linux hands bind(0)
    odd ports and connect() even ones, so a neighbour of a free port is where the client side of
    some earlier connection is likely to sit (EADDRINUSE when the test listens there).
    """
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def _rank_main(rank: int, size: int, port: int, env: dict[str, str], conn: Connection,
               cores: list[int] | None = None) -> None:
    os.environ.update(env)
    if cores:  # as a launcher binds its ranks (mpirun --bind-to core)
        os.sched_setaffinity(0, cores)
    import tensorwire as tw

    try:
        tw.init(rank=rank, world_size=size, init_method=f"tcp://127.0.0.1:{port}")
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException as exc:
            conn.send(("error", "".join(traceback.format_exception(exc))))
    tw.destroy()


class Cluster:
    def __init__(self, size: int, env: dict[str, str] | None = None, start_timeout: float = 60.0,
                 cores: list[list[int]] | None = None) -> None:
        """`cores`: each rank's cores, bound before it starts tensorwire (None: inherited)."""
        self.size = size
        # Calibration off: the tuner's choices come from the default constants, so every run of
        # the suite exercises the same algorithms (test_tuner covers calibration itself).
        self.env = {"TENSORWIRE_TIMEOUT": "30", "TENSORWIRE_CALIBRATE": "0", **(env or {})}
        self.broken = False
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns: list[Connection] = []
        self.procs = []
        for rank in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(rank, size, port, self.env, child,
                                                     cores[rank] if cores else None), daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self._collect(start_timeout, "start")

    def _collect(self, timeout: float, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = dict(enumerate(self.conns))
        import time

        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready = wait(list(pending.values()), timeout=max(0.0, left))
            if not ready:
                for r in pending:
                    errors[r] = f"no answer to {what} within {timeout:g} s (hung?)"
                self.broken = True
                break
            for conn in ready:
                rank = next(r for r, c in pending.items() if c is conn)
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    status, value = "error", f"process died (exit code {self.procs[rank].exitcode})"
                    self.broken = True
                del pending[rank]
                if status == "ok" or status == "ready":
                    results[rank] = value
                else:
                    errors[rank] = value
        if errors:
            raise RankFailure(errors)
        return [results[r] for r in range(self.size)]

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0, **kwargs: Any) -> list[Any]:
        if self.broken:
            raise RuntimeError("cluster is broken by an earlier failure")
        for conn in self.conns:
            conn.send((fn, args, kwargs))
        try:
            return self._collect(timeout, getattr(fn, "__name__", "call"))
        except RankFailure:
            self.broken = True  # ranks may hold aborted groups or half-done state: start afresh
            raise

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
