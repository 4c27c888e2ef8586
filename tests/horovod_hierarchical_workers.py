"""Four-rank checks of the hierarchical communicator over Horovod, run by
tests/test_horovod_hierarchical.py.

Launched as ``horovodrun -np 4 -H localhost:4 --gloo python
tests/horovod_hierarchical_workers.py OUT`` with ``HOROVOD_DYNAMIC_PROCESS_SETS=1``:
the four ranks play two nodes of two (``local_size=2`` is given to the communicator:
on one host horovodrun says 4). Every rank runs every check, in order (some depend
on which process sets the ones before registered), and writes its findings to
``OUT/rank<r>.json``. One launch holds all checks because each pays TensorFlow's
import time four times over. With a third argument ``static`` (and dynamic process
sets off) Horovod starts with the sets of
:func:`~deepreduce.horovod.collectives.hierarchical_process_sets` and only the
lossless sums are checked.
"""

import hashlib
import json
import os
import sys
import traceback

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

import deepreduce as dr
import deepreduce.horovod.tensorflow as drh
from deepreduce.collectives import Traffic
from deepreduce.horovod import collectives as dc
from horovod_common import digits_shard, small_model, tape_step

WORLD, LOCAL = 4, 2
LOSSLESS = {"sparsifier": None, "index": "varint", "value": "raw", "min_size": 0}


def hierarchical(inter="allgather", local_size=LOCAL, **settings):
    return drh.Compression(communicator="hierarchical",
                           communicator_options={"local_size": local_size, "inter": inter},
                           **settings)


def table() -> dict:
    return {",".join(map(str, ranks)): ps_id for ranks, ps_id in dc._process_set_table().items()}


def gather_ranks(transport) -> list:
    return [bytes(f)[0] for f in transport.allgather(bytes([hvd.rank()]), Traffic(), "t")]


def raised(fn) -> dict:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - what was raised is the finding
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


def check_split_errors(rank):
    """Before any set is added: without dynamic process sets (as this process sees it),
    and from a transport smaller than the world, a missing set raises on every rank."""
    transport = dc.horovod_transport()
    before = table()
    saved = os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"]
    os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = "0"
    try:
        off = raised(lambda: transport.split(int(rank < 3)))
    finally:
        os.environ["HOROVOD_DYNAMIC_PROCESS_SETS"] = saved
    intra = transport.split(rank // LOCAL)  # adds the node sets
    smaller = raised(lambda: intra.split(rank))  # singletons: not registered
    return {"off": off, "smaller": smaller, "before": before, "after": table()}


def check_split(rank):
    """The node and shard transports; a key order other than Horovod's; sets reused."""
    transport = dc.horovod_transport()
    intra = transport.split(rank // LOCAL, rank % LOCAL)
    inter = transport.split(rank % LOCAL, rank // LOCAL)
    registered = table()
    again = transport.split(rank // LOCAL, rank % LOCAL)
    reverse = transport.split(rank % 2, key=-rank)  # members ranked by descending rank
    frames = [bytes([rank, member]) for member in range(reverse.size)]
    received = reverse.alltoall(frames, Traffic(), "t")
    return {"intra": [intra.rank, intra.size, intra.process_set.ranks, gather_ranks(intra)],
            "inter": [inter.rank, inter.size, inter.process_set.ranks, gather_ranks(inter)],
            "again_same": again is intra, "table_before": registered, "table_after": table(),
            "reverse": [reverse.rank, reverse.size, gather_ranks(reverse),
                        [bytes(f).hex() for f in received]]}


def rank_tensors(r):
    """Rank ``r``'s inputs: every rank makes every rank's, for the expected sums."""
    rng = np.random.default_rng(100 + r)
    sparse = rng.standard_normal((50, 50)).astype(np.float32)
    sparse[rng.random((50, 50)) < 0.9] = 0
    rows = rng.choice(40, 6, replace=False)
    return [rng.standard_normal((300, 40)).astype(np.float32),
            rng.standard_normal(7).astype(np.float32),
            sparse,
            np.zeros(2000, np.float32),
            rng.standard_normal((21, 30)).astype(np.float64),
            (rng.standard_normal((6, 5)).astype(np.float32), rows)]  # IndexedSlices of (40, 5)


def dense(x):
    if isinstance(x, tuple):
        out = np.zeros((40, 5), np.float32)
        np.add.at(out, x[1], x[0])
        return out
    return x


def as_tensorflow(x):
    if isinstance(x, tuple):
        return tf.IndexedSlices(tf.constant(x[0]), tf.constant(x[1]), tf.constant([40, 5]))
    return tf.constant(x)


def check_lossless(rank):
    """Lossless hierarchical == the node-first dense sum (x0 + x1) + (x2 + x3), bit for
    bit, eager and inside a tf.function, with each communicator between nodes."""
    everyone = [[dense(x) for x in rank_tensors(r)] for r in range(WORLD)]
    expected_sum = [(a + b) + (c + d) for a, b, c, d in zip(*everyone)]
    expected = {"sum": expected_sum,
                "average": [(s.astype(np.float64) * (1 / WORLD)).astype(s.dtype)
                            for s in expected_sum]}
    tensors = [as_tensorflow(x) for x in rank_tensors(rank)]
    names = [f"t{i}" for i in range(len(tensors))]
    out = {}
    for inter in ("allgather", "sparse_allreduce", "block"):
        for op_name, op in (("sum", hvd.Sum), ("average", hvd.Average)):
            compression = hierarchical(**LOSSLESS, inter=inter)
            eager = drh.grouped_allreduce(tensors, compression, op=op, names=names)
            graph = tf.function(lambda *ts, c=compression, op=op: drh.grouped_allreduce(
                list(ts), c, op=op, names=names))(*tensors)
            for mode, results in (("eager", eager), ("graph", graph)):
                got = [tf.convert_to_tensor(g).numpy() for g in results]
                out[f"{inter}_{op_name}_{mode}"] = [
                    bool(g.dtype == e.dtype and np.array_equal(g, e))
                    for g, e in zip(got, expected[op_name])]
            out[f"{inter}_{op_name}_slices"] = type(eager[5]).__name__
            out[f"{inter}_{op_name}_compressed"] = compression.stats.total.compressed_tensors
    return out


def digest(model) -> str:
    h = hashlib.sha256()
    for w in model.get_weights():
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()


def check_topk_trains(rank):
    """Top-k with error feedback, eager steps and tf.function steps: the loss falls and
    every rank ends with the same weights."""
    x, y = digits_shard(rank, WORLD)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out = {}
    for mode in ("eager", "graph"):
        model = small_model()
        optimizer = tf.keras.optimizers.SGD(0.05, momentum=0.9)
        compression = hierarchical(sparsifier=dr.TopK(0.05), index="varint", value="fp16")

        def step(xb, yb, model=model, optimizer=optimizer, compression=compression):
            return tape_step(model, optimizer, compression, loss_fn, xb, yb)

        step = tf.function(step) if mode == "graph" else step
        losses = []
        for epoch in range(2):
            for start in range(0, len(x) - 31, 32):
                losses.append(float(step(x[start:start + 32], y[start:start + 32])))
        out[mode] = {"first": float(np.mean(losses[:5])), "last": float(np.mean(losses[-5:])),
                     "digest": digest(model), "steps": compression.stats.total.steps,
                     "compressed": compression.stats.total.compressed_tensors}
    return out


def check_misconfigured(rank):
    """Rank 3 says four ranks per node, the others two: every rank raises."""
    compression = hierarchical(**LOSSLESS, local_size=4 if rank == 3 else LOCAL)
    return raised(lambda: drh.allreduce(tf.ones(10), compression, op=hvd.Sum, name="x"))


def check_static(rank):
    """Sets registered at hvd.init, dynamic process sets off: found, none added."""
    before = table()
    compression = hierarchical(**LOSSLESS)
    tensors = [as_tensorflow(x) for x in rank_tensors(rank)]
    everyone = [[dense(x) for x in rank_tensors(r)] for r in range(WORLD)]
    expected = [(a + b) + (c + d) for a, b, c, d in zip(*everyone)]
    got = drh.grouped_allreduce(tensors, compression, op=hvd.Sum,
                                names=[f"t{i}" for i in range(len(tensors))])
    return {"equal": [bool(np.array_equal(tf.convert_to_tensor(g).numpy(), e))
                      for g, e in zip(got, expected)],
            "before": before, "after": table()}


def main(out_dir, mode="dynamic"):
    if mode == "static":
        hvd.init(process_sets=dc.hierarchical_process_sets(int(os.environ["HOROVOD_SIZE"]),
                                                           LOCAL))
        checks = [check_static]
    else:
        hvd.init()
        checks = [check_split_errors, check_split, check_lossless, check_topk_trains,
                  check_misconfigured]
    rank = hvd.rank()
    results = {"size": hvd.size()}
    for check in checks:
        try:
            results[check.__name__] = check(rank)
        except Exception:  # noqa: BLE001 - reported to the test, which fails on it
            results[check.__name__] = {"error": traceback.format_exc()}
    # nobody shuts Horovod down (at exit) while another rank still reads its table
    hvd.allgather_object(None)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
