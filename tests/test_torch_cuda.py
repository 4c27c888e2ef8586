"""The device path on CUDA: skipped where there is no GPU.

The same checks as tests/test_torch_device.py with the tensors on a GPU (the
payload bytes, residuals and sums equal the numpy path's bit for bit), and the
hook on two ranks training a model on the GPU with gloo.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import deepreduce as dr  # noqa: E402
from deepreduce.exchange import GradientExchange  # noqa: E402
from deepreduce.torch.device import (DeviceSelector, propose_on_device,  # noqa: E402
                                     select_on_device)

import test_torch_device as on_cpu  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("settings", on_cpu.SETTINGS,
                         ids=lambda s: f"{s['sparsifier']}-{s['value']}")
def test_device_path_on_cuda_codes_and_sums_the_same_bits(settings):
    host, device = on_cpu.pair(settings)
    names = [name for name, _ in on_cpu.SHAPES]
    for step in range(3):
        grads = on_cpu.gradients(step)
        inputs = [torch.from_numpy(g.copy()).cuda() if g.size >= on_cpu.MIN_SIZE else g.copy()
                  for g in grads]
        sent = host.encode_bundle(names, [g.copy() for g in grads])
        assert device.encode_bundle(names, inputs) == sent
        summed = host.decode_bundles(sent * 2, 2, 0, average=True)
        out = [torch.full(shape, float("nan"), device="cuda") for _, shape in on_cpu.SHAPES]
        device.decode_bundles(sent * 2, 2, 0, average=True, out=out)
        for want, got in zip(summed, out):
            assert np.asarray(want).tobytes() == got.cpu().numpy().tobytes()
        assert on_cpu.residuals(device).keys() == on_cpu.residuals(host).keys()
        for name in host.selector.memory.names() if host.selector.memory is not None else []:
            got = device.selector.memory.residual(name)
            got = got.cpu().numpy() if isinstance(got, torch.Tensor) else got
            assert got.tobytes() == host.selector.memory.residual(name).tobytes()


@pytest.mark.parametrize("case", on_cpu.SAMPLED_CASES)
def test_topk_on_cuda_takes_numpy_topk_set_from_its_sample(case):
    n, k = on_cpu.SAMPLED_FROM * 4, 5000
    values = on_cpu.sampled_case(case, n)
    want = dr.TopK(k=k, exact=True)(values.numpy()).indices
    _, exact = propose_on_device(dr.TopK(k=k), values.cuda())
    # counted on the GPU (by torch.nonzero at once before torch 2.6: None)
    assert exact is None or exact.is_cuda
    assert np.array_equal(select_on_device(dr.TopK(k=k), values.cuda()).cpu().numpy(), want)


def test_exchange_keeps_its_residuals_on_the_gpu():
    exchange = GradientExchange(sparsifier=dr.TopK(0.01), min_size=0, selector=DeviceSelector)
    exchange.encode_bundle(["w"], [torch.randn(10_000, device="cuda")])
    assert exchange.selector.memory.residual("w").is_cuda


def test_hook_trains_on_the_gpu_on_two_ranks(tmp_path):
    """Two gloo ranks train on the GPU (ranks share it when there is one) with the
    device path; both end with the same weights, and only pairs crossed to the host."""
    env = dict(os.environ, DEEPREDUCE_TEST_DEVICE="cuda")
    subprocess.run([sys.executable, os.path.join(HERE, "torch_workers.py"), str(tmp_path),
                    "29671", "check_device_training"], check=True, timeout=600, env=env)
    found = [json.loads((tmp_path / f"rank{r}.json").read_text())["check_device_training"]
             for r in range(2)]
    assert "error" not in found[0], found[0].get("error")
    assert found[0]["weights"] == found[1]["weights"]
    assert found[0]["last_loss"] < found[0]["first_loss"]
    assert 0 < found[0]["crossed"] < found[0]["dense"]


def test_lightning_example_trains_with_the_hook():
    """examples/lightning_ddp.py, as docs/pytorch.md passes the hook to Lightning: the
    state is built before the process group and the hook compresses every step after
    its warm-up."""
    pytest.importorskip("lightning.pytorch")
    script = os.path.join(HERE, os.pardir, "examples", "lightning_ddp.py")
    done = subprocess.run([sys.executable, script, "--devices", "1", "--steps", "60"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    (first_loss, last_loss), = re.findall(r"loss ([0-9.]+) at the first step, ([0-9.]+)",
                                          done.stdout)
    assert float(last_loss) < float(first_loss)
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("deepreduce:") and float(last.split("(")[1].split("x")[0]) > 20
