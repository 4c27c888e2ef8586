"""One step's gradients across ranks: select, encode, move, decode, sum.

Every training integration (Horovod + TensorFlow in :mod:`deepreduce.horovod`,
PyTorch DDP in :mod:`deepreduce.torch`) converts its tensors to numpy, provides a
transport, and holds a :class:`GradientExchange`, which does the rest. The exchange
is made of parts with one job each:

- :mod:`deepreduce.config`: the settings (:class:`~deepreduce.config.ExchangeConfig`);
- :mod:`deepreduce.selection`: per tensor, the min-size rule, seeding, error
  feedback and the sparsifier;
- :mod:`deepreduce.allgather_exchange`: bundles of payloads to every rank,
  decoded and summed there (the default communicator, DeepReduce's scheme);
- :mod:`deepreduce.reducing_exchange`: SparCML's and OmniReduce's communicators,
  which sum inside the collective;
- :mod:`deepreduce.bundle`: the bundle's wire format.

There is one way to run a step, :meth:`GradientExchange.reduce_async`, over any
transport and communicator. Horovod's graph mode, which allgathers inside the
TensorFlow graph, uses its two halves: :meth:`GradientExchange.encode_bundle` and
:meth:`GradientExchange.decode_groups`.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from deepreduce.allgather_exchange import AllgatherExchange
from deepreduce.collectives.base import fail_collectively, op_name, signed_allgather
from deepreduce.collectives.transport import Traffic
from deepreduce.config import ExchangeConfig
from deepreduce.errors import DecodeError
from deepreduce.hierarchical_exchange import HierarchicalExchange
from deepreduce.reducing_exchange import ReducingExchange
from deepreduce.selection import Selector
from deepreduce.sparse import SparseTensor
from deepreduce.stats import CompressionStats, StepStats

#: What a bundle travels behind over a transport (Horovod's graph path allgathers bare
#: bundles); ranks that fail to encode send an ERROR frame instead, so none waits.
BUNDLE_SIGNATURE = "exchange=bundles"
#: What the one-byte answers of :meth:`GradientExchange.agree_finite` travel behind.
FINITE_SIGNATURE = "exchange=finite"


class GradientExchange:
    """One step's gradients across ranks: error feedback, sparsifier, codecs, transport, sums.

    Parameters
    ----------
    *args, **settings
        The fields of :class:`~deepreduce.config.ExchangeConfig`, in its order or by
        name: ``sparsifier`` (default Top-1%), ``index`` ("auto"), ``value``
        ("fp16"), ``error_feedback`` (True), ``min_size`` (1024), ``seed`` (0),
        ``communicator`` ("allgather"), ``communicator_options`` and
        ``codec_threads`` (None: automatic).
    config : ExchangeConfig, optional
        All of them at once, instead.
    selector : callable, default :class:`~deepreduce.selection.Selector`
        Makes the per-tensor step from the config: the numpy one, or one that
        works where the tensors live (:class:`deepreduce.torch.device.DeviceSelector`).

    Attributes
    ----------
    config : ExchangeConfig
    memory : ResidualMemory or None
        The residuals of error feedback.
    stats : deepreduce.stats.CompressionStats
        Bytes and times of every step.

    Examples
    --------
    >>> import numpy as np, deepreduce as dr
    >>> from deepreduce.exchange import GradientExchange
    >>> rng = np.random.default_rng(0)
    >>> grads = [rng.standard_normal((100, 50)).astype(np.float32),
    ...          rng.standard_normal(10).astype(np.float32)]
    >>> c = GradientExchange(dr.TopK(0.01), index="varint", value="fp16")
    >>> bundle = c.encode_bundle(["w", "b"], grads)     # what this rank sends
    >>> w, b = c.decode_bundles(bundle + bundle, ranks=2, rank=0)   # what two ranks get
    >>> int(np.count_nonzero(w)), bool(np.array_equal(b, 2 * grads[1]))
    (50, True)
    >>> c.stats.last.ratio > 40
    True
    """

    def __init__(self, *args, config: ExchangeConfig | None = None, selector=Selector,
                 **settings):
        self.config = config = ExchangeConfig.from_settings(config, *args, **settings)
        self.selector = selector(config)
        self._allgather = AllgatherExchange(self.selector, config.codec_threads)
        self._reducing = None if config.communicator in ("allgather", "hierarchical") else \
            ReducingExchange(config, self.selector)
        self._hierarchical = HierarchicalExchange(config, self.selector) \
            if config.communicator == "hierarchical" else None
        self.stats = CompressionStats()
        self._init_runtime()

    #: (what an exchange pickled before the hierarchical communicator existed reads)
    _hierarchical = None

    def _init_runtime(self):
        self._lock = threading.Lock()
        # per bundle group: its last bundle, and what its payloads and tensors decode to
        self._last_sent = {}

    def __getstate__(self):
        # what belongs to the running process stays behind: the lock and the payloads of
        # the last bundle
        state = dict(self.__dict__)
        for runtime in ("_lock", "_last_sent"):
            state.pop(runtime)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._init_runtime()

    def __repr__(self):
        memory = "None" if self.memory is None else f"ResidualMemory(beta={self.memory.beta})"
        options = "".join(f", {k}={v!r}" for k, v in self.communicator_options.items())
        return (f"{type(self).__name__}({self.pipeline!r}, error_feedback={memory}, "
                f"min_size={self.min_size}, seed={self.seed}, "
                f"communicator={self.communicator!r}{options})")

    # -- what the parts hold ---------------------------------------------------------
    @property
    def pipeline(self):
        """The configured pipeline (sparsifier and codecs, seeded)."""
        return self.selector.pipeline

    @property
    def small_pipeline(self):
        """The lossless pipeline of tensors below ``min_size``."""
        return self.selector.small_pipeline

    @property
    def memory(self):
        return self.selector.memory

    @property
    def min_size(self) -> int:
        return self.config.min_size

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def communicator(self) -> str:
        return self.config.communicator

    @property
    def communicator_options(self) -> dict:
        return self.config.communicator_options

    def state_dict(self) -> dict:
        """What a checkpoint needs to continue exactly: every residual (copies) and the
        random streams (see :meth:`deepreduce.selection.Selector.state_dict`)."""
        return self.selector.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict` (of an exchange with the same settings)."""
        self.selector.load_state_dict(state)

    def pay(self, names, tensors, transport=None) -> None:
        """Add what error feedback owes into ``tensors`` (in place) and forget it, for a
        step that sends them whole (a dense allreduce before compression starts).

        With the hierarchical communicator each residual covers this rank's shard,
        which ``transport`` (the reduction's) locates.
        """
        memory = self.memory
        if memory is None:
            return
        if self._hierarchical is not None:
            self._hierarchical.pay(memory, names, tensors, transport)
            return
        for name, x in zip(names, tensors):
            memory.pay(name, x)

    def rescale(self, factor: float) -> None:
        """Multiply every residual by ``factor``: keep error feedback in the units of the
        gradients when they change, as a loss scaler's gradients do when it changes its
        scale (``factor`` = new scale / old scale; by a power of two, exact)."""
        if self.memory is not None:
            self.memory.rescale(factor)

    def agree_finite(self, tensors, transport) -> bool:
        """Whether every rank's ``tensors`` are finite, as :meth:`reduce_async`'s
        ``finite`` takes it: this rank's are checked here (one read pass each), and
        every rank's answer travels in one allgather of a byte on ``transport``, after
        the reductions already started there; the caller waits for it. Every rank
        calls it for the same step. (DDP's hook asks its ranks on a group of its own
        instead, without waiting for its other reductions.)"""
        mine = self.selector.all_finite(tensors)

        def gather():
            # (ASCII: a frame starting with byte 0 is an ERROR frame)
            answers = signed_allgather(transport, FINITE_SIGNATURE, b"1" if mine else b"0",
                                       Traffic(), "finite")
            if any(bytes(answer) not in (b"0", b"1") for answer in answers):
                raise DecodeError("a rank's answer to 'finite?' is not b'0' or b'1'")
            return all(bytes(answer) == b"1" for answer in answers)
        return transport.submit(gather).result()

    def random_state(self) -> dict:
        """Where every tensor's random streams stand."""
        return self.selector.random_state()

    def set_random_state(self, state: dict) -> None:
        """Restore what :meth:`random_state` returned."""
        self.selector.set_random_state(state)

    # -- one step ---------------------------------------------------------------------
    def reduce_async(self, names, tensors, transport, op="sum", as_rows=None, out=None,
                     reuse_out=False, finite=True):
        """Start reducing this rank's gradients over ``transport``; return a Future.

        The one entry point for every communicator and every framework. The
        caller's thread does error feedback, the sparsifier and the encoding;
        the collectives, the decoding and the sums run on the transport's
        communication thread, in the order the reductions were started (the
        same on every rank), so the caller can prepare the next gradients
        while these travel. Every rank calls it with the same names, shapes
        and dtypes, in the same order.

        Parameters
        ----------
        names : list of str or None
            One per tensor: the key of its residual and random streams (None:
            no error feedback).
        tensors : list of numpy.ndarray or SparseTensor
            This rank's gradients.
        transport : deepreduce.collectives.Transport
            Horovod's (:mod:`deepreduce.horovod`), torch.distributed's
            (:mod:`deepreduce.torch`) or a member of ``ThreadTransport.group(P)``.
        op : {"sum", "average"}
        as_rows : list of bool, optional
            As for :meth:`decode_bundles` (with a reducing communicator, the
            rows returned are the non-zero rows of the reduced tensor).
        out : list of numpy.ndarray or None, optional
            As for :meth:`decode_bundles`: arrays the dense results are
            written into.
        reuse_out : bool, default False
            With the allgather communicator, a promise that each ``out`` array
            still holds what the last reduction with the same name wrote into
            it (nothing else wrote there since): only the positions that
            reduction made non-zero are reset, not the whole array. A result
            of 1% non-zeros then costs a pass over 2% of it instead of over
            all of it. DDP's hook keeps such arrays.
        finite : bool, default True
            Whether every rank's tensors of this step are finite, as the ranks
            agreed before the call (:meth:`agree_finite`; DDP's hook allreduces a
            flag per bucket). False makes it a *non-finite step* on every rank:
            each tensor travels whole and exact in a payload of its own, without
            error feedback and whatever the communicator, so the results are the
            rank-order sums, inf or NaN where dense allreduce's are, and nothing
            a later step reads changes (no residual, random stream or ``auto``
            memory). A loop that skips such steps (a loss scaler's overflow
            steps) continues as if they never happened. Every rank passes the
            same value.

        Returns
        -------
        concurrent.futures.Future
            Its result is ``(outputs, traffic)``: the reduced tensors, equal on
            every rank, and the :class:`~deepreduce.collectives.Traffic` of
            this rank. A failure on any rank raises on every rank.

        Examples
        --------
        Two ranks played by threads:

        >>> import numpy as np, deepreduce as dr
        >>> from concurrent.futures import ThreadPoolExecutor
        >>> from deepreduce.collectives import ThreadTransport
        >>> from deepreduce.exchange import GradientExchange
        >>> ex = [GradientExchange(dr.TopK(1), value="raw", min_size=0) for _ in range(2)]
        >>> def rank_main(member):
        ...     g = np.array([1, -4, 2], np.float32) * (member.rank + 1)
        ...     return ex[member.rank].reduce_async(["w"], [g], member).result()
        >>> with ThreadPoolExecutor(2) as pool:
        ...     (outputs, traffic), _ = pool.map(rank_main, ThreadTransport.group(2))
        >>> outputs
        [array([ 0., -12.,   0.], dtype=float32)]

        With SparCML's sparse allreduce, the gradients below ``min_size`` exact:

        >>> ex = [GradientExchange(dr.TopK(2), index="varint", value="raw", min_size=4,
        ...                        communicator="sparse_allreduce") for _ in range(2)]
        >>> def rank_main(member):
        ...     grads = [np.array([0, 3, -1, 0, 2, 0], np.float32) * (member.rank + 1),
        ...              np.ones(2, np.float32)]
        ...     return ex[member.rank].reduce_async(["w", "b"], grads, member).result()[0]
        >>> with ThreadPoolExecutor(2) as pool:
        ...     w, b = list(pool.map(rank_main, ThreadTransport.group(2)))[0]
        >>> w, b
        (array([0., 9., 0., 0., 6., 0.], dtype=float32), array([2., 2.], dtype=float32))
        >>> ex[0].memory.residual("w")    # the entry TopK left behind, kept for the next step
        array([ 0.,  0., -1.,  0.,  0.,  0.], dtype=float32)
        """
        op = op_name(op)
        if len(names) != len(tensors):
            raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
        as_rows = [False] * len(tensors) if as_rows is None else list(as_rows)
        if len(as_rows) != len(tensors):
            raise ValueError(f"as_rows has {len(as_rows)} entries for {len(tensors)} tensors")
        if not finite:
            return self._allgather_step(names, tensors, transport, op, as_rows, out, reuse_out,
                                        exact=True)
        if self._hierarchical is not None:
            return self._hierarchical.reduce_async(list(names), list(tensors), transport, op,
                                                   as_rows, out, self._lock, self.stats,
                                                   reuse_out)
        if self._reducing is not None:
            return self._reducing_step(list(names), list(tensors), transport, op, as_rows, out)
        return self._allgather_step(names, tensors, transport, op, as_rows, out, reuse_out)

    def _allgather_step(self, names, tensors, transport, op, as_rows, out, reuse_out,
                        exact=False):
        try:
            with self._lock:
                bundle, sent, encoded = self._allgather.encode_exact(tensors) if exact else \
                    self._allgather.encode(names, tensors)
        except (ValueError, TypeError) as exc:
            # the other ranks wait in the allgather: they get an ERROR frame and raise
            return transport.submit(fail_collectively, "allgather", transport,
                                    BUNDLE_SIGNATURE, exc)
        encode_end = time.perf_counter()

        def finish():
            traffic = Traffic()
            gathered = signed_allgather(transport, BUNDLE_SIGNATURE, bundle, traffic, "bundles")
            exchanged = StepStats(exchange_seconds=time.perf_counter() - encode_end)
            # no lock: decoding shares nothing with encoding (the next reduction's,
            # running meanwhile), and the transport thread decodes one at a time
            outputs, decoded = self._allgather.decode(
                [gathered], transport.size, transport.rank, op == "average", as_rows, out,
                [sent], list(names) if reuse_out else None)
            # one record per exchange: exchanges may overlap, open/close pairs may not
            self.stats.record_step(encoded + decoded + exchanged)
            return outputs, traffic
        return transport.submit(finish)

    def _reducing_step(self, names, tensors, transport, op, as_rows, out):
        with self._lock:
            reduced = self._reducing.start(names, tensors, op, transport, as_rows)

        def finish():
            with self._lock:
                outputs, traffic, stats = reduced()
            self.stats.record_step(stats)
            for i, target in enumerate(out or []):
                if target is not None:
                    np.copyto(target, np.asarray(outputs[i]).reshape(target.shape))
                    outputs[i] = target
            return outputs, traffic
        # queued behind the reduction's own collectives on the same thread
        return transport.submit(finish)

    # -- the same step in two halves, for an allgather inside a TensorFlow graph --------
    def encode_bundle(self, names, tensors, group: int = 0, finite: bool = True) -> bytes:
        """Encode this rank's gradients (dense arrays or SparseTensors) into one bundle.

        A step whose gradients travel in several allgathers encodes one bundle per
        ``group`` (0, 1, ...: consecutive slices of its tensors) and decodes them
        together with :meth:`decode_groups`; the stats count them as one step.
        If a codec raises, nothing is sent and every dense gradient's residual
        still holds all it owes. ``finite``: as for :meth:`reduce_async` (False: a
        non-finite step, the tensors whole and exact, nothing remembered).
        """
        if len(names) != len(tensors):
            raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
        with self._lock:
            bundle, sent, encoded = self._allgather.encode_exact(tensors) if not finite else \
                self._allgather.encode(names, tensors)
            # what the other ranks will decode from this bundle, so that decoding it
            # again here can be skipped (decoding comes in a separate call)
            self._last_sent[group] = sent
        self.stats.record_encode(tensors=encoded.tensors,
                                 compressed_tensors=encoded.compressed_tensors,
                                 bytes_sent=encoded.bytes_sent, dense_bytes=encoded.dense_bytes,
                                 seconds=encoded.encode_seconds,
                                 codec_seconds=encoded.codec_seconds, group=group,
                                 nonfinite=not finite)
        return bundle

    def decode_bundles(self, gathered, ranks: int, rank: int, average: bool = False,
                       as_rows=None, out=None) -> list:
        """Decode the allgathered bundles of ``ranks`` ranks and reduce them.

        Parameters
        ----------
        gathered : bytes-like or list of bytes-like
            The concatenated bundles, in rank order, or one bundle per rank.
        ranks, rank : int
            Number of ranks and this rank's position (its own bundle is the
            reference every other rank's tensor shapes and dtypes must match).
        average : bool
            Divide the sums by ``ranks`` (Horovod's ``op=Average``).
        as_rows : list of bool, optional
            For each tensor, True to return ``(values, rows)``: the non-zero
            rows of the reduced tensor (``values[i]`` is row ``rows[i]``, as in
            ``tf.IndexedSlices``); False (default) to return a dense array.
        out : list of numpy.ndarray or None, optional
            For each dense result, an array of its size and dtype to write it
            into (its contents are overwritten), or None for a new one.

        Returns
        -------
        list
            One reduced tensor per gradient, with the dtype its payloads carry.
        """
        return self.decode_groups([gathered], ranks, rank, average, as_rows, out)

    def decode_groups(self, groups, ranks: int, rank: int, average: bool = False,
                      as_rows=None, out=None) -> list:
        """:meth:`decode_bundles` for a step that travelled in several allgathers.

        ``groups`` holds what each allgather gathered (in either form
        :meth:`decode_bundles` takes), in group order: the bundles of
        ``encode_bundle(..., group=g)``. Their tensors are decoded and reduced
        as if one bundle had carried them all, in that order.
        """
        with self._lock:
            sent = [self._last_sent.get(group) for group in range(len(groups))]
            results, decoded = self._allgather.decode(groups, ranks, rank, average, as_rows,
                                                      out, sent)
        self.stats.record_decode(bytes_received=decoded.bytes_received,
                                 seconds=decoded.decode_seconds,
                                 codec_seconds=decoded.codec_seconds)
        return results

    def encode_tensor(self, x, name: str | None = None) -> tuple[bytes, SparseTensor]:
        """Encode one dense array or SparseTensor; return ``(payload, received)``.

        For Horovod's compressor protocol, which moves one tensor at a time.
        Tensors below ``min_size`` elements go losslessly; with error feedback
        on and a ``name``, its residual is added first and updated after.
        """
        with self._lock:
            return self._allgather.encode_tensor(name, x)


__all__ = ["GradientExchange", "ExchangeConfig", "BUNDLE_SIGNATURE", "FINITE_SIGNATURE"]
