"""What every communicator shares: inputs, results and handles (the signed first frames are
:mod:`deepreduce.collectives.signed`'s).

A reduction has two halves. :meth:`Communicator._encode` runs in the caller's
thread: it sparsifies the input and encodes what leaves this rank. The rest
(:meth:`Communicator._communicate`: the collectives, the reduction at the
owners, decoding) runs on the transport's communication thread. The
asynchronous form returns after the first half, so the caller can encode the
next tensor while this one travels.

If the first half fails on a rank (a bad argument, an unsupported input), that
rank still takes part in the first collective with an ERROR frame, so every
rank raises instead of waiting forever for it.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

from deepreduce.collectives.signed import fail_collectively
from deepreduce.collectives.transport import Traffic, get_transport
from deepreduce.pipeline import Pipeline
from deepreduce.sparse import SparseTensor

_OPS = {"sum": "sum", "average": "average", "mean": "average"}


def op_name(op) -> str:
    """``"sum"`` or ``"average"`` from ``"sum"``, ``"average"`` or ``"mean"`` (any case).

    Framework constants are the framework layers' to translate:
    :func:`deepreduce.horovod.collectives.op_name` takes ``hvd.Sum`` / ``hvd.Average``.
    """
    if isinstance(op, str) and op.lower() in _OPS:
        return _OPS[op.lower()]
    raise ValueError(f"op must be 'sum' or 'average' ('mean'), got {op!r}; Horovod's hvd.Sum "
                     "and hvd.Average go through deepreduce.horovod.collectives")


@dataclass
class Reduction:
    """The result of one reduction on one rank.

    Attributes
    ----------
    output : numpy.ndarray
        The reduced dense tensor, with the input's shape and dtype (the
        communicators of :mod:`deepreduce.horovod.collectives` make it a
        ``tf.Tensor`` for TensorFlow input). Every rank gets the same values.
    sent : SparseTensor
        What this rank's input contributed after the sparsifier and the codecs:
        ``input - sent`` is the error-feedback residual.
    traffic : Traffic
        Bytes this rank handed to the collectives and received from the others.
    algorithm : str
        The algorithm that ran: ``"allgather"``, ``"split"``,
        ``"recursive_doubling"`` or ``"block"`` (with ``algorithm="auto"``,
        the one the ranks agreed on; the same on every rank).
    """

    output: object
    sent: SparseTensor
    traffic: Traffic
    algorithm: str = ""


class Handle:
    """A reduction in flight; :meth:`wait` returns its :class:`Reduction`."""

    def __init__(self, future, finish):
        self._future, self._finish = future, finish

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Reduction:
        """Block until the reduction is complete; re-raise its error, on every rank."""
        return self._finish(self._future.result(timeout))


@dataclass
class _Input:
    selected: SparseTensor          # after the sparsifier: flat, all pieces one after another
    dense: np.ndarray | None        # flat dense source, when the input was one dense tensor
    shapes: list                    # the shape of each tensor, in order
    single: bool                    # reduce() rather than reduce_many()

    @property
    def dtype(self):
        return self.selected.dtype


class Communicator:
    """Base class of the reducing communicators (``allgather``, ``sparse_allreduce``, ``block``).

    Parameters
    ----------
    pipeline : Pipeline, optional
        Sparsifier and codecs of what travels; ``Pipeline()`` (every non-zero,
        automatic index codec, raw values) by default.
    op : {"sum", "average"}
    process_set : optional
        Not used by this package, which knows no framework: the communicators
        of :mod:`deepreduce.horovod.collectives` reduce over Horovod's
        transport of this Horovod process set. Give it or ``transport``, not both.
    transport : Transport
        How the bytes move between the ranks: a
        :class:`~deepreduce.horovod.collectives.HorovodTransport`, a
        :class:`~deepreduce.torch.transport.TorchTransport`, or a member of
        ``ThreadTransport.group(P)``. Without one, the first reduction raises
        ValueError (the framework layers' communicators bring their own).
    """

    name = ""
    #: The collective each reduction starts with; a failing rank joins it with an ERROR frame.
    first_collective = "alltoall"

    def __init__(self, pipeline=None, op="sum", process_set=None, transport=None):
        if pipeline is None:
            pipeline = Pipeline()
        if not isinstance(pipeline, Pipeline):
            raise ValueError(f"pipeline must be a deepreduce.Pipeline, got "
                             f"{type(pipeline).__name__}")
        if transport is not None and process_set is not None:
            raise ValueError("give a transport or a process_set, not both")
        self.pipeline, self.op = pipeline, op_name(op)
        self._process_set, self._transport = process_set, transport
        #: Bytes sent and received by all reductions of this communicator so far.
        self.traffic = Traffic()

    def __repr__(self):
        return f"{type(self).__name__}(pipeline={self.pipeline!r}, op={self.op!r})"

    @property
    def transport(self):
        """The transport this communicator's collectives run over."""
        if self._transport is None:
            get_transport(None, self._process_set)  # raises, saying what to pass
        return self._transport

    # -- public API -------------------------------------------------------------
    def reduce(self, x) -> Reduction:
        """Reduce ``x`` (ndarray or SparseTensor) over all ranks."""
        return self.reduce_async(x).wait()

    def reduce_async(self, x) -> Handle:
        """Encode ``x`` now and return a :class:`Handle`; the collectives run in the background.

        Every rank must start its reductions in the same order.
        """
        return self._start(lambda: self._input([x], single=True))

    def reduce_many(self, xs) -> list:
        """Reduce several tensors of one dtype in one set of collectives (fusion).

        Each tensor goes through the sparsifier on its own; the selections are
        laid end to end and reduced together. Returns one :class:`Reduction`
        per tensor (they share one ``traffic``).
        """
        return self.reduce_many_async(xs).wait()

    def reduce_many_async(self, xs) -> Handle:
        """Like :meth:`reduce_many`, returning a :class:`Handle`."""
        return self._start(lambda: self._input(list(xs), single=False))

    # -- steps ----------------------------------------------------------------------
    def _start(self, make_input) -> Handle:
        transport = self.transport
        try:
            inp = make_input()
            signature = self._signature(inp)
            plan = self._encode(inp, transport.rank, transport.size)
            error = None
        except (ValueError, TypeError) as exc:
            inp = plan = None
            signature, error = "", exc
        future = transport.submit(self._run, transport, inp, signature, plan, error)
        return Handle(future, self._finish)

    def _input(self, xs: list, single: bool) -> _Input:
        selections, shapes, dense = [], [], None
        for x in xs:
            selected, dense = self.pipeline.sparsify(x)
            selections.append(selected)
            shapes.append(selected.shape)
        if single:
            flat = SparseTensor._trusted(selections[0].values, selections[0].indices,
                                         (selections[0].size,))
            return _Input(flat, dense, shapes, True)
        if not selections:
            raise ValueError("reduce_many needs at least one tensor")
        dtypes = {st.dtype for st in selections}
        if len(dtypes) > 1:
            raise ValueError(f"reduce_many needs tensors of one dtype, got "
                             f"{', '.join(sorted(d.name for d in dtypes))}")
        offsets = np.cumsum([0] + [st.size for st in selections])
        fused = SparseTensor._trusted(
            np.concatenate([st.values for st in selections]),
            np.concatenate([st.indices + offset for st, offset in zip(selections, offsets)]),
            (int(offsets[-1]),))
        return _Input(fused, None, shapes, False)

    def _signature(self, inp: _Input) -> str:
        shapes = ",".join("x".join(map(str, shape)) for shape in inp.shapes)
        if len(shapes) > 200:  # many fused tensors: a digest keeps the frame small
            shapes = (f"{len(inp.shapes)} tensors of {inp.selected.size} elements "
                      f"(crc32 {zlib.crc32(shapes.encode()):08x})")
        fields = {"communicator": self.name, "dtype": inp.dtype.name, "shapes": shapes,
                  "op": self.op, **self._settings()}
        return ";".join(f"{key}={value}" for key, value in fields.items())

    def _settings(self) -> dict:
        """Settings that must agree across ranks, beyond shape, dtype and op."""
        return {}

    def _encode(self, inp: _Input, rank: int, size: int):
        raise NotImplementedError

    def _communicate(self, transport, inp, signature, plan, traffic):
        """The collectives and the sums: return ``(output, sent, algorithm)``."""
        raise NotImplementedError

    def _run(self, transport, inp, signature, plan, error):
        traffic = Traffic()
        if error is not None:
            self._fail(transport, signature, error, traffic)
        output, sent, algorithm = self._communicate(transport, inp, signature, plan, traffic)
        if self.op == "average":
            output /= output.dtype.type(transport.size)
        self.traffic += traffic
        return inp, output, sent, traffic, algorithm

    def _fail(self, transport, signature, error, traffic):
        fail_collectively(self.first_collective, transport, signature, error, traffic)

    def _finish(self, result):
        inp, output, sent, traffic, algorithm = result
        reductions, offset = [], 0
        for shape in inp.shapes:
            size = math.prod(shape)
            piece = output[offset:offset + size].reshape(shape)
            start, end = np.searchsorted(sent.indices, [offset, offset + size])
            piece_sent = SparseTensor._trusted(sent.values[start:end],
                                               sent.indices[start:end] - offset, shape)
            reductions.append(Reduction(piece, piece_sent, traffic, algorithm))
            offset += size
        return reductions[0] if inp.single else reductions
