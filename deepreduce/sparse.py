"""The data model: a sparse tensor as (values, flat indices, dense shape)."""

from __future__ import annotations

import math
import os

import numpy as np

try:  # bfloat16 comes with TensorFlow and JAX; the core works without it
    import ml_dtypes
    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    BFLOAT16 = None

#: dtypes a SparseTensor may hold, with their one-byte wire codes.
DTYPE_CODES = {np.dtype(np.float16): 1, np.dtype(np.float32): 2, np.dtype(np.float64): 3}
if BFLOAT16 is not None:
    DTYPE_CODES[BFLOAT16] = 4
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

#: Largest number of elements a tensor may have: flat indices are int64.
MAX_SIZE = 2**63 - 1


def check_dtype(dtype) -> np.dtype:
    """Return ``dtype`` as a supported floating point ``np.dtype`` or raise ValueError."""
    if isinstance(dtype, np.dtype) and dtype in DTYPE_CODES:  # (native: every payload's)
        return dtype
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"not a dtype: {dtype!r}") from None
    if dtype.newbyteorder("=") not in DTYPE_CODES:
        names = ", ".join(str(d) for d in DTYPE_CODES)
        raise ValueError(f"unsupported dtype {dtype}; supported: {names}")
    return dtype.newbyteorder("=")


#: Byte alignment of the arrays :func:`zeros` returns. TensorFlow adopts a host
#: array aligned to its ``EIGEN_MAX_ALIGN_BYTES`` (64 with AVX-512) as a tensor
#: without copying it; a less aligned one (numpy guarantees 16) it copies.
ALIGNMENT = 64


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not POSIX
        return None


def _check_allocation(nbytes: int, shape, dtype) -> None:
    """Refuse, with a message instead of a MemoryError or the OOM killer, a dense
    array larger than this machine's memory."""
    memory = _physical_memory()
    if memory is not None and nbytes > memory:
        raise MemoryError(f"a dense {dtype} tensor of shape {shape} needs {nbytes / 2**30:,.1f} "
                          f"GiB, more than this machine's {memory / 2**30:,.1f} GiB of memory; "
                          "use the sparse form (values, indices) instead")


def zeros(size: int, dtype) -> np.ndarray:
    """``np.zeros(size, dtype)``, aligned to :data:`ALIGNMENT`, for arrays about to be
    scattered into.

    numpy takes zeroed memory from ``calloc``, which maps fresh 4 KB zero
    pages on first touch; a scatter touches them in random order and pays a
    page fault per page, which costs several times the scatter itself on a
    gradient-sized tensor. Memory from ``np.empty`` is advised to use huge
    pages, and one sequential fill faults it in cheaply.
    """
    dtype = np.dtype(dtype)
    nbytes = int(size) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    start = -raw.__array_interface__["data"][0] % ALIGNMENT
    out = raw[start:start + nbytes].view(dtype)
    out.fill(0)
    return out


def check_shape(shape) -> tuple:
    """Return ``shape`` as a tuple of non-negative ints whose product fits in int64."""
    try:
        shape = tuple(int(d) for d in shape)
    except TypeError:
        shape = (int(shape),)
    if any(d < 0 for d in shape):
        raise ValueError(f"shape dimensions must be >= 0, got {shape}")
    if math.prod(shape) > MAX_SIZE:
        raise ValueError(f"shape {shape} has more than 2**63 - 1 elements")
    return shape


class SparseTensor:
    """A sparse tensor: the non-zeros of a dense tensor and where they are.

    Parameters
    ----------
    values : array_like
        1-D floating point values, one per index.
    indices : array_like
        Flat (C-order) positions in the dense tensor: integers, strictly
        increasing, each in ``[0, prod(shape))``. Stored as int64.
    shape : tuple of int
        Shape of the dense tensor.
    dtype : dtype, optional
        Value dtype; defaults to ``values.dtype``.

    Examples
    --------
    >>> import numpy as np, deepreduce as dr
    >>> st = dr.SparseTensor([1.5, -2.0], [1, 5], shape=(2, 3))
    >>> st.nnz, st.dtype, st.density
    (2, dtype('float32'), 0.3333333333333333)
    >>> st.to_dense()
    array([[ 0. ,  1.5,  0. ],
           [ 0. ,  0. , -2. ]], dtype=float32)
    """

    __slots__ = ("values", "indices", "shape")

    def __init__(self, values, indices, shape, dtype=None):
        shape = check_shape(shape)
        if dtype is None:
            # Python lists and integer arrays become float32, the training default
            given_array = isinstance(values, np.ndarray)
            values = np.asarray(values)
            if values.dtype.kind in "iub" or (not given_array and values.dtype.kind == "f"):
                values = values.astype(np.float32)
        values = np.ascontiguousarray(values, dtype=check_dtype(dtype or values.dtype))
        indices = np.asarray(indices)
        if values.ndim != 1 or indices.ndim != 1:
            raise ValueError(f"values and indices must be 1-D, got shapes {values.shape} "
                             f"and {indices.shape}")
        if values.size != indices.size:
            raise ValueError(f"{values.size} values but {indices.size} indices")
        if indices.size and indices.dtype.kind not in "iu":
            raise ValueError(f"indices must be integers, got {indices.dtype}")
        indices = np.ascontiguousarray(indices, dtype=np.int64)
        n = math.prod(shape)
        if indices.size:
            if indices[0] < 0 or indices[-1] >= n:
                raise ValueError(f"indices must lie in [0, {n}), got range "
                                 f"[{indices.min()}, {indices.max()}]")
            if indices.size > 1 and not (indices[1:] > indices[:-1]).all():
                raise ValueError("indices must be strictly increasing (sorted, unique); "
                                 "use SparseTensor.from_pairs for unsorted input")
        self.values, self.indices, self.shape = values, indices, shape

    @classmethod
    def _trusted(cls, values, indices, shape):
        """Build without validation, for data the library produced and checked itself."""
        st = object.__new__(cls)
        st.values, st.indices, st.shape = values, indices, shape
        return st

    # -- construction ---------------------------------------------------------
    @classmethod
    def from_dense(cls, x) -> "SparseTensor":
        """The non-zero entries of ``x`` (any shape); NaNs count as non-zero."""
        x = np.asarray(x)
        flat = x.reshape(-1)
        indices = np.flatnonzero(flat)
        return cls(flat[indices], indices, x.shape, dtype=x.dtype if x.dtype.kind == "f" or
                   x.dtype == BFLOAT16 else np.float32)

    @classmethod
    def from_pairs(cls, values, indices, shape, dtype=None) -> "SparseTensor":
        """From unsorted (value, index) pairs; repeated indices are summed."""
        values = np.asarray(values)
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        unique, inverse = np.unique(indices, return_inverse=True)
        if unique.size == indices.size:
            order = np.argsort(indices, kind="stable")
            return cls(values.reshape(-1)[order], indices[order], shape, dtype)
        dtype = check_dtype(dtype or values.dtype)
        summed = np.zeros(unique.size, dtype=np.float64 if dtype.itemsize < 8 else dtype)
        np.add.at(summed, inverse, values.reshape(-1))
        return cls(summed.astype(dtype), unique, shape, dtype)

    @classmethod
    def from_rows(cls, values, rows, shape, dtype=None) -> "SparseTensor":
        """From whole rows of a tensor (``tf.IndexedSlices``, a sparse embedding gradient).

        Row ``rows[i]`` of the dense tensor is ``values[i]``; rows that appear
        more than once are summed, as :meth:`from_pairs` sums repeated indices
        (in float64 for narrower dtypes, rounded once). Nothing is densified:
        the work grows with the values given, not with ``shape``.

        Parameters
        ----------
        values : array_like
            Shape ``(len(rows), *shape[1:])``.
        rows : array_like
            1-D integers, each in ``[0, shape[0])``, in any order.
        shape : tuple of int
            Shape of the dense tensor, at least one dimension.
        dtype : dtype, optional
            Value dtype; defaults to ``values``' own (integers become float32,
            as in the constructor).

        Raises
        ------
        ValueError
            When ``values`` does not have that shape, ``rows`` is not a 1-D
            integer array, or a row lies outside ``[0, shape[0])``.

        Examples
        --------
        >>> import numpy as np, deepreduce as dr
        >>> st = dr.SparseTensor.from_rows([[1, 2], [3, 4], [10, 20]], [2, 0, 2], (4, 2))
        >>> st.indices
        array([0, 1, 4, 5])
        >>> st.values
        array([ 3.,  4., 11., 22.], dtype=float32)
        >>> st.to_dense()
        array([[ 3.,  4.],
               [ 0.,  0.],
               [11., 22.],
               [ 0.,  0.]], dtype=float32)
        """
        shape = check_shape(shape)
        if not shape:
            raise ValueError("rows need a shape of at least one dimension, got ()")
        values, rows = np.asarray(values), np.asarray(rows)
        if rows.ndim != 1 or (rows.size and rows.dtype.kind not in "iu"):
            raise ValueError(f"rows must be a 1-D array of integers, got shape {rows.shape} "
                             f"of {rows.dtype}")
        rows = rows.astype(np.int64, copy=False)
        if values.shape != (rows.size, *shape[1:]):
            raise ValueError(f"values of shape {values.shape} do not match {rows.size} rows "
                             f"of shape {shape[1:]}")
        if rows.size and (rows.min() < 0 or rows.max() >= shape[0]):
            raise ValueError(f"rows must lie in [0, {shape[0]}), got range "
                             f"[{rows.min()}, {rows.max()}]")
        if dtype is None:
            dtype = np.float32 if values.dtype.kind in "iub" else values.dtype
        dtype = check_dtype(dtype)
        row_size = math.prod(shape[1:])
        order = np.argsort(rows, kind="stable")
        ordered, block = rows[order], values.reshape(rows.size, row_size)[order]
        if ordered.size > 1 and not (ordered[1:] > ordered[:-1]).all():  # repeated rows
            first = np.concatenate([[True], ordered[1:] != ordered[:-1]])
            summed = np.zeros((int(first.sum()), row_size),
                              dtype=np.float64 if dtype.itemsize < 8 else dtype)
            # each row's values in their order of appearance (the sort is stable)
            np.add.at(summed, np.cumsum(first) - 1, block)
            block, ordered = summed, ordered[first]
        flat = (ordered[:, None] * row_size + np.arange(row_size, dtype=np.int64)).reshape(-1)
        return cls._trusted(np.ascontiguousarray(block, dtype=dtype).reshape(-1), flat, shape)

    @classmethod
    def from_scipy(cls, matrix) -> "SparseTensor":
        """From any ``scipy.sparse`` matrix or array (explicit zeros are kept)."""
        coo = matrix.tocoo()
        flat = np.ravel_multi_index((coo.row, coo.col), coo.shape) if coo.nnz else \
            np.zeros(0, np.int64)
        data = coo.data if coo.data.dtype.kind == "f" else coo.data.astype(np.float32)
        return cls.from_pairs(data, flat, coo.shape)

    # -- views ----------------------------------------------------------------
    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    @property
    def nnz(self) -> int:
        return int(self.indices.size)

    @property
    def size(self) -> int:
        """Number of elements of the dense tensor (the index universe ``n``)."""
        return math.prod(self.shape)

    @property
    def density(self) -> float:
        return self.nnz / self.size if self.size else 0.0

    def to_dense(self, out=None) -> np.ndarray:
        """The dense tensor, zeros where no index is. ``out`` may be a buffer to fill."""
        if out is None:
            _check_allocation(self.size * self.dtype.itemsize, self.shape, self.dtype)
            out = zeros(self.size, self.dtype)
        else:
            if out.size != self.size or out.dtype != self.dtype:
                raise ValueError(f"out must have {self.size} elements of {self.dtype}, got "
                                 f"{out.size} of {out.dtype}")
            out = out.reshape(-1)
            out.fill(0)
        out[self.indices] = self.values
        return out.reshape(self.shape)

    def add_to(self, dense: np.ndarray) -> np.ndarray:
        """Add this tensor into the flat or shaped ``dense`` buffer in place."""
        flat = dense.reshape(-1)
        if flat.size != self.size:
            raise ValueError(f"buffer has {flat.size} elements, tensor has {self.size}")
        flat[self.indices] += self.values  # indices are unique: no lost updates
        return dense

    def to_scipy(self):
        """As a ``scipy.sparse.coo_array`` (2-D tensors only; 1-D become one row)."""
        import scipy.sparse

        shape = self.shape if len(self.shape) == 2 else (1, self.size)
        row, col = np.unravel_index(self.indices, shape)
        return scipy.sparse.coo_array((self.values, (row, col)), shape=shape)

    def __eq__(self, other):
        if not isinstance(other, SparseTensor):
            return NotImplemented
        return (self.shape == other.shape and self.dtype == other.dtype
                and np.array_equal(self.indices, other.indices)
                and np.array_equal(self.values.view(np.uint8), other.values.view(np.uint8)))

    __hash__ = None

    def __repr__(self):
        return (f"SparseTensor(shape={self.shape}, dtype={self.dtype}, nnz={self.nnz}, "
                f"density={self.density:.3g})")
