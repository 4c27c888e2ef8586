"""Chunk-wise Top-k (dr.ChunkTopK): exactly k per chunk, equal to a per-chunk reference."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import deepreduce as dr
from deepreduce.sparsifiers import chunk_keys, get_sparsifier


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
