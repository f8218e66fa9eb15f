"""The same `tensorwire bench` sweep from two source trees, interleaved, side by side.

For a change that must not slow anything (a refactor, a new code path): each round runs the
sweep once from tree A and once from tree B (`PYTHONPATH=TREE/src`, the same Python), and the
table gives per cell the median over rounds of each run's mean call (the slowest rank's, as
nccl-tests) and p50, and the ratio B/A of the means (> 1: B slower).

    python bench/ab_trees.py --a /tmp/base --b . --rounds 3 -- all -b 8 -e 16M -f 8 --np 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_sweep(tree: Path, bench_args: list[str], out: Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    cmd = [sys.executable, "-m", "tensorwire", "bench", *bench_args, "--json", str(out)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    return json.loads(out.read_text())["rows"]


def key(row: dict) -> tuple:
    return row["coll"], row["size"], row["placement"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--a", type=Path, required=True, help="tree A (the reference), e.g. a worktree of main")
    p.add_argument("--b", type=Path, required=True, help="tree B (the change)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then `tensorwire bench` arguments")
    args = p.parse_args(argv)
    bench_args = [a for a in args.bench_args if a != "--"]
    cells: dict[str, dict[tuple, list[dict]]] = {"A": {}, "B": {}}
    with tempfile.TemporaryDirectory(prefix="tw-ab-") as tmp:
        for rnd in range(args.rounds):
            for label, tree in (("A", args.a), ("B", args.b)):
                rows = run_sweep(tree.resolve(), bench_args, Path(tmp) / f"{label}{rnd}.json")
                for row in rows:
                    cells[label].setdefault(key(row), []).append(row)
                print(f"round {rnd + 1}/{args.rounds} {label}: {len(rows)} cells", file=sys.stderr)
    print(f"# A = {args.a}, B = {args.b}; {args.rounds} interleaved rounds of `tensorwire bench "
          f"{' '.join(bench_args)}`")
    print("# mean, p50 (us): median over rounds of each run's value; B/A of the means (> 1: B slower)")
    print(f"{'collective':>14} {'size':>10} {'placement':>12} {'A mean':>9} {'B mean':>9} {'A p50':>8} "
          f"{'B p50':>8} {'B/A':>6}")
    ratios = []
    for k in sorted(cells["A"], key=lambda k: (k[0], k[1], k[2])):
        if k not in cells["B"]:
            continue
        a = {s: statistics.median(r[s] for r in cells["A"][k]) for s in ("mean_us", "p50_us")}
        b = {s: statistics.median(r[s] for r in cells["B"][k]) for s in ("mean_us", "p50_us")}
        ratio = b["mean_us"] / a["mean_us"]
        ratios.append(ratio)
        print(f"{k[0]:>14} {k[1]:>10} {k[2]:>12} {a['mean_us']:9.2f} {b['mean_us']:9.2f} {a['p50_us']:8.2f} "
              f"{b['p50_us']:8.2f} {ratio:6.2f}")
    if ratios:
        print(f"# geometric mean of B/A over {len(ratios)} cells: "
              f"{statistics.geometric_mean(ratios):.3f}; median {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
