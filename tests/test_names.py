"""Tests of thing.names: capture names traced from the source text of the ``catch`` call.

The tests catch through the small ``Client`` below (or, in subprocesses, a ``catch`` function),
which asks a ``NameTracer`` about its caller's frame as thing's own ``catch`` does, so these
tests depend on nothing else in the library.
"""

from __future__ import annotations

import gc
import importlib.util
import linecache
import os
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest

from thing.names import MAX_FILES, MIN_KEYS, CallSite, NameTracer

NAMES_PY = Path(__file__).resolve().parents[1] / "thing" / "names.py"

# Tests of what only column positions can tell apart: several calls on one line.
needs_columns = pytest.mark.skipif(
    sys.version_info < (3, 11), reason="column positions of instructions are new in 3.11"
)


class Client:
    """Stands in for thing's client: ``catch`` returns the name thing would give the capture."""

    def __init__(self) -> None:
        self.tracer = NameTracer()
        self.sites: list[CallSite] = []  # of every catch, in order
        self.names: list[str] = []

    def catch(self, obj=None, name=None, **options) -> str:
        name, site = self.tracer.name_for(sys._getframe(1))
        self.sites.append(site)
        self.names.append(name)
        return name


@pytest.fixture
def client() -> Client:
    return Client()


def load_module(path: Path, name: str):
    """Import the file at ``path`` as a module named ``name``, outside any package."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fallback_name(function, line_in_function: int) -> str:
    """The name thing gives a catch on ``line_in_function`` (1 = the ``def``) of ``function``."""
    code = function.__code__
    qualified = getattr(code, "co_qualname", code.co_name)
    return f"{qualified}:{code.co_firstlineno + line_in_function - 1}"


def run_python(tmp_path: Path, *args: str) -> list[str]:
    """Run a Python subprocess in which ``names`` is thing/names.py; return its output lines."""
    result = subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,
        env={**os.environ, "NAMES_PY": str(NAMES_PY)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


# Loads thing/names.py by path, so the subprocess needs no working thing/__init__.py.
SUBPROCESS_PRELUDE = """\
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("names", os.environ["NAMES_PY"])
names = importlib.util.module_from_spec(spec)
spec.loader.exec_module(names)
tracer = names.NameTracer()
def catch(value=None):
    return tracer.name_for(sys._getframe(1))[0]
"""


# The name is the source text of the first argument -------------------------------------------


def test_plain_name(client):
    loss = 0.5
    assert client.catch(loss) == "loss"


def test_attribute_chain(client):
    model = SimpleNamespace(lm_head=SimpleNamespace(weight=[1.0]))
    assert client.catch(model.lm_head.weight) == "model.lm_head.weight"


def test_subscript(client):
    h = list(range(5))
    assert client.catch(h[3]) == "h[3]"


def test_expression_with_call(client):
    x = [3.0, 4.0]
    assert client.catch(sum(x)) == "sum(x)"
    assert client.catch(max(x, key=abs) * 2) == "max(x, key=abs) * 2"


def test_function_called_by_any_name(client):
    catch = client.catch
    thing = client
    accuracy = 0.5
    assert catch(accuracy) == "accuracy"
    assert thing.catch(accuracy * 2) == "accuracy * 2"


@needs_columns
def test_a_catch_called_back_by_c_code_gets_a_fallback_name_not_another_calls_text(client):
    """map(), a loop's call_soon and the like call catch from C: the frame above is the code
    that called them, and the first argument of that call is not what was caught (every
    such use was filed under one name: "map(client.catch, learning_rates)",
    "self._callback")."""
    import asyncio
    import functools

    learning_rates = [0.1, 0.2]
    assert list(map(client.catch, learning_rates)) == [fallback_name(
        test_a_catch_called_back_by_c_code_gets_a_fallback_name_not_another_calls_text, 11)] * 2

    async def main() -> None:
        loss = 0.25
        asyncio.get_running_loop().call_soon(client.catch, loss)
        await asyncio.sleep(0)

    asyncio.run(main())
    site = client.sites[-1]
    assert site.function == "Handle._run"  # its fallback name says where catch was called
    assert client.names[-1] == f"Handle._run:{site.line}"
    # Called as what it is, by any name, partial or not: traced.
    grab, weight = functools.partial(client.catch, every=1), 1.0
    assert grab(weight) == "weight"

    class Helper:  # a class of Python code that catches for its caller: traced too
        def __init__(self, value) -> None:
            self.name = client.tracer.name_for(sys._getframe(1))[0]

    assert Helper(weight * 2).name == "weight * 2"


@needs_columns
def test_several_catches_on_one_line(client):
    a, b = 1, 2
    assert (client.catch(a), client.catch(b)) == ("a", "b")
    names = []
    names.append(client.catch(a + 1)); names.append(client.catch(b + 1))  # noqa: E702
    assert names == ["a + 1", "b + 1"]


def test_call_spread_over_several_lines(client):
    spread = 0.5
    name = client.catch(
        spread,
        name=None,
    )
    assert name == "spread"


def test_multiline_argument_is_whitespace_normalised(client):
    x, y = 1, 2
    name = client.catch(
        x +
          y  # comments are not part of the name
    )
    assert name == "x + y"


def test_line_breaks_inside_brackets_and_before_dots_leave_no_space(client):
    values = [2, 1]
    name = client.catch(
        sorted(
            values,
            reverse=True
        )
        .index(1)
    )
    assert name == "sorted(values, reverse=True).index(1)"


def test_whitespace_inside_string_literals_is_kept(client):
    table = {"two  spaces": 1, "k  {x}": 2}
    key = "k"
    assert client.catch(table[  "two  spaces"  ]) == 'table[ "two  spaces" ]'
    assert client.catch(table[f"{key}  {{x}}"]) == 'table[f"{key}  {{x}}"]'


@needs_columns
def test_nested_catches(client):
    x = 1.0
    outer = client.catch(inner := client.catch(x))
    assert (outer, inner) == ("inner := client.catch(x)", "x")


def test_first_argument_given_as_keyword(client):
    given = 0.5
    assert client.catch(every=2, name=None, obj=given) == "given"


def test_keyword_that_carries_the_object_is_configurable():
    tracer = NameTracer(keyword="tensor")

    def catch(tensor=None, obj=None):
        return tracer.name_for(sys._getframe(1))[0]

    weights, grad = 0.5, 0.1
    assert catch(obj=grad, tensor=weights) == "weights"



# Where the call is ----------------------------------------------------------------------------


def test_inside_a_function(client):
    def step(gradient):
        return client.catch(gradient)

    assert step(1.0) == "gradient"
    if sys.version_info >= (3, 11):
        assert client.sites[-1].function == "test_inside_a_function.<locals>.step"


def test_inside_a_method(client):
    class Model:
        scale = 2.0

        def forward(self, h):
            return client.catch(self.scale * h)

    assert Model().forward(3.0) == "self.scale * h"


def test_inside_a_list_comprehension(client):
    layers = [1, 2, 3]
    assert [client.catch(layer) for layer in layers] == ["layer"] * 3


def test_inside_a_lambda(client):
    def name_of(g):
        return client.catch(g.grad)

    traced = (lambda g: client.catch(g.grad))(SimpleNamespace(grad=1.0))
    # A different call site with the same text gets its own name, in the file's order.
    assert traced == "g.grad_1"
    assert name_of(SimpleNamespace(grad=1.0)) == "g.grad"


def test_inside_a_nested_function(client):
    def outer():
        def inner(z):
            return client.catch(z.mean)

        return inner(SimpleNamespace(mean=0.0))

    assert outer() == "z.mean"
    if sys.version_info >= (3, 11):
        expected = "test_inside_a_nested_function.<locals>.outer.<locals>.inner"
        assert client.sites[-1].function == expected


def test_call_site_fields(client):
    value = 0.5
    line = sys._getframe().f_lineno + 1
    name = client.catch(value)
    site = client.sites[-1]
    assert name == "value"
    assert site == CallSite(__file__, line, "test_call_site_fields")
    assert (site.file, site.line, site.function) == tuple(site)


def test_call_site_of_a_multiline_call_is_its_first_line(client):
    line = sys._getframe().f_lineno + 1
    client.catch(
        line,
    )
    assert client.sites[-1].line == line


# Once per variable ---------------------------------------------------------------------------


def test_cache_hit_reads_no_source(client, monkeypatch):
    reads = []
    real_getlines = linecache.getlines

    def counting_getlines(*args):
        reads.append(args[0])
        return real_getlines(*args)

    monkeypatch.setattr(linecache, "getlines", counting_getlines)
    cached = 0.5
    names, reads_after = [], []
    for _ in range(100):
        names.append(client.catch(cached))
        reads_after.append(len(reads))
    assert names == ["cached"] * 100
    assert reads_after[0] >= 1 and set(reads_after) == {reads_after[0]}


def test_cache_hit_survives_source_becoming_unreadable(client, monkeypatch):
    def step(kept):
        return client.catch(kept)

    assert step(0.5) == "kept"

    def unreadable(*args):
        raise AssertionError("a cache hit must not read source")

    monkeypatch.setattr(linecache, "getlines", unreadable)
    assert step(0.5) == "kept"


def test_same_site_is_stable_across_loop_iterations(client):
    stable = 0.5
    names = [client.catch(stable) for _ in range(5)]
    assert names == ["stable"] * 5
    assert len(set(client.sites)) == 1


def test_distinct_sites_get_suffixes_in_the_order_of_their_file(client, tmp_path):
    """Whichever catches first: a rank that validates before it trains, or a DataLoader
    worker forked before the loop's first catch, names each variable as every other
    process of the job does."""
    path = tmp_path / "three_losses.py"
    path.write_text("def a(loss):\n    return client.catch(loss)\n"
                    "def b(loss):\n    return client.catch(loss)\n"
                    "def c(loss):\n    return client.catch(loss)\n")
    module = load_module(path, "three_losses")
    module.client = client
    assert module.b(1) == "loss_1"
    assert module.c(1) == "loss_2"
    assert module.a(1) == "loss"
    assert (module.a(2), module.b(2), module.c(2)) == ("loss", "loss_1", "loss_2")


def test_only_catches_that_trace_take_a_place_in_the_files_order(client, tmp_path):
    """A catch given its name, or in a lambda that is a default argument (defined in the
    enclosing scope): neither may take ``loss`` or ``t`` from the one catch of it that
    traces."""
    path = tmp_path / "named_elsewhere.py"
    path.write_text(textwrap.dedent("""
        def train(loss):
            return client.catch(loss, name="train_loss"), client.catch(loss, "again")

        def register(hook=lambda t: client.catch(t)):
            return hook

        def evaluate(t):
            return [client.catch(value) for value in (t,)]

        def validate(loss):
            return client.catch(loss)
    """))
    module = load_module(path, "named_elsewhere")
    module.client = client
    assert module.validate(2.0) == "loss"  # train()'s catches are named by their caller
    assert module.register()(3.0) == "t"
    assert module.evaluate(4.0) == ["value"]


def test_processes_that_catch_in_another_order_agree_on_the_names(tmp_path):
    (tmp_path / "job.py").write_text(SUBPROCESS_PRELUDE + textwrap.dedent("""
        class Samples:
            def __getitem__(self, index):
                x = float(index)
                return catch(x)

        def validate(loss):
            return catch(loss)

        def train(loss):
            x = loss * 2
            return catch(loss), catch(x)

        if sys.argv[1] == "validate first":
            print(validate(0.0), *train(1.0), Samples()[0])
        else:
            print(Samples()[0], *reversed(train(1.0)), validate(0.0))
    """))
    first = run_python(tmp_path, "job.py", "validate first")[0].split()
    second = run_python(tmp_path, "job.py", "samples first")[0].split()
    assert first == ["loss", "loss_1", "x_1", "x"]
    assert second == ["x", "x_1", "loss_1", "loss"]


@needs_columns
def test_one_expression_twice_on_one_line_is_one_name(client):
    twice = 1
    assert (client.catch(twice), client.catch(twice)) == ("twice", "twice")


def test_one_variable_of_one_function_is_one_name_whatever_its_line(client):
    # The original thing's test_vars: one variable caught on two lines is one history;
    # the same variable name in another function is another one.
    def vars_one():
        obj = "abc"
        first = client.catch(obj)
        obj = 2
        return first, client.catch(obj)

    def vars_two():
        obj = 3.0
        return client.catch(obj)

    assert vars_one() == ("obj", "obj")
    assert vars_two() == "obj_1"
    assert vars_one() == ("obj", "obj")


def test_a_cell_run_again_keeps_its_names(client):
    # Terminal IPython compiles each run of a cell under a new file name; Jupyter under
    # one named after the text. Both run in __main__: one module, so the same names.
    source = "loss = 0.5\nfirst = client.catch(loss)\ndef step():\n    return client.catch(loss)\n"
    names = []
    for run in range(3):
        filename = f"<ipython-input-{run}-0123456789ab>"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        try:
            namespace = {"__name__": "__main__", "client": client}
            exec(compile(source, filename, "exec"), namespace)
            names.append((namespace["first"], namespace["step"]()))
        finally:
            del linecache.cache[filename]
    assert names == [("loss", "loss_1")] * 3


def test_same_text_in_another_file_is_distinct(client, tmp_path):
    source = "def step(elsewhere):\n    return client.catch(elsewhere)\n"
    path = tmp_path / "other_file.py"
    path.write_text(source)
    module = load_module(path, "other_file")
    module.client = client
    elsewhere = 0.5
    assert client.catch(elsewhere) == "elsewhere"
    assert module.step(elsewhere) == "elsewhere_1"


def test_suffixed_names_do_not_collide_with_real_names(client):
    def first(metric):
        return client.catch(metric)

    def second(metric):
        return client.catch(metric)

    metric_1 = 0.5
    assert (first(0), second(0), client.catch(metric_1)) == (
        "metric", "metric_1", "metric_1_1")


def test_recompiled_code_at_the_same_site_keeps_its_name(client):
    # Reloading a module or re-running an unchanged notebook cell makes a new code object.
    source = "def step(loss):\n    return client.catch(loss)\n"
    filename = "<thing-test-recompiled>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        names = []
        for _ in range(2):
            namespace = {"client": client}
            exec(compile(source, filename, "exec"), namespace)
            names.append(namespace["step"](0.5))
    finally:
        del linecache.cache[filename]
    assert names == ["loss", "loss"]


def test_concurrent_first_catches_agree(client):
    barrier = threading.Barrier(8)
    names = []

    def worker():
        barrier.wait()
        names.append(client.catch(barrier))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert names == ["barrier"] * 8


# Source registered in linecache: exec and IPython ---------------------------------------------


def test_exec_with_source_in_linecache(client):
    source = "def step(loss):\n    return client.catch(loss * 2)\n"
    filename = "<thing-test-cell>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        namespace = {"client": client}
        exec(compile(source, filename, "exec"), namespace)
        assert namespace["step"](0.5) == "loss * 2"
    finally:
        del linecache.cache[filename]


@needs_columns
def test_ipython_cell(tmp_path):
    pytest.importorskip("IPython")
    # A cell run by IPython's own machinery, in a subprocess so that no IPython shell is left
    # behind in this one for other tests to find.
    cell = textwrap.dedent(
        """\
        from types import SimpleNamespace

        model = SimpleNamespace(weight=1.0)
        h = [0, 1, 2, 3]
        traced = [catch(model.weight), catch(h[3])]
        traced.append(catch(
            model.weight * 2))
        """
    )
    script = SUBPROCESS_PRELUDE + textwrap.dedent(
        f"""\
        from IPython.testing.globalipapp import start_ipython
        shell = start_ipython()
        shell.user_ns["catch"] = catch
        for run in range(2):  # the same cell run again keeps its names
            shell.run_cell({cell!r}).raise_error()
            for name in shell.user_ns["traced"]:
                print("traced:", name)
        """
    )
    output = run_python(tmp_path, "-c", script)
    traced = [line[len("traced: ") :] for line in output if line.startswith("traced: ")]
    assert traced == ["model.weight", "h[3]", "model.weight * 2"] * 2


# Fallback names -------------------------------------------------------------------------------


def test_exec_without_source_falls_back(client):
    namespace = {"client": client}
    exec("def step(loss):\n    return client.catch(loss)\n", namespace)
    assert namespace["step"](0.5) == "step:2"


def test_python_dash_c_falls_back(tmp_path):
    script = SUBPROCESS_PRELUDE + textwrap.dedent(
        """\
        loss = 0.5
        print(catch(loss))
        def step():
            return catch(loss)
        print(step())
        print(step())
        """
    )
    if sys.version_info >= (3, 13):  # which registers the source of -c in linecache
        expected = ["loss", "loss_1", "loss_1"]
    else:
        expected = ["<module>:9", "step:11", "step:11"]
    assert run_python(tmp_path, "-c", script) == expected


def test_no_column_positions_uses_the_one_catch_on_the_line(tmp_path):
    # -X no_debug_ranges removes column positions, as on Python < 3.11.
    script = SUBPROCESS_PRELUDE + textwrap.dedent(
        """\
        loss = 0.5
        print(catch(loss))
        print(catch(
            loss * 2))
        print(catch(loss), catch(loss))
        print(catch(abs(loss)))
        """
    )
    path = tmp_path / "train.py"
    path.write_text(script)
    output = run_python(tmp_path, "-X", "no_debug_ranges", str(path))
    # Two catches on one line cannot be traced without columns: a fallback name each.
    assert output == ["loss", "loss * 2", "<module>:12 <module>:12_1", "abs(loss)"]


def test_no_argument_falls_back(client):
    def step():
        return client.catch()

    def spread(values):
        return client.catch(*values)

    assert step() == fallback_name(step, 2)
    assert spread([1]) == fallback_name(spread, 2)


def test_fallback_names_tell_call_sites_apart_and_keep_to_their_code(client):
    """Without source, two catches on one line (python -c), or lines typed one by one at
    python -i (each line 1 of its own code), are not one history; the same code run again
    (a line typed again, exec in a loop) keeps its name."""
    def run(source: str) -> list[str]:
        namespace = {"client": client, "a": 1, "b": 2}
        exec(source, namespace)
        return namespace["names"]

    assert run("names = [client.catch(a), client.catch(b)]") == ["<module>:1", "<module>:1_1"]
    assert run("names = [client.catch(a)]") == ["<module>:1_2"]  # other code
    assert run("names = [client.catch(b)]") == ["<module>:1_3"]
    assert run("names = [client.catch(a)]") == ["<module>:1_2"]  # the same code again
    assert run("names = [client.catch(a), client.catch(b)]") == ["<module>:1", "<module>:1_1"]
    assert run("names = [client.catch(a + 1)]") == ["<module>:1_4"]  # its constants differ


def test_a_long_traced_name_is_cut_and_stays_apart_from_others(client):
    first = client.catch([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72])  # noqa: E501
    second = client.catch([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 99])  # noqa: E501
    assert len(first) == len(second) == 256 and first != second
    assert first.startswith("[1, 2, 3,") and first[-9] == "…"


def test_deleted_file_falls_back(client, tmp_path):
    path = tmp_path / "deleted_module.py"
    path.write_text("def step(loss):\n    return client.catch(loss)\n")
    module = load_module(path, "deleted_module")
    module.client = client
    path.unlink()
    linecache.checkcache(str(path))
    assert module.step(0.5) == "step:2"


def test_source_that_no_longer_parses_falls_back(client, tmp_path):
    path = tmp_path / "edited_module.py"
    path.write_text("def step(loss):\n    return client.catch(loss)\n")
    module = load_module(path, "edited_module")
    module.client = client
    path.write_text("def step(:\n    return client.catch((((\n")
    linecache.checkcache(str(path))
    assert module.step(0.5) == "step:2"


@needs_columns
def test_source_edited_since_the_code_was_compiled_is_not_read_for_names(client, tmp_path):
    """Two catch lines swapped in the editor while the job runs: read at the running code's
    positions, the new text would file val_loss's values under val_acc."""
    path = tmp_path / "swapped_module.py"
    path.write_text("def evaluate(val_loss, val_acc):\n"
                    "    return client.catch(val_loss), client.catch(val_acc)\n")
    module = load_module(path, "swapped_module")
    module.client = client
    path.write_text("def evaluate(val_loss, val_acc):\n"
                    "    return client.catch(val_acc), client.catch(val_loss)\n")
    linecache.checkcache(str(path))
    assert module.evaluate(1.0, 0.25) == ("evaluate:2", "evaluate:2_1")


@needs_columns
def test_a_module_reloaded_after_an_edit_is_named_from_its_new_text(client, tmp_path):
    """linecache still holds the text from before the edit, and the code running is the new
    one (importlib.reload, IPython's autoreload): the file is read again."""
    path = tmp_path / "reloaded_module.py"
    path.write_text("def step(loss, acc):\n    return client.catch(loss), client.catch(acc)\n")
    assert linecache.getlines(str(path))  # read before the edit (a traceback, a first catch)
    path.write_text("def step(loss, acc):\n    return client.catch(acc), client.catch(loss)\n")
    edited = path.stat().st_mtime + 10  # as an edit made later is: no faster than the clock
    os.utime(path, (edited, edited))
    module = load_module(path, "reloaded_module")
    module.client = client
    assert module.step(1.0, 0.5) == ("acc", "loss")


@needs_columns
def test_names_the_code_loads_unwritten_or_mangled_are_not_taken_for_an_edit(client):
    class Model:
        def __init__(self) -> None:
            self.__w = 1.0

        def weight(self):
            return client.catch(self.__w)

    class Child(Model):
        def weight(self):
            return client.catch(super().weight())

    assert Model().weight() == "self.__w"
    assert Child().weight() == "super().weight()"


def test_never_raises(client, monkeypatch):
    def broken(*args):
        raise RuntimeError("linecache is broken")

    monkeypatch.setattr(linecache, "getlines", broken)

    def step(loss):
        return client.catch(loss)

    assert step(0.5) == fallback_name(step, 2)


# Bounded bookkeeping ---------------------------------------------------------------------------


def test_the_tracer_keeps_no_code_object_alive(client):
    """A job that compiles code again and again (exec in a loop) must not pin it all."""
    source = "def step(loss):\n    return client.catch(loss)\n"
    filename = "<thing-test-unpinned>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        namespace = {"client": client}
        exec(compile(source, filename, "exec"), namespace)
        assert namespace["step"](0.5) == "loss"
        code = weakref.ref(namespace["step"].__code__)
        del namespace
        gc.collect()
        assert code() is None
    finally:
        del linecache.cache[filename]


def test_the_per_instruction_cache_is_bounded():
    tracer = NameTracer(max_sites=50)
    source = "catch(loss)\n"
    for _ in range(200):  # 200 distinct code objects for one site
        code = compile(source, "<thing-test-bounded>", "exec")
        exec(code, {"catch": lambda value: tracer.name_for(sys._getframe(1)), "loss": 1})
    assert len(tracer._by_instruction) <= 50


def test_generated_code_catching_ever_new_texts_keeps_the_tables_bounded():
    """Code generated anew, each generation registered in linecache with a text of its own
    (templated exec, codegen, a new IPython cell each time): each new text made a key,
    a taken name and a file's reading that were never forgotten (26 MB per 100,000)."""
    tracer = NameTracer(max_sites=50)
    catch = lambda value: tracer.name_for(sys._getframe(1))[0]  # noqa: E731
    names = []
    for generation in range(MIN_KEYS + 300):
        filename = f"<thing-test-generated-{generation}>"
        source = f"def step(x):\n    return catch(x * {generation})\n"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        try:
            namespace = {"catch": catch}
            exec(compile(source, filename, "exec"), namespace)
            names.append(namespace["step"](1))
        finally:
            del linecache.cache[filename]
    assert names[:2] == ["x * 0", "x * 1"] and names[-1] == f"x * {MIN_KEYS + 299}"
    assert len(tracer._by_key) <= MIN_KEYS and len(tracer._taken) <= MIN_KEYS
    assert len(tracer._next_suffix) <= MIN_KEYS
    assert len(tracer._in_file_order) <= MAX_FILES
    assert len(tracer._by_instruction) <= 50
