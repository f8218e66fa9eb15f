"""Which tensorwire runtime serves torch's process groups, and which Group each one gets.

One process, one runtime, one connection per pair of processes, whatever the number of torch
groups (the transport multiplexes groups by context id):

- `init_process_group("tensorwire")`: the default group's backend joins the world with
  `tensorwire.init(store=<torch's store>)`, connecting every pair; the default group is the
  tensorwire world and every `new_group` a tensorwire Group over the same connections.
- a Gloo (or other) world with `new_group(..., backend="tensorwire")`: c10d constructs the
  backend on the group's members only, so no world-wide exchange is possible. The runtime then
  spans torch's world ranks and learns where its peers listen group by group: each new group's
  members publish their cards under the group's own store prefix and read the ones they do not
  know yet (one request); pairs then connect on first use, as in a tensorwire world
  (transport/wiring.py).

A torch group's Group needs no communication to create: its context id is a hash of torch's
group name (identical on every member: c10d derives it from a creation counter or the ranks)
and its global ranks, which the extended backend API hands us.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .. import api, log
from ..errors import InvalidArgumentError, RendezvousError, TimeoutError
from ..group.context import context_of
from ..group.group import Group
from ..rendezvous.store import Store
from ..rendezvous.torch_store import TorchStoreAdapter
from ..runtime import Runtime
from .work import join_waiters

_log = log.get("INIT")
_lock = threading.RLock()
_runtime: Runtime | None = None
_owner = ""  # "api": we called tensorwire.init; "user": they did; "links": lazily connected
_refs = 0
_WAITERS_S = 1.0  # how long a closing world waits for its futures' helper threads to end
_EXIT_WAITERS_S = 30.0  # ... and the process's exit for those still running callbacks
_PID = os.getpid()


def store_location(store: Any) -> str | None:
    """'tcp://host:port' or 'file://path' of the torch store under any PrefixStores."""
    s = store
    while isinstance(s, dist.PrefixStore):
        s = s.underlying_store
    if isinstance(s, dist.TCPStore):
        return f"tcp://{s.host}:{s.port}"
    if isinstance(s, dist.FileStore):
        return f"file://{s.path}"
    return None


def timeout_seconds(timeout: Any) -> float | None:
    """A timeout passed to init_process_group / new_group, in seconds; None for torch's default
    (30 minutes), which leaves tensorwire's own: TENSORWIRE_TIMEOUT, else 300 s. Zero or less
    is an error."""
    from torch.distributed.constants import default_pg_timeout

    if not isinstance(timeout, timedelta) or timeout == default_pg_timeout:
        return None
    s = timeout.total_seconds()
    if s <= 0:
        raise InvalidArgumentError(f"tensorwire backend: timeout must be positive, got {timeout!r}")
    return s


def context_id(group_name: str, ranks: list[int]) -> int:
    """The torch group's context id, of its name and ranks."""
    return context_of(f"torch/{group_name}/{','.join(map(str, ranks))}".encode())


def _where(store: Any, size: int) -> str | None:
    loc = store_location(store)
    if loc is None and size > 1:
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        loc = f"tcp://{addr}:{port}" if addr and port else "tcp://127.0.0.1:1"
    return loc


def world_group(store: Any, rank: int, size: int, timeout: Any) -> Group:
    """The default group's backend: the whole tensorwire world, one connection per pair."""
    global _runtime, _owner, _refs
    with _lock:
        if api.is_initialized():
            rt = api.require_runtime("torch backend")
            if (rt.rank, rt.world_size) != (rank, size):
                raise RendezvousError(
                    f"tensorwire is already initialized as rank {rt.rank} of {rt.world_size}, but torch "
                    f"asks for rank {rank} of {size}; call tensorwire.destroy() first")
            _runtime, _owner = rt, "user"  # theirs: torch's shutdown leaves it alone
        else:
            if _runtime is not None:
                raise RendezvousError(
                    "a tensorwire backend of an earlier torch world is still alive; destroy its groups "
                    "(torch.distributed.destroy_process_group()) first")
            t = timeout_seconds(timeout)
            adapter = TorchStoreAdapter(store, timeout=t)
            api.init(rank=rank, world_size=size, init_method=_where(store, size) if size > 1 else None,
                     timeout=t, store=adapter if size > 1 else None)
            _runtime, _owner = api.require_runtime("torch backend"), "api"
        _refs += 1
        return _runtime.world


def sub_group(store: Any, ranks: list[int], group_name: str, timeout: Any) -> Group:
    """A `new_group`'s backend (members only): a Group over the process's runtime."""
    global _runtime, _owner, _refs
    with _lock:
        if _runtime is None and api.is_initialized():
            _runtime, _owner = api.require_runtime("torch backend"), "user"
        if _runtime is None:
            _runtime, _owner = _links_runtime(store, timeout), "links"
        if _owner == "links":
            _learn_members(_runtime, ranks, TorchStoreAdapter(store, timeout=timeout_seconds(timeout)))
        _refs += 1
        return Group(_runtime, ranks, context_id(group_name, ranks), f"torch:{group_name}")


def release() -> None:
    """A torch group shut down; the last one closes what this module opened."""
    global _runtime, _owner, _refs
    with _lock:
        _refs = max(0, _refs - 1)
        if _refs or _runtime is None:
            return
        owner, rt = _owner, _runtime
        _runtime, _owner = None, ""
    if owner != "user":  # theirs stays open: its receives (and the futures waiting on them) go on
        _close(owner, rt)


def _close_links() -> None:
    global _runtime, _owner
    with _lock:
        if _owner != "links" or _runtime is None:
            return
        rt, _runtime, _owner = _runtime, None, ""
    _close("links", rt)


def _close(owner: str, rt: Runtime) -> None:
    """Close a runtime this module opened; its futures' helper threads end as their receives fail."""
    if owner == "api":
        api.destroy()
    else:
        rt.close()
    join_waiters(_WAITERS_S)


def _at_exit() -> None:
    """Before the interpreter finalizes (registered after tensorwire.destroy's own exit hook, so
    run before it): close what this module opened and let the futures' helper threads run
    their callbacks to the end (their receives fail at the close). Not in a forked child: its
    threads and locks are the parent's."""
    if os.getpid() != _PID:
        return
    _close_links()
    if not join_waiters(0.0):
        return
    if api.is_initialized():
        api.destroy()
    left = join_waiters(_EXIT_WAITERS_S)
    if left:
        print(f"tensorwire: {len(left)} torch future callback(s) still running at exit after "
              f"{_EXIT_WAITERS_S:g} s; the process may abort as the interpreter ends", file=sys.stderr,
              flush=True)


atexit.register(_at_exit)


# -- a world whose pairs connect on demand (tensorwire groups on top of another backend) ---------

def _links_runtime(store: Any, timeout: Any) -> Runtime:
    rank, size = dist.get_rank(), dist.get_world_size()
    runtime = api.join_on_demand(rank, size, _where(store, size), timeout=timeout_seconds(timeout))
    _log.info("rank %d/%d: tensorwire groups on top of torch's %s world; pairs connect on demand",
              rank, size, dist.get_backend())
    return runtime


def _learn_members(rt: Runtime, members: list[int], store: Store) -> None:
    """Where a new group's members listen: this rank publishes its card under the group's
    store prefix and reads those it does not know yet, in one request (they all do the same);
    pairs connect on first use."""
    wiring, me = rt.engine.wiring, rt.rank
    if wiring is None:  # a world of one: no peer to learn of
        return
    store.set(f"tw/link/{me}", json.dumps(wiring.cards[me]).encode())
    unknown = [m for m in members if m not in wiring.cards]
    if not unknown:
        return
    try:
        values = store.multi_get([f"tw/link/{m}" for m in unknown], timeout=rt.config.timeout)
    except TimeoutError as exc:
        raise TimeoutError(f"rank {me}: creating a tensorwire group of ranks {members}: rank(s) among "
                           f"{unknown} never published their address within {rt.config.timeout:g} s") from exc
    wiring.learn({m: json.loads(v) for m, v in zip(unknown, values)})
