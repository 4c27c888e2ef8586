"""Golomb and Golomb-Rice coding of index gaps: within 1% of the entropy bound.

For a uniformly random ``k``-subset of ``[0, n)`` the gaps are nearly
geometric with ``p = k / n``, and for geometric sources the Golomb code with
the right parameter is the optimal prefix code (Gallager and Van Voorhis,
1975). On uniform supports it stays within 0.3-0.8% of ``log2 C(n, k) / k`` from
0.1% to 30% density (``benchmarks/index_codecs.py`` compares every code with it);
Rice codes (power-of-two parameters) lose up to 1.4% and decode a little faster
(fixed-width remainders), so they are used where true Golomb gains less
than :data:`RICE_TOLERANCE`.

The module also exposes the field-level coder (:func:`encode_fields`,
:func:`decode_fields`, :func:`encode_values`, :func:`decode_values`) that
:mod:`.runs` reuses for run lengths.
"""

from __future__ import annotations

import functools

import numpy as np

from deepreduce import bits as _bits
from deepreduce.codecs.index import _entropy
from deepreduce.codecs.base import IndexCodec, expect_length, no_indices
from deepreduce.errors import DecodeError
from deepreduce.registry import register_codec

#: Use a Rice parameter unless true Golomb is expected to be smaller by more
#: than this fraction: Rice decodes with shifts and no extra-bit pass.
RICE_TOLERANCE = 0.001

MODES = ("auto", "rice", "golomb")


def choose_parameter(mean: float, mode: str = "auto") -> int:
    """Golomb parameter ``m`` for values of the given mean (geometric model)."""
    if type(mean) is float and type(mode) is str:
        return _choose_parameter(mean, mode)
    return _parameter_of(mean, mode)


# A tensor's Top-k sets have the same count every step and, in a large tensor, a last
# index near its end: their means repeat, and the three code lengths weighed for each
# cost more Python than a cache lookup. (Keyed on exact floats and strings: a pure
# function of them.)
@functools.lru_cache(maxsize=1024)
def _choose_parameter(mean: float, mode: str) -> int:
    return _parameter_of(mean, mode)


def _parameter_of(mean, mode: str) -> int:
    golomb = _entropy.golomb_parameter(mean)
    low = 1 << (golomb.bit_length() - 1)
    if mode == "golomb" or low == golomb:
        return golomb
    # The Rice parameter: the better power of two around the optimum
    # (_entropy.golomb_rice_parameter, whose model this shares).
    bits = {m: _entropy.golomb_expected_bits(mean, m) for m in (low, 2 * low, golomb)}
    rice = min((low, 2 * low), key=bits.get)
    if mode == "rice":
        return rice
    return golomb if 1 - bits[golomb] / bits[rice] > RICE_TOLERANCE else rice


def _layout(m: int) -> tuple[int, int]:
    """``(width, threshold)`` of the truncated-binary remainder for parameter ``m``.

    Remainders below ``threshold = 2**(width + 1) - m`` take ``width`` bits,
    the others ``width + 1``; for a power of two every remainder takes
    ``width = log2 m`` bits.
    """
    width = m.bit_length() - 1
    return width, (1 << (width + 1)) - m


class Split:
    """A sequence split for Golomb coding with parameter ``m``, computed once.

    Holds the quotients (int64), the ``width``-bit heads of the truncated
    binary remainders (uint16 up to 16 bits, else uint64) and the extra low
    bits of the long ones (uint8), so that :meth:`bits` and
    :func:`encode_fields` share the work. With ``consume=True`` the
    quotients are computed in place in ``values``, which the caller must
    not use afterwards: fewer fresh pages for large sets. Encoding turns
    the quotients into terminator positions in place, so a split encodes
    once.
    """

    def __init__(self, values: np.ndarray, m: int, consume: bool = False):
        self.m, self.count = m, values.size
        self.width, threshold = _layout(m)
        self.heads = np.empty(values.size, dtype=np.uint16 if self.width <= 16 else np.uint64)
        if m & (m - 1) == 0:
            np.bitwise_and(values, m - 1, out=self.heads, casting="unsafe")
            self.quotients = np.right_shift(values, self.width,
                                            out=values if consume else None)
            self.extra = np.zeros(0, dtype=np.uint8)
        else:
            quotients = values // m
            remainders = np.subtract(values, quotients * m, out=values if consume else None)
            long_codes = remainders >= threshold
            # A long remainder r is sent as the width + 1 bits of r + threshold.
            remainders += long_codes * threshold
            self.extra = (remainders[long_codes] & 1).astype(np.uint8)
            remainders >>= long_codes
            self.heads[:] = remainders
            self.quotients = quotients

    def bits(self) -> int:
        """Exact bit length of the coded fields (before byte padding)."""
        return (self.count * (self.width + 1) + int(self.quotients.sum())
                + self.extra.size)


def field_bits(values: np.ndarray, m: int) -> int:
    """Exact bit length of :func:`encode_fields` output (before byte padding)."""
    compiled = _entropy._entropyc
    if compiled is not None and values.dtype == np.int64:
        bits = compiled.golomb_bits(np.ascontiguousarray(values), m)
        if bits is not None:
            return bits
    return Split(values, m, consume=False).bits()


def encode_fields(values: np.ndarray, m: int, split: Split | None = None) -> bytes:
    """Golomb-code non-negative int64 ``values`` with parameter ``m``; no header.

    Layout: the ``width``-bit heads of the truncated binary remainders of
    the first ``8 * (count // 8)`` values as byte planes (see
    :func:`deepreduce.codecs.index._entropy.pack_planes`), then one bitstream (MSB
    first, zero-padded to a byte) of the heads of the last ``count % 8``
    values, the extra low bits of the long remainders, and the quotients in
    unary (``q`` zeros and a one). Keeping the parts apart lets each be
    written and read with whole-array operations; the total is exactly the
    sum of the Golomb code lengths. Pass ``split`` when :class:`Split` was
    already computed (``values`` is then unused).
    """
    split = split if split is not None else Split(values, m, consume=False)
    aligned = split.count & ~7
    head_bytes = _entropy.pack_planes(split.heads[:aligned], split.width)
    rest = split.heads[aligned:].astype(np.int64)
    # Value i's terminator follows all earlier codes' q + 1 unary bits: it
    # is bit cumsum(q + 1)[i] of a stream with one leading spare bit.
    ends, split.quotients = split.quotients, None
    ends += 1
    np.cumsum(ends, out=ends)
    lead = rest.size * split.width
    prefix = lead + split.extra.size
    tail = np.zeros(prefix + int(ends[-1]) + 1, dtype=np.uint8)
    tail[prefix + ends] = 1
    tail = tail[1:]
    tail[:lead] = (rest[:, None] >> np.arange(split.width - 1, -1, -1)).reshape(-1) & 1
    tail[lead:prefix] = split.extra
    return head_bytes + np.packbits(tail).tobytes()


def _check_room(data, count: int, width: int, what: str) -> None:
    if 8 * len(data) < count * (width + 1):
        raise DecodeError(f"{what}: {len(data)} bytes cannot hold {count} Golomb codes "
                          f"of at least {width + 1} bits")


def decode_fields(data, count: int, m: int, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Parse :func:`encode_fields` output of ``count >= 1`` values.

    Returns ``(terminators, remainders)``: the bit position (int32 or int64) of each
    unary terminator within the unary part (so value ``i``'s quotient is
    ``terminators[i] - terminators[i-1] - 1``) and the remainders, as int16
    when ``m < 512`` (room for adding ``1 - m`` in place) and int64
    otherwise. Raises DecodeError when the stream is too short for
    ``count`` codes, the unary part does not hold exactly ``count``
    terminators, or bytes follow the last one.
    """
    width, threshold = _layout(m)
    _check_room(data, count, width, what)
    aligned = count & ~7
    plane_bytes = aligned * width // 8
    remainders = np.empty(count, dtype=np.int16 if width <= 8 else np.int64)
    _entropy.unpack_planes(data, aligned, width, out=remainders[:aligned])
    tail = np.frombuffer(data, dtype=np.uint8, offset=plane_bytes)
    tail_bits = 8 * tail.size
    # The first bits of the tail: heads of the last count % 8 remainders,
    # then the extra bits of the long remainders; the unary part follows.
    lead = (count - aligned) * width
    if lead:
        bits = np.unpackbits(tail[:-(-lead // 8)])[:lead]
        weights = np.left_shift(1, np.arange(width - 1, -1, -1, dtype=np.int64))
        remainders[aligned:] = bits.reshape(-1, width) @ weights
    else:
        remainders[aligned:] = 0
    unary_start = lead
    if m & (m - 1):
        long_codes = np.flatnonzero(remainders >= threshold)
        unary_start += long_codes.size
        if tail_bits < unary_start:
            raise DecodeError(f"{what}: stream ends inside the remainder bits")
        extra = np.unpackbits(tail[lead >> 3:-(-unary_start // 8)])
        extra = extra[lead & 7:(lead & 7) + long_codes.size]
        # A long remainder r was sent as the width + 1 bits of r + threshold.
        remainders[long_codes] += remainders[long_codes] + extra - threshold
    terminators = _entropy.set_bit_positions(tail, unary_start)
    if terminators.size != count:
        raise DecodeError(f"{what}: unary part holds {terminators.size} terminators, "
                          f"expected {count} (truncated or corrupt)")
    if tail_bits - unary_start - int(terminators[-1]) > 8:
        raise DecodeError(f"{what}: {(tail_bits - unary_start - int(terminators[-1]) - 1) // 8}"
                          f" trailing bytes after the last code")
    return terminators, remainders


def encode_values(values: np.ndarray, mode: str = "auto") -> bytes:
    """Self-describing Golomb stream of non-negative int64 values: varint ``m``, fields."""
    if values.size == 0:
        return b""
    m = choose_parameter(float(values.mean()), mode)
    return _bits.write_varint(m) + encode_fields(values, m)


def decode_values(data, count: int, limit: int, what: str) -> np.ndarray:
    """Inverse of :func:`encode_values`; every value must be below ``limit``."""
    if count == 0:
        expect_length(data, 0, what)
        return np.zeros(0, dtype=np.int64)
    m, offset = read_parameter(data, limit, what)
    terminators, remainders = decode_fields(data[offset:], count, m, what)
    quotients = np.diff(terminators.astype(np.int64), prepend=-1) - 1
    if int(quotients.max()) >= limit // m + 1:
        raise DecodeError(f"{what}: a value exceeds {limit - 1}")
    quotients *= m
    quotients += remainders
    if int(quotients.max()) >= limit:
        raise DecodeError(f"{what}: a value exceeds {limit - 1}")
    return quotients


def read_parameter(data, limit: int, what: str) -> tuple[int, int]:
    """Read the varint Golomb parameter; it must lie in ``[1, max(limit, 1)]``."""
    m, offset = _bits.read_varint(data, 0, what)
    if not 1 <= m <= max(limit, 1):
        raise DecodeError(f"{what}: Golomb parameter {m} outside [1, {max(limit, 1)}]")
    return m, offset


def index_gaps(indices: np.ndarray) -> np.ndarray:
    """``[i0, i1 - i0 - 1, ...]`` as int64: the non-negative gaps of a strictly increasing set."""
    values = np.empty_like(indices)
    if indices.size:
        values[0] = indices[0]
        np.subtract(indices[1:], indices[:-1], out=values[1:])
        values[1:] -= 1
    return values


def mean_gap(indices: np.ndarray) -> float:
    """Mean of :func:`index_gaps` in O(1): the gaps add up to ``last - (k - 1)``."""
    return (int(indices[-1]) - indices.size + 1) / indices.size


#: Indices from here on take the numpy path: the compiled loops work in 64-bit
#: arithmetic with room for a dozen times ``n``.
COMPILED_LIMIT = 1 << 58


class IndexStream:
    """The Golomb stream of a non-empty index set with parameter ``m``.

    The indices must be int64 and within their universe (see
    :func:`deepreduce.bits.check_indices`); their order is checked here, with a
    ``ValueError`` for a set that is not strictly increasing.

    :attr:`size` is its exact length in bytes and :meth:`data` the stream
    (:func:`encode_index_gaps`). With the compiled loops
    (``deepreduce.codecs.index._entropyc``) the stream is written at once, in one pass
    over the indices that also counts the zero gaps; the numpy path splits
    the gaps and writes the stream only when :meth:`data` asks, so a caller
    that only weighs sizes pays for the split alone. :attr:`adjacent` (the
    number of zero gaps, i.e. of adjacent indices) is counted only with
    ``count_adjacent=True`` (else None) on the numpy path.
    """

    def __init__(self, indices: np.ndarray, m: int, count_adjacent: bool = False):
        compiled = _entropy._entropyc
        if compiled is not None and int(indices[-1]) < COMPILED_LIMIT:
            self._data, self.adjacent = compiled.golomb_encode(
                np.ascontiguousarray(indices, dtype=np.int64), m, _bits.write_varint(m))
            self.size = len(self._data)
            return
        _bits.check_order_of(indices)
        gaps = index_gaps(indices)
        self.adjacent = int(np.count_nonzero(gaps == 0)) if count_adjacent else None
        self._split = Split(gaps, m, consume=True)
        self.size = stream_size(self._split)
        self._data = None

    def data(self) -> bytes:
        if self._data is None:
            self._data = encode_index_gaps(self._split)
        return self._data


def stream_size(split: Split) -> int:
    """Exact byte length of :func:`encode_index_gaps` output."""
    return len(_bits.write_varint(split.m)) + _bits.packed_bytes(split.bits())


def encode_index_gaps(split: Split) -> bytes:
    """Stream of a non-empty index set from the :class:`Split` of its :func:`index_gaps`."""
    return _bits.write_varint(split.m) + encode_fields(None, split.m, split)


def decode_index_gaps(data, n: int, nnz: int, what: str) -> np.ndarray:
    """Inverse of :func:`encode_index_gaps` for ``nnz >= 1``."""
    m, offset = read_parameter(data, n, what)
    compiled = _entropy._entropyc
    if compiled is not None and n < COMPILED_LIMIT:
        fields = data[offset:]
        _check_room(fields, nnz, m.bit_length() - 1, what)
        indices = np.empty(nnz, dtype=np.int64)
        problem = compiled.golomb_decode(fields, m, n, indices)
        if problem is not None:
            raise DecodeError(f"{what}: {problem}")
        return indices
    terminators, remainders = decode_fields(data[offset:], nnz, m, what)
    # Index i = m * (quotients up to i) + (remainders up to i) + i, where the
    # quotients up to i are terminators[i] - i; folding "- m*i + i" into the
    # remainders (all but the first) saves a pass.
    quotient_total = int(terminators[-1]) - nnz + 1
    if m * quotient_total > n:
        raise DecodeError(f"{what}: quotients alone pass n={n}")
    if nnz * m >= 2**62 and float(remainders.sum(dtype=np.float64)) > n:
        # Only then could the int64 running sum below wrap.
        raise DecodeError(f"{what}: remainders add up past n={n}")
    remainders[1:] += 1 - m
    running = remainders.astype(np.int64)
    np.cumsum(running, out=running)
    last = m * quotient_total + int(running[-1]) - (nnz - 1) * (1 - m) + nnz - 1
    if last >= n:
        raise DecodeError(f"{what}: gaps add up to index {last}, past n={n}")
    if m & (m - 1) == 0:
        indices = np.left_shift(terminators, m.bit_length() - 1, dtype=np.int64)
    else:
        indices = np.multiply(terminators, m, dtype=np.int64)
    indices += running
    return indices


@register_codec
class GolombIndices(IndexCodec):
    """Golomb (or Golomb-Rice) code of the gaps between consecutive indices.

    The gaps ``g = [i0, i1 - i0 - 1, ...]`` are coded with the parameter
    ``m`` that is optimal for a geometric source of their mean, i.e. of
    density ``k / n``; ``m`` is stored as a varint at the start of the
    stream. Each gap is ``q = g // m`` in unary plus ``r = g % m`` in
    truncated binary, laid out as in :func:`encode_fields`. An empty set is
    an empty stream.

    Parameters
    ----------
    mode : {"auto", "rice", "golomb"}
        ``"rice"`` restricts ``m`` to powers of two, ``"golomb"`` always uses
        the optimal ``m``, ``"auto"`` uses true Golomb only where it is
        expected to be more than 0.1% smaller.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.index.golomb import GolombIndices
    >>> codec = GolombIndices()
    >>> indices = np.array([3, 17, 18, 60, 61, 90])
    >>> data = codec.encode(indices, n=100)
    >>> len(data)
    5
    >>> codec.decode(data, n=100, nnz=6).tolist()
    [3, 17, 18, 60, 61, 90]
    """

    codec_id = "golomb"

    def __init__(self, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode

    def parameter(self, indices: np.ndarray) -> int:
        """The ``m`` this codec uses for a non-empty index set."""
        return choose_parameter(mean_gap(indices), self.mode)

    def encoded_size(self, indices: np.ndarray) -> int:
        """Exact length in bytes of ``encode(indices, n)``."""
        if indices.size == 0:
            return 0
        return IndexStream(indices, self.parameter(indices)).size

    def encode(self, indices, n):
        indices = _bits.check_indices(indices, n, check_order=False)  # IndexStream checks
        if indices.size == 0:
            return b""
        return IndexStream(indices, self.parameter(indices)).data()

    def max_count(self, data, n):
        return 8 * len(data)  # a bit per gap at least (its quotient's terminator)

    def orders(self, data):
        # each index is the last plus a gap plus one, and the last one is checked below n
        return True

    def decode(self, data, n, nnz):
        what = "golomb indices"
        n, nnz = _bits.check_counts(n, nnz, what)
        if nnz == 0:
            return no_indices(data, what)
        # A memoryview lets the parts be sliced without copying the stream.
        return decode_index_gaps(memoryview(data), n, nnz, what)
