"""torch.profiler events for the backend's calls, as c10d's own backends show theirs
(`gloo:all_reduce`): `tensorwire:all_reduce` over a call, and over an async call until its
Work completes (DDP's bucket all-reduces overlap backward so). While no profiler runs, a call
pays one check and nothing is recorded."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

profiling = torch._C._autograd._profiler_enabled
"""Whether a profiler runs: what the backend's small-call fast paths look at before they go
their way unrecorded (a wrapper's frame would cost them a tenth)."""
_Record = getattr(torch._C._profiler, "_RecordFunctionFast", None)  # torch >= 2.2

Method = TypeVar("Method", bound=Callable[..., Any])


def shown_to_profiler(what: str) -> Callable[[Method], Method]:
    """A ProcessGroup method that records `tensorwire:<what>` while a profiler runs: until
    it returns, or until its Work completes where that Work says when (`end_record_when_done`)."""
    def decorate(method: Method) -> Method:
        if _Record is None:
            return method
        name = f"tensorwire:{what}"

        @functools.wraps(method)
        def shown(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not profiling():
                return method(self, *args, **kwargs)
            record = _Record(name)
            record.__enter__()
            try:
                work = method(self, *args, **kwargs)
            except BaseException:
                record.__exit__(None, None, None)
                raise
            until_done = getattr(work, "end_record_when_done", None)
            if until_done is None:
                record.__exit__(None, None, None)
            else:
                until_done(record)
            return work

        return shown  # type: ignore[return-value]
    return decorate
