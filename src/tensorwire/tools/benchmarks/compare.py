"""`tensorwire bench --compare gloo,mpi`: the same sweep through tensorwire, Gloo and Open MPI.

Every round launches each library once, in the order tensorwire, gloo, mpi, and each launch
measures the whole sweep (collectives x sizes x placements, float32 sum, the same schedule);
R rounds (`--rounds`, default 3) interleave them, so the slow drifts of a shared machine hit
every library alike, and the tables give the median over rounds of each mean call (see `report`):

    tensorwire  python -m tensorwire run -n N -m tensorwire.tools.bench ARGS  (the user's own arguments)
    gloo        PY -m torch.distributed.run --nproc-per-node N ... -m tensorwire.tools.benchmarks.gloo_runner
    mpi         mpiexec --allow-run-as-root --oversubscribe -n N PY -m tensorwire.tools.benchmarks.mpi_runner

PY is `--compare-python`, else this interpreter. The peers import this very tensorwire
(through a PYTHONPATH folder holding nothing but a link to the package) for the shared sweep,
inputs and checks.
A library that cannot run here is skipped with the command that installs it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import gloo_runner, mpi_runner, progress, report, sweep
from .loadmeter import OWNER_ENV
from .options import Options, planned_cells
from .peer import placements_to_run

LAUNCH_TIMEOUT_S = 3600.0
INSTALL = {
    "torch": "pip install 'tensorwire[torch]'",
    "mpiexec": "apt-get install -y openmpi-bin libopenmpi-dev",
    "mpi4py": "pip install mpi4py",
}
_PLACEMENTS = {"gloo": gloo_runner.placements, "mpi": mpi_runner.placements}
_LOG_TAIL = 15


def validate(opts: Options) -> None:
    """What --compare can time the same way everywhere; raises ValueError with the reason."""
    if [dt.str for dt in opts.dtypes] != ["<f4"] or opts.ops != ["sum"]:
        raise ValueError("--compare times float32 sums only (-d float -o sum, the defaults)")


def _has_modules(python: str, modules: list[str]) -> bool:
    if os.path.abspath(python) == os.path.abspath(sys.executable):  # not realpath: venvs link one binary
        return all(importlib.util.find_spec(m) is not None for m in modules)
    probe = "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))"
    try:
        done = subprocess.run([python, "-c", probe, *modules], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def find_peers(names: list[str], explicit: str | None) -> tuple[dict[str, str], list[str]]:
    """({library: python that runs it}, messages about the libraries skipped and why)."""
    python = explicit or sys.executable
    found, notes = {}, []
    for name in names:
        module = "torch" if name == "gloo" else "mpi4py"
        if name == "mpi" and shutil.which("mpiexec") is None:
            notes.append("tensorwire bench: --compare mpi skipped: mpiexec not found on PATH. Install Open "
                         f"MPI with `{INSTALL['mpiexec']}`, then `{INSTALL['mpi4py']}`.")
            continue
        if not _has_modules(python, ["numpy", module]):
            first = f" (Open MPI first: `{INSTALL['mpiexec']}`)" if name == "mpi" else ""
            hint = f"`{INSTALL[module]}`{first}"
            notes.append(f"tensorwire bench: --compare {name} skipped: no Python with {module} and numpy "
                         f"(tried {python}). Install it with {hint}, or pass "
                         "--compare-python PATH.")
            continue
        found[name] = python
    return found, notes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Launch:
    lib: str
    round: int
    cmd: list[str]
    rc: int | str = 0
    wall_s: float = 0.0
    rows: list[dict[str, Any]] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    log_tail: list[str] = field(default_factory=list)


class Driver:
    """Starts the launches of one comparison and keeps what they wrote."""

    def __init__(self, opts: Options, n: int, peers: dict[str, str], workdir: Path) -> None:
        self.opts, self.n, self.peers, self.workdir = opts, n, peers, workdir
        link = workdir / "pythonpath"
        link.mkdir()
        package = Path(__file__).resolve().parents[2]  # tensorwire/tools/benchmarks/compare.py
        (link / "tensorwire").symlink_to(package, target_is_directory=True)
        self.pythonpath = str(link)
        self.progress_file = str(workdir / "progress")

    def _peer_args(self, out: Path) -> list[str]:
        o = self.opts
        return ["--colls", ",".join(o.colls), "--sizes", ",".join(map(str, o.sizes)),
                "--placements", "in-place" if o.inplace_only else ",".join(sweep.PLACEMENTS),
                "--root", str(o.root), "--warmup", "auto" if o.warmup is None else str(o.warmup),
                "--iters", "auto" if o.iters is None else str(o.iters), "--check", str(int(o.check)),
                "--blocking", str(int(o.blocking)),
                "--out", str(out)]

    def command(self, lib: str, out: Path) -> list[str]:
        n = str(self.n)
        if lib == report.TENSORWIRE:
            return [sys.executable, "-m", "tensorwire", "run", "-n", n, "-m", "tensorwire.tools.bench",
                    *self.opts.argv, "--compare-member", str(out)]
        python = self.peers[lib]
        if lib == "gloo":
            return [python, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", n,
                    "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                    "-m", "tensorwire.tools.benchmarks.gloo_runner", *self._peer_args(out)]
        return ["mpiexec", "--allow-run-as-root", "--oversubscribe", "-n", n, python,
                "-m", "tensorwire.tools.benchmarks.mpi_runner", *self._peer_args(out)]

    def env(self, lib: str) -> dict[str, str]:
        env = dict(os.environ)
        env[OWNER_ENV] = str(os.getpid())
        env[progress.PROGRESS_ENV] = self.progress_file
        if lib != report.TENSORWIRE:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [self.pythonpath, env.get("PYTHONPATH")]))
        return env

    def launch(self, lib: str, rnd: int) -> Launch:
        out = self.workdir / f"{lib}-{rnd}.json"
        log = self.workdir / f"{lib}-{rnd}.log"
        result = Launch(lib, rnd, self.command(lib, out))
        t0 = time.monotonic()
        with open(log, "w") as lf:
            proc = subprocess.Popen(result.cmd, stdout=lf, stderr=subprocess.STDOUT, env=self.env(lib),
                                    start_new_session=True)
            try:
                result.rc = proc.wait(timeout=LAUNCH_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                result.rc = "timeout"
                _kill(proc)
            except BaseException:  # Ctrl-C: the launch has a session of its own and did not see it
                _kill(proc)
                raise
        result.wall_s = time.monotonic() - t0
        result.log_tail = log.read_text(errors="replace").splitlines()[-_LOG_TAIL:]
        if result.rc == 0 and out.exists():
            doc = json.loads(out.read_text())
            result.meta = doc.get("meta", {})
            result.rows = [{**r, "lib": lib, "round": rnd} for r in doc.get("rows", [])]
        elif result.rc == 0:
            result.rc = "no results"
        return result

    def planned_cells(self) -> int:
        """Timed loops per round, for the progress bar."""
        o = self.opts
        wanted = ["in-place"] if o.inplace_only else list(sweep.PLACEMENTS)
        total = planned_cells(o)
        for coll in o.colls:
            sizes = 1 if coll == "barrier" else len(o.sizes)
            total += sum(sizes * len(placements_to_run(_PLACEMENTS[lib](coll), wanted)) for lib in self.peers)
        return total


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """End one of our launches with everything it started (its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _describe(lib: str, launches: list[Launch], python: str | None) -> str:
    meta = next((x.meta for x in launches if x.lib == lib and x.meta), {})
    if lib == report.TENSORWIRE:
        return (f"{meta.get('version', '?')}, transport {meta.get('transport', '?')}, "
                "launched by `tensorwire run`")
    how = ("`python -m torch.distributed.run`" if lib == "gloo"
           else "`mpiexec --allow-run-as-root --oversubscribe`")
    return f"{meta.get('library', '?')}, launched by {how} with {python}"


def run(opts: Options) -> int:
    """The whole comparison; prints the tables, writes --json / --markdown / --plot."""
    args = opts.args
    assert args is not None
    n = args.nprocs or 2
    if args.plot:
        report.check_plotting()  # before the sweep, not after it
    peers, notes = find_peers(args.compare, args.compare_python)
    for note in notes:
        print(note, file=sys.stderr, flush=True)
    libs = [report.TENSORWIRE, *peers]
    started = time.time()
    launches: list[Launch] = []
    with tempfile.TemporaryDirectory(prefix="tw-compare-") as tmp:
        driver = Driver(opts, n, peers, Path(tmp))
        per_round = driver.planned_cells()
        bar = progress.Bar(per_round * args.rounds, progress.wanted(args.progress),
                           "tensorwire bench --compare")
        with bar, progress.Follower(driver.progress_file, bar):
            for rnd in range(1, args.rounds + 1):
                for lib in libs:
                    got = driver.launch(lib, rnd)
                    launches.append(got)
                    dirty = sum(1 for r in got.rows if r.get("contaminated"))
                    if got.rc == 0:
                        status = f"{len(got.rows)} cells in {got.wall_s:.1f} s" + (
                            f", {dirty} with foreign CPU load" if dirty else "")
                    else:
                        tail = "\n    ".join(got.log_tail)
                        status = (f"FAILED ({got.rc}) after {got.wall_s:.1f} s; last lines of its output:\n"
                                  f"    {tail}\n  command: {shlex.join(got.cmd)}")
                    bar.log(f"round {rnd}/{args.rounds} {lib}: {status}")
    return _finish(opts, n, libs, peers, notes, launches, time.time() - started)


def _finish(opts: Options, n: int, libs: list[str], peers: dict[str, str], notes: list[str],
            launches: list[Launch], elapsed: float) -> int:
    args = opts.args
    assert args is not None
    rows = [r for x in launches for r in x.rows]
    tw_rows = [r for r in rows if r["lib"] == report.TENSORWIRE]
    if not tw_rows:
        print("tensorwire bench: --compare: no tensorwire launch succeeded; nothing to compare",
              file=sys.stderr)
        return 1
    cells = report.cells(rows)
    ratios = report.ratios(rows, list(peers))
    tables = report.tables(cells, ratios, libs)
    command = "tensorwire bench " + shlex.join(opts.argv)
    described = {lib: _describe(lib, launches, peers.get(lib)) for lib in libs}
    info = report.machine()
    header = [f"# {command}", f"# {n} ranks on {info['host']} ({info['cpus']} CPUs), {args.rounds} round(s) "
              f"in {elapsed:.0f} s; order per round: {', '.join(libs)}"]
    header += [f"#   {lib}: {what}" for lib, what in described.items()]
    header += [f"#   {note.removeprefix('tensorwire bench: --compare ')}" for note in notes]
    text = header + ["#"] + report.text_tables(tables, n, args.rounds)
    print("\n".join(text), flush=True)

    failed = [x for x in launches if x.rc != 0]
    wrong_peer = sorted({(c.lib, c.coll) for c in cells if c.lib != report.TENSORWIRE and c.wrong > 0})
    for lib, coll in wrong_peer:
        print(f"tensorwire bench: {lib} computed wrong results for {coll} (the cells marked WRONG); they are "
              "not compared", file=sys.stderr)
    tw_wrong = sum(r["wrong"] for r in tw_rows if r["wrong"] > 0)
    if tw_wrong:
        print(f"tensorwire bench: tensorwire computed {tw_wrong} wrong value(s)", file=sys.stderr)
    if opts.json_path:
        busbws = [r["busbw_GBps"] for r in tw_rows if r["coll"] != "barrier"]
        tw_meta = next(x.meta for x in launches if x.lib == report.TENSORWIRE and x.meta)
        doc = {"meta": {**tw_meta, "argv": opts.argv}, "rows": tw_rows,
               "avg_busbw_GBps": sum(busbws) / len(busbws) if busbws else 0.0, "wrong_total": tw_wrong,
               "compare": {"libraries": libs, "skipped": notes, "described": described, "nranks": n,
                           "rounds": args.rounds, "elapsed_s": elapsed, "machine": info,
                           "cells": report.cells_json(cells), "ratios": report.ratios_json(ratios),
                           "peer_rows": [r for r in rows if r["lib"] != report.TENSORWIRE],
                           "launches": [{"lib": x.lib, "round": x.round, "cmd": x.cmd, "rc": x.rc,
                                         "wall_s": x.wall_s} for x in launches]}}
        path = os.path.abspath(opts.json_path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        report.plot(cells, args.plot, f"{' vs '.join(libs)}, {n} ranks, {info['host']}")
    if args.markdown:
        method = (f"{args.rounds} interleaved round(s) in {elapsed:.0f} s, each launching every "
                  f"library once (order: {', '.join(libs)}) for the whole sweep. Time (us): the median "
                  "over rounds of each round's mean call, the slowest rank's, as nccl-tests reports it "
                  "(warm-up calls, a barrier, then every call timed on every rank). tw/X: "
                  "tensorwire's time over X's, the median over rounds of the per-round ratio; **< 1 means "
                  "tensorwire is faster**. Each row uses the rounds in which none of its cells saw foreign "
                  "CPU load (other users of this shared machine); where every round saw some, all rounds, "
                  f"and {report.DAGGER} marks the cells that saw it. oop / ip: out-of-place / in-place. "
                  "WRONG: the library's result failed the check against the numpy reference.")
        report.write_markdown(args.markdown, f"{' vs '.join(libs)}: {n} ranks", command, method, info,
                              described, [x.removeprefix("tensorwire bench: --compare ") for x in notes],
                              args.plot, report.markdown_tables(tables))
    return 1 if failed or wrong_peer or tw_wrong else 0

