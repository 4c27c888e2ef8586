"""Index codecs at the entropy bound (golomb, huffman, runs) and the automatic choice (auto)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deepreduce as dr
from deepreduce import bits as _bits
from deepreduce.codecs.index import _entropy, auto, golomb, huffman, runs
from deepreduce.errors import DecodeError
from deepreduce.registry import get_codec, registered_codecs
from index_sets import assert_valid, random_set, round_trip

#: Every configuration whose streams differ.
CODECS = {
    "golomb": {},
    "golomb-rice": {"mode": "rice"},
    "golomb-true": {"mode": "golomb"},
    "huffman": {},
    "huffman-p0-b8": {"precision": 0, "block": 8},
    "huffman-p1-b9": {"precision": 1, "block": 9},
    "runs": {},
    "auto": {},
    "auto-10gbit": {"link_gbits": 10},  # the same streams, chosen by cost
}
SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def make(name):
    return get_codec({"id": name.split("-")[0], **CODECS[name]}, family="index")



# ------------------------------------------------------------------ round trips

@pytest.mark.parametrize("name", CODECS)
@SETTINGS
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1),
       kind=st.sampled_from(["uniform", "sparse", "runs", "blocks"]))
def test_round_trip_random_sets(name, n, seed, kind):
    round_trip(make(name), random_set(np.random.default_rng(seed), n, kind), n)


@pytest.mark.parametrize("name", CODECS)
@SETTINGS
@given(data=st.data())
def test_round_trip_drawn_sets(name, data):
    n = data.draw(st.integers(1, 200))
    round_trip(make(name), sorted(data.draw(st.sets(st.integers(0, n - 1)))), n)


@pytest.mark.parametrize("name", CODECS)
@SETTINGS
@given(data=st.data())
def test_round_trip_huge_universes(name, data):
    n = data.draw(st.sampled_from([2**32 - 1, 2**32, 2**32 + 1, 2**40, 2**62]))
    edges = [0, 1, n // 2, 2**32 - 2, 2**32 - 1, 2**32, n - 2, n - 1]
    chosen = data.draw(st.sets(st.sampled_from(edges) | st.integers(0, n - 1), max_size=30))
    round_trip(make(name), sorted(i for i in chosen if i < n), n)


EDGE_CASES = {
    "empty n=0": ([], 0),
    "empty": ([], 100),
    "n=1": ([0], 1),
    "first": ([0], 1000),
    "last": ([999], 1000),
    "first and last": ([0, 999], 1000),
    "all": (range(777), 777),
    "all but one": ([i for i in range(300) if i != 150], 300),
    "one run": (range(100, 356), 1000),
    "adjacent runs": ([1, 2, 3, 5, 6, 7, 9], 10),
    "aligned rows": ([r * 64 + c for r in (3, 4, 9) for c in range(64)], 6400),
    "rows up to n": ([r * 64 + c for r in (0, 99) for c in range(64)], 6400),
    "last near 2**32": ([2**32 - 1], 2**32),
    "above 2**32": ([5, 2**32 + 7, 2**33], 2**34),
    "max universe": ([0, 2**61, 2**62 - 1], 2**62),
    "large gap then run": ([0] + list(range(10**9, 10**9 + 50)), 2**31),
}


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("case", EDGE_CASES)
def test_edge_cases(name, case):
    indices, n = EDGE_CASES[case]
    data = round_trip(make(name), list(indices), n)
    if not len(indices):
        assert data == b""


def test_golden_streams():
    """Pin the formats: a change here is a format change."""
    indices = np.array([3, 17, 18, 60, 61, 90])
    assert make("golomb").encode(indices, 100).hex() == "0a6c11d619"
    assert make("runs").encode(np.arange(64, 192), 6400).hex() == "40000201400140"
    assert make("auto").encode(indices, 100)[0] == auto.TAGS.index("golomb")


# ------------------------------------------------------------------ sizes

def test_golomb_is_within_one_percent_of_the_bound():
    rng = np.random.default_rng(1)
    for n, k in [(100_000, 100), (100_000, 1_000), (100_000, 10_000), (100_000, 30_000)]:
        indices = np.sort(rng.choice(n, k, replace=False))
        bits = 8 * len(make("golomb").encode(indices, n)) / k
        assert bits <= 1.01 * dr.index_entropy_bits(n, k) + 32 / k


@pytest.mark.parametrize("name", ["golomb", "golomb-rice", "golomb-true", "runs"])
@SETTINGS
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1),
       kind=st.sampled_from(["uniform", "sparse", "runs", "blocks"]))
def test_size_formulas_are_exact(name, n, seed, kind):
    indices = random_set(np.random.default_rng(seed), n, kind)
    codec = make(name)
    assert codec.encoded_size(indices) == len(codec.encode(indices, n))


def test_huffman_estimate_is_close():
    rng = np.random.default_rng(2)
    indices = np.sort(rng.choice(2_000_000, 20_000, replace=False))
    codec = make("huffman")
    actual = 8 * len(codec.encode(indices, 2_000_000))
    assert abs(codec.encoded_bits(indices) - actual) < 0.01 * actual


def exact_sizes(indices, n):
    """Stream sizes of the codecs auto chooses from."""
    return {cid: len(cls().encode(indices, n))
            for cid, cls in registered_codecs("index").items() if cid in auto.TAGS}


@SETTINGS
@given(n=st.integers(1, 20_000), seed=st.integers(0, 2**32 - 1),
       kind=st.sampled_from(["uniform", "sparse", "runs", "blocks"]))
def test_auto_is_within_its_tag_of_the_best_codec_or_a_small_stream(n, seed, kind):
    indices = random_set(np.random.default_rng(seed), n, kind)[:auto.TRIAL_LIMIT]
    sizes = exact_sizes(indices, n)
    data = make("auto").encode(indices, n)
    # within a byte of the best, or a small stream written without trials: no larger
    # than the Golomb code's (the run code's on clustered sets)
    assert len(data) <= min(sizes.values()) + 1 or (
        2 * indices.size <= n and len(data) <= min(sizes["golomb"] + 1, auto.SMALL_STREAM)), sizes


def test_auto_writes_small_streams_without_trials():
    rng = np.random.default_rng(5)
    uniform = np.sort(rng.choice(4096, 41, replace=False))   # Top-1% of a bias
    rows = (np.sort(rng.choice(300, 6, replace=False))[:, None] * 64 + np.arange(64)).ravel()
    for indices, n, codec, limit in ((uniform, 4096, "golomb", auto.SMALL_STREAM),
                                     (rows, 300 * 64, "runs", 20)):
        data = make("auto").encode(indices, n)
        assert auto.TAGS[data[0]] == codec and len(data) < limit
        np.testing.assert_array_equal(make("auto").decode(data, n, indices.size), indices)


@pytest.mark.parametrize("kind", ["uniform", "runs", "blocks", "dense"])
def test_auto_estimates_pick_a_near_best_codec_on_large_sets(kind):
    rng = np.random.default_rng(3)
    n = 400_000
    if kind == "uniform":
        indices = np.sort(rng.choice(n, 4_000, replace=False))
    elif kind == "runs":
        starts = np.sort(rng.choice(n // 50, 300, replace=False)) * 50
        indices = np.unique((starts[:, None] + np.arange(20)).ravel())
    elif kind == "blocks":
        rows = np.sort(rng.choice(n // 64, 200, replace=False))
        indices = (rows[:, None] * 64 + np.arange(64)).ravel()
    else:
        indices = np.flatnonzero(rng.random(n) < 0.8)
    assert indices.size > auto.TRIAL_LIMIT
    best = min(exact_sizes(indices, n).values())
    data = make("auto").encode(indices, n)
    assert len(data) <= 1.005 * best + 4
    np.testing.assert_array_equal(make("auto").decode(data, n, indices.size), indices)


def test_auto_codes_the_complement_of_dense_sets():
    indices = np.delete(np.arange(10_000), [5, 600, 9_999])
    data = make("auto").encode(indices, 10_000)
    assert data[0] & auto.COMPLEMENT and len(data) < 10   # a bitmap would take 1,250
    np.testing.assert_array_equal(make("auto").decode(data, 10_000, indices.size), indices)
    for n in (50, 5000):  # by trials, and by estimates (above TRIAL_LIMIT)
        everything = make("auto").encode(np.arange(n), n)
        assert len(everything) == 1 and everything[0] & auto.COMPLEMENT
        np.testing.assert_array_equal(make("auto").decode(everything, n, n), np.arange(n))


def low_rank_top_k(rng, rows, cols, rank):
    """The support of the Top-1% of a rank-``rank`` matrix: rows and columns of large
    magnitude, whose gaps Huffman codes a little better than Golomb codes."""
    g = rng.standard_normal((rows, rank)) @ rng.standard_normal((rank, cols))
    k = g.size // 100
    return np.sort(np.argpartition(np.abs(g).ravel(), -k)[-k:])


def large_sets():
    rng = np.random.default_rng(8)
    n = 1 << 20
    starts = np.sort(rng.choice(n // 64, 2_000, replace=False)) * 64
    return {"uniform": (np.sort(rng.choice(n, 10_000, replace=False)), n),
            "low rank": (low_rank_top_k(rng, 1024, 1024, 8), n),
            "runs": (np.unique((starts[:, None] + np.arange(20)).ravel()), n),
            "dense": (np.flatnonzero(rng.random(n) < 0.9), n),
            "half": (np.flatnonzero(rng.random(n) < 0.5), n)}


@pytest.mark.parametrize("link_gbits", [0.1, 1, 10, 100])
@pytest.mark.parametrize("kind", sorted(large_sets()))
def test_auto_with_a_link_picks_the_cheapest_stream(kind, link_gbits):
    indices, n = large_sets()[kind]
    codec = auto.AutoIndices(link_gbits)
    run_count = int(np.count_nonzero(np.diff(indices) != 1)) + 1
    model = codec._cost_model(indices.size, run_count, n)
    data = codec.encode(indices, n)
    np.testing.assert_array_equal(codec.decode(data, n, indices.size), indices)
    candidates = {name: len(get_codec(name, family="index").encode(indices, n))
                  for name in auto.CODING_NS}
    costs = {name: model(auto.TAGS.index(name), size) for name, size in candidates.items()}
    chosen = model(data[0], len(data) - 1)
    # the model's best of the direct codes, or better (a complement), up to the estimates' slack
    assert chosen <= 1.03 * min(costs.values()), (auto.TAGS[data[0] & 0x7F], costs)
    # never smaller than plain auto's stream, never costlier by the model
    smallest = auto.AutoIndices().encode(indices, n)
    assert len(data) >= len(smallest)
    assert chosen <= model(smallest[0], len(smallest) - 1) * 1.001


def test_auto_trades_a_few_bytes_for_coding_time_on_fast_links():
    indices = low_rank_top_k(np.random.default_rng(9), 2048, 2048, 32)
    n = 2048 * 2048
    smallest, fast = (auto.AutoIndices(link).encode(indices, n) for link in (None, 10))
    assert auto.TAGS[smallest[0]] == "huffman" and auto.TAGS[fast[0]] == "golomb"
    assert len(smallest) < len(fast) < 1.05 * len(smallest)
    # at 100 Mbit/s clustered rows still go to the run code, the cheapest to send and code
    rows = (np.sort(np.random.default_rng(9).choice(4096, 40, replace=False))[:, None] * 1024
            + np.arange(1024)).ravel()
    assert auto.TAGS[auto.AutoIndices(0.1).encode(rows, 4096 * 1024)[0]] == "runs"


def test_auto_skips_the_lz_codecs_for_a_while_where_they_lost(monkeypatch):
    rng = np.random.default_rng(11)
    n = 1 << 20
    uniform = [np.sort(rng.choice(n, 5_000 + i, replace=False)) for i in range(2 * auto.RECHECK)]
    fresh = [auto.AutoIndices().encode(indices, n) for indices in uniform]
    checks = []
    original = auto.AutoIndices._lz_worth_trying
    monkeypatch.setattr(auto.AutoIndices, "_lz_worth_trying",
                        lambda self, *args: checks.append(1) or original(self, *args))
    codec = auto.AutoIndices().for_one_tensor()
    for indices, alone in zip(uniform, fresh):
        data = codec.encode(indices, n)
        assert data == alone  # LZ lost on these: skipping it changed nothing
        np.testing.assert_array_equal(codec.decode(data, n, indices.size), indices)
    assert len(checks) == 2  # at the first set, and again after RECHECK - 1 skips
    # a set of another size class is checked at once
    codec.encode(np.sort(rng.choice(n, 20_000, replace=False)), n)
    assert len(checks) == 3
    # a shared instance (one Pipeline for many tensors) remembers nothing
    shared = auto.AutoIndices()
    for indices in uniform[:3]:
        shared.encode(indices, n)
    assert len(checks) == 6


def test_auto_codes_a_tensors_next_sets_with_its_clear_winner(monkeypatch):
    rng = np.random.default_rng(13)
    n = 4096 * 64
    choices = []
    original = auto._golomb_stream  # (every full choice sizes the Golomb code first)
    monkeypatch.setattr(auto, "_golomb_stream",
                        lambda indices: choices.append(1) or original(indices))
    codec = auto.AutoIndices().for_one_tensor()
    for step in range(auto.RECHECK + 1):  # rows of 64 adjacent indices: runs, by far
        rows = np.sort(rng.choice(4096, 200 + step, replace=False))
        indices = (rows[:, None] * 64 + np.arange(64)).ravel()
        data = codec.encode(indices, n)
        assert data == auto.AutoIndices().encode(indices, n) and auto.TAGS[data[0]] == "runs"
        np.testing.assert_array_equal(codec.decode(data, n, indices.size), indices)
    fresh = auto.RECHECK + 1  # the fresh instances' choices
    assert len(choices) == fresh + 2  # the first set, then again after RECHECK - 1 sets
    # a winner by less than CLEAR_WIN (Golomb against Huffman on uniform sets) is not
    # remembered: every set is weighed
    uniform = auto.AutoIndices().for_one_tensor()
    choices.clear()
    for i in range(3):
        uniform.encode(np.sort(rng.choice(1 << 20, 5_000 + i, replace=False)), 1 << 20)
    assert len(choices) == 3
    with pytest.raises(ValueError, match="increasing"):  # a recalled code checks the order
        codec.encode(indices[::-1].copy(), n)
    assert len(choices) == 3
    # a set of another size class is weighed, and every set in a shared instance
    codec.encode(np.sort(rng.choice(n, 100, replace=False)), n)
    shared = auto.AutoIndices()
    shared.encode(indices, n)
    shared.encode(indices, n)
    assert len(choices) == 3 + 1 + 2


def test_the_exchange_gives_each_tensor_its_own_auto():
    from deepreduce.config import ExchangeConfig
    from deepreduce.exchange.selection import Selector
    selector = Selector(ExchangeConfig(sparsifier=dr.TopK(0.01), index="auto", value="fp16"))
    a, b = (selector.pipeline_of(name).index_codec for name in ("a", "b"))
    assert a is not b and a == b == selector.pipeline.index_codec
    assert a._memory is not None and selector.pipeline.index_codec._memory is None


def test_a_checkpoint_keeps_what_each_tensors_auto_remembers():
    from deepreduce.config import ExchangeConfig
    from deepreduce.exchange.selection import Selector
    rng = np.random.default_rng(14)
    n, k = 4096 * 64, 200 * 64
    clustered = np.zeros(n, np.float32)  # rows of 64 adjacent entries: runs, by far
    clustered[(np.sort(rng.choice(4096, 200, replace=False))[:, None] * 64
               + np.arange(64)).ravel()] = 1.0
    uniform = [np.zeros(n, np.float32) for _ in range(3)]
    for g in uniform:  # what a full choice codes with Golomb
        g[rng.choice(n, k, replace=False)] = 1.0
    config = ExchangeConfig(sparsifier=dr.TopK(k=k), index="auto", value="fp16", error_feedback=False)

    def payloads(selector, gradients):
        out = []
        for g in gradients:
            selection = selector.select("w", g)
            payload, received = selection.pipeline.encode_sparse(selection.selected,
                                                                 selection.dense)
            selector.settle(selection, received)
            out.append(payload)
        return out

    through = payloads(Selector(config), [clustered] + uniform)
    first = Selector(config)
    payloads(first, [clustered, uniform[0]])
    resumed = Selector(config)
    resumed.load_state_dict(first.state_dict())
    assert payloads(resumed, uniform[1:]) == through[2:]
    assert [dr.read_header(p).index_spec for p in through] == ["auto"] * 4
    # (a selector that forgot codes them otherwise: its first set gets a full choice)
    assert payloads(Selector(config), uniform[1:])[0] != through[2]


def test_auto_checks_the_lz_codecs_every_time_where_they_win():
    rng = np.random.default_rng(12)
    columns = np.sort(rng.choice(1024, 40, replace=False))  # the same columns in many rows
    codec = auto.AutoIndices().for_one_tensor()
    for step in range(auto.RECHECK + 2):
        rows = np.sort(rng.choice(4096, 300, replace=False))
        indices = (rows[:, None] * 1024 + columns).ravel()
        data = codec.encode(indices, 4096 * 1024)
        assert auto.TAGS[data[0]] in auto._LZ, step
        assert data == auto.AutoIndices().encode(indices, 4096 * 1024)


def test_auto_link_is_left_out_of_payload_headers():
    g = np.random.default_rng(10).standard_normal(100_000).astype(np.float32)
    pipe = dr.Pipeline(dr.TopK(0.01), index="auto:link_gbits=2.5")
    assert pipe.index_codec == auto.AutoIndices(link_gbits=2.5)
    assert "link_gbits=2.5" in repr(pipe)
    payload, received = pipe.encode(g)
    assert dr.read_header(payload).index_spec == "auto"
    assert dr.decompress(payload) == received


def test_runs_code_aligned_rows_in_units():
    rows = np.sort(np.random.default_rng(6).choice(1000, 50, replace=False))
    indices = (rows[:, None] * 64 + np.arange(64)).ravel()
    size = len(make("runs").encode(indices, 64_000))
    # About log2(1000 / 50) + 2 bits per row, whatever the row width.
    assert size < 50 * 7 / 8 + 8
    assert 20 * size < len(make("golomb").encode(indices, 64_000))


# ------------------------------------------------------------------ malformed streams

def decode_or_error(codec, data, n, nnz):
    """Decoding untrusted bytes: a valid result or DecodeError, nothing else."""
    try:
        result = codec.decode(data, n, nnz)
    except DecodeError:
        return None
    assert_valid(result, n, nnz)
    return result


@pytest.mark.parametrize("name", CODECS)
def test_every_truncation_raises(name):
    rng = np.random.default_rng(4)
    for n, indices in [(5000, np.sort(rng.choice(5000, 300, replace=False))),
                       (6400, np.arange(640, 1280)),
                       (2**40, np.array([1, 2**35, 2**40 - 1]))]:
        codec = make(name)
        data = codec.encode(indices, n)
        for cut in range(len(data)):
            with pytest.raises(DecodeError):
                codec.decode(data[:cut], n, indices.size)
        with pytest.raises(DecodeError):
            codec.decode(data + b"\0", n, indices.size)


@pytest.mark.parametrize("name", CODECS)
def test_wrong_counts_raise(name):
    rng = np.random.default_rng(5)
    n = 5000
    indices = np.sort(rng.choice(n, 200, replace=False))
    codec = make(name)
    data = codec.encode(indices, n)
    for nnz in (0, 1, 199, 201, 4000, n):
        with pytest.raises(DecodeError):
            codec.decode(data, n, nnz)
    for bad_n in (indices[-1], 100):
        with pytest.raises(DecodeError):
            codec.decode(data, int(bad_n), indices.size)
    for bad in (-1, n + 1):
        with pytest.raises(DecodeError):
            codec.decode(data, n, bad)
    assert decode_or_error(codec, data, 2 * n, indices.size) is not None


@pytest.mark.parametrize("name", CODECS)
@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(["uniform", "runs", "blocks"]))
def test_bit_flips_give_decode_error_or_a_valid_set(name, seed, kind):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 4000))
    indices = random_set(rng, n, kind)
    codec = make(name)
    data = bytearray(codec.encode(indices, n))
    if not data:
        return
    for _ in range(8):
        flipped = bytearray(data)
        position = int(rng.integers(0, 8 * len(data)))
        flipped[position // 8] ^= 1 << (position % 8)
        decode_or_error(codec, bytes(flipped), n, indices.size)


@pytest.mark.parametrize("name", CODECS)
@SETTINGS
@given(data=st.binary(max_size=40), n=st.integers(0, 2**40), nnz=st.integers(0, 300))
def test_random_bytes_never_raise_anything_but_decode_error(name, data, n, nnz):
    if nnz <= n:
        decode_or_error(make(name), data, n, nnz)


def test_truncated_unary_part_and_gaps_past_n():
    indices = np.array([10, 20, 30, 40])
    data = make("golomb").encode(indices, 100)
    with pytest.raises(DecodeError, match="terminators|cannot hold"):
        make("golomb").decode(data[:-1], 100, 4)
    with pytest.raises(DecodeError, match="past n"):
        make("golomb").decode(data, 40, 4)
    # A huge parameter in an otherwise plausible stream.
    with pytest.raises(DecodeError, match="parameter"):
        make("golomb").decode(b"\xff\xff\xff\x7f" + data[1:], 100, 4)


def test_auto_rejects_unknown_tags_and_misplaced_complements():
    with pytest.raises(DecodeError, match="tag"):
        make("auto").decode(bytes([len(auto.TAGS)]), 10, 1)
    with pytest.raises(DecodeError, match="complement"):
        make("auto").decode(bytes([auto.COMPLEMENT | 1]) + b"\x01\x80", 10, 2)
    with pytest.raises(DecodeError, match="empty"):
        make("auto").decode(b"", 10, 1)


def test_huffman_rejects_incomplete_code_tables():
    data = bytearray(make("huffman").encode(np.array([1, 5, 9, 30]), 100))
    data[2] = 0x11  # two codes of length 1 where the table had others
    decode_or_error(make("huffman"), bytes(data), 100, 4)
    with pytest.raises(DecodeError, match="prefix code"):
        make("huffman").decode(b"\x01\x01\x10", 100, 4)


# ------------------------------------------------------------------ arguments

def test_bad_arguments_raise_value_error():
    for spec in ({"id": "golomb", "mode": "fast"}, {"id": "huffman", "precision": 3},
                 {"id": "huffman", "block": 4}, {"id": "huffman", "block": 10_000},
                 {"id": "huffman", "precision": 1.5}, {"id": "huffman", "block": True},
                 {"id": "auto", "link_gbits": 0}, {"id": "auto", "link_gbits": -1.0},
                 {"id": "auto", "link_gbits": True}, {"id": "auto", "link_gbits": "fast"}):
        with pytest.raises(ValueError):
            get_codec(spec, family="index")
    for name in ("golomb", "huffman", "runs", "auto"):
        with pytest.raises(ValueError):
            make(name).encode(np.array([3, 2]), 10)
        with pytest.raises(ValueError):
            make(name).encode(np.array([10]), 10)


def test_specs_round_trip():
    for name in CODECS:
        codec = make(name)
        assert get_codec(codec.spec(), family="index") == codec


# ------------------------------------------------------------------ building blocks

@given(width=st.integers(0, 64), count=st.integers(0, 40), seed=st.integers(0, 2**32 - 1))
@SETTINGS
def test_fixed_width_packing_is_msb_first(width, count, seed):
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 2**63, count, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    values = values >> np.uint64(64 - width) if width else values * np.uint64(0)
    data = _bits.pack_fixed(values, width)
    text = "".join(format(int(v), f"0{width}b") for v in values) if width else ""
    text += "0" * (-len(text) % 8)
    assert data == bytes(int(text[i:i + 8], 2) for i in range(0, len(text), 8))
    np.testing.assert_array_equal(_bits.unpack_fixed(data, count, width, "t"), values)


@given(lengths=st.lists(st.integers(0, 64), max_size=40), seed=st.integers(0, 2**32 - 1))
@SETTINGS
def test_variable_width_packing_round_trips(lengths, seed):
    rng = np.random.default_rng(seed)
    lengths = np.array(lengths, dtype=np.int64)
    values = rng.integers(0, 2**63, lengths.size, dtype=np.uint64) * np.uint64(2)
    values = np.where(lengths > 0, values >> (64 - lengths).astype(np.uint64), 0)
    data, nbits = _entropy.pack_varlen(values, lengths)
    assert nbits == lengths.sum() and len(data) == -(-nbits // 8)
    text = "".join(format(int(v), f"0{n}b") for v, n in zip(values, lengths) if n)
    assert int.from_bytes(data, "big") >> (8 * len(data) - nbits) == int(text or "0", 2)
    np.testing.assert_array_equal(_entropy.unpack_varlen(data, lengths, "t"), values)


@given(counts=st.lists(st.integers(0, 10**6), min_size=1, max_size=200))
@SETTINGS
def test_huffman_lengths_form_a_complete_limited_code(counts):
    counts = np.array(counts)
    lengths = _entropy.huffman_lengths(counts)
    assert np.all((lengths > 0) == (counts > 0))
    assert lengths.max(initial=0) <= _entropy.MAX_CODE_LENGTH
    if np.count_nonzero(counts):
        assert _entropy.kraft_ok(lengths)
        peek, symbol_of, length_of = _entropy.decode_table(lengths)
        codes = _entropy.canonical_codes(lengths)
        for symbol in np.flatnonzero(lengths):
            word = int(codes[symbol]) << (peek - int(lengths[symbol]))
            assert symbol_of[word] == symbol and length_of[word] == lengths[symbol]


def test_huffman_lengths_are_optimal_for_dyadic_counts():
    assert _entropy.huffman_lengths(np.array([8, 4, 2, 1, 1])).tolist() == [1, 2, 3, 4, 4]


@pytest.mark.parametrize("precision", [0, 1, 2])
def test_buckets_cover_every_positive_int64(precision):
    values = np.concatenate([np.arange(1, 3000), 2 ** np.arange(1, 63) - 1,
                             2 ** np.arange(1, 63), 2 ** np.arange(1, 62) + 1])
    symbols, offset_bits = _entropy.bucket_symbols(values.astype(np.int64), precision)
    base, symbol_offset_bits = _entropy.bucket_base(precision)
    assert symbols.max() < _entropy.bucket_count(precision) <= 256
    np.testing.assert_array_equal(symbol_offset_bits[symbols], offset_bits)
    offsets = values - base[symbols]
    assert np.all(offsets >= 0) and not np.any(offsets >> offset_bits)


def test_golomb_parameter_is_the_best_for_geometric_sources():
    for mean in (0.0, 0.3, 1.0, 4.0, 9.0, 99.0, 999.0):
        best = min(range(1, 3000), key=lambda m: _entropy.golomb_expected_bits(mean, m))
        chosen = _entropy.golomb_parameter(mean)
        assert (_entropy.golomb_expected_bits(mean, chosen)
                <= _entropy.golomb_expected_bits(mean, best) + 1e-9)
    assert golomb.choose_parameter(99.0, "rice") == 64
    assert huffman.gap_values(np.array([2, 3, 9])).tolist() == [3, 1, 6]
    assert runs.common_unit(np.array([64, 256]), np.array([128, 64])) == 64


@given(width=st.integers(0, 40), groups=st.integers(0, 30), seed=st.integers(0, 2**32 - 1))
@SETTINGS
def test_bit_planes_round_trip_without_padding(width, groups, seed):
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 2**width, 8 * groups, dtype=np.uint64)
    data = _entropy.pack_planes(values, width)
    assert len(data) == groups * width
    np.testing.assert_array_equal(_entropy.unpack_planes(data, values.size, width), values)


@given(data=st.binary(max_size=300), offset=st.integers(0, 2500))
@SETTINGS
def test_set_bit_positions_match_unpackbits(data, offset):
    expected = np.flatnonzero(np.unpackbits(np.frombuffer(data, dtype=np.uint8))[offset:])
    np.testing.assert_array_equal(_entropy.set_bit_positions(data, offset), expected)
