"""Every message-path algorithm of the registry, called directly on real multi-process groups.

For each collective and each of its registered algorithms (the one-shot shared-memory path,
`needs_direct`, is covered by test_collectives.py), on worlds of 1..5 ranks (and 8) over shared
memory and over TCP: sizes 0, 1, not divisible by the group size, a few KB and ~1 MiB; dtypes
float32, float64, int32, bool, bfloat16, complex64; ops SUM, PRODUCT, MIN, MAX, BXOR; roots
everywhere; equal and unequal blocks in the forms that allow them (the vector forms), and
outputs both as separate arrays and as views of one buffer (the two layouts the collective
layer hands over). Algorithms are called as the tuner calls them, through `group.queue.submit`
so they get a sequence number and a fingerprint, and checked against `reference` computed
on every rank from every rank's deterministic input: bit-exact for data movement, integers,
bool, MIN and MAX; within a summation-order bound for floating-point SUM and PRODUCT.
Replicated results (all_reduce) must also be bitwise identical on every rank.

One `cluster.run` per world runs all cases (process start-up dominates on a 2-core machine);
each rank returns its number of cases and failures, and the parent checks both: a test cannot
pass by checking nothing. The cost formulas are checked apart: positive, finite, monotonic in m.
"""

from __future__ import annotations

import hashlib
import math

import ml_dtypes
import numpy as np
import pytest

import tensorwire as tw
from tensorwire.algorithms import chain, registry
from tensorwire.algorithms.base import blocks_of, contiguous_span
from tensorwire.algorithms.ordered import arrange
from tensorwire.algorithms.prices import Link
from tensorwire.algorithms.registry import COLLECTIVES, algorithms_for, slot_bytes
from tensorwire.ops import ReduceOp, Reduction
from tensorwire.ops.dtypes import dtype_code
from tensorwire.ops.kernels import reduction_kernel
from tensorwire.ops.reference import reference
from tensorwire.ops.validation import op_undefined
from tensorwire.transport.wire import Coll, Fingerprint
from tensorwire.tuning import cost_model

BF16 = np.dtype(ml_dtypes.bfloat16)
F32, F64, I32, BOOL, C64 = (np.dtype(t) for t in (np.float32, np.float64, np.int32, np.bool_, np.complex64))
REDUCE_CASES = [(F32, ReduceOp.SUM), (F64, ReduceOp.PRODUCT), (I32, ReduceOp.SUM), (I32, ReduceOp.BXOR),
                (BOOL, ReduceOp.MAX), (BF16, ReduceOp.MIN), (C64, ReduceOp.PRODUCT), (F64, ReduceOp.MAX),
                (BOOL, ReduceOp.BXOR), (C64, ReduceOp.SUM)]
MOVE_DTYPES = [F32, F64, I32, BOOL, BF16, C64]
EPS = {"float32": 2.0 ** -23, "float64": 2.0 ** -52, "bfloat16": 2.0 ** -7, "complex64": 2.0 ** -23}
BIG_BYTES = 1 << 20
BIG_ELEMS = (BIG_BYTES // 4) + 3  # ~1 MiB of float32, not divisible by any group size here
UNEVEN_SALTS = (1, 4)
REQUIRED = {  # issue 4: the families every collective must offer
    "all_reduce": {"ring", "recursive_doubling", "rabenseifner", "tree", "direct"},
    "broadcast": {"binomial", "chain", "scatter_allgather"},
    "reduce": {"binomial", "linear"},
    "gather": {"binomial", "linear"},
    "scatter": {"binomial", "linear"},
    "all_gather": {"ring", "recursive_doubling", "bruck"},
    "reduce_scatter": {"ring", "recursive_halving", "pairwise"},
    "all_to_all": {"pairwise", "bruck"},
    "barrier": {"dissemination"},
}
WORLDS = [(size, transport) for size in (1, 2, 3, 4, 5) for transport in ("shm", "tcp")]


def _message_algorithms(collective: str) -> dict:
    """Those of one host's worlds: the hierarchical ones run across hosts (test_multihost.py)."""
    return {name: alg for name, alg in sorted(algorithms_for(collective).items())
            if not alg.needs_direct and alg.phases is None}


# --------------------------------------------------------------------------- the plan (both sides)

def _sizes(n: int) -> list[int]:
    """Element counts: empty, one, not divisible by n (and fewer than 3n), a few KB."""
    return [0, 1, 2 * n + 1, 1001]


def _uneven(n: int, salt: int) -> list[int]:
    """Per-rank counts with zeros and differences, the same on every rank."""
    return [(3 * r + salt) % 5 * (1 + salt * 40) for r in range(n)]


def _matrix(n: int, salt: int) -> list[list[int]]:
    """all_to_all counts: rank i sends m[i][j] elements to rank j (zeros included)."""
    return [[(7 * i + 3 * j + salt) % 6 * (1 + salt * 30) for j in range(n)] for i in range(n)]


def _plan(collective: str, n: int) -> list[tuple]:
    """The cases one algorithm of `collective` runs on n ranks: (kind, dtype, op, counts, root, variant)."""
    cases: list[tuple] = []
    sizes = _sizes(n)
    if collective in ("all_reduce", "reduce", "reduce_scatter"):
        for dt, op in REDUCE_CASES:
            for c in sizes:
                cases.append(("even", dt, op, c, len(cases) % n, len(cases) % 2))
        cases.append(("big", F32, ReduceOp.SUM, BIG_ELEMS // (n if collective == "reduce_scatter" else 1),
                      n - 1, 1))
        if collective == "reduce_scatter":
            for i, salt in enumerate(UNEVEN_SALTS):
                dt, op = REDUCE_CASES[i]
                cases.append(("uneven", dt, op, salt, 0, i % 2))
    elif collective == "broadcast":
        for dt in MOVE_DTYPES:
            for c in sizes:
                cases.append(("even", dt, None, c, len(cases) % n, 0))
        cases.append(("big", F32, None, BIG_ELEMS, n - 1, 0))
    elif collective in ("all_gather", "gather", "scatter", "all_to_all"):
        for dt in MOVE_DTYPES:
            for c in sizes:
                cases.append(("even", dt, None, c, len(cases) % n, len(cases) % 2))
        cases.append(("big", F32, None, BIG_ELEMS // n, n - 1, 1))
        for i, salt in enumerate(UNEVEN_SALTS):
            cases.append(("uneven", MOVE_DTYPES[i + 3], None, salt, (i + 1) % n, i % 2))
            if collective == "all_to_all":  # also without a fingerprint: Bruck's general path
                cases.append(("bare", MOVE_DTYPES[i + 3], None, salt, 0, i % 2))
    elif collective == "barrier":
        cases = [("even", None, None, 0, 0, 0)] * 3
    return cases


def _expected_cases(n: int) -> int:
    return sum(len(_plan(c, n)) * len(_message_algorithms(c)) for c in COLLECTIVES)


# --------------------------------------------------------------------------- data (rank side)

def _gen(dt: np.dtype, count: int, key: tuple, rank: int, op: ReduceOp | None = None) -> np.ndarray:
    """Rank `rank`'s input for case `key`, the same on every process. For reductions, values
    that keep PRODUCT in range; for data movement, random bit patterns (NaN payloads too)."""
    rng = np.random.default_rng([int(k) for k in key] + [rank])
    if dt == BOOL:
        p = 0.85 if op in (ReduceOp.PRODUCT, ReduceOp.MIN) else 0.3
        return rng.random(count) < p
    if op is None:
        return rng.integers(0, 256, count * dt.itemsize, dtype=np.uint8).view(dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=count, dtype=dt, endpoint=True)

    def real() -> np.ndarray:
        if op is ReduceOp.PRODUCT:
            return rng.uniform(0.5, 2.0, count) * rng.choice([-1.0, 1.0], count)
        return rng.uniform(-1.0, 1.0, count)
    return (real() + 1j * real() if dt.kind == "c" else real()).astype(dt)


def _garbage(dt: np.dtype, count: int) -> np.ndarray:
    if dt == BOOL:
        return np.ones(count, dtype=dt)
    return np.full(count * dt.itemsize, 0xA5, dtype=np.uint8).view(dt)


def _layout(arrays: list[np.ndarray], one_buffer: int) -> list[np.ndarray]:
    """Copies of `arrays`, either each in its own buffer or as consecutive views of one."""
    if not one_buffer:
        return [a.copy() for a in arrays]
    flat = np.concatenate(arrays) if arrays else np.empty(0)
    out, start = [], 0
    for a in arrays:
        out.append(flat[start:start + a.size])
        start += a.size
    return out


def _digest(a: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]


class _Log:
    def __init__(self) -> None:
        self.cases = 0
        self.fails: list[str] = []
        self.digests: list[str] = []

    def same(self, label: str, got: np.ndarray, want: np.ndarray) -> None:
        if got.dtype != want.dtype or got.shape != want.shape:
            self.fails.append(f"{label}: got {got.dtype}{list(got.shape)}, "
                              f"want {want.dtype}{list(want.shape)}")
        elif got.tobytes() != want.tobytes():
            gb = np.frombuffer(got.tobytes(), np.uint8).reshape(-1, got.dtype.itemsize)
            wb = np.frombuffer(want.tobytes(), np.uint8).reshape(-1, want.dtype.itemsize)
            bad = np.flatnonzero((gb != wb).any(axis=1))
            self.fails.append(f"{label}: {bad.size}/{gb.shape[0]} elements differ, first at {bad[0]}: "
                              f"got {got[bad[0]]!r}, want {want[bad[0]]!r}")

    def close(self, label: str, got: np.ndarray, inputs: list[np.ndarray], red: Reduction) -> None:
        """Against reference: exact for bool/int and MIN/MAX, else a summation-order bound."""
        ref = reference(inputs, red)
        if ref.dtype.kind in "biu" or red.op in (ReduceOp.MIN, ReduceOp.MAX) or ref.size == 0:
            self.same(label, got, ref)
            return
        if got.dtype != ref.dtype or got.shape != ref.shape:
            self.same(label, got, ref)
            return
        wide = np.complex128 if ref.dtype.kind == "c" else np.float64
        g, r = got.astype(wide), ref.astype(wide)
        mags = np.stack([np.abs(x.astype(wide)) for x in inputs])
        mag = mags.prod(axis=0) if red.op is ReduceOp.PRODUCT else mags.sum(axis=0)
        eps = EPS[ref.dtype.name]
        n = len(inputs)
        tol = 4 * n * eps * mag + 4 * eps * np.abs(r) + 1e-30
        bad = ~(np.abs(g - r) <= tol)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            self.fails.append(f"{label}: {int(bad.sum())}/{bad.size} elements off; first at {i}: "
                              f"got {g[i]!r}, want {r[i]!r} (tol {tol[i]:.3g})")

    def result(self) -> dict:
        return {"cases": self.cases, "fails": self.fails[:40], "nfails": len(self.fails),
                "digests": self.digests}


class _Bare:
    """Nothing but the P2P protocol (no fingerprint): how any other caller would run an algorithm."""

    fp = None

    def __init__(self, call) -> None:
        self._call = call
        self.rank, self.size, self.link = call.rank, call.size, call.link

    def isend(self, peer, data, step):
        return self._call.isend(peer, data, step)

    def irecv(self, peer, data, step, reduce=None, base=None):
        return self._call.irecv(peer, data, step, reduce, base)

    def wait(self, *reqs) -> None:
        self._call.wait(*reqs)

    def exchange_now(self, *args):
        return False, False  # every step through requests


# --------------------------------------------------------------------------- the cases (rank side)

def _submit(g, coll: Coll, dt, op, root: int, count: int, label: str, body) -> None:
    fp = Fingerprint(coll, 0 if dt is None else dtype_code(dt), 0 if op is None else int(op), root, count)
    g.queue.submit(fp, label, body, False, None)


def _case_all_reduce(g, alg, log, key, case) -> None:
    n, me = g.size, g.rank
    kind, dt, op, count, _, variant = case
    red = Reduction(op)
    ins = [_gen(dt, count, key, r, op) for r in range(n)]
    x = ins[me].copy()
    label = f"all_reduce {alg.name} {kind} {dt.name} {op.name} x{count}"
    if variant:  # the input apart (read where it is, or copied in), the output starts as garbage
        src = x
        x = _garbage(dt, count)
        _submit(g, Coll.ALL_REDUCE, dt, op, -1, count, label, lambda call: alg.run(call, x, op, src))
        log.same(f"{label} out of place: input kept", src, ins[me])
    else:
        _submit(g, Coll.ALL_REDUCE, dt, op, -1, count, label, lambda call: alg.run(call, x, op))
    log.close(label, x, ins, red)
    log.digests.append(f"{label}: {_digest(x)}")


def _case_reduce(g, alg, log, key, case) -> None:
    n, me = g.size, g.rank
    kind, dt, op, count, root, in_place = case
    red = Reduction(op)
    ins = [_gen(dt, count, key, r, op) for r in range(n)]
    data = ins[me].copy()
    acc = data if (me != root or in_place) else _garbage(dt, count)  # as collectives.reduce passes them
    label = f"reduce {alg.name} {kind} {dt.name} {op.name} x{count} root {root} in place {in_place}"
    _submit(g, Coll.REDUCE, dt, op, root, count, label, lambda call: alg.run(call, data, acc, op, root))
    if me == root:
        log.close(label, acc, ins, red)
    if acc is not data:
        log.same(f"{label}: input kept", data, ins[me])


def _case_broadcast(g, alg, log, key, case) -> None:
    me = g.rank
    kind, dt, _, count, root, _ = case
    want = _gen(dt, count, key, root)
    x = want.copy() if me == root else _garbage(dt, count)
    label = f"broadcast {alg.name} {kind} {dt.name} x{count} root {root}"
    _submit(g, Coll.BROADCAST, dt, None, root, count, label, lambda call: alg.run(call, x, root))
    log.same(label, x, want)


def _counts_of(case, n: int) -> list[int]:
    kind, _, _, count, _, _ = case
    return _uneven(n, count) if kind == "uneven" else [count] * n


def _case_all_gather(g, alg, log, key, case) -> None:
    n, me = g.size, g.rank
    kind, dt, _, _, _, one_buffer = case
    counts = _counts_of(case, n)
    ins = [_gen(dt, c, key, r) for r, c in enumerate(counts)]
    blocks = _layout([_garbage(dt, c) for c in counts], one_buffer)
    np.copyto(blocks[me], ins[me])  # collectives.all_gather fills block `rank` first
    label = f"all_gather {alg.name} {kind} {dt.name} {counts} {'one buffer' if one_buffer else 'list'}"
    coll, cnt = (Coll.ALL_GATHER, counts[0]) if kind != "uneven" else (Coll.ALL_GATHERV, -1)
    _submit(g, coll, dt, None, -1, cnt, label, lambda call: alg.run(call, blocks))
    for r in range(n):
        log.same(f"{label}: block {r}", blocks[r], ins[r])


def _case_reduce_scatter(g, alg, log, key, case) -> None:
    n, me = g.size, g.rank
    kind, dt, op, _, _, one_buffer = case
    red = Reduction(op)
    counts = _counts_of(case, n)
    ins = [[_gen(dt, c, (*key, b), r, op) for b, c in enumerate(counts)] for r in range(n)]
    blocks = _layout(ins[me], one_buffer)
    for b in blocks:
        b.flags.writeable = False  # inputs are only read
    out = _garbage(dt, counts[me])
    layout = "one buffer" if one_buffer else "list"
    label = f"reduce_scatter {alg.name} {kind} {dt.name} {op.name} {counts[:3]}.. {layout}"
    coll, cnt = (Coll.REDUCE_SCATTER, counts[0]) if kind != "uneven" else (Coll.REDUCE_SCATTERV, -1)
    _submit(g, coll, dt, op, -1, cnt, label, lambda call: alg.run(call, blocks, out, op))
    log.close(label, out, [ins[r][me] for r in range(n)], red)
    for b in range(n):
        log.same(f"{label}: input block {b} kept", blocks[b], ins[me][b])


def _case_all_to_all(g, alg, log, key, case) -> None:
    n, me = g.size, g.rank
    kind, dt, _, count, _, one_buffer = case
    m = _matrix(n, count) if kind in ("uneven", "bare") else [[count] * n for _ in range(n)]
    sent = [[_gen(dt, m[i][j], (*key, j), i) for j in range(n)] for i in range(n)]
    sends = _layout(sent[me], one_buffer)
    for b in sends:
        b.flags.writeable = False
    recvs = _layout([_garbage(dt, m[i][me]) for i in range(n)], 1 - one_buffer)
    label = f"all_to_all {alg.name} {kind} {dt.name} {m[me]}"
    coll, cnt = (Coll.ALL_TO_ALL, count * n) if kind in ("even", "big") else (Coll.ALL_TO_ALLV, -1)
    p2p = (lambda call: _Bare(call)) if kind == "bare" else (lambda call: call)
    _submit(g, coll, dt, None, -1, cnt, label, lambda call: alg.run(p2p(call), sends, recvs))
    for i in range(n):
        log.same(f"{label}: from rank {i}", recvs[i], sent[i][me])


def _case_gather(g, alg, log, key, case) -> None:
    n, me = g.size, g.rank
    kind, dt, _, _, root, one_buffer = case
    counts = _counts_of(case, n)
    ins = [_gen(dt, c, key, r) for r, c in enumerate(counts)]
    send = ins[me].copy()
    send.flags.writeable = False
    outs = _layout([_garbage(dt, c) for c in counts], one_buffer) if me == root else None
    label = f"gather {alg.name} {kind} {dt.name} {counts} root {root}"
    coll, cnt = (Coll.GATHER, counts[0]) if kind != "uneven" else (Coll.GATHERV, -1)
    _submit(g, coll, dt, None, root, cnt, label, lambda call: alg.run(call, send, outs, root))
    if outs is not None:
        for r in range(n):
            log.same(f"{label}: block {r}", outs[r], ins[r])


def _case_scatter(g, alg, log, key, case) -> None:
    n, me = g.size, g.rank
    kind, dt, _, _, root, one_buffer = case
    counts = _counts_of(case, n)
    blocks = [_gen(dt, c, key, r) for r, c in enumerate(counts)]
    sends = _layout(blocks, one_buffer) if me == root else None
    if sends is not None:
        for b in sends:
            b.flags.writeable = False
    recv = _garbage(dt, counts[me])
    label = f"scatter {alg.name} {kind} {dt.name} {counts} root {root}"
    coll, cnt = (Coll.SCATTER, counts[0]) if kind != "uneven" else (Coll.SCATTERV, -1)
    _submit(g, coll, dt, None, root, cnt, label, lambda call: alg.run(call, sends, recv, root))
    log.same(label, recv, blocks[me])


def _case_barrier(g, alg, log, key, case) -> None:
    _submit(g, Coll.BARRIER, None, None, -1, -1, f"barrier {alg.name}", lambda call: alg.run(call))


CASES = {"all_reduce": _case_all_reduce, "reduce": _case_reduce, "broadcast": _case_broadcast,
         "all_gather": _case_all_gather, "reduce_scatter": _case_reduce_scatter,
         "all_to_all": _case_all_to_all, "gather": _case_gather, "scatter": _case_scatter,
         "barrier": _case_barrier}


class _Reversed:
    """Orders as topology.Layout gives them, none the identity on 3 ranks: the ring reversed,
    and each root first with the others after it in descending order."""

    def __init__(self, n: int) -> None:
        self.n = n

    @property
    def ring(self) -> tuple[int, ...]:
        return tuple(reversed(range(self.n)))

    def rooted(self, root: int) -> tuple[int, ...]:
        return (root, *sorted((r for r in range(self.n) if r != root), reverse=True))


def rank_every_algorithm(seed: int, arranged: bool = False) -> dict:
    """Every message-path algorithm of every collective over its plan, on this rank; arranged:
    each seen through ordered.arrange in other rank orders."""
    g = tw.world()
    log = _Log()
    for ci, collective in enumerate(COLLECTIVES):
        for name, alg in _message_algorithms(collective).items():
            if arranged:
                alg = arrange(alg, _Reversed(g.size))
            for i, case in enumerate(_plan(collective, g.size)):
                try:
                    CASES[collective](g, alg, log, (seed, ci, i), case)
                except Exception as exc:  # the group is aborted now: report and stop
                    log.fails.append(f"{collective} {name} case {i} {case[:2]}: {type(exc).__name__}: {exc}")
                    return log.result()
                log.cases += 1
    return log.result()


# --------------------------------------------------------------------------- tests

def _expect(results: list[dict], n: int) -> None:
    fails = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["fails"]]
    total = sum(res["nfails"] for res in results)
    assert not fails, f"{total} failed checks, first ones:\n" + "\n".join(fails[:40])
    assert [res["cases"] for res in results] == [_expected_cases(n)] * n
    first = results[0]["digests"]
    for r, res in enumerate(results[1:], start=1):
        diff = [f"{a} vs {b}" for a, b in zip(first, res["digests"]) if a != b]
        assert len(res["digests"]) == len(first) and not diff, \
            f"rank {r}'s all_reduce results differ bitwise from rank 0's:\n" + "\n".join(diff[:20])


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("size", "transport"), WORLDS, ids=[f"{n}-{t}" for n, t in WORLDS])
def test_every_algorithm(get_cluster, size: int, transport: str) -> None:
    results = get_cluster(size, transport).run(rank_every_algorithm, 41 + size, timeout=140)
    _expect(results, size)


@pytest.mark.timeout(240)
def test_every_algorithm_on_eight_ranks(get_cluster) -> None:
    results = get_cluster(8, "shm").run(rank_every_algorithm, 8, timeout=230)
    _expect(results, 8)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_every_algorithm_in_another_rank_order(get_cluster, transport: str) -> None:
    """As a group over hosts runs them where its ranks are not numbered host by host."""
    results = get_cluster(3, transport).run(rank_every_algorithm, 7, True, timeout=140)
    _expect(results, 3)


def test_a_call_in_another_rank_order_keeps_its_fingerprint(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group over hosts runs an algorithm on its call seen in the hosts' order; the view
    passes the call's fingerprint on, so Bruck's vector all_to_all still runs the pairwise
    exchange, as every rank must (each priced the call with its own total: another rank may
    have chosen pairwise for it)."""
    from tensorwire.algorithms import bruck

    ran: list[int] = []
    monkeypatch.setattr(bruck, "pairwise_all_to_all", lambda p2p, sends, recvs: ran.append(p2p.rank))
    orders = type("Orders", (), {"ring": (0, 2, 1, 3)})()
    call = type("Call", (), {"rank": 2, "size": 4, "link": Link("x", 1e-6, 1e-9, 1e-9),
                             "fp": Fingerprint(Coll.ALL_TO_ALLV)})()
    blocks = [np.zeros(1) for _ in range(4)]
    arrange(algorithms_for("all_to_all")["bruck"], orders).run(call, blocks, blocks)
    assert ran == [1]  # group rank 2 is the hosts' order's second


def test_runs_that_reduce_in_place_take_the_input_apart() -> None:
    """Every all_reduce, broadcast and all_gather run takes `src`; one that works in place gets
    it copied into its output first, and runs nothing different where it is None."""
    seen: list = []
    for collective, first in (("all_reduce", np.zeros(3)), ("broadcast", np.zeros(3)),
                              ("all_gather", [np.zeros(3), np.zeros(3)])):
        alg = registry.taking_input_apart(
            registry.Algorithm("probe", collective, lambda p2p, *a: seen.append(a), lambda n, m, link: 0.0))
        args = (first, "arg")[:1 if collective == "all_gather" else 2]
        seen.clear()
        alg.run(type("P2P", (), {"rank": 1})(), *args, np.arange(3.0))
        mine = first[1] if collective == "all_gather" else first
        assert (mine == np.arange(3.0)).all() and seen == [args], collective
        alg.run(type("P2P", (), {"rank": 1})(), *args, None)
        assert len(seen) == 2, collective
    inert = registry.Algorithm("probe", "all_reduce", print, lambda n, m, link: 0.0, out_of_place=True)
    assert registry.taking_input_apart(inert) is inert


def test_required_families_are_registered() -> None:
    for collective, names in REQUIRED.items():
        missing = names - set(algorithms_for(collective))
        assert not missing, f"{collective} lacks {sorted(missing)}"


LINKS = [*(lk for lk in cost_model.DEFAULT_LINKS.values() if not lk.cache),  # the memory entry is no link
         Link("fabric", alpha=1e-6, beta=1 / 25e9, gamma=1 / 20e9)]
COST_RANKS = [2, 3, 4, 5, 7, 8, 16, 33, 64]
COST_BYTES = [0, 1, 7, 1000, 4096, 65_537, 1 << 20, (1 << 20) + 1, 8 << 20, 64 << 20, 1 << 30]


@pytest.mark.timeout(60)
def test_cost_formulas_positive_finite_monotonic() -> None:
    checked = 0
    for collective in COLLECTIVES:
        for name, alg in flat_algorithms(collective).items():
            for link in LINKS:
                single = [alg.cost(1, m, link) for m in COST_BYTES]
                assert all(math.isfinite(c) and c >= 0 for c in single), (collective, name, 1, single)
                for n in COST_RANKS:
                    costs = [alg.cost(n, m, link) for m in COST_BYTES]
                    where = (collective, name, link.name, n)
                    assert all(math.isfinite(c) and c > 0 for c in costs), (*where, costs)
                    assert all(a <= b for a, b in zip(costs, costs[1:])), (*where, costs)
                    checked += 1
    assert checked == sum(len(flat_algorithms(c)) for c in COLLECTIVES) * len(LINKS) * len(COST_RANKS)


def flat_algorithms(collective: str) -> dict:
    """The algorithms priced by a formula (a hierarchical one prices its phases: test_topology.py)."""
    return {name: alg for name, alg in algorithms_for(collective).items() if alg.phases is None}


@pytest.mark.parametrize("collective,n,m,need", [
    ("broadcast", 2, 16, 16), ("broadcast", 2, 1 << 30, 64), ("all_gather", 4, 1 << 30, 64),
    ("all_to_all", 4, 100, 100), ("all_to_all", 4, 1 << 30, 192)])
def test_streamed_direct_needs_a_slot_with_room_for_a_piece_per_stream(collective, n, m, need) -> None:
    """Past the slot the direct path streams any size, but a slot smaller than one 64-byte
    piece per stream cannot (a 32-byte TENSORWIRE_SHM_DIRECT divided by zero): the tuner
    must then leave it out."""
    assert slot_bytes(algorithms_for(collective)["direct"], n, m) == need


@pytest.mark.timeout(60)
def test_gather_choice_does_not_depend_on_size() -> None:
    """The gather's tree copies no more than the linear root receives, so the two are priced
    alike in β and the choice is the same at every size."""
    algs = list(_message_algorithms("gather").values())
    for link in LINKS:
        for n in COST_RANKS:
            picks = {min((alg.cost(n, m, link), alg.name) for alg in algs)[1] for m in COST_BYTES}
            assert len(picks) == 1, (link.name, n, picks)


@pytest.mark.timeout(60)
def test_scatter_tree_wins_small_only_on_many_ranks_and_loses_large() -> None:
    """The linear scatter's latency is priced as the gather's (its sends overlap: back to back
    it measured 1.2-1.7x faster than the tree at 16 B-64 KiB at n = 4): it wins small messages
    until about 16 ranks, where the tree's log2 n latencies are fewer. The binomial scatter
    copies a non-leaf subtree twice at the root and once more per level (store and forward):
    the linear scatter wins large messages from n = 4 on; at n = 2 and 3 both move the same
    bytes."""
    algs = _message_algorithms("scatter")
    gather = _message_algorithms("gather")
    for link in LINKS:
        for n in COST_RANKS:
            small = {name: alg.cost(n, 64, link) for name, alg in algs.items()}
            large = {name: alg.cost(n, 1 << 30, link) for name, alg in algs.items()}
            assert small["linear"] == pytest.approx(gather["linear"].cost(n, 64, link))
            if n == 2:
                assert small["binomial"] == pytest.approx(small["linear"]), (link.name, n)
            elif n < 16:
                assert small["linear"] < small["binomial"], (link.name, n, small)
            else:
                assert small["binomial"] < small["linear"], (link.name, n, small)
            if n <= 3:
                assert large["binomial"] == pytest.approx(large["linear"], rel=1e-3), (link.name, n)
            else:
                assert large["linear"] < large["binomial"], (link.name, n, large)


@pytest.mark.timeout(60)
def test_chain_cuts_segments_by_the_links_bytes_per_latency() -> None:
    """The chain takes the segment count that makes its time least on the group's link: on
    4 emulated hosts with 1 Gbit/s links (α ~100 us) 1 MiB measured 8.8 ms in the chain against
    17 ms for the binomial tree and the scatter + all_gather, where 512 KiB segments had priced
    the chain dearest of the three."""
    gbit = Link("tcp", alpha=100e-6, beta=8e-9, gamma=1e-10)
    assert chain.segment_count(4, 1 << 20, gbit) == 13
    assert chain.segment_count(2, 64 << 20, gbit) == 1  # no pipeline to fill: one message
    assert chain.segment_count(4, 16 << 10, gbit) == 2  # never below MIN_SEGMENT_BYTES
    assert chain.segment_count(4, 1000, gbit) == 1
    algs = _message_algorithms("broadcast")
    for m in (1 << 20, 16 << 20):
        costs = {name: alg.cost(4, m, gbit) for name, alg in algs.items()}
        assert min(costs, key=costs.get) == "chain", (m, costs)
    roomier = Link("shm", alpha=3e-6, beta=0.1e-9, gamma=1e-10)  # 30 KB per α, the gbit's 12.5: fewer
    assert chain.segment_count(8, 1 << 20, roomier) < chain.segment_count(8, 1 << 20, gbit)


def test_contiguous_span() -> None:
    """Consecutive views of one buffer are seen as one span (algorithms then work in place);
    anything else is not, and the algorithm stages through scratch."""
    buf = np.arange(12, dtype=np.float32)
    views = blocks_of(buf, [3, 0, 5, 4])
    span = contiguous_span(views)
    assert span is not None and span.size == 12 and np.shares_memory(span, buf)
    span[:] = -1
    assert (buf == -1).all()
    assert contiguous_span(blocks_of(buf[2:], [3, 0, 5])).ctypes.data == buf[2:].ctypes.data
    assert contiguous_span([np.zeros(3, np.float32), np.zeros(4, np.float32)]) is None
    assert contiguous_span([views[2], views[0]]) is None  # out of order
    assert contiguous_span(blocks_of(buf.reshape(3, 4)[:, 0].copy(), [1, 2])) is not None
    frozen = np.arange(6, dtype=np.int32)
    frozen.flags.writeable = False
    parts = blocks_of(frozen, [2, 4])
    assert contiguous_span(parts) is None and contiguous_span(parts, writable=False) is not None
    assert contiguous_span([np.empty(0, np.int8), np.empty(0, np.int8)]).size == 0


GRID_DTYPES = [np.bool_, np.int8, np.uint16, np.int32, np.int64, np.float16, np.float32, np.float64,
               np.complex64, ml_dtypes.bfloat16]


@pytest.mark.parametrize("dtype", GRID_DTYPES, ids=lambda d: np.dtype(d).name)
def test_one_call_fold_is_the_rank_ordered_fold(dtype) -> None:
    """ufunc.reduce down the slots' grid gives the bits of folding them one by one in rank
    order (what every rank must compute alike) for numpy ufuncs on rows of more than one
    element, at every op, row length and rank count; direct_plans.grid_folds never takes it
    elsewhere (rows of one element: numpy's pairwise sum, which does differ for floats)."""
    from tensorwire.algorithms.direct_plans import _fold_grid, grid_folds
    from tensorwire.ops.kernels import fold, ufunc_of

    dt = np.dtype(dtype)
    rng = np.random.default_rng(7)
    checked = 0
    for n in (3, 5, 8, 9, 16, 17):
        for count in (1, 2, 3, 64, 1000, 10_000):
            stride = -(-count * dt.itemsize // 64) * 64 + 64  # rows a line apart, as slots are
            raw = rng.integers(0, 256, n * stride, dtype=np.uint8)
            if dt.kind in "fc":  # finite values of every magnitude the type has
                scale = 10.0 ** rng.integers(-3, 4)
                vals = (rng.standard_normal(n * stride // dt.itemsize) * scale).astype(dt)
                raw = vals.view(np.uint8)[:n * stride].copy()
            elif dt.kind == "b":
                raw = (raw & 1).astype(np.uint8)
            grid = np.lib.stride_tricks.as_strided(raw.view(dt), (n, count), (stride, dt.itemsize))
            rows = tuple(grid[r] for r in range(n))
            for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND,
                       ReduceOp.BXOR):
                if op_undefined(op, dt.kind if dt.kind in "biufc" else "f"):
                    continue
                kernel = reduction_kernel(op, dt)
                same_bits = count > 1 and ufunc_of(kernel) is not None and dt.num <= 23
                if not same_bits:  # where the one call would differ, it is never taken
                    assert not grid_folds(kernel, dt, n, count), (n, count, op)
                    continue  # (where it is only slower, the bits are checked all the same)
                want, got = np.empty(count, dt), np.empty(count, dt)
                with np.errstate(all="ignore"):
                    fold(rows, want, kernel)
                    _fold_grid(grid, got, kernel)
                assert np.array_equal(want.view(np.uint8), got.view(np.uint8)), (dt, n, count, op)
                checked += 1
    assert checked or dt.kind == "V" or dt == np.float16  # their kernels are not numpy ufuncs
    if dt.kind == "f" and dt.itemsize >= 4:  # why rows of one element are kept out
        col = np.array([1e8, 1.0, -1e8, 1.0, 1e-3, 3.0, 7.0, -2.0, 0.5] * 2, dtype=dt)
        seq = col[0]
        for v in col[1:]:
            seq = dt.type(seq + v)
        assert np.add.reduce(col) != seq


def test_a_phase_that_differs_says_its_hierarchical_call_does() -> None:
    """A hierarchical call whose phases are other collectives on some rank (compress= on one rank
    alone: its phases reduce_scatter where the others' reduce) fails in a phase: the error names
    the caller's call and says that call differs (it read 'collective reduce_scatter vs reduce',
    which no rank had called)."""
    from types import SimpleNamespace

    from tensorwire.algorithms.hierarchical import naming
    from tensorwire.errors import CollectiveMismatchError
    from tensorwire.transport.wire import PHASE_OF

    queue = SimpleNamespace(phase_of=0)
    side = SimpleNamespace(queue=queue)
    p2p = SimpleNamespace(hierarchy=SimpleNamespace(local=side, rail=side), fp=Fingerprint(Coll.ALL_REDUCE),
                          what="all_reduce #1 on group world")

    def phase(p2p: object) -> None:
        raise CollectiveMismatchError("rank 0: reduce_scatter_tensor #1 on group world/host0: rank 1 made a "
                                      "different call at the same point: collective reduce_scatter vs reduce")

    with pytest.raises(CollectiveMismatchError) as caught:
        naming(phase)(p2p)
    text = str(caught.value)
    assert text.startswith("rank 0: all_reduce #1 on group world (hierarchical): reduce_scatter"), text
    assert text.endswith(f"collective reduce_scatter vs reduce; {PHASE_OF}"), text
    assert queue.phase_of == 0
