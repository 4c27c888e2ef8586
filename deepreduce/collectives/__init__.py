"""Reducing collectives for sparse tensors (SparCML, OmniReduce, DeepReduce).

Three communicators, chosen by name, all built on the two byte collectives of a
:class:`~deepreduce.collectives.transport.Transport` (``alltoall`` and
``allgather``) and all applying a :class:`~deepreduce.Pipeline` (sparsifier,
index codec, value codec) to what travels:

``"allgather"``
    every rank's payload to every rank, each rank decodes and sums (DeepReduce);
``"sparse_allreduce"``
    SparCML's SSAR_Split_allgather: index ranges to their owners (alltoall),
    sparse sums there, reduced ranges to all (allgather), each range dense
    when that is smaller (DSAR_Split_allgather);
``"block"``
    OmniReduce: non-zero blocks of ``block_size`` elements to their owners,
    summed there, gathered back.

Each works on numpy arrays and :class:`~deepreduce.SparseTensor`; each has a
blocking ``reduce`` and a ``reduce_async`` that returns a handle; every rank gets
the same result. The bytes each rank sends and receives are counted
(``Reduction.traffic``) and predicted by :mod:`deepreduce.collectives.cost`.
See docs/collectives.md.

This package knows no framework and has no default transport: pass one
(``transport=``), or use a framework's wrappers, which bring theirs.
:mod:`deepreduce.horovod.collectives` gives the same communicators and
:func:`allreduce` over Horovod (``process_set``, ``hvd.Sum`` / ``hvd.Average``,
eager ``tf.Tensor`` and ``tf.IndexedSlices``);
:class:`deepreduce.torch.transport.TorchTransport` runs them over
``torch.distributed``; :class:`ThreadTransport` plays P ranks with threads.

Examples
--------
Two ranks played by threads:

>>> import numpy as np, deepreduce as dr
>>> from concurrent.futures import ThreadPoolExecutor
>>> from deepreduce import collectives
>>> pipe = dr.Pipeline(dr.TopK(2), index="varint")
>>> def rank_main(member):
...     grad = np.array([0, 3, -1, 0, 2, 0], np.float32) * (member.rank + 1)
...     return collectives.allreduce(grad, "sparse_allreduce", pipeline=pipe,
...                                  transport=member)
>>> with ThreadPoolExecutor(2) as pool:
...     totals = list(pool.map(rank_main, collectives.ThreadTransport.group(2)))
>>> totals[1]
array([0., 9., 0., 0., 6., 0.], dtype=float32)
"""

from deepreduce.collectives.transport import (ThreadTransport, Traffic, Transport,
                                              get_transport)
from deepreduce.collectives.communicator import Communicator, Handle, Reduction
from deepreduce.collectives.signed import fail_collectively
from deepreduce.collectives.allgather import AllgatherReduce
from deepreduce.collectives.sparse_allreduce import SparseAllreduce
from deepreduce.collectives.block import BlockReduce
from deepreduce.collectives import cost  # noqa: F401

#: The communicators by name: the one list of them (the framework wrappers and the
#: gradient exchange take these names).
COMMUNICATORS = {"allgather": AllgatherReduce, "sparse_allreduce": SparseAllreduce,
                 "block": BlockReduce}


def get_communicator(communicator="sparse_allreduce", **kwargs) -> Communicator:
    """A communicator from its name (``**kwargs`` go to its constructor), or itself."""
    if isinstance(communicator, Communicator):
        if kwargs:
            raise ValueError("settings go to the constructor; got a built communicator and "
                             f"{sorted(kwargs)}")
        return communicator
    if communicator not in COMMUNICATORS:
        raise ValueError(f"unknown communicator {communicator!r}; known: "
                         f"{', '.join(COMMUNICATORS)}")
    return COMMUNICATORS[communicator](**kwargs)


def allreduce_async(x, communicator="sparse_allreduce", pipeline=None, op="sum",
                    process_set=None, transport=None, **settings) -> Handle:
    """Start reducing ``x`` over all ranks; ``handle.wait().output`` is the result.

    Settings that fail validation on some rank (a ``block_size`` of 0, say)
    raise there and, through an ERROR frame in the first collective, on every
    other rank too.
    """
    if isinstance(communicator, Communicator):
        if pipeline is not None or op != "sum" or process_set is not None \
                or transport is not None or settings:
            raise ValueError("a built communicator carries its own settings; pass only x")
        return communicator.reduce_async(x)
    if communicator not in COMMUNICATORS:
        raise ValueError(f"unknown communicator {communicator!r}; known: "
                         f"{', '.join(COMMUNICATORS)}")
    cls = COMMUNICATORS[communicator]
    try:
        comm = cls(pipeline=pipeline, op=op, process_set=process_set, transport=transport,
                   **settings)
    except (ValueError, TypeError) as exc:
        member = get_transport(transport, process_set)
        future = member.submit(fail_collectively, cls.first_collective, member, "", exc)
        return Handle(future, None)
    return comm.reduce_async(x)


def allreduce(x, communicator="sparse_allreduce", pipeline=None, op="sum", process_set=None,
              transport=None, **settings):
    """Reduce ``x`` over all ranks with the named communicator; return the dense result.

    Parameters
    ----------
    x : ndarray or SparseTensor
    communicator : {"sparse_allreduce", "block", "allgather"} or Communicator
        SparCML's split allgather by default: one tensor that is sparse already costs
        less through its range owners than in every rank's payload to every rank (a
        gradient exchange's ``"allgather"`` default sends one bundle per step instead;
        :mod:`deepreduce.config` says why they differ).
    pipeline : Pipeline, optional
    op : {"sum", "average"}
    process_set : optional
        See :class:`Communicator`: Horovod's, for
        :func:`deepreduce.horovod.collectives.allreduce`, which takes the same
        arguments and TensorFlow tensors too.
    transport : Transport
        How the bytes move (e.g. ``ThreadTransport.group(P)[rank]``); needed
        unless ``communicator`` is a built one.
    **settings
        Further constructor arguments (``block_size``, ``threshold`` for "block").

    Returns
    -------
    ndarray
        The reduced tensor, shaped like ``x``; the same on every rank.
    """
    return allreduce_async(x, communicator, pipeline, op, process_set, transport,
                           **settings).wait().output


def sparse_allreduce(x, pipeline=None, op="sum", process_set=None, transport=None):
    """SparCML's split-allgather sparse allreduce of ``x``; see :class:`SparseAllreduce`."""
    return allreduce(x, "sparse_allreduce", pipeline, op, process_set, transport)


def block_allreduce(x, pipeline=None, block_size=256, threshold=0.0, op="sum",
                    process_set=None, transport=None):
    """OmniReduce's block-sparse allreduce of ``x``; see :class:`BlockReduce`."""
    return allreduce(x, "block", pipeline, op, process_set, transport,
                     block_size=block_size, threshold=threshold)


__all__ = ["AllgatherReduce", "SparseAllreduce", "BlockReduce", "Communicator", "Reduction",
           "Handle", "Traffic", "Transport", "ThreadTransport",
           "COMMUNICATORS", "get_communicator", "allreduce", "allreduce_async",
           "sparse_allreduce", "block_allreduce", "cost"]
