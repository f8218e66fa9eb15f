/* The compiled caller: a planned call from the group's API down in one C call, part of the
 * _native module (docs/design/native.md, "The caller").
 *
 * group/planned.py adds each planned signature whose body is one of the Path methods of
 * _native.c, and Group takes the Caller's methods as its own (group.py). A call that matches
 * one, on numpy arrays that pass the planned path's checks (collectives.py), with the queue idle
 * and nothing arrived to vet (Plans.submit's conditions, read from the objects' slots), is
 * numbered and run here; any other call goes to the Python function untouched. A body that hands
 * back a status or raises is finished by Plans.finish, as Plans.submit's body would be. */
#include "_native.h"
#include <float.h>

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
#define MAX_ARGS 11

typedef struct {
    int coll, root, inplace, nargs;
    int moves; /* a single copy plan's: its body is moves_plan's and moves_run, its extra (kind, root,
                * pids, alias, unknown) */
    PyObject *dtype, *op;   /* the signature's dtype and op, matched by identity (None: none) */
    Py_ssize_t nbytes, out_bytes; /* its input's bytes, and its output's where that differs */
    Path *path;
    PyObject *call, *ref, *ctx, *tail;
    PyObject *small; /* a page-dependent single copy plan's: told the least share of huge pages
                      * its sources reported, where under HUGE_SEEN (tuner.PageDependent); else NULL */
    PyObject *args[MAX_ARGS]; /* the body's arguments; seq and the arrays filled per call */
} Entry;

#define HUGE_SEEN 4 /* tuner.HUGE_SEEN */

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
    PyObject *group, *queue, *engine, *finish;
    /* the queue's and engine's containers, never replaced (read in place), and the engine's lock */
    PyObject *pending, *callbacks, *entry, *unexpected, *deferred, *refusals, *aborted, *current, *channels, *lost,
        *posted, *lock;
    PyObject *fallback[N_COLLS]; /* the group's Python methods */
    PyObject *sum, *array_type, *view_of, *zero;
    PyObject *ident; /* the ident of the thread that called last, as CallQueue.compiled holds it */
    unsigned long ident_value;
    PyTypeObject *call_type;
    int rank, size;
    /* the offsets of the state's scalars: the queue's, the engine's, a CollectiveCall's */
    Py_ssize_t q_seq, q_busy, q_doomed, q_current, q_logged, q_compiled, q_overlap, e_glance, c_seq, c_timeout,
        c_deadline;
    Entry *entries; /* the planned signatures */
    Py_ssize_t n, cap, hint;
    Pair *pairs; /* sendrecv's pairs of routes */
    Py_ssize_t npairs, pairs_cap;
} Caller;

static PyObject *S_out, *S_async_op, *S_timeout, *S_compress, *S_dtype, *S_wake, *S_acquire, *S_release_,
    *S_direct, *S_native, *S_sendq, *S_sink, *S_out_ring, *S_in_ring, *S_bytes, *S_capacity, *S_stream, *S_parked,
    *S_release, *S_spin_s, *S_glance, *S_check_alone;

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

/* `v` in *x where it is an int that a long holds; 0 where not (an int past it is never taken
 * as -1: the call goes to the Python function, which names it). */
static int exact_long(PyObject *v, long *x) {
    int overflow;
    if (v == NULL || !PyLong_CheckExact(v)) return 0;
    *x = PyLong_AsLongAndOverflow(v, &overflow);
    return !overflow;
}

/* A timeout= the caller runs with as it is: a float, or an int a long holds, above 0 and finite;
 * the Python function checks any other (limit_of), and refuses it or reads it. */
static int seconds(PyObject *t) {
    long n;
    if (PyFloat_CheckExact(t)) return PyFloat_AS_DOUBLE(t) > 0.0 && PyFloat_AS_DOUBLE(t) <= DBL_MAX;
    return exact_long(t, &n) && n > 0;
}

static long small(PyObject *v) { /* an int slot's value; -1 where it is not a small int */
    long x;
    return exact_long(v, &x) ? x : -1;
}

static void entry_clear(Entry *e) {
    Py_CLEAR(e->dtype);
    Py_CLEAR(e->op);
    Py_CLEAR(e->path);
    Py_CLEAR(e->call);
    Py_CLEAR(e->ref);
    Py_CLEAR(e->ctx);
    Py_CLEAR(e->tail);
    Py_CLEAR(e->small);
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
        {queue, "pending", &self->pending, 0}, {queue, "callbacks", &self->callbacks, 0},
        {queue, "entry", &self->entry, 1},
        {engine, "unexpected", &self->unexpected, 1},
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
        !slot_offset(qt, "logged", &self->q_logged) || !slot_offset(qt, "compiled", &self->q_compiled) ||
        !slot_offset(qt, "overlap", &self->q_overlap) ||
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
 * a planned signature (extra: the body's arguments after the arrays: a fold code, a root);
 * add_moves(...) the same of a single copy plan (extra: kind, root, pids, alias, unknown), then
 * `small` (Entry.small, or None). */
static PyObject *add_entry(Caller *self, PyObject *const *args, Py_ssize_t nargs, int moves) {
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
    e->moves = moves;
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

static PyObject *Caller_add(Caller *self, PyObject *const *args, Py_ssize_t nargs) {
    return add_entry(self, args, nargs, 0);
}

static PyObject *Caller_add_moves(Caller *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != ADD_ARGS + 6) return PyErr_Format(PyExc_TypeError, "add_moves takes %d arguments", ADD_ARGS + 6);
    PyObject *added = add_entry(self, args, nargs - 1, 1);
    if (added != NULL && args[nargs - 1] != Py_None) self->entries[self->n - 1].small = Py_NewRef(args[nargs - 1]);
    return added;
}

static PyObject *Caller_clear_entries(Caller *self, PyObject *unused) {
    (void)unused;
    for (Py_ssize_t i = 0; i < self->n; i++) entry_clear(&self->entries[i]);
    self->n = 0;
    Py_RETURN_NONE;
}

/* Plans.submit's glance where the counter comes to it (Engine.glance: one round of progress and
 * of the sockets, which may bring an abort that clear_to_run then sees), before the call's plan
 * is looked up: the glance lets other threads run, which may add plans (the table moves). 0 with
 * an exception where it raised. */
static int glance_if_due(Caller *c) {
    if (small(SLOT(c->engine, c->e_glance)) > 1) return 1;
    PyObject *glanced = PyObject_CallMethodNoArgs(c->engine, S_glance);
    Py_XDECREF(glanced);
    return glanced != NULL;
}

/* Nothing stands between the call and its body: Plans.submit's conditions for a one-shot body
 * run inline (glance_if_due has glanced), the COLL log's line per call off among them; no other
 * thread's call has entered the group (CallQueue.entry: `run` takes the group, through
 * CallQueue.compiled and busy, with no Python code run between). */
static int clear_to_run(Caller *c, Entry *e) {
    if (SLOT(c->queue, c->q_busy) != Py_False || SLOT(c->queue, c->q_logged) != Py_False ||
        PyObject_Length(c->pending) != 0 || PyDict_GET_SIZE(c->entry) != 0 ||
        PyObject_Length(c->callbacks) != 0 ||
        small(SLOT(c->queue, c->q_doomed)) != 0 || small(SLOT(c->engine, c->e_glance)) <= 1 ||
        PyDict_GET_SIZE(c->unexpected) || PyObject_Length(c->deferred) != 0)
        return 0;
    if (PyDict_GET_SIZE(c->refusals) && PyDict_Contains(c->refusals, e->ctx) != 0) return 0;
    if (PyDict_GET_SIZE(c->aborted) && PyDict_Contains(c->aborted, e->ctx) != 0) return 0;
    return !PyErr_Occurred();
}

/* This thread's ident (CallQueue.compiled's value), kept while one thread calls; NULL on an error. */
static PyObject *thread_ident(Caller *c) {
    unsigned long id = PyThread_get_thread_ident();
    if (c->ident == NULL || c->ident_value != id) {
        Py_XSETREF(c->ident, PyLong_FromUnsignedLong(id));
        c->ident_value = id;
    }
    return c->ident;
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
 * finish here. NULL without an exception: a single copy plan's arrays overlap where its Python
 * body would copy the input apart first; nothing done (the Python function takes the call). */
static PyObject *run(Caller *c, Entry *e, PyObject *timeout, PyObject *x, PyObject *y, PyObject *result) {
    Moves mv;
    if (e->moves) {
        int kind, root;
        uint64_t alias, unknown;
        if (!to_int(e->args[6], 0, 5, "kind", &kind) || !to_int(e->args[7], -1, MAX_RANKS, "root", &root))
            return NULL;
        alias = PyLong_AsUnsignedLongLong(e->args[9]);
        unknown = PyLong_AsUnsignedLongLong(e->args[10]);
        if (PyErr_Occurred()) return NULL;
        int planned = moves_plan(&mv, e->path, kind, root, e->args[8], alias, unknown, x, y);
        if (planned <= 0) {
            moves_release(&mv);
            return NULL;
        }
    }
    /* what the call uses of its entry, held first: the body lets other threads run, and one may
     * add a plan (the table moves) or clear them */
    PyObject *args[MAX_ARGS], *call = Py_NewRef(e->call), *tail = Py_NewRef(e->tail);
    PyObject *ctx = Py_NewRef(e->ctx), *ref = Py_NewRef(e->ref), *small_pages = Py_XNewRef(e->small);
    Py_ssize_t pages_at = e->moves ? mv.words - 1 : 0; /* the table's share of huge pages */
    Path *path = (Path *)Py_NewRef(e->path);
    int nargs = e->nargs;
    body_fn body = BODIES[e->coll];
    for (int i = 0; i < nargs; i++) args[i] = Py_XNewRef(e->args[i]); /* seq and the arrays: NULL */
    long long last = PyLong_AsLongLong(SLOT(c->queue, c->q_seq));
    PyObject *seq = last == -1 && PyErr_Occurred() ? NULL : PyLong_FromLongLong(last + 1);
    PyObject *glance = PyLong_FromLong(small(SLOT(c->engine, c->e_glance)) - 1);
    timeout = timeout != NULL ? Py_NewRef(timeout) : PyObject_GetAttr(c->group, S_timeout);
    PyObject *ident = thread_ident(c);
    int ok = seq != NULL && glance != NULL && timeout != NULL && ident != NULL &&
             PyDict_SetItem(c->current, ctx, ref) == 0;
    Py_DECREF(ctx);
    Py_DECREF(ref);
    if (!ok) {
        Py_XDECREF(seq);
        Py_XDECREF(glance);
        Py_XDECREF(timeout);
        for (int i = 0; i < nargs; i++) Py_XDECREF(args[i]);
        Py_DECREF(path);
        Py_DECREF(call);
        Py_DECREF(tail);
        Py_XDECREF(small_pages);
        return NULL;
    }
    set_slot(c->engine, c->e_glance, glance);
    set_slot(c->queue, c->q_seq, Py_NewRef(seq));
    set_slot(call, c->c_seq, Py_NewRef(seq));
    set_slot(call, c->c_timeout, timeout);
    set_slot(call, c->c_deadline, Py_NewRef(c->zero));
    set_slot(c->queue, c->q_current, Py_NewRef(call));
    set_slot(c->queue, c->q_busy, Py_NewRef(Py_True));
    set_slot(c->queue, c->q_compiled, Py_NewRef(ident));
    args[0] = seq;
    if (nargs > 4) {
        args[4] = Py_NewRef(x);
        args[5] = Py_NewRef(y);
    }
    PyObject *status = NULL;
    if (e->moves) {
        status = moves_run(path, args, &mv);
        moves_release(&mv);
    } else {
        status = body(path, args, nargs);
    }
    for (int i = 0; i < nargs; i++) Py_DECREF(args[i]); /* seq's with them */
    long s = status == NULL ? 0 : PyLong_AsLong(status);
    if (s == -1 && PyErr_Occurred()) Py_CLEAR(status); /* no status: its error is the body's */
    PyObject *done;
    if (status != NULL && s == DONE) {
        Py_DECREF(status);
        set_slot(c->queue, c->q_busy, Py_NewRef(Py_False));
        set_slot(c->queue, c->q_compiled, Py_NewRef(Py_None));
        done = SLOT(c->queue, c->q_overlap) != Py_None ? PyObject_CallMethodNoArgs(c->queue, S_check_alone)
               : PyObject_Length(c->pending) > 0 ? PyObject_CallMethodNoArgs(c->queue, S_wake)
                                                 : Py_NewRef(Py_None);
    } else {
        if (status == NULL) status = take_exception();
        PyObject *finish_args[5] = {call, tail, status, x, y};
        done = PyObject_Vectorcall(c->finish, finish_args, x == NULL ? 3 : 5, NULL);
        Py_DECREF(status);
    }
    Py_DECREF(call);
    Py_DECREF(tail);
    if (done != NULL && small_pages != NULL) { /* every rank reads the same reports: all learn alike */
        uint64_t least = moves_least_pages(path, pages_at);
        if (least < HUGE_SEEN) {
            Py_DECREF(done);
            done = PyObject_CallFunction(small_pages, "K", (unsigned long long)least);
        }
    }
    Py_DECREF(path);
    Py_XDECREF(small_pages);
    if (done == NULL) return NULL;
    Py_DECREF(done);
    return Py_NewRef(result);
}

/* The Python function's call (the group first). */
static PyObject *fall_back(Caller *c, int coll, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (c->group == NULL) return PyErr_Format(PyExc_RuntimeError, "the group of this Caller is gone");
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
 * argument is not one of its parameters or is given twice, where async_op or compress is not
 * its default, or the timeout not `seconds` (the Python function takes those calls, and names
 * what is wrong). */
static int parse(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int coll, int has, Args *a) {
    Py_ssize_t max = 0;
    while (max < 6 && PARAMS[coll][max] != NULL) max++;
    if (nargs > max) return 0;
    for (Py_ssize_t i = 0; i < 6; i++) a->pos[i] = i < nargs ? args[i] : NULL;
    a->out = a->timeout = NULL;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i), *value = args[nargs + i];
        if (is_name(name, S_timeout) && coll != SENDRECV) { /* sendrecv's is among its PARAMS */
            if (value != Py_None && !seconds(value)) return 0;
            a->timeout = value == Py_None ? NULL : value;
        } else if (is_name(name, S_async_op)) {
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
        if (!glance_if_due(c)) return NULL;
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
        PyObject *result = tensor;
        if (dtype != NULL && out != NULL && (coll != REDUCE || root == c->rank)) {
            PyObject *out_dtype = (dst = planned_array(c, out)) == NULL ? NULL : array_of(c, dst, 1, &out_bytes);
            Py_XDECREF(out_dtype);
            if (out_dtype != dtype || out_bytes != nbytes) Py_CLEAR(dtype);
            result = out;
        }
        /* looked up last: the Python code above (a tensor's view) may let a thread add a plan */
        if (dtype != NULL) e = lookup(c, coll, dtype, nbytes, nbytes, root, op, out == NULL);
        Py_XDECREF(dtype);
        if (e != NULL && clear_to_run(c, e)) done = run(c, e, a.timeout, src, dst != NULL ? dst : src, result);
        Py_XDECREF(src);
        Py_XDECREF(dst);
        if (done != NULL || PyErr_Occurred()) return done;
    }
    return fall_back(c, coll, args, nargs, kwnames);
}

/* gather and scatter: (tensor, list, root); the list is the root's blocks, ignored elsewhere. */
static PyObject *list_call(Caller *c, int coll, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Args a;
    PyObject **pos = a.pos, *dtype = NULL;
    Entry *e = NULL;
    Py_ssize_t nbytes;
    if (c->n && parse(args, nargs, kwnames, coll, 0, &a) && pos[0] != NULL) {
        if (!glance_if_due(c)) return NULL;
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
            PyObject *done = coll == GATHER ? run(c, e, a.timeout, tensor, blocks, list)
                                            : run(c, e, a.timeout, blocks, tensor, tensor);
            if (done != NULL || PyErr_Occurred()) return done;
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
        if (!glance_if_due(c)) return NULL;
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

/* The methods that are one of the shapes above for one collective. */
#define METHOD(NAME, SHAPE, COLL)                                                                    \
    static PyObject *NAME(Caller *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {  \
        return SHAPE(c, COLL, args, nargs, kwnames);                                               \
    }
METHOD(Caller_all_reduce, array_call, ALL_REDUCE)
METHOD(Caller_reduce, array_call, REDUCE)
METHOD(Caller_broadcast, array_call, BROADCAST)
METHOD(Caller_gather, list_call, GATHER)
METHOD(Caller_scatter, list_call, SCATTER)
METHOD(Caller_all_gather, tensor_call, ALL_GATHER)
METHOD(Caller_reduce_scatter, tensor_call, REDUCE_SCATTER)
METHOD(Caller_all_to_all, tensor_call, ALL_TO_ALL)

static PyObject *Caller_barrier(Caller *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Args a;
    if (c->n && parse(args, nargs, kwnames, BARRIER, 0, &a)) {
        if (!glance_if_due(c)) return NULL;
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
    if (cap == -1 && PyErr_Occurred()) goto done;
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
    if (s == -1 && PyErr_Occurred()) s = -3;
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

/* Whether pair p's group has been aborted or either of its peers lost, where Engine.sendrecv_now
 * leaves the call to the general path: 1, 0, or -1 with an exception. */
static int stands_aside(Caller *c, Pair *p) {
    if (PyDict_GET_SIZE(c->lost)) {
        int lost = PyDict_Contains(c->lost, p->out_peer);
        if (lost == 0) lost = PyDict_Contains(c->lost, p->in_peer);
        if (lost != 0) return lost;
    }
    if (!PyDict_GET_SIZE(c->aborted)) return 0;
    PyObject *key = PyTuple_Check(p->in_key) && PyTuple_GET_SIZE(p->in_key) == 2 ? PyTuple_GET_ITEM(p->in_key, 1)
                                                                                 : NULL; /* (peer, header.key) */
    if (key == NULL || !PyTuple_Check(key) || PyTuple_GET_SIZE(key) < 1) return 1;
    return PyDict_Contains(c->aborted, PyTuple_GET_ITEM(key, 0)); /* header.key's ctx */
}

/* Engine.sendrecv_now's way through two rings for pair `p`, under the engine's lock: the ring
 * call's result (2: sent and received, 1: sent), -2 where it did nothing (the Python function
 * then takes the call), -3 on an error (raised). */
static int through_rings(Caller *c, Pair *p, PyObject *send, PyObject *recv) {
    PyObject *took = PyObject_CallMethodNoArgs(c->lock, S_acquire);
    if (took == NULL) return -3;
    Py_DECREF(took);
    int s = -2;
    PyObject *out = PyDict_GetItemWithError(c->channels, p->out_peer);
    PyObject *inn = out == NULL ? NULL : PyDict_GetItemWithError(c->channels, p->in_peer);
    int aside = inn == NULL ? 0 : stands_aside(c, p);
    if (inn != NULL && aside == 0) {
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
            s = exchange(c, p, out, inn, send, recv);
        Py_DECREF(out);
        Py_DECREF(inn);
    } else if (aside < 0 || PyErr_Occurred()) {
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
        return -3;
    }
    if (released == NULL) return -3;
    Py_DECREF(released);
    return s;
}

/* sendrecv(send, dst, recv, src, tag=0, timeout=None): p2p.sendrecv's first way, a pair of
 * routes used before between numpy arrays, run as Engine.sendrecv_now runs it where both
 * channels are rings: what goes at once is sent and received here, a receive that did not come
 * within the spin goes to p2p._finish, and anything else to the Python function, nothing done. */
static PyObject *Caller_sendrecv(Caller *c, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Args a;
    PyObject **pos = a.pos;
    Pair *p = NULL, held; /* held: the pair found, its objects held (the lock's wait lets another
                           * thread add a pair, and the table move, or clear them) */
    Py_ssize_t send_bytes, recv_bytes;
    long dst, src, tag = 0;
    if (c->npairs && parse(args, nargs, kwnames, SENDRECV, 0, &a) && pos[0] != NULL && pos[2] != NULL &&
        exact_long(pos[1], &dst) && exact_long(pos[3], &src) && (pos[4] == NULL || exact_long(pos[4], &tag)) &&
        (pos[5] == NULL || pos[5] == Py_None || seconds(pos[5]))) {
        a.timeout = pos[5] == Py_None ? NULL : pos[5];
        PyObject *send_dtype = array_of(c, pos[0], 0, &send_bytes), *recv_dtype = NULL;
        if (send_dtype != NULL) recv_dtype = array_of(c, pos[2], 1, &recv_bytes);
        for (Py_ssize_t i = 0; recv_dtype != NULL && i < c->npairs; i++) {
            Pair *q = &c->pairs[i];
            if (q->dst == dst && q->src == src && q->tag == tag && q->send_bytes == send_bytes &&
                q->recv_bytes == recv_bytes && q->send_dtype == send_dtype && q->recv_dtype == recv_dtype) {
                held = *q;
                PyObject *objs[] = {held.send_dtype, held.recv_dtype, held.out_peer, held.out_wire, held.in_peer,
                                    held.in_key, held.in_wire, held.out_route, held.in_route, held.finish};
                for (size_t k = 0; k < sizeof objs / sizeof objs[0]; k++) Py_XINCREF(objs[k]);
                p = &held;
                break;
            }
        }
        Py_XDECREF(send_dtype);
        Py_XDECREF(recv_dtype);
        int s = p == NULL ? -2 : through_rings(c, p, pos[0], pos[2]);
        if (s == 1) { /* sent; the receive goes the general way */
            PyObject *rest[7] = {c->group, pos[0], p->out_route, pos[2], p->in_route, Py_True,
                                 a.timeout != NULL ? a.timeout : Py_None};
            PyObject *done = PyObject_Vectorcall(p->finish, rest, 7, NULL);
            if (done == NULL) s = -3;
            Py_XDECREF(done);
        }
        if (p != NULL) pair_clear(&held);
        if (s >= 1) return Py_NewRef(pos[3]);
        if (s == -3 || PyErr_Occurred()) return NULL;
    }
    return fall_back(c, SENDRECV, args, nargs, kwnames);
}

static int Caller_traverse(Caller *self, visitproc visit, void *arg) {
    PyObject *objs[] = {self->group, self->queue, self->engine, self->finish, self->lock, self->channels,
                        self->lost, self->posted, self->pending, self->callbacks, self->entry, self->unexpected,
                        self->deferred, self->refusals, self->aborted, self->current, self->sum,
                        self->array_type, self->view_of, (PyObject *)self->call_type};
    for (size_t i = 0; i < sizeof objs / sizeof objs[0]; i++) Py_VISIT(objs[i]);
    for (int i = 0; i < N_COLLS; i++) Py_VISIT(self->fallback[i]);
    for (Py_ssize_t i = 0; i < self->n; i++) {
        Entry *e = &self->entries[i];
        Py_VISIT(e->call);
        Py_VISIT(e->tail);
        Py_VISIT(e->small);
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
    Py_CLEAR(self->callbacks);
    Py_CLEAR(self->entry);
    Py_CLEAR(self->refusals);
    Py_CLEAR(self->aborted);
    Py_CLEAR(self->current);
    for (int i = 0; i < N_COLLS; i++) Py_CLEAR(self->fallback[i]);
    Py_CLEAR(self->sum);
    Py_CLEAR(self->array_type);
    Py_CLEAR(self->view_of);
    Py_CLEAR(self->call_type);
    Py_CLEAR(self->zero);
    Py_CLEAR(self->ident);
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
    {"add_moves", (PyCFunction)(void (*)(void))Caller_add_moves, METH_FASTCALL,
     "add_moves(collective, dtype, nbytes, out_bytes, root, op, inplace, path, call, ctx, a, b, tail, kind, root, "
     "pids, alias, unknown, small)"},
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

int caller_ready(PyObject *m) {
    if (PyType_Ready(&CallerType) < 0) return -1;
    struct { PyObject **to; const char *s; } names[] = {{&S_out, "out"}, {&S_async_op, "async_op"},
        {&S_timeout, "timeout"}, {&S_compress, "compress"}, {&S_dtype, "dtype"}, {&S_wake, "wake"},
        {&S_acquire, "acquire"}, {&S_release_, "release"}, {&S_direct, "direct"}, {&S_native, "native"},
        {&S_sendq, "sendq"}, {&S_sink, "_sink"}, {&S_out_ring, "out"}, {&S_in_ring, "inn"}, {&S_bytes, "bytes"},
        {&S_capacity, "capacity"}, {&S_stream, "stream"}, {&S_parked, "parked"}, {&S_release, "release"},
        {&S_spin_s, "spin_s"}, {&S_glance, "glance"}, {&S_check_alone, "check_alone"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (*names[i].to == NULL && (*names[i].to = PyUnicode_InternFromString(names[i].s)) == NULL) return -1;
    PyObject *calls = PyTuple_New(N_COLLS);
    for (int i = 0; calls != NULL && i < N_COLLS; i++) {
        PyObject *name = PyUnicode_FromString(COLLS[i]);
        if (name == NULL) Py_CLEAR(calls);
        else PyTuple_SET_ITEM(calls, i, name);
    }
    if (calls == NULL || PyModule_AddObject(m, "COMPILED_CALLS", calls) < 0) {
        Py_XDECREF(calls);
        return -1;
    }
    Py_INCREF(&CallerType);
    if (PyModule_AddObject(m, "Caller", (PyObject *)&CallerType) < 0) {
        Py_DECREF(&CallerType);
        return -1;
    }
    return 0;
}
