"""The ``deflate`` index codec: gap varints through the DEFLATE (zlib) byte compressor
of :mod:`deepreduce.codecs._deflate`."""

from __future__ import annotations

from deepreduce.codecs._deflate import _Deflate
from deepreduce.codecs.index._compressed import CompressedGapIndices
from deepreduce.registry import register_codec


@register_codec
class DeflateIndices(_Deflate, CompressedGapIndices):
    """Gap varints (as in the ``varint`` codec) compressed with raw DEFLATE.

    Parameters
    ----------
    level : int, default 6
        zlib compression level, 0 (store) to 9 (smallest).

    Notes
    -----
    For uniformly random k = 1% of n = 1M, varint bytes deflate to 9.06
    bits per index against 12.65 for fixed 4-byte gaps (entropy bound 8.08);
    see ``ZstdIndices`` for the comparison with byte-shuffled gaps.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.index.deflate import DeflateIndices
    >>> codec = DeflateIndices(level=9)
    >>> indices = np.arange(0, 10_000, 3)
    >>> data = codec.encode(indices, n=10_000)
    >>> len(data) < indices.size // 50
    True
    >>> np.array_equal(codec.decode(data, n=10_000, nnz=indices.size), indices)
    True
    """

    codec_id = "deflate"

    def __init__(self, level: int = 6):  # (the mixin's, stated where the docs read it)
        super().__init__(level)
