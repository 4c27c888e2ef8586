"""Multi-rank checks of the outer step (deepreduce.torch.outer), run by tests/test_outer.py.

Launched as ``python tests/outer_workers.py OUT PORT RANKS CHECK [CHECK ...]``: RANKS
spawned processes form a gloo group on 127.0.0.1:PORT, every rank runs the named
checks in order and writes its findings to ``OUT/rank<r>.json``. Checks that need a
launch of their own (the second half of a resumed run, the four ranks) are named alone.
"""

import hashlib
import os
import sys
import threading

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
                                 "min_size": 0},
           # fragment 0 at inner steps 1, 4, 7, fragment 1 at 3, 6: the checkpoint at
           # step 4 holds fragment 0's exchange in flight
           "streaming": {"mode": "sparseloco", **SPARSE, "fragments": 2, "overlap": 1},
           "streaming_diloco": {"mode": "diloco", "fragments": 2, "overlap": 1,
                                "merge": "carry"}}
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
        in_flight = outer.in_flight
        torch.save({"model": model.state_dict(), "inner": inner.state_dict(),
                    "outer": outer.state_dict()}, os.path.join(out, f"{name}{rank}.pt"))
        found[f"{name} in flight"] = in_flight and outer.in_flight
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
                       "residuals": len(checkpoint["outer"]["residuals"]),
                       "saved_in_flight": "in_flight" in checkpoint["outer"]}
    return found


def check_nonfinite(rank):
    """A NaN, then an inf, in one element of rank 1's parameters before an outer step, in
    both modes: every rank skips that step (a warning naming rank 1 and the parameter),
    the synced copy, the momentum and the residuals stay as they were, every rank's
    parameters go back to the synced copy; the next outer step is an ordinary one."""
    import warnings

    found = {}
    for mode, bad in (("sparseloco", float("nan")), ("sparseloco", float("inf")),
                      ("diloco", float("nan")), ("diloco", float("-inf"))):
        model = net()
        settings = SPARSE if mode == "sparseloco" else {"value": "statq:bits=2,sigmas=6",
                                                        "min_size": 0, **SPARSE}
        outer = OuterOptimizer(model.named_parameters(), mode=mode, sync_every=H, **settings)
        batches = data(rank, 3 * H)
        train(model, outer, batches[:H])     # one ordinary outer step first
        inner = torch.optim.Adam(model.parameters(), lr=1e-2)
        for x, y in batches[H:2 * H]:
            inner_step(model, inner, x, y)
        before = {"synced": digest(outer.synced_parameters().values()),
                  "residuals": digest(torch.from_numpy(outer.exchange.selector.memory.residual(n))
                                      for n in outer.names),
                  "momentum": digest(outer._outer.state[s]["momentum_buffer"]
                                     for s in outer._synced)
                  if mode == "diloco" else None}
        if rank == 1:
            with torch.no_grad():
                model[2].weight[3, 5] = bad
        outer.inner_steps += H - 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outer.step()
        after = {"synced": digest(outer.synced_parameters().values()),
                 "residuals": digest(torch.from_numpy(outer.exchange.selector.memory.residual(n))
                                     for n in outer.names),
                 "momentum": digest(outer._outer.state[s]["momentum_buffer"]
                                    for s in outer._synced)
                 if mode == "diloco" else None}
        at_synced = digest(model.parameters()) == after["synced"]
        finite_residuals = all(np.isfinite(outer.exchange.selector.memory.residual(n)).all()
                               for n in outer.names)
        skipped = outer.stats.last.nonfinite_steps
        digests, _ = train(model, outer, batches[2 * H:])
        found[f"{mode} {bad}"] = {
            "unchanged": {k: before[k] == after[k] for k in before},
            "at_synced": at_synced, "finite_residuals": finite_residuals,
            "skipped": skipped, "warnings": [str(w.message) for w in caught],
            "outer_steps": outer.outer_steps, "next": digests[-1],
            "finite_after": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
            "later_skipped": outer.stats.total.nonfinite_steps}
    return found


def check_overlap(rank):
    """Outer steps whose exchange overlaps the next ``overlap`` inner steps: every rank
    ends each merge with the same synced copy; the parameters are the merge rule applied
    to what they were just before, bit for bit; sync() drains and ends in one model."""
    found = {}
    for tau, rule in ((1, "carry"), (3, "carry"), (2, "mix")):
        model = net()
        outer = OuterOptimizer(model.named_parameters(), mode="sparseloco", sync_every=H,
                               overlap=tau, merge=rule, mixing=0.5, **SPARSE)
        inner = torch.optim.Adam(model.parameters(), lr=1e-2)
        synced_digests, equation, in_flight, stepped, anchor = [], [], [], [], None
        outer_step = outer._outer_step

        def on_which_thread(*args, outer_step=outer_step, stepped=stepped):
            stepped.append(threading.current_thread().name.startswith("deepreduce-outer"))
            outer_step(*args)
        outer._outer_step = on_which_thread   # (the synced copy is in host memory)
        for x, y in data(rank, 3 * H + 1):
            inner_step(model, inner, x, y)
            before = [p.detach().clone() for p in model.parameters()]
            merging = outer.in_flight and outer.inner_steps + 1 == outer._in_flight.merge_at
            started = outer.step()
            if merging:
                synced = list(outer.synced_parameters().values())
                synced_digests.append(digest(synced))
                expected = [(b - a) + s if rule == "carry" else b.lerp(s, 0.5)
                            for b, a, s in zip(before, anchor, synced)]
                equation.append(all(torch.equal(p, e)
                                    for p, e in zip(model.parameters(), expected)))
            if started:
                anchor = [p.detach().clone() for p in model.parameters()]
                in_flight.append(outer.in_flight)
        outer.sync()
        found[f"{tau} {rule}"] = {"synced": synced_digests, "equation": equation,
                                  "stepped": stepped,
                                  "in_flight": in_flight, "end": digest(model.parameters()),
                                  "outer_steps": outer.outer_steps,
                                  "drained": not outer.in_flight,
                                  "end_is_synced": digest(model.parameters()) == digest(
                                      outer.synced_parameters().values())}
    # the first merge's synced copy is the blocking run's first outer step's
    model = net()
    outer = OuterOptimizer(model.named_parameters(), mode="sparseloco", sync_every=H, **SPARSE)
    train(model, outer, data(rank, H))
    found["blocking first"] = digest(outer.synced_parameters().values())
    return found


def check_overlap_failure(rank):
    """An exchange that fails in the background (rank 1's encoder raises at the second
    outer step) raises from the next step() on every rank, and from every call after."""
    model = net()
    outer = OuterOptimizer(model.named_parameters(), mode="sparseloco", sync_every=H,
                           overlap=2, **SPARSE)
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    raised = []
    for call, (x, y) in enumerate(data(rank, 4 * H), 1):
        inner_step(model, inner, x, y)
        if rank == 1 and outer.inner_steps == 2 * H - 1:
            def broken(names, tensors):
                raise ValueError("a codec refused the pseudo-gradients")
            outer.exchange.strategy.encode = broken
        try:
            outer.step()
        except Exception as exc:  # noqa: BLE001 - what is raised is the finding
            raised.append({"at": call, "type": type(exc).__name__, "message": str(exc)})
    for call in (outer.sync, outer.state_dict):
        try:
            call()
            raised.append({"at": call.__name__, "type": None, "message": ""})
        except Exception as exc:  # noqa: BLE001
            raised.append({"at": call.__name__, "type": type(exc).__name__,
                           "message": str(exc)})
    return {"raised": raised}


def check_fragments(rank):
    """Two fragments of about equal bytes, each synced at its own offset: after fragment
    0's outer step its parameters are the same on both ranks while fragment 1's are
    not, and the other way round; each exchange carries about half the bytes."""
    model = net()
    outer = OuterOptimizer(model.named_parameters(), mode="sparseloco", sync_every=4,
                           fragments=2, **SPARSE)
    inner = torch.optim.Adam(model.parameters(), lr=1e-2)
    per_fragment, dense = [], []
    for x, y in data(rank, 8):
        inner_step(model, inner, x, y)
        if outer.step():
            per_fragment.append([digest(outer.params[i] for i in members)
                                 for members in outer.schedule.members])
            dense.append(outer.stats.last.dense_bytes)
    return {"members": outer.schedule.members, "offsets": outer.schedule.offsets,
            "digests": per_fragment, "dense": dense, "whole": outer.dense_bytes,
            "outer_steps": outer.outer_steps}


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
