"""All `TENSORWIRE_*` settings, read in one place (see docs/configuration.md for the table).

Keyword arguments of `init()` win over the environment; the environment wins over defaults.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from . import log
from .errors import TensorwireWarning

DEFAULT_TIMEOUT_S = 300.0
_env_log = log.get("ENV")

SETTINGS = frozenset({
    "TENSORWIRE_ALGO", "TENSORWIRE_AUTH_PENDING", "TENSORWIRE_AUTH_TIMEOUT",
    "TENSORWIRE_BENCH_OWNER", "TENSORWIRE_BENCH_PROGRESS", "TENSORWIRE_BIND",
    "TENSORWIRE_CACHE_DIR", "TENSORWIRE_CACHE_MAX_AGE", "TENSORWIRE_CALIBRATE",
    "TENSORWIRE_COMPRESS", "TENSORWIRE_CUDA_CHUNK", "TENSORWIRE_CUDA_DEVICE_FLAGS",
    "TENSORWIRE_CUDA_HOST_BELOW", "TENSORWIRE_CUDA_IPC", "TENSORWIRE_CUDA_SLOT", "TENSORWIRE_DEBUG",
    "TENSORWIRE_DEBUG_SUBSYS", "TENSORWIRE_DETERMINISTIC", "TENSORWIRE_HELD_BYTES", "TENSORWIRE_HUGE_PAGES",
    "TENSORWIRE_JOB_ID", "TENSORWIRE_KEEP_MEMORY", "TENSORWIRE_LAUNCH_GRACE",
    "TENSORWIRE_MAX_MESSAGE", "TENSORWIRE_NATIVE", "TENSORWIRE_NSOCKS", "TENSORWIRE_PEER_TIMEOUT",
    "TENSORWIRE_SECRET", "TENSORWIRE_SECRET_FILE", "TENSORWIRE_SHM_DIRECT", "TENSORWIRE_SHM_RING",
    "TENSORWIRE_SINGLE_COPY", "TENSORWIRE_SOCKET_IFNAME", "TENSORWIRE_SOCKET_THREADS",
    "TENSORWIRE_SPIN_US", "TENSORWIRE_STORE_HOSTED", "TENSORWIRE_STORE_MAX_CONNECTIONS",
    "TENSORWIRE_STORE_MAX_VALUE", "TENSORWIRE_TCP_CHUNK", "TENSORWIRE_TCP_CONGESTION",
    "TENSORWIRE_TCP_RCVBUF", "TENSORWIRE_TCP_SNDBUF", "TENSORWIRE_TIMEOUT", "TENSORWIRE_TRANSPORT",
    "TENSORWIRE_TUNING_FILE",
})
"""Every environment variable tensorwire reads (tests/test_docs.py keeps the list whole): any
other TENSORWIRE_* is most likely a misspelt one, which would otherwise be ignored unseen."""


def warn_unknown_settings() -> None:
    """Warn about each TENSORWIRE_* variable tensorwire does not read, with the setting it
    most resembles."""
    for name in sorted(n for n in os.environ if n.startswith("TENSORWIRE_") and n not in SETTINGS):
        close = difflib.get_close_matches(name, SETTINGS, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        warnings.warn(f"{name} is not a tensorwire setting and is ignored{hint} (see docs/configuration.md)",
                      TensorwireWarning, stacklevel=4)


def _env_size(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    return parse_size(raw, name) if raw else None


def _env_size_or(name: str, default: int) -> int:
    size = _env_size(name)
    return default if size is None else size


def _env_float(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r} is not a number") from exc
    if not 0 <= value < float("inf"):
        raise ValueError(f"{name}={raw!r}: expected a number of 0 or more")
    return value


def _env_int(name: str, default: int) -> int:
    """A count: digits only, so that 2.5 connections are refused rather than cut to 2."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdecimal():
        raise ValueError(f"{name}={raw!r}: expected a whole number")
    return int(raw)


def _env_count(name: str, least: int, what: str) -> int | None:
    """A count from `least` to 64, or None for `auto` (or unset)."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "auto"):
        return None
    if not raw.isdecimal() or not least <= int(raw) <= 64:
        raise ValueError(f"{name}={raw!r}: expected auto or a number of {what} from {least} to 64")
    return int(raw)


THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_expected(setting: str) -> bool:
    """Whether large user buffers are in huge pages, for TENSORWIRE_HUGE_PAGES `setting`.

    `auto`: not where the kernel gives none (THP `never`); all where it gives them to every
    mapping (`always`); under `madvise` (the common default) numpy advises its arrays from 4
    MiB, but torch's CPU allocator only with THP_MEM_ALLOC_ENABLE=1 (`tensorwire run` sets it),
    so not in a process that has imported torch without it (why it matters:
    docs/design/buffers.md#huge-pages)."""
    value = setting.strip().lower() or "auto"
    if value in ("0", "1"):
        return value == "1"
    if value != "auto":
        raise ValueError(f"TENSORWIRE_HUGE_PAGES={setting!r}: expected auto, 0 or 1")
    try:
        with open(THP_ENABLED) as f:
            mode = f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return False
    if mode != "madvise":
        return mode == "always"
    return "torch" not in sys.modules or os.environ.get("THP_MEM_ALLOC_ENABLE", "") == "1"


_DURATION_UNITS = (("ms", 1e-3), ("s", 1), ("m", 60), ("h", 3600), ("d", 86400))


def parse_duration(text: str) -> float:
    """'3600', '500ms', '90s', '30m', '12h', '7d' -> seconds."""
    t = text.strip().lower()
    number, scale = t, 1.0
    for unit, seconds in _DURATION_UNITS:
        if t.endswith(unit):
            number, scale = t[: -len(unit)], seconds
            break
    try:
        seconds = float(number) * scale
    except ValueError as exc:
        raise ValueError(f"cannot read duration {text!r} (use e.g. 300, 500ms, 90s, 30m, 12h, 7d)") from exc
    if seconds != seconds:  # nan: every comparison with it is false, so no bound would hold
        raise ValueError(f"cannot read duration {text!r}: not a number")
    return seconds


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return parse_duration(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r}: {exc}") from None


def check_debug_settings() -> None:
    """TENSORWIRE_DEBUG and TENSORWIRE_DEBUG_SUBSYS name known levels and subsystems: a typo
    would silently log something else."""
    level = os.environ.get("TENSORWIRE_DEBUG", "").strip().upper()
    if level and level not in log.LEVELS:
        raise ValueError(f"TENSORWIRE_DEBUG={level!r}: expected one of {', '.join(log.LEVELS)}")
    subsys = os.environ.get("TENSORWIRE_DEBUG_SUBSYS", "")
    try:
        log.subsystems(subsys)
    except ValueError as exc:
        raise ValueError(f"TENSORWIRE_DEBUG_SUBSYS={subsys.strip().upper()!r}: {exc}") from None


def _env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r}: expected 1 or 0 (true/false, yes/no, on/off)")


_CALIBRATE_ALIASES = {"": "1", "true": "1", "yes": "1", "on": "1", "false": "0", "no": "0", "off": "0"}


def parse_size(text: str, setting: str = "") -> int:
    """'8', '64K', '64KiB', '1M', '2G' -> bytes (binary multiples, as nccl-tests reads them).
    ValueError naming `setting` (the variable or option it came from, where the caller's own
    error does not) for anything else, a negative size included."""
    t = str(text).strip().upper()
    t = t.removesuffix("IB") if t.endswith("IB") else t.removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(t[-1:], 1)
    if mult != 1:
        t = t[:-1]
    try:
        value = float(t)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        named = f"{setting}: " if setting else ""
        raise ValueError(f"{named}cannot read size {text!r} (use e.g. 8, 64K, 1M, 2G)")
    if value < 0:
        named = f"{setting}={text!r}" if setting else repr(text)
        raise ValueError(f"{named}: expected a size of 0 or more")
    return int(value * mult)


def size_text(nbytes: int, exact: bool = False) -> str:
    """'64 MiB', '1.5 GiB', '13.2 MiB', '512 B': in the largest binary unit it fills, to 3
    significant digits; `exact`: only in a unit that divides it ('1048584 B': a size a
    benchmark's table names)."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        value = nbytes / (1 << shift)
        if value >= 1 and not (exact and nbytes % (1 << shift)):
            if value == int(value):
                return f"{int(value)} {unit}"
            return f"{round(value, 2 if value < 10 else 1 if value < 100 else 0):g} {unit}"
    return f"{nbytes} B"


TCP_SNDBUF = 256 << 10
"""Default SO_SNDBUF of a TCP connection: about what a link of this transport's speed holds in
flight, no more (why: tcp.tune_socket)."""
TCP_RCVBUF = 4 << 20
"""Default SO_RCVBUF of a TCP connection: a whole step of a large collective can land while
its receiver waits for a core (why: tcp.tune_socket)."""
TCP_SETTINGS = ("tcp_congestion", "tcp_sndbuf", "tcp_rcvbuf", "nsocks", "socket_threads")
"""The Config fields that shape a TCP connection or what moves its bytes, and so its calibrated
α and β."""

AUTH_TIMEOUT_S = 10.0
"""Default time a connection gets to authenticate: a rank's handshake takes a few round trips
(under a millisecond on loopback), so only strangers and wedged processes ever reach it."""
PEER_TIMEOUT_S = 10.0
"""Default time in which a peer whose host stopped answering is declared lost."""
STORE_MAX_VALUE = 16 << 20
"""Default largest store value: tensorwire's own are addresses and counters of a few hundred bytes."""


def physical_memory() -> int:
    """Bytes of RAM on this host (1 TiB where the system does not say): the default bound of
    a message's size, which no legitimate message can exceed where it must be staged."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") or 1 << 40
    except (ValueError, OSError):
        return 1 << 40


DIRECT_GROUP_BYTES = 8 << 20
"""Default shared memory of one group's one-shot path (all ranks' slots), before the per-rank bounds."""


@dataclass(frozen=True)
class Config:
    timeout: float = DEFAULT_TIMEOUT_S
    """Seconds any blocking call waits before raising TimeoutError (TENSORWIRE_TIMEOUT)."""
    transport: str = "auto"
    """'auto' (shared memory within a host, TCP across), or 'tcp' to force TCP (TENSORWIRE_TRANSPORT)."""
    socket_ifname: str = ""
    """NCCL-style interface filter: 'eth0,ib' prefixes, '^docker,lo' exclusions, '=eth0' exact."""
    shm_ring_bytes: int = 4 << 20
    """Capacity of each directed shared-memory ring (TENSORWIRE_SHM_RING)."""
    tcp_chunk_bytes: int = 1 << 20
    """Staging chunk for receive-and-reduce over TCP (TENSORWIRE_TCP_CHUNK)."""
    tcp_sndbuf: int = TCP_SNDBUF
    """Send buffer of tensorwire's TCP connections in bytes, as SO_SNDBUF takes it (the kernel
    doubles it); 0 leaves it to the kernel's autotuning (TENSORWIRE_TCP_SNDBUF): see
    tcp.tune_socket."""
    tcp_rcvbuf: int = TCP_RCVBUF
    """Receive buffer of tensorwire's TCP connections in bytes, as SO_RCVBUF takes it (the
    kernel doubles it, and stops autotuning it); 0 leaves it to the kernel's autotuning
    (TENSORWIRE_TCP_RCVBUF): see tcp.tune_socket."""
    nsocks: int | None = None
    """TCP streams per pair of ranks over TCP, over which messages from 256 KiB are split, with
    pump threads a part per MiB (TENSORWIRE_NSOCKS; transport/tcp.py); None: by the cores each
    rank has (transport/pumps.streams_per_pair)."""
    socket_threads: int | None = None
    """Threads per rank that move large TCP messages; None: by the cores each rank has
    (TENSORWIRE_SOCKET_THREADS; transport/pumps.py)."""
    tcp_congestion: str = ""
    """Congestion control of tensorwire's TCP connections, e.g. 'cubic'; '' keeps the system's
    (net.ipv4.tcp_congestion_control) (TENSORWIRE_TCP_CONGESTION): see tcp.tune_socket."""
    direct_bytes: int | None = None
    """Per-rank slot of the one-shot shared-memory path; 0 turns it off; None: see direct_slot
    (TENSORWIRE_SHM_DIRECT)."""
    algo: str = ""
    """Forced algorithms, NCCL-style: 'allreduce:ring' (TENSORWIRE_ALGO)."""
    compress: str = ""
    """'bf16' or 'fp16': the torch backend's float32/float64 SUM and AVG all_reduces run with
    that compress= (TENSORWIRE_COMPRESS; ops/compress.py); '' none."""
    spin_us: float | None = None
    """How long a waiting rank busy-polls before yielding, then sleeping (TENSORWIRE_SPIN_US);
    None: 50 us, or 0 on a host with more ranks than usable cores (TENSORWIRE_SPIN_US)."""
    native: str = "auto"
    """The direct path's compiled bodies: 'auto' where the install built them, '0' the Python
    ones, '1' the compiled ones or an error (TENSORWIRE_NATIVE; transport/native.py)."""
    bind: bool = False
    """Where a machine runs more ranks than the cores they may use, bind each rank to one of
    those cores, round robin by its index among the machine's ranks (TENSORWIRE_BIND=1; a
    trade weighed in Engine.adapt_to_machine)."""
    deterministic: bool = False
    """Bitwise-reproducible reductions: every element folded in rank order (TENSORWIRE_DETERMINISTIC)."""
    calibrate: str = "1"
    """Link calibration at init: '0' skip, '1' probe unless cached, 'force' (TENSORWIRE_CALIBRATE)."""
    tuning_file: str = ""
    """JSON file of per-tier alpha/beta/gamma that override the calibrated ones (TENSORWIRE_TUNING_FILE)."""
    cache_dir: str = ""
    """Where calibrations are cached; '' means $XDG_CACHE_HOME or ~/.cache, then /tensorwire."""
    cache_max_age: float = 86400.0
    """Seconds after which a cached calibration is redone (TENSORWIRE_CACHE_MAX_AGE)."""
    keep_memory: bool = True
    """Keep freed memory in the process, so temporaries reuse warm pages (TENSORWIRE_KEEP_MEMORY)."""
    single_copy: str = "1"
    """Let ranks on one host copy large messages straight out of each other's memory
    (process_vm_readv; under Yama ptrace_scope 1 this declares any process a permitted
    tracer, as Open MPI does): '0' never, '1' for the reductions, and for all_gather and
    all_to_all unless ranks outnumber cores (slower there), 'force' wherever the kernel allows
    (TENSORWIRE_SINGLE_COPY)."""
    huge_pages: bool = True
    """Presume single copy's sources in huge pages until a call sees otherwise (cost_model.HUGE_FROM,
    tuner.PageDependent): TENSORWIRE_HUGE_PAGES=1 or 0, or `auto` (see huge_pages_expected).
    Every rank of a job prices alike: calibration takes it only where all ranks expect them."""
    cuda_ipc: bool = True
    """Ranks of one host exchange CUDA buffers device to device through CUDA IPC; 0 stages them
    through pinned host memory as across hosts (TENSORWIRE_CUDA_IPC)."""
    cuda_slot: int = 1 << 20
    """Per-rank device slot of the small CUDA path (a call whose share fits takes one flag round);
    0 sends every CUDA call through the buffers themselves (TENSORWIRE_CUDA_SLOT)."""
    cuda_device_flags: str = "auto"
    """Small CUDA all_reduces, broadcasts and all_gathers as one kernel per rank that polls its
    peers' flags in GPU memory (Triton): 'auto' where every rank has a GPU of its own or MPS
    runs, '1' wherever Triton imports and ranks share memory through IPC, '0' never
    (TENSORWIRE_CUDA_DEVICE_FLAGS)."""
    cuda_host_below: int = 0
    """CUDA calls whose share per rank is smaller go through pinned host memory and the host's
    one-shot path even where ranks could reach each other's GPU memory (TENSORWIRE_CUDA_HOST_BELOW;
    slower where tried: docs/design/gpu.md)."""
    cuda_chunk: int | None = None
    """Pieces in which staged CUDA all_reduces and broadcasts pipeline the device-to-host copy,
    the wire and the copy back (TENSORWIRE_CUDA_CHUNK); None: by the wire (gpu/staged.piece_bytes)."""
    auth_timeout: float = AUTH_TIMEOUT_S
    """Seconds a connection to the store or to a rank may take to prove it knows the job's
    secret before it is dropped (TENSORWIRE_AUTH_TIMEOUT)."""
    peer_timeout: float = PEER_TIMEOUT_S
    """Seconds after which a peer whose host stopped answering (down, cut off: no connection
    reset ever comes) is lost: TCP keepalive on every connection, what waits for an
    acknowledgement looked at by idle waiters, and the bound of a dial (TENSORWIRE_PEER_TIMEOUT;
    transport/tcp.py tune_socket, transport/failures.py check_silent)."""
    auth_pending: int = 64
    """Connections a store or a listening rank holds while they authenticate; a new one beyond
    drops the one that got least far in its handshake (TENSORWIRE_AUTH_PENDING, auth.Pending)."""
    store_max_value: int = STORE_MAX_VALUE
    """Largest value a store accepts; a larger frame closes its connection (TENSORWIRE_STORE_MAX_VALUE)."""
    store_max_connections: int = 4096
    """Connections a store server holds at once; more are refused (TENSORWIRE_STORE_MAX_CONNECTIONS)."""
    max_message: int = field(default_factory=physical_memory)
    """Largest payload a message header may announce: a header beyond it is a broken or hostile
    stream, and closes the connection before anything is allocated (TENSORWIRE_MAX_MESSAGE;
    default the host's RAM)."""
    held_bytes: int | None = None
    """Bytes of messages a rank may hold for receives and calls it has not made yet (they came
    early) before it drops the next and fails its group with a ResourceError, rather than
    growing until the host runs out of memory (TENSORWIRE_HELD_BYTES; 0: no bound; None: half
    the host's RAM shared by its ranks, at least 1 GiB: `held_limit`)."""
    extra: dict[str, str] = field(default_factory=dict)

    def held_limit(self, local_ranks: int) -> int:
        """TENSORWIRE_HELD_BYTES, or its default for a host of `local_ranks` ranks (0: no bound)."""
        if self.held_bytes is not None:
            return self.held_bytes
        return max(1 << 30, physical_memory() // 2 // max(1, local_ranks))

    @classmethod
    def from_env(cls, **overrides: object) -> Config:
        cfg = cls(
            timeout=_env_seconds("TENSORWIRE_TIMEOUT", DEFAULT_TIMEOUT_S),
            transport=os.environ.get("TENSORWIRE_TRANSPORT", "auto").strip().lower() or "auto",
            socket_ifname=os.environ.get("TENSORWIRE_SOCKET_IFNAME", ""),
            shm_ring_bytes=_env_size_or("TENSORWIRE_SHM_RING", 4 << 20),
            tcp_chunk_bytes=_env_size_or("TENSORWIRE_TCP_CHUNK", 1 << 20),
            tcp_congestion=os.environ.get("TENSORWIRE_TCP_CONGESTION", "").strip(),
            nsocks=_env_count("TENSORWIRE_NSOCKS", 1, "streams"),
            socket_threads=_env_count("TENSORWIRE_SOCKET_THREADS", 0, "threads"),
            tcp_sndbuf=_env_size_or("TENSORWIRE_TCP_SNDBUF", TCP_SNDBUF),
            tcp_rcvbuf=_env_size_or("TENSORWIRE_TCP_RCVBUF", TCP_RCVBUF),
            direct_bytes=_env_size("TENSORWIRE_SHM_DIRECT"),
            algo=os.environ.get("TENSORWIRE_ALGO", ""),
            compress=os.environ.get("TENSORWIRE_COMPRESS", "").strip().lower(),
            spin_us=_env_float("TENSORWIRE_SPIN_US", None),
            native=os.environ.get("TENSORWIRE_NATIVE", "auto").strip().lower() or "auto",
            bind=_env_bool("TENSORWIRE_BIND", False),
            deterministic=_env_bool("TENSORWIRE_DETERMINISTIC", False),
            calibrate=_CALIBRATE_ALIASES.get(os.environ.get("TENSORWIRE_CALIBRATE", "").strip().lower(),
                                             os.environ.get("TENSORWIRE_CALIBRATE", "").strip().lower()),
            tuning_file=os.environ.get("TENSORWIRE_TUNING_FILE", "").strip(),
            cache_dir=os.environ.get("TENSORWIRE_CACHE_DIR", "").strip(),
            cache_max_age=_env_seconds("TENSORWIRE_CACHE_MAX_AGE", 86400.0),
            keep_memory=_env_bool("TENSORWIRE_KEEP_MEMORY", True),
            single_copy=os.environ.get("TENSORWIRE_SINGLE_COPY", "1").strip().lower() or "1",
            huge_pages=huge_pages_expected(os.environ.get("TENSORWIRE_HUGE_PAGES", "auto")),
            cuda_ipc=_env_bool("TENSORWIRE_CUDA_IPC", True),
            cuda_slot=_env_size_or("TENSORWIRE_CUDA_SLOT", 1 << 20),
            cuda_device_flags=os.environ.get("TENSORWIRE_CUDA_DEVICE_FLAGS", "").strip().lower() or "auto",
            cuda_host_below=_env_size_or("TENSORWIRE_CUDA_HOST_BELOW", 0),
            cuda_chunk=_env_size("TENSORWIRE_CUDA_CHUNK")
            if os.environ.get("TENSORWIRE_CUDA_CHUNK", "auto").strip().lower() != "auto" else None,
            auth_timeout=_env_seconds("TENSORWIRE_AUTH_TIMEOUT", AUTH_TIMEOUT_S),
            peer_timeout=_env_seconds("TENSORWIRE_PEER_TIMEOUT", PEER_TIMEOUT_S),
            auth_pending=_env_int("TENSORWIRE_AUTH_PENDING", 64),
            store_max_value=_env_size_or("TENSORWIRE_STORE_MAX_VALUE", STORE_MAX_VALUE),
            store_max_connections=_env_int("TENSORWIRE_STORE_MAX_CONNECTIONS", 4096),
            max_message=_env_size_or("TENSORWIRE_MAX_MESSAGE", physical_memory()),
            held_bytes=_env_size("TENSORWIRE_HELD_BYTES"),
        )
        clean: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
        cfg = replace(cfg, **clean) if clean else cfg
        check_debug_settings()
        warn_unknown_settings()
        if cfg.transport not in ("auto", "tcp", "shm"):
            raise ValueError(f"TENSORWIRE_TRANSPORT (or init's transport=) {cfg.transport!r}: expected "
                             f"auto, tcp or shm")
        if cfg.calibrate not in ("0", "1", "force"):
            raise ValueError(f"TENSORWIRE_CALIBRATE={cfg.calibrate!r}: expected 0 (skip), 1 (probe unless "
                             f"cached) or force (probe and rewrite the cache)")
        slot = cfg.direct_bytes
        if slot is not None and slot != 0 and (slot < 4096 or slot % 64):
            raise ValueError(f"TENSORWIRE_SHM_DIRECT={slot}: expected 0 (off) or a size of at least 4K, a "
                             f"multiple of 64 bytes")
        if cfg.compress not in ("", "bf16", "fp16"):
            raise ValueError(f"TENSORWIRE_COMPRESS={cfg.compress!r}: expected bf16, fp16 or nothing")
        if cfg.native not in ("auto", "0", "1"):
            raise ValueError(f"TENSORWIRE_NATIVE={cfg.native!r}: expected auto, 0 (the Python bodies) or 1 "
                             f"(the compiled ones, an error where they were not built)")
        if cfg.single_copy not in ("0", "1", "force"):
            raise ValueError(f"TENSORWIRE_SINGLE_COPY={cfg.single_copy!r}: expected 0 (never), 1 (the "
                             f"reductions always, the rest unless ranks outnumber cores) or force "
                             f"(wherever the kernel allows)")
        if not cfg.cache_max_age > 0:
            raise ValueError(f"TENSORWIRE_CACHE_MAX_AGE: expected a positive duration, got "
                             f"{cfg.cache_max_age} s")
        if not 0 < cfg.timeout < float("inf"):
            raise ValueError(f"TENSORWIRE_TIMEOUT (or init's timeout=): expected positive seconds, got "
                             f"{cfg.timeout}")
        for name, size in (("SNDBUF", cfg.tcp_sndbuf), ("RCVBUF", cfg.tcp_rcvbuf)):
            if size and not 4096 <= size <= 1 << 30:
                raise ValueError(f"TENSORWIRE_TCP_{name}={size}: expected 0 (the kernel's autotuning) or "
                                 f"4K to 1G")
        if not 4096 <= cfg.tcp_chunk_bytes <= 1 << 30:
            raise ValueError(f"TENSORWIRE_TCP_CHUNK={cfg.tcp_chunk_bytes}: expected 4K to 1G")
        if cfg.spin_us is not None and cfg.spin_us > 1e6:
            raise ValueError(f"TENSORWIRE_SPIN_US={cfg.spin_us:g}: expected 0 to 1000000 (a second)")
        if cfg.cuda_device_flags not in ("auto", "0", "1"):
            raise ValueError(f"TENSORWIRE_CUDA_DEVICE_FLAGS={cfg.cuda_device_flags!r}: expected auto (a GPU "
                             f"per rank or MPS), 1 (wherever Triton imports) or 0 (never)")
        if cfg.cuda_slot % 256:  # slots and the flag words behind them stay aligned for every dtype
            raise ValueError(f"TENSORWIRE_CUDA_SLOT={cfg.cuda_slot}: expected a multiple of 256 bytes "
                             f"(0 turns the slots off)")
        if cfg.cuda_chunk is not None and cfg.cuda_chunk < 64 << 10:
            raise ValueError(f"TENSORWIRE_CUDA_CHUNK={cfg.cuda_chunk}: expected at least 64K")
        if not 0 < cfg.auth_timeout < 1e6:
            raise ValueError(f"TENSORWIRE_AUTH_TIMEOUT={cfg.auth_timeout:g}: expected positive seconds (less "
                             f"than 1e6)")
        if not 1 <= cfg.peer_timeout < 1e6:
            raise ValueError(f"TENSORWIRE_PEER_TIMEOUT={cfg.peer_timeout:g}: expected at least 1 s (and "
                             f"less than 1e6 s)")
        for name, value, least in (("AUTH_PENDING", cfg.auth_pending, 1),
                                   ("STORE_MAX_CONNECTIONS", cfg.store_max_connections, 1),
                                   ("STORE_MAX_VALUE", cfg.store_max_value, 1 << 10),
                                   ("MAX_MESSAGE", cfg.max_message, 1 << 20)):
            if value < least:
                raise ValueError(f"TENSORWIRE_{name}={value}: expected at least {least}")
        if cfg.shm_ring_bytes < 64 << 10 or cfg.shm_ring_bytes % 4096:
            raise ValueError("TENSORWIRE_SHM_RING must be a multiple of 4096 and at least 64K")
        return cfg

    def changed(self, names: Sequence[str] | None = None) -> dict[str, object]:
        """The settings (of `names`, default all) that differ from their fields' defaults."""
        defaults = {f.name: f.default if f.default_factory is MISSING else f.default_factory()
                    for f in fields(self)}
        return {name: getattr(self, name) for name in (defaults if names is None else names)
                if getattr(self, name) != defaults[name]}

    def tcp_changed(self) -> dict[str, object]:
        """The TCP settings (TCP_SETTINGS) that differ from their fields' defaults."""
        return self.changed(TCP_SETTINGS)

    def log_changed(self) -> None:
        """The ENV log's line at init: the settings in effect that are not their defaults."""
        if _env_log.isEnabledFor(logging.INFO):
            changed = self.changed()
            _env_log.info("settings not at their defaults: %s", ", ".join(
                f"{name}={value!r}" for name, value in changed.items()) if changed else "none")

    def direct_slot(self, group_size: int) -> int:
        """Bytes of one rank's slot on the one-shot shared-memory path in a group of this size:
        TENSORWIRE_SHM_DIRECT, or by default 8 MiB for the group's two slots per rank, kept
        between 64 KiB and 1 MiB a rank (a collective that fits skips every per-peer round trip;
        where /dev/shm has less room, shm_budget shrinks it)."""
        if self.direct_bytes is not None:
            return self.direct_bytes
        per_rank = (DIRECT_GROUP_BYTES // (2 * max(group_size, 1))) // 4096 * 4096
        return max(64 << 10, min(1 << 20, per_rank))
