"""Automatic choice of the smallest exact index code, per tensor.

No single index code is best everywhere: a bitmap wins on dense sets, Golomb
codes on uniformly sparse ones, run codes on clustered ones, Huffman codes
on skewed gap distributions, and LZ compressors (deflate, zstd) on the
repetitive column patterns that Top-k of real layers often has. ``auto``
picks per tensor and writes its choice in the first byte of the stream.
"""

from __future__ import annotations

import numpy as np

from deepreduce import bits as _bits
from deepreduce.codecs.index import (bitmap, bitpack, deflate, eliasfano, golomb, huffman, raw,
                                     rle, runs, varint, zstd)
from deepreduce.codecs.base import IndexCodec, expect_length, no_indices
from deepreduce.errors import DecodeError
from deepreduce.registry import register_codec

#: Sub-codec of each tag value, always in its default configuration. The
#: order is part of the stream format: append new codecs, never reorder.
TAGS = ("bitmap", "golomb", "huffman", "runs", "eliasfano", "bitpack", "varint",
        "deflate", "zstd", "rle", "raw")

#: The class behind each tag: bound here, in the format, not looked up in the
#: registry, so registering another codec under one of these names (``replace=True``)
#: never changes how an existing ``auto`` stream decodes.
TAG_CODECS = (bitmap.BitmapIndices, golomb.GolombIndices, huffman.HuffmanIndices,
              runs.RunsIndices, eliasfano.EliasFanoIndices, bitpack.BitpackIndices,
              varint.VarintIndices, deflate.DeflateIndices, zstd.ZstdIndices,
              rle.RleIndices, raw.RawIndices)
assert tuple(cls.codec_id for cls in TAG_CODECS) == TAGS

#: Order of the trials: on equal sizes the first (fastest to decode) wins;
#: the bitmap comes last so that it is only built when it is the smallest.
TRIAL_ORDER = tuple(TAGS.index(name) for name in (
    "golomb", "runs", "bitpack", "eliasfano", "huffman", "varint", "rle", "raw",
    "zstd", "deflate", "bitmap"))

#: Flag in the tag byte: the sub-codec stream holds the complement set.
COMPLEMENT = 0x80

#: Up to this many indices every available sub-codec is simply tried...
#: The trials pay ten codec calls' fixed cost however small the set, several
#: times what the closed-form estimates cost, but on sets this small the
#: estimates may lose a byte or two, which weighs on a training step full of
#: such tensors (``benchmarks/index_codecs.py`` times auto's fixed cost per call).
TRIAL_LIMIT = 64

#: ...unless the Golomb or run code, whose sizes have closed forms, already
#: takes fewer bytes than this: trials could save a few bytes at most.
SMALL_STREAM = 64

#: Gap values the Huffman size estimate looks at, at most.
HUFFMAN_SAMPLE = 1 << 13

#: LZ codecs (deflate, zstd) win on the repetitive column patterns of real
#: layers, which no histogram shows. They are tried on the whole set only after
#: two checks on slices of consecutive indices, each against the best estimated
#: codec's closed-form size for the same slice: zstd on LZ_SLICES[0] indices
#: within a margin of it, then the better LZ codec on LZ_SLICES[1] indices no
#: larger. LZ gains grow with the input, so a slice understates them: the margin
#: is LZ_MARGIN for a set much larger than the slice and shrinks to none as the
#: slice becomes the whole set (a set of a few thousand indices no longer pays
#: two LZ trials for a stream the slice already showed larger). A set no larger
#: than the first slice is coded whole by zstd at once, that stream kept, and the
#: other LZ codec tried when it comes within LZ_MARGIN of the best. Uniform sets
#: fail the checks. With ``link_gbits`` they are looked for only when a stream of
#: no bytes would pay for its coding and for the first check.
LZ_SLICES = (2048, 8192)
LZ_MARGIN = 1.08

#: The instance of one tensor (:meth:`AutoIndices.for_one_tensor`) remembers its last
#: full choice for its next RECHECK - 1 sets of about the same size (the bit length of
#: the count): a tensor's Top-k sets keep their character from step to step, and on
#: sets of a few thousand indices the choice cost twice the chosen code's encoding.
#: When the winner's cost was below every other candidate's by CLEAR_WIN, those sets
#: are coded with it at once; else, when the LZ codecs lost (their slice check failed,
#: or their streams were no smaller), those sets are chosen without them. LZ codecs
#: that won narrowly, and close calls, are weighed every time.
RECHECK = 8
CLEAR_WIN = 0.03

#: When the runner-up's estimate is within this fraction of the best, both
#: are encoded and the smaller stream kept.
CLOSE_CALL = 0.005

_LZ = ("deflate", "zstd")

#: In a tensor's memory (see RECHECK): its next sets are chosen without the LZ codecs.
_NO_LZ = -1

#: Encode + decode time of the candidates of the estimates, for ``link_gbits``:
#: ns per call, per index, per run of adjacent indices and per element of the
#: universe. Fitted by ``benchmarks/index_codecs.py`` (its coding-time section
#: prints a fresh fit and this model's error) on one core of its machine; a faster
#: or slower machine scales them all alike, and what the choice weighs is their
#: differences against the wire's ``8 / link_gbits`` ns per byte.
CODING_NS = {
    #           call    index  run   element
    "golomb":  (8.3e3,  3.4,   1.1,  0),
    "huffman": (10e3,   9.1,   1.8,  0),
    "runs":    (140e3,  3.4,   44,   0),
    "bitmap":  (22e3,   11.4,  42,   0.18),
    "zstd":    (78e3,   18,    4.1,  0),
    "deflate": (45e3,   23,    34,   0),
}

#: ns per element of the universe to build the complement (encoder) and to expand
#: it back (decoder).
COMPLEMENT_NS = 4.0


def coding_ns(codec_id: str, count: int, run_count: int, n: int, calls: int = 1) -> float:
    """Modelled encode + decode time in ns of ``count`` indices in ``run_count``
    runs of adjacent indices, in a universe of ``n`` (see :data:`CODING_NS`);
    ``calls=0`` leaves out the fixed cost of a call (for a part of a set)."""
    per_call, per_index, per_run, per_element = CODING_NS[codec_id]
    return per_call * calls + per_index * count + per_run * run_count + per_element * n


#: The default-configured codec of each tag, built once: a codec holds nothing but
#: its configuration, so every call and thread may share it (building one checks its
#: parameters, which costs more than estimating a small set's size).
_DEFAULT_CODECS = tuple(cls() for cls in TAG_CODECS)
_HUFFMAN = _DEFAULT_CODECS[TAGS.index("huffman")]


def _sub_codec(tag: int):
    """The default-configured codec of a tag."""
    return _DEFAULT_CODECS[tag]


def _size_floor(codec_id: str, indices: np.ndarray, n: int, run_count: int) -> int:
    """A size in bytes the codec's stream cannot go below (from its documented layout).

    Used only to skip trials, so a loose floor costs time, never size.
    """
    k = indices.size
    if codec_id == "raw":
        return 4 * k
    if codec_id == "varint":
        return k
    if codec_id == "bitpack":
        return k * max(n - 1, 0).bit_length() // 8
    if codec_id == "bitmap":
        return _bits.packed_bytes(n)
    if codec_id == "rle":
        return 2 * run_count
    if codec_id == "eliasfano":
        # k low parts of floor(log2(n / k)) bits and k unary ones.
        return k * (max(0, (n // k).bit_length() - 1) + 1) // 8
    if codec_id == "runs":
        # Three varints, then two Golomb streams of run_count codes each.
        return 5 + 2 * (run_count // 8)
    if codec_id == "huffman":
        # Table, codes and offsets without the block lengths: one block.
        return huffman.estimate_gap_bits(indices, 1, _HUFFMAN.precision, k)[0] // 8
    return 0


def _lz_codecs():
    """``(tag, codec)`` of the LZ codecs."""
    tags = [TAGS.index(name) for name in _LZ]
    return [(tag, _sub_codec(tag)) for tag in tags]


def _estimated_size(tag: int, indices: np.ndarray) -> int:
    """Bytes of a codec with a closed-form size (:meth:`AutoIndices._estimate`'s
    candidates) for a set starting at 0, in the universe up to its last index."""
    name = TAGS[tag]
    if name == "bitmap":
        return _bits.packed_bytes(int(indices[-1]) + 1)
    if name == "runs":
        return runs.stream_size(indices)
    if name == "huffman":
        return _HUFFMAN.encoded_bits(indices) // 8
    return _sub_codec(TAGS.index("golomb")).encoded_size(indices)


def _golomb_stream(indices: np.ndarray) -> golomb.IndexStream:
    """The default Golomb code of the set, with its count of adjacent indices."""
    return golomb.IndexStream(indices, golomb.choose_parameter(golomb.mean_gap(indices)),
                              count_adjacent=True)


def complement(indices: np.ndarray, n: int) -> np.ndarray:
    """The sorted indices of ``[0, n)`` not in ``indices`` (allocates ``n`` bytes)."""
    mask = np.ones(n, dtype=bool)
    mask[indices] = False
    return np.flatnonzero(mask)


@register_codec
class AutoIndices(IndexCodec):
    """The smallest of the exact index codecs, chosen per tensor; one tag byte says which.

    The first byte is the sub-codec's position in :data:`TAGS`, plus
    :data:`COMPLEMENT` when the sub-codec codes the absent indices instead
    (only for sets holding more than half the universe); the rest is that
    codec's stream. An empty set is an empty stream.

    Up to :data:`TRIAL_LIMIT` indices every sub-codec (and, for dense sets,
    every sub-codec on the complement) is tried and the smallest stream
    kept, so ``auto`` is never more than one byte larger than any of them,
    except on sets of at most half the universe that the Golomb code (or,
    on clustered sets, the run code) takes to fewer than :data:`SMALL_STREAM`
    bytes: that stream is written without trials, which would cost more
    time than they could save bytes. Above :data:`TRIAL_LIMIT` indices,
    sizes come from cheap estimates instead of trial encodings: exact
    closed forms for the bitmap, Golomb and run codes (one pass over
    the gaps) and the symbol histogram of a gap sample for Huffman. The LZ
    codecs, whose gains no histogram predicts, are tried on the whole set
    only when they beat the best estimated codec on slices of it (see
    :data:`LZ_SLICES`); the instance of one tensor (:meth:`for_one_tensor`, which
    the exchanges use) codes its next few sets of about the same size with the
    last winner when it won clearly, or skips the LZ codecs after they lost
    (:data:`RECHECK`), so it may code a set a little differently from a fresh
    instance. The best estimate is encoded, and so is the runner-up when within
    :data:`CLOSE_CALL` of it.

    Parameters
    ----------
    link_gbits : float or None, default None
        The link's bandwidth in Gbit/s, when known. None picks the smallest
        stream. A bandwidth makes the estimates pick the cheapest stream to send
        and code instead: its bytes at this bandwidth plus the encode and
        decode time the codec takes on a set of this size, run count and
        universe (:data:`CODING_NS`), as one payload sent to one peer. At
        10 Gbit/s a byte costs 0.8 ns, so a Golomb code 1% larger than a Huffman
        code that takes about 5 ns more per index to code wins; at 100 Mbit/s a
        byte costs 80 ns and a Huffman code a few percent smaller does. Sets of
        at most :data:`TRIAL_LIMIT` indices are still chosen by size. The
        bandwidth only steers the encoder: payload headers name plain ``auto``
        and any reader decodes the stream.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.index.auto import AutoIndices, TAGS
    >>> codec = AutoIndices()
    >>> rng = np.random.default_rng(0)
    >>> sparse = np.sort(rng.choice(1_000_000, 10_000, replace=False))
    >>> data = codec.encode(sparse, n=1_000_000)
    >>> TAGS[data[0]], round(8 * len(data) / sparse.size, 2)
    ('golomb', 8.11)
    >>> chosen = np.sort(rng.choice(1000, 40, replace=False))  # 40 rows of 64
    >>> rows = (chosen[:, None] * 64 + np.arange(64)).ravel()
    >>> TAGS[codec.encode(rows, n=64_000)[0]], len(codec.encode(rows, n=64_000))
    ('runs', 41)
    >>> np.array_equal(codec.decode(data, n=1_000_000, nnz=sparse.size), sparse)
    True

    Rows of a low-rank gradient: the smallest stream, and the cheapest at 10 Gbit/s.

    >>> g = rng.standard_normal((512, 8)) @ rng.standard_normal((8, 512))
    >>> top = np.sort(np.argpartition(np.abs(g).ravel(), -2621)[-2621:])
    >>> [TAGS[AutoIndices(link).encode(top, n=g.size)[0]] for link in (None, 10)]
    ['huffman', 'golomb']
    """

    codec_id = "auto"
    encoder_options = ("link_gbits",)

    def __init__(self, link_gbits: float | None = None):
        if link_gbits is not None and (
                isinstance(link_gbits, bool) or not isinstance(link_gbits, (int, float))
                or not 0 < link_gbits < float("inf")):
            raise ValueError(f"link_gbits must be None or a positive number of Gbit/s, "
                             f"got {link_gbits!r}")
        self.link_gbits = link_gbits
        #: (count's bit length, sets left, the tag they are coded with or _NO_LZ), in
        #: the instance of one tensor (see RECHECK); None in a shared one, which
        #: remembers nothing
        self._memory = None

    def for_one_tensor(self) -> "AutoIndices":
        """A fresh instance of this configuration that remembers its last choice (see
        :data:`RECHECK`)."""
        codec = type(self).from_config(self.get_config())
        codec._memory = (0, 0, _NO_LZ)
        return codec

    def choose(self, indices: np.ndarray, n: int) -> tuple[int, bytes]:
        """``(tag byte, sub-codec stream)`` for an index set: :meth:`encode` gives it a
        non-empty one, and the estimates the complement of a dense one, which is empty
        for a full set (then the stream is too).

        The set must pass :func:`deepreduce.bits.check_indices` but for its
        order, which is checked here (the Golomb stream, written first, checks it).
        """
        if indices.size > TRIAL_LIMIT:
            return self._estimate(indices, n)
        if 0 < 2 * indices.size <= n:  # (the empty complement of a full set is tried)
            small = self._small_stream(indices, n)
            if small is not None:
                return small
        else:
            _bits.check_order_of(indices)
        return self._try_all(indices, n)

    def _small_stream(self, indices, n):
        """The Golomb or run stream when the smaller is below :data:`SMALL_STREAM` bytes."""
        coded = _golomb_stream(indices)
        sizes = {TAGS.index("golomb"): coded.size}
        if 4 * coded.adjacent > indices.size:  # clustered, as in _estimate
            sizes[TAGS.index("runs")] = runs.stream_size(indices)
        tag = min(sizes, key=sizes.get)  # on a tie Golomb, the faster to decode
        if sizes[tag] >= SMALL_STREAM:
            return None
        return tag, self._encode_with(tag, indices, n, coded)

    def _try_all(self, indices, n):
        if indices.size == 0:  # (the complement of a full set, from _estimate)
            return TRIAL_ORDER[0], b""
        if indices.size == n:  # its complement is empty: no stream is shorter
            return TRIAL_ORDER[0] | COMPLEMENT, b""
        best = None
        sets = [(0, indices)]
        if 2 * indices.size > n:
            sets.append((COMPLEMENT, complement(indices, n)))
        for flag, members in sets:
            run_count = int(np.count_nonzero(np.diff(members) != 1)) + 1
            for tag in TRIAL_ORDER:
                codec = _sub_codec(tag)
                # Skip codecs whose stream cannot be smaller than the best
                # so far: saves most trials on small tensors.
                if best is not None and _size_floor(
                        TAGS[tag], members, n, run_count) >= len(best[1]):
                    continue
                data = codec.encode(members, n)
                if best is None or len(data) < len(best[1]):
                    best = (tag | flag, data)
        return best

    def _slice_model(self, members: np.ndarray):
        """``cost(tag, size)`` of a stream coding ``members`` (a slice starting at 0, part
        of a larger set: no fixed cost per call), as :meth:`_cost_model` weighs it."""
        if self.link_gbits is None:
            return lambda tag, size: size
        run_count = int(np.count_nonzero(np.diff(members) != 1)) + 1
        ns_per_byte, n = 8 / self.link_gbits, int(members[-1]) + 1
        return lambda tag, size: (size * ns_per_byte + coding_ns(
            TAGS[tag], members.size, run_count, n, calls=0))

    def _cost_model(self, count: int, run_count: int, n: int):
        """``cost(tag, size)`` of a stream of the set: its size, or with
        ``link_gbits`` the ns to send and code it (the tag may carry
        :data:`COMPLEMENT`)."""
        if self.link_gbits is None:
            return lambda tag, size: size
        ns_per_byte = 8 / self.link_gbits

        def cost(tag, size):
            name = TAGS[tag & ~COMPLEMENT]
            if tag & COMPLEMENT:  # the absent indices fill the gaps between the runs
                return (size * ns_per_byte + coding_ns(name, n - count, run_count, n)
                        + COMPLEMENT_NS * n)
            return size * ns_per_byte + coding_ns(name, count, run_count, n)
        return cost

    def _estimate(self, indices, n):
        recalled = self._recall(indices.size)
        if recalled is not None and recalled != _NO_LZ:
            return recalled, _sub_codec(recalled).encode(indices, n)  # (which checks order)
        coded = _golomb_stream(indices)
        cost = self._cost_model(indices.size, indices.size - coded.adjacent, n)
        sizes = {TAGS.index("bitmap"): _bits.packed_bytes(n),
                 TAGS.index("golomb"): coded.size}

        def may_win(tag):  # (a code whose coding alone costs more is not even sized)
            return cost(tag, 0) < min(cost(other, size) for other, size in sizes.items())

        # Runs only pay when many neighbours are adjacent (gap 0).
        if 4 * coded.adjacent > indices.size and may_win(TAGS.index("runs")):
            sizes[TAGS.index("runs")] = runs.stream_size(indices)
        huffman_tag = TAGS.index("huffman")
        if may_win(huffman_tag):
            sample_bits, gaps = huffman.estimate_gap_bits(
                indices, -(-indices.size // HUFFMAN_SAMPLE), _HUFFMAN.precision, _HUFFMAN.block)
            sizes[huffman_tag] = int(sample_bits * indices.size / gaps) // 8
        ranked = sorted(sizes, key=lambda tag: cost(tag, sizes[tag]))
        best = (ranked[0], self._encode_with(ranked[0], indices, n, coded))
        # the cost of every candidate: estimated, then coded where it was
        costs = {tag: cost(tag, size) for tag, size in sizes.items()}
        costs[best[0]] = best_cost = cost(best[0], len(best[1]))
        # an LZ stream must pay for its coding and, with a link, for the slice check
        # that looks for it (a set this small is cheaper sent than searched)
        check_ns = 0 if self.link_gbits is None else coding_ns(
            "zstd", min(indices.size, LZ_SLICES[0]), 0, 0)
        lz = [(tag, codec) for tag, codec in _lz_codecs()
              if cost(tag, 0) + check_ns < best_cost and recalled != _NO_LZ]
        for tag, data in self._lz_streams(indices, ranked[0], lz, cost, best_cost):
            costs[tag] = cost(tag, len(data))
            if costs[tag] < best_cost:
                best, best_cost = (tag, data), costs[tag]
        for tag in ranked[1:]:
            if cost(tag, sizes[tag]) > (1 + CLOSE_CALL) * best_cost:
                break
            data = self._encode_with(tag, indices, n, coded)
            costs[tag] = cost(tag, len(data))
            if costs[tag] < best_cost:
                best, best_cost = (tag, data), costs[tag]
        if 2 * indices.size > n and (self.link_gbits is None or COMPLEMENT_NS * n < best_cost):
            tag, data = self.choose(complement(indices, n), n)
            if cost(tag | COMPLEMENT, len(data)) < best_cost:
                return tag | COMPLEMENT, data  # (a set this dense is not remembered)
        if self._memory is not None and recalled is None:
            runner_up = min((c for tag, c in costs.items() if tag != best[0]), default=None)
            if runner_up is not None and (1 + CLEAR_WIN) * best_cost <= runner_up:
                self._memory = (indices.size.bit_length(), RECHECK - 1, best[0])
            elif lz and best[0] not in dict(lz):
                self._memory = (indices.size.bit_length(), RECHECK - 1, _NO_LZ)
        return best

    def _recall(self, count: int):
        """What this tensor's last full choice says of a set of ``count`` indices (see
        :data:`RECHECK`), counting this set against it: the tag to code it with,
        :data:`_NO_LZ`, or None for a full choice."""
        memory = self._memory
        if memory is None or not memory[1] or memory[0] != count.bit_length():
            return None
        self._memory = (memory[0], memory[1] - 1, memory[2])
        return memory[2]

    def _lz_streams(self, indices, best_tag, candidates, cost, best_cost) -> list:
        """``(tag, stream)`` of the LZ ``candidates`` (``(tag, codec)``) on the whole set
        that are worth weighing against the best stream (of ``best_cost``): none where
        the slice checks say they lose."""
        if not candidates:
            return []
        if indices.size > LZ_SLICES[0]:
            if not self._lz_worth_trying(indices, best_tag, candidates):
                return []
            varints = _bits.varint_encode(_bits.gaps(indices))  # what every LZ codec packs
            return [(tag, codec.encode_varints(varints)) for tag, codec in candidates]
        # the first slice would be the whole set: its stream is coded for real and
        # kept, and the others are tried only when it comes within the margin
        varints = _bits.varint_encode(_bits.gaps(indices))
        *others, (tag, codec) = candidates
        first = (tag, codec.encode_varints(varints))
        if cost(tag, len(first[1])) > LZ_MARGIN * best_cost:
            return [first]
        return [first] + [(tag, codec.encode_varints(varints)) for tag, codec in others]

    def _lz_worth_trying(self, indices, best_tag, candidates) -> bool:
        """Whether the LZ ``candidates`` (``(tag, codec)``) beat the best estimated codec
        on slices of the set, in size or, with ``link_gbits``, in cost."""

        def piece(size):
            size = min(size, indices.size)
            start = (indices.size - size) // 2
            return indices[start:start + size] - indices[start]

        def lz_versus_best(members, trying):
            """The cost of the cheapest of the LZ codecs ``trying`` on a slice, and of the
            best estimated codec."""
            cost = self._slice_model(members)
            varints = _bits.varint_encode(_bits.gaps(members))
            return (min(cost(tag, len(codec.encode_varints(varints))) for tag, codec in trying),
                    cost(best_tag, _estimated_size(best_tag, members)))

        lz, best = lz_versus_best(piece(LZ_SLICES[0]), candidates[-1:])
        unseen = max(0.0, 1 - LZ_SLICES[0] / indices.size)  # of the set, outside the slice
        if lz > (1 + (LZ_MARGIN - 1) * unseen) * best:
            return False  # the usual verdict on uniform sets, for the price of one slice
        if indices.size <= 4 * LZ_SLICES[1]:
            return True   # small enough to try the LZ codecs on the whole set
        lz, best = lz_versus_best(piece(LZ_SLICES[1]), candidates)
        return lz <= best

    @staticmethod
    def _encode_with(tag, indices, n, coded) -> bytes:
        if TAGS[tag] == "golomb":
            return coded.data()
        return _sub_codec(tag).encode(indices, n)

    def encode(self, indices, n):
        indices = _bits.check_indices(indices, n, check_order=False)  # choose checks
        if indices.size == 0:
            return b""
        tag, data = self.choose(indices, n)
        return bytes([tag]) + data

    def max_count(self, data, n):
        if not data:
            return 0
        tag = data[0] & ~COMPLEMENT
        if data[0] & COMPLEMENT or tag >= len(TAGS):
            return None  # a complement's size says nothing of the set's; decode refuses bad tags
        return _sub_codec(tag).max_count(memoryview(data)[1:], n)

    def orders(self, data):
        # (the tag's codec's answer; a complement's order the pipeline checks)
        return len(data) > 0 and not data[0] & COMPLEMENT and \
            data[0] < len(TAGS) and _sub_codec(data[0]).orders(memoryview(data)[1:])

    def decode(self, data, n, nnz):
        what = "auto indices"
        n, nnz = _bits.check_counts(n, nnz, what)
        if nnz == 0:
            return no_indices(data, what)
        if len(data) == 0:
            raise DecodeError(f"{what}: empty stream for {nnz} indices")
        tag, flag = data[0] & ~COMPLEMENT, data[0] & COMPLEMENT
        if tag >= len(TAGS):
            raise DecodeError(f"{what}: unknown codec tag {tag}")
        codec = _sub_codec(tag)
        if not flag:
            if TAGS[tag] == "golomb":
                # The hot path: skip copying the stream past the tag.
                return golomb.decode_index_gaps(memoryview(data)[1:], n, nnz, what)
            return codec.decode(data[1:], n, nnz)
        if 2 * nnz <= n:
            raise DecodeError(f"{what}: complement flag on a set of {nnz} of {n} "
                              f"(at most half)")
        absent = codec.decode(data[1:], n, n - nnz) if n > nnz else None
        if absent is None:
            expect_length(data, 1, what)
            return np.arange(n, dtype=np.int64)
        return complement(absent, n)
