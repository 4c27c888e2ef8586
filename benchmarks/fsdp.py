"""FSDP2's HSDP across two hosts: bytes between the replicas, and residual memory per rank.

Two network namespaces play two nodes (``drfsdp0`` and ``drfsdp1``, joined by a veth
pair ``drf0`` / ``drf1`` with 10.79.0.1/24 and 10.79.0.2/24, addresses that exist only
inside them; :class:`benchmarks.hierarchical.TwoHosts`). Four gloo ranks, two in each
namespace, numbered as torchrun numbers them, form a 2 x 2 device mesh
``("replicate", "shard")``: each node's two ranks are one replica, its shard group
talks over the node's own loopback, and only the replicate dimension (and the
model-wide flags) crosses the veth. Per model (the 8.5M-parameter MLP of the e2e
benchmarks on scikit-learn's digits, batch 32 per rank; the 3.3M-parameter byte
transformer of :mod:`benchmarks.outer_model`, batch 8 x 64 bytes per rank) and per
scheme, in one run:

- ``FSDP2 HSDP fp32``: ``fully_shard(..., mesh=mesh)``, FSDP2's own all-reduce of each
  gradient shard across the replicas, in float32;
- ``FSDP2 HSDP bf16 reduction``: the same with ``MixedPrecisionPolicy(reduce_dtype=
  torch.bfloat16)``;
- ``deepreduce Top-1% + auto + fp16``: ``fully_shard(..., mesh=mesh["shard"])`` and
  :func:`deepreduce.torch.fsdp.compress_replicas` over ``mesh["replicate"]``.

Every transformer block (or MLP layer) is an FSDP unit, and the root. After warm-up
steps (deepreduce averages plainly for ``--start-iter`` of them), ``--steps`` steps in
each of ``--rounds`` rounds; rank 0 reads the veth's interface counters
(``/sys/class/net/drf0/statistics``, transmitted plus received) after a barrier
before and after each round: bytes on the link from the kernel, TCP/IP framing, gloo's
messages and one barrier per round included. The veth is not shaped: bytes do not
depend on the rate (the step times printed beside them are CPU-bound, not link-bound,
and are no claim). After the deepreduce run each rank reports its residual bytes
(error feedback: one per parameter shard of ``min_size`` elements or more) against
its shard's and the model's bytes.

As root, from the repository root::

    python -m benchmarks.fsdp                                  # both models
    python -m benchmarks.fsdp --models mlp --steps 3 --rounds 2   # quicker

Writes ``benchmarks/results/fsdp.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, table, write_report
from benchmarks.hierarchical import TwoHosts, stop_ranks, veth_bytes, wait_for_ranks

NAMESPACES = ("drfsdp0", "drfsdp1")
VETH = ("drf0", "drf1")
ADDRESSES = ("10.79.0.1", "10.79.0.2")
LOCAL, WORLD = 2, 4
SCHEMES = ("FSDP2 HSDP fp32", "FSDP2 HSDP bf16 reduction", "deepreduce Top-1% + auto + fp16")
NATIVE_FP32, OURS = SCHEMES[0], SCHEMES[2]
MODELS = ("mlp", "transformer")


# -- the ranks --------------------------------------------------------------------------

def build(model_name: str, mesh, scheme: str, start_iter: int):
    """The model of ``model_name`` sharded for ``scheme``; its batch function; the state
    of deepreduce's replica exchange (None for FSDP2's own)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import deepreduce as dr
    from deepreduce.torch.fsdp import compress_replicas

    if model_name == "mlp":
        net, units, batch = _mlp()
    else:
        net, units, batch = _transformer()
    native = scheme != OURS
    options = {"mesh": mesh if native else mesh["shard"]}
    if scheme == SCHEMES[1]:
        options["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    for unit in units:
        fully_shard(unit, **options)
    fully_shard(net, **options)
    state = None if native else compress_replicas(
        net, mesh["replicate"], sparsifier=dr.TopK(0.01), index="auto", value="fp16",
        start_iter=start_iter)
    return net, batch, state


def _mlp():
    """torch_e2e's MLP 64-2048-2048-2048-10 and digits batches of 32 per rank."""
    import torch

    from benchmarks.gradients import load_digits_data

    images, _, labels = load_digits_data()
    x_all, y_all = torch.from_numpy(images.reshape(len(images), -1)), torch.from_numpy(labels)
    torch.manual_seed(0)
    widths = [64, 2048, 2048, 2048, 10]
    layers = [torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    net = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.ReLU())][:-1])

    def batch(rank, step):
        g = torch.Generator().manual_seed(1000 * step + rank)
        rows = torch.randint(0, len(x_all), (32,), generator=g)
        return lambda model: torch.nn.functional.cross_entropy(model(x_all[rows]), y_all[rows])
    return net, layers, batch


def _transformer():
    """outer_model's byte transformer (3.3M parameters) and 8 x 64-byte batches per rank."""
    from benchmarks.outer_model import build_model, next_byte_loss, text_splits, training_batch

    train, _ = text_splits()
    net = build_model(seed=0)

    def batch(rank, step):
        x, y = training_batch(train, step, rank)
        return lambda model: next_byte_loss(model, x, y)
    return net, list(net.blocks), batch


def worker(args) -> None:
    """One rank: every model and scheme in turn; rank 0 writes what was measured."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (WORLD // LOCAL, LOCAL),
                            mesh_dim_names=("replicate", "shard"))
    results = []
    for model_name in args.models:
        for scheme in SCHEMES:
            results.append(measure(rank, mesh, model_name, scheme, args))
            if rank == 0:
                print(f"{model_name}, {scheme}: {results[-1]['link_bytes_median']:,.0f} bytes "
                      "on the veth per step", flush=True)
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(results))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # before the interpreter finalises (pytorch#179291), as the torch tests


def measure(rank, mesh, model_name, scheme, args) -> dict:
    """Warm-up, then ``args.rounds`` rounds of ``args.steps`` steps of one scheme."""
    import torch
    import torch.distributed as dist

    net, batch, state = build(model_name, mesh, scheme, args.start_iter)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    step = 0

    def train(steps):
        nonlocal step
        for _ in range(steps):
            opt.zero_grad()
            loss = batch(rank, step)(net)
            loss.backward()
            opt.step()
            step += 1
        return loss.item()

    train(args.start_iter + 1)  # deepreduce's plain steps and its first compressed one
    per_step, seconds, handed = [], [], []
    for _ in range(args.rounds):
        handed_before = state.bytes_handed if state is not None else 0
        dist.barrier()
        start_bytes, start = veth_bytes(), time.perf_counter()
        loss = train(args.steps)
        dist.barrier()
        end_bytes = veth_bytes()
        seconds.append((time.perf_counter() - start) / args.steps)
        if rank == 0 and start_bytes is not None:
            per_step.append((end_bytes - start_bytes) / args.steps)
        if state is not None:
            handed.append((state.bytes_handed - handed_before) / args.steps)
    shard = sum(p.to_local().numel() * p.to_local().element_size() for p in net.parameters())
    model = sum(p.numel() * 4 for p in net.parameters())
    memory = state.exchange.selector.memory if state is not None else None
    residual = 0 if memory is None else sum(memory.residual(n).nbytes for n in memory.names())
    # what each rank hands to the replicate group per step: FSDP2 its padded flat shards
    dense = 0 if state is not None else _padded_shard_bytes(
        net, 2 if scheme == SCHEMES[1] else 4)
    ranks = [None] * WORLD
    dist.all_gather_object(ranks, {"shard_bytes": shard, "residual_bytes": residual,
                                   "handed_per_step": statistics.median(handed) if handed
                                   else dense})
    return {"model": model_name, "scheme": scheme, "params": model // 4,
            "model_bytes": model, "final_loss": loss, "ranks": ranks,
            "link_bytes_per_step": per_step,
            "link_bytes_median": statistics.median(per_step) if per_step else 0,
            "step_seconds_median": statistics.median(seconds)}


def _padded_shard_bytes(net, itemsize: int) -> int:
    """Bytes of the flat gradient shards FSDP2 hands to its all-reduce in a step: each
    parameter's rows padded to a multiple of the shards."""
    return sum(-(-p.shape[0] // LOCAL) * p[0].numel() * itemsize for p in net.parameters())


def run_ranks(args, out: Path, port: int) -> None:
    """The four ranks, two per namespace; stopped if one fails or time runs out."""
    procs = []
    try:
        for rank in range(WORLD):
            host = rank // LOCAL
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank % LOCAL),
                       WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(LOCAL),
                       MASTER_ADDR=ADDRESSES[0], MASTER_PORT=str(port),
                       GLOO_SOCKET_IFNAME=VETH[host], DR_VETH=VETH[host], OMP_NUM_THREADS="1")
            cmd = ["ip", "netns", "exec", NAMESPACES[host], sys.executable, "-m",
                   "benchmarks.fsdp", "--worker", "--worker-out", str(out),
                   "--steps", str(args.steps), "--rounds", str(args.rounds),
                   "--start-iter", str(args.start_iter), "--models", *args.models]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True))
        wait_for_ranks(procs, args.timeout)
    finally:
        stop_ranks(procs)


# -- the report ---------------------------------------------------------------------------

def report(results, args, command) -> str:
    lines = ["# FSDP2's HSDP across two hosts: bytes between the replicas, residual memory",
             "",
             f"Two network namespaces joined by a veth pair play two nodes; {WORLD} gloo ranks, "
             f"{LOCAL} in each, form a 2 x 2 mesh (replicate, shard): each node one replica, "
             "its shard group on the node's loopback, so only the replicate dimension and the "
             "model-wide flags cross the veth. Bytes on the link: the veth's interface "
             "counters (transmitted + received, both directions: TCP/IP framing, gloo's "
             "messages and one barrier per round included), per step, median of "
             f"{args.rounds} rounds of {args.steps} steps after the warm-up, with the "
             "rounds' range. Handed: what each rank hands to the replicate group's "
             "collectives per step (FSDP2: its padded gradient shards, in the reduce "
             "dtype; deepreduce: `state.bytes_handed`, frames with their padding and length "
             "headers). "
             f"deepreduce: Top-1%, `auto` indices, fp16 values, plain for {args.start_iter} "
             "steps first. The veth is not shaped: these are byte counts, not timings. Loss: "
             f"rank 0's after the last of {args.start_iter + 1 + args.rounds * args.steps} "
             "steps, a check that each scheme trains, not a comparison of quality.", "",
             "Made with (as root, from the repository root):", "", f"    {command}", ""]
    for model in dict.fromkeys(r["model"] for r in results):
        runs = {r["scheme"]: r for r in results if r["model"] == model}
        fp32 = runs[NATIVE_FP32]["link_bytes_median"]
        first = next(iter(runs.values()))
        lines += [f"## {model} ({first['params']:,} parameters)", ""]
        rows = []
        for scheme, r in runs.items():
            spread = r["link_bytes_per_step"]
            handed = [rank["handed_per_step"] for rank in r["ranks"]]
            rows.append([scheme, f"{r['link_bytes_median']:,.0f}",
                         f"{min(spread):,.0f}-{max(spread):,.0f}",
                         f"{fp32 / r['link_bytes_median']:.1f}x",
                         f"{min(handed):,.0f}-{max(handed):,.0f}", f"{r['final_loss']:.3f}"])
        lines += table(["scheme", "bytes on the veth per step (median)", "range",
                        "fewer than fp32", "handed per rank per step", "loss"], rows)
        ours = runs[OURS]
        ratio = fp32 / ours["link_bytes_median"]
        lines += ["", f"Bytes on the veth, deepreduce against FSDP2's fp32 HSDP: {ratio:.1f}x "
                  f"fewer (target at least 50x: {'PASS' if ratio >= 50 else 'FAIL'}).", "",
                  "Memory per rank (deepreduce's error feedback):", ""]
        rows = [[rank, f"{ours['model_bytes']:,}", f"{r['shard_bytes']:,}",
                 f"{r['residual_bytes']:,}", f"{r['residual_bytes'] / r['shard_bytes']:.2f}",
                 f"{r['residual_bytes'] / ours['model_bytes']:.2f}"]
                for rank, r in enumerate(ours["ranks"])]
        lines += table(["rank", "model bytes (fp32)", "shard bytes", "residual bytes",
                        "residual / shard", "residual / model"], rows)
        lines += [""]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--steps", type=int, default=4, help="steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--start-iter", type=int, default=2,
                        help="deepreduce's plain steps (warm-up: these and one more)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--port", type=int, default=29750)
    parser.add_argument("--out", default=str(RESULTS / "fsdp.md"))
    parser.add_argument("--from-json", action="store_true",
                        help="write the report again from the .json beside --out, running "
                             "nothing")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.from_json:
        saved = json.loads(Path(args.out).with_suffix(".json").read_text())
        text = report(saved["results"], argparse.Namespace(**saved["args"]), saved["command"])
        write_report(args.out, text, saved)
        print(text)
        return 0
    command = " ".join(["python -m benchmarks.fsdp", *(sys.argv[1:] if argv is None else argv)])
    with TwoHosts(NAMESPACES, VETH, ADDRESSES) as _, tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "worker.json"
        run_ranks(args, out, args.port)
        results = json.loads(out.read_text())
    record = {"results": results, "args": vars(args), "command": command,
              "load": os.getloadavg()[0], "cores": os.cpu_count()}
    text = report(results, args, command)
    write_report(args.out, text, record)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
