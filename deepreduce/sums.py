"""The sums of sparse parts: the one addition every reduction of the project makes.

Below the wire format (:mod:`deepreduce.bundle` localizes a shared payload's
positions with :func:`localize_sorted`), the collectives and the exchange, which
reduce with :func:`sum_into`, :func:`sum_sorted_into` and :func:`sum_sparse`.
The compiled kernels (``deepreduce._sparsesum``, built by ``pip install``) and
numpy write the same bits.
"""

from __future__ import annotations

import numpy as np

from deepreduce.sparse import SparseTensor

try:
    from deepreduce import _sparsesum
except ImportError:  # not compiled (the extension is optional): numpy sums the same
    _sparsesum = None

#: Which :func:`sum_sorted_into` runs: ``"compiled"`` (the C extension
#: ``deepreduce._sparsesum``, built by ``pip install``) or ``"numpy"``. Both write
#: the same bits.
SUM_IMPLEMENTATION = "numpy" if _sparsesum is None else "compiled"


def sum_into(totals: np.ndarray, parts) -> None:
    """Add the SparseTensors ``parts``, one after the other, into the flat ``totals``.

    The one sum of the project: every communicator and the gradient exchange
    reduce with it (directly into a dense result, or through
    :func:`sum_sparse`). The additions happen in ``totals``' dtype, in the
    parts' order, as a dense allreduce in that dtype would do them.
    """
    for part in parts:  # in place, unlike totals[indices] += values (gather, then scatter)
        np.add.at(totals, part.indices, part.values)


#: The dtypes of the compiled sum, native byte order (a set: comparing a dtype with
#: numpy's scalar types converts them first, a microsecond a test).
_SUMMED_DTYPES = frozenset((np.dtype(np.float32), np.dtype(np.float64)))


def localize_sorted(indices: np.ndarray, ends) -> list:
    """Split ``indices``, the increasing positions of tensors laid end to end (``ends``:
    where each ends), into theirs: each tensor's start is taken off its positions in
    place; returns where each tensor's positions begin, then ``len(indices)``.

    Compiled (one pass, ``deepreduce._sparsesum``) where it is built;
    numpy otherwise, a search and a subtraction per tensor, with the same result.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.sums import localize_sorted
    >>> positions = np.array([1, 4, 5, 9], dtype=np.int64)   # tensors of 4, 2 and 6
    >>> localize_sorted(positions, [4, 6, 12]), positions.tolist()
    ([0, 1, 3, 4], [1, 0, 1, 3])
    """
    if _sparsesum is not None and len(ends) and indices.dtype == np.int64 \
            and indices.flags.c_contiguous:
        return _sparsesum.localize(indices, np.asarray(ends, dtype=np.int64))
    cuts = [0, *np.searchsorted(indices, ends[:-1]).tolist(), indices.size]
    for start, low, high in zip(ends[:-1], cuts[1:], cuts[2:]):
        indices[low:high] -= start
    return cuts


def sum_sorted_into(total: np.ndarray, parts, scale=None, stale=None) -> np.ndarray:
    """Make the flat ``total`` the sum of ``parts`` times ``scale``; return where it is
    not zero.

    ``parts`` are SparseTensors of ``total``'s size whose indices increase (as
    decoded payloads' do). ``total`` must be zero except perhaps at ``stale``,
    what this function returned the last time it wrote the same array (None:
    zero everywhere). Afterwards ``total`` holds, at the parts' positions, their
    values added one after the other in ``total``'s dtype (as :func:`sum_into`
    adds them to zeros), multiplied by ``scale`` in double precision when it is
    not None, and zero everywhere else.

    The compiled sum (:data:`SUM_IMPLEMENTATION`) merges the parts and writes
    every position once, in increasing order, zeroing the stale ones on the way;
    the numpy one zeroes, adds and scales in turn. Both write the same bits;
    the positions returned are increasing and distinct from the compiled one,
    and may repeat from numpy's.
    """
    if _sparsesum is not None and total.dtype in _SUMMED_DTYPES and total.flags.c_contiguous:
        return _sparsesum.sum_sorted(
            total.reshape(-1), [part.indices for part in parts],
            [part.values.astype(total.dtype, copy=False) for part in parts],
            None if scale is None else float(scale),
            None if stale is None else np.ascontiguousarray(stale, np.int64))
    if stale is not None:
        total[stale] = 0
    sum_into(total, parts)
    touched = np.concatenate([part.indices for part in parts]) if parts else \
        np.zeros(0, np.int64)
    if scale is not None:
        scale_at(total, touched, scale)
    return touched


def scale_at(total: np.ndarray, positions: np.ndarray, scale) -> None:
    """Multiply ``total`` at ``positions`` (repeats allowed) by ``scale`` in double
    precision, rounding back to ``total``'s dtype."""
    # the right side is computed before any write: repeats scale once
    total[positions] = np.multiply(total[positions], scale, dtype=np.float64)


def sum_sparse(parts: list, length: int, dtype, accumulator=np.float64) -> SparseTensor:
    """Sum SparseTensors over ``[0, length)``; the support of the sum is the union of supports.

    Sums are accumulated by :func:`sum_into` in ``accumulator`` and rounded
    once to ``dtype``. With the float64 default, narrower dtypes get the
    correctly rounded sum of up to 2**29 parts whatever their order; an
    accumulator of the values' own dtype gives the sequential sum in the parts'
    order that a dense allreduce computes.
    """
    parts = [p for p in parts if p.nnz]
    if not parts:
        return SparseTensor._trusted(np.zeros(0, dtype), np.zeros(0, np.int64), (length,))
    if len(parts) == 1:
        return SparseTensor._trusted(parts[0].values.astype(dtype, copy=False),
                                     parts[0].indices, (length,))
    indices = np.concatenate([p.indices for p in parts])
    if indices.size * 8 >= length:
        # Many entries for the range: one pass over a dense accumulator beats a sort.
        totals = np.zeros(length, accumulator)
        sum_into(totals, parts)
        touched = np.zeros(length, dtype=bool)
        touched[indices] = True
        support = np.flatnonzero(touched)
        return SparseTensor._trusted(totals[support].astype(dtype, copy=False), support,
                                     (length,))
    support, inverse = _union(indices)
    totals = np.zeros(support.size, accumulator)
    ends = np.cumsum([p.nnz for p in parts]).tolist()
    sum_into(totals, [SparseTensor._trusted(part.values, inverse[end - part.nnz:end],
                                            (support.size,))
                      for part, end in zip(parts, ends)])
    return SparseTensor._trusted(totals.astype(dtype, copy=False), support, (length,))


def _union(indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(indices, return_inverse=True)`` for a concatenation of sorted parts.

    A stable sort (timsort for int64) finds the sorted runs and merges them in
    linear time, where np.unique's quicksort sorts the whole concatenation afresh
    in ``n log n``: the parts arrive sorted, so the merge is all the work there is.
    """
    order = np.argsort(indices, kind="stable")
    ordered = indices[order]
    first = np.empty(ordered.size, dtype=bool)
    first[:1] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    inverse = np.empty(ordered.size, dtype=np.int64)
    inverse[order] = np.cumsum(first) - 1
    return ordered[first], inverse


def returns_only_what_ranks_lack(pipeline) -> bool:
    """Whether owners may return to each rank only the entries it lacks, with the codecs
    of ``pipeline`` (a :class:`~deepreduce.pipeline.Pipeline`).

    A rank already holds, exactly as its owner decoded them, the entries it
    contributed alone; leaving them out keeps every rank's result identical
    only if the index codec is exact and the value codec codes any subset of
    the rounded sums back to the same values (lossless or
    :attr:`~deepreduce.codecs.base.ValueCodec.elementwise`). Otherwise every
    rank gets the same frame of each range.
    """
    index_codec, value_codec = pipeline.index_codec, pipeline.value_codec
    return (index_codec is not None and index_codec.lossless
            and (value_codec.lossless or value_codec.elementwise))


def return_masks(union: np.ndarray, supports: list) -> list:
    """Per rank, which entries of a reduced range's ``union`` it must get back.

    ``supports[r]`` is the sorted set rank ``r`` contributed to the range (a
    subset of ``union``). Rank ``r`` needs every entry some other rank
    contributed to; an entry only ``r`` contributed is its own value already.
    """
    positions = [np.searchsorted(union, support) for support in supports]
    contributors = np.zeros(union.size, dtype=np.int32)
    for where in positions:  # one pass per rank; a support holds each entry once
        contributors[where] += 1
    masks = []
    for where in positions:
        needed = np.ones(union.size, dtype=bool)
        needed[where[contributors[where] == 1]] = False
        masks.append(needed)
    return masks
