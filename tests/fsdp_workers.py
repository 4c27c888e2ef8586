"""Four-rank checks of deepreduce.torch.fsdp on gloo, run by tests/test_fsdp.py.

Launched as ``python tests/fsdp_workers.py OUT PORT [CHECK ...]``: four spawned
processes form a gloo group on 127.0.0.1:PORT, a 2 x 2 device mesh (2 replicas of
2 shards: ``mesh["replicate"]``, ``mesh["shard"]``), run the named checks (all of
:data:`CHECKS` when none is named) and write their findings to ``OUT/rank<r>.json``.
A check that continues a checkpoint in new processes is named alone in a launch of
its own, after the one that wrote it.
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import deepreduce as dr
from deepreduce.torch.fsdp import compress_replicas
import torch_common
from torch_common import exit_now, launch, prepare, run_checks

LOSSLESS = {"sparsifier": None, "index": "varint", "value": "raw"}
RANKS = 4


def model(seed=0):
    """Rows that do not split evenly into 2 shards (201, 7): FSDP pads their shards."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 300), torch.nn.ReLU(),
                               torch.nn.Linear(300, 201), torch.nn.ReLU(),
                               torch.nn.Linear(201, 7))


def batches(rank, steps, seed=0):
    return torch_common.batches(rank, steps, seed, classes=7)


def sharded(mesh, seed=0, mp_policy=None):
    """``model(seed)``: each Linear an FSDP unit, the root too, on ``mesh``."""
    net = model(seed)
    options = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, **options)
    fully_shard(net, mesh=mesh, **options)
    return net


def step(net, opt, x, y):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(net(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def full(net):
    """Every parameter whole (DTensors gathered over their mesh), as float32."""
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
            for p in net.parameters()]


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def close(a, b, tol=1e-5) -> bool:
    return all(torch.allclose(x, y, rtol=tol, atol=tol) for x, y in zip(a, b))


def check_lossless(rank, mesh):
    """Lossless settings give the mean of all four ranks: against FSDP2's own 2-D HSDP
    and an unsharded model under DDP, trained on the same batches; over the reducing
    communicators too."""
    data = batches(rank, 5)
    reference = DDP(model())
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        step(reference, opt, x, y)
    native = sharded(mesh)   # FSDP2's HSDP: replicate and shard dimensions both
    opt = torch.optim.SGD(native.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        step(native, opt, x, y)
    ours = sharded(mesh["shard"])
    state = compress_replicas(ours, mesh["replicate"], **LOSSLESS, start_iter=2)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        step(ours, opt, x, y)
    total = state.stats.total
    out = {"equals_native_hsdp": same(full(ours), full(native)),
           "close_to_unsharded": close(full(ours), full(reference.module)),
           "native_close_to_unsharded": close(full(native), full(reference.module)),
           "iter": state.iter, "compressed": total.compressed_tensors,
           "units": [unit.module for unit in state.units]}
    for communicator in ("sparse_allreduce", "block"):   # SparCML's, OmniReduce's
        net = sharded(mesh["shard"])
        compress_replicas(net, mesh["replicate"], **LOSSLESS, start_iter=2,
                          communicator=communicator)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        for x, y in data:
            step(net, opt, x, y)
        out[communicator] = same(full(net), full(native))
    return out


class Skipping(torch.nn.Module):
    """One FSDP unit whose branch ``b`` every rank leaves out on odd steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = (torch.nn.Linear(32, 64), torch.nn.Linear(64, 64),
                                     torch.nn.Linear(64, 7))

    def forward(self, x, use_b=True):
        h = torch.relu(self.a(x))
        return self.head(torch.relu(self.b(h)) if use_b else h)


def check_unused_parameters(rank, mesh):
    """Steps in which a unit's parameters get no gradient (FSDP leaves them out of the
    flat shard): the shard goes as one piece, lossless settings still equal FSDP2's HSDP."""
    results = []
    for native in (True, False):
        net = fully_shard(Skipping(), mesh=mesh if native else mesh["shard"])
        state = None if native else compress_replicas(net, mesh["replicate"], **LOSSLESS,
                                                      start_iter=0, min_size=0)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for i, (x, y) in enumerate(batches(rank, 4, seed=10)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x, use_b=i % 2 == 0), y).backward()
            opt.step()
        results.append(full(net))
    return {"equals_native_hsdp": same(*results), "tensors": state.stats.total.tensors}


def check_compressed_trains(rank, mesh):
    """Top-10% and fp16 between the replicas: the loss falls as under FSDP2's own HSDP,
    a fifth of the dense bytes or fewer cross (the allgathers' slots sized per unit, not
    by the largest unit), and error feedback loses nothing: the
    average delivered plus every replica's residual is the mean of the inputs."""
    data = batches(rank, 1, seed=2) * 30   # one batch again and again: its loss must fall

    def train(net, state=None):
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        return [step(net, opt, x, y) for x, y in data]

    native = train(sharded(mesh))
    ours = sharded(mesh["shard"])
    state = compress_replicas(ours, mesh["replicate"], sparsifier=dr.TopK(0.1),
                              value="fp16", start_iter=2)
    losses = train(ours, state)
    total = state.stats.total
    return {"first": losses[0], "last": losses[-1], "native_last": native[-1],
            "ratio": total.dense_bytes / total.bytes_sent, "iter": state.iter,
            # what the transport was handed, against the stats' count of it, and the
            # bundles' own bytes (plain averages alike)
            "handed_over_stats": state.bytes_handed / total.bytes_sent,
            "handed_over_bundles": state.bytes_handed / (total.bytes_sent - total.framing_bytes),
            "conserved": _conserved(mesh), **_conserved_over_steps(rank, mesh),
            "top100_equals_native_hsdp": _top100_equals_native(rank, mesh)}


def _conserved_over_steps(rank, mesh, steps=5):
    """Top-10% with error feedback over several SGD steps (the first plain): for every
    parameter shard, what reached the hook in all the steps, summed over the replicas,
    equals the replicas times the averages delivered plus the replicas' last residuals
    (to float32 rounding: the exchange sums in the shard's dtype). Residuals carry from
    step to step under one key per parameter shard (a new key per step or
    call, or a residual lost or paid twice, breaks the sum)."""
    replicate = mesh["replicate"].get_group()
    net = sharded(mesh["shard"])
    state = compress_replicas(net, replicate, sparsifier=dr.TopK(0.1), value="raw",
                              start_iter=1, min_size=0)
    came, went, reduce_shard = {}, {}, state.reduce_shard

    def recording(unit, flat):  # around the installed hook's work: its input and output
        names, before = unit.pieces(flat.detach().clone().double())
        reduce_shard(unit, flat)
        _, after = unit.pieces(flat.detach().double())
        for name, given, delivered in zip(names, before, after):
            came[name] = came.get(name, 0) + given
            went[name] = went.get(name, 0) + delivered

    state.reduce_shard = recording
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for x, y in batches(rank, steps, seed=6):
        step(net, opt, x, y)
    memory, good = state.exchange.selector.memory, []
    for name, given in came.items():
        kept = memory.residual(name)   # None: not kept under the parameter's name
        residual = torch.zeros_like(given) if kept is None else \
            torch.from_numpy(kept.copy()).double()
        dist.all_reduce(residual, group=replicate)
        dist.all_reduce(given, group=replicate)
        good.append(torch.allclose(went[name] * 2 + residual, given, rtol=0, atol=1e-6))
    return {"conserved_over_steps": all(good) and len(good) == 6,
            "residual_keys": sorted(memory.names()) == sorted(came), "ef_iter": state.iter}


def _top100_equals_native(rank, mesh, steps=3):
    """Top-100% with raw values through the whole compressed path (error feedback,
    selection, codecs) is the mean: AdamW steps bit for bit FSDP2's own 2-D HSDP."""
    results = []
    for ours in (False, True):
        net = sharded(mesh["shard"] if ours else mesh)
        if ours:
            compress_replicas(net, mesh["replicate"], sparsifier="topk:1.0", value="raw",
                              start_iter=0, min_size=0)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        for x, y in batches(rank, steps, seed=8):
            step(net, opt, x, y)
        results.append(full(net))
    return same(*results)


def _conserved(mesh):
    """One step of Top-5% with error feedback from scratch: for every parameter shard,
    the delivered average times the replicas plus the replicas' residuals summed equals
    the replicas' inputs summed (each input: the shard group's mean)."""
    x, y = batches(dist.get_rank(), 1, seed=4)[0]
    replicate = mesh["replicate"].get_group()
    plain = sharded(mesh["shard"])      # what reaches the hook: the shard group's mean
    torch.nn.functional.cross_entropy(plain(x), y).backward()
    inputs = [p.grad.to_local().clone() for p in plain.parameters()]
    ours = sharded(mesh["shard"])
    state = compress_replicas(ours, replicate, sparsifier=dr.TopK(0.05), value="raw",
                              start_iter=0, min_size=0)
    torch.nn.functional.cross_entropy(ours(x), y).backward()
    memory = state.exchange.selector.memory
    good = []
    for (name, p), given in zip(ours.named_parameters(), inputs):
        delivered = p.grad.to_local() * 2
        residual = torch.from_numpy(memory.residual(name).copy()) if name in memory \
            else torch.zeros_like(given)
        dist.all_reduce(residual, group=replicate)
        dist.all_reduce(given, group=replicate)
        good.append(torch.allclose(delivered + residual, given, rtol=0, atol=1e-6))
    return all(good)


def check_device_path(rank, mesh):
    """The dense work on the shard's device (forced on the CPU: the path a GPU takes)
    trains bit for bit as the numpy path, and moves only the selected pairs (and the
    shards below min_size) across the host link, never a whole shard."""
    out = {}
    for device_path in (False, True):
        net = sharded(mesh["shard"])
        state = compress_replicas(net, mesh["replicate"], sparsifier=dr.TopK(0.05),
                                  value="fp16", start_iter=1, device_path=device_path)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        for i, (x, y) in enumerate(batches(rank, 5, seed=11)):
            if device_path and i == 4:
                state.exchange.selector.link.reset()
            step(net, opt, x, y)
        out[device_path] = full(net)
    link, replicas, pair = state.exchange.selector.link, 2, 8 + 4
    bound = 0  # per piece: this rank's k pairs out, every replica's back; small ones whole
    for p in net.parameters():
        n = p.to_local().numel()
        bound += (1 + replicas) * -(-n // 20) * pair if n >= 1024 else \
            n * 4 + replicas * n * pair
    return {"identical": same(out[False], out[True]),
            "crossed": link.to_host_bytes + link.to_device_bytes, "bound": bound,
            "dense": sum(p.to_local().numel() * 4 for p in net.parameters())}


def check_mixed_precision(rank, mesh):
    """bf16 parameters, gradients reduced in bf16, float16 (FSDP divides before and after
    the reductions then) and float32: lossless settings give FSDP2's own HSDP result
    under the same policy."""
    out = {}
    for reduce_dtype in (torch.bfloat16, torch.float16, torch.float32):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        results = []
        for native in (True, False):
            net = sharded(mesh if native else mesh["shard"], mp_policy=policy)
            if not native:
                compress_replicas(net, mesh["replicate"], **LOSSLESS, start_iter=1)
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            for x, y in batches(rank, 3, seed=6):
                step(net, opt, x, y)
            results.append(full(net))
        out[str(reduce_dtype)] = close(*results, tol=1e-6)
    return out


def check_nonfinite(rank, mesh):
    """A step whose input holds an inf on one rank: every rank sees a non-finite gradient
    and skips it (as a loss scaler would); residuals stay as they were, and the run then
    trains bit for bit as one that never saw that batch."""
    data = batches(rank, 6, seed=8)
    bad = (data[0][0].clone(), data[0][1])
    if rank == 3:
        bad[0][0, 0] = float("inf")

    def run(with_bad):
        net = sharded(mesh["shard"])
        state = compress_replicas(net, mesh["replicate"], sparsifier=dr.TopK(0.1),
                                  value="fp16", start_iter=1)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        out = {}
        for i, (x, y) in enumerate(data):
            if with_bad and i == 3:
                before = {k: v.copy() for k, v in state.exchange.selector.state_dict()["residuals"].items()}
                opt.zero_grad()
                torch.nn.functional.cross_entropy(net(bad[0]), bad[1]).backward()
                local = all(torch.isfinite(p.grad.to_local()).all() for p in net.parameters())
                out["skipped_here"] = not local
                after = state.exchange.selector.state_dict()["residuals"]
                out["residuals_kept"] = before.keys() == after.keys() and all(
                    (before[k] == after[k]).all() for k in before)
            step(net, opt, x, y)
        return full(net), state, out

    clean, _, _ = run(False)
    trained, state, out = run(True)
    return {**out, "identical": same(trained, clean), "iter": state.iter,
            "nonfinite_iters": state.nonfinite_iters}


def check_misconfigured(rank, mesh):
    """Ranks configured differently raise on every rank, naming the difference."""
    net = sharded(mesh["shard"])
    compress_replicas(net, mesh["replicate"], start_iter=3 + rank)
    return _raised_in_backward(net, rank)


def check_other_layout(rank, mesh):
    """Replicas whose models differ (another width on replica 1) raise on every rank,
    naming the module."""
    torch.manual_seed(0)
    width = 300 if rank < 2 else 302
    net = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(),
                              torch.nn.Linear(width, 7))
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(net, mesh=mesh["shard"])
    compress_replicas(net, mesh["replicate"])
    return _raised_in_backward(net, rank)


# ---- DiLoCo workers that are FSDP2 groups ---------------------------------------------
def outer_net(seed=0):
    """Weights of 128 rows: 64 per shard, whole 64 x 64 tiles of SparseLoCo's chunks."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(128, 128, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(128, 128, bias=False))


def _workers(mesh, seed=0):
    """``outer_net`` sharded over each worker's two ranks (the shard group)."""
    net = outer_net(seed)
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh["shard"])
    return fully_shard(net, mesh=mesh["shard"])


def _inner(net, opt, rank, step):
    """One inner step on this worker's batch (its two ranks draw different halves)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    opt.zero_grad()
    net(torch.randn(8, 128, generator=g)).square().mean().backward()
    opt.step()


#: SparseLoCo's chunk-wise Top-k (64 of each 64 x 64 tile) with values that travel as
#: they are: the tiles of a shard are tiles of the whole tensor.
OUTER = {"mode": "sparseloco", "sync_every": 2, "value": "raw"}


def check_outer_over_shards(rank, mesh):
    """OuterOptimizer over FSDP2 workers (2 workers of 2 ranks): each rank exchanges its
    local shards over the replicate group; the outer steps equal those of an unsharded
    OuterOptimizer over the same parameters bit for bit, and each rank sends about half
    of the unsharded bundle."""
    from deepreduce.torch.outer import OuterOptimizer
    replicate = mesh["replicate"].get_group()
    net, whole = _workers(mesh), outer_net()
    outer = OuterOptimizer(net.named_parameters(), process_group=replicate, **OUTER)
    # on a group of its own with the same ranks: a shared transport would size the sharded
    # step's allgather slots by the whole step's frames
    own = [dist.new_group(list(range(w, RANKS, 2))) for w in range(2)][rank % 2]
    reference = OuterOptimizer(whole.named_parameters(), process_group=own, **OUTER)
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    identical, sent = [], [0, 0]
    for i in range(6):
        _inner(net, inner, rank, i)
        with torch.no_grad():   # the unsharded worker: the same parameters, whole
            for p, q in zip(net.parameters(), whole.parameters()):
                q.copy_(p.full_tensor())
        if outer.step() & reference.step():   # (both count every inner step)
            sent[0] += outer.stats.last.bytes_sent
            sent[1] += reference.stats.last.bytes_sent
            identical.append(same(full(net), list(whole.parameters())))
    return {"identical": identical, "outer_steps": outer.outer_steps,
            "sent_share": sent[0] / sent[1],
            "local_shapes": [list(p.shape) for p in outer.params]}


def _outer_workers(mesh):
    from deepreduce.torch.outer import OuterOptimizer
    net = sharded(mesh["shard"], seed=3)
    outer = OuterOptimizer(net.named_parameters(), process_group=mesh["replicate"].get_group(),
                           mode="sparseloco", sync_every=2)
    return net, outer, torch.optim.Adam(net.parameters(), lr=1e-2)


def _outer_checkpoint(net, outer, inner):
    from deepreduce.torch.fsdp import per_rank
    model_sd, optim_sd = get_state_dict(net, inner)
    return {"model": model_sd, "optim": optim_sd, "outer": per_rank(outer)}


def _worker_checkpoint(mesh, out_dir) -> dict:
    """Where this worker's checkpoint goes, and its group: one checkpoint per worker (the
    workers' models and inner optimizers differ between outer steps, and DCP would keep
    one copy of the shards they have at the same offsets)."""
    worker = mesh["replicate"].get_local_rank()
    return {"checkpoint_id": os.path.join(out_dir, f"outer{worker}"),
            "process_group": mesh["shard"].get_group()}


def check_outer_checkpoint_save(rank, mesh):
    """The sharded OuterOptimizer (SparseLoCo's defaults) 8 inner steps straight through
    (kept for the next launch); again, stopped after 4 and saved with DCP beside the
    model and the inner optimizer (deepreduce.torch.fsdp.per_rank: every rank's shards).
    One DCP checkpoint per worker, over the worker's own ranks."""
    out_dir = os.environ["FSDP_CHECKPOINT"]
    net, outer, inner = _outer_workers(mesh)
    for x, y in batches(rank, 8, seed=13):
        step(net, inner, x, y)
        outer.step()
    torch.save(full(net), os.path.join(out_dir, f"outer_uninterrupted{rank}.pt"))
    net, outer, inner = _outer_workers(mesh)
    for x, y in batches(rank, 8, seed=13)[:4]:
        step(net, inner, x, y)
        outer.step()
    dcp.save(_outer_checkpoint(net, outer, inner), **_worker_checkpoint(mesh, out_dir))
    return {"outer_steps": outer.outer_steps}


def check_outer_checkpoint_load(rank, mesh):
    """In new processes: the rest of the 8 inner steps from the checkpoint; the same bits."""
    out_dir = os.environ["FSDP_CHECKPOINT"]
    net, outer, inner = _outer_workers(mesh)
    loaded = _outer_checkpoint(net, outer, inner)
    dcp.load(loaded, **_worker_checkpoint(mesh, out_dir))
    set_state_dict(net, inner, model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optim"])
    resumed_at = outer.outer_steps
    for x, y in batches(rank, 8, seed=13)[4:]:
        step(net, inner, x, y)
        outer.step()
    uninterrupted = torch.load(os.path.join(out_dir, f"outer_uninterrupted{rank}.pt"))
    return {"outer_identical": same(full(net), uninterrupted), "outer_resumed_at": resumed_at,
            "outer_residuals": len(outer.exchange.selector.memory)}


# ---- checkpoints: written by one launch, continued by new processes ----------------
RESUME = {"sparsifier": dr.TopK(0.05), "value": "qsgd:bits=8", "start_iter": 2}
STOP, STEPS = 4, 8


def _checkpointed(mesh, **settings):
    net = sharded(mesh["shard"], seed=1)
    state = compress_replicas(net, mesh["replicate"], **{**RESUME, **settings})
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    return net, state, opt


def _dcp_state(net, opt, state):
    model_sd, optim_sd = get_state_dict(net, opt)
    return {"model": model_sd, "optim": optim_sd, "deepreduce": state}


def check_checkpoint_save(rank, mesh):
    """Train STEPS steps straight through (their parameters kept for the next launch);
    again, stopped after STOP and saved with DCP."""
    out_dir = os.environ["FSDP_CHECKPOINT"]
    data = batches(rank, STEPS, seed=3)
    net, state, opt = _checkpointed(mesh)
    for x, y in data:
        step(net, opt, x, y)
    torch.save(full(net), os.path.join(out_dir, f"uninterrupted{rank}.pt"))
    net, state, opt = _checkpointed(mesh)
    for x, y in data[:STOP]:
        step(net, opt, x, y)
    dcp.save(_dcp_state(net, opt, state), checkpoint_id=os.path.join(out_dir, "ckpt"))
    return {"iter": state.iter, "residuals": len(state.exchange.selector.memory)}


def check_checkpoint_load(rank, mesh):
    """In new processes: load the checkpoint, train the rest; the same bits as the run
    that never stopped. Then loads refused: other settings, another layout."""
    out_dir = os.environ["FSDP_CHECKPOINT"]
    path = os.path.join(out_dir, "ckpt")
    net, state, opt = _checkpointed(mesh)
    loaded = _dcp_state(net, opt, state)
    dcp.load(loaded, checkpoint_id=path)
    set_state_dict(net, opt, model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optim"])
    out = {"iter": state.iter, "residuals": len(state.exchange.selector.memory)}
    for x, y in batches(rank, STEPS, seed=3)[STOP:]:
        step(net, opt, x, y)
    uninterrupted = torch.load(os.path.join(out_dir, f"uninterrupted{rank}.pt"))
    out["identical"] = same(full(net), uninterrupted)
    out["other_settings"] = _refusal(path, *_checkpointed(mesh, value="fp16"))
    # the same four ranks as 4 shards of one replica
    flat = init_device_mesh("cpu", (1, RANKS), mesh_dim_names=("replicate", "shard"))
    out["other_layout"] = _refusal(path, *_checkpointed(flat))
    return out


def _refusal(path, net, state, opt) -> str:
    try:
        dcp.load({"deepreduce": state}, checkpoint_id=path)
    except ValueError as exc:
        return str(exc)
    return ""


def _raised_in_backward(net, rank):
    x, y = batches(rank, 1)[0]
    try:
        torch.nn.functional.cross_entropy(net(x), y).backward()
    except Exception as exc:  # noqa: BLE001 - the message is the finding
        return {"raised": True, "message": str(exc), "notes": getattr(exc, "__notes__", [])}
    return {"raised": False, "message": ""}


def check_peer_dies(rank, mesh):
    """Rank 2 leaves after two steps, as a killed process does; rank 0, its peer in the
    replicate group, fails in the hook's allgather, naming the rank, the FSDP module and
    the collective (run alone, with a short timeout: ranks 1 and 3 fail in FSDP's own
    collectives, which say what they say)."""
    net = sharded(mesh["shard"])
    compress_replicas(net, mesh["replicate"], sparsifier=dr.TopK(0.1), start_iter=0,
                      check_finite=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for i, (x, y) in enumerate(batches(rank, 3, seed=12)):
        if i == 2 and rank == 2:
            exit_now()
        try:
            step(net, opt, x, y)
        except Exception as exc:  # noqa: BLE001 - what it says is the finding
            return {"step": i, "type": type(exc).__name__, "message": str(exc)}
    return {"step": None}


def check_refusals(rank, mesh):
    """What compress_replicas refuses, saying why: a model FSDP2 shards on the 2-D mesh
    (it all-reduces across replicas itself), a model without FSDP modules."""
    out = {}
    for name, net in (("native_hsdp", sharded(mesh)), ("unsharded", model())):
        try:
            compress_replicas(net, mesh["replicate"])
            out[name] = ""
        except ValueError as exc:
            out[name] = str(exc)
    return out


CHECKS = [check_lossless, check_unused_parameters, check_compressed_trains,
          check_device_path, check_mixed_precision, check_nonfinite, check_misconfigured,
          check_other_layout, check_refusals, check_outer_over_shards]


def main(rank, out_dir, port, *only):
    prepare(port)
    # (a short timeout: check_peer_dies waits for a rank that is gone)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=30))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    checks = [globals()[name] for name in only] if only else CHECKS
    run_checks(rank, out_dir, [_with_mesh(check, mesh) for check in checks])
    dist.destroy_process_group()
    exit_now()


def _with_mesh(check, mesh):
    def run(rank):
        return check(rank, mesh)
    run.__name__ = check.__name__
    return run


if __name__ == "__main__":
    launch(main, nprocs=RANKS, args=(sys.argv[1], int(sys.argv[2]), *sys.argv[3:]))
