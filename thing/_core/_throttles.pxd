# The counts and call sites of _throttles.pyx, declared for the gate (_gate.pyx) to cimport.

from cpython.object cimport PyObject

cdef extern from "Python.h":  # what both this module and the gate read of a call's frame
    ctypedef struct PyFrameObject
    ctypedef struct PyCodeObject
    PyFrameObject *PyEval_GetFrame()  # borrowed; NULL when no Python code is running
    PyCodeObject *PyFrame_GetCode(PyFrameObject *frame)  # a new reference
    bint PyUnicode_CheckExact(object)
    long long PyLong_AsLongLongAndOverflow(object, int *overflow)  # exact ints: never raises
    void Py_DECREF(PyObject *)

# Traced names' call sites: a direct-mapped table, so that a lookup is one hash and one
# comparison. Two sites that share a slot take turns: the one not in it takes the Python
# path, which puts it back.
cdef enum:
    SITES = 1024

cdef struct Site:
    # Strong references: a code object kept alive cannot be replaced by another at its address.
    PyObject *code
    int instruction
    PyObject *throttle


cdef class Throttle:
    cdef readonly object name
    cdef public long long calls  # calls of the name, sent or not
    cdef public long long sent
    cdef unsigned long long used  # the table's clock at the name's latest call
    cdef bint forgotten  # dropped from the table: the gate no longer answers for it


cdef class Throttles:
    cdef dict _by_name
    cdef Site _sites[SITES]
    cdef unsigned long long _clock
    cdef public Py_ssize_t max_names
    cdef public bint steered
    cdef public set announced

    cdef _forget_least_recent(self)
    cdef _remember(self, code, int instruction, Throttle throttle)
    cdef PyObject *_answerable(self, name) noexcept
    cdef bint skips(self, name, every, first) noexcept
    cdef bint skips_on_demand(self, name) noexcept
    cdef void _count(self, Throttle throttle) noexcept
    cdef void _used_now(self, Throttle throttle) noexcept
