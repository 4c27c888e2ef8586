"""The DDP hook in the training loops people write: overflow steps, a NaN on one
rank, loss scaling (two gloo ranks, tests/torch_loop_workers.py), and what the
state does about them on one process."""

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deepreduce.torch as drt  # noqa: E402
from conftest import findings, run_ranks  # noqa: E402


@pytest.fixture(scope="module")
def loops(tmp_path_factory):
    """Findings of tests/torch_loop_workers.py: ``{check: [rank0, rank1]}``."""
    return run_ranks("torch_loop_workers.py", tmp_path_factory.mktemp("torch_loops"), 2)


def test_an_overflow_step_is_skipped_on_every_rank_and_leaves_no_trace(loops):
    for found in findings(loops, "check_overflow_step"):
        assert found["seen"] == [True] * 5 + [False] + [True] * 4
        assert found["clean_seen"] == [True] * 9
        assert found["same_params"] and found["same_state"]
        assert (found["iter"], found["nonfinite_iters"], found["nonfinite_steps"]) == (9, 1, 1)


def test_a_nan_on_one_rank_reaches_every_rank_as_ddp_would_give_it(loops):
    for found in findings(loops, "check_nan_on_one_rank"):
        assert found["seen"] == [True] * 5 + [False] + [True] * 4
        assert found["nonfinite_where_ddp"]
        assert found["same_params"] and found["same_state"]


def test_grad_scaler_keeps_its_scale_and_the_run_converges(loops):
    for found in findings(loops, "check_grad_scaler"):
        dense, hook, fp32 = found["ddp_fp16"], found["hook_fp16"], found["fp32"]
        assert abs(hook["skipped"] - dense["skipped"]) <= 1
        assert hook["nonfinite_iters"] == hook["skipped"]
        assert hook["scale"] >= dense["scale"] / 2
        assert hook["last_loss"] < 0.8 * hook["first_loss"]
        assert hook["last_loss"] <= 1.05 * fp32["last_loss"] + 0.02


# -- one process ------------------------------------------------------------------------

def _train_one_step(state, scale=1.0, steps=1):
    net = torch.nn.Linear(64, 64)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    ddp.register_comm_hook(state, drt.deepreduce_hook)
    for _ in range(steps):
        (ddp(torch.randn(4, 64)).square().sum() * scale).backward()
    return net


def test_rescale_multiplies_every_residual_exactly(world_of_one):
    state = drt.DeepReduceState(sparsifier="topk:0.1", value="fp16", start_iter=0)
    _train_one_step(state)
    memory = state.exchange.selector.memory
    before = {k: memory.residual(k).copy() for k in memory.names()}
    assert before
    state.rescale(0.5)
    for key, residual in before.items():
        np.testing.assert_array_equal(memory.residual(key), residual * np.float32(0.5))
    with pytest.raises(ValueError, match="finite number > 0"):
        state.rescale(0.0)


def test_the_state_follows_its_grad_scaler_and_checkpoints_the_scale(world_of_one):
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    state = drt.DeepReduceState(sparsifier="topk:0.1", value="fp16", start_iter=0,
                                grad_scaler=scaler)
    scaler.scale(torch.ones(()))  # (the scaler makes its scale tensor at first use)
    _train_one_step(state)
    memory = state.exchange.selector.memory
    before = {k: memory.residual(k).copy() for k in memory.names()}
    scaler.update(new_scale=256.0)     # as after two overflow steps
    net = torch.nn.Linear(64, 64)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    ddp.register_comm_hook(state, drt.deepreduce_hook)
    state.follow_loss_scale()           # what the next backward pass's first bucket does
    for key, residual in before.items():
        np.testing.assert_array_equal(memory.residual(key), residual / 4)
    assert state.state_dict()["loss_scale"] == 256.0
    restored = drt.DeepReduceState(sparsifier="topk:0.1", value="fp16", start_iter=0)
    restored.load_state_dict(state.state_dict())
    assert restored._loss_scale == 256.0


def test_a_non_finite_bucket_on_one_process_is_plain_allreduce(world_of_one):
    state = drt.DeepReduceState(sparsifier="topk:0.1", value="fp16", start_iter=0)
    _train_one_step(state)
    memory = state.exchange.selector.memory
    before = {k: memory.residual(k).copy() for k in memory.names()}
    random_state = state.exchange.selector.random_state()
    net = _train_one_step(state, scale=float("inf"))
    assert not torch.isfinite(net.weight.grad).all()
    assert state.iter == 1 and state.nonfinite_iters == 1
    assert state.stats.total.nonfinite_steps == 1
    assert state.exchange.selector.random_state() == random_state
    for key, residual in before.items():
        np.testing.assert_array_equal(memory.residual(key), residual)


def test_a_non_finite_bucket_without_grad_scaler_warns_once(world_of_one):
    state = drt.DeepReduceState(sparsifier="topk:0.1", value="fp16", start_iter=0)
    _train_one_step(state)
    with pytest.warns(RuntimeWarning, match=r"grad_scaler=scaler.*state\.rescale"):
        _train_one_step(state, scale=float("inf"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")        # once: no second warning
        _train_one_step(state, scale=float("inf"))
    # no warning where the scale is followed, or where there are no residuals to mix
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for quiet in (drt.DeepReduceState(sparsifier="topk:0.1", start_iter=0, grad_scaler=scaler),
                  drt.DeepReduceState(sparsifier="topk:0.1", start_iter=0, error_feedback=False)):
        scaler.scale(torch.ones(()))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _train_one_step(quiet, scale=float("inf"))
        assert quiet.nonfinite_iters == 1


def test_check_finite_off_is_part_of_the_settings(world_of_one):
    on = drt.DeepReduceState(start_iter=0)
    off = drt.DeepReduceState(start_iter=0, check_finite=False)
    with pytest.raises(ValueError, match="check_finite"):
        off.load_state_dict(on.state_dict())
    old = on.state_dict()
    del old["settings"]["check_finite"]   # a checkpoint from before the setting
    drt.DeepReduceState(start_iter=0).load_state_dict(old)


def test_allreduce_of_a_non_finite_tensor_is_exact_and_remembers_nothing(world_of_one):
    state = drt.DeepReduceState(sparsifier="topk:0.1", value="fp16")
    g = torch.randn(4096)
    drt.allreduce(g, state, name="g")
    residual = state.exchange.selector.memory.residual("g").copy()
    bad = g.clone()
    bad[3] = float("nan")
    reduced = drt.allreduce(bad, state, name="g")
    assert torch.equal(torch.isnan(reduced), torch.isnan(bad))
    assert torch.equal(reduced[~torch.isnan(bad)], bad[~torch.isnan(bad)])
    np.testing.assert_array_equal(state.exchange.selector.memory.residual("g"), residual)


def test_a_backward_pass_under_no_sync_leaves_the_residuals_alone(world_of_one):
    """What a GAN's generator step through the discriminator's DDP should be wrapped in:
    DDP then calls no hook, and its gradients, zeroed before the discriminator's own
    step, leave no trace in the residuals."""
    state = drt.DeepReduceState(sparsifier="topk:0.1", value="fp16", start_iter=0)
    net = torch.nn.Linear(64, 64)
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    ddp.register_comm_hook(state, drt.deepreduce_hook)
    ddp(torch.randn(4, 64)).square().sum().backward()
    memory = state.exchange.selector.memory
    before = {k: memory.residual(k).copy() for k in memory.names()}
    with ddp.no_sync():
        ddp(torch.randn(4, 64)).sum().backward()     # the discarded pass
    net.zero_grad()
    assert state.iter == 1 and state.stats.total.steps == 1
    for key, residual in before.items():
        np.testing.assert_array_equal(memory.residual(key), residual)
