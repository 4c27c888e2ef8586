"""Where each tensor's shards lie in the segments a hierarchical step moves.

:class:`ShardLayout` serves the three stages of
:class:`~deepreduce.exchange.hierarchical.HierarchicalExchange`: it cuts this rank's
tensors into the frames of the node's reduce-scatter, sums the shards it receives,
gives the views of each tensor's shard that the strategy between nodes reduces into,
and assembles the whole tensors from every local rank's reduced segments.
"""

from __future__ import annotations

import zlib

import numpy as np

from deepreduce.exchange.summing import nonzero_rows
from deepreduce.exchange.topology import Failures, shard_bounds


class ShardLayout:
    """Where each tensor's shards lie in the segments a step moves.

    A rank's *segment* of one dtype is its shard of every tensor of that dtype,
    one after the other in tensor order; what travels inside a node is a rank's
    segments of every dtype, in the order the dtypes first appear.
    """

    def __init__(self, flats, shapes, local_size: int):
        self.shapes = shapes
        self.sizes = np.array([f.size for f in flats], dtype=np.int64)
        self.dtypes = [f.dtype for f in flats]
        self.local_size = local_size
        self.groups = {}  # dtype -> tensor positions, in order
        for t, dtype in enumerate(self.dtypes):
            self.groups.setdefault(dtype, []).append(t)
        # bounds[t, j]: where shard j of tensor t starts (column local_size: the end)
        self.bounds = np.stack([shard_bounds(n, local_size) for n in self.sizes]) \
            if len(flats) else np.zeros((0, local_size + 1), np.int64)
        lengths = np.diff(self.bounds, axis=1)
        # offsets[g][j]: where each tensor's shard j starts in segment j of dtype group g
        self.offsets = {dtype: np.vstack([np.zeros((1, local_size), np.int64),
                                          np.cumsum(lengths[ts], axis=0)])
                        for dtype, ts in self.groups.items()}
        self.dense_bytes = int(sum(f.nbytes for f in flats))
        self.digest = f"{zlib.crc32(repr([(f.size, f.dtype.str) for f in flats]).encode()):08x}"

    def segments(self, j: int) -> list:
        """``(size, dtype)`` of local rank ``j``'s segments."""
        return [(int(self.offsets[dtype][-1, j]), dtype) for dtype in self.groups]

    def empty_segments(self, j: int) -> list:
        return [np.empty(size, dtype) for size, dtype in self.segments(j)]

    def scatter(self, flats, signature: str, own: int) -> list:
        """Per local rank, a frame
        (:meth:`~deepreduce.exchange.topology.Failures.frame_buffer`) of the bytes of its
        segments cut from this rank's ``flats``; local rank ``own``'s (this rank's) is
        left empty: :meth:`reduce` reads its shards from ``flats``."""
        out = []
        for j in range(self.local_size):
            frame, buffer = Failures.frame_buffer(signature, 0 if j == own else sum(
                size * dtype.itemsize for size, dtype in self.segments(j)))
            if j == own:
                out.append(frame)
                continue
            pos = 0
            for dtype, ts in self.groups.items():
                segment = buffer[pos:pos + int(self.offsets[dtype][-1, j]) * dtype.itemsize] \
                    .view(dtype)
                for t, start in zip(ts, self.offsets[dtype][:-1, j].tolist()):
                    low, high = self.bounds[t, j], self.bounds[t, j + 1]
                    segment[start:start + high - low] = flats[t][low:high]
                pos += segment.nbytes
            out.append(frame)
        return out

    def reduce(self, received, j: int, flats) -> list:
        """Per tensor, its shard ``j`` summed over the node's ranks in local-rank order
        (in the tensor's dtype), from the other ranks' segment bytes ``received`` and this
        rank's ``flats``; the shards of one dtype are views of one segment."""
        shards, pos = [None] * len(self.dtypes), 0
        for dtype, ts in self.groups.items():
            size = int(self.offsets[dtype][-1, j])
            segments = [None if r == j else np.frombuffer(frame, dtype, size, pos)
                        for r, frame in enumerate(received)]
            total = np.empty(size, dtype)
            for t, start in zip(ts, self.offsets[dtype][:-1, j].tolist()):
                low, high = self.bounds[t, j], self.bounds[t, j + 1]
                parts = [flats[t][low:high] if segment is None else
                         segment[start:start + high - low] for segment in segments]
                shard = shards[t] = total[start:start + high - low]
                if len(parts) == 1:
                    shard[...] = parts[0]
                    continue
                np.add(parts[0], parts[1], out=shard)
                for part in parts[2:]:
                    shard += part
            pos += size * dtype.itemsize
        return shards

    def shard_views(self, segments, j: int) -> list:
        """Per tensor, the view of its shard ``j`` in ``segments`` (local rank ``j``'s)."""
        views = [None] * len(self.dtypes)
        for segment, (dtype, ts) in zip(segments, self.groups.items()):
            for t, start in zip(ts, self.offsets[dtype][:-1, j].tolist()):
                views[t] = segment[start:start + self.bounds[t, j + 1] - self.bounds[t, j]]
        return views

    def segment_positions(self, segments, j: int, written, distinct: bool) -> list:
        """Per segment of local rank ``j``, where it may be non-zero, increasing: each
        tensor's ``written`` positions (None: found by a pass over its shard), which are
        increasing and ``distinct`` (else made so)."""
        out = []
        for segment, (dtype, ts) in zip(segments, self.groups.items()):
            bits = segment.view(np.dtype(f"u{dtype.itemsize}"))
            parts = []
            for t, start in zip(ts, self.offsets[dtype][:-1, j].tolist()):
                length = int(self.bounds[t, j + 1] - self.bounds[t, j])
                where = written[t]
                if where is None:
                    where = np.flatnonzero(bits[start:start + length])
                elif not distinct:
                    where = np.unique(where)
                parts.append(where + start)
            out.append(np.concatenate(parts) if parts else np.zeros(0, np.int64))
        return out

    def assemble(self, segments, out, as_rows, stale=None) -> tuple[list, list]:
        """``(tensors, written)``: the whole tensors from every local rank's reduced
        ``segments`` (per local rank, a :class:`~deepreduce.exchange.topology.Segment`
        per dtype), written into ``out`` where given, and per tensor the positions written
        (None: the whole tensor may be). ``stale``: per ``out`` array, the positions outside
        which it is known to be zero (None: it is zeroed whole)."""
        results, written = [], []
        for t, (size, dtype) in enumerate(zip(self.sizes.tolist(), self.dtypes)):
            target = None if out is None or out[t] is None else out[t]
            written.append([])
            if target is None:
                results.append(np.zeros(size, dtype))
                continue
            if not isinstance(target, np.ndarray) or target.size != size \
                    or target.dtype != dtype or not target.flags.c_contiguous:
                raise ValueError(f"out must be a writable C-contiguous {dtype} array of "
                                 f"{size} elements")
            flat = target.reshape(-1)
            where = None if stale is None else stale[t]
            if where is None:
                flat.fill(0)
            else:
                flat[where] = 0
            results.append(flat)
        for j, per_rank in enumerate(segments):
            for entry, (dtype, ts) in zip(per_rank, self.groups.items()):
                starts = self.offsets[dtype][:, j]
                if entry.positions is None:  # dense: each tensor's piece
                    for t, start in zip(ts, starts[:-1].tolist()):
                        low, high = self.bounds[t, j], self.bounds[t, j + 1]
                        results[t][low:high] = entry.values[start:start + high - low]
                        written[t] = None
                    continue
                # sorted positions in the segment: each tensor's run of them
                cuts = np.searchsorted(entry.positions, starts).tolist()
                for t, start, low, high in zip(ts, starts[:-1].tolist(), cuts, cuts[1:]):
                    where = entry.positions[low:high] - start + self.bounds[t, j]
                    results[t][where] = entry.values[low:high]
                    if written[t] is not None:
                        written[t].append(where)
        written = [None if parts is None else
                   (np.concatenate(parts) if parts else np.zeros(0, np.int64))
                   for parts in written]
        for t, flat in enumerate(results):
            whole = flat.reshape(self.shapes[t])
            target = None if out is None else out[t]
            results[t] = nonzero_rows(whole) if as_rows[t] else \
                (target if target is not None else whole)
        return results, written
