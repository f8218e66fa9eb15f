"""`tensorwire topo`: print the job's topology as rank 0 sees it."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import tensorwire as tw

from ..config import size_text
from ..transport import shm_budget
from . import launcher


def main(argv: list[str]) -> int:
    """`tensorwire topo`: inside a job (a launcher's environment) every rank joins and rank 0
    prints; with --np N it starts N local ranks through `tensorwire run` that do so; alone, it
    prints this process as a world of one."""

    p = argparse.ArgumentParser(
        prog="tensorwire topo",
        description="Print the job's topology: hosts and their ranks, each rank's cores, NUMA node, GPU and "
                    "network interface, the tier of its pairs, the ring, tree and hierarchy orders the "
                    "library runs the world group's collectives in, and rank 0's host: the transport, TCP "
                    "streams and pump threads, its machine's usable cores against its ranks, /dev/shm. "
                    "Inside a job (tensorwire run, torchrun, mpirun, Slurm, the multi-host test bed) every "
                    "rank joins and rank 0 prints; --np N starts N ranks on this host.",
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
            topo, here = tw.topology(), _this_host(tw.world())
            text = json.dumps({**topo.as_dict(), "rank0_host": here}, indent=1) if args.json else \
                "\n".join([*topo.describe(), *_described(here)])
            print(text, flush=True)
        tw.barrier()
    finally:
        tw.destroy()
    return 0


def _this_host(world: Any) -> dict[str, Any]:
    """What rank 0 knows of its own host's wiring: the transport, its machine's ranks against the
    cores they may use (where they outnumber them, waiters yield at once), TCP streams and pump threads a pair
    gets, and /dev/shm."""
    engine, cfg = world.engine, world.runtime.config
    size, free = shm_budget.usage()
    return {"transport": "tcp" if cfg.transport == "tcp" else "shm within a host, tcp across",
            "cores": engine.cores, "machine_ranks": engine.machine_ranks,
            "oversubscribed": engine.oversubscribed, "tcp_streams": engine.nsocks,
            "pump_threads": 0 if engine.pumps is None else engine.pumps.threads,
            "dev_shm_bytes": size, "dev_shm_free": free}


def _described(here: dict[str, Any]) -> list[str]:
    waiting = "waiting ranks yield at once" if here["oversubscribed"] else "waiting ranks spin first"
    forced = " (TENSORWIRE_TRANSPORT=tcp)" if here["transport"] == "tcp" else ""
    shm = f"{size_text(here['dev_shm_free'])} free of {size_text(here['dev_shm_bytes'])}"
    return [f"transport: {here['transport']}{forced}; over TCP {here['tcp_streams']} stream(s) a pair, "
            f"{here['pump_threads']} pump thread(s) a rank",
            f"rank 0's machine: {here['cores']} usable core(s) for its {here['machine_ranks']} rank(s), "
            f"{waiting}; /dev/shm {shm}"]
