"""What the REPL functions report, built from the store: summary, a capture, help.

Each function here reads a :class:`~thing.store.HistoryStore` (and, for a
live server, a :class:`~thing.server.ServerInfo` snapshot) and returns a
:class:`~thing.display.Report`; ``display.py`` decides how it looks where it
is shown. Nothing here touches the network.
"""

from __future__ import annotations

import datetime
import inspect
import re
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from .array_stats import ArrayStats, array_stats, as_float64
from .arrays import is_array, loaded_type, sparse_parts
from .captures import Capture, Sender
from .display import Column, Entries, Fields, Report, Table, counted
from .errors import ProtocolError, UnknownName, whole_number
from .store import Announcement, HistoryStore, UnsentNotice

if TYPE_CHECKING:
    from .server import ServerInfo

# Names shown first by help(), in the order a newcomer needs them.
_HELP_ORDER = ("catch", "serve", "get", "get_all", "wait", "ingest_all", "summary", "describe",
               "stats", "plot", "hist", "status", "runs", "request", "available",
               "every", "first", "pause", "resume", "reset", "clear", "save", "load", "help")

# What gives way, in order, when the summary is wider than the terminal: the name last.
_SUMMARY_GIVES_WAY = [("shrink", "value"), ("shrink", "sender"), ("drop", "sender"),
                      ("drop", "from"), ("shrink", "run"), ("drop", "arrived"),
                      ("shrink", "name"), ("shrink", "shape"), ("shrink", "dtype"),
                      ("drop", "kept"), ("drop", "value")]


# -- summary ---------------------------------------------------------------------------


def summary(store: HistoryStore, info: ServerInfo | None, max_items: int | None = 5) -> Report:
    """A row per name (per name, run and rank when several runs or ranks send it), newest
    first.

    ``max_items`` names are shown (``None``: all), each in at most as many rows (the
    newest run first, its lowest ranks), and as many of the newest
    names caught on demand and notices of what was not sent. A row shows the newest
    capture: shape, dtype, framework, the value itself for a scalar, how many
    versions are kept, when it arrived and who sent it; ``!`` marks a capture
    that is not consistent (changed after ``catch()`` before its send ended).
    Below: what senders could not send and what this server refused, and why; then counts.
    """
    if max_items is not None:
        max_items = whole_number(max_items, "max_items (or None: all)", least=1)
    overview = store.overview(max_items)
    now = time.time()
    ranked = any(capture.rank is not None for capture, _ in overview.names)
    several_runs = len({capture.sender.run for capture, _ in overview.names}) > 1
    rows = []
    for capture, versions in overview.names:
        shape, dtype, framework, value = row_kind(capture)
        rows.append([capture.name + flag(capture), capture.sender.run or "?", rank_text(capture),
                     shape, dtype, framework, value, str(versions),
                     ago(capture.received_at, now), sender_text(capture)])
    columns = [Column("name", 16, "middle"), Column("run", 8, "middle"), Column("rank"),
               Column("shape", 9, "middle"), Column("dtype", 7), Column("from"),
               Column("value", 8, "number"),
               Column("kept"), Column("arrived"), Column("sender", 10, "middle")]
    unused = set() if several_runs else {"run"}
    if not ranked:
        unused.add("rank")
    if not any(row[6] for row in rows):
        unused.add("value")
    keep = [i for i, column in enumerate(columns) if column.header not in unused]
    columns = [columns[i] for i in keep]
    rows = [[row[i] for i in keep] for row in rows]

    notes = _more(overview.name_count - len({capture.name for capture, _ in overview.names}),
                  "name") + _more(overview.hidden_rows, "row of runs and ranks",
                                     "rows of runs and ranks")
    counts = [f"{counted(overview.captures, 'capture')} kept", f"{overview.received} received",
              f"{overview.unnamed} unnamed", f"{overview.evicted} evicted"]
    if overview.rejected:
        counts.append(f"{overview.rejected} refused for lack of room")
    if info is not None and info.dropped_transfers:
        counts.append(f"{counted(info.dropped_transfers, 'frame')} refused or cut short "
                      "(over a limit, invalid, or incomplete)")
    if info is not None and info.refused:
        counts.append(f"{counted(info.refused, 'connection')} refused at the cap")
    held = f"{bytes_text(overview.held_bytes)} held of a {bytes_text(overview.max_bytes)} cap"
    if overview.max_versions:
        held += f", {overview.max_versions} versions per name"
    notes.append("; ".join([*counts, held]))
    if overview.inconsistent:
        notes.append(f"! {overview.inconsistent} kept capture(s) changed after catch() before "
                     "their send ended: a later value or a mix (catch(..., copy=True) snapshots)")
    if overview.undelivered:
        reasons = ", ".join(f"{count} {reason}"
                            for reason, count in sorted(overview.undelivered.items()))
        notes.append(f"senders report {sum(overview.undelivered.values())} caught but not "
                     f"delivered: {reasons}")

    where = "thing" if info is None else f"thing server at {info.host}:{info.port}"
    if not overview.names:
        empty = ("nothing received yet; in the training job call thing.catch(tensor)"
                 if not overview.received else "no named captures kept")
        table = Table(f"{where}: {empty}", [], [], notes)
    else:
        table = Table(where, columns, rows, notes, _SUMMARY_GIVES_WAY)
    return Report(table, on_demand_table(store.available(), max_items),
                  unsent_table(overview.unsent, max_items))


def on_demand_table(announced: list[Announcement], max_items: int | None = None
                    ) -> Table | None:
    """Names caught on demand (the newest ``max_items``; None: all): sent only when asked
    for with thing.request()."""
    if not announced:
        return None
    rows = [[a.name if a.name is not None else "(unnamed)",
             "-" if a.shape is None else shape_text(a.shape), a.dtype or a.type_name,
             rank_text_of(a.sender), f"{a.sender.hostname}:{a.sender.pid}"]
            for a in announced[:max_items]]
    return Table("on demand (thing.request(name, count) sends the next calls)",
                 [Column("name", 16, "middle"), Column("shape", 9, "middle"),
                  Column("dtype", 8), Column("rank"), Column("sender", 10, "middle")],
                 rows, _more(len(announced) - len(rows), "name"),
                 [("shrink", "sender"), ("drop", "sender"), ("drop", "rank"),
                  ("shrink", "dtype"), ("shrink", "shape"), ("shrink", "name")])


def unsent_table(notices: list[UnsentNotice], max_items: int | None = None) -> Table | None:
    """What senders could not send and what this server refused, one row per name and
    reason, the newest ``max_items`` (None: all; ``describe`` has more)."""
    if not notices:
        return None
    rows = [[notice.name if notice.name is not None else "(unnamed)", notice.type_name,
             _reason_of(notice), sender_of(notice.sender)] for notice in notices[:max_items]]
    return Table("not sent, or refused", [Column("name", 16, "middle"), Column("type", 10),
                                    Column("reason", 20), Column("sender", 10)], rows,
                 _more(len(notices) - len(rows), "notice"),
                 [("shrink", "sender"), ("drop", "sender"), ("shrink", "type"),
                  ("shrink", "reason"), ("shrink", "name")])


def _more(hidden: int, what: str, plural: str | None = None) -> list[str]:
    """The note under a table cut at ``max_items`` rows."""
    if hidden <= 0:
        return []
    return [f"{counted(hidden, 'more ' + what, 'more ' + (plural or what + 's'))} "
            "(summary(max_items=None) shows all)"]


# -- one capture -----------------------------------------------------------------------


def describe(store: HistoryStore, name_or_id: str | int, index: int = 0,
             rank: int | None = None, step: int | None = None, run: str | None = None
             ) -> Report:
    """Everything known about a capture, with statistics for its arrays.

    A name whose sender could not send it, or that this server refused, is described by
    that notice.
    """
    try:
        capture = store.get(name_or_id, index, rank, step, run)
    except UnknownName:
        # Only a name with nothing kept is described by notices (of that rank and run, if
        # asked).
        unknown = isinstance(name_or_id, str) and not store.versions(name_or_id)
        notices = [notice for notice in store.unsent(name_or_id) if (
            rank is None or notice.sender.rank == rank) and (
            run in (None, "all") or notice.sender.run == run)] if unknown else []
        if not notices:
            raise
        return Report(*(_notice_fields(notice) for notice in notices))
    return capture_report(capture, store, rank)


def capture_report(capture: Capture, store: HistoryStore | None = None,
                   rank: int | None = None) -> Report:
    """The description of one capture (``store`` adds where it stands in its history, or
    in its ``rank``'s when one was asked for)."""
    value = capture.value
    pairs: list[tuple[str, str]] = [
        ("name", capture.name if capture.name is not None else "(unnamed)"),
        ("id", str(capture.id)),
        ("type", type_name(value)),
    ]
    if capture.step is not None:
        pairs.append(("step", step_text(capture)))
    shape, dtype, framework = kind(capture)
    if not is_container(value):
        pairs += [("shape", shape), ("dtype", dtype), ("framework", framework)]
    else:
        pairs += [("contents", f"{shape} items, {counted(len(capture.leaves), 'array')}"),
                  ("dtypes", dtype), ("frameworks", framework)]
    pairs.append(("bytes", f"{bytes_text(capture.nbytes)} ({capture.nbytes} bytes of array data)"))
    arrived = f"{clock(capture.received_at)} ({ago(capture.received_at)})"
    if capture.caught_at is not None:
        transit = max(capture.received_at - capture.caught_at, 0.0)
        arrived += f", {transit * 1000:.1f} ms after catch()"
    pairs.append(("arrived", arrived))
    pairs.append(("sender", sender_of(capture.sender)))
    if capture.sender.run is not None:
        pairs.append(("run", capture.sender.run))
    if capture.rank is not None:
        pairs.append(("rank", rank_text(capture)))
    pairs.append(("call site", capture.call_site or "-"))
    if capture.name is not None and store is not None:
        pairs.append(("versions", _versions_text(store, capture, rank)))
    if capture.requested:
        pairs.append(("sent", "because of a request (thing.request)"))
    pairs.append(("consistent",
                  "yes: the value at the catch() call" if capture.consistent else
                  "NO: it changed after catch() before its send ended, so it holds a later "
                  "value or a mix of two (catch(..., copy=True) avoids it)"))
    scalar = exact_text(_readable(capture))
    table = None
    if scalar is not None:
        pairs.append(("value", scalar))
    elif is_container(value):
        table = _leaf_table(capture)
    elif len(capture.leaves) == 1 and capture.leaves[0].framework != "bytes":
        pairs += _stats_pairs(array_stats(value, capture.leaves[0]))
    title = f"capture {capture.name!r}" if capture.name is not None else f"capture {capture.id}"
    return Report(Fields(title, pairs), table)


def _reason_of(notice: UnsentNotice) -> str:
    return f"refused by this server: {notice.reason}" if notice.refused else notice.reason


def _notice_fields(notice: UnsentNotice) -> Fields:
    title = "this server refused" if notice.refused else "could not send"
    return Fields(f"{title} {notice.name!r}", [
        ("type", notice.type_name),
        ("reason", _reason_of(notice)),
        ("call site", notice.call_site or "-"),
        ("sender", sender_of(notice.sender)),
        ("told at", f"{clock(notice.at)} ({ago(notice.at)})"),
    ])


def _versions_text(store: HistoryStore, capture: Capture, rank: int | None) -> str:
    run = capture.sender.run
    try:
        history = store.get_all(capture.name, rank, run=run)  # as get() counts them
        newest_run = store.get(capture.name, rank=rank).sender.run
    except KeyError:
        return "0 kept (cleared or evicted since)"
    ids = [c.id for c in history]
    of_rank = "" if rank is None else f" from rank {rank}"
    if capture.id not in ids:
        return f"{len(ids)} kept{of_rank}; this one was evicted or cleared since"
    index = len(ids) - 1 - ids.index(capture.id)
    selector = ("" if rank is None else f", rank={rank}") + (
        "" if run == newest_run else f", run={run!r}")
    where = (f"the newest{of_rank}{' of its run' if run != newest_run else ''}" if index == 0
             else f"get({capture.name!r}, index={index}{selector})")
    return f"{len(ids)} kept{of_rank}; this is {where}"


def _stats_pairs(stats: ArrayStats | None) -> list[tuple[str, str]]:
    if stats is None:
        return [("statistics", "none for this dtype")]
    if stats.count == 0:
        return [("statistics", "empty array")]
    of = " of |x|" if stats.magnitude else ""
    over = "" if stats.finite == stats.count else f" (over the {stats.finite} finite values)"
    pairs = [("elements", str(stats.count))]
    if stats.finite:
        low, high, mean = numbers_apart([stats.min, stats.max, stats.mean])
        pairs += [
            (f"min{of}", low),
            (f"max{of}", high),
            (f"mean{of}", mean + over),
            (f"std{of}", number(stats.std) + over),
            ("L2 norm", number(stats.norm) + over),
        ]
    pairs += [("NaN", str(stats.nan)), ("Inf", str(stats.inf))]
    return pairs


def _leaf_table(capture: Capture) -> Table:
    headers = ["path", "shape", "dtype", "min", "max", "mean", "std", "L2", "NaN", "Inf"]
    rows = []
    magnitudes = False  # a complex array's row: statistics of |x|
    for (path, leaf), spec in zip(_leaf_paths(capture.value), capture.leaves):
        stats = None if spec.framework == "bytes" else array_stats(leaf, spec)
        shape = f"{spec.shape[0]} bytes" if spec.framework == "bytes" else shape_text(spec.shape)
        # Four digits, as a table of many columns at 80 has room for; more where min, max
        # and mean differ in later ones.
        numbers = ["", "", "", "", ""] if stats is None or stats.min is None else [
            *numbers_apart([stats.min, stats.max, stats.mean], 4), f"{stats.std:.4g}",
            f"{stats.norm:.4g}"]
        counts = ["", ""] if stats is None else [str(stats.nan), str(stats.inf)]
        dtype = "-" if spec.framework == "bytes" else spec.dtype
        if stats is not None and stats.magnitude:  # said on the path: dtype may be dropped
            path += " |x|"
            magnitudes = True
        rows.append([path, shape, dtype, *numbers, *counts])
    # NaN and Inf columns of zeros say nothing; one that says something always stays.
    unused = {header for i, header in enumerate(headers)
              if header in ("NaN", "Inf") and all(row[i] in ("0", "") for row in rows)}
    keep = [i for i, header in enumerate(headers) if header not in unused]
    columns = [Column(headers[i], 10, "middle") if headers[i] == "path" else Column(headers[i])
               for i in keep]
    notes = ["statistics over finite values; std with ddof=0"]
    if magnitudes:
        notes.append("|x|: of a complex array's magnitudes")
    if unused:
        notes[0] += f"; no {' or '.join(sorted(unused))} values"
    return Table("arrays", columns, [[row[i] for i in keep] for row in rows], notes,
                 [("shrink", "path"), ("drop", "dtype"), ("drop", "L2"), ("drop", "shape")])


def _leaf_paths(value: Any) -> list[tuple[str, Any]]:
    """``(path, leaf)`` of every array in a container, in the order its leaves were sent."""
    found: list[tuple[str, Any]] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, item in node.items():
                walk(item, f"{path}[{key!r}]")
        elif isinstance(node, (list, tuple)):
            for index, item in enumerate(node):
                walk(item, f"{path}[{index}]")
        elif _is_sparse(node):  # it travelled as its parts, one leaf each
            for part, tensor in sparse_parts(node).parts.items():
                found.append((f"{path}.{part}", tensor))
        elif is_array(node):
            found.append((path, node))

    walk(value, "")
    return found


# -- help ------------------------------------------------------------------------------


def help_report() -> Report:
    """Every public function and class of thing with its signature and first sentence."""
    import thing

    public = [*thing.__all__, "help"]
    ordered = [name for name in _HELP_ORDER if name in public]
    ordered += sorted(name for name in public if name not in ordered)
    functions, classes, errors = [], [], []
    for name in ordered:
        obj = getattr(thing, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            errors.append((f"thing.{name}", _first_sentence(obj)))
        elif inspect.isclass(obj):
            methods = [m for m, _ in inspect.getmembers(obj, inspect.isfunction)
                       if not m.startswith("_")]
            line = _first_sentence(obj) + (f" Methods: {', '.join(methods)}." if methods else "")
            classes.append((f"thing.{name}{_signature(obj)}", line))
        elif callable(obj):
            functions.append((f"thing.{name}{_signature(obj)}", _first_sentence(obj)))
    return Report(
        Entries("Functions", functions),
        Entries("Classes", classes),
        Entries("Errors", errors),
        "thing.BACKEND names the transport core in use; help(thing.<name>) shows the whole "
        "documentation of one of the above.",
    )


def _signature(obj: Any) -> str:
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    empty = inspect.Parameter.empty
    parameters = [p.replace(annotation=empty) for p in signature.parameters.values()
                  if not p.name.startswith("_")]
    return str(signature.replace(parameters=parameters, return_annotation=empty))


def _first_sentence(obj: Any) -> str:
    doc = (inspect.getdoc(obj) or "").strip()
    if not doc:
        return ""
    # The first sentence, whatever lines it spans: its first line alone stopped mid-phrase.
    paragraph = " ".join(doc.split("\n\n")[0].split())
    sentence = re.split(r"(?<=[.!?])\s+(?=[A-Z(`])", paragraph, maxsplit=1)[0]
    # reStructuredText to plain text: ``code`` -> code, :class:`Name` -> Name.
    return re.sub(r":\w+:`~?([^`]*)`", r"\1", sentence).replace("``", "")


# -- how a capture reads in a cell --------------------------------------------------------


def is_container(value: Any) -> bool:
    """True for the containers a capture may be: dict, list, tuple, set, frozenset."""
    return isinstance(value, (dict, list, tuple, set, frozenset))


def type_name(value: Any) -> str:
    """``value``'s type as a user knows it: ``dict``, ``torch.Tensor``, ``numpy.ndarray``."""
    kind = type(value)
    module = kind.__module__.partition(".")[0]
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def shape_text(shape: tuple[int, ...]) -> str:
    """A shape as Python writes a tuple: ``(3,)``, ``(2, 3)``, ``()``."""
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def kind(capture: Capture) -> tuple[str, str, str]:
    """``(shape, dtype, framework)`` as the summary shows them."""
    value, leaves = capture.value, capture.leaves
    if _is_sparse(value):  # its parts are the leaves
        layout = str(value.layout).rpartition(".")[2]
        return shape_text(tuple(value.shape)), str(value.dtype).rpartition(".")[2], \
            f"torch {layout}"
    if is_container(value):
        what = f"{type(value).__name__} of {len(value)}"
        if not leaves:
            return what, "-", "python"
        return what, _several(spec.dtype for spec in leaves), _several(
            spec.framework for spec in leaves)
    if len(leaves) == 1:
        spec = leaves[0]
        if spec.framework == "bytes":
            return f"{spec.shape[0]} bytes", "-", "bytes"
        return shape_text(spec.shape), spec.dtype, spec.framework
    return "-", type(value).__name__, "python"


def row_kind(capture: Capture) -> tuple[str, str, str, str]:
    """``kind(capture)`` and its scalar text, for a table row: a value that cannot be
    built (a peer's sparse tensor torch refuses) shows why instead of failing the table."""
    try:
        return (*kind(capture), scalar_text(_readable(capture)) or "")
    except ProtocolError as exc:
        return "-", "-", "-", f"cannot be built: {exc}"


def _is_sparse(value: Any) -> bool:
    tensor = loaded_type("torch", "Tensor")
    return (tensor is not None and isinstance(value, tensor)
            and value.layout != sys.modules["torch"].strided)


def _several(items: Any, most: int = 2) -> str:
    distinct = sorted(set(items))
    return ",".join(distinct) if len(distinct) <= most else f"{len(distinct)} kinds"


_NOT_SINGLE = object()


def _single(value: Any) -> Any:
    """The Python value of a single number or string (a 0-d array's item), else _NOT_SINGLE."""
    if value is None or isinstance(value, (bool, int, float, complex, str)):
        return value
    if isinstance(value, np.generic) or getattr(value, "ndim", None) == 0:
        try:
            return value.item()
        except (TypeError, ValueError, RuntimeError):
            return _NOT_SINGLE
    return _NOT_SINGLE


def _readable(capture: Capture) -> Any:
    """The capture's value, a single bfloat16 or float8 number read from its raw bits where
    neither torch nor ml_dtypes is here to give it its dtype (it arrives as those bits)."""
    value = capture.value
    if (len(capture.leaves) == 1 and isinstance(value, (np.ndarray, np.generic))
            and value.ndim == 0 and value.dtype.name != capture.leaves[0].dtype):
        numbers = as_float64(np.asarray(value), capture.leaves[0])
        if numbers is not None:
            return numbers.item()
    return value


def scalar_text(value: Any) -> str | None:
    """The value itself, shortened, when it is a single number or string; else None."""
    single = _single(value)
    if single is _NOT_SINGLE:
        return None
    if isinstance(single, str):
        return repr(single) if len(single) <= 40 else repr(single[:37]) + "..."
    return number(single)


def exact_text(value: Any) -> str | None:
    """A single value in full, as Python writes it (``0.1234567891``), else None."""
    single = _single(value)
    return None if single is _NOT_SINGLE else repr(single)


def number(x: Any) -> str:
    """A number in at most 6 significant digits; None and bools as Python writes them."""
    if isinstance(x, (float, complex)) and not isinstance(x, bool):
        return f"{x:.6g}"
    return repr(x) if isinstance(x, (bool, type(None))) else str(x)


def numbers_apart(values: list[Any], digits: int = 6) -> list[str]:
    """``values`` as :func:`number` writes them, floats in ``digits`` significant digits or
    as many more as it takes to tell apart those that differ (a loss on a plateau:
    0.6931470 to 0.6931475; a min and max of 99999995 and 100000005, which 6 digits both
    write 1e+08)."""
    distinct = len({value for value in values if value == value})  # a NaN equals nothing
    while True:
        texts = [f"{value:.{digits}g}" if isinstance(value, float) else number(value)
                 for value in values]
        told_apart = len({text for text, value in zip(texts, values) if value == value})
        if told_apart == distinct or digits >= 17:
            return texts
        digits += 1


def bytes_text(nbytes: int) -> str:
    """``nbytes`` in binary units: ``512 B``, ``1.5 KiB``, ``3.0 GiB``."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{nbytes} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def ago(timestamp: float, now: float | None = None) -> str:
    """How long before ``now`` ``timestamp`` was: ``just now``, ``12 s ago``, ``3.5 h ago``."""
    seconds = max((time.time() if now is None else now) - timestamp, 0.0)
    if seconds < 1:
        return "just now"
    if seconds < 60:
        return f"{seconds:.0f} s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 86400:
        return f"{seconds / 3600:.1f} h ago"
    return f"{seconds / 86400:.1f} days ago"


def clock(timestamp: float) -> str:
    """Local date and time to the millisecond."""
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def step_text(capture: Capture) -> str:
    """The step, and the call number of its name when a step was given apart from it."""
    if capture.given_step is None:
        return f"{capture.call} (the call number of its name)"
    if capture.call is None:
        return f"{capture.given_step} (given)"
    return f"{capture.given_step} (given; call {capture.call} of its name)"


def rank_text(capture: Capture) -> str:
    """``rank/world size`` of the sender (``3/8``), or "" outside a distributed job."""
    return rank_text_of(capture.sender)


def rank_text_of(sender: Sender) -> str:
    """``rank/world size`` of a sender (``3/8``), or "" outside a distributed job."""
    if sender.rank is None:
        return ""
    return f"{sender.rank}" + (f"/{sender.world_size}" if sender.world_size else "")


def sender_text(capture: Capture) -> str:
    """``host:pid`` of the process that sent ``capture``."""
    return f"{capture.sender.hostname}:{capture.sender.pid}"


def sender_of(sender: Sender) -> str:
    """A sender in full: address, host and pid."""
    return f"{sender.address} (host {sender.hostname}, pid {sender.pid})"


def flag(capture: Capture) -> str:
    """`` !`` after the name of a capture that is not consistent, else ""."""
    return "" if capture.consistent else " !"
