"""The hierarchical exchange on a two-host network made here: bytes across the link, step time.

Two network namespaces play two hosts: ``drhier0`` and ``drhier1``, joined by a veth
pair (``drh0`` in the first, ``drh1`` in the second; 10.77.0.1/24 and 10.77.0.2/24,
addresses that exist only inside them), the veth shaped by tc (a token bucket on
each end, so both directions) to each rate, the loopback inside each namespace
unshaped. Four torch.distributed gloo ranks, numbered as torchrun numbers them
(``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE=2``; ``MASTER_ADDR`` the first
namespace's veth address; ``GLOO_SOCKET_IFNAME`` each namespace's veth end), two in
each namespace, train torch_e2e's model (MLP 64-2048-2048-2048-10, about 8.5M
parameters, scikit-learn's digits, batch 32 per rank) with each scheme in turns
(:func:`benchmarks.torch_e2e.train_schemes`): DDP's allreduce, PowerSGD rank 1
(one bucket), deepreduce's flat allgather (Top-k 1%, ``auto`` indices, fp16) and
deepreduce's hierarchical communicator with the same settings. Rank 0 reads the
veth's interface counters (``/sys/class/net/drh0/statistics``, transmitted plus
received: both directions) around each turn: the bytes across the link come from
the kernel, not from the program's accounting. Every rate starts with a single TCP
stream across the veth that measures what it carries. The namespaces are deleted
afterwards, also after a failure; every wait is bounded in time.

As root, from the repository root::

    python -m benchmarks.hierarchical                       # 10gbit, 1gbit, 100mbit
    python -m benchmarks.hierarchical --rates 1gbit --steps 4 --rounds 1   # quicker

The 10 Gbit/s run calibrates the CPU terms of the step-time model that
``python -m benchmarks.scale`` checks on the other two rates. Writes
``benchmarks/results/hierarchical.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, receive_bytes, table, write_report
from benchmarks.e2e import NetnsError, burst, check_rights

NAMESPACES = ("drhier0", "drhier1")
VETH = ("drh0", "drh1")
ADDRESSES = ("10.77.0.1", "10.77.0.2")
PREFIX = 24
LOCAL = 2
WORLD = 2 * LOCAL
#: The schemes of the run, by their torch_e2e labels.
SCHEMES = ("DDP allreduce fp32", "PowerSGD rank 1 (one bucket)",
           "deepreduce Top-k 1% + auto + fp16 (allgather)",
           "deepreduce Top-k 1% + auto + fp16 (hierarchical)")
FLAT, HIERARCHICAL = SCHEMES[2], SCHEMES[3]


# -- the two hosts -----------------------------------------------------------------------

def _run(cmd, timeout=30, check=True):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode:
        raise NetnsError(f"{' '.join(cmd)} failed ({proc.returncode}): "
                         f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _in(host: int, *cmd) -> list:
    return ["ip", "netns", "exec", NAMESPACES[host], *cmd]


class TwoHosts:
    """Two namespaces joined by a shaped veth pair; deleted on leaving. The names and
    addresses are this benchmark's unless given (another benchmark takes its own, so
    that both can run side by side)."""

    def __init__(self, namespaces=NAMESPACES, veth=VETH, addresses=ADDRESSES, prefix=PREFIX):
        self.namespaces, self.veth, self.addresses, self.prefix = \
            namespaces, veth, addresses, prefix

    def inside(self, host: int, *cmd) -> list:
        """``cmd`` run inside host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[host], *cmd]

    def __enter__(self):
        check_rights()
        self._delete()  # left over from an interrupted run
        try:
            for name in self.namespaces:
                _run(["ip", "netns", "add", name])
            _run(["ip", "link", "add", self.veth[0], "netns", self.namespaces[0], "type",
                  "veth", "peer", "name", self.veth[1], "netns", self.namespaces[1]])
            for host in (0, 1):
                _run(self.inside(host, "ip", "addr", "add",
                                 f"{self.addresses[host]}/{self.prefix}", "dev",
                                 self.veth[host]))
                _run(self.inside(host, "ip", "link", "set", self.veth[host], "up"))
                _run(self.inside(host, "ip", "link", "set", "lo", "up"))
        except BaseException:
            self._delete()
            raise
        return self

    def run_ranks(self, worker, port: int, timeout: float, local: int = 1) -> None:
        """``python -m *worker`` as ``2 * local`` ranks, rank ``r`` inside host
        ``r // local``, with torch.distributed's environment (host 0 the master, gloo on
        the veth); wait for them, at most ``timeout`` seconds; stop all of them if one
        fails or time runs out."""
        procs = []
        try:
            for rank in range(2 * local):
                host = rank // local
                env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank % local),
                           WORLD_SIZE=str(2 * local), LOCAL_WORLD_SIZE=str(local),
                           MASTER_ADDR=self.addresses[0], MASTER_PORT=str(port),
                           GLOO_SOCKET_IFNAME=self.veth[host], DR_VETH=self.veth[host],
                           OMP_NUM_THREADS="1")
                procs.append(subprocess.Popen(self.inside(host, sys.executable, "-m", *worker),
                                              cwd=ROOT, env=env, start_new_session=True))
            wait_for_ranks(procs, timeout)
        finally:
            stop_ranks(procs)

    def shape(self, rate: str) -> None:
        """Both ends of the veth to ``rate`` (a tc token bucket each: both directions)."""
        for host in (0, 1):
            _run(self.inside(host, "tc", "qdisc", "replace", "dev", self.veth[host], "root",
                             "tbf", "rate", rate, "burst", burst(rate), "latency", "50ms"))

    def _delete(self):
        listed = _run(["ip", "netns", "list"]).stdout.split()
        for name in self.namespaces:
            if name in listed:  # (deleting a namespace deletes its end of the veth)
                _run(["ip", "netns", "del", name], check=False)

    def __exit__(self, *exc):
        self._delete()


def veth_bytes():
    """Bytes the veth end named by ``DR_VETH`` has sent and received so far, or None."""
    name = os.environ.get("DR_VETH")
    try:
        return sum(int(Path(f"/sys/class/net/{name}/statistics/{what}_bytes").read_text())
                   for what in ("tx", "rx"))
    except (OSError, TypeError, ValueError):
        return None


# -- a single TCP stream across the veth ---------------------------------------------------

def probe_server(port: int, nbytes: int, timeout: float) -> None:
    """Receive ``nbytes`` on ``port`` of the second host's address, then answer."""
    with socket.create_server((ADDRESSES[1], port)) as server:
        server.settimeout(timeout)
        conn, _ = server.accept()
        conn.settimeout(timeout)
        receive_bytes(conn, nbytes)
        conn.sendall(b"k")
        conn.close()


def probe_client(port: int, nbytes: int, timeout: float) -> float:
    """Send ``nbytes`` to the server; Gbit/s from the first byte to its answer."""
    deadline = time.monotonic() + timeout
    while True:  # the server may not listen yet
        try:
            client = socket.create_connection((ADDRESSES[1], port), timeout=timeout)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    block = b"\0" * (1 << 20)
    start = time.perf_counter()
    sent = 0
    while sent < nbytes:
        client.sendall(block[:min(len(block), nbytes - sent)])
        sent += min(len(block), nbytes - sent)
    client.recv(1)
    elapsed = time.perf_counter() - start
    client.close()
    return nbytes * 8 / elapsed / 1e9


def probe(rate: str, port: int, timeout: float = 60) -> float:
    """Gbit/s of one TCP stream from the first host to the second: about two seconds'
    worth of bytes at ``rate``."""
    gbit = {"100mbit": 0.1, "1gbit": 1, "10gbit": 10}.get(rate, 1)
    nbytes = int(min(2 * gbit * 1e9 / 8, 200e6))
    common = [sys.executable, "-m", "benchmarks.hierarchical", "--port", str(port),
              "--nbytes", str(nbytes)]
    server = subprocess.Popen(_in(1, *common, "--probe-server"), cwd=ROOT)
    try:
        client = _run(_in(0, *common, "--probe-client"), timeout=timeout)
    finally:
        server.wait(timeout=timeout)
    return float(client.stdout.strip().splitlines()[-1])


def loopback_probe(timeout: float = 60) -> float:
    """Gbit/s of one TCP stream over a namespace's unshaped loopback (the intra link)."""
    out = _run(_in(0, sys.executable, "-m", "benchmarks.e2e", "--probe"), timeout=timeout)
    return float(out.stdout.strip().splitlines()[-1])


# -- the ranks -------------------------------------------------------------------------

def worker(args) -> None:
    """One rank: its place comes from the torchrun-style environment the driver set."""
    import json

    import torch
    import torch.distributed as dist

    from benchmarks.torch_e2e import build_schemes, train_schemes

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    args.schemes, args.local_size = None, LOCAL
    schemes = [s for s in build_schemes(args, WORLD) if s[0] in SCHEMES]
    results = train_schemes(rank, args, schemes, veth_bytes)
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(dict(results=results, ranks=WORLD)))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as the torch tests: before the interpreter finalises (pytorch#179291)


def wait_for_ranks(procs: list, timeout: float) -> None:
    """Until every rank's process has exited; raises when one fails or ``timeout`` runs out."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ranks ran past {timeout} s")
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError("a rank failed: "
                               + ", ".join(f"rank {r} exit {p.returncode}"
                                           for r, p in enumerate(procs)
                                           if p.returncode not in (None, 0)))
        time.sleep(0.5)


def stop_ranks(procs: list) -> None:
    """Kill the ranks still running: only the processes started here, each by its own
    session id."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait(timeout=30)


def run_rate(rate: str, args, net: TwoHosts, port: int) -> dict:
    import json
    import tempfile

    net.shape(rate)
    measured = probe(rate, port)
    print(f"{rate}: one TCP stream across the veth measured {measured:.3f} Gbit/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "worker.json"
        net.run_ranks(["benchmarks.hierarchical", "--worker", "--worker-out", str(out),
                       "--steps", str(args.steps), "--rounds", str(args.rounds),
                       "--warmup", str(args.warmup), "--start-iter", str(args.start_iter),
                       "--hidden", str(args.hidden), "--layers", str(args.layers),
                       "--batch-size", str(args.batch_size), "--lr", str(args.lr),
                       "--seed", str(args.seed), "--link-gbits", f"{measured:.2g}"],
                      port + 1, args.timeout, LOCAL)
        data = json.loads(out.read_text())
    data.update(rate=rate, measured_gbit=measured, load=os.getloadavg()[0],
                cores=os.cpu_count())
    for r in data["results"]:
        wire = r.get("wire_bytes_per_step")
        print(f"  {r['scheme']}: {r['step_ms_median']:.1f} ms/step, "
              f"{(wire or 0) / 1e6:.3f} MB across the veth per step", flush=True)
    return data


# -- the report --------------------------------------------------------------------------

def targets(run) -> dict:
    """The issue's two targets at one rate."""
    by = {r["scheme"]: r for r in run["results"]}
    flat, tiered = by[FLAT], by[HIERARCHICAL]
    ratio = tiered["wire_bytes_per_step"] / flat["wire_bytes_per_step"]
    timed = [r for r in run["results"] if r["kind"] != "none"]
    fastest = min(timed, key=lambda r: r["step_ms_median"])
    return {"wire_ratio": ratio, "wire_target": ratio <= 1 / LOCAL * 1.1,
            "fastest": fastest["scheme"], "fastest_target": fastest["scheme"] == HIERARCHICAL}


def where_the_time_goes(run, by) -> str:
    """What the flat and hierarchical steps spend beyond the compute-only step, against
    the time the veth needs for their bytes (half of the counted bytes each way)."""
    compute = by["compute only (no communication)"]["step_ms_median"]
    parts = []
    for label, scheme in (("flat", FLAT), ("hierarchical", HIERARCHICAL)):
        r = by[scheme]
        wire_ms = r["wire_bytes_per_step"] / 2 * 8 / (run["measured_gbit"] * 1e9) * 1e3
        parts.append(f"{label} {r['step_ms_median'] - compute:.0f} ms beyond the compute-only "
                     f"step, of which the veth needs {wire_ms:.1f} ms for its bytes; each of its "
                     f"ranks hands {r['bytes_sent'] / 1e6:.2f} MB per step to the collectives "
                     f"(encode {r['encode_ms']:.0f} ms, collectives and waiting "
                     f"{r['exchange_ms']:.0f} ms, decode {r['decode_ms']:.0f} ms, summed over "
                     "the buckets)")
    return ("Where the time goes: " + "; ".join(parts) + ". The four ranks share "
            f"{run['cores']} cores, and the node's fast link is TCP over loopback on those "
            "same cores: the hierarchical step's dense stage inside the node costs CPU that "
            "a step bound by CPU pays in full, while the veth's time overlaps the CPU work.")


def report(runs, args, command) -> str:
    params = runs[0]["results"][0]["params"]
    lines = ["# The hierarchical exchange across two hosts", "",
             f"Two network namespaces joined by a veth pair shaped by tc to each rate, "
             f"the loopback inside each unshaped; {WORLD} torch.distributed gloo ranks, "
             f"{LOCAL} in each namespace, numbered as torchrun numbers them "
             f"({platform.machine()}, {os.cpu_count()} cores shared by the four ranks and "
             "with other jobs; one intra-op thread per rank). Model: torch_e2e's MLP "
             f"64-{'-'.join([str(args.hidden)] * args.layers)}-10 ({params:,} parameters, "
             f"{4 * params / 1e6:.1f} MB of float32 gradients), batch {args.batch_size} per "
             f"rank; {args.warmup} warm-up steps per scheme (compression from step "
             f"{args.start_iter}), then {args.steps} timed steps in {args.rounds} turns, the "
             "schemes alternating in an order drawn afresh each turn. Step: median on rank 0. "
             "Across the veth: bytes per step from the interface counters of the veth "
             "(transmitted + received, both directions; TCP/IP framing and gloo's own "
             "messages included). deepreduce: Top-k 1%, `auto` indices, fp16 values; "
             "flat: every rank's payload to every rank (`communicator=\"allgather\"`); "
             "hierarchical: `communicator=\"hierarchical\"` (dense reduce-scatter inside the "
             "namespace, each shard's payload between the namespaces, allgather of the "
             "reduced shards inside).", "",
             "Made with (as root, from the repository root):", "",
             f"    {command}", ""]
    summary = []
    for run in runs:
        t = run["targets"] = targets(run)
        by = {r["scheme"]: r for r in run["results"]}
        lines += [f"## {run['rate']} (one TCP stream across the veth measured "
                  f"{run['measured_gbit']:.3f} Gbit/s; load average {run['load']:.1f})", ""]
        rows = []
        for r in run["results"]:
            wire = r.get("wire_bytes_per_step")
            rows.append([r["scheme"], f"{r['step_ms_median']:.1f}",
                         f"{r['step_ms_q1']:.1f}-{r['step_ms_q3']:.1f}",
                         "" if wire is None else f"{wire / 1e6:.3f}",
                         f"{r['bytes_sent'] / 1e6:.3f}", f"{r['final_loss']:.3f}"])
        lines += table(["scheme", "step ms (median)", "quartiles ms", "MB across the veth "
                        "per step", "MB handed to the collectives per rank", "loss"], rows)
        lines += ["", f"Hierarchical / flat bytes across the veth: {t['wire_ratio']:.3f} "
                  f"(target at most about 1/{LOCAL}: {'PASS' if t['wire_target'] else 'FAIL'}); "
                  f"shortest step: {t['fastest']} "
                  f"({'PASS' if t['fastest_target'] else 'FAIL'}).", ""]
        lines += [where_the_time_goes(run, by), ""]
        summary.append([run["rate"]] + [
            f"{by[s]['step_ms_median']:.0f} ms, {by[s]['wire_bytes_per_step'] / 1e6:.2f} MB"
            for s in SCHEMES])
    lines += ["## Summary", "", "Per step: median step time and bytes across the veth.", ""]
    lines += table(["rate"] + list(SCHEMES), summary)
    lines += ["", "The 10 Gbit/s run calibrates the CPU terms of the step-time model in "
              "`benchmarks/scale.py`, which predicts the other rates from it (see "
              "`scale.md`).", ""]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", nargs="+", default=["10gbit", "1gbit", "100mbit"])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per scheme")
    parser.add_argument("--rounds", type=int, default=4, help="turns the steps are taken in")
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--start-iter", type=int, default=3,
                        help="deepreduce's start_iter and PowerSGD's start_powerSGD_iter")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1200,
                        help="seconds the ranks may run at one rate")
    parser.add_argument("--port", type=int, default=29650)
    parser.add_argument("--out", default=str(RESULTS / "hierarchical.md"))
    parser.add_argument("--from-json", action="store_true",
                        help="write the report again from the .json beside --out, running "
                             "nothing")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--link-gbits", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--probe-server", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe-client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nbytes", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.probe_server:
        probe_server(args.port, args.nbytes, 60)
        return 0
    if args.probe_client:
        print(f"{probe_client(args.port, args.nbytes, 60):.4f}")
        return 0
    if args.from_json:
        import json
        saved = json.loads(Path(args.out).with_suffix(".json").read_text())
        text = report(saved["runs"], argparse.Namespace(**saved["args"]), saved["command"])
        write_report(args.out, text, saved)
        print(text)
        return 0
    command = "python -m benchmarks.hierarchical " + " ".join(
        sys.argv[1:] if argv is None else argv)
    try:
        with TwoHosts() as net:
            loopback = loopback_probe()
            print(f"loopback inside a namespace: one TCP stream {loopback:.2f} Gbit/s",
                  flush=True)
            runs = [run_rate(rate, args, net, args.port + 10 * i)
                    for i, rate in enumerate(args.rates)]
    except NetnsError as exc:
        print(f"hierarchical: cannot make the two hosts: {exc}", file=sys.stderr)
        return 2
    text = report(runs, args, command.strip())
    write_report(args.out, text, dict(runs=runs, args=vars(args), loopback_gbit=loopback,
                                      local_size=LOCAL, world=WORLD, command=command.strip()))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
