"""Golden payloads pin format version 1: the bytes of tests/fixtures/*.drz must not change.

Regenerate (only together with a format version bump) with
``python tests/test_golden.py --write``.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

import deepreduce as dr

FIXTURES = Path(__file__).parent / "fixtures"
CASES = {
    # name: (shape, dtype, sparsifier, index spec, value spec)
    "varint_raw_f32": ((20, 50), np.float32, dr.TopK(k=40), "varint", "raw"),
    "eliasfano_fp16_f32": ((1000,), np.float32, dr.TopK(k=40), "eliasfano", "fp16"),
    "bitmap_bf16_f32": ((1000,), np.float32, dr.TopK(k=300), "bitmap", "bf16"),
    "zstd_zstd_f64": ((4, 250), np.float64, dr.TopK(k=40), "zstd:level=9", "zstd"),
    "deflate_deflate_f16": ((1000,), np.float16, dr.TopK(k=40), "deflate", "deflate"),
    "rle_fp32_f64": ((1000,), np.float64, dr.BlockTopK(0.1, block=16), "rle", "fp32"),
    "bitpack_raw_f32": ((1000,), np.float32, dr.TopK(k=40), "bitpack", "raw"),
    "raw_raw_empty": ((0,), np.float32, None, "raw", "raw"),
    # auto's tag table names other codecs' default streams: these pin all of them
    "auto_fp16_small": ((1000,), np.float32, dr.TopK(k=40), "auto", "fp16"),
    "auto_raw_large": ((200_000,), np.float32, dr.TopK(0.01), "auto", "raw"),
    "auto_raw_blocks": ((4096,), np.float32, dr.BlockTopK(0.25, block=64), "auto", "raw"),
    "golomb_raw_f32": ((1000,), np.float32, dr.TopK(k=40), "golomb", "raw"),
    "huffman_raw_f32": ((5000,), np.float32, dr.TopK(k=500), "huffman", "raw"),
    "runs_raw_f32": ((4096,), np.float32, dr.BlockTopK(0.25, block=64), "runs", "raw"),
}


def case_input(shape, dtype):
    # PCG64 streams are stable across numpy versions, so the input is reproducible
    x = np.random.default_rng(2026).standard_normal(int(np.prod(shape))).astype(dtype)
    return x.reshape(shape)


def encode_case(name):
    shape, dtype, sparsifier, index, value = CASES[name]
    return dr.Pipeline(sparsifier, index, value).encode(case_input(shape, dtype))


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_payload_decodes_to_the_pinned_tensor(name):
    payload = (FIXTURES / f"{name}.drz").read_bytes()
    fresh, received = encode_case(name)
    assert dr.decompress(payload) == received
    assert payload == fresh, "the encoder no longer writes format version 1 byte for byte"


def test_every_fixture_has_a_case():
    assert sorted(p.stem for p in FIXTURES.glob("*.drz")) == sorted(CASES)


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    FIXTURES.mkdir(exist_ok=True)
    for case in CASES:
        (FIXTURES / f"{case}.drz").write_bytes(encode_case(case)[0])
        print("wrote", case)
