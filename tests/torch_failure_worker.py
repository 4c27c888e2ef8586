"""Two gloo ranks train with the deepreduce hook; then rank 1 dies: what rank 0 sees.

Launched by tests/test_torch.py as ``python tests/torch_failure_worker.py OUT PORT
CHECK_FINITE``: after two steps rank 1 leaves (``os._exit``, as a killed process
does, mid-run), and rank 0's next backward pass fails in a collective of the
hook: the all-finite flag's allreduce on the autograd thread (``CHECK_FINITE`` 1)
or the allgather of the bundles on the transport's thread (0). Rank 0 writes what
``backward()`` raised to ``OUT/rank0.json``. The group's timeout is short, so a
peer that is gone but not noticed fails in seconds too.
"""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import deepreduce as dr
import deepreduce.torch as drt
from torch_common import exit_now, launch, prepare


def main(rank, out_dir, port, check_finite):
    prepare(port)
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 300), torch.nn.ReLU(),
                              torch.nn.Linear(300, 10))
    ddp = DDP(net, bucket_cap_mb=0.01)  # a bucket per parameter, about
    state = drt.DeepReduceState(sparsifier=dr.TopK(0.05), start_iter=0,
                                min_compression_rate=0, check_finite=check_finite)
    seen = []

    def hook(state, bucket):
        seen.append(bucket.index())
        return drt.deepreduce_hook(state, bucket)

    ddp.register_comm_hook(state, hook)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
    for _ in range(2):
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
    if rank == 1:
        os._exit(0)  # gone, as a killed rank is: its sockets close
    time.sleep(0.5)
    del seen[:]
    found = {"raised": False}
    start = time.monotonic()
    try:
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
    except Exception as exc:  # noqa: BLE001 - what it raised is the finding
        causes, cause = [], exc.__cause__
        while cause is not None:
            causes.append(f"{type(cause).__name__}: {cause}")
            cause = cause.__cause__
        found = {"raised": True, "type": type(exc).__name__, "message": str(exc),
                 "bucket": getattr(exc, "bucket", None), "first_bucket": seen[0],
                 "causes": causes, "seconds": time.monotonic() - start}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(found, f)
    exit_now()  # (the group is broken: no destroy_process_group, no finalising)


if __name__ == "__main__":
    launch(main, args=(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"))
