"""The DEFLATE (zlib) byte compressor that the ``deflate`` index and value codecs share
(``deepreduce.codecs.index.deflate``, ``deepreduce.codecs.values.deflate``).

Streams are raw DEFLATE (RFC 1951, no zlib header or Adler-32: the payload
container already has a CRC32), decompressed with an output limit derived
from ``n`` and ``nnz`` so a crafted stream cannot inflate without bound.
An empty set of indices or values is an empty stream.
"""

from __future__ import annotations

import zlib

import numpy as np

from deepreduce.errors import DecodeError


def _check_level(level) -> int:
    if isinstance(level, bool) or not isinstance(level, (int, np.integer)) or not 0 <= level <= 9:
        raise ValueError(f"deflate level must be an integer in [0, 9], got {level!r}")
    return int(level)


#: The largest ratio of output to input a raw DEFLATE stream can reach.
MAX_EXPANSION = 1032


def deflate(data: bytes, level: int) -> bytes:
    """Raw DEFLATE stream of ``data``."""
    return zlib.compress(data, level, wbits=-15)


def inflate(data, limit: int, what: str) -> bytes:
    """Decompress one raw DEFLATE stream producing at most ``limit`` bytes.

    Raises DecodeError if the stream is corrupt, truncated, would produce
    more than ``limit`` bytes, or is followed by trailing bytes.
    """
    # DEFLATE expands at most 1032:1 (258-byte matches in 2-bit codes): a larger
    # declared output cannot be real, and zlib takes no limit beyond 2**63 - 1
    limit = min(limit, MAX_EXPANSION * len(data) + 1024)
    decompressor = zlib.decompressobj(-15)
    try:
        # One byte beyond the limit tells "too long" apart from "exactly full".
        out = decompressor.decompress(data, limit + 1)
    except zlib.error as exc:
        raise DecodeError(f"{what}: corrupt deflate stream ({exc})") from None
    if len(out) > limit:
        raise DecodeError(f"{what}: deflate stream decompresses to more than {limit} bytes")
    if not decompressor.eof:
        raise DecodeError(f"{what}: deflate stream is truncated")
    if decompressor.unused_data:
        raise DecodeError(f"{what}: {len(decompressor.unused_data)} trailing bytes "
                          f"after the deflate stream")
    return out


class _Deflate:
    """The deflate half of both codecs: the level, and the byte (de)compressor."""

    def __init__(self, level: int = 6):
        self.level = _check_level(level)

    def _compress(self, data):
        return deflate(data, self.level)

    def _decompress(self, data, limit, what):
        return inflate(data, limit, what)
