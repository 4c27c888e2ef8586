"""The bloom index codec: MurmurHash3, filter layout, the five policies, malformed streams."""

import math

import mmh3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import deepreduce as dr
from deepreduce.codecs._murmur import RangeHasher, key_bytes_for, murmur3_32
from deepreduce.codecs.index import bloom
from deepreduce.codecs.index.bloom import (POLICIES, BloomFilter, BloomIndices, filter_geometry,
                                     pattern_table, predicted_fpr)
from deepreduce.errors import DecodeError
import extensions

SELECTING = ["leftmost", "random", "conflict_sets"]
#: Every (k, block_k) that filter_geometry gives for fpr from 0.5 down to 1e-12.
HASH_COUNTS = sorted({filter_geometry(100, fpr)[1:] for fpr in np.geomspace(0.5, 1e-12, 400)})


def reference_hash(key: int, seed: int, key_bytes: int) -> int:
    return mmh3.hash(key.to_bytes(key_bytes, "little"), seed, signed=False)


def random_indices(rng, n, r):
    return np.sort(rng.choice(n, size=r, replace=False)).astype(np.int64)


def brute_force_positives(filt: BloomFilter, start: int = 0, stop: int | None = None):
    """Every position whose k bits are all set, straight from the filter definition."""
    positions = np.arange(start, filt.n if stop is None else stop, dtype=np.int64)
    bits = filt.bit_positions(positions)
    set_bits = (filt.words[bits >> 6] >> (bits & 63).astype(np.uint64)) & np.uint64(1)
    return positions[set_bits.all(axis=1)]


scan = extensions.fixture(bloom, "_bloomscan", "scan")


def filter_of(indices, n: int, k: int, block_k: int, seed: int, nbytes: int,
              key_bytes: int | None = None) -> BloomFilter:
    """A filter of ``indices`` with the given geometry, hash count and key width."""
    filt = BloomFilter(np.zeros(-(-nbytes // 8), dtype=np.uint64), nbytes, k, block_k, seed, n)
    filt.key_bytes = key_bytes or filt.key_bytes
    flags = np.zeros(filt.m, dtype=bool)
    flags[filt.bit_positions(indices).ravel()] = True
    packed = np.zeros(filt.words.size * 8, dtype=np.uint8)
    packed[:nbytes] = np.packbits(flags, bitorder="little")
    filt.words = packed.view("<u8").astype(np.uint64)
    return filt


# ----------------------------------------------------------------- MurmurHash3

@pytest.mark.parametrize("key_bytes", [4, 8])
def test_murmur_matches_mmh3_on_many_keys_and_seeds(key_bytes):
    rng = np.random.default_rng(key_bytes)
    keys = rng.integers(0, 2**(8 * key_bytes), size=2000, dtype=np.uint64, endpoint=False)
    keys[:4] = [0, 1, 2**32 - 1, 2**(8 * key_bytes) - 1]
    for seed in [0, 1, 42, 2**31, 2**32 - 1, *rng.integers(0, 2**32, size=5).tolist()]:
        expected = [reference_hash(int(k), seed, key_bytes) for k in keys]
        assert murmur3_32(keys, seed, key_bytes).tolist() == expected


@settings(max_examples=200, deadline=None)
@given(key=st.integers(0, 2**64 - 1), seed=st.integers(0, 2**32 - 1))
def test_murmur_matches_mmh3_hypothesis(key, seed):
    width = 4 if key < 2**32 else 8
    assert int(murmur3_32(np.array([key], dtype=np.uint64), seed, width)[0]) == \
        reference_hash(key, seed, width)


def test_murmur_per_element_seeds_and_signed_keys():
    keys = np.arange(-3, 500, dtype=np.int64)[3:]
    seeds = np.arange(keys.size, dtype=np.uint64) * 7919
    expected = [reference_hash(int(k), int(s), 4) for k, s in zip(keys, seeds)]
    assert murmur3_32(keys, seeds).tolist() == expected


@pytest.mark.parametrize("start,key_bytes", [(0, 4), (2**32 - 300, 4), (2**40 + 5, 8),
                                             (7 * 2**32, 8), (123, 8)])
def test_range_hasher_matches_mmh3(start, key_bytes):
    hasher = RangeHasher(chunk=300)
    got = hasher.hash_range(start, 300, 99, key_bytes)
    assert got.tolist() == [reference_hash(start + i, 99, key_bytes) for i in range(300)]


def test_range_hasher_refuses_runs_it_cannot_hash():
    hasher = RangeHasher(chunk=16)
    with pytest.raises(ValueError):
        hasher.hash_range(2**32 - 8, 16, 0, 4)
    with pytest.raises(ValueError):
        hasher.hash_range(2**32 - 8, 16, 0, 8)
    with pytest.raises(ValueError):
        hasher.hash_range(0, 17, 0, 4)


def test_key_width_follows_the_universe():
    assert key_bytes_for(2**32) == 4 and key_bytes_for(2**32 + 1) == 8


# ----------------------------------------------------------------- layout and sizing

@pytest.mark.parametrize("fpr", [0.5, 0.1, 0.01, 1e-3, 1e-4, 1e-6])
def test_sizing_is_the_papers_within_a_few_percent(fpr):
    nbytes, k, block_k = filter_geometry(100_000, fpr)
    assert k == max(1, round(math.log2(1 / fpr)))
    standard = -100_000 * math.log(fpr) / math.log(2) ** 2
    assert standard <= 8 * nbytes <= 1.035 * standard + 8
    assert predicted_fpr(8 * nbytes / 100_000, k, block_k) <= fpr * 1.0001


def test_pattern_table_has_distinct_bits():
    for block_k in range(1, 5):
        masks, offsets = pattern_table(block_k)
        assert masks.shape == (4096,) and offsets.shape == (4096, block_k)
        assert all(bin(int(m)).count("1") == block_k for m in masks[:500])
        choices = math.comb(64, block_k)  # random draws: as many distinct as chance allows
        assert np.unique(masks).size >= 0.97 * choices * (1 - (1 - 1 / choices) ** 4096)


@pytest.mark.parametrize("fpr", [0.3, 0.05, 1e-3])
@pytest.mark.parametrize("key_bytes", [4, 8])
def test_scan_finds_exactly_the_positions_whose_bits_are_set(fpr, key_bytes, scan):
    n, rng = 30_000, np.random.default_rng(int(fpr * 1000) + key_bytes)
    indices = random_indices(rng, n, 400)
    nbytes, k, block_k = filter_geometry(indices.size, fpr)
    # key_bytes=8 exercises the 8-byte key path on a small universe
    filt = filter_of(indices, n, k, block_k, 12345, nbytes, key_bytes)
    positives = filt.positives()
    assert np.array_equal(positives, brute_force_positives(filt))
    assert np.isin(indices, positives).all()
    assert np.array_equal(filt.positives(limit=100), positives[:101])
    assert np.array_equal(filt.positives(start=777, stop=20_001),
                          positives[(positives >= 777) & (positives < 20_001)])


@pytest.mark.parametrize("k,block_k", HASH_COUNTS)
def test_both_scans_agree_for_every_hash_count(k, block_k):
    assert [k for k, _ in HASH_COUNTS] == list(range(1, 41))  # fpr 0.5 .. 1e-12
    n, rng = 5000, np.random.default_rng(k)
    indices = random_indices(rng, n, 150)
    nbytes = filter_geometry(indices.size, 2.0 ** -k)[0]
    filt = filter_of(indices, n, k, block_k, int(rng.integers(2**32)), nbytes)
    expected = brute_force_positives(filt)
    assert np.isin(indices, expected).all()
    results = extensions.both(bloom, "_bloomscan", lambda: [
        filt.positives(), filt.positives(limit=3), filt.positives(limit=expected.size),
        filt.positives(start=1, stop=n - 1),
        BloomFilter.build(indices, n, 2.0 ** -k, filt.seed).words])
    inner = expected[(expected >= 1) & (expected < n - 1)]
    for got in results:
        assert np.array_equal(got[0], expected) and got[0].dtype == np.int64
        assert np.array_equal(got[1], expected[:4])
        assert np.array_equal(got[2], expected)
        assert np.array_equal(got[3], inner)
        assert np.array_equal(got[4], filt.words)  # the encoder's filter is the same


@pytest.mark.parametrize("start,stop", [(2**32 - 1500, 2**32 + 1500), (2**33 - 700, 2**33 + 9),
                                        (2**34 + 8, 2**34 + 8), (2**34 + 1, 2**34 + 10)])
def test_scan_of_a_universe_above_2_32_uses_8_byte_keys(start, stop, scan):
    n = 2**34 + 10
    indices = np.array([0, 2**32 - 2, 2**32 - 1, 2**32, 2**32 + 999, 2**33 - 1, 2**33, n - 1])
    nbytes, k, block_k = filter_geometry(3000, 0.01)  # room for ~3000: many false positives
    filt = filter_of(indices, n, k, block_k, 4242, nbytes)
    assert filt.key_bytes == 8
    positives = filt.positives(start=start, stop=stop)
    assert np.array_equal(positives, brute_force_positives(filt, start, stop))
    assert np.isin(indices[(indices >= start) & (indices < stop)], positives).all()
    assert np.array_equal(filt.positives(limit=0, start=start, stop=stop), positives[:1])


@pytest.mark.parametrize("n", [1, 10, 2**32, 2**32 + 1, 2**40])
def test_build_sets_the_bits_of_the_definition(n, scan):
    indices = np.unique(np.r_[0, n - 1, np.random.default_rng(n % 1000).integers(0, n, 300)])
    built = BloomFilter.build(indices, n, 1e-3, 99)
    assert np.array_equal(built.words, filter_of(indices, n, built.k, built.block_k, 99,
                                                 built.nbytes).words)


def test_scan_range_outside_the_universe_is_refused(scan):
    filt = BloomIndices().build_filter(np.array([3]), 10)
    for start, stop in [(-1, 5), (5, 4), (0, 11)]:
        with pytest.raises(ValueError, match="range"):
            filt.positives(start=start, stop=stop)


def test_empty_and_one_position_filters(scan):
    assert BloomIndices().build_filter(np.array([], np.int64), 1).positives().size == 0
    assert BloomIndices().build_filter(np.array([0]), 1).positives().tolist() == [0]
    assert BloomIndices().build_filter(np.array([], np.int64), 10**6).positives().size == 0
    empty = BloomFilter(np.zeros(1, np.uint64), 8, 3, 1, 0, 0)
    assert empty.positives().size == 0 and empty.positives().dtype == np.int64


def test_implementation_is_reported():
    assert bloom.SCAN_IMPLEMENTATION == ("numpy" if bloom._bloomscan is None else "compiled")


# ----------------------------------------------------------------- the C entry point

compiled = pytest.mark.skipif(bloom._bloomscan is None, reason="deepreduce.codecs.index._bloomscan not built")


def scan_arguments(**changes):
    """Valid arguments of _bloomscan.scan (a 1e-2 filter of 40 indices), with ``changes``."""
    filt = BloomIndices(fpr=0.01).build_filter(np.arange(0, 4000, 100), 4000)
    arguments = {"words": filt.words, "masks": filt.masks, "start": 0, "count": 4000,
                 "seed": filt.seed, "key_bytes": 4, "m": filt.m, "k": filt.k,
                 "block_k": filt.block_k, "out": np.empty(4000, np.int64)}
    return {**arguments, **changes}


@compiled
def test_c_scan_writes_the_positives_and_returns_their_count():
    arguments = scan_arguments()
    count = bloom._bloomscan.scan(*arguments.values())
    assert 40 <= count <= 4000
    assert np.isin(np.arange(0, 4000, 100), arguments["out"][:count]).all()
    assert bloom._bloomscan.scan(*scan_arguments(words=np.zeros(63, np.uint64)).values()) == 0
    assert bloom._bloomscan.scan(*scan_arguments(count=0, out=np.empty(0, np.int64)).values()) \
        == 0


@compiled
def test_c_build_refuses_indices_outside_the_key_width_and_wrong_buffers():
    arguments = scan_arguments()
    build_arguments = [np.zeros(63, np.uint64), arguments["masks"], np.array([5, 2**32]),
                       arguments["seed"], 4, arguments["m"], arguments["k"], arguments["block_k"]]
    with pytest.raises(ValueError, match="indices\\[1\\]"):
        bloom._bloomscan.build(*build_arguments)
    assert not build_arguments[0].any()  # refused before any bit was set
    for index, wrong in [(2, np.array([-1])), (4, 2), (5, 32)]:
        with pytest.raises(ValueError):
            bloom._bloomscan.build(*build_arguments[:index], wrong, *build_arguments[index + 1:])
    read_only = np.zeros(63, np.uint64)
    read_only.setflags(write=False)
    for index, wrong in [(0, read_only), (2, np.array([1, 2], np.int32)), (0, bytearray(504))]:
        with pytest.raises(TypeError):
            bloom._bloomscan.build(*build_arguments[:index], wrong, *build_arguments[index + 1:])


@compiled
@pytest.mark.parametrize("changes", [
    {"words": np.zeros(63, np.int64)}, {"words": np.zeros(63, np.uint32)},
    {"words": np.zeros((63, 2), np.uint64)[:, 0]}, {"words": np.zeros((9, 7), np.uint64)},
    {"words": [0] * 63}, {"masks": np.zeros(4096, np.float64)},
    {"out": np.empty(4000, np.uint64)}, {"out": np.empty(4000, np.int64)[::-1]},
    {"out": np.empty(4000, np.int32)}, {"out": bytes(32000)},
    {"seed": 1.5}, {"start": "0"}])
def test_c_scan_refuses_wrong_buffers_with_type_error(changes):
    with pytest.raises(TypeError):
        bloom._bloomscan.scan(*scan_arguments(**changes).values())


@compiled
@pytest.mark.parametrize("changes", [
    {"words": np.zeros(2, np.uint64)}, {"masks": np.zeros(4095, np.uint64)},
    {"out": np.empty(3999, np.int64)}, {"key_bytes": 2}, {"seed": -1}, {"seed": 2**32},
    {"k": 0}, {"k": 65}, {"block_k": 5}, {"block_k": 0}, {"k": 1, "block_k": 2},
    {"m": 63}, {"m": 2**32 + 8}, {"start": -1}, {"count": -1},
    {"start": 2**32 - 10, "count": 11, "out": np.empty(11, np.int64)},
    {"start": 2**63 - 10, "count": 11, "key_bytes": 8, "out": np.empty(11, np.int64)}])
def test_c_scan_refuses_wrong_values_with_value_error(changes):
    with pytest.raises(ValueError):
        bloom._bloomscan.scan(*scan_arguments(**changes).values())


@pytest.mark.parametrize("fpr", [0.05, 0.01, 1e-3])
def test_measured_false_positive_rate_is_close_to_requested(fpr):
    n, r = 400_000, 4_000
    rng = np.random.default_rng(7)
    false_positives = 0
    for _ in range(3):
        filt = BloomIndices(fpr=fpr).build_filter(random_indices(rng, n, r), n)
        false_positives += filt.positives().size - r
    measured = false_positives / (3 * (n - r))
    assert 0.8 * fpr <= measured <= 1.2 * fpr


def test_bits_per_index_match_the_formula():
    n, r = 1_000_000, 20_000
    data = BloomIndices(fpr=1e-3).encode(random_indices(np.random.default_rng(8), n, r), n)
    assert len(data) * 8 / r <= 1.05 * 1.44 * math.log2(1000)


# ----------------------------------------------------------------- policies

def encode_decode(policy, n, indices, dense=None, fpr=0.01, seed=3):
    encoder = BloomIndices(fpr=fpr, policy=policy, seed=seed)
    values = (indices % 97 + 1).astype(np.float32) if dense is None else dense[indices]
    data, received, sent = encoder.encode_selection(indices, values, n, dense)
    return data, received, sent, values


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3000), density=st.floats(0, 1), seed=st.integers(0, 2**32 - 1))
def test_p0_reconstructs_exactly_given_dense(n, density, seed):
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal(n).astype(np.float32)
    indices = random_indices(rng, n, int(density * n))
    data, received, sent, _ = encode_decode("p0", n, indices, dense, seed=seed)
    assert np.isin(indices, received).all()
    assert np.array_equal(sent, dense[received])
    assert np.array_equal(BloomIndices(fpr=0.01, policy="p0").decode(data, n, received.size),
                          received)


@pytest.mark.parametrize("policy", SELECTING)
@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 3000), density=st.floats(0, 1), seed=st.integers(0, 2**32 - 1))
def test_selecting_policies_return_r_positives_every_decoder_agrees_on(policy, n, density, seed):
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal(n).astype(np.float32)
    indices = random_indices(rng, n, int(density * n))
    data, received, sent, _ = encode_decode(policy, n, indices, dense, fpr=0.05, seed=seed)
    assert received.size == indices.size
    assert np.all(np.diff(received) > 0)
    filt = BloomFilter.from_bytes(data, n, "test")
    assert np.isin(received, filt.positives()).all()
    assert np.array_equal(sent, dense[received])
    first = BloomIndices(fpr=0.05, policy=policy).decode(data, n, indices.size)
    second = BloomIndices(fpr=0.05, policy=policy, seed=77).decode(data, n, indices.size)
    assert np.array_equal(first, received) and np.array_equal(second, received)


@pytest.mark.parametrize("policy", ["p0", *SELECTING])
def test_without_dense_false_positives_receive_zero(policy):
    n, indices = 5000, random_indices(np.random.default_rng(1), 5000, 300)
    data, received, sent, values = encode_decode(policy, n, indices, fpr=0.1)
    true = np.isin(received, indices)
    assert (~true).any()
    assert np.all(sent[~true] == 0)
    assert np.array_equal(sent[true], values[np.searchsorted(indices, received[true])])


def test_leftmost_takes_the_first_positives_and_naive_misassigns_values(scan):
    n, indices = 5000, random_indices(np.random.default_rng(2), 5000, 300)
    encoder = BloomIndices(fpr=0.1, policy="leftmost", seed=1)
    filt_positives = None
    _, received, _, _ = encode_decode("leftmost", n, indices, fpr=0.1, seed=1)
    data, naive_received, sent, values = encode_decode("naive", n, indices, fpr=0.1, seed=1)
    filt_positives = BloomFilter.from_bytes(data, n, "test").positives()
    assert np.array_equal(received, filt_positives[:300])
    assert np.array_equal(naive_received, received)
    assert np.array_equal(sent, values)  # values in index order, whatever the positions
    assert not encoder.lossless


def test_conflict_sets_choose_more_true_positives_than_random():
    n, r = 200_000, 2_000
    indices = random_indices(np.random.default_rng(3), n, r)
    hits = {}
    for policy in ("random", "conflict_sets", "leftmost"):
        received = encode_decode(policy, n, indices, fpr=0.01)[1]
        hits[policy] = np.isin(received, indices).mean()
    assert hits["conflict_sets"] > 0.75 and hits["random"] < 0.6  # about 0.8 and 0.5
    assert abs(hits["random"] - hits["leftmost"]) < 0.1


def test_p0_decoder_checks_the_count(scan):
    n, indices = 5000, random_indices(np.random.default_rng(4), 5000, 100)
    data, received, _, _ = encode_decode("p0", n, indices)
    decoder = BloomIndices(fpr=0.01, policy="p0")
    for nnz in (received.size - 1, received.size + 1, 0):
        with pytest.raises(DecodeError, match="positives"):
            decoder.decode(data, n, nnz)


@pytest.mark.parametrize("policy", SELECTING)
def test_selecting_decoders_need_enough_positives(policy):
    n, indices = 5000, random_indices(np.random.default_rng(5), 5000, 100)
    data, received, _, _ = encode_decode(policy, n, indices)
    positives = BloomFilter.from_bytes(data, n, "test").positives().size
    with pytest.raises(DecodeError, match="fewer than"):
        BloomIndices(policy=policy).decode(data, n, positives + 1)


def test_calls_use_fresh_seeds_but_runs_reproduce():
    n, indices = 10_000, random_indices(np.random.default_rng(6), 10_000, 200)
    runs = [[BloomIndices(seed=9).encode(indices, n)] for _ in range(2)]
    codec = BloomIndices(seed=9)
    streams = [codec.encode(indices, n) for _ in range(3)]
    assert streams[0] == runs[0][0] == runs[1][0]
    assert len(set(streams)) == 3


@pytest.mark.parametrize("n,indices", [(1, [0]), (1, []), (10, [0, 9]), (64, list(range(64))),
                                       (100_000, []), (100_000, [99_999])])
@pytest.mark.parametrize("policy", POLICIES)
def test_edge_cases(n, indices, policy, scan):
    indices = np.array(indices, dtype=np.int64)
    dense = np.arange(n, dtype=np.float64) + 1
    data, received, sent, _ = encode_decode(policy, n, indices, dense)
    assert np.isin(indices, received).all() or policy != "p0"
    assert np.array_equal(BloomIndices(policy=policy).decode(data, n, received.size), received)
    if policy != "naive":
        assert np.array_equal(sent, dense[received])


@pytest.mark.parametrize("policy", ["p0", "conflict_sets"])
def test_pipeline_round_trip(policy):
    x = np.random.default_rng(10).standard_normal(50_000).astype(np.float32)
    pipe = dr.Pipeline(dr.TopK(0.01), index=f"bloom:policy={policy}", value="raw")
    payload, received = pipe.encode(x)
    assert dr.decompress(payload) == received
    assert np.array_equal(received.values, x[received.indices])


# ----------------------------------------------------------------- malformed input

@pytest.mark.parametrize("spec", ["bloom:fpr=0", "bloom:fpr=1", "bloom:fpr=-0.1", "bloom:fpr=2",
                                  "bloom:fpr=1e-20", "bloom:fpr=true", "bloom:policy=p1",
                                  "bloom:seed=-1", "bloom:seed=4294967296", "bloom:seed=1.5"])
def test_bad_parameters_raise_value_error(spec):
    with pytest.raises(ValueError):
        dr.get_codec(spec, family="index")


def test_bad_encoder_input_raises_value_error():
    codec = BloomIndices()
    with pytest.raises(ValueError):
        codec.encode(np.array([3, 1]), 10)
    with pytest.raises(ValueError):
        codec.encode_selection(np.array([1, 3]), np.ones(3), 10)
    with pytest.raises(ValueError):
        codec.encode_selection(np.array([1, 3]), np.ones(2), 10, dense=np.ones(9))


@pytest.mark.parametrize("policy", POLICIES)
def test_truncated_extended_and_corrupted_headers_raise_decode_error(policy):
    n, indices = 4000, random_indices(np.random.default_rng(11), 4000, 50)
    data, received, _, _ = encode_decode(policy, n, indices)
    decoder = BloomIndices(policy=policy)
    for cut in range(len(data)):
        with pytest.raises(DecodeError):
            decoder.decode(data[:cut], n, received.size)
    with pytest.raises(DecodeError):
        decoder.decode(data + b"\0" * 8, n, received.size)
    for position, value in [(0, 2), (1, 0), (1, 65), (6, 0), (6, 7), (6, 0xFF)]:
        broken = bytearray(data)
        broken[position] = value
        with pytest.raises(DecodeError):
            decoder.decode(bytes(broken), n, received.size)
    for n_bad, nnz_bad in [(-1, 0), (n, -1), (10, 20), (n, 1.5)]:
        with pytest.raises(DecodeError):
            decoder.decode(data, n_bad, nnz_bad)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_bit_flips_raise_only_decode_error(policy, data):
    n, indices = 3000, random_indices(np.random.default_rng(12), 3000, 60)
    stream, received, _, _ = encode_decode(policy, n, indices)
    broken = bytearray(stream)
    for _ in range(data.draw(st.integers(1, 3))):
        position = data.draw(st.integers(0, len(broken) - 1))
        broken[position] ^= 1 << data.draw(st.integers(0, 7))
    nnz = data.draw(st.sampled_from([received.size, max(0, received.size - 3), 3000]))
    try:
        out = BloomIndices(policy=policy).decode(bytes(broken), n, nnz)
    except DecodeError:
        return
    assert out.dtype == np.int64 and out.size == nnz
    assert np.all(np.diff(out) > 0) and (out.size == 0 or 0 <= out[0] <= out[-1] < n)


def test_a_saturated_filter_is_rejected_early_by_p0(scan):
    header = bytes([1, 10]) + (0).to_bytes(4, "little") + bytes([32])
    full = header + b"\xff" * 32
    with pytest.raises(DecodeError, match="more than"):
        BloomIndices(policy="p0").decode(full, 1_000_000, 10)


# ----------------------------------------------------------------- conflict sets

def reference_conflict_sets(filt, positives, r, rounds=8):
    """The conflict-set selection as first written (whole-array numpy, memory about
    100 bytes per (positive, bit) pair), kept to show that both implementations of
    today select exactly the same positions."""
    p = positives.size
    if r >= p:
        return positives
    bits = filt.bit_positions(positives)
    pair_keys, inverse = np.unique(bits * p + np.arange(p)[:, None], return_inverse=True)
    bit, member = np.divmod(pair_keys, p)
    set_start = np.flatnonzero(np.r_[True, bit[1:] != bit[:-1]])
    set_size = np.diff(np.r_[set_start, bit.size])
    set_of_pair = np.repeat(np.arange(set_start.size), set_size)
    seed = filt.seed ^ bloom._SELECTION_SEED
    positive_key = murmur3_32(positives, seed, filt.key_bytes)
    set_key = murmur3_32(bit[set_start], seed)
    pair_key = murmur3_32(bit, positive_key[member])
    set_order = np.argsort((set_size.astype(np.uint64) << np.uint64(32)) | set_key,
                           kind="stable")
    set_rank = np.empty_like(set_order)
    set_rank[set_order] = np.arange(set_order.size)
    rank_of_pair = set_rank[set_of_pair]
    pair_order = np.argsort((rank_of_pair.astype(np.uint64) << np.uint64(32)) | pair_key,
                            kind="stable")
    pair_set, pair_member = rank_of_pair[pair_order], member[pair_order]
    rank_size = set_size[set_order]
    rank_start = np.r_[0, np.cumsum(rank_size)]
    level_start = np.flatnonzero(np.r_[True, rank_size[1:] != rank_size[:-1]])
    levels = list(zip(level_start.tolist(), np.r_[level_start[1:], rank_size.size].tolist()))
    member_sets = rank_of_pair[inverse.reshape(p, -1)]
    selected = np.zeros(p, dtype=bool)
    touched = np.zeros(rank_size.size, dtype=bool)
    count = 0
    for _ in range(rounds):
        for first_rank, end_rank in levels:
            lo, hi = rank_start[first_rank], rank_start[end_rank]
            sets, members = pair_set[lo:hi], pair_member[lo:hi]
            open_set = ~touched[first_rank:end_rank]
            touched[first_rank:end_rank] = False
            candidate = np.flatnonzero(open_set[sets - first_rank] & ~selected[members])
            if candidate.size == 0:
                continue
            candidate_sets = sets[candidate]
            first = np.r_[True, candidate_sets[1:] != candidate_sets[:-1]]
            nominees, pickers = members[candidate[first]], candidate_sets[first]
            _, first_nomination = np.unique(nominees, return_index=True)
            first_nomination.sort()
            chosen = nominees[first_nomination][:r - count]
            selected[chosen] = True
            count += chosen.size
            touched[member_sets[chosen]] = True
            touched[pickers] = False
            if count == r:
                return np.sort(positives[selected])
    rest = np.flatnonzero(~selected)
    selected[rest[bloom._smallest_keys(member_sets[rest].min(axis=1), r - count)]] = True
    return np.sort(positives[selected])


def assert_conflict_sets_match(filt, positives, counts, rounds=(8, 2, 0)):
    """Compiled, numpy and the reference select the same positions for each r in
    ``counts`` and each number of rounds (0: the shortfall alone)."""
    for r in sorted({r for r in counts if 0 < r < positives.size}):
        for n_rounds in rounds:
            expected = reference_conflict_sets(filt, positives, r, n_rounds)
            got = extensions.both(bloom, "_bloomscan", bloom._conflict_set_selection,
                                  filt, positives, r, n_rounds)
            for result in got:
                assert result.dtype == np.int64 and np.array_equal(result, expected), \
                    (filt.k, filt.m, positives.size, r, n_rounds)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 20_000), density=st.floats(0.0005, 0.3),
       fpr=st.sampled_from([0.5, 0.2, 0.05, 0.01, 1e-3]), seed=st.integers(0, 2**32 - 1))
def test_conflict_sets_select_what_they_always_did(n, density, fpr, seed):
    rng = np.random.default_rng(seed)
    indices = random_indices(rng, n, max(1, int(density * n)))
    filt = BloomIndices(fpr=fpr, seed=seed).build_filter(indices, n)
    positives = filt.positives()
    assert_conflict_sets_match(filt, positives, [indices.size, positives.size - 1,
                                                 positives.size // 2, 1])


@pytest.mark.parametrize("nbytes,k,block_k", [(8, 1, 1), (8, 3, 1), (8, 20, 4), (16, 64, 4),
                                              (64, 7, 3), (4096, 10, 4)])
def test_conflict_sets_of_crafted_filters_match(nbytes, k, block_k):
    # few filter bits for many positives: sets of hundreds, many of one size, a
    # position's own bits colliding (k up to 64 in 64 bits)
    n, rng = 3000, np.random.default_rng(nbytes * 100 + k)
    filt = filter_of(random_indices(rng, n, 40), n, k, block_k, int(rng.integers(2**32)), nbytes)
    positives = filt.positives()
    assert positives.size >= 40
    assert_conflict_sets_match(filt, positives, [40, positives.size - 1, positives.size // 3])


def test_conflict_sets_with_many_sets_and_8_byte_keys_match():
    # more than 2048 sets (the compiled grouping's two-stage path), 16,384 values
    n = 1 << 20
    indices = random_indices(np.random.default_rng(13), n, 16_384)
    filt = BloomIndices(fpr=0.01, seed=5).build_filter(indices, n)
    assert np.count_nonzero(np.unpackbits(filt.words.view(np.uint8))) > 2048
    assert_conflict_sets_match(filt, filt.positives(), [16_384, 20_000], rounds=(8, 1))
    # positions beyond 2**32 hash with 8-byte keys
    n = 2**34
    indices = np.unique(np.random.default_rng(14).integers(2**33, 2**33 + 40_000, 300))
    filt = BloomIndices(fpr=0.05, seed=6).build_filter(indices, n)
    positives = filt.positives(start=2**33 - 5000, stop=2**33 + 45_000)
    assert filt.key_bytes == 8 and np.isin(indices, positives).all()
    assert_conflict_sets_match(filt, positives, [300, positives.size - 1])


def test_conflict_sets_fixture_decodes_the_same_with_either_implementation():
    from pathlib import Path

    fixture = Path(__file__).parent / "fixtures" / "bloom_conflict_sets_f32"
    payload = (fixture.with_suffix(".drz")).read_bytes()
    with np.load(fixture.with_suffix(".npz")) as expected:
        for st_ in extensions.both(bloom, "_bloomscan", dr.decompress, payload):
            np.testing.assert_array_equal(st_.indices, expected["indices"])
            np.testing.assert_array_equal(st_.values, expected["values"])


def peak_bytes(fn) -> int:
    """Peak memory that tracemalloc sees during ``fn()`` (numpy's arrays, and the C
    extension's buffers, which it allocates through Python's allocator)."""
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_conflict_sets_memory_follows_the_positives_not_the_universe(scan):
    # 200 values in 2**22 positions at fpr 0.01: about 42,000 positives, 7 bits each
    n, r = 1 << 22, 200
    indices = random_indices(np.random.default_rng(15), n, r)
    data = BloomIndices(fpr=0.01, policy="conflict_sets", seed=7).encode(indices, n)
    positives = BloomFilter.from_bytes(data, n, "test").positives().size
    p0 = peak_bytes(lambda: BloomIndices(fpr=0.01, policy="p0").decode(data, n, positives))
    p2 = peak_bytes(lambda: BloomIndices(fpr=0.01, policy="conflict_sets").decode(data, n, r))
    # the scan's own buffers and the positives, plus at most 24 bytes per (positive, bit)
    # pair: 150 bytes a positive (the first implementation took about 650)
    assert p2 <= p0 + 150 * positives, (p0, p2, positives)


@compiled
def test_c_conflict_sets_refuses_what_is_not_a_selection():
    filt = BloomIndices(fpr=0.05).build_filter(np.arange(0, 4000, 50), 4000)
    positives = filt.positives()
    arguments = [filt.words, filt.masks, positives, 80, filt.seed, 7, filt.key_bytes, filt.m,
                 filt.k, filt.block_k, 8, np.empty(80, np.int64)]

    def call(index, value):
        return bloom._bloomscan.conflict_sets(*arguments[:index], value, *arguments[index + 1:])

    assert call(3, 80) is None
    not_positive = np.setdiff1d(np.arange(4000), positives)[:1]
    with pytest.raises(ValueError, match="not a positive"):
        call(2, np.union1d(positives, not_positive))
    for index, wrong in [(2, positives[::-1].copy()),
                         (2, np.r_[-1, positives]), (3, positives.size), (3, -1),
                         (11, np.empty(79, np.int64)), (10, -1), (5, 2**32)]:
        with pytest.raises(ValueError):
            call(index, wrong)
    for index, wrong in [(2, positives.astype(np.int32)), (11, np.empty(80, np.uint64))]:
        with pytest.raises(TypeError):
            call(index, wrong)
