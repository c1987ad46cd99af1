"""The package as a user installs it: a platform wheel with the compiled core, in a fresh venv.

The wheel is built from a copy of the checkout (so the build leaves nothing in
it), installed into a new virtual environment, and exercised from a directory
outside the repository with no PYTHONPATH: a server and a client, both that
venv's python, must round-trip a capture through the compiled core.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.timeout(300)

# What a clean checkout would not contain (see .gitignore), plus what the build does not need.
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", "*.so", "_transport.c",
    ".pytest_cache", ".ruff_cache", ".hypothesis", ".benchmarks", "results", ".venv", "venv",
)


def _run(command: list[str], cwd: Path, env: dict[str, str], timeout: float = 240) -> str:
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _clean_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "THING_PUREPYTHON", "THING_PORT", "THING_SERVER")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip wheel .`` of a copy of this checkout."""
    work = tmp_path_factory.mktemp("packaging")
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCE)
    command = [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-w", str(work / "wheels")]
    if all(importlib.util.find_spec(name) for name in ("Cython", "setuptools", "wheel")):
        # The build requirements are here already: build with them, quickly and offline.
        command.append("--no-build-isolation")
    _run(command, cwd=source, env=_clean_env())
    (built,) = (work / "wheels").glob("thing-*.whl")
    return built


def test_wheel_is_a_platform_wheel_with_the_compiled_core(wheel: Path) -> None:
    assert not wheel.name.endswith("-none-any.whl"), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    compiled = [n for n in names if n.startswith("thing/_core/_transport") and
                n.endswith((".so", ".pyd"))]
    assert len(compiled) == 1, names
    assert "thing/_core/fallback.py" in names
    assert "thing/wire.py" in names and "thing/__init__.py" in names
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in names), names
    assert not any(n.endswith(".c") for n in names), names  # Cython's output: 1.5 MB of it
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names


def test_the_source_distribution_holds_what_builds_and_checks_it(tmp_path: Path) -> None:
    """Its tests collected 30 errors (no conftest.py, no corpus) and README's links to docs/
    led nowhere."""
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=_NOT_SOURCE)
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", str(tmp_path)],
         cwd=source, env=_clean_env())
    (sdist,) = tmp_path.glob("thing-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    for needed in ("LICENSE", "setup.py", "pyproject.toml", "thing/_core/_transport.pyx",
                   "docs/FORMAT.md", "docs/PROTOCOL.md", "tests/__init__.py",
                   "tests/conftest.py"):
        assert needed in names, needed
    assert any(name.startswith("tests/corpus/") for name in names)
    assert not any("__pycache__" in name or name.endswith(".so") for name in names)


SERVER = """
import json, sys, thing
import numpy as np
with thing.Server(port=0) as server:
    print(server.port, flush=True)
    received = server.store.wait("from-the-wheel", timeout=60)
    value = received.value
    print(json.dumps({
        "ok": bool(np.array_equal(value["array"], np.arange(1000, dtype=np.float64) / 7)),
        "text": value["text"],
        "backend": thing.BACKEND,
        "thing": thing.__file__,
        "core": sys.modules["thing._core._transport"].__file__,
    }), flush=True)
    sys.stdin.readline()  # stay up until the client has its acknowledgement
"""

CLIENT = """
import json, sys, thing
import numpy as np
value = {"array": np.arange(1000, dtype=np.float64) / 7, "text": "ünïcode"}
delivered = thing.catch(value, name="from-the-wheel").wait(60)
print(json.dumps({"delivered": delivered, "backend": thing.BACKEND, "thing": thing.__file__,
                  "core": sys.modules["thing._core._transport"].__file__}))
"""


def test_wheel_installs_into_a_fresh_venv_and_round_trips(wheel: Path, tmp_path: Path) -> None:
    env = _clean_env()
    venv = tmp_path / "venv"
    # System site-packages only for numpy (and pip's own wheel support): offline and quick.
    _run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], cwd=tmp_path, env=env)
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed",
          str(wheel)], cwd=tmp_path, env=env)
    outside = tmp_path / "elsewhere"  # not the repository, not the venv
    outside.mkdir()
    server = subprocess.Popen([python, "-c", textwrap.dedent(SERVER)], cwd=outside, env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        assert port.isdigit(), server.communicate(timeout=30)[1]
        client_env = {**env, "THING_SERVER": "127.0.0.1", "THING_PORT": port}
        client = json.loads(_run([python, "-c", textwrap.dedent(CLIENT)], cwd=outside,
                                 env=client_env, timeout=90))
        out, err = server.communicate("done\n", timeout=90)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert server.returncode == 0, err
    served = json.loads(out)
    assert client["delivered"] is True
    assert served["ok"] is True and served["text"] == "ünïcode"
    site = venv.resolve()
    for side in (client, served):
        assert side["backend"] == "compiled"
        assert Path(side["thing"]).resolve().is_relative_to(site), side["thing"]
        assert Path(side["core"]).resolve().is_relative_to(site), side["core"]
        assert not Path(side["thing"]).resolve().is_relative_to(ROOT.resolve())


def _import_from_a_source_tree(tmp_path: Path, old_build: dict[str, str] | None = None
                               ) -> subprocess.CompletedProcess:
    """``import thing`` in a copy of the source tree with no build in it (or ``old_build``,
    compiled module name -> its source, in its place), Python started there: which core it
    chose, and its log."""
    shutil.copytree(ROOT / "thing", tmp_path / "thing",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for module, source in (old_build or {}).items():
        (tmp_path / "thing" / "_core" / f"{module}.py").write_text(source)
    result = subprocess.run([sys.executable, "-c", "import thing; print(thing.BACKEND)"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=60,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert result.returncode == 0 and result.stdout.strip() == "python"
    assert f"python -m pip install -e {tmp_path}" in result.stderr
    return result


def test_an_unbuilt_source_tree_says_how_to_build_it(tmp_path) -> None:
    result = _import_from_a_source_tree(tmp_path)
    assert "compiled core is not built" in result.stderr


def test_a_build_older_than_the_source_falls_back_to_the_twin(tmp_path) -> None:
    """An extension built before the source gained a mover (left in place by a checkout of
    newer code) is not used half-way: the twin runs, and the warning says to rebuild."""
    result = _import_from_a_source_tree(tmp_path, {
        "_transport": "from .fallback import recv_buffers, send_buffers  # the rest is missing\n",
        "_throttles": "from .throttles import Throttle, Throttles\n",
        "_gate": "from .gate import gated\n"})
    assert "older than the source: it lacks MAX_DESCRIPTORS" in result.stderr


def test_a_build_from_before_the_gate_falls_back_to_the_twin(tmp_path) -> None:
    """A build made before ``_throttles`` existed has a whole ``_transport`` and nothing else."""
    result = _import_from_a_source_tree(tmp_path, {"_transport": "from .fallback import *\n"})
    assert "compiled core is not built for this source" in result.stderr
    assert "_throttles" in result.stderr


def test_a_build_of_an_earlier_text_of_the_source_falls_back_to_the_twin(tmp_path) -> None:
    """A .pyx edited and not rebuilt (an editable install) ran the old compiled code without
    a word: only a build that lacked a name was noticed."""
    shutil.copytree(ROOT / "thing", tmp_path / "thing",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    assert list((tmp_path / "thing" / "_core").glob("_transport*.so")), "not built in place"

    def backend() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", "import thing; print(thing.BACKEND)"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60,
                              env={k: v for k, v in os.environ.items()
                                   if k not in ("PYTHONPATH", "THING_PUREPYTHON")})

    built = backend()
    assert built.stdout.strip() == "compiled" and "not built" not in built.stderr
    with open(tmp_path / "thing" / "_core" / "_transport.pyx", "a") as source:
        source.write("# edited since the build\n")
    edited = backend()
    assert edited.returncode == 0 and edited.stdout.strip() == "python"
    assert "_transport.pyx changed since it was built" in edited.stderr
    assert f"python -m pip install -e {tmp_path}" in edited.stderr
