"""Error feedback: what a lossy step did not deliver is added to the next input."""

from __future__ import annotations

import numpy as np

from deepreduce.sparse import SparseTensor


class ResidualMemory:
    """Residual per tensor name, so no gradient mass is silently lost.

    Each step, for every tensor ``name``::

        corrected = memory.compensate(name, gradient)      # gradient + beta * residual
        payload, received = pipeline.encode(corrected)
        memory.update(name, corrected, received)           # residual = corrected - received

    ``received`` is what the receiver decodes (the pipeline returns it), so the
    residual is exact: ``corrected == received.to_dense() + residual`` holds
    element for element (one subtraction per delivered entry, zero rounding
    elsewhere).

    Parameters
    ----------
    beta : float, default 1.0
        Weight of the residual when it is added back. 1.0 is classic error
        feedback (EF-SGD, DeepReduce); values in [0, 1) let stale error decay;
        0 turns error feedback off while keeping the same call sites.

    Examples
    --------
    >>> import numpy as np, deepreduce as dr
    >>> memory, pipe = dr.ResidualMemory(), dr.Pipeline(dr.TopK(1))
    >>> g = np.array([0.5, -2.0, 1.0], np.float32)
    >>> corrected = memory.compensate("w", g)
    >>> payload, received = pipe.encode(corrected)
    >>> memory.update("w", corrected, received)
    >>> memory.residual("w")
    array([0.5, 0. , 1. ], dtype=float32)
    >>> memory.compensate("w", g)
    array([ 1., -2.,  2.], dtype=float32)
    """

    def __init__(self, beta: float = 1.0):
        beta = float(beta)
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta!r}")
        self.beta = beta
        self._residuals: dict[str, np.ndarray] = {}

    def compensate(self, name: str, gradient) -> np.ndarray:
        """Return ``gradient + beta * residual[name]`` (the gradient itself the first time)."""
        gradient = gradient.to_dense() if isinstance(gradient, SparseTensor) else np.asarray(gradient)
        residual = self._residuals.get(name)
        if residual is None or self.beta == 0.0:
            return gradient
        if residual.shape != gradient.shape:
            raise ValueError(f"tensor {name!r} changed shape from {residual.shape} to "
                             f"{gradient.shape}; call reset({name!r}) first")
        return gradient + (residual if self.beta == 1.0 else self.beta * residual).astype(
            gradient.dtype, copy=False)

    def update(self, name: str, sent_input, received: SparseTensor) -> None:
        """Store ``sent_input - received`` as the residual of ``name``."""
        if isinstance(sent_input, SparseTensor):
            residual = sent_input.to_dense()
        else:
            residual = np.array(sent_input, copy=True)
        if residual.size != received.size:
            raise ValueError(f"received tensor has {received.size} elements, input {residual.size}")
        flat = residual.reshape(-1)
        flat[received.indices] -= received.values.astype(flat.dtype, copy=False)
        self._residuals[name] = residual

    def residual(self, name: str) -> np.ndarray | None:
        """The stored residual of ``name`` (None before its first update)."""
        return self._residuals.get(name)

    def reset(self, name: str | None = None) -> None:
        """Forget one residual, or all of them."""
        if name is None:
            self._residuals.clear()
        else:
            self._residuals.pop(name, None)

    def __contains__(self, name) -> bool:
        return name in self._residuals

    def __len__(self) -> int:
        return len(self._residuals)
