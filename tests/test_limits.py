"""Exhausted limits: a small or full /dev/shm degrades (never a SIGBUS), and running out of
descriptors or memory is a clear error on every rank (never a hang).

The /dev/shm cases run real jobs (`tensorwire run`) in a private mount namespace with a small
tmpfs of their own on /dev/shm (root, or a user namespace that allows mounts; skipped otherwise).
"""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tensorwire import limits
from tensorwire.errors import ResourceError
from tensorwire.transport import shm_budget
from tensorwire.transport.segment import GroupSegment
from tensorwire.transport.shm_segments import Ring

MiB = 1 << 20

JOB = """\
import json, os, subprocess, sys
import numpy as np
import tensorwire as tw

world = tw.init()
rank, n = world.rank, world.size
rng = np.random.default_rng(rank)


def check(group, sizes=(1, 1000, 70_000, 600_000, 1 << 20)):
    me, size = group.rank, group.size
    for count in sizes:  # past the rings, the slots and the pipeline's pieces
        data = [np.random.default_rng(100 * r + count).standard_normal(count).astype(np.float32)
                for r in range(size)]
        x = data[me].copy()
        group.all_reduce(x)
        np.testing.assert_allclose(x, np.sum(data, axis=0), rtol=1e-5, atol=1e-4)
        out = np.empty(count * size, dtype=np.float32)
        group.all_gather_into_tensor(out, data[me])
        np.testing.assert_array_equal(out, np.concatenate(data))
        y = data[0].copy() if me == 0 else np.empty(count, dtype=np.float32)
        group.broadcast(y, 0)
        np.testing.assert_array_equal(y, data[0])
        ins = np.arange(count * size, dtype=np.float32) + 1e6 * me
        outs = np.empty_like(ins)
        group.all_to_all_single(outs, ins)
        want = np.concatenate([np.arange(count * me, count * (me + 1), dtype=np.float32) + 1e6 * r
                               for r in range(size)])
        np.testing.assert_array_equal(outs, want)
    for count in (10, 300_000):  # point to point, small and past the rings
        got = np.empty(count, dtype=np.float64)
        sent = group.isend(np.full(count, float(me)), (me + 1) % size)
        group.recv(got, (me - 1) % size)
        sent.wait()
        assert (got == (me - 1) % size).all()
    group.barrier()


def facts(group):
    kinds = {r: getattr(c, "kind", "") for r, c in group.engine.channels.items()}
    rings = sorted({group.engine.channels[r].out.capacity for r, kind in kinds.items() if kind == "shm"})
    return {"rings": rings, "tcp": sorted(r for r, kind in kinds.items() if kind != "shm"),
            "slot": group.direct.slot_bytes if group.direct is not None else 0, "all_local": group.all_local}


check(world)  # pairs connect, and make their rings, as they first talk
report = {"rank": rank, "world": facts(world)}
if os.environ.get("FILL_AFTER_INIT"):
    world.barrier()
    if rank == 0:  # another program takes what is left of /dev/shm
        st = os.statvfs("/dev/shm")
        subprocess.run(["fallocate", "-l", str(st.f_bavail * st.f_frsize), "/dev/shm/eater"], check=True)
        from tensorwire.transport.shm_segments import Ring
        try:
            Ring.create("tw-test-full", 1 << 20)
            report["reserve"] = "made a ring in a full /dev/shm"
        except OSError as exc:
            report["reserve"] = exc.errno
        report["left"] = sorted(os.listdir("/dev/shm"))
    world.barrier()
    sub = world.new_group([0, 1, 2])
    if sub.is_member:
        check(sub)
        report["new_group"] = facts(sub)
    part = world.split(rank % 2)
    check(part)
    report["split"] = facts(part)
    world.barrier()
print("REPORT " + json.dumps(report), flush=True)
tw.destroy()
"""


def _namespaces_work() -> str:
    """'' where this process may mount a tmpfs in a private mount namespace, else why not."""
    try:
        probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                                "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                               capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare unavailable: {exc}"
    return "" if probe.returncode == 0 else \
        f"cannot mount a tmpfs in a mount namespace: {probe.stderr.strip()}"


_WHY_NOT = _namespaces_work() if sys.platform == "linux" else "Linux only"
needs_namespace = pytest.mark.skipif(bool(_WHY_NOT), reason=_WHY_NOT)


def _job_on_small_shm(tmp_path: Path, size: str, np_: int = 4, fill: int = 0,
                      env: dict[str, str] | None = None, timeout: float = 150, job: str = JOB,
                      before: str = "", after: str = "", run_args: tuple[str, ...] = ()):
    """Run `job` with `np_` ranks on a private /dev/shm mounted with options `size`, `fill` bytes
    of it taken first, shell commands `before` and `after` it: (exit code, per-rank reports,
    stderr, the files left in /dev/shm after)."""
    script = tmp_path / "job.py"
    script.write_text(job)
    prefill = f"fallocate -l {fill} /dev/shm/eater && " if fill else ""
    shell = (f"mount -t tmpfs -o size={size} tmpfs /dev/shm && {prefill}{before}"
             f'"$@"; rc=$?; {after}echo "LEFT $(ls -A /dev/shm | grep -v eater | tr "\\n" " ")"; exit $rc')
    run_env = {**os.environ, "TENSORWIRE_CALIBRATE": "0", "TENSORWIRE_TIMEOUT": "60", **(env or {})}
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", shell, "sh",
                           sys.executable, "-m", "tensorwire", "run", *run_args, "-n", str(np_), str(script)],
                          capture_output=True, text=True, timeout=timeout, env=run_env)
    reports = {}
    left = None
    for line in proc.stdout.splitlines():
        if line.startswith("REPORT "):
            report = json.loads(line[7:])
            reports[report["rank"]] = report
        elif line.startswith("LEFT"):
            left = line.split()[1:]
    return proc.returncode, reports, proc.stderr, left


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "TensorwireWarning" in line]


@needs_namespace
def test_small_dev_shm_shrinks_rings_and_slots(tmp_path: Path) -> None:
    """16 MiB of /dev/shm for 4 ranks, which wanted 56: it lost two ranks to SIGBUS before.
    Now rings and slots shrink to fit half of it, results are right, one warning says why."""
    rc, reports, stderr, left = _job_on_small_shm(tmp_path, "16m")
    assert rc == 0, stderr
    assert sorted(reports) == [0, 1, 2, 3], stderr
    for report in reports.values():
        world = report["world"]
        assert world["tcp"] == [] and world["all_local"]
        assert world["rings"] and max(world["rings"]) < 4 * MiB  # shrunk, but rings
        assert 0 < world["slot"] < MiB
    warned = _warnings(stderr)
    assert len(warned) == 1, stderr
    assert "/dev/shm holds 16 MiB" in warned[0] and "--shm-size=128m" in warned[0]
    assert "TENSORWIRE_SHM_RING=" in warned[0]
    assert left == []  # every segment unlinked


@needs_namespace
def test_no_room_for_rings(tmp_path: Path) -> None:
    """2 MiB left: the first rings toward every local peer would take more than half, so every
    pair talks over TCP, and the one-shot segment still fits, with small slots."""
    rc, reports, stderr, left = _job_on_small_shm(tmp_path, "16m", fill=14 * MiB)
    assert rc == 0, stderr
    assert sorted(reports) == [0, 1, 2, 3], stderr
    for rank, report in reports.items():
        world = report["world"]
        assert world["rings"] == [] and world["tcp"] and rank not in world["tcp"]
        assert not world["all_local"] and world["slot"] == shm_budget.SLOT_FLOOR
    warned = _warnings(stderr)
    assert len(warned) == 1, stderr
    assert "TCP for the pairs of ranks whose rings did not fit (12 of 12 rings" in warned[0]
    assert "one-shot slots of 64 KiB" in warned[0]
    assert "TENSORWIRE_SHM_RING" not in warned[0]  # no setting fixes it: only more /dev/shm
    assert left == []


@needs_namespace
def test_full_dev_shm_pairs_agree_on_tcp(tmp_path: Path) -> None:
    """A tmpfs with inodes for 7 files: the world's segment takes one, and rings are made as
    pairs first talk, in whatever order the ranks get there, until the inodes run out, so a
    pair may have a ring one way and not the other; both sides must fall back together (a hang
    otherwise), with a warning from the ranks /dev/shm refused, and every rank must price the
    same tier (what it planned at init: the fallback is the pair's own business)."""
    rc, reports, stderr, left = _job_on_small_shm(tmp_path, "64m,nr_inodes=8")
    assert rc == 0, stderr
    assert sorted(reports) == [0, 1, 2, 3], stderr
    tcp = {r: set(report["world"]["tcp"]) for r, report in reports.items()}
    assert any(tcp.values()) and not all(len(peers) == 3 for peers in tcp.values())
    for r, peers in tcp.items():
        assert all(r in tcp[p] for p in peers)  # pairs agree
    assert len({report["world"]["all_local"] for report in reports.values()}) == 1
    assert len({report["world"]["slot"] for report in reports.values()}) == 1
    refused = [w for w in _warnings(stderr) if "it refused a ring" in w]
    assert refused and all("No space left on device" in w for w in refused), stderr
    assert left == []


@needs_namespace
def test_dev_shm_filled_after_init(tmp_path: Path) -> None:
    """Another program fills /dev/shm after init: the reserved rings keep working, a segment can
    no longer be had (and a failed reservation leaves no file), so new groups take the message
    path, with one more warning for the first of them."""
    rc, reports, stderr, left = _job_on_small_shm(tmp_path, "64m", env={"FILL_AFTER_INIT": "1"})
    assert rc == 0, stderr
    assert sorted(reports) == [0, 1, 2, 3], stderr
    assert reports[0]["reserve"] == errno.ENOSPC
    assert reports[0]["left"] == ["eater"]
    for rank, report in reports.items():
        assert report["world"]["slot"] > 0
        assert report["split"]["slot"] == 0 and report["split"]["all_local"]
        if rank < 3:
            assert report["new_group"]["slot"] == 0
    warned = _warnings(stderr)
    assert len(warned) == 2, stderr  # the rings at init (64 MiB wanted 56), the segment later
    assert "no one-shot segment" in warned[1] and "rings of" not in warned[1]
    assert left == []


GROUPS_JOB = """\
import gc, json, os
import numpy as np
import tensorwire as tw

world = tw.init()
x = np.ones(1000, dtype=np.float32)


def used():
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def cycle(end):
    g = tw.new_group()
    g.all_reduce(x)
    g.all_reduce(x, async_op=True).wait()  # its worker thread too
    slot = g.direct.slot_bytes if g.direct is not None else 0
    if end == "destroy":
        g.destroy()
    else:
        del g
        gc.collect()
    world.barrier()  # every rank let go of it
    return slot, used()


world.all_reduce(x)
base = used()
report = {"rank": world.rank, "base": base}
for end in ("gc", "destroy"):
    report[end] = [cycle(end) for _ in range(8)]
print("REPORT " + json.dumps(report), flush=True)
tw.destroy()
"""


@needs_namespace
def test_groups_give_their_segment_back(tmp_path: Path) -> None:
    """Groups made and left again and again on a 16 MiB /dev/shm, by garbage collection and by
    destroy(): each gets the whole slot the first got, and /dev/shm is back where it was after
    each (they kept their segments for good before: the third had less, the fifth none)."""
    rc, reports, stderr, left = _job_on_small_shm(tmp_path, "16m", np_=2, job=GROUPS_JOB)
    assert rc == 0, stderr
    assert sorted(reports) == [0, 1], stderr
    for report in reports.values():
        slot = report["gc"][0][0]
        assert slot > 0
        for end in ("gc", "destroy"):
            assert report[end] == [[slot, report["base"]]] * 8, (end, report)
    assert left == []


SETUP_CRASH_JOB = """\
import json, os, signal
import tensorwire as tw
from tensorwire.transport.segment import GroupSegment

world = tw.init()
world.barrier()
if world.rank == 0:  # killed right after it made the group's segment, before anyone mapped it
    made = GroupSegment.create

    def make_and_die(*args):
        made(*args)
        os.kill(os.getpid(), signal.SIGKILL)

    GroupSegment.create = make_and_die
try:
    tw.new_group()
    error = ""
except tw.TensorwireError as exc:
    error = type(exc).__name__
print("REPORT " + json.dumps({"rank": world.rank, "error": error}), flush=True)
"""


@needs_namespace
def test_rank_killed_in_group_setup_leaves_no_segment(tmp_path: Path) -> None:
    """Rank 0 is SIGKILLed between making a new group's segment and anyone mapping it: the
    survivors fail with PeerLostError and unlink it (it stayed in /dev/shm for good before)."""
    rc, reports, stderr, left = _job_on_small_shm(tmp_path, "64m", np_=3, job=SETUP_CRASH_JOB,
                                                  run_args=("--keep-going",))
    assert rc != 0 and "rank 0" in stderr and "SIGKILL" in stderr, stderr
    assert sorted(reports) == [1, 2], stderr
    assert all(report["error"] == "PeerLostError" for report in reports.values()), reports
    assert left == []


WHOLE_CRASH_JOB = """\
import os, signal
import tensorwire as tw
from tensorwire.group import shm_setup
from tensorwire.transport.segment import GroupSegment

world = tw.init()
world.barrier()


def die(*args):
    os.kill(os.getpid(), signal.SIGKILL)


if world.rank == 0:  # killed right after it made the group's segment
    made = GroupSegment.create

    def make_and_die(*args):
        made(*args)
        die()

    GroupSegment.create = make_and_die
else:  # killed as it would learn the segment's name: nobody is left to unlink it
    shm_setup.binomial_broadcast = die
tw.new_group()
"""


@needs_namespace
def test_job_killed_in_group_setup_leaves_no_segment(tmp_path: Path) -> None:
    """Every rank is SIGKILLed during a group's setup, the segment made and nobody left to
    unlink it: `tensorwire run` removes it once its ranks are gone (it stayed before)."""
    rc, _, stderr, left = _job_on_small_shm(tmp_path, "64m", np_=2, job=WHOLE_CRASH_JOB,
                                            run_args=("--keep-going",))
    assert rc != 0 and stderr.count("SIGKILL") >= 2, stderr
    assert left == []


STALE_JOB = """\
import json, os
import tensorwire as tw

world = tw.init()
print("REPORT " + json.dumps({"rank": world.rank, "shm": sorted(os.listdir("/dev/shm"))}), flush=True)
tw.destroy()
"""
_MAKE = ("from tensorwire.transport.shm_segments import Ring; import os, sys; "
         "Ring.create(sys.argv[1], 1 << 16); ")


@needs_namespace
def test_job_start_removes_segments_of_exited_processes(tmp_path: Path) -> None:
    """A segment whose maker exited without unlinking it (a job killed whole) is removed when
    the next job starts; one whose maker still runs is kept."""
    py = sys.executable
    before = (f"{py} -c '{_MAKE}os._exit(0)' tw-gone; "
              f"{py} -c '{_MAKE}os.execvp(\"sleep\", [\"sleep\", \"100\"])' tw-alive & live=$!; "
              f"until ls /dev/shm/tw-alive-* >/dev/null 2>&1; do sleep 0.05; done; ls /dev/shm/tw-gone-* && ")
    rc, reports, stderr, left = _job_on_small_shm(tmp_path, "16m", np_=2, job=STALE_JOB, before=before,
                                                  after="kill $live; ")
    assert rc == 0, stderr
    assert sorted(reports) == [0, 1], stderr
    for report in reports.values():
        made = [n.rsplit("-", 1)[0] for n in report["shm"] if n.startswith(("tw-gone", "tw-alive"))]
        assert made == ["tw-alive"], report
    assert [n.rsplit("-", 1)[0] for n in left] == ["tw-alive"]


def test_a_segment_left_without_its_owner_record_is_removed_once_old(tmp_path: Path) -> None:
    """A creator killed between making a segment and writing its owner record leaves an empty
    file that says nothing of who made it: removed once older than a live creator could
    take, kept before (it may be a live job's segment a microsecond old)."""
    from tensorwire.transport import shm_segments

    old, new = tmp_path / "tw-old", tmp_path / "tw-new"
    old.touch()
    new.touch()
    long_ago = time.time() - 2 * shm_segments._UNWRITTEN_S
    os.utime(old, (long_ago, long_ago))
    assert shm_segments.remove_stale(str(tmp_path)) == (1, 0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tw-new"]


def test_only_this_users_segments_are_removed(tmp_path: Path) -> None:
    """Files named like segments that tensorwire did not make (a short file, text), or another
    user's (an empty one, or a segment whose creator is gone) are never removed: a root job
    must not delete what others keep in /dev/shm."""
    from tensorwire.transport import shm_segments

    theirs = tmp_path / "tw-theirs"  # a segment whose creator has exited
    subprocess.run([sys.executable, "-c", "from tensorwire.transport import shm_segments; import os, sys; "
                    "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); "
                    "os.pwrite(fd, shm_segments._owner(), shm_segments._OWNER_AT); "
                    "os.ftruncate(fd, 1 << 16)", str(theirs)],
                   check=True, timeout=60)
    (tmp_path / "tw-notes.txt").write_text("my notes\n")
    (tmp_path / "tw-short").write_bytes(bytes(100))
    (tmp_path / "tw-other-empty").touch()
    long_ago = time.time() - 2 * shm_segments._UNWRITTEN_S
    for p in tmp_path.iterdir():
        os.utime(p, (long_ago, long_ago))
    if os.geteuid() == 0:
        os.chown(tmp_path / "tw-other-empty", 65534, 65534)
        os.chown(theirs, 65534, 65534)
    else:  # not root: the files are this user's, and only the two that tensorwire left go
        (tmp_path / "tw-other-empty").rename(tmp_path / "tw-empty")
    removed, _ = shm_segments.remove_stale(str(tmp_path))
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == (["tw-notes.txt", "tw-other-empty", "tw-short", "tw-theirs"] if os.geteuid() == 0
                    else ["tw-notes.txt", "tw-short"]), kept
    assert removed == (0 if os.geteuid() == 0 else 2)


def test_plans_fit_half_the_free_space() -> None:
    """The plan connect.connect_world makes: a rank's share of half the free space after the
    world's segment (ring_share), and how far its rings may grow within it (plan_rings)."""
    def plan(free: int, local: int, ring: int = 4 * MiB) -> tuple[int, int, int]:
        share = shm_budget.ring_share(free, local, local, MiB)  # the job alone on this host
        return share, shm_budget.plan_rings(share, local, ring), shm_budget.plan_slot(free, local, MiB)

    # 4 ranks, the defaults (4 MiB rings, 1 MiB slots); docs/design/shm-degradation.md's figures
    assert plan(1 << 30, 4)[1:] == (4 * MiB, MiB)
    assert plan(64 * MiB, 4)[1:] == (MiB, MiB)
    assert plan(16 * MiB, 4)[1:] == (256 << 10, 512 << 10)
    assert plan(2 * MiB, 4)[1:] == (0, 64 << 10)  # TCP, the segment gets the space
    assert plan(16 * MiB, 8)[1] == shm_budget.INITIAL_RING  # first rings only: not even the floor fits
    for free in (2 * MiB, 16 * MiB, 64 * MiB, 100 * MiB, 1 << 30):
        for local in (2, 4, 8, 32):
            share, ring, slot = plan(free, local)
            busy = min(limits.typical_peers(local), local - 1)
            first = shm_budget.INITIAL_RING
            rings = busy * Ring.nbytes(ring) + (local - 1 - busy) * Ring.nbytes(first) if ring else 0
            assert rings <= share, (free, local)
            if share:  # else even the segment's floor takes more than half: it gets the space
                assert local * share + GroupSegment.nbytes(local, slot) <= free // 2, (free, local)
            assert ring in (0, first) or (ring >= shm_budget.RING_FLOOR and ring % 4096 == 0)
    assert shm_budget.plan_rings(shm_budget.ring_share(16 * MiB, 4), 4, 64 << 10) == 64 << 10  # as asked
    assert shm_budget.plan_rings(MiB, 1, 4 * MiB) == 4 * MiB  # no local peer: nothing to plan
    assert shm_budget.plan_slot(0, 4, 16 << 10) == 16 << 10  # never grown to the floor


def test_shrinking_halves_only_for_want_of_space() -> None:
    tried = []

    def make(nbytes: int) -> int:
        tried.append(nbytes)
        if nbytes > 256 << 10:
            raise OSError(errno.ENOSPC, "No space left on device")
        return nbytes

    assert shm_budget.shrinking(make, MiB, 64 << 10) == (256 << 10, errno.ENOSPC)
    assert tried == [MiB, 512 << 10, 256 << 10]
    assert shm_budget.shrinking(make, MiB, 512 << 10) == (None, errno.ENOSPC)

    def denied(nbytes: int) -> int:
        raise OSError(errno.EACCES, "Permission denied")

    assert shm_budget.shrinking(denied, MiB, 64 << 10) == (None, errno.EACCES)
    assert Ring.nbytes(MiB) == MiB + 4096


def test_exhausted_limits_are_named() -> None:
    text = str(limits.translate(OSError(errno.EMFILE, "Too many open files"), "rank 3: init"))
    assert text.startswith("rank 3: init: out of file descriptors (ulimit -n is ")
    assert "ip_local_port_range" in str(limits.translate(OSError(errno.EADDRNOTAVAIL, "x"), "rank 1"))
    assert "fs.file-max" in str(limits.translate(OSError(errno.ENFILE, "x"), "rank 1"))
    assert limits.translate(OSError(errno.ECONNREFUSED, "x"), "rank 1") is None
    assert "out of memory" in str(limits.memory_error(MemoryError("Unable to allocate"), "rank 0: x"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY:
        with pytest.raises(ResourceError, match=f"ulimit -n is {soft}"):
            limits.ensure_descriptors(hard + 1, "rank 0: init", "a test")


FD_JOB = """\
import json, os, resource, sys
import tensorwire as tw
rank = int(os.environ["RANK"])
soft, hard = (int(v) for v in os.environ["FD_LIMIT"].split(","))
if str(rank) in os.environ["FD_RANKS"].split(","):
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
try:
    world = tw.init()
    world.barrier()
    soft_now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    print("RESULT " + json.dumps({"rank": rank, "ok": soft_now}), flush=True)
except tw.TensorwireError as exc:
    print("RESULT " + json.dumps({"rank": rank, "error": type(exc).__name__, "text": str(exc)}), flush=True)
    sys.exit(1)
"""


def _job(tmp_path: Path, source: str, env: dict[str, str], *args: str, ranks: int = 2,
         preexec_fn: Callable[[], None] | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """`source` run by `tensorwire run -n ranks` with `args`, `env` over this process's and
    no calibration (well under 90 s, or the test fails): the launcher's process, and each
    rank's 'RESULT {json}' line read."""
    script = tmp_path / "job.py"
    script.write_text(source)
    proc = subprocess.run([sys.executable, "-m", "tensorwire", "run", "-n", str(ranks), str(script), *args],
                          capture_output=True, text=True, timeout=90, preexec_fn=preexec_fn,
                          env={**os.environ, "TENSORWIRE_CALIBRATE": "0", **env})
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
            results[result["rank"]] = result
    return proc, results


def _fd_job(tmp_path: Path, np_: int, limit: str, ranks: str, launcher_limit: int = 0):
    def cap() -> None:
        if launcher_limit:
            resource.setrlimit(resource.RLIMIT_NOFILE, (launcher_limit, launcher_limit))

    # well under the init timeout (300 s): an error that came from a timeout would fail here
    return _job(tmp_path, FD_JOB, {"TENSORWIRE_TIMEOUT": "300", "FD_LIMIT": limit, "FD_RANKS": ranks},
                ranks=np_, preexec_fn=cap)


def test_descriptor_limit_fails_every_rank(tmp_path: Path) -> None:
    """Two of six ranks cannot open the descriptors full-mesh wiring needs: each says which
    limit, and every other rank fails with their reason instead of waiting for them."""
    proc, results = _fd_job(tmp_path, 6, "14,14", "2,4")
    assert proc.returncode != 0
    assert sorted(results) == list(range(6)), proc.stderr
    for rank, result in results.items():
        assert result.get("error") == "ResourceError", result
        if rank in (2, 4):
            assert result["text"].startswith(f"rank {rank}: init: out of file descriptors: ulimit -n is 14")
        else:
            assert "cannot join" in result["text"] and "ulimit -n is 14" in result["text"]


def test_descriptor_soft_limit_is_raised(tmp_path: Path) -> None:
    """A soft limit below what wiring needs, under a hard limit that allows it, is raised."""
    proc, results = _fd_job(tmp_path, 4, "12,4096", "0,1,2,3")
    assert proc.returncode == 0, proc.stderr
    assert sorted(results) == [0, 1, 2, 3] and all(r["ok"] > 12 for r in results.values())


def test_launcher_names_its_descriptor_limit(tmp_path: Path) -> None:
    proc, results = _fd_job(tmp_path, 16, "64,64", "", launcher_limit=40)
    assert proc.returncode == 1 and not results
    assert "tensorwire run: out of file descriptors: ulimit -n is 40" in proc.stderr


MEMORY_JOB = textwrap.dedent("""\
    import json, resource, sys
    import numpy as np
    import tensorwire as tw
    tw.init()
    x = np.ones(16 << 20, dtype=np.float32)  # 64 MiB; recursive doubling needs as much again
    blob = bytes(64 << 20)  # ... and its pickle
    if tw.get_rank() == 1:
        with open("/proc/self/status") as f:
            vm = int(next(line for line in f if line.startswith("VmSize")).split()[1]) << 10
        resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), resource.RLIM_INFINITY))
    try:
        if sys.argv[1] == "all_reduce":
            tw.all_reduce(x)
        else:
            tw.all_gather_object([None] * tw.get_world_size(), blob)
        result = {"rank": tw.get_rank(), "error": ""}
    except tw.TensorwireError as exc:
        result = {"rank": tw.get_rank(), "error": type(exc).__name__, "text": str(exc)}
    print("RESULT " + json.dumps(result), flush=True)
""")


@pytest.mark.parametrize("call", ["all_reduce", "all_gather_object"])
def test_out_of_memory_fails_every_rank(tmp_path: Path, call: str) -> None:
    """A call that cannot allocate, a buffer or an object's pickle, is a ResourceError naming
    the limit on every rank (the pickle's was an InvalidArgumentError "cannot pickle")."""
    proc, results = _job(tmp_path, MEMORY_JOB, {"TENSORWIRE_TIMEOUT": "300",
                                                "TENSORWIRE_ALGO": "allreduce:recursive_doubling"}, call)
    assert sorted(results) == [0, 1], proc.stderr
    for result in results.values():
        assert result["error"] == "ResourceError", result
        assert result["text"].startswith(f"rank 1: {call}") and "out of memory" in result["text"]
        assert "ulimit -v" in result["text"] and "out of memory (;" not in result["text"], result


OBJECTS_JOB = textwrap.dedent("""\
    import json, resource
    import tensorwire as tw
    tw.init()
    rank, big = tw.get_rank(), bytes(64 << 20)  # what rank 1 receives: more than it may map
    calls = {
        "all_gather_object": lambda: tw.all_gather_object([None, None], big if rank == 0 else 1),
        "gather_object": lambda: tw.gather_object(big if rank == 0 else 1, [None, None] if rank else None,
                                                  dst=1),
        "broadcast_object_list": lambda: tw.broadcast_object_list([big] if rank == 0 else [None], src=0),
        "scatter_object_list": lambda: tw.scatter_object_list([None], [1, big] if rank == 0 else None, src=0),
    }
    if rank == 1:  # 16 MiB above what it maps: its own objects pickle, what it receives does not fit
        with open("/proc/self/status") as f:
            vm = int(next(line for line in f if line.startswith("VmSize")).split()[1]) << 10
        resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), resource.RLIM_INFINITY))
    out = {"rank": rank}
    for name, call in calls.items():
        try:
            call()
            out[name] = ["", ""]
        except Exception as exc:
            out[name] = [type(exc).__name__, str(exc)]
    print("RESULT " + json.dumps(out), flush=True)
""")


def test_an_object_collectives_receive_buffer_out_of_memory_fails_every_rank(tmp_path: Path) -> None:
    """Where the buffer for the objects a rank receives cannot be allocated, that rank raised a
    raw MemoryError and its peers waited for it (until it exited, or their timeout): now the
    call fails on every rank with a ResourceError naming the limit, as a failed pickle does."""
    proc, results = _job(tmp_path, OBJECTS_JOB, {"TENSORWIRE_TIMEOUT": "20"})
    assert sorted(results) == [0, 1], proc.stderr
    for result in results.values():
        for call in ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list"):
            kind, text = result[call]
            assert kind == "ResourceError", (call, result)
            assert text.startswith(f"rank 1: {call} #") and "out of memory" in text, result
            assert "ulimit -v" in text, result


UNEXPECTED_JOB = textwrap.dedent("""\
    import json, resource
    import numpy as np
    import tensorwire as tw
    tw.init()
    out = {"rank": tw.get_rank(), "errors": []}

    def attempt(fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            out["errors"].append([type(exc).__name__, str(exc)])

    big, small = np.full(64 << 20, 7, np.uint8), np.ones(4, np.uint8)
    if tw.get_rank() == 0:
        attempt(lambda: (tw.send(big, 1, tag=1, timeout=20), tw.send(small, 1, tag=2, timeout=20)))
    else:  # 16 MiB above what it maps: the 64 MiB message that comes first cannot be held
        with open("/proc/self/status") as f:
            vm = int(next(line for line in f if line.startswith("VmSize")).split()[1]) << 10
        resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), resource.RLIM_INFINITY))
        attempt(tw.recv, small, 0, tag=2, timeout=20)
        attempt(tw.recv, big, 0, tag=1, timeout=5)  # the program goes on: its stream is intact
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    attempt(tw.barrier, timeout=20)
    print("RESULT " + json.dumps(out), flush=True)
""")


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_message_that_cannot_be_held_fails_its_group_naming_the_limit(tmp_path: Path,
                                                                       transport: str) -> None:
    """A message that came before its receive and finds no memory to wait in: a raw MemoryError
    on the receiver (a collective's receiver named the limit), and over TCP the stream fell out
    of step, the next receive reading the payload as a header ('rank 0 sent a malformed message
    header'). Now it is dropped, read past, and its group fails on both ranks with a
    ResourceError naming the limit and the message."""
    proc, results = _job(tmp_path, UNEXPECTED_JOB, {"TENSORWIRE_TIMEOUT": "30",
                                                   "TENSORWIRE_TRANSPORT": transport})
    assert sorted(results) == [0, 1], proc.stderr
    said = ("rank 1: out of memory", "ulimit -v", "from rank 0 (point-to-point, tag 1) on group world")
    assert len(results[1]["errors"]) == 3, results  # both receives and the barrier
    for result in results.values():
        assert result["errors"], result
        for kind, text in result["errors"]:
            assert kind == "ResourceError" and all(s in text for s in said), result


THREAD_JOB = textwrap.dedent("""\
    import json, resource, warnings
    import numpy as np
    import tensorwire as tw
    tw.init()
    x = np.ones(4 << 20)
    g = tw.new_group([0, 1])
    tw.barrier()
    out = {"rank": tw.get_rank()}
    if tw.get_rank() == 1:  # 1 MiB above what it maps: no room for a thread's stack
        with open("/proc/self/status") as f:
            vm = int(next(line for line in f if line.startswith("VmSize")).split()[1]) << 10
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 20), resource.RLIM_INFINITY))
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            tw.isend(x, 0).wait()  # its background thread cannot start: it moves as this waits
        out["warned"] = [str(w.message) for w in said]
    else:
        tw.recv(x, 1)
        out["received"] = bool((x == 1).all())
    try:
        g.all_reduce(np.ones(4), async_op=True).wait()  # the group's worker cannot start on rank 1
        out["error"] = ""
    except tw.TensorwireError as exc:
        out["error"], out["text"] = type(exc).__name__, str(exc)
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    tw.destroy()
    print("RESULT " + json.dumps(out), flush=True)
""")


def test_no_memory_for_a_thread_is_a_resource_error_naming_the_limit(tmp_path: Path) -> None:
    """Where a thread cannot start for the memory limits, Python says only RuntimeError "can't
    start new thread" (a tester's isend raised it, and destroy() then failed joining the thread
    never started): the progress thread is done without (a warning naming the limit, the send
    moving as its wait drives it), an async collective's worker is a ResourceError naming the
    limit on every rank, and destroy() works."""
    proc, results = _job(tmp_path, THREAD_JOB, {"TENSORWIRE_TIMEOUT": "30"})
    assert sorted(results) == [0, 1] and proc.returncode == 0, proc.stderr
    assert results[0]["received"], results
    warned = results[1]["warned"]
    assert any("progress thread: out of memory" in w and "ulimit -v" in w for w in warned), results
    for result in results.values():
        assert result["error"] == "ResourceError" and "ulimit -v" in result["text"], result
        assert "group " in result["text"] and "worker: out of memory" in result["text"], result


def test_a_segment_refused_for_descriptors_names_them_not_dev_shm() -> None:
    """A one-shot segment or ring that could not be made for want of file descriptors (EMFILE:
    a tester held every rank at its ulimit -n with half-open connections) is told as that,
    not as /dev/shm being short of space with its fix."""
    from tensorwire.transport.shm_budget import Shortfall

    short = Shortfall(local=2, ring=4 << 20, ring_used=4 << 20, rings=2, refused=0, ring_errno=0,
                      slot=1 << 20, slot_used=0, slot_errno=errno.EMFILE, size=2)
    text = short.describe("rank 0: group g")
    assert "out of file descriptors (ulimit -n is" in text and "no one-shot segment" in text, text
    assert "/dev/shm" not in text, text


def test_connections_still_to_authenticate_take_at_most_an_eighth_of_the_descriptors() -> None:
    """TENSORWIRE_AUTH_PENDING is bounded by the descriptor limit: at ulimit -n 64 a stranger's
    64 half-open connections held every rank at its limit (a tester); an eighth of it now."""
    code = ("import resource; from tensorwire import limits; "
            "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard)); "
            "print(limits.pending_bound(64), limits.pending_bound(4))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["8", "4"]
