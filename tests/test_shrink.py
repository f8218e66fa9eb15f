"""Going on after a rank dies: `tw.shrink()` / `Group.shrink()`, `tensorwire run --keep-going`,
and torchrun's elastic restarts through the torch backend.

Each case starts its own interpreters (a rank is killed for real, with os._exit), which report
JSON lines; the assertions happen here. The survivors check every collective on the shrunk
group against numpy with tests/soak.py's `check_every_collective`, and force the one-shot
shared-memory path and single copy on it where the transport has them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from cluster import free_port

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent

_PRELUDE = f"""
import json, os, sys, threading, time
import numpy as np
sys.path.insert(0, {str(TESTS)!r})
import tensorwire as tw
from tensorwire.tuning import tuner
from soak import check_every_collective
rank, size, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ARGS = sys.argv[4:]
URL = f"tcp://127.0.0.1:{{port}}"

def report(**kw):
    print("@@" + json.dumps(kw), flush=True)

def outcome(fn, *a, **k):
    t0 = time.monotonic()
    try:
        fn(*a, **k)
    except Exception as exc:
        return {{"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__],
                "msg": str(exc), "t": time.monotonic() - t0}}
    return {{"type": None, "mro": [], "msg": "", "t": time.monotonic() - t0}}

def forced(group, transport):
    '''The one-shot path (small) and single copy (large) forced on `group`, checked.'''
    n, me = group.size, group.rank
    used = []
    for algo, count in (("direct", 8), ("single_copy", 1 << 20)):
        if transport == "tcp" or n < 2:
            break
        x = np.full(count, me + 1.0)
        with tuner.override(group, "all_reduce", algo):
            group.all_reduce(x)
        assert (x == n * (n + 1) / 2).all(), (algo, x[:4])
        used.append(algo)
    return used

def until_failure(fn, seconds=20):
    '''Call fn in a loop until it raises (a peer died); the error's outcome.'''
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        res = outcome(fn)
        if res["type"] is not None:
            return res
    return {{"type": None, "msg": "nothing failed", "mro": [], "t": seconds}}
"""


def _spawn(code: str, rank: int, size: int, port: int, *args: object,
           env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full = {**os.environ, "TENSORWIRE_TIMEOUT": "20", "TENSORWIRE_CALIBRATE": "0", **(env or {})}
    return subprocess.Popen([sys.executable, "-c", _PRELUDE + textwrap.dedent(code), str(rank), str(size),
                             str(port), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full)


def _job(code: str, size: int, transport: str, *args: object,
         timeout: float = 60) -> list[list[dict[str, Any]]]:
    """Run `code` as `size` ranks; every rank's reports (a killed rank's may be empty)."""
    port = free_port()
    env = {"TENSORWIRE_TRANSPORT": "tcp" if transport == "tcp" else "auto"}
    procs = [_spawn(code, r, size, port, *args, env=env) for r in range(size)]
    outputs = []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                err = f"(killed after {timeout:g} s)\n{err}"
            outputs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    reports = []
    for rc, out, err in outputs:
        lines = [json.loads(line[2:]) for line in out.splitlines() if line.startswith("@@")]
        reports.append(lines + [{"rc": rc, "stderr": err[-3000:]}])
    return reports


def _final(rank_reports: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for line in rank_reports:
        merged.update(line)
    return merged


def _survivors_ok(reports: list[list[dict[str, Any]]], dead: set[int]) -> list[dict[str, Any]]:
    finals = [_final(r) for r in reports]
    for rank, res in enumerate(finals):
        if rank in dead:
            assert res["rc"] != 0, f"rank {rank} was to die: {res}"
        else:
            assert res["rc"] == 0 and res.get("done"), f"rank {rank}: {res}"
    return finals


# ------------------------------------------------------------------------------ one failure

_ONE_DIES = """
victim, when = 1, ARGS[0]
world = tw.init(rank=rank, world_size=size, init_method=URL)
x = np.ones(1 << 18, np.float32)  # 1 MiB: a message algorithm, several ring pieces
tw.barrier()
if rank == victim and when == "mid":
    threading.Timer(0.2, lambda: os._exit(3)).start()  # inside one of the all_reduces below
if when == "between":
    for _ in range(3):
        tw.all_reduce(x)
    if rank == victim:
        # once every survivor is past the same calls: a rank that returned from its last call may
        # still be inside it elsewhere (rank 0's third all_reduce over TCP failed so in 1 of 6 full runs)
        time.sleep(0.3)
        os._exit(3)
    time.sleep(0.8)  # idle while it dies: the next call finds it gone
failure = until_failure(lambda: tw.all_reduce(x))
t0 = time.monotonic()
new = tw.shrink()
report(failure=failure, shrink_s=time.monotonic() - t0, ranks=new.ranks, rank=tw.get_rank(),
       size=tw.get_world_size(), world_is_new=tw.world() is new)
old = outcome(world.barrier)
calls = check_every_collective(tw.world(), seed=size)
algos = forced(new, os.environ["TENSORWIRE_TRANSPORT"])
engine = new.runtime.engine
report(old=old, calls=calls, forced=algos, unexpected=len(engine.unexpected),
       retired=world.ctx in engine.retired)
tw.barrier()
report(done=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("size,transport,when", [(3, "shm", "mid"), (4, "shm", "between"),
                                                 (3, "tcp", "between"), (4, "tcp", "mid")])
def test_survivors_shrink_and_run_every_collective(size: int, transport: str, when: str) -> None:
    """Rank 1 dies (os._exit) inside an all_reduce or between calls; the survivors get an error,
    shrink the world, are renumbered in order, and every collective on the new world matches
    numpy (the one-shot path and single copy forced on shared memory). The old world stays
    aborted, its context is retired, and nothing is left queued in the engine."""
    reports = _job(_ONE_DIES, size, transport, when)
    finals = _survivors_ok(reports, {1})
    survivors = [r for r in range(size) if r != 1]
    for new_rank, world_rank in enumerate(survivors):
        res = finals[world_rank]
        assert res["failure"]["type"] in ("PeerLostError", "AbortedError"), res["failure"]
        assert "rank 1" in res["failure"]["msg"], res["failure"]
        assert res["ranks"] == survivors and res["rank"] == new_rank and res["size"] == size - 1, res
        assert res["world_is_new"], res
        assert res["old"]["type"] in ("PeerLostError", "AbortedError") and res["old"]["t"] < 1.0, res["old"]
        assert res["calls"] >= 60, res
        assert res["forced"] == ([] if transport == "tcp" else ["direct", "single_copy"]), res
        assert res["unexpected"] == 0 and res["retired"], res
        assert res["shrink_s"] < 5.0, res


# ------------------------------------------------------------------------------ second failure

_TWO_DIE = """
when = ARGS[0]
world = tw.init(rank=rank, world_size=size, init_method=URL)
x = np.ones(1 << 16, np.float32)
tw.barrier()
if rank == 3:
    threading.Timer(0.2, lambda: os._exit(3)).start()
until_failure(lambda: tw.all_reduce(x))
if rank == 2 and when != "after":  # inside the agreement, or as the new group is set up
    threading.Timer(float(when), lambda: os._exit(4)).start()
shrinks, group = 0, None
while shrinks < 4:
    shrinks += 1
    res = outcome(tw.shrink)
    if res["type"] is not None:
        report(shrink_error=res)  # no retry helps after a failed shrink
        break
    if rank == 2 and when == "after":
        threading.Timer(0.05, lambda: os._exit(4)).start()  # inside the checks below
    res = outcome(check_every_collective, tw.world(), 7)
    if res["type"] is None:
        break
    report(check_error=res)
report(shrinks=shrinks, ranks=tw.world().ranks, rank=tw.get_rank())
tw.barrier()
report(done=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport,when", [("shm", "0.002"), ("tcp", "0.012"), ("shm", "after")])
def test_second_failure_during_or_after_shrink(transport: str, when: str) -> None:
    """4 ranks; rank 3 dies, then rank 2 dies 2 or 12 ms into the survivors' shrink (on this
    machine mostly inside the agreement, or while the new group is set up) or right after it,
    in the first calls on the new group. Ranks 0 and 1 end in the same 2-rank group (shrink
    absorbs a death during it: the agreement counts it, or the new group fails its setup and is
    shrunk again; one after it fails a call, and a second shrink recovers) on which every
    collective matches numpy."""
    reports = _job(_TWO_DIE, 4, transport, when)
    finals = _survivors_ok(reports, {2, 3})
    for rank in (0, 1):
        res = finals[rank]
        assert "shrink_error" not in res, res
        assert res["ranks"] == [0, 1] and res["rank"] == rank, res
        assert res["shrinks"] <= 2, res
        if when == "after":
            assert res["shrinks"] == 2, res
            assert re.search(r"raised (PeerLostError|AbortedError)", res["check_error"]["msg"]), res


_LOWEST_DIES_DECIDING = """
from tensorwire.group.context import mix_context
from tensorwire.group.shrink import SHRINK
from tensorwire.transport import agreement as ag
world = tw.init(rank=rank, world_size=size, init_method=URL)
tw.barrier()
if rank == 3:
    os._exit(3)
time.sleep(0.5)
if rank == 0:  # the lowest member: reports to rank 1 only, decides "nobody failed", tells rank 1, dies
    engine, ctx = world.engine, mix_context(world.ctx, SHRINK, 1)
    ag._send(engine, [1], ctx, ag._REPORT, ag._report({3}, world.ranks, 0), "rank 0's report")
    reports = [ag._recv(engine, w, ctx, ag._REPORT, size + ag._NOTE_BYTES, "report") for w in (1, 2)]
    engine.wait(reports, deadline=time.perf_counter() + 10, ctx=ctx, seq=1 << 62, watch=(), what="reports")
    ag._send(engine, [1], ctx, ag._DECIDE, ag._mask(set(), world.ranks), "rank 0's decision")
    time.sleep(0.3)  # rank 1 reads it before the connection closes
    os._exit(5)
new = tw.shrink()
report(ranks=new.ranks, rank=new.rank, calls=check_every_collective(new, seed=5))
tw.barrier()
report(done=True)
"""


@pytest.mark.timeout(60)
def test_lowest_member_dies_while_deciding() -> None:
    """Rank 3 dies; in the survivors' agreement rank 0 (the lowest member) reports to rank 1
    alone, sends rank 1 alone a decision unlike anyone's candidate, and dies. Rank 1's candidate
    is {3}, rank 2's {0, 3} (rank 0 never reported to it), yet they must decide alike: rank 2
    adopts rank 1's decision, whichever rank 1 took. The group they build still holds a dead
    rank, fails its setup, and is shrunk again, to [1, 2]. Had they kept their candidates they
    would set up different groups and wait for each other until the timeout."""
    finals = _survivors_ok(_job(_LOWEST_DIES_DECIDING, 4, "shm"), {0, 3})
    for rank in (1, 2):
        res = finals[rank]
        assert res["ranks"] == [1, 2] and res["rank"] == rank - 1 and res["calls"] >= 60, res


# ------------------------------------------------------------------------------ no failure, no agreement

_NOTHING_FAILED = """
world = tw.init(rank=rank, world_size=size, init_method=URL)
pair = tw.new_group([0, 2])
same = tw.shrink()  # nobody failed: an equivalent world
y = np.full(3, rank + 1.0)
world.all_reduce(y)  # the old world still works
report(ranks=same.ranks, rank=same.rank, new_ctx=same.ctx != world.ctx, old=y.tolist(),
       calls=check_every_collective(same, seed=3),
       names=[same.name, same.shrink().shrink().name, world.shrink().name])
if rank in (0, 2):
    sub = pair.shrink()
    report(sub=sub.ranks, sub_rank=sub.rank, sub_calls=check_every_collective(sub, seed=4))
tw.barrier()
report(done=True)
"""


@pytest.mark.timeout(60)
def test_shrink_when_nothing_failed_returns_an_equivalent_group() -> None:
    """Every member shrinks though no rank failed: the same members in the same order, a new
    context, every collective right on it, and the old group still usable (world and
    subgroup alike)."""
    finals = _survivors_ok(_job(_NOTHING_FAILED, 3, "shm"), set())
    for rank, res in enumerate(finals):
        assert res["ranks"] == [0, 1, 2] and res["rank"] == rank and res["new_ctx"], res
        assert res["old"] == [6.0] * 3 and res["calls"] >= 60, res
        # one suffix, however many shrinks; world's second shrink is not named as its first's shrink
        assert res["names"] == ["world.shrink1", "world.shrink3", "world.shrink4"], res
        if rank != 1:
            assert res["sub"] == [0, 2] and res["sub_rank"] == rank // 2 and res["sub_calls"] >= 60, res


_LATE = """
tw.init(rank=rank, world_size=size, init_method=URL)
tw.barrier()
if rank == 2:
    os._exit(3)
if rank == 1:
    time.sleep(4)  # alive, but calls shrink only after rank 0's first one timed out
time.sleep(0.5)
if rank == 0:
    report(shrink=outcome(tw.shrink, timeout=2))
new = tw.shrink()  # rank 0: again
y = np.full(5, rank + 1.0)
new.all_reduce(y)
report(ranks=new.ranks, rank=new.rank, sum=y.tolist())
tw.barrier()
report(done=True)
"""


@pytest.mark.timeout(60)
def test_shrink_names_a_late_rank_and_a_retry_meets_it() -> None:
    """Rank 2 dies; rank 1 lives on and calls shrink late: rank 0's shrink ends with a
    TimeoutError within its timeout, naming rank 1 and saying every survivor must call it;
    rank 0 calls shrink again, which goes on where the first stopped and meets rank 1's."""
    finals = _survivors_ok(_job(_LATE, 3, "tcp"), {2})
    shrink = finals[0]["shrink"]
    assert shrink["type"] == "TimeoutError" and 1.9 < shrink["t"] < 5, shrink
    assert re.search(r"rank\(s\) 1 did not send", shrink["msg"]), shrink["msg"]
    assert "every surviving member must call shrink()" in shrink["msg"], shrink["msg"]
    for rank in (0, 1):
        res = finals[rank]
        assert res["ranks"] == [0, 1] and res["rank"] == rank and res["sum"] == [3.0] * 5, res


_DONE_THEN_CRASHES = """
tw.init(rank=rank, world_size=size, init_method=URL)
tw.barrier()
if rank == 1:
    time.sleep(float(ARGS[0]))  # late: rank 0 sees rank 2 crash while it waits for this one
x = np.full(3, rank + 1.0)
tw.reduce(x, dst=0)
if rank == 2:
    os._exit(3)  # its part is done, and it leaves without a goodbye
report(x=x.tolist())
tw.shrink().barrier()
report(done=True)
"""


@pytest.mark.timeout(60)
def test_a_member_that_crashes_after_its_part_does_not_fail_the_call() -> None:
    """Rank 2 sends its part of a reduce to rank 0 and dies at once, while rank 1 is still on
    its way: rank 0's reduce finishes with every part (what it waits for is alive), and the
    survivors shrink as usual."""
    from tensorwire.transport.failures import _CRASH_GRACE_S
    finals = _survivors_ok(_job(_DONE_THEN_CRASHES, 3, "tcp", _CRASH_GRACE_S / 2), {2})
    assert finals[0]["x"] == [6.0] * 3, finals[0]


# ------------------------------------------------------------------------------ tensorwire run --keep-going

_KEEP_GOING = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
import tensorwire as tw
from soak import check_every_collective
tw.init()
tw.barrier()
if tw.get_rank() == 1:
    os._exit(7)
x = np.ones(4)
try:
    while True:
        tw.all_reduce(x)
except tw.TensorwireError:
    pass
tw.shrink()
check_every_collective(tw.world(), seed=1)
print(f"survivor {tw.world().ranks[tw.get_rank()]} done as rank {tw.get_rank()} of {tw.get_world_size()}",
      flush=True)
"""


@pytest.mark.timeout(90)
def test_launcher_keep_going_lets_survivors_finish(tmp_path: Path) -> None:
    """Under `tensorwire run --keep-going` a rank's death does not stop the others: they shrink,
    finish their work and exit 0; the launcher waits for them, reports the failed rank and
    exits with its code."""
    script = tmp_path / "survive.py"
    script.write_text(textwrap.dedent(_KEEP_GOING))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_")}
    env.update(TENSORWIRE_TIMEOUT="20", TENSORWIRE_CALIBRATE="0", TENSORWIRE_LAUNCH_GRACE="0.2")
    proc = subprocess.run([sys.executable, "-m", "tensorwire", "run", "-n", "3", "--keep-going", str(script),
                           str(TESTS)], capture_output=True, text=True, timeout=80, env=env)
    assert proc.returncode == 7, proc.stdout + proc.stderr
    for line in ("survivor 0 done as rank 0 of 2", "survivor 2 done as rank 1 of 2"):
        assert line in proc.stdout, proc.stdout + proc.stderr
    assert re.search(r"rank 1 \(local rank 1, pid \d+\) failed first: exit code 7", proc.stderr), proc.stderr
    assert proc.stderr.count(": exit code 0") == 2, proc.stderr


# ------------------------------------------------------------------------------ torchrun --max-restarts

@pytest.mark.timeout(120)
def test_elastic_restart_resumes_from_checkpoint(tmp_path: Path) -> None:
    """examples/elastic_train.py under `torchrun --max-restarts 1` on the tensorwire backend: rank
    1 is killed (os._exit) at step 12 of the first attempt; torchrun restarts both ranks, which
    resume from the checkpoint of step 10 and end with the weights of a run that never failed
    (the example replays the training in one process and compares)."""
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "TENSORWIRE_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TENSORWIRE_TIMEOUT="30", TENSORWIRE_CALIBRATE="0")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "1", "--monitor-interval", "0.2", str(REPO / "examples" / "elastic_train.py"),
            "--steps", "20", "--checkpoint-every", "5", "--checkpoint", str(tmp_path / "ckpt.pt"),
            "--kill-rank", "1", "--kill-at", "12"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=110, env=env, cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-3000:]}\n{proc.stderr[-5000:]}"
    assert "rank 1: killed at step 12 (attempt 0)" in out, out
    assert "resumed from step 10 (attempt 1)" in out, out
    assert "equal to a run without failures: True" in out, out


_NATIVE_ATTEMPT = """\
import os
import numpy as np
import tensorwire as tw
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
world = tw.init()
x = np.ones(4, np.float32)
tw.all_reduce(x)
if attempt == 0 and world.rank == 1:
    os._exit(3)
tw.barrier()
tw.all_reduce(x)
print(f"rank {world.rank} attempt {attempt}: {x[0]:g}", flush=True)
"""


@pytest.mark.timeout(120)
def test_native_init_under_torchrun_restarts_afresh(tmp_path: Path) -> None:
    """`tw.init()` (no torch backend) under `torchrun --max-restarts 1`: the agent's store
    outlives the first attempt, whose roster must not make the second's ranks 'join twice'."""
    pytest.importorskip("torch")
    script = tmp_path / "attempt.py"
    script.write_text(_NATIVE_ATTEMPT)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "TENSORWIRE_")) and k not in
           ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", TENSORWIRE_TIMEOUT="30", TENSORWIRE_CALIBRATE="0")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "1", "--monitor-interval", "0.2", str(script)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=110, env=env, cwd=tmp_path)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    for rank in (0, 1):
        assert f"rank {rank} attempt 1: 4" in proc.stdout, proc.stdout + proc.stderr[-3000:]


_SOME_DIE = """
dead = {int(r) for r in ARGS[0].split(",")}
tw.init(rank=rank, world_size=size, init_method=URL)
x = np.ones(4, np.float32)
tw.barrier()
if rank in dead:
    time.sleep(0.3)
    os._exit(3)
failure = until_failure(lambda: tw.all_reduce(x))
res = outcome(tw.shrink, majority=True)
if res["type"] is None:
    tw.all_reduce(x)
    res["sum"] = float(x[0])
report(shrink=res, done=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("dead", ["0", "1,2", "0,1", "1,2,3"])
def test_shrink_with_majority_goes_on_only_with_more_than_half(dead: str) -> None:
    """shrink(majority=True): the survivors go on where they are more than half of the group, or
    half with its first rank; else they raise (of the two sides of a network partition, one
    goes on and the other stops, where without it each shrinks to itself)."""
    size, killed = 4, {int(r) for r in dead.split(",")}
    reports = [_final(r) for r in _job(_SOME_DIE, size, "shm", dead)]
    survivors = [r for r in range(size) if r not in killed]
    goes_on = 2 * len(survivors) > size or 2 * len(survivors) == size and 0 in survivors
    for r in survivors:
        res = reports[r]["shrink"]
        if goes_on:
            assert res["type"] is None and res["sum"] == len(survivors), (r, reports[r])
        else:
            assert res["type"] == "AbortedError" and "not a majority of its 4 members" in res["msg"], res
    for r in killed:
        assert reports[r]["rc"] != 0


_LEAVES_AFTER_A_LOSS = """
tw.init(rank=rank, world_size=size, init_method=URL)
x = np.zeros(4)
if rank == 2:
    tw.send(np.ones(4), 1)
    time.sleep(0.3)
    os._exit(3)
if rank == 1:  # loses rank 2, then leaves
    tw.recv(x, 2)
    report(one=outcome(tw.recv, x, 2, tag=5, timeout=20))
    tw.destroy()
else:  # never talked to rank 2: learns of it from rank 1's goodbye
    report(zero=outcome(tw.recv, x, 1, tag=6, timeout=20))
report(done=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_rank_that_leaves_after_a_loss_names_the_rank_lost(transport: str) -> None:
    """Rank 1 loses rank 2 and leaves; rank 0, which never talked to rank 2, loses rank 1 for
    leaving: its error names rank 2 too, from rank 1's goodbye (it blamed rank 1 alone)."""
    reports = [_final(r) for r in _job(_LEAVES_AFTER_A_LOSS, 3, transport)]
    assert "lost rank 2" in reports[1]["one"]["msg"], reports[1]
    msg = reports[0]["zero"]["msg"]
    assert reports[0]["zero"]["type"] == "PeerLostError" and "lost rank 1: it left the job" in msg, msg
    assert "it had lost rank 2 (" in msg, msg


_ANY_AFTER_A_LOSS = """
tw.init(rank=rank, world_size=size, init_method=URL)
tw.barrier()
if rank == 1:
    os._exit(3)
time.sleep(1.0)
works = []
for _ in range(3):  # each posts and fails alone: none is left holding the next one's turn
    works.append(outcome(lambda: tw.irecv_any(np.zeros(4, np.float32), tag=5, timeout=15).wait(20)))
report(works=works, done=True)
"""


@pytest.mark.timeout(60)
def test_receives_from_any_rank_after_every_sender_is_gone_fail_at_once() -> None:
    """An irecv_any posted after its senders died returns a Work that fails with PeerLostError at
    once, each of several in a row (the quick path raised from the call and kept its turn, so
    the next one waited out its timeout), naming the senders lost."""
    works = _final(_job(_ANY_AFTER_A_LOSS, 2, "shm")[0])["works"]
    for w in works:
        assert w["type"] == "PeerLostError" and w["t"] < 5 and "lost rank 1" in w["msg"], works
