"""OmniReduce's block-sparse reduction, over a transport's alltoall and allgather.

The flat tensor is cut into blocks of ``block_size`` elements; a block is zero
when every ``|x| <= threshold``. Only the non-zero blocks travel: their block
numbers through the pipeline's (exact) index codec, their values, whole,
through its value codec. The blocks are dealt to the P owners in granules of
whole blocks, round-robin (:class:`~deepreduce.collectives.ownership.Ownership`:
hot low-numbered rows spread over all owners); each owner adds the blocks it
receives (the union of the non-zero blocks stays block-sparse) and returns
the reduced range, block-sparse or dense, whichever encodes smaller. With a
lossless or elementwise value codec (fp16, bf16) the return is one alltoall
in which every rank gets only the blocks it lacks (a block it contributed
alone is its own already); otherwise one allgather gives every rank the
same range.

Compared with :class:`~deepreduce.collectives.SparseAllreduce`, a block costs
one index for ``block_size`` values, so clustered supports (embedding rows,
attention heads, pruned channels) pay almost nothing for their positions, and
with threshold 0 and a lossless value codec the reduction is exact.
"""

from __future__ import annotations

import functools
import numbers

import numpy as np

from deepreduce.collectives import frames
from deepreduce.collectives.communicator import Communicator
from deepreduce.collectives.ownership import GRANULE, Ownership
from deepreduce.collectives.signed import signed_alltoall
from deepreduce.collectives.frames import Blocks
from deepreduce.errors import DecodeError
from deepreduce.sparse import SparseTensor, zeros
from deepreduce.sums import return_masks, returns_only_what_ranks_lack


class BlockReduce(Communicator):
    """Block-sparse allreduce: non-zero blocks to their owners, reduced blocks to all.

    Parameters
    ----------
    pipeline, op, process_set, transport
        As for :class:`~deepreduce.collectives.communicator.Communicator`. The
        sparsifier runs first (no sparsifier: every non-zero); the index codec
        codes block numbers and must be exact; the value codec must keep the
        values in their order.
    block_size : int, default 256
        Elements per block (OmniReduce's default), >= 1.
    threshold : float, default 0.0
        A block is sent when some ``|x| > threshold`` in it (NaN counts as
        non-zero); entries of blocks left behind are lost (in ``input - sent``).

    Examples
    --------
    >>> import numpy as np, deepreduce as dr
    >>> from concurrent.futures import ThreadPoolExecutor
    >>> from deepreduce.collectives import BlockReduce, ThreadTransport
    >>> def rank_main(member):
    ...     x = np.zeros(16, np.float32)
    ...     x[4 * member.rank:4 * member.rank + 2] = 1.0   # one block per rank is non-zero
    ...     comm = BlockReduce(dr.Pipeline(index="bitmap"), block_size=4, transport=member)
    ...     return comm.reduce(x).output
    >>> with ThreadPoolExecutor(2) as pool:
    ...     outputs = list(pool.map(rank_main, ThreadTransport.group(2)))
    >>> outputs[0]
    array([1., 1., 0., 0., 1., 1., 0., 0., 0., 0., 0., 0., 0., 0., 0., 0.],
          dtype=float32)
    """

    name = "block"
    #: Elements per granule of the owners' interleaved parts (rounded to whole blocks).
    granule = GRANULE

    def __init__(self, pipeline=None, block_size=256, threshold=0.0, op="sum",
                 process_set=None, transport=None):
        if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) \
                or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) \
                or not threshold >= 0:
            raise ValueError(f"threshold must be a number >= 0, got {threshold!r}")
        super().__init__(pipeline, op, process_set, transport)
        index_codec = self.pipeline.index_codec
        if index_codec is None or self.pipeline.value_codec.sorts_values:
            raise ValueError(f"value codec {self.pipeline.value_codec.codec_id!r} reorders the "
                             "values; blocks need a value codec that keeps their order")
        if not index_codec.lossless:
            raise ValueError(f"index codec {index_codec.codec_id!r} is lossy; block numbers "
                             "need an exact index codec")
        self.block_size, self.threshold = int(block_size), float(threshold)

    def __repr__(self):
        return (f"BlockReduce(pipeline={self.pipeline!r}, block_size={self.block_size}, "
                f"threshold={self.threshold}, op={self.op!r})")

    def _settings(self):
        return {"block_size": self.block_size, "granule": self.granule}

    def _ownership(self, n, size):
        """Granules of whole blocks: an owner's local index space holds whole blocks."""
        return Ownership.of(n, size, self.granule, unit=self.block_size)

    def _blocks(self, st: SparseTensor) -> Blocks:
        """The non-zero blocks of ``st``: sorted block numbers and their full contents."""
        block = self.block_size
        block_of = st.indices // block
        starts_block = np.diff(block_of, prepend=-1) != 0
        ids = block_of[starts_block]
        rows = np.zeros((ids.size, block), dtype=st.dtype)
        rows[np.cumsum(starts_block) - 1, st.indices % block] = st.values
        if rows.size:
            magnitudes = np.abs(rows if rows.dtype.itemsize >= 4 else rows.astype(np.float32))
            keep = ~(magnitudes.max(axis=1) <= self.threshold)
            ids, rows = ids[keep], rows[keep]
        return Blocks(ids, rows)

    def _encode(self, inp, rank, size):
        st, block = inp.selected, self.block_size
        owners = self._ownership(st.size, size)
        blocks = self._blocks(st)
        order, cuts, local = owners.split(blocks.ids * block)
        index_codec, value_codec = self.pipeline.index_codec, self.pipeline.value_codec
        per_rank, own = [], None
        sent_rows = np.empty_like(blocks.rows)
        for r in range(size):
            chosen = order[cuts[r]:cuts[r + 1]]
            ids, rows = local[chosen] // block, blocks.rows[chosen]
            if r == rank:
                own = Blocks(ids, rows)
                per_rank.append(b"")
                sent_rows[chosen] = rows
                continue
            blocks_in_range = -(-owners.length(r) // block)
            index_stream = index_codec.encode(ids, blocks_in_range)
            value_stream, received = value_codec.encode_and_receive(rows.reshape(-1))
            per_rank.append(frames.blocks_frame(
                index_stream, value_stream, st.dtype, blocks_in_range, block,
                ids.size, index_codec.header_spec(), value_codec.header_spec()))
            sent_rows[chosen] = np.asarray(received, dtype=st.dtype).reshape(rows.shape)
        sent = Blocks(blocks.ids, sent_rows)
        return per_rank, own, _expand(sent, block, 0, st.size, st.shape)

    def _communicate(self, transport, inp, signature, plan, traffic):
        per_rank, own, sent = plan
        rank, size, dtype, n = transport.rank, transport.size, inp.dtype, inp.selected.size
        block = self.block_size
        owners = self._ownership(n, size)
        length = owners.length(rank)
        bodies = signed_alltoall(transport, signature, per_rank, traffic, "scatter")
        parts = []  # in rank order, as every sum here
        for r in range(size):
            decoded = own if r == rank else frames.read_frame(bodies[r], length, dtype, block)
            if not isinstance(decoded, Blocks):
                raise DecodeError(f"rank {r} sent a frame that holds no blocks")
            parts.append(decoded)
        reduced = _sum_blocks(parts, block, dtype)
        output = zeros(n, dtype)
        if returns_only_what_ranks_lack(self.pipeline):
            per_rank, mine = self._encode_returns(reduced, [p.ids for p in parts], rank,
                                                  length, dtype)
            returned = transport.alltoall(per_rank, traffic, "return")
            # the blocks this rank contributed alone come back from nobody: its own values
            output[sent.indices] = sent.values
        else:
            frame, mine = self._encode_reduced(reduced, length, dtype)
            returned = transport.allgather(frame, traffic, "gather")
        for r in range(size):
            decoded = mine if r == rank else frames.read_frame(returned[r], owners.length(r),
                                                               dtype, block)
            if isinstance(decoded, Blocks):
                # granules hold whole blocks: a block's elements follow its first one
                starts = owners.to_global(r, decoded.ids * block)
                part = _expand(Blocks(starts // block, decoded.rows), block, 0, n, (n,))
                output[part.indices] = part.values
            elif isinstance(decoded, np.ndarray):
                owners.place(output, r, decoded)
            else:
                raise DecodeError(f"rank {r} gathered a frame that holds no blocks")
        return output, sent, "block"

    def _encode_returns(self, reduced: Blocks, supports: list, rank, length, dtype):
        """Per rank, the frame of the reduced blocks it lacks; and the range as all hold it.

        A lossy (elementwise) value codec rounds the sums once here, so the
        owner keeps what the others decode.
        """
        value_codec = self.pipeline.value_codec
        if not value_codec.lossless:
            _, rounded = value_codec.encode_and_receive(reduced.rows.reshape(-1))
            reduced = Blocks(reduced.ids,
                             np.asarray(rounded, dtype=dtype).reshape(reduced.rows.shape))
        # the whole range dense, encoded once if some rank's frame is better dense
        dense = functools.cache(lambda: self._encode_dense(reduced, length, dtype))
        per_rank = []
        for r, needed in enumerate(return_masks(reduced.ids, supports)):
            lacking = Blocks(reduced.ids[needed], reduced.rows[needed])
            per_rank.append(b"" if r == rank else
                            self._encode_reduced(lacking, length, dtype, dense=dense)[0])
        return per_rank, reduced

    def _encode_reduced(self, reduced: Blocks, length, dtype, dense=None):
        """Blocks frame of ``reduced``, or the dense range when that is smaller; and what
        receivers decode from it.

        ``dense``, when given, returns the dense ``(frame, received)`` to compare
        with (default: of ``reduced``); a receiver lacking only part of a range
        gets the whole range when dense.
        """
        index_codec, value_codec = self.pipeline.index_codec, self.pipeline.value_codec
        blocks_in_range = -(-length // self.block_size)
        value_stream, received = value_codec.encode_and_receive(reduced.rows.reshape(-1))
        frame = frames.blocks_frame(index_codec.encode(reduced.ids, blocks_in_range),
                                    value_stream, dtype, blocks_in_range, self.block_size,
                                    reduced.ids.size, index_codec.header_spec(), value_codec.header_spec())
        mine = Blocks(reduced.ids, np.asarray(received, dtype=dtype).reshape(reduced.rows.shape))
        bytes_per_value = len(value_stream) / reduced.rows.size if reduced.rows.size \
            else dtype.itemsize
        if length == 0 or 2 * len(frame) < length * bytes_per_value:
            return frame, mine
        dense_frame, dense_received = (
            dense or (lambda: self._encode_dense(reduced, length, dtype)))()
        if len(dense_frame) < len(frame):
            return dense_frame, dense_received
        return frame, mine

    def _encode_dense(self, reduced: Blocks, length, dtype):
        """The range's dense frame (every value, no block numbers) and what receivers get."""
        value_codec = self.pipeline.value_codec
        values = _expand(reduced, self.block_size, 0, length, (length,)).to_dense()
        stream, received = value_codec.encode_and_receive(values)
        frame = frames.dense_frame(stream, dtype, length, value_codec.header_spec())
        return frame, np.asarray(received, dtype=dtype)


def _sum_blocks(parts: list, block_size, dtype) -> Blocks:
    """Add block lists: the result's blocks are the union, summed in float64."""
    parts = [p for p in parts if p.ids.size]
    if not parts:
        return Blocks(np.zeros(0, np.int64), np.zeros((0, block_size), dtype))
    if len(parts) == 1:
        return Blocks(parts[0].ids, parts[0].rows.astype(dtype, copy=False))
    union = np.unique(np.concatenate([p.ids for p in parts]))
    totals = np.zeros((union.size, block_size), dtype=np.float64)
    for part in parts:  # one pass per rank, in rank order: block numbers are unique per part
        totals[np.searchsorted(union, part.ids)] += part.rows
    return Blocks(union, totals.astype(dtype))


def _expand(blocks: Blocks, block_size, start, end, shape) -> SparseTensor:
    """Every element of the blocks as a SparseTensor, offset by ``start``, cut at ``end``."""
    positions = (start + blocks.ids[:, None] * block_size
                 + np.arange(block_size, dtype=np.int64)).reshape(-1)
    values = blocks.rows.reshape(-1)
    inside = positions < end
    if not inside.all():
        positions, values = positions[inside], values[inside]
    return SparseTensor._trusted(values, positions, shape)
