"""Failures through torch.distributed: tensorwire's errors, raised on every rank, never a hang.

torch's own debug wrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL) does not cover Python backends, so
these checks are the only ones a tensorwire process group has: mismatched collectives (count,
op, kind), bad arguments, timeouts, a failure inside DDP's backward, and a peer that dies.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from test_torch_backend import assert_all_ok, launch

pytest.importorskip("torch")

_SELF = Path(__file__).resolve()


@pytest.mark.timeout(120)
def test_mismatch_invalid_timeout_and_ddp_failure() -> None:
    assert_all_ok(launch("errors", 2, script=_SELF), "errors")


@pytest.mark.timeout(120)
def test_dead_peer_inside_ddp() -> None:
    results = launch("dead_peer", 2, script=_SELF, timeout=90)
    survivor, dead = results
    assert dead.rc == 17, dead.tail()
    assert survivor.rc == 0 and "dead_peer OK" in survivor.out, survivor.tail()


@pytest.mark.timeout(60)
def test_a_rank_with_another_world_size_on_torchs_store() -> None:
    """A store passed to init_process_group skipped the roster's checks: a third process that
    thought the world had 3 ranks failed with 'ValueError: 2 is not in list' from deep inside;
    now the RendezvousError of any other store, at once, and the world of two runs."""
    from cluster import free_port

    results = launch("world_sizes", 3, script=_SELF, args=(str(free_port()),), timeout=50)
    assert all(r.rc == 0 for r in results), [r.tail() for r in results]


# ------------------------------------------------------------------------------------ scenarios

def scenario_world_sizes(port: str) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import tensorwire.torch  # noqa: F401
    from tensorwire import RendezvousError

    rank = int(os.environ["RANK"])
    size = 3 if rank == 2 else 2
    if rank == 2:
        time.sleep(1)  # ranks 0 and 1 first: rank 0 has published its world's size
    store = dist.TCPStore("127.0.0.1", int(port), size, rank == 0, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    if rank == 2:
        exc = _expect(RendezvousError, lambda: dist.init_process_group(
            "tensorwire", store=store, rank=rank, world_size=size, timeout=datetime.timedelta(seconds=20)),
            contains="world size mismatch: rank 2 was started with world_size=3 but rank 0 with world_size=2",
            within=5)
        assert exc is not None
        return
    dist.init_process_group("tensorwire", store=store, rank=rank, world_size=size)
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), 2.0)), t
    time.sleep(2)  # rank 2 has read the store
    dist.destroy_process_group()


def _expect(exc_types, fn, *, contains: str = "", within: float | None = None):
    """Run fn; it must raise one of exc_types (message containing `contains`) within `within` s."""
    start = time.monotonic()
    try:
        fn()
    except exc_types as exc:
        elapsed = time.monotonic() - start
        assert contains in str(exc), f"{type(exc).__name__} without {contains!r}: {exc}"
        assert within is None or elapsed < within, f"raised after {elapsed:.1f} s (limit {within} s)"
        return exc
    raise AssertionError(f"{fn} did not raise {exc_types}")


def _ddp_step(ddp, opt, gen):
    import torch
    import torch.nn.functional as F

    x, y = torch.randn(16, 16, generator=gen), torch.randn(16, 4, generator=gen)
    loss = F.mse_loss(ddp(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def scenario_errors() -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import tensorwire.torch  # noqa: F401
    from tensorwire import CollectiveMismatchError, InvalidArgumentError, TensorwireError
    from tensorwire import TimeoutError as TwTimeoutError

    dist.init_process_group("tensorwire")
    rank = dist.get_rank()

    # count mismatch: both ranks raise, naming the collective and the difference
    g = dist.new_group()
    exc = _expect(CollectiveMismatchError, lambda: dist.all_reduce(torch.ones(4 + rank), group=g),
                  contains="all_reduce", within=10)
    assert "count" in str(exc) and f"rank {rank}" in str(exc), exc
    # the failed group stays failed (its messages may be half-delivered); the world still works
    _expect(CollectiveMismatchError, lambda: dist.all_reduce(torch.ones(4), group=g), within=1)
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), 2.0))

    # op mismatch and collective mismatch
    g = dist.new_group()
    op = dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX
    _expect(CollectiveMismatchError, lambda: dist.all_reduce(torch.ones(4), op=op, group=g), contains="op",
            within=10)
    g = dist.new_group()

    def different_collectives():
        if rank == 0:
            dist.all_reduce(torch.ones(4), group=g)
        else:
            dist.all_gather([torch.zeros(2), torch.zeros(2)], torch.ones(2), group=g)

    _expect(CollectiveMismatchError, different_collectives, within=10)

    # an async collective: wait() raises tensorwire's error; its future carries the message
    g = dist.new_group()
    work = dist.all_reduce(torch.ones(8 * (rank + 1)), group=g, async_op=True)
    _expect(CollectiveMismatchError, work.wait, within=10)
    assert work.is_completed() and not work.is_success()
    _expect(RuntimeError, work.get_future().wait, contains="CollectiveMismatchError")

    # a bad argument on one rank: it raises InvalidArgumentError, the other rank does not hang
    g = dist.new_group()
    if rank == 0:
        _expect(InvalidArgumentError, lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND, group=g),
                contains="BAND", within=5)
    else:
        _expect(TensorwireError, lambda: dist.all_reduce(torch.ones(4), group=g), contains="BAND", within=10)

    # a tensor tensorwire cannot move (neither on the CPU nor on a GPU): the same, found by the torch layer
    g = dist.new_group()
    if rank == 0:
        _expect(InvalidArgumentError, lambda: dist.all_reduce(torch.empty(4, device="meta"), group=g),
                contains="moves CPU and CUDA tensors, got one on meta", within=5)
    else:
        _expect(TensorwireError, lambda: dist.all_reduce(torch.ones(4), group=g),
                contains="moves CPU and CUDA tensors, got one on meta", within=10)

    # a tensor to write whose elements share memory (expand()): refused on its rank, raised on the
    # other; a broadcast root's such tensor is only read, and goes
    g = dist.new_group()
    if rank == 0:
        _expect(InvalidArgumentError, lambda: dist.all_reduce(torch.ones(1).expand(4), group=g),
                contains="share memory", within=5)
    else:
        _expect(TensorwireError, lambda: dist.all_reduce(torch.ones(4), group=g), contains="share memory",
                within=10)
    t = torch.full((1,), 5.0).expand(3) if rank == 0 else torch.zeros(3)
    dist.broadcast(t, 0, group=g)
    assert torch.equal(t, torch.full((3,), 5.0)), t
    # the backend's argument errors name the rank and the call, as tensorwire's own (they said
    # "rank 0: tensorwire backend: ..."); an integer PREMUL_SUM whose factor is not whole is refused
    # on every rank (each rank's share was cut to an integer before the sum: 0.5 * [3, 4] from each
    # of two ranks gave [2, 4]); a whole factor is exact
    g = dist.new_group()
    exc = _expect(InvalidArgumentError, lambda: dist.all_reduce(torch.ones(1).expand(4), group=g),
                  contains=f"rank {rank}: all_reduce #1 on group ", within=5)
    assert "share memory" in str(exc), exc
    g = dist.new_group()
    for call, number in ((lambda t: dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5), group=g), 1),
                         (lambda t: dist.reduce_scatter_tensor(t[:1], t, op=dist._make_nccl_premul_sum(1.5),
                                                               group=g), 2)):
        exc = _expect(InvalidArgumentError, lambda call=call: call(torch.tensor([3, 4], dtype=torch.int32)),
                      contains="needs a whole-number factor", within=5)
        assert f"rank {rank}: " in str(exc) and f" #{number} on group " in str(exc), exc
    t = torch.tensor([3, 4], dtype=torch.int32)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(3.0))
    assert t.tolist() == [18, 24], t
    # a bool PREMUL_SUM is refused for any factor, in one message on every rank (it said
    # "finalize: PREMUL_SUM is not defined for bool" for 2.0, asked for a whole factor for 0.5)
    g = dist.new_group()
    for number, factor in enumerate((2.0, 0.5, torch.tensor([3.0])), 1):
        exc = _expect(InvalidArgumentError,
                      lambda f=factor: dist.all_reduce(torch.ones(2, dtype=torch.bool),
                                                       op=dist._make_nccl_premul_sum(f), group=g),
                      contains=f"rank {rank}: all_reduce #{number} on group ", within=5)
        assert "PREMUL_SUM is not defined for torch.bool" in str(exc) and "finalize" not in str(exc), exc
    exc = _expect(InvalidArgumentError, lambda: dist.barrier(timeout=timedelta(0)),
                  contains="must be positive")
    assert f"rank {rank}: barrier #" in str(exc), exc

    # a rank that never arrives: the other raises TimeoutError after the group's timeout
    g = dist.new_group(timeout=timedelta(seconds=2))
    if rank == 0:
        exc = _expect(TwTimeoutError, lambda: dist.all_reduce(torch.ones(4), group=g), contains="timed out",
                      within=15)
        assert isinstance(exc, TimeoutError)  # the builtin one too
    dist.barrier()  # rank 1 only now calls, long after rank 0 gave up: it learns why at once
    if rank == 1:
        _expect(TwTimeoutError, lambda: dist.all_reduce(torch.ones(4), group=g), within=5)
    # a timeout passed per call (barrier(timeout=...)); zero or less is an error on every rank
    # (it fell back to the group's timeout, silently)
    g = dist.new_group()
    if rank == 0:
        _expect(TwTimeoutError, lambda: dist.barrier(group=g, timeout=timedelta(seconds=1)), within=10)
    dist.barrier()
    for bad in (timedelta(0), timedelta(seconds=-1)):
        _expect(InvalidArgumentError, lambda bad=bad: dist.barrier(timeout=bad), contains="must be positive")
    _expect(InvalidArgumentError, lambda: dist.new_group(timeout=timedelta(0)),
            contains=f"rank {rank}: new_group: tensorwire backend: timeout must be positive")
    dist.barrier()

    # inside DDP's backward: rank 1 issues an extra all-reduce first (the size of DDP's one bucket,
    # with MAX), so the bucket all-reduces disagree. Every rank gets a Python exception out of
    # backward(): no crash, no hang.
    from test_torch_training import _mlp

    g = dist.new_group()
    model = _mlp()
    ddp = DDP(model, process_group=g)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):  # DDP rebuilds its buckets (a broadcast) in the second step: get past it
        _ddp_step(ddp, opt, gen)
    n = sum(p.numel() for p in model.parameters())
    assert n * 4 < 1 << 20, n  # one bucket (DDP's first is 1 MiB)
    if rank == 1:
        dist.all_reduce(torch.ones(n), op=dist.ReduceOp.MAX, group=g, async_op=True)
    exc = _expect((RuntimeError,), lambda: _ddp_step(ddp, opt, gen), within=20)
    assert "CollectiveMismatchError" in f"{type(exc).__name__}: {exc}", exc
    # the next step fails at once too (the group is aborted), and the world still works
    _expect((RuntimeError,), lambda: _ddp_step(ddp, opt, gen), within=5)
    t = torch.ones(2)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), 2.0))
    # the same with a small extra all-reduce, which the ranks run with a different algorithm
    g = dist.new_group()
    ddp = DDP(_mlp(), process_group=g)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(2):
        _ddp_step(ddp, opt, gen)
    if rank == 1:
        dist.all_reduce(torch.ones(7), group=g, async_op=True)
    exc = _expect((RuntimeError,), lambda: _ddp_step(ddp, opt, gen), within=20)
    assert "CollectiveMismatchError" in f"{type(exc).__name__}: {exc}", exc

    # a rank that stalls inside training: the other one's backward raises TimeoutError after the
    # group's timeout, and the staller's own backward then raises the same error at once
    g = dist.new_group(timeout=timedelta(seconds=2))
    ddp = DDP(_mlp(), process_group=g)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(2):
        _ddp_step(ddp, opt, gen)
    if rank == 0:
        exc = _expect((RuntimeError,), lambda: _ddp_step(ddp, opt, gen), contains="timed out", within=15)
    else:
        time.sleep(5)
        # rank 0's half may already be waiting for it, so this step can still succeed; then the
        # next one raises at once (the group is aborted)
        def two_steps():
            _ddp_step(ddp, opt, gen)
            _ddp_step(ddp, opt, gen)

        exc = _expect((RuntimeError,), two_steps, contains="timed out", within=5)
    assert "TimeoutError" in f"{type(exc).__name__}: {exc}", exc
    dist.barrier()  # rank 0 stays until rank 1 saw it: gone, it would be a PeerLostError there
    dist.destroy_process_group()


def scenario_dead_peer() -> None:
    import torch
    import torch.distributed as dist
    from test_torch_training import _mlp
    from torch.nn.parallel import DistributedDataParallel as DDP

    import tensorwire.torch  # noqa: F401
    from tensorwire import PeerLostError

    dist.init_process_group("tensorwire")
    rank = dist.get_rank()
    ddp = DDP(_mlp())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    _ddp_step(ddp, opt, gen)
    dist.barrier()
    if rank == 1:
        os._exit(17)  # dies without a word: no destroy, no goodbye
    # rank 0: the next backward raises (noticed through the closed socket, not a timeout)
    exc = _expect((RuntimeError,), lambda: _ddp_step(ddp, opt, gen), contains="lost rank 1", within=20)
    assert "PeerLostError" in f"{type(exc).__name__}: {exc}", exc
    _expect(PeerLostError, lambda: dist.all_reduce(torch.ones(2)), within=5)
    # shutting down with a dead peer neither hangs nor raises
    start = time.monotonic()
    dist.destroy_process_group()
    assert time.monotonic() - start < 10


if __name__ == "__main__":
    from test_torch_backend import run_scenario  # the script's folder is on sys.path

    run_scenario(globals())
