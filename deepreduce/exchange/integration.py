"""What every integration of the exchange shares, written once: :class:`Integration`.

DDP's hook state, the DiLoCo outer step, torchft's manager and Horovod's compression
each hold one :class:`~deepreduce.exchange.GradientExchange` and need the same frame
around it:

1. settings, validated when the object is made (:class:`~deepreduce.config.ExchangeConfig`
   and the integration's own, each named in its error);
2. the transport, bound late, at the first use (the object may be made before the
   process group exists);
3. agreement: before the first step every rank compares its settings with every other
   rank's and raises on every rank, naming what differs, instead of training apart;
4. the non-finite policy: with ``check_finite`` every rank learns whether every rank's
   tensors are finite, and a step that is not travels whole and exact, changing no
   residual (:meth:`GradientExchange.reduce_async
   <deepreduce.exchange.GradientExchange.reduce_async>`'s ``finite``);
5. statistics: the exchange's :class:`~deepreduce.exchange.stats.CompressionStats`;
6. checkpoints: the residuals and random streams with the settings they belong to; a
   checkpoint of other settings is refused, naming each difference; pickling leaves
   what belongs to the running process (the transport, locks) behind.

An integration subclasses it and keeps only what is its own (DDP's buckets and futures,
the outer update, torchft's manager, Horovod's tensors).
"""

from __future__ import annotations

import numpy as np

from deepreduce.collectives.signed import agree_settings
from deepreduce.config import ExchangeConfig, check_flag
from deepreduce.exchange.gradient_exchange import GradientExchange
from deepreduce.exchange.selection import Selector


class Integration:
    """The frame of an integration around its :class:`GradientExchange`.

    Parameters
    ----------
    config : ExchangeConfig
        The exchange's settings.
    settings : dict
        The integration's own settings that every rank must share and checkpoints
        carry (``{"start_iter": 10, ...}``), beside the exchange's shared ones.
    check_finite : bool, default True
        Whether :meth:`finite_everywhere` asks the ranks (see the module's step 4).
    selector : callable, default Selector
        Makes the exchange's per-tensor step (the numpy one, or one that works where
        the tensors live).

    Attributes
    ----------
    exchange : GradientExchange
    settings : dict
        What every rank must share and checkpoints carry: the exchange's
        :meth:`~deepreduce.config.ExchangeConfig.shared_settings`, the integration's own
        and ``check_finite``.
    check_finite : bool

    Subclasses implement :meth:`_bind` (the transport) and, for state of their own in
    checkpoints, :meth:`_own_state` and :meth:`_load_own_state`; they list the
    attributes that belong to the running process in :attr:`RUNTIME`.
    """

    #: Attributes left out of a pickle (a subclass adds its own); :meth:`_init_runtime`
    #: makes them again.
    RUNTIME = ("_transport", "_agreed")

    def __init__(self, config: ExchangeConfig, settings: dict, *, check_finite=True,
                 selector=Selector):
        self.exchange = GradientExchange(config=config, selector=selector)
        self.check_finite = check_flag("check_finite", check_finite)
        self.settings = {**config.shared_settings(self.exchange.selector.pipeline),
                         **settings, "check_finite": self.check_finite}
        Integration._init_runtime(self)

    def _init_runtime(self):
        self._transport = None  # bound at the first use: see transport
        self._agreed = False    # settings compared across ranks

    # -- what it holds ----------------------------------------------------------------
    @property
    def config(self) -> ExchangeConfig:
        return self.exchange.config

    @property
    def stats(self):
        """Bytes and times of every step (:class:`~deepreduce.exchange.stats.CompressionStats`)."""
        return self.exchange.stats

    @property
    def transport(self):
        """The transport every collective runs on, bound at the first use (:meth:`_bind`)."""
        if self._transport is None:
            self._transport = self._bind()
        return self._transport

    def _bind(self):
        raise NotImplementedError(f"{type(self).__name__} binds no transport")

    # -- agreement and the non-finite policy --------------------------------------------
    def agree(self, transport=None, extra: dict | None = None, *, wait: bool = True,
              again: bool = False, what: str = "settings"):
        """Compare :attr:`settings` (and ``extra``) across the ranks of ``transport``
        (:attr:`transport` when None), once (``again``: for a new set of ranks). Every
        rank calls it. It runs on the transport's thread, before any collective started
        after it; ``wait=False`` returns its future instead of waiting (its failure then
        stops the transport's later tasks on every rank). Raises ValueError on every
        rank, naming each setting that differs."""
        if self._agreed and not again:
            return None
        self._agreed = True
        transport = self.transport if transport is None else transport
        future = transport.submit(agree_settings, transport,
                                  {**self.settings, **(extra or {})}, what)
        return future if not wait else future.result()

    def finite_everywhere(self, tensors, transport=None) -> bool:
        """Whether every rank's ``tensors`` are finite, as the ranks agree (True without
        asking when ``check_finite`` is off): the ``finite`` of the step that sends
        them. Every rank calls it for the same step."""
        if not self.check_finite:
            return True
        return self.exchange.agree_finite(tensors, self.transport if transport is None
                                          else transport)

    def rescale(self, factor: float) -> None:
        """Multiply every residual by ``factor`` (new loss scale / old): error feedback
        stays in the units of the gradients when a loss scaler changes its scale."""
        self.exchange.rescale(factor)

    # -- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The residuals (per tensor name) and random streams, the integration's own
        state and the settings they belong to (checked by :meth:`load_state_dict`)."""
        state = self.exchange.selector.state_dict()
        return {"settings": dict(self.settings), **self._own_state(),
                "residuals": {name: self._saved(residual)
                              for name, residual in state["residuals"].items()},
                "random_state": state["random_state"]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue from :meth:`state_dict` of an object with the same settings; one of
        other settings raises ValueError naming each difference."""
        self.check_settings(state_dict.get("settings"))
        self.exchange.selector.load_state_dict({
            "residuals": {name: self._loaded(residual)
                          for name, residual in state_dict["residuals"].items()},
            "random_state": state_dict["random_state"]})
        self._load_own_state(state_dict)

    def check_settings(self, theirs: dict | None) -> None:
        """Raise ValueError unless ``theirs`` (a checkpoint's settings) are :attr:`settings`,
        naming each one that differs."""
        theirs = upgraded_settings(theirs or {})
        if theirs == self.settings:
            return
        differ = [k for k in dict.fromkeys([*self.settings, *theirs])
                  if theirs.get(k) != self.settings.get(k)]
        raise ValueError("the checkpoint was written with other settings: " + ", ".join(
            f"{k} {theirs.get(k)!r} there, {self.settings.get(k)!r} here" for k in differ))

    def _own_state(self) -> dict:
        """The integration's own entries of :meth:`state_dict`."""
        return {}

    def _load_own_state(self, state_dict: dict) -> None:
        """Take back what :meth:`_own_state` wrote."""

    def _saved(self, residual):
        """A residual as a checkpoint holds it (the selector's copy)."""
        return residual

    def _loaded(self, residual):
        """A checkpoint's residual as the selector takes it."""
        return np.array(residual, copy=True)

    # -- pickling ----------------------------------------------------------------------
    def __getstate__(self):
        state = dict(self.__dict__)
        for name in self.RUNTIME:
            state.pop(name, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_runtime()


def upgraded_settings(settings: dict) -> dict:
    """``settings`` of a checkpoint written before 0.2.0 in today's keys: a boolean
    ``use_error_feedback`` became ``error_feedback``, the decay (1.0 then) or "off", and
    ``check_finite`` was True before it could be set."""
    settings = {"check_finite": True, **settings}
    if "use_error_feedback" in settings:
        used = settings.pop("use_error_feedback")
        settings.setdefault("error_feedback", 1.0 if used else "off")
    return settings


__all__ = ["Integration", "upgraded_settings"]
