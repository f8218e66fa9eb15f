"""Large TCP transfers moved by threads that spend their time in the kernel, off the interpreter lock.

One thread per rank that frames, copies and reduces in turn cannot fill a fast link: while it
sends it does not receive, and while it folds it does neither. A `Pumps` pool hands the body of
a large part (a stream's share of a message, from PUMP_BYTES) to a thread of its own, which
loops over `send`/`recv_into` on big chunks (the kernel copies with the lock released) and folds
what it received with numpy (which releases it too), while the rank's own thread drives the rest.

A part is handed over only while a thread is idle: a job never waits in a queue behind another
that may be waiting for this rank's peer, so a full pool means the rank's thread moves the bytes
itself, as it does with no pool (TENSORWIRE_SOCKET_THREADS=0). The stream owns the socket's
direction again once its job is done; the rank's thread collects the outcome (bytes accounted,
the request finished, an error raised) so no request is ever touched by two threads.
"""

from __future__ import annotations

import os
import queue
import select
import socket
import threading
from collections.abc import Callable

import numpy as np

from .. import limits

PUMP_BYTES = 1 << 20
"""The smallest rest of a part handed to a pump thread: below it the hand-off costs more than
it saves (docs/design/tcp.md#pump-threads)."""
_CHUNK = 4 << 20  # bytes per send/recv call: the kernel takes or gives what its buffers hold
_POLL_MS = 50  # how often a waiting job looks whether its stream was closed


class Job:
    """One direction of one stream for one part: done once, with the bytes moved or an error."""

    __slots__ = ("run", "done", "error", "cancelled")

    def __init__(self, run: Callable[[Job], None]) -> None:
        self.run = run
        self.done = False
        self.error: OSError | None = None
        self.cancelled = False


def _poller(sock: socket.socket, events: int) -> select.poll:
    poller = select.poll()
    poller.register(sock, events)
    return poller


def _check(job: Job) -> None:
    if job.cancelled:
        raise ConnectionAbortedError("the stream was closed")


def send_job(sock: socket.socket, view: memoryview) -> Job:
    """Write all of `view` to the non-blocking `sock`."""
    def run(job: Job) -> None:
        poller = _poller(sock, select.POLLOUT)
        at, end = 0, view.nbytes
        while at < end:
            _check(job)
            try:
                at += sock.send(view[at:at + _CHUNK])
            except (BlockingIOError, InterruptedError):
                poller.poll(_POLL_MS)
    return Job(run)


def _recv(job: Job, sock: socket.socket, poller: select.poll, into: memoryview) -> int:
    """Bytes received into `into` (at least one), waiting for them as long as it takes."""
    while True:
        _check(job)
        try:
            n = sock.recv_into(into)
        except (BlockingIOError, InterruptedError):
            poller.poll(_POLL_MS)
            continue
        if n == 0:
            raise ConnectionResetError("connection closed by peer")
        return n


def recv_job(sock: socket.socket, view: memoryview) -> Job:
    """Fill `view` from the non-blocking `sock`."""
    def run(job: Job) -> None:
        poller = _poller(sock, select.POLLIN)
        at, end = 0, view.nbytes
        while at < end:
            at += _recv(job, sock, poller, view[at:at + _CHUNK])
    return Job(run)


def fold_job(sock: socket.socket, nbytes: int, fold: Callable[[int, np.ndarray], None],
             staging: np.ndarray) -> Job:
    """Receive `nbytes` through `staging`, handing each full buffer (and the last, shorter one)
    to `fold(offset, bytes)`; the kernel goes on receiving into the socket while it folds."""
    def run(job: Job) -> None:
        poller = _poller(sock, select.POLLIN)
        room = staging.data
        at = 0
        while at < nbytes:
            want = min(nbytes - at, len(staging))
            staged = 0
            while staged < want:
                staged += _recv(job, sock, poller, room[staged:want])
            fold(at, staging[:want])
            at += want
    return Job(run)


class Pumps:
    """A process's pump threads: started as jobs first need them, at most `threads`."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.busy = 0  # jobs in flight
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)  # readable once a job finished
        self.receiving: set[socket.socket] = set()  # sockets a job reads: a sleeping waiter skips them
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[Job | None]] = []
        self._workers: list[tuple[threading.Thread, queue.SimpleQueue[Job | None]]] = []
        self._closed = False

    def start(self, job: Job) -> bool:
        """Run `job` on an idle thread (starting one if the pool may grow); False: none is free."""
        with self._lock:
            if self._closed or self.busy >= self.threads:
                return False
            self.busy += 1
            if self._idle:
                self._idle.pop().put(job)
                return True
            inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
            worker = threading.Thread(target=self._work, args=(inbox,), name="tensorwire-pump", daemon=True)
            try:
                worker.start()
            except RuntimeError:  # no memory for a thread (limits.start_thread): the rank's thread moves it
                self.busy -= 1
                return False
            self._workers.append((worker, inbox))
        inbox.put(job)
        return True

    def _work(self, inbox: queue.SimpleQueue[Job | None]) -> None:
        while (job := inbox.get()) is not None:
            try:
                job.run(job)
            except OSError as exc:
                job.error = exc
            with self._lock:
                job.done = True
                self.busy -= 1
                os.eventfd_write(self.fd, 1)
                if self._closed:
                    return
                self._idle.append(inbox)

    def drain(self) -> None:
        """Reset `fd` after a wake-up (the finished jobs are collected by their streams)."""
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Stop the threads; a job still running ends as its stream is closed (Job.cancelled)."""
        with self._lock:
            self._closed = True
            workers, self._workers, self._idle = self._workers, [], []
        for _, inbox in workers:
            inbox.put(None)
        for worker, _ in workers:
            if worker is not threading.current_thread():
                worker.join(1.0)
        os.close(self.fd)


AUTO_STREAMS = 4
"""TCP streams a pair under TENSORWIRE_NSOCKS=auto where a rank has a core to spare (docs/design/tcp.md)."""


def streams_per_pair(setting: int | None, cores: int, machine_ranks: int, peers: int = 0) -> int:
    """TCP streams per pair: `setting` (TENSORWIRE_NSOCKS) if given; else AUTO_STREAMS where a
    rank has a core to spare for pump threads and its hard limit of descriptors holds that many
    to each of its `peers`, one where ranks share cores or it would not."""
    if setting is not None:
        return setting
    spare = cores // max(1, machine_ranks) > 1
    return AUTO_STREAMS if spare and limits.descriptors_allow(AUTO_STREAMS, peers) else 1


def pump_threads(setting: int | None, cores: int, machine_ranks: int, nsocks: int) -> int:
    """Pump threads per rank: `setting` (TENSORWIRE_SOCKET_THREADS) if given; else one per
    direction of each stream of a pair, where a rank has a core to spare for them (none where
    ranks share cores: there the threads would only take turns with the rank's own)."""
    if setting is not None:
        return setting
    spare = cores // max(1, machine_ranks) - 1
    return min(2 * nsocks, spare) if spare > 0 else 0
