"""`tensorwire bench --algo NAME|all`: every algorithm of a collective timed against the model.

    tensorwire bench all_reduce --algo all -b 8 -e 64M -f 4 --np 4 --rounds 3

For each size the tuner's own choice ("auto") runs first, then every algorithm eligible for
that call, each forced in turn through `tuner.override` (no re-initialisation, so every
algorithm runs on the same group, links and calibration). Each line holds the median call
(the plain bench's p50: per iteration the slowest rank, the median over iterations), the mean
call (JUDGED, the plain bench's time), the model's prediction for that algorithm and the mean
call's ratio to it; a summary line per size gives the best forced algorithm and auto/best, by
the mean call. `--rounds R` repeats the whole sequence R times, interleaved, and pools the
iterations: on a busy host a slow spell then hits every algorithm alike instead of whichever
was running.

Only one placement is measured (out-of-place, or in-place with -I), and every forced run is
checked against the numpy reference like the plain bench's, so a wrong algorithm shows up
in #wrong. `--algo NAME` forces one algorithm (sizes where it is not eligible say so).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...algorithms.prices import Link
from ...algorithms.registry import COLLECTIVES, algorithms_for
from ...ops.dtypes import dtype_name
from ...tuning import policy, tuner
from . import report
from .options import Options
from .sweep import NO_INPLACE, ROOTED, Buffers, Case, busbw_factor, measure, summarize
from .tw_calls import collect, make_case, sweep_pairs, time_str, wrong_line

REGISTRY_NAME = {"alltoall": "all_to_all"}
"""bench's collective names (nccl-tests') where the registry's differ."""
AUTO = "auto"
JUDGED = "mean_us"
"""The statistic the model is judged by and algorithms are ranked by: the slowest rank's mean
call (its loop time over its calls, nccl-tests' `-a 3`, the plain bench's time), not the
median over calls, which keeps the fast calls of a backlog only. The model's constants are
mean calls too: a loop of calls costs its mean, stalls included
(docs/design/benchmarking.md#the-mean-call)."""


def _timed(tw: Any, case: Case, opts: Options) -> tuple[list[list[float]], int] | None:
    return collect(tw, measure(tw, case, opts.warmup, opts.iters, opts.check,
                                           blocking=opts.blocking))


def _decision(tw: Any, case: Case, coll: str) -> tuner.Decision | None:
    """The tuner's priced candidates for this case, learnt from one call (None if the call
    never reached the tuner: nothing to move, or one rank)."""
    with tuner.override(tw.world(), coll, None) as ov:
        case.init_inputs(sentinel=False)
        case.call()
    return ov.decision


def measure_size(tw: Any, case: Case, coll: str, wanted: str, opts: Options,
                 rounds: int) -> dict[str, Any] | None:
    """Auto and each wanted algorithm, `rounds` times interleaved; rank 0 gets the result."""
    decision = _decision(tw, case, coll)
    if decision is None:
        names: list[str] = []
    elif wanted == "all":
        names = sorted(n for _, n, _ in decision.priced)
    else:
        names = [n for _, n, _ in decision.priced if n == wanted]
    refused = tuner.refusal(tw.world(), algorithms_for(coll)[wanted], decision.nbytes) \
        if decision is not None and wanted != "all" and not names else ""
    runs = [AUTO, *names] if wanted == "all" or not names else names
    pooled: dict[str, list[list[float]]] = {}
    wrong: dict[str, int] = {}
    for _ in range(rounds):
        for name in runs:
            with tuner.override(tw.world(), coll, None if name == AUTO else name):
                got = _timed(tw, case, opts)
            if got is None:
                continue
            per_rank, w = got
            if name in pooled:
                pooled[name] = [a + b for a, b in zip(pooled[name], per_rank)]
            else:
                pooled[name] = per_rank
            wrong[name] = -1 if w < 0 else wrong.get(name, 0) + w  # -1: not checked (-c 0)
    if tw.get_rank() != 0:
        return None
    n = tw.get_world_size()
    assert opts.iters is not None  # --algo takes a fixed -n (options.parse_options)
    chosen = decision.priced[0][1] if decision is not None else None
    cells = {}
    for name, per_rank in pooled.items():
        stats = summarize(per_rank)
        algbw = case.size / (stats[JUDGED] * 1e-6) / 1e9 if stats[JUDGED] > 0 else 0.0
        runs_as = chosen if name == AUTO else name
        predicted = decision.predicted(runs_as) * 1e6 if decision is not None and runs_as else None
        cells[name] = {
            "algorithm": runs_as, "wrong": wrong[name], "algbw_GBps": algbw,
            "busbw_GBps": algbw * busbw_factor(case.coll, n), **stats, "predicted_us": predicted,
        }
    result: dict[str, Any] = {
        "coll": case.coll, "nranks": n, "size": case.size, "count": case.param,
        "type": dtype_name(case.dtype) if case.coll != "barrier" else "none",
        "redop": case.op or "none", "root": case.root if case.coll in ROOTED else -1,
        "placement": "in-place" if case.inplace else "out-of-place", "iters": opts.iters * rounds,
        "tier": decision.tier if decision is not None else None, "auto": chosen,
        "eligible": sorted(n_ for _, n_, _ in decision.priced) if decision is not None else [],
        "refused": refused, "cells": cells,
    }
    return judge(result)


def judge(result: dict[str, Any], key: str = JUDGED) -> dict[str, Any]:
    """Set one size's verdicts from its cells by the statistic `key` (a cell's field): every
    cell's measured/predicted, the fastest forced algorithm, auto/best, and the chosen
    algorithm's own forced run against the best (auto/best without auto's own noise)."""
    cells = result["cells"]
    result["judged"] = key
    for c in cells.values():
        c["measured_over_predicted"] = c[key] / c["predicted_us"] if c.get("predicted_us") else None
    forced = {k: v for k, v in cells.items() if k != AUTO}
    if forced:
        best = min(forced, key=lambda k: forced[k][key])
        result["best"] = best
        result["best_time_us"] = forced[best][key]
    if AUTO in cells and forced:
        result["auto_time_us"] = cells[AUTO][key]
        result["auto_over_best"] = cells[AUTO][key] / result["best_time_us"]
        if result["auto"] in forced:
            result["chosen_over_best"] = forced[result["auto"]][key] / result["best_time_us"]
    return result


def _us(v: float | None) -> str:
    return "-" if v is None else time_str(v).strip()


def _line(size: str, label: str, *cols: str) -> str:
    """size, algorithm, then time, mean call, predicted, mean/pred, busbw and #wrong, right-aligned."""
    widths = (9, 9, 9, 9, 7, 6)
    return f"{size:>12}  {label:<24} " + "  ".join(f"{c:>{w}}" for c, w in zip(cols, widths))


HEADER = [
    "#" + _line("size", "algorithm", "time", "mean call", "predicted", "mean/pred", "busbw", "#wrong")[1:],
    "#" + _line("(B)", "(* fastest forced)", "(us)", "(us)", "(us)", "", "(GB/s)", "")[1:],
]


def _rates(link: Link) -> dict[str, float | None]:
    """A link's constants as the JSON keeps them: α in µs, β and γ as GB/s (None: free), and
    the memory entry's cache in MiB."""
    out: dict[str, float | None] = {
        "alpha_us": link.alpha * 1e6, "bandwidth_GBps": 1e-9 / link.beta if link.beta else None,
        "reduce_GBps": 1e-9 / link.gamma if link.gamma else None}
    if link.cache:
        out["cache_MiB"] = link.cache / (1 << 20)
    return out


def format_size(res: dict[str, Any]) -> list[str]:
    """One line per algorithm (auto first, then fastest first) and a summary comment."""
    lines = []
    cells = res["cells"]
    for name in sorted(cells, key=lambda k: (k != AUTO, cells[k][JUDGED])):
        c = cells[name]
        best = "*" if name == res.get("best") else ""
        label = f"{AUTO}:{c['algorithm']}" if name == AUTO else name + best
        ratio = c["measured_over_predicted"]
        lines.append(_line(str(res["size"]), label, _us(c["p50_us"]), _us(c[JUDGED]), _us(c["predicted_us"]),
                           "-" if ratio is None else f"{ratio:.2f}", f"{c['busbw_GBps']:.2f}",
                           "N/A" if c["wrong"] < 0 else str(c["wrong"])))
    if "auto_over_best" in res:
        a = cells[AUTO]
        lines.append(f"#{res['size']:>11}  auto {res['auto']}: mean call {_us(res['auto_time_us'])} us "
                     f"(predicted {_us(a['predicted_us'])} us, x{a['measured_over_predicted']:.2f}); "
                     f"best {res['best']} {_us(res['best_time_us'])} us; "
                     f"auto/best {res['auto_over_best']:.2f}")
    return lines


def run_algos(tw: Any, opts: Options, bufs: Buffers, say: Callable[[str], None], doc: dict[str, Any]) -> int:
    """The --algo sweep over opts' collectives, dtypes, ops and sizes; returns #wrong in total.
    `doc`: the --json document, its meta given, its results filled as they come (so that an
    interrupted sweep can write what it measured: bench.run_benchmark)."""

    assert opts.args is not None
    wanted, rounds = opts.args.algo, opts.args.rounds
    rank = tw.get_rank()
    table = tuner.table_for(tw.world().runtime)
    links = {t: {**_rates(lk), "source": table.sources.get(t, "default")} for t, lk in table.links.items()}
    results: list[dict[str, Any]] = []
    doc["meta"].update(algo=wanted, rounds=rounds, links=links)
    doc["results"] = results
    say(f"# --algo {wanted}: " + ("the tuner's choice (auto), then every eligible algorithm forced in turn"
                                  if wanted == "all" else f"{wanted} forced")
        + f"; {rounds} interleaved round(s) of {opts.warmup} warm-up + {opts.iters} timed calls each")
    say("# time = per call the slowest rank, the median over calls; mean call = the slowest rank's time over "
        "its calls, by which the model is judged and the fastest forced (*) is found")
    say("# busbw = size / mean call x nccl-tests factor; 1 GB/s = 1e9 B/s")
    say("# predicted = the tuner's α-β-γ model with this job's link constants:")
    for tier in table.links:
        say(f"#   {tier}: {table.describe(tier)}")
    say("#")
    total_wrong = 0
    ran = False
    for coll in opts.colls:
        reg = REGISTRY_NAME.get(coll, coll)
        if reg not in COLLECTIVES:
            say(f"# Collective: {coll}: point-to-point, no algorithms to choose from (skipped)")
            continue
        name = wanted if wanted == "all" else policy.resolve(reg, wanted)
        if name is None:
            say(f"# Collective: {coll} has no algorithm {wanted!r} (known: "
                f"{', '.join(sorted(algorithms_for(reg)))}; skipped)")
            continue
        ran = True
        say(f"# Collective: {coll}" + (f"  (root {opts.root})" if coll in ROOTED else "")
            + f"  {'in-place' if opts.inplace_only else 'out-of-place'}")
        for line in HEADER:
            say(line)
        for dt, op in sweep_pairs(opts, coll, rank, say):
            for nominal in (opts.sizes if coll != "barrier" else [0]):
                inplace = opts.inplace_only and coll not in NO_INPLACE
                case = make_case(tw, coll, dt, op, opts.root, nominal, inplace, bufs)
                res = measure_size(tw, case, reg, name, opts, rounds)
                if res is None:
                    continue
                if not res["cells"] or (name != "all" and name not in res["cells"]):
                    why = f": {res['refused']}" if res["refused"] else ""
                    say(f"#{case.size:>11}  {name} cannot run this call{why} (eligible: "
                        f"{', '.join(res['eligible']) or 'none: nothing to move'})")
                for line in format_size(res):
                    say(line)
                total_wrong += sum(max(c["wrong"], 0) for c in res["cells"].values())
                results.append(res)
        say("#")
    say(wrong_line(total_wrong, opts.check))
    doc["wrong_total"] = total_wrong
    if rank == 0 and opts.json_path:
        report.write_json(opts.json_path, doc)
    if not ran and wanted != "all" and all(policy.resolve(c, wanted) is None for c in COLLECTIVES):
        raise SystemExit(f"tensorwire bench: error: --algo {wanted!r} names no algorithm")  # a typo
    return total_wrong

