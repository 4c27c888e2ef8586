"""Statistical quantisation: uniform bins over mean +- r sigma, each bin sent as its mean (lossy).

The quantiser of INTELLECT-1 and SparseLoCo (Sarfi et al. 2025, arXiv 2508.15706:
4 bins over +-6 sigma, 2 bits). The values' mean ``mu`` and standard deviation
``sigma`` (over the finite values, in float64) set ``2**bits`` bins of equal width
``w = 2 r sigma / 2**bits`` over ``[mu - r sigma, mu + r sigma]``; each value is sent
as its bin's number, values outside the range in the edge bins, and the receiver gets
the mean of the values that fell in each bin, sent once as a small float32 table. So
every decoded value is the float32 mean of its bin, within ``w`` of the value for
values inside the range, and the bin means keep the sum of every bin (unlike bin
centres, they are unbiased over the bin).

The codes go as ``bits``-bit fields, or, when it is smaller, as a zstd frame of the
codes grouped ``8 // bits`` to a byte (zstd's Huffman stage then codes 2-bit codes in
groups of four, close to their entropy where a code a symbol would spend a bit at least).

Stream (empty for no values): a flags byte (bit 0: the codes are a zstd frame), a
bitmap of the bins in use (``2**bits`` bits, bin ``b`` in bit ``b % 8`` of byte
``b // 8``), the little-endian float32 means of those bins in bin order, then the
codes: ``nnz`` fields of ``bits`` bits, most significant first
(:func:`deepreduce.bits.pack_fixed`), or the frame of ``ceil(nnz / g)`` bytes, code
``i`` in bits ``bits * (g - 1 - i % g)`` up of byte ``i // g``, ``g = 8 // bits``
(the last byte's missing codes zero). Values holding an infinity or NaN decode to NaN
(the table holds NaN), as a QSGD bucket with a non-finite norm does.
"""

from __future__ import annotations

import math

import numpy as np

from deepreduce import bits as _bits
from deepreduce.codecs.base import ValueCodec
from deepreduce.codecs.values.dtypes import check_nnz, check_values, value_dtype
from deepreduce.codecs.values.qsgd import cast_back, working_copy
from deepreduce.codecs._zstd import zstd_compress, zstd_decompress
from deepreduce.errors import DecodeError
from deepreduce.registry import register_codec

MIN_BITS, MAX_BITS = 2, 8

#: Flag of the first byte: the codes are a zstd frame of grouped codes.
ENTROPY_CODED = 1

#: The zstd level of the codes' frame (its Huffman stage does the work; matches rarely
#: pay on quantised gradient values).
ZSTD_LEVEL = 3


def bin_codes(x: np.ndarray, bins: int, sigmas: float) -> np.ndarray:
    """The bin number (uint8) of every float64 value: ``bins`` equal bins over
    ``mean +- sigmas * std`` of the finite values, the values outside in the edge bins
    (NaN in bin 0). All in bin 0 when the values do not spread."""
    finite = np.isfinite(x)
    every = bool(finite.all())
    sample = x if every else x[finite]
    if sample.size == 0:
        return np.zeros(x.size, dtype=np.uint8)
    mean = float(sample.mean())
    std = float(sample.std())
    width = 2 * sigmas * std / bins
    if not (width > 0 and math.isfinite(width)):
        return np.zeros(x.size, dtype=np.uint8)
    with np.errstate(invalid="ignore"):
        position = np.floor((x - (mean - sigmas * std)) / width)
    if not every:
        position[np.isnan(position)] = 0
    np.clip(position, 0, bins - 1, out=position)
    return position.astype(np.uint8)


def bin_means(x: np.ndarray, codes: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """``(used, means)``: which bins hold values (bool) and the float32 mean of each used
    one (NaN for all when a value is not finite)."""
    counts = np.bincount(codes, minlength=bins)
    used = counts > 0
    if not np.isfinite(x).all():
        return used, np.full(int(used.sum()), np.nan, dtype=np.float32)
    sums = np.bincount(codes, weights=x, minlength=bins)
    return used, (sums[used] / counts[used]).astype(np.float32)


def group_codes(codes: np.ndarray, bits: int) -> bytes:
    """Codes ``8 // bits`` to a byte, the first in the high bits (see the module docstring)."""
    per_byte = 8 // bits
    padded = np.zeros(-(-codes.size // per_byte) * per_byte, dtype=np.uint16)
    padded[:codes.size] = codes
    shifts = bits * np.arange(per_byte - 1, -1, -1, dtype=np.uint16)
    return (padded.reshape(-1, per_byte) << shifts).sum(axis=1).astype(np.uint8).tobytes()


def ungroup_codes(data, count: int, bits: int, what: str) -> np.ndarray:
    """Inverse of :func:`group_codes`; the last byte's missing codes must be zero."""
    per_byte = 8 // bits
    grouped = np.frombuffer(data, dtype=np.uint8)
    shifts = bits * np.arange(per_byte - 1, -1, -1, dtype=np.uint8)
    codes = ((grouped[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)
    if np.any(codes[count:]):
        raise DecodeError(f"{what}: bits set past the last code")
    return codes[:count]


@register_codec
class StatQuantValues(ValueCodec):
    """Uniform bins over ``mean +- sigmas * std``, each value decoded as its bin's mean.

    Parameters
    ----------
    bits : int, default 2
        Bits per code, in ``[2, 8]``: ``2**bits`` bins (SparseLoCo: 2, four bins).
    sigmas : float, default 6.0
        Half the range in standard deviations (SparseLoCo: 6); values beyond it go to
        the edge bins.

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.codecs.values.statq import StatQuantValues
    >>> x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    >>> codec = StatQuantValues(bits=2, sigmas=6)
    >>> data, received = codec.encode_and_receive(x)
    >>> np.unique(received).size, round(8 * len(data) / x.size, 2)   # four bins: 1.15 bits
    (4, 1.15)
    >>> np.array_equal(codec.decode(data, x.size, np.float32), received)
    True
    >>> same_bin = received == received[0]          # decoded: the mean of its bin
    >>> bool(received[0] == np.float32(x[same_bin].astype(np.float64).mean()))
    True
    """

    codec_id = "statq"
    lossless = False

    def __init__(self, bits: int = 2, sigmas: float = 6.0):
        if isinstance(bits, bool) or not isinstance(bits, int) or not MIN_BITS <= bits <= MAX_BITS:
            raise ValueError(f"bits must be an integer in [{MIN_BITS}, {MAX_BITS}], got {bits!r}")
        if isinstance(sigmas, bool) or not isinstance(sigmas, (int, float)) \
                or not 0 < sigmas < float("inf"):
            raise ValueError(f"sigmas must be a positive finite number, got {sigmas!r}")
        self.bits = bits
        self.sigmas = float(sigmas)

    @property
    def bins(self) -> int:
        return 1 << self.bits

    def _quantize(self, values):
        values = check_values(values)
        if values.size == 0:
            return b"", values.copy()
        x = working_copy(values)
        codes = bin_codes(x, self.bins, self.sigmas)
        used, means = bin_means(x, codes, self.bins)
        table = np.zeros(self.bins, dtype=np.float32)
        table[used] = means
        received = cast_back(table[codes], values.dtype)
        packed = _bits.pack_fixed(codes, self.bits)
        frame = zstd_compress(group_codes(codes, self.bits), ZSTD_LEVEL)
        flags = ENTROPY_CODED if len(frame) < len(packed) else 0
        head = (bytes([flags]) + np.packbits(used, bitorder="little").tobytes()
                + means.astype("<f4").tobytes())
        return head + (frame if flags else packed), received

    def encode(self, values):
        return self._quantize(values)[0]

    def encode_and_receive(self, values):
        return self._quantize(values)

    def decode(self, data, nnz, dtype):
        dtype = value_dtype(dtype, DecodeError)
        what = f"statq values (bits={self.bits})"
        nnz = check_nnz(nnz, what)
        if nnz == 0:
            if len(data):
                raise DecodeError(f"{what}: {len(data)} bytes for no values")
            return np.zeros(0, dtype=dtype)
        map_bytes = self.bins // 8 if self.bins >= 8 else 1
        if len(data) < 1 + map_bytes:
            raise DecodeError(f"{what}: stream of {len(data)} bytes ends in its header")
        flags = data[0]
        if flags & ~ENTROPY_CODED:
            raise DecodeError(f"{what}: unknown flags {flags:#x}")
        used = np.unpackbits(np.frombuffer(data, np.uint8, map_bytes, 1),
                             bitorder="little").astype(bool)
        if np.any(used[self.bins:]):
            raise DecodeError(f"{what}: bins past {self.bins - 1} marked in use")
        used = used[:self.bins]
        start = 1 + map_bytes + 4 * int(used.sum())
        if not used.any() or len(data) < start:
            raise DecodeError(f"{what}: no bins in use or a truncated table")
        table = np.zeros(self.bins, dtype=np.float32)
        table[used] = np.frombuffer(data, "<f4", int(used.sum()), 1 + map_bytes)
        body = memoryview(data)[start:]
        if flags & ENTROPY_CODED:
            size = -(-nnz // (8 // self.bits))
            grouped = zstd_decompress(body, size, what)
            if len(grouped) != size:
                raise DecodeError(f"{what}: {len(grouped)} bytes of codes, expected {size}")
            codes = ungroup_codes(grouped, nnz, self.bits, what)
        else:
            if len(body) != _bits.packed_bytes(nnz * self.bits):
                raise DecodeError(f"{what}: {len(body)} bytes of codes, expected "
                                  f"{_bits.packed_bytes(nnz * self.bits)} for {nnz} values")
            codes = _bits.unpack_fixed(body, nnz, self.bits, what)
        present = np.bincount(codes, minlength=self.bins) > 0
        if not np.array_equal(present, used):
            raise DecodeError(f"{what}: the codes use other bins than the table names")
        with np.errstate(invalid="ignore"):
            return cast_back(table[codes], dtype)
