"""The time part of :mod:`benchmarks.outer`: the outer step's exchange across two hosts made
here, and the codecs' throughput on this CPU.

Two network namespaces play two hosts, ``drouter0`` and ``drouter1`` (names of their
own, so that a run of ``benchmarks.hierarchical`` beside this one is left alone),
joined by a veth pair (``dro0``/``dro1``, 10.78.0.1/24 and 10.78.0.2/24, addresses
that exist only inside them) shaped by tc to each rate on both ends. One
torch.distributed gloo rank in each (``GLOO_SOCKET_IFNAME`` the veth end) takes outer
steps on the pseudo-gradients that :func:`benchmarks.outer.pseudo_gradients` captured
(every parameter of the outer model; rank 1's scaled by ``1 + 0.1 N(0, 1)`` so that
the two ranks differ), each scheme in turns, its order rotating:

* ``allreduce fp32`` / ``allreduce bf16``: dense DiLoCo as its implementations send it,
  the pseudo-gradients flattened (and cast) into one buffer, ``dist.all_reduce``d and
  averaged;
* with :class:`deepreduce.torch.OuterOptimizer` (when ``deepreduce/torch/outer.py`` is
  committed): its ``sync()``, the whole outer step (pseudo-gradients, error feedback,
  exchange with encode and decode, the outer SGD step, the copy back), in the modes
  dense DiLoCo fp32 (``value="raw"``), bf16, and SparseLoCo
  (``chunktopk:k=64,chunk=4096``, ``chunked``, ``statq:bits=2,sigmas=6``, decay 0.95);
  without it, a :class:`~deepreduce.exchange.GradientExchange` of the SparseLoCo
  settings over :class:`~deepreduce.torch.transport.TorchTransport`.

A step's time is the longest of the two ranks'; the bytes across the veth come from
its interface counters (both directions, TCP/IP framing included). The namespaces
are deleted afterwards, also after a failure; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import best_wall_and_cpu, free_port, table
from benchmarks.e2e import NetnsError, check_rights
from benchmarks.hierarchical import TwoHosts, veth_bytes

NAMESPACES = ("drouter0", "drouter1")
VETH = ("dro0", "dro1")
ADDRESSES = ("10.78.0.1", "10.78.0.2")
PREFIX = 24
WORLD = 2
LINK_GBITS = 1.0


# -- the ranks -------------------------------------------------------------------------

def _rank_tensors(path: str, rank: int) -> dict:
    with np.load(path) as archive:
        tensors = {name: archive[name].astype(np.float32) for name in archive.files}
    if rank:
        rng = np.random.default_rng(rank)
        tensors = {name: (x * (1 + 0.1 * rng.standard_normal(x.shape))).astype(np.float32)
                   for name, x in tensors.items()}
    return tensors


def _allreduce_scheme(tensors: dict, dtype):
    import torch
    import torch.distributed as dist

    local = [torch.from_numpy(x) for x in tensors.values()]
    sizes = [t.numel() for t in local]

    def step():
        flat = torch.cat([t.reshape(-1) for t in local]).to(dtype)
        dist.all_reduce(flat)
        flat = flat.float().div_(WORLD)
        averaged = [part.view_as(t) for part, t in zip(flat.split(sizes), local)]
        return None, averaged
    return step


def _outer_scheme(tensors: dict, **settings):
    """One :class:`OuterOptimizer` over parameters of the tensors' shapes; each step first
    sets the parameters to ``synced - pseudo-gradient``, so that the outer step sends
    the captured pseudo-gradients."""
    import torch

    from deepreduce.torch.outer import OuterOptimizer

    keys = {name: name.replace(".", "_") for name in tensors}  # (ParameterDict keys)
    params = torch.nn.ParameterDict({keys[name]: torch.nn.Parameter(torch.zeros(x.shape))
                                     for name, x in tensors.items()})
    # a group of its own: one transport per scheme, as in a run of one mode (a transport's
    # allgather slots follow the longest frames it carried lately, here the dense ones)
    group = torch.distributed.new_group(list(range(WORLD)))
    outer = OuterOptimizer(params.named_parameters(), sync_every=1, process_group=group,
                           **settings)
    pseudo = {keys[name]: torch.from_numpy(x) for name, x in tensors.items()}
    named = dict(params.named_parameters())

    def step():
        with torch.no_grad():
            for name, synced in outer.synced_parameters().items():
                named[name].copy_(synced - pseudo[name])
        outer.sync()
        return outer.stats.last, None
    return step


def schemes(tensors: dict) -> list:
    import torch

    made = [("allreduce fp32 (dense DiLoCo as sent elsewhere)",
             _allreduce_scheme(tensors, torch.float32)),
            ("allreduce bf16", _allreduce_scheme(tensors, torch.bfloat16))]
    made += [("OuterOptimizer diloco, raw fp32", _outer_scheme(tensors, mode="diloco")),
             ("OuterOptimizer diloco, bf16", _outer_scheme(tensors, mode="diloco",
                                                           value="bf16")),
             ("OuterOptimizer sparseloco (chunktopk k=64, chunked, statq 2 bits)",
              _outer_scheme(tensors, mode="sparseloco"))]
    return made


def worker(args) -> None:
    """One rank: its place comes from the environment the driver set."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    tensors = _rank_tensors(args.gradients, rank)
    made = schemes(tensors)
    results = {label: dict(ms=[], wire=[], encode_ms=[], decode_ms=[], sent=[])
               for label, _ in made}
    for label, step in made:  # a warm-up step each (and the first outer step's agreement)
        dist.barrier()
        step()
    for turn in range(args.repeats):
        for label, step in made[turn % len(made):] + made[:turn % len(made)]:
            dist.barrier()
            before = veth_bytes()
            began = time.perf_counter()
            stats, _ = step()
            elapsed = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            after = veth_bytes()
            r = results[label]
            r["ms"].append(1e3 * float(elapsed))
            r["wire"].append(None if before is None else after - before)
            if stats is not None:
                r["encode_ms"].append(1e3 * stats.encode_seconds)
                r["decode_ms"].append(1e3 * stats.decode_seconds)
                r["sent"].append(stats.bytes_sent)
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(dict(
            results=results, parameters=int(sum(x.size for x in tensors.values())))))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # before the interpreter finalises (pytorch#179291), as the torch tests


# -- the codecs' throughput here ----------------------------------------------------------

def throughput(tensors: dict, repeat: int = 5) -> dict:
    """Encode and decode of the SparseLoCo settings on this CPU (one process, no network),
    per million parameters, against the wire time they save at 1 Gbit/s between 2 ranks."""
    from deepreduce.config import ExchangeConfig
    from deepreduce.exchange import GradientExchange

    names, arrays = list(tensors), list(tensors.values())
    other = [(x * 1.05).astype(np.float32) for x in arrays]
    n = sum(x.size for x in arrays)
    config = ExchangeConfig.sparseloco()
    exchange = GradientExchange(config=config)
    peer = GradientExchange(config=config)
    bundle, theirs = exchange.encode_bundle(names, arrays), peer.encode_bundle(names, other)
    encode_s, encode_cpu = best_wall_and_cpu(lambda: exchange.encode_bundle(names, arrays),
                                             repeat)
    decode_s, decode_cpu = best_wall_and_cpu(lambda: exchange.decode_bundles(
        bundle + theirs, ranks=2, rank=0, average=True), repeat)
    per_m = 1e6 / n
    saved = {f"{label}": (nbytes * n - len(bundle)) * 8 / (LINK_GBITS * 1e9)
             for label, nbytes in (("fp32", 4), ("bf16", 2))}
    return dict(parameters=n, bundle_bytes=len(bundle), encode_ms_per_m=1e3 * encode_s * per_m,
                decode_ms_per_m=1e3 * decode_s * per_m,
                encode_cpu_ms_per_m=1e3 * encode_cpu * per_m,
                decode_cpu_ms_per_m=1e3 * decode_cpu * per_m, load=os.getloadavg()[0],
                saved_ms_per_m={k: 1e3 * v * per_m for k, v in saved.items()},
                target=(encode_cpu + decode_cpu) <= saved["fp32"],
                target_wall=(encode_s + decode_s) <= saved["fp32"])


# -- the part ---------------------------------------------------------------------------

def run(args, captured) -> dict:
    pseudo, facts = captured
    record = dict(throughput=throughput(pseudo), parameters=facts["parameters"],
                  gradients=facts["path"], rates=[])
    t = record["throughput"]
    print(f"time: encode {t['encode_ms_per_m']:.1f} + decode {t['decode_ms_per_m']:.1f} ms "
          f"per million parameters; saves {t['saved_ms_per_m']['fp32']:.1f} ms at 1 Gbit/s",
          flush=True)
    try:
        check_rights()
    except NetnsError as exc:
        record["skipped"] = str(exc)
        print(f"time: the two-host part is skipped: {exc}", flush=True)
        return record
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    with TwoHosts(NAMESPACES, VETH, ADDRESSES, PREFIX) as net:
        for rate in rates:
            net.shape(rate)
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "worker.json"
                net.run_ranks(["benchmarks.outer", "--time-worker", "--worker-out", str(out),
                               "--gradients", facts["path"], "--repeats", str(args.repeats)],
                              free_port(), 900)
                data = json.loads(out.read_text())
            data.update(rate=rate, load=os.getloadavg()[0])
            record["rates"].append(data)
            for label, r in data["results"].items():
                print(f"  {rate} {label}: {np.median(r['ms']):.1f} ms", flush=True)
    return record


def _median(values):
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def section(record) -> list:
    t = record["throughput"]
    lines = ["## Time", "",
             "### Encode + decode on this CPU", "",
             f"SparseLoCo's settings (chunktopk k=64 per 4096, `chunked`, "
             f"`statq:bits=2,sigmas=6`, error feedback with decay 0.95) on the outer model's "
             f"pseudo-gradients ({t['parameters']:,} parameters, every one), one process, "
             f"best of 5: encoding a rank's bundle (error feedback, selection, codecs) "
             f"{t['encode_ms_per_m']:.1f} ms and decoding two ranks' bundles and averaging "
             f"them {t['decode_ms_per_m']:.1f} ms per million parameters; the bundle is "
             f"{t['bundle_bytes']:,} bytes (CPU time of this process: "
             f"{t['encode_cpu_ms_per_m']:.1f} and {t['decode_cpu_ms_per_m']:.1f} ms; load "
             f"average {t['load']:.1f} on {os.cpu_count()} cores). Between 2 ranks at 1 Gbit/s it saves "
             f"{t['saved_ms_per_m']['fp32']:.1f} ms of wire per million parameters against "
             f"a dense fp32 allreduce (4 bytes a parameter each way) and "
             f"{t['saved_ms_per_m']['bf16']:.1f} ms against bf16. Target (encode + decode "
             "at most the wire time saved against fp32), on the CPU time (what other jobs' "
             "share of the cores does not count): " + ("PASS" if t["target"] else "FAIL")
             + "; on the wall clock: " + ("PASS" if t["target_wall"] else "FAIL") + ".", ""]
    lines += ["### The outer step across two hosts", ""]
    if "skipped" in record:
        return lines + [f"Not run here: {record['skipped']}.", ""]
    lines += ["Two network namespaces joined by a veth pair shaped by tc to each rate (both "
              "directions), one torch.distributed gloo rank in each, exchanging the outer "
              f"model's pseudo-gradients ({record['parameters']:,} parameters; the second "
              "rank's scaled by 1 + 0.1 N(0, 1)). Each scheme takes a warm-up outer step, "
              "then the timed ones in turns, the order rotating; a step's time is the "
              "longer of the two ranks', the bytes across the veth come from its interface "
              "counters (both directions, TCP/IP framing included). allreduce: the "
              "pseudo-gradients flattened (and cast) into one buffer, `dist.all_reduce`d "
              "and averaged, as DiLoCo's implementations send them. "
              "The deepreduce rows are `OuterOptimizer.sync()`, the whole outer step "
              "(pseudo-gradients, error feedback, exchange with encode and decode, outer SGD "
              "step, copy back), in its modes: dense DiLoCo fp32 (`value=\"raw\"`) and bf16, "
              "and SparseLoCo (`chunktopk:k=64,chunk=4096`, `chunked`, "
              "`statq:bits=2,sigmas=6`, decay 0.95).", ""]
    for run in record["rates"]:
        bits_per_s = rate_bits(run["rate"])
        lines += [f"#### {run['rate']} (load average {run['load']:.1f})", ""]
        rows, medians = [], {}
        for label, r in run["results"].items():
            ms = np.array(r["ms"])
            medians[label] = float(np.median(ms))
            wire = _median(r["wire"])
            encode, decode = _median(r["encode_ms"]), _median(r["decode_ms"])
            rows.append([label, f"{np.median(ms):.1f}",
                         f"{np.percentile(ms, 25):.1f}-{np.percentile(ms, 75):.1f}",
                         "" if wire is None else f"{wire / 1e6:.3f}",
                         "" if wire is None else f"{wire / 2 * 8 / bits_per_s * 1e3:.1f}",
                         "" if encode is None else f"{encode:.1f}",
                         "" if decode is None else f"{decode:.1f}"])
        lines += table(["scheme", "outer step ms (median)", "quartiles", "MB across the veth",
                        "its wire ms (half each way)", "encode ms", "decode ms"], rows)
        sparse = [label for label in medians if "sparseloco" in label.lower()]
        if sparse:
            ours = medians[sparse[0]]
            against = [f"{than(medians[label], ours)} the {kind} allreduce's"
                       for label, kind in zip(list(medians)[:2], ("fp32", "bf16"))]
            lines += ["", f"The SparseLoCo step takes {ours:.0f} ms: {against[0]} and "
                      f"{against[1]}."]
        lines += [""]
    return lines


def than(theirs: float, ours: float) -> str:
    """``"3.3x less time than"`` or ``"4.7x more time than"``, ours against theirs.

    >>> than(10.0, 4.0), than(4.0, 10.0)
    ('2.5x less time than', '2.5x more time than')
    """
    return (f"{theirs / ours:.1f}x less time than" if ours <= theirs
            else f"{ours / theirs:.1f}x more time than")


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate such as ``"100mbit"`` or ``"1gbit"``.

    >>> rate_bits("100mbit"), rate_bits("1gbit")
    (100000000.0, 1000000000.0)
    """
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise ValueError(f"a rate in kbit, mbit or gbit, got {rate!r}")
