"""`tensorwire bench`: nccl-tests style sweep of one collective (or all of them).

    tensorwire bench all_reduce -b 8 -e 64M -f 4 --np 2
    tensorwire bench all --np 4 --tcp -d double -o max --json out.json

Flags, columns and conventions follow nccl-tests (`all_reduce_perf -b 8 -e 128M -f 2 ...`):

* `size` is nccl-tests' size: the buffer for all_reduce / broadcast / reduce / sendrecv, the
  gathered output for all_gather / gather, the input for reduce_scatter / scatter, each
  rank's whole send buffer for alltoall. The element count is `size // itemsize`, rounded
  down to a multiple of the number of ranks for the split collectives, exactly as nccl-tests'
  `getCollByteCount` does; `count` is the per-rank parameter count nccl-tests prints.
* algbw = size / time (GB/s, 1e9 B/s); busbw = algbw x nccl-tests' factor: all_reduce
  2(n-1)/n; all_gather, reduce_scatter, alltoall, gather, scatter (n-1)/n; broadcast, reduce,
  sendrecv 1.
* time is nccl-tests' time: the mean call, the slowest rank's (its `-a 3`). Per size, W
  warm-up calls, a barrier, then N calls each timed with perf_counter on every rank, so that
  the distribution shows beside the mean: p50 and p99 over the calls, a call counted at its
  slowest rank (`benchmarks.sweep.summarize`). Per-call times are gathered to rank 0 with
  tensorwire itself after the loop.
* #wrong: after the timed loop the inputs are re-initialised, one more call is made and its
  result is compared element by element with a numpy reference built from every rank's
  input (`tensorwire.ops.reference.reference` for reductions). Inputs are small integers, exact in
  every dtype, so any summation order gives the same bits.

`--np N` starts N ranks through the launcher (`tensorwire run -n N -m tensorwire.tools.bench ...`);
inside a launched job (tensorwire run, torchrun, mpirun, srun) the bench just runs.
`barrier` is not an nccl-tests collective: it is shown as one row of size 0.

`--compare gloo,mpi` runs the same sweep through Gloo (torch.distributed) and Open MPI
(mpi4py) too, interleaved over `--rounds` rounds, and prints one comparison table per
collective (`tensorwire.tools.benchmarks.compare`). Cases, the timed loop and the statistics live
in `tensorwire.tools.benchmarks.sweep`, inputs and the check in `tensorwire.tools.benchmarks.check`: the
Gloo and MPI runners share them, so every library is measured the same way.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import ResourceError
from .benchmarks import progress, report, sweep, tcp_ceiling
from .benchmarks.loadmeter import job_meter
from .benchmarks.options import Options, parse_options, planned_cells
from .benchmarks.sweep import NO_INPLACE as _NO_INPLACE
from .benchmarks.sweep import ROOTED as _ROOTED
from .benchmarks.sweep import Buffers, measure
from .benchmarks.tw_calls import collect, make_case, sweep_pairs, time_str, wrong_line
from .launcher import launched_job_size

# ------------------------------------------------------------------------------------------
# Argument parsing



















# ------------------------------------------------------------------------------------------
# One timed case








# ------------------------------------------------------------------------------------------
# Output




def _cells(result: dict[str, Any] | None) -> str:
    if result is None:
        return f"  {'N/A':>7}  {'N/A':>7}  {'N/A':>7}  {'N/A':>6}  {'N/A':>6}  {'N/A':>6}"
    wrong = "N/A" if result["wrong"] < 0 else str(result["wrong"])
    return (f"  {time_str(result['time_us'])}  {time_str(result['p50_us'])}  {time_str(result['p99_us'])}"
            f"  {result['algbw_GBps']:6.2f}  {result['busbw_GBps']:6.2f}  {wrong:>6}")


def _header_lines(inplace_only: bool) -> list[str]:
    left = f"#{'size':>11}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}"
    units = f"#{'(B)':>11}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}"
    cols = f"  {'time':>7}  {'p50':>7}  {'p99':>7}  {'algbw':>6}  {'busbw':>6}  {'#wrong':>6}"
    cunits = f"  {'(us)':>7}  {'(us)':>7}  {'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}"
    width = len(cols)
    if inplace_only:
        title = "#" + " " * (len(left) - 1) + f"{'in-place':^{width}}"
        return [title.rstrip(), left + cols, units + cunits]
    title = "#" + " " * (len(left) - 1) + f"{'out-of-place':^{width}}" + f"{'in-place':^{width}}"
    return [title.rstrip(), left + cols + cols, units + cunits + cunits]


def format_row(size: int, count: int, type_name: str, op_name: str, root: int,
               cells: Sequence[dict[str, Any] | None]) -> str:
    head = f"{size:12d}  {count:12d}  {type_name:>8}  {op_name:>6}  {root:6d}"
    return head + "".join(_cells(c) for c in cells)


def _transport_of(tw: Any) -> str:
    try:
        channels = tw.world().runtime.engine.channels.values()
        kinds = sorted({c.kind for c in channels if c.kind != "pending"})
        return "+".join(kinds) if kinds else "none (1 rank)"
    except Exception:
        return "?"


# ------------------------------------------------------------------------------------------
# Driver


def relaunch(opts: Options) -> int:
    """`tensorwire run -n N [--tcp] -m tensorwire.tools.bench ARGS` and its exit code."""
    from . import launcher

    assert opts.args is not None
    cmd = ["-n", str(opts.args.nprocs)]
    if opts.args.tcp:
        cmd.append("--tcp")
    cmd += ["-m", "tensorwire.tools.bench", *opts.argv]
    return launcher.main(cmd, prog="tensorwire run")




def relaunch_with_progress(opts: Options) -> int:
    """relaunch(), with a progress bar on stderr fed by rank 0 (see `benchmarks.progress`).

    `--progress auto` shows it only when stderr is a terminal and stdout is not: the rows
    streaming to a terminal are progress enough, and the bar must not mix with them.
    """
    args = opts.args
    assert args is not None
    show = progress.wanted(args.progress) and not (args.progress == "auto" and sys.stdout.isatty())
    if not show or args.algo:
        return relaunch(opts)
    with tempfile.TemporaryDirectory(prefix="tw-bench-") as tmp:
        path = os.path.join(tmp, "progress")
        os.environ[progress.PROGRESS_ENV] = path
        try:
            with progress.Bar(planned_cells(opts), True) as bar, progress.Follower(path, bar):
                return relaunch(opts)
        finally:
            os.environ.pop(progress.PROGRESS_ENV, None)


def _count(value: int | None) -> str:
    return "auto" if value is None else str(value)


def _rank_banner(tw: Any, opts: Options) -> list[str]:
    n = tw.get_world_size()
    me = (tw.get_rank(), os.getpid(), socket.gethostname(), _transport_of(tw))
    everyone: list[Any] = [None] * n
    tw.all_gather_object(everyone, me)
    args = opts.args
    assert args is not None
    step = f"{args.stepfactor}(factor)" if args.stepfactor > 1 else f"{args.stepbytes}(bytes)"
    lines = [
        f"# tensorwire bench {' '.join(opts.colls) if len(opts.colls) == 1 else 'all'}  nranks {n}  "
        f"minBytes {args.minbytes} maxBytes {args.maxbytes} step: {step} warmup iters: "
        f"{_count(opts.warmup)} iters: {_count(opts.iters)} validation: {int(opts.check)}",
        "#",
    ]
    if not args.algo:  # an --algo sweep's columns differ: its own header says what they are (algos.py)
        lines += [
            f"# time = the mean of the {_count(opts.iters)} timed iterations on the slowest rank "
            "(nccl-tests' time); p50, p99 = median and",
            "# 99th percentile over the iterations of the slowest rank's time for each (every iteration "
            "timed",
            "# on every rank, after warm-up and a barrier"
            + ("; blocking: a barrier before each);" if opts.blocking else ");"),
            "# algbw = size / time, busbw = algbw x nccl-tests factor; 1 GB/s = 1e9 B/s",
            "#",
        ]
    lines.append("# Using ranks")
    for rank, pid, host, transport in everyone:
        lines.append(f"#  Rank {rank:2d} Pid {pid:7d} on {host:>12} transport {transport}")
    lines.append("#")
    return lines




def run_benchmark(opts: Options, out: Callable[[str], None] = print) -> int:
    import tensorwire as tw

    args = opts.args
    if args is not None and args.tcp:
        os.environ["TENSORWIRE_TRANSPORT"] = "tcp"
    reports = args is not None and not args.compare_member and bool(args.plot or args.markdown)
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        out(line)

    with tempfile.TemporaryDirectory(prefix="tw-bench-") as tmp:
        if reports and not opts.json_path:
            opts.json_path = os.path.join(tmp, "rows.json")
        tw.init()
        root = tw.get_rank() == 0
        doc: dict[str, Any] = {}  # the --json document, filled as the sweep goes
        try:
            code = _run(tw, opts, say if reports else out, doc)
        except KeyboardInterrupt:
            if root and "meta" in doc and opts.json_path:  # (nothing to write without --json or a report)
                _write_partial(opts, doc, lines, reports, args is not None and args.json is not None)
            raise
        finally:
            tw.destroy()
        if reports and root:
            _write_reports(opts, lines)
    return code


def _write_partial(opts: Options, doc: dict[str, Any], lines: list[str], reports: bool, asked: bool) -> None:
    """What an interrupted sweep measured, to --json (its meta marked `partial`) and --markdown
    or --plot (titled so), and where it went, on stderr."""
    assert opts.json_path is not None
    doc["meta"]["partial"] = "interrupted: only the sizes measured before it"
    report.write_json(opts.json_path, doc)
    written = [opts.json_path] if asked else []
    if reports:
        _write_reports(opts, [*lines, "# (interrupted: partial)"], partial=True)
        assert opts.args is not None
        written += [p for p in (opts.args.markdown, opts.args.plot if doc.get("rows") else None) if p]
    print(f"tensorwire bench: interrupted; what was measured before is in {', '.join(written)} (marked "
          f"partial)" if written else "tensorwire bench: interrupted", file=sys.stderr, flush=True)


def _write_reports(opts: Options, lines: list[str], partial: bool = False) -> None:
    """--plot / --markdown of a plain or --algo sweep (rank 0, from what it wrote as JSON; an
    --algo sweep writes no plot, parse_options says); `partial`: an interrupted one's."""
    args = opts.args
    assert args is not None and opts.json_path is not None
    with open(opts.json_path) as f:
        doc = json.load(f)
    meta = doc["meta"]
    info = report.machine()
    cut = " (partial: interrupted)" if partial else ""
    title = f"tensorwire, {meta['nranks']} ranks, transport {meta['transport']}, {info['host']}{cut}"
    plotted = args.plot if doc.get("rows") else None  # none where nothing was measured
    if plotted:
        report.plot(report.cells(doc["rows"]), plotted, title)
    if args.markdown:
        described = {"tensorwire": f"tensorwire {meta['version']}, transport {meta['transport']}"}
        body = ["```", *lines, "```"]
        method = report.ALGO_METHOD if args.algo else report.PLAIN_METHOD
        report.write_markdown(args.markdown, f"tensorwire bench: {meta['nranks']} ranks{cut}",
                              "tensorwire bench " + " ".join(opts.argv), method, info, described,
                              [], plotted, body)


def _run(tw: Any, opts: Options, out: Callable[[str], None], doc: dict[str, Any]) -> int:
    """The sweep; `doc`, the --json document, is filled as it goes (run_benchmark writes what an
    interrupted one holds)."""
    from ..ops.dtypes import dtype_name

    rank, n = tw.get_rank(), tw.get_world_size()
    say = out if rank == 0 else (lambda _line: None)
    args = opts.args
    if args is not None and args.nprocs is not None and args.nprocs != n:
        raise SystemExit(f"tensorwire bench: --np {args.nprocs} but this job has {n} ranks")
    if opts.root >= n:
        raise SystemExit(f"tensorwire bench: --root {opts.root} is out of range for {n} ranks")
    if not opts.dtypes:
        raise SystemExit("tensorwire bench: no usable datatype")

    # One pair of buffers for the largest case (bytes; viewed as each dtype).
    bufs = Buffers.for_cases(opts.colls, opts.sizes, opts.dtypes, n)
    pids: list[Any] = [None] * n
    tw.all_gather_object(pids, os.getpid())
    meter = job_meter(pids) if rank == 0 else None

    for line in _rank_banner(tw, opts):
        say(line)
    ceilings = _tcp_ceiling(tw) if args is not None and args.tcp_ceiling else []
    for line in tcp_ceiling.table(ceilings) if ceilings else []:
        say(line)
    meta = {
        "tool": "tensorwire bench", "version": getattr(tw, "__version__", "?"), "nranks": n,
        "transport": _transport_of(tw), "host": platform.node(), "python": platform.python_version(),
        "numpy": np.__version__, "argv": opts.argv, "warmup": opts.warmup or _count(opts.warmup),
        "iters": opts.iters or _count(opts.iters),
        "timing": "time: the slowest rank's mean iteration; p50/p99: over iterations, each at its "
                  "slowest rank",
    }
    rows: list[dict[str, Any]] = []
    doc.update(meta=meta)
    if args is not None and args.algo:
        from .benchmarks.algos import run_algos

        return exit_code(tw, run_algos(tw, opts, bufs, say, doc))
    doc.update(rows=rows)
    total_wrong = 0
    bw_sum, bw_count = 0.0, 0
    for coll in opts.colls:
        c_sum, c_count = 0.0, 0
        say(f"# Collective: {coll}" + (f"  (root {opts.root})" if coll in _ROOTED else ""))
        for line in _header_lines(opts.inplace_only):
            say(line.rstrip())
        for dt, op in sweep_pairs(opts, coll, rank, say):
            for nominal in (opts.sizes if coll != "barrier" else [0]):
                placements = [True] if opts.inplace_only else [False, True]
                cells: list[dict[str, Any] | None] = []
                size = count = 0
                for inplace in placements:
                    if inplace and coll in _NO_INPLACE:
                        cells.append(None)
                        continue
                    case = make_case(tw, coll, dt, op, opts.root, nominal, inplace, bufs)
                    size, count = case.size, case.param
                    m = measure(tw, case, opts.warmup, opts.iters, opts.check, meter, opts.blocking)
                    got = collect(tw, m)
                    if got is None:
                        cells.append({})
                        continue
                    cell = sweep.cell(coll, n, size, *got)
                    cells.append(cell)
                    wrong, busbw = cell["wrong"], cell["busbw_GBps"]
                    if wrong > 0:
                        total_wrong += wrong
                    if coll != "barrier":
                        bw_sum, bw_count = bw_sum + busbw, bw_count + 1
                        c_sum, c_count = c_sum + busbw, c_count + 1
                    rows.append(sweep.row(case, nominal, cell, m))
                    progress.note(f"{coll} {size} B {rows[-1]['placement']}")
                if rank == 0:
                    say(format_row(size, count, dtype_name(dt) if coll != "barrier" else "none",
                                   op or "none", opts.root if coll in _ROOTED else -1, cells))
        if len(opts.colls) > 1 and coll != "barrier":
            say(f"# Avg bus bandwidth ({coll}) : {c_sum / c_count if c_count else 0.0:.6g}")
            say("#")
    say(wrong_line(total_wrong, opts.check))
    if ceilings:
        best = max(ceilings, key=lambda c: c.gbps())
        for row in rows:
            bw = row.get("algbw_GBps")
            if row["coll"] == "sendrecv" and row["size"] >= 1 << 20 and bw:
                say(f"# sendrecv {row['size']:>10d} B: {bw:.2f} GB/s one way = "
                    f"{bw / ceilings[0].gbps():.2f} of one raw socket, "
                    f"{bw / best.gbps():.2f} of {best.streams} ({row['placement']})")
    dirty = sum(1 for r in rows if r["contaminated"])
    if dirty:
        say(f"# Foreign CPU load     : {dirty} of {len(rows)} timed loops (other processes used the CPU; "
            "foreign_cpu_s in --json)")
    avg = bw_sum / bw_count if bw_count else 0.0
    say(f"# Avg bus bandwidth    : {avg:.6g}")
    say("#")
    doc.update(avg_busbw_GBps=avg, wrong_total=total_wrong)
    if rank == 0 and opts.json_path:
        report.write_json(opts.json_path, doc)
    return exit_code(tw, total_wrong)




def _tcp_ceiling(tw: Any) -> list[tcp_ceiling.Ceiling]:
    """Rank 0 measures the machine's raw TCP while the others wait (their ranks idle)."""
    ceilings = tcp_ceiling.measure() if tw.get_rank() == 0 else []
    tw.barrier()
    return ceilings


def exit_code(tw: Any, total_wrong: int) -> int:
    """Every rank exits with the same code: 1 when any element was wrong (as nccl-tests)."""
    verdict = np.array([total_wrong], dtype=np.int64)
    tw.broadcast(verdict, 0)
    if tw.get_rank() == 0 and verdict[0]:
        print(f"tensorwire bench: {int(verdict[0])} wrong value(s), see the #wrong columns",
              file=sys.stderr, flush=True)
    return 1 if verdict[0] else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry of `tensorwire bench` (and of `python -m tensorwire.tools.bench` in every rank)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        opts = parse_options(argv)
    except SystemExit as exc:  # --help or a usage error: argparse already printed
        return exc.code if isinstance(exc.code, int) else 2
    except ValueError as exc:
        print(f"tensorwire bench: error: {exc}", file=sys.stderr)
        return 2
    assert opts.args is not None
    if opts.args.compare_member:
        opts.json_path = opts.args.compare_member  # one launch of --compare: its rows, nothing else
    elif opts.args.compare:
        return _compare(opts)
    elif opts.args.plot:
        try:
            report.check_plotting()
        except RuntimeError as exc:
            print(f"tensorwire bench: error: {exc}", file=sys.stderr)
            return 2
    if opts.args.nprocs is not None and launched_job_size() is None:
        if opts.args.nprocs > 1:
            return relaunch_with_progress(opts)
    elif launched_job_size() is None:
        print("# tensorwire bench: 1 rank (pass --np N for more, or start it under a launcher)",
              file=sys.stderr)
    try:
        return run_benchmark(opts)
    except KeyboardInterrupt:  # Ctrl-C: every rank stops; rank 0 said what it wrote (_write_partial)
        return 130
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 2
        return int(exc.code or 0)
    except ResourceError as exc:  # the sweep's sizes past this machine's limits: no traceback
        print(f"tensorwire bench: error: {exc}", file=sys.stderr)
        return 1


def _compare(opts: Options) -> int:
    from .benchmarks import compare

    if launched_job_size() is not None:
        print("tensorwire bench: error: --compare starts every library's job itself; run it outside a "
              "launcher (with --np N)", file=sys.stderr)
        return 2
    try:
        compare.validate(opts)
        return compare.run(opts)
    except (ValueError, RuntimeError) as exc:
        print(f"tensorwire bench: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
