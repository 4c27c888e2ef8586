"""benchmarks/gpu_checks.sh --dry-run: the GPU check's own steps on the CPU (gloo, no CUDA
parts), so that the script meant for a lent GPU cannot rot between leases."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

pytest.importorskip("torch")


@pytest.mark.skipif(not (REPO / "benchmarks" / "gpu_checks.sh").exists() or
                    shutil.which("bash") is None or shutil.which("timeout") is None,
                    reason="needs the checkout's benchmarks/ and bash")
def test_gpu_checks_dry_run_runs_every_step_and_writes_no_results():
    results = REPO / "benchmarks" / "results" / "gpu"
    before = sorted(results.rglob("*")) if results.exists() else []
    done = subprocess.run(["bash", "benchmarks/gpu_checks.sh", "--dry-run"], cwd=REPO,
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True,
                          text=True, timeout=300)
    out = pathlib.Path(re.search(r"writing under (\S+)", done.stdout).group(1))
    try:
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
        for part in ("identical", "coupling", "models", "fsdp"):
            assert f"part {part}: ok" in done.stdout
        assert "device path weights identical" in done.stdout
        assert "host path weights identical" in done.stdout
        assert "every step passed" in done.stdout
        assert {p.name for p in out.iterdir()} >= {"machine.txt", "gpu_check.md",
                                                  "device_step.md", "gpu_check.log"}
        assert "compiled extensions" in (out / "machine.txt").read_text()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    assert (sorted(results.rglob("*")) if results.exists() else []) == before


def test_gpu_checks_refuses_to_run_without_a_gpu_unless_dry():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    done = subprocess.run(["bash", "benchmarks/gpu_checks.sh"], cwd=REPO,
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "--dry-run" in done.stderr
