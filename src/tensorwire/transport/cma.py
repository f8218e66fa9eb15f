"""Cross-memory attach: copy straight out of another process's buffer (`process_vm_readv`).

One copy instead of two through a shared slot, for the large one-host collectives
(algorithms/single_copy.py). The kernel checks ptrace access to the source process: same
user and, under Yama's ptrace_scope 1 (Ubuntu's default), only a declared tracer. `allow_peers`
declares any process one (PR_SET_PTRACER_ANY, as Open MPI does for the same purpose); a group
turns single copy on only where every rank could read a peer's memory at setup.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import time
from types import ModuleType

import numpy as np

from .. import log
from ..buffers import address

_log = log.get("INIT")

PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
_YAMA = "/proc/sys/kernel/yama/ptrace_scope"
ALIAS_WINDOW = 64
"""The kernel copies with `rep movsb`, which on some CPUs runs several times slower when the
destination lies 1-31 bytes past the source modulo 4096 (docs/design/memory.md). On such a CPU
(`aliasing_is_slow`) a read whose offsets fall in this window goes through a bounce buffer at a
good offset instead (see `read_into`)."""
ALIAS_SLOW = 1.5
"""A CPU is such a one where a read into the window takes this many times one elsewhere: the
bounce's second copy costs about one more read."""
_ALIAS_PROBE = 256 << 10  # bytes of each read that decides it
BOUNCE = 1 << 20
"""Bytes per bounced piece: large, as a read costs ~10 us before its first byte, yet small
enough that the copy out of a piece still finds it in cache (docs/design/memory.md)."""
_BOUNCE_SHIFT = 2048  # the bounce buffer's offset to the source, modulo 4096


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@functools.cache
def load_libc() -> ctypes.CDLL | None:
    """The C library with process_vm_readv's prototype set; None where it has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        read = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    read.argtypes = (ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.POINTER(_IOVec),
                     ctypes.c_ulong, ctypes.c_ulong)
    read.restype = ctypes.c_ssize_t
    return libc


@functools.cache
def allow_peers() -> str:
    """Let processes of this user read this one's memory; '' or why they still cannot."""
    libc = load_libc()
    if libc is None:
        return "process_vm_readv is not in this C library"
    try:
        with open(_YAMA) as f:
            scope = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return ""  # no Yama: same-user access is the rule
    if scope >= 2:
        return f"Yama ptrace_scope={scope} allows only privileged tracers"
    if scope == 1 and libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY), 0, 0, 0) != 0:
        return f"prctl(PR_SET_PTRACER) failed: {os.strerror(ctypes.get_errno())}"
    return ""


class ProcessGone(ProcessLookupError):
    """The process a read was from no longer exists (a peer that died)."""

    def __init__(self, pid: int) -> None:
        super().__init__(errno.ESRCH, f"process_vm_readv from process {pid}: {os.strerror(errno.ESRCH)}")
        self.pid = pid


def _read(pid: int, local: int, remote: int, nbytes: int) -> None:
    """Copy nbytes from address `remote` of process `pid` to local address `local`."""
    libc = load_libc()
    assert libc is not None
    while nbytes:
        lv, rv = _IOVec(local, nbytes), _IOVec(remote, nbytes)
        got = libc.process_vm_readv(pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
        if got <= 0:
            raise read_error(pid, ctypes.get_errno() if got < 0 else errno.EFAULT)
        local, remote, nbytes = local + got, remote + got, nbytes - got


def _read_natively(read_peer, pid: int, local: int, remote: int, nbytes: int) -> None:
    """_read through the compiled module's read_peer."""
    err = read_peer(pid, local, remote, nbytes)
    if err:
        raise read_error(pid, err)


def read_error(pid: int, err: int) -> OSError:
    """What a read from process `pid` that stopped with errno `err` raises."""
    if err == errno.ESRCH:
        return ProcessGone(pid)
    return OSError(err, f"process_vm_readv from process {pid}: {os.strerror(err)}")


@functools.cache
def aliasing_is_slow() -> bool:
    """Is this CPU's kernel copy slow into the alias window? The best of a few reads out of
    this process into a destination 16 bytes past the source against 2048 past, once; yes
    where this process cannot read itself (the safe answer: bounce)."""
    region = np.ones(2 * _ALIAS_PROBE + 3 * 4096, np.uint8)
    src = region.ctypes.data + -region.ctypes.data % 4096
    best: dict[int, float] = {}
    try:
        for shift in (16, 2048, 16, 2048):
            dst = src + _ALIAS_PROBE + 4096 + shift
            for _ in range(4):
                t0 = time.perf_counter()
                _read(os.getpid(), dst, src, _ALIAS_PROBE)
                best[shift] = min(best.get(shift, 1.0), time.perf_counter() - t0)
    except OSError:
        return True
    return best[16] > ALIAS_SLOW * best[2048]


class Reader:
    """Reads peers' memory into local arrays; keeps the bounce buffer of misaligned reads.
    With the compiled module (`native`), each read is one C call rather than ctypes'."""

    def __init__(self, native: ModuleType | None = None) -> None:
        self._bounce: np.ndarray | None = None
        self._at = 0  # the bounce buffer's address
        self._read = _read if native is None else functools.partial(_read_natively, native.read_peer)

    def read_into(self, dst: np.ndarray, pid: int, remote: int) -> None:
        """Fill contiguous `dst` from address `remote` of process `pid`."""
        local, nbytes = address(dst), dst.nbytes
        if not 0 < (local - remote) % 4096 < ALIAS_WINDOW or not aliasing_is_slow():
            self._read(pid, local, remote, nbytes)
            return
        raw = dst.reshape(-1).view(np.uint8)
        for lo in range(0, nbytes, BOUNCE):
            piece = self.fetch(pid, remote + lo, min(BOUNCE, nbytes - lo))
            raw[lo:lo + piece.size] = piece

    def fetch(self, pid: int, remote: int, nbytes: int) -> np.ndarray:
        """Up to BOUNCE bytes from `remote` of process `pid`, as a view of the bounce buffer
        placed far from the source's alias window (valid until the next fetch)."""
        if self._bounce is None:
            self._bounce = np.empty(BOUNCE + 8192, np.uint8)
            self._at = self._bounce.ctypes.data
        # _BOUNCE_SHIFT past the source; a copy out of it to a destination within the source's
        # window is then ~_BOUNCE_SHIFT from it too
        start = (_BOUNCE_SHIFT + remote - self._at) % 4096
        self._read(pid, self._at + start, remote, nbytes)
        return self._bounce[start:start + nbytes]


def can_read(pid: int, remote: int, expect: int) -> str:
    """'' if the 8-byte word at `remote` in process `pid` reads as `expect`; else why not."""
    word = np.zeros(1, np.uint64)
    try:
        _read(pid, word.ctypes.data, remote, 8)
    except OSError as exc:
        return exc.strerror or str(exc)
    return "" if int(word[0]) == expect else f"read {int(word[0])}, expected {expect}"
