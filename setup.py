"""Build script for the compiled core; everything else is in pyproject.toml."""

import os

from Cython.Build import cythonize
from setuptools import Extension, setup

directives = {"language_level": "3", "boundscheck": False, "wraparound": False}
macros = []
if os.environ.get("THING_DEBUG_BUILD"):
    directives.update(linetrace=True, boundscheck=True)
    macros.append(("CYTHON_TRACE", "1"))  # the directive alone compiles the tracing out

setup(
    ext_modules=cythonize(
        [Extension("thing._core._transport", ["thing/_core/_transport.pyx"],
                   define_macros=macros),
         Extension("thing._core._throttles", ["thing/_core/_throttles.pyx"],
                   define_macros=macros)],
        compiler_directives=directives,
    ),
)
