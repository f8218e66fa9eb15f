"""NCCL-style debug logging: TENSORWIRE_DEBUG=WARN|INFO|TRACE, TENSORWIRE_DEBUG_SUBSYS=INIT,COLL,...

Subsystems are child loggers of `tensorwire` (tensorwire.INIT, tensorwire.TRANSPORT, ...), so the
standard `logging` machinery also works for users who configure it themselves.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import warnings
from types import FrameType

SUBSYSTEMS = ("INIT", "COLL", "P2P", "TRANSPORT", "TUNING", "GRAPH", "ENV", "AUTH")
LEVELS = {"VERSION": logging.WARNING, "WARN": logging.WARNING, "INFO": logging.INFO,
          "TRACE": logging.DEBUG, "DEBUG": logging.DEBUG}
PER_CALL = logging.DEBUG
"""The level of the COLL and P2P logs' line per call (TRACE): at INFO, whose default subsystems
are all of them, one line per call would bury the decisions taken once."""
_configured = False
_per_call = False  # TENSORWIRE_DEBUG asks for TRACE (or DEBUG)


def per_call(logger: logging.Logger) -> bool:
    """Whether `logger` (COLL, P2P) has its line per call: TENSORWIRE_DEBUG=TRACE and the
    subsystem on. Not a program's own logging at DEBUG, which tensorwire's loggers inherit: that
    would take every call off its fast paths."""
    return _per_call and logger.isEnabledFor(PER_CALL)


def subsystems(spec: str) -> set[str]:
    """The subsystems TENSORWIRE_DEBUG_SUBSYS `spec` names: 'INIT,COLL', 'ALL,^COLL', '^GRAPH'
    (all but GRAPH); a ValueError for an unknown name or one that leaves none ('^ALL')."""
    names = [s.strip().upper() for s in spec.split(",") if s.strip()] or ["ALL"]
    unknown = [s for s in names if s.lstrip("^") not in (*SUBSYSTEMS, "ALL")]
    if unknown:
        raise ValueError(f"unknown {', '.join(unknown)} (known: ALL, {', '.join(SUBSYSTEMS)}; ^X excludes X)")
    included = {s for s in names if not s.startswith("^")}
    excluded = {s[1:] for s in names if s.startswith("^")}
    wanted = set(SUBSYSTEMS) if "ALL" in included or not included else included
    wanted = set() if "ALL" in excluded else wanted - excluded
    if not wanted:
        raise ValueError("it leaves no subsystem to log (unset TENSORWIRE_DEBUG to log nothing)")
    return wanted


class _RankFilter(logging.Filter):
    rank = "?"

    def filter(self, record: logging.LogRecord) -> bool:
        record.twrank = self.rank
        return True


_rank_filter = _RankFilter()
logging.getLogger("tensorwire").addHandler(logging.NullHandler())  # silent unless configured


def set_rank(rank: int | str) -> None:
    """Stamp later log lines with this process's world rank (or role: `launcher`)."""
    _rank_filter.rank = str(rank)


def configure() -> None:
    """Attach a stderr handler according to TENSORWIRE_DEBUG; idempotent. The subsystems left
    out get a level above every message, so that `isEnabledFor` tells exactly what is logged
    (what the per-call lines' switch reads: PER_CALL)."""
    global _configured, _per_call
    if _configured:
        return
    _configured = True
    level_name = os.environ.get("TENSORWIRE_DEBUG", "").strip().upper()
    root = logging.getLogger("tensorwire")
    if not level_name:
        return
    root.setLevel(LEVELS.get(level_name, logging.INFO))
    _per_call = root.level <= PER_CALL
    handler = logging.StreamHandler()
    host = socket.gethostname()
    handler.setFormatter(logging.Formatter(
        f"{host}:%(process)d:rank %(twrank)s [tensorwire %(levelname)s %(name)s] %(message)s"))
    handler.addFilter(_rank_filter)
    try:
        wanted = subsystems(os.environ.get("TENSORWIRE_DEBUG_SUBSYS", ""))
    except ValueError:  # Config.from_env fails init naming it
        wanted = set(SUBSYSTEMS)
    for name in SUBSYSTEMS:
        if name not in wanted:
            get(name).setLevel(logging.CRITICAL + 1)
    root.addHandler(handler)


def get(subsys: str) -> logging.Logger:
    return logging.getLogger(f"tensorwire.{subsys}")


def warn(message: str, category: type[Warning]) -> None:
    """A warning users see without configuring anything (Python's warnings, pointed at their own
    code's frame), also in tensorwire's INFO log (not WARN: it would be shown twice)."""
    frame: FrameType | None = sys._getframe(1)
    level = 2  # stacklevel 2: the caller of this function
    while frame is not None and frame.f_globals.get("__name__", "").startswith("tensorwire"):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
    logging.getLogger("tensorwire.INIT").info("%s", message)
