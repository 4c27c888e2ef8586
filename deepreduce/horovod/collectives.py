"""deepreduce's reducing collectives over Horovod, on TensorFlow tensors and numpy arrays.

:mod:`deepreduce.collectives` knows no framework: its communicators move bytes
over the :class:`~deepreduce.collectives.Transport` they are given. This module
gives them Horovod's:

* :class:`HorovodTransport`, ``hvd.alltoall`` and ``hvd.allgather`` on uint8
  tensors of one process set, split into the process sets of sub-groups by
  :meth:`HorovodTransport.split` (what ``communicator="hierarchical"`` needs),
  and :func:`horovod_transport`, the shared one of a process set;
  :func:`hierarchical_process_sets`, the sets to register at ``hvd.init`` when
  dynamic process sets are off;
* :class:`AllgatherReduce`, :class:`SparseAllreduce`, :class:`BlockReduce` and
  :func:`get_communicator`: the communicators of :mod:`deepreduce.collectives`
  (same parameters), over Horovod's transport of their ``process_set`` (the
  global one by default) unless given another, taking ``op=hvd.Sum`` or
  ``hvd.Average`` and eager TensorFlow tensors;
* :func:`allreduce` and :func:`allreduce_async`, the same over Horovod, by
  communicator name.

Inputs may be numpy arrays, :class:`~deepreduce.SparseTensor`, and eager
``tf.Tensor`` or ``tf.IndexedSlices`` (repeated rows are summed; nothing is
densified before the sparsifier). For TensorFlow input the output is a
``tf.Tensor`` of the input's dense shape; otherwise a numpy array.

Examples
--------
In a script started with ``horovodrun -np 4 -H localhost:4 --gloo``::

    import horovod.tensorflow as hvd, deepreduce as dr
    from deepreduce.horovod import collectives as dc
    hvd.init()
    pipe = dr.Pipeline(dr.TopK(0.01), index="eliasfano", value="fp16")
    total = dc.allreduce(grad, "sparse_allreduce", pipeline=pipe)   # a tf.Tensor for one
    comm = dc.BlockReduce(pipe, block_size=256, op=hvd.Average)
    reduction = comm.reduce(emb_grad)      # Reduction(output, sent, traffic, algorithm)
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import threading
import zlib

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from deepreduce import collectives
from deepreduce.collectives import Communicator, Handle, Reduction
from deepreduce.collectives.communicator import op_name as _op_name
from deepreduce.exchange.topology import Topology
from deepreduce.collectives.transport import Traffic, Transport, members_of, split_frames
from deepreduce.sparse import SparseTensor

__all__ = ["HorovodTransport", "horovod_transport", "hierarchical_process_sets", "op_name",
           "from_tensorflow",
           "AllgatherReduce", "SparseAllreduce", "BlockReduce", "get_communicator",
           "allreduce", "allreduce_async"]


class HorovodTransport(Transport):
    """Horovod's ``alltoall`` and ``allgather`` on uint8 tensors of one process set.

    The operations are traced once into ``tf.function``s with fixed names:
    in eager mode Horovod ignores ``name=`` and keys every operation by its type
    (two eager allgathers in flight at once fail with "a tensor with the same
    name ... is currently being processed"), whereas a traced operation keeps
    its name. Ours are therefore never confused with the user's own eager
    collectives, and the communication thread keeps ours to one at a time.

    Parameters
    ----------
    process_set : hvd.ProcessSet, optional
        The ranks to communicate among; the global process set by default.
        This process must be one of them. Members are ranked as Horovod
        ranks them, by global rank (a transport made by :meth:`split` may rank
        them otherwise: by their keys).
    """

    def __init__(self, process_set=None, _order=None):
        super().__init__()
        if not hvd.is_initialized():
            raise RuntimeError("Horovod is not initialised: call hvd.init() before "
                               "reducing over Horovod")
        self.process_set = hvd.global_process_set if process_set is None else process_set
        if not self.process_set.included():
            raise ValueError(f"this process (rank {hvd.rank()}) is not in {self.process_set}")
        self.size = self.process_set.size()
        # _order[r]: the process set's rank of this transport's member r (split ranks the
        # members by key; Horovod always by global rank)
        self._order = None if _order is None or list(_order) == list(range(self.size)) \
            else [int(r) for r in _order]
        self.rank = self.process_set.rank() if self._order is None else \
            self._order.index(self.process_set.rank())
        tag = f"deepreduce_collectives_ps{self.process_set.process_set_id}"
        if self._order is not None:  # never the same names as the set's shared transport
            tag += "_order" + "_".join(map(str, self._order))
        process_set = self.process_set

        @tf.function(input_signature=[tf.TensorSpec([None], tf.uint8),
                                      tf.TensorSpec([None], tf.int32)])
        def alltoall(data, splits):
            return hvd.alltoall(data, splits=splits, name=f"{tag}_alltoall",
                                process_set=process_set)

        @tf.function(input_signature=[tf.TensorSpec([None], tf.uint8)])
        def allgather(data):
            return hvd.allgather(data, name=f"{tag}_allgather", process_set=process_set)

        self._alltoall, self._allgather = alltoall, allgather

    def _in_set_order(self, per_member: list) -> list:
        """``per_member`` (this transport's rank order) in the process set's rank order."""
        if self._order is None:
            return list(per_member)
        out = [None] * self.size
        for member, position in enumerate(self._order):
            out[position] = per_member[member]
        return out

    def _in_member_order(self, per_position: list) -> list:
        """``per_position`` (the process set's rank order) in this transport's rank order."""
        if self._order is None:
            return per_position
        return [per_position[position] for position in self._order]

    def alltoall(self, frames, traffic, stage):
        frames = self._in_set_order([b"" if r == self.rank else f for r, f in enumerate(frames)])
        lengths = [len(f) for f in frames]
        data = np.frombuffer(b"".join(frames), dtype=np.uint8)
        received, splits = self._alltoall(tf.constant(data),
                                          tf.constant(lengths, dtype=tf.int32))
        received = received.numpy()
        traffic.add(stage, data.size, received.size)
        return self._in_member_order(split_frames(received, splits.numpy()))

    def allgather(self, frame, traffic, stage):
        data = np.frombuffer(bytes(frame), dtype=np.uint8)
        # Horovod's allgather does not return the lengths: gather them alongside
        # as 8 bytes per member, the only bookkeeping our frames do not carry.
        head = np.array([data.size], dtype="<u8").view(np.uint8)
        gathered = self._allgather(tf.constant(np.concatenate([head, data]))).numpy()
        own = head.size + data.size
        traffic.add(stage, own, gathered.size - own)
        return self._in_member_order(_split_prefixed(gathered, self.size))

    def split(self, color, key=None):
        """The members of this member's ``color`` as a transport over a Horovod process
        set of their own (see :meth:`deepreduce.collectives.Transport.split`).

        A collective: every member calls it, in the same order. The members
        first allgather their ``(color, key, global rank)``; then each color's
        ranks are looked up in Horovod's process set table, and a set already
        registered (at ``hvd.init(process_sets=...)``, by ``hvd.add_process_set``
        or by an earlier split) is reused. The missing ones are added with
        ``hvd.add_process_set``, which every process of the world must call for
        every new set, in the same order: so only a transport of the global
        process set adds sets (each rank adds every color's set, in the order
        of the colors); a smaller one must find them registered.

        Horovod ranks a process set's members by global rank; the new transport
        ranks them by ``key`` (ties by their rank here) and reorders the frames
        of its collectives where the two differ.

        Parameters
        ----------
        color : int
            The members with the same color form one new transport.
        key : int, optional
            This member's place in it; its rank here by default.

        Returns
        -------
        HorovodTransport
            Over the process set of this member's color: the shared transport of
            the set (:func:`horovod_transport`) where the key order is Horovod's.

        Raises
        ------
        ValueError
            On every member, when a set is missing and cannot be added: dynamic
            process sets are off on some rank (run with
            ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` or ``hvd.init(process_sets="dynamic")``,
            or register the sets at ``hvd.init(process_sets=...)``, e.g.
            :func:`hierarchical_process_sets`), or this transport is not the
            global process set's.
        RuntimeError
            On every member, when the ranks' process set tables differ.
        """
        key = self.rank if key is None else key
        table = _process_set_table()
        mine = np.array([color, key, hvd.rank(), _dynamic_process_sets(), _table_digest(table)],
                        dtype=np.int64)
        rows = np.stack([np.frombuffer(f, dtype="<i8") for f in
                         self.allgather(mine.astype("<i8").tobytes(), Traffic(), "split")])
        if len(set(rows[:, 4].tolist())) > 1:
            raise RuntimeError(
                "HorovodTransport.split: the ranks' Horovod process set tables differ (ranks "
                f"{rows[:, 2].tolist()} have digests {rows[:, 4].tolist()}): every process must "
                "add and remove process sets in the same order")
        colors = sorted(set(rows[:, 0].tolist()))
        wanted = {c: sorted(rows[rows[:, 0] == c, 2].tolist()) for c in colors}
        missing = [ranks for ranks in wanted.values() if tuple(ranks) not in table]
        if missing:
            whole_world = self.size == hvd.size()
            if not whole_world:
                raise ValueError(
                    f"HorovodTransport.split: no Horovod process set holds the ranks "
                    f"{missing}, and only a transport of the global process set can add one "
                    "(hvd.add_process_set is called by every process of the world). Register "
                    "them on every rank first: hvd.init(process_sets=[hvd.ProcessSet(ranks), "
                    "...]) or hvd.add_process_set(ranks), in the same order")
            off = rows[rows[:, 3] == 0, 2].tolist()
            if off:
                raise ValueError(
                    f"HorovodTransport.split: no Horovod process set holds the ranks "
                    f"{missing}, and dynamic process sets are off on ranks {off}, so it cannot "
                    "be added. Run every rank with HOROVOD_DYNAMIC_PROCESS_SETS=1 (or "
                    "hvd.init(process_sets='dynamic')), or register the sets at start: "
                    "hvd.init(process_sets=[hvd.ProcessSet(ranks), ...]) (for the "
                    "hierarchical communicator: deepreduce.horovod.collectives."
                    "hierarchical_process_sets(size, local_size))")
            for ranks in missing:  # every rank, every set, in the order of the colors
                try:
                    table[tuple(ranks)] = hvd.add_process_set(ranks).process_set_id
                except ValueError as exc:  # e.g. the variable was set after hvd.init
                    raise ValueError(
                        f"HorovodTransport.split: Horovod refused to add the process set "
                        f"{ranks} ({exc}); run every rank with HOROVOD_DYNAMIC_PROCESS_SETS=1 "
                        "set before hvd.init, or register the sets at hvd.init(process_sets="
                        "...)") from exc
        process_set = _process_set(wanted[int(color)], table[tuple(wanted[int(color)])])
        members = members_of(rows[:, :2], self.rank)  # ranks here, in key order
        order = [wanted[int(color)].index(int(rows[m, 2])) for m in members]
        if order == list(range(len(order))):
            return horovod_transport(process_set)
        return HorovodTransport(process_set, _order=order)


def _process_set_table() -> dict:
    """Horovod's registered process sets: ``{tuple of global ranks: process_set_id}``."""
    from horovod.tensorflow.mpi_ops import _basics  # the table has no public accessor
    return {tuple(ranks): int(ps_id) for ps_id, ranks in
            _basics._get_process_set_ids_and_ranks().items()}


def _table_digest(table: dict) -> int:
    return zlib.crc32(repr(sorted(table.items())).encode())


def _dynamic_process_sets() -> bool:
    """Whether Horovod was told it may add process sets after ``hvd.init``
    (``HOROVOD_DYNAMIC_PROCESS_SETS``, which ``hvd.init(process_sets="dynamic")`` sets)."""
    value = os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "").strip().lower()
    if value in ("true", "yes", "on"):
        return True
    try:
        return int(value) > 0
    except ValueError:
        return False


def _process_set(ranks: list, process_set_id: int):
    """A ProcessSet object for a registered set (the global one is Horovod's own)."""
    if process_set_id == hvd.global_process_set.process_set_id:
        return hvd.global_process_set
    process_set = hvd.ProcessSet(list(ranks))
    process_set.process_set_id = process_set_id
    return process_set


def hierarchical_process_sets(size: int, local_size: int) -> list:
    """The process sets ``communicator="hierarchical"`` splits the global set into, to
    register at ``hvd.init(process_sets=...)`` where dynamic process sets are off: the
    ranks of each node, then the ranks with each local rank (one per node); a set of
    every rank is left out (it is the global one).

    Parameters
    ----------
    size : int
        The number of ranks (horovodrun's ``HOROVOD_SIZE``, before ``hvd.init``).
    local_size : int
        Ranks per node, as given to the communicator.

    Examples
    --------
    >>> [ps.ranks for ps in hierarchical_process_sets(4, 2)]
    [[0, 1], [2, 3], [0, 2], [1, 3]]
    """
    topology = Topology(int(size), int(local_size), 0)
    nodes = [[topology.global_rank(n, j) for j in range(topology.local_size)]
             for n in range(topology.nodes)]
    shards = [[topology.global_rank(n, j) for n in range(topology.nodes)]
              for j in range(topology.local_size)]
    return [hvd.ProcessSet(ranks) for ranks in nodes + shards if len(ranks) < topology.size]


def _split_prefixed(buffer: np.ndarray, count: int) -> list:
    view, frames, pos = memoryview(buffer).cast("B"), [], 0
    for _ in range(count):
        (length,) = np.frombuffer(view[pos:pos + 8], dtype="<u8")
        frames.append(view[pos + 8:pos + 8 + int(length)])
        pos += 8 + int(length)
    return frames


_TRANSPORTS: dict = {}
_LOCK = threading.Lock()


def horovod_transport(process_set=None) -> HorovodTransport:
    """The shared transport of a Horovod process set (the global one by default)."""
    key = (hvd.global_process_set if process_set is None else process_set).process_set_id
    with _LOCK:
        transport = _TRANSPORTS.get(key)
        if transport is None:
            transport = _TRANSPORTS[key] = HorovodTransport(process_set)
        return transport


def op_name(op) -> str:
    """``"sum"`` or ``"average"`` from a name or Horovod's ``hvd.Sum`` / ``hvd.Average``:
    what the collectives take."""
    if not isinstance(op, str):
        if op == hvd.Sum:
            return "sum"
        if op == hvd.Average:
            return "average"
        raise ValueError(f"op must be 'sum' or 'average' (or hvd.Sum / hvd.Average), got {op!r}")
    return _op_name(op)


def _is_tensorflow(x) -> bool:
    return isinstance(x, (tf.Tensor, tf.Variable, tf.IndexedSlices))


def from_tensorflow(x):
    """``x`` as the collectives take it: an eager ``tf.IndexedSlices`` as a
    :class:`~deepreduce.SparseTensor` of its dense shape (repeated rows summed), an
    eager ``tf.Tensor`` or variable as a numpy array, anything else as it is."""
    if isinstance(x, tf.IndexedSlices):
        if x.dense_shape is None:
            raise ValueError("tf.IndexedSlices without dense_shape: the dense shape is needed")
        return SparseTensor.from_rows(np.asarray(x.values), np.asarray(x.indices).reshape(-1),
                                      np.asarray(x.dense_shape))
    if isinstance(x, (tf.Tensor, tf.Variable)):
        return x.numpy()
    return x


def _as_tensorflow(reduction: Reduction) -> Reduction:
    return dataclasses.replace(reduction, output=tf.convert_to_tensor(reduction.output))


class _TensorFlowHandle:
    """A :class:`~deepreduce.collectives.Handle` whose outputs are ``tf.Tensor`` where
    the inputs were TensorFlow's (``tensorflow[i]``)."""

    def __init__(self, handle: Handle, tensorflow: list):
        self._handle, self._tensorflow = handle, tensorflow

    def done(self) -> bool:
        return self._handle.done()

    def wait(self, timeout: float | None = None):
        """Block until the reduction is complete; re-raise its error, on every rank."""
        result = self._handle.wait(timeout)
        if isinstance(result, Reduction):
            return _as_tensorflow(result)
        return [_as_tensorflow(r) if tensorflow else r
                for r, tensorflow in zip(result, self._tensorflow)]


class _OverHorovod:
    """What a communicator of :mod:`deepreduce.collectives` gains over Horovod:
    Horovod's transport of its ``process_set`` unless it was given a transport,
    ``op=hvd.Sum`` / ``hvd.Average``, and eager TensorFlow inputs."""

    def __init__(self, *args, **kwargs):
        arguments = inspect.signature(super().__init__).bind(*args, **kwargs).arguments
        if "op" in arguments:
            arguments["op"] = op_name(arguments["op"])
        super().__init__(**arguments)

    @property
    def transport(self):
        if self._transport is None:  # looked up at the first reduction: after hvd.init()
            self._transport = horovod_transport(self._process_set)
        return self._transport

    def reduce_async(self, x) -> Handle:
        handle = super().reduce_async(from_tensorflow(x))
        return _TensorFlowHandle(handle, [True]) if _is_tensorflow(x) else handle

    def reduce_many_async(self, xs) -> Handle:
        xs = list(xs)
        tensorflow = [_is_tensorflow(x) for x in xs]
        handle = super().reduce_many_async([from_tensorflow(x) for x in xs])
        return _TensorFlowHandle(handle, tensorflow) if any(tensorflow) else handle


def _over_horovod(cls: type) -> type:
    name = cls.__name__
    return type(name, (_OverHorovod, cls), {
        "__module__": __name__, "__qualname__": name,
        "__doc__": f"""{name} of :mod:`deepreduce.collectives` (the same parameters), over
    Horovod's transport of ``process_set`` (the global process set by default) unless
    ``transport`` is given; ``op`` may be ``hvd.Sum`` or ``hvd.Average``, and inputs
    eager ``tf.Tensor`` or ``tf.IndexedSlices`` (the output is then a ``tf.Tensor``)."""})


#: deepreduce.collectives.COMMUNICATORS' classes over Horovod, by the same names.
_OVER_HOROVOD = {name: _over_horovod(cls) for name, cls in collectives.COMMUNICATORS.items()}
AllgatherReduce = _OVER_HOROVOD["allgather"]
SparseAllreduce = _OVER_HOROVOD["sparse_allreduce"]
BlockReduce = _OVER_HOROVOD["block"]


def get_communicator(communicator="sparse_allreduce", **kwargs) -> Communicator:
    """A communicator over Horovod from its name (``**kwargs`` go to its constructor),
    or itself; see :func:`deepreduce.collectives.get_communicator`."""
    if isinstance(communicator, str) and communicator in _OVER_HOROVOD:
        return _OVER_HOROVOD[communicator](**kwargs)
    return collectives.get_communicator(communicator, **kwargs)


def allreduce_async(x, communicator="sparse_allreduce", pipeline=None, op="sum",
                    process_set=None, transport=None, **settings) -> Handle:
    """Start reducing ``x`` over the ranks of ``process_set``; ``handle.wait().output``
    is the result. See :func:`allreduce`."""
    if not isinstance(communicator, Communicator):
        op = op_name(op)
        if transport is None:
            transport, process_set = horovod_transport(process_set), None
    handle = collectives.allreduce_async(from_tensorflow(x), communicator, pipeline, op,
                                         process_set, transport, **settings)
    return _TensorFlowHandle(handle, [True]) if _is_tensorflow(x) else handle


def allreduce(x, communicator="sparse_allreduce", pipeline=None, op="sum", process_set=None,
              transport=None, **settings):
    """Reduce ``x`` over the ranks of a Horovod process set with the named communicator.

    Parameters
    ----------
    x : ndarray, SparseTensor, tf.Tensor or tf.IndexedSlices
        TensorFlow tensors eager.
    communicator : {"sparse_allreduce", "block", "allgather"} or Communicator
    pipeline : Pipeline, optional
    op : {"sum", "average"} or hvd.Sum / hvd.Average
    process_set : hvd.ProcessSet, optional
        The ranks to reduce over; the global process set by default.
    transport : Transport, optional
        Instead of Horovod's (e.g. ``ThreadTransport.group(P)[rank]``).
    **settings
        Further constructor arguments (``block_size``, ``threshold`` for "block").

    Returns
    -------
    ndarray or tf.Tensor
        The reduced dense tensor, shaped like ``x`` (a ``tf.Tensor`` for
        TensorFlow input); the same on every rank.
    """
    return allreduce_async(x, communicator, pipeline, op, process_set, transport,
                           **settings).wait().output

