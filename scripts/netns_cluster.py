#!/usr/bin/env python3
"""A multi-host tensorwire cluster on one Linux machine, built from network namespaces.

    python scripts/netns_cluster.py --hosts 3 --nproc-per-host 2 --rate 1gbit -- train.py --epochs 1

Topology (K hosts; everything lives in namespaces this script creates and always removes):

    namespace twtb-<pid>-br          namespace twtb-<pid>-h<i>   (one per host i = 0..K-1)
    +------------------------+       +---------------------------------------------+
    | br0 (bridge, no addr)  |       | lo      127.0.0.1                           |
    |   p0 ----- veth -------+-------+ eth0    10.77.0.<i+1>/24  [tc: rate, delay] |
    |   p1 ----- veth ...    |       | hostname twhost-<i> (own UTS namespace)     |
    +------------------------+       | tensorwire run --nnodes K --node-rank i ... |
                                     +---------------------------------------------+

Each host namespace is a distinct host to tensorwire: its own network stack (reaching the
others only through its veth and the bridge) and its own hostname, so ranks on different
hosts never use shared memory (they connect over TCP) while ranks on one host do. Host 0
(10.77.0.1) hosts the rendezvous store. Only loopback and the 10.77.0.0/24 addresses inside
these namespaces are ever used: nothing is added to the root namespace, and there is no
route out of the namespaces.

Every launcher's output is streamed with a `[twhost-<i>]` prefix; at the end the script
reports each host's exit status and exits with the worst one (the largest, 128+N for a death
by signal N). Namespaces, veths and the bridge are removed on success, on failure, on an
exception and on SIGINT/SIGTERM/SIGHUP; after a SIGKILL of this script, `--cleanup`
removes the leftovers (namespaces named twtb-<pid>-* whose pid is gone).

Exit codes of the script itself: 2 usage error, 3 the testbed could not be built (not
root, no iproute2, no network namespaces, no netem for --delay), 4 the job succeeded but
--check-transport found a rank using the wrong transport or address, 124 --job-timeout
expired, 130/143 interrupted. See docs/multihost.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import TextIO

PREFIX = "twtb-"
"""Every namespace this script creates is named twtb-<pid of the creating script>-<role>."""
SUBNET = "10.77.0"
PREFIX_LEN = 24
BRIDGE = "br0"
NETNS_ETC = "/etc/netns"
"""`ip netns exec NS` bind-mounts /etc/netns/NS/<file> over /etc/<file>: each host's /etc/hosts."""
HOST_IF = "eth0"
DEFAULT_MASTER_PORT = 29500
MAX_HOSTS = 200
TAIL_LINES = 40
TERM_TO_KILL_S = 3.0
INTERRUPT_GRACE_S = 8.0
"""After forwarding SIGINT/SIGTERM to the launchers, how long they get before SIGKILL."""
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# Runs inside `unshare --uts` (a fresh UTS namespace), as the very process this script started
# (ip netns exec and unshare exec, they do not fork): set the host name, ask for SIGTERM should
# this script die (the launcher then stops its ranks, as on Ctrl-C), then become the launcher.
_HOST_SHIM = """\
import ctypes, os, signal, socket, sys
socket.sethostname(sys.argv[1])
ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[2]):
    sys.exit("netns_cluster: the testbed exited before this host started")
os.execv(sys.argv[3], sys.argv[3:])
"""

_log_lock = threading.Lock()


def say(text: str, stream: TextIO | None = None) -> None:
    """A testbed message (never mixed into a host's line)."""
    out = stream or sys.stderr
    with _log_lock:
        try:
            out.write(f"netns_cluster: {text}\n")
            out.flush()
        except (OSError, ValueError):
            pass


class SetupError(RuntimeError):
    """The testbed could not be built (or a probe failed); the message says what and why."""


class Interrupted(BaseException):
    """Raised in the main thread by our signal handler, so that `finally` blocks still run."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# ----------------------------------------------------------------------------------------------
# Small helpers


def _cmd(argv: Sequence[str], what: str, check: bool = True, timeout: float = 20.0) -> str:
    """Run a short system command (ip, tc); SetupError with its stderr if it fails."""
    try:
        done = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)
    except FileNotFoundError as exc:
        raise SetupError(f"{what}: {argv[0]} is not installed ({exc})") from exc
    except subprocess.TimeoutExpired as exc:
        raise SetupError(f"{what}: `{' '.join(argv)}` did not finish within {timeout:g} s") from exc
    if check and done.returncode != 0:
        err = (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
        raise SetupError(f"{what}: `{' '.join(argv)}` failed: {err}")
    return done.stdout


_RATE_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
               "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12}


def parse_rate(text: str) -> float:
    """tc rate syntax ('100mbit', '1gbit', '10mbps' = bytes/s) -> bytes per second."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", text)
    if not m or m.group(2).lower() not in _RATE_UNITS:
        raise argparse.ArgumentTypeError(
            f"cannot read rate {text!r}: use tc syntax, e.g. 100mbit, 1gbit, 500kbit (bits/s) or 10mbps "
            f"(bytes/s)")
    value = float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]
    if value < 1000:
        raise argparse.ArgumentTypeError(f"rate {text!r} is below 8kbit: too slow to be useful")
    return value


def parse_delay(text: str) -> float:
    """tc time syntax ('0.2ms', '1ms', '50us', '0.01s') -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|ms|us|usec|msec|sec)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"cannot read delay {text!r}: use e.g. 0.2ms, 1ms, 50us")
    scale = {"s": 1, "sec": 1, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}[m.group(2) or "ms"]
    seconds = float(m.group(1)) * scale
    if seconds > 10:
        raise argparse.ArgumentTypeError(f"delay {text!r} is over 10 s")
    return seconds


def exit_code_of(returncode: int | None) -> int:
    """Shell convention: death by signal N is 128+N; None (never reaped) counts as 1."""
    if returncode is None:
        return 1
    return 128 - returncode if returncode < 0 else returncode


def _pid_alive(pid: int) -> bool:
    """True if `pid` runs (a zombie, dead but not yet reaped, does not count)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (`ip netns list`), [] if ip is missing."""
    try:
        out = _cmd(["ip", "netns", "list"], "list network namespaces")
    except SetupError:
        return []
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL whatever still runs in one of our namespaces (only ever ours: we made it)."""
    try:
        out = _cmd(["ip", "netns", "pids", ns], f"list processes in {ns}", check=False)
    except SetupError:
        return
    for word in out.split():
        if word.isdigit() and int(word) != os.getpid():
            try:
                os.kill(int(word), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _remove_etc(ns: str) -> None:
    """Remove /etc/netns/<ns> (our per-host hosts file), and /etc/netns itself once empty."""
    shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)
    try:
        os.rmdir(NETNS_ETC)  # only succeeds when empty: another testbed's files stay
    except OSError:
        pass


def delete_namespace(ns: str) -> bool:
    """Kill what runs in `ns`, then delete it (its veth ends and bridge go with it)."""
    _kill_namespace_processes(ns)
    _remove_etc(ns)
    try:
        _cmd(["ip", "netns", "delete", ns], f"delete namespace {ns}")
    except SetupError as exc:
        if ns in list_namespaces():
            say(f"warning: {exc}")
            return False
    return True


def cleanup_leftovers(everything: bool = False, out: TextIO | None = None) -> list[str]:
    """Remove namespaces left by a testbed that died without cleaning up (SIGKILL, power cut).

    Only names twtb-<pid>-* are considered, and only those whose pid no longer runs unless
    `everything` (then also those of live testbeds: use only when none should be running).
    """
    removed = []
    names = list_namespaces()
    try:
        # /etc/netns/<ns> directories whose namespace is already gone
        names += [n for n in os.listdir(NETNS_ETC) if n.startswith(PREFIX) and n not in names]
    except OSError:
        pass
    for ns in names:
        m = re.fullmatch(re.escape(PREFIX) + r"(\d+)-[A-Za-z0-9_-]+", ns)
        if not m:
            continue
        pid = int(m.group(1))
        if not everything and (pid == os.getpid() or _pid_alive(pid)):
            say(f"keeping {ns}: its testbed (pid {pid}) is still running (use --cleanup --all)", out)
            continue
        if delete_namespace(ns):
            removed.append(ns)
            say(f"removed leftover namespace {ns}", out)
    if not removed:
        say("no leftover namespaces to remove", out)
    return removed


# ----------------------------------------------------------------------------------------------
# Probing what this machine supports


def probe_support() -> dict[str, object]:
    """What can be built here: {'netns': bool, 'reason': str, 'tbf': bool, 'netem': bool, ...}.

    Builds a throwaway namespace pair with a bridge and a veth, tries `unshare --uts` inside
    it and the two qdiscs the shaping uses, and removes it again.
    """
    result: dict[str, object] = {"netns": False, "reason": "", "tbf": False, "netem": False,
                                 "root": os.geteuid() == 0}
    missing = [tool for tool in ("ip", "tc", "unshare") if shutil.which(tool) is None]
    if "ip" in missing or "unshare" in missing:
        result["reason"] = f"{' and '.join(missing)} not installed (needs iproute2 and util-linux)"
        return result
    tag = f"{PREFIX}{os.getpid()}-probe"
    br, host = f"{tag}b", f"{tag}h"
    made: list[str] = []
    try:
        for ns in (br, host):
            _cmd(["ip", "netns", "add", ns], "create a network namespace")
            made.append(ns)
        _cmd(["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge"], "create a bridge")
        _cmd(["ip", "-n", br, "link", "add", "p0", "type", "veth", "peer", "name", HOST_IF, "netns", host],
             "create a veth pair")
        _cmd(["ip", "-n", br, "link", "set", "p0", "master", BRIDGE], "attach a veth to the bridge")
        _cmd(["ip", "netns", "exec", host, "unshare", "--uts", sys.executable, "-c",
              "import socket; socket.sethostname('twprobe')"], "set a hostname in a UTS namespace")
        result["netns"] = True
        if "tc" not in missing:
            for kind, extra in (("tbf", ["rate", "100mbit", "burst", "32kb", "latency", "50ms"]),
                                ("netem", ["delay", "1ms"])):
                try:
                    _cmd(["tc", "-n", host, "qdisc", "replace", "dev", HOST_IF, "root", kind, *extra],
                         f"add a {kind} qdisc")
                    result[kind] = True
                except SetupError as exc:
                    result[f"{kind}_reason"] = str(exc)
        else:
            result["tbf_reason"] = result["netem_reason"] = "tc is not installed"
    except SetupError as exc:
        hint = "" if os.geteuid() == 0 else " (not running as root)"
        result["reason"] = f"{exc}{hint}"
    finally:
        for ns in reversed(made):
            delete_namespace(ns)
    return result


# ----------------------------------------------------------------------------------------------
# The testbed


@dataclass
class Host:
    index: int
    ns: str
    hostname: str
    address: str
    proc: subprocess.Popen[bytes] | None = None
    reader: threading.Thread | None = None
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    init_lines: list[str] = field(default_factory=list)
    injected: str | None = None
    stats: str = ""

    def status(self) -> str:
        if self.proc is None:
            return "never started"
        code = self.proc.returncode
        if code is None:
            return "still running (could not be reaped)"
        if code >= 0:
            text = f"exit code {code}"
        else:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            text = f"killed by {name} (exit code {128 - code})"
        if self.injected:
            text += f" [injected fault: {self.injected}]"
        return text


_INIT_ADVERTISE = re.compile(r"rank (\d+)/(\d+) from \S+, store (\S+), advertising (\S+), transport (\S+)")
_INIT_CONNECTED = re.compile(r"rank (\d+) wired: shm peers \[([\d, ]*)\], tcp peers \[([\d, ]*)\]")
_TC_SENT = re.compile(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)")


class Testbed:
    """K host namespaces on a bridge; `build()`, `launch(...)`, and always `destroy()`."""

    def __init__(self, hosts: int, rate: float | None = None, rate_text: str | None = None,
                 delay_text: str | None = None, tag: str | None = None,
                 loopback_hostname: bool = False, sysctls: dict[str, str] | None = None) -> None:
        self.tag = tag or f"{PREFIX}{os.getpid()}-"
        self.bridge_ns = f"{self.tag}br"
        self.hosts = [Host(i, f"{self.tag}h{i}", f"twhost-{i}", f"{SUBNET}.{i + 1}") for i in range(hosts)]
        self.rate = rate
        self.rate_text = rate_text
        self.delay_text = delay_text
        self.loopback_hostname = loopback_hostname
        self.sysctls = dict(sysctls or {})
        """net.* settings of every host's namespace (its own copy of the network stack)."""
        self.created: list[str] = []

    def links_label(self) -> str:
        """A name for what the links are made of (rate, delay, the hosts' net.* settings): each
        such bed is a network of its own, and keeps its own calibration cache (Runner.environment)."""
        sysctls = ",".join(f"{k}={v}" for k, v in sorted(self.sysctls.items()))
        text = f"rate-{self.rate_text or 'none'}_delay-{self.delay_text or 'none'}"
        text += f"_{sysctls}" if sysctls else ""
        return re.sub(r"[^A-Za-z0-9_.=,-]", "_", text)[:200]

    # -- building ------------------------------------------------------------------------------

    def build(self) -> None:
        _cmd(["ip", "netns", "add", self.bridge_ns], "create the bridge namespace")
        self.created.append(self.bridge_ns)
        br = self.bridge_ns
        _cmd(["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0",
              "forward_delay", "0"], "create the bridge")
        _cmd(["ip", "-n", br, "link", "set", BRIDGE, "up"], "bring the bridge up")
        for h in self.hosts:
            _cmd(["ip", "netns", "add", h.ns], f"create the namespace of {h.hostname}")
            self.created.append(h.ns)
            port = f"p{h.index}"
            # Created inside the bridge namespace, the far end moved straight into the host's:
            # no interface ever appears in the root namespace.
            _cmd(["ip", "-n", br, "link", "add", port, "type", "veth", "peer", "name", HOST_IF,
                  "netns", h.ns], f"create the veth of {h.hostname}")
            _cmd(["ip", "-n", br, "link", "set", port, "master", BRIDGE], f"attach {port} to the bridge")
            _cmd(["ip", "-n", br, "link", "set", port, "up"], f"bring {port} up")
            _cmd(["ip", "-n", h.ns, "link", "set", "lo", "up"], f"bring lo of {h.hostname} up")
            _cmd(["ip", "-n", h.ns, "addr", "add", f"{h.address}/{PREFIX_LEN}", "dev", HOST_IF],
                 f"address {h.hostname}")
            _cmd(["ip", "-n", h.ns, "link", "set", HOST_IF, "up"], f"bring {HOST_IF} of {h.hostname} up")
            self._shape(h)
            for key, value in self.sysctls.items():
                _cmd(["ip", "netns", "exec", h.ns, "sysctl", "-qw", f"{key}={value}"],
                     f"set {key}={value} on {h.hostname}")
            self._write_hosts_file(h)

    def _write_hosts_file(self, h: Host) -> None:
        """Every host resolves every host name (twhost-<i>) to its testbed address, like a cluster."""
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        if self.loopback_hostname:
            # What Debian/Ubuntu installers write: the machine's own name on a loopback address.
            lines.append(f"127.0.1.1\t{h.hostname}")
        lines += [f"{other.address}\t{other.hostname}" for other in self.hosts]
        folder = os.path.join(NETNS_ETC, h.ns)
        for attempt in range(3):  # a concurrent testbed may rmdir an empty /etc/netns meanwhile
            try:
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, "hosts"), "w") as f:
                    f.write("\n".join(lines) + "\n")
                return
            except FileNotFoundError:
                if attempt == 2:
                    raise
            except OSError as exc:
                raise SetupError(f"write the hosts file of {h.hostname} in {folder}: {exc}") from exc

    def _shape(self, h: Host) -> None:
        """Rate limit both directions of the host's link; delay the host's egress (netem)."""
        tbf: list[str] = []
        if self.rate is not None:
            # 1 ms worth of traffic, at least 32 KiB: the bucket lets a burst through at veth
            # speed after each idle spell, which a real port does not. With 10 ms (1.25 MB at
            # 1 Gbit/s) an n=4 broadcast of 64 KiB took 0.17-0.53 ms instead of 1.5-1.8 ms. Less
            # is no better: with 32 KiB (0.26 ms at 1 Gbit/s) the links of 4 hosts on this 2-vCPU
            # VM moved a third of the rate (n=4 all_reduce of 1 MiB 34-40 ms against 13 ms with
            # 1 ms, 2026-11-27), so 64 KiB messages keep coming in under their price.
            burst = max(32 * 1024, int(self.rate / 1000))
            tbf = ["tbf", "rate", str(self.rate_text), "burst", str(burst), "latency", "100ms"]
        if self.delay_text is not None:
            netem = ["netem", "delay", self.delay_text, "limit", "100000"]
            if self.rate is not None:
                netem += ["rate", str(self.rate_text)]
            try:
                _cmd(["tc", "-n", h.ns, "qdisc", "add", "dev", HOST_IF, "root", *netem],
                     f"delay the link of {h.hostname}")
            except SetupError as exc:
                if "unknown" in str(exc).lower():
                    raise SetupError(f"{exc} -- this kernel has no sch_netem, so --delay cannot be "
                                     f"emulated (--rate alone works: it uses tbf)") from exc
                raise
        elif tbf:
            _cmd(["tc", "-n", h.ns, "qdisc", "add", "dev", HOST_IF, "root", *tbf],
                 f"rate-limit the link of {h.hostname}")
        if tbf:
            _cmd(["tc", "-n", self.bridge_ns, "qdisc", "add", "dev", f"p{h.index}", "root", *tbf],
                 f"rate-limit the link toward {h.hostname}")

    def describe(self) -> list[str]:
        shaping = []
        if self.rate_text:
            shaping.append(f"rate {self.rate_text} each way")
        if self.delay_text:
            shaping.append(f"delay {self.delay_text} on host egress")
        link = ", ".join(shaping) or "unshaped"
        lines = [f"bridge {BRIDGE} in namespace {self.bridge_ns}; {len(self.hosts)} host(s), links {link}"
                 + "".join(f", {k}={v}" for k, v in self.sysctls.items())]
        for h in self.hosts:
            lines.append(f"  {h.hostname}: namespace {h.ns}, {HOST_IF} {h.address}/{PREFIX_LEN} <-> "
                         f"{BRIDGE} port p{h.index}")
        return lines

    def collect_stats(self) -> None:
        """Per host: bytes and packets through its shaped egress (tc -s), for the report."""
        if self.rate is None and self.delay_text is None:
            return
        for h in self.hosts:
            try:
                out = _cmd(["tc", "-s", "-n", h.ns, "qdisc", "show", "dev", HOST_IF], "read tc statistics")
            except SetupError:
                continue
            m = _TC_SENT.search(out)
            if m:
                h.stats = (f"tc sent {int(m.group(1))} bytes in {m.group(2)} packets, dropped {m.group(3)}, "
                           f"overlimits {m.group(4)}")

    # -- tearing down --------------------------------------------------------------------------

    def destroy(self) -> list[str]:
        """Kill what still runs in our namespaces, delete them; returns those that remain."""
        for h in self.hosts:
            if h.proc is not None and h.proc.poll() is None:
                _killpg(h.proc, signal.SIGKILL)
        for h in self.hosts:
            if h.proc is not None:
                try:
                    h.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
        for ns in reversed(self.created):
            delete_namespace(ns)
        for h in self.hosts:
            if h.reader is not None:
                h.reader.join(timeout=2.0)
        present = set(list_namespaces())
        left = [ns for ns in self.created if ns in present]
        self.created = left
        return left


def _killpg(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Signal a host's whole process group (launcher and ranks): it leads its own session."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ----------------------------------------------------------------------------------------------
# Running a job


@dataclass
class JobOptions:
    nproc: int
    job: list[str]
    master_port: int
    python: str
    tcp: bool = False
    timeout: float | None = None
    grace: float | None = None
    job_timeout: float | None = None
    check_transport: bool = False
    kill_host: int | None = None
    kill_after: float | None = None
    kill_when: str | None = None
    kill_mode: str = "host"
    restore_after: float | None = None  # link mode: the port comes back up this long after
    env: dict[str, str] = field(default_factory=dict)
    master_by_name: bool = False


class Runner:
    """Starts one launcher per host, streams their output, injects faults, waits, reports."""

    def __init__(self, bed: Testbed, opts: JobOptions, out: TextIO) -> None:
        self.bed = bed
        self.opts = opts
        self.out = out
        self.kill_event = threading.Event()
        self.restore_at: float | None = None  # --restore-after: when the unplugged link comes back
        self.kill_pattern = re.compile(opts.kill_when) if opts.kill_when else None
        self.t0 = time.monotonic()
        self.timed_out = False
        self.interrupted: int | None = None

    def command(self, h: Host) -> list[str]:
        o = self.opts
        master = self.bed.hosts[0].hostname if o.master_by_name else self.bed.hosts[0].address
        run = [o.python, "-m", "tensorwire", "run", "--nnodes", str(len(self.bed.hosts)),
               "--node-rank", str(h.index), "--master-addr", master, "--master-port", str(o.master_port),
               "-n", str(o.nproc)]
        if o.tcp:
            run.append("--tcp")
        if o.timeout is not None:
            run += ["--timeout", repr(o.timeout)]
        if o.grace is not None:
            run += ["--grace", repr(o.grace)]
        return ["ip", "netns", "exec", h.ns, "unshare", "--uts", o.python, "-c", _HOST_SHIM, h.hostname,
                str(os.getpid()), *run, *o.job]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.opts.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        if not env.get("TENSORWIRE_CACHE_DIR"):
            # the emulated hosts keep their names whatever their links: a 2 x 2 entry cached by
            # an earlier bed priced a 1 Gbit/s one's TCP at 2.27 GB/s, 19x its rate
            base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            env["TENSORWIRE_CACHE_DIR"] = os.path.join(base, "tensorwire", f"netns-{self.bed.links_label()}")
        if not env.get("TENSORWIRE_SECRET") and not env.get("TENSORWIRE_SECRET_FILE"):
            # One secret for every host's launcher, as --secret-file gives a real cluster's:
            # the job is authenticated across the emulated hosts too (docs/security.md).
            env["TENSORWIRE_SECRET"] = secrets.token_hex(32)
        if self.opts.check_transport:
            if env.get("TENSORWIRE_DEBUG", "").strip().upper() not in ("INFO", "TRACE", "DEBUG"):
                env["TENSORWIRE_DEBUG"] = "INFO"
            subsys = env.get("TENSORWIRE_DEBUG_SUBSYS", "").strip()
            if subsys and "ALL" not in subsys.upper().split(","):
                parts = [p for p in subsys.split(",") if p.strip().upper() != "^INIT"]
                env["TENSORWIRE_DEBUG_SUBSYS"] = ",".join(parts + ["INIT"])
            elif not subsys:
                env["TENSORWIRE_DEBUG_SUBSYS"] = "INIT"
        return env

    def _read(self, h: Host) -> None:
        assert h.proc is not None and h.proc.stdout is not None
        for raw in h.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\r\n")
            h.tail.append(line)
            if "tensorwire" in line and ("advertising" in line or "wired:" in line):
                h.init_lines.append(line)
            with _log_lock:
                try:
                    self.out.write(f"[{h.hostname}] {line}\n")
                    self.out.flush()
                except (OSError, ValueError):
                    pass
            pattern = self.kill_pattern
            if pattern is not None and not self.kill_event.is_set() and pattern.search(line):
                self.kill_event.set()
        h.proc.stdout.close()

    def start(self) -> None:
        env = self.environment()
        for h in self.bed.hosts:
            cmd = self.command(h)
            h.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, start_new_session=True)
            h.reader = threading.Thread(target=self._read, args=(h,), name=f"twtb-{h.hostname}", daemon=True)
            h.reader.start()

    def _inject(self) -> None:
        o = self.opts
        assert o.kill_host is not None
        h = self.bed.hosts[o.kill_host]
        if h.proc is None or h.proc.poll() is not None:
            say(f"fault injection: {h.hostname} already exited, nothing to kill")
            return
        if o.kill_mode == "host":
            h.injected = "host crash (SIGKILL to the launcher and all its ranks)"
            _killpg(h.proc, signal.SIGKILL)
        elif o.kill_mode == "launcher":
            h.injected = "SIGKILL to the launcher only"
            try:
                h.proc.kill()
            except ProcessLookupError:
                pass
        elif o.kill_mode == "address":  # the NIC's address goes: its own ranks' sockets to it too
            h.injected = f"address {h.address} deleted"
            _cmd(["ip", "-n", h.ns, "addr", "del", f"{h.address}/{PREFIX_LEN}", "dev", HOST_IF],
                 "delete an address")
        else:  # link: unplug the cable; nobody is told
            h.injected = f"link down (bridge port p{h.index})"
            _cmd(["ip", "-n", self.bed.bridge_ns, "link", "set", f"p{h.index}", "down"], "unplug a link")
            if o.restore_after is not None:
                self.restore_at = time.monotonic() + o.restore_after
        say(f"fault injection at t={time.monotonic() - self.t0:.2f} s (wall {time.time():.3f}): "
            f"{h.hostname}: {h.injected}")

    def wait(self) -> None:
        """Until every launcher exited; handles --kill-*, --job-timeout and interrupts."""
        o = self.opts
        injected = o.kill_host is None
        deadline_kill: float | None = None  # after TERM (timeout/interrupt): when to SIGKILL
        while True:
            running = [h for h in self.bed.hosts if h.proc is not None and h.proc.poll() is None]
            try:
                if not running:
                    return
                now = time.monotonic()
                if not injected and (self.kill_event.is_set()
                                     or (o.kill_after is not None and now - self.t0 >= o.kill_after)):
                    injected = True
                    self._inject()
                if (o.job_timeout is not None and not self.timed_out and self.interrupted is None
                        and now - self.t0 >= o.job_timeout):
                    self.timed_out = True
                    say(f"--job-timeout {o.job_timeout:g} s expired: terminating every host")
                    self._signal(running, signal.SIGTERM)
                    deadline_kill = now + TERM_TO_KILL_S
                if self.restore_at is not None and now >= self.restore_at:
                    self.restore_at = None
                    h = self.bed.hosts[o.kill_host]  # type: ignore[index]
                    _cmd(["ip", "-n", self.bed.bridge_ns, "link", "set", f"p{h.index}", "up"],
                         "plug a link back")
                    say(f"fault injection at t={now - self.t0:.2f} s (wall {time.time():.3f}): {h.hostname}: "
                        f"link up again")
                if deadline_kill is not None and now >= deadline_kill:
                    say("hosts still running after SIGTERM: sending SIGKILL")
                    self._signal(running, signal.SIGKILL)
                    deadline_kill = None
                if injected:
                    time.sleep(0.05)
                else:
                    self.kill_event.wait(0.05)
            except Interrupted as exc:
                self._on_interrupt(exc.signum, running)
                deadline_kill = time.monotonic() + INTERRUPT_GRACE_S

    @staticmethod
    def _signal(hosts: list[Host], sig: int) -> None:
        for h in hosts:
            if h.proc is not None and h.proc.poll() is None:
                _killpg(h.proc, sig)

    def _on_interrupt(self, signum: int, running: list[Host]) -> None:
        if self.interrupted is not None:
            say("second interrupt: killing every host now")
            self._signal(running, signal.SIGKILL)
            return
        self.interrupted = signum
        say(f"received {signal.Signals(signum).name}: forwarding it to every host's launcher and ranks")
        self._signal(running, signum)

    # -- report --------------------------------------------------------------------------------

    def check_transport(self) -> list[str]:
        """Problems found in the INIT log lines: wrong address, shm across hosts, tcp within one."""
        n, hosts = self.opts.nproc, self.bed.hosts
        world = n * len(hosts)
        problems: list[str] = []
        transport = self.environment().get("TENSORWIRE_TRANSPORT", "auto").strip().lower()
        seen_addr: dict[int, tuple[Host, str]] = {}
        seen_conn: dict[int, tuple[Host, set[int], set[int]]] = {}
        for h in hosts:
            for line in h.init_lines:
                m = _INIT_ADVERTISE.search(line)
                if m:
                    seen_addr[int(m.group(1))] = (h, m.group(4))
                m = _INIT_CONNECTED.search(line)
                if m:
                    def ints(s: str) -> set[int]:
                        return {int(x) for x in s.replace(",", " ").split()}

                    seen_conn[int(m.group(1))] = (h, ints(m.group(2)), ints(m.group(3)))
        for r in range(world):
            home = hosts[r // n]
            same = {home.index * n + j for j in range(n)} - {r}
            others = set(range(world)) - same - {r}
            forced_tcp = self.opts.tcp or transport == "tcp"
            want_shm = set() if forced_tcp else same
            want_tcp = (same | others) - want_shm
            if r not in seen_addr:
                problems.append(f"rank {r}: no 'advertising' INIT line (did it reach init?)")
            else:
                h, addr = seen_addr[r]
                if h is not home:
                    problems.append(f"rank {r}: ran on {h.hostname}, expected {home.hostname}")
                # One host: `tensorwire run --nnodes 1` keeps the whole job on loopback.
                want_addr = home.address if len(hosts) > 1 else "127.0.0.1"
                if addr != want_addr:
                    problems.append(f"rank {r} on {home.hostname}: advertised {addr}, "
                                    f"expected {want_addr}")
            if r not in seen_conn:
                problems.append(f"rank {r}: no 'wired:' INIT line (did it finish init?)")
                continue
            _, shm, tcp = seen_conn[r]
            if shm != want_shm or tcp != want_tcp:
                problems.append(f"rank {r} on {home.hostname}: shm peers {sorted(shm)}, tcp peers "
                                f"{sorted(tcp)}; expected shm {sorted(want_shm)}, tcp {sorted(want_tcp)}")
            else:
                say(f"transport ok: rank {r} on {home.hostname} advertised {seen_addr.get(r, (0, '?'))[1]}, "
                    f"shm peers {sorted(shm)}, tcp peers {sorted(tcp)}")
        return problems

    def report(self) -> int:
        codes = []
        elapsed = time.monotonic() - self.t0
        for h in self.bed.hosts:
            code = exit_code_of(h.proc.returncode) if h.proc is not None else 1
            codes.append(code)
            extra = f"; {h.stats}" if h.stats else ""
            say(f"{h.hostname} ({h.address}): {h.status()}{extra}")
            if code != 0 and not h.injected and h.tail:
                # The launcher's verdict ("rank R ... failed first: ...") says most; else the last line.
                verdict = [line for line in h.tail if "failed first" in line]
                say(f"  {h.hostname}: {(verdict or list(h.tail))[-1].strip()}")
        worst = max(codes) if codes else 1
        if self.interrupted is not None:
            worst = 128 + self.interrupted
        elif self.timed_out:
            worst = 124
        if self.opts.check_transport:
            problems = self.check_transport()
            for p in problems:
                say(f"transport check FAILED: {p}")
            if problems and worst == 0:
                worst = 4
        say(f"job finished in {elapsed:.1f} s; exit code {worst}")
        return worst


# ----------------------------------------------------------------------------------------------
# Command line


DESCRIPTION = """\
Run a tensorwire job across K emulated hosts on this machine: K network namespaces joined by
veth pairs to a bridge (in a namespace of its own), 10.77.0.<i+1>/24 on host i, each host
with its own hostname (UTS namespace) so that shared memory is only used within a host. One
`tensorwire run --nnodes K --node-rank i` per host, all at once; output is prefixed with the
host name; the exit code is the worst host's. Everything is removed afterwards, also on
failure and on Ctrl-C. Needs root (or CAP_NET_ADMIN+CAP_SYS_ADMIN), iproute2 and unshare.
"""

EPILOG = """\
examples:
  %(prog)s --hosts 2 -- job.py                          2 hosts, 1 rank each
  %(prog)s --hosts 3 --nproc-per-host 2 --check-transport -- job.py
  %(prog)s --hosts 2 --rate 1gbit -- -m tensorwire bench all_reduce -b 1K -e 16M
  %(prog)s --hosts 3 --kill-host 1 --kill-when READY -- job.py      fault injection
  %(prog)s --check-support                              can this machine build a testbed?
  %(prog)s --cleanup                                    remove leftovers of killed testbeds
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="netns_cluster.py", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2, metavar="K", help="number of hosts (default 2)")
    p.add_argument("-n", "--nproc-per-host", type=int, default=1, metavar="N",
                   help="ranks per host (default 1)")
    p.add_argument("--rate", type=str, default=None, metavar="RATE",
                   help="limit every host link to RATE in each direction, tc syntax (100mbit, 1gbit)")
    p.add_argument("--delay", type=str, default=None, metavar="T",
                   help="add T (e.g. 0.2ms) to every packet a host sends (netem; host-to-host one-way "
                        "latency grows by T, round trip by 2T)")
    p.add_argument("--tcp", action="store_true", help="pass --tcp to tensorwire run (TCP within a host too)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="pass --timeout S to tensorwire run (limit of each blocking tensorwire call)")
    p.add_argument("--grace", type=float, default=None, metavar="S", help="pass --grace S to tensorwire run")
    p.add_argument("--job-timeout", type=float, default=None, metavar="S",
                   help="wall-clock limit of the whole job; then every host is terminated (exit 124)")
    p.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT, metavar="P",
                   help=f"store port on host 0 (default {DEFAULT_MASTER_PORT}; the namespaces are private, "
                        f"so it never clashes with anything outside)")
    p.add_argument("--master-by-name", action="store_true",
                   help="pass --master-addr twhost-0 (a name every host's /etc/hosts resolves) instead of "
                        "10.77.0.1")
    p.add_argument("--loopback-hostname", action="store_true",
                   help="also map each host's own name to 127.0.1.1 in its /etc/hosts, as Debian/Ubuntu "
                        "installers do (to test a job against that common setup)")
    p.add_argument("--python", default=sys.executable, metavar="PATH",
                   help="interpreter that runs `-m tensorwire run` on each host (default: this one)")
    p.add_argument("--env", action="append", default=[], metavar="K=V",
                   help="extra environment variable for every host (repeatable)")
    p.add_argument("--sysctl", action="append", default=[], metavar="NAME=VALUE",
                   help="set a net.* sysctl in every host's namespace, e.g. "
                        "net.ipv4.tcp_slow_start_after_idle=0 (repeatable; only net.* settings are "
                        "per namespace, any other would change this machine)")
    p.add_argument("--check-transport", action="store_true",
                   help="turn on INIT logging and verify that every rank advertised its host's 10.77 "
                        "address and used shared memory exactly toward the ranks of its own host "
                        "(exit 4 if not)")
    p.add_argument("--kill-host", type=int, default=None, metavar="I",
                   help="fault injection: kill host I (with --kill-after or --kill-when)")
    p.add_argument("--kill-after", type=float, default=None, metavar="S",
                   help="... S seconds after the start")
    p.add_argument("--kill-when", default=None, metavar="REGEX",
                   help="... as soon as any host prints a line matching REGEX")
    p.add_argument("--kill-mode", choices=("host", "launcher", "link", "address"), default="host",
                   help="host: SIGKILL the launcher and its ranks (a crash, default); launcher: SIGKILL "
                        "the launcher only; link: take the host's bridge port down (no one is told); "
                        "address: delete the host's address (a failed NIC, a lost lease)")
    p.add_argument("--restore-after", type=float, default=None, metavar="S",
                   help="with --kill-mode link: bring the port back up S seconds later (an outage)")
    p.add_argument("--check-support", action="store_true",
                   help="only probe whether namespaces, unshare --uts, tbf and netem work here; exit 0 "
                        "if a testbed can be built, 3 if not")
    p.add_argument("--json", action="store_true", help="with --check-support: print the result as JSON")
    p.add_argument("--cleanup", action="store_true",
                   help=f"only remove leftover {PREFIX}<pid>-* namespaces of testbeds that no longer run")
    p.add_argument("--all", action="store_true", help="with --cleanup: also those of running testbeds")
    p.add_argument("job", nargs=argparse.REMAINDER, metavar="-- script.py args",
                   help="what every rank runs, as for tensorwire run (a script, or -m module)")
    return p


def _validate(p: argparse.ArgumentParser,
              a: argparse.Namespace) -> tuple[float | None, list[str], dict[str, str], dict[str, str]]:
    job = list(a.job)
    if job and job[0] == "--":
        job = job[1:]
    if not job:
        p.error("no job given: add `-- script.py args` (or `-- -m module args`)")
    if not 1 <= a.hosts <= MAX_HOSTS:
        p.error(f"--hosts must be in 1..{MAX_HOSTS}, got {a.hosts}")
    if a.nproc_per_host < 1:
        p.error(f"--nproc-per-host must be at least 1, got {a.nproc_per_host}")
    if not 1 <= a.master_port <= 65535:
        p.error(f"--master-port must be in 1..65535, got {a.master_port}")
    rate = None
    try:
        if a.rate is not None:
            rate = parse_rate(a.rate)
        if a.delay is not None:
            parse_delay(a.delay)
    except argparse.ArgumentTypeError as exc:
        p.error(str(exc))
    if a.kill_host is not None:
        if not 0 <= a.kill_host < a.hosts:
            p.error(f"--kill-host must be in 0..{a.hosts - 1}, got {a.kill_host}")
        if a.kill_after is None and a.kill_when is None:
            p.error("--kill-host needs --kill-after S or --kill-when REGEX")
        if a.kill_when is not None:
            try:
                re.compile(a.kill_when)
            except re.error as exc:
                p.error(f"--kill-when {a.kill_when!r} is not a regular expression: {exc}")
    elif a.kill_after is not None or a.kill_when is not None:
        p.error("--kill-after / --kill-when need --kill-host I")
    if a.restore_after is not None and (a.kill_mode != "link" or a.kill_host is None or a.restore_after <= 0):
        p.error("--restore-after S (> 0) goes with --kill-host I --kill-mode link")
    env = {}
    for item in a.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            p.error(f"--env {item!r}: expected KEY=VALUE")
        env[key] = value
    sysctls = {}
    for item in a.sysctl:
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("net.") or not value:
            p.error(f"--sysctl {item!r}: expected net.NAME=VALUE (only net.* settings are per namespace)")
        sysctls[key] = value
    for name in ("job_timeout", "timeout", "grace", "kill_after"):
        value = getattr(a, name, None)
        if value is not None and not 0 <= value < float("inf"):
            p.error(f"--{name.replace('_', '-')} {value}: expected 0 or more seconds")
    return rate, job, env, sysctls


def _install_handlers() -> dict[int, object]:
    def handler(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous = {}
    for sig in FORWARDED_SIGNALS:
        previous[sig] = signal.signal(sig, handler)
    return previous


def _ignore_signals() -> None:
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def run(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.check_support:
        support = probe_support()
        if args.json:
            print(json.dumps(support))
        else:
            for key, value in support.items():
                print(f"{key}: {value}")
        return 0 if support["netns"] else 3
    if args.cleanup:
        cleanup_leftovers(everything=args.all)
        return 0
    rate, job, env, sysctls = _validate(parser, args)
    if (args.delay or args.rate) and shutil.which("tc") is None:
        say("--delay/--rate need tc (iproute2), which is not installed")
        return 3
    opts = JobOptions(nproc=args.nproc_per_host, job=job, master_port=args.master_port, python=args.python,
                      tcp=args.tcp, timeout=args.timeout, grace=args.grace, job_timeout=args.job_timeout,
                      check_transport=args.check_transport, kill_host=args.kill_host,
                      kill_after=args.kill_after, kill_when=args.kill_when, kill_mode=args.kill_mode,
                      restore_after=args.restore_after, env=env, master_by_name=args.master_by_name)
    bed = Testbed(args.hosts, rate=rate, rate_text=args.rate, delay_text=args.delay,
                  loopback_hostname=args.loopback_hostname, sysctls=sysctls)
    runner: Runner | None = None
    code = 1
    previous = _install_handlers()
    try:
        try:
            bed.build()
        except SetupError as exc:
            say(f"cannot build the testbed: {exc}")
            return 3
        for line in bed.describe():
            say(line)
        master = bed.hosts[0].hostname if opts.master_by_name else bed.hosts[0].address
        say(f"master {master}:{opts.master_port}; {args.nproc_per_host} rank(s) per host, "
            f"world size {args.nproc_per_host * args.hosts}; job: {' '.join(job)}")
        runner = Runner(bed, opts, sys.stdout)
        try:
            runner.start()
            runner.wait()
        except Interrupted as exc:  # during start: stop what started, report below
            runner._on_interrupt(exc.signum, [h for h in bed.hosts if h.proc is not None])
            runner.wait()
        for h in bed.hosts:
            if h.reader is not None:
                h.reader.join(timeout=2.0)
        bed.collect_stats()
        code = runner.report()
    except Interrupted as exc:
        say(f"received {signal.Signals(exc.signum).name}: cleaning up")
        code = 128 + exc.signum
    finally:
        _ignore_signals()  # nothing may interrupt the cleanup
        try:
            left = bed.destroy()
            if left:
                say(f"WARNING: could not remove {', '.join(left)}; run {sys.argv[0]} --cleanup")
                code = code or 1
            else:
                say(f"cleaned up: namespaces {bed.tag}* removed")
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
    return code


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
