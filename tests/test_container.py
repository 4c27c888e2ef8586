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


def _header_or_error(read, data):
    try:
        return read(memoryview(data).cast("B"))
    except dr.DecodeError as error:
        return str(error)


@pytest.mark.parametrize("kwargs", [
    {}, {"shape": (300, 200)}, {"shape": (2**40,), "nnz": 2**20}, {"shape": (2**14, 2**14)},
    {"shape": (2,) * 32}, {"shape": (2,) * 33}, {"shape": (2**13,) * 5},
    {"index_spec": "x" * 200}, {"index_spec": "x" * 256}, {"value_spec": "\xe9"},
    {"shape": ()}, {"nnz": 0, "shape": (0,)}, {"flags": 1}, {"flags": 2}, {"dtype": 9}])
def test_usual_header_reader_agrees_with_the_field_by_field_one(kwargs):
    # read_header's fast path must accept exactly what the careful reader accepts, with
    # the same result, and leave everything else to it: every cut and every byte value
    # of the header of payloads with one-, two- and longer-byte fields
    from deepreduce import container
    value_spec = kwargs.pop("value_spec", "raw")
    try:
        payload = hand_made(**kwargs, value_spec=value_spec.encode("latin-1").decode("ascii"))
    except UnicodeDecodeError:
        body = hand_made(**kwargs)[:-4].replace(b"\x03raw", b"\x01" + value_spec.encode("latin-1"))
        payload = reseal(body)
    slow = _header_or_error(container._read_header, payload)
    usual = container._read_usual_header(memoryview(payload).cast("B"))
    assert usual is None or usual == slow
    header_end = slow.header_length if isinstance(slow, container.Header) else 40
    for cut in range(min(len(payload), header_end + 2)):
        assert _header_or_error(container.read_header, payload[:cut]) == \
            _header_or_error(container._read_header, payload[:cut])
    for position in range(min(len(payload), header_end + 1)):
        for byte in (0, 1, 2, 3, 0x7F, 0x80, 0x81, 0xFF):
            edited = bytearray(payload)
            edited[position] = byte
            assert _header_or_error(container.read_header, edited) == \
                _header_or_error(container._read_header, edited)


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=60))
def test_usual_header_reader_agrees_on_any_bytes(tail):
    from deepreduce import container
    for data in (tail, b"DR\x01\x00\x02" + tail):
        assert _header_or_error(container.read_header, data) == \
            _header_or_error(container._read_header, data)


def test_pack_writes_the_same_bytes_as_field_by_field():
    # pack remembers spec bytes and checksums its parts: the payload must be the
    # one written field by field
    from deepreduce import container
    for shape, nnz in [((100,), 3), ((300, 200), 1311), ((2**40,), 2**33)]:
        expected = hand_made(shape=shape, nnz=nnz, index_spec="golomb", value_spec="fp16",
                             index_stream=b"abc", value_stream=b"\x01" * 6)
        # (the fast path reads fields of any length up to 63 bits)
        assert container._read_usual_header(memoryview(expected)) == \
            container._read_header(memoryview(expected))
        for _ in range(2):
            assert container.pack(np.dtype(np.float32), shape, nnz, "golomb", "fp16", b"abc",
                                  b"\x01" * 6) == expected
    with pytest.raises(ValueError, match="longer"):
        container.pack(np.dtype(np.float32), (3,), 1, "x" * 256, "raw", b"", b"")
    with pytest.raises(ValueError):
        container.pack(np.dtype(np.float32), (3,), 1, "\xe9", "raw", b"", b"")
