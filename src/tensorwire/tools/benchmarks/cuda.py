"""CUDA tensors through torch.distributed: tensorwire against Gloo (and NCCL where it runs),
side by side in one job, timed as nccl-tests times: the mean call over the timed loop (host
clock around the loop, the device synchronized before and after), with each call's p50 and
p99 from CUDA events and the host's own time per call (the loop before the final
synchronize: what queuing the calls cost) beside it, every result checked first.

    tensorwire bench all_reduce -b 8 -e 64M -f 8 --np 2 --device cuda --compare gloo,nccl
    python -m tensorwire.tools.benchmarks.cuda all_reduce --np 2 --compare gloo   # the same, directly

`--graph` adds, for each library whose calls a CUDA graph can hold (NCCL; tensorwire's small
all_reduce, broadcast and all_gather on its device-flag path), a row timed from replays of one
graph of 100 calls: the cost of a call with no host in the loop (results are checked eagerly).

Every rank takes GPU `rank % device_count` (on a one-GPU machine ranks share it, which NCCL
refuses: its column then says why). The world is a Gloo group on env://; tensorwire is a
`new_group(backend="tensorwire")` over the same ranks, so both move the same tensors.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from typing import Any

from .options import size_argument
from .sweep import busbw_factor

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "alltoall", "pingpong")
"""pingpong: rank 0 sends to rank 1, which sends it back (send/recv; other ranks idle): the
time is the round trip, busbw the bandwidth one way."""
_GRAPH_CALLS = 100  # calls captured in one graph (--graph): a replay runs them all
_CAPTURABLE = ("all_reduce", "broadcast", "all_gather")


def _sizes(lo: int, hi: int, factor: int) -> list[int]:
    """lo, lo * factor, ... up to hi, and hi itself."""
    out, s = [], lo
    while s < hi:
        out.append(s)
        s *= factor
    return [*out, hi]


def _iters(nbytes: int, fixed: int) -> tuple[int, int]:
    """(warm-up, timed) calls: 200 of 64 KiB and less, down to 20 past 16 MiB."""
    timed = fixed or (200 if nbytes <= 64 << 10 else 100 if nbytes <= 1 << 20 else 40 if nbytes <= 16 << 20
                      else 20)
    return max(2, timed // 5), timed


class _Lib:
    def __init__(self, name: str, group: Any, note: str = "") -> None:
        self.name, self.group, self.note = name, group, note


def _buffers(torch: Any, coll: str, nbytes: int, n: int, rank: int, dev: Any) -> tuple[Any, Any, Any]:
    """(send, recv, expected recv) float32 tensors for one call of `coll` at nccl-tests' size."""
    count = max(n, nbytes // 4 // n * n)  # divisible by n
    ar = torch.arange(count, device=dev, dtype=torch.float32)
    if coll == "all_reduce":
        send = ar + rank
        return send, send, ar * n + n * (n - 1) / 2
    if coll == "broadcast":
        send = ar + rank
        return send, send, ar + 0
    if coll == "all_gather":
        block = count // n
        send = torch.arange(block, device=dev, dtype=torch.float32) + 1000 * rank
        recv = torch.empty(count, device=dev)
        want = torch.cat([torch.arange(block, device=dev, dtype=torch.float32) + 1000 * q for q in range(n)])
        return send, recv, want
    if coll == "reduce_scatter":
        block = count // n
        send = ar + rank
        return send, torch.empty(block, device=dev), ar[rank * block:(rank + 1) * block] * n + n * (n - 1) / 2
    if coll == "pingpong":  # rank 1 returns what rank 0 sent; the idle ranks' buffers stay as they are
        recv = torch.empty(count, device=dev) if rank < 2 else ar + 0
        return ar + 0, recv, ar + 0
    block = count // n  # alltoall: block q of rank r's input is r * 1000 + q
    send = torch.cat([torch.full((block,), float(rank * 1000 + q), device=dev) for q in range(n)])
    want = torch.cat([torch.full((block,), float(q * 1000 + rank), device=dev) for q in range(n)])
    return send, torch.empty(count, device=dev), want


def _call(dist: Any, coll: str, send: Any, recv: Any, group: Any) -> Any:
    if coll == "pingpong":
        rank = dist.get_rank()
        if rank == 0:
            return lambda: (dist.send(send, 1, group=group), dist.recv(recv, 1, group=group))
        if rank == 1:
            return lambda: (dist.recv(recv, 0, group=group), dist.send(recv, 0, group=group))
        return lambda: None
    if coll == "all_reduce":
        return lambda: dist.all_reduce(recv, group=group)
    if coll == "broadcast":
        return lambda: dist.broadcast(recv, 0, group=group)
    if coll == "all_gather":
        return lambda: dist.all_gather_into_tensor(recv, send, group=group)
    if coll == "reduce_scatter":
        return lambda: dist.reduce_scatter_tensor(recv, send, group=group)
    return lambda: dist.all_to_all_single(recv, send, group=group)


def _captured(torch: Any, run: Any) -> tuple[Any, str]:
    """(a graph of _GRAPH_CALLS calls of `run`, '') or (None, why not)."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(_GRAPH_CALLS):
                run()
    except Exception as exc:  # the library refuses (every rank alike), or CUDA does
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    return graph, ""


def _measure(torch: Any, dist: Any, lib: _Lib, coll: str, nbytes: int, n: int, rank: int, dev: Any,
             iters: int, gloo: Any, graph: bool = False) -> dict[str, Any] | str:
    """One row; `graph`: timed from replays of one graph of _GRAPH_CALLS calls (a str: why the
    calls could not be captured)."""
    def checked() -> int:
        """Wrong elements of one call on fresh inputs (a repeated signature may take another
        path than its first call: the check runs before and after the timed loop)."""
        send, recv, want = _buffers(torch, coll, nbytes, n, rank, dev)
        _call(dist, coll, send, recv, lib.group)()
        torch.cuda.synchronize(dev)
        return int((recv != want).sum().item())

    wrong = checked()
    send, recv, _ = _buffers(torch, coll, nbytes, n, rank, dev)
    run = _call(dist, coll, send, recv, lib.group)
    warm, timed = _iters(nbytes, iters)
    per = 1
    if graph:
        captured, why = _captured(torch, run)
        if captured is None:
            return why
        run, per, warm, timed = captured.replay, _GRAPH_CALLS, 1, max(3, timed // 20)
    for _ in range(warm):
        run()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(timed)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(timed)]
    torch.cuda.synchronize(dev)
    dist.barrier(group=gloo)
    t0 = time.perf_counter()
    for i in range(timed):
        starts[i].record()
        run()
        ends[i].record()
    host = (time.perf_counter() - t0) / timed / per  # the calls queued: what the host spent per call
    torch.cuda.synchronize(dev)
    mean = (time.perf_counter() - t0) / timed / per
    wrong += checked()
    calls = sorted(s.elapsed_time(e) / 1e3 / per for s, e in zip(starts, ends))
    stats = torch.tensor([mean, calls[len(calls) // 2], calls[min(len(calls) - 1, int(0.99 * len(calls)))],
                          float(wrong), host], dtype=torch.float64)
    dist.all_reduce(stats, dist.ReduceOp.MAX, group=gloo)  # the slowest rank
    mean, p50, p99, wrong, host = stats.tolist()
    moved = recv.numel() * 4 if coll != "reduce_scatter" else send.numel() * 4
    return {"lib": lib.name + (" graph" if graph else ""), "coll": coll, "bytes": moved, "mean_s": mean,
            "p50_s": p50, "p99_s": p99, "host_s": host, "wrong": int(wrong),
            "busbw_GBps": moved * busbw_factor(coll, n) / mean / 1e9}


def _rank(rank: int, n: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import warnings

    import torch
    import torch.distributed as dist

    import tensorwire.torch  # noqa: F401

    warnings.filterwarnings("ignore")
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo")
    gloo = dist.new_group(backend="gloo")
    libs = [_Lib("tensorwire", dist.new_group(backend="tensorwire"))]
    if "gloo" in args.compare:
        libs.append(_Lib("gloo", gloo))
    notes = []
    if "nccl" in args.compare:
        if torch.cuda.device_count() >= n and dist.is_nccl_available():
            libs.append(_Lib("nccl", dist.new_group(backend="nccl")))
        else:
            notes.append(f"nccl: not run: {n} ranks share {torch.cuda.device_count()} GPU(s), which NCCL "
                         "refuses ('Duplicate GPU detected')")
    rows = []
    if "pingpong" in args.colls and "gloo" in args.compare:
        notes.append("gloo: no pingpong: it cannot send CUDA tensors")
    for coll in args.colls:
        for nbytes in _sizes(args.minbytes, args.maxbytes, args.stepfactor):
            for lib in libs:  # interleaved: every library at this size before the next size
                if coll != "pingpong" or lib.name != "gloo":
                    rows.append(_measure(torch, dist, lib, coll, nbytes, n, rank, dev, args.iters, gloo))
                if args.graph and coll in _CAPTURABLE and lib.name != "gloo":
                    row = _measure(torch, dist, lib, coll, nbytes, n, rank, dev, args.iters, gloo, graph=True)
                    if isinstance(row, str):
                        notes.append(f"{lib.name}: {coll} of {nbytes} B not captured: {row}")
                    else:
                        rows.append(row)
    if rank == 0:
        out.put({"rows": rows, "notes": notes, "device": torch.cuda.get_device_name(dev), "n": n,
                 "torch": torch.__version__, "transport": os.environ.get("TENSORWIRE_TRANSPORT", "auto")})
    dist.destroy_process_group()


def _fmt_t(s: float) -> str:
    return f"{s * 1e6:9.1f}" if s < 1e-2 else f"{s * 1e3:8.2f}m"


def table(result: dict[str, Any]) -> str:
    """nccl-tests' columns per library, and tensorwire's speedup over each other one."""
    rows = result["rows"]
    libs = list(dict.fromkeys(r["lib"] for r in rows))
    lines = [f"# {result['n']} ranks, {result['device']}, torch {result['torch']}, "
             f"TENSORWIRE_TRANSPORT={result['transport']}; time in us (m: ms), mean over the timed calls "
             f"(slowest rank), p50/p99 per call (CUDA events), host: the host's time per call queuing them"]
    head = f"{'collective':>14} {'bytes':>10}"
    for lib in libs:
        head += f" | {lib + ' mean':>15} {'p50':>9} {'p99':>9} {'host':>9} {'busbw':>7} {'#wrong':>6}"
    for lib in libs[1:]:
        head += f" | {'x vs ' + lib:>10}"
    lines.append(head)
    by = {(r["coll"], r["bytes"], r["lib"]): r for r in rows}
    for coll, nbytes in dict.fromkeys((r["coll"], r["bytes"]) for r in rows):
        line = f"{coll:>14} {nbytes:>10}"
        for lib in libs:
            r = by.get((coll, nbytes, lib))
            line += " | " + (f"{_fmt_t(r['mean_s']):>15} {_fmt_t(r['p50_s']):>9} {_fmt_t(r['p99_s']):>9} "
                             f"{_fmt_t(r['host_s']):>9} {r['busbw_GBps']:7.2f} {r['wrong']:>6}" if r
                             else f"{'-':>61}")
        tw = by.get((coll, nbytes, "tensorwire"))
        for lib in libs[1:]:
            r = by.get((coll, nbytes, lib))
            line += " | " + (f"{r['mean_s'] / tw['mean_s']:9.1f}x" if r and tw else f"{'-':>10}")
        lines.append(line)
    lines += [f"# {note}" for note in result["notes"]]
    return "\n".join(lines)


def _no_device() -> str:
    """Why CUDA tensors cannot be benchmarked here ('' where they can)."""
    try:
        import torch
    except ImportError:
        return "needs torch with CUDA (pip install 'tensorwire[torch]' with a CUDA build of torch)"
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        return "no CUDA device: torch.cuda.is_available() is False (use --device cpu, the default)"
    return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tensorwire bench --device cuda", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=int, default=2, help="ranks (GPUs round robin)")
    p.add_argument("colls", nargs="*", default=["all"], help=f"collectives: {', '.join(COLLECTIVES)} or all")
    p.add_argument("-b", "--minbytes", type=size_argument, default=8)
    p.add_argument("-e", "--maxbytes", type=size_argument, default=64 << 20)
    p.add_argument("-f", "--stepfactor", type=int, default=8)
    p.add_argument("-n", "--iters", type=int, default=0, help="timed calls per size (0: by size)")
    p.add_argument("--compare", default="gloo", help="gloo, nccl or both, comma-separated ('' for none)")
    p.add_argument("--graph", action="store_true", help=f"also time {', '.join(_CAPTURABLE)} replayed "
                   f"from a CUDA graph of {_GRAPH_CALLS} calls")
    p.add_argument("--json", default="", help="write the rows here")
    args = p.parse_args(argv)
    args.colls = list(COLLECTIVES) if "all" in args.colls else args.colls
    args.compare = {c.strip() for c in args.compare.split(",") if c.strip()}
    bad = set(args.colls) - set(COLLECTIVES)
    if bad:
        p.error(f"unknown collectives {sorted(bad)}; choose from {', '.join(COLLECTIVES)}")
    why = _no_device()
    if why:
        print(f"tensorwire bench --device cuda: {why}", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.np, port, args, out)) for r in range(args.np)]
    for proc in procs:
        proc.start()
    result = None
    deadline = time.monotonic() + 3600
    while result is None and time.monotonic() < deadline:
        try:
            result = out.get(timeout=1)
        except Exception:
            if all(not proc.is_alive() for proc in procs):
                break
    for proc in procs:
        proc.join(30)
    if result is None:
        print("tensorwire bench --device cuda: the ranks failed (their errors are above)", file=sys.stderr)
        return 1
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if any(r["wrong"] for r in result["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
