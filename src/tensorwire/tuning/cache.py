"""The per-host calibration cache: one JSON file of link constants per topology and environment.

The cache lives in TENSORWIRE_CACHE_DIR (default $XDG_CACHE_HOME/tensorwire or
~/.cache/tensorwire), one file per key (cache_key). An entry is read only if it is of this
probe's version, trusted (measured without foreign load) and younger than
TENSORWIRE_CACHE_MAX_AGE; otherwise the job measures again (calibrate.at_init).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import socket
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from .. import log
from ..algorithms.prices import Link
from ..errors import InvalidArgumentError, TensorwireWarning
from ..trusted_paths import untrusted
from .tuning_file import FIELDS, BadFile, parse_tuning, read_json

_log = log.get("TUNING")

PROBE_VERSION = 30
"""Bump when the probe changes what it measures: older cache entries are then ignored."""


def cache_dir(configured: str = "") -> str:
    if configured:
        return os.path.expanduser(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tensorwire")


def host_hash(hostname: str | None = None) -> int:
    """63 bits of the host name: enough to tell hosts apart, and it fits an int64 slot."""
    raw = hashlib.sha256((hostname or socket.gethostname()).encode()).digest()
    return int.from_bytes(raw[:8], "little") >> 1


def environment_digest(cfg: Any, cores: int) -> int:
    """What changes a rank's measurements besides the topology: its usable cores, the kernel,
    the Python and numpy it runs (the interpreter and the kernels are most of every α and γ),
    and the settings that shape how it waits and what it moves (spinning, binding, ring and
    slot sizes)."""
    text = "|".join(map(str, (cores, platform.release(), *sys.version_info[:2],
                              ".".join(np.__version__.split(".")[:2]), cfg.spin_us, cfg.bind,
                              cfg.shm_ring_bytes, cfg.direct_bytes)))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def cache_key(hosts: list[int], tiers: list[str], world_size: int,
              tcp: Mapping[str, object] | None = None, environments: list[int] | None = None) -> str:
    """Constants are cached per hosts, tiers and world size, per TCP setting that differs from
    the defaults (`tcp`: Config.tcp_changed; a TCP link's α and β are those settings'), and
    per environment of the ranks (environment_digest: a core more or less, another kernel,
    Python or numpy measures another machine)."""
    fields: dict[str, object] = {"v": PROBE_VERSION, "hosts": sorted(set(hosts)), "tiers": sorted(tiers),
                                 "world_size": world_size, **(tcp or {})}
    if environments:
        fields["env"] = sorted(set(environments))
    text = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_path(directory: str, key: str) -> str:
    return os.path.join(directory, f"links-{key}.json")


def probed_cores(entry: Mapping[str, Any], cfg: Any, cores: int) -> int | None:
    """The usable cores a job on this host alone, with `cfg`'s settings, had to have for
    `entry` (cached_entries) to be its own: `cores` where a job here would use it (its key is
    the one such a job computes, cache_key over environment_digest), another count where only
    the cores differ (a job pinned to fewer), None where other settings, a kernel, Python or
    numpy did, or no job wrote it (for `tensorwire plan`, which says so)."""
    name, tiers, n = os.path.basename(str(entry.get("path"))), entry.get("tiers"), entry.get("world_size")
    if not isinstance(tiers, list) or not isinstance(n, int):
        return None
    for count in dict.fromkeys([cores, *range(1, max(cores, os.cpu_count() or 1) + 1)]):
        if cache_path("", cache_key([host_hash()], tiers, n, cfg.tcp_changed(),
                                    [environment_digest(cfg, count)])) == name:
            return count
    return None


_WARNED: set[str] = set()  # cache directories named in a warning (once a process)


def trusted(directory: str) -> bool:
    """Whether the cache in `directory` may be used: it (or, not made yet, where it will be) and
    every directory above are this user's to trust (trusted_paths.untrusted), else another user
    could replace or remove its entries. Where not, a warning (TensorwireWarning: every job then
    measures, which an operator should know) says why, and the job measures without the cache."""
    existing = os.path.abspath(directory)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    try:
        found = untrusted(existing)
    except OSError as exc:
        found = (str(exc.filename), f"cannot be looked at ({exc.strerror})")
    if found is None:
        return True
    if directory not in _WARNED:
        _WARNED.add(directory)
        log.warn(f"not using the calibration cache in {directory}: {found[0]} {found[1]}; measuring "
                 f"without it (TENSORWIRE_CACHE_DIR chooses another directory)", TensorwireWarning)
    return False


def load_entry(path: str) -> dict[str, Any] | None:
    """The JSON object of one cache file, None where there is none; BadFile for anything else
    in its place (tuning_file.read_json: no link followed, this user's or root's)."""
    try:
        doc = read_json(path, follow=False, own=True)
    except FileNotFoundError:
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("links"), dict):
        raise BadFile("not a JSON object with a links object")
    return doc


def read_cache(path: str, tiers: list[str], max_age: float = math.inf) -> tuple[dict[str, Link], dict] | None:
    """The cached links of every tier in `tiers` and the entry they come from, or None: missing,
    of another probe version, partial, older than `max_age` seconds, or measured under load
    (not trusted, see at_init); then it is measured again. A file that is no entry at all is
    named in a TensorwireWarning (the job measures, at init's cost, until it is replaced) and
    measured over (write_cache replaces it)."""
    if not trusted(os.path.dirname(path)):
        return None
    try:
        doc = load_entry(path)
    except BadFile as exc:
        log.warn(f"ignoring the calibration cache file {path}: {exc}; measuring again", TensorwireWarning)
        return None
    if doc is None or doc.get("version") != PROBE_VERSION:
        return None
    try:
        links = parse_tuning(doc["links"], path)
        out = {t: Link(t, **links[t]) for t in tiers}
        age = time.time() - float(doc["created"])
    except (ValueError, KeyError, TypeError, OverflowError, InvalidArgumentError):
        return None
    if not doc.get("trusted", False):
        _log.info("re-measuring: %s was measured under load (other processes took %s cores beyond those "
                  "the job left idle)", path, doc.get("foreign_cores", "?"))
        return None
    if not 0 <= age <= max_age:
        _log.info("re-measuring: %s is %.0f s old (TENSORWIRE_CACHE_MAX_AGE: %.0f s)", path, age, max_age)
        return None
    return out, doc


def write_cache(path: str, links: dict[str, Link], meta: dict[str, Any]) -> None:
    """Atomically (rename) write one entry; a cache that cannot be written is a logged warning."""
    doc = {"version": PROBE_VERSION, **meta,
           "links": {t: {f: getattr(link, f) for f in FIELDS if f != "cache" or link.cache}
                     for t, link in links.items()}}
    if not trusted(os.path.dirname(path)):
        return
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".links-", dir=os.path.dirname(path))
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:
        _log.warning("cannot write the calibration cache %s (TENSORWIRE_CACHE_DIR): %s", path, exc)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def cached_entries(directory: str) -> list[dict[str, Any]]:
    """Every readable cache entry of `directory`, newest first (for `tensorwire plan`)."""
    out = []
    if not trusted(directory):
        return []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        if not (name.startswith("links-") and name.endswith(".json")):
            continue
        path = os.path.join(directory, name)
        try:
            doc = load_entry(path)
            if doc is not None and doc.get("version") == PROBE_VERSION:
                doc["links"] = parse_tuning(doc["links"], path)
                doc["path"], doc["created"] = path, float(doc.get("created", 0))
                out.append(doc)
        except (ValueError, KeyError, TypeError, OverflowError, InvalidArgumentError):  # BadFile among them
            continue
    return sorted(out, key=lambda d: d["created"], reverse=True)
