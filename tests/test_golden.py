"""Golden payloads pin the wire format: every fixture is decoded, never re-encoded.

Each ``tests/fixtures/NAME.drz`` (a payload, a Horovod bundle or a collectives
frame, written by some earlier version of deepreduce) sits next to
``NAME.npz``, the arrays it decodes to. The test decodes the old bytes with
today's code and compares, as numcodecs' ``check_backwards_compatibility``
does: a better encoder changes nothing here, a decoder that reads a released
layout differently fails. The policy is in docs/format.md.

``python tests/test_golden.py --write`` adds the fixtures of new cases; it
never rewrites an existing one.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

import deepreduce as dr
from deepreduce.collectives import frames
from deepreduce.bundle import pack_bundle, split_bundles

FIXTURES = Path(__file__).parent / "fixtures"

#: name: (shape, dtype, sparsifier, index spec, value spec). Every codec, and every
#: parameter that changes a layout (bit widths, norms, Bloom policies, value order).
PAYLOADS = {
    "varint_raw_f32": ((20, 50), np.float32, dr.TopK(k=40), "varint", "raw"),
    "eliasfano_fp16_f32": ((1000,), np.float32, dr.TopK(k=40), "eliasfano", "fp16"),
    "bitmap_bf16_f32": ((1000,), np.float32, dr.TopK(k=300), "bitmap", "bf16"),
    "zstd_zstd_f64": ((4, 250), np.float64, dr.TopK(k=40), "zstd:level=9", "zstd"),
    "deflate_deflate_f16": ((1000,), np.float16, dr.TopK(k=40), "deflate", "deflate"),
    "rle_fp32_f64": ((1000,), np.float64, dr.BlockTopK(0.1, block=16), "rle", "fp32"),
    "bitpack_raw_f32": ((1000,), np.float32, dr.TopK(k=40), "bitpack", "raw"),
    "blockpack_raw_f32": ((2000,), np.float32, dr.TopK(k=300), "blockpack", "raw"),
    "raw_raw_empty": ((0,), np.float32, None, "raw", "raw"),
    # auto's tag table names other codecs' default streams: these pin all of them
    "auto_fp16_small": ((1000,), np.float32, dr.TopK(k=40), "auto", "fp16"),
    "auto_raw_large": ((200_000,), np.float32, dr.TopK(0.01), "auto", "raw"),
    "auto_raw_blocks": ((4096,), np.float32, dr.BlockTopK(0.25, block=64), "auto", "raw"),
    "golomb_raw_f32": ((1000,), np.float32, dr.TopK(k=40), "golomb", "raw"),
    "huffman_raw_f32": ((5000,), np.float32, dr.TopK(k=500), "huffman", "raw"),
    "runs_raw_f32": ((4096,), np.float32, dr.BlockTopK(0.25, block=64), "runs", "raw"),
    "raw_qsgd2_f32": ((2000,), np.float32, dr.TopK(k=300), "raw", "qsgd:bits=2"),
    "varint_qsgd4_f32": ((2000,), np.float32, dr.TopK(k=300), "varint", "qsgd"),
    "varint_qsgd8_l2_f64": ((2000,), np.float64, dr.TopK(k=300), "varint",
                            "qsgd:bits=8,norm=l2,bucket=64"),
    "varint_sign_f32": ((2000,), np.float32, dr.TopK(k=300), "varint", "sign"),
    "valueorder_polyfit_f32": ((3000,), np.float32, dr.TopK(k=400), "auto", "polyfit"),
    "valueorder_dexp_f32": ((3000,), np.float32, dr.TopK(k=400), "auto", "dexp"),
    "bloom_p0_f32": ((4000,), np.float32, dr.TopK(k=200), "bloom:fpr=0.01", "raw"),
    "bloom_leftmost_f32": ((4000,), np.float32, dr.TopK(k=200),
                           "bloom:fpr=0.01,policy=leftmost", "raw"),
    "bloom_random_f32": ((4000,), np.float32, dr.TopK(k=200),
                         "bloom:fpr=0.01,policy=random", "raw"),
    "bloom_conflict_sets_f32": ((4000,), np.float32, dr.TopK(k=200),
                                "bloom:fpr=0.01,policy=conflict_sets", "raw"),
    "bloom_naive_f32": ((4000,), np.float32, dr.TopK(k=200),
                        "bloom:fpr=0.01,policy=naive", "raw"),
    # chunked's three layouts: tiles, flat chunks with a shorter last one, and auto
    "chunked_tiles_f32": ((128, 192), np.float32, dr.ChunkTopK(k=16, chunk=1024),
                          "chunked:chunk=1024", "raw"),
    "chunked_flat_f32": ((3000,), np.float32, dr.ChunkTopK(k=5, chunk=256), "chunked:chunk=256",
                         "raw"),
    "chunked_general_f32": ((5000,), np.float32, dr.TopK(k=200), "chunked", "raw"),
    # statq's two layouts of codes: a zstd frame of grouped codes, and packed fields
    "chunked_statq2_f32": ((256, 256), np.float32, dr.ChunkTopK(k=64), "chunked", "statq"),
    "raw_statq8_f64": ((1000,), np.float64, dr.TopK(k=40), "raw", "statq:bits=8,sigmas=3"),
}

#: Framings around payloads: the Horovod bundle and the collectives' frames.
FRAMINGS = ("bundle_two_tensors", "bundle_shared_payload", "bundle_table_checksum",
            "frame_sparse", "frame_dense", "frame_blocks",
            "frame_counts")


def case_input(shape, dtype, seed=2026):
    # PCG64 streams are stable across numpy versions, so the input is reproducible
    x = np.random.default_rng(seed).standard_normal(int(np.prod(shape))).astype(dtype)
    return x.reshape(shape)


def encode_payload(name):
    shape, dtype, sparsifier, index, value = PAYLOADS[name]
    return dr.Pipeline(sparsifier, index, value).encode(case_input(shape, dtype))[0]


def encode_framing(name) -> bytes:
    """The bytes of a framing case (written once, then only decoded)."""
    first = dr.compress(case_input((300,), np.float32), dr.TopK(k=30), "varint", "fp16")
    if name == "bundle_two_tensors":
        second = dr.compress(case_input((40, 5), np.float64, 7), None, "bitmap", "raw")
        return pack_bundle([first, second])
    if name in ("bundle_shared_payload", "bundle_table_checksum"):
        # tensors 0 and 2 (shapes (4, 5) and (7,)) share payload 1, flattened and
        # concatenated; tensor 1 is payload 0
        small = np.concatenate([case_input((4, 5), np.float32, 3).ravel(),
                                np.zeros(3, np.float32), case_input((4,), np.float32, 4)])
        payloads = [first, dr.compress(small, None, "bitmap", "raw")]
        data = pack_bundle(payloads, [1, 0, 1], [(4, 5), (7,)])   # version 3
        if name == "bundle_table_checksum":
            return data
        # version 2, as pack_bundle wrote it before the checksum of its table
        head = data[:len(data) - sum(map(len, payloads)) - 4]
        return head[:3] + b"\x02" + head[4:] + b"".join(payloads)
    if name == "frame_sparse":
        return frames.sparse_frame(first)
    if name == "frame_dense":
        values = case_input((64,), np.float32)
        return frames.dense_frame(values.tobytes(), np.dtype(np.float32), 64, "raw")
    if name == "frame_blocks":
        rows = case_input((3, 8), np.float32)
        ids = dr.get_codec("varint", family="index").encode(np.array([0, 2, 5]), 6)
        return frames.blocks_frame(ids, rows.tobytes(), np.dtype(np.float32), 6, 8, 3,
                                   "varint", "raw")
    if name == "frame_counts":
        return frames.counts_frame(30, 40, 60)
    raise KeyError(name)


def decode_case(name, data) -> dict:
    """Every array the bytes of case ``name`` decode to, by name."""
    if name in PAYLOADS:
        st = dr.decompress(data)
        return {"values": st.values, "indices": st.indices, "shape": np.array(st.shape)}
    if name.startswith("bundle_"):
        bundle, out = split_bundles(data, 1)[0], {}
        for i, st in enumerate(bundle.tensors([dr.decompress(p) for p in bundle.payloads])):
            out.update({f"values{i}": st.values, f"indices{i}": st.indices,
                        f"shape{i}": np.array(st.shape)})
        return out
    if name == "frame_sparse":
        st = frames.read_frame(data, 300, np.dtype(np.float32))
        return {"values": st.values, "indices": st.indices}
    if name == "frame_dense":
        return {"values": frames.read_frame(data, 64, np.dtype(np.float32))}
    if name == "frame_blocks":
        blocks = frames.read_frame(data, 48, np.dtype(np.float32), block_size=8)
        return {"ids": blocks.ids, "rows": blocks.rows}
    if name == "frame_counts":
        return {"counts": np.array(frames.read_counts(data, 300))}
    raise KeyError(name)


CASES = sorted(PAYLOADS) + list(FRAMINGS)


@pytest.mark.parametrize("name", CASES)
def test_fixture_decodes_to_its_pinned_arrays(name):
    data = (FIXTURES / f"{name}.drz").read_bytes()
    with np.load(FIXTURES / f"{name}.npz") as pinned:
        expected = {key: pinned[key] for key in pinned.files}
    decoded = decode_case(name, data)
    assert sorted(decoded) == sorted(expected)
    for key, array in decoded.items():
        assert array.dtype == expected[key].dtype, key
        assert np.array_equal(array, expected[key], equal_nan=True), key


@pytest.mark.parametrize("name", sorted(PAYLOADS))
def test_encoders_are_deterministic_and_decodable(name):
    # separate from the fixtures: the encoder may improve, its output must still
    # be the same twice over and decode to what it says it sends
    shape, dtype, sparsifier, index, value = PAYLOADS[name]
    pipeline = dr.Pipeline(sparsifier, index, value)
    again = dr.Pipeline(sparsifier, index, value)
    payload, received = pipeline.encode(case_input(shape, dtype))
    assert again.encode(case_input(shape, dtype))[0] == payload
    assert dr.decompress(payload) == received


def test_every_fixture_has_a_case():
    assert sorted(p.stem for p in FIXTURES.glob("*.drz")) == sorted(CASES)
    assert sorted(p.stem for p in FIXTURES.glob("*.npz")) == sorted(CASES)


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    FIXTURES.mkdir(exist_ok=True)
    for case in CASES:
        bytes_path, arrays_path = FIXTURES / f"{case}.drz", FIXTURES / f"{case}.npz"
        if not bytes_path.exists():   # released bytes are never rewritten
            bytes_path.write_bytes(encode_payload(case) if case in PAYLOADS
                                   else encode_framing(case))
            print("wrote", bytes_path.name)
        if not arrays_path.exists():
            np.savez(arrays_path, **decode_case(case, bytes_path.read_bytes()))
            print("wrote", arrays_path.name)
