"""Agreement on the failed members of a group, among its survivors (for shrink).

Every member that is alive ends with the same set, even if more members die meanwhile, in two
rounds of point-to-point messages on a context that nothing else uses:

1. reports: every member sends the set of members it knows are lost (and a number of its own,
   whose maximum the agreement also gives, where nobody failed) to every other member and
   waits for every member's report, or for that member's loss. Its candidate is the union.
2. decision (the hierarchical consensus of Cachin, Guerraoui and Rodrigues, *Introduction to
   Reliable and Secure Distributed Programming*, 5.1): member i waits for the decision of every
   lower member, or for its loss, and adopts that of the highest one heard from (else keeps its
   candidate); it then sends its decision to every higher member.

Agreement needs a failure detector that never suspects a live member: here a member is lost
when its connection closes, which the kernel does when its process ends (or when it calls
destroy()), or fails, when its host stopped acknowledging anything for TENSORWIRE_PEER_TIMEOUT
(keepalive answers come from the peer's kernel: a live process is never suspected, however
busy or stopped). The lowest member that stays alive is heard by every higher one, and each of those
adopts from a member at or above it that, by induction, decided alike. See docs/design/shrink.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from ..errors import AbortedError, PeerLostError, TimeoutError
from .engine import Engine
from .requests import P2P_SEQ, RecvRequest, Request
from .wire import P2P_FINGERPRINT, Header, Kind

_REPORT, _DECIDE = 1, 2  # tags of the two rounds
_NOTE_BYTES = 8  # a report's number, after its mask
SHRINK_HINT = ("every surviving member must call shrink() (is one blocked outside tensorwire, or in a call "
               "of another group?); calling shrink() again goes on where this call stopped")


class Agreement:
    """One agreement on the failed `members` (world ranks), on context `ctx` (used by nothing
    else): this rank's report is sent and every message it needs posted when it is made.

    `decide` can be called again after a TimeoutError: it goes on where it stopped, with its
    messages still posted and its context live, so a member that retries a timed-out shrink
    meets the others' first try (a new agreement would wait on a context no one else uses).
    `note`: this rank's number; `note` after `decide` is the largest of the reports'. `hint`:
    what a timed-out member should do, for the TimeoutError."""

    def __init__(self, engine: Engine, members: Sequence[int], ctx: int, what: str, note: int = 0,
                 hint: str = SHRINK_HINT) -> None:
        self.engine, self.members, self.ctx, self.what = engine, list(members), ctx, what
        self.note, self.hint = note, hint
        me, n = engine.rank, len(members)
        engine.poll_peers()  # a peer that died before this call is known now
        self.known = {w for w in members if w in engine.lost}
        others = [w for w in members if w != me]
        _send(engine, [w for w in others if w not in self.known], ctx, _REPORT,
              _report(self.known, members, note), what)
        self.reports = {w: _recv(engine, w, ctx, _REPORT, n + _NOTE_BYTES, what) for w in others}
        self.lower = self.members[:self.members.index(me)]
        self.decisions = {w: _recv(engine, w, ctx, _DECIDE, n, what) for w in self.lower}

    def decide(self, deadline: float, limit: float) -> frozenset[int]:
        """The set of failed members every surviving member decides alike. TimeoutError naming
        the members that neither answered nor failed by `deadline` (perf_counter time), after
        which `decide` may be called again."""
        engine, members, ctx, what = self.engine, self.members, self.ctx, self.what
        me = engine.rank
        try:
            _wait(engine, self.reports, ctx, deadline, what, limit, "its report of the failed ranks",
                  self.hint)
            candidate = set(self.known)
            for w, req in self.reports.items():
                if req.error is not None:
                    candidate.add(w)
                else:
                    candidate |= _members(req.dst[:len(members)], members)
                    self.note = max(self.note, int(req.dst[len(members):].view(np.int64)[0]))
            _wait(engine, self.decisions, ctx, deadline, what, limit, "its decision", self.hint)
        except TimeoutError:
            raise  # the agreement stays as it stands, for the next try
        except BaseException:
            engine.retire(ctx, AbortedError(f"rank {me}: {what} ended"))
            raise
        heard = [w for w in self.lower if self.decisions[w].error is None]
        failed = _members(self.decisions[heard[-1]].dst, members) if heard else frozenset(candidate)
        higher = members[members.index(me) + 1:]
        try:
            _send(engine, [w for w in higher if w not in engine.lost], ctx, _DECIDE, _mask(failed, members),
                  what)
        finally:
            engine.retire(ctx, AbortedError(f"rank {me}: {what} ended"))
        if me in failed:
            raise PeerLostError(f"rank {me}: {what}: the other survivors lost their connection to this rank "
                                f"and count it as failed (failed ranks: {sorted(failed)})", peer=me)
        return failed

    def abandon(self, error: BaseException) -> None:
        """Give up after a timed-out `decide` (a renewal has one try): the members still in
        this agreement, or yet to enter it, fail with `error` at once instead of each waiting
        out its own timeout for this rank."""
        self.engine.abort_group(self.ctx, 0, self.members, error)
        self.engine.retire(self.ctx, error)


def _mask(ranks: Iterable[int], members: Sequence[int]) -> np.ndarray:
    mask = np.zeros(len(members), dtype=np.uint8)
    index = {w: i for i, w in enumerate(members)}
    for w in ranks:
        mask[index[w]] = 1
    return mask


def _report(lost: Iterable[int], members: Sequence[int], note: int) -> np.ndarray:
    """A report: the mask of the members this rank knows are lost, then its number."""
    return np.concatenate([_mask(lost, members), np.array([note], dtype=np.int64).view(np.uint8)])


def _members(mask: np.ndarray, members: Sequence[int]) -> frozenset[int]:
    return frozenset(members[i] for i in np.flatnonzero(mask).tolist())


def _send(engine: Engine, peers: Sequence[int], ctx: int, tag: int, payload: np.ndarray, what: str) -> None:
    """Best effort, never waited for: a send to a member that died meanwhile fails, which the
    agreement tolerates; one the channel could not take at once moves in the background."""
    header = Header(Kind.P2P, ctx, 0, tag, payload.nbytes, P2P_FINGERPRINT)
    for peer in peers:
        engine.watch_in_background(engine.isend(peer, header, payload, what))


def _recv(engine: Engine, peer: int, ctx: int, tag: int, n: int, what: str) -> RecvRequest:
    header = Header(Kind.P2P, ctx, 0, tag, n, P2P_FINGERPRINT)
    return engine.irecv(peer, header, np.zeros(n, dtype=np.uint8), None, what)


def _wait(engine: Engine, reqs: Mapping[int, Request], ctx: int, deadline: float, what: str, limit: float,
          awaited: str, hint: str) -> None:
    """Until every receive has its message or has failed with its sender's loss."""
    try:
        engine.wait(list(reqs.values()), deadline=deadline, ctx=ctx, seq=P2P_SEQ, watch=(), what=what)
    except TimeoutError:
        missing = ", ".join(str(w) for w, req in reqs.items() if not req.done)
        raise TimeoutError(
            f"rank {engine.rank}: {what}: rank(s) {missing} did not send {awaited} within {limit:g} s "
            f"though their connections are alive: {hint}") from None
    except PeerLostError:
        pass  # a member died before it answered: the agreement counts it as failed
    for req in reqs.values():
        if req.error is not None and not isinstance(req.error, PeerLostError):
            raise req.error
