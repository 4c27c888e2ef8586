"""The exchange's CPU work per step on the parameter shapes of real models, no network.

``benchmarks/e2e.py`` trains a model of 8 tensors; most models have hundreds, and
every tensor costs the exchange a few calls whatever its size. Here P (``--ranks``, 2 and
4) :class:`~deepreduce.exchange.GradientExchange` objects play the ranks in one process
on each model's parameter shapes: every step each rank encodes its own Gaussian
gradients (Top-k 1% with error feedback, ``auto:link_gbits=1.0`` indices, fp16
values; tensors under 1,024 values go losslessly), and rank 0 decodes and sums all
bundles, as the allgather communicator does (decoding the P - 1 others' payloads: the
part of a step that grows with the ranks). Timed: rank 0's encode and decode, and
of them the part inside the index and value codecs; the rest (error feedback, Top-k,
container, sums) is set against its memory-traffic floor, 16 bytes per parameter
(gradient and residual read, residual and sum written once) at the copy bandwidth
measured in the same run. The other ranks' encodes between rank 0's steps leave the
caches as a real step would: cold.

Then the fixed cost of a tensor: a bundle of 200 tensors of 256 values (sent
losslessly) and ones of 200 tensors of 4,096 and of 16,384 values (Top-k 1%), per
tensor.

Writes ``benchmarks/results/model_steps.md`` and ``.json``::

    python -m benchmarks.model_steps
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time

import numpy as np

import deepreduce as dr
from deepreduce.exchange.gathering import SHARED_BELOW
from deepreduce.exchange import GradientExchange

from benchmarks.common import RESULTS, copy_bandwidth, mlp_shapes, table, write_report

FLOOR_BYTES_PER_PARAMETER = 16


def resnet50_shapes():
    """torchvision's ResNet-50: convolutions, batch norms (weight and bias), the classifier."""
    shapes, inplanes = [(64, 3, 7, 7), (64,), (64,)], 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,),
                       (planes, planes, 3, 3), (planes,), (planes,),
                       (4 * planes, planes, 1, 1), (4 * planes,), (4 * planes,)]
            if block == 0:  # the downsampling shortcut
                shapes += [(4 * planes, inplanes, 1, 1), (4 * planes,), (4 * planes,)]
            inplanes = 4 * planes
    return shapes + [(1000, 2048), (1000,)]


MODELS = {"e2e MLP": mlp_shapes, "ResNet-50": resnet50_shapes,
          "200 tensors of 256 values": lambda: [(256,)] * 200,
          "200 tensors of 4,096 values": lambda: [(4096,)] * 200,
          "200 tensors of 16,384 values": lambda: [(16384,)] * 200}


def exchanges(ranks: int):
    return [GradientExchange(sparsifier=dr.TopK(0.01), index="auto:link_gbits=1.0", value="fp16", seed=r)
            for r in range(ranks)]


def measure(shapes, ranks: int, steps: int, warmup: int, seed: int) -> dict:
    """Per-step times of rank 0 (ms): encode, decode and their codec parts."""
    names = [f"t{i}" for i in range(len(shapes))]
    rng = np.random.default_rng(seed)
    pool = [[rng.standard_normal(s).astype(np.float32) for s in shapes]
            for _ in range(ranks + 1)]
    ranks_ = exchanges(ranks)
    own = ranks_[0]
    times = {"encode": [], "decode": [], "encode codecs": [], "decode codecs": []}
    for step in range(warmup + steps):
        before = own.stats.total
        start = time.perf_counter()
        bundles = [own.encode_bundle(names, pool[step % len(pool)])]
        encoded = time.perf_counter()
        middle = own.stats.total
        bundles += [ex.encode_bundle(names, pool[(step + r) % len(pool)])
                    for r, ex in enumerate(ranks_[1:], 1)]
        start_decode = time.perf_counter()
        own.decode_bundles(b"".join(bundles), ranks, 0, average=True)
        decoded = time.perf_counter()
        after = own.stats.total
        if step >= warmup:
            times["encode"].append(encoded - start)
            times["decode"].append(decoded - start_decode)
            times["encode codecs"].append((middle - before).codec_seconds)
            times["decode codecs"].append((after - middle).codec_seconds)
    out = {key: {"median_ms": 1e3 * float(np.median(v)),
                 "q1_ms": 1e3 * float(np.percentile(v, 25)),
                 "q3_ms": 1e3 * float(np.percentile(v, 75))} for key, v in times.items()}
    out.update(tensors=len(shapes), parameters=int(sum(math.prod(s) for s in shapes)),
               compressed_tensors=int(sum(math.prod(s) >= own.config.min_size for s in shapes)),
               bytes_per_rank=len(bundles[0]))
    return out


def report(results: list, args, bandwidth: float, load: float) -> str:
    lines = ["# The exchange's CPU work per step, on the shapes of real models", "",
             f"P ranks played in one process ({platform.machine()}, "
             f"{os.cpu_count()} cores, load average {load:.1f} at the start); Top-k 1% with "
             "error feedback, `auto:link_gbits=1.0` + fp16, tensors under 1,024 values "
             "losslessly; Gaussian gradients. Rank 0's encode of its bundle and decode of "
             f"all P bundles into dense averages, median of {args.steps} steps "
             f"after {args.warmup} (quartiles in the JSON file). *Rest*: encode + decode less "
             f"the codecs (error feedback, Top-k, container, sums), against its floor of "
             f"{FLOOR_BYTES_PER_PARAMETER} bytes per parameter at the copy bandwidth measured "
             f"here, {bandwidth:.1f} GB/s (bytes read + written). Produced by "
             "`python -m benchmarks.model_steps`.", ""]
    rows = []
    for r in results:
        encode, decode = r["encode"]["median_ms"], r["decode"]["median_ms"]
        codecs = r["encode codecs"]["median_ms"] + r["decode codecs"]["median_ms"]
        floor = FLOOR_BYTES_PER_PARAMETER * r["parameters"] / (bandwidth * 1e6)
        rows.append([r["shapes"], r["ranks"], f"{r['tensors']} ({r['compressed_tensors']})",
                     f"{r['parameters']:,}", f"{r['bytes_per_rank'] / 1e3:.1f}", f"{encode:.2f}",
                     f"{decode:.2f}", f"{codecs:.2f}", f"{encode + decode - codecs:.2f}",
                     f"{floor:.2f}", f"{1e3 * (encode + decode) / r['tensors']:.0f}"])
    lines += table(["shapes", "P", "tensors (Top-k)", "parameters", "KB sent per rank",
                    "encode ms", "decode ms", "of which codecs ms", "rest ms", "rest's floor ms",
                    "per tensor us"], rows, right_aligned=True)
    lines += ["", "*Per tensor*: encode + decode over the tensors; for the rows of 200 "
              "tensors, whose tensors are small, that is the fixed cost of a tensor in the "
              "exchange: its calls through error feedback, the sparsifier and the sum, and "
              "its share of the codec calls of the payload it travels in (tensors of a dtype "
              f"below {SHARED_BELOW:,} elements share one), paid again for every other "
              "rank's payload that is decoded.", ""]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "model_steps.md"))
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    bandwidth = copy_bandwidth()
    results = []
    for label, shapes in MODELS.items():
        for ranks in args.ranks:
            r = measure(shapes(), ranks, args.steps, args.warmup, args.seed)
            results.append(dict(shapes=label, ranks=ranks, **r))
            print(f"{label}, {ranks} ranks: encode {r['encode']['median_ms']:.2f} ms, decode "
                  f"{r['decode']['median_ms']:.2f} ms", flush=True)
    text = report(results, args, bandwidth, load)
    write_report(args.out, text,
                 dict(results=results, copy_gbytes_s=bandwidth, load=load, args=vars(args)))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
