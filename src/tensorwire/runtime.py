"""The process-wide state behind the API: configuration, store, engine and the world group."""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

from . import log
from .config import Config
from .rendezvous.bootstrap import LaunchInfo
from .rendezvous.store import Store
from .transport.engine import Engine
from .tuning.topology import Topology

_WORKER_GRACE_S = 1.0  # how long an unfinished async collective may still run at shutdown


@dataclass
class Runtime:
    rank: int
    world_size: int
    config: Config
    info: LaunchInfo
    store: Store | None
    engine: Engine
    started: float = field(default_factory=time.monotonic)
    world: object = None  # the world Group, set right after construction
    groups: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # every Group built on it
    shm_told: set = field(default_factory=set)  # shortfalls of /dev/shm the job was warned of (group.py)
    closed: bool = False  # destroy() ran: its groups' calls raise NotInitializedError
    topology: Topology | None = None  # who is near whom (None: the torch backend's runtime over another
    # backend's world, which learns its peers group by group)

    def close(self) -> None:
        self.closed = True
        for group in list(self.groups):
            group.release(_WORKER_GRACE_S)  # a later call takes the checked path, which names the destroy
        self.engine.close()
        if self.store is not None:
            self.store.close()
        log.get("INIT").info("rank %d shut down", self.rank)
