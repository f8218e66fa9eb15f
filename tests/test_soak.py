"""The short soak inside `make test`: random collectives on 4 ranks for about 12 s per transport,
and 6 s on shared memory with the Python bodies only (TENSORWIRE_NATIVE=0), every result
checked against numpy (tests/soak.py; `make soak` runs thousands of steps). The
seed is fresh each run (SOAK_SEED=N fixes it) and printed; a failure names the step and the command
replaying it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parent / "soak.py"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport, seconds, native", [("both", 12, "auto"), ("shm", 6, "0")],
                         ids=["both-transports", "python-bodies"])
def test_short_soak(transport: str, seconds: int, native: str) -> None:
    proc = subprocess.run([sys.executable, str(SOAK), "--np", "4", "--seconds", str(seconds), "--transport",
                           transport, "--timeout", "30"], capture_output=True, text=True, timeout=140,
                          env={**os.environ, "TENSORWIRE_NATIVE": native})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"soak failed:\n{text[:200]}\n...\n{text[-6000:]}"
    assert text.count("every result matched numpy") == (2 if transport == "both" else 1), text[-3000:]
