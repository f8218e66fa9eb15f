"""A namespace inside another store."""

from __future__ import annotations

from ..errors import InvalidArgumentError
from .store import Store, check_key


class PrefixStore(Store):
    """A namespace inside another store, so groups and subsystems cannot collide on key names.

    Closing a prefix view closes the inner store only where the view owns it (`owns`: the view
    is its only user); otherwise many views share one connection.
    """

    def __init__(self, prefix: str, inner: Store, *, owns: bool = False) -> None:
        super().__init__(inner.default_timeout)
        if not prefix:
            raise InvalidArgumentError("PrefixStore needs a non-empty prefix")
        self.prefix = prefix
        self.inner = inner
        self.owns = owns

    @property
    def hosting(self) -> bool:
        return self.inner.hosting

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{check_key(key)}"

    def set(self, key: str, value: bytes) -> None:
        self.inner.set(self._k(key), value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self.inner.get(self._k(key), timeout)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(self._k(key), amount)

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        self.inner.wait([self._k(k) for k in keys], timeout)

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        return self.inner.multi_get([self._k(k) for k in keys], timeout)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check([self._k(k) for k in keys])

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(self._k(key))

    def refusals(self) -> str:
        return self.inner.refusals()

    def close(self) -> None:
        if self.owns:
            self.inner.close()

    def __repr__(self) -> str:
        return f"PrefixStore({self.prefix!r}, {self.inner!r})"
