"""Benchmark of DeepReduce's lossy codecs: bloom, polyfit, dexp, qsgd, sign.

Measures, against the targets of the project's issue 4:

* Bloom filter: bits per true index against ``1.44 log2(1/fpr)`` (target
  within 5%), the false-positive rate measured over 100 tensors against the
  requested one (target within 20%), the decoder's universe scan speed
  (target >= 200 M positions per second on one core, a 25M universe in
  <= 125 ms) with the compiled scan and with its numpy fallback, and which share of the
  positions each policy gives values to
  are true indices;
* Bloom policies' decode: CPU time and peak memory of ``p0``, ``random`` and
  ``conflict_sets`` on the same filters in the same run (issue 33: the
  conflict sets within 1.5x of p0's time, memory in proportion to the
  positives, not the universe);
* Fit-Poly and Fit-DExp: relative L2 error of the (sorted) values and
  encode time;
* QSGD and scaled sign: bits per value and relative L2 error.

Gradients: the Top-k 1% and 10% of the real gradients in
``benchmarks/cache/gradients.npz`` (written by ``benchmarks/gradients.py``)
when that file exists, else of synthetic Laplace-like gradients (said so in
the output). The scan speed always uses a synthetic 25M-element universe:
no captured tensor is that large.

The comparison with the paper's total volumes (BF-P0, Fit-Poly and
QSGD+BF-P0 against raw Top-r pairs) needs whole payloads, i.e. the
pipeline; it is not part of this script.

Usage::

    python -m benchmarks.lossy_codecs            # prints, writes the results file
    python -m benchmarks.lossy_codecs --quick    # smaller scan, fewer repeats
    python -m benchmarks.lossy_codecs --only-decodes   # that section of the results file
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from unittest import mock

import numpy as np

from deepreduce.codecs.index import bloom
from deepreduce.codecs._murmur import RangeHasher
from deepreduce.codecs.index.bloom import BloomFilter, BloomIndices, filter_geometry
from deepreduce.codecs.values.dexp import DoubleExpValues
from deepreduce.codecs.values.polyfit import PolyFitValues
from deepreduce.codecs.values.qsgd import QSGDValues
from deepreduce.codecs.values.sign import SignValues

from benchmarks.common import (GRADIENTS, RESULTS, ROOT, best_of, load_gradients, table,
                               write_report)

RATIOS = (0.01, 0.1)
FPRS = (1e-2, 1e-3, 1e-4)
#: Tensors below this size are left out of the per-tensor codec statistics:
#: a 1% Top-k of them has a handful of values (the pipeline would not pick a
#: Bloom filter or a curve fit for them anyway).
MIN_TENSOR = 4096


def gradients(path=GRADIENTS) -> tuple[dict[str, np.ndarray], str]:
    """``{name: flat float32 gradient}`` and a sentence saying where they come from: the
    cache when it exists, else synthetic gradients."""
    if path.exists():
        grads = {key: g.astype(np.float32).ravel() for key, g in load_gradients(path).items()}
        sizes = sum(g.size for g in grads.values())
        return grads, (f"real gradients: {len(grads)} tensors, {sizes:,} values, from "
                       f"`{os.path.relpath(path, ROOT)}` (benchmarks/gradients.py)")
    rng = np.random.default_rng(0)
    grads = {}
    for i, size in enumerate([4096, 9216, 16384, 36864, 65536, 147456, 262144, 589824]):
        scale = rng.lognormal(-6, 1.5, size=size // 64 + 1).repeat(64)[:size]
        grads[f"synthetic/{i}"] = (rng.laplace(size=size) * scale).astype(np.float32)
    return grads, ("SYNTHETIC gradients (no benchmarks/cache/gradients.npz): Laplace values "
                   "with a log-normal scale per run of 64, 8 tensors of 4K-590K values")


def top_k(x: np.ndarray, ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """Sorted indices and values of the ``ratio`` largest magnitudes (at least one)."""
    k = max(1, int(round(ratio * x.size)))
    indices = np.sort(np.argpartition(np.abs(x), x.size - k)[x.size - k:])
    return indices.astype(np.int64), x[indices]


def large(grads):
    return {name: g for name, g in grads.items() if g.size >= MIN_TENSOR}


# ----------------------------------------------------------------- bloom

def bloom_sizes(grads) -> list[dict]:
    """Bits per true index of the whole stream and of the filter alone, per (fpr, ratio)."""
    rows = []
    for fpr in FPRS:
        target = 1.44 * math.log2(1 / fpr)
        for ratio in RATIOS:
            stream_bits = filter_bits = indices = 0
            for x in large(grads).values():
                idx, _ = top_k(x, ratio)
                data = BloomIndices(fpr=fpr).encode(idx, x.size)
                stream_bits += 8 * len(data)
                filter_bits += 8 * filter_geometry(idx.size, fpr)[0]
                indices += idx.size
            rows.append({"fpr": fpr, "ratio": ratio, "target": target,
                         "stream": stream_bits / indices, "filter": filter_bits / indices,
                         "indices": indices})
    return rows


def bloom_false_positive_rates(grads, tensors: int = 100) -> list[dict]:
    """False-positive rate over ``tensors`` filters (tensors cycled, fresh seed each call)."""
    pool = sorted(large(grads).items(), key=lambda item: -item[1].size)
    rows = []
    for fpr in FPRS:
        for ratio in RATIOS:
            codec = BloomIndices(fpr=fpr, seed=1)
            false_positives = negatives = 0
            for t in range(tensors):
                x = pool[t % len(pool)][1]
                idx, _ = top_k(x, ratio)
                positives = codec.build_filter(idx, x.size).positives()
                false_positives += positives.size - idx.size
                negatives += x.size - idx.size
            measured = false_positives / negatives
            rows.append({"fpr": fpr, "ratio": ratio, "measured": measured,
                         "ratio_to_target": measured / fpr, "false_positives": false_positives,
                         "tensors": tensors})
    return rows


def scan_implementation(name: str):
    """Run the block with the compiled scan and build (as installed) or the numpy fallback."""
    return (mock.patch.object(bloom, "_bloomscan", None) if name == "numpy"
            else contextlib.nullcontext())


def implementations() -> list[str]:
    return ["numpy"] if bloom._bloomscan is None else ["compiled", "numpy"]


def bloom_scan_speed(n: int, repeats: int) -> list[dict]:
    """Decode time of p0 (the full scan) on a synthetic universe of ``n`` positions."""
    rng = np.random.default_rng(1)
    rows = []
    for ratio in RATIOS:
        idx = np.sort(rng.choice(n, size=int(ratio * n), replace=False)).astype(np.int64)
        for fpr in (1e-2, 1e-3):
            for implementation in implementations():
                with scan_implementation(implementation):
                    codec = BloomIndices(fpr=fpr, policy="p0")
                    data = codec.encode(idx, n)
                    nnz = BloomFilter.from_bytes(data, n, "bench").positives().size
                    cpu, _ = best_of(lambda: codec.decode(data, n, nnz), repeats,
                                     time.thread_time)
                    wall, _ = best_of(lambda: codec.decode(data, n, nnz), repeats)
                    ones = np.ones(idx.size, np.float32)
                    encode, _ = best_of(lambda: codec.encode_selection(idx, ones, n), 3,
                                        time.thread_time)
                rows.append({"n": n, "ratio": ratio, "fpr": fpr, "scan": implementation,
                             "cpu": cpu, "wall": wall, "rate": n / cpu / 1e6, "encode": encode})
    return rows


def bloom_scan_breakdown(n: int, repeats: int, ratio: float = 0.01, fpr: float = 1e-3) -> dict:
    """CPU ns per position of the scan's parts, per implementation.

    The word-test-only figure decodes a copy of the filter whose hash count
    is cut to the blocked hashes, so the single-bit stage has nothing to do.
    The numpy scan also times MurmurHash3 alone; the compiled scan hashes
    inside its word-test loop, so its hash has no separate figure.
    """
    rng = np.random.default_rng(4)
    idx = np.sort(rng.choice(n, size=int(ratio * n), replace=False)).astype(np.int64)
    filt = BloomIndices(fpr=fpr).build_filter(idx, n)
    hasher = RangeHasher(1 << 16)

    def hash_all():
        for start in range(0, n, hasher.chunk):
            hasher.hash_range(start, min(hasher.chunk, n - start), filt.seed, filt.key_bytes)

    word_test_only = BloomFilter(filt.words, filt.nbytes, filt.block_k, filt.block_k, filt.seed, n)
    result = {"n": n, "ratio": ratio, "fpr": fpr}
    for implementation in implementations():
        with scan_implementation(implementation):
            times = {"word test": best_of(word_test_only.positives, repeats, time.thread_time)[0],
                     "all": best_of(filt.positives, repeats, time.thread_time)[0]}
        if implementation == "numpy":
            times["hash"] = best_of(hash_all, repeats, time.thread_time)[0]
        result[implementation] = {name: seconds / n * 1e9 for name, seconds in times.items()}
    return result


def bloom_policies(grads, fpr_values=(1e-2, 1e-3)) -> list[dict]:
    """Share of true indices among the positions each policy gives values to (Top-k 1%)."""
    rows = []
    for fpr in fpr_values:
        for policy in ("p0", "leftmost", "random", "conflict_sets"):
            true = received = 0
            seconds = 0.0
            for x in large(grads).values():
                idx, values = top_k(x, 0.01)
                codec = BloomIndices(fpr=fpr, policy=policy, seed=2)
                start = time.perf_counter()
                _, got, _ = codec.encode_selection(idx, values, x.size, x)
                seconds += time.perf_counter() - start
                true += np.isin(got, idx).sum()
                received += got.size
            rows.append({"fpr": fpr, "policy": policy, "true_share": true / received,
                         "received": received, "seconds": seconds})
    return rows


#: (universe, values, fpr) of the policy decode table: Top-0.1% of 2**24 positions at
#: fpr 1e-3, 200 values in 2**26 positions at fpr 1e-2 (where the false positives,
#: about fpr * n, outnumber the values 3,000 to 1), and Top-1% of 2**24 at fpr 1e-3,
#: where the conflict sets' pairs (positives x k) approach the scan's work.
POLICY_DECODES = ((1 << 24, 16_384, 1e-3), (1 << 26, 200, 1e-2), (1 << 24, 167_772, 1e-3))
DECODE_POLICIES = ("p0", "random", "conflict_sets")


def policy_stream(n: int, r: int, fpr: float, policy: str) -> tuple[bytes, int]:
    """A filter of ``r`` random positions of ``[0, n)`` and the nnz its decoder reads."""
    rng = np.random.default_rng(5)
    idx = np.sort(rng.choice(n, size=r, replace=False)).astype(np.int64)
    codec = BloomIndices(fpr=fpr, policy=policy, seed=3)
    data, received, _ = codec.encode_selection(idx, np.ones(r, np.float32), n)
    return data, received.size


def decode_peak(data: bytes, n: int, nnz: int, fpr: float, policy: str,
                implementation: str) -> dict:
    """Peak memory of one decode of ``data``, measured in a fresh process: the growth
    of its maximum resident set over what the process held before the decode, and
    the peak that tracemalloc sees (numpy's arrays and the C extension's buffers,
    which it allocates through Python's allocator)."""
    with tempfile.NamedTemporaryFile(suffix=".bloom") as stream:
        stream.write(data)
        stream.flush()
        code = ("from benchmarks.lossy_codecs import _peak_child; _peak_child("
                f"{stream.name!r}, {n}, {nnz}, {fpr!r}, {policy!r}, {implementation!r})")
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split()
    return {"rss": int(out[0]), "traced": int(out[1])}


def _resident_peak() -> int:
    """This process's peak resident set in bytes. Linux's VmHWM, where ru_maxrss would
    carry over the parent's peak across exec."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _peak_child(path, n, nnz, fpr, policy, implementation):
    with scan_implementation(implementation):
        with open(path, "rb") as stream:
            data = stream.read()
        codec = BloomIndices(fpr=fpr, policy=policy)
        small, small_nnz = policy_stream(1 << 16, 64, fpr, policy)
        codec.decode(small, 1 << 16, small_nnz)  # every code path warm, every import done
        before = _resident_peak()
        result = codec.decode(data, n, nnz)
        after = _resident_peak()
        del result
        tracemalloc.start()
        codec.decode(data, n, nnz)
        traced = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    print(after - before, traced)


def bloom_policy_decodes(repeats: int, cases=POLICY_DECODES) -> list[dict]:
    """CPU time (best of ``repeats``) and peak memory of each policy's decode, per case."""
    rows = []
    for n, r, fpr in cases:
        streams = {policy: policy_stream(n, r, fpr, policy) for policy in DECODE_POLICIES}
        positives = BloomFilter.from_bytes(streams["p0"][0], n, "bench").positives().size
        for implementation in implementations():
            cpu = dict.fromkeys(DECODE_POLICIES, math.inf)
            with scan_implementation(implementation):
                for _ in range(repeats):  # the policies in turn: a busy spell hits them all
                    for policy, (data, nnz) in streams.items():
                        codec = BloomIndices(fpr=fpr, policy=policy)
                        seconds, _ = best_of(lambda: codec.decode(data, n, nnz), 1,
                                             time.thread_time)
                        cpu[policy] = min(cpu[policy], seconds)
            for policy, (data, nnz) in streams.items():
                peak = decode_peak(data, n, nnz, fpr, policy, implementation)
                rows.append({"n": n, "r": r, "fpr": fpr, "scan": implementation,
                             "policy": policy, "positives": positives, "cpu": cpu[policy],
                             "rate": n / cpu[policy] / 1e6, **peak})
                print(f"  {n:,} {r:,} {fpr:g} {implementation} {policy}: "
                      f"{cpu[policy] * 1e3:.0f} ms, peak {peak['traced'] / 1e6:.1f} MB traced, "
                      f"{peak['rss'] / 1e6:.1f} MB RSS", flush=True)
    for row in rows:
        p0 = next(other for other in rows if other["policy"] == "p0" and all(
            other[key] == row[key] for key in ("n", "r", "fpr", "scan")))
        row["vs_p0"] = row["cpu"] / p0["cpu"]
    return rows


DECODES_HEADING = "## Policy decode: time and peak memory"


def policy_decode_section(rows) -> list[str]:
    """The report's section on the policies' decode, heading included."""
    load = os.getloadavg()
    return [DECODES_HEADING, "",
            "Decoding the same filter under p0, random and conflict_sets, the policies in "
            "turn: CPU time of the decoding thread (best of several) and its ratio to p0's; "
            "peak memory of one decode in a fresh process, as tracemalloc sees it (numpy "
            "arrays and the C extension's buffers) and as growth of the peak resident set. "
            "Every policy scans the universe; the selecting ones then hold only the positives "
            "(at most what the declared rate allows) and, for conflict_sets, the (positive, "
            "filter bit) pairs: 8 bytes each at most compiled, about 20 in numpy (issue 33). "
            f"Load average at the end: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}.", "",
            *policy_decode_table(rows)]


def replace_section(path, section: list[str]) -> None:
    """Put ``section`` in the report at ``path`` in place of its own (same heading), or
    before the value codecs' section, leaving every other figure as it was."""
    text = Path(path).read_text()
    start = text.find(section[0] + "\n")
    if start < 0:
        start = end = text.index("## Value codecs")
    else:
        end = text.index("\n## ", start + 1) + 1
    write_report(path, text[:start] + "\n".join(section) + "\n\n" + text[end:])


def policy_decode_table(rows) -> list[str]:
    return table(["universe", "values", "fpr", "scan", "policy", "positives", "decode CPU ms",
                  "vs p0", "M positions/s", "peak MB (traced)", "peak MB (RSS growth)"],
                 [[f"{row['n']:,}", f"{row['r']:,}", f"{row['fpr']:g}", row["scan"],
                   row["policy"], f"{row['positives']:,}", f"{row['cpu'] * 1e3:.0f}",
                   f"{row['vs_p0']:.2f}x", f"{row['rate']:.0f}",
                   f"{row['traced'] / 1e6:.1f}", f"{row['rss'] / 1e6:.1f}"] for row in rows])


# ----------------------------------------------------------------- values

def value_codecs(grads) -> list[dict]:
    """Bits per value, relative L2 error and encode time of each value codec, per ratio."""
    codecs = [PolyFitValues(), PolyFitValues(segments=32), DoubleExpValues(),
              QSGDValues(bits=2), QSGDValues(bits=4), QSGDValues(bits=8),
              QSGDValues(bits=4, norm="l2"), SignValues()]
    rows = []
    for ratio in RATIOS:
        tensors = [top_k(x, ratio)[1] for x in large(grads).values()]
        for codec in codecs:
            error = energy = 0.0
            bits = count = 0
            seconds = 0.0
            for values in tensors:
                if codec.sorts_values:
                    values = values[codec.order(values)]
                start = time.perf_counter()
                data, received = codec.encode_and_receive(values)
                seconds += time.perf_counter() - start
                error += float(np.sum((received.astype(np.float64) - values) ** 2))
                energy += float(np.sum(values.astype(np.float64) ** 2))
                bits += 8 * len(data)
                count += values.size
            rows.append({"ratio": ratio, "codec": codec.spec(), "bits": bits / count,
                         "error": math.sqrt(error / energy), "seconds": seconds,
                         "values": count})
    return rows


def fit_scaling(n: int) -> list[dict]:
    """Encode time and error of the curve fits on the Top-k of one large synthetic tensor."""
    rng = np.random.default_rng(3)
    x = (rng.laplace(size=n) * rng.lognormal(-6, 1.5, size=n // 64 + 1).repeat(64)[:n])
    rows = []
    for ratio in RATIOS:
        _, values = top_k(x.astype(np.float32), ratio)
        for codec in (PolyFitValues(), DoubleExpValues()):
            start = time.perf_counter()
            order = codec.order(values)
            sorted_values = values[order]
            sort_seconds = time.perf_counter() - start
            start = time.perf_counter()
            _, received = codec.encode_and_receive(sorted_values)
            seconds = time.perf_counter() - start
            error = np.linalg.norm(received - sorted_values) / np.linalg.norm(sorted_values)
            rows.append({"ratio": ratio, "codec": codec.spec(), "values": values.size, "n": n,
                         "sort": sort_seconds, "fit": seconds, "error": float(error)})
    return rows


# ----------------------------------------------------------------- report

def report(source, sizes, rates, scans, breakdown, policies, decodes, values, scaling,
           load) -> str:
    lines = ["# Lossy codecs: Bloom filter, curve fits, QSGD, sign", "",
             f"Generated by `python -m benchmarks.lossy_codecs`. Gradients: {source}. "
             f"Tensors under {MIN_TENSOR:,} values are left out of the per-tensor statistics.",
             "", f"Load average while measuring: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
             f"(1 / 5 / 15 min; the machine has {os.cpu_count()} cores shared with other jobs, "
             "so times are the best of several runs).", ""]
    lines += ["## Bloom filter size", "",
              "Bits per true index (Top-k indices of every tensor, summed), against the "
              "standard filter's 1.44 log2(1/fpr). *Filter* counts the filter words only, "
              "*stream* adds the 7-8-byte header per tensor. Target: within 5%.", ""]
    lines += table(["fpr", "Top-k", "indices", "1.44 log2(1/fpr)", "filter bits/index",
                    "stream bits/index", "stream vs target"],
                   [[f"{row['fpr']:g}", f"{row['ratio']:.0%}", f"{row['indices']:,}",
                     f"{row['target']:.2f}", f"{row['filter']:.2f}", f"{row['stream']:.2f}",
                     f"{row['stream'] / row['target'] - 1:+.1%}"] for row in sizes])
    lines += ["", "## Measured false-positive rate", "",
              f"Over {rates[0]['tensors']} filters (the large tensors cycled; every call hashes "
              "with a fresh seed). Target: within 20% of the requested rate.", ""]
    lines += table(["requested fpr", "Top-k", "false positives", "measured fpr",
                    "measured / requested"],
                   [[f"{row['fpr']:g}", f"{row['ratio']:.0%}", f"{row['false_positives']:,}",
                     f"{row['measured']:.3g}", f"{row['ratio_to_target']:.3f}"] for row in rates])
    lines += ["", "## Decoder scan speed", "",
              "p0 decode (tests every position of the universe) of a synthetic tensor on one "
              "core: CPU time of the decoding thread and wall-clock time, each the best of "
              "several runs (on a machine shared with other jobs the wall clock mostly "
              "measures them). Target: >= 200 M positions/s (25M in <= 125 ms). *compiled*: "
              "the C scan `deepreduce.codecs.index._bloomscan` that `pip install` builds; *numpy*: the "
              "fallback where it is not built (same positions). Encoding also scans (to know "
              "the positives) and builds the filter (in C, or numpy for the fallback); its "
              "CPU time is the best of three.", ""]
    lines += table(["universe", "Top-k", "fpr", "scan", "decode CPU ms", "decode wall ms",
                    "M positions/s (CPU)", "encode_selection CPU ms"],
                   [[f"{row['n']:,}", f"{row['ratio']:.0%}", f"{row['fpr']:g}", row["scan"],
                     f"{row['cpu'] * 1e3:.0f}", f"{row['wall'] * 1e3:.0f}", f"{row['rate']:.0f}",
                     f"{row['encode'] * 1e3:.0f}"] for row in scans])
    b = breakdown
    lines += ["", f"Where the CPU time goes (Top-{b['ratio']:.0%}, fpr {b['fpr']:g}, "
              f"{b['n']:,} positions, ns per position):", ""]
    if "compiled" in b:
        c = b["compiled"]
        lines += [f"* compiled: MurmurHash3 and the blocked-word test (blocks of 256 positions "
                  f"hashed with a prefetch of their words, then tested, survivors kept without "
                  f"a branch) {c['word test']:.2f}; the single-bit probes of the survivors "
                  f"(one round per probe, prefetched) {c['all'] - c['word test']:.2f}; "
                  f"total {c['all']:.2f};"]
    p = b["numpy"]
    lines += [f"* numpy fallback: MurmurHash3 of every position {p['hash']:.2f}; the "
              f"blocked-word test (word index, word and pattern gathers, mask test, compaction "
              f"of the survivors) {p['word test'] - p['hash']:.2f}; the single-bit probes of "
              f"the survivors {p['all'] - p['word test']:.2f}; total {p['all']:.2f}.", ""]
    lines += ["", "## Policies", "",
              "Share of true Top-1% indices among the positions each policy gives values to "
              "(p0 gives values to every positive; the others to exactly r), and "
              "encode_selection time summed over the tensors.", ""]
    lines += table(["fpr", "policy", "positions", "true share", "encode s"],
                   [[f"{row['fpr']:g}", row["policy"], f"{row['received']:,}",
                     f"{row['true_share']:.4f}", f"{row['seconds']:.2f}"] for row in policies])
    lines += ["", *policy_decode_section(decodes)]
    lines += ["", "## Value codecs", "",
              "Top-k values of every tensor; bits per value include every header and "
              "coefficient; relative L2 error over all values (curve fits: of the sorted "
              "values, which is what the receiver pairs with the indices sent in value "
              "order); encode time summed over the tensors (sorting excluded).", ""]
    lines += table(["Top-k", "codec", "values", "bits/value", "relative L2 error", "encode ms"],
                   [[f"{row['ratio']:.0%}", f"`{row['codec']}`", f"{row['values']:,}",
                     f"{row['bits']:.3f}", f"{row['error']:.4f}", f"{row['seconds'] * 1e3:.1f}"]
                    for row in values])
    lines += ["", f"Curve fits on one synthetic gradient of {scaling[0]['n']:,} values (Laplace "
              "values, log-normal scale per run of 64; sort = `order()`, fit = "
              "`encode_and_receive` of the sorted values):", ""]
    lines += table(["Top-k", "codec", "values", "sort ms", "fit ms", "relative L2 error"],
                   [[f"{row['ratio']:.0%}", f"`{row['codec']}`", f"{row['values']:,}",
                     f"{row['sort'] * 1e3:.0f}", f"{row['fit'] * 1e3:.0f}", f"{row['error']:.4f}"]
                    for row in scaling])
    lines += ["", "## Not measured here", "",
              "The paper's volume comparisons (BF-P0 at fpr 1e-3, Fit-Poly and QSGD+BF-P0 "
              "against raw Top-r pairs) need whole payloads from the pipeline, including the "
              "value-order index stream that curve fits force; they belong to the pipeline "
              "benchmarks.", ""]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2.5M-position scan, 2 repeats")
    parser.add_argument("--out", default=str(RESULTS / "lossy_codecs.md"),
                        help="markdown file to write")
    parser.add_argument("--only-decodes", action="store_true",
                        help="measure the policies' decode only, and replace that section "
                             "of --out (the other figures stay)")
    args = parser.parse_args(argv)
    if args.only_decodes:
        section = policy_decode_section(bloom_policy_decodes(2 if args.quick else 5))
        print("\n".join(section))
        replace_section(args.out, section)
        return
    grads, source = gradients()
    scan_n, repeats = (2_500_000, 2) if args.quick else (25_000_000, 5)
    print(f"gradients: {source}", flush=True)
    sizes = bloom_sizes(grads)
    print("bloom sizes done", flush=True)
    rates = bloom_false_positive_rates(grads)
    print("false-positive rates done", flush=True)
    scans = bloom_scan_speed(scan_n, repeats)
    breakdown = bloom_scan_breakdown(scan_n, repeats)
    load = os.getloadavg()
    print("scan speed done", flush=True)
    policies = bloom_policies(grads)
    print("policies done", flush=True)
    decodes = bloom_policy_decodes(repeats)
    print("policy decodes done", flush=True)
    values = value_codecs(grads)
    scaling = fit_scaling(scan_n)
    text = report(source, sizes, rates, scans, breakdown, policies, decodes, values, scaling,
                  load)
    print(text)
    if args.out:
        write_report(args.out, text)


if __name__ == "__main__":
    main()
