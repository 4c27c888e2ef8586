"""Byte transports under the communicators: Horovod's, torch.distributed's, or threads.

A transport moves byte frames between the ``size`` members of a group with two
collectives, both called by every member in the same order:

* ``alltoall(frames)``: ``frames[r]`` goes to member ``r``; returns the frame
  each member sent to this one (the own slot is never sent: it is ``b""``);
* ``allgather(frame)``: returns every member's frame, in rank order.

Each transport owns one communication thread. Every collective of every
communicator on that transport runs there, in submission order, so at most one
of them is in flight per process (Horovod keys in-flight operations by name)
and the caller's thread stays free to encode the next tensor.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
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


class HorovodTransport(Transport):
    """Horovod's ``alltoall`` and ``allgather`` on uint8 tensors of one process set.

    The operations are traced once into ``tf.function``s with fixed names:
    in eager mode Horovod ignores ``name=`` and keys every operation by its type
    (two eager allgathers in flight at once fail with "a tensor with the same
    name ... is currently being processed"), whereas a traced operation keeps
    its name. Ours are therefore never confused with the user's own eager
    collectives, and the communication thread keeps ours to one at a time.
    """

    def __init__(self, process_set=None):
        super().__init__()
        import horovod.tensorflow as hvd
        import tensorflow as tf

        if not hvd.is_initialized():
            raise RuntimeError("Horovod is not initialised: call hvd.init() before using "
                               "deepreduce.collectives")
        self.process_set = hvd.global_process_set if process_set is None else process_set
        if not self.process_set.included():
            raise ValueError(f"this process (rank {hvd.rank()}) is not in {self.process_set}")
        self.rank, self.size = self.process_set.rank(), self.process_set.size()
        self._tf = tf
        tag = f"deepreduce_collectives_ps{self.process_set.process_set_id}"
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

    def alltoall(self, frames, traffic, stage):
        lengths = [0 if r == self.rank else len(f) for r, f in enumerate(frames)]
        data = np.frombuffer(b"".join(f for r, f in enumerate(frames) if r != self.rank),
                             dtype=np.uint8)
        received, splits = self._alltoall(self._tf.constant(data),
                                          self._tf.constant(lengths, dtype=self._tf.int32))
        received = received.numpy()
        traffic.add(stage, data.size, received.size)
        return _split(received, splits.numpy())

    def allgather(self, frame, traffic, stage):
        data = np.frombuffer(bytes(frame), dtype=np.uint8)
        # Horovod's allgather does not return the lengths: gather them alongside
        # as 8 bytes per member, the only bookkeeping our frames do not carry.
        head = np.array([data.size], dtype="<u8").view(np.uint8)
        gathered = self._allgather(self._tf.constant(np.concatenate([head, data]))).numpy()
        own = head.size + data.size
        traffic.add(stage, own, gathered.size - own)
        return _split_prefixed(gathered, self.size)


class TorchTransport(Transport):
    """``torch.distributed`` collectives on uint8 tensors of one process group.

    Frames travel as byte tensors on ``device``: the CPU for gloo, the current
    CUDA device for NCCL (NCCL moves only GPU memory), so the same code serves
    both. Variable-length frames are padded to the longest one after their
    lengths are gathered (gloo and NCCL move equal-sized tensors only);
    ``Traffic`` counts the bytes that really cross, padding included.

    Parameters
    ----------
    process_group : torch.distributed.ProcessGroup, optional
        The group to communicate in; the default (world) group when None.
        Its backend must be gloo or NCCL. The transport holds it weakly, so
        ``destroy_process_group`` really destroys it; the transport's
        collectives then raise RuntimeError.
    device : torch.device or str, optional
        Where the byte tensors live; by default the CPU for gloo and
        ``cuda:<current device>`` for NCCL.
    """

    BACKENDS = ("gloo", "nccl")

    def __init__(self, process_group=None, device=None):
        super().__init__()
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialised: call "
                               "torch.distributed.init_process_group first")
        group = dist.group.WORLD if process_group is None else process_group
        # held weakly: a group kept alive after destroy_process_group is destroyed at
        # interpreter exit instead, when gloo's threads can no longer take the GIL
        # to free the tensors they hold, and the process aborts
        self._group = weakref.ref(group)
        backend = str(dist.get_backend(group)).lower()
        if backend not in self.BACKENDS:
            raise ValueError(f"process group backend {backend!r} is not supported; deepreduce "
                             f"runs over {' or '.join(self.BACKENDS)}")
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given process group")
        self.size = dist.get_world_size(group)
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                      else torch.device("cpu"))
        self.device, self.backend = torch.device(device), backend
        self._torch, self._dist = torch, dist
        # The tensors of the last collective, kept until the next one starts (and, at
        # exit, until gloo lets go of them: _release_at_exit). A gloo thread drops its
        # references just after a collective completes; if it dropped the last one it
        # would take the GIL to free their Python objects, and a thread that waits for
        # the GIL while the interpreter finalises aborts the process ("terminate
        # called without an active exception", pytorch/pytorch#179291).
        self._held = []
        _WITH_HELD_TENSORS.add(self)

    @property
    def group(self):
        """The process group; RuntimeError once it has been destroyed."""
        group = self._group()
        if group is None:
            raise RuntimeError("the process group of this transport has been destroyed "
                               "(torch.distributed.destroy_process_group)")
        return group

    def _to_device(self, array: np.ndarray):
        return self._torch.from_numpy(array).to(self.device)

    def _to_host(self, tensor) -> np.ndarray:
        return tensor.cpu().numpy()

    def _wait_until_released(self, deadline: float) -> None:
        """Wait (until ``deadline``, a ``time.monotonic()``) until no collective holds
        the tensors of the last one: then this thread is the one that frees them."""
        while any(_held_elsewhere(t) for t in self._held) and time.monotonic() < deadline:
            time.sleep(0.001)  # lets a gloo thread take the GIL and drop its references

    def _all_gather(self, local) -> list:
        everyone = [self._torch.empty_like(local) for _ in range(self.size)]
        self._dist.all_gather(everyone, local, group=self.group)
        self._held += [local, *everyone]
        return everyone

    def _lengths(self, mine: np.ndarray) -> np.ndarray:
        """Every member's ``mine`` (int64 vector), stacked in rank order."""
        self._held = []  # a new collective: the last one's tensors are free to go
        everyone = self._all_gather(self._to_device(np.ascontiguousarray(mine, dtype=np.int64)))
        return np.stack([self._to_host(t) for t in everyone])

    def allgather(self, frame, traffic, stage):
        data = np.frombuffer(frame, dtype=np.uint8)
        lengths = self._lengths(np.array([data.size]))[:, 0]
        longest = int(lengths.max())
        padded = np.zeros(longest, dtype=np.uint8)
        padded[:data.size] = data
        everyone = self._all_gather(self._to_device(padded))
        gathered = self._to_host(self._torch.cat(everyone)) if longest else padded
        traffic.add(stage, 8 + longest, (self.size - 1) * (8 + longest))
        view = memoryview(gathered).cast("B")
        return [view[r * longest:r * longest + int(n)] for r, n in enumerate(lengths)]

    def alltoall(self, frames, traffic, stage):
        sizes = np.array([0 if r == self.rank else len(f) for r, f in enumerate(frames)])
        incoming = self._lengths(sizes)[:, self.rank]
        data = np.frombuffer(b"".join(f for r, f in enumerate(frames) if r != self.rank),
                             dtype=np.uint8)
        received = self._torch.empty(int(incoming.sum()), dtype=self._torch.uint8,
                                     device=self.device)
        outgoing = self._to_device(data.copy())
        self._dist.all_to_all_single(received, outgoing, incoming.tolist(), sizes.tolist(),
                                     group=self.group)
        self._held += [received, outgoing]
        traffic.add(stage, 8 * self.size + data.size, 8 * self.size + received.numel())
        return _split(self._to_host(received), incoming)


_WITH_HELD_TENSORS = weakref.WeakSet()


def _held_elsewhere(tensor) -> bool:
    """Whether something besides this Python object holds ``tensor`` (a collective's
    work, say); False where torch cannot tell (``Tensor._use_count`` is private API)."""
    use_count = getattr(tensor, "_use_count", None)
    return use_count is not None and use_count() > 1


@atexit.register
def _release_at_exit(timeout: float = 2.0) -> None:
    """Before the interpreter finalises, let gloo's threads drop the last collectives'
    tensors, so that it is the exiting thread that frees them (see TorchTransport)."""
    deadline = time.monotonic() + timeout
    for transport in list(_WITH_HELD_TENSORS):
        transport._wait_until_released(deadline)


def _split(buffer: np.ndarray, lengths) -> list:
    view = memoryview(buffer).cast("B")
    ends = np.cumsum(lengths)
    return [view[end - length:end] for end, length in zip(ends.tolist(), list(lengths))]


def _split_prefixed(buffer: np.ndarray, count: int) -> list:
    view, frames, pos = memoryview(buffer).cast("B"), [], 0
    for _ in range(count):
        (length,) = np.frombuffer(view[pos:pos + 8], dtype="<u8")
        frames.append(view[pos + 8:pos + 8 + int(length)])
        pos += 8 + int(length)
    return frames


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


_HOROVOD_TRANSPORTS: dict = {}
_HOROVOD_LOCK = threading.Lock()


def horovod_transport(process_set=None) -> HorovodTransport:
    """The shared transport of a Horovod process set (the global one by default)."""
    import horovod.tensorflow as hvd

    key = (hvd.global_process_set if process_set is None else process_set).process_set_id
    with _HOROVOD_LOCK:
        transport = _HOROVOD_TRANSPORTS.get(key)
        if transport is None:
            transport = _HOROVOD_TRANSPORTS[key] = HorovodTransport(process_set)
        return transport


def get_transport(transport=None, process_set=None) -> Transport:
    """``transport`` itself when given, else Horovod's for ``process_set``."""
    if transport is not None:
        if process_set is not None:
            raise ValueError("give a transport or a process_set, not both")
        if not isinstance(transport, Transport):
            raise ValueError(f"transport must be a deepreduce.collectives Transport, got "
                             f"{type(transport).__name__}")
        return transport
    return horovod_transport(process_set)
