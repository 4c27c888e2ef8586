"""SparCML's sparse allreduce, SSAR_Split_allgather, with the switch to DSAR.

1. **Split.** Each rank cuts its sparse input into P contiguous index ranges;
   range r is encoded as a deepreduce payload (indices re-based to the range)
   and sent to its owner, rank r, in one ``alltoall``.
2. **Reduce.** The owner decodes the P - 1 payloads, adds its own part and
   keeps the sum sparse: its support is the union of the supports.
3. **Allgather.** The owner encodes its reduced range again and one
   ``allgather`` gives every rank every range. A range whose sparse payload
   is not clearly smaller than its dense encoding is encoded densely as well
   and the smaller one travels (SparCML's ``nnz (isize + vsize) >= n vsize``,
   with the sizes the codecs actually produce): dense-ish results become
   DSAR_Split_allgather range by range.

The value codec of the pipeline applies in both stages (fp16, QSGD...), so a
lossy one rounds twice: the residual in :attr:`Reduction.sent` covers the
first rounding, the owner's rounding of the sum is shared by all ranks.

``algorithm="recursive_doubling"`` is SparCML's SSAR_Recursive_double
instead (P a power of two): in round i every rank swaps its partial sum with
rank ``rank XOR 2**i``, ``log2 P`` rounds. Horovod has no point-to-point
send, so each round is an alltoall in which only the partner's split is
non-empty; docs/collectives.md compares both with the cost model.
"""

from __future__ import annotations

import numpy as np

from deepreduce import container
from deepreduce.collectives import frames
from deepreduce.collectives.base import Communicator, check_peers, ranges, sum_sparse
from deepreduce.sparse import SparseTensor


class SparseAllreduce(Communicator):
    """Sparse allreduce by index ranges: alltoall to the range owners, then allgather.

    Parameters
    ----------
    pipeline, op, process_set, transport
        As for :class:`~deepreduce.collectives.base.Communicator`.
    algorithm : {"split", "recursive_doubling"}, default "split"
        SSAR_Split_allgather (2 collectives, any P) or SSAR_Recursive_double
        (``log2 P`` collectives, P a power of two; receives no more than the
        allgather, and less than the split version when supports overlap
        little).

    Examples
    --------
    Four ranks simulated by threads (with Horovod, leave ``transport`` out and
    start the script with ``horovodrun``):

    >>> import numpy as np, deepreduce as dr
    >>> from concurrent.futures import ThreadPoolExecutor
    >>> from deepreduce.collectives import SparseAllreduce, ThreadTransport
    >>> def rank_main(member):
    ...     x = np.zeros(12, np.float32)
    ...     x[[member.rank, 5]] = 1.0
    ...     pipe = dr.Pipeline(index="varint", value="raw")
    ...     return SparseAllreduce(pipe, transport=member).reduce(x).output
    >>> with ThreadPoolExecutor(4) as pool:
    ...     outputs = list(pool.map(rank_main, ThreadTransport.group(4)))
    >>> outputs[2]
    array([1., 1., 1., 1., 0., 4., 0., 0., 0., 0., 0., 0.], dtype=float32)
    """

    name = "sparse_allreduce"
    ALGORITHMS = ("split", "recursive_doubling")

    def __init__(self, pipeline=None, op="sum", process_set=None, transport=None,
                 algorithm="split"):
        if algorithm not in self.ALGORITHMS:
            raise ValueError(f"algorithm must be one of {self.ALGORITHMS}, got {algorithm!r}")
        super().__init__(pipeline, op, process_set, transport)
        self.algorithm = algorithm

    def __repr__(self):
        return (f"SparseAllreduce(pipeline={self.pipeline!r}, op={self.op!r}, "
                f"algorithm={self.algorithm!r})")

    def _settings(self):
        return {"algorithm": self.algorithm}

    def _encode(self, inp, rank, size):
        if self.algorithm == "recursive_doubling":
            return self._encode_doubling(inp, rank, size)
        st, dense = inp.selected, inp.dense
        bounds = ranges(st.size, size)
        cuts = np.searchsorted(st.indices, bounds).tolist()
        per_rank, sent, own = [], [], None
        for r in range(size):
            start, end = int(bounds[r]), int(bounds[r + 1])
            part = SparseTensor._trusted(st.values[cuts[r]:cuts[r + 1]],
                                         st.indices[cuts[r]:cuts[r + 1]] - start,
                                         (end - start,))
            if r == rank:  # the own range never leaves this rank: nothing to encode
                own, received = part, part
                per_rank.append(b"")
            else:
                payload, received = self.pipeline.encode_sparse(
                    part, None if dense is None else dense[start:end])
                per_rank.append(frames.sparse_frame(payload))
            sent.append(received)
        sent = SparseTensor._trusted(
            np.concatenate([part.values for part in sent]).astype(st.dtype, copy=False),
            np.concatenate([part.indices + bounds[r] for r, part in enumerate(sent)]),
            st.shape)
        return per_rank, own, sent

    def _communicate(self, transport, inp, signature, plan, traffic):
        if self.algorithm == "recursive_doubling":
            return self._communicate_doubling(transport, inp, signature, plan, traffic)
        per_rank, own, sent = plan
        rank, size, dtype, n = transport.rank, transport.size, inp.dtype, inp.selected.size
        bounds = ranges(n, size)
        start, end = int(bounds[rank]), int(bounds[rank + 1])
        signed = [b"" if r == rank else frames.signed(signature, f)
                  for r, f in enumerate(per_rank)]
        received = transport.alltoall(signed, traffic, "scatter")
        bodies = check_peers({r: received[r] for r in range(size) if r != rank},
                             signature, rank)
        # in rank order, like every other sum here: float64 sums are then bit-identical
        # whichever communicator computes them
        parts = [own if r == rank else _sparse(frames.read_frame(bodies[r], end - start, dtype))
                 for r in range(size)]
        frame, mine = self._encode_reduced(sum_sparse(parts, end - start, dtype))
        gathered = transport.allgather(frame, traffic, "gather")
        output = np.zeros(n, dtype=dtype)
        for r in range(size):
            start, end = int(bounds[r]), int(bounds[r + 1])
            decoded = mine if r == rank else frames.read_frame(gathered[r], end - start, dtype)
            _place(output, start, end, decoded)
        return output, sent

    def _encode_reduced(self, reduced: SparseTensor):
        """The frame of a reduced range (sparse or dense, whichever is smaller) and its content."""
        return encode_range(self.pipeline, reduced)

    # -- SSAR_Recursive_double ------------------------------------------------------
    def _encode_doubling(self, inp, rank, size):
        if size & (size - 1):
            raise ValueError(f"recursive doubling needs a power-of-two number of ranks, "
                             f"got {size}; use algorithm='split'")
        if size == 1:
            return [b""], inp.selected, inp.selected
        frame, received = encode_range(self.pipeline, inp.selected, inp.dense)
        # Round 0 carries the signature to every rank, the data to the partner only
        per_rank = [b"" if r == rank else frame if r == rank ^ 1 else b"" for r in range(size)]
        return per_rank, received, _sparse(received)

    def _communicate_doubling(self, transport, inp, signature, plan, traffic):
        per_rank, mine, sent = plan
        rank, size, dtype, n = transport.rank, transport.size, inp.dtype, inp.selected.size
        if size == 1:
            return mine.to_dense(), sent
        partial = None
        for round_ in range(size.bit_length() - 1):
            partner = rank ^ (1 << round_)
            if round_:
                frame, mine = encode_range(self.pipeline, partial)
                per_rank = [frame if r == partner else b"" for r in range(size)]
                received = transport.alltoall(per_rank, traffic, f"round{round_}")
                body = received[partner]
            else:
                signed = [b"" if r == rank else frames.signed(signature, f)
                          for r, f in enumerate(per_rank)]
                received = transport.alltoall(signed, traffic, "round0")
                body = check_peers({r: received[r] for r in range(size) if r != rank},
                                   signature, rank)[partner]
            theirs = _sparse(frames.read_frame(body, n, dtype))
            # Both partners add what the other decodes, lower rank first: identical sums
            pair = [_sparse(mine), theirs] if rank < partner else [theirs, _sparse(mine)]
            partial = sum_sparse(pair, n, dtype)
        return partial.to_dense(), sent


def encode_range(pipeline, reduced: SparseTensor, source=None):
    """Encode a range sparse, or dense when that is smaller; return (frame, received).

    ``source`` is the flat dense tensor ``reduced`` was selected from, when
    there is one: lossy index codecs read the values of their false positives
    there. The dense encoding is only tried when the sparse payload is at
    least half the estimated dense size (the value codec's bytes per value on
    this range times the range length): far from the crossover the estimate
    decides.
    """
    length, dtype = reduced.size, reduced.dtype
    index_codec = pipeline.index_codec
    if source is None and index_codec is not None and not index_codec.lossless:
        source = reduced.to_dense()
    payload, received = pipeline.encode_sparse(reduced, source)
    sparse = frames.sparse_frame(payload)
    value_codec = pipeline.value_codec
    if value_codec.sorts_values or length == 0:
        return sparse, received
    bytes_per_value = (container.read_header(payload).value_length / reduced.nnz
                       if reduced.nnz else dtype.itemsize)
    if 2 * len(sparse) < length * bytes_per_value:
        return sparse, received
    stream, dense_received = value_codec.encode_and_receive(reduced.to_dense())
    dense = frames.dense_frame(stream, dtype, length, value_codec.spec())
    if len(dense) < len(sparse):
        return dense, np.asarray(dense_received, dtype=dtype)
    return sparse, received


def _sparse(decoded):
    if isinstance(decoded, SparseTensor):
        return decoded
    return SparseTensor._trusted(decoded, np.arange(decoded.size, dtype=np.int64),
                                 (decoded.size,))


def _place(output, start, end, decoded):
    if isinstance(decoded, SparseTensor):
        output[start + decoded.indices] = decoded.values
    else:
        output[start:end] = decoded
