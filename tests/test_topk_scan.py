"""TopK's candidate scan: the compiled one (deepreduce._topkscan) and numpy's agree exactly.

``sparsifiers._at_least`` gives the sorted positions where ``|values| >= low``.
Tests that take the ``implementation`` fixture run once with the C scan and
once with it switched off; ``both`` runs the two in one test and compares.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import deepreduce as dr
from deepreduce import sparsifiers
from deepreduce.sparsifiers import _SCAN_SLICE, _at_least
import extensions

compiled_only = pytest.mark.skipif(sparsifiers._topkscan is None,
                                   reason="deepreduce._topkscan is not built")
#: The C scan tests 64 values at a time; numpy goes by _SCAN_SLICE.
BLOCK = 64
EDGE_SIZES = sorted({0, 1, 2, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK + 1,
                     _SCAN_SLICE - 1, _SCAN_SLICE, _SCAN_SLICE + 1, _SCAN_SLICE + BLOCK + 3,
                     3 * _SCAN_SLICE - 1, 3 * _SCAN_SLICE + 5})


implementation = extensions.fixture(sparsifiers, "_topkscan", "implementation")


def both(function, *args):
    """``function(*args)`` with the C scan and with numpy's."""
    return extensions.both(sparsifiers, "_topkscan", function, *args)


def same_positions(outcomes):
    compiled, numpy = outcomes
    assert compiled.dtype == numpy.dtype == np.int64
    np.testing.assert_array_equal(compiled, numpy)
    return compiled


def specials(dtype):
    info = np.finfo(dtype)
    return np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, info.smallest_subnormal,
                     -info.smallest_subnormal, info.smallest_normal, info.max, -info.max],
                    dtype=dtype)


def test_implementation_flag_matches_the_build():
    assert sparsifiers.SCAN_IMPLEMENTATION == ("numpy" if sparsifiers._topkscan is None
                                               else "compiled")


# ------------------------------------------------------------------ the scan itself

@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from([np.float32, np.float64]),
       size=st.one_of(st.sampled_from(EDGE_SIZES), st.integers(0, 3 * BLOCK),
                      st.integers(0, 3 * _SCAN_SLICE)),
       seed=st.integers(0, 2**32 - 1), special_share=st.sampled_from([0.0, 0.01, 0.5]),
       low_kind=st.sampled_from(["zero", "minus_zero", "inf", "minus_inf", "nan", "subnormal",
                                 "from_array", "quantile", "any"]),
       quantile=st.sampled_from([0.0, 0.5, 0.98, 0.99, 0.999, 1.0]),
       any_low=st.floats(width=32))
def test_compiled_and_numpy_scans_agree(dtype, size, seed, special_share, low_kind, quantile,
                                        any_low):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(size).astype(dtype)
    if size and special_share:
        where = rng.random(size) < special_share
        x[where] = rng.choice(specials(dtype), int(where.sum()))
    finite = np.abs(x[np.isfinite(x)])
    low = {"zero": 0.0, "minus_zero": -0.0, "inf": np.inf, "minus_inf": -np.inf,
           "nan": np.nan, "subnormal": np.finfo(dtype).smallest_subnormal,
           "from_array": x[rng.integers(size)] if size else 1.0,
           "quantile": np.quantile(finite, quantile) if finite.size else 1.0,
           "any": any_low}[low_kind]
    low = dtype(low)
    got = same_positions(both(_at_least, x, low))
    np.testing.assert_array_equal(got, np.flatnonzero(np.abs(x) >= low))


@settings(max_examples=100, deadline=None)
@given(dtype=st.sampled_from([np.float32, np.float64]),
       size=st.one_of(st.sampled_from(EDGE_SIZES), st.integers(0, 3 * _SCAN_SLICE)),
       seed=st.integers(0, 2**32 - 1), special_share=st.sampled_from([0.0, 0.01, 0.5]),
       quantile=st.sampled_from([0.0, 0.5, 0.99, 1.0]))
def test_scan_adding_an_addend_is_numpy_add_then_scan(dtype, size, seed, special_share,
                                                       quantile):
    rng = np.random.default_rng(seed)
    residual = rng.standard_normal(size).astype(dtype)
    addend = (rng.standard_normal(size) * rng.choice([1e-30, 1.0, 1e30], size)).astype(dtype)
    if size and special_share:
        where = rng.random(size) < special_share
        addend[where] = rng.choice(specials(dtype), int(where.sum()))
    expected_sum = residual + addend
    finite = np.abs(expected_sum[np.isfinite(expected_sum)])
    low = dtype(np.quantile(finite, quantile) if finite.size else 1.0)
    sums = [residual.copy(), residual.copy()]
    calls = iter(sums)
    got = same_positions(both(lambda: _at_least(next(calls), low, addend)))
    np.testing.assert_array_equal(got, np.flatnonzero(np.abs(expected_sum) >= low))
    for values in sums:  # the same bits as numpy's addition, NaNs included
        np.testing.assert_array_equal(values.view(f"u{values.itemsize}"),
                                      expected_sum.view(f"u{values.itemsize}"))


@compiled_only
@settings(max_examples=100, deadline=None)
@given(size=st.one_of(st.sampled_from(EDGE_SIZES), st.integers(0, 3 * _SCAN_SLICE)),
       seed=st.integers(0, 2**32 - 1), special_share=st.sampled_from([0.0, 0.01, 0.5]),
       quantile=st.sampled_from([0.0, 0.9, 0.99, 1.0]), adding=st.booleans())
def test_avx2_and_sse2_float_blocks_find_and_add_the_same(size, seed, special_share, quantile,
                                                         adding):
    scan = sparsifiers._topkscan
    rng = np.random.default_rng(seed)
    residual = rng.standard_normal(size).astype(np.float32)
    addend = rng.standard_normal(size).astype(np.float32) if adding else None
    if size and special_share:
        where = rng.random(size) < special_share
        residual[where] = rng.choice(specials(np.float32), int(where.sum()))
    finite = np.abs(residual[np.isfinite(residual)])
    low = np.float32(np.quantile(finite, quantile) if finite.size else 1.0)
    k = int(np.count_nonzero(np.abs(residual + (0 if addend is None else addend)) >= low)) // 2
    outcomes = []
    previous = scan._set_avx2(True)
    try:
        for avx2 in (True, False):  # (where the processor lacks AVX2 both take SSE2)
            scan._set_avx2(avx2)
            values = [residual.copy(), residual.copy()]
            outcomes.append((scan.at_least(values[0], low, addend),
                             scan.largest_at_least(values[1], low, k, addend),
                             [v.view(np.uint32) for v in values]))
    finally:
        scan._set_avx2(previous)
    (hits, (positions, selected), sums), (hits_2, (positions_2, selected_2), sums_2) = outcomes
    np.testing.assert_array_equal(hits, hits_2)
    np.testing.assert_array_equal(positions, positions_2)
    np.testing.assert_array_equal(selected.view(np.uint32), selected_2.view(np.uint32))
    for a, b in zip(sums, sums_2):
        np.testing.assert_array_equal(a, b)


@compiled_only
@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from([np.float32, np.float64]),
       size=st.one_of(st.sampled_from(EDGE_SIZES), st.integers(0, 3 * _SCAN_SLICE)),
       seed=st.integers(0, 2**32 - 1), special_share=st.sampled_from([0.0, 0.01, 0.5]),
       distinct=st.sampled_from([3, 50, None]), quantile=st.sampled_from([0.0, 0.9, 0.99]),
       k_share=st.sampled_from([0.0, 0.5, 1.0, None]), adding=st.booleans())
def test_compiled_largest_at_least_is_the_numpy_selection(dtype, size, seed, special_share,
                                                          distinct, quantile, k_share,
                                                          adding):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(size).astype(dtype)
    if distinct:  # few distinct magnitudes: ties at the k-th
        x = (rng.integers(1, distinct + 1, size) * rng.choice([-1, 1], size)).astype(dtype)
    if size and special_share:
        where = rng.random(size) < special_share
        x[where] = rng.choice(specials(dtype), int(where.sum()))
    addend = rng.standard_normal(size).astype(dtype) if adding else None
    total = x + addend if adding else x
    finite = np.abs(total[np.isfinite(total)])
    low = dtype(np.quantile(finite, quantile) if finite.size else 1.0)
    candidates = np.flatnonzero(np.abs(total) >= low)
    k = candidates.size + 1 if k_share is None else int(k_share * candidates.size)
    got = sparsifiers._topkscan.largest_at_least(x, low, k, addend)
    np.testing.assert_array_equal(x, total)
    if k > candidates.size:
        assert got is None
        return
    ranked = np.where(np.isnan(total[candidates]), -np.inf, np.abs(total[candidates]))
    expected = candidates[sparsifiers._largest(ranked, k)]
    positions, selected = got
    assert positions.dtype == np.int64 and selected.dtype == dtype
    np.testing.assert_array_equal(positions, expected)
    # the values kept by the scan are the sums' own bits (NaN payloads, signed zeros)
    np.testing.assert_array_equal(selected.view(f"u{x.itemsize}"),
                                  total[expected].view(f"u{x.itemsize}"))


@compiled_only
def test_scans_running_together_in_threads_each_get_their_own_buffers():
    # the scan lends its buffers to the next one and drops the GIL while it runs:
    # threads scanning at once, float32 and float64 of different sizes mixed, must
    # get what each gets alone
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal(size).astype(dtype)
              for size, dtype in [(300_000, np.float32), (70_001, np.float64),
                                  (1 << 18, np.float32), (5_000, np.float64)]]

    def select(x):
        low = x.dtype.type(np.quantile(np.abs(x), 0.95))
        return sparsifiers._topkscan.largest_at_least(x, low, x.size // 50)

    alone = [select(x) for x in arrays]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(select, arrays * 25))
    for i, (positions, values) in enumerate(together):
        np.testing.assert_array_equal(positions, alone[i % len(arrays)][0])
        np.testing.assert_array_equal(values, alone[i % len(arrays)][1])


@compiled_only
def test_compiled_scan_refuses_bad_arguments():
    x = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="k must be"):
        sparsifiers._topkscan.largest_at_least(x, np.float32(1), -1)
    with pytest.raises(TypeError, match="addend"):
        sparsifiers._topkscan.at_least(x, np.float32(1), np.ones(10, np.float64))
    with pytest.raises(TypeError, match="addend"):
        sparsifiers._topkscan.at_least(x, np.float32(1), np.ones(9, np.float32))
    with pytest.raises(TypeError, match="writable"):
        x.flags.writeable = False
        sparsifiers._topkscan.at_least(x, np.float32(1), np.ones(10, np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size", EDGE_SIZES)
def test_every_value_qualifying_grows_the_output_to_the_whole_array(implementation, dtype,
                                                                    size):
    x = np.arange(size, dtype=dtype) - size // 2
    np.testing.assert_array_equal(_at_least(x, dtype(0)), np.arange(size))
    np.testing.assert_array_equal(_at_least(x, dtype(-np.inf)), np.arange(size))
    assert _at_least(x, dtype(np.nan)).size == 0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_hits_at_every_place_in_a_block(implementation, dtype):
    size = 5 * BLOCK + 7
    for count in (1, 2, 3, BLOCK - 1):
        rng = np.random.default_rng(count)
        x = rng.uniform(-1, 1, size).astype(dtype)
        hits = np.sort(rng.choice(size, count * 5, replace=False))
        x[hits] = np.where(rng.random(hits.size) < 0.5, -2, 2)
        x[hits[::2]] = np.copysign(np.inf, x[hits[::2]])
        np.testing.assert_array_equal(_at_least(x, dtype(2)), hits)
    for position in (0, 1, BLOCK - 1, BLOCK, size - 1):
        x = np.zeros(size, dtype)
        x[position] = -np.finfo(dtype).smallest_subnormal
        np.testing.assert_array_equal(_at_least(x, dtype(np.finfo(dtype).smallest_subnormal)),
                                      [position])
        np.testing.assert_array_equal(_at_least(x, dtype(-0.0)), np.arange(size))


def test_minus_zero_and_nan_values(implementation):
    x = np.array([-0.0, 0.0, np.nan, -np.nan, 1.0, -1.0, np.inf, -np.inf], np.float32)
    np.testing.assert_array_equal(_at_least(x, np.float32(0.0)), [0, 1, 4, 5, 6, 7])
    np.testing.assert_array_equal(_at_least(x, np.float32(-0.0)), [0, 1, 4, 5, 6, 7])
    np.testing.assert_array_equal(_at_least(x, np.float32(np.inf)), [6, 7])
    assert _at_least(x, np.float32(np.nan)).size == 0


def test_views_and_other_dtypes_take_the_numpy_scan_with_the_same_result(implementation):
    rng = np.random.default_rng(3)
    base = rng.standard_normal(3 * BLOCK + 1)
    for x in (base.astype(np.float32)[::2], base[::-1], base.astype(">f4"), base.astype(">f8"),
              base.astype(np.float16)):
        low = x.dtype.type(1.0)
        np.testing.assert_array_equal(_at_least(x, low), np.flatnonzero(np.abs(x) >= low))


# ------------------------------------------------------------------ TopK on top of it

@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("ratio", [1e-4, 0.01, 0.3])
def test_topk_selects_the_same_under_both_scans(dtype, ratio):
    rng = np.random.default_rng(int(ratio * 1e4))
    x = rng.standard_normal(3 * dr.TopK.SAMPLE + 11).astype(dtype)
    x[rng.integers(0, x.size, 200)] = 3.0  # ties at the top
    x[rng.integers(0, x.size, 20)] = np.nan
    for exact in (False, True):
        fast, slow = both(lambda: dr.TopK(ratio, exact=exact)(x))
        assert fast == slow
        assert fast == dr.TopK(ratio, exact=True)(x)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k_share=st.floats(0, 1),
       size=st.one_of(st.integers(dr.TopK.COMPILED_EXACT_BELOW,
                                  dr.TopK.COMPILED_EXACT_BELOW + 3 * BLOCK),
                      st.integers(dr.TopK.EXACT_BELOW, dr.TopK.EXACT_BELOW + 3 * BLOCK)))
def test_topk_sampled_and_exact_agree_under_both_scans(seed, k_share, size):
    # from COMPILED_EXACT_BELOW values the compiled sample runs, from EXACT_BELOW numpy's
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(size).astype(np.float32)
    x[rng.integers(0, size, 50)] = rng.choice([0.0, -0.0, 1.5, np.inf, np.nan], 50)
    k = int(k_share * size)
    compiled, numpy = both(lambda: dr.TopK(k=k)(x))
    assert compiled == numpy == dr.TopK(k=k, exact=True)(x)
    residual = rng.standard_normal(size).astype(np.float32)
    expected = dr.TopK(k=k, exact=True)(residual + x)
    for sampled in both(lambda: dr.TopK(k=k).accumulate(residual.copy(), x)):
        assert sampled == expected


# ------------------------------------------------------------------ the C entry point

@compiled_only
def test_c_scan_returns_a_fresh_int64_array():
    x = np.array([3.0, -1.0, 4.0], np.float32)
    x.setflags(write=False)  # read-only input is fine
    got = sparsifiers._topkscan.at_least(x, 2.0)
    assert isinstance(got, np.ndarray) and got.dtype == np.int64 and got.flags.writeable
    assert got.flags.owndata and got.tolist() == [0, 2]
    assert sparsifiers._topkscan.at_least(np.zeros(0), 0.0).shape == (0,)
    assert sparsifiers._topkscan.at_least(memoryview(x), 2.0).tolist() == [0, 2]


@compiled_only
@pytest.mark.parametrize("values", [
    np.zeros(8, np.int32), np.zeros(8, np.float16), np.zeros(8, np.int64),
    np.zeros(8, np.complex64), np.zeros((2, 4), np.float32), np.zeros((2, 4), np.float64),
    np.zeros(16, np.float32)[::2], np.zeros(8, ">f4"), np.zeros(8, ">f8"),
    np.zeros((), np.float32), [1.0, 2.0], b"\x00" * 16, None, "abc"])
def test_c_scan_refuses_other_buffers_with_type_error(values):
    with pytest.raises(TypeError):
        sparsifiers._topkscan.at_least(values, 0.0)


@compiled_only
@pytest.mark.parametrize("args", [(np.zeros(4),), (np.zeros(4), "1"), (np.zeros(4), None),
                                  (np.zeros(4), 1.0, 2.0), ()])
def test_c_scan_refuses_wrong_arguments_with_type_error(args):
    with pytest.raises(TypeError):
        sparsifiers._topkscan.at_least(*args)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("ratio", [1e-4, 0.01, 0.3])
def test_topk_accumulate_selects_what_topk_selects_from_the_sum(dtype, ratio):
    rng = np.random.default_rng(int(ratio * 1e4) + 1)
    target = rng.standard_normal(3 * dr.TopK.SAMPLE + 11).astype(dtype)
    addend = rng.standard_normal(target.size).astype(dtype)
    addend[rng.integers(0, target.size, 200)] = 3.0  # ties at the top
    addend[rng.integers(0, target.size, 20)] = np.nan
    expected = dr.TopK(ratio, exact=True)(target + addend)
    for implementation in both(lambda: dr.TopK(ratio).accumulate(target.copy(), addend)):
        assert implementation == expected
    # an addend overlapping the target is added as numpy adds it, then selected
    overlapping = target.copy()
    got = dr.TopK(ratio).accumulate(overlapping[1:], overlapping[:-1])
    shifted = target[1:] + target[:-1]
    assert got == dr.TopK(ratio, exact=True)(shifted)


# ------------------------------------------------------------------ the sampled threshold

def numpy_low(values, k, count):
    """The threshold rule of TopK._sampled_low on a sample of all ``values``."""
    expected = count * k / values.size
    j = min(count, int(expected + 4 * np.sqrt(expected) + 2))
    return np.partition(sparsifiers._magnitudes(values), count - j)[count - j]


@compiled_only
@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([np.float32, np.float64]), size=st.integers(1, 600),
       seed=st.integers(0, 2**32 - 1), k_share=st.floats(0, 1), adding=st.booleans(),
       special_share=st.sampled_from([0.0, 0.1, 0.9]))
def test_sampled_low_over_every_value_is_numpy_order_statistic(dtype, size, seed, k_share,
                                                               adding, special_share):
    # a sample as large as the tensor holds each value once: the C threshold is then
    # exactly the order statistic numpy's rule takes
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(size).astype(dtype)
    mask = rng.random(size) < special_share
    values[mask] = rng.choice(specials(dtype), int(mask.sum()))
    addend = rng.standard_normal(size).astype(dtype) if adding else None
    before = values.copy()
    k = int(k_share * size)
    got = sparsifiers._topkscan.sampled_low(values, k, size, seed, addend)
    summed = values if addend is None else values + addend
    expected = numpy_low(summed, k, size)
    assert got == expected or (np.isneginf(expected) and np.isneginf(got))
    np.testing.assert_array_equal(values, before)  # read, never written


@compiled_only
def test_sampled_low_draws_one_value_per_stratum_from_its_seed():
    values = np.arange(1.0, 1001.0, dtype=np.float32)  # magnitude i + 1 at position i
    lows = [sparsifiers._topkscan.sampled_low(values, 10, 10, seed) for seed in range(50)]
    assert lows == [sparsifiers._topkscan.sampled_low(values, 10, 10, seed)
                    for seed in range(50)]  # the same seed, the same sample
    # count 10 takes one of positions 0-99, one of 100-199...; for k=10, j = 3 (0.1
    # expected, plus 4 sigma, plus 2): the 3rd largest sample, from positions 700-799
    assert all(701 <= low <= 800 for low in lows)
    assert len(set(lows)) > 10  # drawn, not fixed


@compiled_only
@pytest.mark.parametrize("args, error", [
    ((np.zeros(8, np.float32), 1, 0, 0), ValueError),     # no sample
    ((np.zeros(8, np.float32), 1, 9, 0), ValueError),     # a larger sample than values
    ((np.zeros(8, np.float32), 9, 4, 0), ValueError),     # k larger than the values
    ((np.zeros(8, np.float32), -1, 4, 0), ValueError),
    ((np.zeros(0, np.float32), 0, 1, 0), ValueError),
    ((np.zeros(8, np.float16), 1, 4, 0), TypeError),
    ((np.zeros(16, np.float32)[::2], 1, 4, 0), TypeError),
    ((np.zeros(8, np.float32), 1, 4, 0, np.zeros(8)), TypeError),     # another dtype
    ((np.zeros(8, np.float32), 1, 4, 0, np.zeros(7, np.float32)), TypeError),
    ((np.zeros(8, np.float32), 1, 4), TypeError)])
def test_sampled_low_refuses_bad_arguments(args, error):
    with pytest.raises(error):
        sparsifiers._topkscan.sampled_low(*args)
