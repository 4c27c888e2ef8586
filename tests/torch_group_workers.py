"""Four-rank checks of when and where deepreduce makes its process groups, on gloo,
run by tests/test_cuda_path.py.

Launched as ``python tests/torch_group_workers.py OUT PORT``: four spawned processes
(two "nodes" of two, numbered as torchrun numbers them) form a gloo group; every rank
runs every check and writes its findings to ``OUT/rank<r>.json``. Every call of
``new_group`` / ``split_group`` is recorded with the thread that made it.
"""

import threading

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import deepreduce as dr
import deepreduce.torch as drt
from deepreduce.torch.outer import OuterOptimizer
from torch_common import batches, launch, leave, model, prepare, run_checks, steps

WORLD, LOCAL = 4, 2
#: (thread name, group_desc, ranks) of every process group made since the last reset
MADE = []


def record_group_creation():
    for name in ("new_group", "split_group"):
        original = getattr(dist, name)

        def recorded(*args, _original=original, **kwargs):
            ranks = kwargs.get("ranks", args[0] if args else None)
            if ranks is None and "split_ranks" in kwargs:
                ranks = kwargs["split_ranks"]
            MADE.append((threading.current_thread().name, kwargs.get("group_desc"),
                         list(ranks) if ranks is not None else None))
            return _original(*args, **kwargs)
        setattr(dist, name, recorded)


def made_since(start):
    return [list(entry) for entry in MADE[start:]]


def check_hook_binds_every_group_at_once(rank):
    """The hierarchical hook on the world: its own group, its flag group and the two
    levels' sub-groups are made when it binds, on the binding thread or on its
    transport's thread while the binder waits; none afterwards."""
    start = len(MADE)
    ddp = DDP(model())
    state = drt.DeepReduceState(communicator="hierarchical", sparsifier=dr.TopK(0.05),
                                start_iter=0, min_compression_rate=0)
    ddp.register_comm_hook(state, drt.deepreduce_hook)
    data = batches(rank, 3, seed=11)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    steps(ddp, opt, data[:1])
    at_bind = made_since(start)
    steps(ddp, opt, data[1:])
    return {"at_bind": at_bind, "later": made_since(start + len(at_bind)), "iter": state.iter}


def check_explicit_bind_on_the_main_thread(rank):
    """state.bind() before training makes the groups there; the backward pass makes none."""
    start = len(MADE)
    ddp = DDP(model())
    state = drt.DeepReduceState(sparsifier=dr.TopK(0.05), start_iter=0, min_compression_rate=0,
                                process_group=dist.new_group(list(range(WORLD))))
    ddp.register_comm_hook(state, drt.deepreduce_hook)
    before = len(MADE)
    state.bind()
    at_bind = made_since(before)
    steps(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), batches(rank, 2, seed=12))
    return {"user": made_since(start)[:1], "at_bind": at_bind,
            "later": made_since(before + len(at_bind)), "main": threading.main_thread().name}


def check_subset_groups(rank):
    """DiLoCo's layout: DDP with the hook inside each node's group, an OuterOptimizer
    across the nodes' ranks of the same local rank (groups of 2 of 4). Every rank makes
    the user's groups; deepreduce's are made by their members when each binds; the
    outer step leaves the members of each outer group with the same weights."""
    node, local = divmod(rank, LOCAL)
    inner = [dist.new_group(list(range(n * LOCAL, n * LOCAL + LOCAL)))
             for n in range(WORLD // LOCAL)][node]
    outer_group = [dist.new_group(list(range(each, WORLD, LOCAL)))
                   for each in range(LOCAL)][local]
    start = len(MADE)
    ddp = DDP(model(), process_group=inner)
    state = drt.DeepReduceState(process_group=inner, sparsifier=dr.TopK(0.05), start_iter=0,
                                min_compression_rate=0)
    ddp.register_comm_hook(state, drt.deepreduce_hook)
    outer = OuterOptimizer(ddp.module.named_parameters(), process_group=outer_group,
                           sync_every=2, mode="diloco")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for x, y in batches(rank, 4, seed=13):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        outer.step()
    weights = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    everyone = [torch.empty_like(weights) for _ in range(WORLD)]
    dist.all_gather(everyone, weights)
    peer = (rank + LOCAL) % WORLD  # the other member of this rank's outer group
    return {"made": made_since(start), "outer_steps": outer.outer_steps,
            "same_as_outer_peer": bool(torch.equal(everyone[peer], weights))}


CHECKS = [check_hook_binds_every_group_at_once, check_explicit_bind_on_the_main_thread,
          check_subset_groups]


def main(rank, out_dir, port, only=None):
    prepare(port, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank % LOCAL),
            LOCAL_WORLD_SIZE=str(LOCAL))
    record_group_creation()
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    checks = [globals()[only]] if only else CHECKS
    run_checks(rank, out_dir, checks)
    leave()


if __name__ == "__main__":
    launch(main, nprocs=WORLD)
