"""The ``loop`` and ``framing`` parts of :mod:`benchmarks.outer` (issue 49): outer steps in
a real training loop across two hosts made here, blocking against overlapped and in
fragments; and the allgather's framing side by side under the DDP hook.

Two network namespaces joined by a shaped veth, as in :mod:`benchmarks.outer_time` (its
names and addresses), one gloo rank in each, one intra-op thread per rank.

* **loop**: each rank trains :mod:`benchmarks.outer_model`'s 3.3M-parameter byte
  transformer with AdamW on its own batches, an :class:`~deepreduce.torch.outer.
  OuterOptimizer` every ``H = 30`` inner steps, in the schemes of :data:`SCHEMES`
  (SparseLoCo and dense DiLoCo in float32, blocking, ``overlap`` 1 and 5, 4
  ``fragments`` with and without overlap), and the same loop with no outer step at all
  (the floor). Each scheme takes ``H`` inner steps of warm-up (its first outer step and
  the agreement), then ``--loop-periods`` periods of ``H`` timed. Per period: the wall
  time (the longer of the two ranks'), the loop's wait in ``outer.step()`` (every call:
  a blocking step, the start of an overlapped one and its merge), and the bytes across
  the veth.
* **framing**: DDP with deepreduce's hook (Top-1%, ``auto`` indices, fp16 values) on a
  1.8M-parameter MLP, three models stepping in turns whose transports frame their
  allgathers three ways (:attr:`deepreduce.torch.transport.TorchTransport.FRAMING`):
  ``padded`` (the longest recent frame and an eighth: the old way), ``exact`` (the
  lengths first, then every frame at its size) and ``model`` (the cost model's choice);
  per step the time inside the transport's allgathers, the step's wall time, and the
  bytes on the wire against the bundles'. And the round trip of a 16-byte allgather,
  which the cost model's default assumes.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import free_port, table
from benchmarks.hierarchical import TwoHosts, veth_bytes
from benchmarks.outer_time import ADDRESSES, NAMESPACES, PREFIX, VETH, WORLD

H = 30
SPARSELOCO = {"mode": "sparseloco"}
DENSE = {"mode": "diloco", "sparsifier": None, "value": "raw"}
#: ``(label, OuterOptimizer settings or None for the floor)``.
SCHEMES = [("no outer step (the floor)", None)] + [
    (f"{kind} {label}", {**base, **extra})
    for kind, base in (("SparseLoCo", SPARSELOCO), ("dense DiLoCo fp32", DENSE))
    for label, extra in (("blocking", {}), ("overlap 1", {"overlap": 1}),
                         ("overlap 5", {"overlap": 5}), ("fragments 4", {"fragments": 4}),
                         ("fragments 4, overlap 5", {"fragments": 4, "overlap": 5}))]
POLICIES = ("padded", "exact", "model")


def _all_gather_single(out, local):
    """One collective into one tensor (torch 2.13 renamed all_gather_into_tensor)."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local)


# -- the ranks -----------------------------------------------------------------------------

#: Where a timed period starts, past a multiple of H: no exchange is in flight there in
#: any scheme (the outer steps start at 0, 7, 15, 22 mod 30 and overlap at most 5 steps),
#: so the schemes can take their periods in turns, each its own exchanges' overlap.
PERIOD_START = 6


def loop_worker(args) -> dict:
    import torch
    import torch.distributed as dist

    from benchmarks.outer_model import build_model, next_byte_loss, text_splits, training_batch
    from deepreduce.torch.outer import OuterOptimizer

    rank = dist.get_rank()
    train, _ = text_splits(args.text_bytes)
    runs = {}
    for label, settings in SCHEMES:
        model = build_model(seed=0)
        group = dist.new_group(list(range(WORLD)))  # (transports of its own, per scheme)
        runs[label] = dict(
            model=model, step=0, walls=[], waits=[], wires=[], exchanges=[],
            inner=torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95)),
            outer=None if settings is None else OuterOptimizer(
                model.named_parameters(), sync_every=H, process_group=group, **settings))

    def period(run, steps: int, timed: bool) -> None:
        model, inner, outer = run["model"], run["inner"], run["outer"]
        dist.barrier()
        before, began, wait, started = veth_bytes(), time.perf_counter(), [], 0
        for _ in range(steps):
            x, y = training_batch(train, run["step"], rank, 0, 4, model.sequence)
            next_byte_loss(model, x, y).backward()
            inner.step()
            inner.zero_grad()
            run["step"] += 1
            if outer is not None:
                t0 = time.perf_counter()
                started += outer.step()
                wait.append(time.perf_counter() - t0)
        elapsed = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        after = veth_bytes()
        assert outer is None or not outer.in_flight, "a period ended with an exchange in flight"
        if timed:
            run["walls"].append(float(elapsed))
            run["waits"].append(float(np.sum(wait)))
            run["exchanges"].append(started)
            run["wires"].append(None if before is None else after - before)

    labels = [label for label, _ in SCHEMES]
    for label in labels:  # warm-up: the first outer step (agreement, groups) and its merge
        period(runs[label], H + PERIOD_START, timed=False)
    for turn in range(args.loop_periods):  # then the schemes' periods in turns
        for label in labels[turn % len(labels):] + labels[:turn % len(labels)]:
            period(runs[label], H, timed=True)
    found = {}
    for label in labels:
        run, outer = runs[label], runs[label]["outer"]
        if outer is not None:
            outer.sync()
        total = None if outer is None else outer.stats.total
        found[label] = {k: run[k] for k in ("walls", "waits", "wires", "exchanges")}
        found[label].update(sent=None if total is None else total.bytes_sent / total.steps,
                            bundle=None if total is None else total.bundle_bytes / total.steps)
        if rank == 0:
            print(f"    {label}: {np.median(run['walls']):.2f} s per {H} inner steps, wait "
                  f"{np.median(run['waits']):.3f} s", flush=True)
    return found


def framing_worker(args) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import deepreduce as dr
    import deepreduce.torch as drt

    rank = dist.get_rank()
    # the round trip of a small allgather, what the cost model's default assumes
    probe, out = torch.zeros(16, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)
    trips = []
    for _ in range(100):
        began = time.perf_counter()
        _all_gather_single(out, probe)
        trips.append(time.perf_counter() - began)
    runs = {}
    for policy in POLICIES:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(),
                                  torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                  torch.nn.Linear(1024, 256))
        group = dist.new_group(list(range(WORLD)))
        model = DDP(net, process_group=group)
        state = drt.DeepReduceState(process_group=group, sparsifier=dr.TopK(0.01),
                                    index="auto", value="fp16")
        model.register_comm_hook(state, drt.deepreduce_hook)
        runs[policy] = dict(model=model, state=state, opt=torch.optim.SGD(
            model.parameters(), lr=0.01), spent=[0.0], steps=[], allgather=[], sent=[],
            bundle=[])
    generator, frames = torch.Generator().manual_seed(rank), []
    for step in range(args.framing_steps + 10):
        for policy in POLICIES[step % 3:] + POLICIES[:step % 3]:
            run = runs[policy]
            x = torch.randn(64, 512, generator=generator)
            before = run["state"].stats.snapshot()
            dist.barrier(group=run["model"].process_group)
            began = time.perf_counter()
            run["spent"][0] = 0.0
            run["model"](x).square().mean().backward()
            run["opt"].step()
            run["opt"].zero_grad()
            elapsed = time.perf_counter() - began
            if step == 0:  # the transport exists now: frame it this policy's way
                transport = run["state"].transport
                transport.FRAMING = policy
                inner, spent = transport.allgather, run["spent"]

                def timed(frame, traffic, stage, inner=inner, spent=spent, policy=policy):
                    if policy == "model":  # the frames the replay sends again
                        frames.append((stage, len(frame)))
                    t0 = time.perf_counter()
                    try:
                        return inner(frame, traffic, stage)
                    finally:
                        spent[0] += time.perf_counter() - t0
                transport.allgather = timed
            if step >= 10:
                done = run["state"].stats.snapshot() - before
                run["steps"].append(elapsed)
                run["allgather"].append(run["spent"][0])
                run["sent"].append(done.bytes_sent)
                run["bundle"].append(done.bundle_bytes)
    replay = _replay(frames[len(frames) // 4:])
    return dict(round_trip=trips, replay=replay, frames=len(frames),
                runs={policy: {k: v for k, v in run.items()
                                                 if k in ("steps", "allgather", "sent",
                                                          "bundle")}
                                        for policy, run in runs.items()})


def _replay(frames) -> dict:
    """The allgathers of ``frames`` (``(stage, length)`` of this rank's, in the hook's
    order) sent again by three transports of their own, framing each way, in turns,
    the ranks meeting at a barrier before each: ``{policy: [seconds of each]}``."""
    import torch.distributed as dist

    from deepreduce.collectives import Traffic
    from deepreduce.torch.transport import TorchTransport

    transports = {}
    for policy in POLICIES:
        transports[policy] = TorchTransport.private(dist.new_group(list(range(WORLD))))
        transports[policy].FRAMING = policy
    seconds = {policy: [] for policy in POLICIES}
    payload = np.random.default_rng(dist.get_rank()).integers(0, 256, 1 << 22, np.uint8)
    for i, (stage, length) in enumerate(frames * 2):  # (the first pass: the history)
        for policy in POLICIES[i % 3:] + POLICIES[:i % 3]:
            transport = transports[policy]
            dist.barrier()
            began = time.perf_counter()
            transport.allgather(payload[:length].tobytes(), Traffic(), stage)
            if i >= len(frames):
                seconds[policy].append(time.perf_counter() - began)
    return seconds


def worker(args) -> None:
    """One rank of the part ``args.part``: its place comes from the environment."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    found = (loop_worker if args.part == "loop" else framing_worker)(args)
    if dist.get_rank() == 0:
        Path(args.worker_out).write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # before the interpreter finalises (pytorch#179291), as the torch tests


# -- the driver ----------------------------------------------------------------------------

def run(args, part: str) -> dict:
    """Every rate of ``args.rates`` across the two namespaces: the ranks' findings."""
    from benchmarks.e2e import NetnsError, check_rights

    try:
        check_rights()
    except NetnsError as exc:
        return {"skipped": str(exc)}
    record = {"rates": []}
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    with TwoHosts(NAMESPACES, VETH, ADDRESSES, PREFIX) as net:
        for rate in rates:
            net.shape(rate)
            load = os.getloadavg()[0]
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "worker.json"
                print(f"{part}: {rate}", flush=True)
                net.run_ranks(["benchmarks.outer", "--loop-worker", part, "--worker-out",
                               str(out), "--loop-periods", str(args.loop_periods),
                               "--framing-steps", str(args.framing_steps),
                               "--text-bytes", str(args.text_bytes)], free_port(), 1800)
                found = json.loads(out.read_text())
            record["rates"].append(dict(rate=rate, load=(load, os.getloadavg()[0]), **found))
    return record


# -- the report ----------------------------------------------------------------------------

def _med(values):
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else float("nan")


def loop_section(record) -> list:
    lines = ["## The outer step in a training loop: blocking, overlapped, in fragments", ""]
    if "skipped" in record:
        return lines + [f"Not run here: {record['skipped']}.", ""]
    lines += ["Two network namespaces joined by a veth shaped by tc to each rate, one gloo "
              "rank in each (one intra-op thread), each training `benchmarks.outer_model`'s "
              f"3.3M-parameter byte transformer with AdamW on its own batches, H = {H}. "
              "Per scheme: H + 6 inner steps of warm-up (the first outer step, its agreement "
              "and merge), then timed periods of H inner steps, each starting 6 steps past a "
              "multiple of H (where no scheme has an exchange in flight), the schemes "
              "taking their periods in turns, the order rotating, so that they share the "
              "machine's load alike (medians over the periods). *Wall per H*: the longer "
              "rank's wall time for H inner steps, against the floor (the same loop with "
              "no outer step). *Wait per H*: the loop's time inside `outer.step()` (a "
              "blocking step whole; with overlap, the start and the merge, which waits if "
              "the exchange is not done). "
              "*Wait per outer step*: the same per exchange started (4 fragments: 4 "
              "exchanges per H). Bytes: what the veth carried per H, both directions, "
              "TCP/IP included; `stats.bytes_sent` and the bundle per exchange. The two "
              "ranks share this machine's 2 cores with each other and with other jobs "
              "(load average beside each rate): the background exchange competes with "
              "the inner steps for them, which two hosts would not.", ""]
    for run in record["rates"]:
        floor = _med(run[SCHEMES[0][0]]["walls"])
        blocking = {kind: _med(run[f"{kind} blocking"]["waits"])
                    for kind in ("SparseLoCo", "dense DiLoCo fp32")}
        lines += [f"### {run['rate']} (load average {run['load'][0]:.1f} at the start, "
                  f"{run['load'][1]:.1f} at the end)", ""]
        rows = []
        for label, _ in SCHEMES:
            found = run[label]
            wall, wait = _med(found["walls"]), _med(found["waits"])
            exchanges = _med(found["exchanges"]) if found["exchanges"] else 0
            kind = next((k for k in blocking if label.startswith(k)), None)
            rows.append([label, f"{wall:.2f}", f"{wall / floor - 1:+.1%}",
                         f"{1e3 * wait:.0f}",
                         "" if not exchanges else f"{1e3 * wait / exchanges:.0f}",
                         "" if kind is None or not blocking[kind] else
                         f"{wait / blocking[kind]:.0%}",
                         f"{_med(found['wires']) / 1e6:.2f}",
                         "" if found["sent"] is None else f"{found['sent']:,.0f}",
                         "" if found["bundle"] is None else f"{found['bundle']:,.0f}"])
        lines += table(["scheme", "wall per H (s)", "vs floor", "wait per H (ms)",
                        "wait per outer step (ms)", "wait vs blocking", "MB on the veth per H",
                        "bytes_sent per exchange", "bundle per exchange"], rows)
        lines += [""]
    return lines


def framing_section(record) -> list:
    lines = ["## Framing of the allgather under the DDP hook, side by side", ""]
    if "skipped" in record:
        return lines + [f"Not run here: {record['skipped']}.", ""]
    lines += ["DDP with `DeepReduceState(sparsifier=TopK(0.01), index='auto', value='fp16')` "
              "on a 1.8M-parameter MLP (512-1024-1024-256, batch 64), two ranks across the "
              "veth, three models stepping in turns whose transports frame the "
              "variable-length allgather three ways: `padded`, every frame in a slot of the "
              "longest recent frame and an eighth (what the transport did before); `exact`, "
              "the lengths first, then every frame at its exact size (two collectives); "
              "`model`, the slot the cost model picks (`cost.slot_capacity`, at its default "
              "network: 0.3 ms a collective and 1 Gbit/s). Medians per step; *allgather ms*: "
              "the time inside the transport's allgathers (on the communication thread, "
              "waiting for the other rank included); "
              "bytes: `stats.bytes_sent` (what the rank handed to the process group) and "
              "the bundles'.", ""]
    for run in record["rates"]:
        trip = 1e6 * _med(run["round_trip"])
        lines += [f"### {run['rate']} (load average {run['load'][0]:.1f} / "
                  f"{run['load'][1]:.1f}); round trip of a 16-byte allgather: {trip:.0f} us",
                  ""]
        rows = []
        for policy in POLICIES:
            found = run["runs"][policy]
            sent, bundle = _med(found["sent"]), _med(found["bundle"])
            replay = run["replay"][policy]
            rows.append([policy, f"{1e3 * _med(replay):.3f}", f"{1e3 * np.mean(replay):.3f}",
                         f"{1e3 * _med(found['allgather']):.2f}",
                         f"{1e3 * _med(found['steps']):.1f}", f"{sent:,.0f}",
                         f"{bundle:,.0f}", f"{sent / bundle - 1:.2%}"])
        lines += table(["framing", "replayed allgather ms (median)", "(mean)",
                        "allgather ms per step, in the hook", "step ms", "bytes_sent per step",
                        "bundle bytes per step", "on the wire beyond the bundles"], rows)
        fastest = min(POLICIES, key=lambda p: np.mean(run["replay"][p]))
        lines += ["", f"The replay: the hook's last {run['frames'] * 3 // 4} allgathers (their "
                  "stages and this rank's lengths, recorded under `model`) sent again by "
                  "three transports of their own, in turns, the ranks meeting at a barrier "
                  "before each, after one pass that builds each transport's history: the "
                  "framing alone, without the hook's waiting for the other rank's encoding. "
                  f"Fastest on the mean: `{fastest}`.", ""]
    return lines
