"""Module-level API with torch.distributed's names: `init`, `all_reduce(x)`, `new_group`, ...

Every function takes `group=None` (the world) and forwards to that Group's method, so the
module-level call and the method are one implementation.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import reprlib
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from . import auth, log, memory
from .config import Config
from .errors import InvalidArgumentError, NotInitializedError, StoreLostError, named
from .group.group import Group
from .rendezvous import bootstrap
from .rendezvous.prefix_store import PrefixStore
from .rendezvous.store import Store
from .rendezvous.tcp_protocol import StoreLimits
from .runtime import Runtime
from .transport import netif, tcp
from .transport.connect import connect_world, refuse_to_join, wire_engine
from .transport.engine import Engine
from .tuning import calibrate, policy
from .tuning.topology import Topology, local_card

_runtime: Runtime | None = None
_generation = 0
_lock = threading.Lock()
_log = log.get("INIT")
F = TypeVar("F", bound=Callable[..., Any])


def init(rank: int | None = None, world_size: int | None = None, init_method: str | None = None, *,
         timeout: float | None = None, transport: str | None = None, socket_ifname: str | None = None,
         store: Any = None, deterministic: bool | None = None) -> Group:
    """Join the job and connect to every peer; returns the world group.

    Without arguments, reads the launcher's environment (tensorwire run, torchrun, mpirun,
    Slurm); `init_method` is 'tcp://host:port', 'file:///path' or 'env://'. `timeout` (seconds,
    default TENSORWIRE_TIMEOUT or 300) bounds initialisation and every later blocking call.
    `store` lets an integration (the torch backend) pass a store it already has.
    `deterministic=True` (or TENSORWIRE_DETERMINISTIC=1) makes floating-point reductions
    bitwise reproducible: every element is folded in rank order, whatever algorithm runs.
    """
    global _runtime, _generation
    with _lock:
        if _runtime is not None:
            raise RuntimeError(f"tensorwire is already initialized (rank {_runtime.rank}); call "
                               f"destroy() first")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not -sys.float_info.max <= timeout <= sys.float_info.max):
            raise InvalidArgumentError(f"init: timeout must be seconds (a finite number), got "
                                       f"{reprlib.repr(timeout)}")
        if deterministic is not None and not isinstance(deterministic, bool):
            raise InvalidArgumentError(f"init: deterministic must be True, False or None, got "
                                       f"{deterministic!r}")
        if store is not None and not isinstance(store, Store):
            raise InvalidArgumentError(f"init: store must be a tensorwire store (rendezvous.Store), got "
                                       f"{type(store).__name__}: pass init_method instead")
        cfg, info, address = _prepare("init", rank, world_size, init_method, timeout=timeout,
                                      transport=transport, socket_ifname=socket_ifname,
                                      deterministic=deterministic)
        deadline = time.monotonic() + cfg.timeout
        hosted_here = store is None and not info.store_hosted and info.init_method.startswith("tcp://")
        if hosted_here and info.world_size > cfg.store_max_connections:  # rank 0 serves every rank
            raise InvalidArgumentError(f"rank {info.rank}: init: TENSORWIRE_STORE_MAX_CONNECTIONS="
                                       f"{cfg.store_max_connections} is below the job's {info.world_size} "
                                       f"ranks, each of which connects to the store")
        if info.world_size > 1:  # inits through a store: a world of one (a rank alone) counts none
            _generation += 1
        secret = _job_secret(info, "init")
        scope = f"tw/{info.job_id}/g{_generation}"
        _log.info("rank %d/%d from %s, store %s, advertising %s, transport %s, TCP congestion control %s",
                  info.rank, info.world_size, info.source, info.init_method, address, cfg.transport,
                  tcp.congestion_in_use(cfg))
        connect_within = None
        while True:
            try:
                with named(info.rank, "init"):
                    root_store, engine, cards = _rendezvous(info, cfg, store, scope, secret, address,
                                                            deadline, connect_within)
                break
            except StoreLostError as exc:
                # rank 0 hosts the store (tcp://) and closed it under this rank's init: it was
                # ending the job before (destroy()) as this rank began the next; its next init
                # serves the address again (as for a rank that came before the store, init's
                # timeout bounds the wait), or it is gone
                if not (hosted_here and info.rank != 0 and exc.closed and connect_within is None):
                    raise
                connect_within = max(0.0, deadline - time.monotonic())
                _log.info("rank %d: init: the store closed under this rank; joining it afresh", info.rank)
        runtime = Runtime(info.rank, info.world_size, cfg, info, root_store if store is None else None,
                          engine, topology=Topology.from_cards(cards))
        runtime.world = Group(runtime, range(info.world_size), 0, "world")
        try:
            calibrate.at_init(runtime.world)  # collective: link constants every rank agrees on
        except BaseException:
            runtime.close()
            raise
        _runtime = runtime
    return runtime.world


def join_on_demand(rank: int, world_size: int, init_method: str | None, *,
                   timeout: float | None = None) -> Runtime:
    """A runtime for this process's rank whose pairs connect on demand and whose ranks meet
    group by group (each group's members publish their cards: wiring.learn), with no
    world-wide exchange: the torch backend's groups on top of another backend's world, whose
    members alone make each group (torch/world.py). It is not the API's world."""
    cfg, info, address = _prepare("new_group", rank, world_size, init_method, timeout=timeout)
    secret = _job_secret(info, "new_group")
    engine, _ = wire_engine(info.rank, info.world_size, cfg, info.job_id, secret, local_card(address),
                            lambda mine: {info.rank: mine}, machine=(info.local_world_size, info.local_rank))
    return Runtime(info.rank, info.world_size, cfg, info, None, engine)


def _job_secret(info: bootstrap.LaunchInfo, what: str) -> auth.Secret:
    """The secret the job's connections prove (bootstrap.job_secret), an error in getting it (a
    secret file, the per-user directory) named with the rank and the call `what`. One process
    opens no connection: nothing to prove (and no per-user secret to create)."""
    if info.world_size <= 1:
        return auth.NO_SECRET
    with named(info.rank, what):
        return bootstrap.job_secret(info)


def _prepare(what: str, rank: int | None, world_size: int | None, init_method: str | None,
             **settings: Any) -> tuple[Config, bootstrap.LaunchInfo, str]:
    """What joining a job starts from: the settings (`settings` over TENSORWIRE_*, checked:
    an unknown algorithm fails before connecting), the launcher's environment and the address
    this rank advertises. `what`: the call, as errors name it."""
    log.configure()
    try:
        cfg = Config.from_env(**settings)
    except ValueError as exc:  # a setting: the error names it
        raise InvalidArgumentError(f"{what}: {exc}") from None
    info = bootstrap.detect(rank, world_size, init_method)
    log.set_rank(info.rank)  # before the first line this rank logs
    if cfg.keep_memory:
        memory.keep_freed_memory()
    cfg.log_changed()
    policy.check_algo(cfg.algo, cfg.deterministic, info.rank)
    multi_host = 0 < info.local_world_size < info.world_size
    with named(info.rank, what):
        address = netif.select_address(cfg.socket_ifname, info.master_addr, info.master_port,
                                       multi_host=multi_host)
    return cfg, info, address


def _rendezvous(info: bootstrap.LaunchInfo, cfg: Config, store: Store | None, scope: str, secret: auth.Secret,
                address: str, deadline: float,
                connect_within: float | None) -> tuple[Store | None, Engine, dict[int, dict]]:
    """The store (`store`, an integration's, else the job's own), its roster checked, and the
    world connected through it: (the store, the engine, every rank's card)."""
    root_store = store
    if root_store is None and info.world_size > 1:
        root_store = bootstrap.create_store(
            info, cfg.timeout, secret=secret, limits=StoreLimits.from_config(cfg), generation=_generation,
            refused=lambda s, error, absent: refuse_to_join(PrefixStore(scope, s), info.rank, error, absent),
            connect_within=connect_within)
    elif root_store is not None and info.world_size > 1:  # the integration's (torch's) store,
        # which may outlive the job's attempts (torchrun's agent): its roster under the job id
        given = root_store
        bootstrap.check_roster(PrefixStore(f"tw/{info.job_id}", given), info, cfg.timeout,
                               _generation, lambda _, error, absent: refuse_to_join(
                                   PrefixStore(scope, given), info.rank, error, absent))
    # Keys carry the job id: torchrun's agent keeps its store across restarts, and a restarted
    # rank read its peer's address of the attempt before (connection refused until timeout).
    scoped = None if root_store is None else PrefixStore(scope, root_store)
    try:
        serving = info.world_size if root_store is not None and root_store.hosting else 0
        engine, cards = connect_world(info.rank, info.world_size, scoped, cfg, info.job_id,
                                      local_card(address), deadline, secret, serving)
    except BaseException:
        if root_store is not None and store is None:
            if root_store.hosting:
                # This process hosts the store: serve a little longer, so the other ranks
                # hit their own timeout and name the rank that is really missing, rather
                # than report a lost store.
                time.sleep(min(3.0, cfg.timeout))
            root_store.close()
        raise
    return root_store, engine, cards


def destroy() -> None:
    """Close every connection and forget the world; `init()` may be called again. It first
    waits for the peers' hosts to acknowledge what this rank sent (at once on a healthy link; up
    to TENSORWIRE_PEER_TIMEOUT for one that answers nothing, as in a network outage)."""
    global _runtime
    with _lock:
        runtime, _runtime = _runtime, None
    if runtime is not None:
        runtime.close()


atexit.register(destroy)


def is_initialized() -> bool:
    return _runtime is not None


def require_runtime(what: str = "this call") -> Runtime:
    """The process's runtime (integrations such as the torch backend build on it); raises
    NotInitializedError naming `what` before init()."""
    if _runtime is None:
        raise NotInitializedError(f"{what} needs tensorwire.init() first (no process group exists)")
    return _runtime


def world() -> Group:
    return require_runtime("world()").world


def get_rank(group: Group | None = None) -> int:
    return world().rank if group is None else group.rank


def get_world_size(group: Group | None = None) -> int:
    return world().size if group is None else group.size


def config() -> Config:
    return require_runtime("config()").config


def topology() -> Topology:
    """The job's topology, the same on every rank: each rank's host, machine, cores, NUMA node,
    GPU and interface (`.ranks`), the hosts (`.hosts`), the tier of a pair (`.tier(a, b)`),
    a group's layout and orders (`.layout(ranks)`); `.as_dict()` for JSON."""
    rt = require_runtime("topology()")
    if rt.topology is None:
        raise NotInitializedError("topology(): this world connects its pairs on demand (tensorwire groups "
                                  "on top of another torch backend) and has no topology")
    return rt.topology


def new_group(ranks: Sequence[int] | None = None, name: str | None = None) -> Group:
    """A group of world ranks (Group.new_group): its members call it; another rank that does
    gets a group of which it is not a member (rank -1)."""
    return require_runtime("new_group").world.new_group(ranks, name)


def split(color: int | None, key: int = 0, group: Group | None = None,
          timeout: float | None = None) -> Group | None:
    """MPI_Comm_split over `group` (default: the world)."""
    return _group(group, "split").split(color, key, timeout)


def shrink(group: Group | None = None, timeout: float | None = None, *, majority: bool = False) -> Group:
    """After a rank failed: the survivors of `group` as a new group (Group.shrink); every live
    member calls it. Without `group` it shrinks the world, and the result becomes the world:
    module-level calls, get_rank(), get_world_size() and new_group() use it from then on.
    `majority=True`: only the side of a network partition that holds a majority goes on."""
    runtime = require_runtime("shrink")
    old = _group(group, "shrink")
    new = old.shrink(timeout, majority=majority)
    if old is runtime.world:
        runtime.world = new
    return new


def _group(group: Group | None, what: str) -> Group:
    if group is None:
        return require_runtime(what).world
    require_runtime(what)
    return group


def _forward(name: str) -> Callable[..., Any]:
    """Group.<name> as a module-level function: the same parameters plus `group=None` (the
    world). It is compiled with the method's explicit signature: a *args/**kwargs wrapper
    costs a noticeable share of a small all_reduce (docs/design/groups.md#forwarding)."""
    method = getattr(Group, name)
    params = list(inspect.signature(method).parameters.values())[1:]  # without self
    env: dict[str, Any] = {"_api": sys.modules[__name__]}
    declared, passed, star = [], [], False
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not star:
            declared.append("*")
            star = True
        if p.default is p.empty:
            declared.append(p.name)
        else:
            env[f"_d{i}"] = p.default
            declared.append(f"{p.name}=_d{i}")
        passed.append(f"{p.name}={p.name}" if p.kind is p.KEYWORD_ONLY else p.name)
    declared += ["group=None"] if star else ["*", "group=None"]
    source = (f"def {name}({', '.join(declared)}):\n"
              f"    if group is None:\n"
              f"        group = (_api._runtime or _api.require_runtime({name!r})).world\n"
              f"    return group.{name}({', '.join(passed)})\n")
    exec(compile(source, f"<tensorwire.api.{name}: forwards to Group.{name}>", "exec"), env)  # noqa: S102
    call = env[name]
    functools.update_wrapper(call, method)
    del call.__wrapped__  # its own signature (with `group`, without `self`) is the true one
    call.__annotations__ = {**method.__annotations__, "group": "Group | None"}
    call.__doc__ = (method.__doc__ or "") + "\n\n`group=None` means the world group."
    return call


all_reduce = _forward("all_reduce")
reduce = _forward("reduce")
broadcast = _forward("broadcast")
all_gather = _forward("all_gather")
all_gather_into_tensor = _forward("all_gather_into_tensor")
all_gatherv = _forward("all_gatherv")
gather = _forward("gather")
gatherv = _forward("gatherv")
scatter = _forward("scatter")
scatterv = _forward("scatterv")
reduce_scatter = _forward("reduce_scatter")
reduce_scatter_tensor = _forward("reduce_scatter_tensor")
reduce_scatterv = _forward("reduce_scatterv")
all_to_all = _forward("all_to_all")
all_to_all_single = _forward("all_to_all_single")
barrier = _forward("barrier")
send = _forward("send")
recv = _forward("recv")
sendrecv = _forward("sendrecv")
isend = _forward("isend")
irecv = _forward("irecv")
irecv_any = _forward("irecv_any")
probe_any = _forward("probe_any")
iprobe_any = _forward("iprobe_any")
all_gather_object = _forward("all_gather_object")
gather_object = _forward("gather_object")
broadcast_object_list = _forward("broadcast_object_list")
scatter_object_list = _forward("scatter_object_list")
