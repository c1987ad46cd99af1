"""What the REPL functions print: the summary, a capture's description, the live status view, help.

Everything is rendered with rich, imported here and only when one of these
functions runs, so ``import thing`` in a training job never loads it. rich's
Console writes to the terminal and, in Jupyter, to the notebook. Without rich
installed the same content is printed as plain text.

Array statistics (:func:`array_stats`) are computed in chunks of about a
million elements, so describing a multi-gigabyte tensor needs only a few
megabytes of scratch memory.
"""

from __future__ import annotations

import datetime
import inspect
import math
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .arrays import LeafSpec, is_array
from .store import Capture

# Elements converted to float64 at a time while computing statistics.
STATS_CHUNK = 1 << 20

# Names shown first by help(), in the order a newcomer needs them.
_HELP_ORDER = ("catch", "serve", "get", "get_all", "wait", "ingest_all", "summary", "describe",
               "status", "clear", "help")


# -- statistics -----------------------------------------------------------------


@dataclass(frozen=True)
class ArrayStats:
    """Statistics of an array's values.

    ``min``/``max``/``mean``/``std``/``norm`` are over the finite values only
    (``None`` when there are none); ``std`` is the population standard
    deviation (``ddof=0``, as numpy); ``norm`` the L2 norm of the flattened
    array. For complex arrays they describe the magnitudes ``|x|``.
    """

    count: int
    finite: int
    nan: int
    inf: int
    min: float | None
    max: float | None
    mean: float | None
    std: float | None
    norm: float | None
    magnitude: bool = False


def array_stats(value: Any, spec: LeafSpec | None = None) -> ArrayStats | None:
    """Statistics of a numpy/torch/jax array, or None for what has none (bytes, unknown dtypes).

    ``spec`` (the capture's :class:`LeafSpec`) lets a bfloat16 array kept as raw
    ``uint16`` bits (no torch or ml_dtypes here) be read as bfloat16.
    """
    flat = _flat_numpy_source(value)
    if flat is None:
        return None
    to_float = _float_converter(flat, spec)
    if to_float is None:
        return None
    magnitude = _is_complex(flat)
    # Integers (not the raw bits of a bfloat16/float8 kept as uint) keep exact min and max.
    exact_int = _is_integer(flat) and not (
        spec is not None and (spec.dtype == "bfloat16" or spec.dtype.startswith("float8")))
    count = finite = nan = inf = 0
    lo = hi = None
    mean = m2 = sumsq = 0.0
    size = _size(flat)
    for start in range(0, size, STATS_CHUNK):
        raw = _chunk(flat, start, start + STATS_CHUNK)
        x = to_float(raw)
        count += x.size
        bad = ~np.isfinite(x)
        if bad.any():
            chunk_nan = int(np.isnan(x).sum())
            nan += chunk_nan
            inf += int(bad.sum()) - chunk_nan
            x = x[~bad]
        if not x.size:
            continue
        if exact_int:  # compare the integers themselves: float64 rounds beyond 2**53
            chunk_lo, chunk_hi = int(raw.min()), int(raw.max())
        else:
            chunk_lo, chunk_hi = float(x.min()), float(x.max())
        lo = chunk_lo if lo is None else min(lo, chunk_lo)
        hi = chunk_hi if hi is None else max(hi, chunk_hi)
        # Chan et al.'s pairwise update: numerically stable mean and variance across chunks.
        n = x.size
        chunk_mean = float(x.mean())
        chunk_m2 = float(np.square(x - chunk_mean).sum())
        total = finite + n
        delta = chunk_mean - mean
        mean += delta * n / total
        m2 += chunk_m2 + delta * delta * finite * n / total
        sumsq += float(np.dot(x, x))
        finite = total
    if not finite:
        return ArrayStats(count, 0, nan, inf, None, None, None, None, None, magnitude)
    return ArrayStats(count, finite, nan, inf, lo, hi, mean, math.sqrt(m2 / finite),
                      math.sqrt(sumsq), magnitude)


def _flat_numpy_source(value: Any) -> Any:
    """A flat (1-D) numpy array or CPU torch tensor over the value's elements, without copying."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        return tensor.reshape(-1)
    if isinstance(value, (bytes, bytearray, memoryview, str)):
        return None
    if isinstance(value, (np.ndarray, np.generic)) or is_array(value):
        array = np.asarray(value)  # a jax array on the CPU: a view of its buffer
        return array.reshape(-1) if array.dtype.kind != "O" else None
    return None


def _size(flat: Any) -> int:
    return int(flat.numel()) if hasattr(flat, "numel") else int(flat.size)


def _chunk(flat: Any, start: int, stop: int) -> np.ndarray:
    piece = flat[start:stop]
    if isinstance(piece, np.ndarray):
        return piece
    if piece.dtype.is_floating_point and piece.element_size() < 4 or not _numpy_has(piece):
        piece = piece.float()  # bfloat16, float8...: numpy cannot hold them
    return piece.numpy()


def _numpy_has(tensor: Any) -> bool:
    try:
        tensor[:0].numpy()
    except (TypeError, RuntimeError):
        return False
    return True


def _is_complex(flat: Any) -> bool:
    return bool(flat.dtype.is_complex) if hasattr(flat, "is_complex") else flat.dtype.kind == "c"


def _is_integer(flat: Any) -> bool:
    if hasattr(flat, "is_complex"):  # torch
        return not flat.dtype.is_floating_point and not flat.dtype.is_complex
    return flat.dtype.kind in "iub"


def _float_converter(flat: Any, spec: LeafSpec | None) -> Any:
    """A function from a raw numpy chunk to float64 values; None when the dtype holds no numbers."""
    if hasattr(flat, "is_complex"):  # torch chunks arrive as numpy float32 (or native dtypes)
        if flat.dtype.is_complex:
            return lambda raw: np.abs(raw).astype(np.float64)
        return lambda raw: raw.astype(np.float64)
    if spec is not None and spec.dtype == "bfloat16" and flat.dtype == np.uint16:
        # bfloat16 kept as its raw bits: they are the upper half of a float32.
        return lambda raw: (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if spec is not None and spec.dtype.startswith("float8") and flat.dtype == np.uint8:
        return None  # raw float8 bits, no library here to read them
    kind = flat.dtype.kind
    if kind == "c":
        return lambda raw: np.abs(raw).astype(np.float64)
    if kind in "fiub":
        return lambda raw: raw.astype(np.float64)
    try:  # ml_dtypes (bfloat16, float8) cast to float
        flat[:0].astype(np.float64)
    except (TypeError, ValueError):
        return None
    return lambda raw: raw.astype(np.float64)


# -- what a value is ------------------------------------------------------------------


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
        elif is_array(node):
            found.append((path, node))

    walk(value, "")
    return found


def _is_container(value: Any) -> bool:
    return isinstance(value, (dict, list, tuple))


def _type_name(value: Any) -> str:
    kind = type(value)
    module = kind.__module__.partition(".")[0]
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def _shape_text(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _kind(capture: Capture) -> tuple[str, str, str]:
    """``(shape, dtype, framework)`` as summary() shows them."""
    value, leaves = capture.value, capture.leaves
    if _is_container(value):
        what = f"{type(value).__name__} of {len(value)}"
        if not leaves:
            return what, "-", "python"
        return what, _several(spec.dtype for spec in leaves), _several(
            spec.framework for spec in leaves)
    if len(leaves) == 1:
        spec = leaves[0]
        if spec.framework == "bytes":
            return f"{spec.shape[0]} bytes", "-", "bytes"
        return _shape_text(spec.shape), spec.dtype, spec.framework
    return "-", type(value).__name__, "python"


def _several(items: Any, most: int = 2) -> str:
    distinct = sorted(set(items))
    return ",".join(distinct) if len(distinct) <= most else f"{len(distinct)} kinds"


def _scalar_text(value: Any) -> str | None:
    """The value itself when it is a single number (or a short string), else None."""
    if value is None or isinstance(value, (bool, int, float, complex)):
        return _number(value)
    if isinstance(value, str):
        return repr(value) if len(value) <= 40 else repr(value[:37]) + "..."
    if isinstance(value, np.generic) or getattr(value, "ndim", None) == 0:
        try:
            return _number(value.item())
        except (TypeError, ValueError, RuntimeError):
            return None
    return None


def _number(x: Any) -> str:
    if isinstance(x, (float, complex)) and not isinstance(x, bool):
        return f"{x:.6g}"
    return repr(x) if isinstance(x, (bool, type(None))) else str(x)


def _bytes_text(nbytes: int) -> str:
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{nbytes} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _ago(timestamp: float, now: float | None = None) -> str:
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


def _clock(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _sender_text(capture: Capture) -> str:
    sender = capture.sender
    text = f"{sender.hostname}:{sender.pid}"
    if sender.rank is not None:
        text += f" rank {sender.rank}" + (f"/{sender.world_size}" if sender.world_size else "")
    return text


def _flag(capture: Capture) -> str:
    return "" if capture.consistent else " !"


# -- rendering, with rich or as plain text ----------------------------------------------


def _rich() -> Any:
    try:
        import rich  # noqa: F401
    except ImportError:
        return None
    from rich import box
    from rich.console import Console
    from rich.table import Table

    return Console, Table, box


class _Output:
    """A table-and-lines printer: rich's Console when rich is installed, else print()."""

    def __init__(self) -> None:
        parts = _rich()
        self.rich = parts is not None
        if self.rich:
            console_type, self._table_type, self._box = parts
            # markup=False: names such as "h[3]" are text, never rich markup tags.
            self.console = console_type(highlight=False, markup=False)

    def table(self, title: str | None, columns: list[str], rows: list[list[str]],
              caption: str | None = None, no_wrap: tuple[int, ...] = (0,)) -> Any:
        if self.rich:
            table = self._table_type(title=title, box=self._box.SIMPLE_HEAD, caption=caption,
                                     title_justify="left", caption_justify="left")
            for index, column in enumerate(columns):
                table.add_column(column, no_wrap=index in no_wrap, overflow="fold")
            for row in rows:
                table.add_row(*row)
            return table
        widths = [max([len(column), *(len(row[i]) for row in rows)])
                  for i, column in enumerate(columns)]
        lines = [title] if title else []
        lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                  for row in [columns, *rows]]
        if caption:
            lines.append(caption)
        return "\n".join(lines)

    def fields(self, title: str | None, pairs: list[tuple[str, str]]) -> Any:
        """A two-column table of ``label: value`` lines."""
        if self.rich:
            grid = self._table_type(title=title, box=None,
                                    show_header=False, title_justify="left", padding=(0, 2, 0, 0))
            grid.add_column(style="bold", no_wrap=True)
            grid.add_column(overflow="fold")
            for label, text in pairs:
                grid.add_row(label, text)
            return grid
        width = max((len(label) for label, _ in pairs), default=0)
        lines = [title] if title else []
        lines += [f"{label.ljust(width)}  {text}" for label, text in pairs]
        return "\n".join(lines)

    def entries(self, title: str, entries: list[tuple[str, str]]) -> Any:
        """A titled list of ``(heading, line)`` pairs: the heading, then the line indented below."""
        if self.rich:
            from rich.padding import Padding
            from rich.text import Text

            grid = self._table_type.grid(padding=(0, 0))
            grid.add_column(overflow="fold")
            grid.add_row(Text(title, style="bold underline"))
            for heading, line in entries:
                grid.add_row(Text(heading, style="bold"))
                if line:
                    grid.add_row(Padding(Text(line), (0, 0, 0, 4)))
            grid.add_row("")
            return grid
        lines = [title]
        for heading, line in entries:
            lines.append(heading)
            if line:
                lines.append("    " + line)
        return "\n".join(lines) + "\n"

    def print(self, *items: Any) -> None:
        for item in items:
            if self.rich:
                self.console.print(item)
            else:
                print(item)


# -- summary ---------------------------------------------------------------------------


def show_summary(server: Any, max_items: int | None = 5) -> None:
    """Print what ``server`` holds: a row per name, the ``max_items`` most recently updated first.

    ``max_items=None`` shows every name. A row shows the name's newest
    capture: shape, dtype, framework, the value itself for a scalar, how many
    versions are kept, when it arrived and who sent it; ``!`` marks a capture
    that is not consistent (changed after ``catch()`` before its send ended).
    Below: counts of names not shown,
    unnamed, evicted and refused captures, and the bytes held against the cap.
    """
    out = _Output()
    overview = server.store.overview(max_items)
    now = time.time()
    rows = []
    with_values = False
    for capture, versions in overview.names:
        shape, dtype, framework = _kind(capture)
        value = _scalar_text(capture.value) or ""
        with_values = with_values or bool(value)
        rows.append([capture.name + _flag(capture), shape, dtype, framework, value, str(versions),
                     _ago(capture.received_at, now), _sender_text(capture)])
    # Short headers: the whole table fits an 80-column terminal or a narrow notebook cell.
    columns = ["name", "shape", "dtype", "from", "value", "kept", "arrived", "sender"]
    if not with_values:
        columns.pop(4)
        for row in rows:
            row.pop(4)
    notes = []
    hidden = overview.name_count - len(overview.names)
    if hidden > 0:
        notes.append(f"{hidden} more name{'s' if hidden != 1 else ''} "
                     f"(summary(max_items=None) shows all)")
    notes.append(f"{overview.captures} captures kept, {overview.received} received")
    notes.append(f"{overview.unnamed} unnamed")
    notes.append(f"{overview.evicted} evicted")
    if overview.rejected:
        notes.append(f"{overview.rejected} refused for lack of room")
    cut = getattr(server, "dropped_transfers", 0)
    if cut:
        notes.append(f"{cut} transfer{'s' if cut != 1 else ''} dropped incomplete or invalid")
    refused = getattr(server, "refused", 0)
    if refused:
        notes.append(f"{refused} connection{'s' if refused != 1 else ''} refused at the cap")
    held = f"{_bytes_text(overview.held_bytes)} held of a {_bytes_text(overview.max_bytes)} cap"
    if overview.max_versions:
        held += f", {overview.max_versions} versions per name"
    notes.append(held)
    caption = "; ".join(notes)
    if overview.inconsistent:
        caption += (f"\n! {overview.inconsistent} kept capture(s) changed after catch() before "
                    "their send ended: a later value or a mix (catch(..., copy=True) snapshots)")
    if overview.undelivered:
        reasons = ", ".join(f"{count} {reason}"
                            for reason, count in sorted(overview.undelivered.items()))
        caption += (f"\nsenders report {sum(overview.undelivered.values())} caught but not "
                    f"delivered: {reasons}")
    where = f"thing server at {server.host}:{server.port}"
    if not overview.names:
        out.print(f"{where}: nothing received yet; in the training job call thing.catch(tensor)."
                  if not overview.received else f"{where}: no named captures kept.", caption)
        return
    # Only the name may wrap: the short columns stay readable in an 80-column terminal.
    out.print(out.table(where, columns, rows, caption, no_wrap=tuple(range(1, len(columns)))))


# -- describe --------------------------------------------------------------------------


def show_description(capture: Capture, server: Any = None) -> None:
    """Print everything known about ``capture``, with statistics for its arrays."""
    out = _Output()
    value = capture.value
    pairs: list[tuple[str, str]] = [
        ("name", capture.name if capture.name is not None else "(unnamed)"),
        ("id", str(capture.id)),
        ("type", _type_name(value)),
    ]
    shape, dtype, framework = _kind(capture)
    if not _is_container(value):
        pairs += [("shape", shape), ("dtype", dtype), ("framework", framework)]
    else:
        pairs += [("contents", f"{shape} items, {len(capture.leaves)} arrays"),
                  ("dtypes", dtype), ("frameworks", framework)]
    pairs.append(("bytes", f"{_bytes_text(capture.nbytes)} ({capture.nbytes} bytes of array data)"))
    arrived = f"{_clock(capture.received_at)} ({_ago(capture.received_at)})"
    if capture.caught_at is not None:
        transit = max(capture.received_at - capture.caught_at, 0.0)
        arrived += f", {transit * 1000:.1f} ms after catch()"
    pairs.append(("arrived", arrived))
    sender = capture.sender
    pairs.append(("sender", f"{sender.address} (host {sender.hostname}, pid {sender.pid})"))
    if sender.rank is not None:
        of = f" of {sender.world_size}" if sender.world_size else ""
        pairs.append(("rank", f"{sender.rank}{of}"))
    pairs.append(("call site", capture.call_site or "-"))
    if capture.name is not None and server is not None:
        pairs.append(("versions", _versions_text(server, capture)))
    pairs.append(("consistent",
                  "yes: the value at the catch() call" if capture.consistent else
                  "NO: it changed after catch() before its send ended, so it holds a later "
                  "value or a mix of two (catch(..., copy=True) avoids it)"))
    scalar = _scalar_text(value)
    tables: list[Any] = []
    if scalar is not None:
        pairs.append(("value", scalar))
    elif _is_container(value):
        tables.append(_leaf_table(out, capture))
    elif len(capture.leaves) == 1 and capture.leaves[0].framework != "bytes":
        pairs += _stats_pairs(array_stats(value, capture.leaves[0]))
    title = f"capture {capture.name!r}" if capture.name is not None else f"capture {capture.id}"
    out.print(out.fields(title, pairs), *tables)


def _versions_text(server: Any, capture: Capture) -> str:
    try:
        history = server.store.get_all(capture.name)
    except KeyError:
        return "0 kept (cleared or evicted since)"
    ids = [c.id for c in history]
    if capture.id not in ids:
        return f"{len(ids)} kept; this one was evicted or cleared since"
    index = len(ids) - 1 - ids.index(capture.id)
    where = "the newest" if index == 0 else f"get({capture.name!r}, index={index})"
    return f"{len(ids)} kept; this is {where}"


def _stats_pairs(stats: ArrayStats | None) -> list[tuple[str, str]]:
    if stats is None:
        return [("statistics", "none for this dtype")]
    if stats.count == 0:
        return [("statistics", "empty array")]
    of = " of |x|" if stats.magnitude else ""
    over = "" if stats.finite == stats.count else f" (over the {stats.finite} finite values)"
    pairs = [("elements", str(stats.count))]
    if stats.finite:
        pairs += [
            (f"min{of}", _number(stats.min)),
            (f"max{of}", _number(stats.max)),
            (f"mean{of}", _number(stats.mean) + over),
            (f"std{of}", _number(stats.std) + over),
            ("L2 norm", _number(stats.norm) + over),
        ]
    pairs += [("NaN", str(stats.nan)), ("Inf", str(stats.inf))]
    return pairs


def _leaf_table(out: _Output, capture: Capture) -> Any:
    rows = []
    for (path, leaf), spec in zip(_leaf_paths(capture.value), capture.leaves):
        if spec.framework == "bytes":
            rows.append([path, f"{spec.shape[0]} bytes", "-", ""])
            continue
        stats = array_stats(leaf, spec)
        text = ""
        if stats is not None and stats.count:
            numbers = zip(("min", "max", "mean", "std", "L2"),
                          (stats.min, stats.max, stats.mean, stats.std, stats.norm))
            text = "  ".join(f"{label} {'-' if x is None else f'{x:.4g}'}" for label, x in numbers)
            text += f"  NaN {stats.nan}  Inf {stats.inf}"
        rows.append([path, _shape_text(spec.shape), spec.dtype, text])
    # One wrapping statistics column keeps the table readable in an 80-column terminal.
    return out.table("arrays", ["path", "shape", "dtype", "statistics"], rows,
                     "statistics over finite values; std with ddof=0", no_wrap=(1, 2))


# -- status ----------------------------------------------------------------------------


def show_status(server: Any, refresh: float = 0.25, rows: int = 10) -> None:
    """Show the newest ``rows`` arrivals live, redrawn as they come; Ctrl+C stops watching.

    In a terminal it is a rich live view with a spinner; in Jupyter a display
    updated in place; elsewhere (output to a file or a pipe) one line per
    arrival. The server keeps receiving in either case, and after Ctrl+C.
    """
    out = _Output()
    store = server.store
    print(f"Watching arrivals at port {server.port}; press Ctrl+C to stop "
          "(the server keeps running).", flush=True)
    try:
        if out.rich and out.console.is_jupyter:
            _status_in_notebook(out, server, refresh, rows)
        elif out.rich and out.console.is_terminal and not out.console.is_dumb_terminal:
            _status_live(out, server, refresh, rows)
        else:
            _status_lines(server, refresh)
    except KeyboardInterrupt:
        pass
    kept = len(store)
    print(f"Stopped watching; the server is still running at port {server.port} "
          f"with {kept} capture{'' if kept == 1 else 's'} kept.", flush=True)


def _status_view(out: _Output, server: Any, rows: int) -> Any:
    from rich.console import Group
    from rich.spinner import Spinner
    from rich.text import Text

    store = server.store
    clients = len(server.clients())
    recent = store.recent(rows)
    header = Spinner("dots", text=Text(
        f"thing server at {server.host}:{server.port}: {store.received} received, "
        f"{len(store)} kept ({_bytes_text(store.held_bytes)}), "
        f"{clients} client{'s' if clients != 1 else ''} connected. Ctrl+C to stop watching."))
    table = out.table(None, ["arrived", "id", "name", "shape", "dtype", "value", "sender"],
                      [_arrival_row(capture) for capture in recent],
                      None if recent else "waiting for the first capture...", no_wrap=(2,))
    return Group(header, table)


def _arrival_row(capture: Capture) -> list[str]:
    shape, dtype, _ = _kind(capture)
    return [_clock(capture.received_at)[11:], str(capture.id),
            (capture.name if capture.name is not None else "(unnamed)") + _flag(capture),
            shape, dtype, _scalar_text(capture.value) or "", _sender_text(capture)]


def _status_live(out: _Output, server: Any, refresh: float, rows: int) -> None:
    from rich.live import Live

    with Live(_status_view(out, server, rows), console=out.console, auto_refresh=False,
              transient=False) as live:
        while True:
            _next_frame(server.store, refresh)
            live.update(_status_view(out, server, rows), refresh=True)


def _status_in_notebook(out: _Output, server: Any, refresh: float, rows: int) -> None:
    from IPython.display import display
    from rich.panel import Panel

    handle = display(Panel(_status_view(out, server, rows)), display_id=True)
    if handle is None:  # not in a running kernel after all
        _status_lines(server, refresh)
        return
    while True:
        _next_frame(server.store, refresh)
        handle.update(Panel(_status_view(out, server, rows)))


def _status_lines(server: Any, refresh: float) -> None:
    store = server.store
    seen = store.received
    while True:
        store.wait_for_arrival(seen, refresh)
        received = store.received
        fresh = [c for c in reversed(store.recent(min(received - seen, 100))) if c.id >= seen]
        if received - seen > len(fresh):
            print(f"... {received - seen - len(fresh)} more arrived", flush=True)
        for capture in fresh:
            print("  ".join(cell for cell in _arrival_row(capture) if cell), flush=True)
        seen = received


def _next_frame(store: Any, refresh: float, min_interval: float = 0.1) -> None:
    """Return after the next arrival or ``refresh`` s, but not sooner than ``min_interval`` s."""
    started = time.monotonic()
    store.wait_for_arrival(store.received, refresh)
    rest = min_interval - (time.monotonic() - started)
    if rest > 0:  # a flood of arrivals must not turn redrawing into a busy loop
        time.sleep(rest)


# -- help ------------------------------------------------------------------------------


def show_help() -> None:
    """Print every public function and class of thing with its signature and first line."""
    import thing

    out = _Output()
    public = [name for name in thing.__all__ if not name.startswith("_")]
    ordered = [name for name in _HELP_ORDER if name in public]
    ordered += sorted(name for name in public if name not in ordered)
    functions, classes, errors = [], [], []
    for name in ordered:
        obj = getattr(thing, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            errors.append((f"thing.{name}", _first_line(obj)))
        elif inspect.isclass(obj):
            methods = [m for m, _ in inspect.getmembers(obj, inspect.isfunction)
                       if not m.startswith("_")]
            line = _first_line(obj) + (f" Methods: {', '.join(methods)}." if methods else "")
            classes.append((f"thing.{name}{_signature(obj)}", line))
        elif callable(obj):
            functions.append((f"thing.{name}{_signature(obj)}", _first_line(obj)))
    out.print(
        out.entries("Functions", functions),
        out.entries("Classes", classes),
        out.entries("Errors", errors),
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


def _first_line(obj: Any) -> str:
    doc = (inspect.getdoc(obj) or "").strip()
    if not doc:
        return ""
    # reStructuredText to plain text: ``code`` -> code, :class:`Name` -> Name.
    return re.sub(r":\w+:`~?([^`]*)`", r"\1", doc.splitlines()[0]).replace("``", "")
