#!/usr/bin/env python
"""What init costs a rank as the job grows: descriptors, connections, /dev/shm, store requests
and bytes, counted (not timed) after init, a barrier and a checked 1 MiB all_reduce.

    python bench/wiring_scale.py --np 8 16 32 64 128 [--ulimit 128] [--tcp] [--markdown]

Each job's N ranks run on this host, started as `tensorwire run` starts them, against a store
this script hosts and counts (TCPStoreServer.served: requests and frame bytes per client).
Every rank reports its open descriptors (/proc/self/fd) and channels, and holds still until
all have reported, so /dev/shm's use is the drop of its free space (statvfs) while the whole
job is alive (other programs on a shared machine move it too). `--ulimit N` starts the ranks
with `ulimit -n N`. Inside another launcher (the multi-host test bed) `--in-job` runs one
rank's part:

    python scripts/netns_cluster.py --hosts 16 -n 4 -- bench/wiring_scale.py --in-job

Results: docs/topology.md (Wiring); the reasoning: docs/design/wiring.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

ALL_REDUCE_COUNT = 1 << 18  # float32: 1 MiB


def in_job() -> dict[str, Any]:
    """One rank: init, barrier, a 1 MiB all_reduce checked, an exchange with its ring
    neighbours; then what it holds. Prints it (an @@ line); with WIRING_HOLD set, waits for a
    line on stdin before leaving (the driver measures /dev/shm meanwhile)."""
    import numpy as np

    import tensorwire as tw

    t0 = time.monotonic()
    try:
        return _rank(tw, np, t0)
    except tw.TensorwireError as exc:  # reported, as what a rank that fails says is part of the result
        out = {"rank": int(os.environ.get("RANK", -1)), "ok": False, "error": type(exc).__name__,
               "msg": str(exc), "t": time.monotonic() - t0}
        print("@@" + json.dumps(out), flush=True)
        return out


def _rank(tw: Any, np: Any, t0: float) -> dict[str, Any]:
    world = tw.init()
    init_s = time.monotonic() - t0
    rank, n = world.rank, world.size
    tw.barrier()
    x = np.full(ALL_REDUCE_COUNT, rank + 1, np.float32)
    tw.all_reduce(x)
    ok = bool((x == n * (n + 1) / 2).all())
    if os.environ.get("WIRING_ALL_TO_ALL"):  # an all_to_all of 0 bytes (bench/first_job.py's job)
        tw.all_to_all_single(np.empty(0, np.float32), np.empty(0, np.float32))
    talk = os.environ.get("WIRING_TALK", "")  # "neighbours": the ring's; "all": every rank
    if n > 1 and talk:
        shift = range(1, 2) if talk == "neighbours" else range(1, n)
        for k in shift:
            got = np.empty(4, np.int64)
            sent = world.isend(np.full(4, rank, np.int64), (rank + k) % n)
            world.recv(got, (rank - k) % n)
            sent.wait()
            ok = ok and bool((got == (rank - k) % n).all())
    tw.barrier()  # what a rank holds once the job's traffic settled (a crossing dial's loser reaped)
    engine = world.runtime.engine
    fds = os.listdir("/proc/self/fd")
    links = [os.readlink(f"/proc/self/fd/{fd}") for fd in fds if os.path.exists(f"/proc/self/fd/{fd}")]
    kinds: dict[str, int] = {}
    for channel in engine.channels.values():
        kinds[channel.kind] = kinds.get(channel.kind, 0) + 1
    wiring = engine.wiring
    segment = len(world.direct.seg.bytes) if world.direct is not None and rank == 0 else 0
    out = {"rank": rank, "ok": ok, "init_s": init_s, "fds": len(links),
           "sockets": sum(s.startswith("socket:") for s in links), "channels": kinds,
           "peers": sorted(engine.channels),
           "ring_bytes": wiring.rings.budget.used if wiring is not None else 0,
           "segment_bytes": segment, "rss_kib": _rss_kib()}
    print("@@" + json.dumps(out), flush=True)
    if os.environ.get("WIRING_HOLD"):
        sys.stdin.readline()
    tw.destroy()
    return out


def measure(n: int, *, ulimit: int = 0, tcp: bool = False, talk: str = "",
            env: dict[str, str] | None = None, timeout: float = 600) -> dict[str, Any]:
    """Run one job of `n` ranks on this host (see the module docstring); per-rank reports and
    the store's counts. `talk`: also exchange a message with the ring neighbours
    ("neighbours") or every other rank ("all")."""
    from tensorwire import auth
    from tensorwire.rendezvous.tcp_server import TCPStoreServer

    text = auth.new_secret()
    server = TCPStoreServer("127.0.0.1", 0, secret=auth.configured({auth.ENV_SECRET: text}))
    free_before = _shm_free()
    base = {k: v for k, v in os.environ.items() if not k.startswith("TENSORWIRE_")}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port), WORLD_SIZE=str(n),
                LOCAL_WORLD_SIZE=str(n), TENSORWIRE_STORE_HOSTED="1", TENSORWIRE_JOB_ID=f"scale{server.port}",
                TENSORWIRE_SECRET=text, TENSORWIRE_CALIBRATE="0", TENSORWIRE_TIMEOUT=str(timeout),
                WIRING_HOLD="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    base.update(env or {})
    if tcp:
        base["TENSORWIRE_TRANSPORT"] = "tcp"
    if talk:
        base["WIRING_TALK"] = talk

    def cap() -> None:
        if ulimit:
            resource.setrlimit(resource.RLIMIT_NOFILE, (ulimit, ulimit))

    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--in-job"],
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)}, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=cap)
             for r in range(n)]
    reports: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        for r, proc in enumerate(procs):
            while r not in reports:
                line = proc.stdout.readline()  # type: ignore[union-attr]
                if not line:
                    reports[r] = {"rank": r, "ok": False, "error": "no report",
                                  "msg": f"exit code {proc.wait()}: {proc.stderr.read()[-2000:]}"}  # type: ignore
                elif line.startswith("@@"):
                    reports[r] = json.loads(line[2:])
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {r} did not report within {timeout:g} s")
        shm_used = max(0, free_before - _shm_free())
        for proc in procs:
            try:  # a rank that failed may exit between its report and this release
                proc.stdin.write("\n")  # type: ignore[union-attr]
                proc.stdin.flush()  # type: ignore[union-attr]
            except (BrokenPipeError, ValueError):
                pass
        codes = [proc.wait(max(1.0, deadline - time.monotonic())) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()
        served = server.served
        server.close()
    store = [{"requests": s.requests, "total": s.total, "bytes_in": s.bytes_in, "bytes_out": s.bytes_out}
             for s in served]
    return {"np": n, "ulimit": ulimit, "tcp": tcp, "codes": codes, "reports": [reports[r] for r in range(n)],
            "store": store, "shm_bytes": shm_used}


def _rss_kib() -> int:
    """This process's resident memory (VmRSS), mapped /dev/shm pages it touched included."""
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _shm_free() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def summary(job: dict[str, Any]) -> dict[str, Any]:
    """One table row: per-rank maxima and means."""
    reps, store = job["reports"], job["store"]

    def stat(values: list[float]) -> tuple[float, float]:
        return max(values), statistics.mean(values)

    reps = [r for r in reps if "channels" in r] or [{"channels": {}, "fds": 0, "init_s": 0, "ring_bytes": 0,
                                                      "segment_bytes": 0}]
    conns = [sum(r["channels"].values()) for r in reps]
    return {"np": job["np"], "ok": all(r.get("ok") for r in job["reports"]) and not any(job["codes"]),
            "fds": stat([r["fds"] for r in reps]), "connections": stat(conns),
            "shm_mib": job["shm_bytes"] / (1 << 20),
            "own_mib": sum(r["ring_bytes"] + r["segment_bytes"] for r in reps) / (1 << 20),
            "requests": stat([s["total"] for s in store]),
            "bytes": stat([s["bytes_in"] + s["bytes_out"] for s in store]),
            "init_s": stat([r["init_s"] for r in reps])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--ulimit", type=int, default=0, help="start the ranks with ulimit -n N")
    p.add_argument("--tcp", action="store_true", help="TENSORWIRE_TRANSPORT=tcp")
    p.add_argument("--talk", choices=["neighbours", "all"], default="",
                   help="after the all_reduce, exchange a message with the ring neighbours or every rank")
    p.add_argument("--json", default="", help="write every job's reports here")
    p.add_argument("--in-job", action="store_true", help="run one rank's part (under a launcher)")
    args = p.parse_args()
    if args.in_job:
        out = in_job()
        sys.exit(0 if out["ok"] else 1)
    jobs = []
    print("| ranks | descriptors per rank, max (mean) | connections per rank, max (mean) | /dev/shm MiB: "
          "rings + segments (statvfs) | store requests per rank, max (mean) | store bytes per rank, max "
          "(mean) | ok |")
    print("|---|---|---|---|---|---|---|")
    for n in args.np:
        job = measure(n, ulimit=args.ulimit, tcp=args.tcp, talk=args.talk)
        jobs.append(job)
        s = summary(job)
        print(f"| {n} | {s['fds'][0]} ({s['fds'][1]:.1f}) | {s['connections'][0]} "
              f"({s['connections'][1]:.1f}) | {s['own_mib']:.1f} ({s['shm_mib']:.0f}) | {s['requests'][0]} "
              f"({s['requests'][1]:.1f}) | {s['bytes'][0]} ({s['bytes'][1]:.0f}) | {s['ok']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(jobs, f, indent=1)


if __name__ == "__main__":
    main()
