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
   node, decoded and summed in node order, as :mod:`deepreduce.exchange.gathering`
   does; or ``"sparse_allreduce"`` / ``"block"``, as
   :mod:`deepreduce.exchange.reducing` does);
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
from typing import NamedTuple

import numpy as np

from deepreduce.collectives import frames
from deepreduce.collectives.signed import check_peers
from deepreduce.collectives.transport import Traffic
from deepreduce.exchange.stats import CompressionStats, StepStats
from deepreduce.exchange.strategy import Step, Strategy
from deepreduce.exchange.shards import ShardLayout
from deepreduce.exchange.summing import memory_of
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


class _Groups(NamedTuple):
    """A transport's topology and the two transports split from it
    (:func:`~deepreduce.exchange.topology.node_transports`)."""

    topology: Topology
    intra: object
    inter: object


@dataclasses.dataclass
class _Prepared:
    """What the caller's thread prepares of a step: its names, its tensors as flat arrays,
    their :class:`ShardLayout` and the frames of the node's reduce-scatter (None after
    a failure), and the seconds it took."""

    names: list
    flats: list | None = None
    layout: ShardLayout | None = None
    outgoing: list | None = None
    seconds: float = 0.0


@dataclasses.dataclass
class _BetweenNodes:
    """Stage 2's result: this rank's reduced segments (None once anything failed), where
    they may be non-zero (None: anywhere), and the stats of the strategy's step."""

    segments: list | None = None
    positions: list | None = None
    stats: StepStats = dataclasses.field(default_factory=StepStats)


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
        transport, tensors = step.transport, list(step.tensors)
        start = time.perf_counter()
        failures = Failures(self._rank_of, transport.rank)
        prepared = _Prepared(list(step.names))
        try:
            topology = self._topology(transport)
            prepared.flats = [_flat(x) for x in tensors]
            prepared.layout = ShardLayout(prepared.flats, [_shape(x) for x in tensors],
                                           topology.local_size)
            prepared.outgoing = prepared.layout.scatter(
                prepared.flats, _layout_signature(prepared.layout.digest), topology.local_rank)
        except (ValueError, TypeError) as exc:
            failures.fail(exc)
        prepared.seconds = time.perf_counter() - start

        def finish():
            return self._step(step, prepared, self._groups_of(transport), failures)
        return transport.submit(finish)

    def _step(self, step: Step, prepared: _Prepared, groups: _Groups, failures: Failures):
        """The three stages, on the transport's thread."""
        topology, intra, layout, out = groups.topology, groups.intra, prepared.layout, step.out
        traffic = Traffic()
        timing = {"exchange": 0.0, "encode": prepared.seconds, "decode": 0.0}
        signature = _layout_signature("none" if layout is None else layout.digest)
        clock = time.perf_counter()
        # 1. inside the node: this rank's shard of every tensor, summed over the node
        received = failures.alltoall(intra, signature, prepared.outgoing or [b""] * intra.size,
                                     traffic, "node reduce-scatter", framed=True)
        shards = None
        if received is not None:
            shards = layout.reduce(received, topology.local_rank, prepared.flats)
        timing["exchange"] += time.perf_counter() - clock
        # 2. between nodes: the compressed exchange of the shard
        between = self._between_nodes(prepared.names, layout, shards, groups, step.lock,
                                      failures, traffic, timing)
        clock = time.perf_counter()
        # 3. inside the node: every reduced shard to every rank of the node
        body, own = b"", None
        if between.segments is not None:
            body, own = pack_shards(between.segments,
                                    1.0 / topology.size if step.op == "average" else None,
                                    between.positions)
        gathered = failures.allgather(intra, signature, body, traffic, "node allgather")
        timing["exchange"] += time.perf_counter() - clock
        failures.raise_if_any()
        clock = time.perf_counter()
        segments = [own if j == topology.local_rank else
                    unpack_shards(frame, layout.segments(j)) for j, frame in enumerate(gathered)]
        reusing = step.reuse_out and out is not None
        stale = None
        if reusing:
            stale = [self._written_out.pop((layout.digest, t), (None, None)) for t in
                     range(len(out))]
            stale = [where if out[t] is not None and memory == memory_of(out[t]) else None
                     for t, (memory, where) in enumerate(stale)]
        outputs, written = layout.assemble(segments, out, step.as_rows, stale)
        if reusing:
            for t, where in enumerate(written):
                if where is not None and out[t] is not None:
                    self._written_out[layout.digest, t] = (memory_of(out[t]), where)
        timing["decode"] += time.perf_counter() - clock
        step.stats.record_step(StepStats(
            steps=1, tensors=len(outputs), compressed_tensors=between.stats.compressed_tensors,
            bytes_sent=traffic.sent, bytes_received=traffic.received,
            dense_bytes=layout.dense_bytes, encode_seconds=timing["encode"],
            decode_seconds=timing["decode"], exchange_seconds=timing["exchange"],
            codec_seconds=between.stats.codec_seconds))
        return outputs, traffic

    def _between_nodes(self, names, layout, shards, groups: _Groups, lock, failures, traffic,
                       timing) -> _BetweenNodes:
        """Stage 2: the strategy between nodes (:class:`~deepreduce.exchange.strategy.Strategy`)
        on this rank's shards, over ``groups.inter``."""
        inner, inter, j = self._inner, groups.inter, groups.topology.local_rank
        if not inner.carries_failures:
            # the ranks learn first whether all of them can go on, since the strategy runs
            # a sequence of collectives that a missing rank would leave waiting
            clock = time.perf_counter()
            ready = failures.allgather(inter, _STATUS_SIGNATURE, b"", traffic,
                                       "between nodes: status")
            timing["exchange"] += time.perf_counter() - clock
            if ready is None:
                return _BetweenNodes()
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
            return _BetweenNodes()
        traffic += inner_traffic
        if outputs is None:  # a failure, which `failures` holds
            return _BetweenNodes()
        done = recorded.last
        clock = time.perf_counter()
        # where the sums may be non-zero, as the strategy knows it: no pass over the shards
        written = [inner.written_positions(key, view) for key, view in zip(keys, views)]
        positions = layout.segment_positions(targets, j, written,
                                             distinct=SUM_IMPLEMENTATION == "compiled")
        timing["encode"] += done.encode_seconds
        timing["exchange"] += done.exchange_seconds
        timing["decode"] += done.decode_seconds + time.perf_counter() - clock
        return _BetweenNodes(targets, positions, done)

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
            return groups.topology
        return Topology(transport.size, resolve_local_size(self.local_size), transport.rank)

    def prepare(self, transport) -> None:
        """Agree on the topology and make the sub-groups of ``transport`` now (on its
        communication thread, every rank), not at its first step: an integration that
        binds its process groups at one moment makes these then too."""
        self._groups_of(transport)

    def _groups_of(self, transport) -> _Groups:
        """The :class:`_Groups` of ``transport``: agreed on and split at its first step, on
        its communication thread, by every rank."""
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
        groups = self._groups[transport] = _Groups(topology, *node_transports(transport,
                                                                               topology))
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
