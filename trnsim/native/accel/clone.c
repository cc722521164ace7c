/* trnsim.native.accel._clone: instruction copies and dependency tuples for the kernel builder.
 *
 * The builder's replay (trnsim.kernel.Kernel.replay) emits a recorded run of instructions
 * again: each copy is the template instruction, every slot shared, with a new index and the
 * deps / first_deps the dependency tracker (deptrack.c) computed for it. In Python that is an
 * object, ~20 attribute stores and two tuples sliced from a list of ints per instruction, about
 * 1 us; here it is an allocation, a copy of the slot words with their references counted and two
 * tuples made straight from the tracker's int32 results. The batched records (nc_matmul_many,
 * nc_transpose_many) set deps / first_deps of fresh instructions the same way (spread).
 *
 * Only instances of pure-Python classes whose every instance word after the object header is a
 * __slots__ object member (or the weak-reference list) are copied: layout() checks that from
 * the type's members once per type and raises TypeError otherwise, so the caller can fall back
 * to its Python copy. A copy is what copy.copy would make of such an object, field for field.
 *
 * Dependency tuples hold ints only, so they are made untracked by the cyclic collector: CPython
 * untracks such tuples itself the first time a collection visits them; untracking them when
 * they are made spares that visit (a 42,000-instruction kernel makes ~75,000 of them).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#include "slots.h"

typedef struct {
    PyTypeObject *type;           /* a strong reference: the cache keeps the class alive */
    Py_ssize_t index, deps, first; /* byte offsets of those three slots */
    Py_ssize_t weaklist;          /* the weak-reference list's offset, not copied (0: none) */
} layout_t;

#define MAX_LAYOUTS 64
static layout_t layouts[MAX_LAYOUTS];
static int n_layouts = 0;

/* The offset of the writable object slot ``name`` that attribute access on instances of ``t``
 * uses (slots.h); -1 when there is none. */
static Py_ssize_t member_offset(PyTypeObject *t, const char *name) {
    PyObject *s = PyUnicode_InternFromString(name);
    if (s == NULL) {
        PyErr_Clear();
        return -1;
    }
    PyMemberDef *m = slot_member(t, s);
    Py_DECREF(s);
    return m != NULL && m->type == T_OBJECT_EX && !(m->flags & READONLY) ? m->offset : -1;
}

/* The layout of ``t``, checked and cached; NULL with TypeError set when it is not copyable. */
static const layout_t *get_layout(PyTypeObject *t) {
    for (int i = 0; i < n_layouts; i++)
        if (layouts[i].type == t)
            return &layouts[i];
    Py_ssize_t words = (t->tp_basicsize - (Py_ssize_t)sizeof(PyObject)) / (Py_ssize_t)sizeof(PyObject *);
    int ok = PyType_HasFeature(t, Py_TPFLAGS_HEAPTYPE) && t->tp_itemsize == 0 && t->tp_dictoffset == 0
             && !PyType_HasFeature(t, Py_TPFLAGS_MANAGED_DICT) && t->tp_alloc == PyType_GenericAlloc
             && t->tp_basicsize >= (Py_ssize_t)sizeof(PyObject)
             && (t->tp_basicsize - (Py_ssize_t)sizeof(PyObject)) % (Py_ssize_t)sizeof(PyObject *) == 0
             && words <= 256;
    /* every word after the header: an object member of a class in the chain, or the weaklist;
     * the chain is heap types down to object itself (no C base with fields of its own) */
    unsigned char covered[256] = {0};
    PyTypeObject *c = t;
    for (; ok && c != NULL && c != &PyBaseObject_Type; c = c->tp_base) {
        if (!PyType_HasFeature(c, Py_TPFLAGS_HEAPTYPE)) {
            ok = 0;
            break;
        }
        for (PyMemberDef *m = c->tp_members; m != NULL && m->name != NULL; m++) {
            Py_ssize_t w = (m->offset - (Py_ssize_t)sizeof(PyObject)) / (Py_ssize_t)sizeof(PyObject *);
            if (m->type == T_OBJECT_EX && m->offset >= (Py_ssize_t)sizeof(PyObject) && w < words
                && (m->offset - (Py_ssize_t)sizeof(PyObject)) % (Py_ssize_t)sizeof(PyObject *) == 0)
                covered[w] = 1;
        }
    }
    ok = ok && c == &PyBaseObject_Type;
    Py_ssize_t wl = t->tp_weaklistoffset;
    if (ok && wl > 0) {
        Py_ssize_t w = (wl - (Py_ssize_t)sizeof(PyObject)) / (Py_ssize_t)sizeof(PyObject *);
        if (w >= 0 && w < words)
            covered[w] = 1;
    }
    for (Py_ssize_t w = 0; ok && w < words; w++)
        ok = covered[w];
    layout_t l = {t, member_offset(t, "index"), member_offset(t, "deps"), member_offset(t, "first_deps"), wl > 0 ? wl : 0};
    if (!ok || l.index < 0 || l.deps < 0 || l.first < 0) {
        PyErr_Format(PyExc_TypeError, "_clone: %s is not a class of __slots__ instructions", t->tp_name);
        return NULL;
    }
    if (n_layouts == MAX_LAYOUTS) {
        PyErr_SetString(PyExc_TypeError, "_clone: too many instruction classes");
        return NULL;
    }
    Py_INCREF(t);
    layouts[n_layouts] = l;
    return &layouts[n_layouts++];
}

static inline void set_slot(PyObject *o, Py_ssize_t off, PyObject *v) {
    PyObject **p = (PyObject **)((char *)o + off);
    PyObject *old = *p;
    *p = v;
    Py_XDECREF(old);
}

/* A tuple of the ints v[0..n), untracked; NULL on error. */
static PyObject *int_tuple(const int32_t *v, Py_ssize_t n) {
    PyObject *t = PyTuple_New(n);
    if (t == NULL || n == 0)
        return t;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyLong_FromLong(v[i]);
        if (x == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, x);
    }
    PyObject_GC_UnTrack(t);
    return t;
}

static int get_ints(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) != 0)
        return -1;
    if (view->len % 4 != 0) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "_clone: results must be int32");
        return -1;
    }
    return 0;
}

/* layout(cls): raises TypeError when instances of cls cannot be copied here. */
static PyObject *py_layout(PyObject *self, PyObject *cls) {
    (void)self;
    if (!PyType_Check(cls)) {
        PyErr_SetString(PyExc_TypeError, "_clone.layout: expected a class");
        return NULL;
    }
    if (get_layout((PyTypeObject *)cls) == NULL)
        return NULL;
    Py_RETURN_NONE;
}

/* replay(templates, firsts, i0, results, dlog, flog) -> list of copies.
 * results: int32, 2n+1 offsets then the values (dt_record_many's layout): copy i's first_deps
 * are values[off[2i]:off[2i+1]] when firsts[i] (else None), its deps values[off[2i+1]:off[2i+2]];
 * its index i0 + i. Each copy's deps and first_deps are appended to dlog and flog. */
static PyObject *py_replay(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *tpl, *firsts, *res, *dlog, *flog;
    Py_ssize_t i0;
    if (!PyArg_ParseTuple(args, "O!SnOO!O!", &PyList_Type, &tpl, &firsts, &i0, &res, &PyList_Type, &dlog,
                          &PyList_Type, &flog))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(tpl);
    if (PyBytes_GET_SIZE(firsts) != n) {
        PyErr_SetString(PyExc_ValueError, "_clone.replay: one first flag per template");
        return NULL;
    }
    Py_buffer view;
    if (get_ints(res, &view) != 0)
        return NULL;
    const int32_t *r = (const int32_t *)view.buf;
    Py_ssize_t total = view.len / 4;
    const char *fl = PyBytes_AS_STRING(firsts);
    PyObject *out = NULL;
    if (total < 2 * n + 1) {
        PyErr_SetString(PyExc_ValueError, "_clone.replay: results shorter than their offsets");
        goto done;
    }
    for (Py_ssize_t k = 0; k <= 2 * n; k++)
        if (r[k] < 0 || r[k] > total - (2 * n + 1) || (k > 0 && r[k] < r[k - 1])) {
            PyErr_SetString(PyExc_ValueError, "_clone.replay: offsets out of order or out of range");
            goto done;
        }
    const int32_t *vals = r + 2 * n + 1;
    const layout_t *l = NULL;
    for (Py_ssize_t i = 0; i < n; i++) { /* every template copyable, before anything is made */
        PyTypeObject *t = Py_TYPE(PyList_GET_ITEM(tpl, i));
        if ((l == NULL || l->type != t) && (l = get_layout(t)) == NULL)
            goto done;
    }
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    l = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyList_GET_ITEM(tpl, i);
        PyTypeObject *t = Py_TYPE(x);
        if (l == NULL || l->type != t)
            l = get_layout(t);
        PyObject *y = t->tp_alloc(t, 0);
        if (y == NULL)
            goto fail;
        PyObject **src = (PyObject **)((char *)x + sizeof(PyObject));
        PyObject **dst = (PyObject **)((char *)y + sizeof(PyObject));
        Py_ssize_t words = (t->tp_basicsize - (Py_ssize_t)sizeof(PyObject)) / (Py_ssize_t)sizeof(PyObject *);
        PyObject **skip = l->weaklist ? (PyObject **)((char *)y + l->weaklist) : NULL;
        for (Py_ssize_t w = 0; w < words; w++) {
            if (dst + w == skip)
                continue;
            PyObject *v = src[w];
            Py_XINCREF(v);
            dst[w] = v;
        }
        PyList_SET_ITEM(out, i, y);
        PyObject *idx = PyLong_FromSsize_t(i0 + i);
        if (idx == NULL)
            goto fail;
        set_slot(y, l->index, idx);
        PyObject *d = int_tuple(vals + r[2 * i + 1], r[2 * i + 2] - r[2 * i + 1]);
        if (d == NULL)
            goto fail;
        set_slot(y, l->deps, d);
        PyObject *f;
        if (fl[i]) {
            f = int_tuple(vals + r[2 * i], r[2 * i + 1] - r[2 * i]);
            if (f == NULL)
                goto fail;
        } else {
            f = Py_None;
            Py_INCREF(f);
        }
        set_slot(y, l->first, f);
        if (PyList_Append(dlog, d) != 0 || PyList_Append(flog, f) != 0)
            goto fail;
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    PyBuffer_Release(&view);
    return out;
}

/* spread(instrs, results, dlog, flog): set each instruction's first_deps and deps from a
 * batched record's results, laid out one after the other as [nfirst, ndeps, first..., deps...]
 * (deptrack.c's dt_record_matmuls / dt_record_transposes), appending them to dlog and flog. */
static PyObject *py_spread(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ins, *res, *dlog, *flog;
    if (!PyArg_ParseTuple(args, "O!OO!O!", &PyList_Type, &ins, &res, &PyList_Type, &dlog, &PyList_Type, &flog))
        return NULL;
    Py_buffer view;
    if (get_ints(res, &view) != 0)
        return NULL;
    const int32_t *r = (const int32_t *)view.buf;
    Py_ssize_t total = view.len / 4, p = 0, n = PyList_GET_SIZE(ins);
    const layout_t *l = NULL;
    PyObject *ret = NULL;
    /* every instruction copyable and the counts exactly cover the results, before any is set */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyList_GET_ITEM(ins, i);
        if ((l == NULL || l->type != Py_TYPE(x)) && (l = get_layout(Py_TYPE(x))) == NULL)
            goto done;
        if (p + 2 > total || r[p] < 0 || r[p + 1] < 0 || p + 2 + (Py_ssize_t)r[p] + r[p + 1] > total) {
            PyErr_SetString(PyExc_ValueError, "_clone.spread: results shorter than their counts");
            goto done;
        }
        p += 2 + r[p] + r[p + 1];
    }
    if (p != total) {
        PyErr_SetString(PyExc_ValueError, "_clone.spread: results longer than the instructions'");
        goto done;
    }
    p = 0;
    l = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyList_GET_ITEM(ins, i);
        if (l == NULL || l->type != Py_TYPE(x))
            l = get_layout(Py_TYPE(x));
        PyObject *f = int_tuple(r + p + 2, r[p]);
        if (f == NULL)
            goto done;
        set_slot(x, l->first, f);
        PyObject *d = int_tuple(r + p + 2 + r[p], r[p + 1]);
        if (d == NULL)
            goto done;
        set_slot(x, l->deps, d);
        p += 2 + r[p] + r[p + 1];
        if (PyList_Append(dlog, d) != 0 || PyList_Append(flog, f) != 0)
            goto done;
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&view);
    return ret;
}

static PyMethodDef methods[] = {
    {"layout", py_layout, METH_O, "layout(cls): TypeError unless instances of cls can be copied here"},
    {"replay", py_replay, METH_VARARGS, "replay(templates, firsts, i0, results, dlog, flog) -> copies"},
    {"spread", py_spread, METH_VARARGS, "spread(instrs, results, dlog, flog): set deps and first_deps"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_clone",
                                    "Instruction copies and dependency tuples for trnsim's kernel builder.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__clone(void) { return PyModule_Create(&module); }
