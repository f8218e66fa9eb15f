"""The sweep a peer library runs for `tensorwire bench --compare`, whatever the library.

A runner module (`gloo_runner`, `mpi_runner`) wraps its library in a `PeerLib` and calls
`main(lib_factory)`; every rank then walks the cells the driver asked for (collectives x
sizes x placements, float32, sum), builds each case with `sweep.make_case` (tensorwire's
buffers, placements and inputs), times it with `sweep.measure`, checks one call against the
numpy reference and sends its figures to rank 0, which writes them as JSON rows shaped like
`tensorwire bench --json`'s. A placement the library cannot express is left out; where it
can express none of the wanted ones (`-I` with a collective it only has out of place), its
only form is measured and labelled as such.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from . import progress, sweep
from .loadmeter import job_meter

FLOAT32 = np.dtype(np.float32)


class PeerLib(Protocol):
    name: str
    rank: int
    size: int

    def placements(self, coll: str) -> tuple[str, ...]:
        """The placements the library can express for `coll`, preferred first."""

    def bind(self, case: sweep.Case) -> Callable[[], Any]:
        """The library's call for the case (its buffers are the case's send / recv views)."""

    def barrier(self) -> None: ...

    def gather(self, arr: np.ndarray) -> list[np.ndarray] | None:
        """Every rank's `arr` (same length everywhere) on rank 0; None elsewhere."""

    def meta(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


def _schedule_arg(text: str) -> int | None:
    return None if text == "auto" else int(text)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--colls", required=True, help="comma list of collectives")
    p.add_argument("--sizes", required=True, help="comma list of nominal sizes in bytes")
    p.add_argument("--placements", default=",".join(sweep.PLACEMENTS))
    p.add_argument("--root", type=int, default=0)
    p.add_argument("--warmup", type=_schedule_arg, default=None, help="number, or auto (by size)")
    p.add_argument("--iters", type=_schedule_arg, default=None, help="number, or auto (by size)")
    p.add_argument("--check", type=int, choices=(0, 1), default=1)
    p.add_argument("--blocking", type=int, choices=(0, 1), default=0)
    p.add_argument("--out", required=True, help="JSON written by rank 0")
    args = p.parse_args(argv)
    args.colls = [c for c in args.colls.split(",") if c]
    unknown = sorted(set(args.colls) - set(sweep.COLLECTIVES))
    if unknown:
        p.error(f"unknown collectives {unknown}")
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.placements = [s for s in args.placements.split(",") if s]
    return args


def placements_to_run(have: Sequence[str], wanted: Sequence[str]) -> list[str]:
    """The wanted placements a library has, else its preferred one (labelled as what it is)."""
    chosen = [p for p in have if p in wanted]
    return chosen or list(have[:1])


def run(lib: PeerLib, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every wanted cell on every rank; rank 0 returns the rows (the others an empty list)."""
    rank, n = lib.rank, lib.size
    pids = lib.gather(np.array([os.getpid()], dtype=np.float64))
    meter = job_meter(int(p[0]) for p in pids) if pids is not None else None
    bufs = sweep.Buffers.for_cases(args.colls, args.sizes, [FLOAT32], n)
    rows: list[dict[str, Any]] = []
    for coll in args.colls:
        op = "sum" if coll in sweep.REDUCING else None
        for nominal in (args.sizes if coll != "barrier" else [0]):
            for placement in placements_to_run(lib.placements(coll), args.placements):
                case = sweep.make_case(coll, FLOAT32, op, args.root, nominal, placement == "in-place", bufs,
                                       rank, n, lib.bind)
                if case.size == 0 and coll != "barrier":
                    continue  # nothing moves (fewer elements than ranks): no figure to compare
                m = sweep.measure(lib, case, args.warmup, args.iters, bool(args.check), meter,
                                  bool(args.blocking))
                gathered = lib.gather(sweep.pack(m))
                if gathered is None:
                    continue
                per_rank, wrong = sweep.unpack(gathered)
                rows.append({"lib": lib.name, **sweep.row(case, nominal, sweep.cell(coll, n, case.size,
                                                                                  per_rank, wrong), m)})
                progress.note(f"{lib.name} {coll} {case.size} B {placement}")
    return rows


def main(make_lib: Callable[[], PeerLib], argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    lib = make_lib()
    try:
        rows = run(lib, args)
        if lib.rank == 0:
            meta = {"lib": lib.name, "nranks": lib.size, "host": platform.node(),
                    "python": platform.python_version(), "numpy": np.__version__, **lib.meta()}
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
        lib.barrier()
    finally:
        lib.close()
    return 0
