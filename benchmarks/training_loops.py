"""Training loops as users run them: does each DDP scheme survive them?

Every scenario below runs on two gloo ranks (a fresh pair of spawned processes per
scenario and scheme, so that one cell's failure cannot leak into the next; a run that
has not ended within ``--timeout`` seconds is killed and reported as hanging) for
three schemes, each registered on the same loop:

``DDP allreduce``
    no comm hook: DDP's own bucketed allreduce (the reference);
``PowerSGD rank 1``
    ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` with
    ``PowerSGDState(process_group=None, matrix_approximation_rank=1,
    start_powerSGD_iter=2)`` (error feedback and warm start, its defaults). Its model
    gets one bucket (``bucket_cap_mb=4``, above the model's 1.35 MB): PowerSGD with
    several buckets in flight hangs on gloo here;
``deepreduce Top-1%``
    ``deepreduce.torch.deepreduce_hook`` with
    ``DeepReduceState(sparsifier="topk:0.01", start_iter=2)`` (``auto`` indices, fp16
    values, error feedback, the allgather communicator: its defaults) and DDP's
    default buckets.

The model is an MLP 128-512-512-16 (ReLU; 336,912 float32 parameters), trained with
SGD (lr 0.1, momentum 0.9) on synthetic data: each rank cycles through 4 batches of
32 Gaussian inputs from a generator seeded with its rank, labelled by a fixed random
linear teacher, so the loss falls within a few steps. Each scenario measures its pass
criterion in the run (the scenario's docstring, repeated in the report): a cell reads
``works`` only when what was measured says so. Besides its own criterion every
scenario asks that the loop ends on both ranks without an error, that the ranks end
with identical parameters (a SHA-256 of their bytes; DDP keeps them equal) and that the
model trains (the mean loss over the last 4 steps, one pass over the 4 batches, is at
least 1% below that over the first 4). A compressing scheme that never compressed
anything in the run is marked ``works (never compressed)``.

Writes ``benchmarks/results/training_loops.md`` and ``.json`` (a run of some scenarios
or schemes only prints its table, unless ``--out`` is given)::

    python -m benchmarks.training_loops                                   # everything
    python -m benchmarks.training_loops --only overflow,nan_one_rank --schemes deepreduce
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import io
import json
import math
import multiprocessing
import os
import pickle
import platform
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.common import RESULTS, free_port, table, write_report

SCHEMES = {"allreduce": "DDP allreduce", "powersgd": "PowerSGD rank 1",
           "deepreduce": "deepreduce Top-1%"}
IN, HIDDEN, OUT = 128, 512, 16
PARAMETERS = IN * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT
BATCH, POOL = 32, 4
LR, MOMENTUM = 0.1, 0.9
START_ITER = 2
POWERSGD_BUCKET_MB = 4
#: Wall-clock limit of one cell (both ranks, torch's import included) and the process
#: group's timeout; torch.compile's first compilation takes longer on two busy cores.
TIMEOUT_S, PG_TIMEOUT_S, COMPILE_TIMEOUT_S = 120, 60, 300
#: The dead-rank scenario's process-group timeout and the bound rank 0 must raise in.
DEAD_PG_TIMEOUT_S, DEAD_BOUND_S = 20, 60


# -- what every rank shares ---------------------------------------------------------------

def net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, OUT))


def batches(rank, steps, seed=0, dtype=None):
    """``steps`` (input, label) pairs cycling through this rank's pool of 4 batches."""
    teacher = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(1000 * seed + rank)
    pool = []
    for _ in range(POOL):
        x = torch.randn(BATCH, IN, generator=g)
        pool.append((x if dtype is None else x.to(dtype), (x @ teacher).argmax(1)))
    return [pool[i % POOL] for i in range(steps)]


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).float(), y)


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def nonfinite(module) -> bool:
    """Whether any gradient of ``module`` holds inf or NaN (each rank checks its own)."""
    return any(p.grad is not None and not bool(torch.isfinite(p.grad).all())
               for p in module.parameters())


def params_finite(module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in module.parameters())


def digest(module) -> str:
    """SHA-256 of the parameters' values (widened to float32 exactly, bf16 too)."""
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def make_state(scheme):
    if scheme == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        return powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                           start_powerSGD_iter=START_ITER)
    if scheme == "deepreduce":
        import deepreduce.torch as drt
        return drt.DeepReduceState(sparsifier="topk:0.01", start_iter=START_ITER)
    return None


def wrap(module, scheme, state=None, **ddp_options):
    """``(DDP(module), state)`` with ``scheme``'s hook registered (``state`` when given)."""
    if scheme == "powersgd":
        ddp_options.setdefault("bucket_cap_mb", POWERSGD_BUCKET_MB)
    ddp = DDP(module, **ddp_options)
    state = make_state(scheme) if state is None else state
    if scheme == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif scheme == "deepreduce":
        import deepreduce.torch as drt
        ddp.register_comm_hook(state, drt.deepreduce_hook)
    return ddp, state


def compressed(state, scheme):
    """Whether the scheme compressed anything in the run (None for plain allreduce)."""
    if scheme == "powersgd":
        return state.total_numel_after_compression < state.total_numel_before_compression
    if scheme == "deepreduce":
        return state.stats.total.compressed_tensors > 0
    return None


def train_step(ddp, opt, x, y, scale=1.0, skip_nonfinite=True):
    """One step; returns ``(loss, gradients were non-finite)``. A step whose gradients
    are not finite skips the optimizer, as GradScaler does."""
    opt.zero_grad()
    loss = loss_of(ddp, x, y)
    (loss * scale if scale != 1.0 else loss).backward()
    bad = nonfinite(ddp.module)
    if not (bad and skip_nonfinite):
        opt.step()
    return loss.item(), bad


def finish(ddp, state, scheme, losses, **found):
    """What every scenario reports besides its own findings."""
    return {"losses": [round(v, 5) for v in losses], "params": digest(ddp.module),
            "params_finite": params_finite(ddp.module),
            "compressed": compressed(state, scheme), **found}


# -- the scenarios, run on each rank --------------------------------------------------------

def run_overflow(rank, scheme):
    """Overflow step: at step 5 (compressing since step 2) the loss is multiplied by
    inf; every rank skips the optimizer step when any of its gradients is not finite.
    Works if both ranks saw step 5 as non-finite, every later step is finite and the
    model trains on (the last 4 steps' loss below the 4 before the overflow)."""
    ddp, state = wrap(net(), scheme)
    opt = sgd(ddp)
    losses, bad_steps = [], []
    for step, (x, y) in enumerate(batches(rank, 14)):
        loss, bad = train_step(ddp, opt, x, y, scale=math.inf if step == 5 else 1.0)
        losses.append(loss)
        if bad:
            bad_steps.append(step)
    return finish(ddp, state, scheme, losses, event=5, nonfinite_steps=bad_steps)


def run_gradscaler(rank, scheme):
    """GradScaler fp16: torch.autocast("cpu", dtype=torch.float16) and
    torch.amp.GradScaler("cpu", growth_interval=5), 40 steps: the scale (2**16 at the
    start) doubles every 5 clean steps until an overflow step halves it, the dynamics of
    a long run with the default interval of 2000, in 40 steps. Works if the final scale
    is >= 1 and the skipped steps are within 1 of DDP allreduce's, or (a model that
    trains otherwise has other gradients) each of them was an overflow of the step's own
    backward pass, which deepreduce's hook counts before any exchange. deepreduce's
    state is told of the scaler (``grad_scaler``), as its docs say to."""
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            probe = torch.nn.Linear(4, 4)(torch.randn(2, 4))
        if probe.dtype != torch.float16:
            return {"unsupported": f"autocast gave {probe.dtype}, not float16"}
    except Exception as exc:  # noqa: BLE001 - what this torch build supports is the finding
        return {"unsupported": f"fp16 autocast on CPU: {type(exc).__name__}: {exc}"}
    ddp, state = wrap(net(), scheme)
    opt = sgd(ddp)
    scaler = torch.amp.GradScaler("cpu", growth_interval=5)
    if hasattr(state, "grad_scaler"):  # deepreduce's
        state.grad_scaler = scaler  # its residuals follow the scale (see DeepReduceState)
    losses, skipped, scales = [], [], []
    for step, (x, y) in enumerate(batches(rank, 40)):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = ddp(x)
        loss = torch.nn.functional.cross_entropy(out.float(), y)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < before:
            skipped.append(step)
        scales.append(scaler.get_scale())
        losses.append(loss.item())
    return finish(ddp, state, scheme, losses, skipped=skipped, final_scale=scaler.get_scale(),
                  min_scale=min(scales), scales=scales,
                  hook_nonfinite=getattr(state, "nonfinite_iters", None))


def run_nan_one_rank(rank, scheme):
    """NaN on one rank: at step 5 rank 1 turns one element of the first layer's weight
    gradient into NaN during backward (a tensor hook on the parameter, before DDP reads
    it). Works if both ranks see a non-finite gradient at step 5 (as DDP's allreduce
    gives), skip that step, and every later step is finite on both ranks."""
    ddp, state = wrap(net(), scheme)
    opt = sgd(ddp)
    weight = ddp.module[0].weight
    losses, bad_steps = [], []

    def poison(grad):
        grad = grad.clone()
        grad[0, 0] = float("nan")
        return grad

    for step, (x, y) in enumerate(batches(rank, 14)):
        handle = weight.register_hook(poison) if step == 5 and rank == 1 else None
        loss, bad = train_step(ddp, opt, x, y)
        if handle is not None:
            handle.remove()
        losses.append(loss)
        if bad:
            bad_steps.append(step)
    return finish(ddp, state, scheme, losses, event=5, nonfinite_steps=bad_steps)


def run_no_sync(rank, scheme):
    """no_sync accumulation: each of 10 steps takes 2 micro-batches, the first
    backward inside ddp.no_sync(). Works if the loop ends, ranks agree, the model trains."""
    ddp, state = wrap(net(), scheme)
    opt = sgd(ddp)
    data = batches(rank, 20)
    losses = []
    for step in range(10):
        opt.zero_grad()
        (x1, y1), (x2, y2) = data[2 * step], data[2 * step + 1]
        with ddp.no_sync():
            first = loss_of(ddp, x1, y1)
            (first / 2).backward()
        second = loss_of(ddp, x2, y2)
        (second / 2).backward()
        opt.step()
        losses.append((first.item() + second.item()) / 2)
    # the loss of a step is that of two batches: compare steps 0-1 with the last 2
    return finish(ddp, state, scheme, losses, window=2)


class Branchy(torch.nn.Module):
    """The MLP with a second head that the forward pass uses on some steps only."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(),
                                         torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU())
        self.head = torch.nn.Linear(HIDDEN, OUT)
        self.aux = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x, use_aux=True):
        h = self.trunk(x)
        return self.head(h) + self.aux(h) if use_aux else self.head(h)


def run_find_unused(rank, scheme):
    """find_unused_parameters=True: a model with an auxiliary head that the forward
    pass leaves out on every third step (steps 0, 3, 6, 9 of 12). Works if the loop ends,
    ranks agree, the model trains."""
    ddp, state = wrap(Branchy(), scheme, find_unused_parameters=True)
    opt = sgd(ddp)
    losses = []
    for step, (x, y) in enumerate(batches(rank, 12)):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x, use_aux=step % 3 != 0), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return finish(ddp, state, scheme, losses)


def _plain_loop(ddp, state, scheme, rank, steps=12, dtype=None):
    opt = sgd(ddp)
    losses, bad_steps = [], []
    for step, (x, y) in enumerate(batches(rank, steps, dtype=dtype)):
        loss, bad = train_step(ddp, opt, x, y, skip_nonfinite=False)
        losses.append(loss)
        if bad:
            bad_steps.append(step)
    return finish(ddp, state, scheme, losses, nonfinite_steps=bad_steps)


def run_static_graph(rank, scheme):
    """static_graph=True, 12 steps. Works if the loop ends, ranks agree, the model trains."""
    ddp, state = wrap(net(), scheme, static_graph=True)
    return _plain_loop(ddp, state, scheme, rank)


def run_bf16(rank, scheme):
    """bf16 model: every parameter and input in bfloat16, 12 steps. Works if the loop
    ends, every gradient is finite, ranks agree, the model trains."""
    ddp, state = wrap(net().to(torch.bfloat16), scheme)
    return _plain_loop(ddp, state, scheme, rank, dtype=torch.bfloat16)


class Mixed(torch.nn.Module):
    """The MLP with its first layer in bfloat16 and the rest in float32."""

    def __init__(self, seed=0):
        super().__init__()
        layers = net(seed)
        self.first = layers[0].to(torch.bfloat16)
        self.rest = layers[1:]

    def forward(self, x):
        return self.rest(self.first(x.to(torch.bfloat16)).float())


def run_mixed_dtype(rank, scheme):
    """Mixed dtypes: the first layer's parameters in bfloat16, the others in float32
    (DDP buckets them by dtype), 12 steps. Works if the loop ends, every gradient is
    finite, ranks agree, the model trains."""
    ddp, state = wrap(Mixed(), scheme)
    return _plain_loop(ddp, state, scheme, rank)


def run_compile(rank, scheme):
    """torch.compile (inductor) of the DDP model, 8 steps. Works if dynamo compiled
    frames on both ranks, the loop ends, ranks agree, the model trains."""
    ddp, state = wrap(net(), scheme)
    compiled = torch.compile(ddp)
    opt = sgd(ddp)
    losses = []
    start = time.perf_counter()
    for x, y in batches(rank, 8):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    from torch._dynamo.utils import counters
    return finish(ddp, state, scheme, losses, loop_s=round(time.perf_counter() - start, 1),
                  compiled_frames=counters["frames"]["ok"],
                  graph_breaks=sum(counters["graph_break"].values()))


def run_join(rank, scheme):
    """Join with uneven inputs: rank 0 has 12 batches, rank 1 has 8, inside
    torch.distributed.algorithms.Join([ddp]). Works if the loop ends on both ranks,
    ranks agree afterwards (Join hands the last joiner's model to all), rank 0's model
    trains."""
    from torch.distributed.algorithms import Join
    ddp, state = wrap(net(), scheme)
    opt = sgd(ddp)
    losses = []
    with Join([ddp]):
        for x, y in batches(rank, 12 if rank == 0 else 8):
            loss, _ = train_step(ddp, opt, x, y, skip_nonfinite=False)
            losses.append(loss)
    return finish(ddp, state, scheme, losses, steps=len(losses))


def run_resume(rank, scheme):
    """Checkpoint resume: 6 steps, then model, optimizer and hook state saved
    (state.state_dict() for deepreduce, the pickled PowerSGDState for PowerSGD) and
    restored into fresh objects, 4 more steps. Works if every parameter equals
    (torch.equal) that of an uninterrupted run of 10 steps, on both ranks."""
    data = batches(rank, 10, seed=3)

    def steps(ddp, opt, part, losses):
        for x, y in part:
            losses.append(train_step(ddp, opt, x, y, skip_nonfinite=False)[0])

    ddp, state = wrap(net(1), scheme)
    opt = sgd(ddp)
    losses = []
    steps(ddp, opt, data, losses)
    uninterrupted = [p.detach().clone() for p in ddp.module.parameters()]

    ddp, state = wrap(net(1), scheme)
    opt = sgd(ddp)
    steps(ddp, opt, data[:6], [])
    buffer = io.BytesIO()
    hook = (pickle.dumps(state) if scheme == "powersgd" else
            state.state_dict() if scheme == "deepreduce" else None)
    torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "hook": hook},
               buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    module = net(2)  # other weights: all of them must come from the checkpoint
    module.load_state_dict(checkpoint["model"])
    restored = None
    if scheme == "powersgd":
        restored = pickle.loads(checkpoint["hook"])
    elif scheme == "deepreduce":
        restored = make_state(scheme)
        restored.load_state_dict(checkpoint["hook"])
    ddp, state = wrap(module, scheme, state=restored)
    opt = sgd(ddp)
    opt.load_state_dict(checkpoint["opt"])
    steps(ddp, opt, data[6:], [])
    equal = [torch.equal(a, b) for a, b in zip(ddp.module.parameters(), uninterrupted)]
    return finish(ddp, state, scheme, losses, identical=all(equal),
                  differing=sum(not e for e in equal), max_difference=max(
                      float((a.detach() - b).abs().max())
                      for a, b in zip(ddp.module.parameters(), uninterrupted)))


def run_dead_rank(rank, scheme, out_dir=None):
    """Dead rank: rank 1 leaves the process abruptly (os._exit) at step 6 of 12; the
    process group's timeout is 20 s. Works if rank 0 raises within 60 s of its last
    completed step instead of hanging."""
    ddp, state = wrap(net(), scheme)
    opt = sgd(ddp)
    last = time.monotonic()
    for step, (x, y) in enumerate(batches(rank, 12)):
        if rank == 1 and step == 6:
            _write(out_dir, rank, {"ok": True, "exited_at_step": step})
            os._exit(17)
        try:
            train_step(ddp, opt, x, y, skip_nonfinite=False)
        except Exception as exc:  # noqa: BLE001 - raising is what is asked for
            return {"raised": True, "raised_at_step": step,
                    "raised_after_s": round(time.monotonic() - last, 2),
                    "error": _short(f"{type(exc).__name__}: {exc}")}
        last = time.monotonic()
    return {"raised": False, "steps": 12}


def run_two_models(rank, scheme):
    """Two models, two states: two DDP models (different seeds), each with a hook
    state of its own, trained in the same loop (a backward pass and an optimizer step
    for each in turn, as in a GAN). Works if both loops end, ranks agree on both models,
    both train."""
    ddp_a, state_a = wrap(net(1), scheme)
    ddp_b, state_b = wrap(net(2), scheme)
    opt_a, opt_b = sgd(ddp_a), sgd(ddp_b)
    losses_a, losses_b = [], []
    for (xa, ya), (xb, yb) in zip(batches(rank, 12, seed=1), batches(rank, 12, seed=2)):
        losses_a.append(train_step(ddp_a, opt_a, xa, ya, skip_nonfinite=False)[0])
        losses_b.append(train_step(ddp_b, opt_b, xb, yb, skip_nonfinite=False)[0])
    second = finish(ddp_b, state_b, scheme, losses_b)
    return finish(ddp_a, state_a, scheme, losses_a, second=second)


# -- judging what the ranks measured ------------------------------------------------------

def trains(losses, window=POOL) -> bool:
    """The mean loss of the last ``window`` steps at least 1% below the first's."""
    if len(losses) < 2 * window or not all(math.isfinite(v) for v in losses):
        return False
    first, last = losses[:window], losses[-window:]
    return sum(last) / window < 0.99 * sum(first) / window


def common_faults(r0, r1, window=POOL, train=True) -> list[str]:
    """What every loop must satisfy: equal parameters on both ranks, finite ones, a
    model that trains (unless ``train`` is False)."""
    faults = []
    if not (r0["params_finite"] and r1["params_finite"]):
        faults.append("parameters not finite")
    if r0["params"] != r1["params"]:
        faults.append("ranks' parameters differ")
    if train and not trains(r0["losses"], window):
        faults.append("does not train (loss %s -> %s)" % _loss_ends(r0["losses"], window))
    return faults


def _loss_ends(losses, window=POOL):
    def mean(part):
        return f"{sum(part) / len(part):.3f}" if part else "-"
    return mean(losses[:window]), mean(losses[-window:])


def per_rank(fault) -> list[str]:
    """``fault(r)`` (a message or None) of each rank's findings, said once when both
    ranks have the same."""
    def judged(r0, r1):
        f0, f1 = fault(r0), fault(r1)
        if f0 and f0 == f1:
            return [f"both ranks: {f0}"]
        return [f"rank {r['rank']}: {f}" for r, f in ((r0, f0), (r1, f1)) if f]
    return judged


def _event_seen(r):
    if r["event"] not in r["nonfinite_steps"]:
        return f"no non-finite gradient at step {r['event']}"


def _later_nonfinite(r):
    later = [s for s in r["nonfinite_steps"] if s > r["event"]]
    if later:
        return f"{len(later)} of {len(r['losses']) - r['event'] - 1} later steps non-finite"


def judge_nonfinite_event(r0, r1):
    event = r0["event"]
    faults = per_rank(_event_seen)(r0, r1) + per_rank(_later_nonfinite)(r0, r1)
    faults += common_faults(r0, r1, train=False)
    losses = r0["losses"]
    before, after = losses[event - POOL:event], losses[-POOL:]
    if not (all(map(math.isfinite, after)) and sum(after) < 0.99 * sum(before)):
        faults.append("does not train on after step %d (loss %.3f -> %.3f)"
                      % (event, sum(before) / POOL, sum(after) / POOL))
    return faults


def judge_gradscaler(r0, r1, reference):
    if "unsupported" in r0:
        return None
    faults = []
    if r0["skipped"] != r1["skipped"]:
        faults.append("ranks skipped different steps")
    if not r0["final_scale"] >= 1:
        faults.append(f"scale collapsed to {r0['final_scale']:.3g}")
    if reference is None:
        faults.append("no DDP allreduce run to compare the skipped steps with")
    elif abs(len(r0["skipped"]) - len(reference["skipped"])) > 1 and \
            r0.get("hook_nonfinite") != len(r0["skipped"]):
        # (a scheme whose model trains otherwise overflows at other scales: deepreduce's
        # hook counts the steps whose own backward pass overflowed, before any exchange)
        faults.append(f"{len(r0['skipped'])} steps skipped, DDP allreduce "
                      f"{len(reference['skipped'])}")
    return faults + common_faults(r0, r1)


def _nonfinite_steps(r):
    if r.get("nonfinite_steps"):
        return f"{len(r['nonfinite_steps'])} steps with non-finite gradients"


def judge_plain(r0, r1):
    faults = per_rank(_nonfinite_steps)(r0, r1)
    if "compiled_frames" in r0 and not (r0["compiled_frames"] and r1["compiled_frames"]):
        faults.append("torch.compile compiled nothing")
    return faults + common_faults(r0, r1, r0.get("window", POOL))


def judge_join(r0, r1):
    faults = []
    if (r0["steps"], r1["steps"]) != (12, 8):
        faults.append(f"steps {r0['steps']}/{r1['steps']}, not 12/8")
    return faults + common_faults(r0, r1)


def _resumed_differs(r):
    if not r["identical"]:
        return (f"{r['differing']} of 6 parameters differ from the uninterrupted run "
                f"(by up to {r['max_difference']:.2g})")


def judge_resume(r0, r1):
    return per_rank(_resumed_differs)(r0, r1) + common_faults(r0, r1, train=False)


def judge_dead_rank(r0, r1):
    if not r0.get("raised"):
        return ["rank 0 finished without an error"]
    if r0["raised_after_s"] >= DEAD_BOUND_S:
        return [f"rank 0 raised only after {r0['raised_after_s']:.0f} s"]
    return []


def judge_two_models(r0, r1):
    return ([f"model A: {f}" for f in common_faults(r0, r1)]
            + [f"model B: {f}" for f in common_faults(r0["second"], r1["second"])])


class Scenario:
    def __init__(self, name, label, run, judge, timeout=TIMEOUT_S, pg_timeout=PG_TIMEOUT_S):
        self.name, self.label, self.run, self.judge = name, label, run, judge
        self.timeout, self.pg_timeout = timeout, pg_timeout

    @property
    def criterion(self) -> str:
        return " ".join(self.run.__doc__.split())


SCENARIOS = {s.name: s for s in [
    Scenario("overflow", "1. overflow step (loss x inf)", run_overflow, judge_nonfinite_event),
    Scenario("gradscaler", "2. GradScaler fp16 autocast", run_gradscaler, judge_gradscaler),
    Scenario("nan_one_rank", "3. NaN on one rank", run_nan_one_rank, judge_nonfinite_event),
    Scenario("no_sync", "4. no_sync accumulation", run_no_sync, judge_plain),
    Scenario("find_unused", "5. find_unused_parameters=True", run_find_unused, judge_plain),
    Scenario("static_graph", "6. static_graph=True", run_static_graph, judge_plain),
    Scenario("bf16", "7a. bf16 model", run_bf16, judge_plain),
    Scenario("mixed_dtype", "7b. mixed fp32/bf16 model", run_mixed_dtype, judge_plain),
    Scenario("compile", "8. torch.compile (inductor)", run_compile, judge_plain,
             timeout=COMPILE_TIMEOUT_S),
    Scenario("join", "9. Join, uneven inputs", run_join, judge_join),
    Scenario("resume", "10. checkpoint resume", run_resume, judge_resume),
    Scenario("dead_rank", "11. dead rank", run_dead_rank, judge_dead_rank,
             timeout=DEAD_BOUND_S + 30, pg_timeout=DEAD_PG_TIMEOUT_S),
    Scenario("two_models", "12. two models, two states", run_two_models, judge_two_models),
]}


# -- the worker: one process per rank ---------------------------------------------------------

def _short(text, limit=240) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _write(out_dir, rank, result):
    path = Path(out_dir) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, default=str))
    tmp.replace(path)


def worker(rank, scenario, scheme, port, out_dir, pg_timeout):
    """One rank of one cell: its findings go to ``out_dir/rank<r>.json``, its output to
    ``out_dir/rank<r>.log`` (gloo's own messages included)."""
    log = os.open(os.path.join(out_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    start = time.monotonic()
    result = {"rank": rank}
    try:
        import deepreduce
        result["deepreduce_from"] = str(Path(deepreduce.__file__).parent)
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        run = SCENARIOS[scenario].run
        found = run(rank, scheme, out_dir) if scenario == "dead_rank" else run(rank, scheme)
        result.update(found, ok=True)
    except Exception as exc:  # noqa: BLE001 - reported to the driver
        result.update(ok=False, error=_short(f"{type(exc).__name__}: {exc}"),
                      traceback=traceback.format_exc())
    result["seconds"] = round(time.monotonic() - start, 2)
    _write(out_dir, rank, result)
    # Leave without finalising the interpreter and without destroy_process_group (the
    # other rank may be gone): a gloo thread freeing a tensor while the interpreter
    # finalises can abort the process after the findings are on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- the driver ---------------------------------------------------------------------------

_PORT_TAKEN = re.compile(r"address already in use|EADDRINUSE", re.I)
_INTERESTING = re.compile(r"error|abort|mismatch|terminate|exception|timed? ?out", re.I)


def run_cell(scenario, scheme, timeout=None, pg_timeout=None) -> dict:
    """Run one scenario with one scheme on two fresh ranks; what they found, or how
    they ended."""
    spec = SCENARIOS[scenario]
    timeout = spec.timeout if timeout is None else timeout
    pg_timeout = spec.pg_timeout if pg_timeout is None else min(pg_timeout, spec.pg_timeout)
    ctx = multiprocessing.get_context("spawn")
    for attempt in range(3):
        with tempfile.TemporaryDirectory(prefix="training_loops.") as tmp:
            port = free_port()
            procs = [ctx.Process(target=worker, args=(r, scenario, scheme, port, tmp, pg_timeout),
                                 daemon=True) for r in range(2)]
            start = time.monotonic()
            for p in procs:
                p.start()
            deadline, timed_out = start + timeout, False
            while any(p.is_alive() for p in procs):
                now = time.monotonic()
                if now > deadline:
                    timed_out = True
                    for p in procs:
                        if p.is_alive():
                            p.kill()
                    break
                if any(not p.is_alive() for p in procs):
                    # the other rank is given the group's timeout and a margin to end
                    deadline = min(deadline, now + pg_timeout + 20)
                time.sleep(0.2)
            for p in procs:
                p.join(5)
            wall = time.monotonic() - start
            ranks, logs = {}, {}
            for r in range(2):
                path = Path(tmp) / f"rank{r}.json"
                ranks[r] = json.loads(path.read_text()) if path.exists() else None
                log = Path(tmp) / f"rank{r}.log"
                logs[r] = log.read_text(errors="replace")[-4000:] if log.exists() else ""
        if attempt < 2 and any(_PORT_TAKEN.search(t) for t in logs.values()) and not timed_out:
            continue  # another job took the port between free_port() and the bind
        break
    cell = {"scenario": scenario, "scheme": scheme, "wall_s": round(wall, 1),
            "timed_out": timed_out, "timeout_s": timeout,
            "exitcodes": [p.exitcode for p in procs], "ranks": ranks}
    cell["log_lines"] = {r: [_short(line, 300) for line in logs[r].splitlines()
                             if _INTERESTING.search(line)][-3:] for r in range(2)}
    return cell


def judge(cell, reference=None):
    """``(verdict, detail)``: the table's cell and a line about it (empty when it works)."""
    spec = SCENARIOS[cell["scenario"]]
    r0, r1 = cell["ranks"][0], cell["ranks"][1]
    dead = cell["scenario"] == "dead_rank"
    if cell["timed_out"] and not (dead and r0 is not None):
        if dead:
            return "fails: rank 0 hangs", (f"rank 0 still running {cell['timeout_s']} s after "
                                           "the start; killed")
        waiting = [r for r in (0, 1) if cell["ranks"][r] is None]
        return (f"hangs/times out (>{cell['timeout_s']} s)",
                f"killed after {cell['timeout_s']} s; rank(s) {waiting} had not finished"
                + _log_detail(cell))
    for r, found in ((0, r0), (1, r1)):
        if found is None:
            code = cell["exitcodes"][r]
            how = (f"signal {-code}" if code is not None and code < 0 else f"exit code {code}")
            logs = " ".join(cell["log_lines"][r])
            why = (", gloo: collective mismatch" if "collective mismatch" in logs else
                   ", gloo: " + _short(logs, 60) if "gloo" in logs else "")
            return (f"fails: rank {r} died ({how}{why})",
                    f"rank {r} ended with {how} before reporting" + _log_detail(cell))
    for r, found in ((0, r0), (1, r1)):
        if not found["ok"]:
            timed = re.search(r"time ?out|timed out", found["error"], re.I) and \
                found["seconds"] >= 0.9 * SCENARIOS[cell["scenario"]].pg_timeout
            what = (f"a collective waited for the group's {spec.pg_timeout} s timeout, then "
                    if timed else "")
            return (f"fails: {what}{_short(found['error'], 90)}",
                    f"rank {r} raised {found['error']} after {found['seconds']} s"
                    + _log_detail(cell))
    faults = (spec.judge(r0, r1, reference) if spec.name == "gradscaler"
              else spec.judge(r0, r1))
    if faults is None:
        return "n/a: " + _short(r0["unsupported"], 80), r0["unsupported"]
    if faults:
        return "fails: " + "; ".join(faults), "; ".join(faults) + _measured(cell)
    if not dead and r0.get("compressed") is False:
        return "works (never compressed)", "the scheme sent every bucket dense" + _measured(cell)
    return "works", _measured(cell).lstrip("; ")


def _log_detail(cell) -> str:
    lines = [f"rank {r}: {line}" for r in (0, 1) for line in cell["log_lines"][r]]
    return ("; log: " + " | ".join(lines[-3:])) if lines else ""


def _measured(cell) -> str:
    """The few figures behind a verdict, for the detail line."""
    r0 = cell["ranks"][0]
    keys = ("nonfinite_steps", "skipped", "final_scale", "identical", "max_difference",
            "raised_at_step", "raised_after_s", "error", "compiled_frames", "graph_breaks",
            "loop_s")
    parts = [f"{k} {r0[k]}" for k in keys if k in r0]
    if cell["scenario"] == "nan_one_rank":
        parts.append(f"rank 1 nonfinite_steps {cell['ranks'][1]['nonfinite_steps']}")
    if "losses" in r0:
        parts.append("loss %s -> %s" % _loss_ends(r0["losses"], r0.get("window", POOL)))
    return "; " + ", ".join(parts) if parts else ""


def run_cells(scenarios, schemes, timeout=None, log=print) -> list[dict]:
    """Every scenario with every scheme, judged; GradScaler's cells need DDP
    allreduce's skipped steps, so its allreduce cell runs whenever it is asked for."""
    cells = []
    for scenario in scenarios:
        wanted = list(schemes)
        if scenario == "gradscaler" and "allreduce" not in wanted:
            wanted.insert(0, "allreduce")
        reference = None
        for scheme in wanted:
            cell = run_cell(scenario, scheme, timeout)
            if scenario == "gradscaler" and scheme == "allreduce":
                r0 = cell["ranks"][0]
                if r0 and r0.get("ok") and "skipped" in r0:
                    reference = r0
            cell["verdict"], cell["detail"] = judge(cell, reference)
            cell["shown"] = scheme in schemes
            log(f"{SCENARIOS[scenario].label:34s} {SCHEMES[scheme]:18s} {cell['wall_s']:6.1f} s  "
                f"{cell['verdict']}", flush=True)
            cells.append(cell)
    return cells


def rows(cells, schemes) -> list[list[str]]:
    """One row per scenario: its label, then each scheme's verdict."""
    by = {(c["scenario"], c["scheme"]): c for c in cells}
    scenarios = list(dict.fromkeys(c["scenario"] for c in cells))
    return [[SCENARIOS[s].label] + [by[s, k]["verdict"] if (s, k) in by else "" for k in schemes]
            for s in scenarios]


def report(record) -> str:
    schemes = record["schemes"]
    cells = [c for c in record["cells"] if c["shown"]]
    lines = ["# Training loops as users run them", "", f"`{record['command']}`", "",
             f"{record['date']}; torch {record['torch']}, Python {record['python']}, "
             f"{record['platform']}, {record['cpus']} CPU cores; deepreduce at "
             f"{record['commit']}. Two gloo ranks on one machine, a fresh pair of "
             f"processes per cell; the whole run took {record['wall_s'] / 60:.1f} minutes.",
             "",
             f"Model: MLP {IN}-{HIDDEN}-{HIDDEN}-{OUT} with ReLU, {PARAMETERS:,} parameters "
             f"({PARAMETERS * 4 / 1e6:.2f} MB in float32); SGD lr {LR}, momentum {MOMENTUM}; "
             f"each rank cycles through {POOL} synthetic batches of {BATCH} from a generator "
             "seeded with its rank, labelled by a fixed random linear teacher. Schemes: DDP's "
             "allreduce (no hook); PowerSGD (`PowerSGDState(process_group=None, "
             f"matrix_approximation_rank=1, start_powerSGD_iter={START_ITER})`, "
             f"`bucket_cap_mb={POWERSGD_BUCKET_MB}`: one bucket); deepreduce "
             f"(`DeepReduceState(sparsifier=\"topk:0.01\", start_iter={START_ITER})` + "
             "`deepreduce_hook`, DDP's default buckets). Each cell is decided by what its run "
             f"measured. A cell that has not ended in {TIMEOUT_S} s "
             f"({COMPILE_TIMEOUT_S} s for torch.compile) is killed: `hangs/times out`; the "
             f"process group's timeout is {PG_TIMEOUT_S} s ({DEAD_PG_TIMEOUT_S} s for the "
             "dead rank).", ""]
    lines += table(["scenario"] + [SCHEMES[s] for s in schemes], rows(cells, schemes))
    failing = [c for c in cells if not c["verdict"].startswith("works")]
    if failing:
        lines += ["", "## What failed", ""]
        lines += [f"- {SCENARIOS[c['scenario']].label}, {SCHEMES[c['scheme']]}: {c['detail']}"
                  for c in failing]
    lines += ["", "## The scenarios and their pass criteria", ""]
    lines += [f"- **{SCENARIOS[s].label}** {SCENARIOS[s].criterion}"
              for s in dict.fromkeys(c["scenario"] for c in cells)]
    lines += ["", "Every loop also has to end on both ranks without an error, leave the "
              "ranks with identical, finite parameters and train: its mean loss over the last "
              f"{POOL} steps (one pass over the batches) at least 1% below that over the first "
              f"{POOL}. A compressing scheme that never compressed reads `works (never "
              "compressed)`. The record beside this report "
              "(`training_loops.json`) holds every cell's measurements.", ""]
    return "\n".join(lines)


def _commit() -> str:
    import subprocess
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "deepreduce"], cwd=root,
                               text=True, capture_output=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head = ""
    if not head:
        return "an unknown commit"
    return f"{head}{' with uncommitted changes under deepreduce/' if dirty else ''}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=",".join(SCENARIOS),
                        help="scenarios, comma-separated: " + ", ".join(SCENARIOS))
    parser.add_argument("--schemes", default=",".join(SCHEMES),
                        help="schemes, comma-separated: " + ", ".join(SCHEMES))
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds a cell may take (default: %d, %d for torch.compile, "
                             "%d for the dead rank)" % (TIMEOUT_S, COMPILE_TIMEOUT_S,
                                                        DEAD_BOUND_S + 30))
    parser.add_argument("--out", default=None,
                        help="the markdown report (default: benchmarks/results/"
                             "training_loops.md for a run of everything, none otherwise)")
    args = parser.parse_args(argv)
    scenarios = [s for s in args.only.split(",") if s]
    schemes = [s for s in args.schemes.split(",") if s]
    for name, known in (("scenario", SCENARIOS), ("scheme", SCHEMES)):
        unknown = [s for s in (scenarios if name == "scenario" else schemes) if s not in known]
        if unknown:
            parser.error(f"unknown {name}(s) {unknown}; known: {', '.join(known)}")
    everything = set(scenarios) == set(SCENARIOS) and set(schemes) == set(SCHEMES)
    out = args.out or (RESULTS / "training_loops.md" if everything else None)

    start = time.monotonic()
    cells = run_cells(scenarios, schemes, args.timeout)
    record = {"command": "python -m benchmarks.training_loops"
              + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "torch": torch.__version__, "python": platform.python_version(),
              "platform": platform.platform(), "cpus": os.cpu_count(), "commit": _commit(),
              "model_parameters": PARAMETERS, "schemes": schemes, "scenarios": scenarios,
              "wall_s": round(time.monotonic() - start, 1), "cells": cells}
    print()
    print("\n".join(table(["scenario"] + [SCHEMES[s] for s in schemes],
                          rows([c for c in cells if c["shown"]], schemes))))
    print(f"\n{record['wall_s']:.0f} s in all")
    if out is not None:
        print(f"wrote {write_report(out, report(record), record)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
