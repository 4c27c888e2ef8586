"""The allgather strategy's decoding side: the ranks' bundles to the parts each sum adds up.

:meth:`~deepreduce.exchange.gathering.GatheringExchange.decode` takes the
allgathered bundles through these steps, in this order:

1. :func:`read`: the bundles of every allgather, one per rank, and the bytes
   received; every rank must send as many tensors as this one;
2. :func:`decode_units`: every payload decoded (this rank's own reused when its
   bundle came back unchanged), side by side on the codec threads, and grouped into
   :class:`Unit`: one per tensor, or one per shared payload summed whole;

then :func:`~deepreduce.exchange.summing.sum_units` sums each unit in rank order.
:class:`Decoded` is the result.
"""

from __future__ import annotations

import dataclasses
import math

from deepreduce.bundle import check_holds, split_bundles
from deepreduce.errors import DecodeError
from deepreduce.exchange.parallel import run_in_order
from deepreduce.exchange.stats import StepStats
from deepreduce.pipeline import decode
from deepreduce.sparse import SparseTensor


@dataclasses.dataclass(frozen=True)
class Decoded:
    """:meth:`~deepreduce.exchange.gathering.GatheringExchange.decode`'s result: the
    reduced tensors and the decoding's stats."""

    tensors: list
    stats: StepStats


@dataclasses.dataclass(frozen=True)
class Unit:
    """What one sum adds up: every rank's part of the same tensors.

    Attributes
    ----------
    positions : list of int
        The step's tensors it gives: one, or those of a shared payload summed whole.
    shapes : list of tuple or None
        For a shared payload, its tensors' shapes (None: one tensor, of its parts' shape).
    parts : list of SparseTensor
        Per rank, in rank order, what it decoded to.
    """

    positions: list
    shapes: list | None
    parts: list


def read(groups, ranks: int, rank: int) -> tuple[list, int, int]:
    """``(bundles, received, count)``: per allgather of ``groups`` (the concatenated
    bundles or one per rank), its :class:`~deepreduce.bundle.Bundle` of each rank; the
    bytes received; and the tensors each rank sent.

    Raises
    ------
    DecodeError
        When an allgather holds bundles of another number of ranks, or a rank sent
        another number of tensors than ``rank``.
    """
    bundles, received = [], 0
    for gathered in groups:
        if isinstance(gathered, (list, tuple)):
            if len(gathered) != ranks:
                raise DecodeError(f"{len(gathered)} bundles for {ranks} ranks")
            bundles.append([split_bundles(bundle, 1)[0] for bundle in gathered])
            received += sum(memoryview(bundle).nbytes for bundle in gathered)
        else:
            bundles.append(split_bundles(gathered, ranks))
            received += memoryview(gathered).nbytes
    counts = [sum(len(per_rank[r].slots) for per_rank in bundles) for r in range(ranks)]
    count = counts[rank]
    for r, tensors in enumerate(counts):
        if tensors != count:
            raise DecodeError(f"rank {r} sent {tensors} tensors, rank {rank} sent "
                              f"{count}: every rank must reduce the same gradients")
    return bundles, received, count


def decode_units(bundles, sent, rank: int, as_rows, threads: int, least: int,
                 summed_whole_below: int) -> list[Unit]:
    """The :class:`Unit` of every tensor of ``bundles`` (from :func:`read`), in order.

    ``sent``: per allgather, the :class:`~deepreduce.exchange.encoding.Sent` of this
    rank's bundle, or None. ``threads``, ``least``: as
    :func:`~deepreduce.exchange.parallel.run_in_order` takes them (``least`` in bytes of
    payload). The shared payloads of an allgather that every rank shares alike, whose
    tensors are all below ``summed_whole_below`` elements and none reduced as rows, are
    summed whole: one unit each.
    """
    # a rank's own payloads are what it encoded, unless its bundle came back
    # changed (bytes(view) == bytes is one memcmp); every other payload is decoded,
    # all of them side by side
    reused = [own is not None and bytes(per_rank[rank].data) == own.bundle
              for per_rank, own in zip(bundles, sent)]
    # what each allgather sums whole tells which payloads to split into their
    # tensors, on the decoding threads
    wholes, first = [], 0
    for per_rank in bundles:
        wholes.append(_summed_whole(per_rank, rank, first, as_rows, summed_whole_below))
        first += len(per_rank[rank].slots)
    tasks = [(payload, bundle if slot in bundle.shared() and slot not in whole else None,
              slot)
             for per_rank, own_reused, whole in zip(bundles, reused, wholes)
             for r, bundle in enumerate(per_rank) if r != rank or not own_reused
             for slot, payload in enumerate(bundle.payloads)]
    decodes = iter(run_in_order(_decode, tasks, threads, cost=lambda task: len(task[0]),
                                least=least))
    units, first = [], 0
    for per_rank, own, own_reused, whole in zip(bundles, sent, reused, wholes):
        decoded, tensors = [], []
        for r, bundle in enumerate(per_rank):
            if r == rank and own_reused:
                decoded.append(own.payloads)
                tensors.append(own.tensors)
                continue
            results = [next(decodes) for _ in bundle.payloads]
            decoded.append([payload for payload, _ in results])
            tensors.append(bundle.tensors(decoded[-1], whole, {
                slot: parts for slot, (_, parts) in enumerate(results) if parts is not None}))
        units += _units(per_rank, decoded, tensors, whole, rank, first)
        first += len(per_rank[rank].slots)
    return units


def _decode(task) -> tuple[SparseTensor, list | None]:
    """A payload's decoding and, where the task names its bundle, its tensors (on the
    decoding's thread: a split is work)."""
    payload, bundle, slot = task
    whole = decode(payload)
    return whole, None if bundle is None else bundle.split(slot, whole, overwrite=True)


def _summed_whole(bundles, rank: int, first: int, as_rows, below: int) -> dict:
    """The shared payloads of one allgather's ``bundles`` (one per rank) that are summed
    whole, with their tensors' positions: those every rank shares alike whose tensors are
    all below ``below`` elements, none reduced as rows. ``first``: the position of the
    first tensor."""
    reference = bundles[rank]
    if not all(b.slots == reference.slots and b.shapes == reference.shapes for b in bundles):
        return {}
    # (rows are reduced per tensor: the rows any rank touched)
    return {slot: ts for slot, ts in reference.shared().items()
            if not any(as_rows[first + t] for t in ts)
            and all(math.prod(reference.shapes[t]) < below for t in ts)}


def _units(bundles, decoded, tensors, whole: dict, rank: int, first: int) -> list[Unit]:
    """The units of one allgather's ``bundles`` (one per rank): one per tensor
    (``tensors``, per rank, what each decoded to), and one per payload summed ``whole``
    (the ranks' payloads ``decoded`` as its parts). ``first``: the position of the first
    tensor."""
    reference = bundles[rank]
    units = []
    for t, slot in enumerate(reference.slots):
        if slot not in whole:
            units.append(Unit([first + t], None, [per_rank[t] for per_rank in tensors]))
        elif t == whole[slot][0]:
            shapes = [reference.shapes[m] for m in whole[slot]]
            check_holds(decoded[rank][slot], sum(math.prod(shape) for shape in shapes),
                        f"bundle of rank {rank}, payload {slot}")
            units.append(Unit([first + m for m in whole[slot]], shapes,
                              [d[slot] for d in decoded]))
    return units
