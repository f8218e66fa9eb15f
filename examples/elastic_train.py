"""Elastic training: checkpoint, get killed, be restarted by torchrun, resume, same result.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/elastic_train.py \\
        --kill-rank 1 --kill-at 12

torchrun restarts every rank of a job in which one failed (up to --max-restarts times); each
attempt starts from scratch, so training must resume from a checkpoint. Here rank 0 saves the
model and optimizer every --checkpoint-every steps (written aside, then renamed: a crash never
leaves half a file), every rank of a restarted attempt loads it at start (the first attempt
removes one an earlier run left), and a step's data depends only on the step
and the rank, so a resumed run sees exactly the batches the lost one would have. With
--kill-rank, that rank exits abruptly at --kill-at in the first attempt; its peer gets a
PeerLostError within seconds (tensorwire notices the closed connection), and torchrun starts
both again. At the end rank 0 replays the whole training in one process and checks that the
weights are those of a run that never failed.

To go on without a restart instead (the survivors only), see tensorwire.shrink() in
docs/failures.md.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import tensorwire.torch  # noqa: F401 - registers the "tensorwire" backend

FEATURES = 8


def batch(step: int, rank: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch of `step`: a function of both alone, so a resumed run sees it again."""
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(size, FEATURES, generator=gen, dtype=torch.float64)
    teacher = torch.arange(1, FEATURES + 1, dtype=torch.float64).reshape(FEATURES, 1) / FEATURES
    return x, x @ teacher + 0.1 * torch.randn(size, 1, generator=gen, dtype=torch.float64)


def new_model(lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 1).double()
    return model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def save(path: str, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    tmp = f"{path}.tmp"
    torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, tmp)
    os.replace(tmp, path)


def replay(steps: int, world: int, lr: float) -> torch.Tensor:
    """The same training in one process: each step's gradient averaged over every rank's batch."""
    model, opt = new_model(lr)
    for step in range(steps):
        opt.zero_grad()
        for rank in range(world):
            x, y = batch(step, rank)
            (nn.functional.mse_loss(model(x), y) / world).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--checkpoint", default="elastic_checkpoint.pt")
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--kill-rank", type=int, default=-1,
                        help="this rank exits abruptly in the first attempt")
    parser.add_argument("--kill-at", type=int, default=-1, help="at this step")
    args = parser.parse_args()

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("tensorwire")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = new_model(args.lr)
    ddp = DDP(model)
    start = 0
    if attempt == 0:  # a checkpoint there is an earlier run's: start fresh (later attempts resume)
        if rank == 0 and os.path.exists(args.checkpoint):
            os.remove(args.checkpoint)
            print(f"removed {args.checkpoint} of an earlier run: the first attempt starts from step 0",
                  flush=True)
        dist.barrier()
    if os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint, map_location="cpu")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        if rank == 0:
            print(f"resumed from step {start} (attempt {attempt})", flush=True)

    for step in range(start, args.steps):
        if attempt == 0 and rank == args.kill_rank and step == args.kill_at:
            print(f"rank {rank}: killed at step {step} (attempt {attempt})", flush=True)
            os._exit(1)  # no goodbye: the peer sees a crash
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()  # DDP averages the gradients over the ranks
        opt.step()
        if (step + 1) % args.checkpoint_every == 0 and rank == 0:
            save(args.checkpoint, step + 1, model, opt)  # before its next gradient: no rank passes it

    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if rank == 0:
        same = torch.allclose(weights, replay(args.steps, world, args.lr), rtol=1e-12, atol=1e-12)
        print(f"final weights {[round(w, 6) for w in weights.tolist()]}; equal to a run without failures: "
              f"{same}", flush=True)
        if not same:
            raise SystemExit("the resumed training diverged from the replay")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
