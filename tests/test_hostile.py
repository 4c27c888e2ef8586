"""Small crafted payloads are rejected with DecodeError before costing time or memory.

Each case here once cost seconds, gigabytes or an exception other than
DecodeError (issue 15). Every payload is under a few hundred bytes and carries
a valid CRC, so the checks reached are the ones that matter: declared sizes
against the bytes that back them, before any work that grows with them.
"""

import math
import struct
import time

import numpy as np
import pytest

import deepreduce as dr
from deepreduce import cli, container, pipeline
from deepreduce import bits as _bits
from deepreduce.codecs.index.bloom import BloomFilter, BloomIndices
from deepreduce.codecs.index.huffman import HuffmanIndices
from deepreduce.codecs.values.polyfit import PolyFitValues

#: Far above what any of these checks takes, far below what the attacks cost.
QUICK = 1.0


def repack(payload, shape=None, nnz=None, index_stream=None, value_stream=None):
    """``payload`` with some header fields or streams replaced, CRC recomputed."""
    header, index, value = container.unpack(payload)
    return container.pack(header.dtype, header.shape if shape is None else shape,
                          header.nnz if nnz is None else nnz, header.index_spec,
                          header.value_spec, bytes(index if index_stream is None
                                                   else index_stream),
                          bytes(value if value_stream is None else value_stream),
                          header.flags)


def small_payload(**pipeline):
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    return dr.compress(x, sparsifier=dr.TopK(0.01), **pipeline)


def rejected_quickly(fn, match=None):
    start = time.perf_counter()
    with pytest.raises(dr.DecodeError, match=match):
        fn()
    assert time.perf_counter() - start < QUICK


@pytest.mark.timing
@pytest.mark.parametrize("n", [10**9, 2**40, 2**62])
def test_bloom_universe_beyond_max_scanned(n):
    payload = repack(small_payload(index="bloom:fpr=0.01"), shape=(n,))
    rejected_quickly(lambda: dr.decompress(payload), "max_scanned")


def all_ones_filter(nbytes=48, k=7):
    words = np.full(-(-nbytes // 8), np.uint64(2**64 - 1))
    filt = BloomFilter(words, nbytes, k, min(k, 4), 0, 2**40)
    return filt.to_bytes()


@pytest.mark.parametrize("policy, n", [("random", 10**8), ("conflict_sets", 10**8),
                                       ("leftmost", 2**62), ("p0", 2**62)])
@pytest.mark.timing
def test_bloom_all_ones_filter_fails_its_popcount(policy, n):
    stream = all_ones_filter()
    assert len(stream) < 64
    rejected_quickly(lambda: BloomIndices(policy=policy).decode(stream, n, 10), "sets")


@pytest.mark.timing
def test_bloom_positives_beyond_the_declared_rate_are_never_held():
    # a filter built at fpr=0.01 under a spec declaring fpr=1e-6: its popcount
    # passes, its false positives (about 1% of the universe) do not
    n, indices = 10**6, np.arange(0, 10**6, 3500)
    data = BloomIndices(fpr=0.01, policy="random").encode(indices, n)
    for policy in ("random", "conflict_sets"):
        decoder = BloomIndices(fpr=1e-6, policy=policy)
        assert decoder.positives_allowed(n, indices.size) < 2000
        rejected_quickly(lambda: decoder.decode(data, n, indices.size), "more than")


@pytest.mark.timing
@pytest.mark.parametrize("nnz", [10**8, 10**9, 2**63 - 2])
def test_value_ordered_index_stream_checked_before_the_values(nnz):
    payload = repack(small_payload(value="polyfit"), shape=(2**63 - 1,), nnz=nnz)
    assert len(payload) < 100
    rejected_quickly(lambda: dr.decompress(payload, max_nnz=None), "index stream")


@pytest.mark.timing
def test_polyfit_piece_lengths_cannot_wrap():
    nnz = 2**62
    # five pieces of 2**62 add up to 2**62 modulo 2**64
    stream = _bits.write_varint(5) + _bits.varint_encode(np.full(5, nnz, np.uint64))
    rejected_quickly(lambda: PolyFitValues(segments=8).decode(stream + bytes(64), nnz,
                                                              np.float32), "piece lengths")


@pytest.mark.timing
def test_deflate_values_of_an_impossible_size_are_a_decode_error(tmp_path):
    payload = repack(small_payload(value="deflate"), shape=(2**62,), nnz=2**62)
    assert len(payload) < 100
    rejected_quickly(lambda: dr.decompress(payload, max_nnz=None))
    path = tmp_path / "hostile.drz"
    path.write_bytes(payload)
    for command in (["decompress", str(path), "--max-nnz", "0"],
                    ["inspect", str(path), "--check", "--max-nnz", "0", "--max-scanned", "0"],
                    ["decompress", str(path), "--max-elements", "0"],
                    ["decompress", str(path)]):
        assert cli.main(command) == 1   # a message, not a traceback


@pytest.mark.timing
def test_zstd_frame_declaring_more_than_it_can_hold():
    from deepreduce.codecs._zstd import zstd_compress, zstd_decompress

    # a magicless frame: single segment with an 8-byte content size of 2**40, then
    # one last RLE block of 100 bytes; a decoder trusting the size allocates 1 TiB
    block = 1 | (1 << 1) | (100 << 3)
    frame = bytes([0xE0]) + struct.pack("<Q", 2**40) + block.to_bytes(3, "little") + b"\0"
    rejected_quickly(lambda: zstd_decompress(frame, 2**62, "test"), "possible")
    # the bound never refuses a real frame: 1 MiB of zeros packs as tightly as zstd can
    zeros = bytes(2**20)
    packed = zstd_compress(zeros, 19)
    assert len(packed) < 100 and zstd_decompress(packed, 2**20, "test") == zeros


@pytest.mark.timing
def test_huffman_counts_checked_before_the_block_table():
    stream = bytes(130)
    n = nnz = 2**31 - 1
    rejected_quickly(lambda: HuffmanIndices(block=8).decode(stream, n, nnz), "cannot hold")


@pytest.mark.timing
def test_max_nnz_is_checked_before_anything_else():
    payload = small_payload(index="varint")
    assert dr.decompress(payload, max_nnz=10).nnz == 10
    with pytest.raises(dr.DecodeError, match="max_nnz=9"):
        dr.decompress(payload, max_nnz=9)
    # before the CRC, the streams or the codecs: a bad CRC is not what is reported
    corrupt = bytearray(repack(payload, nnz=2**40, shape=(2**41,)))
    corrupt[-1] ^= 1
    rejected_quickly(lambda: dr.decompress(bytes(corrupt)), "max_nnz=268,435,456")


def test_max_elements_still_bounds_the_shape_with_a_deprecation_warning(monkeypatch):
    payload = small_payload(index="varint")
    with pytest.warns(DeprecationWarning, match="max_nnz"):
        assert dr.decompress(payload, max_elements=1000).nnz == 10
    with pytest.warns(DeprecationWarning), pytest.raises(dr.DecodeError, match="max_elements=999"):
        dr.decompress(payload, max_elements=999)
    # given, it replaces the default bounds, as it did; None lifts every bound
    bounds = []
    monkeypatch.setattr(pipeline, "decode", lambda payload, *args: bounds.append(args))
    with pytest.warns(DeprecationWarning):
        dr.decompress(payload, max_elements=None)
        dr.decompress(payload, max_scanned=5, max_elements=7)
    dr.decompress(payload)
    assert bounds == [(None, None, None), (None, 5, 7), (2**28, 2**28)]


def test_to_dense_of_a_shape_beyond_memory_says_so():
    st = dr.decompress(repack(small_payload(index="varint"), shape=(2**50,)))
    with pytest.raises(MemoryError, match="sparse form"):
        st.to_dense()
    assert math.prod(st.shape) == 2**50 and st.nnz == 10


def test_header_fields_are_bounded():
    payload = bytearray(small_payload(index="varint"))
    header = container.read_header(payload)
    assert header.size == 1000
    # a truncated payload and a bad CRC are still rejected as before
    with pytest.raises(dr.DecodeError):
        dr.decompress(bytes(payload[:-1]))
    payload[-1] ^= 1
    with pytest.raises(dr.DecodeError, match="CRC"):
        dr.decompress(bytes(payload))
    assert struct.calcsize("<I") == 4


@pytest.mark.parametrize("name", ["eliasfano", "huffman", "varint"])
def test_auto_tags_are_bound_to_fixed_codecs_not_to_the_registry(name):
    from deepreduce.codecs.index.auto import TAG_CODECS, TAGS
    from deepreduce.registry import register_codec

    original = TAG_CODECS[TAGS.index(name)]
    n = 100_000
    indices = np.sort(np.random.default_rng(3).choice(n, 1000, replace=False))
    data = bytes([TAGS.index(name)]) + original().encode(indices, n)

    class Impostor(original):
        def decode(self, data, n, nnz):
            raise AssertionError("the registry was consulted")

    register_codec(Impostor, replace=True)
    try:
        decoded = dr.get_codec("auto", family="index").decode(data, n, indices.size)
    finally:
        register_codec(original, replace=True)
    assert np.array_equal(decoded, indices)


def test_the_pipeline_checks_the_order_unless_the_codec_vouches_for_it():
    from deepreduce.codecs.index.auto import COMPLEMENT, TAGS
    from deepreduce.codecs.index.varint import VarintIndices
    from deepreduce.registry import register_codec

    indices = np.array([3, 9, 40], np.int64)
    auto = dr.get_codec("auto", family="index")
    for codec_id in ("golomb", "bitmap"):
        codec = dr.get_codec(codec_id, family="index")
        assert codec.orders(codec.encode(indices, 64))
        assert auto.orders(bytes([TAGS.index(codec_id)]) + codec.encode(indices, 64))
    assert not auto.orders(bytes([TAGS.index("golomb") | COMPLEMENT]))
    assert not auto.orders(b"") and not auto.orders(bytes([TAGS.index("eliasfano")]))
    assert not dr.get_codec("eliasfano", family="index").orders(b"")

    class Unordered(VarintIndices):  # a codec that neither checks nor vouches
        def decode(self, data, n, nnz):
            return super().decode(data, n, nnz)[::-1].copy()

    payload = dr.compress(np.arange(1, 9, dtype=np.float32), None, "varint", "raw")
    register_codec(Unordered, replace=True)
    try:
        with pytest.raises(dr.DecodeError, match="not strictly increasing"):
            dr.decompress(payload)
    finally:
        register_codec(VarintIndices, replace=True)
