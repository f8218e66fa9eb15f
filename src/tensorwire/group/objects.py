"""Collectives of picklable Python objects (torch.distributed's *_object calls).

Each pickles, agrees on sizes with a small collective, then moves the bytes with the vector
collectives; every rank must call them alike, as any collective.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from .. import limits
from ..algorithms.base import blocks_of
from ..errors import TensorwireError, in_call
from .arguments import check_member, check_root, invalid

if TYPE_CHECKING:
    from .group import Group


def _object_sizes(group: Group, payload: np.ndarray, timeout: float | None) -> list[int]:
    sizes = np.zeros(group.size, dtype=np.int64)
    group.all_gather_into_tensor(sizes, np.array([payload.size], dtype=np.int64), timeout=timeout)
    return [int(s) for s in sizes]


@contextlib.contextmanager
def _steps(group: Group, what: str) -> Iterator[None]:
    """The calls an object collective makes, their errors naming it first ('rank 1:
    all_gather_object on group world: all_gatherv #4 on group world timed out ...')."""
    try:
        yield
    except TensorwireError as exc:
        if f"{what} #" in str(exc):  # a refusal of this call (here or a peer's), named already
            raise
        named = in_call(exc, f"{what} on group {group.name}")
        if named is exc:
            raise
        raise named from exc


def _slots(group: Group, what: str, value: Any, name: str, size: int | None = None) -> None:
    """`value` must be a list (its items are replaced), of `size` items where given."""
    if not isinstance(value, list):
        invalid(group, what, f"{name} must be a list, got {type(value).__name__}")
    if size is not None and len(value) != size:
        invalid(group, what, f"{name} must have {size} slots (one per rank of group {group.name}), got "
                             f"{len(value)}")


def all_gather_object(group: Group, object_list: list[Any], obj: Any, *,
                      timeout: float | None = None) -> list[Any]:
    """object_list[r] = rank r's obj (pickled; the object list must have `size` slots)."""
    what = "all_gather_object"
    check_member(group, what)
    _slots(group, what, object_list, "object_list", group.size)
    payload = _pickle(group, obj, what)
    with _steps(group, what):
        sizes = _object_sizes(group, payload, timeout)
        buf = _buffer(group, sum(sizes), what)
        group.all_gatherv(buf, payload, sizes, timeout=timeout)
    object_list[:] = [pickle.loads(b.data) for b in blocks_of(buf, sizes)]
    return object_list


def gather_object(group: Group, obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, *,
                  timeout: float | None = None) -> list[Any] | None:
    """object_gather_list[r] = rank r's obj on rank dst (a list of `size` slots there; None
    elsewhere, where it is ignored)."""
    what = "gather_object"
    dst = check_root(group, dst, what, "dst")
    if group.rank == dst:
        _slots(group, what, object_gather_list, "object_gather_list", group.size)
    payload = _pickle(group, obj, what)
    with _steps(group, what):
        sizes = _object_sizes(group, payload, timeout)
        buf = _buffer(group, sum(sizes) if group.rank == dst else 0, what)
        group.gatherv(buf, payload, sizes, dst, timeout=timeout)
    if group.rank == dst:
        object_gather_list[:] = [pickle.loads(b.data) for b in blocks_of(buf, sizes)]  # type: ignore[index]
    return object_gather_list


def broadcast_object_list(group: Group, object_list: list[Any], src: int = 0, *,
                          timeout: float | None = None) -> list[Any]:
    """Replace object_list's items on every rank with those of rank src."""
    what = "broadcast_object_list"
    src = check_root(group, src, what, "src")
    _slots(group, what, object_list, "object_list")
    payload = _pickle(group, list(object_list), what) if group.rank == src else np.empty(0, dtype=np.uint8)
    size = np.array([payload.size], dtype=np.int64)
    with _steps(group, what):
        group.broadcast(size, src, timeout=timeout)
        if group.rank != src:
            payload = _buffer(group, int(size[0]), what)
        group.broadcast(payload, src, timeout=timeout)
    if group.rank != src:
        object_list[:] = pickle.loads(payload.data)
    return object_list


def scatter_object_list(group: Group, scatter_object_output_list: list[Any],
                        scatter_object_input_list: Sequence[Any] | None = None, src: int = 0, *,
                        timeout: float | None = None) -> list[Any]:
    """scatter_object_output_list[0] = rank src's scatter_object_input_list[this rank]."""
    what = "scatter_object_list"
    src = check_root(group, src, what, "src")
    _slots(group, what, scatter_object_output_list, "scatter_object_output_list")
    if group.rank == src:
        inputs = scatter_object_input_list
        if not isinstance(inputs, (list, tuple)) or len(inputs) != group.size:
            got = type(inputs).__name__ if not isinstance(inputs, (list, tuple)) else f"{len(inputs)} of them"
            invalid(group, what, f"needs a list of {group.size} input objects on rank {src}, got {got}")
        payloads = [_pickle(group, o, what) for o in inputs]
        sizes = np.array([p.size for p in payloads], dtype=np.int64)
        buf = np.concatenate(payloads)
    else:
        sizes, buf = np.zeros(group.size, dtype=np.int64), np.empty(0, dtype=np.uint8)
    with _steps(group, what):
        group.broadcast(sizes, src, timeout=timeout)
        mine = _buffer(group, int(sizes[group.rank]), what)
        group.scatterv(mine, buf, [int(s) for s in sizes], src, timeout=timeout)
    scatter_object_output_list[:1] = [pickle.loads(mine.data)]
    return scatter_object_output_list


def _pickle(group: Group, obj: Any, what: str) -> np.ndarray:
    """The object's bytes; an object that cannot be pickled fails the call on every rank (the
    others would wait for its sizes), naming this rank and the object's type."""
    try:
        return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8).copy()
    except MemoryError as exc:
        _out_of_memory(group, exc, what)
    except Exception as exc:
        invalid(group, what, f"cannot pickle the {type(obj).__name__} given: {type(exc).__name__}: {exc}")


def _buffer(group: Group, nbytes: int, what: str) -> np.ndarray:
    """A buffer for the bytes this rank receives; where it cannot be allocated, the step that
    would fill it fails on every member (the others would wait for this rank in it)."""
    try:
        return np.empty(nbytes, dtype=np.uint8)
    except MemoryError as exc:
        _out_of_memory(group, exc, what)


def _out_of_memory(group: Group, exc: MemoryError, what: str) -> NoReturn:
    """Refuse the call about to be made on every member, naming the limits, as any call that
    cannot allocate."""
    group.fail_fast(limits.memory_error(exc, f"rank {group.runtime.rank}: {what}"))
