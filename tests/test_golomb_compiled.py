"""The Golomb codec's C loops (deepreduce.codecs.index._entropyc) and the varints' (deepreduce._varint)
give numpy's bits exactly.

Both implementations must give the same stream for every set and parameter,
decode every stream to the same indices, and refuse the same corrupt
streams (each with its own message).
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepreduce import bits as _bits
from deepreduce.codecs.index import _entropy, golomb, runs
from deepreduce.codecs.index.golomb import GolombIndices
import extensions
from index_sets import (COMPILED_SETTINGS, both_outcomes, bit_flipped, compiled_only, random_set,
                        round_trip, same)

MODES = list(golomb.MODES)
implementation = extensions.fixture(_entropy, "_entropyc", "implementation")


def golomb_outcomes(function, *args):
    """:func:`both_outcomes` without the messages, which the C loops word differently."""
    return both_outcomes(function, *args, messages=False)


EDGE_CASES = [([0], 1), ([0], 1000), ([999], 1000), ([0, 999], 1000), (range(777), 777),
              (range(5, 21), 21), ([2**32 - 1], 2**32), ([5, 2**32 + 7, 2**33], 2**34),
              ([0, 2**57, 2**58 - 1], 2**58), ([3, 2**58 + 1], 2**60)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", range(len(EDGE_CASES)))
def test_edge_cases_round_trip(implementation, mode, case):
    indices, n = EDGE_CASES[case]
    round_trip(GolombIndices(mode), list(indices), n)


@compiled_only
@pytest.mark.parametrize("mode", MODES)
@COMPILED_SETTINGS
@given(n=st.integers(1, 30_000), seed=st.integers(0, 2**32 - 1),
       kind=st.sampled_from(["uniform", "sparse", "runs", "blocks"]))
def test_streams_and_decodes_are_identical(mode, n, seed, kind):
    codec = GolombIndices(mode)
    indices = random_set(np.random.default_rng(seed), n, kind)
    data = same(golomb_outcomes(codec.encode, indices, n))
    np.testing.assert_array_equal(same(golomb_outcomes(codec.decode, data, n, indices.size)), indices)


@compiled_only
@COMPILED_SETTINGS
@given(m=st.integers(1, 5000), data=st.data())
def test_every_parameter_gives_the_same_stream(m, data):
    """Parameters auto would never pick: long quotients, every remainder layout."""
    n = data.draw(st.integers(1, 200_000))
    chosen = data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=90))
    indices = np.array(sorted(chosen), dtype=np.int64)
    prefix = b"\x07"
    compiled, adjacent = _entropy._entropyc.golomb_encode(indices, m, prefix)
    assert compiled == prefix + golomb.encode_fields(golomb.index_gaps(indices), m)
    assert adjacent == int(np.count_nonzero(golomb.index_gaps(indices) == 0))
    if m <= n:
        out = np.empty(indices.size, dtype=np.int64)
        assert _entropy._entropyc.golomb_decode(compiled[1:], m, n, out) is None
        np.testing.assert_array_equal(out, indices)


@compiled_only
@pytest.mark.parametrize("mode", MODES)
def test_every_truncation_and_extension_fails_alike(mode):
    rng = np.random.default_rng(7)
    codec = GolombIndices(mode)
    for n, indices in [(5000, np.sort(rng.choice(5000, 300, replace=False))),
                       (2**40, np.array([1, 2**35, 2**40 - 1]))]:
        data = codec.encode(indices, n)
        for cut in range(len(data)):
            assert same(golomb_outcomes(codec.decode, data[:cut], n, indices.size)) == "DecodeError"
        for extra in (b"\0", b"\x80", b"\0" * 9):
            assert same(golomb_outcomes(codec.decode, data + extra, n, indices.size)) == "DecodeError"


@compiled_only
@pytest.mark.parametrize("mode", MODES)
@COMPILED_SETTINGS
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(["uniform", "sparse", "runs"]))
def test_bit_flips_and_wrong_counts_fail_alike(mode, seed, kind):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 6000))
    indices = random_set(rng, n, kind)
    codec = GolombIndices(mode)
    data = codec.encode(indices, n)
    for nnz in {max(indices.size - 1, 1), indices.size + 1, 2 * indices.size + 3}:
        if nnz <= n:
            same(golomb_outcomes(codec.decode, data, n, nnz))
    for smaller_n in {max(n // 2, 1), max(int(indices[-1]), 1) if indices.size else 1}:
        if indices.size <= smaller_n:
            same(golomb_outcomes(codec.decode, data, smaller_n, indices.size))
    if not data:
        return
    for flipped in bit_flipped(rng, data):
        same(golomb_outcomes(codec.decode, flipped, n, indices.size))


@compiled_only
@COMPILED_SETTINGS
@given(data=st.binary(max_size=80), n=st.integers(1, 2**40), nnz=st.integers(1, 300))
def test_random_streams_fail_alike(data, n, nnz):
    if nnz <= n:
        same(golomb_outcomes(GolombIndices().decode, data, n, nnz))


@compiled_only
def test_bad_arguments_raise_instead_of_writing_out_of_bounds():
    compiled = _entropy._entropyc
    with pytest.raises(ValueError, match="strictly increasing"):
        compiled.golomb_encode(np.array([5, 3], dtype=np.int64), 4, b"")
    # unordered sets of every shape: refused before anything is written out of bounds
    for unordered in ([-1, 3], [1, 0], [-5, -3], [3, 3],
                      list(range(0, 8000, 1000)) + [5] * 9,
                      list(range(0, 2**40, 2**37)) + [10, 11]):
        for m in (1, 3, 64):
            with pytest.raises(ValueError, match="strictly increasing"):
                compiled.golomb_encode(np.array(unordered, dtype=np.int64), m, b"")
    with pytest.raises(ValueError):
        compiled.golomb_encode(np.array([1], dtype=np.int64), 0, b"")
    with pytest.raises(ValueError):
        compiled.golomb_encode(np.zeros(0, dtype=np.int64), 4, b"")
    with pytest.raises(TypeError):
        compiled.golomb_encode(np.array([1, 2], dtype=np.int32), 4, b"")
    out = np.empty(2, dtype=np.int64)
    with pytest.raises(ValueError):
        compiled.golomb_decode(b"\xff" * 4, 0, 100, out)
    with pytest.raises(ValueError):
        compiled.golomb_decode(b"\xff" * 4, 200, 100, out)
    with pytest.raises(ValueError):
        compiled.golomb_decode(b"", 4, 100, out)


@pytest.mark.skipif(_bits._varint is None, reason="deepreduce._varint is not built")
@COMPILED_SETTINGS
@given(values=st.lists(st.integers(0, 2**64 - 1), max_size=200),
       small=st.lists(st.integers(0, 300), max_size=50))
def test_varints_are_identical(values, small):
    for chosen in (values, small, values + small):
        array = np.array(chosen, dtype=np.uint64)
        compiled, numpy = extensions.both(_bits, "_varint", _bits.varint_encode, array)
        assert compiled == numpy
        decoded, end = _bits.varint_decode_prefix(compiled, array.size, "test")
        np.testing.assert_array_equal(decoded, array)
        assert end == len(compiled)


@pytest.mark.skipif(_bits._varint is None, reason="deepreduce._varint is not built")
def test_compiled_varints_take_only_uint64_vectors():
    encode = _bits._varint.varint_encode
    assert encode(np.zeros(0, np.uint64)) == b""
    assert encode(np.array([1, 300, 2**64 - 1], np.uint64)) == \
        b"\x01\xac\x02" + b"\xff" * 9 + b"\x01"
    for wrong in (np.zeros(3, np.int64), np.zeros(3, np.uint32), np.zeros((2, 2), np.uint64),
                  np.zeros(6, np.uint64)[::2], "text"):
        with pytest.raises(TypeError, match="uint64"):
            encode(wrong)


@compiled_only
@COMPILED_SETTINGS
@given(n=st.integers(1, 30_000), seed=st.integers(0, 2**32 - 1), offset=st.sampled_from([0, 2**40]),
       kind=st.sampled_from(["uniform", "sparse", "runs", "blocks"]))
def test_run_fields_and_their_sizes_are_numpy_s(n, seed, offset, kind):
    """auto sizes the runs code of every clustered set: the compiled pass gives the same
    unit, fields and Golomb sizes as numpy's, and so the same stream size."""
    indices = random_set(np.random.default_rng(seed), n, kind) + offset
    if indices.size == 0:
        return
    (unit, zeros, extra), (numpy_unit, numpy_zeros, numpy_extra) = extensions.both(
        _entropy, "_entropyc", runs.fields, indices)
    assert unit == numpy_unit
    for got, expected in ((zeros, numpy_zeros), (extra, numpy_extra)):
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, expected)
        for m in {1, 2, 3, golomb.choose_parameter(float(expected.mean())), 1000}:
            same(extensions.both(_entropy, "_entropyc", golomb.field_bits, expected, m))
    same(extensions.both(_entropy, "_entropyc", runs.stream_size, indices))


@compiled_only
def test_run_fields_and_golomb_bits_refuse_what_they_cannot_take():
    compiled = _entropy._entropyc
    room = np.empty(3, np.int64)
    for indices in ([], [2, 1], [1, 1], [-1, 0]):
        with pytest.raises(ValueError, match="strictly increasing"):
            compiled.run_fields(np.array(indices, np.int64), room, room.copy())
    with pytest.raises(ValueError, match="room"):
        compiled.run_fields(np.arange(4, dtype=np.int64), room, room.copy())
    assert compiled.golomb_bits(np.array([5, -1], np.int64), 4) is None
    assert compiled.golomb_bits(np.full(4, 2**62, np.int64), 1) is None  # past 2**64
    with pytest.raises(ValueError, match="m >= 1"):
        compiled.golomb_bits(np.ones(2, np.int64), 0)
