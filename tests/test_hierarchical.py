"""The hierarchical exchange on 4 ranks as 2 nodes x 2, played by threads.

The torch.distributed side (4 gloo processes, the DDP hook) is in
tests/test_torch_hierarchical.py.
"""

from __future__ import annotations

import doctest
import pickle
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import deepreduce as dr
from deepreduce.collectives import frames
from deepreduce.exchange import hierarchical as hierarchical_exchange, topology as hierarchical
from deepreduce.exchange.topology import shard_bounds, unpack_shards
from deepreduce.collectives.transport import ThreadTransport, members_of
from deepreduce.config import ExchangeConfig
from deepreduce.errors import DecodeError
from deepreduce.exchange import GradientExchange

P, LOCAL = 4, 2
LOSSLESS = {"sparsifier": None, "index": "varint", "value": "raw", "min_size": 0}
INTER = {"allgather": {}, "sparse_allreduce": {"algorithm": "split"},
         "block": {"block_size": 16}}


def hierarchical_exchange_of(inter="allgather", local_size=LOCAL, inter_options=None, **settings):
    options = {"local_size": local_size, "inter": inter,
               "inter_options": INTER[inter] if inter_options is None else inter_options}
    return GradientExchange(communicator="hierarchical", communicator_options=options,
                            **settings)


def run_ranks(fn, size=P, timeout=30):
    """``fn(member)`` on every member of a thread group; per rank, its result or error."""
    members = ThreadTransport.group(size, timeout=timeout)
    with ThreadPoolExecutor(size) as pool:
        futures = [pool.submit(fn, member) for member in members]
        out = []
        for future in futures:
            try:
                out.append(future.result(timeout=2 * timeout))
            except Exception as exc:  # noqa: BLE001 - the tests look at it
                out.append(exc)
        return out


def gradients(rank, step=0):
    """A step's gradients of one rank: float32 and float64, odd sizes, a tensor smaller
    than the ranks of a node, a zero one."""
    rng = np.random.default_rng([rank, step])
    return [rng.standard_normal((37, 29)).astype(np.float32),
            rng.standard_normal(5001).astype(np.float64),
            rng.standard_normal(1).astype(np.float32),
            np.zeros(10, np.float32),
            rng.standard_normal((3, 7)).astype(np.float32)]


def node_first_sum(per_rank, local=LOCAL):
    """The dense allreduce that sums each node first, in rank order, in the dtype."""
    nodes = []
    for node in range(len(per_rank) // local):
        total = per_rank[node * local].copy()
        for r in range(node * local + 1, (node + 1) * local):
            total += per_rank[r]
        nodes.append(total)
    result = nodes[0].copy()
    for total in nodes[1:]:
        result += total
    return result


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_docstring_examples():
    for module in (hierarchical_exchange, hierarchical):
        result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.attempted and result.failed == 0


@pytest.mark.parametrize("inter", sorted(INTER))
def test_lossless_equals_the_dense_allreduce_bit_for_bit(inter):
    exchanges = [hierarchical_exchange_of(inter, **LOSSLESS) for _ in range(P)]
    names = ["w", "v", "one", "zero", "small"]

    def rank_main(member):
        grads = gradients(member.rank)
        outputs, traffic = exchanges[member.rank].reduce_async(names, grads, member).result()
        return outputs

    results = run_ranks(rank_main)
    expected = [node_first_sum([gradients(r)[t] for r in range(P)]) for t in range(len(names))]
    for rank, outputs in enumerate(results):
        assert not isinstance(outputs, Exception), outputs
        for t, (got, want) in enumerate(zip(outputs, expected)):
            assert same_bits(got, want), (rank, names[t])
    # and within rounding of the sum in plain rank order
    flat = sum(gradients(r)[0].astype(np.float64) for r in range(P))
    np.testing.assert_allclose(results[0][0], flat, rtol=1e-5, atol=1e-5)


def test_average_out_and_rows():
    """op="average" divides by all P ranks; ``out`` arrays receive the results;
    ``as_rows`` gives the non-zero rows; SparseTensor inputs are taken densely."""
    exchanges = [hierarchical_exchange_of(**LOSSLESS) for _ in range(P)]

    def rank_main(member):
        dense = np.arange(12, dtype=np.float32).reshape(4, 3) * (member.rank + 1)
        rows = np.zeros((6, 2), np.float32)
        rows[member.rank % 3] = member.rank + 1
        out = [np.empty((4, 3), np.float32), None]
        outputs, _ = exchanges[member.rank].reduce_async(
            ["d", "rows"], [dense, dr.SparseTensor.from_dense(rows)], member, "average",
            as_rows=[False, True], out=out).result()
        return outputs, out

    for outputs, out in run_ranks(rank_main):
        assert outputs[0] is out[0]
        assert same_bits(out[0], np.arange(12, dtype=np.float32).reshape(4, 3) * 10 / 4)
        values, rows = outputs[1]
        assert rows.tolist() == [0, 1, 2]
        np.testing.assert_array_equal(values, np.array([[5, 5], [2, 2], [3, 3]]) / 4)


def test_topk_error_feedback_converges_and_ranks_agree():
    """Least squares, each rank its own data: Top-10% of each node's shard with error
    feedback and fp16 values (between the nodes, the bytes of a flat Top-5%: one
    selection per node instead of one per rank) brings the loss down a thousandfold,
    and every rank holds the same weights at every step."""
    n_features, steps, lr = 2000, 80, 0.2
    rng = np.random.default_rng(7)
    truth = rng.standard_normal(n_features).astype(np.float32)
    data = []
    for rank in range(P):
        x = rng.standard_normal((1000, n_features)).astype(np.float32)
        data.append((x, x @ truth))
    # (min_size counts a shard's elements: 1,000 here)
    exchanges = [hierarchical_exchange_of(sparsifier="topk:0.1", value="fp16", seed=rank,
                                          min_size=0) for rank in range(P)]

    def loss(w):
        return float(np.mean([np.mean((x @ w - y) ** 2) for x, y in data]))

    def rank_main(member):
        w = np.zeros(n_features, np.float32)
        x, y = data[member.rank]
        history = []
        for _ in range(steps):
            grad = (2 * x.T @ (x @ w - y) / len(y)).astype(np.float32)
            (avg,), _ = exchanges[member.rank].reduce_async(["w"], [grad], member,
                                                            "average").result()
            w = w - lr * avg
            history.append(w.copy())
        return history

    histories = run_ranks(rank_main, timeout=60)
    for history in histories[1:]:
        assert all(same_bits(a, b) for a, b in zip(history, histories[0]))
    start, end = loss(np.zeros(n_features, np.float32)), loss(histories[0][-1])
    assert end < 1e-3 * start, (start, end)
    stats = exchanges[0].stats.total
    assert stats.compressed_tensors == steps and stats.steps == steps


def test_error_feedback_conserves_the_sum():
    """What was delivered plus every rank's residual (at its shard) is the sum of the
    inputs: nothing is lost between the nodes."""
    exchanges = [hierarchical_exchange_of(sparsifier="topk:0.02", value="raw", min_size=0)
                 for _ in range(P)]
    grads = [np.random.default_rng(r).standard_normal(3001).astype(np.float32)
             for r in range(P)]

    def rank_main(member):
        (total,), _ = exchanges[member.rank].reduce_async(["g"], [grads[member.rank]],
                                                          member).result()
        return total

    delivered = run_ranks(rank_main)[0]
    bounds = shard_bounds(3001, LOCAL)
    owed = np.zeros(3001, np.float64)
    for rank, exchange in enumerate(exchanges):
        local = rank % LOCAL
        owed[bounds[local]:bounds[local + 1]] += exchange.selector.memory.residual("g")
    np.testing.assert_allclose(delivered + owed, np.sum(grads, axis=0), atol=1e-5)
    assert np.count_nonzero(delivered) <= 2 * 2 * (3001 // 2 // 50 + 1)


def test_checkpoint_resumes_bit_for_bit():
    settings = dict(sparsifier="randomk:0.05", value="qsgd:bits=4", min_size=0)

    def run(exchanges, member, steps):
        outs = []
        for step in steps:
            grads = gradients(member.rank, step)[:2]
            outputs, _ = exchanges[member.rank].reduce_async(["w", "v"], grads,
                                                             member).result()
            outs.append([o.copy() for o in outputs])
        return outs

    straight = [hierarchical_exchange_of(**settings) for _ in range(P)]
    uninterrupted = run_ranks(lambda m: run(straight, m, range(6)))
    first = [hierarchical_exchange_of(**settings) for _ in range(P)]
    run_ranks(lambda m: run(first, m, range(3)))
    states = [pickle.loads(pickle.dumps(e.selector.state_dict())) for e in first]
    resumed = [pickle.loads(pickle.dumps(hierarchical_exchange_of(**settings)))
               for _ in range(P)]
    for exchange, state in zip(resumed, states):
        exchange.selector.load_state_dict(state)
        assert state["residuals"]["w"].size in (536, 537)  # a shard of the 1,073
    second = run_ranks(lambda m: run(resumed, m, range(3, 6)))
    for rank in range(P):
        for a, b in zip(uninterrupted[rank][3:], second[rank]):
            assert all(same_bits(x, y) for x, y in zip(a, b))


def test_between_nodes_each_rank_sends_a_shard():
    """A rank's bytes between the nodes are about 1/local_size of what it sends in the
    flat allgather exchange of the same gradients."""
    settings = dict(sparsifier="topk:0.01", value="fp16", min_size=0)
    grads = [np.random.default_rng(r).standard_normal(200_000).astype(np.float32)
             for r in range(P)]

    def step(exchanges):
        def rank_main(member):
            return exchanges[member.rank].reduce_async(["g"], [grads[member.rank]],
                                                       member).result()[1]
        return run_ranks(rank_main)

    flat = step([GradientExchange(**settings) for _ in range(P)])
    tiered = step([hierarchical_exchange_of(**settings) for _ in range(P)])
    for rank in range(P):
        between = sum(sent for stage, sent, _ in tiered[rank].stages if stage == "between nodes")
        assert between < 0.6 * flat[rank].sent, (between, flat[rank].sent)
        stages = [stage for stage, *_ in tiered[rank].stages]
        assert stages == ["node reduce-scatter", "between nodes", "node allgather"]


def test_ranks_configured_differently_fail_on_every_rank():
    def rank_main(member):
        local_size = 4 if member.rank == 3 else 2
        exchange = hierarchical_exchange_of(local_size=local_size, **LOSSLESS)
        return exchange.reduce_async(["w"], [np.ones(8, np.float32)], member).result()

    for error in run_ranks(rank_main):
        assert isinstance(error, ValueError)
        assert "local_size: 2 on ranks 0, 1, 2; 4 on rank 3" in str(error)

    def other_inter(member):
        inter = "block" if member.rank == 0 else "allgather"
        exchange = hierarchical_exchange_of(inter, **LOSSLESS)
        return exchange.reduce_async(["w"], [np.ones(8, np.float32)], member).result()

    for error in run_ranks(other_inter):
        assert isinstance(error, ValueError) and "inter: block on rank 0" in str(error)


def test_ranks_reducing_other_tensors_fail_on_every_rank():
    exchanges = [hierarchical_exchange_of(**LOSSLESS) for _ in range(P)]

    def rank_main(member):
        size = 9 if member.rank == 2 else 8
        return exchanges[member.rank].reduce_async(["w"], [np.ones(size, np.float32)],
                                                   member).result()

    errors = run_ranks(rank_main)
    for error in errors:
        assert isinstance(error, frames.PeerError), error
        assert "every rank must reduce the same tensors" in str(error)


def test_a_rank_that_cannot_encode_makes_every_rank_raise():
    """A codec that raises on one rank's shard (between the nodes): its own error there,
    a PeerError naming it on the three others (one of them on the other node)."""
    exchanges = [hierarchical_exchange_of(**LOSSLESS) for _ in range(P)]

    def rank_main(member):
        exchange = exchanges[member.rank]
        if member.rank == 1:
            def broken(*args, **kwargs):
                raise ValueError("codec broke")
            exchange.strategy._inner.encode = broken
        return exchange.reduce_async(["w"], [np.ones(64, np.float32)], member).result()

    errors = run_ranks(rank_main)
    assert isinstance(errors[1], ValueError) and str(errors[1]) == "codec broke"
    for rank in (0, 2, 3):
        assert isinstance(errors[rank], frames.PeerError)
        assert "rank 1: ValueError: codec broke" in str(errors[rank])


def test_local_size_from_the_launcher_or_an_error_asking_for_it(monkeypatch):
    for variable in ("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    exchanges = [hierarchical_exchange_of(local_size=None, **LOSSLESS) for _ in range(P)]

    def rank_main(member):
        return exchanges[member.rank].reduce_async(["w"], [np.ones(8, np.float32)],
                                                   member).result()

    for error in run_ranks(rank_main):
        assert isinstance(error, ValueError)
        assert "communicator_options={'local_size': N}" in str(error)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    exchanges = [hierarchical_exchange_of(local_size=None, **LOSSLESS) for _ in range(P)]
    for outputs, _ in run_ranks(rank_main):
        assert same_bits(outputs[0], np.full(8, 4, np.float32))


def test_pay_adds_each_residual_into_its_shard():
    exchanges = [hierarchical_exchange_of(sparsifier="topk:0.1", value="raw", min_size=0)
                 for _ in range(P)]
    grads = [np.random.default_rng(r).standard_normal(100).astype(np.float32)
             for r in range(P)]

    def rank_main(member):
        exchange = exchanges[member.rank]
        exchange.reduce_async(["g"], [grads[member.rank]], member).result()
        owed = exchange.selector.memory.residual("g").copy()
        target = np.zeros(100, np.float32)
        exchange.pay(["g"], [target], member)
        return owed, target, "g" in exchange.selector.memory

    for rank, (owed, target, still) in enumerate(run_ranks(rank_main)):
        local = rank % LOCAL
        bounds = shard_bounds(100, LOCAL)
        expected = np.zeros(100, np.float32)
        expected[bounds[local]:bounds[local + 1]] = owed
        assert same_bits(target, expected) and not still


def test_options_are_checked():
    with pytest.raises(ValueError, match="takes the options local_size, inter, inter_options"):
        ExchangeConfig(communicator="hierarchical", communicator_options={"size": 2})
    with pytest.raises(ValueError, match="communicator 'block' takes the options"):
        ExchangeConfig(communicator="hierarchical",
                       communicator_options={"inter": "block", "inter_options": {"x": 1}})
    with pytest.raises(ValueError, match="local_size must be"):
        ExchangeConfig(communicator="hierarchical", communicator_options={"local_size": 0})
    config = ExchangeConfig(communicator="hierarchical")
    assert config.communicator_options == {"local_size": None, "inter": "allgather",
                                           "inter_options": {}}


def test_local_size_must_divide_the_ranks():
    exchanges = [hierarchical_exchange_of(local_size=3, **LOSSLESS) for _ in range(P)]

    def rank_main(member):
        return exchanges[member.rank].reduce_async(["w"], [np.ones(8, np.float32)],
                                                   member).result()

    for error in run_ranks(rank_main):
        assert isinstance(error, ValueError) and "does not divide the 4 ranks" in str(error)


def test_split_orders_members_by_key():
    assert members_of(np.array([[1, 0], [0, 3], [1, -1], [0, 3]]), 3) == [1, 3]

    def rank_main(member):
        sub = member.split(member.rank // 2, key=member.rank % 2)
        from deepreduce.collectives import Traffic
        return sub.rank, sub.size, [bytes(f) for f in sub.allgather(bytes([member.rank]),
                                                                    Traffic(), "t")]

    assert run_ranks(rank_main) == [(0, 2, [b"\x00", b"\x01"]), (1, 2, [b"\x00", b"\x01"]),
                                    (0, 2, [b"\x02", b"\x03"]), (1, 2, [b"\x02", b"\x03"])]


def test_shard_frames_are_read_strictly():
    layout = [(10, np.dtype(np.float32))]
    good, _ = hierarchical.pack_shards([np.zeros(10, np.float32)])
    assert same_bits(unpack_shards(good, layout)[0].dense(10), np.zeros(10, np.float32))
    for bad in (good + b"x", good[:-1], b"\x07", b"\x01\x02\x09\x00\x00\x00\x00\x00\x00\x00"):
        with pytest.raises(DecodeError):
            unpack_shards(bad, layout)


def test_pickled_exchange_leaves_its_groups_behind():
    exchanges = [hierarchical_exchange_of(**LOSSLESS) for _ in range(P)]
    members = ThreadTransport.group(P, timeout=30)
    with ThreadPoolExecutor(P) as pool:
        list(pool.map(lambda m: exchanges[m.rank].reduce_async(
            ["w"], [np.ones(4, np.float32)], m).result(), members))
    assert len(exchanges[0].strategy._groups) == 1  # while its transport lives
    copy = pickle.loads(pickle.dumps(exchanges[0]))
    assert len(copy.strategy._groups) == 0


@pytest.mark.parametrize("sums", ["compiled", "numpy"])
def test_reused_outputs_and_either_sum_give_the_same_bits(monkeypatch, sums):
    """With ``reuse_out`` only what the last step wrote into an ``out`` array is reset;
    the sums' positions come from the decode (the compiled sum's, or numpy's, which may
    repeat): every step's results equal those of fresh arrays."""
    from deepreduce import sums
    if sums == "numpy":
        monkeypatch.setattr(sums, "_sparsesum", None)
        monkeypatch.setattr(hierarchical_exchange, "SUM_IMPLEMENTATION", "numpy")
    settings = dict(sparsifier="topk:0.02", value="fp16", min_size=0)
    reused = [hierarchical_exchange_of(**settings) for _ in range(P)]
    fresh = [hierarchical_exchange_of(**settings) for _ in range(P)]

    def rank_main(member):
        out = [np.full((37, 29), np.nan, np.float32), np.full(5001, np.nan)]
        steps = []
        for step in range(4):
            grads = gradients(member.rank, step)[:2]
            a, _ = reused[member.rank].reduce_async(["w", "v"], grads, member, "average",
                                                    out=out, reuse_out=True).result()
            b, _ = fresh[member.rank].reduce_async(["w", "v"], grads, member,
                                                   "average").result()
            steps.append(all(same_bits(x, y) for x, y in zip(a, b)) and a[0] is out[0])
        return steps

    for steps in run_ranks(rank_main):
        assert steps == [True] * 4


@pytest.mark.parametrize("local", [1, 4])
def test_lossless_with_one_rank_per_node_and_one_node(local):
    """local_size 1 (four nodes of one: the reduce-scatter is trivial) and 4 (one node:
    nothing between nodes) sum as the node-first dense allreduce does."""
    exchanges = [hierarchical_exchange_of(local_size=local, **LOSSLESS) for _ in range(P)]
    names = ["w", "v", "one", "zero", "small"]

    def rank_main(member):
        return exchanges[member.rank].reduce_async(names, gradients(member.rank),
                                                   member).result()[0]

    expected = [node_first_sum([gradients(r)[t] for r in range(P)], local)
                for t in range(len(names))]
    for outputs in run_ranks(rank_main):
        assert all(same_bits(a, b) for a, b in zip(outputs, expected))
