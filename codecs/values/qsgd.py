"""QSGD: stochastic quantisation of values to a few levels per bucket (lossy, unbiased).

Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient
Quantization and Encoding" (NeurIPS 2017), as DeepReduce uses it for the
values of sparse gradients. The values are cut into buckets of ``bucket``
consecutive values; each bucket keeps a norm ``||x||`` as a float32 and
every value becomes ``sign(x) * ||x|| * l / s`` with ``s = 2**(bits-1) -
1`` levels and ``l`` in ``[0, s]`` drawn by stochastic rounding: with ``a
= |x| / ||x|| * s``, ``l = floor(a) + 1`` with probability ``a -
floor(a)``, else ``floor(a)``. Then ``E[decoded] = x`` exactly (the norm is
rounded *up* to float32, so ``a <= s`` always holds and the estimator stays
unbiased with respect to the stored norm).

``norm="max"`` (the default) scales by the bucket's largest magnitude, the
variant QSGD's authors use in practice: every level is reachable and the
variance is far smaller than with ``norm="l2"``, the paper's analysed
scaling (at 4 bits and 512-value buckets of Gaussian values the relative
L2 error is about 0.19 against 1.26).

Stream: ``seed u32`` (the dither seed of this call, :func:`dither`: the codec's
``seed`` mixed with its ``step``, the count of its earlier encodes, so calls
differ but a run is reproducible), the ``ceil(nnz / bucket)`` norms as little-endian float32,
then one ``bits``-bit code per value, ``2 * l + negative``, packed most
significant bit first (:func:`deepreduce.bits.pack_fixed`). A code
with ``l = 0`` has its sign bit clear (every ``bits``-bit code holds a
level ``<= s``, so no other code is invalid). A bucket holding an infinity or NaN
has a non-finite norm and decodes to NaN.

Examples
--------
>>> import numpy as np
>>> from deepreduce.codecs.values.qsgd import QSGDValues
>>> codec = QSGDValues(bits=4, bucket=4)
>>> data, received = codec.encode_and_receive(np.array([0.5, -1.0, 0.0, 2.0], np.float32))
>>> len(data)  # seed, one norm, four 4-bit codes
10
>>> bool(np.all(np.abs(received) <= np.float32(np.sqrt(5.25)) * 1.0001))
True
"""

from __future__ import annotations

import struct

import mmh3
import numpy as np

from deepreduce import bits as _bits
from deepreduce.codecs._murmur import murmur3_32
from deepreduce.codecs.base import ValueCodec
from deepreduce.codecs.values.dtypes import (_QUIET_CASTS, _float32_as, check_nnz, check_values,
                                      to_float32, value_dtype)
from deepreduce.errors import DecodeError
from deepreduce.registry import register_codec

try:
    from deepreduce.codecs.values import _qsgd
except ImportError:  # not built: the numpy loops below give the same bits
    _qsgd = None

#: Which loops quantise: ``"compiled"`` (``deepreduce.codecs.values._qsgd``, built by ``pip install``)
#: or ``"numpy"``. Both give the same bits.
IMPLEMENTATION = "numpy" if _qsgd is None else "compiled"

MIN_BITS, MAX_BITS = 2, 8
MAX_BUCKET = 1 << 24
NORMS = ("max", "l2")
_SEED = struct.Struct("<I")


def check_bucket(bucket) -> int:
    """Constructor check shared by the bucketed codecs: an integer in ``[1, 2**24]``."""
    if isinstance(bucket, bool) or not isinstance(bucket, int) or not 1 <= bucket <= MAX_BUCKET:
        raise ValueError(f"bucket must be an integer in [1, {MAX_BUCKET}], got {bucket!r}")
    return bucket


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    return seed


def working_copy(values: np.ndarray) -> np.ndarray:
    """Values as float64 (exact for every supported dtype)."""
    return values.astype(np.float64) if values.dtype == np.float64 else \
        to_float32(values).astype(np.float64)


def bucket_matrix(x: np.ndarray, bucket: int, dtype=None) -> np.ndarray:
    """``x`` (as ``dtype``, its own by default) zero-padded to whole buckets, shape
    ``(ceil(len/bucket), bucket)``."""
    rows = -(-x.size // bucket)
    padded = np.zeros(rows * bucket, dtype=x.dtype if dtype is None else dtype)
    padded[:x.size] = x
    return padded.reshape(rows, bucket)


def cast_back(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """float64 or float32 results -> ``dtype`` (rounded once for float32, via float32 for
    narrower); ``x`` itself when it has that dtype."""
    if x.dtype == dtype:
        return x
    with np.errstate(**_QUIET_CASTS):  # the narrowing to float32 as well as the cast after
        return _float32_as(x.astype(np.float32, copy=False), dtype)


def float32_at_least(x: np.ndarray) -> np.ndarray:
    """Smallest float32 values ``>= x`` (non-negative float64 input; NaN stays NaN)."""
    with np.errstate(over="ignore", invalid="ignore"):
        rounded = x.astype(np.float32)
        low = rounded.astype(np.float64) < x
    rounded[low] = np.nextafter(rounded[low], np.float32(np.inf))
    return rounded


def bucket_l2_norms(rows: np.ndarray) -> np.ndarray:
    """L2 norm of each row, scaled by the row's peak so squares never overflow.

    A row holding NaN or an infinity gets a NaN norm.
    """
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        peak = np.max(np.abs(rows), axis=1)
        ratio = rows / np.where(peak > 0, peak, 1.0)[:, None]
        return peak * np.sqrt(np.sum(ratio * ratio, axis=1))


def bucket_peaks(rows: np.ndarray) -> np.ndarray:
    """Largest magnitude of each row (NaN when the row holds a NaN)."""
    return np.max(np.abs(rows), axis=1)


def dither(count: int, seed: int) -> np.ndarray:
    """The stochastic rounding's draws for ``count`` values, float32 in ``[0, 1)``: value
    ``i`` draws the top 24 bits of the MurmurHash3 of ``i`` (4 bytes) with ``seed``, over
    2**24 (24 bits are plenty for 8-bit levels). A hash of each position, not a
    generator's stream: the compiled loop draws the same values in the same pass that
    quantises them."""
    draws = murmur3_32(np.arange(count, dtype=np.uint64) & np.uint64(0xFFFFFFFF), seed) >> 8
    return draws.astype(np.float32) * np.float32(2.0 ** -24)


def quantize(rows: np.ndarray, norms: np.ndarray, s: int, dither: np.ndarray) -> np.ndarray:
    """The codes ``2 * level + negative`` of float64 ``rows`` (one bucket per row) with
    float32 ``norms`` and dither draws of the rows' shape: numpy's loop, the compiled
    one's fallback.

    A bucket with a zero or non-finite norm codes 0. Stochastic rounding is unbiased:
    ``floor(a + u)`` is ``floor(a) + 1`` with probability ``a - floor(a)``.
    """
    scale = norms.astype(np.float64)
    usable = np.isfinite(scale) & (scale > 0)
    a = np.abs(rows)  # a = |x| / norm * s, in place
    with np.errstate(invalid="ignore", divide="ignore"):
        a *= np.where(usable, s / scale, 0.0)[:, None]
    if not usable.all():
        a[~usable] = 0.0
    a += dither
    np.floor(a, out=a)
    np.minimum(a, s, out=a)
    levels = a.reshape(-1).astype(np.uint8)
    codes = levels << 1
    codes |= (rows.reshape(-1) < 0) & (levels > 0)
    return codes


def dequantize(codes: np.ndarray, norms: np.ndarray, bucket: int, s: int,
               dtype: np.dtype) -> np.ndarray:
    """``(-1)**negative * level * (norm / s)`` per code ``2 * level + negative``, in
    ``dtype`` (shared by encoder and decoder, so the sender knows exactly what arrives).

    The signed levels are made in int16 (two's complement: ``(l ^ -b) + b`` is
    ``-l`` when the sign bit ``b`` is set), then one multiplication by each
    bucket's ``norm / s``, broadcast over whole buckets; ``(-l) * scale`` has the
    bits of ``-(l * scale)``.
    """
    nnz, buckets = codes.size, norms.size
    negative = (codes & 1).astype(np.int16)
    signed = (codes >> 1).astype(np.int16)
    signed ^= -negative
    signed += negative
    x = np.zeros(buckets * bucket, dtype=np.float64)
    x[:nnz] = signed
    # Corrupt streams may hold signalling NaNs, which warn when widened.
    with np.errstate(invalid="ignore"):
        x.reshape(buckets, bucket)[...] *= (norms.astype(np.float64) / s)[:, None]
    return cast_back(x[:nnz], dtype)


@register_codec
class QSGDValues(ValueCodec):
    """QSGD with ``s = 2**(bits-1) - 1`` levels and one float32 scale per bucket.

    Parameters
    ----------
    bits : int
        Bits per value in ``[2, 8]``: one sign bit and ``bits - 1`` level bits.
    bucket : int
        Values per norm, in ``[1, 2**24]``.
    seed : int
        Seed of the stochastic rounding, in ``[0, 2**32)``; mixed with a
        ``step`` (the encodes made so far: save and restore it to continue a
        sequence), the result written into the stream.
    norm : {"max", "l2"}
        Bucket scale: the largest magnitude (default: at 4 bits and buckets of
        512 its error is about 0.19 against 1.26 with the paper's L2 norm), or
        the L2 norm as in the QSGD paper. Both are unbiased.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.values.qsgd import QSGDValues
    >>> x = np.random.default_rng(0).standard_normal(2048).astype(np.float32)
    >>> codec = QSGDValues(bits=8)
    >>> data = codec.encode(x)
    >>> len(data) * 8 / x.size  # 8 bits per value plus a norm per 512 values
    8.078125
    >>> y = codec.decode(data, nnz=x.size, dtype=np.float32)
    >>> float(np.linalg.norm(y - x) / np.linalg.norm(x)) < 0.05
    True
    """

    codec_id = "qsgd"
    lossless = False

    def __init__(self, bits: int = 4, bucket: int = 512, seed: int = 0, norm: str = "max"):
        if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
            raise ValueError(f"bits must be an integer in [{MIN_BITS}, {MAX_BITS}], got {bits!r}")
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {', '.join(NORMS)}; got {norm!r}")
        self.bits = bits
        self.bucket = check_bucket(bucket)
        self.seed = check_seed(seed)
        self.norm = norm
        #: Encodes made so far: the next one draws from ``seed`` and ``step``. Save
        #: it to continue a sequence, set it to replay one (checkpoints store it).
        self.step = 0

    @property
    def levels(self) -> int:
        """``s``, the largest level."""
        return 2 ** (self.bits - 1) - 1

    def _next_seed(self) -> int:
        # murmur3_32 of the step as 8 bytes, by mmh3: one key needs no numpy arrays
        seed = mmh3.hash(int(self.step).to_bytes(8, "little"), self.seed, signed=False)
        self.step += 1
        return seed

    def _quantize(self, values, receive: bool):
        """``(stream, received or None)``; the compiled loops when built, else numpy."""
        values = check_values(values)
        seed = self._next_seed()
        s, nnz = self.levels, values.size
        if _qsgd is None:
            rows = bucket_matrix(values if values.dtype in (np.float32, np.float64)
                                 else working_copy(values), self.bucket, np.float64)
            norms = self._norms(rows)
            codes = quantize(rows, norms, s, dither(rows.size, seed).reshape(rows.shape))[:nnz]
            packed = _bits.pack_fixed(codes, self.bits)
            received = (dequantize(codes, norms, self.bucket, s, values.dtype) if receive
                        else None)
        else:
            wide = values if values.dtype in (np.float32, np.float64) else to_float32(values)
            if self.norm == "max":  # found by the compiled pass
                norms = np.empty(-(-nnz // self.bucket), np.float32)
            else:
                norms = self._norms(bucket_matrix(wide, self.bucket, np.float64))
            received = np.empty(nnz, wide.dtype) if receive else None
            packed = _qsgd.quantize(wide, self.bucket, self.bits, seed, norms,
                                    self.norm == "max", received)
            if receive:
                received = cast_back(received, values.dtype)
        return _SEED.pack(seed) + norms.astype("<f4").tobytes() + packed, received

    def _norms(self, rows: np.ndarray) -> np.ndarray:
        """Each bucket's float32 scale; a NaN one is written as ``np.nan`` whatever the
        input's NaN payload, as the compiled loop writes it."""
        norms = float32_at_least(bucket_l2_norms(rows) if self.norm == "l2" else
                                 bucket_peaks(rows))
        norms[np.isnan(norms)] = np.nan
        return norms

    def encode(self, values):
        return self._quantize(values, receive=False)[0]

    def encode_and_receive(self, values):
        return self._quantize(values, receive=True)

    def decode(self, data, nnz, dtype):
        dtype = value_dtype(dtype, DecodeError)
        what = f"qsgd values (bits={self.bits}, bucket={self.bucket})"
        nnz = check_nnz(nnz, what)
        buckets = -(-nnz // self.bucket)
        expected = _SEED.size + 4 * buckets + _bits.packed_bytes(nnz * self.bits)
        if len(data) != expected:
            raise DecodeError(f"{what}: stream holds {len(data)} bytes, expected {expected} "
                              f"for {nnz} values")
        norms = np.frombuffer(data, dtype="<f4", count=buckets, offset=_SEED.size)
        if np.any(norms < 0):
            raise DecodeError(f"{what}: negative bucket norm")
        packed = memoryview(data)[_SEED.size + 4 * buckets:]
        if _qsgd is None:
            codes = _bits.unpack_fixed(packed, nnz, self.bits, what)
            canonical = not np.any(codes == 1)
            received = dequantize(codes, norms, self.bucket, self.levels, dtype)
        else:
            received = np.empty(nnz, np.float64 if dtype == np.float64 else np.float32)
            canonical = _qsgd.dequantize(packed, norms, self.bucket, self.bits, received)
            received = cast_back(received, dtype)
        if not canonical:
            raise DecodeError(f"{what}: level 0 with the sign bit set")
        return received

