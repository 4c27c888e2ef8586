"""Canonical Huffman coding of bucketed index gaps, decoded in parallel lanes.

DeepReduce's Huffman codec codes the bytes of the raw int32 indices, where
there is little redundancy to find. The redundancy of a sorted index set is
in its gaps, and their distribution is anything but flat: this codec gives
each gap a short Huffman-coded bucket symbol (its bit length and the next
``precision`` bits, as in Elias-gamma codes) followed by the raw bits that
locate it inside the bucket. Unlike a Golomb code it adapts to any gap
distribution, e.g. the mixtures that Top-k of real gradients produces.

Decoding a prefix code is sequential by nature; to decode with whole-array
operations the symbols are cut into blocks of ``block`` symbols whose bit
lengths are stored, and all blocks are decoded in lockstep, one lane per
block, three symbols per 64-bit window read.

Two implementations write and read the same bytes and raise the same
errors: whole-array numpy, and the optional C extension
``deepreduce.codecs.index._entropyc`` (compiled by ``pip install``), which encodes in
one call (the symbols and their histogram, the code, the tables, both streams)
and decodes in one (the tables and their checks, lane after lane, then the
offsets straight into indices), without the GIL on large sets. The numpy path
makes some twenty calls each way, whose fixed costs are all its time on a few
dozen indices, and on large sets a dozen whole-array operations per three symbols,
each writing a temporary, where the compiled one makes a few passes over the data
(``benchmarks/index_codecs.py`` times both).
:data:`deepreduce.codecs.index._entropy.IMPLEMENTATION` says which one runs.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from deepreduce import bits as _bits
from deepreduce.codecs.index import _entropy
from deepreduce.codecs.base import IndexCodec, no_indices
from deepreduce.errors import DecodeError
from deepreduce.registry import register_codec

#: Symbols decoded from one 64-bit window read: a window starting at a byte
#: holds at least 57 bits from the lane's position, enough for three codes
#: of at most 15 bits and the lookup of the third.
SYMBOLS_PER_WINDOW = 3


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@lru_cache(maxsize=None)
def bucket_tables(precision: int) -> tuple[np.ndarray, np.ndarray]:
    """Read-only ``(base int64, offset_bits uint8)`` per bucket symbol, built once."""
    base, offset_bits = _entropy.bucket_base(precision)
    offset_bits = offset_bits.astype(np.uint8)
    base.flags.writeable = offset_bits.flags.writeable = False
    return base, offset_bits


def gap_values(indices: np.ndarray) -> np.ndarray:
    """``[i0 + 1, i1 - i0, i2 - i1, ...]``: the positive gaps (int64) of an index set."""
    values = np.empty_like(indices)
    if indices.size:
        values[0] = indices[0] + 1
        np.subtract(indices[1:], indices[:-1], out=values[1:])
    return values


def code_layout(values: np.ndarray, precision: int):
    """Bucket symbols, offsets and code lengths of positive gaps.

    Returns ``(symbols, offset_bits, offsets, code_lengths)`` where
    ``code_lengths`` is the Huffman code of the symbol histogram. The
    offsets are computed in place in ``values`` (as uint64).
    """
    symbols, offset_bits = _entropy.bucket_symbols(values, precision)
    base, _ = _entropy.bucket_base(precision)
    values -= np.take(base, symbols)
    counts = np.bincount(symbols, minlength=_entropy.bucket_count(precision))
    return symbols, offset_bits, values.view(np.uint64), _entropy.huffman_lengths(counts)


def estimate_bits(values: np.ndarray, precision: int, block: int) -> int:
    """Bit size of the Huffman stream of ``values``, from the symbol histogram alone.

    Exact for the table, codes and offsets; the block-length field is
    estimated from the spread of the code lengths (block sums vary by about
    their standard deviation times sqrt(block)), which avoids a pass over
    the data per block.
    """
    _, counts = _entropy.bucket_histogram(values, precision)
    lengths = _entropy.huffman_lengths(counts)
    _, symbol_offset_bits = _entropy.bucket_base(precision)
    payload = int(counts @ (lengths + symbol_offset_bits))
    used = np.flatnonzero(counts)
    table = 8 * (2 + _bits.packed_bytes(4 * (int(used[-1]) - int(used[0]) + 1)))
    size = values.size
    blocks = -(-size // block)
    if blocks > 1:
        # floor(8 sqrt(block * variance of the code lengths)), in exact integers
        total, squares = int(counts @ lengths), int(counts @ lengths ** 2)
        width = math.isqrt(64 * (squares * size - total * total) * block
                           // (size * size)).bit_length()
        table += 16 + (blocks - 1) * width
    return payload + table


def estimate_gap_bits(indices: np.ndarray, step: int, precision: int,
                      block: int) -> tuple[int, int]:
    """``(bits, gaps)``: :func:`estimate_bits` of the gaps at every ``step``-th position
    of a non-empty strictly increasing index set (int64, from 0), and their number.

    With ``step`` 1 it is the estimate of the whole stream; a larger step
    estimates a sample at the cost of a pass over that sample only (in one
    call with the compiled loops).
    """
    compiled = _entropy._entropyc
    if compiled is not None and 0 <= precision <= 2:
        return compiled.huffman_estimate(np.ascontiguousarray(indices, dtype=np.int64), step,
                                         precision, block)
    sample = indices[::step] - np.concatenate(([-1], indices[step - 1:-1:step]))
    return estimate_bits(sample, precision, block), sample.size


def _pack_block_lengths(block_bits: np.ndarray) -> bytes:
    """All block lengths but the last: varint minimum, width byte, fixed-width excesses."""
    if block_bits.size <= 1:
        return b""
    lengths = block_bits[:-1]
    low = int(lengths.min())
    width = int(lengths.max() - low).bit_length()
    return (_bits.write_varint(low) + bytes([width])
            + _bits.pack_fixed((lengths - low).astype(np.uint64), width))


def _unpack_block_lengths(data, offset: int, blocks: int, limit: int,
                          what: str) -> tuple[np.ndarray, int]:
    if blocks <= 1:
        return np.zeros(0, dtype=np.int64), offset
    low, offset = _bits.read_varint(data, offset, what)
    if offset >= len(data):
        raise DecodeError(f"{what}: block length table truncated")
    width = data[offset]
    offset += 1
    if low > limit or width > limit.bit_length():
        raise DecodeError(f"{what}: block lengths exceed {limit} bits")
    size = _bits.packed_bytes((blocks - 1) * width)
    if len(data) < offset + size:
        raise DecodeError(f"{what}: block length table truncated")
    excess = _bits.unpack_fixed(data[offset:offset + size], blocks - 1, width, what)
    lengths = excess.astype(np.int64) + low
    if int(lengths.max()) > limit:
        raise DecodeError(f"{what}: block lengths exceed {limit} bits")
    return lengths, offset + size


def decode_lanes(windows: np.ndarray, starts: np.ndarray, steps: int,
                 peek: int, symbol_of: np.ndarray, length_of: np.ndarray):
    """Decode ``steps`` symbols in every lane, all lanes at once.

    ``windows`` are native uint64 big-endian windows at every byte (see
    :func:`_entropy.byte_windows`), with enough zero padding past the data
    that lanes running over their end read zeros. Returns ``(symbols,
    ends, bad)``: symbols as a ``(lanes, steps)`` array, each lane's final
    bit position, and whether any lane met a bit pattern that starts no code.
    """
    lanes = starts.size
    symbols = np.empty((-(-steps // SYMBOLS_PER_WINDOW) * SYMBOLS_PER_WINDOW, lanes),
                       dtype=symbol_of.dtype)
    position = starts.astype(np.int64)
    bad = np.zeros(lanes, dtype=bool)
    drop = np.uint64(64 - peek)
    for step in range(0, steps, SYMBOLS_PER_WINDOW):
        window = windows[position >> 3] << (position & 7).astype(np.uint64)
        for sub in range(min(SYMBOLS_PER_WINDOW, steps - step)):
            word = (window >> drop).astype(np.intp)
            length = length_of[word]
            symbols[step + sub] = symbol_of[word]
            bad |= length == 0
            window <<= length.astype(np.uint64)
            position += length
    return symbols[:steps].T, position, bad


@register_codec
class HuffmanIndices(IndexCodec):
    """Canonical Huffman code of bucketed gaps, with the code table in the stream.

    Each positive gap ``v`` (``i0 + 1``, then ``i[j] - i[j-1]``) becomes a
    bucket symbol (see :func:`deepreduce.codecs.index._entropy.bucket_symbols`)
    and ``floor(log2 v) - precision`` raw offset bits. Stream layout:

    1. the code lengths of the used symbol range (2 bytes + 4 bits each);
    2. the bit lengths of all but the last block of ``block`` symbols
       (varint minimum, a width byte, fixed-width excesses);
    3. the symbol codes, back to back, zero-padded to a byte;
    4. the offsets, back to back, zero-padded to a byte.

    Parameters
    ----------
    precision : int, 0 to 2
        Bits of each gap below its leading one that go into the symbol:
        more adapt better to the distribution, at a larger table.
    block : int, 8 to 4096
        Symbols per independently decodable block. Larger blocks store
        fewer block lengths but decode with fewer parallel lanes and more
        lockstep steps; multiples of 3 use every 64-bit window read fully.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.index.huffman import HuffmanIndices
    >>> codec = HuffmanIndices()
    >>> indices = np.array([3, 17, 18, 60, 61, 90])
    >>> data = codec.encode(indices, n=100)
    >>> codec.decode(data, n=100, nnz=6).tolist()
    [3, 17, 18, 60, 61, 90]
    """

    codec_id = "huffman"

    def __init__(self, precision: int = 2, block: int = 128):
        if not _is_int(precision) or not 0 <= precision <= 2:
            raise ValueError(f"precision must be an integer in [0, 2], got {precision!r}")
        if not _is_int(block) or not 8 <= block <= 4096:
            raise ValueError(f"block must be an integer in [8, 4096], got {block!r}")
        self.precision = int(precision)
        self.block = int(block)

    def encoded_bits(self, indices: np.ndarray) -> int:
        """Close estimate of ``8 * len(encode(indices, n))`` from the gap histogram."""
        if indices.size == 0:
            return 0
        return estimate_gap_bits(indices, 1, self.precision, self.block)[0]

    def encode(self, indices, n):
        compiled = _entropy._entropyc
        # The compiled encoder checks the order on its way (with check_order_of's error).
        indices = _bits.check_indices(indices, n, check_order=compiled is None)
        if indices.size == 0:
            return b""
        if compiled is not None:  # the same bytes in one call: no numpy call per step
            return compiled.huffman_encode(indices, self.precision, self.block)
        symbols, offset_bits, offsets, lengths = code_layout(gap_values(indices),
                                                             self.precision)
        symbol_lengths = np.take(lengths.astype(np.uint8), symbols)
        block_bits = np.add.reduceat(symbol_lengths, np.arange(0, symbols.size, self.block),
                                     dtype=np.int64)
        codes, _ = _entropy.pack_varlen(np.take(_entropy.canonical_codes(lengths), symbols),
                                        symbol_lengths)
        offsets, _ = _entropy.pack_varlen(offsets, offset_bits)
        return (_entropy.pack_code_lengths(lengths) + _pack_block_lengths(block_bits)
                + codes + offsets)

    def max_count(self, data, n):
        return 8 * len(data)  # every code takes a bit at least

    def decode(self, data, n, nnz):
        what = "huffman indices"
        n, nnz = _bits.check_counts(n, nnz, what)
        if nnz == 0:
            return no_indices(data, what)
        # Every code takes at least one bit: refuse counts the stream cannot hold
        # before reading tables whose size follows from them.
        if 8 * len(data) < nnz:
            raise DecodeError(f"{what}: {len(data)} bytes cannot hold {nnz} codes")
        if _entropy._entropyc is not None:  # the same checks and results in one call
            return self._decode_compiled(data, n, nnz, what)
        alphabet = _entropy.bucket_count(self.precision)
        lengths, offset = _entropy.unpack_code_lengths(data, 0, alphabet, what)
        if lengths[0]:
            raise DecodeError(f"{what}: code table gives a code to symbol 0 (a zero gap)")
        blocks = -(-nnz // self.block)
        limit = self.block * _entropy.MAX_CODE_LENGTH
        block_bits, offset = _unpack_block_lengths(data, offset, blocks, limit, what)
        stream = data[offset:]
        # Every symbol takes at least one bit: refuse counts the stream
        # cannot hold before allocating anything of size nnz.
        if 8 * len(stream) < nnz:
            raise DecodeError(f"{what}: {len(stream)} bytes cannot hold {nnz} codes")
        starts = np.zeros(blocks, dtype=np.int64)
        np.cumsum(block_bits, out=starts[1:])
        if int(starts[-1]) > 8 * len(stream):
            raise DecodeError(f"{what}: block lengths run past the end of the stream")
        peek, symbol_of, length_of = _entropy.decode_table(lengths)
        # Lanes that overrun (the last block is short, or the data is bad)
        # read zero padding instead of leaving the array.
        pad = -(-self.block * _entropy.MAX_CODE_LENGTH // 8) + 8
        windows = _entropy.byte_windows(stream, extra=pad).astype(np.uint64)
        symbols, ends, bad = decode_lanes(windows, starts, self.block, peek, symbol_of,
                                          length_of)
        symbols = symbols.reshape(-1)[:nnz]
        # A lane must end where the next one starts; the last lane, whose
        # excess steps decoded padding, is checked through its symbols.
        if blocks > 1 and (np.any(ends[:-1] != starts[1:]) or np.any(bad[:-1])):
            raise DecodeError(f"{what}: a block does not decode to its stored length")
        tail_symbols = symbols[(blocks - 1) * self.block:]
        tail_lengths = np.take(lengths, tail_symbols)
        if np.any(tail_lengths == 0):
            raise DecodeError(f"{what}: bits that start no code in the last block")
        code_end = int(starts[-1]) + int(tail_lengths.sum())
        code_bytes = _bits.packed_bytes(code_end)
        if code_bytes > len(stream):
            raise DecodeError(f"{what}: stream ends inside the codes")
        if code_end % 8 and stream[code_bytes - 1] & ((1 << (8 - code_end % 8)) - 1):
            raise DecodeError(f"{what}: padding bits after the codes are not zero")
        _, symbol_offset_bits = bucket_tables(self.precision)
        offset_bits = np.take(symbol_offset_bits, symbols)
        total = int(offset_bits.sum())
        expected = code_bytes + _bits.packed_bytes(total)
        if len(stream) != expected:
            raise DecodeError(f"{what}: stream holds {len(stream)} bytes after the tables, "
                              f"the codes and offsets take {expected}")
        if total % 8 and stream[-1] & ((1 << (8 - total % 8)) - 1):
            raise DecodeError(f"{what}: padding bits after the offsets are not zero")
        offsets = _entropy.unpack_varlen(stream, offset_bits, what, bit_offset=8 * code_bytes,
                                         windows=windows)
        values = _entropy.bucket_values(symbols, offsets, self.precision)
        return _cumulate(values, n, what)

    def _decode_compiled(self, data, n: int, nnz: int, what: str) -> np.ndarray:
        """:meth:`decode` of ``nnz >= 1`` indices by the C extension, in one call.

        The caller has checked that the stream holds a bit per index, which
        bounds the array allocated here by the stream's size.

        Returns
        -------
        numpy.ndarray
            The indices, int64, as the numpy path returns them.

        Raises
        ------
        DecodeError
            Where the numpy path raises it, with its message.
        """
        indices = np.empty(nnz, dtype=np.int64)
        problem = _entropy._entropyc.huffman_decode(data, n, self.precision, self.block,
                                                    indices)
        if problem is None:
            return indices
        if isinstance(problem, str):
            raise DecodeError(f"{what}: {problem}")
        # The gaps add up past n. They (each below 2**63) are recovered exactly from
        # the running sums, and the numpy checks raise the numpy path's error.
        _cumulate(np.diff(indices, prepend=np.int64(-1)), n, what)
        raise DecodeError(f"{what}: gaps add up to {problem}, past n={n}")  # not reached


def _cumulate(values: np.ndarray, n: int, what: str) -> np.ndarray:
    """Indices from positive gaps; DecodeError unless the last one is below ``n``."""
    # Gaps are below 2**63 each; checking the float total first keeps the
    # exact int64 sum from wrapping on malicious streams.
    if float(values.sum(dtype=np.float64)) > n + 2.0**20:
        raise DecodeError(f"{what}: gaps add up past n={n}")
    last = int(values.sum()) - 1
    if last >= n:
        raise DecodeError(f"{what}: gaps add up to index {last}, past n={n}")
    np.cumsum(values, out=values)
    values -= 1
    return values
