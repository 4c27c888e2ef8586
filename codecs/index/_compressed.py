"""The index half of the byte-compressor codecs (``deflate``, ``zstd``): gap varints
through a byte compressor.

A subclass supplies only ``_compress(data)`` and ``_decompress(data, limit, what)``
(:mod:`deepreduce.codecs._deflate`, :mod:`deepreduce.codecs._zstd`); the limit is the
largest output the declared counts allow, so a crafted stream cannot inflate without
bound. An empty set is an empty stream. The value half is
:mod:`deepreduce.codecs.values._compressed`.
"""

from __future__ import annotations

from deepreduce import bits as _bits
from deepreduce.codecs.base import IndexCodec, no_indices


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
            return no_indices(data, what)
        varints = self._decompress(data, _bits.varint_gap_bytes_bound(n, nnz), what)
        return _bits.ungaps(_bits.varint_decode(varints, nnz, what), n, what)
