"""The Zstandard byte compressor that the ``zstd`` index and value codecs share
(``deepreduce.codecs.index.zstd``, ``deepreduce.codecs.values.zstd``).

Streams are single zstd frames written without the 4-byte magic number
(``FORMAT_ZSTD1_MAGICLESS``: the payload header already says which codec
made the stream) and without a checksum (the container has a CRC32), but
with the content size, which the decoder checks against a limit derived from
``n`` and ``nnz`` before decompressing anything. An empty set of indices or
values is an empty stream.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from deepreduce.errors import DecodeError

_FORMAT = zstandard.FORMAT_ZSTD1_MAGICLESS


def _check_level(level) -> int:
    if isinstance(level, bool) or not isinstance(level, (int, np.integer)) or not 1 <= level <= 22:
        raise ValueError(f"zstd level must be an integer in [1, 22], got {level!r}")
    return int(level)


#: Each thread's compressors (a compressor serves one thread at a time), by the
#: parameters zstd derives from the level and the input's size: building one costs
#: more than compressing a few KB, and a bundle codes many streams of such sizes.
_compressors = threading.local()


def zstd_compress(data: bytes, level: int) -> bytes:
    """One magicless zstd frame of ``data`` with its content size, no checksum."""
    params = zstandard.ZstdCompressionParameters.from_level(
        level, source_size=len(data), format=_FORMAT, write_content_size=1, write_checksum=0)
    # (every other parameter is fixed above: these are all that vary)
    key = (params.compression_level, params.window_log, params.chain_log, params.hash_log,
           params.search_log, params.min_match, params.target_length, params.strategy)
    cache = getattr(_compressors, "by_params", None)
    if cache is None:
        cache = _compressors.by_params = {}
    compressor = cache.get(key)
    if compressor is None:
        if len(cache) >= 64:  # sizes vary without bound in principle; in practice a few
            cache.clear()
        compressor = cache[key] = zstandard.ZstdCompressor(compression_params=params)
    return compressor.compress(data)


#: The largest ratio of content to frame size zstd can reach (an RLE block holds
#: 128 KiB in 4 bytes); a frame declaring more is refused before any allocation.
MAX_EXPANSION = 32768


def zstd_decompress(data, limit: int, what: str) -> bytes:
    """Decompress one frame made by :func:`zstd_compress`, of at most ``limit`` bytes.

    The frame must declare its content size, at most ``limit``; libzstd
    then refuses to produce more than declared, so memory stays bounded.
    Raises DecodeError for a corrupt, truncated or oversized frame and for
    trailing bytes.
    """
    try:
        declared = zstandard.get_frame_parameters(data, format=_FORMAT).content_size
    except zstandard.ZstdError as exc:
        raise DecodeError(f"{what}: bad zstd frame header ({exc})") from None
    if declared == zstandard.CONTENTSIZE_UNKNOWN:
        raise DecodeError(f"{what}: zstd frame does not declare its content size")
    if declared > min(limit, MAX_EXPANSION * len(data)):
        raise DecodeError(f"{what}: zstd frame of {len(data)} bytes declares {declared} "
                          f"bytes, more than the {min(limit, MAX_EXPANSION * len(data))} "
                          "possible")
    # One output buffer of the declared size: bounded, and much faster than
    # the default 128 KiB chunks for large streams.
    decompressor = zstandard.ZstdDecompressor(format=_FORMAT).decompressobj(
        write_size=max(declared, 1))
    try:
        out = decompressor.decompress(data)
    except zstandard.ZstdError as exc:
        raise DecodeError(f"{what}: corrupt zstd frame ({exc})") from None
    if not decompressor.eof:
        raise DecodeError(f"{what}: zstd frame is truncated")
    if decompressor.unused_data:
        raise DecodeError(f"{what}: {len(decompressor.unused_data)} trailing bytes "
                          f"after the zstd frame")
    if len(out) != declared:
        raise DecodeError(f"{what}: zstd frame produced {len(out)} bytes, declared {declared}")
    return out


class _Zstd:
    """The zstd half of both codecs: the level, and the byte (de)compressor."""

    def __init__(self, level: int = 3):
        self.level = _check_level(level)

    def _compress(self, data):
        return zstd_compress(data, self.level)

    def _decompress(self, data, limit, what):
        return zstd_decompress(data, limit, what)
