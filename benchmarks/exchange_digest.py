"""Digests of what GradientExchange steps produce: bundles, sums, residuals and per-stage
traffic on 4 thread ranks, over settings, communicators and codec threads.

A restructuring that promises the same bits runs it on the tree before and after and
compares the lines (``PYTHONPATH=<other checkout> python -m benchmarks.exchange_digest``).
"""
import hashlib
import itertools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from deepreduce.collectives import ThreadTransport
from deepreduce.config import ExchangeConfig
from deepreduce.exchange import GradientExchange

SETTINGS = {
    "topk-fp16-auto": dict(sparsifier="topk:0.01", index="auto", value="fp16"),
    "topk-qsgd-golomb": dict(sparsifier="topk:0.05", index="golomb", value="qsgd:bits=4"),
    "randomk-bf16": dict(sparsifier="randomk:0.02", index="varint", value="bf16", seed=3),
    "lossless": dict(sparsifier=None, value="raw", error_feedback=False),
    "sparseloco": dict(sparsifier="chunktopk:k=64,chunk=4096", index="chunked",
                       value="statq:bits=2,sigmas=6", min_size=0),
    "threshold-polyfit": dict(sparsifier="threshold:1.5", value="polyfit", index="bitpack"),
}
COMMUNICATORS = {
    "allgather": {}, "sparse_allreduce": {"communicator": "sparse_allreduce"},
    "block": {"communicator": "block"},
    "hierarchical": {"communicator": "hierarchical", "communicator_options": {"local_size": 2}},
}
RANKS, STEPS = 4, 3
SHAPES = [(256, 128), (4096,), (10,), (64, 64, 3)]


def digest(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes() if not isinstance(a, (bytes, str)) else
                 (a if isinstance(a, bytes) else a.encode()))
    return h.hexdigest()[:16]


def run(settings, comm, threads):
    exchanges = [GradientExchange(config=ExchangeConfig(**settings, **comm,
                                                        codec_threads=threads))
                 for _ in range(RANKS)]
    names = [f"t{i}" for i in range(len(SHAPES))]

    def rank_main(member):
        out = []
        ex = exchanges[member.rank]
        for step in range(STEPS):
            rng = np.random.default_rng(1000 * step + member.rank)
            grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
            outputs, traffic = ex.reduce_async(names, grads, member, "average").result()
            out.append(digest(*outputs))
            out.append(repr(sorted((k, v) for k, v in vars(traffic).items())))
        memory = ex.selector.memory
        if memory is not None:
            out.append(digest(*[memory.residual(n) for n in names if memory.residual(n) is not None]))
        bundle = ex.encode_bundle(names, [np.full(s, 0.5, np.float32) for s in SHAPES]) \
            if comm == {} else b""
        out.append(digest(bundle))
        return out

    with ThreadPoolExecutor(RANKS) as pool:
        results = list(pool.map(rank_main, ThreadTransport.group(RANKS)))
    return digest("|".join(itertools.chain.from_iterable(results)))


def main():
    for (sname, settings), (cname, comm), threads in itertools.product(
            SETTINGS.items(), COMMUNICATORS.items(), (1, 3)):
        if cname != "allgather" and sname in ("sparseloco", "threshold-polyfit"):
            continue
        print(sname, cname, threads, run(settings, comm, threads), flush=True)


if __name__ == "__main__":
    main()
