"""`tensorwire bench`: end to end through the launcher, and the pieces it is built from.

The end-to-end runs use tiny sizes and iteration counts (a few seconds each); the checker is
tested directly with corrupted results, so a bench that reports #wrong 0 is known to be able
to report something else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tensorwire import bench
from tensorwire.ops import ReduceOp, Reduction

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
    for word in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong"):
        assert word in header, (word, header)
    assert "out-of-place" in stdout and "in-place" in stdout
    assert "(us)" in stdout and "(GB/s)" in stdout
    assert "median" in stdout  # the header says how time is taken
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
    for r in rows:
        assert len(r) == 13, r
        size, count, typ, op, root = int(r[0]), int(r[1]), r[2], r[3], int(r[4])
        assert (count, typ, op, root) == (size // 4, "float", "sum", -1)
        assert r[8] == "0" and r[12] == "0", r  # #wrong, out-of-place and in-place
        assert float(r[5]) > 0 and float(r[9]) > 0
        # busbw = algbw * 2(n-1)/n = algbw at n=2 (printed rounded)
        assert r[6] == r[7] and r[10] == r[11]
    res = json.loads(out.read_text())
    assert res["meta"]["nranks"] == 2 and res["wrong_total"] == 0
    assert len(res["rows"]) == 2 * len(sizes)
    assert {r["placement"] for r in res["rows"]} == {"out-of-place", "in-place"}
    for r in res["rows"]:
        assert r["wrong"] == 0 and r["iters"] == 3
        assert r["p10_us"] <= r["time_us"] <= r["p90_us"] + 1e-9
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
    assert seen == set(bench.COLLECTIVES)
    for coll in bench.COLLECTIVES:
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
        assert len(r) == 9 and r[8] == "N/A"  # in-place columns only, not checked
    assert "out-of-place" not in p.stdout


@pytest.mark.timeout(30)
def test_single_rank_without_launcher() -> None:
    p = run_bench("broadcast", "-b", "1K", "-e", "1K", "-n", "2", "-w", "0")
    assert p.returncode == 0, p.stdout + p.stderr
    rows = data_rows(p.stdout)
    assert len(rows) == 1 and rows[0][0] == "1024" and rows[0][8] == "0"


@pytest.mark.timeout(30)
def test_usage_errors() -> None:
    assert run_bench("nonsense").returncode == 2
    p = run_bench("all_reduce", "-e", "lots")
    assert p.returncode == 2 and "cannot read size" in p.stderr
    p = run_bench("all_reduce", "-o", "xor")
    assert p.returncode == 2 and "--op" in p.stderr


# ---------------------------------------------------------------------------------------------
# Pieces


def test_parse_size() -> None:
    assert bench.parse_size("8") == 8
    assert bench.parse_size("64K") == 64 << 10
    assert bench.parse_size("1M") == 1 << 20
    assert bench.parse_size("2G") == 2 << 30
    assert bench.parse_size("256MB") == 256 << 20
    assert bench.parse_size("4KiB") == 4 << 10


def test_size_list() -> None:
    assert bench.size_list(8, 64 << 10, 4, 0) == [8 * 4 ** i for i in range(7)]
    assert bench.size_list(8, 8, 2, 0) == [8]
    assert bench.size_list(1 << 20, 3 << 20, 1, 1 << 20) == [1 << 20, 2 << 20, 3 << 20]


def test_counts_and_factors_match_nccl_tests() -> None:
    n = 4
    # 100 bytes of float = 25 elements: split collectives round down to 24 (6 per rank)
    assert bench.coll_counts("all_reduce", 25, n) == (25, 25, 25)
    assert bench.coll_counts("all_gather", 25, n) == (6, 24, 6)
    assert bench.coll_counts("reduce_scatter", 25, n) == (24, 6, 6)
    assert bench.coll_counts("alltoall", 25, n) == (24, 24, 6)
    assert bench.coll_counts("gather", 25, n) == (6, 24, 6)
    assert bench.coll_counts("scatter", 25, n) == (24, 6, 6)
    assert bench.effective_bytes("all_gather", 100, 4, n) == (96, 6)
    assert bench.busbw_factor("all_reduce", n) == pytest.approx(1.5)
    for coll in ("all_gather", "reduce_scatter", "alltoall"):
        assert bench.busbw_factor(coll, n) == pytest.approx(0.75)
    for coll in ("broadcast", "reduce", "sendrecv"):
        assert bench.busbw_factor(coll, n) == 1.0


def test_fill_repeats_pattern_from_offset() -> None:
    pat = bench.pattern(np.dtype(np.float32), "sum", 1)
    buf = np.empty(3 * bench.PATTERN_LEN + 5, dtype=np.float32)
    bench.fill(buf, pat, 7)
    idx = (np.arange(buf.size) + 7) % bench.PATTERN_LEN
    assert np.array_equal(buf, pat[idx])


def test_count_wrong_flags_corruption() -> None:
    exp = np.arange(10, dtype=np.float32)
    assert bench.count_wrong(exp.copy(), exp) == 0
    bad = exp.copy()
    bad[3] += 1
    bad[7] = np.nan
    assert bench.count_wrong(bad, exp) == 2
    nan = np.full(3, np.nan, dtype=np.float64)
    assert bench.count_wrong(nan, nan.copy()) == 0
    half = exp.astype(np.float16)
    wrong = half.copy()
    wrong[0] = 5
    assert bench.count_wrong(wrong, half) == 1
    ints = np.arange(5, dtype=np.int8)
    assert bench.count_wrong(ints[::-1].copy(), ints) == 4


@pytest.mark.parametrize("coll", ["all_reduce", "reduce_scatter", "all_gather", "alltoall", "broadcast",
                                  "scatter", "sendrecv"])
def test_checker_accepts_right_and_flags_wrong(coll: str) -> None:
    """Build the correct output of rank 1 of 3 by hand, check it passes, then corrupt it."""
    n, rank, root, param = 3, 1, 0, 2500  # param > PATTERN_LEN: chunk and period boundaries
    dt = np.dtype(np.float32)
    red = Reduction(ReduceOp.SUM)
    pats = [bench.pattern(dt, "sum", r) for r in range(n)]
    send = bench.coll_counts(coll, param * n if coll in ("reduce_scatter", "alltoall", "scatter",
                                                         "all_gather") else param, n)[0]
    inputs = [bench.segment(p, 0, max(send, param * n)) for p in pats]
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
    pieces = bench.expected_pieces(coll, rank, n, root, param)
    assert bench.check_result(out, pieces, pats, red) == 0
    corrupted = out.copy()
    corrupted[[0, 1500, out.size - 1]] += 1
    assert bench.check_result(corrupted, pieces, pats, red) == 3
    # the right data in the wrong place (e.g. swapped blocks, another rank's data) is wrong too
    shifted = np.roll(out, 1)
    assert bench.check_result(shifted, pieces, pats, red) > 0


def test_checker_reduction_uses_op() -> None:
    """A result reduced with the wrong op is flagged (max instead of sum)."""
    n, param = 2, 64
    dt = np.dtype(np.int32)
    pats = [bench.pattern(dt, "sum", r) for r in range(n)]
    xs = [bench.segment(p, 0, param) for p in pats]
    pieces = bench.expected_pieces("all_reduce", 0, n, 0, param)
    assert bench.check_result(xs[0] + xs[1], pieces, pats, Reduction(ReduceOp.SUM)) == 0
    assert bench.check_result(np.maximum(xs[0], xs[1]), pieces, pats, Reduction(ReduceOp.SUM)) > 0


@pytest.mark.parametrize("dtype", bench.DTYPES)
@pytest.mark.parametrize("op", bench.OPS)
def test_patterns_are_order_independent(dtype: str, op: str) -> None:
    """Inputs are chosen so every reduction order gives the same bits: forward == backward fold."""
    from tensorwire.ops import as_reduction, dtype_from_name, reference

    dt = dtype_from_name(dtype)
    red = as_reduction(op)
    n = 5
    xs = [bench.pattern(dt, op, r) for r in range(n)]
    with np.errstate(all="ignore"):
        fwd = reference(xs, red)
        bwd = reference(xs[::-1], red)
    assert bench.count_wrong(fwd, bwd) == 0
