"""Groups (communicators): rank maps, sequence numbers, ordered execution, sub-groups.

Collectives of one group run in the order they were called, on every rank. A blocking call
runs inline on the caller's thread when nothing is queued (no thread hop on the fast path);
async calls, and blocking calls queued behind them, run on the group's worker thread, or on
the thread that waits for them if the worker has not started them yet.
Any failure of a collective aborts the group on every member (as NCCL aborts a
communicator): a group whose messages may be half-delivered is never reused silently.
"""

from __future__ import annotations

import errno
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .. import limits, log
from ..algorithms.hierarchical import Hierarchy
from ..algorithms.recursive_doubling import recursive_doubling_all_reduce
from ..algorithms.registry import Link
from ..algorithms.shm_direct import DirectPath
from ..algorithms.tree import binomial_broadcast
from ..buffers import byte_view
from ..errors import (
    AbortedError,
    InvalidArgumentError,
    PeerLostError,
    ResourceError,
    TensorwireWarning,
    TimeoutError,
    in_call,
)
from ..ops import ReduceOp
from ..transport import cma, shm_budget
from ..transport.requests import Request
from ..transport.shm import GroupSegment
from ..transport.wire import P2P_FINGERPRINT, Coll, Fingerprint, Header, Kind
from ..tuning import tuner
from ..work import Work
from .collectives import Collectives

if TYPE_CHECKING:
    from ..gpu.collectives import DeviceCollectives
    from ..runtime import Runtime
    from ..tuning.topo import Layout

_log = log.get("COLL")
P2P_SEQ = 1 << 62  # point-to-point waits belong to no call: every abort of the group covers them
_P2P_ROUTES = 256  # point-to-point routes kept per group (cleared when full)
_SPACE_ERRNOS = (*shm_budget.SPACE_ERRORS, errno.EMFILE, errno.ENFILE)
"""Why a ring could not be made that is a shortfall worth a warning; others (a peer that only
shares a host name, not /dev/shm) are how tensorwire finds out who shares memory at all."""


class P2PRoute(NamedTuple):
    peer: int  # world rank
    header: Header
    wire: bytes  # the header packed
    label: str
    done: Work  # what a message of this route that completed as it was posted returns


def _mix(*parts: int) -> int:
    """A context id every rank derives identically (FNV-1a over the parts), never 0 (the world)."""
    h = 2166136261
    for part in parts:
        for b in int(part).to_bytes(8, "little", signed=True):
            h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h or 1


class CollectiveCall:
    """One collective's point-to-point view of its group (implements algorithms.base.P2P)."""

    __slots__ = ("group", "rank", "size", "seq", "fp", "name", "timeout", "deadline")

    def __init__(self, group: Group, seq: int, fp: Fingerprint, name: str, timeout: float) -> None:
        self.group = group
        self.rank = group.rank
        self.size = group.size
        self.seq = seq
        self.fp = fp
        self.name = name
        self.timeout = timeout
        self.deadline = 0.0

    @property
    def what(self) -> str:
        """The label errors use: 'all_reduce #12 on group world' (built only when needed)."""
        return f"{self.name} #{self.seq} on group {self.group.name}"

    __str__ = what.fget  # type: ignore[assignment]

    def start(self) -> None:
        self.deadline = time.perf_counter() + self.timeout

    def started(self) -> CollectiveCall:
        """The call with its deadline running (a direct-path call starts it when it first waits)."""
        if not self.deadline:
            self.start()
        return self

    def _header(self, step: int, nbytes: int) -> Header:
        return Header(Kind.COLL, self.group.ctx, self.seq, step, nbytes, self.fp)

    def isend(self, peer: int, data: np.ndarray, step: int) -> Request:
        payload = byte_view(data)
        return self.group.engine.isend(self.group.ranks[peer], self._header(step, payload.nbytes),
                                       payload, self)

    def irecv(self, peer: int, data: np.ndarray, step: int, reduce: ReduceOp | None = None,
              base: np.ndarray | None = None) -> Request:
        dst = data.reshape(-1) if reduce is not None else byte_view(data)
        return self.group.engine.irecv(self.group.ranks[peer], self._header(step, data.nbytes),
                                       dst, reduce, self, base)

    @property
    def link(self) -> Link:
        """The group's link constants, as the tuner priced this call with them."""
        return tuner.link_of(self.group)

    @property
    def hierarchy(self) -> Hierarchy:
        """The group's host group and rail for this rank (hierarchical algorithms only)."""
        return self.group.hierarchy()

    def wait(self, *reqs: Request) -> None:
        direct = self.group.direct
        try:
            self.group.engine.wait(reqs, deadline=self.deadline, ctx=self.group.ctx, seq=self.seq,
                                   watch=self.group.ranks,
                                   what=self, cross_check=None if direct is None else self._cross_check)
        except PeerLostError as exc:
            why = self.group.engine.why_left(exc, self.group.ctx, self.seq)
            if why is exc:
                raise
            raise why from exc

    def _cross_check(self) -> None:
        """A peer that entered this call through the shared-memory path, or ran it on the
        message path as something else."""
        for r, theirs in self.group.direct.published(self.seq, self.fp):  # type: ignore[union-attr]
            raise self.group.engine.mismatch_error(self.what, self.fp, theirs, self.group.ranks[r])


class Group(Collectives):
    """A set of world ranks with its own context id; `rank` is -1 on processes outside it.

    Groups come from `new_group`/`split`; integrations (the torch backend) may also construct
    one directly over the runtime, with a context id every member derives identically."""

    def __init__(self, runtime: Runtime, ranks: Sequence[int], ctx: int, name: str) -> None:
        self.runtime = runtime
        self.engine = runtime.engine
        self.ranks = list(ranks)
        self.ctx = ctx
        self.name = name
        self.size = len(self.ranks)
        self._index = {w: i for i, w in enumerate(self.ranks)}
        self.rank = self._index.get(runtime.rank, -1)
        runtime.groups.add(self)
        self._seq = 0
        self.timeout = runtime.config.timeout
        self._children = 0
        self.shrinks = 0  # shrink() calls so far: each derives its contexts from this count
        self._cv = threading.Condition()
        self._queue: deque[tuple[CollectiveCall, Callable[..., Any], tuple, Work]] = deque()
        self._busy = False
        self._worker: threading.Thread | None = None
        self._stopping = False
        self.choices: dict[tuple, Any] = {}  # the tuner's algorithm per (collective, size, ...)
        self.huge_seen: dict[tuple[str, int], bool] = {}  # see tuner.PageDependent
        self.plans: dict[object, Any] = {}  # checked call signatures -> their bodies (see Collectives)
        self._p2p_routes: dict[tuple[bool, int, int, int], P2PRoute] = {}
        self.wrap: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None  # see wrapping
        self._device: DeviceCollectives | None = None
        me = runtime.rank
        self.all_local = runtime.config.transport != "tcp" and all(
            self.engine.planned_kind(w) == "shm" for w in self.ranks if w != me)
        self.one_host = self.all_local  # every member on this host, rings or not (agreed in _setup_direct)
        self.ring_bytes = runtime.config.shm_ring_bytes  # the smallest ring among members (_setup_direct)
        self._layout: Layout | None | bool = False  # False: not looked up yet
        self._hierarchy: Hierarchy | None = None
        self.direct: DirectPath | None = None
        if self.rank >= 0:
            self._setup_direct()

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
        """Where the group's ranks lie across hosts (topo.Layout: the orders its algorithms
        run in, its hierarchy); None for a group on one host, or where the runtime knows no
        topology (the torch backend's runtime over another backend's world)."""
        if self._layout is False:
            topo = getattr(self.runtime, "topology", None)
            self._layout = None if topo is None or self.all_local else topo.layout(self.ranks, self.name)
        return self._layout  # type: ignore[return-value]

    def hierarchy(self) -> Hierarchy:
        """This rank's host group and rail (algorithms/hierarchical.py), made on first use:
        collectively, inside the first call that runs a hierarchical algorithm, which every
        member runs at the same point. A failure of the group fails them too (Engine.children)."""
        if self._hierarchy is None:
            layout = self.layout
            if layout is None or layout.shape is None:
                raise InvalidArgumentError(f"rank {self.runtime.rank}: group {self.name} has no hierarchy: "
                                           "it is on one host, or each of its hosts holds one rank")
            where = {g: (k, i) for k, on in enumerate(layout.hosts) for i, g in enumerate(on)}
            host, index = where[self.rank]
            ctxs = _mix(self.ctx, -1, host), _mix(self.ctx, -2, index)
            self.engine.children.setdefault(self.ctx, []).extend(ctxs)
            local = Group(self.runtime, [self.ranks[g] for g in layout.hosts[host]], ctxs[0],
                          f"{self.name}/host{host}")
            if local.direct is not None:
                # single copy's all-gather even where ranks outnumber cores (DirectPath.crowded):
                # a host's phases run while the link carries another piece, not against every
                # rank's flag rounds. 2 emulated hosts x 4 ranks on 2 cores, 64 MiB all_reduce,
                # 8 calls each way alternating: 0.628 s mean (0.60-0.67) against 0.708 (0.60-0.92)
                local.direct.crowded = False
            rail = Group(self.runtime, [self.ranks[g] for g in layout.rails[index]], ctxs[1],
                         f"{self.name}/rail{index}")
            self._hierarchy = Hierarchy(local, rail, layout.hosts, host, index, where)
        return self._hierarchy

    # -- execution ----------------------------------------------------------------------------
    def _submit(self, fp: Fingerprint, what: str, body: Callable[..., Any], async_op: bool,
                timeout: float | None, *args: Any) -> Any:
        """Give the call its sequence number now (call order is the contract), run it in order
        as body(call, *args)."""
        self._seq += 1
        call = CollectiveCall(self, self._seq, fp, what, self.timeout if timeout is None else timeout)
        aborted = self.engine.aborted.get(self.ctx)
        if aborted is not None and call.seq >= aborted[0]:
            raise aborted[1]
        if self.wrap is not None:
            body = self.wrap(body)
        # Only the calling thread enqueues, and the worker marks itself busy before it pops,
        # so an empty queue and an idle worker seen here mean nothing else can run now.
        if not async_op and not self._queue and not self._busy:
            self._busy = True
            try:
                return self._run(call, body, args)
            finally:
                self._release()
        work = _QueuedWork(self, call.what)
        with self._cv:
            self._queue.append((call, body, args, work))
            if self._worker is None:
                self._worker = threading.Thread(target=self._work_loop, daemon=True,
                                                name=f"tensorwire-group-{self.name}")
                self._worker.start()
            self._cv.notify_all()
        if async_op:
            return work
        work.wait()
        return work._result

    def _submit_planned(self, call: CollectiveCall, body: Callable[..., Any], direct: bool, async_op: bool,
                        timeout: float | None, *args: Any) -> Any:
        """`_submit` for a planned call (see Collectives.all_reduce), given the plan's own call
        object. A body of the direct path that can run inline, with nothing arrived that must
        be vetted first, reuses that object, its deadline started only if it has to wait: such
        a body keeps no reference to its call, and the setup saved is a fifth of a small
        call's time."""
        engine = self.engine
        if async_op or not direct or self._busy or self._queue or engine.unexpected \
                or engine.deferred_aborts or (engine.aborted and self.ctx in engine.aborted):
            return self._submit(call.fp, call.name, body, async_op, timeout, *args)
        self._seq = call.seq = self._seq + 1
        call.timeout = self.timeout if timeout is None else timeout
        call.deadline = 0.0
        engine.current[self.ctx] = call
        self._busy = True
        try:
            # CPython 3.11 calls body(call, *args) its slow way, 60 ns more (of ~2.5 µs), so the
            # usual arities are spelt out: two arrays (most planned bodies), none (a barrier)
            if len(args) == 2:
                a, b = args
                return body(call, a, b)
            return body(call, *args) if args else body(call)
        except MemoryError as exc:
            raise self._out_of_memory(call, exc) from exc
        except Exception as exc:
            error = self._failed(call, exc)
            if error is exc:
                raise
            raise error from exc
        finally:
            self._busy = False  # _release, inline: a tenth of this method's time
            if self._queue:
                self._wake()

    @contextmanager
    def wrapping(self, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
        """Calls submitted meanwhile run as wrap(body): a staged device call's host collective
        must start only once its data has reached the host, and queue its copy back as it ends,
        wherever (whichever thread) the body runs."""
        self.wrap = wrap
        try:
            yield
        finally:
            self.wrap = None

    @property
    def device(self) -> DeviceCollectives:
        """This group's collectives on CUDA buffers (torch is imported with the first)."""
        if self._device is None:
            from ..gpu.collectives import DeviceCollectives

            self._device = DeviceCollectives(self)
        return self._device

    def _release(self) -> None:
        """An inline call ended: the worker may take what was queued behind it meanwhile."""
        self._busy = False
        if self._queue:
            self._wake()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def planned_call(self, fp: Fingerprint, what: str) -> CollectiveCall:
        """A reusable call object for a plan of `_submit_planned`."""
        return CollectiveCall(self, 0, fp, what, self.timeout)

    def _run(self, call: CollectiveCall, body: Callable[..., Any], args: tuple) -> Any:
        call.start()
        try:
            if self.engine.enter_call(self.ctx, call):
                aborted = self.engine.aborted.get(self.ctx)
                if aborted is not None and call.seq >= aborted[0]:
                    raise aborted[1]  # entering revealed a mismatch with an earlier or this call
            result = body(call, *args)
            direct = self.direct
            if direct is not None and direct.prev_seq != call.seq:
                direct.stamp(call)  # it ran on the message path
            return result
        except MemoryError as exc:
            raise self._out_of_memory(call, exc) from exc
        except Exception as exc:
            error = self._failed(call, exc)
            if error is exc:
                raise
            raise error from exc

    def _failed(self, call: CollectiveCall, exc: Exception) -> Exception:
        """Whatever broke, the peers must not wait for this rank: the group is aborted with the
        error, a lost peer's named with the call (the engine's knows the peer, not the call), a
        timeout's with the members not in the call (Engine.missing)."""
        error = in_call(exc, call.what) if isinstance(exc, PeerLostError) else exc
        phase = any(self.ctx in kids for kids in self.engine.children.values())  # named by its parent's call
        if isinstance(exc, TimeoutError) and not phase:
            error = self.engine.missing(exc, self.ctx, call.seq, self.ranks)
        self.abort(error, call.seq)
        return error

    def _out_of_memory(self, call: CollectiveCall, exc: MemoryError) -> ResourceError:
        """A call that could not allocate: the error names the limits, and every member gets it."""
        error = limits.memory_error(exc, f"rank {self.runtime.rank}: {call.what}")
        self.abort(error, call.seq)
        return error

    def _work_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue or self._busy:
                    if self._stopping:
                        return
                    self._cv.wait()
                self._busy = True  # before the pop: see _submit
                queued = self._queue.popleft()
            self._run_queued(*queued)

    def run_until(self, work: Work) -> None:
        """Run the queued calls up to `work` on this (the waiting) thread while the worker has
        not taken them: a small async call waited for at once then costs no thread wake-ups
        (8 B all_reduce at 2 ranks, async and waited: 6.5 against 28 µs; blocking 2.4)."""
        while not work._done:
            with self._cv:
                if self._busy or not self._queue or self._stopping:
                    return  # the worker has it, or it is done: wait the usual way
                self._busy = True  # as the worker does: see _submit
                queued = self._queue.popleft()
            self._run_queued(*queued)

    def _run_queued(self, call: CollectiveCall, body: Callable[..., Any], args: tuple, work: Work) -> None:
        try:
            result = self._run(call, body, args)
        except BaseException as exc:  # handed to whoever waits on the Work
            work._finish(exc=exc)
        else:
            work._finish(result)
        finally:
            with self._cv:
                self._busy = False
                if self._queue:
                    self._cv.notify_all()

    def stop_worker(self, grace: float) -> None:
        """End the worker thread before the interpreter finalizes: a daemon thread that is
        still inside a C++ call then (a torch op in an abandoned async collective) aborts the
        whole process. Queued calls fail; the running one gets `grace` seconds to finish."""
        with self._cv:
            self._stopping = True
            dropped = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for call, _body, _args, work in dropped:
            work._finish(exc=AbortedError(f"rank {self.runtime.rank}: {call.what} was still queued "
                                          "when tensorwire shut down"))
        worker = self._worker
        if worker is None or worker is threading.current_thread():
            return
        worker.join(grace)
        if worker.is_alive():
            self.engine.fail_locally(self.ctx, 0, AbortedError(
                f"rank {self.runtime.rank}: tensorwire shut down while group {self.name} was "
                "running an async collective nobody waited for"))
            worker.join(grace)

    def abort(self, error: BaseException, seq: int | None = None) -> None:
        """Fail call `seq` (default: the next one) and all later calls of this group, here and
        on every member, with `error` as the reason."""
        _log.warning("aborting group %s: %s", self.name, error)
        self.engine.abort_group(self.ctx, self._seq + 1 if seq is None else seq, self.ranks, error)

    def fail_fast(self, error: InvalidArgumentError) -> None:
        """A local argument error in the call about to be made: abort the group from that call
        on, so peers raise it too instead of waiting for this rank."""
        self.abort(error)
        raise error

    def _internal_call(self, what: str) -> CollectiveCall:
        """A call for the group's own bookkeeping; it takes a sequence number like any other."""
        self._seq += 1
        call = CollectiveCall(self, self._seq, Fingerprint(Coll.SETUP), what, self.timeout)
        call.start()
        return call

    def _setup_direct(self) -> None:
        """Collectively: agree on the group's links (so every rank prices the same tier) and
        give a group on one host its shared segment (the one-shot path), as large as /dev/shm
        allows; warn once of what /dev/shm could not hold (shm_budget)."""
        cfg = self.runtime.config
        if self.size < 2 or cfg.transport == "tcp":
            return
        table = np.zeros((self.size, 6), dtype=np.uint64)  # each rank's row, gathered by a MAX
        table[self.rank] = self._shm_facts()
        recursive_doubling_all_reduce(self._internal_call("shm setup"), table.reshape(-1), ReduceOp.MAX)
        self.all_local = bool(table[:, 0].all())
        self.one_host = bool(table[:, 1].all())
        used = table[:, 4][table[:, 4] > 0]
        if len(used):
            self.ring_bytes = int(used.min())  # what the tuner prices memory traffic with, alike everywhere
        short = shm_budget.Shortfall(local=int(table[:, 5].max()), ring=cfg.shm_ring_bytes,
                                     ring_used=int(used.min()) if len(used) else 0,
                                     rings=int(table[:, 5].sum() - self.size), refused=int(table[:, 2].sum()),
                                     ring_errno=int(table[:, 3].max()))
        want = cfg.direct_slot(self.size)
        if self.one_host and want > 0:
            short.slot, short.size = want, self.size
            short.slot_used, short.slot_errno = self._setup_segment(want)
        told = self.runtime.shm_told
        news = {"rings"} if short.rings_short else set()
        news |= {"segment"} if short.slot_short else set()
        if news - told and self.rank == 0:
            log.warn(short.describe(f"rank {self.runtime.rank}: group {self.name}", "rings" not in told),
                     TensorwireWarning)
        told |= news

    def _shm_facts(self) -> tuple[int, ...]:
        """This rank's row of the group's shared-memory facts: (every peer through rings, every
        peer on this host, rings toward peers on this host it could not make, why (errno),
        the ring its rings grow to, members on this host). Rings are made as pairs first talk
        (transport/wiring.py): a peer counts as through rings unless its pair fell back."""
        engine, me = self.engine, self.runtime.rank
        peers = [w for w in self.ranks if w != me]
        shm = [w for w in peers if engine.planned_kind(w) == "shm" and w not in engine.shm_refused]
        host = sum(w in engine.host_peers for w in peers)
        refused = [engine.shm_refused[w] for w in peers if engine.shm_refused.get(w) in _SPACE_ERRNOS]
        if host and not shm and engine.ring_max == 0:  # no room for rings at all: planned so at init
            refused = [errno.ENOSPC] * host
        return (int(len(shm) == len(peers)), int(host == len(peers)), len(refused), max(refused, default=0),
                engine.ring_max if shm else 0, host + 1)

    def _setup_segment(self, slot: int) -> tuple[int, int]:
        """Rank 0 makes the segment, as large as fits up to `slot` a rank, the others map it;
        the group uses it only if every rank did. (the slot it got, errno why it is smaller)"""
        offer = np.zeros(4, dtype=np.uint64)  # (name token, nonce, slot, errno) of rank 0's segment
        seg = None
        prefix = f"tw-{self.runtime.info.job_id[:24]}-g{self.ctx}"
        if self.rank == 0:
            seg, why = shm_budget.shrinking(functools.partial(GroupSegment.create, prefix, self.size),
                                            shm_budget.plan_slot(shm_budget.usage()[1], self.size, slot),
                                            shm_budget.SLOT_FLOOR)
            offer[:] = (int(seg.name.rsplit("-", 1)[1], 16), seg.nonce, seg.slot_bytes, why) if seg \
                else (0, 0, 0, why)
        verdict = np.zeros(1, dtype=np.uint8)
        try:
            binomial_broadcast(self._internal_call("shm setup"), offer, 0)
            if seg is None and offer[0]:
                try:
                    seg = GroupSegment(f"{prefix}-{int(offer[0]):08x}", self.size, int(offer[2]), False)
                    if seg.nonce != int(offer[1]):
                        seg.close()
                        seg = None
                except OSError as exc:
                    _log.info("rank %d: group %s: cannot map its segment (%s)", self.runtime.rank, self.name,
                              exc)
                    seg = None
            verdict[0] = seg is not None
            if seg is not None:
                direct = DirectPath(seg, self.rank, self.engine, self.ctx, self.ranks)
                direct.offer_single_copy(_single_copy_refused(self.runtime.config.single_copy))
                direct.crowded = self.runtime.config.single_copy == "1" and self.engine.oversubscribed
            recursive_doubling_all_reduce(self._internal_call("shm setup"), verdict, ReduceOp.MIN)
        finally:
            if seg is not None and self.rank == 0:
                seg.unlink()  # everyone mapped it, gave up or failed: nothing is left in /dev/shm
        if verdict[0] and seg is not None:
            self.direct = direct
            self.runtime.segments.append(seg)
            self._setup_single_copy(direct)
        elif seg is not None:
            seg.close()
        return int(offer[2]), int(offer[3])

    def _setup_single_copy(self, direct: DirectPath) -> None:
        """Collectively: single copy where every rank can read every peer's memory."""
        why = direct.offered or direct.probe_single_copy()
        verdict = np.array([not why], dtype=np.uint8)
        recursive_doubling_all_reduce(self._internal_call("shm setup"), verdict, ReduceOp.MIN)
        if verdict[0]:
            direct.enable_single_copy()
        elif why:
            _log.info("rank %d: group %s: no single copy (%s)", self.runtime.rank, self.name, why)

    # -- sub-groups ---------------------------------------------------------------------------
    def shrink(self, timeout: float | None = None) -> Group:
        """After a member failed: a new group of the surviving members, ranked in their old
        order, agreed on by all of them (MPI_Comm_shrink). Every live member must call it;
        this group stays aborted. Called where nothing failed, it returns an equivalent group
        (same members, a new context) and leaves this one usable. See docs/failures.md."""
        from .shrink import shrink_group  # it builds Groups: imported here, not at the top

        return shrink_group(self, timeout)

    def new_group(self, ranks: Sequence[int] | None = None, name: str | None = None) -> Group:
        """Every rank of this group must call it, members or not, in the same order."""
        ranks = list(range(self.size)) if ranks is None else [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks):
            raise InvalidArgumentError(f"rank {self.runtime.rank}: new_group: duplicate ranks in {ranks}")
        bad = [r for r in ranks if not 0 <= r < self.size]
        if bad:
            raise InvalidArgumentError(f"rank {self.runtime.rank}: new_group: ranks {bad} out of range "
                                       f"for group {self.name} of size {self.size}")
        self._children += 1
        ctx = _mix(self.ctx, self._children, *ranks)
        world = [self.ranks[r] for r in ranks]
        return Group(self.runtime, world, ctx, name or f"{self.name}.{self._children}")

    def split(self, color: int | None, key: int = 0, timeout: float | None = None) -> Group | None:
        """MPI_Comm_split: ranks with the same color form a group ordered by (key, rank).

        A color of None (or negative) leaves this rank out; it gets None back."""
        mine = np.array([-1 if color is None or color < 0 else color, key], dtype=np.int64)
        table = np.empty((self.size, 2), dtype=np.int64)
        self.all_gather_into_tensor(table, mine, timeout=timeout)
        self._children += 1
        if mine[0] < 0:
            return None
        members = sorted((int(k), r) for r, (c, k) in enumerate(table) if c == mine[0])
        ranks = [self.ranks[r] for _, r in members]
        return Group(self.runtime, ranks, _mix(self.ctx, self._children, int(mine[0])),
                     f"{self.name}.split{self._children}c{int(mine[0])}")

    # -- point-to-point -----------------------------------------------------------------------
    def _p2p_route(self, sending: bool, peer: int, tag: int, nbytes: int) -> P2PRoute:
        """Where a point-to-point message goes and how it is labelled, kept per (direction,
        peer, tag, size): the checks, the header and its wire form, and the label are most of
        a small message's time otherwise."""
        key = (sending, peer, tag, nbytes)
        route = self._p2p_routes.get(key)
        if route is None:
            world = self._peer(peer, "send" if sending else "recv")
            if len(self._p2p_routes) >= _P2P_ROUTES:
                self._p2p_routes.clear()
            header = Header(Kind.P2P, self.ctx, 0, tag, nbytes, P2P_FINGERPRINT)
            label = (f"send to rank {peer}" if sending else f"recv from rank {peer}") + \
                f" (tag {tag}) on group {self.name}"
            route = self._p2p_routes[key] = P2PRoute(world, header, header.pack(), label,
                                                     _Done(label, self.runtime.rank))
        return route

    def _peer(self, peer: int, what: str) -> int:
        self._check_member(what)
        if not 0 <= peer < self.size:
            raise InvalidArgumentError(f"rank {self.runtime.rank}: {what}: peer {peer} out of range "
                                       f"for group {self.name} of size {self.size}")
        return self.ranks[peer]

    def _check_member(self, what: str) -> None:
        if self.rank < 0:
            raise InvalidArgumentError(f"rank {self.runtime.rank}: {what}: this rank is not a member of "
                                       f"group {self.name} (ranks {self.ranks})")

    def probe_any(self, tag: int = 0, timeout: float | None = None) -> int:
        """Wait until a point-to-point message with `tag` from any member has arrived; its
        sender's group rank (receive from it next). MPI_Probe with MPI_ANY_SOURCE."""
        self._check_member("recv from any rank")
        peers = {w: r for r, w in enumerate(self.ranks) if r != self.rank}
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        pause = 20e-6
        while True:
            world = self.engine.arrived_from(self.ctx, tag, peers)
            if world is not None:
                return peers[world]
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.runtime.rank}: recv from any rank (tag {tag}) on group "
                                   f"{self.name}: no message arrived within {limit:g} s")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _p2p_wait(self, *reqs: Request, timeout: float | None) -> None:
        t = self.timeout if timeout is None else timeout
        try:
            self.engine.wait(reqs, deadline=time.perf_counter() + t, ctx=self.ctx, seq=P2P_SEQ,
                             watch=tuple(r.peer for r in reqs), what=reqs[0].what)
        except PeerLostError as exc:  # named with the message it ended ('recv from rank 2 (tag 0) ...')
            named = in_call(exc, next((r.what for r in reqs if r.error is exc), reqs[0].what))
            if named is exc:
                raise
            raise named from exc

    def _p2p_work(self, req: Request, route: P2PRoute) -> Work:
        if req.done and req.error is None:  # a small send, already in the ring or the socket,
            return route.done  # or a receive whose message had arrived
        self.engine.watch_in_background(req)
        return _P2PWork(self, req)


class _Done(Work):
    """A request that completed as it was posted: nothing to drive, wait or watch."""

    def __init__(self, what: str, rank: int) -> None:
        super().__init__(what, rank)
        self._done = True


class _QueuedWork(Work):
    """A queued call's Work: whoever waits for it without a time limit runs it if the worker
    has not started it yet (Group.run_until)."""

    def __init__(self, group: Group, what: str) -> None:
        super().__init__(what, group.runtime.rank)
        self._group = group

    def wait(self, timeout: float | None = None) -> bool:
        if not self._done and timeout is None:
            self._group.run_until(self)
        return super().wait(timeout)


class _P2PWork(Work):
    """A point-to-point request as a Work: waiting drives the engine instead of a worker."""

    progresses = False

    def __init__(self, group: Group, req: Request) -> None:
        super().__init__(req.what, group.runtime.rank)
        self._group = group
        self._req = req

    def wait(self, timeout: float | None = None) -> bool:
        if not self._done:
            req = self._req
            if not req.done or req.error is not None:  # else nothing to drive nor raise
                try:
                    self._group._p2p_wait(req, timeout=timeout)
                except TimeoutError:
                    raise  # still pending: the caller may wait again
                except BaseException as exc:
                    self._finish(exc=exc)
                    raise
            self._finish()
            return True
        return super().wait(0)

    def is_completed(self) -> bool:
        """Also one round of progress (as MPI_Test): a caller that polls moves its transfer."""
        req = self._req
        if not req.done:
            engine = self._group.engine
            with engine.lock:
                engine.progress()
        return req.done


def _single_copy_refused(setting: str) -> str:
    """Why this rank offers no single copy to a new group; '' if it does."""
    if setting == "0":
        return "TENSORWIRE_SINGLE_COPY=0"
    return cma.allow_peers()
