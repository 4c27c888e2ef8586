"""The exchange's facade: :class:`GradientExchange`, what the integrations hold.

It builds the parts once from the settings (:class:`~deepreduce.config.ExchangeConfig`):
the selector (:mod:`deepreduce.exchange.selection`), the strategy of the communicator
(:func:`strategy_for`) and the stats; every step goes to the
strategy, whatever the framework. See :mod:`deepreduce.exchange` for the parts.
"""

from __future__ import annotations

import dataclasses
import threading

from deepreduce.collectives.communicator import op_name
from deepreduce.collectives.signed import signed_allgather
from deepreduce.collectives.transport import Traffic
from deepreduce.config import ExchangeConfig
from deepreduce.errors import DecodeError
from deepreduce.exchange.gathering import BUNDLE_SIGNATURE, GatheringExchange
from deepreduce.exchange.hierarchical import HierarchicalExchange
from deepreduce.exchange.reducing import ReducingExchange
from deepreduce.exchange.selection import Selector
from deepreduce.exchange.stats import CompressionStats
from deepreduce.exchange.strategy import Step, Strategy
from deepreduce.sparse import SparseTensor

#: What the one-byte answers of :meth:`GradientExchange.agree_finite` travel behind.
FINITE_SIGNATURE = "exchange=finite"


def strategy_for(config: ExchangeConfig, selector: Selector) -> Strategy:
    """The strategy of ``config.communicator``, built once for an exchange; the
    hierarchical one gets the strategy of its ``inter`` communicator from here too."""
    if config.communicator == "allgather":
        return GatheringExchange(selector, config.codec_threads)
    if config.communicator == "hierarchical":
        options = config.communicator_options
        between_nodes = strategy_for(dataclasses.replace(
            config, communicator=options["inter"],
            communicator_options=options["inter_options"]), selector)
        return HierarchicalExchange(config, selector, between_nodes)
    return ReducingExchange(config, selector)


class GradientExchange:
    """One step's gradients across ranks: error feedback, sparsifier, codecs, transport, sums.

    Parameters
    ----------
    config : ExchangeConfig, optional
        The settings at once; or, by name, the fields of
        :class:`~deepreduce.config.ExchangeConfig`: ``sparsifier`` (default Top-1%),
        ``index`` ("auto"), ``value`` ("fp16"), ``error_feedback`` (1.0), ``min_size``
        (1024), ``seed`` (0), ``communicator`` ("allgather"),
        ``communicator_options`` and ``codec_threads`` (None: automatic).
    selector : callable, default :class:`~deepreduce.exchange.selection.Selector`
        Makes the per-tensor step from the config: the numpy one, or one that
        works where the tensors live (:class:`deepreduce.torch.device.DeviceSelector`).

    Attributes
    ----------
    config : ExchangeConfig
    selector : Selector
        Error feedback and selection per tensor: it holds ``pipeline`` (the configured
        one), ``small_pipeline`` (the lossless one of tensors below ``min_size``),
        ``memory`` (the residuals, None without error feedback) and the random
        streams, and checkpoints them (``state_dict()``, ``load_state_dict()``).
    strategy : deepreduce.exchange.strategy.Strategy
        How a step travels, chosen from ``config.communicator``.
    stats : deepreduce.exchange.stats.CompressionStats
        Bytes and times of every step.

    Examples
    --------
    >>> import numpy as np, deepreduce as dr
    >>> from deepreduce.exchange import GradientExchange
    >>> rng = np.random.default_rng(0)
    >>> grads = [rng.standard_normal((100, 50)).astype(np.float32),
    ...          rng.standard_normal(10).astype(np.float32)]
    >>> c = GradientExchange(sparsifier=dr.TopK(0.01), index="varint", value="fp16")
    >>> bundle = c.encode_bundle(["w", "b"], grads)     # what this rank sends
    >>> w, b = c.decode_bundles(bundle + bundle, ranks=2, rank=0)   # what two ranks get
    >>> int(np.count_nonzero(w)), bool(np.array_equal(b, 2 * grads[1]))
    (50, True)
    >>> c.stats.last.ratio > 40
    True
    """

    def __init__(self, *, config: ExchangeConfig | None = None, selector=Selector, **settings):
        self.config = config = ExchangeConfig.from_settings(config, **settings)
        self.selector = selector(config)
        self.strategy = strategy_for(config, self.selector)
        # a non-finite step, and Horovod's graph path, go through the allgather's encoder
        self._allgather = self.strategy if isinstance(self.strategy, GatheringExchange) else \
            GatheringExchange(self.selector, config.codec_threads)
        self.stats = CompressionStats()
        self._init_runtime()

    def _init_runtime(self):
        self._lock = threading.Lock()
        # per bundle group: what the ranks will decode of its last bundle
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
        config = self.config
        options = "".join(f", {k}={v!r}" for k, v in config.communicator_options.items())
        return (f"{type(self).__name__}({self.selector.pipeline!r}, "
                f"error_feedback={config.error_feedback}, min_size={config.min_size}, "
                f"seed={config.seed}, communicator={config.communicator!r}{options})")

    def pay(self, names, tensors, transport=None) -> None:
        """Add what error feedback owes into ``tensors`` (in place) and forget it, for a
        step that sends them whole (a dense allreduce before compression starts).

        With the hierarchical communicator each residual covers this rank's shard,
        which ``transport`` (the reduction's) locates.
        """
        memory = self.selector.memory
        if memory is not None:
            self.strategy.pay(memory, names, tensors, transport)

    def rescale(self, factor: float) -> None:
        """Multiply every residual by ``factor``: keep error feedback in the units of the
        gradients when they change, as a loss scaler's gradients do when it changes its
        scale (``factor`` = new scale / old scale; by a power of two, exact)."""
        memory = self.selector.memory
        if memory is not None:
            memory.rescale(factor)

    def agree_finite(self, tensors, transport, mine: bool | None = None) -> bool:
        """Whether every rank's ``tensors`` are finite, as :meth:`reduce_async`'s
        ``finite`` takes it: this rank's are checked here (one read pass each; ``mine``:
        the answer, checked already), and every rank's answer travels in one allgather
        of a byte on ``transport``, after the reductions already started there; the
        caller waits for it. Every rank calls it for the same step. (DDP's hook asks
        its ranks on a group of its own instead, without waiting for its other
        reductions.)"""
        if mine is None:
            mine = self.selector.all_finite(tensors)

        def gather():
            # (ASCII: a frame starting with byte 0 is an ERROR frame)
            answers = signed_allgather(transport, FINITE_SIGNATURE, b"1" if mine else b"0",
                                       Traffic(), "finite")
            if any(bytes(answer) not in (b"0", b"1") for answer in answers):
                raise DecodeError("a rank's answer to 'finite?' is not b'0' or b'1'")
            return all(bytes(answer) == b"1" for answer in answers)
        return transport.submit(gather).result()

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
        >>> ex = [GradientExchange(sparsifier=dr.TopK(1), value="raw", min_size=0)
        ...       for _ in range(2)]
        >>> def rank_main(member):
        ...     g = np.array([1, -4, 2], np.float32) * (member.rank + 1)
        ...     return ex[member.rank].reduce_async(["w"], [g], member).result()
        >>> with ThreadPoolExecutor(2) as pool:
        ...     (outputs, traffic), _ = pool.map(rank_main, ThreadTransport.group(2))
        >>> outputs
        [array([ 0., -12.,   0.], dtype=float32)]

        With SparCML's sparse allreduce, the gradients below ``min_size`` exact:

        >>> ex = [GradientExchange(sparsifier=dr.TopK(2), index="varint", value="raw", min_size=4,
        ...                        communicator="sparse_allreduce") for _ in range(2)]
        >>> def rank_main(member):
        ...     grads = [np.array([0, 3, -1, 0, 2, 0], np.float32) * (member.rank + 1),
        ...              np.ones(2, np.float32)]
        ...     return ex[member.rank].reduce_async(["w", "b"], grads, member).result()[0]
        >>> with ThreadPoolExecutor(2) as pool:
        ...     w, b = list(pool.map(rank_main, ThreadTransport.group(2)))[0]
        >>> w, b
        (array([0., 9., 0., 0., 6., 0.], dtype=float32), array([2., 2.], dtype=float32))
        >>> ex[0].selector.memory.residual("w")    # the entry TopK left behind, kept for the next step
        array([ 0.,  0., -1.,  0.,  0.,  0.], dtype=float32)
        """
        op = op_name(op)
        if len(names) != len(tensors):
            raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
        as_rows = [False] * len(tensors) if as_rows is None else list(as_rows)
        if len(as_rows) != len(tensors):
            raise ValueError(f"as_rows has {len(as_rows)} entries for {len(tensors)} tensors")
        step = Step(names, tensors, transport, op, as_rows, out, reuse_out, self._lock,
                    self.stats, exact=not finite)
        # a non-finite step travels whole and exact, whatever the communicator
        return (self.strategy if finite else self._allgather).start(step)

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
            coded = self._allgather.encode_exact(tensors) if not finite else \
                self._allgather.encode(names, tensors)
            # what the other ranks will decode from this bundle, so that decoding it
            # again here can be skipped (decoding comes in a separate call)
            self._last_sent[group] = coded.sent
        encoded = coded.stats
        self.stats.record_encode(tensors=encoded.tensors,
                                 compressed_tensors=encoded.compressed_tensors,
                                 bytes_sent=encoded.bytes_sent, dense_bytes=encoded.dense_bytes,
                                 seconds=encoded.encode_seconds,
                                 codec_seconds=encoded.codec_seconds, group=group,
                                 nonfinite=not finite)
        return coded.bundle

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
            decoded = self._allgather.decode(groups, ranks, rank, average, as_rows, out, sent)
        stats = decoded.stats
        self.stats.record_decode(bytes_received=stats.bytes_received,
                                 seconds=stats.decode_seconds, codec_seconds=stats.codec_seconds)
        return decoded.tensors

    def encode_tensor(self, x, name: str | None = None) -> tuple[bytes, SparseTensor]:
        """Encode one dense array or SparseTensor; return ``(payload, received)``.

        For Horovod's compressor protocol, which moves one tensor at a time.
        Tensors below ``min_size`` elements go losslessly; with error feedback
        on and a ``name``, its residual is added first and updated after.
        """
        with self._lock:
            return self._allgather.encode_tensor(name, x)


__all__ = ["GradientExchange", "ExchangeConfig", "BUNDLE_SIGNATURE", "FINITE_SIGNATURE"]
