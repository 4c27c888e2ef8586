"""Value codecs that store each value in a fixed floating point format.

``raw`` keeps the values' own dtype; ``fp32``, ``fp16`` and ``bf16`` cast
to a narrower format and back. Supported value dtypes are float16, float32,
float64 and, when the ``ml_dtypes`` package is importable (it ships with
TensorFlow), ``ml_dtypes.bfloat16``. All streams are little-endian.

Conversions to and from bfloat16 are done here on integer bit patterns
(round to nearest even), never through ``ml_dtypes`` casts, so the results
do not depend on that package's version and NaN payloads are kept (quieted).
The module also provides the dtype checks and the byte shuffle used by the
``deflate`` and ``zstd`` value codecs.
"""

from __future__ import annotations

import numpy as np

from deepreduce.codecs.base import ValueCodec, expect_length
from deepreduce.errors import DecodeError
from deepreduce.registry import register_codec

try:
    import ml_dtypes
except ImportError:  # the core works without it; only bfloat16 values need it
    ml_dtypes = None

try:
    from deepreduce.codecs import _halfcast
except ImportError:  # not built, or no F16C here: numpy's casts give the same bits
    _halfcast = None

#: How ``fp16`` casts float32: ``"compiled"`` (``deepreduce.codecs._halfcast``, F16C) or
#: ``"numpy"``. Both give the same bits.
HALF_IMPLEMENTATION = "numpy" if _halfcast is None else "compiled"

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
    shifts, which is both byte-order independent and several times faster
    than transposing a strided byte view.
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


# ----------------------------------------------------------------- codecs

@register_codec
class RawValues(ValueCodec):
    """Values in their own dtype, little-endian: lossless for every dtype.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.floats import RawValues
    >>> codec = RawValues()
    >>> data = codec.encode(np.array([1.0, -2.5], dtype=np.float32))
    >>> len(data)
    8
    >>> codec.decode(data, nnz=2, dtype=np.float32).tolist()
    [1.0, -2.5]
    """

    codec_id = "raw"

    def encode(self, values):
        return to_le_bytes(check_values(values))

    def decode(self, data, nnz, dtype):
        dtype = value_dtype(dtype, DecodeError)
        what = f"raw {dtype.name} values"
        nnz = check_nnz(nnz, what)
        expect_length(data, nnz * dtype.itemsize, what)
        return from_le_bytes(data, dtype)


class _NarrowingValues(ValueCodec):
    """A value codec that stores each value in one fixed narrower format.

    Subclasses define ``wire_dtype`` and the two conversions; encoding,
    decoding and :meth:`encode_and_receive` (which skips the second decode)
    follow from them.
    """

    lossless = False
    elementwise = True
    wire_dtype: np.dtype

    def _narrow(self, values: np.ndarray) -> np.ndarray:
        """Checked values -> array of ``wire_dtype`` (or its uint bit patterns)."""
        raise NotImplementedError

    def _widen(self, wire: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """Array read from the stream -> values of ``dtype``."""
        raise NotImplementedError

    def _casts_quietly(self, dtype: np.dtype) -> bool:
        """Whether :meth:`_narrow` of values of ``dtype`` and :meth:`_widen` to it warn of
        nothing, so need no ``np.errstate`` (entering and leaving one costs 3 us, as much
        as the casts of a few thousand values)."""
        return False

    def encode(self, values):
        values = check_values(values)
        if self._casts_quietly(values.dtype):
            return self._narrow(values).astype(self.wire_dtype, copy=False).tobytes()
        with np.errstate(**_QUIET_CASTS):
            return self._narrow(values).astype(self.wire_dtype, copy=False).tobytes()

    def decode(self, data, nnz, dtype):
        dtype = value_dtype(dtype, DecodeError)
        what = f"{self.codec_id} values"
        nnz = check_nnz(nnz, what)
        expect_length(data, nnz * self.wire_dtype.itemsize, what)
        if self._casts_quietly(dtype):
            return self._widen(np.frombuffer(data, dtype=self.wire_dtype), dtype)
        with np.errstate(**_QUIET_CASTS):
            return self._widen(np.frombuffer(data, dtype=self.wire_dtype), dtype)

    def encode_and_receive(self, values):
        values = check_values(values)
        if self._casts_quietly(values.dtype):
            wire = self._narrow(values).astype(self.wire_dtype, copy=False)
            return wire.tobytes(), self._widen(wire, values.dtype)
        with np.errstate(**_QUIET_CASTS):
            wire = self._narrow(values).astype(self.wire_dtype, copy=False)
            return wire.tobytes(), self._widen(wire, values.dtype)


@register_codec
class Float32Values(_NarrowingValues):
    """Values cast to float32 (round to nearest even), cast back on decode.

    Exact for float16, bfloat16 and float32 input (bfloat16 NaN payloads are
    quieted); float64 loses precision, so the codec as a whole is lossy.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.floats import Float32Values
    >>> codec = Float32Values()
    >>> data = codec.encode(np.array([0.1, 3.0]))
    >>> codec.decode(data, nnz=2, dtype=np.float64).tolist()
    [0.10000000149011612, 3.0]
    """

    codec_id = "fp32"
    wire_dtype = np.dtype("<f4")

    def _narrow(self, values):
        return _as_float32(values)

    def _widen(self, wire, dtype):
        return _float32_as(wire.astype(np.float32), dtype)


@register_codec
class Float16Values(_NarrowingValues):
    """Values cast to IEEE float16 (round to nearest even), cast back on decode.

    Finite values beyond the float16 range saturate to +-65504 instead of
    becoming infinite (gradient spikes stay large but finite); infinities
    and NaN are kept. Relative error at most 2**-11 in the normal range
    (``|x| >= 2**-14``), absolute error at most 2**-25 below it.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.floats import Float16Values
    >>> codec = Float16Values()
    >>> data = codec.encode(np.array([0.1, 1e6, -np.inf], dtype=np.float32))
    >>> codec.decode(data, nnz=3, dtype=np.float32).tolist()
    [0.0999755859375, 65504.0, -inf]
    """

    codec_id = "fp16"
    wire_dtype = np.dtype("<f2")
    _LIMIT = 65504.0
    #: The smallest magnitude that rounds to infinity in float16 (a NaN fails ``<`` it).
    _OVERFLOW = 65520.0

    def _narrow(self, values):
        # Cast float64 directly: going through float32 could round twice.
        wide = values if values.dtype == np.float64 else _as_float32(values)
        if _halfcast is not None and wide.dtype == np.float32:
            half = np.empty(wide.shape, np.float16)  # saturating in the same pass
            _halfcast.to_half(np.ascontiguousarray(wide).reshape(-1), half.reshape(-1))
            return half
        if wide.size == 0 or max(wide.max(), -wide.min()) < self._OVERFLOW:
            return wide.astype(np.float16)  # nothing to saturate (two reductions, no copy)
        saturated = np.where(np.isfinite(wide), np.clip(wide, -self._LIMIT, self._LIMIT), wide)
        return saturated.astype(np.float16)

    def _casts_quietly(self, dtype):
        # float32 both ways through the compiled casts: numpy casts nothing (and the
        # compiled loops saturate and round without raising floating-point flags
        # numpy would report)
        return _halfcast is not None and dtype == _FLOAT32

    def _widen(self, wire, dtype):
        if _halfcast is None:
            return _float32_as(wire.astype(np.float32), dtype)
        single = np.empty(wire.shape, np.float32)
        _halfcast.to_single(np.ascontiguousarray(wire).reshape(-1), single.reshape(-1))
        return _float32_as(single, dtype)


@register_codec
class BFloat16Values(_NarrowingValues):
    """Values rounded to bfloat16 (8-bit significand, float32's exponent range).

    Rounding is to nearest even on the float32 bit pattern; float64 input is
    first cast to float32 rounding to odd, so it too is rounded correctly.
    Values beyond the bfloat16 range become infinite; NaN stays NaN.
    Relative error at most 2**-8 in the normal range. Does not need
    ``ml_dtypes`` unless the values themselves are bfloat16.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.floats import BFloat16Values
    >>> codec = BFloat16Values()
    >>> data = codec.encode(np.array([0.1, 3.0], dtype=np.float32))
    >>> len(data)
    4
    >>> codec.decode(data, nnz=2, dtype=np.float32).tolist()
    [0.10009765625, 3.0]
    """

    codec_id = "bf16"
    wire_dtype = np.dtype("<u2")

    def _narrow(self, values):
        if is_bfloat16(values.dtype):
            return values.view(np.uint16)
        if values.dtype == np.float64:
            return float32_to_bfloat16_bits(_float64_to_float32_round_to_odd(values))
        return float32_to_bfloat16_bits(_as_float32(values))

    def _widen(self, wire, dtype):
        if is_bfloat16(dtype):
            return wire.astype(np.uint16).view(BFLOAT16)
        return bfloat16_bits_to_float32(wire).astype(dtype)
