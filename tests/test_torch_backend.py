"""torch.distributed end to end on the tensorwire backend: every c10d operation a user can call.

Starting a torch process costs seconds here, so each test launches one set of real processes
that run this file as a script (`python tests/test_torch_backend.py SCENARIO`); a scenario runs
many checks on every rank and raises on the first wrong result. Results are compared with the
same call on a Gloo group over the same processes and, where Gloo has no such op (AVG,
PREMUL_SUM), with a reference computed locally (every rank's input is a known function of its rank).

The other test_torch_*.py files reuse `launch` and `assert_all_ok` from here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from cluster import free_port

pytest.importorskip("torch")

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent


# ------------------------------------------------------------------------------------ launching

@dataclass
class RankResult:
    rank: int
    rc: int
    out: str
    err: str

    def tail(self, n: int = 40) -> str:
        lines = (self.out + self.err).splitlines()
        return "\n".join(lines[-n:])


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any launcher's variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHELASTIC_", "TENSORWIRE_", "OMPI_", "PMI", "SLURM_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                         "MASTER_PORT", "GROUP_RANK", "NODE_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TENSORWIRE_TIMEOUT="60")
    env.update(extra)
    return env


def run_command(argv: list[str], *, env: dict[str, str], timeout: float, cwd: Path = REPO) -> RankResult:
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(argv)} did not finish within {timeout:g} s:\n{out}\n{err}") from None
    return RankResult(0, proc.returncode, out, err)


def launch(scenario: str, nprocs: int, *, script: Path = HERE, args: tuple[str, ...] = (),
           timeout: float = 100.0, **env: str) -> list[RankResult]:
    """Run `script scenario *args` as `nprocs` ranks (env:// variables set); wait for all."""
    base = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nprocs),
                     LOCAL_WORLD_SIZE=str(nprocs), **env)
    procs = []
    for rank in range(nprocs):
        rank_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, str(script), scenario, *args], env=rank_env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    deadline = time.monotonic() + timeout
    results = []
    hung = False
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            out, err = proc.communicate()
        results.append(RankResult(rank, proc.returncode, out, err))
    if hung:
        text = "\n".join(f"--- rank {r.rank} (rc {r.rc}) ---\n{r.tail()}" for r in results)
        raise AssertionError(f"{scenario}: ranks hung past {timeout:g} s\n{text}")
    return results


def assert_all_ok(results: list[RankResult], scenario: str) -> None:
    bad = [r for r in results if r.rc != 0 or f"{scenario} OK" not in r.out]
    if bad:
        text = "\n".join(f"--- rank {r.rank} (rc {r.rc}) ---\n{r.tail()}" for r in results)
        raise AssertionError(f"{scenario} failed on rank(s) {[r.rank for r in bad]}:\n{text}")


# ------------------------------------------------------------------------------------ the tests

@pytest.mark.timeout(120)
def test_every_op_two_ranks() -> None:
    """Every c10d collective, point-to-point and object op, sync and async, all ReduceOps."""
    assert_all_ok(launch("ops", 2), "ops")


@pytest.mark.timeout(120)
def test_every_op_four_ranks_and_sub_groups() -> None:
    """Four ranks: the ops again, then overlapping `new_group`s; then a Gloo world whose
    `new_group(backend="tensorwire")` groups connect their pairs on demand."""
    assert_all_ok(launch("four", 4, timeout=110), "four")


@pytest.mark.timeout(120)
def test_work_futures_and_results_have_gloos_form() -> None:
    """Each async collective's `get_future()` value and `result()` have the form Gloo's have
    (a gather root's: its gather_list, not a list holding that list), compared with the same
    calls on a Gloo group over the same processes; a synchronous call's Work, from the process
    group's method, keeps its own outputs when another call follows."""
    assert_all_ok(launch("work_results", 2), "work_results")


def without_ml_dtypes(tmp_path: Path) -> str:
    """A PYTHONPATH on which `import ml_dtypes` fails, as on a plain `pip install tensorwire[torch]`
    (a sitecustomize.py that maps the module to None)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\nsys.modules['ml_dtypes'] = None  # this interpreter acts as if it were not installed\n")
    return os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("path", ["direct", "messages"])
def test_every_torch_dtype_and_op_without_ml_dtypes(path: str, tmp_path: Path) -> None:
    """Every reduce op on every torch dtype (bfloat16, float16, float8_*, complex32 included) at
    n = 1, 2, 3 (sub-groups of a 3-rank world), through dist.all_reduce, dist.reduce,
    dist.reduce_scatter_tensor and tensorwire's own all_reduce on the tensors, against a
    reference folded in float64, in processes that cannot import ml_dtypes: torch alone must
    be enough. `messages`: the shared-memory one shot off, so the message path's algorithms
    carry and reduce them."""
    env = {"PYTHONPATH": without_ml_dtypes(tmp_path)}
    if path == "messages":
        env["TENSORWIRE_SHM_DIRECT"] = "0"
    assert_all_ok(launch("dtypes", 3, timeout=140, **env), "dtypes")


# ------------------------------------------------------------------------------------ scenarios
# Everything below runs inside the launched ranks.

def _data(rank: int, n: int, dtype, salt: int = 0):
    """Small integer-valued tensors (exact sums and products in any order), one per rank."""
    import torch

    base = (torch.arange(n, dtype=torch.int64) * (rank + 3) + salt + rank) % 5 + 1
    if dtype == torch.bool:
        return base % 2 == 0
    return base.to(dtype)


def _reference(inputs, op):
    import torch
    import torch.distributed as dist

    stack = torch.stack([t.to(torch.float64) if t.is_floating_point() else t for t in inputs])
    if op == dist.ReduceOp.SUM:
        out = stack.sum(0)
    elif op == dist.ReduceOp.PRODUCT:
        out = stack.prod(0)
    elif op == dist.ReduceOp.MIN:
        out = stack.min(0).values
    elif op == dist.ReduceOp.MAX:
        out = stack.max(0).values
    elif op == dist.ReduceOp.AVG:
        out = stack.sum(0) / len(inputs)
    else:
        fn = {dist.ReduceOp.BAND: torch.bitwise_and, dist.ReduceOp.BOR: torch.bitwise_or,
              dist.ReduceOp.BXOR: torch.bitwise_xor}[op]
        out = inputs[0]
        for t in inputs[1:]:
            out = fn(out, t)
    return out.to(inputs[0].dtype)


class _Checker:
    def __init__(self, gloo) -> None:
        import torch.distributed as dist

        from tensorwire.torch import ProcessGroupTensorwire

        self.dist = dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.gloo = gloo
        self.count = 0
        pg = dist.distributed_c10d._get_default_group()
        assert isinstance(pg, ProcessGroupTensorwire), type(pg)
        assert dist.get_backend() == "tensorwire"
        self.tw = pg.tensorwire_group

    def equal(self, what: str, got, want) -> None:
        import torch

        if isinstance(got, (list, tuple)):
            assert len(got) == len(want), f"{what}: {len(got)} results, want {len(want)}"
            for i, (g, w) in enumerate(zip(got, want)):
                self.equal(f"{what}[{i}]", g, w)
            return
        assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got} vs {want}"
        if got.is_floating_point() and got.dtype in (torch.float16, torch.bfloat16):
            ok = torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        elif got.is_floating_point() or got.is_complex():
            ok = torch.allclose(got, want, rtol=1e-6, atol=1e-6)
        else:
            ok = torch.equal(got, want)
        assert ok, f"rank {self.rank}: {what}: got {got}, want {want}"
        self.count += 1

    def same_as_gloo(self, what: str, fn) -> None:
        """fn(group) -> output tensors; run on tensorwire (default group) and on Gloo, compare."""
        before = self.tw.queue.seq
        got = fn(None)
        assert self.tw.queue.seq > before, f"{what}: tensorwire's group did not run it"
        want = fn(self.gloo)
        self.equal(f"{what} vs gloo", got, want)


def _check_reductions(c: _Checker) -> None:
    import torch
    import torch.distributed as dist

    r, n = c.rank, c.size
    ops = [dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX]
    bitwise = [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR]
    cases = [(dt, ops) for dt in (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16,
                                  torch.bfloat16)]
    cases += [(torch.uint8, ops + bitwise), (torch.int64, bitwise)]
    for dtype, dtype_ops in cases:
        for op in dtype_ops:
            def all_reduce(group, dtype=dtype, op=op):
                t = _data(r, 13, dtype)
                dist.all_reduce(t, op=op, group=group)
                return t

            c.same_as_gloo(f"all_reduce {dtype} {op}", all_reduce)
            c.equal(f"all_reduce {dtype} {op} vs reference", all_reduce(None),
                    _reference([_data(k, 13, dtype) for k in range(n)], op))
    # ops Gloo does not have
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        t = _data(r, 9, dtype)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        c.equal(f"all_reduce AVG {dtype}", t, _reference([_data(k, 9, dtype) for k in range(n)],
                                                         dist.ReduceOp.AVG))
    for factor in (0.5, torch.tensor([0.25])):
        t = _data(r, 9, torch.float32)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor))
        f = float(factor)
        c.equal(f"all_reduce PREMUL_SUM({f})", t, f * sum(_data(k, 9, torch.float32) for k in range(n)))
    # PREMUL_SUM with a different factor on every rank: sum(f_r * x_r), NCCL's definition
    t = _data(r, 5, torch.float64)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(float(r + 1)))
    c.equal("all_reduce PREMUL_SUM per-rank factors", t,
            sum((k + 1) * _data(k, 5, torch.float64) for k in range(n)))
    # bool through the bitwise-or of MAX, complex through SUM (torch views it as real)
    def bool_max(group):
        t = _data(r, 8, torch.bool)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t

    c.same_as_gloo("all_reduce bool MAX", bool_max)

    def complex_sum(group):
        t = torch.complex(_data(r, 6, torch.float32), _data(r, 6, torch.float32, salt=2))
        dist.all_reduce(t, group=group)
        return t

    c.same_as_gloo("all_reduce complex64 SUM", complex_sum)

    # sparse COO tensors (SUM: what DDP sends for sparse gradients; nnz differs per rank)
    def sparse(group):
        idx = torch.tensor([[0, 1 + r, 3, r], [2, 0, 1, r]])
        t = torch.sparse_coo_tensor(idx, _data(r, 4, torch.float32), (4 + n, 3 + n))
        dist.all_reduce(t, group=group)
        return t.to_dense()

    c.same_as_gloo("all_reduce sparse", sparse)

    # shapes: 0-d, empty, 2-D, non-contiguous (through a staging copy)
    for shape in ((), (0,), (3, 5)):
        def shaped(group, shape=shape):
            t = _data(r, max(1, int(torch.tensor(shape).prod().item()) if shape else 1), torch.float32)
            t = t[: int(torch.tensor(shape).prod().item()) if shape else 1].reshape(shape)
            dist.all_reduce(t, group=group)
            return t

        c.same_as_gloo(f"all_reduce shape {shape}", shaped)

    def strided(group):
        base = _data(r, 24, torch.float32).reshape(4, 6)
        view = base.t()  # not contiguous
        dist.all_reduce(view, group=group)
        return base

    c.same_as_gloo("all_reduce non-contiguous", strided)

    # a non-contiguous Parameter (a channels_last conv weight, a transposed one): its copy back
    # went through autograd ("a leaf Variable that requires grad is being used in an in-place
    # operation") on every rank the result reached, a broadcast's non-roots alone
    def parameter(group):
        weight = torch.nn.Parameter(_data(r, 24, torch.float32).reshape(4, 6).t())
        dist.broadcast(weight, src=0, group=group)
        dist.all_reduce(weight, group=group, async_op=True).wait()
        return weight.detach().clone()

    c.same_as_gloo("broadcast and async all_reduce of a non-contiguous Parameter", parameter)

    # reduce to every root, every op; non-roots keep their input
    for root in range(n):
        for op in ops:
            def reduce(group, root=root, op=op):
                t = _data(r, 11, torch.float32, salt=root)
                dist.reduce(t, dst=root, op=op, group=group)
                return t if r == root else _data(r, 11, torch.float32, salt=root)

            c.same_as_gloo(f"reduce root {root} {op}", reduce)
        t = _data(r, 4, torch.float32)
        dist.reduce(t, dst=root, op=dist._make_nccl_premul_sum(2.0))
        if r == root:
            c.equal("reduce PREMUL_SUM", t, 2.0 * sum(_data(k, 4, torch.float32) for k in range(n)))
        else:
            c.equal("reduce keeps non-root input", t, _data(r, 4, torch.float32))

    # coalesced all-reduce: the deprecated list API and the coalescing manager
    def coalesced(group):
        ts = [_data(r, 5, torch.float32), _data(r, 3, torch.float32, salt=2),
              _data(r, 7, torch.float32, salt=1)]
        dist.all_reduce_coalesced(ts, group=group)
        return ts

    c.same_as_gloo("all_reduce_coalesced", coalesced)
    # mixed dtypes straight through the process group (torch's wrapper insists on one dtype)
    ts = [_data(r, 5, torch.float32), _data(r, 3, torch.float64), _data(r, 7, torch.int64).reshape(7, 1)]
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    dist.distributed_c10d._get_default_group().allreduce_coalesced(ts, opts).wait()
    c.equal("allreduce_coalesced mixed dtypes", ts,
            [_reference([_data(k, 5, torch.float32) for k in range(n)], dist.ReduceOp.MAX),
             _reference([_data(k, 3, torch.float64) for k in range(n)], dist.ReduceOp.MAX),
             _reference([_data(k, 7, torch.int64) for k in range(n)], dist.ReduceOp.MAX).reshape(7, 1)])
    ts = [_data(r, 6, torch.float32, salt=s) for s in range(3)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    c.equal("coalescing manager", ts, [sum(_data(k, 6, torch.float32, salt=s) for k in range(n))
                                       for s in range(3)])

    # reduce_scatter: list form, tensor form, single form, AVG and PREMUL_SUM, non-contiguous output
    for op in ops:
        def reduce_scatter(group, op=op):
            out = torch.zeros(4)
            ins = [_data(r, 4, torch.float32, salt=k) for k in range(n)]
            dist.reduce_scatter(out, ins, op=op, group=group)
            return out

        c.same_as_gloo(f"reduce_scatter {op}", reduce_scatter)

        def reduce_scatter_tensor(group, op=op):
            out = torch.zeros(3, 2)
            inp = _data(r, 6 * n, torch.float32).reshape(3 * n, 2)
            dist.reduce_scatter_tensor(out, inp, op=op, group=group)
            return out

        c.same_as_gloo(f"reduce_scatter_tensor {op}", reduce_scatter_tensor)
    out = torch.zeros(5)
    dist.reduce_scatter_tensor(out, _data(r, 5 * n, torch.float32), op=dist.ReduceOp.AVG)
    c.equal("reduce_scatter_tensor AVG", out,
            (sum(_data(k, 5 * n, torch.float32) for k in range(n)) / n)[5 * r: 5 * r + 5])
    out = torch.zeros(5)
    inp = _data(r, 5 * n, torch.float32)
    dist.reduce_scatter_tensor(out, inp, op=dist._make_nccl_premul_sum(0.5))
    c.equal("reduce_scatter_tensor PREMUL_SUM", out,
            (0.5 * sum(_data(k, 5 * n, torch.float32) for k in range(n)))[5 * r: 5 * r + 5])
    c.equal("reduce_scatter_tensor keeps its input", inp, _data(r, 5 * n, torch.float32))
    if hasattr(dist, "reduce_scatter_single"):
        out = torch.zeros(2)
        dist.reduce_scatter_single(out, _data(r, 2 * n, torch.float32))
        total = sum(_data(k, 2 * n, torch.float32) for k in range(n))
        c.equal("reduce_scatter_single", out, total[2 * r: 2 * r + 2])

    # (Gloo writes a non-contiguous output in storage order, not element order: compare with the
    # reference instead)
    out = torch.zeros(4, 2).t()  # (2, 4), not contiguous
    dist.reduce_scatter(out, [_data(r, 8, torch.float32, salt=k).reshape(2, 4) for k in range(n)])
    c.equal("reduce_scatter non-contiguous output", out,
            sum(_data(k, 8, torch.float32, salt=r).reshape(2, 4) for k in range(n)))
    # blocks of different sizes, as NCCL takes them (Gloo refuses): rank q's block has q + 1 elements
    out = torch.zeros(r + 1)
    dist.reduce_scatter(out, [_data(r, q + 1, torch.float32, salt=q) for q in range(n)])
    c.equal("reduce_scatter uneven", out, sum(_data(k, r + 1, torch.float32, salt=r) for k in range(n)))


def _check_data_movement(c: _Checker) -> None:
    import torch
    import torch.distributed as dist

    r, n = c.rank, c.size
    for root in range(n):
        for dtype in (torch.float32, torch.int64, torch.bool, torch.bfloat16):
            def broadcast(group, root=root, dtype=dtype):
                t = _data(r, 10, dtype, salt=root)
                dist.broadcast(t, src=root, group=group)
                return t

            c.same_as_gloo(f"broadcast root {root} {dtype}", broadcast)

    def all_gather(group):
        outs = [torch.zeros(3, dtype=torch.int64) for _ in range(n)]
        dist.all_gather(outs, _data(r, 3, torch.int64), group=group)
        return outs

    c.same_as_gloo("all_gather", all_gather)

    def all_gather_strided(group):
        out = torch.zeros(3, n)
        dist.all_gather(list(out.unbind(1)), _data(r, 3, torch.float32), group=group)  # strided views
        return out

    c.same_as_gloo("all_gather into non-contiguous views", all_gather_strided)
    outs = [torch.zeros(q + 1, dtype=torch.int64) for q in range(n)]  # uneven: as NCCL (Gloo refuses)
    dist.all_gather(outs, _data(r, r + 1, torch.int64))
    c.equal("all_gather uneven", outs, [_data(q, q + 1, torch.int64) for q in range(n)])

    def all_gather_into_tensor(group):
        flat = torch.zeros(4 * n, 3)
        dist.all_gather_into_tensor(flat, _data(r, 12, torch.float32).reshape(4, 3), group=group)
        return flat

    c.same_as_gloo("all_gather_into_tensor", all_gather_into_tensor)
    stacked = torch.zeros(n, 2, 2)  # the stacked output shape (Gloo refuses it)
    dist.all_gather_into_tensor(stacked, _data(r, 4, torch.float32, salt=1).reshape(2, 2))
    c.equal("all_gather_into_tensor stacked", stacked,
            torch.stack([_data(k, 4, torch.float32, salt=1).reshape(2, 2) for k in range(n)]))
    if hasattr(dist, "all_gather_single"):
        out = torch.zeros(2 * n)
        dist.all_gather_single(out, _data(r, 2, torch.float32))
        c.equal("all_gather_single", out, torch.cat([_data(k, 2, torch.float32) for k in range(n)]))
    # in place: the input is this rank's slice of the output (what FSDP does)
    out = torch.zeros(3 * n)
    out[3 * r: 3 * r + 3] = _data(r, 3, torch.float32)
    dist.all_gather_into_tensor(out, out[3 * r: 3 * r + 3])
    c.equal("all_gather_into_tensor in place", out, torch.cat([_data(k, 3, torch.float32) for k in range(n)]))
    def all_gather_coalesced(group):
        outs = [[torch.zeros(2), torch.zeros(3)] for _ in range(n)]  # [rank][input index]
        dist.all_gather_coalesced(outs, [_data(r, 2, torch.float32), _data(r, 3, torch.float32, salt=4)],
                                  group=group)
        return [t for lst in outs for t in lst]

    c.same_as_gloo("all_gather_coalesced", all_gather_coalesced)

    for root in range(n):
        def gather(group, root=root):
            outs = [torch.zeros(4) for _ in range(n)] if r == root else None
            dist.gather(_data(r, 4, torch.float32), outs, dst=root, group=group)
            return outs if r == root else [torch.zeros(1)]

        c.same_as_gloo(f"gather root {root}", gather)

        def scatter(group, root=root):
            out = torch.zeros(3)
            ins = [_data(k, 3, torch.float32, salt=root) for k in range(n)] if r == root else None
            dist.scatter(out, ins, src=root, group=group)
            return out

        c.same_as_gloo(f"scatter root {root}", scatter)

    def all_to_all(group):
        ins = [_data(r, 3, torch.float32, salt=10 * r + k) for k in range(n)]
        outs = [torch.zeros(3) for _ in range(n)]
        dist.all_to_all(outs, ins, group=group)
        return outs

    c.same_as_gloo("all_to_all", all_to_all)
    ins = [_data(r, k + 1, torch.float32, salt=10 * r + k) for k in range(n)]  # uneven (Gloo refuses)
    outs = [torch.zeros(r + 1) for _ in range(n)]
    dist.all_to_all(outs, ins)
    c.equal("all_to_all uneven", outs, [_data(k, r + 1, torch.float32, salt=10 * k + r) for k in range(n)])

    def all_to_all_single(group):
        even_out = torch.zeros(2 * n, 3)
        dist.all_to_all_single(even_out, _data(r, 6 * n, torch.float32).reshape(2 * n, 3), group=group)
        in_splits = [k + 1 for k in range(n)]  # rank r sends k+1 rows to rank k
        out_splits = [r + 1] * n
        split_out = torch.zeros(sum(out_splits), 2)
        dist.all_to_all_single(split_out, _data(r, 2 * sum(in_splits), torch.float32).reshape(-1, 2),
                               output_split_sizes=out_splits, input_split_sizes=in_splits, group=group)
        return [even_out, split_out]

    c.same_as_gloo("all_to_all_single (even and with splits)", all_to_all_single)

    before = c.tw.queue.seq
    dist.barrier()
    dist.barrier(async_op=True).wait()
    assert c.tw.queue.seq == before + 2, "barrier did not run on tensorwire"


def _check_async(c: _Checker) -> None:
    import torch
    import torch.distributed as dist

    r, n = c.rank, c.size
    t = _data(r, 1000, torch.float32)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    assert work.wait() is True
    value = fut.wait()
    assert isinstance(value, list) and value[0] is t or torch.equal(value[0], t), value
    assert work.is_completed() and work.is_success() and work.exception() is None
    c.equal("async all_reduce", t, sum(_data(k, 1000, torch.float32) for k in range(n)))
    # many in flight at once, completed in order, futures chained with then()
    ts = [_data(r, 50, torch.float32, salt=s) for s in range(8)]
    works = [dist.all_reduce(x, async_op=True) for x in ts]
    chained = works[-1].get_future().then(lambda f: f.value()[0] * 2)
    for w in works:
        w.wait()
    c.equal("eight async all_reduces", ts, [sum(_data(k, 50, torch.float32, salt=s) for k in range(n))
                                             for s in range(8)])
    c.equal("future.then", chained.wait(), 2 * ts[-1])
    # an all_gather's future holds its list of outputs (Gloo's form), not a list of that list
    outs = [torch.empty(3) for _ in range(n)]
    got = dist.all_gather(outs, torch.full((3,), float(r)), async_op=True).get_future().wait()
    c.equal("all_gather's future", got, [torch.full((3,), float(k)) for k in range(n)])
    for make in (lambda: dist.broadcast(_data(r, 4, torch.float32), src=0, async_op=True),
                 lambda: dist.all_gather([torch.zeros(2) for _ in range(n)], torch.ones(2), async_op=True),
                 lambda: dist.reduce_scatter_tensor(torch.zeros(1), torch.ones(n), async_op=True),
                 lambda: dist.all_to_all_single(torch.zeros(n), torch.ones(n), async_op=True),
                 lambda: dist.barrier(async_op=True)):
        w = make()
        w.get_future().wait()
        assert w.is_completed()


def _check_p2p(c: _Checker) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    r, n = c.rank, c.size
    right, left = (r + 1) % n, (r - 1) % n
    # blocking, alternating order so nobody deadlocks
    got = torch.zeros(5)
    if r % 2 == 0:
        dist.send(_data(r, 5, torch.float32), dst=right)
        dist.recv(got, src=left)
    else:
        dist.recv(got, src=left)
        dist.send(_data(r, 5, torch.float32), dst=right)
    c.equal("send/recv ring", got, _data(left, 5, torch.float32))
    # isend/irecv with tags, received in the opposite order of sending
    a, b = torch.zeros(3), torch.zeros(3)
    reqs = [dist.irecv(b, src=left, tag=2), dist.irecv(a, src=left, tag=1),
            dist.isend(_data(r, 3, torch.float32, salt=1), dst=right, tag=1),
            dist.isend(_data(r, 3, torch.float32, salt=2), dst=right, tag=2)]
    for q in reqs:
        q.wait()
    c.equal("isend/irecv tags", [a, b], [_data(left, 3, torch.float32, salt=1),
                                          _data(left, 3, torch.float32, salt=2)])
    # batch_isend_irecv in both directions
    from_left, from_right = torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    ops = [dist.P2POp(dist.irecv, from_left, left), dist.P2POp(dist.irecv, from_right, right),
           dist.P2POp(dist.isend, _data(r, 4, torch.int64), right),
           dist.P2POp(dist.isend, _data(r, 4, torch.int64), left)]
    for q in dist.batch_isend_irecv(ops):
        q.wait()
    c.equal("batch_isend_irecv", [from_left, from_right],
            [_data(left, 4, torch.int64), _data(right, 4, torch.int64)])
    # a receive from any source (src=None); the sender's rank comes back
    if r == 0:
        seen = set()
        for _ in range(n - 1):
            t = torch.zeros(2)
            src = dist.recv(t, tag=7)
            c.equal("recv from any source", t, _data(src, 2, torch.float32))
            seen.add(src)
        assert seen == set(range(1, n)), seen
    else:
        dist.send(_data(r, 2, torch.float32), dst=0, tag=7)
    # a receive into a strided view whose message is there already: completes as it is posted,
    # the staged copy written back
    dist.send(_data(r, 6, torch.float32), dst=right, tag=11)
    dist.barrier()
    grid = torch.zeros(6, 2)
    dist.recv(grid[:, 1], src=left, tag=11)
    c.equal("recv into a strided view", grid, torch.stack([torch.zeros(6), _data(left, 6, torch.float32)], 1))
    # a receive's Work names its sender, whether it completed as it was posted or later; other
    # Works refuse, as torch's do
    dist.send(_data(r, 2, torch.float32), dst=right, tag=12)
    dist.barrier()
    into = [torch.zeros(2), torch.zeros(2)]
    works = [dist.irecv(into[0], src=left, tag=12), dist.irecv(into[1], src=left, tag=13)]
    dist.send(_data(r, 2, torch.float32), dst=right, tag=13)
    for w, t in zip(works, into):
        w.wait()
        assert w._source_rank() == left, (w, w._source_rank())
        assert w.get_future().value()[0] is t  # its own outputs, whatever calls came after
    for w in (dist.all_reduce(torch.ones(2), async_op=True), dist.isend(torch.ones(2), dst=right, tag=14)):
        w.wait()
        try:
            w._source_rank()
        except RuntimeError as exc:
            assert "recv or recv-from-any" in str(exc), exc
        else:
            raise AssertionError(f"{w}: a source rank where there is none")
    dist.recv(torch.zeros(2), src=left, tag=14)
    c.count += 2
    # a future on a point-to-point Work completes without anybody calling wait()
    t = torch.zeros(2)
    req = dist.irecv(t, src=left, tag=9)
    dist.isend(_data(r, 2, torch.float32), dst=right, tag=9).get_future().wait()
    req.get_future().wait()
    c.equal("p2p future", t, _data(left, 2, torch.float32))
    # a wait's own timeout on a receive whose sender is late bounds that wait only, and says so
    # (it read as the receive's failure: 'timed out waiting for rank(s) ...; the peer is stuck')
    req = dist.irecv(t, src=left, tag=10)
    try:
        req.wait(timeout=timedelta(seconds=0.2))
    except TimeoutError as exc:
        assert f"rank {r}: recv from rank {left}" in str(exc) and "not complete after 0.2 s" in str(exc) \
            and "stays pending" in str(exc), exc
    else:
        raise AssertionError("a wait for a message not sent yet returned")
    dist.barrier()
    dist.send(_data(r, 2, torch.float32), dst=right, tag=10)
    req.wait()
    c.equal("p2p wait again", t, _data(left, 2, torch.float32))
    dist.barrier()


def _check_objects(c: _Checker) -> None:
    import torch.distributed as dist

    r, n = c.rank, c.size
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": r, "payload": "x" * (100 * r)})
    assert objs == [{"rank": k, "payload": "x" * (100 * k)} for k in range(n)], objs
    gathered = [None] * n if r == 0 else None
    dist.gather_object(("from", r), gathered, dst=0)
    if r == 0:
        assert gathered == [("from", k) for k in range(n)], gathered
    lst = [f"root {n - 1}", {1, 2}] if r == n - 1 else [None, None]
    dist.broadcast_object_list(lst, src=n - 1)
    assert lst == [f"root {n - 1}", {1, 2}], lst
    out = [None]
    dist.scatter_object_list(out, [k * 10 for k in range(n)] if r == 0 else None, src=0)
    assert out == [r * 10], out
    c.count += 4


def _check_functional_and_mesh(c: _Checker) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    r, n = c.rank, c.size
    mesh = init_device_mesh("cpu", (n,))
    assert mesh.get_group().group_name == dist.distributed_c10d._get_default_group().group_name
    x = _data(r, 4 * n, torch.float32)
    c.equal("funcol all_reduce", funcol.all_reduce(x, "sum", mesh).wait(), sum(_data(k, 4 * n, torch.float32)
                                                                               for k in range(n)))
    c.equal("funcol all_gather_tensor", funcol.all_gather_tensor(x, 0, mesh).wait(),
            torch.cat([_data(k, 4 * n, torch.float32) for k in range(n)]))
    c.equal("funcol reduce_scatter_tensor", funcol.reduce_scatter_tensor(x, "sum", 0, mesh).wait(),
            sum(_data(k, 4 * n, torch.float32) for k in range(n))[4 * r: 4 * r + 4])
    c.equal("funcol all_to_all_single", funcol.all_to_all_single(x, None, None, mesh).wait(),
            torch.cat([_data(k, 4 * n, torch.float32)[4 * r: 4 * r + 4] for k in range(n)]))
    c.equal("funcol broadcast", funcol.broadcast(x, n - 1, mesh).wait(), _data(n - 1, 4 * n, torch.float32))
    # the devices torch's helpers ask a group for, and a state dict loaded by broadcast from rank 0
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    pg = dist.distributed_c10d._get_default_group()
    assert {d.type for d in pg._device_types} == {"cpu", "cuda"}, pg._device_types
    model = torch.nn.Linear(3, 2)
    full = {k: torch.full_like(v, 7.0) for k, v in model.state_dict().items()} if r == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    assert all((v == 7.0).all() for v in model.state_dict().values()), model.state_dict()
    # a tensor a call used stays resizable (torch's first FSDP frees parameters so)
    t = torch.ones(8)
    dist.all_reduce(t)
    t.untyped_storage().resize_(0)
    c.count += 2
    # by group name, as compiled code calls them
    name = dist.distributed_c10d._get_default_group().group_name
    y = torch.ops._c10d_functional.all_reduce(x, "avg", name)
    y = torch.ops._c10d_functional.wait_tensor(y)
    c.equal("c10d_functional all_reduce avg", y, sum(_data(k, 4 * n, torch.float32) for k in range(n)) / n)


def scenario_ops() -> None:
    import torch.distributed as dist

    import tensorwire.torch  # noqa: F401

    dist.init_process_group("tensorwire")
    c = _Checker(dist.new_group(backend="gloo"))
    for check in (_check_reductions, _check_data_movement, _check_async, _check_p2p, _check_objects,
                  _check_functional_and_mesh):
        check(c)
    print(f"rank {c.rank}: {c.count} checks passed")
    dist.destroy_process_group()


def _form(value):
    """A Work's value as nested lists of tensor shapes: what both backends must agree on."""
    import torch

    return tuple(value.shape) if isinstance(value, torch.Tensor) else [_form(v) for v in value]


def scenario_work_results() -> None:
    import torch
    import torch.distributed as dist

    import tensorwire.torch  # noqa: F401

    dist.init_process_group("tensorwire")
    gloo = dist.new_group(backend="gloo")
    r, n = dist.get_rank(), dist.get_world_size()

    def x():
        return torch.full((3,), float(r + 1))

    def zeros():
        return [torch.zeros(3) for _ in range(n)]

    calls = {
        "all_reduce": lambda g: dist.all_reduce(x(), group=g, async_op=True),
        "broadcast": lambda g: dist.broadcast(x(), 0, group=g, async_op=True),
        "reduce": lambda g: dist.reduce(x(), 0, group=g, async_op=True),
        "all_gather": lambda g: dist.all_gather(zeros(), x(), group=g, async_op=True),
        "all_gather_coalesced": lambda g: dist.all_gather_coalesced([zeros(), zeros()], [x(), x()],
                                                                    group=g, async_op=True),
        "all_to_all": lambda g: dist.all_to_all(zeros(), [x() for _ in range(n)], group=g, async_op=True),
        "all_to_all_single": lambda g: dist.all_to_all_single(torch.zeros(3 * n), torch.ones(3 * n),
                                                              group=g, async_op=True),
        "scatter": lambda g: dist.scatter(torch.zeros(3), zeros() if r == 0 else None, 0, group=g,
                                          async_op=True),
        "barrier": lambda g: dist.barrier(group=g, async_op=True),
    }
    for root in range(n):
        calls[f"gather to {root}"] = lambda g, q=root: dist.gather(x(), zeros() if r == q else None, q,
                                                                   group=g, async_op=True)
    for what, call in calls.items():
        forms = []
        for group in (None, gloo):
            work = call(group)
            if isinstance(work, torch._C.Future):  # what torch's all_gather_coalesced returns
                forms.append(_form(work.wait()))
                continue
            value = work.get_future().wait()
            work.wait()  # Gloo's result() asks for it
            forms.append((_form(value), _form(work.result())))
        assert forms[0] == forms[1], f"rank {r}: {what}: future value, result() {forms[0]}; Gloo's {forms[1]}"
    outs = zeros() if r == 0 else None
    got = dist.gather(x(), outs, 0, async_op=True).get_future().wait()
    assert r != 0 or all(a is b for a, b in zip(got, outs, strict=True)), got  # the root's own tensors
    # a synchronous call's Work, from the ProcessGroup's method, stays that call's (as Gloo's)
    for group in (dist.distributed_c10d._get_default_group(), gloo):
        opts = dist.AllreduceOptions()
        opts.asyncOp = False
        a, b = torch.ones(2), torch.ones(3)
        first = group.allreduce([a], opts)
        second = group.allreduce([b], opts)
        first.wait()
        second.wait()
        assert first.result()[0] is a and first.get_future().wait()[0] is a, (group, first.result())
        assert second.result()[0] is b, (group, second.result())
    dist.destroy_process_group()


def scenario_four() -> None:
    """Four ranks: the ops on a tensorwire world and its sub-groups, then tensorwire groups
    created with new_group(backend="tensorwire") on top of a Gloo world."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh

    import tensorwire.torch  # noqa: F401
    from tensorwire.torch import ProcessGroupTensorwire

    dist.init_process_group("tensorwire")
    c = _Checker(dist.new_group(backend="gloo"))
    r = c.rank
    _check_reductions(c)
    _check_data_movement(c)
    _check_p2p(c)
    # sub-groups: overlapping, created in the same order everywhere; non-members get nothing
    subsets = [[0, 1], [1, 2, 3], [3, 0], [2], [0, 1, 2, 3]]
    groups = [dist.new_group(s) for s in subsets]
    gloos = [dist.new_group(s, backend="gloo") for s in subsets]
    for ranks, g, gg in zip(subsets, groups, gloos):
        ranks = sorted(ranks)  # torch orders a group's ranks
        if r not in ranks:
            assert g == dist.GroupMember.NON_GROUP_MEMBER
            continue
        assert isinstance(g, ProcessGroupTensorwire), g
        assert dist.get_process_group_ranks(g) == ranks
        me = ranks.index(r)
        t, u = _data(r, 6, torch.float32), _data(r, 6, torch.float32)
        dist.all_reduce(t, group=g)
        dist.all_reduce(u, group=gg)
        c.equal(f"all_reduce on {ranks}", t, u)
        outs = [torch.zeros(2) for _ in ranks]
        dist.all_gather(outs, _data(r, 2, torch.float32), group=g)
        c.equal(f"all_gather on {ranks}", outs, [_data(k, 2, torch.float32) for k in ranks])
        b = _data(r, 3, torch.float32)
        dist.broadcast(b, src=ranks[-1], group=g)  # global rank, as torch takes it
        c.equal(f"broadcast on {ranks}", b, _data(ranks[-1], 3, torch.float32))
        if len(ranks) > 1:
            got = torch.zeros(2)
            nxt, prv = ranks[(me + 1) % len(ranks)], ranks[(me - 1) % len(ranks)]
            reqs = [dist.isend(_data(r, 2, torch.float32), dst=nxt, group=g),
                    dist.irecv(got, src=prv, group=g)]
            for q in reqs:
                q.wait()
            c.equal(f"isend/irecv on {ranks}", got, _data(prv, 2, torch.float32))
    # a 2-D DeviceMesh: its dimensions are tensorwire sub-groups; functional collectives on each
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = _data(r, 4, torch.float32)
    for i, dim in enumerate(("dp", "tp")):
        members = dist.get_process_group_ranks(mesh.get_group(dim))
        assert isinstance(mesh.get_group(dim), ProcessGroupTensorwire)
        c.equal(f"mesh {dim} all_reduce", funcol.all_reduce(x, "sum", (mesh, i)).wait(),
                sum(_data(k, 4, torch.float32) for k in members))
        c.equal(f"mesh {dim} all_gather", funcol.all_gather_tensor(x, 0, mesh[dim]).wait(),
                torch.cat([_data(k, 4, torch.float32) for k in members]))
    dist.destroy_process_group()

    # Phase 2: a Gloo world (fresh store), tensorwire only for some groups; pairs connect on demand.
    import tensorwire.torch.world as tw_world

    assert tw_world._runtime is None, "the tensorwire world was not shut down with torch's"
    port = int(os.environ["MASTER_PORT"]) + 1
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=4)
    for ranks in ([0, 1], [2, 3], [1, 2], [0, 1, 2, 3], [0, 3]):
        g = dist.new_group(ranks, backend="tensorwire")
        if r not in ranks:
            continue
        assert isinstance(g, ProcessGroupTensorwire) and dist.get_backend(g) == "tensorwire"
        t = _data(r, 5, torch.float32)
        dist.all_reduce(t, group=g)
        c.equal(f"tensorwire group {ranks} on a gloo world", t,
                sum(_data(k, 5, torch.float32) for k in ranks))
        outs = [torch.zeros(5) for _ in ranks]
        dist.all_gather(outs, _data(r, 5, torch.float32), group=g)
        c.equal(f"all_gather {ranks} on a gloo world", outs, [_data(k, 5, torch.float32) for k in ranks])
    engine = tw_world._runtime.engine
    # one connection per pair, whatever the number of groups: 3 peers at most
    assert len(engine.channels) <= 3 and r not in engine.channels, sorted(engine.channels)
    t = torch.ones(3)
    dist.all_reduce(t)  # the gloo world still works beside them
    assert torch.equal(t, torch.full((3,), 4.0))
    dist.destroy_process_group()
    assert tw_world._runtime is None
    print(f"rank {r}: {c.count} checks passed")


TORCH_DTYPES = ("bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16",
                "bfloat16", "float32", "float64", "complex32", "complex64", "complex128", "float8_e4m3fn",
                "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")


def _wide(t):
    """A tensor's values in numpy at full width: float64, complex128, int64 or bool."""
    import torch

    if t.dtype == torch.bool:
        return t.numpy().copy()
    if t.is_complex():
        return t.to(torch.complex128).numpy()
    return t.to(torch.float64 if t.is_floating_point() else torch.int64).numpy()


def _fold(inputs, op: str, factor: float | None, premul_first: bool):
    """What every rank must hold: the inputs folded in rank order in float64 (complex128, int64),
    each step rounded to the inputs' dtype as the dtype's own arithmetic rounds it; AVG and
    PREMUL_SUM finish the fold, unless torch's backend scales each input first (premul_first)."""
    import numpy as np
    import torch

    dtype = inputs[0].dtype

    def rounded(x):
        return _wide(torch.from_numpy(np.ascontiguousarray(x)).to(dtype))

    xs = [_wide(t) for t in inputs]
    if op == "PREMUL_SUM" and premul_first:
        xs = [rounded(factor * x) for x in xs]
    if dtype == torch.bool:
        fn = {"SUM": np.logical_or, "PRODUCT": np.logical_and, "MIN": np.logical_and, "MAX": np.logical_or,
              "BAND": np.logical_and, "BOR": np.logical_or, "BXOR": np.logical_xor}[op]
    else:
        fn = {"SUM": np.add, "AVG": np.add, "PREMUL_SUM": np.add, "PRODUCT": np.multiply, "MIN": np.minimum,
              "MAX": np.maximum, "BAND": np.bitwise_and, "BOR": np.bitwise_or, "BXOR": np.bitwise_xor}[op]
    acc = xs[0]
    for x in xs[1:]:
        acc = rounded(fn(acc, x))
    if op == "AVG":
        acc = rounded(acc // len(xs) if acc.dtype == np.int64 else acc / len(xs))
    elif op == "PREMUL_SUM" and not premul_first:
        acc = rounded(acc * factor)
    return acc


def _torch_ops(dtype) -> list[str]:
    """The reduce ops defined for a torch dtype."""
    import torch

    if dtype == torch.bool:
        return ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
    if dtype.is_complex:
        return ["SUM", "AVG", "PRODUCT", "PREMUL_SUM"]
    if dtype.is_floating_point:
        return ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"]
    return ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]


def scenario_dtypes() -> None:
    """See test_every_torch_dtype_and_op_without_ml_dtypes."""
    import torch
    import torch.distributed as dist

    import tensorwire.torch  # noqa: F401

    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        pass
    else:
        raise AssertionError("ml_dtypes is importable: this scenario must run without it")
    dist.init_process_group("tensorwire")
    r = dist.get_rank()
    subsets = [[0, 1, 2], [0, 1], [0], [1], [2]]  # n = 3, 2, 1; created in the same order everywhere
    groups = [(ranks, dist.new_group(ranks)) for ranks in subsets]
    checks = 0
    for ranks, pg in groups:
        if r in ranks:
            _check_planned_results(pg)
            for name in TORCH_DTYPES:
                for op in _torch_ops(getattr(torch, name)):
                    checks += _check_dtype_op(pg, ranks, getattr(torch, name), op)
    assert sys.modules.get("ml_dtypes", None) is None
    print(f"rank {r}: {checks} checks passed")
    dist.destroy_process_group()


def _check_planned_results(pg) -> None:
    """Repeated calls on the same small tensors run planned signatures, and return the tensors
    (not tensorwire's numpy views of them), as the first call does."""
    import numpy as np
    import torch

    from tensorwire import buffers
    from tensorwire.ops import ReduceOp

    tw = pg.tensorwire_group
    t, o, u = torch.ones(4), torch.zeros(4), torch.ones(4)
    for _ in range(3):
        assert tw.all_reduce(t) is t and tw.all_reduce(t, out=o) is o
        assert tw.broadcast(t, 0) is t and tw.broadcast(t, 0, out=o) is o
        assert tw.reduce(u, 0) is u
        work = tw.all_reduce(t, async_op=True)
        work.wait()
        assert work.result() is t
    assert buffers.seen_torch_view(t) is not None
    assert ("all_reduce", np.dtype(np.float32), 4, ReduceOp.SUM, True) in tw.plans
    assert torch.equal(t, torch.full((4,), float(tw.size ** 6))), t  # six sums of equal tensors


def _check_dtype_op(pg, ranks: list[int], dtype, op: str) -> int:
    """One op on one dtype in one group, every way in: the number of results checked."""
    import torch
    import torch.distributed as dist

    from tensorwire import ops

    r = dist.get_rank()
    n, me, tw = len(ranks), ranks.index(r), pg.tensorwire_group
    tol = 2 * torch.finfo(dtype).eps if dtype.is_floating_point or dtype.is_complex else 0.0
    factor = 0.5 if dtype.is_floating_point or dtype.is_complex else 2.0
    theirs = dist._make_nccl_premul_sum(factor) if op == "PREMUL_SUM" else getattr(dist.ReduceOp, op)
    ours = ops.premul_sum(factor) if op == "PREMUL_SUM" else getattr(ops.ReduceOp, op)
    inputs = [_data(k, 5 * n, dtype) for k in ranks]
    # (what, call, whether the PREMUL_SUM factor scales each input: torch's backend does, as NCCL)
    cases = [("tensorwire all_reduce", lambda t: tw.all_reduce(t, ours), False),
             ("dist.reduce", lambda t: dist.reduce(t, ranks[-1], theirs, group=pg), True)]
    if not (dtype.is_complex and op == "PRODUCT"):  # torch refuses that all_reduce itself
        cases.append(("dist.all_reduce", lambda t: dist.all_reduce(t, theirs, group=pg), True))
    checks = 0
    for what, call, premul_first in cases:
        t = _data(r, 5 * n, dtype)
        for repeat in range(2):  # the same memory again: the second call runs a planned signature
            t.copy_(_data(r, 5 * n, dtype))
            call(t)
            if what == "dist.reduce" and r != ranks[-1]:
                assert torch.equal(t.view(torch.uint8), _data(r, 5 * n, dtype).view(torch.uint8)), what
                continue
            want = _fold(inputs, op, factor, premul_first)
            _close(f"rank {r} n={n} {what} {dtype} {op} #{repeat}", _wide(t), want, tol)
            checks += 1
    out = torch.zeros(5, dtype=dtype)
    dist.reduce_scatter_tensor(out, _data(r, 5 * n, dtype), theirs, group=pg)
    _close(f"rank {r} n={n} reduce_scatter_tensor {dtype} {op}", _wide(out),
           _fold(inputs, op, factor, True)[5 * me:5 * me + 5], tol)
    return checks + 1


def _close(what: str, got, want, tol: float) -> None:
    import numpy as np

    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    ok = np.array_equal(got, want) if tol == 0 else np.allclose(got, want, rtol=tol, atol=0)
    assert ok, f"{what}: got {got}, want {want}"


def test_torch_groups_derive_their_context_ids_as_tensorwire_groups_do() -> None:
    """One 32-bit FNV-1a (group/context.py) derives every context id: a torch group's from its
    name and ranks, new_group's and split's from their parts; the values stay what they were."""
    from tensorwire.group.context import context_of, mix_context
    from tensorwire.torch.world import context_id

    assert (context_of(b""), context_of(b"a")) == (0x811C9DC5, 0xE40C292C)  # FNV-1a's own test vectors
    assert context_id("0", [0, 1]) == context_of(b"torch/0/0,1") == 2963739802
    parts = b"".join(p.to_bytes(8, "little") for p in (1, 2, 3))
    assert mix_context(1, 2, 3) == context_of(parts) == 1095553189


def test_a_work_wait_beyond_what_a_thread_can_wait_means_no_limit() -> None:
    """torch passes timedelta: one too large for a thread's wait (a million days) bounds
    nothing, as 0 does, where it raised OverflowError."""
    from datetime import timedelta

    from tensorwire.torch.work import seconds

    assert seconds(timedelta(days=10**6)) is None and seconds(timedelta(0)) is None
    assert seconds(timedelta(seconds=90)) == 90.0 and seconds(2.5) == 2.5


@pytest.mark.timeout(120)
def test_calls_show_in_torch_profiler() -> None:
    """As gloo's do (`gloo:all_reduce`): sync and async collectives, point-to-point, a DDP
    step's bucket all-reduces, named after torch.distributed's functions."""
    assert_all_ok(launch("profiled", 2), "profiled")


def scenario_profiled() -> None:
    import time

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import tensorwire.torch  # noqa: F401

    dist.init_process_group("tensorwire")
    r = dist.get_rank()
    t = torch.ones(1 << 12)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
        dist.broadcast(t, 0)
        out = torch.empty(2 << 12)
        dist.all_gather_into_tensor(out, t)
        dist.send(t, 1) if r == 0 else dist.recv(t, 0)
        dist.barrier()
        model(torch.ones(4, 8)).sum().backward()
        dist.barrier()
        if r == 1:
            time.sleep(0.3)
        late = dist.all_reduce(torch.ones(4), async_op=True)  # completes 0.3 s on, on rank 0
        time.sleep(0.8)
        late.wait()
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith("tensorwire:"):
            counts[event.name] = counts.get(event.name, 0) + 1
    last = [e for e in prof.events() if e.name == "tensorwire:all_reduce"][-1]
    took = (last.time_range.end - last.time_range.start) / 1e6
    assert r == 1 or 0.2 < took < 0.7, took  # it ended as the Work completed, not as the profiler stopped
    want = {"tensorwire:all_reduce": 4, "tensorwire:broadcast": 1, "tensorwire:all_gather_into_tensor": 1,
            "tensorwire:send" if r == 0 else "tensorwire:recv": 1, "tensorwire:barrier": 1}
    assert all(counts.get(k, 0) >= v for k, v in want.items()), counts
    assert t[0].item() == 4 and torch.equal(out, torch.full((2 << 12,), 4.0)), (t[:2], out[:2])
    dist.destroy_process_group()


def run_scenario(namespace: dict) -> None:
    """`python tests/<file>.py SCENARIO ARGS...`: run scenario_SCENARIO(*ARGS) and say so."""
    scenario = sys.argv[1]
    namespace[f"scenario_{scenario}"](*sys.argv[2:])
    print(f"rank {os.environ.get('RANK')}: {scenario} OK", flush=True)


if __name__ == "__main__":
    run_scenario(globals())
