"""The CUDA path's rules, checked on the CPU (docs/cuda.md).

A GPU is not needed to check what the code does with a tensor that lives elsewhere:
:class:`Unreadable` is a CPU tensor that numpy cannot read, as it cannot read a CUDA
tensor, whose ``.cpu()`` is its host copy. The stream hand-offs run through the same
code as on a GPU, with the CPU's stand-in streams recording what they were asked to
do (:mod:`deepreduce.torch.streams`).
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deepreduce as dr  # noqa: E402
import deepreduce.torch as drt  # noqa: E402
from deepreduce.collectives import ThreadTransport  # noqa: E402

from benchmarks.device_step import LoopbackTransport  # noqa: E402


class Unreadable(torch.Tensor):
    """A CPU tensor that numpy cannot read, like a CUDA tensor: ``np.asarray`` and
    ``.numpy()`` raise torch's message for a CUDA tensor; ``.cpu()`` is a plain copy.
    What torch makes of it is one too, so every way its values reach the host (what on
    a GPU waits for the device) is counted, per thread, in :attr:`SYNCS` when that is a
    dict."""

    MESSAGE = ("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy "
               "the tensor to host memory first.")
    SYNCS = None

    def __array__(self, *args, **kwargs):
        raise TypeError(self.MESSAGE)

    def numpy(self, *args, **kwargs):
        raise TypeError(self.MESSAGE)

    def cpu(self, *args, **kwargs):
        self._synced("cpu")
        return self.as_subclass(torch.Tensor).clone()

    def item(self):
        self._synced("item")
        return self.as_subclass(torch.Tensor).item()

    def __bool__(self):
        self._synced("bool")
        return bool(self.as_subclass(torch.Tensor))

    def tolist(self):
        self._synced("tolist")
        return self.as_subclass(torch.Tensor).tolist()

    @classmethod
    def _synced(cls, how):
        if cls.SYNCS is not None:
            import threading
            cls.SYNCS.setdefault(threading.current_thread().name, []).append(how)


def unreadable(values) -> Unreadable:
    return torch.as_tensor(values, dtype=torch.float32).clone().as_subclass(Unreadable)


def test_unreadable_is_unreadable():
    x = unreadable([1.0, 2.0])
    with pytest.raises(TypeError, match="numpy"):
        np.asarray(x)
    assert type(x.cpu()) is torch.Tensor and x.cpu().numpy().tolist() == [1.0, 2.0]


class Bucket:
    """What the hook reads of DDP's ``GradBucket``: its buffer, index, whether it is the
    last of the backward pass, and its parameters (by default two: 3,000 and 100
    values)."""

    def __init__(self, buffer, index=0, last=True, shapes=((30, 100), (100,))):
        self._buffer, self._index, self._last = buffer, index, last
        self._params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]

    def buffer(self):
        return self._buffer

    def index(self):
        return self._index

    def is_last(self):
        return self._last

    def parameters(self):
        return self._params


def gradients(seed=0, bad=False):
    values = np.random.default_rng(seed).standard_normal(3100).astype(np.float32)
    if bad:
        values[17] = np.inf
    return unreadable(values)


def state(device_path, transport):
    made = drt.DeepReduceState(sparsifier=dr.TopK(0.05), value="fp16", start_iter=0,
                               min_compression_rate=0, device_path=device_path)
    made._transport = transport  # (as benchmarks/device_step.py binds its loopback)
    return made


@pytest.mark.parametrize("device_path", [False, True])
def test_finite_check_on_a_loopback_transport_reads_no_device_tensor(device_path):
    """benchmarks/device_step.py's states: check_finite (the default) with a transport
    that is not torch.distributed's: the check runs on the tensor's device and only its
    one-value answer crosses to the host."""
    made = state(device_path, LoopbackTransport(2))
    assert made.finite_everywhere([gradients()]) is True
    assert made.finite_everywhere([gradients(bad=True)]) is False


def test_finite_check_on_thread_ranks_reads_no_device_tensor():
    """Two ranks (threads): one rank's inf makes the bucket non-finite on both."""
    members = ThreadTransport.group(2)
    states = [state(False, member) for member in members]
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda r: states[r].finite_everywhere([gradients(r, bad=r == 1)]),
                                range(2)))
        assert answers == [False, False]
        answers = list(pool.map(lambda r: states[r].finite_everywhere([gradients(r)]), range(2)))
        assert answers == [True, True]


@pytest.mark.parametrize("device_path", [False, True])
def test_finite_check_on_a_torch_transport_reads_no_device_tensor(world_of_one, device_path):
    made = drt.DeepReduceState(sparsifier=dr.TopK(0.05), device_path=device_path)
    assert made.finite_everywhere([gradients()]) is True
    assert made.finite_everywhere([gradients(bad=True)]) is False


def test_device_step_scheme_runs_the_hook_on_tensors_numpy_cannot_read():
    """The device path of benchmarks/device_step.py, as it runs on a GPU: the hook over a
    loopback transport of 2 ranks, check_finite on, a bucket numpy cannot read."""
    made = state(True, LoopbackTransport(2))
    buffer = gradients()
    want = buffer.cpu()
    result = drt.deepreduce_hook(made, Bucket(buffer)).wait()
    assert result is buffer and made.iter == 1
    kept = result.cpu()[:3000]  # two identical ranks, averaged: the selected values back
    chosen = torch.topk(want[:3000].abs(), 150).indices
    assert torch.equal(kept[chosen].half().float(), want[:3000][chosen].half().float())
    assert torch.equal(result.cpu()[3000:], want[3000:])  # (below min_size: whole)


def test_state_dict_round_trips_on_the_device_path():
    """DeepReduceState.state_dict() on the device path (its residuals are torch tensors)
    and load_state_dict() into a fresh state: the next step's residuals and results are
    those of the state that never stopped."""
    def fresh():
        return state(True, LoopbackTransport(2))

    going = fresh()
    for step in range(2):
        drt.deepreduce_hook(going, Bucket(gradients(step))).wait()
    saved = going.state_dict()
    assert all(isinstance(r, torch.Tensor) for r in saved["residuals"].values())
    assert len(saved["residuals"]) == 1  # the 3,000-value parameter; the bias goes whole
    resumed = fresh()
    resumed.load_state_dict(saved)
    assert resumed.iter == going.iter == 2
    results = [drt.deepreduce_hook(s, Bucket(gradients(5))).wait().cpu()
               for s in (going, resumed)]
    assert torch.equal(results[0], results[1])
    after = [s.state_dict()["residuals"] for s in (going, resumed)]
    assert after[0].keys() == after[1].keys()
    assert all(torch.equal(after[0][k].cpu(), after[1][k].cpu()) for k in after[0])


# -- the device from the data (docs/cuda.md, "Which device") ---------------------------

@pytest.fixture
def no_current_device(monkeypatch):
    """torch.cuda.current_device() raises: nothing may ask the calling thread's device."""
    def refuse(*args, **kwargs):
        raise AssertionError("asked torch.cuda.current_device()")
    monkeypatch.setattr(torch.cuda, "current_device", refuse)


@pytest.mark.parametrize("config, backends", [
    ("cpu:gloo,cuda:gloo", {"cpu": "gloo", "cuda": "gloo"}),
    ("cuda:nccl", {"cuda": "nccl"}),
    ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
])
def test_backends_of_reads_every_device_types_backend(world_of_one, monkeypatch, config,
                                                      backends):
    import torch.distributed as dist
    from deepreduce.torch import transport as transport_module

    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: config)
    assert transport_module.backends_of(dist.group.WORLD) == backends
    # a mixed group is one deepreduce runs over
    assert transport_module.TorchTransport._backend_of(dist.group.WORLD) == config


def test_an_unknown_backend_is_refused_by_name(world_of_one, monkeypatch):
    import torch.distributed as dist
    from deepreduce.torch import transport as transport_module

    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:ucc")
    with pytest.raises(ValueError, match="ucc"):
        transport_module.TorchTransport._backend_of(dist.group.WORLD)


def test_frames_follow_the_data_never_the_current_device(world_of_one, monkeypatch,
                                                         no_current_device):
    import torch.distributed as dist
    from deepreduce.torch.transport import frame_device

    group = dist.group.WORLD
    # gloo (and any group with a CPU backend): the host, whatever the tensors' device
    assert frame_device(group, "cuda:1") == frame_device(group) == torch.device("cpu")
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    assert frame_device(group, torch.device("cuda", 1)) == torch.device("cpu")
    # NCCL alone: the tensors' own GPU
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    assert frame_device(group, torch.device("cuda", 1)) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="device="):  # no tensors, no bound default group
        frame_device(group)
    with pytest.raises(ValueError, match="on cpu"):
        frame_device(group, "cpu")
    with pytest.raises(ValueError, match="names no GPU"):
        frame_device(group, "cuda")


def test_the_hook_binds_for_its_buckets_device(world_of_one, no_current_device):
    """The first bucket binds the state's transport with the bucket's device; a shared
    transport refuses tensors whose frames would travel elsewhere."""
    from deepreduce.torch import transport as transport_module

    made = drt.DeepReduceState(sparsifier=dr.TopK(0.05), start_iter=0, min_compression_rate=0)
    assert made._transport is None
    drt.deepreduce_hook(made, Bucket(torch.randn(3100))).wait()
    assert made.transport is transport_module.transport_of() and \
        made.transport.device == torch.device("cpu")
    made.transport.serve(torch.device("cpu"))  # (gloo: frames on the host for every device)


def test_outer_optimizer_binds_for_its_parameters(world_of_one, no_current_device):
    from deepreduce.torch.outer import OuterOptimizer
    from deepreduce.torch.transport import transport_of

    net = torch.nn.Linear(40, 40)
    outer = OuterOptimizer(net.named_parameters(), sync_every=1)
    outer.sync()
    assert outer.transport is transport_of() and outer.outer_steps == 1


class FakeConfigured:
    """What ReplicaGroupTransport reads of torchft's configured group."""

    def __init__(self, *device_types):
        self._device_types = [torch.device(d) for d in device_types]

    def rank(self):
        return 0

    def size(self):
        return 1


@pytest.mark.parametrize("served, data, frames", [
    (("cpu", "cuda"), "cpu", "cpu"),         # gloo
    (("cpu", "cuda"), "cuda:1", "cpu"),      # gloo, tensors on a GPU: frames on the host
    (("cuda",), "cuda:1", "cuda:1"),         # torchft's NCCL group: the tensors' GPU
    (("cuda",), "cpu", "cpu"),
])
def test_torchft_transport_follows_its_tensors(no_current_device, served, data, frames):
    from deepreduce.torch.torchft import ReplicaGroupTransport

    transport = ReplicaGroupTransport(FakeConfigured(*served))
    transport.bind(torch.device(data))
    assert transport.device == torch.device(frames)
    asked = ReplicaGroupTransport(FakeConfigured(*served), device="cpu")
    asked.bind(torch.device(data))
    assert asked.device == torch.device("cpu")  # a device given is kept


# -- process groups made at bind time (docs/cuda.md, "Process groups") ------------------

@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """Findings of tests/torch_group_workers.py: ``{check: [rank 0, ..., rank 3]}``."""
    from conftest import run_ranks
    return run_ranks("torch_group_workers.py", tmp_path_factory.mktemp("groups"), 4)


def test_the_hook_makes_every_group_when_it_binds(four_ranks):
    from conftest import findings
    found = findings(four_ranks, "check_hook_binds_every_group_at_once")
    descs = [[desc for _, desc, _ in f["at_bind"]] for f in found]
    # its own group, its flag group, then the node groups and the shard groups (2 each)
    assert descs[0][:2] == ["deepreduce", "deepreduce_flags"]
    assert descs[0][2:] == ["deepreduce_split_2"] * 4
    assert all(d == descs[0] for d in descs)  # the same calls, in the same order, everywhere
    assert all(f["later"] == [] and f["iter"] == 3 for f in found)


def test_an_explicit_bind_makes_the_groups_on_its_thread(four_ranks):
    from conftest import findings
    for f in findings(four_ranks, "check_explicit_bind_on_the_main_thread"):
        assert [desc for _, desc, _ in f["at_bind"]] == ["deepreduce", "deepreduce_flags"]
        assert {thread for thread, _, _ in f["at_bind"]} == {f["main"]}
        assert f["later"] == []


def test_groups_of_subsets_are_made_by_their_members(four_ranks):
    from conftest import findings
    found = findings(four_ranks, "check_subset_groups")
    for rank, f in enumerate(found):
        node, local = divmod(rank, 2)
        inner, outer = [2 * node, 2 * node + 1], [local, local + 2]
        # the hook's groups of its node, then the outer optimizer's of its outer group
        assert [(desc, ranks) for _, desc, ranks in f["made"]] == [
            ("deepreduce", inner), ("deepreduce_flags", inner),
            ("deepreduce", outer), ("deepreduce_flags", outer)]
        assert f["outer_steps"] == 2 and f["same_as_outer_peer"] is True


def test_a_device_bound_nccl_parent_is_split_with_every_member(world_of_one, monkeypatch):
    """With the default group bound to a GPU, NCCL makes sub-groups by ncclCommSplit over
    the parent: new_groups asks split_group (every member of the parent, no other rank)
    and never new_group(use_local_synchronization=True), which would leave the members
    waiting for the non-members' NOCOLOR split."""
    import torch.distributed as dist
    from deepreduce.torch import transport as transport_module

    asked = []

    def split_group(**kwargs):
        asked.append(kwargs)
        return "the split group"
    monkeypatch.setattr(transport_module, "_splits_by_nccl", lambda parent: True)
    monkeypatch.setattr(dist, "split_group", split_group)
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: pytest.fail("new_group called"))
    made = transport_module.new_groups(dist.group.WORLD, [[0]], "deepreduce")
    assert made == ["the split group"]
    assert asked[0]["parent_pg"] is dist.group.WORLD and asked[0]["split_ranks"] == [[0]]
    # another backend than the parent's (a gloo flag group) is not split from it
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: "a new group")
    assert transport_module.new_groups(dist.group.WORLD, [[0]], "flags",
                                       backend="nccl-other") == ["a new group"]


# -- the stream model (docs/cuda.md, "Streams") ----------------------------------------

def test_each_bucket_is_handed_over_before_its_work_runs_and_completed_on_the_lane(
        world_of_one):
    """The order of the hand-offs, on the CPU lane's trace: each bucket's work is handed
    over on the caller's thread (an event on its current stream, on a GPU), waited for
    on the communication thread before it runs, and its future is completed with the
    lane current."""
    made = drt.DeepReduceState(sparsifier=dr.TopK(0.05), start_iter=0, min_compression_rate=0,
                               device_path=True)
    made.bind(torch.device("cpu"))
    lane = made.transport.lane
    lane.trace = []
    try:
        futures = [drt.deepreduce_hook(made, Bucket(torch.randn(3100), index=i, last=i == 1))
                   for i in range(2)]
        for future in futures:
            future.wait()
        trace = list(lane.trace)
    finally:
        lane.trace = None
    handed = [(mark, thread) for what, mark, thread in trace if what == "hand_over"]
    waited = [(mark, thread) for what, mark, thread in trace if what == "wait"]
    assert [mark for mark, _ in waited] == [mark for mark, _ in handed]  # each, in order
    assert {thread for _, thread in handed} == {"MainThread"}
    assert all(thread.startswith("deepreduce-comm") for _, thread in waited)
    for mark, _ in handed:  # handed over before it is waited for
        assert trace.index(("hand_over", mark, "MainThread")) < \
            next(i for i, t in enumerate(trace) if t[:2] == ("wait", mark))
    assert sum(what == "complete" for what, _, _ in trace) == 2  # one per bucket's future
    last_wait = max(i for i, t in enumerate(trace) if t[0] == "wait")
    assert [t[0] for t in trace[last_wait + 1:]].count("complete") >= 1


def test_allreduce_completes_its_future_on_the_lane(world_of_one):
    made = drt.DeepReduceState(sparsifier=None, value="raw")
    x = torch.randn(50)
    made.bind(x.device)
    made.transport.lane.trace = []
    try:
        assert torch.equal(drt.allreduce(x, made, name="x", op="sum"), x)
        whats = [what for what, _, _ in made.transport.lane.trace]
    finally:
        made.transport.lane.trace = None
    assert whats[0] == "hand_over" and "wait" in whats and whats[-1] == "complete"


@pytest.mark.parametrize("check_finite, syncs", [(True, 2), (False, 2)])
def test_the_device_path_waits_for_the_device_twice_per_bucket(world_of_one, monkeypatch,
                                                               check_finite, syncs):
    """Host syncs per compressed bucket on the device path, counted where they happen
    (what reaches the host from a tensor numpy cannot read): on the autograd thread,
    one copy brings this rank's finite answer with the small tensors, one the selected
    pairs (a sampled Top-k over 70,000 values: its check travels with them); on the
    communication thread none (gloo frames are host bytes; sums come from pinned
    memory)."""
    from deepreduce.torch import ddp

    # the finite check as on a GPU (on the CPU it reads its sum at once: no wait there)
    monkeypatch.setattr(ddp, "tensor_finite",
                        lambda x: torch.isfinite(x.sum()) | torch.isfinite(x).all())
    made = drt.DeepReduceState(sparsifier=dr.TopK(0.01), value="fp16", start_iter=0,
                               min_compression_rate=0, device_path=True,
                               check_finite=check_finite)
    shapes = ((70, 1000), (300,), (200,))
    for step in range(3):
        buffer = unreadable(np.random.default_rng(step).standard_normal(70500))
        Unreadable.SYNCS = {}
        try:
            drt.deepreduce_hook(made, Bucket(buffer, shapes=shapes)).wait()
            counted = Unreadable.SYNCS
        finally:
            Unreadable.SYNCS = None
        assert counted.get("MainThread") == ["cpu"] * syncs, counted
        assert not any(thread.startswith("deepreduce-comm") for thread in counted), counted
    link = made.exchange.selector.link
    assert link.to_host_copies == 3 * syncs


def test_streams_docstring_examples():
    import doctest

    from deepreduce.torch import streams
    assert doctest.testmod(streams).failed == 0
