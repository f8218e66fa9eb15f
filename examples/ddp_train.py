"""Train a small MLP with DistributedDataParallel, tensorwire moving the gradients.

    torchrun --nproc-per-node 2 examples/ddp_train.py
    tensorwire run -n 2 examples/ddp_train.py
    torchrun --nproc-per-node 2 examples/ddp_train.py --backend gloo     # the same run on Gloo
    torchrun --nproc-per-node 2 examples/ddp_train.py --device cuda      # on GPUs (ranks may share one)

The only tensorwire-specific lines are `import tensorwire.torch` and the backend name.
At the end every rank checks that its parameters equal rank 0's (DDP keeps them identical).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import tensorwire.torch  # noqa: F401 - registers the "tensorwire" backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="tensorwire")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: rank r trains on GPU r %% device_count (several ranks may share one)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")

    dist.init_process_group(args.backend)  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    model = nn.Sequential(nn.Linear(32, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden),
                          nn.ReLU(), nn.Linear(args.hidden, 1)).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    teacher = torch.randn(32, 1).to(device)

    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard of the data
    warm = min(3, args.steps - 1)  # steps before the clock starts (first kernels, DDP's first pass)
    start = time.perf_counter()
    for step in range(args.steps):
        if step == warm:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        x = torch.randn(args.batch, 32, generator=gen).to(device)
        y = x @ teacher + 0.01 * torch.randn(args.batch, 1, generator=gen).to(device)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()  # gradients are averaged across ranks while backward runs
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # (tensorwire also has ReduceOp.AVG; Gloo does not)
        mean_loss /= world
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {mean_loss.item():.5f}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    same = torch.equal(flat, reference)
    if rank == 0:
        per_step = elapsed / (args.steps - warm) * 1e3
        print(f"{args.backend}: {world} ranks on {args.device}, {args.steps} steps, {per_step:.1f} ms a step "
              f"after {warm}; final loss {mean_loss.item():.6f}; parameters identical on every rank: {same}",
              flush=True)
    dist.destroy_process_group()
    if not same:
        raise SystemExit(f"rank {rank}: parameters differ from rank 0's")


if __name__ == "__main__":
    main()
