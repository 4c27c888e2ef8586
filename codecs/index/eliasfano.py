"""Elias-Fano coding: within 2 bits per index of the entropy bound, no compressor."""

from __future__ import annotations

import numpy as np

from deepreduce import bits as _bits
from deepreduce.codecs.base import IndexCodec, expect_length, no_indices
from deepreduce.errors import DecodeError
from deepreduce.registry import register_codec


@register_codec
class EliasFanoIndices(IndexCodec):
    """Elias-Fano code: ``l`` low bits packed, high parts in unary.

    With ``l = max(0, floor(log2(n / nnz)))``, index ``i[k]`` splits into its
    low ``l`` bits and its high part ``h[k] = i[k] >> l``. The stream is

    1. the ``nnz`` low parts, bit-packed ``l`` bits each, most significant
       bit first (:func:`._bits.pack_fixed`);
    2. a bitmap of ``nnz + ((n - 1) >> l)`` bits with bit ``h[k] + k`` set
       for every ``k`` (the high parts in unary: the number of zeros before
       the ``k``-th one is ``h[k]``), bit ``p`` being bit ``p % 8`` of byte
       ``p // 8`` (:func:`._bits.positions_to_bitmap`).

    Both lengths follow from ``n`` and ``nnz``, so nothing else is stored;
    the total is about ``2 + log2(n / nnz)`` bits per index.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.index.eliasfano import EliasFanoIndices
    >>> codec = EliasFanoIndices()
    >>> data = codec.encode(np.array([3, 17, 18, 60]), n=64)
    >>> len(data)  # 4 x 4 low bits + 4 + 3 unary bits
    3
    >>> codec.decode(data, n=64, nnz=4).tolist()
    [3, 17, 18, 60]
    """

    codec_id = "eliasfano"

    @staticmethod
    def low_bits(n: int, nnz: int) -> int:
        """``max(0, floor(log2(n / nnz)))``, computed exactly on integers."""
        return max(0, (n // nnz).bit_length() - 1) if nnz else 0

    def encode(self, indices, n):
        indices = _bits.check_indices(indices, n)
        nnz = indices.size
        if nnz == 0:
            return b""
        low_bits = self.low_bits(n, nnz)
        unary_bits = nnz + ((n - 1) >> low_bits)
        lows = indices.astype(np.uint64) & np.uint64((1 << low_bits) - 1)
        ones = (indices >> low_bits) + np.arange(nnz, dtype=np.int64)
        return _bits.pack_fixed(lows, low_bits) + _bits.positions_to_bitmap(ones, unary_bits)

    def max_count(self, data, n):
        return 8 * len(data)  # a one in the unary part per index

    def decode(self, data, n, nnz):
        what = "eliasfano indices"
        n, nnz = _bits.check_counts(n, nnz, what)
        if nnz == 0:
            return no_indices(data, what)
        low_bits = self.low_bits(n, nnz)
        unary_bits = nnz + ((n - 1) >> low_bits)
        low_size = _bits.packed_bytes(nnz * low_bits)
        expect_length(data, low_size + _bits.packed_bytes(unary_bits), what)
        ones = _bits.bitmap_to_positions(data[low_size:], unary_bits, what)
        if ones.size != nnz:
            raise DecodeError(f"{what}: unary part has {ones.size} ones, expected {nnz}")
        # The k-th one sits at h[k] + k, so h is non-decreasing and, the
        # bitmap being nnz + max_high bits long, at most max_high.
        highs = (ones - np.arange(nnz, dtype=np.int64)).astype(np.uint64)
        lows = _bits.unpack_fixed(data[:low_size], nnz, low_bits, what)
        indices = (highs << np.uint64(low_bits)) | lows
        return _bits.check_decoded_indices(indices, n, what)
