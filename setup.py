"""Build script for the compiled core; everything else is in pyproject.toml."""

import glob
import os
import zlib

from Cython.Build import cythonize
from setuptools import Extension, setup

directives = {"language_level": "3", "boundscheck": False, "wraparound": False}
macros = []
if os.environ.get("THING_DEBUG_BUILD"):
    directives.update(linetrace=True, boundscheck=True)
    macros.append(("CYTHON_TRACE", "1"))  # the directive alone compiles the tracing out



def extension(name: str) -> Extension:
    """``thing._core.<name>``, told the digest of its source (thing/_core/_build.pxd): its
    .pyx, and the .pxd files it may cimport, in the order thing/_core/__init__.py reads them."""
    source = f"thing/_core/{name}.pyx"
    digest = 0
    for path in [source, *sorted(glob.glob("thing/_core/*.pxd"))]:
        with open(path, "rb") as text:
            digest = zlib.crc32(text.read(), digest)
    return Extension(f"thing._core.{name}", [source],
                     define_macros=[*macros, ("THING_SOURCE_DIGEST", f'"{digest:08x}"')])


setup(
    ext_modules=cythonize([extension("_transport"), extension("_throttles"), extension("_gate")],
                          compiler_directives=directives),
)
