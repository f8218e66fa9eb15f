"""Train an MLP split into pipeline stages, one per rank, on a 1F1B schedule: activations go
forward and their gradients back as point-to-point messages through torch.distributed.

    tensorwire run -n 4 examples/pipeline_train.py
    torchrun --nproc-per-node 4 examples/pipeline_train.py
    torchrun --nproc-per-node 4 examples/pipeline_train.py --backend gloo   # the same run on Gloo
    torchrun --nproc-per-node 2 examples/pipeline_train.py --device cuda    # on GPUs (may share one)

Each step splits a batch into micro-batches. Stage s runs S - s - 1 forwards first, then
alternates one forward and one backward, then finishes the backwards (1F1B): at most S
micro-batches' activations are held per stage. A forward's output and the next backward's
gradient cross in one `batch_isend_irecv`, so neighbours never wait on each other's sends.

After the timed steps every rank trains the whole model alone on the same data (`--no-check`
skips it): each stage's parameters and the last stage's losses must match that single-process
run. The exit status says whether they did.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import tensorwire.torch  # noqa: F401 - registers the "tensorwire" backend

FEATURES = 32


def build(stages: int, hidden: int) -> list[nn.Sequential]:
    """The whole model as per-stage blocks, the same on every rank (seeded): two layers a stage."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(FEATURES, hidden), nn.ReLU()]
    for _ in range(2 * stages - 2):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    layers.append(nn.Linear(hidden, 1))
    per = [layers[4 * s: 4 * s + 4] for s in range(stages)]
    per[-1] = layers[4 * (stages - 1):]
    return [nn.Sequential(*p) for p in per]


def batch(step: int, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s inputs and targets, the same on every rank."""
    gen = torch.Generator().manual_seed(step)
    teacher = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(12345))
    x = torch.randn(size, FEATURES, generator=gen)
    y = torch.tanh(x @ teacher / FEATURES ** 0.5) + 0.01 * torch.randn(size, 1, generator=gen)
    return x.to(device), y.to(device)


class Stage:
    """One rank's part of the pipeline: its blocks, and the micro-batches in flight."""

    def __init__(self, block: nn.Module, rank: int, world: int, micro: int, hidden: int,
                 device: torch.device) -> None:
        self.block, self.rank, self.world = block, rank, world
        self.first, self.last = rank == 0, rank == world - 1
        self.shape, self.device = (micro, hidden), device
        self.held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # micro-batch -> (input, output)

    def exchange(self, send: torch.Tensor | None = None, to: int | None = None,
                 frm: int | None = None) -> torch.Tensor | None:
        """Send `send` to rank `to` and receive a tensor from rank `frm`, in one batch (either
        may be absent: None): the neighbours' messages cross without either waiting for the other."""
        ops, got = [], None
        if send is not None and to is not None:
            ops.append(dist.P2POp(dist.isend, send.contiguous(), to))
        if frm is not None:
            got = torch.empty(self.shape, device=self.device)
            ops.append(dist.P2POp(dist.irecv, got, frm))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return got

    def forward(self, i: int, x: torch.Tensor, y: torch.Tensor, micro_batches: int) -> torch.Tensor:
        if not self.first:
            x.requires_grad_(True)
        out = self.block(x)
        if self.last:  # a micro-batch's share of the batch's mean loss
            out = nn.functional.mse_loss(out, y) / micro_batches
        self.held[i] = (x, out)
        return out

    def backward(self, i: int, grad: torch.Tensor | None) -> torch.Tensor | None:
        x, out = self.held.pop(i)
        torch.autograd.backward(out, grad)
        return None if self.first else x.grad

    def step(self, xs: list[torch.Tensor], ys: list[torch.Tensor]) -> float:
        """One 1F1B step over the micro-batches; the batch's loss on the last stage (else 0)."""
        m = len(xs)
        prev = None if self.first else self.rank - 1
        nxt = None if self.last else self.rank + 1
        warm = min(self.world - self.rank - 1, m)
        losses: list[float] = []

        def forward(i: int, x: torch.Tensor | None) -> torch.Tensor:
            out = self.forward(i, xs[i] if x is None else x, ys[i], m)
            if self.last:
                losses.append(out.item())
            return out

        for i in range(warm):
            self.exchange(forward(i, self.exchange(frm=prev)).detach(), to=nxt)
        x = self.exchange(frm=prev) if warm < m else None
        for j in range(m - warm):
            out = forward(warm + j, x)
            # send this output on, take the gradient of micro-batch j back
            gx = self.backward(j, self.exchange(out.detach(), to=nxt, frm=nxt))
            # send its input's gradient back, take the next micro-batch's input
            x = self.exchange(gx, to=prev, frm=prev if j < m - warm - 1 else None)
        for j in range(m - warm, m):
            self.exchange(self.backward(j, self.exchange(frm=nxt)), to=prev)
        return sum(losses)


def reference(blocks: list[nn.Sequential], steps: int, size: int, micro_batches: int, lr: float,
              device: torch.device) -> list[float]:
    """The same training in one process on the whole model (`blocks`, trained in place): the
    losses it saw."""
    model = nn.Sequential(*blocks).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = batch(step, size, device)
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
            loss = nn.functional.mse_loss(model(xm), ym) / micro_batches
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="tensorwire")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=32, help="samples in a micro-batch")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: rank r on GPU r %% device_count (several ranks may share one)")
    parser.add_argument("--no-check", dest="check", action="store_false",
                        help="skip the single-process run the losses and parameters are checked against")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (torch.cuda.is_available() is False)")

    dist.init_process_group(args.backend)  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)

    blocks = build(world, args.hidden)
    stage = Stage(copy.deepcopy(blocks[rank]).to(device), rank, world, args.micro_batch, args.hidden, device)
    opt = torch.optim.SGD(stage.block.parameters(), lr=args.lr)
    m, size = args.micro_batches, args.micro_batches * args.micro_batch
    warm = min(3, args.steps - 1)  # steps before the clock starts
    losses, start = [], time.perf_counter()
    for step in range(args.steps):
        if step == warm:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        x, y = batch(step, size, device)
        opt.zero_grad()
        losses.append(stage.step(list(x.chunk(m)), list(y.chunk(m))))
        opt.step()
        if stage.last and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {losses[-1]:.5f}", flush=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    per_step = (time.perf_counter() - start) / (args.steps - warm) * 1e3

    verdict = ""
    if args.check:
        trained = copy.deepcopy(blocks)
        alone = reference(trained, args.steps, size, m, args.lr, device)
        mine = torch.cat([p.detach().reshape(-1) for p in stage.block.parameters()])
        want = torch.cat([p.detach().reshape(-1) for p in trained[rank].parameters()])
        diff = float((mine - want).abs().max() / want.abs().max())
        if stage.last:
            diff = max(diff, max(abs(a - b) / abs(b) for a, b in zip(losses, alone, strict=True)))
        worst = torch.tensor([diff], device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        ok = worst.item() <= 1e-5
        verdict = f"; matches a single-process run: {ok} (largest relative difference {worst.item():.1e})"
    if stage.last:
        print(f"{args.backend}: {world} stages on {args.device}, {m} micro-batches of {args.micro_batch}, "
              f"{per_step:.1f} ms a step after {warm}; final loss {losses[-1]:.6f}{verdict}", flush=True)
    dist.destroy_process_group()
    if args.check and not ok:
        raise SystemExit(f"rank {rank}: the pipeline's training differs from the single-process run")


if __name__ == "__main__":
    main()
