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


#: Each spec string's length-prefixed ASCII bytes, as :func:`pack` writes them: a
#: training step packs the same few specs into every payload.
_SPEC_BYTES: dict = {}
_MAX_SPECS = 256


def _encode_spec(spec: str, what: str) -> bytes:
    if type(spec) is str:  # (a str subclass may encode differently: not remembered)
        raw = _SPEC_BYTES.get(spec)
        if raw is not None:
            return raw
    raw = spec.encode("ascii")
    if len(raw) > MAX_SPEC_LENGTH:
        raise ValueError(f"{what} spec longer than {MAX_SPEC_LENGTH} bytes: {spec!r}")
    raw = write_varint(len(raw)) + raw
    if type(spec) is str:
        if len(_SPEC_BYTES) >= _MAX_SPECS:
            _SPEC_BYTES.clear()
        _SPEC_BYTES[spec] = raw
    return raw


def pack(dtype, shape, nnz: int, index_spec: str, value_spec: str,
         index_stream: bytes, value_stream: bytes, flags: int = 0) -> bytes:
    """Assemble one payload from its parts (no validation of the streams)."""
    head = b"".join([MAGIC, bytes((VERSION, flags, DTYPE_CODES[dtype])),
                     write_varint(len(shape)), *[write_varint(d) for d in shape],
                     write_varint(nnz), _encode_spec(index_spec, "index"),
                     _encode_spec(value_spec, "value"), write_varint(len(index_stream)),
                     write_varint(len(value_stream))])
    # the checksum runs over the parts: the streams are copied once, into the payload
    crc = zlib.crc32(value_stream, zlib.crc32(index_stream, zlib.crc32(head)))
    return b"".join((head, index_stream, value_stream, _CRC.pack(crc)))


def read_header(payload) -> Header:
    """Parse and check the header; the streams are not looked at, the CRC is not checked."""
    try:
        data = memoryview(payload).cast("B")
    except TypeError:
        raise DecodeError(f"payload must be bytes-like, got {type(payload).__name__}") from None
    header = _read_usual_header(data)
    return _read_header(data) if header is None else header


def _read_usual_header(data: memoryview) -> Header | None:
    """:func:`_read_header` of ``data`` for the headers encoders write (every varint in
    its shortest form below 2**63, nothing out of bounds), in a third of its time; None
    for anything else, which :func:`_read_header` then reads again, to accept it or to
    say what is wrong with it.

    Every check of :func:`_read_header` is made here too, so that what this returns
    is what it would return (``tests/test_container.py`` compares the two).
    """
    end = len(data)
    if end < 8 or data[0] != MAGIC[0] or data[1] != MAGIC[1] or data[2] != VERSION \
            or data[3] & ~KNOWN_FLAGS or data[4] not in CODE_DTYPES:
        return None
    ndim = data[5]
    if ndim > MAX_NDIM:
        return None
    # The header's fields are read left to right; ``pos`` stays within ``end`` before
    # each read. A varint of nine bytes or fewer holds 63 bits at most: no field's
    # limit (MAX_SIZE) can be passed.
    fields, pos = [], 6
    # the dimensions, nnz, the two specs' lengths and texts, the two streams' lengths
    for text in (False,) * ndim + (False, True, True, False, False):
        if pos >= end:
            return None
        value = data[pos]
        pos += 1
        if value >= 0x80:
            value &= 0x7F
            for shift in range(7, 63, 7):
                if pos >= end:
                    return None
                byte = data[pos]
                pos += 1
                value |= (byte & 0x7F) << shift
                if byte < 0x80:
                    break
            else:
                return None
            if byte == 0:  # (not its shortest form)
                return None
        if text:
            if value > MAX_SPEC_LENGTH or pos + value > end:
                return None
            raw = bytes(data[pos:pos + value])
            if not raw.isascii():
                return None
            value, pos = raw.decode("ascii"), pos + value
        fields.append(value)
    shape = tuple(fields[:ndim])
    nnz, index_spec, value_spec, index_length, value_length = fields[ndim:]
    size = math.prod(shape)
    if size > MAX_SIZE or nnz > size:
        return None
    # (the fields straight into the instance: the frozen dataclass's __init__ sets them
    # one object.__setattr__ at a time, and took a third of this function's time)
    header = _new(Header)
    _setattr(header, "__dict__", {
        "version": VERSION, "flags": data[3], "dtype": CODE_DTYPES[data[4]], "shape": shape,
        "nnz": nnz, "index_spec": index_spec, "value_spec": value_spec,
        "index_length": index_length, "value_length": value_length, "header_length": pos})
    return header


_new, _setattr = object.__new__, object.__setattr__


def _read_header(data: memoryview) -> Header:
    """:func:`read_header` of any bytes, field by field, with a DecodeError naming the
    first thing wrong."""
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
    length = header.payload_length
    if len(data) < length:
        raise DecodeError(f"payload truncated: {len(data)} bytes, the header declares "
                          f"{length}")
    if len(data) > length:
        raise DecodeError(f"{len(data) - length} trailing bytes after the "
                          f"payload's {length}")
    body = data[:-_CRC.size]
    (stored,) = _CRC.unpack(data[-_CRC.size:])
    if zlib.crc32(body) != stored:
        raise DecodeError("CRC32 mismatch: the payload is corrupt")
    start = header.header_length
    middle = start + header.index_length
    return header, data[start:middle], data[middle:middle + header.value_length]
