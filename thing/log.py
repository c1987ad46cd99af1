"""The ``thing`` logger, made on first use.

``import logging`` is about 3 ms, close to half of ``import thing`` in a training job
that imports nothing else that logs (numpy does not). The client path logs only when
something goes wrong, so the logger (and the module) are made then.
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable
from typing import Any

# logging's levels, named here so that choosing one does not import logging
INFO, WARNING, ERROR = 20, 30, 40


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

    def ready(self) -> None:
        """Make the logger now, on this thread: a thread that would import ``logging`` by
        its first message leaves a child forked meanwhile (a DataLoader worker) with
        ``logging`` half imported for good, the child's own code's logging too."""
        self.__getattr__("log")


log: Any = _Logger()


class LogOnce:
    """Logs a message of each kind (its ``key``) once, or once every ``per`` seconds;
    the repeats go to debug. A job that loses its server every second, or a peer that
    misbehaves on every connection, would otherwise fill the log.

    At most ``MAX_KEYS`` keys are remembered; past that the memory starts over, so that
    keys made of names or addresses cannot grow it without bound and a new kind of
    message is never kept quiet.
    """

    MAX_KEYS = 1000

    def __init__(self, per: float = math.inf):
        self.per = per
        self._logged_at: dict[Hashable, float] = {}

    def __call__(self, key: Hashable, level: int, message: str, *args: Any,
                 exc_info: bool = False) -> None:
        now = time.monotonic()
        logged_at = self._logged_at.get(key)
        if logged_at is not None and now - logged_at < self.per:
            log.debug(message, *args, exc_info=exc_info)
            return
        if len(self._logged_at) >= self.MAX_KEYS:
            self._logged_at.clear()
        self._logged_at[key] = now
        log.log(level, message, *args, exc_info=exc_info)
