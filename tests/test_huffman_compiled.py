"""The Huffman codec's C loops (deepreduce.codecs.index._entropyc) give the numpy fallback's bits exactly.

Every test that takes the ``implementation`` fixture runs once with the
compiled loops and once with them switched off (the numpy code in
codecs/index/huffman.py and codecs/index/_entropy.py); the comparisons run both in one test.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepreduce import bits as _bits
from deepreduce.codecs.index import _entropy, huffman
from deepreduce.codecs.index.huffman import HuffmanIndices
import extensions
from index_sets import (COMPILED_SETTINGS, both_outcomes, bit_flipped, compiled_only, random_set,
                        round_trip, same)

PRECISIONS = [0, 1, 2]
BLOCKS = [8, 9, 128, 4096]


implementation = extensions.fixture(_entropy, "_entropyc", "implementation")


def test_implementation_flag_matches_the_build():
    assert _entropy.IMPLEMENTATION == ("numpy" if _entropy._entropyc is None else "compiled")


# ------------------------------------------------------------------ whole codec

EDGE_CASES = [([], 1), ([0], 1), ([0], 1000), ([999], 1000), ([0, 999], 1000),
              (range(777), 777), ([2**32 - 1], 2**32), ([0, 2**32 - 1], 2**32 + 1),
              ([5, 2**32 + 7, 2**33], 2**34), ([0, 2**61, 2**62 - 1], 2**62),
              ([0] + list(range(10**9, 10**9 + 50)), 2**31)]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("case", range(len(EDGE_CASES)))
def test_edge_cases_round_trip(implementation, precision, block, case):
    indices, n = EDGE_CASES[case]
    round_trip(HuffmanIndices(precision, block), list(indices), n)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("block", BLOCKS)
@COMPILED_SETTINGS
@given(n=st.integers(1, 20_000), seed=st.integers(0, 2**32 - 1),
       kind=st.sampled_from(["uniform", "sparse", "runs", "blocks"]))
def test_streams_and_decodes_are_identical(precision, block, n, seed, kind):
    if _entropy._entropyc is None:
        pytest.skip("deepreduce.codecs.index._entropyc is not built")
    codec = HuffmanIndices(precision, block)
    indices = random_set(np.random.default_rng(seed), n, kind)
    data = same(both_outcomes(codec.encode, indices, n))
    np.testing.assert_array_equal(same(both_outcomes(codec.decode, data, n, indices.size)), indices)


@compiled_only
@pytest.mark.parametrize("precision", PRECISIONS)
@COMPILED_SETTINGS
@given(data=st.data())
def test_identical_on_huge_universes(precision, data):
    n = data.draw(st.sampled_from([2**32 - 1, 2**32, 2**32 + 1, 2**40, 2**62]))
    chosen = data.draw(st.sets(st.sampled_from([0, 1, 2**32 - 2, 2**32 - 1, 2**32, n - 1])
                               | st.integers(0, n - 1), max_size=40))
    indices = np.array(sorted(i for i in chosen if i < n), dtype=np.int64)
    codec = HuffmanIndices(precision, data.draw(st.sampled_from(BLOCKS)))
    encoded = same(both_outcomes(codec.encode, indices, n))
    np.testing.assert_array_equal(same(both_outcomes(codec.decode, encoded, n, indices.size)), indices)


@compiled_only
@pytest.mark.parametrize("precision,block", [(2, 128), (0, 8), (1, 9), (2, 4096)])
def test_every_truncation_and_extension_fails_alike(precision, block):
    rng = np.random.default_rng(7)
    codec = HuffmanIndices(precision, block)
    for n, indices in [(5000, np.sort(rng.choice(5000, 300, replace=False))),
                       (2**40, np.array([1, 2**35, 2**40 - 1]))]:
        data = codec.encode(indices, n)
        for cut in range(len(data)):
            outcome = same(both_outcomes(codec.decode, data[:cut], n, indices.size))
            assert isinstance(outcome, str) and outcome.startswith("DecodeError")
        assert isinstance(same(both_outcomes(codec.decode, data + b"\0", n, indices.size)), str)


@compiled_only
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("block", BLOCKS[:-1])  # 4096: one lane, the truncation test's
@COMPILED_SETTINGS
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(["uniform", "runs", "blocks"]))
def test_bit_flips_and_wrong_counts_fail_alike(precision, block, seed, kind):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 6000))
    indices = random_set(rng, n, kind)
    codec = HuffmanIndices(precision, block)
    data = codec.encode(indices, n)
    for nnz in {max(indices.size - 1, 0), indices.size + 1, 2 * indices.size + 3}:
        if nnz <= n:
            same(both_outcomes(codec.decode, data, n, nnz))
    if not data:
        return
    for flipped in bit_flipped(rng, data):
        same(both_outcomes(codec.decode, flipped, n, indices.size))


@compiled_only
@COMPILED_SETTINGS
@given(data=st.binary(max_size=60), n=st.integers(1, 2**40), nnz=st.integers(1, 300),
       block=st.sampled_from(BLOCKS))
def test_random_bytes_fail_alike(data, n, nnz, block):
    if nnz <= n:
        same(both_outcomes(HuffmanIndices(block=block).decode, data, n, nnz))


def test_encoded_bits_estimate_uses_the_same_buckets(implementation):
    indices = np.sort(np.random.default_rng(8).choice(2_000_000, 20_000, replace=False))
    codec = HuffmanIndices()
    actual = 8 * len(codec.encode(indices, 2_000_000))
    assert abs(codec.encoded_bits(indices) - actual) < 0.01 * actual


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("block", BLOCKS)
@COMPILED_SETTINGS
@given(n=st.integers(1, 20_000), seed=st.integers(0, 2**32 - 1), step=st.integers(1, 40),
       kind=st.sampled_from(["uniform", "sparse", "runs", "blocks"]))
def test_sampled_estimates_are_identical(precision, block, n, seed, step, kind):
    """auto's Huffman estimate: the compiled call gives numpy's bits and gap count."""
    if _entropy._entropyc is None:
        pytest.skip("deepreduce.codecs.index._entropyc is not built")
    indices = random_set(np.random.default_rng(seed), n, kind)
    if indices.size:
        same(both_outcomes(huffman.estimate_gap_bits, indices, step, precision, block))


@compiled_only
@pytest.mark.parametrize("gaps", [
    [1], [2**62], [1, 1, 1, 1], [6, 2**40, 2**62 - 2**40],
    # gaps 2**j, each as often as the j-th Fibonacci number: a Huffman code 19 bits deep,
    # flattened to 15
    np.repeat(2 ** np.arange(20), [1, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610,
                                   987, 1597, 2584, 4181, 6765])])
def test_estimates_of_edge_sets_are_identical(gaps):
    indices = np.cumsum(np.asarray(gaps, np.int64)) - 1
    for precision in PRECISIONS:
        for step in (1, 3):
            for block in (8, 2**40):
                same(both_outcomes(huffman.estimate_gap_bits, indices, step, precision, block))


def test_sampled_estimate_is_the_estimate_of_the_sample(implementation):
    indices = np.sort(np.random.default_rng(11).choice(10**6, 30_000, replace=False))
    sample = np.diff(indices, prepend=-1)[::7]
    assert huffman.estimate_gap_bits(indices, 7, 2, 128) == (
        huffman.estimate_bits(sample, 2, 128), sample.size)


# ------------------------------------------------------------------ the one-call codec

def fibonacci_gaps(rng, symbols: int, precision: int) -> np.ndarray:
    """Gaps whose bucket symbols are counted like Fibonacci numbers (1, 1, 2, 3, 5, ...),
    shuffled: a Huffman tree ``symbols - 1`` deep, which the codec flattens to 15."""
    counts = [1, 1]
    while len(counts) < symbols:
        counts.append(counts[-1] + counts[-2])
    # one value per bucket: 1, then powers of two times a mantissa the precision keeps
    mantissa = int(rng.integers(0, 1 << precision))
    values = [1] + [((1 << precision) + mantissa) << j for j in range(1, symbols)]
    gaps = np.repeat(np.array(values, np.int64), counts)
    return rng.permutation(gaps)


def one_call_sets(rng, kind: str):
    """``(indices, n)`` of the shapes the one-call encoder must code as numpy does."""
    if kind == "empty":
        return np.zeros(0, np.int64), int(rng.integers(1, 2**62))
    if kind == "one":
        n = int(rng.choice([1, 2, 1000, 2**32, 2**62]))
        return np.array([int(rng.choice([0, n - 1, int(rng.integers(0, n))]))]), n
    if kind == "ends":  # index 0 and n - 1, a few between
        n = int(rng.integers(2, 2**62))
        middle = rng.integers(1, n - 1, size=int(rng.integers(0, 30))) if n > 2 else []
        return np.unique(np.concatenate([[0, n - 1], middle]).astype(np.int64)), n
    if kind == "dense":
        n = int(rng.integers(1, 20_000))
        return np.flatnonzero(rng.random(n) < rng.choice([0.5, 0.9, 1.0])), n
    if kind == "runs":
        return random_set(rng, int(rng.integers(1, 20_000)), "runs"), 20_000
    if kind == "huge":  # gaps near 2**62
        n = 2**62
        chosen = {0, 1, 2**61, 2**62 - 2, 2**62 - 1}
        chosen |= set(rng.integers(0, n, size=int(rng.integers(0, 40))).tolist())
        keep = rng.random(len(chosen)) < 0.6
        return np.array(sorted(c for c, k in zip(sorted(chosen), keep) if k), np.int64), n
    if kind == "skewed":  # deep codes, flattened
        precision = int(rng.integers(0, 3))
        gaps = fibonacci_gaps(rng, int(rng.integers(17, 24)), precision)
        indices = np.cumsum(gaps) - 1
        return indices, int(indices[-1]) + 1 + int(rng.integers(0, 1000))
    n = int(rng.integers(1, 200_000))
    return random_set(rng, n, str(rng.choice(["uniform", "sparse", "blocks"]))), n


ONE_CALL_KINDS = ["empty", "one", "ends", "dense", "runs", "huge", "skewed", "random"]


@compiled_only
@pytest.mark.parametrize("precision", PRECISIONS)
@COMPILED_SETTINGS
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(ONE_CALL_KINDS),
       block=st.integers(8, 4096) | st.sampled_from([8, 9, 127, 128, 129, 4095, 4096]))
def test_one_call_encode_gives_the_numpy_bytes(precision, seed, kind, block):
    """_entropyc.huffman_encode (the whole encoder in C) writes numpy's stream bit for
    bit, and _entropyc.huffman_decode reads it back as numpy does."""
    indices, n = one_call_sets(np.random.default_rng(seed), kind)
    codec = HuffmanIndices(precision, block)
    data = same(both_outcomes(codec.encode, indices, n))
    assert isinstance(data, bytes)
    decoded = same(both_outcomes(codec.decode, data, n, indices.size))
    np.testing.assert_array_equal(decoded, indices)


@compiled_only
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("symbols", [17, 20, 25])
def test_skewed_sets_are_flattened_alike(precision, symbols):
    """Fibonacci-like histograms: codes deeper than 15 bits, flattened by halving."""
    gaps = fibonacci_gaps(np.random.default_rng(symbols), symbols, precision)
    _, counts = _entropy.bucket_histogram(gaps, precision)
    used = counts[counts > 0]
    assert max(_entropy._huffman_depths(used.tolist())) > _entropy.MAX_CODE_LENGTH
    assert _entropy.huffman_lengths(counts).max() <= _entropy.MAX_CODE_LENGTH
    indices = np.cumsum(gaps) - 1
    n = int(indices[-1]) + 1
    for block in (8, 128, 4096):
        codec = HuffmanIndices(precision, block)
        data = same(both_outcomes(codec.encode, indices, n))
        np.testing.assert_array_equal(same(both_outcomes(codec.decode, data, n, indices.size)),
                                      indices)


@compiled_only
@pytest.mark.parametrize("indices", [[5, 3], [1, 1], [0, 7, 7, 9], [3, 9, 2, 10]])
def test_one_call_encode_refuses_unordered_sets_alike(indices):
    def outcome():
        try:
            return HuffmanIndices().encode(np.array(indices), 100)
        except ValueError as error:
            return str(error)
    assert same(extensions.both(_entropy, "_entropyc", outcome)).startswith("indices must be")


def table_bytes(codec, data, nnz):
    """The length of the code-length and block-length tables at the head of a stream."""
    lengths, offset = _entropy.unpack_code_lengths(data, 0, _entropy.bucket_count(
        codec.precision), "t")
    blocks = -(-nnz // codec.block)
    return huffman._unpack_block_lengths(data, offset, blocks,
                                         codec.block * _entropy.MAX_CODE_LENGTH, "t")[1]


@compiled_only
@pytest.mark.parametrize("precision,block", [(2, 8), (0, 9), (1, 128)])
def test_every_value_of_every_table_byte_fails_alike(precision, block):
    """Each byte of the tables (and the first of the codes) set to each of its 256 values:
    the same indices or the same DecodeError, message included."""
    rng = np.random.default_rng(precision)
    n = 5000
    indices = np.sort(rng.choice(n, 300, replace=False))
    codec = HuffmanIndices(precision, block)
    data = codec.encode(indices, n)
    for at in range(min(table_bytes(codec, data, indices.size) + 1, len(data))):
        for value in range(256):
            changed = data[:at] + bytes([value]) + data[at + 1:]
            same(both_outcomes(codec.decode, changed, n, indices.size))


@compiled_only
@pytest.mark.parametrize("varint", [b"\x80\x00", b"\x81\x80\x00", b"\xff" * 9 + b"\x02",
                                    b"\xff" * 9 + b"\x01", b"\xff" * 10 + b"\x01", b"\x80" * 12,
                                    b"\xff", b"", b"\x00", b"\x7f", b"\x80\x01"])
def test_block_table_varints_fail_alike(varint):
    """The block-length minimum: not shortest, overflowing, too long, truncated, too big."""
    indices = np.arange(0, 3000, 7)
    codec = HuffmanIndices(2, 8)
    data = codec.encode(indices, 3000)
    table = 2 + -(-4 * (data[1] + 1) // 8)
    _, after = _bits.read_varint(data, table)
    for rest in (data[after:], data[after:after + 1], b""):
        outcome = same(both_outcomes(codec.decode, data[:table] + varint + rest, 3000,
                                     indices.size))
        assert isinstance(outcome, (str, np.ndarray))


@compiled_only
@pytest.mark.parametrize("nnz", [1, 5, 130])
def test_gaps_past_n_fail_alike(nnz):
    """Gaps adding up past n, and past 2**64: the exact sum comes back, numpy's error is raised."""
    codec = HuffmanIndices(2, 128)
    n = 2**62
    indices = np.array([2**62 - nnz + i for i in range(nnz)], np.int64)
    data = codec.encode(indices, n)
    for smaller in (2**62 - 1, 2**62 - nnz, nnz):
        assert same(both_outcomes(codec.decode, data, smaller, nnz)).startswith("DecodeError")
    # nnz gaps of 2**63 - 1 each, past 2**64 from 3 on: the largest bucket (247) with all
    # 60 offset bits set, its code a single 1-bit code; block lengths of nnz bits
    lengths = np.zeros(_entropy.bucket_count(2), np.int64)
    lengths[247] = 1
    blocks = -(-nnz // 128)
    table = bytes([128, 1, 0]) if blocks > 1 else b""  # minimum 128 (a varint), width 0
    stream = (_entropy.pack_code_lengths(lengths) + table + bytes(-(-nnz // 8))
              + _bits.pack_fixed(np.full(nnz, 2**60 - 1, np.uint64), 60))
    out = np.empty(nnz, np.int64)
    assert _entropy._entropyc.huffman_decode(stream, n, 2, 128, out) == nnz * (2**63 - 1)
    assert same(both_outcomes(codec.decode, stream, n, nnz)).startswith("DecodeError")


@compiled_only
def test_one_call_codec_is_thread_safe():
    """Other threads encode and decode other payloads while the loops run without the GIL."""
    from concurrent.futures import ThreadPoolExecutor
    rng = np.random.default_rng(5)
    sets = [(np.sort(rng.choice(n, n // 50, replace=False)), n)
            for n in rng.integers(1 << 18, 1 << 21, 12)]
    codec = HuffmanIndices()
    expected = [codec.encode(indices, n) for indices, n in sets]

    def round_trip(item):
        (indices, n), data = item
        encoded = codec.encode(indices, n)
        return encoded == data and np.array_equal(codec.decode(encoded, n, indices.size),
                                                  indices)

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(round_trip, list(zip(sets, expected)) * 3))


# ------------------------------------------------------------------ building blocks

@compiled_only
@pytest.mark.parametrize("precision", PRECISIONS)
def test_bucket_symbols_are_identical(precision):
    rng = np.random.default_rng(9)
    values = np.concatenate([np.arange(1, 5000), 2 ** np.arange(1, 63) - 1, 2 ** np.arange(63),
                             2 ** np.arange(1, 62) + 1,
                             rng.integers(1, 2**63 - 1, 2000, dtype=np.int64)]).astype(np.int64)
    compiled, numpy = both_outcomes(_entropy.bucket_symbols, values, precision)
    for ours, theirs in zip(compiled, numpy):
        np.testing.assert_array_equal(ours, theirs)
        assert ours.dtype == theirs.dtype == np.uint8


@compiled_only
@pytest.mark.parametrize("precision", PRECISIONS)
def test_bucket_histograms_are_identical(precision):
    values = np.random.default_rng(10).geometric(0.001, 5000).astype(np.int64)
    compiled, numpy = both_outcomes(_entropy.bucket_histogram, values, precision)
    for ours, theirs in zip(compiled, numpy):
        np.testing.assert_array_equal(ours, theirs)
        assert ours.dtype == theirs.dtype


@compiled_only
@COMPILED_SETTINGS
@given(counts=st.lists(st.integers(0, 10**6) | st.sampled_from([0, 1, 2, 2**40]),
                       min_size=1, max_size=248))
def test_huffman_lengths_are_identical(counts):
    """Ties merge in the same order; deep codes are flattened the same way."""
    counts = np.array(counts, dtype=np.int64)
    same(both_outcomes(lambda c: _entropy.huffman_lengths(c).tolist(), counts))


def test_huffman_lengths_of_huge_counts(implementation):
    lengths = _entropy.huffman_lengths(np.array([2**62, 2**62, 2**61, 1]))
    assert lengths.tolist() == [2, 1, 3, 3]  # 1 and 2**61 merge first


# ------------------------------------------------------------------ the C entry points

def symbol_arguments(**changes):
    """Valid arguments of _entropyc.bucket_symbols (3 values), with ``changes``."""
    arguments = dict(values=np.array([1, 2, 3]), precision=2, symbols=np.empty(3, np.uint8),
                     offset_bits=np.empty(3, np.uint8), counts=np.empty(256, np.int64))
    arguments.update(changes)
    return arguments


def depth_arguments(**changes):
    """Valid arguments of _entropyc.huffman_depths, with ``changes``."""
    arguments = dict(weights=np.array([5, 1, 1, 3]), depths=np.empty(4, np.int64))
    arguments.update(changes)
    return arguments


def estimate_arguments(**changes):
    """Valid arguments of _entropyc.huffman_estimate (gaps 1, 8, 91), with ``changes``."""
    arguments = dict(indices=np.array([0, 8, 99]), step=1, precision=2, block=128)
    arguments.update(changes)
    return arguments


def encode_arguments(**changes):
    """Valid arguments of _entropyc.huffman_encode (3 indices), with ``changes``."""
    arguments = dict(indices=np.array([0, 8, 99]), precision=2, block=8)
    arguments.update(changes)
    return arguments


def decode_arguments(**changes):
    """Valid arguments of _entropyc.huffman_decode (the stream of 3 indices), with ``changes``."""
    arguments = dict(data=HuffmanIndices(2, 8).encode(np.array([0, 8, 99]), 100), n=100,
                     precision=2, block=8, out=np.empty(3, np.int64))
    arguments.update(changes)
    return arguments


#: Every entry point of the Huffman codec and its buckets (golomb_*, run_fields and
#: golomb_bits have theirs in test_golomb_compiled.py, blockpack_* in test_blockpack.py).
ARGUMENTS = {"huffman_encode": encode_arguments, "huffman_decode": decode_arguments,
             "huffman_estimate": estimate_arguments, "huffman_depths": depth_arguments,
             "bucket_symbols": symbol_arguments}


def call(name, changes):
    return getattr(_entropy._entropyc, name)(*ARGUMENTS[name](**changes).values())


@compiled_only
def test_every_huffman_entry_point_has_its_arguments():
    """No entry point of the Huffman codec escapes the argument tests below."""
    compiled = {name for name in dir(_entropy._entropyc)
                if name.startswith(("huffman_", "bucket_"))}
    assert compiled == set(ARGUMENTS)


def wrong_type(value):
    """An argument of the wrong type in place of ``value``: a string for a number; for a
    buffer, one of float32 items, which no entry point takes."""
    if isinstance(value, (int, np.integer)):
        return "1"
    return np.zeros(3, np.float32)


@compiled_only
@pytest.mark.parametrize("name,argument", [(name, argument) for name, arguments
                                           in ARGUMENTS.items() for argument in arguments()])
def test_every_argument_is_checked(name, argument):
    """Each argument of each entry point, of the wrong type: TypeError, never a crash."""
    with pytest.raises(TypeError):
        call(name, {argument: wrong_type(ARGUMENTS[name]()[argument])})


@compiled_only
def test_entry_points_accept_their_valid_arguments():
    arguments = symbol_arguments(values=np.array([1, 2**62, 2**62]))
    _entropy._entropyc.bucket_symbols(*arguments.values())
    assert arguments["symbols"].tolist() == [1, 244, 244]  # 244 = 0b100 + (60 << 2)
    assert arguments["offset_bits"].tolist() == [0, 60, 60]
    assert arguments["counts"][[1, 244]].tolist() == [1, 2] and arguments["counts"].sum() == 3
    assert call("bucket_symbols", {"offset_bits": None, "counts": None}) is None

    arguments = depth_arguments()
    _entropy._entropyc.huffman_depths(*arguments.values())
    assert arguments["depths"].tolist() == [1, 3, 3, 2]

    bits, gaps = call("huffman_estimate", {})
    assert gaps == 3 and bits == huffman.estimate_bits(np.array([1, 8, 91]), 2, 128)

    data = call("huffman_encode", {})
    assert data == decode_arguments()["data"]
    arguments = decode_arguments()
    assert _entropy._entropyc.huffman_decode(*arguments.values()) is None
    assert arguments["out"].tolist() == [0, 8, 99]
    # a malformed stream: what is wrong, as the numpy path words it
    assert call("huffman_decode", {"data": data[:-1]}).startswith("stream holds")
    assert call("huffman_decode", {"n": 99}) == 100  # the gaps' sum, past n


@compiled_only
@pytest.mark.parametrize("name,changes", [
    ("huffman_depths", {"weights": np.array([5.0, 1, 1, 3])}),
    ("huffman_depths", {"depths": np.empty(4, np.int32)}),
    ("bucket_symbols", {"counts": np.empty(256, np.int32)}),
    ("bucket_symbols", {"symbols": np.empty(3, np.int64)}),
    ("bucket_symbols", {"symbols": b"\0\0\0"}),  # read-only
    ("bucket_symbols", {"values": np.array([[1, 2, 3]])}),
    ("bucket_symbols", {"counts": np.empty(512, np.int64)[::2]}),
    ("huffman_estimate", {"indices": np.array([0, 8, 99])[::-1]}),
    ("huffman_estimate", {"indices": np.array([0.0, 8.0])}),
    ("huffman_encode", {"indices": np.array([0.0, 8.0, 99.0])}),
    ("huffman_encode", {"indices": np.array([0, 8, 99], np.int32)}),
    ("huffman_encode", {"indices": np.array([[0, 8, 99]])}),
    ("huffman_decode", {"out": np.empty(3, np.uint64)}),
    ("huffman_decode", {"out": np.empty(6, np.int64)[::2]}),
    ("huffman_decode", {"data": 7}),
    ("huffman_decode", {"data": np.zeros(4, np.uint16)}),
    ("huffman_decode", {"data": np.zeros((2, 2), np.uint8)}),
    ("huffman_decode", {"out": np.empty((3, 1), np.int64)}),
    ("huffman_decode", {"n": 100.0}),
])
def test_bad_buffers_raise_type_error(name, changes):
    with pytest.raises(TypeError):
        call(name, changes)


@compiled_only
@pytest.mark.parametrize("name,changes", [
    ("huffman_depths", {"weights": np.array([5, -1, 1, 3])}),
    ("huffman_depths", {"weights": np.array([2**62, 2**62])}),
    ("huffman_depths", {"weights": np.zeros(0, np.int64), "depths": np.empty(0, np.int64)}),
    ("huffman_depths", {"depths": np.empty(3, np.int64)}),
    ("huffman_depths", {"weights": np.ones(257, np.int64), "depths": np.empty(257, np.int64)}),
    ("huffman_estimate", {"indices": np.array([0, 8, 8])}),
    ("huffman_estimate", {"indices": np.array([-1, 8, 99])}),
    ("huffman_estimate", {"indices": np.array([0, 99, 8]), "step": 2}),
    ("huffman_estimate", {"indices": np.zeros(0, np.int64)}),
    ("huffman_estimate", {"step": 0}),
    ("huffman_estimate", {"precision": 3}),
    ("huffman_estimate", {"precision": -1}),
    ("huffman_estimate", {"step": -5}),
    ("huffman_estimate", {"block": 0}),
    ("bucket_symbols", {"values": np.array([1, 0, 3])}),
    ("bucket_symbols", {"values": np.array([1, -5, 3])}),
    ("bucket_symbols", {"precision": 3}),
    ("bucket_symbols", {"offset_bits": np.empty(2, np.uint8)}),
    ("bucket_symbols", {"symbols": np.empty(4, np.uint8)}),
    ("bucket_symbols", {"counts": np.empty(255, np.int64)}),
    ("huffman_encode", {"indices": np.zeros(0, np.int64)}),
    ("huffman_encode", {"indices": np.array([0, 8, 8])}),
    ("huffman_encode", {"indices": np.array([-1, 8, 99])}),
    ("huffman_encode", {"indices": np.array([0, 99, 8])}),
    ("huffman_encode", {"indices": np.array([2**63 - 1])}),  # a first gap of 2**63
    ("huffman_encode", {"precision": 3}),
    ("huffman_encode", {"precision": -1}),
    ("huffman_encode", {"block": 0}),
    ("huffman_encode", {"block": 2**24 + 1}),
    ("huffman_decode", {"out": np.empty(0, np.int64)}),
    ("huffman_decode", {"precision": 3}),
    ("huffman_decode", {"block": 0}),
    ("huffman_decode", {"n": 2**62 + 1}),
    ("huffman_decode", {"n": 2**64 - 1}),
    ("huffman_decode", {"precision": -1}),
    ("huffman_decode", {"block": 2**24 + 1}),
])
def test_bad_arguments_raise_value_error(name, changes):
    with pytest.raises(ValueError):
        call(name, changes)
