"""The formats of benchmarks/outer_formats.py that the outer-step byte benchmark weighs
deepreduce against: the 20-bit format carries exactly the values a deepreduce payload of
the same chunk-wise selection carries, and the Rice/bitmap format's sizes are those of
its description's cost formula."""

import doctest
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import deepreduce as dr

#: (the formats live beside the benchmark: the wheel's tests, which run without the
#: checkout's benchmarks, skip them)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
try:
    formats = pytest.importorskip("benchmarks.outer_formats")
finally:
    del sys.path[0]

STATQ = f"statq:bits=2,sigmas={formats.SIGMAS:g}"


def draw_tensor(seed: int, shape, heavy_tails: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if heavy_tails:
        return rng.standard_t(3, size=shape).astype(np.float32)
    return (1e-3 * rng.standard_normal(shape)).astype(np.float32)


@st.composite
def chunked_tensors(draw):
    """``(x, sparsifier)``: a tensor cut whole into square tiles or flat chunks."""
    chunk = draw(st.sampled_from([256, 1024, 4096]))
    side = math.isqrt(chunk)
    if draw(st.booleans()):
        shape = (side * draw(st.integers(1, 3)), side * draw(st.integers(1, 3)))
    else:  # flat chunks: one dimension, or sides that no tile divides
        shape = draw(st.sampled_from([(chunk * 3,), (3, chunk), (chunk // 2 + 1, 2)]))
        if math.prod(shape) % chunk:
            shape = (chunk * 2,)
    k = draw(st.sampled_from([2, 8, 32, chunk // 64, chunk // 8]))
    x = draw_tensor(draw(st.integers(0, 2**32 - 1)), shape, draw(st.booleans()))
    return x, dr.ChunkTopK(k=k, chunk=chunk)


@settings(max_examples=40, deadline=None)
@given(chunked_tensors())
def test_a_deepreduce_payload_carries_exactly_the_values_of_the_20_bit_format(case):
    x, sparsifier = case
    twenty = formats.pack20_decode(formats.pack20_encode(x, sparsifier), x.shape, sparsifier)
    payload = dr.compress(x, sparsifier=sparsifier, index=f"chunked:chunk={sparsifier.chunk}",
                          value=STATQ)
    ours = dr.decompress(payload)
    assert ours.shape == twenty.shape == x.shape
    assert np.array_equal(ours.indices, twenty.indices)
    assert ours.values.dtype == twenty.values.dtype == np.float32
    assert np.array_equal(ours.values.view(np.uint32), twenty.values.view(np.uint32))
    # the same selection, and four bins' worth of values at most
    assert np.array_equal(twenty.indices, sparsifier(x).indices)
    assert np.unique(twenty.values).size <= formats.BINS


def test_the_20_bit_format_is_20_bits_per_element_and_a_table():
    x = draw_tensor(0, (256, 128), heavy_tails=False)
    sparsifier = dr.ChunkTopK(k=64)
    data = formats.pack20_encode(x, sparsifier, quantiser="templar")
    kept = 8 * 64
    assert len(data) == formats.pack20_size(kept) == 4 * formats.BINS + kept * 20 // 8
    back = formats.pack20_decode(data, x.shape, sparsifier)
    codes, table = formats.templar_codes(sparsifier(x).values)
    assert np.array_equal(back.values, table[codes])


def test_templars_quantiser_rounds_to_steps_of_range_std_over_bins():
    values = np.array([-6.0, -2.0, -0.5, 0.5, 1.0, 7.0])
    codes, table = formats.templar_codes(values, bins=4, sigmas=6)
    centred = values - values.mean()
    step = 6 * centred.std(ddof=1) / 4
    expected = np.clip(np.round(centred / step) + 2, 0, 3)
    assert codes.tolist() == expected.tolist()
    for code in np.unique(codes):  # decoded: the mean of its bin
        assert table[code] == np.float32(values[codes == code].mean())


def test_the_two_quantisers_bin_differently():
    values = draw_tensor(1, 4096, heavy_tails=False).astype(np.float64)
    statq, _ = formats.statq_codes(values)
    templar, _ = formats.templar_codes(values)
    # statq: four bins of 3 sigma from mean - 6 sigma; Templar: steps of 1.5 sigma
    # around the mean, so its codes spread over more of their bins
    assert not np.array_equal(statq, templar)
    assert formats.code_entropy_bits(templar) > formats.code_entropy_bits(statq)


# -- the Rice/bitmap format --------------------------------------------------------------

def described_bits(rows, C, choices=(64, 128)) -> int:
    """The description's cost formula, written out row by row and sub-block by sub-block."""
    total = 12 + 16 + 1
    for row in rows:
        k = len(row)
        best = None
        for B in sorted(b for b in choices if C % b == 0):
            lb = int(math.log2(B))
            r = max(0, round(math.log2(max(k * B / C, 1e-9))))
            counts = [sum(1 for p in row if p // B == j) for j in range(C // B)]
            rice = sum(c // 2**r + 1 + r for c in counts)
            local = 10 + rice + lb * k
            bitmap = 10 + rice + B * sum(1 for c in counts if c)
            bits = min(local, bitmap)
            if best is None or bits < best:
                best = bits
        total += 16 + 8 * math.ceil(best / 8)
    return total


@st.composite
def row_sets(draw):
    C = draw(st.sampled_from([128, 256, 1024, 4096]))
    k = draw(st.integers(1, min(C, 160)))
    N = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if draw(st.booleans()):  # uniform
        rows = np.stack([rng.choice(C, k, replace=False) for _ in range(N)])
    else:                    # clustered: where bitmaps pay
        start = rng.integers(0, C - k + 1, size=N)
        rows = np.stack([s + rng.choice(k + k // 4 if s + k + k // 4 <= C else k, k,
                                        replace=False) for s in start])
    return np.sort(rows, axis=1), C


@settings(max_examples=60, deadline=None)
@given(row_sets())
def test_rice_bitmap_sizes_are_the_descriptions_cost_formula(case):
    rows, C = case
    formula = formats.rice_bitmap_bits(rows, C)
    assert formula == described_bits(rows.tolist(), C)
    data = formats.rice_bitmap_encode(rows, C)
    assert len(data) == math.ceil(formula / 8)
    decoded, decoded_c = formats.rice_bitmap_decode(data)
    assert decoded_c == C and decoded == rows.tolist()


def test_rice_bitmap_on_a_1024_square_gaussian_gives_the_issues_figures():
    x = draw_tensor(0, (1024, 1024), heavy_tails=False)
    bits = {}
    for k in (32, 64, 128):
        sparsifier = dr.ChunkTopK(k=k)
        rows, _ = formats.chunk_rows(sparsifier(x).indices, x.shape, sparsifier)
        bits[k] = round(8 * len(formats.rice_bitmap_encode(rows, 4096)) / rows.size, 2)
    assert bits == {32: 10.0, 64: 8.5, 128: 7.61}


def test_rows_and_indices_round_trip_through_the_tile_layout():
    x = draw_tensor(2, (192, 128), heavy_tails=True)
    sparsifier = dr.ChunkTopK(k=16)
    kept = sparsifier(x)
    rows, order = formats.chunk_rows(kept.indices, x.shape, sparsifier)
    keys = (np.arange(rows.shape[0])[:, None] * 4096 + rows).ravel()
    assert np.array_equal(formats.keys_to_indices(keys, x.shape, sparsifier),
                          kept.indices[order])
    with pytest.raises(ValueError, match="16 in each"):
        formats.chunk_rows(kept.indices[1:], x.shape, sparsifier)


def test_the_module_examples_run():
    result = doctest.testmod(formats, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted and not result.failed
