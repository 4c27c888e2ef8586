"""deepreduce as a PyTorch DDP communication hook, a peer of PowerSGD.

::

    import torch, deepreduce as dr, deepreduce.torch as drt
    model = torch.nn.parallel.DistributedDataParallel(net)
    state = drt.DeepReduceState(process_group=None, sparsifier=dr.TopK(0.01),
                                index="auto", value="fp16", start_iter=10)
    model.register_comm_hook(state, drt.deepreduce_hook)

Each bucket DDP hands to the hook is cut back into its parameters' gradients,
and those go through :class:`deepreduce.exchange.GradientExchange`, the same
core the Horovod integration uses: error feedback and the sparsifier per
parameter, one bundle of payloads per bucket, every rank's bundle to every
rank (or SparCML's / OmniReduce's reducing communicators), sums in rank order.
Working per parameter makes the result independent of how DDP groups
parameters into buckets, which it changes after the first iteration, so
residuals, checkpoints and a resumed run do not depend on the bucket layout.
"""

import copy
import math
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist

from deepreduce.collectives.transport import GuardedTransport
from deepreduce.config import ExchangeConfig, check_count, check_number
from deepreduce.exchange.selection import Selector
from deepreduce.exchange.stats import StepStats
from deepreduce.registry import get_codec
from deepreduce.torch.device import DeviceSelector, from_host, host_array, tensor_finite
from deepreduce.torch.integration import TorchIntegration
from deepreduce.torch.streams import lane_of
from deepreduce.torch.transport import CollectiveError, TorchTransport

__all__ = ["DeepReduceState", "deepreduce_hook", "host_array", "from_host"]


def _device_path(asked, config) -> bool:
    """Whether the dense work runs on the gradients' device (see DeepReduceState)."""
    served = config.communicator == "allgather" and \
        get_codec(config.index, family="index").lossless
    if asked is None:
        return served and torch.cuda.is_available()
    if asked and not served:
        raise ValueError("device_path=True serves the allgather communicator with an exact "
                         f"index codec; got communicator={config.communicator!r}, "
                         f"index={config.index!r}")
    return bool(asked)


class DeepReduceState(TorchIntegration):
    """Configuration and state of :func:`deepreduce_hook`.

    Parameters
    ----------
    process_group : torch.distributed.ProcessGroup, optional
        The group to reduce in; the default group when None. gloo and NCCL
        are supported. The group is looked up at the first hook call, so the
        state can be built before ``init_process_group`` (as Lightning's
        ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` does).
    config : ExchangeConfig, optional
        The exchange's settings at once; or, by name, its fields, with the same
        defaults as every deepreduce integration: ``sparsifier`` (Top-1%), ``index``
        ("auto"), ``value`` ("fp16"), ``error_feedback`` (1.0, per parameter),
        ``min_size`` (1024), ``seed`` (0), ``communicator`` ("allgather"; or
        "sparse_allreduce", "block", "hierarchical"), ``communicator_options`` and
        ``codec_threads``.
    start_iter : int, default 10
        Iterations (backward passes) of plain allreduce before compression
        starts. Early gradients change fast and error feedback has nothing to
        work on yet; PowerSGD's ``start_powerSGD_iter`` plays the same role.
    min_compression_rate : float, default 2.0
        A bucket whose payload is estimated to be less than this many times
        smaller than its dense bytes goes as a plain allreduce: compression
        would cost CPU for little traffic saved. The estimate encodes a
        synthetic Gaussian tensor of each parameter's shape once, so it
        depends only on shapes and settings and all ranks agree on it.
    device_path : bool, optional
        Run error feedback, the sparsifier, the residual update and the sums
        on the bucket's device as torch operations, sending only the selected
        pairs (and the tensors below ``min_size``) through the host codecs
        (:class:`deepreduce.torch.device.DeviceSelector`). None (default):
        when CUDA is available, for the allgather communicator with an exact
        index codec. On CPU buckets the numpy/C path is faster
        (``benchmarks/results/device_step.md``), and both give the same bits.
    check_finite : bool, default True
        Before a bucket's gradients touch anything, check that every rank's are
        finite: one read pass over the bucket and an allreduce of one flag, on a
        group of the state's own. A bucket that holds an inf or NaN on any rank
        is a *non-finite step* on every rank: it goes as DDP's plain allreduce of
        the gradients as they are (so every rank gets DDP's result, inf or NaN
        where DDP's is, and a ``GradScaler`` or
        ``clip_grad_norm_(error_if_nonfinite=True)`` skips the step on every rank),
        and the residuals, random streams and ``auto`` memory stay exactly as
        they were: a loop that skips the step continues as if it never happened.
        A backward pass with such a bucket does not count in :attr:`iter`.
        False saves the pass and the flag, and an overflow step then poisons the
        residuals of its bucket for good.
    grad_scaler : torch.amp.GradScaler, optional
        The loss scaler of the training loop. The residuals hold gradients in
        the units of the scaled loss; when the scaler changes its scale (it
        halves it after an overflow step, doubles it after ``growth_interval``
        good ones), the first bucket of the next backward pass multiplies every
        residual by new scale / old scale (powers of two: exact), so error
        feedback stays in the units of the true gradient. Without one,
        :meth:`rescale` does the same for a scaler of your own; the first
        non-finite bucket with error feedback and no ``grad_scaler`` warns once.
        Not pickled (as the process group is not): set the attribute again after
        loading.

    Attributes
    ----------
    iter : int
        Backward passes seen (counted at each iteration's last bucket), less those
        with a non-finite bucket (see ``check_finite``).
    nonfinite_iters : int
        Backward passes with a non-finite bucket.
    exchange : deepreduce.exchange.GradientExchange
        The framework-neutral core doing the work.
    stats : deepreduce.exchange.stats.CompressionStats
        Bytes and times; one record per bucket reduction, plain allreduces
        included (their ``bytes_sent`` is the dense size).

    Notes
    -----
    Every rank must build the state with the same settings (the seed may
    differ); the first hook call compares them on all ranks and raises on
    every rank, naming what differs, instead of hanging. Pickling the state
    (``torch.save``) leaves the process group out, as PowerSGD's state does;
    :meth:`state_dict` and :meth:`load_state_dict` carry the iteration, the
    residuals and the random state, so a resumed run continues exactly as one
    that never stopped. That holds for every setting with the allgather
    communicator. ``"sparse_allreduce"`` and ``"block"`` code the selections
    of a bucket's parameters together, so a value codec whose output depends on
    its neighbours (QSGD's bucket norms) makes them depend on the bucket
    layout, which DDP builds afresh after a restart.
    """

    RUNTIME = TorchIntegration.RUNTIME + (
        "_keys", "_estimates", "guarded", "_results", "_layouts", "_in_iteration",
        "_nonfinite_iteration", "_warned_scale", "grad_scaler")

    def __init__(self, process_group=None, *, config=None, start_iter=10,
                 min_compression_rate=2.0, device_path=None, check_finite=True,
                 grad_scaler=None, **settings):
        config = ExchangeConfig.from_settings(config, **settings)
        self.start_iter = check_count("start_iter", start_iter)
        self.min_compression_rate = check_number("min_compression_rate", min_compression_rate)
        self.device_path = _device_path(device_path, config)
        super().__init__(config, {"start_iter": self.start_iter,
                                  "min_compression_rate": self.min_compression_rate},
                         process_group=process_group, check_finite=check_finite,
                         selector=DeviceSelector if self.device_path else Selector)
        self.grad_scaler = grad_scaler
        self.iter = self.nonfinite_iters = 0
        self._loss_scale = None  # the scale the residuals are in (see grad_scaler)
        self._init_runtime()

    def _init_runtime(self):
        super()._init_runtime()
        self._keys = {}          # id(parameter) -> stable key, given at its first bucket
        self._estimates = {}     # (shape, dtype) -> estimated payload bytes
        # the transport, stopped by a failure every rank shares
        self.guarded = GuardedTransport(lambda: self.transport)
        self._results = {}       # bucket index -> the tensor its reductions are written into
        self._layouts = {}       # bucket index -> its _BucketLayout (see bucket_layout)
        self._in_iteration = False   # a bucket of this backward pass was seen
        self._nonfinite_iteration = False  # one of them was non-finite
        self._warned_scale = False   # (see grad_scaler)
        self.__dict__.setdefault("grad_scaler", None)

    def _bound(self) -> None:
        # the sub-groups a communicator needs (the hierarchical one's), now, on the
        # transport's thread while this one waits: never from two threads at once
        prepare = getattr(self.exchange.strategy, "prepare", None)
        if prepare is not None:
            self.agree(self.guarded, wait=False)  # (first: differing settings are named)
            try:
                self.guarded.submit(prepare, self.guarded).result()
            except Exception:  # noqa: BLE001, S110 - every later task raises it again
                pass  # (through the hook's futures, named: see _fail)

    # -- checkpoints: the frame's, with the counters and the loss scale ------------------
    def _own_state(self) -> dict:
        return {"iter": self.iter, "nonfinite_iters": self.nonfinite_iters,
                "loss_scale": self._loss_scale}

    def _load_own_state(self, state_dict: dict) -> None:
        self.iter = int(state_dict["iter"])
        self.nonfinite_iters = int(state_dict.get("nonfinite_iters", 0))
        self._loss_scale = state_dict.get("loss_scale")

    @property
    def flag_group(self):
        """The group of the per-bucket "all finite?" flags: the ranks of the state's group
        in a second group of deepreduce's own (:attr:`TorchTransport.flag_group
        <deepreduce.torch.transport.TorchTransport.flag_group>`), created with the
        transport's when the state binds its group (see :attr:`transport`). The flags
        are allreduced from the autograd thread while the transport's thread may still
        run earlier buckets' collectives, and DDP's own bookkeeping allreduce runs on
        the state's group: on one group the ranks could see them in different orders.
        Held weakly, as the transport's; RuntimeError once destroyed."""
        return self.transport.flag_group

    # -- what the hook asks of the state -------------------------------------------------
    def reduce_async(self, names, tensors, op="average", *, check=None, as_rows=None,
                     out=None, reuse_out=False):
        """Start reducing this rank's ``tensors`` over the state's group, for
        :func:`deepreduce.torch.allreduce`. The first call compares every rank's settings;
        ``check`` (a tensor, with ``check_finite``): every rank learns first whether it
        is finite everywhere, and a non-finite one goes whole and exact (see
        :meth:`GradientExchange.reduce_async
        <deepreduce.exchange.GradientExchange.reduce_async>`'s ``finite``, which takes
        the other arguments too). Returns its concurrent future."""
        self.agree(self.guarded, wait=False)
        finite = True if check is None else self.finite_everywhere([check])
        return self.exchange.reduce_async(names, tensors, self.guarded, op, as_rows=as_rows,
                                          out=out, reuse_out=reuse_out, finite=finite)

    def finite_everywhere(self, tensors, bucket=None) -> bool:
        """Whether every rank's ``tensors`` (of bucket ``bucket``) are finite (see
        ``check_finite``): checked on their device, the answers allreduced on the
        state's flag group (from the host where it is a gloo one), from the autograd
        thread (the group of the hook's other collectives may be busy with earlier
        buckets); over a transport that is not torch.distributed's, in an allgather of
        a byte after the collectives started there."""
        if not self.check_finite:
            return True
        return self._agree_answer(torch.stack([tensor_finite(t) for t in tensors]).all(),
                                  bucket)

    def bucket_finite(self, layout, buffer, bucket) -> tuple:
        """``(finite, small)``: :meth:`finite_everywhere` of ``buffer``, and on the device
        path the host arrays of its gradients below ``min_size`` (which travel from the
        host), brought over in the same copy as this rank's answer: one wait for the
        device for both (None off the device path)."""
        if not self.device_path:
            return self.finite_everywhere([buffer], bucket=bucket), None
        finite = tensor_finite(buffer) if self.check_finite else None
        mine, small = _with_answer(self.exchange.selector.link, layout.small(buffer), finite)
        return (True if mine is None else self._agree_answer(mine, bucket)), small

    def _agree_answer(self, mine, bucket) -> bool:
        """Every rank's answer from this one's (a bool or a 0-d bool tensor)."""
        transport = self.transport
        if not isinstance(transport, TorchTransport):  # (another transport: on its own)
            return self.exchange.agree_finite([], self.guarded, mine=bool(mine))
        if transport.size == 1:
            return bool(mine)
        flag = (torch.tensor([int(mine)], dtype=torch.int32) if isinstance(mine, bool)
                else mine.to(dtype=torch.int32).reshape(1)).to(transport.flag_device)
        try:
            with transport.failing_as("allreduce of the all-finite flag"):
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.flag_group)
        except CollectiveError as exc:  # raised from the hook: named as its futures'
            raise _named(exc, self, bucket) from exc
        return bool(flag.item())

    def follow_loss_scale(self) -> None:
        """At the first bucket of a backward pass: follow ``grad_scaler``'s scale."""
        if self._in_iteration:
            return
        self._in_iteration = True
        scaler = self.grad_scaler
        if scaler is None or not scaler.is_enabled():
            return
        scale = float(scaler.get_scale())
        if self._loss_scale is not None and scale != self._loss_scale:
            self.rescale(scale / self._loss_scale)
        self._loss_scale = scale

    def count_bucket(self, last: bool, finite: bool) -> None:
        """Count a backward pass at its last bucket, in :attr:`iter` or in
        :attr:`nonfinite_iters`; warn at the first non-finite bucket when the residuals
        may be in a loss scale nobody follows (see ``grad_scaler``)."""
        if not finite and self.grad_scaler is None and self.exchange.selector.memory \
                is not None and not self._warned_scale:
            self._warned_scale = True
            warnings.warn(
                "deepreduce's DDP hook met a non-finite bucket, as a loss scaler's overflow "
                "step makes, and the state has no grad_scaler: when a scaler changes its "
                "scale, error feedback mixes gradients of two scales. Pass "
                "DeepReduceState(..., grad_scaler=scaler), or call state.rescale(new_scale "
                "/ old_scale) when the scale changes", RuntimeWarning, stacklevel=3)
        self._nonfinite_iteration |= not finite
        if not last:
            return
        if self._nonfinite_iteration:
            self.nonfinite_iters += 1
        else:
            self.iter += 1
        self._in_iteration = self._nonfinite_iteration = False

    def bucket_layout(self, bucket, buffer) -> "_BucketLayout":
        """What the hook derives from the layout of ``bucket`` once, not every step:
        kept while DDP hands over the same buffer (DDP's rebuild after the first
        iteration allocates new ones; the layout's views hold the old one's memory, so
        a new buffer never reuses its address)."""
        index = bucket.index()
        layout = self._layouts.get(index)
        if layout is None or not layout.serves(buffer):
            params = bucket.parameters()
            # keys come from the first layout DDP builds (the same in every run of the
            # same model), so checkpoints survive DDP's bucket rebuild
            keys = [self._keys.setdefault(id(p), f"{index}.{position}")
                    for position, p in enumerate(params)]
            layout = self._layouts[index] = _BucketLayout(index, buffer, params, keys,
                                                          self.device_path,
                                                          self.config.min_size)
        return layout

    def compresses(self, layout) -> bool:
        """Whether the bucket of ``layout`` goes compressed: from ``start_iter`` on, when
        its dense bytes are at least ``min_compression_rate`` times its estimated
        payload (worked out once per layout)."""
        if self.iter < self.start_iter:
            return False
        if layout.compressible is None:
            dtype = layout.numpy_dtype
            estimate = sum(self._estimate(shape, dtype) for shape in layout.shapes)
            layout.compressible = \
                sum(layout.sizes) * dtype.itemsize >= self.min_compression_rate * estimate
        return layout.compressible

    def allreduce(self, layout, buffer, nonfinite=False) -> "_BucketReduction":
        """Start DDP's allreduce of ``buffer``: a non-finite one as it is; else with what
        error feedback still owes added (on its host copy, for a device buffer the
        host path serves)."""
        host = buffer
        if not nonfinite:
            host = buffer if self.device_path or layout.on_host else buffer.detach().cpu()
            self.exchange.pay(layout.keys, layout.gradients(host), self.guarded)
        return _BucketReduction(self.guarded.submit(
            lambda: self._allreduce(buffer, host, nonfinite)), buffer)

    def targets(self, layout, buffer, small=None) -> "_Targets":
        """Where a compressed bucket's reduction reads and writes: torch views of the
        buffer on the device path (those below ``min_size`` on the host: ``small``, from
        :meth:`bucket_finite`); else, as the codecs work on host memory, numpy views of
        a CPU buffer, or of a host copy of another (decoded into the copy, which is
        copied back before DDP reads it)."""
        if self.device_path:
            # (encoding copies what it needs before it returns: the sums may overwrite)
            grads = layout.gradients(buffer)
            return _Targets(layout.with_small(grads, small), grads, False, buffer)
        if not layout.on_host:
            host = buffer.detach().cpu()
            grads = layout.gradients(host)
            return _Targets(grads, grads, False, buffer, lambda: buffer.copy_(host))
        grads = layout.gradients(buffer)
        reduced, reuse = self._result_tensor(layout, buffer)
        return _Targets(grads, grads if reduced is buffer else layout.views_of(reduced),
                        reuse, reduced)

    # -- helpers of the above -----------------------------------------------------------
    def _allreduce(self, buffer, host, nonfinite=False) -> None:
        """DDP's allreduce of ``buffer`` (of ``host`` first, when that is its host copy),
        averaged, on the transport's thread; recorded in :attr:`stats`."""
        if host is not buffer:  # the residuals owed were added on the host copy
            buffer.copy_(host)
        transport = self.transport  # (on deepreduce's own group: see transport_of)
        buffer.div_(transport.size)
        with transport.failing_as("allreduce of the whole bucket"):
            dist.all_reduce(buffer, group=transport.group)
        nbytes = buffer.numel() * buffer.element_size()
        self.stats.record_step(StepStats(steps=1, tensors=1, bytes_sent=nbytes,
                                         bytes_received=nbytes, dense_bytes=nbytes,
                                         nonfinite_steps=int(nonfinite)))

    def _result_tensor(self, layout, buffer):
        """``(tensor, reuse)``: the tensor the reduction of a bucket on the CPU is written
        into and handed to DDP: with DDP's default gradient layout
        (``gradient_as_bucket_view=False``) DDP copies the result into every ``.grad``
        whichever tensor it is, so it is one of our own, kept from step to step, and only
        the positions the last step made non-zero are reset (``reuse``); when the
        gradients are views of the bucket, it is the bucket, which then has to be zeroed
        whole."""
        grad = layout.params[0].grad
        if grad is not None and grad.untyped_storage().data_ptr() == layout.storage:
            return buffer, False
        kept = self._results.get(layout.index)
        if kept is None or kept.shape != buffer.shape or kept.dtype != buffer.dtype:
            # zeros: what the exchange remembers having written into a tensor this one
            # replaces (and whose memory it may reuse) is then still a safe thing to reset
            kept = self._results[layout.index] = torch.zeros_like(buffer)
        return kept, True

    def _estimate(self, shape, dtype) -> int:
        """Payload bytes of a synthetic Gaussian gradient of ``shape``: shapes decide."""
        key = (shape, dtype.str)
        if key not in self._estimates:
            size = math.prod(shape)
            selector = self.exchange.selector
            pipeline = selector.small_pipeline if size < self.config.min_size \
                else selector.pipeline
            synthetic = np.random.default_rng(0).standard_normal(size).astype(dtype)
            # a copy: estimating must not advance the random streams of the real ones
            self._estimates[key] = len(copy.deepcopy(pipeline).encode(synthetic.reshape(shape))[0])
        return self._estimates[key]


def deepreduce_hook(state: DeepReduceState,
                    bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: reduce ``bucket`` with deepreduce; average as DDP does.

    Register it with ``model.register_comm_hook(state, deepreduce_hook)``.
    Before ``state.start_iter``, and for buckets that would not shrink by
    ``state.min_compression_rate``, it is a plain allreduce. Otherwise each
    parameter's gradient in the bucket gets its residual (error feedback),
    the sparsifier and the codecs here, in the backward pass; the
    collectives, decoding and sums run on the transport's thread, and the
    returned future completes there, so communication overlaps the rest of
    the backward pass. The steps:

    1. The first call binds the state's group (for the bucket's device) and compares
       every rank's settings; the first bucket of a backward pass follows
       ``grad_scaler``'s scale.
    2. A bucket that is not finite on every rank (``check_finite``) goes as DDP's
       allreduce of the gradients as they are.
    3. Before ``start_iter``, and for a bucket below ``min_compression_rate``, the
       bucket goes as a plain allreduce, with what error feedback owes added.
    4. Otherwise each parameter's gradient goes through the exchange
       (:meth:`GradientExchange.reduce_async
       <deepreduce.exchange.GradientExchange.reduce_async>`).
    5. The last bucket of a backward pass counts it in ``state.iter`` (or in
       ``state.nonfinite_iters``).

    Returns the Future DDP waits for: the averaged bucket, or the failure
    ``loss.backward()`` raises, naming this rank and the bucket.

    Examples
    --------
    On one process (a gloo group of size 1); the weight (4,096 elements) goes
    through Top-10% and fp16, the bias (below ``min_size``) losslessly:

    >>> import os, socket, torch, torch.distributed as dist, deepreduce as dr, deepreduce.torch as drt
    >>> with socket.socket() as s:
    ...     _ = s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    >>> os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    >>> dist.init_process_group("gloo", rank=0, world_size=1)
    >>> model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    >>> state = drt.DeepReduceState(sparsifier=dr.TopK(0.1), value="fp16", start_iter=0)
    >>> model.register_comm_hook(state, drt.deepreduce_hook)
    >>> model(torch.randn(2, 64)).square().sum().backward()
    >>> total = state.stats.total
    >>> state.iter, total.tensors, total.compressed_tensors, total.ratio > 10
    (1, 2, 1, True)
    >>> int((model.module.weight.grad != 0).sum())      # the Top-10% that travelled
    410
    >>> dist.destroy_process_group()
    """
    buffer = bucket.buffer()
    # (GradBucket's methods let go of the GIL: called before the communication thread
    # has work, they do not wait for it)
    index, last = bucket.index(), bucket.is_last()
    if not buffer.dtype.is_floating_point:
        raise TypeError(f"deepreduce_hook reduces floating-point gradients; bucket "
                        f"{index} holds {buffer.dtype}")
    state.bind(buffer.device)                                                    # 1.
    state.agree(state.guarded, wait=False)
    state.follow_loss_scale()
    layout = state.bucket_layout(bucket, buffer)
    finite, small = state.bucket_finite(layout, buffer, index)
    if not finite:                                                               # 2.
        reduction = state.allreduce(layout, buffer, nonfinite=True)
    elif not state.compresses(layout):                                           # 3.
        reduction = state.allreduce(layout, buffer)
    else:                                                                        # 4.
        to = state.targets(layout, buffer, small)
        reduction = _BucketReduction(state.exchange.reduce_async(
            layout.keys, to.inputs, state.guarded, "average", out=to.out,
            reuse_out=to.reuse_out), to.result, to.copy_back)
    state.count_bucket(last, finite)                                             # 5.
    return reduction.future(state, index)


class _Targets(NamedTuple):
    """Where a compressed bucket's reduction reads (``inputs``) and writes (``out``,
    whose memory ``result`` is, copied into the bucket by ``copy_back`` when given)."""

    inputs: list
    out: list
    reuse_out: bool
    result: torch.Tensor
    copy_back: Optional[Callable[[], object]] = None


class _BucketLayout:
    """What the hook derives once from the layout of a bucket, for every step it keeps:
    the parameters' keys and shapes, where each lies in the buffer, views of it, and
    whether the bucket is worth compressing (see :meth:`DeepReduceState.bucket_layout`)."""

    def __init__(self, index, buffer, params, keys, device_path, min_size=0):
        self.buffer = buffer  # (held: its memory is not handed to another buffer)
        self.index = index
        self.storage = buffer.untyped_storage().data_ptr()
        self.params = params
        shapes = [tuple(p.shape) for p in params]
        sizes = [math.prod(s) for s in shapes]
        if sum(sizes) != buffer.numel():  # not a layout of whole parameters: one tensor
            keys, shapes, sizes = [f"bucket{index}"], [(buffer.numel(),)], [buffer.numel()]
        self.keys, self.shapes, self.sizes = keys, shapes, sizes
        self.ends = np.cumsum(sizes).tolist()
        self.numpy_dtype = _numpy_dtype(buffer.dtype)
        self.compressible = None  # worked out at the first step that may compress
        self.on_host = buffer.device.type == "cpu"
        self.device_path = device_path
        self.views = self.per_parameter(host_array(buffer.detach())) \
            if self.on_host and not device_path else None
        self.small_at = [i for i, n in enumerate(sizes) if n < min_size]
        self._kept = None  # (tensor, its views): the last result tensor other than buffer

    def serves(self, buffer) -> bool:
        """Whether ``buffer`` is the one this layout was made for (the same memory)."""
        return buffer is self.buffer or (
            buffer.untyped_storage().data_ptr() == self.storage
            and buffer.shape == self.buffer.shape and buffer.dtype == self.buffer.dtype
            and buffer.device == self.buffer.device)

    def gradients(self, tensor) -> list:
        """Each parameter's gradient in ``tensor``, the buffer or its host copy, as the
        exchange takes it: torch views on the device path, else numpy views (kept for
        the buffer on the CPU)."""
        if self.device_path:
            return self.per_parameter(tensor)
        return self.views if self.on_host else self.per_parameter(host_array(tensor))

    def small(self, buffer) -> list:
        """The gradients in ``buffer`` below ``min_size`` (torch views): the device path
        sends them from the host, losslessly."""
        views = self.per_parameter(buffer)
        return [views[i] for i in self.small_at]

    def with_small(self, grads, small) -> list:
        """``grads`` with the gradients below ``min_size`` replaced by ``small``, their
        host arrays (:meth:`small`'s, brought over)."""
        inputs = list(grads)
        for i, array in zip(self.small_at, small or ()):
            inputs[i] = array
        return inputs

    def per_parameter(self, flat) -> list:
        """Each parameter's slice of ``flat`` (the buffer's elements), shaped."""
        return [flat[end - n:end].reshape(shape)
                for end, n, shape in zip(self.ends, self.sizes, self.shapes)]

    def views_of(self, tensor) -> list:
        """:meth:`per_parameter` of a CPU tensor's memory, kept for the same tensor."""
        if self._kept is None or self._kept[0] is not tensor:
            self._kept = (tensor, self.per_parameter(host_array(tensor)))
        return self._kept[1]


class _BucketReduction(NamedTuple):
    """A bucket's reduction under way: ``tensor`` holds the result once the concurrent
    future ``done`` is and ``copy_back`` (when given) has run."""

    done: Future
    tensor: torch.Tensor
    # (Optional, not "| None": Python 3.9 would evaluate it, as this module cannot
    # postpone its annotations: DDP checks the hook's against dist.GradBucket)
    copy_back: Optional[Callable[[], object]] = None

    def future(self, state, index) -> torch.futures.Future[torch.Tensor]:
        """The hook's one ending: the torch Future DDP waits for, which gets ``tensor``,
        or the failure of ``state``'s bucket ``index`` (see :func:`_fail`).

        A result on a GPU goes in a ``Future(devices=[its device])``, completed with the
        transport's lane current (:mod:`deepreduce.torch.streams`) on whichever thread
        completes it: ``set_result`` records its event on the lane's stream, after the
        reduction's work there (``copy_back`` included), and DDP's ``wait()`` in
        ``finalize_backward`` makes the consumer's stream wait for that event only."""
        tensor = self.tensor
        result = torch.futures.Future(devices=[tensor.device]) \
            if tensor.is_cuda else torch.futures.Future()
        lane = lane_of(state.transport)

        def deliver(done):
            with lane.current():
                try:
                    done.result()
                    if self.copy_back is not None:
                        self.copy_back()
                    result.set_result(tensor)
                except Exception as exc:  # noqa: BLE001 - handed to DDP, which raises it
                    _fail(result, exc, state, index)
        self.done.add_done_callback(deliver)
        return result


def _fail(result, exc, state, index) -> None:
    """Complete the hook's future ``result`` with the failure ``exc`` of bucket ``index``,
    so that ``loss.backward()`` raises it as it is, its causes chained.

    A collective's failure (:class:`~deepreduce.torch.transport.CollectiveError`)
    becomes one that names this rank, the bucket and the collective: "deepreduce hook,
    rank 1, bucket 0, allgather of 'bundles (2 tensors from 0.0)' failed: <torch's
    message>", the same for every later bucket that does not run because of it (the bucket it failed in);
    another exception goes as it is, with a note naming the rank and the bucket.

    ``Future.set_exception`` would not do: it keeps the exception as the future's
    value, which DDP's reducer casts to a tensor in C++; the cast fails, raising
    "Unable to cast <str(value)> to Tensor", the exception itself lost. The cast
    takes ``str()`` of the value for that message: :class:`_Failed` raises the
    exception there, and it leaves the reducer, and ``backward()``, unchanged. Python's
    ``wait()`` and ``value()`` raise it too, as after ``set_exception``.
    """
    result._set_unwrap_func(_raise_failure)
    result.set_result(_Failed(_named(exc, state, index)))


def _named(exc, state, index):
    """``exc``, which bucket ``index`` of the hook raised, as :func:`_fail` hands it on."""
    rank = getattr(state.transport, "global_rank", state.transport.rank)
    if isinstance(exc, CollectiveError) and exc.bucket is None:
        named = getattr(exc, "in_hook", None)
        if named is None:  # the first bucket it failed in
            named = exc.in_hook = CollectiveError(exc.what, rank, exc.reason, bucket=index)
            named.__cause__ = exc
        return named
    if not isinstance(exc, CollectiveError):
        note = f"(in deepreduce's DDP hook, rank {rank}, bucket {index})"
        if note not in getattr(exc, "__notes__", ()):
            exc.add_note(note)
    return exc


class _Failed:
    """The value of a hook's future whose reduction failed (see :func:`_fail`)."""

    __slots__ = ("exc",)

    def __init__(self, exc):
        self.exc = exc

    def __str__(self):
        # what DDP calls on a value that is not a tensor: the exception leaves from here
        raise self.exc

    def __repr__(self):
        return f"<failed reduction: {self.exc!r}>"

    def __reduce__(self):  # (a CUDA future looks for tensors in its value by pickling it)
        return _Failed, (None,)


def _raise_failure(value):
    if isinstance(value, _Failed):
        raise value.exc
    return value


def _with_answer(link, tensors, finite):
    """``(answer, arrays)``: ``finite`` (a 0-d bool tensor, or None) as a bool (None
    stays None) and ``tensors`` (of one dtype) as host arrays, in one copy."""
    if not tensors and finite is None:
        return None, []
    values = torch.cat([t.reshape(-1) for t in tensors]) if tensors else \
        torch.zeros(0, device=finite.device)
    positions = values.new_zeros(0, dtype=torch.int64)
    (_, flat, answer), = link.pairs_to_host([(positions, values, finite)])
    arrays, start = [], 0
    for tensor in tensors:
        arrays.append(flat[start:start + tensor.numel()].reshape(tuple(tensor.shape)))
        start += tensor.numel()
    return (None if finite is None else answer), arrays


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return host_array(torch.empty(0, dtype=dtype)).dtype
