"""tensorwire as a torch.distributed backend: `import tensorwire.torch`, then

    dist.init_process_group("tensorwire")            # under torchrun or tensorwire run
    dist.new_group(ranks, backend="tensorwire")      # also on top of a Gloo world

Importing this module registers the backend name "tensorwire" for CPU and CUDA tensors. Every c10d
operation of a tensorwire process group is run by tensorwire itself (see process_group.py);
errors are tensorwire's (PeerLostError, CollectiveMismatchError, TimeoutError, ...), raised on
every rank. `bf16_allreduce_hook` and `fp16_allreduce_hook` are DDP communication hooks that
compress only between hosts (hooks.py). See docs/torch.md.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.rendezvous  # noqa: F401 - the module, not its same-named function

from .. import auth
from ..errors import RendezvousError, TensorwireError, named
from ..rendezvous import bootstrap
from ..rendezvous.tcp_protocol import EXITED_KEY
from ..rendezvous.tcp_store import TCPStore as TwTCPStore
from . import world
from .hooks import bf16_allreduce_hook, fp16_allreduce_hook
from .process_group import BACKEND_NAME, ProcessGroupTensorwire
from .work import TensorwireWork

__all__ = ["BACKEND_NAME", "ProcessGroupTensorwire", "TensorwireWork", "bf16_allreduce_hook",
           "create_backend", "fp16_allreduce_hook"]


def create_backend(opts: Any, pg_options: Any = None) -> ProcessGroupTensorwire:
    """c10d's constructor hook (extended API): one call per torch group, on its members only."""
    ranks = list(opts.global_ranks_in_group)
    name = str(opts.group_id)
    rank = ranks[opts.group_rank] if ranks else opts.group_rank
    with named(rank, "new_group" if ranks else "init_process_group"):
        timeout = world.timeout_seconds(opts.timeout)
    if not ranks:  # the default group: the tensorwire world
        group = world.world_group(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    else:
        group = world.sub_group(opts.store, ranks, name, opts.timeout)
    if group.rank != opts.group_rank or group.size != opts.group_size:
        raise RuntimeError(f"tensorwire backend: torch says rank {opts.group_rank} of {opts.group_size} "
                           f"for group {name!r} (ranks {ranks}), tensorwire computed {group.rank} of "
                           f"{group.size}")
    return ProcessGroupTensorwire(group, timeout if timeout is not None else group.runtime.config.timeout,
                                  name, release=world.release)


# -- registration --------------------------------------------------------------------------------

if BACKEND_NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND_NAME, create_backend, extended_api=True,
                                  devices=["cpu", "cuda"])


# `tensorwire run` hosts a *tensorwire* store on MASTER_PORT. torch's env:// would try to host
# or reach a torch TCPStore there, so under that launcher env:// instead starts a torch store
# on a free port and publishes the port through the tensorwire store. Elsewhere env:// is torch's.
# torch's store authenticates nobody: on one node it listens on MASTER_ADDR (loopback) alone.
_RDZV = sys.modules["torch.distributed.rendezvous"]
_TORCH_ENV_HANDLER = _RDZV._rendezvous_handlers.get("env")


def _tensorwire_run() -> bootstrap.LaunchInfo | None:
    """This process's launch where `tensorwire run` started it and hosts the job's store; else
    None: torch's env:// serves (an environment tensorwire cannot read is no tensorwire run's,
    which always sets a readable one: torch's env:// judges it)."""
    try:
        info = bootstrap.detect()
    except TensorwireError:
        return None
    hosted = info.source == "tensorwire" and info.store_hosted  # torchrun's agent hosts a store too
    return info if hosted else None


_env_inits = 0


def _env_handler(url: str, timeout: timedelta = timedelta(minutes=30),
                 **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    info = _tensorwire_run()
    if info is None or _TORCH_ENV_HANDLER is None:
        assert _TORCH_ENV_HANDLER is not None
        yield from _TORCH_ENV_HANDLER(url, timeout=timeout, **kwargs)
        return
    global _env_inits
    query = dict(p.split("=", 1) for p in url.partition("?")[2].split("&") if "=" in p)
    rank = int(query.get("rank", info.rank))
    size = int(query.get("world_size", info.world_size))
    addr, port = info.master_addr, info.master_port
    assert addr is not None and port is not None  # tensorwire run always sets them
    _env_inits += 1
    key = f"tw/torch-store/{_env_inits}"
    seconds = timeout.total_seconds()
    with named(rank, "init_process_group"):
        tw_store = TwTCPStore(addr, port, timeout=seconds, server=False, secret=bootstrap.job_secret(info))
    try:
        if rank == 0:
            listen_fd, torch_port = _loopback_listener(addr)
            store = dist.TCPStore(addr, torch_port, size, is_master=True, timeout=timeout,
                                  wait_for_workers=False, master_listen_fd=listen_fd)
            tw_store.set(key, str(store.port).encode())
        else:
            torch_port = int(tw_store.get(key, seconds))
            _host_left(tw_store, rank, None)
            try:
                store = dist.TCPStore(addr, torch_port, size, is_master=False, timeout=timeout)
            except RuntimeError as exc:  # torch's DistNetworkError, DistStoreError
                _host_left(tw_store, rank, exc)
                raise
    finally:
        tw_store.close()
    yield (store, rank, size)
    raise RuntimeError("env:// under tensorwire run cannot re-rendezvous")


def _host_left(tw_store: TwTCPStore, rank: int, exc: BaseException | None) -> None:
    """Where a rank has exited (tensorwire run told its store), torch's store, which rank 0
    hosts, may be gone with it: say so at once, not after torch's own retries end in a bare
    connection timeout."""
    if tw_store.check([EXITED_KEY]):
        why = tw_store.get(EXITED_KEY).decode(errors="replace")
        raise RendezvousError(f"rank {rank}: init_process_group: torch's store, which rank 0 hosts under "
                              f"tensorwire run, cannot be reached: {why}") from exc


def _loopback_listener(addr: str) -> tuple[int | None, int]:
    """(descriptor, port) of a socket listening on `addr` alone, handed over to torch's store,
    where `addr` is a loopback address; else (None, 0): torch's store listens on every interface,
    as the ranks of other hosts must reach it."""
    if not auth.is_loopback(addr):
        return None, 0
    family, _, _, _, address = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.create_server(address[:2], family=family)
    port = sock.getsockname()[1]
    return sock.detach(), port


if _TORCH_ENV_HANDLER is not None and getattr(_TORCH_ENV_HANDLER, "__module__", "") != __name__:
    _RDZV._rendezvous_handlers["env"] = _env_handler
