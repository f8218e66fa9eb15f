"""Peak bus bandwidth per library and collective, and the cell closest to Gloo, from the JSON of
`tensorwire bench --compare` (as `make bench` writes docs/benchmarks/compare-n*.json).

    .venv/bin/python bench/peaks.py docs/benchmarks/compare-n2.json [more.json ...]

A cell's figure is the one the tables show (the median over the rounds); a peak is the largest
over sizes and placements. Issue 3's single-host peak targets are Open MPI's, so its column is
the comparison; `vs Gloo` is the smallest of Gloo's time over tensorwire's over every cell
(above 1: every cell faster than Gloo).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict


def summarize(path: str) -> list[str]:
    with open(path) as f:
        compare = json.load(f)["compare"]
    peak: dict[tuple[str, str], tuple[float, int]] = {}
    times: dict[tuple[str, int, str], dict[str, float]] = defaultdict(dict)
    for c in compare["cells"]:
        key = (c["lib"], c["coll"])
        if c["busbw_GBps"] > peak.get(key, (-1.0, 0))[0]:
            peak[key] = (c["busbw_GBps"], c["size"])
        times[(c["coll"], c["size"], c["placement"])][c["lib"]] = c["time_us"]
    libs = compare["libraries"]
    lines = [f"{path}: {compare['nranks']} ranks, {compare['machine'].get('tensorwire', '')}",
             "collective       " + "".join(f"{lib + ' peak GB/s (size)':>28}" for lib in libs)
             + ("   tensorwire / mpi" if "mpi" in libs else "")]
    for coll in dict.fromkeys(c for (_, c), (bw, _) in peak.items() if bw > 0):  # not the barrier
        cells = []
        for lib in libs:
            bw, size = peak.get((lib, coll), (float("nan"), 0))
            cells.append(f"{bw:>17.3g} ({size:>8})")
        ratio = ""
        if peak.get(("mpi", coll), (0.0, 0))[0] > 0:
            ratio = f"   {peak[('tensorwire', coll)][0] / peak[('mpi', coll)][0]:>16.2f}"
        lines.append(f"{coll:<17}" + "".join(f"{c:>28}" for c in cells) + ratio)
    if "gloo" in libs:
        ratios = [(t["gloo"] / t["tensorwire"], k) for k, t in times.items()
                  if "gloo" in t and "tensorwire" in t]
        (closest, (coll, size, placement)) = min(ratios)
        lines.append(f"vs Gloo: {len(ratios)} cells, closest {closest:.2f}x ({coll} {size} B {placement}); "
                     f"{sum(r < 1 for r, _ in ratios)} cells slower than Gloo")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", help="compare JSON files of `tensorwire bench --compare`")
    for path in parser.parse_args().json:
        print("\n".join(summarize(path)))


if __name__ == "__main__":
    main()
