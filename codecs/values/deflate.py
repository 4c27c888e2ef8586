"""The ``deflate`` value codec: byte-shuffled values through the DEFLATE (zlib) byte compressor
of :mod:`deepreduce.codecs._deflate`."""

from __future__ import annotations

from deepreduce.codecs._deflate import _Deflate
from deepreduce.codecs.values._compressed import CompressedShuffledValues
from deepreduce.registry import register_codec


@register_codec
class DeflateValues(_Deflate, CompressedShuffledValues):
    """Byte-shuffled values compressed with raw DEFLATE; lossless for every dtype.

    Parameters
    ----------
    level : int, default 6
        zlib compression level, 0 (store) to 9 (smallest).

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.values.deflate import DeflateValues
    >>> codec = DeflateValues()
    >>> values = np.repeat(np.float32([0.5, -0.25]), 500)
    >>> data = codec.encode(values)
    >>> len(data) < 100
    True
    >>> np.array_equal(codec.decode(data, nnz=1000, dtype=np.float32), values)
    True
    """

    codec_id = "deflate"

    def __init__(self, level: int = 6):  # (the mixin's, stated where the docs read it)
        super().__init__(level)
