"""The ``thing`` logger, made on first use, and :class:`LogOnce`.

``import logging`` is about 3 ms, close to half of ``import thing`` in a training job
that imports nothing else that logs (numpy does not). So ``import thing`` does not
import it: the logger (and the module) are made when a job opens its first connection
(:meth:`_Logger.ready`, on the thread that opens it), or when something logs first.
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
    """Logs a message of each kind (its ``key``) once, or once every ``per`` seconds, and
    says nothing of the repeats: a job that loses its server every second, or a catch
    that fails at every step, would otherwise fill the log (and pay for each record).

    At most ``MAX_KEYS`` kinds are remembered, those whose ``per`` has run out forgotten
    first: keys made of names or addresses can grow neither the memory nor the log
    without bound. While that many are remembered, a new kind goes to debug.
    """

    MAX_KEYS = 1000

    def __init__(self, per: float = math.inf):
        self.per = per
        self._logged_at: dict[Hashable, float] = {}  # oldest first

    def __call__(self, key: Hashable, level: int, message: str, *args: Any,
                 exc_info: bool = False) -> None:
        now = time.monotonic()
        logged = self._logged_at
        logged_at = logged.get(key)
        if logged_at is not None:
            if now - logged_at < self.per:
                return
            del logged[key]  # logged again below, as the newest
        while logged and now - next(iter(logged.values())) >= self.per:
            del logged[next(iter(logged))]
        if len(logged) >= self.MAX_KEYS:
            log.debug(message, *args, exc_info=exc_info)
            return
        logged[key] = now
        log.log(level, message, *args, exc_info=exc_info)
