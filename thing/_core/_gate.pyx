"""The gate: ``thing.catch`` in C for the calls it can answer without Python.

A training loop calls ``catch`` at every step: each line of Python it runs
costs the loop, most of all right after a step, when the interpreter's code
and data are out of the caches. ``gated(target, throttles, skipped, clients)``
wraps a catch function in a C function that answers two kinds of call itself:

- a call the counts say is not sent (``every=``, ``first=``, or on demand with
  the REPL told of the name): counted, and answered ``skipped``, by the
  counts in ``_throttles.pyx`` (see :meth:`Throttles.skips`);
- a sent call of the common kind (a plain value, a name the gate knows; see
  :class:`Catcher`): snapshotted and queued.

Every other call (a name or site not seen yet, anything while the REPL steers,
arguments or values of an unusual kind) goes to ``catch``, which decides with
the same counts. So the gate only ever gives the answer ``catch`` would have
given, sooner, but for one: a call made while its thread is inside ``catch``
already (from a signal handler or a finalizer) is refused by ``catch``
uncounted, and counted here when it is not sent (a look at the thread's state
would cost every throttled call more than the rare call it would tell apart).
The pure-Python twin (``gate.py``) has no gate: ``catch`` answers every call.
"""

from cpython.buffer cimport PyBUF_C_CONTIGUOUS, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.dict cimport PyDict_GetItem
from cpython.exc cimport PyErr_Clear
from cpython.object cimport PyObject
from libc.limits cimport LLONG_MIN

from thing._core._build cimport THING_SOURCE_DIGEST
from thing._core._throttles cimport (
    Py_DECREF, PyEval_GetFrame, PyFrame_GetCode, PyFrameObject, PyLong_AsLongLongAndOverflow,
    PyUnicode_CheckExact, Throttle, Throttles)

import functools
import sys

SOURCE_DIGEST = THING_SOURCE_DIGEST.decode("ascii")  # see _build.pxd

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
            if catcher is not None and type(catcher.client).catch is not catcher.catch:
                catcher = None  # a catch patched onto the class since: thing.catch calls it
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
cdef object _wire_name, _clock, _ndarray, _new_tuple, _untrack_pending, _catch
cdef Py_ssize_t _hold_first, _scalar_held, _batch, _small_bytes
cdef bint _little_endian
cdef dict _numpy_names = {}  # numpy dtype -> wire name, for the dtypes in the wire's order
cdef dict _torch_dtypes = {}  # torch dtype -> (wire name, element size)
cdef object _tensor = None  # torch.Tensor and torch.nn.Parameter, once torch is loaded
cdef object _parameter = None


cdef _bind():
    global _Leaf, _LeafSpec, _Payload, _Pending, _Handle, _SINGLE_LEAF, _SKIPPED, _busy
    global _wire_name, _clock, _ndarray, _new_tuple, _untrack_pending, _hold_first, _scalar_held
    global _batch, _small_bytes, _little_endian, _catch
    if _Leaf is not None:
        return
    import time

    import numpy
    from thing import arrays, channel, client, frames, handles, value_trees, wire

    taking = value_trees._Taking()
    try:
        taking.node()  # what a tree of one scalar holds, as take_apart counts it
        _scalar_held = taking.held
    except Exception:  # THING_MAX_HEADER_BYTES below a scalar's: catch refuses them, and says so
        _scalar_held = -1
    _LeafSpec, _wire_name = arrays.LeafSpec, arrays._wire_name
    _Payload, _SINGLE_LEAF = value_trees.Payload, value_trees.SINGLE_LEAF
    _Pending, _untrack_pending = frames.Pending, frames.untrack_pending
    _Handle, _SKIPPED, _busy = handles.CaptureHandle, handles.SKIPPED, handles.busy
    _batch, _hold_first = channel.BATCH, channel.HOLD_FIRST_BYTES
    _small_bytes, _catch = wire.SMALL_BYTES, client._CATCH
    _clock, _ndarray, _new_tuple = time.time, numpy.ndarray, tuple.__new__
    _little_endian = sys.byteorder == "little"
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
    cdef readonly object catch  # the class's catch it stands for (client._CATCH)
    cdef Throttles _throttles
    cdef dict _traced  # the name tracer's: (id(code), instruction) -> (code ref, (name, site))
    cdef dict _sites  # and for given names: (id(code), instruction) -> (site, code ref)
    cdef object _overrides
    cdef object _rank

    def __init__(self, client):
        _bind()
        self.client = client
        self.catch = _catch
        self._throttles = client._throttles
        self._traced = client._names._by_instruction
        self._sites = client._names._sites
        self._overrides = client._overrides
        self._rank = client._rank

    cdef object send(self, obj, name, every, first, copy, block, step):
        """The handle of this call of ``catch`` (with no ``server=`` nor ``on_demand=``), or
        None, having changed nothing, if it is not of the common kind."""
        if getattr(_busy, "working", False):  # catch refuses it: see handles.busy
            return None
        # From here, as in catch: a finalizer's or a signal handler's catch is refused while
        # this one looks, snapshots (which may run the collector) and queues.
        _busy.working = True
        try:
            return self._send(obj, name, every, first, copy, block, step)
        finally:
            _busy.working = False

    cdef object _send(self, obj, name, every, first, copy, block, step):
        cdef PyFrameObject *frame
        cdef PyObject *found
        cdef PyObject *code
        cdef Throttle throttle
        cdef int overflow = 0
        client = self.client
        try:  # nothing is changed here: whatever goes wrong, catch looks again, and says why
            if (self._overrides.active or type(every) is not int
                    or (first is not None and type(first) is not int)
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
    if kind is float or kind is int or kind is bool or obj is None:
        if _scalar_held < 0 or obj != obj:  # a NaN: its own bits travel, in a node of theirs
            return None
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
