"""Train a small MLP sharded with FSDP2, its replicas averaged by deepreduce (HSDP).

    torchrun --nproc-per-node=4 examples/fsdp_hsdp.py            # 2 replicas x 2 shards
    torchrun --nproc-per-node=4 examples/fsdp_hsdp.py --native   # FSDP2's own 2-D HSDP

The ranks form a (replicas, shards) device mesh. Each FSDP unit's parameters are
sharded over the ``shard`` dimension, where FSDP2 all-gathers parameters and
reduce-scatters gradients every step, dense: put it on the fast link (the ranks of
one node). The ``replicate`` dimension, where each rank's gradient shard is averaged
with the same shard of the other replicas, is the one to put on the slow link
between nodes, and the one deepreduce compresses (Top-1%, auto indices, fp16 values
after 10 plain steps). Rank 0 prints the loss and the bytes its last step handed to
the replicate group against the bytes FSDP2's own HSDP hands to its all-reduce there
(the whole shard, in the reduce dtype). gloo on CPUs.

Across hosts, one replica per host (HOST being the first one's address):

    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST:29500 examples/fsdp_hsdp.py --device cuda --shards 8

``--device cuda`` runs the same loop on GPUs with NCCL; it has not been run by the
project's tests, which have no GPU.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import deepreduce as dr
from deepreduce.torch.fsdp import compress_replicas


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--shards", type=int, default=2,
                        help="ranks per replica (the ranks of a node, across hosts)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--native", action="store_true",
                        help="FSDP2's own HSDP (a 2-D mesh), no deepreduce")
    args = parser.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # from torchrun
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:  # momentum the sparse updates leave alone decays into subnormals, slow on CPUs
        torch.set_flush_denormal(True)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    if world % args.shards:
        raise SystemExit(f"--shards {args.shards} does not divide the {world} ranks")
    mesh = init_device_mesh(args.device, (world // args.shards, args.shards),
                            mesh_dim_names=("replicate", "shard"))

    torch.manual_seed(0)                       # same initial model on every rank
    net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                              torch.nn.Linear(512, 512), torch.nn.ReLU(),
                              torch.nn.Linear(512, 1)).to(args.device)
    target = torch.nn.Linear(64, 1).to(args.device)  # the function to learn
    # native HSDP shards over "shard" and all-reduces over "replicate" itself; with
    # deepreduce, FSDP2 only shards, and the hook averages across the replicas
    shard_mesh = mesh if args.native else mesh["shard"]
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=shard_mesh)
    fully_shard(net, mesh=shard_mesh)
    state = None
    if not args.native:
        state = compress_replicas(net, mesh["replicate"], sparsifier=dr.TopK(0.01),
                                  index="auto", value="fp16", start_iter=10)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

    data = torch.Generator().manual_seed(rank)  # each rank its own batches
    for step in range(args.steps):
        if state is not None and step == args.steps - 1:
            before = state.bytes_handed
        x = torch.randn(64, 64, generator=data).to(args.device)
        with torch.no_grad():
            y = torch.sin(target(x))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        if rank == 0 and (step + 1) % max(1, args.steps // 5) == 0:
            print(f"step {step + 1:4d}  loss {loss.item():.4f}", flush=True)
    # what FSDP2's HSDP all-reduce is handed per step: every unit's flat gradient shard,
    # each parameter's rows padded to a multiple of the shards
    shard_bytes = sum(-(-p.shape[0] // args.shards) * p[0].numel() * p.element_size()
                      for p in net.parameters())
    if rank == 0 and state is not None:
        last = state.bytes_handed - before  # every unit of the last step, padding included
        print(f"between replicas: deepreduce {last:,} bytes in the last step, "
              f"FSDP2's HSDP {shard_bytes:,} ({shard_bytes / last:.1f}x fewer)", flush=True)
    elif rank == 0:
        print(f"between replicas: FSDP2's HSDP {shard_bytes:,} bytes a step", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
