"""Index sets that hold exactly ``k`` in every chunk (chunk-wise Top-k), at the entropy bound.

SparseLoCo's selection (:class:`deepreduce.ChunkTopK`) keeps ``k`` of every chunk of
``C`` positions: the receiver then knows each chunk's count, and a set carries only
``log2 C(C, k)`` bits per chunk (7.36 bits per index at ``C = 4096, k = 64``), less than
any gap code of the whole set reaches (``auto``: 7.48), which spends bits saying how
many indices each stretch holds. That is the information of a uniform choice within
each chunk; sets whose positions cluster inside their chunks carry less, and there a
gap code can win (``auto`` codes the pseudo-gradients of ``benchmarks.outer``'s language
model in about 7% fewer bits than this bound): the encoder keeps whichever of the two
streams is shorter.

The coder: each chunk's bitmap, position by position, through a binary range coder
(LZMA's carry-propagating one, 32-bit range) with the probability of a one set to
``ones left / positions left`` of the chunk, ``floor(range * ones / positions)``
computed exactly in integers. The product of those probabilities over a chunk is
``1 / C(size, k)``, so the stream is the bound plus the coder's rounding: at most
``2**-24`` relative per decision and a few bytes per stream (within 0.1% of the
bound at ``k = 32, 64, 128`` per 4096: the table in docs/codecs.md). Positions whose
bit is implied (no ones left, or as many ones as positions) cost nothing. One 64-bit
division per position of the universe, encode and decode alike: the compiled loops
(``deepreduce.codecs.index._chunkc``) do little else per position; the Python loop
below, their fallback, gives the same bytes but pays the interpreter on every position
of the universe (docs/codecs.md gives both speeds).

The chunk geometry travels in the stream, so a reader needs nothing but the stream,
``n`` and ``nnz``. The encoder is given indices and ``n`` alone (every index codec is:
the pipeline, the bundles and the collectives pass no shape), so it finds the layout
itself: flat chunks of ``chunk`` first, then the square tiles of side ``isqrt(chunk)``
of every row length ``cols`` that could tile a tensor of ``n`` elements, each
candidate rejected by the counts of whole tile rows (one binary search per tile row)
before its chunks are counted (``cols=`` names the row length and skips the search).
A set that no layout fits, sparse input for one, is coded by ``auto``, and so is one
whose ``auto`` stream is shorter than its exact one: ``auto``'s stream is made first
(its coders pass over the indices, not over the universe, and cost little beside the
range coder), and the range coder runs only when its stream could be the shorter (no
exact stream falls more than :data:`SHORTFALL` bytes below its layout's information).
"""

from __future__ import annotations

import math

import numpy as np

from deepreduce import bits as _bits
from deepreduce.codecs.index import auto
from deepreduce.codecs.base import IndexCodec, no_indices
from deepreduce.errors import DecodeError
from deepreduce.registry import register_codec

try:
    from deepreduce.codecs.index import _chunkc
except ImportError:  # not built: the Python loop below gives the same bytes
    _chunkc = None

#: Which loops code the chunks: ``"compiled"`` (``deepreduce.codecs.index._chunkc``) or
#: ``"numpy"`` (the Python loop of the fallback, named as the other extensions' are).
#: Both give the same bytes.
IMPLEMENTATION = "numpy" if _chunkc is None else "compiled"

#: The first byte of a stream: the layout of its chunks.
GENERAL, FLAT, TILES = 0, 1, 2

#: The largest chunk. ``floor(range * ones / positions)`` stays at least 1 up to 2**24
#: (the range is at least that); the bound keeps decoding within a constant of the
#: stream: a chunk that says anything costs at least ``log2 chunk`` bits, so a stream
#: of ``b`` bits decodes at most ``b * chunk / log2 chunk`` positions (4,096 a bit).
MAX_CHUNK = 1 << 16

#: Tilings are searched among row lengths only when a tensor of ``n`` elements has at
#: most this many tile rows or columns to choose from (the divisors of ``n / chunk``
#: are found by trial division up to its square root).
SEARCH_LIMIT = 1 << 22

_AUTO = auto.AutoIndices()
_TOP = 1 << 24
_MASK32 = 0xFFFFFFFF


# ------------------------------------------------------------------ the range coder

def _encode_python(keys: np.ndarray, chunk: int, chunks: int, last: int, k: int) -> bytes:
    """:func:`encode_keys` in Python: the loop that ``_chunkc.encode`` compiles."""
    out = bytearray()
    low, rng, cache, pending = 0, _MASK32, 0, 1

    def shift_low():
        nonlocal low, cache, pending
        if low < 0xFF000000 or low >= 1 << 32:
            carry, byte = low >> 32, cache
            while True:
                out.append((byte + carry) & 0xFF)
                byte = 0xFF
                pending -= 1
                if not pending:
                    break
            cache = (low >> 24) & 0xFF
        pending += 1
        low = (low & 0x00FFFFFF) << 8

    key, count, j = keys.tolist(), keys.size, 0
    for c in range(chunks):
        size = last if c == chunks - 1 else chunk
        base = c * chunk
        ones, left = min(k, size), size
        for p in range(base, base + size):
            if ones == 0:  # the rest of the chunk is empty: nothing to say
                if j < count and key[j] < base + size:
                    raise ValueError("a chunk holds more keys than its count")
                break
            if ones == left:  # the rest is full
                if key[j:j + left] != list(range(p, base + size)):
                    raise ValueError("a chunk holds fewer keys than its count")
                j += left
                break
            bound = rng * ones // left
            if j < count and key[j] == p:
                rng = bound
                ones -= 1
                j += 1
            else:
                low += bound
                rng -= bound
            left -= 1
            while rng < _TOP:
                rng = (rng << 8) & _MASK32
                shift_low()
    if j != count:
        raise ValueError("keys are not increasing or leave their chunks")
    for shift in (32, 24, 16, 8, 0):  # the value with the most zero bytes in the range
        mask = (1 << shift) - 1
        value = (low + mask) & ~mask
        if value < low + rng:
            low = value
            break
    for _ in range(5):
        shift_low()
    end = len(out)
    while end > 1 and end + 4 > len(out) and out[end - 1] == 0:  # the flush's zeros
        end -= 1
    return bytes(out[1:end])


def _decode_python(data, chunk: int, chunks: int, last: int, k: int, out: np.ndarray):
    """:func:`decode_keys` in Python: the loop that ``_chunkc.decode`` compiles."""
    data = bytes(data)
    length = len(data)
    code = window = int.from_bytes(data[:4].ljust(4, b"\0"), "big")
    read, rng = 4, _MASK32
    if code >= rng:
        return "stream starts outside its range"
    found = []
    for c in range(chunks):
        size = last if c == chunks - 1 else chunk
        base = c * chunk
        ones, left = min(k, size), size
        if out.size - len(found) < ones:
            return "more keys than the output holds"
        for p in range(base, base + size):
            if ones == 0:
                break
            if ones == left:
                found.extend(range(p, base + size))
                break
            bound = rng * ones // left
            if code < bound:
                rng = bound
                found.append(p)
                ones -= 1
            else:
                code -= bound
                rng -= bound
            left -= 1
            while rng < _TOP:
                if read == length + 4:
                    return "the stream ends inside its coded chunks"
                byte = data[read] if read < length else 0
                rng = (rng << 8) & _MASK32
                code = ((code << 8) & _MASK32) | byte
                window = ((window << 8) & _MASK32) | byte
                read += 1
    if len(found) != out.size:
        return "fewer keys than the geometry implies"
    if read < length:
        return "trailing bytes after the coded chunks"
    if read < length + 4 and length and data[-1] == 0:
        return "a zero byte at the end that the encoder leaves out"
    # The encoder ends on the value of [low, low + range) with the most zero bytes at
    # its end: low is window - code, and code must be that value's offset.
    low = (window - code) & _MASK32
    for shift in (32, 24, 16, 8, 0):
        offset = -low % (1 << shift)
        if offset < rng:
            break
    if code != offset:
        return "the stream does not end where the encoder ends it"
    out[:] = found
    return None


def encode_keys(keys: np.ndarray, chunk: int, chunks: int, last: int, k: int) -> bytes:
    """The range-coded bitmaps of ``chunks`` chunks of ``chunk`` positions (the last of
    ``last``), each holding ``min(k, size)`` of the sorted int64 ``keys``
    (``chunk * number + position``); ValueError when they do not."""
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    if _chunkc is not None:
        return _chunkc.encode(keys, chunk, chunks, last, k)
    return _encode_python(keys, chunk, chunks, last, k)


def log2_binomial(n: int, k: int) -> float:
    """``log2 C(n, k)`` (float64)."""
    return (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)


def layout_bits(chunk: int, chunks: int, last: int, k: int) -> float:
    """The information of a set of the layout: ``log2 C(size, min(k, size))`` a chunk,
    which the coded chunks reach within a few bytes (every set has that much)."""
    if chunks == 0:
        return 0.0
    return ((chunks - 1) * log2_binomial(chunk, min(k, chunk))
            + log2_binomial(last, min(k, last)))


#: Bytes a stream of coded chunks may fall short of its layout's information: the flush's
#: zeros left out and the float rounding of :func:`layout_bits`, with room to spare.
SHORTFALL = 6


def decode_keys(data, chunk: int, chunks: int, last: int, k: int, count: int,
                what: str) -> np.ndarray:
    """Inverse of :func:`encode_keys` (``count`` is the number of keys the geometry
    implies); DecodeError for a stream the encoder cannot have written."""
    needed = layout_bits(chunk, chunks, last, k)
    if needed > 8 * (len(data) + SHORTFALL):
        raise DecodeError(f"{what}: {len(data)} bytes cannot hold the {needed:.0f} bits "
                          f"of {chunks} chunks of {k}")
    out = np.empty(count, dtype=np.int64)
    problem = (_chunkc.decode(data, chunk, chunks, last, k, out) if _chunkc is not None
               else _decode_python(data, chunk, chunks, last, k, out))
    if problem is not None:
        raise DecodeError(f"{what}: {problem}")
    return out


# ------------------------------------------------------------------ layouts

def tile_keys(indices: np.ndarray, side: int, cols: int) -> np.ndarray:
    """Chunk keys of flat indices of a ``(n // cols, cols)`` matrix cut into ``side x
    side`` tiles, numbered row-major, positions row-major within a tile (the layout of
    :meth:`deepreduce.ChunkTopK.layout`)."""
    row, col = np.divmod(indices, cols)
    tile_row, local_row = np.divmod(row, side)
    tile_col, local_col = np.divmod(col, side)
    return ((tile_row * (cols // side) + tile_col) * side + local_row) * side + local_col


def tile_indices(keys: np.ndarray, side: int, cols: int) -> np.ndarray:
    """Inverse of :func:`tile_keys`, sorted."""
    tile, local = np.divmod(keys, side * side)
    tile_row, tile_col = np.divmod(tile, cols // side)
    local_row, local_col = np.divmod(local, side)
    return np.sort((tile_row * side + local_row) * cols + tile_col * side + local_col)


def flat_count(n: int, chunk: int, k: int) -> int:
    """Indices a flat layout holds: ``k`` per whole chunk, ``min(k, rest)`` in the last."""
    return (n // chunk) * min(k, chunk) + min(k, n % chunk)


def _flat_fits(indices: np.ndarray, n: int, chunk: int):
    """``k`` when every whole chunk of ``chunk`` holds ``k`` indices and a last, shorter
    one ``min(k, its size)``; else None."""
    whole = n // chunk
    k = int(np.searchsorted(indices, chunk)) if whole else indices.size
    if k == 0 or flat_count(n, chunk, k) != indices.size:
        return None
    if whole > 1:
        counts = np.diff(np.searchsorted(indices, np.arange(0, whole * chunk + 1, chunk)))
        if np.any(counts != k):
            return None
    return k


def _tiles_fit(indices: np.ndarray, n: int, side: int, cols: int):
    """``k`` when every ``side x side`` tile of the ``(n // cols, cols)`` matrix holds
    ``k`` indices; else None."""
    chunk = side * side
    if cols % side or n % cols or (n // cols) % side:
        return None
    tiles = n // chunk
    if indices.size % tiles:
        return None
    k = indices.size // tiles
    per_row = cols // side
    band = side * cols   # positions of one row of tiles
    counts = np.diff(np.searchsorted(indices, np.arange(0, n + 1, band)))
    if k == 0 or np.any(counts != k * per_row):
        return None
    first = tile_keys(indices[:k * per_row], side, cols) // chunk
    if np.any(np.bincount(first, minlength=per_row) != k):
        return None
    if np.any(np.bincount(tile_keys(indices, side, cols) // chunk, minlength=tiles) != k):
        return None
    return k


def _row_lengths(n: int, side: int) -> list:
    """Every row length that tiles a tensor of ``n`` elements in ``side x side`` tiles,
    shortest first (none when there are too many to try)."""
    chunk = side * side
    if n == 0 or n % chunk:
        return []
    tiles = n // chunk
    root = math.isqrt(tiles)
    if root > SEARCH_LIMIT:
        return []
    low = np.arange(1, root + 1, dtype=np.int64)
    low = low[tiles % low == 0]
    counts = sorted(set(low.tolist()) | set((tiles // low).tolist()))
    return [side * count for count in counts]


def find_layout(indices: np.ndarray, n: int, chunk: int, cols: int | None = None):
    """``(FLAT, chunk, k)`` or ``(TILES, side, cols, k)``: a layout in which every chunk of
    the set holds its count (see the module docstring), or None."""
    side = math.isqrt(chunk)
    square = side * side == chunk
    if cols is not None and square:
        k = _tiles_fit(indices, n, side, cols)
        if k is not None:
            return TILES, side, cols, k
    k = _flat_fits(indices, n, chunk)
    if k is not None:
        return FLAT, chunk, k
    if square and cols is None:
        for length in _row_lengths(n, side):
            k = _tiles_fit(indices, n, side, length)
            if k is not None:
                return TILES, side, length, k
    return None


# ------------------------------------------------------------------ the codec

def _check_positive(value, name: str, limit: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise ValueError(f"{name} must be an integer in [1, {limit}], got {value!r}")
    return value


@register_codec
class ChunkedIndices(IndexCodec):
    """Sets with exactly ``k`` indices in every chunk (:class:`deepreduce.ChunkTopK`):
    each chunk's bitmap range-coded at ``log2 C(C, k)`` bits, the bound.

    Stream: one layout byte, then

    * ``1`` (flat): varints ``chunk`` and ``k``, then the coded chunks: consecutive
      chunks of ``chunk`` positions, the last one shorter when ``chunk`` does not
      divide ``n`` (it holds ``min(k, size)``);
    * ``2`` (tiles): varints ``side``, ``cols`` and ``k``, then the coded chunks: the
      ``side x side`` tiles of the ``(n // cols, cols)`` matrix, row-major, positions
      row-major within each;
    * ``0`` (general): an ``auto`` stream, for sets no layout fits and for those whose
      ``auto`` stream is shorter than the exact one (small sets, where the range
      coder's flush and the geometry cost bytes; sets whose positions cluster inside
      their chunks).

    The coded chunks are the range coder's bytes (see the module docstring) without
    their first byte (always zero) and the zero bytes among its last four (implied).
    The decoder refuses a stream shorter than its layout's information (``log2 C(size,
    k)`` bits per chunk, every decoded set has exactly that) before decoding, reads at
    most the four implied zeros past its end, refuses bytes it did not read, a zero
    byte the encoder would have left out, and an end other than the encoder's.

    Why the geometry is in the stream rather than the configuration: an index codec
    is given a sorted set and ``n``, never the shape, and one codec serves every
    tensor of an exchange. So the encoder finds the layout (or is told the row length
    with ``cols``) and writes it: a reader needs only the stream, and ``chunk`` and
    ``cols`` steer only the encoder (payload headers name plain ``chunked``).

    Parameters
    ----------
    chunk : int, default 4096
        Elements per chunk the encoder looks for, up to 2**16: flat chunks of this
        size, or square tiles of side ``isqrt(chunk)`` when it is a square. Give the
        sparsifier's: ``k`` per 32 x 32 tile is also ``4k`` per 64 x 64 tile, a layout
        the default would find and code near that coarser layout's (higher) bound.
    cols : int or None, default None
        The row length (last dimension) of the tensors coded, when known: tiles of
        that matrix are tried first. None searches every row length.

    Examples
    --------
    >>> import numpy as np, deepreduce as dr
    >>> from deepreduce.codecs.index.chunked import ChunkedIndices
    >>> g = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    >>> st = dr.ChunkTopK(k=64)(g)                       # 16 tiles of 64 x 64
    >>> codec = ChunkedIndices()
    >>> data = codec.encode(st.indices, n=g.size)
    >>> data[0], round(8 * len(data) / st.nnz, 2), round(float(dr.index_entropy_bits(4096, 64)), 2)
    (2, 7.41, 7.36)
    >>> np.array_equal(codec.decode(data, n=g.size, nnz=st.nnz), st.indices)
    True
    """

    codec_id = "chunked"
    encoder_options = ("chunk", "cols")

    def __init__(self, chunk: int = 4096, cols: int | None = None):
        self.chunk = _check_positive(chunk, "chunk", MAX_CHUNK)
        self.cols = None if cols is None else _check_positive(cols, "cols", _bits.MAX_UNIVERSE)

    def encode(self, indices, n):
        indices = _bits.check_indices(indices, n)
        if indices.size == 0:
            return b""
        general = bytes([GENERAL]) + _AUTO.encode(indices, n)
        layout = find_layout(indices, n, self.chunk, self.cols)
        if layout is None:
            return general
        if layout[0] == FLAT:
            _, chunk, k = layout
            chunks = -(-n // chunk)
            head = bytes([FLAT]) + _bits.write_varint(chunk) + _bits.write_varint(k)
            keys, geometry = indices, (chunk, chunks, n - (chunks - 1) * chunk, k)
        else:
            _, side, cols, k = layout
            head = (bytes([TILES]) + _bits.write_varint(side) + _bits.write_varint(cols)
                    + _bits.write_varint(k))
            keys = np.sort(tile_keys(indices, side, cols))
            geometry = (side * side, n // (side * side), side * side, k)
        if len(general) < len(head) + layout_bits(*geometry) / 8 - SHORTFALL:
            return general  # (no exact stream can be as short)
        data = head + encode_keys(keys, *geometry)
        return general if len(general) < len(data) else data

    def _geometry(self, data, n: int, what: str):
        """``(offset, chunk, chunks, last, k, count, cols)`` from an exact stream's head
        (``cols`` None for flat chunks)."""
        offset = 1
        if data[0] == FLAT:
            chunk, offset = _bits.read_varint(data, offset, f"{what}: chunk", MAX_CHUNK)
            if chunk == 0:
                raise DecodeError(f"{what}: chunk of 0 positions")
            cols = None
            chunks = -(-n // chunk)
            last = n - (chunks - 1) * chunk
        else:
            side, offset = _bits.read_varint(data, offset, f"{what}: side", math.isqrt(MAX_CHUNK))
            cols, offset = _bits.read_varint(data, offset, f"{what}: cols", max(n, 1))
            chunk = side * side
            if side == 0 or cols == 0 or cols % side or n % cols or (n // cols) % side:
                raise DecodeError(f"{what}: tiles of side {side} do not tile {n} elements "
                                  f"in rows of {cols}")
            chunks, last = n // chunk, chunk
        k, offset = _bits.read_varint(data, offset, f"{what}: k", chunk)
        if k == 0 or n == 0:
            raise DecodeError(f"{what}: an exact stream of no indices")
        count = flat_count(n, chunk, k) if cols is None else chunks * k
        return offset, chunk, chunks, last, k, count, cols

    def max_count(self, data, n):
        if not data:
            return 0
        if data[0] == GENERAL:
            return _AUTO.max_count(memoryview(data)[1:], n)
        try:
            return self._geometry(data, n, "chunked indices")[5] if data[0] in (FLAT, TILES) \
                else None
        except DecodeError:
            return None

    def orders(self, data):
        if len(data) and data[0] == GENERAL:
            return _AUTO.orders(memoryview(data)[1:])
        return len(data) > 0  # keys decode in order; tiles are sorted after mapping back

    def decode(self, data, n, nnz):
        what = "chunked indices"
        n, nnz = _bits.check_counts(n, nnz, what)
        if nnz == 0:
            return no_indices(data, what)
        if len(data) == 0:
            raise DecodeError(f"{what}: empty stream for {nnz} indices")
        if data[0] == GENERAL:
            return _AUTO.decode(bytes(memoryview(data)[1:]), n, nnz)
        if data[0] not in (FLAT, TILES):
            raise DecodeError(f"{what}: unknown layout {data[0]}")
        offset, chunk, chunks, last, k, count, cols = self._geometry(data, n, what)
        if count != nnz:
            raise DecodeError(f"{what}: the layout holds {count} indices, expected {nnz}")
        keys = decode_keys(memoryview(data)[offset:], chunk, chunks, last, k, count, what)
        return keys if cols is None else tile_indices(keys, math.isqrt(chunk), cols)
