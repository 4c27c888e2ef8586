"""deepreduce under torchft: DiLoCo's outer steps through :class:`DeepReduceManager`.

Real torchft on the CPU: an in-process ``LighthouseServer``, two replica groups of one
rank each played by threads (as torchft's own integration tests do), each with its own
TCPStore, ``Manager`` and gloo process group. Runs in ``make test-torchft``'s venv;
elsewhere (no torchft) the module skips.
"""

import doctest
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest

torchft = pytest.importorskip("torchft")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchft.coordination import LighthouseServer  # noqa: E402
from torchft.local_sgd import DiLoCo, LocalSGD  # noqa: E402
from torchft.manager import Manager  # noqa: E402
from torchft.process_group import ProcessGroupGloo  # noqa: E402

import deepreduce.torch.torchft as drft  # noqa: E402
from deepreduce.config import ExchangeConfig  # noqa: E402

OUTER_STEPS, SYNC_EVERY = 3, 4


class CountingGloo(ProcessGroupGloo):
    """torchft's gloo process group, counting the bytes this replica hands to it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bytes_sent = 0

    def allgather(self, output_tensors, input_tensor, opts):
        self.bytes_sent += sum(t.numel() * t.element_size() for t in input_tensor)
        return super().allgather(output_tensors, input_tensor, opts)

    def allreduce(self, tensors, opts):
        self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)
        return super().allreduce(tensors, opts)


def small_model():
    """A fresh copy of one model, the same start on every replica (the initial weights
    are drawn once: the replicas' threads share torch's global generator)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(),
                                torch.nn.Linear(128, 64))
    model.load_state_dict(INITIAL)
    return model


torch.manual_seed(0)
INITIAL = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(),
                              torch.nn.Linear(128, 64)).state_dict()
DENSE_BYTES = 4 * sum(p.numel() for p in small_model().parameters())


def replica(replica_id, lighthouse, settings, outer_steps=OUTER_STEPS, min_replicas=2,
            gloo_timeout=10, lost_at=None, poisoned_at=None, started=None, local_sgd=False,
            streaming=False):
    """One replica group: DiLoCo (AdamW inside, Nesterov SGD outside) until the manager
    has committed ``outer_steps``, with its manager wrapped by deepreduce unless
    ``settings`` is None. Returns the final parameters, the wrapper (or None), the
    bytes the replica handed to its process group, and its commits (each outer step's
    verdict and the residuals after it). ``lost_at``: the replica dies at the start of
    that outer step's exchange, after the quorum that counts it in. ``started``: a
    barrier the replicas meet at once their managers heartbeat, so that the first quorum
    counts them all. ``poisoned_at``: that outer step's first pseudo-gradient holds a NaN.
    ``local_sgd``: torchft's LocalSGD instead, which averages the parameters themselves.
    ``streaming``: Streaming DiLoCo, the two layers as fragments synced in turn, each
    exchange waited for one inner step later (``fragment_sync_delay=1``)."""
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    model = small_model()
    pg = CountingGloo(timeout=timedelta(seconds=gloo_timeout))
    manager = Manager(pg=pg, min_replica_size=min_replicas, use_async_quorum=False,
                      load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                      replica_id=str(replica_id), store_addr="localhost", store_port=store.port,
                      rank=0, world_size=1, lighthouse_addr=lighthouse.address(),
                      timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=20),
                      connect_timeout=timedelta(seconds=10),
                      # the replicas start alike (small_model): no heal at step 0, whose
                      # source (and so the result) would depend on timing
                      init_sync=False)
    compressed = None if settings is None else drft.DeepReduceManager(manager, **settings)
    if started is not None:
        started.wait()
        time.sleep(0.3)  # a few heartbeats (every 100 ms) reach the lighthouse
    commits = []
    outermost = compressed or manager
    should_commit = outermost.should_commit

    def recording(timeout=None):  # each outer step's verdict, and the residuals after it
        committed = should_commit(timeout=timeout)
        commits.append((committed, compressed and compressed.state_dict()["residuals"]))
        return committed
    outermost.should_commit = recording
    if compressed is not None:
        allreduce = compressed.allreduce

        def dying(tensor, *args, **kwargs):
            if manager.current_step() == lost_at:
                raise RuntimeError(f"replica {replica_id} lost")
            if manager.current_step() == poisoned_at and compressed._position == 0:
                tensor.view(-1)[0] = float("nan")
            return allreduce(tensor, *args, **kwargs)
        compressed.allreduce = dying
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    fragments = [model[0], model[2]] if streaming else [model]
    outer = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True)
             for f in fragments]
    data = torch.Generator().manual_seed(100 + replica_id)  # each replica its own batches
    target = torch.randn(64, 64, generator=torch.Generator().manual_seed(7))
    try:
        with (LocalSGD(outermost, model, inner, sync_every=SYNC_EVERY) if local_sgd else
              DiLoCo(outermost, fragments, inner, outer, sync_every=SYNC_EVERY, pin_memory=False,
                     fragment_sync_delay=int(streaming))):
            for _ in range(4 * outer_steps * SYNC_EVERY):  # (a loop that never commits ends)
                if manager.current_step() >= outer_steps:
                    break
                x = torch.randn(16, 64, generator=data)
                loss = (model(x) - x @ target).square().mean()
                inner.zero_grad()
                loss.backward()
                inner.step()
    finally:
        manager.shutdown(wait=False)
    return [p.detach().clone() for p in model.parameters()], compressed, pg.bytes_sent, commits


def run_replicas(settings, replicas=2, **options):
    """``replica`` on ``replicas`` threads around one lighthouse; their results in order.
    ``settings`` is one dict for all, or a list of one per replica."""
    per_replica = settings if isinstance(settings, list) else [settings] * replicas
    poisoned = options.pop("poisoned_at", [None] * replicas)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=options.get("min_replicas", 2),
                                  join_timeout_ms=500, heartbeat_timeout_ms=1000)
    try:
        with ThreadPoolExecutor(replicas) as pool:
            futures = [pool.submit(replica, r, lighthouse, per_replica[r],
                                   poisoned_at=poisoned[r], **options)
                       for r in range(replicas)]
            return [f.result(timeout=120) for f in futures]
    finally:
        lighthouse.shutdown()


def test_diloco_through_deepreduce_keeps_replicas_identical_and_sends_compressed_bytes():
    (params0, ex0, sent0, commits0), (params1, ex1, sent1, _) = run_replicas({})
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)
    assert [committed for committed, _ in commits0] == [True] * OUTER_STEPS
    assert not all(torch.equal(a, b) for a, b in zip(params0, small_model().parameters()))
    # what went to the process group: each outer step's bundle, its lengths, the
    # all-finite byte and the settings once; SparseLoCo's 64 of 4096 at 2 bits
    total = ex0.stats.total
    assert total.steps == OUTER_STEPS and total.dense_bytes == OUTER_STEPS * DENSE_BYTES
    assert total.compressed_tensors == 4 * OUTER_STEPS   # min_size 0: the biases chunk-wise too
    assert sent0 < DENSE_BYTES * OUTER_STEPS / 20
    assert total.bytes_sent <= sent0 <= total.bytes_sent + OUTER_STEPS * 200 + 400
    # every tensor's residual is kept, under a stable name, and decays by 0.95
    assert set(ex0.state_dict()["residuals"]) == {f"fragment0.tensor{i}" for i in range(4)}
    assert ex0.exchange.selector.memory.beta == 0.95


def test_lossless_settings_give_torchft_allreduce_result():
    ours = run_replicas({"sparsifier": None, "value": "raw"})
    theirs = run_replicas(None)
    for (params, _, sent, commits), (reference, _, dense_sent, their_commits) in zip(ours, theirs):
        assert [c for c, _ in commits] == [c for c, _ in their_commits] == [True] * OUTER_STEPS
        for a, b in zip(params, reference):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        assert dense_sent == OUTER_STEPS * DENSE_BYTES   # torchft's allreduce: every float
        assert sent > dense_sent                         # raw values and indices: more


def test_streaming_diloco_keeps_each_fragments_residuals_apart():
    lossless = {"sparsifier": None, "value": "raw", "fragments": 2}
    ours = run_replicas(lossless, streaming=True, outer_steps=4)
    theirs = run_replicas(None, streaming=True, outer_steps=4)
    for (params, _, _, _), (reference, _, _, _) in zip(ours, theirs):
        for a, b in zip(params, reference):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    (params0, compressed, _, _), (params1, _, _, _) = run_replicas(
        {"fragments": 2}, streaming=True, outer_steps=4)
    # the fragment synced last (outer step 4: fragment 1, the second layer) is the same on
    # both replicas; the other has trained on alone since its sync
    assert all(torch.equal(a, b) for a, b in zip(params0[2:], params1[2:]))
    assert not torch.equal(params0[0], params1[0])
    assert set(compressed.state_dict()["residuals"]) == {
        f"fragment{f}.tensor{i}" for f in (0, 1) for i in (0, 1)}
    with pytest.raises(ValueError, match="fragments=len"):   # fragment 1 under 0's names
        run_replicas({}, streaming=True, outer_steps=2)


def test_local_sgd_averages_the_parameters_as_torchft_does():
    # LocalSGD sends the parameters themselves: only settings that lose nothing fit
    lossless = {"sparsifier": None, "value": "raw", "error_feedback": False}
    ours = run_replicas(lossless, local_sgd=True)
    theirs = run_replicas(None, local_sgd=True)
    assert torch.equal(ours[0][0][0], ours[1][0][0])
    for (params, _, _, _), (reference, _, _, _) in zip(ours, theirs):
        for a, b in zip(params, reference):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_replica_that_drops_fails_one_outer_step_then_training_goes_on():
    # the lighthouse lets one replica go on alone; replica 1 dies inside outer step 2
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000,
                                  heartbeat_timeout_ms=1000)
    try:
        started = threading.Barrier(2)
        with ThreadPoolExecutor(2) as pool:
            survivor = pool.submit(replica, 0, lighthouse, {}, min_replicas=1, gloo_timeout=3,
                                   started=started)
            dropped = pool.submit(replica, 1, lighthouse, {}, min_replicas=1, gloo_timeout=3,
                                  lost_at=1, started=started)
            with pytest.raises(RuntimeError, match="replica 1 lost"):
                dropped.result(timeout=120)
            params, compressed, _, commits = survivor.result(timeout=120)
    finally:
        lighthouse.shutdown()
    verdicts = [committed for committed, _ in commits]
    assert verdicts[0] is True and verdicts[-1] is True and False in verdicts
    assert verdicts.count(True) == OUTER_STEPS
    assert all(torch.isfinite(p).all() for p in params)
    # a discarded outer step owes nothing later: its residuals are the last commit's
    for i, (committed, residuals) in enumerate(commits):
        if not committed:
            before = commits[i - 1][1]
            assert residuals.keys() == before.keys()
            assert all(torch.equal(residuals[k], before[k]) for k in before)


def test_a_non_finite_pseudo_gradient_travels_exact_and_leaves_the_residuals():
    (params0, ex0, _, commits0), (params1, ex1, _, commits1) = run_replicas(
        [{}, {}], outer_steps=2, poisoned_at=[None, 1])
    for ex, commits in ((ex0, commits0), (ex1, commits1)):
        assert ex.stats.total.nonfinite_steps == 1    # the second outer step, on both
        (_, before), (_, after) = commits
        assert all(torch.equal(after[k], before[k]) for k in before)
    # as torchft's allreduce would: the NaN reaches both replicas' parameters
    assert torch.isnan(params0[0]).any() and torch.isnan(params1[0]).any()
    assert torch.isnan(params0[0]).sum() == torch.isnan(params1[0]).sum()


def test_settings_that_differ_between_replicas_fail_on_both():
    with pytest.raises(ValueError, match="disagree.*value"):
        run_replicas([{"value": "statq:bits=2"}, {"value": "statq:bits=4"}])


def test_checkpoint_of_the_residuals_continues_exactly():
    (_, compressed, _, _), = run_replicas({}, replicas=1, min_replicas=1, outer_steps=2)
    state = compressed.state_dict()
    assert state["residuals"] and all(r.abs().sum() > 0 for r in state["residuals"].values())
    fresh = drft.DeepReduceManager(compressed.manager)
    fresh.load_state_dict(state)
    again = fresh.state_dict()
    assert all(torch.equal(again["residuals"][k], v) for k, v in state["residuals"].items())
    other = drft.DeepReduceManager(compressed.manager, value="statq:bits=4")
    with pytest.raises(ValueError, match="other settings: value"):
        other.load_state_dict(state)


def test_settings_are_the_exchange_configs():
    (_, compressed, _, _), = run_replicas(
        {"error_feedback": 0.9, "min_size": 1024}, replicas=1,
        min_replicas=1, outer_steps=1)
    assert compressed.exchange.selector.memory.beta == 0.9
    assert compressed.stats.total.compressed_tensors == 2   # the biases travel exact
    # the same as OuterOptimizer's mode="sparseloco"
    assert drft.DeepReduceManager(compressed.manager).config == ExchangeConfig.sparseloco()
    halved = drft.DeepReduceManager(compressed.manager, error_feedback=0.5)
    assert halved.exchange.selector.memory.beta == 0.5
    # the decay is a setting every replica compares and every checkpoint carries
    assert compressed.settings["error_feedback"] == 0.9 and halved.settings["error_feedback"] == 0.5
    with pytest.raises(ValueError, match="error_feedback 0.9 there, 0.5 here"):
        halved.load_state_dict(compressed.state_dict())
    assert drft.DeepReduceManager(compressed.manager, timeout=30).timeout == timedelta(seconds=30)
    for wrong, message in [({"communicator": "sparse_allreduce"}, "allgather"),
                           ({"fragments": 0}, "fragments must be an integer >= 1"),
                           ({"timeout": "30s"}, "timeout must be a datetime.timedelta"),
                           ({"process_group": "gloo"}, "process_group must be a torch"),
                           ({"check_finite": "no"}, "check_finite must be True or False"),
                           ({"error_feedback": 1.5}, "error_feedback must be a decay")]:
        with pytest.raises(ValueError, match=message):
            drft.DeepReduceManager(compressed.manager, **wrong)


def test_docstring_examples():
    result = doctest.testmod(drft, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0
