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

import concurrent.futures
import time
import warnings
import zlib

import numpy as np

import torch
import torch.distributed as dist

from deepreduce.collectives.transport import Traffic
from deepreduce.config import ExchangeConfig, check_count, check_flag, check_number
from deepreduce.exchange.stats import StepStats
from deepreduce.registry import get_codec
from deepreduce.torch.device import from_host, host_array, tensor_finite
from deepreduce.torch.integration import TorchIntegration
from deepreduce.torch.streaming import MERGES, FragmentSchedule, InFlight, merge

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
    overlap : int, default 0
        tau, the inner steps an outer step's exchange overlaps (Streaming DiLoCo,
        Douillard et al. 2025, arXiv 2501.18512): the pseudo-gradients are taken at the
        outer step, their coding and exchange run in the background (on the outer
        group's own process groups, which the inner loop's collectives never meet) while
        the next ``overlap`` inner steps run, and the :meth:`step` after them applies
        the average to the synced copy and merges it into the parameters by ``merge``.
        0: the outer step blocks the loop, as plain DiLoCo's. At most the inner steps
        between two outer steps (one exchange is in flight at a time).
    fragments : int, default 1
        p: the parameters are cut into p runs of consecutive parameters (model order)
        of about equal bytes, and fragment ``i`` is synced every ``sync_every`` inner
        steps at its own offset, ``((i + 1) * sync_every // p) % sync_every`` (see
        :class:`~deepreduce.torch.streaming.FragmentSchedule`): each exchange carries
        about 1/p of the model, so the peak bytes per exchange drop p-fold.
    merge : {"mix", "carry"}, default "mix"
        How an overlapped outer step folds the new synced copy into parameters that
        trained on meanwhile (:func:`~deepreduce.torch.streaming.merge`): ``"mix"`` is
        Streaming DiLoCo's ``param = mixing * param + (1 - mixing) * synced``;
        ``"carry"`` keeps what this worker's inner steps added since the exchange
        started (``param = synced + param - param_then``). ``"mix"`` by measurement:
        on the 3.3M-parameter transformer (600 inner steps, H = 30) the synced copy
        ended 0.5% below (tau 1) and 0.2% above (tau 5) blocking SparseLoCo's
        validation loss, under ``"carry"`` 0.1% and 1.3% above
        (benchmarks/results/outer_streaming.md).
    mixing : float, default 0.5
        Streaming DiLoCo's alpha for ``merge="mix"``.

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
        Bytes and times of every outer step: ``stats.last.bytes_sent``, what this rank
        handed to the outer group at the last one (its bundle in the transport's frame,
        and the all-finite flag), ``stats.last.bundle_bytes`` the bundle's own bytes,
        ``stats.last.dense_bytes`` the pseudo-gradients' own bytes.
    last_traffic : deepreduce.collectives.Traffic or None
        The collectives of the last outer step, stage by stage (``sent`` is
        ``stats.last.bytes_sent``).
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

    **Overlap and fragments.** With ``overlap`` > 0, :meth:`step` returns right after
    starting an outer step; the exchange runs on a background thread (the one thread of
    this object) and the outer group's communication thread. Every rank merges at the
    same inner step, waiting there if the exchange is not done, so every rank ends each
    merge with the same synced copy (their parameters differ by their own inner steps,
    as between any two outer steps). A failed exchange (a peer gone, a codec that
    refused) raises from the next :meth:`step` (or :meth:`sync`, :meth:`drain`,
    :meth:`state_dict`) on every rank, and from every call after. :meth:`sync` first
    merges what is in flight (:meth:`drain`), then takes a blocking outer step of every
    parameter. :meth:`state_dict` during an exchange in flight waits for it (it does not
    merge it): the checkpoint holds its averaged update and what the merge needs, and a
    run loaded from it merges at the same inner step as one that never stopped, bit for
    bit. The loop's own time at an overlapped outer step is one pass over the fragment
    to take its pseudo-gradients (and the finite check) and, at the merge, one to fold
    the synced copy in: with the synced copy in host memory, the outer SGD step runs on
    the background thread too. Memory: the pseudo-gradients of overlapped steps live in
    buffers kept across outer steps (one copy of the synced parameters), and
    ``merge="carry"`` keeps a copy of the fragment's parameters as they were when its
    exchange started, while it is in flight (``"mix"`` nothing more).

    **Non-finite pseudo-gradients.** Before the exchange, every rank checks its
    pseudo-gradients for inf and NaN (one read pass each) and the ranks allgather the
    answer (8 bytes a rank on the outer group), so all of them learn together whether
    some rank's is not finite. Such an outer step is *skipped* on every rank: nothing is
    sent, the synced copy, the outer momentum, the residuals and the random streams stay
    as they were (a residual never takes in an inf or a NaN), and every rank's
    parameters go back to the synced copy, the last model the ranks shared, so training
    goes on from there. A RuntimeWarning names the ranks and the first such parameter of
    each; ``stats.total.nonfinite_steps`` counts the skipped steps. (The inner
    optimizer's state is the loop's: reset it too if a diverged inner step poisoned it.)

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
                 synced_on_host=False, overlap: int = 0, fragments: int = 1,
                 merge: str = "mix", mixing: float = 0.5, **settings):
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
        self._init_streaming(overlap, fragments, merge, mixing)
        super().__init__(config, {
            "mode": self.mode, "sync_every": self.sync_every, "lr": self.lr,
            "momentum": self.momentum, "nesterov": self.nesterov,
            "parameters": f"{len(self.names)} ({zlib.crc32(layout.encode()):08x})",
            **self._streaming_settings()}, process_group=process_group)
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

    def _init_streaming(self, overlap, fragments, merge_rule, mixing) -> None:
        """Check and keep the settings of Streaming DiLoCo (see the class docstring)."""
        overlap = check_count("overlap", overlap, least=0)
        fragments = check_count("fragments", fragments, least=1)
        if merge_rule not in MERGES:
            raise ValueError(f"merge must be one of {', '.join(map(repr, MERGES))}, "
                             f"got {merge_rule!r}")
        mixing = check_number("mixing", mixing, least=0.0, most=1.0)
        self.schedule = FragmentSchedule([p.numel() * p.element_size() for p in self.params],
                                         fragments, self.sync_every)
        if overlap > self.schedule.gap:
            raise ValueError(f"overlap must be at most {self.schedule.gap}, the inner steps "
                             f"between two outer steps (sync_every {self.sync_every}, "
                             f"fragments {fragments}), got {overlap}: one exchange is in "
                             "flight at a time")
        self.overlap, self.fragments = int(overlap), int(fragments)
        self.merge, self.mixing = merge_rule, float(mixing)
        self._in_flight = self._failure = self._background = None
        self._buffers = None  # (the pseudo-gradients of overlapped steps, kept across them)

    def _streaming_settings(self) -> dict:
        settings = {"overlap": self.overlap, "fragments": self.fragments}
        if self.overlap:
            settings["merge"] = self.merge if self.merge == "carry" else \
                f"mix {self.mixing:g}"
        return settings

    # -- the training loop's calls ---------------------------------------------------------
    def step(self) -> bool:
        """Count an inner step; take the outer steps it is due for. Returns whether an
        outer step (of a fragment) started. Call it after the inner optimizer's step, on
        every rank of the group.

        The exchange in flight, if its ``overlap`` inner steps are over, is merged first
        (waiting for it if it is not done); then, at every ``sync_every``-th step (at its
        own offset for each of the ``fragments``), an outer step starts: with ``overlap``
        0 it is taken now, otherwise its exchange runs in the background. A failed
        exchange raises here, at the first call after it failed (on every rank, as every
        rank's collectives fail)."""
        self._raise_failure()
        self.inner_steps += 1
        if self._in_flight is not None and self.inner_steps >= self._in_flight.merge_at:
            self._merge(self._in_flight)
        fragment = self.schedule.due(self.inner_steps)
        if fragment is None:
            return False
        self._start(fragment, self.overlap)
        return True

    def sync(self) -> None:
        """The outer step of every parameter, now: every rank of the group calls it
        together. An exchange in flight is merged first (waiting for it).

        Each parameter's pseudo-gradient (synced less local) is checked for inf and NaN
        on every rank at once (see Notes: a non-finite one skips the step), then goes to
        the host, through one exchange step (error feedback, sparsifier, codecs,
        allgather, decode, average), and the average steps the outer SGD on the synced
        copy, which is then copied into the parameters."""
        self.drain()
        self._start(None, 0)

    def drain(self) -> None:
        """Merge the exchange in flight now (waiting for it), if there is one: what
        :meth:`sync` does first. Every rank of the group calls it together."""
        self._raise_failure()
        if self._in_flight is not None:
            self._merge(self._in_flight)

    @property
    def in_flight(self) -> bool:
        """Whether an outer step's exchange is running in the background."""
        return self._in_flight is not None

    # -- one outer step: start (pseudo-gradients, finite check), exchange, merge ---------
    def _start(self, fragment, overlap: int) -> None:
        """Start the outer step of ``fragment`` (None: every parameter): its exchange runs
        here when ``overlap`` is 0, else on the background thread, merged ``overlap``
        inner steps later."""
        transport = self.transport
        self._agree(transport)
        members = list(range(len(self.params))) if fragment is None else \
            self.schedule.members[fragment]
        with torch.no_grad():
            pseudo = self._pseudo_gradients(members, kept=bool(overlap))
            anchor = [self.params[i].detach().clone() for i in members] \
                if overlap and self.merge == "carry" else []
        mine = self._first_nonfinite(pseudo)
        # what the exchange reads, taken now: the inner steps go on meanwhile
        sent = [t.to(transport.device) for t in pseudo] if self.dense else \
            [host_array(t.cpu()) for t in pseudo]
        flight = InFlight(fragment, members, self.inner_steps, self.inner_steps + overlap,
                          anchor=anchor)
        if not overlap:
            flight.future = concurrent.futures.Future()
            flight.future.set_result(self._exchange(transport, fragment, sent, mine))
            self._merge(flight)
            return
        if self._background is None:
            self._background = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="deepreduce-outer")
        # where the synced copy is in host memory, the background thread steps it too,
        # off the loop's time; on an accelerator the step is a few kernel launches on
        # the loop's stream, and stays there (another thread's would need ordering)
        host = all(self._synced[i].device.type == "cpu" for i in members)
        flight.future = self._background.submit(self._exchange, transport, fragment, sent,
                                                mine, flight if host else None)
        self._in_flight = flight

    def _pseudo_gradients(self, members, kept: bool) -> list:
        """The synced copy less the parameters, of ``members``: new tensors, or (``kept``,
        for an overlapped step) written into buffers this object keeps across outer
        steps, one copy of the synced parameters (fresh memory for them would cost the
        loop page faults at every outer step, more than the subtraction)."""
        local = [self.params[i].detach().to(self._synced[i].device) for i in members]
        if not kept:
            return [self._synced[i] - p for i, p in zip(members, local)]
        if self._buffers is None:
            self._buffers = [None] * len(self.params)
        for i in members:
            if self._buffers[i] is None:
                self._buffers[i] = torch.empty_like(self._synced[i])
        return [torch.sub(self._synced[i], p, out=self._buffers[i])
                for i, p in zip(members, local)]

    def _exchange(self, transport, fragment, sent, mine, stepping=None) -> tuple:
        """``(averaged, nonfinite)``: every rank's first non-finite parameter of
        ``fragment`` (None: of them all; ``{rank: name}``, empty when all are finite),
        and, when all are, the ranks' average of ``sent`` as tensors (None otherwise).
        Runs where the outer step waits for it, or on the background thread;
        :attr:`last_traffic` and :attr:`stats` record it. ``stepping``: the flight
        whose outer step to take here too (marked ``stepped``)."""
        members = list(range(len(self.params))) if fragment is None else \
            self.schedule.members[fragment]
        flags = Traffic()
        gathered = transport.submit(transport.allgather, mine.tobytes(), flags,
                                    "finite").result()
        firsts = [int(np.frombuffer(bytes(f), dtype="<i8")[0]) for f in gathered]
        nonfinite = {rank: self.names[members[first]]
                     for rank, first in enumerate(firsts) if first >= 0}
        if nonfinite:
            self.last_traffic = flags
            self.stats.record_step(StepStats(
                steps=1, tensors=len(members), bytes_sent=flags.sent,
                framing_bytes=flags.sent, bytes_received=flags.received, nonfinite_steps=1,
                dense_bytes=sum(self.params[i].numel() * self.params[i].element_size()
                                for i in members)))
            return None, nonfinite
        if self.dense:
            averaged = transport.submit(self._allreduce_average, transport, sent).result()
        else:
            arrays, traffic = self.exchange.reduce_async(
                [self.names[i] for i in members], sent, transport, op="average").result()
            averaged = [from_host(a) for a in arrays]
            self.last_traffic = traffic
        self.last_traffic += flags
        self.stats.amend_last(StepStats(bytes_sent=flags.sent, framing_bytes=flags.sent,
                                        bytes_received=flags.received))
        if stepping is not None:
            self._outer_step(members, averaged)
            stepping.stepped = True
        return averaged, {}

    def _outer_step(self, members, averaged) -> None:
        """Step the outer SGD on the synced copy of ``members``, ``averaged`` their
        gradient."""
        synced = [self._synced[i] for i in members]
        with torch.no_grad():
            for s, a in zip(synced, averaged):
                s.grad = a.to(device=s.device, dtype=s.dtype)
            self._outer.step()
            for s in synced:
                s.grad = None

    def _merge(self, flight) -> None:
        """Apply the exchange of ``flight``: step the outer SGD on the synced copy of its
        parameters with the average as their gradient, and fold the result into the
        parameters (the synced copy itself when the step did not overlap, else by the
        ``merge`` rule); a skipped step puts the parameters back at the synced copy.
        Raises what the exchange raised (and every later call does too)."""
        self._in_flight = None
        try:
            averaged, nonfinite = flight.future.result()
        except BaseException as exc:
            self._failure = exc
            raise
        members = flight.members
        params = [self.params[i] for i in members]
        synced = [self._synced[i] for i in members]
        with torch.no_grad():
            if nonfinite:
                for p, s in zip(params, synced):
                    p.copy_(s)
                self._warn_nonfinite(nonfinite)
            else:
                if not flight.stepped:
                    self._outer_step(members, averaged)
                if flight.merge_at == flight.started_at:
                    for p, s in zip(params, synced):
                        p.copy_(s)
                else:
                    merge(self.merge, self.mixing, params, synced, flight.anchor)
        self.outer_steps += 1

    def _raise_failure(self) -> None:
        """Raise the failure of an exchange, as soon as one is known (every later call
        too: the ranks' collectives are out of step for good)."""
        flight = self._in_flight
        if self._failure is None and flight is not None and flight.future.done() \
                and flight.future.exception() is not None:
            self._in_flight = None
            self._failure = flight.future.exception()
        if self._failure is not None:
            raise self._failure

    # -- non-finite pseudo-gradients ---------------------------------------------------
    @staticmethod
    def _first_nonfinite(pseudo) -> np.ndarray:
        """The position of the first of ``pseudo`` that holds an inf or a NaN (-1: none),
        as the 8 bytes every rank allgathers: one read pass over each tensor."""
        device = pseudo[0].device
        finite = torch.stack([tensor_finite(t).to(device) for t in pseudo]).cpu()
        bad = torch.nonzero(~finite).reshape(-1)
        return np.array([int(bad[0]) if bad.numel() else -1], dtype="<i8")

    def _warn_nonfinite(self, nonfinite: dict) -> None:
        where = "; ".join(f"rank {rank}: {name!r}" for rank, name in sorted(nonfinite.items()))
        warnings.warn(f"OuterOptimizer: outer step {self.outer_steps + 1} skipped, a "
                      f"pseudo-gradient holds inf or NaN ({where}); every rank's parameters "
                      "are back at the synced copy, whose outer optimizer state and "
                      "residuals did not change", RuntimeWarning, stacklevel=4)

    def _allreduce_average(self, transport, pseudo) -> list:
        """The exact dense outer step: the pseudo-gradients, flattened into one buffer per
        dtype, allreduced on the outer group and averaged (what the lossless exchange
        would deliver, without coding every element); recorded in :attr:`stats`."""
        began = time.perf_counter()
        traffic, nbytes = Traffic(), 0
        averaged = [None] * len(pseudo)
        with torch.no_grad():
            # where the parameters are, when the group takes tensors there (NCCL, gloo,
            # "cpu:gloo,cuda:nccl"), else where its frames travel
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
    def state_dict(self) -> dict:
        """The frame's checkpoint (the residuals, random streams and settings) with the
        counters, the synced copy and the outer optimizer's state. An exchange in flight
        is waited for (not merged): its averaged update (or the synced copy stepped with
        it already, where the background thread took the outer step), and what its
        merge needs, go into the checkpoint, and are merged after loading at the same
        inner step as in a run that never stopped. After a failed exchange it raises that failure (the
        ranks' states no longer agree)."""
        self._raise_failure()
        flight = self._in_flight
        if flight is not None:
            try:
                flight.future.result()
            except BaseException as exc:
                self._in_flight, self._failure = None, exc
                raise
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue from :meth:`state_dict` (of an optimizer with the same settings and
        parameters), into an object with no exchange in flight."""
        if self._in_flight is not None:
            raise RuntimeError("an outer step's exchange is in flight: load a checkpoint "
                               "into a new OuterOptimizer (or after drain())")
        # (checkpoints of versions without overlap and fragments: their defaults)
        settings = {"overlap": 0, "fragments": 1, **(state_dict.get("settings") or {})}
        super().load_state_dict({**state_dict, "settings": settings})

    def _own_state(self) -> dict:
        state = {"inner_steps": self.inner_steps, "outer_steps": self.outer_steps,
                 "synced": {n: s.detach().clone() for n, s in zip(self.names, self._synced)},
                 "outer_optimizer": self._outer.state_dict()}
        flight = self._in_flight
        if flight is not None:  # (done: state_dict waited for it)
            averaged, nonfinite = flight.future.result()
            names = [self.names[i] for i in flight.members]
            state["in_flight"] = {
                "fragment": flight.fragment, "started_at": flight.started_at,
                "merge_at": flight.merge_at, "nonfinite": dict(nonfinite),
                # (stepped: the synced copy above holds its outer step already)
                "stepped": flight.stepped,
                "averaged": None if averaged is None or flight.stepped else
                {n: a.detach().clone() for n, a in zip(names, averaged)},
                "anchor": {n: a.clone() for n, a in zip(names, flight.anchor)}}
        return state

    def _load_own_state(self, state_dict: dict) -> None:
        # (the model's parameters are the model's checkpoint's business)
        with torch.no_grad():
            for name, s in zip(self.names, self._synced):
                s.copy_(state_dict["synced"][name])
        self._outer.load_state_dict(state_dict["outer_optimizer"])
        self.inner_steps = int(state_dict["inner_steps"])
        self.outer_steps = int(state_dict["outer_steps"])
        self._failure = None
        pending = state_dict.get("in_flight")
        if pending is not None:
            fragment = pending["fragment"]
            members = list(range(len(self.params))) if fragment is None else \
                self.schedule.members[fragment]
            names = [self.names[i] for i in members]
            averaged = None if pending["averaged"] is None else \
                [pending["averaged"][n] for n in names]
            flight = InFlight(fragment, members, int(pending["started_at"]),
                              int(pending["merge_at"]),
                              anchor=[pending["anchor"][n] for n in names
                                      if n in pending["anchor"]])
            flight.stepped = bool(pending.get("stepped", False))
            flight.future = concurrent.futures.Future()
            flight.future.set_result((averaged, dict(pending["nonfinite"])))
            self._in_flight = flight

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
