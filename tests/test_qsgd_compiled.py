"""QSGD's loops: the compiled ones (deepreduce.codecs.values._qsgd) and numpy's give the same bits.

Both draw the dither of :func:`deepreduce.codecs.values.qsgd.dither`, so a payload, the values the
sender expects to arrive and the decoded values must be identical byte for byte,
NaN payloads and signed zeros included.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepreduce.bits import pack_fixed
from deepreduce.codecs.values import qsgd
from deepreduce.codecs.values.dtypes import SUPPORTED_DTYPES
from deepreduce.errors import DecodeError
import extensions

#: A negative NaN with a payload that survives narrowing to float32 and float16.
PAYLOAD_NAN = np.uint64(0xFFF9_2345_0000_0000).view(np.float64)

compiled_only = pytest.mark.skipif(qsgd._qsgd is None, reason="deepreduce.codecs.values._qsgd is not built")
implementation = extensions.fixture(qsgd, "_qsgd", "implementation")


def round_trip(codec_settings, values):
    """(payload, received, decoded) of one encode_and_receive and decode."""
    codec = qsgd.QSGDValues(**codec_settings)
    data, received = codec.encode_and_receive(values)
    decoded = codec.decode(data, values.size, values.dtype)
    return data, received, decoded


def as_bits(array):
    return array.dtype, array.tobytes()


def test_implementation_flag_matches_the_build():
    assert qsgd.IMPLEMENTATION == ("numpy" if qsgd._qsgd is None else "compiled")


@compiled_only
@settings(max_examples=200, deadline=None)
@given(dtype=st.sampled_from(SUPPORTED_DTYPES), size=st.integers(0, 2000),
       bits=st.integers(qsgd.MIN_BITS, qsgd.MAX_BITS), bucket=st.sampled_from([1, 3, 64, 512]),
       norm=st.sampled_from(qsgd.NORMS), seed=st.integers(0, 2**32 - 1),
       scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e4, 1e30]),
       special=st.sampled_from([None, np.nan, PAYLOAD_NAN, np.inf, -np.inf, 0.0, -0.0]))
def test_compiled_and_numpy_give_the_same_bits(dtype, size, bits, bucket, norm, seed, scale,
                                                special):
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore"):
        values = (rng.standard_normal(size) * scale).astype(dtype)
    if special is not None and size:
        values[rng.integers(0, size, 1 + size // 50)] = special
    codec_settings = dict(bits=bits, bucket=bucket, norm=norm, seed=seed)
    compiled, numpy = extensions.both(qsgd, "_qsgd", round_trip, codec_settings, values)
    assert compiled[0] == numpy[0]
    for compiled_array, numpy_array in zip(compiled[1:], numpy[1:]):
        assert as_bits(compiled_array) == as_bits(numpy_array)
    assert as_bits(compiled[1]) == as_bits(compiled[2])  # the sender knows what arrives


def decode_or_error(codec, data, size, dtype):
    try:
        return codec.decode(data, size, dtype)
    except DecodeError as error:
        return str(error)


@compiled_only
@settings(max_examples=200, deadline=None)
@given(dtype=st.sampled_from(SUPPORTED_DTYPES), size=st.integers(0, 2000),
       bits=st.integers(qsgd.MIN_BITS, qsgd.MAX_BITS), bucket=st.sampled_from([1, 3, 64, 512]),
       seed=st.integers(0, 2**32 - 1), with_bad_code=st.booleans())
def test_any_payload_decodes_to_the_same_bits(dtype, size, bits, bucket, seed, with_bad_code):
    # Payloads no encoder writes, such as negative codes in a bucket whose norm is NaN
    # or infinite, must decode alike too: a receiver cannot tell where a payload came from.
    rng = np.random.default_rng(seed)
    specials = np.array([0.0, 1e-45, 1e-30, 1.0, 3e38, np.inf, np.nan,
                         PAYLOAD_NAN.astype(np.float32)], np.float32)
    norms = rng.choice(specials, -(-size // bucket))
    codes = rng.integers(0, 2**bits, size)
    if not with_bad_code:
        codes[codes == 1] = 0
    data = qsgd._SEED.pack(seed) + norms.astype("<f4").tobytes() + pack_fixed(codes, bits)
    codec = qsgd.QSGDValues(bits=bits, bucket=bucket)
    compiled, numpy = extensions.both(qsgd, "_qsgd", decode_or_error, codec, data, size, dtype)
    if isinstance(compiled, str):
        assert compiled == numpy
    else:
        assert as_bits(compiled) == as_bits(numpy)


def test_levels_are_within_one_step_and_keep_the_sign(implementation):
    x = np.random.default_rng(1).standard_normal(3000).astype(np.float32)
    codec = qsgd.QSGDValues(bits=5, bucket=100)
    _, received = codec.encode_and_receive(x)
    step = np.repeat(np.abs(x).reshape(-1, 100).max(axis=1), 100) / codec.levels
    assert np.all(np.abs(received - x) <= step * (1 + 1e-6))
    assert np.all((received == 0) | (np.sign(received) == np.sign(x)))


def test_non_canonical_code_is_rejected(implementation):
    codec = qsgd.QSGDValues(bits=8, bucket=4)
    data = bytearray(codec.encode(np.array([1.0, 0.0, 0.0, 0.0], np.float32)))
    data[-1] = 1  # the last code: level 0 with the sign bit set
    with pytest.raises(DecodeError, match="sign bit"):
        codec.decode(bytes(data), 4, np.float32)


@compiled_only
def test_compiled_loops_check_their_arguments():
    values, seed = np.ones(10, np.float32), 7
    norms, quantize = np.empty(2, np.float32), qsgd._qsgd.quantize
    with pytest.raises(ValueError, match="bits"):
        quantize(values, 8, 9, seed, norms, True, None)  # bits in [2, 8]
    with pytest.raises(ValueError, match="bucket"):
        quantize(values, 0, 3, seed, norms, True, None)
    with pytest.raises(TypeError, match="values"):
        quantize(values.astype(np.int32), 8, 3, seed, norms, True, None)
    with pytest.raises((TypeError, OverflowError)):
        quantize(values, 8, 3, -1.5, norms, True, None)
    with pytest.raises(ValueError, match="norms"):
        quantize(values, 8, 3, seed, norms[:1], True, None)
    with pytest.raises(TypeError, match="norms"):
        quantize(values, 8, 3, seed, np.frombuffer(bytes(8), np.float32), True, None)
    with pytest.raises(ValueError, match="received"):
        quantize(values, 8, 3, seed, norms, True, np.empty(9, np.float32))
    with pytest.raises(ValueError, match="codes need"):
        qsgd._qsgd.dequantize(bytes(3), norms, 8, 3, np.empty(10, np.float32))
    with pytest.raises(TypeError, match="out"):
        qsgd._qsgd.dequantize(bytes(4), norms, 8, 3, np.empty(10, np.int64))


def test_dither_is_the_murmur_hash_of_each_position():
    import mmh3
    draws = qsgd.dither(5000, seed=2**32 - 3)
    assert draws.dtype == np.float32 and draws.min() >= 0 and draws.max() < 1
    for i in (0, 1, 4999):
        expected = (mmh3.hash(i.to_bytes(4, "little"), 2**32 - 3, signed=False) >> 8) / 2**24
        assert draws[i] == expected
    # uniform: each of 16 bins holds its share, within 5 standard deviations
    counts = np.bincount((qsgd.dither(2**16, seed=1) * 16).astype(int), minlength=16)
    assert np.all(np.abs(counts - 4096) < 5 * np.sqrt(4096))
