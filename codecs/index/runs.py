"""Clustered supports: Golomb-coded runs, in units of the largest common block.

Embedding gradients select whole rows (64 contiguous indices), block-sparse
methods (OmniReduce) whole blocks of 256, and Top-k of real layers often
takes neighbouring elements. Coding such a set gap by gap spends a bit or
more on every index inside a run; coding its runs spends a few bits per
run. When every run starts and ends on a multiple of some ``unit`` (aligned
rows or blocks), the runs are coded in units, so a 64-wide row costs what
one index of a 64 times smaller universe costs.
"""

from __future__ import annotations

import math

import numpy as np

from deepreduce import bits as _bits
from deepreduce.codecs.index import _entropy, golomb
from deepreduce.codecs.base import IndexCodec, no_indices
from deepreduce.errors import DecodeError
from deepreduce.registry import register_codec


def find_runs(indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start index and length (int64) of each maximal run of consecutive indices."""
    breaks = np.flatnonzero(np.diff(indices) != 1) + 1
    first = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([first, [indices.size]]))
    return indices[first], lengths


def common_unit(starts: np.ndarray, lengths: np.ndarray) -> int:
    """Largest ``u`` dividing every run start and length: the set is made of aligned u-blocks."""
    unit = int(np.gcd.reduce(lengths))
    if unit > 1:
        unit = math.gcd(unit, int(np.gcd.reduce(starts)))
    return max(unit, 1)


def run_fields(starts: np.ndarray, lengths: np.ndarray, unit: int):
    """The two sequences the stream codes, in units: zero gaps and lengths minus one."""
    starts, lengths = starts // unit, lengths // unit
    zeros = np.empty_like(starts)
    zeros[0] = starts[0]
    np.subtract(starts[1:], starts[:-1] + lengths[:-1], out=zeros[1:])
    zeros[1:] -= 1
    return zeros, lengths - 1


def fields(indices: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """``(unit, zeros, extra)`` of a non-empty set that passed
    :func:`deepreduce.bits.check_indices`: :func:`common_unit` and :func:`run_fields`
    of its :func:`find_runs`, in one compiled pass when ``deepreduce.codecs.index._entropyc`` is built."""
    compiled = _entropy._entropyc
    if compiled is None:
        starts, lengths = find_runs(indices)
        unit = common_unit(starts, lengths)
        return (unit, *run_fields(starts, lengths, unit))
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    # one entry per index at most; np.empty's pages are only touched where written
    zeros, extra = np.empty(indices.size, np.int64), np.empty(indices.size, np.int64)
    unit, count = compiled.run_fields(indices, zeros, extra)
    return unit, zeros[:count], extra[:count]


def _values_size(values: np.ndarray) -> int:
    """Exact length of ``golomb.encode_values(values)``."""
    m = golomb.choose_parameter(float(values.mean()))
    return len(_bits.write_varint(m)) + _bits.packed_bytes(golomb.field_bits(values, m))


def stream_size(indices: np.ndarray) -> int:
    """Exact byte length of ``RunsIndices().encode(indices, n)`` for a non-empty set."""
    unit, zeros, extra = fields(indices)
    zero_size = _values_size(zeros)
    return (len(_bits.write_varint(unit)) + len(_bits.write_varint(zeros.size - 1))
            + len(_bits.write_varint(zero_size)) + zero_size + _values_size(extra))


@register_codec
class RunsIndices(IndexCodec):
    """Runs of consecutive indices: Golomb-coded gaps between runs and run lengths.

    With ``R`` maximal runs starting at ``s[j]`` with lengths ``l[j]`` and
    ``unit`` the largest number dividing all of them, the stream holds

    1. varints ``unit`` and ``R - 1``;
    2. a varint byte count, then a Golomb stream (see
       :func:`deepreduce.codecs.index.golomb.encode_values`) of the zero gaps in
       units: ``s[0] / unit`` then ``(s[j] - s[j-1] - l[j-1]) / unit - 1``;
    3. a Golomb stream of ``l[j] / unit - 1``.

    Each Golomb stream picks its own parameter. An empty set is an empty
    stream. This wins over gap codes once runs are a few indices long on
    average, and by far on row- or block-aligned supports.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.index.runs import RunsIndices
    >>> codec = RunsIndices()
    >>> rows = np.array([3, 4, 9])  # rows of 64 elements
    >>> indices = (rows[:, None] * 64 + np.arange(64)).ravel()
    >>> data = codec.encode(indices, n=64 * 100)
    >>> len(data)  # unit 64, 3 runs: 2 + 1 length byte + two 2-byte Golomb streams
    7
    >>> np.array_equal(codec.decode(data, n=64 * 100, nnz=indices.size), indices)
    True
    """

    codec_id = "runs"

    def encoded_size(self, indices: np.ndarray) -> int:
        """Exact length in bytes of ``encode(indices, n)``, without building the stream."""
        return stream_size(indices) if indices.size else 0

    def encode(self, indices, n):
        indices = _bits.check_indices(indices, n)
        if indices.size == 0:
            return b""
        unit, zeros, extra = fields(indices)
        zero_stream = golomb.encode_values(zeros)
        return (_bits.write_varint(unit) + _bits.write_varint(zeros.size - 1)
                + _bits.write_varint(len(zero_stream)) + zero_stream
                + golomb.encode_values(extra))

    def decode(self, data, n, nnz):
        what = "runs indices"
        n, nnz = _bits.check_counts(n, nnz, what)
        if nnz == 0:
            return no_indices(data, what)
        unit, offset = _bits.read_varint(data, 0, what)
        if not 1 <= unit <= nnz or nnz % unit:
            raise DecodeError(f"{what}: unit {unit} does not divide nnz={nnz}")
        runs, offset = _bits.read_varint(data, offset, what)
        runs += 1
        if runs > nnz // unit:
            raise DecodeError(f"{what}: {runs} runs cannot hold {nnz} indices")
        size, offset = _bits.read_varint(data, offset, what)
        if offset + size > len(data):
            raise DecodeError(f"{what}: zero-gap stream runs past the end")
        units = -(-n // unit)
        zeros = golomb.decode_values(data[offset:offset + size], runs, units, what)
        lengths = golomb.decode_values(data[offset + size:], runs, units, what) + 1
        if int(lengths.sum()) != nnz // unit:
            raise DecodeError(f"{what}: runs hold {int(lengths.sum()) * unit} indices, "
                              f"expected {nnz}")
        # Every field is below n / unit, so the float total bounds the
        # exact int64 sums below.
        if float(zeros.sum(dtype=np.float64)) + nnz // unit + runs > units + 2.0**20:
            raise DecodeError(f"{what}: runs extend past n={n}")
        zeros[1:] += 1
        zeros[1:] += lengths[:-1]
        starts = np.cumsum(zeros)
        if (int(starts[-1]) + int(lengths[-1])) * unit > n:
            raise DecodeError(f"{what}: runs extend past n={n}")
        lengths *= unit
        starts *= unit
        before = np.cumsum(lengths) - lengths
        return np.arange(nnz, dtype=np.int64) + np.repeat(starts - before, lengths)
