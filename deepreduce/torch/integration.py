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

    def _bind(self):
        return transport_of(self.process_group)

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
