"""The collectives of a Group: check arguments, fingerprint, pick an algorithm, run.

Each is bound as a method of Group (group/group.py). A call of a signature planned before takes
its plan at the top (group/planned.py); any other is checked (group/arguments.py), planned
if it can be, and submitted to the group's execution queue with its body (group/bodies.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import buffers
from ..algorithms.base import blocks_of
from ..algorithms.direct_plans import BroadcastPlan, GatherPlan, ReducePlan, ScatterPlan, TensorPlan
from ..errors import InvalidArgumentError
from ..gpu import is_device_buffer as _on_device
from ..ops import ReduceOp, Reduction
from ..ops.compress import codec_for
from ..transport.wire import Coll
from ..tuning import tuner
from . import bodies
from .arguments import (
    apart,
    array,
    array_list,
    check_counts,
    check_member,
    check_root,
    fingerprint,
    fits_out,
    flats,
    invalid,
    is_rank,
    planned,
    planned_list,
    reduction,
    same_dtype,
    split_rows,
    usable,
)
from .bodies import SELECT
from .planned import REPLAN

if TYPE_CHECKING:
    from ..gpu.collectives import DeviceCollectives
    from .calls import CollectiveCall
    from .group import Group

def _device(group: Group, timeout: float | None, what: str) -> DeviceCollectives:
    """The group's collectives on CUDA buffers, looked up once what a refused call left is
    settled: a renewal (renewal.py) replaces them with the group's segment."""
    group.queue.settle(timeout, what)
    return group.device


# -- reductions -------------------------------------------------------------------------------
def all_reduce(group: Group, tensor: Any, op: Any = ReduceOp.SUM, *, out: Any = None,
               async_op: bool = False, timeout: float | None = None, compress: str | None = None) -> Any:
    """Reduce `tensor` over the group; in place, or into `out` leaving `tensor` untouched.

    `compress="bf16"` or `"fp16"` (float32/float64, SUM or AVG, host memory; every rank alike):
    on a group over hosts the shares cross between hosts in 16 bits and are summed in the
    tensor's precision, exact within each host, the same result on every rank; on one host
    the call is exact (docs/multihost.md#compressed-all_reduce gives the error bound)."""
    what = "all_reduce"
    # The hot path of small all_reduces (gradient norms, loss values, flags): a signature
    # (dtype, count, op, in/out of place) whose checks passed before only needs its arrays'
    # flags re-checked, and on the direct path runs with everything else looked up already:
    # most of a small call's Python time.
    src = planned(tensor, async_op) if compress is None else None
    if src is not None and (type(op) is ReduceOp or type(op) is Reduction):
        plan = group.plans.get((what, src.dtype, src.size, op, out is None))
        if plan is not None:
            flags = src.flags
            dst: np.ndarray | None
            if out is None:
                ok, dst = flags.c_contiguous and flags.writeable, src
            else:
                dst = planned(out, async_op)
                ok = flags.c_contiguous and fits_out(src, dst)
            if ok:
                call, run, red = plan
                result = tensor if out is None else out
                if run is None:
                    done = group.plans.submit(call, bodies.all_reduce, False, async_op, timeout, result,
                                              src, dst, red, result)
                else:
                    done = group.plans.submit(call, run, True, async_op, timeout, result, src, dst)
                if done is not REPLAN:
                    return done
    if _on_device(tensor):
        if compress is not None:
            invalid(group, what, f"compress={compress!r} compresses tensors in host memory only, "
                    f"not CUDA ones")
        return _device(group, timeout, what).all_reduce(tensor, op, out, async_op, timeout)
    check_member(group, what)
    src = array(group, tensor, what, writable=out is None)
    dst = src if out is None else array(group, out, what, writable=True, name="out")
    if dst is not src and (dst.dtype != src.dtype or dst.size != src.size):
        invalid(group, what, f"out has {dst.size} x {dst.dtype}, tensor {src.size} x {src.dtype}")
    red = reduction(group, op, src.dtype, what)
    if compress is not None:
        try:
            codec = codec_for(compress, src.dtype, red.op, rank=group.runtime.rank, collective=what)
        except InvalidArgumentError as exc:
            group.fail_fast(exc)
        fp = fingerprint(Coll.ALL_REDUCE, src.dtype, red, count=src.size, variant=codec.name)
        return group.queue.submit(fp, what, bodies.all_reduce, async_op, timeout, src, dst, red,
                                  out if out is not None else tensor, codec)
    fp = fingerprint(Coll.ALL_REDUCE, src.dtype, red, count=src.size)
    if src is planned(tensor, False) and (out is None or dst is planned(out, False)) \
            and red.factor is None and type(op) in (ReduceOp, Reduction):
        group.plans.remember_all_reduce((what, src.dtype, src.size, op, out is None), src, fp, red)
    return group.queue.submit(fp, what, bodies.all_reduce, async_op, timeout, src, dst, red,
                              out if out is not None else tensor)


def reduce(group: Group, tensor: Any, dst: int = 0, op: Any = ReduceOp.SUM, *, out: Any = None,
           async_op: bool = False, timeout: float | None = None) -> Any:
    """Reduce onto rank `dst` (in place, or into `out` there); other ranks' inputs are kept."""
    what = "reduce"
    mine = group.rank == dst
    data = planned(tensor, async_op)
    if data is not None and (type(op) is ReduceOp or type(op) is Reduction) \
            and (type(dst) is int or is_rank(dst)):  # see all_reduce
        plan = group.plans.get((what, data.dtype, data.size, dst, op, out is None))
        if plan is not None:
            acc: np.ndarray | None
            if not mine or out is None:
                ok, acc = usable(data, mine), data
            else:
                acc = planned(out, async_op)
                ok = usable(data, False) and fits_out(data, acc)
            if ok:
                call, direct, run, red = plan
                result = out if mine and out is not None else tensor
                if red is not None:
                    done = group.plans.submit(call, bodies.reduce, direct, async_op, timeout, result, data,
                                              acc, red, dst, result, run)
                else:  # its ReducePlan
                    done = group.plans.submit(call, run, True, async_op, timeout, result, data, acc)
                if done is not REPLAN:
                    return done
    if _on_device(tensor):
        return _device(group, timeout, what).reduce(tensor, dst, op, out, async_op, timeout)
    root = check_root(group, dst, what, "dst")
    src = array(group, tensor, what, writable=out is None and group.rank == root)
    target = src
    if group.rank == root and out is not None:
        target = array(group, out, what, writable=True, name="out")
        if target.dtype != src.dtype or target.size != src.size:
            invalid(group, what, f"out has {target.size} x {target.dtype}, "
                    f"tensor {src.size} x {src.dtype}")
    red = reduction(group, op, src.dtype, what)
    fp = fingerprint(Coll.REDUCE, src.dtype, red, root, src.size)
    result = out if (out is not None and group.rank == root) else tensor
    if src is planned(tensor, False) and (target is src or target is planned(out, False)) \
            and red.factor is None and type(op) in (ReduceOp, Reduction):
        group.plans.remember((what, src.dtype, src.size, dst, op, out is None), fp, what, what, src.nbytes,
                             red, whole=(src.nbytes, lambda dp: ReducePlan(dp, src.dtype, src.size, red.op,
                                                                   root, red).run))
    return group.queue.submit(fp, what, bodies.reduce, async_op, timeout, src, target, red, root, result,
                              SELECT)


def reduce_scatter(group: Group, output: Any, input_list: Sequence[Any], op: Any = ReduceOp.SUM, *,
                   async_op: bool = False, timeout: float | None = None) -> Any:
    """Rank r gets the reduction of everybody's input_list[r]. The blocks may differ in size
    (as reduce_scatterv), alike on every rank; input_list[rank] matches `output`."""
    what = "reduce_scatter"
    data = planned(output, async_op)
    if data is not None and (type(op) is ReduceOp or type(op) is Reduction):  # see all_reduce
        plan = group.plans.get((what, data.dtype, data.size, op))
        if plan is not None:
            blocks = planned_list(input_list, data, group.size, False, async_op, group.engine.native)
            if blocks is not None and usable(data, True):
                call, direct, run, red, general = plan
                if general is None:  # its TensorPlan
                    done = group.plans.submit(call, run, True, async_op, timeout, output, blocks, data)
                else:
                    done = group.plans.submit(call, bodies.reduce_scatter, direct, async_op, timeout, output,
                                              flats(blocks), data, red, True, output, run)
                if done is not REPLAN:
                    return done
    if _on_device(output):
        return _device(group, timeout, what).reduce_scatter(output, input_list, op, async_op, timeout)
    check_member(group, what)
    out = array(group, output, what, writable=True, name="output")
    blocks = array_list(group, input_list, what, "input_list", writable=False, like=out, uneven=True)
    red = reduction(group, op, out.dtype, what)
    if any(b.size != out.size for b in blocks):  # rank r gets input_list[r]'s count, as reduce_scatterv
        counts = [b.size for b in blocks]
        fp = fingerprint(Coll.REDUCE_SCATTERV, out.dtype, red, count=-1, counts=counts)
        return group.queue.submit(fp, what, bodies.reduce_scatter, async_op, timeout, flats(blocks), out, red,
                                  False, output, SELECT)
    fp = fingerprint(Coll.REDUCE_SCATTER, out.dtype, red, count=out.size)
    if out is planned(output, False) and red.factor is None and type(op) in (ReduceOp, Reduction) \
            and all(a is planned(b, False) for a, b in zip(blocks, input_list)):
        total = out.nbytes * group.size
        group.plans.remember((what, out.dtype, out.size, op), fp, what, "reduce_scatter", total, red, True,
                             one_rank=True, whole=(total, lambda dp: TensorPlan(
                           dp, what, out.dtype, out.size * group.size, red).run_blocks))
    return group.queue.submit(fp, what, bodies.reduce_scatter, async_op, timeout, flats(blocks), out, red,
                              True,
                              output, SELECT)


def reduce_scatter_tensor(group: Group, output: Any, input: Any, op: Any = ReduceOp.SUM, *,
                          async_op: bool = False, timeout: float | None = None) -> Any:
    """Single-tensor form: `input` is size x output.numel(), rank r gets block r reduced."""
    what = "reduce_scatter_tensor"
    inp, out = planned(input, async_op), planned(output, async_op)
    if inp is not None and out is not None \
            and (type(op) is ReduceOp or type(op) is Reduction):  # a checked signature: see all_reduce
        plan = group.plans.get((what, inp.dtype, inp.size, out.size, op))
        if plan is not None and out.dtype == inp.dtype and usable(inp, False) and usable(out, True):
            call, direct, run, red, counts = plan
            if counts is not None:
                done = group.plans.submit(call, bodies.reduce_scatter, direct, async_op, timeout, output,
                                          blocks_of(inp.reshape(-1), counts), out, red, True, output,
                                          run)
            else:
                done = group.plans.submit(call, run, True, async_op, timeout, output, inp, out)
            if done is not REPLAN:
                return done
    if _on_device(output):
        return _device(group, timeout, what).reduce_scatter_tensor(output, input, op, async_op, timeout)
    check_member(group, what)
    out = array(group, output, what, writable=True, name="output")
    inp = array(group, input, what, writable=False, name="input")
    same_dtype(group, [out, inp], what)
    if inp.size != out.size * group.size:
        invalid(group, what, f"input has {inp.size} elements, expected size x output = "
                f"{group.size} x {out.size}")
    counts = [out.size] * group.size
    red = reduction(group, op, out.dtype, what)
    fp = fingerprint(Coll.REDUCE_SCATTER, out.dtype, red, count=out.size)
    if inp is planned(input, False) and out is planned(output, False) and red.factor is None \
            and type(op) in (ReduceOp, Reduction):
        group.plans.remember((what, inp.dtype, inp.size, out.size, op), fp, what, "reduce_scatter",
                             inp.nbytes,
                             red, counts, one_rank=True,
                             whole=(inp.nbytes, lambda dp: TensorPlan(dp, "reduce_scatter", inp.dtype,
                                                                   inp.size, red).run))
    return group.queue.submit(fp, what, bodies.reduce_scatter, async_op, timeout, blocks_of(inp.reshape(-1),
                                                                                            counts),
                              out, red, True, output, SELECT)


def reduce_scatterv(group: Group, output: Any, input: Any, counts: Sequence[int], op: Any = ReduceOp.SUM,
                    *, async_op: bool = False, timeout: float | None = None) -> Any:
    """Vector form: rank r gets `counts[r]` reduced elements; `input` holds sum(counts)."""
    what = "reduce_scatterv"
    if _on_device(output):
        return _device(group, timeout, what).reduce_scatterv(output, input, counts, op, async_op, timeout)
    check_member(group, what)
    counts = check_counts(group, counts, what)
    out = array(group, output, what, writable=True, name="output")
    inp = array(group, input, what, writable=False, name="input")
    same_dtype(group, [out, inp], what)
    if inp.size != sum(counts) or out.size != counts[group.rank]:
        invalid(group, what, f"input has {inp.size} elements (want sum(counts)={sum(counts)}), output "
                f"{out.size} (want counts[{group.rank}]={counts[group.rank]})")
    red = reduction(group, op, out.dtype, what)
    even = len(set(counts)) == 1  # equal counts run as reduce_scatter_tensor (its one-shot paths too)
    return group.queue.submit(fingerprint(Coll.REDUCE_SCATTERV, out.dtype, red, count=-1, counts=counts),
                              what,
                              bodies.reduce_scatter, async_op, timeout, blocks_of(inp.reshape(-1),
                                                                                  counts), out, red,
                              even, output, SELECT)


# -- data movement ------------------------------------------------------------------------------
def broadcast(group: Group, tensor: Any, src: int = 0, *, out: Any = None, async_op: bool = False,
              timeout: float | None = None) -> Any:
    """Rank `src`'s tensor to everyone: in place, or into `out` (then `tensor` is only read)."""
    what = "broadcast"
    data = planned(tensor, async_op)
    if data is not None and (type(src) is int or is_rank(src)):  # a checked signature: see all_reduce
        plan = group.plans.get((what, data.dtype, data.size, src, out is None))
        if plan is not None:
            dst: np.ndarray | None
            if out is None:
                ok, dst = usable(data, group.rank != src), data
            else:
                dst = planned(out, async_op)
                ok = usable(data, False) and fits_out(data, dst)
            if ok:
                call, direct, run, root = plan
                result = tensor if out is None else out
                if root is not None:
                    done = group.plans.submit(call, bodies.broadcast, direct, async_op, timeout, result, data,
                                              dst, root, result, run)
                else:  # its BroadcastPlan
                    done = group.plans.submit(call, run, True, async_op, timeout, result, data, dst)
                if done is not REPLAN:
                    return done
    if _on_device(tensor):
        return _device(group, timeout, what).broadcast(tensor, src, out, async_op, timeout)
    root = check_root(group, src, what, "src")
    data = array(group, tensor, what, writable=out is None and group.rank != root)
    target = data if out is None else array(group, out, what, writable=True, name="out")
    if target is not data and (target.dtype != data.dtype or target.size != data.size):
        invalid(group, what, f"out has {target.size} x {target.dtype}, tensor {data.size} x {data.dtype}")
    fp = fingerprint(Coll.BROADCAST, data.dtype, root=root, count=data.size)
    result = tensor if out is None else out
    if data is planned(tensor, False) and target is (data if out is None else planned(out, False)):
        group.plans.remember((what, data.dtype, data.size, src, out is None), fp, what, what, target.nbytes,
                             root, whole=(data.nbytes, lambda dp: BroadcastPlan(dp, data.dtype,
                                                                             data.size,
                                                                             root).run))
    return group.queue.submit(fp, what, bodies.broadcast, async_op, timeout, data, target, root, result,
                              SELECT)


def all_gather(group: Group, tensor_list: Sequence[Any], tensor: Any, *, async_op: bool = False,
               timeout: float | None = None) -> Any:
    """tensor_list[r] receives rank r's tensor (list form; no staging copy). Ranks' tensors may
    differ in size (as all_gatherv): tensor_list[r] holds rank r's, alike on every rank."""
    what = "all_gather"
    data = planned(tensor, async_op)
    if data is not None:  # a checked signature: see all_reduce
        plan = group.plans.get((what, data.dtype, data.size))
        if plan is not None:
            blocks = planned_list(tensor_list, data, group.size, True, async_op, group.engine.native)
            if blocks is not None and usable(data, False):
                call, direct, run, general = plan
                if general is None:  # its TensorPlan
                    done = group.plans.submit(call, run, True, async_op, timeout, tensor_list, data, blocks)
                else:
                    done = group.plans.submit(call, bodies.all_gather, direct, async_op, timeout, tensor_list,
                                              data, blocks, True, tensor_list, run)
                if done is not REPLAN:
                    return done
    if _on_device(tensor):
        return _device(group, timeout, what).all_gather(tensor_list, tensor, async_op, timeout)
    check_member(group, what)
    inp = array(group, tensor, what, writable=False)
    outs = array_list(group, tensor_list, what, "tensor_list", writable=True, like=inp, uneven=True)
    if any(o.size != inp.size for o in outs):  # tensor_list[r] holds rank r's count, as all_gatherv
        fp = fingerprint(Coll.ALL_GATHERV, inp.dtype, counts=[o.size for o in outs])
        return group.queue.submit(fp, what, bodies.all_gather, async_op, timeout, inp, outs, False,
                                  tensor_list, SELECT)
    fp = fingerprint(Coll.ALL_GATHER, inp.dtype, count=inp.size)
    if inp is planned(tensor, False) and all(a is planned(o, False) for a, o in zip(outs, tensor_list)):
        group.plans.remember((what, inp.dtype, inp.size), fp, what, "all_gather", inp.nbytes * group.size,
                             True,
                             whole=(inp.nbytes, lambda dp: TensorPlan(dp, "all_gather", inp.dtype,
                                                                   inp.size).run_list))
    return group.queue.submit(fp, what, bodies.all_gather, async_op, timeout, inp, outs, True, tensor_list,
                              SELECT)


def all_gather_into_tensor(group: Group, output: Any, input: Any, *, async_op: bool = False,
                           timeout: float | None = None) -> Any:
    """Single-tensor form: output is size x input, rank r's input lands in block r."""
    what = "all_gather_into_tensor"
    inp, out = planned(input, async_op), planned(output, async_op)
    if inp is not None and out is not None:  # a checked signature: see all_reduce
        plan = group.plans.get((what, inp.dtype, inp.size, out.size))
        if plan is not None and out.dtype == inp.dtype and usable(inp, False) and usable(out, True):
            call, direct, run, counts = plan
            if counts is not None:
                done = group.plans.submit(call, bodies.all_gather, direct, async_op, timeout, output, inp,
                                          blocks_of(out.reshape(-1), counts), True, output, run)
            else:
                done = group.plans.submit(call, run, True, async_op, timeout, output, inp, out)
            if done is not REPLAN:
                return done
    if _on_device(output):
        return _device(group, timeout, what).all_gather_into_tensor(output, input, async_op, timeout)
    check_member(group, what)
    inp = array(group, input, what, writable=False, name="input")
    out = array(group, output, what, writable=True, name="output")
    same_dtype(group, [out, inp], what)
    if out.size != inp.size * group.size:
        invalid(group, what, f"output has {out.size} elements, expected size x input = "
                f"{group.size} x {inp.size}")
    counts = [inp.size] * group.size
    outs = blocks_of(out.reshape(-1), counts)
    fp = fingerprint(Coll.ALL_GATHER, inp.dtype, count=inp.size)
    if inp is planned(input, False) and out is planned(output, False):
        group.plans.remember((what, inp.dtype, inp.size, out.size), fp, what, "all_gather", out.nbytes,
                             counts,
                             whole=(inp.nbytes, lambda dp: TensorPlan(dp, "all_gather", inp.dtype,
                                                                   inp.size).run))
    return group.queue.submit(fp, what, bodies.all_gather, async_op, timeout, inp, outs, True, output, SELECT)


def all_gatherv(group: Group, output: Any, input: Any, counts: Sequence[int], *, async_op: bool = False,
                timeout: float | None = None) -> Any:
    """Vector form: rank r contributes counts[r] elements; output holds sum(counts)."""
    what = "all_gatherv"
    if _on_device(output):
        return _device(group, timeout, what).all_gatherv(output, input, counts, async_op, timeout)
    check_member(group, what)
    counts = check_counts(group, counts, what)
    inp = array(group, input, what, writable=False, name="input")
    out = array(group, output, what, writable=True, name="output")
    same_dtype(group, [out, inp], what)
    if inp.size != counts[group.rank] or out.size != sum(counts):
        invalid(group, what, f"input has {inp.size} elements (want counts[{group.rank}]="
                f"{counts[group.rank]}), output {out.size} (want sum(counts)={sum(counts)})")
    outs = blocks_of(out.reshape(-1), counts)
    even = len(set(counts)) == 1  # equal counts run as all_gather_into_tensor (its one-shot paths too)
    return group.queue.submit(fingerprint(Coll.ALL_GATHERV, inp.dtype, counts=counts), what,
                              bodies.all_gather, async_op,
                              timeout, inp, outs, even, output, SELECT)


def gather(group: Group, tensor: Any, gather_list: Sequence[Any] | None = None, dst: int = 0, *,
           async_op: bool = False, timeout: float | None = None) -> Any:
    """gather_list (on rank dst only) receives every rank's tensor."""
    what = "gather"
    data = planned(tensor, async_op)
    if data is not None and (type(dst) is int or is_rank(dst)):  # a checked signature: see all_reduce
        plan = group.plans.get((what, data.dtype, data.size, dst))
        blocks = None if group.rank != dst else \
            planned_list(gather_list, data, group.size, True, async_op, group.engine.native)
        if plan is not None and usable(data, False) and (group.rank != dst or blocks is not None):
            call, direct, run, root = plan
            if root is None:  # its GatherPlan
                done = group.plans.submit(call, run, True, async_op, timeout, gather_list, data, blocks)
            else:
                done = group.plans.submit(call, bodies.gather, direct, async_op, timeout, gather_list,
                                          buffers.flat(data), None if blocks is None else flats(blocks), dst,
                                          gather_list, run)
            if done is not REPLAN:
                return done
    if _on_device(tensor):
        return _device(group, timeout, what).gather(tensor, gather_list, dst, async_op, timeout)
    root = check_root(group, dst, what, "dst")
    inp = array(group, tensor, what, writable=False)
    outs = None
    if group.rank == root:
        outs = array_list(group, gather_list, what, "gather_list", writable=True, like=inp)
    fp = fingerprint(Coll.GATHER, inp.dtype, root=root, count=inp.size)
    if inp is planned(tensor, False) and (
            outs is None or all(a is planned(o, False) for a, o in zip(outs,
                                                                       gather_list))):  # type: ignore[arg-type]
        group.plans.remember((what, inp.dtype, inp.size, root), fp, what, "gather", inp.nbytes * group.size,
                             root, one_rank=True, whole=(inp.nbytes, lambda dp: GatherPlan(
                           dp, inp.dtype, inp.size, root).run))
    return group.queue.submit(fp, what, bodies.gather, async_op, timeout, buffers.flat(inp),
                              None if outs is None else flats(outs), root, gather_list, SELECT)


def scatter(group: Group, tensor: Any, scatter_list: Sequence[Any] | None = None, src: int = 0, *,
            async_op: bool = False, timeout: float | None = None) -> Any:
    """Rank r's tensor receives scatter_list[r] of rank src."""
    what = "scatter"
    data = planned(tensor, async_op)
    if data is not None and (type(src) is int or is_rank(src)):  # a checked signature: see all_reduce
        plan = group.plans.get((what, data.dtype, data.size, src))
        blocks = None if group.rank != src else \
            planned_list(scatter_list, data, group.size, False, async_op, group.engine.native)
        if plan is not None and usable(data, True) and (group.rank != src or blocks is not None):
            call, direct, run, root = plan
            if root is None:  # its ScatterPlan
                done = group.plans.submit(call, run, True, async_op, timeout, tensor, blocks, data)
            else:
                done = group.plans.submit(call, bodies.scatter, direct, async_op, timeout, tensor,
                                          None if blocks is None else flats(blocks), buffers.flat(data),
                                          src, tensor, run)
            if done is not REPLAN:
                return done
    if _on_device(tensor):
        return _device(group, timeout, what).scatter(tensor, scatter_list, src, async_op, timeout)
    root = check_root(group, src, what, "src")
    out = array(group, tensor, what, writable=True)
    ins = None
    if group.rank == root:
        ins = array_list(group, scatter_list, what, "scatter_list", writable=False, like=out)
    fp = fingerprint(Coll.SCATTER, out.dtype, root=root, count=out.size)
    if out is planned(tensor, False) and (
            ins is None or all(a is planned(i, False) for a, i in zip(ins,
                                                                      scatter_list))):  # type: ignore[arg-type]
        group.plans.remember((what, out.dtype, out.size, root), fp, what, "scatter", out.nbytes * group.size,
                             root, one_rank=True, whole=(out.nbytes * group.size, lambda dp: ScatterPlan(
                           dp, out.dtype, out.size, root).run))
    return group.queue.submit(fp, what, bodies.scatter, async_op, timeout,
                              None if ins is None else flats(ins),
                              buffers.flat(out), root, tensor, SELECT)


def gatherv(group: Group, output: Any, input: Any, counts: Sequence[int], dst: int = 0, *,
            async_op: bool = False, timeout: float | None = None) -> Any:
    """Vector gather: rank r sends counts[r] elements; `output` (rank dst) holds sum(counts)."""
    what = "gatherv"
    if _on_device(input):
        return _device(group, timeout, what).gatherv(output, input, counts, dst, async_op, timeout)
    root = check_root(group, dst, what, "dst")
    counts = check_counts(group, counts, what)
    inp = array(group, input, what, writable=False, name="input")
    if inp.size != counts[group.rank]:
        invalid(group, what, f"input has {inp.size} elements, counts[{group.rank}]={counts[group.rank]}")
    outs = None
    if group.rank == root:
        out = array(group, output, what, writable=True, name="output")
        same_dtype(group, [out, inp], what)
        if out.size != sum(counts):
            invalid(group, what, f"output has {out.size} elements, sum(counts)={sum(counts)}")
        outs = blocks_of(out.reshape(-1), counts)

    def body(call: CollectiveCall) -> Any:
        send = inp.reshape(-1) if outs is None else apart([inp.reshape(-1)], outs, (0, root))[0]
        tuner.run(group, call, "gather", sum(counts) * inp.itemsize, send, outs, root)
        return output

    return group.queue.submit(fingerprint(Coll.GATHERV, inp.dtype, root=root, counts=counts), what, body,
                              async_op,
                              timeout)


def scatterv(group: Group, output: Any, input: Any, counts: Sequence[int], src: int = 0, *,
             async_op: bool = False, timeout: float | None = None) -> Any:
    """Vector scatter: rank r receives counts[r] elements of rank src's `input`."""
    what = "scatterv"
    if _on_device(output):
        return _device(group, timeout, what).scatterv(output, input, counts, src, async_op, timeout)
    root = check_root(group, src, what, "src")
    counts = check_counts(group, counts, what)
    out = array(group, output, what, writable=True, name="output")
    if out.size != counts[group.rank]:
        invalid(group, what, f"output has {out.size} elements, counts[{group.rank}]={counts[group.rank]}")
    ins = None
    if group.rank == root:
        inp = array(group, input, what, writable=False, name="input")
        same_dtype(group, [out, inp], what)
        if inp.size != sum(counts):
            invalid(group, what, f"input has {inp.size} elements, sum(counts)={sum(counts)}")
        ins = blocks_of(inp.reshape(-1), counts)

    def body(call: CollectiveCall) -> Any:
        sends = None if ins is None else apart(ins, [out], (root, 0))
        tuner.run(group, call, "scatter", sum(counts) * out.itemsize, sends, out.reshape(-1), root)
        return output

    # the total is in the fingerprint: ranks whose counts sum differently fail as a mismatch
    # (they could not even agree on the algorithm: tree._scatter_cost depends on it)
    return group.queue.submit(fingerprint(Coll.SCATTERV, out.dtype, root=root, count=sum(counts),
                                          counts=counts),
                              what, body, async_op, timeout)


def all_to_all(group: Group, output_list: Sequence[Any], input_list: Sequence[Any], *,
               async_op: bool = False, timeout: float | None = None) -> Any:
    """output_list[r] receives rank r's input_list[this rank]; sizes may differ per pair."""
    what = "all_to_all"
    if _on_device(output_list[0] if output_list else None):
        return _device(group, timeout, what).all_to_all(output_list, input_list, async_op, timeout)
    check_member(group, what)
    ins = array_list(group, input_list, what, "input_list", writable=False)
    outs = array_list(group, output_list, what, "output_list", writable=True)
    dtype = same_dtype(group, ins + outs, what)
    ins = apart(ins, outs)
    return _all_to_all(group, what, output_list, ins, outs, dtype, async_op, timeout, Coll.ALL_TO_ALLV, -1)


def all_to_all_single(group: Group, output: Any, input: Any,
                      output_split_sizes: Sequence[int] | None = None,
                      input_split_sizes: Sequence[int] | None = None, *, async_op: bool = False,
                      timeout: float | None = None) -> Any:
    """Split sizes count rows of dim 0 (as torch does); without them, equal blocks."""
    what = "all_to_all_single"
    src, dst = planned(input, async_op), planned(output, async_op)
    if src is not None and dst is not None and input_split_sizes is None \
            and output_split_sizes is None:  # a checked signature: see all_reduce
        plan = group.plans.get((what, src.dtype, src.shape, dst.shape))
        if plan is not None and dst.dtype == src.dtype and usable(src, False) and usable(dst, True):
            call, direct, run, counts = plan
            if counts is None:  # the one shot through the slots: in place is fine there
                done = group.plans.submit(call, run, True, async_op, timeout, output, src, dst)
            elif np.may_share_memory(src, dst):  # not for the algorithms: the checked path copies
                done = REPLAN
            else:
                done = group.plans.submit(call, bodies.all_to_all, direct, async_op, timeout, output,
                                          blocks_of(src.reshape(-1), counts),
                                          blocks_of(dst.reshape(-1), counts), True, output, run)
            if done is not REPLAN:
                return done
    if _on_device(output):
        return _device(group, timeout, what).all_to_all_single(output, input, output_split_sizes,
                                                               input_split_sizes, async_op, timeout)
    check_member(group, what)
    inp = array(group, input, what, writable=False, name="input")
    out = array(group, output, what, writable=True, name="output")
    dtype = same_dtype(group, [inp, out], what)
    if np.may_share_memory(inp, out):
        inp = inp.copy()  # see apart: not planned, so the check above repeats for each call
    ins = split_rows(group, inp, input_split_sizes, what, "input")
    outs = split_rows(group, out, output_split_sizes, what, "output")
    even = input_split_sizes is None and output_split_sizes is None
    coll, count = (Coll.ALL_TO_ALL, inp.size) if even else (Coll.ALL_TO_ALLV, -1)
    if even and inp is planned(input, False) and out is planned(output, False) \
            and ins[group.rank].size == outs[group.rank].size:  # so every block has that size
        group.plans.remember((what, inp.dtype, inp.shape, out.shape), fingerprint(coll, dtype, count=count),
                             what,
                             "all_to_all", inp.nbytes, [b.size for b in ins],
                             one_rank=True,  # on one rank the algorithm copies the block
                             whole=(inp.nbytes, lambda dp: TensorPlan(dp, "all_to_all", inp.dtype,
                                                                   inp.size).run))
    return _all_to_all(group, what, output, ins, outs, dtype, async_op, timeout, coll, count)


def _all_to_all(group: Group, what: str, result: Any, ins: list[np.ndarray], outs: list[np.ndarray],
                dtype: np.dtype, async_op: bool, timeout: float | None, coll: Coll, count: int) -> Any:
    if ins[group.rank].size != outs[group.rank].size:
        invalid(group, what, f"this rank sends itself {ins[group.rank].size} elements but expects "
                f"{outs[group.rank].size}")

    fp = fingerprint(coll, dtype, count=count)
    return group.queue.submit(fp, what, bodies.all_to_all, async_op, timeout, ins, outs,
                              coll == Coll.ALL_TO_ALL,
                              result, SELECT)


def barrier(group: Group, *, async_op: bool = False, timeout: float | None = None) -> Any:
    """Returns once every rank of the group has entered it."""
    plan = group.plans.get("barrier")
    if plan is None:
        check_member(group, "barrier")
        plan = group.plans.remember_barrier()
    call, body, direct = plan
    done = group.plans.submit(call, body, direct, async_op, timeout, None)
    return barrier(group, async_op=async_op, timeout=timeout) if done is REPLAN else done
