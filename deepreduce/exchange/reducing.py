"""The reducing exchange: gradients summed inside SparCML's or OmniReduce's collectives.

With ``communicator="sparse_allreduce"`` or ``"block"`` the
:class:`~deepreduce.exchange.GradientExchange` hands each step here: error
feedback and the sparsifier run per gradient (:class:`~deepreduce.exchange.selection.Selector`),
then the selections of all gradients of one dtype go through one set of the
communicator's collectives with the configured codecs, and each residual becomes
``corrected - sent``, with ``sent`` as the communicator reports it. Small gradients
travel with the others when the codecs are lossless, otherwise in a second,
lossless reduction.
"""

from __future__ import annotations

import time

import numpy as np

from deepreduce import collectives
from deepreduce.collectives.transport import Traffic
from deepreduce.exchange.stats import StepStats
from deepreduce.exchange.strategy import Step, Strategy
from deepreduce.exchange.summing import nonzero_rows
from deepreduce.pipeline import Pipeline


class ReducingExchange(Strategy):
    """The communicators of one configuration, and a step through them.

    Parameters
    ----------
    config : ExchangeConfig
        Its ``communicator`` is ``"sparse_allreduce"`` or ``"block"``.
    selector : Selector
        The exchange's per-tensor step (pipelines, error feedback).
    """

    def __init__(self, config, selector):
        self.name, self.options = config.communicator, config.communicator_options
        self.selector = selector
        pipeline = selector.pipeline
        # the sparsifier runs per gradient; the communicator codes the selections
        self._wire_pipeline = Pipeline(None, index=pipeline.index_codec,
                                       value=pipeline.value_codec)
        # small tensors go without loss: blocks below a threshold would be dropped
        self._small_options = ({**self.options, "threshold": 0.0}
                               if "threshold" in self.options else self.options)
        index_codec = pipeline.index_codec
        # small tensors can share the reduction of the large ones when that loses nothing
        self._small_ride_along = (index_codec is not None and index_codec.lossless
                                  and pipeline.value_codec.lossless
                                  and self._small_options == self.options)
        # built now, so that a setting the communicator rejects (a lossy index codec for
        # blocks, block_size=0) fails here, not at the first step
        self._communicator("main")
        self._communicator("small")

    def _communicator(self, kind, **per_call):
        """The communicator of the large (``"main"``) or the small gradients."""
        if kind == "small":
            return collectives.get_communicator(self.name, pipeline=self.selector.small_pipeline,
                                                **self._small_options, **per_call)
        return collectives.get_communicator(self.name, pipeline=self._wire_pipeline,
                                            **self.options, **per_call)

    def start(self, step: Step):
        """Encode now; reduce on the transport's thread, after the collectives this
        queues there (see :class:`~deepreduce.exchange.strategy.Strategy`)."""
        with step.lock:
            reduced = self.reduce(list(step.names), list(step.tensors), step.op,
                                  step.transport, step.as_rows)

        def finish():
            with step.lock:
                outputs, traffic, stats = reduced()
            step.stats.record_step(stats)
            for i, target in enumerate(step.out or []):
                if target is not None:
                    np.copyto(target, np.asarray(outputs[i]).reshape(target.shape))
                    outputs[i] = target
            return outputs, traffic
        # queued behind the reduction's own collectives on the same thread
        return step.transport.submit(finish)

    def reduce(self, names, tensors, op: str, transport, as_rows):
        """Error feedback, sparsifier and encoding now; return the function that waits
        for the collectives and returns ``(outputs, traffic, stats)``.

        The caller holds the exchange's lock around both.
        """
        start = time.perf_counter()
        selections, groups = [], {}
        dense_bytes = compressed = 0
        for i, (name, x) in enumerate(zip(names, tensors)):
            small = self.selector.is_small(x)
            selection = self.selector.select(name, x)
            kind = "small" if small and not self._small_ride_along else "main"
            compressed += not small
            selections.append(selection)
            dense_bytes += selection.selected.size * selection.selected.dtype.itemsize
            # insertion order is the order of the gradients: the same on every rank
            groups.setdefault((kind, selection.selected.dtype), []).append(i)
        handles = []
        for (kind, _), positions in groups.items():
            # built per step: cheap, and no communicator outlives the step accumulating
            # its traffic
            communicator = self._communicator(kind, op=op, transport=transport)
            handles.append((positions, communicator.reduce_many_async(
                [selections[i].selected for i in positions])))
        encoded = time.perf_counter()

        def finish():
            results, traffic, failure, reductions = [None] * len(tensors), Traffic(), None, []
            for positions, handle in handles:
                try:  # wait for every group, so that a failing one leaves the ranks in step
                    group = handle.wait()
                except Exception as exc:  # noqa: BLE001 - re-raised below
                    failure = failure or exc
                    continue
                reductions += zip(positions, group)
                traffic += group[0].traffic
            if failure is not None:
                raise failure
            exchanged = time.perf_counter()
            for i, reduction in reductions:
                self.selector.settle(selections[i], reduction.sent)
                results[i] = nonzero_rows(reduction.output) if as_rows[i] else reduction.output
            return results, traffic, StepStats(
                steps=1, tensors=len(tensors), compressed_tensors=compressed,
                bytes_sent=traffic.sent, bytes_received=traffic.received,
                dense_bytes=dense_bytes, encode_seconds=encoded - start,
                decode_seconds=time.perf_counter() - exchanged,
                exchange_seconds=exchanged - encoded)

        return finish
