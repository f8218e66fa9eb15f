"""Our Store API over a torch.distributed store."""

from __future__ import annotations

from typing import Any

from ..errors import RendezvousError, TensorwireError, TimeoutError
from .store import DEFAULT_STORE_TIMEOUT_S, Store, check_key, check_value


class TorchStoreAdapter(Store):
    """Our Store API over a `torch.distributed.Store`, for torchrun's agent store or a store
    torch hands to our process-group backend. torch is imported only here, only when used."""

    def __init__(self, torch_store: Any, *, timeout: float | None = None) -> None:
        if timeout is None:
            t = getattr(torch_store, "timeout", None)
            seconds = t.total_seconds() if t is not None else 0.0
            timeout = seconds if seconds > 0 else DEFAULT_STORE_TIMEOUT_S
        super().__init__(timeout)
        self.torch_store = torch_store

    @staticmethod
    def _td(seconds: float) -> Any:
        from datetime import timedelta
        return timedelta(seconds=seconds)

    def _translate(self, what: str, exc: BaseException, timeout: float | None = None) -> TensorwireError:
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "timeout" in text.lower() or "timed out" in text.lower() or type(exc).__name__ == "DistStoreError":
            waited = f" after {timeout:g} s" if timeout is not None else ""
            return TimeoutError(f"store {what} timed out{waited} (torch store: {text})")
        return RendezvousError(f"store {what} failed on the torch store: {text}")

    def set(self, key: str, value: bytes) -> None:
        check_key(key)
        value = check_value(key, value)
        try:
            self.torch_store.set(key, value)
        except RuntimeError as exc:
            raise self._translate(f"set({key!r})", exc) from exc

    def get(self, key: str, timeout: float | None = None) -> bytes:
        check_key(key)
        t = self._timeout(timeout)
        try:
            # torch's get() uses the store-wide timeout; waiting first applies ours.
            self.torch_store.wait([key], self._td(t))
            return bytes(self.torch_store.get(key))
        except RuntimeError as exc:
            raise self._translate(f"get({key!r})", exc, t) from exc

    def add(self, key: str, amount: int) -> int:
        check_key(key)
        try:
            return int(self.torch_store.add(key, int(amount)))
        except RuntimeError as exc:
            raise self._translate(f"add({key!r})", exc) from exc

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        keys = [check_key(k) for k in keys]
        t = self._timeout(timeout)
        try:
            self.torch_store.wait(keys, self._td(t))
        except RuntimeError as exc:
            raise self._translate(f"wait({keys!r})", exc, t) from exc

    def multi_get(self, keys: list[str], timeout: float | None = None) -> list[bytes]:
        if not keys:
            return []
        self.wait(keys, timeout)
        try:
            return [bytes(v) for v in self.torch_store.multi_get(keys)]
        except RuntimeError as exc:
            raise self._translate(f"multi_get({len(keys)} keys)", exc) from exc

    def check(self, keys: list[str]) -> bool:
        keys = [check_key(k) for k in keys]
        try:
            return bool(self.torch_store.check(keys))
        except RuntimeError as exc:
            raise self._translate(f"check({keys!r})", exc) from exc

    def delete_key(self, key: str) -> bool:
        check_key(key)
        try:
            return bool(self.torch_store.delete_key(key))
        except RuntimeError as exc:
            raise self._translate(f"delete_key({key!r})", exc) from exc

    def close(self) -> None:
        # torch stores close when garbage-collected; dropping our reference is all we can do.
        self.torch_store = None

    def __repr__(self) -> str:
        return f"TorchStoreAdapter({self.torch_store!r})"
