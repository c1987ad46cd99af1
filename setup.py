"""Build script for the compiled core; everything else is in pyproject.toml."""

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
    """``thing._core.<name>``, told the digest of its source (thing/_core/_build.pxd)."""
    source = f"thing/_core/{name}.pyx"
    with open(source, "rb") as text:
        digest = f"{zlib.crc32(text.read()):08x}"
    return Extension(f"thing._core.{name}", [source],
                     define_macros=[*macros, ("THING_SOURCE_DIGEST", f'"{digest}"')])


setup(
    ext_modules=cythonize([extension("_transport"), extension("_throttles")],
                          compiler_directives=directives),
)
