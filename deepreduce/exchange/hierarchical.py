"""The hierarchical exchange: dense inside a node, compressed between nodes.

With ``communicator="hierarchical"`` the :class:`~deepreduce.exchange.GradientExchange`
hands each step here. Ranks are numbered node by node, ``local_size`` per node
(as torchrun and horovodrun number them); every tensor is cut into
``local_size`` contiguous shards (:func:`~deepreduce.exchange.topology.shard_bounds`),
and local rank ``l`` is in charge of shard ``l``:

1. inside the node, a dense reduce-scatter (one alltoall): each rank receives
   its shard of every tensor from the others of its node and sums them in
   local-rank order, in the tensors' dtype;
2. between nodes, the ranks in charge of the same shard (one per node) run the
   configured exchange on it: error feedback on the node's sum of the shard
   (residuals kept per tensor name, of the shard's size), the sparsifier and
   codecs, then the ``inter`` communicator (``"allgather"``: bundles to every
   node, decoded and summed in node order, as :mod:`deepreduce.exchange.allgather`
   does; or ``"sparse_allreduce"`` / ``"block"``, as
   :mod:`deepreduce.exchange.reducing` does);
3. inside the node, an allgather of the reduced shards (each dense, or its
   non-zero positions and values when that is smaller).

A lossless configuration therefore yields the sums ``(x_0 + ... + x_{L-1}) +
(next node's) + ...``: a dense allreduce that sums each node first, in rank
order, bit for bit. ``min_size`` applies to what a rank compresses, its shard.
"""

from __future__ import annotations

import time
import weakref
import zlib

import numpy as np

from deepreduce.collectives import frames
from deepreduce.collectives.signed import check_peers
from deepreduce.collectives.transport import Traffic
from deepreduce.exchange.stats import CompressionStats, StepStats
from deepreduce.exchange.strategy import Step, Strategy
from deepreduce.exchange.summing import memory_of, nonzero_rows
from deepreduce.exchange.topology import (CarriedStage, Failures, Topology, node_transports,
                                          pack_shards, resolve_local_size, shard_bounds,
                                          unpack_shards)
from deepreduce.sparse import SparseTensor
from deepreduce.sparsifiers import _as_float_array
from deepreduce.sums import SUM_IMPLEMENTATION

#: What stage 2 allgathers behind: a strategy's bundles, or, before a strategy whose
#: collectives cannot carry a failure, nothing: whether every rank can go on.
_BUNDLES_SIGNATURE = "exchange=hierarchical;stage=bundles"
_STATUS_SIGNATURE = "exchange=hierarchical;stage=status"


class HierarchicalExchange(Strategy):
    """The three stages of a hierarchical step over one transport.

    Parameters
    ----------
    config : ExchangeConfig
        Its ``communicator`` is ``"hierarchical"``; ``communicator_options``
        hold ``local_size`` (None: from the launcher, see
        :func:`~deepreduce.exchange.topology.resolve_local_size`),
        ``inter`` and ``inter_options``.
    selector : Selector
        The exchange's per-tensor step (pipelines, error feedback): it sees the
        shards.
    between_nodes : Strategy
        The strategy of ``inter`` (an allgather or a reducing one) that stage 2 runs
        on the shards through its :meth:`~deepreduce.exchange.strategy.Strategy.start`
        (:func:`~deepreduce.exchange.gradient_exchange.strategy_for` builds it).

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

    def __init__(self, config, selector, between_nodes: Strategy):
        options = config.communicator_options
        self.local_size = options["local_size"]
        self.inter, self.inter_options = options["inter"], options["inter_options"]
        self.selector = selector
        self._inner = between_nodes
        self._init_runtime()

    def _init_runtime(self):
        # per transport: its topology and the two transports split from it, made at its
        # first step (creating groups is collective and slow)
        self._groups = weakref.WeakKeyDictionary()
        self._segments = {}  # (layout, local rank) -> arrays the reduced shards are summed into
        self._written_out = {}  # (layout, tensor) -> (its out array, positions written there)

    def __getstate__(self):
        state = dict(self.__dict__)
        # process groups, and arrays of the running process, stay with it
        for runtime in ("_groups", "_segments", "_written_out"):
            state.pop(runtime)
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
    def start(self, step: Step):
        """Start a step; a Future of ``(outputs, traffic)`` (see
        :meth:`deepreduce.exchange.GradientExchange.reduce_async`; with ``reuse_out``
        only the positions the last step wrote into each ``out`` array are reset).

        The caller's thread copies out of ``tensors`` the shards that go to the
        other ranks of the node; the three stages run on ``transport``'s
        communication thread, which reads this rank's own shard from ``tensors``
        (they must stay as they are until the Future completes, as a DDP bucket
        does), the error feedback and encoding under ``step.lock``; ``step.stats``
        records the step.
        """
        names, tensors, transport = list(step.names), list(step.tensors), step.transport
        op, as_rows, out, reuse_out = step.op, step.as_rows, step.out, step.reuse_out
        lock, stats = step.lock, step.stats
        start = time.perf_counter()
        failures = Failures(self._rank_of, transport.rank)
        layout = outgoing = flats = None
        try:
            flats = [_flat(x) for x in tensors]
            layout = _Layout(flats, [_shape(x) for x in tensors],
                             self._topology(transport).local_size)
            outgoing = layout.scatter(flats, _layout_signature(layout.digest),
                                      self._topology(transport).local_rank)
        except (ValueError, TypeError) as exc:
            failures.fail(exc)
        prepared = time.perf_counter() - start

        def finish():
            groups = self._groups_of(transport)
            topology, intra, inter = groups
            return self._step(names, layout, flats, outgoing, topology, intra, inter, op,
                              as_rows, out, reuse_out, lock, stats, failures, prepared)
        return transport.submit(finish)

    def _step(self, names, layout, flats, outgoing, topology, intra, inter, op, as_rows, out,
              reuse_out, lock, stats, failures, prepared):
        traffic, timing = Traffic(), {"exchange": 0.0, "encode": prepared, "decode": 0.0}
        signature = _layout_signature("none" if layout is None else layout.digest)
        clock = time.perf_counter()
        # 1. inside the node: this rank's shard of every tensor, summed over the node
        received = failures.alltoall(intra, signature, outgoing or [b""] * intra.size,
                                     traffic, "node reduce-scatter", framed=True)
        shards = None
        if received is not None:
            shards = layout.reduce(received, topology.local_rank, flats)
        timing["exchange"] += time.perf_counter() - clock
        # 2. between nodes: the compressed exchange of the shard
        reduced, positions, between = self._between_nodes(
            names, layout, shards, topology, inter, lock, failures, traffic, timing)
        clock = time.perf_counter()
        # 3. inside the node: every reduced shard to every rank of the node
        body, own = b"", None
        if reduced is not None:
            body, own = pack_shards(reduced, 1.0 / topology.size if op == "average" else None,
                                    positions)
        gathered = failures.allgather(intra, signature, body, traffic, "node allgather")
        timing["exchange"] += time.perf_counter() - clock
        failures.raise_if_any()
        clock = time.perf_counter()
        segments = [own if j == topology.local_rank else
                    unpack_shards(frame, layout.segments(j)) for j, frame in enumerate(gathered)]
        stale = None
        if reuse_out and out is not None:
            stale = [self._written_out.pop((layout.digest, t), (None, None)) for t in
                     range(len(out))]
            stale = [where if out[t] is not None and memory == memory_of(out[t]) else None
                     for t, (memory, where) in enumerate(stale)]
        outputs, written = layout.assemble(segments, out, as_rows, stale)
        if reuse_out and out is not None:
            for t, where in enumerate(written):
                if where is not None and out[t] is not None:
                    self._written_out[layout.digest, t] = (memory_of(out[t]), where)
        timing["decode"] += time.perf_counter() - clock
        stats.record_step(StepStats(
            steps=1, tensors=len(outputs), compressed_tensors=between.compressed_tensors,
            bytes_sent=traffic.sent, bytes_received=traffic.received,
            dense_bytes=layout.dense_bytes, encode_seconds=timing["encode"],
            decode_seconds=timing["decode"], exchange_seconds=timing["exchange"],
            codec_seconds=between.codec_seconds))
        return outputs, traffic

    def _between_nodes(self, names, layout, shards, topology, inter, lock, failures, traffic,
                       timing):
        """Stage 2: the strategy between nodes (:class:`~deepreduce.exchange.strategy.Strategy`)
        on this rank's shards, over ``inter``: ``(reduced segments, where they may be
        non-zero, its step's stats)``; the segments None once anything failed."""
        inner, j = self._inner, topology.local_rank
        if not inner.carries_failures:
            # the ranks learn first whether all of them can go on, since the strategy runs
            # a sequence of collectives that a missing rank would leave waiting
            clock = time.perf_counter()
            ready = failures.allgather(inter, _STATUS_SIGNATURE, b"", traffic,
                                       "between nodes: status")
            timing["exchange"] += time.perf_counter() - clock
            if ready is None:
                return None, None, StepStats()
        targets = views = keys = None
        if shards is not None:
            # (the targets are last step's: only the positions it wrote are reset)
            targets = self._targets(layout, j)
            views = layout.shard_views(targets, j)
            keys = [f"{layout.digest}/{t}" for t in range(len(shards))]
        carry = CarriedStage(failures, _BUNDLES_SIGNATURE, "between nodes") \
            if inner.carries_failures else None
        recorded = CompressionStats()
        step = Step(names, shards, inter, "sum", [False] * len(names), views, True, lock,
                    recorded, out_keys=keys, carry=carry)
        try:
            outputs, inner_traffic = inner.start(step).result()
        except ValueError as exc:  # DecodeError included
            failures.fail(exc)
            return None, None, StepStats()
        traffic += inner_traffic
        if outputs is None:  # a failure, which `failures` holds
            return None, None, StepStats()
        done = recorded.last
        clock = time.perf_counter()
        # where the sums may be non-zero, as the strategy knows it: no pass over the shards
        written = [inner.written_positions(key, view) for key, view in zip(keys, views)]
        positions = layout.segment_positions(targets, j, written)
        timing["encode"] += done.encode_seconds
        timing["exchange"] += done.exchange_seconds
        timing["decode"] += done.decode_seconds + time.perf_counter() - clock
        return targets, positions, done

    def _targets(self, layout, j: int) -> list:
        """The arrays this rank's reduced segments are summed into: kept from step to step
        for the same tensors (the decode resets only what it wrote the step before)."""
        key = (layout.digest, j)
        targets = self._segments.get(key)
        if targets is None:
            targets = self._segments[key] = layout.empty_segments(j)
        return targets

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
        them whole: each residual is of this rank's shard of the node's sum, and the
        strategy between nodes pays it into this rank's shard of its gradient, so the
        dense sum over all ranks holds it once."""
        if not len(memory):
            return
        topology = self._topology(transport)
        owed = [(name, x.reshape(-1)) for name, x in zip(names, tensors)
                if name is not None and name in memory]
        shards = []
        for _, flat in owed:
            bounds = shard_bounds(flat.size, topology.local_size)
            shards.append(flat[bounds[topology.local_rank]:bounds[topology.local_rank + 1]])
        # (its residuals cover the whole of each shard: it needs no transport to place them)
        self._inner.pay(memory, [name for name, _ in owed], shards, None)

def _layout_signature(digest: str) -> str:
    return f"exchange=hierarchical;layout={digest}"


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

    def scatter(self, flats, signature: str, own: int) -> list:
        """Per local rank, a frame (:meth:`Failures.frame_buffer`) of the bytes of its
        segments cut from this rank's ``flats``; local rank ``own``'s (this rank's) is
        left empty: :meth:`reduce` reads its shards from ``flats``."""
        out = []
        for j in range(self.local_size):
            frame, buffer = Failures.frame_buffer(signature, 0 if j == own else sum(
                size * dtype.itemsize for size, dtype in self.segments(j)))
            if j == own:
                out.append(frame)
                continue
            pos = 0
            for dtype, ts in self.groups.items():
                segment = buffer[pos:pos + int(self.offsets[dtype][-1, j]) * dtype.itemsize] \
                    .view(dtype)
                for t, start in zip(ts, self.offsets[dtype][:-1, j].tolist()):
                    low, high = self.bounds[t, j], self.bounds[t, j + 1]
                    segment[start:start + high - low] = flats[t][low:high]
                pos += segment.nbytes
            out.append(frame)
        return out

    def reduce(self, received, j: int, flats) -> list:
        """Per tensor, its shard ``j`` summed over the node's ranks in local-rank order
        (in the tensor's dtype), from the other ranks' segment bytes ``received`` and this
        rank's ``flats``; the shards of one dtype are views of one segment."""
        shards, pos = [None] * len(self.dtypes), 0
        for dtype, ts in self.groups.items():
            size = int(self.offsets[dtype][-1, j])
            segments = [None if r == j else np.frombuffer(frame, dtype, size, pos)
                        for r, frame in enumerate(received)]
            total = np.empty(size, dtype)
            for t, start in zip(ts, self.offsets[dtype][:-1, j].tolist()):
                low, high = self.bounds[t, j], self.bounds[t, j + 1]
                parts = [flats[t][low:high] if segment is None else
                         segment[start:start + high - low] for segment in segments]
                shard = shards[t] = total[start:start + high - low]
                if len(parts) == 1:
                    shard[...] = parts[0]
                    continue
                np.add(parts[0], parts[1], out=shard)
                for part in parts[2:]:
                    shard += part
            pos += size * dtype.itemsize
        return shards

    def shard_views(self, segments, j: int) -> list:
        """Per tensor, the view of its shard ``j`` in ``segments`` (local rank ``j``'s)."""
        views = [None] * len(self.dtypes)
        for segment, (dtype, ts) in zip(segments, self.groups.items()):
            for t, start in zip(ts, self.offsets[dtype][:-1, j].tolist()):
                views[t] = segment[start:start + self.bounds[t, j + 1] - self.bounds[t, j]]
        return views

    def segment_positions(self, segments, j: int, written) -> list:
        """Per segment of local rank ``j``, where it may be non-zero, increasing: each
        tensor's ``written`` positions (None: found by a pass over its shard)."""
        out = []
        for segment, (dtype, ts) in zip(segments, self.groups.items()):
            bits = segment.view(np.dtype(f"u{dtype.itemsize}"))
            parts = []
            for t, start in zip(ts, self.offsets[dtype][:-1, j].tolist()):
                length = int(self.bounds[t, j + 1] - self.bounds[t, j])
                where = written[t]
                if where is None:
                    where = np.flatnonzero(bits[start:start + length])
                elif SUM_IMPLEMENTATION != "compiled":  # numpy's may repeat, unordered
                    where = np.unique(where)
                parts.append(where + start)
            out.append(np.concatenate(parts) if parts else np.zeros(0, np.int64))
        return out

    def assemble(self, segments, out, as_rows, stale=None) -> tuple[list, list]:
        """``(tensors, written)``: the whole tensors from every local rank's reduced
        ``segments`` (per local rank, a :class:`~deepreduce.exchange.topology.Segment`
        per dtype), written into ``out`` where given, and per tensor the positions written
        (None: the whole tensor may be). ``stale``: per ``out`` array, the positions outside
        which it is known to be zero (None: it is zeroed whole)."""
        results, written = [], []
        for t, (size, dtype) in enumerate(zip(self.sizes.tolist(), self.dtypes)):
            target = None if out is None or out[t] is None else out[t]
            written.append([])
            if target is None:
                results.append(np.zeros(size, dtype))
                continue
            if not isinstance(target, np.ndarray) or target.size != size \
                    or target.dtype != dtype or not target.flags.c_contiguous:
                raise ValueError(f"out must be a writable C-contiguous {dtype} array of "
                                 f"{size} elements")
            flat = target.reshape(-1)
            where = None if stale is None else stale[t]
            if where is None:
                flat.fill(0)
            else:
                flat[where] = 0
            results.append(flat)
        for j, per_rank in enumerate(segments):
            for entry, (dtype, ts) in zip(per_rank, self.groups.items()):
                starts = self.offsets[dtype][:, j]
                if entry.positions is None:  # dense: each tensor's piece
                    for t, start in zip(ts, starts[:-1].tolist()):
                        low, high = self.bounds[t, j], self.bounds[t, j + 1]
                        results[t][low:high] = entry.values[start:start + high - low]
                        written[t] = None
                    continue
                # sorted positions in the segment: each tensor's run of them
                cuts = np.searchsorted(entry.positions, starts).tolist()
                for t, start, low, high in zip(ts, starts[:-1].tolist(), cuts, cuts[1:]):
                    where = entry.positions[low:high] - start + self.bounds[t, j]
                    results[t][where] = entry.values[low:high]
                    if written[t] is not None:
                        written[t].append(where)
        written = [None if parts is None else
                   (np.concatenate(parts) if parts else np.zeros(0, np.int64))
                   for parts in written]
        for t, flat in enumerate(results):
            whole = flat.reshape(self.shapes[t])
            target = None if out is None else out[t]
            results[t] = nonzero_rows(whole) if as_rows[t] else \
                (target if target is not None else whole)
        return results, written

