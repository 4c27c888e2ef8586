"""The payload container: round trips, and strict rejection of every malformed payload."""

import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import deepreduce as dr
from deepreduce.bits import write_varint
from deepreduce.sparse import BFLOAT16

FLOAT_DTYPES = [np.float16, np.float32, np.float64] + ([BFLOAT16] if BFLOAT16 is not None else [])


def make_payload(n=1000, k=50, index="varint", value="raw", dtype=np.float32, shape=None):
    x = np.random.default_rng(n + k).standard_normal(n).astype(dtype)
    if shape:
        x = x.reshape(shape)
    return dr.Pipeline(dr.TopK(k=k), index, value).encode(x)


def reseal(body: bytes) -> bytes:
    """Give a hand-edited payload body a valid CRC, to reach the checks behind it."""
    return body + struct.pack("<I", zlib.crc32(body))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(1000,), (10, 100), (2, 5, 10, 10)])
def test_round_trip_shapes_and_dtypes(dtype, shape):
    payload, received = make_payload(dtype=dtype, shape=shape)
    back = dr.decompress(payload)
    assert back == received and back.shape == shape and back.dtype == np.dtype(dtype)


def test_header_fields():
    payload, _ = make_payload(index="zstd:level=9", value="fp16")
    header = dr.read_header(payload)
    assert (header.version, header.shape, header.nnz) == (1, (1000,), 50)
    assert (header.index_spec, header.value_spec) == ("zstd:level=9", "fp16")
    assert header.payload_length == len(payload)


def test_small_tensor_overhead_is_small():
    payload, _ = make_payload(n=10, k=2)
    assert len(payload) - 2 * 4 < 30  # header + CRC stay compact for tiny gradients


@pytest.mark.parametrize("n", [0, 1])
def test_empty_and_single_element(n):
    payload, received = make_payload(n=n, k=n)
    assert dr.decompress(payload) == received


def test_all_zero_tensor_sends_nothing():
    payload = dr.compress(np.zeros((4, 4), np.float32))
    st_ = dr.decompress(payload)
    assert st_.nnz == 0 and st_.shape == (4, 4)
    np.testing.assert_array_equal(st_.to_dense(), np.zeros((4, 4)))


def test_every_truncation_is_rejected():
    payload, _ = make_payload(n=200, k=20)
    for cut in range(len(payload)):
        with pytest.raises(dr.DecodeError):
            dr.decompress(payload[:cut])


def test_trailing_bytes():
    payload, _ = make_payload()
    with pytest.raises(dr.DecodeError, match="trailing"):
        dr.decompress(payload + b"\0")


def test_bad_magic_and_version_and_flags():
    payload, _ = make_payload()
    with pytest.raises(dr.DecodeError, match="magic"):
        dr.decompress(b"XX" + payload[2:])
    with pytest.raises(dr.DecodeError, match="version"):
        dr.decompress(payload[:2] + b"\x07" + payload[3:])
    with pytest.raises(dr.DecodeError, match="flag"):
        dr.decompress(payload[:3] + b"\x80" + payload[4:])
    with pytest.raises(dr.DecodeError, match="dtype"):
        dr.decompress(payload[:4] + b"\x63" + payload[5:])


def test_bad_crc():
    payload, _ = make_payload()
    corrupt = bytearray(payload)
    corrupt[-10] ^= 0x01
    with pytest.raises(dr.DecodeError, match="CRC32"):
        dr.decompress(bytes(corrupt))


def hand_made(shape=(100,), nnz=3, index_spec="varint", value_spec="raw", index_stream=b"\x01\x01\x01",
              value_stream=b"\0" * 12, index_length=None, value_length=None, flags=0, dtype=2):
    w = write_varint
    body = b"DR" + bytes((1, flags, dtype)) + w(len(shape)) + b"".join(w(d) for d in shape)
    body += w(nnz) + w(len(index_spec)) + index_spec.encode() + w(len(value_spec)) + value_spec.encode()
    body += w(len(index_stream) if index_length is None else index_length)
    body += w(len(value_stream) if value_length is None else value_length)
    return reseal(body + index_stream + value_stream)


def test_hand_made_payload_is_valid():
    st_ = dr.decompress(hand_made())
    np.testing.assert_array_equal(st_.indices, [1, 3, 5])


@pytest.mark.parametrize("kwargs, message", [
    ({"nnz": 101}, "exceeds the 100 elements"),
    ({"shape": (2**62, 4)}, "more than 2\\*\\*63"),
    ({"index_spec": "nosuchcodec"}, "unknown index codec"),
    ({"value_spec": "nosuchcodec"}, "unknown value codec"),
    ({"index_spec": "varint:bogus=1"}, "bad parameters"),
    ({"index_length": 2}, "trailing|truncated|stream"),
    ({"value_length": 100}, "truncated"),
    ({"index_stream": b"\x01\x01\x70"}, "range|past|exceed|out of|universe"),
    ({"value_stream": b"\0" * 8}, "value|bytes|expected"),
    ({"flags": 1}, "value-order|flag"),
])
def test_inconsistent_headers(kwargs, message):
    with pytest.raises(dr.DecodeError, match=message):
        dr.decompress(hand_made(**kwargs))


def test_huge_declared_tensor_with_tiny_streams_does_not_allocate():
    # 2**62 elements and nnz 2**40 declared in a few bytes: must fail on the stream
    # lengths before anything of that size is allocated
    payload = hand_made(shape=(2**62,), nnz=2**40)
    with pytest.raises(dr.DecodeError):
        dr.decompress(payload)


def test_not_bytes():
    with pytest.raises(dr.DecodeError, match="bytes-like"):
        dr.decompress(12345)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_decode_error(data):
    with pytest.raises(dr.DecodeError):
        dr.decompress(data)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_bit_flips_of_resealed_payloads_only_raise_decode_error(data):
    index = data.draw(st.sampled_from(["raw", "bitpack", "varint", "deflate", "zstd", "bitmap",
                                       "rle", "eliasfano"]))
    value = data.draw(st.sampled_from(["raw", "fp16", "bf16", "fp32", "zstd", "deflate"]))
    payload, received = make_payload(n=300, k=30, index=index, value=value)
    body = bytearray(payload[:-4])
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(body) - 1))
        body[position] ^= 1 << data.draw(st.integers(0, 7))
    try:
        st_ = dr.decompress(reseal(bytes(body)))
    except dr.DecodeError:
        return
    # A flip that still decodes must give a well-formed tensor.
    assert st_.nnz <= st_.size and np.all(np.diff(st_.indices) > 0)
