"""The hierarchical exchange: dense inside a node, compressed between nodes.

With ``communicator="hierarchical"`` the :class:`~deepreduce.exchange.GradientExchange`
hands each step here. Ranks are numbered node by node, ``local_size`` per node
(as torchrun and horovodrun number them); every tensor is cut into
``local_size`` contiguous shards (:func:`~deepreduce.collectives.hierarchical.shard_bounds`),
and local rank ``l`` is in charge of shard ``l``:

1. inside the node, a dense reduce-scatter (one alltoall): each rank receives
   its shard of every tensor from the others of its node and sums them in
   local-rank order, in the tensors' dtype;
2. between nodes, the ranks in charge of the same shard (one per node) run the
   configured exchange on it: error feedback on the node's sum of the shard
   (residuals kept per tensor name, of the shard's size), the sparsifier and
   codecs, then the ``inter`` communicator (``"allgather"``: bundles to every
   node, decoded and summed in node order, as :mod:`deepreduce.allgather_exchange`
   does; or ``"sparse_allreduce"`` / ``"block"``, as
   :mod:`deepreduce.reducing_exchange` does);
3. inside the node, an allgather of the reduced shards (each dense, or its
   non-zero positions and values when that is smaller).

A lossless configuration therefore yields the sums ``(x_0 + ... + x_{L-1}) +
(next node's) + ...``: a dense allreduce that sums each node first, in rank
order, bit for bit. ``min_size`` applies to what a rank compresses, its shard.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
import zlib

import numpy as np

from deepreduce.allgather_exchange import AllgatherExchange
from deepreduce.collectives import frames
from deepreduce.collectives.base import check_peers, scale_at
from deepreduce.collectives.hierarchical import (Failures, Topology, node_transports,
                                                 pack_shards, resolve_local_size, shard_bounds,
                                                 unpack_shards)
from deepreduce.collectives.transport import Traffic
from deepreduce.reducing_exchange import ReducingExchange, nonzero_rows
from deepreduce.sparse import SparseTensor
from deepreduce.sparsifiers import _as_float_array
from deepreduce.stats import StepStats


class HierarchicalExchange:
    """The three stages of a hierarchical step over one transport.

    Parameters
    ----------
    config : ExchangeConfig
        Its ``communicator`` is ``"hierarchical"``; ``communicator_options``
        hold ``local_size`` (None: from the launcher, see
        :func:`~deepreduce.collectives.hierarchical.resolve_local_size`),
        ``inter`` and ``inter_options``.
    selector : Selector
        The exchange's per-tensor step (pipelines, error feedback): it sees the
        shards.

    Examples
    --------
    Four ranks as two nodes of two, played by threads, lossless:

    >>> import numpy as np, threading, deepreduce as dr
    >>> from concurrent.futures import ThreadPoolExecutor
    >>> from deepreduce.collectives import ThreadTransport
    >>> from deepreduce.exchange import GradientExchange
    >>> ex = [GradientExchange(sparsifier=None, index="varint", value="raw", min_size=0,
    ...                        communicator="hierarchical",
    ...                        communicator_options={"local_size": 2}) for _ in range(4)]
    >>> def rank_main(member):
    ...     g = np.arange(6, dtype=np.float32) * (member.rank + 1)
    ...     (total,), traffic = ex[member.rank].reduce_async(["w"], [g], member).result()
    ...     return total
    >>> with ThreadPoolExecutor(4) as pool:
    ...     totals = list(pool.map(rank_main, ThreadTransport.group(4)))
    >>> totals[3]
    array([ 0., 10., 20., 30., 40., 50.], dtype=float32)
    """

    def __init__(self, config, selector):
        options = config.communicator_options
        self.local_size = options["local_size"]
        self.inter, self.inter_options = options["inter"], options["inter_options"]
        self.selector = selector
        if self.inter == "allgather":
            self._inner = AllgatherExchange(selector, config.codec_threads)
        else:
            self._inner = ReducingExchange(dataclasses.replace(
                config, communicator=self.inter, communicator_options=self.inter_options),
                selector)
        self._init_runtime()

    def _init_runtime(self):
        # per transport: its topology and the two transports split from it, made at its
        # first step (creating groups is collective and slow)
        self._groups = weakref.WeakKeyDictionary()

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_groups")  # process groups stay with the process
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_runtime()

    @property
    def signature(self) -> str:
        """What every rank must agree on before the first step."""
        options = ",".join(f"{k}:{v}" for k, v in sorted(self.inter_options.items()))
        return f"exchange=hierarchical;inter={self.inter};inter_options={options}"

    # -- one step ----------------------------------------------------------------------
    def reduce_async(self, names, tensors, transport, op, as_rows, out, lock, stats):
        """Start a step; a Future of ``(outputs, traffic)`` (see
        :meth:`deepreduce.exchange.GradientExchange.reduce_async`).

        The caller's thread copies this rank's shards out of ``tensors``; the
        three stages run on ``transport``'s communication thread, the error
        feedback and encoding under ``lock``, and ``stats`` records the step.
        """
        start = time.perf_counter()
        failures = Failures(self._rank_of, transport.rank)
        layout = outgoing = None
        try:
            flats = [_flat(x) for x in tensors]
            layout = _Layout(flats, [_shape(x) for x in tensors],
                             self._topology(transport).local_size)
            outgoing = layout.scatter(flats)
        except (ValueError, TypeError) as exc:
            failures.fail(exc)
        prepared = time.perf_counter() - start

        def finish():
            groups = self._groups_of(transport)
            topology, intra, inter = groups
            return self._step(names, layout, outgoing, topology, intra, inter, op, as_rows,
                              out, lock, stats, failures, prepared)
        return transport.submit(finish)

    def _step(self, names, layout, outgoing, topology, intra, inter, op, as_rows, out, lock,
              stats, failures, prepared):
        traffic, timing = Traffic(), {"exchange": 0.0, "encode": prepared, "decode": 0.0}
        digest = "none" if layout is None else layout.digest
        clock = time.perf_counter()
        # 1. inside the node: this rank's shard of every tensor, summed over the node
        received = failures.alltoall(intra, f"exchange=hierarchical;layout={digest}",
                                     outgoing or [b""] * intra.size, traffic,
                                     "node reduce-scatter")
        shards = None
        if received is not None:
            shards = layout.reduce(received, topology.local_rank)
        timing["exchange"] += time.perf_counter() - clock
        # 2. between nodes: the compressed exchange of the shard
        reduced, encoded, decoded = self._between_nodes(
            names, layout, shards, topology, inter, lock, failures, traffic, timing)
        clock = time.perf_counter()
        if reduced is not None and op == "average":
            for segment in reduced:
                scale_at(segment, np.flatnonzero(segment), 1.0 / topology.size)
        # 3. inside the node: every reduced shard to every rank of the node
        body = b"" if reduced is None else pack_shards(reduced)
        gathered = failures.allgather(intra, f"exchange=hierarchical;layout={digest}", body,
                                      traffic, "node allgather")
        timing["exchange"] += time.perf_counter() - clock
        failures.raise_if_any()
        clock = time.perf_counter()
        segments = [reduced if j == topology.local_rank else
                    unpack_shards(frame, layout.segments(j)) for j, frame in enumerate(gathered)]
        outputs = layout.assemble(segments, out, as_rows)
        timing["decode"] += time.perf_counter() - clock
        stats.record_step(StepStats(
            steps=1, tensors=len(outputs), compressed_tensors=encoded.compressed_tensors,
            bytes_sent=traffic.sent, bytes_received=traffic.received,
            dense_bytes=layout.dense_bytes, encode_seconds=timing["encode"],
            decode_seconds=timing["decode"], exchange_seconds=timing["exchange"],
            codec_seconds=encoded.codec_seconds + decoded.codec_seconds))
        return outputs, traffic

    def _between_nodes(self, names, layout, shards, topology, inter, lock, failures, traffic,
                       timing):
        """Stage 2: ``(reduced segments or None, encode stats, decode stats)``."""
        encoded, decoded = StepStats(), StepStats()
        targets = None if shards is None else layout.empty_segments(topology.local_rank)
        if self.inter == "allgather":
            bundle = b""
            clock = time.perf_counter()
            if shards is not None:
                try:
                    with lock:
                        bundle, sent, encoded = self._inner.encode(names, shards)
                except (ValueError, TypeError) as exc:
                    failures.fail(exc)
            timing["encode"] += time.perf_counter() - clock
            clock = time.perf_counter()
            gathered = failures.allgather(inter, "exchange=hierarchical;stage=bundles", bundle,
                                          traffic, "between nodes")
            timing["exchange"] += time.perf_counter() - clock
            if gathered is None:
                return None, encoded, decoded
            clock = time.perf_counter()
            try:
                _, decoded = self._inner.decode(
                    [gathered], inter.size, inter.rank, False, None,
                    layout.shard_views(targets, topology.local_rank), [sent])
            except ValueError as exc:  # DecodeError included
                failures.fail(exc)
                return None, encoded, decoded
            timing["decode"] += time.perf_counter() - clock
            return targets, encoded, decoded
        # sparse_allreduce / block: the ranks learn first whether all of them can go on,
        # since each runs a sequence of collectives that a missing rank would leave waiting
        clock = time.perf_counter()
        if failures.allgather(inter, "exchange=hierarchical;stage=status", b"", traffic,
                              "between nodes: status") is None:
            return None, encoded, decoded
        try:
            with lock:
                reduction = self._inner.start(names, shards, "sum", inter, [False] * len(shards))
            with lock:
                outputs, inner_traffic, encoded = reduction()
        except ValueError as exc:
            failures.fail(exc)
            return None, encoded, decoded
        traffic += inner_traffic
        for view, output in zip(layout.shard_views(targets, topology.local_rank), outputs):
            np.copyto(view, np.asarray(output).reshape(-1))
        timing["exchange"] += time.perf_counter() - clock
        return targets, encoded, decoded

    # -- the groups ----------------------------------------------------------------------
    def _topology(self, transport) -> Topology:
        groups = self._groups.get(transport)
        if groups is not None:
            return groups[0]
        return Topology(transport.size, resolve_local_size(self.local_size), transport.rank)

    def _groups_of(self, transport):
        """``(topology, intra, inter)`` of ``transport``: agreed on and split at its first
        step, on its communication thread, by every rank."""
        groups = self._groups.get(transport)
        if groups is not None:
            return groups
        failure, local_size = None, None
        try:
            local_size = resolve_local_size(self.local_size)
            topology = Topology(transport.size, local_size, transport.rank)
            topology.check_launcher()
        except ValueError as exc:
            failure = exc
        signature = f"{self.signature};local_size={local_size}"
        body = frames.error_frame(f"{type(failure).__name__}: {failure}") if failure else b""
        gathered = transport.allgather(frames.signed(signature, body), Traffic(), "agree")
        if failure is not None:
            raise failure
        check_peers({r: f for r, f in enumerate(gathered) if r != transport.rank}, signature,
                    transport.rank)
        intra, inter = node_transports(transport, topology)
        groups = self._groups[transport] = (topology, intra, inter)
        return groups

    def _rank_of(self, sub, member: int) -> int:
        """The whole group's rank of ``member`` of the intra or inter transport ``sub``."""
        for topology, intra, inter in self._groups.values():
            if sub is intra:
                return topology.global_rank(topology.node, member)
            if sub is inter:
                return topology.global_rank(member, topology.local_rank)
        return member

    # -- error feedback outside the exchange --------------------------------------------
    def pay(self, memory, names, tensors, transport) -> None:
        """Add what error feedback owes into ``tensors`` (in place), for a step that sends
        them whole: each residual is of this rank's shard of the node's sum, and goes into
        this rank's shard of its gradient, so the dense sum over all ranks holds it once."""
        if not len(memory):
            return
        topology = self._topology(transport)
        for name, x in zip(names, tensors):
            if name is None or name not in memory:
                continue
            flat = x.reshape(-1)
            bounds = shard_bounds(flat.size, topology.local_size)
            memory.pay(name, flat[bounds[topology.local_rank]:bounds[topology.local_rank + 1]])


def _shape(x) -> tuple:
    return x.shape if isinstance(x, SparseTensor) else np.shape(x)


def _flat(x) -> np.ndarray:
    """``x`` (a dense array or SparseTensor) as a flat floating-point array."""
    if isinstance(x, SparseTensor):
        return x.to_dense().reshape(-1)
    x = x if isinstance(x, np.ndarray) and x.dtype.kind == "f" else _as_float_array(x)
    return x.reshape(-1)


class _Layout:
    """Where each tensor's shards lie in the segments a step moves.

    A rank's *segment* of one dtype is its shard of every tensor of that dtype,
    one after the other in tensor order; what travels inside a node is a rank's
    segments of every dtype, in the order the dtypes first appear.
    """

    def __init__(self, flats, shapes, local_size: int):
        self.shapes = shapes
        self.sizes = np.array([f.size for f in flats], dtype=np.int64)
        self.dtypes = [f.dtype for f in flats]
        self.local_size = local_size
        self.groups = {}  # dtype -> tensor positions, in order
        for t, dtype in enumerate(self.dtypes):
            self.groups.setdefault(dtype, []).append(t)
        # bounds[t, j]: where shard j of tensor t starts (column local_size: the end)
        self.bounds = np.stack([shard_bounds(n, local_size) for n in self.sizes]) \
            if len(flats) else np.zeros((0, local_size + 1), np.int64)
        lengths = np.diff(self.bounds, axis=1)
        # offsets[g][j]: where each tensor's shard j starts in segment j of dtype group g
        self.offsets = {dtype: np.vstack([np.zeros((1, local_size), np.int64),
                                          np.cumsum(lengths[ts], axis=0)])
                        for dtype, ts in self.groups.items()}
        self.dense_bytes = int(sum(f.nbytes for f in flats))
        self.digest = f"{zlib.crc32(repr([(f.size, f.dtype.str) for f in flats]).encode()):08x}"

    def segments(self, j: int) -> list:
        """``(size, dtype)`` of local rank ``j``'s segments."""
        return [(int(self.offsets[dtype][-1, j]), dtype) for dtype in self.groups]

    def empty_segments(self, j: int) -> list:
        return [np.empty(size, dtype) for size, dtype in self.segments(j)]

    def scatter(self, flats) -> list:
        """Per local rank, the bytes of its segments cut from this rank's ``flats``."""
        out = []
        for j in range(self.local_size):
            buffer = np.empty(sum(size * dtype.itemsize for size, dtype in self.segments(j)),
                              np.uint8)
            pos = 0
            for dtype, ts in self.groups.items():
                segment = buffer[pos:pos + int(self.offsets[dtype][-1, j]) * dtype.itemsize] \
                    .view(dtype)
                for t, start in zip(ts, self.offsets[dtype][:-1, j].tolist()):
                    low, high = self.bounds[t, j], self.bounds[t, j + 1]
                    segment[start:start + high - low] = flats[t][low:high]
                pos += segment.nbytes
            out.append(memoryview(buffer))
        return out

    def reduce(self, received, j: int) -> list:
        """Per tensor, its shard ``j`` summed over the node's ranks in local-rank order,
        from every rank's segment bytes ``received``."""
        shards, pos = [None] * len(self.dtypes), 0
        for dtype, ts in self.groups.items():
            size = int(self.offsets[dtype][-1, j])
            parts = [np.frombuffer(frame, dtype, size, pos) for frame in received]
            total = parts[0].copy()
            for part in parts[1:]:
                total += part
            for t, start in zip(ts, self.offsets[dtype][:-1, j].tolist()):
                shards[t] = total[start:start + self.bounds[t, j + 1] - self.bounds[t, j]]
            pos += size * dtype.itemsize
        return shards

    def shard_views(self, segments, j: int) -> list:
        """Per tensor, the view of its shard ``j`` in ``segments`` (local rank ``j``'s)."""
        views = [None] * len(self.dtypes)
        for segment, (dtype, ts) in zip(segments, self.groups.items()):
            for t, start in zip(ts, self.offsets[dtype][:-1, j].tolist()):
                views[t] = segment[start:start + self.bounds[t, j + 1] - self.bounds[t, j]]
        return views

    def assemble(self, segments, out, as_rows) -> list:
        """The whole tensors from every local rank's reduced ``segments``, written into
        ``out`` where given."""
        results = []
        for t, (size, dtype, shape) in enumerate(zip(self.sizes.tolist(), self.dtypes,
                                                     self.shapes)):
            target = None if out is None or out[t] is None else out[t]
            if target is not None and (not isinstance(target, np.ndarray) or target.size != size
                                       or target.dtype != dtype
                                       or not target.flags.c_contiguous):
                raise ValueError(f"out must be a writable C-contiguous {dtype} array of "
                                 f"{size} elements")
            flat = np.empty(size, dtype) if target is None else target.reshape(-1)
            results.append(flat)
        for j, per_rank in enumerate(segments):
            for t, view in enumerate(self.shard_views(per_rank, j)):
                results[t][self.bounds[t, j]:self.bounds[t, j + 1]] = view
        for t, flat in enumerate(results):
            whole = flat.reshape(self.shapes[t])
            target = None if out is None else out[t]
            results[t] = nonzero_rows(whole) if as_rows[t] else \
                (target if target is not None else whole)
        return results
