"""Alpha-beta cost model of the communicators: bytes per rank and operations.

Every function returns a :class:`Cost` for one rank of ``P``, assuming the
index space splits evenly over the owners and the non-zeros spread evenly over
the index space (random supports). ``sent`` and ``received`` count what
:class:`~deepreduce.collectives.Traffic` measures: the bytes of the tensors a
rank hands to the collectives for the others and gets from the others. The
time estimate is ``ops * alpha_op + messages * alpha + received * beta``:
``alpha_op`` is the fixed price of one Horovod operation (its negotiation
round, about a millisecond with Gloo on one machine), ``alpha`` the latency of
one point-to-point message, ``beta`` seconds per byte. docs/collectives.md
derives each formula.

``index_bytes`` is bytes per index, either a number or a function of the
density of the index set (codecs spend fewer bits per index on denser sets);
:func:`entropy_index_bytes` is the lower bound, :func:`codec_index_bytes`
measures a codec.

Examples
--------
>>> from deepreduce.collectives import cost
>>> P, n, k = 4, 25_000_000, 250_000
>>> union = cost.union_size(n, k, P)
>>> round(union / n, 4)
0.0394
>>> ag = cost.allgather(P, n, k, index_bytes=1.2, value_bytes=4)
>>> sar = cost.sparse_allreduce(P, n, k, union, index_bytes=1.2, value_bytes=4)
>>> dense = cost.dense_allreduce(P, n, value_bytes=4)
>>> round(ag.received / 1e6, 2), round(sar.received / 1e6, 2), round(dense.received / 1e6)
(3.9, 4.82, 150)

Four random 1% supports barely overlap, so the split-allgather receives more
than the allgather, unless each owner returns to every rank only the entries
it lacks (``others``: the union of the other three supports); identical
supports halve the allgather's bytes:

>>> others = cost.union_size(n, k, P - 1)
>>> lacking = cost.sparse_allreduce(P, n, k, union, 1.2, 4, others=others)
>>> round(lacking.received / 1e6, 2)
3.87
>>> identical = cost.sparse_allreduce(P, n, k, k, index_bytes=1.2, value_bytes=4)
>>> round(identical.received / 1e6, 2)
1.95
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: Bytes around each frame: payload header and CRC, the frame kind, and the
#: 8-byte length the Horovod transport adds to allgathered frames. A
#: typical value for 1-D tensors; it only matters for tiny tensors.
FRAME_OVERHEAD = 40
#: Bytes of the signature on the first frame of a reduction.
SIGNATURE = 60
#: Default network of :func:`choose_algorithm` (``algorithm="auto"``): the fixed
#: price of one Horovod operation (its negotiation round: all that a tiny eager
#: allgather costs; ``benchmarks/e2e.py`` times one of 1 KB, docs/results.md), a
#: message latency, and seconds per byte (1 GB/s, a 10 Gb/s link after protocol
#: overheads).
ALPHA_OP, ALPHA, BETA = 1e-3, 1e-5, 1e-9
#: The algorithms of ``sparse_allreduce`` that :func:`choose_algorithm` weighs, in
#: the order that breaks ties.
ALGORITHMS = ("split", "recursive_doubling", "allgather")


@dataclass(frozen=True)
class Cost:
    """Predicted traffic of one rank in one reduction."""

    sent: float
    received: float
    ops: int          # Horovod operations (each pays one negotiation round)
    messages: int     # point-to-point messages per rank on the critical path

    def time(self, beta: float, alpha: float = 0.0, alpha_op: float = 0.0) -> float:
        """Seconds: ``ops * alpha_op + messages * alpha + received * beta``."""
        return self.ops * alpha_op + self.messages * alpha + self.received * beta


def _rate(index_bytes, density: float) -> float:
    return float(index_bytes(density) if callable(index_bytes) else index_bytes)


def union_size(n: int, k: float, P: int, shared: float = 0.0) -> float:
    """Expected non-zeros of a sum of ``P`` supports of ``k`` indices each out of ``n``.

    A fraction ``shared`` of every support is common to all ranks (1: identical
    supports); the rest is drawn uniformly at random, independently per rank.
    Disjoint supports give ``min(n, P * k)``, beyond this model.
    """
    if not 0.0 <= shared <= 1.0:
        raise ValueError(f"shared must be in [0, 1], got {shared}")
    common = shared * k
    free = n - common
    if free <= 0:
        return float(n)
    return common + free * (1.0 - (1.0 - (k - common) / free) ** P)


def union_of(n: int, counts) -> float:
    """Expected non-zeros of a sum of independent uniformly random supports of ``counts``.

    ``n (1 - prod(1 - k_r / n))``: each element is missed by every support
    independently. Correlated supports (shared hot rows) have smaller unions,
    disjoint ones larger (up to ``min(n, sum(counts))``).
    """
    if n <= 0:
        return 0.0
    missed = np.prod(1.0 - np.minimum(np.asarray(counts, dtype=np.float64), n) / n)
    return float(n * (1.0 - missed))


def allgather(P: int, n: int, k: float, index_bytes, value_bytes: float,
              overhead: float = FRAME_OVERHEAD + SIGNATURE) -> Cost:
    """Every rank's payload to every other rank: receive ``(P - 1)`` payloads.

    With Gloo's ring allgather the wire carries the same volume: each rank
    forwards ``P - 1`` payloads and receives ``P - 1``.
    """
    payload = k * (_rate(index_bytes, k / n if n else 0.0) + value_bytes) + overhead
    return Cost(sent=payload, received=(P - 1) * payload, ops=1, messages=P - 1)


#: The network a transport assumes when it weighs a variable-length allgather in one
#: collective against two (:func:`slot_capacity`): what one more collective costs, and a
#: 1 Gbit/s link. A second collective costs more than a bare round trip (gloo's 16-byte
#: allgather took 126 us across a veth at 1 Gbit/s, the lengths-first framing 0.24 ms
#: more per allgather than one padded collective, in the median, 0.68 ms in the mean:
#: ``benchmarks/results/outer.md``, framing part).
ROUND_TRIP, LINK_BYTES_PER_SECOND = 3e-4, 125e6

#: The capacities :func:`slot_capacity` weighs: the mean recent length plus these many
#: standard deviations of the recent lengths (and 0: the lengths alone first).
SLACK_DEVIATIONS = (-1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0)


def slot_capacity(recent, P: int, round_trip: float = ROUND_TRIP,
                  seconds_per_byte: float = 1 / LINK_BYTES_PER_SECOND, align: int = 64) -> int:
    """The bytes of each rank's frame that the first collective of a variable-length
    allgather carries (its *capacity*), the one with the least expected time.

    Collectives move equal-sized tensors, so each rank sends its frame's length (8 bytes)
    and its first ``c`` bytes, zero-padded, in one collective; what is longer than ``c``
    follows in a second one, at its exact size. A large ``c`` pads, a small one pays a
    second collective more often. ``recent`` holds the lengths of the recent frames of
    the same kind (every rank's), taken as normally distributed with their mean ``m``
    and standard deviation ``s``; each candidate ``c`` (0, and ``m + z s`` for ``z`` in
    :data:`SLACK_DEVIATIONS`, rounded up to ``align``) is weighed by its expected
    seconds::

        round_trip + (P - 1) (8 + c) beta + q(c) round_trip + (P - 1) tail(c) beta

    with ``beta`` = ``seconds_per_byte``, ``p(c)`` the chance that a frame is longer
    than ``c``, ``q(c) = 1 - (1 - p)^P`` that one of the P frames is (then every rank
    takes part in the second collective), and ``tail(c)`` a frame's expected bytes past
    ``c``. Ties go to the smaller capacity. A pure function of its arguments: ranks that
    saw the same lengths choose the same.

    Examples
    --------
    Frames of about 56 KB that vary by a hundred bytes: one collective, with a few
    hundred bytes of slack (0.5%) at 1 Gbit/s:

    >>> from deepreduce.collectives.cost import slot_capacity
    >>> recent = [56_100, 56_350, 56_200, 56_260, 56_180, 56_240]
    >>> slot_capacity(recent, 2)
    56512

    Frames that vary by half their size: padding would cost more than a second
    collective, so the lengths go first and every frame at its exact size:

    >>> slot_capacity([1_000_000, 1_500_000, 2_000_000, 1_200_000], 2)
    0

    Equal lengths fit exactly; no history, no slot (the lengths travel first):

    >>> slot_capacity([4800] * 6, 2), slot_capacity([], 2)
    (4800, 0)
    """
    # (a transport asks often, so scalar arithmetic on a few candidates:
    # numpy's calls on arrays this small cost more than the work)
    values = np.asarray(recent, dtype=np.float64).reshape(-1).tolist()
    if not values:
        return 0
    mean = sum(values) / len(values)
    spread = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    best, best_seconds = 0, None
    for z in (None, *SLACK_DEVIATIONS):
        c = 0 if z is None else int(-(-max(mean + z * spread, 0.0) // align) * align)
        if spread > 0:
            u = (c - mean) / spread
            p = 0.5 * math.erfc(u / _ROOT_TWO)
            tail = spread * (math.exp(-0.5 * u * u) / _ROOT_TWO_PI - u * p)  # E[(L - c)+]
        else:
            p, tail = float(c < mean), max(mean - c, 0.0)
        q = 1.0 - (1.0 - p) ** P
        seconds = (round_trip + (P - 1) * (8 + c) * seconds_per_byte + q * round_trip
                   + (P - 1) * tail * seconds_per_byte)
        if best_seconds is None or seconds < best_seconds or \
                (seconds == best_seconds and c < best):
            best, best_seconds = c, seconds
    return best


_ROOT_TWO, _ROOT_TWO_PI = math.sqrt(2.0), math.sqrt(2.0 * math.pi)


def _range_bytes(P, n, union, index_bytes, value_bytes, overhead):
    sparse = union / P * (_rate(index_bytes, union / n if n else 0.0) + value_bytes)
    return min(sparse, n / P * value_bytes) + overhead


def _owner_based(P, scatter, returned, one_range) -> Cost:
    """Scatter to the owners, then the return stage: per-rank frames or one allgathered range."""
    if returned is not None:  # an alltoall: a frame of what each rank lacks
        return Cost(sent=scatter + (P - 1) * returned, received=scatter + (P - 1) * returned,
                    ops=2, messages=2 * (P - 1))
    return Cost(sent=scatter + one_range, received=scatter + (P - 1) * one_range,
                ops=2, messages=2 * (P - 1))


def sparse_allreduce(P: int, n: int, k: float, union: float, index_bytes, value_bytes: float,
                     overhead: float = FRAME_OVERHEAD, others: float | None = None) -> Cost:
    """SSAR_Split_allgather with the dense switch (DSAR) per range.

    Scatter: ``(P - 1) / P`` of the own ``k`` entries leave, as much arrives.
    Return: without ``others``, the own reduced range (``union / P`` entries,
    or ``n / P`` dense values when smaller) goes out once and ``P - 1`` ranges
    arrive (an allgather). With ``others``, the expected non-zeros of the sum
    of the *other* ``P - 1`` supports, each owner sends every rank only the
    entries it lacks, ``others / P`` per range (an alltoall): what the
    communicator does when its codecs allow it
    (:func:`~deepreduce.sums.returns_only_what_ranks_lack`).
    """
    scatter = (P - 1) / P * k * (_rate(index_bytes, k / n if n else 0.0) + value_bytes) \
        + (P - 1) * (overhead + SIGNATURE)
    returned = None if others is None else \
        _range_bytes(P, n, others, index_bytes, value_bytes, overhead)
    return _owner_based(P, scatter, returned,
                        _range_bytes(P, n, union, index_bytes, value_bytes, overhead))


def block(P: int, n: int, block_size: int, blocks: float, union_blocks: float, index_bytes,
          value_bytes: float, overhead: float = FRAME_OVERHEAD,
          others_blocks: float | None = None) -> Cost:
    """OmniReduce-style blocks: ``blocks`` non-zero per rank, ``union_blocks`` after the sum.

    ``index_bytes`` is per block number, in the universe of ``ceil(n / block_size)``
    blocks. A block carries ``block_size`` values whatever its fill.
    ``others_blocks``, as ``others`` of :func:`sparse_allreduce`: the non-zero
    blocks of the sum of the other ``P - 1`` ranks, when each rank gets back
    only the blocks it lacks.
    """
    total = -(-n // block_size)

    def range_bytes(count):
        per_block = _rate(index_bytes, count / total if total else 0.0) \
            + block_size * value_bytes
        return min(count / P * per_block, n / P * value_bytes) + overhead

    per_block_in = _rate(index_bytes, blocks / total if total else 0.0) \
        + block_size * value_bytes
    scatter = (P - 1) / P * blocks * per_block_in + (P - 1) * (overhead + SIGNATURE)
    returned = None if others_blocks is None else range_bytes(others_blocks)
    return _owner_based(P, scatter, returned, range_bytes(union_blocks))


def dense_allreduce(P: int, n: int, value_bytes: float) -> Cost:
    """Ring allreduce (reduce-scatter + allgather): ``2 (P - 1) / P * n * value_bytes`` each way."""
    volume = 2 * (P - 1) / P * n * value_bytes
    return Cost(sent=volume, received=volume, ops=1, messages=2 * (P - 1))


def recursive_doubling(P: int, n: int, k: float, index_bytes, value_bytes: float,
                       shared: float = 0.0, overhead: float = FRAME_OVERHEAD) -> Cost:
    """SparCML's SSAR_Recursive_double (P a power of two), for comparison.

    In round ``i`` a rank swaps its partial sum, the union of ``2**i`` supports,
    with the rank ``2**i`` away: ``log2 P`` messages and, over Horovod, as many
    operations (each an alltoall that reaches all ``P - 1`` peers with Gloo).
    """
    if P < 1 or P & (P - 1):
        raise ValueError(f"recursive doubling needs a power-of-two P, got {P}")
    received = 0.0
    for i in range(int(math.log2(P))):
        union = union_size(n, k, 2 ** i, shared)
        sparse = union * (_rate(index_bytes, union / n if n else 0.0) + value_bytes)
        received += min(sparse, n * value_bytes) + overhead
    rounds = int(math.log2(P))
    # each round is an alltoall: Gloo posts a message to every peer, empty or not
    return Cost(sent=received, received=received, ops=rounds, messages=rounds * (P - 1))


def choose_algorithm(P: int, n: int, counts, index_bytes, value_bytes: float,
                     alpha_op: float = ALPHA_OP, alpha: float = ALPHA, beta: float = BETA,
                     per_rank_returns: bool = True):
    """The algorithm of ``sparse_allreduce`` with the least predicted time, and every cost.

    ``counts`` are the ranks' non-zeros; the union of the supports is
    estimated as if they were independent and uniformly random
    (:func:`union_of`): correlated supports overlap more, so the estimate
    favours the split-allgather less than it deserves, and a wrong estimate
    costs bytes, never correctness. Candidates: ``"split"``,
    ``"recursive_doubling"`` (P a power of two) and ``"allgather"``; the time
    is :meth:`Cost.time` with ``alpha_op``, ``alpha`` and ``beta``; equal times
    go to fewer bytes received, then to the order of :data:`ALGORITHMS`. A
    pure function of its arguments: ranks that agree on them choose the same.
    ``per_rank_returns``: whether the split's owners return to each rank only
    what it lacks (``others`` of :func:`sparse_allreduce`).

    Returns
    -------
    (str, dict)
        The chosen name and ``{name: Cost}`` of the candidates.

    Examples
    --------
    >>> name, costs = choose_algorithm(4, 25_000_000, [250_000] * 4, 1.0, 4)
    >>> name, round(costs["split"].received / costs["allgather"].received, 2)
    ('allgather', 0.99)
    >>> choose_algorithm(4, 25_000_000, [250_000] * 4, 1.0, 4, alpha_op=0, alpha=0)[0]
    'split'
    """
    k = float(np.mean(counts)) if len(counts) else 0.0
    others = None
    if per_rank_returns:
        others = float(np.mean([union_of(n, np.delete(counts, r)) for r in range(len(counts))]))
    costs = {"split": sparse_allreduce(P, n, k, union_of(n, counts), index_bytes, value_bytes,
                                       others=others)}
    if P & (P - 1) == 0:
        costs["recursive_doubling"] = recursive_doubling(P, n, k, index_bytes, value_bytes)
    costs["allgather"] = allgather(P, n, k, index_bytes, value_bytes)
    name = min(costs, key=lambda a: (costs[a].time(beta, alpha, alpha_op), costs[a].received,
                                     ALGORITHMS.index(a)))
    return name, costs


def entropy_index_bytes(density: float) -> float:
    """Information-theoretic bytes per index of a random set: H(density) / density / 8."""
    if density <= 0.0 or density >= 1.0:
        return 0.0
    entropy = -(density * math.log2(density) + (1 - density) * math.log2(1 - density))
    return entropy / density / 8


def codec_index_bytes(index_codec, universe: int, seed: int = 0, run: int = 1):
    """A function ``density -> bytes per index`` measured with ``index_codec``.

    It encodes one random set of that density in ``[0, universe)``; the
    communicators' ranges hold ``n / P`` elements, so pass that as ``universe``.
    With ``run > 1`` the set is made of aligned runs of ``run`` consecutive
    indices (whole blocks, embedding rows), which run-aware codecs code for
    almost nothing per index.
    """
    rng = np.random.default_rng(seed)

    def rate(density: float) -> float:
        runs = int(round(density * universe / run))
        if runs == 0:
            return 0.0
        starts = np.sort(rng.choice(universe // run, size=runs, replace=False)) * run
        indices = (starts[:, None] + np.arange(run)).reshape(-1).astype(np.int64)
        return len(index_codec.encode(indices, universe)) / indices.size

    return rate


# ----------------------------------------------------------------- whole steps

#: The schemes :func:`received_per_rank` and :func:`step_time` model: dense ring
#: allreduce of float32, raw Top-k pairs (int32 + float32) allgathered, and
#: deepreduce's payloads over the allgather, sparse_allreduce and block communicators.
SCHEMES = ("dense", "pairs", "allgather", "sparse_allreduce", "block")


def received_per_rank(scheme: str, P: int, n: int, k: float, pair_bytes: float,
                      block_size: int = 256, value_bytes: float = 4.0) -> float:
    """Bytes one rank receives per step under ``scheme`` (see :data:`SCHEMES`).

    ``n`` gradient elements of which each rank sends ``k`` (Top-k, or ``k /
    block_size`` whole blocks for ``"block"``), at ``pair_bytes`` per sent
    element on the wire (index and value codecs together; ignored by
    ``"dense"`` and ``"pairs"``, which send 4 and 8). ``value_bytes``: what
    the value codec spends on a value (4 for float32, 2 for fp16), which is
    what sparse_allreduce pays per element of a range it sends dense; a pair
    costs at least that. Supports are taken as independent and uniformly
    random, as everywhere in this module.

    >>> n, k = 2_000_000, 20_000
    >>> round(received_per_rank("allgather", 4, n, k, 3.0) / 1e3, 1)  # 3 payloads of k pairs
    180.3
    >>> round(received_per_rank("sparse_allreduce", 4, n, k, 3.0, value_bytes=2) / 1e3, 1)
    179.1
    """
    if scheme == "dense":
        return dense_allreduce(P, n, 4).received
    if scheme == "pairs":
        return allgather(P, n, k, 4, 4, overhead=0).received
    if scheme == "allgather":
        return allgather(P, n, k, pair_bytes, 0).received
    if scheme == "sparse_allreduce":
        if pair_bytes < value_bytes:
            raise ValueError(f"pair_bytes ({pair_bytes}) must be at least value_bytes "
                             f"({value_bytes}): a pair carries a value and an index")
        # a pair is an index and a value; a range sent dense costs the values alone
        return sparse_allreduce(P, n, k, union_size(n, k, P), pair_bytes - value_bytes,
                                value_bytes, others=union_size(n, k, P - 1)).received
    if scheme == "block":
        total, blocks = -(-n // block_size), k / block_size
        # a block's index is a few bits: its values carry the bytes
        return block(P, n, block_size, blocks, union_size(total, blocks, P), 0, pair_bytes,
                     others_blocks=union_size(total, blocks, P - 1)).received
    raise ValueError(f"unknown scheme {scheme!r}; expected one of {SCHEMES}")


def step_time(compute: float, cpu_fixed: float, cpu_per_peer: float, received: float,
              P: int, bandwidth: float, shared_link: bool = False, cpu_share: float = 1.0,
              overlap: bool = True) -> float:
    """Seconds of one training step: compute, then the exchange's CPU work and the wire.

    ``compute`` is the step without communication; ``cpu_fixed + (P - 1) *
    cpu_per_peer`` the CPU work of the exchange (error feedback, selection,
    encoding and sums, then decoding and adding each other rank's part);
    ``received`` the bytes one rank receives (:func:`received_per_rank`) at
    ``bandwidth`` bytes per second. With ``overlap`` the wire runs while the
    CPU works (a DDP hook encodes one bucket while the collectives move the
    last on their own thread), so the step takes the longer of the two after
    the compute; without, both add up (a ring allreduce, whose CPU work is
    its reduction). With ``shared_link`` all ranks' traffic crosses one link
    (ranks on one machine, as in the benchmarks here), so it carries ``P *
    received``; otherwise every rank has a full-duplex link of its own.
    ``cpu_share`` stretches the CPU work when ranks share cores (``P /
    cores`` when there are more ranks than cores; ``compute`` is then that
    of a rank with a core of its own, stretched alike by the caller).

    >>> step_time(0.010, 0.020, 0.001, 1e6, P=4, bandwidth=125e6)  # 1 Gbit/s
    0.033
    >>> round(step_time(0.010, 0.020, 0.001, 1e6, P=4, bandwidth=125e6, overlap=False), 3)
    0.041
    """
    wire = received * (P if shared_link else 1) / bandwidth
    cpu = cpu_share * (cpu_fixed + (P - 1) * cpu_per_peer)
    return compute + (max(cpu, wire) if overlap else cpu + wire)
