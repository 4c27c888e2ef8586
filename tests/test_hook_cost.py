"""The fixed cost of a DDP hook step (issue 31 item 10): collectives per allgather.

The two-rank checks run on two gloo ranks spawned by this file itself
(``python tests/test_hook_cost.py OUT PORT``, as tests/torch_workers.py does).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import free_port
from deepreduce.collectives.cost import slot_capacity

HERE = os.path.abspath(__file__)

#: Per allgather, the frame length of each of the two ranks: empty, the first (no
#: history: two collectives), ones that fit what came before, one that overflows on
#: one rank only, then shorter ones again.
LENGTHS = [(0, 0), (5, 3), (5, 4), (100, 7), (90, 80), (2000, 10), (1900, 1800), (10, 0),
           (0, 0)]


def frame(rank, call, length) -> bytes:
    return bytes((rank * 31 + call * 7 + i) % 256 for i in range(length))


def check_allgather(rank):
    import deepreduce.torch as drt
    from deepreduce.collectives import Traffic

    transport = drt.transport_of()
    out = []
    for call, lengths in enumerate(LENGTHS):
        traffic = Traffic()
        gathered = transport.allgather(frame(rank, call, lengths[rank]), traffic, "cost")
        out.append({"frames": [bytes(f).hex() for f in gathered],
                    "collectives": len(traffic.stages), "sent": traffic.sent})
    # another stage keeps its own history
    traffic = Traffic()
    transport.allgather(b"x" * 50, traffic, "other")
    return {"calls": out, "other_collectives": len(traffic.stages)}


def worker(rank, out, port):
    import torch.distributed as dist

    from torch_common import run_checks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    run_checks(rank, out, (check_allgather,))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("hook_cost")
    subprocess.run([sys.executable, HERE, str(out), str(free_port())], check=True, timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_allgather_takes_one_collective_when_the_frames_fit(two_ranks):
    found = [rank["check_allgather"] for rank in two_ranks]
    for rank, mine in enumerate(found):
        assert "error" not in mine, f"rank {rank}:\n{mine['error']}"
    # the same frames in the same collectives on both ranks (each sent its own tails)
    def moved(rank):
        return [(c["frames"], c["collectives"]) for c in rank["calls"]]
    assert moved(found[0]) == moved(found[1])
    assert found[0]["other_collectives"] == found[1]["other_collectives"]
    calls = found[0]["calls"]
    for call, (lengths, got) in enumerate(zip(LENGTHS, calls)):
        assert got["frames"] == [frame(r, call, n).hex() for r, n in enumerate(lengths)], call
    # a stage's first allgather gathers the lengths first; then frames that fit the slot
    # the cost model picked from what the stage sent lately take one collective, and
    # those that do not, two (every rank alike)
    assert [c["collectives"] for c in calls][:6] == [1, 2, 1, 2, 1, 2]
    assert calls[-1]["collectives"] == calls[-2]["collectives"] == 1
    assert found[0]["other_collectives"] == 2
    # the slot carries the length and the capacity the cost model picks from the
    # lengths the stage sent lately (every rank's), kept for as many allgathers as it
    # looked back on or until a frame overflows it; what does not fit follows at its
    # exact size, and both count in what the rank sent
    recent, held, weighed = [], None, 0
    for call, lengths in enumerate(LENGTHS):
        capacity = 0
        if recent:
            if held is None or held[1] == 0:
                held, weighed = [slot_capacity(np.concatenate(recent[-8:]), 2),
                                 min(len(recent), 8)], weighed + 1
            held[1] -= 1
            capacity = held[0]
        for rank, mine in enumerate(lengths):
            sent = found[rank]["calls"][call]["sent"]
            assert sent == 8 + capacity + max(0, mine - capacity), (call, rank)
        overflowed = any(n > capacity for n in lengths)
        assert calls[call]["collectives"] == 1 + overflowed, call
        if overflowed:
            held = None
        recent.append(np.array(lengths))
    assert calls[2]["sent"] == 8 + 64
    assert weighed < len(LENGTHS) - 1    # a slot that fits is kept, not weighed again


if __name__ == "__main__":
    import torch.multiprocessing as mp

    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    mp.spawn(worker, args=(sys.argv[1], sys.argv[2]), nprocs=2)
