"""Fit-DExp: sorted magnitudes sent as a double exponential, signs as a bitmap.

DeepReduce's second curve fit (Kostopoulou et al., arXiv 2102.03112): the
magnitudes of a sparsified gradient, sorted ascending, follow a slow rise
and a sharp final tail, which ``a e^(p x) + c e^(q x)`` captures with four
numbers. Here the positions are mapped to ``x`` in ``[0, 1]`` and the second
term is anchored at the end, ``y(x) = a e^(p x) + c e^(q (x - 1))``, so no
coefficient over- or underflows float32 however steep the tail.

The values travel in ascending order of magnitude (``sorts_values``;
``order`` is a stable argsort of ``|x|``) and each value's sign travels as
one bit. The fit is :func:`scipy.optimize.curve_fit` (least squares,
Levenberg-Marquardt) on at most 4096 evenly spaced points of the sorted
curve plus its top 1%, started from a guess read off the curve (see
:func:`fit`); when it fails to converge, or converges to something worse
than the guess or than a constant, the better of those is kept. Fewer than
8 values get a constant (their mean magnitude).

Stream: ``a, p, c, q`` as little-endian float32, then a bitmap of nnz bits,
bit ``i`` set when value ``i`` is negative (bit ``i`` is bit ``i % 8`` of
byte ``i // 8``, zero padding). Values must be finite (encoding raises
ValueError otherwise).

Examples
--------
>>> import numpy as np
>>> from deepreduce.codecs.values.dexp import DoubleExpValues
>>> x = np.random.default_rng(0).laplace(size=10_000).astype(np.float32)
>>> codec = DoubleExpValues()
>>> y = x[codec.order(x)]
>>> data, received = codec.encode_and_receive(y)
>>> len(data)  # four parameters and 10,000 sign bits
1266
>>> bool(np.all(np.sign(received) == np.sign(y)))
True
"""

from __future__ import annotations

import warnings

import numpy as np
from scipy.optimize import OptimizeWarning, curve_fit

from deepreduce import bits as _bits
from deepreduce.codecs.base import ValueCodec
from deepreduce.codecs.values.dtypes import check_nnz, check_values, value_dtype
from deepreduce.codecs.values.qsgd import cast_back, working_copy
from deepreduce.errors import DecodeError
from deepreduce.registry import register_codec

#: Below this many values the curve is a constant (the mean magnitude).
MIN_FIT = 8
#: Evenly spaced points the least-squares fit sees (plus the top 1%).
FIT_POINTS = 4096
#: Model evaluations curve_fit may spend before giving up.
MAX_EVALUATIONS = 600
_PARAMS = 4


def curve(x: np.ndarray, a: float, p: float, c: float, q: float) -> np.ndarray:
    """``a e^(p x) + c e^(q (x - 1))``."""
    return a * np.exp(p * x) + c * np.exp(q * (x - 1.0))


def _positions(nnz: int) -> np.ndarray:
    return np.linspace(0.0, 1.0, nnz) if nnz > 1 else np.zeros(nnz)


def _initial_guess(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """A start read off the curve: the slow term, then the fast one from what is left.

    ``y`` is sorted ascending and non-negative. The slow term is a straight
    line through ``log y`` over the first 90% of the positions; the fast
    term's height is what the slow term misses at the top, its rate the
    inverse of the distance from the top to where that miss has fallen by
    a factor e.
    """
    body = max(2, int(0.9 * y.size))
    positive = y[:body] > 0
    if np.count_nonzero(positive) >= 2:
        p, log_a = np.polyfit(x[:body][positive], np.log(y[:body][positive]), 1)
        a, p = float(np.exp(log_a)), float(np.clip(p, -50.0, 50.0))
    else:
        a, p = float(y[:body].mean()), 0.0
    missed = y - a * np.exp(p * x)
    c = max(float(missed[-1]), 0.0)
    q = 1.0
    if c > 0:
        below = np.flatnonzero(missed < c / np.e)
        if below.size:
            q = 1.0 / max(1.0 - float(x[below[-1]]), 1.0 / y.size)
    return np.array([a, p, c, float(np.clip(q, 1.0, 1e4))])


def fit(y: np.ndarray) -> np.ndarray:
    """The four parameters for the sorted magnitudes ``y``, as float32.

    The best (least squares on the fitted points) of: the curve_fit result,
    the initial guess, and the constant mean, so a failed or diverging fit
    never does worse than a constant.
    """
    nnz = y.size
    mean = float(y.mean()) if nnz else 0.0
    constant = np.array([mean, 0.0, 0.0, 0.0])
    if nnz < MIN_FIT:
        return constant.astype(np.float32)
    x = _positions(nnz)
    sample = np.unique(np.r_[np.linspace(0, nnz - 1, min(nnz, FIT_POINTS)).astype(np.int64),
                             np.arange(nnz - max(1, nnz // 100), nnz)])
    xs, ys = x[sample], y[sample]
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", OptimizeWarning)
        guess = _initial_guess(x, y)
        candidates = [constant, guess]
        try:
            candidates.append(curve_fit(curve, xs, ys, p0=guess, maxfev=MAX_EVALUATIONS)[0])
        except (RuntimeError, ValueError, FloatingPointError):
            pass  # no convergence: the guess and the constant remain
        errors = [np.sum((curve(xs, *c.astype(np.float32).astype(np.float64)) - ys) ** 2)
                  for c in candidates]
    errors = [e if np.isfinite(e) else np.inf for e in errors]
    return candidates[int(np.argmin(errors))].astype(np.float32)


def _magnitudes(params: np.ndarray, nnz: int) -> np.ndarray:
    """The fitted curve at every position, float64 (shared by encoder and decoder)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return curve(_positions(nnz), *params.astype(np.float64).tolist())


@register_codec
class DoubleExpValues(ValueCodec):
    """Fit-DExp: a double exponential through the sorted magnitudes, plus sign bits.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.values.dexp import DoubleExpValues
    >>> codec = DoubleExpValues()
    >>> data = codec.encode(np.array([-1.0, 2.0, -3.0], dtype=np.float32))
    >>> codec.decode(data, nnz=3, dtype=np.float32).tolist()  # a constant below 8 values
    [-2.0, 2.0, -2.0]
    """

    codec_id = "dexp"
    lossless = False
    sorts_values = True

    def order(self, values) -> np.ndarray:
        """Ascending order of the magnitudes (stable), the order the stream uses."""
        return np.argsort(np.abs(working_copy(check_values(values))), kind="stable")

    def _fit(self, values):
        values = check_values(values)
        x = working_copy(values)
        if not np.all(np.isfinite(x)):
            raise ValueError("dexp needs finite values (got NaN or infinity)")
        params = fit(np.abs(x))
        negative = x < 0
        data = params.astype("<f4").tobytes() + _bits.positions_to_bitmap(
            np.flatnonzero(negative), x.size)
        return data, params, negative, values.dtype

    @staticmethod
    def _values(params, negative, dtype):
        y = _magnitudes(params, negative.size)
        np.negative(y, out=y, where=negative)
        return cast_back(y, dtype)

    def encode(self, values):
        return self._fit(values)[0]

    def encode_and_receive(self, values):
        data, params, negative, dtype = self._fit(values)
        return data, self._values(params, negative, dtype)

    def decode(self, data, nnz, dtype):
        dtype = value_dtype(dtype, DecodeError)
        what = "dexp values"
        nnz = check_nnz(nnz, what)
        expected = 4 * _PARAMS + _bits.packed_bytes(nnz)
        if len(data) != expected:
            raise DecodeError(f"{what}: stream holds {len(data)} bytes, expected {expected} "
                              f"for {nnz} values")
        params = np.frombuffer(data, dtype="<f4", count=_PARAMS)
        negative = np.zeros(nnz, dtype=bool)
        negative[_bits.bitmap_to_positions(data[4 * _PARAMS:], nnz, what)] = True
        return self._values(params, negative, dtype)
