"""The block-packed index code: its layout, its compiled loops (deepreduce.codecs.index._entropyc) against
numpy's, and the streams it refuses.

Both implementations must write the same stream for every set, decode every stream to
the same indices and refuse the same malformed ones (each with its own message).
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepreduce.codecs.index import _entropy
from deepreduce.codecs.index.blockpack import BLOCK, BlockpackIndices, bit_lengths
import extensions
from index_sets import COMPILED_SETTINGS, both_outcomes, compiled_only, random_set, round_trip, same

implementation = extensions.fixture(_entropy, "_entropyc", "implementation")
CODEC = BlockpackIndices()

EDGE_CASES = [([0], 1), ([0], 1000), ([999], 1000), (range(777), 777), (range(BLOCK), BLOCK),
              (range(0, 2 * BLOCK + 2, 2), 2 * BLOCK + 2), ([2**32 - 1], 2**32),
              ([5, 2**32 + 7, 2**33], 2**34), ([0, 2**61, 2**62 - 1], 2**62)]


def outcomes(function, *args):
    return both_outcomes(function, *args, messages=False)


def test_layout_is_widths_then_blocks_msb_first():
    # 0, 2, ..., 254: gaps 0 then 127 of 1; then 1000, a gap of 1000 - 254 - 1 = 745
    indices = np.r_[np.arange(0, 2 * BLOCK, 2), [1000]]
    data = CODEC.encode(indices, 1001)
    assert data[:2] == bytes([1, 10])  # block widths: bit lengths of 1 and of 745
    assert data[2:2 + 16] == bytes([0x7F]) + bytes([0xFF]) * 15
    assert data[18:] == bytes([745 >> 2, (745 & 3) << 6])  # 10 bits, zero padded
    assert len(data) == 2 + 16 + 2


@pytest.mark.parametrize("case", range(len(EDGE_CASES)))
def test_edge_cases_round_trip(implementation, case):
    indices, n = EDGE_CASES[case]
    round_trip(CODEC, list(indices), n)


@compiled_only
@pytest.mark.parametrize("case", range(len(EDGE_CASES)))
def test_edge_cases_give_the_same_stream(case):
    # (widths past 56 bits: the compiled encoder writes such a gap as two fields)
    indices, n = EDGE_CASES[case]
    indices = np.array(list(indices), dtype=np.int64)
    data = same(outcomes(CODEC.encode, indices, n))
    np.testing.assert_array_equal(same(outcomes(CODEC.decode, data, n, indices.size)), indices)


@compiled_only
@COMPILED_SETTINGS
@given(n=st.integers(1, 30_000), seed=st.integers(0, 2**32 - 1),
       kind=st.sampled_from(["uniform", "sparse", "runs", "blocks"]))
def test_streams_and_decodes_are_identical(n, seed, kind):
    indices = random_set(np.random.default_rng(seed), n, kind)
    data = same(outcomes(CODEC.encode, indices, n))
    np.testing.assert_array_equal(same(outcomes(CODEC.decode, data, n, indices.size)), indices)


def test_bit_lengths_match_python():
    values = np.array([0, 1, 2, 3, 255, 256, 2**32 - 1, 2**32, 2**62 - 1, 2**64 - 1], np.uint64)
    assert bit_lengths(values).tolist() == [int(v).bit_length() for v in values]


def corrupt_streams():
    indices = np.sort(np.random.default_rng(3).choice(5000, 300, replace=False))
    data = CODEC.encode(indices, 5000)
    widths = -(-indices.size // BLOCK)
    wider = bytearray(data)
    wider[0] += 1  # the first block's width, one more than its largest gap needs
    too_wide = bytearray(data)
    too_wide[0] = 14  # 5000 - 1 has 13 bits
    padded = bytearray(data)
    padded[-1] |= 1  # the last block: 44 gaps of its width leave padding bits
    return indices, {"truncated": data[:-1], "trailing": data + b"\0",
                     "no widths": data[:widths - 1], "non-canonical width": bytes(wider),
                     "width past n": bytes(too_wide), "padding": bytes(padded),
                     "past n": data, "empty": b""}


@pytest.mark.parametrize("case", sorted(corrupt_streams()[1]))
def test_malformed_streams_are_refused_by_both(case):
    indices, streams = corrupt_streams()
    n = 4000 if case == "past n" else 5000  # the same stream, decoded in a smaller universe
    outcome = both_outcomes(CODEC.decode, streams[case], n, indices.size, messages=False)
    assert same(outcome) == "DecodeError"
