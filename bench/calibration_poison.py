"""Small-message latency after a bad calibration in the cache, against a freshly calibrated run.

    .venv/bin/python bench/calibration_poison.py --rounds 5
    .venv/bin/python bench/calibration_poison.py --rounds 5 --src /tmp/old/src   # another checkout

Each round runs, in turn, `tensorwire bench all_reduce -b 8 -e 8 -n ITERS --np N` twice:
"fresh" on an empty cache, then "planted" on a cache holding the entry the fresh job wrote,
rewritten by hand as issue 35's unlucky probe left it: the one shot at 97 us, trusted, just
made (so the planted job finds the fresh job's constants but for that α). Each line gives
the mean call, p50 and p99 (us, out of place) of both and planted/fresh by the mean; the last
line the median of those ratios. `--src` runs the bench of another source tree (PYTHONPATH),
e.g. the code before the fix (`git archive <commit> src | tar -x -C /tmp/old`).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

POISON_ALPHA = 97e-6


def bench(cache: str, args: argparse.Namespace, out: str) -> dict:
    env = {**os.environ, "TENSORWIRE_CACHE_DIR": cache}
    if args.src:
        env["PYTHONPATH"] = args.src
    cmd = [sys.executable, "-m", "tensorwire", "bench", "all_reduce", "-b", "8", "-e", "8",
           "-n", str(args.iters), "--np", str(args.np), "--json", out]
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)
    with open(out) as f:
        row = next(r for r in json.load(f)["rows"] if r["placement"] == "out-of-place")
    # before the mean became the headline, time_us was the median and there was no p99
    return {"mean": row["mean_us"], "p50": row.get("p50_us", row["time_us"]),
            "p99": row.get("p99_us", row["max_us"])}


def plant(fresh: str, cache: str) -> None:
    """The fresh job's entry, with the one shot's α at POISON_ALPHA, into `cache`."""
    (path,) = glob.glob(os.path.join(fresh, "links-*.json"))
    with open(path) as f:
        doc = json.load(f)
    doc["links"]["direct"]["alpha"] = POISON_ALPHA
    doc.update(created=time.time(), trusted=True, load_per_cpu=0.0, direct_slower=False)
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, os.path.basename(path)), "w") as f:
        json.dump(doc, f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--np", type=int, default=2)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--src", default="", help="source tree to run the bench from (PYTHONPATH)")
    args = p.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory(prefix="tw-poison-") as tmp:
        out = os.path.join(tmp, "rows.json")
        print(f"{'round':>5}  {'fresh mean/p50/p99 (us)':>26}  {'planted mean/p50/p99 (us)':>26}  "
              "planted/fresh")
        for r in range(args.rounds):
            fresh_cache, planted = os.path.join(tmp, f"fresh-{r}"), os.path.join(tmp, f"planted-{r}")
            fresh = bench(fresh_cache, args, out)
            plant(fresh_cache, planted)
            bad = bench(planted, args, out)
            ratios.append(bad["mean"] / fresh["mean"])

            def fmt(x: dict) -> str:
                return f"{x['mean']:8.2f} {x['p50']:8.2f} {x['p99']:8.1f}"

            print(f"{r:>5}  {fmt(fresh):>26}  {fmt(bad):>26}  {ratios[-1]:13.2f}", flush=True)
    print(f"median planted/fresh (mean call): {statistics.median(ratios):.2f}; "
          f"range {min(ratios):.2f}-{max(ratios):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
