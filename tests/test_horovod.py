"""deepreduce.horovod: real two-rank Horovod runs.

The multi-rank checks run once, in a single ``horovodrun -np 2 --gloo`` launch of
tests/horovod_workers.py (each launch pays TensorFlow's import time); the tests
below assert on what every rank recorded. The framework-neutral parts they build on
are tested without Horovod: the bundle format in test_bundle.py, GradientExchange in
test_exchange.py.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------ two Horovod ranks

@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Run tests/horovod_workers.py on two Gloo ranks; return each rank's findings."""
    pytest.importorskip("horovod.tensorflow")
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(horovodrun):
        horovodrun = shutil.which("horovodrun")
    if horovodrun is None:
        pytest.skip("horovodrun not found")
    out = tmp_path_factory.mktemp("horovod")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2",
           "HOROVOD_GLOO_TIMEOUT_SECONDS": "60", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([horovodrun, "-np", "2", "-H", "localhost:2", "--gloo",
                           sys.executable, os.path.join(HERE, "horovod_workers.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    files = [out / f"rank{r}.json" for r in range(2)]
    if proc.returncode or not all(f.exists() for f in files):
        pytest.fail(f"horovodrun failed ({proc.returncode}):\n{proc.stdout[-5000:]}\n"
                    f"{proc.stderr[-5000:]}")
    return [json.loads(f.read_text()) for f in files]


def findings(ranks, check):
    """Each rank's findings of one check; fails with the traceback if it raised."""
    per_rank = [r[check] for r in ranks]
    for rank, found in enumerate(per_rank):
        assert "exception" not in found, f"rank {rank}:\n{found['exception']}"
    return per_rank


def test_lossless_pipeline_equals_horovod_allreduce(ranks):
    for found in findings(ranks, "lossless"):
        for key in ("average_eager_equal", "average_graph_equal", "sum_eager_equal",
                    "sum_graph_equal"):
            assert all(found[key]), key
        assert found["average_dtypes"] == ["float32"] * 4 + ["float64"]
    assert len({f["sum_checksum"] for f in findings(ranks, "lossless")}) == 1


def test_ranks_with_different_payload_sizes(ranks):
    found = findings(ranks, "different_sizes")
    assert all(f["equal"] for f in found)
    sent = [f["bytes_sent"] for f in found]
    assert sent[0] * 10 < sent[1]
    # Horovod's allgather (in the graph) moves the bundles as they are: each rank decoded
    # every rank's, its own included, and nothing framed them
    assert found[0]["bytes_received"] == found[1]["bytes_received"] == sum(sent)
    assert [f["bundle_bytes"] for f in found] == sent


def test_held_results_survive_and_dropped_ones_are_reused(ranks):
    for found in findings(ranks, "held_results"):
        assert found["kept_unchanged"] and all(found["correct"])
        assert found["kept_address"] not in found["addresses"]
        # TensorFlow adopted the aligned sums (no copy) and let go of them once dropped
        assert all(found["adopted"]) and len(set(found["addresses"][1:])) == 1


# allgather with fp16 values; sparse_allreduce with raw values, whose owners' sums
# round once, to float32
@pytest.mark.parametrize("check, min_ratio", [("error_feedback", 15),
                                              ("sparse_allreduce_error_feedback", 5)])
def test_topk_with_error_feedback_loses_no_mass(ranks, check, min_ratio):
    found = findings(ranks, check)
    for f in found:
        # delivered sums + every rank's residual == every input, to float32 rounding
        assert max(f["mass_error"]) < 1e-4
        assert all(0 < r for r in f["residual_norm"])
        # TopK 2% of 1000 and of 2000 per rank, summed over two ranks
        assert all(a <= 40 and b <= 80 for a, b in f["nonzeros"])
        assert f["ratio"] > min_ratio
    assert found[0]["delivered_checksum"] == found[1]["delivered_checksum"]


def test_gradients_in_several_bundles_reduce_to_the_same_bits(ranks):
    for found in findings(ranks, "grouped_bundles"):
        assert found["same"] == [[True, True]] * 4  # in a graph and eagerly
        # each training step counts once, whatever the number of bundles
        assert found["steps"] == [4, 4, 4]
        assert found["tensors"] == [4 * 6] * 3
        assert len(set(found["dense_bytes"])) == 1


def test_every_communicator_equals_horovod_allreduce(ranks):
    found = findings(ranks, "communicators")
    for f in found:
        assert set(f) >= {"allgather", "sparse_allreduce", "recursive_doubling", "block"}
        for key, run in f.items():
            if key == "all_ranks":
                continue
            # w, b (below min_size), float64 w64, embedding IndexedSlices
            assert run["eager_equal"] == [True] * 4, key
            assert run["graph_equal"] == [True] * 4, key
            assert run["slices"] == [True, True], key
            assert run["steps"] == 2 and 0 < run["bytes_sent"], key
            assert run["dense_bytes"] == 4 * (2400 + 30 + 800) + 8 * 1200, key


def test_indexed_slices_stay_sparse(ranks):
    for f in findings(ranks, "indexed_slices"):
        assert f["local_is_slices"] and f["is_slices"]
        assert f["rows"] == [1, 5, 7, 60, 99]
        assert f["equal"]
        assert f["bytes_sent"] < f["dense_bytes"] / 4  # sent sparse, not densified
        assert f["sparse_as_dense_is_tensor"] and f["sparse_as_dense_equal"]
        assert f["topk_value_shape"][1] == 8 and f["topk_rows_unique"]
        assert f["topk_residual_nonzero"] > 0


def test_tape_options_like_horovod(ranks):
    for f in findings(ranks, "tape_options"):
        assert f["nested_keys"] == ["a", "b"]
        assert f["predivide_close"] and f["local_scaled"]
        assert f["tensor_source_equal"]


def test_compression_in_plain_horovod_tape_fails_loudly(ranks):
    for f in findings(ranks, "misuse"):
        # inside Horovod's tf.function the DecodeError surfaces as a TensorFlow error
        assert f["tape_error"] == "InvalidArgumentError"
        assert "DecodeError" in f["tape_message"]
        assert "drh.DistributedGradientTape" in f["tape_message"]
        # eager hvd.allreduce: the DecodeError itself
        assert f["eager_is_decode_error"]
        assert "drh.DistributedGradientTape" in f["eager_message"]


def test_keras_fit_reduces_the_loss(ranks):
    found = findings(ranks, "keras_fit")
    for f in found:
        for label, epochs in (("new", 3), ("legacy", 3), ("sparse_allreduce", 2)):
            run = f[label]
            assert run["loss"][-1] < 0.5 * run["loss"][0], label
            assert run["class_name"] == "SGD"
            assert run["steps"] == epochs * 29  # 899 samples per rank, batch 32
            assert len(run["dr_ratio"]) == epochs and min(run["dr_ratio"]) > 10, label
    assert found[0]["event_files"]  # TensorBoard events from the stats callback
    for label in ("new", "legacy", "sparse_allreduce"):
        assert found[0][label]["checksum"] == found[1][label]["checksum"]


def test_a_skipped_non_finite_step_leaves_no_trace(ranks):
    """An inf on one rank: every rank sees non-finite gradients at that step and skips
    it, and the run ends bit for bit as one that never took that batch."""
    for f in findings(ranks, "nonfinite_step"):
        assert f["finite_seen"] == [True] * 5 + [False] + [True] * 6
        assert f["clean_finite_seen"] == [True] * 11
        assert f["nonfinite_steps"] == 1
        assert f["weights_equal"] and f["residuals_equal"]


def test_custom_loop_reduces_the_loss(ranks):
    found = findings(ranks, "custom_loop")
    for f in found:
        assert f["last"] < 0.5 * f["first"]
        assert f["steps"] == 3 * 28
    assert found[0]["checksum"] == found[1]["checksum"]


GRAPH_WITH_ONE_INTER_OP_THREAD = """
import tensorflow as tf, horovod.tensorflow as hvd, deepreduce as dr
import deepreduce.horovod.tensorflow as drh
tf.config.threading.set_inter_op_parallelism_threads(1)
hvd.init()
v = tf.Variable(tf.ones([4096]))
compression = drh.Compression(sparsifier=dr.TopK(0.01), index="varint", communicator="sparse_allreduce")

@tf.function
def step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * v)
    return drh.DistributedGradientTape(tape, compression=compression).gradient(loss, [v])

try:
    step()
except ValueError as exc:
    print("refused:", exc)
"""


def test_reducing_communicator_in_a_graph_with_one_inter_op_thread_is_refused():
    # Such a graph would wait forever for the thread its own host call holds.
    pytest.importorskip("horovod.tensorflow")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([sys.executable, "-c", GRAPH_WITH_ONE_INTER_OP_THREAD], env=env,
                          capture_output=True, text=True, timeout=120)
    assert "refused:" in proc.stdout and "set_inter_op_parallelism_threads" in proc.stdout, \
        proc.stdout[-2000:] + proc.stderr[-3000:]
