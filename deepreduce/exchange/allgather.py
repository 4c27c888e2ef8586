"""The allgather exchange (DeepReduce's scheme): bundles to every rank, decoded and summed.

Every rank packs its gradients' payloads (one per gradient, or one per group of
small gradients of a dtype) into a bundle (:mod:`deepreduce.bundle`), the
bundles are allgathered whatever their lengths, and every rank splits them,
decodes every payload and sums in rank order, so all ranks end with
bit-identical results.

Why bundles rather than ``collectives.AllgatherReduce`` for training: the bundle
carries self-checking payloads of every dtype in one allgather, each gradient
gets its own error feedback and sparsifier (small ones go losslessly), a large
one its own payload and ``auto`` choice, and sparse gradients come back as the
rows any rank touched; ``AllgatherReduce`` fuses the gradients of one dtype into
a single payload. Both sum with the functions of :mod:`deepreduce.sums`.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import NamedTuple

import numpy as np

from deepreduce.bundle import check_holds, pack_bundle, split_bundles, split_shared
from deepreduce.collectives.signed import fail_collectively, signed_allgather
from deepreduce.collectives.transport import Traffic
from deepreduce.errors import DecodeError
from deepreduce.exchange.parallel import PARALLEL_BYTES, PARALLEL_ENTRIES, codec_threads, run_in_order
from deepreduce.exchange.stats import StepStats
from deepreduce.exchange.strategy import Step, Strategy
from deepreduce.pipeline import Pipeline, decode
from deepreduce.sparse import SparseTensor, zeros
from deepreduce.sums import returns_only_what_ranks_lack, scale_at, sum_sorted_into, sum_sparse

#: What a bundle travels behind over a transport (Horovod's graph path allgathers bare
#: bundles); ranks that fail to encode send an ERROR frame instead, so none waits.
BUNDLE_SIGNATURE = "exchange=bundles"

#: Compressed tensors below this many elements share payloads (see
#: :meth:`AllgatherExchange._shared_payloads`), of up to PAYLOAD_ELEMENTS elements
#: each; larger ones keep their own. A payload costs its header, its checksum and the
#: Python between its codec calls, which holds the GIL: a model of many small tensors
#: in a payload each spends much of its codec time there and gains nothing from a
#: second codec thread, while a few shared payloads cost almost no bytes more
#: (``benchmarks/codec_threads.py`` measures both; figures in docs/results.md).
SHARED_BELOW = 1 << 22
PAYLOAD_ELEMENTS = 1 << 22

#: Tensors below this many elements share payloads apart from larger ones, and a
#: payload of them is summed whole: its tensors are views of one sum (copied into the
#: caller's arrays where it gives them), one call for many small tensors. A larger
#: tensor is summed on its own, into an array of its own: aligned, so that TensorFlow
#: adopts it without a copy, rewritten next step where last step's entries were, and
#: with ``reuse_out`` written into the caller's array only where some rank sent an
#: entry.
SUMMED_WHOLE_BELOW = 1 << 16


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
    """:meth:`AllgatherExchange.encode`'s result: what to send, what the ranks will decode
    of it, and the encoding's stats."""

    sent: Sent
    stats: StepStats

    @property
    def bundle(self) -> bytes:
        return self.sent.bundle


@dataclasses.dataclass(frozen=True)
class Decoded:
    """:meth:`AllgatherExchange.decode`'s result: the reduced tensors and the decoding's
    stats."""

    tensors: list
    stats: StepStats


class _Coding(NamedTuple):
    """What one payload codes: its pipeline, the selection and the dense source (None for
    a sparse input)."""

    pipeline: Pipeline
    selected: SparseTensor
    dense: np.ndarray | None


class _Owners(NamedTuple):
    """Whose one payload is: the positions of its tensors, their shapes when they share
    it (else None), and the selections to settle with what it delivers (None: none)."""

    positions: list
    shapes: list | None
    selections: list | None


@dataclasses.dataclass
class _SharedPayload:
    """Tensors that travel in one payload (see :meth:`AllgatherExchange._shared_payloads`):
    ``members`` their ``(position, array)``; ``selects`` False when it goes losslessly."""

    selects: bool
    members: list

    @property
    def first(self) -> int:
        """The position of its first tensor: the one it travels with."""
        return self.members[0][0]


class AllgatherExchange(Strategy):
    """Encode one rank's gradients into a bundle; decode and sum the ranks' bundles.

    Parameters
    ----------
    selector : Selector
        The exchange's per-tensor step (pipelines, error feedback).
    codec_threads : int or None, default None
        Threads that code the payloads of a bundle and decode the ranks'
        (see :class:`~deepreduce.config.ExchangeConfig`); None: worked out from
        the cores and ranks of the host at the first step
        (:func:`~deepreduce.exchange.parallel.codec_threads`).

    Notes
    -----
    The caller (:class:`~deepreduce.exchange.GradientExchange`) serialises
    encodings; a decoding may run beside the next step's encoding, since the
    two share nothing but the sums kept for reuse, which only decoding touches.
    Besides :meth:`start`, the Horovod graph path calls :meth:`encode` and
    :meth:`decode` itself (the allgather runs inside the TensorFlow graph).
    """

    #: (what an exchange pickled before the setting existed reads: automatic)
    codec_threads = None
    #: The automatic setting's threads, once worked out (see :meth:`_codec_threads`).
    _automatic_threads = None

    def __init__(self, selector, codec_threads: int | None = None):
        self.selector = selector
        self.codec_threads = codec_threads
        pipeline = selector.pipeline
        # coding the selections of several tensors as one (indices offset, values
        # concatenated) delivers to each exactly what coding it alone would, so they
        # may share a payload
        self._selections_share = (
            returns_only_what_ranks_lack(pipeline)
            and all(getattr(codec, "seed", None) is None
                    for codec in (pipeline.index_codec, pipeline.value_codec)))
        self._sums = _ReusedSums()
        self._codec_seconds = 0.0

    def __getstate__(self):
        # the automatic setting is worked out again where the exchange is loaded
        state = dict(self.__dict__)
        state.pop("_automatic_threads", None)
        return state

    def _codec_threads(self) -> int:
        """``codec_threads(self.codec_threads)``; the automatic setting's worked out once
        (it reads the process's CPU affinity, the machine's cores and the environment,
        system calls that every encode and every decode would repeat)."""
        setting = self.codec_threads
        if setting is not None:
            return setting
        threads = self._automatic_threads
        if threads is None:
            threads = self._automatic_threads = codec_threads(None)
        return threads

    def _encode_timed(self, pipeline, selected, dense):
        """``pipeline.encode_sparse(selected, dense)``, adding the time of its codecs to
        ``_codec_seconds``."""
        start = time.perf_counter()
        try:
            return pipeline.encode_sparse(selected, dense)
        finally:
            self._codec_seconds += time.perf_counter() - start

    def start(self, step: Step):
        """Encode this rank's bundle now; allgather, decode and sum on the transport's
        thread (see :class:`~deepreduce.exchange.strategy.Strategy`)."""
        transport = step.transport
        try:
            with step.lock:
                encoded = self.encode_exact(step.tensors) if step.exact else \
                    self.encode(step.names, step.tensors)
        except (ValueError, TypeError) as exc:
            # the other ranks wait in the allgather: they get an ERROR frame and raise
            return transport.submit(fail_collectively, "allgather", transport,
                                    BUNDLE_SIGNATURE, exc)
        encode_end = time.perf_counter()

        def finish():
            traffic = Traffic()
            gathered = signed_allgather(transport, BUNDLE_SIGNATURE, encoded.bundle, traffic,
                                        "bundles")
            exchanged = StepStats(exchange_seconds=time.perf_counter() - encode_end)
            # no lock: decoding shares nothing with encoding (the next reduction's,
            # running meanwhile), and the transport thread decodes one at a time
            decoded = self.decode([gathered], transport.size, transport.rank,
                                  step.op == "average", step.as_rows, step.out, [encoded.sent],
                                  list(step.names) if step.reuse_out else None)
            # one record per exchange: exchanges may overlap, open/close pairs may not
            step.stats.record_step(encoded.stats + decoded.stats + exchanged)
            return decoded.tensors, traffic
        return transport.submit(finish)

    def encode_tensor(self, name, x) -> tuple[bytes, SparseTensor]:
        """``(payload, received)`` of one tensor, its error feedback settled."""
        selection = self.selector.select(name, x)
        payload, received = self._encode_timed(selection.pipeline, selection.selected,
                                               selection.dense)
        self.selector.settle(selection, received)
        return payload, received

    def encode(self, names, tensors) -> Encoded:
        """This rank's bundle of ``tensors`` (dense arrays or SparseTensors), with what the
        ranks will decode of each of its payloads and of each tensor.

        Every dense gradient's error feedback and selection come first, then the
        codecs, then the residuals' updates: if a codec raises, nothing is sent and
        every dense gradient's residual still holds all it owes.
        """
        start = time.perf_counter()
        self._codec_seconds = 0.0
        shared = self._shared_payloads(tensors)
        sharing = {t: group for group in shared for t, _ in group.members}
        slots, receiveds, sparse = [], [None] * len(tensors), []
        # Every dense tensor's error feedback and selection first, then the codecs
        # back to back, then the residuals: a codec call right after a pass over a
        # whole gradient and its residual finds its code and tables evicted from the
        # caches, and runs several times slower than warm. Per payload: its coding
        # (pipeline, selection, dense source), and whose it is (tensor positions,
        # their shapes when they share it, the selections to settle).
        # (the selections all at once, in the order the payloads take them: a selector
        # on a device then brings them to the host in one copy)
        requests = []
        for t, (name, x) in enumerate(zip(names, tensors)):
            group = sharing.get(t)
            if group is None:
                if not isinstance(x, SparseTensor):
                    requests.append((name, x))
            elif t == group.first and group.selects:
                requests += [(names[m], array) for m, array in group.members]
        selections = iter(self.selector.select_all(requests))
        codings, owners = [], []
        for t, (name, x) in enumerate(zip(names, tensors)):
            group = sharing.get(t)
            if group is not None and t != group.first:
                slots.append(slots[group.first])  # it travels with the group's first
                continue
            slots.append(len(codings))
            if group is not None:
                coding, owner = self._select_shared(group, selections)
            elif isinstance(x, SparseTensor):  # coded after the others, see below
                sparse.append((len(codings), t))
                coding, owner = None, _Owners([t], None, None)
            else:
                selection = next(selections)
                coding = _Coding(selection.pipeline, selection.selected, selection.dense)
                owner = _Owners([t], None, [selection])
            codings.append(coding)
            owners.append(owner)
        # Each payload's coding on its own: every tensor has its own pipeline (random
        # streams included), so on several threads they make the same bytes.
        pending = [i for i, coding in enumerate(codings) if coding is not None]
        coding_start = time.perf_counter()
        to_code = [codings[i] for i in pending]
        # (run_in_order codes on the caller's thread alone unless two codings reach
        # PARALLEL_ENTRIES: only then are the threads worth working out)
        threads = 1 if sum(coding.selected.nnz >= PARALLEL_ENTRIES for coding in to_code) < 2 \
            else self._threads(to_code)
        coded = run_in_order(_encode, to_code, threads,
                             cost=lambda coding: coding.selected.nnz, least=PARALLEL_ENTRIES)
        self._codec_seconds += time.perf_counter() - coding_start
        for i, result in zip(pending, coded):
            codings[i] = result
        # Sparse ones one at a time, their residuals settled at once: their error
        # feedback makes a dense sum each. (After the others: if a dense tensor's
        # coding raised, none of them was settled.)
        for i, t in sparse:
            codings[i] = self.encode_tensor(names[t], tensors[t])
        payloads, decoded, settles = [], [], []
        for (payload, received), (members, shapes, selections) in zip(codings, owners):
            payloads.append(payload)
            decoded.append(received)
            if shapes is None:
                parts = [received]
            elif selections:
                # (the index code is exact: the parts' indices are the selections')
                parts, low = [], 0
                for selection, shape in zip(selections, shapes):
                    high = low + selection.selected.nnz
                    parts.append(SparseTensor._trusted(
                        received.values[low:high], selection.selected.indices, shape))
                    low = high
            else:
                parts = split_shared(received, shapes)
            for t, part in zip(members, parts):
                receiveds[t] = part
            settles += zip(selections or (), parts)
        # (if a coding raised, nothing was sent: every dense tensor's residual still
        # holds its whole corrected gradient)
        self.selector.settle_all(settles)
        bundle = (pack_bundle(payloads, slots, [receiveds[t].shape for t in sorted(sharing)])
                  if shared else pack_bundle(payloads))
        min_size = self.selector.min_size
        stats = StepStats(steps=1, tensors=len(tensors),
                          compressed_tensors=sum(r.size >= min_size for r in receiveds),
                          bytes_sent=len(bundle),
                          dense_bytes=sum(r.size * r.dtype.itemsize for r in receiveds),
                          encode_seconds=time.perf_counter() - start,
                          codec_seconds=self._codec_seconds)
        return Encoded(Sent(bundle, decoded, receiveds), stats)

    def encode_exact(self, tensors) -> Encoded:
        """:meth:`encode` of a non-finite step (see
        :meth:`~deepreduce.exchange.GradientExchange.reduce_async`'s ``finite``): every
        tensor whole and exact in a payload of its own (the lossless pipeline of the
        small tensors), no error feedback, no draw from any random stream. The ranks'
        sums are then the dense sums in rank order: non-finite where those are."""
        start = time.perf_counter()
        payloads, receiveds = [], []
        for x in tensors:
            # (the lossless selection of the small tensors: it draws nothing, remembers nothing)
            selection = self.selector.select(None, x, lossless=True)
            payload, received = selection.pipeline.encode_sparse(selection.selected,
                                                                 selection.dense)
            payloads.append(payload)
            receiveds.append(received)
        bundle = pack_bundle(payloads)
        stats = StepStats(steps=1, tensors=len(tensors), bytes_sent=len(bundle),
                          dense_bytes=sum(r.size * r.dtype.itemsize for r in receiveds),
                          encode_seconds=time.perf_counter() - start, nonfinite_steps=1)
        return Encoded(Sent(bundle, receiveds, receiveds), stats)

    def _shared_payloads(self, tensors) -> list[_SharedPayload]:
        """The tensors that travel in a shared payload, one :class:`_SharedPayload` each.

        Per dtype, the dense tensors below ``min_size`` share a lossless payload
        (``selects`` False) and, when the codecs code each selection as they would
        alone, those from ``min_size`` to :data:`SHARED_BELOW` elements share
        payloads of their selections (``selects`` True), consecutive tensors of up
        to :data:`PAYLOAD_ELEMENTS` elements in all, those below
        :data:`SUMMED_WHOLE_BELOW` apart from the larger: two or more tensors a payload.
        Each of them then costs a slice of a payload instead of one (its header,
        checksum and codec calls, and decoding them again for every rank).
        """
        groups, min_size = {}, self.selector.min_size
        for t, x in enumerate(tensors):
            size = self.selector.size(x)
            if isinstance(x, SparseTensor) or size >= SHARED_BELOW or (
                    size >= min_size and not self._selections_share):
                continue
            array = self.selector.floating(x)
            selects = size >= min_size
            payloads = groups.setdefault(
                (selects, array.dtype, size >= SUMMED_WHOLE_BELOW), [[0, []]])
            if selects and payloads[-1][0] + size > PAYLOAD_ELEMENTS:
                payloads.append([0, []])
            payloads[-1][0] += size
            payloads[-1][1].append((t, array))
        return [_SharedPayload(selects, members) for (selects, *_), payloads in groups.items()
                for _, members in payloads if len(members) > 1]

    def _select_shared(self, shared: _SharedPayload, selections) -> tuple[_Coding, _Owners]:
        """``(coding, owners)`` of the payload ``shared`` (see :meth:`_shared_payloads`)
        (its ``owners.selections`` None when it is lossless). ``selections``: an iterator
        whose next ones are the members' (when they select)."""
        selects, members = shared.selects, shared.members
        shapes = [tuple(array.shape) for _, array in members]
        positions = [t for t, _ in members]
        if not selects:
            flat = np.concatenate([array.reshape(-1) for _, array in members])
            selection = self.selector.select(None, flat, lossless=True)
            return (_Coding(selection.pipeline, selection.selected, selection.dense),
                    _Owners(positions, shapes, None))
        # each tensor's own error feedback and selection, then one coding of them all
        own, values, indices, offset = [], [], [], 0
        for _, array in members:
            selection = next(selections)
            own.append(selection)
            values.append(selection.selected.values)
            indices.append(selection.selected.indices + offset)
            offset += self.selector.size(array)
        whole = SparseTensor._trusted(np.concatenate(values), np.concatenate(indices), (offset,))
        # (coded with its first tensor's pipeline, whose auto index codec remembers the
        # payload's last choice, see codecs/auto.py's RECHECK: its tensors are the same
        # from step to step)
        return _Coding(own[0].pipeline, whole, None), _Owners(positions, shapes, own)

    def _threads(self, codings) -> int:
        """The threads for ``codings`` (``(pipeline, ...)``): :attr:`codec_threads`, or one
        when two of them would draw from the same random stream (a codec with a
        ``step`` or an ``_rng`` in two pipelines), whose draws depend on the order."""
        threads = self._codec_threads()
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

    def written_positions(self, key, target: np.ndarray) -> np.ndarray | None:
        """Where the last :meth:`decode` with ``out_keys`` may have made ``target`` (the
        ``out`` array of the tensor keyed ``key``) non-zero, or None when it wrote it
        whole: increasing and distinct with the compiled sums, perhaps repeated and
        unordered with numpy's (see :func:`~deepreduce.sums.sum_sorted_into`)."""
        return self._sums.peek_written(key, target)

    def decode(self, groups, ranks, rank, average, as_rows, out, sent,
               out_keys=None) -> Decoded:
        """The tensors of the allgathered ``groups`` of bundles, summed.

        See :meth:`~deepreduce.exchange.GradientExchange.decode_groups` for the
        arguments. ``sent``: per group, the :class:`Sent` of this rank's bundle (see
        :meth:`encode`), or None. ``out_keys``: as
        :meth:`~deepreduce.exchange.GradientExchange.reduce_async`'s reuse_out,
        the name of each tensor, under which the positions written into its
        ``out`` are kept."""
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
        # a rank's own payloads are what it encoded, unless its bundle came back
        # changed (bytes(view) == bytes is one memcmp); every other payload is decoded,
        # all of them side by side
        reused = [own is not None and bytes(per_rank[rank].data) == own.bundle
                  for per_rank, own in zip(read, sent)]
        # what each allgather sums whole tells which payloads to split into their
        # tensors, on the decoding threads
        wholes, first = [], 0
        for per_rank in read:
            wholes.append(_summed_whole(per_rank, rank, first, as_rows))
            first += len(per_rank[rank].slots)
        tasks = [(payload, bundle if slot in bundle.shared() and slot not in whole else None,
                  slot)
                 for per_rank, own_reused, whole in zip(read, reused, wholes)
                 for r, bundle in enumerate(per_rank) if r != rank or not own_reused
                 for slot, payload in enumerate(bundle.payloads)]
        decodes = iter(run_in_order(_decode, tasks, self._codec_threads(),
                                    cost=lambda task: len(task[0]), least=PARALLEL_BYTES))
        units, first = [], 0
        for per_rank, own, own_reused, whole in zip(read, sent, reused, wholes):
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
        codec_seconds = time.perf_counter() - codec_start
        results = [None] * count
        scale = 1.0 / ranks if average else None
        # the sums into tensors on a device, all at once after the loop (the selector then
        # copies every part's pairs there together), and the copies out of shared payloads'
        # sums that follow them
        device_sums, after_sums = [], []
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
                                    results, device_sums, after_sums)
                continue
            i = positions[0]
            if as_rows[i]:
                results[i] = _sum_rows(parts, scale)
                continue
            if out is not None and out[i] is not None and not isinstance(out[i], np.ndarray):
                # a tensor on a device: the selector sums where it lives
                _check_holds_elements(out[i], reference.size, self.selector)
                device_sums.append((out[i], parts, scale))
                results[i] = out[i]
                continue
            # the sequential sum in the dtype, as Horovod's dense allreduce computes it,
            # straight into the dense result: no per-rank arrays, no union of supports
            accumulator = _accumulator(reference.dtype)
            target = None if out is None or out[i] is None else \
                _writable_flat(out[i], reference.size, reference.dtype)
            memory = None
            if target is not None and target.dtype == accumulator:
                total = target
                if out_keys is not None:  # (the same memory below: looked up once)
                    memory = _memory_of(target)
                stale = None if memory is None else self._sums.written(out_keys[i], memory)
                if stale is None:
                    total.fill(0)
            else:
                total, stale = self._sums.zeros(i, reference.size, accumulator)
            touched = sum_sorted_into(total, parts, scale, stale)
            result = total.astype(reference.dtype, copy=False)
            if target is None:
                self._sums.keep(i, total, touched)
            elif memory is not None:  # (total is target)
                self._sums.keep_written(out_keys[i], memory, touched)
            elif result is not target:
                np.copyto(target, result)
                result = target
            results[i] = result.reshape(reference.shape)
        if device_sums:
            self.selector.sum_into_device(device_sums)
        for copy_out in after_sums:
            copy_out()
        return Decoded(results, StepStats(bytes_received=received,
                                          decode_seconds=time.perf_counter() - start,
                                          codec_seconds=codec_seconds))

    def _reduce_shared(self, positions, shapes, parts, reference, scale, out, out_keys,
                       results, device_sums, after_sums) -> None:
        """Sum the ranks' ``parts`` of one shared payload at once, into ``results`` at
        ``positions``: views of one dense sum, or copies into ``out``. Tensors on a device
        add their sum to ``device_sums`` and the copies of its slices to ``after_sums``."""
        first = None if out is None else out[positions[0]]
        if first is not None and not isinstance(first, np.ndarray):
            # tensors on a device: one sum there, then each tensor's slice of it
            whole = first.new_empty(reference.size)
            device_sums.append((whole, parts, scale))
            for t, shape in zip(positions, shapes):
                _check_holds_elements(out[t], math.prod(shape), self.selector)
                results[t] = out[t]

            def copy_out():
                start = 0
                for t, shape in zip(positions, shapes):
                    size = math.prod(shape)
                    out[t].reshape(-1).copy_(whole[start:start + size])
                    start += size
            after_sums.append(copy_out)
            return
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
                    self._sums.forget_written(out_keys[t])
                result = out[t]
            results[t] = result


def _check_holds_elements(target, size: int, selector) -> None:
    if selector.size(target) != size:
        raise ValueError(f"out has {selector.size(target)} elements for a tensor of {size}")


def _encode(coding) -> tuple[bytes, SparseTensor]:
    pipeline, selected, dense = coding
    return pipeline.encode_sparse(selected, dense)


def _decode(task) -> tuple[SparseTensor, list | None]:
    """A payload's decoding and, where the task names its bundle, its tensors (on the
    decoding's thread: a split is work)."""
    payload, bundle, slot = task
    whole = decode(payload)
    return whole, None if bundle is None else bundle.split(slot, whole, overwrite=True)


def _writable_flat(array: np.ndarray, size: int, dtype: np.dtype) -> np.ndarray:
    """``array`` as a flat view, after checking that it can hold ``size`` values of
    ``dtype``."""
    if not isinstance(array, np.ndarray) or array.size != size or array.dtype != dtype \
            or not array.flags.c_contiguous or not array.flags.writeable:
        raise ValueError(f"out must be a writable C-contiguous {dtype} array of "
                         f"{size} elements")
    return array.reshape(-1)


def _summed_whole(bundles, rank: int, first: int, as_rows) -> dict:
    """The shared payloads of one allgather's ``bundles`` (one per rank) that are summed
    whole, with their tensors' positions: those every rank shares alike whose tensors are
    all below :data:`SUMMED_WHOLE_BELOW` elements, none reduced as rows. ``first``: the
    position of the first tensor."""
    reference = bundles[rank]
    if not all(b.slots == reference.slots and b.shapes == reference.shapes for b in bundles):
        return {}
    # (rows are reduced per tensor: the rows any rank touched)
    return {slot: ts for slot, ts in reference.shared().items()
            if not any(as_rows[first + t] for t in ts)
            and all(math.prod(reference.shapes[t]) < SUMMED_WHOLE_BELOW for t in ts)}


def _units(bundles, decoded, tensors, whole: dict, rank: int, first: int) -> list:
    """What one allgather's ``bundles`` (one per rank) hold, as ``(positions, shapes,
    parts)`` to reduce: one per tensor (``shapes`` None; ``tensors``, per rank, what each
    decoded to), and one per payload summed ``whole`` (its tensors' ``shapes``, the ranks'
    payloads ``decoded`` as ``parts``). ``first``: the position of the first tensor."""
    reference = bundles[rank]
    units = []
    for t, slot in enumerate(reference.slots):
        if slot not in whole:
            units.append(([first + t], None, [per_rank[t] for per_rank in tensors]))
        elif t == whole[slot][0]:
            shapes = [reference.shapes[m] for m in whole[slot]]
            check_holds(decoded[rank][slot], sum(math.prod(shape) for shape in shapes),
                        f"bundle of rank {rank}, payload {slot}")
            units.append(([first + m for m in whole[slot]], shapes, [d[slot] for d in decoded]))
    return units


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

    def written(self, key, memory: tuple) -> np.ndarray | None:
        """The positions :meth:`keep_written` recorded under ``key`` when the target array
        is the same ``memory`` (its :func:`_memory_of`) as then (else None: the whole
        array must be reset); the record is dropped."""
        last = self._written.pop(key, None)
        if last is not None and last[0] == memory:
            return last[1]
        return None

    def forget_written(self, key) -> None:
        """Drop the record under ``key`` (its array was written whole)."""
        self._written.pop(key, None)

    def keep_written(self, key, memory: tuple, touched: np.ndarray) -> None:
        """Remember that the array of ``memory`` (its :func:`_memory_of`) is zero but
        perhaps at ``touched``."""
        self._written[key] = (memory, touched)

    def peek_written(self, key, target: np.ndarray) -> np.ndarray | None:
        """What :meth:`written` would return, leaving the record in place."""
        last = self._written.get(key)
        return last[1] if last is not None and last[0] == _memory_of(target) else None


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
