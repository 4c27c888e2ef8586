"""The cost model's two link classes and the hierarchical scheme (benchmarks.cluster_cost, on
deepreduce.collectives.cost)."""

import json
import sys
from pathlib import Path

import pytest

from deepreduce.collectives import cost

#: (the model serves benchmarks.scale_nodes and lives beside it: the wheel's tests, which
#: run without the checkout's benchmarks, skip it)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
try:
    cluster_cost = pytest.importorskip("benchmarks.cluster_cost")
finally:
    del sys.path[0]

ROOT = Path(__file__).resolve().parent.parent
N, K, PAIR = 1_000_000, 10_000, 3.0
OVERHEAD = cost.FRAME_OVERHEAD + cost.SIGNATURE  # around an allgathered payload


def test_hierarchical_bytes_by_hand_two_nodes_of_two():
    s1, s2, s3 = cluster_cost.hierarchical_stages(4, 2, N, K, PAIR)
    # 1: the other rank of the node sends its half of the float32 gradient
    assert (s1.intra, s1.inter, s1.intra_messages) == (N / 2 * 4, 0, 1)
    # 2: each rank gets the other node's payload of its shard (k / 2 pairs); the port
    # carries both ranks' payloads
    payload = K / 2 * PAIR + OVERHEAD
    assert (s2.intra, s2.inter, s2.inter_messages) == (0, 2 * payload, 1)
    # 3: the other shard, the union of two random supports of 5,000 in 500,000, sparse
    union = 500_000 * (1 - (1 - 5_000 / 500_000) ** 2)
    assert union == pytest.approx(9_950)
    assert s3.intra == pytest.approx(union * 8 + cost.FRAME_OVERHEAD)
    assert s3.inter == 0


def test_reduced_shards_go_dense_when_that_is_smaller():
    # 8 nodes at 20%: the union covers 83% of the shard, more than half, so dense
    *_, s3 = cluster_cost.hierarchical_stages(64, 8, N, N // 5, PAIR)
    assert s3.intra == pytest.approx(7 * (N / 8 * 4 + cost.FRAME_OVERHEAD))


def test_one_rank_per_node_is_the_flat_exchange():
    cluster = cluster_cost.Cluster(1, cluster_cost.Link(100e9), cluster_cost.Link(1.25e9, 1e-5))
    for inter in ("allgather", "sparse_allreduce", "block"):
        s1, s2, s3 = cluster_cost.hierarchical_stages(16, 1, N, K, PAIR, inter=inter)
        (flat,) = cluster_cost.flat_stages(inter, 16, 1, N, K, PAIR, value_bytes=2.0)
        assert s1.intra == s3.intra == 0
        assert s2 == flat
        assert cluster_cost.exchange_time([s1, s2, s3], cluster) == pytest.approx(
            cluster_cost.exchange_time([flat], cluster))


def test_one_node_stays_inside_it():
    s1, s2, s3 = cluster_cost.hierarchical_stages(8, 8, N, K, PAIR)
    assert s1.inter == s2.inter == s3.inter == 0
    # a dense hierarchical step on one node is a dense reduce-scatter and allgather:
    # a ring allreduce's volume
    stages = cluster_cost.hierarchical_stages(8, 8, N, K, PAIR, inter="dense", overhead=0)
    assert sum(s.intra for s in stages) == pytest.approx(
        cost.dense_allreduce(8, N, 4).received)
    (flat,) = cluster_cost.flat_stages("allgather", 8, 8, N, K, PAIR)
    assert flat.inter == 0 and flat.intra == cost.received_per_rank("allgather", 8, N, K, PAIR)


@pytest.mark.parametrize("P,L", [(16, 8), (64, 8), (1024, 8), (8, 2), (64, 4)])
def test_hierarchical_port_bytes_are_about_one_in_local_size_of_flat(P, L):
    (flat,) = cluster_cost.flat_stages("allgather", P, L, N, K, PAIR)
    tiered = cluster_cost.hierarchical_stages(P, L, N, K, PAIR)[1]
    ratio = tiered.inter / flat.inter
    # (N - 1) / (P - 1) payloads of 1 / L the size, per port: about 1 / L
    assert ratio == pytest.approx((P // L - 1) / (P - 1), rel=0.05)
    assert ratio <= 1.05 / L  # a frame's overhead on payloads 1 / L the size


def test_flat_port_carries_one_ring_hop_or_every_rank_of_the_node():
    received = 1e6
    ring = cluster_cost.flat_stage("dense", 64, 8, received, 126)
    assert ring.inter == ring.intra == received
    direct = cluster_cost.flat_stage("block", 64, 8, received, 126)
    assert direct.inter == pytest.approx(8 * 56 / 63 * received)
    assert direct.intra == pytest.approx(7 / 63 * received)
    # the ring allreduce's port bytes match a hierarchical dense step's within (N-1)/N
    (dense,) = cluster_cost.flat_stages("dense", 64, 8, N, 0, 0)
    tiered = cluster_cost.hierarchical_stages(64, 8, N, 0, 0, inter="dense")[1]
    assert tiered.inter == pytest.approx(dense.inter * (7 / 8) / (63 / 64))


def test_stage_time_and_step():
    cluster = cluster_cost.Cluster(8, cluster_cost.Link(100e9, 5e-6), cluster_cost.Link(1.25e9, 2e-5))
    stage = cluster_cost.Stage(intra=1e9, inter=1.25e6, intra_messages=1, inter_messages=1)
    assert stage.time(cluster) == pytest.approx(0.01 + 5e-6)  # the intra link is slower here
    assert cluster_cost.step_on(cluster, [stage, stage], 0.1, 0.05, overlap=False) == pytest.approx(
        0.1 + 0.05 + 2 * (0.01 + 5e-6))
    with pytest.raises(ValueError, match="do not fill"):
        cluster.nodes(12)


def test_hierarchical_cpu_limits():
    # one rank per node: the flat terms; the dense stage's fixed part aside
    assert cluster_cost.hierarchical_cpu(1, 16, 0.08, 0.02, 0.0, 0.001) == pytest.approx(0.08 + 15 * 0.02)
    assert cluster_cost.hierarchical_cpu(8, 1, 0.08, 0.02, 0.004, 0.001) == pytest.approx(
        0.004 + 7 * 0.001 + 0.01)


def test_powersgd_elements_of_the_benchmark_mlp():
    # the e2e MLP 64-2048-2048-2048-10 (benchmarks.common.mlp_shapes; written out, as the
    # wheel's tests run without the checkout's benchmarks): 74,064 bytes handed to the
    # allreduces per rank, measured by benchmarks.hierarchical
    shapes = [(64, 2048), (2048,), (2048, 2048), (2048,), (2048, 2048), (2048,), (2048, 10),
              (10,)]
    assert cluster_cost.powersgd_elements(shapes) * 4 == 74_064
    assert cluster_cost.powersgd_elements([(4, 3, 2)], rank=2) == (4 + 6) * 2


def test_scale_checks_the_two_host_runs():
    path = ROOT / "benchmarks" / "results" / "hierarchical.json"
    if not path.exists():
        pytest.skip(f"{path} is absent (python -m benchmarks.hierarchical writes it)")
    from benchmarks import scale_nodes
    rows, worst, cpu, pair_bytes = scale_nodes.two_host_check(json.loads(path.read_text()))
    assert rows and worst >= 0 and pair_bytes > 0 and set(cpu) == set(scale_nodes.TWO_HOST)
    # the model's bytes across the veth are within 25% of the interface counters
    assert all(abs(float(r[-1].rstrip("%"))) <= 25 for r in rows if r[2] == "MB across")


def test_scale_report_has_the_cluster_section():
    path = ROOT / "benchmarks" / "results" / "scale.md"
    if not path.exists():
        pytest.skip(f"{path} is absent")
    text = path.read_text()
    assert "8 ranks per node" in text and "hierarchical" in text
