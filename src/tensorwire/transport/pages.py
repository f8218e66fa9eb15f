"""How much of a buffer lies in transparent huge pages, as the kernel's page tables say.

A read out of another process (transport/cma.py) pins the source's pages one by one, and runs
faster out of huge pages than out of 4 KiB ones (docs/design/memory.md): what single
copy costs depends on where its sources' buffers lie, which only each source can see. A source
looks with PAGEMAP_SCAN (Linux 6.7+), an ioctl on /proc/self/pagemap that lists the huge-page
runs of a range; a look costs microseconds, so the answer is kept a moment per buffer.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time

from .cma import load_libc

UNKNOWN = 15
"""`eighths` where the kernel cannot tell (no PAGEMAP_SCAN, no /proc), or where no page of the
buffers is there yet."""
KEEP_S = 0.05
"""Seconds an answer for a buffer is reused: pages change rarely (khugepaged collapses them,
reclaim splits them) and a stale answer only misprices, but a scan per call is a visible share
of a MiB-sized single copy's time (docs/design/memory.md)."""
_PAGE_IS_PRESENT, _PAGE_IS_PFNZERO, _PAGE_IS_HUGE = 1 << 3, 1 << 5, 1 << 6
_RUNS = 16


class _Region(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


class _ScanArg(ctypes.Structure):  # struct pm_scan_arg, linux/fs.h
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
        "category_inverted", "category_mask", "category_anyof_mask", "return_mask")]


_PAGEMAP_SCAN = (3 << 30) | (ctypes.sizeof(_ScanArg) << 16) | (ord("f") << 8) | 16  # _IOWR('f', 16, ...)


class PageScanner:
    """Answers `eighths` for the process that made it (it keeps its /proc/self/pagemap open):
    take the process's own from `scanner()`."""

    def __init__(self) -> None:
        self._fd = -1
        self._ioctl = None
        libc = load_libc()
        try:
            if libc is not None:
                self._fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            pass
        if self._fd >= 0:
            self._ioctl = libc["ioctl"]  # type: ignore[index]  # its own prototype, not libc.ioctl's
            self._ioctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)
            self._ioctl.restype = ctypes.c_int
        self._runs = (_Region * _RUNS)()
        # the present pages' runs, each with whether it is huge or the zero page
        self._arg = _ScanArg(size=ctypes.sizeof(_ScanArg), vec=ctypes.addressof(self._runs), vec_len=_RUNS,
                             category_mask=_PAGE_IS_PRESENT,
                             return_mask=_PAGE_IS_PRESENT | _PAGE_IS_PFNZERO | _PAGE_IS_HUGE)
        self._kept: dict[tuple[int, int], tuple[int, int, float]] = {}

    def eighths(self, spans: list[tuple[int, int]]) -> int:
        """Eighths (0-8, rounded down) of the bytes of `spans` ((address, bytes) each) that lie
        in huge pages, of those that are there at all: a page not yet touched (or still the
        zero page) is left out, as its first write decides what it becomes. An output that
        peers read after this rank has written it had counted as out of huge pages before its
        first call (the benchmark's: every out-of-place all_reduce then left single copy for
        good). UNKNOWN where the kernel cannot tell, or where none of the bytes is there yet."""
        huge = present = 0
        empty = True
        now = time.monotonic()
        for span in spans:
            if not span[1]:
                continue
            empty = False
            kept = self._kept.get(span)
            if kept is None or now - kept[2] > KEEP_S:
                got = self._scan(*span)
                if got is None:
                    return UNKNOWN
                if len(self._kept) >= 64:
                    self._kept.clear()
                kept = self._kept[span] = (*got, now)
            huge += kept[0]
            present += kept[1]
        if empty:
            return 8
        return 8 * huge // present if present else UNKNOWN

    def _scan(self, address: int, nbytes: int) -> tuple[int, int] | None:
        """(bytes in huge pages, bytes there at all) of [address, address + nbytes); None where
        the kernel cannot tell."""
        if self._ioctl is None:
            return None
        if not nbytes:
            return 0, 0
        lo, hi = address & ~4095, (address + nbytes + 4095) & ~4095
        arg, runs, huge, present = self._arg, self._runs, 0, 0
        while lo < hi:
            arg.start, arg.end = lo, hi
            got = self._ioctl(self._fd, _PAGEMAP_SCAN, ctypes.byref(arg))
            if got < 0:  # ENOTTY / EINVAL before Linux 6.7
                self._ioctl = None
                return None
            for i in range(got):
                run = runs[i]
                if run.categories & _PAGE_IS_PFNZERO:
                    continue
                overlap = max(0, min(run.end, address + nbytes) - max(run.start, address))
                present += overlap
                if run.categories & _PAGE_IS_HUGE:
                    huge += overlap
            if got < _RUNS or arg.walk_end >= hi:
                break
            lo = arg.walk_end
        return huge, present


@functools.cache
def scanner() -> PageScanner:
    """This process's scanner (a forked child makes its own: the parent's reads its parent)."""
    return PageScanner()


os.register_at_fork(after_in_child=scanner.cache_clear)
