"""Build script for the compiled core; everything else is in pyproject.toml."""

import os

from Cython.Build import cythonize
from setuptools import Extension, setup

directives = {"language_level": "3", "boundscheck": False, "wraparound": False}
if os.environ.get("THING_DEBUG_BUILD"):
    directives.update(linetrace=True, boundscheck=True)

setup(
    ext_modules=cythonize(
        [Extension("thing._core._transport", ["thing/_core/_transport.pyx"]),
         Extension("thing._core._throttles", ["thing/_core/_throttles.pyx"])],
        compiler_directives=directives,
    ),
)
