"""The ``thing`` logger, made on first use.

``import logging`` is about 3 ms, close to half of ``import thing`` in a training job
that imports nothing else that logs (numpy does not). The client path logs only when
something goes wrong, so the logger (and the module) are made then.
"""

from __future__ import annotations

from typing import Any


class _Logger:
    """Stands for ``logging.getLogger("thing")``: the first use of each method looks it up,
    and it is kept, so that later calls cost what the logger's own do."""

    def __getattr__(self, name: str) -> Any:
        import logging

        logger = logging.getLogger("thing")
        if not any(isinstance(handler, logging.NullHandler) for handler in logger.handlers):
            # A library stays quiet unless the application configured logging.
            logger.addHandler(logging.NullHandler())
        value = getattr(logger, name)
        setattr(self, name, value)
        return value


log: Any = _Logger()
