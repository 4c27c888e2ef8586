"""The contract every deepreduce codec keeps, as checks any codec can be run through.

deepreduce's own test suite runs every registered codec through
:func:`check_codec`; a codec of your own gets the same checks with one call::

    from deepreduce.testing import check_codec
    check_codec(MyIndexCodec())                      # in your test suite
    check_codec(MyLossyValues(), error_bound=0.05)   # relative L2 error allowed

What is checked (each check is also a function of its own):

* **round trip** (:func:`check_round_trip`): index codecs on empty, single,
  full, random and clustered sets, value codecs on every supported dtype and
  sizes from 0 up; lossless codecs return their input bit for bit, lossy
  ones exactly what ``encode_selection`` / ``encode_and_receive`` said the
  receiver gets, within ``error_bound`` of the input; an index codec's
  ``max_count`` never says a stream holds fewer indices than it does;
* **configuration** (:func:`check_config`): ``get_config`` is JSON-safe and
  ``from_config`` and the spec string rebuild an equal codec, and the header's
  spec names it but for its encoder-only options;
* **repr and equality** (:func:`check_repr_and_equality`);
* **hostile input** (:func:`check_hostile_decode`): truncated streams, flipped
  bits, inflated counts and a huge declared universe raise only
  :class:`~deepreduce.DecodeError` (or decode to a well-formed result), each
  within a time bound;
* **determinism** (:func:`check_determinism`): equal configurations at the
  same ``step`` (stochastic codecs) write the same bytes.
"""

from __future__ import annotations

import json
import time

import numpy as np

from deepreduce.errors import DecodeError
from deepreduce.registry import get_codec
from deepreduce.sparse import DTYPE_CODES

#: Seconds one hostile decode may take: far above what a check costs, far below
#: what decoding a declared size would.
HOSTILE_SECONDS = 2.0


def index_cases(seed: int = 0) -> list:
    """``(n, indices)`` pairs covering the shapes of index sets that matter."""
    rng = np.random.default_rng(seed)
    cases = [(0, np.zeros(0, np.int64)), (1, np.zeros(0, np.int64)), (1, np.array([0])),
             (1000, np.array([999])), (64, np.arange(64)), (5000, np.arange(5000, step=2))]
    for n, density in ((10_000, 0.001), (10_000, 0.01), (20_000, 0.1), (3000, 0.6)):
        cases.append((n, np.sort(rng.choice(n, int(density * n), replace=False))))
    blocks = np.sort(rng.choice(300, 40, replace=False))
    cases.append((300 * 32, (blocks[:, None] * 32 + np.arange(32)).reshape(-1)))
    return [(n, indices.astype(np.int64)) for n, indices in cases]


def value_cases(seed: int = 0) -> list:
    """Arrays of every supported dtype, empty to a few thousand values."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(size).astype(dtype)
            for dtype in DTYPE_CODES for size in (0, 1, 7, 1000, 4097)]


def _relative_error(received, values) -> float:
    wide = values.astype(np.float64)
    norm = np.linalg.norm(wide)
    return float(np.linalg.norm(received.astype(np.float64) - wide) / norm) if norm else 0.0


def check_round_trip(codec, error_bound: float | None = None) -> None:
    """Decoding gives back the input (lossless) or what the encoder said it sends."""
    if codec.family == "index":
        rng = np.random.default_rng(1)
        for n, indices in index_cases():
            values = rng.standard_normal(indices.size).astype(np.float32)
            data, received, _ = codec.encode_selection(indices, values, n)
            decoded = codec.decode(data, n, received.size)
            assert decoded.dtype == np.int64 and np.array_equal(decoded, received), \
                f"{codec!r}: decode differs from what encode_selection promised (n={n})"
            most = codec.max_count(data, n)
            assert most is None or most >= received.size, \
                f"{codec!r}: max_count {most} below the {received.size} indices of a stream"
            if codec.lossless:
                assert np.array_equal(decoded, indices), f"{codec!r} lost indices (n={n})"
        return
    for values in value_cases():
        if codec.sorts_values:
            values = values[codec.order(values)]
        data, received = codec.encode_and_receive(values)
        decoded = codec.decode(data, values.size, values.dtype)
        assert decoded.dtype == values.dtype and decoded.shape == values.shape, \
            f"{codec!r} decoded {decoded.shape} {decoded.dtype} for {values.shape} {values.dtype}"
        assert np.array_equal(decoded, received, equal_nan=True), \
            f"{codec!r}: decode differs from what encode_and_receive promised"
        if codec.lossless:
            assert np.array_equal(decoded.view(np.uint8), values.view(np.uint8)), \
                f"{codec!r} is lossless but changed {values.dtype} bits"
        elif error_bound is not None and values.size >= 1000:
            error = _relative_error(decoded, values)
            assert error <= error_bound, \
                f"{codec!r}: relative L2 error {error:.3g} above {error_bound} ({values.dtype})"


def check_config(codec) -> None:
    """The configuration is JSON-safe and rebuilds an equal codec, from the config and the spec."""
    config = codec.get_config()
    assert json.loads(json.dumps(config)) == config, f"{codec!r}: config is not JSON-safe"
    assert type(codec).from_config(config) == codec
    assert get_codec(config, family=codec.family) == codec
    assert get_codec(codec.spec(), family=codec.family) == codec
    # the header names the codec but for encoder-only options, left at their defaults
    in_header = get_codec(codec.header_spec(), family=codec.family).get_config()
    defaults = {p.name: p.default for p in codec._parameters()}
    assert in_header == {key: defaults[key] if key in codec.encoder_options else value
                         for key, value in config.items()}, codec.header_spec()


def check_repr_and_equality(codec) -> None:
    """``repr`` names the class and every setting; equal configs make equal, hashable codecs."""
    text = repr(codec)
    assert text.startswith(type(codec).__name__ + "("), text
    for key, value in codec.get_config().items():
        if key != "id":
            assert f"{key}={value!r}" in text, f"{text} omits {key}"
    twin = type(codec).from_config(codec.get_config())
    assert twin == codec and hash(twin) == hash(codec) and codec != object()


def _bounded(fn, what: str):
    """Run ``fn``; a DecodeError is fine, so is a result; anything else, or slowness, is not."""
    start = time.perf_counter()
    try:
        result = fn()
    except DecodeError:
        result = None
    elapsed = time.perf_counter() - start
    assert elapsed < HOSTILE_SECONDS, f"{what} took {elapsed:.2f} s"
    return result


def check_hostile_decode(codec, seed: int = 0) -> None:
    """Truncations, bit flips, inflated counts and huge universes: only DecodeError, quickly."""
    rng = np.random.default_rng(seed)
    if codec.family == "index":
        n = 20_000
        indices = np.sort(rng.choice(n, 400, replace=False)).astype(np.int64)
        data, received, _ = codec.encode_selection(
            indices, np.ones(indices.size, np.float32), n)
        count = received.size

        def decode(stream, n=n, count=count):
            return codec.decode(stream, n, count)
        inflated = [(n, count + 1), (n, max(count - 1, 0)), (2 * n, count)]
        if not codec.scans_universe:  # a Bloom filter's decoder tests every position
            inflated += [(2**62, count), (2**62, 2**40)]
    else:
        values = rng.standard_normal(3000).astype(np.float32)
        if codec.sorts_values:
            values = values[codec.order(values)]
        data = codec.encode(values)
        count = values.size

        def decode(stream, n=None, count=count):
            return codec.decode(stream, count, np.float32)
        inflated = [(None, count + 1), (None, count - 1), (None, 2**40), (None, 2**62)]
    name = type(codec).__name__
    cuts = sorted(set(rng.integers(0, len(data), 24).tolist()) | {0, len(data) - 1}) \
        if data else []
    for cut in cuts:
        result = _bounded(lambda: decode(data[:cut]), f"{name}: stream cut at {cut}")
        if result is not None:
            assert result.shape == (count,), f"{name}: a truncated stream decoded to " \
                                             f"{result.shape}"
    for _ in range(24 if data else 0):
        flipped = bytearray(data)
        bit = int(rng.integers(0, 8 * len(flipped)))
        flipped[bit // 8] ^= 1 << (bit % 8)
        result = _bounded(lambda: decode(bytes(flipped)), f"{name}: bit {bit} flipped")
        if result is not None:
            assert result.shape == (count,)
    for n, nnz in inflated:
        _bounded(lambda: decode(data, n, nnz) if n is not None else decode(data, count=nnz),
                 f"{name}: n={n}, nnz={nnz}")


def check_determinism(codec) -> None:
    """Two codecs of one configuration write the same bytes, at the same ``step`` too."""
    rng = np.random.default_rng(2)
    twin = type(codec).from_config(codec.get_config())
    if codec.family == "index":
        indices = np.sort(rng.choice(10_000, 300, replace=False)).astype(np.int64)
        encode = [lambda c=c: c.encode(indices, 10_000) for c in (codec, twin)]
    else:
        values = rng.standard_normal(2000).astype(np.float32)
        encode = [lambda c=c: c.encode(values) for c in (codec, twin)]
    if hasattr(codec, "step"):
        codec.step = twin.step = 5
    first, second = encode[0](), encode[1]()
    assert first == second, f"{codec!r}: equal configurations wrote different bytes"
    if hasattr(codec, "step"):
        codec.step = 5
        assert encode[0]() == first, f"{codec!r}: the same step wrote different bytes"


def check_codec(codec, error_bound: float | None = None) -> None:
    """Run every check of the contract on ``codec`` (an instance, any configuration).

    Parameters
    ----------
    codec : deepreduce.IndexCodec or deepreduce.ValueCodec
    error_bound : float, optional
        For lossy value codecs: the relative L2 error allowed on Gaussian
        values (not checked when None).

    Examples
    --------
    >>> import deepreduce as dr
    >>> from deepreduce.testing import check_codec
    >>> check_codec(dr.get_codec("varint", family="index"))
    >>> check_codec(dr.get_codec("fp16", family="value"), error_bound=1e-3)
    """
    check_config(codec)
    check_repr_and_equality(codec)
    check_round_trip(codec, error_bound)
    check_determinism(codec)
    check_hostile_decode(codec)
