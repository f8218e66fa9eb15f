"""`ProcessGroupTensorwire`: every c10d operation of one torch process group, run by tensorwire.

torch 2.13 lets Python subclass `ProcessGroup` (not the lower-level `Backend`): torch's Python
functions call these methods directly, and C++ callers (DDP's reducer, functional collectives)
reach them through the pybind trampoline. Each method translates torch's calling convention
(lists of tensors, an options struct) into one or more calls on the tensorwire Group and wraps
them in a `TensorwireWork`.

- `opts.asyncOp` False (a plain `dist.all_reduce(t)`): the call runs inline on the caller's
  thread (tensorwire's fast path, no thread hop) and a completed Work is returned.
- `opts.asyncOp` True (`async_op=True`, DDP's bucket all-reduces, functional collectives): the
  call is queued on the group's worker, so communication overlaps whatever the caller does next.
- Tensors that are not contiguous go through a contiguous copy, copied back on completion.
- PREMUL_SUM multiplies each rank's input by its factor before a SUM (NCCL's definition: the
  factors may differ per rank); AVG is tensorwire's own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from sys import getrefcount
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ..buffers import as_array, like_torch, seen_torch_view
from ..errors import AbortedError, InvalidArgumentError
from ..group.group import Group
from ..ops import ReduceOp, premul_sum
from ..ops.finalize import finalize
from ..ops.validation import op_undefined
from .profiling import profiling, shown_to_profiler
from .work import CompletedWork, TensorwireWork, finished

BACKEND_NAME = "tensorwire"

Call = Callable[[bool, "float | None"], Any]  # (async_op, timeout) -> tensorwire Work or result


class _Staging:
    """One call's tensors: checked (a bad one is an error naming the rank and the call),
    contiguous stand-ins for non-contiguous ones, and the copies back on completion.

    `collective` False: a bad tensor raises on this rank only (point-to-point: nobody else
    waits on it), else it fails the call on every member."""

    def __init__(self, group: Group, what: str, collective: bool = True) -> None:
        self.group = group
        self.what = what
        self.collective = collective
        self.back: list[tuple[torch.Tensor, torch.Tensor]] = []

    def invalid(self, message: str) -> NoReturn:
        """A local argument error: fail the call everywhere (peers raise it too, nobody waits)."""
        error = InvalidArgumentError(f"rank {self.group.runtime.rank}: {self.what}: {message}")
        if self.collective:
            self.group.fail_fast(error)
        raise error

    def check(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor):
            self.invalid(f"the tensorwire backend expected a torch.Tensor, got {type(t).__name__}")
        if t.device.type not in ("cpu", "cuda"):
            self.invalid(f"the tensorwire backend moves CPU and CUDA tensors, got one on {t.device}")
        if t.is_sparse:
            self.invalid("the tensorwire backend takes sparse tensors in all_reduce (SUM) only; "
                         "pass t.to_dense() here")

    def one(self, tensors: Sequence[Any]) -> Any:
        """The one tensor (or list) c10d passes in `tensors` for this process."""
        if len(tensors) != 1:
            self.invalid(f"the tensorwire backend takes exactly one tensor per process (got {len(tensors)}); "
                         "one tensor per rank is all c10d passes")
        return tensors[0]

    def out(self, t: torch.Tensor) -> torch.Tensor:
        """A buffer a collective may write (and read: broadcast roots, in-place reductions)."""
        self.check(t)
        if t.is_contiguous():
            return t
        if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
            self.invalid("a tensor to write into has elements that share memory (a zero stride, as "
                         "expand() makes); pass a tensor of its own (t.clone())")
        buf = t.detach().contiguous()
        self.back.append((t, buf))
        return buf

    def inp(self, t: torch.Tensor) -> torch.Tensor:
        self.check(t)
        return t if t.is_contiguous() else t.contiguous()

    def scaled(self, t: torch.Tensor, factor: Any, *, in_place: bool = False) -> torch.Tensor:
        """factor * t, in place or as a new tensor (inputs the caller keeps must not change), by
        tensorwire's rule for every dtype (ops.finalize's PREMUL_SUM: 16-bit floats and float8
        in float32, integers exactly by a whole-number factor, another refused on any device):
        torch itself cannot scale a float8 tensor, nor an integer one by a float in place.
        Device tensors: torch's arithmetic. No factor scales a bool, on any device."""
        if t.dtype == torch.bool:
            why = op_undefined(ReduceOp.PREMUL_SUM, "b")
            self.invalid(f"PREMUL_SUM is not defined for torch.bool ({why})")
        integer = not (t.is_floating_point() or t.is_complex())
        try:  # a device tensor's factor is read only where it matters (a tensor factor syncs)
            red = premul_sum(factor) if t.is_cpu or integer else None
        except InvalidArgumentError as exc:
            self.group.fail_fast(exc)
        if integer and not float(red.factor).is_integer():  # type: ignore[union-attr,arg-type]
            self.invalid(f"PREMUL_SUM of a {t.dtype} tensor needs a whole-number factor, got {red.factor!r}: "  # type: ignore[union-attr]
                         f"each rank's input is scaled before the sum, and its share would be cut to an "
                         f"integer; scale the result instead, or reduce a floating-point copy")
        if not t.is_cpu:
            f = factor.to(t.device, t.dtype) if isinstance(factor, torch.Tensor) else factor
            return t.mul_(f) if in_place else t * f
        try:
            arr = as_array(t, writable=in_place, rank=self.group.runtime.rank, collective=self.what)
        except InvalidArgumentError as exc:
            self.group.fail_fast(exc)
        if not in_place:
            arr = arr.copy()
        try:
            finalize(arr, red, 1)  # type: ignore[arg-type]
        except InvalidArgumentError as exc:  # a dtype without arithmetic (an old ml_dtypes)
            self.invalid(str(exc))
        return t if in_place else like_torch(t, arr)

    def finish(self) -> Callable[[], None] | None:
        if not self.back:
            return None
        pairs = self.back

        def copy_back() -> None:
            with torch.no_grad():  # as the contiguous tensors are written: a Parameter's too
                for dst, src in pairs:
                    dst.copy_(src)

        return copy_back


_OPS = tuple(ReduceOp)  # by value: tensorwire numbers its ops as torch's RedOpType does
_SUM = dist.ReduceOp.SUM
_UNSET = dist.AllreduceOptions().timeout  # torch's "no timeout of the call's own"
_ALLREDUCE_OPTIONS, _BROADCAST_OPTIONS = dist.AllreduceOptions, dist.BroadcastOptions


def _seen(tensors: Any, opts: Any, kind: type[Any]) -> Any:
    """The view of a plain synchronous call's one small CPU tensor that a call made before
    (buffers.seen_torch_view), else None: such a call goes straight to the group's planned
    path, with the fewest reads through torch's bindings (docs/design/groups.md#torch-backend)."""
    if type(opts) is kind and type(tensors) is list and len(tensors) == 1 and not opts.asyncOp:
        return seen_torch_view(tensors[0])
    return None


def _reduction(opts: Any) -> tuple[ReduceOp, Any]:
    """(the op tensorwire runs, the PREMUL_SUM factor or None) from torch's options: SUM by
    one comparison, the rest by the op's value, as few reads through torch's bindings as can be."""
    rop = opts.reduceOp
    if rop == _SUM:
        return ReduceOp.SUM, None
    value = rop.op.value
    if not 0 <= value < len(_OPS):
        raise InvalidArgumentError(f"tensorwire backend: unknown reduce op {rop.op}")
    op = _OPS[value]
    if op is ReduceOp.PREMUL_SUM:
        factor = getattr(rop, "factor", None)
        if factor is None:
            raise InvalidArgumentError("PREMUL_SUM needs a factor (torch.distributed._make_nccl_premul_sum)")
        return ReduceOp.SUM, factor
    return op, None


class ProcessGroupTensorwire(dist.ProcessGroup):
    """One torch process group backed by one tensorwire Group (its context id on the wire)."""

    def __init__(self, group: Group, timeout: float | None, group_name: str = "",
                 release: Callable[[], None] | None = None) -> None:
        super().__init__(group.rank, group.size)
        self._tw = group
        self._timeout = timeout
        self._group_name = group_name
        self._group_desc = ""
        self._release = release
        self._closed = False
        self._compress = group.runtime.config.compress or None  # TENSORWIRE_COMPRESS
        done = self._done = CompletedWork(None)  # see _completed
        self._unheld = getrefcount(done)  # as _completed counts it while the group alone holds it
        for device in ("cpu", "cuda"):  # the devices torch's helpers ask of a group (_device_types:
            self._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, None)  # a
            # state dict's broadcast from rank 0, async checkpoints); _get_backend answers for them

    # -- identity ----------------------------------------------------------------------------
    @property
    def tensorwire_group(self) -> Group:
        """The tensorwire Group behind this process group (its numpy/buffer API works too)."""
        return self._tw

    def getBackendName(self) -> str:  # noqa: N802 - torch's virtual
        return BACKEND_NAME

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    # torch's helpers that look up the group's backend for a device (one serves every device);
    # torch's own C++ ops that do so (the `_out` functional collectives) cannot see this
    supports_splitting = supports_coalescing = supports_time_estimate = supports_tensor_alloc = False

    def _get_backend(self, device: Any) -> ProcessGroupTensorwire:
        return self

    def __repr__(self) -> str:
        return (f"ProcessGroupTensorwire(rank={self._tw.rank}, size={self._tw.size}, "
                f"name={self._group_name!r}, ranks={self._tw.ranks})")

    # -- running -----------------------------------------------------------------------------
    def _timeout_of(self, opts: Any, what: str) -> float | None:
        own = opts.timeout if opts is not None else _UNSET
        if own == _UNSET:  # the common case
            return self._timeout
        limit = own.total_seconds()  # (torch's options hold a timedelta)
        if limit <= 0:
            _Staging(self._tw, what).invalid(f"a call's timeout must be positive, got {own!r}")
        return limit

    def _completed(self, outputs: Any) -> CompletedWork:
        """The Work of a synchronous collective. Making a Work goes through torch's bindings, and
        torch's functions only wait on it and drop it (dist.all_reduce returns None): the group
        aims its Work at each call's outputs in turn while nobody else holds it, and makes a new
        one where somebody does (a caller of the method itself, or C++ through torch's holder),
        so a kept Work's result() stays its own call's. Point-to-point calls, which torch's API
        makes with no word of whether the caller waits at once (dist.irecv returns the Work),
        get their own."""
        done = self._done
        if getrefcount(done) == self._unheld:
            done.outputs = outputs
            return done
        done = self._done = CompletedWork(outputs)
        return done

    def _run(self, what: str, opts: Any, outputs: Any, calls: Sequence[Call],
             finish: Callable[[], None] | None = None) -> dist.Work:
        timeout = self._timeout_of(opts, what)
        if opts is not None and not opts.asyncOp:
            for call in calls:
                call(False, timeout)
            if finish is not None:
                finish()
            return self._completed(outputs)
        parts = [call(True, timeout) for call in calls]
        return TensorwireWork(parts, outputs, what, finish=finish, timeout=timeout)

    # -- reductions --------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        view = _seen(tensors, opts, _ALLREDUCE_OPTIONS)
        if view is not None and self._compress is None and opts.reduceOp == _SUM and not profiling():
            self._tw.all_reduce(view, ReduceOp.SUM, timeout=self._timeout_of(opts, "all_reduce"))
            return self._completed(tensors)
        return self._allreduce(tensors, opts)

    @shown_to_profiler("all_reduce")
    def _allreduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        """allreduce but its fast path, which skips the profiler's wrapper."""
        # type() first: cheaper than isinstance against torch.Tensor and hasattr on torch's
        # options (docs/design/groups.md#torch-backend)
        if type(tensors) is not list and isinstance(tensors, torch.Tensor):  # allreduce(t, op), pybind's
            tensors = [tensors]
        if type(opts) is not dist.AllreduceOptions and (opts is None or not hasattr(opts, "asyncOp")):
            op, opts = opts, dist.AllreduceOptions()
            if op is not None:
                opts.reduceOp = op
        op, factor = _reduction(opts)
        if factor is None and len(tensors) == 1 and not opts.asyncOp:
            t = tensors[0]
            if t.is_contiguous() and (t.is_cpu or t.is_cuda):  # a plain dist.all_reduce(t): most direct
                self._tw.all_reduce(t, op, timeout=self._timeout_of(opts, "all_reduce"),
                                    compress=None if self._compress is None else self._compressing(t, op))
                return self._completed(tensors)
        if len(tensors) == 1 and tensors[0].is_sparse:
            self._sparse_all_reduce(tensors[0], op, factor, self._timeout_of(opts, "all_reduce"))
            return CompletedWork(tensors) if opts.asyncOp else self._completed(tensors)
        st = _Staging(self._tw, "all_reduce")
        buf = st.out(st.one(tensors))
        if factor is not None:
            st.scaled(buf, factor, in_place=True)
        g = self._tw
        compress = None if self._compress is None else self._compressing(buf, op)
        return self._run("all_reduce", opts, tensors,
                         [lambda a, t: g.all_reduce(buf, op, async_op=a, timeout=t, compress=compress)],
                         st.finish())

    def _compressing(self, t: torch.Tensor, op: ReduceOp) -> str | None:
        """TENSORWIRE_COMPRESS where it applies: float32/float64 SUM and AVG in host memory."""
        if t.is_cpu and t.dtype in (torch.float32, torch.float64) and op in (ReduceOp.SUM, ReduceOp.AVG):
            return self._compress
        return None

    def _sparse_all_reduce(self, t: torch.Tensor, op: ReduceOp, factor: Any, timeout: float | None) -> None:
        """SUM of sparse COO tensors (what DDP sends for sparse gradients, and all Gloo offers):
        every rank's indices and values are gathered, summed locally and coalesced. In place
        (the tensor's nnz changes); synchronous even when asked for async, like its result."""
        if op is not ReduceOp.SUM or t.layout != torch.sparse_coo or not t.is_cpu:
            raise InvalidArgumentError(f"rank {self._tw.runtime.rank}: all_reduce of a sparse tensor "
                                       f"supports SUM on CPU COO tensors only (got {op.name}, {t.layout} on "
                                       f"{t.device})")
        g = self._tw
        src = t.coalesce()
        if factor is not None:
            src = src * factor
        sparse_dim = src.sparse_dim()
        indices = src.indices().t().contiguous()  # (nnz, sparse_dim)
        values = src.values().contiguous()  # (nnz, *dense shape)
        per_value = math.prod(values.shape[1:])
        counts = torch.zeros(g.size, dtype=torch.int64)
        g.all_gather_into_tensor(counts, torch.tensor([indices.shape[0]], dtype=torch.int64), timeout=timeout)
        nnz = [int(c) for c in counts]
        all_indices = torch.empty(sum(nnz), sparse_dim, dtype=torch.int64)
        all_values = torch.empty((sum(nnz), *values.shape[1:]), dtype=values.dtype)
        g.all_gatherv(all_indices, indices, [c * sparse_dim for c in nnz], timeout=timeout)
        g.all_gatherv(all_values, values, [c * per_value for c in nnz], timeout=timeout)
        total = torch.sparse_coo_tensor(all_indices.t(), all_values, t.shape).coalesce()
        t.copy_(total)

    @shown_to_profiler("all_reduce_coalesced")
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """One all-reduce per dtype over the tensors packed end to end."""
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        op, factor = _reduction(opts)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        checked = _Staging(self._tw, "all_reduce_coalesced")
        for t in tensors:
            checked.check(t)
            by_dtype.setdefault(t.dtype, []).append(t)
        calls: list[Call] = []
        unpack: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        g = self._tw
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group]) if len(group) > 1 else None
            if flat is None:
                st = _Staging(self._tw, "all_reduce_coalesced")
                buf = st.out(group[0])
                if st.back:
                    unpack.append((buf, group))
            else:
                buf = flat
                unpack.append((flat, group))
            if factor is not None:
                checked.scaled(buf, factor, in_place=True)
            compress = None if self._compress is None else self._compressing(buf, op)

            def call(a: bool, t: float | None, b: torch.Tensor = buf, c: str | None = compress) -> Any:
                return g.all_reduce(b, op, async_op=a, timeout=t, compress=c)
            calls.append(call)

        def finish() -> None:
            for flat, group in unpack:
                offset = 0
                for t in group:
                    n = t.numel()
                    t.copy_(flat.reshape(-1)[offset:offset + n].view(t.shape))
                    offset += n

        return self._run("all_reduce_coalesced", opts, tensors, calls, finish if unpack else None)

    @shown_to_profiler("reduce")
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceOptions()
        op, factor = _reduction(opts)
        root = opts.rootRank
        st = _Staging(self._tw, "reduce")
        t = st.one(tensors)
        buf = st.out(t) if self._tw.rank == root else st.inp(t)
        g = self._tw
        if factor is None:
            call: Call = lambda a, tm: g.reduce(buf, root, op, async_op=a, timeout=tm)  # noqa: E731
        else:
            src = st.scaled(buf, factor)
            out = buf if g.rank == root else None
            call = lambda a, tm: g.reduce(src, root, op, out=out, async_op=a, timeout=tm)  # noqa: E731
        return self._run("reduce", opts, tensors, [call], st.finish())

    @shown_to_profiler("reduce_scatter")
    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op, factor = _reduction(opts)
        st = _Staging(self._tw, "reduce_scatter")
        out = st.out(st.one(output_tensors))
        ins = [st.inp(t) for t in st.one(input_tensors)]
        if factor is not None:
            ins = [st.scaled(t, factor) for t in ins]
        g = self._tw
        return self._run("reduce_scatter", opts, output_tensors,
                         [lambda a, t: g.reduce_scatter(out, ins, op, async_op=a, timeout=t)], st.finish())

    @shown_to_profiler("reduce_scatter_tensor")
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op, factor = _reduction(opts)
        st = _Staging(self._tw, "reduce_scatter_tensor")
        out, inp = st.out(output), st.inp(input)
        if factor is not None:
            inp = st.scaled(inp, factor)
        g = self._tw
        return self._run("reduce_scatter_tensor", opts, [output],
                         [lambda a, t: g.reduce_scatter_tensor(out, inp, op, async_op=a, timeout=t)],
                         st.finish())

    _reduce_scatter_base = reduce_scatter_single

    @shown_to_profiler("reduce_scatter_tensor_coalesced")
    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        op, factor = _reduction(opts)
        st = _Staging(self._tw, "reduce_scatter_tensor_coalesced")
        calls: list[Call] = []
        g = self._tw
        for output, input in zip(outputs, inputs, strict=True):
            out, inp = st.out(output), st.inp(input)
            if factor is not None:
                inp = st.scaled(inp, factor)

            def call(a: bool, t: float | None, o: torch.Tensor = out, i: torch.Tensor = inp) -> Any:
                return g.reduce_scatter_tensor(o, i, op, async_op=a, timeout=t)
            calls.append(call)
        return self._run("reduce_scatter_tensor_coalesced", opts, outputs, calls, st.finish())

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement -----------------------------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        view = _seen(tensors, opts, _BROADCAST_OPTIONS)
        if view is not None and not profiling():
            self._tw.broadcast(view, opts.rootRank, timeout=self._timeout_of(opts, "broadcast"))
            return self._completed(tensors)
        return self._broadcast(tensors, opts)

    @shown_to_profiler("broadcast")
    def _broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        """broadcast but its fast path (as _allreduce)."""
        if isinstance(tensors, torch.Tensor):  # the pybind convenience form: broadcast(t, root)
            tensors = [tensors]
        if opts is None or not hasattr(opts, "asyncOp"):
            root, opts = opts, dist.BroadcastOptions()
            opts.rootRank = int(root or 0)
        root = opts.rootRank
        st = _Staging(self._tw, "broadcast")
        g = self._tw
        tensor = st.one(tensors)
        buf = st.inp(tensor) if g.rank == root else st.out(tensor)  # the root's is only read
        return self._run("broadcast", opts, tensors,
                         [lambda a, t: g.broadcast(buf, root, async_op=a, timeout=t)], st.finish())

    @shown_to_profiler("all_gather")
    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllgatherOptions()
        st = _Staging(self._tw, "all_gather")
        mine = st.one(output_tensors)
        outs = [st.out(t) for t in mine]
        inp = st.inp(st.one(input_tensors))
        g = self._tw
        return self._run("all_gather", opts, mine,  # the future's value: the list, as Gloo's
                         [lambda a, t: g.all_gather(outs, inp, async_op=a, timeout=t)], st.finish())

    @shown_to_profiler("all_gather_into_tensor")
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllgatherOptions()
        st = _Staging(self._tw, "all_gather_into_tensor")
        out, inp = st.out(output), st.inp(input)
        g = self._tw
        return self._run("all_gather_into_tensor", opts, [output],
                         [lambda a, t: g.all_gather_into_tensor(out, inp, async_op=a, timeout=t)],
                         st.finish())

    _allgather_base = all_gather_single

    @shown_to_profiler("all_gather_into_tensor_coalesced")
    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllgatherOptions()
        st = _Staging(self._tw, "all_gather_into_tensor_coalesced")
        g = self._tw
        calls: list[Call] = []
        for output, input in zip(outputs, inputs, strict=True):
            out, inp = st.out(output), st.inp(input)

            def call(a: bool, t: float | None, o: torch.Tensor = out, i: torch.Tensor = inp) -> Any:
                return g.all_gather_into_tensor(o, i, async_op=a, timeout=t)
            calls.append(call)
        return self._run("all_gather_into_tensor_coalesced", opts, outputs, calls, st.finish())

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @shown_to_profiler("all_gather_coalesced")
    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllgatherOptions()
        st = _Staging(self._tw, "all_gather_coalesced")
        g = self._tw
        calls: list[Call] = []
        for i, input in enumerate(inputs):  # output_lists[rank][i] receives rank's inputs[i]
            outs, inp = [st.out(per_rank[i]) for per_rank in output_lists], st.inp(input)

            def call(a: bool, t: float | None, o: list[torch.Tensor] = outs, i: torch.Tensor = inp) -> Any:
                return g.all_gather(o, i, async_op=a, timeout=t)
            calls.append(call)
        return self._run("all_gather_coalesced", opts, output_lists, calls, st.finish())

    @shown_to_profiler("gather")
    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.GatherOptions()
        root = opts.rootRank
        st = _Staging(self._tw, "gather")
        inp = st.inp(st.one(input_tensors))
        mine, outs = [], None  # the future's value: the root's gather_list, as Gloo's and NCCL's
        if self._tw.rank == root:
            mine = st.one(output_tensors)
            outs = [st.out(t) for t in mine]
        g = self._tw
        return self._run("gather", opts, mine,
                         [lambda a, t: g.gather(inp, outs, root, async_op=a, timeout=t)], st.finish())

    @shown_to_profiler("scatter")
    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.ScatterOptions()
        root = opts.rootRank
        st = _Staging(self._tw, "scatter")
        out = st.out(st.one(output_tensors))
        ins = None
        if self._tw.rank == root:
            ins = [st.inp(t) for t in st.one(input_tensors)]
        g = self._tw
        return self._run("scatter", opts, output_tensors,
                         [lambda a, t: g.scatter(out, ins, root, async_op=a, timeout=t)], st.finish())

    @shown_to_profiler("all_to_all")
    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllToAllOptions()
        st = _Staging(self._tw, "all_to_all")
        outs = [st.out(t) for t in output_tensors]
        ins = [st.inp(t) for t in input_tensors]
        g = self._tw
        return self._run("all_to_all", opts, output_tensors,
                         [lambda a, t: g.all_to_all(outs, ins, async_op=a, timeout=t)], st.finish())

    @shown_to_profiler("all_to_all_single")
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.AllToAllOptions()
        st = _Staging(self._tw, "all_to_all_single")
        out, inp = st.out(output), st.inp(input)
        osplit = list(output_split_sizes) or None
        isplit = list(input_split_sizes) or None
        g = self._tw
        return self._run("all_to_all_single", opts, [output],
                         [lambda a, t: g.all_to_all_single(out, inp, osplit, isplit, async_op=a, timeout=t)],
                         st.finish())

    alltoall_base = all_to_all_single

    @shown_to_profiler("barrier")
    def barrier(self, opts: Any = None) -> dist.Work:
        opts = opts if opts is not None else dist.BarrierOptions()
        g = self._tw
        return self._run("barrier", opts, [], [lambda a, t: g.barrier(async_op=a, timeout=t)])

    # -- point-to-point ------------------------------------------------------------------------
    @shown_to_profiler("send")
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        st = _Staging(self._tw, "send", collective=False)
        data = st.inp(st.one(tensors))
        part = self._tw.isend(data, dst, tag)
        if finished(part):  # a small send, in the peer's ring already
            return CompletedWork(tensors)
        return TensorwireWork([part], tensors, f"send to rank {dst}", timeout=self._timeout)

    @shown_to_profiler("recv")
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        st = _Staging(self._tw, "recv", collective=False)
        buf = st.out(st.one(tensors))
        part = self._tw.irecv(buf, src, tag)
        finish = st.finish()
        if finished(part):  # its message had arrived
            if finish is not None:
                finish()
            return CompletedWork(tensors, src)
        return TensorwireWork([part], tensors, f"recv from rank {src}", finish=finish,
                              timeout=self._timeout, source_rank=src)

    @shown_to_profiler("recv")
    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        """A receive from whichever rank sends first, found and received as its Work is waited on
        (or its future's helper thread waits)."""
        st = _Staging(self._tw, "recv", collective=False)
        buf = st.out(st.one(tensors))
        part = self._tw.irecv_any(buf, tag, self._timeout)
        return TensorwireWork([part], tensors, "recv from any rank", finish=st.finish(),
                              timeout=self._timeout, source_rank=part.result)

    # -- lifecycle -----------------------------------------------------------------------------
    def abort(self) -> None:
        self._tw.abort(AbortedError(f"rank {self._tw.runtime.rank}: process group {self._group_name!r} "
                                    f"was aborted (ProcessGroup.abort())"))
        self.shutdown()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._release is not None:
            self._release()



def _outside_compiled_code(cls: type) -> None:
    """The methods torch calls run eagerly where torch.compile traces their caller. Dynamo would
    otherwise trace them as the caller's code (dist.broadcast in a compiled function) or as
    frames of their own (DDP's C++ reducer calling back from a compiled forward), and fail on
    the process group, which it sees as an opaque object; Gloo's methods, in C++, it never
    enters. Marked, not wrapped: torch.compiler.disable's wrapper would cost every call."""
    try:
        from torch._C._dynamo import eval_frame
        skip = eval_frame._FrameExecStrategy(eval_frame._FrameAction.SKIP, eval_frame._FrameAction.SKIP)
        set_strategy = eval_frame.set_code_exec_strategy
    except (ImportError, AttributeError):  # a torch without Dynamo's frame strategies
        return
    for name, value in list(vars(cls).items()):
        if not name.startswith("_") and callable(value) and hasattr(value, "__code__"):
            value._torchdynamo_disable = True  # Dynamo's tracer calls it, not traces it
            set_strategy(value.__code__, skip)  # nor compiles its frames


_outside_compiled_code(ProcessGroupTensorwire)
