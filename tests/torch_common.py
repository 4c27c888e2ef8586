"""What the torch worker scripts share: the model and its batches, comparing parameters,
a run stopped and resumed from a checkpoint, and the frame of a launch (spawned ranks
that run their checks and write their findings to ``OUT/rank<r>.json``).

Imported by tests/torch_workers.py, torch_loop_workers.py, torch_hierarchical_workers.py
and torch_failure_worker.py, which are launched by path (``python tests/<worker>.py OUT
PORT``): tests/ is then sys.path[0].
"""

import io
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import deepreduce.torch as drt


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 300), torch.nn.ReLU(),
                               torch.nn.Linear(300, 200), torch.nn.ReLU(),
                               torch.nn.Linear(200, 10))


def batches(rank, steps, seed=0, classes=10):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, classes, (16,), generator=g))
            for _ in range(steps)]


def steps(ddp, opt, data):
    """One optimizer step per batch of ``data``, on the cross-entropy loss."""
    for x, y in data:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()


def params(module):
    return [p.detach().clone() for p in module.parameters()]


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def resumed(settings, data, stop, measure):
    """Train ``model(seed=1)`` on the hook with ``settings`` over ``data`` straight
    through; then again, stopped after ``stop`` batches, saved with torch.save (model,
    optimizer, hook state), loaded into fresh objects and trained on the rest.

    Returns ``measure`` of the uninterrupted run's module, and the resumed run's DDP
    model, its state and the checkpoint it was resumed from."""

    def fresh():
        ddp = DDP(model(seed=1))
        state = drt.DeepReduceState(**settings)
        ddp.register_comm_hook(state, drt.deepreduce_hook)
        return ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    ddp, state, opt = fresh()
    steps(ddp, opt, data)
    uninterrupted = measure(ddp.module)
    ddp, state, opt = fresh()
    steps(ddp, opt, data[:stop])
    buffer = io.BytesIO()
    torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                "hook": state.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)
    ddp, state, opt = fresh()
    ddp.module.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    state.load_state_dict(checkpoint["hook"])
    steps(ddp, opt, data[stop:])
    return uninterrupted, ddp, state, checkpoint


def prepare(port, **environ):
    """A spawned rank's first step: where the group meets (and ``environ``), one thread."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **environ)
    torch.set_num_threads(1)


def run_checks(rank, out_dir, checks):
    """Run every check, then write ``{check name: findings}`` to ``OUT/rank<r>.json``;
    a check that raises has its traceback for findings, under ``"error"``."""
    findings = {}
    for check in checks:
        try:
            findings[check.__name__] = check(rank)
        except Exception:  # noqa: BLE001 - reported to the pytest side
            findings[check.__name__] = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(findings, f)


def leave():
    """Destroy the group and leave without finalising the interpreter. DDP's reducer keeps
    the group alive past destroy_process_group, and a gloo thread that frees a tensor
    while the interpreter finalises aborts the process (pytorch/pytorch#179291): a
    failure of torch's exit, after the findings are on disk, not of what is checked."""
    dist.destroy_process_group()
    exit_now()


def exit_now():
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(main, nprocs=2, args=None):
    """Spawn ``main(rank, *args)`` on ``nprocs`` ranks; ``args`` are by default the
    command line's ``OUT PORT [CHECK]`` (one check by name, else all)."""
    if args is None:
        args = (sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])
    mp.start_processes(main, args=args, nprocs=nprocs, start_method="spawn")


def raised_in_first_step(rank, make_state):
    """Train ``model()`` one step on the hook of ``make_state()``: what it raised."""
    ddp = DDP(model())
    state = make_state()
    ddp.register_comm_hook(state, drt.deepreduce_hook)
    x, y = batches(rank, 1)[0]
    try:
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
    except Exception as exc:  # noqa: BLE001 - the message is the finding
        return {"raised": True, "message": str(exc)}
    return {"raised": False, "message": ""}
