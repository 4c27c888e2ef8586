"""MurmurHash3 x86_32 of integer keys, vectorised in numpy uint32 arithmetic.

The result equals ``mmh3.hash(key_bytes, seed, signed=False)`` bit for bit,
where ``key_bytes`` is the key in little-endian order, 4 bytes long
(``key.to_bytes(4, "little")``) or 8 bytes long (``key.to_bytes(8,
"little")``). Index codecs hash positions of the universe ``[0, n)`` with
4-byte keys when ``n <= 2**32`` and with 8-byte keys otherwise
(:func:`key_bytes_for`): the 4-byte hash is about a quarter cheaper, and
that is what a universe scan spends most of its time on.

Two entry points:

* :func:`murmur3_32` hashes an arbitrary key array (the seed may be an array
  too, broadcast against the keys);
* :class:`RangeHasher` hashes runs of consecutive keys ``start, start+1,
  ...`` into reusable buffers, the inner loop of a universe scan: about 20
  in-place numpy operations per chunk, no allocation.

Examples
--------
>>> import mmh3
>>> import numpy as np
>>> from deepreduce.codecs._murmur import murmur3_32
>>> int(murmur3_32(np.array([7]), seed=42)[0]) == mmh3.hash((7).to_bytes(4, "little"), 42, signed=False)
True
>>> int(murmur3_32(np.array([2**40 + 5]), seed=1, key_bytes=8)[0]) == mmh3.hash(
...     (2**40 + 5).to_bytes(8, "little"), 1, signed=False)
True
"""

from __future__ import annotations

import numpy as np

_U32 = np.uint32
_C1 = 0xCC9E2D51
_C2 = 0x1B873593
_ROUND_ADD = 0xE6546B64
_FMIX1 = 0x85EBCA6B
_FMIX2 = 0xC2B2AE35
_MASK32 = 0xFFFFFFFF


def key_bytes_for(n: int) -> int:
    """Key width used to hash positions of a universe of ``n`` elements: 4 or 8 bytes."""
    return 4 if n <= 2**32 else 8


def _rotl(x: np.ndarray, r: int, tmp: np.ndarray) -> None:
    """Rotate uint32 ``x`` left by ``r`` bits in place (``tmp``: scratch of the same shape)."""
    np.left_shift(x, _U32(r), out=tmp)
    np.right_shift(x, _U32(32 - r), out=x)
    np.bitwise_or(x, tmp, out=x)


def _scramble(k: np.ndarray, tmp: np.ndarray) -> None:
    """``k = rotl(k, 15) * c2`` in place; ``k`` already holds ``key_word * c1``."""
    _rotl(k, 15, tmp)
    np.multiply(k, _U32(_C2), out=k)


def _round_tail(h: np.ndarray, tmp: np.ndarray) -> None:
    """``h = rotl(h, 13) * 5 + 0xe6546b64`` in place (the end of one body round)."""
    _rotl(h, 13, tmp)
    np.multiply(h, _U32(5), out=h)
    np.add(h, _U32(_ROUND_ADD), out=h)


def _finish(h: np.ndarray, length: int, tmp: np.ndarray) -> None:
    """XOR the key length in, then the fmix32 avalanche, in place."""
    np.bitwise_xor(h, _U32(length), out=h)
    np.right_shift(h, _U32(16), out=tmp)
    np.bitwise_xor(h, tmp, out=h)
    np.multiply(h, _U32(_FMIX1), out=h)
    np.right_shift(h, _U32(13), out=tmp)
    np.bitwise_xor(h, tmp, out=h)
    np.multiply(h, _U32(_FMIX2), out=h)
    np.right_shift(h, _U32(16), out=tmp)
    np.bitwise_xor(h, tmp, out=h)


def _scramble_scalar(word: int) -> int:
    """Python-int version of ``rotl(word * c1, 15) * c2`` (for a key word shared by a chunk)."""
    k = (word * _C1) & _MASK32
    k = ((k << 15) | (k >> 17)) & _MASK32
    return (k * _C2) & _MASK32


def murmur3_32(keys, seed, key_bytes: int = 4) -> np.ndarray:
    """MurmurHash3 x86_32 of each key, as uint32.

    Parameters
    ----------
    keys : array of non-negative integers
        Each below ``2**(8 * key_bytes)``; hashed as its little-endian bytes.
    seed : int or uint32 array
        The hash seed (taken modulo 2**32); an array is broadcast against
        ``keys``, which gives one independent hash function per element.
    key_bytes : {4, 8}
        Key width in bytes.

    Returns
    -------
    numpy.ndarray
        uint32 hashes, shape of ``keys`` (broadcast with ``seed``).
    """
    if key_bytes not in (4, 8):
        raise ValueError(f"key_bytes must be 4 or 8, got {key_bytes!r}")
    keys = np.asarray(keys)
    if keys.dtype.kind not in "iu":
        raise ValueError(f"keys must be integers, got dtype {keys.dtype}")
    seed = np.asarray(seed)
    if seed.dtype.kind not in "iu":
        raise ValueError(f"seed must be an integer or integer array, got dtype {seed.dtype}")
    seed = (seed.astype(np.uint64) & np.uint64(_MASK32)).astype(_U32) if seed.ndim else \
        _U32(int(seed) & _MASK32)
    shape = np.broadcast_shapes(keys.shape, np.shape(seed))
    # astype to uint32 keeps the low 32 bits of each key (the first key word).
    h = np.broadcast_to(keys, shape).astype(_U32)
    np.multiply(h, _U32(_C1), out=h)
    tmp = np.empty_like(h)
    _scramble(h, tmp)
    np.bitwise_xor(h, seed, out=h)
    _round_tail(h, tmp)
    if key_bytes == 8:
        high = np.broadcast_to(keys.astype(np.uint64) >> np.uint64(32), shape).astype(_U32)
        np.multiply(high, _U32(_C1), out=high)
        _scramble(high, tmp)
        np.bitwise_xor(h, high, out=h)
        _round_tail(h, tmp)
    _finish(h, key_bytes, tmp)
    return h


class RangeHasher:
    """Hashes of consecutive keys ``start, start+1, ...``, chunk by chunk, without allocating.

    Parameters
    ----------
    chunk : int
        Largest number of keys hashed per call; the buffers have this size.

    Examples
    --------
    >>> import mmh3
    >>> from deepreduce.codecs._murmur import RangeHasher
    >>> h = RangeHasher(chunk=4).hash_range(10, 3, seed=5, key_bytes=4)
    >>> h.tolist() == [mmh3.hash(i.to_bytes(4, "little"), 5, signed=False) for i in (10, 11, 12)]
    True
    """

    def __init__(self, chunk: int):
        self.chunk = int(chunk)
        # key * c1 for the keys 0..chunk-1; a run starting at ``start`` adds
        # start * c1 (mod 2**32), one operation instead of a multiplication.
        self._key_times_c1 = np.arange(self.chunk, dtype=_U32) * _U32(_C1)
        self._hash = np.empty(self.chunk, dtype=_U32)
        self._tmp = np.empty(self.chunk, dtype=_U32)

    def hash_range(self, start: int, count: int, seed: int, key_bytes: int) -> np.ndarray:
        """Hashes of keys ``start .. start+count-1`` (a view of an internal buffer).

        The view is overwritten by the next call. With 8-byte keys the run
        must not cross a multiple of 2**32 (its high key word is shared).
        """
        if not 0 < count <= self.chunk:
            raise ValueError(f"count must be in [1, {self.chunk}], got {count}")
        high = start >> 32
        if key_bytes == 4 and (start + count - 1) >> 32:
            raise ValueError("4-byte keys must be below 2**32")
        if key_bytes == 8 and (start + count - 1) >> 32 != high:
            raise ValueError("a run of 8-byte keys must not cross a multiple of 2**32")
        h, tmp = self._hash[:count], self._tmp[:count]
        np.add(self._key_times_c1[:count], _U32((start * _C1) & _MASK32), out=h)
        _scramble(h, tmp)
        np.bitwise_xor(h, _U32(seed & _MASK32), out=h)
        _round_tail(h, tmp)
        if key_bytes == 8:
            np.bitwise_xor(h, _U32(_scramble_scalar(high)), out=h)
            _round_tail(h, tmp)
        _finish(h, key_bytes, tmp)
        return h
