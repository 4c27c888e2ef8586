"""Fixed-width bit packing of indices: ``ceil(log2 n)`` bits each."""

from __future__ import annotations

from deepreduce import bits as _bits
from deepreduce.codecs.base import IndexCodec
from deepreduce.registry import register_codec


@register_codec
class BitpackIndices(IndexCodec):
    """Each index in ``ceil(log2 n)`` bits, packed MSB first (see :mod:`._bits`).

    The width follows from ``n`` (``n = 1`` needs 0 bits, ``n = 2`` one bit),
    so the stream is exactly ``ceil(nnz * width / 8)`` bytes.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.index.bitpack import BitpackIndices
    >>> codec = BitpackIndices()
    >>> data = codec.encode(np.array([1, 5, 6]), n=8)  # 3 bits each
    >>> len(data)
    2
    >>> codec.decode(data, n=8, nnz=3).tolist()
    [1, 5, 6]
    """

    codec_id = "bitpack"

    @staticmethod
    def width(n: int) -> int:
        """Bits per index for a universe of ``n``: ``ceil(log2 n)``, 0 for ``n <= 1``."""
        return max(n - 1, 0).bit_length()

    def encode(self, indices, n):
        indices = _bits.check_indices(indices, n)
        return _bits.pack_fixed(indices.astype("uint64"), self.width(n))

    def max_count(self, data, n):
        width = self.width(n)
        return 8 * len(data) // width if width else n

    def decode(self, data, n, nnz):
        what = "bitpack indices"
        n, nnz = _bits.check_counts(n, nnz, what)
        values = _bits.unpack_fixed(data, nnz, self.width(n), what)
        return _bits.check_decoded_indices(values, n, what)
