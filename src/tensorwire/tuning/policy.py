"""Which algorithms may run a collective: TENSORWIRE_ALGO's forced and excluded names, and
deterministic mode's rank-ordered reductions.

TENSORWIRE_ALGO forces or excludes names, NCCL-style: `allreduce:ring`, `broadcast:binomial`,
`allreduce:^direct`, `^recursive_doubling` (every collective), `allreduce:ring|direct` (either);
clauses are separated by `,` or `;`. An unqualified forced name applies to the collectives that
have an algorithm of that name and leaves the others alone. Unknown collectives or names are
an error at init that lists the known ones.

Deterministic mode (TENSORWIRE_DETERMINISTIC=1) leaves only rank-ordered reductions eligible
for all_reduce, reduce and reduce_scatter (DETERMINISTIC: the one-shot shared-memory path,
the rank_ordered message algorithm, the linear reduce), which fold every element in rank
order and so produce the same bits whatever was chosen.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from ..algorithms import rank_ordered
from ..algorithms.prices import Shape
from ..algorithms.registry import COLLECTIVES, Algorithm, algorithms_for, slot_bytes
from ..config import Config
from ..errors import InvalidArgumentError

REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter")
"""Collectives whose result depends on the order of the reduction (floating point)."""
DETERMINISTIC = {
    "all_reduce": frozenset({"direct", "single_copy", rank_ordered.NAME}),
    "reduce": frozenset({"direct", rank_ordered.NAME, "linear"}),
    "reduce_scatter": frozenset({"direct", "single_copy", rank_ordered.NAME}),
}
"""Per reduction, the algorithms that fold every element in rank order, ((x0 op x1) op x2) ...:
the same bits whichever of them runs."""
EXCLUDED = "excluded by TENSORWIRE_ALGO"
"""why_not's reason for an algorithm that could run a call but TENSORWIRE_ALGO keeps out."""
ALIASES = {"tree": "binomial"}
"""Family names accepted in TENSORWIRE_ALGO where no algorithm has that exact name."""


def _norm(name: str) -> str:
    return name.replace("_", "").replace("-", "").strip().lower()


_COLLECTIVE_BY_NORM = {_norm(c): c for c in COLLECTIVES}


@functools.lru_cache(maxsize=64)
def parse_spec(spec: str) -> tuple[tuple[str | None, tuple[str, ...], tuple[str, ...]], ...]:
    """Clauses (collective or None, forced names, excluded names), names normalized; raises
    InvalidArgumentError for syntax errors and unknown collectives (names are checked by
    `check_algo`, which knows the registry)."""
    clauses = []
    for part in filter(None, (p.strip() for p in spec.replace(";", ",").split(","))):
        coll_text, colon, names_text = part.rpartition(":")
        coll = None
        if colon:
            coll = _COLLECTIVE_BY_NORM.get(_norm(coll_text))
            if coll is None:
                raise InvalidArgumentError(
                    f"TENSORWIRE_ALGO={spec!r}: unknown collective {coll_text.strip()!r} "
                    f"(known: {', '.join(COLLECTIVES)})")
        forced, excluded = [], []
        for name in names_text.replace("+", "|").split("|"):
            name = name.strip()
            if name.startswith("^"):
                if not _norm(name[1:]):
                    raise InvalidArgumentError(f"TENSORWIRE_ALGO={spec!r}: '^' without a name in {part!r}")
                excluded.append(_norm(name[1:]))
            elif _norm(name):
                forced.append(_norm(name))
        if not forced and not excluded:
            raise InvalidArgumentError(f"TENSORWIRE_ALGO={spec!r}: no algorithm named in {part!r}")
        clauses.append((coll, tuple(forced), tuple(excluded)))
    if spec.strip() and not clauses:
        raise InvalidArgumentError(f"TENSORWIRE_ALGO={spec!r}: no clause (expected e.g. allreduce:ring)")
    return tuple(clauses)


def _registered(collective: str) -> dict[str, str]:
    """Normalized name -> registered name, aliases included, for one collective."""
    names = {_norm(n): n for n in algorithms_for(collective)}
    for alias, target in ALIASES.items():
        if alias not in names and _norm(target) in names:
            names[alias] = names[_norm(target)]
    return names


def resolve(collective: str, name: str) -> str | None:
    """The registered algorithm of `collective` that `name` means (case, `_`, `-` and the
    aliases ignored as in TENSORWIRE_ALGO), or None."""
    return _registered(collective).get(_norm(name))


@functools.lru_cache(maxsize=256)
def parse_algo(spec: str, collective: str) -> tuple[frozenset[str], frozenset[str]]:
    """(forced, excluded) registered names for one collective; forced empty means 'any'."""
    known = _registered(collective)
    forced: set[str] = set()
    excluded: set[str] = set()
    for coll, f, x in parse_spec(spec):
        if coll is not None and coll != collective:
            continue
        excluded.update(known[n] for n in x if n in known)
        for n in f:
            if n in known:
                forced.add(known[n])
            elif coll is not None:  # unknown here: matches nothing (check_algo reports it at init)
                forced.add(n)
            # an unqualified forced name only binds the collectives that have it
    return frozenset(forced), frozenset(excluded)


def allowed(cfg: Config, collective: str, name: str, force: bool = True) -> bool:
    """May `name` run `collective` under TENSORWIRE_ALGO and deterministic mode? `force=False`
    applies the exclusions only (see forcing)."""
    if not cfg.algo and not cfg.deterministic:
        return True
    forced, excluded = parse_algo(cfg.algo, collective)
    if name in excluded or (force and forced and name not in forced):
        return False
    return not (cfg.deterministic and not is_deterministic(algorithms_for(collective)[name]))


def is_deterministic(alg: Algorithm) -> bool:
    """Folds in rank order (data movement without reduction is deterministic anyway)."""
    if alg.collective not in REDUCTIONS:
        return True
    return alg.name in DETERMINISTIC[alg.collective]


def check_algo(spec: str, deterministic: bool = False, rank: int | None = None) -> None:
    """Raise InvalidArgumentError naming the known algorithms if `spec` names an unknown
    collective or algorithm, or leaves deterministic mode without a reduction algorithm."""
    where = f"rank {rank}: " if rank is not None else ""
    try:
        clauses = parse_spec(spec) if spec else ()
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{where}{exc}") from None
    every = sorted({n for c in COLLECTIVES for n in algorithms_for(c)})
    for coll, forced_names, excluded_names in clauses:
        for name in forced_names + excluded_names:
            if coll is not None:
                if name not in _registered(coll):
                    raise InvalidArgumentError(
                        f"{where}TENSORWIRE_ALGO={spec!r}: {coll} has no algorithm {name!r} "
                        f"(known for {coll}: {', '.join(sorted(algorithms_for(coll)))})")
            elif not any(name in _registered(c) for c in COLLECTIVES):
                raise InvalidArgumentError(
                    f"{where}TENSORWIRE_ALGO={spec!r}: no collective has an algorithm {name!r} "
                    f"(known: {', '.join(every)})")
    if deterministic:
        for coll in REDUCTIONS:
            forced, excluded = parse_algo(spec, coll)
            ordered = sorted(n for n, a in algorithms_for(coll).items() if is_deterministic(a))
            # the shared-memory path only runs on one host: something else must remain
            left = [n for n, a in algorithms_for(coll).items() if is_deterministic(a) and not a.needs_direct
                    and n not in excluded and (not forced or n in forced)]
            if not left:
                raise InvalidArgumentError(
                    f"{where}TENSORWIRE_ALGO={spec!r} leaves deterministic mode no {coll} algorithm for "
                    f"every size: only {', '.join(ordered)} reduce in rank order (unset "
                    f"TENSORWIRE_DETERMINISTIC, or allow {rank_ordered.NAME})")


def forcing(cfg: Config, collective: str, shape: Shape | None, even: bool = True) -> bool:
    """Does TENSORWIRE_ALGO's forcing bind a call? Not where it forces only algorithms the call
    cannot run by its kind: hierarchical ones where the group cannot run them (`shape` None: a
    group on one host, or the host groups and rails its phases run on, which choose their own
    algorithms, or a call whose blocks may differ; or the rails' variants on hosts holding
    different numbers of ranks), the one-shot path's where the call's blocks differ (not
    `even`: the vector forms)."""
    forced = parse_algo(cfg.algo, collective)[0] if cfg.algo else frozenset()
    if not forced:
        return True
    algs = algorithms_for(collective)
    return not all(name in algs and ((algs[name].phases is not None and not runs_on(algs[name], shape))
                                     or (algs[name].needs_direct and not even)) for name in forced)


def why_not(alg: Algorithm, n: int, nbytes: int, cfg: Config, *, slot: int | None = None,
            single_copy: bool = False, crowded: bool = False, oversubscribed: bool = False,
            shape: Shape | None = None, force: bool = True) -> str:
    """'' where `alg` may run a call of nbytes on n ranks, else why not: the rules of the
    tuner's choice (tuner.candidates) and of `tensorwire plan` alike. `slot`: the call's
    one-shot slot (None: no shared-memory path); `single_copy`: the ranks may read each other's
    memory; `crowded`: TENSORWIRE_SINGLE_COPY=1's rule where ranks outnumber cores;
    `oversubscribed`: ranks outnumber the cores they may use; `shape`: what hierarchical
    algorithms would run in (None: nothing across hosts); `force`: TENSORWIRE_ALGO's forcing
    binds (forcing)."""
    if alg.phases is not None and not runs_on(alg, shape):
        return "groups across hosts only" if shape is None else "not for hosts of these numbers of ranks"
    if alg.needs_direct:
        if slot is None:
            return "one-host shared-memory path only"
        need = slot_bytes(alg, n, nbytes)
        if need > slot:
            return f"needs {need} B of a one-shot slot of {slot} (TENSORWIRE_SHM_DIRECT)"
        if alg.needs_single_copy and not single_copy:
            return "reads peers' memory: TENSORWIRE_SINGLE_COPY or the kernel (ptrace) does not allow it here"
        if alg.needs_single_copy and crowded and not alg.single_copy_crowded:
            return "not where ranks outnumber cores (TENSORWIRE_SINGLE_COPY=force allows it)"
        if alg.named_where_crowded and oversubscribed and \
                alg.name not in parse_algo(cfg.algo, alg.collective)[0]:
            return "not where ranks outnumber cores (TENSORWIRE_ALGO naming it allows it)"
    if not alg.eligible(n, nbytes):
        return f"not for {n} ranks at {nbytes} B"
    if cfg.algo and not allowed(replace(cfg, deterministic=False), alg.collective, alg.name, force):
        return EXCLUDED
    if cfg.deterministic and not is_deterministic(alg):
        return "not rank-ordered (deterministic mode)"
    return ""


def rivals(collective: str, name: str, n: int, nbytes: int, single_copy: bool) -> list[Algorithm]:
    """The algorithms of `collective` besides `name` that a group of n ranks on one host has
    for nbytes (by messages, or single copy where it reads its peers), whatever TENSORWIRE_ALGO
    allows: what the one-shot path is built to beat at small sizes (calibrate.with_direct_bound)."""
    return [a for a in algorithms_for(collective).values()
            if a.name != name and a.phases is None and a.eligible(n, nbytes)
            and (not a.needs_direct or (a.needs_single_copy and single_copy))]


def runs_on(alg: Algorithm, shape: Shape | None) -> bool:
    """Whether a hierarchical algorithm can run on a group of this shape."""
    return shape is not None and (alg.uniform if shape.uniform else alg.uneven)

