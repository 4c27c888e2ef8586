"""torchft's fault-tolerant outer steps (DiLoCo, LocalSGD) with deepreduce's exchange.

torchft (``pip install torchft``, the ``torchft`` extra) runs DiLoCo and LocalSGD across
*replica groups* that may come and go: a lighthouse forms a quorum before every outer
step, the replica groups' process group is reconfigured to its members, and a step in
which anything failed is discarded on every replica (``should_commit``). Its fragments
send their pseudo-gradients through one call, ``Manager.allreduce(tensor)``, which
averages in place over the quorum's participants.

:class:`DeepReduceManager` stands in for the manager where DiLoCo or LocalSGD take one
and routes that call through :class:`deepreduce.exchange.GradientExchange`::

    import torchft, deepreduce.torch.torchft as drft
    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), use_async_quorum=False, ...)
    compressed = drft.DeepReduceManager(manager)       # SparseLoCo's settings
    with torchft.local_sgd.DiLoCo(compressed, [model], inner, outer, sync_every=30):
        ...                                           # the training loop, unchanged

Each outer step's pseudo-gradients go out as one bundle (error feedback per tensor, the
sparsifier, the index and value codecs), every participant's bundle reaches every
participant by an allgather on torchft's replica process group
(:class:`ReplicaGroupTransport`), and each decodes, sums in rank order and divides by
the number of participants, as torchft's own allreduce does. Everything else the
manager does (quorum, healing, commits, checkpoints) is torchft's. The exchange works on
host copies of the pseudo-gradients (numpy and the compiled codecs): a copy per outer
step, every ``sync_every`` inner steps.
"""

from __future__ import annotations

import concurrent.futures
import numbers
import threading
import weakref
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from deepreduce.collectives import frames
from deepreduce.collectives.transport import Transport
from deepreduce.config import ExchangeConfig, check_count
from deepreduce.torch.device import from_host, host_array
from deepreduce.torch.integration import TorchIntegration, check_process_group
from deepreduce.torch.transport import CollectiveError, _reason

__all__ = ["DeepReduceManager", "ReplicaGroupTransport"]

#: What a collective of :class:`ReplicaGroupTransport` waits at most when the group's
#: own timeout is unknown.
DEFAULT_TIMEOUT = timedelta(seconds=60)


class ReplicaGroupTransport(Transport):
    """The allgather of deepreduce over torchft's replica process group.

    torchft's ``ProcessGroupGloo`` (or NCCL) is one object whose members change: the
    manager reconfigures it to each new quorum's participants. :meth:`bind` reads the
    rank and size of the current configuration; the manager calls it once per outer
    step, after the quorum. An allgather of variable-length frames takes two
    collectives on the group: every member's length, then every frame padded to the
    longest (``Traffic`` counts the padding: it crosses too).

    Parameters
    ----------
    process_group : torchft.process_group.ProcessGroup
        The replica groups' process group (the one given to ``torchft.Manager(pg=...)``).
    device : torch.device or str, optional
        Where the byte tensors live. By default (None) they follow the tensors the
        transport serves, read at each :meth:`bind`: the CPU where those are on the
        CPU or the group has a backend for CPU tensors (gloo), else their device (an
        NCCL group moves only GPU memory). Never the calling thread's current device.
    """

    def __init__(self, process_group, device=None):
        super().__init__()
        self.process_group = process_group
        self._asked = None if device is None else torch.device(device)
        self.device = torch.device("cpu") if self._asked is None else self._asked
        self.rank, self.size = 0, 1
        self._configured = None  # weakly: the group of the configuration bound last

    def bind(self, device=None) -> bool:
        """Take the rank and size of the group's current configuration, and the device
        of the tensors it serves now (``device``; see the class's ``device``); whether
        it is another configuration than at the last call (a new quorum: its members
        should compare their settings)."""
        group = configured_group(self.process_group)
        self.rank, self.size = group.rank(), group.size()
        if self._asked is None and device is not None:
            self.device = _frame_device_of(group, torch.device(device))
        changed = self._configured is None or self._configured() is not group
        self._configured = weakref.ref(group)
        return changed

    def allgather(self, frame, traffic, stage):
        try:
            return self._allgather(np.frombuffer(frame, dtype=np.uint8), traffic, stage)
        except Exception as exc:  # noqa: BLE001 - named, and chained
            raise CollectiveError(f"allgather of {stage!r} on torchft's replica group",
                                  self.rank, _reason(exc)) from exc

    def _allgather(self, data, traffic, stage):
        lengths = torch.cat(self._gather(torch.tensor([data.size], dtype=torch.int64)))
        lengths = lengths.cpu().numpy()
        longest = int(lengths.max())
        padded = np.zeros(longest, dtype=np.uint8)
        padded[:data.size] = data
        everyone = torch.stack(self._gather(torch.from_numpy(padded))).cpu().numpy()
        traffic.add(stage, 8 + longest, (self.size - 1) * (8 + longest))
        return [memoryview(everyone[r, :int(n)]) for r, n in enumerate(lengths)]

    def _gather(self, local) -> list:
        """Every member's ``local`` (one collective), in rank order."""
        local = local.to(self.device)
        everyone = [torch.empty_like(local) for _ in range(self.size)]
        self.process_group.allgather([everyone], [local], AllgatherOptions()).wait()
        return everyone

    def alltoall(self, frames, traffic, stage):
        raise NotImplementedError("deepreduce over torchft sends bundles by allgather: use "
                                  "communicator='allgather'")


def _frame_device_of(group, device: torch.device) -> torch.device:
    """Where frames travel on torchft's configured ``group`` for tensors on ``device``: the
    CPU for CPU tensors or a group with a CPU backend (``ProcessGroup._device_types``,
    where torch tells), else ``device``."""
    if device.type == "cpu":
        return device
    served = {d.type for d in getattr(group, "_device_types", ())}
    return torch.device("cpu") if "cpu" in served else device


def configured_group(process_group):
    """The torch process group that a torchft process group runs on now (its wrappers
    unwrapped): its ``rank()`` and ``size()`` are the current configuration's."""
    group, seen = process_group, set()
    while hasattr(group, "parent") and id(group) not in seen:
        seen.add(id(group))
        group = group.parent  # (torchft asserts that it is configured)
    return group


class DeepReduceManager(TorchIntegration):
    """A torchft ``Manager`` whose ``allreduce`` goes through deepreduce's exchange.

    Give it to torchft's ``DiLoCo`` or ``LocalSGD`` where they take the manager;
    every other attribute is the manager's own.

    Parameters
    ----------
    manager : torchft.Manager
        The replica group's manager. DiLoCo needs ``use_async_quorum=False``.
    config : ExchangeConfig, optional
        The exchange's settings at once; or, by name, its fields (``sparsifier``,
        ``index``, ``value``, ``error_feedback``, the decay of the residuals,
        ``min_size``, ``seed``, ``codec_threads``; ``communicator`` must stay
        "allgather"), which take the place of SparseLoCo's
        (:meth:`ExchangeConfig.sparseloco <deepreduce.config.ExchangeConfig.sparseloco>`,
        as :class:`~deepreduce.torch.outer.OuterOptimizer`'s ``mode="sparseloco"``).
        SparseLoCo's outer step is then torchft's DiLoCo with ``SGD(lr=1.0)`` (alpha,
        no momentum) as the outer optimizer; DiLoCo's own Nesterov momentum goes with
        ``error_feedback=1.0``, and dense DiLoCo in bf16 is
        ``config=ExchangeConfig.diloco(value="bf16")``.
    fragments : int, default 1
        The model fragments DiLoCo syncs in turn (Streaming DiLoCo: the length of its
        ``model_fragments``); outer step ``s`` syncs fragment ``s % fragments``. Each
        pseudo-gradient's residual is named by its fragment and its position among the
        tensors of that fragment's outer step (``"fragment0.tensor3"``): the same
        tensor at every step, on every replica and after a restart.
    check_finite : bool, default True
        Before encoding, every participant learns whether all participants'
        pseudo-gradients are finite (one pass, a byte allgathered); where one is not,
        the step travels whole and exact, as torchft's allreduce sends it, and no
        residual changes.
    process_group : torchft.process_group.ProcessGroup, optional
        The replica groups' process group; by default the manager's.
    device : torch.device or str, optional
        Where the transport's byte tensors live (see :class:`ReplicaGroupTransport`).
    timeout : datetime.timedelta or float, optional
        How long a wait for an outer step's exchange lasts before it counts as failed
        (a number: seconds); by default the manager's ``timeout``.

    Attributes
    ----------
    manager : torchft.Manager
    exchange : deepreduce.exchange.GradientExchange
    transport : ReplicaGroupTransport
    stats : deepreduce.exchange.stats.CompressionStats
        Bytes and times of every outer step's exchange.
    last_traffic : deepreduce.collectives.Traffic or None
        What the last exchange handed to the process group and got back.

    Notes
    -----
    **What travels together.** ``allreduce`` only queues its tensor; the tensors queued
    since the last use of the manager go out as one bundle when a ``Work`` of theirs is
    waited on, or the manager is used for anything else (DiLoCo's next inner step
    touches it; ``should_commit`` and ``start_quorum`` wait for the exchange to end).
    So an outer step travels as one bundle, and with ``fragment_sync_delay`` its
    exchange overlaps the inner steps as torchft's allreduce does.

    **Faults follow torchft's path.** An exchange that fails (a replica left, a
    timeout) reports the error to the manager (``manager.report_error``) and leaves
    the tensors as they were; ``should_commit`` then answers False on every replica,
    DiLoCo discards the outer step, and the next quorum goes on without the lost
    replica. The residuals and random streams go back to where they stood before
    the discarded step: nothing of it is owed later. Settings that differ between
    replicas are no fault but a mistake: they raise on every replica, naming what
    differs.

    **Checkpoints.** The residuals are each replica's own (what it still owes the
    others), so they are not part of what torchft sends a replica that heals from a
    peer: a new replica starts owing nothing. :meth:`state_dict` and
    :meth:`load_state_dict` keep them across a restart of the same replica.

    ``allreduce`` calls with another ``reduce_op`` than AVG or SUM, or integer
    tensors, go to torchft's own allreduce (after the exchange in flight ends, so
    the two never share the process group at once). ``should_quantize`` is torchft's
    own quantisation; here the value codec decides.

    Examples
    --------
    One replica group, its lighthouse in this process, one DiLoCo outer step:

    >>> from datetime import timedelta
    >>> import torch, torch.distributed as dist
    >>> from torchft import Manager, ProcessGroupGloo
    >>> from torchft.coordination import LighthouseServer
    >>> from torchft.local_sgd import DiLoCo
    >>> import deepreduce.torch.torchft as drft
    >>> lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    >>> store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    >>> model = torch.nn.Linear(64, 64)
    >>> manager = Manager(pg=ProcessGroupGloo(), min_replica_size=1, use_async_quorum=False,
    ...                   load_state_dict=model.load_state_dict, state_dict=model.state_dict,
    ...                   replica_id="0", store_addr="localhost", store_port=store.port,
    ...                   rank=0, world_size=1, lighthouse_addr=lighthouse.address(),
    ...                   timeout=timedelta(seconds=10))
    >>> compressed = drft.DeepReduceManager(manager)
    >>> inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> outer = torch.optim.SGD(model.parameters(), lr=1.0)    # SparseLoCo: no momentum
    >>> with DiLoCo(compressed, [model], inner, outer, sync_every=2, pin_memory=False):
    ...     for _ in range(2):
    ...         inner.zero_grad()
    ...         model(torch.randn(8, 64)).square().mean().backward()
    ...         inner.step()
    >>> manager.current_step(), compressed.stats.last.compressed_tensors   # weight, bias
    (1, 2)
    >>> compressed.stats.last.ratio > 10        # 64 of 4096 weights, 2 bits each
    True
    >>> manager.shutdown(wait=False); lighthouse.shutdown()
    """

    RUNTIME = TorchIntegration.RUNTIME + ("manager", "_lock", "_pending", "_in_flight")

    def __init__(self, manager, *, config=None, fragments=1, check_finite=True,
                 process_group=None, device=None, timeout=None, **settings):
        self.fragments = check_count("fragments", fragments, least=1)
        config = ExchangeConfig.from_settings(config, **settings) if config is not None \
            else ExchangeConfig.sparseloco(**settings)
        if config.communicator != "allgather":
            raise ValueError("deepreduce over torchft sends bundles by allgather; got "
                             f"communicator={config.communicator!r}")
        group = getattr(manager, "_pg", None) if process_group is None else process_group
        if group is None:
            raise ValueError("the manager holds no process group: pass process_group= (the "
                             "pg given to torchft.Manager)")
        super().__init__(config, {"fragments": self.fragments},
                         process_group=check_process_group(group), check_finite=check_finite)
        self.manager = manager
        self._transport = ReplicaGroupTransport(group, device)
        self.timeout = _timeout(timeout if timeout is not None else
                                getattr(manager, "_timeout", DEFAULT_TIMEOUT))
        self.last_traffic = None
        self._lock = threading.RLock()
        self._pending = []       # the queued tensors of the bundle to come: _Queued
        self._in_flight = []     # the _Batch of every exchange started and not waited for
        self._shapes = {}        # residual name -> (shape, dtype) it was first given
        self._snapshot = None    # the exchange's state before this outer step's first bundle
        self._new_step()

    def _new_step(self):
        self._position = 0       # tensors queued since the quorum
        self._fragment = None    # the fragment of this outer step, read at its first tensor
        self._bound = False      # transport bound to this quorum's configuration

    # -- what torchft's fragments call -------------------------------------------------
    def allreduce(self, tensor, should_quantize=False, reduce_op=dist.ReduceOp.AVG):
        """Queue ``tensor`` for this outer step's bundle; return a ``Work``.

        As torchft's ``Manager.allreduce``: the tensor is averaged (or summed) in
        place over the quorum's participants once the Work is waited on; after an
        error, nothing is sent and the Work completes with the tensor as it was.
        """
        if reduce_op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM) \
                or not tensor.dtype.is_floating_point:
            self._drain()
            return self.manager.allreduce(tensor, should_quantize=should_quantize,
                                          reduce_op=reduce_op)
        future = _Future(self._drain)
        if self.manager.errored():
            future.set_result(tensor)
            return _QueuedWork(future)
        self.manager.wait_quorum()
        with self._lock:
            if self._fragment is None:
                self._fragment = self.manager.current_step() % self.fragments
            name = f"fragment{self._fragment}.tensor{self._position}"
            self._position += 1
            self._check_shape(name, tensor)
            divisor = self.manager.num_participants() if reduce_op == dist.ReduceOp.AVG else 1
            self._pending.append(_Queued(name, tensor, divisor, future))
        return _QueuedWork(future)

    def start_quorum(self, *args, **kwargs):
        """torchft's ``start_quorum``, once this manager's exchanges have ended (the new
        quorum reconfigures the process group they run on)."""
        self._drain()
        self._snapshot = None  # (an outer step that never asked should_commit: kept)
        self.manager.start_quorum(*args, **kwargs)
        with self._lock:
            self._new_step()

    def should_commit(self, timeout=None) -> bool:
        """torchft's ``should_commit``, once this outer step's exchange has ended (so that
        its errors count); a discarded step gives back the residuals it changed."""
        self._drain()
        committed = self.manager.should_commit(timeout=timeout)
        if not committed and self._snapshot is not None:
            self.exchange.selector.load_state_dict(self._snapshot)
        self._snapshot = None
        return committed

    def __getattr__(self, name):
        # (only for what this class does not define: the manager's own attributes)
        if name.startswith("__") or name in ("manager", "_lock", "_pending"):
            raise AttributeError(name)
        self._flush()  # another use of the manager: the queued tensors' bundle is complete
        return getattr(self.manager, name)

    # -- the exchange --------------------------------------------------------------------
    def _check_shape(self, name, tensor):
        seen = self._shapes.setdefault(name, (tuple(tensor.shape), tensor.dtype))
        if seen != (tuple(tensor.shape), tensor.dtype):
            raise ValueError(
                f"tensor {self._position - 1} of fragment {self._fragment}'s outer step is "
                f"{tuple(tensor.shape)} {tensor.dtype}, at an earlier step it was {seen[0]} "
                f"{seen[1]}: if DiLoCo syncs several model fragments, pass "
                f"fragments=len(model_fragments) (now {self.fragments})")

    def _flush(self):
        """Start the exchange of the queued tensors (one bundle), if there are any."""
        with self._lock:
            queued, self._pending = self._pending, []
            if not queued:
                return
            try:
                self._start(queued)
            except ValueError as exc:
                if isinstance(exc, frames.PeerError):
                    self._fail(queued, exc)
                else:  # other settings on a peer, a tensor a codec refuses: a mistake
                    self._fail(queued, exc, report=False)
                    raise
            except Exception as exc:  # noqa: BLE001 - torchft's error path
                self._fail(queued, exc)

    def _start(self, queued):
        transport = self.transport
        if not self._bound:
            self._bound = True
            if transport.bind(queued[0].tensor.device):  # a new quorum: its members
                self.agree(transport, again=True)            # compare their settings
        if self._snapshot is None:  # what a discarded outer step gives back
            self._snapshot = self.exchange.selector.state_dict()
        participating = self.manager.is_participating()
        # a replica that is not participating (healing, a spare) sends zeros, as in
        # torchft's allreduce, and keeps its residuals
        arrays = [_host(q.tensor) if participating else np.zeros_like(_host(q.tensor))
                  for q in queued]
        names = [q.name if participating else None for q in queued]
        finite = self.finite_everywhere(arrays, transport)
        batch = _Batch(queued)
        batch.started = self.exchange.reduce_async(names, arrays, transport, "sum",
                                                   finite=finite)
        self._in_flight.append(batch)
        batch.started.add_done_callback(lambda done: self._deliver(batch))

    def _deliver(self, batch):
        """On the transport's thread: write the reduced tensors in place, divided by the
        participants, and complete their Works; or report the failure to torchft. A
        batch given up on (see :meth:`_drain`) is left alone: its step has moved on."""
        with batch.lock:
            if batch.settled:
                return
            batch.settled = True
            try:
                outputs, self.last_traffic = batch.started.result()
                for q, output in zip(batch.queued, outputs):
                    q.tensor.copy_(from_host(output).reshape(q.tensor.shape))
                    if q.divisor != 1:
                        q.tensor.div_(q.divisor)
            except Exception as exc:  # noqa: BLE001 - torchft's error path
                self._fail(batch.queued, exc)
                return
            for q in batch.queued:
                q.future.set_result(q.tensor)

    def _fail(self, queued, exc, report=True):
        if report:
            self.manager.report_error(exc)
        for q in queued:
            if not q.future.done():
                q.future.set_result(q.tensor)

    def _drain(self):
        """Start what is queued and wait for every exchange in flight, each at most the
        timeout: one that outlasts it counts as failed, and its tensors stay as they
        were."""
        self._flush()
        with self._lock:
            in_flight, self._in_flight = self._in_flight, []
        for batch in in_flight:
            concurrent.futures.wait([batch.started], timeout=self.timeout.total_seconds())
            with batch.lock:
                if batch.settled:
                    continue
                batch.settled = True
                self._fail(batch.queued, TimeoutError(
                    f"deepreduce's exchange on torchft's replica group took over {self.timeout}"))

class _Queued:
    """A tensor waiting for its outer step's bundle."""

    __slots__ = ("name", "tensor", "divisor", "future")

    def __init__(self, name, tensor, divisor, future):
        self.name, self.tensor, self.divisor, self.future = name, tensor, divisor, future


class _Batch:
    """The tensors of one bundle, the future of their exchange, and whether they are
    settled (delivered, or given up on)."""

    def __init__(self, queued):
        self.queued, self.started = queued, None
        self.lock, self.settled = threading.Lock(), False


class _Future(torch.futures.Future):
    """The future of a queued tensor: waiting on it starts the bundle it waits for (and
    gives up on it after the manager's timeout), and ends once the callbacks chained to
    it (``then``) have run too, which torch's future does not promise when another
    thread completes it."""

    def __init__(self, drain):
        super().__init__()
        self._drain, self._chained = drain, []

    def then(self, callback):
        chained = super().then(callback)
        self._chained.append(chained)
        return chained

    def wait(self):
        self._drain()
        value = super().wait()
        for chained in self._chained:
            chained.wait()
        return value


class _QueuedWork(dist._Work):
    """The ``Work`` of one tensor, as torchft's allreduce returns: ``wait()`` and
    ``get_future()``."""

    def __init__(self, future: _Future):
        super().__init__()
        self._future = future

    def wait(self, timeout=None) -> bool:
        self._future.wait()
        return True

    def get_future(self):
        return self._future


def _timeout(timeout) -> timedelta:
    """``timeout`` as a timedelta: one, or a number of seconds > 0."""
    if isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
        raise ValueError(f"timeout must be a datetime.timedelta or a number of seconds > 0, "
                         f"got {timeout!r}")
    return timeout


def _host(tensor) -> np.ndarray:
    """The tensor's values as a host numpy array (a view for a CPU tensor)."""
    return host_array(tensor.detach().cpu())

