"""The DeepReduce paper's reported volumes next to ours, on our real gradients.

DeepReduce (Kostopoulou, Xu et al., "DeepReduce: A Sparse-tensor Communication
Framework for Distributed Deep Learning", arXiv 2102.03112, NeurIPS 2021)
reports the data volume of its codecs relative to plain Top-r, which sends
every kept entry as a 32-bit index and a 32-bit value:

* QSGD values + Bloom-filter indices with policy P0 send 3.2x less than
  Top-r with r = 10%, at the same accuracy;
* Fit-Poly (piecewise polynomial fit of the sorted values) sends about 40%
  less than Top-r with r = 1%;
* BF-P0 (Bloom filter at false-positive rate 1e-3, values of all positives)
  sends about 33% less than Top-r with r = 1%.

This script applies the same sparsifier (Top-r per tensor, r = 1% and 10%)
to the gradients cached by ``benchmarks/gradients.py`` (a CNN, a ResNet-20
and an embedding model on scikit-learn's digits), encodes them with
deepreduce's implementations of those codecs and with deepreduce's own exact
index codecs (``auto``) plus QSGD or fp16 values, and prints how many times
less than raw Top-r pairs each one sends. Like DeepReduce (and deepreduce's
Horovod wrappers), it compresses the tensors of at least 1,024 elements only;
smaller ones would travel uncompressed under every scheme.

Two volumes per scheme: the two encoded streams alone (what the paper
counts), and whole deepreduce payloads (with their header and CRC32, about
25 bytes per tensor). Errors: relative L2 error of what the receiver
reconstructs against the Top-r selection (what the codecs lose) and against
the dense gradient (what the step loses in all). The paper's figures are
"at the same accuracy" after full training runs; we measure volumes and
errors on captured gradients, not accuracy.

Writes ``benchmarks/results/paper_comparison.md`` and ``.json``.

    python -m benchmarks.paper_comparison
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import deepreduce as dr

from benchmarks.common import GRADIENTS, RESULTS, load_gradients, table, write_report

MIN_SIZE = 1024
RAW_PAIR_BYTES = 8  # int32 index + float32 value

#: (ratio, label, index spec or None for value order, value spec, paper's "x less than Top-r")
PAPER = [
    (0.10, "QSGD + BF-P0 (fpr 1e-3)", "bloom:fpr=0.001,policy=p0", "qsgd", 3.2),
    (0.01, "Fit-Poly", None, "polyfit", 1 / (1 - 0.40)),
    (0.01, "BF-P0 (fpr 1e-3), fp32 values", "bloom:fpr=0.001,policy=p0", "raw", 1 / (1 - 0.33)),
]
PAPER_TEXT = {0: "3.2x less", 1: "about 40% less (1.67x)", 2: "about 33% less (1.49x)"}


def ours(index):
    """deepreduce's exact index coding with the two value codecs the paper's best is set against."""
    return [(f"deepreduce {index} + qsgd", index, "qsgd"),
            (f"deepreduce {index} + qsgd:bits=8", index, "qsgd:bits=8"),
            (f"deepreduce {index} + fp16", index, "fp16"),
            (f"deepreduce {index} + raw fp32 (lossless)", index, "raw")]


def measure(tensors, ratio, index_spec, value_spec):
    """Volumes and errors of one scheme over all tensors."""
    pipe = (dr.Pipeline(dr.TopK(ratio), index=index_spec, value=value_spec) if index_spec
            else dr.Pipeline(dr.TopK(ratio), value=value_spec))
    payload_bytes = stream_bytes = delivered = kept = 0
    err_sel = norm_sel = err_dense = norm_dense = 0.0
    for g in tensors:
        flat = g.reshape(-1).astype(np.float64)
        selected = pipe.sparsifier(g)
        payload, received = pipe.encode(g)
        header = dr.read_header(payload)
        payload_bytes += len(payload)
        stream_bytes += header.index_length + header.value_length
        kept += selected.nnz
        delivered += received.nnz
        got = received.to_dense().reshape(-1).astype(np.float64)
        top = selected.to_dense().reshape(-1).astype(np.float64)
        err_sel += float(np.sum((got - top) ** 2))
        norm_sel += float(np.sum(top ** 2))
        err_dense += float(np.sum((got - flat) ** 2))
        norm_dense += float(np.sum(flat ** 2))
    return dict(payload_bytes=payload_bytes, stream_bytes=stream_bytes, kept=kept,
                delivered=delivered, rel_err_topr=float(np.sqrt(err_sel / norm_sel)),
                rel_err_dense=float(np.sqrt(err_dense / norm_dense)))


def run(path: Path):
    arrays = load_gradients(path)
    tensors = [a for a in arrays.values() if a.size >= MIN_SIZE]
    index = "auto"
    elements = sum(t.size for t in tensors)
    lines = ["# DeepReduce paper's volumes next to ours", "",
             "Paper: Kostopoulou, Xu et al., *DeepReduce: A Sparse-tensor Communication "
             "Framework for Distributed Deep Learning*, arXiv 2102.03112 (NeurIPS 2021). Its "
             "figures are relative to Top-r sending a 32-bit index and a 32-bit value per kept "
             "entry, at equal accuracy after training.", "",
             f"Ours: Top-r per tensor of the {len(tensors)} gradient tensors with at least "
             f"{MIN_SIZE:,} elements in `{path.name}` ({elements:,} elements: CNN, ResNet-20 and "
             "embedding model on scikit-learn's digits, `benchmarks/gradients.py`). "
             "*x less* = raw Top-r pair bytes (8 per kept entry) / the scheme's bytes; streams "
             "= index + value streams (what the paper counts), payloads = whole deepreduce "
             "payloads (header and CRC32 included). Errors are relative L2 of what the receiver "
             "reconstructs, against the Top-r selection and against the dense gradient. "
             "We compare volumes and errors on captured gradients, not accuracy after training.",
             ""]
    records = []
    detail = []
    for ratio in sorted({p[0] for p in PAPER}):
        raw = RAW_PAIR_BYTES * sum(dr.TopK(ratio)(t).nnz for t in tensors)
        rows = []
        schemes = [(label, ix, val, claim, PAPER_TEXT[i])
                   for i, (r, label, ix, val, claim) in enumerate(PAPER) if r == ratio]
        schemes.append(("Top-r raw pairs int32 + fp32 (the paper's baseline)", "raw", "raw",
                        1.0, "1x (baseline)"))
        schemes += [(label, ix, val, None, "") for label, ix, val in ours(index)]
        for label, index_spec, value_spec, claim, claim_text in schemes:
            m = measure(tensors, ratio, index_spec, value_spec)
            x_streams = raw / m["stream_bytes"]
            x_payloads = raw / m["payload_bytes"]
            rows.append([label, claim_text, f"{x_streams:.2f}", f"{x_payloads:.2f}",
                         f"{8 * m['stream_bytes'] / m['kept']:.2f}",
                         f"{m['delivered'] / m['kept']:.3f}", f"{m['rel_err_topr']:.2e}",
                         f"{m['rel_err_dense']:.3f}"])
            records.append(dict(ratio=ratio, scheme=label, index=index_spec, value=value_spec,
                                paper_x_less=claim, x_less_streams=x_streams,
                                x_less_payloads=x_payloads, **m))
            print(f"done {ratio:.0%} {label}", flush=True)
        detail += [f"## Top-r {ratio:.0%} (raw pairs: {raw:,} bytes)", ""]
        detail += table(["scheme", "paper: x less than Top-r", "ours: x less (streams)",
                         "ours: x less (payloads)", "bits per kept entry (streams)",
                         "delivered / kept", "rel. error vs Top-r", "rel. error vs dense"],
                        rows) + [""]
    lines += summary(records, index) + detail + NOTES
    return "\n".join(lines) + "\n", records


def summary(records, index):
    """One line per claim of the paper: its figure, ours, and deepreduce's exact coding.

    deepreduce's entry is its smallest exact-index pipeline whose value error
    (against the Top-r selection) is no larger than the paper scheme's.
    """
    rows = []
    for ratio, label, _, _, claim in PAPER:
        mine = next(r for r in records if r["ratio"] == ratio and r["scheme"] == label)
        candidates = [r for r in records if r["ratio"] == ratio
                      and r["scheme"].startswith(f"deepreduce {index}")
                      and r["rel_err_topr"] <= mine["rel_err_topr"]]
        best = max(candidates, key=lambda r: r["x_less_streams"], default=None)
        ours_cells = ([best["scheme"], f"{best['x_less_streams']:.2f}",
                       f"{best['rel_err_topr']:.2e}"] if best else ["none", "", ""])
        rows.append([f"{ratio:.0%}", label, f"{claim:.2f}", f"{mine['x_less_streams']:.2f}",
                     f"{mine['rel_err_topr']:.2e}"] + ours_cells)
    return ["## Summary", ""] + table(
        ["Top-r", "paper's scheme", "paper: x less", "ours, same scheme: x less (streams)",
         "its error vs Top-r", "deepreduce exact index, no more error", "x less (streams)",
         "its error vs Top-r"], rows) + [""]


NOTES = [
    "## Notes", "",
    "* BF-P0 sends a value for every positive of the filter, false ones included: at "
    "fpr 1e-3 and r = 1% there are about fpr x (n - r) = 0.1 r false positives (the "
    "*delivered / kept* column), which costs 10% more values on top of the filter's "
    "1.44 log2(1000) = 14.4 bits per index. Its error against the Top-r selection is the mass of "
    "those extra (true, dense) values; against the dense gradient it is no worse than Top-r's.",
    "* Fit-Poly sends the values in sorted order, so the indices must follow that order: "
    "DeepReduce sent them as 32-bit integers, deepreduce packs them at ceil(log2 n) bits, which "
    "is why our Fit-Poly volume beats the paper's.",
    "* QSGD here is deepreduce's `qsgd` at its defaults (4 bits, buckets of 512, stochastic "
    "rounding); the paper's QSGD settings may differ. The same value codec behind the exact "
    "`auto` index codec replaces a lossy 14-bit-per-index filter with an exact code of about "
    "log2(n/r) + 1.5 bits per index, which is where deepreduce's own pipeline gains over the "
    "paper's best at equal value error.",
    "* Small tensors (under 1,024 elements) are left out of every scheme, as in DeepReduce; "
    "volumes are totals over the remaining tensors.",
    "",
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gradients", default=str(GRADIENTS),
                        help="gradient cache of benchmarks/gradients.py (made when missing)")
    parser.add_argument("--out", default=str(RESULTS / "paper_comparison.md"))
    args = parser.parse_args(argv)
    report, records = run(Path(args.gradients))
    write_report(args.out, report, records)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
