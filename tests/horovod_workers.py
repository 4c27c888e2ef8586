"""Multi-rank checks of deepreduce.horovod.tensorflow, run by tests/test_horovod.py.

Launched as ``horovodrun -np 2 -H localhost:2 --gloo python tests/horovod_workers.py OUT``:
every rank runs every check and writes its findings to ``OUT/rank<r>.json``;
the pytest side asserts on them. One launch holds all checks because each one
pays TensorFlow's import time.
"""

import json
import os
import sys
import tempfile
import traceback

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras

import deepreduce as dr
import deepreduce.horovod.tensorflow as drh
from horovod_common import digits_shard, small_model, tape_step

INDEX = "varint"


def lossless(**kwargs):
    return drh.Compression(sparsifier=None, index=INDEX, value="raw", **kwargs)


def equal(a, b) -> bool:
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


def gathered(value):
    """Every rank's ``value`` (JSON-able), in rank order."""
    return hvd.allgather_object(value)


def check_lossless(rank):
    rng = np.random.default_rng(100 + rank)
    sparse = rng.standard_normal((50, 50)).astype(np.float32)
    sparse[rng.random((50, 50)) < 0.9] = 0
    tensors = [tf.constant(rng.standard_normal((300, 40)).astype(np.float32)),
               tf.constant(rng.standard_normal(7).astype(np.float32)),   # below min_size
               tf.constant(sparse),
               tf.constant(np.zeros(2000, np.float32)),
               tf.constant(rng.standard_normal((20, 30)).astype(np.float64))]
    names = [f"t{i}" for i in range(len(tensors))]
    out = {}
    for op_name, op in (("average", hvd.Average), ("sum", hvd.Sum)):
        compression = lossless(min_size=100)
        expected = [hvd.allreduce(t, op=op) for t in tensors]
        eager = drh.grouped_allreduce(tensors, compression, op=op, names=names)
        graph = tf.function(lambda *ts: drh.grouped_allreduce(list(ts), compression, op=op,
                                                              names=names))(*tensors)
        out[f"{op_name}_eager_equal"] = [equal(a, b) for a, b in zip(eager, expected)]
        out[f"{op_name}_graph_equal"] = [equal(a, b) for a, b in zip(graph, expected)]
        out[f"{op_name}_dtypes"] = [g.dtype.name for g in graph]
        out[f"{op_name}_checksum"] = float(sum(np.abs(g.numpy()).sum() for g in graph))
    return out


def check_different_sizes(rank):
    x = np.zeros(5000, np.float32)
    count = 10 if rank == 0 else 3000
    x[np.random.default_rng(rank).choice(5000, count, replace=False)] = 1.5 + rank
    compression = lossless(min_size=0)
    result = drh.allreduce(tf.constant(x), compression, op=hvd.Sum, name="x")
    expected = hvd.allreduce(tf.constant(x), op=hvd.Sum)
    return {"equal": equal(result, expected), "bytes_sent": compression.stats.last.bytes_sent,
            "bytes_received": compression.stats.last.bytes_received,
            "bundle_bytes": compression.stats.last.bundle_bytes}


def check_held_results_survive(rank):
    """TensorFlow adopts deepreduce's aligned sums without copying, and deepreduce
    rewrites a sum in place once nothing holds it: a result still held must not
    change, and the memory of dropped ones is reused."""
    compression = lossless(min_size=0)
    reduce = tf.function(lambda t: drh.allreduce(t, compression, op=hvd.Sum, name="x"))

    def gradient(step):
        x = np.random.default_rng(10 * step + rank).standard_normal(6000).astype(np.float32)
        x[np.random.default_rng(step).random(6000) < 0.8] = 0
        return tf.constant(x)

    def address(tensor):  # np.asarray views an eager tensor's memory; .numpy() copies it
        return np.asarray(tensor).__array_interface__["data"][0]

    kept = reduce(gradient(0))
    kept_copy = kept.numpy().copy()
    correct, addresses, adopted = [], [], []
    for step in range(1, 5):
        result = reduce(gradient(step))
        correct.append(equal(result, hvd.allreduce(gradient(step), op=hvd.Sum)))
        addresses.append(address(result))
        # the array deepreduce summed into
        (written, _), = compression.exchange._allgather._sums._last.values()
        adopted.append(addresses[-1] == written.__array_interface__["data"][0])
        del result
    # eagerly too: whatever TensorFlow does with the host arrays, a held result stays
    eager_kept = drh.allreduce(gradient(0), compression, op=hvd.Sum, name="x")
    eager_copy = eager_kept.numpy().copy()
    for step in range(1, 4):
        result = drh.allreduce(gradient(step), compression, op=hvd.Sum, name="x")
        correct.append(equal(result, hvd.allreduce(gradient(step), op=hvd.Sum)))
        del result
    return {"kept_unchanged": equal(kept, kept_copy) and equal(eager_kept, eager_copy),
            "correct": correct, "kept_address": address(kept),
            "addresses": addresses, "adopted": adopted}


def check_error_feedback(rank, value="fp16", communicator="allgather"):
    compression = drh.Compression(sparsifier=dr.TopK(0.02), index=INDEX, value=value, min_size=0,
                                  communicator=communicator)
    names, shapes = ["a", "b"], [(1000,), (40, 50)]
    rng = np.random.default_rng(7 + rank)

    @tf.function
    def step(a, b):
        return drh.grouped_allreduce([a, b], compression, op=hvd.Sum, names=names)

    delivered = [np.zeros(s) for s in shapes]
    inputs = [np.zeros(s) for s in shapes]
    nonzeros = []
    for _ in range(6):
        grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        for total, g in zip(inputs, grads):
            total += g
        results = step(*[tf.constant(g) for g in grads])
        for total, r in zip(delivered, results):
            total += r.numpy()
        nonzeros.append([int(np.count_nonzero(r.numpy())) for r in results])
    residuals = [compression.exchange.selector.memory.residual(n).astype(np.float64) for n in names]
    # the sum over ranks of inputs and residuals, by allreduce in float64
    all_inputs = [hvd.allreduce(tf.constant(x), op=hvd.Sum).numpy() for x in inputs]
    all_residuals = [hvd.allreduce(tf.constant(x), op=hvd.Sum).numpy() for x in residuals]
    errors = [float(np.abs(d + r - i).max())
              for d, r, i in zip(delivered, all_residuals, all_inputs)]
    return {"mass_error": errors, "nonzeros": nonzeros,
            "residual_norm": [float(np.abs(r).sum()) for r in residuals],
            "delivered_checksum": float(sum(np.abs(d).sum() for d in delivered)),
            "ratio": compression.stats.last.ratio}


def check_grouped_bundles(rank, groups=3):
    """A tape reducing in one bundle, and ones reducing in ``groups`` inside a
    tf.function and eagerly, with Top-k and error feedback: the same bits every
    step."""
    shapes = [(300, 40), (40,), (40, 200), (200,), (200, 10), (10,)]
    variables = [tf.Variable(np.zeros(s, np.float32)) for s in shapes]
    kinds = [(0, True), (groups, True), (groups, False)]  # (num_groups, in a graph)
    compressions = [drh.Compression(sparsifier=dr.TopK(0.05), index=INDEX, value="fp16") for _ in kinds]

    def make_step(compression, num_groups, graph):
        def step(coefficients):
            with tf.GradientTape() as tape:  # the gradients are the coefficients
                loss = tf.add_n([tf.reduce_sum(v * c) for v, c in zip(variables, coefficients)])
            tape = drh.DistributedGradientTape(tape, compression=compression,
                                               num_groups=num_groups)
            return tape.gradient(loss, variables)
        return tf.function(step) if graph else step

    steps = [make_step(c, *kind) for c, kind in zip(compressions, kinds)]
    rng = np.random.default_rng(11 + rank)
    same = []
    for _ in range(4):
        coefficients = [tf.constant(rng.standard_normal(s).astype(np.float32)) for s in shapes]
        one, *grouped = ([r.numpy().tobytes() for r in step(coefficients)] for step in steps)
        same.append([g == one for g in grouped])
    stats = [c.stats.total for c in compressions]
    return {"same": same, "steps": [s.steps for s in stats],
            "tensors": [s.tensors for s in stats],
            "dense_bytes": [s.dense_bytes for s in stats]}


#: Every communicator of the wrappers, by the key its findings are stored under.
COMMUNICATORS = {"allgather": ("allgather", None),
                 "sparse_allreduce": ("sparse_allreduce", None),
                 "recursive_doubling": ("sparse_allreduce", {"algorithm": "recursive_doubling"}),
                 "block": ("block", {"block_size": 64})}


def check_communicators(rank):
    """Lossless tape gradients equal Horovod's allreduce with every communicator.

    The loss is linear in the variables, so each gradient is exactly a constant
    of the rank: dense, below min_size, float64 and IndexedSlices (embedding
    rows, one repeated) in one step.
    """
    rng = np.random.default_rng(300 + rank)

    def coefficients(shape, density, dtype=np.float32):
        c = rng.standard_normal(shape).astype(dtype)
        c[rng.random(shape) > density] = 0
        return tf.constant(c)

    w = tf.Variable(tf.zeros((60, 40)), name="w")
    b = tf.Variable(tf.zeros(30), name="b")
    w64 = tf.Variable(tf.zeros((40, 30), tf.float64), name="w64")
    emb = tf.Variable(tf.zeros((100, 8)), name="emb")
    variables = [w, b, w64, emb]
    cw, cb, c64 = coefficients((60, 40), 0.1), coefficients(30, 1.0), \
        coefficients((40, 30), 0.5, np.float64)
    ids = tf.constant([3, 7, 7, 42] if rank == 0 else [7, 90])
    rows = coefficients((int(ids.shape[0]), 8), 1.0)

    def loss_fn():
        return (tf.reduce_sum(w * cw) + tf.reduce_sum(b * cb)
                + tf.cast(tf.reduce_sum(w64 * c64), tf.float32)
                + tf.reduce_sum(tf.gather(emb, ids) * rows))

    with tf.GradientTape() as tape:
        loss = loss_fn()
    expected = [hvd.allreduce(tf.convert_to_tensor(g), op=hvd.Average)
                for g in tape.gradient(loss, variables)]
    out = {}
    for key, (communicator, options) in COMMUNICATORS.items():
        compression = lossless(min_size=100, communicator=communicator,
                               communicator_options=options)

        def reduced():
            with tf.GradientTape() as tape:
                loss = loss_fn()
            tape = drh.DistributedGradientTape(tape, compression=compression)
            return tape.gradient(loss, variables)

        eager, graph = reduced(), tf.function(reduced)()
        out[key] = {
            "eager_equal": [equal(tf.convert_to_tensor(g), e) for g, e in zip(eager, expected)],
            "graph_equal": [equal(tf.convert_to_tensor(g), e) for g, e in zip(graph, expected)],
            "slices": [isinstance(g[3], tf.IndexedSlices) for g in (eager, graph)],
            "steps": compression.stats.total.steps,
            "bytes_sent": compression.stats.last.bytes_sent,
            "dense_bytes": compression.stats.last.dense_bytes}
    return out


def check_indexed_slices(rank):
    emb = tf.Variable(np.arange(800, dtype=np.float32).reshape(100, 8) / 100)
    ids = tf.constant([1, 5, 5, 7] if rank == 0 else [5, 60, 99, 99, 99])
    weight = float(rank + 2)
    out = {}

    def loss_fn():
        return tf.reduce_sum(tf.gather(emb, ids) * weight)

    with tf.GradientTape() as tape:
        loss = loss_fn()
    local = tape.gradient(loss, emb)
    expected = hvd.allreduce(tf.convert_to_tensor(local), op=hvd.Average)

    compression = lossless(min_size=0)
    with tf.GradientTape() as tape:
        loss = loss_fn()
    grad = drh.DistributedGradientTape(tape, compression=compression).gradient(loss, emb)
    out["local_is_slices"] = isinstance(local, tf.IndexedSlices)
    out["is_slices"] = isinstance(grad, tf.IndexedSlices)
    out["rows"] = sorted(grad.indices.numpy().tolist())
    out["equal"] = equal(tf.convert_to_tensor(grad), expected)
    out["bytes_sent"] = compression.stats.last.bytes_sent
    out["dense_bytes"] = compression.stats.last.dense_bytes

    # sparse_as_dense, and TopK with error feedback inside tf.function
    with tf.GradientTape() as tape:
        loss = loss_fn()
    dense = drh.DistributedGradientTape(tape, compression=lossless(min_size=0),
                                        sparse_as_dense=True).gradient(loss, emb)
    out["sparse_as_dense_is_tensor"] = isinstance(dense, tf.Tensor)
    out["sparse_as_dense_equal"] = equal(dense, expected)

    topk = drh.Compression(sparsifier=dr.TopK(0.25), index=INDEX, value="fp16", min_size=0)

    @tf.function
    def sparse_step():
        with tf.GradientTape() as tape:
            loss = loss_fn()
        g = drh.DistributedGradientTape(tape, compression=topk).gradient(loss, emb)
        return g.values, g.indices

    for _ in range(3):
        values, rows = sparse_step()
    out["topk_value_shape"] = values.shape.as_list()
    out["topk_rows_unique"] = len(set(rows.numpy().tolist())) == int(rows.shape[0])
    out["topk_residual_nonzero"] = int(np.count_nonzero(topk.exchange.selector.memory.residual("Variable:0")))
    return out


def check_tape_options(rank):
    """gradient_predivide_factor, local sources, nested sources, tensor sources."""
    rng = np.random.default_rng(rank)
    a = tf.Variable(rng.standard_normal((40, 40)).astype(np.float32), name="a")
    b = tf.Variable(rng.standard_normal(30).astype(np.float32), name="b")
    x = tf.constant(rng.standard_normal(30).astype(np.float32))

    def loss_fn():
        return tf.reduce_sum(a * a) + tf.reduce_sum(b * x * x)

    out = {}
    with tf.GradientTape() as tape:
        loss = loss_fn()
    local_a, local_b = tape.gradient(loss, [a, b])
    expected_a = hvd.allreduce(local_a, op=hvd.Average)

    with tf.GradientTape() as tape:
        loss = loss_fn()
    tape = drh.DistributedGradientTape(tape, compression=lossless(min_size=0),
                                       gradient_predivide_factor=4.0)
    tape.register_local_source(b)
    grads = tape.gradient(loss, {"a": a, "b": b})
    out["nested_keys"] = sorted(grads)
    out["predivide_close"] = bool(np.allclose(grads["a"].numpy(), expected_a.numpy(),
                                              rtol=1e-6, atol=0))
    out["local_scaled"] = equal(grads["b"], local_b / hvd.size())

    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(x * x * float(rank + 1))
    (gx,) = drh.DistributedGradientTape(tape, compression=lossless()).gradient(y, [x])
    out["tensor_source_equal"] = equal(gx, hvd.allreduce(2 * x * float(rank + 1)))
    return out


def check_misuse(rank):
    out = {}
    compression = lossless(error_feedback=False)
    v = tf.Variable(tf.ones((32, 32)))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * v * float(rank + 1))
    try:
        hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, [v])
        out["tape_error"] = None
    except Exception as exc:  # noqa: BLE001 - the type is what is checked
        out["tape_error"] = type(exc).__name__
        out["tape_message"] = str(exc)
    x = tf.constant(np.full((16, 16), rank + 1.0, np.float32))
    try:
        hvd.allreduce(x, op=hvd.Sum, compression=compression)
        out["eager_error"] = None
    except Exception as exc:  # noqa: BLE001
        out["eager_error"] = type(exc).__name__
        out["eager_is_decode_error"] = isinstance(exc, dr.DecodeError)
        out["eager_message"] = str(exc)
    return out


def weights_checksum(model):
    return float(sum(np.abs(w).astype(np.float64).sum() for w in model.get_weights()))


def check_keras_fit(rank, size, log_dir):
    x, y = digits_shard(rank, size)
    out = {}
    runs = (("new", tf.keras.optimizers.SGD(0.05, momentum=0.9), "allgather", 3),
            ("legacy", tf.keras.optimizers.legacy.SGD(0.05, momentum=0.9), "allgather", 3),
            ("sparse_allreduce", tf.keras.optimizers.SGD(0.05, momentum=0.9),
             "sparse_allreduce", 2))
    for label, optimizer, communicator, epochs in runs:
        compression = drh.Compression(sparsifier=dr.TopK(0.05), index=INDEX, value="fp16",
                                      communicator=communicator)
        model = small_model()
        model.compile(optimizer=drh.DistributedOptimizer(optimizer, compression=compression),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        callbacks = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
                     drh.CompressionStatsCallback(compression,
                                                  log_dir=log_dir if rank == 0 else None)]
        history = model.fit(x, y, batch_size=32, epochs=epochs, verbose=0,
                            callbacks=callbacks)
        out[label] = {"loss": history.history["loss"],
                      "dr_ratio": history.history.get("dr_ratio"),
                      "class_name": type(model.optimizer).__name__,
                      "steps": compression.stats.total.steps,
                      "checksum": weights_checksum(model)}
    out["event_files"] = sorted(os.listdir(log_dir)) if rank == 0 else []
    return out


def check_custom_loop(rank, size):
    x, y = digits_shard(rank, size)
    model = small_model()
    optimizer = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    compression = drh.Compression(sparsifier=dr.TopK(0.05), index=INDEX, value="fp16")
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(xb, yb):
        return tape_step(model, optimizer, compression, loss_fn, xb, yb)

    losses = []
    for epoch in range(3):
        for start in range(0, len(x) - 31, 32):
            losses.append(float(train_step(x[start:start + 32], y[start:start + 32])))
    return {"first": float(np.mean(losses[:5])), "last": float(np.mean(losses[-5:])),
            "checksum": weights_checksum(model), "steps": compression.stats.total.steps}


def check_nonfinite_step_is_skipped(rank, size, poisoned=5):
    """A custom loop that skips steps with non-finite gradients (as a loss scaler does):
    an inf loss on rank 1 at one step gives every rank non-finite gradients, and the
    run then continues bit for bit as one that never took that batch."""
    x, y = digits_shard(rank, size)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def run(poison, skip):
        model = small_model()
        optimizer = tf.keras.optimizers.SGD(0.05, momentum=0.9)
        compression = drh.Compression(sparsifier=dr.TopK(0.05), index=INDEX, value="fp16")

        @tf.function
        def train_step(xb, yb, scale):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True)) * scale
            tape = drh.DistributedGradientTape(tape, compression=compression)
            grads = tape.gradient(loss, model.trainable_variables)
            finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
            if finite:
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return finite

        seen = []
        for step, start in enumerate(range(0, 12 * 32, 32)):
            if step == skip:
                continue
            scale = np.inf if step == poison and rank == 1 else 1.0
            seen.append(bool(train_step(x[start:start + 32], y[start:start + 32],
                                        tf.constant(scale, tf.float32))))
        residuals = compression.exchange.selector.state_dict()["residuals"]
        return model.get_weights(), residuals, seen, compression.stats.total.nonfinite_steps

    weights, residuals, seen, nonfinite = run(poisoned, None)
    clean_weights, clean_residuals, clean_seen, _ = run(None, poisoned)
    return {"finite_seen": seen, "clean_finite_seen": clean_seen,
            "nonfinite_steps": nonfinite,
            "weights_equal": all(np.array_equal(a, b) for a, b in zip(weights, clean_weights)),
            # (keyed by variable names, which the second model's differ in)
            "residuals_equal": len(residuals) == len(clean_residuals) > 0 and all(
                np.array_equal(a, b) for a, b in zip(residuals.values(),
                                                     clean_residuals.values()))}


def main(out_dir):
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    results = {"size": size}
    checks = [("lossless", lambda: check_lossless(rank)),
              ("different_sizes", lambda: check_different_sizes(rank)),
              ("held_results", lambda: check_held_results_survive(rank)),
              ("error_feedback", lambda: check_error_feedback(rank)),
              ("communicators", lambda: check_communicators(rank)),
              ("sparse_allreduce_error_feedback",
               lambda: check_error_feedback(rank, "raw", "sparse_allreduce")),
              ("indexed_slices", lambda: check_indexed_slices(rank)),
              ("tape_options", lambda: check_tape_options(rank)),
              ("grouped_bundles", lambda: check_grouped_bundles(rank)),
              ("misuse", lambda: check_misuse(rank)),
              ("keras_fit", lambda: check_keras_fit(rank, size, tempfile.mkdtemp())),
              ("custom_loop", lambda: check_custom_loop(rank, size)),
              ("nonfinite_step", lambda: check_nonfinite_step_is_skipped(rank, size))]
    for name, check in checks:
        try:
            results[name] = check()
        except Exception:  # noqa: BLE001 - reported to the test, which fails on it
            results[name] = {"exception": traceback.format_exc()}
        # cross-rank comparisons: every rank records what every rank saw
        results[name]["all_ranks"] = gathered(json.loads(json.dumps(results[name])))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
