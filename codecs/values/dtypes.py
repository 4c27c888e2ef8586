"""The value dtypes every value codec accepts, their checks, byte images and casts.

Supported value dtypes are float16, float32, float64 and, when the ``ml_dtypes``
package is importable (it ships with TensorFlow), ``ml_dtypes.bfloat16``. All streams
are little-endian.

Conversions to and from bfloat16 are done here on integer bit patterns
(round to nearest even), never through ``ml_dtypes`` casts, so the results
do not depend on that package's version and NaN payloads are kept (quieted).
The byte shuffle here serves the ``deflate`` and ``zstd`` value codecs.
"""

from __future__ import annotations

import numpy as np

from deepreduce.errors import DecodeError

try:
    import ml_dtypes
except ImportError:  # the core works without it; only bfloat16 values need it
    ml_dtypes = None

#: ``np.dtype(ml_dtypes.bfloat16)``, or None when ml_dtypes is missing.
BFLOAT16 = np.dtype(ml_dtypes.bfloat16) if ml_dtypes is not None else None

#: Float casts here overflow to infinity on purpose, and signalling NaNs
#: raise the "invalid" flag when converted; neither deserves a warning.
_QUIET_CASTS = {"over": "ignore", "invalid": "ignore"}

#: Every dtype a value codec accepts.
SUPPORTED_DTYPES = tuple(d for d in (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32),
                                     np.dtype(np.float64)) if d is not None)


_SUPPORTED = frozenset(SUPPORTED_DTYPES)
_FLOAT32 = np.dtype(np.float32)


def is_bfloat16(dtype) -> bool:
    """Whether ``dtype`` is ml_dtypes' bfloat16 (False when ml_dtypes is missing)."""
    # Never compare with a None BFLOAT16: np.dtype(None) is float64.
    return BFLOAT16 is not None and np.dtype(dtype) == BFLOAT16


def value_dtype(dtype, error=ValueError) -> np.dtype:
    """Return ``dtype`` as a native-order numpy dtype, or raise ``error`` if unsupported."""
    if isinstance(dtype, np.dtype) and dtype in _SUPPORTED:  # (native: every payload's)
        return dtype
    if dtype is None:  # np.dtype(None) would silently mean float64
        raise error("value dtype must be given, got None")
    try:
        dtype = np.dtype(dtype)
    except (TypeError, ValueError):
        raise error(f"not a dtype: {dtype!r}") from None
    if dtype.byteorder not in "=|":
        dtype = dtype.newbyteorder("=")
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(d.name for d in SUPPORTED_DTYPES)
        raise error(f"value dtype {dtype} not supported; supported: {names}")
    return dtype


def check_nnz(nnz, what: str) -> int:
    """Decoder-side check of a value count: a non-negative integer, else DecodeError."""
    if type(nnz) is int and nnz >= 0:  # (what the container reads)
        return nnz
    if isinstance(nnz, (bool, np.bool_)) or not isinstance(nnz, (int, np.integer)) or nnz < 0:
        raise DecodeError(f"{what}: value count must be a non-negative integer, got {nnz!r}")
    return int(nnz)


def check_values(values) -> np.ndarray:
    """Encoder-side check: a contiguous native-order 1-D array of a supported dtype."""
    values = np.asarray(values)
    if values.ndim != 1:
        raise ValueError(f"values must be a 1-D array, got shape {values.shape}")
    return np.ascontiguousarray(values, dtype=value_dtype(values.dtype))


def _bits_dtype(dtype: np.dtype) -> np.dtype:
    """The little-endian unsigned integer dtype of the same size (its bit pattern)."""
    return np.dtype(f"<u{dtype.itemsize}")


def to_le_bytes(values: np.ndarray) -> bytes:
    """Little-endian bytes of a checked value array (bit patterns, NaN payloads kept)."""
    return values.view(f"u{values.dtype.itemsize}").astype(_bits_dtype(values.dtype)).tobytes()


def from_le_bytes(data, dtype: np.dtype) -> np.ndarray:
    """Inverse of :func:`to_le_bytes`; ``len(data)`` must be a multiple of the item size."""
    bits = np.frombuffer(data, dtype=_bits_dtype(dtype))
    return bits.astype(f"u{dtype.itemsize}").view(dtype)


def shuffle_bytes(values: np.ndarray) -> bytes:
    """Byte-shuffle values: all least significant bytes, then all next bytes, ...

    Grouping bytes of equal significance (the sign/exponent bytes are highly
    repetitive in gradients) makes general-purpose compressors much more
    effective than on the interleaved values. Planes are cut with integer
    shifts, which is byte-order independent and reads whole words in order,
    where transposing a byte view gathers one byte at a stride.
    """
    itemsize = values.dtype.itemsize
    words = values.view(f"u{itemsize}")
    planes = np.empty((itemsize, values.size), dtype=np.uint8)
    for byte in range(itemsize):
        planes[byte] = words >> (8 * byte)  # the assignment keeps the low 8 bits
    return planes.tobytes()


def unshuffle_bytes(data, nnz: int, dtype: np.dtype) -> np.ndarray:
    """Inverse of :func:`shuffle_bytes`; ``data`` must hold ``nnz * itemsize`` bytes."""
    planes = np.frombuffer(data, dtype=np.uint8).reshape(dtype.itemsize, nnz)
    words = planes[0].astype(f"u{dtype.itemsize}")
    for byte in range(1, dtype.itemsize):
        words |= planes[byte].astype(words.dtype) << (8 * byte)
    return words.view(dtype)


# ----------------------------------------------------------------- bfloat16 by bits

def float32_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16, round to nearest even; returns uint16 bit patterns.

    Values beyond the bfloat16 range round to infinity, as IEEE rounding
    does; NaN stays NaN (its top payload bits kept, quiet bit set).
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    # Adding 0x7FFF, plus one more when the kept part is odd, carries into
    # the kept bits exactly when the dropped half is above (or, for odd,
    # at) one half.
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16
    nan = np.isnan(x)
    if nan.any():
        rounded[nan] = (bits[nan] >> 16) | np.uint32(0x0040)
    return rounded.astype(np.uint16)


def bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Exact float32 values of bfloat16 bit patterns."""
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32)


def _float64_to_float32_round_to_odd(x: np.ndarray) -> np.ndarray:
    """Cast float64 to float32 rounding to odd (truncate, then set the last bit if inexact).

    Rounding to odd first and to nearest even second gives the correctly
    rounded result as long as the intermediate format has at least two more
    bits than the final one (float32: 24, bfloat16: 8), so float64 values
    reach bfloat16 without double-rounding errors.
    """
    with np.errstate(**_QUIET_CASTS):
        nearest = x.astype(np.float32)
        widened = nearest.astype(np.float64)
    bits = nearest.view(np.uint32).copy()
    inexact = (widened != x) & ~np.isnan(x)
    # Sign-magnitude: stepping the magnitude bits down by one moves toward
    # zero, undoing a round-up (including one that overflowed to infinity).
    rounded_up = inexact & (np.abs(widened) > np.abs(x))
    bits[rounded_up] -= np.uint32(1)
    bits[inexact] |= np.uint32(1)
    return bits.view(np.float32)


def to_float32(values: np.ndarray) -> np.ndarray:
    """Float32 copy of supported values (exact for float16 and bfloat16)."""
    with np.errstate(**_QUIET_CASTS):
        return _as_float32(values, copy=True)


def from_float32(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Cast float32 values to ``dtype`` (round to nearest even when narrowing)."""
    with np.errstate(**_QUIET_CASTS):
        return _float32_as(x, dtype)


# The two casts without their np.errstate, for codecs that already hold it (here and
# in qsgd): entering one costs about as much as casting a small tensor's values.

def _as_float32(values: np.ndarray, copy: bool = False) -> np.ndarray:
    if is_bfloat16(values.dtype):
        return bfloat16_bits_to_float32(values.view(np.uint16))
    return values.astype(np.float32, copy=copy)


def _float32_as(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if x.dtype == _FLOAT32 and dtype == _FLOAT32:  # (no cast to make)
        return x
    if is_bfloat16(dtype):
        return float32_to_bfloat16_bits(x).view(BFLOAT16)
    return x.astype(dtype, copy=False)
