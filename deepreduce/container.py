"""The payload container, format version 1 (specified in docs/format.md).

::

    magic "DR" | version u8 | flags u8 | dtype u8 | ndim varint | dims varint*ndim
    | nnz varint | index spec (varint length + ASCII) | value spec (same)
    | index stream length varint | value stream length varint
    | index stream | value stream | CRC32 of all preceding bytes (u32, little-endian)

Everything the decoder reads is checked before it is trusted, so a malformed
payload raises :class:`~deepreduce.DecodeError` and never drives an allocation.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

from deepreduce.bits import read_varint, write_varint
from deepreduce.errors import DecodeError
from deepreduce.sparse import CODE_DTYPES, DTYPE_CODES, MAX_SIZE

MAGIC = b"DR"
VERSION = 1
#: Flag bit: the value codec sorts values, so indices travel in value order,
#: packed at ceil(log2 n) bits each, and the index spec is empty.
FLAG_VALUE_ORDER = 0x01
KNOWN_FLAGS = FLAG_VALUE_ORDER
MAX_NDIM = 32
MAX_SPEC_LENGTH = 255
_CRC = struct.Struct("<I")


@dataclass(frozen=True)
class Header:
    """What a payload declares about itself (``deepreduce inspect`` prints this)."""

    version: int
    flags: int
    dtype: object
    shape: tuple
    nnz: int
    index_spec: str
    value_spec: str
    index_length: int
    value_length: int
    header_length: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def payload_length(self) -> int:
        return self.header_length + self.index_length + self.value_length + _CRC.size

    @property
    def value_order(self) -> bool:
        return bool(self.flags & FLAG_VALUE_ORDER)


class _Reader:
    """Bounded reads from the header bytes with DecodeError on every shortfall."""

    __slots__ = ("data", "pos")

    def __init__(self, data: memoryview):
        self.data, self.pos = data, 0

    def byte(self, what: str) -> int:
        if self.pos >= len(self.data):
            raise DecodeError(f"payload truncated in the header ({what})")
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self, what: str, limit: int = MAX_SIZE) -> int:
        pos = self.pos
        if pos < len(self.data):
            value = self.data[pos]
            if value <= limit and value < 0x80:  # one byte: most fields of most headers
                self.pos = pos + 1
                return value
        value, self.pos = read_varint(self.data, pos, f"header field {what}", limit)
        return value

    def text(self, what: str) -> str:
        length = self.varint(f"{what} length", MAX_SPEC_LENGTH)
        if self.pos + length > len(self.data):
            raise DecodeError(f"payload truncated in the header ({what})")
        raw = bytes(self.data[self.pos:self.pos + length])
        self.pos += length
        try:
            return raw.decode("ascii")
        except UnicodeDecodeError:
            raise DecodeError(f"{what} is not ASCII: {raw!r}") from None


def _encode_spec(spec: str, what: str) -> bytes:
    raw = spec.encode("ascii")
    if len(raw) > MAX_SPEC_LENGTH:
        raise ValueError(f"{what} spec longer than {MAX_SPEC_LENGTH} bytes: {spec!r}")
    return write_varint(len(raw)) + raw


def pack(dtype, shape, nnz: int, index_spec: str, value_spec: str,
         index_stream: bytes, value_stream: bytes, flags: int = 0) -> bytes:
    """Assemble one payload from its parts (no validation of the streams)."""
    parts = [MAGIC, bytes((VERSION, flags, DTYPE_CODES[dtype])), write_varint(len(shape))]
    parts += [write_varint(d) for d in shape]
    parts += [write_varint(nnz), _encode_spec(index_spec, "index"), _encode_spec(value_spec, "value"),
              write_varint(len(index_stream)), write_varint(len(value_stream)), index_stream, value_stream]
    body = b"".join(parts)
    return body + _CRC.pack(zlib.crc32(body))


def read_header(payload) -> Header:
    """Parse and check the header; the streams are not looked at, the CRC is not checked."""
    try:
        data = memoryview(payload).cast("B")
    except TypeError:
        raise DecodeError(f"payload must be bytes-like, got {type(payload).__name__}") from None
    if len(data) < len(MAGIC) or bytes(data[:2]) != MAGIC:
        raise DecodeError(f"not a deepreduce payload: starts with {bytes(data[:2])!r}, "
                          f"expected magic {MAGIC!r}")
    reader = _Reader(data)
    reader.pos = len(MAGIC)
    version = reader.byte("version")
    if version != VERSION:
        raise DecodeError(f"unsupported format version {version} (this library reads {VERSION})")
    flags = reader.byte("flags")
    if flags & ~KNOWN_FLAGS:
        raise DecodeError(f"unknown flag bits 0x{flags & ~KNOWN_FLAGS:02x} in the header")
    code = reader.byte("dtype")
    if code not in CODE_DTYPES:
        raise DecodeError(f"unknown dtype code {code}")
    ndim = reader.varint("ndim", MAX_NDIM)
    shape = tuple(reader.varint(f"dimension {i}") for i in range(ndim))
    if math.prod(shape) > MAX_SIZE:
        raise DecodeError(f"shape {shape} has more than 2**63 - 1 elements")
    nnz = reader.varint("nnz")
    if nnz > math.prod(shape):
        raise DecodeError(f"nnz {nnz} exceeds the {math.prod(shape)} elements of shape {shape}")
    index_spec = reader.text("index codec spec")
    value_spec = reader.text("value codec spec")
    index_length = reader.varint("index stream length")
    value_length = reader.varint("value stream length")
    return Header(version, flags, CODE_DTYPES[code], shape, nnz, index_spec, value_spec,
                  index_length, value_length, reader.pos)


def unpack(payload, header: Header | None = None) -> tuple[Header, memoryview, memoryview]:
    """Check a payload whole and split it into its header and two streams.

    ``header``: what :func:`read_header` returned for this payload, if the caller
    has it already (it is not parsed twice).
    """
    if header is None:
        header = read_header(payload)
    data = memoryview(payload).cast("B")
    if len(data) < header.payload_length:
        raise DecodeError(f"payload truncated: {len(data)} bytes, the header declares "
                          f"{header.payload_length}")
    if len(data) > header.payload_length:
        raise DecodeError(f"{len(data) - header.payload_length} trailing bytes after the "
                          f"payload's {header.payload_length}")
    body = data[:-_CRC.size]
    (stored,) = _CRC.unpack(data[-_CRC.size:])
    if zlib.crc32(body) != stored:
        raise DecodeError("CRC32 mismatch: the payload is corrupt")
    start = header.header_length
    middle = start + header.index_length
    return header, data[start:middle], data[middle:middle + header.value_length]
