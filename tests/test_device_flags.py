"""The device-flag path's kernel and protocol (gpu/flag_kernel.py, gpu/device_flags.py: small
all_reduce, broadcast and all_gather) on any machine: Triton's interpreter runs the same
kernel on the CPU, in real rank processes whose flags and slots lie in shared memory, as they
lie in IPC memory on a GPU. What this cannot
show (the GPU's memory ordering, the launch cost, graph capture) tests/test_gpu.py does on a
GPU. The interpreter has no clock: a kernel's limit counts spins there.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import tensorwire as tw
from cluster import Cluster, RankFailure

torch = pytest.importorskip("torch")
pytest.importorskip("triton", reason="Triton is not installed (the test extra installs it)")

_FLOATS = ("float32", "float64", "float16", "bfloat16")
_INTS = ("int32", "int64", "int8", "uint8")
_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG")


@contextlib.contextmanager
def _flag_path() -> Iterator[tuple[Any, Any]]:
    """A fresh group of the world and its device-flag path, whose areas are files of /dev/shm
    that every rank maps; the group is destroyed after."""
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel's module is first imported here
    from tensorwire.gpu.device_flags import DeviceFlags, area_bytes

    g = tw.new_group()
    size = area_bytes(g.runtime.config.cuda_slot)
    token = np.array([random.getrandbits(62) if g.rank == 0 else 0], dtype=np.int64)
    g.broadcast(token, 0)
    path = f"/dev/shm/tw-test-flags-{token[0]}-" + "{}"
    with open(path.format(g.rank), "wb") as f:
        f.truncate(size)  # zeros: the flags start at zero
    g.barrier()
    views = []
    for r in range(g.size):
        with open(path.format(r), "r+b") as f:
            views.append(np.frombuffer(mmap.mmap(f.fileno(), size), dtype=np.uint8))
    g.barrier()
    os.unlink(path.format(g.rank))
    try:
        yield g, DeviceFlags(g, [v.ctypes.data for v in views], "cpu")
    finally:
        g.destroy()


def _raised(call: Callable[[], Any], error: type[BaseException] = tw.TensorwireError) -> str:
    """What `call` raised (an `error`), or 'no error'."""
    try:
        call()
    except error as exc:
        return str(exc)
    return "no error"


def _inputs(case: tuple, rank: int, size: int) -> list:
    dtype, op, count, seed = case[:4]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for r in range(size):
        if dtype in _INTS or dtype == "bfloat16":  # bfloat16: whole numbers, as the interpreter rounds
            lo = 0 if dtype == "uint8" else -3          # float32 to bfloat16 its own way
            t = torch.randint(lo, 4, (count,), generator=gen, dtype=torch.int64)
        else:
            t = torch.randn(count, generator=gen, dtype=torch.float64)
        if dtype in _FLOATS and op in ("MIN", "MAX") and count > 3 and r == size - 1:
            t = t.double()
            t[3] = float("nan")  # a NaN wins, as on the host
        out.append(t.to(getattr(torch, dtype)))
    return out


def _expected(xs: list, dtype: str, op: str):
    """Every rank's input folded in rank order; float16 and bfloat16 in float32, rounded once."""
    wide = torch.float32 if dtype in ("float16", "bfloat16") else getattr(torch, dtype)
    acc = xs[0].to(wide)
    fold = {"SUM": torch.add, "AVG": torch.add, "PRODUCT": torch.mul, "MIN": torch.minimum,
            "MAX": torch.maximum}[op]
    for x in xs[1:]:
        acc = fold(acc, x.to(wide))
    if op == "AVG":
        acc = acc / len(xs)
    return acc.to(getattr(torch, dtype))


def _bits(t):
    return t.view(torch.uint8) if t.is_floating_point() else t


def _all_cases(cases: list[tuple]) -> list[str]:
    with _flag_path() as (g, flags):
        wrong = []
        for case in cases:
            dtype, op, count, seed, in_place = case
            xs = _inputs(case, g.rank, g.size)
            x = xs[g.rank].clone()
            y = x if in_place else torch.full_like(x, 7)
            assert flags.takes(x.numel() * x.element_size(), x.dtype, tw.ReduceOp[op])
            flags.all_reduce(x, y, tw.ReduceOp[op])
            want = _expected(xs, dtype, op)
            if dtype == "bfloat16" and op == "AVG":  # a third rounds in the interpreter its own way: an ulp
                ok = torch.allclose(y.float(), want.float(), rtol=2**-7, atol=0)
                if not ok:
                    wrong.append(f"rank {g.rank}: {case}: {y[:8].tolist()} != {want[:8].tolist()}")
                continue
            nan = torch.isnan(want) if want.is_floating_point() else torch.zeros_like(want, dtype=torch.bool)
            if not (torch.equal(torch.isnan(y) if y.is_floating_point() else nan, nan)
                    and torch.equal(_bits(y[~nan]), _bits(want[~nan]))):
                wrong.append(f"rank {g.rank}: {case}: {y[:8].tolist()} != {want[:8].tolist()}")
        flags.check()
    return wrong


@pytest.mark.timeout(600)
@pytest.mark.parametrize("size", [1, 2, 3])
def test_device_flag_all_reduce_matches_the_reference(get_cluster, size):
    """Every dtype and op the path takes, one element to more than one program's part (16 KiB),
    in place and not: bit for bit the rank-ordered fold (NaNs included), on every rank."""
    rng = random.Random(size)
    cases = []
    for dtype in _FLOATS + _INTS:
        for op in _OPS:
            if op == "AVG" and dtype in _INTS:
                continue
            two = (16 << 10) // getattr(torch, dtype).itemsize + 5  # two programs' parts
            count = rng.choice([1, 7, 1000, two])
            cases.append((dtype, op, count, rng.getrandbits(31), rng.random() < 0.5))
    results = get_cluster(size, "shm").run(_all_cases, cases, timeout=550)
    assert results == [[]] * size


def _movements(cases: list[tuple]) -> list[str]:
    with _flag_path() as (g, flags):
        wrong = []
        for dtype, count, root, in_place in cases:
            gen = torch.Generator().manual_seed(count)
            xs = [torch.randint(0, 256, (count * getattr(torch, dtype).itemsize,), generator=gen,
                                dtype=torch.uint8).view(getattr(torch, dtype)) for _ in range(g.size)]
            if dtype == "bool":
                xs = [x.view(torch.uint8).bitwise_and(1).view(torch.bool) for x in xs]
            assert flags.moves(xs[0].numel() * xs[0].element_size())
            x = xs[g.rank].clone()
            y = x if in_place else torch.zeros_like(x)
            flags.broadcast(x, y, root)
            if not torch.equal(y.view(torch.uint8), xs[root].view(torch.uint8)):
                wrong.append(f"rank {g.rank}: broadcast {dtype} x{count} from {root}")
            out = torch.zeros(g.size * count, dtype=x.dtype)
            x = out[g.rank * count:(g.rank + 1) * count] if in_place else xs[g.rank].clone()
            x.copy_(xs[g.rank])
            flags.all_gather(x, out)
            if not torch.equal(out.view(torch.uint8), torch.cat(xs).view(torch.uint8)):
                wrong.append(f"rank {g.rank}: all_gather {dtype} x{count}")
        flags.check()
    return wrong


@pytest.mark.timeout(300)
@pytest.mark.parametrize("size", [2, 3])
def test_device_flag_broadcast_and_all_gather_move_every_byte(get_cluster, size):
    """Any dtype, moved as 32-bit words where they fit and as bytes where not (an odd number of
    int16, bool), one element to two programs' parts, in place and not, every root."""
    rng = random.Random(size)
    cases = []
    for dtype in ("float32", "complex64", "bool", "int16", "float16", "uint8", "float64"):
        for _ in range(2):
            count = rng.choice([1, 7, (16 << 10) // getattr(torch, dtype).itemsize + 3])
            cases.append((dtype, count, rng.randrange(size), rng.random() < 0.5))
    assert get_cluster(size, "shm").run(_movements, cases, timeout=250) == [[]] * size


def _runs_ahead(calls: int) -> list[str]:
    with _flag_path() as (g, flags):
        rng = random.Random(g.rank)
        wrong = []
        for k in range(calls):
            if g.rank == k % g.size or rng.random() < 0.2:
                time.sleep(0.05)  # the others run ahead: they finish this call while it still reads
            n = 4000 + k % 3  # sizes vary with the call, alike on every rank; four blocks to read
            x = torch.arange(n, dtype=torch.float32) + 100 * g.rank + k
            flags.all_reduce(x, x, tw.ReduceOp.SUM)
            want = sum(torch.arange(n, dtype=torch.float32) + 100 * r + k for r in range(g.size))
            if not torch.equal(x, want):
                wrong.append(f"rank {g.rank} call {k}: {x.tolist()} != {want.tolist()}")
        flags.check()
    return wrong


@pytest.mark.timeout(300)
def test_calls_reuse_their_slots_while_a_rank_runs_ahead(get_cluster):
    """Twelve calls on three ranks, each late in turn: the others finish a call and write their
    next one's share while it still reads; each slot is written again only two calls later,
    once every peer has read it (with one slot instead of two this fails)."""
    assert get_cluster(3, "shm").run(_runs_ahead, 12, timeout=250) == [[]] * 3


def _mismatch(counts: list[int], ops: list[str]) -> str:
    with _flag_path() as (g, flags):
        x = torch.ones(counts[g.rank], dtype=torch.float32)
        if ops[g.rank] == "broadcast":
            flags.broadcast(x, x, 0)
        else:
            flags.all_reduce(x, x, tw.ReduceOp[ops[g.rank]])
        assert torch.equal(x, torch.ones_like(x)), "the output was touched"
        return _raised(flags.check, tw.CollectiveMismatchError)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("what", ["size", "op", "collective"])
def test_a_mismatched_call_is_an_error_on_every_rank(get_cluster, what):
    """Ranks that call with different sizes (one program's part, or more on one side), ops or
    collectives: each raises, naming the peer and both calls, and leaves its output as it was."""
    counts, ops = {"size": ([100, 100, 5000], ["SUM"] * 3), "op": ([64] * 3, ["SUM", "SUM", "MAX"]),
                   "collective": ([64] * 3, ["SUM", "broadcast", "SUM"])}[what]
    errors = get_cluster(3, "shm").run(_mismatch, counts, ops, timeout=250)
    for rank, text in enumerate(errors):
        kind = "broadcast" if ops[rank] == "broadcast" else "all_reduce"
        assert text.startswith(f"rank {rank}: {kind} on CUDA (device flags): group rank "), text
        expect = {"size": ("all_reduce of 20000 B of float32, SUM", "all_reduce of 400 B of float32, SUM"),
                  "op": ("all_reduce of 256 B of float32, MAX", "all_reduce of 256 B of float32, SUM"),
                  "collective": ("broadcast of 256 B of float32 from group rank 0",
                                 "all_reduce of 256 B of float32, SUM")}[what]
        assert all(e in text for e in expect), text


def _timeout() -> str:
    with _flag_path() as (g, flags):
        if g.rank == 0:
            x = torch.ones(10, dtype=torch.float64)
            started = time.perf_counter()
            flags.all_reduce(x, x, tw.ReduceOp.SUM, timeout=0.5)
            waited = time.perf_counter() - started
            assert waited < 30, f"the kernel waited {waited:.1f} s"
            assert torch.equal(x, torch.ones_like(x)), "the output was touched"
            return _raised(flags.check, tw.TimeoutError)
        seen = _raised(g.barrier)  # rank 1 never makes the call: rank 0's abort reaches it here
        return f"{seen} | {_raised(flags.check)}"  # the abort stopped this rank's path too


@pytest.mark.timeout(300)
def test_a_rank_that_never_calls_is_a_timeout_on_every_rank(get_cluster):
    """Rank 0's kernel gives up after its limit, leaves its output alone; rank 0 raises a
    TimeoutError naming the missing rank and aborts the group, so rank 1 raises it too."""
    first, second = get_cluster(2, "shm").run(_timeout, timeout=250)
    assert first.startswith("rank 0: all_reduce on CUDA (device flags): group rank 1 did not make the "
                            "call within 0.5 s"), first
    seen, later = second.split(" | ")
    assert all("group rank 1 did not make the call" in text for text in (seen, later)), second


def _alarm(how: str) -> str:
    with _flag_path() as (g, flags):
        if g.rank == 1:
            time.sleep(0.5)
            if how == "abort":
                g.abort(tw.AbortedError("rank 1 gave up"))
                return "aborted"
            x = torch.ones(10, dtype=torch.float32)  # a launch that fails: a type no kernel accumulates in
            return _raised(lambda: flags._launch(flags.kernel.ALL_REDUCE, x, x, x.dtype, tw.ReduceOp.SUM, 0,
                                                 (0, "no such type"), None), Exception)
        x = torch.ones(10, dtype=torch.float32)
        kernel = threading.Thread(target=flags.all_reduce, args=(x, x, tw.ReduceOp.SUM, 600.0))
        started = time.perf_counter()
        kernel.start()
        time.sleep(1.0)
        _raised(g.barrier)  # the host reads the abort, which tells the waiting kernel to stop
        kernel.join(60)
        waited = time.perf_counter() - started
        assert not kernel.is_alive() and waited < 30, f"the kernel still waits after {waited:.1f} s"
        return _raised(flags.check)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["abort", "launch"])
def test_an_abort_stops_a_kernel_waiting_for_a_peer(get_cluster, how):
    """A kernel waiting (limit 600 s) for a rank that aborts the group instead, or whose own
    launch fails (the launch aborts the group): once the host reads the abort, the kernel
    stops, and the path raises the group's error."""
    first, second = get_cluster(2, "shm").run(_alarm, how, timeout=250)
    if how == "abort":
        assert "rank 1 gave up" in first and second == "aborted", (first, second)
    else:
        assert second != "no error" and second.splitlines()[0][:60] in first, (first, second)


def _lose_a_rank() -> str:
    with _flag_path() as (g, flags):
        if g.rank == 1:
            time.sleep(1.0)  # rank 0's kernel waits for this rank meanwhile
            os._exit(3)
        x = torch.ones(10, dtype=torch.float32)
        started = time.perf_counter()
        flags.all_reduce(x, x, tw.ReduceOp.SUM, 600.0)  # the interpreter runs the kernel here: this
        waited = time.perf_counter() - started            # thread is held as a synchronize holds it
        try:
            flags.check()
        except tw.PeerLostError as exc:
            assert waited < 30 and "rank 1" in str(exc), (waited, str(exc))
            return str(exc)
        raise AssertionError(f"no PeerLostError after {waited:.1f} s")


@pytest.mark.timeout(300)
def test_a_lost_rank_stops_a_kernel_while_the_host_is_held():
    """Rank 1 exits while rank 0's kernel waits for it (limit 600 s) and rank 0's thread makes
    no call (held by the kernel, as by a synchronize or a full launch queue): the progress
    thread sees the loss, the kernel stops, and the path raises PeerLostError."""
    cluster = Cluster(2, {"TENSORWIRE_TRANSPORT": "auto"})
    try:
        with pytest.raises(RankFailure) as failure:
            cluster.run(_lose_a_rank, timeout=250)
        assert list(failure.value.errors) == [1], failure.value.errors  # rank 0 returned
    finally:
        cluster.close()


class _Compiled:
    """What Triton's compiled kernel offers: `[grid](*args, *constexprs)`, a grid of three, and
    ints that must fit the types of its first launch (OverflowError else, before launching)."""

    run = None

    def __init__(self, kinds: list[str], launched: list[tuple]) -> None:
        self.kinds, self.launched = kinds, launched

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        def runner(*args: Any) -> None:
            assert grid[2] == 1 and grid[1] == 1
            for a, kind in zip(args, self.kinds):
                if kind == "i32" and not -(1 << 31) <= a < 1 << 31:
                    raise OverflowError("signed integer is greater than maximum")
            self.launched.append(("compiled", grid, args))
        return runner


class _Jit:
    """Triton's JIT function: `[grid](*args, **constexprs)` compiles (counted) and launches."""

    def __init__(self) -> None:
        self.launched: list[tuple] = []
        self.compiles = 0

    def __getitem__(self, grid: tuple) -> Callable[..., _Compiled]:
        def run(*args: Any, **consts: Any) -> _Compiled:
            from triton.runtime.jit import mangle_type

            self.compiles += 1
            self.launched.append(("jit", grid, args, consts))
            return _Compiled([mangle_type(a) if isinstance(a, int) else "" for a in args], self.launched)
        return run


def test_launches_of_a_signature_seen_go_to_its_compiled_kernel() -> None:
    """device_flags.Launcher: the second launch of a signature skips Triton's binding (every
    argument, then the constexprs, in order, on a grid of three); an int past int32 or another
    dtype is another signature; a compiled launch Triton refuses goes its own way; nothing is
    kept in the interpreter or without Triton's types."""
    from triton.runtime.jit import mangle_type

    from tensorwire.gpu.device_flags import Launcher

    jit = _Jit()
    launcher = Launcher(jit, ("A", "B"), mangle_type)
    x, y = torch.zeros(4), torch.zeros(4)
    launcher.launch(3, (x, y, 5, 7), (1, 2))
    launcher.launch(3, (x, y, 6, 8), (1, 2))
    assert jit.compiles == 1 and jit.launched[-1] == ("compiled", (3, 1, 1), (x, y, 6, 8, 1, 2))
    launcher.launch(3, (x, y, 6, 1 << 40), (1, 2))  # int64 there: compiled afresh, as Triton does
    launcher.launch(3, (x, y.to(torch.float64), 6, 8), (1, 2))
    launcher.launch(3, (x, y, 6, 8), (1, 3))
    assert jit.compiles == 4, jit.launched
    launcher.launch(3, (x, y, 6, 1 << 41), (1, 2))
    assert jit.compiles == 4 and jit.launched[-1][0] == "compiled"
    first = next(iter(launcher.compiled))
    launcher.compiled[first] = _RefusingCompiled()
    launcher.launch(3, (x, y, 6, 8), (1, 2))
    assert jit.compiles == 5 and jit.launched[-1][0] == "jit"
    assert isinstance(launcher.compiled[first], _Compiled)
    for kept in (Launcher(_Jit(), ("A", "B"), mangle_type, keep=False), Launcher(_Jit(), ("A", "B"), None)):
        for _ in range(2):
            kept.launch(1, (x, y, 5, 7), (1, 2))
        assert kept.kernel.compiles == 2 and not kept.compiled


class _RefusingCompiled:
    run = None

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        def runner(*args: Any) -> None:
            raise OverflowError("signed integer is greater than maximum")
        return runner
