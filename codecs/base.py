"""Tiny base classes for the two codec families.

A codec's constructor keyword arguments are its whole configuration: each is
stored as an attribute of the same name, so :meth:`Codec.get_config` can read
them back and :meth:`Codec.from_config` can rebuild an equal codec. Everything a
decoder needs beyond that configuration (a code table, a seed, a chosen
parameter) travels inside the encoded stream itself.
"""

from __future__ import annotations

import functools
import inspect

import numpy as np

from deepreduce.errors import DecodeError


#: Types of the parameter values whose spec strings a codec keeps (see :meth:`Codec._spec`).
_IMMUTABLE = frozenset((str, int, float, bool, type(None)))


class Codec:
    """Common part of index and value codecs.

    Attributes
    ----------
    codec_id : str
        Registry name, as written in specs (``"zstd:level=9"``) and payloads.
    family : str
        ``"index"`` or ``"value"``; the two families have separate namespaces.
    lossless : bool
        Whether ``decode(encode(x)) == x`` bit for bit.
    """

    codec_id: str = ""
    family: str = ""
    lossless: bool = True
    #: Constructor parameters that only steer the encoder's choices: a stream
    #: decodes the same whatever their values, so payload headers leave them out
    #: (:meth:`header_spec`) and readers never need to know them.
    encoder_options: tuple[str, ...] = ()

    @classmethod
    @functools.cache  # spec() runs for every payload; inspect.signature is slow
    def _parameters(cls):
        sig = inspect.signature(cls.__init__)
        return tuple(p for name, p in sig.parameters.items() if name != "self"
                     and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))

    def get_config(self) -> dict:
        """JSON-safe configuration: ``{"id": codec_id, **constructor kwargs}``."""
        config = {"id": self.codec_id}
        for p in self._parameters():
            config[p.name] = getattr(self, p.name)
        return config

    @classmethod
    def from_config(cls, config: dict) -> "Codec":
        """Rebuild a codec from :meth:`get_config` output."""
        config = dict(config)
        codec_id = config.pop("id", cls.codec_id)
        if codec_id != cls.codec_id:
            raise ValueError(f"config id {codec_id!r} does not match codec {cls.codec_id!r}")
        return cls(**config)

    def for_one_tensor(self) -> "Codec":
        """The codec to code one tensor's sets with, step after step: ``self`` for a
        codec that keeps nothing between calls. One that learns from what it codes
        (``auto``'s memory of where the LZ codecs lost) returns a fresh instance of
        the same configuration, so that one tensor's sets never steer another's.
        The exchanges give every tensor its own (see
        :meth:`deepreduce.exchange.selection.Selector.pipeline_of`)."""
        return self

    def spec(self) -> str:
        """Compact spec string naming only the non-default parameters.

        ``get_codec(codec.spec())`` rebuilds an equal codec, e.g. ``"zstd"``,
        ``"qsgd:bits=4"`` or ``"auto:link_gbits=10"``.
        """
        return self._spec(())

    def header_spec(self) -> str:
        """What a payload header stores: :meth:`spec` without the :attr:`encoder_options`."""
        return self._spec(self.encoder_options)

    def _spec(self, leave_out) -> str:
        # Every payload's header names its codecs: the string is kept, with the very
        # objects it was made from, and made again once a parameter is another object.
        # (Only for immutable values, which nobody can change in place; by identity,
        # since equal values may be written differently: 1, 1.0 and True.)
        values = [getattr(self, p.name) for p in self._parameters()]
        memo = self.__dict__.get("_spec_memo") if hasattr(self, "__dict__") else None
        known = None if memo is None else memo.get(leave_out)
        if known is not None and len(known[0]) == len(values) and all(
                a is b for a, b in zip(known[0], values)):
            return known[1]
        spec = self._format_spec(leave_out)
        if all(type(value) in _IMMUTABLE for value in values):
            try:
                if memo is None:
                    memo = self._spec_memo = {}
                memo[leave_out] = (values, spec)
            except AttributeError:  # (no __dict__: nothing kept)
                pass
        return spec

    def _format_spec(self, leave_out) -> str:
        from deepreduce.registry import format_spec

        changed = {p.name: getattr(self, p.name) for p in self._parameters()
                   if p.name not in leave_out
                   and (p.default is p.empty or getattr(self, p.name) != p.default)}
        return format_spec(self.codec_id, changed)

    def __eq__(self, other):
        return type(self) is type(other) and self.get_config() == other.get_config()

    def __hash__(self):
        return hash((type(self), tuple(sorted(self.get_config().items()))))

    def __repr__(self):
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "id")
        return f"{type(self).__name__}({params})"


class IndexCodec(Codec):
    """Encodes a sorted set of unique flat indices from the universe ``[0, n)``.

    Subclasses implement :meth:`encode` and :meth:`decode`. ``decode`` may trust
    nothing in ``data``: it raises :class:`~deepreduce.DecodeError` for any
    malformed stream and never allocates more than ``nnz`` (or ``n`` bits, for
    bitmap-like codes) before checking that the stream can hold that many.
    """

    family = "index"

    def encode(self, indices: np.ndarray, n: int) -> bytes:
        """Encode ``indices`` (int64, strictly increasing, all in ``[0, n)``)."""
        raise NotImplementedError

    #: True for codecs whose decoding tests every position of the universe (Bloom
    #: filters): their cost grows with ``n`` whatever the stream, so callers bound
    #: ``n`` (``dr.decompress(max_scanned=)``). Every other codec's decoding costs
    #: at most a constant times its stream plus its output (``nnz`` indices).
    scans_universe: bool = False

    def max_count(self, data, n: int) -> int | None:
        """The most indices of ``[0, n)`` a stream like ``data`` can hold, by its length.

        An upper bound that costs nothing to compute (:meth:`decode` checks the
        exact count): the pipeline refuses a payload declaring more non-zeros
        before decoding either stream. None where the length bounds nothing:
        run-length and LZ codes describe any number of indices in a few bytes.
        """
        return None

    def decode(self, data: bytes, n: int, nnz: int) -> np.ndarray:
        """Return the ``nnz`` indices as int64, strictly increasing, in ``[0, n)``."""
        raise NotImplementedError

    def orders(self, data) -> bool:
        """True when :meth:`decode` of ``data`` returns strictly increasing indices (or
        raises) whatever the stream holds, by construction, so that the pipeline need
        not check their order again.

        False (the default) has the pipeline check it: a pass over the indices
        and two numpy calls, each handing the GIL to the other codec threads
        and back (:mod:`deepreduce.exchange.parallel`). A codec says True only where its
        decoding cannot give anything else (gaps of at least one, the set bits
        of a bitmap).
        """
        return False

    def encode_selection(self, indices, values, n, dense=None):
        """Encode the index set and say which (index, value) pairs will arrive.

        Returns ``(data, received_indices, values_to_send)``: the stream, the
        sorted index set the receiver's :meth:`decode` will produce, and the
        values that must travel for those indices, in the same order. Exact
        codecs deliver ``indices`` and ``values`` unchanged; lossy index codecs
        (Bloom filters) override this and may read ``dense`` (the flat dense
        tensor, when the caller has it) for the values of false positives.
        """
        return self.encode(indices, n), indices, values


class ValueCodec(Codec):
    """Encodes a 1-D array of floating point values.

    ``decode`` returns an array of the original dtype (lossy codecs round to
    their precision, then cast back), so the receiver can scatter it directly.
    """

    family = "value"
    #: True for codecs that send values in their own order (curve fits sort
    #: them). Such a codec implements ``order(values) -> permutation``; its
    #: ``encode`` receives ``values[order(values)]`` and ``decode`` returns that
    #: order, and the pipeline makes the indices travel in the same order.
    sorts_values: bool = False
    #: True for codecs that round each value on its own, so that a rounded
    #: value codes back to itself (casts to a narrower float): any subset of
    #: decoded values then travels again unchanged, as with a lossless codec.
    #: The owner-based communicators rely on it to leave out of their return
    #: stage the entries a rank contributed alone.
    elementwise: bool = False

    def encode(self, values: np.ndarray) -> bytes:
        raise NotImplementedError

    def decode(self, data: bytes, nnz: int, dtype: np.dtype) -> np.ndarray:
        raise NotImplementedError

    def encode_and_receive(self, values: np.ndarray) -> tuple[bytes, np.ndarray]:
        """Encode, and also return exactly what the receiver will decode.

        Error feedback uses the second element to keep what was not delivered.
        Lossy codecs may override this when they can avoid a second decode.
        """
        data = self.encode(values)
        if self.lossless:
            return data, values
        return data, self.decode(data, values.size, values.dtype)


def expect_length(data, expected: int, what: str) -> None:
    """Raise DecodeError unless ``len(data) == expected``."""
    if len(data) != expected:
        raise DecodeError(f"{what}: stream holds {len(data)} bytes, expected {expected}")


def no_indices(data, what: str) -> np.ndarray:
    """The empty set an index decoder told ``nnz == 0`` returns, once its stream is
    checked to be empty too (every such codec encodes the empty set as no bytes).

    Examples
    --------
    >>> from deepreduce.codecs.base import no_indices
    >>> no_indices(b"", "golomb indices")
    array([], dtype=int64)
    >>> no_indices(b"x", "golomb indices")
    Traceback (most recent call last):
    ...
    deepreduce.errors.DecodeError: golomb indices: stream holds 1 bytes, expected 0
    """
    expect_length(data, 0, what)
    return np.zeros(0, dtype=np.int64)


__all__ = ["Codec", "IndexCodec", "ValueCodec", "DecodeError", "expect_length", "no_indices"]
