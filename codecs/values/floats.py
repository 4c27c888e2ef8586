"""Value codecs that cast each value to a fixed narrower floating point format.

``fp32``, ``fp16`` and ``bf16`` cast to a narrower format and back (the dtypes and the
casts are :mod:`deepreduce.codecs.values.dtypes`; ``raw``, which keeps the values' own
dtype, is :mod:`deepreduce.codecs.values.raw`). All streams are little-endian.
"""

from __future__ import annotations

import numpy as np

from deepreduce.codecs.base import ValueCodec, expect_length
from deepreduce.codecs.values.dtypes import (_FLOAT32, _QUIET_CASTS, BFLOAT16, _as_float32,
                                             _float32_as, _float64_to_float32_round_to_odd,
                                             bfloat16_bits_to_float32, check_nnz, check_values,
                                             float32_to_bfloat16_bits, is_bfloat16, value_dtype)
from deepreduce.errors import DecodeError
from deepreduce.registry import register_codec

try:
    from deepreduce.codecs.values import _halfcast
except ImportError:  # not built, or no F16C here: numpy's casts give the same bits
    _halfcast = None

#: How ``fp16`` casts float32: ``"compiled"`` (``deepreduce.codecs.values._halfcast``, F16C) or
#: ``"numpy"``. Both give the same bits.
HALF_IMPLEMENTATION = "numpy" if _halfcast is None else "compiled"


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
        nothing, so need no ``np.errstate`` (entering and leaving one costs as much as
        casting a small tensor's values)."""
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
    >>> from deepreduce.codecs.values.floats import Float32Values
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
    >>> from deepreduce.codecs.values.floats import Float16Values
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
    >>> from deepreduce.codecs.values.floats import BFloat16Values
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
