"""The one exception hierarchy of tensorwire.

Every message names the rank that raised it and, where there is one, the collective, its
sequence number and what was wrong, so a log line from any rank is enough to find the fault.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Iterator, Sequence
from typing import NamedTuple, TypeVar

CLEAN_GROUP = ("shrink() makes a clean one (under torch.distributed: destroy_process_group(), then "
               "init_process_group())")
"""How a program goes on after its group was aborted, as the messages that say so end."""


class Relayed(NamedTuple):
    """How an error came from a peer's abort notice (transport/failures.py)."""

    origin: int  # the rank that reported it first
    message: str  # its message there
    text: str  # the error's text as this rank made it (retold later: named already)
    receiver: int  # this rank, which received it


class TensorwireError(RuntimeError):
    """Base of every error tensorwire raises on purpose."""

    relayed: Relayed | None = None
    """Set where the error is a peer's report, passed on as it was reported (its first
    reporter named once)."""


class NotInitializedError(TensorwireError):
    """A call needs `tensorwire.init()` first."""


class InvalidArgumentError(TensorwireError, ValueError):
    """Bad input detected locally before anything was sent (rank, root, buffer, op/dtype)."""


class TimeoutError(TensorwireError, builtins.TimeoutError):  # noqa: A001 - deliberate, see hierarchy
    """A blocking call did not finish within its timeout; the message names whom it waited for."""


class PeerLostError(TensorwireError, ConnectionError):
    """A peer's connection closed or its process vanished while we needed it."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


_E = TypeVar("_E", bound=BaseException)


def retold(exc: _E, message: str) -> _E:
    """An error of `exc`'s class and attributes (PeerLostError's peer) with another message."""
    told = type(exc)(message)
    told.__dict__.update(exc.__dict__)
    return told


@contextlib.contextmanager
def named(rank: int, call: str) -> Iterator[None]:
    """A TensorwireError raised below (the store, an interface filter), which knows neither the
    rank nor the call, retold as 'rank 3: init: ...'; one that names a rank already passes."""
    try:
        yield
    except TensorwireError as exc:
        if str(exc).startswith("rank "):
            raise
        raise retold(exc, f"rank {rank}: {call}: {exc}") from exc


def in_call(exc: TensorwireError, where: str) -> TensorwireError:
    """`exc` with the call it ended named after its rank ('rank 3: all_reduce #12 on group
    world: lost rank 2: ...'): an error raised below the call (a lost peer, a sub-group's
    phase) knows the connection or phase, not the call the caller made. The same object where
    it names `where` already (it came with a peer's abort, or was named below). A peer's
    report of another call (its `relayed`: origin, message, text, the rank that received it)
    is quoted whole after this rank's call: it starts with the reporter's rank and call."""
    text = str(exc)
    if where in text:
        return exc
    relayed = exc.relayed
    if relayed is not None and relayed.text == text:  # (not once retold: named already)
        return retold(exc, f"rank {relayed.receiver}: {where}: {text}")
    rank, _, rest = text.partition(": ") if text.startswith("rank ") else ("", "", text)
    return retold(exc, f"{rank}: {where}: {rest}" if rank else f"{where}: {rest}")


def call_prefix(rank: int | None, collective: str | None) -> str:
    """'rank 3: all_reduce: ' (either part where known, '' with neither): how a message about
    a caller's argument starts (a group's refusal then names the call: CallQueue.refuse)."""
    parts = []
    if rank is not None:
        parts.append(f"rank {rank}")
    if collective:
        parts.append(collective)
    return ": ".join(parts) + ": " if parts else ""


def _argument_error(exc: BaseException, rank: int) -> tuple[str, str] | None:
    """(the call, the rest) of an argument error of a collective ('rank 3: all_reduce: ...');
    None where it is not one."""
    what, sep, rest = str(exc).removeprefix(f"rank {rank}: ").partition(": ")
    return (what, rest) if str(exc).startswith(f"rank {rank}: ") and sep and what.isidentifier() else None


def called(exc: BaseException, rank: int) -> str:
    """The call an argument error of a collective names ('all_reduce'), else 'a call'."""
    parts = _argument_error(exc, rank)
    return "a call" if parts is None else parts[0]


def naming_call(exc: BaseException, rank: int, number: int, group: str) -> BaseException:
    """An argument error of a collective ('rank 3: all_reduce: ...') with the call it refused
    named as every error names it ('rank 3: all_reduce #12 on group world: ...')."""
    parts = _argument_error(exc, rank)
    if parts is None:
        return exc
    return retold(exc, f"rank {rank}: {parts[0]} #{number} on group {group}: {parts[1]}")


class CollectiveMismatchError(TensorwireError):
    """Ranks disagree on which collective they call, or on its count, dtype, op or root."""


class RendezvousError(TensorwireError):
    """Bootstrapping failed: store unreachable, port in use, wrong world size, duplicate rank."""


class StoreLostError(RendezvousError):
    """The connection to the store broke: its server closed it (`closed`), or went silent."""

    def __init__(self, message: str, closed: bool = False) -> None:
        super().__init__(message)
        self.closed = closed


class AuthenticationError(RendezvousError):
    """Another process could not prove that it knows the job's secret (a different secret, or
    not one of this job's processes): see docs/security.md."""


class AbortedError(TensorwireError):
    """The group was aborted (by an error detected on another rank, or by `abort()`)."""


class ResourceError(TensorwireError):
    """A limit of the system ran out: file descriptors, ports or memory; the message names the
    limit, what it is set to and how to raise it."""


class CudaDriverError(TensorwireError):
    """A CUDA driver call failed (the message carries the driver's own name for the error)."""


class TensorwireWarning(UserWarning):
    """Something works, but worse than it could or than the program may assume: tensorwire fell
    back (a /dev/shm too small for its rings), ignores a setting it does not know, or runs a job
    unauthenticated. Shown once; silence with `warnings.filterwarnings("ignore", category=...)`."""


class UnauthenticatedJobWarning(TensorwireWarning):
    """A job that spans hosts runs without a secret: anyone who reaches its ports can join it
    (and run code on its ranks through the object collectives)."""


def rank_spans(ranks: Sequence[int], most: int = 6) -> str:
    """Ranks as runs, for names and errors: [0, 1, 2, 3, 8] as '0-3,8'; past `most` runs, '...'."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = [str(a) if a == b else f"{a}-{b}" for a, b in runs[:most]]
    return ",".join(text) + (",..." if len(runs) > most else "")
