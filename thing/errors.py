"""The exceptions thing raises, and the one check of a whole-number argument."""

from __future__ import annotations

import numbers
from typing import Any


class ThingError(Exception):
    """Base class of every error thing raises on purpose."""


class UnsupportedType(ThingError, TypeError):
    """An object (or dtype) that cannot travel; ``catch`` logs it and returns a failed handle."""


class ProtocolError(ThingError):
    """A peer sent bytes that are not a valid thing frame.

    A frame whose header, read whole, is refused is read past; one the reader
    cannot follow (a bad prefix or trailer, a signature that fails) closes the
    connection.
    """

    # The refused capture's name, where its header gave a valid one, so that the REPL
    # can say by name why nothing of it was kept.
    capture_name: str | None = None


class HandshakeError(ProtocolError):
    """The peer is not a thing peer, speaks another protocol version, or refused us."""


class LimitExceeded(ProtocolError):
    """A frame asked for more than the receiver's limits allow; nothing was allocated for it.

    The frame is refused with this reason and read past; the connection stays up.
    """


class InvalidValue(ProtocolError):
    """A frame read whole holds a value no framework would build (a sparse tensor whose
    indices break torch's rules); it is refused with this reason, the connection stays up.
    """


class BadRecording(ThingError, ValueError):
    """A file of a recording is not one thing wrote, or was damaged; nothing of it was loaded."""


class ArgumentError(ThingError, ValueError):
    """A function was given a value it does not take; the message says which ones it does."""


class ArgumentTypeError(ThingError, TypeError):
    """A function was given an argument of a type it does not take."""


class VersionOutOfRange(ThingError, IndexError):
    """``index=`` reaches past the versions kept of a name; the message says how many there are."""


class NotServing(ThingError, RuntimeError):
    """A REPL function was called before ``thing.serve()``."""


class UnknownName(ThingError, KeyError):
    """No kept capture has this name; the message lists the closest names, or says why."""

    def __str__(self) -> str:
        # KeyError would show the message as a quoted repr.
        return str(self.args[0]) if self.args else ""


def whole_number(value: Any, what: str, least: int | None = None,
                 most: int | None = None) -> int:
    """``value`` as an int, if it is an integer (a numpy one too) from ``least`` to ``most``
    (where given); else ArgumentTypeError, or ArgumentError for one out of range, naming
    ``what``. A bool is not one: True as step 1 would hand back a capture nobody asked for."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{what} is a whole number, not {value!r}")
    number = int(value)
    if (least is not None and number < least) or (most is not None and number > most):
        bounds = (f"from {least}" if most is None else f"from {least} to {most}"
                  if least is not None else f"up to {most}")
        raise ArgumentError(f"{what} is a whole number {bounds}, not {value!r}")
    return number
