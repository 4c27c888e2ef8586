"""The one interface of the exchange strategies: a :class:`Step` in, a Future out.

A strategy moves one step's gradients across the ranks: the allgather
(:class:`~deepreduce.exchange.gathering.GatheringExchange`, DeepReduce's scheme), the
reducing communicators (:class:`~deepreduce.exchange.reducing.ReducingExchange`,
SparCML's and OmniReduce's) or the hierarchical one
(:class:`~deepreduce.exchange.hierarchical.HierarchicalExchange`, dense inside a node,
one of the other two between nodes, which it drives through this interface too).
:func:`~deepreduce.exchange.gradient_exchange.strategy_for` picks one once, when the
exchange is built, from ``config.communicator``.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import threading

    from deepreduce.exchange.memory import ResidualMemory
    from deepreduce.exchange.stats import CompressionStats
    from deepreduce.exchange.topology import CarriedStage


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
    out_keys : list or None
        With ``reuse_out``, the key of each ``out`` array, under which the positions
        written there are kept (None: the names).
    carry : CarriedStage or None
        None: a reduction of its own, which a failure on any rank makes every rank
        raise. Else the step is a stage of a larger reduction that carries failures
        through its stages (the hierarchical strategy's stage 2): a strategy that
        :attr:`~Strategy.carries_failures` records a failure there, takes part in its
        collectives all the same (with nothing to encode once one is recorded) and
        completes the Future with None for the outputs.
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
    out_keys: list | None = None
    carry: CarriedStage | None = None


class Strategy(Protocol):
    """What the exchange asks of a strategy."""

    #: Whether the strategy's collectives carry a failure that ``step.carry`` records to
    #: every rank; one whose collectives cannot runs as a stage only once every rank is
    #: known to be able to go on (a missing rank would leave them waiting).
    carries_failures = False

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

    def written_positions(self, key, target):
        """Where the last step with ``reuse_out`` may have made ``target``, the ``out``
        array kept under ``key``, non-zero; None: anywhere (a pass over it finds them)."""
        return None
