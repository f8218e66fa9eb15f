"""`tensorwire bench --algo`: every eligible algorithm forced in turn, against the tuner's choice
and the cost model's prediction (end to end through the launcher, tiny sizes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX launcher")


def run_bench(*args: str, timeout: float = 40) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TENSORWIRE_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env.update(TENSORWIRE_TIMEOUT="30", TENSORWIRE_CALIBRATE="0")  # the default constants: no probe
    return subprocess.run([sys.executable, "-m", "tensorwire", "bench", *args], env=env, text=True,
                          capture_output=True, timeout=timeout)


def rows(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.timeout(60)
def test_algo_all_lists_every_algorithm_with_predictions(tmp_path: Path) -> None:
    out = tmp_path / "algo.json"
    page = tmp_path / "algo.md"
    p = run_bench("all_reduce", "--algo", "all", "-b", "8", "-e", "64K", "-f", "8", "-n", "2", "-w", "1",
                  "--np", "2", "--json", str(out), "--markdown", str(page))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "--algo all" in page.read_text() and "# Wrong values         : 0 OK" in page.read_text()
    # the headers describe the columns printed: no p50/p99 nor the plain sweep's time (a tester)
    for text in (p.stdout, page.read_text()):
        assert "p50" not in text and "p99" not in text and "algbw" not in text, text
        assert "the median over calls" in text and "busbw = size / mean call" in text, text
    assert "# Wrong values         : 0 OK" in p.stdout
    lines = rows(p.stdout)
    sizes = [8, 64, 512, 4096, 32768]
    assert sorted({int(r[0]) for r in lines}) == sizes
    for size in sizes:
        at = [r for r in lines if int(r[0]) == size]
        names = {r[1].rstrip("*") for r in at}
        assert any(n.startswith("auto:") for n in names), at
        assert {"ring", "recursive_doubling", "rabenseifner", "tree"} <= names, at
        for r in at:  # size, algorithm, time, mean call, predicted, mean/pred, busbw, #wrong
            assert all(float(v) > 0 for v in r[2:6]) and r[7] == "0", r
        summary = next(line for line in p.stdout.splitlines() if line.startswith(f"#{size:>11}  auto"))
        assert "auto/best" in summary and "predicted" in summary, summary
    doc = json.loads(out.read_text())
    assert doc["meta"]["algo"] == "all" and doc["wrong_total"] == 0
    for res in doc["results"]:
        assert res["auto"] in res["cells"] and res["best"] in res["cells"] and res["auto_over_best"] > 0
        assert res["judged"] == "mean_us"  # the model is judged, and algorithms ranked, by the mean call
        forced = {k: c for k, c in res["cells"].items() if k != "auto"}
        fastest = min(c["mean_us"] for c in forced.values())
        assert res["best_time_us"] == forced[res["best"]]["mean_us"] == fastest
        for cell in res["cells"].values():
            assert cell["predicted_us"] > 0 and cell["wrong"] == 0
            assert cell["measured_over_predicted"] == pytest.approx(cell["mean_us"] / cell["predicted_us"])


@pytest.mark.timeout(60)
def test_algo_name_forces_one_and_says_where_it_cannot_run() -> None:
    p = run_bench("all_reduce", "--algo", "Recursive-Doubling", "-b", "1K", "-e", "1K", "-n", "2", "-w", "0",
                  "--np", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert [r[1] for r in rows(p.stdout)] == ["recursive_doubling*"]
    p = run_bench("broadcast", "--algo", "ring", "-b", "1K", "-e", "1K", "-n", "2", "-w", "0", "--np", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "broadcast has no algorithm 'ring'" in p.stdout and not rows(p.stdout)
    # why not, as `tensorwire plan` says it (policy.why_not), not only what could run instead
    p = run_bench("all_reduce", "--algo", "single_copy", "-b", "1K", "-e", "1K", "-n", "2", "-w", "0",
                  "--np", "2", "--tcp")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "single_copy cannot run this call: one-host shared-memory path only (eligible: " in p.stdout, \
        p.stdout
