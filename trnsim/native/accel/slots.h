/* The __slots__ member an attribute lookup finds, for the plain CPython extensions that read or
 * write instruction slots directly (scan.c, clone.c). */
#ifndef TRNSIM_SLOTS_H
#define TRNSIM_SLOTS_H

#include <Python.h>
#include <structmember.h>

/* The member of ``name`` in instances of ``tp`` when it is the __slots__ member that attribute
 * access on them uses (the class has the default attribute lookup, the first class of its MRO
 * that defines ``name`` defines it as a member descriptor of a class ``tp`` derives from);
 * NULL when not (then only the generic attribute protocol gives what Python would). */
static inline PyMemberDef *slot_member(PyTypeObject *tp, PyObject *name) {
    if (tp->tp_getattro != PyObject_GenericGetAttr || !tp->tp_mro)
        return NULL;
    PyObject *d = NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tp->tp_mro) && !d; i++) {
        PyObject *dict = ((PyTypeObject *)PyTuple_GET_ITEM(tp->tp_mro, i))->tp_dict;
        if (dict)
            d = PyDict_GetItemWithError(dict, name); /* borrowed */
        if (!d && PyErr_Occurred()) {
            PyErr_Clear();
            return NULL;
        }
    }
    /* a member of another class's layout (a descriptor copied into this class) is not read
     * here: its __get__ raises TypeError for such an object, and so PyObject_GetAttr does */
    if (!d || Py_TYPE(d) != &PyMemberDescr_Type || !PyType_IsSubtype(tp, ((PyDescrObject *)d)->d_type))
        return NULL;
    return ((PyMemberDescrObject *)d)->d_member;
}

#endif
