"""Smoke test of ``benchmarks/device_step.py``: the e2e MLP at P=2, one measured step."""

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

pytest.importorskip("torch")
needs_checkout = pytest.mark.skipif(not (REPO / "benchmarks" / "device_step.py").exists(),
                                    reason="the tests run without a checkout (an installed wheel)")


@needs_checkout
def test_device_step_benchmark_reports_every_scheme(tmp_path):
    out = tmp_path / "device_step.md"
    subprocess.run([sys.executable, "-m", "benchmarks.device_step", "--models", "mlp",
                    "--ranks", "2", "--steps", "1", "--topk-repeats", "1", "--out", str(out)],
                   cwd=REPO, timeout=120, capture_output=True, text=True, check=True)
    text = out.read_text()
    assert "8,546,314 parameters" in text
    for scheme in ("deepreduce numpy/C path, P=2", "deepreduce device path, P=2",
                   "PowerSGD rank 1", "PowerSGD rank 4", "DDP fp16_compress_hook"):
        assert f"| {scheme} |" in text
    rows = {r["scheme"]: r for r in json.loads(out.with_suffix(".json").read_text())["rows"]}
    assert len(rows) == 5 and all(r["ms"] > 0 for r in rows.values())
    dense = rows["DDP fp16_compress_hook"]["dense_bytes"]
    assert dense == 4 * 8_546_314
    numpy_path, device_path = rows["deepreduce numpy/C path, P=2"], rows["deepreduce device path, P=2"]
    # the same payloads on both paths; only the selected and decoded pairs cross the link
    assert numpy_path["sent_bytes"] == device_path["sent_bytes"] < dense / 50
    assert numpy_path["host_device_bytes"] == 2 * dense
    assert 0 < device_path["host_device_bytes"] < dense / 5
    # the MLP's 2 buckets: on the device path to the host, per bucket, a copy of its
    # all-finite answer (with the small tensors of the bucket that has one, the last
    # layer's 10 biases) and one of its selections; back, each bucket's decoded
    # positions and values
    assert device_path["copies"] == [4, 4] and numpy_path["copies"] == [2, 2]
    # the Top-k comparison: both ways timed (and checked to agree) at every size
    topk = json.loads(out.with_suffix(".json").read_text())["topk"]
    assert [r["n"] for r in topk] == [1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22]
    assert all(r["sampled_ms"] > 0 and r["all_ms"] > 0 and r["k"] <= r["candidates"]
               for r in topk)
    assert "## Top-k on the device" in text
