"""Training with infrequent synchronisation: DiLoCo and SparseLoCo outer steps over deepreduce.

::

    import torch, deepreduce.torch as drt
    outer = drt.OuterOptimizer(model.named_parameters(), mode="sparseloco", sync_every=30)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for x, y in batches:                 # no DDP: each rank trains its own copy
        loss_fn(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        outer.step()                     # every 30th call: the outer step

Each rank (each *worker*) runs ``sync_every`` (H) inner optimizer steps on its own
batches; then every worker forms its *pseudo-gradient*, the synced parameters less its
own (``theta_synced - theta_local``: a descent step along it moves toward the workers'
average), sends them all through one :class:`~deepreduce.exchange.GradientExchange`
step (error feedback, sparsifier and codecs per parameter, one bundle, allgather,
decode, average), and applies the outer update to the synced copy, which then
replaces the model's parameters on every worker. Two modes (Douillard et al. 2023,
arXiv 2311.08105; Sarfi et al. 2025, arXiv 2508.15706) differ only in their defaults: the
outer update's (:data:`OUTER_UPDATE`) and the exchange's (the presets
:meth:`ExchangeConfig.diloco <deepreduce.config.ExchangeConfig.diloco>` and
:meth:`ExchangeConfig.sparseloco <deepreduce.config.ExchangeConfig.sparseloco>`):

==================  ==================================  ==================================
                    ``mode="diloco"``                   ``mode="sparseloco"``
==================  ==================================  ==================================
outer update        SGD, Nesterov momentum 0.9, lr 0.7  SGD, no momentum, lr (alpha) 1.0
error feedback      only when the pipeline is lossy     decay beta = 0.95 (the momentum)
                    (decay 1.0)
sparsifier          None (every element)                ``chunktopk:k=64,chunk=4096``
index codec         ``auto``                            ``chunked``
value codec         ``raw`` (float32; or ``bf16``)      ``statq:bits=2,sigmas=6``
min_size            1024                                0 (every tensor chunk-wise)
==================  ==================================  ==================================

Dense DiLoCo is the same object as the compressed kinds (the baseline runs the same
code, the same outer update and checkpoints); in float32 its outer step is an allreduce
(see :attr:`OuterOptimizer.dense`).
"""

from __future__ import annotations

import time
import zlib

import torch
import torch.distributed as dist

from deepreduce.collectives.transport import Traffic
from deepreduce.config import ExchangeConfig, check_count, check_flag, check_number
from deepreduce.exchange.stats import StepStats
from deepreduce.registry import get_codec
from deepreduce.torch.device import from_host, host_array
from deepreduce.torch.integration import TorchIntegration

__all__ = ["OuterOptimizer", "OUTER_UPDATE"]

#: Each mode's outer update (``torch.optim.SGD``'s lr, momentum, nesterov), what the
#: arguments left out (or None) take; the exchange's settings come from the preset of
#: the same name (:meth:`ExchangeConfig.diloco`, :meth:`ExchangeConfig.sparseloco`).
OUTER_UPDATE = {
    "diloco": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
    "sparseloco": {"lr": 1.0, "momentum": 0.0, "nesterov": False},
}


class OuterOptimizer(TorchIntegration):
    """The outer step of DiLoCo-style training, every ``sync_every`` inner steps.

    Parameters
    ----------
    params : iterable of torch.nn.Parameter, or of (name, Parameter)
        ``model.parameters()`` or ``model.named_parameters()`` (the names then key the
        residuals and the checkpoint; otherwise their positions do). Every
        floating-point parameter is synced, whether or not it has a gradient (a frozen
        parameter's pseudo-gradient is zero, and costs a few bytes); parameters of other
        dtypes (integers, booleans) have no average and are left as each rank has
        them, listed in :attr:`skipped`. A DTensor parameter (a model sharded with
        FSDP2's ``fully_shard``) is synced as this rank's local shard (docs/fsdp.md).
    mode : {"sparseloco", "diloco"}, default "sparseloco"
        The defaults of the outer update (:data:`OUTER_UPDATE`) and of the exchange
        (the preset of the same name of :class:`~deepreduce.config.ExchangeConfig`;
        see the module's table).
    sync_every : int, default 30
        H, the inner steps between outer steps: :meth:`step` counts them.
    process_group : torch.distributed.ProcessGroup, optional
        The workers of the outer step; the default (world) group when None. Bound late,
        at the first outer step (as :class:`~deepreduce.torch.DeepReduceState` does),
        so the object can be made before ``init_process_group``. A worker can be
        several ranks: each rank then joins the group of the ranks with its local rank
        in the other workers (see Notes).
    lr : float, optional
        The outer learning rate (diloco 0.7; sparseloco's alpha, 1.0).
    momentum : float, optional
        The outer SGD's momentum (diloco 0.9; sparseloco 0: error feedback plays its part).
    nesterov : bool, optional
        Nesterov momentum (diloco True; sparseloco False). The outer update is
        ``torch.optim.SGD(synced, lr, momentum, nesterov=nesterov)`` stepped with the
        averaged pseudo-gradient as the gradient, bit for bit.
    config : ExchangeConfig, optional
        The exchange's settings at once (the communicator is the allgather); or, by
        name, its fields, which take the place of the mode's preset's:
        ``sparsifier`` (``None`` sends every element: dense DiLoCo with
        ``value="raw"`` or ``"bf16"``), ``index``, ``value``, ``error_feedback`` (the
        decay beta of error feedback per parameter, :class:`~deepreduce.ResidualMemory`:
        ``accumulate = pseudo-gradient + beta * residual``, and what was not delivered
        stays for the next outer step; False turns it off; sparseloco 0.95, diloco 1.0
        when the pipeline loses anything, else off), ``min_size``, ``seed``,
        ``codec_threads``.
    synced_on_host : bool, default False
        Keep the synced copy (and the outer momentum) in host memory instead of on the
        parameters' device: the accelerator then holds nothing beyond the model and the
        inner optimizer, and each outer step copies the parameters to the host and the
        result back (the pseudo-gradients cross to the host for the codecs either way).

    Attributes
    ----------
    inner_steps, outer_steps : int
        :meth:`step` calls, and outer steps taken (checkpointed).
    exchange : deepreduce.exchange.GradientExchange
        The exchange of the pseudo-gradients; ``exchange.memory`` holds the residuals.
    dense : bool
        No sparsifier and a lossless value codec (dense DiLoCo in float32): the outer
        step is then an allreduce of the pseudo-gradients on the outer group, one per
        dtype, which averages exactly what the exchange would, without coding every
        element on the host.
    stats : deepreduce.exchange.stats.CompressionStats
        Bytes and times of every outer step (``stats.last.bytes_sent``: the bundle this
        rank sent at the last one; ``stats.last.dense_bytes``: the pseudo-gradients'
        own bytes).
    last_traffic : deepreduce.collectives.Traffic or None
        What really crossed at the last outer step (padding of the allgather included).
    names : list of str
        The synced parameters' names, in the order they travel.
    skipped : list of str
        The parameters left out (not floating point).

    Notes
    -----
    **Memory** beyond the model and the inner optimizer: the synced copy (one copy of
    the synced parameters, on their device, or on the host with ``synced_on_host``),
    the outer momentum (one more with ``momentum`` > 0, where the synced copy is), the
    residuals of error feedback (one float copy in host memory, when on), and, during
    an outer step, the pseudo-gradients and their average in host memory.

    **Workers of several ranks** (DDP inside a node, the outer step between nodes):
    with W workers of L ranks each, the ranks of a worker train one model under DDP
    over their own group, and rank ``l`` of every worker joins the outer group of the
    ranks ``l, L + l, 2L + l, ...``. Every rank makes every group (``new_group`` is
    collective)::

        worker, local = divmod(rank, L)
        inner = [dist.new_group(range(w * L, w * L + L)) for w in range(W)][worker]
        outer = [dist.new_group(range(l, W * L, L)) for l in range(L)][local]
        model = DDP(net, process_group=inner)
        opt = OuterOptimizer(model.module.named_parameters(), process_group=outer)

    The ranks of a worker hold the same parameters, so the L outer groups exchange the
    same pseudo-gradients and reach the same result: the worker's ranks stay identical.
    (Each rank sends a whole bundle. A worker whose ranks shard the model with FSDP2
    sends 1/L of it from each: give this object the sharded model's parameters, each
    rank's local shards, and the replicate group; see docs/fsdp.md.)

    **Agreement.** At the first outer step every rank of the group compares its
    settings, its parameters' names, shapes and dtypes, and a checksum of the
    parameters it starts from (the synced copy): a difference raises ValueError on
    every rank, naming it, instead of training apart. Seed the model alike on every
    rank (or build this object after DDP has broadcast it).

    **Checkpoints.** :meth:`state_dict` holds the synced copy, the outer optimizer's
    state, the residuals, the random streams and the counters; save it with the
    model's and the inner optimizer's, at any inner step. :meth:`load_state_dict` into a
    new object (same settings) continues bit for bit as a run that never stopped.

    **The last steps.** Inner steps after the last outer step are each rank's own: when
    ``inner_steps % sync_every`` is not 0 at the end, call :meth:`sync` once more (every
    rank at once) for a common model. (A :meth:`sync` right after an outer step is not
    a no-op: the momentum and the residuals still move the parameters.)

    Examples
    --------
    One rank (a gloo group of this process); SGD inner steps, an outer step every 2:

    >>> import os, socket, torch, torch.distributed as dist, deepreduce.torch as drt
    >>> from deepreduce.torch.outer import OuterOptimizer
    >>> with socket.socket() as s:
    ...     _ = s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    >>> os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    >>> dist.init_process_group("gloo", rank=0, world_size=1)
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Linear(128, 64)
    >>> outer = OuterOptimizer(model.named_parameters(), mode="sparseloco", sync_every=2)
    >>> inner = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> synced = []
    >>> for _ in range(4):
    ...     model(torch.randn(8, 128)).square().mean().backward()
    ...     inner.step()
    ...     inner.zero_grad()
    ...     synced.append(outer.step())
    >>> synced, outer.outer_steps
    ([False, True, False, True], 2)
    >>> last = outer.stats.last          # the 8,192 weights as 2 tiles of 64 x 64, k = 64
    >>> last.dense_bytes, last.bytes_sent < last.dense_bytes / 50
    (33024, True)
    >>> bool(torch.equal(model.weight, outer.synced_parameters()["weight"]))
    True
    >>> dist.destroy_process_group()
    """

    def __init__(self, params, mode: str = "sparseloco", sync_every: int = 30,
                 process_group=None, *, config=None, lr=None, momentum=None, nesterov=None,
                 synced_on_host=False, **settings):
        if mode not in OUTER_UPDATE:
            raise ValueError(f"mode must be one of {', '.join(map(repr, OUTER_UPDATE))}, "
                             f"got {mode!r}")
        self.mode, self.sync_every = mode, check_count("sync_every", sync_every, least=1)
        defaults = OUTER_UPDATE[mode]
        self.lr = check_number("lr", defaults["lr"] if lr is None else lr)
        self.momentum = check_number("momentum", defaults["momentum"] if momentum is None
                                     else momentum)
        self.nesterov = check_flag("nesterov", defaults["nesterov"] if nesterov is None
                                   else nesterov)
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov=True needs momentum > 0")
        self.synced_on_host = check_flag("synced_on_host", synced_on_host)
        config = ExchangeConfig.from_settings(config, **settings) if config is not None \
            else getattr(ExchangeConfig, mode)(**settings)
        if config.communicator != "allgather":
            raise ValueError("the outer step sends its bundle by allgather; got "
                             f"communicator={config.communicator!r}")
        self.names, self.params, self.skipped = _floating_parameters(params)
        if not self.params:
            raise ValueError("no floating-point parameters to synchronise")
        # what every rank of the group must share (seeds may differ), and checkpoints carry
        layout = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in zip(self.names,
                                                                             self.params))
        super().__init__(config, {
            "mode": self.mode, "sync_every": self.sync_every, "lr": self.lr,
            "momentum": self.momentum, "nesterov": self.nesterov,
            "parameters": f"{len(self.names)} ({zlib.crc32(layout.encode()):08x})"},
            process_group=process_group)
        # nothing to select, code or remember: the outer step is an allreduce
        self.dense = config.sparsifier is None and \
            get_codec(config.value, family="value").lossless
        with torch.no_grad():
            self._synced = [p.detach().to("cpu" if self.synced_on_host else p.device,
                                          copy=True) for p in self.params]
        self._outer = torch.optim.SGD(self._synced, lr=self.lr, momentum=self.momentum,
                                      nesterov=self.nesterov)
        self.inner_steps = self.outer_steps = 0
        self.last_traffic = None

    # -- the training loop's calls ---------------------------------------------------------
    def step(self) -> bool:
        """Count an inner step; at every ``sync_every``-th, take the outer step
        (:meth:`sync`). Returns whether it did. Call it after the inner optimizer's step,
        on every rank of the group."""
        self.inner_steps += 1
        if self.inner_steps % self.sync_every:
            return False
        self.sync()
        return True

    def sync(self) -> None:
        """The outer step, now: every rank of the group calls it together.

        Each parameter's pseudo-gradient (synced less local) goes to the host, through
        one exchange step (error feedback, sparsifier, codecs, allgather, decode,
        average), and the average steps the outer SGD on the synced copy, which is then
        copied into the parameters."""
        transport = self.transport
        self._agree(transport)
        if self.dense:
            averaged = self._allreduce_average(transport)
        else:
            with torch.no_grad():
                pseudo = [host_array((s - p.detach().to(s.device)).cpu())
                          for p, s in zip(self.params, self._synced)]
            averaged, self.last_traffic = self.exchange.reduce_async(
                self.names, pseudo, transport, op="average").result()
        with torch.no_grad():
            for s, a in zip(self._synced, averaged):
                s.grad = (a if self.dense else from_host(a)).to(device=s.device, dtype=s.dtype)
            self._outer.step()
            for p, s in zip(self.params, self._synced):
                s.grad = None
                p.copy_(s)
        self.outer_steps += 1

    def _allreduce_average(self, transport) -> list:
        """The exact dense outer step: the pseudo-gradients, flattened into one buffer per
        dtype, allreduced on the outer group and averaged (what the lossless exchange
        would deliver, without coding every element); recorded in :attr:`stats`."""
        began = time.perf_counter()
        traffic, nbytes = Traffic(), 0
        averaged = [None] * len(self.params)
        with torch.no_grad():
            # where the parameters are, when the group takes tensors there (NCCL, gloo,
            # "cpu:gloo,cuda:nccl"), else where its frames travel
            pseudo = [(s - p.detach().to(s.device)) for p, s in zip(self.params, self._synced)]
            pseudo = [t if transport.serves(t.device) else t.to(transport.device)
                      for t in pseudo]
            for dtype in dict.fromkeys(t.dtype for t in pseudo):
                members = [i for i, t in enumerate(pseudo) if t.dtype == dtype]
                flat = torch.cat([pseudo[i].reshape(-1) for i in members])
                with transport.failing_as("allreduce of the pseudo-gradients"):
                    dist.all_reduce(flat, group=transport.group)
                flat.div_(transport.size)
                for i, part in zip(members, flat.split([pseudo[i].numel() for i in members])):
                    averaged[i] = part.view_as(pseudo[i])
                nbytes += flat.numel() * flat.element_size()
        traffic.add("allreduce", nbytes, nbytes)
        self.last_traffic = traffic
        self.stats.record_step(StepStats(steps=1, tensors=len(pseudo), bytes_sent=nbytes,
                                         bytes_received=nbytes, dense_bytes=nbytes,
                                         exchange_seconds=time.perf_counter() - began))
        return averaged

    # -- what it holds -------------------------------------------------------------------
    @property
    def dense_bytes(self) -> int:
        """Bytes of the synced parameters as they are (what a dense outer step sends)."""
        return sum(p.numel() * p.element_size() for p in self.params)

    def synced_parameters(self) -> dict:
        """The synced copy, ``{name: tensor}`` (the tensors themselves: read, do not keep
        across outer steps)."""
        return dict(zip(self.names, self._synced))

    def __repr__(self):
        shown = ", ".join(f"{k}={v!r}" for k, v in self.settings.items() if k != "parameters")
        return f"{type(self).__name__}({shown}, synced_on_host={self.synced_on_host})"

    def _data_device(self):
        return self.params[0].device  # (frames where the parameters are, for NCCL)

    # -- checkpoints: the frame's, with the counters, the synced copy and the momentum --
    def _own_state(self) -> dict:
        return {"inner_steps": self.inner_steps, "outer_steps": self.outer_steps,
                "synced": {n: s.detach().clone() for n, s in zip(self.names, self._synced)},
                "outer_optimizer": self._outer.state_dict()}

    def _load_own_state(self, state_dict: dict) -> None:
        # (the model's parameters are the model's checkpoint's business)
        with torch.no_grad():
            for name, s in zip(self.names, self._synced):
                s.copy_(state_dict["synced"][name])
        self._outer.load_state_dict(state_dict["outer_optimizer"])
        self.inner_steps = int(state_dict["inner_steps"])
        self.outer_steps = int(state_dict["outer_steps"])

    # -- agreement ------------------------------------------------------------------------
    def _agree(self, transport) -> None:
        """Compare the settings, the parameters and where they start on every rank, once."""
        if self._agreed:
            return
        checksum = 0
        for s in self._synced:
            checksum = zlib.crc32(host_array(s.detach().cpu().contiguous()).view("u1"),
                                  checksum)
        try:
            self.agree(transport, {"start": f"{checksum:08x}"}, what="outer settings")
        except ValueError as exc:
            raise ValueError(f"OuterOptimizer: {exc} ('start' is a checksum of the "
                             "parameters each rank starts from: seed the model alike on "
                             "every rank; 'parameters' counts their names, shapes and "
                             "dtypes)") from exc


def _floating_parameters(params):
    """``(names, parameters, skipped names)``: the floating-point parameters of ``params``
    (plain or named), each once."""
    entries = list(params)
    named = [(e if isinstance(e, tuple) else (str(i), e)) for i, e in enumerate(entries)]
    names, kept, skipped, seen = [], [], [], set()
    for name, p in named:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"parameter {name!r} is a {type(p).__name__}, not a tensor")
        if id(p) in seen:
            continue
        seen.add(id(p))
        if hasattr(p, "to_local"):  # a DTensor (FSDP2): this rank's shard, in place
            with torch.no_grad():
                p = p.to_local()
        if p.dtype.is_floating_point:
            names.append(name)
            kept.append(p)
        else:
            skipped.append(name)
    if len(set(names)) != len(names):
        raise ValueError("two parameters share a name")
    return names, kept, skipped
