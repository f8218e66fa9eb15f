"""Pinned host buffers that device buffers are staged through where ranks cannot reach each
other's device memory (other hosts, TCP forced, CUDA IPC unavailable).

Pinned, because a copy from pageable memory is several times slower and cannot overlap
anything (docs/design/gpu.md#notes-moved-out-of-the-code). Pinning is slow (a page-locking
system call per buffer), so buffers are kept and reused; a buffer goes back to the pool
with the event after the last copy out of it, and is handed out again only once that
event has passed.
"""

from __future__ import annotations

import threading
from typing import Any

SMALLEST = 64 << 10
KEPT_BYTES = 1 << 30
"""Pinned bytes kept for reuse per process (beyond, buffers are freed when given back)."""

_lock = threading.Lock()
_free: list[tuple[Any, Any]] = []  # (uint8 pinned tensor, event after its last use or None)
_kept = 0


def take(nbytes: int) -> Any:
    """A pinned uint8 host tensor of at least `nbytes`, free to write now."""
    import torch

    global _kept
    with _lock:
        best = None
        for i, (buf, _event) in enumerate(_free):
            if buf.numel() >= nbytes and (best is None or buf.numel() < _free[best][0].numel()):
                best = i
        if best is not None:
            buf, event = _free.pop(best)
            _kept -= buf.numel()
        else:
            buf = event = None
    if event is not None:
        event.synchronize()  # the last copy out of it (usually long done)
    if buf is None:
        size = max(SMALLEST, 1 << max(nbytes - 1, 0).bit_length())
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    return buf


def give_back(buf: Any, event: Any = None) -> None:
    """Return `buf` to the pool; `event` marks its last use by a copy still queued."""
    global _kept
    with _lock:
        if _kept + buf.numel() <= KEPT_BYTES:
            _free.append((buf, event))
            _kept += buf.numel()


def mirror(buf: Any, like: Any) -> Any:
    """`buf`'s first bytes as a host tensor of `like`'s dtype and shape."""
    nbytes = like.numel() * like.element_size()
    return buf[:nbytes].view(like.dtype).view(like.shape)
