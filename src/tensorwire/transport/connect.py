"""Joining the world: every rank's card for a fixed number of store requests, then the wiring
that connects pairs on first use (wiring.py).

Each rank listens on the address it advertises and publishes its card (topology.local_card, plus
the port it listens on and what identifies its process) under its own key; rank 0 reads them
all in one request (Store.multi_get) and publishes them as one compressed blob, which every
other rank reads in one request. So a rank's bootstrap costs 2 store requests (rank 0: 3),
whatever the size of the job, where reading every peer's key cost n - 1; what it reads grows
with the job (the cards: the topology needs them), tens of bytes per rank compressed
(docs/topology.md, Wiring). No connection is made here: the first message to a peer makes it.
A world whose ranks meet group by group (the torch backend's groups on top of another
backend's world) is wired alike (wire_engine), publishing its cards as each group forms.

A rank short of descriptors publishes its error as its card, and every rank raises it (limits.py).
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from .. import auth, limits, log
from ..config import Config, size_text
from ..errors import (
    InvalidArgumentError,
    RendezvousError,
    ResourceError,
    TensorwireError,
    TimeoutError,
    rank_spans,
)
from ..rendezvous.store import Store
from . import shm_budget
from .engine import Engine
from .processes import core_sharers, namespace, process_start
from .wiring import Wiring

_log = log.get("INIT")
_BLOB = "tw/cards"
_GATHER_GRACE_S = 5.0
"""How much longer than its timeout a rank waits for rank 0's blob: rank 0 waits the timeout
for the others' cards first, and then names the ranks that never came."""


def _card_key(rank: int) -> str:
    return f"tw/card/{rank}"


def refuse_to_join(store: Store, rank: int, error: BaseException, absent: Sequence[int] = ()) -> None:
    """Publish `error` as rank `rank`'s card (`store` scoped to the job, as connect_world's):
    the ranks gathering the cards raise it at once, naming this rank, instead of timing out.
    `absent`: other ranks whose cards it publishes too, so that rank 0 stops waiting at once
    where no world can form (rank 0 was started with another world size)."""
    refusal = json.dumps(_refusal(rank, error)).encode()
    for r in (rank, *absent):
        store.set(_card_key(r), refusal)


def _refusal(rank: int, error: BaseException) -> dict[str, Any]:
    """The card of a rank that cannot join: why, as the others raise it (_cannot_join)."""
    return {"error": str(error), "class": type(error).__name__, "rank": rank}


def exchange_cards(rank: int, world_size: int, store: Store, card: dict[str, Any], deadline: float,
                   timeout: float) -> dict[int, dict[str, Any]]:
    """Every rank's card (this one's is `card`), for 2 store requests a rank (rank 0: 3).

    TimeoutError naming the ranks that published nothing in time; where a rank published an
    error instead of its card (it cannot join), an error of that class naming it."""
    store.set(_card_key(rank), json.dumps(card).encode())
    try:
        if rank == 0:
            others = list(range(1, world_size))
            try:
                left = max(deadline - time.monotonic(), 0.001)
                values = store.multi_get([_card_key(r) for r in others], timeout=left)
                blob: Any = [card, *(json.loads(v) for v in values)]
            except TimeoutError:
                blob = {"missing": [r for r in others if not store.check([_card_key(r)])],
                        "refused": store.refusals()}
            raw = json.dumps(blob).encode()
            packed = zlib.compress(raw, 6)
            store.set(_BLOB, packed)
            _log.info("rank 0 gathered %d cards: %d bytes, %d compressed", world_size, len(raw), len(packed))
        else:
            try:
                packed = store.get(_BLOB, timeout=max(deadline - time.monotonic(), 0.001) + _GATHER_GRACE_S)
            except TimeoutError as exc:
                raise TimeoutError(f"rank {rank}: init: rank 0 never published the ranks' addresses (within "
                                   f"{timeout + _GATHER_GRACE_S:g} s): did it fail or exit?") from exc
            blob = json.loads(zlib.decompress(packed))
    except RendezvousError as exc:  # a rank exited (tensorwire run told the store): say why, if it did
        for r in range(world_size):
            if r != rank and store.check([_card_key(r)]):
                cause = _cannot_join(rank, r, json.loads(store.get(_card_key(r))))
                if cause is not None:
                    raise cause from exc
        raise
    if isinstance(blob, dict) and rank in blob["missing"]:
        raise TimeoutError(f"rank {rank}: init: this rank came after rank 0 had waited its {timeout:g} s "
                           f"for it and given up: start every rank within the timeout of the others")
    if isinstance(blob, dict):
        missing = blob["missing"] or ["?"]
        who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {rank_spans(missing, most=12)}"
        refused = f"; {blob['refused']}" if blob.get("refused") else ""
        raise TimeoutError(
            f"rank {rank}: init: {who} never arrived (no address published within {timeout:g} s){refused}; "
            f"is it running with the same WORLD_SIZE={world_size} and store?")
    for r, theirs in enumerate(blob):
        cause = _cannot_join(rank, r, theirs) if r != rank else None
        if cause is not None:
            raise cause
    return dict(enumerate(blob))


def _cannot_join(rank: int, r: int, theirs: dict[str, Any]) -> TensorwireError | None:
    """The error rank `r` published instead of its card, as this rank raises it (None: a card)."""
    if "error" not in theirs:
        return None
    cls = {"ResourceError": ResourceError, "InvalidArgumentError": InvalidArgumentError}.get(
        theirs.get("class", ""), RendezvousError)
    r = theirs.get("rank", r)  # the refusing rank (it may also answer for others)
    why = str(theirs["error"]).removeprefix(f"rank {r}: init: ")
    who = f"rank {r}" if r != rank else f"another process started as rank {r}"
    return cls(f"rank {rank}: init: {who} cannot join: {why}")


def connect_world(rank: int, world_size: int, store: Store | None, cfg: Config, job_id: str,
                  card: dict[str, Any], deadline: float, secret: auth.Secret,
                  serving: int = 0) -> tuple[Engine, dict[int, dict[str, Any]]]:
    """The world's engine (wire_engine) and every rank's card, exchanged through `store`: the
    job's topology costs no exchange of its own. `serving`: store clients this process also
    serves (it hosts the store), whose descriptors it needs too. `store` is None only in a
    world of one, which publishes nothing."""
    def publish(mine: dict[str, Any]) -> dict[int, dict[str, Any]]:
        assert store is not None
        if rank and "error" in mine:  # rank 0 tells the others, as it gathers; this rank raises now
            store.set(_card_key(rank), json.dumps(mine).encode())
            return {rank: mine}
        return exchange_cards(rank, world_size, store, mine, deadline, cfg.timeout)

    return wire_engine(rank, world_size, cfg, job_id, secret, card, publish, serving=serving)


def wire_engine(rank: int, world_size: int, cfg: Config, job_id: str, secret: auth.Secret,
                card: dict[str, Any], publish: Callable[[dict[str, Any]], dict[int, dict[str, Any]]], *,
                serving: int = 0,
                machine: tuple[int, int] | None = None) -> tuple[Engine, dict[int, dict[str, Any]]]:
    """Rank `rank`'s engine, wired to connect to any peer on first use (each connection proving
    `secret`), and the cards `publish` returns for this rank's own: `card` (topology.local_card:
    its address `addr`, host name `host`, machine `machine`, ...) with the port this rank
    listens on and what identifies its process, or why this rank cannot join (which this then
    raises). Every rank's card tells which ranks share this host and its cores; where
    `publish` returns only this rank's (a world whose ranks meet group by group), `machine`
    says it instead: the launcher's count of this host's ranks and this rank's index among
    them (bootstrap.UNKNOWN where it does not say). `serving`: store clients this process
    also serves, whose descriptors it needs too."""
    engine = Engine(rank, world_size, cfg.spin_us, cfg.native)
    if world_size == 1:
        return engine, {rank: card}
    error, wiring = None, None
    try:
        why = f"wiring {world_size} ranks" + (" and serving the store to them" if serving else "")
        limits.ensure_descriptors(limits.wiring_need(world_size) + serving, f"rank {rank}: init", why)
        wiring = Wiring(engine, cfg, job_id, secret, card["addr"], (card["host"], card["machine"]),
                        world_size)
    except TensorwireError as exc:  # no descriptors, a setting the kernel refuses: every rank raises it
        error = exc  # published: the others learn of it from this rank's card
    try:
        shm_free = shm_budget.free_at_start()  # before it publishes: before any segment of the job exists
        if error is not None:
            publish(_refusal(rank, error))
            raise error
        assert wiring is not None
        cards = publish({**card, "port": wiring.port, "loopback": wiring.loopback_port, "netns": wiring.netns,
                         "start": process_start(), "pidns": namespace("pid")})
        engine.wiring = wiring
        wiring.learn(cards)
        local, share = _settle(engine, rank, world_size, cfg, card, cards, machine, shm_free)
        wiring.start(share, max(local, 1))
    except BaseException:
        if wiring is not None:
            wiring.close()
        raise
    _log.info("rank %d listening on %s:%d (host %s); %s peer(s) on this host, rings grow up to %s within %s "
              "of /dev/shm; pairs connect on first use", rank, card["addr"], wiring.port, card["host"],
              local - 1 if local > 0 else "unknown", size_text(wiring.rings.ring_max),
              size_text(share))
    if len(cards) > 1 and _log.isEnabledFor(20):
        kinds = {r: engine.planned_kind(r) for r in cards if r != rank}
        _log.info("rank %d wired: shm peers %s, tcp peers %s", rank,
                  [r for r, k in kinds.items() if k == "shm"], [r for r, k in kinds.items() if k == "tcp"])
    return engine, cards


def _settle(engine: Engine, rank: int, world_size: int, cfg: Config, card: dict[str, Any],
            cards: dict[int, dict[str, Any]], machine: tuple[int, int] | None, free: int) -> tuple[int, int]:
    """Fit `engine` to the ranks that share this machine's cores (before the wiring offers
    streams); (ranks on this host, or UNKNOWN; this rank's share of `free` /dev/shm for its
    rings). The arguments are wire_engine's."""
    if machine is None:
        where = (card["host"], card["machine"])
        local = sum(1 for c in cards.values() if (c["host"], c["machine"]) == where)
        mates = sorted(r for r, c in cards.items() if c["machine"] == card["machine"])
        engine.adapt_to_machine(len(mates), mates.index(rank), cfg.bind, cfg.socket_threads, cfg.nsocks,
                                core_sharers(cards, rank))
        if cfg.transport == "tcp" or local == 1:
            return local, 0
        world = world_size if local == world_size else 0  # the world group will want a one-shot segment too
        return local, shm_budget.ring_share(free, local, world, cfg.direct_slot(world_size))
    local, index = machine
    if local > 0:
        engine.adapt_to_machine(local, index, cfg.bind, cfg.socket_threads, cfg.nsocks)
    # the peers on this host are learnt group by group: rings for them, whoever they turn out to be
    return local, 0 if cfg.transport == "tcp" else shm_budget.ring_share(free, max(local, 1))
