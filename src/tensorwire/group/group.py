"""Groups (communicators): identity, rank maps, topology and sub-groups.

A Group is composed of its parts: the ordered execution of its calls (execution.CallQueue,
`group.queue`), its planned fast paths (planned.Plans, `group.plans`), its shared-memory
path (shm_setup, `group.direct`) and its device collectives (`group.device`). The calls
themselves are plain functions of the group, bound here as methods by family:
collectives.py, p2p.py, objects.py, and shrink.py.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from .. import buffers, log
from ..algorithms.hierarchical import Hierarchy
from ..errors import InvalidArgumentError, NotInitializedError, rank_spans
from ..ops import ReduceOp
from ..transport.wire import Coll
from . import bodies, call_log, collectives, objects, p2p, shm_setup
from .arguments import check_member, fingerprint
from .calls import CollectiveCall
from .context import NEW_GROUP, SPLIT, mix_context
from .execution import CallQueue
from .planned import Plans
from .shrink import shrink_group

if TYPE_CHECKING:
    from ..gpu.collectives import DeviceCollectives
    from ..runtime import Runtime
    from ..transport.segment import DirectPath
    from ..tuning.topology import Layout

_log = log.get("COLL")
_WORKER_GRACE_S = 1.0  # how long an unfinished async call may still run when its group is destroyed


class Group:
    """A set of world ranks with its own context id; `rank` is -1 on processes outside it.

    Groups come from `new_group`/`split`; integrations (the torch backend) may also construct
    one directly over the runtime, with a context id every member derives identically."""

    def __init__(self, runtime: Runtime, ranks: Sequence[int], ctx: int, name: str,
                 check_order: bool = False) -> None:
        self.runtime = runtime
        self.engine = runtime.engine
        self.ranks = list(ranks)
        self.ctx = ctx
        self.name = name
        self.size = len(self.ranks)
        self._index = {w: i for i, w in enumerate(self.ranks)}
        self.rank = self._index.get(runtime.rank, -1)
        runtime.groups.add(self)
        self.timeout = runtime.config.timeout
        self._made: dict[tuple[int, ...], int] = {}  # new_group: groups made so far of each membership
        self._splits = 0  # split() calls so far
        self.shrinks = 0  # shrink() calls so far: each derives its contexts from this count
        self.queue = CallQueue(self)  # sequence numbers and the ordered execution
        self.plans = Plans(self, self.queue)  # checked call signatures -> their plans
        self.choices: dict[tuple, Any] = {}  # the tuner's algorithm per (collective, size, ...)
        self.huge_seen: dict[tuple[str, int], bool] = {}  # see tuner.PageDependent
        self.p2p_routes: dict[tuple[bool, int, int, int], p2p.P2PRoute] = {}  # see p2p._route
        self.p2p_pairs: dict[tuple, tuple[p2p.P2PRoute, p2p.P2PRoute]] = {}  # see p2p.sendrecv
        self.any_source_turns = p2p.AnySourceTurns()  # receives from any member (p2p.irecv_any)
        self.direct_plans: dict[tuple, Any] = {}  # see shm_direct.direct_all_reduce
        self._device: DeviceCollectives | None = None
        me = runtime.rank
        self.all_local = runtime.config.transport != "tcp" and all(
            self.engine.planned_kind(w) == "shm" for w in self.ranks if w != me)
        self.one_host = self.all_local  # every member on this host, rings or not (agreed in shm_setup)
        self.ring_bytes = runtime.config.shm_ring_bytes  # the smallest ring among members (shm_setup)
        self._layout: Layout | None | bool = False  # False: not looked up yet
        self._hierarchy: Hierarchy | None = None
        self.direct: DirectPath | None = None
        self.destroyed = False  # destroy() ran: its calls raise NotInitializedError
        if self.rank >= 0:
            if self.engine.native is not None:
                self._compile_api(self.engine.native)
            call_log.log_p2p(self)
            shm_setup.setup_direct(self, check_order)

    def _compile_api(self, native: ModuleType) -> None:
        """Take the compiled caller's methods as this group's methods of those names: a call
        that the group planned on the one-shot path (planned.Plans._compile), or a sendrecv of
        a pair of routes used before (p2p.sendrecv), runs in one C call, and any other goes to
        the class's Python function, as without it (so does every call while the COLL log has a
        line per call: call_log.py)."""
        names = native.COMPILED_CALLS
        caller = native.Caller(self, self.queue, self.engine, self.plans.finish,
                                           tuple(getattr(Group, name) for name in names), ReduceOp.SUM,
                                           np.ndarray, buffers.seen_torch_view, CollectiveCall, self.rank)
        self.plans.take(caller, names)
        for name in names:
            setattr(self, name, getattr(caller, name))

    def __repr__(self) -> str:
        return f"<tensorwire.Group {self.name} rank {self.rank}/{self.size} ranks={self.ranks}>"

    @property
    def is_member(self) -> bool:
        return self.rank >= 0

    def world_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    def group_rank(self, world_rank: int) -> int:
        """This group's rank of a world rank, -1 if it is not a member."""
        return self._index.get(world_rank, -1)

    # -- topology ------------------------------------------------------------------------------
    @property
    def layout(self) -> Layout | None:
        """Where the group's ranks lie across hosts (topology.Layout: the orders its algorithms
        run in, its hierarchy); None for a group on one host, or where the runtime knows no
        topology (the torch backend's runtime over another backend's world)."""
        if self._layout is False:
            topo = self.runtime.topology
            self._layout = None if topo is None or self.all_local else topo.layout(self.ranks, self.name)
        return self._layout  # type: ignore[return-value]

    def hierarchy(self) -> Hierarchy:
        """This rank's host group and rail (algorithms/hierarchical.py), made on first use:
        collectively, inside the first call that runs a hierarchical algorithm, which every
        member runs at the same point. A failure of the group fails them too (Engine.children)."""
        if self._hierarchy is None:
            layout = self.layout
            if layout is None:  # one rank a host: host groups of one (the compressed all_reduce)
                raise InvalidArgumentError(f"rank {self.runtime.rank}: group {self.name} has no hierarchy: "
                                           "it is on one host")
            where = {g: (k, i) for k, on in enumerate(layout.hosts) for i, g in enumerate(on)}
            host, index = where[self.rank]
            ctxs = mix_context(self.ctx, -1, host), mix_context(self.ctx, -2, index)
            self.engine.children.setdefault(self.ctx, []).extend(ctxs)
            local = self.derive([self.ranks[g] for g in layout.hosts[host]], ctxs[0],
                                f"{self.name}/host{host}")
            if local.direct is not None:
                # single copy's all-gather even where ranks outnumber cores (DirectPath.crowded):
                # a host's phases run while the link carries another piece, not against every
                # rank's flag rounds (see docs/design/groups.md#hierarchy)
                local.direct.crowded = False
            rail = self.derive([self.ranks[g] for g in layout.rails[index]], ctxs[1],
                               f"{self.name}/rail{index}")
            self._hierarchy = Hierarchy(local, rail, layout.hosts, host, index, where)
        return self._hierarchy

    @property
    def device(self) -> DeviceCollectives:
        """This group's collectives on CUDA buffers (torch is imported with the first)."""
        if self._device is None:
            from ..gpu.collectives import DeviceCollectives

            self._device = DeviceCollectives(self)
        return self._device

    # -- failures ------------------------------------------------------------------------------
    def abort(self, error: BaseException, seq: int | None = None) -> None:
        """Fail call `seq` (default: the next one) and all later calls of this group, here and
        on every member, with `error` as the reason."""
        _log.warning("aborting group %s: %s", self.name, error)
        seq = self.queue.seq + 1 if seq is None else seq
        self.queue.raised = max(self.queue.raised, seq)
        if self.direct is not None:
            self.direct.withdraw(seq)
        self.engine.abort_group(self.ctx, seq, self.ranks, error)

    def fail_fast(self, error: Exception) -> NoReturn:
        """A local argument error (or a failed allocation) in the call about to be made: that
        call fails on every member (execution.CallQueue.refuse), so peers raise it too instead
        of waiting for this rank."""
        self.queue.refuse(error)

    def forget_plans(self) -> None:
        """Drop the planned calls, point-to-point routes and direct plans: each next call is
        checked again."""
        self.plans.clear()
        self.p2p_routes.clear()
        self.forget_pairs()
        self.direct_plans.clear()

    def forget_pairs(self) -> None:
        """Drop sendrecv's pairs of routes (p2p.sendrecv), the compiled caller's too."""
        self.p2p_pairs.clear()
        if self.plans.caller is not None:
            self.plans.caller.clear_pairs()

    # -- lifetime -----------------------------------------------------------------------------
    def destroy(self) -> None:
        """End this group on this rank and give back what it holds: its shared-memory segment
        (the space returns once every member has destroyed the group or exited), its worker
        thread, its planned calls, its hierarchy's groups. Every member calls it after its last
        call on the group, as with torch's destroy_process_group(group); it waits for no one,
        except up to a second for its sends nobody waited for to go out. Later calls on it raise
        NotInitializedError, and a member's call after this rank's last one, or receive from
        this rank of a message it never sent, raises PeerLostError there at once; groups made
        from it are not affected. A group nothing refers to any more gives its segment back
        when it is garbage collected."""
        if self.destroyed:
            return
        if self is self.runtime.world:
            raise InvalidArgumentError(f"rank {self.runtime.rank}: destroy: the world group ends with "
                                       "tensorwire.destroy()")
        self.destroyed = True
        self.runtime.groups.discard(self)
        self.release(_WORKER_GRACE_S, f"group {self.name} was destroyed")
        self._tell_destroyed()
        self.engine.retire(self.ctx, NotInitializedError(
            f"rank {self.runtime.rank}: group {self.name} was destroyed on this rank"))

    def _tell_destroyed(self) -> None:
        """Tell the members that this rank makes no call on the group after the last one it
        started: a member's call after that fails at once instead of at its timeout."""
        if self.rank < 0 or self.engine.closed or self.runtime.pid != os.getpid():
            return
        last = self.queue.current
        seq = last.seq if last is not None else 0
        after = f"after its call #{last.number(seq)}" if last is not None and last.number(seq) > 0 \
            else "before its first call"
        self.engine.tell_destroyed(self.ctx, seq + 1, self.ranks,
                                   f"rank {self.runtime.rank} destroyed group {self.name} {after}",
                                   sending=self.engine.finish_sends(self.ctx))

    def release(self, grace: float, why: str = "tensorwire shut down (destroy())") -> None:
        """Stop the worker (a running call gets `grace` seconds; queued ones fail saying `why`),
        forget the planned calls and drop the segment and the hierarchy's groups: their memory
        goes with the last reference, so a call still running keeps what it uses."""
        self.queue.stop_worker(grace, why)
        self.choices.clear()
        self._report_last_call()
        self._forget(grace, why)

    def _report_last_call(self) -> None:
        """On stderr, whatever the log settings, what no later call will raise: a last call that
        this rank completed and a peer made as another (DirectPath.last_call_mismatch), or a
        peer's abort of a call this rank had returned from."""
        if self.engine.closed or self.runtime.pid != os.getpid():  # a fork's copy: the parent's calls
            return
        self.engine.poll_peers()  # an abort that came in after this rank's last call
        aborted = self.engine.aborted.get(self.ctx)
        if aborted is not None:
            error = aborted[1] if self.queue.raised < aborted[0] <= self.queue.seq else None
            why = ("a member aborted that call after this rank had returned from it (found as the group "
                   "ended): this rank's result of it may not be the collective's")
        elif self.direct is not None:
            error = self.direct.last_call_mismatch(self.name, self.queue.internal)
            why = "this rank's result of that call is not the collective's"
        else:
            return
        if error is not None:
            with contextlib.suppress(OSError, ValueError):  # stderr closed: nothing to tell
                print(f"tensorwire: {error}; {why}", file=sys.stderr, flush=True)

    def _forget(self, grace: float, why: str) -> None:
        """Drop the planned calls, the segment, the device state and the hierarchy's groups."""
        self.forget_plans()
        self.direct = None
        self._device = None
        if self._hierarchy is not None:
            self._hierarchy.local.release(grace, why)
            self._hierarchy.rail.release(grace, why)
            self._hierarchy = None

    def renew(self, ctx: int) -> None:
        """Collectively: go on under context `ctx`, what the old one held dropped and the
        segment made afresh (renewal.py; the caller retired the old context)."""
        self._forget(0.0, f"group {self.name} renewed itself")
        self.ctx = self.plans.ctx = ctx
        self.queue.current = None
        if self.rank >= 0:
            shm_setup.setup_direct(self)

    # -- sub-groups ---------------------------------------------------------------------------
    def derive(self, ranks: Sequence[int], ctx: int, name: str, check_order: bool = False) -> Group:
        """A group of world `ranks` over this group's runtime, with a context every member
        derived alike: sub-groups, a hierarchy's host groups and rails, shrink's survivors.
        `check_order`: the members must be seen to list `ranks` in one order (new_group's)."""
        if self.runtime.closed or self.destroyed:
            check_member(self, f"making group {name}")
        return Group(self.runtime, ranks, ctx, name, check_order)

    def new_group(self, ranks: Sequence[int] | None = None, name: str | None = None) -> Group:
        """A group of these ranks of this group (in this order). Its members must call it,
        in the same order among the groups of the same members; other ranks may (torch's rule:
        every rank calls it) or not (MPI_Comm_create_group's). Its context comes from its
        members and how many groups of them this rank made before, not from the other groups;
        members that list them in different orders get a CollectiveMismatchError."""
        ranks = list(range(self.size)) if ranks is None else [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks):
            raise InvalidArgumentError(f"rank {self.runtime.rank}: new_group: duplicate ranks in {ranks}")
        bad = [r for r in ranks if not 0 <= r < self.size]
        if bad:
            raise InvalidArgumentError(f"rank {self.runtime.rank}: new_group: ranks {bad} out of range "
                                       f"for group {self.name} of size {self.size}")
        key = tuple(sorted(ranks))  # the order is checked as the group is set up (shm_setup)
        nth = self._made[key] = self._made.get(key, 0) + 1
        ctx = mix_context(self.ctx, NEW_GROUP, nth, *key)
        world = [self.ranks[r] for r in ranks]
        again = f"#{nth}" if nth > 1 else ""
        return self.derive(world, ctx, name or f"{self.name}[{rank_spans(ranks)}]{again}", check_order=True)

    def split(self, color: int | None, key: int = 0, timeout: float | None = None) -> Group | None:
        """MPI_Comm_split: ranks with the same color form a group ordered by (key, rank).

        A color of None (or negative) leaves this rank out; it gets None back. Colors and keys
        are integers of 64 bits; another value fails the split on every member."""
        check_member(self, "split")
        for name, value in (("color", color), ("key", key)):
            if not (value is None and name == "color") and not (
                    isinstance(value, (int, np.integer)) and -1 << 63 <= value < 1 << 63):
                self.fail_fast(InvalidArgumentError(
                    f"rank {self.runtime.rank}: split: {name}={value!r} is not an integer of 64 bits"))
        mine = np.array([-1 if color is None or color < 0 else color, key], dtype=np.int64)
        table = np.empty((self.size, 2), dtype=np.int64)
        self.queue.submit(fingerprint(Coll.SPLIT, mine.dtype, count=2), "split", bodies.all_gather, False,
                          timeout, mine, list(table), True, table, bodies.SELECT)  # not the user's all_gather
        self._splits += 1
        if mine[0] < 0:
            return None
        members = sorted((int(k), r) for r, (c, k) in enumerate(table) if c == mine[0])
        ranks = [self.ranks[r] for _, r in members]
        return self.derive(ranks, mix_context(self.ctx, SPLIT, self._splits, int(mine[0])),
                           f"{self.name}.split{self._splits}c{int(mine[0])}")

    shrink = shrink_group

    # -- reductions (collectives.py) ----------------------------------------------------------
    all_reduce = collectives.all_reduce
    reduce = collectives.reduce
    reduce_scatter = collectives.reduce_scatter
    reduce_scatter_tensor = collectives.reduce_scatter_tensor
    reduce_scatterv = collectives.reduce_scatterv

    # -- data movement (collectives.py) -------------------------------------------------------
    broadcast = collectives.broadcast
    all_gather = collectives.all_gather
    all_gather_into_tensor = collectives.all_gather_into_tensor
    all_gatherv = collectives.all_gatherv
    gather = collectives.gather
    scatter = collectives.scatter
    gatherv = collectives.gatherv
    scatterv = collectives.scatterv
    all_to_all = collectives.all_to_all
    all_to_all_single = collectives.all_to_all_single
    barrier = collectives.barrier

    # -- point-to-point (p2p.py) --------------------------------------------------------------
    isend = p2p.isend
    irecv = p2p.irecv
    irecv_any = p2p.irecv_any
    send = p2p.send
    recv = p2p.recv
    sendrecv = p2p.sendrecv
    probe_any = p2p.probe_any
    iprobe_any = p2p.iprobe_any

    # -- Python objects (objects.py) ----------------------------------------------------------
    all_gather_object = objects.all_gather_object
    gather_object = objects.gather_object
    broadcast_object_list = objects.broadcast_object_list
    scatter_object_list = objects.scatter_object_list
