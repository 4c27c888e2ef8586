"""The chunked index codec: exactly k per chunk at the bound log2 C(C, k) / k, lossless and
strict, with its compiled range coder (deepreduce.codecs.index._chunkc) and its Python loop giving
the same bytes."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import deepreduce as dr
from deepreduce.codecs.index import chunked
from deepreduce.codecs.index.chunked import FLAT, GENERAL, TILES, ChunkedIndices, find_layout
from deepreduce.errors import DecodeError
import extensions

implementation = extensions.fixture(chunked, "_chunkc", "implementation")
compiled_only = pytest.mark.skipif(chunked._chunkc is None,
                                   reason="deepreduce.codecs.index._chunkc is not built")
SETTINGS = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

shapes = st.one_of(
    st.lists(st.integers(0, 50), min_size=1, max_size=3).map(tuple),
    st.tuples(st.integers(1, 3), st.sampled_from([4, 8, 12, 16]), st.sampled_from([4, 8, 12, 6])))


def outcome(function, *args):
    try:
        return function(*args)
    except DecodeError:
        return "DecodeError"


@SETTINGS
@given(shape=shapes, chunk=st.sampled_from([1, 4, 9, 16, 7, 64]), k=st.integers(0, 20),
       tiles=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_chunk_topk_sets_round_trip_in_their_layout(implementation, shape, chunk, k, tiles, seed):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    sparsifier = dr.ChunkTopK(k=k, chunk=chunk, tiles=tiles)
    selected = sparsifier(x)
    codec = ChunkedIndices(chunk=chunk)
    data = codec.encode(selected.indices, x.size)
    decoded = codec.decode(data, x.size, selected.nnz)
    assert decoded.dtype == np.int64
    np.testing.assert_array_equal(decoded, selected.indices)
    most = codec.max_count(data, x.size)
    assert most is None or most >= selected.nnz
    if selected.nnz:  # coded in its layout, or as auto's stream when that is shorter
        general = 1 + len(dr.get_codec("auto", family="index").encode(selected.indices,
                                                                        x.size))
        assert (data[0] in (FLAT, TILES) and len(data) <= general) or (
            data[0] == GENERAL and len(data) == general)


@compiled_only
@SETTINGS
@given(shape=shapes, chunk=st.sampled_from([1, 4, 9, 16, 7, 64]), k=st.integers(1, 20),
       seed=st.integers(0, 2**32 - 1), flips=st.lists(st.integers(0, 2**20), max_size=3))
def test_compiled_and_python_give_the_same_bytes_and_decodes(shape, chunk, k, seed, flips):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    selected = dr.ChunkTopK(k=k, chunk=chunk)(x)
    codec = ChunkedIndices(chunk=chunk)
    compiled, python = extensions.both(chunked, "_chunkc", codec.encode, selected.indices, x.size)
    assert compiled == python
    stream = bytearray(compiled)
    for bit in flips:  # corrupt streams: the same outcome both ways
        if stream:
            stream[(bit // 8) % len(stream)] ^= 1 << (bit % 8)
    compiled, python = extensions.both(chunked, "_chunkc", outcome, codec.decode, bytes(stream),
                                       x.size, selected.nnz)
    if isinstance(compiled, np.ndarray):
        np.testing.assert_array_equal(compiled, python)
    else:
        assert compiled == python


@pytest.mark.parametrize("k, within", [(32, 0.01), (64, 0.01), (128, 0.01)])
def test_within_one_percent_of_the_bound_on_sparseloco_tiles(k, within):
    x = np.random.default_rng(k).standard_normal((1024, 1024)).astype(np.float32)
    selected = dr.ChunkTopK(k=k, chunk=4096)(x)
    data = ChunkedIndices().encode(selected.indices, x.size)
    bits = 8 * len(data) / selected.nnz
    bound = dr.index_entropy_bits(4096, k)
    auto = 8 * len(dr.get_codec("auto", family="index").encode(selected.indices, x.size)) \
        / selected.nnz
    print(f"k={k}: chunked {bits:.4f} bits per index, bound {bound:.4f}, auto {auto:.4f}")
    assert data[0] == TILES
    assert bound <= bits <= (1 + within) * bound
    assert bits < auto


def test_layouts_found_from_the_set_alone():
    rng = np.random.default_rng(3)
    cases = [((64, 48), 16, TILES, 48), ((3, 8, 16), 16, TILES, 16), ((100,), 16, FLAT, None),
             ((8, 10), 16, FLAT, None), ((4, 8, 8), 64, FLAT, None),  # one tile per matrix: flat chunks
             ((5000,), 4096, FLAT, None), ((4, 16, 16), 64, TILES, 16)]
    for shape, chunk, kind, cols in cases:
        x = rng.standard_normal(shape)
        indices = dr.ChunkTopK(k=3, chunk=chunk)(x).indices
        layout = find_layout(indices, x.size, chunk)
        assert layout[0] == kind and layout[-1] == 3, (shape, layout)
        if kind == TILES:
            assert layout[1:3] == (math.isqrt(chunk), cols)
    # the row length given: tried first
    x = rng.standard_normal((32, 32))
    indices = dr.ChunkTopK(k=16, chunk=16)(x).indices   # every 4 x 4 tile full
    assert find_layout(indices, 1024, 16, cols=32)[:3] == (TILES, 4, 32)


def test_sets_that_fit_no_layout_go_as_auto_streams(implementation):
    rng = np.random.default_rng(4)
    indices = np.sort(rng.choice(100_000, 3000, replace=False))
    data = ChunkedIndices().encode(indices, 100_000)
    assert data[0] == GENERAL
    assert data[1:] == dr.get_codec("auto", family="index").encode(indices, 100_000)
    np.testing.assert_array_equal(ChunkedIndices().decode(data, 100_000, 3000), indices)


def test_one_chunk_is_any_subset_at_its_bound(implementation):
    rng = np.random.default_rng(5)
    indices = np.sort(rng.choice(3000, 1000, replace=False))
    data = ChunkedIndices().encode(indices, 3000)   # n < chunk: one chunk of 3000
    assert data[0] == FLAT
    assert 8 * len(data) <= 1000 * dr.index_entropy_bits(3000, 1000) + 64
    np.testing.assert_array_equal(ChunkedIndices().decode(data, 3000, 1000), indices)


def test_small_sets_keep_the_shorter_auto_stream():
    for indices, n in (([999], 1000), ([0, 5], 10), ([3], 2**40)):
        data = ChunkedIndices().encode(np.array(indices), n)
        general = bytes([GENERAL]) + dr.get_codec("auto", family="index").encode(
            np.array(indices), n)
        assert len(data) <= len(general)
        np.testing.assert_array_equal(ChunkedIndices().decode(data, n, len(indices)), indices)


def test_full_and_empty_chunks_cost_no_coded_bytes(implementation):
    assert chunked.encode_keys(np.arange(64), 16, 4, 16, 16) == b""    # every chunk full
    np.testing.assert_array_equal(chunked.decode_keys(b"", 16, 4, 16, 16, 64, "test"),
                                  np.arange(64))
    x = np.zeros((64, 64), np.float32)
    x[:, ::2] = 1   # ties: the first 8 of each row's ones in every 8 x 8 tile...
    indices = dr.ChunkTopK(k=32, chunk=64)(x).indices
    data = ChunkedIndices(chunk=64).encode(indices, x.size)
    np.testing.assert_array_equal(ChunkedIndices().decode(data, x.size, indices.size), indices)


def encoded_tiles(k=8):
    x = np.random.default_rng(6).standard_normal((128, 128)).astype(np.float32)
    indices = dr.ChunkTopK(k=k, chunk=1024)(x).indices
    return ChunkedIndices(chunk=1024).encode(indices, x.size), indices


def test_strict_decoding(implementation):
    data, indices = encoded_tiles()
    codec, n, nnz = ChunkedIndices(), 128 * 128, indices.size
    assert data[0] == TILES and data[-1] != 0
    np.testing.assert_array_equal(codec.decode(data, n, nnz), indices)
    bad = [(data + b"\x01", n, nnz, None), (data[:-1] + bytes([data[-1] ^ 1]), n, nnz, None),
           (data + b"\x00", n, nnz, None), (data[:-9], n, nnz, "cannot hold"),
           (data, n, nnz + 1, "holds"), (data, n, nnz - 1, "holds"), (data, 2 * n, nnz, None),
           (data, 2**62, nnz, None), (b"\x07" + data[1:], n, nnz, "unknown layout"),
           (b"", n, nnz, "empty"), (data[:2], n, nnz, "truncated"),
           (bytes([TILES, 32, 100]) + data[4:], n, nnz, "do not tile"),
           (bytes([FLAT, 0, 8]) + data[4:], n, nnz, "chunk"),
           (bytes([TILES, 32, 0x80, 1, 0]) + data[5:], n, nnz, "no indices"),
           (bytes([TILES, 32, 0x80, 1]) + b"\xff" * 5, n, nnz, None)]
    for stream, n_, nnz_, message in bad:
        with pytest.raises(DecodeError, match=message):
            codec.decode(stream, n_, nnz_)
    with pytest.raises(DecodeError):
        codec.decode(b"\x00", 10, 0)
    # a tiny stream declaring a huge layout is refused before any decoding
    head = bytes([FLAT]) + dr.bits.write_varint(4096) + b"\x01"
    with pytest.raises(DecodeError, match="cannot hold"):
        codec.decode(head + b"\x55" * 8, 2**40, 2**28)
    assert codec.max_count(head, 2**40) == 2**28


def test_decoding_reads_at_most_four_implied_bytes(implementation):
    data, indices = encoded_tiles(k=30)
    body = 5   # layout, side, cols (2 bytes), k
    with pytest.raises(DecodeError, match="ends inside|cannot hold"):
        ChunkedIndices().decode(data[:body + 3], 128 * 128, indices.size)


def test_truncated_streams_decode_to_well_formed_sets_or_raise(implementation):
    data, indices = encoded_tiles(k=30)
    for cut in range(5, len(data), 7):
        try:
            got = ChunkedIndices().decode(data[:cut], 128 * 128, indices.size)
        except DecodeError:
            continue
        assert got.shape == indices.shape and np.all(np.diff(got) > 0)


def test_bad_parameters():
    for spec in ("chunked:chunk=0", f"chunked:chunk={2**24 + 1}", "chunked:cols=0",
                 "chunked:chunk=true", "chunked:cols=1.5"):
        with pytest.raises(ValueError):
            dr.get_codec(spec, family="index")
    assert dr.get_codec("chunked:chunk=64,cols=512", family="index").header_spec() == "chunked"


def test_encoder_refuses_sets_that_break_their_layout():
    with pytest.raises(ValueError):
        chunked.encode_keys(np.array([0, 1, 2]), 4, 2, 4, 2)   # 3 in chunk 0
    with pytest.raises(ValueError):
        chunked._encode_python(np.array([0, 1, 2]), 4, 2, 4, 2)


def test_sets_that_cluster_inside_their_chunks_keep_the_shorter_auto_stream(implementation):
    x = np.zeros((128, 128), np.float32)
    x[::64, :] = 1 + np.arange(128)          # each 64 x 64 tile's largest: its first row
    selected = dr.ChunkTopK(k=64)(x)
    codec = ChunkedIndices()
    data = codec.encode(selected.indices, x.size)
    exact = chunked.layout_bits(4096, 4, 4096, 64) / 8   # what the exact stream needs
    assert data[0] == GENERAL and len(data) < exact
    np.testing.assert_array_equal(codec.decode(data, x.size, selected.nnz), selected.indices)
