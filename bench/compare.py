#!/usr/bin/env python
"""tensorwire vs Gloo vs Open MPI: the numbers the team quotes, measured in one invocation.

    .venv/bin/python bench/compare.py                      # n=2, 3 rounds, ~2-3 min on a quiet machine
    .venv/bin/python bench/compare.py --nranks 2,4 --out-dir docs/benchmarks

Rows: 8-byte all_reduce and barrier (the anchors' latency schedule, W=500 N=5000) and the
64 MiB all_reduce (the anchors' schedule x ANCHOR_ITER_SCALE=2, i.e. W=6 N=22, as in their
interleaved ratio step). Every variant is one launch per round doing all three rows:

  tw-shm    tensorwire run -n N bench/anchor_tensorwire.py          (shared memory)
  tw-tcp    tensorwire run -n N --tcp bench/anchor_tensorwire.py    (TCP over loopback)
  gloo      torchrun ... <anchors>/bench_torch.py                   (the anchors' command)
  mpi       mpiexec --allow-run-as-root --oversubscribe -n N <anchors python> <anchors>/bench_mpi.py
  (optional: tw-shm-inplace, mpi-inplace: all_reduce in place; gloo's is always in place)

All of them share the anchors' common.py (sizes, schedule, statistics: time of an op = max
over ranks, median over ops), so their figures are comparable. Launches are interleaved:
round r runs every variant once, in an order rotated by r, so slow drifts of this shared
machine hit all variants alike. Before each launch the machine gets up to --quiet-wait
seconds to become quiet (the anchors' sysmon.py); the CPU time foreign processes used while
a row was timed is recorded, and a launch with a contaminated row (the anchors' rule:
foreign CPU > 0.03 s + 5% of the timed wall time) is run again up to --retries times,
keeping the least contaminated attempt. Cells still contaminated are marked with a dagger.
--budget (default 330 s) bounds the run: re-runs, quiet waits and further rounds (after the
second) are skipped when they would not fit.

The table gives, per row, the median over rounds of each variant's median op time, and the
median over rounds of the per-round time ratios tensorwire / gloo and tensorwire / mpi
(> 1: tensorwire is slower).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_ANCHORS = REPO.parent / "shared" / "anchors"
DEFAULT_ANCHORS_PY = Path("/opt/anchors-venv/bin/python")
BIG = 64 << 20
TW_VARIANTS = ("tw-shm", "tw-tcp", "tw-shm-inplace")
BASELINES = ("gloo", "mpi", "mpi-inplace")
ALL_VARIANTS = TW_VARIANTS + BASELINES
LABEL = {
    "tw-shm": "tensorwire shm", "tw-tcp": "tensorwire tcp", "tw-shm-inplace": "tensorwire shm in-place",
    "gloo": "gloo", "mpi": "mpi", "mpi-inplace": "mpi in-place",
}
ROWS = (("ar8", "all_reduce 8 B", "us"), ("barrier", "barrier", "us"), ("big", "all_reduce 64 MiB", "ms"))


def log(*parts: object) -> None:
    print(time.strftime("%H:%M:%S"), *parts, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(variant: str, n: int, out: str, a: argparse.Namespace) -> list[str]:
    args = ["--colls", "all_reduce", "--sizes", str(a.size), "--latency", "--out", out]
    anchors = Path(a.anchors_dir)
    if variant.startswith("tw-"):
        cmd = [sys.executable, "-m", "tensorwire", "run", "-n", str(n)]
        if variant == "tw-tcp":
            cmd.append("--tcp")
        cmd += [str(REPO / "bench" / "anchor_tensorwire.py"), "--anchors-dir", str(anchors), *args]
        if variant == "tw-shm-inplace":
            cmd.append("--inplace")
        return cmd
    if variant == "gloo":
        torchrun = Path(a.anchors_python).parent / "torchrun"
        return [str(torchrun), "--nnodes", "1", "--nproc-per-node", str(n), "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), str(anchors / "bench_torch.py"), *args]
    if variant in ("mpi", "mpi-inplace"):
        cmd = ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", str(n), str(a.anchors_python),
               str(anchors / "bench_mpi.py"), *args]
        return cmd + (["--inplace"] if variant == "mpi-inplace" else [])
    raise ValueError(variant)


def contaminated(row: dict) -> bool:
    """The anchors' rule (run_all.py): foreign CPU above 0.03 s + 5% of the timed wall time."""
    f = row.get("foreign_cpu_s")
    return f is not None and f > 0.03 + 0.05 * row.get("timed_wall_s", 0.0)


def extract(data: dict) -> dict:
    """The three figures of one launch, with their contamination flags and spread."""
    lat = {r["coll"]: r for r in data["latency"]}
    big = next(r for r in data["rows"] if r["coll"] == "all_reduce" and r["nominal"] == data["_size"])
    out = {}
    for key, row, scale in (("ar8", lat["all_reduce"], 1.0), ("barrier", lat["barrier"], 1.0),
                            ("big", big, 1e-3)):
        out[key] = {"time": row["time_us"] * scale, "p10": row["p10_us"] * scale,
                    "p90": row["p90_us"] * scale,
                    "mean": row["mean_us"] * scale, "busbw": row.get("busbw_GBps"),
                    "foreign_cpu_s": row.get("foreign_cpu_s"), "timed_wall_s": row.get("timed_wall_s"),
                    "contaminated": contaminated(row), "ops": row["ops"], "warmup": row["warmup"]}
    return out


class Clock:
    """The time budget: re-runs of contaminated launches only while the rest still fits."""

    def __init__(self, budget: float, launches: int) -> None:
        self.t0, self.budget, self.left, self.walls = time.time(), budget, launches, []

    def done_one(self, wall: float) -> None:
        self.walls.append(wall)

    def finished_launch(self) -> None:
        self.left -= 1

    def may_rerun(self) -> bool:
        avg = statistics.mean(self.walls) if self.walls else 0.0
        return time.time() - self.t0 + avg * self.left <= self.budget


def launch(variant: str, n: int, a: argparse.Namespace, sysmon, workdir: Path, clock: Clock) -> dict:
    """One launch, run again while contaminated (--retries, within --budget) or failed (once);
    returns the least contaminated successful attempt, or a record of the failure."""
    best = None
    failures: list[str] = []
    attempt = 0
    while True:
        out = workdir / f"{variant}_n{n}.json"
        if out.exists():
            out.unlink()
        cmd = command(variant, n, str(out), a)
        env = dict(os.environ)
        env["ANCHOR_ITER_SCALE"] = str(a.iter_scale)
        env.pop("OMP_NUM_THREADS", None)  # each launcher applies its own default (1)
        for key in [k for k in env if k.startswith("TENSORWIRE_")]:
            env.pop(key)
        if a.tensorwire_src and variant.startswith("tw-"):
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [a.tensorwire_src, env.get("PYTHONPATH")]))
        waited = 0.0
        if a.quiet_wait > 0 and clock.may_rerun():  # no time for waiting once the budget is tight
            _, waited = sysmon.wait_quiet(timeout=a.quiet_wait, log=lambda *m: None)
        logp = workdir / f"{variant}_n{n}_a{attempt}.log"
        try:
            mon = sysmon.run_monitored(cmd, log_path=str(logp), env=env, timeout=a.launch_timeout)
        except subprocess.TimeoutExpired:
            mon = {"rc": "timeout", "wall_s": a.launch_timeout}
        clock.done_one(mon["wall_s"])
        attempt += 1
        if mon["rc"] != 0 or not out.exists():
            tail = logp.read_text(errors="replace").splitlines()[-12:] if logp.exists() else []
            failures.append(f"rc {mon['rc']}: " + " | ".join(t.strip() for t in tail))
            log(f"  {LABEL[variant]:<24} n={n}: FAILED (rc {mon['rc']}); last lines:\n    "
                + "\n    ".join(tail))
            if len(failures) < 2 and clock.may_rerun():
                continue  # one more try for a failed launch
            break
        data = json.loads(out.read_text())
        data["_size"] = a.size
        fig = extract(data)
        result = {"variant": variant, "n": n, "attempt": attempt - 1, "figures": fig,
                  "meta": data.get("meta"), "failures": failures,
                  "launch": {k: mon[k] for k in ("wall_s", "foreign_cpu_s", "cmd")},
                  "waited_for_quiet_s": waited}
        score = sum(v["foreign_cpu_s"] or 0.0 for v in fig.values())
        if best is None or score < best[0]:
            best = (score, result)
        bad = [k for k, v in fig.items() if v["contaminated"]]
        log(f"  {LABEL[variant]:<24} n={n}: 8 B {fig['ar8']['time']:8.1f} us  barrier "
            f"{fig['barrier']['time']:8.1f} us  64 MiB {fig['big']['time']:7.1f} ms  "
            f"(launch {mon['wall_s']:.1f} s{', contaminated: ' + ','.join(bad) if bad else ''})")
        reruns = attempt - len(failures) - 1
        if not bad or reruns >= a.retries or not clock.may_rerun():
            break
    clock.finished_launch()
    if best is None:
        return {"variant": variant, "n": n, "failed": True, "failures": failures}
    return best[1]


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def ratio_fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def summarize(runs: list[dict], variants: list[str], n: int, rounds: int) -> tuple[list[str], dict]:
    """Markdown lines for one n and the numbers behind them."""
    by = {(r["variant"], r["round"]): r for r in runs if r["n"] == n and not r.get("failed")}
    failed = {(r["variant"], r["round"]) for r in runs if r["n"] == n and r.get("failed")}
    tws = [v for v in variants if v in TW_VARIANTS]
    bases = [v for v in variants if v in BASELINES]
    # tensorwire in-place is compared with mpi in-place when both ran; otherwise with mpi
    summary: dict = {"n": n, "rows": {}}
    head = ["measurement", *(LABEL[v] for v in variants)]
    ratio_cols = [(t, b) for t in tws for b in bases
                  if not (b == "mpi-inplace" and t != "tw-shm-inplace")
                  and not (b == "mpi" and t == "tw-shm-inplace" and "mpi-inplace" in bases)]
    head += [f"{LABEL[t].replace('tensorwire ', 'tw ')} / {LABEL[b]}" for t, b in ratio_cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, name, unit in ROWS:
        cells = [f"{name} ({unit})"]
        row_sum: dict = {"unit": unit, "median": {}, "ratio": {}, "per_round": {}}
        for v in variants:
            vals = [by[(v, r)]["figures"][key] for r in range(rounds) if (v, r) in by]
            times = [x["time"] for x in vals]
            med = statistics.median(times) if times else None
            row_sum["median"][v] = med
            row_sum["per_round"][v] = times
            dag = "†" if any(x["contaminated"] for x in vals) else ""
            cell = fmt(med) + dag
            if key == "big" and vals:
                bw = statistics.median(x["busbw"] for x in vals if x["busbw"] is not None)
                cell += f" ({bw:.2f} GB/s)"
            cells.append(cell)
        for t, b in ratio_cols:
            per = [by[(t, r)]["figures"][key]["time"] / by[(b, r)]["figures"][key]["time"]
                   for r in range(rounds) if (t, r) in by and (b, r) in by]
            med = statistics.median(per) if per else None
            row_sum["ratio"][f"{t}/{b}"] = {"median": med, "per_round": per}
            cells.append(ratio_fmt(med) + (f" ({min(per):.2f}-{max(per):.2f})" if len(per) > 1 else ""))
        summary["rows"][key] = row_sum
        lines.append("| " + " | ".join(cells) + " |")
    # per-round detail
    lines += ["", f"Per round (n={n}): median op time; foreign CPU s during the timed loops "
                  "(8 B / barrier / 64 MiB).", "",
              "| round | variant | 8 B all_reduce us (p10-p90) | barrier us (p10-p90) | 64 MiB ms (p10-p90) "
              "| foreign CPU s |", "|---|---|---|---|---|---|"]
    for r in range(rounds):
        for v in variants:
            run = by.get((v, r))
            if run is None:
                if (v, r) in failed:
                    lines.append(f"| {r + 1} | {LABEL[v]} | failed | failed | failed | - |")
                continue
            f = run["figures"]
            fc = " / ".join(f"{(f[k]['foreign_cpu_s'] or 0):.2f}" for k in ("ar8", "barrier", "big"))
            cells = [f"{fmt(f[k]['time'])}{'†' if f[k]['contaminated'] else ''} "
                     f"({fmt(f[k]['p10'])}-{fmt(f[k]['p90'])})" for k in ("ar8", "barrier", "big")]
            lines.append(f"| {r + 1} | {LABEL[v]} | " + " | ".join(cells) + f" | {fc} |")
    return lines, summary


def machine_text(runs: list[dict]) -> list[str]:
    metas = {r["variant"]: r.get("meta") or {} for r in runs}
    ncpu = os.cpu_count()
    lines = [f"- host `{platform.node()}`, {ncpu} CPUs, Python {platform.python_version()}, "
             f"{platform.system()} {platform.release()}"]
    tw_meta = metas.get("tw-shm") or metas.get("tw-tcp") or {}
    if tw_meta:
        lines.append(f"- tensorwire {tw_meta.get('tensorwire')} (numpy {tw_meta.get('numpy')}), launched by "
                     "`tensorwire run`; out-of-place all_reduce (`all_reduce(send, out=recv)`) like "
                     "bench_mpi.py "
                     "unless marked in-place")
    if metas.get("gloo"):
        lines.append(f"- torch {metas['gloo'].get('torch')} gloo (in-place all_reduce), launched by torchrun")
    mpi_meta = metas.get("mpi") or metas.get("mpi-inplace")
    if mpi_meta:
        lines.append(f"- {mpi_meta.get('mpi_library')}, mpi4py {mpi_meta.get('mpi4py')}, "
                     "default MCA settings")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--nranks", default="2", help="comma list of rank counts (default 2; e.g. 2,4)")
    ap.add_argument("--variants", default="tw-shm,tw-tcp,gloo,mpi",
                    help=f"comma list from {', '.join(ALL_VARIANTS)} (default tw-shm,tw-tcp,gloo,mpi)")
    ap.add_argument("--size", type=int, default=BIG, help="bytes of the large all_reduce (default 64 MiB)")
    ap.add_argument("--iter-scale", type=float, default=2.0,
                    help="ANCHOR_ITER_SCALE for the large all_reduce (default 2, as the anchors' ratio step)")
    ap.add_argument("--anchors-dir", default=str(DEFAULT_ANCHORS))
    ap.add_argument("--anchors-python", default=str(DEFAULT_ANCHORS_PY),
                    help="python of the anchors' venv (torch, mpi4py); its torchrun runs gloo")
    ap.add_argument("--quiet-wait", type=float, default=5.0,
                    help="seconds each launch may wait for a quiet machine (0: don't wait; default 5)")
    ap.add_argument("--retries", type=int, default=1,
                    help="re-runs of a launch with a contaminated row (default 1)")
    ap.add_argument("--budget", type=float, default=330.0,
                    help="seconds: contaminated launches are re-run only while the rest still fits "
                         "(default 330)")
    ap.add_argument("--launch-timeout", type=float, default=240.0)
    ap.add_argument("--tensorwire-src", default=None, metavar="DIR",
                    help="run tensorwire from this source folder (a snapshot or another checkout: "
                         "DIR/tensorwire is imported) instead of the installed one")
    ap.add_argument("--out-dir", default=None,
                    help="also write compare.md and compare.json there (e.g. docs/benchmarks)")
    a = ap.parse_args(argv)
    a.anchors_dir = str(Path(a.anchors_dir).resolve())
    if a.tensorwire_src:
        a.tensorwire_src = str(Path(a.tensorwire_src).resolve())
        if not (Path(a.tensorwire_src) / "tensorwire" / "__init__.py").is_file():
            ap.error(f"--tensorwire-src {a.tensorwire_src}: no tensorwire package there")
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in ALL_VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(ALL_VARIANTS)}")
    nranks = [int(x) for x in a.nranks.split(",")]
    anchors = Path(a.anchors_dir)
    for need in ("common.py", "sysmon.py", "bench_torch.py", "bench_mpi.py"):
        if not (anchors / need).is_file():
            ap.error(f"{anchors / need} not found (pass --anchors-dir)")
    if any(v in BASELINES for v in variants) and not Path(a.anchors_python).exists():
        ap.error(f"{a.anchors_python} not found (pass --anchors-python)")
    if any(v.startswith("mpi") for v in variants) and shutil.which("mpiexec") is None:
        ap.error("mpiexec not found on PATH")
    sys.path.insert(0, str(anchors))  # sysmon imports common from there
    import sysmon  # noqa: E402  (the anchors' own load guard, by path)

    t0 = time.time()
    clock = Clock(a.budget, a.rounds * len(nranks) * len(variants))
    runs: list[dict] = []
    rounds_done = 0
    with tempfile.TemporaryDirectory(prefix="tw-compare-") as tmp:
        workdir = Path(tmp)
        for rnd in range(a.rounds):
            per_round = (time.time() - t0) / rnd if rnd else 0.0
            if rnd >= 2 and time.time() - t0 + per_round > a.budget:
                log(f"stopping after {rnd} rounds: another would exceed --budget {a.budget:.0f} s "
                    "(the machine is slow or loaded)")
                break
            rounds_done = rnd + 1
            for n in nranks:
                order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
                log(f"round {rnd + 1}/{a.rounds}, n={n}: {', '.join(order)}")
                for v in order:
                    res = launch(v, n, a, sysmon, workdir, clock)
                    res["round"] = rnd
                    runs.append(res)
    elapsed = time.time() - t0

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = [f"# tensorwire vs Gloo vs Open MPI ({stamp})", "",
          f"`bench/compare.py --rounds {a.rounds} --nranks {a.nranks} --variants {','.join(variants)}` "
          f"({elapsed:.0f} s{'' if rounds_done == a.rounds else f', stopped after {rounds_done} rounds'}). "
          f"Cells: median over {rounds_done} interleaved rounds of each launch's median "
          "op time "
          "(op time = max over ranks); ratios: median (min-max) over rounds of the per-round time ratio, "
          "> 1 means tensorwire is slower. 8 B all_reduce and barrier: W=500, N=5000; 64 MiB all_reduce: "
          f"the anchors' schedule x {a.iter_scale:g}. † = foreign CPU load during the timed loop above the "
          "anchors' threshold even after re-runs. This machine is shared: compare ratios from one run, "
          "not absolute times across runs.", ""]
    md += machine_text(runs)
    summaries = []
    for n in nranks:
        lines, summary = summarize(runs, variants, n, rounds_done)
        summaries.append(summary)
        md += ["", f"## n={n}" + (" (oversubscribed)" if n > (os.cpu_count() or n) else ""), ""] + lines
    text = "\n".join(md) + "\n"
    print(text)
    if a.out_dir:
        out = Path(a.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.md").write_text(text)
        (out / "compare.json").write_text(json.dumps(
            {"generated": stamp, "args": vars(a), "elapsed_s": elapsed, "summary": summaries, "runs": runs},
            indent=1))
        log(f"wrote {out / 'compare.md'} and {out / 'compare.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
