"""`tensorwire bench`: end to end through the launcher, and the pieces it is built from.

The end-to-end runs use tiny sizes and iteration counts (a few seconds each); the checker is
tested directly with corrupted results, so a bench that reports #wrong 0 is known to be able
to report something else.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tensorwire.config import Config, parse_size, size_text
from tensorwire.ops import ReduceOp, Reduction
from tensorwire.tools.benchmarks import algos as bench_algo
from tensorwire.tools.benchmarks import check, options, report, sweep

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX launcher")


def _env() -> dict[str, str]:
    """Our environment without any launcher's variables, so `--np` really relaunches."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
            "SLURM_PROCID")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("TENSORWIRE_")}
    env["TENSORWIRE_TIMEOUT"] = "30"
    return env


def run_bench(*args: str, timeout: float = 45) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tensorwire", "bench", *args], env=_env(), text=True,
                          capture_output=True, timeout=timeout)


def data_rows(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line.strip() and not line.startswith("#")]


def assert_header(stdout: str) -> None:
    header = next(line for line in stdout.splitlines() if "redop" in line)
    for word in ("size", "count", "type", "redop", "root", "time", "p50", "p99", "algbw", "busbw", "#wrong"):
        assert word in header, (word, header)
    assert "out-of-place" in stdout and "in-place" in stdout
    assert "(us)" in stdout and "(GB/s)" in stdout
    assert "time = the mean" in stdout  # the header says how time is taken
    assert "# Avg bus bandwidth" in stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_all_reduce_sweep(tmp_path: Path, transport: str) -> None:
    out = tmp_path / "res.json"
    extra = ["--tcp"] if transport == "tcp" else []
    p = run_bench("all_reduce", "-b", "8", "-e", "64K", "-f", "4", "-n", "3", "-w", "1", "--np", "2",
                  "--json", str(out), *extra)
    assert p.returncode == 0, p.stdout + p.stderr
    assert_header(p.stdout)
    assert f"transport {transport}" in p.stdout
    rows = data_rows(p.stdout)
    sizes = [8 * 4 ** i for i in range(7)]  # 8 .. 32K (128K > 64K)
    assert [int(r[0]) for r in rows] == sizes
    for r in rows:  # per placement: time (the mean), p50, p99, algbw, busbw, #wrong
        assert len(r) == 17, r
        size, count, typ, op, root = int(r[0]), int(r[1]), r[2], r[3], int(r[4])
        assert (count, typ, op, root) == (size // 4, "float", "sum", -1)
        assert r[10] == "0" and r[16] == "0", r  # #wrong, out-of-place and in-place
        assert all(float(v) > 0 for v in (*r[5:8], *r[11:14]))
        assert float(r[6]) <= float(r[7]) and float(r[12]) <= float(r[13])  # p50 <= p99
        # busbw = algbw * 2(n-1)/n = algbw at n=2 (printed rounded)
        assert r[8] == r[9] and r[14] == r[15]
    res = json.loads(out.read_text())
    assert res["meta"]["nranks"] == 2 and res["wrong_total"] == 0
    assert len(res["rows"]) == 2 * len(sizes)
    assert {r["placement"] for r in res["rows"]} == {"out-of-place", "in-place"}
    for r in res["rows"]:
        assert r["wrong"] == 0 and r["iters"] == 3
        assert r["time_us"] == r["mean_us"]  # the headline is the mean call
        assert r["min_us"] <= r["p10_us"] <= r["p50_us"] <= r["p90_us"] <= r["p99_us"] <= r["max_us"]
        assert r["algbw_GBps"] == pytest.approx(r["size"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])


@pytest.mark.timeout(60)
def test_all_collectives_tiny(tmp_path: Path) -> None:
    out = tmp_path / "all.json"
    p = run_bench("all", "-b", "8", "-e", "256", "-f", "32", "-n", "2", "-w", "1", "--np", "2", "-r", "1",
                  "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    assert_header(p.stdout)
    res = json.loads(out.read_text())
    seen = {r["coll"] for r in res["rows"]}
    assert seen == set(sweep.COLLECTIVES)
    for coll in sweep.COLLECTIVES:
        rows = [r for r in res["rows"] if r["coll"] == coll]
        placements = {r["placement"] for r in rows}
        if coll in ("alltoall", "sendrecv", "barrier"):
            assert placements == {"out-of-place"}, coll
        else:
            assert placements == {"out-of-place", "in-place"}, coll
        nominal = {r["nominal"] for r in rows}
        assert nominal == ({0} if coll == "barrier" else {8, 256}), coll
        assert all(r["wrong"] == 0 for r in rows), coll
        if coll in ("broadcast", "reduce", "gather", "scatter"):
            assert all(r["root"] == 1 for r in rows)
    # nccl-tests' size semantics at n=2, 8 bytes of float: 2 elements, split ones 1 per rank
    ag = next(r for r in res["rows"] if r["coll"] == "all_gather" and r["nominal"] == 8)
    assert (ag["size"], ag["count"]) == (8, 1)
    assert sum(1 for r in data_rows(p.stdout)) == 9 * 2 + 1  # two sizes per collective, one barrier
    assert "N/A" in p.stdout  # in-place alltoall / sendrecv / barrier


@pytest.mark.timeout(60)
def test_options_dtype_op_inplace_only_nocheck() -> None:
    p = run_bench("reduce_scatter", "-b", "64", "-e", "64", "-n", "2", "-w", "0", "--np", "2",
                  "-d", "int32,bfloat16", "-o", "max,avg", "-I", "-c", "0")
    assert p.returncode == 0, p.stdout + p.stderr
    rows = data_rows(p.stdout)
    assert [(r[2], r[3]) for r in rows] == [("int32", "max"), ("int32", "avg"),
                                           ("bfloat16", "max"), ("bfloat16", "avg")]
    for r in rows:
        assert len(r) == 11 and r[10] == "N/A"  # in-place columns only, not checked
    assert "out-of-place" not in p.stdout


def test_the_headline_is_the_mean_call_with_its_tail_beside_it() -> None:
    """nccl-tests reports the mean over the timed iterations: so does the bench (the slowest
    rank's mean call), with the median and the 99th percentile of the calls (each at its slowest
    rank) beside it, so that a tail shows: 97 calls of 10 us and 3 of 1 ms have a median of
    10 us and a mean of 39.7 us. A tensorwire/other ratio is taken between means."""
    fast = [10e-6] * 97 + [1e-3] * 3
    stats = sweep.summarize([fast, [t / 2 for t in fast]])
    assert stats["time_us"] == stats["mean_us"] == pytest.approx(39.7)
    assert stats["p50_us"] == pytest.approx(10) and stats["p99_us"] == pytest.approx(1000)
    assert stats["min_us"] == pytest.approx(10) and stats["max_us"] == pytest.approx(1000)
    assert sweep.summarize([[10e-6] * 99 + [1e-3]])["p99_us"] == pytest.approx(10)  # one call in 100
    # ranks slow in turn (calls that overlap): each call is slow somewhere, no rank's loop is
    rank0, rank1 = [1e-6, 9e-6] * 10, [9e-6, 1e-6] * 10
    turns = sweep.summarize([rank0, rank1])
    assert turns["mean_us"] == pytest.approx(5) and turns["p50_us"] == pytest.approx(9)
    cell = sweep.cell("all_reduce", 2, 8, [fast], 0)
    assert cell["algbw_GBps"] == pytest.approx(8 / (cell["mean_us"] * 1e-6) / 1e9)


def test_blocking_puts_a_barrier_before_every_timed_call() -> None:
    """-z 1: each timed call after a barrier of its own (and the one before the loop), none
    between warm-up calls; without it only the one before the loop."""
    events: list[str] = []

    class Comm:
        def barrier(self) -> None:
            events.append("barrier")

    case = SimpleNamespace(coll="barrier", size=0, call=lambda: events.append("call"),
                           init_inputs=lambda sentinel: None)
    for blocking, want in ((True, ["call", "barrier", "barrier", "call", "barrier", "call"]),
                           (False, ["call", "barrier", "call", "call"])):
        events.clear()
        m = sweep.measure(Comm(), case, 1, 2, False, blocking=blocking)
        assert events == want and len(m.times) == 2
    p = run_bench("broadcast", "-b", "1K", "-e", "1K", "-n", "2", "-w", "0", "--np", "2", "-z", "1")
    assert p.returncode == 0 and "blocking: a barrier before each" in p.stdout, p.stdout + p.stderr


@pytest.mark.timeout(30)
def test_single_rank_without_launcher() -> None:
    p = run_bench("broadcast", "-b", "1K", "-e", "1K", "-n", "2", "-w", "0")
    assert p.returncode == 0, p.stdout + p.stderr
    rows = data_rows(p.stdout)
    assert len(rows) == 1 and rows[0][0] == "1024" and rows[0][10] == "0"


def test_sizes_past_memory_are_one_line_not_a_traceback() -> None:
    limit = 8 << 30  # address space: the 16 GiB buffer cannot be had whatever the overcommit policy
    p = subprocess.run([sys.executable, "-m", "tensorwire", "bench", "all_reduce", "-b", "16G", "-e", "16G",
                        "-n", "1", "-w", "0"], env=_env(), text=True, capture_output=True, timeout=45,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert "tensorwire bench: error: a buffer of" in p.stderr and "docs/limits.md" in p.stderr, p.stderr


@pytest.mark.timeout(30)
def test_usage_errors() -> None:
    assert run_bench("nonsense").returncode == 2
    p = run_bench("all_reduce", "-e", "lots")
    assert p.returncode == 2 and "cannot read size" in p.stderr
    p = run_bench("all_reduce", "-o", "xor")
    assert p.returncode == 2 and "--op" in p.stderr
    # output paths are checked before any rank starts (a folder failed after the whole sweep)
    p = run_bench("all_reduce", "--json", str(Path(__file__).parent))
    assert p.returncode == 2 and "is a directory" in p.stderr, p.stderr


def test_other_tools_usage_errors() -> None:
    """plan's --gamma must be a positive rate (-1 printed negative times, nan NaN ones), sizes
    must be finite; topo's --np inside a job (mpirun's too) would start a job per rank."""
    def tool(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tensorwire", *args], env={**_env(), **env}, text=True,
                              capture_output=True, timeout=45)

    for gamma in ("-1", "nan", "0"):
        p = tool("plan", "all_reduce", "1M", "--np", "4", "--no-probe", "--gamma", gamma)
        assert p.returncode == 2 and "--gamma must be a positive rate" in p.stderr, p.stderr
    p = tool("plan", "all_reduce", "inf", "--no-probe")
    assert p.returncode == 2 and "cannot read size 'inf'" in p.stderr, p.stderr
    p = tool("topo", "--np", "2", WORLD_SIZE="2", RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    assert p.returncode == 2 and "inside a job of 2 ranks" in p.stderr, p.stderr
    p = tool("topo", "--np", "2", OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="1")  # mpirun's
    assert p.returncode == 2 and "inside a job" in p.stderr, p.stderr


# ---------------------------------------------------------------------------------------------
# Pieces


def test_parse_size() -> None:
    assert parse_size("8") == 8
    assert parse_size("64K") == 64 << 10
    assert parse_size("1M") == 1 << 20
    assert parse_size("2G") == 2 << 30
    assert parse_size("256MB") == 256 << 20
    assert parse_size("4KiB") == 4 << 10


def test_one_size_reader_and_writer_for_settings_options_and_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """A negative size is refused wherever it is read, naming where it came from (the setting's
    reader once took "-8" for -8 bytes, the bench's options refused it); one formatter writes
    sizes, exactly where a table names them."""
    with pytest.raises(ValueError, match=r"^TENSORWIRE_SHM_RING='-8': expected a size of 0 or more$"):
        parse_size("-8", "TENSORWIRE_SHM_RING")
    with pytest.raises(ValueError, match=r"^'-8': expected a size of 0 or more$"):
        parse_size("-8")
    with pytest.raises(argparse.ArgumentTypeError, match="'-8': expected a size of 0 or more"):
        options.size_argument("-8")
    monkeypatch.setenv("TENSORWIRE_SHM_DIRECT", "-8")
    with pytest.raises(ValueError, match="TENSORWIRE_SHM_DIRECT='-8': expected a size of 0 or more"):
        Config.from_env()
    assert [size_text(n) for n in (0, 1536, 64 << 20, 13_893_632, 1_040_000, 3 << 40)] == \
        ["0 B", "1.5 KiB", "64 MiB", "13.2 MiB", "1016 KiB", "3 TiB"]
    assert [size_text(n, exact=True) for n in (1536, 1 << 20, (1 << 20) + 8)] == \
        ["1536 B", "1 MiB", "1048584 B"]
    assert sweep.busbw_factor("pingpong", 4) == 2.0  # a round trip timed: the rate one way


def test_size_list() -> None:
    assert sweep.size_list(8, 64 << 10, 4, 0) == [8 * 4 ** i for i in range(7)]
    assert sweep.size_list(8, 8, 2, 0) == [8]
    assert sweep.size_list(1 << 20, 3 << 20, 1, 1 << 20) == [1 << 20, 2 << 20, 3 << 20]


def test_counts_and_factors_match_nccl_tests() -> None:
    n = 4
    # 100 bytes of float = 25 elements: split collectives round down to 24 (6 per rank)
    assert sweep.coll_counts("all_reduce", 25, n) == (25, 25, 25)
    assert sweep.coll_counts("all_gather", 25, n) == (6, 24, 6)
    assert sweep.coll_counts("reduce_scatter", 25, n) == (24, 6, 6)
    assert sweep.coll_counts("alltoall", 25, n) == (24, 24, 6)
    assert sweep.coll_counts("gather", 25, n) == (6, 24, 6)
    assert sweep.coll_counts("scatter", 25, n) == (24, 6, 6)
    assert sweep.busbw_factor("all_reduce", n) == pytest.approx(1.5)
    for coll in ("all_gather", "reduce_scatter", "alltoall"):
        assert sweep.busbw_factor(coll, n) == pytest.approx(0.75)
    for coll in ("broadcast", "reduce", "sendrecv"):
        assert sweep.busbw_factor(coll, n) == 1.0


def test_fill_repeats_pattern_from_offset() -> None:
    pat = check.pattern(np.dtype(np.float32), "sum", 1)
    buf = np.empty(3 * check.PATTERN_LEN + 5, dtype=np.float32)
    check.fill(buf, pat, 7)
    idx = (np.arange(buf.size) + 7) % check.PATTERN_LEN
    assert np.array_equal(buf, pat[idx])


def test_count_wrong_flags_corruption() -> None:
    exp = np.arange(10, dtype=np.float32)
    assert check.count_wrong(exp.copy(), exp) == 0
    bad = exp.copy()
    bad[3] += 1
    bad[7] = np.nan
    assert check.count_wrong(bad, exp) == 2
    nan = np.full(3, np.nan, dtype=np.float64)
    assert check.count_wrong(nan, nan.copy()) == 0
    half = exp.astype(np.float16)
    wrong = half.copy()
    wrong[0] = 5
    assert check.count_wrong(wrong, half) == 1
    ints = np.arange(5, dtype=np.int8)
    assert check.count_wrong(ints[::-1].copy(), ints) == 4


@pytest.mark.parametrize("coll", ["all_reduce", "reduce_scatter", "all_gather", "alltoall", "broadcast",
                                  "scatter", "sendrecv"])
def test_checker_accepts_right_and_flags_wrong(coll: str) -> None:
    """Build the correct output of rank 1 of 3 by hand, check it passes, then corrupt it."""
    n, rank, root, param = 3, 1, 0, 2500  # param > PATTERN_LEN: chunk and period boundaries
    dt = np.dtype(np.float32)
    red = Reduction(ReduceOp.SUM)
    pats = [check.pattern(dt, "sum", r) for r in range(n)]
    send = sweep.coll_counts(coll, param * n if coll in ("reduce_scatter", "alltoall", "scatter",
                                                         "all_gather") else param, n)[0]
    inputs = [check.segment(p, 0, max(send, param * n)) for p in pats]
    if coll == "all_reduce":
        out = sum(x[:param] for x in inputs)
    elif coll == "reduce_scatter":
        out = sum(x[rank * param:(rank + 1) * param] for x in inputs)
    elif coll == "all_gather":
        out = np.concatenate([x[:param] for x in inputs])
    elif coll == "alltoall":
        out = np.concatenate([x[rank * param:(rank + 1) * param] for x in inputs])
    elif coll == "broadcast":
        out = inputs[root][:param]
    elif coll == "scatter":
        out = inputs[root][rank * param:(rank + 1) * param]
    else:  # sendrecv: from the previous rank
        out = inputs[(rank - 1) % n][:param]
    out = np.ascontiguousarray(out, dtype=dt)
    pieces = check.expected_pieces(coll, rank, n, root, param)
    assert check.check_result(out, pieces, pats, red) == 0
    corrupted = out.copy()
    corrupted[[0, 1500, out.size - 1]] += 1
    assert check.check_result(corrupted, pieces, pats, red) == 3
    # the right data in the wrong place (e.g. swapped blocks, another rank's data) is wrong too
    shifted = np.roll(out, 1)
    assert check.check_result(shifted, pieces, pats, red) > 0


def test_checker_reduction_uses_op() -> None:
    """A result reduced with the wrong op is flagged (max instead of sum)."""
    n, param = 2, 64
    dt = np.dtype(np.int32)
    pats = [check.pattern(dt, "sum", r) for r in range(n)]
    xs = [check.segment(p, 0, param) for p in pats]
    pieces = check.expected_pieces("all_reduce", 0, n, 0, param)
    assert check.check_result(xs[0] + xs[1], pieces, pats, Reduction(ReduceOp.SUM)) == 0
    assert check.check_result(np.maximum(xs[0], xs[1]), pieces, pats, Reduction(ReduceOp.SUM)) > 0


@pytest.mark.parametrize("dtype", options.DTYPES)
@pytest.mark.parametrize("op", options.OPS)
def test_patterns_are_order_independent(dtype: str, op: str) -> None:
    """Inputs are chosen so every reduction order gives the same bits: forward == backward fold."""
    from tensorwire.ops.dtypes import dtype_from_name
    from tensorwire.ops.reduce_op import as_reduction
    from tensorwire.ops.reference import reference

    dt = dtype_from_name(dtype)
    red = as_reduction(op)
    n = 5
    xs = [check.pattern(dt, op, r) for r in range(n)]
    with np.errstate(all="ignore"):
        fwd = reference(xs, red)
        bwd = reference(xs[::-1], red)
    assert check.count_wrong(fwd, bwd) == 0


# ---------------------------------------------------------------------------------------------
# --compare, --plot, --markdown, the progress bar, the foreign-load meter

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _mpi_python() -> str | None:
    """A Python with mpi4py (the one --compare would pick), when mpiexec exists too."""
    if shutil.which("mpiexec") is None:
        return None
    return sys.executable if importlib.util.find_spec("mpi4py") is not None else None


def comparison_rows(stdout: str, coll: str) -> tuple[list[str], list[list[str]]]:
    """(column heads, data rows) of one collective's comparison table."""
    lines = stdout.splitlines()
    at = lines.index(next(ln for ln in lines if ln.startswith(f"# Collective: {coll}")))
    heads = lines[at + 1].lstrip("#").split()
    rows = []
    for line in lines[at + 3:]:
        if line.startswith("#"):
            break
        rows.append(line.split())
    return heads, rows


@pytest.mark.timeout(90)
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed in the test venv")
def test_compare_gloo(tmp_path: Path) -> None:
    out, md, png = tmp_path / "cmp.json", tmp_path / "cmp.md", tmp_path / "cmp.png"
    extra = ["--plot", str(png)] if HAS_MATPLOTLIB else []
    p = run_bench("all_reduce", "-b", "8", "-e", "4K", "-f", "512", "-n", "5", "-w", "1", "--np", "2",
                  "--compare", "gloo", "--rounds", "2", "--json", str(out), "--markdown", str(md), *extra,
                  timeout=80)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "tensorwire is faster" in p.stdout  # the header says which way the ratio points
    heads, rows = comparison_rows(p.stdout, "all_reduce")
    assert heads == ["size", "tensorwire:oop", "tensorwire:ip", "gloo:ip", "tw/gloo"]
    assert [int(r[0]) for r in rows] == [8, 4096]
    res = json.loads(out.read_text())
    cmp = res["compare"]
    cells = {(c["lib"], c["placement"], c["nominal"]): c for c in cmp["cells"]}
    for r in rows:
        times = [float(v.rstrip("†").replace(",", "")) for v in r[1:4]]
        ratio = float(r[4].rstrip("†"))
        assert all(t > 0 for t in times), r
        # gloo's all_reduce is in place only: the ratio is the median over rounds of tensorwire's
        # in-place time over gloo's in the same round (not the ratio of the medians); of two
        # rounds, their geometric mean
        mine, theirs = cells[("tensorwire", "in-place", int(r[0]))], cells[("gloo", "in-place", int(r[0]))]
        per_round = [mine["rounds"][str(k)] / theirs["rounds"][str(k)] for k in mine["used_rounds"]]
        assert ratio == pytest.approx(statistics.geometric_mean(per_round), rel=0.05), (r, per_round)
    assert p.stderr.count("round ") == 4  # 2 rounds x (tensorwire, gloo), each reported

    assert res["rows"] and all(r["lib"] == "tensorwire" for r in res["rows"])  # nccl-tests rows kept
    assert cmp["libraries"] == ["tensorwire", "gloo"] and cmp["rounds"] == 2
    assert {(x["lib"], x["round"], x["rc"]) for x in cmp["launches"]} == {
        ("tensorwire", 1, 0), ("gloo", 1, 0), ("tensorwire", 2, 0), ("gloo", 2, 0)}
    gloo = [r for r in cmp["peer_rows"] if r["lib"] == "gloo"]
    assert gloo and all(r["wrong"] == 0 and r["placement"] == "in-place" for r in gloo)  # checked
    assert all("foreign_cpu_s" in r and "contaminated" in r for r in gloo)
    cells = {(c["lib"], c["placement"], c["nominal"]): c for c in cmp["cells"]}
    assert len(cells[("gloo", "in-place", 8)]["rounds"]) == 2
    assert {(r["other"], r["tw_placement"], r["other_placement"]) for r in cmp["ratios"]} == {
        ("gloo", "in-place", "in-place")}
    text = md.read_text()
    assert "--compare gloo" in text and "| size |" in text and "tw/gloo" in text and "CPUs" in text
    if HAS_MATPLOTLIB:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "cmp.png" in text


@pytest.mark.timeout(60)
def test_compare_mpi(tmp_path: Path) -> None:
    python = _mpi_python()
    if python is None:
        pytest.skip("needs mpiexec and a Python with mpi4py (apt-get install -y openmpi-bin libopenmpi-dev; "
                    "pip install mpi4py)")
    out = tmp_path / "cmp.json"
    p = run_bench("reduce_scatter", "-b", "1K", "-e", "1K", "-n", "5", "-w", "1", "--np", "2",
                  "--compare", "mpi", "--compare-python", python, "--rounds", "1", "--json", str(out),
                  timeout=50)
    assert p.returncode == 0, p.stdout + p.stderr
    heads, rows = comparison_rows(p.stdout, "reduce_scatter")
    # Reduce_scatter_block in place differs from nccl-tests' in place: only out-of-place is timed
    assert heads == ["size", "tensorwire:oop", "tensorwire:ip", "mpi:oop", "tw/mpi"]
    assert len(rows) == 1 and float(rows[0][4].rstrip("†")) > 0
    mpi = json.loads(out.read_text())["compare"]["peer_rows"]
    assert mpi and all(r["lib"] == "mpi" and r["wrong"] == 0 for r in mpi)


@pytest.mark.timeout(60)
def test_compare_missing_libraries_are_skipped_with_install_hints(tmp_path: Path) -> None:
    env = _env()
    env["PATH"] = str(tmp_path)  # no mpiexec here
    p = subprocess.run([sys.executable, "-m", "tensorwire", "bench", "barrier", "-n", "3", "-w", "1",
                        "--np", "2", "--compare", "gloo,mpi", "--compare-python", "/bin/false",
                        "--rounds", "1"],
                       env=env, text=True, capture_output=True, timeout=50)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "--compare gloo skipped" in p.stderr and "pip install 'tensorwire[torch]'" in p.stderr
    assert "--compare mpi skipped" in p.stderr and "apt-get install -y openmpi-bin libopenmpi-dev" in p.stderr
    assert "pip install mpi4py" in p.stderr
    heads, rows = comparison_rows(p.stdout, "barrier")
    assert heads == ["size", "tensorwire:oop"] and len(rows) == 1  # tensorwire alone still measured


@pytest.mark.timeout(60)
@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="matplotlib is not installed in the test venv")
def test_plain_plot_markdown_and_progress(tmp_path: Path) -> None:
    png, md = tmp_path / "p.png", tmp_path / "p.md"
    p = run_bench("broadcast", "-b", "8", "-e", "1K", "-f", "128", "-n", "3", "-w", "1", "--np", "2",
                  "--plot", str(png), "--markdown", str(md), "--progress", "on")
    assert p.returncode == 0, p.stdout + p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = md.read_text()
    assert "tensorwire bench broadcast" in text and "```" in text and "p.png" in text
    assert [int(r[0]) for r in data_rows(p.stdout)] == [8, 1024]  # stdout untouched by the bar
    assert "[tensorwire bench] 4/4" in p.stderr  # plain progress lines (stderr is no terminal)
    assert "[tensorwire bench]" not in p.stdout


@pytest.mark.timeout(30)
def test_plot_without_matplotlib_says_what_to_install(tmp_path: Path) -> None:
    fake = tmp_path / "matplotlib"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('hidden for the test')\n")
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    p = subprocess.run([sys.executable, "-m", "tensorwire", "bench", "all_reduce", "--np", "2", "--plot",
                        str(tmp_path / "x.png")], env=env, text=True, capture_output=True, timeout=25)
    assert p.returncode == 2 and "pip install 'tensorwire[bench]'" in p.stderr, p.stderr


def test_compare_usage_errors() -> None:
    assert run_bench("all_reduce", "--compare", "nccl").returncode == 2
    p = run_bench("all_reduce", "--compare", "gloo", "-d", "double")
    assert p.returncode == 2 and "float32" in p.stderr
    p = run_bench("all_reduce", "--algo", "ring", "-n", "auto")
    assert p.returncode == 2 and "auto" in p.stderr
    p = run_bench("all_reduce", "--algo", "ring", "--compare", "gloo")
    assert p.returncode == 2 and "--compare" in p.stderr
    # options that would be silently ignored, or fail after the sweep
    with pytest.raises(ValueError, match="--rounds repeats an --algo or --compare sweep"):
        options.parse_options(["all_reduce", "--rounds", "3"])
    with pytest.raises(ValueError, match="--plot draws a plain or --compare sweep"):
        options.parse_options(["all_reduce", "--algo", "all", "-n", "2", "-w", "1", "--plot", "/tmp/x.png"])


def test_auto_schedule() -> None:
    opts = options.parse_options(["all_reduce", "-n", "auto", "-w", "auto"])
    assert opts.iters is None and opts.warmup is None
    assert options.parse_options(["all_reduce", "--compare", "gloo"]).args.rounds == 3
    assert options.parse_options(["all_reduce"]).args.rounds == 1
    schedule = [sweep.schedule(1 << k) for k in range(0, 31)]
    assert all(w >= 1 and n >= 5 for w, n in schedule)
    assert [n for _, n in schedule] == sorted((n for _, n in schedule), reverse=True)  # fewer when larger


def _rows(lib: str, rnd: int, times: dict[int, float], placement: str = "out-of-place",
          dirty: bool = False, wrong: int = 0) -> list[dict]:
    return [{"lib": lib, "round": rnd, "coll": "all_reduce", "nominal": s, "size": s, "nranks": 2,
             "placement": placement, "type": "float", "redop": "sum", "time_us": t, "wrong": wrong,
             "contaminated": dirty} for s, t in times.items()]


def test_report_rounds_pairing_and_contamination() -> None:
    rows = (_rows("tensorwire", 1, {8: 10.0}) + _rows("tensorwire", 2, {8: 30.0})
            + _rows("tensorwire", 3, {8: 11.0}, dirty=True)
            + _rows("tensorwire", 1, {8: 5.0}, "in-place") + _rows("tensorwire", 2, {8: 6.0}, "in-place")
            + _rows("gloo", 1, {8: 20.0}, "in-place") + _rows("gloo", 2, {8: 24.0}, "in-place")
            + _rows("mpi", 1, {8: 1.0}) + _rows("mpi", 2, {8: 2.0})
            + _rows("mpi", 1, {8: 1.0}, "in-place", wrong=3)
            # 64 B: foreign load in every round
            + _rows("tensorwire", 1, {64: 20.0}, dirty=True) + _rows("tensorwire", 2, {64: 40.0}, dirty=True)
            + _rows("mpi", 1, {64: 2.0}) + _rows("mpi", 2, {64: 4.0}))
    cells = {(c.lib, c.placement, c.nominal): c for c in report.cells(rows)}
    tw8 = cells[("tensorwire", "out-of-place", 8)]
    # round 3 saw foreign load: the whole row uses rounds 1 and 2, for every library alike
    assert (tw8.time_us, tw8.used_rounds, tw8.contaminated) == (20.0, [1, 2], False)
    assert cells[("mpi", "in-place", 8)].wrong == 3
    tw64, mpi64 = cells[("tensorwire", "out-of-place", 64)], cells[("mpi", "out-of-place", 64)]
    assert (tw64.time_us, tw64.contaminated) == (30.0, True)  # no clean round: all of them, flagged
    assert (mpi64.time_us, mpi64.contaminated) == (3.0, False)
    ratios = {(r.other, r.nominal): r for r in report.ratios(rows, ["gloo", "mpi"])}
    g = ratios[("gloo", 8)]
    # gloo has in-place only: tensorwire's in-place is compared with it
    assert (g.tw_placement, g.other_placement, g.ratio) == ("in-place", "in-place", 0.25)
    m = ratios[("mpi", 8)]
    assert (m.tw_placement, m.per_round) == ("out-of-place", {1: 10.0, 2: 15.0})
    assert m.ratio == pytest.approx((10.0 * 15.0) ** 0.5)  # of two rounds, the geometric mean
    assert ratios[("mpi", 64)].contaminated and ratios[("mpi", 64)].ratio == 10.0
    tables = report.tables(report.cells(rows), report.ratios(rows, ["gloo", "mpi"]),
                           ["tensorwire", "gloo", "mpi"])
    text = "\n".join(report.text_tables(tables, 2, 3))
    assert "WRONG" in text and report.DAGGER in text and "tw/gloo" in text


def test_foreign_load_meter_counts_others_only(monkeypatch: pytest.MonkeyPatch) -> None:
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc")
    from tensorwire.tools.benchmarks.loadmeter import OWNER_ENV, ForeignLoad, contaminated

    monkeypatch.delenv(OWNER_ENV, raising=False)
    busy = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"
            "print(flush=True)\ntime.sleep(30)")
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    meter = ForeignLoad([ours.pid])
    meter.start()
    other = subprocess.Popen([sys.executable, "-c", busy], stdout=subprocess.PIPE)  # a sibling: not ours
    try:
        assert other.stdout is not None and other.stdout.readline()  # it has burnt its 0.4 s
        foreign = meter.stop()
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()
    assert foreign >= 0.3 and contaminated(foreign, 1.0)
    assert not contaminated(0.02, 1.0)


def test_peaks_script_reads_the_peaks_and_the_closest_gloo_cell(tmp_path) -> None:
    """bench/peaks.py: the largest bus bandwidth per library and collective over sizes and
    placements, tensorwire's against Open MPI's, and the cell where Gloo comes closest."""
    script = Path(__file__).parent.parent / "bench" / "peaks.py"
    spec = importlib.util.spec_from_file_location("peaks", script)
    peaks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peaks)

    def cell(lib: str, coll: str, size: int, placement: str, us: float, busbw: float) -> dict:
        return {"lib": lib, "coll": coll, "size": size, "placement": placement, "time_us": us,
                "busbw_GBps": busbw}

    cells = [cell("tensorwire", "all_gather", 1 << 20, "in-place", 100.0, 5.0),
             cell("tensorwire", "all_gather", 4 << 20, "in-place", 300.0, 7.0),
             cell("mpi", "all_gather", 1 << 20, "in-place", 50.0, 10.0),
             cell("gloo", "all_gather", 1 << 20, "in-place", 150.0, 3.0),
             cell("gloo", "all_gather", 4 << 20, "in-place", 1200.0, 1.75),
             cell("tensorwire", "barrier", 0, "in-place", 1.0, 0.0),
             cell("mpi", "barrier", 0, "in-place", 0.5, 0.0)]
    path = tmp_path / "compare.json"
    path.write_text(json.dumps({"compare": {"libraries": ["tensorwire", "gloo", "mpi"], "nranks": 2,
                                            "machine": {}, "cells": cells}}))
    lines = peaks.summarize(str(path))
    row = next(line for line in lines if line.startswith("all_gather"))
    assert "7 ( 4194304)" in row and "10 ( 1048576)" in row and row.endswith("0.70"), row
    assert not any(line.startswith("barrier") for line in lines)  # no bandwidth to speak of
    assert lines[-1].startswith("vs Gloo: 2 cells, closest 1.50x (all_gather 1048576 B in-place); 0 "), lines


def _algo_sweep():
    """bench/algo_sweep.py as a module (a script, not part of the package)."""
    script = Path(__file__).parent.parent / "bench" / "algo_sweep.py"
    spec = importlib.util.spec_from_file_location("algo_sweep", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_algo_sweep_merges_a_partial_sweep_into_the_tables() -> None:
    """bench/algo_sweep.py --merge: the collectives swept replace theirs in the earlier tables
    (results and launches, in place), the others and the earlier parameters stay, and the
    tables say what was merged in and when."""
    sweep_script = _algo_sweep()

    def launch(coll: str, when: str) -> dict:
        return {"coll": coll, "when": when}

    old = {"params": {"generated": "10:00", "iters": 5},
           "launches": [launch("reduce", "old"), launch("scatter", "old"), launch("scatter", "old"),
                        launch("gather", "old")],
           "results": {"reduce": ["r-old"], "scatter": ["s-old"], "gather": ["g-old"]}}
    params, launches, results = sweep_script.merged(
        old, {"generated": "11:00", "iters": 20}, [launch("scatter", "new"), launch("barrier", "new")],
        {"scatter": ["s-new"], "barrier": ["b-new"]})
    assert [(x["coll"], x["when"]) for x in launches] == [
        ("reduce", "old"), ("scatter", "new"), ("gather", "old"), ("barrier", "new")]
    assert results == {"reduce": ["r-old"], "scatter": ["s-new"], "gather": ["g-old"], "barrier": ["b-new"]}
    assert params["iters"] == 5 and params["merged"] == "barrier, scatter from a later run (11:00)"
    again, _, _ = sweep_script.merged({"params": params, "launches": launches, "results": results},
                                      {"generated": "12:00"}, [launch("gather", "newer")], {"gather": ["g"]})
    assert again["merged"] == "barrier, scatter from a later run (11:00); gather from a later run (12:00)"


def test_algo_sweep_judges_by_the_statistic_the_bench_recorded() -> None:
    """bench/algo_sweep.py's summary: the choice's two runs (auto, forced) count as agreeing only
    within 10% of each other, in the statistic the bench judged by (the mean call; older tables
    the median slowest rank); the last column sets the prediction beside the median slowest rank
    from 64 KiB; a size that misses the choice criterion shows its forced run's ratio."""
    sweep_script = _algo_sweep()

    def cell(time_us: float, mean_us: float, predicted_us: float = 100.0) -> dict:
        return {"time_us": time_us, "mean_us": mean_us, "predicted_us": predicted_us,
                "measured_over_predicted": time_us / predicted_us}

    older = {"size": 1 << 20, "auto": "ring", "best": "ring", "auto_over_best": 1.2,
             "chosen_over_best": 1.0,
             "cells": {"auto": cell(120, 100), "ring": cell(100, 100), "tree": cell(130, 120)}}
    newer = {"size": 16, "auto": "tree", "best": "ring", "auto_over_best": 1.3, "chosen_over_best": 1.25,
             "judged": "mean_us",
             "cells": {"auto": cell(200, 61), "ring": cell(100, 50), "tree": cell(125, 60)}}
    c = sweep_script.counts([older, newer])
    assert c["repeat_ok"] == [1, 2]  # 120 against 100 (medians): apart; 61 against 60 (means): together
    assert c["auto_ok"] == [0, 2] and c["choice_ok"] == [1, 2]
    assert c["median_ok"] == [1, 1]  # 16 B is below the prediction criterion's sizes
    table = "\n".join(sweep_script.collective_table([older, newer]))
    assert "1.20 ✗ (forced 1.00)" in table and "1.30 ✗ (forced 1.25)" in table
    assert "| 16 B | tree | 61 µs |" in table  # the newer row shows its mean call


def test_algo_sweep_lists_every_exception_by_kind() -> None:
    """bench/algo_sweep.py's exceptions: each point outside a criterion once, under its kind: the
    choice's own runs disagreeing (its forced run within 10%), a choice the model got wrong (with
    both prices and both times), a prediction outside ±30% from 64 KiB (with the forced run's)."""
    sweep_script = _algo_sweep()

    def cell(mean_us: float, predicted_us: float) -> dict:
        return {"mean_us": mean_us, "predicted_us": predicted_us}

    def row(size: int, auto: str, cells: dict) -> dict:
        return bench_algo.judge({"size": size, "auto": auto, "cells": cells}, "mean_us")

    noisy = row(16, "ring", {"auto": cell(130, 100), "ring": cell(100, 100), "tree": cell(105, 100)})
    wrong = row(1 << 20, "ring", {"auto": cell(200, 150), "ring": cell(200, 150), "tree": cell(100, 300)})
    fine = row(1 << 20, "tree", {"auto": cell(101, 100), "ring": cell(200, 150), "tree": cell(100, 100)})
    text = "\n".join(sweep_script.exceptions({"all_reduce": [noisy, wrong, fine]}))
    assert "of the best): 1\n\n- all_reduce 16 B: ring, auto 1.30x the best, forced 1.00x" in text
    assert ("first: 1\n\n- all_reduce 1 MiB: chose ring (priced 150 µs, ran 200 µs forced), tree ran 100 µs "
            "(priced 300 µs): priced 2.00x, ran 0.50x the choice; auto 2.00x the best") in text
    assert "(≥ 64 KiB): 1\n\n- all_reduce 1 MiB: ring measured 1.33x its price, its forced run 1.33x" in text
    assert text.count("\n- ") == 3, text


def test_bench_command_line_as_the_api_names_it() -> None:
    """`--device` is in `bench --help`; the API's all_to_all is the sweep's alltoall; CUDA without a
    device is a clear error, not a crash of every rank."""
    helped = run_bench("--help")
    assert helped.returncode == 0 and "--device {cpu,cuda}" in helped.stdout, helped.stdout
    assert "/opt/" not in helped.stdout  # no machine's path in the help
    assert options.parse_options(["all_to_all"]).colls == ["alltoall"]
    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a CUDA device")
    nocuda = run_bench("--device", "cuda", "all_reduce", "-b", "8", "-e", "8")
    assert nocuda.returncode == 2, nocuda.stdout + nocuda.stderr
    assert "no CUDA device" in nocuda.stderr or "needs torch" in nocuda.stderr, nocuda.stderr
    assert "Traceback" not in nocuda.stderr, nocuda.stderr


def test_topology_repr_names_ranks_and_hosts() -> None:
    from tensorwire.tuning.topology import RankInfo, Topology

    ranks = [RankInfo(r, host, host, 100 + r, "127.0.0.1", "lo", (r,), (0,))
             for r, host in enumerate(("a", "a", "b"))]
    assert repr(Topology(ranks)) == "<tensorwire.Topology: 3 ranks on 2 host(s)>"


@pytest.mark.timeout(90)
def test_tcp_ceiling_beside_sendrecv() -> None:
    """--tcp-ceiling prints what raw sockets move here with 1, 2, 4 and 8 streams, and sendrecv's
    bandwidth as a fraction of it; the probe moves every byte (an odd size over 3 sockets)."""
    from tensorwire.tools.benchmarks import tcp_ceiling

    small = tcp_ceiling.measure(streams=(1, 3), nbytes=(1 << 20) + 5, rounds=2)
    assert [c.streams for c in small] == [1, 3] and all(len(c.seconds) == 2 and c.gbps() > 0 for c in small)
    p = run_bench("sendrecv", "-b", "1M", "-e", "1M", "-n", "3", "-w", "1", "--np", "2", "--tcp",
                  "--tcp-ceiling", timeout=80)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("# TCP ceiling of this machine"))
    assert [int(line.split()[1]) for line in lines[at + 2:at + 6]] == [1, 2, 4, 8]
    assert all(float(line.split()[-1]) > 0 for line in lines[at + 2:at + 6])
    assert any(line.startswith("# sendrecv    1048576 B:") and "of one raw socket" in line for line in lines)


@pytest.mark.timeout(60)
def test_the_recorded_commit_counts_changes_anywhere_in_the_package(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`(git <sha>)` lacked `+changes` while the library was modified: only src/tensorwire/tools
    was looked at. The whole package is, a new file in it included."""
    import tensorwire

    asked: list[str] = []
    monkeypatch.setattr(report, "_git_commit", lambda folder: asked.append(folder) or "abc1234")
    assert report.machine()["tensorwire"].endswith("(git abc1234)")
    assert asked == [str(Path(tensorwire.__file__).resolve().parent)]
    monkeypatch.undo()
    if shutil.which("git") is None:
        pytest.skip("no git")
    package = tmp_path / "src" / "pkg"
    (package / "tools").mkdir(parents=True)
    (package / "core.py").write_text("x = 1\n")
    (package / "tools" / "bench.py").write_text("y = 1\n")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    clean = report._git_commit(str(package))
    assert clean is not None and not clean.endswith("+changes")
    (package / "core.py").write_text("x = 2\n")
    assert report._git_commit(str(package)) == f"{clean}+changes"
    subprocess.run([*git, "checkout", "-q", "src/pkg/core.py"], check=True)
    (package / "new.py").write_text("z = 1\n")
    assert report._git_commit(str(package)) == f"{clean}+changes"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("written", [True, False])
def test_ctrl_c_stops_every_rank_without_a_traceback_and_keeps_what_was_measured(tmp_path: Path,
                                                                                written: bool) -> None:
    """Ctrl-C (SIGINT to the driver) during a sweep: exit 130, and every rank printed a
    KeyboardInterrupt traceback while --json was not written (a tester). Now no traceback,
    and --json and --markdown hold the sizes measured before it, marked partial (without
    them, nothing is written: that raised an AssertionError)."""
    out, doc, page = tmp_path / "out.txt", tmp_path / "p.json", tmp_path / "p.md"
    with open(out, "w") as stdout:
        argv = ["all_reduce", "-b", "8", "-e", "64M", "-n", "200", "-w", "1", "--np", "2",
                *(["--json", str(doc), "--markdown", str(page)] if written else [])]
        proc = subprocess.Popen([sys.executable, "-m", "tensorwire", "bench", *argv],
                                env={**_env(), "TENSORWIRE_CALIBRATE": "0"}, stdout=stdout,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while not data_rows(out.read_text()) and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.2)
            assert data_rows(out.read_text()), "no size measured within 60 s"
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=40)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    if not written:
        return
    assert f"what was measured before is in {doc}, {page} (marked partial)" in err, err
    written = json.loads(doc.read_text())
    assert written["meta"]["partial"].startswith("interrupted") and written["rows"], written["meta"]
    assert {r["size"] for r in written["rows"]} >= {8}
    assert "(partial: interrupted)" in page.read_text()
