"""CUDA buffers through every collective and point-to-point call, on a real GPU.

Skipped ("no CUDA device") where torch cannot see one. Ranks are real processes sharing the
machine's GPUs round robin (on a one-GPU machine every rank shares it: the case NCCL
refuses). Every result is checked against a reference computed on the CPU in float64 (or
exactly, for integers) from inputs every rank can regenerate. Sizes straddle the small
path's slot (TENSORWIRE_CUDA_SLOT, 1 MiB) so both device-to-device paths run; uint32 MIN and
float8 movement exercise the staged fallbacks inside an IPC group; TENSORWIRE_CUDA_IPC=0
stages everything.
"""

from __future__ import annotations

import functools
import operator
import os
import threading
import time

import pytest

from cluster import Cluster, RankFailure


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not _has_cuda(), reason="no CUDA device")]

SLOT = 1 << 20


# ------------------------------------------------------------------------------------ in the ranks

def _device(rank: int):
    """This rank's GPU: round robin over the machine's."""
    import torch

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


_OPS_BY_KIND = {
    "f": ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"),
    "c": ("SUM", "AVG", "PRODUCT", "PREMUL_SUM"),
    "i": ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"),
    "u": ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"),
    "b": ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"),
}


def _kind(dtype) -> str:
    import torch

    if dtype == torch.bool:
        return "b"
    if dtype.is_complex:
        return "c"
    if dtype.is_floating_point:
        return "f"
    return "u" if dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64) else "i"


def _input(dtype, count: int, rank: int, salt: int, op: str = "SUM"):
    """Rank `rank`'s input of a case, on the CPU (every rank can make every rank's)."""
    import torch

    g = torch.Generator().manual_seed(rank * 7919 + salt)
    kind = _kind(dtype)
    if kind == "b":
        return torch.rand(count, generator=g) < 0.5
    if kind in "iu":
        lo, hi = (1, 3) if op == "PRODUCT" else (0, 30) if kind == "u" else (-20, 20)
        return torch.randint(lo, hi + 1, (count,), generator=g, dtype=torch.int64).to(dtype)
    if op == "PRODUCT":
        base = torch.rand(count, generator=g, dtype=torch.float64) + 0.5
    else:
        base = torch.randn(count, generator=g, dtype=torch.float64)
    if kind == "c":
        base = torch.complex(base, torch.randn(count, generator=g, dtype=torch.float64))
    return base.to(dtype)


def _factor(dtype) -> float:
    return 0.5 if dtype.is_floating_point or dtype.is_complex else 2.0


def _reference(op: str, parts: list, dtype):
    """The reduction of `parts` (CPU tensors of `dtype`) computed wide: float64/complex128 or int64."""
    import torch

    kind = _kind(dtype)
    wide = [p.to(torch.complex128 if kind == "c" else torch.float64 if kind == "f" else torch.int64)
            for p in parts]
    n = len(parts)
    if kind == "b":
        stack = torch.stack([p.to(torch.bool) for p in parts])
        if op in ("SUM", "MAX", "BOR"):
            return stack.any(0)
        if op in ("PRODUCT", "MIN", "BAND"):
            return stack.all(0)
        return stack.to(torch.int64).sum(0) % 2 == 1  # BXOR
    acc = wide[0].clone()
    for w in wide[1:]:
        if op in ("SUM", "AVG", "PREMUL_SUM"):
            acc = acc + w
        elif op == "PRODUCT":
            acc = acc * w
        elif op == "MIN":
            acc = torch.minimum(acc, w)
        elif op == "MAX":
            acc = torch.maximum(acc, w)
        elif op == "BAND":
            acc = acc & w
        elif op == "BOR":
            acc = acc | w
        elif op == "BXOR":
            acc = acc ^ w
    if op == "AVG":
        acc = acc / n if kind in "fc" else torch.div(acc, n, rounding_mode="floor")
    if op == "PREMUL_SUM":
        acc = acc * _factor(dtype) if kind in "fc" else acc * int(_factor(dtype))
    return acc


def _close(out, ref, parts: list, op: str, dtype) -> str:
    """'' if `out` (CPU) matches `ref` within what `dtype`'s rounding allows, else what differs."""
    import torch

    kind = _kind(dtype)
    if kind in "biu":
        wrapped = ref.to(dtype) if kind != "b" else ref
        bad = (out != wrapped).nonzero()
        return "" if not len(bad) else f"{len(bad)} wrong, first at {int(bad[0])}: {out[bad[0]]} vs " \
            f"{wrapped[bad[0]]}"
    eps = torch.finfo(dtype).eps if kind == "f" else torch.finfo(torch.float32 if dtype == torch.complex64
                                                                   else torch.float64).eps
    wide = torch.complex128 if kind == "c" else torch.float64
    scale = ref.abs() if op == "PRODUCT" else sum(p.to(wide).abs() for p in parts)
    if op in ("AVG",):
        scale = scale / len(parts)
    if op == "PREMUL_SUM":
        scale = scale * _factor(dtype)
    err = (out.to(wide) - ref).abs()
    tol = 4 * len(parts) * eps * scale + 1e-30
    bad = (err > tol).nonzero()
    if torch.isnan(out.to(wide)).any():
        return "NaN in the result"
    return "" if not len(bad) else f"{len(bad)} beyond tolerance, first at {int(bad[0])}: {out[bad[0]]} " \
        f"vs {ref[bad[0]]}"


def every_collective(dtype_names: list[str], large: bool) -> list[str]:
    """Every collective on this rank's device, each result checked; returns what was wrong."""
    import torch

    import tensorwire as tw

    world = tw.world()
    n, r = world.size, world.rank
    dev = _device(r)
    wrong: list[str] = []
    salt = 0

    def check(label: str, out, ref, parts, op, dtype) -> None:
        why = _close(out.cpu(), ref, parts, op, dtype)
        if why:
            wrong.append(f"rank {r}: {label}: {why}")

    for name in dtype_names:
        dtype = getattr(torch, name)
        kind = _kind(dtype)
        item = torch.empty(0, dtype=dtype).element_size()
        counts = [37, (SLOT // item) + 129] if large else [37]
        for count in counts:
            for op in _OPS_BY_KIND[kind]:
                salt += 1
                parts = [_input(dtype, count, q, salt, op) for q in range(n)]
                ref = _reference(op, parts, dtype)
                red = tw.premul_sum(_factor(dtype)) if op == "PREMUL_SUM" else getattr(tw.ReduceOp, op)
                x = parts[r].to(dev)
                tw.all_reduce(x, red)  # in place
                check(f"all_reduce {name} {op} x{count}", x, ref, parts, op, dtype)
                x = parts[r].to(dev)
                tw.all_reduce(x, red)  # twice: the other slot, the same buffer
                check(f"all_reduce again {name} {op} x{count}", x, ref, parts, op, dtype)
                root = 1 % n
                y = parts[r].to(dev)
                tw.reduce(y, root, red)
                if r == root:
                    check(f"reduce {name} {op} x{count}", y, ref, parts, op, dtype)
                elif not torch.equal(y.cpu(), parts[r]):
                    wrong.append(f"rank {r}: reduce {name} {op}: a non-root's input changed")
                big = [_input(dtype, count * n, q, salt + 1000, op) for q in range(n)]
                out = torch.empty(count, dtype=dtype, device=dev)
                tw.reduce_scatter_tensor(out, big[r].to(dev), red)
                mine = [b[r * count:(r + 1) * count] for b in big]
                check(f"reduce_scatter_tensor {name} {op} x{count}", out, _reference(op, mine, dtype), mine,
                      op, dtype)
            # data movement: bitwise
            salt += 1
            parts = [_input(dtype, count, q, salt) for q in range(n)]
            x = parts[r].to(dev)
            out = torch.empty(count, dtype=dtype, device=dev)
            tw.all_reduce(x, tw.ReduceOp.SUM, out=out)
            check(f"all_reduce out= {name} x{count}", out, _reference("SUM", parts, dtype), parts, "SUM",
                  dtype)
            if not torch.equal(x.cpu(), parts[r]):
                wrong.append(f"rank {r}: all_reduce out= {name}: the input changed")
            b = parts[r].to(dev)
            tw.broadcast(b, n - 1)
            if not torch.equal(b.cpu(), parts[n - 1]):
                wrong.append(f"rank {r}: broadcast {name} x{count}")
            gathered = torch.empty(n * count, dtype=dtype, device=dev)
            tw.all_gather_into_tensor(gathered, parts[r].to(dev))
            if not torch.equal(gathered.cpu(), torch.cat(parts)):
                wrong.append(f"rank {r}: all_gather_into_tensor {name} x{count}")
            inplace = torch.zeros(n * count, dtype=dtype, device=dev)
            inplace[r * count:(r + 1) * count] = parts[r].to(dev)
            tw.all_gather_into_tensor(inplace, inplace[r * count:(r + 1) * count])
            if not torch.equal(inplace.cpu(), torch.cat(parts)):
                wrong.append(f"rank {r}: all_gather_into_tensor in place {name} x{count}")
            outs = [torch.empty(count, dtype=dtype, device=dev) for _ in range(n)]
            tw.all_gather(outs, parts[r].to(dev))
            if not all(torch.equal(o.cpu(), p) for o, p in zip(outs, parts)):
                wrong.append(f"rank {r}: all_gather {name} x{count}")
            big = [_input(dtype, count * n, q, salt + 7) for q in range(n)]
            got = torch.empty(count * n, dtype=dtype, device=dev)
            tw.all_to_all_single(got, big[r].to(dev))
            want = torch.cat([b[r * count:(r + 1) * count] for b in big])
            if not torch.equal(got.cpu(), want):
                wrong.append(f"rank {r}: all_to_all_single {name} x{count}")
    if os.environ.get("TENSORWIRE_CUDA_DEVICE_FLAGS") == "1" and n > 1 and world.device.flags is None:
        wrong.append(f"rank {r}: the device-flag path was forced but not taken (see the init log)")
    return wrong


def rooted_vector_p2p_async() -> list[str]:
    """gather, scatter, the vector forms, uneven all_to_all, all_gather and reduce_scatter,
    point-to-point, async calls and streams, CuPy arrays (where CuPy is installed): the staged and
    asynchronous paths."""
    import torch

    import tensorwire as tw

    world = tw.world()
    n, r = world.size, world.rank
    dev = _device(r)
    wrong: list[str] = []
    parts = [torch.arange(10, dtype=torch.float32) + 100 * q for q in range(n)]
    mine = parts[r].to(dev)
    blocks = [torch.empty(10, device=dev) for _ in range(n)] if r == 0 else None
    tw.gather(mine, blocks, 0)
    if r == 0 and not all(torch.equal(b.cpu(), p) for b, p in zip(blocks, parts)):
        wrong.append("gather")
    got = torch.empty(10, device=dev)
    tw.scatter(got, [p.to(dev) for p in parts] if r == n - 1 else None, n - 1)
    if not torch.equal(got.cpu(), parts[r]):
        wrong.append(f"rank {r}: scatter")
    counts = [q + 1 for q in range(n)]
    out = torch.empty(sum(counts), device=dev)
    tw.all_gatherv(out, torch.full((r + 1,), float(r), device=dev), counts)
    want = torch.cat([torch.full((q + 1,), float(q)) for q in range(n)])
    if not torch.equal(out.cpu(), want):
        wrong.append(f"rank {r}: all_gatherv")
    sends = [torch.full((q + 1,), float(10 * r + q), device=dev) for q in range(n)]
    recvs = [torch.empty(r + 1, device=dev) for _ in range(n)]
    tw.all_to_all(recvs, sends)
    if not all(torch.equal(recvs[q].cpu(), torch.full((r + 1,), float(10 * q + r))) for q in range(n)):
        wrong.append(f"rank {r}: all_to_all uneven")
    gathered = [torch.empty(q + 1, device=dev) for q in range(n)]  # the list forms, uneven
    tw.all_gather(gathered, torch.full((r + 1,), float(r), device=dev))
    if not all(torch.equal(gathered[q].cpu(), torch.full((q + 1,), float(q))) for q in range(n)):
        wrong.append(f"rank {r}: all_gather uneven")
    mine_sum = torch.empty(r + 1, device=dev)
    tw.reduce_scatter(mine_sum, [torch.full((q + 1,), float(r + 1), device=dev) for q in range(n)])
    if not torch.equal(mine_sum.cpu(), torch.full((r + 1,), n * (n + 1) / 2)):
        wrong.append(f"rank {r}: reduce_scatter uneven")
    if n > 1:
        data = torch.arange(1000, device=dev, dtype=torch.int64) * (r + 1)
        into = torch.empty(1000, device=dev, dtype=torch.int64)
        works = [tw.isend(data, (r + 1) % n, tag=3), tw.irecv(into, (r - 1) % n, tag=3)]
        for w in works:
            w.wait()
        if not torch.equal(into.cpu(), torch.arange(1000) * ((r - 1) % n + 1)):
            wrong.append(f"rank {r}: isend/irecv")
    if n > 1:  # both buffers checked before anything is sent; one deadline for the pair
        got = torch.empty(1000, device=dev)
        tw.sendrecv(torch.arange(1000.0, device=dev) + r, (r + 1) % n, got, (r - 1) % n, tag=8)
        if not torch.equal(got.cpu(), torch.arange(1000.0) + (r - 1) % n):
            wrong.append(f"rank {r}: sendrecv")
    # async calls left queued, then a blocking one: the caller's thread runs the queued bodies
    # (slots, then a published buffer) in order before its own
    a = torch.full((1000,), float(r + 1), device=dev)
    b = torch.full((3 << 18,), 1.0, device=dev)
    works = [tw.all_reduce(a, async_op=True), tw.all_reduce(b, async_op=True)]
    c = torch.full((8,), float(r), device=dev)
    tw.all_reduce(c)
    for w in works:
        w.wait()
    if not (torch.all(a == n * (n + 1) / 2) and torch.all(b == n) and torch.all(c == n * (n - 1) / 2)):
        wrong.append(f"rank {r}: async calls run by a later blocking call: {a[0].item()} {b[0].item()} "
                     f"{c[0].item()}")
    # repeated small all_reduces: the planned path after each signature's first call, two
    # signatures interleaved (each parity's slot refilled by either), uint32 on its signed
    # view, AVG, and one call from a thread that made no CUDA call before
    for i in range(5):
        v = torch.full((3, 5), float(r + i), device=dev)
        tw.all_reduce(v)
        w = torch.full((7,), 4_000_000_000 - r - i, dtype=torch.uint32, device=dev)
        tw.all_reduce(w, tw.ReduceOp.BAND if i % 2 else tw.ReduceOp.SUM)
        avg = torch.full((2,), float(2 * r + i), device=dev)
        tw.all_reduce(avg, tw.ReduceOp.AVG)
        values = [4_000_000_000 - q - i for q in range(n)]
        want_w = functools.reduce(operator.and_, values) if i % 2 else sum(values) % 2**32
        if not (torch.all(v == sum(q + i for q in range(n))) and w.cpu().tolist() == [want_w] * 7
                and torch.all(avg == sum(2 * q + i for q in range(n)) / n)):
            wrong.append(f"rank {r}: planned all_reduce, call {i}: {v[0, 0].item()} {w[0].item()} "
                         f"{avg[0].item()}")
    got = []
    thread = threading.Thread(target=lambda: got.append(tw.all_reduce(torch.full((3, 5), 1.0, device=dev))))
    thread.start()
    thread.join()
    if not got or not torch.all(got[0] == n):
        wrong.append(f"rank {r}: planned all_reduce from another thread: {got}")
    # an empty host tensor, then an empty device one: the device call must not take the host's
    # kept view (both have address 0)
    tw.all_reduce(torch.empty(0))
    empty = torch.empty(0, device=dev)
    tw.all_reduce(empty)
    if empty.device != dev or empty.numel():
        wrong.append(f"rank {r}: empty device all_reduce")
    # async on a side stream: the caller's later work waits for the result, nothing else does
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.full((1 << 20,), float(r + 1), device=dev)  # queued, not run yet
        work = tw.all_reduce(x, async_op=True)
        work.wait()
        y = x * 2  # on `side`, after the all_reduce's GPU work
    side.synchronize()
    if not torch.all(y == 2 * n * (n + 1) / 2):
        wrong.append(f"rank {r}: async all_reduce on a side stream: {y[:3].tolist()}")
    # a blocking call ordered after the kernel that makes its input, with no synchronize
    x = torch.empty(3 << 20, device=dev).fill_(float(r))
    x.mul_(2).add_(1)
    tw.all_reduce(x)
    if not torch.all(x == sum(2 * q + 1 for q in range(n))):
        wrong.append(f"rank {r}: blocking all_reduce after its input's kernels")
    # uint32 MIN (no torch CUDA kernel: staged) and float8 movement
    u = torch.tensor([7 + r, 3_000_000_000 - r], dtype=torch.uint32, device=dev)
    tw.all_reduce(u, tw.ReduceOp.MIN)
    if u.cpu().tolist() != [7, 3_000_000_000 - (n - 1)]:
        wrong.append(f"rank {r}: uint32 MIN: {u.cpu().tolist()}")
    if hasattr(torch, "float8_e4m3fn"):
        f8 = torch.full((64,), float(r), device=dev).to(torch.float8_e4m3fn)
        tw.broadcast(f8, 0)
        if not torch.all(f8.float() == 0):
            wrong.append(f"rank {r}: float8 broadcast")
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None:
        with cupy.cuda.Device(dev.index):
            c = cupy.full(1000, r + 1, dtype=cupy.float32)
            tw.all_reduce(c)
            if not bool((c == n * (n + 1) / 2).all()):
                wrong.append(f"rank {r}: CuPy all_reduce")
    return wrong


def device_p2p(in_place: bool) -> list[str]:
    """Point-to-point of CUDA buffers between ranks 0 and 1 (the others idle): blocking
    ping-pong from 8 B to 64 MiB, data a kernel wrote just before (no synchronize), the
    sender's buffer overwritten right after its send returns, two tags interleaved out of
    order, a send whose Work is dropped and its buffer freed, host buffers on either side, then
    a size mismatch on a fresh group. `in_place`: every CUDA-to-CUDA receive must have come
    device to device (gpu/p2p.py) but those faster staged (p2p.staged_faster), else staged."""
    import numpy as np
    import torch

    import tensorwire as tw

    world = tw.world()
    r = world.rank
    dev = _device(r)
    wrong: list[str] = []
    g = tw.new_group()
    if r > 1:
        world.barrier()
        return wrong
    peer = 1 - r
    tw.sendrecv(np.zeros(1), peer, np.zeros(1), peer)  # the pair is wired: later sends may go in place

    from tensorwire.gpu import p2p

    def landed(work, what: str, nbytes: int) -> None:
        work.wait()
        came = getattr(work, "device", None) is not None and work.device.copied is not None
        if came != (in_place and not p2p.staged_faster(nbytes)):
            wrong.append(f"rank {r}: {what}: {'device to device' if came else 'staged'}")

    for count in (2, 1 << 14, 1 << 20, 16 << 20):  # float32: 8 B to 64 MiB
        mine = torch.empty(count, device=dev).fill_(float(r + 1)).mul_(3)  # queued, not run yet
        got = torch.empty(count, device=dev)
        if r == 0:
            tw.send(mine, peer, tag=1)
            mine.fill_(-1.0)  # after the send returned: the receiver's copy must be done first
            landed(tw.irecv(got, peer, tag=1), f"recv of {count * 4} B", count * 4)
        else:
            landed(tw.irecv(got, peer, tag=1), f"recv of {count * 4} B", count * 4)
            tw.send(mine, peer, tag=1)
            mine.fill_(-1.0)
        twice = got * 2  # on the current stream, after the receive
        if not torch.all(twice == 2 * 3 * (peer + 1)).item():
            wrong.append(f"rank {r}: ping-pong of {count * 4} B: got {got[:3].tolist()}")
    # tags interleaved: rank 0 sends a(2), b(3), c(2); rank 1 receives tag 3 first
    if r == 0:
        works = [tw.isend(torch.full((1000,), v, device=dev), peer, tag=t) for v, t in ((1.0, 2), (2.0, 3),
                                                                                       (3.0, 2))]
        for w in works:
            w.wait()
    else:
        into = [torch.empty(1000, device=dev) for _ in range(3)]
        works = [tw.irecv(into[1], peer, tag=3), tw.irecv(into[0], peer, tag=2),
                 tw.irecv(into[2], peer, tag=2)]
        for w in works:
            w.wait()
        if [t[0].item() for t in into] != [1.0, 2.0, 3.0]:
            wrong.append(f"rank {r}: tags out of order: {[t[0].item() for t in into]}")
    # a send whose Work is dropped unwaited and its tensor freed once acknowledged: the block
    # must not go to a new tensor before the receiver's copy, held back by a long kernel, ran
    if r == 0:
        work = tw.isend(torch.full((1 << 20,), 7.0, device=dev), peer, tag=6)
        while not work.is_completed():  # acknowledged: the receiver's copy is queued, not run
            time.sleep(0.001)
        del work
        for _ in range(4):
            torch.full((1 << 20,), -2.0, device=dev)  # the freed block's size: it may come back
    else:
        late = torch.empty(1 << 20, device=dev)
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clock before the receive: its copy waits
        tw.irecv(late, peer, tag=6).wait()
        if not torch.all(late == 7.0).item():
            wrong.append(f"rank {r}: a dropped send's buffer was reused before the copy: {late[:3].tolist()}")
    # host buffers on one side: a CUDA send into host memory, a host send into CUDA memory
    host = np.zeros(1 << 16, np.float32)
    if r == 0:
        tw.send(torch.full((1 << 16,), 5.0, device=dev), peer, tag=4)
        tw.recv(got := torch.empty(1 << 16, device=dev), peer, tag=5)
        if not torch.all(got == 6.0).item():
            wrong.append(f"rank {r}: host send into CUDA memory: {got[:3].tolist()}")
    else:
        tw.recv(host, peer, tag=4)
        tw.send(np.full(1 << 16, 6.0, np.float32), peer, tag=5)
        if not (host == 5.0).all():
            wrong.append(f"rank {r}: CUDA send into host memory: {host[:3].tolist()}")
    # a size mismatch: the receiver raises it and aborts the group, the sender learns it
    try:
        if r == 0:
            g.send(torch.ones(1000, device=dev), peer)
            g.barrier()
        else:
            g.recv(torch.empty(1001, device=dev), peer)
        wrong.append(f"rank {r}: size mismatch: nothing raised")
    except tw.CollectiveMismatchError:
        pass
    world.barrier()
    return wrong


def graph_capture() -> list[str]:
    """A collective and a send made while the current stream captures a CUDA graph, on the
    host-flag path: a clear error on every rank, nothing queued, and the group goes on."""
    import torch

    import tensorwire as tw

    world = tw.world()
    n, r = world.size, world.rank
    dev = _device(r)
    x = torch.ones(8, device=dev)
    wrong: list[str] = []
    for call in (lambda: tw.all_reduce(x), lambda: tw.all_reduce(x), lambda: tw.send(x, (r + 1) % n)):
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                call()
            wrong.append(f"rank {r}: captured without an error")
        except tw.InvalidArgumentError as exc:
            if "CUDA graph" not in str(exc):
                wrong.append(f"rank {r}: {exc}")
        tw.all_reduce(x)  # outside the capture: planned after the first
    if not torch.all(x == n ** 3).item():
        wrong.append(f"rank {r}: the calls after the captures: {x[:3].tolist()}")
    return wrong


def device_flags() -> list[str]:
    """Small calls on the device-flag path: all_reduce of every dtype and op it takes, one
    element to the slot, in place, into `out`, async; broadcast and all_gather (list and
    tensor forms) of 32-bit and odd-sized types; each checked; then a mismatched size, raised
    at the group's next call on every rank."""
    import torch

    import tensorwire as tw

    world = tw.world()
    n, r = world.size, world.rank
    dev = _device(r)
    g = tw.new_group()
    g.all_reduce(torch.ones(1, device=dev))  # sets the group's device path up
    if g.device.flags is None:
        return [f"rank {r}: no device flags (see the init log)"]
    wrong: list[str] = []
    salt = 0
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
                  torch.int8, torch.uint8):
        for op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG"):
            if op == "AVG" and not dtype.is_floating_point:
                continue
            for count, how in ((1, "in place"), (4099, "out"), (SLOT // dtype.itemsize, "async")):
                salt += 1
                parts = [_input(dtype, count, k, salt, op) for k in range(n)]
                x = parts[r].to(dev)
                if how == "in place":
                    g.all_reduce(x, op=tw.ReduceOp[op])
                    out = x
                elif how == "out":
                    out = torch.empty_like(x)
                    g.all_reduce(x, op=tw.ReduceOp[op], out=out)
                else:
                    g.all_reduce(x, op=tw.ReduceOp[op], async_op=True).wait()
                    out = x
                why = _close(out.cpu(), _reference(op, parts, dtype), parts, op, dtype)
                if why:
                    wrong.append(f"rank {r}: {dtype} {op} x{count} {how}: {why}")
    for dtype in (torch.float32, torch.bool, torch.complex64, torch.int16):
        for count in (1, 4099, SLOT // dtype.itemsize):
            salt += 1
            parts = [_input(dtype, count, k, salt) for k in range(n)]
            root = salt % n
            x = parts[r].to(dev)
            g.broadcast(x, root)
            if not torch.equal(x.cpu(), parts[root]):
                wrong.append(f"rank {r}: broadcast {dtype} x{count} from {root}")
            outs = [torch.empty(count, dtype=dtype, device=dev) for _ in range(n)]
            g.all_gather(outs, parts[r].to(dev))
            whole = torch.empty(n * count, dtype=dtype, device=dev)
            g.all_gather_into_tensor(whole, parts[r].to(dev), async_op=True).wait()
            if not torch.equal(torch.cat([o.cpu() for o in outs]), torch.cat(parts)) \
                    or not torch.equal(whole.cpu(), torch.cat(parts)):
                wrong.append(f"rank {r}: all_gather {dtype} x{count}")
    g.all_reduce(torch.ones(1000 if r == 0 else 999, device=dev))
    try:
        g.all_reduce(torch.ones(8, device=dev))
        torch.cuda.synchronize()
        g.all_reduce(torch.ones(8, device=dev))
        wrong.append(f"rank {r}: a mismatched size raised nothing")
    except tw.CollectiveMismatchError as exc:
        if "4000 B of float32, SUM" not in str(exc) or "3996 B of float32, SUM" not in str(exc):
            wrong.append(f"rank {r}: {exc}")
    return wrong


def _sums_of_ones(n: int, calls: int) -> float:
    """A float64 buffer of ones after `calls` sum all_reduces of `n` ranks, each folding in
    rank order (n ** calls is rounded once, the folds at every add: 3 ** 34 > 2 ** 53)."""
    import numpy as np

    v = np.float64(1)
    for _ in range(calls):
        v = functools.reduce(operator.add, [v] * n)
    return float(v)


def device_flags_graph() -> list[str]:
    """100 all_reduces of three sizes, an all_gather and a broadcast captured in one CUDA graph,
    replayed 10 times, each replay checked; a call off the device-flag path inside a capture is
    still a clear error."""
    import torch

    import tensorwire as tw

    world = tw.world()
    n, r = world.size, world.rank
    dev = _device(r)
    xs = [torch.ones(c, dtype=torch.float64, device=dev) for c in (1, 512, SLOT // 8)]
    mine, gathered = torch.full((4,), float(r), device=dev), torch.empty(4 * n, device=dev)
    for x in xs:  # the group's setup and each kind's compile happen outside the capture
        tw.all_reduce(x)
    tw.broadcast(mine, 0)
    tw.all_gather_into_tensor(gathered, mine)
    if world.device.flags is None:
        return [f"rank {r}: no device flags (see the init log)"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for k in range(100):
            tw.all_reduce(xs[k % 3])
        tw.all_gather_into_tensor(gathered, mine)
        tw.broadcast(mine, n - 1)
    wrong: list[str] = []
    want = torch.arange(n, dtype=torch.float32).repeat_interleave(4)
    for replay in range(10):
        for x in xs:
            x.fill_(1)
        mine.fill_(float(r))
        graph.replay()
        torch.cuda.synchronize()
        for x, calls in zip(xs, (34, 33, 33)):
            if not torch.all(x == _sums_of_ones(n, calls)).item():
                wrong.append(f"rank {r}: replay {replay}, {x.numel()} elements: {x[:3].tolist()}")
        if not torch.equal(gathered.cpu(), want) or not torch.all(mine == n - 1).item():
            wrong.append(f"rank {r}: replay {replay}: all_gather {gathered.tolist()}, "
                         f"broadcast {mine.tolist()}")
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            tw.all_reduce(torch.ones(SLOT // 4 + 1, device=dev))
        wrong.append(f"rank {r}: an all_reduce larger than the slot was captured")
    except tw.InvalidArgumentError as exc:
        if "CUDA graph" not in str(exc):
            wrong.append(f"rank {r}: {exc}")
    return wrong


def device_flags_lose_a_rank() -> float:
    """Rank 1 exits while rank 0 keeps making small all_reduces on the device-flag path: its
    kernels stop waiting once the host sees the loss, and a call raises PeerLostError."""
    import torch

    import tensorwire as tw

    world = tw.world()
    dev = _device(world.rank)
    x = torch.ones(8, device=dev)
    tw.all_reduce(x)
    assert world.device.flags is not None, f"rank {world.rank}: no device flags (see the init log)"
    world.barrier()
    if world.rank == 1:
        os._exit(3)
    start = time.monotonic()
    while time.monotonic() - start < 60:
        tw.all_reduce(x)
        time.sleep(0.001)
    return time.monotonic() - start


def lose_a_receiver() -> float:
    """Rank 1 leaves while rank 0 sends it a CUDA buffer: PeerLostError, not a hang."""
    import torch

    import tensorwire as tw

    world = tw.world()
    dev = _device(world.rank)
    x = torch.ones(1 << 22, device=dev)
    world.send(x, 1 - world.rank) if world.rank == 0 else world.recv(x, 0)  # the pair is wired
    world.barrier()
    if world.rank == 1:
        time.sleep(0.5)
        os._exit(3)
    start = time.monotonic()
    world.send(x, 1)
    return time.monotonic() - start


def mismatches(kinds: list[str]) -> list[str]:
    """Each kind of bad call on a fresh group of the world; what each raised, on this rank."""
    import numpy as np
    import torch

    import tensorwire as tw

    r = tw.world().rank
    dev = _device(r)
    raised = []
    for kind in kinds:
        g = tw.new_group()  # the last kind's error aborted its group, not this one
        x = torch.ones(1000, device=dev)
        try:
            if kind == "collective":
                g.all_reduce(x) if r == 0 else g.broadcast(x, 0)
            elif kind == "device":
                g.all_reduce(x) if r == 0 else g.all_reduce(np.ones(1000, np.float32))
            elif kind == "mixed":
                g.all_reduce(x, out=torch.empty(1000)) if r == 0 else g.all_reduce(x)
            elif kind == "count":
                g.all_reduce(x if r == 0 else torch.ones(999, device=dev))
            elif kind == "planned count":  # both ranks planned the signature; rank 1 leaves it
                for _ in range(2):
                    g.all_reduce(torch.ones(1000, device=dev))
                g.all_reduce(x if r == 0 else torch.ones(999, device=dev))
            raised.append("nothing")
        except Exception as exc:
            raised.append(f"{type(exc).__name__}: {exc}")
    return raised


def lose_a_rank() -> float:
    import torch

    import tensorwire as tw

    world = tw.world()
    dev = _device(world.rank)
    world.barrier()
    if world.rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        tw.all_reduce(torch.ones(1 << 22, device=dev))
    except tw.PeerLostError as exc:
        raise tw.PeerLostError(f"{exc} (after {time.monotonic() - start:.1f} s)") from None
    return time.monotonic() - start


# ------------------------------------------------------------------------------------ the tests

def _none_wrong(per_rank: list[list[str]]) -> None:
    wrong = [w for ws in per_rank for w in ws]
    assert not wrong, "\n".join(wrong)


def _cluster(n: int, **env: str) -> Cluster:
    return Cluster(n, {"TENSORWIRE_TIMEOUT": "30", **env})


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n, flags", [(1, "auto"), (2, "auto"), (3, "auto"), (4, "auto"), (3, "1")],
                         ids=["1", "2", "3", "4", "3-device-flags"])
def test_every_collective_op_and_dtype(n: int, flags: str) -> None:
    """`3-device-flags`: small all_reduces, broadcasts and all_gathers on the device-flag path
    (forced), between every other call on the same groups."""
    names = ["float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8", "bool",
             "complex64"]
    cluster = _cluster(n, TENSORWIRE_CUDA_DEVICE_FLAGS=flags)
    try:
        _none_wrong(cluster.run(every_collective, names, False, timeout=240))
        if n in (2, 3):  # both device-to-device paths: past the slot, reading buffers in place
            _none_wrong(cluster.run(every_collective, ["float32", "bfloat16", "int64", "uint8"], True,
                                    timeout=240))
        _none_wrong(cluster.run(rooted_vector_p2p_async, timeout=120))
    finally:
        cluster.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("env", [{"TENSORWIRE_CUDA_IPC": "0"}, {"TENSORWIRE_TRANSPORT": "tcp"}],
                         ids=["ipc-off", "tcp"])
def test_staged(env: dict[str, str]) -> None:
    cluster = _cluster(3, TENSORWIRE_CUDA_CHUNK="64K", **env)
    try:
        for large in (False, True):
            _none_wrong(cluster.run(every_collective, ["float32", "bfloat16", "int32", "bool"], large,
                                    timeout=240))
        _none_wrong(cluster.run(rooted_vector_p2p_async, timeout=120))
    finally:
        cluster.close()


_BAD_CALLS = {
    "collective": ("CollectiveMismatchError", "all_reduce of CUDA buffers", "broadcast of CUDA buffers"),
    "device": ("CollectiveMismatchError", "all_reduce of CUDA buffers", "buffers of the same kind"),
    "mixed": ("one call takes buffers of one device",),
    "count": ("CollectiveMismatchError", "count", "1000", "999"),
    "planned count": ("CollectiveMismatchError", "count", "1000", "999"),
}


@pytest.mark.timeout(120)
def test_errors_on_every_rank() -> None:
    """Each raised by the call itself: the host-flag path (the device-flag path raises a
    mismatch at the next call: test_small_calls_with_device_flags)."""
    cluster = _cluster(2, TENSORWIRE_CUDA_DEVICE_FLAGS="0")
    try:
        raised = cluster.run(mismatches, list(_BAD_CALLS), timeout=90)
    finally:
        cluster.close()
    for rank, texts in enumerate(raised):
        for (kind, expect), text in zip(_BAD_CALLS.items(), texts):
            assert all(e in text for e in expect), f"rank {rank}, {kind}: {text}"


@pytest.mark.timeout(240)
def test_point_to_point_device_to_device() -> None:
    """Between ranks of one host CUDA buffers go device to device; TENSORWIRE_CUDA_IPC=0
    stages them, with the same results."""
    for env, in_place in (({}, True), ({"TENSORWIRE_CUDA_IPC": "0"}, False)):
        cluster = _cluster(3, **env)
        try:
            _none_wrong(cluster.run(device_p2p, in_place, timeout=200))
        finally:
            cluster.close()


@pytest.mark.timeout(120)
def test_capture_in_a_cuda_graph_is_a_clear_error() -> None:
    """On the host-flag path every call (test_small_calls_with_device_flags: the other)."""
    cluster = _cluster(2, TENSORWIRE_CUDA_DEVICE_FLAGS="0")
    try:
        _none_wrong(cluster.run(graph_capture, timeout=90))
    finally:
        cluster.close()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scenario", [device_flags, device_flags_graph])
def test_small_calls_with_device_flags(scenario) -> None:
    """The device-flag path (forced: without MPS the ranks' kernels take turns on one GPU, slower
    but the same results) at 2 and 3 ranks."""
    for n in (2, 3):
        cluster = _cluster(n, TENSORWIRE_CUDA_DEVICE_FLAGS="1")
        try:
            _none_wrong(cluster.run(scenario, timeout=200))
        finally:
            cluster.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", [lose_a_rank, lose_a_receiver, device_flags_lose_a_rank],
                         ids=["collective", "device-send", "device-flags"])
def test_lost_peer_is_an_error_within_seconds(scenario) -> None:
    """A rank lost in a collective, while a CUDA send to it waits for its copy, or while small
    all_reduces wait for it on the GPU."""
    cluster = _cluster(2, TENSORWIRE_CUDA_DEVICE_FLAGS="1" if scenario is device_flags_lose_a_rank else "0")
    try:
        with pytest.raises(RankFailure) as failure:
            cluster.run(scenario, timeout=60)
        assert "PeerLostError" in failure.value.errors.get(0, ""), failure.value.errors
    finally:
        cluster.close()


@pytest.mark.timeout(240)
def test_torch_backend_and_ddp_on_cuda() -> None:
    from test_torch_backend import assert_all_ok, launch

    assert_all_ok(launch("torch_cuda", 2, script=_SELF, timeout=200), "torch_cuda")


def scenario_torch_cuda() -> None:
    import torch
    import torch.distributed as dist

    import tensorwire.torch  # noqa: F401

    rank = int(os.environ["RANK"])
    dev = _device(rank)
    dist.init_process_group("tensorwire")
    n = dist.get_world_size()
    x = torch.full((1000,), float(rank + 1), device=dev)
    dist.all_reduce(x)
    assert torch.all(x == n * (n + 1) / 2), x[:4]
    y = torch.full((3 << 20,), float(rank), device=dev)
    work = dist.all_reduce(y, async_op=True)
    value = work.get_future().wait()[0]
    assert torch.all(value == n * (n - 1) / 2)
    z = torch.full((5,), float(rank), device=dev)
    dist.broadcast(z, 1)
    assert torch.all(z == 1)
    out = torch.empty(2 * n, device=dev)
    dist.all_gather_into_tensor(out, torch.full((2,), float(rank), device=dev))
    assert out.tolist() == [float(q) for q in range(n) for _ in range(2)]
    rs = torch.empty(3, device=dev)
    dist.reduce_scatter_tensor(rs, torch.arange(3 * n, dtype=torch.float32, device=dev))
    assert rs.tolist() == [float(n * (3 * rank + i)) for i in range(3)]
    a2a = torch.empty(n, device=dev)
    dist.all_to_all_single(a2a, torch.full((n,), float(rank), device=dev))
    assert a2a.tolist() == [float(q) for q in range(n)]
    nc = torch.zeros(4, 3, device=dev).t()  # not contiguous
    nc += rank + 1
    dist.all_reduce(nc)
    assert torch.all(nc == n * (n + 1) / 2)
    dist.barrier()
    if rank == 0:
        dist.send(torch.arange(4, device=dev, dtype=torch.float32), 1)
    elif rank == 1:
        got = torch.empty(4, device=dev)
        dist.recv(got, 0)
        assert got.tolist() == [0.0, 1.0, 2.0, 3.0]
    # an irecv waited on a side stream: what that stream queues next sees the data
    if rank == 0:
        dist.send(torch.arange(1 << 20, device=dev, dtype=torch.float32), 1)
    elif rank == 1:
        side = torch.cuda.Stream()
        got = torch.empty(1 << 20, device=dev)
        with torch.cuda.stream(side):
            dist.irecv(got, 0).wait()
            twice = got * 2
        side.synchronize()
        assert torch.equal(twice, torch.arange(1 << 20, device=dev, dtype=torch.float32) * 2)
    # batch_isend_irecv around the ring (torch's P2POp), 4 MiB each way, each rank's send first
    right, left = (rank + 1) % n, (rank - 1) % n
    got = torch.empty(1 << 20, device=dev)
    ops = [dist.P2POp(dist.isend, torch.full((1 << 20,), float(rank), device=dev), right),
           dist.P2POp(dist.irecv, got, left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    assert torch.all(got == left).item(), got[:4]
    _ddp_matches_gloo(dev)
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_torch_distributed_all_reduce_in_a_cuda_graph() -> None:
    """torch.cuda.graph around dist.all_reduce on the device-flag path (forced)."""
    from test_torch_backend import assert_all_ok, launch

    assert_all_ok(launch("torch_cuda_graph", 2, script=_SELF, timeout=200, TENSORWIRE_CUDA_DEVICE_FLAGS="1"),
                  "torch_cuda_graph")


def scenario_torch_cuda_graph() -> None:
    """100 dist.all_reduce captured, the graph replayed 10 times, each replay checked."""
    import torch
    import torch.distributed as dist

    import tensorwire.torch  # noqa: F401

    rank = int(os.environ["RANK"])
    dev = _device(rank)
    dist.init_process_group("tensorwire")
    n = dist.get_world_size()
    x = torch.ones(1024, dtype=torch.float64, device=dev)
    dist.all_reduce(x)  # sets the group up and compiles the kernel, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(100):
            dist.all_reduce(x)
            x /= n - 0.5  # the data between calls changes too: a replay is the whole step
    for _ in range(10):
        x.fill_(1)
        graph.replay()
        torch.cuda.synchronize()
        want = 1.0
        for _ in range(100):
            want = want * n / (n - 0.5)
        assert torch.allclose(x, torch.full_like(x, want), rtol=1e-12), (x[:3].tolist(), want)
    dist.destroy_process_group()


def _ddp_matches_gloo(dev) -> None:
    """DDP with a CUDA model: tensorwire's losses equal Gloo's (Gloo moves CUDA tensors too)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    gloo = dist.new_group(backend="gloo")
    losses = {}
    for name, group in (("tensorwire", None), ("gloo", gloo)):
        torch.manual_seed(0)
        nn = torch.nn
        model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1)).to(dev)
        ddp = DDP(model, device_ids=[dev.index], process_group=group, bucket_cap_mb=0.05)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        gen = torch.Generator(device=dev).manual_seed(1 + dist.get_rank())
        curve = []
        for _ in range(8):
            x = torch.randn(64, 32, device=dev, generator=gen)
            loss = ddp(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        losses[name] = curve
    for a, b in zip(losses["tensorwire"], losses["gloo"]):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), losses


_SELF = __import__("pathlib").Path(__file__).resolve()

if __name__ == "__main__":
    from test_torch_backend import run_scenario  # the script's folder is on sys.path

    run_scenario(globals())
