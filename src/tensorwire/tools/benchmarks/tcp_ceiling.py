"""What this machine's TCP can move between two processes, beside which tensorwire's figures are read.

Two processes, 64 MiB one way over loopback, split over 1, 2, 4 and 8 sockets, each driven by
its own thread with blocking `sendall`/`recv_into` (the kernel copies; no framing, no Python per
byte), with the send and receive buffers tensorwire gives its own connections. The time runs
from the first byte sent to the receiver's one-byte acknowledgement of the last.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np

from ...config import Config
from ...transport.tcp import tune_socket

STREAMS = (1, 2, 4, 8)
NBYTES = 64 << 20


@dataclass
class Ceiling:
    streams: int
    seconds: list[float]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.seconds)

    def gbps(self, nbytes: int = NBYTES) -> float:
        return nbytes / self.mean / 1e9


def _parts(nbytes: int, k: int) -> list[tuple[int, int]]:
    per = -(-nbytes // k)
    return [(i * per, min(nbytes, (i + 1) * per)) for i in range(k)]


def _each(socks: list[socket.socket], buf: memoryview, nbytes: int, receive: bool) -> None:
    """Move `buf`'s parts over `socks`, one thread per socket."""
    def move(sock: socket.socket, view: memoryview) -> None:
        if not receive:
            sock.sendall(view)
            return
        while view.nbytes:
            view = view[sock.recv_into(view):]
    parts = _parts(nbytes, len(socks))
    threads = [threading.Thread(target=move, args=(s, buf[a:b])) for s, (a, b) in zip(socks, parts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _receiver(port: int, streams: tuple[int, ...], nbytes: int, rounds: int) -> None:
    cfg = Config.from_env()
    buf = np.empty(nbytes, np.uint8).data
    for k in streams:
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(k)]
        for s in socks:
            tune_socket(s, cfg)
        for _ in range(rounds):
            _each(socks, buf, nbytes, receive=True)
            socks[0].sendall(b"!")
        for s in socks:
            s.close()


def measure(streams: tuple[int, ...] = STREAMS, nbytes: int = NBYTES, rounds: int = 5,
            timeout: float = 120.0) -> list[Ceiling]:
    """One-way raw-socket throughput with each number of streams; the first round of each warms
    the connections and is not counted."""
    cfg = Config.from_env()
    listener = socket.create_server(("127.0.0.1", 0), backlog=max(streams))
    listener.settimeout(timeout)
    port = listener.getsockname()[1]
    child = mp.get_context("spawn").Process(target=_receiver, args=(port, streams, nbytes, rounds + 1),
                                            daemon=True)
    child.start()
    data = np.ones(nbytes, np.uint8).data
    out = []
    try:
        for k in streams:
            socks = [listener.accept()[0] for _ in range(k)]
            for s in socks:
                tune_socket(s, cfg)
                s.settimeout(timeout)
            times = []
            for _ in range(rounds + 1):
                t0 = time.perf_counter()
                _each(socks, data, nbytes, receive=False)
                if socks[0].recv(1) != b"!":
                    raise RuntimeError("the ceiling probe's receiver left")
                times.append(time.perf_counter() - t0)
            out.append(Ceiling(k, times[1:]))
            for s in socks:
                s.close()
    finally:
        listener.close()
        child.join(timeout)
        if child.is_alive():
            child.kill()
    return out


def table(ceilings: list[Ceiling], nbytes: int = NBYTES) -> list[str]:
    """The ceiling as '#' lines for a benchmark's header."""
    lines = [f"# TCP ceiling of this machine: {nbytes >> 20} MiB one way between two processes over "
             f"loopback, raw sockets, one thread per socket, tensorwire's socket buffers",
             "#   sockets   mean (ms)   p50 (ms)   GB/s"]
    for c in ceilings:
        lines.append(f"#   {c.streams:7d}   {c.mean * 1e3:9.2f}   {statistics.median(c.seconds) * 1e3:8.2f}"
                     f"   {c.gbps(nbytes):5.2f}")
    return lines
