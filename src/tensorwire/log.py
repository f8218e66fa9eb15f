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

SUBSYSTEMS = ("INIT", "COLL", "P2P", "TRANSPORT", "TUNING", "GRAPH", "ENV", "LAUNCH", "BENCH", "AUTH")
LEVELS = {"VERSION": logging.WARNING, "WARN": logging.WARNING, "INFO": logging.INFO,
          "TRACE": logging.DEBUG, "DEBUG": logging.DEBUG}
_configured = False


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
    """Attach a stderr handler according to TENSORWIRE_DEBUG; idempotent."""
    global _configured
    if _configured:
        return
    _configured = True
    level_name = os.environ.get("TENSORWIRE_DEBUG", "").strip().upper()
    root = logging.getLogger("tensorwire")
    if not level_name:
        return
    root.setLevel(LEVELS.get(level_name, logging.INFO))
    handler = logging.StreamHandler()
    host = socket.gethostname()
    handler.setFormatter(logging.Formatter(
        f"{host}:%(process)d:rank %(twrank)s [tensorwire %(levelname)s %(name)s] %(message)s"))
    handler.addFilter(_rank_filter)
    subsys = {s.strip().upper() for s in os.environ.get("TENSORWIRE_DEBUG_SUBSYS", "ALL").split(",")}
    if "ALL" not in subsys:
        excluded = {s[1:] for s in subsys if s.startswith("^")}
        included = {s for s in subsys if not s.startswith("^")} or set(SUBSYSTEMS)
        wanted = included - excluded
        handler.addFilter(lambda r: r.name.rsplit(".", 1)[-1] in wanted)
    root.addHandler(handler)


def get(subsys: str) -> logging.Logger:
    return logging.getLogger(f"tensorwire.{subsys}")


def warn(message: str, category: type[Warning]) -> None:
    """A warning users see without configuring anything (Python's warnings, pointed at their own
    code's frame), also in tensorwire's INFO log (not WARN: it would be shown twice)."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: the caller of this function
    while frame is not None and frame.f_globals.get("__name__", "").startswith("tensorwire"):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
    logging.getLogger("tensorwire.INIT").info("%s", message)
