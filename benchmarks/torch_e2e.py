"""End to end with PyTorch DDP: training steps over a bandwidth-limited network.

Two gloo ranks (spawned processes) train the e2e benchmark's MLP (64-2048-2048-2048-10,
about 8.5M parameters, scikit-learn's digits, batch 32 per rank) with
``torch.nn.parallel.DistributedDataParallel`` and each way of reducing the
gradients a PyTorch user would pick:

``compute only``
    one process, no DDP: the floor of every step time;
``DDP allreduce fp32``
    DDP's own bucketed allreduce;
``DDP, a hook that sends nothing``
    a comm hook that hands each bucket back as it is (no communication, each
    rank steps on its own gradient): what DDP's buckets and hook calls cost,
    the floor of every hook's step;
``DDP fp16_compress_hook``
    PyTorch's fp16 cast hook;
``PowerSGD rank 1`` / ``rank 4``
    PyTorch's PowerSGD hook with error feedback. On this torch build PowerSGD
    with more than one bucket aborted on gloo with a collective size mismatch,
    so its model gets one bucket (``bucket_cap_mb`` above the model's size);
``raw Top-k pairs``
    what a user writes without deepreduce: a hook with error feedback,
    ``torch.topk`` of 1% of each bucket, int32 indices and float32 values
    allgathered, summed with ``index_add_``;
``deepreduce``
    ``deepreduce_hook``: Top-k 1%, ``auto`` indices with fp16 or 8-bit QSGD
    values over the allgather communicator, and fp16 over SparCML's
    ``sparse_allreduce`` and OmniReduce's ``block`` (Top-k of 256-element
    blocks). ``auto`` is told the single-stream bandwidth measured at the
    start of the run (``auto:link_gbits=G``: the index stream cheapest to code
    and send, not the smallest), as a user who knows their network would.

As in benchmarks/e2e.py, as root the script shapes a network namespace's
loopback with ``tc`` to each rate, measures the single TCP stream it gets, runs
the ranks inside it and deletes it afterwards; schemes alternate in turns, in an
order drawn afresh each round, so that load from other jobs spreads over all of
them. deepreduce's rows break the step down (encode, decode, codecs, exchange,
from the hook state's stats) and set it against its physical limit. Writes
``benchmarks/results/torch_e2e.md``, ``.json`` and ``.png``.

    python -m benchmarks.torch_e2e                      # 1 Gbit/s, 10 Gbit/s, 100 Mbit/s
    python -m benchmarks.torch_e2e --rates 1gbit --steps 6 --rounds 2     # quicker
    python -m benchmarks.torch_e2e --from-json benchmarks/results/torch_e2e.json  # re-render
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, free_port, table
from benchmarks.e2e import (BURST, COST_COLUMNS, cost_cells, loopback_tx_bytes, prepare_link,
                            run_rates, write_results)

NAMESPACE = "drtorch"
RATIO = 0.01
DEEPREDUCE = "deepreduce Top-k 1% + auto + fp16 (allgather)"
NOTHING = "DDP, a hook that sends nothing"
UNCHECKED = "deepreduce Top-k 1% + auto + fp16 (allgather), check_finite=False"
#: The hierarchical scheme, in the schemes when ``args.local_size`` is set
#: (``benchmarks/hierarchical.py``).
HIERARCHICAL = "deepreduce Top-k 1% + auto + fp16 (hierarchical)"


# -- the worker: one process per rank ---------------------------------------------------

def build_schemes(args, world):
    """``(label, kind, ddp_kwargs, register)`` per scheme; ``register(ddp)`` returns a
    function giving the bytes this rank contributed since its last call (for deepreduce,
    with the hook state's ``stats`` as its attribute)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    import deepreduce as dr
    import deepreduce.torch as drt

    def dense_bytes(ddp, itemsize=4):
        per_step = itemsize * sum(p.numel() for p in ddp.parameters())
        return lambda steps: per_step * steps

    def plain(ddp):
        return dense_bytes(ddp)

    def nothing(ddp):
        def hook(state, bucket):
            future = torch.futures.Future()
            future.set_result(bucket.buffer())
            return future
        ddp.register_comm_hook(None, hook)
        return lambda steps: 0

    def fp16(ddp):
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return dense_bytes(ddp, 2)

    def powersgd(rank):
        def register(ddp):
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=rank,
                start_powerSGD_iter=args.start_iter, use_error_feedback=True,
                min_compression_rate=2)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            per_step = 0
            for p in ddp.parameters():  # what PowerSGD compresses, and what it sends dense
                n, m = p.shape[0], p[0].numel() if p.dim() > 1 else 1
                compressed = p.dim() > 1 and n * m >= 2 * (n + m) * rank
                per_step += 4 * ((n + m) * rank if compressed else p.numel())
            return lambda steps: per_step * steps
        return register

    def raw_pairs(ddp):
        residuals = {}
        sent = [0]

        def hook(state, bucket):
            buffer = bucket.buffer()
            key = (bucket.index(), buffer.numel())
            corrected = buffer + residuals[key] if key in residuals else buffer.clone()
            k = max(1, int(RATIO * corrected.numel()))
            _, indices = torch.topk(corrected.abs(), k, sorted=False)
            values = corrected[indices]
            corrected[indices] = 0
            residuals[key] = corrected
            sent[0] += 8 * k
            gathered_i = [torch.empty_like(indices, dtype=torch.int32) for _ in range(world)]
            gathered_v = [torch.empty_like(values) for _ in range(world)]
            dist.all_gather(gathered_i, indices.to(torch.int32))
            work = dist.all_gather(gathered_v, values, async_op=True)

            def finish(_):
                buffer.zero_()
                for i, v in zip(gathered_i, gathered_v):
                    buffer.index_add_(0, i.long(), v)
                return buffer.div_(world)
            return work.get_future().then(finish)

        ddp.register_comm_hook(None, hook)

        def take(steps):
            value, sent[0] = sent[0], 0
            return value
        return take

    index = f"auto:link_gbits={args.link_gbits}" if args.link_gbits else "auto"

    def deepreduce(**settings):
        def register(ddp):
            state = drt.DeepReduceState(start_iter=args.start_iter, index=index, **settings)
            ddp.register_comm_hook(state, drt.deepreduce_hook)
            last = [state.stats.snapshot()]

            def take(steps):
                now = state.stats.snapshot()
                value, last[0] = (now - last[0]).bytes_sent, now
                return value
            take.stats = state.stats
            return take
        return register

    one_bucket = {"bucket_cap_mb": 1024}
    schemes = [
        ("DDP allreduce fp32", "dense", {}, plain),
        (NOTHING, "floor", {}, nothing),
        ("DDP fp16_compress_hook", "fp16", {}, fp16),
        ("PowerSGD rank 1 (one bucket)", "powersgd", one_bucket, powersgd(1)),
        ("PowerSGD rank 4 (one bucket)", "powersgd", one_bucket, powersgd(4)),
        ("raw Top-k pairs hook (torch.topk, int32 + fp32)", "pairs", {}, raw_pairs),
        (DEEPREDUCE, "deepreduce", {}, deepreduce(sparsifier=dr.TopK(RATIO), value="fp16")),
        # what the per-bucket non-finite check (a read pass, a flag allreduced) costs
        (UNCHECKED, "deepreduce", {}, deepreduce(sparsifier=dr.TopK(RATIO), value="fp16",
                                                  check_finite=False)),
        ("deepreduce Top-k 1% + auto + qsgd:bits=8 (allgather)", "deepreduce", {},
         deepreduce(sparsifier=dr.TopK(RATIO), value="qsgd:bits=8")),
        ("deepreduce Top-k 1% + auto + fp16 (sparse_allreduce)", "deepreduce", {},
         deepreduce(sparsifier=dr.TopK(RATIO), value="fp16", communicator="sparse_allreduce")),
        ("deepreduce block Top-k 1% of 256 + fp16 (block)", "deepreduce", {},
         deepreduce(sparsifier=dr.BlockTopK(RATIO, block=256), value="fp16",
                    communicator="block")),
    ]
    if getattr(args, "local_size", None):  # ranks numbered node by node, local_size per node
        schemes.append((HIERARCHICAL, "deepreduce", {}, deepreduce(
            sparsifier=dr.TopK(RATIO), value="fp16", communicator="hierarchical",
            communicator_options={"local_size": args.local_size})))
    if args.schemes:
        schemes = [s for s in schemes if any(word in s[0] for word in args.schemes)]
    return schemes


def worker(rank, args, port, out_path):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    results = train_schemes(rank, args, build_schemes(args, args.ranks), loopback_tx_bytes)
    if rank == 0:
        Path(out_path).write_text(json.dumps(dict(results=results, ranks=args.ranks)))
    dist.destroy_process_group()


def train_schemes(rank, args, schemes, wire_bytes):
    """Train a copy of the model with each of ``schemes`` (see :func:`build_schemes`) and
    without communication, in turns; per scheme, its step times, bytes and loss.
    ``wire_bytes()``: the bytes the network has carried so far (or None), read around
    each turn."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from sklearn.datasets import load_digits

    digits = load_digits()
    features = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    labels = torch.tensor(digits.target, dtype=torch.long)

    def build_model():
        torch.manual_seed(args.seed)
        widths = [64] + [args.hidden] * args.layers
        layers = []
        for a, b in zip(widths, widths[1:]):
            layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(widths[-1], 10))

    runs = [dict(label="compute only (no communication)", kind="none", model=build_model(),
                 take=lambda steps: 0)]
    runs[0]["module"] = runs[0]["model"]
    for label, kind, ddp_kwargs, register in schemes:
        model = build_model()
        ddp = torch.nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
        runs.append(dict(label=label, kind=kind, model=ddp, module=model, take=register(ddp)))
    for run in runs:
        run.update(opt=torch.optim.SGD(run["model"].parameters(), lr=args.lr, momentum=0.9),
                   batches=torch.Generator().manual_seed(1000 * args.seed + rank), times=[],
                   losses=[], wire=0, sent=0, steps=0, path=[])

    def steps(run, count, timed):
        for _ in range(count):
            batch = torch.randint(0, len(labels), (args.batch_size,), generator=run["batches"])
            stats = getattr(run["take"], "stats", None)
            before = stats.snapshot() if stats is not None else None
            start = time.perf_counter()
            run["opt"].zero_grad()
            loss = torch.nn.functional.cross_entropy(run["model"](features[batch]),
                                                     labels[batch])
            loss.backward()
            run["opt"].step()
            if timed:
                run["times"].append(time.perf_counter() - start)
                run["losses"].append(loss.item())
                if before is not None:  # this step's buckets together
                    done = stats.snapshot() - before
                    run["path"].append({key: 1e3 * getattr(done, f"{key}_seconds") for key
                                        in ("encode", "decode", "codec", "exchange")})

    barrier = torch.zeros(1)
    for run in runs:
        steps(run, args.warmup, timed=False)
        run["take"](args.warmup)
    per_round = max(1, -(-args.steps // args.rounds))
    for turn in range(args.rounds):
        # a new order each round, the same on every rank (as in e2e.py)
        for position in np.random.default_rng([args.seed, turn]).permutation(len(runs)):
            run = runs[position]
            dist.all_reduce(barrier)  # the ranks start each turn together
            tx = wire_bytes()
            steps(run, per_round, timed=True)
            dist.all_reduce(barrier)
            end = wire_bytes()
            run["wire"] = None if tx is None or end is None or run["wire"] is None \
                else run["wire"] + end - tx
            run["sent"] += run["take"](per_round)
            run["steps"] += per_round
    results = []
    for run in runs:
        params = sum(p.numel() for p in run["module"].parameters())
        times = run["times"]
        results.append(dict(
            scheme=run["label"], kind=run["kind"], params=params, steps=len(times),
            step_ms_median=1e3 * float(np.median(times)),
            step_ms_q1=1e3 * float(np.percentile(times, 25)),
            step_ms_q3=1e3 * float(np.percentile(times, 75)),
            bytes_sent=run["sent"] / run["steps"], dense_bytes=4 * params,
            wire_bytes_per_step=None if run["wire"] is None or run["kind"] == "none"
            else run["wire"] / run["steps"],
            final_loss=float(np.mean(run["losses"][-per_round:])),
            **{f"{key}_ms": float(np.median([step[key] for step in run["path"]]))
               for key in ("encode", "decode", "codec", "exchange") if run["path"]}))
    return results


def spawn_workers(args):
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(args, free_port(), args.worker_out), nprocs=args.ranks)


# -- the driver ------------------------------------------------------------------------

def run_rate(rate, args, net):
    prefix, measured = prepare_link(rate, net)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "worker.json"
        cmd = prefix + [sys.executable, "-m", "benchmarks.torch_e2e", "--worker",
                        "--worker-out", str(out),
                        "--steps", str(args.steps), "--rounds", str(args.rounds),
                        "--warmup", str(args.warmup), "--start-iter", str(args.start_iter),
                        "--hidden", str(args.hidden), "--layers", str(args.layers),
                        "--batch-size", str(args.batch_size), "--lr", str(args.lr),
                        "--seed", str(args.seed), "--ranks", str(args.ranks),
                        "--link-gbits", f"{measured:.2g}"]
        if args.schemes:
            cmd += ["--schemes", *args.schemes]
        subprocess.run(cmd, cwd=ROOT, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        data = json.loads(out.read_text())
    data.update(rate=rate if net is not None else "unshaped loopback", measured_gbit=measured,
                load=os.getloadavg()[0], cores=os.cpu_count())
    for r in data["results"]:
        print(f"  {r['scheme']}: {r['step_ms_median']:.1f} ms/step, "
              f"{r['bytes_sent'] / 1e6:.3f} MB sent per rank", flush=True)
    return data


def targets(run):
    by_label = {r["scheme"]: r for r in run["results"]}
    ours = by_label.get(DEEPREDUCE)
    dense = next((r for r in run["results"] if r["kind"] == "dense"), None)
    power1 = next((r for r in run["results"] if "rank 1" in r["scheme"]), None)
    if ours is None:
        return {}
    out = {}
    if dense:
        out["vs_dense"] = dense["step_ms_median"] / ours["step_ms_median"]
    if power1:
        out["vs_powersgd_rank1"] = power1["step_ms_median"] / ours["step_ms_median"]
    compute = next((r for r in run["results"] if r["kind"] == "none"), None)
    if compute is not None and ours.get("wire_bytes_per_step") and run.get("measured_gbit"):
        # the physical limit, as in e2e.py: computing the step, plus the wire time of its bytes
        out["wire_ms"] = ours["wire_bytes_per_step"] * 8e3 / (run["measured_gbit"] * 1e9)
        out["limit_ms"] = compute["step_ms_median"] + out["wire_ms"]
        out["vs_limit"] = ours["step_ms_median"] / out["limit_ms"]
    floor = by_label.get(NOTHING)
    if power1 and floor is not None and "wire_ms" in out:
        # what 2x PowerSGD rank 1 leaves a hook, over DDP's own cost, beside its wire time
        out["floor_ms"] = floor["step_ms_median"]
        out["hook_budget_ms"] = (power1["step_ms_median"] / 2 - out["floor_ms"]
                                 - out["wire_ms"])
    return out


def report(runs, args):
    params = runs[0]["results"][0]["params"]
    lines = ["# End to end with PyTorch DDP over a shaped network", "",
             f"{args.ranks} gloo ranks (spawned processes) on one machine "
             f"({platform.machine()}, {os.cpu_count()} cores shared with other jobs), one "
             "intra-op thread per rank, torch DDP. Model: MLP "
             f"64-{'-'.join([str(args.hidden)] * args.layers)}-10 on scikit-learn's digits, "
             f"{params:,} parameters ({4 * params / 1e6:.1f} MB of float32 gradients), batch "
             f"{args.batch_size} per rank, SGD with momentum. Every scheme trains its own copy "
             f"of the model on the same batches: {args.warmup} warm-up steps (deepreduce and "
             f"PowerSGD compress from step {args.start_iter}, and DDP rebuilds its buckets "
             f"after the first), then {args.steps} timed steps in {args.rounds} turns, the "
             "schemes alternating in an order drawn afresh each round. Step time: median on "
             "rank 0 (quartiles in the JSON file). MB sent: what one rank contributes to the "
             "collectives per step" + (
                 "" if getattr(args, "sent_counted", "bundles") == "wire" else
                 " (this run predates 0.2.0, whose counts include the transport's frame: "
                 "deepreduce's figures are its bundles alone, and the slots' padding and "
                 "lengths, about 12% more then, are only in the wire MB)") +
             ". Wire MB: everything that crossed the namespace's "
             "loopback per step, both ranks, TCP framing included. Loss: mean training loss "
             "over the last turn.", ""]
    for run in runs:
        lines += [f"## {run['rate']} (single TCP stream measured {run['measured_gbit']:.2f} "
                  f"Gbit/s; load average {run['load']:.1f})", ""]
        dense = next((r for r in run["results"] if r["kind"] == "dense"), None)
        lines += table(["scheme", "step ms (median)", "x faster than DDP allreduce", *COST_COLUMNS,
                        "loss after the timed steps"],
                       [[r["scheme"], f"{r['step_ms_median']:.1f}",
                         f"{dense['step_ms_median'] / r['step_ms_median']:.2f}" if dense else "",
                         *cost_cells(r), f"{r['final_loss']:.3f}"] for r in run["results"]])
        t = run["targets"] = targets(run)
        if t:
            lines += ["", f"`{DEEPREDUCE}` against the others, as step-time ratios: DDP "
                          f"allreduce / deepreduce = {t.get('vs_dense', float('nan')):.2f}, "
                          "PowerSGD rank 1 / deepreduce = "
                          f"{t.get('vs_powersgd_rank1', float('nan')):.2f}."]
            if run["rate"] == "1gbit":
                lines[-1] += (" Targets at 1 Gbit/s: at least 5x shorter than DDP allreduce: "
                              f"{'PASS' if t.get('vs_dense', 0) >= 5 else 'FAIL'}; at least 2x "
                              "shorter than PowerSGD rank 1: "
                              f"{'PASS' if t.get('vs_powersgd_rank1', 0) >= 2 else 'FAIL'}.")
            if "vs_limit" in t:
                lines[-1] += (f" Its physical limit, the compute-only step plus the wire time of "
                              f"its bytes at the measured rate: "
                              f"{t['limit_ms'] - t['wire_ms']:.1f} + {t['wire_ms']:.1f} = "
                              f"{t['limit_ms']:.1f} ms; deepreduce takes {t['vs_limit']:.2f}x "
                              "that.")
            if run["rate"] == "1gbit" and "hook_budget_ms" in t:
                ours = next(r for r in run["results"] if r["scheme"] == DEEPREDUCE)
                work = ours.get("encode_ms", 0) + ours.get("decode_ms", 0)
                lines[-1] += (f" DDP with a hook that sends nothing takes {t['floor_ms']:.1f} "
                              "ms a step: 2x shorter than PowerSGD rank 1 leaves any hook "
                              f"{t['hook_budget_ms']:.1f} ms of work a step beside its "
                              f"bytes' {t['wire_ms']:.1f} ms on the wire (none of it "
                              "overlapping the compute, as in the limit); deepreduce's "
                              f"encode + decode takes {work:.1f} ms.")
        lines.append("")
    lines += ["## Notes", "",
              "* PowerSGD runs with one bucket: with several, it aborted on gloo with a "
              "collective size mismatch on this torch build. Its bytes count the P and Q "
              "factors of every matrix it compresses and the tensors it sends dense.",
              f"* {NOTHING}: each rank steps on its own gradient, so its loss is not "
              "comparable; its step time is what DDP's buckets and hook calls cost here.",
              "* The raw Top-k pairs hook pays `torch.topk` over each bucket (a full "
              "selection); deepreduce's Top-k samples a threshold and scans once.",
              "* deepreduce's MB sent is its bundle (or, for sparse_allreduce and block, every "
              "frame it hands to both of their collectives); TorchTransport pads frames to "
              "the longest rank's, which the wire column includes.",
              "* deepreduce's times are this rank's per step, medians over the timed steps, "
              "summed over the buckets DDP hands the hook: *encode + decode* from the bucket to "
              "the payloads (error feedback, Top-k, codecs; during backward) and from the "
              "gathered payloads to the averaged gradients (on the transport's thread), *of "
              "which codecs* the part inside the index and value codecs (the reducing "
              "communicators code inside their collectives and show none), *exchange* from the "
              "end of a bucket's encoding to the start of its decoding, waiting for the other "
              "rank included; a bucket's exchange overlaps the backward pass of the next.", "",
              f"![step time per scheme]({Path(args.out).with_suffix('.png').name})", ""]
    return "\n".join(lines)


def plot(runs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 5), squeeze=False)
    for ax, run in zip(axes[0], runs):
        rows = run["results"]
        ax.barh([r["scheme"] for r in rows], [r["step_ms_median"] for r in rows],
                color=["tab:green" if r["kind"] == "deepreduce" else "tab:gray" for r in rows])
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_xlabel("median step time, ms (log)")
        ax.set_title(f"{run['rate']} ({run['measured_gbit']:.2f} Gbit/s measured)")
        if ax is not axes[0][0]:
            ax.set_yticklabels([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=["1gbit", "10gbit", "100mbit"],
                        choices=sorted(BURST))
    parser.add_argument("--no-netns", action="store_true",
                        help="unshaped loopback, no root needed")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per scheme")
    parser.add_argument("--rounds", type=int, default=4, help="turns the steps are taken in")
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--start-iter", type=int, default=4,
                        help="deepreduce's start_iter and PowerSGD's start_powerSGD_iter")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--schemes", nargs="*", default=None,
                        help="only the schemes whose label contains one of these words")
    parser.add_argument("--out", default=str(RESULTS / "torch_e2e.md"))
    parser.add_argument("--from-json", metavar="TORCH_E2E_JSON",
                        help="only re-render the report and plot of an earlier run's json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    # (what "MB sent" counts: records of runs before 0.2.0 have no such key)
    parser.add_argument("--sent-counted", default="wire", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--link-gbits", type=float, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        spawn_workers(args)
        return 0
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        args = argparse.Namespace(**{**saved["args"], "out": args.out})
        return write_results(saved["runs"], args, report, plot)
    runs = run_rates(args, run_rate, NAMESPACE, "torch_e2e")
    return 2 if runs is None else write_results(runs, args, report, plot)


if __name__ == "__main__":
    sys.exit(main())
