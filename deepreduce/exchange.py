"""The framework-neutral exchange of one step's gradients: error feedback, encode, move, sum.

Every training integration (Horovod + TensorFlow in :mod:`deepreduce.horovod`,
PyTorch DDP in :mod:`deepreduce.torch`) only converts its tensors to numpy and
provides a transport; everything else happens here, in
:class:`GradientExchange`.

With the default **allgather** communicator (DeepReduce's scheme) every rank
packs its gradients' payloads (one per gradient, or one per group of small
gradients of a dtype) into a **bundle**, the bundles are allgathered
(whatever their lengths), and every rank splits them, decodes every payload
and sums in rank order, so all ranks end with bit-identical results. With a
**reducing** communicator of :mod:`deepreduce.collectives`
(``"sparse_allreduce"``, SparCML's; ``"block"``, OmniReduce's) the selected
entries of all gradients of one dtype are reduced in one set of collectives
(:meth:`GradientExchange.reduce_tensors`).

Bundle layouts (``docs/format.md`` has the details)::

    version 1: magic "DRB" | 1 | payload count m | m payload lengths | the payloads
    version 3: magic "DRB" | 3 | m | m payload lengths | tensor count T
               | T payload numbers | ranks, then dimensions, of the tensors that share
               a payload | CRC32 of all of this | the payloads

(every count, length, number and dimension a varint; version 2 is version 3
without the CRC32, read but no longer written). In version 1 payload ``i`` is
tensor ``i``. Version 3, written when tensors share a payload, says which
payload holds each tensor; a payload holding several is their concatenation,
flattened, in tensor order. The exchange shares payloads between the small
tensors of a dtype, and between the selections of its compressed tensors below
:data:`SHARED_BELOW` elements (:meth:`GradientExchange._shared_payloads`), which
then cost a slice of a payload each instead of a payload. Each payload is a
complete deepreduce container (with its own CRC32), so a bundle needs no
checksum of its own; the framing is checked strictly and every inconsistency
raises :class:`~deepreduce.DecodeError`.

Why bundles rather than ``collectives.AllgatherReduce`` for training: the
bundle carries self-checking payloads of every dtype in one allgather, each
gradient gets its own error feedback and sparsifier (small ones go
losslessly), a large one its own payload and ``auto`` choice, and sparse
gradients come back as the rows any rank touched; ``AllgatherReduce`` fuses
the gradients of one dtype into a single payload. Both sum with the functions
of :mod:`deepreduce.collectives.base`.
"""

from __future__ import annotations

import inspect
import itertools
import math
import numbers
import struct
import sys
import threading
import time
import zlib

import numpy as np

from deepreduce import collectives
from deepreduce.collectives.base import (fail_collectively, scale_at, signed_allgather,
                                         sum_sorted_into, sum_sparse)
from deepreduce.collectives.transport import Traffic
from deepreduce.bits import read_varint, varint_decode_prefix, varint_encode, write_varint
from deepreduce.errors import DecodeError
from deepreduce.memory import ResidualMemory
from deepreduce.pipeline import DEFAULT_INDEX, DEFAULT_VALUE, Pipeline, decode
from deepreduce.registry import get_codec, parse_spec
from deepreduce.sparse import SparseTensor, zeros
from deepreduce.sparsifiers import _as_float_array, get_sparsifier
from deepreduce.stats import CompressionStats, StepStats

BUNDLE_MAGIC = b"DRB"
#: Bundle layouts this module reads; it writes version 1 unless tensors share a payload
#: (then 3). Version 2, version 3 without the checksum of its table, was written only on
#: 2026-11-26: its payloads' checksums do not cover which tensor is where.
BUNDLE_VERSIONS = (1, 2, 3)
#: What a bundle travels behind over a transport (Horovod's graph path allgathers bare
#: bundles); ranks that fail to encode send an ERROR frame instead, so none waits.
BUNDLE_SIGNATURE = "exchange=bundles"
_MAX_VARINT_BYTES = 10
#: Up to this many varints a bundle's field is read one by one.
_FEW_VARINTS = 48
_CRC = struct.Struct("<I")
#: Most dimensions a tensor sharing a payload may have (numpy's limit).
_MAX_DIMS = 64
#: Compressed tensors below this many elements share a payload (see
#: :meth:`GradientExchange._shared_payloads`); larger ones keep their own, and with it
#: ``auto``'s choice of index code for them alone.
SHARED_BELOW = 1 << 16

#: The communicators the Horovod wrappers accept, by name.
COMMUNICATORS = ("allgather", "sparse_allreduce", "block")
# what every reduction decides for itself: not options of a Compression
_PER_CALL = ("pipeline", "op", "process_set", "transport")


def pack_bundle(payloads, slots=None, shapes=()) -> bytes:
    """Frame ``payloads`` (bytes-like) into one bundle.

    Parameters
    ----------
    payloads : list of bytes-like
        Each a complete payload.
    slots : list of int, optional
        For each tensor of the bundle, in order, the number of the payload
        that holds it (version 3); None (version 1): payload ``i`` is tensor ``i``.
    shapes : list of tuple
        With ``slots``, the shape of each tensor (in order) whose payload
        holds other tensors too: such a payload is the concatenation of its
        tensors, flattened, in tensor order.

    Examples
    --------
    >>> from deepreduce.exchange import pack_bundle, split_bundles
    >>> data = pack_bundle([b"abc", b""]) + pack_bundle([b"xy", b"z"], [0, 1, 0], [(2,), (3, 1)])
    >>> [([bytes(p) for p in b.payloads], b.slots, b.shapes)
    ...  for b in split_bundles(data, ranks=2)]
    [([b'abc', b''], [0, 1], {}), ([b'xy', b'z'], [0, 1, 0], {0: (2,), 2: (3, 1)})]
    """
    lengths = np.array([len(p) for p in payloads], dtype=np.uint64)
    head = [BUNDLE_MAGIC, bytes((1 if slots is None else 3,)), write_varint(len(payloads)),
            varint_encode(lengths)]
    if slots is not None:
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if slots.size and (slots.min() < 0 or slots.max() >= len(payloads)) or \
                np.unique(slots).size != len(payloads):
            raise ValueError(f"slots {slots.tolist()} must name each of the "
                             f"{len(payloads)} payloads")
        sharing = int(np.count_nonzero(np.bincount(slots, minlength=len(payloads))[slots] > 1))
        shapes = [tuple(int(d) for d in shape) for shape in shapes]
        if len(shapes) != sharing:
            raise ValueError(f"{len(shapes)} shapes for the {sharing} tensors that share a "
                             "payload")
        head += [write_varint(slots.size), varint_encode(slots),
                 varint_encode(np.array([len(s) for s in shapes], dtype=np.uint64)),
                 varint_encode(np.array([d for s in shapes for d in s], dtype=np.uint64))]
        head.append(_CRC.pack(zlib.crc32(b"".join(head))))
    return b"".join([*head, *payloads])


class Bundle:
    """One rank's bundle, as :func:`split_bundles` reads it.

    Attributes
    ----------
    data : memoryview
        The bundle's bytes.
    payloads : list of memoryview
        Its payloads.
    slots : list of int
        For each tensor, in order, the number of the payload holding it.
    shapes : dict
        The shapes of the tensors (by position) that share a payload with
        others; that payload holds their concatenation, flattened, in tensor order.
    """

    __slots__ = ("data", "payloads", "slots", "shapes", "_what")

    def __init__(self, data, payloads, slots, shapes, what="bundle"):
        self.data, self.payloads, self.slots, self.shapes = data, payloads, slots, shapes
        self._what = what

    def tensors(self, decoded) -> list[SparseTensor]:
        """Each tensor of the bundle, given its payloads ``decoded``.

        Raises
        ------
        DecodeError
            When a shared payload does not hold exactly its tensors' elements.
        """
        parts = {}
        for slot, positions in self.shared().items():
            parts.update(zip(positions, split_shared(
                decoded[slot], [self.shapes[t] for t in positions],
                f"{self._what}, payload {slot}")))
        return [parts[t] if t in parts else decoded[slot] for t, slot in enumerate(self.slots)]

    def shared(self) -> dict:
        """The payloads that hold several tensors: their positions, in order, by payload."""
        members = {}
        for position in self.shapes:  # (in tensor order)
            members.setdefault(self.slots[position], []).append(position)
        return members


def split_shared(whole: SparseTensor, shapes, what: str = "shared payload") -> list:
    """The tensors of ``shapes`` whose flattened concatenation ``whole`` holds."""
    sizes = [math.prod(shape) for shape in shapes]
    _check_holds(whole, sum(sizes), what)
    ends = list(itertools.accumulate(sizes))
    cuts = np.searchsorted(whole.indices, ends[:-1]).tolist() + [whole.nnz]
    parts, low = [], 0
    for shape, start, high in zip(shapes, [0] + ends, cuts):
        parts.append(SparseTensor._trusted(whole.values[low:high],
                                           whole.indices[low:high] - start, shape))
        low = high
    return parts


def _check_holds(whole: SparseTensor, size: int, what: str) -> None:
    if whole.shape != (size,):
        raise DecodeError(f"{what}: shape {whole.shape} does not hold its tensors' "
                          f"{size} elements")


def split_bundles(data, ranks: int) -> list[Bundle]:
    """Read the concatenation of ``ranks`` bundles, of any version.

    Raises
    ------
    DecodeError
        When the data is not exactly ``ranks`` well-formed bundles.
    """
    view = memoryview(data).cast("B")
    bundles, pos = [], 0
    for rank in range(ranks):
        what, start = f"bundle of rank {rank}", pos
        header_end = pos + len(BUNDLE_MAGIC) + 1
        if bytes(view[pos:pos + len(BUNDLE_MAGIC)]) != BUNDLE_MAGIC or header_end > len(view):
            raise DecodeError(f"{what}: expected magic {BUNDLE_MAGIC!r} at byte {pos} of the "
                              f"{len(view)} gathered bytes, found {bytes(view[pos:pos + 3])!r}")
        version = view[header_end - 1]
        if version not in BUNDLE_VERSIONS:
            raise DecodeError(f"{what}: unsupported bundle version {version}")
        count, pos = read_varint(view, header_end, what)
        lengths, pos = _read_varints(view, pos, count, f"{what} payload lengths")
        slots, shapes = list(range(count)), {}
        if version >= 2:
            slots, shapes, pos = _read_table(view, pos, count, what)
        if version == 3:
            # the payloads' own checksums do not cover which tensor is where
            if pos + _CRC.size > len(view):
                raise DecodeError(f"{what}: truncated before the checksum of its table")
            if _CRC.unpack_from(view, pos)[0] != zlib.crc32(view[start:pos]):
                raise DecodeError(f"{what}: CRC32 mismatch in its table")
            pos += _CRC.size
        remaining = len(view) - pos
        if count and (int(lengths.max()) > remaining or float(lengths.sum(dtype=np.float64))
                      > remaining):
            raise DecodeError(f"{what}: payload lengths add up to more than the {remaining} "
                              "bytes that follow")
        ends = pos + np.cumsum(lengths.astype(np.int64))
        starts = np.concatenate(([pos], ends[:-1])) if count else ends
        payloads = [view[s:e] for s, e in zip(starts.tolist(), ends.tolist())]
        pos = int(ends[-1]) if count else pos
        bundles.append(Bundle(view[start:pos], payloads, slots, shapes, what))
    if pos != len(view):
        raise DecodeError(f"{len(view) - pos} bytes after the {ranks} bundles")
    return bundles


def _read_varints(view, pos: int, count: int, what: str) -> tuple[np.ndarray, int]:
    """``count`` varints at ``pos``, refused before anything is sized from ``count`` when
    fewer bytes follow."""
    if count > len(view) - pos:
        raise DecodeError(f"{what}: declares {count} values but only {len(view) - pos} "
                          "bytes follow")
    if count <= _FEW_VARINTS:  # a loop costs 0.3 us a varint, numpy's passes 20 us a call
        values = np.empty(count, dtype=np.uint64)
        for i in range(count):
            values[i], pos = read_varint(view, pos, what)
        return values, pos
    # varint_decode_prefix scans its whole input: give it only the bytes these can
    # occupy, not the payloads behind them
    values, used = varint_decode_prefix(view[pos:pos + _MAX_VARINT_BYTES * count], count, what)
    return values, pos + used


def _read_table(view, pos: int, payloads: int, what: str):
    """The table of versions 2 and 3: ``(slots, shapes, pos)`` (see :class:`Bundle`)."""
    tensors, pos = read_varint(view, pos, what)
    slots, pos = _read_varints(view, pos, tensors, f"{what} slots")
    if tensors and int(slots.max()) >= payloads:
        raise DecodeError(f"{what}: a tensor is in payload {int(slots.max())} of {payloads}")
    slots = slots.astype(np.int64)  # (each below payloads)
    references = np.bincount(slots, minlength=payloads)
    if (references == 0).any():
        raise DecodeError(f"{what}: payload {int(np.argmin(references))} holds no tensor")
    shared = np.flatnonzero(references[slots] > 1)
    ranks, pos = _read_varints(view, pos, shared.size, f"{what} shared tensors' ranks")
    if shared.size and int(ranks.max()) > _MAX_DIMS:
        raise DecodeError(f"{what}: a tensor of {int(ranks.max())} dimensions "
                          f"(at most {_MAX_DIMS})")
    dims, pos = _read_varints(view, pos, int(ranks.sum()), f"{what} shared tensors' shapes")
    dims, bounds = dims.tolist(), [0, *itertools.accumulate(ranks.tolist())]
    shapes = {t: tuple(dims[lo:hi]) for t, lo, hi in zip(shared.tolist(), bounds, bounds[1:])}
    return slots.tolist(), shapes, pos


def _accepts_seed(factory) -> bool:
    try:
        return "seed" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def _seeded_sparsifier(spec, seed: int):
    """The sparsifier of ``spec``; a spec string without a seed gets ``seed``."""
    sparsifier = get_sparsifier(spec)
    if isinstance(spec, str) and _accepts_seed(type(sparsifier)) and \
            "seed" not in parse_spec(spec)[2]:
        sparsifier = get_sparsifier(spec + ("," if ":" in spec else ":") + f"seed={seed}")
    return sparsifier


def _seeded_codec(spec, family: str, seed: int):
    """The codec of ``spec``; a spec string or config without a seed gets ``seed``."""
    codec = get_codec(spec, family=family)
    if isinstance(spec, (str, dict)) and _accepts_seed(type(codec)):
        given = parse_spec(spec)[2] if isinstance(spec, str) else spec
        if "seed" not in given:
            codec = type(codec).from_config({**codec.get_config(), "seed": seed})
    return codec


class GradientExchange:
    """One step's gradients across ranks: error feedback, sparsifier, codecs, transport, sums.

    The framework integrations hand it numpy arrays (or SparseTensors) and a
    transport: :meth:`reduce_async` does the rest over any communicator;
    Horovod's graph path calls its halves, :meth:`encode_bundle` and
    :meth:`decode_bundles`, around an in-graph allgather.

    Parameters
    ----------
    sparsifier : callable, str or None
        ``dr.TopK(0.01)``, ``"randomk:0.01"``... None sends every non-zero.
    index : str, dict or IndexCodec, default "auto"
        Index codec (see :class:`deepreduce.Pipeline`).
    value : str, dict or ValueCodec, default "raw"
        Value codec, e.g. ``"fp16"``.
    memory : "residual", None or ResidualMemory, default "residual"
        Error feedback: the part of each gradient that was not delivered
        (``input - received``, exactly) is added to the next gradient of the
        same variable. None turns it off; pass a :class:`deepreduce.ResidualMemory`
        instance to share or inspect it (``beta`` < 1 lets stale error decay).
        The residual of a ``tf.IndexedSlices`` gradient is kept dense (as
        ResidualMemory keeps every residual), so with error feedback on an
        embedding costs one pass over its dense size per step; what travels
        stays sparse.
    min_size : int, default 1024
        Tensors with fewer elements travel losslessly (every non-zero, a
        bitmap of their positions, raw values) in the same bundle, the dense
        ones of each dtype concatenated in one payload: small layers (biases,
        norms) cost little and lose nothing. 0 compresses everything.
    seed : int, default 0
        Seed given to a sparsifier or codec named by a spec string or config
        that takes a ``seed`` and does not set one (RandomK, randomised
        rounding...), so runs are reproducible. The same seed on every rank
        makes RandomK draw the same coordinates everywhere; pass
        ``seed=base + hvd.rank()`` for independent draws.
    communicator : {"allgather", "sparse_allreduce", "block"}, default "allgather"
        How the gradients travel. ``"allgather"``: every rank's bundle to
        every rank (:meth:`encode_bundle`, :meth:`decode_bundles`).
        ``"sparse_allreduce"`` and ``"block"``: the communicators of
        :mod:`deepreduce.collectives`, which reduce inside the collective
        (:meth:`reduce_tensors`); error feedback and the sparsifier run here,
        per gradient, and the communicator moves the selected entries of all
        gradients of one dtype with the configured codecs. Small tensors
        travel with the others when the codecs are lossless, otherwise in a
        second, lossless reduction.
    communicator_options : dict, optional
        Settings of that communicator: ``algorithm`` (``"auto"``, ``"split"``
        or ``"recursive_doubling"``) for ``"sparse_allreduce"``; ``block_size``
        and ``threshold`` for ``"block"``. ``"allgather"`` takes none.

    Examples
    --------
    >>> import numpy as np, deepreduce as dr
    >>> from deepreduce.exchange import GradientExchange
    >>> rng = np.random.default_rng(0)
    >>> grads = [rng.standard_normal((100, 50)).astype(np.float32),
    ...          rng.standard_normal(10).astype(np.float32)]
    >>> c = GradientExchange(dr.TopK(0.01), index="varint", value="fp16")
    >>> bundle = c.encode_bundle(["w", "b"], grads)     # what this rank sends
    >>> w, b = c.decode_bundles(bundle + bundle, ranks=2, rank=0)   # what two ranks get
    >>> int(np.count_nonzero(w)), bool(np.array_equal(b, 2 * grads[1]))
    (50, True)
    >>> c.stats.last.ratio > 40
    True
    """

    def __init__(self, sparsifier=None, index=DEFAULT_INDEX, value=DEFAULT_VALUE,
                 memory="residual", min_size: int = 1024, seed: int = 0,
                 communicator: str = "allgather", communicator_options=None):
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        if isinstance(min_size, bool) or not isinstance(min_size, numbers.Integral) \
                or min_size < 0:
            raise ValueError(f"min_size must be an integer >= 0, got {min_size!r}")
        self.seed, self.min_size = int(seed), int(min_size)
        value = _seeded_codec(value, "value", self.seed)
        if not value.sorts_values:  # curve fits: the pipeline decides the index coding
            index = _seeded_codec(index, "index", self.seed)
        self.pipeline = Pipeline(_seeded_sparsifier(sparsifier, self.seed), index=index,
                                 value=value)
        # small tensors: every non-zero, values bit-exact. A bitmap (n/8 bytes) is
        # exact whatever the configured index codec is (which may be lossy) and
        # costs nothing to choose
        self.small_pipeline = Pipeline(None, index="bitmap", value="raw")
        if (isinstance(memory, str) and memory == "residual") or memory is ResidualMemory:
            memory = ResidualMemory()
        elif memory is False:
            memory = None
        if memory is not None and not isinstance(memory, ResidualMemory):
            raise ValueError(f"memory must be 'residual', None or a ResidualMemory, got {memory!r}")
        self.memory = memory
        self.communicator, self.communicator_options = _check_communicator(
            communicator, communicator_options)
        # the sparsifier runs per gradient in reduce_tensors; the communicator
        # codes the selections with the configured codecs
        self._wire_pipeline = Pipeline(None, index=self.pipeline.index_codec,
                                      value=self.pipeline.value_codec)
        # small tensors go without loss: blocks below a threshold would be dropped
        self._small_options = ({**self.communicator_options, "threshold": 0.0}
                               if "threshold" in self.communicator_options
                               else self.communicator_options)
        index_codec = self.pipeline.index_codec
        # coding the selections of several tensors as one (indices offset, values
        # concatenated) delivers to each exactly what coding it alone would, so they
        # may share a payload
        self._selections_share = (
            collectives.base.returns_only_what_ranks_lack(self.pipeline)
            and all(getattr(codec, "seed", None) is None
                    for codec in (index_codec, self.pipeline.value_codec)))
        # small tensors can share the reduction of the large ones when that loses nothing
        self._small_ride_along = (index_codec is not None and index_codec.lossless
                                  and self.pipeline.value_codec.lossless
                                  and self._small_options == self.communicator_options)
        if self.communicator != "allgather":
            # build both now: a setting the communicator rejects (a lossy index
            # codec for blocks, block_size=0) fails here, not at the first step
            self._build_communicator("main")
            self._build_communicator("small")
        self.stats = CompressionStats()
        # per tensor name, the pipeline with its own random streams (see _pipeline_of)
        self._pipelines = {}
        self._lock = threading.Lock()
        self._last_sent = {}  # per bundle group: its last bundle, and what its payloads decode to
        self._sums = _ReusedSums()
        self._codec_seconds = 0.0

    def __getstate__(self):
        # what belongs to the running process stays behind: the lock, the buffers
        # kept for reuse and the payloads of the last bundle
        state = dict(self.__dict__)
        for runtime in ("_lock", "_sums", "_last_sent"):
            state.pop(runtime)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock, self._sums, self._last_sent = threading.Lock(), _ReusedSums(), {}

    def __repr__(self):
        memory = "None" if self.memory is None else f"ResidualMemory(beta={self.memory.beta})"
        options = "".join(f", {k}={v!r}" for k, v in self.communicator_options.items())
        return (f"{type(self).__name__}({self.pipeline!r}, memory={memory}, "
                f"min_size={self.min_size}, seed={self.seed}, "
                f"communicator={self.communicator!r}{options})")

    def state_dict(self) -> dict:
        """What a checkpoint needs to continue exactly: every residual (copies) and
        :meth:`random_state`. Plain numpy arrays and ints: ``pickle`` or ``torch.save``
        it."""
        memory = self.memory
        residuals = {} if memory is None else {name: memory.residual(name).copy()
                                               for name in memory.names()}
        return {"residuals": residuals, "random_state": self.random_state()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` (of an exchange with the same settings)."""
        if self.memory is not None:
            self.memory.reset()
            for name, residual in state["residuals"].items():
                self.memory.restore(name, residual)
        self.set_random_state(state["random_state"])

    def _pipeline_of(self, name):
        """The pipeline of tensor ``name``: the configured one, with every random stream
        (RandomK, stochastic rounding, Bloom hashing) seeded from ``seed`` and the name.

        A stream per tensor makes what a tensor draws independent of the order
        in which tensors are encoded (DDP hands its buckets over in a different
        order after its first iteration, and again after a restart), so a
        resumed run draws exactly what an uninterrupted one does.
        """
        pipeline = self._pipelines.get(name)
        if pipeline is None:
            base = self.pipeline
            pipeline = self._pipelines[name] = Pipeline(
                _with_seed(base.sparsifier, name), index=_with_seed(base.index_codec, name),
                value=_with_seed(base.value_codec, name))
        return pipeline

    def random_state(self) -> dict:
        """Where every tensor's random streams stand (see :meth:`_pipeline_of`).

        Checkpoint it with the residuals: :meth:`set_random_state` on a new
        exchange of the same configuration continues the same sequences.
        """
        state = {}
        for name, pipeline in self._pipelines.items():
            for role, part in _random_parts(pipeline):
                if hasattr(part, "step"):
                    state[f"{name}/{role}.step"] = int(part.step)
                rng = getattr(part, "_rng", None)
                if isinstance(rng, np.random.Generator):
                    state[f"{name}/{role}.rng"] = rng.bit_generator.state
        return state

    def set_random_state(self, state: dict) -> None:
        """Restore what :meth:`random_state` returned."""
        names = {key.split("/", 1)[0] for key in state}
        for name in names:
            for role, part in _random_parts(self._pipeline_of(name)):
                if f"{name}/{role}.step" in state:
                    part.step = int(state[f"{name}/{role}.step"])
                if f"{name}/{role}.rng" in state:
                    part._rng.bit_generator.state = state[f"{name}/{role}.rng"]

    # -- one tensor -----------------------------------------------------------
    def encode_tensor(self, x, name: str | None = None) -> tuple[bytes, SparseTensor]:
        """Encode one dense array or SparseTensor; return ``(payload, received)``.

        Tensors below ``min_size`` elements go losslessly. With error feedback
        on and a ``name``, the residual of ``name`` is added first and updated
        after (``input - received``).
        """
        pipeline, selected, dense, corrected = self._select(x, name)
        payload, received = self._encode_timed(pipeline, selected, dense)
        if corrected is not None:
            self.memory.settle(name, corrected, received, selected)
        return payload, received

    def _select(self, x, name):
        """``(pipeline, selected, dense, corrected)``: what :meth:`encode_tensor` codes and
        how (see :meth:`_corrected_selection`); ``corrected`` is None without error
        feedback, else what :meth:`ResidualMemory.settle` finishes it with."""
        if _size(x) < self.min_size:
            return (self.small_pipeline, *self.small_pipeline.sparsify(x), None)
        pipeline = self._pipeline_of(name)
        if self.memory is None or name is None:
            return (pipeline, *pipeline.sparsify(x), None)
        # as ResidualMemory.feedback; if encoding raises, a dense gradient's residual
        # holds the whole corrected gradient
        corrected, selected, dense = self._corrected_selection(name, x, pipeline)
        return pipeline, selected, dense, corrected

    def _encode_timed(self, pipeline, selected, dense):
        """``pipeline.encode_sparse(selected, dense)``, adding the time of its codecs to
        ``_codec_seconds``."""
        start = time.perf_counter()
        try:
            return pipeline.encode_sparse(selected, dense)
        finally:
            self._codec_seconds += time.perf_counter() - start

    def _corrected_selection(self, name: str, x, pipeline):
        """``(corrected, selected, dense)``: ``x`` plus the residual of ``name``, what
        ``pipeline``'s sparsifier selects from it, and its flat dense form (None for a
        sparse ``x``). Error feedback is on; :meth:`ResidualMemory.settle` finishes it."""
        if isinstance(x, SparseTensor):
            if name in self.memory:
                # the residual is dense: its non-zeros join the sparse gradient's,
                # and the sparsifier chooses among the union
                x = SparseTensor.from_dense(self.memory.compensate(name, x))
            return (x, *pipeline.sparsify(x))
        # the addition into the residual and the selection in one pass
        corrected, selected = self.memory.accumulate_and_select(name, x, pipeline.sparsifier)
        return corrected, selected, _as_float_array(corrected).reshape(-1)

    # -- one step -------------------------------------------------------------
    def encode_bundle(self, names, tensors, group: int = 0) -> bytes:
        """Encode this rank's gradients (dense arrays or SparseTensors) into one bundle.

        A step whose gradients travel in several allgathers encodes one bundle per
        ``group`` (0, 1, ...: consecutive slices of its tensors) and decodes them
        together with :meth:`decode_groups`; the stats count them as one step.

        Every dense gradient's error feedback and selection come first, then the
        codecs, then the residuals' updates: if a codec raises, nothing is sent and
        every dense gradient's residual still holds all it owes.
        """
        bundle, sent, encoded = self._encode_bundle(names, tensors)
        # what the other ranks will decode from this bundle, so that decoding it
        # again here can be skipped (decoding comes in a separate call)
        self._last_sent[group] = sent
        self.stats.record_encode(tensors=encoded.tensors,
                                 compressed_tensors=encoded.compressed_tensors,
                                 bytes_sent=encoded.bytes_sent, dense_bytes=encoded.dense_bytes,
                                 seconds=encoded.encode_seconds,
                                 codec_seconds=encoded.codec_seconds, group=group)
        return bundle

    def _encode_bundle(self, names, tensors):
        """``(bundle, (bundle, decoded), stats)``: the bundle, with what the ranks will decode
        of each of its payloads."""
        with self._lock:
            start = time.perf_counter()
            self._codec_seconds = 0.0
            if len(names) != len(tensors):
                raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
            shared = self._shared_payloads(tensors)
            sharing = {t: group for group in shared for t, _ in group[1]}
            payloads, slots, receiveds, decoded = [], [], [None] * len(tensors), []
            # Every dense tensor's error feedback and selection first, then the codecs
            # back to back, then the residuals: a codec call right after a pass over a
            # whole gradient and its residual finds its code and tables evicted, and
            # in a training step took 2-3x its warm time. (Sparse ones one at a time:
            # their error feedback makes a dense sum each.)
            selections = {t: self._select(x, name) for t, (name, x)
                          in enumerate(zip(names, tensors))
                          if t not in sharing and not isinstance(x, SparseTensor)}
            settles = []
            for t, (name, x) in enumerate(zip(names, tensors)):
                group = sharing.get(t)
                if group is None:
                    slots.append(len(payloads))
                    if t in selections:
                        pipeline, selected, dense, corrected = selections[t]
                        payload, receiveds[t] = self._encode_timed(pipeline, selected, dense)
                        if corrected is not None:
                            settles.append((name, corrected, receiveds[t], selected))
                    else:
                        payload, receiveds[t] = self.encode_tensor(x, name)
                    payloads.append(payload)
                    decoded.append(receiveds[t])
                elif t == group[1][0][0]:  # the group travels where its first tensor is
                    slots.append(len(payloads))
                    payload, whole, parts = self._encode_shared(*group, names, settles)
                    payloads.append(payload)
                    decoded.append(whole)
                    for (member, _), part in zip(group[1], parts):
                        receiveds[member] = part
                else:
                    slots.append(slots[group[1][0][0]])
            # (if a coding raised, nothing was sent: every dense tensor's residual still
            # holds its whole corrected gradient)
            for name, corrected, received, selected in settles:
                self.memory.settle(name, corrected, received, selected)
            bundle = (pack_bundle(payloads, slots, [receiveds[t].shape for t in sorted(sharing)])
                      if shared else pack_bundle(payloads))
            encoded = StepStats(steps=1, tensors=len(tensors),
                                compressed_tensors=sum(r.size >= self.min_size for r in receiveds),
                                bytes_sent=len(bundle),
                                dense_bytes=sum(r.size * r.dtype.itemsize for r in receiveds),
                                encode_seconds=time.perf_counter() - start,
                                codec_seconds=self._codec_seconds)
        return bundle, (bundle, decoded), encoded

    def _shared_payloads(self, tensors) -> list[tuple[bool, list]]:
        """The tensors that travel in a shared payload: ``(selects, members)`` per payload,
        ``members`` their ``(position, array)``.

        Per dtype, the dense tensors below ``min_size`` share a lossless payload
        (``selects`` False) and, when the codecs code each selection as they would
        alone, those from ``min_size`` to :data:`SHARED_BELOW` elements share one of
        their selections (``selects`` True): two or more tensors a payload. Each
        of them then costs a slice of a payload instead of one (its header, checksum
        and codec calls, and decoding them again for every rank).
        """
        groups = {}
        for t, x in enumerate(tensors):
            size = _size(x)
            if isinstance(x, SparseTensor) or size >= SHARED_BELOW or (
                    size >= self.min_size and not self._selections_share):
                continue
            array = x if isinstance(x, np.ndarray) and x.dtype.kind == "f" else _as_float_array(x)
            groups.setdefault((size >= self.min_size, array.dtype), []).append((t, array))
        return [(selects, members) for (selects, _), members in groups.items()
                if len(members) > 1]

    def _encode_shared(self, selects: bool, members, names,
                       settles: list) -> tuple[bytes, SparseTensor, list]:
        """``(payload, whole, tensors)``: the payload of ``members`` (see
        :meth:`_shared_payloads`), what the receivers decode of it and of each member.
        Appends to ``settles`` the :meth:`ResidualMemory.settle` calls that finish their
        error feedback."""
        shapes = [array.shape for _, array in members]
        if not selects:
            flat = np.concatenate([array.reshape(-1) for _, array in members])
            payload, whole = self._encode_timed(self.small_pipeline,
                                                *self.small_pipeline.sparsify(flat))
            return payload, whole, split_shared(whole, shapes)
        # each tensor's own error feedback and selection, then one coding of them all
        feedback, values, indices, offset = [], [], [], 0
        for t, array in members:
            pipeline = self._pipeline_of(names[t])
            if self.memory is None or names[t] is None:
                corrected, selected = None, pipeline.sparsify(array)[0]
            else:
                corrected, selected, _ = self._corrected_selection(names[t], array, pipeline)
            feedback.append((corrected, selected))
            values.append(selected.values)
            indices.append(selected.indices + offset)
            offset += array.size
        whole = SparseTensor._trusted(np.concatenate(values), np.concatenate(indices), (offset,))
        payload, received = self._encode_timed(self.pipeline, whole, None)
        parts = split_shared(received, shapes)
        for (t, _), (corrected, selected), part in zip(members, feedback, parts):
            if corrected is not None:
                # (the index code is exact: the part's indices are the selection's)
                settles.append((names[t], corrected, part, SparseTensor._trusted(
                    selected.values, part.indices, part.shape)))
        return payload, received, parts

    def decode_bundles(self, gathered, ranks: int, rank: int, average: bool = False,
                       as_rows=None, out=None) -> list:
        """Decode the allgathered bundles of ``ranks`` ranks and reduce them.

        Parameters
        ----------
        gathered : bytes-like or list of bytes-like
            The concatenated bundles, in rank order, or one bundle per rank.
        ranks, rank : int
            Number of ranks and this rank's position (its own bundle is the
            reference every other rank's tensor shapes and dtypes must match).
        average : bool
            Divide the sums by ``ranks`` (Horovod's ``op=Average``).
        as_rows : list of bool, optional
            For each tensor, True to return ``(values, rows)``: the non-zero
            rows of the reduced tensor (``values[i]`` is row ``rows[i]``, as in
            ``tf.IndexedSlices``); False (default) to return a dense array.
        out : list of numpy.ndarray or None, optional
            For each dense result, an array of its size and dtype to write it
            into (its contents are overwritten), or None for a new one.

        Returns
        -------
        list
            One reduced tensor per gradient, with the dtype its payloads carry.
        """
        return self.decode_groups([gathered], ranks, rank, average, as_rows, out)

    def decode_groups(self, groups, ranks: int, rank: int, average: bool = False,
                      as_rows=None, out=None) -> list:
        """:meth:`decode_bundles` for a step that travelled in several allgathers.

        ``groups`` holds what each allgather gathered (in either form
        :meth:`decode_bundles` takes), in group order: the bundles of
        ``encode_bundle(..., group=g)``. Their tensors are decoded and reduced
        as if one bundle had carried them all, in that order.
        """
        with self._lock:
            sent = [self._last_sent.get(group) for group in range(len(groups))]
            results, decoded = self._decode_bundles(groups, ranks, rank, average, as_rows,
                                                    out, sent)
        self.stats.record_decode(bytes_received=decoded.bytes_received,
                                 seconds=decoded.decode_seconds,
                                 codec_seconds=decoded.codec_seconds)
        return results

    def _decode_bundles(self, groups, ranks, rank, average, as_rows, out, sent, out_keys=None):
        """See :meth:`decode_groups`. ``sent``: per group, this rank's bundle and what each
        of its payloads decodes to (see :meth:`_encode_bundle`), or None. ``out_keys``: as
        :meth:`reduce_async`'s reuse_out, the name of each tensor, under which the
        positions written into its ``out`` are kept."""
        start = time.perf_counter()
        read, received = [], 0
        for gathered in groups:
            if isinstance(gathered, (list, tuple)):
                if len(gathered) != ranks:
                    raise DecodeError(f"{len(gathered)} bundles for {ranks} ranks")
                read.append([split_bundles(bundle, 1)[0] for bundle in gathered])
                received += sum(memoryview(bundle).nbytes for bundle in gathered)
            else:
                read.append(split_bundles(gathered, ranks))
                received += memoryview(gathered).nbytes
        counts = [sum(len(per_rank[r].slots) for per_rank in read) for r in range(ranks)]
        count = counts[rank]
        for r, tensors in enumerate(counts):
            if tensors != count:
                raise DecodeError(f"rank {r} sent {tensors} tensors, rank {rank} sent "
                                  f"{count}: every rank must reduce the same gradients")
        as_rows = [False] * count if as_rows is None else list(as_rows)
        if len(as_rows) != count:
            raise ValueError(f"as_rows has {len(as_rows)} entries for {count} tensors")
        codec_start = time.perf_counter()
        units, first = [], 0
        for per_rank, own in zip(read, sent):
            # a rank's own payloads are what it encoded, unless its bundle came back
            # changed (bytes(view) == bytes is one memcmp)
            decoded = [own[1] if r == rank and own is not None and bytes(bundle.data) == own[0]
                       else [decode(p) for p in bundle.payloads]
                       for r, bundle in enumerate(per_rank)]
            units += _units(per_rank, decoded, rank, first, as_rows)
            first += len(per_rank[rank].slots)
        codec_seconds = time.perf_counter() - codec_start
        results = [None] * count
        scale = 1.0 / ranks if average else None
        for positions, shapes, parts in units:
            reference = parts[rank]
            for r, part in enumerate(parts):
                if part.shape != reference.shape or part.dtype != reference.dtype:
                    what = f"tensor {positions[0]}" if shapes is None else \
                        f"the payload of tensors {positions}"
                    raise DecodeError(f"{what}: rank {r} sent {part.shape} {part.dtype}, "
                                      f"rank {rank} sent {reference.shape} {reference.dtype}")
            if shapes is not None:
                self._reduce_shared(positions, shapes, parts, reference, scale, out, out_keys,
                                    results)
                continue
            i = positions[0]
            if as_rows[i]:
                results[i] = _sum_rows(parts, scale)
                continue
            # the sequential sum in the dtype, as Horovod's dense allreduce computes it,
            # straight into the dense result: no per-rank arrays, no union of supports
            accumulator = _accumulator(reference.dtype)
            target = None if out is None or out[i] is None else \
                _writable_flat(out[i], reference.size, reference.dtype)
            if target is not None and target.dtype == accumulator:
                total = target
                stale = None if out_keys is None else self._sums.written(out_keys[i], target)
                if stale is None:
                    total.fill(0)
            else:
                total, stale = self._sums.zeros(i, reference.size, accumulator)
            touched = sum_sorted_into(total, parts, scale, stale)
            result = total.astype(reference.dtype, copy=False)
            if target is None:
                self._sums.keep(i, total, touched)
            elif out_keys is not None and total is target:
                self._sums.keep_written(out_keys[i], target, touched)
            elif result is not target:
                np.copyto(target, result)
                result = target
            results[i] = result.reshape(reference.shape)
        return results, StepStats(bytes_received=received,
                                  decode_seconds=time.perf_counter() - start,
                                  codec_seconds=codec_seconds)

    def _reduce_shared(self, positions, shapes, parts, reference, scale, out, out_keys,
                       results) -> None:
        """Sum the ranks' ``parts`` of one shared payload at once, into ``results`` at
        ``positions``: views of one dense sum, or copies into ``out``."""
        accumulator, key = _accumulator(reference.dtype), ("shared", positions[0])
        total, stale = self._sums.zeros(key, reference.size, accumulator)
        self._sums.keep(key, total, sum_sorted_into(total, parts, scale, stale))
        flat, start = total.astype(reference.dtype, copy=False), 0
        for t, shape in zip(positions, shapes):
            size = math.prod(shape)
            result = flat[start:start + size].reshape(shape)
            start += size
            if out is not None and out[t] is not None:
                target = _writable_flat(out[t], size, reference.dtype)
                np.copyto(target, result.reshape(-1))
                if out_keys is not None:  # written whole: no record of positions holds
                    self._sums.written(out_keys[t], target)
                result = out[t]
            results[t] = result

    # -- one step, reduced inside the collective -------------------------------
    def reduce_tensors(self, names, tensors, op="sum", process_set=None, transport=None,
                       as_rows=None) -> list:
        """Reduce this rank's gradients across ranks with the reducing communicator.

        For ``communicator="sparse_allreduce"`` or ``"block"``. Every rank
        calls this with the same names, shapes and dtypes, in the same order;
        it returns when the reduction is complete (the collectives run on the
        communicator's transport thread; a rank whose part fails makes every
        rank raise).

        Each gradient of ``min_size`` elements or more gets its residual
        (error feedback), then the sparsifier; smaller ones send every
        non-zero. The selections of all gradients of one dtype go through one
        set of collectives (small ones through a second, lossless one when the
        codecs are lossy), and the residual becomes exactly ``corrected
        input - sent``, with ``sent`` as the communicator reports it.

        Parameters
        ----------
        names, tensors
            As for :meth:`encode_bundle`.
        op : {"sum", "average"} or hvd.Sum / hvd.Average
        process_set : horovod ProcessSet, optional
            Reduce within this process set (the global one by default).
        transport : deepreduce.collectives.Transport, optional
            Instead of Horovod, e.g. a member of ``ThreadTransport.group(P)``.
        as_rows : list of bool, optional
            As for :meth:`decode_bundles`, except that the rows returned are
            the non-zero rows of the reduced tensor.

        Returns
        -------
        list
            One reduced tensor per gradient (dtype of its values), equal on every rank.

        Examples
        --------
        Two ranks played by threads (under ``horovodrun``, leave ``transport`` out):

        >>> import numpy as np, deepreduce as dr
        >>> from concurrent.futures import ThreadPoolExecutor
        >>> from deepreduce.collectives import ThreadTransport
        >>> from deepreduce.exchange import GradientExchange
        >>> c = [GradientExchange(dr.TopK(2), index="varint", min_size=4,
        ...                          communicator="sparse_allreduce") for _ in range(2)]
        >>> def rank_main(member):
        ...     grads = [np.array([0, 3, -1, 0, 2, 0], np.float32) * (member.rank + 1),
        ...              np.ones(2, np.float32)]            # below min_size: exact
        ...     return c[member.rank].reduce_tensors(["w", "b"], grads, transport=member)
        >>> with ThreadPoolExecutor(2) as pool:
        ...     w, b = list(pool.map(rank_main, ThreadTransport.group(2)))[0]
        >>> w, b
        (array([0., 9., 0., 0., 6., 0.], dtype=float32), array([2., 2.], dtype=float32))
        >>> c[0].memory.residual("w")    # the entry TopK left behind, kept for the next step
        array([ 0.,  0., -1.,  0.,  0.,  0.], dtype=float32)
        """
        if self.communicator == "allgather":
            raise ValueError("communicator 'allgather' reduces with encode_bundle and "
                             "decode_bundles")
        if len(names) != len(tensors):
            raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
        as_rows = [False] * len(tensors) if as_rows is None else list(as_rows)
        if len(as_rows) != len(tensors):
            raise ValueError(f"as_rows has {len(as_rows)} entries for {len(tensors)} tensors")
        with self._lock:
            finish = self._start_reduction(list(names), list(tensors), op, process_set,
                                           transport, as_rows)
            return finish()[0]

    def reduce_async(self, names, tensors, transport, op="sum", as_rows=None, out=None,
                     reuse_out=False):
        """Start reducing this rank's gradients over ``transport``; return a Future.

        The one entry point for every communicator and every framework. The
        caller's thread does error feedback, the sparsifier and the encoding;
        the collectives, the decoding and the sums run on the transport's
        communication thread, in the order the reductions were started (the
        same on every rank), so the caller can prepare the next gradients
        while these travel.

        Parameters
        ----------
        names, tensors
            As for :meth:`encode_bundle`.
        transport : deepreduce.collectives.Transport
            Horovod's, torch.distributed's (``deepreduce.torch``) or a member
            of ``ThreadTransport.group(P)``.
        op : {"sum", "average"}
        as_rows : list of bool, optional
            As for :meth:`decode_bundles`.
        out : list of numpy.ndarray or None, optional
            As for :meth:`decode_bundles`: arrays the dense results are
            written into.
        reuse_out : bool, default False
            With the allgather communicator, a promise that each ``out`` array
            still holds what the last reduction with the same name wrote into
            it (nothing else wrote there since): only the positions that
            reduction made non-zero are reset, not the whole array. A result
            of 1% non-zeros then costs a pass over 2% of it instead of over
            all of it. DDP's hook keeps such arrays.

        Returns
        -------
        concurrent.futures.Future
            Its result is ``(outputs, traffic)``: the reduced tensors, equal on
            every rank, and the :class:`~deepreduce.collectives.Traffic` of
            this rank. A failure on any rank raises on every rank.

        Examples
        --------
        >>> import numpy as np, deepreduce as dr
        >>> from concurrent.futures import ThreadPoolExecutor
        >>> from deepreduce.collectives import ThreadTransport
        >>> from deepreduce.exchange import GradientExchange
        >>> ex = [GradientExchange(dr.TopK(1), min_size=0) for _ in range(2)]
        >>> def rank_main(member):
        ...     g = np.array([1, -4, 2], np.float32) * (member.rank + 1)
        ...     return ex[member.rank].reduce_async(["w"], [g], member).result()
        >>> with ThreadPoolExecutor(2) as pool:
        ...     (outputs, traffic), _ = pool.map(rank_main, ThreadTransport.group(2))
        >>> outputs
        [array([ 0., -12.,   0.], dtype=float32)]
        """
        op = collectives.base.op_name(op)
        if len(names) != len(tensors):
            raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
        if self.communicator == "allgather":
            try:
                bundle, sent, encoded = self._encode_bundle(names, tensors)
            except (ValueError, TypeError) as exc:
                # the other ranks wait in the allgather: they get an ERROR frame and raise
                return transport.submit(fail_collectively, "allgather", transport,
                                        BUNDLE_SIGNATURE, exc)
            encode_end = time.perf_counter()

            def finish():
                traffic = Traffic()
                gathered = signed_allgather(transport, BUNDLE_SIGNATURE, bundle, traffic,
                                            "bundles")
                exchanged = time.perf_counter()
                # no lock: decoding shares nothing with encoding (the next reduction's,
                # running meanwhile), and the transport thread decodes one at a time
                outputs, decoded = self._decode_bundles(
                    [gathered], transport.size, transport.rank, op == "average", as_rows, out,
                    [sent], list(names) if reuse_out else None)
                # one record per exchange: exchanges may overlap, open/close pairs may not
                self.stats.record_step(encoded + decoded + StepStats(
                    exchange_seconds=exchanged - encode_end))
                return outputs, traffic
        else:
            as_rows = [False] * len(tensors) if as_rows is None else list(as_rows)
            with self._lock:
                reduced = self._start_reduction(list(names), list(tensors), op, None,
                                                transport, as_rows)

            def finish():
                with self._lock:
                    outputs, traffic = reduced()
                for target, output in zip(out or [], outputs):
                    if target is not None:
                        np.copyto(target, np.asarray(output).reshape(target.shape))
                return [o if t is None else t for o, t in
                        zip(outputs, out or [None] * len(outputs))], traffic
        # queued behind the reduction's own collectives on the same thread
        return transport.submit(finish)

    def _build_communicator(self, kind, **per_call):
        """The communicator of the large (``"main"``) or the small gradients."""
        if kind == "small":
            return collectives.get_communicator(self.communicator, pipeline=self.small_pipeline,
                                                **self._small_options, **per_call)
        return collectives.get_communicator(self.communicator, pipeline=self._wire_pipeline,
                                            **self.communicator_options, **per_call)

    def _start_reduction(self, names, tensors, op, process_set, transport, as_rows):
        """Error feedback, sparsifier and encoding now; return the function that waits
        for the collectives and returns ``(outputs, traffic)``."""
        start = time.perf_counter()
        selections, corrected, groups = [], {}, {}
        dense_bytes = compressed = 0
        for i, (name, x) in enumerate(zip(names, tensors)):
            if _size(x) < self.min_size:
                selected = self.small_pipeline.sparsify(x)[0]
                kind = "main" if self._small_ride_along else "small"
            else:
                pipeline = self._pipeline_of(name)
                if self.memory is None or name is None:
                    selected = pipeline.sparsify(x)[0]
                else:
                    corrected[i], selected, _ = self._corrected_selection(name, x, pipeline)
                kind = "main"
                compressed += 1
            selections.append(selected)
            dense_bytes += selected.size * selected.dtype.itemsize
            # insertion order is the order of the gradients: the same on every rank
            groups.setdefault((kind, selected.dtype), []).append(i)
        handles = []
        for (kind, _), positions in groups.items():
            # built per step: cheap (the Horovod transport is shared), and no
            # communicator outlives the step accumulating its traffic
            communicator = self._build_communicator(kind, op=op, process_set=process_set,
                                                    transport=transport)
            handles.append((positions, communicator.reduce_many_async(
                [selections[i] for i in positions])))
        encoded = time.perf_counter()

        def finish():
            results, traffic, failure, reductions = [None] * len(tensors), Traffic(), None, []
            for positions, handle in handles:
                try:  # wait for every group, so that a failing one leaves the ranks in step
                    group = handle.wait()
                except Exception as exc:  # noqa: BLE001 - re-raised below
                    failure = failure or exc
                    continue
                reductions += zip(positions, group)
                traffic += group[0].traffic
            if failure is not None:
                raise failure
            exchanged = time.perf_counter()
            for i, reduction in reductions:
                if i in corrected:
                    self.memory.settle(names[i], corrected[i], reduction.sent, selections[i])
                results[i] = _nonzero_rows(reduction.output) if as_rows[i] else reduction.output
            end = time.perf_counter()
            self.stats.record_step(StepStats(
                steps=1, tensors=len(tensors), compressed_tensors=compressed,
                bytes_sent=traffic.sent, bytes_received=traffic.received,
                dense_bytes=dense_bytes, encode_seconds=encoded - start,
                decode_seconds=end - exchanged, exchange_seconds=exchanged - encoded))
            return results, traffic

        return finish


def _with_seed(part, name):
    """The sparsifier or codec ``part`` with its random stream seeded from its own seed
    and the tensor ``name`` (``part`` itself when it draws nothing)."""
    seed = getattr(part, "seed", None)
    if seed is None:
        return part
    seed = zlib.crc32(str(name).encode(), seed)
    if hasattr(part, "with_seed"):  # a sparsifier
        return part.with_seed(seed)
    return type(part).from_config({**part.get_config(), "seed": seed})


def _random_parts(pipeline):
    return [(role, part) for role, part in (("sparsifier", pipeline.sparsifier),
                                            ("index", pipeline.index_codec),
                                            ("value", pipeline.value_codec))
            if part is not None]


def _writable_flat(array: np.ndarray, size: int, dtype: np.dtype) -> np.ndarray:
    """``array`` as a flat view, after checking that it can hold ``size`` values of
    ``dtype``."""
    if not isinstance(array, np.ndarray) or array.size != size or array.dtype != dtype \
            or not array.flags.c_contiguous or not array.flags.writeable:
        raise ValueError(f"out must be a writable C-contiguous {dtype} array of "
                         f"{size} elements")
    return array.reshape(-1)


def _units(bundles, decoded, rank: int, first: int, as_rows) -> list:
    """What one allgather's ``bundles`` (one per rank, payloads ``decoded``) hold, as
    ``(positions, shapes, parts)`` to reduce: one per tensor (``shapes`` None), and one
    per shared payload when every rank shares it alike (its tensors' ``shapes``, the
    ranks' whole payloads as ``parts``). ``first``: the position of the first tensor."""
    reference = bundles[rank]
    alike = all(b.slots == reference.slots and b.shapes == reference.shapes for b in bundles)
    members = reference.shared() if alike else {}
    # (rows are reduced per tensor: the rows any rank touched)
    shared = {slot: ts for slot, ts in members.items()
              if not any(as_rows[first + t] for t in ts)}
    tensors = None if len(shared) == len(members) and alike else \
        [b.tensors(d) for b, d in zip(bundles, decoded)]
    units = []
    for t, slot in enumerate(reference.slots):
        if slot not in shared:
            units.append(([first + t], None, [
                d[slot] if tensors is None else tensors[r][t] for r, d in enumerate(decoded)]))
        elif t == shared[slot][0]:
            shapes = [reference.shapes[m] for m in shared[slot]]
            _check_holds(decoded[rank][slot], sum(math.prod(shape) for shape in shapes),
                         f"bundle of rank {rank}, payload {slot}")
            units.append(([first + m for m in shared[slot]], shapes, [d[slot] for d in decoded]))
    return units


def _size(x) -> int:
    return x.size if isinstance(x, SparseTensor) else int(np.size(x))


def _check_communicator(name, options) -> tuple[str, dict]:
    """The communicator's name and its options, checked against its constructor."""
    if name not in COMMUNICATORS:
        raise ValueError(f"communicator must be one of {', '.join(map(repr, COMMUNICATORS))}, "
                         f"got {name!r}")
    options = {} if options is None else dict(options)
    if name == "allgather":
        if options:
            raise ValueError(f"communicator 'allgather' takes no options, got {sorted(options)}")
        return name, options
    accepted = [p for p in inspect.signature(collectives.COMMUNICATORS[name]).parameters
                if p not in _PER_CALL]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        reason = (" (the pipeline is the Compression's own; op and process_set are "
                  "arguments of the wrappers)" if set(unknown) & set(_PER_CALL) else "")
        raise ValueError(f"communicator {name!r} takes the options {', '.join(accepted)}; "
                         f"got {', '.join(unknown)}{reason}")
    return name, options


def _nonzero_rows(dense: np.ndarray):
    """``(values, rows)`` of the rows of ``dense`` holding a non-zero (NaN counts)."""
    flat = dense.reshape(dense.shape[0], int(np.prod(dense.shape[1:], dtype=np.int64)))
    rows = np.flatnonzero((flat != 0).any(axis=1))
    return dense[rows], rows.astype(np.int64)


def _accumulator(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype.itemsize >= 8 else np.dtype(np.float32)


def _references(array: np.ndarray) -> int:
    """References to the memory of ``array``, an array from :func:`~deepreduce.sparse.zeros`:
    every view of it holds one, and so does a TensorFlow tensor that adopted a view."""
    return sys.getrefcount(array.base)


#: :func:`_references` of an array nobody else views: measured, because the
#: temporaries the count includes differ between Python versions.
_UNSHARED = _references(zeros(1, np.float32))


class _ReusedSums:
    """Each tensor's dense sum of the last decode, rewritten in place once nobody holds it;
    and where the sums written into a caller's arrays (``reuse_out``) are non-zero.

    A reduced gradient is zeros plus the ranks' sparse entries. Writing it into
    last step's array costs resetting the entries that array holds, not a pass
    over the whole tensor, and the array is aligned so that TensorFlow adopts it
    as a tensor instead of copying it. An array anything still views (a tensor
    TensorFlow has not released, a result the caller kept) is left alone and a
    fresh one replaces it.
    """

    def __init__(self):
        self._last = {}
        self._written = {}

    def zeros(self, key, size: int, dtype) -> tuple[np.ndarray, np.ndarray | None]:
        """``(total, stale)``: a flat array, zero except perhaps at the positions
        ``stale``: last step's for ``key`` when it is free (with the positions it
        holds), else a new one (and None)."""
        last = self._last.pop(key, None)
        if last is not None:
            total, touched = last
            if total.size == size and total.dtype == dtype and _references(total) == _UNSHARED:
                return total, touched
        return zeros(size, dtype), None

    def keep(self, key, total: np.ndarray, touched: np.ndarray) -> None:
        """Remember ``total`` (from :meth:`zeros`), non-zero at most at ``touched``."""
        self._last[key] = (total, touched)

    def written(self, key, target: np.ndarray) -> np.ndarray | None:
        """The positions :meth:`keep_written` recorded under ``key`` when ``target`` is the
        same memory as then (else None: the whole array must be reset)."""
        last = self._written.pop(key, None)
        if last is not None and last[0] == _memory_of(target):
            return last[1]
        return None

    def keep_written(self, key, target: np.ndarray, touched: np.ndarray) -> None:
        """Remember that ``target`` is zero but perhaps at ``touched``."""
        self._written[key] = (_memory_of(target), touched)


def _memory_of(array: np.ndarray) -> tuple:
    return array.__array_interface__["data"][0], array.size, array.dtype.str


def _sum_rows(parts, scale):
    """Sum the ranks' sparse tensors into ``(values, rows)`` of the touched rows only."""
    first = parts[0]
    row_shape = first.shape[1:]
    row_size = int(np.prod(row_shape, dtype=np.int64))
    if row_size == 0:
        return np.zeros((0, *row_shape), first.dtype), np.zeros(0, np.int64)
    accumulator = _accumulator(first.dtype)
    summed = sum_sparse(parts, first.size, accumulator, accumulator)
    row_of = summed.indices // row_size
    rows = np.unique(row_of)
    total = np.zeros(rows.size * row_size, accumulator)
    slots = np.searchsorted(rows, row_of) * row_size + summed.indices % row_size
    total[slots] = summed.values
    if scale is not None:
        scale_at(total, slots, scale)
    values = total.astype(first.dtype, copy=False)
    return values.reshape(rows.size, *row_shape), rows
