"""Chunk-wise Top-k (dr.ChunkTopK): exactly k per chunk, equal to a per-chunk reference.

The dense selection runs in C (``deepreduce._topkscan.chunk_largest``) where the extension
is built, else in numpy; the tests that compare them run both in one test.
"""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import deepreduce as dr
from deepreduce import sparsifiers
from deepreduce.sparse import BFLOAT16
from deepreduce.sparsifiers import chunk_keys, get_sparsifier
import extensions

compiled_only = pytest.mark.skipif(sparsifiers._topkscan is None,
                                   reason="deepreduce._topkscan is not built")
FLOAT_DTYPES = [np.float16, np.float32, np.float64] + ([BFLOAT16] if BFLOAT16 is not None else [])


def reference_chunks(shape, chunk, tiles=True):
    """The flat indices of every chunk, in chunk order, by loops over the tiles."""
    size = math.prod(shape)
    side = math.isqrt(chunk)
    flat = np.arange(size).reshape(shape) if size else np.zeros(0, np.int64)
    if (tiles and len(shape) >= 2 and side * side == chunk and size
            and shape[-1] % side == 0 and shape[-2] % side == 0):
        matrix = flat.reshape(-1, shape[-1])
        return [matrix[r:r + side, c:c + side].reshape(-1)
                for r in range(0, matrix.shape[0], side)
                for c in range(0, matrix.shape[1], side)]
    flat = flat.reshape(-1)
    return [flat[start:start + chunk] for start in range(0, size, chunk)]


def reference(x, k, chunk, tiles=True):
    """Per chunk: the k largest magnitudes, ties to the lowest index (a stable sort)."""
    flat = x.reshape(-1)
    kept = []
    for members in reference_chunks(x.shape, chunk, tiles):
        mag = np.abs(flat[members].astype(np.float64))
        mag[np.isnan(mag)] = -np.inf
        order = np.argsort(-mag, kind="stable")  # members are increasing: ties to the lowest
        kept.append(members[order[:k]])
    return np.sort(np.concatenate(kept)) if kept else np.zeros(0, np.int64)


shapes = st.one_of(
    st.lists(st.integers(0, 40), min_size=1, max_size=3).map(tuple),
    st.tuples(st.sampled_from([1, 2, 3]), st.sampled_from([4, 8, 12]),
              st.sampled_from([4, 8, 16, 6])))


@settings(max_examples=100, deadline=None)
@given(data=st.data(), shape=shapes, chunk=st.sampled_from([1, 4, 9, 16, 7]),
       k=st.integers(0, 20), tiles=st.booleans())
def test_matches_the_per_chunk_reference(data, shape, chunk, k, tiles):
    x = data.draw(hnp.arrays(np.float32, shape,
                             elements=st.sampled_from([0.0, 1.0, -1.0, 2.0, -0.5, 7.0, np.nan])))
    sparsifier = dr.ChunkTopK(k=k, chunk=chunk, tiles=tiles)
    got = sparsifier(x)
    np.testing.assert_array_equal(got.indices, reference(x, k, chunk, tiles))
    np.testing.assert_array_equal(got.values, x.reshape(-1)[got.indices], strict=True)
    # exactly min(k, chunk size) in every chunk
    for members in reference_chunks(shape, chunk, tiles):
        assert np.isin(members, got.indices).sum() == min(k, members.size)


@settings(max_examples=60, deadline=None)
@given(shape=shapes, chunk=st.sampled_from([1, 4, 9, 16, 7]), tiles=st.booleans())
def test_chunk_keys_number_the_reference_chunks(shape, chunk, tiles):
    layout = dr.ChunkTopK(k=1, chunk=chunk, tiles=tiles).layout(shape)
    for number, members in enumerate(reference_chunks(shape, chunk, tiles)):
        np.testing.assert_array_equal(chunk_keys(members, layout),
                                      number * chunk + np.arange(members.size))


def test_sparseloco_tiles_of_a_large_matrix():
    x = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    got = dr.ChunkTopK(k=64)(x)
    assert got.nnz == 256 * 64
    counts = np.bincount(chunk_keys(got.indices, ("tiles", 64, 1024)) // 4096, minlength=256)
    assert np.all(counts == 64)
    np.testing.assert_array_equal(got.indices, reference(x, 64, 4096))


def test_layouts():
    s = dr.ChunkTopK(k=4, chunk=16)
    assert s.layout((8, 12)) == ("tiles", 4, 12)
    assert s.layout((3, 8, 4)) == ("tiles", 4, 4)
    assert s.layout((8, 6)) == ("flat", 16, 48)      # 6 columns do not tile
    assert s.layout((64,)) == ("flat", 16, 64)
    assert s.layout((0, 4)) == ("flat", 16, 0)
    assert dr.ChunkTopK(k=4, chunk=8).layout((8, 8)) == ("flat", 8, 64)  # 8 is no square
    assert dr.ChunkTopK(k=4, chunk=16, tiles=False).layout((8, 8)) == ("flat", 16, 64)


def test_empty_and_single_element():
    for shape in [(0,), (0, 64), (1,), (1, 1)]:
        x = np.ones(shape, np.float32)
        assert dr.ChunkTopK(k=3)(x).nnz == math.prod(shape)
        assert dr.ChunkTopK(k=0)(x).nnz == 0


def test_sparse_input_selects_among_stored_entries_per_chunk():
    st_ = dr.SparseTensor([1.0, -5.0, 2.0, 3.0, 0.5], [3, 10, 40, 41, 99], (100,))
    got = dr.ChunkTopK(k=1, chunk=32)(st_)
    np.testing.assert_array_equal(got.indices, [10, 41, 99])
    np.testing.assert_array_equal(got.values, [-5.0, 3.0, 0.5])


def test_accumulate_and_float16():
    x = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float16)
    target = np.zeros_like(x)
    got = dr.ChunkTopK(k=8, chunk=256).accumulate(target, x)
    np.testing.assert_array_equal(got.indices, reference(x, 8, 256))
    assert got.values.dtype == np.float16


def test_spec_and_bad_arguments():
    assert get_sparsifier("chunktopk:k=64,chunk=4096").layout((128, 128)) == ("tiles", 64, 128)
    assert get_sparsifier("chunktopk:32").k == 32
    assert repr(get_sparsifier("chunktopk:k=8,chunk=64,tiles=false")) == \
        "ChunkTopK(k=8, chunk=64, tiles=False)"
    for kwargs in ({"k": -1}, {"k": 1.5}, {"k": None}, {"k": 1, "chunk": 0},
                   {"k": True}):
        with pytest.raises(ValueError):
            dr.ChunkTopK(**kwargs)


# ------------------------------------------------------------------ compiled against numpy

def both_selections(sparsifier, x):
    """``sparsifier(x)``'s indices with the compiled selection and with numpy's, the values
    checked to be those of ``x`` there."""
    outcomes = extensions.both(sparsifiers, "_topkscan", sparsifier, x)
    for got in outcomes:
        assert got.indices.dtype == np.int64
        expected = np.asarray(x).reshape(-1)[got.indices]
        assert got.values.dtype == expected.dtype
        bits = f"u{expected.itemsize}"  # (bits: numpy sees no NaN in a bfloat16)
        np.testing.assert_array_equal(got.values.view(bits), expected.view(bits))
    return [got.indices for got in outcomes]


def specials(dtype):
    """Values where magnitudes are easy to get wrong: NaN of both signs, infinities, zeros of
    both signs, subnormals, ties."""
    info = np.finfo(np.float32 if np.dtype(dtype).itemsize < 4 else dtype)
    return np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 2.0,
                     info.smallest_subnormal, -info.smallest_subnormal, info.max],
                    dtype=np.float64)


def draw_values(rng, shape, dtype, kind):
    """A tensor of ``shape``: Gaussian, a few special values among Gaussians, only special
    values (ties everywhere), values spread over one binade (a radix digit sees them all
    alike), or equal but for their last bits."""
    size = math.prod(shape)
    if kind == "gaussian":
        x = rng.standard_normal(size)
    elif kind == "specials":
        x = rng.choice(specials(dtype), size)
    elif kind == "some_specials":
        x = rng.standard_normal(size)
        where = rng.random(size) < 0.05
        x[where] = rng.choice(specials(dtype), int(where.sum()))
    elif kind == "one_binade":
        x = 1.0 + rng.random(size)
    else:  # "last_bits": the same value, its lowest mantissa bits drawn
        x = np.full(size, 1.5)
        x = x.astype(dtype)
        bits = x.view(f"u{x.itemsize}")
        bits |= rng.integers(0, 8, size).astype(bits.dtype)
        return x.reshape(shape)
    with np.errstate(over="ignore"):
        return x.astype(dtype).reshape(shape)


VALUE_KINDS = ["gaussian", "specials", "some_specials", "one_binade", "last_bits"]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(FLOAT_DTYPES), kind=st.sampled_from(VALUE_KINDS),
       chunk=st.sampled_from([1, 2, 4, 7, 9, 16, 64, 100, 256]), tiles=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_compiled_and_numpy_selections_agree(data, dtype, kind, chunk, tiles, seed):
    side = math.isqrt(chunk)
    shape = data.draw(st.one_of(
        st.lists(st.integers(0, 70), min_size=1, max_size=3).map(tuple),
        # shapes that tile (for a square chunk), stacked matrices among them
        st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4)).map(
            lambda t: (t[0], t[1] * side, t[2] * side)),
        st.tuples(st.integers(1, 5), st.integers(1, 5)).map(
            lambda t: (t[0] * side, t[1] * side))))
    k = data.draw(st.one_of(st.integers(0, 3), st.integers(0, chunk + 2)))
    x = draw_values(np.random.default_rng(seed), shape, dtype, kind)
    sparsifier = dr.ChunkTopK(k=k, chunk=chunk, tiles=tiles)
    compiled, numpy = both_selections(sparsifier, x)
    np.testing.assert_array_equal(compiled, numpy)
    if dtype in (np.float32, np.float64) and kind != "gaussian":
        np.testing.assert_array_equal(compiled, reference(x, k, chunk, tiles))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", VALUE_KINDS)
@pytest.mark.parametrize("shape, k, chunk", [((256, 192), 64, 4096), ((128, 128), 1, 4096),
                                             ((128, 128), 4095, 4096), ((3, 64, 128), 7, 1024),
                                             ((10_000,), 64, 4096), ((4096 * 3 + 5,), 100, 4096),
                                             ((200, 300), 64, 4096)])
def test_compiled_and_numpy_agree_on_large_chunks(dtype, kind, shape, k, chunk):
    # chunks large enough that the C radix select takes several levels before its sort
    x = draw_values(np.random.default_rng(k), shape, dtype, kind)
    compiled, numpy = both_selections(dr.ChunkTopK(k=k, chunk=chunk), x)
    np.testing.assert_array_equal(compiled, numpy)
    np.testing.assert_array_equal(compiled, reference(x, k, chunk))


def test_compiled_and_numpy_agree_on_strided_and_foreign_order_input():
    rng = np.random.default_rng(3)
    wide = rng.standard_normal((128, 256)).astype(np.float32)
    for x in [wide[:, ::2], wide.T, wide[::2], wide.astype(">f4"), np.asfortranarray(wide),
              wide.reshape(-1)[::3]]:
        compiled, numpy = both_selections(dr.ChunkTopK(k=16, chunk=1024), x)
        np.testing.assert_array_equal(compiled, numpy)
        np.testing.assert_array_equal(compiled, reference(np.asarray(x, np.float32), 16, 1024))


def test_signed_zeros_tie_and_nan_ranks_below_them():
    x = np.array([np.nan, -0.0, 0.0, -np.nan, -0.0, 0.0, np.nan, 0.0], np.float32)
    for k, expected in [(1, [1]), (3, [1, 2, 4]), (6, [1, 2, 4, 5, 7, 0]),
                        (7, [0, 1, 2, 3, 4, 5, 7])]:
        for got in both_selections(dr.ChunkTopK(k=k, chunk=8), x):
            np.testing.assert_array_equal(got, np.sort(expected))


@compiled_only
def test_compiled_selection_checks_its_arguments():
    chunk_largest = sparsifiers._topkscan.chunk_largest
    values = np.zeros(64, np.float32)
    for args in [(-1, 16, 0, 0), (1, 0, 0, 0), (1, 16, 3, 8), (1, 16, 4, 6), (1, 16, 4, 32),
                 (1, 16, -1, 0)]:
        with pytest.raises(ValueError):
            chunk_largest(values, *args)
    for bad in [values.astype(np.float16), values[::2], values.reshape(8, 8),
                values.astype(np.int32)]:
        with pytest.raises(TypeError):
            chunk_largest(bad, 1, 16, 0, 0)
    np.testing.assert_array_equal(chunk_largest(values, 1, 16, 4, 16), [0, 4, 8, 12])
    np.testing.assert_array_equal(chunk_largest(values, 1, 16, 0, 0), [0, 16, 32, 48])


@compiled_only
def test_compiled_selection_lets_other_threads_run():
    import threading

    x = np.random.default_rng(0).standard_normal((2048, 1024)).astype(np.float32)
    ticks, done = [], threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(1)

    thread = threading.Thread(target=tick)
    thread.start()
    try:
        for _ in range(3):
            dr.ChunkTopK(k=64)(x)
    finally:
        done.set()
        thread.join()
    assert ticks


@compiled_only
@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(VALUE_KINDS), k=st.sampled_from([1, 5, 64, 300, 4095]),
       tiles=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_avx2_and_sse2_selections_agree(kind, k, tiles, seed):
    scan = sparsifiers._topkscan
    x = draw_values(np.random.default_rng(seed), (128, 192), np.float32, kind)
    side = 64 if tiles else 0
    outcomes = []
    previous = scan._set_avx2(True)
    try:
        for avx2 in (True, False):  # (where the processor lacks AVX2 both take SSE2)
            scan._set_avx2(avx2)
            outcomes.append(scan.chunk_largest(x.reshape(-1), k, 4096, side, 192 if tiles else 0))
    finally:
        scan._set_avx2(previous)
    np.testing.assert_array_equal(outcomes[0], outcomes[1])
    np.testing.assert_array_equal(outcomes[0], reference(x, k, 4096, tiles))
