"""The one interface of the exchange strategies, and the choice of one from the settings.

A strategy moves one step's gradients across the ranks: the allgather
(:class:`~deepreduce.exchange.allgather.AllgatherExchange`, DeepReduce's scheme), the
reducing communicators (:class:`~deepreduce.exchange.reducing.ReducingExchange`,
SparCML's and OmniReduce's) or the hierarchical one
(:class:`~deepreduce.exchange.hierarchical.HierarchicalExchange`, dense inside a node).
:func:`strategy_for` picks it once, when the exchange is built, from
``config.communicator``; the hierarchical strategy gets the strategy between nodes
from it too.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import threading

    from deepreduce.config import ExchangeConfig
    from deepreduce.exchange.memory import ResidualMemory
    from deepreduce.exchange.selection import Selector
    from deepreduce.exchange.stats import CompressionStats


@dataclasses.dataclass
class Step:
    """One rank's request to reduce its gradients, as
    :meth:`~deepreduce.exchange.GradientExchange.reduce_async` checked it.

    Attributes
    ----------
    names, tensors, transport, op, as_rows, out, reuse_out
        As :meth:`~deepreduce.exchange.GradientExchange.reduce_async` takes them
        (``op`` "sum" or "average", ``as_rows`` one bool per tensor).
    lock : threading.Lock
        Held around error feedback and encoding: one step's at a time.
    stats : CompressionStats
        Where the step's bytes and times are recorded.
    exact : bool
        A non-finite step: every tensor whole and exact, nothing remembered
        (only the allgather strategy runs these).
    """

    names: list
    tensors: list
    transport: object
    op: str
    as_rows: list
    out: list | None
    reuse_out: bool
    lock: threading.Lock
    stats: CompressionStats
    exact: bool = False


class Strategy(Protocol):
    """What the exchange asks of a strategy."""

    def start(self, step: Step) -> Future:
        """Start ``step``: error feedback, selection and encoding on the caller's thread
        (under ``step.lock``), the collectives, decoding and sums on the transport's
        communication thread. The Future's result is ``(outputs, traffic)``."""

    def pay(self, memory: ResidualMemory, names, tensors, transport) -> None:
        """Add what error feedback owes into ``tensors`` (in place) and forget it, for a
        step that sends them whole. Each residual covers its whole tensor here; a
        strategy whose residuals cover part of it says which part."""
        for name, x in zip(names, tensors):
            memory.pay(name, x)


def strategy_for(config: ExchangeConfig, selector: Selector) -> Strategy:
    """The strategy of ``config.communicator``, built once for an exchange."""
    from deepreduce.exchange.allgather import AllgatherExchange
    from deepreduce.exchange.hierarchical import HierarchicalExchange
    from deepreduce.exchange.reducing import ReducingExchange

    if config.communicator == "allgather":
        return AllgatherExchange(selector, config.codec_threads)
    if config.communicator == "hierarchical":
        options = config.communicator_options
        between_nodes = strategy_for(dataclasses.replace(
            config, communicator=options["inter"],
            communicator_options=options["inter_options"]), selector)
        return HierarchicalExchange(config, selector, between_nodes)
    return ReducingExchange(config, selector)
