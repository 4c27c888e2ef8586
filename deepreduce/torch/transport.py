"""``torch.distributed``'s collectives as a deepreduce transport (gloo or NCCL).

:class:`TorchTransport` moves the byte frames of :mod:`deepreduce.collectives`'
communicators and of :class:`~deepreduce.exchange.GradientExchange` between the
ranks of a process group; :func:`transport_of` gives the shared one of a group,
over process groups of its own (:meth:`TorchTransport.private`). Where its byte
frames travel follows the group's backends and the tensors it serves
(:func:`frame_device`), never the calling thread's current CUDA device.
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

from deepreduce.collectives import cost
from deepreduce.collectives.transport import Transport, members_of, split_frames
from deepreduce.torch.streams import Lane

__all__ = ["TorchTransport", "CollectiveError", "transport_of", "frame_device", "backends_of"]


class CollectiveError(RuntimeError):
    """A collective of deepreduce's failed: a peer died or left, a timeout, a destroyed
    group. The message names the rank (global, as torchrun's log prefixes do), the
    collective and the stage (``what``: "allgather of 'bundles (2 tensors from 0.0)'")
    and the reason; the exception torch.distributed raised is the ``__cause__``. The DDP hook raises one
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

    Frames travel as byte tensors on :attr:`device` (:func:`frame_device`): the CPU
    where the group has a backend for CPU tensors (gloo, or a mixed
    ``"cpu:gloo,cuda:nccl"`` group), else the device of the tensors the transport serves
    (NCCL moves only GPU memory), so the same code serves both. gloo and NCCL move
    equal-sized tensors only, so an allgather of variable-length frames sends each in a
    slot of ``8 + capacity`` bytes, its length first: one collective when every frame
    fits, and a second one, an alltoall with uneven splits, for the bytes past the
    capacity, at their exact sizes. The capacity of a stage is the cost model's choice
    (:func:`deepreduce.collectives.cost.slot_capacity`) from the lengths of its recent
    frames, which every rank saw alike, so every rank picks the same (and keeps it for
    as many allgathers as it looked back on, or until a frame overflows it): frames that
    vary little travel in one collective with a little slack, frames that vary much in
    two with little padding. ``Traffic`` counts the bytes that really cross, lengths and
    padding included.

    Parameters
    ----------
    process_group : torch.distributed.ProcessGroup, optional
        The group to communicate in; the default (world) group when None.
        Its backends must be gloo or NCCL (one, or ``"cpu:gloo,cuda:nccl"``). The
        transport holds it weakly, so ``destroy_process_group`` really destroys it;
        the transport's collectives then raise RuntimeError.
    device : torch.device or str, optional
        The device of the tensors the transport serves (a DDP bucket's, the
        parameters'): where the frames travel when the group has no backend for the
        CPU. Needed for an NCCL group, unless the default group is bound to a device
        (``init_process_group(device_id=...)``).
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
        self.device, self.backend = frame_device(group, device), backend
        # the communication thread's stream, on the device of the tensors served (see
        # submit and deepreduce.torch.streams)
        self.lane = Lane(self.device if device is None else device)
        self._served = {self.lane.device}  # devices whose tensors it was asked to serve
        # The tensors of the last collective, kept until the next one starts (and, at
        # exit, until gloo lets go of them: _release_at_exit). A gloo thread drops its
        # references just after a collective completes; if it dropped the last one it
        # would take the GIL to free their Python objects, and a thread that waits for
        # the GIL while the interpreter finalises aborts the process ("terminate
        # called without an active exception", pytorch/pytorch#179291).
        self._held = []
        _WITH_HELD_TENSORS.add(self)
        self._recent = {}  # stage -> the frame lengths of its last allgathers
        self._slots = {}  # stage -> [the cost model's capacity, allgathers left to reuse it]

    @classmethod
    def _backend_of(cls, group) -> str:
        """The backend of ``group`` as torch.distributed names it ("gloo", "nccl",
        "cpu:gloo,cuda:nccl"), once each of its backends is one deepreduce runs over."""
        backend = str(dist.get_backend(group)).lower()
        backends = backends_of(group)
        unknown = {device: name for device, name in backends.items() if name not in cls.BACKENDS}
        if unknown:
            named = ", ".join(f"{name} for {device}" for device, name in unknown.items())
            raise ValueError(f"process group backend {backend!r} ({named}) is not supported; "
                             f"deepreduce "
                             f"runs over {' or '.join(cls.BACKENDS)} (one of them, or one per "
                             "device type: 'cpu:gloo,cuda:nccl')")
        return backend

    def serves(self, device) -> bool:
        """Whether a collective of this transport's group takes tensors on ``device``
        where they are (its group has a backend for their device type)."""
        return torch.device(device).type in backends_of(self.group)

    def serve(self, device) -> None:
        """Serve tensors on ``device`` too: ValueError unless their frames travel on this
        transport's :attr:`device` (every user of a shared transport agrees on it); a
        transport whose lane has no stream yet gets one on ``device`` when it is a GPU
        (a first user with CPU tensors, a later one with CUDA buckets)."""
        if device is None or device in self._served:
            return
        device = torch.device(device)
        if frame_device(self.group, device) != self.device:
            raise ValueError(f"this transport's frames travel on {self.device}, as the first "
                             f"tensors it served asked; tensors on {device} need a "
                             "transport over another process group")
        if self.lane.stream is None and device.type == "cuda":
            self.lane = Lane(device)
        self._served.add(device)

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

        Collective: every member of ``process_group`` calls it, in the same order
        with respect to their other process-group creations (see
        :func:`new_groups`, which makes both). The transport's group takes
        ``process_group``'s backend and timeout; the flag group is a gloo one where
        ``process_group`` has no backend for CPU tensors (NCCL alone): its one-value
        flags then travel from the host, on no CUDA stream and no second NCCL
        communicator. torch.distributed holds them until ``destroy_process_group()``,
        this transport only weakly.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialised: call "
                               "torch.distributed.init_process_group first")
        group = dist.group.WORLD if process_group is None else process_group
        backend = cls._backend_of(group)
        if dist.get_rank(group) < 0:
            raise ValueError("this process is not a member of the given process group")
        flags_backend = backend if "cpu" in backends_of(group) or not dist.is_gloo_available() \
            else "gloo"
        own, = new_groups(group, [range(dist.get_world_size(group))], "deepreduce")
        flags, = new_groups(group, [range(dist.get_world_size(group))], "deepreduce_flags",
                            backend=flags_backend)
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

    def submit(self, fn, *args):
        """Run ``fn(*args)`` on the communication thread, with the :attr:`lane`'s stream
        current there, ordered after the caller's current stream now (the hand-over:
        see :mod:`deepreduce.torch.streams`)."""
        return super().submit(self._run_on_lane, self.lane.hand_over(), fn, args)

    def _run_on_lane(self, event, fn, args):
        with self.lane.running(event):
            return fn(*args)

    @property
    def flag_device(self) -> torch.device:
        """Where the flags of :attr:`flag_group` travel: the host where it has a backend for
        CPU tensors (always, when gloo is built), else this transport's device."""
        return torch.device("cpu") if "cpu" in backends_of(self.flag_group) else self.device

    @contextlib.contextmanager
    def failing_as(self, what: str):
        """Raise what fails inside as a :class:`CollectiveError` naming ``what`` (say
        "allgather of 'bundles (2 tensors from 0.0)'") and this rank, the original
        exception chained."""
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

    #: How :meth:`_capacity` picks a stage's slot: ``"model"`` (the cost model's
    #: choice, :func:`deepreduce.collectives.cost.slot_capacity`), ``"padded"`` (the
    #: longest recent frame and an eighth, rounded up to 64 bytes: what this transport
    #: did before the cost model) or ``"exact"`` (no slot: the lengths, then every frame
    #: at its exact size). Every rank must use the same (benchmarks compare them).
    FRAMING = "model"
    #: The network the cost model assumes: the round trip of a small collective, in
    #: seconds, and the bytes per second of the link (the defaults of
    #: :data:`deepreduce.collectives.cost.ROUND_TRIP` and ``LINK_BYTES_PER_SECOND``).
    #: Set them alike on every rank (a class attribute, or on every rank's transport).
    ROUND_TRIP_SECONDS, BYTES_PER_SECOND = cost.ROUND_TRIP, cost.LINK_BYTES_PER_SECOND

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
        traffic.add(stage, 8 + capacity, (self.size - 1) * (8 + capacity))
        tails = np.maximum(lengths - capacity, 0)
        self._remember(stage, lengths, overflowed=bool(tails.any()))
        if self.size == 1 or not tails.any():
            view = memoryview(slots.reshape(-1)).cast("B")
            return [memoryview(data) if r == self.rank else
                    view[r * (8 + capacity) + 8:r * (8 + capacity) + 8 + int(n)]
                    for r, n in enumerate(lengths)]
        # the bytes past the capacity, at their exact sizes: an alltoall with uneven
        # splits, this rank's tail to every other rank (counted once in ``sent``, as the
        # slot is: what this rank contributes)
        incoming = [0 if r == self.rank else int(n) for r, n in enumerate(tails)]
        mine = int(tails[self.rank])
        outgoing = self._to_device(np.tile(data[head:], self.size - 1))
        received = torch.empty(sum(incoming), dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(received, outgoing, incoming,
                               [0 if r == self.rank else mine for r in range(self.size)],
                               group=self.group)
        self._held += [received, outgoing]
        traffic.add(stage, mine, sum(incoming))
        pieces = split_frames(self._to_host(received), incoming)
        return [memoryview(data) if r == self.rank else
                memoryview(np.concatenate((slots[r, 8:8 + min(int(n), capacity)], pieces[r])))
                for r, n in enumerate(lengths)]

    #: Allgathers of one stage whose frame lengths :meth:`_capacity` looks back on.
    RECENT = 8

    def _capacity(self, stage) -> int:
        """The bytes of a frame the first collective of an allgather of ``stage`` carries,
        from the lengths of the stage's recent frames (every rank's, so every rank
        computes the same; 0 for a new stage), as :attr:`FRAMING` says."""
        recent = self._recent.get(stage)
        if not recent or self.FRAMING == "exact":
            return 0
        if self.FRAMING == "padded":
            longest = int(np.concatenate(recent).max())
            return -(-(longest + longest // 8) // 64) * 64
        # the model's choice holds for as many allgathers of the stage as it looked back
        # on, or until a frame overflows it: weighing it at every allgather took 15-30 us,
        # what its bytes save there at 1 Gbit/s (benchmarks/results/outer.md, framing);
        # every rank, seeing the same lengths, weighs it again at the same allgather
        held = self._slots.get(stage)
        if held is None or held[1] == 0:
            held = self._slots[stage] = [cost.slot_capacity(
                np.concatenate(recent), self.size, self.ROUND_TRIP_SECONDS,
                1.0 / self.BYTES_PER_SECOND), len(recent)]
        held[1] -= 1
        return held[0]

    def _remember(self, stage, lengths, overflowed: bool = False) -> None:
        recent = self._recent.setdefault(stage, [])
        recent.append(np.array(lengths, dtype=np.int64))
        del recent[:-self.RECENT]
        if overflowed:  # the lengths moved: weigh the slot again at the next allgather
            self._slots.pop(stage, None)

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

        The sub-groups are made by :func:`new_groups`, by every member of this
        transport's group, in the order of their colors. Members are ranked by
        ``key``. The sub-groups take this transport's backend and timeout.
        """
        with self.failing_as(f"split into sub-groups (color {color})"):
            return self._split(color, key)

    def _split(self, color, key):
        key = self.rank if key is None else key
        mine = np.array([color, key, dist.get_rank()], dtype=np.int64)
        table = self._lengths(mine)  # every member's (color, key, global rank)
        members = members_of(table[:, :2], self.rank)
        colors = sorted(set(table[:, 0].tolist()))
        # each color's members (ranks of this group), ordered by their keys
        splits = [members_of(table[:, :2], int(np.flatnonzero(table[:, 0] == each)[0]))
                  for each in colors]
        created = new_groups(self.group, splits, f"deepreduce_split_{len(colors)}")
        transport = TorchTransport(created[colors.index(color)], self.lane.device)
        if transport.rank != members.index(self.rank):  # (new_group ignored the order)
            raise RuntimeError("torch.distributed ranked the new group's members otherwise "
                               "than their keys")
        return transport


def new_groups(parent, splits, desc: str, backend=None) -> list:
    """Process groups of disjoint subsets of ``parent``'s members, made by every member
    of ``parent`` in one call: ``splits`` lists each subset's members as ranks of
    ``parent``, in the order they are to be ranked. Returns, for each subset, its group
    on its members and None elsewhere (the caller keeps its own).

    How, follows what torch.distributed needs (``distributed_c10d.py``,
    ``_new_group_with_tag`` and ``_new_process_group_helper``):

    - The default group bound to a GPU (``init_process_group(device_id=...)``) with
      NCCL makes NCCL sub-groups by ``ncclCommSplit``, collective over every rank of
      the group split from: ``new_group`` there has non-members split with
      ``NCCL_SPLIT_NOCOLOR``, so ``use_local_synchronization=True`` (non-members
      return at once) would leave the members waiting. Then ``split_group`` splits
      ``parent`` itself, every member of ``parent`` taking part, and no rank outside
      it. (``split_group`` ranks each subset in ``parent``'s order.)
    - ``parent`` of the whole world: ``new_group`` by every rank, for every subset in
      turn (names from torch's group counter, alike on every rank that makes the
      same calls in the same order).
    - A smaller ``parent``, no device-bound split: ``new_group(...,
      use_local_synchronization=True)`` by the members of each subset alone (a rank
      outside ``parent`` does not know the call is made).

    ``backend`` (default: ``parent``'s) other than ``parent``'s, as a gloo flag group
    of an NCCL parent, is never split from it (``split_group`` keeps the parent's
    backends). The groups take ``parent``'s timeout.
    """
    backend = str(dist.get_backend(parent)).lower() if backend is None else backend
    global_ranks = dist.get_process_group_ranks(parent)
    splits = [[global_ranks[r] for r in members] for members in splits]
    mine = dist.get_rank()
    timeout = _timeout_of(parent)
    if _splits_by_nccl(parent) and backend == str(dist.get_backend(parent)).lower():
        order = {g: r for r, g in enumerate(global_ranks)}
        for members in splits:
            if [order[g] for g in members] != sorted(order[g] for g in members):
                raise ValueError("a device-bound NCCL group splits its members in the order "
                                 "of their ranks; asked for another order: "
                                 f"{[order[g] for g in members]}")
        made = dist.split_group(parent_pg=parent, timeout=timeout, group_desc=desc,
                                split_ranks=[sorted(order[g] for g in m) for m in splits])
        return [made if mine in members else None for members in splits]
    whole_world = len(global_ranks) == dist.get_world_size()
    groups = []
    for members in splits:
        if not whole_world and mine not in members:
            groups.append(None)
            continue
        options = {} if members == sorted(members) else {"sort_ranks": False}
        made = dist.new_group(members, backend=backend, timeout=timeout, group_desc=desc,
                              use_local_synchronization=not whole_world, **options)
        groups.append(made if mine in members else None)
    return groups


def _splits_by_nccl(parent) -> bool:
    """Whether torch.distributed makes sub-groups of ``parent`` by splitting an NCCL
    communicator: the default group is bound to a device whose backend in ``parent``
    is NCCL (see :func:`new_groups`)."""
    default = dist.distributed_c10d._get_default_group()
    bound = getattr(default, "bound_device_id", None)
    return bound is not None and backends_of(parent).get(bound.type) == "nccl"


# weak keys: a destroyed process group must not be kept alive (see TorchTransport)
_TRANSPORTS = weakref.WeakKeyDictionary()
_TRANSPORTS_LOCK = threading.Lock()


def transport_of(process_group=None, device=None) -> TorchTransport:
    """The shared :class:`TorchTransport` of ``process_group`` (the default group when
    None), made at the first call for the group.

    One per group and process, so every deepreduce collective of that group
    (the DDP hook's, :func:`deepreduce.torch.allreduce`'s, an
    :class:`~deepreduce.torch.outer.OuterOptimizer`'s) runs on one thread, in
    the order it was started, which is the same on every rank. It runs them on
    a process group of its own with the same members, and has a second one,
    ``flag_group`` (:meth:`TorchTransport.private`), both created by the first
    call for ``process_group``, which every member must make: collectives of
    DDP's own on ``process_group`` (``find_unused_parameters=True``'s
    bookkeeping, from the autograd thread) then never meet deepreduce's.

    ``device`` is that of the tensors the caller serves (see :func:`frame_device`);
    a later caller whose tensors would need their frames elsewhere gets a
    ValueError.
    """
    group = dist.group.WORLD if process_group is None else process_group
    if group is None:  # torch.distributed is not initialised: TorchTransport says so
        return TorchTransport()
    with _TRANSPORTS_LOCK:
        transport = _TRANSPORTS.get(group)
        if transport is None:
            transport = _TRANSPORTS[group] = TorchTransport.private(group, device)
        else:
            transport.serve(device)
        return transport


def backends_of(group) -> dict:
    """``{device type: backend}`` of ``group``: ``{"cpu": "gloo", "cuda": "gloo"}`` for
    gloo, ``{"cuda": "nccl"}`` for NCCL, ``{"cpu": "gloo", "cuda": "nccl"}`` for
    ``"cpu:gloo,cuda:nccl"`` (``torch.distributed.get_backend_config``)."""
    try:
        config = str(dist.get_backend_config(group))
    except (AttributeError, ValueError, RuntimeError):  # (a group torch did not register)
        config = str(dist.get_backend(group))
    backends = {}
    for part in config.lower().split(","):
        device, _, backend = part.strip().rpartition(":")
        if device:
            backends[device] = backend
        else:  # a bare name: the device types torch says it serves
            capability = getattr(dist.Backend, "backend_capability", {})
            backends.update(dict.fromkeys(capability.get(backend, ["cpu"]), backend))
    return backends


def frame_device(group, device=None) -> torch.device:
    """Where a transport over ``group`` moves its byte frames, for tensors on ``device``.

    The frames are bytes in host memory, made and read by the host codecs. Where the
    group has a backend for CPU tensors (gloo, or a mixed ``"cpu:gloo,cuda:nccl"``
    group), they travel from there: no copy to a device, no CUDA stream involved.
    Otherwise (NCCL alone) they must travel on a GPU: that of the tensors the
    transport serves (``device``: the bucket's, the parameters'), else the device the
    default group is bound to (``init_process_group(device_id=...)``). Never the
    calling thread's current device, which is cuda:0 on a thread that never called
    ``torch.cuda.set_device`` (the main thread of a script that only moved its model).
    """
    backends = backends_of(group)
    if "cpu" in backends:
        return torch.device("cpu")
    if device is not None:
        device = torch.device(device)
        if device.type not in backends:
            raise ValueError(f"a {dist.get_backend(group)} process group moves tensors on "
                             f"{' or '.join(sorted(backends))} only; the tensors to serve are "
                             f"on {device}: move them, or use a group with a backend for "
                             f"{device.type} (say 'cpu:gloo,cuda:nccl')")
        if device.index is None and device.type == "cuda":
            raise ValueError(f"device={device} names no GPU: give the tensors' own device "
                             "(tensor.device), say cuda:0")
        return device
    bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
    if bound is not None and bound.type in backends:
        return bound
    raise ValueError(f"a {dist.get_backend(group)} process group moves GPU memory only: pass "
                     "device= (the device of the tensors it serves), or bind the default group "
                     "to one (init_process_group(device_id=...))")


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
