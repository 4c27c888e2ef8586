"""End to end: Horovod training steps over a bandwidth-limited network, dense versus sparse.

Two ranks train the same MLP (about 8.5M parameters by default, on scikit-learn's
digits: nothing is downloaded) for a few steps with each way of reducing the
gradients, and rank 0 records the step time, the bytes each rank contributes
per step, the bytes that crossed the network, and deepreduce's encode + decode
time:

``compute only``
    no communication at all: the floor of every step time;
``dense allreduce``
    ``hvd.DistributedGradientTape`` (Horovod's ring allreduce of float32);
``Horovod fp16``
    the same with ``hvd.Compression.fp16``;
``Top-k IndexedSlices``
    what a Horovod user writes without deepreduce: ``tf.math.top_k`` per
    tensor with error feedback, sent as ``tf.IndexedSlices`` (Horovod
    allgathers int32 indices and float32 values);
``Top-k raw pairs``
    deepreduce's fast Top-k and error feedback, but the pairs raw (int32 +
    float32) over the same single allgather: isolates what the codecs bring;
``deepreduce``
    ``drh.DistributedGradientTape`` with Top-k 1%, the ``auto`` index codec
    told the measured link bandwidth (``auto:link_gbits=G``: the stream
    cheapest to code and send, not the smallest) and fp16 values (and QSGD
    values when that codec exists), and with the Golomb index code, the
    fastest exact one;
``sparse_allreduce`` / ``block``
    SparCML's split-allgather and OmniReduce's block communicators of
    :mod:`deepreduce.collectives` through the same wrappers
    (``communicator=``), with the same pipelines (block: Top-k of
    256-element blocks).

The network: as root, the script creates a network namespace whose loopback
is shaped by ``tc`` (a token bucket at each ``--rates`` value), so every byte
between the two ranks crosses a link of that bandwidth, runs ``horovodrun -np
2 --gloo`` inside it, and deletes the namespace afterwards. It measures the
single-stream TCP bandwidth it actually got, too. Without the rights to do
that (CAP_NET_ADMIN) it says so and stops, unless ``--no-netns`` asks for the
plain loopback.

It also times an allgather of 1 KB with the ranks idle: what Horovod takes for any
allgather on that link (its negotiation and its background thread's cycle), which
every step pays besides the wire time of its bytes.

Writes ``benchmarks/results/e2e.md``, ``e2e.json`` and ``e2e.png``.

    python -m benchmarks.e2e                       # 1, 10 and 0.1 Gbit/s (needs root)
    python -m benchmarks.e2e --rates 1gbit --steps 5 --hidden 1024   # quicker
    python -m benchmarks.e2e --no-netns            # unshaped loopback, no root needed
    python -m benchmarks.e2e --from-json benchmarks/results/e2e.json   # re-render only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.common import (RESULTS, ROOT, copy_bandwidth, mlp_shapes, receive_bytes, table,
                               write_report)

NAMESPACE = "drbench"
RATIO = 0.01
#: Allgathers of 1 KB timed for Horovod's fixed cost of one (the first two not counted).
ALLGATHER_PROBES = 22
SYNCHRONIZED = "compute + 1 KB allgather between backward and update (synchronization only)"
#: Resamples of the turns for the interval of a ratio of two schemes' median steps.
RESAMPLES = 2000
#: tc token bucket per rate: the bucket must hold at least one 64 KiB loopback
#: frame, and a larger one at 10 Gbit/s so the timer granularity does not cap it.
BURST = {"100mbit": "256kb", "1gbit": "256kb", "10gbit": "1mb"}


def burst(rate: str) -> str:
    """The token bucket's burst at ``rate``, in tc's units."""
    return BURST.get(rate, "1mb")


# -- the network ------------------------------------------------------------------------

class NetnsError(RuntimeError):
    pass


def _run(cmd, check=True):
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode:
        raise NetnsError(f"{' '.join(cmd)} failed ({proc.returncode}): "
                         f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def check_rights():
    """Raise NetnsError with a clear message unless namespaces and tc can be used here."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsError(f"{' and '.join(missing)} not found (Debian: apt-get install iproute2)")
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        raise NetnsError("creating a network namespace and shaping its loopback with tc needs "
                         "root (CAP_NET_ADMIN and CAP_SYS_ADMIN); run as root, or pass "
                         "--no-netns to measure on the unshaped loopback")


class ShapedLoopback:
    """A network namespace whose loopback is limited to ``rate`` by a tc token bucket."""

    def __init__(self, name=NAMESPACE):
        self.name = name

    def __enter__(self):
        check_rights()
        if self.name in _run(["ip", "netns", "list"]).stdout.split():
            _run(["ip", "netns", "del", self.name])  # left over from an interrupted run
        try:
            _run(["ip", "netns", "add", self.name])
        except NetnsError as exc:
            raise NetnsError(f"cannot create network namespace {self.name!r} ({exc}); "
                             "this needs root with CAP_SYS_ADMIN, or --no-netns") from None
        _run(["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"])
        return self

    def shape(self, rate):
        _run(["ip", "netns", "exec", self.name, "tc", "qdisc", "replace", "dev", "lo", "root",
              "tbf", "rate", rate, "burst", burst(rate), "latency", "50ms"])

    def prefix(self):
        return ["ip", "netns", "exec", self.name]

    def __exit__(self, *exc):
        _run(["ip", "netns", "del", self.name], check=False)


def probe_bandwidth(nbytes=50_000_000):
    """Single TCP stream over 127.0.0.1 in this network namespace: Gbit/s."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]

    def sink():
        conn, _ = server.accept()
        receive_bytes(conn, nbytes)
        conn.close()

    thread = threading.Thread(target=sink)
    thread.start()
    client = socket.create_connection(("127.0.0.1", port))
    block = b"\0" * (1 << 20)
    start = time.perf_counter()
    sent = 0
    while sent < nbytes:
        client.sendall(block)
        sent += len(block)
    thread.join()
    elapsed = time.perf_counter() - start
    client.close()
    server.close()
    return sent * 8 / elapsed / 1e9


# -- the worker (one per rank, started by horovodrun) ----------------------------------

def loopback_tx_bytes():
    """Bytes sent on this namespace's loopback so far (both ranks' traffic), or None."""
    try:
        return int(Path("/sys/class/net/lo/statistics/tx_bytes").read_text())
    except OSError:
        return None


def worker(args):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import horovod.tensorflow as hvd
    from sklearn.datasets import load_digits

    import deepreduce as dr
    import deepreduce.horovod.tensorflow as drh
    from deepreduce.bundle import split_bundles

    # One thread per op: the two ranks share two cores. Two inter-op threads, because a
    # reducing communicator runs Horovod ops from inside its host call in the graph.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    digits = load_digits()
    features = (digits.data / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int64)
    # auto is told the link's measured bandwidth, as a user who knows their network would
    index = f"auto:link_gbits={args.link_gbits}" if args.link_gbits else "auto"
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def build_model():
        tf.keras.utils.set_random_seed(args.seed)
        layers = [tf.keras.layers.Dense(args.hidden, activation="relu", name=f"fc{i + 1}")
                  for i in range(args.layers)]
        model = tf.keras.Sequential([tf.keras.Input((features.shape[1],)), *layers,
                                     tf.keras.layers.Dense(10, name="logits")])
        return model

    def plain_step(model, opt, x, y, wrap=None):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        if wrap is not None:
            tape = wrap(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def make_indexed_slices_step(model, opt):
        """tf.math.top_k + error feedback, sent as IndexedSlices (Horovod allgathers them)."""
        residuals = [tf.Variable(tf.zeros([int(np.prod(v.shape))]), trainable=False)
                     for v in model.trainable_variables]

        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            reduced = []
            for g, var, res in zip(grads, model.trainable_variables, residuals):
                n = res.shape[0]
                if n < 1024:  # as deepreduce does: small tensors go dense
                    reduced.append(hvd.allreduce(g, op=hvd.Average))
                    continue
                flat = tf.reshape(g, [-1]) + res
                k = max(1, int(np.ceil(RATIO * n)))
                chosen = tf.math.top_k(tf.abs(flat), k=k, sorted=False).indices
                values = tf.gather(flat, chosen)
                res.assign(tf.tensor_scatter_nd_update(flat, chosen[:, None],
                                                       tf.zeros_like(values)))
                slices = hvd.allreduce(tf.IndexedSlices(values, chosen, [n]), op=hvd.Average)
                reduced.append(tf.reshape(tf.convert_to_tensor(slices), var.shape))
            opt.apply_gradients(zip(reduced, model.trainable_variables))
            return loss
        return step

    def synchronized_step(model, opt, x, y):
        """The compute-only step with the ranks waiting for each other between backward and
        update, as every exchange makes them: a 1 KB allgather of gradient values."""
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        gathered = hvd.allgather(tf.reshape(grads[0], [-1])[:256], name="synchronization")
        with tf.control_dependencies([gathered]):
            grads = [tf.identity(g) for g in grads]
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    schemes = []  # (label, kind, builder) ; builder(model, opt) -> (step, info)

    def add(label, kind, builder):
        if not args.schemes or any(s in label for s in args.schemes):
            schemes.append((label, kind, builder))

    add("compute only (no communication)", "none",
        lambda m, o: (lambda x, y: plain_step(m, o, x, y), {}))
    add(SYNCHRONIZED, "sync", lambda m, o: (lambda x, y: synchronized_step(m, o, x, y), {}))
    add("dense allreduce (Horovod, fp32)", "dense",
        lambda m, o: (lambda x, y: plain_step(m, o, x, y, hvd.DistributedGradientTape), {}))
    add("Horovod fp16 compression", "fp16",
        lambda m, o: (lambda x, y: plain_step(
            m, o, x, y, lambda t: hvd.DistributedGradientTape(
                t, compression=hvd.Compression.fp16)), {}))
    add(f"Top-k {RATIO:.0%} IndexedSlices (tf.math.top_k, Horovod allgather)", "slices",
        lambda m, o: (make_indexed_slices_step(m, o), {}))

    def drh_builder(index_spec, value_spec, sparsifier=None, **communicator):
        def build(m, o):
            compression = drh.Compression(sparsifier=sparsifier or dr.TopK(RATIO), index=index_spec,
                                          value=value_spec, **communicator)
            step = lambda x, y: plain_step(  # noqa: E731
                m, o, x, y, lambda t: drh.DistributedGradientTape(t, compression=compression))
            return step, {"compression": compression}
        return build

    add(f"Top-k {RATIO:.0%} raw pairs int32+fp32 (allgather)", "drh",
        drh_builder("raw", "raw"))
    add(f"deepreduce Top-k {RATIO:.0%} + {index} + fp16 (allgather)", "drh",
        drh_builder(index, "fp16"))
    # what the per-step non-finite check (a read pass, a small allgather) costs
    add(f"deepreduce Top-k {RATIO:.0%} + {index} + fp16 (allgather), check_finite=False", "drh",
        drh_builder(index, "fp16", check_finite=False))
    add(f"deepreduce Top-k {RATIO:.0%} + {index} + qsgd (allgather)", "drh",
        drh_builder(index, "qsgd"))
    # the fastest exact index code
    add(f"deepreduce Top-k {RATIO:.0%} + golomb + fp16 (allgather)", "drh",
        drh_builder("golomb", "fp16"))

    add(f"deepreduce sparse_allreduce (SparCML), Top-k {RATIO:.0%} + {index} + fp16", "drh",
        drh_builder(index, "fp16", communicator="sparse_allreduce"))
    add(f"deepreduce block (OmniReduce), block Top-k {RATIO:.0%} of 256 + fp16", "drh",
        drh_builder(index, "fp16", dr.BlockTopK(RATIO, block=256), communicator="block",
                    communicator_options={"block_size": 256}))

    # Every scheme gets its own model (same initial weights) and the same batches. The
    # schemes take turns, a few steps each, round after round: load from other jobs on the
    # machine then spreads over all of them instead of spoiling one. Each round in a new
    # order (the same on both ranks): what a scheme leaves behind (a drained token bucket,
    # TCP windows after a dense transfer) then comes before a different scheme each time.
    runs = []
    for label, kind, builder in schemes:
        model = build_model()
        opt = tf.keras.optimizers.SGD(args.lr)
        hvd.broadcast_variables(model.variables, root_rank=0)
        step, info = builder(model, opt)
        if not args.eager:  # as Keras fit and most custom loops run: one graph per step
            step = tf.function(step)
        runs.append(dict(label=label, kind=kind, model=model, step=step, info=info,
                         batches=np.random.default_rng(args.seed + rank), times=[],
                         losses=[], path=[], sent=[], wire=0, has_wire=True))

    def run_steps(run, count, timed):
        for _ in range(count):
            batch = run["batches"].choice(len(labels), size=args.batch_size, replace=False)
            start = time.perf_counter()
            loss = float(run["step"](tf.constant(features[batch]), tf.constant(labels[batch])))
            elapsed = time.perf_counter() - start
            if timed:
                run["times"].append(elapsed)
                run["losses"].append(loss)
                if "compression" in run["info"]:  # this step's encode, decode and codec times
                    compression = run["info"]["compression"]
                    run["path"].append(compression.stats.last.per_step())
                    if is_ours(run["label"]):  # its bundles, for the codec-time prediction
                        run["sent"].append({group: sent.bundle for group, sent
                                            in compression.exchange._last_sent.items()})

    for run in runs:
        run_steps(run, args.warmup, timed=False)
        info = run["info"]
        if "compression" in info:
            run["snapshot"] = info["compression"].stats.snapshot()
    per_round = max(1, -(-args.steps // args.rounds))
    for turn in range(args.rounds):
        for position in np.random.default_rng([args.seed, turn]).permutation(len(runs)):
            run = runs[position]
            hvd.allreduce(tf.zeros([1]), name="barrier")  # the ranks start each turn together
            tx_start = loopback_tx_bytes()
            run_steps(run, per_round, timed=True)
            hvd.allreduce(tf.zeros([1]), name="barrier")
            tx_end = loopback_tx_bytes()
            if tx_start is None or tx_end is None:
                run["has_wire"] = False
            else:
                run["wire"] += tx_end - tx_start

    # Horovod's own fixed cost of one allgather on this link, as the steps issue it (in a
    # tf.function, the ranks idle and the token bucket refilled, as between steps): what a
    # step pays besides the wire time of its bytes, whatever it sends
    @tf.function
    def small_allgather(data):
        return hvd.allgather(data, name="latency_probe")

    probe, latencies = tf.zeros([1024], tf.uint8), []
    for _ in range(ALLGATHER_PROBES):
        hvd.allreduce(tf.zeros([1]), name="barrier")
        time.sleep(0.02)
        start = time.perf_counter()
        small_allgather(probe).numpy()
        latencies.append(time.perf_counter() - start)
    allgather_ms = 1e3 * float(np.median(latencies[2:]))

    results = []
    for run in runs:
        times, kind, info = run["times"], run["kind"], run["info"]
        params = sum(int(np.prod(v.shape)) for v in run["model"].trainable_variables)
        steps = len(times)
        row = dict(scheme=run["label"], kind=kind, params=params, steps=steps,
                   step_ms_median=1e3 * float(np.median(times)),
                   step_ms_mean=1e3 * float(np.mean(times)),
                   step_ms_min=1e3 * float(np.min(times)),
                   step_ms_q1=1e3 * float(np.percentile(times, 25)),
                   step_ms_q3=1e3 * float(np.percentile(times, 75)), final_loss=run["losses"][-1],
                   step_ms=[1e3 * t for t in times],  # in turn order, per_round a turn
                   wire_bytes_per_step=run["wire"] / steps if run["has_wire"] else None)
        dense_bytes = 4 * params
        if kind == "dense":
            row["bytes_sent"] = dense_bytes
        elif kind == "fp16":
            row["bytes_sent"] = dense_bytes // 2
        elif kind == "slices":
            sizes = [int(np.prod(v.shape)) for v in run["model"].trainable_variables]
            row["bytes_sent"] = sum(8 * max(1, int(np.ceil(RATIO * n))) if n >= 1024 else 4 * n
                                    for n in sizes)
        elif kind == "drh":
            per = (info["compression"].stats.snapshot() - run["snapshot"]).per_step()
            row["bytes_sent"] = per["bytes_sent"]
            # medians over the timed steps, as for the step time; the means beside them
            for key in ("encode_ms", "decode_ms", "exchange_ms", "codec_ms"):
                row[key] = float(np.median([step[key] for step in run["path"]]))
                row[f"{key}_mean"] = per[key]
        else:
            row["bytes_sent"] = 0
        row["dense_bytes"] = dense_bytes
        row["step_ms_median_ranks"] = hvd.allgather_object(row["step_ms_median"])
        results.append(row)
        if rank == 0:
            print(f"  {row['scheme']}: {row['step_ms_median']:.1f} ms/step, "
                  f"{row['bytes_sent'] / 1e6:.3f} MB sent per rank", flush=True)
    ours = next((run for run in runs if is_ours(run["label"])), None)
    if rank == 0 and ours is not None:
        # the Top-k pairs this rank sent in each timed step, for the codec-time prediction
        saved = {}
        for step, sent in enumerate(ours["sent"]):  # per bundle group: its bundle
            pairs = []
            for group in sorted(sent):
                bundle = split_bundles(sent[group], 1)[0]
                decoded = [dr.decompress(bytes(payload)) for payload in bundle.payloads]
                # the payloads of the compressed tensors, as the codecs coded them
                tensors = bundle.tensors(decoded)
                pairs += [decoded[slot] for slot in sorted(
                    {slot for t, slot in enumerate(bundle.slots) if tensors[t].size >= 1024})]
            saved.update({f"{field}{step}_{i}": value for i, pair in enumerate(pairs)
                          for field, value in (("indices", pair.indices), ("values", pair.values),
                                               ("size", np.int64(pair.size)))})
        np.savez(pairs_path(args.worker_out), **saved)
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(
            dict(results=results, ranks=size, index=index, hidden=args.hidden,
                 layers=args.layers, batch_size=args.batch_size, steps_per_turn=per_round,
                 allgather_1kb_ms=allgather_ms), indent=1))


# -- the driver --------------------------------------------------------------------------

def prepare_link(rate, net) -> tuple[list[str], float]:
    """Shape ``net`` to ``rate`` (``net`` None: the plain loopback) and measure one TCP
    stream across it: the command prefix that runs a process there, and its Gbit/s."""
    prefix = []
    if net is not None:
        net.shape(rate)
        prefix = net.prefix()
    probe = subprocess.run(prefix + [sys.executable, "-m", "benchmarks.e2e", "--probe"],
                           cwd=ROOT, capture_output=True, text=True, check=True)
    measured = float(probe.stdout.strip().splitlines()[-1])
    print(f"{rate or 'unshaped loopback'}: single TCP stream measured {measured:.2f} Gbit/s",
          flush=True)
    return prefix, measured


def run_rate(rate, args, net):
    """Run the worker on two ranks (shaped to ``rate`` unless ``net`` is None)."""
    prefix, measured = prepare_link(rate, net)
    # the best of before and after the run: a copy timed while another job loads the
    # memory bus would take the floor for more than this machine's
    copy_before = copy_bandwidth()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "worker.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2",
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
        horovodrun = str(Path(sys.executable).parent / "horovodrun")
        cmd = (prefix + [horovodrun, "-np", "2", "-H", "localhost:2", "--gloo",
                        sys.executable, "-m", "benchmarks.e2e", "--worker", "--worker-out", str(out),
                        "--steps", str(args.steps), "--warmup", str(args.warmup),
                        "--rounds", str(args.rounds),
                        "--hidden", str(args.hidden), "--layers", str(args.layers),
                        "--batch-size", str(args.batch_size), "--lr", str(args.lr),
                        "--seed", str(args.seed), "--link-gbits", f"{measured:.2g}"]
               + (["--eager"] if args.eager else []))
        if args.schemes:
            cmd += ["--schemes", *args.schemes]
        subprocess.run(cmd, cwd=ROOT, env=env, check=True)
        data = json.loads(out.read_text())
        steps_pairs = saved_pairs(pairs_path(out)) if pairs_path(out).exists() else None
    data.update(rate=rate if net is not None else "unshaped loopback", measured_gbit=measured,
                copy_gbytes_s=max(copy_before, copy_bandwidth()),
                codec_prediction_random_ms=codec_cost_ms(
                    random_pairs(mlp_shapes(args.hidden, args.layers)), data["index"], "fp16"))
    if steps_pairs:
        # auto's choice varies from step to step (at 100 Mbit/s Huffman codes for some,
        # Golomb for others), so one step's pairs would not predict the median step
        data["codec_prediction_ms"] = float(np.median(
            [codec_cost_ms(pairs, data["index"], "fp16") for pairs in steps_pairs]))
        data["codec_prediction_steps"] = len(steps_pairs)
    print(f"  memory copy {data['copy_gbytes_s']:.1f} GB/s; the codecs' own speed predicts "
          f"{data.get('codec_prediction_ms', float('nan')):.1f} ms of codec time per step on "
          f"this run's pairs, {data['codec_prediction_random_ms']:.1f} ms on random supports",
          flush=True)
    return data


def is_ours(label) -> bool:
    """The scheme the issue's targets are about: deepreduce, allgather, fp16 values."""
    return label.startswith("deepreduce Top-k") and "+ fp16 (allgather)" in label \
        and "golomb" not in label and "check_finite" not in label


def prediction_source(run) -> str:
    """What the codec-time prediction of ``run`` was timed on: runs saved before it was
    timed on each timed step's pairs timed it on the last step's, or before that on random
    supports only."""
    if "codec_prediction_steps" in run:
        return (f" on the pairs this rank sent in each of its {run['codec_prediction_steps']} "
                "timed steps (the median step)")
    return " on the pairs this rank sent in its last step" \
        if "codec_prediction_random_ms" in run else ""


def pairs_path(worker_out) -> Path:
    return Path(worker_out).with_suffix(".pairs.npz")


def random_pairs(shapes):
    """Top-k pairs of every compressed payload of ``shapes`` on random supports (the
    tensors below ``SHARED_BELOW`` elements share one, as the exchange codes them)."""
    import deepreduce as dr
    from deepreduce.exchange.gathering import SHARED_BELOW

    sizes = [int(np.prod(shape)) for shape in shapes]
    shared = [n for n in sizes if 1024 <= n < SHARED_BELOW]
    payloads = [n for n in sizes if n >= SHARED_BELOW] + \
        ([sum(shared)] if len(shared) > 1 else shared)
    rng, pairs = np.random.default_rng(0), []
    for n in payloads:
        k = max(1, int(np.ceil(RATIO * n)))
        indices = np.sort(rng.choice(n, k, replace=False))
        pairs.append(dr.SparseTensor(rng.standard_normal(k).astype(np.float32), indices, (n,)))
    return pairs


def saved_pairs(path):
    """Per timed step, the pairs a worker saved (see :func:`pairs_path`)."""
    import deepreduce as dr

    with np.load(path) as saved:
        keys = [name[len("size"):].split("_") for name in saved.files if name.startswith("size")]
        steps = [[] for _ in range(1 + max((int(step) for step, _ in keys), default=-1))]
        for step, i in sorted(keys, key=lambda key: (int(key[0]), int(key[1]))):
            steps[int(step)].append(dr.SparseTensor(
                saved[f"values{step}_{i}"], saved[f"indices{step}_{i}"],
                (int(saved[f"size{step}_{i}"]),)))
        return steps


def codec_cost_ms(pairs, index, value, ranks=2, repeats=5) -> float:
    """What the codecs' own speed predicts per step: encoding this rank's Top-k ``pairs``
    (a SparseTensor per tensor) and decoding the other ``ranks - 1`` payloads of each (a
    rank never decodes its own), from median timings outside any framework."""
    import deepreduce as dr

    total = 0.0
    for selected in pairs:
        pipeline = dr.Pipeline(None, index=index, value=value)
        encodes, decodes = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            payload, _ = pipeline.encode_sparse(selected, None)
            encodes.append(time.perf_counter() - start)
            start = time.perf_counter()
            dr.decompress(payload)
            decodes.append(time.perf_counter() - start)
        total += np.median(encodes) + (ranks - 1) * np.median(decodes)
    return 1e3 * total


def targets(run):
    """The issue's targets at this rate: deepreduce (fp16) against dense and raw Top-k."""
    dense = next((r for r in run["results"] if r["kind"] == "dense"), None)
    raw = [r for r in run["results"] if r["kind"] in ("drh", "slices")
           and ("raw pairs" in r["scheme"] or "IndexedSlices" in r["scheme"])]
    ours = next((r for r in run["results"] if is_ours(r["scheme"])), None)
    if ours is None:
        return None
    out = dict(scheme=ours["scheme"], step_ms=ours["step_ms_median"])
    if dense:
        out["vs_dense"] = dense["step_ms_median"] / ours["step_ms_median"]
    for r in raw:
        key = "vs_raw_pairs" if "raw pairs" in r["scheme"] else "vs_indexed_slices"
        out[key] = r["step_ms_median"] / ours["step_ms_median"]
        if "step_ms" in r and "step_ms" in ours and run.get("steps_per_turn"):
            out[f"{key}_interval"] = paired_interval(r["step_ms"], ours["step_ms"],
                                                     run["steps_per_turn"])
    path_ms = ours.get("encode_ms", 0.0) + ours.get("decode_ms", 0.0)
    out.update(path_ms=path_ms, path_fraction=path_ms / ours["step_ms_median"],
               codec_ms=ours.get("codec_ms", 0.0),
               codec_fraction=ours.get("codec_ms", 0.0) / ours["step_ms_median"])
    compute = next((r for r in run["results"] if r["kind"] == "none"), None)
    if compute is not None and ours.get("wire_bytes_per_step") and run.get("measured_gbit"):
        # the physical limit: computing the step, plus the wire time of its bytes
        wire_ms = ours["wire_bytes_per_step"] * 8e3 / (run["measured_gbit"] * 1e9)
        out.update(limit_ms=compute["step_ms_median"] + wire_ms, wire_ms=wire_ms,
                   vs_limit=ours["step_ms_median"] / (compute["step_ms_median"] + wire_ms))
    if run.get("codec_prediction_ms"):
        out["codec_vs_prediction"] = out["codec_ms"] / run["codec_prediction_ms"]
    if run.get("copy_gbytes_s"):
        # read the gradient, read and write the residual, write the reduced gradient
        floor_ms = 16 * ours["params"] / (run["copy_gbytes_s"] * 1e9) * 1e3
        out.update(memory_floor_ms=floor_ms,
                   non_codec_vs_floor=(path_ms - out["codec_ms"]) / floor_ms)
    return out


#: The columns of :func:`cost_cells` in the reports of this script and of torch_e2e.py.
COST_COLUMNS = ("MB sent per rank", "wire MB per step", "encode + decode ms",
                "of which codecs ms", "exchange ms")


def cost_cells(r) -> list[str]:
    """What a scheme's step sends and what its exchange costs, as report cells (empty where
    the scheme has no such figure)."""
    wire = r.get("wire_bytes_per_step")
    return [f"{r['bytes_sent'] / 1e6:.3f}",
            f"{wire / 1e6:.2f}" if wire is not None else "n/a",
            f"{r['encode_ms'] + r['decode_ms']:.1f}" if "encode_ms" in r else "",
            f"{r['codec_ms']:.1f}" if r.get("codec_ms") else "",
            f"{r['exchange_ms']:.1f}" if r.get("exchange_ms") is not None else ""]


def paired_interval(times, other_times, per_turn: int) -> tuple[float, float]:
    """The 95% interval of median(times) / median(other_times), two schemes' steps taken
    ``per_turn`` at a time in alternating turns: a bootstrap that resamples whole turns,
    the same ones for both (a turn's steps share the machine's load of the moment)."""
    turns = np.asarray(times).reshape(-1, per_turn)
    other = np.asarray(other_times).reshape(-1, per_turn)
    picks = np.random.default_rng(0).integers(0, len(turns), (RESAMPLES, len(turns)))
    ratios = (np.median(turns[picks].reshape(RESAMPLES, -1), axis=1)
              / np.median(other[picks].reshape(RESAMPLES, -1), axis=1))
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def interval_text(t, key) -> str:
    if f"{key}_interval" not in t:
        return ""
    return " (95% interval {:.2f}-{:.2f})".format(*t[f"{key}_interval"])


def reading(run, t):
    """What the measured times allow: the best ratio a codec of this speed can reach."""
    by_kind = {}
    for r in run["results"]:
        by_kind.setdefault(r["kind"], r)
    floor, dense = by_kind.get("none"), by_kind.get("dense")
    ours = next(r for r in run["results"] if r["scheme"] == t["scheme"])
    raw = next((r for r in run["results"] if "raw pairs" in r["scheme"]), None)
    if floor is None or dense is None:
        return []
    compute, codec, dense_ms = floor["step_ms_median"], t["path_ms"], dense["step_ms_median"]
    rest = t["step_ms"] - compute - codec
    params = ours["params"]
    lines = [f"Where its {t['step_ms']:.0f} ms go: forward + backward + update {compute:.0f} ms "
             f"(the compute-only step), encode + decode {codec:.0f} ms "
             f"({1e6 * codec / params:.1f} ns per parameter; {t['codec_ms']:.0f} ms of it in "
             f"the index and value codecs, the rest error feedback, Top-k and the dense sums), "
             f"the remaining {rest:.0f} ms"]
    exchange = ours.get("exchange_ms")
    if exchange is not None and run.get("allgather_1kb_ms") is not None \
            and t.get("wire_ms") is not None:
        lines[-1] += (f": the exchange, {exchange:.1f} ms from the end of this rank's encoding "
                      f"to the start of its decoding ({t['wire_ms']:.1f} ms of wire time for "
                      f"its bytes at the measured rate, {run['allgather_1kb_ms']:.1f} ms that "
                      "Horovod takes for any allgather here (one of 1 KB, timed in the same run "
                      "with the ranks idle: its negotiation between the ranks and its "
                      "background thread's cycle), the rest waiting for the other rank; tc's "
                      f"token bucket lets a burst of "
                      f"{burst(run['rate']).replace('kb', ' KB').replace('mb', ' MB')} through "
                      "at once, without wire time), and "
                      f"{max(0.0, rest - exchange):.1f} ms around it: TensorFlow's host calls "
                      "and the conversions of their tensors (medians of different quantities: "
                      "they need not add up exactly)")
    lines[-1] += "."
    synchronized = by_kind.get("sync")
    if synchronized is not None:
        lines[-1] += (f" Waiting for each other alone: the compute-only step with a 1 KB "
                      f"allgather between backward and update took "
                      f"{synchronized['step_ms_median']:.1f} ms, "
                      f"{synchronized['step_ms_median'] - compute:+.1f} ms against the "
                      "compute-only step.")
    lines += ["",
             f"Reading the targets: even with free communication this step cannot be shorter "
             f"than compute + codec = {compute + codec:.0f} ms, {dense_ms / (compute + codec):.1f}x "
             f"below dense allreduce's {dense_ms:.0f} ms. 5x needs the whole step under "
             f"{dense_ms / 5:.0f} ms: after the {compute:.0f} ms of compute that leaves "
             f"{max(0.0, dense_ms / 5 - compute):.0f} ms for encoding, exchange and decoding."]
    if raw is not None and raw.get("wire_bytes_per_step") and ours.get("wire_bytes_per_step"):
        to_ms = 8e3 / (run["measured_gbit"] * 1e9)
        saved = (raw["wire_bytes_per_step"] - ours["wire_bytes_per_step"]) * to_ms
        lines[-1] += (f" Against raw Top-k pairs the wire carries "
                      f"{raw['wire_bytes_per_step'] / 1e6:.2f} MB instead of "
                      f"{ours['wire_bytes_per_step'] / 1e6:.2f} MB per step: at the measured "
                      f"{run['measured_gbit']:.2f} Gbit/s that is {saved:.0f} ms, the most the "
                      "codecs can save over raw pairs here, against "
                      f"{codec - raw.get('encode_ms', 0) - raw.get('decode_ms', 0):.0f} ms of "
                      "extra encode + decode.")
    return lines


NOTES = [
    "## Notes", "",
    "* The ranks share two cores with each other and with other jobs: forward and backward "
    "run on one thread per rank, Horovod's and deepreduce's work competes with them. Times "
    "are medians over turns spread across the run (step times with their quartiles: a "
    "difference of a few ms between two schemes can be the machine's noise), and so are the "
    "encode, decode, codec and "
    "exchange times (each rank's own per step); the JSON file has every rank's median step, "
    "the mean and the minimum, and the means of the encode, decode, codec and exchange times. "
    "A ratio of two schemes' median steps is given with its 95% interval: a bootstrap that "
    "resamples whole turns, the same turns for both schemes (the JSON file has every "
    "step's time on rank 0, in turn order).",
    "* Horovod's fp16 compression can be slower than float32 here: converting and reducing "
    "float16 on the CPU costs more than the halved traffic saves when the link is fast.",
    "* `Top-k IndexedSlices` uses `tf.math.top_k`, a full sort-based selection that costs "
    "far more than deepreduce's sampled threshold; `Top-k raw pairs` uses deepreduce's Top-k "
    "and error feedback with raw int32 + float32 pairs, so that comparing it with the "
    "deepreduce rows isolates what the index and value codecs bring. *Encode + decode*: "
    "from the gradient to the payloads (error feedback, Top-k, codecs) and from the gathered "
    "payloads to the dense sums; *of which codecs*: the part inside the index and value "
    "codecs (coding the selected entries, decoding the payloads). `auto:link_gbits=G` is "
    "`auto` told the single-stream bandwidth measured at the start of the run: it picks the "
    "index stream cheapest to encode, send at G Gbit/s and decode (plain `auto` picks the "
    "smallest, here Huffman codes 1% smaller than Golomb's and 2-4x slower to code); the "
    "`golomb` row fixes the fastest exact index code.",
    "* sparse_allreduce and block are deepreduce's SparCML and OmniReduce communicators "
    "(`deepreduce.collectives`) selected in the same Horovod wrappers "
    "(`drh.Compression(..., communicator=...)`); their *MB sent* counts every frame a rank "
    "contributes to both of their collectives, and since they decode and sum inside the "
    "exchange (at the range owners), that work shows in *exchange ms*, not in *encode + "
    "decode ms*. Exchange: from the end of encoding to the start of decoding, waiting for the "
    "slower rank included.",
    "",
]


def report(runs, args):
    first = runs[0]["results"]
    params = first[0]["params"]
    lines = ["# End to end: Horovod training steps over a shaped network", "",
             f"Two ranks (`horovodrun -np 2 --gloo`) on one machine ({platform.machine()}, "
             f"{os.cpu_count()} cores shared with other jobs), one intra-op TensorFlow thread per rank. "
             f"Model: MLP 64-{'-'.join([str(args.hidden)] * args.layers)}-10 on scikit-learn's "
             f"digits, {params:,} parameters ({4 * params / 1e6:.1f} MB of float32 gradients), "
             f"batch {args.batch_size} per rank, plain SGD, each step "
             f"{'run eagerly' if args.eager else 'a tf.function (as in Keras fit)'}. "
             "Every scheme trains its own copy of "
             f"the model on the same batches: {args.warmup} warm-up steps, then {args.steps} "
             f"timed steps taken in {args.rounds} turns, the schemes alternating (in an order drawn "
             "afresh for each round), so that load "
             "from other jobs spreads over all of them. Step time is the median on rank 0 "
             "(forward, backward, reduction, update). Bytes sent: what one rank contributes per step "
             "(dense: its float32 gradients; Top-k: its pairs or payloads). Wire bytes: "
             "everything that crossed the namespace's loopback per step, both ranks, TCP "
             "framing and Horovod's control messages included. Error feedback is on for every "
             f"Top-k scheme. deepreduce's index codec: `{runs[0]['index']}`.", ""]
    for run in runs:
        lines += [f"## {run['rate']} (single TCP stream measured {run['measured_gbit']:.2f} "
                  "Gbit/s)", ""]
        dense = next((r for r in run["results"] if r["kind"] == "dense"), None)
        rows = []
        for r in run["results"]:
            speedup = f"{dense['step_ms_median'] / r['step_ms_median']:.2f}" if dense else ""
            step = f"{r['step_ms_median']:.1f}" + (
                f" ({r['step_ms_q1']:.1f}-{r['step_ms_q3']:.1f})" if "step_ms_q1" in r else "")
            rows.append([r["scheme"], step, speedup, *cost_cells(r), f"{r['final_loss']:.3f}"])
        lines += table(["scheme", "step ms (median, quartiles)", "x faster than dense",
                        *COST_COLUMNS, "loss after the timed steps"], rows)
        t = targets(run)
        if t:
            lines += ["", f"Targets for `{t['scheme']}`, as step-time ratios: dense allreduce / "
                          f"deepreduce = {t.get('vs_dense', float('nan')):.2f} (target >= 5); raw "
                          "Top-k pairs over allgather / deepreduce = "
                          f"{t.get('vs_raw_pairs', float('nan')):.2f}"
                          f"{interval_text(t, 'vs_raw_pairs')} and Top-k IndexedSlices / "
                          f"deepreduce = {t.get('vs_indexed_slices', float('nan')):.2f}"
                          f"{interval_text(t, 'vs_indexed_slices')} (target "
                          f">= 1.5); encode + decode (target < 20% of its step): the index and "
                          f"value codecs {t['codec_ms']:.1f} ms = {t['codec_fraction']:.0%}, "
                          f"the whole path with error feedback, Top-k and the dense sums "
                          f"{t['path_ms']:.1f} ms = {t['path_fraction']:.0%}."]
            run["targets"] = t
            if "vs_limit" in t:
                lines += ["", f"Near the wire (issue 14): the physical limit of this step is "
                              f"compute-only + wire time of its bytes = "
                              f"{t['limit_ms'] - t['wire_ms']:.1f} + {t['wire_ms']:.1f} = "
                              f"{t['limit_ms']:.1f} ms; deepreduce takes {t['vs_limit']:.2f}x "
                              "that (target <= 1.3 at 1 Gbit/s)."]
                if run.get("allgather_1kb_ms") is not None:
                    with_fixed = t["limit_ms"] + run["allgather_1kb_ms"]
                    lines[-1] += (f" With Horovod's fixed cost of the one allgather a step "
                                  f"needs ({run['allgather_1kb_ms']:.1f} ms), {with_fixed:.1f} "
                                  f"ms: {t['step_ms'] / with_fixed:.2f}x.")
            if "codec_vs_prediction" in t:
                lines[-1] += (f" Codec time {t['codec_ms']:.1f} ms against "
                              f"{run['codec_prediction_ms']:.1f} ms predicted by the codecs' own "
                              f"speed{prediction_source(run)}"
                              f": {t['codec_vs_prediction']:.2f}x (target <= 2)")
                if run.get("codec_prediction_random_ms"):
                    lines[-1] += (f"; on random supports of the same sizes they predict "
                                  f"{run['codec_prediction_random_ms']:.1f} ms "
                                  f"({t['codec_ms'] / run['codec_prediction_random_ms']:.2f}x)")
                lines[-1] += "."
            if "non_codec_vs_floor" in t:
                lines[-1] += (f" The rest of the path (error feedback, Top-k, sums) "
                              f"{t['path_ms'] - t['codec_ms']:.1f} ms against a memory-traffic "
                              f"floor of {t['memory_floor_ms']:.1f} ms (16 bytes per parameter at "
                              f"the measured {run['copy_gbytes_s']:.1f} GB/s copy bandwidth): "
                              f"{t['non_codec_vs_floor']:.2f}x (target <= 2).")
            lines += ["", *reading(run, t)]
        lines.append("")
    lines += NOTES + [f"![step time per scheme]({Path(args.out).with_suffix('.png').name})", ""]
    return "\n".join(lines)


def plot(runs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schemes = list(dict.fromkeys(r["scheme"] for run in runs for r in run["results"]))
    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 0.45 * len(schemes) + 1.8),
                             sharey=True)
    axes = np.atleast_1d(axes)
    for ax, run in zip(axes, runs):
        by = {r["scheme"]: r for r in run["results"]}
        y = np.arange(len(schemes))
        step = [by[s]["step_ms_median"] if s in by else np.nan for s in schemes]
        codec = [by[s].get("encode_ms", 0) + by[s].get("decode_ms", 0) if s in by else 0
                 for s in schemes]
        ax.barh(y, step, color="tab:blue", label="step time")
        ax.barh(y, codec, color="tab:orange", label="of which deepreduce encode + decode")
        for yi, value in zip(y, step):
            if np.isfinite(value):
                ax.text(value, yi, f" {value:.0f}", va="center", fontsize=7)
        ax.set_yticks(y, [s.replace(" (", "\n(") for s in schemes], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("ms per step (median)")
        if np.nanmax(step) > 30 * np.nanmin(step):  # a slow link: dense would hide the rest
            ax.set_xscale("log")
            ax.set_xlabel("ms per step (median, log scale)")
        ax.set_title(f"{run['rate']} (measured {run['measured_gbit']:.2f} Gbit/s)")
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"2 ranks, MLP with {runs[0]['results'][0]['params'] / 1e6:.1f}M parameters")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit", "100mbit"],
                        help="tc rates of the shaped loopback (default: 1gbit 10gbit 100mbit)")
    parser.add_argument("--no-netns", action="store_true",
                        help="no namespace, no shaping: the plain loopback (no root needed)")
    parser.add_argument("--hidden", type=int, default=2048, help="width of the hidden layers")
    parser.add_argument("--layers", type=int, default=3, help="hidden layers")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--steps", type=int, default=48, help="timed steps per scheme")
    parser.add_argument("--rounds", type=int, default=16,
                        help="the timed steps are spread over this many turns per scheme")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eager", action="store_true",
                        help="run each training step eagerly instead of as a tf.function")
    parser.add_argument("--schemes", nargs="*", default=None,
                        help="only schemes whose label contains one of these strings")
    parser.add_argument("--out", default=str(RESULTS / "e2e.md"))
    parser.add_argument("--from-json", metavar="E2E_JSON",
                        help="only re-render the table and plot of an earlier run's e2e.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--link-gbits", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.probe:
        print(f"{probe_bandwidth():.4f}")
        return 0
    if args.worker:
        worker(args)
        return 0
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        runs = saved["runs"]
        args = argparse.Namespace(**{**vars(args), **{k: saved["args"][k] for k in (
            "hidden", "layers", "batch_size", "steps", "rounds", "warmup")},
            "eager": saved["args"].get("eager", True)})  # runs saved before the flag were eager
        return write_results(runs, args)
    runs = run_rates(args, run_rate)
    return 2 if runs is None else write_results(runs, args)


def run_rates(args, run_rate, namespace=NAMESPACE, name="e2e"):
    """``run_rate(rate, args, net)`` at each of ``args.rates`` on a loopback shaped to it
    (with ``--no-netns``, once on the plain loopback): the runs, or None, said on stderr,
    where this machine does not let the script shape its network."""
    if args.no_netns:
        return [run_rate(None, args, None)]
    try:
        with ShapedLoopback(namespace) as net:
            return [run_rate(rate, args, net) for rate in args.rates]
    except NetnsError as exc:
        print(f"{name}: cannot shape the network: {exc}", file=sys.stderr)
        return None


def write_results(runs, args, report=report, plot=plot):
    """Write the markdown table, the plot and the JSON of ``runs`` next to ``args.out``."""
    text = report(runs, args)
    out = write_report(args.out, text, dict(runs=runs, args=vars(args)))
    plot(runs, out.with_suffix(".png"))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
