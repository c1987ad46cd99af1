"""Chooses the byte movers: the compiled ``_transport`` or its pure-Python twin.

``THING_PUREPYTHON=1`` forces the twin; it is also used, with a warning that
says how to build, when the extension cannot be imported (a source checkout
that was never built).
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
        # Said once, at import, where it can be seen: most likely a source checkout on the
        # path that was never built (python started in the repository's folder).
        logging.getLogger("thing").warning(
            "thing's compiled core is not built (%s), so thing runs on its slower pure-Python "
            "twin. Imported from %s: build it with `python -m pip install -e %s`, or start "
            "Python outside that folder to use the installed thing.",
            exc, os.path.dirname(os.path.dirname(__file__)),
            os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

__all__ = ["BACKEND", "PrivateMapping", "copy_into", "recv_buffers", "send_buffers"]
