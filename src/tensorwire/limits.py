"""The system limits a job can run out of, named in its errors: descriptors, ports, memory.

Each rank checks its descriptors before wiring (raising its soft limit toward the hard one
where that suffices, as Open MPI does) and tells the others through the store, so no rank waits
for one that cannot wire; the errors met anyway become a `ResourceError` that names the limit,
its value and how to raise it (docs/limits.md; why: docs/design/shm-degradation.md).
"""

from __future__ import annotations

import errno
import math
import os
import resource
import threading

from . import log
from .errors import ResourceError

_log = log.get("INIT")
HEADROOM = 16
"""Descriptors a process needs beyond those it is asked for: a rank after init holds 5 besides
its sockets (standard streams, /proc/self/pagemap), and while it starts a segment's, the
calibration cache's and the application's own few."""
_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"


def typical_peers(size: int) -> int:
    """How many peers a rank of a group of `size` typically talks to: its ring neighbours and
    the log2 partners of recursive doubling and halving and of binomial trees."""
    return min(size - 1, 2 * math.ceil(math.log2(max(size, 2))) + 2)


def wiring_need(world_size: int) -> int:
    """Descriptors a rank's wiring needs at init, beyond HEADROOM: its listeners (at its address
    and on loopback), the wiring thread's wakeup and spare, and a connection to each peer it
    typically talks to. Pairs connect on first use (transport/wiring.py), so this, not the
    world size, is what a rank holds; a rank that talks to more peers later raises its soft
    limit then, or fails naming the limit."""
    return 4 + typical_peers(world_size)


def descriptors_allow(per_peer: int, peers: int) -> bool:
    """Could this process hold `per_peer` descriptors for each of `peers` peers (and the
    wiring's own) under its hard limit? Soft limits rise as connections need (raise_soft_limit)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return _unlimited(hard) or HEADROOM + wiring_need(1) + per_peer * peers <= hard


def open_descriptors() -> int:
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listing it
    except OSError as exc:  # no descriptor left to list them with: as many as the limit
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0] if exc.errno == errno.EMFILE else 0


def pending_bound(setting: int) -> int:
    """TENSORWIRE_AUTH_PENDING within this process's descriptors: at most an eighth of its
    soft limit, so that connections still to prove themselves never take the descriptors its
    peers and segments need."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return setting if _unlimited(soft) else max(1, min(setting, soft // 8))


def _unlimited(value: int) -> bool:
    return value == resource.RLIM_INFINITY


def ensure_descriptors(need: int, who: str, why: str) -> None:
    """Make sure this process can open `need` more descriptors (plus HEADROOM): raise the soft
    limit as far as that takes where the hard limit allows, else raise ResourceError naming
    the limit, `who` ran out ("rank 3: init") and `why` it needs them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = open_descriptors()
    want = used + need + HEADROOM
    if _unlimited(soft) or want <= soft:
        return
    if _unlimited(hard) or want <= hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        _log.info("%s: raised the soft limit of open files from %d to %d (hard limit %s) for %s", who, soft,
                  want, "unlimited" if _unlimited(hard) else hard, why)
        return
    suggest = 1024
    while suggest < want:
        suggest *= 2
    raise ResourceError(
        f"{who}: out of file descriptors: ulimit -n is {soft} (hard limit {hard}) and {used} are open, "
        f"but {why} needs about {need + HEADROOM} more; raise the limit to {suggest} or more "
        f"(`ulimit -n {suggest}` before starting, `docker run --ulimit nofile={suggest}`, systemd "
        f"LimitNOFILE={suggest}, Slurm's PropagateResourceLimits) (docs/limits.md)")


def raise_soft_limit() -> bool:
    """Where this process ran out of descriptors below its hard limit: double the soft limit
    (at most to the hard one), as a rank connecting to more peers than init planned for needs
    (transport/wiring.py); whether it rose."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if _unlimited(soft) or (not _unlimited(hard) and soft >= hard):
        return False
    new = 2 * soft if _unlimited(hard) else min(2 * soft, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    _log.info("raised the soft limit of open files from %d to %d (hard limit %s) to connect to more peers",
              soft, new, "unlimited" if _unlimited(hard) else hard)
    return True


def translate(exc: OSError, who: str) -> ResourceError | None:
    """The ResourceError an exhausted limit behind `exc` amounts to, None for other errors."""
    if exc.errno == errno.EMFILE:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        return ResourceError(f"{who}: out of file descriptors (ulimit -n is {soft}, hard limit {hard}, "
                             f"{open_descriptors()} open): raise it with `ulimit -n` (docs/limits.md)")
    if exc.errno == errno.ENFILE:
        return ResourceError(f"{who}: the system is out of file descriptors (fs.file-max "
                             f"{_read('/proc/sys/fs/file-max')}); close other programs' files or raise "
                             f"fs.file-max (docs/limits.md)")
    if exc.errno in (errno.EADDRNOTAVAIL, errno.EADDRINUSE):
        return ResourceError(f"{who}: out of local ports (net.ipv4.ip_local_port_range is "
                             f"{_read(_RANGE).replace(chr(9), '-')}; sockets in TIME_WAIT hold theirs for a "
                             f"minute): widen the range or wait (docs/limits.md) [{exc}]")
    if exc.errno == errno.ENOMEM:
        return memory_error(exc, who)
    return None


def memory_error(exc: BaseException, who: str,
                 advice: str = "use smaller messages or raise the limit") -> ResourceError:
    """Out of memory, with the limits that apply: the address-space rlimit and the cgroup's."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    limits = [f"ulimit -v {'unlimited' if _unlimited(soft) else f'{soft >> 20} MiB'}"]
    cgroup = _cgroup_memory()
    if cgroup:
        limits.append(cgroup)
    return ResourceError(f"{who}: out of memory ({str(exc) or type(exc).__name__}; {', '.join(limits)}): "
                         f"{advice} (docs/limits.md)")


def start_thread(thread: threading.Thread, who: str) -> None:
    """`thread.start()`, or a ResourceError naming the memory limits where no thread can start
    (Python says only "can't start new thread")."""
    try:
        thread.start()
    except RuntimeError as exc:
        if "can't start new thread" not in str(exc):  # (e.g. at interpreter shutdown)
            raise
        raise memory_error(exc, who, "raise the limit") from exc


def _cgroup_memory() -> str:
    """'cgroup memory.max X MiB, Y MiB in use' for this process's cgroup (v2), '' where unknown."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next(line.split(":", 2)[2].strip() for line in f if line.startswith("0::"))
        base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        limit = _read(os.path.join(base, "memory.max"))
        current = int(_read(os.path.join(base, "memory.current")))
    except (OSError, StopIteration, ValueError):
        return ""
    shown = limit if limit == "max" else f"{int(limit) >> 20} MiB"
    return f"cgroup memory.max {shown}, {current >> 20} MiB in use"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"
