"""TENSORWIRE_TUNING_FILE: link constants a user sets, read and laid over a table.

The file is JSON, {tier: {field: value}}, with values in SI units or friendlier ones
(`alpha_us`, `bandwidth_GBps`, ...: docs/tuning.md gives the format); a calibration cache
entry works as a tuning file.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from collections.abc import Mapping
from typing import Any

from ..algorithms.prices import Link
from ..errors import InvalidArgumentError
from .cost_model import DEFAULT_LINKS, ONE_WAY, TIERS, LinkTable, default_table

FIELDS = ("alpha", "beta", "gamma", "cache")
REQUIRED = FIELDS[:3]  # every link has these; `cache` only the memory entry (else 0)

_UNITS = {  # accepted key -> (field, factor to SI, is a rate)
    "alpha": ("alpha", 1.0, False), "alpha_us": ("alpha", 1e-6, False),
    "beta": ("beta", 1.0, False), "bandwidth_gbps": ("beta", 1e9, True),
    "gamma": ("gamma", 1.0, False), "reduce_gbps": ("gamma", 1e9, True),
    "cache": ("cache", 1.0, False), "cache_mib": ("cache", float(1 << 20), False),
}


MAX_FILE_BYTES = 1 << 20
"""Largest tuning file or calibration cache entry read: a few hundred bytes is what one holds."""


class BadFile(ValueError):
    """A file that is not a small regular file of JSON (of this user's or root's, where asked)."""


def read_json(path: str, follow: bool = True, own: bool = False) -> Any:
    """The JSON document in `path`; FileNotFoundError where there is none; BadFile for anything
    else in its place: opened without waiting on a FIFO (nor following a last link unless
    `follow`), its type, owner (`own`: this user or root) and size checked before a byte is read."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        link = exc.errno == errno.ELOOP and not follow
        raise BadFile(f"cannot open it: {'a symbolic link, not followed' if link else exc.strerror}") from exc
    try:
        st = os.fstat(fd)  # before fdopen, which refuses a directory with its own error
        if not stat.S_ISREG(st.st_mode):
            raise BadFile("not a regular file")
        if own and st.st_uid not in (os.geteuid(), 0):  # a shared directory: another user's file
            raise BadFile(f"a file of uid {st.st_uid}, not this user's")
        if st.st_size > MAX_FILE_BYTES:
            raise BadFile(f"{st.st_size} bytes, more than the {MAX_FILE_BYTES} read")
        raw = os.read(fd, MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise BadFile(f"not valid JSON ({exc})") from exc


def _finite(raw: Any) -> float | None:
    """`raw` as a float if it is a finite JSON number (not a bool), else None."""
    if not isinstance(raw, (int, float)) or isinstance(raw, bool):
        return None
    try:
        value = float(raw)  # an integer of hundreds of digits overflows
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def parse_tuning(doc: Any, where: str) -> dict[str, dict[str, float]]:
    """{tier: {field: SI value}} from a tuning document (see docs/tuning.md for the format)."""
    if isinstance(doc, Mapping) and "links" in doc:
        doc = doc["links"]  # a cache file works as a tuning file
    if not isinstance(doc, Mapping):
        raise InvalidArgumentError(f"{where}: expected a JSON object of tiers, e.g. "
                                   f'{{"tcp": {{"alpha_us": 50, "bandwidth_GBps": 1.2}}}}')
    out: dict[str, dict[str, float]] = {}
    for tier, fields in doc.items():
        if not isinstance(fields, Mapping):
            raise InvalidArgumentError(f"{where}: tier {tier!r} must map to an object of constants")
        values: dict[str, float] = {}
        for key, raw in fields.items():
            unit = _UNITS.get(str(key).lower())
            if unit is None:
                raise InvalidArgumentError(f"{where}: tier {tier!r}: unknown key {key!r} (known: alpha, "
                                           f"alpha_us, beta, bandwidth_GBps, gamma, reduce_GBps, "
                                           f"cache, cache_MiB)")
            name, factor, is_rate = unit
            value = _finite(raw)
            if value is None or value < 0 or (is_rate and value == 0):
                shown = repr(raw) if len(repr(raw)) < 40 else f"{repr(raw)[:37]}..."
                raise InvalidArgumentError(f"{where}: tier {tier!r}: {key} must be a finite "
                                           f"{'positive' if is_rate else 'non-negative'} number, got {shown}")
            if name in values:
                raise InvalidArgumentError(f"{where}: tier {tier!r}: {name} given twice")
            values[name] = 1.0 / (value * factor) if is_rate else value * factor
        out[str(tier)] = values
    return out


def load_tuning_file(path: str, setting: str = "TENSORWIRE_TUNING_FILE") -> dict[str, dict[str, float]]:
    """The file's constants per tier; errors name it as `setting` gave it."""
    where = f"{setting}={path!r}"
    try:
        doc = read_json(os.path.expanduser(path))
    except FileNotFoundError as exc:
        raise InvalidArgumentError(f"{where}: cannot read it ({exc.strerror})") from None
    except BadFile as exc:
        raise InvalidArgumentError(f"{where}: {exc}") from None
    return parse_tuning(doc, where)


_TIER_OF_ONE_WAY = {one_way: tier for tier, one_way in ONE_WAY.items()}


def overridden(name: str, base: Link | None, values: Mapping[str, float],
               origin: str) -> tuple[Link, str] | None:
    """Link `name` with the file's `values` over `base` (None: no constant to keep), and its
    source: 'file' where the file sets α, β and γ, else 'file+<origin>' (`base`'s source); None
    where a constant is left unset (a link of the file's own needs all three)."""
    kept = base or Link(name, **{f: math.nan for f in REQUIRED})
    merged = {f: values.get(f, getattr(kept, f)) for f in FIELDS}
    if any(math.isnan(v) for v in merged.values()):
        return None
    return Link(name, **merged), "file" if all(f in values for f in REQUIRED) else f"file+{origin}"


def apply_overrides(table: LinkTable, overrides: Mapping[str, Mapping[str, float]]) -> LinkTable:
    """The table with the file's constants in place; tiers the file adds are kept too. A tier
    set by the file prices its one-way messages too, unless the file sets those as well (on top
    of the tier's constants where none were measured one way)."""
    links, sources = dict(table.links), dict(table.sources)
    for tier, values in overrides.items():
        of = _TIER_OF_ONE_WAY.get(tier, "")  # a one-way link the probe did not measure: its tier's
        base = links.get(tier) or DEFAULT_LINKS.get(tier) or links.get(of) or DEFAULT_LINKS.get(of)
        done = overridden(tier, base, values, sources.get(tier, "default"))
        if done is not None:  # else a new tier without all three constants: plan reports it as incomplete
            links[tier], sources[tier] = done
    for tier in TIERS:  # a tier the file sets and whose messages one way it does not: its link prices all
        if tier in overrides and ONE_WAY[tier] not in overrides:
            links.pop(ONE_WAY[tier], None)
            sources.pop(ONE_WAY[tier], None)
    return LinkTable(links, sources, table.probe_s, table.setup_s, table.cache_path, dict(table.extra))


def defaults_with_file(path: str) -> LinkTable:
    """The default constants, overridden by the tuning file at `path` (if any): the table of a
    runtime that does not calibrate."""
    return apply_overrides(default_table(), load_tuning_file(path)) if path else default_table()
