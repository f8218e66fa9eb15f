"""`tensorwire topo`: print the job's topology as rank 0 sees it."""

from __future__ import annotations

import argparse
import json
import os

import tensorwire as tw

from . import launcher


def main(argv: list[str]) -> int:
    """`tensorwire topo`: inside a job (a launcher's environment) every rank joins and rank 0
    prints; with --np N it starts N local ranks through `tensorwire run` that do so; alone, it
    prints this process as a world of one."""

    p = argparse.ArgumentParser(
        prog="tensorwire topo",
        description="Print the job's topology: hosts and their ranks, each rank's cores, NUMA node, GPU and "
                    "network interface, the tier of its pairs, and the ring, tree and hierarchy orders the "
                    "library runs the world group's collectives in. Inside a job (tensorwire run, torchrun, "
                    "mpirun, Slurm, the multi-host test bed) every rank joins and rank 0 prints; --np N "
                    "starts N ranks on this host.",
        epilog="examples:\n  tensorwire topo --np 4\n  tensorwire run -n 4 -m tensorwire topo --json\n"
               "  python scripts/netns_cluster.py --hosts 2 -n 4 -- -m tensorwire topo",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=None, metavar="N", help="start N ranks on this host")
    p.add_argument("--json", action="store_true", help="print the topology as JSON")
    args = p.parse_args(argv)
    if args.np is not None:
        if args.np < 1:
            p.error("--np must be >= 1")
        size = launcher.launched_job_size()
        if size is not None:  # started as a rank already (tensorwire run, torchrun, mpirun, srun)
            p.error(f"--np {args.np} inside a job{f' of {size} ranks' if size else ''}: leave it out")
        again = ["-m", "tensorwire", "topo", *(["--json"] if args.json else [])]
        return launcher.main(["-n", str(args.np), *again], prog="tensorwire topo")
    os.environ.setdefault("TENSORWIRE_CALIBRATE", "0")  # the topology needs no link constants
    tw.init()
    try:
        if tw.get_rank() == 0:
            topo = tw.topology()
            text = json.dumps(topo.as_dict(), indent=1) if args.json else "\n".join(topo.describe())
            print(text, flush=True)
        tw.barrier()
    finally:
        tw.destroy()
    return 0
