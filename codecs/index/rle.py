"""Run-length coding of the index bitmap: cheap for clustered (block) sparsity."""

from __future__ import annotations

import numpy as np

from deepreduce import bits as _bits
from deepreduce.codecs.base import IndexCodec
from deepreduce.errors import DecodeError
from deepreduce.registry import register_codec


@register_codec
class RleIndices(IndexCodec):
    """Alternating zero and one runs of the bitmap, as LEB128 varints.

    With ``m`` maximal runs of consecutive indices, the stream holds ``2m``
    varints: ``z0, o0 - 1, z1 - 1, o1 - 1, ..., z(m-1) - 1, o(m-1) - 1``,
    where ``z0 >= 0`` is the number of absent elements before the first run,
    ``z_j >= 1`` the gap before run ``j`` and ``o_j >= 1`` the length of run
    ``j``. Storing lengths that must be positive minus one makes every stream
    decode to exactly one index set. The trailing zero run is implied by
    ``n``; an empty set is an empty stream. The decoder checks that the runs
    end within ``n`` and hold ``nnz`` ones in total.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.index.rle import RleIndices
    >>> codec = RleIndices()
    >>> data = codec.encode(np.array([2, 3, 4, 8]), n=10)
    >>> list(data)  # 2 zeros, 3 ones, 3 zeros, 1 one
    [2, 2, 2, 0]
    >>> codec.decode(data, n=10, nnz=4).tolist()
    [2, 3, 4, 8]
    """

    codec_id = "rle"

    def encode(self, indices, n):
        indices = _bits.check_indices(indices, n)
        if indices.size == 0:
            return b""
        run_starts = np.flatnonzero(np.diff(indices, prepend=-2) != 1)
        run_ends = np.append(run_starts[1:], indices.size)  # positions in `indices`
        first_index = indices[run_starts]
        one_runs = run_ends - run_starts
        zero_runs = np.diff(first_index, prepend=0)
        zero_runs[1:] -= one_runs[:-1]
        runs = np.empty(2 * run_starts.size, dtype=np.uint64)
        runs[0::2] = zero_runs
        runs[1::2] = one_runs - 1
        runs[2::2] -= np.uint64(1)
        return _bits.varint_encode(runs)

    def decode(self, data, n, nnz):
        what = "rle indices"
        n, nnz = _bits.check_counts(n, nnz, what)
        runs = _bits.varint_decode(data, None, what)
        if runs.size % 2 or runs.size > 2 * nnz or (nnz and not runs.size):
            raise DecodeError(f"{what}: stream holds {runs.size} run lengths, expected "
                              f"an even number between 2 and {2 * nnz} for {nnz} indices")
        if runs.size == 0:
            return np.zeros(0, dtype=np.int64)
        if int(runs.max()) >= n:
            raise DecodeError(f"{what}: a run of {int(runs.max())} does not fit in {n} elements")
        lengths = runs + np.uint64(1)
        lengths[0] -= np.uint64(1)
        # Each length is at most n <= 2**62, so a running sum can only wrap
        # past 2**64 after an earlier boundary exceeded n: checking the
        # largest boundary catches overflow as well as overrun.
        boundaries = np.cumsum(lengths, dtype=np.uint64)
        if int(boundaries.max()) > n:
            raise DecodeError(f"{what}: runs cover more than the {n} elements")
        one_runs = lengths[1::2].astype(np.int64)
        if int(one_runs.sum()) != nnz:
            raise DecodeError(f"{what}: runs hold {int(one_runs.sum())} ones, expected {nnz}")
        run_first = boundaries[0::2].astype(np.int64)
        ones_before = np.cumsum(one_runs) - one_runs
        return np.arange(nnz, dtype=np.int64) + np.repeat(run_first - ones_before, one_runs)
