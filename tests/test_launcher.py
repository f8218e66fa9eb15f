"""`tensorwire run` end to end: real launcher subprocesses running small scripts.

None of these need tensorwire's collectives; they check the contract the ranks rely on
(environment, store, args) and the failure handling users rely on (exit codes, the report,
bounded shutdown, signals).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cluster import free_port
from tensorwire import auth
from tensorwire.tools import cli, launcher

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

ENV_SCRIPT = """\
import json, os, sys
from tensorwire.rendezvous.tcp_store import TCPStore
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
        "MASTER_ADDR", "MASTER_PORT", "TENSORWIRE_STORE_HOSTED", "TENSORWIRE_JOB_ID",
        "TENSORWIRE_TRANSPORT", "TENSORWIRE_TIMEOUT", "PYTHONUNBUFFERED", "OMP_NUM_THREADS",
        "THP_MEM_ALLOC_ENABLE"]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=20)
store.set(f"hello/{rank}", f"from {rank}".encode())
seen = {r: store.get(f"hello/{r}", timeout=20).decode() for r in range(world)}
store.close()
out = {"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[1:], "seen": seen}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
"""


def _launch(args: list[str], cwd: Path, **kwargs: object) -> subprocess.Popen[str]:
    env = dict(os.environ)
    for name in ("OMP_NUM_THREADS", "THP_MEM_ALLOC_ENABLE", "TENSORWIRE_LAUNCH_GRACE"):
        env.pop(name, None)
    return subprocess.Popen([sys.executable, "-m", "tensorwire", "run", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def _run(args: list[str], cwd: Path, timeout: float = 40) -> subprocess.CompletedProcess[str]:
    proc = _launch(args, cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"launcher did not finish in {timeout}s\nstdout:\n{out}\nstderr:\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _results(directory: Path, world: int) -> dict[int, dict]:
    return {r: json.loads((directory / f"rank{r}.json").read_text()) for r in range(world)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(60)
def test_env_contract_store_and_args(tmp_path: Path) -> None:
    script = tmp_path / "env_rank.py"
    script.write_text(ENV_SCRIPT)
    res = _run(["-n", "3", "--tcp", "--timeout", "7.5", str(script), str(tmp_path), "--lr", "3",
                "-n", "9", "--", "x y"], tmp_path)
    assert res.returncode == 0, res.stderr
    results = _results(tmp_path, 3)
    port = results[0]["env"]["MASTER_PORT"]
    assert int(port) > 0
    for rank, got in results.items():
        env = got["env"]
        assert env == {
            "RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "3",
            "GROUP_RANK": "0", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
            "TENSORWIRE_STORE_HOSTED": "1", "TENSORWIRE_JOB_ID": f"127_0_0_1-{port}",
            "TENSORWIRE_TRANSPORT": "tcp", "TENSORWIRE_TIMEOUT": "7.5", "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1", "THP_MEM_ALLOC_ENABLE": "1",
        }
        # Options after the script belong to the script, even ones the launcher also has.
        assert got["argv"] == [str(tmp_path), "--lr", "3", "-n", "9", "--", "x y"]
        assert got["seen"] == {str(r): f"from {r}" for r in range(3)}


@pytest.mark.timeout(60)
def test_module_mode_and_stdout_stderr_pass_through(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "worker.py").write_text(textwrap.dedent("""\
        import os, sys
        print(f"out rank {os.environ['RANK']} args {sys.argv[1:]}")
        print(f"err rank {os.environ['RANK']}", file=sys.stderr)
        """))
    res = _run(["-n", "2", "-m", "mypkg.worker", "a", "--b"], tmp_path)
    assert res.returncode == 0, res.stderr
    for rank in range(2):
        assert f"out rank {rank} args ['a', '--b']" in res.stdout.splitlines()
        assert f"err rank {rank}" in res.stderr.splitlines()
    assert "tensorwire run:" not in res.stderr  # no report when everything went well


@pytest.mark.timeout(60)
def test_the_report_names_the_rank_an_error_came_from(tmp_path: Path) -> None:
    """The first rank to exit may be one that raised a peer's abort: the report says whose."""
    script = tmp_path / "abort.py"
    script.write_text(textwrap.dedent("""\
        import os, sys, time
        rank = int(os.environ["RANK"])
        if rank == 0:
            time.sleep(1.0)
            sys.exit("TimeoutError: rank 0: barrier #1 on group world timed out")
        sys.exit("TimeoutError: rank 0: barrier #1 timed out [reported by rank 0; seen on rank 1]")
        """))
    res = _run(["-n", "2", str(script)], tmp_path)
    assert "rank 1 (local rank 1, pid " in res.stderr and "failed first: exit code 1 (its error came from " \
        "rank 0: see below)" in res.stderr, res.stderr
    assert "rank 0 (local rank 0, pid" in res.stderr, res.stderr


def test_a_rank_that_finds_master_port_in_use_is_told_why(tmp_path: Path) -> None:
    """A torch program that did not import tensorwire.torch (a Gloo job) has env:// host its
    store on MASTER_PORT, where tensorwire's is: the report says so (before: only torch's
    EADDRINUSE on rank 0, a connection reset on the others)."""
    script = tmp_path / "bind.py"
    script.write_text(textwrap.dedent("""\
        import os, socket
        socket.create_server((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
        """))
    res = _run(["-n", "1", str(script)], tmp_path)
    assert res.returncode == 1, res.stderr
    assert "MASTER_PORT is tensorwire's store" in res.stderr and "imports tensorwire.torch" in res.stderr, \
        res.stderr


def test_failing_rank_sets_exit_code_and_report(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent("""\
        import os, signal, sys, time
        rank = int(os.environ["RANK"])
        if rank == 1:
            time.sleep(0.5)
            for i in range(30):
                print(f"rank1 line {i}", file=sys.stderr)
            sys.exit(3)
        if rank == 2:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # needs the SIGKILL escalation
        time.sleep(60)
        """))
    grace = 1.0
    start = time.monotonic()
    res = _run(["-n", "3", "--grace", str(grace), str(script)], tmp_path)
    elapsed = time.monotonic() - start
    assert res.returncode == 3, res.stderr
    assert elapsed < 0.5 + grace + launcher.TERM_TO_KILL_S + 8.0, elapsed  # (3 interpreters' start: 8 s
    # on a loaded 2-core machine); far below the 60 s the others sleep
    report = res.stderr[res.stderr.index("tensorwire run: rank 1"):]
    assert "tensorwire run: rank 1 (local rank 1, pid " in report
    assert "failed first: exit code 3" in report
    tail = [line.strip() for line in report.splitlines() if line.strip().startswith("rank1 line")]
    assert tail == [f"rank1 line {i}" for i in range(10, 30)]  # the last 20 lines
    assert "rank 0 (local rank 0, pid" in report and "killed by signal SIGTERM (15)" in report
    assert "rank 2 (local rank 2, pid" in report and "killed by signal SIGKILL (9)" in report
    # Every stderr line was also relayed live, before the report.
    assert all(f"rank1 line {i}" in res.stderr for i in range(30))


@pytest.mark.timeout(60)
def test_rank_killed_by_signal_is_reported(tmp_path: Path) -> None:
    script = tmp_path / "segv.py"
    script.write_text(textwrap.dedent("""\
        import os, signal, sys, time
        if os.environ["RANK"] == "0":
            print("about to die", file=sys.stderr)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.2)
        """))
    res = _run(["-n", "2", "--grace", "2", str(script)], tmp_path)
    assert res.returncode == 128 + signal.SIGKILL, res.stderr
    assert "rank 0 (local rank 0, pid" in res.stderr
    assert "failed first: killed by signal SIGKILL (9)" in res.stderr
    assert "    about to die" in res.stderr
    # Rank 1 finished on its own within the grace period: its real status is shown.
    assert "rank 1 (local rank 1, pid" in res.stderr and "exit code 0" in res.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_stops_all_children(tmp_path: Path, sig: signal.Signals) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(textwrap.dedent("""\
        import os, signal, sys, time
        rank = os.environ["RANK"]
        if rank == "1":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
        time.sleep(60)
        """))
    proc = _launch(["-n", "3", "--grace", "0.5", str(script), str(tmp_path)], tmp_path)
    pid_files = [tmp_path / f"pid{r}" for r in range(3)]
    deadline = time.monotonic() + 20
    while not all(p.exists() and p.read_text() for p in pid_files):
        assert time.monotonic() < deadline, "ranks did not start"
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    pids = [int(p.read_text()) for p in pid_files]
    start = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=20)
    assert time.monotonic() - start < 0.5 + launcher.TERM_TO_KILL_S + 3.0
    assert proc.returncode == 128 + sig, err
    assert f"received {sig.name}, forwarded it to all ranks" in err
    assert "killed by signal SIGKILL (9)" in err  # rank 1 ignored the forwarded signal
    assert not [pid for pid in pids if _alive(pid)]


def _state(pid: int) -> str:
    """A process's state letter from Linux's /proc ('T' stopped, 'S' sleeping, ...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _until(check: object, what: str, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from Linux's /proc")
def test_ctrl_z_stops_the_whole_job_and_continuing_continues_it(tmp_path: Path) -> None:
    """SIGTSTP (Ctrl-Z) reaches the launcher alone, the ranks being in sessions of their own:
    it stops every rank and what it forked, then itself; SIGCONT (fg, bg) continues them all."""
    script = tmp_path / "stoppable.py"
    script.write_text(textwrap.dedent("""\
        import os, sys, time
        rank = os.environ["RANK"]
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        open(os.path.join(sys.argv[1], f"pid{rank}"), "w").write(str(os.getpid()))
        while not os.path.exists(os.path.join(sys.argv[1], "go")):
            time.sleep(0.02)
        """))
    proc = _launch(["-n", "2", str(script), str(tmp_path)], tmp_path)
    pid_files = [tmp_path / f"pid{r}" for r in range(2)]
    _until(lambda: all(p.exists() and p.read_text() for p in pid_files), "ranks did not start", 20)
    ranks = [int(p.read_text()) for p in pid_files]
    forked = [int(pid) for r in ranks for pid in Path(f"/proc/{r}/task/{r}/children").read_text().split()]
    assert len(forked) == 2
    try:
        proc.send_signal(signal.SIGTSTP)
        _until(lambda: all(_state(pid) == "T" for pid in [proc.pid, *ranks, *forked]), "the job did not stop")
        (tmp_path / "go").write_text("")
        time.sleep(0.3)
        assert all(_state(pid) == "T" for pid in ranks)  # stopped: they do not see the file
        proc.send_signal(signal.SIGCONT)
        _, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
    finally:
        for pid in [*ranks, *forked]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.communicate()


@pytest.mark.timeout(60)
def test_two_nodes_form_one_world(tmp_path: Path) -> None:
    script = tmp_path / "env_rank.py"
    script.write_text(ENV_SCRIPT)
    port = free_port()
    secret = tmp_path / "job.secret"
    common = ["-n", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--secret-file", str(secret)]
    # Start node 1 first: its ranks must wait for node 0's store (and node 0 to create the
    # secret file, as on a shared file system) rather than fail.
    node1 = _launch([*common, "--node-rank", "1", str(script), str(tmp_path)], tmp_path)
    time.sleep(0.3)
    node0 = _launch([*common, "--node-rank", "0", str(script), str(tmp_path)], tmp_path)
    for proc in (node1, node0):
        _, err = proc.communicate(timeout=40)
        assert proc.returncode == 0, err
    results = _results(tmp_path, 4)
    for rank, got in results.items():
        env = got["env"]
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "4"
        assert env["LOCAL_RANK"] == str(rank % 2) and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["NODE_RANK"] == env["GROUP_RANK"] == str(rank // 2)
        assert env["MASTER_PORT"] == str(port)
        assert env["TENSORWIRE_JOB_ID"] == f"127_0_0_1-{port}"
        assert got["seen"] == {str(r): f"from {r}" for r in range(4)}
    assert secret.stat().st_mode & 0o777 == 0o600


SUM_SCRIPT = """\
import hashlib, os, sys
import numpy as np
import tensorwire as tw
tw.init()
x = np.ones(4)
tw.all_reduce(x)
assert x.tolist() == [tw.get_world_size()] * 4, x
secret = os.environ.get("TENSORWIRE_SECRET", "")
print(f"rank {tw.get_rank()} ok", hashlib.sha256(secret.encode()).hexdigest()[:16] if secret else "none")
"""


@pytest.mark.timeout(90)
def test_one_node_gets_a_fresh_secret_per_job(tmp_path: Path) -> None:
    script = tmp_path / "sum.py"
    script.write_text(SUM_SCRIPT)
    seen = []
    for _ in range(2):
        res = _run(["-n", "2", str(script)], tmp_path)
        assert res.returncode == 0, res.stderr
        digests = {line.split()[-1] for line in res.stdout.splitlines() if " ok " in line}
        assert len(digests) == 1 and "none" not in digests, res.stdout  # both ranks got the job's
        seen.append(digests.pop())
    assert seen[0] != seen[1]


@pytest.mark.timeout(90)
def test_nodes_without_a_secret_warn_once_and_with_different_ones_fail(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "sum.py"
    script.write_text(SUM_SCRIPT)

    def two_nodes(extra0: list[str], extra1: list[str], timeout: str = "20") -> list[subprocess.Popen[str]]:
        common = ["-n", "1", "--nnodes", "2", "--master-port", str(free_port()), "--timeout", timeout]
        return [_launch([*common, "--node-rank", str(i), *extra, str(script)], tmp_path)
                for i, extra in ((0, extra0), (1, extra1))]

    procs = two_nodes([], [])
    done = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], done
    stderr = "".join(err for _, err in done)
    assert stderr.count("UnauthenticatedJobWarning") == 1, stderr
    assert "--secret-file" in done[0][1]
    # Different secrets: node 1's rank cannot even reach the store, and says why; node 0's store
    # logs the refusal, and its rank, timing out, says that the store refused node 1 (it said only
    # that rank 1 never arrived). It cannot fail sooner: whoever reaches the port can connect with
    # a wrong secret, and must not end the job.
    for name in "ab":
        auth.create_secret_file(str(tmp_path / name))
    monkeypatch.setenv("TENSORWIRE_DEBUG", "WARN")
    monkeypatch.setenv("TENSORWIRE_DEBUG_SUBSYS", "AUTH")
    node0, node1 = two_nodes(["--secret-file", str(tmp_path / "a")], ["--secret-file", str(tmp_path / "b")],
                             timeout="8")
    try:
        _, err = node1.communicate(timeout=60)
        assert node1.returncode != 0
        assert "could not prove that it knows this job's secret" in err
        _, err = node0.communicate(timeout=60)
        assert node0.returncode != 0
        assert re.search(r"rank launcher .*store \S+: dropped a connection from 127\.0\.0\.1:\d+: hung up "
                         r"after the store's challenge without proving the job's secret", err), err
        assert re.search(r"TimeoutError: rank 0: init: rank 1 never arrived \(no address published within "
                         r"8 s\); the store refused [12] connection\(s\) from 127\.0\.0\.1 that could not "
                         r"prove the job's secret", err), err
    finally:
        for proc in (node0, node1):
            proc.kill()
            proc.communicate(timeout=30)


INIT_SCRIPT = """\
import tensorwire as tw
try:
    tw.init()
except Exception as exc:
    print(f"init failed: {type(exc).__name__}: {exc}", flush=True)
    raise SystemExit(3)
"""


@pytest.mark.timeout(120)
def test_nodes_given_different_n_fail_at_once_naming_it(tmp_path: Path) -> None:
    """-n 2 on node 0, -n 1 on node 1: node 1's rank said that it joined twice, node 0's ranks
    waited their timeout for ranks 2-3. Now all three fail at once naming both nodes' -n."""
    script = tmp_path / "init.py"
    script.write_text(INIT_SCRIPT)
    common = ["--nnodes", "2", "--master-port", str(free_port()), "--secret-file", str(tmp_path / "s"),
              "--timeout", "60", str(script)]
    t0 = time.monotonic()
    nodes = [_launch(["-n", str(2 - i), "--node-rank", str(i), *common], tmp_path) for i in (0, 1)]
    try:
        outs = [proc.communicate(timeout=100)[0] for proc in nodes]
    finally:
        for proc in nodes:
            proc.kill()
            proc.communicate()
    assert time.monotonic() - t0 < 40, outs  # not the 60 s of the timeout
    said = [line for out in outs for line in out.splitlines() if line.startswith("init failed")]
    assert len(said) == 3, outs
    for line in said:
        assert "RendezvousError" in line, line
        assert "mismatch: rank 1 was started with world_size=2 but rank 0 with world_size=4" in line, line
        assert "node 1 runs -n 1 --nnodes 2, node 0 -n 2 --nnodes 2; every node needs the same" in line, line


@pytest.mark.timeout(120)
def test_a_node_whose_rank_fails_before_init_ends_the_other_nodes_wait(tmp_path: Path) -> None:
    """Node 1's only rank exits at once: its launcher's notice to the store (which ends every
    read blocked on the store) ran in a daemon thread that died with the launcher, unsent, and
    node 0's rank waited its whole timeout. The launcher now waits for it."""
    script = tmp_path / "quit.py"
    script.write_text("import os, sys\nif os.environ['NODE_RANK'] == '1':\n    sys.exit(3)\n" + INIT_SCRIPT)
    common = ["-n", "1", "--nnodes", "2", "--master-port", str(free_port()), "--secret-file",
              str(tmp_path / "s"), "--timeout", "60", str(script)]
    t0 = time.monotonic()
    nodes = [_launch(["--node-rank", str(i), *common], tmp_path) for i in (0, 1)]
    try:
        out = nodes[0].communicate(timeout=100)[0]
    finally:
        for proc in nodes:
            proc.kill()
            proc.communicate()
    assert time.monotonic() - t0 < 40, out  # not the 60 s of the timeout
    assert re.search(r"init failed: RendezvousError: rank 0: init: .* cannot complete: rank 1 \(local rank "
                     r"0, pid \d+\) on node 1 ended with exit code 3 \(seen by tensorwire run\)", out), out


@pytest.mark.timeout(60)
def test_help_texts() -> None:
    top = subprocess.run([sys.executable, "-m", "tensorwire", "--help"], capture_output=True, text=True,
                         timeout=30)
    assert top.returncode == 0
    assert "run" in top.stdout and "bench" in top.stdout and "version" in top.stdout
    run = subprocess.run([sys.executable, "-m", "tensorwire", "run", "--help"], capture_output=True,
                         text=True, timeout=30)
    assert run.returncode == 0
    for option in ("--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port",
                   "--grace", "--tcp", "--timeout", "--secret-file", "-m"):
        assert option in run.stdout
    assert "tensorwire run -n 4 train.py" in run.stdout


@pytest.mark.timeout(30)
def test_bad_arguments_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "ok.py"
    script.write_text("")
    assert launcher.main(["--nnodes", "2", str(script)]) == 2
    assert "--master-port 0" in capsys.readouterr().err
    assert launcher.main(["--nnodes", "2", "--node-rank", "2", "--master-port", "1", str(script)]) == 2
    assert launcher.main(["-n", "0", str(script)]) == 2
    assert launcher.main([str(tmp_path / "missing.py")]) == 2
    assert "not found" in capsys.readouterr().err
    assert cli.main(["version"]) == 0
    assert capsys.readouterr().out.startswith("tensorwire ")
    assert cli.main(["version", "--al"]) == 2
    assert "unknown argument '--al'" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_version_all_reports_the_installation_and_hides_the_secret() -> None:
    env = {**os.environ, "TENSORWIRE_SECRET": "s3cr3t-value", "TENSORWIRE_NSOCKS": "2",
           "TENSORWIRE_TIMOUT": "5", "TENSORWIRE_TIMEOUT": "abc"}
    p = subprocess.run([sys.executable, "-m", "tensorwire", "version", "--all"], capture_output=True,
                       text=True, timeout=50, env=env)
    assert p.returncode == 0, p.stderr
    rows = dict(map(str.strip, line.split("  ", 1)) for line in p.stdout.splitlines()[1:])  # name, text
    native = importlib.util.find_spec("tensorwire.transport._native") is not None
    assert rows["compiled module"].startswith("built, used" if native else "not built"), rows
    has_torch = importlib.util.find_spec("torch") is not None
    assert rows["torch"].startswith("not installed") != has_torch and ("CUDA" in rows) == has_torch
    assert re.fullmatch(r"[\d.]+ [KMGT]?i?B free of [\d.]+ [KMGT]?i?B", rows["/dev/shm"]), rows["/dev/shm"]
    assert "soft limit" in rows["open files"]
    assert "TENSORWIRE_NSOCKS=2" in rows["settings"] and "TENSORWIRE_SECRET=(hidden)" in rows["settings"]
    assert "TENSORWIRE_TIMOUT=5 (not a setting: ignored)" in rows["settings"], rows
    assert "TENSORWIRE_TIMEOUT='abc'" in rows["settings error"], rows
    assert "s3cr3t" not in p.stdout + p.stderr


@pytest.mark.timeout(30)
def test_port_in_use_is_reported(tmp_path: Path) -> None:
    script = tmp_path / "ok.py"
    script.write_text("")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        res = _run(["--master-port", str(busy.getsockname()[1]), str(script)], tmp_path)
    assert res.returncode == 1
    assert "cannot host the store" in res.stderr


CONGESTION_SCRIPT = """
import socket
import tensorwire as tw
def congestion_of(sock):
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\\0")[0].decode()
tw.init()
socks = [ch.stream.sock for ch in tw.api.require_runtime().engine.channels.values()]
print("rank", tw.get_rank(), sorted({congestion_of(s) for s in socks}),
      sorted({s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) for s in socks}),
      sorted({s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) for s in socks}))
tw.destroy()
"""


@pytest.mark.timeout(60)
def test_tcp_settings_are_the_ones_asked_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TENSORWIRE_TCP_CONGESTION runs every connection with that algorithm (reno: built into
    every Linux and allowed without privileges), TENSORWIRE_TCP_SNDBUF and TENSORWIRE_TCP_RCVBUF
    size its buffers (the kernel reports twice what was asked); a name the kernel refuses fails
    init naming the setting and what the kernel offers, on every rank, as a buffer below 4K does."""
    script = tmp_path / "congestion.py"
    script.write_text(CONGESTION_SCRIPT)
    monkeypatch.setenv("TENSORWIRE_TCP_CONGESTION", "reno")
    monkeypatch.setenv("TENSORWIRE_TCP_SNDBUF", "64K")
    monkeypatch.setenv("TENSORWIRE_TCP_RCVBUF", "96K")
    done = _run(["-n", "3", "--tcp", str(script)], tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [f"rank {r} ['reno'] [131072] [196608]" for r in range(3)]
    for name in ("SNDBUF", "RCVBUF"):
        for size, shown in (("100", "100"), ("1T", str(1 << 40))):
            monkeypatch.setenv(f"TENSORWIRE_TCP_{name}", size)
            bad = _run(["-n", "2", "--tcp", str(script)], tmp_path)
            assert bad.returncode != 0
            said = f"TENSORWIRE_TCP_{name}={shown}: expected 0 (the kernel's autotuning) or 4K to 1G"
            assert said in bad.stderr, bad.stderr
        monkeypatch.delenv(f"TENSORWIRE_TCP_{name}")
    monkeypatch.setenv("TENSORWIRE_TCP_CONGESTION", "no-such-algorithm")
    failed = _run(["-n", "2", "--tcp", str(script)], tmp_path)
    assert failed.returncode != 0
    assert "InvalidArgumentError: TENSORWIRE_TCP_CONGESTION='no-such-algorithm': the kernel refused it" \
        in failed.stderr
    assert "available here: " in failed.stderr and "reno" in failed.stderr


EARLY_EXIT_SCRIPT = """\
import os, sys, time
if os.environ["RANK"] == "2":
    sys.exit(3)
import tensorwire as tw
start = time.monotonic()
try:
    tw.init()
except tw.TensorwireError as exc:
    print(f"rank {os.environ['RANK']} after {time.monotonic() - start:.1f} s: {exc}", flush=True)
    sys.exit(1)
"""


@pytest.mark.timeout(60)
def test_a_rank_that_exits_before_init_fails_the_others_at_once(tmp_path: Path) -> None:
    """Under --keep-going nobody stops the others: the launcher tells the store, whose blocked
    reads then end, so ranks waiting in init() for the dead one fail in seconds, naming it and
    how it ended, not at their timeout."""
    script = tmp_path / "early_exit.py"
    script.write_text(EARLY_EXIT_SCRIPT)
    start = time.monotonic()
    res = _run(["-n", "3", "--keep-going", "--timeout", "120", str(script)], tmp_path)
    assert time.monotonic() - start < 20, res.stderr
    assert res.returncode == 3, res.stderr
    lines = sorted(res.stdout.splitlines())
    assert [line.split(" after ")[0] for line in lines] == ["rank 0", "rank 1"], res.stdout
    for line in lines:
        assert float(line.split(" after ")[1].split(" s:")[0]) < 15, line
        assert re.search(r"rank 2 \(local rank 2, pid \d+\) on node 0 ended with exit code 3", line), line


REINIT_SCRIPT = """\
import numpy as np
import tensorwire as tw
for cycle in range(3):
    world = tw.init()
    x = np.full(4, world.rank + 1.0, np.float32)
    tw.all_reduce(x)
    assert x[0] == world.size * (world.size + 1) / 2, (cycle, x)
    rank = world.rank
    tw.destroy()
    if rank == 0 and cycle == 1:  # a world of its own between two of the job's: no generation
        tw.init(rank=0, world_size=1)
        tw.destroy()
print(f"rank {rank}: 3 cycles", flush=True)
"""


@pytest.mark.timeout(60)
def test_init_after_destroy_joins_again(tmp_path: Path) -> None:
    """The launcher's store lives as long as the job: each init() of a rank is a new generation
    of the roster, not a second process with the same rank; a world of one in between is not
    one (rank 0 then waited in a generation of its own until the timeout)."""
    script = tmp_path / "reinit.py"
    script.write_text(REINIT_SCRIPT)
    res = _run(["-n", "2", "--timeout", "30", str(script)], tmp_path)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["rank 0: 3 cycles", "rank 1: 3 cycles"]


FORKED_WORKER = """\
import os, signal, sys, threading, time
import numpy as np
import tensorwire as tw
w = tw.init()
a = np.ones(1 << 16, np.float32)
tw.all_reduce(a)  # every pair connected
if w.rank == 1:
    if os.fork() == 0:  # a worker (a data loader's) that outlives its rank, with copies of its descriptors
        parent = os.getppid()
        while os.getppid() == parent:
            time.sleep(0.05)
        time.sleep(15)
        os._exit(0)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
killed = time.time() + 0.5
try:
    while True:
        tw.all_reduce(a)
except tw.PeerLostError as exc:
    print(f"noticed {time.time() - killed:.2f} s after: {exc}", flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tcp", [False, True])
def test_a_rank_killed_while_its_fork_lives_is_lost_at_once(tmp_path: Path, tcp: bool) -> None:
    """A process a rank forked after init() closes its copies of the rank's sockets: when the rank
    is killed, its peers learn it at once, not when the fork exits (15 s later here)."""
    (tmp_path / "job.py").write_text(FORKED_WORKER)
    res = _run(["-n", "2", "--keep-going", *(["--tcp"] if tcp else []), "job.py"], tmp_path, timeout=50)
    line = next((x for x in res.stdout.splitlines() if x.startswith("noticed")), None)
    assert line is not None, res.stdout + res.stderr
    assert float(line.split()[1]) < 5.0 and "lost rank 1" in line, line


SMALL_BUFFERS = """\
import time
import numpy as np
import tensorwire as tw
w = tw.init()
a, b = np.full(1 << 20, w.rank, np.uint8), np.empty(1 << 20, np.uint8)
t0 = time.perf_counter()
tw.sendrecv(a, 1 - w.rank, b, 1 - w.rank)
print(f"rank {w.rank} {time.perf_counter() - t0:.3f} {int(b[0])}", flush=True)
"""


@pytest.mark.timeout(60)
def test_small_tcp_buffers_are_set_before_connecting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TENSORWIRE_TCP_RCVBUF=4K set after a dialed socket connected stalled its transfers: init's
    calibration ran into the job's 20 s timeout. Set before, the job runs (its time is not
    asserted: docs/design/tcp.md has the measurement)."""
    (tmp_path / "small.py").write_text(SMALL_BUFFERS)
    monkeypatch.setenv("TENSORWIRE_TCP_RCVBUF", "4K")
    monkeypatch.setenv("TENSORWIRE_TCP_SNDBUF", "4K")
    done = _run(["-n", "2", "--tcp", "--timeout", "20", "small.py"], tmp_path, timeout=50)
    assert done.returncode == 0, done.stderr
    for line in done.stdout.splitlines():
        rank, _seconds, got = line.split()[1:]
        assert int(got) == 1 - int(rank), line


@pytest.mark.timeout(60)
def test_stdin_goes_to_rank_0(tmp_path: Path) -> None:
    """As mpirun: the launcher's stdin is rank 0's; the other ranks read nothing."""
    (tmp_path / "read.py").write_text("import os, sys\n"
                                      "print(f\"rank {os.environ['RANK']} read {sys.stdin.read()!r}\")\n")
    res = subprocess.run([sys.executable, "-m", "tensorwire", "run", "-n", "2", "read.py"], cwd=tmp_path,
                         input="hello\n", capture_output=True, text=True, timeout=50)
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["rank 0 read 'hello\\n'", "rank 1 read ''"], res.stdout


LEAVES_A_CHILD = """\
import os, signal, sys, time
if os.fork() == 0:  # a worker left behind; rank 0's ignores SIGTERM
    if os.environ["RANK"] == "0":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with open(f"child{os.environ['RANK']}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)
    os._exit(0)
while not os.path.exists(f"child{os.environ['RANK']}"):
    time.sleep(0.01)
"""


@pytest.mark.timeout(60)
def test_processes_a_rank_leaves_behind_are_ended(tmp_path: Path) -> None:
    """As torchrun: what a rank forked and left running ends with the job, and the launcher says so
    (it outlived the job before); SIGKILL where SIGTERM is ignored."""
    (tmp_path / "job.py").write_text(LEAVES_A_CHILD)
    res = _run(["-n", "2", "job.py"], tmp_path, timeout=50)
    assert res.returncode == 0, res.stderr
    pids = [int((tmp_path / f"child{r}").read_text()) for r in range(2)]
    for rank, pid in enumerate(pids):
        assert f"rank {rank} left 1 process(es) running (pid {pid}): ending them" in res.stderr, res.stderr
    assert not any(_running(pid) for pid in pids)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may be slow to reap, or never)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False
