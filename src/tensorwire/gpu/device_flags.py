"""The device-flag path: a small all_reduce, broadcast or all_gather on CUDA buffers as one
kernel launch per rank.

Where every rank's kernels run at once (a GPU per rank, or ranks sharing a GPU under MPS), a
small call needs no host round: each rank's kernel (gpu/flag_kernel.py, Triton) writes its
share into its slot, raises its flag and polls its peers' flags in IPC memory. With no
host in the loop, a CUDA graph can capture the call. Where the processes' kernels time-slice
one GPU (no MPS), a kernel waiting for another's would wait a time slice each call, so the
host-flag path (ipc_path) stays. The group's device setup (device_group.py) chooses, the same
on every rank, and names the choice in the init log.

Errors: a kernel that finds a peer's call differ, waits past the group's timeout, or is told
the group failed, leaves its output untouched and says so in status words in pinned host
memory; the host raises at the group's next call, on every rank through the group's abort.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..errors import AbortedError, CollectiveMismatchError, TimeoutError
from ..ops import ReduceOp
from .tensors import code_of

_OPS = {ReduceOp.SUM: 0, ReduceOp.PRODUCT: 1, ReduceOp.MIN: 2, ReduceOp.MAX: 3, ReduceOp.AVG: 4}
_FLOATS = ("float16", "bfloat16", "float32", "float64")
_TYPES = _FLOATS + ("int8", "uint8", "int32", "int64")
_NAMES = (*_TYPES, "bool", "int16", "uint16", "uint32", "uint64", "complex64", "complex128", "float8_e4m3fn",
          "float8_e5m2")  # what a message may name (a broadcast or all_gather moves any dtype)
_WIDE = {"float16": "float32", "bfloat16": "float32"}  # folded in float32, rounded once
_BLOCK = 1024
_INTERPRETED_SPIN_NS = 20_000  # Triton's CPU interpreter has no clock: a spin there takes about this
_MAX_WAIT_NS = 1 << 61  # an infinite timeout, as the kernel's int64 takes it (beside flag_kernel.WIDE)


def available() -> str:
    """Why the path cannot run in this process ('' where it can): Triton must import."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install
        return f"Triton cannot be imported ({type(exc).__name__}: {exc})"
    return ""


def mps_running() -> bool:
    """Is an MPS control daemon serving this process's clients (its pipe directory)?"""
    pipes = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    return os.path.exists(os.path.join(pipes, "control"))


def slot_bytes(slot: int) -> int:
    """The path's slot for TENSORWIRE_CUDA_SLOT=`slot`: at most 1 MiB, 64 programs, so every
    rank's programs of a call fit on the GPU at once (a program waits for its peers')."""
    return min(slot, 1 << 20)


def area_bytes(slot: int) -> int:
    """Bytes of a rank's IPC area the path uses after the host-flag slots: two slots, flags."""
    from .flag_kernel import CHUNK_BYTES, WORDS

    slot = slot_bytes(slot)
    return 2 * slot + -(-slot // CHUNK_BYTES) * WORDS * 8


_CONSTEXPRS = ("NRANKS", "MODE", "OP", "ACC", "CHUNK", "BLOCK", "SLOT", "CLOCK")  # flag_kernel.one_shot's
_KINDS = ("all_reduce", "broadcast", "all_gather")  # flag_kernel's ALL_REDUCE, BROADCAST, ALL_GATHER


def fingerprint(mode: int, nbytes: int, dtype: Any, aux: int) -> int:
    """A call's signature in one int64, what a peer's kernel compares: the collective, one
    rank's share in bytes, the dtype, and the op (all_reduce) or root (broadcast, its low 12
    bits)."""
    return nbytes << 24 | mode << 20 | code_of(dtype)[0] << 12 | (aux & 0xFFF)


def describe(fp: int) -> str:
    names = {code_of(name)[0]: name for name in _NAMES}
    mode, aux = fp >> 20 & 0xF, fp & 0xFFF
    kind = _KINDS[mode] if mode < len(_KINDS) else "?"
    what = f"{kind} of {fp >> 24} B of {names.get(fp >> 12 & 0xFF, '?')}"
    if mode == 0:
        return f"{what}, {ReduceOp(aux).name}"
    return f"{what} from group rank {aux}" if mode == 1 else what


class DeviceFlags:
    """One group's device-flag path on this rank.

    Built from where every rank's flag area and two slots begin in this process (`areas`,
    `area_bytes` long each); its table of addresses goes to `device`, its status words to
    host memory the kernel can write (pinned, for a CUDA device). A failure of the group, or
    the loss of a member, tells waiting kernels to stop (Failures.alarms)."""

    def __init__(self, group: Any, areas: list[int], device: Any) -> None:
        import torch
        import triton.language as tl
        import triton.runtime.jit as jit

        from . import flag_kernel

        self.kernel, self.tl = flag_kernel, tl
        cfg, self.engine = group.runtime.config, group.engine
        self.rank, self.size, self.timeout = group.rank, group.size, cfg.timeout
        self.slot = slot_bytes(cfg.cuda_slot)
        self.status = torch.zeros(flag_kernel.STATUS_WORDS, dtype=torch.int64,
                                  pin_memory=torch.device(device).type == "cuda")
        self.words = self.status.numpy()
        self.table = torch.tensor([a + 2 * self.slot for a in areas] + list(areas) + [self.status.data_ptr()],
                                  dtype=torch.int64, device=device)
        self.members = set(group.ranks) - {group.runtime.rank}
        self.abort = group.abort  # every member raises the error
        engine, ctx = group.engine, group.ctx
        self.reason: Callable[[], BaseException | None] = lambda: engine.aborted.get(ctx, (0, None))[1]
        self.interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        self.capturing: Callable[[], bool] = (lambda: False) if self.interpreted else \
            torch.cuda.is_current_stream_capturing
        self.error: BaseException | None = None
        self.lost: int | None = None  # the member whose loss stopped the path
        self.launcher = Launcher(flag_kernel.one_shot, _CONSTEXPRS, getattr(jit, "mangle_type", None),
                                 keep=not self.interpreted)
        engine.alarms[ctx] = self.alarm

    def takes(self, nbytes: int, dtype: Any, op: Any) -> bool:
        """Does an all_reduce of this signature take the path? The same answer on every rank
        for the same call: it depends on nothing else."""
        name = str(dtype).removeprefix("torch.")
        return 0 < nbytes <= self.slot and name in _TYPES and op in _OPS \
            and (op is not ReduceOp.AVG or name in _FLOATS)

    def moves(self, nbytes: int) -> bool:
        """Does a broadcast or all_gather whose every rank's share is `nbytes` take the path?"""
        return 0 < nbytes <= self.slot

    def all_reduce(self, src: Any, dst: Any, op: ReduceOp, timeout: float | None = None) -> None:
        """Queue the call's kernel on the current stream (of `src`'s device). `dst` is `src`
        or does not overlap it."""
        name = str(src.dtype).removeprefix("torch.")
        acc = getattr(self.tl, _WIDE.get(name, name))
        self._launch(self.kernel.ALL_REDUCE, src, dst, src.dtype, int(op), 0, (_OPS[op], acc), timeout)

    def broadcast(self, src: Any, dst: Any, root: int, timeout: float | None = None) -> None:
        """dst = the root's src (any dtype; dst may be src, a non-root's src is not read)."""
        x, y = _words(src, dst)
        self._launch(self.kernel.BROADCAST, x, y, src.dtype, root, root, (0, None), timeout)

    def all_gather(self, src: Any, dst: Any, timeout: float | None = None) -> None:
        """dst (size x src's elements, flat) = every rank's src in rank order; src may be this
        rank's part of dst, and overlaps no other part."""
        x, y = _words(src, dst)
        self._launch(self.kernel.ALL_GATHER, x, y, src.dtype, 0, 0, (0, None), timeout)

    def _launch(self, mode: int, x: Any, y: Any, dtype: Any, aux: int, root: int, fold: tuple[int, Any],
                timeout: float | None) -> None:
        """`aux`: the fingerprint's op (ReduceOp) or root; `fold`: the kernel's op and the
        type it accumulates in (all_reduce). No host round: every _GLANCE calls, one look at
        the sockets (an abort, a lost rank), as other calls that never wait make; and while
        the kernel may wait, the progress thread looks too (Engine.watch_peers), for a graph's
        replays as long as the process lives."""
        engine = self.engine
        capturing = self.capturing()
        engine.until_glance -= 1
        if engine.until_glance <= 0 and not capturing:  # a glance may synchronize (p2p arrivals)
            engine.glance()
        self.check()
        k, n, esize = self.kernel, x.numel(), x.element_size()
        nbytes, chunk = n * esize, k.CHUNK_BYTES // esize
        seconds = self.timeout if timeout is None else timeout
        engine.watch_peers(float("inf") if capturing else seconds)
        ns = _MAX_WAIT_NS if seconds * 1e9 >= _MAX_WAIT_NS else int(seconds * 1e9)  # inf included
        limit = ns // _INTERPRETED_SPIN_NS if self.interpreted else ns
        fp = k.WIDE | fingerprint(mode, nbytes, dtype, aux)
        consts = (self.size, mode, fold[0], fold[1], chunk, min(_BLOCK, chunk), self.slot // esize,
                  not self.interpreted)  # one_shot's constexprs, in its order
        try:
            args = (x, y, self.table, n, self.rank, root, fp, k.WIDE + limit)
            self.launcher.launch(-(-nbytes // k.CHUNK_BYTES), args, consts)
        except BaseException as exc:  # a compile or launch error: the peers' kernels are already waiting
            self.abort(exc)
            raise

    def check(self) -> None:
        """Raise what ended an earlier call early (and abort the group with it, once)."""
        if self.error is not None:
            raise self.error
        code = int(self.words[0])
        if code == 0:
            return
        k = self.kernel
        peer, theirs, mine = (int(w) & ~k.WIDE for w in self.words[1:4])
        kind = _KINDS[mine >> 20 & 0xF] if code in (k.MISMATCH, k.TIMEOUT) else "a small call"
        where = f"rank {self.rank}: {kind} on CUDA (device flags)"
        if code == k.MISMATCH:
            self.error = CollectiveMismatchError(f"{where}: group rank {peer} called it with "
                                                 f"{describe(theirs)}, this rank with {describe(mine)}")
        elif code == k.TIMEOUT:
            waited = theirs * (_INTERPRETED_SPIN_NS if self.interpreted else 1) / 1e9
            self.error = TimeoutError(f"{where}: group rank {peer} did not make the call within "
                                      f"{waited:g} s (its kernel never raised its flag)")
        else:  # the group failed, or a member was lost (alarm)
            self.error = self.reason() or (self.engine.lost_error(self.lost) if self.lost is not None else
                                           AbortedError(f"{where}: the group failed"))
        self.abort(self.error)
        raise self.error

    def alarm(self, peer: int | None) -> None:
        """The group failed (peer None) or a rank was lost: kernels waiting stop waiting."""
        if (peer is None or peer in self.members) and self.words[0] == 0:
            self.lost = peer
            self.words[0] = self.kernel.ABORTED


class Launcher:
    """Launches of one Triton kernel, a signature launched before straight from its compiled
    form: Triton's own launch binds and keys every argument each call. The key is what Triton
    specializes a kernel on: the constexprs, each tensor's dtype and 16-byte alignment, and
    the type it gives each int (`int_type`, triton.runtime.jit.mangle_type; None: nothing is
    kept). A compiled launch Triton refuses before launching goes its own way."""

    def __init__(self, kernel: Any, constexprs: tuple[str, ...], int_type: Callable[[int], Any] | None,
                 keep: bool = True) -> None:
        self.kernel, self.constexprs, self.int_type = kernel, constexprs, int_type
        self.keep = keep and int_type is not None
        self.compiled: dict[tuple, Any] = {}

    def launch(self, blocks: int, args: tuple, consts: tuple) -> None:
        """Run the kernel on `blocks` programs with `args` (tensors, then ints) and the values
        of its constexprs, in its order."""
        grid = (blocks, 1, 1)  # three dimensions, as a compiled kernel takes them
        key = None
        int_type = self.int_type
        if self.keep and int_type is not None:  # (keep: an int_type)
            key = (consts, *(a.dtype if hasattr(a, "dtype") else int_type(a) for a in args),
                   *(a.data_ptr() % 16 for a in args if hasattr(a, "data_ptr")))
            compiled = self.compiled.get(key)
            if compiled is not None:
                try:
                    compiled[grid](*args, *consts)
                    return
                except OverflowError:  # an int past the type the kernel was compiled for
                    del self.compiled[key]
                except TypeError:  # a Triton whose compiled launch takes other arguments (3.2)
                    self.keep = False
                    self.compiled.clear()
        compiled = self.kernel[grid](*args, **dict(zip(self.constexprs, consts)))
        if key is not None and hasattr(compiled, "run"):
            self.compiled[key] = compiled


def _words(*buffers: Any) -> list[Any]:
    """Flat buffers as one type that views them all, the wider of int32 and uint8: moving
    bytes needs no dtype."""
    import torch

    flat = [b.reshape(-1).view(torch.uint8) for b in buffers]
    if all(f.numel() % 4 == 0 and f.data_ptr() % 4 == 0 for f in flat):
        return [f.view(torch.int32) for f in flat]
    return flat
