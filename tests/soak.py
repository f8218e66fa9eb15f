"""Soak: thousands of random collectives, every result checked against numpy.

    python tests/soak.py                                  20000 steps, 4 ranks, shm then TCP
    python tests/soak.py --seconds 20 --transport tcp     as many steps as fit in 20 s
    python tests/soak.py --seed 7 --replay 1234           step 1234 of seed 7 again, alone

Each step draws, from (seed, step) alone, a collective (every one tensorwire has, plus
point-to-point), a group (the world, a reordered copy, subgroups from new_group and split), a
dtype, an op, a size from 0 to 4 MiB per rank, a root and whether it runs async (async calls
are waited for a few steps later, so several are in flight at once). Every rank derives every
rank's input from (seed, step, rank, block), so it computes what it must receive with plain
numpy folds and compares. The seed is printed first; a wrong result names the step and the
command that replays it. Ranks stop together: every 16 steps they agree (all_reduce MAX)
whether any of them is out of time.

`check_every_collective(group, seed)` runs each collective once at a few sizes on one group
(tests/test_shrink.py checks shrunk groups with it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import tensorwire as tw
from tensorwire.ops import ReduceOp, premul_sum

MAX_BYTES = 4 << 20
SYNC_EVERY = 16  # steps between the ranks' agreement on stopping (and the wait for async calls)
MAX_IN_FLIGHT = 4  # async calls outstanding before they are waited for

try:
    import ml_dtypes

    _BF16: list[np.dtype] = [np.dtype(ml_dtypes.bfloat16)]
except ImportError:  # the bf16 extra is not installed
    _BF16 = []

DTYPES = [np.dtype(t) for t in (np.bool_, np.int8, np.uint8, np.int32, np.int64, np.float16, np.float32,
                                np.float64, np.complex64)] + _BF16
_EXACT_OPS = {  # what a fold of small integers gives exactly, by dtype kind
    "b": [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR,
          ReduceOp.BXOR],
    "i": [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG, ReduceOp.BAND,
          ReduceOp.BOR, ReduceOp.BXOR],
    "f": [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG, ReduceOp.PREMUL_SUM],
    "c": [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.AVG],
}
_BOOL_FOLD = {ReduceOp.SUM: np.logical_or, ReduceOp.PRODUCT: np.logical_and, ReduceOp.MIN: np.logical_and,
              ReduceOp.MAX: np.logical_or, ReduceOp.BAND: np.logical_and, ReduceOp.BOR: np.logical_or,
              ReduceOp.BXOR: np.logical_xor}
_FOLD = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PREMUL_SUM: np.add,
         ReduceOp.PRODUCT: np.multiply, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
         ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}
_FACTORS = (0.5, 2.0, 0.25)  # PREMUL_SUM factors: powers of two keep small sums exact

KINDS = {  # collective -> weight in the draw
    "all_reduce": 4, "reduce": 2, "broadcast": 3, "all_gather": 1, "all_gather_into_tensor": 2,
    "all_gatherv": 1, "gather": 1, "gatherv": 1, "scatter": 1, "scatterv": 1, "reduce_scatter": 1,
    "reduce_scatter_tensor": 2, "reduce_scatterv": 1, "all_to_all": 1, "all_to_all_single": 2,
    "all_to_allv": 1, "barrier": 1, "sendrecv": 2,
}
_REDUCING = {"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatterv"}
_BLOCKED = {"all_to_all", "all_to_all_single", "all_to_allv", "reduce_scatter", "reduce_scatter_tensor",
            "reduce_scatterv", "scatter", "scatterv"}  # the rank's buffer is split in group-size blocks


# ------------------------------------------------------------------------------------ groups

@dataclass(frozen=True)
class GroupSpec:
    label: str
    members: tuple[int, ...]  # world ranks, in group-rank order


def group_specs(n: int) -> list[GroupSpec]:
    """The groups a soak uses, the same list on every rank of an n-rank world."""
    specs = [GroupSpec("world", tuple(range(n))), GroupSpec("reversed", tuple(reversed(range(n)))),
             GroupSpec("evens", tuple(range(0, n, 2))), GroupSpec("ends", (0, n - 1) if n > 1 else (0,))]
    for color in (0, 1):  # split(color=rank % 2, key=-rank): members by descending rank
        members = tuple(sorted((r for r in range(n) if r % 2 == color), reverse=True))
        if members:
            specs.append(GroupSpec(f"split{color}", members))
    return specs


def build_groups(world: tw.Group) -> list[tw.Group | None]:
    """This rank's group for each spec (None where it is not a member); collective."""
    specs = group_specs(world.size)
    groups: list[tw.Group | None] = [world]
    for spec in specs[1:4]:
        g = world.new_group(list(spec.members), name=spec.label)
        groups.append(g if g.is_member else None)
    mine = world.split(world.rank % 2, key=-world.rank)
    for spec in specs[4:]:
        groups.append(mine if world.rank in spec.members else None)
    return groups


# ------------------------------------------------------------------------------------ steps

@dataclass(frozen=True)
class Step:
    index: int
    group: int  # index into group_specs
    kind: str
    dtype: np.dtype
    op: Any  # ReduceOp, a PREMUL_SUM Reduction, or None
    count: int  # elements of a rank's buffer (for blocked kinds: of each block)
    root: int
    async_op: bool
    out_of_place: bool
    counts: tuple[int, ...]  # per-rank counts of the vector forms (and of all_to_allv's rows)

    def describe(self, specs: Sequence[GroupSpec]) -> str:
        op = "" if self.op is None else f" {self.op.name if isinstance(self.op, ReduceOp) else self.op}"
        extra = f", counts {list(self.counts)}" if self.counts else ""
        how = f"{', async' if self.async_op else ''}{', out of place' if self.out_of_place else ''}"
        return (f"{self.kind}{op} of {self.count} x {self.dtype.name} (root {self.root}{extra}{how}) on "
                f"group {specs[self.group].label} {list(specs[self.group].members)}")


def draw(seed: int, index: int, specs: Sequence[GroupSpec], kind: str | None = None,
         nbytes: int | None = None, group: int = -1) -> Step:
    """Step `index` of `seed`: a function of those alone (and the world's size through specs)."""
    rng = np.random.default_rng([seed, index])
    g = int(rng.integers(len(specs))) if group < 0 else group
    size = len(specs[g].members)
    if kind is None:
        names = list(KINDS)
        weights = np.array([KINDS[k] for k in names], dtype=float)
        kind = names[int(rng.choice(len(names), p=weights / weights.sum()))]
    dtype = DTYPES[int(rng.integers(len(DTYPES)))]
    op = None
    if kind in _REDUCING:
        ops = _EXACT_OPS[_category(dtype)]
        op = ops[int(rng.integers(len(ops)))]
        if op is ReduceOp.PREMUL_SUM:
            op = premul_sum(_FACTORS[int(rng.integers(len(_FACTORS)))])
    if nbytes is None:
        nbytes = 0 if rng.random() < 0.05 else int(np.exp(rng.uniform(0.0, np.log(MAX_BYTES))))
    count = nbytes // dtype.itemsize
    if kind in _BLOCKED:
        count //= size
    counts: tuple[int, ...] = ()
    if kind in ("all_gatherv", "gatherv", "scatterv", "reduce_scatterv", "all_to_allv"):
        counts = tuple(int(c) for c in rng.integers(0, count + 1, size))
    return Step(index, g, kind, dtype, op, count, int(rng.integers(size)), bool(rng.random() < 0.25),
                bool(rng.random() < 0.5), counts)


def _category(dtype: np.dtype) -> str:
    """'b' bool, 'i' integers, 'c' complex, 'f' floats (bfloat16 included)."""
    return {"b": "b", "i": "i", "u": "i", "c": "c"}.get(dtype.kind, "f")


def block(seed: int, step: Step, rank: int, part: int, count: int) -> np.ndarray:
    """Rank `rank`'s block `part` of step `step`: small integers, so folds are exact in any dtype
    and order (products of at most 4 ranks of values in -2..2; a few ranks more stay exact too)."""
    rng = np.random.default_rng([seed, step.index, rank, part])
    op = step.op.op if hasattr(step.op, "op") else step.op
    if step.dtype.kind == "b":
        return rng.integers(0, 2, count, dtype=np.int8).astype(np.bool_)
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        return rng.integers(0, 128, count, dtype=np.int8).astype(step.dtype)
    low, high = ((-2, 3) if op is ReduceOp.PRODUCT else (-8, 9)) if step.dtype.kind != "u" else \
        ((0, 3) if op is ReduceOp.PRODUCT else (0, 17))
    values = rng.integers(low, high, count, dtype=np.int8)
    if step.dtype.kind == "c":
        return (values + 1j * rng.integers(low, high, count, dtype=np.int8)).astype(step.dtype)
    return values.astype(step.dtype)


def fold(arrays: Sequence[np.ndarray], step: Step, size: int) -> np.ndarray:
    """What the reduction of `arrays` must be, by numpy (left fold, then AVG/PREMUL_SUM)."""
    red = step.op
    op = red.op if hasattr(red, "op") else red
    dtype = step.dtype
    table = _BOOL_FOLD if dtype.kind == "b" else _FOLD
    out = np.array(arrays[0], copy=True)
    for a in arrays[1:]:
        table[op](out, a, out=out)
    if op is ReduceOp.AVG:
        if dtype.kind in "iu":
            return out // dtype.type(size)
        wide = np.float32 if dtype.itemsize <= 2 else dtype.type  # float16, bfloat16: in float32
        return (out.astype(wide) / wide(size)).astype(dtype)
    if op is ReduceOp.PREMUL_SUM:
        return (out.astype(np.float32 if dtype.itemsize <= 2 else dtype.type) * red.factor).astype(dtype)
    return out


# ------------------------------------------------------------------------------------ running

class Mismatch(AssertionError):
    pass


@dataclass
class Pending:
    step: Step
    works: list[Any]
    checks: list[Callable[[], None]]


class Soak:
    """Runs steps on this rank: draws them, calls the collective, checks what it received."""

    def __init__(self, world: tw.Group, seed: int, replay_hint: str = "", only: bool = False) -> None:
        """`only`: steps run on `world` alone (no subgroups are made)."""
        self.world = world
        self.seed = seed
        self.specs = [GroupSpec("group", tuple(world.ranks))] if only else group_specs(world.size)
        self.groups: list[tw.Group | None] = [world] if only else build_groups(world)
        self.hint = replay_hint
        self.pending: list[Pending] = []
        self.done: Counter[str] = Counter()

    # -- the loop ---------------------------------------------------------------------------
    def run(self, steps: int | None, seconds: float | None, report: Callable[[str], None]) -> int:
        """Steps 0, 1, ... until `steps` or, agreed by all ranks, `seconds`; the steps run."""
        start = last = time.monotonic()
        index = 0
        while steps is None or index < steps:
            self.step(index)
            index += 1
            if index % SYNC_EVERY == 0:
                self.settle()
                out = np.array([seconds is not None and time.monotonic() - start > seconds], dtype=np.uint8)
                self.world.all_reduce(out, ReduceOp.MAX)
                if out[0]:
                    break
                if time.monotonic() - last > 5:
                    last = time.monotonic()
                    report(f"soak: step {index}, {index / (last - start):.0f} steps/s")
        self.settle()
        self.world.barrier()
        return index

    def step(self, index: int, step: Step | None = None) -> None:
        step = step or draw(self.seed, index, self.specs)
        g = self.groups[step.group]
        if g is None:
            return
        try:
            works, checks = RUNNERS[step.kind](self, g, step)
        except Exception as exc:
            raise Mismatch(self._where(step, g, f"raised {type(exc).__name__}: {exc}")) from exc
        self.done[step.kind] += 1
        if step.async_op:
            self.pending.append(Pending(step, works, checks))
            if len(self.pending) >= MAX_IN_FLIGHT:
                self.settle()
        else:
            self._finish(Pending(step, works, checks), g)

    def settle(self) -> None:
        """Wait for every async call in flight and check it."""
        pending, self.pending = self.pending, []
        for p in pending:
            self._finish(p, self.groups[p.step.group])

    def _finish(self, p: Pending, g: tw.Group) -> None:
        try:
            for work in p.works if p.step.async_op else ():  # blocking calls return their output
                work.wait()
            for check in p.checks:
                check()
        except Mismatch as exc:
            raise Mismatch(self._where(p.step, g, str(exc))) from None
        except Exception as exc:
            raise Mismatch(self._where(p.step, g, f"raised {type(exc).__name__}: {exc}")) from exc

    def _where(self, step: Step, g: tw.Group, what: str) -> str:
        return (f"soak step {step.index} (seed {self.seed}): {step.describe(self.specs)}: group rank "
                f"{g.rank} (world rank {self.world.rank}): {what}\n  replay: {self.hint}--seed {self.seed} "
                f"--replay {step.index}")

    # -- data -------------------------------------------------------------------------------
    def data(self, step: Step, rank: int, part: int = 0, count: int | None = None) -> np.ndarray:
        return block(self.seed, step, rank, part, step.count if count is None else count)


def _expect(got: np.ndarray, want: np.ndarray, what: str, step: Step) -> Callable[[], None]:
    def check() -> None:
        a, b = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
        if a.shape != b.shape:
            raise Mismatch(f"{what}: {a.size} elements, expected {b.size}")
        if _category(step.dtype) == "f":
            a, b = a.astype(np.float64), b.astype(np.float64)
        bad = np.flatnonzero(a != b)
        if bad.size:
            i = int(bad[0])
            raise Mismatch(f"{what}: {bad.size} of {a.size} elements wrong, the first at {i}: got {a[i]!r}, "
                           f"expected {b[i]!r}")
    return check


def _splits(counts: Sequence[int], parts: int) -> list[tuple[int, int]]:
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(int)
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(parts)]


Runner = Callable[[Soak, tw.Group, Step], tuple[list[Any], list[Callable[[], None]]]]


def _all_reduce(s: Soak, g: tw.Group, st: Step):
    mine = s.data(st, g.rank)
    want = fold([s.data(st, r) for r in range(g.size)], st, g.size)
    if st.out_of_place:
        out = np.empty_like(mine)
        work = g.all_reduce(mine, st.op, out=out, async_op=st.async_op)
        return [work], [_expect(out, want, "all_reduce output", st), _expect(mine, s.data(st, g.rank),
                                                                              "all_reduce input", st)]
    work = g.all_reduce(mine, st.op, async_op=st.async_op)
    return [work], [_expect(mine, want, "all_reduce result", st)]


def _reduce(s: Soak, g: tw.Group, st: Step):
    mine = s.data(st, g.rank)
    root = g.rank == st.root
    out = np.empty_like(mine) if st.out_of_place and root else None
    work = g.reduce(mine, st.root, st.op, out=out, async_op=st.async_op)
    if not root:
        return [work], [_expect(mine, s.data(st, g.rank), "reduce input (not the root)", st)]
    want = fold([s.data(st, r) for r in range(g.size)], st, g.size)
    return [work], [_expect(mine if out is None else out, want, "reduce result", st)]


def _broadcast(s: Soak, g: tw.Group, st: Step):
    want = s.data(st, st.root)
    buf = want.copy() if g.rank == st.root else np.zeros_like(want)
    out = np.empty_like(buf) if st.out_of_place else None
    work = g.broadcast(buf, st.root, out=out, async_op=st.async_op)
    return [work], [_expect(buf if out is None else out, want, "broadcast result", st)]


def _all_gather(s: Soak, g: tw.Group, st: Step):
    outs = [np.empty(st.count, st.dtype) for _ in range(g.size)]
    work = g.all_gather(outs, s.data(st, g.rank), async_op=st.async_op)
    return [work], [_expect(outs[r], s.data(st, r), f"all_gather block {r}", st) for r in range(g.size)]


def _all_gather_into_tensor(s: Soak, g: tw.Group, st: Step):
    out = np.empty(st.count * g.size, st.dtype)
    work = g.all_gather_into_tensor(out, s.data(st, g.rank), async_op=st.async_op)
    want = np.concatenate([s.data(st, r) for r in range(g.size)])
    return [work], [_expect(out, want, "all_gather_into_tensor output", st)]


def _all_gatherv(s: Soak, g: tw.Group, st: Step):
    out = np.empty(sum(st.counts), st.dtype)
    work = g.all_gatherv(out, s.data(st, g.rank, count=st.counts[g.rank]), st.counts, async_op=st.async_op)
    want = np.concatenate([s.data(st, r, count=st.counts[r]) for r in range(g.size)])
    return [work], [_expect(out, want, "all_gatherv output", st)]


def _gather(s: Soak, g: tw.Group, st: Step):
    root = g.rank == st.root
    outs = [np.empty(st.count, st.dtype) for _ in range(g.size)] if root else None
    work = g.gather(s.data(st, g.rank), outs, st.root, async_op=st.async_op)
    checks = [_expect(outs[r], s.data(st, r), f"gather block {r}", st) for r in range(g.size)] if outs else []
    return [work], checks


def _gatherv(s: Soak, g: tw.Group, st: Step):
    out = np.empty(sum(st.counts), st.dtype) if g.rank == st.root else None
    mine = s.data(st, g.rank, count=st.counts[g.rank])
    work = g.gatherv(out, mine, st.counts, st.root, async_op=st.async_op)
    if out is None:
        return [work], []
    want = np.concatenate([s.data(st, r, count=st.counts[r]) for r in range(g.size)])
    return [work], [_expect(out, want, "gatherv output", st)]


def _scatter(s: Soak, g: tw.Group, st: Step):
    ins = [s.data(st, st.root, part=r) for r in range(g.size)] if g.rank == st.root else None
    out = np.empty(st.count, st.dtype)
    work = g.scatter(out, ins, st.root, async_op=st.async_op)
    return [work], [_expect(out, s.data(st, st.root, part=g.rank), "scatter output", st)]


def _scatterv(s: Soak, g: tw.Group, st: Step):
    full = s.data(st, st.root, count=sum(st.counts))
    out = np.empty(st.counts[g.rank], st.dtype)
    work = g.scatterv(out, full if g.rank == st.root else None, st.counts, st.root, async_op=st.async_op)
    lo, hi = _splits(st.counts, g.size)[g.rank]
    return [work], [_expect(out, full[lo:hi], "scatterv output", st)]


def _reduce_scatter(s: Soak, g: tw.Group, st: Step):
    ins = [s.data(st, g.rank, part=r) for r in range(g.size)]
    out = np.empty(st.count, st.dtype)
    work = g.reduce_scatter(out, ins, st.op, async_op=st.async_op)
    want = fold([s.data(st, r, part=g.rank) for r in range(g.size)], st, g.size)
    return [work], [_expect(out, want, "reduce_scatter output", st)]


def _reduce_scatter_tensor(s: Soak, g: tw.Group, st: Step):
    inp = np.concatenate([s.data(st, g.rank, part=r) for r in range(g.size)])
    out = np.empty(st.count, st.dtype)
    work = g.reduce_scatter_tensor(out, inp, st.op, async_op=st.async_op)
    want = fold([s.data(st, r, part=g.rank) for r in range(g.size)], st, g.size)
    return [work], [_expect(out, want, "reduce_scatter_tensor output", st)]


def _reduce_scatterv(s: Soak, g: tw.Group, st: Step):
    total = sum(st.counts)
    out = np.empty(st.counts[g.rank], st.dtype)
    work = g.reduce_scatterv(out, s.data(st, g.rank, count=total), st.counts, st.op, async_op=st.async_op)
    lo, hi = _splits(st.counts, g.size)[g.rank]
    want = fold([s.data(st, r, count=total)[lo:hi] for r in range(g.size)], st, g.size)
    return [work], [_expect(out, want, "reduce_scatterv output", st)]


def _all_to_all(s: Soak, g: tw.Group, st: Step):
    outs = [np.empty(st.count, st.dtype) for _ in range(g.size)]
    work = g.all_to_all(outs, [s.data(st, g.rank, part=r) for r in range(g.size)], async_op=st.async_op)
    return [work], [_expect(outs[r], s.data(st, r, part=g.rank), f"all_to_all block from {r}", st)
                    for r in range(g.size)]


def _all_to_all_single(s: Soak, g: tw.Group, st: Step):
    inp = np.concatenate([s.data(st, g.rank, part=r) for r in range(g.size)])
    out = np.empty_like(inp)
    work = g.all_to_all_single(out, inp, async_op=st.async_op)
    want = np.concatenate([s.data(st, r, part=g.rank) for r in range(g.size)])
    return [work], [_expect(out, want, "all_to_all_single output", st)]


def _all_to_allv(s: Soak, g: tw.Group, st: Step):
    """all_to_all_single with split sizes: rank i sends counts[(i + j) % n] rows to rank j."""
    n = g.size

    def rows(i: int, j: int) -> int:
        return st.counts[(i + j) % n]

    inp = np.concatenate([s.data(st, g.rank, part=j, count=rows(g.rank, j)) for j in range(n)])
    out = np.empty(sum(rows(i, g.rank) for i in range(n)), st.dtype)
    work = g.all_to_all_single(out, inp, [rows(i, g.rank) for i in range(n)],
                               [rows(g.rank, j) for j in range(n)], async_op=st.async_op)
    want = np.concatenate([s.data(st, i, part=g.rank, count=rows(i, g.rank)) for i in range(n)])
    return [work], [_expect(out, want, "all_to_all_single (split sizes) output", st)]


def _barrier(s: Soak, g: tw.Group, st: Step):
    return [g.barrier(async_op=st.async_op)], []


def _sendrecv(s: Soak, g: tw.Group, st: Step):
    """A ring shift: send to the right, receive from the left (point-to-point, async inside)."""
    right, left = (g.rank + 1) % g.size, (g.rank - 1) % g.size
    out = np.empty(st.count, st.dtype)
    sent = s.data(st, g.rank)
    works = [g.isend(sent, right, tag=st.index & 0xFFFF), g.irecv(out, left, tag=st.index & 0xFFFF)]
    if not st.async_op:
        for w in works:
            w.wait()
    return works, [_expect(out, s.data(st, left), f"recv from rank {left}", st)]


RUNNERS: dict[str, Runner] = {
    "all_reduce": _all_reduce, "reduce": _reduce, "broadcast": _broadcast, "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into_tensor, "all_gatherv": _all_gatherv, "gather": _gather,
    "gatherv": _gatherv, "scatter": _scatter, "scatterv": _scatterv, "reduce_scatter": _reduce_scatter,
    "reduce_scatter_tensor": _reduce_scatter_tensor, "reduce_scatterv": _reduce_scatterv,
    "all_to_all": _all_to_all, "all_to_all_single": _all_to_all_single, "all_to_allv": _all_to_allv,
    "barrier": _barrier, "sendrecv": _sendrecv,
}
assert set(RUNNERS) == set(KINDS)

CHECK_SIZES = (0, 24, 96 << 10, 3 << 20)
"""Bytes per rank that `check_every_collective` runs: empty, the one-shot path, messages and
streaming, and large calls (single copy where the group can)."""


def check_every_collective(group: tw.Group, seed: int = 0) -> int:
    """Every collective (and a ring of point-to-point messages) once per size in CHECK_SIZES on
    `group`, blocking and in the order all members share, each checked against numpy; raises
    Mismatch naming the first wrong one. Every member calls it; returns the calls made."""
    soak = Soak(group, seed, "check_every_collective ", only=True)
    index = 0
    for nbytes in CHECK_SIZES:
        for kind in RUNNERS:
            st = draw(seed, index, soak.specs, kind=kind, nbytes=nbytes, group=0)
            soak.step(index, Step(**{**st.__dict__, "async_op": False}))
            index += 1
    return index


# ------------------------------------------------------------------------------------ driver

def _worker(args: argparse.Namespace) -> int:
    world = tw.init()
    transport = " --transport tcp" if tw.config().transport == "tcp" else ""
    hint = f"python tests/soak.py --np {world.size}{transport} "
    soak = Soak(world, args.seed, hint)
    say = (lambda text: print(text, flush=True)) if world.rank == 0 else (lambda text: None)
    start = time.monotonic()
    if args.replay is not None:
        soak.step(args.replay)
        soak.settle()
        world.barrier()
        say(f"soak: step {args.replay} of seed {args.seed} matched numpy")
        return 0
    steps = soak.run(args.steps, args.seconds, say)
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(soak.done.items()))
    say(f"soak: seed {args.seed}: {steps} steps on {world.size} ranks ({tw.config().transport}) in "
        f"{time.monotonic() - start:.1f} s, every result matched numpy (calls on rank 0: {kinds})")
    tw.destroy()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--steps", type=int, default=None, help="steps per transport (default 20000)")
    parser.add_argument("--seconds", type=float, default=None, help="stop after this long instead")
    parser.add_argument("--seed", type=int, default=None,
                        help="default: $SOAK_SEED, else a fresh one (printed)")
    parser.add_argument("--transport", choices=("shm", "tcp", "both"), default="both")
    parser.add_argument("--replay", type=int, default=None, metavar="STEP", help="run only this step")
    parser.add_argument("--timeout", type=float, default=60, help="TENSORWIRE_TIMEOUT of the ranks")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps is None and args.seconds is None:
        args.steps = 20000
    if args.worker:
        return _worker(args)
    if args.seed is None:
        args.seed = int(os.environ.get("SOAK_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"soak: seed {args.seed} (replay a failing step with --seed {args.seed} --replay STEP)", flush=True)
    transports = ("shm", "tcp") if args.transport == "both" and args.replay is None else \
        (("shm",) if args.transport == "both" else (args.transport,))
    for transport in transports:
        cmd = [sys.executable, "-m", "tensorwire", "run", "-n", str(args.np), "--timeout", str(args.timeout),
               *(["--tcp"] if transport == "tcp" else []), os.path.abspath(__file__), "--worker",
               "--seed", str(args.seed)]
        cmd += ["--replay", str(args.replay)] if args.replay is not None else \
            (["--steps", str(args.steps)] if args.steps is not None else []) + \
            (["--seconds", str(args.seconds)] if args.seconds is not None else [])
        env = {**os.environ, "TENSORWIRE_CALIBRATE": os.environ.get("TENSORWIRE_CALIBRATE", "0")}
        print(f"soak: {transport}: {' '.join(cmd[2:])}", flush=True)
        rc = subprocess.call(cmd, env=env)
        if rc:
            print(f"soak: {transport}: FAILED (exit code {rc}); seed {args.seed}", flush=True)
            return rc
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
