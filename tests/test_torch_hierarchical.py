"""The hierarchical communicator on four gloo ranks as two nodes of two: the DDP hook,
drt.allreduce and TorchTransport.split (tests/torch_hierarchical_workers.py)."""

import pytest

from conftest import findings, run_ranks

pytest.importorskip("torch")

WORLD = 4


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """Findings of tests/torch_hierarchical_workers.py: ``{check: [rank 0, ..., rank 3]}``."""
    return run_ranks("torch_hierarchical_workers.py",
                     tmp_path_factory.mktemp("torch_hierarchical"), WORLD)


def test_split_makes_the_node_and_the_shard_groups(four_ranks):
    found = findings(four_ranks, "check_split")
    for rank, groups in enumerate(found):
        node, local = divmod(rank, 2)
        assert groups["intra"] == [local, 2, [f"{2 * node:02x}", f"{2 * node + 1:02x}"]]
        assert groups["inter"] == [node, 2, [f"{local:02x}", f"{local + 2:02x}"]]


def test_lossless_hook_equals_the_node_first_dense_allreduce_bit_for_bit(four_ranks):
    for found in findings(four_ranks, "check_lossless"):
        for inter in ("allgather", "sparse_allreduce", "block"):
            assert found[inter] == found["reference"], inter
            assert found[f"{inter}_compressed"] == 5 * 6  # 5 steps, 6 parameters
        # DDP's flat ring allreduce adds in another order: the same within rounding
        assert found["flat_max_difference"] < 1e-6


def test_topk_error_feedback_trains_and_every_rank_ends_alike(four_ranks):
    found = findings(four_ranks, "check_topk_trains")
    assert len({f["digest"] for f in found}) == 1
    for f in found:
        assert f["last"] < 0.8 * f["first"], f
        assert f["compressed"] == 40 * 2  # the two weight matrices' shards, 40 steps


def test_resume_from_checkpoint_equals_uninterrupted_run(four_ranks):
    for found in findings(four_ranks, "check_resume"):
        assert found["identical"] is True
        # residuals of each rank's shard: half of each weight matrix
        assert found["residual_shapes"] == {"0.0": [4800], "0.2": [30000]}


def test_allreduce_dense_and_sparse_coo(four_ranks):
    for found in findings(four_ranks, "check_allreduce"):
        assert found == {"dense": True, "sparse": True}


def test_ranks_configured_differently_fail_everywhere_naming_the_difference(four_ranks):
    for found in findings(four_ranks, "check_misconfigured"):
        assert found["raised"] is True
        assert "ranks disagree on the reduction: communicator_options:" in found["message"]
        assert "'local_size': 4" in found["message"] and "on rank 3" in found["message"]
