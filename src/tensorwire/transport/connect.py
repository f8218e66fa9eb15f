"""Wiring the world: one socket per pair of ranks, plus shared-memory rings between local pairs.

Each rank listens on the address it advertises, publishes it in the store, connects to every
lower rank and accepts every higher one, each connection authenticated (`handshake.py`).
Pairs on the same host then offer each other a ring;
shared memory is used only if both sides could map the other's segment and read its nonce,
so two "hosts" that merely share a hostname but not /dev/shm fall back to TCP by themselves,
and so do pairs whose rings /dev/shm has no room for (shm_budget sizes them first). A rank
short of descriptors says so in place of its address, and every rank raises it (limits.py).
"""

from __future__ import annotations

import errno
import functools
import json
import os
import socket
import struct
import time
from typing import NamedTuple

from .. import auth, limits, log
from ..config import Config
from ..errors import RendezvousError, ResourceError, TimeoutError
from ..rendezvous.store import Store
from . import cma, shm_budget
from .engine import Engine
from .handshake import connect_pairs
from .shm import Ring, ShmChannel
from .tcp import SocketStream, TcpChannel, congestion_of, tune_socket

_log = log.get("INIT")


def _send_msg(sock: socket.socket, obj: object) -> None:
    raw = json.dumps(obj).encode()
    sock.sendall(struct.pack("<I", len(raw)) + raw)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection during setup")
        buf += chunk
    return bytes(buf)


_MAX_SETUP_MSG = 1 << 16


def _recv_msg(sock: socket.socket) -> object:
    (n,) = struct.unpack("<I", recv_exact(sock, 4))
    if n > _MAX_SETUP_MSG:
        raise ConnectionError(f"a setup message of {n} bytes (at most {_MAX_SETUP_MSG} expected)")
    return json.loads(recv_exact(sock, n))


def connect_world(rank: int, world_size: int, store: Store, cfg: Config, job_id: str,
                  card: dict, deadline: float, secret: auth.Secret,
                  serving: int = 0) -> tuple[Engine, dict[int, dict]]:
    """The world's engine with a channel to every peer, each connection proving `secret`, and
    every rank's card. `card` is this
    rank's (topo.local_card: its address `addr`, host name `host`, machine `machine`, ...): it
    is published with the port this rank listens on, which makes the job's topology cost no
    exchange of its own. `serving`: store clients this process also serves (it hosts the
    store), whose descriptors it needs too."""
    engine = Engine(rank, world_size, cfg.spin_us)
    if world_size == 1:
        return engine, {rank: card}
    address, hostname, machine = card["addr"], card["host"], card["machine"]
    try:
        limits.ensure_descriptors(world_size + serving, f"rank {rank}: init",
                                  f"full-mesh wiring of {world_size} ranks"
                                  + (" and serving the store to them" if serving else ""))
        listener = _listen(rank, address, world_size)
    except ResourceError as exc:
        store.set(f"tw/peer/{rank}", json.dumps({"error": str(exc)}).encode())  # every rank raises it
        raise
    port = listener.getsockname()[1]
    _, shm_free = shm_budget.usage()  # before this rank publishes, so before any ring of the job exists
    store.set(f"tw/peer/{rank}", json.dumps({**card, "port": port}).encode())
    _log.info("rank %d listening on %s:%d (host %s)", rank, address, port, hostname)
    peers: dict[int, dict] = {}
    for r in range(world_size):
        if r == rank:
            continue
        left = deadline - time.monotonic()
        try:
            peers[r] = json.loads(store.get(f"tw/peer/{r}", timeout=max(left, 0.001)))
        except TimeoutError as exc:
            raise TimeoutError(
                f"rank {rank}: init: rank {r} never arrived (no address published within "
                f"{cfg.timeout:g} s); is it running with the same WORLD_SIZE={world_size} and store?"
            ) from exc
        if "error" in peers[r]:
            listener.close()
            raise ResourceError(f"rank {rank}: init: rank {r} cannot join: {peers[r]['error']}")
    try:
        socks = connect_pairs(rank, world_size, listener, {r: (peers[r]["addr"], peers[r]["port"])
                                                           for r in range(rank)},
                              set(range(rank + 1, world_size)), job_id, secret, cfg, deadline,
                              f"rank {rank}: init")
    finally:
        listener.close()
    mates = [rank] + [r for r, info in peers.items() if info.get("machine") == machine]
    engine.adapt_to_machine(len(mates), sorted(mates).index(rank), cfg.bind)
    local = {r for r, info in peers.items() if info["host"] == hostname and cfg.transport != "tcp"}
    alone = len(local) + 1 == world_size  # the world group will want a one-shot segment too
    capacity = shm_budget.plan_ring(shm_free, len(local) + 1, cfg.shm_ring_bytes,
                                    world_size if alone else 0, cfg.direct_slot(world_size))
    rings = attach_peers(engine, socks, local, job_id, cfg, capacity)
    tcp = sorted(set(socks) - set(rings))
    settings = ""
    if tcp:
        sock = socks[tcp[0]]
        buffers = "; ".join(
            f"{what} buffer {sock.getsockopt(socket.SOL_SOCKET, opt) >> 10} KiB"
            + ("" if asked else ", autotuned")
            for what, opt, asked in (("send", socket.SO_SNDBUF, cfg.tcp_sndbuf),
                                     ("receive", socket.SO_RCVBUF, cfg.tcp_rcvbuf)))
        settings = (f" (congestion control {congestion_of(sock)}"
                    f"{'' if cfg.tcp_congestion else ', the system default'}; {buffers})")
    _log.info("rank %d connected: shm peers %s, tcp peers %s%s", rank, sorted(rings), tcp, settings)
    return engine, {**peers, rank: {**card, "port": port}}


def _listen(rank: int, address: str, world_size: int) -> socket.socket:
    try:
        return socket.create_server((address, 0), backlog=max(world_size, 16))
    except OSError as exc:
        raise limits.translate(exc, f"rank {rank}: init: listening on {address}") or \
            RendezvousError(f"rank {rank}: cannot listen on {address}: {exc}") from exc


class RingPair(NamedTuple):
    out: Ring
    inn: Ring
    peer_pid: int  # non-zero where this process can read the peer's memory
    peer_reads: bool  # the peer can read this process's memory


def attach_peers(engine: Engine, socks: dict[int, socket.socket], local: set[int], job_id: str,
                 cfg: Config, capacity: int | None = None) -> dict[int, RingPair]:
    """Turn connected sockets into channels: shared-memory rings toward the `local` peers that
    agree (both sides run this), TCP for the rest. Safe while the engine runs (an integration
    connecting pairs on demand); returns the ring pairs set up. This rank's rings hold
    `capacity` bytes (None: what fits /dev/shm now, shm_budget.plan_ring; 0: none fit)."""
    refused = "TENSORWIRE_SINGLE_COPY=0" if cfg.single_copy == "0" else cma.allow_peers()
    if refused and local:
        _log.info("rank %d: peers will not read this process's memory (%s): large point-to-point "
                  "messages go through the rings", engine.rank, refused)
    if capacity is None:
        capacity = shm_budget.plan_ring(shm_budget.usage()[1], len(local) + 1, cfg.shm_ring_bytes)
    engine.host_peers |= local
    rings = _setup_rings(engine, socks, local, job_id, capacity, not refused)
    with engine.lock:
        install_channels(engine, socks, rings, cfg)
    return rings


def install_channels(engine: Engine, socks: dict[int, socket.socket],
                     rings: dict[int, RingPair], cfg: Config) -> None:
    """One channel per connected peer: shared memory where a ring pair was set up, else TCP."""
    for r in sorted(socks):
        tune_socket(socks[r], cfg)
        stream = SocketStream(socks[r], r, engine, cfg.tcp_chunk_bytes, cfg.max_message)
        if r in rings:
            pair = rings[r]
            engine.add_channel(r, ShmChannel(stream, pair.out, pair.inn, engine, pair.peer_pid,
                                             pair.peer_reads))
        else:
            engine.add_channel(r, TcpChannel(stream))


def _setup_rings(engine: Engine, socks: dict[int, socket.socket], local: set[int], job_id: str,
                 capacity: int, readable: bool) -> dict[int, RingPair]:
    """Exchange ring names with local peers; keep a pair only if both sides mapped it. Each
    side also tries to read the other's memory (the nonce of its ring, in its own process),
    where the other offers it (`readable`): large point-to-point messages are read so. A ring
    is its writer's: it reserves the pages (shm.reserve) and chooses its capacity, so a pair
    with too little /dev/shm for either ring talks over TCP (engine.shm_refused says why)."""
    rank = engine.rank
    mine: dict[int, Ring] = {}
    for r in sorted(local):
        ring, why = None, errno.ENOSPC  # capacity 0: no ring fits (shm_budget.plan_ring)
        if capacity:
            ring, why = shm_budget.shrinking(functools.partial(Ring.create, f"tw-{job_id[:24]}-{rank}-{r}"),
                                             capacity, shm_budget.RING_FLOOR)
        if ring is None:
            engine.shm_refused[r] = why
            _log.info("rank %d: no shared memory toward rank %d (%s); using TCP", rank, r, os.strerror(why))
        else:
            mine[r] = ring
    for r in sorted(socks):
        ring = mine.get(r)
        offer = {"ring": ring.name, "nonce": ring.nonce, "capacity": ring.capacity} if ring \
            else {"ring": "", "nonce": 0}
        if ring and readable:
            offer.update(pid=os.getpid(), probe=ring.nonce_address)
        _send_msg(socks[r], offer)
    theirs: dict[int, Ring] = {}
    pids: dict[int, int] = {}  # the peers whose memory this process can read
    for r in sorted(socks):
        offer = _recv_msg(socks[r])
        if r in mine and offer["ring"]:
            try:
                ring = Ring(offer["ring"], offer["capacity"], create=False)
                if ring.nonce == offer["nonce"]:
                    theirs[r] = ring
                else:
                    ring.close()
            except OSError as exc:
                engine.shm_refused[r] = exc.errno or 0
            if r in theirs and offer.get("pid"):
                why = cma.can_read(offer["pid"], offer["probe"], offer["nonce"])
                if why:
                    _log.info("rank %d cannot read rank %d's memory (%s)", rank, r, why)
                else:
                    pids[r] = offer["pid"]
        elif r in local and r in mine:
            engine.shm_refused.setdefault(r, 0)  # the peer made no ring (engine.shm_refused there)
    for r in sorted(socks):
        _send_msg(socks[r], {"ok": r in theirs, "reads": r in pids})
    rings = {}
    for r in sorted(socks):
        answer = _recv_msg(socks[r])
        ok = answer["ok"]
        if r in mine:
            mine[r].unlink()  # both mapped it (or gave up): the name is no longer needed
        if ok and r in theirs:
            rings[r] = RingPair(mine[r], theirs[r], pids.get(r, 0), answer["reads"])
        else:
            if r in local:
                engine.shm_refused.setdefault(r, 0)
            if r in mine:
                mine[r].close()
            if r in theirs:
                theirs[r].close()
    return rings
