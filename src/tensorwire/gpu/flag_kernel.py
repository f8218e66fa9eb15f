"""The one-shot all_reduce, broadcast and all_gather of the device-flag path
(gpu/device_flags.py), as one Triton kernel.

Program p of each rank owns bytes [p * CHUNK_BYTES, (p + 1) * CHUNK_BYTES) of the call (of
one rank's share). It copies that part of its input into its slot of the call's parity (a
broadcast's root only), publishes it with a release store of its flag word, waits (acquire)
until every rank's flag word of program p reaches the call's number, then reads the part out
of the slots: an all_reduce folds every rank's in rank order, so every rank computes the same
bits; a broadcast copies the root's; an all_gather copies each rank's to its place. A flag
word counts the calls its program took part in: the number lives in device memory, so a CUDA
graph replays the kernel with no host in the loop.

A slot of parity q is written again two calls later, once this rank has seen every peer's
flag of the call between: a peer publishes that call only after its previous kernel, the
reads of this slot, has ended (calls of one group run in order on each rank's device).

Each rank also publishes its call's fingerprint (collective, size, dtype, op or root) beside
its flag, one per
parity; a rank that finds a peer's differ, or waits past its limit, or finds the status word
set while it still waits (by the host on an abort, or by another of its programs), leaves its
output untouched and says why in the status words, in pinned host memory that the host reads
without a sync.
"""

from __future__ import annotations

import triton
import triton.language as tl

CHUNK_BYTES = 16 << 10  # one program's part of a call
WORDS = 4  # int64 words per program in a rank's flag area: its call count, a fingerprint per parity
STATUS_WORDS = 4  # what ended a call early, the peer, its fingerprint (or the limit), this rank's
OK, MISMATCH, TIMEOUT, ABORTED = 0, 1, 2, 3
SUM, PRODUCT, MIN, MAX, AVG = 0, 1, 2, 3, 4
ALL_REDUCE, BROADCAST, ALL_GATHER = 0, 1, 2
WIDE = 1 << 62
"""Set in every fingerprint and added to every limit: Triton compiles an integer argument once
per class of width (what fits 32 bits, what needs 64), even where it does not specialize on
its value; both always need 64 bits, so a call's size or timeout costs no compile (a capture
included)."""
_POLL = tl.constexpr(64)  # spins between looks at the status word and the clock
_WIDE = tl.constexpr(WIDE)
_MISMATCH, _TIMEOUT, _PRODUCT, _MIN, _MAX, _AVG, _ALL_REDUCE, _BROADCAST = (
    tl.constexpr(c) for c in (MISMATCH, TIMEOUT, PRODUCT, MIN, MAX, AVG, ALL_REDUCE, BROADCAST))


@triton.jit
def _fold(acc, v, OP: tl.constexpr):
    if OP == _PRODUCT:
        return acc * v
    elif OP == _MIN:  # a NaN wins, as on the host
        return tl.minimum(acc, v, propagate_nan=tl.PropagateNan.ALL)
    elif OP == _MAX:
        return tl.maximum(acc, v, propagate_nan=tl.PropagateNan.ALL)
    else:
        return acc + v


@triton.jit(do_not_specialize=["n", "rank", "root", "fp", "limit"])  # one compile per kind and group size
def one_shot(x, y, table, n, rank, root, fp, limit, NRANKS: tl.constexpr, MODE: tl.constexpr,
             OP: tl.constexpr, ACC: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
             SLOT: tl.constexpr, CLOCK: tl.constexpr):
    """MODE ALL_REDUCE: y = the fold of every rank's x (n elements; y may be x); BROADCAST: y =
    the root's x; ALL_GATHER: y[r * n:(r + 1) * n] = rank r's x. `table` (int64): every rank's
    flag area, then every rank's slots (two of SLOT elements), as this process maps them, then
    the status words. `limit`: WIDE + nanoseconds of waiting for a peer (CLOCK), else spins."""
    pid = tl.program_id(0)
    ty = x.dtype.element_ty
    status = tl.load(table + 2 * NRANKS).to(tl.pointer_type(tl.int64))
    mine = tl.load(table + rank).to(tl.pointer_type(tl.int64)) + pid * 4
    seq = tl.load(mine, volatile=True) + 1
    par = seq & 1
    lo = pid * CHUNK
    slot = tl.load(table + NRANKS + rank).to(tl.pointer_type(ty)) + par * SLOT
    if MODE == _BROADCAST:
        share = rank == root
    else:
        share = True
    if share:
        for i in tl.range(0, CHUNK, BLOCK):
            offs = lo + i + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(slot + offs, tl.load(x + offs, mask=m), mask=m)
    tl.store(mine + 1 + par, fp)
    tl.debug_barrier()  # every thread's part of the slot is written before the flag
    tl.atomic_xchg(mine, seq, sem="release", scope="sys")

    ok = 1  # this program saw every rank's flag and fingerprint agree
    for r in tl.static_range(NRANKS):
        theirs = tl.load(table + r).to(tl.pointer_type(tl.int64)) + pid * 4
        if CLOCK:
            t0 = tl.extra.cuda.globaltimer()
        else:
            t0 = 0
        v = tl.atomic_add(theirs, 0, sem="acquire", scope="sys")
        spins = 0
        while (v < seq) & (ok == 1):
            spins += 1
            if spins % _POLL == 0:
                if CLOCK:
                    late = tl.extra.cuda.globaltimer() - t0 > limit - _WIDE
                else:
                    late = spins > limit - _WIDE
                if tl.load(status, volatile=True) != 0:  # the host, or another program, gave up
                    ok = 0
                elif late:
                    tl.store(status + 1, r)
                    tl.store(status + 2, limit)
                    tl.store(status + 3, fp)
                    tl.store(status, _TIMEOUT)
                    ok = 0
            v = tl.atomic_add(theirs, 0, sem="acquire", scope="sys")
        if ok == 1:
            other = tl.load(theirs + 1 + par, volatile=True)
            if other != fp:
                tl.store(status + 1, r)
                tl.store(status + 2, other)
                tl.store(status + 3, fp)
                tl.store(status, _MISMATCH)
                ok = 0

    if ok == 1:
        for i in tl.range(0, CHUNK, BLOCK):
            offs = lo + i + tl.arange(0, BLOCK)
            m = offs < n
            if MODE == _ALL_REDUCE:
                acc = tl.load(tl.load(table + NRANKS).to(tl.pointer_type(ty)) + par * SLOT + offs, mask=m,
                              cache_modifier=".cg").to(ACC)
                for r in tl.static_range(1, NRANKS):
                    peer = tl.load(table + NRANKS + r).to(tl.pointer_type(ty)) + par * SLOT
                    acc = _fold(acc, tl.load(peer + offs, mask=m, cache_modifier=".cg").to(ACC), OP)
                if OP == _AVG:  # rounded to nearest, as the host divides (float32's `/` is approximate)
                    if ACC.is_fp32():
                        acc = tl.math.div_rn(acc, tl.full([BLOCK], NRANKS, ACC))
                    else:
                        acc = acc / NRANKS
                if ACC.primitive_bitwidth != ty.primitive_bitwidth:  # float16, bfloat16: round once
                    acc = acc.to(ty, fp_downcast_rounding="rtne")
                tl.store(y + offs, acc, mask=m)
            elif MODE == _BROADCAST:
                src = tl.load(table + NRANKS + root).to(tl.pointer_type(ty)) + par * SLOT
                tl.store(y + offs, tl.load(src + offs, mask=m, cache_modifier=".cg"), mask=m)
            else:
                for r in tl.static_range(NRANKS):
                    src = tl.load(table + NRANKS + r).to(tl.pointer_type(ty)) + par * SLOT
                    tl.store(y + r * n + offs, tl.load(src + offs, mask=m, cache_modifier=".cg"), mask=m)
