"""Names for captures that were not given one, traced from the source text of the call.

``thing.catch(loss)`` is named ``loss``, ``thing.catch(model.lm_head.weight)`` is named
``model.lm_head.weight`` and ``thing.catch(h[3])`` is named ``h[3]``: the name is the source
text of the first positional argument (or, when there is none, of the ``obj=`` keyword
argument), with every run of whitespace and newlines collapsed to one space (none at all
where a line break follows an opening bracket or precedes a closing bracket, ``.`` or ``,``)
and comments dropped. The function called may have any name (``thing.catch``, ``client.catch``,
``catch``...).

On Python 3.11+ the exact call expression is found from the calling instruction's source
positions, so several catches on one line, calls spread over several lines, nested calls,
lambdas and comprehensions are all named correctly. Before 3.11 (or under
``-X no_debug_ranges``) only the line is known; a call is named only when it is the one call of
a function whose name ends in ``catch`` on that line.

Source is read through :mod:`linecache`, which is also where IPython and Jupyter register
the text of their cells.

Fallback rule: when the source is not available (``python -c`` before Python 3.13, ``exec``
of a string, a deleted file, ``python -i``) or cannot be matched to the call, the capture is
named ``<function>:<line>``, after the qualified name of the calling function and the line of
the call, for example ``<module>:3`` or ``Trainer.step:42``. Such a name stands for its call
site, not for an expression: two catches on one line (or every line typed at ``python -i``,
each line 1) are told apart by the code they are in, as ``<module>:1``, ``<module>:1_1``...;
the same code run again keeps its name (past ``max_sites`` names, new sites on one
line share one name again, as code without source made anew at every call would
otherwise make new names for ever).

A traced name longer than ``MAX_TRACED_NAME`` characters (a long literal argument) is cut to
its start, ``…`` and a hash of the whole text, so different texts stay different names.

One variable is one history: a name is keyed by the module (its ``__name__``), the
qualified name of the calling function and the expression, not by the line. The same
expression caught on several lines of one function is one name, and so is a training cell
run again in IPython or Jupyter, whose cells all belong to ``__main__`` (as do ``python -i``
and ``exec`` of a string). The same expression in *another* function gets ``_1``, ``_2``...
appended (``loss``, ``loss_1``, ``loss_2``) in the order the functions come in their file,
whichever catches first, so that every process of a job (ranks, DataLoader workers) names
each variable alike; in another module, in the order they first catch. A key keeps its name
for the life of the process. Past ``max_sites`` keys (at least ``MIN_KEYS``: generated
code catching ever-new texts), a new key is named after its text alone, and not
remembered: the same text in two functions is one name then.
"""

from __future__ import annotations

import ast
import bisect
import functools
import io
import itertools
import keyword
import linecache
import re
import sys
import threading
import tokenize
import types
import weakref
from typing import Any, Callable, NamedTuple, Optional

# Tokens that only lay out the source; dropped when the argument's text is normalised.
_LAYOUT_TOKENS = frozenset(
    {
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    }
)
# The longest traced name; a longer one is cut (a server refuses names past 4 KiB, and a
# table shows a few dozen characters).
MAX_TRACED_NAME = 256
MAX_FILES = 256  # source files whose reading a tracer keeps (see NameTracer._parsed)
# Names a tracer remembers: max_sites, but at least this many (a file's functions that
# catch the same text take their names together, a few dozen keys at once).
MIN_KEYS = 1000
_OPENING = frozenset({"(", "[", "{"})
_CLOSING_OR_JOINING = frozenset({")", "]", "}", ".", ","})
# Python 3.12+ tokenizes f-strings into parts; earlier versions have no such tokens.
_FSTRING_START = getattr(tokenize, "FSTRING_START", None)
_FSTRING_END = getattr(tokenize, "FSTRING_END", None)
# What _argument_at answers for source text that the running code was not compiled from,
# and for a call of something that is not catch (see _calls_catch).
_STALE: Any = object()
_ANOTHER_CALL: Any = object()
_PARSING = threading.Lock()  # see _parse


class CallSite(NamedTuple):
    """Where a capture was made: the file, the line of the call and the calling function."""

    file: str
    line: int
    function: str


class NameTracer:
    """Names captures after the source text of their first argument, one name per variable."""

    def __init__(self, keyword: str = "obj", max_sites: int = 10_000,
                 on_forget: Optional[Callable[[types.CodeType], None]] = None) -> None:
        """``keyword`` is the argument that carries the captured object when not positional.

        ``max_sites`` bounds the per-instruction cache (code compiled again and
        again, as by ``exec`` in a loop, would otherwise grow it forever).
        ``on_forget(code)`` is called (outside the lock) for each code object,
        still alive, that the cache forgets an instruction of, or whose
        instruction it traces to another name: traced again, a site may get
        another name (other globals, edited source), so what remembered the old
        one (the compiled gate's call sites) must forget it too.
        """
        self.keyword = keyword
        self.max_sites = max_sites
        self._on_forget = on_forget
        # (id(code), f_lasti) -> (weak reference to the code, (name, CallSite)). Keyed by id()
        # because hashing a code object hashes its constants (and every nested code
        # object) on each call; the weak reference tells a reused id from the original
        # without keeping any code object (or what it references) alive (the compiled
        # gate keeps those of up to 1024 call sites alive: see thing/_core/_throttles.pyx).
        self._by_instruction: dict[tuple[int, int], tuple[Any, tuple[str, CallSite]]] = {}
        self._sites: dict[tuple[int, int], tuple[CallSite, Any]] = {}  # for name= captures
        # Everything below is touched only when a call site is seen for the first time.
        self._lock = threading.Lock()
        # (module, function, text) -> name; a fallback text's key has the site's code too.
        self._by_key: dict[tuple[Any, ...], str] = {}
        self._taken: set[str] = set()
        self._next_suffix: dict[str, int] = {}
        # filename -> (the lines linecache gave, their text, its parse); for the line-based
        # fallback, which otherwise would parse a whole file for every call site in it.
        # This and the next keep MAX_FILES files, the most recently read (a file is read
        # again if need be: generated code registers a file of its own per generation).
        self._parsed: dict[str, tuple[list[str], str, Optional[ast.Module]]] = {}
        # filename -> (the lines linecache gave, those of them that say "catch", traced
        # text -> the functions whose catch calls have that text in the order they come in
        # the file, once the file was read for it): see _resolve.
        self._in_file_order: dict[str, tuple[list[str], list[str],
                                             Optional[dict[str, list[str]]]]] = {}

    def after_fork(self) -> None:
        """In a forked child: another thread of the parent may have held a lock."""
        global _PARSING
        self._lock = threading.Lock()
        _PARSING = threading.Lock()

    def name_for(self, frame: types.FrameType) -> tuple[str, CallSite]:
        """Return the name and call site of the call that ``frame`` is executing.

        ``frame`` is the frame of the code that called ``catch``. The first call from a site
        reads its source; every later one is a dictionary lookup. Never raises: a site whose
        name cannot be traced gets the ``<function>:<line>`` fallback.
        """
        code = frame.f_code
        cached = self._by_instruction.get((id(code), frame.f_lasti))
        if cached is not None and cached[0]() is code:
            return cached[1]
        return self._resolve(frame)

    def still_names(self, frame: types.FrameType, name: str) -> bool:
        """Whether the cache still gives ``name`` for the instruction ``frame`` is executing
        (another thread may have made it forget since :meth:`name_for` said so)."""
        code = frame.f_code
        cached = self._by_instruction.get((id(code), frame.f_lasti))
        return cached is not None and cached[0]() is code and cached[1][0] == name

    def site_for(self, frame: types.FrameType) -> CallSite:
        """The call site of a capture given its name: cached per instruction, as names are."""
        code = frame.f_code
        key = (id(code), frame.f_lasti)
        cached = self._sites.get(key)
        if cached is not None and cached[1]() is code:
            return cached[0]
        site = call_site(frame)
        with self._lock:
            self._sites[key] = (site, weakref.ref(code))
            while len(self._sites) > self.max_sites:
                del self._sites[next(iter(self._sites))]
        return site

    def _resolve(self, frame: types.FrameType) -> tuple[str, CallSite]:
        code = frame.f_code
        site = call_site(frame)
        try:
            text = self._trace(frame, site)
        except Exception as exc:  # a name is never worth failing a training step for
            _debug("could not trace a capture name (%r); using a fallback", exc)
            text = None
        # Interactive code (IPython and Jupyter cells, python -i, exec of a string) runs in
        # __main__, or in a namespace without a name: one module, so a re-run cell keeps
        # its names.
        key: tuple[Any, ...] = (str(frame.f_globals.get("__name__", "__main__")),
                                site.function, text)
        if text is None:  # one name per call site, told apart by its code's content (while
            # the names made so are few: exec of ever-new code would make ever-new names)
            key = (*key[:2], _fallback_name(site))
            if len(self._by_key) < self.max_sites:
                key += (_code_at(code, frame.f_lasti),)
        # The functions of this file that catch the same text take their names in the order
        # they come in it, whichever catches first: a process (a rank that validates before
        # it trains, a DataLoader worker) must not name another variable after this one.
        alike = ([] if text is None or key in self._by_key else
                 self._functions_catching(code.co_filename, frame.f_globals, text))
        with self._lock:
            remembering = len(self._by_key) < max(self.max_sites, MIN_KEYS)
            for function in alike if remembering else ():
                if (key[0], function, text) not in self._by_key:
                    self._by_key[key[0], function, text] = self._claim(text)
            name = self._by_key.get(key)
            if name is None and remembering:
                name = self._by_key[key] = self._claim(key[2])
            elif name is None:  # past max_sites: not remembered, nor told apart by suffixes
                name = key[2]
            cache = self._by_instruction
            # A stale entry goes to the back; a live one is there only if another thread
            # traced the same instruction just now, maybe in another module's globals.
            replaced = cache.pop((id(code), frame.f_lasti), None)
            cache[id(code), frame.f_lasti] = (weakref.ref(code), (name, site))
            forgotten = ([code] if replaced is not None and replaced[0]() is code
                         and replaced[1][0] != name else [])
            while len(cache) > self.max_sites:
                reference, _ = cache.pop(next(iter(cache)))
                alive = reference()
                if alive is not None:  # a dead code object is remembered nowhere
                    forgotten.append(alive)
        if self._on_forget is not None:
            for gone in forgotten:
                self._on_forget(gone)
        return name, site

    def _claim(self, base: str) -> str:
        """The first free name among ``base``, ``base_1``, ``base_2``...; called under the lock."""
        suffix = self._next_suffix.get(base, 0)
        name = base if suffix == 0 else f"{base}_{suffix}"
        while name in self._taken:
            suffix += 1
            name = f"{base}_{suffix}"
        self._next_suffix[base] = suffix + 1
        self._taken.add(name)
        return name

    def _trace(self, frame: types.FrameType, site: CallSite) -> Optional[str]:
        """The normalised source text of the call's first argument (cut to
        ``MAX_TRACED_NAME``); None if the source does not say."""
        code = frame.f_code
        lines = linecache.getlines(code.co_filename, frame.f_globals)
        positions = _call_positions(code, frame.f_lasti)
        if not lines:
            argument = None
        elif positions is not None:
            argument = _argument_at(lines, positions, self.keyword, frame)
            if argument is None or argument is _STALE:
                # linecache may hold the text from before an edit that the running code was
                # compiled from (a module reloaded): read the file again (if changed), once.
                linecache.checkcache(code.co_filename)
                lines = linecache.getlines(code.co_filename, frame.f_globals)
                argument = _argument_at(lines, positions, self.keyword, frame)
            if argument is _STALE:
                _debug("the source of %s:%s is not the text its code was compiled from "
                       "(edited since?); using a fallback name", site.file, site.line)
                return None
            if argument is _ANOTHER_CALL:
                _debug("catch was called by the callable called at %s:%s (a callback), not "
                       "there: its first argument is not what was caught; using a fallback "
                       "name", site.file, site.line)
                return None
        else:
            argument = self._argument_on_line(code.co_filename, lines, site.line)
        if argument is None:
            why = "no source" if not lines else "no single first argument found in the source"
            _debug("%s for the capture at %s:%s; using a fallback name",
                   why, site.file, site.line)
            return None
        return _cut_to_length(argument)

    def _functions_catching(self, filename: str, module_globals: dict[str, Any], text: str
                            ) -> list[str]:
        """The qualified names of the functions of ``filename`` that catch ``text``, in the
        order they come in the file; [] where the file cannot have two such calls."""
        lines = linecache.getlines(filename, module_globals)
        cached = self._in_file_order.get(filename)
        if cached is None or cached[0] is not lines:
            cached = (lines, [line for line in lines if "catch" in line], None)
        _, saying_catch, order = cached
        if order is None:
            # Read (parsed and walked: 120 ms for 6,000 lines) only for a text that two
            # lines calling a catch hold: most files catch each thing once.
            if sum(text in line for line in saying_catch) < 2:
                order = {}  # not kept: another text of the file may need the file read
            else:
                try:
                    order = _functions_catching(_parse("".join(lines)), lines, self.keyword)
                except (SyntaxError, ValueError, RecursionError):  # first-catch order
                    order = {}
                except Exception as exc:  # CPython 3.11's parser racing another thread's
                    _debug("could not read the catch calls of %s (%r): first-catch order",
                           filename, exc)
                    return []
                cached = (lines, saying_catch, order)
        with self._lock:
            _remember(self._in_file_order, filename, cached)
        return order.get(text, [])

    def _argument_on_line(self, filename: str, lines: list[str], line: int) -> Optional[str]:
        """Best effort without column positions: the one ``...catch(arg)`` call on the line."""
        cached = self._parsed.get(filename)
        # linecache hands out the same list until the file is read again.
        if cached is None or cached[0] is not lines:
            source = "".join(lines)
            try:
                tree: Optional[ast.Module] = _parse(source)
            except (SyntaxError, ValueError):
                tree = None
            cached = (lines, source, tree)
            with self._lock:
                _remember(self._parsed, filename, cached)
        _, source, tree = cached
        if tree is None:
            return None
        found = []
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and node.lineno <= line <= (node.end_lineno or node.lineno)
                and _called_name(node.func).endswith("catch")
            ):
                argument = _first_argument(node, self.keyword)
                if argument is not None:
                    found.append(ast.get_source_segment(source, argument))
        if len(found) == 1 and found[0]:
            return _normalise_whitespace(found[0])
        return None


def _functions_catching(tree: ast.Module, lines: list[str], keyword: str
                        ) -> dict[str, list[str]]:
    """Traced text -> the qualified names (``co_qualname``) of the functions whose calls of
    a ``...catch`` function, not given a ``name``, have that text as first argument, in the
    order of the file.

    A function whose qualified name is worked out wrong here (a ``global`` one nested in
    another) takes a suffix it would not otherwise; a ``catch`` imported under another
    name is not seen at all (first-catch order).
    """
    order: dict[str, list[str]] = {}
    inlined = sys.version_info >= (3, 12)  # comprehensions run in their function's frame
    encoded = [line.encode("utf-8") for line in lines]  # the ast's columns count bytes
    comprehensions = {ast.GeneratorExp: "<genexpr>", ast.ListComp: "<listcomp>",
                      ast.SetComp: "<setcomp>", ast.DictComp: "<dictcomp>"}
    saying_catch = [number for number, line in enumerate(lines, 1) if "catch" in line]

    def visit(nodes: Any, qualname: str, prefix: str) -> None:
        for child in nodes:
            first_line = getattr(child, "lineno", None)
            if first_line is not None:  # only where a line says "catch": a tenth of the walk
                first_line = min([first_line, *(decorator.lineno for decorator in getattr(
                    child, "decorator_list", ()))])
                at = bisect.bisect_left(saying_catch, first_line)
                if at == len(saying_catch) or saying_catch[at] > child.end_lineno:
                    continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                # Decorators, defaults and annotations run where the function is defined.
                arguments = child.args
                visit([*getattr(child, "decorator_list", ()), *arguments.defaults,
                       *filter(None, arguments.kw_defaults)], qualname, prefix)
                inner = prefix + getattr(child, "name", "<lambda>")
                body = child.body if isinstance(child.body, list) else [child.body]
                visit(body, inner, inner + ".<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit([*child.decorator_list, *child.bases, *child.keywords], qualname,
                      prefix)
                visit(child.body, prefix + child.name, prefix + child.name + ".")
            elif type(child) in comprehensions and (
                    not inlined or isinstance(child, ast.GeneratorExp)):
                first, *rest = child.generators
                visit([first.iter], qualname, prefix)  # evaluated where it is written
                inner = prefix + comprehensions[type(child)]
                made = ([child.key, child.value] if isinstance(child, ast.DictComp)
                        else [child.elt])
                visit([first.target, *first.ifs, *rest, *made], inner, inner + ".<locals>.")
            else:
                if (isinstance(child, ast.Call) and _called_name(child.func).endswith("catch")
                        and len(child.args) < 2
                        and not any(k.arg == "name" for k in child.keywords)):
                    argument = _first_argument(child, keyword)
                    text = argument and _text_of(argument, encoded)
                    if text:
                        functions = order.setdefault(
                            _cut_to_length(_normalise_whitespace(text)), [])
                        if qualname not in functions:
                            functions.append(qualname)
                visit(ast.iter_child_nodes(child), qualname, prefix)

    visit(tree.body, "<module>", "")
    return order


def _text_of(node: ast.expr, encoded: list[bytes]) -> str:
    """The source text of ``node``, from the file's lines in UTF-8 (``ast.get_source_segment``
    splits the whole file again at each call)."""
    first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
    if last == first:
        return encoded[first][node.col_offset:node.end_col_offset].decode("utf-8")
    return b"".join([encoded[first][node.col_offset:], *encoded[first + 1:last],
                     encoded[last][:node.end_col_offset]]).decode("utf-8")


def _cut_to_length(text: str) -> str:
    """``text``, or, past ``MAX_TRACED_NAME`` characters, its start, ``…`` and a hash of it
    all, so that different texts stay different names."""
    if len(text) <= MAX_TRACED_NAME:
        return text
    import hashlib  # here: it takes 3 ms of `import thing` (OpenSSL), for a rare name

    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()
    return f"{text[:MAX_TRACED_NAME - 9]}…{digest}"


def identifier_for(name: str) -> str:
    """The Python identifier that stands for a capture name (``thing.ingest_all`` binds it).

    Every run of characters that cannot appear in an identifier becomes one
    ``_`` and leading/trailing ``_`` are stripped (``model.lm_head.weight`` ->
    ``model_lm_head_weight``, ``h[3]`` -> ``h_3``); a result that starts with
    a digit, is a keyword or is empty gets a leading ``_``. ``thing.get``
    accepts it for the name when no other name has the same identifier.
    """
    import unicodedata  # here: only the REPL's side asks, and a job's `import thing` need not

    # NFKC first, as Python reads identifiers ("x²" is typed as "x2", "ﬁle" as "file").
    ident = re.sub(r"\W+", "_", unicodedata.normalize("NFKC", name)).strip("_")
    if not ident.isidentifier() and ident:  # word characters that cannot start one ("①")
        ident = "".join(c if ("_" + c).isidentifier() else "_" for c in ident)
    if not ident or not ident.isidentifier() or keyword.iskeyword(ident):
        ident = "_" + ident
    return ident


def call_site(frame: types.FrameType) -> CallSite:
    """Where ``frame`` is now: its file, the line of the call it is making, its function.

    The line is the first line of the call expression where Python records
    positions (a call spread over several lines starts there).
    """
    code = frame.f_code
    positions = _call_positions(code, frame.f_lasti)
    line = positions[0] if positions is not None else frame.f_lineno or 0
    outer, dot, function = getattr(code, "co_qualname", code.co_name).rpartition(".")
    while function.startswith(_RESUMED) and "_at_" in function:  # see _RESUMED
        function = function[len(_RESUMED):].rpartition("_at_")[0]
    return CallSite(code.co_filename, line, outer + dot + function)


# torch.compile runs what follows a graph break (a catch is one) in a function it makes,
# torch_dynamo_resume_in_<function>_at_<line> (Net.torch_dynamo_resume_in_forward_at_11 for
# a method), whose lines are the user's: the catch is the user's function's, whichever graph
# break came before it.
_RESUMED = "torch_dynamo_resume_in_"


def _parse(source: str, mode: str = "exec") -> Any:
    """``ast.parse``, one thread at a time: CPython 3.11's parser, run by two threads at once,
    can fail ("AST constructor recursion depth mismatch"), and a site would then keep a
    fallback name."""
    with _PARSING:
        return ast.parse(source, mode=mode)


def _remember(files: dict[str, Any], filename: str, reading: Any) -> None:
    """Keep ``reading`` of ``filename`` as the newest, forgetting the oldest past MAX_FILES
    (the caller holds the tracer's lock)."""
    files.pop(filename, None)
    files[filename] = reading
    while len(files) > MAX_FILES:
        del files[next(iter(files))]


def _debug(message: str, *args: Any) -> None:
    """Why a name fell back, for whoever turned on debug logging. Not thing.log's logger:
    this module stands alone (its tests load it by path), and logging loads only here."""
    import logging

    logging.getLogger("thing").debug(message, *args)


def _fallback_name(site: CallSite) -> str:
    return f"{site.function}:{site.line}"


def _code_at(code: types.CodeType, lasti: int) -> int:
    """What tells a call site without source from another on the same line: the content of
    its code (not the object: the same line run again is compiled again) and the call's
    place in it."""
    return hash((code.co_code, code.co_consts, code.co_names, code.co_varnames, lasti))


def _call_positions(code: types.CodeType, lasti: int) -> Optional[tuple[int, int, int, int]]:
    """(line, end_line, column, end_column) of the call being executed, if Python records them."""
    co_positions = getattr(code, "co_positions", None)
    if co_positions is None or lasti < 0:
        return None
    # One entry per 2-byte code unit; f_lasti is a byte offset.
    position = next(itertools.islice(co_positions(), lasti // 2, None), None)
    if position is None or None in position:
        return None
    return position


def _argument_at(
    lines: list[str], positions: tuple[int, int, int, int], keyword: str,
    frame: types.FrameType,
) -> Optional[str]:
    """The first argument's text of the call expression at these positions of ``frame``'s
    code, if it is a call; ``_STALE`` if that text cannot be what the code was compiled
    from, ``_ANOTHER_CALL`` if it is the call of something that then called catch."""
    code = frame.f_code
    line, end_line, column, end_column = positions
    if not 1 <= line <= end_line <= len(lines):
        return None
    # Columns count UTF-8 bytes, as in the ast.
    chunk = [text.encode("utf-8") for text in lines[line - 1 : end_line]]
    if line == end_line:
        chunk[0] = chunk[0][column:end_column]
    else:
        chunk[0] = chunk[0][column:]
        chunk[-1] = chunk[-1][:end_column]
    expression = b"".join(chunk).decode("utf-8")
    try:
        call = _parse(expression, "eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(call, ast.Call):
        return None
    argument = _first_argument(call, keyword)
    if argument is None:
        return None
    # The argument's place in the file: the expression starts at (line, column).
    start = (line + argument.lineno - 1,
             argument.col_offset + (column if argument.lineno == 1 else 0))
    end = (line + (argument.end_lineno or argument.lineno) - 1,
           (argument.end_col_offset or 0) + (column if argument.end_lineno == 1 else 0))
    if not _loads_are_named_in(code, start, end, argument):
        return _STALE
    if not _calls_catch(call.func, frame):
        return _ANOTHER_CALL
    text = ast.get_source_segment(expression, argument)
    return _normalise_whitespace(text) if text else None


def _calls_catch(callee: ast.expr, frame: types.FrameType) -> bool:
    """Whether the call at ``frame``'s instruction, of ``callee``, may be the call of catch
    itself: False only for a callable that cannot be, found without running any code.

    catch called by C code (``map(thing.catch, xs)``, ``loop.call_soon(thing.catch, x)``,
    whose ``Context.run(self._callback, *self._args)`` runs it) has the frame of the code
    that called that C code above it: the first argument of that call is not what was
    caught, and every such use would share its text as a name. C code calls catch so:
    a C function other than catch, or a class C made; Python code would have a frame of
    its own between them (one skipped on purpose with ``_depth`` included).
    """
    try:
        target = _static_value(callee, frame)
        while type(target) is functools.partial:
            target = target.func
        if type(target) is types.MethodType:
            target = target.__func__
        kind = type(target)  # compared by identity, never ==: a metaclass may define that
        if issubclass(kind, type):  # a class: C code if C made it (list, map), as no class
            # in Python is (its __init__ may be a helper that catches with _depth)
            return bool(_TYPE_FLAGS.__get__(target) & _HEAP_TYPE)
        if any(kind is callable_type for callable_type in _C_CALLABLES) or (
                kind.__name__ == "cython_function_or_method"):
            return target.__name__ == "catch"  # thing.catch, a Client's: compiled gates
    except Exception:  # an object that does not let itself be looked at: cannot tell
        pass
    return True


# Callables of C code, whose names can be read without running any code.
_C_CALLABLES = (types.BuiltinFunctionType, types.MethodDescriptorType,
                types.WrapperDescriptorType, types.MethodWrapperType,
                types.ClassMethodDescriptorType)
# A class's flags as type keeps them (no metaclass's attribute of that name), and the one
# that says a class was made by a class statement, not by C.
_TYPE_FLAGS = type.__dict__["__flags__"]
_HEAP_TYPE = 1 << 9
_UNKNOWN: Any = object()


def _locals_kind() -> type:
    return type(sys._getframe().f_locals)


# Namespaces looked into: plain dicts, and a function's locals as 3.13+ gives them (a proxy
# of the frame's), not a class body's mapping, whose __contains__ may be anyone's.
_NAMESPACES = (dict, _locals_kind())


def _static_value(node: ast.expr, frame: types.FrameType) -> Any:
    """What a name or a chain of attributes names in ``frame``, found as
    ``inspect.getattr_static`` finds attributes (no property, no ``__getattr__`` runs);
    ``_UNKNOWN`` for any other expression, or one not found so."""
    if isinstance(node, ast.Name):
        for namespace in (frame.f_locals, frame.f_globals, frame.f_builtins):
            if not any(type(namespace) is kind for kind in _NAMESPACES):
                return _UNKNOWN
            if node.id in namespace:
                return namespace[node.id]
        return _UNKNOWN
    if isinstance(node, ast.Attribute):
        owner = _static_value(node.value, frame)
        if owner is _UNKNOWN:
            return _UNKNOWN
        import inspect  # here: only the first call from each site traces

        found = inspect.getattr_static(owner, node.attr, _UNKNOWN)
        if type(found) is types.MemberDescriptorType and not issubclass(type(owner), type):
            return found.__get__(owner)  # a slot's value (asyncio's Handle keeps its so)
        return found
    return _UNKNOWN


def _loads_are_named_in(code: types.CodeType, start: tuple[int, int], end: tuple[int, int],
                        argument: ast.expr) -> bool:
    """Whether every variable and attribute that ``code`` loads where ``argument``'s text
    lies (from ``start`` to ``end``, as (line, column)) is named in that text.

    The file may have been edited since the code was compiled: its text at the code's
    positions may then be another call (two catch lines swapped), and a name traced from it
    would file one variable's values under another's name. A text that names what the code
    loads there is the text it was compiled from, as far as a name can tell.
    """
    import dis  # here: only the first call from each site traces

    named = {node.id for node in ast.walk(argument) if isinstance(node, ast.Name)}
    named |= {node.attr for node in ast.walk(argument) if isinstance(node, ast.Attribute)}
    if "super" in named and code.co_argcount:  # super() loads the method's first argument
        named.add(code.co_varnames[0])
    private = tuple(name for name in named if name.startswith("__"))
    for instruction in dis.get_instructions(code):
        position = instruction.positions
        if (position is None or None in position or not instruction.opname.startswith("LOAD_")
                or instruction.opname == "LOAD_CONST"):
            continue
        # Starting inside, not lying inside: edited text may be shorter than the code's. A
        # load that starts before is of the call or the statement around it.
        if not start <= (position.lineno, position.col_offset) < end:
            continue
        loaded = instruction.argval
        for name in loaded if isinstance(loaded, tuple) else (loaded,):
            if not isinstance(name, str) or not name.isidentifier() or name in named:
                continue
            # super() loads __class__ unwritten; a class's private names are mangled.
            if name != "__class__" and not any(map(name.endswith, private)):
                return False
    return True


def _first_argument(call: ast.Call, keyword: str) -> Optional[ast.expr]:
    """The first positional argument, else the one passed as ``keyword=``."""
    if call.args:
        # catch(*tensors) has no one expression to be named after.
        return None if isinstance(call.args[0], ast.Starred) else call.args[0]
    return next((k.value for k in call.keywords if k.arg == keyword), None)


def _called_name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def _normalise_whitespace(text: str) -> str:
    """``x +  # why\\n    y`` -> ``x + y``: one space between tokens that had any, no comments.

    Works on tokens, so string literals (f-strings included) are kept exactly as written.
    """
    if "#" not in text and not any(character.isspace() for character in text):
        return text  # nothing to collapse or drop: most names (``loss``, ``h[3]``)
    # The parentheses make a multi-line expression one logical line, as it was in the call.
    wrapped = f"({text})"
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(wrapped).readline))
    except (tokenize.TokenError, SyntaxError):
        return " ".join(text.split())
    line_starts = list(itertools.accumulate((len(line) + 1 for line in wrapped.split("\n")),
                                            initial=0))
    # Spans are cut from the text rather than taken from token.string because Python 3.12+
    # splits an f-string into many tokens whose strings do not always match its source.
    spans: list[list[int]] = []
    fstring_depth = 0
    for token in tokens:
        if token.type in _LAYOUT_TOKENS:
            continue
        start = line_starts[token.start[0] - 1] + token.start[1]
        end = line_starts[token.end[0] - 1] + token.end[1]
        if fstring_depth:
            spans[-1][1] = end
        else:
            spans.append([start, end])
        fstring_depth += (token.type == _FSTRING_START) - (token.type == _FSTRING_END)
    parts: list[str] = []
    previous = ""
    previous_end = None
    for start, end in spans[1:-1]:  # without the added parentheses
        token = wrapped[start:end]
        gap = wrapped[previous_end:start] if previous_end is not None else ""
        # A line break inside brackets or before ``.method()`` is layout, not spacing:
        # "torch.cat(\n    [a, b]\n)" reads best as "torch.cat([a, b])".
        if gap and not (
            "\n" in gap and (previous in _OPENING or token in _CLOSING_OR_JOINING)
        ):
            parts.append(" ")
        parts.append(token)
        previous, previous_end = token, end
    return "".join(parts) or " ".join(text.split())
