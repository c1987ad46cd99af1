"""Every name's ``every=``/``first=`` counts, and the call sites of traced names.

A training loop calls ``thing.catch(w, every=100)`` at every step, and 99
calls in 100 send nothing: such a call should cost about what an empty
function call costs. The gate (``_gate.pyx``) answers those calls in C, from
the counts kept here. It finds the name's :class:`Throttle`: by the name
given, or, for a traced name, by the instruction that called (the Python
path remembers it at each call of a traced name, and forgets it when the
name tracer does, for traced again it may get another name). When the
counts say the call is not sent (or it is on demand, and the REPL was told
of the name), :meth:`Throttles.skips` counts it, as ``catch`` would have. The
classes are declared in ``_throttles.pxd``, which the gate cimports. The
pure-Python twin (``throttles.py``) keeps the same counts.
"""

from cpython.object cimport PyObject
from cpython.dict cimport PyDict_GetItem
from cpython.exc cimport PyErr_Clear
from cpython.ref cimport Py_XDECREF, Py_XINCREF

from thing._core._build cimport THING_SOURCE_DIGEST

SOURCE_DIGEST = THING_SOURCE_DIGEST.decode("ascii")  # see _build.pxd

cdef extern from *:
    """
    #include "frameobject.h"
    #if PY_VERSION_HEX < 0x030B0000  /* PyFrame_GetLasti is 3.11's: the field before it */
    static int thing_frame_lasti(PyFrameObject *frame) { return frame->f_lasti; }
    #else
    #define thing_frame_lasti PyFrame_GetLasti
    #endif
    """
    # The calling instruction, as this module reads it both where it remembers a site
    # and where it looks one up (so the unit, which changed in 3.10, never matters).
    int thing_frame_lasti(PyFrameObject *frame)

cdef extern from "Python.h":  # the rest, shared with the gate, in _throttles.pxd
    bint PyFrame_Check(object)
    bint PyLong_CheckExact(object)
    int PySet_Contains(object, object)  # -1 on an error, left set


cdef class Throttle:
    """One name's ``every=``/``first=`` counts."""

    def __init__(self, name=None):
        self.name = name

    def admit(self, every, first) -> int:
        """Count a call; its number (from 1) if it is one to send, else 0 (``every`` below 2
        sends every call)."""
        cdef long long call = self.calls
        self.calls = call + 1
        if (every > 1 and call % every) or (first is not None and self.sent >= first):
            return 0
        self.sent += 1
        return call + 1

    def count(self) -> int:
        """Count a call whatever the throttles say; its number (from 1)."""
        self.calls += 1
        return self.calls


cdef inline size_t _slot(PyObject *code, int instruction) noexcept:
    return ((<size_t>code >> 4) ^ (<size_t>instruction * 2654435761u)) & (SITES - 1)


cdef class Throttles:
    """Every name's :class:`Throttle`, at most ``max_names`` of them (beyond it the least
    recently caught are forgotten, an eighth at a time, and their counting restarts), and
    the call sites of traced names, for the gate.

    ``steered`` says whether the REPL set anything for this client (its
    ``Overrides.active``, which sets it): while it does, the gate leaves every call to
    ``catch``. ``announced`` is the set of on-demand names this process's ``catch`` has
    dealt with already (told the REPL of, or found it need not): the gate answers an
    on-demand call of those only.
    """

    def __init__(self, Py_ssize_t max_names=10_000):
        self._by_name = {}
        self.max_names = max_names
        self.steered = False
        self.announced = None

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(SITES):
            Py_XDECREF(self._sites[i].code)
            Py_XDECREF(self._sites[i].throttle)

    def __len__(self) -> int:
        return len(self._by_name)

    def of(self, name) -> Throttle:
        """The throttle of ``name``, made if need be, and counted as its latest use."""
        cdef Throttle throttle = self._by_name.get(name)
        self._clock += 1
        if throttle is None:  # setdefault: another thread may have made it just now
            throttle = self._by_name.setdefault(name, Throttle(name))
            throttle.used = self._clock
            if len(self._by_name) > self.max_names:
                self._forget_least_recent()
        throttle.used = self._clock
        return throttle

    def remember(self, frame, Throttle throttle) -> bool:
        """Remember that the call ``frame`` is making (of a traced name) counts under
        ``throttle``: the gate answers the next calls from the same instruction. True if
        the gate did not know that already."""
        if not PyFrame_Check(frame):
            raise TypeError(f"not a frame: {frame!r}")
        code = frame.f_code
        cdef int instruction = thing_frame_lasti(<PyFrameObject *><void *>frame)
        cdef Site *site = &self._sites[_slot(<PyObject *>code, instruction)]
        if (site.code == <PyObject *>code and site.instruction == instruction
                and site.throttle == <PyObject *>throttle):
            return False
        self._remember(code, instruction, throttle)
        return True

    cdef _forget_least_recent(self):
        # An eighth at a time: a job that makes up a new name at every step sorts the
        # table once per max_names / 8 names, not once per name.
        by_use = sorted(self._by_name.items(), key=_used)
        cdef Throttle throttle
        for name, throttle in by_use[:len(by_use) - self.max_names + self.max_names // 8]:
            if self._by_name.get(name) is throttle:  # not made again meanwhile
                del self._by_name[name]
                throttle.forgotten = True

    cdef _remember(self, code, int instruction, Throttle throttle):
        cdef Site *site = &self._sites[_slot(<PyObject *>code, instruction)]
        cdef PyObject *old_code = site.code
        cdef PyObject *old_throttle = site.throttle
        # The slot is whole before anything is released: freeing the old code object can
        # run Python (a weak reference's callback), which may come back here.
        Py_XINCREF(<PyObject *>code)
        Py_XINCREF(<PyObject *>throttle)
        site.code = <PyObject *>code
        site.instruction = instruction
        site.throttle = <PyObject *>throttle
        Py_XDECREF(old_code)
        Py_XDECREF(old_throttle)

    def forget_sites(self, code=None) -> None:
        """Forget the call sites remembered for the gate in ``code`` (every one, without):
        the name tracer forgot them, and traced again they may get another name."""
        cdef Py_ssize_t i
        cdef PyObject *old_code
        cdef PyObject *old_throttle
        for i in range(SITES):
            old_code, old_throttle = self._sites[i].code, self._sites[i].throttle
            if old_code == NULL or (code is not None and old_code != <PyObject *>code):
                continue
            # Emptied before anything is released (which may run Python, and come back).
            self._sites[i].code = self._sites[i].throttle = NULL
            Py_XDECREF(old_code)
            Py_XDECREF(old_throttle)

    cdef PyObject *_answerable(self, name) noexcept:
        """The throttle of this call (borrowed) if the gate may answer for it, else NULL."""
        cdef PyObject *throttle = NULL
        cdef PyFrameObject *frame
        cdef PyObject *code
        cdef int instruction
        cdef Site *site
        if self.steered:
            return NULL
        if name is None:
            frame = PyEval_GetFrame()
            if frame == NULL:
                return NULL
            instruction = thing_frame_lasti(frame)
            code = <PyObject *>PyFrame_GetCode(frame)
            site = &self._sites[_slot(code, instruction)]
            if site.code == code and site.instruction == instruction:
                throttle = site.throttle
            Py_DECREF(code)
        elif PyUnicode_CheckExact(name):
            throttle = PyDict_GetItem(self._by_name, name)
        if throttle != NULL and (<Throttle>throttle).forgotten:
            return NULL
        return throttle

    cdef bint skips(self, name, every, first) noexcept:
        """Whether ``catch(name=name, every=every, first=first)`` is a call that is not
        sent; if so it is counted, as ``catch`` counts it. (On demand, catch also tells the
        REPL of the name: the gate leaves those calls to it.)"""
        cdef int overflow = 0
        cdef long long every_n, first_n = -1
        cdef PyObject *found
        cdef Throttle throttle
        if not PyLong_CheckExact(every):  # a numpy int, a float...: catch decides
            return False
        every_n = PyLong_AsLongLongAndOverflow(every, &overflow)
        if overflow or every_n < 1:
            return False
        if first is not None:
            if not PyLong_CheckExact(first):
                return False
            first_n = PyLong_AsLongLongAndOverflow(first, &overflow)
            if overflow:
                return False
        if every_n == 1 and first is None:
            return False
        found = self._answerable(name)
        if found == NULL:
            return False
        throttle = <Throttle>found
        if not (throttle.calls % every_n or (first is not None and throttle.sent >= first_n)):
            return False
        self._count(throttle)
        return True

    cdef bint skips_on_demand(self, name) noexcept:
        """Whether ``catch(name=name, on_demand=True)`` is a call nobody asked for, of a name
        the REPL was told of; if so it is counted, as ``catch`` counts it."""
        cdef PyObject *found = self._answerable(name)
        cdef Throttle throttle
        cdef int told
        if found == NULL or self.announced is None:
            return False
        # A reference of our own: the set's lookup may run Python (a name's __eq__), which
        # may forget this throttle.
        throttle = <Throttle>found
        told = PySet_Contains(self.announced, throttle.name)
        if told < 0:  # a name that cannot be looked up: catch decides
            PyErr_Clear()
        if told != 1 or throttle.forgotten:
            return False
        self._count(throttle)
        return True

    cdef void _count(self, Throttle throttle) noexcept:
        throttle.calls += 1
        self._used_now(throttle)

    cdef void _used_now(self, Throttle throttle) noexcept:
        self._clock += 1
        throttle.used = self._clock


def _used(item):
    return (<Throttle>item[1]).used
