"""The framework-neutral bundle format (deepreduce.bundle): what one rank sends in one
step, its framing, its table of which tensor lies in which payload, and the checks that
reject a cut, changed or lying bundle before anything is allocated."""

import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import deepreduce as dr
from deepreduce import bundle as bundle_format
from deepreduce.bundle import pack_bundle, split_bundles


payload_lists = st.lists(st.lists(st.binary(max_size=300), max_size=6), min_size=1, max_size=4)


@settings(max_examples=100, deadline=None)
@given(payload_lists)
def test_bundles_round_trip(bundles):
    data = b"".join(pack_bundle(b) for b in bundles)
    split = split_bundles(data, len(bundles))
    assert [[bytes(p) for p in bundle.payloads] for bundle in split] == bundles
    assert [bundle.slots for bundle in split] == [list(range(len(b))) for b in bundles]


def test_every_truncation_and_extension_raises_decode_error():
    data = pack_bundle([b"abc", b"", b"x" * 200]) + pack_bundle([b"yz"])
    for cut in range(len(data)):
        with pytest.raises(dr.DecodeError):
            split_bundles(data[:cut], 2)
    with pytest.raises(dr.DecodeError, match="after the 2 bundles"):
        split_bundles(data + b"\0", 2)
    with pytest.raises(dr.DecodeError):
        split_bundles(data, 3)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.integers(1, 3))
def test_garbage_raises_only_decode_error(data, ranks):
    for candidate in (data, bundle_format.BUNDLE_MAGIC + bytes((1,)) + data,
                      bundle_format.BUNDLE_MAGIC + bytes((2,)) + data):
        try:
            split_bundles(candidate, ranks)
        except dr.DecodeError:
            pass


def test_lying_headers_are_rejected_before_allocating():
    for version in bundle_format.BUNDLE_VERSIONS:
        head = bundle_format.BUNDLE_MAGIC + bytes((version,))
        with pytest.raises(dr.DecodeError, match="declares"):
            split_bundles(head + b"\xff\xff\xff\xff\x0f", 1)          # 2**32 - 1 payloads
    head = bundle_format.BUNDLE_MAGIC + b"\x01"
    with pytest.raises(dr.DecodeError, match="add up to more"):
        split_bundles(head + b"\x01\xff\xff\xff\xff\x0f" + b"abc", 1)  # one huge payload
    with pytest.raises(dr.DecodeError, match="version"):
        split_bundles(bundle_format.BUNDLE_MAGIC + b"\x07\x00", 1)
    with pytest.raises(dr.DecodeError, match="magic"):
        split_bundles(b"DR\x01\x00", 1)


@pytest.mark.parametrize("table, match", [
    (b"\xff\xff\xff\xff\x0f", "declares"),         # 2**32 - 1 tensors
    (b"\x02\x00\x05", "in payload 5 of 2"),
    (b"\x02\x00\x00", "payload 1 holds no tensor"),
    (b"\x03\x00\x01\x00\x41\x01", "65 dimensions"),
    (b"\x03\x00\x01\x00\x02\x01", "shapes"),          # 3 dims declared, 2 follow
])
@pytest.mark.parametrize("version", [2, 3])
def test_lying_tables_are_rejected(table, match, version):
    # two payloads of 1 and 0 bytes, then the table (and its checksum), then the payloads
    head = bundle_format.BUNDLE_MAGIC + bytes((version,)) + b"\x02\x01\x00" + table
    checksum = zlib.crc32(head).to_bytes(4, "little") if version == 3 else b""
    if version == 3 and match == "shapes":
        match = None  # the dimension that is not there is read from the checksum's bytes
    with pytest.raises(dr.DecodeError, match=match):
        split_bundles(head + checksum + b"z", 1)


def test_a_changed_table_fails_its_checksum():
    # payload checksums do not cover which tensor is where: swapping two tensors of one
    # shape, or reshaping one, would go unnoticed without the table's own
    payload = dr.compress(np.arange(8, dtype=np.float32), None, "bitmap", "raw")
    data = pack_bundle([payload, payload], [0, 1, 0, 1], [(2, 2), (4,), (2, 2), (4,)])
    assert split_bundles(data, 1)[0].slots == [0, 1, 0, 1]
    table_end = len(data) - 2 * len(payload) - 4
    for position in range(4, table_end + 4):
        changed = bytearray(data)
        changed[position] ^= 0x01
        with pytest.raises(dr.DecodeError):
            split_bundles(bytes(changed), 1)
    with pytest.raises(dr.DecodeError, match="CRC32 mismatch in its table"):
        split_bundles(data[:6] + b"\x01" + data[7:], 1)   # slots [0, 1, 1, 1]


@st.composite
def shared_bundles(draw):
    """``(payloads, slots, shapes)`` of a bundle whose tensors may share payloads."""
    payloads = draw(st.lists(st.binary(max_size=50), min_size=1, max_size=5))
    extra = draw(st.lists(st.integers(0, len(payloads) - 1), max_size=6))
    slots = draw(st.permutations(list(range(len(payloads))) + extra))
    shared = [t for t, slot in enumerate(slots) if slots.count(slot) > 1]
    shapes = draw(st.lists(st.lists(st.integers(0, 2**40), max_size=4).map(tuple),
                           min_size=len(shared), max_size=len(shared)))
    return payloads, slots, shapes


@settings(max_examples=100, deadline=None)
@given(st.lists(shared_bundles(), min_size=1, max_size=3))
def test_bundles_with_shared_payloads_round_trip(bundles):
    data = b"".join(pack_bundle(*b) for b in bundles)
    for bundle, (payloads, slots, shapes) in zip(split_bundles(data, len(bundles)), bundles):
        assert [bytes(p) for p in bundle.payloads] == payloads and bundle.slots == slots
        shared = [t for t, slot in enumerate(slots) if slots.count(slot) > 1]
        assert bundle.shapes == dict(zip(shared, shapes))
    for cut in range(len(data)):
        with pytest.raises(dr.DecodeError):
            split_bundles(data[:cut], len(bundles))


@pytest.mark.parametrize("payloads", [3, bundle_format._FEW_VARINTS + 20])
def test_long_and_short_fields_read_alike(payloads):
    # a field of a few varints is read one by one, a longer one in whole-array passes
    rng = np.random.default_rng(payloads)
    data = [bytes(rng.integers(0, 256, rng.integers(0, 300), dtype=np.uint8))
            for _ in range(payloads)]
    slots = list(range(payloads)) + rng.integers(0, payloads, payloads).tolist()
    shared = [t for t, slot in enumerate(slots) if slots.count(slot) > 1]
    shapes = [tuple(rng.integers(0, 2**40, rng.integers(0, 4)).tolist()) for _ in shared]
    bundle = split_bundles(pack_bundle(data, slots, shapes), 1)[0]
    assert [bytes(p) for p in bundle.payloads] == data and bundle.slots == slots
    assert bundle.shapes == dict(zip(shared, shapes))
    truncated = pack_bundle(data, slots, shapes)[:-sum(map(len, data)) - 5]
    with pytest.raises(dr.DecodeError):
        split_bundles(truncated, 1)


def _read_or_error(data, ranks):
    try:
        return [([bytes(p) for p in b.payloads], b.slots, b.shapes, bytes(b.data))
                for b in split_bundles(data, ranks)]
    except dr.DecodeError as error:
        return str(error)


@settings(max_examples=50, deadline=None)
@given(shared_bundles(), st.data())
def test_remembered_tables_read_as_fresh_ones(bundle, data):
    # a table read before is looked up by its bytes: what the lookup gives, and what
    # every changed or cut bundle gives, must be what reading it afresh gives
    packed = pack_bundle(*bundle)
    bundle_format._READ_TABLES.clear()
    bundle_format._READ_TABLE_LENGTHS.clear()
    fresh = _read_or_error(packed, 1)
    assert bundle_format._READ_TABLES  # (remembered)
    remembered = split_bundles(packed, 1)[0]
    assert _read_or_error(packed, 1) == fresh
    remembered.slots.append(7)  # a caller's change reaches no later read
    remembered.shapes[99] = (1,)
    assert _read_or_error(packed, 1) == fresh
    edits = [packed[:cut] for cut in range(len(packed))]
    for _ in range(20):
        edited = bytearray(packed)
        edited[data.draw(st.integers(4, len(packed) - 1))] = data.draw(st.integers(0, 255))
        edits.append(bytes(edited))
    for edited in edits:
        outcome = _read_or_error(edited, 1)
        bundle_format._READ_TABLES.clear()
        bundle_format._READ_TABLE_LENGTHS.clear()
        assert _read_or_error(edited, 1) == outcome
        split_bundles(packed, 1)  # (remembered again for the next one)


def test_pack_bundle_refuses_inconsistent_tables():
    with pytest.raises(ValueError, match="must name each"):
        pack_bundle([b"a", b"b"], [0, 0])
    with pytest.raises(ValueError, match="must name each"):
        pack_bundle([b"a"], [0, 1])
    with pytest.raises(ValueError, match="1 shapes for the 2 tensors"):
        pack_bundle([b"a", b"b"], [0, 0, 1], [(3,)])


@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.data())
def test_split_shared_gives_the_same_tensors_in_place_or_not(sizes, data):
    total = sum(sizes)
    indices = np.array(sorted(data.draw(st.sets(st.integers(0, total - 1)))), np.int64)
    whole = dr.SparseTensor(np.arange(indices.size, dtype=np.float32), indices, (total,))
    shapes, dense = [(size,) for size in sizes], whole.to_dense()
    copied = bundle_format.split_shared(whole, shapes)
    assert whole.indices.tolist() == indices.tolist()  # (read, not written)
    frozen = indices.copy()
    frozen.flags.writeable = False  # (as a codec's view of its stream may be)
    read_only = bundle_format.split_shared(
        dr.SparseTensor(whole.values, frozen, (total,)), shapes, overwrite=True)
    in_place = bundle_format.split_shared(whole, shapes, overwrite=True)
    starts = np.cumsum([0, *sizes])
    for size, start, *parts in zip(sizes, starts, copied, read_only, in_place):
        for part in parts:
            assert part.shape == (size,) and part.indices.dtype == np.int64
            assert np.array_equal(part.to_dense(), dense[start:start + size])
