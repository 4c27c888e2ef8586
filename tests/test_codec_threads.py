"""Codec threads: a bundle's payloads coded and decoded side by side, the compiled loops
without the GIL, and nothing that travels or stays behind changed by either."""

import importlib
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import deepreduce as dr
from deepreduce.exchange import gathering, parallel
from deepreduce.codecs.index import _entropy, bloom, golomb
from deepreduce.codecs.values import floats, qsgd
from deepreduce import sums
from deepreduce.config import ExchangeConfig
from deepreduce.exchange import GradientExchange
from deepreduce.sparse import SparseTensor

# ------------------------------------------------------------------- the setting


def test_codec_threads_is_none_or_a_positive_integer():
    assert ExchangeConfig().codec_threads is None
    assert ExchangeConfig(codec_threads=np.int64(3)).codec_threads == 3
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="codec_threads must be None"):
            ExchangeConfig(codec_threads=bad)


def test_automatic_threads_are_the_ranks_share_of_its_cores(monkeypatch):
    monkeypatch.setattr(parallel, "available_cores", lambda: 16)
    monkeypatch.setattr(parallel.os, "cpu_count", lambda: 16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("HOROVOD_LOCAL_SIZE", raising=False)
    assert parallel.codec_threads(None) == parallel.MAX_CODEC_THREADS  # capped
    assert parallel.codec_threads(7) == 7                               # as set
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert parallel.codec_threads(None) == 2                            # 16 cores, 8 ranks
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert parallel.codec_threads(None) == 1
    # a rank pinned to 3 of the 16 cores has them to itself
    monkeypatch.setattr(parallel, "available_cores", lambda: 3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert parallel.codec_threads(None) == 3
    # horovodrun says how many ranks share the host in its own variable
    monkeypatch.setattr(parallel, "available_cores", lambda: 16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("HOROVOD_LOCAL_SIZE", "8")
    assert parallel.codec_threads(None) == 2


def test_run_in_order_gives_a_loops_results_and_its_first_error():
    assert parallel.run_in_order(lambda x: 2 * x, range(50), threads=3,
                                 cost=lambda x: x % 7) == [2 * x for x in range(50)]
    ran = []

    def fails_at_odd(x):
        ran.append(x)
        if x % 2:
            raise KeyError(x)
        return x

    # every item runs, and the error is the one a loop would have raised first
    with pytest.raises(KeyError, match="1"):
        parallel.run_in_order(fails_at_odd, range(20), threads=3, cost=lambda x: x)
    assert sorted(ran) == list(range(20))


def test_run_in_order_keeps_light_items_on_the_callers_thread():
    def where(x):
        return threading.current_thread() is threading.main_thread()

    # (one heavy item is not worth a second thread)
    assert all(parallel.run_in_order(where, range(30), threads=3, cost=lambda x: x, least=29))
    on_caller = parallel.run_in_order(where, range(30), threads=3, cost=lambda x: x, least=20)
    assert all(on_caller[:20])


#: Tensors below this many elements share payloads, of this many elements at most, in
#: these tests: the exchange's own bounds, in the millions, would make them slow.
SHARED_BELOW = 1 << 16


@pytest.fixture(autouse=True)
def smaller_shared_payloads(monkeypatch):
    monkeypatch.setattr(gathering, "SHARED_BELOW", SHARED_BELOW)
    monkeypatch.setattr(gathering, "PAYLOAD_ELEMENTS", SHARED_BELOW)


@pytest.fixture
def every_coding_on_threads(monkeypatch):
    """Small tensors on the codec threads too (they keep to the caller's otherwise)."""
    monkeypatch.setattr(gathering, "PARALLEL_ENTRIES", 0)
    monkeypatch.setattr(gathering, "PARALLEL_BYTES", 0)


# --------------------------------------------------------- the same bytes and sums


def gradients(rng, step):
    """Every kind of tensor a bundle holds: large ones with payloads of their own,
    mid-sized ones that share their selections' payload, small ones that share a
    lossless payload, and a sparse (row) gradient."""
    sizes = [3 * SHARED_BELOW, 2 * SHARED_BELOW + 5, SHARED_BELOW, 5000, 3000, 100, 7]
    grads = [rng.standard_normal(size).astype(np.float32) * (1 + step) for size in sizes]
    rows = np.sort(rng.choice(2000, 40, replace=False))
    grads.append(SparseTensor(rng.standard_normal(40 * 16).astype(np.float32),
                              (rows[:, None] * 16 + np.arange(16)).reshape(-1), (2000, 16)))
    return grads


@pytest.mark.parametrize("settings", [
    {},                                                     # Top-1%, auto, fp16
    {"value": "qsgd:bits=4"},                               # a random stream per tensor
    {"sparsifier": "randomk:0.02", "index": "bloom:fpr=0.01", "value": "bf16"},
    {"index": "huffman", "value": "raw", "error_feedback": False},
], ids=["default", "qsgd", "randomk-bloom", "huffman"])
def test_threads_code_the_same_bundles_sums_and_residuals(settings, every_coding_on_threads):
    names = [f"t{i}" for i in range(8)]
    ranks = 3
    runs = {}
    for threads in (1, 3):
        rng = np.random.default_rng(5)
        exchanges = [GradientExchange(codec_threads=threads, **settings)
                     for _ in range(ranks)]
        steps = []
        for step in range(3):
            bundles = [ex.encode_bundle(names, gradients(rng, step)) for ex in exchanges]
            sums = exchanges[1].decode_bundles(bundles, ranks=ranks, rank=1)
            steps.append((bundles, sums))
        runs[threads] = steps, [ex.selector.state_dict() for ex in exchanges]
    (one, one_states), (three, three_states) = runs[1], runs[3]
    for (bundles, sums), (bundles3, sums3) in zip(one, three):
        assert bundles == bundles3
        for a, b in zip(sums, sums3):
            if isinstance(a, tuple):
                a, b = np.concatenate([a[0].ravel(), a[1]]), np.concatenate([b[0].ravel(), b[1]])
            np.testing.assert_array_equal(a, b)
    for state, state3 in zip(one_states, three_states):
        assert state["random_state"] == state3["random_state"]
        assert state["residuals"].keys() == state3["residuals"].keys()
        for name, residual in state["residuals"].items():
            np.testing.assert_array_equal(residual, state3["residuals"][name])


def test_a_failed_coding_on_threads_raises_the_first_and_leaves_every_residual(
        monkeypatch, every_coding_on_threads):
    ex = GradientExchange(sparsifier=dr.TopK(0.01), value="fp16", codec_threads=3)
    rng = np.random.default_rng(3)
    names = ["s1", "s2", "a", "b", "c"]
    grads = [rng.standard_normal(size).astype(np.float32)
             for size in (2048, 4096, SHARED_BELOW, 4 * SHARED_BELOW, SHARED_BELOW)]
    ex.encode_bundle(names, grads)
    owed = [g + ex.selector.memory.residual(name) for name, g in zip(names, grads)]

    def failing(name):
        def encode_sparse(selected, dense=None):
            raise RuntimeError(f"coding {name} failed")
        return encode_sparse

    for name in ("b", "c"):  # b (the larger, coded first on the threads) comes first
        monkeypatch.setattr(ex.selector.pipeline_of(name), "encode_sparse", failing(name))
    with pytest.raises(RuntimeError, match="coding b failed"):
        ex.encode_bundle(names, grads)
    for name, expected in zip(names, owed):
        np.testing.assert_array_equal(ex.selector.memory.residual(name), expected)


def test_codings_that_share_a_random_stream_stay_on_one_thread():
    # one QSGD object in every pipeline (a custom selector might hand out such): its
    # draws depend on the order of the codings, so they must keep the bundle's order
    ex = GradientExchange(value="qsgd:bits=4", codec_threads=3)
    shared = ex.selector.pipeline_of("x").value_codec
    codings = [(ex.selector.pipeline_of(name), None, None) for name in ("x", "y")]
    assert ex._allgather._threads(codings) == 3
    ex.selector.pipeline_of("y").value_codec = shared
    assert ex._allgather._threads(codings) == 1


@pytest.mark.skipif(not (Path(__file__).resolve().parent.parent / "benchmarks").is_dir(),
                    reason="the benchmarks live in the checkout (not in an installed wheel)")
def test_the_benchmark_compares_the_settings_on_the_same_bytes(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent))
    benchmark = importlib.import_module("benchmarks.codec_threads")
    shapes = [(300, 300), (200, 400), (64,), (40, 30)]
    monkeypatch.setitem(benchmark.MODELS, "tiny", lambda: shapes)
    out = tmp_path / "threads.md"
    benchmark.main(["--models", "tiny", "--steps", "1", "--out", str(out)])
    written = json.loads(out.with_suffix(".json").read_text())
    assert set(written["handover_speedups"]) == {"1", "4", "16"}
    assert all(speedup > 0 for speedup in written["handover_speedups"].values())
    record = written["models"]["tiny"]
    assert record["parameters"] == 90000 + 80000 + 64 + 1200
    assert set(record["settings"]) == {"1", "2", "2, every payload"}
    assert record["payloads"] == 4  # (alone: the two above SHARED_BELOW, one of each kind)
    assert 0 < record["gil_free_speedup_best"]
    assert "| tiny | 1 |" in out.read_text() and "| 2, GIL-free reference |" in out.read_text()


# ---------------------------------------------------------- the GIL, released


def runs_beside(call) -> bool:
    """Whether another thread runs Python while ``call()`` runs.

    With a switch interval longer than the test, the calling thread keeps the
    GIL until it blocks or a compiled function releases it: the other thread,
    started just before the call and waiting for the GIL, sees ``inside``
    set only if something in the call released it.
    """
    inside, seen, go = [False], [], threading.Lock()
    go.acquire()

    def other():
        with go:
            seen.append(inside[0])

    interval = sys.getswitchinterval()
    # (set before the thread starts: no wait for the GIL may then end in a request
    # that the caller drop it)
    sys.setswitchinterval(1000.0)
    thread = threading.Thread(target=other)
    try:
        thread.start()
        inside[0] = True
        go.release()  # the other thread now waits for the GIL
        call()
        inside[0] = False
    finally:
        sys.setswitchinterval(interval)
        thread.join()
    return seen[0]


#: The compiled functions that keep the GIL, and why.
KEEP_THE_GIL = {
    "huffman_depths": "a tree of at most 256 leaves: shorter than handing the GIL over",
}

#: The extension modules of the codec loops (and of the selection and the sums).
EXTENSIONS = [(module, attribute) for module, attribute in (
    (_entropy, "_entropyc"), (floats, "_halfcast"), (qsgd, "_qsgd"), (bloom, "_bloomscan"),
    (dr.bits, "_varint"), (dr.sparsifiers, "_topkscan"), (sums, "_sparsesum"))
    if getattr(module, attribute, None) is not None]


def record_compiled_calls(monkeypatch) -> dict:
    """``{name: (function, args)}``: the largest call of every compiled function made by
    the codecs, the sparsifier and the sum on large inputs."""
    calls = {}

    def recording(name, function):
        def call(*args):
            size = sum(np.asarray(a).nbytes if isinstance(a, (np.ndarray, bytes)) else 0
                       for a in args)
            if size >= calls.get(name, (None, (), -1))[2]:
                copies = tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args)
                calls[name] = (function, copies, size)
            return function(*args)
        return call

    for module, attribute in EXTENSIONS:
        extension = getattr(module, attribute)
        for name in dir(extension):
            function = getattr(extension, name)
            if callable(function) and not name.startswith("_") and not isinstance(function, type):
                monkeypatch.setattr(extension, name, recording(name, function))
    rng = np.random.default_rng(0)
    n = 1 << 24
    indices = np.sort(rng.choice(n, 1 << 20, replace=False)).astype(np.int64)
    values = rng.standard_normal(indices.size).astype(np.float32)
    part = SparseTensor._trusted(values, indices, (n,))
    for index, value in (("golomb", "fp16"), ("huffman", "qsgd:bits=4"), ("blockpack", "raw"),
                         ("runs", "raw"), ("varint", "raw"), ("auto", "raw"),
                         ("bloom:fpr=0.01", "raw")):
        payload, _ = dr.Pipeline(None, index=index, value=value).encode_sparse(part)
        dr.decompress(payload)
    dense = rng.standard_normal(n).astype(np.float32)
    dr.TopK(0.01)(dense)
    dr.sparsifiers._at_least(dense, np.float32(2.5))
    golomb.field_bits(np.diff(indices), 16)
    sums.sum_sorted_into(np.zeros(n, np.float32), [part, part])
    sums.localize_sorted(indices.copy(), [n // 3, n // 2, n])
    calls = {name: (function, args) for name, (function, args, _) in calls.items()}
    # samples are small (and loops that small keep the GIL): the whole array instead
    if "sampled_low" in calls:
        function, (values, k, _, *rest) = calls["sampled_low"]
        calls["sampled_low"] = function, (values, k, values.size // 2, *rest)
    if "huffman_estimate" in calls:
        function, (values, _, *rest) = calls["huffman_estimate"]
        calls["huffman_estimate"] = function, (values, 1, *rest)
    return calls


@pytest.mark.skipif(floats._halfcast is None, reason="deepreduce.codecs.values._halfcast is not built")
def test_short_loops_keep_the_gil():
    # handing the GIL over and back costs more than a loop this short
    values, out = np.ones(1000, np.float32), np.empty(1000, np.float16)
    assert not runs_beside(lambda: [floats._halfcast.to_half(values, out) for _ in range(1000)])


def test_a_busy_python_thread_is_seen_to_keep_the_gil():
    def busy():
        total = 0
        for i in range(200_000):
            total += i
    assert not runs_beside(busy)
    assert runs_beside(lambda: threading.Event().wait(0.05))


@pytest.mark.timing
@pytest.mark.skipif(not EXTENSIONS, reason="no compiled extension is built")
def test_the_compiled_loops_release_the_gil(monkeypatch):
    calls = record_compiled_calls(monkeypatch)
    monkeypatch.undo()
    assert {"golomb_encode", "golomb_decode", "golomb_bits", "to_half", "to_single",
            "varint_encode", "at_least", "sum_sorted", "localize"} <= set(calls)
    holding = []
    for name, (function, args) in sorted(calls.items()):
        if name in KEEP_THE_GIL:
            continue
        # repeated (with the same outputs) for some 50 ms, so that the waiting thread
        # wakes during one of the calls even on a busy machine
        def repeated():
            start = time.perf_counter()
            for _ in range(200):
                function(*args)
                if time.perf_counter() - start > 0.05:
                    return
        if not any(runs_beside(repeated) for _ in range(3)):
            holding.append(name)
    assert holding == []
