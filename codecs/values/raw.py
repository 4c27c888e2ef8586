"""The ``raw`` value codec: values in their own dtype, little-endian."""

from __future__ import annotations

from deepreduce.codecs.base import ValueCodec, expect_length
from deepreduce.codecs.values.dtypes import check_nnz, check_values, from_le_bytes, to_le_bytes, value_dtype
from deepreduce.errors import DecodeError
from deepreduce.registry import register_codec


@register_codec
class RawValues(ValueCodec):
    """Values in their own dtype, little-endian: lossless for every dtype.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.values.raw import RawValues
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
