#!/usr/bin/env python
"""One rank fails a collective, every other rank reports what it raised: the drill behind the
failure figures of the 64-rank test bed (docs/architecture.md, "Failure model").

    python scripts/netns_cluster.py --hosts 16 -n 4 --rate 1gbit \\
        --env TENSORWIRE_TCP_CONGESTION=cubic -- bench/failure_drill.py --fault sleep > drill.log
    python bench/failure_drill.py --summarize drill.log

Faults of rank --victim (the last rank by default) at the all_reduce of --count float32
elements after three and a barrier: `kill` (exits 0.5 s into it: a crash), `mismatch` (calls broadcast
instead), `sleep` (sleeps through it, past the timeout). Every rank then prints one `DRILL`
line (what it raised, after how long) and exits as the exception propagates (`--exit raise`,
a goodbye to its peers) or at once (`--exit now`, a crash). The summary counts the ranks that
raised, those whose message names the victim as the cause (for `mismatch`: the mismatch), and
the slowest.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import numpy as np

_CAUSE = {"kill": r"lost rank {v}\b", "mismatch": r"CollectiveMismatchError",
          "sleep": r"Not in this call: .*rank {v} did not answer"}


def drill(args: argparse.Namespace) -> None:
    import tensorwire as tw

    tw.init(timeout=args.timeout)
    world, rank = tw.world(), tw.get_rank()
    victim = args.victim if args.victim >= 0 else world.size - 1
    x = np.ones(args.count, np.float32)

    def report(raised: str | None) -> None:
        print("DRILL " + json.dumps({"rank": rank, "fault": args.fault, "victim": victim, "raised": raised,
                                     "after": time.perf_counter() - t0}), flush=True)

    for _ in range(3):
        world.all_reduce(x)
    world.barrier()
    t0 = time.perf_counter()
    try:
        if rank == victim and args.fault == "kill":
            time.sleep(0.5)  # the others are inside the all_reduce by then
            os._exit(3)
        if rank == victim and args.fault == "sleep":
            time.sleep(args.timeout + 5)
        if rank == victim and args.fault == "mismatch":
            world.broadcast(x, 0)
        else:
            world.all_reduce(x)
        report(None)
    except Exception as exc:
        report(f"{type(exc).__name__}: {exc}")
        if args.exit == "now":
            os._exit(1)
        raise SystemExit(1) from exc


def summarize(path: str) -> str:
    with open(path, errors="replace") as f:
        rows = [json.loads(line.split("DRILL ", 1)[1]) for line in f if "DRILL {" in line]
    if not rows:
        return f"{path}: no DRILL lines"
    fault, victim = rows[0]["fault"], rows[0]["victim"]
    cause = re.compile(_CAUSE[fault].format(v=victim))
    raised = [r for r in rows if r["raised"]]
    named = [r for r in raised if cause.search(r["raised"])]
    slowest = max((r["after"] for r in raised if r["rank"] != victim), default=0.0)  # (a sleeper wakes late)
    return (f"{fault} of rank {victim}: {len(rows)} ranks reported, {len(raised)} raised, {len(named)} name "
            f"the cause ({_CAUSE[fault].format(v=victim)}), the slowest other rank after {slowest:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fault", choices=sorted(_CAUSE), default="sleep")
    ap.add_argument("--victim", type=int, default=-1, help="the failing rank (default: the last)")
    ap.add_argument("--count", type=int, default=1 << 20, help="all_reduce elements (float32)")
    ap.add_argument("--timeout", type=float, default=5.0, help="tensorwire's timeout, seconds")
    ap.add_argument("--exit", choices=("raise", "now"), default="raise")
    ap.add_argument("--summarize", metavar="LOG", help="summarize a drill's output instead of running one")
    args = ap.parse_args()
    if args.summarize:
        print(summarize(args.summarize))
        return
    drill(args)


if __name__ == "__main__":
    sys.exit(main())
