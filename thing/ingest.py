"""``thing.ingest_all()``: the newest capture of every name, bound as a REPL variable.

A name becomes the identifier :func:`thing.names.identifier_for` makes of it
(``model.lm_head.weight`` -> ``model_lm_head_weight``); a name that is its
identifier already (``loss``) has it before one made into it (``-loss``). What
a REPL depends on is never replaced: builtins (``print``, ``len``...), modules
(``thing``, ``np``...), IPython's own variables (``In``, ``_3``...) and the
REPL's output history (``_``, ``_4``, bound or not yet); no identifier is a
dunder, as its underscores are stripped (``__name__`` -> ``name``). Other
existing variables are kept unless ``overwrite=True``, except those still
holding what an earlier ``ingest_all`` bound (an array, a tensor, a float):
those are brought up to date.
Whatever is skipped is reported with how to reach it.
"""

from __future__ import annotations

import builtins
import contextlib
import re
import sys
import types
import weakref
from typing import Any

import numpy as np

from .captures import value_of
from .display import Fields, Report
from .errors import ProtocolError, UnknownName
from .names import identifier_for
from .store import HistoryStore

# Entries a report lists of each kind: among 20,000 names, all of them made 20,000 lines.
MAX_LISTED = 50


def _listed(entries: list[str]) -> str:
    """The first MAX_LISTED entries, and how many more (the returned dict holds them all)."""
    shown = ", ".join(entries[:MAX_LISTED])
    more = len(entries) - MAX_LISTED
    return shown + (f", and {more} more (the dict ingest_all returns has them)" if more > 0
                    else "")


class Ingested(dict):
    """``{variable: capture name}`` of what was bound; shows itself as the report."""

    def __init__(self, bound: dict[str, str], report: Report):
        super().__init__(bound)
        self.report = report

    def __repr__(self) -> str:
        return repr(self.report)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        self.report._repr_pretty_(printer, cycle)

    def _repr_html_(self) -> str:
        return self.report.html()


def ingest_all(store: HistoryStore, overwrite: bool = False,
               namespace: dict[str, Any] | None = None) -> Ingested:
    """Bind the newest capture of every name in ``namespace`` (default: the REPL's)."""
    shell = _ipython_shell()
    if namespace is None:
        namespace = shell.user_ns if shell is not None else _caller_globals()
    protected = set(getattr(shell, "user_ns_hidden", ()) or ()) if shell is not None else set()
    _forget_gone(namespace)
    bound: dict[str, str] = {}
    claimed: dict[str, str] = {}  # identifier -> the name bound or kept under it
    kept: list[str] = []
    refused: list[str] = []
    # A name that is its own identifier first: "-loss" must not take the variable of "loss".
    for name in sorted(store.names(), key=lambda name: identifier_for(name) != name):
        ident = identifier_for(name)
        shown = ident if ident == name else f"{ident} ({name!r})"
        if ident in claimed:
            refused.append(f"{name!r} (its variable {ident} is {claimed[ident]!r})")
            continue
        existing = namespace.get(ident, _MISSING)
        if _never_replaced(ident, existing, protected):
            refused.append(f"{name!r} ({ident} is {_what(ident, existing)})")
            continue
        if existing is not _MISSING and not overwrite and existing is not _ours(namespace,
                                                                                ident):
            claimed[ident] = name
            kept.append(shown)
            continue
        try:
            value = value_of(store.get(name))
        except UnknownName:  # cleared or evicted meanwhile
            continue
        except ProtocolError as exc:  # a peer's value that cannot be built
            refused.append(f"{name!r} ({exc})")
            continue
        namespace[ident] = value
        claimed[ident] = bound[ident] = name
        _remember(namespace, ident, value)
    pairs = [("bound", _listed([ident if ident == name else f"{ident} ({name!r})"
                                for ident, name in bound.items()]) or "-")]
    if kept:
        pairs.append(("kept", f"{_listed(kept)}: existing variables; "
                              "ingest_all(overwrite=True) replaces them"))
    if refused:
        pairs.append(("skipped", f"{_listed(refused)}; use thing.get(name)"))
    noun = "variable" if len(bound) == 1 else "variables"
    return Ingested(bound, Report(Fields(f"ingest_all: {len(bound)} {noun}", pairs)))


_MISSING = object()
# What ingest_all bound, by (namespace, identifier): a variable still holding it is brought
# up to date, not kept as the user's. Weakly where the value allows (an array, a tensor);
# strongly a float or a numpy number, which Python never shares between two variables by
# itself (as it does small ints, strings and numpy's bools). Anything else is kept as the
# user's once bound.
_bound_weakly: weakref.WeakValueDictionary[tuple[int, str], Any] = weakref.WeakValueDictionary()
_bound_strongly: dict[tuple[int, str], Any] = {}


def _ours(namespace: dict[str, Any], ident: str) -> Any:
    key = (id(namespace), ident)
    return _bound_strongly.get(key, _bound_weakly.get(key, _MISSING))


def _forget_gone(namespace: dict[str, Any]) -> None:
    """Forget the numbers bound in ``namespace`` that it no longer holds (deleted, or bound
    to something else): kept for ever, a run of per-step names would pile up here."""
    space = id(namespace)
    for key in [key for key, value in _bound_strongly.items()
                if key[0] == space and namespace.get(key[1], _MISSING) is not value]:
        del _bound_strongly[key]


def _remember(namespace: dict[str, Any], ident: str, value: Any) -> None:
    key = (id(namespace), ident)
    _bound_strongly.pop(key, None)
    _bound_weakly.pop(key, None)
    if type(value) in (float, complex) or (isinstance(value, np.generic)
                                           and not isinstance(value, np.bool_)):
        _bound_strongly[key] = value
    else:
        with contextlib.suppress(TypeError):  # no weak reference to it: kept once bound
            _bound_weakly[key] = value
# The REPL's output history: _ (python -i, IPython) and _4 (IPython), bound or not yet.
_OUTPUT_HISTORY = re.compile(r"_\d*")


def _never_replaced(ident: str, existing: Any, protected: set[str]) -> bool:
    return (hasattr(builtins, ident) or ident in protected or _OUTPUT_HISTORY.fullmatch(ident)
            is not None or isinstance(existing, types.ModuleType))


def _what(ident: str, existing: Any) -> str:
    if isinstance(existing, types.ModuleType):
        return "a module"
    if hasattr(builtins, ident):
        return "a builtin"
    if _OUTPUT_HISTORY.fullmatch(ident):
        return "the REPL's output history"
    return "IPython's"


def _ipython_shell() -> Any:
    ipython = sys.modules.get("IPython")
    return ipython.get_ipython() if ipython is not None else None


def _caller_globals() -> dict[str, Any]:
    """The globals of the first caller outside thing."""
    frame = sys._getframe(1)
    while frame.f_back is not None and _inside_thing(frame.f_globals.get("__name__")):
        frame = frame.f_back
    return frame.f_globals


def _inside_thing(module: Any) -> bool:
    return isinstance(module, str) and (module == "thing" or module.startswith("thing."))
