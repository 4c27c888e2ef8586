"""The allgather strategy's sums: every rank's parts of a tensor into the step's result.

:func:`sum_units` sums each :class:`~deepreduce.exchange.decoding.Unit` in rank order
in the dtype's accumulator (float32; float64 for 8-byte dtypes), as Horovod's dense
allreduce does, so every rank ends with the same bits. Where a result goes:

- a shared payload summed whole: its tensors are views of one sum, copied into the
  caller's arrays where it gives them;
- any other tensor: summed on its own, straight into the dense result (no per-rank
  arrays, no union of supports), an array of its own that :class:`ReusedSums`
  rewrites next step where last step's entries were (aligned, so that TensorFlow
  adopts it without a copy), or the caller's ``out`` array (with ``reuse_out``,
  reset only where last step wrote);
- tensors on a device: the selector sums there, all at once, a shared payload's
  tensors as one (:meth:`~deepreduce.exchange.selection.Selector.sum_into_device`):
  this module calls no framework;
- a tensor reduced as rows: ``(values, rows)`` of the rows any rank touched
  (:func:`sum_rows`; :func:`nonzero_rows` of a dense result).
"""

from __future__ import annotations

import math
import sys

import numpy as np

from deepreduce.errors import DecodeError
from deepreduce.sparse import zeros
from deepreduce.sums import scale_at, sum_sorted_into, sum_sparse


def sum_units(units, rank: int, scale, as_rows, out, out_keys, reused, selector) -> list:
    """Per tensor (``as_rows`` has one flag each), the sum of its ranks' parts.

    Parameters
    ----------
    units : list of Unit
        What each sum adds up (:func:`~deepreduce.exchange.decoding.decode_units`).
    rank : int
        This rank: its part is the reference every other rank's must match.
    scale : float or None
        What the sums are multiplied by (``1 / ranks`` to average; None: 1).
    as_rows, out, out_keys
        As :meth:`~deepreduce.exchange.gathering.GatheringExchange.decode` takes them.
    reused : ReusedSums
        The sums kept from the last step.
    selector : Selector
        Sums into the ``out`` tensors that are not numpy arrays (on a device).
    """
    results = [None] * len(as_rows)
    # the sums into tensors on a device, all at once after the loop (the selector then
    # copies every part's pairs there together)
    device_sums = []
    for unit in units:
        reference = _reference(unit, rank)
        if unit.shapes is not None:
            _sum_shared(unit, reference, scale, out, out_keys, reused, selector, results,
                        device_sums)
            continue
        i = unit.positions[0]
        if as_rows[i]:
            results[i] = sum_rows(unit.parts, scale)
        elif out is not None and out[i] is not None and not isinstance(out[i], np.ndarray):
            # a tensor on a device: the selector sums where it lives
            _check_holds_elements(out[i], reference.size, selector)
            device_sums.append((out[i], unit.parts, scale))
            results[i] = out[i]
        else:
            results[i] = _sum_tensor(i, unit.parts, reference, scale, out, out_keys, reused)
    if device_sums:
        selector.sum_into_device(device_sums)
    return results


def _reference(unit, rank: int):
    """This rank's part of ``unit``, after checking that every rank's has its shape and
    dtype."""
    reference = unit.parts[rank]
    for r, part in enumerate(unit.parts):
        if part.shape != reference.shape or part.dtype != reference.dtype:
            what = f"tensor {unit.positions[0]}" if unit.shapes is None else \
                f"the payload of tensors {unit.positions}"
            raise DecodeError(f"{what}: rank {r} sent {part.shape} {part.dtype}, "
                              f"rank {rank} sent {reference.shape} {reference.dtype}")
    return reference


def _sum_tensor(i: int, parts, reference, scale, out, out_keys, reused) -> np.ndarray:
    """Tensor ``i``'s sum of ``parts`` on the host: into ``out[i]`` where given, else into
    an array :class:`ReusedSums` keeps."""
    accumulator = _accumulator(reference.dtype)
    target = None if out is None or out[i] is None else \
        _writable_flat(out[i], reference.size, reference.dtype)
    memory = None
    if target is not None and target.dtype == accumulator:
        total = target
        if out_keys is not None:  # (the same memory below: looked up once)
            memory = memory_of(target)
        stale = None if memory is None else reused.written(out_keys[i], memory)
        if stale is None:
            total.fill(0)
    else:
        total, stale = reused.zeros(i, reference.size, accumulator)
    touched = sum_sorted_into(total, parts, scale, stale)
    result = total.astype(reference.dtype, copy=False)
    if target is None:
        reused.keep(i, total, touched)
    elif memory is not None:  # (total is target)
        reused.keep_written(out_keys[i], memory, touched)
    elif result is not target:
        np.copyto(target, result)
        result = target
    return result.reshape(reference.shape)


def _sum_shared(unit, reference, scale, out, out_keys, reused, selector, results,
                device_sums) -> None:
    """Sum the ranks' parts of one shared payload at once, into ``results`` at its
    positions: views of one dense sum, or copies into ``out``. Tensors on a device add
    one job to ``device_sums``: their list, whose concatenation the selector makes the
    sum."""
    positions, shapes, parts = unit.positions, unit.shapes, unit.parts
    first = None if out is None else out[positions[0]]
    if first is not None and not isinstance(first, np.ndarray):
        targets = [out[t] for t in positions]
        for t, target, shape in zip(positions, targets, shapes):
            _check_holds_elements(target, math.prod(shape), selector)
            results[t] = target
        device_sums.append((targets, parts, scale))
        return
    accumulator, key = _accumulator(reference.dtype), ("shared", positions[0])
    total, stale = reused.zeros(key, reference.size, accumulator)
    reused.keep(key, total, sum_sorted_into(total, parts, scale, stale))
    flat, start = total.astype(reference.dtype, copy=False), 0
    for t, shape in zip(positions, shapes):
        size = math.prod(shape)
        result = flat[start:start + size].reshape(shape)
        start += size
        if out is not None and out[t] is not None:
            target = _writable_flat(out[t], size, reference.dtype)
            np.copyto(target, result.reshape(-1))
            if out_keys is not None:  # written whole: no record of positions holds
                reused.forget_written(out_keys[t])
            result = out[t]
        results[t] = result


def _check_holds_elements(target, size: int, selector) -> None:
    if selector.size(target) != size:
        raise ValueError(f"out has {selector.size(target)} elements for a tensor of {size}")


def _writable_flat(array: np.ndarray, size: int, dtype: np.dtype) -> np.ndarray:
    """``array`` as a flat view, after checking that it can hold ``size`` values of
    ``dtype``."""
    if not isinstance(array, np.ndarray) or array.size != size or array.dtype != dtype \
            or not array.flags.c_contiguous or not array.flags.writeable:
        raise ValueError(f"out must be a writable C-contiguous {dtype} array of "
                         f"{size} elements")
    return array.reshape(-1)


def _accumulator(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype.itemsize >= 8 else np.dtype(np.float32)


def sum_rows(parts, scale):
    """Sum the ranks' sparse tensors into ``(values, rows)`` of the touched rows only."""
    first = parts[0]
    row_shape = first.shape[1:]
    row_size = int(np.prod(row_shape, dtype=np.int64))
    if row_size == 0:
        return np.zeros((0, *row_shape), first.dtype), np.zeros(0, np.int64)
    accumulator = _accumulator(first.dtype)
    summed = sum_sparse(parts, first.size, accumulator, accumulator)
    row_of = summed.indices // row_size
    rows = np.unique(row_of)
    total = np.zeros(rows.size * row_size, accumulator)
    slots = np.searchsorted(rows, row_of) * row_size + summed.indices % row_size
    total[slots] = summed.values
    if scale is not None:
        scale_at(total, slots, scale)
    values = total.astype(first.dtype, copy=False)
    return values.reshape(rows.size, *row_shape), rows


def nonzero_rows(dense: np.ndarray):
    """``(values, rows)`` of the rows of ``dense`` holding a non-zero (NaN counts)."""
    flat = dense.reshape(dense.shape[0], int(np.prod(dense.shape[1:], dtype=np.int64)))
    rows = np.flatnonzero((flat != 0).any(axis=1))
    return dense[rows], rows.astype(np.int64)


def memory_of(array: np.ndarray) -> tuple:
    """What tells one array's memory from another's: its address, size and dtype."""
    return array.__array_interface__["data"][0], array.size, array.dtype.str


def _references(array: np.ndarray) -> int:
    """References to the memory of ``array``, an array from :func:`~deepreduce.sparse.zeros`:
    every view of it holds one, and so does a TensorFlow tensor that adopted a view."""
    return sys.getrefcount(array.base)


#: :func:`_references` of an array nobody else views: measured, because the
#: temporaries the count includes differ between Python versions.
_UNSHARED = _references(zeros(1, np.float32))


class ReusedSums:
    """Each tensor's dense sum of the last decode, rewritten in place once nobody holds it;
    and where the sums written into a caller's arrays (``reuse_out``) are non-zero.

    A reduced gradient is zeros plus the ranks' sparse entries. Writing it into
    last step's array costs resetting the entries that array holds, not a pass
    over the whole tensor, and the array is aligned so that TensorFlow adopts it
    as a tensor instead of copying it. An array anything still views (a tensor
    TensorFlow has not released, a result the caller kept) is left alone and a
    fresh one replaces it.

    Examples
    --------
    >>> import numpy as np
    >>> sums = ReusedSums()
    >>> total, stale = sums.zeros("w", 4, np.float32)
    >>> total[1] = 2.0
    >>> sums.keep("w", total, np.array([1]))
    >>> again, stale = sums.zeros("w", 4, np.float32)  # nobody else views it: rewritten
    >>> again is total, stale.tolist()
    (True, [1])
    >>> kept = again[1:]
    >>> sums.keep("w", again, stale)
    >>> fresh, stale = sums.zeros("w", 4, np.float32)  # a view of it is alive: a new one
    >>> fresh is again, stale
    (False, None)
    """

    def __init__(self):
        self._last = {}
        self._written = {}

    def zeros(self, key, size: int, dtype) -> tuple[np.ndarray, np.ndarray | None]:
        """``(total, stale)``: a flat array, zero except perhaps at the positions
        ``stale``: last step's for ``key`` when it is free (with the positions it
        holds), else a new one (and None)."""
        last = self._last.pop(key, None)
        if last is not None:
            total, touched = last
            if total.size == size and total.dtype == dtype and _references(total) == _UNSHARED:
                return total, touched
        return zeros(size, dtype), None

    def keep(self, key, total: np.ndarray, touched: np.ndarray) -> None:
        """Remember ``total`` (from :meth:`zeros`), non-zero at most at ``touched``."""
        self._last[key] = (total, touched)

    def written(self, key, memory: tuple) -> np.ndarray | None:
        """The positions :meth:`keep_written` recorded under ``key`` when the target array
        is the same ``memory`` (its :func:`memory_of`) as then (else None: the whole
        array must be reset); the record is dropped."""
        last = self._written.pop(key, None)
        if last is not None and last[0] == memory:
            return last[1]
        return None

    def forget_written(self, key) -> None:
        """Drop the record under ``key`` (its array was written whole)."""
        self._written.pop(key, None)

    def keep_written(self, key, memory: tuple, touched: np.ndarray) -> None:
        """Remember that the array of ``memory`` (its :func:`memory_of`) is zero but
        perhaps at ``touched``."""
        self._written[key] = (memory, touched)

    def peek_written(self, key, target: np.ndarray) -> np.ndarray | None:
        """What :meth:`written` would return, leaving the record in place."""
        last = self._written.get(key)
        return last[1] if last is not None and last[0] == memory_of(target) else None
