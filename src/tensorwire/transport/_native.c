/* The direct path's one-shot bodies in C: the same protocol, layout and fold order as
 * transport/segment.py and algorithms/shm_direct.py, which stay the reference (and the whole
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
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define DONE (-1)
#define PENDING (-2)
#define NOT_ENTERED (-3)
#define STAMP 8 /* word of a control line where the per-parity (seq, a, b) stamps start */
#define MAX_RANKS 4096

typedef struct {
    PyObject_HEAD
    Py_buffer seg;          /* the whole segment, held for the object's life */
    uint64_t *words;
    Py_ssize_t *lines;      /* word index of each rank's control line */
    char *slots;            /* rank 0's slot of parity 0; slot (r, p) is 2r + p slots on */
    Py_ssize_t slot_bytes;
    int rank, size;
    long long spin_ns;      /* busy-poll budget; 0: yield instead (ranks share cores) */
    int yields;
    /* the protocol's state, as segment.State holds it on the Python path */
    int parity;             /* the slot parity of the last call entered */
    int settled;            /* every rank is known past that call, its stamps checked */
    int unvetted;           /* a message-path call's notes to check before the next entry */
    unsigned long long prev_seq, prev_a, prev_b; /* the last call published, its fingerprint words */
    PyObject *prev_name;    /* its collective */
} Path;

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

/* Whether every other rank (or only rank `only`, if >= 0) has a flag >= seq. */
static int arrived(const Path *p, int only, uint64_t seq) {
    if (only >= 0) return load(p->words + p->lines[only]) >= seq;
    for (int r = 0; r < p->size; r++)
        if (r != p->rank && load(p->words + p->lines[r]) < seq) return 0;
    return 1;
}

/* Poll until the awaited flags reach seq: a short spell holding the interpreter lock (a peer
 * already there costs nothing more), then the rest of the budget without it. */
static int await_flags(const Path *p, int only, uint64_t seq) {
    for (int i = 0; i < 64; i++)
        if (arrived(p, only, seq)) return 1;
    int ok = 0;
    Py_BEGIN_ALLOW_THREADS
    if (p->spin_ns > 0) {
        long long end = now_ns() + p->spin_ns;
        for (;;) {
            for (int i = 0; i < 256 && !ok; i++) ok = arrived(p, only, seq);
            if (ok || now_ns() > end) break;
        }
    } else {
        for (int i = 0; i < p->yields && !ok; i++) {
            sched_yield();
            ok = arrived(p, only, seq);
        }
    }
    Py_END_ALLOW_THREADS
    return ok;
}

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
 * `only` (>= 0), everyone else (-1) or no one (-2); a status. */
static int round_trip(Path *p, const Head *h, int only) {
    int parity = p->parity;
    stamp(p, h->seq, parity, h->a, h->b);
    p->prev_seq = h->seq;
    p->prev_a = h->a;
    p->prev_b = h->b;
    if (p->prev_name != h->name) Py_SETREF(p->prev_name, Py_NewRef(h->name));
    p->settled = 0;
    if (only == -2) return DONE;
    if (!await_flags(p, only, h->seq)) return PENDING;
    for (int r = 0; r < p->size; r++) {
        if (r == p->rank || (only >= 0 && r != only)) continue;
        const uint64_t *at = p->words + p->lines[r] + STAMP + 3 * parity;
        if (load(at) != h->seq || at[1] != h->a || at[2] != h->b) return r;
    }
    p->settled = only == -1;
    return DONE;
}

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

static int to_int(PyObject *o, int lo, int hi, const char *what, int *v) {
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

/* A group of one has nothing to fold: its slot is the result. */
static void fold_into(const Path *p, fold_fn f, int parity, Py_buffer *dst, Py_ssize_t count) {
    if (p->size == 1)
        memcpy(dst->buf, slot(p, 0, parity), (size_t)dst->len);
    else
        f(dst->buf, slot(p, 0, parity), 2 * p->slot_bytes, p->size, count);
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
static PyObject *Path_all_reduce(Path *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) return PyErr_Format(PyExc_TypeError, "all_reduce takes 7 arguments");
    return publish_and_fold(self, args, 1);
}

/* reduce(seq, a, b, name, src, dst, code, root): the root folds. */
static PyObject *Path_reduce(Path *self, PyObject *const *args, Py_ssize_t nargs) {
    int root;
    if (nargs != 8) return PyErr_Format(PyExc_TypeError, "reduce takes 8 arguments");
    if (!to_int(args[7], 0, self->size, "root", &root)) return NULL;
    return publish_and_fold(self, args, self->rank == root);
}

/* broadcast(seq, a, b, name, src, dst, root): the root copies src into its slot and
 * publishes, then fills dst from the slot unless dst is src; the others wait for the root
 * and copy its slot into dst. */
static PyObject *Path_broadcast(Path *self, PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *Path_gather(Path *self, PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *Path_scatter(Path *self, PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *Path_exchange(Path *self, PyObject *const *args, Py_ssize_t nargs) {
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
            for (int r = 0; r < self->size; r++)
                memcpy((char *)dst.buf + r * block, slot(self, r, self->parity) + offset, (size_t)block);
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
static PyObject *Path_barrier(Path *self, PyObject *const *args, Py_ssize_t nargs) {
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
 * fits unwrapped (ShmChannel._put without a descriptor); whether it did. */
static int put_record(uint64_t *words, char *data, uint64_t cap, const char *header, const Py_buffer *payload) {
    uint64_t head = words[HEAD_WORD], n = (uint64_t)payload->len, end = head + HEADER + padded(n);
    uint64_t pos = head % cap;
    if (end - load(words + TAIL_WORD) > cap || pos + (end - head) > cap) return 0;
    memcpy(data + pos, header, HEADER);
    memcpy(data + pos + HEADER, payload->buf, (size_t)n);
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
 * it lies whole and unwrapped, waiting up to spin_ns for it (ShmChannel.take_now): 1 taken,
 * 0 another record comes first, -1 nothing whole yet. */
static int take_record(uint64_t *words, const char *data, uint64_t cap, const char *header, Py_buffer *dst,
                       long long spin_ns) {
    uint64_t tail = words[TAIL_WORD], n = (uint64_t)dst->len, end = tail + HEADER + padded(n);
    uint64_t avail = await_head(words, tail, HEADER, spin_ns), pos = tail % cap;
    if (avail < HEADER) return -1;
    if (memcmp(data + pos, header, HEADER) != 0 || pos + HEADER + n > cap) return 0;
    if (avail < end - tail && await_head(words, tail, end - tail, spin_ns) < end - tail) return -1;
    memcpy(dst->buf, data + pos + HEADER, (size_t)n);
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
static PyObject *ring_sendrecv(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
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

/* Whether `blocks` is a list whose every item is an object of like's type with a C-contiguous
 * buffer (writable where asked) of like's length and format: the per-call checks of a planned
 * list argument (group.arguments.planned_list); 0 sends the caller to those checks. */
static int blocks_match(PyObject *blocks, PyObject *like_obj, int writable) {
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
    {"blocks_like", (PyCFunction)(void (*)(void))blocks_like, METH_FASTCALL,
     "blocks_like(blocks, like, writable) -> bool"},
    {NULL},
};

/* ---- the type ------------------------------------------------------------------------------- */

static int Path_init(Path *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"segment", "lines", "rank", "slots", "slot_bytes", "spin_ns", "yields", NULL};
    PyObject *seg, *lines;
    Py_ssize_t slots_at, slot_bytes;
    long long spin_ns;
    int rank, yields;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOinnLi", kwlist, &seg, &lines, &rank, &slots_at,
                                     &slot_bytes, &spin_ns, &yields))
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

static PyMethodDef Path_methods[] = {
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

static PyTypeObject PathType = {
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

/* ---- the caller: a planned call from the group's API in one C call -------------------------- */
/* group/planned.py adds each planned signature whose body is one of the Path methods above, and
 * Group takes the Caller's methods as its own (group.py). A call that matches one, on numpy
 * arrays that pass the planned path's checks (collectives.py), with the queue idle and nothing
 * arrived to vet (Plans.submit's conditions, read from the objects' slots), is numbered and run
 * here; any other call goes to the Python function untouched. A body that hands back a status
 * or raises is finished by Plans.finish, as Plans.submit's body would be. */

enum { ALL_REDUCE, REDUCE, BROADCAST, BARRIER, GATHER, SCATTER, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, SENDRECV,
       N_COLLS };
static const char *const COLLS[N_COLLS] = {"all_reduce", "reduce", "broadcast", "barrier", "gather", "scatter",
                                           "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                                           "sendrecv"};

typedef PyObject *(*body_fn)(Path *, PyObject *const *, Py_ssize_t);
static const body_fn BODIES[N_COLLS] = {Path_all_reduce, Path_reduce, Path_broadcast, Path_barrier,
                                        Path_gather, Path_scatter, Path_exchange, Path_exchange, Path_exchange,
                                        NULL};

#define HEAD_ARGS 4 /* (seq, a, b, name) */
#define MAX_ARGS 9

typedef struct {
    int coll, root, inplace, nargs;
    PyObject *dtype, *op;   /* the signature's dtype and op, matched by identity (None: none) */
    Py_ssize_t nbytes, out_bytes; /* its input's bytes, and its output's where that differs */
    Path *path;
    PyObject *call, *ref, *ctx, *tail;
    PyObject *args[MAX_ARGS]; /* the body's arguments; seq and the arrays filled per call */
} Entry;

/* A pair of point-to-point routes sendrecv used before (group.p2p_pairs), and what their one
 * call through the rings needs (ShmChannel.exchange_now). */
typedef struct {
    long dst, src, tag;
    Py_ssize_t send_bytes, recv_bytes, remote, ctrl;
    PyObject *send_dtype, *recv_dtype, *out_peer, *out_wire, *in_peer, *in_key, *in_wire, *out_route, *in_route,
        *finish;
} Pair;

typedef struct {
    PyObject_HEAD
    PyObject *group, *queue, *engine, *finish, *lock, *channels, *lost, *posted;
    Pair *pairs;
    Py_ssize_t npairs, pairs_cap;
    PyObject *pending, *unexpected, *deferred, *refusals, *aborted, *current; /* never replaced */
    PyObject *fallback[N_COLLS];
    PyObject *sum, *array_type, *view_of, *zero;
    PyTypeObject *call_type;
    int rank, size;
    Py_ssize_t q_seq, q_busy, q_doomed, q_current, e_glance, c_seq, c_timeout, c_deadline;
    Entry *entries;
    Py_ssize_t n, cap, hint;
} Caller;

static PyObject *S_out, *S_async_op, *S_timeout, *S_compress, *S_dtype, *S_wake, *S_acquire, *S_release_,
    *S_direct, *S_native, *S_sendq, *S_sink, *S_out_ring, *S_in_ring, *S_bytes, *S_capacity, *S_stream, *S_parked,
    *S_release, *S_spin_s;

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

/* Put `v` (a new reference, taken) into the slot at `off` of `obj`. */
static void set_slot(PyObject *obj, Py_ssize_t off, PyObject *v) {
    PyObject *old = SLOT(obj, off);
    SLOT(obj, off) = v;
    Py_XDECREF(old);
}

/* The offset of `name`, a __slots__ attribute of `type`. */
static int slot_offset(PyTypeObject *type, const char *name, Py_ssize_t *off) {
    PyObject *d = PyObject_GetAttrString((PyObject *)type, name);
    if (d == NULL) return 0;
    int ok = Py_IS_TYPE(d, &PyMemberDescr_Type) && ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX;
    if (ok) *off = ((PyMemberDescrObject *)d)->d_member->offset;
    Py_DECREF(d);
    if (!ok) PyErr_Format(PyExc_TypeError, "%s.%s is not a __slots__ attribute", type->tp_name, name);
    return ok;
}

static long small(PyObject *v) { /* an int slot's value; -1 where it is not a small int */
    if (v == NULL || !PyLong_CheckExact(v)) return -1;
    long x = PyLong_AsLong(v);
    if (x == -1 && PyErr_Occurred()) PyErr_Clear();
    return x;
}

static void entry_clear(Entry *e) {
    Py_CLEAR(e->dtype);
    Py_CLEAR(e->op);
    Py_CLEAR(e->path);
    Py_CLEAR(e->call);
    Py_CLEAR(e->ref);
    Py_CLEAR(e->ctx);
    Py_CLEAR(e->tail);
    for (int i = 0; i < MAX_ARGS; i++) Py_CLEAR(e->args[i]);
}

static int Caller_init(Caller *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"group", "queue", "engine", "finish", "fallbacks", "sum", "array_type",
                             "view_of", "call_type", "rank", NULL};
    PyObject *group, *queue, *engine, *finish, *fallbacks, *sum, *array_type, *view_of, *call_type;
    int rank;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOO!OO!i", kwlist, &group, &queue, &engine, &finish,
                                     &fallbacks, &sum, &PyType_Type, &array_type, &view_of, &PyType_Type,
                                     &call_type, &rank))
        return -1;
    if (self->group != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Caller is set up once");
        return -1;
    }
    if (!PyTuple_Check(fallbacks) || PyTuple_GET_SIZE(fallbacks) != N_COLLS) {
        PyErr_Format(PyExc_TypeError, "fallbacks: a tuple of %d functions", N_COLLS);
        return -1;
    }
    struct { PyObject *obj; const char *name; PyObject **to; int dict; } parts[] = {
        {queue, "pending", &self->pending, 0}, {engine, "unexpected", &self->unexpected, 1},
        {engine, "deferred_aborts", &self->deferred, 0}, {engine, "refusals", &self->refusals, 1},
        {engine, "aborted", &self->aborted, 1}, {engine, "current", &self->current, 1},
        {engine, "channels", &self->channels, 1}, {engine, "lost", &self->lost, 1},
        {engine, "posted", &self->posted, 1}};
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        PyObject *v = PyObject_GetAttrString(parts[i].obj, parts[i].name);
        if (v == NULL) return -1;
        if (parts[i].dict ? !PyDict_CheckExact(v) : !(PyList_CheckExact(v) || PyObject_HasAttrString(v, "popleft"))) {
            Py_DECREF(v);
            PyErr_Format(PyExc_TypeError, "%s is not the container expected", parts[i].name);
            return -1;
        }
        *parts[i].to = v;
    }
    PyTypeObject *qt = Py_TYPE(queue), *et = Py_TYPE(engine), *ct = (PyTypeObject *)call_type;
    if (!slot_offset(qt, "seq", &self->q_seq) || !slot_offset(qt, "busy", &self->q_busy) ||
        !slot_offset(qt, "doomed", &self->q_doomed) || !slot_offset(qt, "current", &self->q_current) ||
        !slot_offset(et, "until_glance", &self->e_glance) || !slot_offset(ct, "seq", &self->c_seq) ||
        !slot_offset(ct, "timeout", &self->c_timeout) || !slot_offset(ct, "deadline", &self->c_deadline))
        return -1;
    self->zero = PyFloat_FromDouble(0.0);
    self->lock = PyObject_GetAttrString(engine, "lock");
    if (self->zero == NULL || self->lock == NULL) return -1;
    self->group = Py_NewRef(group);
    self->queue = Py_NewRef(queue);
    self->engine = Py_NewRef(engine);
    self->finish = Py_NewRef(finish);
    for (int i = 0; i < N_COLLS; i++) self->fallback[i] = Py_NewRef(PyTuple_GET_ITEM(fallbacks, i));
    self->sum = Py_NewRef(sum);
    self->array_type = Py_NewRef(array_type);
    self->view_of = Py_NewRef(view_of);
    self->call_type = (PyTypeObject *)Py_NewRef(call_type);
    self->rank = rank;
    PyObject *size = PyObject_GetAttrString(group, "size");
    self->size = (int)small(size);
    Py_XDECREF(size);
    if (self->size > 0) return 0;
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "group.size: a positive int");
    return -1;
}

#define ADD_ARGS 13
/* add(collective, dtype, nbytes, out_bytes, root, op, inplace, path, call, ctx, a, b, tail, *extra):
 * a planned signature (extra: the body's arguments after the arrays: a fold code, a root). */
static PyObject *Caller_add(Caller *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < ADD_ARGS || nargs > ADD_ARGS + MAX_ARGS - HEAD_ARGS - 2)
        return PyErr_Format(PyExc_TypeError, "add takes %d to %d arguments", ADD_ARGS,
                            ADD_ARGS + MAX_ARGS - HEAD_ARGS - 2);
    if (self->group == NULL) return PyErr_Format(PyExc_RuntimeError, "Caller was not set up");
    const char *coll = PyUnicode_AsUTF8(args[0]);
    if (coll == NULL) return NULL;
    int c = 0;
    while (c < N_COLLS && strcmp(COLLS[c], coll) != 0) c++;
    if (c == N_COLLS) return PyErr_Format(PyExc_ValueError, "no compiled caller of %s", coll);
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[2]), out_bytes = PyLong_AsSsize_t(args[3]);
    int root, inplace = PyObject_IsTrue(args[6]);
    if (((nbytes == -1 || out_bytes == -1) && PyErr_Occurred()) || inplace < 0) return NULL;
    if (!to_int(args[4], -1, MAX_RANKS, "root", &root)) return NULL;
    if (!Py_IS_TYPE(args[7], &PathType) || ((Path *)args[7])->words == NULL)
        return PyErr_Format(PyExc_TypeError, "path: a set-up Path");
    if (!Py_IS_TYPE(args[8], self->call_type))
        return PyErr_Format(PyExc_TypeError, "call: a %s", self->call_type->tp_name);
    PyObject *ref = PyObject_GetAttrString(args[8], "ref"), *name = PyObject_GetAttrString(args[8], "name");
    if (ref == NULL || name == NULL) {
        Py_XDECREF(ref);
        Py_XDECREF(name);
        return NULL;
    }
    if (self->n == self->cap) {
        Py_ssize_t cap = self->cap ? 2 * self->cap : 8;
        Entry *grown = PyMem_Realloc(self->entries, (size_t)cap * sizeof(Entry));
        if (grown == NULL) {
            Py_DECREF(ref);
            Py_DECREF(name);
            return PyErr_NoMemory();
        }
        self->entries = grown;
        self->cap = cap;
    }
    Entry *e = &self->entries[self->n++];
    memset(e, 0, sizeof *e);
    e->coll = c;
    e->root = root;
    e->inplace = inplace;
    e->nbytes = nbytes;
    e->out_bytes = out_bytes;
    e->dtype = Py_NewRef(args[1]);
    e->op = Py_NewRef(args[5]);
    e->path = (Path *)Py_NewRef(args[7]);
    e->call = Py_NewRef(args[8]);
    e->ref = ref;
    e->ctx = Py_NewRef(args[9]);
    e->tail = Py_NewRef(args[12]);
    e->args[1] = Py_NewRef(args[10]);
    e->args[2] = Py_NewRef(args[11]);
    e->args[3] = name;
    e->nargs = c == BARRIER ? HEAD_ARGS : HEAD_ARGS + 2 + (int)(nargs - ADD_ARGS);
    for (Py_ssize_t i = ADD_ARGS; i < nargs; i++) e->args[HEAD_ARGS + 2 + i - ADD_ARGS] = Py_NewRef(args[i]);
    Py_RETURN_NONE;
}

static PyObject *Caller_clear_entries(Caller *self, PyObject *unused) {
    (void)unused;
    for (Py_ssize_t i = 0; i < self->n; i++) entry_clear(&self->entries[i]);
    self->n = 0;
    Py_RETURN_NONE;
}

/* Nothing stands between the call and its body: Plans.submit's conditions for a one-shot body
 * run inline (the glance counter must not reach 0 here: Python's path glances). */
static int clear_to_run(Caller *c, Entry *e) {
    if (SLOT(c->queue, c->q_busy) != Py_False || PyObject_Length(c->pending) != 0 ||
        small(SLOT(c->queue, c->q_doomed)) != 0 || small(SLOT(c->engine, c->e_glance)) <= 1 ||
        PyDict_GET_SIZE(c->unexpected) || PyObject_Length(c->deferred) != 0)
        return 0;
    if (PyDict_GET_SIZE(c->refusals) && PyDict_Contains(c->refusals, e->ctx) != 0) return 0;
    if (PyDict_GET_SIZE(c->aborted) && PyDict_Contains(c->aborted, e->ctx) != 0) return 0;
    return !PyErr_Occurred();
}

static PyObject *take_exception(void) {
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

/* Number the call (its timeout: NULL for the group's), run its body on x and y (its arrays or
 * lists; NULL: a barrier) and return `result`, through Plans.finish where the body does not
 * finish here. */
static PyObject *run(Caller *c, Entry *e, PyObject *timeout, PyObject *x, PyObject *y, PyObject *result) {
    long long last = PyLong_AsLongLong(SLOT(c->queue, c->q_seq));
    PyObject *seq = last == -1 && PyErr_Occurred() ? NULL : PyLong_FromLongLong(last + 1);
    PyObject *glance = PyLong_FromLong(small(SLOT(c->engine, c->e_glance)) - 1);
    timeout = timeout != NULL ? Py_NewRef(timeout) : PyObject_GetAttr(c->group, S_timeout);
    if (seq == NULL || glance == NULL || timeout == NULL || PyDict_SetItem(c->current, e->ctx, e->ref) < 0) {
        Py_XDECREF(seq);
        Py_XDECREF(glance);
        Py_XDECREF(timeout);
        return NULL;
    }
    set_slot(c->engine, c->e_glance, glance);
    set_slot(c->queue, c->q_seq, Py_NewRef(seq));
    set_slot(e->call, c->c_seq, Py_NewRef(seq));
    set_slot(e->call, c->c_timeout, timeout);
    set_slot(e->call, c->c_deadline, Py_NewRef(c->zero));
    set_slot(c->queue, c->q_current, Py_NewRef(e->call));
    set_slot(c->queue, c->q_busy, Py_NewRef(Py_True));
    PyObject **args = e->args;
    args[0] = seq;
    args[4] = x;
    args[5] = y;
    PyObject *status = BODIES[e->coll](e->path, args, e->nargs);
    args[0] = args[4] = args[5] = NULL;
    Py_DECREF(seq);
    long s = status == NULL ? 0 : PyLong_AsLong(status);
    if (status != NULL && s == DONE) {
        Py_DECREF(status);
        set_slot(c->queue, c->q_busy, Py_NewRef(Py_False));
        if (PyObject_Length(c->pending) > 0) {
            PyObject *woke = PyObject_CallMethodNoArgs(c->queue, S_wake);
            if (woke == NULL) return NULL;
            Py_DECREF(woke);
        }
        return Py_NewRef(result);
    }
    if (status == NULL) status = take_exception();
    PyObject *finish_args[5] = {e->call, e->tail, status, x, y};
    PyObject *done = PyObject_Vectorcall(c->finish, finish_args, x == NULL ? 3 : 5, NULL);
    Py_DECREF(status);
    if (done == NULL) return NULL;
    Py_DECREF(done);
    return Py_NewRef(result);
}

/* The Python function's call (the group first). */
static PyObject *fall_back(Caller *c, int coll, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *few[16], **stack = few;
    Py_ssize_t total = nargs + (kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames));
    if (total >= 16 && (stack = PyMem_Malloc((size_t)(total + 1) * sizeof *stack)) == NULL) return PyErr_NoMemory();
    stack[0] = c->group;
    memcpy(stack + 1, args, (size_t)total * sizeof *stack);
    PyObject *done = PyObject_Vectorcall(c->fallback[coll], stack, nargs + 1, kwnames);
    if (stack != few) PyMem_Free(stack);
    return done;
}

/* A call's arguments: its parameters before the keyword-only ones (NULL where not given), and
 * the keyword-only `out` and `timeout` (NULL where None or absent). */
typedef struct {
    PyObject *pos[6], *out, *timeout;
} Args;

static int is_name(PyObject *name, PyObject *interned) {
    return name == interned || PyUnicode_Compare(name, interned) == 0;
}

/* Each method's parameters before its keyword-only ones (collectives.py's, after the group). */
static const char *const PARAMS[N_COLLS][6] = {
    {"tensor", "op"}, {"tensor", "dst", "op"}, {"tensor", "src"}, {NULL},
    {"tensor", "gather_list", "dst"}, {"tensor", "scatter_list", "src"}, {"output", "input"},
    {"output", "input", "op"}, {"output", "input", "output_split_sizes", "input_split_sizes"},
    {"send", "dst", "recv", "src", "tag", "timeout"}};
enum { KW_OUT = 1, KW_COMPRESS = 2 }; /* the keyword-only ones besides async_op and timeout */

/* Fill `a` from a call of method `coll` (`has`: its keyword-only parameters); 0 where an
 * argument is not one of its parameters or is given twice, or where async_op or compress is not
 * its default (the Python function takes those calls, and names what is wrong). */
static int parse(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int coll, int has, Args *a) {
    Py_ssize_t max = 0;
    while (max < 6 && PARAMS[coll][max] != NULL) max++;
    if (nargs > max) return 0;
    for (Py_ssize_t i = 0; i < 6; i++) a->pos[i] = i < nargs ? args[i] : NULL;
    a->out = a->timeout = NULL;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i), *value = args[nargs + i];
        if (is_name(name, S_timeout) && coll != SENDRECV) /* sendrecv's is among its PARAMS */
            a->timeout = value == Py_None ? NULL : value;
        else if (is_name(name, S_async_op)) {
            if (value != Py_False) return 0;
        } else if ((has & KW_OUT) && is_name(name, S_out)) {
            a->out = value == Py_None ? NULL : value;
        } else if ((has & KW_COMPRESS) && is_name(name, S_compress)) {
            if (value != Py_None) return 0;
        } else {
            Py_ssize_t k = 0;
            while (k < max && PyUnicode_CompareWithASCIIString(name, PARAMS[coll][k]) != 0) k++;
            if (k == max || a->pos[k] != NULL) return 0;
            a->pos[k] = value;
        }
    }
    return !PyErr_Occurred();
}

/* `o` is a numpy array whose buffer is one C-contiguous run (writable where asked): its dtype
 * (a new reference), byte length and rows (its first dimension, -1 for a scalar); NULL where
 * not. */
static PyObject *shaped_array_of(Caller *c, PyObject *o, int writable, Py_ssize_t *nbytes, Py_ssize_t *rows) {
    Py_buffer view;
    if ((PyObject *)Py_TYPE(o) != c->array_type) return NULL;
    if (PyObject_GetBuffer(o, &view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Clear();
        return NULL;
    }
    *nbytes = view.len;
    *rows = view.ndim > 0 ? view.shape[0] : -1;
    PyBuffer_Release(&view);
    PyObject *dtype = PyObject_GetAttr(o, S_dtype);
    if (dtype == NULL) PyErr_Clear();
    return dtype;
}

/* The array a planned call runs on for `o` (collectives.py's `planned`): `o` itself where it is
 * a numpy array, else the view `view_of` (buffers.seen_torch_view) has of it, a CPU tensor
 * seen before; a new reference, NULL where there is none. */
static PyObject *planned_array(Caller *c, PyObject *o) {
    if ((PyObject *)Py_TYPE(o) == c->array_type) return Py_NewRef(o);
    PyObject *view = PyObject_CallOneArg(c->view_of, o);
    if (view != NULL && (PyObject *)Py_TYPE(view) == c->array_type) return view;
    if (view == NULL) PyErr_Clear(); /* the Python function meets it again */
    Py_XDECREF(view);
    return NULL;
}

static PyObject *array_of(Caller *c, PyObject *o, int writable, Py_ssize_t *nbytes) {
    Py_ssize_t rows;
    return shaped_array_of(c, o, writable, nbytes, &rows);
}

/* The entry of a signature: the one found last first (a loop repeats one), then the rest. */
static Entry *lookup(Caller *c, int coll, PyObject *dtype, Py_ssize_t nbytes, Py_ssize_t out_bytes, int root,
                     PyObject *op, int inplace) {
    for (Py_ssize_t k = 0; k <= c->n; k++) {
        Py_ssize_t i = k == 0 ? c->hint : k - 1;
        if (i >= c->n) continue;
        Entry *e = &c->entries[i];
        if (e->coll == coll && e->dtype == dtype && e->nbytes == nbytes && e->out_bytes == out_bytes &&
            e->root == root && e->op == op && e->inplace == inplace) {
            c->hint = i;
            return e;
        }
    }
    return NULL;
}

/* A root argument (NULL: the default, 0); -1 where it is not an int a plan could have. */
static int root_of(PyObject *o) {
    if (o == NULL) return 0;
    long r = small(o);
    return r >= 0 && r < MAX_RANKS ? (int)r : -1;
}

/* all_reduce, reduce and broadcast: tensor first, out apart or not. */
static PyObject *array_call(Caller *c, int coll, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Args a;
    PyObject **pos = a.pos, *src = NULL, *dst = NULL, *dtype = NULL, *done = NULL;
    Entry *e = NULL;
    Py_ssize_t nbytes, out_bytes = -1;
    if (c->n && parse(args, nargs, kwnames, coll, KW_OUT | (coll == ALL_REDUCE ? KW_COMPRESS : 0), &a)) {
        PyObject *tensor = pos[0], *out = a.out, *op = coll == BROADCAST ? Py_None : c->sum;
        int root = -1, writable = out == NULL;
        if (coll == ALL_REDUCE) {
            if (pos[1] != NULL) op = pos[1];
        } else {
            root = root_of(pos[1]);
            if (coll == REDUCE && pos[2] != NULL) op = pos[2];
            if (coll == REDUCE)
                writable = root == c->rank && out == NULL;
            else
                writable = out == NULL && root != c->rank;
        }
        if (tensor != NULL && (coll == ALL_REDUCE || root >= 0) && (src = planned_array(c, tensor)) != NULL)
            dtype = array_of(c, src, writable, &nbytes);
        if (dtype != NULL) e = lookup(c, coll, dtype, nbytes, nbytes, root, op, out == NULL);
        PyObject *result = tensor;
        if (e != NULL && out != NULL && (coll != REDUCE || root == c->rank)) {
            PyObject *out_dtype = (dst = planned_array(c, out)) == NULL ? NULL : array_of(c, dst, 1, &out_bytes);
            Py_XDECREF(out_dtype);
            if (out_dtype != dtype || out_bytes != nbytes) e = NULL;
            result = out;
        }
        Py_XDECREF(dtype);
        if (e != NULL && clear_to_run(c, e)) done = run(c, e, a.timeout, src, dst != NULL ? dst : src, result);
        Py_XDECREF(src);
        Py_XDECREF(dst);
        if (done != NULL || PyErr_Occurred()) return done;
    }
    return fall_back(c, coll, args, nargs, kwnames);
}

static PyObject *Caller_all_reduce(Caller *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return array_call(c, ALL_REDUCE, args, nargs, kwnames);
}

static PyObject *Caller_reduce(Caller *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return array_call(c, REDUCE, args, nargs, kwnames);
}

static PyObject *Caller_broadcast(Caller *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return array_call(c, BROADCAST, args, nargs, kwnames);
}

/* gather and scatter: (tensor, list, root); the list is the root's blocks, ignored elsewhere. */
static PyObject *list_call(Caller *c, int coll, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Args a;
    PyObject **pos = a.pos, *dtype = NULL;
    Entry *e = NULL;
    Py_ssize_t nbytes;
    if (c->n && parse(args, nargs, kwnames, coll, 0, &a) && pos[0] != NULL) {
        PyObject *tensor = pos[0], *list = pos[1] == NULL ? Py_None : pos[1];
        int root = root_of(pos[2]), mine = root == c->rank;
        if (root >= 0) dtype = array_of(c, tensor, coll == SCATTER, &nbytes);
        if (dtype != NULL) e = lookup(c, coll, dtype, nbytes, nbytes, root, Py_None, 1);
        Py_XDECREF(dtype);
        if (e != NULL && mine && !(PyList_CheckExact(list) && PyList_GET_SIZE(list) == e->path->size &&
                                   blocks_match(list, tensor, coll == GATHER)))
            e = NULL;
        if (e != NULL && clear_to_run(c, e)) {
            PyObject *blocks = mine ? list : Py_None;
            return coll == GATHER ? run(c, e, a.timeout, tensor, blocks, list)
                                  : run(c, e, a.timeout, blocks, tensor, tensor);
        }
        if (PyErr_Occurred()) return NULL;
    }
    return fall_back(c, coll, args, nargs, kwnames);
}

/* all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single: (output, input, then an
 * op, or split sizes that must be None: equal blocks, each of whole rows). */
static PyObject *tensor_call(Caller *c, int coll, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Args a;
    PyObject **pos = a.pos, *src = NULL, *dst = NULL, *in_dtype = NULL, *out_dtype = NULL, *done = NULL;
    Entry *e = NULL;
    Py_ssize_t nbytes, out_bytes = -1, in_rows, out_rows;
    if (c->n && parse(args, nargs, kwnames, coll, 0, &a) && pos[0] != NULL && pos[1] != NULL) {
        PyObject *op = coll == REDUCE_SCATTER ? (pos[2] == NULL ? c->sum : pos[2]) : Py_None;
        int even = coll != ALL_TO_ALL || ((pos[2] == NULL || pos[2] == Py_None) && (pos[3] == NULL || pos[3] == Py_None));
        if (even && (src = planned_array(c, pos[1])) != NULL) in_dtype = shaped_array_of(c, src, 0, &nbytes, &in_rows);
        if (in_dtype != NULL && (dst = planned_array(c, pos[0])) != NULL)
            out_dtype = shaped_array_of(c, dst, 1, &out_bytes, &out_rows);
        if (coll == ALL_TO_ALL && out_dtype != NULL &&
            (in_rows < 0 || out_rows < 0 || in_rows % c->size || out_rows % c->size))
            Py_CLEAR(out_dtype);
        if (out_dtype != NULL && out_dtype == in_dtype) e = lookup(c, coll, in_dtype, nbytes, out_bytes, -1, op, 1);
        Py_XDECREF(in_dtype);
        Py_XDECREF(out_dtype);
        if (e != NULL && clear_to_run(c, e)) done = run(c, e, a.timeout, src, dst, pos[0]);
        Py_XDECREF(src);
        Py_XDECREF(dst);
        if (done != NULL || PyErr_Occurred()) return done;
    }
    return fall_back(c, coll, args, nargs, kwnames);
}

static PyObject *Caller_gather(Caller *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return list_call(c, GATHER, args, nargs, kwnames);
}

static PyObject *Caller_scatter(Caller *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return list_call(c, SCATTER, args, nargs, kwnames);
}

static PyObject *Caller_all_gather(Caller *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return tensor_call(c, ALL_GATHER, args, nargs, kwnames);
}

static PyObject *Caller_reduce_scatter(Caller *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return tensor_call(c, REDUCE_SCATTER, args, nargs, kwnames);
}

static PyObject *Caller_all_to_all(Caller *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return tensor_call(c, ALL_TO_ALL, args, nargs, kwnames);
}

static PyObject *Caller_barrier(Caller *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Args a;
    if (c->n && parse(args, nargs, kwnames, BARRIER, 0, &a)) {
        Entry *e = lookup(c, BARRIER, Py_None, 0, 0, -1, Py_None, 1);
        if (e != NULL && clear_to_run(c, e)) return run(c, e, a.timeout, NULL, NULL, Py_None);
        if (PyErr_Occurred()) return NULL;
    }
    return fall_back(c, BARRIER, args, nargs, kwnames);
}

static void pair_clear(Pair *p) {
    PyObject **objs[] = {&p->send_dtype, &p->recv_dtype, &p->out_peer, &p->out_wire, &p->in_peer, &p->in_key,
                         &p->in_wire, &p->out_route, &p->in_route, &p->finish};
    for (size_t i = 0; i < sizeof objs / sizeof objs[0]; i++) Py_CLEAR(*objs[i]);
}

static PyObject *Caller_clear_pairs(Caller *self, PyObject *unused) {
    (void)unused;
    for (Py_ssize_t i = 0; i < self->npairs; i++) pair_clear(&self->pairs[i]);
    self->npairs = 0;
    Py_RETURN_NONE;
}

/* add_pair(dst, src, tag, send_bytes, recv_bytes, send_dtype, recv_dtype, out_route, in_route,
 * remote, ctrl, finish): a pair of p2p.P2PRoute, what shm.py's rings take (REMOTE_BYTES,
 * CTRL_BYTES) and p2p._finish. */
static PyObject *Caller_add_pair(Caller *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 12) return PyErr_Format(PyExc_TypeError, "add_pair takes 12 arguments");
    if (self->group == NULL) return PyErr_Format(PyExc_RuntimeError, "Caller was not set up");
    Pair p;
    memset(&p, 0, sizeof p);
    p.dst = PyLong_AsLong(args[0]);
    p.src = PyLong_AsLong(args[1]);
    p.tag = PyLong_AsLong(args[2]);
    p.send_bytes = PyLong_AsSsize_t(args[3]);
    p.recv_bytes = PyLong_AsSsize_t(args[4]);
    p.remote = PyLong_AsSsize_t(args[9]);
    p.ctrl = PyLong_AsSsize_t(args[10]);
    if (PyErr_Occurred()) return NULL;
    struct { PyObject *route; const char *name; PyObject **to; } fields[] = {
        {args[7], "peer", &p.out_peer}, {args[7], "wire", &p.out_wire}, {args[8], "peer", &p.in_peer},
        {args[8], "key", &p.in_key}, {args[8], "wire", &p.in_wire}};
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        if ((*fields[i].to = PyObject_GetAttrString(fields[i].route, fields[i].name)) == NULL) {
            pair_clear(&p);
            return NULL;
        }
    if (self->npairs == self->pairs_cap) {
        Py_ssize_t cap = self->pairs_cap ? 2 * self->pairs_cap : 8;
        Pair *grown = PyMem_Realloc(self->pairs, (size_t)cap * sizeof(Pair));
        if (grown == NULL) {
            pair_clear(&p);
            return PyErr_NoMemory();
        }
        self->pairs = grown;
        self->pairs_cap = cap;
    }
    p.send_dtype = Py_NewRef(args[5]);
    p.recv_dtype = Py_NewRef(args[6]);
    p.out_route = Py_NewRef(args[7]);
    p.in_route = Py_NewRef(args[8]);
    p.finish = Py_NewRef(args[11]);
    self->pairs[self->npairs++] = p;
    Py_RETURN_NONE;
}

/* obj.name, true or not; -1 on an error. */
static int attr_true(PyObject *obj, PyObject *name) {
    PyObject *v = PyObject_GetAttr(obj, name);
    int t = v == NULL ? -1 : PyObject_IsTrue(v);
    Py_XDECREF(v);
    return t;
}

/* ShmChannel.exchange_now through `out` and `inn` (the engine's lock held, both checked direct
 * and nothing filed under the receive's key): the ring call's result (2, 1, 0 or -1), or -2
 * where exchange_now would return None (the engine then goes one by one). */
static int exchange(Caller *c, Pair *p, PyObject *out, PyObject *inn, PyObject *send, PyObject *recv) {
    PyObject *ring = NULL, *in_ring = NULL, *native = PyObject_GetAttr(out, S_native), *call[11] = {NULL};
    int s = -2, queued;
    if (native == NULL || native == Py_None || attr_true(out, S_sendq) != 0 || p->send_bytes >= p->remote)
        goto done;
    if ((ring = PyObject_GetAttr(out, S_out_ring)) == NULL || (call[2] = PyObject_GetAttr(ring, S_capacity)) == NULL)
        goto done;
    Py_ssize_t cap = PyLong_AsSsize_t(call[2]);
    PyObject *sink = PyObject_GetAttr(inn, S_sink);
    Py_XDECREF(sink);
    if (sink != Py_None || p->send_bytes > (cap >> 1) - 127) goto done;
    PyObject *stream = PyObject_GetAttr(inn, S_stream);
    queued = stream == NULL ? -1 : attr_true(inn, S_sendq);
    if (queued == 0) queued = attr_true(stream, S_sendq);
    Py_XDECREF(stream);
    double spin = 0.0;
    if (queued == 0) {
        PyObject *spin_s = PyObject_GetAttr(c->engine, S_spin_s);
        spin = spin_s == NULL ? -1.0 : PyFloat_AsDouble(spin_s);
        Py_XDECREF(spin_s);
    }
    if (queued < 0 || spin < 0.0 || (in_ring = PyObject_GetAttr(inn, S_in_ring)) == NULL ||
        (call[0] = PyObject_GetAttr(ring, S_bytes)) == NULL || (call[5] = PyObject_GetAttr(in_ring, S_bytes)) == NULL ||
        (call[7] = PyObject_GetAttr(in_ring, S_capacity)) == NULL || (call[1] = PyLong_FromSsize_t(p->ctrl)) == NULL ||
        (call[10] = PyLong_FromLongLong((long long)(spin * 1e9))) == NULL)
        goto done;
    call[6] = Py_NewRef(call[1]);
    call[3] = Py_NewRef(p->out_wire);
    call[4] = Py_NewRef(send);
    call[8] = Py_NewRef(p->in_wire);
    call[9] = Py_NewRef(recv);
    PyObject *done_obj = ring_sendrecv(NULL, call, 11);
    if (done_obj == NULL) {
        s = -3;
        goto done;
    }
    s = (int)PyLong_AsLong(done_obj);
    Py_DECREF(done_obj);
    if (s == 2 && (PyObject_SetAttr(inn, S_parked, Py_None) < 0 || PyObject_SetAttr(inn, S_release, Py_False) < 0))
        s = -3;
done:
    for (int i = 0; i < 11; i++) Py_XDECREF(call[i]);
    Py_XDECREF(native);
    Py_XDECREF(ring);
    Py_XDECREF(in_ring);
    if (s == -2 && PyErr_Occurred()) s = -3;
    return s;
}

/* sendrecv(send, dst, recv, src, tag=0, timeout=None): p2p.sendrecv's first way, a pair of
 * routes used before between numpy arrays, run as Engine.sendrecv_now runs it where both
 * channels are rings: what goes at once is sent and received here, a receive that did not come
 * within the spin goes to p2p._finish, and anything else to the Python function, nothing done. */
static PyObject *Caller_sendrecv(Caller *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Args a;
    PyObject **pos = a.pos;
    Pair *p = NULL;
    Py_ssize_t send_bytes, recv_bytes;
    if (c->npairs && parse(args, nargs, kwnames, SENDRECV, 0, &a) && pos[0] != NULL && pos[1] != NULL &&
        pos[2] != NULL && pos[3] != NULL) {
        a.timeout = pos[5] == Py_None ? NULL : pos[5];
        long dst = small(pos[1]), src = small(pos[3]), tag = pos[4] == NULL ? 0 : small(pos[4]);
        int ints = pos[4] == NULL || PyLong_CheckExact(pos[4]); /* small() says -1 for a tag of another type */
        PyObject *send_dtype = ints ? array_of(c, pos[0], 0, &send_bytes) : NULL, *recv_dtype = NULL;
        if (send_dtype != NULL) recv_dtype = array_of(c, pos[2], 1, &recv_bytes);
        for (Py_ssize_t i = 0; recv_dtype != NULL && i < c->npairs; i++) {
            Pair *q = &c->pairs[i];
            if (q->dst == dst && q->src == src && q->tag == tag && q->send_bytes == send_bytes &&
                q->recv_bytes == recv_bytes && q->send_dtype == send_dtype && q->recv_dtype == recv_dtype) {
                p = q;
                break;
            }
        }
        Py_XDECREF(send_dtype);
        Py_XDECREF(recv_dtype);
        int s = -2;
        if (p != NULL) {
            PyObject *took = PyObject_CallMethodNoArgs(c->lock, S_acquire);
            if (took == NULL) return NULL;
            Py_DECREF(took);
            PyObject *out = PyDict_GetItemWithError(c->channels, p->out_peer);
            PyObject *inn = out == NULL ? NULL : PyDict_GetItemWithError(c->channels, p->in_peer);
            if (inn != NULL && !PyDict_GET_SIZE(c->aborted) && !PyDict_GET_SIZE(c->lost)) {
                Py_INCREF(out);
                Py_INCREF(inn);
                int direct = attr_true(out, S_direct);
                if (direct > 0) direct = attr_true(inn, S_direct);
                PyObject *filed = direct > 0 ? PyDict_GetItemWithError(c->posted, p->in_key) : NULL;
                int busy = filed != NULL ? PyObject_IsTrue(filed) : 0;
                if (direct > 0 && !busy && !PyErr_Occurred()) {
                    filed = PyDict_GetItemWithError(c->unexpected, p->in_key);
                    busy = filed != NULL ? PyObject_IsTrue(filed) : 0;
                }
                if (direct < 0 || busy < 0 || PyErr_Occurred())
                    s = -3;
                else if (direct > 0 && !busy)
                    s = exchange(c, p, out, inn, pos[0], pos[2]);
                Py_DECREF(out);
                Py_DECREF(inn);
            } else if (PyErr_Occurred()) {
                s = -3;
            }
            PyObject *exc = s == -3 ? take_exception() : NULL;
            PyObject *released = PyObject_CallMethodNoArgs(c->lock, S_release_);
            if (exc != NULL) {
                Py_XDECREF(released);
#if PY_VERSION_HEX >= 0x030C0000
                PyErr_SetRaisedException(exc);
#else
                PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
                Py_DECREF(exc);
#endif
                return NULL;
            }
            if (released == NULL) return NULL;
            Py_DECREF(released);
        }
        if (s == 1) { /* sent; the receive goes the general way (held: the call may clear the pairs) */
            PyObject *finish = Py_NewRef(p->finish), *out_route = Py_NewRef(p->out_route);
            PyObject *in_route = Py_NewRef(p->in_route);
            PyObject *rest[7] = {c->group, pos[0], out_route, pos[2], in_route, Py_True,
                                 a.timeout != NULL ? a.timeout : Py_None};
            PyObject *done = PyObject_Vectorcall(finish, rest, 7, NULL);
            Py_DECREF(finish);
            Py_DECREF(out_route);
            Py_DECREF(in_route);
            if (done == NULL) return NULL;
            Py_DECREF(done);
        }
        if (s >= 1) return Py_NewRef(pos[3]);
        if (PyErr_Occurred()) return NULL;
    }
    return fall_back(c, SENDRECV, args, nargs, kwnames);
}

static int Caller_traverse(Caller *self, visitproc visit, void *arg) {
    PyObject *objs[] = {self->group, self->queue, self->engine, self->finish, self->lock, self->channels,
                        self->lost, self->posted, self->pending, self->unexpected,
                        self->deferred, self->refusals, self->aborted, self->current, self->sum,
                        self->array_type, self->view_of, (PyObject *)self->call_type};
    for (size_t i = 0; i < sizeof objs / sizeof objs[0]; i++) Py_VISIT(objs[i]);
    for (int i = 0; i < N_COLLS; i++) Py_VISIT(self->fallback[i]);
    for (Py_ssize_t i = 0; i < self->n; i++) {
        Entry *e = &self->entries[i];
        Py_VISIT(e->call);
        Py_VISIT(e->tail);
        Py_VISIT((PyObject *)e->path);
    }
    for (Py_ssize_t i = 0; i < self->npairs; i++) {
        Py_VISIT(self->pairs[i].out_route);
        Py_VISIT(self->pairs[i].in_route);
        Py_VISIT(self->pairs[i].finish);
    }
    return 0;
}

static int Caller_clear(Caller *self) {
    Py_DECREF(Caller_clear_entries(self, NULL));
    Py_DECREF(Caller_clear_pairs(self, NULL));
    Py_CLEAR(self->lock);
    Py_CLEAR(self->channels);
    Py_CLEAR(self->lost);
    Py_CLEAR(self->posted);
    Py_CLEAR(self->group);
    Py_CLEAR(self->queue);
    Py_CLEAR(self->engine);
    Py_CLEAR(self->finish);
    Py_CLEAR(self->pending);
    Py_CLEAR(self->unexpected);
    Py_CLEAR(self->deferred);
    Py_CLEAR(self->refusals);
    Py_CLEAR(self->aborted);
    Py_CLEAR(self->current);
    for (int i = 0; i < N_COLLS; i++) Py_CLEAR(self->fallback[i]);
    Py_CLEAR(self->sum);
    Py_CLEAR(self->array_type);
    Py_CLEAR(self->view_of);
    Py_CLEAR(self->call_type);
    Py_CLEAR(self->zero);
    return 0;
}

static void Caller_dealloc(Caller *self) {
    PyObject_GC_UnTrack(self);
    Caller_clear(self);
    PyMem_Free(self->entries);
    PyMem_Free(self->pairs);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define API(NAME) (PyCFunction)(void (*)(void))NAME, METH_FASTCALL | METH_KEYWORDS
static PyMethodDef Caller_methods[] = {
    {"add", (PyCFunction)(void (*)(void))Caller_add, METH_FASTCALL,
     "add(collective, dtype, nbytes, root, op, inplace, path, call, ctx, a, b, tail, *extra)"},
    {"clear", (PyCFunction)Caller_clear_entries, METH_NOARGS, "clear(): forget every signature"},
    {"add_pair", (PyCFunction)(void (*)(void))Caller_add_pair, METH_FASTCALL,
     "add_pair(dst, src, tag, send_bytes, recv_bytes, send_dtype, recv_dtype, out_route, in_route, remote, ctrl, "
     "finish)"},
    {"clear_pairs", (PyCFunction)Caller_clear_pairs, METH_NOARGS, "clear_pairs(): forget every pair of routes"},
    {"sendrecv", API(Caller_sendrecv), "Group.sendrecv, a pair of routes used before in C"},
    {"all_reduce", API(Caller_all_reduce), "Group.all_reduce, planned calls in C"},
    {"reduce", API(Caller_reduce), "Group.reduce, planned calls in C"},
    {"broadcast", API(Caller_broadcast), "Group.broadcast, planned calls in C"},
    {"barrier", API(Caller_barrier), "Group.barrier, planned calls in C"},
    {"gather", API(Caller_gather), "Group.gather, planned calls in C"},
    {"scatter", API(Caller_scatter), "Group.scatter, planned calls in C"},
    {"all_gather_into_tensor", API(Caller_all_gather), "Group.all_gather_into_tensor, planned calls in C"},
    {"reduce_scatter_tensor", API(Caller_reduce_scatter), "Group.reduce_scatter_tensor, planned calls in C"},
    {"all_to_all_single", API(Caller_all_to_all), "Group.all_to_all_single, planned calls in C"},
    {NULL},
};

static PyTypeObject CallerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tensorwire.transport._native.Caller",
    .tp_basicsize = sizeof(Caller),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One group's planned one-shot calls from its API in one C call (see group/planned.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Caller_init,
    .tp_traverse = (traverseproc)Caller_traverse,
    .tp_clear = (inquiry)Caller_clear,
    .tp_dealloc = (destructor)Caller_dealloc,
    .tp_methods = Caller_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_native",
    .m_doc = "The direct path's one-shot bodies in C.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&PathType) < 0 || PyType_Ready(&CallerType) < 0) return NULL;
    struct { PyObject **to; const char *s; } names[] = {{&S_out, "out"}, {&S_async_op, "async_op"},
        {&S_timeout, "timeout"}, {&S_compress, "compress"}, {&S_dtype, "dtype"}, {&S_wake, "wake"},
        {&S_acquire, "acquire"}, {&S_release_, "release"}, {&S_direct, "direct"}, {&S_native, "native"},
        {&S_sendq, "sendq"}, {&S_sink, "_sink"}, {&S_out_ring, "out"}, {&S_in_ring, "inn"}, {&S_bytes, "bytes"},
        {&S_capacity, "capacity"}, {&S_stream, "stream"}, {&S_parked, "parked"}, {&S_release, "release"},
        {&S_spin_s, "spin_s"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (*names[i].to == NULL && (*names[i].to = PyUnicode_InternFromString(names[i].s)) == NULL) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&PathType);
    Py_INCREF(&CallerType);
    PyObject *calls = PyTuple_New(N_COLLS);
    for (int i = 0; calls != NULL && i < N_COLLS; i++) {
        PyObject *name = PyUnicode_FromString(COLLS[i]);
        if (name == NULL) Py_CLEAR(calls);
        else PyTuple_SET_ITEM(calls, i, name);
    }
    if (calls == NULL || PyModule_AddObject(m, "COMPILED_CALLS", calls) < 0 ||
        PyModule_AddObject(m, "Path", (PyObject *)&PathType) < 0 ||
        PyModule_AddObject(m, "Caller", (PyObject *)&CallerType) < 0 ||
        PyModule_AddIntConstant(m, "DONE", DONE) < 0 || PyModule_AddIntConstant(m, "PENDING", PENDING) < 0 ||
        PyModule_AddIntConstant(m, "NOT_ENTERED", NOT_ENTERED) < 0) {
        Py_DECREF(&PathType);
        Py_DECREF(&CallerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
