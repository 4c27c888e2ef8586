"""Quality of the outer-step schemes: DDP, dense DiLoCo, compressed DiLoCo and SparseLoCo.

    python -m benchmarks.outer_quality            # writes benchmarks/results/outer_quality.md

Two gloo ranks on this machine train the byte-level transformer of
:mod:`benchmarks.outer_model` on the standard library's sources, four times, from the
same initial weights on the same tokens (rank ``r``'s batch of inner step ``s`` is the
same in every scheme), with the same inner AdamW:

* ``ddp``: DDP's allreduce of the float32 gradients at every step;
* ``diloco``: dense DiLoCo, :class:`deepreduce.torch.outer.OuterOptimizer` with
  ``mode="diloco"``: every H inner steps the float32 pseudo-gradients (``raw``), outer
  SGD with Nesterov momentum (lr 0.7, momentum 0.9);
* ``diloco_deepreduce``: the same outer step on pseudo-gradients compressed with
  SparseLoCo's codecs (chunk-wise Top-k, ``chunked`` indices, 2-bit ``statq``) with error
  feedback (beta 1.0), keeping twice SparseLoCo's share by default (``--diloco-k``
  128 of 4096: Nesterov momentum on top of the compressed average amplifies what the
  selection drops);
* ``sparseloco``: ``mode="sparseloco"``: error feedback with decay 0.95 in place of the
  momentum, chunk-wise Top-64 of every 64 x 64 tile (1.56%), 2-bit ``statq``, outer
  lr 1.0.

The report gives each scheme's validation loss (nats per byte, on held-out text, after
the last step), the bytes each rank sends per outer step and per inner step (DDP: the
4 bytes per parameter each rank contributes to every allreduce), the ratio against DDP,
and the validation loss after every outer step as a plot. :func:`run` is what
``benchmarks.outer`` calls; :func:`main` writes the results file.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import deepreduce as dr
from deepreduce.torch.outer import OuterOptimizer

from benchmarks.common import RESULTS, free_port, plot_loss_curves, table, write_report
from benchmarks.outer_model import (build_model, next_byte_loss, parameter_count, text_splits,
                                    training_batch, validation_loss)

SCHEMES = ("ddp", "diloco", "diloco_deepreduce", "sparseloco")

#: SparseLoCo with Streaming DiLoCo's overlap and fragments (issue 49): each is compared
#: with the blocking ``sparseloco`` run (``--schemes sparseloco sparseloco_overlap1 ...``).
STREAMING = {"sparseloco_overlap1": {"overlap": 1, "merge": "carry"},
             "sparseloco_overlap5": {"overlap": 5, "merge": "carry"},
             "sparseloco_overlap1_mix": {"overlap": 1, "merge": "mix"},
             "sparseloco_overlap5_mix": {"overlap": 5, "merge": "mix"},
             "sparseloco_fragments2": {"fragments": 2},
             "sparseloco_fragments4": {"fragments": 4},
             "sparseloco_fragments4_overlap5": {"fragments": 4, "overlap": 5, "merge": "mix"},
             "sparseloco_fragments4_overlap5_carry": {"fragments": 4, "overlap": 5,
                                                      "merge": "carry"}}

#: What the report calls each scheme.
TITLES = {"ddp": "DDP (AdamW, allreduce every step)", "diloco": "dense DiLoCo (float32)",
          "diloco_deepreduce": "DiLoCo with deepreduce (chunk Top-k, 2-bit, EF)",
          "sparseloco": "SparseLoCo with deepreduce",
          **{name: "SparseLoCo, " + ", ".join(f"{k} {v}" for k, v in extra.items())
             for name, extra in STREAMING.items()}}

#: The targets of issue 43.
TARGET_RATIO, TARGET_GAP = 5000, 0.01


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="inner steps per scheme")
    parser.add_argument("--sync-every", type=int, default=30, help="H")
    parser.add_argument("--batch-size", type=int, default=4, help="windows per rank and step")
    parser.add_argument("--sequence", type=int, default=64, help="bytes per window")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3, help="the inner AdamW's")
    parser.add_argument("--warmup", type=int, default=30, help="inner steps of linear warm-up")
    parser.add_argument("--k", type=int, default=64, help="SparseLoCo's kept per chunk of 4096")
    parser.add_argument("--diloco-k", type=int, default=128,
                        help="compressed DiLoCo's kept per chunk of 4096")
    parser.add_argument("--sparseloco-lr", type=float, default=None,
                        help="SparseLoCo's outer lr alpha (default: the mode's, 1.0)")
    parser.add_argument("--sparseloco-beta", type=float, default=None,
                        help="SparseLoCo's error feedback decay (default: the mode's, 0.95)")
    parser.add_argument("--curve-windows", type=int, default=64,
                        help="validation windows after each outer step (the plot)")
    parser.add_argument("--windows", type=int, default=512,
                        help="validation windows of the final loss")
    parser.add_argument("--text-bytes", type=int, default=2_000_000)
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES),
                        choices=SCHEMES + tuple(STREAMING))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "outer_quality.md"))
    parser.add_argument("--across-seeds", nargs="+", metavar="RECORD_JSON",
                        help="train nothing: tabulate the streaming schemes' gaps to "
                             "blocking SparseLoCo over the seeds of these records")
    return parser.parse_args(argv)


def outer_settings(scheme: str, args) -> dict:
    """The OuterOptimizer settings of an outer-step scheme."""
    def compressed(k):
        return {"sparsifier": f"chunktopk:k={k},chunk=4096", "index": "chunked",
                "value": "statq:bits=2,sigmas=6", "min_size": 0}
    if scheme == "diloco":
        return {"mode": "diloco", "sparsifier": None, "value": "raw"}
    if scheme == "diloco_deepreduce":
        return {"mode": "diloco", **compressed(args.diloco_k)}
    # (error_feedback=None turns error feedback off: the mode's decay unless one is given)
    decay = {} if args.sparseloco_beta is None else {"error_feedback": args.sparseloco_beta}
    return {"mode": "sparseloco", **compressed(args.k), "lr": args.sparseloco_lr, **decay,
            **STREAMING.get(scheme, {})}


def train_scheme(scheme: str, rank: int, args, train, validation) -> dict:
    """One scheme on this rank: what rank 0 measured (the curve, bytes, times)."""
    sizes = {"width": args.width, "depth": args.depth, "heads": args.heads,
             "sequence": args.sequence}
    model = build_model(seed=args.seed, **sizes)
    net = DDP(model) if scheme == "ddp" else model
    inner = torch.optim.AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.95),
                              weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(
        inner, lambda step: min(1.0, (step + 1) / max(1, args.warmup)))
    # a group of its own per scheme, as in a run of one scheme: the transport's slots
    # follow the bundles it carried lately, which another scheme's would mislead
    outer = None if scheme == "ddp" else OuterOptimizer(
        model.named_parameters(), sync_every=args.sync_every,
        process_group=dist.new_group(list(range(args.ranks))), **outer_settings(scheme, args))
    H = args.sync_every
    curve = [(0, validation_loss(model, validation, args.sequence, args.curve_windows))] \
        if rank == 0 else []
    losses, outer_seconds = [], []
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = training_batch(train, step, rank, args.seed, args.batch_size, args.sequence)
        loss = next_byte_loss(net, x, y)
        loss.backward()
        inner.step()
        inner.zero_grad()
        warmup.step()
        losses.append(loss.item())
        if outer is not None:  # (the loop's wait: every call, the merges of overlap too)
            began = time.perf_counter()
            outer.step()
            outer_seconds.append(time.perf_counter() - began)
        if (step + 1) % H == 0 and rank == 0:
            curve.append((step + 1, validation_loss(model, validation, args.sequence,
                                                    args.curve_windows)))
    if outer is not None and outer.in_flight:
        outer.drain()  # the last exchange, merged as the blocking run's step is taken
    elif outer is not None and outer.inner_steps % H:
        outer.sync()  # the steps since the last outer step
    seconds = time.perf_counter() - start
    found = {"seconds": seconds, "curve": curve, "params": parameter_count(model),
             "train_loss": float(np.mean(losses[-H:]))}
    if rank == 0:
        found["val_loss"] = validation_loss(model, validation, args.sequence, args.windows)
        if outer is not None:  # the model the workers share (each fragment's last sync)
            shared = build_model(seed=args.seed, **sizes)
            with torch.no_grad():
                for name, p in shared.named_parameters():
                    p.copy_(outer.synced_parameters()[name])
            found["val_loss_synced"] = validation_loss(shared, validation, args.sequence,
                                                       args.windows)
    if outer is None:
        found["bytes_per_inner_step"] = dense = 4 * parameter_count(model)
        found["bytes_per_outer_step"] = dense * H
    else:
        total = outer.stats.total
        # bytes_sent: what the transport handed the outer group (slots, lengths, flags);
        # bundle_bytes: the bundles' own
        found.update(bytes_per_outer_step=total.bytes_sent / total.steps,
                     bundle_per_outer_step=total.bundle_bytes / total.steps,
                     bytes_per_inner_step=total.bytes_sent / args.steps,
                     dense_per_outer_step=total.dense_bytes / total.steps,
                     outer_steps=outer.outer_steps,
                     outer_step_seconds=float(np.sum(outer_seconds)) / outer.outer_steps,
                     settings=repr(outer))
    return found


def worker(rank, args, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    train, validation = text_splits(args.text_bytes)
    for scheme in args.schemes:
        found = train_scheme(scheme, rank, args, train, validation)
        if rank == 0:
            print(f"{scheme}: validation loss {found['val_loss']:.4f}, "
                  f"{found['bytes_per_inner_step']:,.0f} bytes per inner step, "
                  f"{found['seconds']:.0f} s", flush=True)
            results[scheme] = found
        dist.barrier()
    if rank == 0:
        results["text_bytes"] = train.numel() + validation.numel()
        results["validation_bytes"] = validation.numel()
    dist.destroy_process_group()


def kept_per_outer_step(args) -> int:
    """Elements SparseLoCo's selection keeps of the model's parameters per outer step."""
    model = build_model(seed=args.seed, width=args.width, depth=args.depth, heads=args.heads,
                        sequence=args.sequence)
    select = dr.ChunkTopK(k=args.k, chunk=4096)
    return sum(select(np.zeros(tuple(p.shape), np.float32)).nnz for p in model.parameters())


def plot(results, schemes, path) -> bool:
    """The validation curves as a PNG at ``path``; False when matplotlib is missing."""
    curves = {TITLES[s]: results[s]["curve"] for s in schemes}
    low = min(loss for curve in curves.values() for _, loss in curve)
    high = min(4.0, max(loss for curve in curves.values() for _, loss in curve[1:]))
    return plot_loss_curves(curves, path, "inner steps", (low - 0.1, high + 0.1),
                            plain=(TITLES["ddp"],))


def _synced(found) -> float:
    """The validation loss of the synced copy (rank 0's model in records without it)."""
    return found.get("val_loss_synced", found["val_loss"])


def report(args, results, load, plotted, image) -> tuple[str, dict]:
    """``(markdown section, record)`` of the measured ``results``."""
    schemes = [s for s in SCHEMES + tuple(STREAMING) if s in results]
    params = results[schemes[0]]["params"]
    ddp = 4 * params
    reference = results.get("diloco", {}).get("val_loss")
    blocking = results.get("sparseloco", {}).get("val_loss")
    rows = []
    for scheme in schemes:
        found = results[scheme]
        gap = "" if reference is None else f"{found['val_loss'] / reference - 1:+.2%}"
        versus = "" if blocking is None or scheme not in STREAMING else \
            f"{found['val_loss'] / blocking - 1:+.2%}"
        if "val_loss_synced" in found and scheme in STREAMING and blocking is not None:
            versus += f" (synced copy {_synced(found) / blocking - 1:+.2%})"
        outer_ms = (f"{1e3 * found['outer_step_seconds']:.0f}" if "outer_step_seconds" in found
                    else "")
        bundle = found.get("bundle_per_outer_step", found["bytes_per_outer_step"])
        rows.append(f"| {TITLES[scheme]} | {found['val_loss']:.4f} | {gap} | {versus} | "
                    f"{found['bytes_per_outer_step']:,.0f} | {bundle:,.0f} | "
                    f"{found['bytes_per_outer_step'] / bundle - 1:.2%} | "
                    f"{found['bytes_per_inner_step']:,.0f} | "
                    f"{ddp / found['bytes_per_inner_step']:,.0f}x | {outer_ms} | "
                    f"{found['seconds']:.0f} |")
    record = {"args": vars(args), "params": params, "ddp_bytes_per_inner_step": ddp,
              "load": load, "schemes": {s: results[s] for s in schemes}}
    met = []
    if "sparseloco" in results:
        sparse = results["sparseloco"]
        ratio = ddp / sparse["bytes_per_inner_step"]
        kept = kept_per_outer_step(args)
        bits = 8 * sparse["bytes_per_outer_step"] / kept
        bundle_bits = 8 * sparse["bundle_per_outer_step"] / kept
        record.update(sparseloco_ratio=ratio, kept_per_outer_step=kept,
                      bits_per_kept_element=bits, bundle_bits_per_kept_element=bundle_bits)
        met.append((f"SparseLoCo at least {TARGET_RATIO:,}x fewer bytes per inner step "
                    f"than DDP ({ratio:,.0f}x)", ratio >= TARGET_RATIO))
        if reference is not None:
            gap = sparse["val_loss"] / reference - 1
            record["sparseloco_gap"] = gap
            met.append((f"SparseLoCo's validation loss within {TARGET_GAP:.0%} of dense "
                        f"DiLoCo's ({gap:+.2%})", gap <= TARGET_GAP))
    for scheme in schemes:
        if scheme in STREAMING and blocking is not None:
            # the synced copy: the model the workers share (blocking's is its parameters)
            gap = _synced(results[scheme]) / blocking - 1
            met.append((f"{TITLES[scheme]} at most {TARGET_GAP:.0%} above blocking "
                        f"SparseLoCo's validation loss, synced copy ({gap:+.2%})",
                        gap <= TARGET_GAP))
    record["targets"] = {what: ok for what, ok in met}
    tokens = args.ranks * args.batch_size * args.sequence
    lines = [
        "## Quality: DDP, DiLoCo and SparseLoCo on a byte-level transformer", "",
        "Produced by `python -m benchmarks.outer_quality`: torch "
        f"{torch.__version__}, Python {platform.python_version()}, {args.ranks} gloo ranks "
        f"on one machine ({os.cpu_count()} cores, shared with other work: load average "
        f"{load[0]:.1f} at the start, {load[1]:.1f} at the end), one intra-op thread per "
        "rank.", "",
        f"Model: `benchmarks.outer_model.ByteTransformer(width={args.width}, depth="
        f"{args.depth}, heads={args.heads}, sequence={args.sequence})`, {params:,} "
        "parameters (every 2-D weight's sides multiples of 64). Task: the next byte of the "
        f"standard library's `.py` files ({results['text_bytes']:,} bytes, the last "
        f"{results['validation_bytes']:,} held out). Each scheme: {args.steps} inner steps "
        f"of AdamW (lr {args.lr:g}, betas 0.9/0.95, {args.warmup} steps of warm-up), "
        f"{args.batch_size} windows of {args.sequence} bytes per rank and step ({tokens:,} "
        f"bytes a step over the ranks, {tokens * args.steps:,} in all), the same initial "
        f"weights and the same batches in every scheme; outer steps every H = "
        f"{args.sync_every} inner steps. SparseLoCo keeps {args.k} of every 64 x 64 tile "
        f"({args.k / 4096:.2%}), compressed DiLoCo {args.diloco_k} "
        f"({args.diloco_k / 4096:.2%}). Validation loss: nats per byte over {args.windows} windows "
        f"spread over the held-out text, after the last step, of rank 0's model (the plot: "
        f"{args.curve_windows} windows after every outer step); against blocking SparseLoCo "
        "also of the synced copy, the model the workers share (with fragments, each "
        "fragment as of its last sync: rank 0's model holds up to H - H/p inner steps of "
        "its own in all but the last fragment; with overlap and `mix`, the last merge "
        "leaves it halfway between its own and the shared model). The targets take the "
        "synced copy.", "",
        "Bytes are what each rank hands to the process group: DDP's 4 bytes per parameter "
        "at every inner step (what each rank contributes to the allreduce, and what a ring "
        "allreduce sends per rank with 2 ranks); for the outer steps, `stats.bytes_sent`: "
        "each outer step's bundle in the transport's frame (its length, the slot's padding, "
        "the signature) and the all-finite flag, per inner step over the inner steps; the "
        "bundle's own bytes (`stats.bundle_bytes`) beside them, and what the frame adds. "
        "With fragments an outer step syncs one fragment. Outer step (ms): the loop's wait "
        "in `outer.step()` per outer step (with overlap, the start and the merge), a mean "
        "that includes the first outer step's agreement and group creation, on two "
        "ranks sharing this machine's loaded cores (`benchmarks.outer`'s loop part "
        "times the loop between two hosts).", "",
        "| scheme | validation loss | vs dense DiLoCo | vs blocking SparseLoCo | "
        "bytes per outer step | bundle bytes | framing | bytes per inner step | "
        "fewer than DDP | outer step (ms) | wall (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *rows, ""]
    if "sparseloco" in results:
        lines += [f"SparseLoCo sends {record['kept_per_outer_step']:,} kept elements per outer "
                  f"step at {record['bits_per_kept_element']:.2f} bits each on the wire "
                  f"({record['bundle_bits_per_kept_element']:.2f} in the bundle, headers "
                  "included).", ""]
    if met:
        lines += ["Targets: " + "; ".join(f"{what}: {'met' if ok else 'NOT met'}"
                                          for what, ok in met) + ".", ""]
    if plotted:
        lines += [f"![validation loss after every outer step]({image})", ""]
    else:
        lines += ["(No plot: matplotlib is not installed.)", ""]
    return "\n".join(lines), record


def run(args=None) -> tuple[str, dict]:
    """Train every scheme of ``args`` (:func:`parse_args`' defaults when None) and return
    ``(markdown section, record)``; the plot goes beside ``args.out``."""
    args = parse_args([]) if args is None else args
    load_start = os.getloadavg()[0]
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(worker, args=(args, free_port(), shared), nprocs=args.ranks)
        results = dict(shared)
    load = (load_start, os.getloadavg()[0])
    image = os.path.splitext(os.path.basename(args.out))[0] + ".png"
    plotted = plot(results, [s for s in SCHEMES + tuple(STREAMING) if s in results],
                   os.path.join(os.path.dirname(os.path.abspath(args.out)), image))
    return report(args, results, load, plotted, image)


def write(out, section: str, record: dict) -> str:
    """Write :func:`run`'s section and record to ``out`` (and its json); the text."""
    text = "# Outer-step training: quality against DDP and dense DiLoCo\n\n" + section
    write_report(out, text, record)
    return text


def across_seeds(paths) -> tuple[str, dict]:
    """``(markdown, record)``: the streaming schemes against blocking SparseLoCo seed by
    seed, from the records (.json) of runs with other ``--seed``s (a seed's schemes may
    come from several records), and the mean and range of each gap over the seeds."""
    import json

    by_seed = {}
    for path in paths:
        record = json.loads(Path(path).read_text())
        by_seed.setdefault(record["args"]["seed"], {}).update(
            {s: _synced(found) for s, found in record["schemes"].items()})
    seeds = sorted(by_seed)
    schemes = [s for s in STREAMING if all(s in by_seed[seed] for seed in seeds)]
    missing = [seed for seed in seeds if "sparseloco" not in by_seed[seed]]
    if missing:
        raise ValueError(f"no blocking sparseloco run for seed(s) {missing}")
    gaps = {s: [by_seed[seed][s] / by_seed[seed]["sparseloco"] - 1 for seed in seeds]
            for s in schemes}
    header = ["scheme", *[f"seed {seed}" for seed in seeds], "mean gap", "range",
              f"mean within {TARGET_GAP:.0%}"]
    rows = [["SparseLoCo, blocking", *[f"{by_seed[seed]['sparseloco']:.4f}" for seed in seeds],
             "", "", ""]]
    for s in schemes:
        mean = sum(gaps[s]) / len(seeds)
        rows.append([TITLES[s], *[f"{by_seed[seed][s]:.4f} ({gap:+.2%})"
                                  for seed, gap in zip(seeds, gaps[s])],
                     f"{mean:+.2%}", f"{min(gaps[s]):+.2%} to {max(gaps[s]):+.2%}",
                     "met" if mean <= TARGET_GAP else "NOT met"])
    lines = ["## Overlap and fragments over several seeds", "",
             "Validation loss of the synced copy (the model the workers share) after 600 "
             "inner steps (as above: the 3.3M-parameter byte transformer, 2 gloo ranks, "
             "H = 30, SparseLoCo's settings), each seed its own "
             "initial weights and batches, the same in every scheme of that seed; in "
             "brackets the gap to that seed's blocking run.", "",
             "Made with `python -m benchmarks.outer_quality --schemes sparseloco ... --seed S` "
             "per seed, then `python -m benchmarks.outer_quality --across-seeds "
             "RECORD.json ...`.", "", *table(header, rows), ""]
    return "\n".join(lines), {"seeds": seeds, "val_loss": by_seed, "gaps": gaps}


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if args.across_seeds:
        text, record = across_seeds(args.across_seeds)
        write_report(args.out, "# Outer-step training: overlap and fragments over seeds\n\n"
                     + text, record)
        print(text)
        return 0
    section, record = run(args)
    print(write(args.out, section, record))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
