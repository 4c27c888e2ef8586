"""Tests of deepreduce.collectives.

Most checks run P ranks as threads of this process (``ThreadTransport``): the
communicators' logic is the same whatever moves the bytes. Two launches of
real Horovod ranks (Gloo, 2 and 4 processes) then run every scenario of
``collectives_workers.py`` against Horovod's dense allreduce.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import deepreduce as dr
from deepreduce import collectives as dc
from deepreduce import container
from deepreduce.collectives import cost, frames
from deepreduce import sums
from deepreduce.collectives.communicator import op_name
from deepreduce.collectives.ownership import Ownership
from deepreduce.collectives.transport import ThreadTransport
from deepreduce.errors import DecodeError

from collectives_workers import SCENARIOS, block_clustered, make_input

#: The communicators under test: "split", "recursive_doubling" and "auto" are
#: sparse_allreduce's algorithms; "auto" here weighs bytes alone, so that on these small
#: tensors it picks each of the three somewhere (the default network picks allgather).
NAMES = ("allgather", "split", "recursive_doubling", "auto", "block")
BY_BYTES = {"algorithm": "auto", "alpha_op": 0, "alpha": 0}
LOSSLESS = dr.Pipeline(index="eliasfano", value="raw")


def sparse_settings(name):
    return BY_BYTES if name == "auto" else {"algorithm": name}


def communicator(name, granule=None, **kwargs):
    """Build a communicator of :data:`NAMES`; block settings only reach "block"."""
    if name != "block":
        kwargs.pop("block_size", None)
        kwargs.pop("threshold", None)
    if name in ("split", "recursive_doubling", "auto"):
        comm = dc.SparseAllreduce(**sparse_settings(name), **kwargs)
    else:
        comm = dc.get_communicator(name, **kwargs)
    if granule is not None:
        comm.granule = granule
    return comm


def allreduce(x, name, member, **settings):
    """``dc.allreduce`` with a name of :data:`NAMES`."""
    if name in ("split", "recursive_doubling", "auto"):
        name, settings = "sparse_allreduce", dict(settings, **sparse_settings(name))
    return dc.allreduce(x, name, pipeline=LOSSLESS, transport=member, **settings)


def names_for(size):
    """Recursive doubling needs a power-of-two number of ranks."""
    return [name for name in NAMES if name != "recursive_doubling" or not size & (size - 1)]


def run_ranks(size, fn):
    """Run ``fn(member)`` for every member of a thread group; return the per-rank results."""
    members = ThreadTransport.group(size, timeout=30)
    with ThreadPoolExecutor(size) as pool:
        futures = [pool.submit(fn, member) for member in members]
        return [future.result(timeout=60) for future in futures]


def run_ranks_catching(size, fn):
    """Like :func:`run_ranks`, returning the exception each rank raised (or None)."""
    def catching(member):
        try:
            fn(member)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc
        return None
    return run_ranks(size, catching)


def reduce_everywhere(name, inputs, pipeline=LOSSLESS, **kwargs):
    return run_ranks(len(inputs), lambda m: communicator(
        name, pipeline=pipeline, transport=m, **kwargs).reduce(inputs[m.rank]))


# -- exactness ---------------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("name,size", [(name, size) for size in (1, 2, 3, 4, 5)
                                       for name in names_for(size)])
def test_lossless_equals_dense_sum(name, scenario, size):
    inputs = [make_input(scenario, size, r) for r in range(size)]
    expected = np.sum(inputs, axis=0)
    for x, reduction in zip(inputs, reduce_everywhere(name, inputs, block_size=16)):
        assert reduction.output.dtype == x.dtype
        np.testing.assert_array_equal(reduction.output, expected)
        np.testing.assert_array_equal(reduction.sent.to_dense(), x)


@settings(max_examples=60, deadline=None)
@given(size=st.integers(1, 5), n=st.integers(0, 400), density=st.floats(0, 1),
       block_size=st.integers(1, 40), index=st.sampled_from(
           ["eliasfano", "varint", "bitmap", "rle", "raw"]),
       op=st.sampled_from(["sum", "average"]), seed=st.integers(0, 2**16),
       granule=st.sampled_from([1, 3, 16, None]))
def test_random_inputs_exact(size, n, density, block_size, index, op, seed, granule):
    rng = np.random.default_rng(seed)
    inputs = [np.where(rng.random(n) < density, rng.integers(-9, 10, n), 0).astype(np.float32)
              for _ in range(size)]
    expected = np.sum(inputs, axis=0)
    if op == "average":
        expected = expected / np.float32(size)
    pipeline = dr.Pipeline(index=index, value="raw")
    for name in names_for(size):
        for reduction in reduce_everywhere(name, inputs, pipeline, op=op,
                                           block_size=block_size, granule=granule):
            np.testing.assert_array_equal(reduction.output, expected)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_general_floats_identical_across_communicators(dtype):
    # every communicator sums in float64, in rank order, and rounds once: bit-identical
    # results (for float64 inputs, the sequential sum in rank order)
    rng = np.random.default_rng(5)
    inputs = [np.where(rng.random(3000) < 0.2, rng.standard_normal(3000), 0).astype(dtype)
              for _ in range(4)]
    expected = np.sum(np.array(inputs, dtype=np.float64), axis=0).astype(dtype)
    for name in NAMES:
        reductions = reduce_everywhere(name, inputs, block_size=32)
        outputs = [r.output for r in reductions]
        assert all(o.tobytes() == outputs[0].tobytes() for o in outputs)
        if reductions[0].algorithm == "recursive_doubling":
            # its partial sums travel, so they are rounded to the dtype every round
            np.testing.assert_allclose(outputs[0], expected, rtol=4 * np.finfo(dtype).eps,
                                       atol=4 * np.finfo(dtype).eps)
        else:
            assert outputs[0].tobytes() == expected.tobytes()


def test_shapes_tensors_and_fusion():
    size = 4
    parts = [[make_input("overlap", size, r, n=m, seed=m).reshape(shape)
              for m, shape in ((60, (3, 4, 5)), (1, (1,)), (500, (500,)), (0, (0, 2)))]
             for r in range(size)]
    for name in NAMES:
        results = run_ranks(size, lambda m: communicator(
            name, pipeline=LOSSLESS, transport=m).reduce_many(parts[m.rank]))
        for r, reductions in enumerate(results):
            for i, reduction in enumerate(reductions):
                expected = np.sum([parts[q][i] for q in range(size)], axis=0)
                assert reduction.output.shape == parts[r][i].shape
                np.testing.assert_array_equal(reduction.output, expected)
                np.testing.assert_array_equal(reduction.sent.to_dense(), parts[r][i])


def test_sparse_tensor_input_and_sparsifier_residual():
    size = 4
    rng = np.random.default_rng(1)
    grads = [rng.integers(-50, 50, 4000).astype(np.float32) for _ in range(size)]
    pipeline = dr.Pipeline(dr.TopK(0.03), index="varint")
    for name in NAMES:
        reductions = reduce_everywhere(name, grads, pipeline)
        sent = [r.sent.to_dense() for r in reductions]
        for r, reduction in enumerate(reductions):
            np.testing.assert_array_equal(reduction.output, np.sum(sent, axis=0))
            kept = np.flatnonzero(sent[r])
            np.testing.assert_array_equal(sent[r][kept], grads[r][kept])
    sparse_inputs = [dr.SparseTensor.from_dense(g.reshape(40, 100)) for g in grads]
    for name in NAMES:
        for reduction in reduce_everywhere(name, sparse_inputs):
            assert reduction.output.shape == (40, 100)
            np.testing.assert_array_equal(reduction.output.reshape(-1), np.sum(grads, axis=0))


@pytest.mark.skipif("bloom" not in dr.registered_codecs("index"),
                    reason="no Bloom-filter index codec registered")
def test_lossy_index_codec_output_is_the_sum_of_what_was_sent():
    # Bloom false positives travel with their true values (from the dense input)
    rng = np.random.default_rng(6)
    inputs = [rng.standard_normal(20000).astype(np.float32) for _ in range(4)]
    pipeline = dr.Pipeline(dr.TopK(0.01), index="bloom")
    for name in ("allgather", "split", "recursive_doubling", "auto"):
        reductions = reduce_everywhere(name, inputs, pipeline)
        sent = [r.sent.to_dense() for r in reductions]
        np.testing.assert_allclose(reductions[0].output, np.sum(sent, axis=0), rtol=1e-6,
                                   atol=1e-6)
        for s, x in zip(sent, inputs):
            np.testing.assert_array_equal(s[s != 0], x[s != 0])
    with pytest.raises(ValueError, match="lossy"):
        dc.BlockReduce(pipeline)


def test_block_threshold_drops_small_blocks_into_the_residual():
    size = 3
    inputs = [block_clustered(size, r, n=2048, block=32) for r in range(size)]
    for x in inputs:
        x[5] = 0.25  # a block holding only a small value: left behind at threshold 0.5
    for reduction, x in zip(reduce_everywhere("block", inputs, block_size=32, threshold=0.5),
                            inputs):
        assert reduction.sent.to_dense()[5] == 0
        residual = x - reduction.sent.to_dense()
        assert np.abs(residual).max() <= 0.5
    exact = reduce_everywhere("block", inputs, block_size=32)
    np.testing.assert_array_equal(exact[0].output, np.sum(inputs, axis=0))


def test_lossy_values_same_everywhere():
    size = 4
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal(2000).astype(np.float32) for _ in range(size)]
    pipeline = dr.Pipeline(index="varint", value="fp16")
    for name in NAMES:
        reductions = reduce_everywhere(name, inputs, pipeline, block_size=64)
        outputs = [r.output for r in reductions]
        assert all(np.array_equal(outputs[0], o) for o in outputs)
        assert np.abs(outputs[0] - np.sum(inputs, axis=0)).max() < 0.02
        for reduction, x in zip(reductions, inputs):
            # what was sent is the fp16 rounding, except the own range of the owner-based
            # communicators, which never leaves the rank
            sent, rounded = reduction.sent.to_dense(), x.astype(np.float16).astype(np.float32)
            assert np.all((sent == rounded) | (sent == x))
            assert np.array_equal(sent, rounded) == (reduction.algorithm in (
                "allgather", "recursive_doubling"))


# -- the dense switch and the traffic ------------------------------------------------


def gathered(reduction):
    """Bytes of the last stage: the reduced ranges coming back (allgather or alltoall)."""
    return sum(received for stage, _, received in reduction.traffic.stages
               if stage in ("gather", "return"))


def test_return_masks_leave_out_what_a_rank_contributed_alone():
    from deepreduce.sums import return_masks

    supports = [np.array([1, 4, 7]), np.array([4, 9]), np.array([], dtype=np.int64)]
    union = np.array([1, 4, 7, 9])
    masks = return_masks(union, supports)
    assert [union[m].tolist() for m in masks] == [[4, 9], [1, 4, 7], [1, 4, 7, 9]]


@pytest.mark.parametrize("value", ["fp16", "bf16", "qsgd", "sign"])
def test_lossy_values_on_sparse_supports_same_everywhere(value):
    # little overlap: with elementwise codecs the owners return only what each rank lacks,
    # and every rank must still end with the same tensor
    size, n = 4, 4096
    rng = np.random.default_rng(9)
    inputs = [np.zeros(n, np.float32) for _ in range(size)]
    for x in inputs:
        x[rng.choice(n, 200, replace=False)] = rng.standard_normal(200)
    pipeline = dr.Pipeline(index="varint", value=value)
    for name in ("split", "block"):
        reductions = reduce_everywhere(name, inputs, pipeline, block_size=16)
        outputs = [r.output for r in reductions]
        assert all(np.array_equal(outputs[0], o) for o in outputs), (name, value)
        last_stage = reductions[0].traffic.stages[-1][0]
        assert last_stage == ("return" if value in ("fp16", "bf16") else "gather")


@pytest.mark.parametrize("name", ["split", "block"])
def test_reduced_ranges_switch_to_dense(name):
    size, n = 4, 8000
    dense_inputs = [make_input("dense_after", size, r, n=n) for r in range(size)]
    reductions = reduce_everywhere(name, dense_inputs, block_size=16)
    np.testing.assert_array_equal(reductions[0].output, np.sum(dense_inputs, axis=0))
    dense_range = n // size * 4
    assert gathered(reductions[0]) <= (size - 1) * (dense_range + 100)
    rng = np.random.default_rng(4)
    sparse_inputs = [np.zeros(n, np.float32) for _ in range(size)]
    for x in sparse_inputs:
        x[rng.choice(n, 40, replace=False)] = 1
    assert gathered(reduce_everywhere(name, sparse_inputs, block_size=16)[0]) < \
        (size - 1) * dense_range / 2


def test_measured_traffic_matches_the_cost_model_and_split_beats_allgather():
    size, n, k = 4, 400_000, 4000
    rng = np.random.default_rng(3)
    inputs = [dr.SparseTensor(rng.standard_normal(k).astype(np.float32),
                              np.sort(rng.choice(n, k, replace=False)), (n,))
              for _ in range(size)]
    rate = cost.codec_index_bytes(LOSSLESS.index_codec, n // size)
    union, others = cost.union_size(n, k, size), cost.union_size(n, k, size - 1)
    qsgd = dr.get_codec("qsgd:bits=8", family="value")
    models = {"allgather": cost.allgather(size, n, k, rate, 4),
              "split": cost.sparse_allreduce(size, n, k, union, rate, 4, others=others),
              "split-qsgd": cost.sparse_allreduce(size, n, k, union, rate,
                                                  len(qsgd.encode(inputs[0].values)) / k),
              "recursive_doubling": cost.recursive_doubling(size, n, k, rate, 4)}
    received = {}
    for name, model in models.items():
        if name == "split-qsgd":  # QSGD is not elementwise: every rank gets the same range
            pipeline = dr.Pipeline(index=LOSSLESS.index_codec, value=qsgd)
            reductions = reduce_everywhere("split", inputs, pipeline)
        else:
            reductions = reduce_everywhere(name, inputs)
        received[name] = np.mean([r.traffic.received for r in reductions])
        sent = np.mean([r.traffic.sent for r in reductions])
        # ThreadTransport carries no 8-byte length prefixes: allow for them
        assert abs(received[name] / model.received - 1) < 0.05, \
            (name, received[name], model.received)
        assert abs(sent / model.sent - 1) < 0.05, (name, sent, model.sent)
    # random supports barely overlap, yet returning only what each rank lacks wins
    assert received["split"] < received["allgather"]


def test_cost_model_properties():
    n, k = 10**6, 10**4
    assert cost.union_size(n, k, 4, shared=1.0) == pytest.approx(k)
    assert cost.union_size(n, k, 1) == pytest.approx(k)
    assert cost.union_size(n, n, 3) == pytest.approx(n)
    with pytest.raises(ValueError, match="shared"):
        cost.union_size(n, k, 4, shared=1.5)
    ag = cost.allgather(8, n, k, 1.0, 4)
    sar = cost.sparse_allreduce(8, n, k, cost.union_size(n, k, 8), 1.0, 4)
    dense = cost.dense_allreduce(8, n, 4)
    assert dense.received == pytest.approx(2 * 7 / 8 * n * 4)
    assert sar.received < dense.received and ag.received < dense.received
    # identical supports: split-allgather receives about 2 (P-1)/P k, allgather (P-1) k
    same = cost.sparse_allreduce(8, n, k, k, 1.0, 4, overhead=0)
    assert same.received == pytest.approx(2 * 7 / 8 * k * 5 - 0 + 7 * cost.SIGNATURE)
    # a dense sum costs at most n / P values per range
    full = cost.sparse_allreduce(4, n, n // 2, n, 1.0, 4, overhead=0)
    assert full.received == pytest.approx(3 / 4 * n / 2 * 5 + 3 * cost.SIGNATURE + 3 * n / 4 * 4)
    assert cost.recursive_doubling(1, n, k, 1.0, 4).received == 0
    with pytest.raises(ValueError, match="power-of-two"):
        cost.recursive_doubling(6, n, k, 1.0, 4)
    assert cost.entropy_index_bytes(0.01) == pytest.approx(dr.index_entropy_bits(10**6, 10**4)
                                                           / 8, rel=1e-3)
    assert cost.Cost(1, 100, 2, 6).time(beta=0.01, alpha=1, alpha_op=10) == 27


def test_received_per_rank_counts_both_stages_of_the_reducing_communicators():
    n, k, P, pair = 10**6, 10**4, 4, 3.2  # a pair: a 1.2-byte index and an fp16 value
    allgather = cost.received_per_rank("allgather", P, n, k, pair)
    split = cost.received_per_rank("sparse_allreduce", P, n, k, pair, value_bytes=2)
    assert allgather == pytest.approx(cost.allgather(P, n, k, pair, 0).received)
    assert split == pytest.approx(cost.sparse_allreduce(
        P, n, k, cost.union_size(n, k, P), pair - 2, 2,
        others=cost.union_size(n, k, P - 1)).received)
    # random supports barely overlap: the owners return about what the other ranks sent,
    # so a rank receives about as much as from the allgather (the scatter alone: a quarter)
    assert split == pytest.approx(allgather, rel=0.05)
    with pytest.raises(ValueError, match="value_bytes"):
        cost.received_per_rank("sparse_allreduce", P, n, k, 1.5, value_bytes=2)


def agreed_table(inputs, pipeline=LOSSLESS):
    """The (nnz, index bytes, value bytes) every rank announces under algorithm="auto"."""
    table = []
    for x in inputs:
        payload, _ = pipeline.encode_sparse(dr.SparseTensor.from_dense(x))
        header = container.read_header(payload)
        table.append((int(np.count_nonzero(x)), header.index_length, header.value_length))
    return table


@pytest.mark.parametrize("case,count,network,expected", [
    # disjoint: no entry goes back to the rank it came from, and the others' entries
    # arrive from each owner as one denser set (fewer bits per index) than in an allgather
    ("disjoint", 2000, BY_BYTES, lambda a: a == "split"),
    # the union is estimated as for independent supports: identical ones win the split
    # only where the model already prefers it (dense enough that ranges go dense)
    ("identical", 16000, BY_BYTES, lambda a: a == "split"),
    ("identical", 2000, {}, lambda a: a == "allgather"),  # small: one operation beats two
])
def test_auto_choice_is_the_cost_models_argmin(case, count, network, expected):
    size, n = 4, 40_000
    rng = np.random.default_rng(8)
    common = rng.choice(n, count, replace=False)
    inputs = []
    for r in range(size):
        x = np.zeros(n, np.float32)
        x[np.arange(r, n, size)[:count] if case == "disjoint" else common] = r + 1
        inputs.append(x)
    reductions = run_ranks(size, lambda m: dc.SparseAllreduce(
        LOSSLESS, transport=m, **network).reduce(inputs[m.rank]))
    comm = dc.SparseAllreduce(LOSSLESS, **network)
    argmin = comm.choose(size, n, agreed_table(inputs))
    assert {r.algorithm for r in reductions} == {argmin} and expected(argmin)
    for reduction in reductions:
        np.testing.assert_array_equal(reduction.output, np.sum(inputs, axis=0))
    # the model's own argmin, recomputed from the announced sizes
    table = agreed_table(inputs)
    total = sum(t[0] for t in table)
    floor = cost.entropy_index_bytes(total / size / n)
    rate = lambda d: sum(t[1] for t in table) / total * cost.entropy_index_bytes(d) / floor  # noqa: E731
    times = {name: c.time(comm.beta, comm.alpha, comm.alpha_op) for name, c in
             cost.choose_algorithm(size, n, [t[0] for t in table], rate,
                                   sum(t[2] for t in table) / total, comm.alpha_op,
                                   comm.alpha, comm.beta)[1].items()}
    assert times[argmin] == min(times.values())


def test_auto_picks_every_algorithm_and_agrees_everywhere():
    size, chosen = 4, set()
    for scenario in SCENARIOS:
        inputs = [make_input(scenario, size, r) for r in range(size)]
        reductions = reduce_everywhere("auto", inputs)
        assert len({r.algorithm for r in reductions}) == 1
        chosen.add(reductions[0].algorithm)
        np.testing.assert_array_equal(reductions[0].output, np.sum(inputs, axis=0))
        stages = [stage for stage, _, _ in reductions[0].traffic.stages]
        assert stages[0] == "agree"
    # by bytes, allgather never beats recursive doubling; the default network picks it
    # for small tensors (test_auto_choice_is_the_cost_models_argmin)
    assert chosen == {"split", "recursive_doubling"}
    # P not a power of two: recursive doubling is never a candidate
    inputs = [make_input("disjoint", 3, r) for r in range(3)]
    assert reduce_everywhere("auto", inputs)[0].algorithm != "recursive_doubling"
    # the default network: the default algorithm is auto
    assert dc.SparseAllreduce(LOSSLESS).algorithm == "auto"
    with pytest.raises(ValueError, match="alpha_op"):
        dc.SparseAllreduce(LOSSLESS, alpha_op=-1)
    errors = run_ranks_catching(2, lambda m: dc.SparseAllreduce(
        LOSSLESS, transport=m, beta=1e-9 * (m.rank + 1)).reduce(np.ones(4, np.float32)))
    assert all(isinstance(e, ValueError) and "network" in str(e) for e in errors)
    errors = run_ranks_catching(2, lambda m: dc.SparseAllreduce(
        LOSSLESS, transport=m, algorithm="auto" if m.rank else "split").reduce(
            np.ones(4, np.float32)))
    assert all(isinstance(e, ValueError) and "algorithm" in str(e) for e in errors)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 300), parts=st.integers(1, 6), granule=st.integers(1, 40),
       unit=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_ownership_is_a_bijection(n, parts, granule, unit, seed):
    owners = Ownership.of(n, parts, granule, unit)
    assert owners.granule % unit == 0
    assert sum(owners.length(r) for r in range(parts)) == n
    x = np.random.default_rng(seed).random(n)
    rebuilt = np.full(n, -1.0)
    indices = np.flatnonzero(x < 0.5)
    order, cuts, local = owners.split(indices)
    for r in range(parts):
        mine = owners.take(x, r)
        assert mine.size == owners.length(r)
        owners.place(rebuilt, r, mine)
        chosen = order[cuts[r]:cuts[r + 1]]
        assert np.all(np.diff(local[chosen]) > 0) and np.all(local[chosen] < mine.size)
        np.testing.assert_array_equal(owners.to_global(r, local[chosen]), indices[chosen])
        np.testing.assert_array_equal(mine[local[chosen]], x[indices[chosen]])
    np.testing.assert_array_equal(rebuilt, x)


def test_interleaved_ownership_balances_clustered_inputs():
    # hot rows at low ids: contiguous ranges load owner 0, granules spread the load
    size, n, rows = 4, 1 << 16, 64
    rng = np.random.default_rng(9)
    inputs = []
    for r in range(size):
        x = np.zeros(n, np.float32)
        hot = np.unique(rng.zipf(1.3, 300) - 1)
        hot = hot[hot < n // rows]
        x[(hot[:, None] * rows + np.arange(rows)).reshape(-1)] = r + 1
        inputs.append(x)
    for name in ("split", "block"):
        loads = {}
        for granule in (n, 1024):
            reductions = reduce_everywhere(name, inputs, block_size=rows, granule=granule)
            np.testing.assert_array_equal(reductions[0].output, np.sum(inputs, axis=0))
            loads[granule] = max(r.traffic.stages[0][2] for r in reductions)
        assert loads[1024] < 0.6 * loads[n], loads


def test_counts_frames():
    frame = frames.counts_frame(5, 300, 20)
    assert frames.read_counts(frame, 10) == (5, 300, 20)
    for cut in range(len(frame)):
        with pytest.raises(DecodeError):
            frames.read_counts(frame[:cut], 10)
    for bad in (frame + b"\0", frames.counts_frame(11, 0, 0), b"\x01\x00\x00\x00"):
        with pytest.raises(DecodeError):
            frames.read_counts(bad, 10)


@pytest.mark.parametrize("module", ["cost", "transport", "ownership", "allgather",
                                    "sparse_allreduce", "block"])
def test_docstring_examples(module):
    result = doctest.testmod(importlib.import_module(f"deepreduce.collectives.{module}"),
                             optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted and not result.failed


# -- asynchronous use -------------------------------------------------------------------


def test_async_handles_give_the_same_results():
    size = 4
    inputs = [[make_input(s, size, r, seed=i) for i, s in enumerate(SCENARIOS)]
              for r in range(size)]
    expected = [np.sum([inputs[r][i] for r in range(size)], axis=0)
                for i in range(len(SCENARIOS))]

    def rank_main(member):
        comms = [communicator(name, pipeline=LOSSLESS, transport=member) for name in NAMES]
        handles = [comm.reduce_async(x) for x in inputs[member.rank] for comm in comms]
        return [h.wait(timeout=30).output for h in handles]

    for outputs in run_ranks(size, rank_main):
        for i, out in enumerate(outputs):
            np.testing.assert_array_equal(out, expected[i // len(NAMES)])


# -- errors: every rank raises, nobody hangs ----------------------------------------------


def test_mismatched_shapes_raise_on_every_rank():
    for name in NAMES:
        errors = run_ranks_catching(4, lambda m: allreduce(
            np.ones(10 + (m.rank == 2), np.float32), name, m))
        assert all(isinstance(e, ValueError) for e in errors)
        assert len({str(e) for e in errors}) == 1
        assert "shapes: 10 on ranks 0, 1, 3; 11 on rank 2" in str(errors[0])


def test_mismatched_dtype_and_block_size_raise_on_every_rank():
    errors = run_ranks_catching(2, lambda m: dc.allreduce(
        np.ones(10, np.float64 if m.rank else np.float32), "sparse_allreduce",
        pipeline=LOSSLESS, transport=m))
    assert all("dtype: float32 on rank 0; float64 on rank 1" in str(e) for e in errors)
    errors = run_ranks_catching(2, lambda m: dc.block_allreduce(
        np.ones(10, np.float32), LOSSLESS, block_size=8 + m.rank, transport=m))
    assert all("block_size: 8 on rank 0; 9 on rank 1" in str(e) for e in errors)


@pytest.mark.parametrize("name", NAMES)
def test_bad_argument_on_one_rank_raises_everywhere(name):
    def rank_main(member):
        settings = {"block_size": 0 if member.rank == 1 else 4} if name == "block" else {}
        allreduce(np.ones(10, np.float32), name, member, **settings)

    errors = run_ranks_catching(4, rank_main)
    if name == "block":
        assert all(isinstance(e, ValueError) and "block_size" in str(e) for e in errors)
        assert "rank 1" in str(errors[0]) and "rank 1" in str(errors[2])
    else:
        assert errors == [None] * 4

    def bad_input(member):
        x = np.array(["not", "numbers"]) if member.rank == 0 else np.ones(2, np.float32)
        allreduce(x, name, member)

    errors = run_ranks_catching(4, bad_input)
    assert all(isinstance(e, ValueError) for e in errors), errors
    assert "rank 0" in str(errors[1])
    # the group is still in step afterwards
    outputs = run_ranks(4, lambda m: allreduce(np.full(4, m.rank, np.float32), name, m))
    np.testing.assert_array_equal(outputs[0], np.full(4, 6, np.float32))


def test_recursive_doubling_needs_a_power_of_two():
    errors = run_ranks_catching(3, lambda m: allreduce(np.ones(5, np.float32),
                                                       "recursive_doubling", m))
    assert all(isinstance(e, ValueError) and "power-of-two" in str(e) for e in errors)
    with pytest.raises(ValueError, match="algorithm"):
        dc.SparseAllreduce(LOSSLESS, algorithm="ring")


def test_many_fused_tensors_and_their_mismatch():
    shapes = [(i % 7 + 1, 3) for i in range(200)]
    outputs = run_ranks(2, lambda m: dc.SparseAllreduce(LOSSLESS, transport=m).reduce_many(
        [np.full(shape, m.rank + 1, np.float32) for shape in shapes]))
    assert all(np.array_equal(r.output, np.full(s, 3, np.float32))
               for r, s in zip(outputs[1], shapes))
    errors = run_ranks_catching(2, lambda m: dc.SparseAllreduce(LOSSLESS, transport=m)
                                .reduce_many([np.ones(s, np.float32)
                                              for s in shapes[:len(shapes) - m.rank]]))
    assert all(isinstance(e, ValueError) and "200 tensors" in str(e) and "199 tensors" in str(e)
               for e in errors)


def test_mixed_dtypes_in_reduce_many_raise_everywhere():
    errors = run_ranks_catching(2, lambda m: dc.SparseAllreduce(LOSSLESS, transport=m)
                                .reduce_many([np.ones(3, np.float32), np.ones(3)]))
    assert all(isinstance(e, ValueError) and "one dtype" in str(e) for e in errors)


def test_local_argument_errors():
    with pytest.raises(ValueError, match="block_size"):
        dc.BlockReduce(LOSSLESS, block_size=0)
    with pytest.raises(ValueError, match="block_size"):
        dc.BlockReduce(LOSSLESS, block_size=2.5)
    with pytest.raises(ValueError, match="threshold"):
        dc.BlockReduce(LOSSLESS, threshold=-1)
    with pytest.raises(ValueError, match="unknown communicator"):
        dc.get_communicator("ring")
    with pytest.raises(ValueError, match="op must be"):
        dc.SparseAllreduce(LOSSLESS, op="max")
    with pytest.raises(ValueError, match="Pipeline"):
        dc.SparseAllreduce("topk")
    member = ThreadTransport.group(1)[0]
    with pytest.raises(ValueError, match="not both"):
        dc.SparseAllreduce(LOSSLESS, process_set=object(), transport=member)
    with pytest.raises(ValueError, match="own settings"):
        dc.allreduce(np.ones(2), dc.SparseAllreduce(LOSSLESS, transport=member),
                     op="average")
    with pytest.raises(ValueError, match="at least one member"):
        ThreadTransport.group(0)


def test_no_default_transport_and_only_named_ops():
    # the collectives know no framework: without a transport they say what to pass
    comm = dc.SparseAllreduce(LOSSLESS)  # built without one (the exchanges do that)
    for start in (lambda: comm.reduce(np.ones(4, np.float32)),
                  lambda: dc.allreduce(np.ones(4, np.float32), "block", pipeline=LOSSLESS),
                  lambda: dc.allreduce(np.ones(4, np.float32), "block", block_size=0)):
        with pytest.raises(ValueError, match="no transport") as error:
            start()
        assert "deepreduce.horovod.collectives" in str(error.value)
        assert "deepreduce.torch.transport.TorchTransport" in str(error.value)
    with pytest.raises(ValueError, match="process_set alone .*horovod_transport"):
        dc.BlockReduce(LOSSLESS, process_set=object()).reduce(np.ones(4, np.float32))
    assert [op_name(op) for op in ("sum", "Average", "MEAN")] == ["sum", "average",
                                                                       "average"]
    for framework_constant in (0, 1, None):  # hvd.Average, hvd.Sum: the Horovod layer's
        with pytest.raises(ValueError, match="deepreduce.horovod.collectives"):
            op_name(framework_constant)


# -- frames: malformed input raises DecodeError -------------------------------------------


def sample_frames():
    st_ = dr.SparseTensor(np.array([1.5, -2.0, 3.0], np.float32), [1, 7, 30], (40,))
    payload, _ = LOSSLESS.encode_sparse(st_)
    values = np.arange(40, dtype=np.float32)
    index_codec = LOSSLESS.index_codec
    rows = np.arange(16, dtype=np.float32).reshape(2, 8)
    return [
        (frames.sparse_frame(payload), None),
        (frames.dense_frame(values.tobytes(), np.dtype(np.float32), 40, "raw"), None),
        (frames.blocks_frame(index_codec.encode(np.array([0, 4]), 5), rows.tobytes(),
                             np.dtype(np.float32), 5, 8, 2, index_codec.spec(), "raw"), 8),
    ]


def test_frames_round_trip():
    sparse, dense, blocks = (frames.read_frame(f, 40, np.dtype(np.float32), b)
                             for f, b in sample_frames())
    assert sparse.indices.tolist() == [1, 7, 30]
    assert dense.tolist() == list(range(40))
    assert blocks.ids.tolist() == [0, 4] and blocks.rows.shape == (2, 8)
    with pytest.raises(frames.PeerError, match="out of memory"):
        frames.read_frame(frames.error_frame("out of memory"), 40, np.dtype(np.float32))
    signature, rest = frames.read_signed(frames.signed("a=1;b=2", b"xyz"))
    assert signature == "a=1;b=2" and bytes(rest) == b"xyz"


def test_malformed_frames_raise_decode_error():
    rng = np.random.default_rng(0)
    for frame, block_size in sample_frames():
        for cut in range(len(frame)):
            with pytest.raises(DecodeError):
                frames.read_frame(frame[:cut], 40, np.dtype(np.float32), block_size)
        for position in range(1, len(frame)):
            corrupt = bytearray(frame)
            corrupt[position] ^= 1 << int(rng.integers(8))
            with pytest.raises(DecodeError):
                frames.read_frame(bytes(corrupt), 40, np.dtype(np.float32), block_size)
        with pytest.raises(DecodeError):
            frames.read_frame(frame + b"\0", 40, np.dtype(np.float32), block_size)
        with pytest.raises(DecodeError):  # a frame about another range length
            frames.read_frame(frame, 41, np.dtype(np.float32), block_size)
        with pytest.raises(DecodeError):
            frames.read_frame(frame, 40, np.dtype(np.float64), block_size)
    with pytest.raises(DecodeError, match="unknown frame kind"):
        frames.read_frame(b"\x09abc", 40, np.dtype(np.float32))
    for bad in (b"", b"\x85", b"\x05ab", b"\x01\xff"):
        with pytest.raises(DecodeError):
            frames.read_signed(bad)


# -- real Horovod ranks -------------------------------------------------------------------

HOROVOD = importlib.util.find_spec("horovod") is not None and \
    importlib.util.find_spec("tensorflow") is not None


@pytest.mark.skipif(not HOROVOD, reason="horovod with TensorFlow is not installed")
@pytest.mark.parametrize("size", [2, 4])
def test_horovod_ranks(size):
    horovodrun = Path(sys.executable).with_name("horovodrun")
    script = Path(__file__).with_name("collectives_workers.py")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    done = subprocess.run([str(horovodrun), "-np", str(size), "-H", f"localhost:{size}",
                           "--gloo", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=300, env=env)
    runs = [json.loads(line.split("RESULT ", 1)[1]) for line in done.stdout.splitlines()
            if "RESULT " in line]
    assert done.returncode == 0 and len(runs) == size, done.stdout[-3000:] + done.stderr[-3000:]
    names = {tuple(name for name, _, _ in run["results"]) for run in runs}
    assert len(names) == 1 and len(next(iter(names))) > 50
    failures = [f"rank {run['rank']} {name}: {detail}" for run in runs
                for name, ok, detail in run["results"] if not ok]
    assert not failures, "\n".join(failures)


@settings(max_examples=100, deadline=None)
@given(parts=st.lists(st.lists(st.integers(0, 300), max_size=60, unique=True), max_size=5))
def test_sum_sparse_unions_sorted_parts_like_np_unique(parts):
    length = 301
    parts = [dr.SparseTensor._trusted(np.arange(1, len(p) + 1, dtype=np.float32),
                                      np.array(sorted(p), dtype=np.int64), (length,))
             for p in parts]
    indices = np.concatenate([p.indices for p in parts] + [np.zeros(0, np.int64)])
    support, inverse = sums._union(indices)
    expected_support, expected_inverse = np.unique(indices, return_inverse=True)
    np.testing.assert_array_equal(support, expected_support)
    np.testing.assert_array_equal(inverse, expected_inverse.ravel())
    total = sums.sum_sparse(parts, length, np.float32)
    dense = sum((p.to_dense() for p in parts), np.zeros(length, np.float32))
    np.testing.assert_array_equal(total.to_dense(), dense)
