"""deepreduce.torch.fsdp: FSDP2's replica exchange (HSDP), compressed.

The multi-rank checks run on four real gloo ranks, 2 replicas x 2 shards (spawned
processes, see tests/fsdp_workers.py); the rest on one process.
"""

import doctest
import json
import os
import pickle
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.fsdp")

import deepreduce as dr  # noqa: E402
from deepreduce.torch import fsdp  # noqa: E402
from conftest import HERE, findings, free_port, run_ranks, torchrun_example  # noqa: E402


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """Findings of tests/fsdp_workers.py's checks on four gloo ranks."""
    return run_ranks("fsdp_workers.py", tmp_path_factory.mktemp("fsdp_ranks"), 4)


def test_lossless_settings_give_the_mean_of_all_ranks(four_ranks):
    for found in findings(four_ranks, "check_lossless"):
        # bit for bit FSDP2's own 2-D HSDP; an unsharded DDP model to float rounding
        assert found["equals_native_hsdp"] is True
        assert found["close_to_unsharded"] and found["native_close_to_unsharded"]
        # 5 steps, 2 before start_iter; per step the two weight shards >= min_size
        assert found["iter"] == 5 and found["compressed"] == 6
        assert found["units"] == ["0", "2", "4"]
        assert found["sparse_allreduce"] is True and found["block"] is True


def test_a_unit_with_parameters_left_out_goes_as_one_piece(four_ranks):
    for found in findings(four_ranks, "check_unused_parameters"):
        # steps 0 and 2: six parameter shards each; steps 1 and 3: one piece each
        assert found == {"equals_native_hsdp": True, "tensors": 14}


def test_compressed_settings_train_and_error_feedback_loses_nothing(four_ranks):
    for found in findings(four_ranks, "check_compressed_trains"):
        assert found["last"] < 0.3 * found["first"]
        assert found["last"] < 2 * found["native_last"]
        assert found["ratio"] > 4 and found["iter"] == 30
        # the stats count what the transport was handed; the frames' length headers and
        # slots at most an eighth above the longest recent bundle of the same unit
        # (slots sized by the largest unit doubled the bytes)
        assert found["handed_over_stats"] == 1.0
        assert 1 < found["handed_over_bundles"] < 1.2
        assert found["conserved"] is True
        # over five steps too: one residual per parameter shard, kept from step to step
        assert found["conserved_over_steps"] is True and found["residual_keys"] is True
        assert found["ef_iter"] == 5
        # Top-100% + raw values through the compressed path: FSDP2's HSDP bit for bit
        assert found["top100_equals_native_hsdp"] is True


def test_device_path_trains_as_the_numpy_path_and_moves_only_pairs(four_ranks):
    for found in findings(four_ranks, "check_device_path"):
        assert found["identical"] is True
        assert 0 < found["crossed"] <= found["bound"] < found["dense"]


def test_outer_steps_over_fsdp2_workers_equal_unsharded_ones_sending_half(four_ranks):
    for found in findings(four_ranks, "check_outer_over_shards"):
        # 128 x 128 weights on 2 shards: 64 rows each, SparseLoCo's 64 x 64 tiles whole
        assert found["local_shapes"] == [[64, 128], [64, 128]]
        assert found["outer_steps"] == 3 and found["identical"] == [True, True, True]
        assert 0.5 <= found["sent_share"] < 0.55     # 1/L of the bundle, and its header


def test_mixed_precision_bf16_parameters_any_reduce_dtype(four_ranks):
    for found in findings(four_ranks, "check_mixed_precision"):
        assert found == {"torch.bfloat16": True, "torch.float16": True, "torch.float32": True}


def test_a_nonfinite_step_is_shared_exact_and_forgotten(four_ranks):
    for found in findings(four_ranks, "check_nonfinite"):
        # an inf in rank 3's input reaches every rank; skipping it leaves no trace
        assert found == {"skipped_here": True, "residuals_kept": True, "identical": True,
                         "iter": 6, "nonfinite_iters": 1}


def test_settings_that_differ_raise_on_every_rank_naming_them(four_ranks):
    for rank, found in enumerate(findings(four_ranks, "check_misconfigured")):
        assert found["raised"] is True
        assert "start_iter: 3 on rank 0; 4 on rank 1; 5 on rank 2; 6 on rank 3" \
            in found["message"]
        # the last layer's unit reduces first
        assert f"rank {rank}, module '4'" in " ".join(found["notes"])


def test_replicas_of_another_layout_raise_naming_the_module(four_ranks):
    for rank, found in enumerate(findings(four_ranks, "check_other_layout")):
        assert found["raised"] is True
        # the ranks of this rank's replicate group (global), each with its version
        a, b = rank % 2, rank % 2 + 2
        assert found["message"].startswith("the replicas hold other layouts: module 0: ")
        assert f"0.weight[150, 32]/4800, 0.bias[150]/150 on rank {a}; " \
               f"0.weight[151, 32]/4832, 0.bias[151]/151 on rank {b}" in found["message"]


def test_refuses_native_hsdp_and_unsharded_models(four_ranks):
    for found in findings(four_ranks, "check_refusals"):
        assert "2-D mesh" in found["native_hsdp"] and "mesh['shard']" in found["native_hsdp"]
        assert "no FSDP module" in found["unsharded"]


def launch(out, *checks, env=None):
    """The findings of ``checks`` in one launch of four new processes: ``{check: [...]}``."""
    subprocess.run([sys.executable, os.path.join(HERE, "fsdp_workers.py"), str(out),
                    str(free_port()), *checks], check=True, timeout=600,
                   env={**os.environ, **(env or {})})
    found = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    return {check: [rank[check] for rank in found] for check in found[0]}


def test_dcp_checkpoint_continues_bit_for_bit_in_new_processes(tmp_path):
    env = {"FSDP_CHECKPOINT": str(tmp_path)}
    saved = launch(tmp_path, "check_checkpoint_save", "check_outer_checkpoint_save", env=env)
    for found in findings(saved, "check_checkpoint_save"):
        # 4 steps, 2 of them compressed; residuals of the two weight shards
        assert found == {"iter": 4, "residuals": 2}
    loaded = launch(tmp_path, "check_checkpoint_load", "check_outer_checkpoint_load", env=env)
    for rank, found in enumerate(findings(loaded, "check_checkpoint_load")):
        assert found["iter"] == 4 and found["residuals"] == 2
        assert found["identical"] is True
        assert found["other_settings"].startswith(
            "the checkpoint was written with other settings: value "
            "\"QSGDValues(bits=8, bucket=512, norm='max')\" there, 'Float16Values()' here")
        layout = found["other_layout"]
        assert layout.startswith("the checkpoint was written with another layout: "
                                 "replicas '2' there, '1' here; shard ")
        assert f"'{rank % 2} of 2' there, '{rank} of 4' here" in layout
    # DiLoCo over FSDP2 workers: one checkpoint per worker, its outer state per rank
    for found in findings(saved, "check_outer_checkpoint_save"):
        assert found == {"outer_steps": 2}
    for found in findings(loaded, "check_outer_checkpoint_load"):
        assert found == {"outer_identical": True, "outer_resumed_at": 2, "outer_residuals": 6}


def test_a_replica_that_dies_fails_the_hook_naming_rank_module_and_collective(tmp_path):
    # rank 2 leaves mid-run; the launch's exit status says so, rank 0's file what it saw
    subprocess.run([sys.executable, os.path.join(HERE, "fsdp_workers.py"), str(tmp_path),
                    str(free_port()), "check_peer_dies"], timeout=300, check=False,
                   capture_output=True)
    found = json.loads((tmp_path / "rank0.json").read_text())["check_peer_dies"]
    assert found["step"] == 2 and found["type"] == "HookError", found
    assert found["message"].startswith("deepreduce FSDP hook, rank 0, module '4', allgather "
                                       "of 'bundles (2 tensors from 4.weight) of module 4 "
                                       "(state 0)' failed: ")


def test_example_trains_on_four_ranks_under_torchrun():
    # as docs/fsdp.md launches it: torchrun --nproc-per-node=4 examples/fsdp_hsdp.py
    lines = torchrun_example("fsdp_hsdp.py", 4, "--steps", "30")
    losses = [float(line.split()[-1]) for line in lines if line.startswith("step")]
    assert len(losses) == 5 and losses[-1] < losses[0] / 2      # it learns
    last = lines[-1]
    assert last.startswith("between replicas: deepreduce") and "FSDP2's HSDP 593,924" in last
    assert float(last.split("(")[1].split("x")[0]) > 20          # bytes per step below dense


# ------------------------------------------------------------------ one process

def test_docstring_examples():
    result = doctest.testmod(fsdp, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted and result.failed == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"value": "nosuchcodec"}, "nosuchcodec"),
    ({"start_iter": -1}, "start_iter"),
    ({"communicator": "ring"}, "communicator"),
])
def test_bad_settings_fail_when_the_state_is_built(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fsdp.ReplicaExchangeState(**kwargs)


def test_state_is_built_before_the_process_group_and_pickles_without_it():
    state = fsdp.ReplicaExchangeState(None, sparsifier=dr.TopK(0.05), start_iter=3)
    restored = pickle.loads(pickle.dumps(state))
    assert restored.start_iter == 3 and restored.process_group is None
    assert restored.settings == state.settings and restored.units == []
