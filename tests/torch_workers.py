"""Two-rank checks of deepreduce.torch on gloo, run by tests/test_torch.py.

Launched as ``python tests/torch_workers.py OUT PORT``: two spawned processes
form a gloo group on 127.0.0.1:PORT, every rank runs every check and writes
its findings to ``OUT/rank<r>.json``; the pytest side asserts on them. One
launch holds all checks because each process pays torch's import time. The model,
data and launch helpers the torch workers share are tests/torch_common.py's.
"""

import os
import pickle

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import deepreduce as dr
import deepreduce.torch as drt
from deepreduce.collectives import Traffic
from torch_common import (batches, launch, leave, model, params, prepare,
                          raised_in_first_step, resumed, run_checks, same, steps)

LOSSLESS = {"sparsifier": None, "index": "varint", "value": "raw"}


def train(ddp, data, lr=0.1):
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    steps(ddp, opt, data)
    return opt


def check_lossless(rank):
    """A lossless state over every communicator trains exactly as DDP's allreduce."""
    data = batches(rank, 6)
    reference = DDP(model())
    train(reference, data)
    out = {}
    for communicator in ("allgather", "sparse_allreduce", "block"):
        ddp = DDP(model())
        state = drt.DeepReduceState(**LOSSLESS, communicator=communicator, start_iter=2,
                                    min_compression_rate=0)
        ddp.register_comm_hook(state, drt.deepreduce_hook)
        train(ddp, data)
        out[communicator] = same(params(ddp), params(reference))
        out[f"{communicator}_compressed"] = state.stats.total.compressed_tensors
    return out


def error_feedback_state():
    return drt.DeepReduceState(process_group=None, sparsifier=dr.TopK(0.05), value="raw",
                               start_iter=0, min_compression_rate=0)


#: Built before init_process_group, as Lightning's DDPStrategy(ddp_comm_state=...) does.
EARLY_STATES = {}


def check_error_feedback(rank):
    """Top-k with error feedback: delivered sum + everyone's residual == sum of inputs.
    The state was built before the process group existed."""
    net = model()
    ddp = DDP(net)
    state = EARLY_STATES.pop("error_feedback")
    ddp.register_comm_hook(state, drt.deepreduce_hook)
    x, y = batches(rank, 1)[0]
    local = model()
    torch.nn.functional.cross_entropy(local(x), y).backward()
    inputs = [p.grad.detach().clone() for p in local.parameters()]
    torch.nn.functional.cross_entropy(ddp(x), y).backward()
    delivered = [p.grad.detach().clone() * 2 for p in net.parameters()]   # average -> sum
    memory = state.exchange.selector.memory
    residuals = [torch.from_numpy(memory.residual(key).copy()) if key in memory
                 else torch.zeros_like(g) for key, g in zip(_keys(state, net), inputs)]
    summed_inputs = [_sum(t) for t in inputs]
    summed_residuals = [_sum(t) for t in residuals]
    return {"conserved": all(torch.allclose(d + r, i, rtol=0, atol=1e-6)
                             for d, r, i in zip(delivered, summed_residuals, summed_inputs)),
            "sparse": all(bool((d != 0).float().mean() < 0.2)
                          for d, p in zip(delivered, net.parameters()) if p.numel() >= 1024)}


def _keys(state, net):
    return [state._keys[id(p)] for p in net.parameters()]


def _sum(tensor):
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, tensor.contiguous())
    return everyone[0] + everyone[1]


def check_resume(rank):
    """A run stopped and resumed from a checkpoint continues bit-identically."""
    data = batches(rank, 10, seed=3)
    settings = {"sparsifier": dr.TopK(0.02), "value": "qsgd:bits=8", "start_iter": 2,
                "min_compression_rate": 0}
    uninterrupted, ddp, state, _ = resumed(settings, data, 5, params)
    restored = pickle.loads(pickle.dumps(state))
    # the device path (forced on the CPU): its residuals are torch tensors in the checkpoint
    device_uninterrupted, device_ddp, _, device_checkpoint = resumed(
        {**settings, "device_path": True}, data, 5, params)
    return {"identical": same(params(ddp), uninterrupted), "iter": state.iter,
            "pickled_group": restored.process_group is None,
            "pickled_residuals": len(restored.exchange.selector.memory),
            "device_identical": same(params(device_ddp), device_uninterrupted),
            "device_residuals": len(device_checkpoint["hook"]["residuals"])}


def check_gradient_layouts(rank):
    """Top-k trains bit for bit alike whether DDP's gradients are views of its buckets
    (the hook writes the bucket, zeroed whole) or not (a tensor the hook keeps between
    steps, where only last step's positions are reset)."""
    data = batches(rank, 6, seed=5)
    out = {}
    # from the first iteration on, before DDP rebuilds its buckets, and from the second
    for start_iter in (0, 1):
        for as_view in (False, True):
            # small buckets: several of them, as in a real model
            ddp = DDP(model(), gradient_as_bucket_view=as_view, bucket_cap_mb=0.1)
            state = drt.DeepReduceState(sparsifier=dr.TopK(0.05), start_iter=start_iter,
                                        min_compression_rate=0)
            ddp.register_comm_hook(state, drt.deepreduce_hook)
            train(ddp, data)
            out[start_iter, as_view] = params(ddp), len(state._results)
    return {"identical": all(same(out[s, False][0], out[s, True][0]) for s in (0, 1)),
            "kept": out[1, False][1], "kept_with_views": out[1, True][1]}


def check_device_path(rank):
    """The dense work on the bucket's device (forced on CPU) trains bit for bit as the
    numpy path, with DDP's gradient layouts, no_sync() accumulation and static_graph;
    a step moves about (1 + P) x k pairs across the host link, never a bucket."""
    data = batches(rank, 6, seed=7)
    settings = dict(sparsifier=dr.TopK(0.05), value="fp16", start_iter=1,
                    min_compression_rate=0)

    def run(device_path, **ddp_options):
        ddp = DDP(model(), bucket_cap_mb=0.1, **ddp_options)
        state = drt.DeepReduceState(device_path=device_path, **settings)
        ddp.register_comm_hook(state, drt.deepreduce_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for step, (x, y) in enumerate(data):
            opt.zero_grad()
            if step == 3:  # gradient accumulation: this batch's gradient waits a step
                with ddp.no_sync():
                    torch.nn.functional.cross_entropy(ddp(x), y).backward()
            if device_path and step == len(data) - 1:
                state.exchange.selector.link.reset()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        return params(ddp), state

    reference, _ = run(False)
    out = {"device_" + name: same(run(True, **options)[0], reference)
           for name, options in (("plain", {}), ("views", {"gradient_as_bucket_view": True}),
                                 ("static", {"static_graph": True}))}
    _, state = run(True)
    link, ranks, pair = state.exchange.selector.link, 2, 8 + 4
    bound = 0
    for p in model().parameters():
        n = p.numel()
        bound += (1 + ranks) * -(-n // 20) * pair if n >= 1024 else n * 4 + ranks * n * pair
    out["crossed"] = link.to_host_bytes + link.to_device_bytes
    out["bound"] = bound
    out["dense"] = sum(p.numel() * 4 for p in model().parameters())
    return out


def check_device_training(rank):
    """On the device the tests ask for (DEEPREDUCE_TEST_DEVICE, a GPU for
    tests/test_torch_cuda.py): the device path trains, the ranks agree, and only pairs
    cross to the host."""
    device = torch.device(os.environ.get("DEEPREDUCE_TEST_DEVICE", "cpu"),
                          torch.cuda.current_device() if torch.cuda.is_available() else None)
    net = model().to(device)
    ddp = DDP(net, device_ids=[device] if device.type == "cuda" else None)
    state = drt.DeepReduceState(sparsifier=dr.TopK(0.05), value="fp16", start_iter=1,
                                min_compression_rate=0, device_path=True)
    ddp.register_comm_hook(state, drt.deepreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches(rank, 1) * 8:   # one batch again and again: its loss must fall
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    link = state.exchange.selector.link
    return {"weights": [p.detach().cpu().double().sum().item() for p in net.parameters()],
            "first_loss": losses[0], "last_loss": losses[-1],
            # per compressed step (the first is a plain allreduce)
            "crossed": (link.to_host_bytes + link.to_device_bytes) / 7,
            "dense": sum(p.numel() * 4 for p in net.parameters())}


def check_allreduce(rank):
    """drt.allreduce: dense and sparse COO inputs, every communicator, lossless."""
    out = {}
    g = torch.Generator().manual_seed(rank)
    dense = torch.randn(40, 30, generator=g)
    expected = dense.clone()
    dist.all_reduce(expected)
    emb = torch.nn.Embedding(50, 8, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.arange(400, dtype=torch.float32).reshape(50, 8))
    emb(torch.tensor([rank, 7, 20 + rank])).sum().backward()
    sparse_grad = emb.weight.grad
    expected_sparse = sparse_grad.to_dense().clone()
    dist.all_reduce(expected_sparse)
    for communicator in ("allgather", "sparse_allreduce", "block"):
        state = drt.DeepReduceState(**LOSSLESS, communicator=communicator)
        total = drt.allreduce(dense, state, name="w", op="sum")
        out[f"{communicator}_dense"] = torch.equal(total, expected)
        handle = drt.allreduce_async(sparse_grad, state, name="emb", op="sum")
        reduced = handle.wait()
        out[f"{communicator}_sparse"] = reduced.is_sparse and torch.equal(
            reduced.to_dense(), expected_sparse)
    return out


def check_transport(rank):
    """TorchTransport's two collectives with frames of different lengths, empty ones too."""
    transport = drt.transport_of()
    frames = [bytes([rank]) * (3 * r + rank) for r in range(2)]
    received = transport.alltoall(frames, Traffic(), "test")
    gathered = transport.allgather(bytes([7]) * rank, Traffic(), "test")
    empty = transport.allgather(b"", Traffic(), "test")
    return {"device": str(transport.device), "alltoall": [bytes(f).hex() for f in received],
            "allgather": [bytes(f).hex() for f in gathered],
            "empty": [len(f) for f in empty]}


def check_misconfigured(rank):
    """Ranks configured differently raise on every rank, naming the difference."""
    return raised_in_first_step(rank, lambda: drt.DeepReduceState(start_iter=3 + rank))


class Branchy(torch.nn.Module):
    """A model with branches that some steps leave out: ``b`` on odd steps on every rank,
    ``c`` on the ranks where ``(step + rank) % 3`` is not 0 (used on another rank)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 64)
        self.c, self.head = torch.nn.Linear(64, 64), torch.nn.Linear(64, 10)

    def forward(self, x, step, rank):
        h = torch.relu(self.a(x))
        if step % 2 == 0:
            h = torch.relu(self.b(h))
        if (step + rank) % 3 == 0:
            h = torch.relu(self.c(h))
        return self.head(h)


def check_find_unused(rank):
    """DDP(find_unused_parameters=True), whose own bookkeeping allreduce runs on the
    model's group from the autograd thread: a lossless hook trains exactly as DDP's
    allreduce (the hook's collectives run on groups of deepreduce's own)."""
    data = batches(rank, 8, seed=9)

    def run(hooked):
        # small buckets: several collectives of the hook's per step, beside DDP's
        ddp = DDP(Branchy(), find_unused_parameters=True, bucket_cap_mb=0.01)
        state = None
        if hooked:
            state = drt.DeepReduceState(**LOSSLESS, start_iter=2, min_compression_rate=0)
            ddp.register_comm_hook(state, drt.deepreduce_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for step, (x, y) in enumerate(data):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x, step, rank), y).backward()
            opt.step()
        return params(ddp), state

    reference, _ = run(False)
    trained, state = run(True)
    return {"identical": same(trained, reference), "iter": state.iter,
            "compressed": state.stats.total.compressed_tensors,
            "own_groups": state.transport.group is not dist.group.WORLD
            and state.flag_group is not state.transport.group}


CHECKS = [check_transport, check_lossless, check_error_feedback, check_gradient_layouts,
          check_device_path, check_resume, check_allreduce, check_misconfigured,
          check_find_unused]


def main(rank, out_dir, port, only=None):
    prepare(port)
    backend = os.environ.get("DEEPREDUCE_TEST_BACKEND", "gloo")
    if backend == "nccl" or os.environ.get("DEEPREDUCE_TEST_DEVICE") == "cuda":
        # frames travel between GPUs; ranks share one when there is only one
        torch.cuda.set_device(rank % torch.cuda.device_count())
    EARLY_STATES["error_feedback"] = error_feedback_state()
    dist.init_process_group(backend, rank=rank, world_size=2)
    checks = CHECKS if backend == "gloo" else [check_transport]
    if only:
        checks = [globals()[only]]
    run_checks(rank, out_dir, checks)
    leave()


if __name__ == "__main__":
    launch(main)
