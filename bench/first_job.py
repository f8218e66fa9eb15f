#!/usr/bin/env python
"""What the first job on a host holds against the next one, which finds its calibration cached.

    python bench/first_job.py --np 16 64

For each N the same job runs twice on this host, on a fresh, empty TENSORWIRE_CACHE_DIR: N
ranks started as `tensorwire run` starts them, init (calibration on), a barrier, a checked 1
MiB all_reduce and an all_to_all of 0 bytes; then every rank reports what it holds and waits
until all have (bench/wiring_scale.py runs the jobs). The first job probes and writes the
cache, the second reads and checks it: the entry is marked trusted in between (`--as-written`
leaves it as the probe wrote it, and a probe under load then makes the second job probe
again). Per job: init time, descriptors, connections and resident memory per rank (max and
mean), the /dev/shm the job's rings and segments hold and the drop of /dev/shm's free space
(statvfs: other programs on a shared machine move it too).
Results: docs/limits.md; the reasoning: docs/design/calibration.md.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import statistics
import sys
import tempfile
from typing import Any


def _scale() -> Any:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wiring_scale.py")
    spec = importlib.util.spec_from_file_location("wiring_scale", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def row(n: int, which: str, job: dict[str, Any]) -> str:
    reps = [r for r in job["reports"] if "channels" in r]
    ok = len(reps) == n and all(r["ok"] for r in reps) and not any(job["codes"])

    def stat(values: list[float], fmt: str) -> str:
        mean = f"{statistics.mean(values):{'.1f' if fmt == 'd' else fmt}}"
        return f"{max(values):{fmt}} ({mean})" if values else "-"

    own = sum(r["ring_bytes"] + r["segment_bytes"] for r in reps) / (1 << 20)
    cells = [str(n), which, stat([r["init_s"] for r in reps], ".1f"), stat([r["fds"] for r in reps], "d"),
             stat([sum(r["channels"].values()) for r in reps], "d"),
             stat([r["rss_kib"] / 1024 for r in reps], ".0f"),
             f"{own:.0f} ({job['shm_bytes'] / (1 << 20):.0f})", str(ok)]
    return "| " + " | ".join(cells) + " |"


def trust(cache: str) -> str:
    """Mark the entry in `cache` trusted; what its probe saw of other processes' load."""
    (path,) = glob.glob(os.path.join(cache, "links-*.json"))
    with open(path) as f:
        doc = json.load(f)
    seen = f"foreign load {doc.get('foreign_cores')} cores, trusted {doc.get('trusted')}"
    doc["trusted"] = True
    with open(path, "w") as f:
        json.dump(doc, f)
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, nargs="+", default=[16])
    p.add_argument("--json", default="", help="write every job's reports here")
    p.add_argument("--as-written", action="store_true", help="do not mark the first job's entry trusted")
    p.add_argument("--timeout", type=float, default=600,
                   help="seconds a job may take (and its TENSORWIRE_TIMEOUT)")
    args = p.parse_args()
    scale = _scale()
    print("| ranks | job | init s, max (mean) | descriptors per rank, max (mean) | connections per rank, "
          "max (mean) | resident MiB per rank, max (mean) | /dev/shm MiB: rings + segments (statvfs) | ok |")
    print("|---|---|---|---|---|---|---|---|")
    jobs = []
    for n in args.np:
        with tempfile.TemporaryDirectory(prefix="tw-first-job-") as cache:
            env = {"TENSORWIRE_CALIBRATE": "1", "TENSORWIRE_CACHE_DIR": cache, "WIRING_ALL_TO_ALL": "1"}
            for which in ("first", "cached"):
                job = scale.measure(n, env=env, timeout=args.timeout)
                jobs.append({"which": which, **job})
                print(row(n, which, job), flush=True)
                if which == "first" and not args.as_written:
                    print(f"(the first job's probe: {trust(cache)})", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(jobs, f, indent=1)


if __name__ == "__main__":
    main()
