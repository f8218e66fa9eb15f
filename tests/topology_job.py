"""The job tests/test_multihost.py runs across emulated hosts to check topology-aware and
hierarchical collectives: every rank computes every rank's input itself and checks its results
against numpy (tensorwire.ops.reference folds in rank order).

    python scripts/netns_cluster.py --hosts 2 -n 3 -- tests/topology_job.py topology matrix

Two groups over the same processes: the world as the launcher numbers it (block placement:
host i holds ranks i*N ..) and a group numbered cyclically (its rank r on host r mod H, what
Slurm's cyclic distribution gives), whose orders differ from its numbering. Modes:
  topology  what tw.topology() and the groups' layouts say, against the test bed's placement
  matrix    every algorithm eligible for every collective (forced, two sizes, roots first and
            last), then every (op, dtype) pair of the reductions under the hierarchical and a
            flat algorithm, every dtype through the data movement, and a pipelined all_reduce
  algos     the matrix's first part only
  mismatch  ranks that disagree on a hierarchical all_reduce: a clear error on every rank
  refusal   the last rank refuses a hierarchical all_reduce the others run: it fails on every
            rank, and the group renews itself and goes on, three times over
  uneven    groups whose hosts hold different numbers of ranks: the hierarchy they can run
Data is chosen so that every reduction is exact whatever its order (integers; floats holding
small integers; powers of two for products), so results must match exactly (bit for bit but
for the sign of a floating-point zero).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator

import numpy as np

import tensorwire as tw
from tensorwire.ops import ReduceOp, Reduction
from tensorwire.ops.reference import reference
from tensorwire.ops.validation import check_op_dtype
from tensorwire.tuning import tuner

try:
    import ml_dtypes

    EXTRA = [np.dtype(ml_dtypes.bfloat16)]
except ImportError:  # bfloat16 is an extra
    EXTRA = []

DTYPES = [np.dtype(t) for t in (np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
                                np.int64, np.uint64, np.float16, np.float32, np.float64, np.complex64,
                                np.complex128)] + EXTRA
ROOTED = ("broadcast", "reduce", "gather", "scatter")


def say(text: str) -> None:
    print(text, flush=True)


def placement() -> tuple[int, int]:
    """(hosts, ranks per host) of the test bed."""
    per = int(os.environ["LOCAL_WORLD_SIZE"])
    return tw.get_world_size() // per, per


_GROUPS: list[tuple[str, tw.Group]] = []
RAN: set[tuple[str, str]] = set()  # (collective, algorithm) that `algos` ran


def groups() -> list[tuple[str, tw.Group]]:
    if not _GROUPS:
        hosts, per = placement()
        n = hosts * per
        cyclic = [(i % hosts) * per + i // hosts for i in range(n)]  # group rank i -> world rank
        _GROUPS.extend([("block", tw.world()), ("cyclic", tw.new_group(cyclic, name="cyclic"))])
    return _GROUPS


def inputs(dt: np.dtype, count: int, key: tuple, n: int, op: ReduceOp = ReduceOp.SUM) -> list[np.ndarray]:
    """Every rank's input for case `key`, the same on every process."""
    out = []
    for r in range(n):
        rng = np.random.default_rng([*key, r])
        if dt == np.bool_:
            a = rng.random(count) < 0.5
        elif dt.kind in "iu":
            info = np.iinfo(dt)
            a = rng.integers(info.min, info.max, size=count, dtype=dt, endpoint=True)
        else:
            pick = [-2.0, -1.0, 1.0, 2.0] if op is ReduceOp.PRODUCT else np.arange(-8.0, 9.0)
            a = rng.choice(pick, count)
            if dt.kind == "c":
                a = a + 1j * rng.choice(pick, count)
        out.append(np.ascontiguousarray(a).astype(dt))
    return out


def reduction(op: ReduceOp) -> Reduction:
    return tw.premul_sum(0.5) if op is ReduceOp.PREMUL_SUM else Reduction(op)


def reductions() -> Iterator[tuple[int, np.dtype, ReduceOp]]:
    """(index of the dtype, dtype, op) of every pair tensorwire reduces."""
    for di, dt in enumerate(DTYPES):
        for op in ReduceOp:
            try:
                check_op_dtype(reduction(op), dt, rank=0, collective="reductions")
            except tw.InvalidArgumentError:
                continue
            yield di, dt, op


def run_case(g: tw.Group, coll: str, dt: np.dtype, count: int, red: Reduction, root: int, key: tuple) -> None:
    """One call of `coll` on group `g`; raises AssertionError naming what differed."""
    n, r = g.size, g.rank
    xs = inputs(dt, count, key, n, red.op)
    mine = xs[r].copy()
    what = f"{g.name} {coll} {dt} {red.op.name} count {count} root {root}"
    if coll == "all_reduce":
        g.all_reduce(mine, red)
        want = reference(xs, red)
    elif coll == "reduce":
        g.reduce(mine, root, red)
        want = reference(xs, red) if r == root else xs[r]
    elif coll == "reduce_scatter":
        out = np.empty(count, dtype=dt)
        g.reduce_scatter(out, [x.copy() for x in inputs(dt, count, (*key, r), n, red.op)], red)
        want = reference([inputs(dt, count, (*key, q), n, red.op)[r] for q in range(n)], red)
        mine = out
    elif coll == "broadcast":
        g.broadcast(mine, root)
        want = xs[root]
    elif coll == "all_gather":
        outs = [np.empty(count, dtype=dt) for _ in range(n)]
        g.all_gather(outs, mine)
        mine, want = np.concatenate(outs), np.concatenate(xs)
    elif coll == "gather":
        outs = [np.empty(count, dtype=dt) for _ in range(n)] if r == root else None
        g.gather(mine, outs, root)
        if r == root:
            mine, want = np.concatenate(outs), np.concatenate(xs)
        else:
            want = xs[r]
    elif coll == "scatter":
        blocks = [x.copy() for x in inputs(dt, count, (*key, root), n)] if r == root else None
        out = np.empty(count, dtype=dt)
        g.scatter(out, blocks, root)
        mine, want = out, inputs(dt, count, (*key, root), n)[r]
    elif coll == "all_to_all_single":
        out = np.empty(count * n, dtype=dt)
        g.all_to_all_single(out, np.concatenate(inputs(dt, count, (*key, r), n)))
        mine = out
        want = np.concatenate([inputs(dt, count, (*key, q), n)[r] for q in range(n)])
    elif coll == "all_to_all":
        outs = [np.empty(count, dtype=dt) for _ in range(n)]
        g.all_to_all(outs, [x.copy() for x in inputs(dt, count, (*key, r), n)])
        mine = np.concatenate(outs)
        want = np.concatenate([inputs(dt, count, (*key, q), n)[r] for q in range(n)])
    elif coll == "barrier":
        g.barrier()
        return
    else:
        raise ValueError(coll)
    want = np.ascontiguousarray(want).astype(dt)
    # values for floating point (a product's zero may come out -0 in another order), bits otherwise
    if not (np.array_equal(mine, want) if dt.kind in "fcV" else mine.tobytes() == want.tobytes()):
        bad = np.flatnonzero(mine != want)[:5]
        raise AssertionError(f"{what}: rank {r} got {mine[bad]} at {bad}, expected {np.asarray(want)[bad]}")


def forced(g: tw.Group, coll: str, name: str | None, *case: object) -> None:
    if name is None:
        run_case(g, coll, *case)  # type: ignore[arg-type]
        return
    with tuner.override(g, registered(coll), name):
        run_case(g, coll, *case)  # type: ignore[arg-type]


def registered(coll: str) -> str:
    """The registry's name of what run_case calls `coll`."""
    return "all_to_all" if coll == "all_to_all_single" else coll


def eligible(g: tw.Group, coll: str, nbytes: int) -> list[str]:
    """The algorithms the tuner could pick for the call run_case makes (its all_to_all is the
    list form, whose blocks may differ: priced as size 0, without the one-shot path)."""
    if coll == "all_to_all":
        return sorted(name for _, name, _ in tuner.decide(g, coll, 0, direct_ok=False).priced)
    return sorted(name for _, name, _ in tuner.decide(g, registered(coll), nbytes).priced)


def algos(cases: list[int]) -> None:
    """Every eligible algorithm of every collective, forced, at an uneven and a larger size."""
    for gi, (_, g) in enumerate(groups()):
        for ci, coll in enumerate(("all_reduce", "reduce", "reduce_scatter", "broadcast", "all_gather",
                                   "gather", "scatter", "all_to_all", "all_to_all_single", "barrier")):
            for count in (7, 3001):
                per_rank = coll not in ("all_reduce", "reduce", "broadcast", "barrier")
                names = eligible(g, coll, 0 if coll == "barrier" else count * 8 * (g.size if per_rank else 1))
                for name in names:
                    RAN.add((coll, name))
                    for root in ((0, g.size - 1) if coll in ROOTED else (0,)):
                        forced(g, coll, name, np.dtype(np.float64), count, Reduction(ReduceOp.SUM), root,
                               (gi, ci, count, root))
                        cases[0] += 1


def matrix(cases: list[int]) -> None:
    algos(cases)
    # (collective, algorithm, elements): the rails' all_reduce needs a KiB per rank
    # (hierarchical.SHARE_MIN), and gets a count its hosts' ranks do not divide
    runs = [("all_reduce", "hierarchical", 1024 * tw.get_world_size() + 5),
            ("all_reduce", "hierarchical_leaders", 5), ("all_reduce", "ring", 5),
            ("reduce", "hierarchical", 5), ("reduce", "binomial", 5),
            ("reduce_scatter", "hierarchical", 5), ("reduce_scatter", "ring", 5)]
    for gi, (_, g) in enumerate(groups()):
        for di, dt, op in reductions():
            for ci, (coll, name, count) in enumerate(runs):
                forced(g, coll, name, dt, count, reduction(op), g.size - 1, (gi, di, int(op), ci, 100))
                cases[0] += 1
        for di, dt in enumerate(DTYPES):
            for ci, coll in enumerate(("broadcast", "all_gather", "gather", "scatter", "all_to_all",
                                       "all_to_all_single")):
                forced(g, coll, None, dt, 9, Reduction(ReduceOp.SUM), 1, (gi, di, ci, 200))
                cases[0] += 1
        # a pipelined all_reduce: more than one piece (algorithms/hierarchical.PIECE_BYTES)
        count = (9 << 20) // 4 + 5
        for out_of_place in (False, True):
            with tuner.override(g, "all_reduce", "hierarchical"):
                xs = inputs(np.dtype(np.float32), count, (gi, 300), g.size)
                x = xs[g.rank].copy()
                out = np.empty_like(x) if out_of_place else x
                g.all_reduce(x, out=out if out_of_place else None)
                assert np.array_equal(out, reference(xs, Reduction(ReduceOp.SUM))), f"{g.name} pipelined"
                assert not out_of_place or np.array_equal(x, xs[g.rank]), f"{g.name} pipelined: input changed"
            cases[0] += 1


def uneven(cases: list[int]) -> None:
    """Groups whose hosts hold different numbers of ranks (on 2 hosts x 3: 3 + 1, and 3 + 2
    numbered out of order): the hierarchical all_reduce (on the rails every host has), the
    leaders' and the rooted ones are eligible, all_gather's and reduce_scatter's are not; every
    eligible algorithm of every collective agrees with numpy with every rank as the root; the
    hierarchical all_reduces and reduce every (op, dtype) pair; a pipelined all_reduce."""
    hosts, per = placement()
    n = hosts * per
    for gi, members in enumerate(([*range(per + 1)], [per + 1, 0, per, 1, n - 1])):
        g = tw.new_group(members, name=f"uneven{gi}")
        if not g.is_member:
            continue
        shape = g.layout.shape
        assert shape is not None and not shape.uniform, (g.name, g.layout)
        assert "hierarchical_leaders" in eligible(g, "all_reduce", 8), g.name
        hierarchical = {c: eligible(g, c, 3001 * 8) for c in ("all_reduce", "broadcast", "reduce",
                                                               "barrier", "all_gather", "reduce_scatter")}
        for c in ("all_reduce", "broadcast", "reduce", "barrier"):
            assert "hierarchical" in hierarchical[c], (c, hierarchical)
        for c in ("all_gather", "reduce_scatter"):
            assert "hierarchical" not in hierarchical[c], (c, hierarchical)
        for ci, coll in enumerate(("all_reduce", "reduce", "broadcast", "barrier")):
            for count in (7, 3001):
                for name in eligible(g, coll, 0 if coll == "barrier" else count * 8):
                    for root in (range(g.size) if coll in ROOTED else (0,)):
                        forced(g, coll, name, np.dtype(np.float64), count, Reduction(ReduceOp.SUM), root,
                               (gi, ci, count, root, 400))
                        cases[0] += 1
        for di, dt, op in reductions():
            key = (gi, di, int(op))
            forced(g, "all_reduce", "hierarchical_leaders", dt, 5, reduction(op), 0, (*key, 500))
            forced(g, "all_reduce", "hierarchical", dt, 1024 * g.size + 5, reduction(op), 0, (*key, 502))
            forced(g, "reduce", "hierarchical", dt, 5, reduction(op), g.size - 1, (*key, 501))
            cases[0] += 3
        # the rails' all_reduce in pieces (algorithms/hierarchical.PIECE_BYTES), out of place
        xs = inputs(np.dtype(np.float32), (9 << 20) // 4 + 5, (gi, 503), g.size)
        out = np.empty_like(xs[g.rank])
        with tuner.override(g, "all_reduce", "hierarchical"):
            g.all_reduce(xs[g.rank].copy(), out=out)
        assert np.array_equal(out, reference(xs, Reduction(ReduceOp.SUM))), f"{g.name} pipelined"
        cases[0] += 1


def mismatch() -> None:
    """Ranks that disagree on a hierarchical all_reduce's count (rank 0 one element more), on
    its size so far that rank 0 alone runs another algorithm (4 elements: the leaders'
    variant, the others the rails'), on its op where the phases sum alike (AVG on rank 0, SUM
    elsewhere), or on compress= (bf16 on rank 0, fp16 elsewhere: the same 16-bit words cross):
    every rank raises a mismatch that names the caller's call, not only the phase's sub-group,
    within seconds (the last two were sums of different things, silently, before the phases
    carried their caller's digest). All are forced: whether the tuner picks a hierarchy for
    these sizes depends on the machine's load."""
    r = tw.get_rank()
    count = 1 << 20
    cases = (("count", count + (r == 0), tw.ReduceOp.SUM, None), ("algorithm", 4 if r == 0 else count,
             tw.ReduceOp.SUM, None), ("op", count, tw.ReduceOp.AVG if r == 0 else tw.ReduceOp.SUM, None),
             ("compress", count, tw.ReduceOp.SUM, "bf16" if r == 0 else "fp16"))
    for label, mine, op, compress in cases:
        g = tw.new_group(list(range(tw.get_world_size())), name=label)
        try:
            with tuner.override(g, "all_reduce", "hierarchical" if mine >= count else "hierarchical_leaders"):
                g.all_reduce(np.ones(mine, dtype=np.float32), op, timeout=20, compress=compress)
        except tw.CollectiveMismatchError as exc:
            # the caller's call, found in a phase ("(hierarchical)") or at the call itself, by a
            # waiter's question where its peers are (timing decides which comes first)
            assert f"all_reduce #1 on group {label}" in str(exc), exc
            say(f"MISMATCH OK rank {r} {label}: {exc}")
            continue
        raise AssertionError(f"rank {r}: {label}: no error")


def refusal() -> None:
    """The last rank passes a non-contiguous array to a 2 MiB all_reduce (hierarchical: its
    phases run on the hosts' groups and the rails), the others a good one: every rank raises
    the refusal naming that rank, and the group goes on (renewed, its hierarchy with it). A
    call a member made on the old context before it learned of the refusal fails on every
    member (group/renewal.py): the next good all_reduce may fail so, the same number of times
    on every rank, before one is right."""
    r, n = tw.get_rank(), tw.get_world_size()
    g = tw.new_group(list(range(n)), name="refusal")
    for k in range(3):
        half = np.ones(1 << 20, np.float32)
        mine = half[::2] if r == n - 1 else np.ones(1 << 19, np.float32)
        try:
            with tuner.override(g, "all_reduce", "hierarchical"):
                g.all_reduce(mine, timeout=20)
        except tw.InvalidArgumentError as exc:
            assert f"rank {n - 1}" in str(exc) and "not C-contiguous" in str(exc), exc
        else:
            raise AssertionError(f"rank {r}: round {k}: no error")
        failed = 0
        while True:
            x = np.full(1 << 19, r + 1.0, np.float32)
            try:
                with tuner.override(g, "all_reduce", "hierarchical"):
                    g.all_reduce(x, timeout=20)
                break
            except tw.InvalidArgumentError as exc:  # made on the old context by some member
                assert "not C-contiguous" in str(exc) and failed < 2, (r, k, failed, exc)
                failed += 1
        assert np.all(x == n * (n + 1) / 2), (r, k, x[:4])
        counts = np.array([failed, -failed])
        g.all_reduce(counts, tw.ReduceOp.MAX, timeout=20)
        assert counts[0] == -counts[1] == failed, (r, k, failed, counts)
    say(f"REFUSAL OK rank {r}")


def topology() -> None:
    """The topology as a job sees it: one host per namespace, one machine, tiers, orders."""
    hosts, per = placement()
    topo = tw.topology()
    r = tw.get_rank()
    blocks = [tuple(range(h * per, (h + 1) * per)) for h in range(hosts)]
    assert topo.hosts == blocks, topo.hosts
    assert len(set(topo.machine_of)) == 1, "the emulated hosts share one kernel"
    assert topo.ranks[r].host == socket.gethostname() and topo.ranks[r].interface == "eth0", topo.ranks[r]
    assert topo.ranks[r].address == f"10.77.0.{r // per + 1}", topo.ranks[r]
    for q in range(topo.size):
        want = "self" if q == r else "net" if q // per != r // per else ("numa", "host")
        assert topo.tier(r, q) in want, (r, q, topo.tier(r, q))
    (_, world), (_, cyclic) = groups()
    n = hosts * per
    assert world.layout.ring == tuple(range(n)) and world.layout.shape.per_host == per
    # the cyclic group's rank i lies on host i mod H: its ring visits each host's ranks together
    assert cyclic.layout.hosts == tuple(tuple(range(h, n, hosts)) for h in range(hosts)), cyclic.layout.hosts
    assert cyclic.layout.rooted(n - 1)[:per] == (n - 1, *range((n - 1) % hosts, n - 1, hosts))
    assert cyclic.layout.shape.nic_share == per  # every rank of a host crosses through its eth0
    say(f"TOPOLOGY OK rank {r}")


def main() -> None:
    tw.init()
    cases = [0]
    for mode in sys.argv[1:]:
        if mode == "topology":
            topology()
        elif mode == "matrix":
            matrix(cases)
        elif mode == "algos":
            algos(cases)
        elif mode == "mismatch":
            mismatch()
        elif mode == "refusal":
            refusal()
        elif mode == "uneven":
            uneven(cases)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    tw.barrier()
    say(f"JOB OK rank {tw.get_rank()} cases {cases[0]}")
    tw.destroy()


if __name__ == "__main__":
    main()
