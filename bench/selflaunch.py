"""Start a bench script's own ranks: N copies of it with `--worker`, torchrun's environment."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def run_workers(script: str, nproc: int, argv: list[str] | None, **env_extra: str) -> int:
    """Run `script --worker ARGV` as ranks 0..nproc-1 against a free local MASTER_PORT; the
    worst exit code. A launcher's job variables are left out, so the ranks form a job of their
    own even when this runs inside one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "TENSORWIRE_JOB"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
               PYTHONUNBUFFERED="1", **env_extra)
    forwarded = argv if argv is not None else sys.argv[1:]
    cmd = [sys.executable, script, "--worker", *forwarded]
    procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(nproc)]
    return max((p.wait() for p in procs), key=abs)
