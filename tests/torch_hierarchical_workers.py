"""Four-rank checks of the hierarchical communicator on gloo, run by
tests/test_torch_hierarchical.py.

Launched as ``python tests/torch_hierarchical_workers.py OUT PORT``: four spawned
processes, numbered as torchrun numbers two nodes of two (``RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE=2``, ``WORLD_SIZE=4`` in their environment), form a gloo group on
127.0.0.1:PORT; every rank runs every check and writes its findings to
``OUT/rank<r>.json``. A launch of its own, so that the two-rank launch of
tests/torch_workers.py stays as quick as it was.
"""

import hashlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import deepreduce as dr
import deepreduce.torch as drt
from deepreduce.collectives import Traffic
from torch_common import (batches, launch, leave, model, prepare, raised_in_first_step,
                          resumed, run_checks)

WORLD, LOCAL = 4, 2
LOSSLESS = {"sparsifier": None, "index": "varint", "value": "raw", "min_size": 0}
#: The node groups and the shard groups of the reference hook, made once by every rank.
GROUPS = {}


def train(ddp, data, lr=0.1):
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def digest(module) -> str:
    """The bits of every parameter: equal digests, identical weights."""
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def hierarchical(**settings):
    return drt.DeepReduceState(communicator="hierarchical", start_iter=0,
                               min_compression_rate=0, **settings)


def node_first_hook(state, bucket):
    """The dense allreduce that sums each node first, then across nodes (what a
    hierarchical dense allreduce computes): with two ranks per group each sum is one
    addition, the same bits whatever order gloo adds in."""
    buffer = bucket.buffer().div_(WORLD)
    rank = dist.get_rank()
    dist.all_reduce(buffer, group=GROUPS["node"][rank // LOCAL])
    dist.all_reduce(buffer, group=GROUPS["shard"][rank % LOCAL])
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def check_split(rank):
    """TorchTransport.split: the ranks of a node, and those holding the same shard."""
    transport = drt.transport_of()
    intra = transport.split(rank // LOCAL, rank % LOCAL)
    inter = transport.split(rank % LOCAL, rank // LOCAL)
    return {"intra": [intra.rank, intra.size, [bytes(f).hex() for f in
                                               intra.allgather(bytes([rank]), Traffic(), "t")]],
            "inter": [inter.rank, inter.size, [bytes(f).hex() for f in
                                               inter.allgather(bytes([rank]), Traffic(), "t")]]}


def check_lossless(rank):
    """A lossless hierarchical hook trains bit for bit as the node-first dense allreduce,
    with each communicator between the nodes; DDP's flat allreduce within rounding."""
    data = batches(rank, 5)
    reference = DDP(model())
    reference.register_comm_hook(None, node_first_hook)
    train(reference, data)
    flat = DDP(model())
    train(flat, data)
    out = {"reference": digest(reference.module),
           "flat_max_difference": max(float((a - b).detach().abs().max()) for a, b in zip(
               reference.parameters(), flat.parameters()))}
    for inter in ("allgather", "sparse_allreduce", "block"):
        ddp = DDP(model())
        state = hierarchical(**LOSSLESS, communicator_options={"inter": inter})
        ddp.register_comm_hook(state, drt.deepreduce_hook)
        train(ddp, data)
        out[inter] = digest(ddp.module)
        out[f"{inter}_compressed"] = state.stats.total.compressed_tensors
    return out


def check_topk_trains(rank):
    """Top-k with error feedback: the loss on the ranks' data falls, every rank ends with
    the same weights, and a rank sends about half its gradient's payload between nodes."""
    data = batches(rank, 4, seed=2) * 10      # four batches per rank, ten epochs
    ddp = DDP(model(seed=2))
    state = hierarchical(sparsifier=dr.TopK(0.05), value="fp16", min_size=1024)
    ddp.register_comm_hook(state, drt.deepreduce_hook)
    losses = train(ddp, data, lr=0.05)
    return {"first": sum(losses[:4]) / 4, "last": sum(losses[-4:]) / 4,
            "digest": digest(ddp.module), "compressed": state.stats.total.compressed_tensors}


def check_resume(rank):
    """A run stopped and resumed from a checkpoint continues bit-identically."""
    data = batches(rank, 8, seed=3)
    settings = {"sparsifier": dr.TopK(0.02), "value": "qsgd:bits=8", "start_iter": 2,
                "min_compression_rate": 0, "communicator": "hierarchical"}
    uninterrupted, ddp, _, checkpoint = resumed(settings, data, 4, digest)
    shapes = {k: tuple(v.shape) for k, v in checkpoint["hook"]["residuals"].items()}
    return {"identical": digest(ddp.module) == uninterrupted, "residual_shapes": shapes}


def check_allreduce(rank):
    """drt.allreduce over the hierarchical communicator: dense and sparse COO, lossless."""
    g = torch.Generator().manual_seed(rank)
    dense = torch.randn(40, 30, generator=g)
    gathered = [torch.empty_like(dense) for _ in range(WORLD)]
    dist.all_gather(gathered, dense)
    expected = (gathered[0] + gathered[1]) + (gathered[2] + gathered[3])
    state = hierarchical(**LOSSLESS)
    total = drt.allreduce(dense, state, name="w", op="sum")
    emb = torch.nn.Embedding(50, 8, sparse=True)
    emb(torch.tensor([rank, 7, 20 + rank])).sum().backward()
    expected_sparse = emb.weight.grad.to_dense().clone()
    dist.all_reduce(expected_sparse)   # (ones: every order adds them exactly)
    reduced = drt.allreduce(emb.weight.grad, state, name="emb", op="sum")
    return {"dense": torch.equal(total, expected),
            "sparse": reduced.is_sparse and torch.equal(reduced.to_dense(), expected_sparse)}


def check_misconfigured(rank):
    """Ranks configured differently raise on every rank, naming the difference."""
    options = {"local_size": 4} if rank == 3 else {}
    return raised_in_first_step(rank, lambda: hierarchical(communicator_options=options))


CHECKS = [check_split, check_lossless, check_topk_trains, check_resume, check_allreduce,
          check_misconfigured]


def main(rank, out_dir, port, only=None):
    prepare(port, RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank % LOCAL),
            LOCAL_WORLD_SIZE=str(LOCAL))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    # every rank creates every group, in the same order
    GROUPS["node"] = [dist.new_group([n * LOCAL + j for j in range(LOCAL)])
                      for n in range(WORLD // LOCAL)]
    GROUPS["shard"] = [dist.new_group(list(range(j, WORLD, LOCAL))) for j in range(LOCAL)]
    run_checks(rank, out_dir, [globals()[only]] if only else CHECKS)
    leave()


if __name__ == "__main__":
    launch(main, nprocs=WORLD)
