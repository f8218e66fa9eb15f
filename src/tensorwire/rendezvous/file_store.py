"""A store in a directory, for processes of one host without a launcher's store."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import stat
import threading
import time
import urllib.parse
from typing import NoReturn

from ..errors import InvalidArgumentError, RendezvousError, TensorwireError, TimeoutError
from ..trusted_paths import kind, untrusted, user_name
from .store import DEFAULT_STORE_TIMEOUT_S, Store, check_key, check_value

_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
"""Every open in the directory: a planted symbolic link fails (ELOOP) and a FIFO opens without
blocking, to be refused as what it is."""


def _check_parent(parent: str, store: str) -> None:
    """The directories above the store must keep others from renaming it away or planting
    another in its place (trusted_paths.untrusted)."""
    try:
        found = untrusted(parent)
    except OSError as exc:
        raise RendezvousError(f"cannot check {exc.filename}, above the file store {store}: {exc.strerror}") \
            from exc
    if found is not None:
        _refuse(found[0], store, found[1])


def _refuse(path: str, store: str, problem: str) -> NoReturn:
    raise RendezvousError(f"{path}, above the file store {store}, {problem}: another user may have made it "
                          f"to read or change the job's store; remove it, or choose another directory "
                          f"(init_method='file:///...')")


class FileStore(Store):
    """A store in a directory, for processes of one host that share no launcher-provided store.

    One file per key, written to a temporary name then renamed (readers see whole values or
    nothing); counters are updated under an `fcntl` lock. Reads poll, backing off to ~10 ms:
    there is no cross-process wakeup in the stdlib that is simpler than that.

    The directory is this user's alone, or refused with an error naming it: made mode 0700, it
    must be a real directory owned by this user that nobody else may write to, in a parent
    `_check_parent` accepts. Every file is opened through the directory's descriptor, without
    following links, and must be a regular file: a name planted there is an error, never a
    stranger's value or a read that blocks.

    With cleanup=True the directory is one job's: each process using it holds a shared flock
    on its member file for as long as it does (the kernel drops it when the process dies). The
    last one to close removes the directory; one that finds no holder (a job killed before it
    could) empties it before use. A directory holding files but no member file is no store's:
    refused, never emptied.
    """

    _LOCK_NAME = ".lock"
    _MEMBERS_NAME = ".members"

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = DEFAULT_STORE_TIMEOUT_S,
                 cleanup: bool = False) -> None:
        super().__init__(timeout)
        self.path = os.path.abspath(os.fspath(path))
        self._closed = False
        self._members: int | None = None
        self._dir = self._open_dir()
        if cleanup:
            try:
                self._join(time.monotonic() + self.default_timeout)
            except BaseException:
                if self._dir >= 0:
                    os.close(self._dir)
                raise

    # -- the directory ------------------------------------------------------------------------

    def _open_dir(self) -> int:
        parent = existing = os.path.dirname(self.path)
        missing = []
        while not os.path.lexists(existing):
            missing.append(existing)
            existing = os.path.dirname(existing)
        _check_parent(existing, self.path)  # before anything is made in it
        for level in reversed(missing):  # each 0700 (makedirs gives all but the last the umask's)
            try:
                os.mkdir(level, 0o700)
            except FileExistsError:
                pass  # made meanwhile, or not a directory: _check_parent says what it is
            except OSError as exc:
                raise RendezvousError(f"cannot create {level}, above the file store {self.path}: "
                                      f"{exc.strerror}") from exc
        _check_parent(parent, self.path)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.path, 0o700)
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise RendezvousError(f"the file store directory {self.path} is {self._describe(self.path)}, "
                                      f"not a directory: remove it, or choose another place") from exc
            raise RendezvousError(f"cannot create the file store directory {self.path}: {exc.strerror}") \
                from exc
        st = os.fstat(fd)
        problem = None
        if st.st_uid != os.geteuid():
            problem = f"belongs to {user_name(st.st_uid)}, not to this user ({user_name(os.geteuid())})"
        elif st.st_mode & 0o022:
            problem = f"is writable by its group or others (mode {st.st_mode & 0o7777:o})"
        if problem is not None:
            os.close(fd)
            raise RendezvousError(f"the file store directory {self.path} {problem}: others could read or "
                                  f"change the job's keys; remove it, or choose another place")
        return fd

    @staticmethod
    def _describe(path: str, dir_fd: int | None = None) -> str:
        try:
            st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
        except OSError as exc:
            return f"unusable ({exc.strerror})"
        return f"{kind(st.st_mode)} of {user_name(st.st_uid)}"

    def _same(self, fd: int, name: str | None) -> bool:
        """Whether `fd` is still what `name` in the directory (None: the directory itself at its
        path) names: the last user may have removed both while this one waited for a lock."""
        try:
            st = os.stat(self.path, follow_symlinks=False) if name is None else \
                os.stat(name, dir_fd=self._dir, follow_symlinks=False)
        except OSError:
            return False
        mine = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def _open(self, name: str, flags: int, what: str) -> int:
        """`name` in the directory, which must be a regular file (FileNotFoundError passes)."""
        try:
            fd = os.open(name, flags | _OPEN_FLAGS, 0o600, dir_fd=self._dir)
        except FileNotFoundError:
            raise
        except OSError as exc:
            where = f"file store {self.path}: {what}"
            if exc.errno == errno.ELOOP:
                raise RendezvousError(f"{where}: {name} is {self._describe(name, self._dir)}, which this job "
                                      f"did not make") from exc
            raise RendezvousError(f"{where}: cannot open {name}: {exc.strerror}") from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise RendezvousError(f"file store {self.path}: {what}: {name} is "
                                  f"{self._describe(name, self._dir)}, not a regular file: this job did not "
                                  f"make it")
        return fd

    def _flock(self, fd: int, op: int, deadline: float, what: str) -> None:
        delay = 0.0005
        while True:
            try:
                fcntl.flock(fd, op | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"file store {self.path}: {what}: a lock in it stayed taken until the "
                                       f"timeout") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.01)

    def _empty(self, keep: str | None = None) -> None:
        for name in os.listdir(self._dir):
            if name != keep:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self._dir)

    def _join(self, deadline: float) -> None:
        names = os.listdir(self._dir)
        if names and self._MEMBERS_NAME not in names:  # not a store: never empty it, nor remove it
            shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
            raise RendezvousError(f"the file store directory {self.path} holds files no job's store made "
                                  f"({shown}): a job's store is a directory of its own, which the job "
                                  f"removes when it ends; choose a path that does not exist yet (file:///...)")
        while True:
            fd = self._open(self._MEMBERS_NAME, os.O_RDWR | os.O_CREAT, "join")
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    self._empty(keep=self._MEMBERS_NAME)  # nobody holds it: left by a job that died
                except BlockingIOError:
                    pass
                self._flock(fd, fcntl.LOCK_SH, deadline, "join")
            except BaseException:
                os.close(fd)
                raise
            if self._same(fd, self._MEMBERS_NAME) and self._same(self._dir, None):
                self._members = fd
                return
            os.close(fd)  # its last user removed it meanwhile: make it anew
            if time.monotonic() >= deadline:
                raise TimeoutError(f"file store {self.path}: join: the directory kept being removed until "
                                   f"the timeout")
            old, self._dir = self._dir, -1
            os.close(old)
            self._dir = self._open_dir()

    # -- keys ---------------------------------------------------------------------------------

    def _file(self, key: str) -> str:
        name = urllib.parse.quote(key, safe="-_.")
        if len(name) > 200 or name.startswith("."):
            name = "h_" + hashlib.sha256(key.encode()).hexdigest()
        return name

    def _exists(self, key: str) -> bool:
        try:
            os.stat(self._file(key), dir_fd=self._dir, follow_symlinks=False)
            return True
        except FileNotFoundError:
            return False

    def _write(self, key: str, value: bytes) -> None:
        tmp = f".tmp-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
        fd = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, f"set({key!r})")
        try:
            with open(fd, "wb") as f:
                f.write(value)
            os.replace(tmp, self._file(key), src_dir_fd=self._dir, dst_dir_fd=self._dir)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._dir)
            raise RendezvousError(f"file store {self.path}: cannot write key {key!r}: {exc}") from exc

    def _read(self, key: str) -> bytes | None:
        try:
            fd = self._open(self._file(key), os.O_RDONLY, f"get({key!r})")
        except FileNotFoundError:
            return None
        with open(fd, "rb") as f:
            return f.read()

    def _poll(self, keys: list[str], timeout: float) -> list[str]:
        """Wait until no key is missing or the deadline passes; returns the keys still missing."""
        deadline = time.monotonic() + timeout
        delay = 0.0005
        missing = [k for k in keys if not self._exists(k)]
        while missing:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return missing
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.01)
            missing = [k for k in missing if not self._exists(k)]
        return []

    def _ensure_open(self, what: str) -> None:
        if self._closed:
            raise RendezvousError(f"{what}: the file store {self.path} is closed")

    def set(self, key: str, value: bytes) -> None:
        self._ensure_open(f"set({key!r})")
        self._write(check_key(key), check_value(key, value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        self._ensure_open(f"get({key!r})")
        check_key(key)
        t = self._timeout(timeout)
        deadline = time.monotonic() + t
        while True:
            value = self._read(key)
            if value is not None:
                return value
            if self._poll([key], max(deadline - time.monotonic(), 0.0)):
                raise TimeoutError(f"store get({key!r}) timed out after {t:g} s waiting for the key "
                                   f"to be set (file store {self.path})")

    def add(self, key: str, amount: int) -> int:
        self._ensure_open(f"add({key!r})")
        check_key(key)
        what = f"add({key!r})"
        fd = self._open(self._LOCK_NAME, os.O_RDWR | os.O_CREAT, what)
        try:
            self._flock(fd, fcntl.LOCK_EX, time.monotonic() + self.default_timeout, what)
            old = self._read(key) or b"0"
            try:
                new = int(old) + int(amount)
            except ValueError:
                raise InvalidArgumentError(f"add({key!r}, {amount}) on file store {self.path}: the key holds "
                                           f"{old[:40]!r}, not an integer counter") from None
            self._write(key, str(new).encode())
            return new
        finally:
            os.close(fd)  # closing releases the flock

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        self._ensure_open(f"wait({keys!r})")
        keys = [check_key(k) for k in keys]
        t = self._timeout(timeout)
        missing = self._poll(keys, t)
        if missing:
            raise TimeoutError(f"store wait timed out after {t:g} s; keys still missing: {missing} "
                               f"(file store {self.path})")

    def check(self, keys: list[str]) -> bool:
        self._ensure_open(f"check({keys!r})")
        return all(self._exists(check_key(k)) for k in keys)

    def delete_key(self, key: str) -> bool:
        self._ensure_open(f"delete_key({key!r})")
        try:
            os.unlink(self._file(check_key(key)), dir_fd=self._dir)
            return True
        except FileNotFoundError:
            return False

    def close(self) -> None:
        """Close; with cleanup=True the last of the processes that opened the directory removes it."""
        if self._closed:
            return
        self._closed = True
        if self._members is not None:
            # Closers take turns under the lock file, so that of two closing at once, one sees
            # the other gone: each tries to turn its shared hold exclusive, which only the last can.
            with contextlib.suppress(TensorwireError, OSError):
                lock = self._open(self._LOCK_NAME, os.O_RDWR | os.O_CREAT, "close")
                try:
                    self._flock(lock, fcntl.LOCK_EX, time.monotonic() + self.default_timeout, "close")
                    try:
                        fcntl.flock(self._members, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        last = True
                    except BlockingIOError:
                        last = False
                    if last and self._same(self._dir, None):
                        self._empty()
                        os.rmdir(self.path)
                finally:
                    os.close(lock)
            os.close(self._members)
        os.close(self._dir)

    def __repr__(self) -> str:
        return f"FileStore({self.path!r})"
