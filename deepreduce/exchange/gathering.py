"""The allgather strategy (DeepReduce's scheme): bundles to every rank, decoded and summed.

Every rank packs its gradients' payloads (one per gradient, or one per group of
small gradients of a dtype) into a bundle (:mod:`deepreduce.bundle`), the
bundles are allgathered whatever their lengths, and every rank splits them,
decodes every payload and sums in rank order, so all ranks end with
bit-identical results. One step, as :class:`GatheringExchange` runs it:

1. encode, on the caller's thread (:mod:`~deepreduce.exchange.encoding`): which
   tensors share a payload, error feedback and selection, the codecs, the residuals;
2. allgather the bundles, on the transport's thread;
3. decode (:mod:`~deepreduce.exchange.decoding`) and sum
   (:mod:`~deepreduce.exchange.summing`) there.

This module holds the thresholds those steps follow. Why bundles rather than
``collectives.AllgatherReduce`` for training: the bundle carries self-checking
payloads of every dtype in one allgather, each gradient gets its own error feedback
and sparsifier (small ones go losslessly), a large one its own payload and ``auto``
choice, and sparse gradients come back as the rows any rank touched;
``AllgatherReduce`` fuses the gradients of one dtype into a single payload. Both sum
with the functions of :mod:`deepreduce.sums`.
"""

from __future__ import annotations

import time

from deepreduce.bundle import pack_bundle
from deepreduce.collectives.signed import fail_collectively, signed_allgather
from deepreduce.collectives.transport import Traffic
from deepreduce.exchange import encoding
from deepreduce.exchange.decoding import Decoded, decode_units, read
from deepreduce.exchange.encoding import (Encoded, Sent, distinct_streams, encode_one,
                                         shared_payloads)
from deepreduce.exchange.parallel import PARALLEL_BYTES, PARALLEL_ENTRIES, codec_threads
from deepreduce.exchange.stats import StepStats
from deepreduce.exchange.strategy import Step, Strategy
from deepreduce.exchange.summing import ReusedSums, sum_units
from deepreduce.sparse import SparseTensor
from deepreduce.sums import returns_only_what_ranks_lack

#: What a bundle travels behind over a transport (Horovod's graph path allgathers bare
#: bundles); ranks that fail to encode send an ERROR frame instead, so none waits.
BUNDLE_SIGNATURE = "exchange=bundles"

#: Compressed tensors below this many elements share payloads (see
#: :func:`~deepreduce.exchange.encoding.shared_payloads`), of up to PAYLOAD_ELEMENTS
#: elements each; larger ones keep their own. A payload costs its header, its checksum
#: and the Python between its codec calls, which holds the GIL: a model of many small
#: tensors in a payload each spends much of its codec time there and gains nothing from
#: a second codec thread, while a few shared payloads cost almost no bytes more
#: (``benchmarks/codec_threads.py`` measures both; figures in docs/results.md).
SHARED_BELOW = 1 << 22
PAYLOAD_ELEMENTS = 1 << 22

#: Tensors below this many elements share payloads apart from larger ones, and a
#: payload of them is summed whole: its tensors are views of one sum (copied into the
#: caller's arrays where it gives them), one call for many small tensors. A larger
#: tensor is summed on its own, into an array of its own: aligned, so that TensorFlow
#: adopts it without a copy, rewritten next step where last step's entries were, and
#: with ``reuse_out`` written into the caller's array only where some rank sent an
#: entry (see :mod:`~deepreduce.exchange.summing`).
SUMMED_WHOLE_BELOW = 1 << 16


__all__ = ["GatheringExchange", "BUNDLE_SIGNATURE", "Decoded", "Encoded", "Sent"]


def bundle_stage(names) -> str:
    """The stage of the allgather of a step's bundles over tensors of ``names`` (the same
    on every rank: every rank names the same tensors in the same order).

    >>> bundle_stage(["0.weight", "0.bias"]), bundle_stage([None]), bundle_stage([])
    ('bundles (2 tensors from 0.weight)', 'bundles (1 tensors from None)', 'bundles')
    """
    return f"bundles ({len(names)} tensors from {names[0]})" if len(names) else "bundles"


class GatheringExchange(Strategy):
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
    #: A step's one allgather carries a failure that ``step.carry`` records.
    carries_failures = True

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
        self._sums = ReusedSums()

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

    def _threads(self, codings) -> int:
        """The codec threads for ``codings`` (``(pipeline, ...)`` each): one where two
        share a random stream (:func:`~deepreduce.exchange.encoding.distinct_streams`)."""
        return distinct_streams(codings, self._codec_threads())

    # -- one step ----------------------------------------------------------------------
    def start(self, step: Step):
        """Encode this rank's bundle now; allgather, decode and sum on the transport's
        thread (see :class:`~deepreduce.exchange.strategy.Strategy`)."""
        transport, carry = step.transport, step.carry
        encoded = error = None
        if carry is None or not carry.failed:
            try:
                with step.lock:
                    encoded = self.encode_exact(step.tensors) if step.exact else \
                        self.encode(step.names, step.tensors)
            except (ValueError, TypeError) as exc:
                error = exc
        encode_end = time.perf_counter()
        out_keys = None if not step.reuse_out else \
            list(step.names) if step.out_keys is None else step.out_keys

        # a stage of its own for the bundles of each set of tensors (a DDP bucket, a
        # fragment of the model): a transport that frames a stage after its recent
        # frames (TorchTransport's slots) then follows each set's bundles apart
        stage = bundle_stage(step.names)

        def finish():
            traffic = Traffic()
            bundle = b"" if encoded is None else encoded.bundle
            if carry is not None:
                gathered = carry.allgather(transport, bundle, traffic, error)
                if gathered is None:  # a failure, which the larger reduction carries on
                    return None, traffic
            elif error is not None:
                # the other ranks wait in the allgather: they get an ERROR frame and raise
                fail_collectively("allgather", transport, BUNDLE_SIGNATURE, error,
                                  stage=stage)
            else:
                gathered = signed_allgather(transport, BUNDLE_SIGNATURE, bundle, traffic,
                                            stage)
            exchanged = StepStats(exchange_seconds=time.perf_counter() - encode_end)
            # no lock: decoding shares nothing with encoding (the next reduction's,
            # running meanwhile), and the transport thread decodes one at a time
            decoded = self.decode([gathered], transport.size, transport.rank,
                                  step.op == "average", step.as_rows, step.out, [encoded.sent],
                                  out_keys)
            # one record per exchange: exchanges may overlap, open/close pairs may not;
            # the bytes sent are the transport's (slots, lengths, signature), the
            # bundle's own beside them
            recorded = encoded.stats + decoded.stats + exchanged
            recorded.framing_bytes = traffic.sent - recorded.bytes_sent
            recorded.bytes_sent, recorded.bytes_received = traffic.sent, traffic.received
            step.stats.record_step(recorded)
            return decoded.tensors, traffic
        return transport.submit(finish)

    def written_positions(self, key, target):
        """Where the last :meth:`decode` with ``out_keys`` may have made ``target`` (the
        ``out`` array of the tensor keyed ``key``) non-zero, or None when it wrote it
        whole: increasing and distinct with the compiled sums, perhaps repeated and
        unordered with numpy's (see :func:`~deepreduce.sums.sum_sorted_into`)."""
        return self._sums.peek_written(key, target)

    # -- the encoding side -------------------------------------------------------------
    def encode_tensor(self, name, x) -> tuple[bytes, SparseTensor]:
        """``(payload, received)`` of one tensor, its error feedback settled."""
        payload, received, _ = encode_one(self.selector, name, x)
        return payload, received

    def encode(self, names, tensors) -> Encoded:
        """This rank's bundle of ``tensors`` (dense arrays or SparseTensors), with what the
        ranks will decode of each of its payloads and of each tensor.

        Every dense gradient's error feedback and selection come first, then the
        codecs, then the residuals' updates: if a codec raises, nothing is sent and
        every dense gradient's residual still holds all it owes.
        """
        start = time.perf_counter()
        shared = shared_payloads(tensors, self.selector, self._selections_share,
                                 shared_below=SHARED_BELOW, payload_elements=PAYLOAD_ELEMENTS,
                                 summed_whole_below=SUMMED_WHOLE_BELOW)
        payloads, slots = encoding.select(names, tensors, shared, self.selector)
        codec_seconds = encoding.code(payloads, self._threads, PARALLEL_ENTRIES)
        # sparse tensors one at a time, their residuals settled at once: their error
        # feedback makes a dense sum each (after the others: if a dense tensor's coding
        # raised, none of them was settled)
        for payload in payloads:
            if payload.coding is None:
                t = payload.positions[0]
                payload.data, payload.received, seconds = encode_one(
                    self.selector, names[t], tensors[t])
                codec_seconds += seconds
        receiveds = encoding.settle(payloads, len(tensors), self.selector)
        bundle = encoding.pack(payloads, slots, shared, receiveds)
        min_size = self.selector.min_size
        stats = StepStats(steps=1, tensors=len(tensors),
                          compressed_tensors=sum(r.size >= min_size for r in receiveds),
                          bytes_sent=len(bundle),
                          dense_bytes=sum(r.size * r.dtype.itemsize for r in receiveds),
                          encode_seconds=time.perf_counter() - start,
                          codec_seconds=codec_seconds)
        return Encoded(Sent(bundle, [payload.received for payload in payloads], receiveds),
                       stats)

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

    # -- the decoding side -------------------------------------------------------------
    def decode(self, groups, ranks, rank, average, as_rows, out, sent,
               out_keys=None) -> Decoded:
        """The tensors of the allgathered ``groups`` of bundles, summed.

        See :meth:`~deepreduce.exchange.GradientExchange.decode_groups` for the
        arguments. ``sent``: per group, the :class:`~deepreduce.exchange.encoding.Sent`
        of this rank's bundle (see :meth:`encode`), or None. ``out_keys``: as
        :meth:`~deepreduce.exchange.GradientExchange.reduce_async`'s reuse_out,
        the name of each tensor, under which the positions written into its
        ``out`` are kept."""
        start = time.perf_counter()
        bundles, received, count = read(groups, ranks, rank)
        as_rows = [False] * count if as_rows is None else list(as_rows)
        if len(as_rows) != count:
            raise ValueError(f"as_rows has {len(as_rows)} entries for {count} tensors")
        codec_start = time.perf_counter()
        units = decode_units(bundles, sent, rank, as_rows, self._codec_threads(),
                             PARALLEL_BYTES, SUMMED_WHOLE_BELOW)
        codec_seconds = time.perf_counter() - codec_start
        results = sum_units(units, rank, 1.0 / ranks if average else None, as_rows, out,
                            out_keys, self._sums, self.selector)
        return Decoded(results, StepStats(bytes_received=received,
                                          decode_seconds=time.perf_counter() - start,
                                          codec_seconds=codec_seconds))
