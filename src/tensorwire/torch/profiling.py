"""torch.profiler events for the backend's calls, as c10d's own backends show theirs
(`gloo:all_reduce`): `tensorwire:all_reduce` over a call, and over an async call until its
Work completes (DDP's bucket all-reduces overlap backward so). While no profiler runs, a call
pays one check and nothing is recorded."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.autograd.profiler import record_function

profiling = torch._C._autograd._profiler_enabled
"""Whether a profiler runs: what the backend's small-call fast paths look at before they go
their way unrecorded (a wrapper's frame would cost them a tenth)."""

Method = TypeVar("Method", bound=Callable[..., Any])


def shown_to_profiler(what: str) -> Callable[[Method], Method]:
    """A ProcessGroup method that records `tensorwire:<what>` while a profiler runs: until it
    returns, or until its Work completes where that is later (torch ends the record then,
    with the caller's profiler state, on whatever thread completes it)."""
    def decorate(method: Method) -> Method:
        name = f"tensorwire:{what}"

        @functools.wraps(method)
        def shown(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not profiling():
                return method(self, *args, **kwargs)
            with record_function(name) as record:
                work = method(self, *args, **kwargs)
                if not work.is_completed():
                    record._call_end_callbacks_on_future(work.get_future())
            return work

        return shown  # type: ignore[return-value]
    return decorate
