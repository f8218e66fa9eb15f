"""Keep freed memory in the process instead of handing it back to the kernel.

Algorithms need temporaries of the message's size (a received block, a copy to reduce into),
and so does the engine for messages that arrive before their receive is posted. glibc serves
large allocations with fresh mmap()s and trims the heap on free, so every such temporary is
new memory whose first touch page-faults, far slower than copying into warm pages
(docs/design/buffers.md#kept-memory). MPI libraries make the same choice (Open MPI's memory
hooks turn mmap and trimming off for the same reason): with allocations served from the heap
and the heap kept, a collective's temporaries reuse the pages of the previous call.

TENSORWIRE_KEEP_MEMORY=0 leaves the allocator alone. Only glibc is tuned; elsewhere this does
nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

from . import log

_log = log.get("INIT")

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
KEEP_BYTES = 1 << 30
"""Free memory at the top of the heap beyond this is still returned (bounds what is kept)."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


@functools.cache
def keep_freed_memory() -> bool:
    """Serve large allocations from the heap and keep up to KEEP_BYTES of it once freed; True
    when glibc took the settings. Process-wide and idempotent."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    ok = bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
    _log.info("allocator: large allocations from the heap, %s kept after free%s", "1 GiB",
              "" if ok else " (mallopt refused)")
    return ok


def give_back() -> None:
    """Return the heap's free pages to the kernel now (glibc's malloc_trim; elsewhere nothing):
    what a one-off burst of large arrays left (calibration's at init) is not kept for the job."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
        trim(0)
