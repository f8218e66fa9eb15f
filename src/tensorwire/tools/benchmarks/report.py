"""What `tensorwire bench` measured, as comparison tables, markdown and plots.

Rows (from `tensorwire bench --json` and from the peer runners, each with `lib` and `round`)
are folded into cells: per library, collective, size and placement, the median over rounds of
each round's mean call (`sweep.summarize`). Each table row (collective and size) uses the rounds in which
none of its cells saw foreign CPU load, so its times and ratios come from the same rounds;
where every round saw some, it uses them all and marks the cells that saw it with a dagger.
A ratio is tensorwire's time over the other library's, the median over those rounds of the
per-round ratio (geometric between the middle two of an even count), between placements both
libraries have (out-of-place first).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import subprocess
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ...config import size_text
from .sweep import busbw_factor

TENSORWIRE = "tensorwire"
DAGGER = "†"
SHORT = {"out-of-place": "oop", "in-place": "ip"}
PLOT_COLORS = {"tensorwire": "tab:blue", "gloo": "tab:orange", "mpi": "tab:green"}

Row = dict[str, Any]


@dataclass
class Cell:
    lib: str
    coll: str
    nominal: int
    size: int
    placement: str
    type: str
    redop: str
    time_us: float
    busbw_GBps: float
    rounds: dict[int, float]  # every round's mean call (us)
    used_rounds: list[int]  # the rounds the time is the median of
    contaminated: bool  # foreign CPU load in a used round (no round of its row was clean)
    wrong: int  # > 0: the library computed something else; -1: not checked


@dataclass
class Ratio:
    other: str
    coll: str
    nominal: int
    tw_placement: str
    other_placement: str
    ratio: float
    per_round: dict[int, float]
    contaminated: bool


def _row_key(r: Row) -> tuple[str, int, str, str]:
    return r["coll"], r["nominal"], r["type"], r["redop"]


def used_rounds(rows: Iterable[Row]) -> dict[tuple[str, int, str, str], tuple[set[int], bool]]:
    """Per table row: (the rounds none of its cells saw foreign load in, False), else (all, True)."""
    seen: dict[tuple[str, int, str, str], set[int]] = defaultdict(set)
    dirty: dict[tuple[str, int, str, str], set[int]] = defaultdict(set)
    for r in rows:
        seen[_row_key(r)].add(r.get("round", 0))
        if r.get("contaminated"):
            dirty[_row_key(r)].add(r.get("round", 0))
    out = {}
    for k, rounds in seen.items():
        clean = rounds - dirty[k]
        out[k] = (clean, False) if clean else (rounds, True)
    return out


def _selected(rs: list[Row], used: tuple[set[int], bool]) -> tuple[list[Row], bool]:
    """The rows of the used rounds (all rows if the cell has none there) and whether any is dirty."""
    chosen = [r for r in rs if r.get("round", 0) in used[0]] or rs
    return chosen, any(r.get("contaminated") for r in chosen)


def cells(rows: Sequence[Row]) -> list[Cell]:
    groups: dict[tuple[str, str, int, str, str, str], list[Row]] = defaultdict(list)
    for r in rows:
        lib = r.get("lib", TENSORWIRE)
        groups[(lib, r["coll"], r["nominal"], r["placement"], r["type"], r["redop"])].append(r)
    usage = used_rounds(rows)
    out = []
    for (lib, coll, nominal, placement, type_, redop), rs in groups.items():
        chosen, dirty = _selected(rs, usage[(coll, nominal, type_, redop)])
        time_us = statistics.median(r["time_us"] for r in chosen)
        size, n = rs[0]["size"], rs[0]["nranks"]
        busbw = size / (time_us * 1e-6) / 1e9 * busbw_factor(coll, n) if time_us > 0 else 0.0
        wrongs = [r["wrong"] for r in rs]
        wrong = -1 if any(w < 0 for w in wrongs) else sum(wrongs)
        out.append(Cell(lib, coll, nominal, size, placement, type_, redop, time_us, busbw,
                        {r.get("round", 0): r["time_us"] for r in rs},
                        sorted(r.get("round", 0) for r in chosen), dirty, wrong))
    return out


def _pair(tw: set[str], other: set[str]) -> tuple[str, str] | None:
    for placement in ("out-of-place", "in-place"):
        if placement in tw and placement in other:
            return placement, placement
    if tw and other:
        return min(tw), min(other)  # no common placement: each library's own (the table names both)
    return None


def _median_ratio(values: Iterable[float]) -> float:
    """The median of ratios; of an even count, the geometric (not arithmetic) mean of the middle
    two, so that 0.04 and 500 give 4.5, not 250."""
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else math.sqrt(v[mid - 1] * v[mid])


def ratios(rows: Sequence[Row], others: Sequence[str]) -> list[Ratio]:
    """tensorwire / other per collective and size, on the pairing `_pair` picks per collective."""
    by: dict[tuple[str, str, int, str], dict[int, Row]] = defaultdict(dict)
    placements: dict[tuple[str, str], set[str]] = defaultdict(set)
    for r in rows:
        lib = r.get("lib", TENSORWIRE)
        by[(lib, r["coll"], r["nominal"], r["placement"])][r.get("round", 0)] = r
        placements[(lib, r["coll"])].add(r["placement"])
    usage = used_rounds(rows)
    out = []
    for other in others:
        for coll in dict.fromkeys(r["coll"] for r in rows):
            pair = _pair(placements[(TENSORWIRE, coll)], placements[(other, coll)])
            if pair is None:
                continue
            for nominal in sorted({r["nominal"] for r in rows if r["coll"] == coll}):
                mine, theirs = by[(TENSORWIRE, coll, nominal, pair[0])], by[(other, coll, nominal, pair[1])]
                both = {k: (mine[k], theirs[k]) for k in sorted(mine.keys() & theirs.keys())
                        if mine[k]["time_us"] > 0 and theirs[k]["time_us"] > 0 and theirs[k]["wrong"] <= 0}
                if not both:
                    continue
                rounds, _ = usage[_row_key(mine[next(iter(both))])]
                chosen = {k: ab for k, ab in both.items() if k in rounds} or both
                per = {k: a["time_us"] / b["time_us"] for k, (a, b) in chosen.items()}
                dirty = any(a.get("contaminated") or b.get("contaminated") for a, b in chosen.values())
                out.append(Ratio(other, coll, nominal, pair[0], pair[1], _median_ratio(per.values()), per,
                                 dirty))
    return out


# ------------------------------------------------------------------------------------------
# Text


def fmt_us(us: float) -> str:
    if us >= 1000:
        return f"{us:,.0f}"
    if us >= 100:
        return f"{us:.1f}"
    return f"{us:.2f}"


def _time_cell(c: Cell | None) -> str:
    if c is None:
        return "-"
    if c.wrong > 0:
        return "WRONG"
    return fmt_us(c.time_us) + (DAGGER if c.contaminated else "")


def fmt_ratio(ratio: float) -> str:
    """Two decimals, but never a bare 0.00: below 0.1 two significant digits (0.0035)."""
    return f"{ratio:.2f}" if ratio >= 0.1 else f"{ratio:.2g}"


def _ratio_cell(r: Ratio | None) -> str:
    return "-" if r is None else fmt_ratio(r.ratio) + (DAGGER if r.contaminated else "")


@dataclass
class Table:
    """One collective's comparison: the columns (library, placement) it has and its rows."""

    coll: str
    columns: list[tuple[str, str]]
    others: list[str]
    pairs: dict[str, tuple[str, str]]
    rows: list[tuple[int, list[str], list[str]]]  # (size, time cells, ratio cells)
    geomean: dict[str, float]


def tables(cs: Sequence[Cell], rs: Sequence[Ratio], libs: Sequence[str]) -> list[Table]:
    out = []
    for coll in dict.fromkeys(c.coll for c in cs):
        mine = [c for c in cs if c.coll == coll]
        columns = [(lib, p) for lib in libs for p in ("out-of-place", "in-place")
                   if any(c.lib == lib and c.placement == p for c in mine)]
        others = [lib for lib in libs[1:] if any(r.coll == coll and r.other == lib for r in rs)]
        at = {(c.lib, c.placement, c.nominal): c for c in mine}
        rat = {(r.other, r.nominal): r for r in rs if r.coll == coll}
        pairs = {r.other: (r.tw_placement, r.other_placement) for r in rs if r.coll == coll}
        body = []
        for nominal in sorted({c.nominal for c in mine}):
            size = max(c.size for c in mine if c.nominal == nominal)
            body.append((size, [_time_cell(at.get((lib, p, nominal))) for lib, p in columns],
                         [_ratio_cell(rat.get((o, nominal))) for o in others]))
        geo = {}
        for o in others:
            vals = [r.ratio for r in rs if r.coll == coll and r.other == o]
            geo[o] = math.exp(sum(math.log(v) for v in vals) / len(vals))
        out.append(Table(coll, columns, others, pairs, body, geo))
    return out


def _pair_text(t: Table) -> str:
    """Which placements each ratio compares (gloo's all_reduce, e.g., exists only in place)."""
    return "; ".join(f"tw/{o}: tensorwire {t.pairs[o][0]} vs {o} {t.pairs[o][1]}" for o in t.others)


def text_tables(ts: Sequence[Table], n: int, rounds: int) -> list[str]:
    """The comparison tables as `#`-commented headers and whitespace-separated rows."""
    lines = [
        f"# Comparison, {n} ranks, float32 sum, {rounds} interleaved round(s): time (us) = median over",
        "# rounds of each round's mean call (the slowest rank's, as nccl-tests); ratio tw/X = tensorwire",
        "# time / X time, median over rounds of the per-round ratio: < 1 means tensorwire is faster, > 1",
        "# slower. A row uses the rounds in which none of its cells saw foreign CPU load,",
        f"# else all rounds and {DAGGER} marks the cells that saw it. oop = out-of-place, ip = in-place;",
        "# WRONG = the library's result failed the check; - = not measured.",
        "#",
    ]
    for t in ts:
        heads = [f"{lib}:{SHORT[p]}" for lib, p in t.columns] + [f"tw/{o}" for o in t.others]
        values = [[*times, *rats] for _, times, rats in t.rows]
        widths = [max(8, len(h), *(len(v[i]) for v in values)) for i, h in enumerate(heads)]
        units = ["(us)"] * len(t.columns) + [""] * len(t.others)
        lines.append(f"# Collective: {t.coll}" + (f"  ({_pair_text(t)})" if t.others else ""))
        lines.append(f"#{'size':>11}" + "".join(f"  {h:>{w}}" for h, w in zip(heads, widths)))
        lines.append((f"#{'(B)':>11}" + "".join(f"  {u:>{w}}" for u, w in zip(units, widths))).rstrip())
        for (size, _, _), vals in zip(t.rows, values):
            lines.append(f"{size:12d}" + "".join(f"  {v:>{w}}" for v, w in zip(vals, widths)))
        if t.geomean:
            means = ", ".join(f"tw/{o} {fmt_ratio(g)}" for o, g in t.geomean.items())
            lines.append("# geometric mean: " + means)
        lines.append("#")
    return lines


def markdown_tables(ts: Sequence[Table]) -> list[str]:
    lines: list[str] = []
    for t in ts:
        heads = ["size"] + [f"{lib} {p} (us)" for lib, p in t.columns] + [f"tw/{o}" for o in t.others]
        lines += [f"### {t.coll}", ""]
        if t.others:
            lines += [_pair_text(t) + ".", ""]
        lines += ["| " + " | ".join(heads) + " |", "|" + "---:|" * len(heads)]
        for size, times, rats in t.rows:
            lines.append("| " + " | ".join([size_text(size, exact=True), *times, *rats]) + " |")
        if t.geomean:
            means = ", ".join(f"tw/{o} **{fmt_ratio(g)}**" for o, g in t.geomean.items())
            lines += ["", f"Geometric mean: {means}."]
        lines.append("")
    return lines


def machine() -> dict[str, Any]:
    """What a reader needs to judge the numbers: the host, its CPUs and memory, the software."""
    import numpy as np

    from ... import __version__

    info: dict[str, Any] = {"host": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release(),
                            "python": platform.python_version(), "numpy": np.__version__,
                            "tensorwire": __version__}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
        with open("/proc/meminfo") as f:
            info["memory_GiB"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    commit = _git_commit(str(Path(__file__).resolve().parents[2]))  # the whole package: src/tensorwire
    if commit:
        info["tensorwire"] += f" (git {commit})"
    return info


def _git_commit(folder: str) -> str | None:
    """The checkout's commit, with `+changes` when `folder` differs from it, a new file in it
    included (None outside git)."""
    try:
        head = subprocess.run(["git", "-C", folder, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", folder, "status", "--porcelain", "."],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def write_json(path: str, doc: dict[str, Any]) -> None:
    """A sweep's --json document (rank 0)."""
    full = os.path.abspath(path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
        json.dump(doc, f, indent=1, default=float)


def machine_lines(info: dict[str, Any], libraries: dict[str, str]) -> list[str]:
    lines = [f"- host `{info['host']}`: {info['cpus']} CPUs ({info.get('cpu', '?')}), "
             f"{info.get('memory_GiB', '?')} GiB, Linux {info['kernel']}",
             f"- Python {info['python']}, numpy {info['numpy']}, tensorwire {info['tensorwire']}"]
    lines += [f"- {lib}: {what}" for lib, what in libraries.items()]
    return lines


PLAIN_METHOD = ("Time: the mean call, the slowest rank's, as nccl-tests reports it (warm-up calls, a "
                "barrier, then every call timed on every rank); p50 and p99: the median and 99th percentile "
                "over the calls of each call's time on its slowest rank; algbw = size / time, busbw = algbw "
                "x nccl-tests' factor (GB/s = 1e9 B/s).")


ALGO_METHOD = ("Per size and algorithm: time, the median over calls of each call's time on its slowest "
               "rank; mean call, the slowest rank's time over its calls (nccl-tests' time), by which the "
               "model is judged and the fastest forced algorithm (*) found; predicted, the tuner's α-β-γ "
               "model with the job's link constants; busbw = size / mean call x nccl-tests' factor (GB/s = "
               "1e9 B/s).")
"""How an --algo sweep's tables read (its --markdown page; the plain sweep's: PLAIN_METHOD)."""

def write_markdown(path: str, title: str, command: str, method: str, info: dict[str, Any],
                   described: dict[str, str], notes: Sequence[str], plot_path: str | None,
                   body: Sequence[str]) -> None:
    """A results page: title, the exact command, how to read it, the machine, the plot, `body`."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = [f"# {title}", "", f"Measured {stamp} with", "", f"    {command}", "", method, "",
          *machine_lines(info, described)]
    md += [f"- skipped: {note}" for note in notes]
    if plot_path:
        rel = os.path.relpath(os.path.abspath(plot_path), os.path.dirname(os.path.abspath(path)))
        md += ["", f"![time and busbw against size]({rel})"]
    md += ["", *body]
    full = os.path.abspath(path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w") as f:
        f.write("\n".join(md).rstrip() + "\n")


# ------------------------------------------------------------------------------------------
# Plot


def check_plotting() -> None:
    """Raise with the install hint before a long sweep, not after it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install 'tensorwire[bench]' "
                           "(or pip install matplotlib)") from None


def plot(cs: Sequence[Cell], path: str, title: str) -> None:
    """Time and busbw against size (log x; log time), a row of two panels per collective, one
    line per library, placement (and datatype / op where several were swept)."""
    check_plotting()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colls = [c for c in dict.fromkeys(x.coll for x in cs) if c != "barrier"]
    if not colls:
        raise RuntimeError("--plot: nothing to plot (barrier alone has no sizes)")
    fig, axes = plt.subplots(len(colls), 2, figsize=(11, 3.2 * len(colls) + 0.4), squeeze=False,
                             layout="constrained")
    sizes = matplotlib.ticker.FuncFormatter(lambda x, _pos: size_text(int(x), exact=True).replace(" ", ""))
    for row, coll in enumerate(colls):
        series: dict[tuple[str, str, str, str], list[Cell]] = defaultdict(list)
        for c in cs:
            if c.coll == coll and c.size > 0 and c.wrong <= 0:
                series[(c.lib, c.placement, c.type, c.redop)].append(c)
        variants = {(type_, redop) for _, _, type_, redop in series}
        for (lib, placement, type_, redop), pts in series.items():
            pts.sort(key=lambda c: c.size)
            label = f"{lib} {placement}" + (f" {type_} {redop}" if len(variants) > 1 else "")
            style = {"color": PLOT_COLORS.get(lib), "linestyle": "-" if placement == "out-of-place" else "--",
                     "marker": "o", "markersize": 3, "label": label}
            xs = [c.size for c in pts]
            axes[row][0].plot(xs, [c.time_us for c in pts], **style)
            axes[row][1].plot(xs, [c.busbw_GBps for c in pts], **style)
            dirty = [c for c in pts if c.contaminated]
            if dirty:
                for ax, ys in ((axes[row][0], [c.time_us for c in dirty]),
                               (axes[row][1], [c.busbw_GBps for c in dirty])):
                    ax.scatter([c.size for c in dirty], ys, marker="x", color="red", zorder=3)
        for col, ylabel in enumerate(("time (us)", "busbw (GB/s)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(sizes)
            if col == 0:
                ax.set_yscale("log")
            ax.set_title(coll)
            ax.set_xlabel("size (B)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
        axes[row][0].legend(fontsize=7)
    note = ", barrier not shown" if any(c.coll == "barrier" for c in cs) else ""
    fig.suptitle(f"{title}   (red x: foreign CPU load{note})", fontsize=9)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cells_json(cs: Sequence[Cell]) -> list[dict[str, Any]]:
    return [asdict(c) for c in cs]


def ratios_json(rs: Sequence[Ratio]) -> list[dict[str, Any]]:
    return [asdict(r) for r in rs]
