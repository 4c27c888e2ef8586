"""Codec benchmark: bits per nnz against the entropy bound, throughput, and baselines.

Two parts, one run:

Synthetic supports
    Top-k of standard normal float32 tensors, n in {1M, 25M}, density in
    {0.1%, 1%, 10%}: every exact index codec against the entropy bound
    log2 C(n,k)/k, every value codec's bits and error, and the end-to-end
    pipeline targets. Throughput is in MB/s of *dense* input (n * 4 bytes), the
    figure that compares with a memory copy and with sending the dense tensor.
Real gradients
    The cache written by ``benchmarks/gradients.py`` (a CNN, a ResNet-20 and an
    embedding model on scikit-learn's digits; generated on first use), Top-k
    0.1%, 1% and 10% per tensor: bits per index of every index codec per model,
    every value codec's bits and error, and what one training step sends per
    model next to the baselines a user would otherwise have: dense fp32 and fp16
    (Horovod's allreduce and its fp16 compression), raw Top-k pairs int32 +
    float32 (what Horovod's IndexedSlices path sends), zstd of those raw pairs,
    and deepreduce pipelines.

Writes ``benchmarks/results/codecs.md`` (markdown, also printed),
``codecs.json`` (every figure, for the notebooks and the README) and PNG plots
``codecs_*.png``.

Targets: sparsify (fast TopK 1%) + encode with varint + fp16 at >= 500 MB/s of
dense input; decode + scatter into a dense buffer >= 1 GB/s (issue 2). ``auto``
within 3% of the entropy bound on every synthetic cell, and the smallest exact
codec or within 2% of it on real gradients (issue 3).

    python -m benchmarks.codecs                 # full run (a few minutes)
    python -m benchmarks.codecs --sizes 1000000 # quicker
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core: the targets are per core

import numpy as np  # noqa: E402
import zstandard  # noqa: E402

import deepreduce as dr  # noqa: E402
from deepreduce.registry import registered_codecs  # noqa: E402

from benchmarks.common import (GRADIENTS, RESULTS, best_of, load_gradients, table,  # noqa: E402
                               write_report)

MODELS = ("cnn", "resnet20", "embedding")
GRADIENT_DENSITIES = (0.001, 0.01, 0.1)
#: The index codec of the deepreduce pipelines set against the baselines.
PIPELINE_INDEX = "auto"
#: Value codec settings shown besides each codec's defaults.
EXTRA_VALUE_SPECS = ("qsgd:bits=2", "qsgd:bits=8", "polyfit:degree=3")


def exact_index_codecs():
    return {cid: cls() for cid, cls in sorted(registered_codecs("index").items()) if cls.lossless}


def lossy_index_codecs():
    return {cid: cls() for cid, cls in sorted(registered_codecs("index").items())
            if not cls.lossless}


def value_codecs(include_sorting=False):
    codecs = {cid: cls() for cid, cls in sorted(registered_codecs("value").items())
              if include_sorting or not cls.sorts_values}
    for spec in EXTRA_VALUE_SPECS:
        cid = spec.split(":")[0]
        if cid in codecs:  # not left out for sorting its values
            codecs[spec] = dr.get_codec(spec, family="value")
    return codecs


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


def _ordered(codec, values):
    """The values in the order the codec sends them (curve fits sort them)."""
    return values[codec.order(values)] if codec.sorts_values else values


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


def synthetic_section(sizes, densities, repeat):
    """Markdown lines and records of the synthetic Top-k supports."""
    lines, records = [], []
    rng = np.random.default_rng(0)
    for n in sizes:
        x = rng.standard_normal(n).astype(np.float32)
        for density in densities:
            st = dr.TopK(density)(x)
            bound, rows = index_table(n, st, repeat)
            lines += [f"### n = {n:,}, density {density:g} (k = {st.nnz:,})", "",
                      f"Index codecs; entropy bound {bound:.2f} bits/index.", ""]
            lines += table(["index codec", "bits/index", "x bound", "encode MB/s", "decode MB/s",
                            "encode M idx/s", "decode M idx/s"],
                           [[r[0], f"{r[1]:.2f}", f"{r[2]:.3f}", f"{r[3]:,.0f}", f"{r[4]:,.0f}",
                             f"{r[5]:.0f}", f"{r[6]:.0f}"] for r in rows])
            auto = next(r for r in rows if r[0] == "auto")
            verdict = "met" if auto[2] <= 1.03 else "MISSED"
            lines += ["", f"`auto`: {auto[2]:.3f} x bound (target <= 1.03: {verdict}); "
                          f"encode {auto[5]:.0f} M idx/s (target >= 50 at n = 25M, 1%), "
                          f"decode {auto[6]:.0f} M idx/s (target >= 100).", ""]
            values = value_table(n, st, repeat)
            lines += table(["value codec", "bits/value", "rel. L2 error", "encode MB/s",
                            "decode MB/s"],
                           [[r[0], f"{r[1]:.2f}", f"{r[2]:.2e}", f"{r[3]:,.0f}", f"{r[4]:,.0f}"]
                            for r in values])
            p = pipeline_row(x, density, "varint", "fp16", repeat)
            # issue 2's targets are stated for Top-k 1%; other densities are reported as is
            targets = ((" (target >= 500: " + ("met" if p["encode"] >= 500 else "NOT met") + ")",
                        " (target >= 1000: " + ("met" if p["decode"] >= 1000 else "NOT met") + ")")
                       if density == 0.01 else ("", ""))
            lines += ["", "Pipeline TopK + varint + fp16: "
                      f"sparsify {p['sparsify']:,.0f} MB/s; sparsify + encode {p['encode']:,.0f} MB/s"
                      f"{targets[0]}; decode + scatter {p['decode']:,.0f} MB/s{targets[1]}; "
                      f"{p['bits']:.2f} bits/nnz in total.", ""]
            records.append(dict(
                n=n, density=density, nnz=st.nnz, bound=bound,
                index=[dict(codec=r[0], bits=r[1], x_bound=r[2], encode_mbs=r[3],
                            decode_mbs=r[4], encode_midx=r[5], decode_midx=r[6]) for r in rows],
                value=[dict(codec=r[0], bits=r[1], rel_l2=r[2], encode_mbs=r[3],
                            decode_mbs=r[4]) for r in values],
                pipeline=p))
            print(f"done n={n:,} density={density:g}", flush=True)
    return lines, records


# -- real gradients -------------------------------------------------------------------

def by_model(gradients: dict) -> dict:
    """``{model: [(variable, gradient)]}`` of the ``{"model/variable": gradient}`` cache."""
    grouped = {}
    for key, array in gradients.items():
        model, name = key.split("/", 1)
        grouped.setdefault(model, []).append((name, array))
    return grouped


def raw_pairs(st) -> bytes:
    """Top-k as Horovod's IndexedSlices path sends it: int32 indices, then float32 values."""
    return st.indices.astype("<i4").tobytes() + st.values.astype("<f4").tobytes()


def _step_bytes(selected, grads, density):
    """Bytes one step sends per model for every baseline and deepreduce pipeline.

    Returns ``[(scheme, {model: bytes}, rel_l2_of_values)]``; the error is the
    relative L2 error of the delivered values against the Top-k values (0 for
    lossless schemes; for the dense fp16 baseline, against the dense gradient).
    """
    zstd = zstandard.ZstdCompressor(level=3)
    models = list(selected)
    dense = {m: sum(g.size for _, g in grads[m]) for m in models}
    nnz = {m: sum(s.nnz for s in selected[m]) for m in models}
    all_flat = np.concatenate([g.reshape(-1) for m in models for _, g in grads[m]])
    rows = [("dense fp32 (allreduce)", {m: 4 * dense[m] for m in models}, 0.0),
            ("dense fp16 (Horovod fp16)", {m: 2 * dense[m] for m in models},
             float(np.linalg.norm(all_flat.astype(np.float16).astype(np.float64) - all_flat)
                         / np.linalg.norm(all_flat))),
            ("Top-k raw pairs int32+fp32", {m: 8 * nnz[m] for m in models}, 0.0),
            ("Top-k raw pairs + zstd", {m: sum(len(zstd.compress(raw_pairs(s)))
                                             for s in selected[m]) for m in models}, 0.0)]
    specs = [(PIPELINE_INDEX, value) for value in
             ("raw", "zstd", "fp16", "bf16", "qsgd", "qsgd:bits=8", "sign")] + [(None, "polyfit")]
    for index_spec, value_spec in specs:
        pipe = dr.Pipeline(None, index_spec, value_spec) if index_spec \
            else dr.Pipeline(None, value=value_spec)
        sizes, err2, norm2 = {}, 0.0, 0.0
        for m in models:
            total = 0
            for s in selected[m]:
                payload, received = pipe.encode(s)
                total += len(payload)
                err2 += float(np.sum((received.values.astype(np.float64)
                                      - s.values.astype(np.float64)) ** 2))
                norm2 += float(np.sum(s.values.astype(np.float64) ** 2))
            sizes[m] = total
        label = f"deepreduce {index_spec or 'value-order'} + {value_spec}"
        rows.append((label, sizes, float(np.sqrt(err2 / norm2)) if norm2 else 0.0))
    return rows


def gradient_section(path: Path, repeat: int, densities=GRADIENT_DENSITIES):
    grads = by_model(load_gradients(path))
    models = [m for m in MODELS if m in grads] + [m for m in grads if m not in MODELS]
    total = sum(g.size for m in models for _, g in grads[m])
    lines = [f"## Real gradients ({path.name}: {sum(len(grads[m]) for m in models)} tensors, "
             f"{total:,} elements), Top-k per tensor", "",
             "Per model: " + "; ".join(
                 f"{m} {len(grads[m])} tensors, {sum(g.size for _, g in grads[m]):,} elements"
                 for m in models) + ". Bits are totals over all tensors of a model divided by "
             "their nnz; small tensors (biases: Top-k keeps at least one entry) carry a "
             "relatively larger payload header. Index speeds are M indices/s over the whole "
             "set of tensors, value speeds M values/s: on tensors this small they measure "
             "per-call overhead as much as coding speed.", ""]
    records = []
    for density in densities:
        selected = {m: [dr.TopK(density)(g) for _, g in grads[m]] for m in models}
        every = [s for m in models for s in selected[m]]
        dense_of = [g.reshape(-1) for m in models for _, g in grads[m]]
        nnz = {m: sum(s.nnz for s in selected[m]) for m in models}
        nnz_all = sum(nnz.values())
        bound = {m: sum(dr.index_entropy_bits(s.size, s.nnz) * s.nnz for s in selected[m])
                 / nnz[m] for m in models}
        bound_all = sum(bound[m] * nnz[m] for m in models) / nnz_all
        lines += [f"### Density {density:g}: k = {nnz_all:,} in all "
                  f"({', '.join(f'{m} {nnz[m]:,}' for m in models)})", "",
                  "Index codecs (exact). Entropy bound log2 C(n,k)/k per tensor, weighted: "
                  + ", ".join(f"{m} {bound[m]:.2f}" for m in models)
                  + f", all {bound_all:.2f} bits/index.", ""]
        index_rows = []
        for cid, codec in exact_index_codecs().items():
            t_enc, streams = best_of(lambda: [codec.encode(s.indices, s.size) for s in every],
                                     repeat)
            t_dec, backs = best_of(lambda: [codec.decode(d, s.size, s.nnz)
                                            for d, s in zip(streams, every)], repeat)
            assert all(np.array_equal(b, s.indices) for b, s in zip(backs, every)), cid
            sizes, pos = {}, 0
            for m in models:
                sizes[m] = sum(len(d) for d in streams[pos:pos + len(selected[m])])
                pos += len(selected[m])
            bits = {m: 8 * sizes[m] / nnz[m] for m in models}
            bits_all = 8 * sum(sizes.values()) / nnz_all
            index_rows.append(dict(codec=cid, bits=bits, bits_all=bits_all,
                                   x_bound=bits_all / bound_all,
                                   encode_midx=nnz_all / t_enc / 1e6,
                                   decode_midx=nnz_all / t_dec / 1e6))
        lines += table(["index codec"] + [f"{m} bits/idx" for m in models]
                       + ["all bits/idx", "x bound", "encode M idx/s", "decode M idx/s"],
                       [[r["codec"]] + [f"{r['bits'][m]:.2f}" for m in models]
                        + [f"{r['bits_all']:.2f}", f"{r['x_bound']:.3f}",
                           f"{r['encode_midx']:.3g}", f"{r['decode_midx']:.3g}"]
                        for r in index_rows])
        smallest = min(r["bits_all"] for r in index_rows)
        auto = next(r for r in index_rows if r["codec"] == "auto")
        gap = auto["bits_all"] / smallest - 1
        lines += ["", f"`auto`: {auto['bits_all']:.2f} bits/index, {gap:+.1%} against "
                      f"the smallest exact codec (target <= +2%: "
                      f"{'met' if gap <= 0.02 else 'MISSED'})."]
        lossy_rows = []
        for cid, codec in lossy_index_codecs().items():
            t_enc, encoded = best_of(lambda: [codec.encode_selection(s.indices, s.values, s.size, d)
                                              for s, d in zip(every, dense_of)], repeat)
            t_dec, _ = best_of(lambda: [codec.decode(data, s.size, idx.size) for
                                        (data, idx, _), s in zip(encoded, every)], repeat)
            size = sum(len(data) for data, _, _ in encoded)
            delivered = sum(idx.size for _, idx, _ in encoded)
            lossy_rows.append(dict(codec=cid, bits_all=8 * size / nnz_all,
                                   delivered=delivered / nnz_all,
                                   encode_midx=nnz_all / t_enc / 1e6,
                                   decode_midx=nnz_all / t_dec / 1e6))
        lines += ["", "Lossy index codecs (default settings; bits per selected index, "
                      "delivered = indices the receiver gets / k):", ""]
        lines += table(["index codec", "bits/idx", "delivered", "encode M idx/s",
                        "decode M idx/s"],
                       [[r["codec"], f"{r['bits_all']:.2f}", f"{r['delivered']:.3f}",
                         f"{r['encode_midx']:.3g}", f"{r['decode_midx']:.3g}"]
                        for r in lossy_rows])

        value_rows = []
        for cid, codec in value_codecs(include_sorting=True).items():
            inputs = [_ordered(codec, s.values) for s in every]
            t_enc, encoded = best_of(lambda: [codec.encode_and_receive(v) for v in inputs],
                                     repeat)
            t_dec, _ = best_of(lambda: [codec.decode(data, v.size, v.dtype)
                                        for (data, _), v in zip(encoded, inputs)], repeat)
            err2 = sum(float(np.sum((r.astype(np.float64) - v.astype(np.float64)) ** 2))
                       for (_, r), v in zip(encoded, inputs))
            norm2 = sum(float(np.sum(v.astype(np.float64) ** 2)) for v in inputs)
            size = sum(len(data) for data, _ in encoded)
            value_rows.append(dict(codec=cid, bits=8 * size / nnz_all,
                                   rel_l2=float(np.sqrt(err2 / norm2)), lossless=codec.lossless,
                                   sorts=codec.sorts_values,
                                   encode_mvals=nnz_all / t_enc / 1e6,
                                   decode_mvals=nnz_all / t_dec / 1e6))
        lines += ["", "Value codecs (all models; codecs marked * sort the values, so their "
                      "indices travel in value order, bit-packed):", ""]
        lines += table(["value codec", "bits/value", "rel. L2 error", "encode M val/s",
                        "decode M val/s"],
                       [[r["codec"] + (" *" if r["sorts"] else ""), f"{r['bits']:.2f}",
                         f"{r['rel_l2']:.2e}", f"{r['encode_mvals']:.3g}",
                         f"{r['decode_mvals']:.3g}"] for r in value_rows])

        step_rows = _step_bytes(selected, grads, density)
        dense_all = sum(step_rows[0][1].values())
        raw_all = sum(step_rows[2][1].values())
        lines += ["", "Bytes one step sends per rank (whole payloads, headers included), "
                      "against the baselines:", ""]
        lines += table(["scheme"] + [f"{m} bytes" for m in models]
                       + ["all bytes", "x smaller than dense fp32", "x smaller than raw pairs",
                          "value rel. L2 error"],
                       [[label] + [f"{sizes[m]:,}" for m in models]
                        + [f"{sum(sizes.values()):,}", f"{dense_all / sum(sizes.values()):.1f}",
                           f"{raw_all / sum(sizes.values()):.2f}", f"{err:.1e}"]
                        for label, sizes, err in step_rows])
        lines.append("")
        records.append(dict(density=density, nnz=nnz, nnz_all=nnz_all, bound=bound,
                            bound_all=bound_all, index=index_rows, lossy_index=lossy_rows,
                            value=value_rows,
                            step=[dict(scheme=label, bytes=sizes, bytes_all=sum(sizes.values()),
                                       rel_l2=err) for label, sizes, err in step_rows]))
        print(f"done real gradients density={density:g}", flush=True)
    return lines, records


# -- plots ------------------------------------------------------------------------------

def plot_results(synthetic, gradients, outdir: Path) -> list[str]:
    """Write the PNG plots; return their file names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if gradients:
        fig, axes = plt.subplots(1, len(gradients), figsize=(4.2 * len(gradients), 4.2),
                                 sharey=True)
        axes = np.atleast_1d(axes)
        for ax, rec in zip(axes, gradients):
            rows = sorted(rec["index"], key=lambda r: r["bits_all"])
            bits = [r["bits_all"] for r in rows]
            ax.barh([r["codec"] for r in rows], np.minimum(bits, 40), color="tab:blue")
            for y, b in enumerate(bits):
                ax.text(min(b, 40) + 0.5, y, f"{b:.1f}", va="center", fontsize=7)
            ax.axvline(rec["bound_all"], color="k", ls="--", lw=1,
                       label=f"entropy bound {rec['bound_all']:.1f}")
            ax.axvline(32, color="tab:red", ls=":", lw=1, label="raw int32 (32)")
            ax.set_xlim(0, 46)
            ax.set_title(f"Top-k {rec['density']:.1%}: bits per index")
            ax.legend(fontsize=7, loc="lower right")
        fig.suptitle("Exact index codecs on real gradients (all models)")
        fig.tight_layout()
        fig.savefig(outdir / "codecs_gradients_index.png", dpi=90)
        plt.close(fig)
        written.append("codecs_gradients_index.png")

        fig, ax = plt.subplots(figsize=(9, 4.6))
        schemes = [s["scheme"] for s in gradients[0]["step"]]
        width = 0.8 / len(gradients)
        ypos = np.arange(len(schemes))
        for i, rec in enumerate(gradients):
            by_scheme = {s["scheme"]: s["bytes_all"] for s in rec["step"]}
            ax.barh(ypos + i * width, [by_scheme.get(s, np.nan) for s in schemes], width,
                    label=f"Top-k {rec['density']:.1%}")
        ax.set_yticks(ypos + width * (len(gradients) - 1) / 2, schemes, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("bytes per step per rank (CNN + ResNet-20 + embedding model)")
        ax.set_title("What one step sends: baselines and deepreduce pipelines")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(outdir / "codecs_gradients_bytes.png", dpi=90)
        plt.close(fig)
        written.append("codecs_gradients_bytes.png")

        rec = next((r for r in gradients if r["density"] == 0.01), gradients[0])
        fig, ax = plt.subplots(figsize=(7, 4.6))
        speeds = np.array([r["encode_mvals"] for r in rec["value"]])
        sizes = 30 + 300 * speeds / speeds.max()
        errors = np.array([max(r["rel_l2"], 1e-9) for r in rec["value"]])
        ax.scatter([r["bits"] for r in rec["value"]], errors, s=sizes, alpha=0.6)
        for i, (r, e) in enumerate(zip(rec["value"], errors)):
            ax.annotate(r["codec"], (r["bits"], e), fontsize=7, xytext=(5, 9 * (i % 3) - 9),
                        textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("bits per value")
        ax.set_ylabel("relative L2 error (lossless shown at 1e-9)")
        ax.set_title(f"Value codecs on real gradients, Top-k {rec['density']:.0%} "
                     "(marker area ~ encode speed)")
        fig.tight_layout()
        fig.savefig(outdir / "codecs_gradients_values.png", dpi=90)
        plt.close(fig)
        written.append("codecs_gradients_values.png")
    if synthetic:
        n = max(r["n"] for r in synthetic)
        cells = [r for r in synthetic if r["n"] == n]
        fig, ax = plt.subplots(figsize=(7, 4.6))
        for codec in [r["codec"] for r in cells[0]["index"]]:
            pts = [(c["density"], next(r["x_bound"] for r in c["index"] if r["codec"] == codec))
                   for c in cells]
            ax.plot(*zip(*pts), marker="o", label=codec)
        ax.axhline(1.0, color="k", ls="--", lw=1)
        ax.axhline(1.03, color="gray", ls=":", lw=1, label="auto target 1.03")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("density k/n")
        ax.set_ylabel("bits per index / entropy bound")
        ax.set_title(f"Exact index codecs on random Top-k supports, n = {n:,}")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(outdir / "codecs_synthetic.png", dpi=90)
        plt.close(fig)
        written.append("codecs_synthetic.png")
    return written


def run(sizes, densities, repeat, gradients, gradient_repeat):
    lines = ["# Codec benchmark", "",
             f"One core (OMP_NUM_THREADS=1), best of {repeat} (real gradients: best of "
             f"{gradient_repeat}); numpy {np.__version__}; "
             f"registered index codecs: {', '.join(sorted(registered_codecs('index')))}; "
             f"value codecs: {', '.join(sorted(registered_codecs('value')))}. "
             "MB/s are of dense float32 input (n x 4 bytes); M idx/s are indices per second. "
             "Bound = log2 C(n,k)/k. The machine is shared with other jobs, so speeds are "
             "indicative (best of the repeats).", ""]
    synthetic, records = [], {}
    if sizes:
        lines += ["## Synthetic Top-k supports of standard normal tensors", ""]
        synth_lines, synthetic = synthetic_section(sizes, densities, repeat)
        lines += synth_lines
    real = []
    if gradients:
        real_lines, real = gradient_section(Path(gradients), gradient_repeat)
        lines += real_lines
    records = dict(synthetic=synthetic, gradients=real, repeat=repeat,
                   gradient_repeat=gradient_repeat,
                   pipeline_index=PIPELINE_INDEX)
    return "\n".join(lines) + "\n", records


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="*", default=[1_000_000, 25_000_000],
                        help="synthetic tensor sizes; none skips the synthetic part")
    parser.add_argument("--densities", type=float, nargs="+", default=[0.001, 0.01, 0.1])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--gradient-repeat", type=int, default=7,
                        help="timing repetitions on the (small) real gradients")
    parser.add_argument("--gradients", default=str(GRADIENTS),
                        help="real gradient cache from benchmarks/gradients.py (made when "
                             "missing); 'none' skips the real gradients")
    parser.add_argument("--out", default=str(RESULTS / "codecs.md"))
    args = parser.parse_args()
    gradients = None if args.gradients.lower() == "none" else args.gradients
    report, records = run(args.sizes, args.densities, args.repeat, gradients,
                          args.gradient_repeat)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plots = plot_results(records["synthetic"], records["gradients"], out.parent)
    report += "\n" + "\n".join(f"![{p}]({p})" for p in plots) + "\n"
    print(report)
    write_report(out, report, records)


if __name__ == "__main__":
    main()
