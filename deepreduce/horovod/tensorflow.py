"""deepreduce payloads as Horovod + TensorFlow gradients.

A Horovod training script changes one or two lines::

    import tensorflow as tf, horovod.tensorflow as hvd, deepreduce as dr
    import deepreduce.horovod.tensorflow as drh

    hvd.init()
    compression = drh.Compression(sparsifier=dr.TopK(0.01), index="auto", value="fp16",
                                  error_feedback=True)      # these are the defaults
    tape = drh.DistributedGradientTape(tape, compression=compression)       # custom loops
    opt = drh.DistributedOptimizer(tf.keras.optimizers.SGD(0.1),
                                   compression=compression)                 # Keras fit

How it travels. Horovod's allreduce sums what it is given, and summed payload
bytes mean nothing, so deepreduce uses the **allgather communicator**: each rank
encodes all its gradients of a step into one bundle (one payload per gradient,
the small ones of a dtype sharing one, framed by :mod:`deepreduce.exchange`),
one ``hvd.allgather`` moves every rank's bundle to every rank (their sizes may
differ), and every rank decodes all of them and sums in rank order (dividing by
the number of ranks for ``op=hvd.Average``), so all ranks apply the same
gradient. Encoding and decoding are numpy code, run directly in eager mode and through
``tf.numpy_function`` inside ``tf.function`` and ``model.fit``.

``Compression(communicator="sparse_allreduce")`` (SparCML) or ``"block"``
(OmniReduce) reduces inside the collective instead, with the communicators of
:mod:`deepreduce.collectives`: index ranges (or blocks) go to their owner
ranks over ``hvd.alltoall``, are summed there and allgathered back, so what a
rank receives no longer grows with the number of ranks. Error feedback, the
sparsifier and the codecs stay as configured; all gradients of one dtype
travel in one set of collectives::

    compression = drh.Compression(sparsifier=dr.TopK(0.01), value="fp16",
                                  communicator="sparse_allreduce")
    compression = drh.Compression(communicator="block",
                                  communicator_options={"block_size": 256})

``Compression(communicator="hierarchical")`` sums each node's gradients densely
and compresses only between nodes (:mod:`deepreduce.exchange.hierarchical`); its
node and shard groups are Horovod process sets, found registered or added at the
first step (:meth:`~deepreduce.horovod.collectives.HorovodTransport.split`: that
needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1``, or the sets given to ``hvd.init``, see
:func:`~deepreduce.horovod.collectives.hierarchical_process_sets`)::

    compression = drh.Compression(sparsifier=dr.TopK(0.01), value="fp16", communicator="hierarchical",
                                  communicator_options={"inter": "allgather"})

``tf.IndexedSlices`` gradients (embeddings) are encoded as sparse tensors of the
variable's shape, never densified, and come back as ``tf.IndexedSlices`` of the
rows any rank touched (unless ``sparse_as_dense=True``); with sparse allreduce
and block, of the rows whose reduced sum is non-zero.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

from deepreduce.errors import DecodeError
from deepreduce.horovod.collectives import horovod_transport
from deepreduce.pipeline import decode
from deepreduce.sparse import SparseTensor
from deepreduce.config import ExchangeConfig
from deepreduce.exchange.integration import Integration
from deepreduce.horovod.keras import CompressionStatsCallback
from deepreduce.exchange.stats import CompressionStats, StepStats

__all__ = ["Compression", "DistributedGradientTape", "DistributedOptimizer",
           "CompressionStatsCallback", "allreduce", "grouped_allreduce",
           "CompressionStats", "StepStats"]

MISUSE_HINT = (
    "the deepreduce payload reaching Compression.decompress does not decode. Horovod's "
    "allreduce sums what it is given, and summed payload bytes are not a payload: pass "
    "deepreduce.horovod.tensorflow.Compression to drh.DistributedGradientTape, "
    "drh.DistributedOptimizer or drh.allreduce (import deepreduce.horovod.tensorflow as "
    "drh), which allgather the payloads, instead of horovod's own wrappers")


# Entry points called from user code that TensorFlow may be autograph-converting
# (tf.function, model.fit) are marked do_not_convert: they are plain Python that
# builds ops, and the numpy functions they define must run as written.
_plain_python = tf.autograph.experimental.do_not_convert


def _host_call(fn, inputs, tout, ordered=True):
    """Run numpy ``fn`` on ``inputs``: directly when eager, as a graph op otherwise.

    Returns a list of tensors (one per dtype in ``tout``). Eager calls raise
    ``fn``'s own exceptions; inside a graph TensorFlow reports them as
    ``tf.errors.InvalidArgumentError`` (for ValueError and DecodeError) with
    the same message. ``ordered=False`` leaves the op out of the order a
    ``tf.function`` keeps among its stateful ops (Horovod's collectives are
    some), so it may run while one of them is under way: for calls whose only
    effects are on state no other op reads, and whose output is used.
    """
    if tf.executing_eagerly():
        outputs = fn(*[t.numpy() for t in inputs])
        return [tf.convert_to_tensor(o, dtype=d) for o, d in zip(outputs, tout)]
    return tf.numpy_function(fn, inputs, tout, stateful=ordered)


class Compression(Integration):
    """Compression of gradients for Horovod: sparsifier, codecs, error feedback.

    Parameters
    ----------
    config : ExchangeConfig, optional
        The exchange's settings at once; or, by name, the fields of
        :class:`~deepreduce.config.ExchangeConfig`, with the same defaults as every
        deepreduce integration: ``sparsifier`` (Top-1%), ``index`` ("auto"),
        ``value`` ("fp16"), ``error_feedback`` (1.0, per variable), ``min_size``
        (1024), ``seed`` (0), ``communicator`` ("allgather"; or "sparse_allreduce",
        "block", "hierarchical"), ``communicator_options`` and ``codec_threads``.
        ``Compression(sparsifier=None, value="raw")`` sends every non-zero, losslessly.

        With "hierarchical", ``communicator_options`` take ``local_size``
        (ranks per node; horovodrun's ``HOROVOD_LOCAL_SIZE`` by default),
        ``inter`` and ``inter_options``. Its groups are Horovod process sets of
        the wrappers' ``process_set`` (the global one), added at the first step
        with dynamic process sets (``HOROVOD_DYNAMIC_PROCESS_SETS=1``) or
        registered at ``hvd.init``; otherwise the first step raises ValueError
        on every rank, saying so. It runs eagerly and inside ``tf.function``.
    check_finite : bool, default True
        The wrappers check every step that all ranks' gradients are finite (one
        read pass over them and a small allgather of the answers) before error
        feedback touches them. A step with an inf or NaN on any rank goes whole and
        exact on every rank (:meth:`~deepreduce.exchange.GradientExchange.reduce_async`'s
        ``finite``): every rank gets the rank-order sums, inf or NaN where dense
        allreduce's are, so a loop that skips non-finite steps (Keras'
        ``LossScaleOptimizer``, a custom loop) skips it on every rank, and the
        residuals and random streams stay as they were. False saves the pass and
        the allgather; an overflow step then poisons the residuals for good.

    Attributes
    ----------
    exchange : deepreduce.exchange.GradientExchange
        The framework-neutral exchange doing the work.
    stats : deepreduce.exchange.stats.CompressionStats
        The bytes and times of every step it compressed:
        ``compression.stats.last.ratio``, ``compression.stats.as_dict()``.

    Notes
    -----
    The object follows Horovod's compressor protocol (:meth:`compress` returns
    the payload as a 1-D ``tf.uint8`` tensor, :meth:`decompress` decodes one),
    but Horovod's own ``DistributedGradientTape``/``DistributedOptimizer``
    allreduce (sum) the compressed tensors. Given to them, :meth:`decompress`
    raises :class:`~deepreduce.DecodeError` explaining to use this module's
    wrappers (inside ``tf.function`` TensorFlow reports it as
    ``tf.errors.InvalidArgumentError`` with that message); if the ranks'
    payloads differ in length Horovod itself refuses the mismatched allreduce.
    A wrong gradient is never returned: every payload carries a CRC32.

    With sparse allreduce, a lossy value codec rounds twice (what a rank
    sends to a range owner, then the owner's sum); the residual holds the
    first rounding exactly, the second is the same on every rank and not fed
    back.
    """

    def __init__(self, *, config=None, check_finite=True, **settings):
        super().__init__(ExchangeConfig.from_settings(config, **settings), {},
                         check_finite=check_finite)

    def __repr__(self):
        return f"Compression({self.exchange!r})"

    def _bind(self):
        return horovod_transport()

    # -- Horovod's compressor protocol ---------------------------------------
    @_plain_python
    def compress(self, tensor):
        """Encode ``tensor`` into a payload (1-D uint8 tensor); ctx is its dtype and shape.

        No error feedback here: the protocol does not say which variable a
        tensor belongs to. The communicator of this module does.
        """
        tensor = tf.convert_to_tensor(tensor)

        def encode_one(x):
            return (np.frombuffer(self.exchange.encode_tensor(x)[0], dtype=np.uint8),)

        (payload,) = _host_call(encode_one, [tensor], [tf.uint8])
        payload.set_shape([None])
        return payload, (tensor.dtype, tensor.shape)

    @_plain_python
    def decompress(self, tensor, ctx):
        """Decode one payload back into a dense tensor of the original dtype and shape."""
        dtype, shape = ctx

        def decode_one(payload):
            try:
                st = decode(payload.tobytes())
            except DecodeError as exc:
                raise DecodeError(f"{MISUSE_HINT} (decoder: {exc})") from exc
            return (st.to_dense().astype(dtype.as_numpy_dtype, copy=False),)

        (dense,) = _host_call(decode_one, [tensor], [dtype])
        dense.set_shape(shape)
        return dense


def _check_compression(compression):
    if compression is None:
        return Compression()
    if not isinstance(compression, Compression):
        raise ValueError("compression must be a deepreduce.horovod.tensorflow.Compression "
                         f"(horovod's own compressors are for allreduce), got {compression!r}")
    return compression


def _source_keys(sources) -> list[str]:
    """Stable names for error feedback: variable names, made unique; positions otherwise."""
    keys, seen = [], {}
    for i, source in enumerate(sources):
        try:
            name = source.name
        except AttributeError:  # eager tensors have no meaningful name
            name = None
        if not isinstance(name, str):
            name = f"#{i}"
        seen[name] = seen.get(name, 0) + 1
        keys.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return keys


class _Reducer:
    """Reduces a list of gradients across ranks with the compression's communicator.

    Allgather: one bundle per rank through one ``hvd.allgather`` between two
    host calls (encode, decode). Sparse allreduce, block and hierarchical: one
    host call runs the whole reduction, its collectives included (Horovod
    operations on :class:`~deepreduce.horovod.collectives.HorovodTransport`,
    issued from its communication thread).
    """

    def __init__(self, compression, op, sparse_as_dense, gradient_predivide_factor,
                 process_set, num_groups=0):
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError("op must be hvd.Average or hvd.Sum (deepreduce sums decoded "
                             f"payloads), got {op!r}")
        if gradient_predivide_factor != 1.0 and op != hvd.Average:
            raise ValueError("gradient_predivide_factor is only supported with op=hvd.Average")
        self.compression = _check_compression(compression)
        self.op, self.sparse_as_dense = op, bool(sparse_as_dense)
        self.predivide = float(gradient_predivide_factor)
        self.process_set = process_set
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 0:
            raise ValueError(f"num_groups must be an int >= 0, got {num_groups!r}")
        self.num_groups = num_groups

    @_plain_python
    def __call__(self, grads, keys):
        """Reduce ``grads`` (tensors, IndexedSlices or None) named ``keys`` across ranks:

        1. the gradients as host inputs (:class:`_HostStep`), predivided;
        2. the first step compares every rank's settings (eagerly, on Horovod's
           transport thread);
        3. the reduction: an allgather of bundles between two host calls, or the whole
           reduction of another communicator in one host call;
        4. the results as tensors of the gradients' kinds, shapes and dtypes.
        """
        todo = [(i, g) for i, g in enumerate(grads) if g is not None]
        if not todo:
            return list(grads)
        step = _HostStep([self._predivided(g) for _, g in todo], [keys[i] for i, _ in todo])
        self.compression.agree(horovod_transport(self.process_set))
        if self.compression.config.communicator == "allgather":
            outputs = self._allgather(step)
        else:
            outputs = self._reduce(step)
        reduced = list(grads)
        for (i, _), result in zip(todo, step.results(outputs)):
            reduced[i] = result if self.predivide == 1.0 else \
                _map_values(result, lambda v: v * self.predivide)
        return reduced

    def _predivided(self, g):
        if isinstance(g, tf.IndexedSlices) and self.sparse_as_dense:
            g = tf.convert_to_tensor(g)
        return g if self.predivide == 1.0 else _map_values(g, lambda v: v / self.predivide)

    def _allgather(self, step) -> list:
        """Each group's bundle encoded in a host call, allgathered by Horovod, and all of
        them decoded and reduced in one more host call; with ``check_finite`` the ranks'
        flags go in an allgather first, and every encode takes their minimum."""
        exchange, compression = self.compression.exchange, self.compression
        finite = []  # (one flag for every group's encode, the same on every rank)
        if compression.check_finite:
            (mine,) = _host_call(lambda *arrays: (np.int32(exchange.selector.all_finite(
                step.unpack(arrays))),), step.inputs, [tf.int32])
            answers = hvd.allgather(tf.reshape(mine, [1]), process_set=self.process_set)
            finite = [tf.cast(tf.reduce_min(answers), tf.int32)]
        gathered, ranges = [], _balanced_groups(step.templates, self.num_groups)
        for group, (lo, hi) in enumerate(ranges):
            def encode(*arrays, lo=lo, hi=hi, group=group):
                everywhere = not finite or bool(arrays[-1])
                arrays = arrays[:-1] if finite else arrays
                bundle = exchange.encode_bundle(step.names[lo:hi],
                                                step.unpack(arrays, step.kinds[lo:hi]),
                                                group, finite=everywhere)
                return (np.frombuffer(bundle, dtype=np.uint8),)

            # in a graph the groups' encodes are not chained to the allgathers (as
            # stateful ops would be): the next group encodes while this one is on the
            # wire. Their effects (residuals, stats) belong to the exchange, which
            # decode_all, a stateful op after every allgather, reads.
            (bundle,) = _host_call(encode, step.inputs[step.starts[lo]:step.starts[hi]] + finite,
                                   [tf.uint8], ordered=len(ranges) == 1)
            bundle.set_shape([None])
            gathered.append(hvd.allgather(bundle, process_set=self.process_set))
        ranks, rank = self.process_set.size(), self.process_set.rank()

        def decode_all(*groups):
            return step.pack(exchange.decode_groups(list(groups), ranks, rank,
                                                    self.op == hvd.Average,
                                                    as_rows=step.as_rows))
        return _host_call(decode_all, gathered, step.tout)

    def _reduce(self, step) -> list:
        """The whole reduction of a reducing or hierarchical communicator in one host call
        (its collectives are Horovod ops on the transport's thread)."""
        compression = self.compression
        exchange, transport = compression.exchange, horovod_transport(self.process_set)
        if not tf.executing_eagerly() and \
                tf.config.threading.get_inter_op_parallelism_threads() == 1:
            # The communicator runs Horovod ops from inside the host call; in a graph
            # that call holds TensorFlow's only inter-op thread, and they would wait
            # for it forever.
            raise ValueError(f"communicator={compression.config.communicator!r} inside a "
                             "tf.function needs TensorFlow's inter-op thread pool to have "
                             "at least 2 threads (tf.config.threading."
                             "set_inter_op_parallelism_threads; 0, the default, is fine), "
                             "or run the step eagerly, or use communicator='allgather'")
        op = "average" if self.op == hvd.Average else "sum"

        def reduce_all(*arrays):
            tensors = step.unpack(arrays)
            finite = compression.finite_everywhere(tensors, transport)
            return step.pack(exchange.reduce_async(step.names, tensors, transport, op,
                                                   as_rows=step.as_rows,
                                                   finite=finite).result()[0])
        return _host_call(reduce_all, step.inputs, step.tout)


class _HostStep:
    """The gradients of one reduction as host calls see them: each dense tensor one
    input, each IndexedSlices three (values, indices, dense shape); what the results'
    host outputs are (``tout``), and how both convert (:meth:`unpack`, :meth:`pack`,
    :meth:`results`)."""

    def __init__(self, grads, names):
        self.templates, self.names = grads, names
        self.kinds = ["rows" if isinstance(g, tf.IndexedSlices) else "dense" for g in grads]
        self.inputs, self.tout = [], []
        for g in grads:
            if isinstance(g, tf.IndexedSlices):
                self.inputs += [g.values, g.indices, tf.cast(g.dense_shape, tf.int64)]
                self.tout += [g.values.dtype, tf.int64]
            else:
                self.inputs.append(tf.convert_to_tensor(g))
                self.tout.append(g.dtype)
        self.as_rows = [kind == "rows" for kind in self.kinds]
        # tensor i's host arrays are inputs[starts[i]:starts[i + 1]]
        self.starts = np.cumsum([0] + [1 if k == "dense" else 3 for k in self.kinds]).tolist()

    def unpack(self, arrays, kinds=None) -> list:
        """The host arrays of the inputs (of tensors of ``kinds``) as dense arrays and
        SparseTensors."""
        tensors, pos = [], 0
        for kind in self.kinds if kinds is None else kinds:
            if kind == "dense":
                tensors.append(arrays[pos])
                pos += 1
            else:
                tensors.append(SparseTensor.from_rows(*arrays[pos:pos + 3]))
                pos += 3
        return tensors

    def pack(self, reduced) -> list:
        """The reduced tensors as the flat list of host outputs (see ``tout``)."""
        outputs = []
        for kind, template, result in zip(self.kinds, self.templates, reduced):
            if kind == "dense":
                outputs.append(result.astype(template.dtype.as_numpy_dtype, copy=False))
            else:
                values, rows = result
                outputs += [values.astype(template.values.dtype.as_numpy_dtype, copy=False),
                            rows]
        return outputs

    def results(self, outputs) -> list:
        """The host calls' outputs as tensors of the gradients' kinds and shapes."""
        results, pos = [], 0
        for kind, template in zip(self.kinds, self.templates):
            if kind == "dense":
                result = outputs[pos]
                result.set_shape(template.shape)
                pos += 1
            else:
                values, rows = outputs[pos], outputs[pos + 1]
                values.set_shape(tf.TensorShape([None]).concatenate(template.values.shape[1:]))
                rows.set_shape([None])
                result = tf.IndexedSlices(values, tf.cast(rows, template.indices.dtype),
                                          template.dense_shape)
                pos += 2
            results.append(result)
        return results


def _map_values(g, function):
    """``function`` of the values of ``g``, a tensor or IndexedSlices."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(function(g.values), g.indices, g.dense_shape)
    return function(g)


def _balanced_groups(templates, num_groups: int) -> list[tuple[int, int]]:
    """``num_groups`` (at least 1, at most one per tensor) consecutive ranges of the
    tensors, ``(start, stop)``, of about equal numbers of elements."""
    sizes = []
    for template in templates:
        shape = (template.values if isinstance(template, tf.IndexedSlices) else template).shape
        sizes.append(max(1, shape.num_elements() or 1))
    count = max(1, min(num_groups, len(sizes)))
    total, cuts, running = sum(sizes), [0], 0
    for i, size in enumerate(sizes[:-1]):
        running += size
        still_to_start = count - len(cuts)
        # a group ends once the running total reaches its share, or when each group
        # still to start needs one of the tensors left
        if still_to_start and (running * count >= len(cuts) * total
                               or len(sizes) - (i + 1) == still_to_start):
            cuts.append(i + 1)
    return list(zip(cuts, cuts[1:] + [len(sizes)]))


@_plain_python
def _reduce_with_local(reducer, grads, sources, local_refs, scale_local_gradients):
    """Reduce the gradients of non-local sources; scale local ones as Horovod does."""
    keys = _source_keys(sources)
    is_local = [s.ref() in local_refs if hasattr(s, "ref") else False for s in sources]
    shared = reducer([None if local else g for g, local in zip(grads, is_local)], keys)
    out = []
    for g, r, local in zip(grads, shared, is_local):
        if not local:
            out.append(r)
        elif g is None or not scale_local_gradients:
            out.append(g)
        elif isinstance(g, tf.IndexedSlices):
            out.append(tf.IndexedSlices(g.values / reducer.process_set.size(), g.indices,
                                        g.dense_shape))
        else:
            out.append(g / reducer.process_set.size())
    return out


@_plain_python
def grouped_allreduce(tensors, compression=None, op=hvd.Average, names=None,
                      process_set=hvd.global_process_set, sparse_as_dense=False):
    """Reduce several tensors across ranks in one exchange of deepreduce payloads.

    One allgather of one bundle per rank, or (``communicator=`` of the
    compression) one set of sparse-allreduce or block collectives per dtype.

    Parameters
    ----------
    tensors : list of tf.Tensor or tf.IndexedSlices
    compression : Compression, optional
        Defaults to a lossless ``Compression()``.
    op : hvd.Average or hvd.Sum
    names : list of str, optional
        Keys of the error-feedback residuals; required when error feedback is
        on and a tensor is compressed lossily, so residuals never mix.
    process_set : hvd.ProcessSet
    sparse_as_dense : bool
        Densify IndexedSlices before sending.

    Returns
    -------
    list
        The reduced tensors (IndexedSlices stay IndexedSlices), equal on every rank.
    """
    reducer = _Reducer(compression, op, sparse_as_dense, 1.0, process_set)
    tensors = list(tensors)
    if names is None:
        if reducer.compression.exchange.selector.memory is not None:
            raise ValueError("names= is required with error feedback (error_feedback=1.0): "
                             "residuals are kept per name")
        names = [f"#{i}" for i in range(len(tensors))]
    return reducer(tensors, list(names))


def allreduce(tensor, compression=None, op=hvd.Average, name=None,
              process_set=hvd.global_process_set, sparse_as_dense=False):
    """Reduce one tensor across ranks through deepreduce payloads.

    See :func:`grouped_allreduce`; ``name`` keys the error-feedback residual.
    """
    return grouped_allreduce([tensor], compression, op, None if name is None else [name],
                             process_set, sparse_as_dense)[0]


class _DistributedTapeMixin:
    """Placed before the user's tape class: gradients are reduced before returning."""

    def __init__(self, tape, reducer, persistent, watch_accessed_variables,
                 scale_local_gradients):
        super().__init__(persistent, watch_accessed_variables)
        self._tape = tape._tape  # the recording made under the user's `with` block
        self._dr_reducer = reducer
        self._dr_local_sources = set()
        self._dr_scale_local = scale_local_gradients

    def register_local_source(self, source):
        """Keep this source's gradient local (not reduced), as in Horovod."""
        self._dr_local_sources.add(source.ref())

    @_plain_python
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources, flat_grads = tf.nest.flatten(sources), tf.nest.flatten(grads)
        reduced = _reduce_with_local(self._dr_reducer, flat_grads, flat_sources,
                                     self._dr_local_sources, self._dr_scale_local)
        return tf.nest.pack_sequence_as(grads, reduced)


def _check_unsupported(backward_passes_per_step, average_aggregated_gradients):
    if backward_passes_per_step != 1 or average_aggregated_gradients:
        raise ValueError("backward_passes_per_step > 1 (local gradient aggregation) is not "
                         "supported by deepreduce's wrappers; accumulate gradients yourself "
                         "and reduce them with drh.grouped_allreduce")


def DistributedGradientTape(gradtape, device_dense="", device_sparse="", compression=None,
                            sparse_as_dense=False, op=hvd.Average,
                            gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set=hvd.global_process_set, scale_local_gradients=True):
    """A tape whose ``gradient()`` returns gradients reduced through deepreduce payloads.

    Drop-in replacement for ``hvd.DistributedGradientTape`` with the same
    arguments. All gradients of one ``gradient()`` call travel together: one
    bundle per rank over one ``hvd.allgather``, or ``num_groups`` of them (see
    below), or one set of collectives per dtype with the compression's
    ``communicator="sparse_allreduce"`` or ``"block"``. ``groups`` (Horovod's
    explicit allreduce grouping) is accepted for compatibility only, as are
    ``device_dense``/``device_sparse`` (codecs run on the host CPU).

    Parameters
    ----------
    gradtape : tf.GradientTape
        The tape that recorded the forward pass.
    compression : Compression, optional
        Defaults to a lossless ``Compression()``.
    sparse_as_dense : bool
        Densify ``tf.IndexedSlices`` gradients before sending.
    op : hvd.Average or hvd.Sum
    gradient_predivide_factor : float
        With Average, gradients are divided by it before encoding and the
        average multiplied by it after (as Horovod does).
    process_set : hvd.ProcessSet
        Reduce over these ranks only.
    scale_local_gradients : bool
        Divide gradients of sources registered with ``register_local_source``
        by the number of ranks, as Horovod does.
    num_groups : int, default 0
        With the allgather communicator, the gradients travel in this many
        bundles (consecutive gradients, about equal in size; 0 or 1: one
        bundle), one ``hvd.allgather`` each. Inside a ``tf.function`` a group
        is encoded while the groups before it are on the wire (and the last
        layers' gradients while backward still computes the first ones'); the
        reduced gradients are the same bits. That needs a core to spare: with
        no more cores than ranks, encoding a group takes the core from backward
        and the overlap gains nothing (docs/horovod.md). Other communicators
        ignore it.
    """
    del device_dense, device_sparse, groups  # host codecs; num_groups groups the bundles
    reducer = _Reducer(compression, op, sparse_as_dense, gradient_predivide_factor,
                       process_set, num_groups)
    cls = type(gradtape.__class__.__name__, (_DistributedTapeMixin, gradtape.__class__), {})
    return cls(gradtape, reducer, gradtape._persistent, gradtape._watch_accessed_variables,
               scale_local_gradients)


class _DistributedOptimizerMixin:
    """Common part of the optimizer mixins: the reduction and local variables."""

    def register_local_var(self, var):
        """Keep this variable's gradient local (not reduced), as in Horovod."""
        self._dr_local_vars.add(var.ref())

    @_plain_python
    def _dr_reduce(self, grads_and_vars):
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return grads_and_vars
        grads, variables = zip(*grads_and_vars)
        reduced = _reduce_with_local(self._dr_reducer, list(grads), list(variables),
                                     self._dr_local_vars, self._dr_scale_local)
        return list(zip(reduced, variables))


class _ReduceInComputeGradients(_DistributedOptimizerMixin):
    """Keras 2.11+ optimizers: minimize() -> compute_gradients() -> apply_gradients()."""

    def compute_gradients(self, loss, var_list, tape=None):
        return self._dr_reduce(super().compute_gradients(loss, var_list, tape))


class _ReduceInLegacyHooks(_DistributedOptimizerMixin):
    """Legacy (optimizer_v2) optimizers: minimize() -> _compute_gradients(); get_gradients()."""

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        return self._dr_reduce(super()._compute_gradients(loss, var_list, grad_loss, tape))

    def get_gradients(self, loss, params):
        grads = super().get_gradients(loss, params)
        return [g for g, _ in self._dr_reduce(zip(grads, params))]


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",
                         compression=None, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=hvd.Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False,
                         num_groups=0, groups=None, process_set=hvd.global_process_set,
                         scale_local_gradients=True):
    """Wrap a Keras optimizer so the gradients it computes travel as deepreduce payloads.

    Drop-in replacement for ``horovod.tensorflow.keras.DistributedOptimizer``
    (Keras 2 / ``tf.keras``, new and legacy optimizers): ``model.fit`` and
    ``optimizer.minimize`` reduce the gradients in one exchange per step
    (through the compression's communicator).
    The returned optimizer has the wrapped optimizer's class name and config,
    so saved models load without deepreduce. ``name``, ``device_*`` and
    ``groups`` are accepted for compatibility; ``backward_passes_per_step``
    must be 1.
    Gradients passed straight to ``apply_gradients`` are not reduced (as in
    Horovod): custom loops use :func:`DistributedGradientTape`.

    Parameters
    ----------
    optimizer : tf.keras.optimizers.Optimizer
    compression : Compression, optional
        Defaults to a lossless ``Compression()``.
    sparse_as_dense, gradient_predivide_factor, op, process_set, scale_local_gradients
        As for :func:`DistributedGradientTape`.
    num_groups : int, default 0
        The bundles of a step, as for :func:`DistributedGradientTape`.
    """
    del name, device_dense, device_sparse, groups
    _check_unsupported(backward_passes_per_step, average_aggregated_gradients)
    reducer = _Reducer(compression, op, sparse_as_dense, gradient_predivide_factor,
                       process_set, num_groups)
    base = optimizer.__class__
    # hook the methods this optimizer generation calls; same class name, so
    # saved models load without deepreduce
    mixin = _ReduceInComputeGradients if hasattr(base, "compute_gradients") \
        else _ReduceInLegacyHooks
    cls = type(base.__name__, (mixin, base), {})
    distributed = cls.from_config(optimizer.get_config())
    distributed._dr_reducer = reducer
    distributed._dr_local_vars = set()
    distributed._dr_scale_local = scale_local_gradients
    return distributed
