"""Statistics of captured arrays: min, max, mean, std, L2 norm, NaN and Inf counts.

Computed in chunks of about a million elements converted to float64 at a
time, so describing a multi-gigabyte tensor needs only a few megabytes of
scratch memory. Works on numpy, torch (CPU or not) and jax arrays, and on
bfloat16 kept as raw bits where no library can read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .arrays import LeafSpec, is_array, loaded_type

# Elements converted to float64 at a time.
STATS_CHUNK = 1 << 20
# Up to this many elements, statistics are worked out in plain Python (see _few_values_stats).
FEW_VALUES = 32


@dataclass(frozen=True)
class ArrayStats:
    """Statistics of an array's values.

    ``min``/``max``/``mean``/``std``/``norm`` are over the finite values only
    (``None`` when there are none); ``std`` is the population standard
    deviation (``ddof=0``, as numpy); ``norm`` the L2 norm of the flattened
    array. For complex arrays they describe the magnitudes ``|x|``.
    """

    count: int
    finite: int
    nan: int
    inf: int
    min: float | None
    max: float | None
    mean: float | None
    std: float | None
    norm: float | None
    magnitude: bool = False


def array_stats(value: Any, spec: LeafSpec | None = None) -> ArrayStats | None:
    """Statistics of a numpy/torch/jax array, or None for what has none (bytes, unknown dtypes).

    ``spec`` (the capture's :class:`LeafSpec`) lets a bfloat16 array kept as raw
    ``uint16`` bits (no torch or ml_dtypes here) be read as bfloat16.
    """
    flat = _flat_numpy_source(value)
    if flat is None:
        return None
    to_float = _float_converter(flat, spec)
    if to_float is None:
        return None
    magnitude = _is_complex(flat)
    # Integers (not the raw bits of a bfloat16/float8 kept as uint) keep exact min and max.
    exact_int = _is_integer(flat) and not (
        spec is not None and (spec.dtype == "bfloat16" or spec.dtype.startswith("float8")))
    size = _size(flat)
    describe = (_one_value_stats if size == 1 else _few_values_stats if size <= FEW_VALUES
                else _chunked_stats)
    if describe is not _chunked_stats and to_float is _to_float64 and flat.dtype.itemsize <= 8:
        # Values that reach Python without a numpy cast that could warn (see
        # _python_floats), then plain Python: np.errstate costs more than that.
        return _described(describe, flat, to_float, magnitude, exact_int)
    # Values near the float64 limits overflow a square, and a cast may meet a signalling
    # NaN: no warning printed from whichever thread (the REPL's, the background worker's)
    # asked.
    with np.errstate(all="ignore"):
        return _described(describe, flat, to_float, magnitude, exact_int)


def _described(describe: Any, *values: Any) -> ArrayStats:
    """``describe(*values)``, worked out again on scaled values where the magnitudes
    called for it (see :func:`_scale_exponent`)."""
    stats = describe(*values)
    scale = 0 if describe is _one_value_stats else _scale_exponent(stats)
    return describe(*values, scale) if scale else stats


# Beyond these magnitudes a square overflows to inf, or underflows to 0, in float64: the
# mean of [1e308] * 3, the std of a constant 3e200, the norm of 1e-200 would come out wrong.
_SQUARE_SAFE = (2.0 ** -480, 2.0 ** 480)


def _scale_exponent(stats: ArrayStats) -> int:
    """0 for statistics worked out exactly as they are; else the power of two to divide the
    values by (exactly) so that their sums and squares neither overflow nor underflow."""
    if not stats.finite or stats.min is None or stats.max is None:
        return 0
    largest = max(abs(float(stats.min)), abs(float(stats.max)))
    if largest == 0.0 or _SQUARE_SAFE[0] <= largest <= _SQUARE_SAFE[1]:
        return 0
    return math.frexp(largest)[1]


def _unscaled(value: float, scale: int) -> float:
    """``value * 2**scale``: inf where it is beyond float64 (a norm of many 1e308s)."""
    try:
        return math.ldexp(value, scale)
    except OverflowError:
        return math.copysign(math.inf, value)


def _chunked_stats(flat: Any, to_float: Any, magnitude: bool, exact_int: bool,
                   scale: int = 0) -> ArrayStats:
    """Statistics in chunks; the mean, std and norm of the values divided by ``2**scale``
    (see :func:`_scale_exponent`), then multiplied back."""
    size = _size(flat)
    count = finite = nan = inf = 0
    lo = hi = None
    mean = m2 = sumsq = 0.0
    for start in range(0, size, STATS_CHUNK):
        raw = _chunk(flat, start, start + STATS_CHUNK)
        x = to_float(raw)
        count += x.size
        bad = ~np.isfinite(x)
        if bad.any():
            chunk_nan = int(np.isnan(x).sum())
            nan += chunk_nan
            inf += int(bad.sum()) - chunk_nan
            x = x[~bad]
        if not x.size:
            continue
        if exact_int:  # compare the integers themselves: float64 rounds beyond 2**53
            chunk_lo, chunk_hi = int(raw.min()), int(raw.max())
        else:
            chunk_lo, chunk_hi = float(x.min()), float(x.max())
        lo = chunk_lo if lo is None else min(lo, chunk_lo)
        hi = chunk_hi if hi is None else max(hi, chunk_hi)
        if scale:
            x = np.ldexp(x, -scale)
        # Chan et al.'s pairwise update: numerically stable mean and variance across chunks.
        n = x.size
        chunk_mean = float(x.mean())
        chunk_m2 = float(np.square(x - chunk_mean).sum())
        total = finite + n
        delta = chunk_mean - mean
        mean += delta * n / total
        m2 += chunk_m2
        if finite:  # (the first chunk has no cross term: delta² of 1e200 is inf, and inf·0 NaN)
            m2 += delta * delta * finite * n / total
        # Not np.dot: BLAS would start its thread pool, whose threads spin on every core
        # for a while after each call (measured: +40 % on a training loop beside the REPL).
        sumsq += chunk_m2 + n * chunk_mean * chunk_mean
        finite = total
    if not finite:
        return ArrayStats(count, 0, nan, inf, None, None, None, None, None, magnitude)
    return ArrayStats(count, finite, nan, inf, lo, hi, _unscaled(mean, scale),
                      _unscaled(math.sqrt(m2 / finite), scale),
                      _unscaled(math.sqrt(sumsq), scale), magnitude)


def _one_value_stats(flat: Any, to_float: Any, magnitude: bool, exact_int: bool
                     ) -> ArrayStats:
    """What :func:`_chunked_stats` makes of a single value, bit for bit, without its seven
    reductions: most captures of a training loop are one number (a loss, a rate), and the
    background worker describes every one. Its norm is its magnitude, never a square's
    overflow or underflow."""
    raw = _chunk(flat, 0, 1)
    value = float(_python_floats(raw, to_float)[0])
    if value != value:
        return ArrayStats(1, 0, 1, 0, None, None, None, None, None, magnitude)
    if math.isinf(value):
        return ArrayStats(1, 0, 0, 1, None, None, None, None, None, magnitude)
    extreme = int(raw[0]) if exact_int else value
    # 0.0 + value: the loop's running mean starts at 0.0, which makes a -0.0 mean +0.0.
    return ArrayStats(1, 1, 0, 0, extreme, extreme, 0.0 + value, 0.0, abs(value), magnitude)


def _few_values_stats(flat: Any, to_float: Any, magnitude: bool, exact_int: bool,
                      scale: int = 0) -> ArrayStats:
    """What :func:`_chunked_stats` makes of a few values, to rounding, in plain Python:
    on a small vector (a per-layer norm, a handful of metrics) numpy's reductions cost
    several times their arithmetic, and the background worker describes every capture."""
    raw = _chunk(flat, 0, FEW_VALUES)
    values = _python_floats(raw, to_float)
    finite = [value for value in values if -math.inf < value < math.inf]
    count = len(values)
    nan = 0 if len(finite) == count else sum(value != value for value in values)
    if not finite:
        return ArrayStats(count, 0, nan, count - nan, None, None, None, None, None, magnitude)
    if exact_int:  # the integers themselves, as the loop compares them
        integers = raw.tolist()
        low, high = int(min(integers)), int(max(integers))
    else:
        low, high = min(finite), max(finite)
    n = len(finite)
    if scale:
        finite = [math.ldexp(value, -scale) for value in finite]
    mean = sum(finite) / n
    spread = sum([(value - mean) * (value - mean) for value in finite])
    squares = sum([value * value for value in finite])
    return ArrayStats(count, n, nan, count - n - nan, low, high, _unscaled(mean, scale),
                      _unscaled(math.sqrt(spread / n), scale),
                      _unscaled(math.sqrt(squares), scale), magnitude)


def value_histogram(value: Any, spec: LeafSpec | None, bins: int, low: float, high: float
                    ) -> tuple[np.ndarray, np.ndarray] | None:
    """``(counts, edges)``: how many finite values (magnitudes for complex) fall in each of
    ``bins`` equal bins from ``low`` to ``high`` (the array's min and max), counted chunk by
    chunk; None when the dtype holds no numbers."""
    flat = _flat_numpy_source(value)
    to_float = None if flat is None else _float_converter(flat, spec)
    if to_float is None:
        return None
    if not low < high:  # every value the same: one bin around it, wide enough to exist
        low, largest = float(low), float(np.finfo(np.float64).max)
        spread = max(abs(low) * 1e-6, 0.5)
        # Not past the largest float (a constant 1.8e308 made every edge NaN).
        low, high = max(low - spread, -largest), min(low + spread, largest)
    # Halved, then doubled: from -1e308 to 1e308 the width itself would overflow.
    edges = 2 * np.linspace(low / 2, high / 2, bins + 1)
    if not np.all(np.diff(edges) > 0):  # a range finer than float64 can cut in ``bins``
        middle, step = low / 2 + high / 2, float(np.spacing(max(abs(low), abs(high))))
        edges = middle + step * np.arange(-bins, bins + 1, 2, dtype=np.float64)
    counts = np.zeros(bins, np.int64)
    with np.errstate(all="ignore"):
        for start in range(0, _size(flat), STATS_CHUNK):
            x = to_float(_chunk(flat, start, start + STATS_CHUNK))
            x = x[np.isfinite(x)]
            # The last edge belongs to the last bin; rounding may not put min and max inside.
            index = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, bins - 1)
            counts += np.bincount(index, minlength=bins)
    return counts, edges


def _python_floats(raw: np.ndarray, to_float: Any) -> list[Any]:
    """``to_float(raw)`` as Python numbers. Plain floats widen in ``tolist``, which, unlike a
    numpy cast, does not warn of a signalling NaN among them; integers cannot make it warn."""
    if to_float is _to_float64 and raw.dtype.kind == "f" and raw.dtype.itemsize <= 8:
        return raw.tolist()
    return to_float(raw).tolist()


def as_float64(array: np.ndarray, spec: LeafSpec) -> np.ndarray | None:
    """A received array's values as float64 (magnitudes for complex), bfloat16 and float8
    read from their raw bits; None when its dtype holds no numbers."""
    to_float = _float_converter(array, spec)
    return None if to_float is None else to_float(array)


def _flat_numpy_source(value: Any) -> Any:
    """A flat (1-D) numpy array or CPU torch tensor over the value's elements, without copying."""
    tensor_type = loaded_type("torch", "Tensor")
    if tensor_type is not None and isinstance(value, tensor_type):
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        return tensor.reshape(-1)
    if isinstance(value, (bytes, bytearray, memoryview, str)):
        return None
    if isinstance(value, (np.ndarray, np.generic)) or is_array(value):
        array = np.asarray(value)  # a jax array on the CPU: a view of its buffer
        return array.reshape(-1) if array.dtype.kind != "O" else None
    return None


def _size(flat: Any) -> int:
    return int(flat.numel()) if hasattr(flat, "numel") else int(flat.size)


def _chunk(flat: Any, start: int, stop: int) -> np.ndarray:
    piece = flat[start:stop]
    if isinstance(piece, np.ndarray):
        return piece
    if piece.dtype.is_floating_point and piece.element_size() < 4 or not _numpy_has(piece):
        piece = piece.float()  # bfloat16, float8...: numpy cannot hold them
    return piece.numpy()


def _numpy_has(tensor: Any) -> bool:
    try:
        tensor[:0].numpy()
    except (TypeError, RuntimeError):
        return False
    return True


def _is_complex(flat: Any) -> bool:
    return bool(flat.dtype.is_complex) if hasattr(flat, "is_complex") else flat.dtype.kind == "c"


def _is_integer(flat: Any) -> bool:
    if hasattr(flat, "is_complex"):  # torch
        return not flat.dtype.is_floating_point and not flat.dtype.is_complex
    return flat.dtype.kind in "iub"


def _e4m3fn_values() -> np.ndarray:
    """What each of the 256 float8_e4m3fn bit patterns means: 4 exponent bits (bias 7), 3
    mantissa bits, subnormals, no infinities, NaN at all ones."""
    bits = np.arange(256)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 0xF, bits & 0x7
    values = sign * np.where(exponent == 0, mantissa / 8 * 2.0**-6,
                             (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    values[(bits & 0x7F) == 0x7F] = np.nan
    return values


_E4M3FN_VALUES = _e4m3fn_values()


def _float_converter(flat: Any, spec: LeafSpec | None) -> Any:
    """A function from a raw numpy chunk to float64 values; None when the dtype holds no numbers."""
    if hasattr(flat, "is_complex"):  # torch chunks arrive as numpy float32 (or native dtypes)
        if flat.dtype.is_complex:
            return _magnitudes
        return lambda raw: raw.astype(np.float64)
    if spec is not None and spec.dtype == "bfloat16" and flat.dtype == np.uint16:
        # bfloat16 kept as its raw bits: they are the upper half of a float32.
        return lambda raw: (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if spec is not None and spec.dtype == "float8_e5m2" and flat.dtype == np.uint8:
        # The upper half of a float16, bit for bit.
        return lambda raw: (raw.astype(np.uint16) << 8).view(np.float16).astype(np.float64)
    if spec is not None and spec.dtype == "float8_e4m3fn" and flat.dtype == np.uint8:
        return lambda raw: _E4M3FN_VALUES[raw]
    kind = flat.dtype.kind
    if kind == "c":
        return _magnitudes
    if kind in "fiub":
        return _to_float64
    try:  # ml_dtypes (bfloat16, float8) cast to float
        flat[:0].astype(np.float64)
    except (TypeError, ValueError):
        return None
    return lambda raw: raw.astype(np.float64)


def _magnitudes(raw: np.ndarray) -> np.ndarray:
    """``|z|`` as float64, worked out in complex128: in complex64 a finite ``3e38+3e38j``
    would overflow to inf."""
    return np.abs(raw.astype(np.complex128, copy=False)) if raw.dtype.itemsize <= 16 else (
        np.abs(raw).astype(np.float64))


def _to_float64(raw: np.ndarray) -> np.ndarray:
    """The plain cast of numpy's own numbers (floats, integers, bools)."""
    return raw.astype(np.float64)
