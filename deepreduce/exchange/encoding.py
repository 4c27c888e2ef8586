"""The allgather strategy's encoding side: one rank's tensors to the payloads of its bundle.

:meth:`~deepreduce.exchange.gathering.GatheringExchange.encode` takes them through
these steps, in this order:

1. :func:`shared_payloads`: which tensors share a payload (small ones losslessly,
   mid-sized ones' selections when the codecs code each as they would alone);
2. :func:`select`: every dense tensor's error feedback and selection, in one call of
   the selector, and the :class:`Payload` of each payload of the bundle;
3. :func:`code`: the payloads' codecs, on the codec threads (a sparse tensor is coded
   after them, alone: :func:`encode_one`);
4. :func:`settle`: what the ranks will decode of each tensor, and error feedback
   settled with it, last: if a codec raises, nothing is sent and every dense tensor's
   residual still holds all it owes.

:class:`Sent` is what the encoder keeps of the bundle, so that decoding it again can
be skipped; :class:`Encoded` adds the encoding's stats.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import numpy as np

from deepreduce.bundle import pack_bundle, split_shared
from deepreduce.exchange.parallel import run_in_order
from deepreduce.exchange.stats import StepStats
from deepreduce.pipeline import Pipeline
from deepreduce.sparse import SparseTensor


@dataclasses.dataclass(frozen=True)
class Sent:
    """What the ranks decode of one bundle of this rank: kept by the encoder so that
    decoding it again here can be skipped (when it comes back unchanged).

    Attributes
    ----------
    bundle : bytes
    payloads : list of SparseTensor
        What each of its payloads decodes to.
    tensors : list of SparseTensor
        What each of its tensors decodes to.
    """

    bundle: bytes
    payloads: list
    tensors: list


@dataclasses.dataclass(frozen=True)
class Encoded:
    """:meth:`~deepreduce.exchange.gathering.GatheringExchange.encode`'s result: what to
    send, what the ranks will decode of it, and the encoding's stats."""

    sent: Sent
    stats: StepStats

    @property
    def bundle(self) -> bytes:
        return self.sent.bundle


@dataclasses.dataclass
class SharedPayload:
    """Tensors that travel in one payload (see :func:`shared_payloads`): ``members`` their
    ``(position, array)``; ``selects`` False when it goes losslessly."""

    selects: bool
    members: list

    @property
    def first(self) -> int:
        """The position of its first tensor: the one it travels with."""
        return self.members[0][0]


def shared_payloads(tensors, selector, selections_share: bool, *, shared_below: int,
                    payload_elements: int, summed_whole_below: int) -> list[SharedPayload]:
    """The tensors that travel in a shared payload, one :class:`SharedPayload` each.

    Per dtype, the dense tensors below ``selector.min_size`` share a lossless
    payload (``selects`` False) and, when ``selections_share`` (the codecs code
    each selection as they would alone), those from ``min_size`` to
    ``shared_below`` elements share payloads of their selections (``selects``
    True), consecutive tensors of up to ``payload_elements`` elements in all, those
    below ``summed_whole_below`` apart from the larger: two or more tensors a
    payload. Each of them then costs a slice of a payload instead of one (its
    header, checksum and codec calls, and decoding them again for every rank).

    Examples
    --------
    >>> import numpy as np
    >>> from deepreduce.config import ExchangeConfig
    >>> from deepreduce.exchange.selection import Selector
    >>> selector = Selector(ExchangeConfig(min_size=1024))
    >>> sizes = [10, 20, 5000, 6000, 1 << 22]
    >>> tensors = [np.ones(size, np.float32) for size in sizes]
    >>> shared = shared_payloads(tensors, selector, True, shared_below=1 << 22,
    ...                          payload_elements=1 << 22, summed_whole_below=1 << 16)
    >>> [(payload.selects, [t for t, _ in payload.members]) for payload in shared]
    [(False, [0, 1]), (True, [2, 3])]
    """
    groups, min_size = {}, selector.min_size
    for t, x in enumerate(tensors):
        size = selector.size(x)
        if isinstance(x, SparseTensor) or size >= shared_below or (
                size >= min_size and not selections_share):
            continue
        array = selector.floating(x)
        selects = size >= min_size
        payloads = groups.setdefault(
            (selects, array.dtype, size >= summed_whole_below), [[0, []]])
        if selects and payloads[-1][0] + size > payload_elements:
            payloads.append([0, []])
        payloads[-1][0] += size
        payloads[-1][1].append((t, array))
    return [SharedPayload(selects, members) for (selects, *_), payloads in groups.items()
            for _, members in payloads if len(members) > 1]


class Coding(NamedTuple):
    """What one payload's codecs code: ``pipeline.encode_sparse(selected, dense)`` (``dense``
    None for a sparse input)."""

    pipeline: Pipeline
    selected: SparseTensor
    dense: np.ndarray | None


@dataclasses.dataclass
class Payload:
    """One payload of the bundle being encoded: whose it is, what its codecs code, and,
    once coded, its bytes and what the ranks will decode of it.

    Attributes
    ----------
    positions : list of int
        The tensors it carries.
    shapes : list of tuple or None
        Their shapes, when they share it (None: one tensor's own payload).
    selections : list of Selection
        The selections that :func:`settle` finishes with what it delivers (none for
        a lossless shared payload, and for a sparse tensor, settled as it is coded).
    coding : Coding or None
        What its codecs code; None for a sparse tensor, coded after the others by
        :func:`encode_one`.
    data : bytes
        Once coded: the payload.
    received : SparseTensor
        Once coded: what the ranks decode of it.
    """

    positions: list
    shapes: list | None
    selections: list
    coding: Coding | None
    data: bytes | None = None
    received: SparseTensor | None = None


def select(names, tensors, shared: list[SharedPayload], selector) -> tuple[list, list]:
    """``(payloads, slots)``: the :class:`Payload` of each payload of the bundle of
    ``tensors``, in order, and per tensor the position of its payload.

    Every dense tensor's error feedback and selection come here, before any codec:
    a codec call right after a pass over a whole gradient and its residual finds its
    code and tables evicted from the caches, and runs several times slower than warm.
    The selections are asked for all at once, in the order the payloads take them: a
    selector on a device then brings them to the host in one copy.
    """
    sharing = {t: group for group in shared for t, _ in group.members}
    requests = []
    for t, (name, x) in enumerate(zip(names, tensors)):
        group = sharing.get(t)
        if group is None:
            if not isinstance(x, SparseTensor):
                requests.append((name, x))
        elif t == group.first and group.selects:
            requests += [(names[m], array) for m, array in group.members]
    selections = iter(selector.select_all(requests))
    payloads, slots = [], []
    for t, x in enumerate(tensors):
        group = sharing.get(t)
        if group is not None and t != group.first:
            slots.append(slots[group.first])  # it travels with the group's first
            continue
        slots.append(len(payloads))
        if group is not None:
            payloads.append(_select_shared(group, selections, selector))
        elif isinstance(x, SparseTensor):
            payloads.append(Payload([t], None, [], None))
        else:
            selection = next(selections)
            payloads.append(Payload([t], None, [selection], _coding(selection)))
    return payloads, slots


def _select_shared(shared: SharedPayload, selections, selector) -> Payload:
    """The :class:`Payload` of ``shared``. ``selections``: an iterator whose next ones
    are the members' (when they select)."""
    shapes = [tuple(array.shape) for _, array in shared.members]
    positions = [t for t, _ in shared.members]
    if not shared.selects:
        flat = np.concatenate([array.reshape(-1) for _, array in shared.members])
        selection = selector.select(None, flat, lossless=True)
        return Payload(positions, shapes, [], _coding(selection))
    # each tensor's own error feedback and selection, then one coding of them all
    own, values, indices, offset = [], [], [], 0
    for _, array in shared.members:
        selection = next(selections)
        own.append(selection)
        values.append(selection.selected.values)
        indices.append(selection.selected.indices + offset)
        offset += selector.size(array)
    whole = SparseTensor._trusted(np.concatenate(values), np.concatenate(indices), (offset,))
    # (coded with its first tensor's pipeline, whose auto index codec remembers the
    # payload's last choice, see codecs/index/auto.py's RECHECK: its tensors are the
    # same from step to step)
    return Payload(positions, shapes, own, Coding(own[0].pipeline, whole, None))


def _coding(selection) -> Coding:
    return Coding(selection.pipeline, selection.selected, selection.dense)


def code(payloads, threads, least: int) -> float:
    """Code every payload with a coding, in place; return the seconds it took.

    Each payload's coding on its own: every tensor has its own pipeline (random
    streams included), so on several threads they make the same bytes.
    ``threads``: a callable of the codings giving the codec threads (see
    :func:`distinct_streams`), asked only when two codings reach ``least`` entries
    (:func:`~deepreduce.exchange.parallel.run_in_order` codes on the caller's thread
    alone otherwise).
    """
    start = time.perf_counter()
    to_code = [payload for payload in payloads if payload.coding is not None]
    codings = [payload.coding for payload in to_code]
    if sum(coding.selected.nnz >= least for coding in codings) < 2:
        # one thread: the caller's, straight to the pipelines (no pool to go through)
        for payload, (pipeline, selected, dense) in zip(to_code, codings):
            payload.data, payload.received = pipeline.encode_sparse(selected, dense)
        return time.perf_counter() - start
    coded = run_in_order(_encode, codings, threads(codings),
                         cost=lambda coding: coding.selected.nnz, least=least)
    for payload, (data, received) in zip(to_code, coded):
        payload.data, payload.received = data, received
    return time.perf_counter() - start


def _encode(coding: Coding) -> tuple[bytes, SparseTensor]:
    pipeline, selected, dense = coding
    return pipeline.encode_sparse(selected, dense)


def distinct_streams(codings, threads: int) -> int:
    """``threads``, or one when two of the ``codings`` (``(pipeline, ...)`` each) would
    draw from the same random stream (a codec with a ``step`` or an ``_rng`` in two
    pipelines), whose draws depend on the order."""
    if threads == 1:
        return 1
    seen = set()
    for pipeline, *_ in codings:
        for codec in {id(c): c for c in (pipeline.index_codec, pipeline.value_codec)
                      if hasattr(c, "step") or hasattr(c, "_rng")}.values():
            if id(codec) in seen:
                return 1
            seen.add(id(codec))
    return threads


def encode_one(selector, name, x) -> tuple[bytes, SparseTensor, float]:
    """``(payload, received, codec seconds)`` of one tensor coded alone, its error
    feedback settled."""
    selection = selector.select(name, x)
    start = time.perf_counter()
    payload, received = selection.pipeline.encode_sparse(selection.selected, selection.dense)
    seconds = time.perf_counter() - start
    selector.settle(selection, received)
    return payload, received, seconds


def settle(payloads, count: int, selector) -> list[SparseTensor]:
    """What the ranks will decode of each of the ``count`` tensors, from its coded
    payload's; error feedback settled with it, all at once."""
    receiveds, settles = [None] * count, []
    for payload in payloads:
        parts = _parts(payload)
        for t, part in zip(payload.positions, parts):
            receiveds[t] = part
        settles += zip(payload.selections, parts)
    selector.settle_all(settles)
    return receiveds


def _parts(payload: Payload) -> list[SparseTensor]:
    """What the ranks will decode of each tensor of the coded ``payload``."""
    received = payload.received
    if payload.shapes is None:
        return [received]
    if not payload.selections:
        return split_shared(received, payload.shapes)
    # (the index code is exact: the parts' indices are the selections')
    parts, low = [], 0
    for selection, shape in zip(payload.selections, payload.shapes):
        high = low + selection.selected.nnz
        parts.append(SparseTensor._trusted(received.values[low:high],
                                           selection.selected.indices, shape))
        low = high
    return parts


def pack(payloads, slots, shared: list[SharedPayload], receiveds) -> bytes:
    """The bundle of the coded ``payloads``: with the tensors' ``slots`` and the shapes of
    those that share a payload, when any do."""
    data = [payload.data for payload in payloads]
    if not shared:
        return pack_bundle(data)
    positions = sorted(t for group in shared for t, _ in group.members)
    return pack_bundle(data, slots, [receiveds[t].shape for t in positions])
