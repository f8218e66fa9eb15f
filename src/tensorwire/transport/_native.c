/* The direct path's one-shot bodies in C: the same protocol, layout and fold order as
 * transport/segment.py and algorithms/direct_plans.py, which stay the reference (and the whole
 * implementation with TENSORWIRE_NATIVE=0). A Path holds the protocol's state (DirectPath.st),
 * so a planned call is one C call: it enters (takes the next parity once every rank is past
 * the call that last used it), publishes, waits and finishes. Only the common case runs
 * here: every waited-for rank arrives within the spin budget. Anything else is handed back to
 * Python as a status: NOT_ENTERED (nothing done: the previous call is to be settled or a
 * message-path call vetted first), PENDING (published; wait in Python, then finish with
 * fold/copy_out) or the group rank whose stamp differs.
 *
 * Loads and stores of flags and stamps are acquire/release atomics: what x86-64's store order
 * gives the Python path for free, spelt out for any machine. */
#include "_native.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/uio.h>
#include <unistd.h>


/* A protocol call's (seq, a, b, name): its number, fingerprint words and collective. */
typedef struct {
    uint64_t seq, a, b;
    PyObject *name;
} Head;

static inline uint64_t load(const uint64_t *w) { return __atomic_load_n(w, __ATOMIC_ACQUIRE); }
static inline void store(uint64_t *w, uint64_t v) { __atomic_store_n(w, v, __ATOMIC_RELEASE); }

static inline char *slot(const Path *p, int r, int parity) {
    return p->slots + (Py_ssize_t)(2 * r + parity) * p->slot_bytes;
}

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ---- waiting ------------------------------------------------------------------------------- */

/* Whether every other rank (or only rank `only`, if >= 0) has word `word` of its control
 * line (0: the flag) >= seq. */
static int arrived(const Path *p, int only, int word, uint64_t seq) {
    if (only >= 0) return load(p->words + p->lines[only] + word) >= seq;
    for (int r = 0; r < p->size; r++)
        if (r != p->rank && load(p->words + p->lines[r] + word) < seq) return 0;
    return 1;
}

/* Poll until the awaited words reach seq: a short spell holding the interpreter lock (a peer
 * already there costs nothing more), then the rest of the budget (spin_ns; where ranks share
 * cores, the Path's yields) without it. */
static int await_word_for(const Path *p, int only, int word, uint64_t seq, long long spin_ns) {
    for (int i = 0; i < 64; i++)
        if (arrived(p, only, word, seq)) return 1;
    int ok = 0;
    Py_BEGIN_ALLOW_THREADS
    if (p->spin_ns > 0) {
        long long end = now_ns() + spin_ns;
        for (;;) {
            for (int i = 0; i < 256 && !ok; i++) ok = arrived(p, only, word, seq);
            if (ok || now_ns() > end) break;
        }
    } else {
        for (int i = 0; i < p->yields && !ok; i++) {
            sched_yield();
            ok = arrived(p, only, word, seq);
        }
    }
    Py_END_ALLOW_THREADS
    return ok;
}

static int await_word(const Path *p, int only, int word, uint64_t seq) {
    return await_word_for(p, only, word, seq, p->spin_ns);
}

static int await_flags(const Path *p, int only, uint64_t seq) { return await_word(p, only, 0, seq); }

/* Stamp (seq, a, b) beside this rank's flag for `parity`, then store the flag (last). */
static void stamp(const Path *p, uint64_t seq, int parity, uint64_t a, uint64_t b) {
    uint64_t *line = p->words + p->lines[p->rank];
    uint64_t *at = line + STAMP + 3 * parity;
    at[1] = a;
    at[2] = b;
    store(at, seq);
    store(line, seq);
}

/* Publish on the entered parity and note the call as the last published, then wait for
 * `only` (>= 0), everyone else (-1) or no one (-2) up to spin_ns; a status. */
static int round_trip_for(Path *p, const Head *h, int only, long long spin_ns) {
    int parity = p->parity;
    stamp(p, h->seq, parity, h->a, h->b);
    p->prev_seq = h->seq;
    p->prev_a = h->a;
    p->prev_b = h->b;
    if (p->prev_name != h->name) Py_SETREF(p->prev_name, Py_NewRef(h->name));
    p->settled = 0;
    if (only == -2) return DONE;
    if (!await_word_for(p, only, 0, h->seq, spin_ns)) return PENDING;
    for (int r = 0; r < p->size; r++) {
        if (r == p->rank || (only >= 0 && r != only)) continue;
        const uint64_t *at = p->words + p->lines[r] + STAMP + 3 * parity;
        if (load(at) != h->seq || at[1] != h->a || at[2] != h->b) return r;
    }
    p->settled = only == -1;
    return DONE;
}

static int round_trip(Path *p, const Head *h, int only) { return round_trip_for(p, h, only, p->spin_ns); }

/* Whether every other rank published the last call (on the current parity) with its
 * fingerprint; a status. */
static int settle(Path *p) {
    if (!await_flags(p, -1, p->prev_seq)) return PENDING;
    for (int r = 0; r < p->size; r++) {
        const uint64_t *at = p->words + p->lines[r] + STAMP + 3 * p->parity;
        if (r != p->rank && load(at) == p->prev_seq && (at[1] != p->prev_a || at[2] != p->prev_b)) return r;
    }
    p->settled = 1;
    return DONE;
}

/* Take the next parity where nothing is left to vet or wait for first (DirectPath.enter). */
static int enter(Path *p) {
    if (p->unvetted || (!p->settled && settle(p) != DONE)) return 0;
    p->parity ^= 1;
    return 1;
}

/* ---- folds: dst = slot_0 op slot_1 op ... in rank order, elementwise ------------------------ */

typedef void (*fold_fn)(char *dst, const char *first, Py_ssize_t stride, int n, Py_ssize_t count);

/* Signed integers add and multiply as unsigned: numpy wraps, and C leaves signed overflow undefined. */
#define ADD(T, U) (T)((U)x + (U)y)
#define MUL(T, U) (T)((U)x * (U)y)
#define MIN(T, U) (y < x ? y : x)
#define MAX(T, U) (y > x ? y : x)
#define AND(T, U) (T)(x & y)
#define OR(T, U) (T)(x | y)
#define XOR(T, U) (T)(x ^ y)
/* A float op with a NaN operand gives that NaN, quieted, the first operand's where both are
 * (numpy's result on x86); left to the compiler, which may swap a commutative op's operands,
 * the sign and payload of such a NaN could differ from numpy's. */
#define NAN_FIRST_FN(NAME, T, BITS, QUIET)                                                      \
    static inline T NAME(T x, T y, T r) {                                                       \
        if (r == r) return r;                                                                   \
        T n = x != x ? x : y != y ? y : r;                                                      \
        BITS bits;                                                                              \
        memcpy(&bits, &n, sizeof bits);                                                         \
        bits |= (BITS)1 << QUIET;                                                               \
        memcpy(&n, &bits, sizeof n);                                                            \
        return n;                                                                               \
    }
NAN_FIRST_FN(nan_first_f, float, uint32_t, 22)
NAN_FIRST_FN(nan_first_d, double, uint64_t, 51)
#define NAN_FIRST(x, y, r) _Generic((x), float: nan_first_f, double: nan_first_d)(x, y, r)

/* The folds are built for the widest vectors of x86-64 and picked when the module loads (an
 * ifunc: GCC with glibc; elsewhere the baseline build only). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__)
#define WIDE __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define WIDE
#endif
#define FOLD(NAME, T, U, OP)                                                                    \
    WIDE static void NAME(char *dst, const char *first, Py_ssize_t stride, int n, Py_ssize_t count) \
    {                                                                                           \
        T *o = (T *)dst;                                                                        \
        const T *s0 = (const T *)first, *s1 = (const T *)(first + stride);                     \
        for (Py_ssize_t i = 0; i < count; i++) {                                                \
            T x = s0[i], y = s1[i];                                                             \
            o[i] = OP(T, U);                                                                    \
        }                                                                                       \
        for (int r = 2; r < n; r++) {                                                           \
            const T *s = (const T *)(first + r * stride);                                       \
            for (Py_ssize_t i = 0; i < count; i++) {                                            \
                T x = o[i], y = s[i];                                                           \
                o[i] = OP(T, U);                                                                \
            }                                                                                   \
        }                                                                                       \
    }

#define INT_FOLDS(S, T, U)                                                                      \
    FOLD(sum_##S, T, U, ADD) FOLD(prod_##S, T, U, MUL) FOLD(min_##S, T, U, MIN)                 \
    FOLD(max_##S, T, U, MAX) FOLD(band_##S, T, U, AND) FOLD(bor_##S, T, U, OR)                  \
    FOLD(bxor_##S, T, U, XOR)

INT_FOLDS(i8, int8_t, uint8_t)
INT_FOLDS(u8, uint8_t, uint8_t)
INT_FOLDS(i16, int16_t, uint16_t)
INT_FOLDS(u16, uint16_t, uint16_t)
INT_FOLDS(i32, int32_t, uint32_t)
INT_FOLDS(u32, uint32_t, uint32_t)
INT_FOLDS(i64, int64_t, uint64_t)
INT_FOLDS(u64, uint64_t, uint64_t)
/* Floats fold a chunk at a time with a flag of any NaN result: loops the compiler vectorizes.
 * Only a chunk that met a NaN is folded again element by element, the NaN chosen as above; its
 * operands are still in place (a dst that is also an operand is written from a scratch array
 * after the check). */
#define CHUNK 256
#define FLOAT_FOLD(NAME, T, OP)                                                                 \
    WIDE static void NAME##_pair(T *o, const T *s0, const T *s1, Py_ssize_t count) {            \
        T tmp[CHUNK];                                                                           \
        T *to = o == s0 ? tmp : NULL;                                                           \
        for (Py_ssize_t at = 0; at < count; at += CHUNK) {                                      \
            Py_ssize_t m = count - at < CHUNK ? count - at : CHUNK;                             \
            T *out = to != NULL ? to : o + at;                                                  \
            const T *x = s0 + at, *y = s1 + at;                                                 \
            int nan = 0;                                                                        \
            for (Py_ssize_t i = 0; i < m; i++) {                                                \
                T r = x[i] OP y[i];                                                             \
                out[i] = r;                                                                     \
                nan |= r != r;                                                                  \
            }                                                                                   \
            if (nan)                                                                            \
                for (Py_ssize_t i = 0; i < m; i++) out[i] = NAN_FIRST(x[i], y[i], x[i] OP y[i]); \
            if (to != NULL) memcpy(o + at, to, (size_t)m * sizeof(T));                          \
        }                                                                                       \
    }                                                                                           \
    static void NAME(char *dst, const char *first, Py_ssize_t stride, int n, Py_ssize_t count) { \
        T *o = (T *)dst;                                                                        \
        NAME##_pair(o, (const T *)first, (const T *)(first + stride), count);                   \
        for (int r = 2; r < n; r++) NAME##_pair(o, o, (const T *)(first + r * stride), count);  \
    }
FLOAT_FOLD(sum_f32, float, +)
FLOAT_FOLD(prod_f32, float, *)
FLOAT_FOLD(sum_f64, double, +)
FLOAT_FOLD(prod_f64, double, *)

/* Indexed by dtype code * 8 + op code, the codes of transport/native.py's FOLD_CODES. */
#define INT_ROW(S) {NULL, sum_##S, prod_##S, min_##S, max_##S, band_##S, bor_##S, bxor_##S}
static const fold_fn FOLDS[11][8] = {
    {NULL},
    INT_ROW(i8), INT_ROW(u8), INT_ROW(i16), INT_ROW(u16),
    INT_ROW(i32), INT_ROW(u32), INT_ROW(i64), INT_ROW(u64),
    {NULL, sum_f32, prod_f32},
    {NULL, sum_f64, prod_f64},
};
static const int ITEMSIZE[11] = {0, 1, 1, 2, 2, 4, 4, 8, 8, 4, 8};

/* ---- arguments ------------------------------------------------------------------------------ */

static int to_u64(PyObject *o, uint64_t *v) {
    *v = (uint64_t)PyLong_AsUnsignedLongLong(o);
    return !(*v == (uint64_t)-1 && PyErr_Occurred());
}

int to_int(PyObject *o, int lo, int hi, const char *what, int *v) {
    long x = PyLong_AsLong(o);
    if (x == -1 && PyErr_Occurred()) return 0;
    if (x < lo || x >= hi) {
        PyErr_Format(PyExc_ValueError, "%s %ld out of range [%d, %d)", what, x, lo, hi);
        return 0;
    }
    *v = (int)x;
    return 1;
}

/* (seq, a, b, name) leading every protocol call. */
static int head(PyObject *const *args, Head *h) {
    h->name = args[3];
    return to_u64(args[0], &h->seq) && to_u64(args[1], &h->a) && to_u64(args[2], &h->b);
}

/* A C-contiguous buffer of at most the slot's bytes; `writable` for outputs. */
static int buffer(const Path *p, PyObject *o, int writable, Py_buffer *view) {
    if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return 0;
    if (view->len > p->slot_bytes) {
        PyErr_Format(PyExc_ValueError, "%zd bytes do not fit the %zd-byte slot", view->len, p->slot_bytes);
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

static fold_fn fold_of(PyObject *o, Py_ssize_t nbytes, Py_ssize_t *count) {
    long code = PyLong_AsLong(o);
    if (code == -1 && PyErr_Occurred()) return NULL;
    fold_fn f = code > 0 && code < 11 * 8 ? FOLDS[code / 8][code % 8] : NULL;
    if (f == NULL) {
        PyErr_Format(PyExc_ValueError, "no fold with code %ld", code);
        return NULL;
    }
    *count = nbytes / ITEMSIZE[code / 8];
    return f;
}

static PyObject *status(int s) { return PyLong_FromLong(s); }

/* ---- the bodies ----------------------------------------------------------------------------- */

/* Ranks that fold the same slots at once contend for their cache lines: from SPREAD_FROM bytes
 * each rank folds its own 1/n of the elements first, then the others' in turn (each element
 * still folds in rank order: the same result; docs/design/segment.md#reading-the-slots). */
#define SPREAD_FROM (8 << 10)

/* dst = every slot of `parity` folded in rank order (a group of one has nothing to fold). */
static void fold_into(const Path *p, fold_fn f, int parity, Py_buffer *dst, Py_ssize_t count) {
    const char *first = slot(p, 0, parity);
    if (p->size == 1) {
        memcpy(dst->buf, first, (size_t)dst->len);
        return;
    }
    if (dst->len < SPREAD_FROM) {
        f(dst->buf, first, 2 * p->slot_bytes, p->size, count);
        return;
    }
    Py_ssize_t item = dst->len / count, part = ((count + p->size - 1) / p->size + 63) & ~(Py_ssize_t)63;
    for (int i = 0; i < p->size; i++) {
        Py_ssize_t lo = part * ((p->rank + i) % p->size), left = count - lo;
        if (left > 0)
            f((char *)dst->buf + lo * item, first + lo * item, 2 * p->slot_bytes, p->size, left < part ? left : part);
    }
}

/* (seq, a, b, name, src, dst, code, ...): enter, copy src into this rank's slot and publish;
 * where this rank `folds`, wait for everyone and fold every slot into dst (read only then). */
static PyObject *publish_and_fold(Path *self, PyObject *const *args, int folds) {
    Head h;
    int s;
    Py_buffer src, dst;
    Py_ssize_t count = 0;
    fold_fn f = NULL;
    if (!head(args, &h) || !buffer(self, args[4], 0, &src)) return NULL;
    if (folds) {
        if (!buffer(self, args[5], 1, &dst)) {
            PyBuffer_Release(&src);
            return NULL;
        }
        f = fold_of(args[6], dst.len, &count);
        if (f != NULL && src.len != dst.len) {
            PyErr_SetString(PyExc_ValueError, "src and dst differ in size");
            f = NULL;
        }
        if (f == NULL) {
            PyBuffer_Release(&dst);
            PyBuffer_Release(&src);
            return NULL;
        }
    }
    if (!enter(self)) {
        s = NOT_ENTERED;
    } else {
        memcpy(slot(self, self->rank, self->parity), src.buf, (size_t)src.len);
        s = round_trip(self, &h, folds ? -1 : -2);
        if (folds && s == DONE) fold_into(self, f, self->parity, &dst, count);
    }
    PyBuffer_Release(&src);
    if (folds) PyBuffer_Release(&dst);
    return status(s);
}

/* all_reduce(seq, a, b, name, src, dst, code): every rank folds. */
PyObject *Path_all_reduce(Path *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) return PyErr_Format(PyExc_TypeError, "all_reduce takes 7 arguments");
    return publish_and_fold(self, args, 1);
}

/* reduce(seq, a, b, name, src, dst, code, root): the root folds. */
PyObject *Path_reduce(Path *self, PyObject *const *args, Py_ssize_t nargs) {
    int root;
    if (nargs != 8) return PyErr_Format(PyExc_TypeError, "reduce takes 8 arguments");
    if (!to_int(args[7], 0, self->size, "root", &root)) return NULL;
    return publish_and_fold(self, args, self->rank == root);
}

/* broadcast(seq, a, b, name, src, dst, root): the root copies src into its slot and
 * publishes, then fills dst from the slot unless dst is src; the others wait for the root
 * and copy its slot into dst. */
PyObject *Path_broadcast(Path *self, PyObject *const *args, Py_ssize_t nargs) {
    Head h;
    int root, s;
    Py_buffer view;
    if (nargs != 7) return PyErr_Format(PyExc_TypeError, "broadcast takes 7 arguments");
    if (!head(args, &h) || !to_int(args[6], 0, self->size, "root", &root)) return NULL;
    if (self->rank == root) {
        if (!buffer(self, args[4], 0, &view)) return NULL;
        if (!enter(self)) {
            PyBuffer_Release(&view);
            return status(NOT_ENTERED);
        }
        memcpy(slot(self, root, self->parity), view.buf, (size_t)view.len);
        PyBuffer_Release(&view);
        s = round_trip(self, &h, -2);
        if (args[5] == args[4]) return status(s);
    } else {
        if (!enter(self)) return status(NOT_ENTERED);
        s = round_trip(self, &h, root);
        if (s != DONE) return status(s);
    }
    if (!buffer(self, args[5], 1, &view)) return NULL;
    memcpy(view.buf, slot(self, root, self->parity), (size_t)view.len);
    PyBuffer_Release(&view);
    return status(s);
}

/* copy `from` into the buffer `o` (a block of the caller's list), which must hold `len` bytes. */
static int fill(const Path *p, PyObject *o, const char *from, Py_ssize_t len) {
    Py_buffer view;
    if (!buffer(p, o, 1, &view)) return 0;
    int ok = view.len == len;
    if (ok)
        memcpy(view.buf, from, (size_t)len);
    else
        PyErr_Format(PyExc_ValueError, "a block of %zd bytes where %zd were expected", view.len, len);
    PyBuffer_Release(&view);
    return ok;
}

/* gather(seq, a, b, name, send, blocks, root): every rank but the root copies send into its
 * slot and publishes; the root fills its own block from send (unless it is send), waits for
 * everyone and copies each slot into its block (blocks: the root's list of size ranks, None
 * elsewhere). */
PyObject *Path_gather(Path *self, PyObject *const *args, Py_ssize_t nargs) {
    Head h;
    int root, s;
    Py_buffer send;
    if (nargs != 7) return PyErr_Format(PyExc_TypeError, "gather takes 7 arguments");
    if (!head(args, &h) || !to_int(args[6], 0, self->size, "root", &root) || !buffer(self, args[4], 0, &send))
        return NULL;
    Py_ssize_t len = send.len;
    PyObject *blocks = args[5];
    if (self->rank == root && (!PyList_Check(blocks) || PyList_GET_SIZE(blocks) != self->size)) {
        PyBuffer_Release(&send);
        return PyErr_Format(PyExc_ValueError, "the root's blocks must be a list of %d", self->size);
    }
    if (!enter(self)) {
        PyBuffer_Release(&send);
        return status(NOT_ENTERED);
    }
    if (self->rank != root) {
        memcpy(slot(self, self->rank, self->parity), send.buf, (size_t)len);
        PyBuffer_Release(&send);
        return status(round_trip(self, &h, -2));
    }
    PyObject *own = PyList_GET_ITEM(blocks, root);
    int ok = own == args[4] || fill(self, own, send.buf, len);
    PyBuffer_Release(&send);
    if (!ok) return NULL;
    s = round_trip(self, &h, -1);
    for (int r = 0; s == DONE && r < self->size; r++)
        if (r != root && !fill(self, PyList_GET_ITEM(blocks, r), slot(self, r, self->parity), len)) return NULL;
    return status(s);
}

/* scatter(seq, a, b, name, blocks, recv, root, starts): the root writes `starts` (where each
 * rank's block begins in its slot, uint64 per rank: the table the Python bodies write and
 * read) and every other rank's block after it, publishes, then fills recv from its own block
 * (unless it is recv); the others wait for the root and copy their block into recv. */
PyObject *Path_scatter(Path *self, PyObject *const *args, Py_ssize_t nargs) {
    Head h;
    int root, s = DONE;
    Py_buffer table, recv, view;
    if (nargs != 8) return PyErr_Format(PyExc_TypeError, "scatter takes 8 arguments");
    if (!head(args, &h) || !to_int(args[6], 0, self->size, "root", &root) || !buffer(self, args[7], 0, &table))
        return NULL;
    if (!buffer(self, args[5], 1, &recv)) {
        PyBuffer_Release(&table);
        return NULL;
    }
    const uint64_t *starts = table.buf;
    PyObject *blocks = args[4];
    int ok = table.len == 8 * (Py_ssize_t)self->size;
    for (int r = 0; ok && r < self->size; r++)
        ok = r == root || starts[r] + (uint64_t)recv.len <= (uint64_t)self->slot_bytes;
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "starts do not place the blocks within the slot");
    } else if (self->rank == root && (!PyList_Check(blocks) || PyList_GET_SIZE(blocks) != self->size)) {
        PyErr_Format(PyExc_ValueError, "the root's blocks must be a list of %d", self->size);
        ok = 0;
    } else if (!enter(self)) {
        s = NOT_ENTERED;
    } else if (self->rank != root) {
        s = round_trip(self, &h, root);
        if (s == DONE) memcpy(recv.buf, slot(self, root, self->parity) + starts[self->rank], (size_t)recv.len);
    } else {
        char *base = slot(self, root, self->parity);
        memcpy(base, starts, (size_t)table.len);
        for (int r = 0; ok && r < self->size; r++) {
            if (r == root) continue;
            if (!(ok = buffer(self, PyList_GET_ITEM(blocks, r), 0, &view))) break;
            if (!(ok = view.len == recv.len))
                PyErr_Format(PyExc_ValueError, "a block of %zd bytes where %zd were expected", view.len,
                             recv.len);
            else
                memcpy(base + starts[r], view.buf, (size_t)view.len);
            PyBuffer_Release(&view);
        }
        if (ok) s = round_trip(self, &h, -2);
    }
    PyBuffer_Release(&table);
    PyBuffer_Release(&recv);
    if (!ok) return NULL;
    if (s != NOT_ENTERED && self->rank == root && PyList_GET_ITEM(blocks, root) != args[5]) {
        if (!buffer(self, PyList_GET_ITEM(blocks, root), 0, &view)) return NULL;
        ok = fill(self, args[5], view.buf, view.len);
        PyBuffer_Release(&view);
        if (!ok) return NULL;
    }
    return status(s);
}

/* exchange(seq, a, b, name, src, dst, offset, block, code): every rank copies src into its
 * slot, publishes and waits for everyone; then takes `block` bytes from `offset` of every
 * slot: into dst back to back in rank order (code 0: all_gather, all_to_all), or folded in
 * rank order into dst (a fold code: reduce_scatter). TensorPlan.run's one-shot body. */
PyObject *Path_exchange(Path *self, PyObject *const *args, Py_ssize_t nargs) {
    Head h;
    Py_buffer src, dst;
    Py_ssize_t offset, block, count = 0;
    fold_fn f = NULL;
    int s;
    if (nargs != 9) return PyErr_Format(PyExc_TypeError, "exchange takes 9 arguments");
    if (!head(args, &h)) return NULL;
    offset = PyLong_AsSsize_t(args[6]);
    block = PyLong_AsSsize_t(args[7]);
    if ((offset == -1 || block == -1) && PyErr_Occurred()) return NULL;
    if (offset < 0 || block < 0 || offset + block > self->slot_bytes)
        return PyErr_Format(PyExc_ValueError, "a block of %zd bytes at %zd leaves the %zd-byte slot", block,
                            offset, self->slot_bytes);
    int folds = PyObject_IsTrue(args[8]); /* a fold code, or 0: copies */
    if (folds < 0 || (folds && (f = fold_of(args[8], block, &count)) == NULL)) return NULL;
    if (!buffer(self, args[4], 0, &src)) return NULL;
    if (PyObject_GetBuffer(args[5], &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (dst.len != (f != NULL ? block : block * self->size)) {
        PyErr_Format(PyExc_ValueError, "dst has %zd bytes where %zd were expected", dst.len,
                     f != NULL ? block : block * self->size);
        s = 0;
    } else if (!enter(self)) {
        s = NOT_ENTERED;
    } else {
        memcpy(slot(self, self->rank, self->parity), src.buf, (size_t)src.len);
        s = round_trip(self, &h, -1);
        if (s == DONE && f != NULL && self->size > 1)
            f(dst.buf, slot(self, 0, self->parity) + offset, 2 * self->slot_bytes, self->size, count);
        else if (s == DONE)
            for (int i = 0; i < self->size; i++) { /* its own slot first, not everyone's first at once */
                int r = (self->rank + i) % self->size;
                memcpy((char *)dst.buf + r * block, slot(self, r, self->parity) + offset, (size_t)block);
            }
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return PyErr_Occurred() ? NULL : status(s);
}

/* round(seq, a, b, name, whom): publish on the parity DirectPath.enter took, then wait for
 * everyone else (-1), rank `whom` (>= 0) or no one (-2): DirectPath.publish of any body. */
static PyObject *Path_round(Path *self, PyObject *const *args, Py_ssize_t nargs) {
    Head h;
    int whom;
    if (nargs != 5) return PyErr_Format(PyExc_TypeError, "round takes 5 arguments");
    if (!head(args, &h) || !to_int(args[4], -2, self->size, "whom", &whom)) return NULL;
    return status(round_trip(self, &h, whom));
}

/* barrier(seq, a, b, name): enter, publish and wait for everyone else. */
PyObject *Path_barrier(Path *self, PyObject *const *args, Py_ssize_t nargs) {
    Head h;
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "barrier takes 4 arguments");
    if (!head(args, &h)) return NULL;
    return status(enter(self) ? round_trip(self, &h, -1) : NOT_ENTERED);
}

/* settle(): wait for everyone else to have published the last call, which this rank
 * published without waiting for all (DirectPath.settle_previous); a rank that stamped it
 * otherwise is returned. */
static PyObject *Path_settle(Path *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)args;
    if (nargs != 0) return PyErr_Format(PyExc_TypeError, "settle takes no arguments");
    return status(settle(self));
}

/* fold(parity, dst, code): finish an all_reduce or a root's reduce after a wait in Python. */
static PyObject *Path_fold(Path *self, PyObject *const *args, Py_ssize_t nargs) {
    int parity;
    Py_buffer dst;
    Py_ssize_t count;
    if (nargs != 3) return PyErr_Format(PyExc_TypeError, "fold takes 3 arguments");
    if (!to_int(args[0], 0, 2, "parity", &parity) || !buffer(self, args[1], 1, &dst)) return NULL;
    fold_fn f = fold_of(args[2], dst.len, &count);
    if (f != NULL) fold_into(self, f, parity, &dst, count);
    PyBuffer_Release(&dst);
    if (f == NULL) return NULL;
    Py_RETURN_NONE;
}

/* ---- a pair's ring: the small point-to-point message (transport/shm.py) ---------------------- */

#define HEADER 64  /* wire.HEADER_SIZE: a record's header, and the ring's alignment */
#define HEAD_WORD 0
#define TAIL_WORD 8

/* The ring segment `o` (its whole mapping) as words, and its data: `at` bytes in, `capacity`
 * long; the header `h` as 64 bytes. */
static int ring_args(PyObject *const *args, Py_buffer *ring, uint64_t **words, char **data,
                     uint64_t *capacity, const char **header) {
    Py_ssize_t at = PyLong_AsSsize_t(args[1]), cap = PyLong_AsSsize_t(args[2]);
    if ((at == -1 || cap == -1) && PyErr_Occurred()) return 0;
    if (!PyBytes_Check(args[3]) || PyBytes_GET_SIZE(args[3]) != HEADER) {
        PyErr_SetString(PyExc_ValueError, "a header is 64 bytes");
        return 0;
    }
    if (PyObject_GetBuffer(args[0], ring, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return 0;
    if (at < (TAIL_WORD + 1) * 8 || cap <= 0 || cap % HEADER || at > ring->len - cap) {
        PyBuffer_Release(ring);
        PyErr_SetString(PyExc_ValueError, "the ring does not fit its segment");
        return 0;
    }
    *words = ring->buf;
    *data = (char *)ring->buf + at;
    *capacity = (uint64_t)cap;
    *header = PyBytes_AS_STRING(args[3]);
    return 1;
}

static inline uint64_t padded(uint64_t n) { return (n + 63) & ~(uint64_t)63; }

/* Write `payload` as one record (the header, then the payload) at the ring's head where it
 * fits (ShmChannel._put without a descriptor); whether it did. Records are 64-aligned, so
 * the header never wraps; the payload may, past the ring's end to its start. */
static int put_record(uint64_t *words, char *data, uint64_t cap, const char *header, const Py_buffer *payload) {
    uint64_t head = words[HEAD_WORD], n = (uint64_t)payload->len, end = head + HEADER + padded(n);
    if (end - load(words + TAIL_WORD) > cap) return 0;
    uint64_t pos = head % cap, at = (pos + HEADER) % cap, first = n < cap - at ? n : cap - at;
    memcpy(data + pos, header, HEADER);
    memcpy(data + at, payload->buf, (size_t)first);
    memcpy(data, (const char *)payload->buf + first, (size_t)(n - first));
    store(words + HEAD_WORD, end);
    return 1;
}

/* How many bytes past `tail` the writer has published, polled for up to spin_ns (without the
 * interpreter lock) until that is `want`. */
static uint64_t await_head(const uint64_t *words, uint64_t tail, uint64_t want, long long spin_ns) {
    uint64_t avail = load(words + HEAD_WORD) - tail;
    if (avail >= want || spin_ns <= 0) return avail;
    Py_BEGIN_ALLOW_THREADS
    long long end = now_ns() + spin_ns;
    for (;;) {
        for (int i = 0; i < 256 && avail < want; i++) avail = load(words + HEAD_WORD) - tail;
        if (avail >= want || now_ns() > end) break;
    }
    Py_END_ALLOW_THREADS
    return avail;
}

/* Read the record at the ring's tail into dst where its header is `header` byte for byte and
 * it lies whole in the ring (its payload may wrap), waiting up to spin_ns for it
 * (ShmChannel.take_now): 1 taken, 0 another record comes first, -1 nothing whole yet. */
static int take_record(uint64_t *words, const char *data, uint64_t cap, const char *header, Py_buffer *dst,
                       long long spin_ns) {
    uint64_t tail = words[TAIL_WORD], n = (uint64_t)dst->len, end = tail + HEADER + padded(n);
    uint64_t avail = await_head(words, tail, HEADER, spin_ns), pos = tail % cap;
    if (avail < HEADER) return -1;
    if (memcmp(data + pos, header, HEADER) != 0 || end - tail > cap) return 0; /* never whole: too large */
    if (avail < end - tail && await_head(words, tail, end - tail, spin_ns) < end - tail) return -1;
    uint64_t at = (pos + HEADER) % cap, first = n < cap - at ? n : cap - at;
    memcpy(dst->buf, data + at, (size_t)first);
    memcpy((char *)dst->buf + first, data, (size_t)(n - first));
    store(words + TAIL_WORD, end);
    return 1;
}

/* ring_put(segment, at, capacity, header, payload) -> bool: put_record; False leaves the
 * message to the general path. */
static PyObject *ring_put(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer ring, payload;
    uint64_t *words, cap;
    char *data;
    const char *header;
    (void)module;
    if (nargs != 5) return PyErr_Format(PyExc_TypeError, "ring_put takes 5 arguments");
    if (!ring_args(args, &ring, &words, &data, &cap, &header)) return NULL;
    if (PyObject_GetBuffer(args[4], &payload, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&ring);
        return NULL;
    }
    int fits = put_record(words, data, cap, header, &payload);
    PyBuffer_Release(&payload);
    PyBuffer_Release(&ring);
    return PyBool_FromLong(fits);
}

/* ring_take(segment, at, capacity, header, dst, spin_ns) -> True, False or None: take_record
 * (False: another record comes first; None: nothing whole yet). */
static PyObject *ring_take(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer ring, dst;
    uint64_t *words, cap;
    char *data;
    const char *header;
    (void)module;
    if (nargs != 6) return PyErr_Format(PyExc_TypeError, "ring_take takes 6 arguments");
    long long spin_ns = PyLong_AsLongLong(args[5]);
    if (spin_ns == -1 && PyErr_Occurred()) return NULL;
    if (!ring_args(args, &ring, &words, &data, &cap, &header)) return NULL;
    if (PyObject_GetBuffer(args[4], &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&ring);
        return NULL;
    }
    int taken = take_record(words, data, cap, header, &dst, spin_ns);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&ring);
    PyObject *result = taken > 0 ? Py_True : taken == 0 ? Py_False : Py_None;
    return Py_NewRef(result);
}

/* ring_sendrecv(out_segment, at, capacity, header, payload, in_segment, at, capacity, header,
 * dst, spin_ns) -> int: put_record into the out ring, then take_record from the in ring (a
 * small MPI_Sendrecv, ShmChannel.exchange_now): 2 both done, 1 put only, 0 neither; -1 neither,
 * for a payload that is not C-contiguous or a dst that is not that or writable, which the
 * general path names. */
PyObject *ring_sendrecv(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer out, in, payload, dst;
    uint64_t *out_words, *in_words, out_cap, in_cap;
    char *out_data, *in_data;
    const char *out_header, *in_header;
    (void)module;
    if (nargs != 11) return PyErr_Format(PyExc_TypeError, "ring_sendrecv takes 11 arguments");
    long long spin_ns = PyLong_AsLongLong(args[10]);
    if (spin_ns == -1 && PyErr_Occurred()) return NULL;
    if (!ring_args(args, &out, &out_words, &out_data, &out_cap, &out_header)) return NULL;
    if (!ring_args(args + 5, &in, &in_words, &in_data, &in_cap, &in_header)) {
        PyBuffer_Release(&out);
        return NULL;
    }
    int s = -1;
    if (PyObject_GetBuffer(args[4], &payload, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
    } else {
        if (PyObject_GetBuffer(args[9], &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
        } else {
            s = put_record(out_words, out_data, out_cap, out_header, &payload);
            if (s) s += take_record(in_words, in_data, in_cap, in_header, &dst, spin_ns) > 0;
            PyBuffer_Release(&dst);
        }
        PyBuffer_Release(&payload);
    }
    PyBuffer_Release(&in);
    PyBuffer_Release(&out);
    return PyLong_FromLong(s);
}

/* Copy n bytes from address `remote` of process `pid` into `local` (cross-memory attach,
 * cma._read): 0, or the errno that stopped it. */
static int read_span(long pid, char *local, uint64_t remote, size_t n) {
    while (n) {
        struct iovec lv = {local, n}, rv = {(void *)(uintptr_t)remote, n};
        ssize_t got = process_vm_readv((pid_t)pid, &lv, 1, &rv, 1, 0);
        if (got <= 0) return got < 0 ? errno : EFAULT;
        local += got;
        remote += (uint64_t)got;
        n -= (size_t)got;
    }
    return 0;
}

#define READ_HELD (64 << 10) /* below it a read is short and keeps the interpreter lock */

/* read_span, the interpreter lock released where the read is large. */
static int read_peer(long pid, char *local, uint64_t remote, size_t n) {
    if (n < READ_HELD) return read_span(pid, local, remote, n);
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = read_span(pid, local, remote, n);
    Py_END_ALLOW_THREADS
    return err;
}

#define READ_WORD 2   /* a control line's READ progress word (segment.READ) */
#define CHUNK_BITS 24 /* segment.CHUNK_BITS */

/* memcpy, the interpreter lock released where the copy is large. */
static void copy_bytes(char *dst, const char *src, size_t n) {
    if (n < READ_HELD) {
        memcpy(dst, src, n);
        return;
    }
    Py_BEGIN_ALLOW_THREADS
    memcpy(dst, src, n);
    Py_END_ALLOW_THREADS
}

/* The single copy bodies that only move bytes (algorithms/single_copy.py, _move): enter, write
 * `table` (the addresses peers read, then the huge-page share) into this rank's slot, publish
 * and wait for everyone; read each of `reads` out of its source (`pid`: every rank's process);
 * copy llen bytes from lsrc to ldst (none: NULL); mark this rank's reads done and wait until
 * `whom` (every other rank: -1, a rank, no one: -2) read this rank's buffers. Besides DONE,
 * NOT_ENTERED and a rank whose stamp differs: PENDING (published: the wait and the rest to
 * Python), SETTLED (everyone there, nothing kept of the reads: one failed, or lies in the
 * window `alias` (0: none) of a CPU slow there; Python reads again, and raises or bounces as
 * its path does) or COPIED (read and marked: Python waits for the readers). */
static int moves(Path *self, const Head *h, const uint64_t *table, Py_ssize_t words, const uint64_t *pid,
                 Read *reads, Py_ssize_t count, int whom, char *ldst, const char *lsrc, Py_ssize_t llen,
                 uint64_t alias) {
    if (!enter(self)) return NOT_ENTERED;
    int parity = self->parity, s = DONE;
    memcpy(slot(self, self->rank, parity), table, (size_t)words * 8);
    if ((s = round_trip_for(self, h, -1, self->wait_ns)) != DONE) return s;
    for (Py_ssize_t k = 0; k < count; k++) {
        Read *r = reads + k;
        r->remote = ((const uint64_t *)slot(self, r->source, parity))[r->index];
        uint64_t off = ((uint64_t)(uintptr_t)r->dst - r->remote) % 4096;
        if (r->len && off && off < alias) return SETTLED;
    }
    for (Py_ssize_t k = 0; k < count; k++)
        if (reads[k].len && read_peer((long)pid[reads[k].source], reads[k].dst, reads[k].remote, (size_t)reads[k].len))
            return SETTLED;
    if (ldst != NULL) copy_bytes(ldst, lsrc, (size_t)llen);
    uint64_t target = (h->seq << CHUNK_BITS) + 1;
    store(self->words + self->lines[self->rank] + READ_WORD, target);
    return whom == -2 || await_word_for(self, whom, READ_WORD, target, self->wait_ns) ? DONE : COPIED;
}

/* The processes of `pids` (a tuple of every rank's) into pid; 0 with an exception otherwise. */
static int pids_of(const Path *p, PyObject *pids, uint64_t *pid) {
    if (!PyTuple_Check(pids) || PyTuple_GET_SIZE(pids) != p->size) {
        PyErr_SetString(PyExc_TypeError, "pids: a tuple of every rank's process");
        return 0;
    }
    for (int r = 0; r < p->size; r++)
        if (!to_u64(PyTuple_GET_ITEM(pids, r), pid + r)) return 0;
    return 1;
}

/* single_copy(seq, a, b, name, table, pids, reads, whom, local, alias) -> status: `moves` for
 * Python's single copy bodies, `reads` flat (source, index, dst) and `local` (dst, src) or None. */
static PyObject *Path_single_copy(Path *self, PyObject *const *args, Py_ssize_t nargs) {
    Head h;
    int whom, s = DONE;
    uint64_t alias;
    if (nargs != 10) return PyErr_Format(PyExc_TypeError, "single_copy takes 10 arguments");
    PyObject *table = args[4], *reads = args[6], *local = args[8];
    if (!head(args, &h) || !to_int(args[7], -2, self->size, "whom", &whom) || !to_u64(args[9], &alias)) return NULL;
    if (!PyTuple_Check(table) || !PyTuple_Check(reads) || PyTuple_GET_SIZE(reads) % 3 ||
        (local != Py_None && (!PyTuple_Check(local) || PyTuple_GET_SIZE(local) != 2)))
        return PyErr_Format(PyExc_TypeError, "single_copy: bad arguments");
    Py_ssize_t words = PyTuple_GET_SIZE(table), count = PyTuple_GET_SIZE(reads) / 3, held = 0;
    if (words * 8 > self->slot_bytes) return PyErr_Format(PyExc_ValueError, "the table outgrows the slot");
    /* one block: the buffers, the reads, the table and the processes */
    Py_buffer *buf = PyMem_Calloc(1, ((size_t)count + 2) * sizeof(Py_buffer) + (size_t)count * sizeof(Read) +
                                         (size_t)(words + self->size) * 8);
    if (buf == NULL) return PyErr_NoMemory();
    Read *rd = (Read *)(buf + count + 2);
    uint64_t *vals = (uint64_t *)(rd + count);
    if (!pids_of(self, args[5], vals + words)) goto out;
    for (Py_ssize_t i = 0; i < words; i++)
        if (!to_u64(PyTuple_GET_ITEM(table, i), vals + i)) goto out;
    for (Py_ssize_t k = 0; k < count; k++) {
        if (!to_int(PyTuple_GET_ITEM(reads, 3 * k), 0, self->size, "source", &rd[k].source) ||
            !to_int(PyTuple_GET_ITEM(reads, 3 * k + 1), 0, (int)(self->slot_bytes / 8), "index", &rd[k].index) ||
            PyObject_GetBuffer(PyTuple_GET_ITEM(reads, 3 * k + 2), buf + held, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto out;
        rd[k].dst = buf[held].buf;
        rd[k].len = buf[held++].len;
    }
    char *ldst = NULL, *lsrc = NULL;
    if (local != Py_None) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(local, 0), buf + held, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto out;
        ldst = buf[held++].buf;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(local, 1), buf + held, PyBUF_C_CONTIGUOUS) < 0) goto out;
        lsrc = buf[held++].buf;
        if (buf[held - 1].len != buf[held - 2].len) {
            PyErr_SetString(PyExc_ValueError, "single_copy: the local copy's sizes differ");
            goto out;
        }
    }
    s = moves(self, &h, vals, words, vals + words, rd, count, whom, ldst, lsrc, held ? buf[held - 1].len : 0, alias);
out:
    while (held--) PyBuffer_Release(buf + held);
    PyMem_Free(buf);
    return PyErr_Occurred() ? NULL : status(s);
}

/* ---- single copy's planned calls (the compiled caller's) ------------------------------------ */

static int meets(const char *a, Py_ssize_t an, const char *b, Py_ssize_t bn) {
    return an > 0 && bn > 0 && a < b + bn && b < a + an;
}

static int hold(Moves *m, PyObject *o, int writable, Py_buffer **view) {
    if (PyObject_GetBuffer(o, m->buf + m->held, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return 0;
    *view = m->buf + m->held++;
    return 1;
}

/* A list of the group's size, each item's buffer held (writable where asked). */
static int hold_list(Moves *m, const Path *p, PyObject *list, int writable, Py_buffer **first) {
    if (!PyList_Check(list) || PyList_GET_SIZE(list) != p->size) {
        PyErr_SetString(PyExc_TypeError, "a list of one block per rank");
        return 0;
    }
    Py_buffer *view;
    for (int r = 0; r < p->size; r++) {
        if (!hold(m, PyList_GET_ITEM(list, r), writable, &view)) return 0;
        if (r == 0) *first = view;
    }
    return 1;
}

/* The share of huge pages of what peers read (transport/pages.py's PageScanner.eighths, the
 * same rule, its own answers kept PAGES_KEEP_S per span): PAGEMAP_SCAN on /proc/self/pagemap. */
#define PAGE_IS_PRESENT (1 << 3)
#define PAGE_IS_PFNZERO (1 << 5)
#define PAGE_IS_HUGE (1 << 6)
#define PAGES_RUNS 16
#define PAGES_KEPT 16
#define PAGES_KEEP_S 0.05
typedef struct { uint64_t start, end, categories; } PageRun;
typedef struct {
    uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages, category_inverted, category_mask,
        category_anyof_mask, return_mask;
} PageScan; /* struct pm_scan_arg, linux/fs.h */
#define PAGEMAP_SCAN_IOCTL ((3UL << 30) | ((unsigned long)sizeof(PageScan) << 16) | ('f' << 8) | 16)
typedef struct { uint64_t at, len, huge, present; double when; } PagesKept;

static struct {
    int fd, broken;
    pid_t pid; /* whose pagemap fd is: a forked child opens its own */
    PagesKept kept[PAGES_KEPT];
    int next;
} pagemap = {.fd = -1};

/* Bytes of [at, at + len) in huge pages and there at all, into *huge and *present; 0 where the
 * kernel cannot tell. The GIL serialises callers. */
static int pages_of(uint64_t at, uint64_t len, uint64_t *huge, uint64_t *present) {
    if (pagemap.broken) return 0;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double now = (double)ts.tv_sec + ts.tv_nsec * 1e-9;
    pid_t me = getpid();
    if (pagemap.pid != me) {
        if (pagemap.fd >= 0) close(pagemap.fd);
        memset(pagemap.kept, 0, sizeof pagemap.kept);
        pagemap.pid = me;
        pagemap.fd = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
        if (pagemap.fd < 0) {
            pagemap.broken = 1;
            return 0;
        }
    }
    for (int i = 0; i < PAGES_KEPT; i++) {
        PagesKept *k = &pagemap.kept[i];
        if (k->at == at && k->len == len && k->when > 0 && now - k->when <= PAGES_KEEP_S) {
            *huge += k->huge;
            *present += k->present;
            return 1;
        }
    }
    uint64_t lo = at & ~4095ULL, hi = (at + len + 4095) & ~4095ULL, h = 0, there = 0;
    PageRun runs[PAGES_RUNS];
    PageScan arg = {.size = sizeof arg, .vec = (uint64_t)(uintptr_t)runs, .vec_len = PAGES_RUNS,
                    .category_mask = PAGE_IS_PRESENT,
                    .return_mask = PAGE_IS_PRESENT | PAGE_IS_PFNZERO | PAGE_IS_HUGE};
    while (lo < hi) {
        arg.start = lo;
        arg.end = hi;
        int got = ioctl(pagemap.fd, PAGEMAP_SCAN_IOCTL, &arg);
        if (got < 0) { /* ENOTTY / EINVAL before Linux 6.7 */
            pagemap.broken = 1;
            return 0;
        }
        for (int i = 0; i < got; i++) {
            if (runs[i].categories & PAGE_IS_PFNZERO) continue;
            uint64_t from = runs[i].start > at ? runs[i].start : at;
            uint64_t to = runs[i].end < at + len ? runs[i].end : at + len;
            uint64_t overlap = to > from ? to - from : 0;
            there += overlap;
            if (runs[i].categories & PAGE_IS_HUGE) h += overlap;
        }
        if (got < PAGES_RUNS || arg.walk_end >= hi) break;
        lo = arg.walk_end;
    }
    pagemap.kept[pagemap.next] = (PagesKept){at, len, h, there, now};
    pagemap.next = (pagemap.next + 1) % PAGES_KEPT;
    *huge += h;
    *present += there;
    return 1;
}

/* The word a table carries for the `count` buffers peers read: `unknown` unless it is
 * PAGES_SCAN; then eighths (0-8) of their present bytes in huge pages, 8 where they are empty,
 * PAGES_UNKNOWN where the kernel cannot tell or nothing is there yet. */
static uint64_t pages_word(uint64_t unknown, const Py_buffer *spans, int count) {
    if (unknown != PAGES_SCAN) return unknown;
    uint64_t huge = 0, present = 0;
    int empty = 1;
    for (int i = 0; i < count; i++) {
        if (!spans[i].len) continue;
        empty = 0;
        if (!pages_of((uint64_t)(uintptr_t)spans[i].buf, (uint64_t)spans[i].len, &huge, &present))
            return PAGES_UNKNOWN;
    }
    if (empty) return 8;
    return present ? 8 * huge / present : PAGES_UNKNOWN;
}

/* The least of every rank's table word `word` on the current parity: what the sources of the
 * call just run reported (DirectPath.huge_eighths). */
uint64_t moves_least_pages(const Path *p, Py_ssize_t word) {
    uint64_t least = PAGES_UNKNOWN;
    for (int r = 0; r < p->size; r++) {
        uint64_t w = load((const uint64_t *)slot(p, r, p->parity) + word);
        if (w < least) least = w;
    }
    return least;
}

static void add_read(Moves *m, int source, int index, char *dst, Py_ssize_t len) {
    m->reads[m->count++] = (Read){source, index, dst, len, 0};
}

/* `moves`' arguments for a planned call of `kind` on the caller's x and y (broadcast: the
 * tensor and the output, all_gather and all_to_all: input and output, gather: the tensor and
 * the root's list, scatter: the root's list and the tensor), as algorithms/single_copy.py's
 * bodies make them, its huge-page share `unknown` (pages.UNKNOWN where nothing reads it;
 * PAGES_SCAN: a page-dependent plan's, scanned: pages_word). 1: planned; 0: arrays that overlap
 * where the bodies would take the input apart first (the Python path's, untouched); -1: an
 * error. Release with moves_release. */
int moves_plan(Moves *m, Path *p, int kind, int root, PyObject *pids, uint64_t alias, uint64_t unknown,
               PyObject *x, PyObject *y) {
    int n = p->size, me = p->rank;
    memset(m, 0, sizeof *m);
    m->alias = alias;
    m->whom = -1;
    /* one block: the buffers, the reads, the table and the processes */
    m->buf = PyMem_Calloc(1, ((size_t)n + 2) * sizeof(Py_buffer) + (size_t)n * sizeof(Read) + (size_t)(2 * n + 1) * 8);
    if (m->buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    m->reads = (Read *)(m->buf + n + 2);
    m->table = (uint64_t *)(m->reads + n);
    m->pid = m->table + n + 1;
    if (!pids_of(p, pids, m->pid)) return -1;
    uint64_t *t = m->table;
    Py_buffer *bx = NULL, *by = NULL, *list = NULL;
    m->words = 2;
    uint64_t unread = unknown == PAGES_SCAN ? PAGES_UNKNOWN : unknown; /* a table no peer reads */
    t[1] = unread;
    switch (kind) {
    case MOVE_BROADCAST: /* y is x in place */
        if (!hold(m, x, 0, &bx) || !hold(m, y, x != y || me != root, &by)) return -1;
        if (me != root) {
            t[0] = (uint64_t)(uintptr_t)by->buf;
            add_read(m, root, 0, by->buf, by->len);
            m->whom = -2;
            return 1;
        }
        t[0] = (uint64_t)(uintptr_t)bx->buf;
        t[1] = pages_word(unknown, bx, 1);
        if (x != y) {
            if (meets(bx->buf, bx->len, by->buf, by->len) || bx->len != by->len) return 0;
            m->ldst = by->buf;
            m->lsrc = bx->buf;
            m->llen = bx->len;
        }
        return 1;
    case MOVE_ALL_GATHER:
    case MOVE_ALL_TO_ALL: {
        if (!hold(m, x, 0, &bx) || !hold(m, y, 1, &by)) return -1;
        int all = kind == MOVE_ALL_TO_ALL;
        Py_ssize_t len = all ? bx->len / n : bx->len;
        char *mine = (char *)by->buf + me * len, *in = (char *)bx->buf + (all ? me * len : 0);
        if (by->len != n * len || (all && bx->len != by->len)) return 0;
        if (all ? meets(bx->buf, bx->len, by->buf, by->len)
                : in != mine && meets(bx->buf, bx->len, by->buf, by->len))
            return 0;
        if (all) {
            for (int r = 0; r < n; r++) t[r] = (uint64_t)(uintptr_t)((char *)bx->buf + r * len);
            t[n] = pages_word(unknown, bx, 1);
            m->words = n + 1;
        } else {
            t[0] = (uint64_t)(uintptr_t)bx->buf;
            t[1] = pages_word(unknown, bx, 1);
        }
        for (int k = 1; k < n; k++) {
            int r = (me + k) % n;
            add_read(m, r, all ? me : 0, (char *)by->buf + r * len, len);
        }
        if (in != mine) {
            m->ldst = mine;
            m->lsrc = in;
            m->llen = len;
        }
        return 1;
    }
    case MOVE_GATHER: /* y: the root's list */
        if (!hold(m, x, 0, &bx)) return -1;
        t[0] = (uint64_t)(uintptr_t)bx->buf;
        if (me != root) {
            t[1] = pages_word(unknown, bx, 1);
            m->whom = root;
            return 1;
        }
        if (!hold_list(m, p, y, 1, &list)) return -1;
        for (int r = 0; r < n; r++)
            if (list[r].len != bx->len || (r != root && meets(bx->buf, bx->len, list[r].buf, list[r].len)))
                return 0;
        if (list[root].buf != bx->buf && meets(bx->buf, bx->len, list[root].buf, list[root].len)) return 0;
        for (int k = 1; k < n; k++) {
            int r = (me + k) % n;
            add_read(m, r, 0, list[r].buf, list[r].len);
        }
        if (list[root].buf != bx->buf) {
            m->ldst = list[root].buf;
            m->lsrc = bx->buf;
            m->llen = bx->len;
        }
        m->whom = -2;
        return 1;
    case MOVE_SCATTER: /* x: the root's list */
        if (!hold(m, y, 1, &by)) return -1;
        m->words = n + 1;
        t[n] = unread;
        if (me != root) {
            for (int r = 0; r < n; r++) t[r] = 0;
            add_read(m, root, me, by->buf, by->len);
            m->whom = -2;
            return 1;
        }
        if (!hold_list(m, p, x, 0, &list)) return -1;
        for (int r = 0; r < n; r++) {
            if (list[r].len != by->len || (r != root && meets(by->buf, by->len, list[r].buf, list[r].len)))
                return 0;
            t[r] = (uint64_t)(uintptr_t)list[r].buf;
        }
        t[n] = pages_word(unknown, list, n);
        if (list[root].buf != by->buf) {
            if (meets(by->buf, by->len, list[root].buf, list[root].len)) return 0;
            m->ldst = by->buf;
            m->lsrc = list[root].buf;
            m->llen = by->len;
        }
        return 1;
    }
    PyErr_Format(PyExc_ValueError, "no single copy call of kind %d", kind);
    return -1;
}

/* Run a planned call moves_plan made, given its (seq, a, b, name): a status. */
PyObject *moves_run(Path *p, PyObject *const *head_args, Moves *m) {
    Head h;
    if (!head(head_args, &h)) return NULL;
    return status(moves(p, &h, m->table, m->words, m->pid, m->reads, m->count, m->whom, m->ldst, m->lsrc, m->llen,
                        m->alias));
}

void moves_release(Moves *m) {
    while (m->held) PyBuffer_Release(m->buf + --m->held);
    PyMem_Free(m->buf);
    memset(m, 0, sizeof *m);
}

#define EX_SENT 1  /* this rank's descriptor is in the ring to its destination */
#define EX_TAKEN 2 /* the source's descriptor was taken (and read, unless err) */
#define EX_ACKED 4 /* ... and acknowledged (else the caller acknowledges it) */
#define EX_DONE 8  /* the destination acknowledged this rank's descriptor: its send is complete */
#define SEQ_AT 8   /* a header's seq field, where an acknowledgement names the message's id */

/* Take the REMOTE message at the in ring's tail where its header is `header` (its record: the
 * payload's address, the message's id), waiting up to spin_ns for a record; read its payload
 * out of process `pid` into dst; acknowledge it into the ack ring (`ack_template` with the id
 * at SEQ_AT). -1: nothing there yet; 0: another record comes first; else EX_TAKEN, with
 * EX_ACKED where the acknowledgement went (else the caller sends it), *id the message's and
 * *err the read's errno (0: read). */
static int take_and_read(uint64_t *in_words, const char *in_data, uint64_t in_cap, const char *header,
                         Py_buffer *dst, long pid, uint64_t *ack_words, char *ack_data, uint64_t ack_cap,
                         const char *ack_template, long long spin_ns, uint64_t *id, int *err) {
    uint64_t where[HEADER / 8];
    Py_buffer got = {.buf = where, .len = HEADER};
    int taken = take_record(in_words, in_data, in_cap, header, &got, spin_ns);
    if (taken <= 0) return taken;
    *id = where[1];
    *err = read_peer(pid, dst->buf, where[0], (size_t)dst->len);
    char ack[HEADER];
    memcpy(ack, ack_template, HEADER);
    memcpy(ack + SEQ_AT, id, 8);
    Py_buffer none = {.buf = ack, .len = 0};
    return EX_TAKEN | (put_record(ack_words, ack_data, ack_cap, ack, &none) ? EX_ACKED : 0);
}

/* ring_exchange_read(out, at, cap, header, descriptor, in, at, cap, header, dst, ack_out, at,
 * cap, ack_header, pid, ack_in, at, cap, acked_header, spin_ns) -> (flags, id, errno): a large
 * MPI_Sendrecv where each rank reads the other's buffer (ShmChannel.exchange_read, the REMOTE
 * exchange the general path makes in Python): put this rank's descriptor to its destination;
 * take_and_read its source's; then take the destination's acknowledgement (`acked_header`).
 * `flags` (EX_*) says how far it went; the id is the source's message, errno the read's. */
static PyObject *ring_exchange_read(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer rings[4], payload, dst;
    uint64_t *words[4], cap[4];
    char *data[4];
    const char *header[4];
    int held = 0, flags = 0, err = 0;
    uint64_t id = 0;
    (void)module;
    if (nargs != 20) return PyErr_Format(PyExc_TypeError, "ring_exchange_read takes 20 arguments");
    long long spin_ns = PyLong_AsLongLong(args[19]);
    long pid = PyLong_AsLong(args[14]);
    if ((spin_ns == -1 || pid == -1) && PyErr_Occurred()) return NULL;
    for (; held < 4; held++)
        if (!ring_args(args + 5 * held, &rings[held], &words[held], &data[held], &cap[held], &header[held]))
            goto release;
    if (PyObject_GetBuffer(args[4], &payload, PyBUF_C_CONTIGUOUS) < 0) goto release;
    if (payload.len != HEADER) {
        PyBuffer_Release(&payload);
        PyErr_SetString(PyExc_ValueError, "a descriptor is 64 bytes");
        goto release;
    }
    if (PyObject_GetBuffer(args[9], &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&payload);
        goto release;
    }
    if (put_record(words[0], data[0], cap[0], header[0], &payload)) {
        flags = EX_SENT;
        int got = take_and_read(words[1], data[1], cap[1], header[1], &dst, pid, words[2], data[2], cap[2],
                                header[2], spin_ns, &id, &err);
        if (got > 0) {
            char nothing;
            Py_buffer none = {.buf = &nothing, .len = 0};
            flags |= got;
            if (take_record(words[3], data[3], cap[3], header[3], &none, spin_ns) > 0) flags |= EX_DONE;
        }
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&payload);
release:
    while (held--) PyBuffer_Release(&rings[held]);
    if (PyErr_Occurred()) return NULL;
    return Py_BuildValue("(iKi)", flags, (unsigned long long)id, err);
}

/* ring_take_read(in, at, cap, header, dst, pid, ack_out, at, cap, ack_header, spin_ns) ->
 * (taken, id, errno): a blocking receive of a large message its sender left in its memory
 * (ShmChannel.take_read): take_and_read's result (-1, 0, or its EX_* flags), the message's id,
 * the read's errno. */
static PyObject *ring_take_read(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Py_buffer in, ack, dst;
    uint64_t *in_words, *ack_words, in_cap, ack_cap, id = 0;
    char *in_data, *ack_data;
    const char *header, *ack_header;
    int err = 0, got = -1;
    (void)module;
    if (nargs != 11) return PyErr_Format(PyExc_TypeError, "ring_take_read takes 11 arguments");
    long long spin_ns = PyLong_AsLongLong(args[10]);
    long pid = PyLong_AsLong(args[5]);
    if ((spin_ns == -1 || pid == -1) && PyErr_Occurred()) return NULL;
    if (!ring_args(args, &in, &in_words, &in_data, &in_cap, &header)) return NULL;
    if (!ring_args(args + 6, &ack, &ack_words, &ack_data, &ack_cap, &ack_header)) {
        PyBuffer_Release(&in);
        return NULL;
    }
    if (PyObject_GetBuffer(args[4], &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) == 0) {
        got = take_and_read(in_words, in_data, in_cap, header, &dst, pid, ack_words, ack_data, ack_cap, ack_header,
                            spin_ns, &id, &err);
        PyBuffer_Release(&dst);
    }
    PyBuffer_Release(&ack);
    PyBuffer_Release(&in);
    if (PyErr_Occurred()) return NULL;
    return Py_BuildValue("(iKi)", got, (unsigned long long)id, err);
}

/* Whether `blocks` is a list whose every item is an object of like's type with a C-contiguous
 * buffer (writable where asked) of like's length and format: the per-call checks of a planned
 * list argument (group.arguments.planned_list); 0 sends the caller to those checks. */
int blocks_match(PyObject *blocks, PyObject *like_obj, int writable) {
    Py_buffer like, view;
    if (!PyList_Check(blocks)) return 0;
    if (PyObject_GetBuffer(like_obj, &like, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear(); /* a dtype with no buffer format (bfloat16): the Python checks take it */
        return 0;
    }
    const char *format = like.format != NULL ? like.format : "B";
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0), ok = 1;
    for (Py_ssize_t i = 0; ok && i < PyList_GET_SIZE(blocks); i++) {
        PyObject *o = PyList_GET_ITEM(blocks, i);
        if (Py_TYPE(o) != Py_TYPE(like_obj)) {
            ok = 0;
            break;
        }
        Py_INCREF(o);
        if (PyObject_GetBuffer(o, &view, flags) < 0) {
            PyErr_Clear();
            ok = 0;
        } else {
            ok = view.len == like.len && view.itemsize == like.itemsize &&
                 strcmp(view.format != NULL ? view.format : "B", format) == 0;
            PyBuffer_Release(&view);
        }
        Py_DECREF(o);
    }
    PyBuffer_Release(&like);
    return ok;
}

/* read_peer(pid, local, remote, nbytes) -> errno: cma._read in one C call (0: read). */
static PyObject *read_peer_py(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t local, remote, n;
    (void)module;
    if (nargs != 4) return PyErr_Format(PyExc_TypeError, "read_peer takes 4 arguments");
    long pid = PyLong_AsLong(args[0]);
    if ((pid == -1 && PyErr_Occurred()) || !to_u64(args[1], &local) || !to_u64(args[2], &remote) ||
        !to_u64(args[3], &n))
        return NULL;
    return PyLong_FromLong(read_peer(pid, (char *)(uintptr_t)local, remote, (size_t)n));
}

/* blocks_like(blocks, like, writable) -> bool: blocks_match, one C call instead of a Python loop. */
static PyObject *blocks_like(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) return PyErr_Format(PyExc_TypeError, "blocks_like takes 3 arguments");
    int writable = PyObject_IsTrue(args[2]);
    if (writable < 0) return NULL;
    return PyBool_FromLong(blocks_match(args[0], args[1], writable));
}

static PyMethodDef module_methods[] = {
    {"ring_put", (PyCFunction)(void (*)(void))ring_put, METH_FASTCALL,
     "ring_put(segment, at, capacity, header, payload) -> bool"},
    {"ring_take", (PyCFunction)(void (*)(void))ring_take, METH_FASTCALL,
     "ring_take(segment, at, capacity, header, dst, spin_ns) -> True, False or None"},
    {"ring_sendrecv", (PyCFunction)(void (*)(void))ring_sendrecv, METH_FASTCALL,
     "ring_sendrecv(out_segment, at, capacity, header, payload, in_segment, at, capacity, header, dst, "
     "spin_ns) -> 2, 1, 0 or -1"},
    {"ring_exchange_read", (PyCFunction)(void (*)(void))ring_exchange_read, METH_FASTCALL,
     "ring_exchange_read(out, at, capacity, header, descriptor, in, at, capacity, header, dst, ack_out, at, "
     "capacity, ack_header, pid, ack_in, at, capacity, acked_header, spin_ns) -> (flags, id, errno)"},
    {"ring_take_read", (PyCFunction)(void (*)(void))ring_take_read, METH_FASTCALL,
     "ring_take_read(in, at, capacity, header, dst, pid, ack_out, at, capacity, ack_header, spin_ns) -> "
     "(taken, id, errno)"},
    {"read_peer", (PyCFunction)(void (*)(void))read_peer_py, METH_FASTCALL,
     "read_peer(pid, local, remote, nbytes) -> errno"},
    {"blocks_like", (PyCFunction)(void (*)(void))blocks_like, METH_FASTCALL,
     "blocks_like(blocks, like, writable) -> bool"},
    {NULL},
};

/* ---- the type ------------------------------------------------------------------------------- */

static int Path_init(Path *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"segment", "lines", "rank", "slots", "slot_bytes", "spin_ns", "yields", "wait_ns", NULL};
    PyObject *seg, *lines;
    Py_ssize_t slots_at, slot_bytes;
    long long spin_ns, wait_ns = -1;
    int rank, yields;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOinnLi|L", kwlist, &seg, &lines, &rank, &slots_at,
                                     &slot_bytes, &spin_ns, &yields, &wait_ns))
        return -1;
    if (self->words != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Path is set up once");
        return -1;
    }
    PyObject *seq = PySequence_Fast(lines, "lines must be a sequence");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > MAX_RANKS || rank < 0 || rank >= n || slot_bytes < 0 || slots_at < 0) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "bad group shape");
        return -1;
    }
    if (PyObject_GetBuffer(seg, &self->seg, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(seq);
        return -1;
    }
    self->lines = PyMem_Calloc((size_t)n, sizeof(Py_ssize_t));
    int ok = self->lines != NULL;
    for (Py_ssize_t r = 0; ok && r < n; r++) {
        Py_ssize_t w = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, r));
        ok = !(w == -1 && PyErr_Occurred()) && w >= 0 && (w + STAMP + 6) * 8 <= self->seg.len;
        self->lines[r] = w;
    }
    Py_DECREF(seq);
    if (!ok || slots_at + 2 * n * slot_bytes > self->seg.len) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "the layout does not fit the segment");
        PyBuffer_Release(&self->seg);
        PyMem_Free(self->lines);
        self->lines = NULL;
        return -1;
    }
    self->words = (uint64_t *)self->seg.buf;
    self->slots = (char *)self->seg.buf + slots_at;
    self->slot_bytes = slot_bytes;
    self->rank = rank;
    self->size = (int)n;
    self->spin_ns = spin_ns;
    self->wait_ns = wait_ns < spin_ns ? spin_ns : wait_ns;
    self->yields = yields;
    self->parity = 1;
    self->settled = 1;
    self->prev_name = PyUnicode_FromString("");
    return self->prev_name == NULL ? -1 : 0;
}

static void Path_dealloc(Path *self) {
    if (self->words != NULL) PyBuffer_Release(&self->seg);
    PyMem_Free(self->lines);
    Py_XDECREF(self->prev_name);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Every method needs a set-up Path: one made without __init__ has no segment. */
#define GUARDED(NAME)                                                                   \
    static PyObject *NAME##_checked(Path *self, PyObject *const *args, Py_ssize_t n) {  \
        if (self->words == NULL) {                                                      \
            PyErr_SetString(PyExc_RuntimeError, "Path was not set up");                 \
            return NULL;                                                                \
        }                                                                               \
        return NAME(self, args, n);                                                     \
    }
GUARDED(Path_all_reduce)
GUARDED(Path_reduce)
GUARDED(Path_broadcast)
GUARDED(Path_gather)
GUARDED(Path_scatter)
GUARDED(Path_round)
GUARDED(Path_exchange)
GUARDED(Path_barrier)
GUARDED(Path_settle)
GUARDED(Path_fold)
GUARDED(Path_single_copy)

static PyMethodDef Path_methods[] = {
    {"single_copy", (PyCFunction)(void (*)(void))Path_single_copy_checked, METH_FASTCALL,
     "single_copy(seq, a, b, name, table, pids, reads, whom, local, alias) -> status"},
    {"all_reduce", (PyCFunction)(void (*)(void))Path_all_reduce_checked, METH_FASTCALL,
     "all_reduce(seq, a, b, name, src, dst, code) -> status"},
    {"reduce", (PyCFunction)(void (*)(void))Path_reduce_checked, METH_FASTCALL,
     "reduce(seq, a, b, name, src, dst, code, root) -> status"},
    {"broadcast", (PyCFunction)(void (*)(void))Path_broadcast_checked, METH_FASTCALL,
     "broadcast(seq, a, b, name, src, dst, root) -> status"},
    {"gather", (PyCFunction)(void (*)(void))Path_gather_checked, METH_FASTCALL,
     "gather(seq, a, b, name, send, blocks, root) -> status"},
    {"scatter", (PyCFunction)(void (*)(void))Path_scatter_checked, METH_FASTCALL,
     "scatter(seq, a, b, name, blocks, recv, root, starts) -> status"},
    {"round", (PyCFunction)(void (*)(void))Path_round_checked, METH_FASTCALL,
     "round(seq, a, b, name, whom) -> status"},
    {"exchange", (PyCFunction)(void (*)(void))Path_exchange_checked, METH_FASTCALL,
     "exchange(seq, a, b, name, src, dst, offset, block, code) -> status"},
    {"barrier", (PyCFunction)(void (*)(void))Path_barrier_checked, METH_FASTCALL,
     "barrier(seq, a, b, name) -> status"},
    {"settle", (PyCFunction)(void (*)(void))Path_settle_checked, METH_FASTCALL,
     "settle() -> status"},
    {"fold", (PyCFunction)(void (*)(void))Path_fold_checked, METH_FASTCALL,
     "fold(parity, dst, code): every slot of parity folded into dst"},
    {NULL},
};

static PyMemberDef Path_members[] = {
    {"parity", T_INT, offsetof(Path, parity), 0, "the slot parity of the last call entered"},
    {"settled", T_INT, offsetof(Path, settled), 0, "every rank is known past that call"},
    {"unvetted", T_INT, offsetof(Path, unvetted), 0, "a message-path call to check before the next entry"},
    {"prev_seq", T_ULONGLONG, offsetof(Path, prev_seq), 0, "the last call published"},
    {"prev_a", T_ULONGLONG, offsetof(Path, prev_a), 0, "its fingerprint's first word"},
    {"prev_b", T_ULONGLONG, offsetof(Path, prev_b), 0, "its fingerprint's second word"},
    {"prev_name", T_OBJECT_EX, offsetof(Path, prev_name), 0, "its collective"},
    {NULL},
};

PyTypeObject PathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tensorwire.transport._native.Path",
    .tp_basicsize = sizeof(Path),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One rank's view of a group segment's one-shot protocol (see transport/native.py).",
    .tp_new = PyType_GenericNew, /* zeroed: words NULL until init */
    .tp_init = (initproc)Path_init,
    .tp_dealloc = (destructor)Path_dealloc,
    .tp_methods = Path_methods,
    .tp_members = Path_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_native",
    .m_doc = "The direct path's one-shot bodies in C.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&PathType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&PathType);
    if (PyModule_AddObject(m, "Path", (PyObject *)&PathType) < 0) {
        Py_DECREF(&PathType);
        Py_DECREF(m);
        return NULL;
    }
    if (caller_ready(m) < 0 || PyModule_AddIntConstant(m, "DONE", DONE) < 0 ||
        PyModule_AddIntConstant(m, "PENDING", PENDING) < 0 ||
        PyModule_AddIntConstant(m, "NOT_ENTERED", NOT_ENTERED) < 0 ||
        PyModule_AddIntConstant(m, "PAGES_SCAN", PAGES_SCAN) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
