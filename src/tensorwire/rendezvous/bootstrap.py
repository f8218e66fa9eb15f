"""Who am I, how many are we, where is the store: read from arguments or the launcher's env.

Launchers each speak their own dialect (tensorwire run, torchrun, Open MPI, MPICH/Hydra,
Slurm). This module turns any of them into one `LaunchInfo`, so nothing above it ever reads a
launcher variable, then `create_store` connects every rank to the same store and checks that
the ranks agree on who is who before anything else trusts them.
"""

from __future__ import annotations

import builtins
import hashlib
import json
import os
import re
import tempfile
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .. import auth
from ..errors import InvalidArgumentError, RendezvousError, TimeoutError, UnauthenticatedJobWarning
from .file_store import FileStore
from .prefix_store import PrefixStore
from .store import Store
from .tcp_protocol import DEFAULT_LIMITS, StoreLimits
from .tcp_store import TCPStore
from .torch_store import TorchStoreAdapter

SOURCES = ("explicit", "tensorwire", "torchrun", "mpirun", "slurm", "env", "single")
SCHEMES = ("tcp", "file", "env", "torch-agent")
UNKNOWN = -1
"""Value of local_rank / local_world_size / node_rank when the launcher does not say."""

JOIN_KEY = "tw/join/{generation}/{seat}"
WORLD_SIZE_KEY = "tw/world_size/{generation}"
"""Roster keys carry the generation (the how-many-th init() of the process through a store): a
store the launcher keeps for the whole job sees each rank join once per generation, so init()
after destroy() is no second process with the same rank. A rank's seat is its rank in a world of
its size ('4/1'), rank 0's is '0' (it sets the size): two processes given the same rank of one
world join twice, while ranks started with another world size than rank 0 (nodes of `tensorwire
run` given different -n) meet the size check, which names both sizes."""


@dataclass
class LaunchInfo:
    """Everything bootstrapping needs to know about this process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str | None
    master_port: int | None
    init_method: str
    """'tcp://host:port', 'file:///path', or 'torch-agent://host:port' (torchrun's agent store)."""
    source: str
    """Where rank and world size came from: one of SOURCES."""
    job_id: str
    """Same on every rank of one job, different between concurrent jobs; safe in file names."""
    store_hosted: bool = False
    """The launcher already runs the store server, so rank 0 must not start one."""


# --------------------------------------------------------------------------------------------
# Small parsers


def _hash(*parts: object, n: int = 12) -> str:
    return hashlib.sha256("\0".join(str(p) for p in parts).encode()).hexdigest()[:n]


def _safe_id(raw: str, prefix: str) -> str:
    """A job id usable in shared-memory and file names; hashed when the raw id is not."""
    if re.fullmatch(r"[A-Za-z0-9_.-]{1,48}", raw):
        return raw
    return f"{prefix}-{_hash(raw)}"


def expand_hostlist(text: str) -> list[str]:
    """Expand a Slurm host list: 'node[01-04,07],gpu3' -> node01..node04, node07, gpu3.

    Zero padding follows the width of each range's first bound; several bracket groups in
    one name ('r[1-2]n[1-2]') expand as a cartesian product, in Slurm's order.
    """
    out: list[str] = []
    for item in _split_top_level(text.strip()):
        out.extend(_expand_item(item, text))
    return out


def _split_top_level(text: str) -> list[str]:
    items: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise InvalidArgumentError(f"host list {text!r} has an unmatched ']'")
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise InvalidArgumentError(f"host list {text!r} has an unmatched '['")
    items.append("".join(cur))
    return [i.strip() for i in items if i.strip()]


def _expand_item(item: str, whole: str) -> list[str]:
    lb = item.find("[")
    if lb < 0:
        return [item]
    rb = item.index("]", lb)
    prefix, body, rest = item[:lb], item[lb + 1:rb], item[rb + 1:]
    values: list[str] = []
    for part in body.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise InvalidArgumentError(f"host list {whole!r}: cannot read range {part!r} in [{body}]")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise InvalidArgumentError(f"host list {whole!r}: range {part!r} runs backwards")
        width = len(lo)
        values.extend(f"{v:0{width}d}" for v in range(int(lo), int(hi) + 1))
    return [name for v in values for name in _expand_item(prefix + v + rest, whole)]


def expand_tasks_per_node(text: str) -> list[int]:
    """Expand Slurm's SLURM_TASKS_PER_NODE: '2(x3),1' -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise InvalidArgumentError(f"cannot read tasks per node {text!r} (part {part!r})")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def parse_init_method(init_method: str) -> tuple[str, str | None, int | None, str | None]:
    """Split an init method into (scheme, host, port, path); InvalidArgumentError if malformed."""
    m = re.fullmatch(r"([a-z][a-z0-9+.-]*)://(.*)", init_method.strip())
    if not m or m.group(1) not in SCHEMES:
        raise InvalidArgumentError(
            f"init_method {init_method!r} is not understood; use 'tcp://host:port', "
            f"'file:///path/to/dir' or 'env://'")
    scheme, rest = m.group(1), m.group(2)
    if scheme == "env":
        return scheme, None, None, None
    if scheme == "file":
        path = rest.split("?", 1)[0]
        if not path.startswith("/"):
            raise InvalidArgumentError(f"init_method {init_method!r}: file:// needs an absolute path "
                                       f"(three slashes: file:///tmp/job)")
        return scheme, None, None, path
    rest = rest.split("?", 1)[0].rstrip("/")
    hm = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)|([^:/\[\]]+):(\d+)", rest)
    if not hm:
        raise InvalidArgumentError(f"init_method {init_method!r}: expected {scheme}://host:port")
    if hm.group(1):
        raise InvalidArgumentError(f"init_method {init_method!r}: IPv6 addresses are not supported (the "
                                   f"transports speak IPv4); use an IPv4 address or a host name with one")
    host = hm.group(3)
    port = int(hm.group(4))
    if not 0 <= port <= 65535:
        raise InvalidArgumentError(f"init_method {init_method!r}: port {port} is outside 0..65535")
    return scheme, host, port, None


def _tcp_url(scheme: str, host: str, port: int) -> str:
    host = host.strip("[]")  # MASTER_ADDR=[::1] as well as ::1
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


# --------------------------------------------------------------------------------------------
# Launcher environments


@dataclass
class _Found:
    source: str
    rank: int
    world_size: int
    local_rank: int = UNKNOWN
    local_world_size: int = UNKNOWN
    node_rank: int = UNKNOWN
    master_addr: str | None = None
    master_port: int | None = None
    init_method: str | None = None
    job_id: str | None = None
    store_hosted: bool = False


class _Env:
    """Typed reads of one launcher's variables, with errors that name variable and launcher."""

    def __init__(self, env: Mapping[str, str], who: str) -> None:
        self.env = env
        self.who = who

    def has(self, *names: str) -> bool:
        return all(self.env.get(n, "") != "" for n in names)

    def str(self, *names: str) -> str | None:
        for n in names:
            v = self.env.get(n, "")
            if v != "":
                return v
        return None

    def int(self, *names: builtins.str, default: builtins.int | None = None) -> builtins.int:
        for n in names:
            v = self.env.get(n, "").strip()
            if v != "":
                try:
                    return int(v)
                except ValueError:
                    raise InvalidArgumentError(
                        f"{n}={v!r} (from the {self.who} environment) is not an integer") from None
        if default is None:
            raise InvalidArgumentError(f"the {self.who} environment lacks {' / '.join(names)}")
        return default

    def master(self) -> tuple[builtins.str | None, builtins.int | None]:
        addr = self.str("MASTER_ADDR")
        port = self.int("MASTER_PORT", default=UNKNOWN)
        if not (0 <= port <= 65535 or port == UNKNOWN):
            raise InvalidArgumentError(
                f"MASTER_PORT={port} (from the {self.who} environment) is outside 0..65535")
        return addr, (None if port == UNKNOWN else port)


def _from_tensorwire(e: _Env) -> _Found:
    addr, port = e.master()
    if addr is None or port is None:
        raise RendezvousError("the tensorwire launcher environment (TENSORWIRE_JOB_ID set) lacks "
                              "MASTER_ADDR / MASTER_PORT")
    return _Found(
        "tensorwire", e.int("RANK"), e.int("WORLD_SIZE"), e.int("LOCAL_RANK", default=UNKNOWN),
        e.int("LOCAL_WORLD_SIZE", default=UNKNOWN), e.int("GROUP_RANK", "NODE_RANK", default=UNKNOWN),
        addr, port, _tcp_url("tcp", addr, port), _safe_id(e.env["TENSORWIRE_JOB_ID"], "tw"),
        e.str("TENSORWIRE_STORE_HOSTED") == "1")


def _from_torchrun(e: _Env) -> _Found:
    addr, port = e.master()
    if addr is None or port is None:
        raise RendezvousError(
            "the torchrun environment (TORCHELASTIC_RUN_ID set) lacks MASTER_ADDR / MASTER_PORT")
    # torchrun's agent already serves a c10d TCPStore on MASTER_PORT when it says so; then we
    # must speak torch's protocol to it instead of starting our own server on that port.
    agent = e.str("TORCHELASTIC_USE_AGENT_STORE") == "True"
    run_id = e.env["TORCHELASTIC_RUN_ID"]
    restart = e.str("TORCHELASTIC_RESTART_COUNT") or "0"
    # The default run id is the literal 'none', shared by unrelated jobs: mix in the store
    # address, which no two live jobs share, and the restart count, which changes per attempt.
    job_id = f"torchrun-{_hash(run_id, restart, addr, port)}"
    return _Found(
        "torchrun", e.int("RANK"), e.int("WORLD_SIZE"), e.int("LOCAL_RANK", default=UNKNOWN),
        e.int("LOCAL_WORLD_SIZE", default=UNKNOWN), e.int("GROUP_RANK", default=UNKNOWN),
        addr, port, _tcp_url("torch-agent" if agent else "tcp", addr, port), job_id, agent)


_MPI_JOB_VARS = ("PMIX_NAMESPACE", "OMPI_MCA_orte_hnp_uri", "OMPI_MCA_ess_base_jobid", "PMI_KVSNAME",
                 "PMI_PORT")


def _from_mpi(e: _Env) -> _Found:
    if e.has("OMPI_COMM_WORLD_RANK") or e.has("OMPI_COMM_WORLD_SIZE"):
        rank = e.int("OMPI_COMM_WORLD_RANK", "PMIX_RANK")
        size = e.int("OMPI_COMM_WORLD_SIZE")
        local = e.int("OMPI_COMM_WORLD_LOCAL_RANK", default=UNKNOWN)
        local_size = e.int("OMPI_COMM_WORLD_LOCAL_SIZE", default=UNKNOWN)
    else:  # MPICH / Intel MPI (Hydra)
        rank = e.int("PMI_RANK")
        size = e.int("PMI_SIZE")
        local = e.int("MPI_LOCALRANKID", default=UNKNOWN)
        local_size = e.int("MPI_LOCALNRANKS", default=UNKNOWN)
    single_host = local_size == size
    addr, port = e.master()
    raw_job = e.str(*_MPI_JOB_VARS)
    if raw_job is not None:
        job_id = f"mpi-{_hash(raw_job)}"
    elif addr is not None:
        job_id = f"mpi-{_hash(addr, port)}"
    else:
        # All ranks of a one-host MPI job are children of the same launcher process.
        job_id = f"mpi-ppid{os.getppid()}"
    if addr is not None:
        if port is None:
            port = 20000 + int(_hash(job_id, n=8), 16) % 20000
        init = _tcp_url("tcp", addr, port)
    elif single_host:
        init = f"file://{_private_store_dir(job_id)}"
    else:
        raise RendezvousError(
            f"mpirun started {size} ranks on more than one host (this host has {local_size}"
            f"{'' if local_size != UNKNOWN else ' (unknown)'}), so they need a TCP store: set MASTER_ADDR "
            f"to the host of rank 0 and MASTER_PORT to a free port (e.g. mpirun -x MASTER_ADDR=node1 "
            f"-x MASTER_PORT=29500 ...)")
    return _Found("mpirun", rank, size, local, local_size, 0 if single_host else UNKNOWN,
                  addr, port, init, job_id, False)


def _private_store_dir(job_id: str) -> str:
    """Where a one-host job without a launcher's store keeps its file store: inside this user's
    directory, the per-user secret's (<tmp>/tensorwire-<uid>), which FileStore makes mode 0700
    and refuses if it is another user's."""
    return os.path.join(tempfile.gettempdir(), f"tensorwire-{os.geteuid()}", job_id)


def _from_slurm(e: _Env) -> _Found:
    job = e.int("SLURM_JOB_ID", "SLURM_JOBID")
    step = e.str("SLURM_STEP_ID", "SLURM_STEPID") or "0"
    job_id = _safe_id(f"slurm-{job}.{step}", "slurm")
    size = e.int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    node = e.int("SLURM_NODEID", default=UNKNOWN)
    local_size = UNKNOWN
    tpn = e.str("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if tpn is not None and node != UNKNOWN:
        counts = expand_tasks_per_node(tpn)
        if node < len(counts):
            local_size = counts[node]
    addr, port = e.master()
    if addr is None:
        nodelist = e.str("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if nodelist is None:
            raise RendezvousError("the Slurm environment names no node list (SLURM_STEP_NODELIST / "
                                  "SLURM_JOB_NODELIST); set MASTER_ADDR to the host of rank 0")
        hosts = expand_hostlist(nodelist)
        if not hosts:
            raise RendezvousError(f"the Slurm node list {nodelist!r} is empty; set MASTER_ADDR")
        addr = hosts[0]  # Slurm always places task 0 on the first node of the step
    if port is None:
        port = 20000 + job % 20000
    return _Found("slurm", e.int("SLURM_PROCID"), size, e.int("SLURM_LOCALID", default=UNKNOWN),
                  local_size, node, addr, port, _tcp_url("tcp", addr, port), job_id, False)


def _from_plain_env(e: _Env) -> _Found:
    addr, port = e.master()
    init = _tcp_url("tcp", addr, port) if addr is not None and port is not None else None
    job = e.str("TENSORWIRE_JOB_ID")
    return _Found(
        "env", e.int("RANK"), e.int("WORLD_SIZE"), e.int("LOCAL_RANK", default=UNKNOWN),
        e.int("LOCAL_WORLD_SIZE", default=UNKNOWN), e.int("GROUP_RANK", "NODE_RANK", default=UNKNOWN),
        addr, port, init, _safe_id(job, "tw") if job else None, False)


def _from_launcher(env: Mapping[str, str]) -> _Found | None:
    """The first launcher whose markers are present, most specific first.

    Order matters: torchrun or mpirun inside a Slurm allocation also inherit SLURM_* variables
    that describe the allocation, not the processes they started.
    """
    if env.get("TENSORWIRE_JOB_ID") and env.get("RANK"):
        return _from_tensorwire(_Env(env, "tensorwire launcher"))
    if env.get("TORCHELASTIC_RUN_ID") and env.get("RANK"):
        return _from_torchrun(_Env(env, "torchrun"))
    if (env.get("OMPI_COMM_WORLD_RANK") or (env.get("PMIX_RANK") and env.get("OMPI_COMM_WORLD_SIZE"))
            or (env.get("PMI_RANK") and env.get("PMI_SIZE"))):
        return _from_mpi(_Env(env, "mpirun"))
    if env.get("SLURM_PROCID") and any(env.get(v) for v in ("SLURM_STEP_ID", "SLURM_STEPID",
                                                          "SLURM_STEP_NUM_TASKS")):
        # Without a step variable this is the batch script itself, a single process.
        return _from_slurm(_Env(env, "Slurm"))
    if env.get("RANK") and env.get("WORLD_SIZE"):
        return _from_plain_env(_Env(env, "RANK/WORLD_SIZE"))
    return None


# --------------------------------------------------------------------------------------------
# detect


def detect(rank: int | None = None, world_size: int | None = None, init_method: str | None = None,
           *, env: Mapping[str, str] = os.environ) -> LaunchInfo:
    """Work out rank, world size and store location: explicit arguments win, then the launcher.

    With neither, this is a single-process world (rank 0 of 1) with a private store.
    `env` is the environment to read (tests pass a dict instead of touching os.environ).
    """
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
    found = _from_launcher(env)

    if init_method is not None and parse_init_method(init_method)[0] == "env":
        e = _Env(env, "env://")
        addr, port = e.master()
        missing = [n for n, v in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if v is None]
        if missing:
            raise InvalidArgumentError(
                f"init_method='env://' needs {' and '.join(missing)} in the environment")
        assert addr is not None and port is not None
        if found is None:
            if rank is None:
                rank = e.int("RANK")
            if world_size is None:
                world_size = e.int("WORLD_SIZE")
            found = _Found("env", rank, world_size, e.int("LOCAL_RANK", default=UNKNOWN),
                           e.int("LOCAL_WORLD_SIZE", default=UNKNOWN), UNKNOWN, addr, port, None)
        if found.init_method is None or (found.master_addr, found.master_port) != (addr, port):
            found.init_method = _tcp_url("tcp", addr, port)
            found.store_hosted = False
        found.master_addr, found.master_port = addr, port
        init_method = None  # from here on: "what the launcher said", now with MASTER_* checked

    explicit_ranks = rank is not None and world_size is not None
    if found is not None:
        r = found.rank if rank is None else rank
        ws = found.world_size if world_size is None else world_size
        local_rank, local_ws, node_rank = found.local_rank, found.local_world_size, found.node_rank
    elif rank is None and world_size is None:
        r, ws, local_rank, local_ws, node_rank = 0, 1, 0, 1, 0
    else:
        if world_size is None:
            raise InvalidArgumentError(f"rank={rank} was given without world_size (and no launcher "
                                       f"environment provides WORLD_SIZE)")
        if rank is None:
            if world_size != 1:
                raise InvalidArgumentError(f"world_size={world_size} was given without rank (and no "
                                           f"launcher environment provides RANK)")
            rank = 0
        r, ws = rank, world_size
        local_rank, local_ws, node_rank = (0, 1, 0) if ws == 1 else (UNKNOWN, UNKNOWN, UNKNOWN)

    if ws < 1:
        raise InvalidArgumentError(f"world_size must be >= 1, got {ws}")
    if not 0 <= r < ws:
        raise InvalidArgumentError(f"rank {r} is outside [0, {ws}) for world_size={ws}")
    if local_ws != UNKNOWN and local_rank != UNKNOWN and not 0 <= local_rank < local_ws:
        raise InvalidArgumentError(f"local rank {local_rank} is outside [0, {local_ws}) (rank {r})")

    job_env = env.get("TENSORWIRE_JOB_ID", "")
    store_hosted = False
    if init_method is not None:
        scheme, host, port, _ = parse_init_method(init_method)
        if found is not None and found.init_method == init_method:
            store_hosted = found.store_hosted
        if scheme == "file":
            addr, mport = None, None
        else:
            addr, mport = host, port
        if job_env:
            job_id = _safe_id(job_env, "tw")
        elif found is not None and found.job_id and (
                found.init_method == init_method or (found.master_addr, found.master_port) == (addr, mport)):
            job_id = found.job_id  # the launcher's store, reached another way (torch's, by its backend)
        else:
            job_id = f"tw-{_hash(init_method)}"
        init = init_method
    elif found is not None and found.init_method is not None:
        init, addr, mport = found.init_method, found.master_addr, found.master_port
        store_hosted = found.store_hosted
        job_id = found.job_id or f"tw-{_hash(init)}"
    elif ws == 1:
        # A private store on a free port: nobody else needs to find it.
        init, addr, mport = "tcp://127.0.0.1:0", "127.0.0.1", 0
        job_id = _safe_id(job_env, "tw") if job_env else f"single-{os.getpid()}"
    else:
        raise InvalidArgumentError(
            f"rank {r} of world_size={ws}: no way to find the other ranks; pass init_method "
            f"('tcp://host:port' or 'file:///path') or set MASTER_ADDR and MASTER_PORT")

    scheme, _, port, _ = parse_init_method(init)
    if scheme in ("tcp", "torch-agent") and port == 0 and ws > 1:
        raise InvalidArgumentError(f"init_method {init!r}: port 0 only works for a single process; "
                                   f"{ws} ranks need a fixed port they all know")

    if explicit_ranks:
        source = "explicit"
    elif found is not None:
        source = found.source
    elif rank is None and world_size is None:
        source = "single"
    else:
        source = "explicit"
    return LaunchInfo(r, ws, local_rank, local_ws, node_rank, addr, mport, init, source, job_id, store_hosted)


# --------------------------------------------------------------------------------------------
# The job's secret


_warned = False


def spans_hosts(info: LaunchInfo) -> bool:
    """Whether the job may have ranks on other hosts: as the launcher says, else unless its
    store is on this host's loopback (which only this host can reach) or in a directory."""
    if info.world_size == 1:
        return False
    if info.local_world_size > 0:
        return info.local_world_size < info.world_size
    scheme, host, _, _ = parse_init_method(info.init_method)
    return scheme != "file" and not auth.is_loopback(host or "")


def job_secret(info: LaunchInfo, env: Mapping[str, str] = os.environ) -> auth.Secret:
    """The secret every connection of this job proves: TENSORWIRE_SECRET or
    TENSORWIRE_SECRET_FILE (`tensorwire run` sets one); else, on one host, this user's
    (`auth.per_user`); else none, which rank 0 warns about once a process
    (UnauthenticatedJobWarning)."""
    found = auth.configured(env)
    if found is not None:
        return found
    if not spans_hosts(info):
        return auth.per_user()
    global _warned
    if info.rank == 0 and not _warned:
        _warned = True
        on_host = f"{info.local_world_size} on this host" if info.local_world_size > 0 else "store at " \
            f"{info.init_method}"
        how = ("pass --secret-file PATH to every `tensorwire run`" if info.store_hosted else
               f"set {auth.ENV_SECRET_FILE} to a file (mode 0600) holding the same secret on every host, "
               f"or {auth.ENV_SECRET}")
        warnings.warn(
            f"tensorwire: this job spans hosts ({info.world_size} ranks, {on_host}) and has no secret: "
            f"anyone who can reach its ports can join it, read and change its store, and run code on every "
            f"rank through the object collectives (pickle). To authenticate "
            f"its connections, {how} (see docs/security.md).", UnauthenticatedJobWarning, stacklevel=3)
    return auth.NO_SECRET


# --------------------------------------------------------------------------------------------
# create_store


def _torch_agent_store(host: str, port: int, timeout: float) -> Store:
    try:
        import torch.distributed as dist
    except ImportError as exc:
        raise RendezvousError(f"torchrun's agent store at {host}:{port} speaks torch's protocol, but torch "
                              f"is not importable here ({exc})") from exc
    try:
        torch_store: Any = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    except RuntimeError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RendezvousError(f"could not connect to torchrun's agent store at {host}:{port} within "
                              f"{timeout:g} s: {first}") from exc
    return TorchStoreAdapter(torch_store, timeout=timeout)


def create_store(info: LaunchInfo, timeout: float, *, secret: auth.Secret | None = None,
                 limits: StoreLimits = DEFAULT_LIMITS, generation: int = 1,
                 refused: Callable[[Store, RendezvousError, Sequence[int]], None] | None = None,
                 connect_within: float | None = None) -> Store:
    """Connect to (rank 0: host, unless the launcher does) the job's store and check the roster.

    `secret`: the job's (default `job_secret(info)`); a TCP store proves it, and serves only
    clients that do (torch's stores and file stores have no such handshake). `generation`: the
    process's count of init() calls through a store, the same on every rank (see JOIN_KEY). The checks catch
    the two launch mistakes that otherwise surface as a hang much later: two processes given
    the same rank, and ranks started with different world sizes. `refused(store, error, absent)` is
    called before the latter raises, so that the rank can tell the others (api.init).
    `connect_within`: how long a TCP store's client tries to reach its server (default `timeout`).
    """
    scheme, host, port, path = parse_init_method(info.init_method)
    if scheme == "tcp":
        assert host is not None and port is not None
        if port == 0 and info.world_size > 1:
            raise InvalidArgumentError(f"init_method {info.init_method!r}: port 0 only works for one process")
        store: Store = TCPStore(host, port, timeout=timeout, server=info.rank == 0 and not info.store_hosted,
                                secret=secret if secret is not None else job_secret(info), limits=limits,
                                connect_within=connect_within)
    elif scheme == "file":
        assert path is not None
        store = FileStore(path, timeout=timeout, cleanup=True)
    elif scheme == "torch-agent":
        assert host is not None and port is not None
        # The agent's store outlives the attempts of an elastic job (--max-restarts): each
        # attempt's keys live under its job id, which counts the restarts.
        store = PrefixStore(info.job_id, _torch_agent_store(host, port, timeout), owns=True)
    else:
        raise InvalidArgumentError(f"create_store cannot open init_method {info.init_method!r}; "
                                   f"resolve 'env://' with detect() first")
    try:
        check_roster(store, info, timeout, generation, refused)
    except BaseException:
        store.close()
        raise
    return store


def check_roster(store: Store, info: LaunchInfo, timeout: float, generation: int,
                 refused: Callable[[Store, RendezvousError, Sequence[int]], None] | None) -> None:
    seat = "0" if info.rank == 0 else f"{info.world_size}/{info.rank}"
    joined = store.add(JOIN_KEY.format(generation=generation, seat=seat), 1)
    size_key = WORLD_SIZE_KEY.format(generation=generation)
    if joined > 1:
        raise RendezvousError(
            f"rank {info.rank} joined twice: two processes were given the same rank "
            f"(store {info.init_method}, world_size={info.world_size}, source {info.source}); if the "
            f"store is left over from an earlier run, remove it or use a fresh address")
    if info.rank == 0:
        store.set(size_key, json.dumps({"world_size": info.world_size,
                                        "local_world_size": info.local_world_size}).encode())
        return
    try:
        theirs = store.get(size_key, timeout)
    except TimeoutError as exc:
        refusals = store.refusals()
        raise TimeoutError(
            f"rank {info.rank} waited {timeout:g} s for rank 0 to publish its world size "
            f"('{size_key}') in the store {info.init_method}{'; ' + refusals if refusals else ''}; "
            f"did rank 0 start?") from exc
    try:
        rank0 = json.loads(theirs)
        size, local_size = int(rank0["world_size"]), int(rank0["local_world_size"])
    except (ValueError, TypeError, KeyError) as exc:
        raise RendezvousError(f"rank {info.rank}: init: rank 0 published its world size as {theirs[:64]!r} "
                              f"in the store {info.init_method}: it runs another tensorwire version, or "
                              f"another program wrote '{size_key}'") from exc
    if size != info.world_size:
        error = RendezvousError(
            f"rank {info.rank}: init: world size mismatch: rank {info.rank} was started with "
            f"world_size={info.world_size} but rank 0 with world_size={size} (store {info.init_method})"
            f"{_nodes_differ(info, size, local_size)}")
        if refused is not None:  # and for the others rank 0 waits for: no world can form
            refused(store, error, [r for r in range(1, size) if r != info.rank])
        raise error


def _nodes_differ(info: LaunchInfo, size: int, local_size: int) -> str:
    """What `tensorwire run` was told on this rank's node and on rank 0's, where the world sizes
    differ: each makes WORLD_SIZE --nnodes times -n."""
    if info.source != "tensorwire" or min(info.local_world_size, local_size) < 1:
        return ""
    return (f"; tensorwire run makes WORLD_SIZE --nnodes times -n: node {info.node_rank} runs -n "
            f"{info.local_world_size} --nnodes {info.world_size // info.local_world_size}, node 0 -n "
            f"{local_size} --nnodes {size // local_size}; every node needs the same -n and --nnodes")
