"""SparCML's sparse allreduce: SSAR_Split_allgather (with DSAR), SSAR_Recursive_double,
and the choice between them and a plain allgather from the alpha-beta cost model.

``algorithm="split"``:

1. **Split.** The index space is dealt to the P owners in granules
   (:class:`~deepreduce.collectives.ownership.Ownership`: round-robin, so that hot
   low indices spread over all owners); each rank encodes the part of its
   sparse input that each owner holds as a deepreduce payload (indices local
   to the owner) and sends it there, in one ``alltoall``.
2. **Reduce.** The owner decodes the P - 1 payloads, adds its own part and
   keeps the sum sparse: its support is the union of the supports.
3. **Return.** The owner encodes its reduced part again and sends it back.
   With an exact index codec and a lossless or elementwise value codec
   (fp16, bf16), every rank gets, in one ``alltoall``, only the entries it
   lacks: an entry it contributed alone is its own value already (as the
   owner decoded it), so with little overlap it does not travel twice and
   the split receives less than an allgather of the inputs. Otherwise (QSGD
   rounds per bucket, Bloom filters add positions) one ``allgather`` gives
   every rank the same part, SparCML's original. A frame whose sparse
   payload is not clearly smaller than the dense part is encoded densely as
   well and the smaller one travels (SparCML's ``nnz (isize + vsize) >= n
   vsize``, with the sizes the codecs actually produce): dense-ish results
   become DSAR_Split_allgather part by part.

The value codec of the pipeline applies in both stages (fp16, QSGD...), so a
lossy one rounds twice: the residual in :attr:`Reduction.sent` covers the
first rounding, the owner's rounding of the sum is shared by all ranks.

``algorithm="recursive_doubling"`` is SparCML's SSAR_Recursive_double
instead (P a power of two): in round i every rank swaps its partial sum with
rank ``rank XOR 2**i``, ``log2 P`` rounds. A transport has no point-to-point
send (Horovod has none), so each round is an alltoall in which only the
partner's split is non-empty.

``algorithm="auto"`` (the default) first exchanges every rank's non-zero count
and encoded sizes (one small alltoall that also checks the signatures), then
every rank evaluates :func:`~deepreduce.collectives.cost.choose_algorithm` on
the same numbers and runs the cheapest of split, recursive doubling and a
plain allgather of the payloads. docs/collectives.md has the argument.
"""

from __future__ import annotations

import functools
import numbers

import numpy as np

from deepreduce import container
from deepreduce.collectives import cost, frames
from deepreduce.collectives.communicator import Communicator
from deepreduce.collectives.ownership import GRANULE, Ownership
from deepreduce.collectives.signed import signed_alltoall
from deepreduce.sparse import SparseTensor, zeros
from deepreduce.sums import return_masks, returns_only_what_ranks_lack, sum_sparse


class SparseAllreduce(Communicator):
    """Sparse allreduce: split-allgather, recursive doubling or allgather, chosen by cost.

    Parameters
    ----------
    pipeline, op, process_set, transport
        As for :class:`~deepreduce.collectives.communicator.Communicator`.
    algorithm : {"auto", "split", "recursive_doubling"}, default "auto"
        ``"split"``: SSAR_Split_allgather (2 collectives, any P).
        ``"recursive_doubling"``: SSAR_Recursive_double (``log2 P``
        collectives, P a power of two; receives no more than the allgather,
        and less than the split version when supports overlap little).
        ``"auto"``: one small exchange of the ranks' sizes, then the cheapest
        of those two and a plain allgather under the cost model
        (:func:`~deepreduce.collectives.cost.choose_algorithm`);
        :attr:`Reduction.algorithm` says which ran.
    alpha_op, alpha, beta : float
        The network ``"auto"`` weighs the algorithms with: seconds per
        Horovod operation, per message and per byte (defaults
        :data:`~deepreduce.collectives.cost.ALPHA_OP`, ``ALPHA``, ``BETA``).
        ``alpha_op=0, alpha=0`` chooses by bytes alone.

    Examples
    --------
    Four ranks simulated by threads (over Horovod, under ``horovodrun``:
    :class:`deepreduce.horovod.collectives.SparseAllreduce`, which needs no
    ``transport``):

    >>> import numpy as np, deepreduce as dr
    >>> from concurrent.futures import ThreadPoolExecutor
    >>> from deepreduce.collectives import SparseAllreduce, ThreadTransport
    >>> def rank_main(member):
    ...     x = np.zeros(12, np.float32)
    ...     x[[member.rank, 5]] = 1.0
    ...     pipe = dr.Pipeline(index="varint", value="raw")
    ...     return SparseAllreduce(pipe, transport=member).reduce(x)
    >>> with ThreadPoolExecutor(4) as pool:
    ...     reductions = list(pool.map(rank_main, ThreadTransport.group(4)))
    >>> reductions[2].output
    array([1., 1., 1., 1., 0., 4., 0., 0., 0., 0., 0., 0.], dtype=float32)
    >>> reductions[2].algorithm    # a tiny tensor: one operation beats two
    'allgather'
    """

    name = "sparse_allreduce"
    ALGORITHMS = ("auto", "split", "recursive_doubling")
    #: Elements per granule of the owners' interleaved parts (``"split"``).
    granule = GRANULE

    def __init__(self, pipeline=None, op="sum", process_set=None, transport=None,
                 algorithm="auto", alpha_op=cost.ALPHA_OP, alpha=cost.ALPHA, beta=cost.BETA):
        if algorithm not in self.ALGORITHMS:
            raise ValueError(f"algorithm must be one of {self.ALGORITHMS}, got {algorithm!r}")
        for name, value in (("alpha_op", alpha_op), ("alpha", alpha), ("beta", beta)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                    or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        super().__init__(pipeline, op, process_set, transport)
        self.algorithm = algorithm
        self.alpha_op, self.alpha, self.beta = float(alpha_op), float(alpha), float(beta)

    def __repr__(self):
        return (f"SparseAllreduce(pipeline={self.pipeline!r}, op={self.op!r}, "
                f"algorithm={self.algorithm!r})")

    def _settings(self):
        settings = {"algorithm": self.algorithm}
        if self.algorithm == "auto":  # every rank must weigh the algorithms alike
            settings["network"] = f"{self.alpha_op:g}/{self.alpha:g}/{self.beta:g}"
        if self.algorithm != "recursive_doubling":
            settings["granule"] = self.granule
        return settings

    def _encode(self, inp, rank, size):
        if self.algorithm == "recursive_doubling":
            return self._encode_doubling(inp, rank, size)
        if self.algorithm == "auto":
            return self._encode_auto(inp, rank, size)
        return self._encode_split(inp, rank, size)

    def _communicate(self, transport, inp, signature, plan, traffic):
        if self.algorithm == "recursive_doubling":
            return self._communicate_doubling(transport, inp, signature, plan, traffic)
        if self.algorithm == "auto":
            return self._communicate_auto(transport, inp, signature, plan, traffic)
        return self._communicate_split(transport, inp, signature, plan, traffic)

    # -- algorithm="auto" -------------------------------------------------------------
    def _encode_auto(self, inp, rank, size):
        """The whole input as one payload (what allgather and recursive doubling's first
        round send), and its sizes for the agreement."""
        frame, received = encode_range(self.pipeline, inp.selected, inp.dense)
        if frame[0] == frames.SPARSE:
            header = container.read_header(frame[1:])
            sizes = (inp.selected.nnz, header.index_length, header.value_length)
        else:
            sizes = (inp.selected.nnz, 0, len(frame))
        return frame, received, sizes

    def choose(self, size: int, n: int, table) -> str:
        """The algorithm for ``size`` ranks given every rank's ``(nnz, index bytes, value
        bytes)`` of its whole payload: the cost model's choice, the same on every rank."""
        counts = [nnz for nnz, _, _ in table]
        total = sum(counts)
        if total == 0:
            index_bytes, value_bytes = 0.0, 0.0
        else:
            # bytes per entry measured at the ranks' own density; index codecs
            # spend fewer bytes per index on denser sets (the union), modelled
            # by the entropy bound's slope
            own_rate = sum(i for _, i, _ in table) / total
            value_bytes = sum(v for _, _, v in table) / total
            own_density = min(total / size / n, 1.0)
            floor = cost.entropy_index_bytes(own_density)
            index_bytes = (own_rate if floor == 0.0 else
                           lambda d: own_rate * cost.entropy_index_bytes(d) / floor)
        name, _ = cost.choose_algorithm(size, n, counts, index_bytes, value_bytes,
                                        self.alpha_op, self.alpha, self.beta,
                                        returns_only_what_ranks_lack(self.pipeline))
        return name

    def _communicate_auto(self, transport, inp, signature, plan, traffic):
        frame, mine, sizes = plan
        rank, size, n = transport.rank, transport.size, inp.selected.size
        bodies = signed_alltoall(transport, signature, [frames.counts_frame(*sizes)] * size,
                                 traffic, "agree")
        table = [sizes if r == rank else frames.read_counts(bodies[r], n) for r in range(size)]
        algorithm = self.choose(size, n, table)
        if algorithm == "split":
            split_plan = self._encode_split(inp, rank, size)
            return self._communicate_split(transport, inp, signature, split_plan, traffic)
        if algorithm == "recursive_doubling":
            per_rank = [frame if r == rank ^ 1 else b"" for r in range(size)]
            return self._communicate_doubling(transport, inp, signature,
                                              (per_rank, mine, _sparse(mine)), traffic)
        gathered = transport.allgather(frame, traffic, "gather")
        parts = [_sparse(mine if r == rank else frames.read_frame(gathered[r], n, inp.dtype))
                 for r in range(size)]
        return sum_sparse(parts, n, inp.dtype).to_dense(), _sparse(mine), "allgather"

    # -- SSAR_Split_allgather ---------------------------------------------------------
    def _ownership(self, n, size):
        return Ownership.of(n, size, self.granule)

    def _encode_split(self, inp, rank, size):
        st, dense = inp.selected, inp.dense
        owners = self._ownership(st.size, size)
        order, cuts, local = owners.split(st.indices)
        lossy_index = self.pipeline.index_codec is not None \
            and not self.pipeline.index_codec.lossless
        per_rank, sent, own = [], [], None
        for r in range(size):
            chosen = order[cuts[r]:cuts[r + 1]]
            part = SparseTensor._trusted(st.values[chosen], local[chosen],
                                         (owners.length(r),))
            if r == rank:  # the own part never leaves this rank: nothing to encode
                own, received = part, part
                per_rank.append(b"")
            else:
                # only lossy index codecs read the dense source (false positives' values)
                source = owners.take(dense, r) if lossy_index and dense is not None else None
                payload, received = self.pipeline.encode_sparse(part, source)
                per_rank.append(frames.sparse_frame(payload))
            sent.append(received)
        indices = np.concatenate([owners.to_global(r, part.indices)
                                  for r, part in enumerate(sent)])
        values = np.concatenate([part.values for part in sent]).astype(st.dtype, copy=False)
        if owners.n > owners.stride:  # interleaved parts: back to increasing indices
            back = np.argsort(indices, kind="stable")
            indices, values = indices[back], values[back]
        return per_rank, own, SparseTensor._trusted(values, indices, st.shape)

    def _communicate_split(self, transport, inp, signature, plan, traffic):
        per_rank, own, sent = plan
        rank, size, dtype, n = transport.rank, transport.size, inp.dtype, inp.selected.size
        owners = self._ownership(n, size)
        length = owners.length(rank)
        bodies = signed_alltoall(transport, signature, per_rank, traffic, "scatter")
        # in rank order, like every other sum here: float64 sums are then bit-identical
        # whichever communicator computes them
        parts = [own if r == rank else _sparse(frames.read_frame(bodies[r], length, dtype))
                 for r in range(size)]
        reduced = sum_sparse(parts, length, dtype)
        output = zeros(n, dtype)
        if returns_only_what_ranks_lack(self.pipeline):
            per_rank, mine = self._encode_returns(reduced, [p.indices for p in parts], rank)
            returned = transport.alltoall(per_rank, traffic, "return")
            # what this rank contributed alone comes back from nobody: its own values
            output[sent.indices] = sent.values
        else:
            frame, mine = encode_range(self.pipeline, reduced)
            returned = transport.allgather(frame, traffic, "gather")
        for r in range(size):
            decoded = mine if r == rank else frames.read_frame(returned[r], owners.length(r),
                                                               dtype)
            if isinstance(decoded, SparseTensor):
                output[owners.to_global(r, decoded.indices)] = decoded.values
            else:
                owners.place(output, r, decoded)
        return output, sent, "split"

    def _encode_returns(self, reduced: SparseTensor, supports: list, rank: int):
        """Per rank, the frame of the reduced entries it lacks; and the part as all hold it.

        A rank's frame is sparse, or the whole part dense when that is
        smaller. A lossy (elementwise) value codec rounds the sums once here,
        so the owner keeps what the others decode.
        """
        value_codec = self.pipeline.value_codec
        if not value_codec.lossless:
            _, rounded = value_codec.encode_and_receive(reduced.values)
            reduced = SparseTensor._trusted(np.asarray(rounded, dtype=reduced.dtype),
                                            reduced.indices, reduced.shape)
        # the whole part dense, encoded once if some rank's frame is better dense
        dense = functools.cache(lambda: encode_dense(self.pipeline, reduced))
        per_rank = []
        for r, needed in enumerate(return_masks(reduced.indices, supports)):
            if r == rank:
                per_rank.append(b"")
                continue
            lacking = SparseTensor._trusted(reduced.values[needed], reduced.indices[needed],
                                            reduced.shape)
            per_rank.append(encode_range(self.pipeline, lacking, dense=dense)[0])
        return per_rank, reduced

    # -- SSAR_Recursive_double ------------------------------------------------------
    def _encode_doubling(self, inp, rank, size):
        if size & (size - 1):
            raise ValueError(f"recursive doubling needs a power-of-two number of ranks, "
                             f"got {size}; use algorithm='split' or 'auto'")
        if size == 1:
            return [b""], inp.selected, inp.selected
        frame, received = encode_range(self.pipeline, inp.selected, inp.dense)
        # Round 0 carries the signature to every rank, the data to the partner only
        per_rank = [frame if r == rank ^ 1 else b"" for r in range(size)]
        return per_rank, received, _sparse(received)

    def _communicate_doubling(self, transport, inp, signature, plan, traffic):
        per_rank, mine, sent = plan
        rank, size, dtype, n = transport.rank, transport.size, inp.dtype, inp.selected.size
        if size == 1:
            return _sparse(mine).to_dense(), sent, "recursive_doubling"
        partial = None
        for round_ in range(size.bit_length() - 1):
            partner = rank ^ (1 << round_)
            if round_:
                frame, mine = encode_range(self.pipeline, partial)
                per_rank = [frame if r == partner else b"" for r in range(size)]
                received = transport.alltoall(per_rank, traffic, f"round{round_}")
                body = received[partner]
            else:
                body = signed_alltoall(transport, signature, per_rank, traffic,
                                       "round0")[partner]
            theirs = _sparse(frames.read_frame(body, n, dtype))
            # Both partners add what the other decodes, lower rank first: identical sums
            pair = [_sparse(mine), theirs] if rank < partner else [theirs, _sparse(mine)]
            partial = sum_sparse(pair, n, dtype)
        return partial.to_dense(), sent, "recursive_doubling"


def encode_range(pipeline, reduced: SparseTensor, source=None, dense=None):
    """Encode a range sparse, or dense when that is smaller; return (frame, received).

    ``source`` is the flat dense tensor ``reduced`` was selected from, when
    there is one: lossy index codecs read the values of their false positives
    there. The dense encoding is only tried when the sparse payload is at
    least half the estimated dense size (the value codec's bytes per value on
    this range times the range length): far from the crossover the estimate
    decides. ``dense``, when given, returns the dense ``(frame, received)``
    to compare with (default :func:`encode_dense` of ``reduced``): a receiver
    that lacks only part of a range gets the whole range when dense.
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
    dense_frame, dense_received = (dense or (lambda: encode_dense(pipeline, reduced)))()
    if len(dense_frame) < len(sparse):
        return dense_frame, dense_received
    return sparse, received


def encode_dense(pipeline, reduced: SparseTensor):
    """The dense frame of a range (every value, no indices) and what receivers decode."""
    value_codec = pipeline.value_codec
    stream, received = value_codec.encode_and_receive(reduced.to_dense())
    frame = frames.dense_frame(stream, reduced.dtype, reduced.size, value_codec.header_spec())
    return frame, np.asarray(received, dtype=reduced.dtype)


def _sparse(decoded):
    if isinstance(decoded, SparseTensor):
        return decoded
    return SparseTensor._trusted(decoded, np.arange(decoded.size, dtype=np.int64),
                                 (decoded.size,))

