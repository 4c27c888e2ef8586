"""PyTorch integration: a DDP communication hook and allreduce over torch.distributed.

::

    import torch, deepreduce as dr, deepreduce.torch as drt
    model = torch.nn.parallel.DistributedDataParallel(net)
    state = drt.DeepReduceState(sparsifier=dr.TopK(0.01), index="auto", value="fp16")
    model.register_comm_hook(state, drt.deepreduce_hook)

    total = drt.allreduce(grad, state, name="w")     # custom loops, dense or sparse COO

Everything framework-neutral (error feedback, encoding, the collectives'
logic, the sums) lives in :mod:`deepreduce.exchange` and
:mod:`deepreduce.collectives`; this package converts tensors and moves bytes
with :class:`~deepreduce.torch.transport.TorchTransport` (gloo or NCCL).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from deepreduce.sparse import SparseTensor
from deepreduce.torch.ddp import DeepReduceState, deepreduce_hook, from_host, host_array
from deepreduce.torch.outer import OuterOptimizer as OuterOptimizer  # (docs/diloco.md)
from deepreduce.torch.streams import lane_of
from deepreduce.torch.transport import CollectiveError, transport_of

__all__ = ["DeepReduceState", "deepreduce_hook", "allreduce", "allreduce_async",
           "transport_of", "CollectiveError"]


def allreduce_async(tensor, state: DeepReduceState, name: str | None = None,
                    op: str = "average") -> torch.futures.Future:
    """Start reducing ``tensor`` across the ranks of ``state``'s group; return a Future.

    For training loops that do not use DDP. ``tensor`` is dense, or a sparse
    COO tensor (the gradient of ``nn.Embedding(sparse=True)``), which is
    encoded sparse, never densified. The state's sparsifier, codecs and
    communicator apply; its ``start_iter`` and ``min_compression_rate``
    concern only the DDP hook; its ``check_finite`` applies: a tensor with an inf
    or NaN on any rank is reduced whole and exact on every rank (inf or NaN where a
    dense allreduce gives them), and its residual and random streams stay as they
    were. Every rank must start the same reductions in the same order.

    Parameters
    ----------
    tensor : torch.Tensor
        Floating point, dense or sparse COO, on any device.
    state : DeepReduceState
    name : str, optional
        Key of the error-feedback residual (one per tensor you reduce each
        step). None reduces without error feedback.
    op : {"average", "sum"}

    Returns
    -------
    torch.futures.Future
        Its value is the reduced tensor, the same on every rank: dense for a
        dense input (same shape, dtype and device); for a sparse input, a
        sparse COO tensor holding the rows any rank sent.
    """
    if not tensor.dtype.is_floating_point:
        raise TypeError(f"allreduce reduces floating-point tensors, got {tensor.dtype}")
    state.bind(tensor.device)
    sparse = tensor.is_sparse
    x = _sparse_to_numpy(tensor) if sparse else host_array(tensor.detach().cpu())
    # (a result on a GPU: made with the transport's lane current, which set_result
    # records, so that the consumer's stream waits for it: deepreduce.torch.streams)
    result = torch.futures.Future(devices=[tensor.device]) if tensor.is_cuda \
        else torch.futures.Future()
    lane = lane_of(state.transport)

    def deliver(future):
        with lane.current():
            _deliver(future)

    def _deliver(future):
        try:
            (output,), _ = future.result()
            if sparse:
                values, rows = output
                result.set_result(torch.sparse_coo_tensor(
                    torch.from_numpy(rows)[None], from_host(values), tensor.shape,
                    device=tensor.device, check_invariants=True, is_coalesced=True))
            else:
                result.set_result(from_host(output).to(tensor.device))
        except Exception as exc:  # noqa: BLE001 - raised by the future's wait()
            result.set_exception(exc)

    started = state.reduce_async([name], [x], op, as_rows=[sparse],
                                 check=tensor._values() if sparse else tensor.detach())
    started.add_done_callback(deliver)
    return result


def allreduce(tensor, state: DeepReduceState, name: str | None = None, op: str = "average"):
    """Reduce ``tensor`` across ranks; see :func:`allreduce_async`."""
    return allreduce_async(tensor, state, name, op).wait()


def _sparse_to_numpy(tensor) -> SparseTensor:
    """A sparse COO tensor as a :class:`~deepreduce.SparseTensor` of its dense shape."""
    coalesced = tensor.detach().coalesce().cpu()
    shape = tuple(coalesced.shape)
    sparse_dims = coalesced.sparse_dim()
    rows = np.ravel_multi_index(coalesced.indices().numpy(), shape[:sparse_dims]) \
        if coalesced._nnz() else np.zeros(0, np.int64)
    # the sparse dimensions as one: rows of the dense dimensions, with the same flat indices
    by_rows = (math.prod(shape[:sparse_dims]), *shape[sparse_dims:])
    st = SparseTensor.from_rows(host_array(coalesced.values()), rows, by_rows)
    return SparseTensor._trusted(st.values, st.indices, shape)
