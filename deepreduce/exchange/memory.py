"""Error feedback: what a lossy step did not deliver is added to the next input."""

from __future__ import annotations

import math
import warnings

import numpy as np

from deepreduce.sparse import SparseTensor
from deepreduce.sparsifiers import Sparsifier


class ResidualMemory:
    """Residual per tensor name, so no gradient mass is silently lost.

    Error feedback in two halves around each encoding, for every tensor ``name``::

        corrected = memory.accumulate(name, gradient)      # gradient + beta * residual
        payload, received = pipeline.encode(corrected)
        memory.settle(name, corrected, received)           # residual = corrected - received

    ``received`` is what the receiver decodes (the pipeline returns it), so the
    residual is exact: ``corrected == received.to_dense() + residual`` holds
    element for element (one subtraction per delivered entry, zero rounding
    elsewhere). The gradient is added into the residual's own memory: no
    tensor-sized array is made. :meth:`accumulate_and_select` fuses the first
    half with the sparsifier; :meth:`pay` is the step that sends everything
    owed uncompressed. Every path of deepreduce uses these.

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
    >>> corrected = memory.accumulate("w", g)
    >>> payload, received = pipe.encode(corrected)
    >>> memory.settle("w", corrected, received)
    >>> memory.residual("w")
    array([0.5, 0. , 1. ], dtype=float32)
    >>> memory.accumulate("w", g)
    array([ 1., -2.,  2.], dtype=float32)
    """

    def __init__(self, beta: float = 1.0):
        beta = float(beta)
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta!r}")
        self.beta = beta
        self._residuals: dict[str, np.ndarray] = {}

    def accumulate(self, name: str, gradient) -> np.ndarray:
        """First half of error feedback: ``gradient + beta * residual``, made in place.

        The gradient is added into the residual's own memory, which then holds
        everything owed until :meth:`settle` subtracts what was delivered (a
        fresh array of a large gradient costs more in page faults than the
        addition). The result is that memory: read it, do not keep it. A
        sparse gradient, or the first one of a name, gives a new array instead.
        """
        corrected = self._corrected_in_place(name, gradient)
        return self._compensated(name, gradient) if corrected is None else corrected

    def settle(self, name: str, corrected, received: SparseTensor,
               selected: SparseTensor | None = None) -> None:
        """Second half: the residual becomes ``corrected - received``.

        ``corrected`` is what :meth:`accumulate` returned; ``received`` is what
        the receivers decode. When ``corrected`` is the residual's own memory
        (accumulate's usual case) the delivered entries are subtracted there;
        otherwise, or when ``received`` views it, the residual is a copy of
        ``corrected`` less ``received``. ``selected``, when given, is what the sparsifier
        took from ``corrected``: where ``received`` has the same index array,
        its values are ``corrected``'s there, and reading them again is skipped.
        """
        if corrected is self._residuals.get(name) \
                and not np.may_share_memory(received.values, corrected):
            self._store(name, corrected, received, selected)
        else:
            residual = corrected.to_dense() if isinstance(corrected, SparseTensor) else \
                np.array(corrected, copy=True, order="C")
            self._store(name, residual, received)

    def accumulate_and_select(self, name: str, gradient, sparsifier):
        """:meth:`accumulate`, then ``sparsifier`` applied to the result.

        Returns ``(corrected, selected)``: what :meth:`accumulate` returns and
        what the sparsifier chose from it. When the gradient is added into the
        residual's memory, a :class:`~deepreduce.sparsifiers.Sparsifier` does
        the addition and the selection together
        (:meth:`~deepreduce.sparsifiers.Sparsifier.accumulate`: one pass over
        memory for TopK); the bits are the same as with the two calls.
        """
        residual = self._in_place_residual(name, gradient)
        if residual is None or not isinstance(sparsifier, Sparsifier):
            corrected = self.accumulate(name, gradient)
            return corrected, sparsifier(corrected)
        return residual, sparsifier.accumulate(residual, gradient)

    def _corrected_in_place(self, name, gradient):
        """``gradient + beta * residual`` computed in the residual's memory (None when
        the residual cannot take it: none yet, another shape or dtype, a sparse
        gradient). The same bits as :meth:`_compensated`: the sum commutes."""
        residual = self._in_place_residual(name, gradient)
        if residual is not None:
            np.add(residual, gradient, out=residual)
        return residual

    def _in_place_residual(self, name, gradient):
        """The residual of ``name``, already times ``beta``, ready for ``gradient`` to be
        added into it; None when it cannot take it (see :meth:`_corrected_in_place`)."""
        residual = self._residuals.get(name)
        if isinstance(gradient, SparseTensor) or residual is None or self.beta == 0.0:
            return None
        gradient = np.asarray(gradient)
        if residual.shape != gradient.shape or residual.dtype != gradient.dtype:
            return None
        if self.beta != 1.0:
            np.multiply(residual, self.beta, out=residual)
        return residual

    def pay(self, name: str, gradient: np.ndarray) -> np.ndarray:
        """Add what is owed to ``name`` into ``gradient`` (in place) and forget it.

        For a step that sends the whole corrected gradient as it is (a dense
        allreduce before compression starts): nothing is left owed.
        """
        residual = self._residuals.pop(name, None)
        if residual is not None and self.beta != 0.0:
            owed = residual if self.beta == 1.0 else self.beta * residual
            gradient += owed.astype(gradient.dtype, copy=False).reshape(gradient.shape)
        return gradient

    def _compensated(self, name: str, gradient) -> np.ndarray:
        """``gradient + beta * residual[name]`` as a new array (the gradient itself the
        first time)."""
        gradient = gradient.to_dense() if isinstance(gradient, SparseTensor) else \
            np.asarray(gradient)
        residual = self._residuals.get(name)
        if residual is None or self.beta == 0.0:
            return gradient
        if residual.shape != gradient.shape:
            raise ValueError(f"tensor {name!r} changed shape from {residual.shape} to "
                             f"{gradient.shape}; call reset({name!r}) first")
        return gradient + (residual if self.beta == 1.0 else self.beta * residual).astype(
            gradient.dtype, copy=False)

    # -- the earlier API, kept for callers written against it ----------------------------
    def compensate(self, name: str, gradient) -> np.ndarray:
        """Deprecated: :meth:`accumulate` (which adds in place) does this."""
        _deprecated("compensate", "accumulate")
        return self._compensated(name, gradient)

    def update(self, name: str, sent_input, received: SparseTensor) -> None:
        """Deprecated: :meth:`settle` does this."""
        _deprecated("update", "settle")
        residual = sent_input.to_dense() if isinstance(sent_input, SparseTensor) else \
            np.array(sent_input, copy=True, order="C")
        self._store(name, residual, received)

    def feedback(self, name: str, gradient, encode):
        """Deprecated: call :meth:`accumulate`, encode, then :meth:`settle`."""
        _deprecated("feedback", "accumulate and settle")
        corrected = self.accumulate(name, gradient)
        payload, received = encode(corrected)
        self.settle(name, corrected, received)
        return payload, received

    def _store(self, name, residual: np.ndarray, received: SparseTensor, selected=None) -> None:
        """Subtract ``received`` from ``residual`` (C-contiguous, ours) in place and keep it."""
        if residual.size != received.size:
            raise ValueError(f"received tensor has {received.size} elements, input {residual.size}")
        flat = residual.reshape(-1)
        delivered = received.values.astype(flat.dtype, copy=False)
        if selected is not None and selected.indices is received.indices \
                and selected.values.dtype == flat.dtype:
            # the same bits as below, without gathering the scattered entries again
            flat[received.indices] = selected.values - delivered
        else:
            flat[received.indices] -= delivered
        self._residuals[name] = residual

    def rescale(self, factor: float) -> None:
        """Multiply every residual by ``factor``, in place (see
        :meth:`deepreduce.exchange.GradientExchange.rescale`)."""
        factor = float(factor)
        if not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"factor must be a finite number > 0, got {factor!r}")
        for residual in self._residuals.values():
            residual *= factor

    def residual(self, name: str) -> np.ndarray | None:
        """The stored residual of ``name`` (None before its first update).

        The array itself, not a copy: :meth:`accumulate` updates it in place, so
        copy it to keep it.
        """
        return self._residuals.get(name)

    def restore(self, name: str, residual) -> None:
        """Set the residual of ``name`` to a copy of ``residual`` (from a checkpoint)."""
        self._residuals[name] = np.array(residual, copy=True, order="C")

    def names(self) -> list:
        """The names that hold a residual."""
        return list(self._residuals)

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


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"ResidualMemory.{old} is deprecated; use {new}", DeprecationWarning,
                  stacklevel=3)
