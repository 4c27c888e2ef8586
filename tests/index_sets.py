"""Index sets and checks shared by the index codec tests."""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from deepreduce.codecs.index import _entropy
from deepreduce.errors import DecodeError
import extensions

#: Hypothesis settings of the tests comparing deepreduce.codecs.index._entropyc's loops with numpy's.
COMPILED_SETTINGS = settings(max_examples=60, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow,
                                                    HealthCheck.function_scoped_fixture])
compiled_only = pytest.mark.skipif(_entropy._entropyc is None,
                                   reason="deepreduce.codecs.index._entropyc is not built")


def both_outcomes(function, *args, messages=True):
    """``function(*args)`` with deepreduce.codecs.index._entropyc's loops and with numpy's: each
    result, or its DecodeError as ``"DecodeError: message"`` (``"DecodeError"`` alone
    when ``messages`` is False: the two implementations word them differently)."""
    def outcome():
        try:
            return function(*args)
        except DecodeError as error:
            return f"DecodeError: {error}" if messages else "DecodeError"
    return extensions.both(_entropy, "_entropyc", outcome)


def same(outcomes):
    """The outcome both implementations gave; arrays must be equal int64 arrays."""
    compiled, numpy = outcomes
    if isinstance(compiled, np.ndarray):
        assert isinstance(numpy, np.ndarray), numpy
        np.testing.assert_array_equal(compiled, numpy)
        assert compiled.dtype == numpy.dtype == np.int64
    else:
        assert compiled == numpy
    return compiled


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
