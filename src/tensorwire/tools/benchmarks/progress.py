"""A progress bar on stderr for long sweeps, fed by the ranks through a file.

Rank 0 of every measured job appends one line per finished cell to the file named by
TENSORWIRE_BENCH_PROGRESS; the process the user started (the launcher, or the `--compare`
driver) follows the file and draws the bar. The bar never touches stdout, so the tables stay
parseable. It uses `rich` when installed (`pip install 'tensorwire[bench]'`) and plain
`[k/N] ...` lines otherwise or when stderr is not a terminal (only when forced with
`--progress on`: `auto` shows it on a terminal only).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from types import TracebackType
from typing import Any, TextIO

PROGRESS_ENV = "TENSORWIRE_BENCH_PROGRESS"
_PLAIN_EVERY_S = 5.0


def note(what: str) -> None:
    """Record a finished cell (no-op unless a progress file was handed down)."""
    path = os.environ.get(PROGRESS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(what.replace("\n", " ") + "\n")


def wanted(choice: str, stream: TextIO | None = None) -> bool:
    """`--progress on|off|auto`: auto means stderr is a terminal."""
    if choice in ("on", "off"):
        return choice == "on"
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)())


class Bar:
    """`with Bar(total, enabled) as bar: bar.update(done, text)`; nothing at all when disabled."""

    def __init__(self, total: int, enabled: bool, title: str = "tensorwire bench",
                 stream: TextIO | None = None) -> None:
        self.total, self.enabled, self.title = max(1, total), enabled, title
        self.stream = sys.stderr if stream is None else stream
        self._rich: Any = None
        self._task: Any = None
        self._last_plain = 0.0
        self._done = 0

    def __enter__(self) -> Bar:
        if not self.enabled:
            return self
        if self.stream.isatty():
            try:
                from rich.console import Console
                from rich.progress import (
                    BarColumn,
                    MofNCompleteColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                )
            except ImportError:
                pass
            else:
                self._rich = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("{task.fields[what]}"),
                                      console=Console(file=self.stream), transient=True,
                                      redirect_stdout=False, redirect_stderr=False)
                self._rich.start()
                self._task = self._rich.add_task(self.title, total=self.total, what="")
        return self

    def update(self, done: int, what: str = "") -> None:
        if not self.enabled or done == self._done and not what:
            return
        self._done = min(done, self.total)
        if self._rich is not None:
            self._rich.update(self._task, completed=self._done, what=what)
            return
        now = time.monotonic()
        if now - self._last_plain >= _PLAIN_EVERY_S or self._done == self.total:
            self._last_plain = now
            print(f"[{self.title}] {self._done}/{self.total} {what}".rstrip(), file=self.stream, flush=True)

    def log(self, text: str) -> None:
        """A status line on stderr (above the bar when there is one), shown even without a bar."""
        if self._rich is not None:
            self._rich.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._rich is not None:
            self._rich.stop()


class Follower:
    """Follows a progress file in a thread and moves `bar` by `base` + lines written so far."""

    def __init__(self, path: str, bar: Bar, base: int = 0, label: str = "") -> None:
        self.path, self.bar, self.base, self.label = path, bar, base, label
        self.lines = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tw-bench-progress", daemon=True)

    def _poll(self) -> None:
        try:
            with open(self.path) as f:
                lines = f.read().splitlines()
        except OSError:
            return
        if len(lines) != self.lines:
            self.lines = len(lines)
            self.bar.update(self.base + self.lines, f"{self.label}{lines[-1]}")

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self._poll()

    def __enter__(self) -> Follower:
        if self.bar.enabled:
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.bar.enabled:
            self._stop.set()
            self._thread.join()
            self._poll()
