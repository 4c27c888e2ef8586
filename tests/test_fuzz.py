"""Fuzzing every decoder and the container: arbitrary bytes give DecodeError or a
well-formed result, never another exception, quickly (hypothesis, bounded examples).

Random bytes mostly fail the first checks, so the container is also fuzzed with
valid payloads whose streams are mutated and whose CRC is recomputed: those reach
the codecs' own checks through the whole decoding path.
"""

import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deepreduce as dr
from deepreduce import container

FUZZ = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
INDEX_CODECS = sorted(dr.registered_codecs("index"))
VALUE_CODECS = sorted(dr.registered_codecs("value"))


def well_formed_indices(result, n, nnz):
    assert result.shape == (nnz,) and result.dtype == np.int64
    assert nnz == 0 or (result[0] >= 0 and result[-1] < n and np.all(np.diff(result) > 0))


@pytest.mark.parametrize("codec_id", INDEX_CODECS)
@FUZZ
@given(data=st.binary(max_size=200), n=st.integers(0, 100_000), nnz=st.integers(0, 300))
def test_index_decoders_take_any_bytes(codec_id, data, n, nnz):
    codec = dr.get_codec(codec_id, family="index")
    nnz = min(nnz, n)
    try:
        result = codec.decode(data, n, nnz)
    except dr.DecodeError:
        return
    well_formed_indices(result, n, nnz)


@pytest.mark.parametrize("codec_id", VALUE_CODECS)
@FUZZ
@given(data=st.binary(max_size=200), nnz=st.integers(0, 3000),
       dtype=st.sampled_from([np.float16, np.float32, np.float64]))
def test_value_decoders_take_any_bytes(codec_id, data, nnz, dtype):
    codec = dr.get_codec(codec_id, family="value")
    try:
        result = codec.decode(data, nnz, np.dtype(dtype))
    except dr.DecodeError:
        return
    assert result.shape == (nnz,) and result.dtype == dtype


def seed_payloads():
    x = np.random.default_rng(5).standard_normal(3000).astype(np.float32)
    pipelines = [("auto", "fp16"), ("golomb", "qsgd"), ("huffman", "raw"), ("eliasfano", "zstd"),
                 ("bloom:fpr=0.01,policy=random", "raw"), ("auto", "polyfit"),
                 ("runs", "deflate"), ("bitmap", "sign")]
    return [dr.compress(x, dr.TopK(0.05), index, value) for index, value in pipelines]


SEEDS = seed_payloads()


@FUZZ
@given(data=st.binary(max_size=400))
def test_container_takes_any_bytes(data):
    try:
        st_ = dr.decompress(data)
    except dr.DecodeError:
        return
    assert st_.indices.size == st_.nnz


@FUZZ
@given(which=st.integers(0, len(SEEDS) - 1), flips=st.lists(st.integers(0, 10**6), max_size=8),
       cut=st.integers(0, 10**6))
def test_mutated_payloads_with_a_valid_crc(which, flips, cut):
    payload = SEEDS[which]
    header, index, value = container.unpack(payload)
    streams = bytearray(bytes(index) + bytes(value))
    for flip in flips:
        if streams:
            streams[flip % len(streams)] ^= 1 << (flip % 8)
    split = len(index)
    if cut % 3 == 0 and streams:    # shorten one of the streams too
        del streams[cut % len(streams)]
        split = min(split, len(streams))
    body = container.pack(header.dtype, header.shape, header.nnz, header.index_spec,
                          header.value_spec, bytes(streams[:split]), bytes(streams[split:]),
                          header.flags)
    assert zlib.crc32(body[:-4]) == int.from_bytes(body[-4:], "little")
    try:
        st_ = dr.decompress(body)
    except dr.DecodeError:
        return
    well_formed_indices(st_.indices, st_.size, st_.nnz)
