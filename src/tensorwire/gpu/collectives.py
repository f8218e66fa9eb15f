"""Collectives on CUDA buffers.

A group's device path is chosen at its first call on CUDA buffers, collectively:

- `ipc`: every rank on one host, and every rank could open every peer's memory and events
  through CUDA IPC. Calls move data device to device:
  - small calls (a rank's share fits `TENSORWIRE_CUDA_SLOT`): each rank owns two slots of
    device memory that its peers opened at setup. A call copies the rank's share into the
    slot of its parity, one host flag round (a barrier) says every share is there, and each
    rank reads what it needs straight out of its peers' slots. As on the host's one-shot
    path, a slot is refilled only once every peer's reads of it two calls ago have run.
    Where every rank's kernels run at once (a GPU per rank, or MPS), a small all_reduce,
    broadcast or all_gather is instead one kernel per rank that polls its peers' flags in GPU
    memory (device_flags.py): no host round, so CUDA graphs can capture it.
  - larger calls: each rank publishes where its buffers are (allocation handle and offset,
    an all_gather of small records) and reads its peers' buffers in place, one copy per byte
    at device speed; all_reduce is a reduce-scatter (rank r folds block r of every input)
    then an all-gather of the folded blocks. A closing flag round keeps a rank's buffers
    untouched until its peers' reads of them have run.
- `staged`: through pinned host buffers and the host collective (ranks on several hosts,
  `TENSORWIRE_TRANSPORT=tcp`, `TENSORWIRE_CUDA_IPC=0`, or IPC refused); all_reduces and
  broadcasts pipeline the copy to the host, the wire and the copy back in pieces.
- `alone`: a group of one rank.

Ordering is by CUDA events, never a device-wide synchronize. A rank's GPU work waits for its
peers' through interprocess events (cudaStreamWaitEvent); the host flag rounds only say that
those events were recorded. A blocking call queues its GPU work on the caller's current
stream and returns without waiting for the GPU (as NCCL does); `async_op=True` queues it on
the group's own stream after the caller's work, and `Work.wait()` makes the caller's current
stream wait for it. Reductions that torch's CUDA kernels lack (most of uint16/32/64, float8)
are staged and reduced on the host.

Every host round runs as a call of the group (its own sequence number, the call's
fingerprint with `wire.ON_DEVICE` set), so mismatches, lost peers and timeouts are the
host path's, on every rank.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..buffers import torch_dtype_to_numpy
from ..errors import InvalidArgumentError
from ..group.arguments import check_member, check_root, invalid
from ..group.p2p import P2PWork, position, receive, route_of
from ..group.planned import REPLAN
from ..ops import ReduceOp, Reduction
from ..ops.reduce_op import as_reduction
from ..ops.validation import op_undefined
from ..transport.wire import ON_DEVICE, Coll, Fingerprint
from ..work import Work
from . import ipc_path, kernels, staged, staging
from . import p2p as p2p_ipc
from .device_flags import DeviceFlags
from .device_group import DeviceGroup, DeviceWork
from .ipc_path import Spec
from .planned import SmallAllReduce
from .staged import Landing
from .tensors import as_device_tensor, caller_stream, code_of, same_device, torch_module

if TYPE_CHECKING:
    from ..group.group import Group
    from ..transport.requests import SendRequest

_LEAN = 1 << 20  # blocking all_reduces up to this size keep their pinned buffer (host_plans)
_PLANS = 64  # planned small all_reduce signatures per group
_CAPTURED = ("the current stream is capturing a CUDA graph, which can hold only small all_reduces, "
             "broadcasts and all_gathers on the device-flag path (docs/gpu.md): this call's GPU work is "
             "ordered after the peers' through host rounds that a replay would skip; make it outside "
             "torch.cuda.graph()")


class DeviceCollectives:
    """The collectives of one Group on CUDA buffers (Group.device)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.state: DeviceGroup | None = None
        self.plans: dict[tuple, SmallAllReduce] = {}  # small blocking all_reduces seen: (dtype, shape, op)
        self.tensor_type: type[Any] | None = None  # torch.Tensor, once a plan or the device-flag path exists
        self.flags: DeviceFlags | None = None  # the device-flag path, where the group has it
        self.current_device: Any = None  # torch's current-device lookup, with the path
        self.raw_stream: Any = None  # torch's current-raw-stream lookup, with the path
        self.flag_stream: int | None = None  # the stream of this rank's last flag kernel (0: the default)

    # -- common -----------------------------------------------------------------------------
    def _tensor(self, obj: Any, what: str, name: str = "tensor") -> Any:
        try:
            return as_device_tensor(obj, rank=self.group.runtime.rank, collective=what, name=name)
        except InvalidArgumentError as exc:
            self.group.fail_fast(exc)
            raise

    def _tensors(self, objs: Sequence[Any] | None, what: str, name: str, like: Any,
                 uneven: bool = False) -> list[Any]:
        """One tensor per rank, each of like's dtype and count (`uneven`: only this rank's count)."""
        g = self.group
        if objs is None or len(objs) != g.size:
            got = "None" if objs is None else str(len(objs))
            invalid(g, what, f"{name} must hold one tensor per rank ({g.size}), got {got}")
        out = [self._tensor(o, what, f"{name}[{i}]") for i, o in enumerate(objs)]
        for i, t in enumerate(out):
            if t.dtype != like.dtype or (t.numel() != like.numel() and (not uneven or i == g.rank)):
                invalid(g, what, f"{name}[{i}] is {t.numel()} x {t.dtype}, expected {like.numel()} x "
                        f"{like.dtype}")
        return out

    def _device(self, tensors: list[Any], what: str, coll: Coll, timeout: float | None,
                capturable: bool = False) -> DeviceGroup:
        """The group's device state, set up by the first device call (`coll`, `what`). Under
        graph capture only a `capturable` call on a group set up already gets it: the caller
        then refuses the capture unless its call takes the device-flag path."""
        g = self.group
        if torch_module().cuda.is_current_stream_capturing() and (
                not capturable or self.state is None or self.state.flags is None):
            invalid(g, what, _CAPTURED)
        try:
            dev = same_device(tensors, rank=g.runtime.rank, collective=what)
        except InvalidArgumentError as exc:
            g.fail_fast(exc)
        state = self.state
        if state is None:
            fp = Fingerprint(coll | ON_DEVICE, code_of(tensors[0].dtype)[0])
            state = self.state = DeviceGroup(g, dev, fp, what, timeout)
            if state.flags is not None:
                self.flags, self.tensor_type = state.flags, torch_module().Tensor
                torch = torch_module()
                self.current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
                self.raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream",
                                          lambda d: torch.cuda.current_stream(d).cuda_stream)
        elif state.device != dev:
            invalid(g, what, f"group {g.name} moves CUDA buffers of cuda:{state.device} (its first device "
                    f"call's); this call passed cuda:{dev}: make one group per device")
        return state

    def _fp(self, coll: Coll, dtype: Any, red: Reduction | None = None, root: int = -1,
            count: int = -1) -> Fingerprint:
        code = code_of(dtype)[0]
        if red is None:
            return Fingerprint(coll | ON_DEVICE, code, 0, root, count, 0)
        aux = 0 if red.factor is None else struct.unpack("<Q", struct.pack("<d", red.factor))[0]
        return Fingerprint(coll | ON_DEVICE, code, red.op, root, count, aux)

    def _reduction(self, op: Any, dtype: Any, what: str) -> Reduction:
        g = self.group
        try:
            red = as_reduction(op, rank=g.runtime.rank, collective=what)
        except InvalidArgumentError as exc:
            g.fail_fast(exc)
        why = op_undefined(red.op, code_of(dtype)[1])
        if why:
            invalid(g, what, f"{red.op.name} is not defined for {dtype} ({why})")
        return red

    def _on_device(self, dg: DeviceGroup, red: Reduction | None, dtype: Any, nbytes: int) -> bool:
        """Does this call move device to device (else: staged)? Every rank finds the same: the
        path, the size (every rank's share) and torch's kernels are alike everywhere."""
        if dg.mode == "staged" or (nbytes < dg.host_below and dg.mode == "ipc"):
            return False
        return red is None or kernels.runs_on_device(red, dtype, dg.device)

    # -- reductions -------------------------------------------------------------------------------
    def all_reduce(self, tensor: Any, op: Any, out: Any, async_op: bool, timeout: float | None) -> Any:
        what, g = "all_reduce", self.group
        if type(tensor) is self.tensor_type and out is None and not async_op and type(op) is ReduceOp and \
                (timeout is None or type(timeout) is float and 0.0 < timeout < math.inf):  # else: checked
            flags, state, nbytes = self.flags, self.state, tensor.numel() * tensor.element_size()
            if flags is not None and state is not None and nbytes >= state.host_below \
                    and flags.takes(nbytes, tensor.dtype, op) and tensor.is_contiguous() and not g.destroyed \
                    and not tensor.is_neg() and tensor.get_device() == state.device == self.current_device():
                self._in_order(state.device)
                flags.all_reduce(tensor, tensor, op, timeout)  # on the current stream
                return tensor
            plan = self.plans.get((tensor.dtype, tensor.shape, op))
            if plan is not None and not g.queue.busy and not g.queue.pending and plan.runs(tensor):
                done = plan(tensor, timeout)
                if done is not REPLAN:
                    return done
                return g.device.all_reduce(tensor, op, out, async_op, timeout)  # the group renewed itself
        check_member(g, what)
        src = self._tensor(tensor, what)
        dst = src if out is None else self._tensor(out, what, "out")
        if dst is not src and (dst.dtype != src.dtype or dst.numel() != src.numel()):
            invalid(g, what, f"out has {dst.numel()} x {dst.dtype}, tensor {src.numel()} x {src.dtype}")
        dg = self._device([src, dst], what, Coll.ALL_REDUCE, timeout, capturable=True)
        red = self._reduction(op, src.dtype, what)
        result = tensor if out is None else out
        sf = src.reshape(-1)
        df = sf if dst is src else dst.reshape(-1)  # one object where one memory: staged, one mirror
        n, nbytes = sf.numel(), sf.numel() * sf.element_size()
        flags = dg.flags
        if flags is not None and nbytes >= dg.host_below and flags.takes(nbytes, src.dtype, red.op):
            if df is not sf and ipc_path.overlap(sf, df):  # the kernel reads its part before it writes
                sf = sf.clone()
            return self._flag_call(dg, what, tensor, [sf, df],
                                   lambda: flags.all_reduce(sf, df, red.op, timeout), async_op, result)
        self._refuse_capture(what)
        if not self._on_device(dg, red, src.dtype, nbytes):
            if not async_op and dg.mode != "alone" and nbytes <= _LEAN:
                return staged.host_all_reduce(dg, tensor, sf, df, red, timeout, result)
            return staged.chunked(dg, tensor, sf, df, True, lambda s, d, a: g.all_reduce(
                s, red, out=None if d is s else d, async_op=a, timeout=timeout), async_op, result)
        fp = self._fp(Coll.ALL_REDUCE, src.dtype, red, count=n)
        small = ipc_path.small(dg, nbytes)
        key = (src.dtype, src.shape, op)
        if small and n and src is tensor and type(src) is torch_module().Tensor and out is None \
                and not async_op and type(op) is ReduceOp and not src.is_complex() \
                and key not in self.plans and len(self.plans) < _PLANS:  # repeats: gpu/planned.py
            self.plans[key] = SmallAllReduce(g, dg, src, red, fp)
            self.tensor_type = type(src)
        if small or dg.mode == "alone":
            def fold_all(shares: list[Any]) -> None:
                kernels.fold(df, shares, red.op)
                kernels.finalize(df, red, g.size)

            spec = Spec(sf, nbytes, src.dtype, fold_all, result)
        elif dg.one_gpu:
            def lead(shares: list[Any]) -> None:
                if g.rank == 0:  # one process computes for all: no kernel of one waits for another's
                    kernels.fold(df, shares, red.op)
                    kernels.finalize(df, red, g.size)
                    for r in range(1, g.size):
                        spec.outs[r].copy_(df)

            spec = Spec(sf, nbytes, src.dtype, lead, result, out=df)
        else:
            bounds = ipc_path.blocks(n, g.size)
            lo, hi = bounds[g.rank]

            def fold_mine(shares: list[Any]) -> None:
                mine = df[lo:hi]
                kernels.fold(mine, [s[lo:hi] for s in shares], red.op)
                kernels.finalize(mine, red, g.size)

            def gather(outs: list[Any]) -> None:
                for r, (a, b) in enumerate(bounds):
                    if r != g.rank and b > a:
                        df[a:b].copy_(outs[r][a:b])

            spec = Spec(sf, nbytes, src.dtype, fold_mine, result, gather, df)
        return ipc_path.run(dg, what, fp, spec, tensor, [src, dst], async_op, timeout)

    def _flag_call(self, dg: DeviceGroup, what: str, obj: Any, tensors: list[Any], launch: Any,
                   async_op: bool, result: Any, after: Any = None) -> Any:
        """One kernel launch (gpu/device_flags.py), `launch()`, on the call's stream; then
        `after()` there, if given."""
        st = dg.begin(obj, tensors, async_op, False)
        with dg.on(st), torch_module().cuda.device(dg.device):
            self._in_order(dg.device)
            launch()
            if after is not None:
                after()
            if st.end is not None:
                st.end.record(st.stream)
        if not async_op:
            return result
        queued = Work(what, self.group.runtime.rank)
        queued.finish()
        return DeviceWork(queued, st.end, st.stream, dg.device, result)

    def _refuse_capture(self, what: str) -> None:
        """A call off the device-flag path cannot be captured (see _CAPTURED)."""
        if torch_module().cuda.is_current_stream_capturing():
            invalid(self.group, what, _CAPTURED)

    def _in_order(self, device: int) -> None:
        """A rank's device-flag kernels of a group run one after another (each advances its
        own call counts, device_flags.py): a call on another stream than the last one's waits
        for it there (not inside a graph capture, which may not wait on work outside it)."""
        stream = self.raw_stream(device)
        if stream != self.flag_stream:
            torch = torch_module()
            if self.flag_stream is not None and not torch.cuda.is_current_stream_capturing():
                last = torch.cuda.Event()
                last.record(torch.cuda.ExternalStream(self.flag_stream, device=device))
                torch.cuda.current_stream(device).wait_event(last)
            self.flag_stream = stream

    def reduce(self, tensor: Any, dst: int, op: Any, out: Any, async_op: bool, timeout: float | None) -> Any:
        what, g = "reduce", self.group
        root = check_root(g, dst, what, "dst")
        src = self._tensor(tensor, what)
        target = src
        if g.rank == root and out is not None:
            target = self._tensor(out, what, "out")
            if target.dtype != src.dtype or target.numel() != src.numel():
                invalid(g, what, f"out has {target.numel()} x {target.dtype}, tensor {src.numel()} x "
                        f"{src.dtype}")
        dg = self._device([src, target], what, Coll.REDUCE, timeout)
        red = self._reduction(op, src.dtype, what)
        result = out if (out is not None and g.rank == root) else tensor
        sf = src.reshape(-1)
        tf = sf if target is src else target.reshape(-1)
        if not self._on_device(dg, red, src.dtype, sf.numel() * sf.element_size()):
            mine = g.rank == root
            return staged.chunked(dg, tensor, sf, tf, True, lambda s, d, a: g.reduce(
                s, root, red, out=d if mine and d is not s else None, async_op=a, timeout=timeout),
                                  async_op, result)

        def fold_at_root(shares: list[Any]) -> None:
            if g.rank == root:
                kernels.fold(tf, shares, red.op)
                kernels.finalize(tf, red, g.size)

        spec = Spec(sf, sf.numel() * sf.element_size(), src.dtype, fold_at_root, result)
        return ipc_path.run(dg, what, self._fp(Coll.REDUCE, src.dtype, red, root, sf.numel()), spec, tensor,
                            [src, target], async_op, timeout)

    def reduce_scatter(self, output: Any, input_list: Sequence[Any], op: Any, async_op: bool,
                       timeout: float | None) -> Any:
        what, g = "reduce_scatter", self.group
        check_member(g, what)
        out = self._tensor(output, what, "output")
        ins = self._tensors(input_list, what, "input_list", out, uneven=True)
        if any(t.numel() != out.numel() for t in ins):  # uneven blocks: through the host
            dg = self._device([out, *ins], what, Coll.REDUCE_SCATTERV, timeout)
            red = self._reduction(op, out.dtype, what)  # refused before anything is staged
            return staged.whole(dg, output, ins, [out], lambda h, a: g.reduce_scatter(
                h(out), [h(t) for t in ins], red, async_op=a, timeout=timeout), async_op, output)
        return self._reduce_scatter(what, output, out, ins, op, async_op, timeout)

    def reduce_scatter_tensor(self, output: Any, input: Any, op: Any, async_op: bool,
                              timeout: float | None) -> Any:
        what, g = "reduce_scatter_tensor", self.group
        check_member(g, what)
        out = self._tensor(output, what, "output")
        inp = self._tensor(input, what, "input")
        if inp.dtype != out.dtype or inp.numel() != out.numel() * g.size:
            invalid(g, what, f"input is {inp.numel()} x {inp.dtype}, expected {g.size} x output "
                    f"({out.numel()} x {out.dtype})")
        return self._reduce_scatter(what, output, out, list(inp.reshape(-1).chunk(g.size)) if out.numel()
                                    else [inp.reshape(-1)] * g.size, op, async_op, timeout, inp)

    def _reduce_scatter(self, what: str, result: Any, out: Any, ins: list[Any], op: Any, async_op: bool,
                        timeout: float | None, whole: Any = None) -> Any:
        g = self.group
        dg = self._device([out, *ins], what, Coll.REDUCE_SCATTER, timeout)
        red = self._reduction(op, out.dtype, what)
        of, m = out.reshape(-1), out.numel()
        if not self._on_device(dg, red, out.dtype, m * g.size * out.element_size()):
            return staged.whole(dg, result, ins, [out], lambda h, a: g.reduce_scatter(
                h(out), [h(t) for t in ins], red, async_op=a, timeout=timeout), async_op, result)
        flat = whole.reshape(-1) if whole is not None else ipc_path.joined(ins)
        if ipc_path.overlap(flat, of) and not (whole is not None and of.data_ptr() == ins[g.rank].data_ptr()):
            flat = flat.clone()  # peers read every block of it while this rank writes its output
        me = g.rank

        def fold_mine(shares: list[Any]) -> None:
            kernels.fold(of, [s[me * m:(me + 1) * m] for s in shares], red.op)
            kernels.finalize(of, red, g.size)

        spec = Spec(flat, flat.numel() * flat.element_size(), out.dtype, fold_mine, result)
        return ipc_path.run(dg, what, self._fp(Coll.REDUCE_SCATTER, out.dtype, red, count=m * g.size), spec,
                            result, [out, flat], async_op, timeout)

    def reduce_scatterv(self, output: Any, input: Any, counts: Sequence[int], op: Any, async_op: bool,
                        timeout: float | None) -> Any:
        what, g = "reduce_scatterv", self.group
        out, inp = self._tensor(output, what, "output"), self._tensor(input, what, "input")
        dg = self._device([out, inp], what, Coll.REDUCE_SCATTERV, timeout)
        return staged.whole(dg, output, [inp], [out], lambda h, a: g.reduce_scatterv(
            h(out), h(inp), counts, op, async_op=a, timeout=timeout), async_op, output)

    # -- data movement ----------------------------------------------------------------------------
    def broadcast(self, tensor: Any, src: int, out: Any, async_op: bool, timeout: float | None) -> Any:
        what, g = "broadcast", self.group
        root = check_root(g, src, what, "src")
        data = self._tensor(tensor, what)
        target = data if out is None else self._tensor(out, what, "out")
        if target is not data and (target.dtype != data.dtype or target.numel() != data.numel()):
            invalid(g, what, f"out has {target.numel()} x {target.dtype}, tensor {data.numel()} x "
                    f"{data.dtype}")
        dg = self._device([data, target], what, Coll.BROADCAST, timeout, capturable=True)
        result = tensor if out is None else out
        df = data.reshape(-1)
        tf = df if target is data else target.reshape(-1)
        mine = g.rank == root
        flags, nbytes = dg.flags, df.numel() * df.element_size()
        if flags is not None and nbytes >= dg.host_below and flags.moves(nbytes):
            if tf is not df and ipc_path.overlap(df, tf):
                df = df.clone()
            return self._flag_call(dg, what, tensor, [df, tf], lambda: flags.broadcast(df, tf, root, timeout),
                                   async_op, result)
        self._refuse_capture(what)
        if not self._on_device(dg, None, data.dtype, df.numel() * df.element_size()):
            return staged.chunked(dg, tensor, df, tf, mine, lambda s, d, a: g.broadcast(
                s, root, out=None if d is s else d, async_op=a, timeout=timeout), async_op, result)

        def take(shares: list[Any]) -> None:
            if not mine:
                tf.copy_(shares[root])
            elif tf.data_ptr() != df.data_ptr():
                tf.copy_(df)

        spec = Spec(df if mine else None, df.numel() * df.element_size(), data.dtype, take, result)
        return ipc_path.run(dg, what, self._fp(Coll.BROADCAST, data.dtype, root=root, count=df.numel()), spec,
                            tensor, [data, target], async_op, timeout)

    def all_gather(self, tensor_list: Sequence[Any], tensor: Any, async_op: bool,
                   timeout: float | None) -> Any:
        what, g = "all_gather", self.group
        check_member(g, what)
        inp = self._tensor(tensor, what)
        outs = self._tensors(tensor_list, what, "tensor_list", inp, uneven=True)
        if any(o.numel() != inp.numel() for o in outs):  # uneven blocks: through the host
            dg = self._device([inp, *outs], what, Coll.ALL_GATHERV, timeout)
            return staged.whole(dg, tensor_list, [inp], outs, lambda h, a: g.all_gather(
                [h(o) for o in outs], h(inp), async_op=a, timeout=timeout), async_op, tensor_list)
        return self._all_gather(what, tensor_list, inp, [o.reshape(-1) for o in outs], async_op, timeout,
                                None)

    def all_gather_into_tensor(self, output: Any, input: Any, async_op: bool, timeout: float | None) -> Any:
        what, g = "all_gather_into_tensor", self.group
        check_member(g, what)
        out, inp = self._tensor(output, what, "output"), self._tensor(input, what, "input")
        if out.dtype != inp.dtype or out.numel() != inp.numel() * g.size:
            invalid(g, what, f"output is {out.numel()} x {out.dtype}, expected {g.size} x input "
                    f"({inp.numel()} x {inp.dtype})")
        of, m = out.reshape(-1), inp.numel()
        return self._all_gather(what, output, inp, [of[r * m:(r + 1) * m] for r in range(g.size)],
                                async_op, timeout, of)

    def _all_gather(self, what: str, result: Any, inp: Any, outs: list[Any], async_op: bool,
                    timeout: float | None, whole: Any) -> Any:
        """`whole`: the flat output `outs` are parts of (all_gather_into_tensor), else None."""
        g = self.group
        dg = self._device([inp, *outs], what, Coll.ALL_GATHER, timeout, capturable=True)
        flat = inp.reshape(-1)
        flags, nbytes = dg.flags, flat.numel() * flat.element_size()
        if flags is not None and nbytes >= dg.host_below and flags.moves(nbytes):
            if any(ipc_path.overlap(flat, o) for r, o in enumerate(outs) if r != g.rank):
                flat = flat.clone()
            m = flat.numel()
            gathered = whole if whole is not None else torch_module().empty(g.size * m, dtype=flat.dtype,
                                                                            device=flat.device)

            def scatter_list() -> None:  # the list form: from one buffer into the caller's tensors
                if whole is None:
                    for r, o in enumerate(outs):
                        o.copy_(gathered[r * m:(r + 1) * m])

            return self._flag_call(dg, what, result, [flat, *outs, gathered],
                                   lambda: flags.all_gather(flat, gathered, timeout), async_op, result,
                                   scatter_list)
        self._refuse_capture(what)
        if not self._on_device(dg, None, inp.dtype, flat.numel() * flat.element_size()):
            return staged.whole(dg, result, [flat], outs, lambda h, a: g.all_gather(
                [h(o) for o in outs], h(flat), async_op=a, timeout=timeout), async_op, result)
        me = g.rank
        if any(ipc_path.overlap(flat, o) for r, o in enumerate(outs) if r != me):
            flat = flat.clone()

        def take(shares: list[Any]) -> None:
            for r, o in enumerate(outs):
                if r != me:
                    o.copy_(shares[r])
                elif o.data_ptr() != flat.data_ptr():
                    o.copy_(flat)

        spec = Spec(flat, flat.numel() * flat.element_size(), inp.dtype, take, result)
        return ipc_path.run(dg, what, self._fp(Coll.ALL_GATHER, inp.dtype, count=flat.numel()), spec, result,
                            [flat, *outs], async_op, timeout)

    def all_to_all(self, output_list: Sequence[Any], input_list: Sequence[Any], async_op: bool,
                   timeout: float | None) -> Any:
        what, g = "all_to_all", self.group
        check_member(g, what)
        if len(output_list) != g.size or len(input_list) != g.size:
            invalid(g, what, f"output_list and input_list must hold one tensor per rank ({g.size}), got "
                    f"{len(output_list)} and {len(input_list)}")
        outs = [self._tensor(o, what, f"output_list[{i}]") for i, o in enumerate(output_list)]
        ins = [self._tensor(t, what, f"input_list[{i}]") for i, t in enumerate(input_list)]
        if len({(t.numel(), t.dtype) for t in outs + ins}) > 1:  # uneven blocks: through the host
            dg = self._device([*outs, *ins], what, Coll.ALL_TO_ALLV, timeout)
            return staged.whole(dg, output_list, ins, outs, lambda h, a: g.all_to_all(
                [h(o) for o in outs], [h(t) for t in ins], async_op=a, timeout=timeout),
                                async_op, output_list)
        return self._all_to_all(what, output_list, [o.reshape(-1) for o in outs], ins, None, async_op,
                                timeout)

    def all_to_all_single(self, output: Any, input: Any, output_split_sizes: Sequence[int] | None,
                          input_split_sizes: Sequence[int] | None, async_op: bool,
                          timeout: float | None) -> Any:
        what, g = "all_to_all_single", self.group
        check_member(g, what)
        out, inp = self._tensor(output, what, "output"), self._tensor(input, what, "input")
        even = all(s is None or len(set(s)) <= 1 for s in (output_split_sizes, input_split_sizes))
        if out.dtype != inp.dtype:
            invalid(g, what, f"output is {out.dtype}, input {inp.dtype}")
        if not even or inp.numel() % g.size or out.numel() != inp.numel():
            dg = self._device([out, inp], what, Coll.ALL_TO_ALLV, timeout)
            return staged.whole(dg, output, [inp], [out], lambda h, a: g.all_to_all_single(
                h(out), h(inp), output_split_sizes, input_split_sizes, async_op=a, timeout=timeout),
                                async_op, output)
        m = out.numel() // g.size
        of = out.reshape(-1)
        return self._all_to_all(what, output, [of[r * m:(r + 1) * m] for r in range(g.size)], None,
                                inp.reshape(-1), async_op, timeout)

    def _all_to_all(self, what: str, result: Any, outs: list[Any], ins: list[Any] | None, whole: Any,
                    async_op: bool, timeout: float | None) -> Any:
        g = self.group
        dg = self._device([*outs, *(ins or [whole])], what, Coll.ALL_TO_ALL, timeout)
        flat = whole if whole is not None else ipc_path.joined(ins)  # type: ignore[arg-type]
        dtype, m = flat.dtype, outs[0].numel()
        if not self._on_device(dg, None, dtype, flat.numel() * flat.element_size()):
            return staged.whole(dg, result, [flat], outs, lambda h, a: g.all_to_all(
                [h(o) for o in outs], list(h(flat).chunk(g.size)) if m else [h(flat)] * g.size,
                async_op=a, timeout=timeout), async_op, result)
        if any(ipc_path.overlap(flat, o) for o in outs):
            flat = flat.clone()  # peers read its blocks while this rank writes its outputs
        me = g.rank

        def take(shares: list[Any]) -> None:
            for r, o in enumerate(outs):
                o.copy_(shares[r][me * m:(me + 1) * m])

        spec = Spec(flat, flat.numel() * flat.element_size(), dtype, take, result)
        return ipc_path.run(dg, what, self._fp(Coll.ALL_TO_ALL, dtype, count=flat.numel()), spec, result,
                            [flat, *outs], async_op, timeout)

    # -- staged only: rooted and vector calls; point-to-point device to device where it can ---
    def gather(self, tensor: Any, gather_list: Sequence[Any] | None, dst: int, async_op: bool,
               timeout: float | None) -> Any:
        what, g = "gather", self.group
        root = check_root(g, dst, what, "dst")
        inp = self._tensor(tensor, what)
        outs = self._tensors(gather_list, what, "gather_list", inp) if g.rank == root else []
        dg = self._device([inp, *outs], what, Coll.GATHER, timeout)
        return staged.whole(dg, tensor, [inp], outs, lambda h, a: g.gather(
            h(inp), [h(o) for o in outs] if outs else None, root, async_op=a, timeout=timeout),
                            async_op, gather_list)

    def scatter(self, tensor: Any, scatter_list: Sequence[Any] | None, src: int, async_op: bool,
                timeout: float | None) -> Any:
        what, g = "scatter", self.group
        root = check_root(g, src, what, "src")
        out = self._tensor(tensor, what)
        ins = self._tensors(scatter_list, what, "scatter_list", out) if g.rank == root else []
        dg = self._device([out, *ins], what, Coll.SCATTER, timeout)
        return staged.whole(dg, tensor, ins, [out], lambda h, a: g.scatter(
            h(out), [h(t) for t in ins] if ins else None, root, async_op=a, timeout=timeout),
                            async_op, tensor)

    def all_gatherv(self, output: Any, input: Any, counts: Sequence[int], async_op: bool,
                    timeout: float | None) -> Any:
        what, g = "all_gatherv", self.group
        out, inp = self._tensor(output, what, "output"), self._tensor(input, what, "input")
        dg = self._device([out, inp], what, Coll.ALL_GATHERV, timeout)
        return staged.whole(dg, output, [inp], [out], lambda h, a: g.all_gatherv(
            h(out), h(inp), counts, async_op=a, timeout=timeout), async_op, output)

    def gatherv(self, output: Any, input: Any, counts: Sequence[int], dst: int, async_op: bool,
                timeout: float | None) -> Any:
        what, g = "gatherv", self.group
        inp = self._tensor(input, what, "input")
        out = self._tensor(output, what, "output") if g.rank == dst and output is not None else None
        dg = self._device([inp] + ([out] if out is not None else []), what, Coll.GATHERV, timeout)
        return staged.whole(dg, input, [inp], [out] if out is not None else [], lambda h, a: g.gatherv(
            h(out) if out is not None else None, h(inp), counts, dst, async_op=a, timeout=timeout),
                            async_op, output)

    def scatterv(self, output: Any, input: Any, counts: Sequence[int], src: int, async_op: bool,
                 timeout: float | None) -> Any:
        what, g = "scatterv", self.group
        out = self._tensor(output, what, "output")
        inp = self._tensor(input, what, "input") if g.rank == src and input is not None else None
        dg = self._device([out] + ([inp] if inp is not None else []), what, Coll.SCATTERV, timeout)
        return staged.whole(dg, output, [inp] if inp is not None else [], [out], lambda h, a: g.scatterv(
            h(out), h(inp) if inp is not None else None, counts, src, async_op=a, timeout=timeout),
                            async_op, output)

    def isend(self, tensor: Any, dst: int, tag: int) -> Work:
        t = self.check_p2p(tensor, "send")
        stream = caller_stream(tensor, t.device.index)
        if self.p2p_in_place():
            sent = self._send_in_place(t, stream, dst, tag)
            if sent is not None:
                return sent
        torch = torch_module()
        buf = staging.take(t.numel() * t.element_size())
        host = staging.mirror(buf, t)
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record()
        arrived.synchronize()
        work = self.group.isend(host, dst, tag)
        work.add_done_callback(lambda _w: staging.give_back(buf))
        return work

    def irecv(self, tensor: Any, src: int, tag: int) -> Work:
        t = self.check_p2p(tensor, "recv")
        stream = caller_stream(tensor, t.device.index)
        buf = staging.take(t.numel() * t.element_size())
        host = staging.mirror(buf, t)
        target = p2p_ipc.Target(t, stream) if self.p2p_in_place() and t.numel() else None
        return Landing(receive(self.group, host, src, tag, target), t, host, buf, stream, target)

    def irecv_any(self, tensor: Any, tag: int, timeout: float | None) -> Work:
        t = self.check_p2p(tensor, "recv")
        buf = staging.take(t.numel() * t.element_size())
        host = staging.mirror(buf, t)
        return Landing(self.group.irecv_any(host, tag, timeout), t, host, buf,
                       caller_stream(tensor, t.device.index))

    def _send_in_place(self, t: Any, stream: Any, dst: int, tag: int) -> Work | None:
        """Send `t` (written on `stream`, the caller's) device to device where shared memory
        joins this rank to `dst` (gpu/p2p.py); None where it cannot go so: stage it."""
        g = self.group
        dtype = torch_dtype_to_numpy(t.dtype)
        nbytes = t.numel() * t.element_size()
        if dtype is None or not nbytes or p2p_ipc.staged_faster(nbytes):
            return None
        route = route_of(g, True, dst, tag, nbytes, dtype)
        channel = g.engine.channels.get(route.peer)
        if channel is None or channel.kind != "shm":
            return None  # not wired yet (its first send connects), or on another host
        body = p2p_ipc.describe(t, stream)
        if body is None:
            return None
        source = p2p_ipc.Source(t)
        req = g.engine.isend_device(route.peer, route.header, body, source, route.label, position(g))
        if req is None:
            return None
        g.engine.watch_in_background(req)
        return _Sent(g, req, t.device.index)

    def p2p_in_place(self) -> bool:
        """May point-to-point messages go device to device (gpu/p2p.py) where shared memory
        joins the ranks? Not with TENSORWIRE_CUDA_IPC=0 or TENSORWIRE_TRANSPORT=tcp."""
        cfg = self.group.runtime.config
        return cfg.cuda_ipc and cfg.transport != "tcp"

    def check_p2p(self, tensor: Any, what: str) -> Any:
        """A bad buffer fails this rank's call only: nobody else waits on a point-to-point call."""
        rank = self.group.runtime.rank
        if torch_module().cuda.is_current_stream_capturing():
            raise InvalidArgumentError(f"rank {rank}: {what}: {_CAPTURED}")
        return as_device_tensor(tensor, rank=rank, collective=what, name="tensor")


class _Sent(P2PWork):
    """A send device to device: done once the receiver queued its copy; a waiter's current
    stream then waits for that copy before it may write the buffer again."""

    def __init__(self, group: Group, req: SendRequest, device: int) -> None:
        super().__init__(group, req)
        self.sent = req
        self.device = device

    def wait(self, timeout: float | None = None) -> bool:
        super().wait(timeout)
        copied = self.sent.copied
        if copied is not None:
            p2p_ipc.wait_copied(copied, self.sent.peer, torch_module().cuda.current_stream(self.device))
        return True
