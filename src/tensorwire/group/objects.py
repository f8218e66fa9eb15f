"""Collectives of picklable Python objects (torch.distributed's *_object calls).

Each pickles, agrees on sizes with a small collective, then moves the bytes with the vector
collectives; every rank must call them alike, as any collective.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..algorithms.base import blocks_of
from .arguments import invalid

if TYPE_CHECKING:
    from .group import Group


def _object_sizes(group: Group, payload: np.ndarray, timeout: float | None) -> list[int]:
    sizes = np.zeros(group.size, dtype=np.int64)
    group.all_gather_into_tensor(sizes, np.array([payload.size], dtype=np.int64), timeout=timeout)
    return [int(s) for s in sizes]


def all_gather_object(group: Group, object_list: list[Any], obj: Any, *,
                      timeout: float | None = None) -> list[Any]:
    """object_list[r] = rank r's obj (pickled; the object list must have `size` slots)."""
    payload = _pickle(group, obj, "all_gather_object")
    sizes = _object_sizes(group, payload, timeout)
    buf = np.empty(sum(sizes), dtype=np.uint8)
    group.all_gatherv(buf, payload, sizes, timeout=timeout)
    object_list[:] = [pickle.loads(b) for b in blocks_of(buf, sizes)]
    return object_list


def gather_object(group: Group, obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, *,
                  timeout: float | None = None) -> list[Any] | None:
    payload = _pickle(group, obj, "gather_object")
    sizes = _object_sizes(group, payload, timeout)
    buf = np.empty(sum(sizes) if group.rank == dst else 0, dtype=np.uint8)
    group.gatherv(buf, payload, sizes, dst, timeout=timeout)
    if group.rank == dst and object_gather_list is not None:
        object_gather_list[:] = [pickle.loads(b) for b in blocks_of(buf, sizes)]
    return object_gather_list


def broadcast_object_list(group: Group, object_list: list[Any], src: int = 0, *,
                          timeout: float | None = None) -> list[Any]:
    """Replace object_list's items on every rank with those of rank src."""
    payload = (_pickle(group, list(object_list), "broadcast_object_list") if group.rank == src
               else np.empty(0, dtype=np.uint8))
    size = np.array([payload.size], dtype=np.int64)
    group.broadcast(size, src, timeout=timeout)
    if group.rank != src:
        payload = np.empty(int(size[0]), dtype=np.uint8)
    group.broadcast(payload, src, timeout=timeout)
    if group.rank != src:
        object_list[:] = pickle.loads(payload)
    return object_list


def scatter_object_list(group: Group, scatter_object_output_list: list[Any],
                        scatter_object_input_list: Sequence[Any] | None = None, src: int = 0, *,
                        timeout: float | None = None) -> list[Any]:
    """scatter_object_output_list[0] = rank src's scatter_object_input_list[this rank]."""
    if group.rank == src:
        if scatter_object_input_list is None or len(scatter_object_input_list) != group.size:
            invalid(group, "scatter_object_list", f"needs {group.size} input objects on rank {src}")
        payloads = [_pickle(group, o, "scatter_object_list") for o in scatter_object_input_list]
        sizes = np.array([p.size for p in payloads], dtype=np.int64)
        buf = np.concatenate(payloads)
    else:
        sizes, buf = np.zeros(group.size, dtype=np.int64), np.empty(0, dtype=np.uint8)
    group.broadcast(sizes, src, timeout=timeout)
    mine = np.empty(int(sizes[group.rank]), dtype=np.uint8)
    group.scatterv(mine, buf, [int(s) for s in sizes], src, timeout=timeout)
    scatter_object_output_list[:1] = [pickle.loads(mine)]
    return scatter_object_output_list


def _pickle(group: Group, obj: Any, what: str) -> np.ndarray:
    """The object's bytes; an object that cannot be pickled fails the call on every rank (the
    others would wait for its sizes), naming this rank and the object's type."""
    try:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        invalid(group, what, f"cannot pickle the {type(obj).__name__} given: {type(exc).__name__}: {exc}")
    return np.frombuffer(data, dtype=np.uint8).copy()
