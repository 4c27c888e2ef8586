"""Train a byte-level language model with infrequent synchronisation (SparseLoCo or DiLoCo).

    torchrun --nproc-per-node=2 examples/diloco.py                   # SparseLoCo
    torchrun --nproc-per-node=2 examples/diloco.py --mode diloco     # dense DiLoCo

No DDP: every rank trains its own copy of the model with AdamW on its own batches of
the standard library's ``.py`` files (they ship with Python: nothing is downloaded),
and every ``--sync-every`` inner steps ``deepreduce.torch.outer.OuterOptimizer`` takes
the outer step: SparseLoCo sends the chunk-wise Top-64 of every 64 x 64 tile of each
pseudo-gradient, 2-bit quantised, with error feedback; dense DiLoCo sends all of it
in float32 and steps Nesterov's momentum. Rank 0 prints, at every outer step, the
training loss and the bytes it sent against the dense bytes, and at the end the
validation loss on held-out text. gloo on CPUs, NCCL when CUDA is available.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from deepreduce.torch.outer import OuterOptimizer


def standard_library_text(limit: int) -> bytes:
    """The first ``limit`` bytes of the standard library's top-level ``.py`` files."""
    folder = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py") and total < limit:
            with open(os.path.join(folder, name), "rb") as f:
                chunks.append(f.read())
            total += len(chunks[-1])
    return b"".join(chunks)[:limit]


class ByteModel(torch.nn.Module):
    """The next byte from the previous ``context``: an embedding, then an MLP (every
    weight's sides multiples of 64, so SparseLoCo's 64 x 64 tiles cover them)."""

    def __init__(self, context=32, embedding=64, hidden=512):
        super().__init__()
        self.embed = torch.nn.Embedding(256, embedding)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(context * embedding, hidden), torch.nn.GELU(),
            torch.nn.Linear(hidden, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 256))

    def forward(self, x):
        return self.mlp(self.embed(x).flatten(1))


def windows(data, starts, context):
    """Inputs (``context`` bytes) and targets (the byte after) at ``starts``."""
    batch = data[starts[:, None] + torch.arange(context + 1, device=data.device)]
    return batch[:, :-1], batch[:, -1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("sparseloco", "diloco"), default="sparseloco")
    parser.add_argument("--steps", type=int, default=300, help="inner steps")
    parser.add_argument("--sync-every", type=int, default=30, help="H: inner steps per outer")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3, help="the inner AdamW's")
    args = parser.parse_args()

    rank = int(os.environ["RANK"])             # set by torchrun, with WORLD_SIZE,
    local_rank = int(os.environ["LOCAL_RANK"])  # LOCAL_RANK, MASTER_ADDR and MASTER_PORT
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:  # the ranks share the machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["LOCAL_WORLD_SIZE"])))
    dist.init_process_group("nccl" if cuda else "gloo")

    text = torch.frombuffer(bytearray(standard_library_text(1_000_000)), dtype=torch.uint8)
    text = text.long().to(device)
    train, held_out = text[:-50_000], text[-50_000:]
    torch.manual_seed(0)                       # the same initial model on every rank
    model = ByteModel(args.context).to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    outer = OuterOptimizer(model.named_parameters(), mode=args.mode, sync_every=args.sync_every)

    batches = torch.Generator().manual_seed(rank)   # each rank its own batches
    losses = []
    for _ in range(args.steps):
        starts = torch.randint(0, train.numel() - args.context - 1, (args.batch_size,),
                               generator=batches).to(device)
        x, y = windows(train, starts, args.context)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        inner.step()
        inner.zero_grad()
        losses.append(loss.item())
        if outer.step() and rank == 0:
            last = outer.stats.last
            print(f"outer step {outer.outer_steps:3d}  inner step {outer.inner_steps:4d}  "
                  f"loss {sum(losses[-args.sync_every:]) / args.sync_every:.4f}  "
                  f"sent {last.bytes_sent:,} bytes (bundle {last.bundle_bytes:,}) against "
                  f"{last.dense_bytes:,} dense "
                  f"({last.ratio:.0f}x fewer)", flush=True)
    if outer.inner_steps % args.sync_every:
        outer.sync()                           # the steps since the last outer step
    starts = torch.linspace(0, held_out.numel() - args.context - 2, 4096).long().to(device)
    with torch.no_grad():
        validation = F.cross_entropy(model(windows(held_out, starts, args.context)[0]),
                                     windows(held_out, starts, args.context)[1]).item()
    if rank == 0:
        total = outer.stats.total
        print(f"{args.mode}: validation loss {validation:.4f} after {outer.inner_steps} inner "
              f"and {outer.outer_steps} outer steps; {total.bytes_sent / total.steps:,.0f} bytes "
              f"per outer step on the wire (bundles {total.bundle_bytes / total.steps:,.0f}) "
              f"against {outer.dense_bytes:,} dense ({total.ratio:.0f}x fewer)",
              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
