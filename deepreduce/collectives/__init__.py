"""Reducing collectives for sparse tensors over Horovod (SparCML, OmniReduce, DeepReduce).

Three communicators, chosen by name, all built on Horovod's own ``alltoall``
and ``allgather`` and all applying a :class:`~deepreduce.Pipeline` (sparsifier,
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

Each works on numpy arrays, :class:`~deepreduce.SparseTensor`, and eager
``tf.Tensor`` / ``tf.IndexedSlices``; each has a blocking ``reduce`` and a
``reduce_async`` that returns a handle; every rank gets the same result. The
bytes each rank sends and receives are counted (``Reduction.traffic``) and
predicted by :mod:`deepreduce.collectives.cost`. See docs/collectives.md.

Examples
--------
In a script started with ``horovodrun -np 4 -H localhost:4 --gloo``::

    import horovod.tensorflow as hvd, deepreduce as dr
    from deepreduce import collectives
    hvd.init()
    pipe = dr.Pipeline(dr.TopK(0.01), index="eliasfano", value="fp16")
    total = collectives.allreduce(grad, "sparse_allreduce", pipeline=pipe)
"""

from deepreduce.collectives.transport import (HorovodTransport, ThreadTransport,
                                              TorchTransport, Traffic, Transport,
                                              get_transport)
from deepreduce.collectives.base import Communicator, Handle, Reduction, fail_collectively
from deepreduce.collectives.allgather import AllgatherReduce
from deepreduce.collectives.sparse_allreduce import SparseAllreduce
from deepreduce.collectives.block import BlockReduce
from deepreduce.collectives import cost  # noqa: F401

#: The communicators by the names the Horovod wrappers accept.
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
    x : ndarray, SparseTensor, tf.Tensor or tf.IndexedSlices
    communicator : {"sparse_allreduce", "block", "allgather"} or Communicator
    pipeline : Pipeline, optional
    op : {"sum", "average"}
    process_set : horovod ProcessSet, optional
    transport : Transport, optional
        Instead of Horovod (e.g. ``ThreadTransport.group(P)[rank]``).
    **settings
        Further constructor arguments (``block_size``, ``threshold`` for "block").

    Returns
    -------
    ndarray or tf.Tensor
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
           "Handle", "Traffic", "Transport", "HorovodTransport", "ThreadTransport",
           "TorchTransport",
           "COMMUNICATORS", "get_communicator", "allreduce", "allreduce_async",
           "sparse_allreduce", "block_allreduce", "cost"]
