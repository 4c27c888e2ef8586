"""DeepReduce's own scheme: allgather every rank's payload, decode all, sum.

The reference point of the other communicators: one collective, and every
rank receives the P - 1 payloads of the others, so the volume grows with P.
"""

from __future__ import annotations

from deepreduce.collectives import frames
from deepreduce.collectives.communicator import Communicator
from deepreduce.collectives.signed import signed_allgather
from deepreduce.errors import DecodeError
from deepreduce.sparse import SparseTensor
from deepreduce.sums import sum_sparse


class AllgatherReduce(Communicator):
    """Allgather the payloads, then every rank decodes and sums all of them.

    Parameters
    ----------
    pipeline, op, process_set, transport
        As for :class:`~deepreduce.collectives.communicator.Communicator`.

    Examples
    --------
    >>> import numpy as np, deepreduce as dr
    >>> from concurrent.futures import ThreadPoolExecutor
    >>> from deepreduce.collectives import AllgatherReduce, ThreadTransport
    >>> def rank_main(member):
    ...     x = np.arange(6, dtype=np.float32) * (member.rank + 1)
    ...     reduction = AllgatherReduce(dr.Pipeline(index="varint"), transport=member).reduce(x)
    ...     return reduction.output
    >>> with ThreadPoolExecutor(2) as pool:
    ...     outputs = list(pool.map(rank_main, ThreadTransport.group(2)))
    >>> outputs[1]
    array([ 0.,  3.,  6.,  9., 12., 15.], dtype=float32)
    """

    name = "allgather"
    first_collective = "allgather"

    def _encode(self, inp, rank, size):
        payload, received = self.pipeline.encode_sparse(inp.selected, inp.dense)
        return frames.sparse_frame(payload), received

    def _communicate(self, transport, inp, signature, plan, traffic):
        frame, sent = plan
        rank, n, dtype = transport.rank, inp.selected.size, inp.dtype
        bodies = signed_allgather(transport, signature, frame, traffic, "gather")
        parts = [sent if r == rank else frames.read_frame(bodies[r], n, dtype)
                 for r in range(transport.size)]
        if not all(isinstance(part, SparseTensor) for part in parts):
            raise DecodeError("allgather frames must hold sparse payloads")
        return sum_sparse(parts, n, dtype).to_dense(), sent, "allgather"
