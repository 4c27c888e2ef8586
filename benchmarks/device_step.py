"""The DDP hooks' own work per step on real model shapes, with P simulated ranks.

For each model, DDP (on a world-of-1 process group: gloo on the CPU, NCCL on a GPU)
makes its gradient buckets as it always does (25 MB each, a first one of 1 MB, rebuilt
after the first backward pass in the order the gradients became ready); the script
keeps DDP's ``GradBucket`` objects from a second backward pass and then, every step,
fills their buffers with Gaussian gradients (outside the timing) and calls each
scheme's hook on them in DDP's order, waiting for every future. What is timed (wall
clock and this process's CPU time) is the hook's work and nothing else: no forward or
backward pass runs beside it. In DDP the same work is spread over the backward pass
(a bucket's hook starts when its gradients are ready, and deepreduce's collectives,
decoding and sums run on its transport's thread).

Schemes, measured in the same run, in an order reversed every round:

``deepreduce numpy/C path, P=...`` and ``deepreduce device path, P=...``
    ``deepreduce_hook`` with Top-k 1% + ``auto`` indices + fp16 values, error
    feedback, ``start_iter=0``, ``min_compression_rate=0``, with ``device_path=False``
    (each bucket goes to the host, where numpy and C do the work) and
    ``device_path=True`` (error feedback, selection, the residual update and the sums
    as torch operations on the bucket's device; only the selected pairs cross to the
    host codecs). The state's transport is a loopback one (:class:`LoopbackTransport`):
    ``allgather`` hands back P copies of this rank's frame, so decoding the P - 1
    other bundles and summing P of them cost what they cost at P ranks;
``PowerSGD rank 1`` / ``rank 4``
    ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` with error
    feedback and warm start (their defaults), compressing from the third step
    (``start_powerSGD_iter=2``, the least PowerSGD accepts with error feedback), its
    default ``min_compression_rate=2``. Its allreduces run on the world of 1, so they
    cost next to nothing: what is measured is its computation, the same at any P;
``DDP fp16_compress_hook``
    the cast to fp16 and back (its allreduce on the world of 1 likewise).

Bytes per step: the dense gradient bytes; the bytes a rank sends (deepreduce's
``stats``, PowerSGD's own counts of elements after compression, fp16 half the dense
bytes); and host<->device bytes: on the device path those the state's ``HostLink``
(``state.exchange.selector.link``) counts; the numpy/C path copies each bucket to the
host and back, twice the dense bytes when the buckets are not on the CPU (on the CPU
it moves nothing: the figure is what it would move); PowerSGD and fp16 stay on the
device.

Then the device path's Top-k alone (:func:`measure_topk`): on tensors of 16K to 4M
values, from a sampled threshold against over all values, which tells where
``deepreduce.torch.device.SAMPLED_FROM`` should lie on this device.

Writes ``benchmarks/results/device_step.md`` and ``.json``::

    python -m benchmarks.device_step                         # ResNet-50, GPT-2 small, MLP; P 2, 8
    python -m benchmarks.device_step --models mlp --ranks 2 --steps 1 --out /tmp/d.md
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from deepreduce.collectives.transport import Transport, split_frames

from benchmarks.common import RESULTS, free_port, mlp_shapes, table, write_report

RATIO = 0.01
BUCKET_CAP_MB = 25
POWERSGD_START = 2
#: seconds a step's futures may take before the run fails
STEP_TIMEOUT = int(os.environ.get("DEVICE_STEP_TIMEOUT", 300))


# -- the loopback transport ---------------------------------------------------------------

class LoopbackTransport(Transport):
    """``size`` simulated ranks that all send what this one (rank 0) sends.

    ``allgather`` hands back ``size`` copies of this rank's frame in one buffer, as a
    real transport delivers the ranks' frames; ``alltoall`` hands back, from every
    other rank, the frame this rank addressed to it. Collectives run on one
    communication thread, as on the real transports.

    >>> from deepreduce.collectives.transport import Traffic
    >>> traffic = Traffic()
    >>> [bytes(f) for f in LoopbackTransport(3).allgather(b"ab", traffic, "demo")]
    [b'ab', b'ab', b'ab']
    >>> traffic.sent, traffic.received
    (2, 4)
    """

    rank = 0

    def __init__(self, size: int):
        super().__init__()
        if size < 1:
            raise ValueError(f"a group needs at least one member, got size={size}")
        self.size = size

    def allgather(self, frame, traffic, stage):
        data = bytes(frame)
        traffic.add(stage, len(data), (self.size - 1) * len(data))
        return split_frames(data * self.size, [len(data)] * self.size)

    def alltoall(self, frames, traffic, stage):
        received = [b"" if r == self.rank else bytes(f) for r, f in enumerate(frames)]
        nbytes = sum(map(len, received))
        traffic.add(stage, nbytes, nbytes)
        return [memoryview(f) for f in received]


# -- the models (no weights: only their gradients' shapes matter to the hooks) -------------

class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        out = planes * self.expansion
        self.conv1, self.bn1 = nn.Conv2d(inplanes, planes, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3, self.bn3 = nn.Conv2d(planes, out, 1, bias=False), nn.BatchNorm2d(out)
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    """torchvision's ResNet-50 (v1.5: the stride on the 3x3 convolution), layer for layer:
    bottleneck blocks [3, 4, 6, 3], 25,557,032 parameters."""

    def __init__(self, classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, inplanes = [], 64
        for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for block in range(blocks):
                layers.append(Bottleneck(inplanes, planes, stride if block == 0 else 1))
                inplanes = planes * Bottleneck.expansion
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class GPT2Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.c_attn(self.ln_1(x)).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2 small's shapes: 12 layers, d=768, 12 heads, vocabulary 50,257, context 1,024,
    the output layer tied to the token embedding: 124,439,808 parameters."""

    def __init__(self, layers=12, d=768, heads=12, vocab=50257, context=1024):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.Sequential(*(GPT2Block(d, heads) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        return self.ln_f(self.blocks(x)) @ self.wte.weight.t()


def mlp():
    """The e2e benchmarks' MLP, 64-2048-2048-2048-10: 8,546,314 parameters."""
    shapes = mlp_shapes()
    layers = []
    for weight in shapes[0::2]:
        layers += [nn.Linear(*weight), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


#: name -> (label, module builder, a small input on ``device`` for one backward pass)
MODELS = {
    "resnet50": ("ResNet-50", ResNet50,
                 lambda device: torch.randn(2, 3, 64, 64, device=device)),
    "gpt2": ("GPT-2 small", GPT2,
             lambda device: torch.randint(0, 50257, (1, 8), device=device)),
    "mlp": ("e2e MLP", mlp, lambda device: torch.randn(4, 64, device=device)),
}


# -- DDP's buckets ----------------------------------------------------------------------------

def ddp_buckets(module, example):
    """DDP of ``module`` and its ``GradBucket`` objects, in DDP's order, after the rebuild
    that follows the first backward pass."""
    device = example.device
    ddp = nn.parallel.DistributedDataParallel(
        module, device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=BUCKET_CAP_MB)
    captured = {}

    def capture(_, bucket):
        captured[bucket.index()] = bucket
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    ddp.register_comm_hook(None, capture)
    for _ in range(2):  # DDP rebuilds its buckets after the first backward pass
        captured.clear()
        ddp(example).float().square().mean().backward()
    return ddp, [captured[i] for i in range(len(captured))]


# -- the schemes ----------------------------------------------------------------------------

class Scheme:
    """A hook, its state, and what it tells of the bytes of a step."""

    def __init__(self, label, hook, state, kind, ranks=None, one_at_a_time=False):
        self.label, self.hook, self.state, self.kind, self.ranks = label, hook, state, kind, ranks
        #: wait for each bucket's future before the next bucket's hook call
        self.one_at_a_time = one_at_a_time
        self.wall, self.cpu, self.sent, self.host_bytes, self.select = [], [], [], [], []
        self.copies = []

    def counters(self):
        """Cumulative (bytes sent, host<->device bytes, (copies to the host, to the
        device)) of the state, where it counts them."""
        if self.kind == "deepreduce":
            sent = self.state.stats.snapshot().bytes_sent
            if self.state.device_path:
                link = self.state.exchange.selector.link
                return (sent, link.to_host_bytes + link.to_device_bytes,
                        (link.to_host_copies, link.to_device_copies))
            return sent, None, None
        if self.kind == "powersgd":
            return 4 * self.state.total_numel_after_compression, None, None
        return None, None, None


def build_schemes(ranks, device):
    import deepreduce as dr
    import deepreduce.torch as drt
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    schemes = []
    for p in ranks:
        for device_path, path in ((False, "numpy/C path"), (True, "device path")):
            state = drt.DeepReduceState(sparsifier=dr.TopK(RATIO), index="auto", value="fp16",
                                        error_feedback=1.0, start_iter=0,
                                        min_compression_rate=0, device_path=device_path)
            state._transport = LoopbackTransport(p)  # bound at the first hook call otherwise
            schemes.append(Scheme(f"deepreduce {path}, P={p}", drt.deepreduce_hook, state,
                                  "deepreduce", p))
    for rank in (1, 4):
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                            start_powerSGD_iter=POWERSGD_START,
                                            use_error_feedback=True)
        # several buckets' PowerSGD in flight at once hung on gloo here (its chained
        # allreduces): one bucket at a time
        schemes.append(Scheme(f"PowerSGD rank {rank}", powerSGD_hook.powerSGD_hook, state,
                              "powersgd", one_at_a_time=device.type != "cuda"))
    schemes.append(Scheme("DDP fp16_compress_hook", default_hooks.fp16_compress_hook, None,
                          "fp16"))
    return schemes


class SelectionClock:
    """Seconds spent in :func:`deepreduce.torch.device.propose_on_device` (the device path's
    sparsifier), wrapped while the clock is installed; on a GPU, launch time only."""

    def __init__(self):
        self.seconds = 0.0
        self._lock = threading.Lock()

    def __enter__(self):
        import deepreduce.torch.device as device_module
        self._module, self._original = device_module, device_module.propose_on_device

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self._original(*args, **kwargs)
            finally:
                with self._lock:
                    self.seconds += time.perf_counter() - start
        device_module.propose_on_device = timed
        return self

    def __exit__(self, *exc):
        self._module.propose_on_device = self._original


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_step(scheme, buckets, device):
    """One step of ``scheme``'s hook over ``buckets``: (wall s, CPU s)."""
    synchronize(device)
    start, start_cpu = time.perf_counter(), time.process_time()
    if scheme.one_at_a_time:
        for bucket in buckets:
            wait_all([scheme.hook(scheme.state, bucket)], scheme.label)
    else:
        wait_all([scheme.hook(scheme.state, bucket) for bucket in buckets], scheme.label)
    synchronize(device)
    return time.perf_counter() - start, time.process_time() - start_cpu


def wait_all(futures, label, timeout=STEP_TIMEOUT):
    """Wait for every future; RuntimeError, naming ``label``, after ``timeout`` seconds."""
    done = threading.Semaphore(0)
    for future in futures:
        future.add_done_callback(lambda _: done.release())
    deadline = time.monotonic() + timeout
    for position in range(len(futures)):
        if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
            pending = [i for i, f in enumerate(futures) if not f.done()]
            raise RuntimeError(f"{label}: the futures of buckets {pending} did not complete "
                               f"within {timeout} s")
    for future in futures:
        future.wait()  # raises what a hook raised


def fill(buckets, noise, at):
    """Gaussian gradients into the buckets: the window of ``noise`` from ``at`` on."""
    for bucket in buckets:
        buffer = bucket.buffer()
        buffer.copy_(noise[at:at + buffer.numel()])
        at += buffer.numel()


def measure_model(name, ranks, steps, warmup, device, seed=0):
    label, build, example = MODELS[name]
    torch.manual_seed(seed)
    module = build().to(device)
    parameters = sum(p.numel() for p in module.parameters())
    ddp, buckets = ddp_buckets(module, example(device))
    dense = sum(b.buffer().numel() * b.buffer().element_size() for b in buckets)
    generator = torch.Generator().manual_seed(seed)
    spare = 1 << 16
    noise = torch.randn(sum(b.buffer().numel() for b in buckets) + spare,
                        generator=generator).to(device)
    schemes = build_schemes(ranks, device)
    print(f"{label}: {parameters:,} parameters in {len(buckets)} buckets", flush=True)
    began = time.perf_counter()
    for round_ in range(warmup + steps):
        order = schemes if round_ % 2 == 0 else schemes[::-1]
        # every scheme gets the same gradients in a round, new ones every round
        at = int(torch.randint(0, spare + 1, (1,), generator=generator))
        for scheme in order:
            fill(buckets, noise, at)
            before = scheme.counters()
            with SelectionClock() as selection:
                wall, cpu = run_step(scheme, buckets, device)
            after = scheme.counters()
            if round_ >= warmup:
                scheme.wall.append(wall)
                scheme.cpu.append(cpu)
                scheme.select.append(selection.seconds)
                scheme.sent.append(None if after[0] is None else after[0] - before[0])
                scheme.host_bytes.append(None if after[1] is None else after[1] - before[1])
                scheme.copies.append(None if after[2] is None else
                                     [a - b for a, b in zip(after[2], before[2])])
        print(f"  round {round_ + 1}/{warmup + steps} at {time.perf_counter() - began:.0f} s"
              + (" (warm-up)" if round_ < warmup else ": " + ", ".join(
                  f"{s.label} {1e3 * s.wall[-1]:.0f} ms" for s in schemes)), flush=True)
    rows = []
    for scheme in schemes:
        if scheme.kind == "deepreduce":
            sent = statistics.median(scheme.sent)
            host = (statistics.median(scheme.host_bytes) if scheme.state.device_path
                    else 2 * dense)
            copies = ([statistics.median(c) for c in zip(*scheme.copies)]
                      if scheme.state.device_path else [len(buckets)] * 2)
        elif scheme.kind == "powersgd":
            sent, host, copies = statistics.median(scheme.sent), 0, None
        else:
            sent, host, copies = dense // 2, 0, None
        rows.append({"model": label, "scheme": scheme.label, "ranks": scheme.ranks,
                     "device_path": (scheme.state.device_path if scheme.kind == "deepreduce"
                                     else None),
                     "ms": 1e3 * statistics.median(scheme.wall),
                     "cpu_ms": 1e3 * statistics.median(scheme.cpu),
                     "select_ms": 1e3 * statistics.median(scheme.select),
                     "ms_all": [1e3 * s for s in scheme.wall],
                     "sent_bytes": sent, "host_device_bytes": host, "copies": copies,
                     "dense_bytes": dense})
    model = {"model": label, "parameters": parameters, "buckets": len(buckets),
             "bucket_elements": [b.buffer().numel() for b in buckets], "dense_bytes": dense}
    del schemes, ddp, buckets, module, noise
    gc.collect()
    return model, rows


#: Tensor sizes of the Top-k comparison (:func:`measure_topk`): ResNet-50's range and
#: GPT-2 small's largest matrices.
TOPK_SIZES = (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22)


def measure_topk(device, repeats: int, sizes=TOPK_SIZES, seed=0) -> list[dict]:
    """The device path's Top-k 1% of Gaussian tensors of ``sizes`` values, from a sampled
    threshold and over all values (``SAMPLED_FROM`` set below and above the size), the
    two in turns: median ms of ``repeats`` calls each, device synchronised, after one
    warm-up call; each call checks that both take the same set."""
    from unittest import mock

    import deepreduce as dr
    from deepreduce.torch import device as device_module

    generator = torch.Generator(device=device).manual_seed(seed)
    rows = []
    for n in sizes:
        values = torch.randn(n, device=device, generator=generator)
        k = max(1, round(RATIO * n))
        times = {"sampled": [], "all": []}
        for call in range(repeats + 1):
            chosen = {}
            for way, sampled_from in (("sampled", 0), ("all", n + 1)):
                with mock.patch.object(device_module, "SAMPLED_FROM", sampled_from):
                    synchronize(device)
                    start = time.perf_counter()
                    chosen[way] = device_module.select_on_device(dr.TopK(k=k), values)
                    synchronize(device)
                if call:
                    times[way].append(time.perf_counter() - start)
            if not torch.equal(chosen["sampled"], chosen["all"]):
                raise AssertionError(f"Top-k of {n} values: the sampled and full selections "
                                     "differ")
        low, _ = device_module._sampled_low(
            device_module._magnitudes(values[device_module.sample_positions(n, device)]), k, n)
        rows.append({"n": n, "k": k, "candidates": int((values.abs() >= low).sum()),
                     **{f"{way}_ms": 1e3 * statistics.median(t) for way, t in times.items()}})
    return rows


# -- the report -------------------------------------------------------------------------------

def megabytes(nbytes):
    return f"{nbytes / 1e6:,.2f}"


def report(record) -> str:
    on_cpu = record["device"] == "cpu"
    lines = ["# The hooks' own work per step on real model shapes", "",
             "`" + " ".join(["python -m benchmarks.device_step", *record["argv"]]) + "`", "",
             f"Device: {record['device_name']}; torch {record['torch']} with "
             f"{record['threads']} intra-op threads; {record['cpus']} CPU cores "
             f"({record['machine']}). Each figure is the median of the measured steps (their "
             f"number under each model) after {record['warmup']} warm-up steps; the schemes "
             "ran in turns, one step each, in an order reversed every round.", "",
             "What is timed: each scheme's hook called on DDP's own buckets (`GradBucket`s "
             "kept from a backward pass of DDP on a world-of-1 process group, 25 MB buckets "
             "after DDP's rebuild), filled with Gaussian gradients before the step, from the "
             "first hook call until every bucket's future has completed"
             + (" and the device is synchronised" if not on_cpu else "")
             + ": the hook's work and nothing else (no forward or backward pass beside it). "
             "`ms` is wall-clock time, `CPU ms` this process's CPU time over all its threads. "
             "deepreduce runs Top-k 1% + auto + fp16 with error feedback, start_iter=0, "
             "min_compression_rate=0, over a loopback transport of P ranks (allgather hands "
             "back P copies of this rank's bundle: the P - 1 others are decoded and all P "
             "summed, as at P ranks; the copies carry the same index sets, where real ranks' "
             "would differ). PowerSGD (error feedback, warm start, compressing from step "
             f"{POWERSGD_START}, min_compression_rate 2) and the fp16 hook allreduce on a world "
             "of 1, where the allreduce costs next to nothing: their figures are their "
             "computation, the same at any P."
             + (" On gloo, PowerSGD with several buckets in flight at once hung here (its "
                "chained allreduces; GPT-2 small's 13 buckets, at its first compressing step), "
                "so its buckets go one at a time: the next hook call waits for the last "
                "bucket's future, which leaves out the overlap between buckets it could have."
                if on_cpu else ""), "",
             "Bytes per step: `sent` is what a rank hands to the collectives (deepreduce's "
             "stats; PowerSGD's elements after compression x 4; fp16 half the dense bytes); "
             "`host<->device` is what crosses between host and device memory: the device "
             "path's `HostLink` count (selected pairs to the host, decoded pairs back)"
             + ("; for the numpy/C path, marked *, twice the dense bytes: each bucket is "
                "copied to the host and back when it is not on the CPU; on the CPU, as here, "
                "it moves nothing and the figure is what it would move" if on_cpu else
                "; the numpy/C path copies each bucket to the host and back (twice the "
                "dense bytes)")
             + ". PowerSGD and fp16 stay on the device. `copies`: the copies a step makes "
             "to the host and to the device (the device path's `HostLink` counts: per "
             "bucket, its all-finite answer with its tensors below `min_size`, then its "
             "selections, to the host, the decoded positions and values back; the "
             "numpy/C path's bucket, one each way). "
             "On a GPU each copy to the host waits for the device; the device path's "
             "copies to the device start from pinned memory and do not.", ""]
    header = ["scheme", "P", "ms", "CPU ms", "x PowerSGD r1", "sent MB", "host<->device MB",
              "copies to host / device", "dense MB"]
    for model in record["models"]:
        rows = [r for r in record["rows"] if r["model"] == model["model"]]
        powersgd1 = next(r["ms"] for r in rows if r["scheme"] == "PowerSGD rank 1")
        lines += [f"## {model['model']}", "",
                  f"{model['parameters']:,} parameters in {model['buckets']} DDP buckets; "
                  f"dense gradients {megabytes(model['dense_bytes'])} MB; median of "
                  f"{model['steps']} steps.", ""]
        body = []
        for r in rows:
            host = megabytes(r["host_device_bytes"])
            if r["device_path"] is False and on_cpu:
                host += " *"
            body.append([r["scheme"], r["ranks"] or "any", f"{r['ms']:,.1f}",
                         f"{r['cpu_ms']:,.1f}", f"{r['ms'] / powersgd1:.2f}",
                         megabytes(r["sent_bytes"]), host,
                         "" if r.get("copies") is None else "{:g} / {:g}".format(*r["copies"]),
                         megabytes(r["dense_bytes"])])
        lines += table(header, body, right_aligned=True) + [""]
    lines += ["## Which path serves which device", ""] + paths_note(record) + [""]
    if record.get("topk"):
        lines += ["## Top-k on the device: from a sampled threshold or over all values", "",
                  "`select_on_device(TopK(k))` of Gaussian tensors, k = 1% of them: with the "
                  "sampled threshold (the candidates that reach it, then the exact selection "
                  "among them) and with the exact selection over all values, in turns; median "
                  f"of {record['topk_repeats']} calls each, the device synchronised around each."
                  f" The device path samples from {record['sampled_from']:,} values up.", ""]
        body = [[f"{r['n']:,}", f"{r['k']:,}", f"{r['candidates']:,}", f"{r['sampled_ms']:,.3f}",
                 f"{r['all_ms']:,.3f}", f"{r['all_ms'] / r['sampled_ms']:.2f}x"]
                for r in record["topk"]]
        lines += table(["values", "k", "candidates", "sampled ms", "all values ms",
                        "sampled faster by"], body, right_aligned=True) + [""]
    return "\n".join(lines)


def paths_note(record) -> list[str]:
    """The numpy/C path against the device path, per model and P, in this run."""
    pairs = []
    for model in record["models"]:
        for p in record["ranks"]:
            rows = {r["device_path"]: r for r in record["rows"]
                    if r["model"] == model["model"] and r["ranks"] == p}
            if True in rows and False in rows:
                pairs.append((model["model"], p, rows[False]["ms"], rows[True]["ms"],
                              rows[True]["select_ms"]))
    cells = "; ".join(f"{m} P={p}: {numpy_ms:,.1f} ms numpy/C, {device_ms:,.1f} ms device "
                      f"({device_ms / numpy_ms:.2f}x; {select_ms:,.1f} ms of it in "
                      "`propose_on_device`)" for m, p, numpy_ms, device_ms, select_ms in pairs)
    faster = sum(device < numpy for _, _, numpy, device, _ in pairs)
    if record["device"] == "cpu":
        verdict = ("On the CPU the device path was faster in "
                   f"{faster} of {len(pairs)} cases: {cells}.")
        return [verdict, "",
                "On CPU buckets the numpy/C path needs no copy (it works on the bucket's memory in "
                "place), and its passes over the dense gradient are one-pass C loops: error "
                "feedback in place, Top-k by a sampled threshold and one scan, the sums scattered "
                "straight into the result. The device path does the same work as general torch "
                "operations that each pass over the whole tensor and allocate their results (|x|, "
                "its comparison with the sampled threshold, `torch.nonzero` of that mask, then "
                "`torch.topk` over the candidates' 64-bit keys, which break ties as on the host: "
                "most of its time, above), which on a CPU costs more than the host copies it saves,"
                " since on the CPU there are none to save. So "
                "`DeepReduceState(device_path=None)` keeps the numpy/C path on the CPU and takes "
                "the device path when CUDA is available, where the numpy/C path would copy every "
                "bucket to the host and back (the `host<->device` column: twice the dense bytes, "
                "against the device path's selected and decoded pairs)."]
    return [f"On {record['device_name']} the device path was faster in {faster} of "
            f"{len(pairs)} cases: {cells}."]


def cpu_model() -> str:
    """The processor's name from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS),
                        default=["resnet50", "gpt2", "mlp"])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 8],
                        help="simulated ranks P of deepreduce's loopback transport")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per scheme")
    parser.add_argument("--warmup", type=int, default=POWERSGD_START + 1,
                        help="warm-up steps per scheme (PowerSGD compresses from step "
                             f"{POWERSGD_START})")
    parser.add_argument("--device", default=None,
                        help="torch device (default: cuda when available, else cpu)")
    parser.add_argument("--topk-repeats", type=int, default=20,
                        help="calls per way of the Top-k comparison (0: none)")
    parser.add_argument("--out", default=str(RESULTS / "device_step.md"))
    args = parser.parse_args(argv)
    import deepreduce.torch.device as device_module

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        models, rows = [], []
        for name in args.models:
            model, model_rows = measure_model(name, args.ranks, args.steps, args.warmup, device)
            model["steps"] = args.steps
            models.append(model)
            rows += model_rows
        topk = measure_topk(device, args.topk_repeats) if args.topk_repeats else []
    finally:
        dist.destroy_process_group()
    record = {"argv": list(argv if argv is not None else sys.argv[1:]),
              "device": device.type,
              "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                              else f"CPU ({cpu_model()})"),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "cpus": os.cpu_count(), "machine": platform.platform(),
              "ranks": args.ranks, "warmup": args.warmup,
              "models": models, "rows": rows, "topk": topk, "topk_repeats": args.topk_repeats,
              "sampled_from": device_module.SAMPLED_FROM}
    out = write_report(args.out, report(record), record)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
