"""deepreduce.torch.outer: DiLoCo and SparseLoCo outer steps.

The multi-rank checks run on real gloo ranks (spawned processes, tests/outer_workers.py):
two ranks for most, a second launch of new processes for the resumed run, four ranks
as two workers of two. The rest on one process.
"""

import doctest
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import deepreduce.torch.outer as outer_module  # noqa: E402
import deepreduce.torch.streaming as streaming_module  # noqa: E402
from deepreduce.config import ExchangeConfig  # noqa: E402
from deepreduce.torch.outer import OuterOptimizer  # noqa: E402
from conftest import findings, free_port, torchrun_example  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(out, ranks, *checks):
    """Findings of tests/outer_workers.py's ``checks`` on ``ranks`` gloo ranks."""
    subprocess.run([sys.executable, os.path.join(HERE, "outer_workers.py"), str(out),
                    str(free_port()), str(ranks), *checks], check=True, timeout=300)
    found = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    return {check: [rank[check] for rank in found] for check in found[0]}


@pytest.fixture(scope="module")
def ranks_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("outer_ranks")


@pytest.fixture(scope="module")
def two_ranks(ranks_folder):
    """One launch for the two-rank checks (and the first half of the resumed run, whose
    checkpoints stay in ``ranks_folder``)."""
    return launch(ranks_folder, 2, "check_identical", "check_dense_reference",
                  "check_sparseloco_reference", "check_mismatch", "check_synced_on_host",
                  "check_nonfinite", "check_overlap", "check_overlap_failure",
                  "check_fragments",
                  "check_resume_first")


def test_docstring_examples():
    for module in (outer_module, streaming_module):
        result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.attempted and result.failed == 0, module.__name__


def test_ranks_are_identical_after_every_outer_step_and_apart_in_between(two_ranks):
    rank0, rank1 = findings(two_ranks, "check_identical")
    assert rank0["synced"] == [False, False, True] * 3 and rank0["outer_steps"] == 3
    for a, b, synced in zip(rank0["digests"], rank1["digests"], rank0["synced"]):
        assert (a == b) == synced
    assert len(set(rank0["digests"])) == 9          # every step moved the parameters
    # the weights as 8 x 8 tiles with 4 kept in each, 2-bit values: about 6% of the bytes
    assert rank0["sent"] < rank0["dense"] / 8
    assert rank0["residuals"] == 4 and rank0["beta"] == 0.95


def test_dense_diloco_is_torch_sgd_nesterov_on_the_mean_pseudo_gradient(two_ranks):
    for found in findings(two_ranks, "check_dense_reference"):
        assert found["identical"] == [True] * 3, found["worst"]
        assert found["skipped"] == ["count"] and found["memory"] is True
        # the frozen parameter, moved by hand (+1 on rank 0, +2 on rank 1 each step),
        # is synced: the average of the ranks' drift, through Nesterov's outer step
        assert len(set(found["frozen"])) == 1 and found["frozen"][0] > 0
    assert [f["count"] for f in findings(two_ranks, "check_dense_reference")] == [[0], [1]]
    found = findings(two_ranks, "check_dense_reference")[0]
    # raw float32 values and indices of a full set: about the dense bytes
    assert found["dense"] <= found["sent"] < 1.1 * found["dense"] + 200


def test_sparseloco_is_error_feedback_topk_statq_and_a_plain_descent_step(two_ranks):
    for found in findings(two_ranks, "check_sparseloco_reference"):
        assert found["identical"] == [True] * 3, found["worst"]
        assert found["residuals_match"] is True
        # 4 of every 8 x 8 tile: 512 weights -> 32, 256 -> 16; biases in flat chunks
        assert found["kept"][:4] == [32, 4, 16, 4]


def test_settings_that_differ_raise_on_every_rank_naming_them(two_ranks):
    for found in findings(two_ranks, "check_mismatch"):
        for name in ("sync_every", "value", "start"):
            assert found[name]["raised"], name
            assert f"{name}:" in found[name]["message"], found[name]["message"]
        assert "seed the model alike" in found["start"]["message"]
        assert "on rank 0" in found["value"]["message"] and "on rank 1" in found["value"]["message"]


def test_a_nonfinite_pseudo_gradient_skips_the_outer_step_on_every_rank(two_ranks):
    rank0, rank1 = findings(two_ranks, "check_nonfinite")
    assert set(rank0) == {"sparseloco nan", "sparseloco inf", "diloco nan", "diloco -inf"}
    for case in rank0:
        for found in (rank0[case], rank1[case]):
            # nothing the next steps read moved; the parameters are the synced copy again
            assert all(found["unchanged"].values()), (case, found["unchanged"])
            assert found["at_synced"] and found["finite_residuals"], case
            assert found["skipped"] == 1 and found["later_skipped"] == 1, case
            assert len(found["warnings"]) == 1, case
            assert "rank 1: '2.weight'" in found["warnings"][0], found["warnings"]
            assert "rank 0" not in found["warnings"][0]
            # the next outer step is an ordinary one, and trains on from the synced copy
            assert found["outer_steps"] == 3 and found["finite_after"], case
        assert rank0[case]["next"] == rank1[case]["next"], case


def test_synced_copy_on_the_host_trains_the_same_bits(two_ranks):
    for found in findings(two_ranks, "check_synced_on_host"):
        assert found["True"]["digests"] == found["False"]["digests"]
        assert found["True"]["devices"] == ["cpu"]


def test_resumed_in_new_processes_equals_the_uninterrupted_run(two_ranks, ranks_folder):
    second = launch(ranks_folder, 2, "check_resume_second")
    for before, after in zip(findings(two_ranks, "check_resume_first"),
                             findings(second, "check_resume_second")):
        for name in ("sparseloco", "diloco_compressed"):
            assert after[name]["digest"] == before[name], name
            assert after[name]["resumed_at"] == [4, 1] and after[name]["ended_at"] == [8, 2]
            assert after[name]["residuals"] == 4
            assert not after[name]["saved_in_flight"]
        # two fragments, overlap 1: saved while fragment 0's exchange was in flight (the
        # checkpoint waited for it and holds its update), merged after loading as in the
        # run that never stopped; merges at steps 2, 4 | 5, 7, 8
        for name in ("streaming", "streaming_diloco"):
            assert before[f"{name} in flight"] and after[name]["saved_in_flight"], name
            assert after[name]["digest"] == before[name], name
            assert after[name]["resumed_at"] == [4, 2] and after[name]["ended_at"] == [8, 5]
        assert after["streaming"]["residuals"] == 4


def test_overlap_merges_by_its_rule_and_every_rank_shares_the_synced_copy(two_ranks):
    rank0, rank1 = findings(two_ranks, "check_overlap")
    for case in ("1 carry", "3 carry", "2 mix"):
        mine, theirs = rank0[case], rank1[case]
        # outer steps start at 3, 6, 9 and merge tau steps later; sync() drains the last
        assert mine["in_flight"] == [True] * 3 and len(mine["synced"]) >= 2, case
        assert mine["synced"] == theirs["synced"], case            # one synced copy
        assert mine["equation"] == [True] * len(mine["synced"]), case
        # the outer SGD steps ran on the background thread, sync()'s on the loop's
        assert mine["stepped"] == [True] * len(mine["in_flight"]) + [False], case
        assert theirs["equation"] == [True] * len(theirs["synced"]), case
        assert mine["drained"] and mine["end_is_synced"] and mine["end"] == theirs["end"]
        assert mine["outer_steps"] == 4, case                      # 3 merges and sync()
    # the pseudo-gradients of the first outer step are the blocking run's
    assert rank0["1 carry"]["synced"][0] == rank0["blocking first"]


def test_a_failed_exchange_in_flight_raises_from_the_next_step_on_every_rank(two_ranks):
    for rank, found in enumerate(findings(two_ranks, "check_overlap_failure")):
        raised = found["raised"]
        # the second outer step starts at the 6th step() call and fails in the
        # background: a later call raises (at the latest the merging one, the 8th), and
        # so does every call after it ("at": the step() call, 1 to 12)
        first = raised[0]
        assert first["at"] in (7, 8), raised
        assert first["type"] == ("ValueError" if rank == 1 else "PeerError"), raised
        assert "a codec refused" in first["message"], raised
        assert [r["at"] for r in raised] == [*range(first["at"], 13), "sync", "state_dict"]
        assert all(r["type"] == first["type"] for r in raised), raised


def test_fragments_sync_at_their_own_offsets(two_ranks):
    rank0, rank1 = findings(two_ranks, "check_fragments")
    # 16 x 32 + 32 and 32 x 8 + 8 parameters: the first weight alone, the rest
    assert rank0["members"] == [[0], [1, 2, 3]] and rank0["offsets"] == [2, 0]
    assert rank0["outer_steps"] == 4
    for step, (mine, theirs) in enumerate(zip(rank0["digests"], rank1["digests"])):
        synced = step % 2                    # fragment 0 at steps 2, 6; fragment 1 at 4, 8
        assert mine[synced] == theirs[synced], step
        assert mine[1 - synced] != theirs[1 - synced], step
    assert sum(rank0["dense"][:2]) == rank0["whole"]


def test_four_ranks_as_two_workers_of_two(tmp_path):
    found = findings(launch(tmp_path, 4, "check_workers_of_two"), "check_workers_of_two")
    assert [f["group_size"] for f in found] == [2] * 4
    assert [f["group_rank"] for f in found] == [0, 0, 1, 1]
    for step, synced in enumerate(found[0]["synced"]):
        digests = [f["digests"][step] for f in found]
        assert digests[0] == digests[1] and digests[2] == digests[3]   # DDP inside a worker
        assert (digests[0] == digests[2]) == synced                    # the outer step between


# -- one process ---------------------------------------------------------------------------

def test_modes_defaults_and_bytes(world_of_one):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 128)
    sparse = OuterOptimizer(model.parameters(), sync_every=1)
    assert (sparse.lr, sparse.momentum, sparse.nesterov, sparse.config.error_feedback) == \
        (1.0, 0.0, False, 0.95)
    assert sparse.config == ExchangeConfig.sparseloco()
    assert sparse.names == ["0", "1"]
    dense = OuterOptimizer(model.parameters(), mode="diloco", sync_every=1)
    assert (dense.lr, dense.momentum, dense.nesterov, dense.config.error_feedback) == \
        (0.7, 0.9, True, None)
    assert dense.config == ExchangeConfig.diloco()
    half = OuterOptimizer(model.parameters(), mode="diloco", value="bf16", sync_every=1)
    assert half.config.error_feedback == 1.0    # a lossy pipeline feeds its error back
    sent = {}
    for name, outer in {"sparse": sparse, "dense": dense, "half": half}.items():
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        outer.step()
        sent[name] = outer.stats.last.bytes_sent
    assert sent["dense"] >= dense.dense_bytes > 1.9 * sent["half"]
    # 8 tiles of 64 x 64 with 64 kept: 1.56%, 2-bit values
    assert sent["sparse"] < dense.dense_bytes / 40


def test_arguments_are_checked():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="mode must be one of"):
        OuterOptimizer(model.parameters(), mode="localsgd")
    with pytest.raises(ValueError, match="sync_every"):
        OuterOptimizer(model.parameters(), sync_every=0)
    with pytest.raises(ValueError, match="nesterov=True needs momentum"):
        OuterOptimizer(model.parameters(), momentum=0.0, nesterov=True)
    with pytest.raises(ValueError, match="error_feedback"):
        OuterOptimizer(model.parameters(), error_feedback=1.5)
    with pytest.raises(ValueError, match="no floating-point parameters"):
        OuterOptimizer([torch.nn.Parameter(torch.ones(2, dtype=torch.long),
                                           requires_grad=False)])


def test_streaming_arguments_are_checked():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="overlap must be at most 15"):
        OuterOptimizer(model.parameters(), sync_every=30, fragments=2, overlap=16)
    with pytest.raises(ValueError, match="fragments must be at most the 2"):
        OuterOptimizer(model.parameters(), fragments=3)
    with pytest.raises(ValueError, match="merge must be one of"):
        OuterOptimizer(model.parameters(), overlap=1, merge="average")
    with pytest.raises(ValueError, match="overlap must be an integer"):
        OuterOptimizer(model.parameters(), overlap=-1)
    outer = OuterOptimizer(model.parameters(), sync_every=30, fragments=2, overlap=5)
    assert "overlap=5" in repr(outer) and "fragments=2" in repr(outer)


def test_load_state_dict_refuses_other_settings():
    model = torch.nn.Linear(4, 4)
    state = OuterOptimizer(model.parameters(), sync_every=3).state_dict()
    with pytest.raises(ValueError, match="sync_every 3 there, 4 here"):
        OuterOptimizer(model.parameters(), sync_every=4).load_state_dict(state)


def test_example_script_trains_on_two_ranks_under_torchrun():
    # as docs/diloco.md launches it: torchrun --nproc-per-node=2 examples/diloco.py
    lines = torchrun_example("diloco.py", 2, "--steps", "50", "--sync-every", "20")
    outer_steps = [line for line in lines if line.startswith("outer step")]
    assert len(outer_steps) == 2 and "inner step   40" in outer_steps[-1]
    last = lines[-1]
    assert last.startswith("sparseloco: validation loss") and "after 50 inner and 3 outer" in last
    assert float(last.split("(")[-1].split("x")[0]) > 100       # bytes per outer step below dense
