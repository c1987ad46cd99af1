"""How the REPL functions show what they report: text that fits, HTML in notebooks.

A report (the summary, a capture's description, help) is built once as plain
data, :class:`Table`, :class:`Fields` and :class:`Entries` inside a
:class:`Report`, and rendered two ways:

- as plain text fitted to a width: a terminal's, 80 columns when piped, and
  the text/plain copy a notebook keeps. No ANSI codes, and no cell is ever
  wrapped onto a second line: a table too wide for its width first shortens
  and drops its lesser columns, then shortens long names from the middle
  (``model.transformer…attn.weight``), so a name stays one readable line.
- as HTML, escaped (names come from peers), for Jupyter.

:func:`show` picks: a notebook gets both (it displays the HTML), anything else
the text. Nothing here imports more than the standard library.
"""

from __future__ import annotations

import cmath
import html
import shutil
import sys
import unicodedata
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Union

GAP = "  "  # between columns
NOTEBOOK_TEXT_WIDTH = 120  # for a notebook's text/plain copy, which has no width of its own


def counted(count: int, noun: str, plural: str | None = None) -> str:
    """``count`` and ``noun``, plural unless it is one: "1 segment", "3 segments"."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def terminal_width() -> int:
    """The width to fit text to: the terminal's, ``COLUMNS`` if set, else 80 (piped output)."""
    return max(shutil.get_terminal_size((80, 24)).columns, 20)


def columns(text: str) -> int:
    """The terminal columns ``text`` takes: two for a wide character (CJK, most emoji), none
    for a combining mark or an invisible format character, one for any other."""
    if text.isascii():
        return len(text)
    return sum(map(_columns_of, text))


def _columns_of(char: str) -> int:
    if unicodedata.category(char) in ("Mn", "Me", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def elide(text: str, width: int, keep: str = "end") -> str:
    """``text`` cut to ``width`` columns with ``…``: keeping its start (``keep="end"``
    cuts the end) or both its ends (``keep="middle"`` cuts the middle). ``keep="number"``
    writes a number in fewer significant digits instead (other text is cut at its end)."""
    if columns(text) <= width:
        return text
    if keep == "number":
        shorter = _fewer_digits(text, width)
        if shorter is not None:
            return shorter
    if width <= 1:
        return "…"[:width]
    if keep == "middle":
        tail = (width - 1) // 2
        return _start(text, width - 1 - tail) + "…" + _start(text[::-1], tail)[::-1]
    return _start(text, width - 1) + "…"


def _fewer_digits(text: str, width: int) -> str | None:
    """The number ``text`` in as many significant digits as fit in ``width`` columns, None if
    it is no number or not even one digit fits: cut like text, ``2.99817e-05`` read as
    ``2.99817…`` and ``-9223372036854775808`` as ``-922337…``."""
    bare = text.strip("()")  # numpy writes a complex64 (1+2j)
    try:
        value: float | complex | Decimal = complex(bare) if bare.endswith("j") else float(bare)
    except ValueError:
        return None
    if not cmath.isfinite(value) and "inf" not in bare.lower() and "nan" not in bare.lower():
        if isinstance(value, complex):  # a part past float64: cut as text
            return None
        value = Decimal(bare)  # an int past float64 (10**400), which float() makes inf
    for digits in range(6, 0, -1):
        shorter = format(value, f".{digits}g")
        if len(shorter) <= width:
            return shorter
    return None


def _start(text: str, width: int) -> str:
    """The longest start of ``text`` that takes at most ``width`` columns."""
    if text.isascii():
        return text[:width]
    used = 0
    for index, char in enumerate(text):
        used += _columns_of(char)
        if used > width:
            return text[:index]
    return text


def wrap(text: str, width: int, indent: str = "", first: str | None = None) -> list[str]:
    """``text`` in lines of at most ``width`` columns (wide characters count two), broken
    at spaces: the first line begins with ``first`` (default ``indent``), the others with
    ``indent``. A word too long for a line of its own is broken across lines, with no
    character dropped (a name to type again, a path)."""
    line = indent if first is None else first
    used, fresh = columns(line), True  # fresh: nothing on the line yet but its indent
    lines: list[str] = []
    for word in _words(text, width - max(used, columns(indent))):
        wide = columns(word)
        if not fresh and used + 1 + wide > width:
            lines.append(line)
            line, used, fresh = indent, columns(indent), True
        if not fresh:
            line, used = f"{line} {word}", used + 1 + wide
            continue
        while wide > max(width - used, 1):  # too long for the line: its start fills it
            piece = _start(word, max(width - used, 1)) or word[0]
            lines.append(line + piece)
            word = word[len(piece):]
            wide = columns(word)
            line, used = indent, columns(indent)
        if word:
            line, used, fresh = line + word, used + wide, False
    if not fresh or not lines:
        lines.append(line)
    return lines


# Units that stay on the line of the number before them: "2.0 GiB", "12 s", never apart.
UNITS = frozenset({"B", "KiB", "MiB", "GiB", "TiB", "ns", "µs", "ms", "s", "min", "h", "%"})


def _words(text: str, room: int) -> list[str]:
    """The words ``text`` is broken at, a unit held to its number where both fit in
    ``room`` columns (else a line too narrow for them would break the unit itself)."""
    words: list[str] = []
    for word in text.split():
        if (words and words[-1][-1].isdigit() and word.rstrip(",;:.)") in UNITS
                and columns(words[-1]) + 1 + columns(word) <= room):
            words[-1] += " " + word
        else:
            words.append(word)
    return words


def _padded(text: str, width: int) -> str:
    return text + " " * (width - columns(text))


@dataclass
class Column:
    """A table column: ``min_width`` is how far it may be shortened (None: never), and
    ``elide`` which part of a long cell is cut (``"middle"`` for names, else ``"end"``;
    ``"number"`` writes numbers in fewer digits, see :func:`elide`)."""

    header: str
    min_width: int | None = None
    elide: str = "end"


@dataclass
class Table:
    """Rows of text cells under headers, a title above and notes below.

    ``give_way`` says, in order, what happens while the table is wider than its
    width: ``("shrink", header)`` shortens a column towards its ``min_width``,
    ``("drop", header)`` leaves a column out.
    """

    title: str | None
    columns: list[Column]
    rows: list[list[str]]
    notes: list[str] = field(default_factory=list)
    give_way: list[tuple[str, str]] = field(default_factory=list)

    def text(self, width: int) -> str:
        """The table as lines of at most ``width`` characters (notes wrap; cells never do)."""
        shown, widths = self._fit(width)
        lines = wrap(self.title, width) if self.title else []
        if self.rows:
            def line(cells: list[str]) -> str:
                return GAP.join(_padded(elide(cells[i], widths[i], self.columns[i].elide),
                                        widths[i]) for i in shown).rstrip()

            lines.append(line([column.header for column in self.columns]))
            lines.append(GAP.join("─" * widths[i] for i in shown))
            lines += [line(row) for row in self.rows]
        lines += _wrapped(self.notes, width)
        return "\n".join(lines)

    def _fit(self, width: int) -> tuple[list[int], dict[int, int]]:
        """The columns shown and their widths, after giving way as far as needed."""
        index = {column.header: i for i, column in enumerate(self.columns)}
        shown = list(range(len(self.columns)))
        widths = {i: max([columns(self.columns[i].header), *(columns(row[i]) for row in self.rows)])
                  for i in shown}
        for action, header in self.give_way:
            excess = sum(widths[i] for i in shown) + len(GAP) * (len(shown) - 1) - width
            i = index.get(header)
            if excess <= 0:
                break
            if i is None or i not in shown:
                continue
            if action == "drop":
                shown.remove(i)
            else:
                floor = self.columns[i].min_width or widths[i]
                widths[i] = max(widths[i] - excess, min(floor, widths[i]))
        return shown, widths

    def html(self) -> str:
        """The whole table, every cell escaped."""
        parts = ['<table style="text-align:left">']
        if self.title:
            parts.append(f'<caption style="text-align:left"><b>{_esc(self.title)}</b></caption>')
        if self.rows:
            parts.append("<thead><tr>" + "".join(
                f'<th style="text-align:left">{_esc(c.header)}</th>' for c in self.columns)
                + "</tr></thead><tbody>")
            parts += ["<tr>" + "".join(f'<td style="text-align:left">{_esc(cell)}</td>'
                                       for cell in row) + "</tr>" for row in self.rows]
            parts.append("</tbody>")
        parts.append("</table>")
        parts += [f"<div>{_esc(note)}</div>" for note in self.notes]
        return "".join(parts)


@dataclass
class Fields:
    """``label  value`` lines under a title; long values wrap under themselves."""

    title: str | None
    pairs: list[tuple[str, str]]

    def text(self, width: int) -> str:
        """``label  value`` lines, values wrapped at ``width`` under themselves."""
        labels = max((len(label) for label, _ in self.pairs), default=0)
        lines = wrap(self.title, width) if self.title else []
        indent = " " * (labels + len(GAP))
        for label, value in self.pairs:
            lines += wrap(value or "-", max(width, labels + 20), indent,
                          label.ljust(labels) + GAP)
        return "\n".join(lines)

    def html(self) -> str:
        """A two-column HTML table, escaped."""
        rows = "".join(f'<tr><th style="text-align:left">{_esc(label)}</th>'
                       f'<td style="text-align:left">{_esc(value)}</td></tr>'
                       for label, value in self.pairs)
        title = f"<b>{_esc(self.title)}</b>" if self.title else ""
        return f"{title}<table>{rows}</table>"


@dataclass
class Entries:
    """A titled list of headings, each with its line indented below it (help's layout)."""

    title: str
    entries: list[tuple[str, str]]

    def text(self, width: int) -> str:
        """Each heading (a long one broken at its spaces, after commas in a signature),
        then its line wrapped and indented below it."""
        width = max(width, 30)
        lines = wrap(self.title, width)
        for heading, line in self.entries:
            lines += wrap(heading, width, " " * 8, "")
            lines += wrap(line, width, " " * 4)
        return "\n".join(lines) + "\n"

    def html(self) -> str:
        """A definition list, escaped."""
        items = "".join(f"<dt><code>{_esc(heading)}</code></dt><dd>{_esc(line)}</dd>"
                        for heading, line in self.entries)
        return f"<b>{_esc(self.title)}</b><dl>{items}</dl>"


Part = Union[Table, Fields, Entries, str]


class Report:
    """What a REPL function shows: parts rendered as fitted text, or as HTML in a notebook.

    Echoed in a REPL (``repr``), printed in IPython, or displayed in Jupyter,
    it shows itself the right way in each.
    """

    def __init__(self, *parts: Part):
        self.parts = [part for part in parts if part]

    def text(self, width: int | None = None) -> str:
        """Plain text, no ANSI codes, fitted to ``width`` (default: the terminal's)."""
        width = terminal_width() if width is None else width
        return "\n\n".join((_fitted(part, width) if isinstance(part, str)
                            else part.text(width)).rstrip("\n") for part in self.parts)

    def html(self) -> str:
        """An escaped HTML fragment, for notebooks."""
        return '<div class="thing-report">' + "".join(
            f"<div>{_esc(part)}</div>" if isinstance(part, str) else part.html()
            for part in self.parts) + "</div>"

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.text(NOTEBOOK_TEXT_WIDTH if in_notebook() else None))

    def _repr_html_(self) -> str:
        return self.html()


def show(report: Report) -> None:
    """Show ``report``: displayed (HTML, with a text/plain copy) in a notebook, else printed."""
    if in_notebook():
        from IPython.display import display

        display(report)
    else:
        _print(report.text())


def say(line: str) -> None:
    """Print a line for the REPL's user now, wrapped to the terminal's width (flushed:
    live views print as things arrive)."""
    _print(_fitted(line, terminal_width()))


def print_drawing(text: str) -> None:
    """Print ``text`` as it was drawn, to its own width and with its colours (a plot)."""
    _print(text)


def _print(text: str) -> None:
    """Print ``text`` flushed; on an output that cannot encode a character of it (a Latin-1
    terminal and a table's ─ or a plot's braille), with that character replaced."""
    try:
        print(text, flush=True)
    except UnicodeEncodeError:
        encoding = getattr(sys.stdout, "encoding", None) or "ascii"
        print(text.encode(encoding, "replace").decode(encoding), flush=True)


_said: set[str] = set()


def say_once(line: str) -> None:
    """:func:`say` a line the first time it is said in this session only (a hint that an
    optional package would do better)."""
    if line not in _said:
        _said.add(line)
        say(line)


def in_notebook() -> bool:
    """True inside a Jupyter kernel (where output is displayed, not written to a terminal)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def _wrapped(lines: list[str], width: int) -> list[str]:
    return [wrapped for line in lines for wrapped in wrap(line, max(width, 20))]


def _fitted(text: str, width: int) -> str:
    """``text``'s lines as they are where they fit (a drawing keeps its spacing), else
    wrapped."""
    return "\n".join(line if columns(line) <= width else "\n".join(wrap(line, width))
                     for line in text.split("\n"))
