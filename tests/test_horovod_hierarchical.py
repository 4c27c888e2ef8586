"""The hierarchical communicator over Horovod: HorovodTransport.split on process sets,
and four Gloo ranks as two nodes of two (tests/horovod_hierarchical_workers.py, one
``horovodrun -np 4 --gloo`` launch with dynamic process sets)."""

import doctest
import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("horovod.tensorflow")

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD, LOCAL = 4, 2


def test_docstring_examples():
    from deepreduce.horovod import collectives

    result = doctest.testmod(collectives, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0


def test_hierarchical_process_sets_leave_out_the_global_one():
    from deepreduce.horovod.collectives import hierarchical_process_sets

    assert [ps.ranks for ps in hierarchical_process_sets(6, 3)] == \
        [[0, 1, 2], [3, 4, 5], [0, 3], [1, 4], [2, 5]]
    assert [ps.ranks for ps in hierarchical_process_sets(2, 1)] == [[0], [1]]
    assert [ps.ranks for ps in hierarchical_process_sets(2, 2)] == [[0], [1]]
    with pytest.raises(ValueError, match="whole nodes"):
        hierarchical_process_sets(4, 3)


def launch(out, mode: str) -> dict:
    """Run tests/horovod_hierarchical_workers.py on four Gloo ranks; ``{check: [rank 0,
    ..., 3]}``. ``mode``: "dynamic" (HOROVOD_DYNAMIC_PROCESS_SETS=1) or "static"."""
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(horovodrun):
        horovodrun = shutil.which("horovodrun")
    if horovodrun is None:
        pytest.skip("horovodrun not found")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2",
           "HOROVOD_GLOO_TIMEOUT_SECONDS": "60", "PYTHONUNBUFFERED": "1",
           "HOROVOD_DYNAMIC_PROCESS_SETS": "1" if mode == "dynamic" else "0"}
    proc = subprocess.run([horovodrun, "-np", str(WORLD), "-H", f"localhost:{WORLD}", "--gloo",
                           sys.executable, os.path.join(HERE, "horovod_hierarchical_workers.py"),
                           str(out), mode], env=env, capture_output=True, text=True,
                          timeout=600)
    files = [out / f"rank{r}.json" for r in range(WORLD)]
    if proc.returncode or not all(f.exists() for f in files):
        pytest.fail(f"horovodrun failed ({proc.returncode}):\n{proc.stdout[-5000:]}\n"
                    f"{proc.stderr[-5000:]}")
    ranks = [json.loads(f.read_text()) for f in files]
    return {check: [found[check] for found in ranks] for check in ranks[0]}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """The findings of the launch with dynamic process sets."""
    return launch(tmp_path_factory.mktemp("horovod_hierarchical"), "dynamic")


def findings(four_ranks, check):
    for rank, found in enumerate(four_ranks[check]):
        assert "error" not in found, f"rank {rank}:\n{found['error']}"
    return four_ranks[check]


def test_split_makes_the_node_and_the_shard_process_sets(four_ranks):
    for rank, found in enumerate(findings(four_ranks, "check_split")):
        node, local = divmod(rank, LOCAL)
        node_ranks = [LOCAL * node + j for j in range(LOCAL)]
        shard_ranks = [local + LOCAL * n for n in range(WORLD // LOCAL)]
        assert found["intra"] == [local, LOCAL, node_ranks, node_ranks]
        assert found["inter"] == [node, WORLD // LOCAL, shard_ranks, shard_ranks]
        # the global set, the two node sets and the two shard sets, each once: a second
        # split reuses them (and the transport)
        assert found["table_before"] == {"0,1,2,3": 0, "0,1": 1, "2,3": 2, "0,2": 3,
                                         "1,3": 4}
        assert found["table_after"] == found["table_before"] and found["again_same"]


def test_split_ranks_members_by_key_where_horovod_ranks_them_otherwise(four_ranks):
    for rank, found in enumerate(findings(four_ranks, "check_split")):
        members = sorted((r for r in range(WORLD) if r % 2 == rank % 2), reverse=True)
        me = members.index(rank)
        received = ["" if m == me else bytes([members[m], me]).hex()
                    for m in range(len(members))]
        assert found["reverse"] == [me, len(members), members, received]


def test_split_without_a_way_to_make_the_sets_raises_on_every_rank(four_ranks):
    for rank, found in enumerate(findings(four_ranks, "check_split_errors")):
        assert found["before"] == {"0,1,2,3": 0}
        assert found["after"] == {"0,1,2,3": 0, "0,1": 1, "2,3": 2}
        off = found["off"]
        assert off["raised"] == "ValueError"
        assert "dynamic process sets are off on ranks [0, 1, 2, 3]" in off["message"]
        assert "HOROVOD_DYNAMIC_PROCESS_SETS=1" in off["message"]
        assert "hvd.init(process_sets=" in off["message"]
        smaller = found["smaller"]
        assert smaller["raised"] == "ValueError"
        assert "only a transport of the global process set can add one" in smaller["message"]


def test_lossless_equals_the_node_first_dense_sum_bit_for_bit(four_ranks):
    for found in findings(four_ranks, "check_lossless"):
        for inter in ("allgather", "sparse_allreduce", "block"):
            for op in ("sum", "average"):
                for mode in ("eager", "graph"):
                    assert found[f"{inter}_{op}_{mode}"] == [True] * 6, (inter, op, mode)
                assert found[f"{inter}_{op}_slices"] == "IndexedSlices"
                assert found[f"{inter}_{op}_compressed"] == 2 * 6  # eager + graph, 6 tensors


def test_topk_error_feedback_trains_alike_on_every_rank(four_ranks):
    found = findings(four_ranks, "check_topk_trains")
    for mode in ("eager", "graph"):
        assert len({f[mode]["digest"] for f in found}) == 1, mode
        for f in found:
            assert f[mode]["last"] < 0.6 * f[mode]["first"], (mode, f)
            # only the first kernel's shard (4096 of 8192 elements) reaches min_size
            assert f[mode]["steps"] == f[mode]["compressed"] == 28
    # a tf.function step reduces the same bits as an eager one
    assert found[0]["eager"]["digest"] == found[0]["graph"]["digest"]


def test_ranks_configured_differently_fail_everywhere(four_ranks):
    # the settings every rank compares before its first step name the difference
    for found in findings(four_ranks, "check_misconfigured"):
        assert found["raised"] == "ValueError"
        assert "communicator_options: {'local_size': 2," in found["message"]
        assert "on ranks 0, 1, 2; {'local_size': 4," in found["message"]
        assert found["message"].endswith("on rank 3")


def test_sets_registered_at_init_serve_without_dynamic_process_sets(tmp_path):
    found = findings(launch(tmp_path, "static"), "check_static")
    for f in found:
        assert f["equal"] == [True] * 6
        assert f["before"] == f["after"] == {"0,1,2,3": 0, "0,1": 1, "2,3": 2, "0,2": 3,
                                             "1,3": 4}
