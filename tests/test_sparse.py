import numpy as np
import pytest
import scipy.sparse
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import deepreduce as dr
from deepreduce.sparse import BFLOAT16

FLOAT_DTYPES = [np.float16, np.float32, np.float64] + ([BFLOAT16] if BFLOAT16 is not None else [])


def test_construction_and_dense_round_trip():
    st_ = dr.SparseTensor([1.5, -2.0], [1, 5], shape=(2, 3))
    assert st_.nnz == 2 and st_.size == 6 and st_.dtype == np.float32
    np.testing.assert_array_equal(st_.to_dense(), [[0, 1.5, 0], [0, 0, -2.0]])


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=0, max_dims=4, max_side=6),
                  elements=st.sampled_from([0.0, 1.0, -2.5, 0.125, np.inf])))
def test_from_dense_to_dense_is_identity(x):
    st_ = dr.SparseTensor.from_dense(x)
    assert st_.shape == x.shape and st_.nnz == np.count_nonzero(x)
    np.testing.assert_array_equal(st_.to_dense(), x)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_dtypes_kept(dtype):
    x = np.array([0, 1, 0, -3], dtype=dtype)
    st_ = dr.SparseTensor.from_dense(x)
    assert st_.dtype == np.dtype(dtype)
    assert st_.to_dense().dtype == np.dtype(dtype)


def test_integer_input_becomes_float32():
    assert dr.SparseTensor.from_dense(np.array([0, 2, 3])).dtype == np.float32


@pytest.mark.parametrize("values, indices, shape, message", [
    ([1.0], [3], (3,), "indices must lie in"),
    ([1.0], [-1], (3,), "indices must lie in"),
    ([1.0, 2.0], [2, 1], (3,), "strictly increasing"),
    ([1.0, 2.0], [1, 1], (3,), "strictly increasing"),
    ([1.0], [0, 1], (3,), "1 values but 2 indices"),
    ([[1.0]], [0], (3,), "must be 1-D"),
    ([1.0], [0.5], (3,), "must be integers"),
    ([1.0], [0], (-1,), "must be >= 0"),
    ([1.0], [0], (2**40, 2**40), "more than 2\\*\\*63"),
])
def test_validation_errors(values, indices, shape, message):
    with pytest.raises(ValueError, match=message):
        dr.SparseTensor(values, indices, shape)


def test_unsupported_dtype():
    with pytest.raises(ValueError, match="unsupported dtype"):
        dr.SparseTensor(np.array([1], np.complex64), [0], (2,))


def test_from_pairs_sorts_and_sums_duplicates():
    st_ = dr.SparseTensor.from_pairs(np.array([1.0, 2.0, 4.0], np.float32), [5, 1, 5], (8,))
    np.testing.assert_array_equal(st_.indices, [1, 5])
    np.testing.assert_array_equal(st_.values, [2.0, 5.0])


def test_scipy_round_trip():
    m = scipy.sparse.random(20, 30, density=0.1, format="csr", random_state=0, dtype=np.float32)
    st_ = dr.SparseTensor.from_scipy(m)
    assert st_.shape == (20, 30)
    np.testing.assert_array_equal(st_.to_dense(), m.toarray())
    np.testing.assert_array_equal(st_.to_scipy().toarray(), m.toarray())


def test_add_to_and_out_buffer():
    st_ = dr.SparseTensor([1.0, 2.0], [0, 3], (2, 2))
    acc = np.ones((2, 2), np.float32)
    st_.add_to(acc)
    np.testing.assert_array_equal(acc, [[2, 1], [1, 3]])
    out = np.full((2, 2), 7, np.float32)
    np.testing.assert_array_equal(st_.to_dense(out=out), [[1, 0], [0, 2]])
    with pytest.raises(ValueError):
        st_.add_to(np.zeros(5, np.float32))


def test_huge_shape_with_few_entries():
    st_ = dr.SparseTensor([1.0], [2**40], (2**41,))
    assert st_.size == 2**41 and st_.density < 1e-12


# -- from_rows: whole rows (IndexedSlices, sparse embedding gradients) -------------------


def test_from_rows_places_rows_and_sums_repeated_ones():
    values = np.array([[1, 2], [3, 4], [10, 20], [100, 200]], np.float32)
    st_ = dr.SparseTensor.from_rows(values, [3, 0, 3, 3], (5, 2))
    assert st_.shape == (5, 2) and st_.dtype == np.float32
    np.testing.assert_array_equal(st_.indices, [0, 1, 6, 7])
    np.testing.assert_array_equal(st_.values, [3, 4, 111, 222])
    dense = np.zeros((5, 2), np.float32)
    np.add.at(dense, [3, 0, 3, 3], values)
    np.testing.assert_array_equal(st_.to_dense(), dense)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), dtype=st.sampled_from([np.float16, np.float32, np.float64]))
def test_from_rows_is_from_pairs_of_the_rows_elements(data, dtype):
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=6))
    count = data.draw(st.integers(0, 12)) if shape[0] else 0
    rows = np.array(data.draw(st.lists(st.integers(0, shape[0] - 1), min_size=count,
                                       max_size=count)) if count else [], np.int64)
    values = data.draw(hnp.arrays(dtype, (count, *shape[1:]),
                                  elements=st.floats(-100, 100, width=16)))
    got = dr.SparseTensor.from_rows(values, rows, shape)
    row_size = int(np.prod(shape[1:], dtype=np.int64))
    flat = (rows[:, None] * row_size + np.arange(row_size)).reshape(-1)
    expected = dr.SparseTensor.from_pairs(values.reshape(-1), flat, shape, dtype)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    np.testing.assert_array_equal(got.indices, expected.indices)
    np.testing.assert_array_equal(got.values.view(np.uint8), expected.values.view(np.uint8))


def test_from_rows_empty_and_zero_sized_rows():
    empty = dr.SparseTensor.from_rows(np.zeros((0, 3), np.float32), [], (4, 3))
    assert empty.nnz == 0 and empty.shape == (4, 3) and empty.dtype == np.float32
    assert empty.indices.dtype == np.int64
    no_columns = dr.SparseTensor.from_rows(np.zeros((2, 0), np.float32), [1, 1], (4, 0))
    assert no_columns.nnz == 0 and no_columns.shape == (4, 0)
    vector = dr.SparseTensor.from_rows(np.array([2.0, 5.0]), [4, 1], (6,))  # 1-D: elements
    np.testing.assert_array_equal(vector.to_dense(), [0, 5, 0, 0, 2, 0])
    assert vector.dtype == np.float64


def test_from_rows_dtypes():
    as_ints = dr.SparseTensor.from_rows([[1, 2]], [0], (2, 2))
    assert as_ints.dtype == np.float32
    wide = dr.SparseTensor.from_rows(np.ones((2, 2), np.float32), [1, 1], (2, 2), np.float64)
    assert wide.dtype == np.float64 and wide.values.tolist() == [2.0, 2.0]
    if BFLOAT16 is not None:
        bf = dr.SparseTensor.from_rows(np.ones((3, 2), BFLOAT16), [1, 0, 1], (2, 2))
        assert bf.dtype == BFLOAT16 and bf.values.astype(np.float32).tolist() == [1, 1, 2, 2]


@pytest.mark.parametrize("values, rows, shape, message", [
    (np.ones((2, 3)), [0, 4], (4, 3), r"rows must lie in \[0, 4\), got range \[0, 4\]"),
    (np.ones((2, 3)), [-1, 0], (4, 3), r"rows must lie in \[0, 4\)"),
    (np.ones((1, 3)), [0], (0, 3), r"rows must lie in \[0, 0\)"),
    (np.ones((2, 2)), [0, 1], (4, 3), r"values of shape \(2, 2\) do not match 2 rows of shape \(3,\)"),
    (np.ones(6), [0, 1], (4, 3), "do not match"),
    (np.ones((2, 3)), [[0, 1]], (4, 3), "1-D array of integers"),
    (np.ones((2, 3)), [0.0, 1.0], (4, 3), "1-D array of integers"),
    (np.ones(1), [0], (), "at least one dimension"),
    (np.ones((1, 3), np.complex64), [0], (4, 3), "unsupported dtype"),
])
def test_from_rows_errors(values, rows, shape, message):
    with pytest.raises(ValueError, match=message):
        dr.SparseTensor.from_rows(values, rows, shape)
