"""Training through torch.distributed on tensorwire: DDP (2 and 4 ranks), FSDP2, DeviceMesh.

Every run trains the same seeded model twice in the same processes, once on the tensorwire
default group and once on a Gloo group over the same ranks, and compares: the loss curves must
match within float tolerance and, on tensorwire, every rank's parameters must be identical
after every step. The DDP run also checks that bucket all-reduces overlap backward: the first
bucket's all-reduce starts on tensorwire's worker thread before backward has handed over the
last bucket.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from test_torch_backend import assert_all_ok, launch

from cluster import free_port

pytest.importorskip("torch")


@pytest.mark.timeout(120)
def test_ddp_fsdp2_two_ranks() -> None:
    # the Gloo world's store gets a port of its own (MASTER_PORT + 1 was once taken: EADDRINUSE)
    assert_all_ok(launch("train", 2, script=_SELF, GLOO_PORT=str(free_port()), TENSORWIRE_COMPRESS="bf16"),
                  "train")


@pytest.mark.timeout(120)
def test_powersgd_with_several_buckets_trains_or_says_why() -> None:
    """PowerSGD's hook makes calls in its futures' callbacks while DDP's next buckets come from
    backward: their order is a matter of timing (Gloo hangs). Every rank trains to the same
    parameters, or raises an error: the interleaving seen on this rank, or the different
    calls the ranks paired; never a hang."""
    assert_all_ok(launch("powersgd_buckets", 2, script=_SELF), "powersgd_buckets")


@pytest.mark.timeout(120)
def test_torch_compile_of_ddp_and_of_calls() -> None:
    """torch.compile(DDP(model)) failed at its second step, and a compiled function calling
    dist.broadcast or dist.barrier at once: Dynamo traced the backend's Python methods (called
    by the C++ reducer from the compiled forward, or inlined) and met the process group as an
    opaque object. They now run eagerly, as Gloo's C++ ones do."""
    assert_all_ok(launch("compiled", 2, script=_SELF), "compiled")


@pytest.mark.timeout(120)
def test_ddp_four_ranks() -> None:
    assert_all_ok(launch("ddp4", 4, script=_SELF), "ddp4")


# ------------------------------------------------------------------------------------ scenarios

def _mlp(width: int = 64, depth: int = 5, seed: int = 0):
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    layers: list = [nn.Linear(16, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 4))
    return nn.Sequential(*layers)


def _flat_params(model):
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _identical_everywhere(flat, gloo) -> bool:
    import torch
    import torch.distributed as dist

    copies = [torch.zeros_like(flat) for _ in range(dist.get_world_size(gloo))]
    dist.all_gather(copies, flat, group=gloo)
    return all(torch.equal(c, copies[0]) for c in copies)


def _train_ddp(group, gloo, *, steps: int, hook=None, state=None, **ddp_kwargs) -> tuple[list[float], object]:
    """Train a seeded MLP with DDP on `group` (its comm hook's state: `state`, else the group);
    check parameters agree on all ranks each step."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _mlp()
    ddp = DDP(model, process_group=group, **ddp_kwargs)
    if hook is not None:
        ddp.register_comm_hook(group if state is None else state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    losses = []
    for step in range(steps):
        x = torch.randn(32, 16, generator=gen)
        y = torch.randn(32, 4, generator=gen)
        loss = F.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        assert _identical_everywhere(_flat_params(model), gloo), f"parameters differ after step {step}"
    return losses, _flat_params(model)


def _compare_with_gloo(name: str, tw_result, gloo_result, *, rtol: float = 1e-5) -> None:
    import torch

    (tw_losses, tw_params), (gl_losses, gl_params) = tw_result, gloo_result
    assert torch.allclose(torch.tensor(tw_losses), torch.tensor(gl_losses), rtol=rtol, atol=1e-7), \
        f"{name}: loss curves differ:\n tensorwire {tw_losses}\n gloo       {gl_losses}"
    assert torch.allclose(tw_params, gl_params, rtol=rtol * 10, atol=1e-6), f"{name}: final parameters differ"


def _check_overlap(gloo) -> None:
    """Bucket all-reduces run on tensorwire's worker while backward still computes later buckets."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    pg = dist.distributed_c10d._get_default_group()
    g = pg.tensorwire_group
    events: list[tuple[str, float, str]] = []
    submit = g.queue.submit

    def recording_submit(fp, what, body, async_op, timeout, *args):
        if what != "all_reduce":
            return submit(fp, what, body, async_op, timeout, *args)
        events.append(("submit", time.perf_counter(), "async" if async_op else "sync"))

        def recorded(call, *body_args):
            events.append(("start", time.perf_counter(), threading.current_thread().name))
            return body(call, *body_args)

        return submit(fp, what, recorded, async_op, timeout, *args)

    model = _mlp(width=256, depth=8)  # ~0.5M parameters in ~0.25 MB buckets: several buckets
    ddp = DDP(model, bucket_cap_mb=0.25)
    gen = torch.Generator().manual_seed(7)
    # 4096 rows: the backward takes ~38 ms (64 rows took ~1 ms, less than Python's 5 ms GIL
    # switch interval, and the worker sometimes got the GIL only after the last bucket)
    x, y = torch.randn(4096, 16, generator=gen), torch.randn(4096, 4, generator=gen)
    F.mse_loss(ddp(x), y).backward()  # first step: DDP rebuilds its buckets
    ddp.zero_grad()
    g.queue.submit = recording_submit
    try:
        F.mse_loss(ddp(x), y).backward()
    finally:
        del g.queue.submit
    submits = [e for e in events if e[0] == "submit"]
    starts = [e for e in events if e[0] == "start"]
    assert len(submits) >= 3, f"expected several DDP buckets, got {len(submits)}: {events}"
    assert all(e[2] == "async" for e in submits), events
    assert all(e[2].startswith("tensorwire-group") for e in starts), f"not on the worker: {starts}"
    assert starts[0][1] < submits[-1][1], \
        f"the first bucket's all-reduce started only after the last bucket was handed over: {events}"
    assert _identical_everywhere(_flat_params(model), gloo)


def _train_sparse(group, steps: int = 4):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(100, 8, mode="sum", sparse=True), nn.Linear(8, 1))
    ddp = DDP(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(steps):
        loss = ddp(torch.randint(0, 100, (8, 5), generator=gen)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, _flat_params(model)


def _fit(model, seed: int, steps: int) -> list[float]:
    """Adam on random regressions (16 inputs to 4 outputs), a generator per rank: the losses."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 16, generator=gen), torch.randn(16, 4, generator=gen)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _train_fsdp2(mesh, steps: int) -> tuple[list[float], object]:
    import torch
    from torch.distributed.fsdp import fully_shard

    model = _mlp(width=48, depth=4, seed=3)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses = _fit(model, 200, steps)
    full = torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()])  # DTensor gather
    return losses, full


def _train_fsdp1(group, steps: int) -> tuple[list[float], object]:
    """torch's first FSDP, FULL_SHARD: it frees the gathered parameters by resizing their
    storage to 0 after each use (a storage numpy had viewed could not be resized)."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    model = FSDP(_mlp(width=48, depth=4, seed=4), process_group=group, device_id=torch.device("cpu"),
                 sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=True)
    losses = _fit(model, 300, steps)
    with FSDP.summon_full_params(model):
        full = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    return losses, full


def scenario_train() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.device_mesh import init_device_mesh

    import tensorwire.torch  # noqa: F401

    dist.init_process_group("tensorwire")
    gloo = dist.new_group(backend="gloo")
    steps = 6
    _compare_with_gloo("DDP", _train_ddp(None, gloo, steps=steps), _train_ddp(gloo, gloo, steps=steps))
    variant = dict(bucket_cap_mb=0.01, gradient_as_bucket_view=True, static_graph=True)
    _compare_with_gloo("DDP small buckets, bucket views, static graph",
                       _train_ddp(None, gloo, steps=steps, **variant),
                       _train_ddp(gloo, gloo, steps=steps, **variant))
    # comm hooks chain on the Work's future (bf16_compress_hook needs NCCL: not on CPU)
    for hook in (default_hooks.allreduce_hook, default_hooks.fp16_compress_hook):
        _compare_with_gloo(f"DDP {hook.__name__}", _train_ddp(None, gloo, steps=steps, hook=hook),
                           _train_ddp(gloo, gloo, steps=steps, hook=hook), rtol=1e-3)
    # PowerSGD's hook waits, inside the then-callback that runs where a Work completed (the
    # group's worker), for the future of an all_reduce it queued on the same group
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    def power(g):
        return powersgd.PowerSGDState(process_group=g, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                      min_compression_rate=0.5)

    _compare_with_gloo("DDP powerSGD_hook",
                       _train_ddp(None, gloo, steps=steps, hook=powersgd.powerSGD_hook, state=power(None)),
                       _train_ddp(gloo, gloo, steps=steps, hook=powersgd.powerSGD_hook, state=power(gloo)),
                       rtol=1e-3)
    # tensorwire's compress hook, and TENSORWIRE_COMPRESS=bf16 (the test sets it): asked for, and
    # on one host (nothing crosses between hosts) exact
    _compare_with_gloo("DDP bf16_allreduce_hook",
                       _train_ddp(None, gloo, steps=steps, hook=tensorwire.torch.bf16_allreduce_hook),
                       _train_ddp(gloo, gloo, steps=steps))
    choices = dist.distributed_c10d._get_default_group().tensorwire_group.choices
    dist.all_reduce(torch.ones(10))
    dist.all_reduce(torch.ones(10, dtype=torch.int64))
    assert choices.get(("all_reduce", 40, "bf16")) is False and ("all_reduce", 80, "bf16") not in choices
    with dist._coalescing_manager():  # coalesced all_reduces are asked to compress too (they were not)
        dist.all_reduce(torch.ones(10))
        dist.all_reduce(torch.ones(14))
    assert choices.get(("all_reduce", 96, "bf16")) is False, choices
    _check_overlap(gloo)
    # sparse gradients (an embedding bag): DDP all-reduces sparse COO tensors
    _compare_with_gloo("DDP sparse embedding", _train_sparse(None), _train_sparse(gloo))

    _compare_with_gloo("FSDP FULL_SHARD", _train_fsdp1(None, steps), _train_fsdp1(gloo, steps))
    # FSDP2 on a 1-D mesh of the tensorwire world, then the same on a Gloo world
    tw = _train_fsdp2(init_device_mesh("cpu", (dist.get_world_size(),)), steps)
    dist.destroy_process_group()
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['GLOO_PORT']}",
                            rank=rank, world_size=size)
    gl = _train_fsdp2(init_device_mesh("cpu", (size,)), steps)
    _compare_with_gloo("FSDP2", tw, gl)
    dist.destroy_process_group()


def scenario_powersgd_buckets() -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    import tensorwire.torch  # noqa: F401

    dist.init_process_group("tensorwire")
    gloo = dist.new_group(backend="gloo")
    model = _mlp(width=128, depth=8)
    ddp = DDP(model, bucket_cap_mb=0.01)  # a bucket for every layer or two
    ddp.register_comm_hook(powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                                  start_powerSGD_iter=2, min_compression_rate=0.5),
                           powersgd.powerSGD_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    try:
        for _ in range(8):
            F.mse_loss(ddp(torch.randn(32, 16, generator=gen)), torch.randn(32, 4, generator=gen)).backward()
            opt.step()
            opt.zero_grad()
    except RuntimeError as exc:
        assert "done-callback" in str(exc) or "made a different call" in str(exc), exc
    else:
        assert _identical_everywhere(_flat_params(model), gloo)


def scenario_ddp4() -> None:
    import torch.distributed as dist

    import tensorwire.torch  # noqa: F401

    dist.init_process_group("tensorwire")
    gloo = dist.new_group(backend="gloo")
    steps = 5
    _compare_with_gloo("DDP 4 ranks", _train_ddp(None, gloo, steps=steps),
                       _train_ddp(gloo, gloo, steps=steps))
    # DDP over a 2-rank tensorwire sub-group of the 4 (two independent replicas)
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    gloo_pairs = [dist.new_group([0, 1], backend="gloo"), dist.new_group([2, 3], backend="gloo")]
    mine, mine_gloo = pairs[rank // 2], gloo_pairs[rank // 2]
    tw = _train_ddp(mine, mine_gloo, steps=steps, find_unused_parameters=True)
    gl = _train_ddp(mine_gloo, mine_gloo, steps=steps, find_unused_parameters=True)
    _compare_with_gloo("DDP on sub-groups", tw, gl)
    dist.destroy_process_group()


def scenario_compiled() -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import tensorwire.torch  # noqa: F401

    dist.init_process_group("tensorwire")
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    losses = {}
    for name, group in (("tensorwire", None), ("gloo", gloo)):
        model = _mlp(width=8, depth=2)
        ddp = torch.compile(DDP(model, process_group=group), backend="eager")
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        torch.manual_seed(rank)
        losses[name] = []
        for _ in range(3):
            opt.zero_grad()
            loss = ddp(torch.randn(4, 16)).square().mean()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
        if name == "tensorwire":
            assert _identical_everywhere(_flat_params(model), gloo)
    assert losses["tensorwire"] == pytest.approx(losses["gloo"], rel=1e-6), losses

    @torch.compile(backend="eager")
    def calls(x):
        dist.broadcast(x, src=1)
        dist.barrier()
        dist.all_reduce(x)
        return x * 2

    assert calls(torch.full((3,), float(rank))).tolist() == [4.0] * 3  # rank 1's 1.0, summed, doubled
    dist.destroy_process_group()


_SELF = __import__("pathlib").Path(__file__).resolve()

if __name__ == "__main__":
    from test_torch_backend import run_scenario  # the script's folder is on sys.path

    run_scenario(globals())
