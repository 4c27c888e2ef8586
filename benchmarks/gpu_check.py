"""The checks of docs/cuda.md that need a GPU, in one process (run by benchmarks/gpu_checks.sh).

Parts, each printing its figures and a verdict line ``part X: ok`` or ``part X: FAILED``:

(a) ``identical``: DDP on a world of 1 (NCCL bound to the GPU: deepreduce's groups are
    split from it), 6 steps each on the device path, on the device path with forward and
    backward under a side stream (``with torch.cuda.stream(s):``), and on the host path
    (``device_path=False``): the weights must be identical bit for bit, and
    ``state_dict()`` / ``load_state_dict()`` must round-trip through ``torch.save``.
(b) ``coupling``: a long kernel (``torch.cuda._sleep``) queued on the main stream must not
    delay the communication thread's allgather handed over before it; a long kernel on
    the communication thread's stream must not delay the next matmul on the main one.
(c) ``models``: ResNet-50 and a GPT-2-small-sized model under DDP, the deepreduce hook
    (device path, Top-1%, fp16) against ``allreduce_hook`` and PowerSGD rank 1: median
    step time, and the host syncs of one backward pass (``torch.profiler``: the CUDA
    runtime's synchronize calls, every thread).
(d) ``fsdp``: the FSDP2 replica exchange on one GPU, where ``deepreduce.torch.fsdp`` has
    landed on this branch; otherwise it says so.

``--dry-run`` runs the same code on the CPU with gloo, small shapes and no CUDA parts
(part b, the side stream, the profiler's CUDA counts), writing nothing under
benchmarks/results: the test suite runs it (tests/test_gpu_checks.py) so that the
script cannot rot.

    python -m benchmarks.gpu_check --out benchmarks/results/gpu/gpu_check.md
    python -m benchmarks.gpu_check --dry-run --out /tmp/gpu_check.md
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import free_port, write_report

PARTS = ("identical", "coupling", "models", "fsdp")


def small_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))


def batches(steps, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 64, generator=g).to(device),
             torch.randint(0, 10, (32,), generator=g).to(device)) for _ in range(steps)]


def ddp_of(module, device, **options):
    return nn.parallel.DistributedDataParallel(
        module.to(device), device_ids=[device.index] if device.type == "cuda" else None,
        **options)


def hook_state(device_path, **settings):
    import deepreduce as dr
    import deepreduce.torch as drt
    return drt.DeepReduceState(**{"sparsifier": dr.TopK(0.05), "value": "fp16",
                                  "start_iter": 1, "min_compression_rate": 0,
                                  "device_path": device_path, **settings})


# -- (a) identical weights ---------------------------------------------------------------

def part_identical(device, steps=6) -> tuple[bool, list[str]]:
    import deepreduce.torch as drt

    data = batches(steps, device)
    variants = [("device path", True, False), ("host path", False, False)]
    if device.type == "cuda":
        variants.insert(1, ("device path under a side stream", True, True))
    weights, lines, ok = {}, [], True
    for label, device_path, side in variants:
        ddp = ddp_of(small_model(), device)
        state = hook_state(device_path)
        ddp.register_comm_hook(state, drt.deepreduce_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        stream = torch.cuda.Stream(device) if side else None
        if side:  # (the model and the batches were made on the default stream)
            stream.wait_stream(torch.cuda.current_stream(device))
        for x, y in data:
            with torch.cuda.stream(stream) if side else nullcontext():
                opt.zero_grad()
                nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
        if side:
            torch.cuda.current_stream(device).wait_stream(stream)
        weights[label] = torch.cat([p.detach().reshape(-1).cpu() for p in ddp.parameters()])
        saved = io.BytesIO()
        torch.save(state.state_dict(), saved)
        saved.seek(0)
        fresh = hook_state(device_path)
        fresh.load_state_dict(torch.load(saved, weights_only=False))
        resumed = fresh.iter == state.iter == steps
        ok &= resumed
        lines.append(f"  {label}: iter {state.iter}, compressed tensors "
                     f"{state.stats.total.compressed_tensors}, state_dict round trip "
                     f"{'ok' if resumed else 'FAILED'}")
    reference = weights["device path"]
    for label, value in weights.items():
        same = torch.equal(value, reference)
        ok &= same
        lines.append(f"  {label} weights {'identical to' if same else 'DIFFER from'} the "
                     f"device path's (max |difference| {float((value - reference).abs().max()):.3g})")
    return ok, lines


# -- (b) stream coupling -------------------------------------------------------------------

def sleep_cycles(device, seconds) -> int:
    """``torch.cuda._sleep`` cycles that take about ``seconds`` on ``device``."""
    cycles = 10_000_000
    torch.cuda.synchronize(device)
    began = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize(device)
    return int(cycles * seconds / (time.perf_counter() - began))


def part_coupling(device, sleep_s=0.5) -> tuple[bool, list[str]]:
    from deepreduce.collectives import Traffic
    from deepreduce.torch.transport import transport_of

    transport = transport_of(None, device)
    frame = bytes(range(256)) * 64
    transport.submit(transport.allgather, frame, Traffic(), "probe").result()  # warm
    cycles = sleep_cycles(device, sleep_s)
    # 1. handed over, then a long kernel on the main stream: the allgather must not wait
    torch.cuda.synchronize(device)
    began = time.perf_counter()
    gathered = transport.submit(transport.allgather, frame, Traffic(), "probe")
    torch.cuda._sleep(cycles)
    gathered.result()
    allgather_s = time.perf_counter() - began
    torch.cuda.synchronize(device)

    # 2. a long kernel on the communication thread's stream after its allgather: the
    # main stream's next matmul must not wait for it
    def long_work():
        transport.allgather(frame, Traffic(), "probe")
        torch.cuda._sleep(cycles)
    a = torch.randn(2048, 2048, device=device)
    (a @ a).sum().item()  # (warm)
    transport.submit(long_work).result()
    began = time.perf_counter()
    (a @ a).sum().item()
    matmul_s = time.perf_counter() - began
    torch.cuda.synchronize(device)
    ok = allgather_s < sleep_s / 2 and matmul_s < sleep_s / 2
    return ok, [f"  a {1e3 * sleep_s:.0f} ms kernel on the main stream; the allgather handed "
                f"over before it took {1e3 * allgather_s:.1f} ms",
                f"  a {1e3 * sleep_s:.0f} ms kernel on the communication stream; the next "
                f"matmul on the main stream took {1e3 * matmul_s:.1f} ms"]


# -- (c) model steps -------------------------------------------------------------------------

def model_cases(device, dry_run):
    from benchmarks.device_step import GPT2, ResNet50, mlp

    if dry_run:
        return [("e2e MLP", mlp, lambda: torch.randn(4, 64, device=device),
                 lambda out: out.float().square().mean())]
    return [("ResNet-50", ResNet50, lambda: torch.randn(32, 3, 224, 224, device=device),
             lambda out: out.float().square().mean()),
            ("GPT-2 small", GPT2, lambda: torch.randint(0, 50257, (8, 512), device=device),
             lambda out: out.float().square().mean())]


def hooks(device):
    import deepreduce as dr
    import deepreduce.torch as drt
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    def deepreduce():
        return drt.DeepReduceState(sparsifier=dr.TopK(0.01), value="fp16", start_iter=0,
                                   device_path=True), drt.deepreduce_hook

    def allreduce():
        return None, default_hooks.allreduce_hook

    def powersgd():
        return powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                           start_powerSGD_iter=2), powerSGD_hook.powerSGD_hook
    return [("deepreduce (device path)", deepreduce), ("allreduce_hook", allreduce),
            ("PowerSGD rank 1", powersgd)]


def training_step(ddp, opt, x, loss_of):
    def step():
        opt.zero_grad()
        loss_of(ddp(x)).backward()
        opt.step()
    return step


def host_syncs(step, device) -> int | None:
    """The CUDA runtime's synchronize calls during ``step()`` (every thread), less the one
    that ends the profiled step."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    return sum(e.count for e in prof.key_averages()
               if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                            "cudaEventSynchronize", "cudaMemcpy")) - 1


def part_models(device, dry_run, steps) -> tuple[bool, list[str]]:
    lines, ok = [], True
    for label, build, example, loss_of in model_cases(device, dry_run):
        for name, make in hooks(device):
            torch.manual_seed(0)
            # (PowerSGD with several buckets in flight hangs on gloo: one bucket there)
            one_bucket = {"bucket_cap_mb": 1000} if dry_run and "PowerSGD" in name else {}
            ddp = ddp_of(build(), device, **one_bucket)
            state, hook = make()
            ddp.register_comm_hook(state, hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
            x = example()

            step = training_step(ddp, opt, x, loss_of)
            times = []
            for i in range(steps + 2):
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                began = time.perf_counter()
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if i >= 2:
                    times.append(time.perf_counter() - began)
            syncs = host_syncs(step, device)
            finite = all(torch.isfinite(p).all() for p in ddp.parameters())
            ok &= bool(finite)
            lines.append(f"  {label}, {name}: {1e3 * statistics.median(times):.1f} ms per step"
                         + ("" if syncs is None else f", {syncs} host syncs in one step")
                         + ("" if finite else ", NON-FINITE weights"))
            del ddp, opt, state, step
    return ok, lines


# -- (d) FSDP2 -------------------------------------------------------------------------------

def part_fsdp(device) -> tuple[bool, list[str]]:
    try:
        import deepreduce.torch.fsdp  # noqa: F401
    except ImportError:
        return True, ["  deepreduce.torch.fsdp has not landed on this branch: nothing to run"]
    return True, ["  deepreduce.torch.fsdp is here; its check is the fsdp branch's "
                  "(benchmarks/fsdp.py) and runs after this script"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="on the CPU, gloo, small shapes, no CUDA parts")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per model and hook")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    cuda = not args.dry_run
    if cuda and not torch.cuda.is_available():
        parser.error("no CUDA device: use --dry-run")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1,
                            **({"device_id": device} if cuda else {}))
    lines, failed = [f"# GPU checks ({'dry run on the CPU' if args.dry_run else device})", "",
                     f"torch {torch.__version__}, device "
                     f"{torch.cuda.get_device_name(device) if cuda else 'CPU'}", ""], []
    try:
        for part in args.parts:
            began = time.perf_counter()
            if part == "coupling" and not cuda:
                ok, found = True, ["  skipped: CUDA streams only"]
            elif part == "identical":
                ok, found = part_identical(device)
            elif part == "coupling":
                ok, found = part_coupling(device)
            elif part == "models":
                ok, found = part_models(device, args.dry_run, 1 if args.dry_run else args.steps)
            else:
                ok, found = part_fsdp(device)
            verdict = f"part {part}: {'ok' if ok else 'FAILED'} ({time.perf_counter() - began:.0f} s)"
            print(verdict, *found, sep="\n", flush=True)
            lines += [f"## {verdict}", "", *(line.strip() for line in found), ""]
            if not ok:
                failed.append(part)
    finally:
        dist.destroy_process_group()
    write_report(args.out, "\n".join(lines))
    print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
