"""Nodes of 8 ranks: two link classes and the hierarchical scheme, a section of scale.md.

The step-time model of :mod:`benchmarks.scale_model` (calibrated as :mod:`benchmarks.scale`
says) predicts nodes of 8 ranks with two link classes (``cluster_cost.Cluster``: an
intra-node link per rank, one network port per node) for P = 8 ... 1024: the dense
ring, a dense hierarchical allreduce, PowerSGD rank 1 (network only), deepreduce's flat
allgather and ``communicator="hierarchical"`` with allgather or sparse_allreduce between
nodes, for the MLP and for ResNet-50's size. When ``benchmarks/results/hierarchical.json``
(``python -m benchmarks.hierarchical``: two namespaces of two ranks) is there, the model
set to that topology is checked against it: the bytes across the veth at every rate,
and the steps at the rates its 10 Gbit/s run did not calibrate (target 25%).

Run by ``python -m benchmarks.scale``, which writes the whole report.
"""

from __future__ import annotations

import json
import math

from deepreduce.collectives import cost

from benchmarks import cluster_cost
from benchmarks.common import RESULTS, mlp_shapes, table
from benchmarks.scale_model import (FIT_RATE, RATIO, RUNS, TARGET, VALUE_BYTES, bandwidth,
                                    calibrate, core_share, load)

HIERARCHICAL = RESULTS / "hierarchical.json"
LOCAL_SIZE = 8
NODE_P = [8, 16, 32, 64, 128, 256, 512, 1024]
INTRA_GBYTE = [100, 200]
INTER_GBIT = [10, 25, 100]
#: Seconds per message on each link class (a message inside a node through shared memory
#: or NVLink; one across a datacenter network over TCP).
INTRA_LATENCY, INTER_LATENCY = 5e-6, 20e-6
#: The schemes of the section on nodes: name, and whether its wire overlaps its CPU work.
NODE_SCHEMES = {"dense ring": False, "dense hierarchical": False, "PowerSGD rank 1": False,
                "deepreduce allgather": True, "hierarchical, allgather between nodes": False,
                "hierarchical, sparse_allreduce between nodes": False}
#: The torch_e2e labels of the two-host run (benchmarks.hierarchical) by scheme of the model.
TWO_HOST = {"dense ring": "DDP allreduce fp32", "PowerSGD rank 1": "PowerSGD rank 1 (one bucket)",
            "deepreduce allgather": "deepreduce Top-k 1% + auto + fp16 (allgather)",
            "hierarchical, allgather between nodes":
                "deepreduce Top-k 1% + auto + fp16 (hierarchical)"}


def resnet50_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of ResNet-50 (25,557,032 parameters): convolutions, batch norms'
    weights and biases, and the classifier."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    cin = 64
    for width, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3)):
        for b in range(blocks):
            for cout, cin_, kernel in ((width, cin, 1), (width, width, 3), (4 * width, width, 1)):
                shapes += [(cout, cin_, kernel, kernel), (cout,), (cout,)]
            if b == 0:  # the projection of the shortcut
                shapes += [(4 * width, cin, 1, 1), (4 * width,), (4 * width,)]
            cin = 4 * width
    return shapes + [(1000, 2048), (1000,)]


def node_stages(scheme, P, n, pair_bytes, shapes):
    """The :class:`cluster_cost.Stage` list of ``scheme`` at ``P`` ranks, :data:`LOCAL_SIZE` per node."""
    k = RATIO * n
    if scheme == "dense ring":
        return cluster_cost.flat_stages("dense", P, LOCAL_SIZE, n, 0, 0)
    if scheme == "dense hierarchical":
        return cluster_cost.hierarchical_stages(P, LOCAL_SIZE, n, 0, 0, inter="dense")
    if scheme == "PowerSGD rank 1":  # two ring allreduces: P, then Q
        elements = cluster_cost.powersgd_elements(shapes)
        return [cluster_cost.flat_stage("dense", P, LOCAL_SIZE, cost.dense_allreduce(P, elements, 4)
                                .received, 2 * cluster_cost.messages_per_rank("dense", P))]
    if scheme == "deepreduce allgather":
        return cluster_cost.flat_stages("allgather", P, LOCAL_SIZE, n, k, pair_bytes["allgather"])
    inter = scheme.split(", ")[1].split()[0]
    return cluster_cost.hierarchical_stages(P, LOCAL_SIZE, n, k, pair_bytes[inter], inter=inter,
                                    value_bytes=VALUE_BYTES)


def node_cpu(scheme, model, P, scale):
    """CPU seconds of the exchange on one core per rank, the calibrated terms times
    ``scale`` (the model's elements over the calibration's); None where not calibrated."""
    nodes = P // LOCAL_SIZE
    terms = {s: (scale * m["cpu_fixed"], scale * max(m["cpu_per_peer"], 0.0))
             for s, m in model.items()}
    dense = terms["dense"]
    if scheme == "dense ring":
        return dense[0] + (P - 1) * dense[1]
    if scheme == "dense hierarchical":
        return cluster_cost.hierarchical_cpu(LOCAL_SIZE, nodes, *dense, *dense)
    if scheme == "deepreduce allgather":
        return terms["allgather"][0] + (P - 1) * terms["allgather"][1]
    if scheme.startswith("hierarchical"):
        inter = scheme.split(", ")[1].split()[0]
        return cluster_cost.hierarchical_cpu(LOCAL_SIZE, nodes, *terms[inter], *dense)
    return None  # PowerSGD: not in the calibration runs


def nodes_grid(model, n, shapes, n_cal, with_cpu):
    """``{(intra GB/s, inter Gbit/s): {P: {scheme: seconds}}}``: the exchange's seconds
    beyond the compute-only step (its CPU work too when ``with_cpu``)."""
    pair_bytes = {s: m["pair_bytes"] for s, m in model.items()}
    grid = {}
    for intra in INTRA_GBYTE:
        for inter in INTER_GBIT:
            cluster = cluster_cost.Cluster(LOCAL_SIZE, cluster_cost.Link(intra * 1e9, INTRA_LATENCY),
                                   cluster_cost.Link(bandwidth(inter), INTER_LATENCY))
            by_p = grid[intra, inter] = {}
            for P in NODE_P:
                times = by_p[P] = {}
                for scheme, overlap in NODE_SCHEMES.items():
                    stages = node_stages(scheme, P, n, pair_bytes, shapes)
                    cpu = node_cpu(scheme, model, P, n / n_cal) if with_cpu else 0.0
                    if cpu is not None:
                        times[scheme] = cluster_cost.step_on(cluster, stages, 0.0, cpu, overlap)
    return grid


def winners(grid) -> list[str]:
    """Per pair of links, the fastest scheme as P grows."""
    lines = []
    for (intra, inter), by_p in grid.items():
        best = [(P, min(times, key=times.get)) for P, times in by_p.items()]
        runs = [f"{best[0][1]} at P = {best[0][0]}"] + [
            f"{b} from P = {p}" for (_, a), (p, b) in zip(best, best[1:]) if a != b]
        lines.append(f"- intra {intra} GB/s, inter {inter} Gbit/s: " + "; ".join(runs))
    return lines


def grid_table(grid, intra) -> list[str]:
    schemes = list(next(iter(next(iter(grid.values())).values())))
    rows = []
    for (a, inter), by_p in grid.items():
        if a != intra:
            continue
        for P, times in by_p.items():
            best = min(times, key=times.get)
            rows.append([str(inter), str(P)] + [
                f"**{1e3 * times[s]:.1f}**" if s == best else f"{1e3 * times[s]:.1f}"
                for s in schemes])
    return table(["inter Gbit/s", "P"] + schemes, rows)


# -- the check against two hosts of two ranks (benchmarks.hierarchical) ------------------------

def two_host_model(data, scheme, pair_bytes):
    """``(stages, cluster)`` of ``scheme`` on the two namespaces of ``data``'s run at
    ``rate``: the veth is the nodes' shared port, loopback the link inside."""
    args, n = data["args"], data["runs"][0]["results"][0]["params"]
    P, local = data["world"], data["local_size"]
    if scheme == "dense ring":
        stages = cluster_cost.flat_stages("dense", P, local, n, 0, 0)
    elif scheme == "PowerSGD rank 1":
        elements = cluster_cost.powersgd_elements(mlp_shapes(args["hidden"], args["layers"]))
        stages = [cluster_cost.flat_stage("dense", P, local, cost.dense_allreduce(P, elements, 4)
                                  .received, 2 * cluster_cost.messages_per_rank("dense", P))]
    elif scheme == "deepreduce allgather":
        stages = cluster_cost.flat_stages("allgather", P, local, n, RATIO * n, pair_bytes)
    else:
        stages = cluster_cost.hierarchical_stages(P, local, n, RATIO * n, pair_bytes,
                                          value_bytes=VALUE_BYTES)
    return stages


def composed_cpu(data) -> dict:
    """CPU ms of the flat allgather and the hierarchical step in ``data``'s run as the
    cluster section composes them from the torch_e2e calibration (model elements and
    core sharing scaled)."""
    runs = {P: load(P) for P in (2, 4)}
    model, n_cal = calibrate(runs), runs[2][FIT_RATE]["params"]
    n, P, local = data["runs"][0]["results"][0]["params"], data["world"], data["local_size"]
    scale, share = n / n_cal, core_share(P, data["runs"][0]["cores"])
    terms = {s: (scale * m["cpu_fixed"], scale * max(m["cpu_per_peer"], 0.0))
             for s, m in model.items()}
    flat = terms["allgather"][0] + (P - 1) * terms["allgather"][1]
    tiered = cluster_cost.hierarchical_cpu(local, P // local, *terms["allgather"], *terms["dense"])
    return {"deepreduce allgather": 1e3 * share * flat,
            "hierarchical, allgather between nodes": 1e3 * share * tiered}


def two_host_check(data):
    """Rows ``[rate, scheme, quantity, measured, predicted, error]`` and the worst error:
    the bytes across the veth per step at every rate, and the step at the rates the
    calibration (the :data:`FIT_RATE` run: CPU work per scheme) did not see."""
    runs = {run["rate"]: run for run in data["runs"]}
    fit = runs[FIT_RATE]
    n = fit["results"][0]["params"]

    def by_scheme(run):
        by_label = {r["scheme"]: r for r in run["results"]}
        compute = next(r for r in run["results"] if r["kind"] == "none")
        return {s: by_label[label] for s, label in TWO_HOST.items()}, \
            compute["step_ms_median"] / 1e3

    # bytes per sent element of deepreduce's payloads: the flat allgather's payload at 10 Gbit/s
    fitted, fit_compute = by_scheme(fit)
    pair_bytes = fitted["deepreduce allgather"]["bytes_sent"] / (RATIO * n)
    loop = cluster_cost.Link(bandwidth(data["loopback_gbit"]))

    def wire(scheme, run):
        cluster = cluster_cost.Cluster(data["local_size"], loop,
                                       cluster_cost.Link(bandwidth(run["measured_gbit"])))
        return cluster_cost.exchange_time(two_host_model(data, scheme, pair_bytes), cluster)

    cpu = {s: fitted[s]["step_ms_median"] / 1e3 - fit_compute
           - (0.0 if NODE_SCHEMES[s] else wire(s, fit)) for s in TWO_HOST}
    rows, worst = [], 0.0
    for rate, run in runs.items():
        measured, compute = by_scheme(run)
        for s in TWO_HOST:
            veth = 2 * sum(stage.inter for stage in two_host_model(data, s, pair_bytes))
            got = measured[s]["wire_bytes_per_step"]
            checks = [("MB across", got / 1e6, veth / 1e6)]
            if rate != FIT_RATE:
                step = cluster_cost.step_on(cluster_cost.Cluster(data["local_size"], loop, cluster_cost.Link(
                    bandwidth(run["measured_gbit"]))), two_host_model(data, s, pair_bytes),
                    compute, cpu[s], NODE_SCHEMES[s])
                checks.append(("step ms", measured[s]["step_ms_median"], 1e3 * step))
            for quantity, m, p in checks:
                error = p / m - 1
                worst = max(worst, abs(error))
                rows.append([rate, s, quantity, f"{m:.3f}" if quantity == "MB across"
                             else f"{m:.1f}", f"{p:.3f}" if quantity == "MB across"
                             else f"{p:.1f}", f"{100 * error:+.0f}%"])
    return rows, worst, {s: 1e3 * c for s, c in cpu.items()}, pair_bytes


def nodes_section(model, n, compute) -> list[str]:
    """The markdown of the prediction for nodes of :data:`LOCAL_SIZE` ranks; its figures
    (ms) go to ``results/scale/nodes.json``."""
    models = {"MLP": (n, mlp_shapes(1024, 3)), "ResNet-50": (None, resnet50_shapes())}
    grids = {}
    for name, (size, shapes) in models.items():
        size = size or sum(math.prod(s) for s in shapes)
        models[name] = (size, shapes)
        for with_cpu in (False, True):
            grids[name, with_cpu] = nodes_grid(model, size, shapes, n, with_cpu)
    resnet = models["ResNet-50"][0]
    (RUNS / "nodes.json").write_text(json.dumps(
        {f"{name} {'with CPU' if with_cpu else 'network only'}": {
            f"intra {a} GB/s, inter {b} Gbit/s": {str(P): {s: 1e3 * t for s, t in times.items()}
                                                   for P, times in by_p.items()}
            for (a, b), by_p in grid.items()} for (name, with_cpu), grid in grids.items()},
        indent=1) + "\n")
    lines = ["", f"## Prediction: nodes of {LOCAL_SIZE} ranks, two link classes", "",
             f"{LOCAL_SIZE} ranks per node, numbered node by node; each rank has an intra-node "
             f"link of its own ({' or '.join(map(str, INTRA_GBYTE))} GB/s each way, "
             f"{1e6 * INTRA_LATENCY:g} us a message: NVLink or PCIe), and the node one network "
             f"port ({', '.join(map(str, INTER_GBIT))} Gbit/s each way, "
             f"{1e6 * INTER_LATENCY:g} us a message) that its {LOCAL_SIZE} ranks share. "
             "The model is `cluster_cost.flat_stages`, `cluster_cost.hierarchical_stages` and "
             "`cluster_cost.step_on`:",
             "",
             "- **dense ring**: DDP's ring allreduce of float32 over all P ranks. With the ranks "
             f"numbered node by node, one of each {LOCAL_SIZE} hops of the ring leaves a node, so "
             "the port carries what one rank receives, 2 (P - 1) / P of the gradient, and the "
             "ring runs at the pace of that hop (2 (P - 1) messages).",
             "- **dense hierarchical**: a dense reduce-scatter inside the node, a ring allreduce "
             f"of each 1/{LOCAL_SIZE} shard among the P / {LOCAL_SIZE} ranks that hold it (the "
             f"port carries the {LOCAL_SIZE} rings at once), an allgather inside: about the same "
             "bytes through the port as the ring, in 2 (P/8 - 1) messages.",
             "- **PowerSGD rank 1**: two ring allreduces (P, then Q) of (rows + columns) floats "
             "per matrix and every element of the vectors (`cluster_cost.powersgd_elements`). Its CPU "
             "work was not part of the calibration runs, so it appears only in the network-only "
             "figures.",
             "- **deepreduce allgather**: the flat exchange of this section's calibration: a ring "
             "allgather of every rank's payload (Top-k 1%, the calibrated bytes per element): the "
             "port carries one rank's (P - 1) payloads.",
             "- **hierarchical, X between nodes**: `communicator=\"hierarchical\"`: (1) a dense "
             f"reduce-scatter inside the node ({LOCAL_SIZE - 1}/{LOCAL_SIZE} of the float32 "
             f"gradient per rank over the intra link), (2) X (allgather or sparse_allreduce) of "
             f"each shard (Top-k 1% of n / {LOCAL_SIZE} elements) among the P / {LOCAL_SIZE} "
             f"ranks holding it: the port carries the {LOCAL_SIZE} shards' exchanges, about "
             f"1/{LOCAL_SIZE} of the flat allgather's bytes; (3) an allgather of the reduced "
             "shards inside the node, each as positions and float32 values (the union of the "
             "nodes' random supports) or dense, whichever is smaller. The stages run one after "
             "the other, and after the CPU work (the implementation runs them, the error "
             "feedback and encoding on one communication thread).",
             "",
             "CPU: as in the section above, each rank has the CPU of one core of this machine "
             "(its calibrated terms at P = 2), scaled by the model's elements over the "
             f"calibration's ({n:,}) for the larger model. The hierarchical scheme's CPU work "
             "is composed from the flat terms (`cluster_cost.hierarchical_cpu`): a dense allreduce's "
             f"among {LOCAL_SIZE} ranks for the two stages inside the node, and the inter "
             f"communicator's, divided by {LOCAL_SIZE}, for a shard of 1/{LOCAL_SIZE} the size "
             "among P / 8 ranks. On a GPU node the selection and sums would run on the GPU and "
             "the CPU figures are what this implementation costs on host cores: the "
             "network-only figures (the CPU work taken as nil) show what the links alone favour. "
             "The per-peer CPU terms grow linearly with P, as above: the dense ring's "
             f"{1e3 * max(model['dense']['cpu_per_peer'], 0.0):.2f} ms per peer, a fit of "
             "two runs, becomes most of its time at P = 1024, which is why "
             "the dense hierarchical scheme (8 peers inside, P / 8 outside, on 1/8 of the "
             "gradient) overtakes it there; read those crossovers as the model's, not as "
             "measured. The two-host check below finds the hierarchical composition several "
             "times too low on this machine's shared cores (its dense stages cost more than a "
             "ring's reduction): read the hierarchical scheme's figures with the CPU terms as "
             "lower bounds.", "",
             f"Models: the MLP of the calibration ({n:,} parameters; compute-only step "
             f"{1e3 * compute:.1f} ms here, not included below) and ResNet-50 ({resnet:,} "
             "parameters: its shapes for PowerSGD). Times are the exchange's, in ms beyond the "
             "compute-only step; fastest in bold.", "",
             f"### The MLP, with this machine's CPU terms, intra {INTRA_GBYTE[0]} GB/s", ""]
    lines += grid_table(grids["MLP", True], INTRA_GBYTE[0])
    lines += ["", f"### ResNet-50, network only, intra {INTRA_GBYTE[0]} GB/s", ""]
    lines += grid_table(grids["ResNet-50", False], INTRA_GBYTE[0])
    lines += ["", "### Fastest scheme as P grows", ""]
    for (name, with_cpu), grid in grids.items():
        lines += [f"{name}, {'with the CPU terms' if with_cpu else 'network only'}:", ""]
        lines += winners(grid) + [""]
    return lines


def two_host_section() -> list[str]:
    """The markdown of the check against :data:`HIERARCHICAL`, or that it is pending."""
    lines = ["## Check: two hosts of two ranks (benchmarks.hierarchical)", ""]
    if not HIERARCHICAL.exists():
        return lines + [f"Pending: `{HIERARCHICAL.relative_to(RESULTS.parent.parent)}` is "
                        "absent (as root: `python -m benchmarks.hierarchical`, then "
                        "`python -m benchmarks.scale`).", ""]
    data = json.loads(HIERARCHICAL.read_text())
    if FIT_RATE not in {run["rate"] for run in data["runs"]}:
        return lines + [f"Pending: the run has no {FIT_RATE} rate to calibrate on.", ""]
    rows, worst, cpu, pair_bytes = two_host_check(data)
    composed = composed_cpu(data)
    verdict = "PASS" if worst <= TARGET else "FAIL"
    lines += [f"`benchmarks/results/hierarchical.json`: {data['world']} gloo ranks as two "
              f"network namespaces of {data['local_size']}, joined by a veth shaped by tc (the "
              "nodes' shared port: both ranks of a namespace cross it), loopback TCP inside "
              f"(one stream {data['loopback_gbit']:.1f} Gbit/s; the model's intra link), on "
              f"this machine's {data['runs'][0]['cores']} cores shared by the four ranks; "
              f"the MLP of {data['runs'][0]['results'][0]['params']:,} parameters. The model "
              "of the cluster section is set to this topology (P = 4, 2 per node). The bytes "
              "across the veth (both directions) come from the model alone, with the flat "
              f"allgather's {pair_bytes:.2f} bytes per sent element at {FIT_RATE}; the step "
              f"time from the {FIT_RATE} run's CPU work per scheme (its step less the "
              "compute-only step, and less the modelled wire time where the scheme does not "
              "overlap them: "
              + ", ".join(f"{s} {ms:.0f} ms" for s, ms in cpu.items())
              + "), the compute-only step measured at the same rate, and the link measured "
              "there. Whether each scheme overlaps its wire with its CPU work was set from "
              "the implementation before this check ran (only the flat allgather does). "
              f"Target: every figure within {TARGET:.0%}. Worst error {100 * worst:.0f}% "
              f"({verdict}).", ""]
    lines += table(["rate", "scheme", "quantity", "measured", "predicted", "error"], rows)
    hier, flat = "hierarchical, allgather between nodes", "deepreduce allgather"
    lines += ["", "Not part of the target, but what it says of the cluster section: its CPU "
              "work composed from the torch_e2e terms (`cluster_cost.hierarchical_cpu`, scaled to this "
              "model and to 4 ranks on 2 cores) would be "
              f"{composed[hier]:.0f} ms for the hierarchical step against the {cpu[hier]:.0f} ms "
              f"calibrated here, and {composed[flat]:.0f} ms for the flat allgather against "
              f"{cpu[flat]:.0f} ms. The flat terms carry over; the hierarchical composition "
              f"is {cpu[hier] / composed[hier]:.1f} times too low on this machine: its dense "
              "stages inside the node go through loopback TCP and numpy passes over the whole "
              "gradient on the cores the ranks share, far dearer than a ring allreduce's "
              "reduction. The cluster section's figures with the CPU terms therefore favour "
              "the hierarchical scheme; its network-only figures do not depend on this."]
    lines += ["", "The bytes the model leaves out are TCP/IP framing and gloo's own messages: "
              "a few percent on megabytes, more on PowerSGD's many small allreduces. The 100 "
              "Mbit/s step of the flat allgather is where the model's overlap of wire and CPU "
              "is least exact: the veth needs about half as long as its CPU work there.", ""]
    return lines
