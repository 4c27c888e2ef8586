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
