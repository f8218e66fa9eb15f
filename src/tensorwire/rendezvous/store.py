"""The store every rank bootstraps through: a job-wide key-value API with deadlines.

A store only bootstraps: ranks publish their addresses and counters, then talk directly. So the
stores favour clear failures over speed: every blocking call has a deadline, and every error
names the key, the endpoint and how long was waited. One implementation per file beside this
one: `tcp_store` (and its `tcp_server`), `file_store`, `prefix_store`, `torch_store`.
"""

from __future__ import annotations

import abc

from ..errors import InvalidArgumentError

DEFAULT_STORE_TIMEOUT_S = 300.0


def check_key(key: str) -> str:
    """`key`, unless it is not a non-empty str (every store's rule)."""
    if not isinstance(key, str) or not key:
        raise InvalidArgumentError(f"store keys must be non-empty str, got {key!r}")
    return key


def check_value(key: str, value: bytes) -> bytes:
    """`value` as bytes, unless it is a str or nothing bytes() takes."""
    if isinstance(value, str):
        raise InvalidArgumentError(f"store value for key {key!r} must be bytes, got str (encode it first)")
    try:
        return bytes(value)
    except TypeError as exc:
        raise InvalidArgumentError(
            f"store value for key {key!r} must be bytes, got {type(value).__name__}") from exc


class Store(abc.ABC):
    """A job-wide key-value store: bytes values, atomic counters, blocking reads with deadlines."""

    def __init__(self, default_timeout: float = DEFAULT_STORE_TIMEOUT_S) -> None:
        if default_timeout <= 0:
            raise InvalidArgumentError(f"store timeout must be positive, got {default_timeout}")
        self.default_timeout = float(default_timeout)

    def _timeout(self, timeout: float | None) -> float:
        t = self.default_timeout if timeout is None else float(timeout)
        if t < 0 or t != t:
            raise InvalidArgumentError(f"store timeout must be >= 0 seconds, got {timeout}")
        return t

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Publish `value` under `key`, replacing any previous value and waking its waiters."""

    @abc.abstractmethod
    def get(self, key: str, timeout: float | None = None) -> bytes:
        """Return the value of `key`, waiting for it to be set; TimeoutError after `timeout` s."""

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Atomically add `amount` to the counter `key` (0 if absent) and return the new value.

        The counter is stored as ASCII decimal, so `get` of the same key reads e.g. b'3'.
        """

    @abc.abstractmethod
    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        """Block until every key exists; TimeoutError naming the missing ones otherwise."""

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        """The values of `keys`, waiting until every one is set (TimeoutError naming the missing
        ones otherwise). One request where the store can (TCPStore, torch's): a job's bootstrap
        costs each rank a fixed number of requests, not one per peer."""
        self.wait(keys, timeout)
        return [self.get(k, 0.0) for k in keys]

    @abc.abstractmethod
    def check(self, keys: list[str]) -> bool:
        """Whether all `keys` exist right now (never blocks)."""

    @abc.abstractmethod
    def delete_key(self, key: str) -> bool:
        """Remove `key`; returns whether it existed."""

    def refusals(self) -> str:
        """For the error of a rank that timed out waiting for others: the connections the store
        turned away because they could not prove the job's secret, as a sentence ('' where there
        were none, or the store cannot tell). Never raises."""
        return ""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections and files; the store is unusable afterwards."""

    @property
    def hosting(self) -> bool:
        """Whether this process serves the store to the others (TCPStore's server): its
        clients hold this process's descriptors, and closing it ends the store for them."""
        return False

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
