"""The ``zstd`` index codec: gap varints through the Zstandard byte compressor
of :mod:`deepreduce.codecs._zstd`."""

from __future__ import annotations

from deepreduce.codecs._zstd import _Zstd
from deepreduce.codecs.index._compressed import CompressedGapIndices
from deepreduce.registry import register_codec


@register_codec
class ZstdIndices(_Zstd, CompressedGapIndices):
    """Gap varints (as in the ``varint`` codec) compressed with zstd.

    Parameters
    ----------
    level : int, default 3
        zstd compression level, 1 (fastest) to 22 (smallest).

    Notes
    -----
    Measured on uniformly random k = 1% of n = 1M (entropy bound 8.08 bits
    per index), zstd level 3: varint gap bytes 9.00 bits per index, fixed
    4-byte gaps 11.61, byte-shuffled 3-byte gaps 8.83. Byte shuffling wins
    by 2% there but loses 10% on runs of 4 adjacent indices (3.79 against
    3.46) and needs a width per universe size, so the codec keeps varints.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.index.zstd import ZstdIndices
    >>> codec = ZstdIndices(level=9)
    >>> indices = np.arange(0, 10_000, 3)
    >>> data = codec.encode(indices, n=10_000)
    >>> len(data) < indices.size // 50
    True
    >>> np.array_equal(codec.decode(data, n=10_000, nnz=indices.size), indices)
    True
    """

    codec_id = "zstd"

    def __init__(self, level: int = 3):  # (the mixin's, stated where the docs read it)
        super().__init__(level)
