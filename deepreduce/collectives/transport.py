"""Byte transports under the communicators: the interface, and threads in one process.

A transport moves byte frames between the ``size`` members of a group with two
collectives, both called by every member in the same order:

* ``alltoall(frames)``: ``frames[r]`` goes to member ``r``; returns the frame
  each member sent to this one (the own slot is never sent: it is ``b""``);
* ``allgather(frame)``: returns every member's frame, in rank order.

Each transport owns one communication thread. Every collective of every
communicator on that transport runs there, in submission order, so at most one
of them is in flight per process (Horovod, for one, keys in-flight operations by
name) and the caller's thread stays free to encode the next tensor.

This package knows no framework. The transports over real ranks live with their
frameworks: :class:`deepreduce.horovod.collectives.HorovodTransport` (Horovod's
``alltoall`` and ``allgather``) and :class:`deepreduce.torch.transport.TorchTransport`
(``torch.distributed`` on gloo or NCCL). :class:`ThreadTransport` plays several
ranks with threads of one process.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Traffic:
    """Bytes one member handed to the collectives and got back from the others.

    ``sent`` counts the bytes of the tensors this member contributes for other
    members (its own slot of an alltoall and the copy of its own frame in an
    allgather result are not counted); ``received`` counts the bytes of the
    tensors it gets from other members. ``stages`` keeps the same two numbers
    per named stage, in order.
    """

    sent: int = 0
    received: int = 0
    stages: list = field(default_factory=list)

    def add(self, stage: str, sent: int, received: int) -> None:
        self.sent += sent
        self.received += received
        self.stages.append((stage, sent, received))

    def __iadd__(self, other: "Traffic"):
        for stage in other.stages:
            self.add(*stage)
        return self


class Transport:
    """Base class: ``rank``, ``size``, the two collectives and the communication thread."""

    rank: int
    size: int

    def __init__(self):
        self._executor = None
        self._executor_lock = threading.Lock()

    def submit(self, fn, *args):
        """Run ``fn(*args)`` on this transport's communication thread; return a Future."""
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1,
                                                    thread_name_prefix="deepreduce-comm")
        return self._executor.submit(fn, *args)

    def alltoall(self, frames: list, traffic: Traffic, stage: str) -> list:
        raise NotImplementedError

    def allgather(self, frame, traffic: Traffic, stage: str) -> list:
        raise NotImplementedError

    def split(self, color: int, key: int | None = None) -> "Transport":
        """The members with the same ``color`` as a transport of their own (MPI's
        ``Comm_split``): a collective, called by every member in the same order.

        Members of the new transport are ranked by ``key`` (default: their rank
        here), ties broken by their rank here. The hierarchical exchange splits a
        transport into the ranks of a node and the ranks that hold the same shard
        on every node (:func:`deepreduce.exchange.topology.node_transports`).
        Creating the new groups may be slow (torch.distributed's ``new_group``):
        split once, keep the result.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot split into sub-groups; the transports that can: "
            "ThreadTransport, deepreduce.torch.transport.TorchTransport, "
            "deepreduce.horovod.collectives.HorovodTransport")

    def _split_members(self, color: int, key: int | None) -> list:
        """The ranks here of the members that share this member's ``color``, in the order
        of their ``(key, rank)``: every member's pair, gathered over this transport."""
        key = self.rank if key is None else key
        mine = np.array([color, key], dtype="<i8")
        gathered = self.allgather(mine.tobytes(), Traffic(), "split")
        return members_of(np.stack([np.frombuffer(f, dtype="<i8") for f in gathered]),
                          self.rank)


def members_of(pairs: np.ndarray, rank: int) -> list:
    """Given every member's ``(color, key)`` (rows, in rank order), the ranks that share
    ``rank``'s color, ordered by ``(key, rank)``.

    >>> members_of(np.array([[0, 0], [1, 0], [0, 5], [0, 1]]), 2)
    [0, 3, 2]
    """
    pairs = np.asarray(pairs, dtype=np.int64)
    same = np.flatnonzero(pairs[:, 0] == pairs[rank, 0])
    order = np.lexsort((same, pairs[same, 1]))  # by key, then by rank
    return same[order].tolist()


def split_frames(buffer, lengths) -> list:
    """Views of the consecutive frames of ``lengths`` bytes that fill ``buffer``, in order:
    how a transport cuts what one collective delivered into the members' frames."""
    view = memoryview(buffer).cast("B")
    ends = np.cumsum(lengths)
    return [view[end - length:end] for end, length in zip(ends.tolist(), list(lengths))]


class GuardedTransport(Transport):
    """Another transport that runs no task once one has failed: the failure every rank
    raised (a collective's, or a decoding error of the same bundles) is raised by every
    later task instead, so no rank starts a collective that the others would not.

    Parameters
    ----------
    bind : callable
        Returns the transport to run on, called once, at the first use: an integration
        that binds its process group late (at its first step) hands over its accessor.

    Attributes
    ----------
    failure : Exception or None
        The first failure of a task, raised again by every task after it.

    Examples
    --------
    >>> member = ThreadTransport.group(1)[0]
    >>> guarded = GuardedTransport(lambda: member)
    >>> guarded.submit(lambda: 1 / 0).exception()
    ZeroDivisionError('division by zero')
    >>> guarded.submit(lambda: "runs").exception()
    ZeroDivisionError('division by zero')
    """

    def __init__(self, bind):
        super().__init__()
        self._bind, self._inner = bind, None
        self.failure = None

    @property
    def inner(self) -> Transport:
        """The transport it runs on: ``bind()``, called at the first use."""
        if self._inner is None:
            self._inner = self._bind()
        return self._inner

    @property
    def rank(self):
        return self.inner.rank

    @property
    def size(self):
        return self.inner.size

    def submit(self, fn, *args):
        def guarded():
            if self.failure is not None:
                raise self.failure
            try:
                return fn(*args)
            except Exception as exc:  # noqa: BLE001 - every rank raises the same
                self.failure = exc
                raise
        return self.inner.submit(guarded)

    def allgather(self, frame, traffic, stage):
        return self.inner.allgather(frame, traffic, stage)

    def alltoall(self, frames, traffic, stage):
        return self.inner.alltoall(frames, traffic, stage)

    def split(self, color, key=None):
        return self.inner.split(color, key)


class ThreadTransport(Transport):
    """``size`` members in one process, one per thread: for tests and experiments.

    Build the group with :meth:`group`; hand member ``r`` to the thread that
    plays rank ``r``. The collectives meet at a barrier, as real ranks would.

    Examples
    --------
    >>> from concurrent.futures import ThreadPoolExecutor
    >>> from deepreduce.collectives.transport import ThreadTransport, Traffic
    >>> members = ThreadTransport.group(3)
    >>> with ThreadPoolExecutor(3) as pool:
    ...     out = list(pool.map(lambda t: [bytes(f) for f in
    ...                                     t.allgather(bytes([t.rank]), Traffic(), "demo")],
    ...                         members))
    >>> out[0]
    [b'\\x00', b'\\x01', b'\\x02']
    """

    def __init__(self, rank, size, shared):
        super().__init__()
        self.rank, self.size, self._shared = rank, size, shared

    @classmethod
    def group(cls, size: int, timeout: float | None = None) -> list:
        """``size`` members; a collective waiting longer than ``timeout`` seconds fails
        with ``threading.BrokenBarrierError`` on every member."""
        if size < 1:
            raise ValueError(f"a group needs at least one member, got size={size}")
        shared = {"barrier": threading.Barrier(size, timeout=timeout), "slots": [None] * size}
        return [cls(rank, size, shared) for rank in range(size)]

    def _exchange(self, item):
        slots, barrier = self._shared["slots"], self._shared["barrier"]
        slots[self.rank] = item
        barrier.wait()
        everything = list(slots)
        barrier.wait()  # nobody overwrites a slot before all have read
        return everything

    def alltoall(self, frames, traffic, stage):
        everything = self._exchange([b"" if r == self.rank else bytes(f)
                                     for r, f in enumerate(frames)])
        received = [everything[r][self.rank] for r in range(self.size)]
        traffic.add(stage, sum(map(len, everything[self.rank])), sum(map(len, received)))
        return [memoryview(f) for f in received]

    def allgather(self, frame, traffic, stage):
        everything = self._exchange(bytes(frame))
        own = len(everything[self.rank])
        traffic.add(stage, own, sum(map(len, everything)) - own)
        return [memoryview(f) for f in everything]

    def split(self, color, key=None):
        """The members of this member's ``color`` as a group of their own (see
        :meth:`Transport.split`).

        Examples
        --------
        >>> from concurrent.futures import ThreadPoolExecutor
        >>> members = ThreadTransport.group(4)
        >>> with ThreadPoolExecutor(4) as pool:
        ...     subs = list(pool.map(lambda t: t.split(t.rank % 2, key=-t.rank), members))
        >>> [(s.rank, s.size) for s in subs]
        [(1, 2), (1, 2), (0, 2), (0, 2)]
        """
        key = self.rank if key is None else key
        members = members_of(np.array(self._exchange((int(color), int(key)))), self.rank)
        # the first member makes the new group's meeting place and hands it to the others
        fresh = {"barrier": threading.Barrier(len(members),
                                              timeout=self._shared["barrier"]._timeout),
                 "slots": [None] * len(members)} if members[0] == self.rank else None
        shared = self._exchange(fresh)[members[0]]
        return ThreadTransport(members.index(self.rank), len(members), shared)


def get_transport(transport=None, process_set=None) -> Transport:
    """``transport`` itself, checked; ValueError, saying what to pass, when there is none.

    The collectives know no framework and have no default transport:
    :mod:`deepreduce.horovod.collectives` and :mod:`deepreduce.torch` supply
    Horovod's and torch.distributed's.
    """
    if transport is None:
        if process_set is not None:
            raise ValueError(
                "a process_set alone does not say how to move the bytes: deepreduce.collectives "
                "runs over the transport it is given. For a Horovod process set use the "
                "communicators of deepreduce.horovod.collectives, or pass transport="
                "deepreduce.horovod.collectives.horovod_transport(process_set)")
        raise ValueError(
            "no transport: deepreduce.collectives runs over the transport it is given. Pass "
            "transport= (deepreduce.horovod.collectives.HorovodTransport, "
            "deepreduce.torch.transport.TorchTransport, or a member of "
            "ThreadTransport.group(P) in one process), or use the framework wrappers, which "
            "supply their own: deepreduce.horovod.collectives (allreduce, get_communicator) "
            "and deepreduce.torch")
    if process_set is not None:
        raise ValueError("give a transport or a process_set, not both")
    if not isinstance(transport, Transport):
        raise ValueError(f"transport must be a deepreduce.collectives Transport, got "
                         f"{type(transport).__name__}")
    return transport
