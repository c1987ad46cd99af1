"""Chooses the compiled core (``_transport``, the byte movers; ``_throttles``, the
``every=``/``first=`` counts; ``_gate``, ``catch`` in C for the calls it can
answer without Python) or its pure-Python twin (``fallback``, ``throttles``,
``gate``).

``THING_PUREPYTHON=1`` forces the twin; it is also used, with a warning that
says how to build, when the extension cannot be imported (a source checkout
that was never built) or lacks a name this source uses (one built from an
older source, left in place).
"""

from __future__ import annotations

import importlib
import os

# What both cores provide, and this package takes from the one it chose.
_MOVERS = ("MAX_DESCRIPTORS", "PrivateMapping", "bytes_at", "map_file",
           "recv_buffers", "recv_some", "send_buffers", "send_snapshots", "split_small_frames",
           "split_stored_acks", "untrack", "wake")
_THROTTLES = ("Throttle", "Throttles")
_GATE = ("gated",)


def _say_not_built(exc: ImportError) -> None:
    """Warn, once at import where it can be seen, that the compiled core is missing, and why.

    Most likely a source checkout on the path that was never built (Python
    started in the repository's folder), or built before its source changed.
    """
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    checkout = os.path.dirname(package)
    if os.path.exists(os.path.join(checkout, "pyproject.toml")):
        remedy = (f"build it with `python -m pip install -e {checkout}` (or `python setup.py "
                  "build_ext --inplace` there), or, to use a thing installed elsewhere, start "
                  "Python outside that folder")
    else:
        # Not by name: "thing" on the package index is another project.
        remedy = "reinstall thing from the wheel or the source it was installed from"
    # Straight to logging, before thing's NullHandler (thing/log.py) is added: with no
    # logging configured, this one warning is printed.
    import logging

    logging.getLogger("thing").warning(
        "thing's compiled core is not built for this source (%s), so thing runs on its "
        "slower pure-Python twin. Imported from %s: %s.", exc, package, remedy)


def _changed_since_built(*modules: object) -> str | None:
    """In a source checkout (a pyproject.toml beside the package), the first ``.pyx`` whose
    text, or that of a ``.pxd`` it may cimport, is not what its extension was built from
    (an edit not yet built, which would otherwise run the old code without a word); None
    where they agree, or elsewhere."""
    here = os.path.dirname(os.path.abspath(__file__))
    if not os.path.exists(os.path.join(os.path.dirname(os.path.dirname(here)),
                                       "pyproject.toml")):
        return None
    import glob
    import zlib

    declarations = sorted(glob.glob(os.path.join(here, "*.pxd")))
    for module in modules:
        source = os.path.join(here, f"{module.__name__.rpartition('.')[2]}.pyx")
        digest = 0
        try:
            for path in [source, *declarations]:  # as setup.py works it out
                with open(path, "rb") as text:
                    digest = zlib.crc32(text.read(), digest)
        except OSError:
            continue
        if getattr(module, "SOURCE_DIGEST", None) != f"{digest:08x}":
            return os.path.basename(source)
    return None


if os.environ.get("THING_PUREPYTHON", "") not in ("", "0"):
    from . import fallback as _movers
    from . import gate as _gate
    from . import throttles as _throttles

    BACKEND = "python"
else:
    try:
        # By full name: a missing extension then reads "No module named ...", not Python's
        # "partially initialized module (most likely due to a circular import)".
        _throttles = importlib.import_module(f"{__name__}._throttles")
        _gate = importlib.import_module(f"{__name__}._gate")
        _movers = importlib.import_module(f"{__name__}._transport")

        missing = [name for name in _MOVERS if not hasattr(_movers, name)]
        missing += [name for name in _THROTTLES if not hasattr(_throttles, name)]
        missing += [name for name in _GATE if not hasattr(_gate, name)]
        if missing:
            raise ImportError(f"the build is older than the source: it lacks {', '.join(missing)}")
        changed = _changed_since_built(_movers, _throttles, _gate)
        if changed:
            raise ImportError(f"{changed} changed since it was built")
        BACKEND = "compiled"
    # A ValueError: an extension built against older declarations of a class it cimports
    # (_throttles.pxd), which Cython checks at import.
    except (ImportError, ValueError) as exc:  # pragma: no cover - depends on the build
        from . import fallback as _movers
        from . import gate as _gate
        from . import throttles as _throttles

        BACKEND = "python"
        _say_not_built(exc)

MAX_DESCRIPTORS: int = _movers.MAX_DESCRIPTORS
PrivateMapping = _movers.PrivateMapping
bytes_at = _movers.bytes_at
map_file = _movers.map_file
recv_buffers = _movers.recv_buffers
recv_some = _movers.recv_some
send_buffers = _movers.send_buffers
send_snapshots = _movers.send_snapshots
split_small_frames = _movers.split_small_frames
split_stored_acks = _movers.split_stored_acks
untrack = _movers.untrack
wake = _movers.wake
Throttle = _throttles.Throttle
Throttles = _throttles.Throttles
gated = _gate.gated

__all__ = ["BACKEND", *_MOVERS, *_THROTTLES, *_GATE]
