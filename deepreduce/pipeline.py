"""The compression pipeline: sparsifier, index codec, value codec, container.

::

    dense --sparsifier--> SparseTensor --index codec--> index stream
                                       --value codec--> value stream --container--> payload

Every encode also returns what the receiver will decode, so lossy stages never
need a second decode to know their error and error feedback can be exact.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from deepreduce import container
from deepreduce.bits import pack_fixed, unpack_fixed
from deepreduce.errors import DecodeError
from deepreduce.registry import decoding_codec, get_codec
from deepreduce.sparse import SparseTensor, check_dtype
from deepreduce.sparsifiers import _as_float_array, get_sparsifier

DEFAULT_INDEX = "auto"
DEFAULT_VALUE = "raw"


def _order_width(n: int) -> int:
    return max(1, (n - 1).bit_length())


class Pipeline:
    """A sparsifier and two codecs: everything needed to make and read payloads.

    Parameters
    ----------
    sparsifier : callable, str or None, default None
        Chooses the entries that travel: ``dr.TopK(0.01)``, a spec such as
        ``"topk:0.01"``, or None to send every non-zero. It is applied to dense
        input and to :class:`SparseTensor` input alike.
    index : IndexCodec, dict or str, default "auto"
        Codec of the sorted flat indices (see ``deepreduce --help``).
    value : ValueCodec, dict or str, default "raw"
        Codec of the values. A pipeline (a file format first) loses nothing unless asked;
        a gradient exchange's defaults are Top-1% and fp16, where error feedback makes
        up the loss (:mod:`deepreduce.config` says why they differ).

    Examples
    --------
    >>> import numpy as np, deepreduce as dr
    >>> g = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    >>> pipe = dr.Pipeline(dr.TopK(0.01), index="varint", value="fp16")
    >>> payload, received = pipe.encode(g)
    >>> dr.decompress(payload) == received
    True
    >>> received.nnz
    100
    """

    def __init__(self, sparsifier=None, index=DEFAULT_INDEX, value=DEFAULT_VALUE):
        self.sparsifier = get_sparsifier(sparsifier)
        self.value_codec = get_codec(value, family="value")
        if self.value_codec.sorts_values:
            # Curve fits send values in their own order, so indices must follow that
            # order: fixed-width packing at ceil(log2 n) bits beats any set codec
            # plus a permutation (log2 n/k + log2 k bits at least).
            if index not in (None, DEFAULT_INDEX, "bitpack"):
                raise ValueError(f"value codec {self.value_codec.codec_id!r} sorts the values, "
                                 "so indices travel in value order, bit-packed; leave index "
                                 f"at its default instead of {index!r}")
            self.index_codec = None
        else:
            self.index_codec = get_codec(index, family="index")

    def __repr__(self):
        index = self.index_codec.spec() if self.index_codec else "value-order"
        return (f"Pipeline(sparsifier={self.sparsifier!r}, index={index!r}, "
                f"value={self.value_codec.spec()!r})")

    def sparsify(self, x) -> tuple[SparseTensor, np.ndarray | None]:
        """Apply the sparsifier; also return the flat dense input when there is one."""
        if isinstance(x, SparseTensor):
            return self.sparsifier(x), None
        x = _as_float_array(x)
        return self.sparsifier(x), x.reshape(-1)

    def encode(self, x) -> tuple[bytes, SparseTensor]:
        """Return ``(payload, received)``: the bytes, and the tensor the receiver decodes."""
        selected, dense = self.sparsify(x)
        return self.encode_sparse(selected, dense)

    def encode_sparse(self, st: SparseTensor, dense=None) -> tuple[bytes, SparseTensor]:
        """Encode an already sparsified tensor (``dense``: its flat dense source, if any)."""
        dtype, n = check_dtype(st.dtype), st.size
        if self.index_codec is None:
            order = self.value_codec.order(st.values)
            value_stream, received_values = self.value_codec.encode_and_receive(st.values[order])
            indices = st.indices[order]
            index_stream = pack_fixed(indices.astype(np.uint64), _order_width(n))
            back = np.argsort(indices)
            received = SparseTensor._trusted(received_values[back], indices[back], st.shape)
            flags, index_spec = container.FLAG_VALUE_ORDER, ""
        else:
            index_stream, indices, values = self.index_codec.encode_selection(
                st.indices, st.values, n, dense)
            value_stream, received_values = self.value_codec.encode_and_receive(values)
            received = SparseTensor._trusted(received_values, indices, st.shape)
            flags, index_spec = 0, self.index_codec.header_spec()
        payload = container.pack(dtype, st.shape, received.nnz, index_spec,
                                 self.value_codec.header_spec(), index_stream, value_stream, flags)
        return payload, received


#: Default bounds of :func:`decompress` on what decoding a payload may cost (see
#: docs/format.md, "Cost of decoding"): 2**28 declared non-zeros (the decoded int64
#: indices and their values: 3 GiB with float32) and 2**28 positions tested by a
#: decode that scans the declared universe (a Bloom-filter index stream). Neither
#: bounds the declared shape: a sparse tensor of any shape decodes in time and memory
#: that follow its payload and its non-zeros.
DEFAULT_MAX_NNZ = 1 << 28
DEFAULT_MAX_SCANNED = 1 << 28

_DEFAULT = object()  # "not given", where None means "no bound"
_INT64 = np.dtype(np.int64)


def _refuse(what: str, amount: int, knob: str, bound: int):
    raise DecodeError(f"the payload {what} ({amount:,}), more than {knob}={bound:,}: "
                      f"pass a larger {knob} (None: no bound, for trusted data) to decode it")


def decode(payload, max_nnz: int | None = None, max_scanned: int | None = None,
           max_shape: int | None = None) -> SparseTensor:
    """Decode any payload; the codecs are named inside it.

    The bounds (None: none) refuse a payload before any work that grows with
    them: ``max_nnz`` its declared non-zeros, ``max_scanned`` the positions
    its index decode would test (the declared universe of a Bloom filter),
    ``max_shape`` its declared elements (what ``max_elements`` bounded).
    """
    header = container.read_header(payload)
    n, nnz = header.size, header.nnz
    if max_shape is not None and n > max_shape:
        _refuse(f"declares shape {header.shape}", n, "max_elements", max_shape)
    if max_nnz is not None and nnz > max_nnz:
        _refuse("declares nnz", nnz, "max_nnz", max_nnz)
    try:
        value_codec = decoding_codec(header.value_spec, "value")
        index_codec = None if header.value_order else decoding_codec(header.index_spec, "index")
    except ValueError as exc:
        raise DecodeError(f"payload names a codec this library cannot build: {exc}") from None
    if max_scanned is not None and index_codec is not None and index_codec.scans_universe \
            and n > max_scanned:
        _refuse(f"index codec {header.index_spec!r} tests every position of shape "
                f"{header.shape}", n, "max_scanned", max_scanned)
    header, index_stream, value_stream = container.unpack(payload, header)
    if header.value_order != value_codec.sorts_values:
        raise DecodeError(f"value codec {header.value_spec!r} and the value-order flag disagree")
    # Both checks come before the values are decoded: their work grows with nnz.
    if header.value_order and len(index_stream) * 8 < nnz * _order_width(n):
        raise DecodeError(f"value-ordered index stream of {len(index_stream)} bytes cannot "
                          f"hold {nnz} indices of {_order_width(n)} bits")
    if index_codec is not None:
        most = index_codec.max_count(index_stream, n)
        if most is not None and nnz > most:
            raise DecodeError(f"index stream of {len(index_stream)} bytes "
                              f"({header.index_spec!r}) cannot hold nnz={nnz} indices")
    values = value_codec.decode(bytes(value_stream), nnz, header.dtype)
    if values.shape != (nnz,) or values.dtype != header.dtype:
        raise DecodeError(f"value codec {header.value_spec!r} returned {values.shape} "
                          f"{values.dtype}, expected ({nnz},) {header.dtype}")
    if index_codec is None:
        if header.index_spec:
            raise DecodeError("a value-ordered payload must have an empty index spec")
        indices = unpack_fixed(bytes(index_stream), nnz, _order_width(n),
                              "value-ordered indices").astype(np.int64)
        order = np.argsort(indices, kind="stable")
        indices, values = indices[order], values[order]
        if nnz and (indices[-1] >= n or (nnz > 1 and not (indices[1:] > indices[:-1]).all())):
            raise DecodeError("value-ordered indices repeat or exceed the tensor size")
        return SparseTensor._trusted(values, indices, header.shape)
    indices = np.asarray(index_codec.decode(bytes(index_stream), n, nnz))
    if indices.shape != (nnz,) or indices.dtype != _INT64:  # (a dtype: no conversion)
        raise DecodeError(f"index codec {header.index_spec!r} returned {indices.shape} "
                          f"{indices.dtype}, expected ({nnz},) int64")
    if nnz and (indices[0] < 0 or indices[-1] >= n):
        raise DecodeError(f"decoded indices leave the range [0, {n})")
    if nnz > 1 and not index_codec.orders(index_stream) \
            and not (indices[1:] > indices[:-1]).all():
        raise DecodeError("decoded indices are not strictly increasing")
    return SparseTensor._trusted(values, indices, header.shape)


def compress(x, sparsifier=None, index=DEFAULT_INDEX, value=DEFAULT_VALUE) -> bytes:
    """Compress a dense array or a :class:`SparseTensor` into one payload.

    Parameters
    ----------
    x : array_like or SparseTensor
        Dense input of any shape (float16, bfloat16, float32 or float64; other
        numeric types are converted to float32), or a sparse tensor.
    sparsifier, index, value
        As for :class:`Pipeline`.

    Returns
    -------
    bytes
        A self-describing payload; :func:`decompress` needs nothing else.

    Examples
    --------
    >>> import numpy as np, deepreduce as dr
    >>> g = np.random.default_rng(0).standard_normal(1_000_000).astype(np.float32)
    >>> payload = dr.compress(g, sparsifier=dr.TopK(0.01), index="eliasfano", value="fp16")
    >>> st = dr.decompress(payload)
    >>> st.nnz, st.to_dense().shape, st.dtype
    (10000, (1000000,), dtype('float32'))
    >>> len(payload) < 10_000 * 4  # raw int32 + fp32 pairs: 80,000 bytes
    True
    """
    return Pipeline(sparsifier, index, value).encode(x)[0]


def decompress(payload, max_nnz: int | None = DEFAULT_MAX_NNZ,
               max_scanned: int | None = DEFAULT_MAX_SCANNED, *,
               max_elements=_DEFAULT) -> SparseTensor:
    """Decode a payload made by :func:`compress` (or any deepreduce encoder).

    Decoding costs time and memory in proportion to the payload's length, its
    declared non-zeros and, for a Bloom-filter index stream only, the declared
    universe, which its decoder scans; never in proportion to the declared
    shape otherwise. The two bounds cap what a payload from an untrusted
    source can make this call spend, and are checked before anything else.

    Parameters
    ----------
    payload : bytes-like
    max_nnz : int or None, default 2**28
        Refuse payloads declaring more non-zeros (the decoded indices and
        values: 8 bytes plus a value each). None: no bound.
    max_scanned : int or None, default 2**28
        Refuse payloads whose index decode would test more positions of the
        universe (Bloom-filter streams test every element of the declared
        shape). None: no bound.
    max_elements : int or None, optional
        Deprecated: bounds the declared shape, which no longer bounds the
        cost of decoding. Given (None too), it is checked as before, and
        ``max_nnz`` and ``max_scanned`` apply only where passed explicitly.

    Raises
    ------
    DecodeError
        For every malformed payload, and for one beyond a bound, with a
        message naming the problem (and the bound to raise).

    Examples
    --------
    A 5,000,000 x 64 embedding gradient of 16 rows decodes with the defaults:

    >>> import numpy as np, deepreduce as dr
    >>> rows = np.array([3, 70, 4_999_999])
    >>> st = dr.SparseTensor.from_rows(np.ones((3, 64), np.float32), rows, (5_000_000, 64))
    >>> dr.decompress(dr.compress(st, value="fp16")).nnz
    192
    """
    if max_elements is _DEFAULT:
        return decode(payload, max_nnz, max_scanned)
    warnings.warn("max_elements bounds the declared shape, which no longer bounds the cost "
                  "of decoding; use max_nnz= and max_scanned=", DeprecationWarning,
                  stacklevel=2)
    return decode(payload, None if max_nnz is DEFAULT_MAX_NNZ else max_nnz,
                  None if max_scanned is DEFAULT_MAX_SCANNED else max_scanned, max_elements)


def index_entropy_bits(n: int, k: int) -> float:
    """Entropy bound of a k-subset of [0, n) in bits per element: log2 C(n, k) / k."""
    if k == 0 or k == n:
        return 0.0
    from scipy.special import gammaln

    return (gammaln(n + 1) - gammaln(k + 1) - gammaln(n - k + 1)) / math.log(2) / k
