"""Rendezvous layer: stores over real sockets and files, launcher detection, address choice.

Cross-process tests start real interpreters (`python -c`), so they exercise exactly what a
job does: separate processes meeting through a port or a directory on loopback.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cluster import free_port
from tensorwire import auth
from tensorwire.errors import InvalidArgumentError, RendezvousError, TimeoutError
from tensorwire.rendezvous.bootstrap import (
    LaunchInfo,
    check_roster,
    create_store,
    detect,
    expand_hostlist,
    expand_tasks_per_node,
    parse_init_method,
)
from tensorwire.rendezvous.file_store import FileStore
from tensorwire.rendezvous.prefix_store import PrefixStore
from tensorwire.rendezvous.tcp_protocol import EXITED_KEY, KEYS_ROOM, key_batches
from tensorwire.rendezvous.tcp_server import TCPStoreServer
from tensorwire.rendezvous.tcp_store import TCPStore
from tensorwire.rendezvous.torch_store import TorchStoreAdapter
from tensorwire.transport.netif import list_interfaces, match_ifname, route_source_address, select_address

LOOPBACK = "127.0.0.1"

# Prelude of every child: report the result (or the error's class and message) as one JSON line.
_PRELUDE = """
import json, sys, time
from tensorwire.rendezvous.tcp_store import TCPStore
from tensorwire.rendezvous.file_store import FileStore
from tensorwire.rendezvous.bootstrap import detect, create_store
def report(**kw):
    print(json.dumps(kw), flush=True)
"""


def spawn(code: str, *args: object) -> subprocess.Popen[str]:
    source = _PRELUDE + textwrap.dedent(code)
    return subprocess.Popen([sys.executable, "-c", source, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen[str], timeout: float = 20.0) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"child failed (rc {proc.returncode}):\n{err}"
    return json.loads(out.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------
# TCPStore


@pytest.mark.timeout(30)
def test_tcp_store_set_get_add_across_processes() -> None:
    host = TCPStore(LOOPBACK, 0, timeout=20, server=True)
    try:
        n = 3
        code = """
        rank, port, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
        s = TCPStore("127.0.0.1", port, timeout=15)
        ticket = s.add("counter", 1)
        s.set(f"from/{rank}", f"hello from {rank}".encode())
        seen = {str(r): s.get(f"from/{r}").decode() for r in range(n)}
        s.close()
        report(ticket=ticket, seen=seen)
        """
        procs = [spawn(code, r, host.port, n) for r in range(n)]
        results = [finish(p) for p in procs]
        assert sorted(r["ticket"] for r in results) == [1, 2, 3]
        expected = {str(r): f"hello from {r}" for r in range(n)}
        assert all(r["seen"] == expected for r in results)
        assert host.get("counter") == b"3"  # counters read back as ASCII decimal
        assert host.add("counter", 10) == 13
    finally:
        host.close()


@pytest.mark.timeout(30)
def test_get_blocks_until_another_process_sets() -> None:
    with TCPStore(LOOPBACK, 0, timeout=20, server=True) as store:
        proc = spawn("""
        s = TCPStore("127.0.0.1", int(sys.argv[1]), timeout=15)
        time.sleep(0.6)
        s.set("late/key", b"worth the wait")
        report(ok=True)
        """, store.port)
        t0 = time.monotonic()
        value = store.get("late/key", timeout=15)
        waited = time.monotonic() - t0
        assert finish(proc) == {"ok": True}
    assert value == b"worth the wait"
    assert waited >= 0.5


@pytest.mark.timeout(30)
def test_wait_blocks_until_all_keys_exist() -> None:
    with TCPStore(LOOPBACK, 0, timeout=20, server=True) as store:
        proc = spawn("""
        s = TCPStore("127.0.0.1", int(sys.argv[1]), timeout=15)
        for k in ("w/a", "w/b"):
            time.sleep(0.3)
            s.set(k, b"1")
        report(ok=True)
        """, store.port)
        t0 = time.monotonic()
        store.wait(["w/a", "w/b"], timeout=15)
        waited = time.monotonic() - t0
        finish(proc)
        assert store.check(["w/a", "w/b"]) is True
    assert waited >= 0.5


@pytest.mark.timeout(30)
def test_get_timeout_raises_our_timeout_error_naming_key() -> None:
    with TCPStore(LOOPBACK, 0, timeout=20, server=True) as store:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"get\('no/such/key'\) timed out after 0\.3 s") as info:
            store.get("no/such/key", timeout=0.3)
        elapsed = time.monotonic() - t0
        assert isinstance(info.value, builtins_timeout())
        assert 0.25 <= elapsed < 3.0
        # The stream stays in sync after a timeout: the next call gets its own answer.
        store.set("after", b"fine")
        assert store.get("after", timeout=1) == b"fine"
        with pytest.raises(TimeoutError, match=r"missing: \['w/2'\]"):
            store.wait(["after", "w/2"], timeout=0.2)
        # A key set later than the timeout still reaches later readers.
        store.set("no/such/key", b"late")
        assert store.get("no/such/key", timeout=1) == b"late"


def builtins_timeout() -> type:
    import builtins
    return builtins.TimeoutError


@pytest.mark.timeout(30)
def test_default_timeout_applies_when_none_given() -> None:
    with TCPStore(LOOPBACK, 0, timeout=0.4, server=True) as store:
        assert store.default_timeout == 0.4
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="k0"):
            store.get("k0")
        assert 0.3 <= time.monotonic() - t0 < 3.0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("forever", [1e10, 1e308])
def test_a_timeout_past_what_a_socket_can_time_waits_without_one(forever: float) -> None:
    """TENSORWIRE_TIMEOUT=1e10 ('wait forever') raised OverflowError from socket.settimeout in
    every rank's init (a tester)."""
    with TCPStore(LOOPBACK, 0, timeout=forever, server=True) as store:
        store.set("k", b"v")
        assert store.get("k") == b"v"
        assert store.get("k", timeout=forever) == b"v"


@pytest.mark.timeout(30)
def test_multi_get_of_more_keys_than_a_request_carries() -> None:
    """A world's cards past ~40k ranks: one request held at most 65535 keys in 1 MiB (70,000
    ranks failed with struct.error from the encoder); the keys go in batches."""
    keys = [f"tw/job/card/{r}" for r in range(70_000)]
    batches = key_batches(keys)
    assert len(batches) == 2 and sum(batches, []) == keys
    assert all(len(b) <= 0xFFFF and sum(2 + len(k) for k in b) <= KEYS_ROOM for b in batches)
    with TCPStoreServer(LOOPBACK, 0) as server:
        store = TCPStore(LOOPBACK, server.port, timeout=5)
        for k in (keys[0], keys[-1]):
            store.set(k, k.encode())
        with pytest.raises(TimeoutError, match="keys still missing"):
            store.multi_get(keys, timeout=0.3)
        assert store.multi_get([keys[0], keys[-1]]) == [keys[0].encode(), keys[-1].encode()]
        store.close()


@pytest.mark.timeout(30)
def test_port_in_use_is_a_clear_error() -> None:
    with TCPStoreServer(LOOPBACK, 0) as server:
        port = server.port
        with pytest.raises(RendezvousError, match=f"port {port} on 127.0.0.1 is already in use"):
            TCPStoreServer(LOOPBACK, port)
        with pytest.raises(RendezvousError, match=f"port {port} on 127.0.0.1 is already in use"):
            TCPStore(LOOPBACK, port, timeout=2, server=True)
    # Any listener counts, not only ours.
    with socket.socket() as other:
        other.bind((LOOPBACK, 0))
        other.listen()
        port = other.getsockname()[1]
        with pytest.raises(RendezvousError, match=f"port {port} on 127.0.0.1 is already in use"):
            TCPStoreServer(LOOPBACK, port)


@pytest.mark.timeout(30)
def test_connect_to_nothing_fails_within_timeout() -> None:
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=rf"127\.0\.0\.1:{port} after trying for 1\.\d s") as info:
        TCPStore(LOOPBACK, port, timeout=1.0)
    elapsed = time.monotonic() - t0
    assert 0.9 <= elapsed < 4.0
    assert "MASTER_ADDR" in str(info.value)


@pytest.mark.timeout(30)
def test_a_timeout_too_short_for_any_attempt_is_named_as_the_cause() -> None:
    """TENSORWIRE_TIMEOUT=1e-9 said 'after trying for 0.0 s (last error: None)' and blamed
    MASTER_ADDR: the timeout ran out, and the message says so."""
    with pytest.raises(RendezvousError, match=r"its timeout of 1e-09 s \(TENSORWIRE_TIMEOUT or timeout=\) "
                                              r"ran out before a first attempt$"):
        TCPStore(LOOPBACK, free_port(), timeout=1e-9)
    with pytest.raises(RendezvousError, match=r"after trying for 0\.\d s, its whole timeout \(TENSORWIRE_"):
        TCPStore(LOOPBACK, free_port(), timeout=0.3)


@pytest.mark.timeout(30)
def test_connect_retries_until_server_appears() -> None:
    port = free_port()
    holder: list[TCPStoreServer] = []
    timer = threading.Timer(0.5, lambda: holder.append(TCPStoreServer(LOOPBACK, port)))
    timer.start()
    try:
        t0 = time.monotonic()
        with TCPStore(LOOPBACK, port, timeout=10) as client:
            client.set("k", b"v")
            assert client.get("k") == b"v"
        assert time.monotonic() - t0 >= 0.4
    finally:
        timer.join()
        for s in holder:
            s.close()


@pytest.mark.timeout(30)
def test_wrong_protocol_peer_is_rejected() -> None:
    with socket.socket() as fake:
        fake.bind((LOOPBACK, 0))
        fake.listen()
        port = fake.getsockname()[1]

        def answer_garbage() -> None:
            conn, _ = fake.accept()
            with conn:
                conn.recv(64)
                conn.sendall(b"\x00\x00\x00\x09\x00NOTSTORE")

        t = threading.Thread(target=answer_garbage, daemon=True)
        t.start()
        with pytest.raises(RendezvousError, match="not as a tensorwire store"):
            TCPStore(LOOPBACK, port, timeout=5)
        t.join(5)


def _blocked(read: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    """`read` running in a thread, given 0.3 s to block; what it raises lands in the list."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            read()
        except BaseException as exc:  # recorded for the caller's assertions
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.3)
    return t, errors


@pytest.mark.timeout(30)
def test_server_going_away_raises_instead_of_hanging() -> None:
    proc = spawn("""
    from tensorwire.rendezvous.tcp_server import TCPStoreServer
    srv = TCPStoreServer("127.0.0.1", 0)
    report(port=srv.port)
    time.sleep(60)
    """)
    assert proc.stdout is not None
    port = json.loads(proc.stdout.readline())["port"]
    client = TCPStore(LOOPBACK, port, timeout=20)
    try:
        client.set("k", b"v")
        t, errors = _blocked(lambda: client.get("never", timeout=20))
        t0 = time.monotonic()
        proc.kill()
        proc.wait(10)
        t.join(10)
        assert not t.is_alive()
        assert time.monotonic() - t0 < 5
        assert len(errors) == 1 and isinstance(errors[0], RendezvousError)
        assert f"127.0.0.1:{port}" in str(errors[0])
        with pytest.raises(RendezvousError, match="lost earlier"):
            client.set("k", b"again")
    finally:
        proc.kill()
        proc.communicate()
        client.close()


@pytest.mark.timeout(30)
def test_a_rank_reported_exited_ends_every_blocked_read() -> None:
    """What `tensorwire run` does when a rank exits: reads blocked on keys nobody will set end
    at once with the report (the first one kept), and so do later ones; set keys still read."""
    with TCPStore(LOOPBACK, 0, timeout=20, server=True) as host, \
            TCPStore(LOOPBACK, host.port, timeout=20) as waiter:
        host.set("here", b"v")
        t, errors = _blocked(lambda: waiter.multi_get(["here", "never"], timeout=20))
        t0 = time.monotonic()
        host.set(EXITED_KEY, b"rank 2 ended with exit code 3")
        t.join(10)
        assert time.monotonic() - t0 < 5 and len(errors) == 1 and isinstance(errors[0], RendezvousError)
        assert "cannot complete: rank 2 ended with exit code 3" in str(errors[0])
        host.set(EXITED_KEY, b"rank 1 ended with exit code 0")
        with pytest.raises(RendezvousError, match="rank 2 ended with exit code 3"):
            waiter.get("never", timeout=20)
        assert waiter.get("here") == b"v" and waiter.multi_get(["here"]) == [b"v"]


@pytest.mark.timeout(30)
def test_tcp_store_is_thread_safe() -> None:
    with TCPStore(LOOPBACK, 0, timeout=20, server=True) as store:
        results: list[int] = []
        lock = threading.Lock()

        def worker(i: int) -> None:
            for j in range(50):
                n = store.add("threads", 1)
                store.set(f"t/{i}/{j}", str(n).encode())
                with lock:
                    results.append(n)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results) == list(range(1, 201))
        assert store.get("threads") == b"200"


@pytest.mark.timeout(30)
def test_store_argument_errors() -> None:
    with TCPStore(LOOPBACK, 0, timeout=5, server=True) as store:
        with pytest.raises(InvalidArgumentError, match="must be bytes"):
            store.set("k", "text")  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="non-empty"):
            store.get("")
        store.set("word", b"abc")
        with pytest.raises(InvalidArgumentError, match=r"add\('word', 1\).*not an integer"):
            store.add("word", 1)
        assert store.add("fine", 2) == 2  # the connection survived the refused add


# --------------------------------------------------------------------------------------------
# FileStore, PrefixStore, torch adapter


@pytest.mark.timeout(30)
def test_file_store_across_processes(tmp_path: Path) -> None:
    path = tmp_path / "store"
    n, adds = 3, 100
    code = """
    rank, path, n, adds = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    s = FileStore(path, timeout=15)
    s.set(f"ready/{rank}", b"")
    s.wait([f"ready/{r}" for r in range(n)])  # start the adds together, to contend for the lock
    for _ in range(adds):
        s.add("counter", 1)
    s.set(f"from/{rank}", f"r{rank}".encode())
    seen = [s.get(f"from/{r}").decode() for r in range(n)]
    report(seen=seen)
    """
    procs = [spawn(code, r, path, n, adds) for r in range(n)]
    results = [finish(p) for p in procs]
    assert all(r["seen"] == [f"r{i}" for i in range(n)] for r in results)
    store = FileStore(path, timeout=5)
    assert store.get("counter") == str(n * adds).encode()  # no lost updates under the lock
    assert store.add("counter", -1) == n * adds - 1


@pytest.mark.timeout(30)
def test_file_store_get_blocks_then_times_out(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "s", timeout=5)
    proc = spawn("""
    s = FileStore(sys.argv[1], timeout=15)
    time.sleep(0.4)
    s.set("late", b"here")
    report(ok=True)
    """, tmp_path / "s")
    t0 = time.monotonic()
    assert store.get("late", timeout=10) == b"here"
    assert time.monotonic() - t0 >= 0.3
    finish(proc)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"get\('tw/missing'\) timed out after 0\.2 s"):
        store.get("tw/missing", timeout=0.2)
    assert time.monotonic() - t0 < 2
    with pytest.raises(TimeoutError, match=r"missing: \['b'\]"):
        store.wait(["late", "b"], timeout=0.1)
    assert store.check(["late"]) and not store.check(["late", "b"])
    assert store.delete_key("late") is True and store.delete_key("late") is False


def test_file_store_cleanup_removes_directory_after_last_user(tmp_path: Path) -> None:
    path = tmp_path / "job"
    a = FileStore(path, timeout=5, cleanup=True)
    b = FileStore(path, timeout=5, cleanup=True)
    a.set("x", b"1")
    a.close()
    assert path.exists() and b.get("x") == b"1"
    b.close()
    assert not path.exists()


def test_file_store_keys_with_odd_characters(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "s", timeout=5)
    keys = ["a/b/c", "..", ".lock", "sp ace", "ü", "x" * 500]
    for i, k in enumerate(keys):
        store.set(k, str(i).encode())
    assert [store.get(k) for k in keys] == [str(i).encode() for i in range(len(keys))]


@pytest.mark.timeout(30)
def test_prefix_store_isolation() -> None:
    with TCPStore(LOOPBACK, 0, timeout=5, server=True) as inner:
        a, b = PrefixStore("group/a", inner), PrefixStore("group/b", inner)
        a.set("k", b"A")
        b.set("k", b"B")
        assert a.get("k") == b"A" and b.get("k") == b"B"
        assert inner.get("group/a/k") == b"A"
        assert a.add("n", 5) == 5 and b.add("n", 1) == 1
        a.set("only-a", b"1")
        assert a.check(["only-a"]) and not b.check(["only-a"])
        with pytest.raises(TimeoutError, match="group/b/only-a"):
            b.get("only-a", timeout=0.1)
        a.close()  # a view's close leaves the shared connection open
        assert b.get("k") == b"B"


@pytest.mark.timeout(30)
def test_torch_store_adapter() -> None:
    dist = pytest.importorskip("torch.distributed")
    from datetime import timedelta

    master = dist.TCPStore(LOOPBACK, 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    client = TorchStoreAdapter(dist.TCPStore(LOOPBACK, master.port, is_master=False,
                                             timeout=timedelta(seconds=5)))
    assert client.default_timeout == 5
    client.set("k", b"v")
    assert client.get("k") == b"v"
    assert client.add("n", 3) == 3 and client.get("n") == b"3"
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"get\('absent'\) timed out after 0\.2 s"):
        client.get("absent", timeout=0.2)
    assert time.monotonic() - t0 < 2
    with pytest.raises(TimeoutError):
        client.wait(["k", "absent"], timeout=0.2)
    assert client.check(["k"]) and not client.check(["absent"])


# --------------------------------------------------------------------------------------------
# detect()


def test_detect_single_process_without_env() -> None:
    info = detect(env={})
    assert (info.rank, info.world_size, info.source) == (0, 1, "single")
    assert info.init_method == "tcp://127.0.0.1:0"
    assert (info.local_rank, info.local_world_size, info.node_rank) == (0, 1, 0)
    assert info.store_hosted is False


def test_detect_tensorwire_launcher() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "TENSORWIRE_JOB_ID": "job42",
           "TENSORWIRE_STORE_HOSTED": "1"}
    info = detect(env=env)
    assert info == LaunchInfo(3, 4, 1, 2, 1, "127.0.0.1", 29511, "tcp://127.0.0.1:29511", "tensorwire",
                              "job42", True)


def test_detect_torchrun_agent_store_and_plain() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "none",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
    info = detect(env=env)
    assert info.source == "torchrun"
    assert info.init_method == "torch-agent://127.0.0.1:29400"
    assert info.store_hosted is True
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (1, 2, 1, 2)
    rank0 = detect(env={**env, "RANK": "0", "LOCAL_RANK": "0"})
    assert rank0.job_id == info.job_id  # every rank agrees
    assert detect(env={**env, "TORCHELASTIC_RESTART_COUNT": "1"}).job_id != info.job_id
    assert detect(env={**env, "MASTER_PORT": "29401"}).job_id != info.job_id
    plain = detect(env={**env, "TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert plain.init_method == "tcp://127.0.0.1:29400" and plain.store_hosted is False


def test_detect_open_mpi_single_host_uses_file_store() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_MCA_orte_hnp_uri": "123.0;tcp://127.0.0.1:4000"}
    info = detect(env=env)
    assert (info.source, info.rank, info.world_size, info.local_rank, info.local_world_size) == \
        ("mpirun", 2, 4, 2, 4)
    assert info.init_method == f"file://{tempfile.gettempdir()}/tensorwire-{os.geteuid()}/{info.job_id}"
    assert info.master_addr is None and info.node_rank == 0
    assert detect(env={**env, "OMPI_COMM_WORLD_RANK": "0"}).job_id == info.job_id
    other_job = detect(env={**env, "OMPI_MCA_orte_hnp_uri": "999.0;tcp://127.0.0.1:4001"})
    assert other_job.job_id != info.job_id
    pmix = detect(env={"PMIX_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                       "PMIX_NAMESPACE": "prterun-host-77@1"})
    assert (pmix.rank, pmix.world_size, pmix.source) == (1, 2, "mpirun")


def test_detect_open_mpi_multi_host_needs_master_addr() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "PMIX_NAMESPACE": "prterun-host-5@1"}
    with pytest.raises(RendezvousError, match="set MASTER_ADDR"):
        detect(env=env)
    info = detect(env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29600"})
    assert info.init_method == "tcp://127.0.0.1:29600" and info.store_hosted is False


def test_detect_mpich() -> None:
    env = {"PMI_RANK": "1", "PMI_SIZE": "3", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"}
    info = detect(env=env)
    assert (info.source, info.rank, info.world_size, info.local_rank) == ("mpirun", 1, 3, 1)
    assert info.job_id == f"mpi-ppid{os.getppid()}"  # single host: the shared launcher parent
    assert info.init_method.startswith(f"file://{tempfile.gettempdir()}/tensorwire-{os.geteuid()}/mpi-")


def test_detect_slurm() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
           "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "node[01-04,07],gpu3",
           "SLURM_STEP_TASKS_PER_NODE": "2(x4)"}
    info = detect(env=env)
    assert (info.source, info.rank, info.world_size, info.local_rank, info.local_world_size,
            info.node_rank) == ("slurm", 5, 8, 1, 2, 2)
    assert info.master_addr == "node01"
    assert info.master_port == 20000 + 123456 % 20000 == 23456
    assert info.init_method == "tcp://node01:23456"
    assert info.job_id == "slurm-123456.0"
    override = detect(env={**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"})
    assert override.init_method == "tcp://127.0.0.1:29999"
    # The batch script itself (no step variables) is not a multi-rank job.
    batch = {k: v for k, v in env.items() if not k.startswith("SLURM_STEP")}
    assert detect(env=batch).source == "single"


def test_detect_launcher_precedence_over_slurm() -> None:
    slurm = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7", "SLURM_STEP_ID": "1",
             "SLURM_STEP_NODELIST": "n1"}
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400",
                "TORCHELASTIC_RUN_ID": "abc"}
    assert detect(env={**slurm, **torchrun}).source == "torchrun"
    mpi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert detect(env={**slurm, **mpi}).rank == 1


def test_detect_explicit_arguments_win() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400",
           "TORCHELASTIC_RUN_ID": "abc"}
    info = detect(1, 2, "tcp://127.0.0.2:29700", env=env)
    assert (info.rank, info.world_size, info.source) == (1, 2, "explicit")
    assert (info.master_addr, info.master_port) == ("127.0.0.2", 29700)
    assert info.job_id == detect(0, 2, "tcp://127.0.0.2:29700", env={}).job_id
    f = detect(0, 2, "file:///tmp/tw-test-dir", env={})
    assert f.init_method == "file:///tmp/tw-test-dir" and f.master_addr is None
    # init_method alone: rank and size come from the launcher.
    partial = detect(init_method="tcp://127.0.0.3:29800", env=env)
    assert (partial.rank, partial.world_size, partial.source) == (3, 4, "torchrun")


def test_detect_env_init_method() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29501"}
    info = detect(init_method="env://", env=env)
    assert (info.rank, info.world_size, info.init_method, info.source) == \
        (1, 2, "tcp://127.0.0.1:29501", "env")
    assert detect(env=env) == info  # plain RANK/WORLD_SIZE/MASTER_* means the same
    with pytest.raises(InvalidArgumentError, match="MASTER_PORT"):
        detect(init_method="env://", env={"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})
    # torchrun's agent store is still honoured when the user writes env://
    tr = {**env, "TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert detect(init_method="env://", env=tr).init_method == "torch-agent://127.0.0.1:29501"


def test_detect_validation_errors() -> None:
    with pytest.raises(InvalidArgumentError, match=r"rank 4 is outside \[0, 4\)"):
        detect(4, 4, "tcp://127.0.0.1:29500", env={})
    with pytest.raises(InvalidArgumentError, match="world_size must be >= 1, got 0"):
        detect(0, 0, "tcp://127.0.0.1:29500", env={})
    with pytest.raises(InvalidArgumentError, match=r"rank -1 is outside"):
        detect(-1, 2, "tcp://127.0.0.1:29500", env={})
    with pytest.raises(InvalidArgumentError, match="RANK='x'"):
        detect(env={"RANK": "x", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "a",
                    "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    with pytest.raises(InvalidArgumentError, match="no way to find the other ranks"):
        detect(0, 2, env={})
    with pytest.raises(InvalidArgumentError, match="port 0 only works for a single process"):
        detect(0, 2, "tcp://127.0.0.1:0", env={})
    with pytest.raises(InvalidArgumentError, match="not understood"):
        detect(0, 1, "udp://127.0.0.1:1", env={})
    with pytest.raises(InvalidArgumentError, match="without world_size"):
        detect(rank=1, env={})


def test_parse_init_method() -> None:
    assert parse_init_method("tcp://127.0.0.1:29500") == ("tcp", "127.0.0.1", 29500, None)
    # IPv6: refused where it is read, on every rank (rank 0 failed to route it, the others waited)
    with pytest.raises(InvalidArgumentError, match="IPv6 addresses are not supported"):
        parse_init_method("tcp://[::1]:80")
    for addr in ("::1", "[::1]"):
        with pytest.raises(InvalidArgumentError, match=r"'tcp://\[::1\]:80': IPv6"):
            detect(env={"MASTER_ADDR": addr, "MASTER_PORT": "80", "RANK": "1", "WORLD_SIZE": "2"})
    assert parse_init_method("file:///tmp/x") == ("file", None, None, "/tmp/x")
    assert parse_init_method("env://") == ("env", None, None, None)
    with pytest.raises(InvalidArgumentError, match="absolute path"):
        parse_init_method("file://relative")
    with pytest.raises(InvalidArgumentError, match="outside 0..65535"):
        parse_init_method("tcp://h:70000")


def test_hostlist_parser() -> None:
    assert expand_hostlist("node[01-04,07],gpu3") == [
        "node01", "node02", "node03", "node04", "node07", "gpu3"]
    assert expand_hostlist("a1") == ["a1"]
    assert expand_hostlist("n[8-11]") == ["n8", "n9", "n10", "n11"]
    assert expand_hostlist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    assert expand_hostlist("x[098-100]-ib") == ["x098-ib", "x099-ib", "x100-ib"]
    with pytest.raises(InvalidArgumentError, match="unmatched"):
        expand_hostlist("node[01-02")
    with pytest.raises(InvalidArgumentError, match="runs backwards"):
        expand_hostlist("node[5-2]")
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]


# --------------------------------------------------------------------------------------------
# create_store with real processes

_JOIN = """
rank, ws, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
try:
    store = create_store(detect(rank, ws, init, env={}), timeout=float(sys.argv[4]))
    store.set(f"hello/{rank}", b"x")
    time.sleep(float(sys.argv[5]))
    report(ok=True)
except Exception as exc:
    report(ok=False, kind=type(exc).__name__, msg=str(exc))
"""


@pytest.mark.timeout(30)
def test_create_store_three_ranks_meet() -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [spawn(_JOIN, r, 3, init, 10, 1.0) for r in (2, 1, 0)]  # rank 0 starts last
    assert [finish(p) for p in procs] == [{"ok": True}] * 3


_REINIT = """
import numpy as np
import tensorwire as tw
rank, n, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
for i in range(int(sys.argv[4])):
    tw.init(rank, n, init, timeout=20)
    x = np.ones(4, np.float32)
    tw.all_reduce(x)
    assert x.tolist() == [n] * 4, x
    tw.destroy()
report(ok=True)
"""


@pytest.mark.timeout(120)
def test_init_and_destroy_in_a_loop_on_an_address_rank_0_hosts() -> None:
    """Rank 0 hosts the store (tcp://, no launcher) and closes it at destroy(): a rank already
    in its next init() saw its store closed (RendezvousError at once, its peers then timing
    out, the second of 20 rounds at 3 ranks); it now joins the store rank 0's next init serves."""
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [spawn(_REINIT, r, 3, init, 12) for r in range(3)]
    assert [finish(p, timeout=100) for p in procs] == [{"ok": True}] * 3


@pytest.mark.timeout(30)
def test_create_store_single_process() -> None:
    info = detect(env={})
    store = create_store(info, timeout=5)
    try:
        assert json.loads(store.get("tw/world_size/1"))["world_size"] == 1
        assert store.get("tw/join/1/0") == b"1"
    finally:
        store.close()


@pytest.mark.timeout(30)
def test_a_world_size_published_by_another_version_is_a_clear_error(tmp_path: Path) -> None:
    """Rank 0 publishes its world size as JSON now; a plain number (an older tensorwire) or
    anything else there is a RendezvousError naming it, not a TypeError from inside."""
    store = FileStore(tmp_path / "s", timeout=5)
    store.set("tw/world_size/1", b"4")
    info = detect(1, 4, f"file://{tmp_path / 's'}", env={})
    with pytest.raises(RendezvousError, match="rank 1: init: rank 0 published its world size as b'4'"):
        check_roster(store, info, 5, 1, None)


@pytest.mark.timeout(30)
def test_create_store_duplicate_rank() -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    root = create_store(detect(0, 3, init, env={}), timeout=10)
    try:
        procs = [spawn(_JOIN, 1, 3, init, 10, 0.0) for _ in range(2)]
        results = sorted((finish(p) for p in procs), key=lambda r: r["ok"])
        assert results[1] == {"ok": True}
        assert results[0]["kind"] == "RendezvousError"
        assert "rank 1 joined twice: two processes were given the same rank" in results[0]["msg"]
    finally:
        root.close()


@pytest.mark.timeout(30)
def test_create_store_world_size_mismatch() -> None:
    init = f"tcp://127.0.0.1:{free_port()}"
    root = create_store(detect(0, 2, init, env={}), timeout=10)
    try:
        result = finish(spawn(_JOIN, 1, 3, init, 10, 0.0))
        assert result["kind"] == "RendezvousError"
        assert "rank 1 was started with world_size=3 but rank 0 with world_size=2" in result["msg"]
    finally:
        root.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("nproc0", "nproc1", "stray"), [(2, 1, 1), (1, 2, 3)])
def test_nodes_given_different_n_are_told_so_and_stop_rank_0_waiting(nproc0: int, nproc1: int,
                                                                      stray: int) -> None:
    """`tensorwire run -n 2` on node 0, `-n 1` on node 1: node 1's rank 1 (of 2) met node 0's rank 1 (of
    4) and said that two processes were given the same rank, and rank 0 waited its timeout for
    ranks 2-3; the other way round, rank 0 (of 2) waited for a rank 1 nobody started. Now the
    rank names both world sizes and both nodes' -n, and answers for every other rank of rank 0's
    world (api.init publishes the error as their cards: rank 0 raises it at once)."""
    port = free_port()
    secret = auth.Secret(b"s" * 32, "test")

    def launched(rank: int, nproc: int, node: int) -> LaunchInfo:
        return detect(env={"TENSORWIRE_JOB_ID": "j", "RANK": str(rank), "WORLD_SIZE": str(2 * nproc),
                           "LOCAL_RANK": str(rank % nproc), "LOCAL_WORLD_SIZE": str(nproc),
                           "NODE_RANK": str(node), "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port)})

    stores = [create_store(launched(0, nproc0, 0), timeout=10, secret=secret)]
    try:
        if nproc0 == 2:  # node 0's rank 1 joins first
            stores.append(create_store(launched(1, 2, 0), timeout=10, secret=secret))
        told: list[list[int]] = []
        with pytest.raises(RendezvousError) as caught:
            create_store(launched(stray, nproc1, 1), timeout=10, secret=secret,
                         refused=lambda _, error, absent: told.append(list(absent)))
        assert str(caught.value).startswith(
            f"rank {stray}: init: world size mismatch: rank {stray} was started with world_size={2 * nproc1} "
            f"but rank 0 with world_size={2 * nproc0} (store tcp://127.0.0.1:{port}); tensorwire run makes "
            f"WORLD_SIZE --nnodes times -n: node 1 runs -n {nproc1} --nnodes 2, node 0 -n {nproc0} --nnodes "
            f"2; every node needs the same -n and --nnodes"), caught.value
        assert told == [[r for r in range(1, 2 * nproc0) if r != stray]]
    finally:
        for store in stores:
            store.close()


@pytest.mark.timeout(30)
def test_create_store_file_method_duplicate_rank(tmp_path: Path) -> None:
    init = f"file://{tmp_path / 'job'}"
    procs = [spawn(_JOIN, r, 2, init, 10, 0.5) for r in (0, 0, 1)]
    results = [finish(p) for p in procs]
    failures = [r for r in results if not r["ok"]]
    assert len(failures) == 1 and "rank 0 joined twice" in failures[0]["msg"]


@pytest.mark.timeout(30)
def test_create_store_waiting_for_missing_rank_zero_times_out() -> None:
    init = f"file:///tmp/tw-test-{os.getpid()}-{time.monotonic_ns()}"
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 1 waited 0\.3 s for rank 0"):
        create_store(detect(1, 2, init, env={}), timeout=0.3)
    assert time.monotonic() - t0 < 3
    assert not Path(parse_init_method(init)[3] or "").exists()  # the failed store cleaned up


@pytest.mark.timeout(30)
def test_create_store_through_torchrun_agent_store() -> None:
    dist = pytest.importorskip("torch.distributed")
    from datetime import timedelta

    agent = dist.TCPStore(LOOPBACK, 0, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(agent.port),
           "TORCHELASTIC_RUN_ID": "t", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    info = detect(env=env)
    store = create_store(info, timeout=5)
    again = None
    try:
        assert isinstance(store, PrefixStore) and isinstance(store.inner, TorchStoreAdapter)
        # our keys went into the agent's store, under the attempt's job id
        assert json.loads(agent.get(f"{info.job_id}/tw/world_size/1"))["world_size"] == 1
        with pytest.raises(RendezvousError, match="rank 0 joined twice"):
            create_store(detect(env=env), timeout=5)
        # the next attempt of an elastic job (--max-restarts) finds the store as the last left
        # it, and joins afresh
        again = create_store(detect(env={**env, "TORCHELASTIC_RESTART_COUNT": "1"}), timeout=5)
        # init() after destroy() in the same process (the agent's store lives on): the roster's
        # next generation, joined afresh (tests/test_launcher.py runs it end to end)
        store.close()
        store = create_store(detect(env=env), timeout=5, generation=2)
        assert agent.get(f"{info.job_id}/tw/join/2/0") == b"1"
    finally:
        store.close()
        if again is not None:
            again.close()


# --------------------------------------------------------------------------------------------
# netif


def test_match_ifname() -> None:
    names = ["lo", "eth0", "eth1", "eth10", "docker0", "ib0", "ibp1"]
    assert match_ifname("eth0,ib", names) == ["eth0", "ib0", "ibp1"]
    assert match_ifname("eth1", names) == ["eth1", "eth10"]
    assert match_ifname("=eth1", names) == ["eth1"]
    assert match_ifname("^docker,lo", names) == ["eth0", "eth1", "eth10", "ib0", "ibp1"]
    assert match_ifname("^=eth1,lo", names) == ["eth0", "eth10", "docker0", "ib0", "ibp1"]
    assert match_ifname("", names) == names
    assert match_ifname("wlan", names) == []


def test_list_interfaces_has_loopback() -> None:
    assert ("lo", "127.0.0.1") in list_interfaces()


def test_select_address() -> None:
    assert select_address("lo", None, None) == "127.0.0.1"
    assert select_address("=lo", "127.0.0.1", 29500) == "127.0.0.1"
    assert route_source_address("127.0.0.1", 29500) == "127.0.0.1"
    assert select_address("", "127.0.0.1", 29500) == "127.0.0.1"
    assert select_address("", None, None) == "127.0.0.1"
    with pytest.raises(RendezvousError, match=r"no network interface matches .*'nosuchif'.*lo=127\.0\.0\.1"):
        select_address("nosuchif", None, None)


@pytest.mark.timeout(30)
def test_init_names_the_rank_whose_interface_filter_matches_nothing() -> None:
    import tensorwire as tw

    with pytest.raises(RendezvousError, match=r"^rank 0: init: no network interface matches "
                                              r"TENSORWIRE_SOCKET_IFNAME='nosuchif'"):
        tw.init(rank=0, world_size=1, socket_ifname="nosuchif")
    assert not tw.is_initialized()


@pytest.mark.timeout(30)
def test_a_world_that_meets_group_by_group_is_set_up_as_init_sets_one_up() -> None:
    """api.join_on_demand (the torch backend's groups on top of another backend's world): its
    settings are checked as init's are (an unknown algorithm fails before anything listens),
    and the rank listens knowing only its own card: no store is asked, pairs connect on demand."""
    proc = spawn("""
    import os
    from tensorwire import api
    from tensorwire.errors import InvalidArgumentError
    os.environ["TENSORWIRE_ALGO"] = "all_reduce:rnig"
    try:
        api.join_on_demand(1, 2, "tcp://127.0.0.1:1", timeout=5)
        refused = ""
    except InvalidArgumentError as exc:
        refused = str(exc)
    del os.environ["TENSORWIRE_ALGO"]
    rt = api.join_on_demand(1, 2, "tcp://127.0.0.1:1", timeout=5)
    wiring = rt.engine.wiring
    report(refused=refused, cards=sorted(wiring.cards), port=wiring.port, topology=rt.topology,
           world=api.is_initialized())
    rt.close()
    """)
    got = finish(proc)
    assert got["refused"].startswith("rank 1: ") and "rnig" in got["refused"], got
    assert got["cards"] == [1] and got["port"] > 0, got
    assert got["topology"] is None and got["world"] is False, got


@pytest.mark.timeout(30)
def test_a_store_says_whether_this_process_serves_it(tmp_path: Path) -> None:
    """Store.hosting, declared for every store (init probed stores for a `server` attribute):
    the TCP store whose server runs in this process, and a prefix view of it, say so; a client
    of it and a file store do not."""
    with TCPStore(LOOPBACK, 0, timeout=10, server=True) as host, \
            TCPStore(LOOPBACK, host.port, timeout=10) as client:
        assert host.hosting and PrefixStore("tw", host).hosting
        assert not client.hosting and not PrefixStore("tw", client).hosting
    store = FileStore(tmp_path / "s", timeout=5)
    assert not store.hosting
    store.close()
