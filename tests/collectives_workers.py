"""Inputs for the collectives tests, and the script each Horovod rank runs.

``python -m horovod.runner ... collectives_workers.py`` (or horovodrun) runs every
scenario on every rank and prints one ``RESULT {json}`` line per rank: a list of
``[check name, ok, detail]``. One launch covers all checks, because each
launch pays TensorFlow's import time once per rank.
"""

from __future__ import annotations

import json
import sys
import traceback

import numpy as np

SCENARIOS = ("disjoint", "identical", "overlap", "empty_some", "dense_after", "tiny")


def make_input(scenario: str, size: int, rank: int, n: int = 2000, seed: int = 0,
               dtype=np.float32) -> np.ndarray:
    """Integer-valued input of one rank: sums of such values are exact in any order."""
    rng = np.random.default_rng([seed, rank])
    shared = np.random.default_rng([seed, 999])
    x = np.zeros(n, dtype=dtype)
    values = lambda count: rng.integers(-8, 9, count).astype(dtype)  # noqa: E731
    if scenario == "disjoint":
        mine = np.arange(rank, n, size)
        idx = rng.choice(mine, size=min(mine.size, max(1, n // (8 * size))), replace=False)
    elif scenario == "identical":
        idx = shared.choice(n, size=n // 20, replace=False)
    elif scenario == "overlap":
        common = shared.choice(n, size=n // 40, replace=False)
        idx = np.union1d(common, rng.choice(n, size=n // 40, replace=False))
    elif scenario == "empty_some":
        if rank % 2 == 0:
            return x
        idx = rng.choice(n, size=n // 30, replace=False)
    elif scenario == "dense_after":
        idx = rng.choice(n, size=int(n * 0.6), replace=False)
    elif scenario == "tiny":  # fewer elements than ranks: some ranges are empty
        x = np.zeros(3, dtype=dtype)
        x[rank % 3] = rank + 1
        return x
    else:
        raise ValueError(scenario)
    x[idx] = values(idx.size)
    return x


def block_clustered(size: int, rank: int, n: int = 4096, block: int = 64, seed: int = 0):
    """Non-zeros in a few blocks, some blocks shared by all ranks, partly filled."""
    rng = np.random.default_rng([seed, rank])
    blocks = n // block
    hot = np.random.default_rng([seed, 7]).choice(blocks, size=blocks // 8, replace=False)
    own = rng.choice(blocks, size=blocks // 16, replace=False)
    x = np.zeros(n, dtype=np.float32)
    for b in np.union1d(hot, own):
        fill = rng.random(block) < 0.7
        x[b * block:(b + 1) * block] = np.where(fill, rng.integers(1, 9, block), 0)
    return x


def _run_checks():
    import tensorflow as tf
    import horovod.tensorflow as hvd

    import deepreduce as dr
    from deepreduce.horovod import collectives as dc

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    results = []

    def check(name, fn):
        try:
            ok, detail = fn()
        except Exception as exc:  # reported to the test, which shows the rank's traceback
            ok, detail = False, "".join(traceback.format_exception(exc))[-2000:]
        results.append([name, bool(ok), str(detail)[:2000]])

    def dense_sum(x, op=hvd.Sum):
        return hvd.allreduce(tf.constant(x), op=op).numpy()

    def same_everywhere(array):
        gathered = hvd.allgather(tf.constant(np.asarray(array).reshape(1, -1))).numpy()
        return all(np.array_equal(gathered[0].view(np.uint8), row.view(np.uint8))
                   for row in gathered)

    lossless = dr.Pipeline(index="eliasfano", value="raw")
    # sparse_allreduce's algorithms; "auto" weighs bytes alone here, so that it picks
    # split or recursive doubling on these small tensors (the default network: allgather)
    names = ("allgather", "split", "recursive_doubling", "auto", "block")
    by_bytes = {"algorithm": "auto", "alpha_op": 0, "alpha": 0}
    algorithms = ("allgather", "split", "recursive_doubling", "block")
    chosen = set()

    def settings_of(name):
        return by_bytes if name == "auto" else {"algorithm": name}

    def communicator(name, **kwargs):
        if name in ("split", "recursive_doubling", "auto"):
            return dc.SparseAllreduce(**settings_of(name), **kwargs)
        return dc.get_communicator(name, **kwargs)

    def allreduce(x, name, **kwargs):
        if name in ("split", "recursive_doubling", "auto"):
            name, kwargs = "sparse_allreduce", dict(kwargs, **settings_of(name))
        return dc.allreduce(x, name, **kwargs)

    for scenario in SCENARIOS:
        x = make_input(scenario, size, rank)
        expected = dense_sum(x)
        for name in names:
            settings = {"block_size": 16} if name == "block" else {}

            def exact(x=x, expected=expected, name=name, settings=settings):
                reduction = communicator(name, pipeline=lossless, **settings).reduce(x)
                out = reduction.output
                # every rank ran the same algorithm
                agreed = same_everywhere(np.array([algorithms.index(reduction.algorithm)]))
                if name == "auto":
                    chosen.add(reduction.algorithm)
                return (np.array_equal(out, expected) and out.dtype == x.dtype and agreed
                        and np.array_equal(reduction.sent.to_dense(), x)), \
                    f"max diff {np.abs(out - expected).max() if out.size else 0}, " \
                    f"{reduction.algorithm}"
            check(f"{name}/{scenario}", exact)

    # The dense switch really happens: gathered ranges arrive as dense frames.
    def dsar():
        x = make_input("dense_after", size, rank, n=8000)
        reduction = dc.SparseAllreduce(lossless, algorithm="split").reduce(x)
        gathered = sum(received for stage, _, received in reduction.traffic.stages
                       if stage in ("gather", "return"))
        dense_bound = (size - 1) * (8000 / size * 4 + 64)
        return np.array_equal(reduction.output, dense_sum(x)) and gathered <= dense_bound, \
            f"gathered {gathered} bytes, dense bound {dense_bound}"
    check("sparse_allreduce/dsar_switch", dsar)

    def auto_choices():
        # with the default network, small tensors take one operation (allgather; at
        # P = 2 recursive doubling is one operation too, with fewer bytes); by bytes,
        # the scenarios above made auto pick split and recursive doubling at P = 4
        x = make_input("overlap", size, rank)
        reduction = dc.SparseAllreduce(lossless).reduce(x)
        wanted = {"split", "recursive_doubling"} if size == 4 else {"recursive_doubling"}
        default = "recursive_doubling" if size == 2 else "allgather"
        return (reduction.algorithm == default and wanted <= chosen
                and np.array_equal(reduction.output, dense_sum(x))), \
            f"default {reduction.algorithm}, by bytes {sorted(chosen)}"
    check("sparse_allreduce/auto_choices", auto_choices)

    # Interleaved ownership: small granules deal the index space round-robin
    xi = make_input("overlap", size, rank)
    for name in ("split", "block"):
        def interleaved(name=name):
            comm = communicator(name, pipeline=lossless,
                                **({"block_size": 8} if name == "block" else {}))
            comm.granule = 24
            return np.array_equal(comm.reduce(xi).output, dense_sum(xi)), ""
        check(f"{name}/interleaved_granules", interleaved)

    # dtypes and shapes
    for dtype in (np.float64, np.float16):
        x = make_input("overlap", size, rank, n=600, dtype=dtype).reshape(20, 30)
        expected = dense_sum(x)
        for name in names:
            def typed(x=x, expected=expected, name=name):
                out = allreduce(x, name, pipeline=lossless, block_size=7) if name == "block" \
                    else allreduce(x, name, pipeline=lossless)
                return out.shape == x.shape and out.dtype == x.dtype and \
                    np.array_equal(out, expected), f"{out.dtype} {out.shape}"
            check(f"{name}/{np.dtype(dtype).name}_2d", typed)

    # Block-clustered input, threshold 0 and > 0 (then the result is the sum of what was sent)
    xb = block_clustered(size, rank)
    for threshold in (0.0, 3.5):
        def blocks(threshold=threshold):
            reduction = dc.BlockReduce(dr.Pipeline(index="bitmap"), block_size=64,
                                       threshold=threshold).reduce(xb)
            expected = dense_sum(reduction.sent.to_dense())
            lossless_ok = threshold > 0 or np.array_equal(reduction.sent.to_dense(), xb)
            return np.array_equal(reduction.output, expected) and lossless_ok, \
                f"traffic {reduction.traffic.received}"
        check(f"block/clustered_threshold_{threshold}", blocks)

    # A sparsifier: the output is the sum of what every rank sent (error feedback is exact)
    g = np.random.default_rng(rank).integers(-100, 100, 5000).astype(np.float32)
    for name in names:
        def topk(name=name):
            reduction = communicator(
                name, pipeline=dr.Pipeline(dr.TopK(0.02), index="varint")).reduce(g)
            sent = reduction.sent.to_dense()
            nonzero_sent = np.flatnonzero(sent)
            return (np.array_equal(reduction.output, dense_sum(sent))
                    and np.array_equal(sent[nonzero_sent], g[nonzero_sent])), ""
        check(f"{name}/topk_residual", topk)

    # Lossy values (fp16): same result on every rank, close to the sum
    gf = np.random.default_rng(rank + 10).standard_normal(3000).astype(np.float32)
    for name in names:
        def fp16(name=name):
            out = allreduce(gf, name, pipeline=dr.Pipeline(index="varint", value="fp16"))
            err = np.abs(out - dense_sum(gf)).max()
            return same_everywhere(out) and err < 0.02 * size, f"max error {err}"
        check(f"{name}/fp16_values", fp16)

    # TensorFlow inputs: tf.Tensor and tf.IndexedSlices (repeated rows are summed)
    xt = make_input("overlap", size, rank, n=300).reshape(30, 10)
    rows = tf.constant([rank % 5, 7, rank % 5], dtype=tf.int64)
    slices = tf.IndexedSlices(tf.constant(np.full((3, 10), rank + 1.0, np.float32)), rows,
                              tf.constant([30, 10], dtype=tf.int64))
    slices_dense = tf.convert_to_tensor(slices).numpy()
    for name in names:
        def tensorflow_inputs(name=name):
            out = allreduce(tf.constant(xt), name, pipeline=lossless)
            out_slices = allreduce(slices, name, pipeline=lossless)
            return (isinstance(out, tf.Tensor) and np.array_equal(out.numpy(), dense_sum(xt))
                    and np.array_equal(out_slices.numpy(), dense_sum(slices_dense))), ""
        check(f"{name}/tensorflow", tensorflow_inputs)

    # Fusion: several tensors, one set of collectives
    parts = [make_input("overlap", size, rank, n=m, seed=m) for m in (100, 1, 2500)]
    for name in names:
        def fused(name=name):
            reductions = communicator(name, pipeline=lossless).reduce_many(
                [parts[0].reshape(10, 10), parts[1], parts[2]])
            return all(np.array_equal(r.output.reshape(-1), dense_sum(p))
                       and np.array_equal(r.sent.to_dense().reshape(-1), p)
                       for r, p in zip(reductions, parts)), ""
        check(f"{name}/reduce_many", fused)

    # Average matches Horovod's Average
    xa = make_input("overlap", size, rank)
    for name in names:
        def average(name=name):
            out = allreduce(xa, name, pipeline=lossless, op=hvd.Average)
            return np.allclose(out, dense_sum(xa, hvd.Average), rtol=0, atol=1e-6), ""
        check(f"{name}/average", average)

    # Async: several reductions in flight, an eager Horovod op of the user's in between
    inputs = [make_input(s, size, rank, seed=i) for i, s in enumerate(SCENARIOS[:4])]
    expected_all = [dense_sum(x) for x in inputs]
    for name in names:
        def asynchronous(name=name):
            comm = communicator(name, pipeline=lossless)
            handles = [comm.reduce_async(x) for x in inputs[:2]]
            user = hvd.allreduce(tf.constant([float(rank)]), op=hvd.Sum).numpy()
            handles += [comm.reduce_async(x) for x in inputs[2:]]
            outs = [h.wait(timeout=120).output for h in handles]
            return (all(np.array_equal(o, e) for o, e in zip(outs, expected_all))
                    and user[0] == sum(range(size))), ""
        check(f"{name}/async", asynchronous)

    # Errors: every rank raises a clear error, nobody hangs, and later reductions still work
    for name in names:
        def mismatch(name=name):
            x = np.ones(100 + (rank == size - 1), np.float32)
            try:
                allreduce(x, name, pipeline=lossless)
            except ValueError as exc:
                return "shapes" in str(exc) and "rank" in str(exc), str(exc)
            return False, "no error"
        check(f"{name}/shape_mismatch", mismatch)

        def dtype_mismatch(name=name):
            x = np.ones(50, np.float64 if rank == 0 else np.float32)
            try:
                allreduce(x, name, pipeline=lossless)
            except ValueError as exc:
                return "dtype" in str(exc), str(exc)
            return False, "no error"
        check(f"{name}/dtype_mismatch", dtype_mismatch)

        def after_errors(name=name):
            x = make_input("overlap", size, rank)
            return np.array_equal(allreduce(x, name, pipeline=lossless), dense_sum(x)), ""
        check(f"{name}/after_errors", after_errors)

    def bad_block_size():
        try:
            dc.allreduce(np.ones(10, np.float32), "block", pipeline=lossless,
                         block_size=0 if rank == 1 else 4)
        except ValueError as exc:
            return "block_size" in str(exc), str(exc)
        return False, "no error"
    check("block/bad_block_size_one_rank", bad_block_size)

    def block_size_everywhere():
        try:
            dc.BlockReduce(lossless, block_size=0)
        except ValueError as exc:
            return "block_size" in str(exc), str(exc)
        return False, "no error"
    check("block/bad_block_size_all_ranks", block_size_everywhere)

    print("RESULT " + json.dumps({"rank": rank, "size": size, "results": results}), flush=True)


if __name__ == "__main__":
    try:
        _run_checks()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
