"""The ``zstd`` value codec: byte-shuffled values through the Zstandard byte compressor
of :mod:`deepreduce.codecs._zstd`."""

from __future__ import annotations

from deepreduce.codecs._zstd import _Zstd
from deepreduce.codecs.values._compressed import CompressedShuffledValues
from deepreduce.registry import register_codec


@register_codec
class ZstdValues(_Zstd, CompressedShuffledValues):
    """Byte-shuffled values compressed with zstd; lossless for every dtype.

    Parameters
    ----------
    level : int, default 3
        zstd compression level, 1 (fastest) to 22 (smallest).

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.values.zstd import ZstdValues
    >>> codec = ZstdValues()
    >>> values = np.repeat(np.float32([0.5, -0.25]), 500)
    >>> data = codec.encode(values)
    >>> len(data) < 100
    True
    >>> np.array_equal(codec.decode(data, nnz=1000, dtype=np.float32), values)
    True
    """

    codec_id = "zstd"

    def __init__(self, level: int = 3):  # (the mixin's, stated where the docs read it)
        super().__init__(level)
