"""The process-wide state behind the API: configuration, store, engine and the world group."""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import log
from .config import Config
from .rendezvous.bootstrap import LaunchInfo
from .rendezvous.store import Store
from .transport.engine import Engine
from .tuning.topology import Topology

if TYPE_CHECKING:
    from .group.group import Group

_WORKER_GRACE_S = 1.0  # how long an unfinished async collective may still run at shutdown


@dataclass(eq=False)  # one per job: compared by identity, kept in a WeakSet
class Runtime:
    rank: int
    world_size: int
    config: Config
    info: LaunchInfo
    store: Store | None
    engine: Engine
    started: float = field(default_factory=time.monotonic)
    world: Group = None  # type: ignore[assignment]  # set right after construction (api.init); None
    # only in join_on_demand's runtime, whose world nothing reads
    groups: weakref.WeakSet = field(default_factory=weakref.WeakSet)  # every Group built on it
    shm_told: set = field(default_factory=set)  # shortfalls of /dev/shm the job was warned of (group.py)
    shrunk: dict = field(default_factory=dict)  # shrinks of each group name's line so far (shrink.py)
    closed: bool = False  # destroy() ran, or a fork's copy: its groups' calls raise NotInitializedError
    pid: int = field(default_factory=os.getpid)  # the process that made it (a fork's copy has another)
    topology: Topology | None = None  # who is near whom (None: the torch backend's runtime over another
    # backend's world, which learns its peers group by group)

    def __post_init__(self) -> None:
        _LIVE.add(self)
        self.engine.held_limit = self.config.held_limit(self.info.local_world_size)

    def ended(self, what: str) -> str:
        """Why a call (`what`) on this closed runtime's groups cannot run."""
        if self.pid != os.getpid():
            return (f"rank {self.rank}: {what}: this process is a fork of rank {self.rank}'s, made after "
                    f"tensorwire.init(): its connections and shared memory are the parent's, and a call "
                    f"here would speak for the parent. Communicate from the parent, or call destroy() "
                    f"and init() in the child for a job of its own (multiprocessing's 'spawn' start "
                    f"method makes children without the parent's state)")
        return (f"rank {self.rank}: {what}: tensorwire.destroy() was called, which ended this group; call "
                f"init() again and make the group anew")

    def close(self) -> None:
        self.closed = True
        if self.pid != os.getpid():  # a fork's copy: what it would close is the parent's
            return
        for group in list(self.groups):
            group.release(_WORKER_GRACE_S)  # a later call takes the checked path, which names the destroy
        self.engine.close()
        if self.store is not None:
            self.store.close()
        log.get("INIT").info("rank %d shut down", self.rank)


_LIVE: weakref.WeakSet[Runtime] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A process forked after init() holds its parent's connections and shared memory: its calls
    would speak for the parent (a peer matched them against the parent's). Its runtimes are
    closed, touching nothing shared, so that their groups' calls raise (Runtime.ended), and its
    copies of the sockets closed (a data-loader worker kept a killed rank's connections open)."""
    for runtime in list(_LIVE):
        runtime.closed = True
        runtime.engine.let_go_in_fork()
        for group in list(runtime.groups):
            group.forget_plans()  # every call then takes the checked path


os.register_at_fork(after_in_child=_after_fork_in_child)
