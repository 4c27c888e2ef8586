"""The integration frame (:class:`deepreduce.exchange.integration.Integration`) for torch.

What torch adds to the frame: checkpoints hold the residuals as torch tensors (what
``torch.save`` and torch.distributed.checkpoint expect), the transport is
:func:`~deepreduce.torch.transport.transport_of` the integration's process group, bound at
the first use, and the process group is checked when it is given and left out of pickles.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from deepreduce.exchange.integration import Integration
from deepreduce.exchange.selection import Selector
from deepreduce.torch.device import from_host, host_array
from deepreduce.torch.transport import transport_of


class TorchIntegration(Integration):
    """:class:`~deepreduce.exchange.integration.Integration` over a torch process group.

    Parameters
    ----------
    config, settings, check_finite, selector
        As for :class:`~deepreduce.exchange.integration.Integration`.
    process_group : torch.distributed.ProcessGroup, optional
        The group to reduce in; the default group when None, looked up at the first
        use, so the object can be made before ``init_process_group``.
    """

    RUNTIME = Integration.RUNTIME + ("process_group",)

    def __init__(self, config, settings: dict, *, process_group=None, check_finite=True,
                 selector=Selector):
        super().__init__(config, settings, check_finite=check_finite, selector=selector)
        self.process_group = check_process_group(process_group)

    def bind(self, device=None):
        """Bind to the group now, if not bound yet: :func:`transport_of
        <deepreduce.torch.transport.transport_of>` the group for tensors on ``device``,
        which makes deepreduce's own process groups (collective: every rank of the
        group binds, in the same order with respect to its other process-group
        creations), then what the integration needs once bound (:meth:`_bound`). Bound
        already, the transport serves ``device`` too (:meth:`TorchTransport.serve
        <deepreduce.torch.transport.TorchTransport.serve>`). Returns the transport."""
        if self._transport is None:
            self._transport = transport_of(self.process_group, device)
            self._bound()
        else:
            serve = getattr(self._transport, "serve", None)  # (a torch transport)
            if serve is not None:
                serve(device)
        return self._transport

    def _bind(self):
        return self.bind(self._data_device())

    def _data_device(self):
        """The device of the tensors served, where it is known before the first step
        (None: the first step binds with its tensors')."""
        return None

    def _bound(self) -> None:
        """What the integration makes once its transport is bound."""

    def _saved(self, residual) -> torch.Tensor:
        # (the device path's residuals are tensors on the device already)
        if isinstance(residual, torch.Tensor):
            return residual.detach().clone()
        return from_host(residual)

    def _loaded(self, residual) -> np.ndarray:
        if isinstance(residual, torch.Tensor):
            return host_array(residual.detach().cpu()).copy()
        return np.array(residual, copy=True)

    def __setstate__(self, state):
        super().__setstate__(state)
        self.process_group = None  # (the default group's, once used)


def check_process_group(group, name: str = "process_group"):
    """``group`` when it is None or a torch process group (torchft's are too)."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"{name} must be a torch.distributed.ProcessGroup or None (the "
                         f"default group), got {group!r}")
    return group


__all__ = ["TorchIntegration", "check_process_group"]
