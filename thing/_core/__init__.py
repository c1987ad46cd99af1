"""Chooses the byte movers: the compiled ``_transport`` or its pure-Python twin.

``THING_PUREPYTHON=1`` forces the twin; it is also used, with a log line,
when the extension cannot be imported (a source checkout that was never built).
"""

from __future__ import annotations

import logging
import os

if os.environ.get("THING_PUREPYTHON", "") not in ("", "0"):
    from .fallback import PrivateMapping, copy_into, recv_buffers, send_buffers

    BACKEND = "python"
else:
    try:
        from ._transport import PrivateMapping, copy_into, recv_buffers, send_buffers

        BACKEND = "compiled"
    except ImportError as exc:  # pragma: no cover - depends on the build
        from .fallback import PrivateMapping, copy_into, recv_buffers, send_buffers

        BACKEND = "python"
        logging.getLogger("thing").info("compiled core unavailable (%s); using pure Python", exc)

__all__ = ["BACKEND", "PrivateMapping", "copy_into", "recv_buffers", "send_buffers"]
