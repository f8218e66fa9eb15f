"""A store in a directory, for processes of one host without a launcher's store."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
import time
import urllib.parse

from ..errors import InvalidArgumentError, RendezvousError, TensorwireError, TimeoutError
from .store import DEFAULT_STORE_TIMEOUT_S, Store, check_key, check_value


class FileStore(Store):
    """A store in a directory, for processes of one host that share no launcher-provided store.

    One file per key, written to a temporary name then renamed (readers see whole values or
    nothing); counters are updated under an `fcntl` lock. Reads poll, backing off to ~10 ms:
    there is no cross-process wakeup in the stdlib that is simpler than that.
    """

    _LOCK_NAME = ".lock"
    _USERS_KEY = "__tensorwire_users__"

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = DEFAULT_STORE_TIMEOUT_S,
                 cleanup: bool = False) -> None:
        super().__init__(timeout)
        self.path = os.fspath(path)
        self._cleanup = cleanup
        self._closed = False
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            raise RendezvousError(f"cannot create the file store directory {self.path}: {exc}") from exc
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise RendezvousError(f"the file store directory {self.path} is not writable by this process")
        if cleanup:
            self.add(self._USERS_KEY, 1)

    def _file(self, key: str) -> str:
        name = urllib.parse.quote(key, safe="-_.")
        if len(name) > 200 or name.startswith("."):
            name = "h_" + hashlib.sha256(key.encode()).hexdigest()
        return os.path.join(self.path, name)

    def _write(self, key: str, value: bytes) -> None:
        target = self._file(key)
        tmp = f"{os.path.join(self.path, '.tmp')}-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
        try:
            with open(tmp, "wb") as f:
                f.write(value)
            os.replace(tmp, target)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise RendezvousError(f"file store {self.path}: cannot write key {key!r}: {exc}") from exc

    def _read(self, key: str) -> bytes | None:
        try:
            with open(self._file(key), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise RendezvousError(f"file store {self.path}: cannot read key {key!r}: {exc}") from exc

    def _poll(self, keys: list[str], timeout: float) -> list[str]:
        """Wait until no key is missing or the deadline passes; returns the keys still missing."""
        deadline = time.monotonic() + timeout
        delay = 0.0005
        missing = [k for k in keys if not os.path.exists(self._file(k))]
        while missing:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return missing
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.01)
            missing = [k for k in missing if not os.path.exists(self._file(k))]
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
        lock_path = os.path.join(self.path, self._LOCK_NAME)
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise RendezvousError(f"file store {self.path}: cannot open its lock file: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
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
        return all(os.path.exists(self._file(check_key(k))) for k in keys)

    def delete_key(self, key: str) -> bool:
        self._ensure_open(f"delete_key({key!r})")
        try:
            os.unlink(self._file(check_key(key)))
            return True
        except FileNotFoundError:
            return False

    def close(self) -> None:
        """Close; with cleanup=True the last of the processes that opened the directory removes it."""
        if self._closed:
            return
        if self._cleanup:
            with contextlib.suppress(TensorwireError, OSError):
                if self.add(self._USERS_KEY, -1) <= 0:
                    for name in os.listdir(self.path):
                        with contextlib.suppress(OSError):
                            os.unlink(os.path.join(self.path, name))
                    with contextlib.suppress(OSError):
                        os.rmdir(self.path)
        self._closed = True

    def __repr__(self) -> str:
        return f"FileStore({self.path!r})"
