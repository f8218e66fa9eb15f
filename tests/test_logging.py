"""The debug log: which subsystems TENSORWIRE_DEBUG_SUBSYS names, the COLL and P2P logs' line per
call at TRACE, the ENV log's settings at init, and nothing of it on the fast paths while off."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tensorwire import log
from tensorwire.config import Config

JOB = """
import sys
import numpy as np
import tensorwire as tw

w = tw.init()
r = w.rank
x = np.arange(1000, dtype=np.float32)
if r == 0:
    tw.send(x, 1, tag=3)
    tw.isend(x[:10], 1, tag=4).wait()
else:
    y = np.empty_like(x)
    tw.recv(y, 0, tag=3)
    tw.irecv(y[:10], 0, tag=4).wait()
out = np.empty(2, np.float32)
w.sendrecv(np.full(2, r, np.float32), 1 - r, out, 1 - r, tag=5)
for _ in range(3):  # planned after the first: each still logged
    tw.all_reduce(x)
tw.reduce(x, dst=1)
tw.broadcast(x, 0)
tw.all_gather_into_tensor(np.empty(8, np.float32), np.ones(4, np.float32))
tw.barrier()
tw.barrier()
tw.all_to_all_single(np.empty(8, np.float32), np.ones(8, np.float32))
if sys.argv[1] == "torch":
    import torch
    import torch.distributed as dist
    import tensorwire.torch  # noqa: F401 - the backend

    dist.init_process_group("tensorwire")
    t = torch.ones(4)
    dist.all_reduce(t)  # the backend's fast path
    dist.barrier()
    dist.destroy_process_group()
print("job OK", flush=True)
tw.destroy()
"""


def _job(tmp_path: Path, mode: str = "numpy", **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    full = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_")}
    full.update({"TENSORWIRE_CALIBRATE": "0", "TENSORWIRE_TIMEOUT": "60", **env})
    done = subprocess.run([sys.executable, "-m", "tensorwire", "run", "-n", "2", str(script), mode],
                          env=full, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0 and done.stdout.count("job OK") == 2, done.stderr[-4000:]
    return done


def _lines(err: str, rank: int, subsys: str) -> list[str]:
    mark = f":rank {rank} [tensorwire "
    return [line.split("] ", 1)[1] for line in err.splitlines()
            if mark in line and f"tensorwire.{subsys}]" in line]


@pytest.mark.timeout(120)
def test_trace_logs_a_line_per_collective_and_point_to_point_call(tmp_path: Path) -> None:
    """TENSORWIRE_DEBUG=TRACE with COLL or P2P logged nothing for a job of sends, receives and
    collectives (a tester): each call now has its line, the planned and compiled ones too; the
    calibration's own calls at init have none (nor do they run otherwise: probes._own_calls)."""
    err = _job(tmp_path, TENSORWIRE_DEBUG="TRACE", TENSORWIRE_DEBUG_SUBSYS="COLL,P2P,ENV",
               TENSORWIRE_CALIBRATE="force", TENSORWIRE_CACHE_DIR=str(tmp_path / "cache")).stderr
    for rank in (0, 1):
        coll = _lines(err, rank, "COLL")
        names = [line.split(" on group")[0] for line in coll]
        assert names == [*(f"all_reduce #{i}" for i in (1, 2, 3)), "reduce #4", "broadcast #5",
                         "all_gather_into_tensor #6", "barrier #7", "barrier #8",
                         "all_to_all_single #9"], coll
        pattern = (r"all_reduce #2 on group world \(2 ranks\): count 1000 float32 \(4000 B\), op SUM, "
                   r"algo \w+ over shm, [\d.]+ (us|ms|s)$")
        assert re.match(pattern, coll[1]), coll[1]
        assert "root 1, algo" in coll[3] and "root 0, algo" in coll[4], coll
        assert all(" algo - " not in line for line in coll), coll
        assert ": count 8 float32 (32 B), 4 a peer, algo " in coll[8], coll[8]  # (it read as 8 a peer)
        p2p = _lines(err, rank, "P2P")
        way, peer = ("send", "dst 1") if rank == 0 else ("recv", "src 0")
        assert p2p[0].startswith(f"{way} on group world: tensor 4000 B float32, {peer}, tag 3, took "), p2p
        assert p2p[1].startswith(f"i{way} on group world: tensor 40 B float32, {peer}, tag 4, posted in "), \
            p2p
        assert p2p[2].startswith(f"sendrecv on group world: send 8 B float32, dst {1 - rank}, recv 8 B "
                                 f"float32, src {1 - rank}, tag 5, took "), p2p
        assert len(p2p) == 3, p2p
        env = _lines(err, rank, "ENV")
        assert len(env) == 1 and "timeout=60.0" in env[0] and "calibrate='force'" in env[0], env
    assert "tensorwire.INIT]" not in err  # not asked for


@pytest.mark.timeout(120)
def test_the_torch_backend_fast_path_is_logged_and_info_has_no_line_per_call(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    err = _job(tmp_path, "torch", TENSORWIRE_DEBUG="TRACE", TENSORWIRE_DEBUG_SUBSYS="COLL").stderr
    coll = _lines(err, 0, "COLL")
    torch_calls = [line for line in coll if " on group torch:" in line or "count 4 float32" in line]
    assert any(line.startswith("all_reduce #") and "count 4 float32 (16 B), op SUM, algo" in line
               for line in torch_calls), coll
    assert any(line.startswith("barrier #") for line in coll[8:]), coll
    err = _job(tmp_path, TENSORWIRE_DEBUG="INFO", TENSORWIRE_DEBUG_SUBSYS="ALL,^GRAPH").stderr
    assert "tensorwire.ENV]" in err and "tensorwire.INIT]" in err and "tensorwire.GRAPH]" not in err
    assert not re.search(r"#\d+ on group world", err), err  # the lines per call are TRACE's


def test_subsystems_are_what_the_setting_names(monkeypatch: pytest.MonkeyPatch) -> None:
    everything = set(log.SUBSYSTEMS)
    assert log.subsystems("") == log.subsystems("ALL") == everything
    assert log.subsystems("INIT,^coll") == {"INIT"}
    assert log.subsystems("^GRAPH") == log.subsystems("ALL,^GRAPH") == everything - {"GRAPH"}
    with pytest.raises(ValueError, match="leaves no subsystem"):  # it passed, then logged everything
        log.subsystems("^ALL")
    monkeypatch.setenv("TENSORWIRE_DEBUG_SUBSYS", "^ALL")
    with pytest.raises(ValueError, match=r"TENSORWIRE_DEBUG_SUBSYS='\^ALL': it leaves no subsystem"):
        Config.from_env()
    with pytest.raises(ValueError, match="unknown LAUNCH"):  # a name nothing logged under
        log.subsystems("LAUNCH")


@pytest.mark.timeout(60)
def test_without_the_lines_per_call_the_fast_paths_are_untouched() -> None:
    """Off (the default), a group keeps the compiled caller's methods and the class's
    point-to-point ones: nothing is wrapped or checked on the way of a call."""
    import tensorwire as tw

    world = tw.init(rank=0, world_size=1)
    try:
        assert not world.queue.logged
        compiled = "builtin_function_or_method"
        assert all(name not in vars(world) or type(vars(world)[name]).__name__ == compiled
                   for name in ("send", "recv", "isend", "irecv", "irecv_any", "sendrecv"))
        if world.engine.native is not None:
            assert type(world.all_reduce).__name__ == compiled
    finally:
        tw.destroy()


@pytest.mark.timeout(60)
def test_a_program_s_own_debug_logging_leaves_the_lines_per_call_off() -> None:
    """tensorwire's loggers inherit the root logger's level: a program's logging.basicConfig at
    DEBUG turned the lines per call on, and every call went off its fast paths (8 B all_reduce
    ~60 us where it takes ~1). Only TENSORWIRE_DEBUG=TRACE turns them on."""
    code = ("import logging; logging.basicConfig(level=logging.DEBUG)\n"
            "import tensorwire as tw\n"
            "w = tw.init(rank=0, world_size=1)\n"
            "print('LOGGED', w.queue.logged, 'send' in vars(w) and type(w.send).__name__ == 'function')\n"
            "tw.destroy()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_DEBUG")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50,
                         env={**env, "TENSORWIRE_CALIBRATE": "0"})
    assert "LOGGED False False" in out.stdout, out.stdout + out.stderr[-2000:]


@pytest.mark.timeout(60)
def test_every_line_of_init_carries_the_rank() -> None:
    """The allocator's line at init was stamped `rank ?` on every rank (a tester): it came
    before the rank was known. Each line now carries it."""
    code = "import tensorwire as tw; tw.init(rank=0, world_size=1); tw.destroy()"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_")}
    env.update(TENSORWIRE_DEBUG="INFO", TENSORWIRE_DEBUG_SUBSYS="INIT", TENSORWIRE_KEEP_MEMORY="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=env)
    lines = [line for line in out.stderr.splitlines() if "[tensorwire " in line]
    assert out.returncode == 0 and any("allocator:" in line for line in lines), out.stderr
    assert all(":rank 0 [tensorwire " in line for line in lines), out.stderr
