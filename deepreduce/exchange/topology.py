"""The pieces of a topology-aware reduction: nodes, shards, and the dense stages inside a node.

Clusters join the ranks of a node by a fast link and the nodes by a slower one.
The hierarchical exchange (:mod:`deepreduce.exchange.hierarchical`) moves
gradients in three stages:

1. **inside each node**, a dense reduce-scatter: local rank ``l`` receives
   shard ``l`` of every tensor from the other ranks of its node and sums them
   (uncompressed: the fast link carries it);
2. **between nodes**, the compressed exchange of each shard among the ranks
   that hold the same shard, one per node (:func:`node_transports`' ``inter``);
3. **inside each node**, an allgather of the reduced shards.

Only stage 2 crosses the slow link, and each rank there sends ``1 / local_size``
of the gradient: the slow link carries what one rank of each node would send
in a flat exchange of the node sums. This module holds what the stages need and
knows no framework: the topology (:class:`Topology`, :func:`resolve_local_size`),
the split of a transport into the two kinds of groups (:func:`node_transports`),
the cut of a tensor into shards (:func:`shard_bounds`), the frames of the
reduced shards (:func:`pack_shards`, :func:`unpack_shards`), and collectives
that carry a failure through every stage (:class:`Failures`), so that a rank
that cannot take part makes every rank raise instead of leaving them waiting.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np

from deepreduce.bits import read_varint, write_varint
from deepreduce.collectives import frames
from deepreduce.errors import DecodeError

#: The communicators that may run between the nodes.
INTER = ("allgather", "sparse_allreduce", "block")
#: The options of ``communicator="hierarchical"``.
OPTIONS = ("local_size", "inter", "inter_options")

_DENSE, _SPARSE = 0, 1
#: The kind byte before the body of a frame of :class:`Failures` that carries data (the
#: other kind is :data:`frames.ERROR <deepreduce.collectives.frames.ERROR>`).
_DATA = 0xFF


def check_options(options: dict, check_inter) -> dict:
    """``options`` of ``communicator="hierarchical"``, checked and with their defaults.

    ``check_inter(name, options)`` checks the options of the communicator
    between the nodes (:func:`deepreduce.config._check_communicator`).

    >>> check_options({"local_size": 8}, lambda name, options: options)
    {'local_size': 8, 'inter': 'allgather', 'inter_options': {}}
    >>> check_options({"inter": "hierarchical"}, lambda name, options: options)
    Traceback (most recent call last):
    ...
    ValueError: the hierarchical communicator's inter must be one of 'allgather', \
'sparse_allreduce', 'block', got 'hierarchical'
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"communicator 'hierarchical' takes the options {', '.join(OPTIONS)}; "
                         f"got {', '.join(unknown)}")
    local_size = options.get("local_size")
    if local_size is not None and (isinstance(local_size, bool) or not isinstance(
            local_size, (int, np.integer)) or local_size < 1):
        raise ValueError(f"local_size must be None (from the launcher) or an integer >= 1, "
                         f"got {local_size!r}")
    inter = options.get("inter", "allgather")
    if inter not in INTER:
        raise ValueError(f"the hierarchical communicator's inter must be one of "
                         f"{', '.join(map(repr, INTER))}, got {inter!r}")
    inter_options = check_inter(inter, options.get("inter_options") or {})
    return {"local_size": None if local_size is None else int(local_size), "inter": inter,
            "inter_options": inter_options}


def resolve_local_size(local_size: int | None) -> int:
    """Ranks per node: ``local_size``, else torchrun's ``LOCAL_WORLD_SIZE``, else
    horovodrun's ``HOROVOD_LOCAL_SIZE`` or an initialised Horovod's ``local_size()``.

    Raises
    ------
    ValueError
        When none says it.
    """
    if local_size is not None:
        return int(local_size)
    for variable in ("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE"):
        value = os.environ.get(variable)
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{variable}={value!r} is not a number of ranks") from None
    horovod = sys.modules.get("horovod.tensorflow")  # asked only where already imported
    if horovod is not None and horovod.is_initialized():
        return int(horovod.local_size())
    raise ValueError("communicator 'hierarchical' needs the number of ranks per node: pass "
                     "communicator_options={'local_size': N}, or launch with torchrun "
                     "(LOCAL_WORLD_SIZE) or horovodrun (HOROVOD_LOCAL_SIZE)")


@dataclass(frozen=True)
class Topology:
    """Where a rank sits: ranks are numbered node by node, ``local_size`` per node
    (torchrun's and horovodrun's numbering).

    >>> t = Topology(size=8, local_size=4, rank=6)
    >>> t.nodes, t.node, t.local_rank
    (2, 1, 2)
    """

    size: int
    local_size: int
    rank: int

    def __post_init__(self):
        if self.local_size < 1 or self.size % self.local_size:
            raise ValueError(f"local_size={self.local_size} does not divide the {self.size} "
                             "ranks into whole nodes")

    @property
    def nodes(self) -> int:
        return self.size // self.local_size

    @property
    def node(self) -> int:
        return self.rank // self.local_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_size

    def check_launcher(self) -> None:
        """Raise when the launcher's ``LOCAL_RANK`` says this rank sits elsewhere in its
        node than the numbering node by node puts it (checked when the transport spans
        the launcher's whole world)."""
        local, world = os.environ.get("LOCAL_RANK"), os.environ.get("WORLD_SIZE")
        if local is None or world is None or not world.isdigit() or int(world) != self.size:
            return
        if local.isdigit() and int(local) != self.local_rank:
            raise ValueError(
                f"rank {self.rank} has LOCAL_RANK={local}, but with local_size="
                f"{self.local_size} the hierarchical exchange takes it for local rank "
                f"{self.local_rank}: the ranks must be numbered node by node, "
                f"{self.local_size} per node")

    def global_rank(self, node: int, local_rank: int) -> int:
        return node * self.local_size + local_rank


def node_transports(transport, topology: Topology):
    """``(intra, inter)``: the ranks of this rank's node, ranked by local rank, and the
    ranks with this rank's local rank on every node, ranked by node.

    Two collective :meth:`~deepreduce.collectives.Transport.split` calls: every
    rank of ``transport`` makes them, in this order.
    """
    intra = transport.split(topology.node, topology.local_rank)
    inter = transport.split(topology.local_rank, topology.node)
    return intra, inter


def shard_bounds(n: int, parts: int) -> np.ndarray:
    """Where the ``parts`` contiguous shards of ``n`` elements start, and the end: sizes
    differ by one element at most.

    >>> shard_bounds(10, 4).tolist()
    [0, 2, 5, 7, 10]
    """
    return np.arange(parts + 1, dtype=np.int64) * int(n) // parts


@dataclass
class Segment:
    """A reduced segment as it travels: its non-zero ``positions`` and their ``values``,
    or, when that is not smaller, every value (``positions`` None, ``values`` dense)."""

    positions: np.ndarray | None
    values: np.ndarray

    def dense(self, size: int) -> np.ndarray:
        if self.positions is None:
            return self.values
        out = np.zeros(size, self.values.dtype)
        out[self.positions] = self.values
        return out


def pack_shards(segments, scale: float | None = None, positions=None) -> tuple[bytes, list]:
    """``(frame, entries)``: one frame of the flat arrays ``segments`` (a rank's reduced
    shards, one per dtype), each dense or as positions and values when that is smaller;
    and the :class:`Segment` of each, as every receiver will read it.

    A position is kept when its value's bits are not all zero, so -0.0 travels
    as itself and every rank assembles the same bits. ``scale`` (op "average")
    multiplies the values in double precision first, rounding back to their
    dtype (in place in ``segments``). ``positions``: per segment, increasing positions
    outside which it is known to be zero (None: found by a pass over it). Positions
    take 4 bytes each (8 from 2**32 elements on).

    >>> seg = np.zeros(1000, np.float32); seg[[3, 700]] = [1.5, -0.0]
    >>> frame, (entry,) = pack_shards([seg], scale=0.5)
    >>> len(frame) < 40, entry.positions.tolist(), entry.values.tolist()
    (True, [3, 700], [0.75, -0.0])
    >>> unpack_shards(frame, [(1000, seg.dtype)])[0].values.tolist()
    [0.75, -0.0]
    """
    parts, entries = [], []
    for i, segment in enumerate(segments):
        where = None if positions is None else positions[i]
        if where is None:
            where = np.flatnonzero(segment.view(np.dtype(f"u{segment.dtype.itemsize}")))
        index = np.dtype("<u4") if segment.size < 2**32 else np.dtype("<u8")
        if where.size * (index.itemsize + segment.dtype.itemsize) < segment.nbytes:
            values = segment[where]
            if scale is not None:
                values = np.multiply(values, scale, dtype=np.float64).astype(segment.dtype)
            parts += [bytes((_SPARSE,)), write_varint(where.size),
                      where.astype(index).tobytes(), values.tobytes()]
            entries.append(Segment(where, values))
        else:
            if scale is not None:
                segment[...] = np.multiply(segment, scale, dtype=np.float64)
            parts += [bytes((_DENSE,)), segment.tobytes()]
            entries.append(Segment(None, segment))
    return b"".join(parts), entries


def unpack_shards(frame, layout) -> list:
    """The :class:`Segment` of each segment of a :func:`pack_shards` frame; ``layout``:
    ``(size, dtype)`` of each.

    Raises
    ------
    DecodeError
        When the frame does not hold exactly that.
    """
    view, pos, segments = memoryview(frame).cast("B"), 0, []
    for size, dtype in layout:
        dtype = np.dtype(dtype)
        if pos >= len(view):
            raise DecodeError("shard frame truncated")
        kind, pos = view[pos], pos + 1
        if kind == _DENSE:
            end = pos + size * dtype.itemsize
            if end > len(view):
                raise DecodeError("shard frame truncated in a dense segment")
            segments.append(Segment(None, np.frombuffer(view[pos:end], dtype=dtype)))
        elif kind == _SPARSE:
            count, pos = read_varint(view, pos, "shard entries", size)
            index = np.dtype("<u4") if size < 2**32 else np.dtype("<u8")
            middle = pos + count * index.itemsize
            end = middle + count * dtype.itemsize
            if end > len(view):
                raise DecodeError("shard frame truncated in a sparse segment")
            positions = np.frombuffer(view[pos:middle], dtype=index).astype(np.int64)
            if count and (positions[-1] >= size or (np.diff(positions) <= 0).any()):
                raise DecodeError("shard positions are not increasing within the segment")
            segments.append(Segment(positions, np.frombuffer(view[middle:end], dtype=dtype)))
        else:
            raise DecodeError(f"unknown shard segment kind {kind}")
        pos = end
    if pos != len(view):
        raise DecodeError(f"{len(view) - pos} bytes after the shard segments")
    return segments


class Failures:
    """What went wrong in one reduction, carried through every one of its collectives.

    A rank that fails (its own error, or an ERROR frame or a disagreeing
    signature from a peer) still takes part in each later collective, with an
    ERROR frame that names the root causes; three stages (node, shard group,
    node) reach every rank, so all of them raise, with the same causes.

    Parameters
    ----------
    rank_of : callable
        ``rank_of(transport, member) -> int``: the rank, in the whole group,
        of ``member`` of a sub-transport (messages name whole-group ranks).
    rank : int
        This rank in the whole group.
    """

    def __init__(self, rank_of, rank: int):
        self.rank_of, self.rank = rank_of, rank
        self.own = None          # this rank's exception
        self.causes = set()      # "rank R: what went wrong"

    def __bool__(self):
        return self.own is not None or bool(self.causes)

    def fail(self, exc: BaseException) -> None:
        """Record this rank's own error."""
        if self.own is None:
            self.own = exc
            self.causes.add(f"rank {self.rank}: {type(exc).__name__}: {exc}")

    @staticmethod
    def frame_buffer(signature: str, size: int) -> tuple[np.ndarray, np.ndarray]:
        """``(frame, body)``: a data frame with room for ``size`` body bytes, to be filled
        in place (``body`` is its view) and handed to :meth:`alltoall` with
        ``framed=True``: megabytes then travel without a copy to put a header before them."""
        head = np.frombuffer(frames.signed(signature, bytes((_DATA,))), np.uint8)
        frame = np.empty(head.size + size, np.uint8)
        frame[:head.size] = head
        return frame, frame[head.size:]

    def _frame(self, signature: str, body) -> bytes:
        if self:
            return frames.signed(signature, frames.error_frame("\n".join(sorted(self.causes))))
        return b"".join((frames.signed(signature, bytes((_DATA,))), body))

    def allgather(self, transport, signature: str, body, traffic, stage: str) -> list | None:
        """Every member's ``body`` (this one's as given), or None once anything failed."""
        gathered = transport.allgather(self._frame(signature, body), traffic, stage)
        return self._read(transport, signature, gathered, body)

    def alltoall(self, transport, signature: str, bodies, traffic, stage: str,
                 framed: bool = False) -> list | None:
        """The bodies every member sent this one (its own slot: ``bodies[rank]``), or None
        once anything failed. ``framed``: ``bodies`` are whole frames of
        :meth:`frame_buffer` (this ``signature``), sent as they are."""
        mine = transport.rank
        if framed and not self:
            sent = [b"" if r == mine else frame for r, frame in enumerate(bodies)]
            own = memoryview(bodies[mine])[len(frames.signed(signature, b"")) + 1:]
        else:
            sent = [b"" if r == mine else self._frame(signature, body)
                    for r, body in enumerate(bodies)]
            own = bodies[mine]
        received = transport.alltoall(sent, traffic, stage)
        return self._read(transport, signature, received, own)

    def _read(self, transport, signature, received, own) -> list | None:
        bodies = []
        for member, frame in enumerate(received):
            if member == transport.rank:
                bodies.append(own)
                continue
            whole = self.rank_of(transport, member)
            try:
                theirs, body = frames.read_signed(frame)
            except DecodeError as exc:
                self.causes.add(f"rank {whole}: unreadable frame ({exc})")
                continue
            if len(body) and body[0] == frames.ERROR:
                self.causes.update(bytes(body[1:]).decode("utf-8", "replace").splitlines())
            elif theirs != signature:
                self.causes.add(f"rank {whole} sent {theirs!r} where rank {self.rank} sent "
                                f"{signature!r}: every rank must reduce the same tensors "
                                "with the same settings")
            elif not len(body) or body[0] != _DATA:
                self.causes.add(f"rank {whole}: unreadable frame (kind "
                                f"{body[0] if len(body) else None})")
            bodies.append(body[1:])
        return None if self else bodies

    def raise_if_any(self) -> None:
        """Raise this rank's own error, or a PeerError naming every cause."""
        if self.own is not None:
            raise self.own
        if self.causes:
            raise frames.PeerError("the hierarchical reduction failed on other ranks: "
                                   + "; ".join(sorted(self.causes)))


@dataclass
class CarriedStage:
    """One stage of a hierarchical reduction that another strategy runs (stage 2: its
    :class:`~deepreduce.exchange.strategy.Step`'s ``carry``): its one allgather, behind
    ``signature`` and counted as ``name`` in the traffic, carries the reduction's
    :class:`Failures` on to the next stage."""

    failures: Failures
    signature: str
    name: str

    @property
    def failed(self) -> bool:
        """Whether anything failed already (this rank then has nothing to send)."""
        return bool(self.failures)

    def allgather(self, transport, body, traffic, error: BaseException | None = None):
        """Every member's ``body``, or None once anything failed; ``error``: this rank's
        own failure, recorded first."""
        if error is not None:
            self.failures.fail(error)
        return self.failures.allgather(transport, self.signature, body, traffic, self.name)
