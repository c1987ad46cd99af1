"""Every name's ``every=``/``first=`` counts, and throttled calls answered without Python.

A training loop calls ``thing.catch(w, every=100)`` at every step, and 99
calls in 100 send nothing: such a call should cost about what an empty
function call costs. ``gated(target, throttles, skipped)`` wraps a catch
function in a C function that answers those calls itself. It finds the
name's :class:`Throttle`: by the name given, or, for a traced name, by the
instruction that called (the Python path remembers it at each call of a
traced name, and forgets it when the name tracer does, for traced again it
may get another name). When the counts say the call is not sent (or it is
on demand, and the REPL was told of the name), it counts it and returns
``skipped``. Every other call (one to send, a name or site not seen yet,
anything while the REPL steers, arguments of an unusual type) goes to
``catch``, which decides with the same counts. So the gate only ever gives
the answer ``catch`` would have given, sooner, but for one: a call made while
its thread is inside ``catch`` already (from a signal handler or a finalizer)
is refused by ``catch`` uncounted, and counted here when it is not sent (a
look at the thread's state would cost every throttled call more than the
rare call it would tell apart). The pure-Python twin (``throttles.py``) has no
gate: ``catch`` answers every call.
"""

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.object cimport PyObject
from cpython.dict cimport PyDict_GetItem
from cpython.exc cimport PyErr_Clear
from cpython.ref cimport Py_XDECREF, Py_XINCREF
from libc.limits cimport LLONG_MIN

from thing._core._build cimport THING_SOURCE_DIGEST

import functools
import sys

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

cdef extern from "Python.h":
    ctypedef struct PyFrameObject
    ctypedef struct PyCodeObject
    PyFrameObject *PyEval_GetFrame()  # borrowed; NULL when no Python code is running
    PyCodeObject *PyFrame_GetCode(PyFrameObject *frame)  # a new reference
    bint PyFrame_Check(object)
    bint PyLong_CheckExact(object)
    bint PyUnicode_CheckExact(object)
    int PySet_Contains(object, object)  # -1 on an error, left set
    long long PyLong_AsLongLongAndOverflow(object, int *overflow)  # exact ints: never raises
    void Py_DECREF(PyObject *)


cdef class Throttle:
    """One name's ``every=``/``first=`` counts."""

    cdef readonly object name
    cdef public long long calls  # calls of the name, sent or not
    cdef public long long sent
    cdef unsigned long long used  # the table's clock at the name's latest call
    cdef bint forgotten  # dropped from the table: the gate no longer answers for it

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

    cdef dict _by_name
    cdef Site _sites[SITES]
    cdef unsigned long long _clock
    cdef public Py_ssize_t max_names
    cdef public bint steered
    cdef public set announced

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

    cdef inline void _count(self, Throttle throttle) noexcept:
        throttle.calls += 1
        self._used_now(throttle)

    cdef inline void _used_now(self, Throttle throttle) noexcept:
        self._clock += 1
        throttle.used = self._clock


def _used(item):
    return (<Throttle>item[1]).used


def gated(target, Throttles throttles, skipped, clients=None):
    """``target``, a catch, with the calls it would not send answered in C, and the sent
    calls of the common kind queued in C (see the module docstring). It keeps the name
    ``catch``, which a wrong call's TypeError names.

    ``target`` is ``thing.catch`` or a ``Client``'s bound ``catch`` (not a subclass's own,
    which may treat the arguments otherwise): the code that called the gate is the code
    that called ``catch``, as no Python frame comes between them. ``clients`` is the
    ``Client`` whose ``catch`` it is, or the namespace whose ``_default_client`` it is
    at each call (``thing``'s); None leaves every sent call to ``target``.

    Called from code ``torch.compile`` made (a catch is a graph break: torch calls the
    gate as it is), ``catch`` runs with torch's frame evaluation off, as in
    ``torch.compiler.disable``: else torch compiles thing's own functions as they run
    (milliseconds a call, its warnings printed, and a capture whose shape changed not
    sent).
    """
    cdef Catcher catcher = None
    if clients is not None and type(clients) is not dict:
        catcher = Catcher(clients)

    def catch(obj, name=None, server=None, every=1, first=None, *, copy=None, block=False,
             step=None, on_demand=False, int _depth=1):
        nonlocal catcher
        cdef PyObject *client
        if _depth == 1:  # else a helper's catch(..., _depth=2): its caller's call site counts
            if on_demand is False:
                if throttles.skips(name, every, first):
                    return skipped
            elif on_demand is True and throttles.skips_on_demand(name):
                return skipped
        if type(clients) is dict:  # thing.catch: whichever client is the default now
            client = PyDict_GetItem(clients, "_default_client")
            if client is NULL or <object>client is None:
                catcher = None
            elif catcher is None or catcher.client is not <object>client:
                catcher = Catcher(<object>client)
        frames = _torch_frames()
        if frames is not None:
            try:
                compiled = frames.set_eval_frame(None)
            except Exception:  # a torch whose hooks are called otherwise: catch as it is
                compiled = None
            if compiled is not None:
                try:
                    return _send(catcher, target, obj, name, server, every, first, copy, block,
                                 step, on_demand, _depth)
                finally:
                    frames.set_eval_frame(compiled)
        return _send(catcher, target, obj, name, server, every, first, copy, block, step,
                     on_demand, _depth)

    return functools.wraps(target)(catch)


cdef inline object _send(Catcher catcher, target, obj, name, server, every, first, copy,
                         block, step, on_demand, int depth):
    cdef object handle
    if catcher is not None and depth == 1 and on_demand is False and server is None:
        handle = catcher.send(obj, name, every, first, copy, block, step)
        if handle is not None:
            return handle
    if depth == 1:  # catch's own default: thing.catch takes no _depth
        return target(obj, name, server, every, first, copy=copy, block=block, step=step,
                      on_demand=on_demand)
    return target(obj, name, server, every, first, copy=copy, block=block, step=step,
                  on_demand=on_demand, _depth=depth)


cdef dict _modules = sys.modules


cdef inline object _torch_frames():
    """torch's frame evaluation hooks (``torch._C._dynamo.eval_frame``) once torch.compile's
    machinery is loaded (``import torch`` loads the hooks, not the machinery), else None."""
    if PyDict_GetItem(_modules, "torch._dynamo") is NULL:
        return None
    cdef PyObject *module = PyDict_GetItem(_modules, "torch._C._dynamo.eval_frame")
    return None if module is NULL else <object>module


# -- the sent calls of the common kind -------------------------------------------------

# thing's own objects, bound by the first Catcher (the modules are loaded by then: a Catcher
# is made for a Client, and Client loads them), so that `import thing` loads no more.
cdef object _Leaf = None
cdef object _LeafSpec, _Payload, _Pending, _Handle, _SINGLE_LEAF, _SKIPPED, _busy
cdef object _wire_name, _clock, _ndarray, _new_tuple, _untrack_pending
cdef Py_ssize_t _hold_first, _scalar_held, _batch, _small_bytes
cdef bint _little_endian
cdef dict _numpy_names = {}  # numpy dtype -> wire name, for the dtypes in the wire's order
cdef dict _torch_dtypes = {}  # torch dtype -> (wire name, element size)
cdef object _tensor = None  # torch.Tensor and torch.nn.Parameter, once torch is loaded
cdef object _parameter = None


cdef _bind():
    global _Leaf, _LeafSpec, _Payload, _Pending, _Handle, _SINGLE_LEAF, _SKIPPED, _busy
    global _wire_name, _clock, _ndarray, _new_tuple, _untrack_pending, _hold_first, _scalar_held
    global _batch, _small_bytes, _little_endian
    if _Leaf is not None:
        return
    import time

    import numpy
    from thing import arrays, channel, frames, handles, value_trees, wire

    taking = value_trees._Taking()
    taking.node()  # what a tree of one scalar holds, as take_apart counts it
    _scalar_held = taking.held
    _LeafSpec, _Payload, _SINGLE_LEAF = arrays.LeafSpec, value_trees.Payload, value_trees.SINGLE_LEAF
    _Pending, _Handle, _SKIPPED, _busy = frames.Pending, handles.CaptureHandle, handles.SKIPPED, handles.busy
    _wire_name, _clock, _ndarray, _new_tuple = arrays._wire_name, time.time, numpy.ndarray, tuple.__new__
    _untrack_pending, _batch, _small_bytes = frames.untrack_pending, channel.BATCH, wire.SMALL_BYTES
    _hold_first, _little_endian = channel.HOLD_FIRST_BYTES, sys.byteorder == "little"
    _Leaf = arrays.Leaf  # last: bound only once everything is


cdef class Catcher:
    """A client's sent calls of the common kind, queued without running its ``catch``.

    The common kind: a name given as a printable ``str``, or traced at a call
    site the gate knows; ``every=`` and ``first=`` plain ints, ``step=`` one
    that fits the wire; ``copy=`` None or True; the default server, with its
    channel open and not down; nothing steered; and a value that is a float
    (not NaN), an int, a bool or None, or a numpy array or a CPU torch tensor of
    at most ``HOLD_FIRST_BYTES`` that is snapshotted at the call, its bytes in
    order in its own memory. :meth:`send` looks at all of that first, and for
    anything else returns None having changed nothing: ``catch`` then does it
    all. Otherwise it does what ``catch`` does, in the same order: it counts
    the call and reads the rank as ``catch`` does, snapshots the value as
    ``arrays.hold`` would, and queues it as ``Channel._enqueue`` would where
    there is room now and nothing unusual (else it calls that). As with the
    throttled calls, the answer is always the one ``catch`` gives, and the code
    that gives it in Python is its specification; a training loop just runs
    less Python to get it (right after a step, every line costs microseconds).
    """

    cdef readonly object client
    cdef Throttles _throttles
    cdef dict _traced  # the name tracer's: (id(code), instruction) -> (code ref, (name, site))
    cdef dict _sites  # and for given names: (id(code), instruction) -> (site, code ref)
    cdef object _overrides
    cdef object _rank

    def __init__(self, client):
        _bind()
        self.client = client
        self._throttles = client._throttles
        self._traced = client._names._by_instruction
        self._sites = client._names._sites
        self._overrides = client._overrides
        self._rank = client._rank

    cdef object send(self, obj, name, every, first, copy, block, step):
        """The handle of this call of ``catch`` (with no ``server=`` nor ``on_demand=``), or
        None, having changed nothing, if it is not of the common kind."""
        cdef PyFrameObject *frame
        cdef PyObject *found
        cdef PyObject *code
        cdef Throttle throttle
        cdef int overflow = 0
        client = self.client
        try:  # nothing is changed here: whatever goes wrong, catch looks again, and says why
            if (getattr(_busy, "working", False) or self._overrides.active
                    or type(every) is not int or (first is not None and type(first) is not int)
                    or (copy is not None and copy is not True)):
                return None
            if step is not None:
                if type(step) is not int:
                    return None
                if PyLong_AsLongLongAndOverflow(step, &overflow) == LLONG_MIN or overflow:
                    return None  # the wire's int64 keeps its least value for "no step"
            frame = PyEval_GetFrame()
            if frame == NULL or not (name is None or (PyUnicode_CheckExact(name)
                                                      and name.isprintable())):
                return None
            found = self._throttles._answerable(name)  # NULL if never caught from this site
            if found == NULL:
                return None
            throttle = <Throttle>found  # a reference of our own from here
            code = <PyObject *>PyFrame_GetCode(frame)
            Py_DECREF(code)  # the frame holds it while we run
            key = (<size_t>code, (<object>frame).f_lasti)  # the tracer's: (id(code), f_lasti)
            if name is None:
                entry = self._traced.get(key)
                if (entry is None or entry[0]() is not <object>code
                        or entry[1][0] != throttle.name):
                    return None
                name, site = entry[1]
            else:
                entry = self._sites.get(key)
                if entry is None or entry[1]() is not <object>code:
                    return None
                site = entry[0]
            channel = client._channels.get(None)
            if channel is None or channel.down:
                return None
            snapshot_bytes = client.snapshot_bytes
            if type(snapshot_bytes) is not int:
                return None
            payload = _held(obj, copy, snapshot_bytes)
            if payload is None:
                return None
        except Exception:
            return None
        _busy.working = True
        try:
            self._throttles._used_now(throttle)
            call = throttle.admit(every, first)
            if not call:
                return _SKIPPED
            return _queue(channel, _new_tuple(_Pending, (
                name, payload, site, _clock(), self._rank.read(),
                _Handle(name, None, channel._hurry), None, call, step, False)),
                block, copy, snapshot_bytes)
        except Exception as exc:  # catch() must never raise into a training loop
            return client._failed(exc, None, name, site, obj)
        finally:
            _busy.working = False


cdef object _queue(channel, pending, block, copy, snapshot_bytes):
    """Queue ``pending`` (held, of the common kind) as ``Channel._enqueue`` would: in the
    common case here (room now, the channel open and up, nothing steered), else by it."""
    cdef Py_ssize_t nbytes = pending[1].held, items, queued
    mutex = channel._mutex
    mutex.acquire()
    try:
        room = channel._room
        items = room.items
        if (channel._closed or channel.down or channel.overrides.active
                or items >= room.max_items or (items and room.bytes + nbytes > room.max_bytes)):
            queue = None  # each of those is Channel._enqueue's to deal with
        else:
            room.items = items + 1
            room.bytes += nbytes
            # Channel._queue_up, for a capture that no request brought, in an open channel
            # that nothing steers.
            queue = channel._queue
            queue.append(pending)
            queued = len(queue)
            channel._queued_bytes += nbytes
            if queued > _batch:
                _untrack_pending(pending)
            wake = channel._idle
            if not channel._send_now and (
                    nbytes >= _small_bytes or queued >= _batch or 2 * queued > room.max_items
                    or 2 * channel._queued_bytes > room.max_bytes):
                channel._send_now = wake = True
            if wake:
                channel._idle = False
                channel._signal()
    finally:
        mutex.release()
    if queue is None:
        return channel._enqueue(pending, block, copy, snapshot_bytes)
    return pending[5]  # its handle


cdef object _held(obj, copy, snapshot_bytes):
    """``obj`` taken apart and snapshotted as ``take_apart`` and ``hold`` would, if it is a
    value of the common kind (see :class:`Catcher`); else None."""
    kind = type(obj)
    if kind is float:
        if obj != obj:  # a NaN: its own bits travel, in a node of their own
            return None
        return _Payload(obj, [], 0, _scalar_held)
    if kind is int or kind is bool or obj is None:
        return _Payload(obj, [], 0, _scalar_held)
    if not _little_endian:
        return None
    cdef Py_ssize_t limit = _hold_first
    if copy is None and snapshot_bytes < limit:
        limit = snapshot_bytes
    if kind is _ndarray:
        leaf = _numpy_snapshot(obj, limit)
    elif _is_plain_tensor(kind):
        leaf = _tensor_snapshot(obj, limit)
    else:
        return None
    return None if leaf is None else _Payload(_SINGLE_LEAF, [leaf], leaf.nbytes)


cdef object _numpy_snapshot(array, Py_ssize_t limit):
    cdef Py_buffer view
    dtype = array.dtype
    name = _numpy_names.get(dtype)
    if name is None:
        try:
            name = _wire_name(dtype)
        except Exception:  # not a dtype that travels: catch says why
            return None
        if dtype.byteorder == ">":  # swapped by catch, into the wire's order
            return None
        _numpy_names[dtype] = name
    try:
        PyObject_GetBuffer(array, &view, PyBUF_C_CONTIGUOUS)
    except Exception:  # strided, or a dtype numpy lends no buffer of (datetime64)
        return None
    try:
        if view.len > limit:
            return None
        data = PyBytes_FromStringAndSize(<char *>view.buf, view.len)
        nbytes = view.len
    finally:
        PyBuffer_Release(&view)
    return _Leaf(_new_tuple(_LeafSpec, ("numpy", name, array.shape, False)), data, nbytes)


cdef bint _is_plain_tensor(kind) noexcept:
    global _tensor, _parameter
    cdef PyObject *torch
    if _tensor is None:
        torch = PyDict_GetItem(_modules, "torch")
        if torch is NULL:
            return False
        try:  # half made while another thread imports it: none of its tensors exist yet
            _parameter = (<object>torch).nn.Parameter
            _tensor = (<object>torch).Tensor
        except Exception:
            PyErr_Clear()  # (a noexcept function's except clause leaves nothing set)
            return False
    return kind is _tensor or kind is _parameter


cdef object _tensor_snapshot(tensor, Py_ssize_t limit):
    """A plain CPU tensor's bytes at ``start`` in memory of its own, as ``arrays.hold``
    copies them (``_check_memory``, ``_snapshot_tensor``); None for any other."""
    cdef Py_ssize_t nbytes, extent
    try:
        torch = _modules["torch"]
        if tensor.layout is not torch.strided or not tensor.is_cpu:
            return None
        dtype = tensor.dtype
        known = _torch_dtypes.get(dtype)
        if known is None:
            known = _torch_dtypes[dtype] = (_wire_name(dtype), tensor.element_size())
        name, nbytes = known
        shape = tuple(tensor.shape)
        for extent in shape:  # at most limit: no overflow
            nbytes = 0 if extent == 0 else (limit + 1 if nbytes > limit // extent
                                            else nbytes * extent)
        if (nbytes > limit or tensor.is_conj() or tensor.is_neg()
                or not tensor.is_contiguous()):
            return None
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        start = tensor.storage_offset() * known[1]
        if nbytes and (not address or storage.nbytes() < start + nbytes):
            return None  # no memory, or memory freed (FSDP): catch says so
        data = PyBytes_FromStringAndSize(<char *><size_t>(address + start), nbytes)
    except Exception:  # a wrapper with no storage (torch.func), ...: catch tells it apart
        return None
    return _Leaf(_new_tuple(_LeafSpec, ("torch", name, shape, False)), data, nbytes)
