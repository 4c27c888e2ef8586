"""The fp16 codec's casts: the compiled ones (deepreduce.codecs.values._halfcast, F16C) and numpy's
give the same bytes.

The stream, the values the sender expects to arrive and the decoded values must be
identical byte for byte, saturation, signalling and quiet NaN payloads, signed zeros
and subnormals included, whatever the thread's flush-to-zero setting.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepreduce.codecs.values import floats  # (patched: the module that holds _halfcast)
import extensions

compiled_only = pytest.mark.skipif(floats._halfcast is None,
                                   reason="deepreduce.codecs.values._halfcast is not built (or no F16C)")
CODEC = floats.Float16Values()

#: float32 bit patterns where casting to float16 changes behaviour: zeros, float16's
#: subnormal, normal and rounding boundaries (ties included), the saturation limits,
#: the infinities, signalling and quiet NaNs with and without surviving payload bits.
EDGES = np.array([
    0x00000000, 0x80000000, 0x00000001, 0x33000000, 0x33000001, 0x337fffff, 0x33800000,
    0x38800000, 0x387fe000, 0x387ff000, 0x3f801000, 0x3f803000, 0x3f800fff, 0x477fe000,
    0x477fefff, 0x477ff000, 0x477fffff, 0x47800000, 0x7f7fffff, 0x7f800000, 0xff800000,
    0x7f800001, 0x7f801fff, 0x7f802000, 0x7fbfffff, 0x7fc00000, 0x7fc00001, 0x7fffffff,
    0xff800001, 0xffc00000, 0xffffe000, 0xc77ff000, 0xc7800000, 0xff7fffff,
], dtype=np.uint32)


def both_ways(function, *args):
    """``[function(*args)`` compiled, ``function(*args)`` with numpy's casts``]``."""
    return extensions.both(floats, "_halfcast", function, *args)


def encoded(values):
    data, received = CODEC.encode_and_receive(values)
    return data, received.dtype, received.tobytes(), CODEC.encode(values)


def test_implementation_flag_matches_the_build():
    assert floats.HALF_IMPLEMENTATION == ("numpy" if floats._halfcast is None else "compiled")


@compiled_only
def test_every_float16_decodes_to_the_same_bits():
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).tobytes()
    for dtype in (np.float32, np.float64):
        compiled, numpy = both_ways(CODEC.decode, halves, 1 << 16, dtype)
        assert compiled.dtype == numpy.dtype == dtype
        assert compiled.tobytes() == numpy.tobytes()


@compiled_only
def test_float32_patterns_across_the_whole_range_encode_to_the_same_bytes():
    # every 251st bit pattern (a prime stride: every exponent, many significands),
    # then the edges alone and at every offset of a vector and its tail
    sample = np.arange(0, 1 << 32, 251, dtype=np.uint64).astype(np.uint32)
    compiled, numpy = both_ways(encoded, sample.view(np.float32))
    assert compiled == numpy
    for start in range(9):
        for length in range(0, 26):
            values = np.roll(EDGES, start)[:length].view(np.float32)
            compiled, numpy = both_ways(encoded, values)
            assert compiled == numpy, (start, length)


@compiled_only
@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=70), st.sampled_from([1.0, 1e-5, 3e4, 1e5]))
def test_random_values_encode_and_arrive_the_same(patterns, scale):
    bits = np.array(patterns, dtype=np.uint32)
    with np.errstate(over="ignore"):
        scaled = bits.view(np.float32) * np.float32(scale)
    for values in (bits.view(np.float32), scaled):
        compiled, numpy = both_ways(encoded, values)
        assert compiled == numpy


@compiled_only
def test_flush_to_zero_in_the_calling_thread_changes_nothing():
    # TensorFlow's threads run with flush-to-zero and denormals-are-zero set; the casts
    # must still produce and read float16 subnormals. torch sets both bits for us.
    torch = pytest.importorskip("torch")
    values = np.concatenate([EDGES.view(np.float32),
                             np.float32([1e-5, -6e-8, 3e-8, 6.1e-5, 1e-40])])
    expected = both_ways(encoded, values)[1]
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).tobytes()
    expected_decoded = both_ways(CODEC.decode, halves, 1 << 16, np.float32)[1].tobytes()
    if not torch.set_flush_denormal(True):
        pytest.skip("this processor cannot flush denormals")
    try:
        assert np.float32(1e-40) * np.float32(1) == 0  # the setting took effect
        assert encoded(values) == expected
        assert CODEC.decode(halves, 1 << 16, np.float32).tobytes() == expected_decoded
    finally:
        torch.set_flush_denormal(False)


@compiled_only
def test_casts_check_their_arguments():
    half = np.zeros(4, np.uint16)
    single = np.zeros(4, np.float32)
    for args in [(np.zeros(4, np.float64), half), (single, np.zeros(3, np.uint16)),
                 (single, single), (single, half[::2].copy()[:1]),
                 (np.zeros((2, 2), np.float32), half)]:
        with pytest.raises(TypeError):
            floats._halfcast.to_half(*args)
    with pytest.raises(ValueError, match="read-only"):
        floats._halfcast.to_half(single, np.frombuffer(bytes(8), np.uint16))
    for args in [(half, np.zeros(4, np.float64)), (np.zeros(4, np.float32), single),
                 (half, np.zeros(5, np.float32))]:
        with pytest.raises(TypeError):
            floats._halfcast.to_single(*args)
