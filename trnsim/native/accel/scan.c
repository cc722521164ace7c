/* trnsim.native.accel._scan: the simulator's per-instruction reads in one C pass.
 *
 * simulate() needs, for every instruction of a kernel, its type and engine, whether its deps /
 * first_deps are still the tuples the dependency tracker logged, and the few fields its cost
 * depends on (TensorE's operand views, a DMA's queue and plan, the operands a Vector/Scalar/
 * GpSimd cost key reads). Read with one map()/attrgetter pass per question, each pass costs
 * 25-50 ns per instruction in cache misses alone (the instruction objects are spread over
 * memory: a big kernel's do not fit in the caches) plus the tuples and hashes; here every
 * instruction is visited once.
 *
 * The instructions are numbered by the *identity* of those fields: two instructions get the
 * same number exactly when their type, engine and every listed field are the same objects.
 * That is finer than any value key of those fields (equal values in different objects get
 * different numbers), so a caller that works out a cost once per number, from the first
 * instruction with that number, gets what it would get instruction by instruction. Every
 * object a number stands for stays referenced until the call returns, so its address cannot
 * be reused by a temporary (a property returning a fresh object) within one call.
 *
 * An attribute that is a __slots__ member of a class with the default attribute lookup is read
 * from its slot directly (what PyObject_GetAttr finds too: a member descriptor is a data
 * descriptor, nothing overrides it), a few ns instead of ~20 through the generic lookup; an
 * empty slot, any other attribute or class goes through PyObject_GetAttr. That needs the
 * member descriptor's layout, so this is not a limited-API (abi3) module.
 *
 * A plain CPython extension, not cffi: it reads Python objects. Any error
 * (a missing attribute, a non-list) is raised as Python raises it; sim.py then takes its
 * map() path, which meets the same error where it always did.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include "slots.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SCAN_MAX_FIELDS 8

typedef struct {
    Py_ssize_t k;        /* objects per key */
    Py_ssize_t nkeys;
    Py_ssize_t cap;      /* keys allocated */
    PyObject **keys;     /* nkeys * k owned references */
    Py_ssize_t *first;   /* position (in the scanned order) of each key's first object */
    int32_t *slot;       /* open addressing: key number + 1, 0 empty */
    size_t mask;
} numbering_t;

static uint64_t hash_key(PyObject *const *p, Py_ssize_t k) {
    uint64_t h = 0x9E3779B97F4A7C15ull;
    for (Py_ssize_t i = 0; i < k; i++) {
        h ^= (uint64_t)(uintptr_t)p[i] >> 4;
        h *= 0xff51afd7ed558ccdull;
        h ^= h >> 29;
    }
    return h;
}

static void numbering_free(numbering_t *t) {
    if (t->keys) {
        for (Py_ssize_t i = 0; i < t->nkeys * t->k; i++)
            Py_XDECREF(t->keys[i]);
    }
    free(t->keys);
    free(t->first);
    free(t->slot);
    memset(t, 0, sizeof(*t));
}

static int numbering_init(numbering_t *t, Py_ssize_t k) {
    memset(t, 0, sizeof(*t));
    t->k = k;
    t->cap = 64;
    t->mask = 255;
    t->keys = malloc(sizeof(PyObject *) * (size_t)(t->cap * k));
    t->first = malloc(sizeof(Py_ssize_t) * (size_t)t->cap);
    t->slot = calloc(t->mask + 1, sizeof(int32_t));
    if (!t->keys || !t->first || !t->slot) {
        numbering_free(t);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static int numbering_grow(numbering_t *t) {
    if (t->nkeys >= INT32_MAX - 1) {
        PyErr_SetString(PyExc_OverflowError, "_scan.number: too many distinct keys");
        return -1;
    }
    if (t->nkeys == t->cap) {
        Py_ssize_t cap = t->cap * 2;
        PyObject **keys = realloc(t->keys, sizeof(PyObject *) * (size_t)(cap * t->k));
        if (!keys) { PyErr_NoMemory(); return -1; }
        t->keys = keys;
        Py_ssize_t *first = realloc(t->first, sizeof(Py_ssize_t) * (size_t)cap);
        if (!first) { PyErr_NoMemory(); return -1; }
        t->first = first;
        t->cap = cap;
    }
    if ((size_t)(t->nkeys + 1) * 2 > t->mask + 1) {  /* keep the table at most half full */
        size_t mask = t->mask * 2 + 1;
        int32_t *slot = calloc(mask + 1, sizeof(int32_t));
        if (!slot) { PyErr_NoMemory(); return -1; }
        for (Py_ssize_t j = 0; j < t->nkeys; j++) {
            size_t h = (size_t)hash_key(t->keys + j * t->k, t->k) & mask;
            while (slot[h]) h = (h + 1) & mask;
            slot[h] = (int32_t)(j + 1);
        }
        free(t->slot);
        t->slot = slot;
        t->mask = mask;
    }
    return 0;
}

/* The number of key ``cand`` (k new references); the references are kept for a new key and
 * released for a known one. -1 on error (references released). */
static Py_ssize_t numbering_get(numbering_t *t, PyObject **cand, Py_ssize_t pos) {
    Py_ssize_t k = t->k;
    size_t h = (size_t)hash_key(cand, k) & t->mask;
    for (;;) {
        int32_t s = t->slot[h];
        if (!s) break;
        PyObject **key = t->keys + (Py_ssize_t)(s - 1) * k;
        Py_ssize_t i = 0;
        while (i < k && key[i] == cand[i]) i++;
        if (i == k) {
            for (i = 0; i < k; i++) Py_XDECREF(cand[i]);
            return s - 1;
        }
        h = (h + 1) & t->mask;
    }
    if (numbering_grow(t) < 0) {
        for (Py_ssize_t i = 0; i < k; i++) Py_XDECREF(cand[i]);
        return -1;
    }
    Py_ssize_t j = t->nkeys++;
    memcpy(t->keys + j * k, cand, sizeof(PyObject *) * (size_t)k);
    t->first[j] = pos;
    h = (size_t)hash_key(cand, k) & t->mask;
    while (t->slot[h]) h = (h + 1) & t->mask;
    t->slot[h] = (int32_t)(j + 1);
    return j;
}

PyDoc_STRVAR(instructions_doc,
"instructions(instrs, fields, dlog, flog) -> (keys, first, deps_same, first_same)\n\n"
"One pass over ``instrs`` (a list): each instruction is numbered, in order of first\n"
"appearance, by the identity of (its type, its ``engine``, and ``getattr(ins, f)`` for the\n"
"names ``fields[type(ins)]`` gives, a tuple of at most 8). ``keys``: bytes, one int32 number\n"
"per instruction; ``first``: list, the position of each number's first instruction.\n"
"``deps_same``: the first position whose ``deps`` is not the object ``dlog`` holds there\n"
"(``len(instrs)`` if none; -1 if ``dlog`` is None); ``first_same`` the same for\n"
"``first_deps`` and ``flog``. ``fields`` is any mapping (a dict with ``__missing__`` works).");

static PyObject *str_engine, *str_deps, *str_first_deps;

/* The offset of ``name``'s __slots__ member in instances of ``tp``, when reading it there is
 * what PyObject_GetAttr does; -1 when not (then ask PyObject_GetAttr). */
static Py_ssize_t slot_offset(PyTypeObject *tp, PyObject *name) {
    PyMemberDef *m = slot_member(tp, name);
    if (!m || (m->type != T_OBJECT_EX && m->type != T_OBJECT))
        return -1;
    return m->offset;
}

/* getattr(obj, name), read from the slot at ``off`` when there is one (a new reference). */
static inline PyObject *get_field(PyObject *obj, PyObject *name, Py_ssize_t off) {
    if (off >= 0) {
        PyObject *v = *(PyObject **)((char *)obj + off);
        if (v) {
            Py_INCREF(v);
            return v;
        }
    }
    return PyObject_GetAttr(obj, name);  /* an empty slot raises (or gives None) as Python does */
}

/* What the pass needs of one instruction type: the field names and where each is read. */
typedef struct {
    PyTypeObject *tp;        /* owned */
    PyObject *names;         /* owned tuple */
    Py_ssize_t nf;
    Py_ssize_t off[3 + SCAN_MAX_FIELDS];  /* engine, deps, first_deps, fields... */
} tinfo_t;

typedef struct {
    tinfo_t *at;
    Py_ssize_t n, cap;
} tcache_t;

static void tcache_free(tcache_t *c) {
    for (Py_ssize_t i = 0; i < c->n; i++) {
        Py_DECREF(c->at[i].tp);
        Py_DECREF(c->at[i].names);
    }
    free(c->at);
    memset(c, 0, sizeof(*c));
}

static tinfo_t *tcache_get(tcache_t *c, PyTypeObject *tp, PyObject *fields) {
    for (Py_ssize_t i = 0; i < c->n; i++)
        if (c->at[i].tp == tp)
            return &c->at[i];
    PyObject *names = PyObject_GetItem(fields, (PyObject *)tp);
    if (!names)
        return NULL;
    if (!PyTuple_Check(names) || PyTuple_GET_SIZE(names) > SCAN_MAX_FIELDS) {
        Py_DECREF(names);
        PyErr_SetString(PyExc_ValueError, "_scan.instructions: fields must give a tuple of at most 8 names");
        return NULL;
    }
    for (Py_ssize_t f = 0; f < PyTuple_GET_SIZE(names); f++) {
        if (!PyUnicode_Check(PyTuple_GET_ITEM(names, f))) {
            Py_DECREF(names);
            PyErr_SetString(PyExc_TypeError, "_scan.instructions: fields must be attribute names");
            return NULL;
        }
    }
    if (c->n == c->cap) {
        Py_ssize_t cap = c->cap ? c->cap * 2 : 16;
        tinfo_t *at = realloc(c->at, sizeof(tinfo_t) * (size_t)cap);
        if (!at) {
            Py_DECREF(names);
            PyErr_NoMemory();
            return NULL;
        }
        c->at = at;
        c->cap = cap;
    }
    tinfo_t *e = &c->at[c->n++];
    Py_INCREF(tp);
    e->tp = tp;
    e->names = names;
    e->nf = PyTuple_GET_SIZE(names);
    e->off[0] = slot_offset(tp, str_engine);
    e->off[1] = slot_offset(tp, str_deps);
    e->off[2] = slot_offset(tp, str_first_deps);
    for (Py_ssize_t f = 0; f < e->nf; f++)
        e->off[3 + f] = slot_offset(tp, PyTuple_GET_ITEM(names, f));
    return e;
}

static PyObject *scan_instructions(PyObject *self, PyObject *args) {
    PyObject *objs, *fields, *dlog, *flog;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOOO", &objs, &fields, &dlog, &flog))
        return NULL;
    if (!PyList_Check(objs) || (dlog != Py_None && !PyList_Check(dlog)) || (flog != Py_None && !PyList_Check(flog))) {
        PyErr_SetString(PyExc_TypeError, "_scan.instructions: instrs, dlog and flog must be lists (or None)");
        return NULL;
    }
    Py_ssize_t n = PyList_Size(objs);
    if ((dlog != Py_None && PyList_Size(dlog) != n) || (flog != Py_None && PyList_Size(flog) != n)) {
        PyErr_SetString(PyExc_ValueError, "_scan.instructions: a log of another length");
        return NULL;
    }
    Py_ssize_t deps_same = dlog == Py_None ? -1 : n, first_same = flog == Py_None ? -1 : n;
    const Py_ssize_t k = 2 + SCAN_MAX_FIELDS;
    PyObject *ids = PyBytes_FromStringAndSize(NULL, n > 0 ? n * 4 : 0);
    numbering_t t;
    if (!ids || numbering_init(&t, k) < 0) {
        Py_XDECREF(ids);
        return NULL;
    }
    int32_t *out = (int32_t *)PyBytes_AsString(ids);
    PyObject *cand[2 + SCAN_MAX_FIELDS];
    tcache_t types = {NULL, 0, 0};
    tinfo_t *ti = NULL;
    for (Py_ssize_t p = 0; p < n; p++) {
        PyObject *obj = PyList_GetItem(objs, p);  /* borrowed */
        if (!obj)
            goto fail;
        Py_INCREF(obj);  /* a property below may run any code */
        PyTypeObject *tp = Py_TYPE(obj);
        Py_ssize_t c = 0;
        if (!ti || ti->tp != tp) {
            ti = tcache_get(&types, tp, fields);
            if (!ti)
                goto fail_cand;
        }
        memset(cand, 0, sizeof(cand));
        cand[c++] = (PyObject *)tp;
        Py_INCREF(tp);
        cand[c] = get_field(obj, str_engine, ti->off[0]);
        if (!cand[c])
            goto fail_cand;
        c++;
        if (deps_same == n) {
            PyObject *v = get_field(obj, str_deps, ti->off[1]);
            if (!v)
                goto fail_cand;
            PyObject *logged = PyList_GetItem(dlog, p);  /* borrowed; NULL if a property shortened it */
            Py_DECREF(v);
            if (!logged)
                goto fail_cand;
            if (v != logged)
                deps_same = p;
        }
        if (first_same == n) {
            PyObject *v = get_field(obj, str_first_deps, ti->off[2]);
            if (!v)
                goto fail_cand;
            PyObject *logged = PyList_GetItem(flog, p);
            Py_DECREF(v);
            if (!logged)
                goto fail_cand;
            if (v != logged)
                first_same = p;
        }
        for (Py_ssize_t f = 0; f < ti->nf; f++, c++) {
            cand[c] = get_field(obj, PyTuple_GET_ITEM(ti->names, f), ti->off[3 + f]);
            if (!cand[c])
                goto fail_cand;
        }
        Py_DECREF(obj);
        /* unused key slots stay NULL: numbering_get compares and releases them as such */
        Py_ssize_t j = numbering_get(&t, cand, p);
        if (j < 0)
            goto fail;
        out[p] = (int32_t)j;
        continue;
    fail_cand:
        for (Py_ssize_t i = 0; i < c; i++) Py_XDECREF(cand[i]);
        Py_DECREF(obj);
        goto fail;
    }
    tcache_free(&types);
    PyObject *first = PyList_New(t.nkeys);
    if (!first)
        goto fail;
    for (Py_ssize_t j = 0; j < t.nkeys; j++) {
        PyObject *v = PyLong_FromSsize_t(t.first[j]);
        if (!v) { Py_DECREF(first); goto fail; }
        PyList_SetItem(first, j, v);  /* steals */
    }
    numbering_free(&t);
    PyObject *res = Py_BuildValue("(NNnn)", ids, first, deps_same, first_same);  /* N: steals */
    return res;
fail:
    tcache_free(&types);
    numbering_free(&t);
    Py_DECREF(ids);
    return NULL;
}

static PyMethodDef scan_methods[] = {
    {"instructions", scan_instructions, METH_VARARGS, instructions_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef scan_module = {
    PyModuleDef_HEAD_INIT, "_scan",
    "The simulator's per-instruction reads in C (see scan.c).", -1, scan_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__scan(void) {
    str_engine = PyUnicode_InternFromString("engine");
    str_deps = PyUnicode_InternFromString("deps");
    str_first_deps = PyUnicode_InternFromString("first_deps");
    if (!str_engine || !str_deps || !str_first_deps)
        return NULL;
    return PyModule_Create(&scan_module);
}
