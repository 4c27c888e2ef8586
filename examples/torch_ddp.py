"""Train a small MLP with PyTorch DDP on two gloo ranks of this machine, with deepreduce.

    python examples/torch_ddp.py                 # deepreduce: Top-1%, auto indices, fp16
    python examples/torch_ddp.py --dense         # DDP's own allreduce, for comparison

Each rank learns the same synthetic regression task from its own batches; the
hook sends each gradient's largest 1% (error feedback keeps the rest for later
steps). It prints the loss and, for deepreduce, the bytes sent per step against
DDP's dense bytes. Across hosts, start one process per rank with the usual
MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE and call ``train(rank, world)``.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import deepreduce as dr
import deepreduce.torch as drt


def train(rank: int, world: int, steps: int = 200, dense: bool = False) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)                       # same initial model on every rank
    net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                              torch.nn.Linear(512, 512), torch.nn.ReLU(),
                              torch.nn.Linear(512, 1))
    target = torch.nn.Linear(64, 1)            # the function to learn
    model = torch.nn.parallel.DistributedDataParallel(net)
    state = None
    if not dense:
        state = drt.DeepReduceState(sparsifier=dr.TopK(0.01), index="auto", value="fp16",
                                    start_iter=10)
        model.register_comm_hook(state, drt.deepreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    for step in range(steps):
        if state is not None and step == steps - 1:
            before = state.stats.snapshot()
        x = torch.randn(64, 64, generator=data)
        with torch.no_grad():
            y = torch.sin(target(x))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if rank == 0 and (step + 1) % max(1, steps // 5) == 0:
            print(f"step {step + 1:4d}  loss {loss.item():.4f}", flush=True)
    if rank == 0 and state is not None:
        last = state.stats.snapshot() - before    # every bucket of the last step
        print(f"deepreduce: {last.bytes_sent:,} bytes sent in the last step against "
              f"{last.dense_bytes:,} dense ({last.ratio:.1f}x fewer)")
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dense", action="store_true", help="DDP's allreduce, no hook")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    mp.spawn(train, args=(args.ranks, args.steps, args.dense), nprocs=args.ranks)


if __name__ == "__main__":
    main()
