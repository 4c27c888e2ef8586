"""Sparsifiers: choose which entries of a dense tensor travel.

A sparsifier is a callable ``sparsifier(x) -> SparseTensor``. ``x`` is a dense
array of any shape, or a :class:`SparseTensor` (then the choice is made among
its stored entries: an embedding gradient is sparse already). Indices always
come out sorted, so the index codecs see a set.

Specs name them on the command line and in configs: ``topk:0.01``,
``topk:k=1000``, ``randomk:0.01,seed=7``, ``threshold:1e-3``,
``blocktopk:0.01,block=256``, ``chunktopk:k=64,chunk=4096``, ``none``.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from deepreduce.sparse import BFLOAT16, SparseTensor, check_dtype
from deepreduce.spec import parse_spec

try:
    from deepreduce import _topkscan
except ImportError:  # not compiled (the extension is optional): the numpy scan serves
    _topkscan = None

#: Which candidate scan :class:`TopK` runs: ``"compiled"`` (the C extension
#: ``deepreduce._topkscan``, built by ``pip install``) or ``"numpy"``. Both give
#: the same positions.
SCAN_IMPLEMENTATION = "numpy" if _topkscan is None else "compiled"


def _as_float_array(x) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.kind != "f" and x.dtype != BFLOAT16:
        x = x.astype(np.float32)
    check_dtype(x.dtype)
    return x


def _magnitudes(values: np.ndarray) -> np.ndarray:
    # float16/bfloat16 compare fine in float32; NaN would poison a partition, so it ranks lowest
    mag = np.abs(values if values.dtype.itemsize >= 4 else values.astype(np.float32))
    if np.isnan(mag).any():
        mag = np.where(np.isnan(mag), -np.inf, mag)
    return mag


def _largest(mag: np.ndarray, k: int) -> np.ndarray:
    """Sorted positions of the ``k`` largest entries; ties go to the lowest positions.

    The tie rule makes the result a function of the data alone, so the exact
    and the sampled TopK modes agree element for element.
    """
    n = mag.size
    if k >= n:
        return np.arange(n, dtype=np.int64)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    kth = np.partition(mag, n - k)[n - k]
    keep = mag > kth
    missing = k - int(np.count_nonzero(keep))
    if missing:
        keep[np.flatnonzero(mag == kth)[:missing]] = True
    return np.flatnonzero(keep)


#: The dtypes of the compiled scan, native byte order (a set: comparing a dtype with
#: numpy's scalar types converts them first, a microsecond a test).
_SCANNED_DTYPES = frozenset((np.dtype(np.float32), np.dtype(np.float64)))


def _compiled_scan(values: np.ndarray, addend=None) -> bool:
    """Whether the compiled scan and sample take ``values`` (and ``addend``): built, and
    C-contiguous float32 or float64 in native byte order, the addend of the same dtype."""
    return (_topkscan is not None and values.dtype in _SCANNED_DTYPES
            and values.flags.c_contiguous
            and (addend is None or (addend.dtype == values.dtype
                                    and addend.flags.c_contiguous)))


#: Elements per slice of the numpy :func:`_at_least`: its temporaries stay in the L2 cache.
_SCAN_SLICE = 1 << 16


def _at_least(values: np.ndarray, low, addend=None) -> np.ndarray:
    """Sorted positions of ``|values| >= low`` (NaN never) in 1-D ``values``.

    ``low`` is a scalar of ``values``' dtype (TopK's estimate is one), so the
    comparison is in that precision whichever scan runs. C-contiguous float32
    and float64 go through the compiled scan when it is built
    (:data:`SCAN_IMPLEMENTATION`): one pass that writes only the positions.
    The numpy scan goes slice by slice with two small scratch buffers:
    whole-array temporaries of a large gradient would be fresh memory every
    call, and their page faults cost more than the comparison.

    With ``addend`` (an array of ``values``' dtype and size that does not
    overlap it), ``values += addend`` happens first, in place and in the same
    pass: each slice is scanned while its sum is still in the cache.
    """
    if _compiled_scan(values) and (addend is None or addend.flags.c_contiguous):
        return _topkscan.at_least(values, low, addend)
    if values.size <= _SCAN_SLICE:
        if addend is not None:
            np.add(values, addend, out=values)
        return np.flatnonzero(np.abs(values) >= low)
    magnitudes = np.empty(_SCAN_SLICE, dtype=values.dtype)
    hits = np.empty(_SCAN_SLICE, dtype=bool)
    found = [np.zeros(0, dtype=np.int64)]
    for start in range(0, values.size, _SCAN_SLICE):
        part = values[start:start + _SCAN_SLICE]
        if addend is not None:
            np.add(part, addend[start:start + _SCAN_SLICE], out=part)
        np.abs(part, out=magnitudes[:part.size])
        np.greater_equal(magnitudes[:part.size], low, out=hits[:part.size])
        where = np.flatnonzero(hits[:part.size])
        if where.size:
            found.append(where + start)
    return np.concatenate(found)


def _count(ratio, k, n: int, what: str) -> int:
    """Number of entries to keep out of ``n`` from a ratio or a count."""
    if k is not None:
        if k > n:
            raise ValueError(f"{what}: k={k} is larger than the tensor ({n} elements)")
        return k
    return min(n, math.ceil(ratio * n)) if n else 0


def _check_ratio_or_k(ratio_or_k, ratio, k, what):
    """Resolve the flexible ``(ratio_or_k, ratio=, k=)`` arguments to (ratio, k)."""
    given = [v for v in (ratio_or_k, ratio, k) if v is not None]
    if len(given) != 1:
        raise ValueError(f"{what} takes exactly one of a ratio in (0, 1] or a count k >= 0")
    if ratio_or_k is not None:
        if isinstance(ratio_or_k, numbers.Integral) and not isinstance(ratio_or_k, bool):
            k = int(ratio_or_k)
        else:
            ratio = ratio_or_k
    if k is not None:
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(f"{what}: k must be an integer >= 0, got {k!r}")
        return None, int(k)
    ratio = float(ratio)
    if not 0.0 < ratio <= 1.0:  # also rejects NaN
        raise ValueError(f"{what}: ratio must be in (0, 1], got {ratio!r}")
    return ratio, None


class Sparsifier:
    """Base class: subclasses implement ``_select(values, n, indices)``.

    ``_select`` returns sorted positions into ``values``. ``indices`` is None
    for dense input (then positions are the flat indices) or the flat indices
    of sparse input.
    """

    def __call__(self, x) -> SparseTensor:
        if isinstance(x, SparseTensor):
            positions = self._select(x.values, x.size, x.indices)
            return SparseTensor._trusted(x.values[positions], x.indices[positions], x.shape)
        x = _as_float_array(x)
        flat = x.reshape(-1)
        positions = self._select(flat, flat.size, None)
        return SparseTensor._trusted(flat[positions], positions, x.shape)

    def _select(self, values, n, indices):
        raise NotImplementedError

    def accumulate(self, target: np.ndarray, addend) -> SparseTensor:
        """Add ``addend`` into the array ``target``, in place, and select from the sum.

        The same as ``np.add(target, addend, out=target)`` followed by
        ``self(target)``, including when the selection raises (``target`` then
        holds the sum). Error feedback adds each gradient into its residual
        and then selects: :class:`TopK` does both in one pass over memory.
        """
        np.add(target, addend, out=target)
        return self(target)

    def with_seed(self, seed: int) -> "Sparsifier":
        """This sparsifier with its random stream seeded by ``seed`` (itself when it draws
        nothing)."""
        return self

    def __repr__(self):
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items()
                           if not k.startswith("_") and v is not None)
        return f"{type(self).__name__}({params})"


class NonZero(Sparsifier):
    """Keep every non-zero entry (what passing no sparsifier means)."""

    def _select(self, values, n, indices):
        return np.flatnonzero(values)


class TopK(Sparsifier):
    """Keep the ``k`` entries of largest magnitude.

    Parameters
    ----------
    ratio_or_k : float or int
        A float in (0, 1] is a fraction of the tensor's elements (rounded up);
        an int is a count. ``ratio=`` or ``k=`` may be given by name instead.
    exact : bool, default False
        False estimates the k-th magnitude from a sample, keeps the candidates
        above a safe margin below it and finishes with an exact selection among
        them; True partitions the whole tensor. Both return the same set: ties
        at the k-th magnitude go to the lowest indices.

    Examples
    --------
    >>> import numpy as np, deepreduce as dr
    >>> dr.TopK(2)(np.array([0.1, -3.0, 2.0, 0.5])).indices
    array([1, 2])
    >>> dr.TopK(0.5)(np.array([0.1, -3.0, 2.0, 0.5])).values
    array([-3.,  2.])
    """

    #: Below this many values the exact path is as cheap as the fast mode with numpy's
    #: sample, whose fixed cost (several numpy calls) a small tensor never repays; the
    #: compiled sample and scan (float32 and float64 arrays, when the extension is
    #: built) cost little per call, so the fast mode pays from COMPILED_EXACT_BELOW on
    #: (``benchmarks/model_steps.py`` times small Top-k tensors; docs/results.md).
    EXACT_BELOW = 1 << 13
    COMPILED_EXACT_BELOW = 1 << 10
    #: Largest sample of the fast mode, taken from tensors of 1M values and more; smaller
    #: ones take one value in 256, at least MIN_SAMPLE. The two costs pull apart: each
    #: sampled position costs a cache miss or two, and a smaller sample widens the
    #: candidates' margin (four standard deviations of its count), which leaves the scan
    #: more candidates to keep and the exact selection more to sort. Past SAMPLE
    #: positions the misses cost more than the candidates they would save, so the
    #: sample stops growing there; on tensors of tens of thousands of values the sample
    #: is most of the selection's work, so it shrinks with the tensor.
    SAMPLE = 1 << 12
    MIN_SAMPLE = 1 << 8

    def __init__(self, ratio_or_k=None, *, ratio=None, k=None, exact=False):
        self.ratio, self.k = _check_ratio_or_k(ratio_or_k, ratio, k, "TopK")
        self.exact = bool(exact)
        # fixed seed: the sample positions never change what is selected, only how fast
        self._rng = np.random.default_rng(0x7095)
        self._draws = 0  # the compiled sample's seed: its own stream each call

    def _select(self, values, n, indices):
        k = _count(self.ratio, self.k, values.size if indices is not None else n, "TopK")
        if self._exact_for(values, k):
            return _largest(_magnitudes(values), k)
        low = self._sampled_low(values, k)
        if values.dtype.itemsize < 4:
            values = values.astype(np.float32)
        return self._largest_reaching(values, low, k)[0]

    def accumulate(self, target: np.ndarray, addend) -> SparseTensor:
        addend = np.asarray(addend)
        try:
            k = _count(self.ratio, self.k, target.size, "TopK")
        except ValueError:  # raised again by the selection, after the addition as documented
            return super().accumulate(target, addend)
        if (self._exact_for(target, k) or target.dtype not in _SCANNED_DTYPES
                or addend.dtype != target.dtype or addend.shape != target.shape
                or not target.flags.c_contiguous or np.may_share_memory(target, addend)):
            return super().accumulate(target, addend)
        flat, addend = target.reshape(-1), addend.reshape(-1)
        # the sample is taken from the sums to be: the same values, drawn the same way,
        # as selecting from the finished sum would take
        low = self._sampled_low(flat, k, addend)
        positions, selected = self._largest_reaching(flat, low, k, addend)
        if selected is None:
            selected = flat[positions]
        return SparseTensor._trusted(selected, positions, target.shape)

    def _exact_for(self, values: np.ndarray, k: int) -> bool:
        below = self.COMPILED_EXACT_BELOW if _compiled_scan(values) else self.EXACT_BELOW
        return self.exact or values.size < below or k == values.size

    def _sampled_low(self, values: np.ndarray, k: int, addend=None):
        """A magnitude that about ``k`` plus a safe margin of the 1-D ``values`` reach
        (of ``values + addend`` when given: the sums to be), from a sample."""
        # one position drawn in each of `count` equal strata: increasing addresses, which
        # the prefetcher follows, and a sample at least as representative as a uniform one
        count = min(self.SAMPLE, max(self.MIN_SAMPLE, values.size >> 8))
        if _compiled_scan(values, addend):
            self._draws += 1
            return values.dtype.type(_topkscan.sampled_low(values, k, count, self._draws,
                                                           addend))
        stride = values.size // count
        positions = self._rng.integers(0, stride, count)
        positions += np.arange(0, count * stride, stride)
        sample = _magnitudes(values[positions] if addend is None
                             else values[positions] + addend[positions])
        # Rank j of the sample, counted from the top, sits k/n of the way down with a
        # margin of four standard deviations, so the candidates hold the top k with
        # overwhelming probability; when they do not, the exact path runs instead.
        expected = count * k / values.size
        j = min(count, int(expected + 4 * math.sqrt(expected) + 2))
        return np.partition(sample, count - j)[count - j]

    @staticmethod
    def _largest_reaching(values, low, k: int, addend=None):
        """``(positions, selected)``: the positions of the top ``k`` of ``values`` (after
        ``values += addend``), chosen among those that reach ``low`` when they are
        enough, else among all, and the values there when the compiled scan kept them
        (else None)."""
        if math.isfinite(low) and _compiled_scan(values, addend):
            found = _topkscan.largest_at_least(values, low, k, addend)
            if found is not None:
                return found
        elif np.isfinite(low):
            candidates = _at_least(values, low, addend)
            if candidates.size >= k:
                return candidates[_largest(_magnitudes(values[candidates]), k)], None
        elif addend is not None:
            np.add(values, addend, out=values)
        return _largest(_magnitudes(values), k), None


class RandomK(Sparsifier):
    """Keep ``k`` entries chosen uniformly at random (without replacement).

    Parameters
    ----------
    ratio_or_k : float or int
        Fraction of elements (float in (0, 1]) or count (int).
    seed : int, default 0
        Seeds the generator once; successive calls draw new sets, and two
        sparsifiers with the same seed draw the same sequence of sets.

    Examples
    --------
    >>> import numpy as np, deepreduce as dr
    >>> dr.RandomK(3, seed=1)(np.arange(10.0)).nnz
    3
    """

    def __init__(self, ratio_or_k=None, *, ratio=None, k=None, seed=0):
        self.ratio, self.k = _check_ratio_or_k(ratio_or_k, ratio, k, "RandomK")
        self.seed = int(seed)
        self._rng = np.random.default_rng(self.seed)

    def with_seed(self, seed: int) -> "RandomK":
        return RandomK(ratio=self.ratio, k=self.k, seed=seed)

    def _select(self, values, n, indices):
        count = values.size if indices is not None else n
        k = _count(self.ratio, self.k, count, "RandomK")
        return np.sort(self._rng.choice(count, size=k, replace=False))


class Threshold(Sparsifier):
    """Keep the entries with ``|x| > tau`` (``tau=0`` keeps the non-zeros).

    Examples
    --------
    >>> import numpy as np, deepreduce as dr
    >>> dr.Threshold(0.5)(np.array([0.1, -3.0, 0.5, 0.6])).indices
    array([1, 3])
    """

    def __init__(self, tau):
        tau = float(tau)
        if not (math.isfinite(tau) and tau >= 0):
            raise ValueError(f"Threshold: tau must be a finite number >= 0, got {tau!r}")
        self.tau = tau

    def _select(self, values, n, indices):
        if values.dtype.itemsize < 4:
            values = values.astype(np.float32)
        return np.flatnonzero((values > self.tau) | (values < -self.tau))


class BlockTopK(Sparsifier):
    """Keep whole blocks of ``block`` consecutive elements, those of largest L2 norm.

    OmniReduce-style selection: the dense tensor is cut into blocks (the last one
    may be shorter), and ``ceil(ratio * blocks)`` blocks are kept entirely.

    Examples
    --------
    >>> import numpy as np, deepreduce as dr
    >>> x = np.zeros(1024, np.float32); x[300] = 5
    >>> st = dr.BlockTopK(0.25, block=256)(x)
    >>> int(st.indices[0]), st.nnz
    (256, 256)
    """

    def __init__(self, ratio=None, *, block=256):
        self.ratio, _ = _check_ratio_or_k(None, ratio, None, "BlockTopK")
        if isinstance(block, bool) or not isinstance(block, numbers.Integral) or block < 1:
            raise ValueError(f"BlockTopK: block must be an integer >= 1, got {block!r}")
        self.block = int(block)

    def _select(self, values, n, indices):
        blocks = -(-n // self.block)
        if indices is None:
            norms = self._dense_norms(values, blocks)
        else:
            norms = np.bincount(indices // self.block, weights=np.square(values, dtype=np.float64),
                                minlength=blocks)
        chosen = _largest(norms, math.ceil(self.ratio * blocks))
        if indices is None:
            positions = (chosen[:, None] * self.block + np.arange(self.block)).reshape(-1)
            return positions[positions < n]
        return np.flatnonzero(np.isin(indices // self.block, chosen))


    def _dense_norms(self, values, blocks: int) -> np.ndarray:
        """Squared L2 norm of each block, in float64, a cache-sized slice of blocks at a
        time: the float64 squares of a whole large gradient would be fresh memory, twice
        its size, every call."""
        whole = values.size // self.block
        norms = np.empty(blocks)
        step = max(1, _SCAN_SLICE // self.block)
        squares = np.empty(step * self.block)
        for first in range(0, whole, step):
            last = min(whole, first + step)
            part = squares[:(last - first) * self.block]
            np.square(values[first * self.block:last * self.block], out=part, dtype=np.float64)
            np.add.reduce(part.reshape(-1, self.block), axis=1, out=norms[first:last])
        if whole < blocks:  # the last, shorter block
            norms[whole] = np.square(values[whole * self.block:], dtype=np.float64).sum()
        return norms


class ChunkTopK(Sparsifier):
    """Keep the ``k`` entries of largest magnitude in every chunk of ``chunk`` elements.

    SparseLoCo's selection (Sarfi et al. 2025, arXiv 2508.15706): exactly ``k`` per
    chunk, so that every chunk speaks and the index stream knows each chunk's count
    (see the ``chunked`` index codec). Ties go to the lowest index, as in
    :class:`TopK`; NaN ranks lowest.

    The chunks of a tensor (its :meth:`layout`):

    * **tiles**: a tensor of two or more dimensions whose last two, ``(rows, cols)``,
      are both multiples of ``side = isqrt(chunk)``, where ``side * side == chunk``,
      is cut into square tiles of ``side x side`` (64 x 64 for the default 4096, as
      SparseLoCo does); leading dimensions stack matrices, whose tiles never cross
      from one matrix to the next. Tiles are numbered row-major over the tile grid of
      the ``(size // cols, cols)`` matrix.
    * **flat**: every other tensor (one-dimensional, a last dimension or a row count
      that does not divide, a chunk that is no square, ``tiles=False``) is cut into
      consecutive chunks of ``chunk`` elements of its flattened (C-order) form; a last,
      shorter chunk of ``L`` elements keeps ``min(k, L)``.

    A chunk no larger than ``k`` is kept whole. On a :class:`SparseTensor` the choice
    is among the stored entries of each chunk, which may be fewer than ``k``.

    Parameters
    ----------
    k : int
        Entries kept per chunk, ``>= 0``.
    chunk : int, default 4096
        Elements per chunk, ``>= 1``.
    tiles : bool, default True
        False cuts every tensor into flat chunks.

    Examples
    --------
    >>> import numpy as np, deepreduce as dr
    >>> x = np.random.default_rng(0).standard_normal((128, 192)).astype(np.float32)
    >>> st = dr.ChunkTopK(k=64)(x)     # six 64 x 64 tiles, 64 entries each
    >>> st.nnz, st.indices[:3].tolist()
    (384, [138, 159, 219])
    >>> dr.ChunkTopK(k=64).layout(x.shape)
    ('tiles', 64, 192)
    >>> dr.ChunkTopK(k=2, chunk=4).layout((10,)), dr.ChunkTopK(k=2, chunk=4)(np.arange(10.0)).indices
    (('flat', 4, 10), array([2, 3, 6, 7, 8, 9]))
    """

    def __init__(self, k=None, *, chunk=4096, tiles=True):
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
            raise ValueError(f"ChunkTopK: k must be an integer >= 0, got {k!r}")
        if isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk < 1:
            raise ValueError(f"ChunkTopK: chunk must be an integer >= 1, got {chunk!r}")
        self.k, self.chunk, self.tiles = int(k), int(chunk), bool(tiles)

    def layout(self, shape) -> tuple:
        """``("tiles", side, cols)`` or ``("flat", chunk, size)`` for a tensor of ``shape``
        (see the class docstring)."""
        shape = tuple(int(d) for d in shape)
        size = math.prod(shape)
        side = math.isqrt(self.chunk)
        if (self.tiles and len(shape) >= 2 and side * side == self.chunk and size
                and shape[-1] % side == 0 and shape[-2] % side == 0):
            return "tiles", side, shape[-1]
        return "flat", self.chunk, size

    def __call__(self, x) -> SparseTensor:
        if isinstance(x, SparseTensor):
            keys = chunk_keys(x.indices, self.layout(x.shape))
            positions = _largest_per_group(_magnitudes(x.values), keys // self.chunk, self.k)
            return SparseTensor._trusted(x.values[positions], x.indices[positions], x.shape)
        x = _as_float_array(x)
        flat = x.reshape(-1)
        positions = self._select_dense(flat, self.layout(x.shape))
        return SparseTensor._trusted(flat[positions], positions, x.shape)

    def _select_dense(self, flat: np.ndarray, layout) -> np.ndarray:
        kind, side, size = layout
        chunk, k = self.chunk, self.k
        if _topkscan is not None:
            # float16 and bfloat16 magnitudes order exactly as their float32 values do, as
            # _magnitudes has it below
            compiled = flat if flat.dtype.itemsize >= 4 else flat.astype(np.float32)
            if _compiled_scan(compiled):  # one pass per chunk in C (ChunkTopK's notes there)
                return _topkscan.chunk_largest(compiled, k, chunk,
                                               side if kind == "tiles" else 0,
                                               size if kind == "tiles" else 0)
        if kind == "tiles":
            cols = size
            rows = flat.size // cols
            grid = flat.reshape(rows // side, side, cols // side, side).transpose(0, 2, 1, 3)
            keep = _keep_largest_rows(_magnitudes(grid.reshape(-1, chunk)), k)
            return np.flatnonzero(keep.reshape(rows // side, cols // side, side, side)
                                  .transpose(0, 2, 1, 3))
        full = flat.size // chunk
        keep = np.zeros(flat.size, dtype=bool)
        if full:
            keep[:full * chunk] = _keep_largest_rows(
                _magnitudes(flat[:full * chunk]).reshape(full, chunk), k).reshape(-1)
        if flat.size > full * chunk:  # the last, shorter chunk
            rest = _magnitudes(flat[full * chunk:])
            keep[full * chunk:] = _keep_largest_rows(rest.reshape(1, -1), min(k, rest.size))[0]
        return np.flatnonzero(keep)

    def __repr__(self):
        return f"ChunkTopK(k={self.k}, chunk={self.chunk}, tiles={self.tiles})"


def chunk_keys(indices: np.ndarray, layout) -> np.ndarray:
    """``chunk * chunk_number + position within the chunk`` of each flat index, for a
    :meth:`ChunkTopK.layout` (tiles: row-major within the tile)."""
    indices = np.asarray(indices, dtype=np.int64)
    kind, side, cols = layout
    if kind == "flat":
        return indices
    row, col = np.divmod(indices, cols)
    tile_row, local_row = np.divmod(row, side)
    tile_col, local_col = np.divmod(col, side)
    return ((tile_row * (cols // side) + tile_col) * side + local_row) * side + local_col


def _keep_largest_rows(mag: np.ndarray, k: int) -> np.ndarray:
    """Boolean mask of the ``k`` largest entries of every row of ``mag`` (2-D), ties
    to the lowest column: one partition along the rows, the ties settled where a
    row has more of them than it keeps."""
    rows, width = mag.shape
    if k >= width:
        return np.ones(mag.shape, dtype=bool)
    if k == 0 or rows == 0:
        return np.zeros(mag.shape, dtype=bool)
    kth = np.partition(mag, width - k, axis=1)[:, width - k:width - k + 1]
    keep = mag > kth
    tied = mag == kth
    missing = k - np.count_nonzero(keep, axis=1)
    crowded = np.flatnonzero(np.count_nonzero(tied, axis=1) > missing)
    if crowded.size:  # more ties than places: the first ones, by column
        ranks = np.cumsum(tied[crowded], axis=1)
        tied[crowded] &= ranks <= missing[crowded, None]
    keep |= tied
    return keep


def _largest_per_group(mag: np.ndarray, groups: np.ndarray, k: int) -> np.ndarray:
    """Sorted positions of the ``k`` largest ``mag`` within each group (``groups`` of
    the same size), ties to the lowest position."""
    if mag.size == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((np.arange(mag.size), -mag.astype(np.float64), groups))
    sorted_groups = groups[order]
    starts = np.flatnonzero(np.r_[True, sorted_groups[1:] != sorted_groups[:-1]])
    rank = np.arange(mag.size) - np.repeat(starts, np.diff(np.r_[starts, mag.size]))
    return np.sort(order[rank < k])


_SPARSIFIERS = {"topk": TopK, "randomk": RandomK, "threshold": Threshold,
                "blocktopk": BlockTopK, "chunktopk": ChunkTopK, "none": NonZero, "nonzero": NonZero}


def get_sparsifier(spec):
    """A sparsifier from an instance, ``None`` (the non-zeros) or a spec string.

    Examples
    --------
    >>> from deepreduce.sparsifiers import get_sparsifier
    >>> get_sparsifier("topk:0.01")
    TopK(ratio=0.01, exact=False)
    >>> get_sparsifier("blocktopk:0.1,block=64")
    BlockTopK(ratio=0.1, block=64)
    >>> get_sparsifier("chunktopk:k=64,chunk=4096")
    ChunkTopK(k=64, chunk=4096, tiles=True)
    """
    if spec is None:
        return NonZero()
    if callable(spec):
        return spec
    name, args, kwargs = parse_spec(spec)
    if name not in _SPARSIFIERS:
        raise ValueError(f"unknown sparsifier {name!r}; known: {', '.join(sorted(_SPARSIFIERS))}")
    try:
        return _SPARSIFIERS[name](*args, **kwargs)
    except TypeError as exc:
        raise ValueError(f"bad parameters in sparsifier spec {spec!r}: {exc}") from None
