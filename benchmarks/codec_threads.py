"""The codec threads' speed-up: a bundle's codec time on 1 thread and on 2.

One rank's step on a model's parameter shapes, Gaussian gradients, the default
exchange (Top-k 1% with error feedback, ``auto`` indices, fp16 values, tensors
under 1,024 values lossless): the rank encodes its bundle, a second rank
encodes its own, and the first decodes both (its own payloads reused, the
other's decoded), as the allgather communicator does with P = 2. Timed: the
codec part of that step (``StepStats.codec_seconds``: the wall time of the
codings of the bundle and of the decodings), with ``codec_threads=1``, with
more, and with more and every payload on them (payloads of fewer than
:data:`deepreduce.exchange.parallel.PARALLEL_ENTRIES` entries stay on the caller's
thread otherwise), the settings taking turns step after step so that all see
the same load. Every step asserts that the settings give the same bundles and
the same sums. Beside them, a GIL-free reference: the bundle's index sets
Golomb-coded on 1 thread and on more, which tells what this machine's cores
gave threads at the time (on a machine shared with other jobs, often less
than their number), and what a hand-over of the GIL costs (:func:`handover_speedups`).

The models: torchvision's ResNet-50 (161 parameter tensors, 25.6M parameters,
:func:`benchmarks.model_steps.resnet50_shapes` builds them from the
architecture), whose tensors travel in 9 payloads, 8 of them of 8,192 entries or more;
an MLP of three 4096 x 4096 layers (168,000 entries each); on request
(``--models``) GPT-2 small's 148 tensors (124M parameters,
:func:`gpt2_small_shapes`).

Writes ``benchmarks/results/codec_threads.md`` and ``.json``::

    python -m benchmarks.codec_threads
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time
import zlib

import numpy as np

from deepreduce.exchange import gathering
from deepreduce.exchange import GradientExchange
from deepreduce.bundle import split_bundles
from deepreduce.codecs.index import golomb
from deepreduce.exchange.parallel import PARALLEL_ENTRIES, available_cores, run_in_order
from deepreduce.pipeline import decode

from benchmarks.common import RESULTS, mlp_shapes, table, write_report
from benchmarks.model_steps import resnet50_shapes


def gpt2_small_shapes(layers: int = 12, width: int = 768, vocabulary: int = 50257,
                      context: int = 1024) -> list[tuple[int, ...]]:
    """GPT-2 small's parameter shapes (Hugging Face's layout: Conv1D weights are
    ``(in, out)``): the token and position embeddings, per block two layer norms,
    the attention's input and output projections and the MLP's two, the final norm."""
    block = [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,),
             (width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width), (width,)]
    return [(vocabulary, width), (context, width)] + block * layers + [(width,), (width,)]


MODELS = {"ResNet-50": resnet50_shapes, "GPT-2 small": gpt2_small_shapes,
          "MLP 4096x4": lambda: mlp_shapes(hidden=4096, layers=4)}


def step(exchanges, names, grads, every_payload: bool):
    """One step of rank 0 among ``len(exchanges)`` ranks: ``(bundles, sums, codec, encode
    codec, decode codec)``, the times in seconds. ``every_payload``: the small payloads'
    codings on the threads too (they stay on the caller's otherwise)."""
    least = gathering.PARALLEL_ENTRIES, gathering.PARALLEL_BYTES
    if every_payload:
        gathering.PARALLEL_ENTRIES = gathering.PARALLEL_BYTES = 0
    try:
        bundles = [ex.encode_bundle(names, g) for ex, g in zip(exchanges, grads)]
        # (the step is open until its decode: what the encode recorded so far)
        encoded = exchanges[0].stats._pending.codec_seconds
        sums = exchanges[0].decode_bundles(bundles, ranks=len(exchanges), rank=0)
    finally:
        gathering.PARALLEL_ENTRIES, gathering.PARALLEL_BYTES = least
    codec = exchanges[0].stats.last.codec_seconds
    return bundles, sums, codec, encoded, codec - encoded


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def machine_busy() -> float:
    """Seconds of CPU this machine has spent (every process), from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(f) for f in stat.readline().split()[1:]]
    return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")


def scheduling() -> str:
    """This process's nice value, and its scheduling group's where Linux groups them."""
    grouped = ""
    try:
        with open("/proc/self/autogroup") as group:
            # "/autogroup-238 nice 0"; some kernels and containers leave it empty
            fields = group.read().split()
    except OSError:
        fields = []
    if fields:
        grouped = f", its group's {fields[-1]}"
    return f"nice {os.nice(0)}{grouped}"


def index_sets(bundle: bytes) -> list[np.ndarray]:
    """The index set of every payload of ``bundle``."""
    return [decode(payload).indices for payload in split_bundles(bundle, 1)[0].payloads]


def golomb_seconds(sets, threads: int) -> float:
    """Seconds to Golomb-code ``sets`` on ``threads`` threads: code whose every pass runs
    without the GIL, the most a number of threads can gain on this machine now."""
    begin = time.perf_counter()
    run_in_order(lambda indices: golomb.IndexStream(indices, 64), sets, threads, cost=len)
    return time.perf_counter() - begin


def handover_speedups(threads: int, pieces=(1, 4, 16), items: int = 10,
                      repeats: int = 30) -> dict:
    """The speed-up of ``threads`` threads over one on synthetic items of the same work
    (1,200 additions in Python, then ``zlib.crc32`` of 200 KB, which releases the GIL) cut into
    ``pieces`` parts each, so that an item hands the GIL over that many times: what the
    hand-overs cost on this machine, apart from any codec. Medians of ``repeats``."""
    speedups = {}
    for count in pieces:
        data, loops = bytes(200_000 // count), 1200 // count

        def item(_):
            for _ in range(count):
                total = 0
                for i in range(loops):
                    total += i
                zlib.crc32(data)

        times = {1: [], threads: []}
        for _ in range(repeats):
            for setting in times:
                begin = time.perf_counter()
                run_in_order(item, range(items), setting)
                times[setting].append(time.perf_counter() - begin)
        speedups[count] = statistics.median(times[1]) / statistics.median(times[threads])
    return speedups


def measure(model: str, threads: int, ranks: int, steps: int) -> dict:
    shapes = MODELS[model]()
    names = [f"p{i}" for i in range(len(shapes))]
    rng = np.random.default_rng(0)
    grads = [[rng.standard_normal(shape).astype(np.float32) for shape in shapes]
             for _ in range(ranks)]
    # (threads, every payload on them)
    settings = ((1, False), (threads, False), (threads, True))
    exchanges = {t: [GradientExchange(codec_threads=t[0]) for _ in range(ranks)]
                 for t in settings}
    times = {t: [] for t in settings}
    sets, ceiling = None, {1: [], threads: []}
    start, busy, own = time.perf_counter(), machine_busy(), cpu_seconds()
    for i in range(steps + 2):  # two warm-up steps
        results = {t: step(exchanges[t], names, grads, t[1]) for t in settings}
        if sets is None:
            sets = index_sets(results[settings[0]][0][0])
        for count in ceiling:
            ceiling[count].append(golomb_seconds(sets, count))
        reference = results[settings[0]]
        for t in settings[1:]:
            assert results[t][0] == reference[0], "the bundles differ"
            assert all(np.array_equal(a, b) for a, b in zip(results[t][1], reference[1])), \
                "the sums differ"
        if i >= 2:
            for t in settings:
                times[t].append(results[t][2:])
    wall = time.perf_counter() - start
    others = (machine_busy() - busy - (cpu_seconds() - own)) / wall
    record = {"tensors": len(shapes), "parameters": int(sum(np.prod(s) for s in shapes)),
              "payloads": len(sets),
              "parallel_payloads": sum(len(s) >= PARALLEL_ENTRIES for s in sets),
              "bundle_bytes": len(reference[0][0]), "other_processes_cores": others,
              "settings": {}}
    one, more = (ceiling[count][2:] for count in (1, threads))
    record["gil_free_speedup_best"] = min(one) / min(more)
    record["gil_free_speedup_median"] = statistics.median(one) / statistics.median(more)
    codec_one = [c for c, _, _ in times[settings[0]]]
    for t in settings:
        codec = [c for c, _, _ in times[t]]
        record["settings"][f"{t[0]}{', every payload' if t[1] else ''}"] = {
            "codec_ms_best": 1e3 * min(codec), "codec_ms_median": 1e3 * statistics.median(codec),
            "encode_codec_ms_best": 1e3 * min(e for _, e, _ in times[t]),
            "decode_codec_ms_best": 1e3 * min(d for _, _, d in times[t]),
            "speedup_best": min(codec_one) / min(codec),
            "speedup_median": statistics.median(codec_one) / statistics.median(codec)}
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["ResNet-50", "MLP 4096x4"],
                        choices=list(MODELS))
    parser.add_argument("--threads", type=int, default=2, help="codec threads against 1")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per setting")
    parser.add_argument("--out", default=str(RESULTS / "codec_threads.md"))
    args = parser.parse_args(argv)

    record = {"cores": available_cores(), "ranks": args.ranks, "steps": args.steps,
              "threads": args.threads, "models": {}}
    record["handover_speedups"] = handover_speedups(args.threads)
    rows = []
    for model in args.models:
        result = record["models"][model] = measure(model, args.threads, args.ranks, args.steps)
        for i, (t, s) in enumerate(result["settings"].items()):
            rows.append([model if i == 0 else "", t, f"{s['codec_ms_best']:.2f}",
                         f"{s['codec_ms_median']:.2f}", f"{s['encode_codec_ms_best']:.2f}",
                         f"{s['decode_codec_ms_best']:.2f}", f"{s['speedup_best']:.2f}x",
                         f"{s['speedup_median']:.2f}x"])
        rows.append(["", f"{args.threads}, GIL-free reference", "", "", "", "",
                     f"{result['gil_free_speedup_best']:.2f}x",
                     f"{result['gil_free_speedup_median']:.2f}x"])
    models = "; ".join(
        f"{m}: {r['tensors']} tensors, {r['parameters']:,} parameters in {r['payloads']} "
        f"payloads, {r['parallel_payloads']} of them of {PARALLEL_ENTRIES:,} entries or more "
        "(the others stay on the caller's thread but in the 'every payload' rows), "
        f"a bundle of {r['bundle_bytes']:,} bytes, other processes used "
        f"{r['other_processes_cores']:.2f} cores during the run"
        for m, r in record["models"].items())
    lines = [
        f"# Codec threads: a bundle's codec time on 1 thread and on {args.threads}",
        "",
        f"`python -m benchmarks.codec_threads` on {platform.machine()}, {available_cores()} "
        f"cores, {time.strftime('%Y-%m-%d')}. Gaussian gradients, the default exchange (Top-k "
        "1% with error feedback, `auto` indices, fp16 values); rank 0 encodes its bundle and "
        f"decodes the {args.ranks} ranks' (its own payloads reused). Codec time: "
        "`StepStats.codec_seconds`, the wall time of the bundle's codings and of the "
        f"decodings; best and median of {args.steps} steps per setting, the settings taking "
        f"turns. Every step gave the same bundles and sums with either setting. The GIL-free "
        "reference, timed at each step too, is the Golomb coding of the bundle's index sets "
        f"alone on 1 thread and on {args.threads} (one compiled pass each, without the GIL): "
        "the most more threads could gain on this machine while the benchmark ran. Run at "
        f"{scheduling()}. {models}.",
        "",
        "What a hand-over of the GIL costs here: synthetic items of 1,200 additions in "
        "Python and a `zlib.crc32` of 200 KB (which releases the GIL), cut so that each "
        "hands the GIL "
        f"over 1, 4 or 16 times, gained on {args.threads} threads "
        + ", ".join(f"{speedup:.2f}x ({count})" for count, speedup
                    in record["handover_speedups"].items())
        + " (medians): the fewer hand-overs a payload's coding makes, the more threads gain.",
        "",
        *table(["model", "codec threads", "codec ms (best)", "codec ms (median)",
                "encode codecs ms", "decode codecs ms", "speed-up (best)",
                "speed-up (median)"], rows, right_aligned=True),
        "",
    ]
    out = write_report(args.out, "\n".join(lines), record)
    print("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
