"""Shared fixtures: `get_cluster(size, transport)` hands out a live N-rank world (see cluster.py)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

import pytest

from cluster import Cluster

_MAX_LIVE = 3  # clusters kept alive at once: each rank is a process on a 2-core machine
_live: OrderedDict[tuple[int, str], Cluster] = OrderedDict()

TRANSPORTS = ("shm", "tcp")
PYTHON = "shm-python"
"""A `transport` of get_cluster: shared memory with the Python bodies only (TENSORWIRE_NATIVE=0)."""


def _get(size: int, transport: str = "shm") -> Cluster:
    key = (size, transport)
    cluster = _live.pop(key, None)
    if cluster is None or cluster.broken:
        if cluster is not None:
            cluster.close()
        while len(_live) >= _MAX_LIVE:
            _live.popitem(last=False)[1].close()
        env = {"TENSORWIRE_TRANSPORT": "tcp" if transport == "tcp" else "auto"}
        if transport == PYTHON:
            env["TENSORWIRE_NATIVE"] = "0"
        cluster = Cluster(size, env)
    _live[key] = cluster
    return cluster


@pytest.fixture(scope="session")
def get_cluster() -> Iterator[Callable[..., Cluster]]:
    yield _get
    while _live:
        _live.popitem()[1].close()
