"""Vectorised bit-level building blocks shared by the index codecs.

Everything here works on whole numpy arrays; the only Python loops run over
bit or byte positions (at most 64 / 10 iterations), never over elements.
Decoding helpers take a ``what`` string naming the stream and raise
:class:`~deepreduce.DecodeError` with that prefix for any malformed input, so
codec decoders can call them on untrusted bytes directly.

API
---
Stream checks
    :func:`check_indices` (encoder side, ``ValueError``),
    :func:`check_counts` and :func:`check_decoded_indices` (decoder side,
    ``DecodeError``).
Delta coding of strictly increasing indices
    :func:`gaps` / :func:`ungaps`: first index, then successive differences
    minus one, as uint64.
LEB128 varints (7 bits per byte, high bit set on every byte but the last)
    :func:`varint_encode`, :func:`varint_decode` (whole stream),
    :func:`varint_decode_prefix` (``count`` varints from an offset, returns the
    end offset), :func:`read_varint` / :func:`write_varint` (one scalar, for
    small headers), :func:`varint_gap_bytes_bound` (largest varint stream the
    gaps of ``nnz`` indices below ``n`` can need, a safe decompression limit).
Fixed-width bit packing, most significant bit first
    :func:`pack_fixed`, :func:`unpack_fixed`, :func:`packed_bytes`. Value
    ``i`` occupies stream bits ``[i*width, (i+1)*width)``, its most
    significant bit first, stream bit ``b`` being bit ``7 - b % 8`` of byte
    ``b // 8`` (``np.packbits``'s default order, the order of every
    bitstream in :mod:`._entropy`); the padding bits of the last byte are
    zero. Eight values fill exactly ``width`` bytes, so both directions work
    on groups of eight with constant shifts.

Examples
--------
>>> import numpy as np
>>> from deepreduce import bits as _bits
>>> data = _bits.varint_encode(np.array([1, 300], dtype=np.uint64))
>>> data.hex()
'01ac02'
>>> _bits.varint_decode(data, 2, "demo").tolist()
[1, 300]
>>> packed = _bits.pack_fixed(np.array([5, 2, 7], np.uint64), 3)
>>> packed.hex()  # 101 010 111, MSB first
'ab80'
>>> _bits.unpack_fixed(packed, 3, 3, "demo").tolist()
[5, 2, 7]
>>> _bits.ungaps(_bits.gaps(np.array([3, 4, 9])), 10, "demo").tolist()
[3, 4, 9]
"""

from __future__ import annotations

import numpy as np

from deepreduce.errors import DecodeError

try:
    from deepreduce import _varint
except ImportError:  # not compiled (the extension is optional): numpy serves
    _varint = None

#: Universe sizes must stay below this so every index and every partial sum
#: of gaps fits in int64 without wrapping.
MAX_UNIVERSE = 2**62

#: A uint64 needs at most 10 LEB128 bytes (9 * 7 = 63 bits, plus one).
MAX_VARINT_BYTES = 10

_U64 = np.dtype("<u8")
_BE64 = np.dtype(">u8")


# ----------------------------------------------------------------- checks

_INT64 = np.dtype(np.int64)


def check_indices(indices, n: int, check_order: bool = True) -> np.ndarray:
    """Validate encoder input; return it as a contiguous int64 array.

    Raises ``ValueError`` (not DecodeError: this is the caller's mistake)
    unless ``indices`` is 1-D, integral, strictly increasing and within
    ``[0, n)``, and ``0 <= n <= MAX_UNIVERSE``. ``check_order=False`` skips
    the pass that checks the order, for encoders that check it on their
    way (with :func:`check_order_of` or as the compiled Golomb loop does).
    """
    if type(n) is int and 0 <= n <= MAX_UNIVERSE and type(indices) is np.ndarray \
            and indices.dtype == _INT64 and indices.ndim == 1 and indices.flags.c_contiguous:
        # what the pipeline passes: the checks below, on Python ints
        if indices.size:
            first, last = int(indices[0]), int(indices[-1])
            if first < 0 or last >= n:
                raise ValueError(f"indices must lie in [0, {n}), got range [{first}, {last}]")
            if check_order:
                check_order_of(indices)
        return indices
    n = _as_int(n, "n", ValueError)
    if not 0 <= n <= MAX_UNIVERSE:
        raise ValueError(f"n must be in [0, 2**62], got {n}")
    indices = np.asarray(indices)
    if indices.ndim != 1 or (indices.size and indices.dtype.kind not in "iu"):
        raise ValueError(f"indices must be a 1-D integer array, got shape "
                         f"{indices.shape} dtype {indices.dtype}")
    if indices.dtype == np.uint64 and indices.size and indices.max() > MAX_UNIVERSE:
        raise ValueError(f"indices must lie in [0, {n}), got {indices.max()}")
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    if indices.size:
        if indices[0] < 0 or indices[-1] >= n:
            raise ValueError(f"indices must lie in [0, {n}), got range "
                             f"[{indices[0]}, {indices[-1]}]")
        if check_order:
            check_order_of(indices)
    return indices


def check_order_of(indices: np.ndarray) -> None:
    """Raise ``ValueError`` unless the int64 ``indices`` are strictly increasing."""
    if indices.size > 1 and not np.all(indices[1:] > indices[:-1]):
        raise ValueError("indices must be strictly increasing (sorted, unique)")


def check_counts(n: int, nnz: int, what: str) -> tuple[int, int]:
    """Check the universe size and count a decoder was given.

    Returns ``(n, nnz)`` as Python ints; raises DecodeError unless
    ``0 <= nnz <= n <= MAX_UNIVERSE``.
    """
    if type(n) is int and type(nnz) is int and 0 <= nnz <= n <= MAX_UNIVERSE:
        return n, nnz  # (what the pipeline passes: the checks below pass, unformatted)
    n = _as_int(n, f"{what}: n", DecodeError)
    nnz = _as_int(nnz, f"{what}: nnz", DecodeError)
    if not 0 <= n <= MAX_UNIVERSE:
        raise DecodeError(f"{what}: universe size n={n} outside [0, 2**62]")
    if not 0 <= nnz <= n:
        raise DecodeError(f"{what}: nnz={nnz} outside [0, n={n}]")
    return n, nnz


def check_decoded_indices(indices: np.ndarray, n: int, what: str) -> np.ndarray:
    """Raise DecodeError unless ``indices`` is strictly increasing within ``[0, n)``.

    Returns ``indices`` as int64. Works on int64 or uint64 input; uint64
    values above the int64 range are reported as out of range, not wrapped.
    """
    if indices.size:
        first, last = int(indices[0]), int(indices[-1])
        if first < 0 or last >= n:
            raise DecodeError(f"{what}: decoded index range [{first}, {last}] "
                              f"leaves [0, {n})")
        if indices.size > 1 and not np.all(indices[1:] > indices[:-1]):
            raise DecodeError(f"{what}: decoded indices are not strictly increasing")
    return indices.astype(np.int64, copy=False)


def _as_int(value, name, error):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise error(f"{name} must be an integer, got {value!r}")
    return int(value)


# ----------------------------------------------------------------- deltas

def gaps(indices: np.ndarray) -> np.ndarray:
    """Delta-code strictly increasing indices: ``[i0, i1-i0-1, i2-i1-1, ...]`` (uint64).

    Subtracting one makes adjacent indices give 0 and makes the code a
    bijection: any gap sequence whose sum stays below ``n`` decodes to a
    strictly increasing set, so decoders need no separate ordering check.
    """
    indices = np.asarray(indices, dtype=np.int64)
    out = np.empty(indices.size, dtype=np.uint64)
    if indices.size:
        out[0] = indices[0]
        np.subtract(indices[1:], indices[:-1], out=out[1:], casting="unsafe")
        out[1:] -= np.uint64(1)
    return out


def ungaps(gap_values: np.ndarray, n: int, what: str) -> np.ndarray:
    """Inverse of :func:`gaps`; raise DecodeError unless the result lies in ``[0, n)``.

    ``n`` must not exceed ``MAX_UNIVERSE``. Rejecting any gap ``>= n`` first
    means a running sum can only wrap around 2**64 after an earlier partial
    sum already passed ``n``, so checking the largest decoded index suffices.
    """
    gap_values = np.asarray(gap_values, dtype=np.uint64)
    if gap_values.size == 0:
        return np.zeros(0, dtype=np.int64)
    if int(gap_values.max()) >= n:
        raise DecodeError(f"{what}: a gap of {int(gap_values.max())} does not fit "
                          f"in a universe of {n}")
    positions = np.cumsum(gap_values + np.uint64(1), dtype=np.uint64)
    positions -= np.uint64(1)
    if int(positions.max()) >= n:
        raise DecodeError(f"{what}: gaps add up past the universe size {n}")
    return positions.astype(np.int64)


# ----------------------------------------------------------------- varints

def varint_encode(values: np.ndarray) -> bytes:
    """LEB128-encode unsigned integers (low 7-bit group first)."""
    values = np.ascontiguousarray(values, dtype=np.uint64)
    if values.size == 0:
        return b""
    if _varint is not None:  # same bytes, without numpy's fixed costs on short inputs
        return _varint.varint_encode(values)
    groups = max(1, -(-int(values.max()).bit_length() // 7))
    # One row of candidate bytes per value, all flagged "more follows"; the
    # last real byte of each row is then unflagged, and a row-major boolean
    # selection of the real bytes is exactly the concatenated stream.
    rows = np.empty((values.size, groups), dtype=np.uint8)
    lengths = np.ones(values.size, dtype=np.int8)
    for group in range(groups):
        rows[:, group] = (values >> np.uint64(7 * group)).astype(np.uint8) | 0x80
        if group:
            lengths += values >= np.uint64(1 << (7 * group))
    rows[np.arange(values.size), lengths - 1] &= 0x7F
    return rows[np.arange(groups, dtype=np.int8) < lengths[:, None]].tobytes()


def varint_decode_prefix(data, count: int | None, what: str,
                         offset: int = 0) -> tuple[np.ndarray, int]:
    """Decode ``count`` varints starting at byte ``offset`` of ``data``.

    Returns ``(values, end)`` with ``end`` the offset just past the last one;
    bytes after it are left alone. ``count=None`` decodes every varint up to
    the end of ``data``. Raises DecodeError when fewer than ``count`` complete
    varints follow ``offset``, or a varint is longer than 10 bytes, overflows
    64 bits or is not in its shortest form (so each value has one encoding).
    """
    buffer = np.frombuffer(data, dtype=np.uint8)[offset:]
    ends = np.flatnonzero(buffer < 0x80)
    if count is None:
        if buffer.size and (ends.size == 0 or ends[-1] != buffer.size - 1):
            raise DecodeError(f"{what}: varint truncated at the end of the stream")
        count = ends.size
    elif ends.size < count:
        cut = " and ends inside a varint" if buffer.size and buffer[-1] >= 0x80 else ""
        raise DecodeError(f"{what}: stream holds {ends.size} complete varints{cut}, "
                          f"expected {count}")
    if count == 0:
        return np.zeros(0, dtype=np.uint64), offset
    ends = ends[:count]
    lengths = np.diff(ends, prepend=-1)
    if lengths.max() > MAX_VARINT_BYTES:
        raise DecodeError(f"{what}: varint longer than {MAX_VARINT_BYTES} bytes")
    last_bytes = buffer[ends]
    if np.any((lengths > 1) & (last_bytes == 0)):
        raise DecodeError(f"{what}: varint not in its shortest form")
    if np.any((lengths == MAX_VARINT_BYTES) & (last_bytes > 1)):
        raise DecodeError(f"{what}: varint overflows 64 bits")
    used = buffer[:int(ends[-1]) + 1]
    starts = ends - lengths + 1
    group = np.arange(used.size, dtype=np.int64) - np.repeat(starts, lengths)
    parts = (used & 0x7F).astype(np.uint64) << (7 * group).astype(np.uint64)
    values = np.bitwise_or.reduceat(parts, starts)
    return values, offset + int(ends[-1]) + 1


def varint_decode(data, count: int | None, what: str) -> np.ndarray:
    """Decode a stream of exactly ``count`` varints (all of them when ``count`` is None).

    Raises DecodeError when the stream holds fewer or more values than
    ``count``, ends inside a varint, or a varint is malformed (see
    :func:`varint_decode_prefix`).
    """
    values, end = varint_decode_prefix(data, count, what)
    if end != len(data):
        if np.frombuffer(data, dtype=np.uint8)[-1] >= 0x80:
            raise DecodeError(f"{what}: varint truncated at the end of the stream")
        raise DecodeError(f"{what}: stream holds more than the expected {count} varints")
    return values


def write_varint(value: int) -> bytes:
    """LEB128 bytes of one non-negative integer below 2**64 (for small headers)."""
    if 0 <= value < 0x80:  # one byte: most header fields
        return bytes((value,))
    if 0x80 <= value < 0x4000:  # two: most of the others (shapes, lengths, counts)
        return bytes(((value & 0x7F) | 0x80, value >> 7))
    if not 0 <= value < 2**64:
        raise ValueError(f"varint value must be in [0, 2**64), got {value}")
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def read_varint(data, offset: int, what: str = "varint",
                limit: int = 2**64 - 1) -> tuple[int, int]:
    """Read one varint at ``offset``; return ``(value, offset_after_it)``.

    Same strictness as :func:`varint_decode_prefix`; reads at most 10 bytes.
    A value above ``limit`` raises DecodeError too (header fields bound
    themselves this way before anything is sized from them).
    """
    if 0 <= offset < len(data):
        value = data[offset]
        if value < 0x80 and value <= limit:  # one byte: most of them
            return value, offset + 1
    value = 0
    for group in range(MAX_VARINT_BYTES):
        if offset + group >= len(data):
            raise DecodeError(f"{what}: varint truncated at the end of the stream")
        byte = data[offset + group]
        value |= (byte & 0x7F) << (7 * group)
        if byte < 0x80:
            if group and byte == 0:
                raise DecodeError(f"{what}: varint not in its shortest form")
            if value >= 2**64:
                raise DecodeError(f"{what}: varint overflows 64 bits")
            if value > limit:
                raise DecodeError(f"{what} = {value} exceeds its limit {limit}")
            return value, offset + group + 1
    raise DecodeError(f"{what}: varint longer than {MAX_VARINT_BYTES} bytes")


def varint_gap_bytes_bound(n: int, nnz: int) -> int:
    """Most bytes :func:`varint_encode` can emit for ``gaps(indices)`` of ``nnz`` indices in ``[0, n)``.

    Every varint takes one byte, plus one per further 7-bit group. A gap needs
    a second byte only from 128 on, and the gaps sum to less than ``n``, so
    the extra bytes number at most ``n // 128`` (and at most 9 per gap). Used
    as the output limit of decompressors, it keeps them below the size of the
    dense tensor.
    """
    return nnz + min((MAX_VARINT_BYTES - 1) * nnz, n // 128)


# ----------------------------------------------------------------- bit packing

def packed_bytes(nbits: int) -> int:
    """Bytes holding ``nbits`` bits: ``ceil(nbits / 8)``."""
    return (nbits + 7) // 8


def _group_layout(width: int):
    """Where each of the 8 values of a group sits: ``(word, shift_in_word)``.

    A group of 8 values of ``width`` bits is ``width`` bytes, i.e. at most
    ``width / 8`` uint64 words; value ``j`` starts at group bit ``j * width``.
    """
    return [((j * width) >> 6, (j * width) & 63) for j in range(8)]


def pack_fixed(values: np.ndarray, width: int) -> bytes:
    """Pack unsigned integers into ``width`` bits each (0 <= width <= 64), MSB first.

    Returns ``packed_bytes(len(values) * width)`` bytes whose padding bits
    are zero. Raises ValueError if ``width`` is out of range or a value does
    not fit in ``width`` bits.
    """
    if not 0 <= width <= 64:
        raise ValueError(f"bit width must be in [0, 64], got {width}")
    values = np.ascontiguousarray(values, dtype=np.uint64)
    count = values.size
    if count == 0:
        return b""
    if width < 64 and int(values.max()) >> width:
        raise ValueError(f"values do not fit in {width} bits (max {int(values.max())})")
    if width == 0:
        return b""
    if width == 8:  # checked above: every value fits in a byte
        return values.astype(np.uint8).tobytes()
    if width in _IN_A_BYTE:
        return _pack_in_bytes(values, width)
    groups = -(-count // 8)
    if width <= 8:
        return _pack_narrow(values, width, groups)[:packed_bytes(count * width)]
    lanes = np.zeros((groups, 8), dtype=np.uint64)
    lanes.reshape(-1)[:count] = values
    words_per_group = -(-width // 8)
    words = np.zeros((groups, words_per_group), dtype=np.uint64)
    for j, (word, shift) in enumerate(_group_layout(width)):
        lane = lanes[:, j]
        head = 64 - shift - width
        if head >= 0:
            words[:, word] |= lane << np.uint64(head)
        else:
            words[:, word] |= lane >> np.uint64(-head)
            words[:, word + 1] |= lane << np.uint64(64 + head)
    raw = words.astype(_BE64).view(np.uint8).reshape(groups, 8 * words_per_group)
    return raw[:, :width].tobytes()[:packed_bytes(count * width)]


#: Widths whose values never straddle a byte: a byte holds ``8 // width`` of them whole.
_IN_A_BYTE = (1, 2, 4)


def _pack_in_bytes(values, width) -> bytes:
    """Widths 1, 2 and 4 (small codes, such as statq's): byte ``i`` is the OR of its
    ``8 // width`` values shifted into place, one strided pass per place (the general
    path's fixed cost per call dominates a small tensor's)."""
    if width == 1:
        return np.packbits(values.astype(np.uint8)).tobytes()
    per_byte = 8 // width
    codes = np.zeros(-(-values.size // per_byte) * per_byte, dtype=np.uint8)
    codes[:values.size] = values
    codes = codes.reshape(-1, per_byte)
    packed = codes[:, 0] << np.uint8(8 - width)
    for j in range(1, per_byte):
        packed |= codes[:, j] << np.uint8(8 - (j + 1) * width)
    return packed.tobytes()


def _pack_narrow(values, width, groups) -> bytes:
    """Widths up to 8: a group of 8 values is one 64-bit word (its top ``8*width`` bits).

    The words are stored at byte stride ``width``, so consecutive 8-byte
    stores overlap; each word is first completed with the leading bytes of
    the groups that follow it, making every overlapping store write the
    same bytes, whatever order numpy stores them in.
    """
    if values.size != 8 * groups:
        padded = np.zeros(8 * groups, dtype=np.uint64)
        padded[:values.size] = values
        values = padded
    lanes = values.reshape(groups, 8)
    words = lanes[:, 0] << np.uint64(64 - width)
    for j in range(1, 8):
        words |= lanes[:, j] << np.uint64(64 - (j + 1) * width)
    for ahead in range(1, 8):
        if 8 * width * ahead >= 64:
            break
        words[:-ahead] |= words[ahead:] >> np.uint64(8 * width * ahead)
    out = np.zeros(groups * width + 8, dtype=np.uint8)
    np.ndarray(shape=(groups,), dtype=_BE64, buffer=out, strides=(width,))[:] = words
    return out[:groups * width].tobytes()


def unpack_fixed(data, count: int, width: int, what: str) -> np.ndarray:
    """Inverse of :func:`pack_fixed`; returns ``count`` values.

    ``data`` must be exactly ``packed_bytes(count * width)`` bytes with zero
    padding bits, else DecodeError. The result is uint16 for widths up to 8
    (callers widen it in their first arithmetic step), uint64 otherwise.
    With ``width == 0`` the stream is empty whatever ``count`` is: callers
    must bound ``count`` themselves before calling.
    """
    if not 0 <= width <= 64:
        raise DecodeError(f"{what}: bit width {width} outside [0, 64]")
    nbytes = packed_bytes(count * width)
    if len(data) != nbytes:
        raise DecodeError(f"{what}: stream holds {len(data)} bytes, expected {nbytes} "
                          f"for {count} values of {width} bits")
    if width == 0 or count == 0:
        return np.zeros(count, dtype=np.uint16 if width <= 8 else np.uint64)
    if width == 8:  # one value a byte, no padding: the bytes are the values
        return np.frombuffer(data, dtype=np.uint8, count=count).astype(np.uint16)
    padding = 8 * nbytes - count * width
    if padding and data[nbytes - 1] & ((1 << padding) - 1):
        raise DecodeError(f"{what}: padding bits of the last byte are not zero")
    if width in _IN_A_BYTE:  # (the inverse of _pack_in_bytes)
        packed = np.frombuffer(data, dtype=np.uint8, count=nbytes)
        if width == 1:
            return np.unpackbits(packed, count=count).astype(np.uint16)
        lanes = np.empty((nbytes, 8 // width), dtype=np.uint16)
        for j in range(8 // width):
            np.bitwise_and(packed >> np.uint8(8 - (j + 1) * width), np.uint8((1 << width) - 1),
                           out=lanes[:, j])
        return lanes.reshape(-1)[:count]
    groups = -(-count // 8)
    if width <= 8:
        # Byte pairs as 16-bit words; value j of a group sits in pair
        # (j*width) // 8 at a constant shift.
        raw = np.zeros(groups * width + 1, dtype=np.uint8)
        raw[:nbytes] = np.frombuffer(data, dtype=np.uint8, count=nbytes)
        pairs = raw[:-1].astype(np.uint16) << 8
        pairs |= raw[1:]
        pairs = pairs.reshape(groups, width)
        starts = np.arange(8) * width
        lanes = pairs[:, starts >> 3]
        lanes >>= (16 - (starts & 7) - width).astype(np.uint16)
        lanes &= np.uint16((1 << width) - 1)
        return lanes.reshape(-1)[:count]
    words_per_group = -(-width // 8)
    raw = np.zeros((groups, 8 * words_per_group), dtype=np.uint8)
    flat = np.zeros(groups * width, dtype=np.uint8)
    flat[:nbytes] = np.frombuffer(data, dtype=np.uint8, count=nbytes)
    raw[:, :width] = flat.reshape(groups, width)
    words = raw.view(_BE64).astype(np.uint64)
    lanes = np.empty((groups, 8), dtype=np.uint64)
    mask = np.uint64((1 << width) - 1)
    for j, (word, shift) in enumerate(_group_layout(width)):
        head = 64 - shift - width
        if head >= 0:
            lanes[:, j] = (words[:, word] >> np.uint64(head)) & mask
        else:
            lanes[:, j] = ((words[:, word] << np.uint64(-head))
                           | (words[:, word + 1] >> np.uint64(64 + head))) & mask
    return lanes.reshape(-1)[:count]


# ----------------------------------------------------------------- bitmaps

def positions_to_bitmap(positions: np.ndarray, nbits: int) -> bytes:
    """Bitmap of ``nbits`` bits with the given (strictly increasing) positions set.

    Bit ``p`` is bit ``p % 8`` of byte ``p // 8`` (``np.packbits`` with
    ``bitorder="little"``). Costs O(len(positions)) plus zeroing the bitmap;
    builds an ``nbits``-byte array only when at least one bit in eight is set.
    """
    positions = np.asarray(positions, dtype=np.int64)
    if 8 * positions.size >= nbits:
        # dense (a small tensor sent whole): one mask costs less than grouping by byte
        mask = np.zeros(nbits, dtype=bool)
        mask[positions] = True
        return np.packbits(mask, bitorder="little").tobytes()
    out = np.zeros(packed_bytes(nbits), dtype=np.uint8)
    if positions.size:
        byte = positions >> 3
        masks = np.left_shift(1, positions & 7).astype(np.uint8)
        run_starts = np.flatnonzero(np.diff(byte, prepend=-1))
        out[byte[run_starts]] = np.bitwise_or.reduceat(masks, run_starts)
    return out.tobytes()


#: Bitmaps up to this many bytes are expanded whole when decoded.
_SMALL_BITMAP = 256


def bitmap_to_positions(data, nbits: int, what: str) -> np.ndarray:
    """Set positions (int64, increasing) of a bitmap made by :func:`positions_to_bitmap`.

    Raises DecodeError unless ``data`` is exactly ``ceil(nbits / 8)`` bytes
    with zero padding bits. Only the non-zero bytes are expanded to bits, so
    sparse bitmaps decode in O(nbits / 8 + set bits).
    """
    expected = packed_bytes(nbits)
    if len(data) != expected:
        raise DecodeError(f"{what}: bitmap holds {len(data)} bytes, expected "
                          f"{expected} for {nbits} bits")
    buffer = np.frombuffer(data, dtype=np.uint8)
    if nbits % 8 and buffer[-1] >> (nbits % 8):
        raise DecodeError(f"{what}: padding bits of the bitmap's last byte are not zero")
    if expected > _SMALL_BITMAP:
        if np.bitwise_and.reduce(buffer[:nbits >> 3]) == 0xFF and \
                (nbits % 8 == 0 or buffer[-1] == (1 << nbits % 8) - 1):
            return np.arange(nbits, dtype=np.int64)  # every bit set: small tensors sent whole
        nonzero_bytes = np.flatnonzero(buffer)
        if 4 * nonzero_bytes.size < 3 * expected:
            # (one flat scan of the expanded bytes: a 2-D np.nonzero would write two
            # index arrays, a row and a column for every set bit)
            bits = np.flatnonzero(np.unpackbits(buffer[nonzero_bytes], bitorder="little"))
            return nonzero_bytes[bits >> 3] * 8 + (bits & 7)
    # small or dense: expanding every byte costs less than finding the non-zero ones
    return np.flatnonzero(np.unpackbits(buffer, bitorder="little"))
