"""The pure-Python twin of ``_gate.pyx``: no gate.

``gated(catch, ...)`` returns ``catch`` itself, which answers every call,
throttled or sent, in Python: the compiled gate is only a shorter way to the
answer ``catch`` gives, so this is its specification and its baseline.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

Catch = TypeVar("Catch", bound=Callable[..., Any])


def gated(target: Catch, throttles: Any, skipped: Any, clients: Any = None) -> Catch:
    """``target`` itself: without the compiled core, every call is answered, and queued,
    in Python."""
    return target
