"""The device path (deepreduce.torch.device) against the numpy path, on CPU tensors.

The same torch operations run on a GPU; here they must select the same sets, code
the same payload bytes and leave bit-identical residuals and sums.
"""

import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import deepreduce as dr  # noqa: E402
from deepreduce.exchange import GradientExchange  # noqa: E402
from deepreduce.exchange.selection import Selector  # noqa: E402
from deepreduce.torch import device as device_module  # noqa: E402
from deepreduce.torch.device import (DeviceSelector, HostLink, from_host,  # noqa: E402
                                     SAMPLED_FROM, host_array, propose_on_device,
                                     sample_positions, select_on_device)

#: (name, shape): one with its own payload, two that share one, one below min_size
SHAPES = [("w", (300, 400)), ("v", (64, 40)), ("u", (2000,)), ("b", (100,))]
MIN_SIZE = 1024

SETTINGS = [
    dict(sparsifier=dr.TopK(0.01), value="fp16"),
    dict(sparsifier=dr.TopK(0.05), value="raw", index="golomb"),
    dict(sparsifier=dr.TopK(0.02), value="bf16"),
    dict(sparsifier=dr.TopK(0.02), value="qsgd:bits=4"),
    dict(sparsifier="randomk:0.02", value="fp16"),
    dict(sparsifier=dr.Threshold(2.5), value="raw"),
    dict(sparsifier=dr.BlockTopK(0.1, block=64), value="fp16"),
    dict(sparsifier=None, value="raw", error_feedback=False),
    dict(sparsifier=dr.TopK(0.01), value="fp16", error_feedback=0.5),
]


def gradients(step, dtype=np.float32):
    rng = np.random.default_rng(step)
    grads = [rng.standard_normal(shape).astype(dtype) for _, shape in SHAPES]
    grads[0][0, :7] = 3.0          # ties at the top: the lowest positions win
    return grads


def pair(settings):
    def make(selector):
        return GradientExchange(min_size=MIN_SIZE, selector=selector, **settings)
    return make(Selector), make(DeviceSelector)


def device_inputs(grads):
    return [torch.from_numpy(g.copy()) if g.size >= MIN_SIZE else g.copy() for g in grads]


def step_both(host, device, step, ranks=2):
    names = [name for name, _ in SHAPES]
    grads = gradients(step)
    sent = host.encode_bundle(names, [g.copy() for g in grads])
    assert device.encode_bundle(names, device_inputs(grads)) == sent
    gathered = sent * ranks
    summed = host.decode_bundles(gathered, ranks, 0, average=True)
    out = [torch.full(shape, np.nan) for _, shape in SHAPES]
    assert device.decode_bundles(gathered, ranks, 0, average=True, out=out) == out
    for want, got in zip(summed, out):
        assert np.asarray(want).tobytes() == got.numpy().tobytes()
    link = device.selector.link   # the pairs went to the host, the sums came back
    assert link.to_host_bytes > 0 and link.to_device_bytes > 0


def residuals(exchange):
    memory = exchange.selector.memory

    def host(residual):
        return host_array(residual.cpu()) if isinstance(residual, torch.Tensor) else residual

    return {} if memory is None else {
        name: host(memory.residual(name)).tobytes() for name in memory.names()}


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"{s['sparsifier']}-{s['value']}")
def test_device_path_codes_and_sums_the_same_bits(settings):
    host, device = pair(settings)
    for step in range(3):
        step_both(host, device, step)
        assert residuals(device) == residuals(host)


def test_device_path_resumes_bit_exactly():
    settings = dict(sparsifier="randomk:0.02", value="qsgd:bits=4")
    host, device = pair(settings)
    for step in range(2):
        step_both(host, device, step)
    saved = pickle.loads(pickle.dumps(device.selector.state_dict()))
    resumed = GradientExchange(min_size=MIN_SIZE, selector=DeviceSelector, **settings)
    resumed.selector.load_state_dict(saved)
    for step in range(2, 4):
        step_both(host, resumed, step)
    assert residuals(resumed) == residuals(host)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16,
                                   torch.float64])
@pytest.mark.parametrize("k", [0, 1, 37, 1000, 4096])
def test_topk_on_device_takes_numpy_topk_set(dtype, k):
    rng = np.random.default_rng(k)
    values = torch.from_numpy(rng.standard_normal(4096)).to(dtype)
    values[:50] = 1.5               # ties
    values[60] = float("nan")       # ranks lowest
    values[61] = float("-inf")
    values[62] = -0.0
    host = values.float().numpy() if dtype == torch.bfloat16 else values.numpy()
    want = dr.TopK(k=k, exact=True)(host).indices
    got = select_on_device(dr.TopK(k=k), values).numpy()
    assert np.array_equal(got, want)


def sampled_case(case, n):
    """A tensor of ``n`` values whose sampled threshold works (gaussian, ties, nan) or
    misleads: too few values reach it, or too many for the candidates' room."""
    values = torch.from_numpy(np.random.default_rng(7).standard_normal(n, np.float32))
    if case == "ties":
        values[::7] = 2.5            # the k-th magnitude, held by many more than k
    elif case == "too few reach":
        # large values at the sampled positions alone
        values = torch.rand(n, generator=torch.Generator().manual_seed(7))
        values[sample_positions(n)] = 3.0
    elif case == "too many reach":
        # small values at the sampled positions alone
        values = torch.rand(n, generator=torch.Generator().manual_seed(7)) + 2.0
        values[sample_positions(n)] = 1e-3
    elif case == "nan":
        values[::3] = float("nan")
    return values


SAMPLED_CASES = ["gaussian", "ties", "too few reach", "too many reach", "nan"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", SAMPLED_CASES)
def test_topk_on_device_takes_numpy_topk_set_from_its_sample(case, dtype):
    """Tensors of SAMPLED_FROM values and more select among the candidates reaching a
    sample's threshold, or among all values when the sample misled."""
    n, k = SAMPLED_FROM * 4, 5000
    values = sampled_case(case, n).to(dtype)
    want = dr.TopK(k=k, exact=True)(values.float().numpy()).indices
    positions, exact = propose_on_device(dr.TopK(k=k), values)
    # whether the candidates held the top k is known on the device, counted there: not
    # when the k-th magnitude's ties alone outnumber the candidates' room
    assert exact.dtype == torch.bool and bool(exact) == (case in ("gaussian", "nan"))
    if bool(exact):
        assert np.array_equal(positions.numpy(), want)
    assert np.array_equal(select_on_device(dr.TopK(k=k), values).numpy(), want)


@pytest.mark.parametrize("case", SAMPLED_CASES)
def test_topk_on_device_without_nonzero_static_counts_its_candidates(case, monkeypatch):
    """Where torch has no nonzero_static for the device (CUDA before torch 2.6), the
    candidates come from torch.nonzero, which counts them at once: the same sets."""
    def missing(*args, **kwargs):
        raise NotImplementedError("aten::nonzero_static on this backend")

    monkeypatch.setattr(torch, "nonzero_static", missing)
    monkeypatch.setattr(device_module, "_COUNTS_NONZERO", set())
    n, k = SAMPLED_FROM * 2, 3000
    values = sampled_case(case, n)
    want = dr.TopK(k=k, exact=True)(values.numpy()).indices
    positions, exact = propose_on_device(dr.TopK(k=k), values)
    assert exact is None and np.array_equal(positions.numpy(), want)
    assert device_module._COUNTS_NONZERO == {"cpu"}


@pytest.mark.parametrize("case", ["too few reach", "too many reach"])
def test_device_path_codes_the_same_bits_when_the_sample_misleads(case):
    """The selection that finds, in the pairs' copy, that its candidates missed selects
    again among all values, beside tensors whose sample did not mislead and a small one
    from the host: the same payloads and residuals as the numpy path."""
    n = SAMPLED_FROM * 2
    settings = dict(sparsifier=dr.TopK(0.01), value="fp16")
    host = GradientExchange(min_size=MIN_SIZE, **settings)
    device = GradientExchange(min_size=MIN_SIZE, selector=DeviceSelector, **settings)
    names = ["gaussian", "misled", "gaussian too", "small"]
    for step in range(2):
        tensors = [sampled_case("gaussian", n), sampled_case(case, n) * (step + 1),
                   sampled_case("gaussian", n) * 2, torch.randn(100)]
        sent = host.encode_bundle(names, [t.numpy().copy() for t in tensors])
        on_device = [t.clone() for t in tensors[:3]] + [tensors[3].numpy().copy()]
        copies = device.selector.link.to_host_copies
        assert device.encode_bundle(names, on_device) == sent
        assert residuals(device) == residuals(host)
        # the three tensors' pairs in one copy, the misled one's again in a second
        assert device.selector.link.to_host_copies - copies == 2


@settings(max_examples=40, deadline=None)
@given(extra=st.integers(0, 3 * SAMPLED_FROM), k=st.integers(1, 20_000),
       levels=st.sampled_from([None, 3, 50]), seed=st.integers(0, 2**32 - 1),
       dtype=st.sampled_from([torch.float32, torch.float16]))
def test_topk_on_device_from_its_sample_is_numpy_topk(extra, k, levels, seed, dtype):
    """Above SAMPLED_FROM values, any k, with values from a few levels (ties at the k-th
    magnitude) or continuous, signs, NaN and infinities: numpy's exact TopK set."""
    n = SAMPLED_FROM + extra
    rng = np.random.default_rng(seed)
    host = rng.standard_normal(n) if levels is None else rng.integers(-levels, levels, n) / 7
    host[rng.integers(0, n, 20)] = rng.choice([np.nan, np.inf, -np.inf, 0.0], 20)
    values = torch.from_numpy(host.astype(np.float32)).to(dtype)
    want = dr.TopK(k=min(k, n), exact=True)(values.float().numpy()).indices
    assert np.array_equal(select_on_device(dr.TopK(k=min(k, n)), values).numpy(), want)
    positions, exact = propose_on_device(dr.TopK(k=min(k, n)), values)
    if exact is None or bool(exact):  # what it vouches for is the set
        assert np.array_equal(positions.numpy(), want)


def test_small_tensors_come_from_the_host():
    device = GradientExchange(min_size=MIN_SIZE, selector=DeviceSelector)
    with pytest.raises(ValueError, match="from the host"):
        device.encode_bundle(["b"], [torch.ones(10)])


def test_lossy_index_codecs_take_the_host_path():
    with pytest.raises(ValueError, match="exact index codec"):
        GradientExchange(index="bloom", selector=DeviceSelector)


@pytest.mark.parametrize("value", ["fp16", "qsgd:bits=4"])
def test_a_steps_pairs_cross_in_one_copy_each_way(value):
    """The selections of a step's tensors go to the host in one copy; what the receivers
    decode of them comes back, where error feedback needs it and the value codec is not a
    cast, in one for the positions and one for the values; so do the decoded pairs of
    every rank and tensor for the sums."""
    device = GradientExchange(min_size=MIN_SIZE, selector=DeviceSelector,
                              sparsifier=dr.TopK(0.01), value=value)
    names = [name for name, _ in SHAPES]
    sent = device.encode_bundle(names, device_inputs(gradients(0)))
    link = device.selector.link
    settled = 0 if value == "fp16" else 2
    assert (link.to_host_copies, link.to_device_copies) == (1, settled)
    out = [torch.zeros(shape) for _, shape in SHAPES]
    device.decode_bundles(sent * 2, 2, 0, average=True, out=out)
    assert (link.to_host_copies, link.to_device_copies) == (1, settled + 2)


def test_host_link_counts_what_crosses():
    link = HostLink()
    arrays = link.to_host([torch.arange(4, dtype=torch.int64),
                           torch.arange(4, 10, dtype=torch.int64).view(2, 3)])
    assert [a.tolist() for a in arrays] == [[0, 1, 2, 3], [[4, 5, 6], [7, 8, 9]]]
    # back: arrays of one dtype in one copy each
    back = link.to_device([arrays[1], np.float32([0.5, 1.5]), arrays[0]], "cpu")
    assert (link.to_host_bytes, link.to_device_bytes) == (80, 88)
    assert link.to_device_copies == 2
    assert [b.tolist() for b in back] == [[4, 5, 6, 7, 8, 9], [0.5, 1.5], [0, 1, 2, 3]]
    assert link.to_host([]) == [] and link.to_host_bytes == 80
    link.reset()
    # pairs and their check in one copy: 3 int64 positions, 3 float16 values, 1 byte
    # several tensors' pairs and checks in one copy, each part from a multiple of 8
    # bytes: 3 int64 positions, 3 float16 values (+2), a check (+7); 1 position, 1
    # float32 value (+4)
    (positions, values, check), (one, value, unchecked) = link.pairs_to_host([
        (torch.tensor([1, 5, 9], dtype=torch.int32), torch.tensor([0.5, -2.0, 3.0]).half(),
         torch.tensor(False)),
        (torch.tensor([2]), torch.tensor([1.5]), None)])
    assert link.to_host_bytes == (24 + 8 + 8) + (8 + 8)
    assert positions.tolist() == [1, 5, 9] and values.tolist() == [0.5, -2.0, 3.0]
    assert values.dtype == np.float16 and check is False
    assert one.tolist() == [2] and value.tolist() == [1.5] and unchecked is True
    assert link.pairs_to_host([]) == [] and link.to_host_copies == 1


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
@pytest.mark.parametrize("value", ["raw", "fp16", "bf16"])
def test_half_precision_buckets_take_the_same_bits(dtype, value):
    # AMP's fp16 and bf16 gradients: selection in float32, sums accumulated in float32
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    host, device = pair(dict(sparsifier=dr.TopK(0.02), value=value))
    names = [name for name, _ in SHAPES]
    for step in range(2):
        grads = [g.astype(dtype) for g in gradients(step)]
        inputs = [from_host(g.copy()) if g.size >= MIN_SIZE else g.copy() for g in grads]
        sent = host.encode_bundle(names, [g.copy() for g in grads])
        assert device.encode_bundle(names, inputs) == sent
        summed = host.decode_bundles(sent * 2, 2, 0, average=True)
        out = [torch.zeros(shape, dtype=inputs[0].dtype) for _, shape in SHAPES]
        device.decode_bundles(sent * 2, 2, 0, average=True, out=out)
        for want, got in zip(summed, out):
            assert np.asarray(want).tobytes() == host_array(got).tobytes()
        assert residuals(device) == residuals(host)


def test_sums_of_tensors_of_several_dtypes_come_back_together():
    """One decode with float32 and float16 tensors: their values cross in a copy per
    dtype, and every sum has the numpy path's bits."""
    settings = dict(sparsifier=dr.TopK(0.05), value="raw")
    host, device = (GradientExchange(min_size=MIN_SIZE, selector=selector, **settings)
                    for selector in (Selector, DeviceSelector))
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(5000).astype(np.float32),
             rng.standard_normal(3000).astype(np.float16)]
    sent = host.encode_bundle(["a", "h"], [g.copy() for g in grads])
    assert device.encode_bundle(["a", "h"], [torch.from_numpy(g.copy()) for g in grads]) == sent
    summed = host.decode_bundles(sent * 3, 3, 0, average=True)
    out = [torch.zeros(5000), torch.zeros(3000, dtype=torch.float16)]
    device.decode_bundles(sent * 3, 3, 0, average=True, out=out)
    for want, got in zip(summed, out):
        assert np.asarray(want).tobytes() == got.numpy().tobytes()
    assert device.selector.link.to_device_copies == 3  # positions, float32, float16 values
