"""Fit-Poly: sorted values sent as a piecewise polynomial (DeepReduce's curve fit).

Sorted, the values of a sparsified gradient form a smooth monotone curve:
a few polynomial pieces describe tens of thousands of values. Following
DeepReduce (Kostopoulou et al., arXiv 2102.03112):

1. the values travel in ascending order (``sorts_values``; ``order`` is a
   stable argsort, and the pipeline makes the indices follow that order);
2. the curve is cut between the negative and the non-negative values (the
   jump at zero would spoil any fit), then split greedily: the piece whose
   points lie farthest from their chord (the line through the piece's end
   points) is cut at that farthest point, until ``segments`` pieces exist
   or no piece can be cut into two of at least ``2 * (degree + 1)``
   values;
3. each piece gets a least-squares polynomial of degree ``degree`` (lower
   for pieces of at most ``degree`` values, which are then interpolated),
   computed in the Chebyshev basis on the piece's positions mapped to
   ``[-1, 1]``, which keeps the float32 coefficients well conditioned.

Stream: ``varint pieces``, ``pieces`` varint lengths (each at least 1,
summing to nnz), then every piece's ``min(degree, length - 1) + 1``
Chebyshev coefficients as little-endian float32, piece after piece.
Values must be finite (encoding raises ValueError otherwise).

Examples
--------
>>> import numpy as np
>>> from deepreduce.codecs.values.polyfit import PolyFitValues
>>> x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
>>> codec = PolyFitValues()
>>> y = x[codec.order(x)]
>>> data, received = codec.encode_and_receive(y)
>>> len(data)  # 10,000 values in 12 pieces of 6 float32 coefficients
308
>>> bool(np.linalg.norm(received - y) / np.linalg.norm(y) < 0.01)
True
"""

from __future__ import annotations

import numpy as np
from numpy.polynomial import chebyshev

from deepreduce import bits as _bits
from deepreduce.codecs.base import ValueCodec
from deepreduce.codecs.values.dtypes import check_nnz, check_values, value_dtype
from deepreduce.codecs.values.qsgd import cast_back, working_copy
from deepreduce.errors import DecodeError
from deepreduce.registry import register_codec

MAX_DEGREE = 32
MAX_SEGMENTS = 1 << 16


def _positions(length: int) -> np.ndarray:
    """The ``length`` positions of a piece mapped onto ``[-1, 1]`` (0 for a single value)."""
    if length == 1:
        return np.zeros(1)
    return np.linspace(-1.0, 1.0, length)


def _chord_gap(y: np.ndarray, lo: int, hi: int, min_len: int) -> tuple[float, int]:
    """Largest distance of ``y[lo:hi]`` to its chord and where to cut (or ``(-1, 0)``).

    The cut keeps at least ``min_len`` values on each side.
    """
    if hi - lo < 2 * min_len:
        return -1.0, 0
    piece = y[lo:hi]
    chord = np.linspace(piece[0], piece[-1], piece.size)
    gap = np.abs(piece - chord)
    inner = gap[min_len:piece.size - min_len + 1]
    at = int(np.argmax(inner))
    return float(inner[at]), lo + min_len + at


def knots(y: np.ndarray, degree: int, segments: int) -> np.ndarray:
    """Piece boundaries ``[0, ..., len(y)]`` chosen as described in the module docstring."""
    negatives = int(np.count_nonzero(y < 0))
    bounds = sorted({0, negatives, y.size})
    min_len = 2 * (degree + 1)
    pieces = [(lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]
    gaps = [_chord_gap(y, lo, hi, min_len) for lo, hi in pieces]
    while pieces and len(pieces) < segments:  # at most `segments` iterations
        best = max(range(len(pieces)), key=lambda i: gaps[i][0])
        gap, cut = gaps[best]
        if gap <= 0:
            break
        lo, hi = pieces[best]
        pieces[best:best + 1] = [(lo, cut), (cut, hi)]
        gaps[best:best + 1] = [_chord_gap(y, lo, cut, min_len), _chord_gap(y, cut, hi, min_len)]
    return np.array([lo for lo, _ in pieces] + [y.size], dtype=np.int64)


def _evaluate(lengths: np.ndarray, coefficients: list[np.ndarray]) -> np.ndarray:
    """The piecewise polynomial at every position, float64 (shared by encoder and decoder)."""
    out = np.empty(int(lengths.sum()), dtype=np.float64)
    start = 0
    for length, coef in zip(lengths.tolist(), coefficients):  # one iteration per piece
        out[start:start + length] = chebyshev.chebval(_positions(length), coef.astype(np.float64))
        start += length
    return out


@register_codec
class PolyFitValues(ValueCodec):
    """Fit-Poly: piecewise least-squares polynomials through the sorted values.

    Parameters
    ----------
    degree : int
        Polynomial degree per piece, in ``[0, 32]``.
    segments : int
        Largest number of pieces, in ``[2, 65536]`` (two are needed when the
        values have both signs).

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.values.polyfit import PolyFitValues
    >>> codec = PolyFitValues(degree=2, segments=2)
    >>> y = np.array([-3.0, -2.0, -1.0, 1.0, 4.0, 9.0])
    >>> data = codec.encode(y)
    >>> np.round(codec.decode(data, nnz=6, dtype=np.float64), 6).tolist()
    [-3.0, -2.0, -1.0, 1.0, 4.0, 9.0]
    """

    codec_id = "polyfit"
    lossless = False
    sorts_values = True

    def __init__(self, degree: int = 5, segments: int = 12):
        if isinstance(degree, bool) or not isinstance(degree, int) \
                or not 0 <= degree <= MAX_DEGREE:
            raise ValueError(f"degree must be an integer in [0, {MAX_DEGREE}], got {degree!r}")
        if isinstance(segments, bool) or not isinstance(segments, int) \
                or not 2 <= segments <= MAX_SEGMENTS:
            raise ValueError(f"segments must be an integer in [2, {MAX_SEGMENTS}], "
                             f"got {segments!r}")
        self.degree = degree
        self.segments = segments

    def order(self, values) -> np.ndarray:
        """Ascending order of the values (stable), the order the stream uses."""
        return np.argsort(working_copy(check_values(values)), kind="stable")

    def _piece_degrees(self, lengths: np.ndarray) -> np.ndarray:
        return np.minimum(self.degree, lengths - 1)

    def _fit(self, values):
        values = check_values(values)
        y = working_copy(values)
        if not np.all(np.isfinite(y)):
            raise ValueError("polyfit needs finite values (got NaN or infinity)")
        bounds = knots(y, self.degree, self.segments)
        lengths = np.diff(bounds)
        coefficients = [chebyshev.chebfit(_positions(hi - lo), y[lo:hi], deg).astype(np.float32)
                        for lo, hi, deg in zip(bounds[:-1].tolist(), bounds[1:].tolist(),
                                               self._piece_degrees(lengths).tolist())]
        data = b"".join([_bits.write_varint(lengths.size),
                         _bits.varint_encode(lengths.astype(np.uint64)),
                         *(c.astype("<f4").tobytes() for c in coefficients)])
        return data, lengths, coefficients, values.dtype

    def encode(self, values):
        return self._fit(values)[0]

    def encode_and_receive(self, values):
        data, lengths, coefficients, dtype = self._fit(values)
        return data, cast_back(_evaluate(lengths, coefficients), dtype)

    def decode(self, data, nnz, dtype):
        dtype = value_dtype(dtype, DecodeError)
        what = f"polyfit values (degree={self.degree}, segments={self.segments})"
        nnz = check_nnz(nnz, what)
        pieces, offset = _bits.read_varint(data, 0, what)
        if pieces > min(nnz, self.segments) or (nnz and not pieces):
            raise DecodeError(f"{what}: {pieces} pieces for {nnz} values")
        lengths, offset = _bits.varint_decode_prefix(data, pieces, what, offset)
        # each length is at most nnz < 2**63, so a float64 sum tells a wrapped uint64 sum
        if np.any(lengths == 0) or (pieces and np.any(lengths > nnz)) \
                or float(lengths.sum(dtype=np.float64)) > 2.0 * nnz + 1 \
                or int(lengths.sum()) != nnz:
            raise DecodeError(f"{what}: piece lengths do not cover the {nnz} values")
        lengths = lengths.astype(np.int64)
        counts = self._piece_degrees(lengths) + 1
        expected = offset + 4 * int(counts.sum())
        if len(data) != expected:
            raise DecodeError(f"{what}: stream holds {len(data)} bytes, expected {expected}")
        flat = np.frombuffer(data, dtype="<f4", offset=offset)
        coefficients = np.split(flat, np.cumsum(counts)[:-1])
        with np.errstate(over="ignore", invalid="ignore"):
            return cast_back(_evaluate(lengths, coefficients), dtype)
