"""Index sets and checks shared by the index codec tests."""

import numpy as np


def assert_valid(indices, n, nnz):
    """What a decoder may return for any input: nnz strictly increasing int64 in [0, n)."""
    assert indices.dtype == np.int64
    assert indices.shape == (nnz,)
    if nnz:
        assert indices[0] >= 0 and indices[-1] < n
        assert np.all(np.diff(indices) > 0)


def round_trip(codec, indices, n):
    """Encode and decode ``indices`` with ``codec``; assert bit-exactness, return the stream."""
    indices = np.asarray(indices, dtype=np.int64)
    data = codec.encode(indices, n)
    assert isinstance(data, bytes)
    decoded = codec.decode(data, n, indices.size)
    assert decoded.dtype == np.int64
    np.testing.assert_array_equal(decoded, indices)
    return data


def random_set(rng, n, kind):
    """Index sets of the shapes the codecs meet: uniform, sparse, runs, aligned blocks."""
    if kind == "uniform":
        return np.sort(rng.choice(n, size=int(rng.integers(0, n + 1)), replace=False))
    if kind == "sparse":
        return np.sort(rng.choice(n, size=min(n, int(rng.integers(0, 20))), replace=False))
    if kind == "blocks":
        width = int(rng.choice([2, 8, 64]))
        blocks = -(-n // width)
        chosen = rng.choice(blocks, size=int(rng.integers(0, blocks + 1)), replace=False)
        indices = (np.sort(chosen)[:, None] * width + np.arange(width)).ravel()
        return indices[indices < n]
    # runs of adjacent indices, as block sparsifiers produce
    bits = np.zeros(n, dtype=bool)
    for start in rng.integers(0, n, size=int(rng.integers(0, 12))):
        bits[start:start + int(rng.integers(1, 60))] = True
    return np.flatnonzero(bits)


def bit_flipped(rng, data: bytes, copies: int = 8):
    """``copies`` corrupt copies of ``data``, each with one to three of its bits flipped."""
    for _ in range(copies):
        flipped = bytearray(data)
        for position in rng.integers(0, 8 * len(data), size=int(rng.integers(1, 4))):
            flipped[position // 8] ^= 1 << (position % 8)
        yield bytes(flipped)
