"""`tensorwire run`: start N ranks per node, host the rendezvous store, supervise, report.

The launcher exists so that a failure is reported once, clearly, by the process that saw
all ranks: which rank failed first, how, and its last stderr lines. The other ranks get a
grace period to report the lost peer themselves before they are terminated, and every wait
after a failure is bounded, so the launcher itself never hangs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO, TextIO

from .. import auth, limits, log
from ..config import Config
from ..errors import InvalidArgumentError, RendezvousError, ResourceError, TensorwireError
from ..rendezvous import bootstrap
from ..rendezvous.tcp_protocol import EXITED_KEY, StoreLimits
from ..rendezvous.tcp_server import TCPStoreServer
from ..rendezvous.tcp_store import TCPStore
from ..transport.shm_segments import remove_stale

DEFAULT_GRACE_S = 5.0
TERM_TO_KILL_S = 3.0
"""After SIGTERM, how long ranks get before SIGKILL."""
REAP_AFTER_KILL_S = 5.0
"""After SIGKILL, how long to wait for the kernel to reap before giving up (never blocks forever)."""
TAIL_LINES = 20
SECRET_FILE_WAIT_S = 30.0
"""How long a node other than 0 waits for --secret-file to appear (node 0 may be creating it
on a shared file system)."""
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
"""Each rank runs in its own session, so a terminal's signals reach the launcher alone (SIGTSTP
and SIGCONT too: Launcher._on_stop)."""
EXIT_NOTICE_TIMEOUT_S = 10.0
"""How long telling the store that a rank exited may try (in the background)."""
EXIT_NOTICE_WAIT_S = 3.0
"""How long a launcher one of whose ranks failed waits, once its ranks have all ended, for that
notice to reach the store (milliseconds where the store is up): the other nodes' ranks, waiting
in init(), learn of the failure from it."""

DESCRIPTION = """\
Start N ranks of a Python program on this node (like torchrun): the launcher hosts the
rendezvous store on node rank 0, gives every rank its RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT (the store's: a torch program imports tensorwire.torch before
init_process_group, whatever its backend, for env:// to work), passes each rank's stdout
through untouched and relays its stderr line by line; its own stdin goes to rank 0 (as
mpirun's), the others read none. If
a rank fails, the others get --grace seconds to report the lost peer, are then terminated,
and the launcher prints which rank failed first with its last stderr lines and exits with
that rank's exit code (128+N if it died of signal N). With
--keep-going the others run on (they may shrink their groups and continue) and the launcher
waits for every rank before it reports. Processes a rank forked and left running end with the
job (SIGTERM, then SIGKILL), as torchrun's do, unless the launcher itself is killed with
SIGKILL (the ranks then get SIGTERM, their children nothing); one meant to outlive the job
starts its own session. SIGINT (Ctrl-C), SIGTERM, SIGHUP and SIGQUIT are forwarded to every
rank (a second one: SIGKILL); Ctrl-Z stops every rank with the launcher, and fg or bg
continue them (calls in flight time out if the stop outlasts their timeout).

The job is authenticated: its store and its ranks serve only processes that prove they know
its secret. On one node the launcher makes a fresh secret and hands it to its ranks; across
nodes, give every launcher the same --secret-file (or TENSORWIRE_SECRET / _SECRET_FILE), else
the job runs unauthenticated and rank 0 warns (docs/security.md).
"""

EPILOG = """\
examples:
  tensorwire run -n 4 train.py --epochs 3          4 ranks on this host
  tensorwire run -n 2 -m mypkg.worker              run a module, like python -m
  tensorwire run -n 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 train.py
  tensorwire run -n 8 --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 train.py

environment of each rank:
  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, NODE_RANK, MASTER_ADDR,
  MASTER_PORT, TENSORWIRE_STORE_HOSTED=1, TENSORWIRE_JOB_ID, TENSORWIRE_SECRET (a fresh one on
  one node, unless set) or TENSORWIRE_SECRET_FILE (--secret-file), PYTHONUNBUFFERED=1,
  OMP_NUM_THREADS=1 and THP_MEM_ALLOC_ENABLE=1 (torch's CPU tensors from 2 MiB in huge pages,
  which peers read 3x faster) unless set, TENSORWIRE_TRANSPORT=tcp (--tcp), TENSORWIRE_TIMEOUT
  (--timeout)
"""


def launched_job_size(env: dict[str, str] | None = None) -> int | None:
    """The world size of the job this process is a rank of (tensorwire run, torchrun, mpirun,
    srun): None outside one, 0 for a launcher's environment too broken to read (init() explains)."""
    try:
        found = bootstrap.detect(env=dict(os.environ if env is None else env))
    except Exception:
        return 0
    return None if found.source == "single" else found.world_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of `tensorwire run` (kept apart so the CLI can show them)."""
    parser.add_argument("-n", "--nproc-per-node", type=int, default=1, metavar="N",
                        help="ranks to start on this node (default 1)")
    parser.add_argument("--nnodes", type=int, default=1, metavar="K",
                        help="number of nodes, one launcher per node (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, metavar="I",
                        help="this node's index in 0..K-1; node 0 hosts the store (default 0)")
    parser.add_argument("--master-addr", default="127.0.0.1", metavar="A",
                        help="address of node 0, where the store listens; with --nnodes 1 the "
                             "store always listens on 127.0.0.1 (default 127.0.0.1)")
    parser.add_argument("--master-port", type=int, default=0, metavar="P",
                        help="port of the store; 0 picks a free one, allowed only with --nnodes 1 "
                             "(default 0)")
    parser.add_argument("--secret-file", default=None, metavar="PATH",
                        help="file holding the job's secret (mode 0600), the same on every node; node 0 "
                             "creates it if missing (on a shared file system the other nodes then find "
                             f"it: they wait up to {SECRET_FILE_WAIT_S:g} s). Default: a fresh secret with "
                             "--nnodes 1, none (and a warning) across nodes unless TENSORWIRE_SECRET or "
                             "TENSORWIRE_SECRET_FILE is set")
    parser.add_argument("--tcp", action="store_true",
                        help="force the TCP transport, even between ranks on one host "
                             "(sets TENSORWIRE_TRANSPORT=tcp)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="seconds a blocking tensorwire call waits before raising "
                             "(sets TENSORWIRE_TIMEOUT)")
    parser.add_argument("--grace", type=float, default=None, metavar="S",
                        help="after a rank fails, seconds the others get to exit on their own before "
                             f"SIGTERM, then SIGKILL {TERM_TO_KILL_S:g} s later "
                             f"(default $TENSORWIRE_LAUNCH_GRACE or {DEFAULT_GRACE_S:g})")
    parser.add_argument("--keep-going", action="store_true",
                        help="a failed rank does not stop the others (survivors may call "
                             "tensorwire.shrink() and go on); wait for every rank, then report and exit "
                             "with the first failed rank's code")
    parser.add_argument("-m", dest="module", action="store_true",
                        help="treat script_or_module as a module name and run it like python -m")
    parser.add_argument("script", metavar="script_or_module",
                        help="the Python script (or, with -m, the module) every rank runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="args",
                        help="arguments passed unchanged to the script")


def build_parser(prog: str = "tensorwire run") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


@dataclass
class LaunchPlan:
    """Everything decided before the first child starts (validated, defaults resolved)."""

    nproc: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    command: list[str]
    grace: float
    tcp: bool = False
    timeout: float | None = None
    keep_going: bool = False
    secret_file: str | None = None

    @property
    def bind_addr(self) -> str:
        # A single-node job never needs to be reachable from elsewhere: keep it on loopback.
        return self.master_addr if self.nnodes > 1 else "127.0.0.1"

    def job_id(self, port: int) -> str:
        """Same on every node (derived from what all nodes were told), unique per store."""
        return re.sub(r"[^A-Za-z0-9_-]", "_", f"{self.bind_addr}-{port}")

    def rank_env(self, local_rank: int, port: int, base: dict[str, str]) -> dict[str, str]:
        env = dict(base)
        env.update({
            "RANK": str(self.node_rank * self.nproc + local_rank),
            "WORLD_SIZE": str(self.nnodes * self.nproc),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(self.nproc),
            "GROUP_RANK": str(self.node_rank),
            "NODE_RANK": str(self.node_rank),
            "MASTER_ADDR": self.bind_addr,
            "MASTER_PORT": str(port),
            "TENSORWIRE_STORE_HOSTED": "1",
            "TENSORWIRE_JOB_ID": self.job_id(port),
            "PYTHONUNBUFFERED": "1",
        })
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # see tuner.PageDependent
        if self.tcp:
            env["TENSORWIRE_TRANSPORT"] = "tcp"
        if self.timeout is not None:
            env["TENSORWIRE_TIMEOUT"] = repr(self.timeout)
        return env


def make_plan(args: argparse.Namespace) -> LaunchPlan:
    """Validate the parsed options; raises ValueError with a message meant for the user."""
    if args.nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
    if args.nnodes < 1:
        raise ValueError(f"--nnodes must be at least 1, got {args.nnodes}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank must be in 0..{args.nnodes - 1}, got {args.node_rank}")
    if not 0 <= args.master_port <= 65535:
        raise ValueError(f"--master-port must be in 0..65535, got {args.master_port}")
    if args.nnodes > 1 and args.master_port == 0:
        raise ValueError("--master-port 0 (pick a free port) only works with --nnodes 1: "
                         "every node must be told the same port")
    if args.timeout is not None and not 0 < args.timeout < float("inf"):
        raise ValueError(f"--timeout must be positive seconds, got {args.timeout}")
    grace = args.grace
    if grace is None:
        raw = os.environ.get("TENSORWIRE_LAUNCH_GRACE", "")
        try:
            grace = float(raw) if raw else DEFAULT_GRACE_S
        except ValueError as exc:
            raise ValueError(f"TENSORWIRE_LAUNCH_GRACE={raw!r} is not a number") from exc
    if not 0 <= grace < float("inf"):
        raise ValueError(f"--grace must be 0 or more seconds, got {grace}")
    if args.module:
        command = [sys.executable, "-m", args.script, *args.script_args]
    else:
        if not os.path.exists(args.script):
            raise ValueError(f"script {args.script!r} not found")
        command = [sys.executable, args.script, *args.script_args]
    return LaunchPlan(nproc=args.nproc_per_node, nnodes=args.nnodes, node_rank=args.node_rank,
                      master_addr=args.master_addr, master_port=args.master_port, command=command,
                      grace=grace, tcp=args.tcp, timeout=args.timeout, keep_going=args.keep_going,
                      secret_file=os.path.abspath(args.secret_file) if args.secret_file else None)


def job_secret(plan: LaunchPlan, env: dict[str, str]) -> tuple[auth.Secret, dict[str, str]]:
    """The job's secret, and the variables that hand it to the ranks (an empty value: unset it).

    --secret-file wins, then a secret the environment configures (the ranks inherit it);
    else one node makes a fresh one, which its ranks get in their environment (readable by
    this user's processes only, through /proc/PID/environ); else there is none."""
    if plan.secret_file is not None:
        path = plan.secret_file
        if plan.node_rank == 0:
            key = auth.create_secret_file(path)
        else:
            give_up = time.monotonic() + SECRET_FILE_WAIT_S
            while not os.path.exists(path) and time.monotonic() < give_up:
                time.sleep(0.1)
            key = auth.read_secret_file(path)
        return auth.Secret(key, f"--secret-file {path}"), {auth.ENV_SECRET_FILE: path, auth.ENV_SECRET: ""}
    found = auth.configured(env)
    if found is not None:
        return found, {}
    if plan.nnodes == 1:
        text = auth.new_secret()
        return auth.Secret(text.encode(), "tensorwire run"), {auth.ENV_SECRET: text}
    return auth.NO_SECRET, {}


@dataclass(eq=False)
class RankProcess:
    """One child: its process, the tail of its stderr, and how it ended."""

    rank: int
    local_rank: int
    proc: subprocess.Popen[bytes]
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    signalled_by_launcher: str | None = None
    reader: threading.Thread | None = None

    @property
    def label(self) -> str:
        return f"rank {self.rank} (local rank {self.local_rank}, pid {self.proc.pid})"

    def status(self) -> str:
        code = self.proc.returncode
        if code is None:
            return "still running (could not be reaped)"
        if code >= 0:
            return f"exit code {code}"
        return f"killed by signal {_signal_name(-code)} ({-code})"

    def send(self, sig: int) -> None:
        """Signal the rank, noting it: its report says what the launcher sent ('SIGTERM, then SIGKILL')."""
        if self.proc.returncode is None:
            sent, name = self.signalled_by_launcher, _signal_name(sig)
            self.signalled_by_launcher = name if sent is None else f"{sent}, then {name}"
            try:
                self.proc.send_signal(sig)
            except (ProcessLookupError, OSError):
                pass


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the launcher dies, even by SIGKILL (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the launcher's own signal forwarding still applies


def _group_members(pgids: set[int]) -> dict[int, list[int]]:
    """The live processes of each process group of `pgids`, in one look at Linux's /proc
    (elsewhere whether any is: the group itself)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        alive = {}
        for pgid in pgids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, 0)
                alive[pgid] = [pgid]
        return alive
    members: dict[int, list[int]] = {}
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            pgid = int(fields[2])  # after the name: state, ppid, pgrp
            if pgid in pgids and fields[0] != b"Z":
                members.setdefault(pgid, []).append(int(entry))
    return {pgid: sorted(pids) for pgid, pids in members.items()}


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_code_of(returncode: int) -> int:
    """Shell convention: a death by signal N becomes 128+N."""
    return 128 - returncode if returncode < 0 else returncode


class Launcher:
    """Runs one node's ranks to completion; `run()` returns the launcher's exit code."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.ranks: list[RankProcess] = []
        self._exits: queue.Queue[RankProcess] = queue.Queue()
        self._output_lock = threading.Lock()
        self._signal_received: int | None = None
        self._signal_count = 0
        self._store_at: tuple[int, auth.Secret] | None = None  # the job store's port and secret
        self._exit_told = False
        self._notice: threading.Thread | None = None  # telling the store

    # -- children -----------------------------------------------------------------------------

    def _relay(self, child: RankProcess, source: IO[bytes], sink: TextIO, keep_tail: bool) -> None:
        """Copy a child's stream to ours a whole line at a time (lines of ranks never interleave
        mid-line), keeping stderr's tail for the failure report."""
        out = getattr(sink, "buffer", None)
        for line in source:
            if keep_tail:
                child.tail.append(line.decode(errors="replace").rstrip("\r\n"))
            with self._output_lock:
                try:
                    if out is not None:
                        out.write(line)
                    else:
                        sink.write(line.decode(errors="replace"))
                    sink.flush()
                except (OSError, ValueError):
                    pass  # our stream is gone; keep draining so the child never blocks
        source.close()

    def _await_exit(self, child: RankProcess) -> None:
        child.proc.wait()
        self._exits.put(child)

    def _tell_store(self, child: RankProcess) -> None:
        """The first rank of this node to exit: tell the job's store, whose server then ends every
        read blocked on a key not set yet (ranks waiting for it in init() fail at once, naming
        it, instead of at their timeout)."""
        if self._exit_told or self._store_at is None or self.plan.nnodes * self.plan.nproc == 1:
            return
        self._exit_told = True
        port, secret = self._store_at
        text = (f"{child.label} on node {self.plan.node_rank} ended with {child.status()} (seen by "
                f"tensorwire run), so the job's ranks can no longer all meet")

        def post() -> None:
            with contextlib.suppress(TensorwireError, OSError):
                store = TCPStore(self.plan.bind_addr, port, timeout=EXIT_NOTICE_TIMEOUT_S, secret=secret)
                try:
                    store.set(EXITED_KEY, text.encode())
                finally:
                    store.close()

        self._notice = threading.Thread(target=post, name="tw-exit-notice", daemon=True)
        self._notice.start()

    def _start(self, port: int, secret_env: dict[str, str]) -> None:
        base = {k: v for k, v in {**os.environ, **secret_env}.items() if v}
        for local_rank in range(self.plan.nproc):
            if self._signal_received is not None:
                break  # interrupted while starting: don't start more
            env = self.plan.rank_env(local_rank, port, base)
            stdin = None if env["RANK"] == "0" else subprocess.DEVNULL  # as mpirun: rank 0 reads it
            # its own session: what it forks stays in its process group, which the launcher
            # ends after it (_end_left_behind); signals reach it from the launcher alone
            proc = subprocess.Popen(self.plan.command, env=env, stdin=stdin,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    preexec_fn=_die_with_parent, start_new_session=True)
            child = RankProcess(rank=int(env["RANK"]), local_rank=local_rank, proc=proc)
            self.ranks.append(child)
            assert proc.stdout is not None and proc.stderr is not None
            who = f"relaying rank {child.rank}'s output"
            relay = threading.Thread(target=self._relay, args=(child, proc.stdout, sys.stdout, False),
                                     name=f"tw-stdout-{child.rank}", daemon=True)
            limits.start_thread(relay, who)
            reader = threading.Thread(target=self._relay, args=(child, proc.stderr, sys.stderr, True),
                                      name=f"tw-stderr-{child.rank}", daemon=True)
            limits.start_thread(reader, who)
            child.reader = reader
            limits.start_thread(threading.Thread(target=self._await_exit, args=(child,),
                                                 name=f"tw-wait-{child.rank}", daemon=True), who)

    # -- signals ------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Forward to every rank; a second signal means "now": SIGKILL."""
        self._signal_count += 1
        if self._signal_received is None:
            self._signal_received = signum
        sig = signum if self._signal_count == 1 else signal.SIGKILL
        for child in self.ranks:
            child.send(sig)

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        """Ctrl-Z: stop every rank, with what it forked, then the launcher, as a shell stops a
        job (SIGTSTP reaches the launcher alone); continuing the launcher continues them."""
        self._signal_groups(signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGSTOP)

    def _on_continue(self, signum: int, frame: FrameType | None) -> None:
        self._signal_groups(signal.SIGCONT)

    def _signal_groups(self, sig: int) -> None:
        for child in self.ranks:
            if child.proc.returncode is None:
                with contextlib.suppress(OSError):
                    os.killpg(child.proc.pid, sig)  # each rank leads its own session

    def _install_handlers(self) -> dict[int, object]:
        previous: dict[int, object] = {}
        if threading.current_thread() is not threading.main_thread():
            return previous  # signal handlers can only be set from the main thread
        for sig in FORWARDED_SIGNALS:
            previous[sig] = signal.signal(sig, self._on_signal)
        previous[signal.SIGTSTP] = signal.signal(signal.SIGTSTP, self._on_stop)
        previous[signal.SIGCONT] = signal.signal(signal.SIGCONT, self._on_continue)
        return previous

    @staticmethod
    def _restore_handlers(previous: dict[int, object]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    # -- supervision --------------------------------------------------------------------------

    def _signal_all(self, sig: int, pending: set[RankProcess]) -> None:
        for child in pending:
            child.send(sig)

    def _supervise(self) -> RankProcess | None:
        """Wait for all ranks; returns the first that failed on its own (None if none did)."""
        pending = set(self.ranks)
        first_failure: RankProcess | None = None
        deadline: float | None = None  # set once something went wrong: the grace period
        stage = "grace"
        while pending:
            if deadline is None and self._signal_received is not None:
                deadline = time.monotonic() + self.plan.grace
            wait = 0.2 if deadline is None else min(0.2, max(0.0, deadline - time.monotonic()))
            try:
                child = self._exits.get(timeout=wait)
            except queue.Empty:
                child = None
            if child is not None:
                pending.discard(child)
                self._tell_store(child)
                if (child.proc.returncode != 0 and first_failure is None
                        and child.signalled_by_launcher is None and self._signal_received is None):
                    first_failure = child
                    if deadline is None and not self.plan.keep_going:
                        deadline = time.monotonic() + self.plan.grace
                continue
            if deadline is None or time.monotonic() < deadline or not pending:
                continue
            if stage == "grace":
                self._signal_all(signal.SIGTERM, pending)
                stage, deadline = "term", time.monotonic() + TERM_TO_KILL_S
            elif stage == "term":
                self._signal_all(signal.SIGKILL, pending)
                stage, deadline = "kill", time.monotonic() + REAP_AFTER_KILL_S
            else:
                break  # unkillable (e.g. stuck in the kernel): report rather than hang
        return first_failure

    def run(self) -> int:
        plan = self.plan
        server = None
        port = plan.master_port
        clients = plan.nnodes * plan.nproc if plan.node_rank == 0 else 0
        try:
            limits.ensure_descriptors(2 * plan.nproc + clients, "tensorwire run",
                                      f"relaying the output of {plan.nproc} rank(s)"
                                      + (f" and serving the store to {clients}" if clients else ""))
        except ResourceError as exc:
            print(exc, file=sys.stderr)
            return 1
        try:
            secret, secret_env = job_secret(plan, dict(os.environ))
        except TensorwireError as exc:  # a secret that is missing, unreadable or too short
            print(f"tensorwire run: {exc}", file=sys.stderr)
            return 2 if isinstance(exc, InvalidArgumentError) else 1
        if plan.node_rank == 0:
            try:
                store_limits = StoreLimits.from_config(Config.from_env())
            except ValueError as exc:
                print(f"tensorwire run: {exc}", file=sys.stderr)
                return 2
            if clients > store_limits.max_connections:  # every rank connects to the store
                print(f"tensorwire run: TENSORWIRE_STORE_MAX_CONNECTIONS={store_limits.max_connections} is "
                      f"below the job's {clients} ranks, each of which connects to the store",
                      file=sys.stderr)
                return 2
            try:
                # Several nodes: listen on every interface, since MASTER_ADDR may resolve to a
                # loopback address on this node (Debian's 127.0.1.1 hostname line).
                server = TCPStoreServer(plan.bind_addr if plan.nnodes == 1 else "0.0.0.0", port,
                                        secret=secret, limits=store_limits)
            except (RendezvousError, OSError) as exc:
                print(f"tensorwire run: cannot host the store on {plan.bind_addr}:{port}: {exc}",
                      file=sys.stderr)
                return 1
            port = server.port
        self._store_at = (port, secret)
        previous = self._install_handlers()
        try:
            try:
                self._start(port, secret_env)
            except (OSError, ResourceError) as exc:  # ResourceError: no thread to relay a rank's output
                print(f"tensorwire run: cannot start {plan.command[0]}: {exc}", file=sys.stderr)
                self._signal_all(signal.SIGTERM, set(self.ranks))
                self._signal_received = self._signal_received or signal.SIGTERM
                self._supervise()
                return 1
            first_failure = self._supervise()
            if first_failure is not None and self._notice is not None:
                self._notice.join(EXIT_NOTICE_WAIT_S)  # else it dies with this process, unsent
        finally:
            self._restore_handlers(previous)
            self._end_left_behind()
            for child in self.ranks:
                if child.reader is not None:
                    # A grandchild may hold the pipe open; don't wait for it forever.
                    child.reader.join(timeout=1.0)
            if server is not None:
                server.close()
            remove_stale()  # segments of ranks killed before they unlinked them (in group setup)
        return self._report(first_failure)

    def _end_left_behind(self) -> None:
        """End what the ranks forked and left running (as torchrun does): SIGTERM to each rank's
        process group, SIGKILL to what is left TERM_TO_KILL_S later, and say so. A process that
        is to outlive the job leaves the group itself (setsid)."""
        groups = {child.rank: child.proc.pid for child in self.ranks if child.proc.returncode is not None}
        found = _group_members(set(groups.values()))
        left = {rank: found[pgid] for rank, pgid in groups.items() if pgid in found}
        if not left:
            return
        with self._output_lock:
            for rank, pids in sorted(left.items()):
                print(f"tensorwire run: rank {rank} left {len(pids)} process(es) running (pid "
                      f"{', '.join(map(str, pids))}): ending them", file=sys.stderr, flush=True)
        deadline = time.monotonic() + TERM_TO_KILL_S
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for rank in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(groups[rank], sig)
            while time.monotonic() < deadline and _group_members({groups[r] for r in left}):
                time.sleep(0.05)
            deadline = time.monotonic() + REAP_AFTER_KILL_S

    def _report(self, first_failure: RankProcess | None) -> int:
        if first_failure is None and self._signal_received is None:
            return 0
        lines: list[str] = []
        if first_failure is not None:
            lines.append(f"tensorwire run: {first_failure.label} failed first: {first_failure.status()}"
                         f"{_reported_by(first_failure)}")
            if first_failure.tail:
                lines.append(f"  last {len(first_failure.tail)} stderr line(s) of rank {first_failure.rank}:")
                lines.extend(f"    {text}" for text in first_failure.tail)
            else:
                lines.append(f"  (rank {first_failure.rank} wrote nothing to stderr)")
            code = exit_code_of(first_failure.proc.returncode or 1)
        else:
            assert self._signal_received is not None
            name = _signal_name(self._signal_received)
            lines.append(f"tensorwire run: received {name}, forwarded it to all ranks")
            code = 128 + self._signal_received
        others = [c for c in self.ranks if c is not first_failure]
        if others:
            lines.append("tensorwire run: other ranks:" if first_failure else "tensorwire run: ranks:")
        for child in others:
            text = f"  {child.label}: {child.status()}"
            if child.signalled_by_launcher is not None and child.proc.returncode != 0:
                text += f" (the launcher sent {child.signalled_by_launcher})"
            elif child.proc.returncode not in (0, None) and child.tail:
                text += f"; last stderr line: {child.tail[-1]}"
            lines.append(text)
        if any(_IN_USE.search(text) for child in self.ranks for text in child.tail):
            lines.append("tensorwire run: a rank found an address in use; MASTER_PORT is tensorwire's "
                         "store: a torch program, whatever its backend, imports tensorwire.torch before "
                         "init_process_group(init_method='env://') to get a torch store of its own "
                         "(docs/torch.md)")
        with self._output_lock:
            print("\n".join(lines), file=sys.stderr, flush=True)
        return code


_REPORTED = re.compile(r"\[reported by rank (\d+); seen on rank \d+\]")
_IN_USE = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)


def _reported_by(child: RankProcess) -> str:
    """Where the error a rank exited with came from another rank (a peer's abort: '[reported by
    rank 0; seen on rank 1]'), that rank: the first to exit need not be the first to fail."""
    found = next((m for m in map(_REPORTED.search, reversed(child.tail)) if m), None)
    if found is None or int(found.group(1)) == child.rank:
        return ""
    return f" (its error came from rank {found.group(1)}: see below)"


def main(argv: Sequence[str] | None = None, prog: str = "tensorwire run") -> int:
    """Entry of `tensorwire run`; returns the exit code (that of the first failing rank)."""
    parser = build_parser(prog)
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # --help or a usage error: argparse already printed
        return exc.code if isinstance(exc.code, int) else 2
    try:
        plan = make_plan(args)
    except ValueError as exc:
        parser.print_usage(sys.stderr)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    log.configure()  # the store it hosts logs as the ranks do (TENSORWIRE_DEBUG)
    log.set_rank("launcher")
    return Launcher(plan).run()


if __name__ == "__main__":
    raise SystemExit(main())
