"""The dense sum of sparse parts: the compiled one (deepreduce._sparsesum) and numpy's
write the same bits.

``deepreduce.sums.sum_sorted_into`` is what every rank of the allgather exchange
runs on the decoded payloads of each gradient: zero what last step's sum left,
add the parts in rank order, scale for an average.
"""

import doctest

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deepreduce as dr
from deepreduce import sums as base
from deepreduce.sums import sum_sorted_into
import extensions

compiled_only = pytest.mark.skipif(base._sparsesum is None,
                                   reason="deepreduce._sparsesum is not built")
SPECIALS = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e38, 3e38]


def test_docstring_examples():
    result = doctest.testmod(base, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted and not result.failed


def test_implementation_flag_matches_the_build():
    assert base.SUM_IMPLEMENTATION == ("numpy" if base._sparsesum is None else "compiled")


def random_parts(rng, size, count, dtype, density, special_share):
    parts = []
    for _ in range(count):
        nnz = int(rng.binomial(size, density)) if size else 0
        indices = np.sort(rng.choice(size, nnz, replace=False)).astype(np.int64)
        values = rng.standard_normal(nnz).astype(dtype)
        if nnz and special_share:
            where = rng.random(nnz) < special_share
            values[where] = rng.choice(np.array(SPECIALS, dtype), int(where.sum()))
        parts.append(dr.SparseTensor(values, indices, (size,)))
    return parts


def bits(array):
    return array.view(f"u{array.itemsize}")


@pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")  # numpy on inf and NaN
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_nans_meeting_keep_the_running_sums_payload_as_numpy_add_at_does(dtype, ranks):
    uint = np.dtype(f"u{np.dtype(dtype).itemsize}")
    info = np.finfo(dtype)
    quiet = 1 << (info.nmant - 1)
    nans = [np.array([(1 << (info.bits - 1)) - (1 << info.nmant) + payload], uint).view(dtype)[0]
            for payload in (quiet | 5, 3)]  # a quiet NaN, and a signalling one
    negative = np.array([np.array([n]).view(uint)[0] | (1 << (info.bits - 1)) for n in nans],
                        uint).view(dtype)
    size = 8
    # at 0 two NaNs of other payloads meet; at 1 inf + -inf makes the processor's own NaN,
    # which then meets one of the payloads; at 2 a NaN meets finite values
    columns = [[nans[0], np.inf, 1.0], [negative[1], -np.inf, nans[1]],
               [nans[1], nans[0], 2.0], [negative[0], 3.0, negative[1]], [1.0, 1.0, 1.0]]
    parts = [dr.SparseTensor(np.array(columns[r], dtype), np.arange(3), (size,))
             for r in range(ranks)]
    expected = np.zeros(size, dtype)
    base.sum_into(expected, parts)  # numpy's add.at, part after part
    for implementation in extensions.both(base, "_sparsesum", lambda: _summed(parts, size, dtype)):
        np.testing.assert_array_equal(implementation.view(uint), expected.view(uint))


def _summed(parts, size, dtype):
    total = np.zeros(size, dtype)
    sum_sorted_into(total, parts)
    return total


@pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")  # numpy on inf and NaN
@settings(max_examples=200, deadline=None)
@given(dtype=st.sampled_from([np.float32, np.float64]),
       # up to several of the compiled sum's windows of 4096 positions (three parts and more)
       size=st.one_of(st.integers(0, 70), st.integers(0, 5000), st.integers(8000, 30000)),
       ranks=st.sampled_from([0, 1, 2, 3, 4, 5, 8]),
       density=st.sampled_from([0.0, 0.001, 0.01, 0.3, 1.0]),
       special_share=st.sampled_from([0.0, 0.1]),
       scale=st.sampled_from([None, 0.5, 1 / 3, 1.0]), steps=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_compiled_and_numpy_sums_write_the_same_bits(dtype, size, ranks, density,
                                                      special_share, scale, steps, seed):
    rng = np.random.default_rng(seed)
    totals = {"compiled": np.zeros(size, dtype), "numpy": np.zeros(size, dtype)}
    stale = {"compiled": None, "numpy": None}
    for _ in range(steps):  # each step reuses the array last step wrote
        parts = random_parts(rng, size, ranks, dtype, density, special_share)
        expected = np.zeros(size, dtype)
        base.sum_into(expected, parts)
        union = np.unique(np.concatenate([p.indices for p in parts] + [np.zeros(0, np.int64)]))
        if scale is not None:
            expected[union] = np.multiply(expected[union], scale, dtype=np.float64)
        calls = iter(("compiled", "numpy"))  # as installed, then numpy's

        def step():
            which = next(calls)
            stale[which] = sum_sorted_into(totals[which], parts, scale, stale[which])

        extensions.both(base, "_sparsesum", step)
        for which in ("compiled", "numpy"):
            np.testing.assert_array_equal(bits(totals[which]), bits(expected))
            np.testing.assert_array_equal(np.unique(stale[which]), union)
        if base._sparsesum is not None:  # the compiled union comes sorted and distinct
            np.testing.assert_array_equal(stale["compiled"], union)


@compiled_only
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_compiled_sum_refuses_parts_that_do_not_increase_or_leave_the_tensor(ranks):
    good = dr.SparseTensor(np.ones(3, np.float32), [1, 4, 6], (8,))
    for indices in ([1, 1, 2], [3, 2, 5], [-1, 2, 3], [1, 2, 8]):
        bad = dr.SparseTensor._trusted(np.ones(3, np.float32), np.array(indices), (8,))
        for where in range(ranks):  # the first part, the last, one between
            parts = [good] * where + [bad] + [good] * (ranks - 1 - where)
            with pytest.raises(ValueError, match="strictly increasing"):
                sum_sorted_into(np.zeros(8, np.float32), parts)
    # out of order across windows of the sum of three parts and more
    far = dr.SparseTensor._trusted(np.ones(2, np.float32), np.array([9000, 10]), (10000,))
    with pytest.raises(ValueError, match="strictly increasing"):
        sum_sorted_into(np.zeros(10000, np.float32), [far] * ranks)
    for stale in ([2, 2], [5, 1], [8], [-1]):
        with pytest.raises(ValueError, match="strictly increasing"):
            sum_sorted_into(np.zeros(8, np.float32), [good] * ranks, None, np.array(stale))


@compiled_only
def test_compiled_sum_checks_its_arguments():
    part = dr.SparseTensor(np.ones(2, np.float32), [0, 1], (4,))
    read_only = np.zeros(4, np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        base._sparsesum.sum_sorted(read_only, [part.indices], [part.values], None, None)
    with pytest.raises(TypeError, match="values"):
        base._sparsesum.sum_sorted(np.zeros(4, np.float32), [part.indices],
                                   [part.values.astype(np.float64)], None, None)
    with pytest.raises(ValueError, match="same length"):
        base._sparsesum.sum_sorted(np.zeros(4, np.float32), [part.indices], [], None, None)
    with pytest.raises(ValueError, match="2 indices and 1 values"):
        base._sparsesum.sum_sorted(np.zeros(4, np.float32), [part.indices],
                                   [part.values[:1]], None, None)


localized = extensions.fixture(base, "_sparsesum", "localized")


# (the fixture only picks the implementation: the same for every example)
@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=12), data=st.data())
def test_localize_splits_increasing_positions_into_each_tensors(localized, sizes, data):
    ends = np.cumsum(sizes).tolist()
    positions = sorted(data.draw(st.sets(st.integers(0, max(ends[-1] - 1, 0)),
                                         max_size=ends[-1])))
    indices = np.array(positions, dtype=np.int64)
    cuts = base.localize_sorted(indices, ends)
    assert cuts[0] == 0 and cuts[-1] == len(positions) and len(cuts) == len(sizes) + 1
    for start, end, low, high in zip([0, *ends[:-1]], ends, cuts, cuts[1:]):
        want = [p - start for p in positions if start <= p < end]
        assert indices[low:high].tolist() == want


@compiled_only
@given(st.lists(st.integers(-2**62, 2**62), max_size=50),
       st.lists(st.integers(-2**62, 2**62), min_size=1, max_size=6))
def test_compiled_localize_stays_in_bounds_on_any_input(values, ends):
    # a hostile payload's positions are checked before the split; any input must
    # still leave the cuts in order and within the array
    indices = np.array(values, dtype=np.int64)
    cuts = base._sparsesum.localize(indices, np.array(ends, dtype=np.int64))
    assert len(cuts) == len(ends) + 1 and cuts[-1] == len(values)
    assert cuts == sorted(cuts) and 0 <= cuts[0]


@compiled_only
def test_compiled_localize_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="at least one tensor"):
        base._sparsesum.localize(np.zeros(3, np.int64), np.zeros(0, np.int64))
    with pytest.raises(TypeError, match="writable"):
        frozen = np.zeros(3, np.int64)
        frozen.flags.writeable = False
        base._sparsesum.localize(frozen, np.array([5], np.int64))
    with pytest.raises(TypeError, match="int64"):
        base._sparsesum.localize(np.zeros(3, np.int32), np.array([5], np.int64))
