"""Where compression pays as ranks grow: a step-time model, checked against runs here.

The model (:func:`deepreduce.collectives.cost.step_time`) adds to the compute-only
step the longer of two parts that overlap (for the dense ring allreduce,
their sum): the exchange's CPU work,
``cpu_fixed + (P - 1) * cpu_per_peer`` (error feedback, selection, encoding,
then decoding and adding each other rank's part), and the wire time of the
bytes one rank receives (:func:`~deepreduce.collectives.cost.received_per_rank`: ring
allreduce, allgather, SparCML's split-allgather, OmniReduce's blocks, over
random supports).

Its inputs come from two runs of ``benchmarks/torch_e2e.py`` (PyTorch DDP,
gloo, the e2e MLP with 1024-wide layers, 2.2M parameters, Top-k 1%), at
P = 2 and P = 4 ranks and three rates each, as root::

    for P in 2 4; do python -m benchmarks.torch_e2e --ranks $P --hidden 1024 \\
        --steps 32 --rounds 8 --warmup 6 --start-iter 4 --schemes "allreduce fp32" \\
        "raw Top-k" "fp16 (allgather)" "(sparse_allreduce)" "(block)" \\
        --out benchmarks/results/scale/torch_p$P.md; done
    python -m benchmarks.scale

- bytes per sent element of each scheme: what a rank sent per step at P = 2
  (the traffic this predicts is checked against the bytes that crossed the
  loopback in every run);
- the CPU terms: from the 10 Gbit/s runs (where the hooks' CPU work hides
  the wire it overlaps), the step less the compute-only step (and, for the
  dense allreduce, whose reduction adds to its wire, less the modelled wire
  time), at P = 2 and P = 4 (two equations, two unknowns);
- the machine: all ranks share one shaped loopback (it carries ``P`` times
  what one rank receives) and its cores: with more ranks than cores, each gets
  cores / P of one, so the compute-only step and the CPU terms at P are those
  at P = 2 (a core each here) stretched by P / cores. The compute-only step
  measured at P = 4 is not used: four ranks that never wait for each other do
  not share two cores evenly, so its median moves far from run to run (the
  report says by how much in the calibration that showed it).

The 1 Gbit/s and 100 Mbit/s runs, which the fit never sees, check the model:
the target is every prediction within 25% of the measured median step. Then
the model predicts a cluster: one rank per node, each with its own
full-duplex link and its own cores, for P = 2 ... 256 and 0.1 ... 100 Gbit/s,
and names the fastest scheme in each cell and the crossovers.

Then the model predicts nodes of 8 ranks with two link classes and the hierarchical
scheme (:mod:`benchmarks.scale_nodes`, a section of the same report). Both use the
model's inputs, calibration and prediction from :mod:`benchmarks.scale_model`.

Writes ``benchmarks/results/scale.md`` and ``scale.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deepreduce.collectives import cost

from benchmarks.common import RESULTS, table, write_report
from benchmarks.scale_model import (FIT_RATE, TARGET, calibrate, core_share, load, predict,
                                    received)
from benchmarks.scale_nodes import nodes_section, two_host_section

NAMES = {"dense": "dense allreduce", "pairs": "raw Top-k pairs",
         "allgather": "deepreduce allgather", "sparse_allreduce": "deepreduce sparse_allreduce",
         "block": "deepreduce block"}
CLUSTER_P = [2, 4, 8, 16, 32, 64, 128, 256]
CLUSTER_GBIT = [0.1, 1, 10, 25, 100]


def validation(runs, model):
    rows, worst = [], 0.0
    for P, by_rate in sorted(runs.items()):
        for rate, run in by_rate.items():
            if rate == FIT_RATE:
                continue
            for scheme in cost.SCHEMES:
                measured = run["steps"][scheme]
                share = core_share(P, run["cores"])
                predicted = predict(scheme, model, P, run["params"],
                                    share * runs[2][rate]["compute"], run["gbit"],
                                    shared_link=True, cpu_share=share)
                error = predicted / measured - 1
                worst = max(worst, abs(error))
                q1, q3 = run["spread"][scheme]
                rows.append([str(P), rate, NAMES[scheme], f"{1e3 * measured:.1f}",
                             f"{1e3 * q1:.1f}-{1e3 * q3:.1f}", f"{1e3 * predicted:.1f}",
                             f"{100 * error:+.0f}%"])
    return rows, worst


def traffic(runs, model):
    """Rows of the check of the traffic part alone: the bytes that cross the shared
    loopback per step (every rank's, ``P`` times what one receives), predicted against
    measured (TCP framing and the collectives' own messages included; mean of the rates)."""
    rows = []
    for P, by_rate in sorted(runs.items()):
        n = by_rate[FIT_RATE]["params"]
        for scheme in cost.SCHEMES:
            measured = [run["wire"][scheme] for run in by_rate.values()
                        if run["wire"][scheme] is not None]
            if not measured:
                continue
            mean = sum(measured) / len(measured)
            predicted = received(scheme, P, n, model[scheme]["pair_bytes"]) * P
            rows.append([str(P), NAMES[scheme], f"{mean / 1e6:.3f}", f"{predicted / 1e6:.3f}",
                         f"{100 * (predicted / mean - 1):+.0f}%"])
    return rows


def cluster(model, n, compute):
    """``{gbit: {P: {scheme: seconds}}}`` for one rank per node, own link and cores."""
    return {gbit: {P: {s: predict(s, model, P, n, compute, gbit, shared_link=False)
                       for s in cost.SCHEMES} for P in CLUSTER_P} for gbit in CLUSTER_GBIT}


def crossovers(predicted) -> list[str]:
    """Where the fastest scheme changes as P grows, per rate."""
    lines = []
    for gbit, by_p in predicted.items():
        winners = [(P, min(times, key=times.get)) for P, times in by_p.items()]
        changes = [f"{NAMES[b]} from P = {p2}" for (p1, a), (p2, b) in zip(winners, winners[1:])
                   if a != b]
        first = NAMES[winners[0][1]]
        lines.append(f"- {gbit:g} Gbit/s: {first} at P = {winners[0][0]}"
                     + ("; " + "; ".join(changes) if changes else ", up to P = 256"))
    return lines


def plot(predicted, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=False)
    for ax, gbit in zip(axes, (1, 10, 100)):
        for scheme in cost.SCHEMES:
            ax.plot(CLUSTER_P, [1e3 * predicted[gbit][P][scheme] for P in CLUSTER_P],
                    marker="o", label=NAMES[scheme])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks P")
        ax.set_ylabel("predicted step (ms)")
        ax.set_title(f"{gbit:g} Gbit/s per node")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Predicted step time of the 2.2M-parameter MLP, Top-k 1%, one rank per node")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "scale.md")
    args = parser.parse_args(argv)
    runs = {P: load(P) for P in (2, 4)}
    model = calibrate(runs)
    rows, worst = validation(runs, model)
    n = runs[2][FIT_RATE]["params"]
    compute = runs[2][FIT_RATE]["compute"]
    cores = runs[2][FIT_RATE]["cores"]
    predicted = cluster(model, n, compute)
    verdict = "PASS" if worst <= TARGET else "FAIL"

    lines = ["# Where compression pays as ranks grow", "",
             "Written by `python -m benchmarks.scale` from `benchmarks/results/scale/"
             "torch_p2.json` and `torch_p4.json` (PyTorch DDP on gloo, the e2e MLP with "
             f"1024-wide layers: {n:,} parameters, Top-k 1%, fp16 values; see the script for "
             "the commands). The model is `deepreduce.collectives.cost.step_time`.", "",
             "## Calibration", "",
             f"From the {FIT_RATE} runs at P = 2 and P = 4: bytes per sent element (at P = 2), "
             "and the CPU work of the exchange per step, fixed and per other rank "
             "(the step less the compute-only step: at this rate the hooks' CPU work hides the "
             "wire it overlaps, and for the dense allreduce, whose reduction adds to its wire, "
             "less the modelled wire time too; the P = 4 run divided by its core sharing, "
             f"P / cores = {core_share(4, cores):g} on this machine's {cores} cores). The "
             f"compute-only step at P = 4 is taken as {core_share(4, cores):g} times that at "
             f"P = 2 ({1e3 * runs[2][FIT_RATE]['compute']:.1f} ms at {FIT_RATE}); measured, "
             "it came out at " + ", ".join(
                 f"{1e3 * run['compute']:.1f} ms at {rate}" for rate, run in runs[4].items())
             + " in these runs (see the script for why it is not used).", ""]
    lines += table(["scheme", "bytes per sent element", "CPU fixed ms", "CPU per peer ms"],
                   [[NAMES[s], f"{m['pair_bytes']:.2f}", f"{1e3 * m['cpu_fixed']:.1f}",
                     f"{1e3 * m['cpu_per_peer']:.2f}"] for s, m in model.items()])
    lines += ["", "A negative per-peer term (noise between two runs) would count as zero in "
              "the predictions.", "",
              "## Check: the runs the fit did not see", "",
              "All ranks on this machine share one shaped loopback, which the model "
              f"knows. Target: every prediction within {TARGET:.0%} of the measured median. "
              f"Worst error {100 * worst:.0f}% ({verdict}). A first model that added the "
              "hooks' wire time to their CPU work instead of overlapping them missed by up "
              "to 50% (at 100 Mbit/s, where the wire is longest); the overlap was chosen "
              "after seeing that, so these runs check the rest of the model, not that "
              "choice. Likewise the core sharing by P / cores replaced the compute-only step "
              "measured at P = 4 after a calibration in which that measurement came out at "
              "9.4 ms (quartiles 7.8-17.4) and the model missed by 36%; these runs were made "
              "after that change.", ""]
    lines += table(["P", "rate", "scheme", "measured ms", "quartiles ms", "predicted ms",
                    "error"], rows)
    lines += ["", "The traffic part alone: the bytes that crossed the shaped loopback per "
              "step (all ranks; TCP framing and the collectives' own messages included, so "
              "a few percent above the payloads), against the model's.", ""]
    lines += table(["P", "scheme", "measured wire MB per step", "predicted MB", "error"],
                   traffic(runs, model))
    lines += ["", "## Prediction: one rank per node, each with its own link and cores", "",
              f"Compute-only step {1e3 * compute:.1f} ms (as at P = 2 here); predicted step in "
              "ms, fastest in bold.", ""]
    cluster_rows = []
    for gbit, by_p in predicted.items():
        for P, times in by_p.items():
            best = min(times, key=times.get)
            cluster_rows.append([f"{gbit:g}", str(P)] + [
                (f"**{1e3 * t:.1f}**" if s == best else f"{1e3 * t:.1f}")
                for s, t in times.items()])
    lines += table(["Gbit/s", "P"] + [NAMES[s] for s in cost.SCHEMES], cluster_rows)
    lines += ["", "Fastest scheme as P grows:", ""] + crossovers(predicted)
    lines += ["", "![predicted step time against P](scale.png)", "",
              "What the model leaves out: overlap of the exchange with backward (the model "
              "adds it to the compute), tc's token bucket (bursts of 256 KB pass at once), "
              "per-message latency (tiny beside these volumes until P is in the hundreds), "
              "and correlated supports, whose unions are smaller than random ones (real "
              "Top-k supports overlap more, which favours sparse_allreduce and block). The "
              "per-peer CPU terms come from P = 2 and 4 alone and grow linearly in the "
              "predictions; sparse_allreduce's and block's work per peer should shrink as "
              "their ranges do (n / P), so beyond the measured P their curves are upper "
              "bounds. This is a 2.2M-parameter model whose exchange costs about 20 ms of "
              "CPU per step on this machine: a larger model, or faster codecs, move the "
              "crossovers to faster links.", ""]
    lines += nodes_section(model, n, compute)
    lines += two_host_section()
    text = "\n".join(lines) + "\n"
    print(text)
    write_report(args.out, text)
    plot(predicted, args.out.with_suffix(".png"))
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    raise SystemExit(main())
