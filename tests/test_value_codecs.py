"""Basic value codecs: raw, fp32, fp16, bf16 (codecs/values/raw.py, floats.py), deflate and zstd."""

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deepreduce.codecs._deflate import deflate
from deepreduce.codecs._zstd import zstd_compress
from deepreduce.codecs.values.deflate import DeflateValues
from deepreduce.codecs.values.dtypes import BFLOAT16, SUPPORTED_DTYPES, float32_to_bfloat16_bits
from deepreduce.codecs.values.floats import BFloat16Values, Float16Values, Float32Values
from deepreduce.codecs.values.raw import RawValues
from deepreduce.codecs.values.zstd import ZstdValues
from deepreduce.errors import DecodeError
from deepreduce.registry import get_codec

LOSSLESS = ["raw", "deflate", "zstd"]
LOSSY = ["fp32", "fp16", "bf16"]
ALL = LOSSLESS + LOSSY
DTYPES = list(SUPPORTED_DTYPES)
DTYPE_IDS = [d.name for d in DTYPES]


def _is_bfloat16(dtype) -> bool:
    # without ml_dtypes BFLOAT16 is None, and np.dtype(...) == None is True
    return BFLOAT16 is not None and np.dtype(dtype) == BFLOAT16


def codec(codec_id, **params):
    return get_codec({"id": codec_id, **params}, family="value")


def bits(values):
    return values.view(f"u{values.dtype.itemsize}")


def random_bit_patterns(rng, dtype, size):
    """Values from uniformly random bit patterns: NaNs with payloads, infinities, subnormals."""
    raw = rng.integers(0, 2**(8 * dtype.itemsize), size=size, dtype=np.uint64, endpoint=False)
    return raw.astype(f"u{dtype.itemsize}").view(dtype)


def special_values(dtype):
    wide = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e-30, 3e38, 70000.0,
                     65504.0, 65519.0, 65520.0, -1e6, 6e-8, 2.0**-24, 2.0**-14, 2.0**-126,
                     2.0**-133, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 0.1, -0.3])
    with np.errstate(over="ignore"):
        if _is_bfloat16(dtype):
            return float32_to_bfloat16_bits(wide.astype(np.float32)).view(BFLOAT16)
        return wide.astype(dtype)


def sample_values(dtype, seed=0, size=500):
    rng = np.random.default_rng(seed)
    return np.concatenate([special_values(dtype), random_bit_patterns(rng, dtype, size)])


def as_float64(values):
    with np.errstate(invalid="ignore"):  # signalling NaNs flag "invalid" when widened
        if _is_bfloat16(values.dtype):
            return (bits(values).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return values.astype(np.float64)


def reference_round(x, significand_bits, min_normal_exponent, largest):
    """Correctly rounded (nearest, ties to even) value of float64 ``x`` in a binary format.

    Computed independently of the codecs: scale each value so its last kept
    bit has weight one, round with numpy's exact half-to-even, scale back.
    Values rounding beyond ``largest`` become infinite.
    """
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x) & (x != 0)
    _, exponent = np.frexp(np.where(finite, x, 1.0))
    exponent = np.maximum(exponent, min_normal_exponent + 1)
    scale = np.ldexp(1.0, exponent - significand_bits)
    with np.errstate(over="ignore", invalid="ignore"):  # 2**1024 -> inf is wanted
        rounded = np.where(finite, np.round(x / scale) * scale, x)
    return np.where(np.abs(rounded) > largest, np.copysign(np.inf, x), rounded)


def round_to_bfloat16(x):
    return reference_round(x, 8, -126, float.fromhex("0x1.fep127"))


def round_to_float16(x):
    return reference_round(x, 11, -14, 65504.0)


# ------------------------------------------------------------------ lossless codecs

@pytest.mark.parametrize("codec_id", LOSSLESS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_lossless_round_trip_is_bit_exact(codec_id, dtype):
    values = sample_values(dtype)
    c = codec(codec_id)
    assert c.lossless
    data = c.encode(values)
    decoded = c.decode(data, values.size, dtype)
    assert decoded.dtype == dtype
    np.testing.assert_array_equal(bits(decoded), bits(values))
    sent, received = c.encode_and_receive(values)
    assert sent == data
    np.testing.assert_array_equal(bits(received), bits(values))


@pytest.mark.parametrize("codec_id", LOSSLESS)
@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(DTYPES), size=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_lossless_round_trip_random(codec_id, dtype, size, seed):
    values = random_bit_patterns(np.random.default_rng(seed), dtype, size)
    c = codec(codec_id)
    decoded = c.decode(c.encode(values), size, dtype)
    np.testing.assert_array_equal(bits(decoded), bits(values))


@pytest.mark.parametrize("codec_id", ALL)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_empty_values(codec_id, dtype):
    c = codec(codec_id)
    data = c.encode(np.zeros(0, dtype=dtype))
    assert data == b""
    decoded = c.decode(data, 0, dtype)
    assert decoded.dtype == dtype and decoded.size == 0


def test_raw_stream_is_little_endian_values():
    values = np.array([1.0, -2.5], dtype=np.float32)
    assert RawValues().encode(values) == values.astype("<f4").tobytes()
    assert RawValues().encode(values.astype(">f4")) == values.astype("<f4").tobytes()
    assert RawValues().encode(np.array([1.0], np.float64)).hex() == "000000000000f03f"


def test_byte_shuffle_helps_compression():
    rng = np.random.default_rng(0)
    values = rng.normal(0, 1e-3, 20_000).astype(np.float32)
    shuffled = len(ZstdValues().encode(values))
    unshuffled = len(zstd_compress(values.tobytes(), 3))
    assert shuffled < unshuffled


# ------------------------------------------------------------------ lossy codecs

@pytest.mark.parametrize("codec_id", LOSSY)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_encode_and_receive_matches_decode(codec_id, dtype):
    values = sample_values(dtype, seed=1)
    c = codec(codec_id)
    assert not c.lossless
    data, received = c.encode_and_receive(values)
    assert data == c.encode(values)
    decoded = c.decode(data, values.size, dtype)
    assert decoded.dtype == dtype and received.dtype == dtype
    np.testing.assert_array_equal(bits(received), bits(decoded))
    assert np.array_equal(np.isnan(as_float64(decoded)), np.isnan(as_float64(values)))


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d.itemsize <= 4], ids=lambda d: d.name)
def test_fp32_is_exact_for_narrow_dtypes(dtype):
    values = sample_values(dtype, seed=2)
    decoded = Float32Values().decode(Float32Values().encode(values), values.size, dtype)
    nan = np.isnan(as_float64(values))
    np.testing.assert_array_equal(bits(decoded)[~nan], bits(values)[~nan])
    assert np.all(np.isnan(as_float64(decoded))[nan])
    if not _is_bfloat16(dtype):  # numpy keeps float16/float32 NaN payloads through float32
        np.testing.assert_array_equal(bits(decoded), bits(values))


def test_fp32_rounds_float64():
    values = sample_values(np.dtype(np.float64), seed=3)
    decoded = Float32Values().decode(Float32Values().encode(values), values.size, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(np.float32).astype(np.float64)
    np.testing.assert_array_equal(decoded, expected)
    assert len(Float32Values().encode(values)) == 4 * values.size


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fp16_is_correctly_rounded_and_saturates(dtype):
    values = sample_values(dtype, seed=4, size=3000)
    wide = as_float64(values)
    data = Float16Values().encode(values)
    assert len(data) == 2 * values.size
    on_wire = np.frombuffer(data, dtype="<f2").astype(np.float64)
    finite = np.isfinite(wide)
    expected = round_to_float16(np.where(finite, np.clip(wide, -65504, 65504), wide))
    np.testing.assert_array_equal(on_wire, expected)
    decoded = as_float64(Float16Values().decode(data, values.size, dtype))
    normal = finite & (np.abs(wide) >= 2.0**-14) & (np.abs(wide) <= 65504)
    relative = np.abs(decoded[normal] - wide[normal]) / np.abs(wide[normal])
    if not _is_bfloat16(dtype):  # bf16 receivers round again to 8 bits
        assert relative.max() <= 2.0**-11
        tiny = finite & (np.abs(wide) < 2.0**-14)
        assert np.all(np.abs(decoded[tiny] - wide[tiny]) <= 2.0**-25)
    big = finite & (np.abs(wide) > 65504)
    assert np.all(np.abs(on_wire[big]) == 65504) and np.all(np.sign(on_wire[big]) == np.sign(wide[big]))
    infinite = np.isinf(wide)
    np.testing.assert_array_equal(on_wire[infinite], wide[infinite])
    assert np.all(np.isnan(on_wire[np.isnan(wide)]))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bf16_is_correctly_rounded(dtype):
    values = sample_values(dtype, seed=5, size=3000)
    wide = as_float64(values)
    data = BFloat16Values().encode(values)
    assert len(data) == 2 * values.size
    on_wire = as_float64((np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32))
    nan = np.isnan(wide)
    np.testing.assert_array_equal(on_wire[~nan], round_to_bfloat16(wide[~nan]))
    assert np.all(np.isnan(on_wire[nan]))
    decoded = as_float64(BFloat16Values().decode(data, values.size, dtype))
    normal = np.isfinite(wide) & (np.abs(wide) >= 2.0**-126) & (np.abs(wide) < 3e38)
    if dtype.itemsize >= 4:
        relative = np.abs(decoded[normal] - wide[normal]) / np.abs(wide[normal])
        assert relative.max() <= 2.0**-8
    if _is_bfloat16(dtype):
        np.testing.assert_array_equal(bits(BFloat16Values().decode(data, values.size, dtype))[~nan],
                                      bits(values)[~nan])


def test_bf16_avoids_double_rounding_of_float64():
    # Just above a bfloat16 tie: float32 rounding lands exactly on the tie,
    # and a second round-to-even would wrongly go down to 1.0.
    x = np.array([1 + 2.0**-8 + 2.0**-30, -(1 + 2.0**-8 + 2.0**-30), 1 + 2.0**-8, 1 + 3 * 2.0**-8])
    decoded = BFloat16Values().decode(BFloat16Values().encode(x), x.size, np.float64)
    np.testing.assert_array_equal(decoded, [1 + 2.0**-7, -(1 + 2.0**-7), 1.0, 1 + 2.0**-6])


@pytest.mark.skipif(BFLOAT16 is None, reason="ml_dtypes not installed")
def test_bf16_matches_ml_dtypes_for_float32():
    values = sample_values(np.dtype(np.float32), seed=6, size=5000)
    ours = np.frombuffer(BFloat16Values().encode(values), dtype="<u2")
    with np.errstate(over="ignore", invalid="ignore"):
        theirs = values.astype(BFLOAT16).view(np.uint16)
    nan = np.isnan(values)
    np.testing.assert_array_equal(ours[~nan], theirs[~nan])
    assert np.all((ours[nan] & 0x7FC0) == 0x7FC0)  # quiet NaN


@pytest.mark.parametrize("codec_id", LOSSY)
@pytest.mark.parametrize("source", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("target", DTYPES, ids=DTYPE_IDS)
def test_lossy_streams_decode_to_any_supported_dtype(codec_id, source, target):
    """Their wire format does not depend on the source dtype."""
    values = special_values(source)
    decoded = codec(codec_id).decode(codec(codec_id).encode(values), values.size, target)
    assert decoded.dtype == target and decoded.shape == values.shape


# ------------------------------------------------------------------ configs and arguments

CONFIGS = [("raw", {}), ("fp32", {}), ("fp16", {}), ("bf16", {}), ("deflate", {}),
           ("deflate", {"level": 1}), ("zstd", {}), ("zstd", {"level": 22})]


@pytest.mark.parametrize("codec_id, params", CONFIGS)
def test_config_and_spec_round_trip(codec_id, params):
    c = codec(codec_id, **params)
    config = json.loads(json.dumps(c.get_config()))
    assert config == {**type(c)().get_config(), **params}
    assert type(c).from_config(config) == c
    assert get_codec(c.spec(), family="value") == c
    assert c.family == "value" and not c.sorts_values
    assert c.lossless == (codec_id in LOSSLESS)


def test_default_levels():
    assert DeflateValues().spec() == "deflate" and ZstdValues().spec() == "zstd"
    assert ZstdValues(level=9).spec() == "zstd:level=9"


@pytest.mark.parametrize("cls, level", [
    (DeflateValues, -1), (DeflateValues, 10), (DeflateValues, "1"), (DeflateValues, False),
    (ZstdValues, 0), (ZstdValues, 23), (ZstdValues, 3.5),
])
def test_bad_levels_raise_value_error(cls, level):
    with pytest.raises(ValueError, match="level"):
        cls(level=level)


@pytest.mark.parametrize("codec_id", ALL)
@pytest.mark.parametrize("values", [
    np.zeros(3, dtype=np.int32), np.zeros(3, dtype=np.complex64), np.zeros((2, 2), np.float32),
    np.float32(1.0), np.array(["a"]),
], ids=["int32", "complex", "2-D", "scalar", "str"])
def test_bad_values_raise_value_error(codec_id, values):
    with pytest.raises(ValueError):
        codec(codec_id).encode(values)
    with pytest.raises(ValueError):
        codec(codec_id).encode_and_receive(values)


@pytest.mark.parametrize("codec_id", ALL)
@pytest.mark.parametrize("dtype", [np.int32, np.complex64, None, "nonsense"])
def test_unsupported_decode_dtype_raises_decode_error(codec_id, dtype):
    with pytest.raises(DecodeError, match="dtype"):
        codec(codec_id).decode(b"\x00" * 8, 2, dtype)


@pytest.mark.parametrize("codec_id", ALL)
@pytest.mark.parametrize("nnz", [-1, 1.5, True, None])
def test_bad_counts_raise_decode_error(codec_id, nnz):
    with pytest.raises(DecodeError):
        codec(codec_id).decode(b"\x00" * 8, nnz, np.float32)


# ------------------------------------------------------------------ malformed streams

def decode_or_reject(codec_id, data, nnz, dtype):
    try:
        result = codec(codec_id).decode(data, nnz, dtype)
    except DecodeError as exc:
        assert str(exc)
        return None
    assert result.dtype == dtype and result.shape == (nnz,)
    return result


@pytest.mark.parametrize("codec_id", ALL)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_every_truncation_and_trailing_byte_is_rejected(codec_id, dtype):
    values = sample_values(dtype, size=40)
    data = codec(codec_id).encode(values)
    for cut in range(len(data)):
        with pytest.raises(DecodeError):
            codec(codec_id).decode(data[:cut], values.size, dtype)
    with pytest.raises(DecodeError):
        codec(codec_id).decode(data + b"\x00", values.size, dtype)


@pytest.mark.parametrize("codec_id", ALL)
@settings(max_examples=100, deadline=None)
@given(dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**32 - 1), flips=st.integers(1, 3))
def test_bit_flips_are_rejected_or_valid(codec_id, dtype, seed, flips):
    rng = np.random.default_rng(seed)
    values = sample_values(dtype, seed=seed % 7, size=int(rng.integers(1, 100)))
    corrupt = bytearray(codec(codec_id).encode(values))
    for position in rng.integers(0, 8 * len(corrupt), size=flips):
        corrupt[position // 8] ^= 1 << (position % 8)
    decode_or_reject(codec_id, bytes(corrupt), values.size, dtype)


@pytest.mark.parametrize("codec_id", ALL)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_wrong_counts_are_rejected_or_valid(codec_id, dtype):
    values = sample_values(dtype, size=60)
    data = codec(codec_id).encode(values)
    for nnz in (0, 1, values.size - 1, values.size + 1, 2 * values.size, 10**15):
        decode_or_reject(codec_id, data, nnz, dtype)
    if codec_id in ("deflate", "zstd"):  # sizes do not give the count away
        for nnz in (values.size - 1, values.size + 1):
            with pytest.raises(DecodeError):
                codec(codec_id).decode(data, nnz, dtype)


@pytest.mark.parametrize("codec_id, compress", [("deflate", deflate), ("zstd", zstd_compress)])
def test_decompression_bombs_are_refused(codec_id, compress):
    bomb = compress(b"\x00" * 10**6, 6)
    with pytest.raises(DecodeError, match="more than"):
        codec(codec_id).decode(bomb, 1000, np.float32)


@pytest.mark.parametrize("codec_id", ["deflate", "zstd"])
def test_empty_needs_empty_stream(codec_id):
    with pytest.raises(DecodeError):
        codec(codec_id).decode(codec(codec_id).encode(np.zeros(1, np.float32)), 0, np.float32)


def test_works_without_ml_dtypes():
    script = (
        "import sys; sys.modules['ml_dtypes'] = None\n"
        "import numpy as np, deepreduce as dr\n"
        "from deepreduce.codecs.values import dtypes\n"
        "assert dtypes.BFLOAT16 is None and len(dtypes.SUPPORTED_DTYPES) == 3\n"
        "x = np.array([0.1, -2.0], np.float64)\n"
        "for cid in ['raw', 'fp32', 'fp16', 'bf16', 'deflate', 'zstd']:\n"
        "    c = dr.get_codec(cid, family='value')\n"
        "    y = c.decode(c.encode(x), 2, np.float64)\n"
        "    assert np.allclose(x, y, rtol=2**-8), (cid, y)\n"
        "try:\n"
        "    dtypes.value_dtype('V2')\n"
        "except ValueError:\n"
        "    print('ok')\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
