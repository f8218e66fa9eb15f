"""`tensorwire version --all`: what this installation can do, in the lines a bug report needs.

Nothing here starts a job: each line is read from an import, a library's own query (torch's
device queries for the GPUs) or the operating system, and says what is missing and what turns
it on."""

from __future__ import annotations

import importlib.util
import os
import resource
import shutil
from importlib import metadata

from ..config import size_text


def _version_of(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def compiled_module() -> str:
    setting = os.environ.get("TENSORWIRE_NATIVE", "auto")
    try:
        from ..transport import _native  # type: ignore[attr-defined]  # noqa: F401
    except ImportError as exc:
        return (f"not built ({exc}): small calls on one host run their Python inner loops; reinstall "
                "with a C compiler and the Python headers")
    used = "not used" if setting.strip() == "0" else "used"
    return f"built, {used} (TENSORWIRE_NATIVE={setting})"


def torch_lines() -> list[tuple[str, str]]:
    if importlib.util.find_spec("torch") is None:
        return [("torch", "not installed: pip install 'tensorwire[torch]' for the torch.distributed backend")]
    import torch

    lines = [("torch", f"{torch.__version__}: `import tensorwire.torch` registers the backend 'tensorwire'")]
    if not torch.cuda.is_available():
        why = "torch built without CUDA" if torch.version.cuda is None else "no GPU visible"
        return [*lines, ("CUDA", f"not available ({why}): collectives on CPU tensors only")]
    names = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        names.append(f"{i}: {torch.cuda.get_device_name(i)} (sm_{major}{minor})")
    lines.append(("CUDA", f"{torch.version.cuda}, {len(names)} GPU(s): " + "; ".join(names)))
    from ..gpu import device_flags

    why_not = device_flags.available()
    mps = "an MPS daemon serves this process" if device_flags.mps_running() else "no MPS daemon"
    setting = os.environ.get("TENSORWIRE_CUDA_DEVICE_FLAGS", "auto")
    lines.append(("device flags", f"cannot run: {why_not}" if why_not else
                  f"Triton {_version_of('triton')}; {mps} (TENSORWIRE_CUDA_DEVICE_FLAGS={setting}: "
                  "auto takes them with a GPU per rank or under MPS)"))
    return lines


def shm_line() -> str:
    try:
        st = os.statvfs("/dev/shm")
    except OSError as exc:
        return f"unusable ({exc}): ranks of one host talk over TCP"
    return f"{size_text(st.f_bavail * st.f_frsize)} free of {size_text(st.f_blocks * st.f_frsize)}"


def lines() -> list[tuple[str, str]]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    mpi = _version_of("mpi4py")
    mpiexec = shutil.which("mpiexec")
    out = [("compiled module", compiled_module()), *torch_lines(),
           ("ml_dtypes", _version_of("ml_dtypes") or "not installed: bfloat16 and float8 arrays need "
                                                     "pip install 'tensorwire[bf16]' (torch tensors do not)"),
           ("mpi4py", (f"{mpi}, mpiexec {'at ' + mpiexec if mpiexec else 'not on PATH'}" if mpi else
                       "not installed") + " (bench --compare mpi)"),
           ("/dev/shm", shm_line()),
           ("open files", f"soft limit {soft}, hard {limit} (raised to the hard limit where a job needs it)")]
    from ..config import SETTINGS, Config

    env = sorted(k for k in os.environ if k.startswith("TENSORWIRE_"))
    shown = [(f"{k}=(hidden)" if k == "TENSORWIRE_SECRET" else f"{k}={os.environ[k]}") +
             ("" if k in SETTINGS else " (not a setting: ignored)") for k in env]
    out.append(("settings", ", ".join(shown) if env else "all defaults (no TENSORWIRE_* variable set)"))
    try:
        Config.from_env()
    except ValueError as exc:
        out.append(("settings error", f"{exc} (init() refuses it)"))
    return out


def report() -> str:
    rows = lines()
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {text}" for name, text in rows)
