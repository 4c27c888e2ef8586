"""Multi-rank checks of the outer step (deepreduce.torch.outer), run by tests/test_outer.py.

Launched as ``python tests/outer_workers.py OUT PORT RANKS CHECK [CHECK ...]``: RANKS
spawned processes form a gloo group on 127.0.0.1:PORT, every rank runs the named
checks in order and writes its findings to ``OUT/rank<r>.json``. Checks that need a
launch of their own (the second half of a resumed run, the four ranks) are named alone.
"""

import hashlib
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import deepreduce as dr
from deepreduce.torch.outer import OuterOptimizer
from torch_common import exit_now, launch, prepare, run_checks

#: SparseLoCo on the small tensors of these checks: 8 x 8 tiles, 4 kept in each.
SPARSE = {"sparsifier": "chunktopk:k=4,chunk=64"}
H = 3


def net(seed=0):
    torch.manual_seed(seed)
    # every weight's sides are multiples of 8: chunk-wise tiles of 8 x 8 cover them
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def data(rank, steps, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return [(torch.randn(16, 16, generator=g), torch.randn(16, 8, generator=g))
            for _ in range(steps)]


def inner_step(model, inner, x, y):
    inner.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    inner.step()


def digest(tensors) -> str:
    """The bits of every tensor: equal digests, identical tensors."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train(model, outer, batches, lr=1e-2):
    """Adam inner steps, an ``outer.step()`` after each: the digests after each."""
    inner = torch.optim.Adam(model.parameters(), lr=lr)
    digests, synced = [], []
    for x, y in batches:
        inner_step(model, inner, x, y)
        synced.append(outer.step())
        digests.append(digest(model.parameters()))
    return digests, synced


def gathered(tensor):
    """Every rank's ``tensor``, in rank order."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return parts


def check_identical(rank):
    """SparseLoCo on two ranks with batches of their own: identical after every outer
    step, apart in between."""
    model = net()
    outer = OuterOptimizer(model.named_parameters(), mode="sparseloco", sync_every=H, **SPARSE)
    digests, synced = train(model, outer, data(rank, 3 * H))
    last = outer.stats.last
    return {"digests": digests, "synced": synced, "outer_steps": outer.outer_steps,
            "sent": last.bytes_sent, "dense": last.dense_bytes,
            "residuals": len(outer.exchange.selector.memory), "beta": outer.exchange.selector.memory.beta}


def check_dense_reference(rank):
    """Dense DiLoCo (raw values) against its definition: the average of the ranks'
    pseudo-gradients as the gradient of torch's SGD with Nesterov momentum on the
    synced copy. A frozen parameter that each rank changes by hand is synced too; an
    integer one is left alone."""
    model = net()
    model.register_parameter("frozen", torch.nn.Parameter(torch.zeros(5), requires_grad=False))
    model.register_parameter("count", torch.nn.Parameter(torch.tensor([rank]),
                                                         requires_grad=False))
    outer = OuterOptimizer(model.named_parameters(), mode="diloco", sync_every=H,
                           sparsifier=None, value="raw")
    floating = [p for p in model.parameters() if p.dtype.is_floating_point]
    reference = [p.detach().clone() for p in floating]
    reference_outer = torch.optim.SGD(reference, lr=0.7, momentum=0.9, nesterov=True)
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    identical, worst = [], 0.0
    for step, (x, y) in enumerate(data(rank, 3 * H)):
        inner_step(model, inner, x, y)
        with torch.no_grad():
            model.frozen.add_(rank + 1.0)
        if (step + 1) % H == 0:
            for r, p in zip(reference, floating):
                pseudo = gathered(r - p.detach())
                r.grad = (pseudo[0] + pseudo[1]) / 2
            reference_outer.step()
        if outer.step():
            identical.append(all(torch.equal(p, r) for p, r in zip(floating, reference)))
            worst = max(worst, max((p - r).abs().max().item()
                                   for p, r in zip(floating, reference)))
    return {"identical": identical, "worst": worst, "skipped": outer.skipped,
            "count": model.count.tolist(), "frozen": model.frozen.tolist(),
            "memory": outer.exchange.selector.memory is None, "sent": outer.stats.last.bytes_sent,
            "dense": outer.dense_bytes}


def check_sparseloco_reference(rank):
    """SparseLoCo against its definition, by hand in numpy: e = beta * e + delta; keep
    the chunk-wise Top-k of e, quantised by statq (what the receivers decode); e -= what
    was sent; theta -= alpha * the ranks' mean of what they sent."""
    beta, alpha = 0.9, 0.8
    model = net()
    outer = OuterOptimizer(model.named_parameters(), mode="sparseloco", sync_every=H,
                           error_feedback=beta, lr=alpha, **SPARSE)
    pipeline = dr.Pipeline(dr.ChunkTopK(k=4, chunk=64), index="chunked",
                           value="statq:bits=2,sigmas=6")
    params = list(model.parameters())
    reference = [p.detach().clone() for p in params]
    reference_outer = torch.optim.SGD(reference, lr=alpha)
    residuals = [None] * len(params)
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    identical, worst, kept = [], 0.0, []
    for step, (x, y) in enumerate(data(rank, 3 * H)):
        inner_step(model, inner, x, y)
        if (step + 1) % H == 0:
            for i, (r, p) in enumerate(zip(reference, params)):
                delta = (r - p.detach()).numpy()
                e = delta if residuals[i] is None else beta * residuals[i] + delta
                _, received = pipeline.encode(e)
                sent = received.to_dense().reshape(e.shape)
                residuals[i] = e - sent
                kept.append(received.nnz)
                mine = torch.from_numpy(np.ascontiguousarray(sent))
                everyone = gathered(mine)
                r.grad = (everyone[0] + everyone[1]) / 2
            reference_outer.step()
        if outer.step():
            identical.append(all(torch.equal(p, r) for p, r in zip(params, reference)))
            worst = max(worst, max((p - r).abs().max().item() for p, r in zip(params, reference)))
    residuals_match = all(np.array_equal(outer.exchange.selector.memory.residual(name), res)
                          for name, res in zip(outer.names, residuals))
    return {"identical": identical, "worst": worst, "kept": kept,
            "residuals_match": residuals_match}


RESUMED = {"sparseloco": {"mode": "sparseloco", **SPARSE},
           "diloco_compressed": {"mode": "diloco", **SPARSE, "value": "statq:bits=2,sigmas=6",
                                 "min_size": 0}}
STEPS, STOP = 8, 4


def _fresh(settings):
    model = net(seed=1)
    outer = OuterOptimizer(model.named_parameters(), sync_every=H, **settings)
    return model, outer, torch.optim.Adam(model.parameters(), lr=1e-2)


def _run(model, outer, inner, batches):
    for x, y in batches:
        inner_step(model, inner, x, y)
        outer.step()


def check_resume_first(rank):
    """The first process of a resumed run: the uninterrupted run's digest, and the
    checkpoint at inner step STOP (between two outer steps), on disk."""
    out = os.environ["OUTER_TEST_OUT"]
    found = {}
    for name, settings in RESUMED.items():
        model, outer, inner = _fresh(settings)
        _run(model, outer, inner, data(rank, STEPS))
        found[name] = digest(model.parameters())
        model, outer, inner = _fresh(settings)
        _run(model, outer, inner, data(rank, STEPS)[:STOP])
        torch.save({"model": model.state_dict(), "inner": inner.state_dict(),
                    "outer": outer.state_dict()}, os.path.join(out, f"{name}{rank}.pt"))
    return found


def check_resume_second(rank):
    """The second, in new processes: load the checkpoint into new objects, train on."""
    out = os.environ["OUTER_TEST_OUT"]
    found = {}
    for name, settings in RESUMED.items():
        checkpoint = torch.load(os.path.join(out, f"{name}{rank}.pt"), weights_only=False)
        model, outer, inner = _fresh(settings)
        model.load_state_dict(checkpoint["model"])
        inner.load_state_dict(checkpoint["inner"])
        outer.load_state_dict(checkpoint["outer"])
        resumed_at = (outer.inner_steps, outer.outer_steps)
        _run(model, outer, inner, data(rank, STEPS)[STOP:])
        found[name] = {"digest": digest(model.parameters()), "resumed_at": resumed_at,
                       "ended_at": (outer.inner_steps, outer.outer_steps),
                       "residuals": len(checkpoint["outer"]["residuals"])}
    return found


def check_mismatch(rank):
    """Settings, models or starting points that differ between the ranks: every rank
    raises at the first outer step, naming what differs."""
    cases = {"sync_every": ({"sync_every": 2 + rank}, 0),
             "value": ({"value": ("raw", "bf16")[rank], "sparsifier": None}, 0),
             "start": ({}, rank)}
    found = {}
    for name, (settings, seed) in cases.items():
        model = net(seed)
        outer = OuterOptimizer(model.named_parameters(), **{"sync_every": H, **settings})
        try:
            outer.sync()
            found[name] = {"raised": False, "message": ""}
        except ValueError as exc:
            found[name] = {"raised": True, "message": str(exc)}
    return found


def check_synced_on_host(rank):
    """The synced copy on the host trains the same bits (here the device is the CPU too)."""
    found = {}
    for on_host in (False, True):
        model = net()
        outer = OuterOptimizer(model.named_parameters(), sync_every=H, synced_on_host=on_host,
                               **SPARSE)
        digests, _ = train(model, outer, data(rank, 2 * H))
        found[str(on_host)] = {"digests": digests, "devices": sorted(
            {str(s.device) for s in outer.synced_parameters().values()})}
    return found


def check_workers_of_two(rank):
    """Four ranks as two workers of two: DDP inside each worker, the outer step between
    the ranks with the same local rank. Every rank makes every group."""
    local_size, workers = 2, 2
    worker, local = divmod(rank, local_size)
    inner_groups = [dist.new_group(list(range(w * local_size, (w + 1) * local_size)))
                    for w in range(workers)]
    outer_groups = [dist.new_group(list(range(lr, workers * local_size, local_size)))
                    for lr in range(local_size)]
    model = DDP(net(), process_group=inner_groups[worker])
    outer = OuterOptimizer(model.module.named_parameters(), mode="sparseloco", sync_every=H,
                           process_group=outer_groups[local], **SPARSE)
    digests, synced = train(model, outer, data(10 * worker + local, 3 * H))
    return {"digests": digests, "synced": synced, "group_size": outer.transport.size,
            "group_rank": outer.transport.rank}


def main(rank, out_dir, port, world, checks):
    prepare(port, OUTER_TEST_OUT=out_dir)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    run_checks(rank, out_dir, [globals()[name] for name in checks])
    dist.barrier()
    dist.destroy_process_group()
    exit_now()


if __name__ == "__main__":
    out, port, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    launch(main, nprocs=world, args=(out, port, world, sys.argv[4:]))
