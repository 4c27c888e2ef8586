"""Bloom-filter index codec (DeepReduce's BF) and its false-positive policies.

A Bloom filter of the ``r`` true indices costs about ``1.44 log2(1/fpr)``
bits per index whatever ``n`` is, but the receiver learns a superset of
the indices: every position of the universe whose bits are all set. A
*policy* (DeepReduce, Kostopoulou et al., arXiv 2102.03112) decides which
of those positives receive values; sender and receiver run the same policy
on the same filter, so they agree on the positions without sending them.

Filter layout (stream version 1)
--------------------------------
The filter has ``m = 8 * nbytes`` bits (at least 64) and ``k =
round(log2(1/fpr))`` hash functions, as in the paper. Position ``i`` is hashed with MurmurHash3
x86_32 (:mod:`deepreduce.codecs._murmur`; 4-byte little-endian keys when
``n <= 2**32``, 8-byte keys above):

* ``h1 = murmur3_32(i, seed)``, ``h2 = murmur3_32(i, seed ^ 0x9E3779B9)``;
* ``block_k = clip(k // 2, 1, 4)`` of the ``k`` bits lie in one 64-bit
  word, word ``(h1 * (m // 64)) >> 32`` (bit ``b`` of the filter is bit
  ``b % 64`` of word ``b // 64``), at the ``block_k`` distinct bit offsets
  of pattern ``h1 & 4095`` of a fixed pattern table (derived from
  MurmurHash3 itself, identical everywhere);
* the other ``k - block_k`` bits are single bits anywhere in the filter,
  by double hashing: bit ``((h2 + j * h1) mod 2**32) * m >> 32`` for
  ``j = 0 .. k - block_k - 1``.

Why the blocked word: the decoder must test every position of the
universe. One word gather and one mask test after ``h1`` reject about 93%
of the positions (4 bits of a half-full word), so ``h2`` and the
single-bit probes are computed for the survivors only. Confining some
bits to one word raises the false-positive rate at a given size (the
number of indices per word varies): about +10% at fpr 1e-3 with 4 blocked bits, against +50% for a
filter with all bits in one 512-bit block. The size compensates: ``m`` is
the smallest whose modelled rate (:func:`predicted_fpr`) is ``fpr``,
0.5-3% more than the paper's ``-r ln(fpr) / ln(2)**2``, rounded up to
whole bytes.

Two implementations of the scan (and of the filter's build) give the same
bits and positions: the C extension ``deepreduce.codecs.index._bloomscan`` (compiled by
``pip install``), one pass over blocks of positions that hashes, tests and keeps
them while they are in cache, and, where it is not built, whole-array numpy
(about 20 operations per position for the hash alone, each a pass that writes a
temporary), several times slower (``benchmarks/lossy_codecs.py`` times both and
says where the time goes). :data:`SCAN_IMPLEMENTATION` says
which one runs. The same extension runs the ``conflict_sets`` selection (the
numpy fallback selects the same positions); either takes memory in proportion to
the positives times ``k``, never to the universe (figures in the same file).

Stream: ``version u8 | k u8 | seed u32`` (little endian), ``nbytes`` as
a LEB128 varint, then the filter's ``nbytes`` bytes (bit ``b`` is bit
``b % 8`` of byte ``b // 8``, the little-endian view of the words). The
seed is the codec's ``seed`` parameter mixed with its ``step`` (its earlier
encodes), so every call hashes differently (false positives do not repeat from
step to step) yet a run is reproducible; ``random`` and ``conflict_sets`` derive their choices from it.

Policies (``policy=``)
----------------------
``p0``
    All positives receive values: false positives take their value from the
    dense tensor when the sender has it (then the reconstruction is exact),
    else 0. ``nnz`` is the number of positives.
``leftmost``
    The ``r`` first positives (the decoder stops scanning once it has them).
``random``
    ``r`` positives chosen by a seeded generator every rank reproduces: the
    ``r`` positives of smallest ``murmur3_32(i, seed ^ 0x7F4A7C15)``.
``conflict_sets``
    The paper's Algorithm 1. The conflict set of a filter bit is the set of
    positives hashing to it; a bit set by a single positive proves that
    positive true. Sets are visited from the smallest (singletons first);
    a set that gained a selected member since its last visit is skipped,
    any other picks one random unselected member; rounds repeat until
    ``r`` are selected. Sets of equal size are visited simultaneously
    (whole-array work) rather than one after another, the only departure
    from the sequential algorithm; after 8 rounds any shortfall is filled
    with the positives whose smallest set is smallest. Within a set, the
    random member is the one of smallest ``murmur3_32(bit, key)``, ``key``
    the member's ``murmur3_32(i, seed ^ 0x7F4A7C15)``; sets of one size are
    visited in the order of ``murmur3_32(bit, seed ^ 0x7F4A7C15)``, then of
    their bits.
``naive``
    The true values, in index order, assigned to the ``r`` first positives
    (what a receiver without a policy would do; for comparison only).

Under every policy but ``naive`` a false positive that receives a value
gets the dense tensor's value (when known, else 0), and
:meth:`BloomIndices.encode_selection` returns exactly the pairs the
receiver reconstructs, so error feedback keeps every undelivered value.
"""

from __future__ import annotations

import math
import struct
from functools import lru_cache

import numpy as np

from deepreduce import bits as _bits
from deepreduce.codecs._murmur import RangeHasher, key_bytes_for, murmur3_32
from deepreduce.codecs.base import IndexCodec
from deepreduce.errors import DecodeError
from deepreduce.registry import register_codec

try:
    from deepreduce.codecs.index import _bloomscan
except ImportError:  # not compiled (the extension is optional): the numpy scan serves
    _bloomscan = None

VERSION = 1
POLICIES = ("p0", "leftmost", "random", "conflict_sets", "naive")

#: Which universe scan :meth:`BloomFilter.positives` runs: ``"compiled"`` (the C
#: extension ``deepreduce.codecs.index._bloomscan``, built by ``pip install``) or ``"numpy"``.
SCAN_IMPLEMENTATION = "numpy" if _bloomscan is None else "compiled"
#: Most hash bits confined to one 64-bit word (see :func:`blocked_hashes`).
BLOCK_HASHES = 4
#: Patterns of the blocked word: ``h1 & (PATTERNS - 1)`` picks one.
PATTERN_BITS = 12
PATTERNS = 1 << PATTERN_BITS
MAX_HASHES = 64
#: Filters stay below 2**32 bits, so ``g * m >> 32`` fits in uint64.
MAX_BYTES = 1 << 29
#: A filter has at least one whole 64-bit word for the blocked bits.
MIN_BYTES = 8
#: fpr below this would need more than MAX_HASHES hash functions.
MIN_FPR = 1e-15

_HEADER = struct.Struct("<BBI")
_SECOND_HASH_SEED = 0x9E3779B9
_SELECTION_SEED = 0x7F4A7C15
_PATTERN_SEED = 0x5BD1E995
_CONFLICT_ROUNDS = 8
_SCAN_CHUNK = 1 << 16
#: Positions per call of the compiled scan: its output buffer has this size,
#: and ``limit`` is checked between calls.
_COMPILED_CHUNK = 1 << 20
#: Survivors of the word test are collected over this many positions before
#: their single-bit probes run, so those probes cost few numpy calls.
_SCAN_BATCH = 1 << 18
_MASK32 = 0xFFFFFFFF
_BUILD_SLICE = 1 << 20
#: Compact the single-bit candidates when fewer than this share passed.
_COMPACT_BELOW = 0.75
_LITTLE_ENDIAN = np.little_endian


def _words_of(filter_bytes: np.ndarray) -> np.ndarray:
    """Filter bytes as native uint64 words, the last one zero-padded."""
    padded = np.zeros(-(-filter_bytes.size // 8) * 8, dtype=np.uint8)
    padded[:filter_bytes.size] = filter_bytes
    return padded.view("<u8").astype(np.uint64)


@lru_cache(maxsize=None)
def pattern_table(block_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``PATTERNS`` bit patterns of ``block_k`` distinct bits of a 64-bit word.

    Returns ``(masks, offsets)``: uint64 masks, and the bit offsets as an
    int64 array of shape ``(PATTERNS, block_k)``. Pattern ``p`` takes the
    ``block_k`` offsets with the smallest ``murmur3_32(64 p + offset,
    0x5BD1E995)``: fixed, platform-independent, uniformly random.
    """
    keys = np.arange(PATTERNS * 64, dtype=np.uint64)
    ranks = murmur3_32(keys, _PATTERN_SEED).reshape(PATTERNS, 64)
    offsets = np.argsort(ranks, axis=1, kind="stable")[:, :block_k].astype(np.int64)
    masks = np.bitwise_or.reduce(np.left_shift(np.uint64(1), offsets.astype(np.uint64)),
                                 axis=1, dtype=np.uint64)
    masks.setflags(write=False)
    offsets.setflags(write=False)
    return masks, offsets


def predicted_fpr(bits_per_key: float, k: int, block_k: int) -> float:
    """False-positive rate of the blocked-word layout at ``bits_per_key`` bits per index.

    A query's word holds the patterns of ``J ~ Poisson(64 / bits_per_key)``
    indices (the load varies from word to word, which is what costs rate
    over a standard filter) plus single bits of all indices; its single
    bits hit an average word. Standard Bloom-filter approximations
    otherwise (bits of one pattern independent); ``benchmarks/lossy_codecs.py``
    measures the rate that filters sized by this model give.
    """
    singles = k - block_k
    untouched_by_singles = math.exp(-singles / bits_per_key)
    load = 64.0 / bits_per_key
    keep = 1.0 - block_k / 64.0
    spread = 12.0 * math.sqrt(load) + 30.0  # Poisson terms farther out are negligible
    blocked = 0.0
    for j in range(int(max(0.0, load - spread)), int(load + spread) + 1):
        weight = math.exp(j * math.log(load) - load - math.lgamma(j + 1))
        blocked += weight * (1.0 - keep ** j * untouched_by_singles) ** block_k
    fill = 1.0 - math.exp(-k / bits_per_key)
    return blocked * fill ** singles


def blocked_hashes(k: int) -> int:
    """How many of ``k`` hashes share the blocked word: half of them, 1 to BLOCK_HASHES."""
    return max(1, min(BLOCK_HASHES, k // 2))


def filter_geometry(r: int, fpr: float) -> tuple[int, int, int]:
    """``(nbytes, k, block_k)`` of a filter for ``r`` indices at false-positive rate ``fpr``.

    As in the paper, ``k = round(log2(1/fpr))`` (at least 1); a standard
    filter would take ``m = -r ln(fpr) / ln(2)**2`` bits. The blocked word
    raises the rate a little at that size, so the equivalent size for this
    layout is the smallest ``m`` (never below the standard one) whose
    :func:`predicted_fpr` is ``fpr``: 0.5-3.5% more bits. ``m`` is rounded up
    to whole bytes, at least 8.
    """
    k = max(1, math.floor(math.log2(1 / fpr) + 0.5))
    block_k = blocked_hashes(k)
    low = -math.log(fpr) / math.log(2) ** 2
    high = 2.0 * low
    if predicted_fpr(low, k, block_k) > fpr:
        for _ in range(50):  # bisection on bits per index
            middle = 0.5 * (low + high)
            if predicted_fpr(middle, k, block_k) > fpr:
                low = middle
            else:
                high = middle
        low = high
    nbytes = max(MIN_BYTES, -(-math.ceil(r * low) // 8))
    return nbytes, k, block_k


class BloomFilter:
    """A filter as the stream describes it, with the hashing every rank shares.

    Parameters
    ----------
    words : numpy.ndarray
        The filter as uint64 words (bit ``b`` is bit ``b % 64`` of word
        ``b // 64``), zero-padded to whole words.
    nbytes : int
        Filter size in bytes (``m = 8 * nbytes`` bits).
    k, block_k, seed : int
        Hash count, hashes confined to one word, hash seed.
    n : int
        Universe size (decides the key width).
    """

    def __init__(self, words: np.ndarray, nbytes: int, k: int, block_k: int, seed: int,
                 n: int):
        self.words, self.nbytes = words, nbytes
        self.k, self.block_k, self.seed, self.n = k, block_k, seed, n
        self.key_bytes = key_bytes_for(n)
        self.m = 8 * nbytes
        self.block_words = self.m // 64
        self.masks, self.offsets = pattern_table(block_k)

    @classmethod
    def build(cls, indices: np.ndarray, n: int, fpr: float, seed: int) -> "BloomFilter":
        """The filter of ``indices`` sized for ``fpr``."""
        nbytes, k, block_k = filter_geometry(indices.size, fpr)
        if nbytes > MAX_BYTES:
            raise ValueError(f"a Bloom filter of {indices.size} indices at fpr={fpr} needs "
                             f"{8 * nbytes} bits, above the 2**32-bit limit")
        filt = cls(np.zeros(-(-nbytes // 8), dtype=np.uint64), nbytes, k, block_k, seed, n)
        if indices.size and _bloomscan is not None:  # same bits, without the temporaries
            _bloomscan.build(filt.words, filt.masks, np.ascontiguousarray(indices, np.int64),
                             seed, filt.key_bytes, filt.m, k, block_k)
        elif indices.size:
            # One byte per filter bit, set by a plain scatter, then packed: OR-ing
            # into words takes ufunc.at, which works one element at a time; indices
            # go in slices to bound the (indices x k) bit-position temporaries.
            flags = np.zeros(filt.m, dtype=bool)
            for start in range(0, indices.size, _BUILD_SLICE):
                flags[filt.bit_positions(indices[start:start + _BUILD_SLICE]).ravel()] = True
            filt.words = _words_of(np.packbits(flags, bitorder="little"))
        return filt

    def to_bytes(self) -> bytes:
        header = _HEADER.pack(VERSION, self.k, self.seed) + _bits.write_varint(self.nbytes)
        return header + self.words.astype("<u8").tobytes()[:self.nbytes]

    @classmethod
    def from_bytes(cls, data, n: int, what: str) -> "BloomFilter":
        """Parse and check a stream (DecodeError on anything malformed)."""
        if len(data) < _HEADER.size:
            raise DecodeError(f"{what}: stream holds {len(data)} bytes, shorter than the "
                              f"{_HEADER.size}-byte header")
        version, k, seed = _HEADER.unpack_from(data)
        if version != VERSION:
            raise DecodeError(f"{what}: unknown stream version {version}")
        if not 1 <= k <= MAX_HASHES:
            raise DecodeError(f"{what}: hash count {k} outside [1, {MAX_HASHES}]")
        nbytes, offset = _bits.read_varint(data, _HEADER.size, what)
        if not MIN_BYTES <= nbytes <= MAX_BYTES:
            raise DecodeError(f"{what}: filter of {nbytes} bytes outside "
                              f"[{MIN_BYTES}, {MAX_BYTES}]")
        if len(data) != offset + nbytes:
            raise DecodeError(f"{what}: stream holds {len(data)} bytes, expected "
                              f"{offset + nbytes} for a filter of {nbytes} bytes")
        words = _words_of(np.frombuffer(data, dtype=np.uint8, offset=offset))
        return cls(words, nbytes, k, blocked_hashes(k), seed, n)

    def popcount(self) -> int:
        """Set bits of the filter: at most ``k`` per inserted position."""
        return int(np.unpackbits(self.words.view(np.uint8)).sum(dtype=np.int64))

    # ------------------------------------------------------------ hashing

    def _hashes(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        h1 = murmur3_32(positions, self.seed, self.key_bytes)
        h2 = None
        if self.k > self.block_k:
            h2 = murmur3_32(positions, self.seed ^ _SECOND_HASH_SEED, self.key_bytes)
        return h1, h2

    def _word_of(self, h1: np.ndarray) -> np.ndarray:
        return (np.multiply(h1, np.uint64(self.block_words), dtype=np.uint64)
                >> np.uint64(32)).view(np.int64)

    def _single_bit(self, g: np.ndarray) -> np.ndarray:
        """Filter bit of double-hash value ``g`` (uint32): ``g * m >> 32``."""
        return (np.multiply(g, np.uint64(self.m), dtype=np.uint64) >> np.uint64(32)).view(np.int64)

    def bit_positions(self, positions: np.ndarray) -> np.ndarray:
        """The ``k`` filter bits of each position, shape ``(len(positions), k)``, int64."""
        h1, h2 = self._hashes(positions)
        bits = np.empty((positions.size, self.k), dtype=np.int64)
        word = self._word_of(h1)
        pattern = (h1 & np.uint32(PATTERNS - 1)).astype(np.intp)
        bits[:, :self.block_k] = word[:, None] * 64 + self.offsets[pattern]
        g = h2
        for j in range(self.block_k, self.k):  # at most MAX_HASHES iterations
            bits[:, j] = self._single_bit(g)
            g = g + h1
        return bits

    # ------------------------------------------------------------ the scan

    def positives(self, limit: int | None = None, start: int = 0,
                  stop: int | None = None) -> np.ndarray:
        """All positions of ``[start, stop)`` (default ``[0, n)``) the filter reports.

        Increasing, int64. With ``limit``, stops once more than ``limit``
        are found and returns the first ``limit + 1``: enough for callers
        that need ``limit`` of them or must reject a filter with too many.
        The compiled scan runs when it is built (:data:`SCAN_IMPLEMENTATION`),
        else the numpy one; both return the same positions.
        """
        stop = self.n if stop is None else stop
        if not 0 <= start <= stop <= self.n:
            raise ValueError(f"positions [{start}, {stop}) are not a range of [0, {self.n})")
        if start == stop or not self.words.any():
            return np.zeros(0, dtype=np.int64)
        if _bloomscan is not None:
            return self._compiled_scan(start, stop, limit)
        return self._numpy_scan(start, stop, limit)

    def _compiled_scan(self, start: int, stop: int, limit: int | None) -> np.ndarray:
        """``positives`` by the C extension, chunk by chunk (the check for ``limit``)."""
        chunk = min(_COMPILED_CHUNK, stop - start)
        out = np.empty(chunk, dtype=np.int64)
        found, found_count = [], 0
        for first in range(start, stop, chunk):
            count = _bloomscan.scan(self.words, self.masks, first, min(chunk, stop - first),
                                    self.seed, self.key_bytes, self.m, self.k, self.block_k,
                                    out)
            found.append(out[:count].copy())
            found_count += count
            if limit is not None and found_count > limit:
                break
        result = np.concatenate(found)
        return result if limit is None else result[:limit + 1]

    def _numpy_scan(self, start: int, stop: int, limit: int | None) -> np.ndarray:
        """``positives`` in whole-array numpy: the fallback without the C extension."""
        chunk = min(_SCAN_CHUNK, stop - start)
        hasher = RangeHasher(chunk)
        # Three 8-byte buffers reused for every chunk (with the hasher's two
        # 4-byte ones about 33 bytes per position, so a chunk stays in L2):
        # ``wide`` holds h1 widened, then the word index, then the pattern;
        # ``pattern_index`` and ``word`` what their names say.
        buffers = (np.empty(chunk, dtype=np.uint64), np.empty(chunk, dtype=np.int64),
                   np.empty(chunk, dtype=np.uint64), np.empty(chunk, dtype=bool))
        nwords, shift = np.uint64(self.block_words), np.uint64(32)
        low_bits = np.uint64(PATTERNS - 1)
        words, masks = self.words, self.masks
        found, found_count = [], 0
        batch_positions, batch_h1, batch_size = [], [], 0
        first = start
        while first < stop:
            # 8-byte keys share their high word within a run of the hasher.
            count = min(chunk, stop - first, (((first >> 32) + 1) << 32) - first)
            h1 = hasher.hash_range(first, count, self.seed, self.key_bytes)
            # (a short chunk, at a run's end, takes the buffers' start: the next may be whole)
            wide, pattern_index, word, passed = (buffer[:count] for buffer in buffers)
            # A plain widening copy then 8-byte arithmetic beats mixed-type
            # ufuncs, which cast through small buffers.
            np.copyto(wide, h1)
            np.bitwise_and(wide, low_bits, out=pattern_index.view(np.uint64))
            np.multiply(wide, nwords, out=wide)
            np.right_shift(wide, shift, out=wide)
            np.take(words, wide.view(np.int64), out=word, mode="clip")
            np.take(masks, pattern_index, out=wide, mode="clip")
            np.bitwise_and(word, wide, out=word)
            np.equal(word, wide, out=passed)
            survivors = np.flatnonzero(passed)
            batch_h1.append(h1[survivors])
            survivors += first
            batch_positions.append(survivors)
            batch_size += count
            first += count
            if batch_size >= _SCAN_BATCH or first == stop:
                kept = self._probe_singles(np.concatenate(batch_positions),
                                           np.concatenate(batch_h1))
                found.append(kept)
                found_count += kept.size
                batch_positions, batch_h1, batch_size = [], [], 0
                if limit is not None and found_count > limit:
                    break
        result = np.concatenate(found)
        return result if limit is None else result[:limit + 1]

    def _probe_singles(self, positions: np.ndarray, h1: np.ndarray) -> np.ndarray:
        """Keep the positions whose single (non-blocked) bits are all set.

        Probes run one bit at a time. While many candidates fail a probe
        (the false positives of the word test, half of them per probe) the
        candidates are compacted after each; once nearly all pass (the true
        indices) a running mask is cheaper than copying three arrays.
        """
        if self.k == self.block_k or positions.size == 0:
            return positions
        g = murmur3_32(positions, self.seed ^ _SECOND_HASH_SEED, self.key_bytes)
        m, low6 = np.uint64(self.m), np.uint64(63)
        alive = None  # None: every candidate has passed the probes so far
        for j in range(self.k - self.block_k):  # at most MAX_HASHES iterations
            if j:
                np.add(g, h1, out=g)
            bit = np.multiply(g, m, dtype=np.uint64)
            np.right_shift(bit, np.uint64(32), out=bit)
            word = np.take(self.words, (bit >> np.uint64(6)).view(np.int64), mode="clip")
            np.bitwise_and(bit, low6, out=bit)
            np.right_shift(word, bit, out=word)
            hit = word.view(np.uint8)[::8] if _LITTLE_ENDIAN else word.astype(np.uint8)
            passed = np.bitwise_and(hit, np.uint8(1)).view(bool)
            alive = passed if alive is None else np.logical_and(alive, passed, out=alive)
            if np.count_nonzero(alive) < _COMPACT_BELOW * alive.size:
                keep = np.flatnonzero(alive)
                positions, h1, g = positions[keep], h1[keep], g[keep]
                alive = None
        return positions if alive is None else positions[alive]


# ----------------------------------------------------------------- policies

def _smallest_keys(keys: np.ndarray, count: int) -> np.ndarray:
    """Indices of the ``count`` smallest keys, ties broken by position (deterministic)."""
    return np.argsort(keys, kind="stable")[:count]


def _random_selection(filt: BloomFilter, positives: np.ndarray, r: int) -> np.ndarray:
    keys = murmur3_32(positives, filt.seed ^ _SELECTION_SEED, filt.key_bytes)
    return np.sort(positives[_smallest_keys(keys, r)])


def _conflict_set_selection(filt: BloomFilter, positives: np.ndarray, r: int,
                            rounds: int = _CONFLICT_ROUNDS) -> np.ndarray:
    """The paper's Algorithm 1 (see the module docstring): ``r`` of the ``positives``.

    The C extension's loop runs when it is built, else :func:`_conflict_sets_numpy`;
    both select the same positions. ``rounds``: visits of every set before the
    shortfall is filled (tests lower it to reach that path).
    """
    p = positives.size
    if r >= p:
        return positives
    if p >= 2**31 or p * filt.k >= 2**32:  # positives and pairs are numbered with 4 bytes
        raise DecodeError(f"conflict_sets: {p} positives of {filt.k} hashes, more than the "
                          "policy handles")
    if _bloomscan is None:
        return _conflict_sets_numpy(filt, positives, r, rounds)
    out = np.empty(r, dtype=np.int64)
    _bloomscan.conflict_sets(filt.words, filt.masks, np.ascontiguousarray(positives, np.int64),
                             r, filt.seed, filt.seed ^ _SELECTION_SEED, filt.key_bytes, filt.m,
                             filt.k, filt.block_k, rounds, out)
    return out


def _level_rows(starts: np.ndarray, size: int, member: np.ndarray,
                pair_key: np.ndarray) -> np.ndarray:
    """The members of the sets of one ``size`` starting at ``starts`` (in the pairs),
    a row per set, each by (pair key, position): ``(len(starts), size)`` uint32."""
    where = starts[:, None] + np.arange(size)
    rows = (pair_key[where].astype(np.uint64) << np.uint64(32)) | member[where]
    rows.sort(axis=1)  # keys are distinct: the positions differ
    return (rows & np.uint64(2**31 - 1)).astype(np.uint32)


def _conflict_sets_numpy(filt: BloomFilter, positives: np.ndarray, r: int,
                         rounds: int) -> np.ndarray:
    """:func:`_conflict_set_selection` on whole arrays, the sets of one size at a time.

    Memory: about 20 bytes per (positive, distinct bit) pair at its peak (grouping
    them), then 12; nothing grows with the universe.
    """
    p = positives.size
    # One pair per (bit, positive) as bit << 31 | positive, sorted in place: grouped
    # by bit then positive; a positive whose own bits collide counts once.
    pairs = filt.bit_positions(positives)
    np.left_shift(pairs, 31, out=pairs)
    pairs |= np.arange(p)[:, None]
    pairs = pairs.reshape(-1)
    pairs.sort()
    repeat = pairs[1:] == pairs[:-1]
    if repeat.any():
        pairs = pairs[np.r_[True, ~repeat]]
    del repeat
    bit = (pairs >> 31).astype(np.uint32)
    member = (pairs & (2**31 - 1)).astype(np.uint32)
    del pairs
    set_start = np.flatnonzero(np.r_[True, bit[1:] != bit[:-1]])
    set_size = np.diff(np.r_[set_start, bit.size])
    set_bit = bit[set_start]

    # Random draws every rank reproduces: a key per positive, one per set, and one
    # per (set, member) pair for the choice inside a set. Sorts are stable (or of
    # distinct keys) so ties resolve the same way everywhere.
    seed = filt.seed ^ _SELECTION_SEED
    positive_key = murmur3_32(positives, seed, filt.key_bytes)
    set_key = murmur3_32(set_bit, seed)
    pair_key = np.empty(bit.size, dtype=np.uint32)
    for lo in range(0, bit.size, _BUILD_SLICE):  # bounds murmur's temporaries
        hi = lo + _BUILD_SLICE
        pair_key[lo:hi] = murmur3_32(bit[lo:hi], positive_key[member[lo:hi]])
    del bit, positive_key

    # Rank sets by (size, key). The sets of one size (a level) are rows of one
    # matrix, each row its members by (pair key, position): the first unselected
    # member of a row is the set's random choice.
    set_order = np.argsort((set_size.astype(np.uint64) << np.uint64(32)) | set_key,
                           kind="stable")
    set_rank = np.empty_like(set_order)
    set_rank[set_order] = np.arange(set_order.size)
    rank_size = set_size[set_order]
    level_start = np.flatnonzero(np.r_[True, rank_size[1:] != rank_size[:-1]])
    levels = [(first, end, _level_rows(set_start[set_order[first:end]], int(rank_size[first]),
                                       member, pair_key))
              for first, end in zip(level_start.tolist(),
                                    np.r_[level_start[1:], rank_size.size].tolist())]
    del member, pair_key

    def set_ranks(chosen):
        """The set ranks of each chosen positive, shape ``(len(chosen), k)``."""
        bits = filt.bit_positions(positives[chosen]).astype(np.uint32)
        return set_rank[np.searchsorted(set_bit, bits)]

    selected = np.zeros(p, dtype=bool)
    touched = np.zeros(rank_size.size, dtype=bool)  # gained a selected member since last visit
    count = 0
    for _ in range(rounds):
        for first_rank, end_rank, rows in levels:  # one pass per distinct set size
            open_rows = np.flatnonzero(~touched[first_rank:end_rank])
            touched[first_rank:end_rank] = False
            unselected = ~selected[rows[open_rows]]
            column = unselected.argmax(axis=1)
            picking = unselected[np.arange(open_rows.size), column]
            if not picking.any():
                continue
            pickers = open_rows[picking]
            nominees = rows[pickers, column[picking]]
            _, first_nomination = np.unique(nominees, return_index=True)
            first_nomination.sort()
            chosen = nominees[first_nomination][:r - count]
            selected[chosen] = True
            count += chosen.size
            touched[set_ranks(chosen)] = True
            touched[first_rank + pickers] = False  # a set's own pick does not compromise it
            if count == r:
                return positives[selected]
    # Shortfall after the last round: positives whose smallest set comes first.
    rest = np.flatnonzero(~selected)
    first_set = np.concatenate([set_ranks(rest[lo:lo + _SCAN_CHUNK]).min(axis=1)
                                for lo in range(0, rest.size, _SCAN_CHUNK)])
    selected[rest[_smallest_keys(first_set, r - count)]] = True
    return positives[selected]


# ----------------------------------------------------------------- the codec

@register_codec
class BloomIndices(IndexCodec):
    """Bloom-filter index set with DeepReduce's false-positive policies (lossy).

    Parameters
    ----------
    fpr : float
        Target false-positive rate, in ``[1e-15, 1)``; sets the size (about
        ``1.44 log2(1/fpr)`` bits per index) and the hash count.
    policy : {"p0", "leftmost", "random", "conflict_sets", "naive"}
        Which positives receive values (see the module docstring).
    seed : int
        Hash seed in ``[0, 2**32)``, mixed with ``step``, the encodes made so far.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.index.bloom import BloomIndices
    >>> n = 100_000
    >>> dense = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    >>> true = np.flatnonzero(np.abs(dense) > 3.0)
    >>> codec = BloomIndices(fpr=0.001, policy="p0")
    >>> data, received, values = codec.encode_selection(true, dense[true], n, dense)
    >>> bool(np.isin(true, received).all()), bool((values == dense[received]).all())
    (True, True)
    >>> bool((codec.decode(data, n, received.size) == received).all())
    True
    """

    codec_id = "bloom"
    lossless = False
    scans_universe = True

    def __init__(self, fpr: float = 0.001, policy: str = "p0", seed: int = 0):
        if isinstance(fpr, bool) or not isinstance(fpr, (int, float)) \
                or not MIN_FPR <= fpr < 1:
            raise ValueError(f"fpr must be a number in [{MIN_FPR}, 1), got {fpr!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MASK32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
        self.fpr = float(fpr)
        self.policy = policy
        self.seed = seed
        #: Encodes made so far: the next one draws from ``seed`` and ``step``. Save
        #: it to continue a sequence, set it to replay one (checkpoints store it).
        self.step = 0

    def _next_seed(self) -> int:
        seed = int(murmur3_32(np.array([self.step], dtype=np.uint64), self.seed, 8)[0])
        self.step += 1
        return seed

    def build_filter(self, indices, n: int) -> BloomFilter:
        """The filter of ``indices`` (checked) with the next per-call seed."""
        indices = _bits.check_indices(indices, n)
        return BloomFilter.build(indices, n, self.fpr, self._next_seed())

    def select(self, filt: BloomFilter, r: int, what: str = "bloom indices") -> np.ndarray:
        """The positions the policy gives values to, increasing; ``r``: values sent.

        Sender and receiver both call this (``p0`` ignores ``r``). Raises
        DecodeError when the filter has fewer than ``r`` positives.
        """
        if self.policy == "p0":
            return filt.positives()
        leftmost = self.policy in ("leftmost", "naive")
        # the others choose among all positives: never hold more than the declared
        # false-positive rate allows, however the filter was crafted
        allowed = r if leftmost else self.positives_allowed(filt.n, r)
        positives = filt.positives(limit=allowed)
        if not leftmost and positives.size > allowed:
            raise DecodeError(f"{what}: filter has more than {allowed} positives, more than "
                              f"{r} true ones and fpr={self.fpr} allow")
        if positives.size < r:
            raise DecodeError(f"{what}: filter has {positives.size} positives, fewer than "
                              f"nnz={r}")
        if leftmost:
            return positives[:r]
        if self.policy == "random":
            return _random_selection(filt, positives, r)
        return _conflict_set_selection(filt, positives, r)

    def positives_allowed(self, n: int, r: int) -> int:
        """Most positives a filter of ``r`` positions of ``[0, n)`` at this ``fpr`` may show.

        The expected false positives, ``fpr * n``, four times over plus ten
        standard deviations and a constant: an honest filter stays far below,
        and decoding never holds more positions than this.
        """
        expected = self.fpr * max(0, n - r)
        return min(n, r + int(4 * expected + 10 * math.sqrt(expected)) + 1024)

    def encode(self, indices, n):
        return self.build_filter(indices, n).to_bytes()

    def encode_selection(self, indices, values, n, dense=None):
        indices = _bits.check_indices(indices, n)
        values = np.asarray(values)
        if values.shape != indices.shape:
            raise ValueError(f"values shape {values.shape} does not match indices "
                             f"shape {indices.shape}")
        if dense is not None:
            dense = np.asarray(dense).reshape(-1)
            if dense.size != n:
                raise ValueError(f"dense has {dense.size} elements, expected n={n}")
        filt = BloomFilter.build(indices, n, self.fpr, self._next_seed())
        received = self.select(filt, indices.size)
        if self.policy == "naive":
            return filt.to_bytes(), received, values.copy()
        sent = np.zeros(received.size, dtype=values.dtype)
        where = np.minimum(np.searchsorted(indices, received), max(indices.size - 1, 0))
        true = indices[where] == received if indices.size else np.zeros(received.size, bool)
        sent[true] = values[where[true]]
        if dense is not None:
            sent[~true] = dense[received[~true]]
        return filt.to_bytes(), received, sent

    def decode(self, data, n, nnz):
        what = f"bloom indices ({self.policy})"
        n, nnz = _bits.check_counts(n, nnz, what)
        filt = BloomFilter.from_bytes(data, n, what)
        # checked before the scan, whose cost grows with the universe: a filter of
        # nnz positions (p0: at most nnz) sets at most k bits for each
        if filt.popcount() > filt.k * nnz:
            raise DecodeError(f"{what}: filter sets {filt.popcount()} bits, more than "
                              f"k={filt.k} for each of the nnz={nnz} positives it may hold")
        if self.policy == "p0":
            positives = filt.positives(limit=nnz)
            if positives.size != nnz:
                more = "more than " if positives.size > nnz else ""
                raise DecodeError(f"{what}: filter has {more}{positives.size} positives, "
                                  f"expected nnz={nnz}")
            return positives
        return self.select(filt, nnz, what)
