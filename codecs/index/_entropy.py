"""Vectorised bitstream and entropy-coding building blocks for the gap codecs.

Used by :mod:`.golomb`, :mod:`.huffman`, :mod:`.runs` and :mod:`.auto`.
Every stream here is **MSB-first**: stream bit ``b`` is bit ``7 - b % 8`` of
byte ``b // 8`` (``np.packbits``'s default order), so a code read left to
right is read from the most significant bit down, which is what unary codes,
canonical Huffman codes and table-driven decoders want.

All functions work on whole numpy arrays. The only Python loops run over
the 8 lanes of a packing group, over code lengths (at most 64) or over the
alphabet of a Huffman code (at most a few hundred symbols), never over the
elements of a stream.

API
---
Fixed-width fields
    :func:`pack_planes` / :func:`unpack_planes`: the bits of
    :func:`deepreduce.bits.pack_fixed` (which writes fixed-width
    fields in this same MSB-first order) cut into byte-aligned planes of 8,
    4, 2 and 1 bits, decoded by table lookups.
Variable-width fields
    :func:`pack_varlen` / :func:`unpack_varlen`: values of given bit lengths
    written back to back; the reader gathers a 64-bit window per value.
Set bits
    :func:`set_bit_positions`: where the ones of a unary code are.
Peeking
    :func:`byte_windows`: a big-endian 64-bit window starting at every byte,
    for table-driven decoders that look at the next few bits of many lanes.
Canonical Huffman codes
    :func:`huffman_lengths` (length-limited), :func:`canonical_codes`,
    :func:`decode_table`, :func:`pack_code_lengths` / :func:`unpack_code_lengths`.
Geometric model
    :func:`golomb_parameter`, :func:`golomb_rice_parameter`,
    :func:`golomb_expected_bits`: the optimal Golomb parameter for a
    geometric source of a given mean and the expected code length.
Bucketing of positive integers
    :func:`bucket_symbols` / :func:`bucket_values`: an Elias-gamma-like
    split of ``v >= 1`` into a small symbol (bit length and the ``precision``
    bits below the leading one) and raw offset bits; :func:`bucket_histogram`
    counts the symbols too.

Examples
--------
>>> import numpy as np
>>> from deepreduce.codecs.index import _entropy
>>> values, lengths = np.array([1, 0, 5], np.uint64), np.array([1, 2, 3])
>>> packed, nbits = _entropy.pack_varlen(values, lengths)
>>> packed.hex(), nbits  # 1 00 101
('94', 6)
>>> _entropy.unpack_varlen(packed, lengths, "demo").tolist()
[1, 0, 5]
"""

from __future__ import annotations

import functools
import heapq
import math

import numpy as np

from deepreduce.bits import pack_fixed, packed_bytes, unpack_fixed
from deepreduce.errors import DecodeError

try:
    from deepreduce.codecs.index import _entropyc
except ImportError:  # not compiled (the extension is optional): numpy serves
    _entropyc = None

_U64 = np.uint64
_BE64 = np.dtype(">u8")

#: Which implementation buckets values (:func:`bucket_symbols`) and runs the
#: Huffman codec's loops (:mod:`.huffman`): ``"compiled"`` (the C extension
#: ``deepreduce.codecs.index._entropyc``, built by ``pip install``) or ``"numpy"``. Both give
#: the same bits.
IMPLEMENTATION = "numpy" if _entropyc is None else "compiled"

#: Longest Huffman code built here. Decode tables have ``2**MAX_CODE_LENGTH``
#: entries, and three codes plus a 7-bit misalignment fit in one 64-bit window.
MAX_CODE_LENGTH = 15


# ------------------------------------------------------------ bit planes

def plane_widths(width: int) -> list[int]:
    """Split ``width`` into byte-friendly parts, most significant first: 8s, then 4, 2, 1."""
    return [8] * (width // 8) + [part for part in (4, 2, 1) if width & part]


def pack_planes(values: np.ndarray, width: int) -> bytes:
    """Pack a multiple of 8 values of ``width`` bits as byte-aligned planes.

    The bits of each value are cut into parts of 8, 4, 2 and 1 bits (see
    :func:`plane_widths`); part after part, the parts of all values are
    packed ``8 / part`` to a byte, MSB first. With a multiple of 8 values
    no plane needs padding, so the size is exactly ``len(values) * width / 8``
    bytes, and unpacking is a few byte-wide shifts per plane: no gathers.
    """
    out = []
    shift = width
    for part in plane_widths(width):
        shift -= part
        digits = ((values >> shift) & ((1 << part) - 1)).astype(np.uint8)
        per_byte = 8 // part
        digits = digits.reshape(-1, per_byte)
        packed = digits[:, 0] << np.uint8(8 - part) if per_byte > 1 else digits[:, 0].copy()
        for j in range(1, per_byte):
            packed |= digits[:, j] << np.uint8(8 - part * (j + 1))
        out.append(packed.tobytes())
    return b"".join(out)


def _spread_tables() -> dict:
    """Per byte value: its 8 / part digits of ``part`` bits, one per byte, in memory order."""
    byte = np.arange(256, dtype=np.uint64)
    tables = {}
    for part, dtype in ((4, np.uint16), (2, np.uint32), (1, _U64)):
        per_byte = 8 // part
        spread = np.zeros(256, dtype=_U64)
        for j in range(per_byte):
            digit = (byte >> _U64(8 - part * (j + 1))) & _U64((1 << part) - 1)
            spread |= digit << _U64(8 * j)
        tables[part] = spread.astype(dtype).astype(np.dtype(dtype).newbyteorder("<"))
    return tables


_SPREAD = _spread_tables()


def unpack_planes(data, count: int, width: int, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`pack_planes` for ``count`` (a multiple of 8) values.

    ``data`` must hold at least ``count * width / 8`` bytes (callers check).
    The values go to ``out`` (any integer array of ``count`` elements wide
    enough) or to a new array, uint8 up to 8 bits, uint16 up to 16, else
    uint64. Each plane is spread to one digit per byte by a 256-entry table
    lookup per byte.
    """
    if out is None:
        out = np.empty(count, dtype=np.uint8 if width <= 8 else
                       np.uint16 if width <= 16 else _U64)
    if width == 0:
        out[:] = 0
    offset = 0
    for number, part in enumerate(plane_widths(width)):
        nbytes = count * part // 8
        chunk = np.frombuffer(data, dtype=np.uint8, count=nbytes, offset=offset)
        offset += nbytes
        digits = chunk if part == 8 else np.take(_SPREAD[part], chunk).view(np.uint8)
        if number == 0:
            out[:] = digits
        else:
            out <<= part
            out |= digits
    return out


# ------------------------------------------------------------ variable width

def pack_varlen(values: np.ndarray, lengths: np.ndarray) -> tuple[bytes, int]:
    """Write ``values[i]`` in ``lengths[i]`` bits (0..64), back to back, MSB first.

    Returns ``(data, nbits)``: the zero-padded bytes and the number of bits
    written. Values must fit their lengths. Works in four arrays of the
    input size, updated in place.
    """
    shifts = np.array(lengths, dtype=_U64)  # a copy: reused below
    bounds = np.cumsum(shifts)
    nbits = int(bounds[-1]) if bounds.size else 0
    if nbits == 0:
        return b"", 0
    # Left-align each field in 64 bits (numpy shifts by 64 give 0) ...
    np.subtract(_U64(64), shifts, out=shifts)
    aligned = np.left_shift(np.asarray(values, dtype=_U64), shifts)
    # ... find where it starts (end - length = end + (64 - length) - 64) ...
    bounds += shifts
    bounds -= _U64(64)
    np.bitwise_and(bounds, _U64(63), out=shifts)
    # ... and split it between the word it starts in and the next one.
    heads = aligned >> shifts
    np.subtract(_U64(64), shifts, out=shifts)
    spills = np.left_shift(aligned, shifts, out=aligned)
    # Fields starting in the same word have disjoint bits, so the word is
    # their sum: a difference of running sums, exact modulo 2**64. Only the
    # last field starting in a word can spill into the next one.
    nwords = (nbits + 63) // 64
    last = np.searchsorted(bounds, np.arange(1, nwords + 1, dtype=_U64) << _U64(6)) - 1
    running = np.cumsum(heads, out=heads)
    words = np.zeros(nwords + 1, dtype=_U64)
    words[:nwords] = running[last]
    words[1:nwords] -= running[last[:-1]]
    words[1:] |= spills[last]
    return words.astype(_BE64).tobytes()[:packed_bytes(nbits)], nbits


def byte_windows(data, extra: int = 0) -> np.ndarray:
    """Big-endian uint64 window starting at every byte of ``data`` (zeros past its end).

    Entry ``i`` holds bytes ``i .. i+7``; ``extra`` more entries past the end
    are available (all zero bytes). Returns a read-only strided view: index
    it with an array to gather windows.
    """
    padded = np.zeros(len(data) + extra + 8, dtype=np.uint8)
    padded[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    return np.ndarray(shape=(len(data) + extra + 1,), dtype=_BE64, buffer=padded,
                      strides=(1,))


def unpack_varlen(data, lengths: np.ndarray, what: str, bit_offset: int = 0,
                  windows: np.ndarray | None = None) -> np.ndarray:
    """Read fields of the given bit lengths (0..64) written by :func:`pack_varlen`.

    Fields start at ``bit_offset`` and follow each other. Pass ``windows``
    (native uint64 :func:`byte_windows` of ``data`` with at least one entry
    of padding) when the caller has them. Raises DecodeError when ``data``
    holds fewer bits than the fields need; bits after the last field are
    not looked at. Returns uint64; works in four arrays of the input size.
    """
    widths = np.array(lengths, dtype=np.int64)  # a copy: reused below
    if widths.size == 0:
        return np.zeros(0, dtype=_U64)
    starts = np.cumsum(widths)
    needed = bit_offset + int(starts[-1])
    if needed > 8 * len(data):
        raise DecodeError(f"{what}: fields need {needed} bits, stream holds {8 * len(data)}")
    starts -= widths
    starts += bit_offset
    if windows is None:
        windows = byte_windows(data, extra=1)
        if 4 * widths.size > len(data):
            # Converting every window to native order once beats converting
            # each gathered one when the fields are dense.
            windows = windows.astype(_U64)
    byte = starts >> 3
    values = np.take(windows, byte).astype(_U64, copy=False)
    shift = np.bitwise_and(starts, 7, out=starts).view(_U64)
    values <<= shift
    if int(widths.max()) > 57:
        # A 64-bit window starting at the field's byte holds only 64 - shift
        # of its bits; the ninth byte supplies the rest.
        byte += 1
        ninth = np.take(windows, byte).astype(_U64, copy=False) & _U64(0xFF)
        values |= ninth >> (_U64(8) - shift)
    # numpy defines shifts by 64 or more as 0, which empty fields rely on.
    np.subtract(64, widths, out=widths)
    values >>= widths.view(_U64)
    return values


# ------------------------------------------------------------ bitmaps of positions

def _bit_position_tables():
    """Per byte value: the positions of its set bits (MSB = 0), padded, and which are real."""
    byte = np.arange(256)[:, None]
    present = ((byte >> (7 - np.arange(8))) & 1).astype(bool)
    # A stable sort of "absent" puts each byte's set positions first, in order.
    order = np.argsort(~present, axis=1, kind="stable").astype(np.int32)
    valid = np.arange(8) < present.sum(axis=1, keepdims=True)
    return order, valid


_BIT_POSITIONS, _BIT_VALID = _bit_position_tables()


def set_bit_positions(data, bit_offset: int = 0) -> np.ndarray:
    """Positions of the set bits of ``data`` at or after ``bit_offset``, relative to it.

    Each byte is expanded to its (padded) set-bit positions by an 8-entry
    table row and the padding is dropped with one ``np.compress``: the positions
    come straight from the table, where ``flatnonzero(unpackbits(...))`` first
    writes a byte per bit and then scans them all, at the 50% density of unary
    codes half of them zero. Returns int32 (int64 for streams of 2**28 bytes or more).
    """
    chunk = np.frombuffer(data, dtype=np.uint8)[bit_offset >> 3:]
    if chunk.size == 0:
        return np.zeros(0, dtype=np.int64)
    if chunk.size >= 1 << 28:
        return np.flatnonzero(np.unpackbits(chunk)[bit_offset & 7:])
    if bit_offset & 7:
        chunk = chunk.copy()
        chunk[0] &= 0xFF >> (bit_offset & 7)
    positions = np.take(_BIT_POSITIONS, chunk, axis=0).reshape(-1)
    byte_starts = np.arange(positions.size, dtype=np.int32)
    positions += np.bitwise_and(byte_starts, -8, out=byte_starts)
    positions = np.compress(np.take(_BIT_VALID, chunk, axis=0).reshape(-1), positions)
    positions -= bit_offset & 7
    return positions


# ------------------------------------------------------------ geometric model

def golomb_parameter(mean: float) -> int:
    """Optimal Golomb parameter for geometric values of the given mean.

    Gallager and Van Voorhis: for ``P(v) = (1 - t) t**v`` the smallest
    ``m`` with ``t**m + t**(m + 1) <= 1`` is optimal; ``t = mean / (mean + 1)``.
    """
    if not mean > 0:
        return 1
    theta = mean / (mean + 1.0)
    return max(1, math.ceil(math.log1p(theta) / math.log1p(1.0 / mean) - 1e-12))


def golomb_expected_bits(mean: float, m: int) -> float:
    """Expected Golomb code length (bits) of a geometric value of the given mean."""
    if not mean > 0:
        return 1.0 + math.floor(math.log2(m))
    log_theta = -math.log1p(1.0 / mean)
    width = m.bit_length() - 1
    threshold = (1 << (width + 1)) - m
    tail = math.exp(m * log_theta)  # P(v >= m)
    quotient = tail / -math.expm1(m * log_theta)
    long_codes = (math.exp(threshold * log_theta) - tail) / -math.expm1(m * log_theta)
    return quotient + 1 + width + long_codes


def golomb_rice_parameter(mean: float) -> int:
    """The power of two ``m`` with the smallest expected code length."""
    m = golomb_parameter(mean)
    low = 1 << (m.bit_length() - 1)
    if low == m:
        return m
    return min((low, 2 * low), key=lambda c: golomb_expected_bits(mean, c))


# ------------------------------------------------------------ bucketing

def bucket_count(precision: int) -> int:
    """Size of the bucket alphabet for values in ``[1, 2**63)``."""
    return (1 << (precision + 1)) + (62 - precision) * (1 << precision)


def bucket_symbols(values: np.ndarray, precision: int) -> tuple[np.ndarray, np.ndarray]:
    """Symbols and offset bit lengths (both uint8) of positive int64 values.

    Values below ``2**(precision + 1)`` are their own symbol and carry no
    offset bits. A larger value with ``floor(log2 v) = e`` carries its low
    ``e - precision`` bits raw; its symbol names ``e`` and the ``precision``
    bits below the leading one.
    """
    if _entropyc is not None and 0 <= precision <= 2:
        values = np.ascontiguousarray(values, dtype=np.int64)
        symbols = np.empty(values.size, dtype=np.uint8)
        offset_bits = np.empty(values.size, dtype=np.uint8)
        _entropyc.bucket_symbols(values, precision, symbols, offset_bits, None)
        return symbols, offset_bits
    # floor(log2 v) is the biased exponent field of float64(v), minus 1023.
    exponent = values.astype(np.float64).view(np.int64) >> 52
    exponent -= 1023 + precision
    if values.size and int(values.max()) >= 1 << 52:
        # Rounding to float64 can carry into the next power of two.
        exponent -= (values >> (exponent + precision)) == 0
    offset_bits = np.maximum(exponent, 0, out=exponent)
    # With o = e - precision > 0 offset bits, v >> o is the leading one and
    # the mantissa, in [2**precision, 2**(precision+1)); adding o * 2**precision
    # lands every (e, mantissa) pair above the small values, which keep v.
    symbols = values >> offset_bits
    symbols += offset_bits << precision
    return symbols.astype(np.uint8), offset_bits.astype(np.uint8)


def bucket_histogram(values: np.ndarray, precision: int) -> tuple[np.ndarray, np.ndarray]:
    """Bucket symbols (uint8) of positive int64 values and their counts (int64, per symbol)."""
    if _entropyc is not None and 0 <= precision <= 2:  # one pass instead of two
        values = np.ascontiguousarray(values, dtype=np.int64)
        symbols = np.empty(values.size, dtype=np.uint8)
        counts = np.empty(256, dtype=np.int64)
        _entropyc.bucket_symbols(values, precision, symbols, None, counts)
        return symbols, counts[:bucket_count(precision)]
    symbols, _ = bucket_symbols(values, precision)
    return symbols, np.bincount(symbols, minlength=bucket_count(precision))


@functools.lru_cache(maxsize=None)
def bucket_base(precision: int) -> tuple[np.ndarray, np.ndarray]:
    """Per symbol: the smallest value it stands for and its number of offset bits.

    Computed once per precision; the arrays are read-only.
    """
    symbols = np.arange(bucket_count(precision), dtype=np.int64)
    small = 1 << (precision + 1)
    offset_bits = np.maximum((symbols - small) >> precision, -1) + 1
    mantissa = (symbols - small) & ((1 << precision) - 1)
    base = np.where(symbols < small, symbols,
                    ((1 << precision) + mantissa) << np.maximum(offset_bits, 0))
    base.setflags(write=False)
    offset_bits.setflags(write=False)
    return base, offset_bits


def bucket_values(symbols: np.ndarray, offsets: np.ndarray, precision: int) -> np.ndarray:
    """Inverse of :func:`bucket_symbols`: ``base[symbol] + offset`` (int64)."""
    base, _ = bucket_base(precision)
    values = offsets.view(np.int64) if offsets.dtype == _U64 else offsets.astype(np.int64)
    values += np.take(base, symbols)
    return values


# ------------------------------------------------------------ canonical Huffman

def huffman_lengths(counts: np.ndarray, max_length: int = MAX_CODE_LENGTH) -> np.ndarray:
    """Huffman code lengths (int64, 0 for unused symbols), none above ``max_length``.

    A single used symbol gets length 1. When the optimal code is too deep,
    the counts are flattened (halved, keeping every used symbol at least 1)
    and the code rebuilt, the usual way to limit lengths at a tiny loss.
    """
    counts = np.asarray(counts, dtype=np.int64)
    lengths = np.zeros(counts.size, dtype=np.int64)
    used = np.flatnonzero(counts)
    if used.size == 0:
        return lengths
    if used.size == 1:
        lengths[used] = 1
        return lengths
    if used.size > 1 << max_length:
        raise ValueError(f"{used.size} symbols cannot have codes of at most {max_length} bits")
    weights = counts[used].copy()
    while True:
        depth = _tree_depths(weights)
        if depth.max() <= max_length:
            lengths[used] = depth
            return lengths
        weights = np.maximum(weights >> 1, 1)


def _tree_depths(weights: np.ndarray) -> np.ndarray:
    """Leaf depths (int64) of the Huffman tree of int64 ``weights``: compiled when built."""
    # The C heap adds weights in 64 bits; totals this large stay in Python.
    if _entropyc is not None and float(weights.sum(dtype=np.float64)) < 2.0**62:
        depths = np.empty(weights.size, dtype=np.int64)
        _entropyc.huffman_depths(weights, depths)
        return depths
    return np.array(_huffman_depths(weights.tolist()), dtype=np.int64)


def _huffman_depths(weights: list) -> list:
    """Leaf depths of a Huffman tree over ``weights`` (a loop over the alphabet)."""
    heap = [(w, i, (i,)) for i, w in enumerate(weights)]
    heapq.heapify(heap)
    depth = [0] * len(weights)
    tie = len(weights)
    while len(heap) > 1:
        w1, _, leaves1 = heapq.heappop(heap)
        w2, _, leaves2 = heapq.heappop(heap)
        for leaf in leaves1 + leaves2:
            depth[leaf] += 1
        heapq.heappush(heap, (w1 + w2, tie, leaves1 + leaves2))
        tie += 1
    return depth


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical codes (uint64) for the given lengths: shorter codes first, then by symbol."""
    lengths = np.asarray(lengths, dtype=np.int64)
    codes = np.zeros(lengths.size, dtype=_U64)
    order = np.lexsort((np.arange(lengths.size), lengths))
    order = order[lengths[order] > 0]
    code = 0
    previous = 0
    for symbol in order.tolist():
        length = int(lengths[symbol])
        code <<= length - previous
        codes[symbol] = code
        code += 1
        previous = length
    return codes


def kraft_ok(lengths: np.ndarray) -> bool:
    """Whether code lengths form a complete prefix code (or a single 1-bit code)."""
    used = lengths[lengths > 0]
    if used.size == 0:
        return False
    if used.size == 1:
        return int(used[0]) == 1
    top = int(used.max())
    return int(np.sum(np.left_shift(1, top - used))) == 1 << top


def decode_table(lengths: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """Lookup tables for a canonical code: ``(peek_bits, symbol_of, length_of)``.

    ``symbol_of[w]`` and ``length_of[w]`` give the symbol whose code is a
    prefix of the ``peek_bits``-bit word ``w`` and that code's length. A
    single-symbol code ``0`` leaves the words starting with 1 at length 0,
    which decoders treat as invalid.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    codes = canonical_codes(lengths)
    peek = int(lengths.max())
    symbol_of = np.zeros(1 << peek, dtype=np.uint8 if lengths.size <= 256 else np.int64)
    length_of = np.zeros(1 << peek, dtype=np.int64)
    for symbol in np.flatnonzero(lengths).tolist():
        length = int(lengths[symbol])
        first = int(codes[symbol]) << (peek - length)
        symbol_of[first:first + (1 << (peek - length))] = symbol
        length_of[first:first + (1 << (peek - length))] = length
    return peek, symbol_of, length_of


def pack_code_lengths(lengths: np.ndarray) -> bytes:
    """Code lengths as ``first symbol, count, 4-bit lengths`` (bytes: 2 + ceil(count/2))."""
    used = np.flatnonzero(lengths)
    first, last = int(used[0]), int(used[-1])
    span = lengths[first:last + 1].astype(_U64)
    return bytes([first, last - first]) + pack_fixed(span, 4)


def unpack_code_lengths(data, offset: int, alphabet: int, what: str) -> tuple[np.ndarray, int]:
    """Inverse of :func:`pack_code_lengths`; returns ``(lengths, offset_after)``.

    Raises DecodeError when the table is truncated, names symbols outside
    the alphabet, or is not a complete prefix code.
    """
    if len(data) < offset + 2:
        raise DecodeError(f"{what}: code table truncated")
    first, span = data[offset], data[offset + 1] + 1
    if first + span > alphabet:
        raise DecodeError(f"{what}: code table names symbols up to {first + span - 1}, "
                          f"the alphabet has {alphabet}")
    nbytes = packed_bytes(4 * span)
    if len(data) < offset + 2 + nbytes:
        raise DecodeError(f"{what}: code table truncated")
    lengths = np.zeros(alphabet, dtype=np.int64)
    lengths[first:first + span] = unpack_fixed(data[offset + 2:offset + 2 + nbytes], span, 4,
                                               what)
    if lengths[first] == 0 or lengths[first + span - 1] == 0 or not kraft_ok(lengths):
        raise DecodeError(f"{what}: code lengths do not form a complete prefix code")
    return lengths, offset + 2 + nbytes
