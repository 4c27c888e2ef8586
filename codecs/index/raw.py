"""Uncompressed index stream: the reference point every other index codec beats."""

from __future__ import annotations

import numpy as np

from deepreduce import bits as _bits
from deepreduce.codecs.base import IndexCodec, expect_length
from deepreduce.registry import register_codec


@register_codec
class RawIndices(IndexCodec):
    """Indices as little-endian int32 when ``n <= 2**31``, else int64.

    The integer width follows from ``n`` alone, so the stream is exactly
    ``4 * nnz`` (or ``8 * nnz``) bytes with nothing else in it.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.index.raw import RawIndices
    >>> codec = RawIndices()
    >>> data = codec.encode(np.array([1, 5]), n=10)
    >>> data.hex()
    '0100000005000000'
    >>> codec.decode(data, n=10, nnz=2).tolist()
    [1, 5]
    """

    codec_id = "raw"

    @staticmethod
    def _dtype(n: int) -> np.dtype:
        return np.dtype("<i4") if n <= 2**31 else np.dtype("<i8")

    def encode(self, indices, n):
        indices = _bits.check_indices(indices, n)
        return indices.astype(self._dtype(n)).tobytes()

    def max_count(self, data, n):
        return len(data) // self._dtype(n).itemsize

    def decode(self, data, n, nnz):
        what = "raw indices"
        n, nnz = _bits.check_counts(n, nnz, what)
        dtype = self._dtype(n)
        expect_length(data, nnz * dtype.itemsize, what)
        return _bits.check_decoded_indices(np.frombuffer(data, dtype=dtype), n, what)
