"""Train a small MLP with PyTorch DDP and deepreduce's communication hook.

    torchrun --nproc-per-node=2 examples/torch_ddp.py           # Top-1%, auto indices, fp16
    torchrun --nproc-per-node=2 examples/torch_ddp.py --dense   # DDP's own allreduce

Across two hosts, run on each (HOST being the first one's address):

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d \
        --rdzv-endpoint=HOST:29500 examples/torch_ddp.py

Each rank learns the same synthetic regression task from its own batches; the
hook sends each gradient's largest 1% (error feedback keeps the rest for later
steps). Rank 0 prints the loss and, for deepreduce, the bytes sent in the last
step against DDP's dense bytes. gloo on CPUs, NCCL when CUDA is available.
"""

import argparse
import os

import torch
import torch.distributed as dist

import deepreduce as dr
import deepreduce.torch as drt


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dense", action="store_true", help="DDP's allreduce, no hook")
    args = parser.parse_args()

    rank = int(os.environ["RANK"])             # set by torchrun, with WORLD_SIZE,
    local_rank = int(os.environ["LOCAL_RANK"])  # LOCAL_RANK, MASTER_ADDR and MASTER_PORT
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:  # momentum the sparse updates leave alone decays into subnormals, slow on CPUs
        torch.set_flush_denormal(True)
    dist.init_process_group("nccl" if cuda else "gloo")

    torch.manual_seed(0)                       # same initial model on every rank
    net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                              torch.nn.Linear(512, 512), torch.nn.ReLU(),
                              torch.nn.Linear(512, 1)).to(device)
    target = torch.nn.Linear(64, 1).to(device)  # the function to learn
    model = torch.nn.parallel.DistributedDataParallel(
        net, device_ids=[local_rank] if cuda else None)
    state = None
    if not args.dense:
        state = drt.DeepReduceState(sparsifier=dr.TopK(0.01), index="auto", value="fp16",
                                    start_iter=10)
        model.register_comm_hook(state, drt.deepreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    data = torch.Generator().manual_seed(rank)  # each rank its own batches
    for step in range(args.steps):
        if state is not None and step == args.steps - 1:
            before = state.stats.snapshot()
        x = torch.randn(64, 64, generator=data).to(device)
        with torch.no_grad():
            y = torch.sin(target(x))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if rank == 0 and (step + 1) % max(1, args.steps // 5) == 0:
            print(f"step {step + 1:4d}  loss {loss.item():.4f}", flush=True)
    if rank == 0 and state is not None:
        last = state.stats.snapshot() - before  # every bucket of the last step
        print(f"deepreduce: {last.bytes_sent:,} bytes sent in the last step against "
              f"{last.dense_bytes:,} dense ({last.ratio:.1f}x fewer)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
