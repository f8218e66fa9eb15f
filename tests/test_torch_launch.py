"""Starting the tensorwire backend every way torch users do: torchrun, `tensorwire run`, and the
env://, tcp:// and file:// init methods (with destroy and re-init in one process), a single
process, the 'cpu:tensorwire' device syntax; examples/ddp_train.py under both launchers, and
examples/pipeline_train.py (send/recv through batch_isend_irecv) against its single-process run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from test_torch_backend import REPO, assert_all_ok, clean_env, launch, run_command

from cluster import free_port, free_ports

pytest.importorskip("torch")

_SELF = Path(__file__).resolve()
BIN = Path(sys.executable).parent
EXAMPLE = REPO / "examples" / "ddp_train.py"


def _check_example(result, what: str) -> None:
    text = result.out + result.err
    assert result.rc == 0, f"{what} exited {result.rc}:\n{text[-4000:]}"
    assert "parameters identical on every rank: True" in result.out, text[-4000:]
    assert "step   0" in result.out, text[-4000:]


@pytest.mark.timeout(120)
def test_example_under_torchrun() -> None:
    argv = [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(free_port()),
            str(EXAMPLE), "--steps", "6"]
    _check_example(run_command(argv, env=clean_env(), timeout=100), "torchrun")


@pytest.mark.timeout(120)
def test_example_under_tensorwire_run() -> None:
    argv = [str(BIN / "tensorwire"), "run", "-n", "2", str(EXAMPLE), "--steps", "6"]
    _check_example(run_command(argv, env=clean_env(), timeout=100), "tensorwire run")


@pytest.mark.timeout(120)
def test_the_torch_store_of_a_one_node_tensorwire_run_listens_on_loopback_alone() -> None:
    """torch's store authenticates nobody: it listened on every interface (*:PORT), where other
    machines could write its keys, though `tensorwire run --help` says 127.0.0.1."""
    argv = [str(BIN / "tensorwire"), "run", "-n", "2", str(_SELF), "torch_store_address"]
    result = run_command(argv, env=clean_env(), timeout=100)
    assert result.rc == 0 and "torch_store_address OK" in result.out, (result.out + result.err)[-4000:]


@pytest.mark.timeout(120)
def test_pipeline_example_matches_its_single_process_run() -> None:
    """Three stages on a 1F1B schedule: every stage's parameters and the losses after 5 steps
    are those of the whole model trained in one process (the example exits 1 where not)."""
    argv = [str(BIN / "tensorwire"), "run", "-n", "3", str(REPO / "examples" / "pipeline_train.py"),
            "--steps", "5", "--hidden", "64", "--micro-batches", "5"]
    result = run_command(argv, env=clean_env(), timeout=100)
    text = result.out + result.err
    assert result.rc == 0, f"pipeline example exited {result.rc}:\n{text[-4000:]}"
    assert "3 stages on cpu" in result.out, text[-4000:]
    assert "matches a single-process run: True" in result.out, text[-4000:]


@pytest.mark.timeout(120)
def test_a_process_exits_cleanly_with_future_callbacks_pending() -> None:
    """The futures' helper threads ran their callbacks while the interpreter finalized: torch
    aborted the process ('terminate called without an active exception')."""
    results = launch("future_callbacks_at_exit", 2, script=_SELF)
    for r in results:
        assert "terminate called" not in r.err, r.tail()
    assert_all_ok(results, "future_callbacks_at_exit")


@pytest.mark.timeout(120)
def test_init_methods_and_reinit() -> None:
    ports = tuple(map(str, free_ports(5)))
    assert_all_ok(launch("init_methods", 2, script=_SELF, args=ports), "init_methods")


# ------------------------------------------------------------------------------------ scenarios

def scenario_init_methods(*ports: str) -> None:
    import tempfile
    import threading

    import numpy as np
    import torch
    import torch.distributed as dist

    import tensorwire as tw
    import tensorwire.torch  # noqa: F401
    from tensorwire.torch import ProcessGroupTensorwire

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tcp_port, store_port, tw_port, store2_port, solo_port = map(int, ports)

    def exercise(tag: str) -> None:
        assert isinstance(dist.distributed_c10d._get_default_group(), ProcessGroupTensorwire), tag
        assert "tensorwire" in dist.get_backend(), (tag, dist.get_backend())
        t = torch.full((5,), float(rank + 1))
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((5,), float(size * (size + 1) // 2))), (tag, t)
        sub = dist.new_group([0, 1])
        outs = [torch.zeros(2) for _ in range(2)]
        dist.all_gather(outs, torch.full((2,), float(rank)), group=sub)
        assert [o[0].item() for o in outs] == [0.0, 1.0], (tag, outs)
        # tensorwire's own API runs on the same world, over the same connections
        x = np.full(3, rank + 1, dtype=np.int64)
        tw.all_reduce(x)
        assert x.tolist() == [3, 3, 3], (tag, x)
        # a receive posted before its send, through its future: the rank's progress thread and
        # the future's helper thread run, and destroy must have ended both when it returns (a
        # daemon thread that frees a torch Work as the interpreter exits aborts the process)
        got = torch.zeros(4)
        if rank == 0:
            fut = dist.irecv(got, 1).get_future()
            dist.barrier()
            fut.wait()
            assert torch.equal(got, torch.arange(4.0)), (tag, got)
        elif rank == 1:
            dist.barrier()
            dist.send(torch.arange(4.0), 0)
        dist.destroy_process_group()
        assert not tw.is_initialized(), f"{tag}: tensorwire still initialized after destroy"
        left = [t.name for t in threading.enumerate() if t.name.startswith("tensorwire")]
        assert not left, f"{tag}: threads still running after destroy_process_group(): {left}"

    # env:// (MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE), the default init method
    dist.init_process_group("tensorwire")
    exercise("env://")
    # tcp:// with explicit rank and size, and the device-map syntax
    dist.init_process_group("cpu:tensorwire", init_method=f"tcp://127.0.0.1:{tcp_port}", rank=rank,
                            world_size=size)
    exercise("tcp://")
    # file:// (a fresh file both ranks agree on)
    path = os.path.join(tempfile.gettempdir(), f"tw-torch-filestore-{tcp_port}")
    dist.init_process_group("tensorwire", init_method=f"file://{path}", rank=rank, world_size=size)
    exercise("file://")
    # an explicit store object
    store = dist.TCPStore("127.0.0.1", store_port, size, is_master=rank == 0)
    dist.init_process_group("tensorwire", store=store, rank=rank, world_size=size)
    exercise("store=")
    # a user who initialized tensorwire first: torch's world reuses it instead of a second one
    tw.init(rank=rank, world_size=size, init_method=f"tcp://127.0.0.1:{tw_port}")
    store = dist.TCPStore("127.0.0.1", store2_port, size, is_master=rank == 0)
    dist.init_process_group("tensorwire", store=store, rank=rank, world_size=size)
    pg = dist.distributed_c10d._get_default_group()
    assert pg.tensorwire_group is tw.world()
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), float(size)))
    dist.destroy_process_group()
    assert tw.is_initialized(), "torch must not destroy a tensorwire world it did not create"
    tw.destroy()
    if rank == 0:  # a world of one process
        dist.init_process_group("tensorwire", init_method=f"tcp://127.0.0.1:{solo_port}", rank=0,
                                world_size=1)
        t = torch.ones(2)
        dist.all_reduce(t)
        dist.barrier()
        assert torch.equal(t, torch.ones(2))
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_rank_that_comes_after_rank_0_left_is_told_why() -> None:
    """Under `tensorwire run --keep-going`, rank 1 came after rank 0 had waited its 3 s and
    exited: it then tried rank 0's torch store for 13 s more and ended in torch's bare 'client
    socket has timed out' (DistNetworkError). It now fails at once, naming rank 0's exit."""
    argv = [str(BIN / "tensorwire"), "run", "--keep-going", "-n", "2", str(_SELF), "late_rank"]
    result = run_command(argv, env=clean_env(), timeout=100)
    text = result.out + result.err
    assert "rank 1: init_process_group: torch's store, which rank 0 hosts under tensorwire run, cannot be " \
           "reached: rank 0" in text, text[-4000:]
    assert "late_rank OK" in result.out, text[-4000:]


def scenario_late_rank() -> None:
    import time
    from datetime import timedelta

    import torch.distributed as dist

    import tensorwire.torch  # noqa: F401
    from tensorwire.errors import RendezvousError

    if os.environ["RANK"] == "0":
        try:
            dist.init_process_group("tensorwire", timeout=timedelta(seconds=3))
        except TimeoutError:
            return  # (it never printed OK: the launcher sees rank 0 end, and tells the store)
    time.sleep(6)
    try:
        dist.init_process_group("tensorwire", timeout=timedelta(seconds=3))
    except RendezvousError as exc:  # (torch's DistNetworkError, 13 s later, before)
        print(exc, flush=True)


def scenario_torch_store_address() -> None:
    import torch
    import torch.distributed as dist

    import tensorwire.torch  # noqa: F401

    dist.init_process_group("tensorwire")
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if dist.get_rank() == 0:  # the store's host: where its listening socket is bound
        bound = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    local, state = line.split()[1], line.split()[3]
                    address, port = local.rsplit(":", 1)
                    if state == "0A" and int(port, 16) == store.port:
                        bound.append(address)
        assert bound == ["0100007F"], f"torch's store on port {store.port} listens on {bound}"
    t = torch.ones(2)
    dist.all_reduce(t)  # the store served both ranks
    assert torch.equal(t, torch.full((2,), 2.0))
    dist.destroy_process_group()


def scenario_future_callbacks_at_exit() -> None:
    import time

    import torch
    import torch.distributed as dist

    import tensorwire.torch  # noqa: F401

    dist.init_process_group("tensorwire")
    rank = dist.get_rank()
    for tag in range(3):  # receives nobody sends to, whose futures' callbacks are slow
        dist.irecv(torch.zeros(4), 1 - rank, tag=300 + tag).get_future().then(lambda f: time.sleep(1.0))
    print("future_callbacks_at_exit OK", flush=True)  # and exit with them pending


if __name__ == "__main__":
    from test_torch_backend import run_scenario  # the script's folder is on sys.path

    run_scenario(globals())
