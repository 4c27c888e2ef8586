"""Shared halves of the byte-compressor codecs (``deflate``, ``zstd``).

Both families run a general-purpose byte compressor over a byte image of the
stream: gap varints for indices, byte-shuffled values for values. A subclass
supplies only ``_compress(data)`` and ``_decompress(data, limit, what)``; the
limit is the largest output the declared counts allow, so a crafted stream
cannot inflate without bound. An empty set is an empty stream.
"""

from __future__ import annotations

import numpy as np

from deepreduce import bits as _bits
from deepreduce.codecs.base import IndexCodec, ValueCodec, expect_length
from deepreduce.codecs.floats import (check_nnz, check_values, shuffle_bytes, unshuffle_bytes,
                                      value_dtype)
from deepreduce.errors import DecodeError


class CompressedGapIndices(IndexCodec):
    """Gap varints (as in the ``varint`` codec) through a byte compressor."""

    def _compress(self, data: bytes) -> bytes:
        raise NotImplementedError

    def _decompress(self, data, limit: int, what: str) -> bytes:
        raise NotImplementedError

    def encode(self, indices, n):
        indices = _bits.check_indices(indices, n)
        if indices.size == 0:
            return b""
        return self.encode_varints(_bits.varint_encode(_bits.gaps(indices)))

    def encode_varints(self, varints: bytes) -> bytes:
        """The stream of a non-empty set from its gap varints (as :meth:`encode` makes
        them), so that several compressors can share one varint pass."""
        return self._compress(varints)

    def decode(self, data, n, nnz):
        what = f"{self.codec_id} indices"
        n, nnz = _bits.check_counts(n, nnz, what)
        if nnz == 0:
            expect_length(data, 0, what)
            return np.zeros(0, dtype=np.int64)
        varints = self._decompress(data, _bits.varint_gap_bytes_bound(n, nnz), what)
        return _bits.ungaps(_bits.varint_decode(varints, nnz, what), n, what)


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
