"""Named /dev/shm segments: made with every page reserved, mapped without holding a descriptor,
unlinked, and removed after a creator that died before it unlinked them. The rings of shm.py and
the one-shot segments of segment.py are such segments.

A segment starts with a control page: its user's words first (a ring's head and tail: shm.py),
the creator's nonce at word 16, and the creator's owner record at byte 192, by which
`remove_stale` tells a dead job's segment from a live one's.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import secrets
import stat
import struct
import time
import weakref

import numpy as np

from ..buffers import address
from . import cma
from .processes import namespace, process_start, start_of

CTRL_BYTES = 4096  # a segment's control page, before its data
_NONCE = 16  # the word of the creator's nonce
SHM_DIR = "/dev/shm"
PREFIX = "tw-"  # every segment's name starts so
_OWNER = struct.Struct("<8sQq32s")
"""The creator's record at _OWNER_AT of the control page (magic, pid, start time, pid
namespace), written before the segment has a size: what tells a segment whose creator is gone
(`remove_stale`) from a live job's."""
_OWNER_AT, _MAGIC = 192, b"tw-owner"
_UNWRITTEN_S = 60.0
"""A segment without its owner record this long after it was made lost its creator in the
microseconds between making it and writing the record (a job killed whole): stale too."""


class Segment:
    """A named /dev/shm mapping with a 4 KiB control page (word 16 holds the creator's nonce).

    Its creator reserves every page before anyone maps it (`reserve`): tmpfs hands pages out on
    first touch, and a write past the space left killed the writer with SIGBUS. The mapping
    keeps no descriptor (`map_shared`) and lasts as long as any view of it."""

    def __init__(self, name: str, nbytes: int, create: bool, nonce: int = 0) -> None:
        if not create and (not name.startswith(PREFIX) or "/" in name or "\0" in name):
            raise OSError(errno.EINVAL, f"not a tensorwire segment name: {name!r}")
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else os.O_NOFOLLOW)
        fd = os.open(self.path, flags | os.O_CLOEXEC, 0o600)
        try:
            if create:
                os.pwrite(fd, _owner(), _OWNER_AT)
                os.ftruncate(fd, nbytes)
                reserve(fd, nbytes)
            else:
                _check_mappable(fd, self.path, nbytes)
            self.bytes = map_shared(fd, nbytes)
        except BaseException:
            if create:
                self.unlink()  # nothing left behind in /dev/shm
            raise
        finally:
            os.close(fd)
        self.words = self.bytes.data.cast("Q")
        if create:
            self.words[_NONCE] = nonce

    @staticmethod
    def unique_name(prefix: str) -> str:
        return f"{prefix}-{secrets.token_hex(4)}"

    @property
    def nonce(self) -> int:
        return self.words[_NONCE]

    @property
    def nonce_address(self) -> int:
        """Where this process sees the nonce word: a peer that reads it across processes
        (cma.can_read) has proven it can read this process's memory."""
        return address(self.bytes) + _NONCE * 8

    def unlink(self) -> None:
        _unlink(self.path)

    def close(self) -> None:
        """Drop this object's views; the mapping goes with the last view anywhere."""
        self.words.release()
        self.bytes = None  # type: ignore[assignment]


def _check_mappable(fd: int, path: str, nbytes: int) -> None:
    """A segment a peer named (its name came over a connection or the store): a file of this
    user's, of the size announced (mapping past its end would be a SIGBUS at the first read)."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        raise OSError(errno.EPERM, f"{path} is not a regular file of this user's")
    if st.st_size < nbytes:
        raise OSError(errno.EINVAL, f"{path} holds {st.st_size} bytes, not the {nbytes} announced")


def _owner() -> bytes:
    """This process's owner record (read afresh: a forked child is another process)."""
    return _OWNER.pack(_MAGIC, os.getpid(), process_start(), namespace("pid").encode())


def remove_stale(directory: str = SHM_DIR) -> tuple[int, int]:
    """Unlink the segments in `directory` whose creating process is gone: a job killed before
    it unlinked them (a live job's are unlinked as soon as mapped). Only where the creator is
    provably gone: in this process's pid namespace, its pid exited or reused (start time); a
    creator in another namespace (container) is never judged; an empty file (a creator that
    died before it wrote its owner record), after _UNWRITTEN_S. Only this user's files: others'
    (root's job among them) are theirs to clean. (segments, bytes) removed."""
    mine = namespace("pid").encode()
    if process_start() < 0 or not mine:  # no /proc to tell the living from the dead
        return 0, 0
    removed = freed = 0
    for name in _named(directory, PREFIX):
        path = os.path.join(directory, name)
        held = _held_by_the_gone(path, mine)
        if held >= 0 and _unlink(path):
            removed, freed = removed + 1, freed + held
    return removed, freed


def _held_by_the_gone(path: str, pidns: bytes) -> int:
    """The bytes segment `path` holds if it is this user's and its creator (in namespace
    `pidns`) is gone; else -1 (alive, elsewhere, unknown, another user's, or not a segment)."""
    try:  # never blocks (a FIFO) nor follows a link
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return -1
    try:
        st = os.fstat(fd)
        record = os.pread(fd, _OWNER.size, _OWNER_AT) if stat.S_ISREG(st.st_mode) else b""
    except OSError:
        return -1
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid():
        return -1
    if len(record) < _OWNER.size:
        unwritten = stat.S_ISREG(st.st_mode) and st.st_size == 0
        return 0 if unwritten and time.time() - st.st_mtime > _UNWRITTEN_S else -1
    magic, pid, start, ns = _OWNER.unpack(record)
    if magic != _MAGIC or ns.rstrip(b"\0") != pidns or start < 0 or start_of(pid) == start:
        return -1
    return st.st_blocks * 512


def unlink_prefixed(prefix: str, directory: str = SHM_DIR) -> int:
    """Unlink every segment named `prefix`-*: a group's whose creator was lost before it could
    (group/shm_setup.py). How many."""
    return sum(_unlink(os.path.join(directory, n)) for n in _named(directory, f"{prefix}-"))


def _named(directory: str, prefix: str) -> list[str]:
    try:
        return [n for n in os.listdir(directory) if n.startswith(prefix)]
    except OSError:
        return []


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def reserve(fd: int, nbytes: int) -> None:
    """Make tmpfs allocate a segment's pages now, or fail with ENOSPC (or ENOMEM where a memory
    cgroup is full) having allocated none: a page it could not hand out later would be a SIGBUS
    at its first touch (docs/design/shm-degradation.md)."""
    os.posix_fallocate(fd, 0, nbytes)


_PROT_RW, _MAP_SHARED = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED


@functools.cache
def _mmap_calls() -> tuple | None:
    libc = cma.load_libc()
    if libc is None:
        return None
    mapper, unmapper = libc["mmap"], libc["munmap"]  # own prototypes, not libc.mmap's
    mapper.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long)
    mapper.restype = ctypes.c_void_p
    unmapper.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    unmapper.restype = ctypes.c_int
    return mapper, unmapper


def map_shared(fd: int, nbytes: int) -> np.ndarray:
    """`nbytes` of `fd` mapped shared, as bytes, holding no descriptor: Python's mmap keeps a
    duplicate of the file's (2 per local peer for the rings: 94 descriptors at 48 ranks on a
    host, more than the sockets). The mapping is undone when the last view of it goes."""
    calls = _mmap_calls()
    if calls is None:
        return np.frombuffer(mmap.mmap(fd, nbytes), dtype=np.uint8)
    mapper, unmapper = calls
    where = mapper(None, nbytes, _PROT_RW, _MAP_SHARED, fd, 0)
    if where is None or where == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {nbytes} bytes: {os.strerror(err)}")
    owner = (ctypes.c_uint8 * nbytes).from_address(where)
    weakref.finalize(owner, unmapper, where, nbytes).atexit = False  # exit unmaps; threads may still poll
    return np.frombuffer(memoryview(owner), dtype=np.uint8)


class Ring(Segment):
    """A single-writer byte ring; `capacity` is a multiple of 64 so records never straddle the wrap."""

    def __init__(self, name: str, capacity: int, create: bool, nonce: int = 0) -> None:
        super().__init__(name, self.nbytes(capacity), create, nonce)
        self.capacity = capacity
        self.data = self.bytes[CTRL_BYTES:]
        self.raw = self.data.data  # headers: a memoryview slice is cheaper than numpy's

    @staticmethod
    def nbytes(capacity: int) -> int:
        return CTRL_BYTES + capacity

    @classmethod
    def create(cls, prefix: str, capacity: int) -> Ring:
        return cls(cls.unique_name(prefix), capacity, True, secrets.randbits(63))

    def close(self) -> None:
        self.data = None  # type: ignore[assignment]
        self.raw.release()
        super().close()
