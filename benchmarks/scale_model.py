"""The step-time model of :mod:`benchmarks.scale`: its inputs (the torch_e2e runs at
P = 2 and 4), its calibration and its prediction, which scale.py and
:mod:`benchmarks.scale_nodes` (the nodes-of-8 section of the same report) both use.

The model is :func:`deepreduce.collectives.cost.step_time`; how it is calibrated, and
why, is said in :mod:`benchmarks.scale`.
"""

from __future__ import annotations

import json

from deepreduce.collectives import cost

from benchmarks.common import RESULTS

RUNS = RESULTS / "scale"
RATIO = 0.01
#: Bytes per value of the compressed schemes' value codec (fp16): what a range sent dense
#: costs per element in sparse_allreduce.
VALUE_BYTES = 2.0
TARGET = 0.25
FIT_RATE = "10gbit"
#: The torch_e2e label of each scheme of the model.
LABELS = {
    "dense": "DDP allreduce fp32",
    "pairs": "raw Top-k pairs hook (torch.topk, int32 + fp32)",
    "allgather": "deepreduce Top-k 1% + auto + fp16 (allgather)",
    "sparse_allreduce": "deepreduce Top-k 1% + auto + fp16 (sparse_allreduce)",
    "block": "deepreduce block Top-k 1% of 256 + fp16 (block)",
}
#: Whether the scheme's wire time overlaps its CPU work (see cost.step_time).
OVERLAP = {scheme: scheme != "dense" for scheme in LABELS}


def load(P: int) -> dict:
    """``{rate: {"gbit": measured, "steps": {scheme: seconds}, "sent": {...}, "compute": s,
    "cores": the machine's}}``."""
    data = json.loads((RUNS / f"torch_p{P}.json").read_text())
    out = {}
    for run in data["runs"]:
        by_label = {r["scheme"]: r for r in run["results"]}
        compute = next(r for r in run["results"] if r["kind"] == "none")
        out[run["rate"]] = dict(
            gbit=run["measured_gbit"], compute=compute["step_ms_median"] / 1e3,
            params=compute["params"], cores=run["cores"],
            steps={s: by_label[label]["step_ms_median"] / 1e3 for s, label in LABELS.items()},
            spread={s: (by_label[label]["step_ms_q1"] / 1e3, by_label[label]["step_ms_q3"] / 1e3)
                    for s, label in LABELS.items()},
            sent={s: by_label[label]["bytes_sent"] for s, label in LABELS.items()},
            wire={s: by_label[label].get("wire_bytes_per_step") for s, label in LABELS.items()})
    return out


def core_share(P: int, cores: int) -> float:
    """How much longer CPU work takes at ``P`` ranks than at 2 on ``cores`` cores."""
    return max(1.0, P / cores) / max(1.0, 2 / cores)


def bandwidth(gbit: float) -> float:
    return gbit * 1e9 / 8


def calibrate(runs: dict) -> dict:
    """Per scheme: bytes per sent element, ``cpu_fixed`` and ``cpu_per_peer`` (seconds)."""
    two = runs[2]
    n = two[FIT_RATE]["params"]
    k = RATIO * n
    out = {}
    for scheme in cost.SCHEMES:
        pair_bytes = two[FIT_RATE]["sent"][scheme] / k
        cpu = {}
        for P, by_rate in runs.items():
            fit = by_rate[FIT_RATE]
            share = core_share(P, fit["cores"])
            # at 10 Gbit/s the hooks' CPU work outlasts the wire it overlaps; the ring
            # allreduce's reduction adds to its wire
            wire = 0.0 if OVERLAP[scheme] else \
                received(scheme, P, n, pair_bytes) * P / bandwidth(fit["gbit"])
            cpu[P] = (fit["steps"][scheme] - share * two[FIT_RATE]["compute"] - wire) / share
        per_peer = (cpu[4] - cpu[2]) / 2
        out[scheme] = dict(pair_bytes=pair_bytes, cpu_fixed=cpu[2] - per_peer,
                           cpu_per_peer=per_peer)
    return out


def received(scheme, P, n, pair_bytes) -> float:
    """Bytes one rank receives per step (:func:`cost.received_per_rank`, fp16 values)."""
    return cost.received_per_rank(scheme, P, n, RATIO * n, pair_bytes, value_bytes=VALUE_BYTES)


def predict(scheme, model, P, n, compute, gbit, shared_link, cpu_share=1.0) -> float:
    params = model[scheme]
    return cost.step_time(compute, params["cpu_fixed"], max(params["cpu_per_peer"], 0.0),
                          received(scheme, P, n, params["pair_bytes"]), P, bandwidth(gbit),
                          shared_link=shared_link,
                          cpu_share=cpu_share, overlap=OVERLAP[scheme])
