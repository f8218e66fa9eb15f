#!/usr/bin/env python
"""Flat, hierarchical and Gloo side by side across emulated hosts, per collective and size.

    python bench/hosts_sweep.py --shapes 4x2,8x2 --rate 1gbit -b 4 -e 64M -f 16 --out /tmp/hosts

For each shape (K hosts x N ranks, scripts/netns_cluster.py) and collective it runs
`tensorwire bench COLL --algo all -I` as the job of the test bed: per size the tuner's choice
and every eligible algorithm forced in turn, on the same group and links. Then Gloo through
torch.distributed (benchmarks/gloo_runner.py) over the same sizes, in a job of its own on a
test bed of the same shape. It prints, per shape and collective, one row per size: the
tuner's choice, the fastest flat algorithm, the fastest hierarchical one and Gloo, each the
mean call (the slowest rank's mean, nccl-tests' figure), and Gloo over the tuner's choice.
The JSON of every job stays in --out (--reuse goes on from there); --json gathers it in one
file, --markdown writes the tables with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tensorwire.config import parse_size, size_text
from tensorwire.tools.benchmarks.report import fmt_us, machine, machine_lines
from tensorwire.tools.benchmarks.sweep import size_list

HERE = Path(__file__).resolve().parent
TESTBED = HERE.parent / "scripts" / "netns_cluster.py"
COLLS = "all_reduce,broadcast,all_gather,reduce_scatter"


def testbed(hosts: int, per: int, args: argparse.Namespace, job: list[str], log: Path, result: Path) -> None:
    if args.reuse and result.exists():
        print(f"# reusing {result}", flush=True)
        return
    cmd = [sys.executable, str(TESTBED), "--hosts", str(hosts), "-n", str(per),
           "--job-timeout", str(args.job_timeout), "--env", "GLOO_SOCKET_IFNAME=eth0",
           "--sysctl", f"net.ipv4.tcp_congestion_control={args.congestion}"]
    if args.rate:
        cmd += ["--rate", args.rate]
    cmd += ["--", *job]
    print(f"# {' '.join(cmd)}", flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    print(f"#   {time.time() - t0:.0f} s, exit {done.returncode}, log {log}", flush=True)
    if done.returncode:
        raise SystemExit(f"hosts_sweep: the job failed (exit {done.returncode}); see {log}")


def best(cells: dict[str, Any], hierarchical: bool) -> tuple[str, float] | None:
    """The fastest forced algorithm of one kind, by the mean call."""
    mine = {k: v["mean_us"] for k, v in cells.items()
            if k != "auto" and k.startswith("hierarchical") == hierarchical}
    if not mine:
        return None
    name = min(mine, key=mine.__getitem__)
    return name, mine[name]


def table(coll: str, results: list[dict[str, Any]], gloo_rows: list[dict[str, Any]]) -> list[str]:
    gloo = {r["size"]: r["mean_us"] for r in gloo_rows if r["coll"] == coll}
    lines = [f"| {coll} | tuner's choice | fastest flat | fastest hierarchical | Gloo | Gloo / choice |",
             "|---|---|---|---|---|---|"]
    for res in results:
        if res["size"] == 0:
            continue  # fewer elements than ranks: nothing moves
        cells = res["cells"]
        auto = cells.get("auto")
        flat, hier = best(cells, False), best(cells, True)
        g = gloo.get(res["size"])
        cols = [size_text(res["size"], exact=True),
                f"{fmt_us(auto['mean_us'])} ({res['auto']})" if auto else "-",
                f"{fmt_us(flat[1])} ({flat[0]})" if flat else "-",
                f"{fmt_us(hier[1])} ({hier[0]})" if hier else "not eligible",
                fmt_us(g) if g else "-",
                f"{g / auto['mean_us']:.2f}" if g and auto else "-"]
        lines.append("| " + " | ".join(cols) + " |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="4x2,8x2", help="comma list of HOSTSxRANKS")
    p.add_argument("--colls", default=COLLS)
    p.add_argument("--rate", default="1gbit", help="host links' rate (tc syntax; empty: unshaped)")
    p.add_argument("--congestion", default="reno",
                   help="every host's TCP congestion control, for both libraries (BBR without an fq qdisc "
                        "stalls bursts after idle spells: design/tcp.md)")
    p.add_argument("-b", default="4")
    p.add_argument("-e", default="64M")
    p.add_argument("-f", type=int, default=16)
    p.add_argument("--out", default="hosts-sweep", help="folder for the jobs' JSON and logs")
    p.add_argument("--json", help="also write every job's results here, in one file")
    p.add_argument("--reuse", action="store_true",
                   help="jobs whose JSON is already in --out are not run again (a sweep cut short goes on)")
    p.add_argument("--markdown", help="also write the tables here, with the command and the machine")
    p.add_argument("-n", "--iters", type=int, default=40, help="timed calls per size below --large-from")
    p.add_argument("-w", "--warmup", type=int, default=5, help="warm-up calls per size below --large-from")
    p.add_argument("--large-from", type=parse_size, default=parse_size("1M"))
    p.add_argument("--large-iters", type=int, default=4,
                   help="timed calls per size from --large-from (1 warm-up)")
    p.add_argument("--job-timeout", type=int, default=1500, help="seconds per test-bed job")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    colls = [c for c in args.colls.split(",") if c]
    sz = size_list(parse_size(args.b), parse_size(args.e), args.f, 0)
    report = []
    combined: dict[str, Any] = {}
    small, large = [v for v in sz if v < args.large_from], [v for v in sz if v >= args.large_from]
    bands = [(band, iters, warm) for band, iters, warm in
             ((small, args.iters, args.warmup), (large, args.large_iters, 1)) if band]
    for shape in args.shapes.split(","):
        hosts, per = (int(v) for v in shape.split("x"))
        docs: dict[str, list[dict[str, Any]]] = {c: [] for c in colls}
        gloo_rows: list[dict[str, Any]] = []
        for k, (band, iters, warm) in enumerate(bands):
            counts = ["-n", str(iters), "-w", str(warm)]
            for coll in colls:
                path = out / f"tw-{shape}-{coll}-{k}.json"
                testbed(hosts, per, args, ["-m", "tensorwire", "bench", coll, "--algo", "all", "-I",
                                           "-b", str(band[0]), "-e", str(band[-1]), "-f", str(args.f),
                                           *counts, "--progress", "off", "--json", str(path)],
                        out / f"tw-{shape}-{coll}-{k}.log", path)
                docs[coll] += json.loads(path.read_text())["results"]
            gpath = out / f"gloo-{shape}-{k}.json"
            testbed(hosts, per, args, ["-m", "tensorwire.tools.benchmarks.gloo_runner",
                                       "--colls", ",".join(colls), "--sizes", ",".join(map(str, band)),
                                       "--placements", "in-place",
                                       "--warmup", str(warm), "--iters", str(iters), "--out", str(gpath)],
                    out / f"gloo-{shape}-{k}.log", gpath)
            gloo_rows += json.loads(gpath.read_text())["rows"]
        combined[shape] = {"tensorwire": docs, "gloo": gloo_rows}
        report.append(f"### {hosts} hosts x {per} ranks" + (f", {args.rate} links" if args.rate else ""))
        report.append("")
        for coll in colls:
            report += [*table(coll, docs[coll], gloo_rows), ""]
    text = "\n".join(report)
    print(text)
    if args.json:
        doc = {"meta": {**machine(), "argv": sys.argv[1:]}, "shapes": combined}
        Path(args.json).write_text(json.dumps(doc, separators=(",", ":"), default=float))
    if args.markdown:
        command = "python bench/hosts_sweep.py " + " ".join(sys.argv[1:])
        Path(args.markdown).write_text(
            f"# Across emulated hosts: flat, hierarchical and Gloo\n\n```\n{command}\n```\n\n"
            "Mean call (the slowest rank's mean over its calls), in place, float32, sum; "
            "all ranks on one machine, each host a network namespace.\n\n"
            + "\n".join(machine_lines(machine(), {})) + "\n\n" + text + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
