"""The frames the communicators exchange (specified in docs/collectives.md).

::

    frame          := kind u8 | body
    kind 0 ERROR   body = UTF-8 message: the sender could not take part
    kind 1 SPARSE  body = deepreduce payload (container v1) of one index range,
                   indices re-based to the range
    kind 2 DENSE   body = container v1 payload with nnz = size, empty index spec
                   and index stream: every value of the range, in order
    kind 3 BLOCKS  body = varint block_size | container v1 payload of shape
                   (blocks in range, block_size) whose nnz rows are the non-zero
                   blocks: the index stream holds their block numbers, the value
                   stream their nnz * block_size values, row after row
    kind 4 COUNTS  body = varint nnz | varint index bytes | varint value bytes:
                   what ``algorithm="auto"`` agrees on before it chooses

The first frame of every reduction also carries the sender's signature
(``varint length | ASCII``, see :func:`signed`), so that ranks which disagree
on shape, dtype or settings find out in the first collective, all of them.
Readers trust nothing: every malformed frame raises DecodeError.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from deepreduce import container
from deepreduce.bits import read_varint, write_varint
from deepreduce.errors import DecodeError
from deepreduce.pipeline import decode as decode_payload
from deepreduce.registry import get_codec

ERROR, SPARSE, DENSE, BLOCKS, COUNTS = 0, 1, 2, 3, 4
MAX_SIGNATURE = 1024


def signed(signature: str, frame: bytes) -> bytes:
    """Prefix ``frame`` with ``signature``."""
    raw = signature.encode("ascii")
    if len(raw) > MAX_SIGNATURE:
        raise ValueError(f"signature longer than {MAX_SIGNATURE} bytes")
    return write_varint(len(raw)) + raw + frame


def read_signed(frame) -> tuple[str, memoryview]:
    """Split a signed frame into its signature and the frame proper."""
    view = memoryview(frame).cast("B")
    length, pos = read_varint(view, 0, "signature length", MAX_SIGNATURE)
    if pos + length > len(view):
        raise DecodeError("frame truncated in the signature")
    try:
        signature = bytes(view[pos:pos + length]).decode("ascii")
    except UnicodeDecodeError:
        raise DecodeError("frame signature is not ASCII") from None
    return signature, view[pos + length:]


def error_frame(message: str) -> bytes:
    return bytes((ERROR,)) + message.encode("utf-8", "replace")


def sparse_frame(payload: bytes) -> bytes:
    return bytes((SPARSE,)) + payload


def dense_frame(value_stream: bytes, dtype, length: int, value_spec: str) -> bytes:
    return bytes((DENSE,)) + container.pack(dtype, (length,), length, "", value_spec,
                                            b"", value_stream)


def blocks_frame(index_stream: bytes, value_stream: bytes, dtype, blocks_in_range: int,
                 block_size: int, count: int, index_spec: str, value_spec: str) -> bytes:
    return (bytes((BLOCKS,)) + write_varint(block_size)
            + container.pack(dtype, (blocks_in_range, block_size), count, index_spec,
                             value_spec, index_stream, value_stream))


def counts_frame(nnz: int, index_bytes: int, value_bytes: int) -> bytes:
    return bytes((COUNTS,)) + write_varint(nnz) + write_varint(index_bytes) \
        + write_varint(value_bytes)


def read_counts(frame, n: int) -> tuple[int, int, int]:
    """``(nnz, index bytes, value bytes)`` of a COUNTS frame about a tensor of ``n`` elements."""
    view = memoryview(frame).cast("B")
    if not len(view) or view[0] != COUNTS:
        raise DecodeError(f"expected a counts frame, got kind {view[0] if len(view) else None}")
    nnz, pos = read_varint(view, 1, "non-zeros", n)
    index_bytes, pos = read_varint(view, pos, "index bytes", 2**62)
    value_bytes, pos = read_varint(view, pos, "value bytes", 2**62)
    if pos != len(view):
        raise DecodeError(f"counts frame has {len(view) - pos} trailing bytes")
    return nnz, index_bytes, value_bytes


@dataclass
class Blocks:
    """Non-zero blocks of one range: sorted block numbers and a (count, block_size) array."""

    ids: np.ndarray
    rows: np.ndarray


def _codec(spec: str, family: str):
    try:
        return get_codec(spec, family=family)
    except ValueError as exc:
        raise DecodeError(f"frame names a {family} codec this library cannot build: {exc}") \
            from None


def _check_dtype(header, dtype, what):
    if header.dtype != dtype:
        raise DecodeError(f"{what} holds {header.dtype} values, expected {dtype}")


def _values(header, stream, count, dtype, what):
    codec = _codec(header.value_spec, "value")
    if codec.sorts_values or header.value_order:
        raise DecodeError(f"{what} must not use a value-ordering codec")
    values = codec.decode(bytes(stream), count, dtype)
    if values.shape != (count,) or values.dtype != dtype:
        raise DecodeError(f"value codec {header.value_spec!r} returned {values.shape} "
                          f"{values.dtype}, expected ({count},) {dtype}")
    return values


def read_frame(frame, length: int, dtype, block_size: int | None = None):
    """Decode one frame about a range of ``length`` elements of ``dtype``.

    Returns a :class:`SparseTensor` of shape ``(length,)`` (SPARSE), a dense
    1-D array (DENSE) or :class:`Blocks` (BLOCKS, only when ``block_size`` is
    given). An ERROR frame raises :class:`PeerError` with the sender's message.
    """
    view = memoryview(frame).cast("B")
    if not len(view):
        raise DecodeError("empty frame")
    kind, body = view[0], view[1:]
    if kind == ERROR:
        raise PeerError(bytes(body).decode("utf-8", "replace"))
    if kind == SPARSE:
        st = decode_payload(body)
        if st.shape != (length,) or st.dtype != dtype:
            raise DecodeError(f"sparse frame holds {st.shape} {st.dtype}, expected "
                              f"({length},) {dtype}")
        return st
    if kind == DENSE:
        header, index_stream, value_stream = container.unpack(body)
        if header.shape != (length,) or header.nnz != length or header.index_spec \
                or header.index_length or header.flags:
            raise DecodeError(f"dense frame declares shape {header.shape}, nnz {header.nnz}, "
                              f"index spec {header.index_spec!r}; expected all {length} values "
                              "and no indices")
        _check_dtype(header, dtype, "dense frame")
        return _values(header, value_stream, length, dtype, "dense frame")
    if kind == BLOCKS and block_size is not None:
        declared, pos = read_varint(view, 1, "block size", 2**31)
        if declared != block_size:
            raise DecodeError(f"block frame uses blocks of {declared}, expected {block_size}")
        header, index_stream, value_stream = container.unpack(view[pos:])
        blocks_in_range = -(-length // block_size)
        if header.shape != (blocks_in_range, block_size):
            raise DecodeError(f"block frame has shape {header.shape}, expected "
                              f"({blocks_in_range}, {block_size})")
        _check_dtype(header, dtype, "block frame")
        index_codec = _codec(header.index_spec, "index")
        ids = np.asarray(index_codec.decode(bytes(index_stream), blocks_in_range, header.nnz))
        if ids.shape != (header.nnz,) or ids.dtype != np.int64:
            raise DecodeError(f"index codec {header.index_spec!r} returned {ids.shape} "
                              f"{ids.dtype}, expected ({header.nnz},) int64")
        if ids.size and (ids[0] < 0 or ids[-1] >= blocks_in_range
                         or (ids.size > 1 and not (ids[1:] > ids[:-1]).all())):
            raise DecodeError("block numbers are not increasing within the range")
        values = _values(header, value_stream, header.nnz * block_size, dtype, "block frame")
        return Blocks(ids, values.reshape(header.nnz, block_size))
    raise DecodeError(f"unknown frame kind {kind}")


class PeerError(ValueError):
    """Another rank reported that it could not take part in the reduction."""

