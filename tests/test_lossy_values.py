"""Lossy value codecs: qsgd, statq, sign, polyfit (Fit-Poly) and dexp (Fit-DExp)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import deepreduce as dr
from deepreduce.codecs.values.dexp import DoubleExpValues, curve
from deepreduce.codecs.values.dtypes import SUPPORTED_DTYPES
from deepreduce.codecs.values.polyfit import PolyFitValues
from deepreduce.codecs.values.qsgd import QSGDValues
from deepreduce.codecs.values.sign import SignValues
from deepreduce.codecs.values.statq import StatQuantValues
from deepreduce.errors import DecodeError

DTYPES = list(SUPPORTED_DTYPES)
DTYPE_IDS = [d.name for d in DTYPES]
CODECS = [QSGDValues(), QSGDValues(bits=2, bucket=7, norm="l2"), QSGDValues(bits=8, bucket=1),
          SignValues(), SignValues(bucket=3), PolyFitValues(), PolyFitValues(degree=0, segments=2),
          DoubleExpValues(), StatQuantValues(), StatQuantValues(bits=3, sigmas=2.5),
          StatQuantValues(bits=8)]
CODEC_IDS = [c.spec() for c in CODECS]


def relative_l2(approx, exact):
    return float(np.linalg.norm(approx.astype(np.float64) - exact) / np.linalg.norm(exact))


def sample(codec, size, seed=0, dtype=np.float32):
    """Values as the pipeline hands them to ``codec`` (sorted for the curve fits)."""
    x = np.random.default_rng(seed).standard_normal(size).astype(dtype)
    return x[codec.order(x)] if codec.sorts_values else x


def top_k(values, ratio):
    k = max(1, int(values.size * ratio))
    return values[np.argpartition(np.abs(values), -k)[-k:]]


# ----------------------------------------------------------------- all codecs

@pytest.mark.parametrize("codec", CODECS, ids=CODEC_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("size", [0, 1, 5, 9, 1000])
def test_received_is_what_decode_returns(codec, dtype, size):
    values = sample(codec, size, dtype=dtype)
    data, received = codec.encode_and_receive(values)
    decoded = codec.decode(data, size, dtype)
    assert decoded.dtype == dtype and decoded.shape == (size,)
    assert np.array_equal(decoded.view(np.uint8), received.view(np.uint8))
    assert not codec.lossless


@pytest.mark.parametrize("codec", CODECS, ids=CODEC_IDS)
def test_truncated_or_extended_streams_raise_decode_error(codec):
    values = sample(codec, 300)
    data = codec.encode(values)
    for cut in range(len(data)):
        with pytest.raises(DecodeError):
            codec.decode(data[:cut], 300, np.float32)
    with pytest.raises(DecodeError):
        codec.decode(data + b"\0", 300, np.float32)


@pytest.mark.parametrize("codec", CODECS, ids=CODEC_IDS)
def test_wrong_counts_and_dtypes_raise_decode_error(codec):
    data = codec.encode(sample(codec, 100))
    for nnz in (91, 109, -1, 2**40, 1.5, None):  # 1-bit codes: a byte more or less
        with pytest.raises(DecodeError):
            codec.decode(data, nnz, np.float32)
    for dtype in (np.int32, "not a dtype", None):
        with pytest.raises(DecodeError):
            codec.decode(data, 100, dtype)


@pytest.mark.parametrize("codec", CODECS, ids=CODEC_IDS)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_corrupted_streams_raise_only_decode_error(codec, data):
    stream = bytearray(codec.encode(sample(codec, 64)))
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(stream) - 1))
        stream[position] ^= 1 << data.draw(st.integers(0, 7))
    try:
        out = codec.decode(bytes(stream), 64, np.float32)
    except DecodeError:
        return
    assert out.shape == (64,) and out.dtype == np.float32


@pytest.mark.parametrize("spec", ["qsgd:bits=1", "qsgd:bits=9", "qsgd:bucket=0", "qsgd:seed=-1",
                                  "qsgd:norm=l1", "qsgd:bits=4.0", "sign:bucket=0",
                                  "sign:bucket=true", "polyfit:degree=-1", "polyfit:degree=33",
                                  "polyfit:segments=1", "polyfit:degree=2.5", "dexp:degree=3",
                                  "statq:bits=1", "statq:bits=9", "statq:sigmas=0",
                                  "statq:sigmas=-1", "statq:bits=2.0", "statq:sigmas=true"])
def test_bad_parameters_raise_value_error(spec):
    with pytest.raises(ValueError):
        dr.get_codec(spec, family="value")


@pytest.mark.parametrize("codec", CODECS, ids=CODEC_IDS)
def test_config_round_trip(codec):
    again = dr.get_codec(codec.spec(), family="value")
    assert again == codec and again.get_config() == codec.get_config()


@pytest.mark.parametrize("codec", [c for c in CODECS if c.sorts_values], ids=str)
def test_curve_fits_sort_and_pipeline_round_trip(codec):
    x = np.random.default_rng(1).standard_normal(20_000).astype(np.float32)
    payload, received = dr.Pipeline(dr.TopK(0.05), value=codec).encode(x)
    assert dr.decompress(payload) == received
    assert received.nnz == 1000


@pytest.mark.parametrize("codec", [QSGDValues(), SignValues()], ids=str)
def test_quantizers_in_the_pipeline(codec):
    x = np.random.default_rng(2).standard_normal(20_000).astype(np.float32)
    payload, received = dr.Pipeline(dr.TopK(0.05), index="bloom", value=codec).encode(x)
    assert dr.decompress(payload) == received


# ----------------------------------------------------------------- qsgd

@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("norm", ["max", "l2"])
def test_qsgd_error_is_within_one_level(bits, norm):
    codec = QSGDValues(bits=bits, bucket=64, norm=norm)
    x = np.random.default_rng(bits).standard_normal(1000)
    data, received = codec.encode_and_receive(x)
    assert len(data) == 4 + 4 * 16 + -(-1000 * bits // 8)
    rows = np.pad(x, (0, 24)).reshape(-1, 64)
    scale = np.max(np.abs(rows), axis=1) if norm == "max" else np.linalg.norm(rows, axis=1)
    step = np.repeat(scale, 64)[:1000] / codec.levels
    assert np.all(np.abs(received - x) <= step * (1 + 1e-6))
    assert np.all((received == 0) | (np.sign(received) == np.sign(x)))


@pytest.mark.parametrize("bits,norm", [(2, "max"), (4, "max"), (2, "l2")])
def test_qsgd_is_unbiased(bits, norm):
    x = np.random.default_rng(3).standard_normal(256) * np.r_[np.full(128, 1e-3), np.ones(128)]
    codec = QSGDValues(bits=bits, bucket=32, norm=norm, seed=11)
    trials = 600
    draws = np.stack([codec.decode(codec.encode(x), x.size, np.float64) for _ in range(trials)])
    # Each estimate is a scaled Bernoulli: standardise the mean error by its exact spread.
    rows = x.reshape(-1, 32)
    scale = np.max(np.abs(rows), axis=1) if norm == "max" else np.linalg.norm(rows, axis=1)
    step = np.repeat(scale.astype(np.float32).astype(np.float64), 32) / codec.levels
    fraction = np.abs(x) / step - np.floor(np.abs(x) / step)
    spread = step * np.sqrt(fraction * (1 - fraction) / trials)
    z = (draws.mean(axis=0) - x)[spread > 0] / spread[spread > 0]
    assert np.all(np.abs(z) < 6)
    assert 0.7 < np.mean(z ** 2) < 1.3


def test_qsgd_calls_differ_but_runs_reproduce():
    x = np.random.default_rng(4).standard_normal(500)
    first, second = QSGDValues(seed=5), QSGDValues(seed=5)
    runs = [[c.encode(x) for _ in range(3)] for c in (first, second)]
    assert runs[0] == runs[1]
    assert len(set(runs[0])) == 3
    assert QSGDValues(seed=6).encode(x) != runs[0][0]


def test_qsgd_non_finite_buckets_decode_to_nan():
    codec = QSGDValues(bucket=2)
    out = codec.decode(codec.encode(np.array([1.0, np.nan, np.inf, 2.0, 3.0, -1.0])), 6,
                       np.float32)
    assert np.all(np.isnan(out[:4])) and np.all(np.isfinite(out[4:]))


def test_qsgd_rejects_non_canonical_codes():
    codec = QSGDValues(bits=3, bucket=4)
    clean = codec.encode(np.array([0.0, 0.0, 0.0, 1.0]))  # seed, norm, 12 bits of codes
    signed_zero = bytearray(clean)
    signed_zero[8] |= 0x20  # the first code (MSB first) becomes level 0 with the sign bit
    with pytest.raises(DecodeError, match="sign bit"):
        codec.decode(bytes(signed_zero), 4, np.float32)
    negative_norm = bytearray(clean)
    negative_norm[7] |= 0x80  # sign bit of the float32 norm
    with pytest.raises(DecodeError, match="negative"):
        codec.decode(bytes(negative_norm), 4, np.float32)


# ----------------------------------------------------------------- statq

def statq_bins(x, bits, sigmas):
    """The bins of the statistical quantiser, by its definition: edges over mean +- r std."""
    wide = x.astype(np.float64)
    mean, std = wide.mean(), wide.std()
    width = 2 * sigmas * std / 2**bits
    low = mean - sigmas * std
    return np.clip(np.floor((wide - low) / width), 0, 2**bits - 1).astype(int), low, width


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sigmas", [6.0, 2.0])
@pytest.mark.parametrize("data", ["gaussian", "student-t"])
def test_statq_decodes_every_value_to_the_mean_of_its_bin(bits, sigmas, data):
    rng = np.random.default_rng(bits)
    x = (rng.standard_normal(5000) if data == "gaussian" else rng.standard_t(3, 5000)) + 0.3
    codec = StatQuantValues(bits=bits, sigmas=sigmas)
    stream, received = codec.encode_and_receive(x)
    assert np.array_equal(codec.decode(stream, x.size, np.float64), received)
    bins, low, width = statq_bins(x, bits, sigmas)
    for b in np.unique(bins):
        members = bins == b
        assert np.all(received[members] == np.float32(x[members].mean()))
    inside = (x >= low) & (x < low + 2**bits * width)
    # within a bin width where the bin holds only values of its range (an edge bin that
    # took clipped values has its mean pulled outwards)
    clean = ~np.isin(bins, bins[~inside])
    assert clean.sum() > x.size // 2
    assert np.all(np.abs(x - received)[clean] <= width * (1 + 1e-6))
    # the clipped values went to the edge bins, so their means lie beyond the inner edges
    assert np.all(received[x < low] <= low + width) and np.all(received[x >= low + 2**bits * width]
                                                                >= low + (2**bits - 1) * width)
    assert abs(received.sum() - x.sum()) <= 1e-4 * np.abs(x).sum()  # bin means keep the sums


@pytest.mark.parametrize("data", ["gaussian", "student-t"])
def test_statq_bits_per_value_are_near_the_entropy_of_the_codes(data):
    rng = np.random.default_rng(7)
    g = rng.standard_normal((1024, 1024)) if data == "gaussian" else rng.standard_t(3, (1024, 1024))
    for name, values in (("all values", g.reshape(-1)[:1 << 16].astype(np.float32)),
                         ("chunktopk k=64/4096", dr.ChunkTopK(k=64)(g.astype(np.float32)).values)):
        for bits in (2, 4, 8):
            stream = StatQuantValues(bits=bits).encode(values)
            codes, _, _ = statq_bins(values, bits, 6.0)
            p = np.bincount(codes) / codes.size
            entropy = -np.sum(p[p > 0] * np.log2(p[p > 0]))
            rate = 8 * len(stream) / values.size
            print(f"statq:bits={bits} {data} {name}: {rate:.3f} bits per value, "
                  f"entropy of the codes {entropy:.3f}")
            assert rate <= bits + 0.1        # never much above the packed codes
            if bits == 2:                     # SparseLoCo's: near the entropy
                assert rate <= entropy * 1.1 + 0.05


def test_statq_packs_codes_when_zstd_does_not_pay():
    x = np.random.default_rng(8).standard_normal(40)
    stream = StatQuantValues(bits=8).encode(x)
    used = int(np.sum(np.unpackbits(np.frombuffer(stream[1:33], np.uint8))))
    assert stream[0] == 0 and len(stream) == 1 + 32 + 4 * used + 40
    stream = StatQuantValues(bits=2).encode(np.random.default_rng(8).standard_normal(4000))
    assert stream[0] == 1


def test_statq_constant_and_non_finite_values():
    codec = StatQuantValues()
    for x in (np.full(10, 2.5), np.array([7.0])):
        assert np.array_equal(codec.decode(codec.encode(x), x.size, np.float64), x)
    out = codec.decode(codec.encode(np.array([1.0, np.nan, np.inf, 2.0])), 4, np.float32)
    assert np.all(np.isnan(out))


def test_statq_rejects_streams_the_encoder_cannot_write():
    codec = StatQuantValues(bits=2)
    clean = codec.encode(np.random.default_rng(9).standard_normal(300))
    bad = [bytes([4]) + clean[1:], clean[:1] + bytes([clean[1] | 0xF0]) + clean[2:],
           clean[:1] + b"\x00" + clean[2:]]
    for stream in bad:
        with pytest.raises(DecodeError):
            codec.decode(stream, 300, np.float32)
    packed = StatQuantValues(bits=8).encode(np.array([0.0, 1.0, 2.0]))   # three bins in use
    wrong_bin = bytearray(packed)
    wrong_bin[-1] ^= 0x01
    with pytest.raises(DecodeError, match="other bins"):
        StatQuantValues(bits=8).decode(bytes(wrong_bin), 3, np.float32)


def test_statq_after_chunked_indices_in_the_pipeline():
    x = np.random.default_rng(10).standard_normal((256, 512)).astype(np.float32)
    pipeline = dr.Pipeline(dr.ChunkTopK(k=64), "chunked", "statq:bits=2,sigmas=6")
    payload, received = pipeline.encode(x)
    assert dr.decompress(payload) == received
    header = dr.read_header(payload)
    assert (header.index_spec, header.value_spec) == ("chunked", "statq")
    assert 8 * len(payload) / received.nnz < 9   # 7.37 bits of index, 1.1 of value, header


# ----------------------------------------------------------------- sign

def test_sign_sends_mean_magnitude_per_bucket():
    x = np.random.default_rng(6).standard_normal(1000)
    codec = SignValues(bucket=64)
    data, received = codec.encode_and_receive(x)
    assert len(data) == 4 * 16 + 125
    rows = np.pad(np.abs(x), (0, 24)).reshape(-1, 64)
    means = rows.sum(axis=1) / np.r_[np.full(15, 64), 40]
    expected = np.repeat(means.astype(np.float32), 64)[:1000] * np.where(x < 0, -1, 1)
    assert np.array_equal(received, expected.astype(np.float64))


def test_sign_zero_counts_as_positive_and_padding_is_checked():
    codec = SignValues(bucket=4)
    data = codec.encode(np.array([0.0, -0.0, -2.0]))
    third = float(np.float32(2 / 3))
    assert codec.decode(data, 3, np.float32).tolist() == [third, third, -third]
    with pytest.raises(DecodeError, match="padding"):
        codec.decode(data[:-1] + bytes([data[-1] | 0x80]), 3, np.float32)


# ----------------------------------------------------------------- polyfit

@pytest.mark.parametrize("ratio", [0.01, 0.1])
def test_polyfit_error_bound_on_sorted_gradients(ratio):
    """Sorted top-k values of a Gaussian: within 0.2% relative L2, about 300 bytes in all."""
    values = top_k(np.random.default_rng(7).standard_normal(200_000), ratio)
    codec = PolyFitValues()
    y = values[codec.order(values)]
    data, received = codec.encode_and_receive(y.astype(np.float32))
    assert relative_l2(received, y) < 2e-3
    assert len(data) <= 1 + 12 * 3 + 12 * 6 * 4  # 12 pieces of 6 float32 coefficients


def test_polyfit_reproduces_polynomial_pieces():
    t = np.linspace(0, 1, 400)
    y = np.r_[-2 - t[::-1] ** 3, 0.5 + 3 * t + t ** 2]  # one cubic per sign
    codec = PolyFitValues(degree=3, segments=2)
    data, received = codec.encode_and_receive(y)
    assert np.max(np.abs(received - y)) < 1e-5
    assert len(data) == 1 + 4 + 2 * 4 * 4  # two pieces: count, lengths, 4 coefficients each


def test_polyfit_knots_split_where_the_curve_bends():
    t = np.linspace(0, 1, 3000)
    y = np.where(t < 0.7, t, 0.7 + 20 * (t - 0.7))  # a kink at 70%
    codec = PolyFitValues(degree=1, segments=2)
    received = codec.encode_and_receive(y)[1]
    assert np.max(np.abs(received - y)) < 0.02


def test_polyfit_order_is_a_stable_ascending_sort():
    x = np.array([3.0, -1.0, 3.0, 0.0, -1.0], dtype=np.float32)
    assert PolyFitValues().order(x).tolist() == [1, 4, 3, 0, 2]


@pytest.mark.parametrize("codec", [PolyFitValues(), DoubleExpValues()], ids=str)
def test_curve_fits_reject_non_finite_values(codec):
    for bad in (np.nan, np.inf):
        with pytest.raises(ValueError, match="finite"):
            codec.encode(np.array([1.0, bad, 2.0]))


def test_polyfit_rejects_inconsistent_piece_tables():
    codec = PolyFitValues(degree=2, segments=3)
    good = codec.encode(np.linspace(-1, 1, 40))
    cases = {
        b"\x04": "pieces",                 # more pieces than segments allows
        b"\x00": "pieces",                 # no piece for 40 values
        b"\x01\x27": "cover",              # one piece of 39 values
        b"\x02\x14\x15": "cover",          # 20 + 21 values
        b"\x02\x00\x28": "cover",          # an empty piece
        b"\x01\xa8\x80\x80\x80\x80\x80\x80\x80\x80\x01": "cover",  # a huge length
    }
    for header, message in cases.items():
        with pytest.raises(DecodeError, match=message):
            codec.decode(header + good[3:], 40, np.float32)


# ----------------------------------------------------------------- dexp

def test_dexp_recovers_a_double_exponential():
    x = np.linspace(0, 1, 5000)
    magnitudes = curve(x, 0.3, 1.5, 2.0, 40.0)
    signs = np.where(np.random.default_rng(8).random(x.size) < 0.5, -1.0, 1.0)
    codec = DoubleExpValues()
    received = codec.encode_and_receive(magnitudes * signs)[1]
    assert relative_l2(received, magnitudes * signs) < 1e-3


@pytest.mark.parametrize("ratio", [0.01, 0.1])
def test_dexp_error_bound_on_sorted_gradients(ratio):
    """Sorted top-k magnitudes of a Gaussian: within 5% relative L2, signs exact."""
    values = top_k(np.random.default_rng(9).standard_normal(200_000), ratio)
    codec = DoubleExpValues()
    y = values[codec.order(values)]
    data, received = codec.encode_and_receive(y)
    assert relative_l2(received, y) < 0.05
    assert np.array_equal(np.sign(received), np.sign(y))
    assert len(data) == 16 + -(-y.size // 8)


@pytest.mark.parametrize("values", [np.zeros(50), np.full(50, 2.5), np.abs(np.linspace(-1, 1, 50)),
                                    np.random.default_rng(10).standard_t(2, 5000)])
def test_dexp_never_does_worse_than_a_constant(values):
    codec = DoubleExpValues()
    y = values[codec.order(values)]
    received = codec.encode_and_receive(y)[1]
    constant = np.mean(np.abs(y)) * np.where(y < 0, -1.0, 1.0)
    assert np.linalg.norm(received - y) <= np.linalg.norm(constant - y) * 1.0001 + 1e-12


def test_dexp_order_sorts_magnitudes():
    x = np.array([-3.0, 1.0, -0.5, 2.0])
    assert DoubleExpValues().order(x).tolist() == [2, 1, 3, 0]
