"""The formats deepreduce's outer-step payloads are weighed against, re-implemented here.

Two formats of Templar (tplr-ai/templar), the open implementation of SparseLoCo,
written from their descriptions for :mod:`benchmarks.outer` (nothing of theirs is
imported or copied):

* **The 20-bit format** (:func:`pack20_encode`, :func:`pack20_decode`), what its main
  branch sends: every chunk of a tensor (64 x 64 tiles of a 2-D weight, ``C = 4096``
  positions) keeps its ``k`` largest magnitudes; each kept element goes as its 12-bit
  position inside its chunk, two positions to three bytes, plus one byte for its
  quantised value; the quantiser's small table travels once per tensor. Its own
  quantiser (:func:`templar_codes`) centres the values on their mean, divides by
  ``range * std / bins`` (the sample standard deviation), rounds, adds ``bins / 2``
  and clips to ``[0, bins)``; each code is decoded as the mean of the centred values
  that fell in its bin, plus the mean. Here the bytes can carry either that
  quantiser's codes or deepreduce's ``statq`` codes (``2**bits`` equal bins over
  ``mean +- sigmas * std``, each decoded as its bin's float32 mean): with ``statq``
  they carry exactly the values a deepreduce payload of the same selection carries,
  which ``tests/test_outer_formats.py`` checks bit for bit.
* **The Rice/bitmap index format** of its unmerged branch ``feat/efficient-compress``
  (:func:`rice_bitmap_encode`, :func:`rice_bitmap_decode`, and the cost formula
  :func:`rice_bitmap_bits` that its encoder chooses by). A payload is a bit stream,
  every field least significant bit first: ``C - 1`` in 12 bits, the number of rows
  (chunks) ``N`` in 16, one reserved bit; then per row its length in bytes (16 bits)
  and the row, padded to whole bytes. A row splits its ``C`` positions into ``C / B``
  sub-blocks, ``B`` one of (64, 128) (the powers of two dividing ``C``), and writes
  ``log2 B`` (5 bits), a Rice parameter ``r`` (4 bits) and a flag (1 bit); then for
  every sub-block its count of kept positions as a Rice code (``count >> r`` ones, a
  zero, the low ``r`` bits of the count) and, when the count is not zero, either a
  ``B``-bit bitmap of the sub-block or each position inside it in ``log2 B`` bits
  (the flag says which, for the whole row). ``r = max(0, round(log2(k B / C)))`` for
  a row of ``k``. Per row the encoder takes the ``B`` and the flag of the fewest bits
  by the formula ``10 + sum_j (floor(c_j / 2**r) + 1 + r) + min(k log2 B, B s)``
  (``c_j`` the counts, ``s`` the sub-blocks that hold any), ties to the smaller ``B``
  and to positions over the bitmap.

Both are written with whole-array numpy work; the decoders are plain loops (they are
here to check the encoders, not to be fast).
"""

from __future__ import annotations

import math

import numpy as np

from deepreduce.codecs.values.qsgd import cast_back, working_copy
from deepreduce.codecs.values.statq import bin_codes, bin_means
from deepreduce.sparse import SparseTensor
from deepreduce.sparsifiers import ChunkTopK, chunk_keys

#: What SparseLoCo's settings make of a tensor: 64 x 64 tiles, four bins over +- 6 sigma.
CHUNK, BINS, SIGMAS = 4096, 4, 6.0

#: The sub-block sizes the Rice/bitmap encoder chooses among.
B_CHOICES = (64, 128)

#: Bits of the Rice/bitmap payload's header and of each row's own header and length.
PAYLOAD_HEADER_BITS, ROW_HEADER_BITS, ROW_LENGTH_BITS = 12 + 16 + 1, 5 + 4 + 1, 16


# -- chunk-wise selections as rows of positions inside their chunks -----------------------

def chunk_rows(indices: np.ndarray, shape, sparsifier: ChunkTopK) -> tuple[np.ndarray, np.ndarray]:
    """``(rows, order)``: the kept flat ``indices`` of a tensor of ``shape`` as positions
    inside their chunks, one row per chunk in :meth:`ChunkTopK.layout`'s numbering,
    ascending within a row (int64, ``(chunks, k)``); and the permutation that puts the
    flat order into that row order (``indices[order]`` is row by row).

    >>> import numpy as np, deepreduce as dr
    >>> x = np.arange(16.0).reshape(4, 4)
    >>> tiles = dr.ChunkTopK(k=1, chunk=4)            # 2 x 2 tiles, one kept in each
    >>> st = tiles(x)
    >>> rows, order = chunk_rows(st.indices, x.shape, tiles)
    >>> st.indices.tolist(), rows.ravel().tolist(), st.indices[order].tolist()
    ([5, 7, 13, 15], [3, 3, 3, 3], [5, 7, 13, 15])
    """
    keys = chunk_keys(indices, sparsifier.layout(shape))
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    chunks = -(-math.prod(shape) // sparsifier.chunk)
    if keys.size != chunks * sparsifier.k:
        raise ValueError(f"{keys.size} kept elements are not {sparsifier.k} in each of "
                         f"{chunks} chunks")
    rows = (keys % sparsifier.chunk).reshape(chunks, sparsifier.k)
    if np.any(keys.reshape(chunks, -1) // sparsifier.chunk != np.arange(chunks)[:, None]):
        raise ValueError(f"the chunks do not hold {sparsifier.k} kept elements each")
    return rows, order


def keys_to_indices(keys: np.ndarray, shape, sparsifier: ChunkTopK) -> np.ndarray:
    """Inverse of :func:`deepreduce.sparsifiers.chunk_keys`: the flat index of every chunk
    key (``chunk * number + position``), in the keys' order."""
    kind, side, cols = sparsifier.layout(shape)
    if kind == "flat":
        return np.asarray(keys, dtype=np.int64)
    tile, local = np.divmod(keys, side * side)
    tile_row, tile_col = np.divmod(tile, cols // side)
    local_row, local_col = np.divmod(local, side)
    return (tile_row * side + local_row) * cols + tile_col * side + local_col


# -- the quantisers ------------------------------------------------------------------------

def statq_codes(values: np.ndarray, bins: int = BINS, sigmas: float = SIGMAS):
    """``(codes, table)``: deepreduce's ``statq`` quantiser on ``values`` (in the order
    given: the mean and deviation are sums), the table holding every bin's decoded
    float32 value (0 for bins no value fell in); ``table[codes]`` is what ``statq``
    decodes."""
    x = working_copy(np.asarray(values))
    codes = bin_codes(x, bins, sigmas)
    used, means = bin_means(x, codes, bins)
    table = np.zeros(bins, dtype=np.float32)
    table[used] = means
    return codes, table


def templar_codes(values: np.ndarray, bins: int = BINS, sigmas: float = SIGMAS):
    """``(codes, table)``: Templar's quantiser, in float64 (its own runs in the values'
    dtype): ``codes = clip(round((v - mean) / (sigmas * std / bins)) + bins // 2, 0,
    bins - 1)``, ``std`` the sample deviation (``n - 1``), and each code decoded as the
    mean of its bin's centred values plus the mean (float32).

    >>> codes, table = templar_codes(np.array([-3.0, -1.0, 1.0, 3.0]))
    >>> codes.tolist()              # steps of 6 std / 4 = 3.87 around 0: round(v / 3.87) + 2
    [1, 2, 2, 3]
    """
    x = np.asarray(values, dtype=np.float64)
    shift = x.mean()
    centred = x - shift
    std = math.sqrt(float(centred @ centred) / max(centred.size - 1, 1))
    scale = sigmas * std / bins
    if not (scale > 0 and math.isfinite(scale)):
        scale = 1.0
    codes = np.clip(np.round(centred / scale) + bins // 2, 0, bins - 1).astype(np.uint8)
    counts = np.bincount(codes, minlength=bins)
    sums = np.bincount(codes, weights=centred, minlength=bins)
    lookup = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)
    return codes, (lookup + shift).astype(np.float32)


QUANTISERS = {"statq": statq_codes, "templar": templar_codes}


def code_entropy_bits(codes: np.ndarray, bins: int = BINS) -> float:
    """Empirical (zero-order) entropy of ``codes`` in bits per code.

    >>> code_entropy_bits(np.array([0, 1, 0, 1], np.uint8))
    1.0
    """
    counts = np.bincount(codes, minlength=bins)
    p = counts[counts > 0] / codes.size
    return float(-(p * np.log2(p)).sum()) + 0.0


# -- the 20-bit format -----------------------------------------------------------------------

def pack12(positions: np.ndarray) -> bytes:
    """12-bit positions, two to three bytes: the first's low 8 bits, then its high 4 bits
    under the second's low 4, then the second's high 8 (an odd count gets a 0 partner)."""
    p = np.asarray(positions, dtype=np.int64)
    if p.size and (p.min() < 0 or p.max() >= 1 << 12):
        raise ValueError("positions must fit in 12 bits")
    pairs = np.zeros(2 * -(-p.size // 2), dtype=np.int64)
    pairs[:p.size] = p
    first, second = pairs[0::2], pairs[1::2]
    out = np.empty((first.size, 3), dtype=np.uint8)
    out[:, 0] = first & 0xFF
    out[:, 1] = (first >> 8) | ((second & 0xF) << 4)
    out[:, 2] = second >> 4
    return out.tobytes()


def unpack12(data, count: int) -> np.ndarray:
    """Inverse of :func:`pack12`."""
    raw = np.frombuffer(data, dtype=np.uint8).reshape(-1, 3).astype(np.int64)
    out = np.empty(2 * raw.shape[0], dtype=np.int64)
    out[0::2] = raw[:, 0] | ((raw[:, 1] & 0xF) << 8)
    out[1::2] = (raw[:, 1] >> 4) | (raw[:, 2] << 4)
    return out[:count]


def pack20_size(count: int, bins: int = BINS) -> int:
    """Bytes of the 20-bit format for ``count`` kept elements of one tensor: the table,
    three bytes per two positions, a byte per value."""
    return 4 * bins + 3 * -(-count // 2) + count


def pack20_encode(x: np.ndarray, sparsifier: ChunkTopK, quantiser: str = "statq",
                  bins: int = BINS, sigmas: float = SIGMAS) -> bytes:
    """The 20-bit format of one tensor: the table (``bins`` little-endian float32), the
    chunk-local positions of every kept element (12 bits, chunk by chunk, ascending
    within one), then one byte per kept element, its code, in the same order.

    The quantiser sees the kept values in flat-index order, as deepreduce's payload
    sends them, so that ``"statq"`` makes the same codes and table as the ``statq``
    value codec. The shape, ``k`` and the chunk geometry are the receiver's to know,
    as in Templar (every peer holds the model).

    >>> import numpy as np, deepreduce as dr
    >>> g = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32)
    >>> data = pack20_encode(g, dr.ChunkTopK(k=64))
    >>> len(data), (len(data) - 16) * 8 / (4 * 64)          # the table, then 20 bits each
    (656, 20.0)
    """
    st = sparsifier(x)
    codes, table = QUANTISERS[quantiser](st.values, bins, sigmas)
    rows, order = chunk_rows(st.indices, st.shape, sparsifier)
    return (table.astype("<f4").tobytes() + pack12(rows.ravel())
            + codes[order].astype(np.uint8).tobytes())


def pack20_decode(data, shape, sparsifier: ChunkTopK, bins: int = BINS,
                  dtype=np.float32) -> SparseTensor:
    """Inverse of :func:`pack20_encode`: the kept elements of a tensor of ``shape`` with
    their decoded values (``table[code]`` as ``dtype``), in flat-index order."""
    chunks = -(-math.prod(shape) // sparsifier.chunk)
    count = chunks * sparsifier.k
    if len(data) != pack20_size(count, bins):
        raise ValueError(f"{len(data)} bytes, expected {pack20_size(count, bins)}")
    table = np.frombuffer(data, "<f4", bins, 0).astype(np.float32)
    index_end = 4 * bins + 3 * -(-count // 2)
    rows = unpack12(memoryview(data)[4 * bins:index_end], count).reshape(chunks, -1)
    codes = np.frombuffer(data, np.uint8, count, index_end)
    flat = keys_to_indices((np.arange(chunks)[:, None] * sparsifier.chunk + rows).ravel(),
                           shape, sparsifier)
    order = np.argsort(flat)
    values = cast_back(table[codes[order]], np.dtype(dtype))
    return SparseTensor(values, flat[order], tuple(shape), dtype=np.dtype(dtype))


# -- the Rice/bitmap index format ------------------------------------------------------------

def _valid_b(C: int, choices=B_CHOICES) -> tuple:
    valid = tuple(sorted(b for b in choices if b > 0 and not b & (b - 1) and C % b == 0))
    if not valid:
        raise ValueError(f"no sub-block size of {choices} divides C = {C}")
    return valid


def rice_parameter(k: int, C: int, B: int) -> int:
    """``max(0, round(log2(k B / C)))`` (0 for an empty row), the Rice parameter of the
    counts of a row of ``k`` in sub-blocks of ``B`` (its expected count per sub-block)."""
    mean = k * B / max(C, 1)
    return max(0, int(np.round(math.log2(max(mean, 1e-9)))))


def _row_choices(counts_by_b: dict, k: int, C: int):
    """Per row of ``k`` positions: the chosen ``B``, its Rice parameter, the bitmap flag,
    and its bits."""
    rows = next(iter(counts_by_b.values())).shape[0]
    best_bits = np.full(rows, np.iinfo(np.int64).max, dtype=np.int64)
    best_b = np.zeros(rows, dtype=np.int64)
    best_r = np.zeros(rows, dtype=np.int64)
    best_map = np.zeros(rows, dtype=bool)
    for B, counts in counts_by_b.items():
        lb = B.bit_length() - 1
        r = rice_parameter(k, C, B)
        rice = (counts >> r).sum(axis=1) + (1 + r) * (C // B)
        local = ROW_HEADER_BITS + rice + lb * k
        bitmap = ROW_HEADER_BITS + rice + B * (counts > 0).sum(axis=1)
        bits = np.minimum(local, bitmap)
        better = bits < best_bits
        best_bits = np.where(better, bits, best_bits)
        best_b = np.where(better, B, best_b)
        best_r = np.where(better, r, best_r)
        best_map = np.where(better, bitmap < local, best_map)
    return best_b, best_r, best_map, best_bits


def _counts(rows: np.ndarray, C: int, B: int) -> np.ndarray:
    """Kept positions per sub-block of ``B``, ``(rows, C // B)``."""
    n_sub = C // B
    flat = (np.arange(rows.shape[0])[:, None] * n_sub + rows // B).ravel()
    return np.bincount(flat, minlength=rows.shape[0] * n_sub).reshape(rows.shape[0], n_sub)


def rice_bitmap_bits(rows: np.ndarray, C: int, choices=B_CHOICES) -> int:
    """Bits of the Rice/bitmap payload of ``rows`` (``(N, k)`` positions in ``[0, C)``) by
    the description's cost formula: the header, then per row its 16-bit length and the
    chosen ``B``'s bits rounded up to whole bytes. The payload is this, rounded up to
    whole bytes.

    >>> rows = np.arange(0, 4096, 128).reshape(1, 32)   # one per 128: 64 sub-blocks of 64
    >>> int(rice_bitmap_bits(rows, 4096))   # a row of 298 bits: 29 + 16 + 8 x 38
    349
    """
    rows = np.asarray(rows, dtype=np.int64)
    counts = {B: _counts(rows, C, B) for B in _valid_b(C, choices)}
    bits = _row_choices(counts, rows.shape[1], C)[3]
    return PAYLOAD_HEADER_BITS + int((ROW_LENGTH_BITS + 8 * -(-bits // 8)).sum())


def _field_bits(values: np.ndarray, widths: np.ndarray, starts: np.ndarray, out: np.ndarray):
    """Write each value's low ``width`` bits, least significant first, from ``start``."""
    widths = np.asarray(widths, dtype=np.int64)
    total = int(widths.sum())
    if not total:
        return
    field = np.repeat(np.arange(widths.size), widths)
    offset = np.arange(total) - np.repeat(np.cumsum(widths) - widths, widths)
    out[np.repeat(starts, widths) + offset] = (np.asarray(values, dtype=np.int64)[field]
                                               >> offset) & 1


def rice_bitmap_encode(rows: np.ndarray, C: int, choices=B_CHOICES) -> bytes:
    """The Rice/bitmap payload of ``rows`` (``(N, k)`` positions in ``[0, C)``, each row's
    distinct; see the module docstring).

    >>> rows = np.array([[1, 5, 64, 4000]])
    >>> data = rice_bitmap_encode(rows, 4096)
    >>> len(data) == -(-rice_bitmap_bits(rows, 4096) // 8), rice_bitmap_decode(data)[0]
    (True, [[1, 5, 64, 4000]])
    """
    rows = np.sort(np.asarray(rows, dtype=np.int64), axis=1)
    N, k = rows.shape
    if not 1 <= C <= 1 << 12 or N >= 1 << 16:
        raise ValueError(f"C must be in [1, 4096] and rows fewer than 65536, got {C}, {N}")
    if rows.size and (rows.min() < 0 or rows.max() >= C or np.any(np.diff(rows, axis=1) == 0)):
        raise ValueError("each row must hold distinct positions in [0, C)")
    valid = _valid_b(C, choices)
    counts_by_b = {B: _counts(rows, C, B) for B in valid}
    best_b, best_r, best_map, row_bits = _row_choices(counts_by_b, k, C)
    row_bytes = -(-row_bits // 8)
    if np.any(row_bytes >= 1 << 16):
        raise ValueError("a row longer than 65535 bytes")
    row_start = PAYLOAD_HEADER_BITS + np.concatenate(
        ([0], np.cumsum(ROW_LENGTH_BITS + 8 * row_bytes)[:-1])).astype(np.int64)
    total = PAYLOAD_HEADER_BITS + int((ROW_LENGTH_BITS + 8 * row_bytes).sum())
    bits = np.zeros(8 * -(-total // 8), dtype=np.uint8)
    _field_bits([C - 1, N, 0], [12, 16, 1], np.array([0, 12, 28]), bits)
    _field_bits(row_bytes, np.full(N, 16), row_start, bits)
    body = row_start + ROW_LENGTH_BITS
    lbs = np.array([b.bit_length() - 1 for b in best_b.tolist()], dtype=np.int64)
    _field_bits(np.stack([lbs, best_r, best_map.astype(np.int64)], 1).ravel(),
                np.tile([5, 4, 1], N), np.stack([body, body + 5, body + 9], 1).ravel(), bits)
    for B in valid:  # the rows of one sub-block size at once
        chosen = np.flatnonzero(best_b == B)
        if not chosen.size:
            continue
        lb = B.bit_length() - 1
        counts = counts_by_b[B][chosen]                      # (R, C // B)
        r = best_r[chosen][:, None]
        q = counts >> r
        payload = np.where(best_map[chosen][:, None], B * (counts > 0), lb * counts)
        lengths = q + 1 + r + payload                        # bits of each sub-block
        starts = (body[chosen] + ROW_HEADER_BITS)[:, None] + np.cumsum(lengths, 1) - lengths
        # the unary part: q ones (the zero after them is the array's own)
        bits[np.repeat(starts.ravel(), q.ravel())
             + np.arange(int(q.sum())) - np.repeat(np.cumsum(q.ravel()) - q.ravel(), q.ravel())] = 1
        _field_bits((counts & ((1 << r) - 1)).ravel(), np.broadcast_to(r, counts.shape).ravel(),
                    (starts + q + 1).ravel(), bits)
        data_start = starts + q + 1 + r                      # where each sub-block's data goes
        sub = rows[chosen] // B                              # (R, k), ascending in each row
        local = rows[chosen] - sub * B
        row_of = np.repeat(np.arange(chosen.size), k)
        first = data_start[row_of, sub.ravel()]
        if best_map[chosen].any():
            mapped = np.repeat(best_map[chosen], k)
            bits[(first + local.ravel())[mapped]] = 1
        listed = ~np.repeat(best_map[chosen], k)
        if listed.any():
            # rank of each position inside its sub-block (rows are sorted, so sub ascends)
            before = np.cumsum(counts, 1) - counts
            rank = np.arange(k)[None, :] - np.take_along_axis(before, sub, 1)
            _field_bits(local.ravel()[listed], np.full(int(listed.sum()), lb),
                        (first + lb * rank.ravel())[listed], bits)
    return np.packbits(bits, bitorder="little").tobytes()


class _Bits:
    """Reads fields least significant bit first from a byte string."""

    def __init__(self, data):
        self.bits = np.unpackbits(np.frombuffer(data, np.uint8), bitorder="little")
        self.at = 0

    def read(self, width: int) -> int:
        if self.at + width > self.bits.size:
            raise ValueError("the payload ends inside a field")
        field = self.bits[self.at:self.at + width]
        self.at += width
        return int.from_bytes(np.packbits(field, bitorder="little").tobytes(), "little")

    def unary(self) -> int:
        ones = 0
        while self.read(1):
            ones += 1
        return ones


def rice_bitmap_decode(data) -> tuple[list, int]:
    """``(rows, C)`` of a Rice/bitmap payload: each row's positions, ascending."""
    reader = _Bits(data)
    C, N = reader.read(12) + 1, reader.read(16)
    reader.read(1)
    rows = []
    for _ in range(N):
        length = reader.read(16)
        row = _Bits(bytes(reader.read(8) for _ in range(length)))
        lb, r, bitmap = row.read(5), row.read(4), row.read(1)
        B = 1 << lb
        positions = []
        for j in range(C // B):
            count = (row.unary() << r) + row.read(r)
            if not count:
                continue
            if bitmap:
                mask = row.read(B)
                positions += [j * B + p for p in range(B) if mask >> p & 1]
            else:
                positions += [j * B + row.read(lb) for _ in range(count)]
        rows.append(positions)
    return rows, C
