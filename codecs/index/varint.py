"""Delta coding plus LEB128 varints: small gaps take one byte."""

from __future__ import annotations

from deepreduce import bits as _bits
from deepreduce.codecs.base import IndexCodec
from deepreduce.registry import register_codec


@register_codec
class VarintIndices(IndexCodec):
    """Gaps between successive indices (minus one), each as a LEB128 varint.

    The stream is the first index, then ``i[k] - i[k-1] - 1`` for each next
    index, 7 bits per byte with the high bit marking "more bytes follow".
    Gaps below 128 (densities above roughly 1%) take one byte.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.index.varint import VarintIndices
    >>> codec = VarintIndices()
    >>> data = codec.encode(np.array([3, 4, 200]), n=1000)
    >>> data.hex()
    '0300c301'
    >>> codec.decode(data, n=1000, nnz=3).tolist()
    [3, 4, 200]
    """

    codec_id = "varint"

    def encode(self, indices, n):
        indices = _bits.check_indices(indices, n)
        return _bits.varint_encode(_bits.gaps(indices))

    def max_count(self, data, n):
        return len(data)  # a byte per varint at least

    def decode(self, data, n, nnz):
        what = "varint indices"
        n, nnz = _bits.check_counts(n, nnz, what)
        return _bits.ungaps(_bits.varint_decode(data, nnz, what), n, what)
