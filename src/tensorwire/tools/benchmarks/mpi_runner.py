"""Open MPI (or any MPI) through mpi4py, timed like tensorwire: a peer of `tensorwire bench --compare`.

Started by `mpiexec -n N python -m tensorwire.tools.benchmarks.mpi_runner ...` (see
`peer.parse_args` for the arguments). The buffer-based calls (Allreduce, Bcast, ...) work on
tensorwire's numpy views directly; in place is MPI_IN_PLACE where its meaning matches
nccl-tests' (not for Reduce_scatter_block, whose in-place result lands at the start of the
buffer rather than in the rank's block).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import peer
from .sweep import Case

_BOTH = ("out-of-place", "in-place")
_PLACEMENTS = {"all_reduce": _BOTH, "broadcast": ("in-place",), "reduce": _BOTH, "all_gather": _BOTH,
               "gather": _BOTH, "scatter": _BOTH}



def placements(coll: str) -> tuple[str, ...]:
    """The placements this library can express for `coll`, preferred first."""
    return _PLACEMENTS.get(coll, ("out-of-place",))

class Mpi:
    name = "mpi"

    def __init__(self) -> None:
        import mpi4py
        from mpi4py import MPI

        self.mpi4py, self.MPI = mpi4py, MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def placements(self, coll: str) -> tuple[str, ...]:
        return placements(coll)

    def bind(self, case: Case) -> Callable[[], Any]:
        comm, IN_PLACE = self.comm, self.MPI.IN_PLACE  # noqa: N806 (MPI's spelling)
        send, recv, root, coll, inplace = case.send, case.recv, case.root, case.coll, case.inplace
        is_root = self.rank == root
        if coll == "all_reduce":
            return lambda: comm.Allreduce(IN_PLACE if inplace else send, recv)
        if coll == "broadcast":
            return lambda: comm.Bcast(recv, root)
        if coll == "reduce":
            if inplace:  # the root reduces into its buffer; the others' buffer is their input
                return lambda: comm.Reduce(IN_PLACE if is_root else recv, recv if is_root else None,
                                           root=root)
            return lambda: comm.Reduce(send, recv if is_root else None, root=root)
        if coll == "all_gather":
            return lambda: comm.Allgather(IN_PLACE if inplace else send, recv)
        if coll == "reduce_scatter":
            return lambda: comm.Reduce_scatter_block(send, recv)
        if coll == "alltoall":
            return lambda: comm.Alltoall(send, recv)
        if coll == "gather":
            mine = IN_PLACE if inplace and is_root else send
            return lambda: comm.Gather(mine, recv if is_root else None, root=root)
        if coll == "scatter":
            into = IN_PLACE if inplace and is_root else recv
            return lambda: comm.Scatter(send if is_root else None, into, root=root)
        if coll == "sendrecv":
            dst, src = (self.rank + 1) % self.size, (self.rank - 1) % self.size
            return lambda: comm.Sendrecv(send, dst, recvbuf=recv, source=src)
        if coll == "barrier":
            return comm.Barrier
        raise ValueError(coll)

    def barrier(self) -> None:
        self.comm.Barrier()

    def gather(self, arr: np.ndarray) -> list[np.ndarray] | None:
        mine = np.ascontiguousarray(arr, dtype=np.float64)
        out = np.empty((self.size, mine.size), dtype=np.float64) if self.rank == 0 else None
        self.comm.Gather(mine, out, root=0)
        return None if out is None else list(out)

    def meta(self) -> dict[str, Any]:
        version = self.MPI.Get_library_version().replace("\0", "").strip().splitlines()[0]
        return {"library": f"{version}, mpi4py {self.mpi4py.__version__}", "mpi4py": self.mpi4py.__version__}

    def close(self) -> None:
        pass  # mpi4py finalizes MPI at exit


if __name__ == "__main__":
    raise SystemExit(peer.main(Mpi))
