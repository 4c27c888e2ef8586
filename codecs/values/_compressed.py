"""The value half of the byte-compressor codecs (``deflate``, ``zstd``): byte-shuffled
values through a byte compressor.

A subclass supplies only ``_compress(data)`` and ``_decompress(data, limit, what)``
(:mod:`deepreduce.codecs._deflate`, :mod:`deepreduce.codecs._zstd`); the limit is the
size the declared count gives, so a crafted stream cannot inflate without bound. An
empty set is an empty stream. The index half is
:mod:`deepreduce.codecs.index._compressed`.
"""

from __future__ import annotations

import numpy as np

from deepreduce.codecs.base import ValueCodec, expect_length
from deepreduce.codecs.values.dtypes import (check_nnz, check_values, shuffle_bytes,
                                             unshuffle_bytes, value_dtype)
from deepreduce.errors import DecodeError


class CompressedShuffledValues(ValueCodec):
    """Byte-shuffled values through a byte compressor; lossless for every dtype."""

    def _compress(self, data: bytes) -> bytes:
        raise NotImplementedError

    def _decompress(self, data, limit: int, what: str) -> bytes:
        raise NotImplementedError

    def encode(self, values):
        values = check_values(values)
        if values.size == 0:
            return b""
        return self._compress(shuffle_bytes(values))

    def decode(self, data, nnz, dtype):
        dtype = value_dtype(dtype, DecodeError)
        what = f"{self.codec_id} {dtype.name} values"
        nnz = check_nnz(nnz, what)
        if nnz == 0:
            expect_length(data, 0, what)
            return np.zeros(0, dtype=dtype)
        size = nnz * dtype.itemsize
        shuffled = self._decompress(data, size, what)
        expect_length(shuffled, size, what + " (decompressed)")
        return unshuffle_bytes(shuffled, nnz, dtype)
