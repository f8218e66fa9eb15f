"""Gloo through torch.distributed, timed like tensorwire: a peer of `tensorwire bench --compare`.

Started by `python -m torch.distributed.run --nproc-per-node N -m tensorwire.tools.benchmarks.gloo_runner
...` (see `peer.parse_args` for the arguments), or as the job of `tensorwire run` (across the
emulated hosts of scripts/netns_cluster.py: bench/hosts_sweep.py), whose launcher's store holds
MASTER_PORT: Gloo's store then takes the next port. Buffers are tensorwire's numpy views wrapped
with `torch.from_numpy` (no copies). torch.distributed's all_reduce, broadcast and reduce work
in place only; all_gather_into_tensor, reduce_scatter_tensor, gather and scatter take separate
buffers or, in place, views of one (checked to give nccl-tests' results); all_to_all_single and
isend / irecv separate buffers only.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from . import peer
from .sweep import Case

_BOTH = ("out-of-place", "in-place")
_PLACEMENTS = {"all_reduce": ("in-place",), "broadcast": ("in-place",), "reduce": ("in-place",),
               "all_gather": _BOTH, "reduce_scatter": _BOTH, "gather": _BOTH, "scatter": _BOTH}



def placements(coll: str) -> tuple[str, ...]:
    """The placements this library can express for `coll`, preferred first."""
    return _PLACEMENTS.get(coll, ("out-of-place",))

class Gloo:
    name = "gloo"

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        warnings.filterwarnings("ignore", category=FutureWarning)
        self.torch, self.dist = torch, dist
        if os.environ.get("TENSORWIRE_STORE_HOSTED") == "1":
            addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1
            dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}",
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        else:
            dist.init_process_group("gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def placements(self, coll: str) -> tuple[str, ...]:
        return placements(coll)

    def bind(self, case: Case) -> Callable[[], Any]:
        dist, t = self.dist, self.torch.from_numpy
        send, recv, root, coll = t(case.send), t(case.recv), case.root, case.coll
        if coll == "all_reduce":
            return lambda: dist.all_reduce(recv)
        if coll == "broadcast":
            return lambda: dist.broadcast(recv, root)
        if coll == "reduce":
            return lambda: dist.reduce(recv, root)
        if coll == "all_gather":
            return lambda: dist.all_gather_into_tensor(recv, send)
        if coll == "reduce_scatter":
            return lambda: dist.reduce_scatter_tensor(recv, send)
        if coll == "alltoall":
            return lambda: dist.all_to_all_single(recv, send)
        if coll == "gather":
            blocks = [t(b) for b in case.recv_blocks()] if self.rank == root else None
            return lambda: dist.gather(send, blocks, root)
        if coll == "scatter":
            blocks = [t(b) for b in case.send_blocks()] if self.rank == root else None
            return lambda: dist.scatter(recv, blocks, root)
        if coll == "sendrecv":
            dst, src = (self.rank + 1) % self.size, (self.rank - 1) % self.size

            def sendrecv() -> None:
                for req in (dist.isend(send, dst), dist.irecv(recv, src)):
                    req.wait()
            return sendrecv
        if coll == "barrier":
            return dist.barrier
        raise ValueError(coll)

    def barrier(self) -> None:
        self.dist.barrier()

    def gather(self, arr: np.ndarray) -> list[np.ndarray] | None:
        mine = self.torch.from_numpy(np.ascontiguousarray(arr))
        out = [self.torch.empty_like(mine) for _ in range(self.size)] if self.rank == 0 else None
        self.dist.gather(mine, out, 0)
        return None if out is None else [o.numpy() for o in out]

    def meta(self) -> dict[str, Any]:
        return {"library": f"torch {self.torch.__version__} gloo", "torch": self.torch.__version__}

    def close(self) -> None:
        self.dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(peer.main(Gloo))
