"""One bit per element of the universe: the best exact code for dense index sets."""

from __future__ import annotations

from deepreduce import bits as _bits
from deepreduce.codecs.base import IndexCodec
from deepreduce.errors import DecodeError
from deepreduce.registry import register_codec


@register_codec
class BitmapIndices(IndexCodec):
    """An ``n``-bit bitmap, bit ``i`` set when index ``i`` is present.

    Bit ``i`` is bit ``i % 8`` of byte ``i // 8`` (``np.packbits`` with
    ``bitorder="little"``); the stream is always ``ceil(n / 8)`` bytes with
    zero padding bits, so it pays off once more than about ``n / 32`` indices
    are present (then it beats 32-bit raw indices).

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.index.bitmap import BitmapIndices
    >>> codec = BitmapIndices()
    >>> data = codec.encode(np.array([0, 3, 9]), n=10)
    >>> data.hex()
    '0902'
    >>> codec.decode(data, n=10, nnz=3).tolist()
    [0, 3, 9]
    """

    codec_id = "bitmap"

    def encode(self, indices, n):
        indices = _bits.check_indices(indices, n)
        return _bits.positions_to_bitmap(indices, n)

    def max_count(self, data, n):
        return min(n, 8 * len(data))

    def orders(self, data):
        return True  # the set bits' positions, in order, of a stream of n bits

    def decode(self, data, n, nnz):
        what = "bitmap indices"
        n, nnz = _bits.check_counts(n, nnz, what)
        indices = _bits.bitmap_to_positions(data, n, what)
        if indices.size != nnz:
            raise DecodeError(f"{what}: bitmap has {indices.size} bits set, expected {nnz}")
        return indices
