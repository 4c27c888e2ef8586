"""deepreduce.torch: the DDP hook, allreduce and the torch.distributed transport.

The multi-rank checks run on two real gloo ranks (spawned processes, see
tests/torch_workers.py); the rest on one process.
"""

import doctest
import gc
import json
import os
import pickle
import re
import subprocess
import sys
import time
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import deepreduce as dr  # noqa: E402
import deepreduce.torch as drt  # noqa: E402
from deepreduce.collectives import Traffic  # noqa: E402
from deepreduce.torch import transport as transport_module  # noqa: E402
from deepreduce.torch import ddp  # noqa: E402
from conftest import findings, free_port, run_ranks, torchrun_example  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Findings of tests/torch_workers.py on two gloo ranks: ``{check: [rank0, rank1]}``."""
    return run_ranks("torch_workers.py", tmp_path_factory.mktemp("torch_ranks"), 2)


def test_lossless_hook_equals_ddp_allreduce_for_every_communicator(two_ranks):
    for found in findings(two_ranks, "check_lossless"):
        for communicator in ("allgather", "sparse_allreduce", "block"):
            assert found[communicator] is True, communicator
            # 6 iterations, 2 before start_iter, 3 parameters of >= min_size each
            assert found[f"{communicator}_compressed"] == 12


def test_topk_error_feedback_conserves_the_gradient_sum(two_ranks):
    for found in findings(two_ranks, "check_error_feedback"):
        assert found == {"conserved": True, "sparse": True}


def test_hook_trains_alike_whether_gradients_are_bucket_views_or_not(two_ranks):
    for found in findings(two_ranks, "check_gradient_layouts"):
        assert found["identical"] is True
        # a result tensor of its own per bucket, none when .grad views the bucket
        assert found["kept"] > 1 and found["kept_with_views"] == 0


def test_device_path_trains_as_the_numpy_path_and_moves_only_pairs(two_ranks):
    for found in findings(two_ranks, "check_device_path"):
        assert found["device_plain"] and found["device_views"] and found["device_static"]
        assert 0 < found["crossed"] <= found["bound"] < found["dense"]


def test_resume_from_checkpoint_equals_uninterrupted_run(two_ranks):
    for found in findings(two_ranks, "check_resume"):
        assert found == {"identical": True, "iter": 10, "pickled_group": True,
                         "pickled_residuals": 3, "device_identical": True,
                         "device_residuals": 3}


def test_allreduce_dense_and_sparse_coo_every_communicator(two_ranks):
    for found in findings(two_ranks, "check_allreduce"):
        assert found and all(found.values()), found


def test_transport_moves_frames_of_any_length(two_ranks):
    rank0, rank1 = findings(two_ranks, "check_transport")
    # rank r sends bytes([r]) * (3 * peer + r) to each peer; its own slot stays b""
    assert rank0["alltoall"] == ["", "01"] and rank1["alltoall"] == ["000000", ""]
    assert rank0["allgather"] == rank1["allgather"] == ["", "07"]
    assert rank0["empty"] == rank1["empty"] == [0, 0]


def test_find_unused_parameters_trains_as_ddp_allreduce(two_ranks):
    # DDP's own bookkeeping allreduce on the model's group, from the autograd thread,
    # does not meet the hook's collectives: those run on groups of deepreduce's own
    for found in findings(two_ranks, "check_find_unused"):
        # 8 iterations, 2 before start_iter, 3 parameters of >= min_size each
        assert found == {"identical": True, "iter": 8, "compressed": 18, "own_groups": True}


def test_ranks_configured_differently_fail_everywhere_naming_the_difference(two_ranks):
    for found in findings(two_ranks, "check_misconfigured"):
        assert found["raised"] is True
        assert "start_iter: 3 on rank 0; 4 on rank 1" in found["message"]


# ------------------------------------------------------------------ one process
# (world_of_one: a gloo group of this process alone, from conftest.py)

def test_docstring_examples():
    result = doctest.testmod(ddp, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted and result.failed == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"value": "nosuchcodec"}, "nosuchcodec"),
    ({"sparsifier": "topk:1.5"}, "ratio"),
    ({"communicator": "ring"}, "communicator"),
    ({"start_iter": -1}, "start_iter"),
    ({"min_compression_rate": float("nan")}, "min_compression_rate"),
])
def test_bad_settings_fail_when_the_state_is_built(kwargs, message):
    # no process group exists: the settings are checked before any collective
    with pytest.raises(ValueError, match=message):
        drt.DeepReduceState(**kwargs)


def test_state_binds_its_group_late():
    # built before init_process_group, as Lightning's DDPStrategy builds it; the group
    # is looked up when the state is first used
    state = drt.DeepReduceState(process_group=None)
    with pytest.raises(RuntimeError, match="init_process_group"):
        state.transport


def test_a_destroyed_group_is_not_kept_alive():
    # a group that outlives destroy_process_group is destroyed at interpreter exit,
    # when gloo's threads can no longer take the GIL to free their tensors: the
    # process then aborts ("terminate called without an active exception")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    group = weakref.ref(dist.group.WORLD)
    state = drt.DeepReduceState(sparsifier=None, index="varint", value="raw", start_iter=0)
    total = drt.allreduce(torch.ones(10), state, op="sum")
    transport = state.transport
    dist.destroy_process_group()
    gc.collect()
    assert torch.equal(total, torch.ones(10)) and group() is None
    with pytest.raises(RuntimeError, match="destroyed"):
        transport.allgather(b"frame", Traffic(), "test")


@pytest.mark.timing
def test_exit_waits_until_no_collective_holds_the_last_tensors(world_of_one):
    # A gloo thread that drops the last reference to a Python-made tensor takes the
    # GIL to free it; while the interpreter finalises that aborts the process
    # (pytorch/pytorch#179291). The transport keeps the last collective's tensors,
    # and at exit waits until it holds the last reference to each of them.
    transport = drt.transport_of()
    transport.allgather(b"frame", Traffic(), "test")
    held = transport._held
    # gloo's thread lets go of them just after the collective returns, not before
    transport._wait_until_released(time.monotonic() + 10)
    assert held and all(t._use_count() == 1 for t in held)
    other_owner = torch.ones(held[0].shape, requires_grad=True) * held[0]  # saves it
    assert held[0]._use_count() == 2
    start = time.monotonic()
    transport_module._release_at_exit(timeout=0.2)
    assert time.monotonic() - start >= 0.2    # waited for the other owner, then gave up
    del other_owner
    start = time.monotonic()
    transport_module._release_at_exit(timeout=30)
    assert time.monotonic() - start < 5       # nothing else holds them: no wait
    assert transport in transport_module._WITH_HELD_TENSORS


def test_non_float_tensors_are_refused(world_of_one):
    state = drt.DeepReduceState()
    with pytest.raises(TypeError, match="floating-point"):
        drt.allreduce(torch.arange(10), state)


def test_a_failed_collective_reaches_backward_named_and_chained(world_of_one, monkeypatch):
    # DDP casts the value of the hook's future to a tensor in C++: an exception set with
    # Future.set_exception arrived as "Unable to cast <its message> to Tensor"
    state = drt.DeepReduceState(sparsifier=dr.TopK(0.1), start_iter=0, min_compression_rate=0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    model.register_comm_hook(state, drt.deepreduce_hook)
    transport = state.transport

    def broken(frame, traffic, stage):
        raise RuntimeError(f"gloo says no ({stage})")
    monkeypatch.setattr(transport, "_allgather", broken)
    with pytest.raises(transport_module.CollectiveError) as raised:
        model(torch.ones(2, 64)).sum().backward()
    assert str(raised.value) == ("deepreduce hook, rank 0, bucket 0, allgather of 'settings' "
                                 "failed: gloo says no (settings)")
    assert raised.value.bucket == 0 and raised.value.what == "allgather of 'settings'"
    transport_error = raised.value.__cause__     # the transport's, and torch's under it
    assert str(transport_error) == "rank 0, allgather of 'settings' failed: gloo says no " \
        "(settings)"
    assert str(transport_error.__cause__) == "gloo says no (settings)"
    # without DDP: the transport's error, from the future's wait()
    with pytest.raises(transport_module.CollectiveError, match="^rank 0, allgather of 'settings"):
        drt.allreduce(torch.ones(10), drt.DeepReduceState(sparsifier=None, value="raw"))


@pytest.mark.parametrize("check_finite, collective", [
    # on the transport's thread (its stage names the bucket's tensors)
    (False, r"allgather of 'bundles \(\d+ tensors from [\d.]+\)'"),
    (True, "allreduce of the all-finite flag"),  # on the autograd thread
])
def test_a_dead_peer_fails_the_hook_naming_rank_bucket_and_collective(tmp_path, check_finite,
                                                                       collective):
    # rank 1 dies after two steps; rank 0's next backward pass raises at once
    subprocess.run([sys.executable, os.path.join(HERE, "torch_failure_worker.py"),
                    str(tmp_path), str(free_port()), str(int(check_finite))],
                   check=True, timeout=180)
    found = json.loads((tmp_path / "rank0.json").read_text())
    assert found["raised"] is True and found["type"] == "CollectiveError", found
    assert re.match(f"deepreduce hook, rank 0, bucket {found['first_bucket']}, {collective} "
                    "failed: ", found["message"]), found["message"]
    assert found["bucket"] == found["first_bucket"]
    # gloo's own message, chained under the transport's error
    assert re.match(f"CollectiveError: rank 0, {collective} failed: ", found["causes"][0])
    assert found["causes"][-1].split(":")[0] in ("RuntimeError", "DistBackendError",
                                                 "DistNetworkError")
    assert found["causes"][-1].split(": ", 1)[1] in found["message"]


def test_one_rank_hook_matches_plain_training(world_of_one):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Linear(64, 3))
    reference = pickle.loads(pickle.dumps(net))
    model = torch.nn.parallel.DistributedDataParallel(net)
    state = drt.DeepReduceState(sparsifier=None, value="raw", start_iter=1, min_size=0,
                                min_compression_rate=0)
    model.register_comm_hook(state, drt.deepreduce_hook)
    x = torch.randn(8, 20)
    for module in (model, reference):
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            module(x).square().mean().backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), reference.parameters()))
    assert state.iter == 3 and state.stats.total.compressed_tensors == 8  # 4 params x 2


def test_min_compression_rate_sends_incompressible_buckets_as_allreduce(world_of_one):
    net = torch.nn.Linear(64, 64)
    model = torch.nn.parallel.DistributedDataParallel(net)
    # every non-zero with raw values: no smaller than dense, so never worth it
    state = drt.DeepReduceState(sparsifier=None, value="raw", start_iter=0,
                                min_compression_rate=1.5)
    model.register_comm_hook(state, drt.deepreduce_hook)
    model(torch.ones(2, 64)).sum().backward()
    assert state.stats.total.compressed_tensors == 0 and state.stats.total.steps == 1


def test_state_dict_round_trip_and_settings_check(world_of_one):
    state = drt.DeepReduceState(sparsifier=dr.TopK(0.1), start_iter=0)
    x = torch.randn(4096)
    drt.allreduce(x, state, name="w")
    saved = state.state_dict()
    assert set(saved["residuals"]) == {"w"} and saved["iter"] == 0
    other = drt.DeepReduceState(sparsifier=dr.TopK(0.1), start_iter=0)
    other.load_state_dict(saved)
    assert np.array_equal(other.exchange.selector.memory.residual("w"), saved["residuals"]["w"].numpy())
    with pytest.raises(ValueError, match="start_iter"):
        drt.DeepReduceState(sparsifier=dr.TopK(0.1), start_iter=5).load_state_dict(saved)
    # each rank's link bandwidth steers only its own encoder: not a shared setting
    assert saved["settings"]["index"] == "AutoIndices()"  # as written before link_gbits
    drt.DeepReduceState(sparsifier=dr.TopK(0.1), start_iter=0,
                        index="auto:link_gbits=10").load_state_dict(saved)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="NCCL needs two CUDA devices")
def test_nccl_transport_moves_frames_between_gpus(tmp_path):  # pragma: no cover - no GPU here
    env = {**os.environ, "DEEPREDUCE_TEST_BACKEND": "nccl"}
    subprocess.run([sys.executable, os.path.join(HERE, "torch_workers.py"), str(tmp_path),
                    str(free_port())], check=True, env=env, timeout=600)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text())["check_transport"]
                    for r in range(2))
    assert rank0["device"].startswith("cuda") and rank1["device"].startswith("cuda")
    assert rank0["alltoall"] == ["", "01"] and rank1["alltoall"] == ["000000", ""]
    assert rank0["allgather"] == rank1["allgather"] == ["", "07"]


def test_example_script_trains_on_two_ranks_under_torchrun():
    # as the README launches it: torchrun --nproc-per-node=2 examples/torch_ddp.py
    lines = torchrun_example("torch_ddp.py", 2, "--steps", "30")
    losses = [float(line.split()[-1]) for line in lines if line.startswith("step")]
    assert len(losses) == 5 and losses[-1] < losses[0] / 2      # it learns
    assert lines[-1].startswith("deepreduce:") and "x fewer" in lines[-1]
    assert float(lines[-1].split("(")[1].split("x")[0]) > 20     # bytes per step below dense


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_hook_and_allreduce_take_every_float_dtype(world_of_one, dtype):
    if dtype == torch.bfloat16 and dr.sparse.BFLOAT16 is None:
        pytest.skip("bfloat16 needs ml_dtypes")
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 64).to(dtype)
    reference = pickle.loads(pickle.dumps(net))
    model = torch.nn.parallel.DistributedDataParallel(net)
    state = drt.DeepReduceState(sparsifier=dr.TopK(0.1), value="raw", start_iter=0,
                                min_compression_rate=0)
    model.register_comm_hook(state, drt.deepreduce_hook)
    x = torch.randn(2, 64, dtype=dtype)
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert net.weight.grad.dtype == dtype
    assert int((net.weight.grad != 0).sum()) == 410           # the Top-10% travelled
    assert torch.equal(net.bias.grad, reference.bias.grad)   # below min_size: all of it
    x = torch.randn(300, dtype=dtype)
    assert torch.equal(drt.allreduce(x, drt.DeepReduceState(sparsifier=None, value="raw")), x)


def test_seeds_may_differ_between_ranks_and_pickles_load_anywhere(world_of_one):
    states = [drt.DeepReduceState(sparsifier="randomk:0.01", value="qsgd:bits=4", seed=rank)
              for rank in range(2)]
    assert states[0].settings == states[1].settings
    assert repr(states[0].exchange.selector.pipeline.sparsifier) != \
        repr(states[1].exchange.selector.pipeline.sparsifier)
    restored = pickle.loads(pickle.dumps(states[0]))
    assert restored.process_group is None and restored._transport is None


def test_text_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "train_text.md"
    subprocess.run([sys.executable, "-m", "benchmarks.train_text", "--steps", "80", "--start-iter", "10",
                    "--text-bytes", "200000", "--out", str(out)], cwd=os.path.dirname(HERE), check=True,
                   timeout=600, capture_output=True)
    table = out.read_text()
    assert "| bytes fewer than dense | 1x |" in table and "Targets:" in table
    # the hook's step, broken down (issue 31 item 10)
    assert "hook's own work" in table and "| encode:" in table and "| the rest:" in table


def test_a_compressed_bucket_reaches_its_first_codec_in_few_frames(world_of_one):
    """The way down from the hook (issue 51: 14 project frames before; at most 9): the
    hook's steps, the exchange's entry, the strategy, the encoder, the pipeline, the
    codec; no layer that only forwards."""
    import inspect
    import threading
    from pathlib import Path

    root = Path(dr.__file__).resolve().parent.parent
    chains = []

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and not chains and code.co_name == "encode" \
                and "/codecs/" in code.co_filename:
            stack = [f.frame for f in inspect.getouterframes(frame)][::-1]
            names = [f.f_code.co_name for f in stack]
            if "_estimate" not in names and "deepreduce_hook" in names:
                chains.append([f for f in stack[names.index("deepreduce_hook"):]
                               if Path(f.f_code.co_filename).resolve().is_relative_to(root)])

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256))
    state = drt.DeepReduceState(sparsifier=dr.TopK(0.01), index="varint", value="fp16",
                                start_iter=0, device_path=False)
    model.register_comm_hook(state, drt.deepreduce_hook)
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        model(torch.randn(2, 256)).square().sum().backward()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    (chain,) = chains
    where = [f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}" for f in chain]
    assert where[0] == "ddp.py:deepreduce_hook" and where[-1] == "varint.py:encode"
    assert len(chain) <= 9, where
