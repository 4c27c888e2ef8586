"""``torch.distributed``'s collectives as a deepreduce transport (gloo or NCCL).

:class:`TorchTransport` moves the byte frames of :mod:`deepreduce.collectives`'
communicators and of :class:`~deepreduce.exchange.GradientExchange` between the
ranks of a process group; :func:`deepreduce.torch.transport_of` gives the shared
one of a group, over process groups of its own (:meth:`TorchTransport.private`).
A collective that fails raises :class:`CollectiveError`, naming it.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref

import numpy as np
import torch
import torch.distributed as dist

from deepreduce.collectives.transport import Transport, members_of, split_frames

__all__ = ["TorchTransport", "CollectiveError", "transport_of"]


class CollectiveError(RuntimeError):
    """A collective of deepreduce's failed: a peer died or left, a timeout, a destroyed
    group. The message names the rank (global, as torchrun's log prefixes do), the
    collective and the stage (``what``: "allgather of 'bundles'") and the reason; the
    exception torch.distributed raised is the ``__cause__``. The DDP hook raises one
    that also names the bucket (``bucket``; None for the transport's own).
    """

    def __init__(self, what: str, rank: int, reason: str, bucket: int | None = None):
        where = f"rank {rank}" if bucket is None else \
            f"deepreduce hook, rank {rank}, bucket {bucket}"
        super().__init__(f"{where}, {what} failed: {reason}")
        self.what, self.rank, self.reason, self.bucket = what, rank, reason, bucket

    def __reduce__(self):
        return type(self), (self.what, self.rank, self.reason, self.bucket)


class TorchTransport(Transport):
    """``torch.distributed`` collectives on uint8 tensors of one process group.

    Frames travel as byte tensors on ``device``: the CPU for gloo, the current
    CUDA device for NCCL (NCCL moves only GPU memory), so the same code serves
    both. gloo and NCCL move equal-sized tensors only, so an allgather of
    variable-length frames sends each in a slot of ``8 + capacity`` bytes,
    its length first: one collective when every frame fits (the capacity
    follows the longest frames of the same stage lately, which every rank
    saw alike, so every rank picks the same), and a second one for what
    overflows when one does not. ``Traffic`` counts the bytes that really
    cross, padding included.

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
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialised: call "
                               "torch.distributed.init_process_group first")
        group = dist.group.WORLD if process_group is None else process_group
        # held weakly: a group kept alive after destroy_process_group is destroyed at
        # interpreter exit instead, when gloo's threads can no longer take the GIL
        # to free the tensors they hold, and the process aborts
        self._group = weakref.ref(group)
        self._flag_group = None  # (made by private())
        backend = self._backend_of(group)
        self.rank, self.global_rank = dist.get_rank(group), dist.get_rank()
        if self.rank < 0:
            raise ValueError("this process is not a member of the given process group")
        self.size = dist.get_world_size(group)
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
                      else torch.device("cpu"))
        self.device, self.backend = torch.device(device), backend
        # The tensors of the last collective, kept until the next one starts (and, at
        # exit, until gloo lets go of them: _release_at_exit). A gloo thread drops its
        # references just after a collective completes; if it dropped the last one it
        # would take the GIL to free their Python objects, and a thread that waits for
        # the GIL while the interpreter finalises aborts the process ("terminate
        # called without an active exception", pytorch/pytorch#179291).
        self._held = []
        _WITH_HELD_TENSORS.add(self)
        self._longest = {}  # stage -> the longest frames of its last allgathers

    @classmethod
    def _backend_of(cls, group) -> str:
        backend = str(dist.get_backend(group)).lower()
        if backend not in cls.BACKENDS:
            raise ValueError(f"process group backend {backend!r} is not supported; deepreduce "
                             f"runs over {' or '.join(cls.BACKENDS)}")
        return backend

    @classmethod
    def private(cls, process_group=None, device=None) -> "TorchTransport":
        """A transport over a process group of its own, with the members of
        ``process_group`` (the default group when None) ranked alike, and a second
        such group, :attr:`flag_group`.

        Collectives on the same group that two threads start can interleave in
        another order on each rank, and the ranks then exchange the wrong tensors
        (gloo: "Is there a distributed collective mismatch") or wait for each other
        forever. DDP with ``find_unused_parameters=True`` runs a bookkeeping
        allreduce of its own on the model's group from the autograd thread, while
        the transport's collectives run on its communication thread; on groups of
        their own they cannot meet.

        Collective: every member of ``process_group`` calls it (its members alone:
        ``new_group(..., use_local_synchronization=True)``), in the same order with
        respect to their other ``new_group`` calls. The groups take
        ``process_group``'s backend and timeout; torch.distributed holds them until
        ``destroy_process_group()``, this transport only weakly.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialised: call "
                               "torch.distributed.init_process_group first")
        group = dist.group.WORLD if process_group is None else process_group
        backend = cls._backend_of(group)
        if dist.get_rank(group) < 0:
            raise ValueError("this process is not a member of the given process group")
        ranks = dist.get_process_group_ranks(group)  # global ranks, in the group's order
        options = {} if ranks == sorted(ranks) else {"sort_ranks": False}
        own, flags = (dist.new_group(ranks, backend=backend, timeout=_timeout_of(group),
                                     use_local_synchronization=True, group_desc=desc,
                                     **options)
                      for desc in ("deepreduce", "deepreduce_flags"))
        transport = cls(own, device)
        transport._flag_group = weakref.ref(flags)
        if transport.rank != dist.get_rank(group):  # (new_group ignored the order)
            raise RuntimeError("torch.distributed ranked the new group's members otherwise "
                               "than the given group")
        return transport

    @property
    def group(self):
        """The process group; RuntimeError once it has been destroyed."""
        group = self._group()
        if group is None:
            raise RuntimeError("the process group of this transport has been destroyed "
                               "(torch.distributed.destroy_process_group)")
        return group

    @property
    def flag_group(self):
        """The second group of a :meth:`private` transport: the same members, for the
        small collectives another thread runs beside this transport's (the DDP hook's
        all-finite flag, from the autograd thread). RuntimeError once it has been
        destroyed, and for a transport built over a group of the caller's."""
        if self._flag_group is None:
            raise RuntimeError("this transport runs on a group of the caller's; "
                               "TorchTransport.private (transport_of) makes a flag group")
        group = self._flag_group()
        if group is None:
            raise RuntimeError("the flag group of this transport has been destroyed "
                               "(torch.distributed.destroy_process_group)")
        return group

    @contextlib.contextmanager
    def failing_as(self, what: str):
        """Raise what fails inside as a :class:`CollectiveError` naming ``what`` (say
        "allgather of 'bundles'") and this rank, the original exception chained."""
        try:
            yield
        except CollectiveError:
            raise
        except Exception as exc:  # noqa: BLE001 - named, and chained
            raise CollectiveError(what, self.global_rank, _reason(exc)) from exc

    def _to_device(self, array: np.ndarray):
        return torch.from_numpy(array).to(self.device)

    def _to_host(self, tensor) -> np.ndarray:
        return tensor.cpu().numpy()

    def _wait_until_released(self, deadline: float) -> None:
        """Wait (until ``deadline``, a ``time.monotonic()``) until no collective holds
        the tensors of the last one: then this thread is the one that frees them."""
        while any(_held_elsewhere(t) for t in self._held) and time.monotonic() < deadline:
            time.sleep(0.001)  # lets a gloo thread take the GIL and drop its references

    def _all_gather(self, local) -> list:
        everyone = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(everyone, local, group=self.group)
        self._held += [local, *everyone]
        return everyone

    def _gather_rows(self, local) -> np.ndarray:
        """Every member's ``local`` (a uint8 vector), as the rows of one host array."""
        everyone = torch.empty(self.size * local.numel(), dtype=local.dtype,
                               device=local.device)
        _all_gather_single(everyone, local, group=self.group)
        self._held += [local, everyone]
        return self._to_host(everyone).reshape(self.size, local.numel())

    def _lengths(self, mine: np.ndarray) -> np.ndarray:
        """Every member's ``mine`` (int64 vector), stacked in rank order."""
        self._held = []  # a new collective: the last one's tensors are free to go
        everyone = self._all_gather(self._to_device(np.ascontiguousarray(mine, dtype=np.int64)))
        return np.stack([self._to_host(t) for t in everyone])

    def allgather(self, frame, traffic, stage):
        with self.failing_as(f"allgather of {stage!r}"):
            return self._allgather(frame, traffic, stage)

    def _allgather(self, frame, traffic, stage):
        data = np.frombuffer(frame, dtype=np.uint8)
        capacity = self._capacity(stage)
        self._held = []  # a new collective: the last one's tensors are free to go
        # one slot per rank: the frame's length (int64), then its first bytes
        slot = np.zeros(8 + capacity, dtype=np.uint8)
        slot[:8].view(np.int64)[0] = data.size
        head = min(data.size, capacity)
        slot[8:8 + head] = data[:head]
        slots = self._gather_rows(self._to_device(slot))
        lengths = slots[:, :8].copy().view(np.int64)[:, 0]
        longest = int(lengths.max())
        traffic.add(stage, 8 + capacity, (self.size - 1) * (8 + capacity))
        self._remember(stage, longest)
        if longest <= capacity:
            view = memoryview(slots.reshape(-1)).cast("B")
            return [view[r * (8 + capacity) + 8:r * (8 + capacity) + 8 + int(n)]
                    for r, n in enumerate(lengths)]
        # a frame did not fit: the bytes past the capacity, padded to the longest overflow
        extra = longest - capacity
        padded = np.zeros(extra, dtype=np.uint8)
        padded[:data.size - head] = data[head:]
        tails = self._gather_rows(self._to_device(padded))
        traffic.add(stage, extra, (self.size - 1) * extra)
        return [memoryview(np.concatenate((slots[r, 8:8 + min(int(n), capacity)],
                                           tails[r, :max(int(n) - capacity, 0)]))).cast("B")
                for r, n in enumerate(lengths)]

    #: Frames of the allgathers of one stage that :meth:`_capacity` looks back on, and
    #: the largest capacity it picks: longer frames go in two collectives, as then the
    #: second costs little beside moving them.
    RECENT, MAX_CAPACITY = 8, 1 << 20

    def _capacity(self, stage) -> int:
        """The bytes of a frame the first collective of an allgather of ``stage`` carries:
        the longest of the stage's recent frames and an eighth (every rank computes the
        same from the lengths it gathered), rounded up to 64; 0 for a new stage."""
        recent = self._longest.get(stage)
        if not recent:
            return 0
        longest = max(recent)
        capacity = -(-(longest + longest // 8) // 64) * 64
        return capacity if capacity <= self.MAX_CAPACITY else 0

    def _remember(self, stage, longest: int) -> None:
        recent = self._longest.setdefault(stage, [])
        recent.append(longest)
        del recent[:-self.RECENT]

    def alltoall(self, frames, traffic, stage):
        with self.failing_as(f"alltoall of {stage!r}"):
            return self._alltoall(frames, traffic, stage)

    def _alltoall(self, frames, traffic, stage):
        sizes = np.array([0 if r == self.rank else len(f) for r, f in enumerate(frames)])
        incoming = self._lengths(sizes)[:, self.rank]
        # one copy of the frames, into memory torch may own (a dense reduce-scatter moves
        # megabytes here)
        data, pos = np.empty(int(sizes.sum()), dtype=np.uint8), 0
        for size, frame in zip(sizes.tolist(), frames):
            if size:
                data[pos:pos + size] = np.frombuffer(frame, dtype=np.uint8)
                pos += size
        received = torch.empty(int(incoming.sum()), dtype=torch.uint8, device=self.device)
        outgoing = self._to_device(data)
        dist.all_to_all_single(received, outgoing, incoming.tolist(), sizes.tolist(),
                               group=self.group)
        self._held += [received, outgoing]
        traffic.add(stage, 8 * self.size + data.size, 8 * self.size + received.numel())
        return split_frames(self._to_host(received), incoming)

    def split(self, color, key=None):
        """The members of this member's ``color`` as a transport over a process group
        of their own (see :meth:`deepreduce.collectives.Transport.split`).

        torch.distributed creates groups collectively: in a group of the whole
        world, every rank creates every sub-group, in the order of their colors
        (``new_group``, which NCCL needs); in a smaller group, the members of each
        sub-group create theirs alone (``use_local_synchronization``). Members are
        ranked by ``key`` (``sort_ranks=False`` where that differs from their
        global ranks' order). The sub-groups take this transport's backend and
        timeout.
        """
        with self.failing_as(f"split into sub-groups (color {color})"):
            return self._split(color, key)

    def _split(self, color, key):
        key = self.rank if key is None else key
        mine = np.array([color, key, dist.get_rank()], dtype=np.int64)
        table = self._lengths(mine)  # every member's (color, key, global rank)
        members = members_of(table[:, :2], self.rank)
        whole_world = self.size == dist.get_world_size()
        settings = {"backend": self.backend, "timeout": _timeout_of(self.group)}
        created = None
        for each in sorted(set(table[:, 0].tolist())):
            if each != color and not whole_world:
                continue
            ranks = table[members_of(table[:, :2], int(np.flatnonzero(table[:, 0] == each)[0])),
                          2].tolist()
            ordered = ranks == sorted(ranks)
            group = dist.new_group(ranks, use_local_synchronization=not whole_world,
                                   **settings, **({} if ordered else {"sort_ranks": False}))
            if each == color:
                created = group
        transport = TorchTransport(created, self.device)
        if transport.rank != members.index(self.rank):  # (new_group ignored the order)
            raise RuntimeError("torch.distributed ranked the new group's members otherwise "
                               "than their keys")
        return transport


#: One collective into one output tensor (torch 2.13 renamed all_gather_into_tensor).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_WITH_HELD_TENSORS = weakref.WeakSet()


def _timeout_of(group):
    """The timeout of ``group``'s collectives; None (new_group's default) where torch
    does not tell (``ProcessGroup._get_backend`` is private API)."""
    for device in getattr(group, "_device_types", ()):
        try:
            return group._get_backend(device).options._timeout
        except Exception:  # noqa: BLE001, S112 - the next device may tell
            continue
    return None


def _reason(exc: BaseException) -> str:
    """``exc``'s message without the C++ stack torch appends to some."""
    text = str(exc).split("\nException raised from ", 1)[0].strip()
    return text or type(exc).__name__


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


# the shared transport of each process group (weak keys: a destroyed process group must not
# be kept alive, see TorchTransport)
_TRANSPORTS = weakref.WeakKeyDictionary()
_TRANSPORTS_LOCK = threading.Lock()


def transport_of(process_group=None) -> TorchTransport:
    """The shared :class:`TorchTransport` of ``process_group``.

    One per group and process, so every deepreduce collective of that group
    (the hook's, :func:`deepreduce.torch.allreduce`'s) runs on one thread, in
    the order it was started, which is the same on every rank. It runs them on
    a process group of its own with the same members, and has a second one,
    ``flag_group`` (:meth:`TorchTransport.private
    <deepreduce.torch.transport.TorchTransport.private>`), both created by the
    first call for ``process_group``, which every member must make: collectives
    of DDP's own on ``process_group`` (``find_unused_parameters=True``'s
    bookkeeping, from the autograd thread) then never meet deepreduce's.
    """
    group = dist.group.WORLD if process_group is None else process_group
    if group is None:  # torch.distributed is not initialised: TorchTransport says so
        return TorchTransport()
    with _TRANSPORTS_LOCK:
        transport = _TRANSPORTS.get(group)
        if transport is None:
            transport = _TRANSPORTS[group] = TorchTransport.private(group)
        return transport
