/* What transport/_native.c (the one-shot bodies, the ring loops) and _caller.c (the compiled
 * caller) share: one extension module, two files. */
#ifndef TENSORWIRE_NATIVE_H
#define TENSORWIRE_NATIVE_H

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
#define SETTLED (-4)
#define COPIED (-5)
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
    long long wait_ns;      /* ... of the single copy bodies' waits (as long as a waiter spins in Python) */
    int yields;
    /* the protocol's state, as segment.State holds it on the Python path */
    int parity;             /* the slot parity of the last call entered */
    int settled;            /* every rank is known past that call, its stamps checked */
    int unvetted;           /* a message-path call's notes to check before the next entry */
    unsigned long long prev_seq, prev_a, prev_b; /* the last call published, its fingerprint words */
    PyObject *prev_name;    /* its collective */
} Path;

extern PyTypeObject PathType;

/* A read of a single copy body: buffer `index` of the table rank `source` published, into dst. */
typedef struct {
    int source, index;
    char *dst;
    Py_ssize_t len;
    uint64_t remote; /* where it lies in the source, once published */
} Read;

/* A planned single copy call's arguments (moves_plan), its buffers held. */
enum { MOVE_BROADCAST, MOVE_ALL_GATHER, MOVE_ALL_TO_ALL, MOVE_GATHER, MOVE_SCATTER };
typedef struct {
    uint64_t *table, *pid, alias;
    Py_ssize_t words, count, held, llen;
    Read *reads;
    Py_buffer *buf;
    char *ldst, *lsrc;
    int whom;
} Moves;

/* A table's share of huge pages (transport/pages.py): UNKNOWN where the kernel cannot tell;
 * PAGES_SCAN, given to moves_plan as its `unknown`, asks it to scan what peers read. */
#define PAGES_UNKNOWN 15
#define PAGES_SCAN 16
int moves_plan(Moves *m, Path *p, int kind, int root, PyObject *pids, uint64_t alias, uint64_t unknown,
               PyObject *x, PyObject *y);
uint64_t moves_least_pages(const Path *p, Py_ssize_t word);
PyObject *moves_run(Path *p, PyObject *const *head_args, Moves *m);
void moves_release(Moves *m);

/* The Path methods, called with a Python method's arguments (see each in _native.c). */
PyObject *Path_all_reduce(Path *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *Path_reduce(Path *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *Path_broadcast(Path *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *Path_gather(Path *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *Path_scatter(Path *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *Path_exchange(Path *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *Path_barrier(Path *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *ring_sendrecv(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
int blocks_match(PyObject *blocks, PyObject *like_obj, int writable);
int to_int(PyObject *o, int lo, int hi, const char *what, int *v);

/* Ready the Caller type and add it and COMPILED_CALLS to the module (_caller.c); -1 on error. */
int caller_ready(PyObject *module);

#endif
