"""Dense PyTorch DDP versus deepreduce: a character language model on Python's own sources.

    python -m benchmarks.train_text          # two gloo ranks on this machine (make demo BACKEND=torch)

Both runs train the same model (same initial weights, same batches, SGD with
momentum) with ``torch.nn.parallel.DistributedDataParallel`` on two spawned gloo
ranks: once with DDP's own allreduce, once with ``deepreduce_hook`` (Top-k,
``auto`` indices, fp16 values, error feedback). The text is the standard
library's own ``.py`` files, which ship with every Python: nothing is
downloaded. The model predicts the next byte from the previous ``context``
bytes: an ``nn.Embedding`` of the 256 byte values, then an MLP. Rank 0 prints
bytes sent per step, step time and the validation loss side by side and writes
``benchmarks/results/train_text.md``. The two runs step in turn (a dense step,
then a deepreduce step), so that other work on the machine slows both alike;
the report breaks the deepreduce step down into the hook's phases.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import deepreduce as dr
import deepreduce.torch as drt

from benchmarks.common import RESULTS, add_compression_arguments, free_port, write_report


#: The hook's phases in a step (``StepStats``' ``<phase>_seconds``, summed over the buckets).
PHASES = ("encode", "exchange", "decode", "codec")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--context", type=int, default=16, help="bytes of context")
    parser.add_argument("--embedding", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    add_compression_arguments(parser)
    parser.add_argument("--start-iter", type=int, default=50,
                        help="plain allreduce steps before deepreduce starts")
    parser.add_argument("--text-bytes", type=int, default=2_000_000,
                        help="bytes of standard-library source to read")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS / "train_text.md"))
    return parser.parse_args(argv)


def standard_library_text(limit: int) -> bytes:
    """The first ``limit`` bytes of the standard library's top-level ``.py`` files, by name."""
    folder = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py") and total < limit:
            with open(os.path.join(folder, name), "rb") as f:
                chunks.append(f.read())
            total += len(chunks[-1])
    return b"".join(chunks)[:limit]


class CharModel(torch.nn.Module):
    """Next byte from the previous ``context`` bytes: embedding, then a two-layer MLP."""

    def __init__(self, context, embedding, hidden):
        super().__init__()
        self.embed = torch.nn.Embedding(256, embedding)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(context * embedding, hidden),
                                       torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                                       torch.nn.ReLU(), torch.nn.Linear(hidden, 256))

    def forward(self, x):
        return self.mlp(self.embed(x).flatten(1))


def windows(data: torch.Tensor, starts: torch.Tensor, context: int):
    """Inputs (``context`` bytes) and targets (the next byte) at ``starts``."""
    offsets = starts[:, None] + torch.arange(context + 1)
    batch = data[offsets]
    return batch[:, :-1], batch[:, -1]


def validation_loss(model, data, context, count=20_000):
    starts = torch.linspace(0, data.numel() - context - 2, count).long()
    with torch.no_grad():
        x, y = windows(data, starts, context)
        return torch.nn.functional.cross_entropy(model(x), y).item()


class Run:
    """One of the two runs (``scheme`` "dense" or "deepreduce"): its model, optimizer,
    batches and what its steps measured; :func:`worker` steps the two in turn."""

    def __init__(self, rank, args, text, scheme):
        torch.manual_seed(args.seed)                      # same initial weights on every rank
        self.model = CharModel(args.context, args.embedding, args.hidden)
        self.ddp = DDP(self.model)
        self.state = None
        if scheme == "deepreduce":
            self.state = drt.DeepReduceState(sparsifier=dr.TopK(args.ratio), index=args.index,
                                             value=args.value, start_iter=args.start_iter,
                                             seed=args.seed)
            self.ddp.register_comm_hook(self.state, drt.deepreduce_hook)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=args.lr, momentum=args.momentum)
        self.args, self.text = args, text
        self.batches = torch.Generator().manual_seed(1000 * args.seed + rank)  # each rank its own
        self.times, self.sent, self.phases = [], [], []
        self.dense_bytes = 4 * sum(p.numel() for p in self.model.parameters())

    def step(self):
        args, state = self.args, self.state
        train_data = self.text[0]
        starts = torch.randint(0, train_data.numel() - args.context - 1, (args.batch_size,),
                               generator=self.batches)
        x, y = windows(train_data, starts, args.context)
        before = state.stats.snapshot() if state is not None else None
        start = time.perf_counter()
        self.opt.zero_grad()
        self.loss = torch.nn.functional.cross_entropy(self.ddp(x), y)
        self.loss.backward()
        self.opt.step()
        self.times.append(time.perf_counter() - start)
        if state is None:
            self.sent.append(self.dense_bytes)
        else:  # the buckets of this step, summed (their futures completed in backward)
            step = state.stats.snapshot() - before
            self.sent.append(step.bytes_sent)
            self.phases.append([getattr(step, f"{phase}_seconds") for phase in PHASES]
                               + [step.steps])

    def result(self) -> dict:
        """Final loss, step times, bytes sent per step, phases, validation loss."""
        return {"loss": self.loss.item(), "times": self.times, "sent": self.sent,
                "phases": self.phases, "dense_bytes": self.dense_bytes,
                "val_loss": validation_loss(self.model, self.text[1], self.args.context),
                "params": sum(p.numel() for p in self.model.parameters())}


def worker(rank, args, port, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # Top-k leaves most coordinates without an update at each step, and their momentum
    # decays by 0.9 a step into subnormal floats after about 750 steps, where every
    # optimizer operation on them takes a slow microcode path on x86 (a fifth more
    # time a step, which is not the hook's): flushed to zero in both runs, as sparse
    # training on CPUs wants.
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    raw = np.frombuffer(standard_library_text(args.text_bytes), dtype=np.uint8)
    data = torch.from_numpy(raw.astype(np.int64))
    cut = int(0.9 * data.numel())
    text = (data[:cut], data[cut:])
    runs = {scheme: Run(rank, args, text, scheme) for scheme in ("dense", "deepreduce")}
    # the two runs step in turn: a machine shared with other work slows both alike
    for _ in range(args.steps):
        for run in runs.values():
            run.step()
    out = {scheme: run.result() for scheme, run in runs.items()}
    if rank == 0:
        for scheme in runs:
            print(f"{scheme}: validation loss {out[scheme]['val_loss']:.4f}", flush=True)
        results.update(out, text_bytes=int(raw.size))
    dist.destroy_process_group()


def report(args, results, load):
    dense, ours = results["dense"], results["deepreduce"]
    after = args.start_iter + 10  # deepreduce's steps, past the warm-up and DDP's rebuild
    sent_dense = int(np.mean(dense["sent"][after:]))
    sent_ours = int(np.mean(ours["sent"][after:]))
    ratio = sent_dense / sent_ours
    gap = ours["val_loss"] / dense["val_loss"] - 1
    ms = lambda run: 1e3 * float(np.median(run["times"][after:]))  # noqa: E731
    met = [("validation loss within 2% of dense", gap <= 0.02),
           ("at least 30x fewer bytes per step", ratio >= 30)]
    lines = [
        "# Dense PyTorch DDP versus deepreduce: a character model on Python's sources", "",
        "Produced by `python -m benchmarks.train_text` (`make demo BACKEND=torch`): "
        f"torch {torch.__version__}, Python {platform.python_version()}, {args.ranks} gloo "
        f"ranks on one machine ({os.cpu_count()} cores), one intra-op thread per rank.", "",
        f"Task: predict the next byte of the standard library's `.py` files "
        f"({results['text_bytes']:,} bytes read in file-name order, the last 10% held out) "
        f"from the previous {args.context} bytes. Model: `nn.Embedding(256, "
        f"{args.embedding})`, then an MLP {args.context * args.embedding}-{args.hidden}-"
        f"{args.hidden}-256 ({dense['params']:,} parameters). SGD lr {args.lr} momentum "
        f"{args.momentum}, batch {args.batch_size} per rank, {args.steps} steps, the same "
        "initial weights and batches in both runs, subnormal floats flushed to zero in both "
        "(`torch.set_flush_denormal(True)`: the momentum of the coordinates Top-k leaves "
        "without an update decays into them). deepreduce: `DeepReduceState(sparsifier="
        f"TopK({args.ratio}), index={args.index!r}, value={args.value!r}, start_iter="
        f"{args.start_iter})` with error feedback; parameters under 1,024 elements travel "
        "losslessly in the same bundle. Bytes are what each rank contributes per step after "
        f"step {after} (dense: DDP's float32 buckets); step times are medians over the "
        "same steps, the two runs stepping in turn. Load average: "
        f"{load[0]:.1f} at the start, {load[1]:.1f} at the end.",
        "",
        "| | dense DDP | deepreduce |", "|---|---:|---:|",
        f"| bytes sent per step (per rank) | {sent_dense:,} | {sent_ours:,} |",
        f"| bytes fewer than dense | 1x | {ratio:.1f}x |",
        f"| median step time | {ms(dense):.2f} ms | {ms(ours):.2f} ms |",
        f"| final training loss (rank 0's batch) | {dense['loss']:.4f} | {ours['loss']:.4f} |",
        f"| validation loss (nats per byte) | {dense['val_loss']:.4f} | "
        f"{ours['val_loss']:.4f} ({gap:+.2%}) |", "",
        "Targets: " + "; ".join(f"{what}: {'met' if ok else 'NOT met'}" for what, ok in met)
        + ".", "", *breakdown(dense, ours, after)]
    return "\n".join(lines), all(ok for _, ok in met)


def breakdown(dense, ours, after) -> list:
    """The report's lines on where the hook's step goes (medians per step, rank 0)."""
    dense_ms = 1e3 * float(np.median(dense["times"][after:]))
    steps = 1e3 * np.asarray(ours["times"][after:])
    phases = np.asarray(ours["phases"][after:], dtype=float)
    encode, exchange, decode, codec = (1e3 * phases[:, i] for i in range(len(PHASES)))
    buckets = phases[:, len(PHASES)]
    rest = steps - dense_ms - encode - exchange - decode
    median = lambda values: float(np.median(values))  # noqa: E731
    rows = [("dense step (DDP's allreduce)", dense_ms),
            ("deepreduce step", median(steps)),
            ("**hook's own work** (deepreduce step - dense step)", median(steps) - dense_ms),
            ("encode: error feedback, Top-k, codecs (autograd thread)", median(encode)),
            ("exchange: the collectives, waiting for the other rank included", median(exchange)),
            ("decode and sums (communication thread)", median(decode)),
            ("of encode and decode: inside the codecs", median(codec)),
            ("the rest: hand-offs, futures, the hook's Python (own work - the three)",
             median(rest))]
    return ["## Where the hook's step goes", "",
            f"Rank 0, medians per step over the same steps ({median(buckets):.0f} buckets a "
            "step; each phase summed over them). Encode runs in the backward pass; the "
            "exchange and decode of one bucket run on the communication thread and may "
            "overlap the next bucket's encode, so the rest can be small or negative.", "",
            "| | ms per step |", "|---|---:|",
            *(f"| {what} | {value:.2f} |" for what, value in rows), ""]


def main(argv=None):
    args = parse_args(argv)
    load_start = os.getloadavg()[0]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(worker, args=(args, free_port(), results), nprocs=args.ranks)
        results = dict(results)
    text, _ = report(args, results, (load_start, os.getloadavg()[0]))
    write_report(args.out, text)
    print(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
