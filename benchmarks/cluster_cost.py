"""Cost model of a cluster of nodes: two link classes, and the hierarchical scheme.

Ranks are numbered node by node, ``local_size`` per node (torchrun's numbering); a rank
reaches the others of its node over an intra-node link of its own (NVLink, PCIe, shared
memory) and the other nodes through the node's one network port, which the node's
``local_size`` ranks share. A :class:`Stage` is what one stage of an exchange moves on
each class; stages run one after the other, the two classes within a stage at once.

:mod:`deepreduce.collectives.cost` models one class of link (every rank alike); this
module places its schemes on nodes (:func:`flat_stages`) and adds the hierarchical
communicator's three stages (:func:`hierarchical_stages`). docs/multinode.md says what
the model predicts and how far to trust it. It serves :mod:`benchmarks.scale_nodes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deepreduce.collectives.cost import (FRAME_OVERHEAD, dense_allreduce, received_per_rank,
                                         union_size)

#: Schemes whose flat exchange runs as a ring (gloo's allreduce and allgather): with the
#: ranks numbered node by node, one of each ``local_size`` hops of the ring leaves a node.
RING = ("dense", "pairs", "allgather")
#: Bytes per position of a reduced shard sent sparse in the hierarchical scheme's last stage.
POSITION_BYTES = 4


@dataclass(frozen=True)
class Link:
    """One class of link: ``bandwidth`` bytes per second each way, ``latency`` seconds per
    message.

    Examples
    --------
    >>> Link(bandwidth=1e9, latency=1e-5).time(2e6, messages=3)
    0.00203
    """

    bandwidth: float
    latency: float = 0.0

    def time(self, nbytes: float, messages: int = 0) -> float:
        """Seconds to receive ``nbytes`` in ``messages`` messages one after the other."""
        return messages * self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Cluster:
    """Nodes of ``local_size`` ranks: an ``intra`` link per rank, one ``inter`` port per node.

    Examples
    --------
    >>> c = Cluster(8, intra=Link(100e9), inter=Link(25e9 / 8))
    >>> c.nodes(64)
    8
    """

    local_size: int
    intra: Link
    inter: Link

    def nodes(self, P: int) -> int:
        if P % self.local_size:
            raise ValueError(f"{P} ranks do not fill nodes of {self.local_size}")
        return P // self.local_size


@dataclass(frozen=True)
class Stage:
    """What one stage of an exchange moves: ``intra`` bytes one rank receives over its
    intra-node link, ``inter`` bytes the node's port receives (its ranks together; it
    sends as many), and the messages on each, one after the other.

    Examples
    --------
    >>> c = Cluster(2, intra=Link(10e9), inter=Link(1e9, latency=1e-4))
    >>> round(Stage(intra=1e6, inter=1e6, inter_messages=2).time(c), 6)  # the port is slower
    0.0012
    """

    intra: float = 0.0
    inter: float = 0.0
    intra_messages: int = 0
    inter_messages: int = 0

    def time(self, cluster: Cluster) -> float:
        """Seconds of the stage: the slower of the two classes, which move at once."""
        return max(cluster.intra.time(self.intra, self.intra_messages),
                   cluster.inter.time(self.inter, self.inter_messages))


def flat_stage(scheme: str, P: int, local_size: int, received: float, messages: int) -> Stage:
    """A flat exchange over ``P`` ranks, ``local_size`` per node, in which every rank
    receives ``received`` bytes in ``messages`` messages.

    A ring (:data:`RING`) with the ranks numbered node by node sends one of each
    ``local_size`` hops through a node's port: the port carries what one rank
    receives, and every other hop the intra link, each at once (a pipelined ring
    runs at the pace of its slowest hop). Any other scheme sends directly to each
    peer: ``(P - L) / (P - 1)`` of a rank's bytes come from other nodes, and the
    port carries that for all ``L = local_size`` ranks of the node.

    Examples
    --------
    >>> flat_stage("allgather", 16, 8, 1e6, 15)
    Stage(intra=1000000.0, inter=1000000.0, intra_messages=15, inter_messages=15)
    >>> flat_stage("sparse_allreduce", 16, 8, 1.5e6, 30).inter  # 8 ranks x 8/15 of theirs
    6400000.0
    >>> flat_stage("allgather", 8, 8, 1e6, 7).inter  # one node: nothing leaves it
    0.0
    """
    nodes = P // local_size
    if nodes <= 1:
        return Stage(intra=received, intra_messages=messages)
    if local_size == 1:
        return Stage(inter=received, inter_messages=messages)
    if scheme in RING:
        return Stage(intra=received, inter=received, intra_messages=messages,
                     inter_messages=messages)
    return Stage(intra=(local_size - 1) / (P - 1) * received,
                 inter=local_size * (P - local_size) / (P - 1) * received,
                 intra_messages=messages, inter_messages=messages)


def messages_per_rank(scheme: str, P: int) -> int:
    """Messages a rank receives one after the other: ``2 (P - 1)`` for a ring allreduce
    and the two stages of the owner-based schemes, ``P - 1`` for an allgather.

    Examples
    --------
    >>> messages_per_rank("dense", 8), messages_per_rank("allgather", 8)
    (14, 7)
    """
    return (P - 1) * (1 if scheme in ("pairs", "allgather") else 2)


def flat_stages(scheme: str, P: int, local_size: int, n: int, k: float, pair_bytes: float,
                block_size: int = 256, value_bytes: float = 4.0) -> list:
    """The one :class:`Stage` of ``scheme`` (:data:`SCHEMES`) over all ``P`` ranks, with
    :func:`received_per_rank`'s bytes.

    Examples
    --------
    >>> (stage,) = flat_stages("dense", 16, 8, 1_000_000, 0, 0)
    >>> stage.inter / 1e6  # a ring allreduce: 2 (P - 1) / P of the float32 gradient
    7.5
    """
    received = received_per_rank(scheme, P, n, k, pair_bytes, block_size, value_bytes)
    return [flat_stage(scheme, P, local_size, received, messages_per_rank(scheme, P))]


def reduced_shard_nonzeros(inter: str, nodes: int, shard: float, k: float,
                           block_size: int = 256) -> float:
    """Expected non-zeros of a shard of ``shard`` elements after the exchange between
    ``nodes`` nodes, each sending ``k`` of them: the union of their supports (whole
    blocks for ``"block"``), every element for ``"dense"``.

    Examples
    --------
    >>> round(reduced_shard_nonzeros("allgather", 4, 1e6, 1e4))  # 4 random supports of 1%
    39404
    """
    if inter == "dense":
        return float(shard)
    if inter == "block":
        return min(shard, union_size(shard / block_size, k / block_size, nodes) * block_size)
    return union_size(shard, k, nodes)


def hierarchical_stages(P: int, local_size: int, n: int, k: float, pair_bytes: float,
                        inter: str = "allgather", block_size: int = 256,
                        value_bytes: float = 2.0, dense_bytes: float = 4.0,
                        overhead: float = FRAME_OVERHEAD) -> list:
    """The three :class:`Stage` of ``communicator="hierarchical"``.

    With ``L = local_size`` ranks per node and ``N = P / L`` nodes, for a gradient of
    ``n`` elements of ``dense_bytes`` of which a rank would send ``k`` (density
    ``k / n``, which each rank keeps in its shard of ``n / L``):

    1. inside the node, a dense reduce-scatter (an alltoall): a rank receives
       ``(L - 1) / L * n * dense_bytes`` in ``L - 1`` messages;
    2. between nodes, ``inter`` (:data:`SCHEMES`, or ``"dense"`` for a ring
       allreduce of the shard) among the ``N`` ranks that hold the same shard:
       :func:`received_per_rank` of ``N`` ranks, ``n / L`` elements, ``k / L``
       sent, and the node's port carries that for its ``L`` ranks at once;
    3. inside the node, a ring allgather of the reduced shards: a rank receives
       ``L - 1`` shards, each dense or as positions and values, whichever is
       smaller (:func:`reduced_shard_nonzeros` non-zeros, :data:`POSITION_BYTES`
       each plus their values).

    Examples
    --------
    Two nodes of two ranks, a million float32 elements, 1% sent at 3 bytes each:

    >>> s1, s2, s3 = hierarchical_stages(4, 2, 1_000_000, 10_000, 3.0)
    >>> s1.intra, s2.inter, s2.inter_messages  # half the gradient; 2 ranks x 1 payload
    (2000000.0, 30200.0, 1)
    >>> round(s3.intra)  # the other shard: union of 2 supports of 5,000 in 500,000
    79640
    """
    nodes = P // local_size
    shard, k_shard = n / local_size, k / local_size
    first = Stage(intra=(local_size - 1) * shard * dense_bytes, intra_messages=local_size - 1)
    if inter == "dense":
        received = dense_allreduce(nodes, shard, dense_bytes).received
    else:
        received = received_per_rank(inter, nodes, shard, k_shard, pair_bytes, block_size,
                                     value_bytes)
    second = Stage(inter=local_size * received,
                   inter_messages=messages_per_rank(inter, nodes))
    nonzeros = reduced_shard_nonzeros(inter, nodes, shard, k_shard, block_size)
    one = min(nonzeros * (POSITION_BYTES + dense_bytes), shard * dense_bytes) + overhead
    third = Stage(intra=(local_size - 1) * one if local_size > 1 else 0.0,
                  intra_messages=local_size - 1)
    return [first, second, third]


def exchange_time(stages, cluster: Cluster) -> float:
    """Seconds on the wire of an exchange's stages, one after the other.

    Examples
    --------
    >>> c = Cluster(8, intra=Link(100e9), inter=Link(10e9 / 8))
    >>> n, k = 25_600_000, 256_000
    >>> flat = exchange_time(flat_stages("allgather", 64, 8, n, k, 3.0), c)
    >>> tiered = exchange_time(hierarchical_stages(64, 8, n, k, 3.0), c)
    >>> round(1e3 * flat, 1), round(1e3 * tiered, 1)
    (38.7, 5.3)
    """
    return sum(stage.time(cluster) for stage in stages)


def hierarchical_cpu(local_size: int, nodes: int, inter_fixed: float, inter_per_peer: float,
                     dense_fixed: float, dense_per_peer: float) -> float:
    """CPU seconds of a hierarchical step, from the flat schemes' terms.

    The dense stages inside the node cost what a dense allreduce's reduction
    costs among ``local_size`` ranks (``dense_fixed + (L - 1) *
    dense_per_peer``); the compressed exchange runs on a shard of ``1 / L`` of
    the gradient among ``nodes`` ranks, so its terms, which grow with the
    elements handled and the bytes of each peer's payload, shrink by ``L``.

    Examples
    --------
    >>> round(hierarchical_cpu(8, 16, 0.080, 0.020, 0.004, 0.001), 4)  # seconds
    0.0585
    """
    return dense_fixed + (local_size - 1) * dense_per_peer \
        + (inter_fixed + (nodes - 1) * inter_per_peer) / local_size


def powersgd_elements(shapes, rank: int = 1) -> int:
    """Elements PowerSGD allreduces per step: ``(rows + columns) * rank`` for each tensor
    of two or more dimensions (its matrix view: the first dimension by the rest), every
    element of the others (sent uncompressed), as the ``powerSGD_hook`` does.

    Examples
    --------
    >>> powersgd_elements([(64, 2048), (2048,), (2048, 10), (10,)])  # 2112 + 2048 + 2058 + 10
    6228
    """
    total = 0
    for shape in shapes:
        if len(shape) >= 2:
            rows = shape[0]
            total += (rows + math.prod(shape[1:])) * rank
        else:
            total += math.prod(shape)
    return total


def step_on(cluster: Cluster, stages, compute: float, cpu: float, overlap: bool) -> float:
    """Seconds of a step on ``cluster``: ``compute``, then the exchange's ``cpu`` work and
    its :func:`exchange_time`, overlapped (the longer of the two) or one after the other.

    Examples
    --------
    >>> c = Cluster(2, intra=Link(10e9), inter=Link(1e9))
    >>> step_on(c, [Stage(inter=2e7)], compute=0.01, cpu=0.015, overlap=True)
    0.03
    """
    wire = exchange_time(stages, cluster)
    return compute + (max(cpu, wire) if overlap else cpu + wire)
