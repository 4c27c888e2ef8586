"""Fixtures and helpers the test modules share."""

import json
import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script, out, ranks, timeout=600):
    """Findings of ``python tests/SCRIPT OUT PORT``, a worker that spawns ``ranks`` ranks
    which each write ``OUT/rank<r>.json``: ``{check: [rank 0's, rank 1's, ...]}``."""
    subprocess.run([sys.executable, os.path.join(HERE, script), str(out), str(free_port())],
                   check=True, timeout=timeout)
    found = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    return {check: [rank[check] for rank in found] for check in found[0]}


def torchrun_example(name, ranks, *args, timeout=300) -> list:
    """The output lines of ``examples/NAME`` run by torchrun as ``ranks`` processes on
    this machine, as the docs launch it; fails with the ranks' traceback if they fail."""
    script = os.path.join(HERE, os.pardir, "examples", name)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run",
                           f"--nproc-per-node={ranks}", "--rdzv-backend=c10d",
                           "--rdzv-endpoint=localhost:0", script, *args],
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()


def findings(per_check, check):
    """One check's findings on every rank; fails with a rank's traceback if it raised."""
    for rank, found in enumerate(per_check[check]):
        assert "error" not in found, f"rank {rank}:\n{found['error']}"
    return per_check[check]


@pytest.fixture
def world_of_one():
    """A gloo process group of this process alone, destroyed after the test."""
    dist = pytest.importorskip("torch.distributed")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
