"""Codec benchmark: bits per nnz against the entropy bound, and throughput, on one core.

Synthetic Top-k supports of standard normal float32 tensors, n in {1M, 25M},
density in {0.1%, 1%, 10%}; with ``--gradients FILE`` also real gradients (the
cache written by ``benchmarks/gradients.py``). Throughput is in MB/s of
*dense* input (n * 4 bytes), the figure that compares with a memory copy and
with sending the dense tensor. Prints markdown and writes it to
``benchmarks/results/codecs.md``.

Targets (issue 2): sparsify (fast TopK 1%) + encode with varint + fp16 at
>= 500 MB/s of dense input; decode + scatter into a dense buffer >= 1 GB/s.

    python benchmarks/codecs.py                 # full run (about two minutes)
    python benchmarks/codecs.py --sizes 1000000 # quicker
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core: the targets are per core

import numpy as np  # noqa: E402

import deepreduce as dr  # noqa: E402
from deepreduce.registry import registered_codecs  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def best_of(fn, repeat):
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def exact_index_codecs():
    return {cid: cls() for cid, cls in sorted(registered_codecs("index").items()) if cls.lossless}


def value_codecs():
    return {cid: cls() for cid, cls in sorted(registered_codecs("value").items())
            if not cls.sorts_values}


def index_table(n, st, repeat):
    dense_mb = n * 4 / 1e6
    bound = dr.index_entropy_bits(n, st.nnz)
    rows = []
    for cid, codec in exact_index_codecs().items():
        t_enc, data = best_of(lambda: codec.encode(st.indices, n), repeat)
        t_dec, back = best_of(lambda: codec.decode(data, n, st.nnz), repeat)
        assert np.array_equal(back, st.indices), cid
        bits = 8 * len(data) / st.nnz
        rows.append((cid, bits, bits / bound, dense_mb / t_enc, dense_mb / t_dec,
                     st.nnz / t_enc / 1e6, st.nnz / t_dec / 1e6))
    return bound, rows


def value_table(n, st, repeat):
    dense_mb = n * 4 / 1e6
    rows = []
    for cid, codec in value_codecs().items():
        t_enc, (data, received) = best_of(lambda: codec.encode_and_receive(st.values), repeat)
        t_dec, back = best_of(lambda: codec.decode(data, st.nnz, st.values.dtype), repeat)
        err = np.linalg.norm(back.astype(np.float64) - st.values) / np.linalg.norm(st.values)
        rows.append((cid, 8 * len(data) / st.nnz, err, dense_mb / t_enc, dense_mb / t_dec))
    return rows


def pipeline_row(x, density, index, value, repeat):
    """End to end: sparsify + encode, and decode + scatter into a reused dense buffer."""
    pipe = dr.Pipeline(dr.TopK(density), index, value)
    t_sparsify, st = best_of(lambda: pipe.sparsifier(x), repeat)
    t_encode, (payload, _) = best_of(lambda: pipe.encode(x), repeat)
    buffer = np.empty_like(x)
    t_decode, _ = best_of(lambda: dr.decompress(payload).to_dense(out=buffer), repeat)
    dense_mb = x.nbytes / 1e6
    return dict(sparsify=dense_mb / t_sparsify, encode=dense_mb / t_encode,
                decode=dense_mb / t_decode, bits=8 * len(payload) / st.nnz)


def run(sizes, densities, repeat, gradients):
    lines = ["# Codec benchmark", "",
             f"One core (OMP_NUM_THREADS=1), best of {repeat}; numpy {np.__version__}. "
             "MB/s are of dense float32 input (n x 4 bytes); M idx/s are indices per second. "
             "Bound = log2 C(n,k)/k.", ""]
    rng = np.random.default_rng(0)
    for n in sizes:
        x = rng.standard_normal(n).astype(np.float32)
        for density in densities:
            st = dr.TopK(density)(x)
            bound, rows = index_table(n, st, repeat)
            lines += [f"## n = {n:,}, density {density:g} (k = {st.nnz:,})", "",
                      f"Index codecs; entropy bound {bound:.2f} bits/index.", "",
                      "| index codec | bits/index | x bound | encode MB/s | decode MB/s "
                      "| encode M idx/s | decode M idx/s |", "|---|---|---|---|---|---|---|"]
            lines += [f"| {r[0]} | {r[1]:.2f} | {r[2]:.3f} | {r[3]:,.0f} | {r[4]:,.0f} "
                      f"| {r[5]:.0f} | {r[6]:.0f} |" for r in rows]
            lines += ["", "| value codec | bits/value | rel. L2 error | encode MB/s | decode MB/s |",
                      "|---|---|---|---|---|"]
            lines += [f"| {r[0]} | {r[1]:.2f} | {r[2]:.2e} | {r[3]:,.0f} | {r[4]:,.0f} |"
                      for r in value_table(n, st, repeat)]
            p = pipeline_row(x, density, "varint", "fp16", repeat)
            lines += ["", "Pipeline TopK + varint + fp16: "
                      f"sparsify {p['sparsify']:,.0f} MB/s; sparsify + encode {p['encode']:,.0f} MB/s "
                      f"(target >= 500); decode + scatter {p['decode']:,.0f} MB/s (target >= 1000); "
                      f"{p['bits']:.2f} bits/nnz in total.", ""]
            print(f"done n={n:,} density={density:g}", flush=True)
    if gradients:
        lines += gradient_section(Path(gradients), repeat)
    return "\n".join(lines) + "\n"


def gradient_section(path, repeat):
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files if ".indexed_" not in k}
    lines = [f"## Real gradients ({path.name}: {len(arrays)} tensors, "
             f"{sum(a.size for a in arrays.values()):,} elements), Top-k per tensor", ""]
    for density in (0.001, 0.01, 0.1):
        selected = [dr.TopK(density)(a) for a in arrays.values()]
        nnz = sum(s.nnz for s in selected)
        bound = sum(dr.index_entropy_bits(s.size, s.nnz) * s.nnz for s in selected) / nnz
        lines += [f"Density {density:g}: k = {nnz:,} in all, bound {bound:.2f} bits/index.", "",
                  "| index codec | bits/index | x bound |", "|---|---|---|"]
        for cid, codec in exact_index_codecs().items():
            size = sum(len(codec.encode(s.indices, s.size)) for s in selected)
            lines.append(f"| {cid} | {8 * size / nnz:.2f} | {8 * size / nnz / bound:.3f} |")
        lines.append("")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 25_000_000])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01, 0.1])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gradients", default=None,
                        help="real gradient cache from benchmarks/gradients.py")
    parser.add_argument("--out", default=str(RESULTS / "codecs.md"))
    args = parser.parse_args()
    report = run(args.sizes, args.densities, args.repeat, args.gradients)
    print(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report)


if __name__ == "__main__":
    main()
