"""Project-wide rules: import weight, lint, no pickle or eval in the library."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from .conftest import ROOT, run_script


def test_import_thing_imports_no_heavy_modules() -> None:
    out = run_script(
        """
        import sys, thing
        heavy = ("torch", "jax", "rich", "IPython", "ml_dtypes")
        print(" ".join(m for m in heavy if m in sys.modules))
        """
    )
    assert out.strip() == ""


def test_library_never_unpickles_or_evaluates() -> None:
    pattern = re.compile(r"\bimport pickle\b|\bfrom pickle\b|\bpickle\.loads?\(|\beval\(|\bexec\(")
    offenders = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in (ROOT / "thing").rglob("*.py*")
        if path.suffix in (".py", ".pyx", ".pxd")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed")
def test_ruff_clean() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "thing", "tests", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
