import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import deepreduce as dr
from deepreduce.sparsifiers import get_sparsifier


def reference_topk(x, k):
    """k largest magnitudes, ties to the lowest index (a stable sort)."""
    order = np.argsort(-np.abs(x.astype(np.float64)), kind="stable")
    return np.sort(order[:k])


@settings(max_examples=80, deadline=None)
@given(hnp.arrays(np.float32, st.integers(0, 300),
                  elements=st.sampled_from([0.0, 1.0, -1.0, 2.0, -0.5, 7.0])),
       st.integers(0, 300))
def test_topk_matches_reference_with_ties(x, k):
    k = min(k, x.size)
    for exact in (False, True):
        got = dr.TopK(k=k, exact=exact)(x)
        np.testing.assert_array_equal(got.indices, reference_topk(x, k))
        np.testing.assert_array_equal(got.values, x[got.indices])


@pytest.mark.parametrize("n, ratio", [(300_000, 0.01), (200_000, 0.0001), (150_000, 0.5)])
def test_fast_topk_equals_exact_on_large_inputs(n, ratio):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.integers(0, n, 100)] = 3.0  # ties at the top
    fast, exact = dr.TopK(ratio)(x), dr.TopK(ratio, exact=True)(x)
    assert fast == exact
    assert fast.nnz == math.ceil(ratio * n)


def test_fast_topk_on_heavy_ties_and_float16():
    x = np.ones(300_000, np.float16)
    x[::7] = 2
    got = dr.TopK(k=50_000)(x)
    np.testing.assert_array_equal(got.indices, reference_topk(x, 50_000))


def test_topk_ratio_and_count_forms():
    x = np.arange(10, dtype=np.float32)
    assert dr.TopK(0.3)(x).nnz == 3
    assert dr.TopK(3)(x).nnz == 3
    assert dr.TopK(k=3)(x).nnz == 3
    assert dr.TopK(1.0)(x).nnz == 10
    assert dr.TopK(1)(x).indices.tolist() == [9]


@pytest.mark.parametrize("args, kwargs", [((-0.1,), {}), ((0.0,), {}), ((1.5,), {}),
                                          ((float("nan"),), {}), ((), {}), ((0.1,), {"k": 3}),
                                          ((), {"k": -1})])
def test_topk_bad_arguments(args, kwargs):
    with pytest.raises(ValueError):
        dr.TopK(*args, **kwargs)


def test_topk_k_larger_than_tensor():
    with pytest.raises(ValueError, match="larger than the tensor"):
        dr.TopK(k=11)(np.zeros(10))


def test_topk_on_sparse_input_selects_among_stored_entries():
    st_ = dr.SparseTensor([1.0, -5.0, 2.0], [3, 10, 40], (100,))
    got = dr.TopK(k=2)(st_)
    np.testing.assert_array_equal(got.indices, [10, 40])
    assert dr.TopK(0.5)(st_).nnz == 2  # ratio of the stored entries


def test_randomk_reproducible_and_advancing():
    x = np.arange(1000, dtype=np.float32)
    a, b = dr.RandomK(0.1, seed=3), dr.RandomK(0.1, seed=3)
    first_a, first_b = a(x), b(x)
    assert first_a == first_b and first_a.nnz == 100
    assert a(x) != first_a  # the next step draws a new set
    assert np.all(np.diff(first_a.indices) > 0)


def test_threshold():
    x = np.array([0.1, -3.0, 0.5, 0.6, -0.5], np.float32)
    np.testing.assert_array_equal(dr.Threshold(0.5)(x).indices, [1, 3])
    np.testing.assert_array_equal(dr.Threshold(0)(x).indices, [0, 1, 2, 3, 4])
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="tau"):
            dr.Threshold(bad)


def test_blocktopk_dense_and_sparse_agree():
    rng = np.random.default_rng(0)
    x = np.zeros(1000, np.float32)
    x[rng.integers(0, 1000, 60)] = rng.standard_normal(60)
    dense = dr.BlockTopK(0.25, block=64)(x)
    blocks = dense.indices // 64
    assert dense.nnz == 4 * 64 and np.all(blocks == np.repeat(np.unique(blocks), 64))
    norms = np.array([np.sum(x[i:i + 64] ** 2) for i in range(0, 1000, 64)])
    assert set(np.unique(dense.indices // 64)) == set(np.argsort(-norms, kind="stable")[:4])
    sparse = dr.BlockTopK(0.25, block=64)(dr.SparseTensor.from_dense(x))
    assert set(sparse.indices) == set(dense.indices[dense.values != 0])


def test_blocktopk_last_partial_block():
    x = np.zeros(300, np.float32)
    x[299] = 1
    got = dr.BlockTopK(0.5, block=256)(x)
    np.testing.assert_array_equal(got.indices, np.arange(256, 300))
    with pytest.raises(ValueError, match="block"):
        dr.BlockTopK(0.1, block=0)


@pytest.mark.parametrize("n, block", [(0, 4), (1, 4), (300, 256), (200_003, 256),
                                      (200_003, 7), (70_000, 100_000), (3 << 16, 1)])
def test_blocktopk_norms_of_large_tensors_come_slice_by_slice_with_the_same_bits(n, block):
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    blocks = -(-n // block)
    squares = np.square(x, dtype=np.float64)
    whole = n // block * block
    expected = np.concatenate([squares[:whole].reshape(-1, block).sum(axis=1),
                               [squares[whole:].sum()] if whole < n else []])
    np.testing.assert_array_equal(dr.BlockTopK(0.1, block=block)._dense_norms(x, blocks),
                                  expected)


def test_specs():
    assert isinstance(get_sparsifier(None), dr.NonZero)
    assert get_sparsifier("topk:0.01").ratio == 0.01
    assert get_sparsifier("topk:k=5").k == 5
    assert get_sparsifier("randomk:0.1,seed=4").seed == 4
    assert get_sparsifier("blocktopk:0.1,block=64").block == 64
    with pytest.raises(ValueError, match="unknown sparsifier"):
        get_sparsifier("bottomk:0.1")
    with pytest.raises(ValueError, match="bad parameters"):
        get_sparsifier("topk:0.1,colour=3")


@pytest.mark.parametrize("n", [65_535, 65_536, 65_537, 200_000])
def test_candidate_scan_matches_whole_array_comparison(n):
    from deepreduce.sparsifiers import _at_least

    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.integers(0, n, 50)] = np.nan
    x[rng.integers(0, n, 50)] = -np.inf
    x[-1], x[0] = 2.5, -0.0
    for low in (np.float32(0.0), np.float32(2.5), np.float32(np.inf)):
        expected = np.flatnonzero((x >= low) | (x <= -low))
        np.testing.assert_array_equal(_at_least(x, low), expected)
