"""GradientExchange run directly, without a framework: bundles encoded and decoded in
numpy, error feedback, stats, the reducing communicators and reduce_async on thread ranks
(ThreadTransport), random streams and state dicts."""

import doctest
import pickle
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import deepreduce as dr
from deepreduce.exchange import decoding, gathering, gradient_exchange, stats
from deepreduce.bundle import pack_bundle, split_bundles
from deepreduce.exchange import GradientExchange


def make_exchange(sparsifier=None, **settings):
    """A GradientExchange with these tests' baseline, every non-zero with raw values,
    unless they set otherwise (the library's defaults are Top-1% and fp16)."""
    settings.setdefault("value", "raw")
    return GradientExchange(sparsifier=sparsifier, **settings)


@pytest.mark.parametrize("module", [gradient_exchange, stats])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def gradients(seed, shapes=((100, 50), (10,), (300,))):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def test_lossless_sum_and_average_match_numpy():
    names = ["w", "b", "v"]
    ranks = [gradients(r) for r in range(3)]
    for average in (False, True):
        c = make_exchange(None, index="varint", min_size=50)
        data = b"".join(c.encode_bundle(names, g) for g in ranks)
        results = c.decode_bundles(data, ranks=3, rank=1, average=average)
        for i, result in enumerate(results):
            expected = ranks[0][i] + ranks[1][i] + ranks[2][i]
            if average:
                expected = (expected.astype(np.float64) * (1 / 3)).astype(np.float32)
            assert result.dtype == np.float32 and np.array_equal(result, expected)


SHARED_CASE = [((40, 30), np.float32), ((10,), np.float32), ((3, 4), np.float64),
               ((7,), np.float32), ((5,), np.float64), ((0,), np.float32), ((2, 3), np.float16)]


def shared_case_gradients(seed):
    rng = np.random.default_rng(seed)
    grads = [(rng.standard_normal(shape) * (rng.random(shape) < 0.7)).astype(dtype)
             for shape, dtype in SHARED_CASE]
    return grads + [dr.SparseTensor([1.5 + seed], [2 + seed], (6,))]


def test_small_dense_tensors_share_one_payload_per_dtype_and_sum_exactly():
    names = [f"t{i}" for i in range(len(SHARED_CASE) + 1)]
    ranks = [make_exchange(dr.TopK(0.05), index="golomb", min_size=100, seed=r)
             for r in range(3)]
    grads = [shared_case_gradients(r) for r in range(3)]
    bundles = [c.encode_bundle(names, g) for c, g in zip(ranks, grads)]
    read = split_bundles(bundles[0], 1)[0]
    # the Top-k tensor, the float32 ones, the float64 ones, float16 and the sparse input
    # alone: a group needs two tensors of a dtype, and a sparse input stays sparse
    assert read.slots == [0, 1, 2, 1, 2, 1, 3, 4] and len(read.payloads) == 5
    assert read.shapes == {1: (10,), 2: (3, 4), 3: (7,), 4: (5,), 5: (0,)}
    assert bundles[0][3] == 3   # version 3 only because of the sharing
    assert make_exchange(min_size=100).encode_bundle(names[:2], grads[0][:2])[3] == 1
    as_rows = [False] * len(names)
    as_rows[2] = True
    outputs = [None] * len(names)
    outputs[4] = np.full(5, np.nan)
    for rank in range(3):
        results = ranks[rank].decode_bundles(b"".join(bundles), ranks=3, rank=rank,
                                             as_rows=as_rows, out=outputs)
        for t in range(1, len(SHARED_CASE)):
            expected = grads[0][t] + grads[1][t] + grads[2][t]
            got = results[t]
            if as_rows[t]:
                values, rows = got
                got = np.zeros_like(expected)
                got[rows] = values
            assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes(), t
        assert np.shares_memory(results[4], outputs[4])
        assert results[-1].tolist() == [0, 0, 1.5, 2.5, 3.5, 0]
        assert ranks[rank].stats.last.tensors == len(names)


@pytest.mark.parametrize("value, payload_elements, summed_whole_below, slots", [
    ("fp16", 1 << 22, 1 << 16, [0, 0, 1, 0, 0, 2]), ("raw", 1 << 22, 1 << 16, [0, 0, 1, 0, 0, 2]),
    # consecutive tensors fill a payload up to PAYLOAD_ELEMENTS, then start the next
    ("fp16", 5000, 1 << 16, [0, 0, 1, 2, 2, 3]),
    # tensors from SUMMED_WHOLE_BELOW on share payloads apart from the smaller (here the
    # first is the only one that large: it travels alone)
    ("fp16", 1 << 22, 2500, [0, 1, 2, 1, 1, 3])])
def test_selections_sharing_a_payload_deliver_what_they_would_alone(
        value, payload_elements, summed_whole_below, slots, monkeypatch):
    # tensors from min_size up to SHARED_BELOW elements share payloads of their
    # selections; each delivers what coding it alone would, so the sums and the
    # residuals are the same bits
    monkeypatch.setattr(gathering, "SHARED_BELOW", 1 << 13)
    monkeypatch.setattr(gathering, "PAYLOAD_ELEMENTS", payload_elements)
    monkeypatch.setattr(gathering, "SUMMED_WHOLE_BELOW", summed_whole_below)
    shapes = [(60, 50), (300,), (1 << 13,), (50, 40), (2000,), (5,)]
    names = ["a", "b", "big", "c", "d", "tiny"]

    def ranks():
        return [make_exchange(dr.TopK(0.05), index="auto", value=value, min_size=200,
                                 seed=r) for r in range(2)]

    shared, alone = ranks(), ranks()
    for step in range(3):
        grads = [gradients(10 * step + r, shapes) for r in range(2)]
        bundles = [c.encode_bundle(names, g) for c, g in zip(shared, grads)]
        assert split_bundles(bundles[0], 1)[0].slots == slots
        separate = [pack_bundle([c.encode_tensor(x, name)[0] for name, x in zip(names, g)])
                    for c, g in zip(alone, grads)]
        for got, want in zip(shared[0].decode_bundles(b"".join(bundles), 2, 0),
                             alone[0].decode_bundles(b"".join(separate), 2, 0)):
            assert got.tobytes() == want.tobytes()
        for name in names[:5]:
            assert shared[1].selector.memory.residual(name).tobytes() == \
                alone[1].selector.memory.residual(name).tobytes()
    assert sum(map(len, bundles)) < sum(map(len, separate))


@pytest.mark.parametrize("index, value", [("auto", "qsgd"), ("bloom:fpr=0.01", "fp16")])
def test_selections_do_not_share_when_coding_them_together_would_change_them(index, value):
    # QSGD's buckets and random rounding, a Bloom filter's false positives: coding a
    # tensor with others would deliver something else than coding it alone
    c = make_exchange(dr.TopK(0.05), index=index, value=value, min_size=200)
    bundle = c.encode_bundle(["a", "b", "c"], gradients(0, [(60, 50), (300,), (50, 40)]))
    assert split_bundles(bundle, 1)[0].slots == [0, 1, 2] and bundle[3] == 1


def test_encode_times_a_step_of_shared_selections_in_seconds():
    # (a bug once reported the clock's reading instead: the payloads' parts reused
    # the name of the encode's start time)
    c = make_exchange(dr.TopK(0.05), index="golomb", value="fp16", min_size=200)
    begin = time.perf_counter()
    bundle = c.encode_bundle(["a", "b"], gradients(0, [(60, 50), (300,)]))
    elapsed = time.perf_counter() - begin
    assert split_bundles(bundle, 1)[0].slots == [0, 0]
    c.decode_bundles(bundle, ranks=1, rank=0)
    assert 0 < c.stats.last.encode_seconds <= elapsed
    assert 0 < c.stats.last.codec_seconds <= c.stats.last.encode_seconds \
        + c.stats.last.decode_seconds


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("into_out", [False, True])
def test_shared_payloads_reduce_to_the_bits_of_separate_ones(average, into_out):
    # a payload shared alike by every rank is summed whole, its tensors are views of
    # (or copies from) that sum: the same bits as summing them one by one
    names = [f"t{i}" for i in range(len(SHARED_CASE) + 2)]
    grads = [shared_case_gradients(r) + [np.full((2, 2), r + 0.5, np.float16)]
             for r in range(3)]
    ranks = [make_exchange(None, index="golomb", min_size=100) for _ in range(3)]
    shared = b"".join(c.encode_bundle(names, g) for c, g in zip(ranks, grads))
    alone = make_exchange(None, index="golomb", min_size=100)
    separate = b"".join(pack_bundle([alone.encode_tensor(x)[0] for x in g])
                        for g in grads)

    def outputs():
        return [np.full(np.shape(x), np.nan, np.asarray(x).dtype)
                if into_out and not isinstance(x, dr.SparseTensor) else None for x in grads[0]]

    for rank in range(3):
        kept = outputs()
        got = ranks[rank].decode_bundles(shared, 3, rank, average, out=kept)
        want = make_exchange(None).decode_bundles(separate, 3, rank, average,
                                                     out=outputs())
        for t, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), t
            assert kept[t] is None or a.size == 0 or np.shares_memory(a, kept[t])


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.sampled_from([0, 1, 7, 60, 150, 999, 2500]), min_size=1, max_size=7),
       dtypes=st.lists(st.sampled_from([np.float16, np.float32, np.float64]), min_size=7,
                       max_size=7),
       ranks=st.integers(1, 3), average=st.booleans(), seed=st.integers(0, 2**16))
def test_any_mix_of_shared_payloads_reduces_to_the_bits_of_separate_ones(
        sizes, dtypes, ranks, average, seed):
    names = [f"t{i}" for i in range(len(sizes))]

    def make():
        return [make_exchange(dr.TopK(0.1), index="golomb", value="fp16", min_size=100,
                                 seed=r) for r in range(ranks)]

    shared, alone = make(), make()
    for step in range(2):  # the second step runs on residuals and reused sums
        rng = np.random.default_rng([seed, step])
        grads = [[rng.standard_normal(n).astype(dtype) for n, dtype in zip(sizes, dtypes)]
                 for _ in range(ranks)]
        together = b"".join(c.encode_bundle(names, g) for c, g in zip(shared, grads))
        separate = b"".join(pack_bundle([c.encode_tensor(x, name)[0]
                                         for name, x in zip(names, g)])
                            for c, g in zip(alone, grads))
        for rank in range(ranks):
            got = shared[rank].decode_bundles(together, ranks, rank, average)
            want = alone[rank].decode_bundles(separate, ranks, rank, average)
            for a, b in zip(got, want):
                assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_bundles_of_either_version_reduce_together():
    # a rank whose writer gives every tensor its own payload (version 1, as before
    # payloads were shared) and ranks that share them reduce to the same bits
    names = [f"t{i}" for i in range(len(SHARED_CASE) + 1)]
    c = make_exchange(None, index="golomb", min_size=100)
    grads = [shared_case_gradients(r) for r in range(2)]
    shared = [c.encode_bundle(names, g) for g in grads]
    separate = pack_bundle([c.encode_tensor(x)[0] for x in grads[1]])
    assert separate[3] == 1 and shared[1][3] == 3
    for got, want in zip(make_exchange(None).decode_bundles(shared[0] + separate, 2, 0),
                         make_exchange(None).decode_bundles(b"".join(shared), 2, 0)):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


def test_a_shared_payload_must_hold_exactly_its_tensors():
    payload = dr.compress(np.arange(6, dtype=np.float32), None, "bitmap", "raw")
    for shapes in ([(2,), (3,)], [(2,), (2, 3)]):
        bundle = pack_bundle([payload], [0, 0], shapes)
        with pytest.raises(dr.DecodeError, match="does not hold its tensors' 5|8 elements"):
            make_exchange(None).decode_bundles(bundle, ranks=1, rank=0)
    matrix = dr.compress(np.ones((2, 3), np.float32), None, "bitmap", "raw")
    with pytest.raises(dr.DecodeError, match=r"shape \(2, 3\) does not hold"):
        make_exchange(None).decode_bundles(pack_bundle([matrix], [0, 0], [(3,), (3,)]), 1, 0)
    parts = make_exchange(None).decode_bundles(pack_bundle([payload], [0, 0], [(2,), (4,)]),
                                                 ranks=1, rank=0)
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3, 4, 5]]


def test_error_feedback_is_exact_and_small_tensors_are_lossless():
    c = make_exchange(dr.TopK(0.05), index="varint", value="fp16", min_size=20)
    names = ["w", "b", "v"]
    previous = {n: 0.0 for n in names}
    for step in range(4):
        grads = gradients(step)
        bundle = c.encode_bundle(names, grads)
        read = split_bundles(bundle, 1)[0]
        assert read.slots == [0, 1, 0]  # w and v share a payload
        parts = read.tensors([dr.decompress(p) for p in read.payloads])
        for name, g, part in zip(names, grads, parts):
            received = part.to_dense()
            compensated = g + previous[name]
            if g.size < 20:
                assert np.array_equal(received, g) and c.selector.memory.residual(name) is None
                continue
            residual = c.selector.memory.residual(name)
            # what was delivered plus what is kept is exactly what was to be sent
            assert np.array_equal(received + residual, compensated)
            assert np.count_nonzero(received) == int(np.ceil(0.05 * g.size))
            previous[name] = residual.copy()  # feedback updates the residual in place
    assert c.stats.total.steps == 0 and c.stats.last.bytes_sent == 0  # no decode yet
    c.decode_bundles(bundle, ranks=1, rank=0)
    assert c.stats.total.steps == 1 and c.stats.last.bytes_sent == len(bundle)
    assert c.stats.last.dense_bytes == 4 * (5000 + 10 + 300) and c.stats.last.ratio > 5


def test_error_feedback_is_a_decay_or_off():
    assert make_exchange(dr.TopK(1), index="varint", error_feedback=False).selector.memory is None
    assert make_exchange(index="varint", error_feedback=None).selector.memory is None
    assert make_exchange(index="varint", error_feedback=True).selector.memory.beta == 1.0
    c = make_exchange(dr.TopK(1), index="varint", error_feedback=0.5, min_size=0)
    assert c.config.error_feedback == 0.5 and c.selector.memory.beta == 0.5
    c.encode_bundle(["x"], [np.array([1.0, 3.0], np.float32)])
    assert np.array_equal(c.selector.memory.residual("x"), [1.0, 0.0])
    assert np.array_equal(c.selector.memory.accumulate("x", np.zeros(2, np.float32)), [0.5, 0])
    for wrong in (1.5, -0.1, "residual", dr.ResidualMemory()):
        with pytest.raises(ValueError, match="error_feedback must be a decay in"):
            make_exchange(error_feedback=wrong)


def test_sparse_inputs_reduce_to_rows():
    shape = (6, 3)
    a = dr.SparseTensor.from_pairs(np.ones(6, np.float32), [0, 1, 2, 12, 13, 14], shape)
    b = dr.SparseTensor.from_pairs(np.full(3, 2, np.float32), [12, 13, 14], shape)
    c = make_exchange(None, index="varint", min_size=0)
    data = c.encode_bundle(["e"], [a]) + c.encode_bundle(["e"], [b])
    (values, rows), = c.decode_bundles(data, ranks=2, rank=0, as_rows=[True])
    assert rows.tolist() == [0, 4]
    assert np.array_equal(values, [[1, 1, 1], [3, 3, 3]]) and values.dtype == np.float32
    (dense,) = c.decode_bundles(data, ranks=2, rank=0, average=True)
    assert np.array_equal(dense, (a.to_dense() + b.to_dense()) / 2)


def test_sparse_input_with_error_feedback_stays_sparse_selection():
    c = make_exchange(dr.TopK(2), index="varint", min_size=0)
    st1 = dr.SparseTensor([5.0, -1.0, 0.5], [3, 10, 40], (50,))
    payload, received = c.encode_tensor(st1, "e")
    assert received.indices.tolist() == [3, 10]
    # the residual (0.5 at 40) joins the next sparse gradient's entries
    payload, received = c.encode_tensor(dr.SparseTensor([0.25], [41], (50,)), "e")
    assert received.indices.tolist() == [40, 41]
    assert np.count_nonzero(c.selector.memory.residual("e")) == 0


@pytest.mark.parametrize("value", ["fp16", "qsgd"])
def test_own_bundle_is_not_decoded_again_and_gives_the_same_sums(value):
    names, shapes = ["w", "b"], ((200, 30), (500,))
    ranks = [make_exchange(dr.TopK(0.1), index="auto", value=value, seed=r)
             for r in range(2)]
    for step in range(3):
        bundles = [c.encode_bundle(names, gradients(10 * step + r, shapes))
                   for r, c in enumerate(ranks)]
        data = b"".join(bundles)
        # rank 0 last encoded bundles[0]: it reuses what its encoder returned; a fresh
        # object has nothing to reuse and decodes every bundle
        fresh = make_exchange(dr.TopK(0.1), index="auto", value=value)
        for got, expected in zip(ranks[0].decode_bundles(data, ranks=2, rank=0),
                                 fresh.decode_bundles(data, ranks=2, rank=0)):
            np.testing.assert_array_equal(got, expected)


def test_bundles_of_several_groups_decode_as_one_and_count_one_step(monkeypatch):
    names, shapes = ["w", "b", "v"], ((200, 30), (500,), (64, 64))
    one, grouped = ([make_exchange(dr.TopK(0.1), index="auto", value="fp16", seed=r)
                     for r in range(2)] for _ in range(2))
    decoded = []
    monkeypatch.setattr(decoding, "decode", lambda payload: decoded.append(1) or
                        dr.decompress(payload))
    for step in range(3):
        grads = [gradients(10 * step + r, shapes) for r in range(2)]
        data = b"".join(c.encode_bundle(names, g) for c, g in zip(one, grads))
        # the second group first, as a graph may run the two encodes
        second = [c.encode_bundle(names[2:], g[2:], group=1) for c, g in zip(grouped, grads)]
        first = [c.encode_bundle(names[:2], g[:2], group=0) for c, g in zip(grouped, grads)]
        expected = one[0].decode_bundles(data, ranks=2, rank=0)
        decoded.clear()
        got = grouped[0].decode_groups([b"".join(first), b"".join(second)], ranks=2, rank=0)
        assert len(decoded) == 3  # rank 1's payloads only: rank 0 reuses what it encoded
        for a, b in zip(got, expected):
            assert a.tobytes() == b.tobytes()
        last = grouped[0].stats.last
        assert grouped[0].stats.total.steps == step + 1 and last.tensors == 3
        assert last.bytes_sent == len(first[0]) + len(second[0])


def address(array) -> int:
    return array.__array_interface__["data"][0]


@pytest.mark.parametrize("dtype, average", [(np.float32, False), (np.float32, True),
                                            (np.float64, True), (np.float16, False)])
def test_dense_sums_reuse_memory_only_when_nobody_holds_them(dtype, average):
    names, shapes = ["w", "b"], ((120, 40), (700,))
    c = make_exchange(dr.TopK(0.05), index="golomb", value="raw", min_size=0)

    def step(seed):
        bundles = [c.encode_bundle(names, [g.astype(dtype) for g in gradients(seed + r, shapes)])
                   for r in range(2)]
        data = b"".join(bundles)
        fresh = make_exchange(dr.TopK(0.05), index="golomb", min_size=0)
        return c.decode_bundles(data, ranks=2, rank=1, average=average), \
            fresh.decode_bundles(data, ranks=2, rank=1, average=average)

    first, expected = step(0)
    if dtype != np.float16:  # float16 is summed in float32 and cast at the end
        assert all(address(r) % dr.sparse.ALIGNMENT == 0 for r in first)
    first_addresses = [address(r) for r in first]
    del first
    # nobody holds last step's sums: they are rewritten in place (for float32 and
    # float64, which are summed in their own type), with last step's entries reset
    second, expected = step(10)
    for got, want in zip(second, expected):
        np.testing.assert_array_equal(got, want)
    if dtype != np.float16:
        assert [address(r) for r in second] == first_addresses
    # sums still held, whole or by a view, are never written to
    kept, kept_view = [r.copy() for r in second], second[1][5:9]
    third, expected = step(20)
    for got, want, old, held in zip(third, expected, kept, second):
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(held, old)
        assert not np.shares_memory(got, held)
    del second
    fourth, expected = step(30)
    np.testing.assert_array_equal(kept_view, kept[1][5:9])
    assert not np.shares_memory(fourth[1], kept_view)
    assert not np.shares_memory(fourth[0], third[0])  # third is still held here
    for got, want in zip(fourth, expected):
        np.testing.assert_array_equal(got, want)


def test_mismatched_ranks_raise_decode_error():
    c = make_exchange(None, index="varint")
    one = c.encode_bundle(["a"], [np.ones(3, np.float32)])
    two = c.encode_bundle(["a", "b"], [np.ones(3, np.float32), np.ones(2, np.float32)])
    with pytest.raises(dr.DecodeError, match="same gradients"):
        c.decode_bundles(one + two, ranks=2, rank=0)
    other_shape = c.encode_bundle(["a"], [np.ones(4, np.float32)])
    with pytest.raises(dr.DecodeError, match="rank 1 sent"):
        c.decode_bundles(one + other_shape, ranks=2, rank=0)
    corrupt = bytearray(one)
    corrupt[-1] ^= 1
    with pytest.raises(dr.DecodeError, match="CRC"):
        c.decode_bundles(bytes(corrupt), ranks=1, rank=0)


def test_seed_reaches_specs_and_makes_runs_reproducible():
    g = [np.random.default_rng(0).standard_normal(5000).astype(np.float32)]

    def bundles(**kwargs):
        c = make_exchange(index="varint", error_feedback=False, **kwargs)
        return [c.encode_bundle(["g"], g) for _ in range(3)]

    assert bundles(sparsifier="randomk:0.01", seed=3) == bundles(sparsifier="randomk:0.01",
                                                                 seed=3)
    assert bundles(sparsifier="randomk:0.01", seed=3) != bundles(sparsifier="randomk:0.01",
                                                                 seed=4)
    # a seed in the spec wins over the Compression's
    assert bundles(sparsifier="randomk:0.01,seed=9", seed=3) == \
        bundles(sparsifier="randomk:0.01,seed=9", seed=4)
    assert make_exchange("randomk:0.01", index="varint", seed=5).selector.pipeline.sparsifier.seed == 5


def test_curve_fit_values_take_the_default_index():
    c = make_exchange(dr.TopK(0.05), value="polyfit", error_feedback=False)
    g = gradients(0)
    data = c.encode_bundle(["w", "b", "v"], g)
    w, b, v = c.decode_bundles(data, ranks=1, rank=0)
    assert np.count_nonzero(w) == 250 and np.array_equal(b, g[1])
    with pytest.raises(ValueError, match="sorts the values"):
        make_exchange(value="polyfit", index="varint")


def test_front_ends_take_settings_by_name_only():
    with pytest.raises(TypeError):
        GradientExchange(dr.TopK(0.01))
    with pytest.raises(TypeError, match="memory"):
        make_exchange(memory=None)     # (0.1's name of error_feedback)
    with pytest.raises(ValueError, match="not both"):
        GradientExchange(config=dr.ExchangeConfig(), value="raw")


@pytest.mark.parametrize("kwargs", [{"min_size": -1}, {"min_size": 1.5},
                                    {"error_feedback": "yes"},
                                    {"seed": "0"}, {"sparsifier": "nosuch"},
                                    {"value": "nosuch"}])
def test_bad_arguments_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        make_exchange(**{"index": "varint", **kwargs})


def test_stats_counters():
    s = stats.CompressionStats()
    s.record_encode(tensors=2, compressed_tensors=1, bytes_sent=100, dense_bytes=1000,
                    seconds=0.5)
    s.record_decode(bytes_received=200, seconds=0.25)
    before = s.snapshot()
    s.record_encode(tensors=2, compressed_tensors=1, bytes_sent=300, dense_bytes=1000,
                    seconds=0.5)
    s.record_decode(bytes_received=600, seconds=0.25, codec_seconds=0.125)
    epoch = (s.snapshot() - before).per_step()
    assert epoch["bytes_sent"] == 300 and epoch["decode_ms"] == 250 and epoch["codec_ms"] == 125
    assert s.total.steps == 2 and s.total.ratio == 5.0 and s.last.bytes_received == 600
    d = s.as_dict()
    assert d["steps"] == 2 and d["bytes_sent"] == 300 and d["total_bytes_sent"] == 400
    s.reset()
    assert s.total.steps == 0


def test_codec_time_is_the_part_of_encode_and_decode_inside_the_codecs():
    names, shapes = ["w", "b"], ((300, 200), (50,))
    for index in ("raw", "huffman"):
        c = make_exchange(dr.TopK(0.05), index=index, value="fp16")
        bundle = c.encode_bundle(names, gradients(0, shapes))
        c.decode_bundles(bundle + bundle, ranks=2, rank=0)  # rank 1's bundle is decoded
        last = c.stats.last
        assert 0 < last.codec_seconds < last.encode_seconds + last.decode_seconds


# ------------------------------------------- reducing communicators, thread ranks

COMMUNICATOR_SETTINGS = [("sparse_allreduce", None),
                         ("sparse_allreduce", {"algorithm": "recursive_doubling"}),
                         ("block", {"block_size": 16})]


def on_threads(size, fn):
    """Run ``fn(member)`` for the ``size`` members of a thread group; results in rank order."""
    from deepreduce.collectives import ThreadTransport

    with ThreadPoolExecutor(size) as pool:
        return list(pool.map(fn, ThreadTransport.group(size, timeout=30)))


def integer_gradients(rank, shapes=((60, 50), (10,), (300,)), density=0.2):
    """Sparse integer-valued float32 gradients: their sums are exact in any order."""
    rng = np.random.default_rng([rank, 5])
    grads = []
    for shape in shapes:
        g = rng.integers(-9, 10, shape).astype(np.float32)
        g[rng.random(shape) > density] = 0
        grads.append(g)
    return grads


@pytest.mark.parametrize("communicator, options", COMMUNICATOR_SETTINGS)
@pytest.mark.parametrize("op", ["sum", "average"])
def test_reducing_communicators_match_numpy(communicator, options, op):
    names, size = ["w", "b", "v", "d"], 4
    inputs = [integer_gradients(r) + [np.full((5, 4), r + 1.0)] for r in range(size)]
    # float64 "d" travels in its own set of collectives; "b" and "d" are below min_size
    compressions = [make_exchange(None, index="varint", min_size=100,
                                        communicator=communicator,
                                        communicator_options=options) for _ in range(size)]

    def rank_main(member):
        return compressions[member.rank].reduce_async(names, inputs[member.rank], member,
                                                      op).result()[0]

    for results in on_threads(size, rank_main):
        for i, result in enumerate(results):
            expected = sum(x[i] for x in inputs)
            if op == "average":
                expected = expected / size
            assert result.dtype == inputs[0][i].dtype and np.array_equal(result, expected)
    last = compressions[0].stats.last
    assert last.tensors == 4 and last.compressed_tensors == 2
    assert last.dense_bytes == 4 * (3000 + 10 + 300) + 8 * 20
    assert last.bytes_sent > 0 and last.bytes_received > 0


@pytest.mark.parametrize("communicator, options", COMMUNICATOR_SETTINGS)
def test_reducing_communicators_feed_back_exactly(communicator, options):
    """Residual = corrected input - sent; small tensors exact despite fp16 values."""
    names, size, steps = ["w", "b", "v"], 2, 3
    compressions = [make_exchange(dr.TopK(0.05), index="varint", value="fp16",
                                        min_size=20, communicator=communicator,
                                        communicator_options=options) for _ in range(size)]
    grads = [[gradients(10 * step + r) for step in range(steps)] for r in range(size)]
    previous = [{n: 0.0 for n in names} for _ in range(size)]

    def rank_main(member):
        r, c = member.rank, compressions[member.rank]
        outputs = []
        for step in range(steps):
            corrected = [g + previous[r][n] for n, g in zip(names, grads[r][step])]
            outputs.append(c.reduce_async(names, grads[r][step], member).result()[0])
            for name, x in zip(names, corrected):
                residual = c.selector.memory.residual(name)
                if x.size < 20:
                    assert residual is None
                    continue
                sent = (x - residual).ravel()
                # what counted of this rank's input is its top 5%, in fp16 where it
                # was encoded (a rank's own range or blocks are used as they are)
                kept, exact = np.flatnonzero(sent), x.ravel()
                assert kept.size <= int(np.ceil(0.05 * x.size))
                assert np.abs(exact[kept]).min() >= np.sort(np.abs(exact))[-kept.size]
                rounded = exact.astype(np.float16).astype(np.float32)
                assert np.all((sent[kept] == exact[kept]) | (sent[kept] == rounded[kept]))
                previous[r][name] = residual
        return outputs

    per_rank = on_threads(size, rank_main)
    for step in range(steps):
        bias = per_rank[0][step][1]
        assert np.array_equal(bias, grads[0][step][1] + grads[1][step][1])
        for i in range(3):
            assert np.array_equal(per_rank[0][step][i], per_rank[1][step][i])


def test_block_threshold_spares_small_tensors():
    c = [make_exchange(None, index="varint", min_size=8, communicator="block",
                             communicator_options={"block_size": 4, "threshold": 0.5})
         for _ in range(2)]
    small = np.array([0.25, 0, 0, 0.25], np.float32)
    large = np.array([0.25, 0, 0, 0, 3, 0, 0, 0], np.float32)

    def rank_main(member):
        return c[member.rank].reduce_async(["s", "l"], [small, large], member).result()[0]

    reduced_small, reduced_large = on_threads(2, rank_main)[0]
    assert np.array_equal(reduced_small, 2 * small)      # below min_size: no threshold
    assert np.array_equal(reduced_large, [0, 0, 0, 0, 6, 0, 0, 0])  # first block left behind
    assert np.array_equal(c[0].selector.memory.residual("l"), [0.25, 0, 0, 0, 0, 0, 0, 0])


def test_reducing_communicators_reduce_sparse_inputs_to_rows():
    shape = (6, 3)
    a = dr.SparseTensor.from_pairs(np.ones(6, np.float32), [0, 1, 2, 12, 13, 14], shape)
    b = dr.SparseTensor.from_pairs(np.full(3, -1, np.float32), [12, 13, 14], shape)
    c = [make_exchange(None, index="varint", min_size=0,
                             communicator="sparse_allreduce") for _ in range(2)]

    def rank_main(member):
        return c[member.rank].reduce_async(["e"], [(a, b)[member.rank]], member,
                                           as_rows=[True]).result()[0]

    (values, rows), = on_threads(2, rank_main)[1]
    assert rows.tolist() == [0] and np.array_equal(values, [[1, 1, 1]])  # row 4 sums to 0


def test_a_failing_rank_fails_every_rank():
    c = [make_exchange(None, index="varint", communicator="sparse_allreduce")
         for _ in range(2)]

    def rank_main(member):
        x = np.ones(3 + member.rank, np.float32)       # shapes disagree
        try:
            c[member.rank].reduce_async(["x"], [x], member).result()
        except ValueError as exc:
            return str(exc)

    assert all("disagree" in message for message in on_threads(2, rank_main))
    assert c[0].stats.total.steps == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"communicator": "ring"}, "communicator must be"),
    ({"communicator_options": {"block_size": 4}}, "takes no options"),
    ({"communicator": "block", "communicator_options": {"algorithm": "split"}},
     "block_size, threshold"),
    ({"communicator": "sparse_allreduce", "communicator_options": {"op": "sum"}},
     "arguments of each reduction"),
    ({"communicator": "block", "communicator_options": {"block_size": 0}}, "block_size"),
    ({"communicator": "block", "index": "bloom"}, "lossy"),
    ({"communicator": "sparse_allreduce", "communicator_options": {"algorithm": "ring"}},
     "algorithm"),
])
def test_bad_communicator_settings_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_exchange(**{"index": "varint", **kwargs})


def test_reduce_async_over_a_transport_fails_on_every_rank_instead_of_hanging():
    from concurrent.futures import ThreadPoolExecutor
    from deepreduce.collectives import ThreadTransport
    from deepreduce.collectives.frames import PeerError

    exchanges = [make_exchange(dr.TopK(0.5), min_size=0) for _ in range(2)]

    def rank_main(member):
        grad = np.arange(8, dtype=np.float32) if member.rank == 0 else np.array(["x"] * 8)
        future = exchanges[member.rank].reduce_async(["w"], [grad], member)
        try:
            future.result(timeout=60)
        except Exception as exc:  # noqa: BLE001 - the finding
            return type(exc), str(exc)
        return None, ""

    with ThreadPoolExecutor(2) as pool:
        (kind0, message0), (kind1, message1) = pool.map(rank_main, ThreadTransport.group(2))
    assert kind0 is PeerError and "rank 1" in message0
    assert kind1 is not None and kind1 is not PeerError


@pytest.mark.parametrize("average", [False, True])
@pytest.mark.parametrize("shapes, summed_whole_below", [
    (((200, 30), (500,)), None),
    (((200, 30), (500,), (40, 50), (300,)), None),   # (sharing, the payload summed whole)
    (((200, 30), (500,), (40, 50), (300,)), 1000)])  # (sharing, summed tensor by tensor)
def test_reduce_async_reusing_out_resets_only_what_it_wrote(
        average, shapes, summed_whole_below, monkeypatch):
    from deepreduce.collectives import ThreadTransport

    if summed_whole_below is not None:
        monkeypatch.setattr(gathering, "SUMMED_WHOLE_BELOW", summed_whole_below)
    names = [f"t{i}" for i in range(len(shapes))]
    reused, fresh = ([make_exchange(dr.TopK(0.05), index="auto", value="fp16", seed=r)
                      for r in range(2)] for _ in range(2))
    kept = [[np.empty(shape, np.float32) for shape in shapes] for _ in range(2)]
    op = "average" if average else "sum"

    def rank_main(member, step):
        grads = gradients(10 * step + member.rank, shapes)
        mine = reused[member.rank].reduce_async(names, [g.copy() for g in grads], member, op,
                                                out=kept[member.rank], reuse_out=True)
        return mine.result(timeout=60)[0]

    def reference_main(member, step):
        grads = gradients(10 * step + member.rank, shapes)
        return fresh[member.rank].reduce_async(names, grads, member, op).result(timeout=60)[0]

    for step in range(4):  # Top-k's support moves: last step's positions must go back to 0
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(rank_main, ThreadTransport.group(2), [step] * 2))
            expected = list(pool.map(reference_main, ThreadTransport.group(2), [step] * 2))
        for rank in range(2):
            for out, result, reference in zip(kept[rank], got[rank], expected[rank]):
                assert np.shares_memory(result, out) and out.tobytes() == reference.tobytes()
    # a selection summed on its own keeps which positions it wrote; one copied whole, none
    written = reused[0]._allgather.written_positions("t0", kept[0][0])
    assert (written is None) == (summed_whole_below is None and len(shapes) > 2)
    # another array under the same name was never written by the exchange: reset whole
    other = [np.full(shape, np.nan, np.float32) for shape in shapes]
    kept[0], kept[1] = other, [np.full(shape, np.nan, np.float32) for shape in shapes]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(rank_main, ThreadTransport.group(2), [9] * 2))
        expected = list(pool.map(reference_main, ThreadTransport.group(2), [9] * 2))
    assert all(a.tobytes() == b.tobytes() for a, b in zip(got[0], expected[0]))


@pytest.mark.parametrize("settings", [{"sparsifier": "randomk:0.05"},
                                      {"sparsifier": dr.TopK(0.05), "value": "qsgd:bits=4"}])
def test_random_streams_are_per_tensor_and_checkpointable(settings):
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal(3000).astype(np.float32) for _ in range(2))

    def payloads(exchange, names, tensors):
        """What each tensor delivers (tensors may share a payload)."""
        read = split_bundles(exchange.encode_bundle(names, tensors), 1)[0]
        parts = read.tensors([dr.decompress(p) for p in read.payloads])
        return {name: (p.indices.tobytes(), p.values.tobytes()) for name, p in zip(names, parts)}

    one, other = (make_exchange(index="varint", error_feedback=False, **settings) for _ in range(2))
    first = payloads(one, ["a", "b"], [a, b])
    # the other order draws the same for each tensor: streams do not depend on call order
    assert payloads(other, ["b", "a"], [b, a]) == first
    state = one.selector.random_state()
    assert state and all(key.split("/")[0] in ("a", "b") for key in state)
    later = payloads(one, ["a", "b"], [a, b])
    assert later != first                          # the streams moved on
    restored = make_exchange(index="varint", error_feedback=False, **settings)
    restored.selector.set_random_state(state)
    assert payloads(restored, ["a", "b"], [a, b]) == later


def test_exchange_state_dict_continues_exactly():
    rng = np.random.default_rng(2)
    grads = [rng.standard_normal(4000).astype(np.float32) for _ in range(4)]

    def run(exchange, steps):
        return [exchange.encode_bundle(["w"], [g]) for g in steps]

    settings = dict(sparsifier=dr.TopK(0.02), value="qsgd:bits=4", min_size=0)
    through = make_exchange(**settings)
    uninterrupted = run(through, grads)
    first = make_exchange(**settings)
    run(first, grads[:2])
    saved = pickle.loads(pickle.dumps(first.selector.state_dict()))
    resumed = make_exchange(**settings)
    resumed.selector.load_state_dict(saved)
    assert run(resumed, grads[2:]) == uninterrupted[2:]
