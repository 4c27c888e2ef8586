"""Two-rank checks of the DDP hook in the training loops people write, run by
tests/test_torch_loops.py: overflow steps, a NaN on one rank, loss scaling.

Launched as ``python tests/torch_loop_workers.py OUT PORT``: two spawned processes
form a gloo group, every rank runs every check and writes its findings to
``OUT/rank<r>.json`` (the model and data helpers are tests/torch_common.py's).
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import deepreduce.torch as drt
from torch_common import batches, launch, leave, model, params, prepare, run_checks, same

#: Compression from the third step; every bucket compressed.
SETTINGS = {"sparsifier": "topk:0.05", "value": "fp16", "start_iter": 2,
            "min_compression_rate": 0}


def finite_grads(module) -> bool:
    return all(bool(torch.isfinite(p.grad).all()) for p in module.parameters())


def train_skipping(rank, poison=None, skip=None, steps=10, poisoned_ranks=(0, 1), nan=False,
                   reference=None):
    """SGD on the hook, skipping the optimizer step when a gradient is non-finite (as a
    loss scaler does). At step ``poison`` the ranks of ``poisoned_ranks`` get an inf
    loss, or with ``nan`` one NaN in one gradient element; step ``skip`` is left out.
    With ``reference`` (a DDP model without hook, trained alike), where the gradients of
    both are non-finite at the poisoned step is compared."""
    ddp = DDP(model(seed=2))
    state = drt.DeepReduceState(**SETTINGS)
    ddp.register_comm_hook(state, drt.deepreduce_hook)
    modules = [ddp] if reference is None else [ddp, reference]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in modules]
    seen, same_grads = [], None
    for step, (x, y) in enumerate(batches(rank, steps, seed=4)):
        if step == skip:
            continue
        poisoned = step == poison and rank in poisoned_ranks
        grads = []
        for module, opt in zip(modules, optimizers):
            opt.zero_grad()
            weight = module.module[2].weight
            handle = weight.register_hook(_one_nan) if poisoned and nan else None
            loss = torch.nn.functional.cross_entropy(module(x), y)
            (loss * float("inf") if poisoned and not nan else loss).backward()
            if handle is not None:
                handle.remove()
            finite = finite_grads(module)
            grads.append([p.grad.clone() for p in module.parameters()])
            if finite:
                opt.step()
        seen.append(finite_grads(ddp))
        if reference is not None and step == poison:
            # (the two models differ by then: where their gradients are non-finite)
            same_grads = all(torch.equal(torch.isfinite(a), torch.isfinite(b))
                             for a, b in zip(*grads))
    return ddp, state, seen, same_grads


def _one_nan(grad):
    grad = grad.clone()
    grad.view(-1)[7] = float("nan")
    return grad


def _same_state(state, other) -> bool:
    ours, theirs = state.state_dict(), other.state_dict()
    return (ours["iter"] == theirs["iter"]
            and ours["random_state"] == theirs["random_state"]
            and sorted(ours["residuals"]) == sorted(theirs["residuals"])
            and all(torch.equal(ours["residuals"][k], theirs["residuals"][k])
                    for k in ours["residuals"]))


def check_overflow_step(rank):
    """An inf loss on every rank at one step: every rank skips it, and the run ends bit
    for bit as one that never took that batch."""
    ddp, state, seen, _ = train_skipping(rank, poison=5)
    clean, clean_state, clean_seen, _ = train_skipping(rank, skip=5)
    return {"seen": seen, "clean_seen": clean_seen, "same_params": same(params(ddp),
                                                                       params(clean)),
            "same_state": _same_state(state, clean_state),
            "iter": state.iter, "nonfinite_iters": state.nonfinite_iters,
            "nonfinite_steps": state.stats.total.nonfinite_steps}


def check_nan_on_one_rank(rank):
    """One NaN in one element of rank 1's gradient: both ranks get DDP's allreduce of
    that step (NaN where it has NaN), skip it, and end as a run without that batch."""
    reference = DDP(model(seed=2))
    ddp, state, seen, same_grads = train_skipping(rank, poison=5, poisoned_ranks=(1,),
                                                  nan=True, reference=reference)
    clean, clean_state, _, _ = train_skipping(rank, skip=5)
    return {"seen": seen, "nonfinite_where_ddp": same_grads,
            "same_params": same(params(ddp), params(clean)),
            "same_state": _same_state(state, clean_state)}


def check_grad_scaler(rank, steps=40):
    """fp16 autocast with a GradScaler: the hook (told of the scaler) keeps its scale and
    skips what DDP's allreduce skips; fp32 on the hook is the quality reference."""
    out = {}
    for label, hook, half in (("fp32", True, False), ("ddp_fp16", False, True),
                              ("hook_fp16", True, True)):
        ddp = DDP(model(seed=5))
        scaler = torch.amp.GradScaler("cpu", growth_interval=4, enabled=half)
        if hook:
            state = drt.DeepReduceState(**SETTINGS, grad_scaler=scaler)
            ddp.register_comm_hook(state, drt.deepreduce_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        losses, skipped = [], 0
        for x, y in taught(rank, steps):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=half):
                loss = torch.nn.functional.cross_entropy(ddp(x), y)
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            skipped += half and scaler.get_scale() < scale
            losses.append(float(loss.detach()))
        out[label] = {"skipped": int(skipped), "scale": float(scaler.get_scale()),
                      "last_loss": sum(losses[-5:]) / 5, "first_loss": sum(losses[:5]) / 5}
        if hook:
            out[label]["nonfinite_iters"] = state.nonfinite_iters
    return out


def taught(rank, steps, seed=6):
    """Batches whose labels a fixed linear map of the inputs gives: a task to learn."""
    teacher = torch.randn(32, 10, generator=torch.Generator().manual_seed(seed))
    return [(x, (x @ teacher).argmax(1)) for x, _ in batches(rank, steps, seed=seed)]


CHECKS = [check_overflow_step, check_nan_on_one_rank, check_grad_scaler]


def main(rank, out_dir, port, only=None):
    prepare(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    run_checks(rank, out_dir, [globals()[only]] if only else CHECKS)
    leave()


if __name__ == "__main__":
    launch(main)
