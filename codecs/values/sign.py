"""Scaled sign: one bit per value and one scale per bucket (signSGD / EF-SignSGD values).

Each bucket of ``bucket`` consecutive values is sent as its mean magnitude
``mean(|x|)`` (float32, rounded to nearest) and one sign bit per value;
the receiver gets ``+-mean(|x|)``. This is the value code of
EF-SignSGD (Karimireddy et al., 2019): with error feedback the residual
keeps what the scaled sign loses. Zeros (and -0.0) count as positive.
A bucket holding an infinity or NaN has a non-finite scale, so all its
values decode to infinity or NaN.

Stream: the ``ceil(nnz / bucket)`` scales as little-endian float32, then a
bitmap of ``nnz`` bits, bit ``i`` set when value ``i`` is negative (bit
``i`` is bit ``i % 8`` of byte ``i // 8``, zero padding).
"""

from __future__ import annotations

import numpy as np

from deepreduce import bits as _bits
from deepreduce.codecs.base import ValueCodec
from deepreduce.codecs.values.dtypes import check_nnz, check_values, value_dtype
from deepreduce.codecs.values.qsgd import bucket_matrix, cast_back, check_bucket, working_copy
from deepreduce.errors import DecodeError
from deepreduce.registry import register_codec


def _expand(negative: np.ndarray, scales: np.ndarray, bucket: int, dtype) -> np.ndarray:
    """``+-scale`` per value in ``dtype`` (shared by encoder and decoder)."""
    with np.errstate(invalid="ignore"):  # signalling NaNs of corrupt streams warn when widened
        x = np.repeat(scales.astype(np.float64), bucket)[:negative.size]
    np.negative(x, out=x, where=negative)
    return cast_back(x, dtype)


@register_codec
class SignValues(ValueCodec):
    """1-bit signs with one float32 scale (mean magnitude) per bucket.

    Parameters
    ----------
    bucket : int
        Values per scale, in ``[1, 2**24]``.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.values.sign import SignValues
    >>> codec = SignValues(bucket=4)
    >>> data = codec.encode(np.array([0.5, -1.5, 1.0, -3.0], np.float32))
    >>> len(data)  # one scale, one byte of signs
    5
    >>> codec.decode(data, nnz=4, dtype=np.float32).tolist()
    [1.5, -1.5, 1.5, -1.5]
    """

    codec_id = "sign"
    lossless = False

    def __init__(self, bucket: int = 512):
        self.bucket = check_bucket(bucket)

    def _quantize(self, values):
        values = check_values(values)
        x = working_copy(values)
        rows = bucket_matrix(np.abs(x), self.bucket)
        counts = np.minimum(self.bucket, x.size - self.bucket * np.arange(rows.shape[0]))
        with np.errstate(over="ignore", invalid="ignore"):
            scales = (rows.sum(axis=1) / counts).astype(np.float32)
        negative = x < 0
        data = scales.astype("<f4").tobytes() + _bits.positions_to_bitmap(
            np.flatnonzero(negative), x.size)
        return data, negative, scales, values.dtype

    def encode(self, values):
        return self._quantize(values)[0]

    def encode_and_receive(self, values):
        data, negative, scales, dtype = self._quantize(values)
        return data, _expand(negative, scales, self.bucket, dtype)

    def decode(self, data, nnz, dtype):
        dtype = value_dtype(dtype, DecodeError)
        what = f"sign values (bucket={self.bucket})"
        nnz = check_nnz(nnz, what)
        buckets = -(-nnz // self.bucket)
        expected = 4 * buckets + _bits.packed_bytes(nnz)
        if len(data) != expected:
            raise DecodeError(f"{what}: stream holds {len(data)} bytes, expected {expected} "
                              f"for {nnz} values")
        scales = np.frombuffer(data, dtype="<f4", count=buckets)
        if np.any(scales < 0):
            raise DecodeError(f"{what}: negative bucket scale")
        negative = np.zeros(nnz, dtype=bool)
        negative[_bits.bitmap_to_positions(data[4 * buckets:], nnz, what)] = True
        return _expand(negative, scales.astype(np.float32), self.bucket, dtype)
