"""deepreduce for sharded training: FSDP2's replica exchange (HSDP), compressed.

::

    import deepreduce as dr
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from deepreduce.torch.fsdp import compress_replicas

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node),
                            mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])     # sharded inside a node: the fast link
    fully_shard(model, mesh=mesh["shard"])
    state = compress_replicas(model, mesh["replicate"], sparsifier=dr.TopK(0.01),
                              value="fp16")       # averaged across nodes: compressed

The model is sharded with ``fully_shard`` on its shard group alone; FSDP2 then
reduce-scatters each unit's gradients there and hands the unit's flat gradient
shard to the all-reduce hook this module installs on every FSDP module
(``FSDPModule.set_all_reduce_hook``). The hook averages that shard across the
replicate group, the ranks that hold the same shard in the other replicas, in
place, through one :class:`~deepreduce.exchange.GradientExchange` step:

1. At the first call, the transports are bound (late: the state can be built
   before ``init_process_group``) and every rank's settings, and every replica's
   layout of its shards, are compared; a difference raises on every rank.
2. A shard that holds an inf or NaN on any rank of the model is a *non-finite
   step* everywhere: averaged whole and exact, nothing remembered.
3. Before ``start_iter``: a plain average.
4. Then: each parameter's piece of the flat shard (FSDP pads each to an equal
   number of rows per rank; the padding stays out) goes through error feedback
   (its own residual), the sparsifier and the codecs; every replica's payloads
   reach every replica (or another communicator), are decoded and averaged, and
   the averages are written back into the shard.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math

import numpy as np
import torch
import torch.distributed as dist

from deepreduce.collectives.signed import signed_allgather
from deepreduce.collectives.transport import GuardedTransport, Traffic, Transport
from deepreduce.config import ExchangeConfig, check_count
from deepreduce.exchange.selection import Selector
from deepreduce.exchange.stats import StepStats
from deepreduce.torch.ddp import _device_path
from deepreduce.torch.device import DeviceSelector, host_array, tensor_finite
from deepreduce.torch.integration import TorchIntegration
from deepreduce.torch.streams import lane_of
from deepreduce.torch.transport import CollectiveError, transport_of

__all__ = ["compress_replicas", "ReplicaExchangeState", "HookError", "per_rank"]

#: What the replicas' layouts travel behind when they are compared (once).
LAYOUT_SIGNATURE = "fsdp=layout"

#: Numbers the states as they are attached to models (see _UnitStages).
_ATTACHED = itertools.count()


def compress_replicas(model, replicate=None, *, state=None,
                      **settings) -> "ReplicaExchangeState":
    """Average ``model``'s gradient shards across replicas with deepreduce; return the state.

    Parameters
    ----------
    model : torch.nn.Module
        Sharded with ``fully_shard(..., mesh=<the shard mesh>)`` (1-D: a model
        sharded on a 2-D mesh already all-reduces across replicas itself).
    replicate : torch.distributed.ProcessGroup or DeviceMesh, optional
        The ranks that hold the same shards in the other replicas: a group, or a
        1-D mesh such as ``mesh["replicate"]``; the default group when None.
    **settings
        The settings of :class:`ReplicaExchangeState`.
    state : ReplicaExchangeState, optional
        A state built beforehand, instead of the settings.

    Returns
    -------
    ReplicaExchangeState
        Checkpoint it beside the model and the optimizer (see its ``state_dict``).

    Examples
    --------
    One process (a gloo group of one: one replica of one shard); the weight's 4,096
    elements go through Top-10% and fp16, the bias (below ``min_size``) losslessly:

    >>> import os, torch, torch.distributed as dist, deepreduce as dr
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch.distributed.fsdp import fully_shard
    >>> from deepreduce.torch.fsdp import compress_replicas
    >>> os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29593")
    >>> dist.init_process_group("gloo", rank=0, world_size=1)
    >>> mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
    >>> model = fully_shard(torch.nn.Linear(64, 64), mesh=mesh["shard"])
    >>> state = compress_replicas(model, mesh["replicate"], sparsifier=dr.TopK(0.1),
    ...                           start_iter=0)
    >>> model(torch.randn(2, 64)).square().sum().backward()
    >>> total = state.stats.total
    >>> state.iter, total.tensors, total.compressed_tensors, total.ratio > 5
    (1, 2, 1, True)
    >>> int((model.weight.grad.to_local() != 0).sum())   # the Top-10% that travelled
    410
    >>> state.layout()["module <root>"]     # parameter, its shard's shape / padded length
    'weight[64, 64]/4096, bias[64]/64'
    >>> dist.destroy_process_group()
    """
    if state is None:
        state = ReplicaExchangeState(replicate, **settings)
    elif settings or replicate is not None:
        raise ValueError("give a state or the replicate group and settings, not both")
    state.attach(model)
    return state


class ReplicaExchangeState(TorchIntegration):
    """Configuration and state of the replica exchange :func:`compress_replicas` installs.

    Parameters
    ----------
    replicate : torch.distributed.ProcessGroup or DeviceMesh, optional
        The group the shards are averaged over (see :func:`compress_replicas`; a
        mesh's group is taken at once). None: the default group, looked up at the
        first hook call, so that the state can be made before ``init_process_group``.
        deepreduce's own groups of the same ranks are made at the first hook call.
    **settings
        The settings of :class:`~deepreduce.config.ExchangeConfig`, by name, with the
        same defaults as every deepreduce integration: ``sparsifier`` (Top-1%),
        ``index`` ("auto"), ``value`` ("fp16"), ``error_feedback`` (on, per parameter
        shard), ``min_size`` (1024: smaller parameter shards travel
        losslessly), ``seed``, ``communicator`` ("allgather") and its options.
    config : ExchangeConfig, optional
        All of them at once, instead.
    start_iter : int, default 10
        Backward passes of plain averaging before compression starts, as
        :class:`~deepreduce.torch.DeepReduceState`'s.
    device_path : bool, optional
        Error feedback, selection and sums on the shard's device (see
        :class:`~deepreduce.torch.DeepReduceState`); None: when CUDA is available.
    check_finite : bool, default True
        Before a shard touches anything, learn whether every rank's shard of the
        same unit is finite: one read pass and an allreduce of one flag over all
        the model's ranks (every replica and every shard: a loss scaler skips a step
        on all of them). A unit that holds an inf or NaN anywhere is averaged as
        it is, exactly, on every rank, and residuals, random streams and ``auto``
        memory stay as they were; the backward pass counts in ``nonfinite_iters``,
        not in ``iter``.
    grad_scaler : torch.amp.GradScaler, optional
        The loop's loss scaler: residuals follow its scale (see
        :class:`~deepreduce.torch.DeepReduceState`). Not checkpointed.

    Attributes
    ----------
    iter, nonfinite_iters : int
        Backward passes seen (finite everywhere), and those with a non-finite unit.
    exchange : deepreduce.exchange.GradientExchange
        The framework-neutral core.
    stats : deepreduce.exchange.stats.CompressionStats
        One record per unit and backward pass: the bytes handed to the collectives (the
        bundle and its framing apart) against the shard's dense bytes (a plain
        average's: the dense bytes).
    bytes_handed : int
        Bytes this rank handed to the replicate group's collectives so far: the
        frames with the transport's padding and length headers, and the dense shards
        of plain averages. What crosses to the other replicas.
    units : list
        What the hook knows of each FSDP unit: its module, parameters, their shard
        shapes and padded lengths (after :meth:`attach`).

    Notes
    -----
    The state is DCP's ``Stateful``: ``dcp.save({"model": ..., "optim": ...,
    "deepreduce": state}, checkpoint_id=...)`` keeps every rank's part (its
    residuals are those of its own parameter shards: one float copy of the rank's
    shard at most), and a ``dcp.load`` of the same in new processes continues bit for
    bit. A checkpoint of other settings or of another layout (other replicas or
    shards, another model or wrapping) is refused, naming what differs; one written
    by fewer ranks than load it fails in DCP, which names the first rank's key it
    misses (``deepreduce.rank<N>``). Pickling leaves the groups and the units out:
    :meth:`attach` again.

    The hook runs inside FSDP's backward and returns once the shard is averaged, so
    the replicas' exchange of one unit does not overlap the backward of the next
    (FSDP2's own HSDP all-reduce does not on the CPU either). A unit of which some
    parameters got no gradient in a step (FSDP leaves them out of the flat shard)
    goes as one piece, with a residual of its own; ``set_reduce_scatter_unused_params
    (True)`` on the module keeps them in.
    """

    RUNTIME = TorchIntegration.RUNTIME + (
        "_everyone", "guarded", "_unit_transports", "_in_iteration", "_nonfinite_iteration",
        "grad_scaler", "units", "_serial")

    def __init__(self, replicate=None, *, config=None, start_iter=10, device_path=None,
                 check_finite=True, grad_scaler=None, **settings):
        config = ExchangeConfig.from_settings(config, **settings)
        self.start_iter = check_count("start_iter", start_iter)
        self.device_path = _device_path(device_path, config)
        super().__init__(config, {"start_iter": self.start_iter},
                         process_group=_group_of(replicate), check_finite=check_finite,
                         selector=DeviceSelector if self.device_path else Selector)
        self.grad_scaler = grad_scaler
        self.iter = self.nonfinite_iters = self.bytes_handed = 0
        self._loss_scale = None  # the scale the residuals are in (see grad_scaler)
        self._init_runtime()

    def _init_runtime(self):
        super()._init_runtime()
        self._everyone = None    # bound with the transport, at the first hook call
        # the transport, stopped by a failure every rank shares
        self.guarded = GuardedTransport(lambda: self.transport)
        self._unit_transports = {}  # module -> its _UnitStages over guarded
        self._in_iteration = self._nonfinite_iteration = False
        self.__dict__.setdefault("grad_scaler", None)
        self.__dict__.setdefault("units", [])

    # -- installing ---------------------------------------------------------------
    def attach(self, model) -> None:
        """Install the hook on every FSDP module of ``model`` (the root too, when it
        holds parameters), learning each unit's layout."""
        from torch.distributed.fsdp import FSDPModule
        names = {id(p): name for name, p in model.named_parameters()}
        modules = {id(m): name for name, m in model.named_modules()}
        units = []
        for module in model.modules():
            if not isinstance(module, FSDPModule):
                continue
            groups = module._get_fsdp_state()._fsdp_param_groups
            if len(groups) > 1:
                raise ValueError(f"FSDP module {modules[id(module)]!r} has several parameter "
                                 "groups (shard_placement_fn with other meshes): its all-reduce "
                                 "hook would be ambiguous; shard it on one mesh")
            for group in groups:
                unit = _Unit.of(group, modules[id(module)] or "<root>", names)
                units.append(unit)
                module.set_all_reduce_hook(_Hook(self, unit))
        if not units:
            raise ValueError("the model has no FSDP module with parameters: shard it with "
                             "torch.distributed.fsdp.fully_shard(..., mesh=mesh['shard']) first")
        self.units = units
        # states attached in the same order on every rank: the same number everywhere
        self._serial = next(_ATTACHED)

    # -- the groups ---------------------------------------------------------------------
    @property
    def everyone(self):
        """The transport of all the model's ranks (every shard of every replica), for the
        settings' agreement and the all-finite flags; bound with :attr:`transport` (the
        replicate group's, :func:`~deepreduce.torch.transport.transport_of` it) at the
        first hook call, for the shard's device."""
        if self._everyone is None:
            self._bind_all(None)
        return self._everyone

    def _bind_all(self, device) -> None:
        """Bind the replicate group's transport and the model's, for tensors on
        ``device`` (collective: every rank of the model, at its first hook call); bound
        already, they serve ``device`` too."""
        self.bind(device)
        if self._everyone is None:
            ranks = self.guarded.submit(_model_ranks, self.transport,
                                        self.units[0].shard_group).result()
            group = None if len(ranks) == dist.get_world_size() else \
                dist.new_group(ranks, use_local_synchronization=True)
            self._everyone = transport_of(group, device)
        else:
            self._everyone.serve(device)

    def _replicate_group(self):
        return dist.group.WORLD if self.process_group is None else self.process_group

    def _agree(self) -> None:
        """Once: the same settings on every rank, the same layout on every replica."""
        if self._agreed:
            return
        self.agree(self.everyone)
        self.guarded.submit(self._agree_layout).result()

    def _agree_layout(self) -> None:
        """Every replica's :meth:`layout` (less its number) against this one's, on the
        transport's thread; ValueError on every rank, naming each module that differs
        and the ranks (global) that hold each version."""
        mine = json.dumps(self.layout(shared_only=True)).encode()
        frames = signed_allgather(self.transport, LAYOUT_SIGNATURE, mine, Traffic(), "layout")
        layouts = [json.loads(bytes(frame)) for frame in frames]
        ranks = dist.get_process_group_ranks(self._replicate_group())
        differences = []
        for key in dict.fromkeys(k for layout in layouts for k in layout):
            holders = {}
            for rank, layout in zip(ranks, layouts):
                holders.setdefault(layout.get(key, "absent"), []).append(str(rank))
            if len(holders) > 1:
                differences.append(f"{key}: " + "; ".join(
                    f"{value} on rank{'s' if len(held) > 1 else ''} {', '.join(held)}"
                    for value, held in holders.items()))
        if differences:
            raise ValueError("the replicas hold other layouts: " + " | ".join(differences))

    def layout(self, shared_only=False) -> dict:
        """This rank's place and what it holds, as text: which replica and shard, and each
        unit's parameters with their shard shapes and padded lengths. ``shared_only``:
        less the replica's number, which is all that differs between the ranks of one
        replicate group."""
        unit = self.units[0]
        group = self._replicate_group()
        replicas = dist.get_world_size(group)
        layout = {"replicas": str(replicas), "shard": f"{unit.shard_rank} of {unit.shard_size}"}
        if not shared_only:
            layout["replica"] = f"{dist.get_rank(group)} of {replicas}"
        layout.update((f"module {u.module}", u.describe()) for u in self.units)
        return layout

    # -- the hook -----------------------------------------------------------------------
    def reduce_shard(self, unit: "_Unit", flat: torch.Tensor) -> None:
        """Average ``flat``, ``unit``'s reduce-scattered gradient shard, across the
        replicas, in place: what the installed hook does (the module docstring's steps).
        What fails raises from ``loss.backward()``, naming this rank and the module."""
        try:
            if not flat.dtype.is_floating_point:
                raise TypeError(f"the replica exchange averages floating-point gradients; "
                                f"the shard holds {flat.dtype}")
            self._bind_all(flat.device)
            self._agree()
            ends_here = self._begin_backward()
            finite = self.finite_everywhere([flat])
            if not finite:  # every rank: as it is, nothing remembered
                self._average_dense(flat, nonfinite=True)
            elif self.iter < self.start_iter:
                self._average_dense(flat, unit)
            else:
                self._exchange(unit, flat)
            self._nonfinite_iteration |= not finite
            if ends_here:
                self._end_backward()
        except Exception as exc:
            named = _named(exc, unit)
            if named is exc:
                raise
            raise named from exc

    def _exchange(self, unit, flat) -> None:
        """One GradientExchange step of ``unit``'s parameter pieces in ``flat``."""
        with self._pieces(unit, flat) as (names, pieces):
            inputs = _small_to_host(self.exchange, pieces) if self.device_path else pieces
            _, traffic = self.exchange.reduce_async(names, inputs, self._of_unit(unit),
                                                    "average", out=pieces).result()
        self.bytes_handed += traffic.sent
        _after_lane(self.transport, flat)

    @contextlib.contextmanager
    def _pieces(self, unit, flat):
        """``(names, pieces)`` of ``unit`` in ``flat`` as the exchange takes them: torch
        views on the device path, else numpy views of the shard on the CPU, or of a host
        copy of it, copied back when the block ends."""
        host_copy = flat.is_cuda and not self.device_path
        work = flat.detach().cpu() if host_copy else flat.detach()
        yield unit.pieces(work if self.device_path else host_array(work))
        if host_copy:
            flat.copy_(work)

    def _of_unit(self, unit) -> "_UnitStages":
        """The transport ``unit``'s exchanges run on: the state's, its stages named after
        the unit (see :class:`_UnitStages`)."""
        transport = self._unit_transports.get(unit.module)
        if transport is None:
            transport = self._unit_transports[unit.module] = _UnitStages(
                self.guarded, f"module {unit.module} (state {self._serial})")
        return transport

    def _average_dense(self, flat, unit=None, nonfinite=False) -> None:
        """A plain average of ``flat`` across the replicas, recorded in :attr:`stats`;
        with ``unit``, what error feedback still owes its parameters is added first."""
        memory = self.exchange.selector.memory
        if unit is not None and memory is not None and len(memory):
            with self._pieces(unit, flat) as (names, pieces):
                self.exchange.pay(names, pieces, self.guarded)

        def average():
            transport = self.transport
            with transport.failing_as("allreduce of the whole shard"):
                flat.div_(transport.size)
                dist.all_reduce(flat, group=transport.group)
            nbytes = flat.numel() * flat.element_size()
            self.bytes_handed += nbytes
            self.stats.record_step(StepStats(steps=1, tensors=1, bytes_sent=nbytes,
                                             bytes_received=nbytes, dense_bytes=nbytes,
                                             nonfinite_steps=int(nonfinite)))
        self.guarded.submit(average).result()
        _after_lane(self.transport, flat)

    def finite_everywhere(self, tensors, transport=None) -> bool:
        """Whether every rank's ``tensors`` (this unit's shard) are finite (see
        ``check_finite``): checked on their device, the answers allreduced over every
        rank of the model (:attr:`everyone`'s flag group), from the autograd thread."""
        if not self.check_finite:
            return True
        everyone = self.everyone if transport is None else transport
        flag = torch.stack([tensor_finite(t) for t in tensors]).all().to(
            device=everyone.device, dtype=torch.int32).reshape(1)
        if everyone.size > 1:
            with everyone.failing_as("allreduce of the all-finite flag"):
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=everyone.flag_group)
        return bool(flag.item())

    # -- backward passes ----------------------------------------------------------------
    def _begin_backward(self) -> bool:
        """At the first unit of a backward pass: count the pass when it ends (True: the
        hook was called outside one, and the unit is the pass), follow the scaler."""
        if self._in_iteration:
            return False
        self._in_iteration, ends_here = True, False
        try:  # (FSDP's own final callback, queued before, reduces the last units first)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        except RuntimeError:
            ends_here = True
        scaler = self.grad_scaler
        if scaler is not None and scaler.is_enabled():
            scale = float(scaler.get_scale())
            if self._loss_scale is not None and scale != self._loss_scale:
                self.rescale(scale / self._loss_scale)
            self._loss_scale = scale
        return ends_here

    def _end_backward(self) -> None:
        if self._nonfinite_iteration:
            self.nonfinite_iters += 1
        else:
            self.iter += 1
        self._in_iteration = self._nonfinite_iteration = False

    # -- checkpoints (DCP's Stateful) -----------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's part, under a key of its own (``"rank<global rank>"``), so that
        ``torch.distributed.checkpoint.save`` keeps every rank's: the frame's (settings,
        residuals of this rank's parameter shards as tensors, random state) with the
        counters, the loss scale and the layout."""
        return {_rank_key(): RankCheckpoint(super().state_dict())}

    def load_state_dict(self, state_dict: dict) -> None:
        """Continue from :meth:`state_dict`, refusing one of other settings or another
        layout, with a message that names each difference."""
        mine = _own_part(state_dict)
        self.check_settings(mine.state.get("settings"))
        theirs, ours = mine.state["layout"], self.layout()
        differ = [k for k in dict.fromkeys([*ours, *theirs]) if theirs.get(k) != ours.get(k)]
        if differ:
            raise ValueError("the checkpoint was written with another layout: " + "; ".join(
                f"{k} {theirs.get(k, 'absent')!r} there, {ours.get(k, 'absent')!r} here"
                for k in differ))
        super().load_state_dict(mine.state)

    def _own_state(self) -> dict:
        return {"iter": self.iter, "nonfinite_iters": self.nonfinite_iters,
                "loss_scale": self._loss_scale, "layout": self.layout()}

    def _load_own_state(self, state_dict: dict) -> None:
        self.iter, self.nonfinite_iters = int(state_dict["iter"]), int(state_dict["nonfinite_iters"])
        self._loss_scale = state_dict["loss_scale"]


@dataclasses.dataclass
class RankCheckpoint:
    """One rank's part of a :class:`ReplicaExchangeState` checkpoint, ``state`` (its
    ``state_dict`` in the frame's form), as one object: DCP saves it whole, so that a
    checkpoint of another layout reaches :meth:`ReplicaExchangeState.load_state_dict`,
    which names the difference, instead of failing on a tensor's size in DCP."""

    state: dict


def per_rank(obj) -> "PerRank":
    """``obj`` (anything with ``state_dict`` / ``load_state_dict``) as a DCP ``Stateful``
    that keeps every rank's state: for state that differs between ranks in plain tensors,
    such as an :class:`~deepreduce.torch.outer.OuterOptimizer` over a sharded model's
    local shards (its synced copy and residuals are this rank's shards).
    ``torch.distributed.checkpoint`` would save a plain tensor under one key once, from
    one rank.

    ::

        dcp.save({"model": model_sd, "optim": optim_sd, "outer": per_rank(outer)}, ...)
    """
    return PerRank(obj)


class PerRank:
    """See :func:`per_rank`: ``state_dict()`` is ``{"rank<global rank>": RankCheckpoint(
    obj.state_dict())}``; ``load_state_dict`` hands this rank's part to ``obj``."""

    def __init__(self, obj):
        self.obj = obj

    def state_dict(self) -> dict:
        return {_rank_key(): RankCheckpoint(self.obj.state_dict())}

    def load_state_dict(self, state_dict: dict) -> None:
        self.obj.load_state_dict(_own_part(state_dict).state)


def _rank_key() -> str:
    return f"rank{dist.get_rank()}"


def _own_part(state_dict: dict) -> "RankCheckpoint":
    """This rank's :class:`RankCheckpoint` in ``state_dict``; ValueError when it has none."""
    key = _rank_key()
    mine = state_dict.get(key)
    if mine is None:
        raise ValueError(f"the checkpoint holds no deepreduce state for {key} (it holds "
                         f"{', '.join(sorted(state_dict)) or 'none'}): written by another "
                         "number of ranks")
    return mine


class _Hook:
    """The all-reduce hook of one FSDP unit: ``hook(flat_shard)``."""

    def __init__(self, state, unit):
        self.state, self.unit = state, unit

    def __call__(self, flat: torch.Tensor) -> None:
        self.state.reduce_shard(self.unit, flat)


@dataclasses.dataclass
class _Unit:
    """An FSDP unit's layout: its module, and per parameter its name, the shape of this
    rank's shard and the length of its padded piece of the flat shard, in order."""

    module: str
    names: list
    shapes: list
    padded: list
    shard_group: object
    shard_rank: int
    shard_size: int

    @classmethod
    def of(cls, param_group, module, names) -> "_Unit":
        from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo
        mesh_info = param_group.mesh_info
        if isinstance(mesh_info, DDPMeshInfo):
            raise ValueError(f"FSDP module {module!r} is sharded on a 2-D mesh (FSDP2's own "
                             "HSDP), which all-reduces across replicas itself; shard it with "
                             "fully_shard(..., mesh=mesh['shard']) and give mesh['replicate'] "
                             "to compress_replicas")
        params = param_group.fsdp_params
        return cls(module, [names[id(p.sharded_param)] for p in params],
                   [tuple(p.sharded_size) for p in params],
                   [math.prod(p.padded_sharded_param_size) for p in params],
                   mesh_info.shard_process_group, mesh_info.shard_mesh_rank,
                   mesh_info.shard_mesh_size)

    @property
    def numel(self) -> int:
        return sum(self.padded)

    def describe(self) -> str:
        return ", ".join(f"{n}{list(s)}/{p}" for n, s, p in zip(self.names, self.shapes,
                                                                 self.padded))

    def pieces(self, flat) -> tuple[list, list]:
        """``(names, pieces)``: each parameter's shard in ``flat``, shaped, the padding
        and empty shards left out. A shard of another length (FSDP left out parameters
        without a gradient) goes as one piece, named after the module and its length."""
        if flat.shape[0] != self.numel:
            return [f"{self.module}[{flat.shape[0]}]"], [flat]
        names, pieces, start = [], [], 0
        for name, shape, padded in zip(self.names, self.shapes, self.padded):
            size = math.prod(shape)
            if size:
                names.append(name)
                pieces.append(flat[start:start + size].reshape(shape))
            start += padded
        return names, pieces


class _UnitStages(Transport):
    """The state's transport for one unit's exchanges: its collectives' stages carry the
    unit's name (and the state's number). A TorchTransport sizes the slots of an
    allgather from the recent frames of the same stage; the units' payloads differ by
    orders of magnitude (a 2048 x 2048 weight's shard against a bias), and slots sized
    by the largest would pad every other unit's frames to its size. (The transport of
    a group is shared: another state's frames, a lossless one's, say, would size them
    too.)"""

    def __init__(self, guarded, unit: str):
        super().__init__()
        self.guarded, self.suffix = guarded, f" of {unit}"

    @property
    def rank(self):
        return self.guarded.rank

    @property
    def size(self):
        return self.guarded.size

    def submit(self, fn, *args):
        return self.guarded.submit(fn, *args)

    def allgather(self, frame, traffic, stage):
        return self.guarded.allgather(frame, traffic, stage + self.suffix)

    def alltoall(self, frames, traffic, stage):
        return self.guarded.alltoall(frames, traffic, stage + self.suffix)

    def split(self, color, key=None):
        return self.guarded.split(color, key)


class HookError(CollectiveError):
    """A collective of the replica exchange failed; the message names the rank, the
    FSDP module and the collective."""

    def __init__(self, what: str, rank: int, reason: str, module: str):
        RuntimeError.__init__(self, f"deepreduce FSDP hook, rank {rank}, module {module!r}, "
                                    f"{what} failed: {reason}")
        self.what, self.rank, self.reason, self.bucket = what, rank, reason, None
        self.module = module

    def __reduce__(self):
        return type(self), (self.what, self.rank, self.reason, self.module)


def _named(exc, unit):
    """``exc``, raised by ``unit``'s hook, naming this rank and the FSDP module."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if isinstance(exc, HookError):
        return exc
    if isinstance(exc, CollectiveError):
        named = getattr(exc, "in_hook", None)
        if named is None:  # the first unit it failed in
            named = exc.in_hook = HookError(exc.what, rank, exc.reason, unit.module)
            named.__cause__ = exc
        return named
    note = f"(in deepreduce's FSDP hook, rank {rank}, module {unit.module!r})"
    if note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)
    return exc


def _group_of(replicate):
    """The process group of ``replicate``: a group, a 1-D DeviceMesh's, or None."""
    if hasattr(replicate, "get_group"):  # a DeviceMesh
        if replicate.ndim != 1:
            raise ValueError(f"replicate must be a 1-D DeviceMesh (mesh['replicate']), got "
                             f"one of {replicate.ndim} dimensions")
        return replicate.get_group()
    return replicate


def _model_ranks(transport, shard_group) -> list:
    """Every rank of the model (global, sorted): the shard groups of the replicate group's
    members, gathered over ``transport`` (the replicate group's)."""
    mine = np.full(dist.get_world_size(), -1, np.int64)
    ranks = dist.get_process_group_ranks(shard_group)
    mine[:len(ranks)] = ranks
    gathered = transport.allgather(mine.tobytes(), Traffic(), "shard groups")
    return sorted({int(r) for frame in gathered for r in np.frombuffer(frame, np.int64)
                   if r >= 0})


def _small_to_host(exchange, pieces) -> list:
    """The device path's ``pieces`` with those below ``min_size`` on the host."""
    inputs = list(pieces)
    small = [i for i, piece in enumerate(pieces) if piece.numel() < exchange.config.min_size]
    for i, array in zip(small, exchange.selector.link.to_host([pieces[i] for i in small])):
        inputs[i] = array
    return inputs


def _after_lane(transport, flat) -> None:
    """On a GPU: the hook's stream (FSDP's, which reads ``flat`` next) waits for what the
    transport's lane wrote into it (its work waited for the hook's stream when handed
    over: :class:`deepreduce.torch.streams.Lane`). On the CPU, nothing to order."""
    stream = lane_of(transport).stream
    if flat.is_cuda and stream is not None:
        torch.cuda.current_stream(flat.device).wait_stream(stream)
