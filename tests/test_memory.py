import copy

import numpy as np
import pytest

import deepreduce as dr


@pytest.mark.parametrize("value", ["raw", "fp16", "bf16"])
def test_residual_plus_delivered_equals_input_over_steps(value):
    rng = np.random.default_rng(0)
    memory, pipe = dr.ResidualMemory(), dr.Pipeline(dr.TopK(0.05), "varint", value)
    delivered = np.zeros(2000, np.float32)
    inputs = np.zeros(2000, np.float32)
    for _ in range(20):
        g = rng.standard_normal(2000).astype(np.float32)
        inputs += g
        corrected = memory.accumulate("w", g)
        owed = corrected.copy()   # (settle subtracts in the same memory)
        _, received = pipe.encode(corrected)
        memory.settle("w", corrected, received)
        np.testing.assert_array_equal(received.to_dense() + memory.residual("w"), owed)
        delivered += received.to_dense()
    # no gradient mass lost: what arrived plus what is still owed is what was put in
    np.testing.assert_allclose(delivered + memory.residual("w"), inputs, rtol=0, atol=1e-4)


def test_beta_and_reset():
    memory = dr.ResidualMemory(beta=0.5)
    g = np.array([1.0, 2.0], np.float32)
    memory.settle("w", g, dr.SparseTensor([2.0], [1], (2,)))
    np.testing.assert_array_equal(memory.accumulate("w", g), [1.5, 2.0])
    assert "w" in memory and len(memory) == 1
    memory.reset("w")
    assert memory.residual("w") is None
    with pytest.raises(ValueError, match="beta"):
        dr.ResidualMemory(beta=2)


def test_shape_change_is_an_error():
    memory = dr.ResidualMemory()
    memory.settle("w", np.ones(3, np.float32), dr.SparseTensor([], [], (3,)))
    with pytest.raises(ValueError, match="changed shape"):
        memory.accumulate("w", np.ones(4, np.float32))


def reference_step(residual, g, beta, encode):
    """Error feedback written out with new arrays: ``(corrected, received, residual)``."""
    corrected = g if residual is None else \
        g + (residual if beta == 1.0 else beta * residual).astype(g.dtype)
    _, received = encode(corrected)
    residual = corrected.copy()
    residual.reshape(-1)[received.indices] -= received.values.astype(g.dtype)
    return corrected, received, residual


@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_accumulate_and_settle_equal_error_feedback_in_one_buffer(beta):
    rng = np.random.default_rng(1)
    pipe = dr.Pipeline(dr.TopK(0.05), "varint", "fp16")
    memory, residual = dr.ResidualMemory(beta), None
    buffers = set()
    for step in range(6):
        g = rng.standard_normal((40, 50)).astype(np.float32)
        corrected = memory.accumulate("w", g)
        _, received = pipe.encode(corrected)
        memory.settle("w", corrected, received)
        _, expected, residual = reference_step(residual, g, beta, pipe.encode)
        assert received == expected
        np.testing.assert_array_equal(memory.residual("w"), residual)
        if step >= 1:
            buffers.add(id(memory.residual("w")))
    assert len(buffers) == 1  # updated in place from the second step on


def test_everything_stays_owed_when_encoding_fails():
    memory, pipe = dr.ResidualMemory(), dr.Pipeline(dr.TopK(1))
    g = np.array([0.5, -2.0, 1.0], np.float32)
    corrected = memory.accumulate("w", g)
    memory.settle("w", corrected, pipe.encode(corrected)[1])
    owed = g + memory.residual("w")
    memory.accumulate("w", g)   # an encoding that raises never reaches settle
    np.testing.assert_array_equal(memory.residual("w"), owed)


def test_pay_adds_what_is_owed_and_forgets_it():
    memory = dr.ResidualMemory(beta=0.5)
    memory.settle("w", np.array([2.0, 4.0], np.float32), dr.SparseTensor([4.0], [1], (2,)))
    gradient = np.ones(2, np.float32)
    assert memory.pay("w", gradient) is gradient
    np.testing.assert_array_equal(gradient, [2.0, 1.0])
    assert "w" not in memory
    np.testing.assert_array_equal(memory.pay("w", gradient), [2.0, 1.0])  # nothing owed


def test_the_earlier_api_still_works_with_a_warning():
    memory, pipe = dr.ResidualMemory(), dr.Pipeline(dr.TopK(1))
    g = np.array([0.5, -2.0, 1.0], np.float32)
    with pytest.warns(DeprecationWarning, match="accumulate"):
        corrected = memory.compensate("w", g)
    with pytest.warns(DeprecationWarning, match="settle"):
        memory.update("w", corrected, pipe.encode(corrected)[1])
    with pytest.warns(DeprecationWarning):
        memory.feedback("w", np.array([0.5, -3.0, 1.0], np.float32), pipe.encode)
    np.testing.assert_array_equal(memory.residual("w"), [1.0, 0.0, 2.0])


def test_accumulate_and_settle_around_a_deferred_delivery():
    # the reducing communicators learn what was delivered only after their collectives
    rng = np.random.default_rng(2)
    memory, residual = dr.ResidualMemory(), None
    topk = dr.TopK(0.1)
    for step in range(4):
        g = rng.standard_normal(500).astype(np.float32)
        corrected = memory.accumulate("w", g)
        expected_input, sent, residual = reference_step(residual, g, 1.0,
                                                        lambda x: (None, topk(x)))
        np.testing.assert_array_equal(corrected, expected_input)
        memory.settle("w", corrected, topk(corrected))
        np.testing.assert_array_equal(memory.residual("w"), residual)
        if step >= 1:  # from the second step the residual's own memory is reused
            assert corrected is memory.residual("w")
    # an array accumulate did not make is copied, never adopted
    outside = np.ones(500, np.float32)
    memory.settle("w", outside, topk(outside))
    assert not np.shares_memory(memory.residual("w"), outside)
    memory.reset()
    assert len(memory) == 0 and memory.accumulate("w", outside) is outside


@pytest.mark.parametrize("beta", [1.0, 0.5])
@pytest.mark.parametrize("sparsifier", [dr.TopK(0.01), dr.TopK(0.01, exact=True),
                                        dr.RandomK(0.01, seed=3), dr.Threshold(2.0)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_accumulate_and_select_is_accumulate_then_select(beta, sparsifier, dtype):
    # 3 * TopK.SAMPLE elements: TopK samples its threshold, fused with the addition
    rng = np.random.default_rng(4)
    fused, reference = dr.ResidualMemory(beta), dr.ResidualMemory(beta)
    twin = copy.deepcopy(sparsifier)  # the same random draws, in the same order
    for step in range(4):
        g = rng.standard_normal((3, dr.TopK.SAMPLE)).astype(dtype)
        corrected, selected = fused.accumulate_and_select("w", g, sparsifier)
        expected_input = reference.accumulate("w", g)
        np.testing.assert_array_equal(corrected, expected_input)
        assert selected == twin(expected_input)
        fused.settle("w", corrected, selected)
        reference.settle("w", expected_input, selected)
        np.testing.assert_array_equal(fused.residual("w"), reference.residual("w"))
        if step >= 1:
            assert corrected is fused.residual("w")


def test_accumulate_and_select_takes_any_callable():
    memory = dr.ResidualMemory()
    g = np.array([0.5, -2.0, 1.0], np.float32)
    memory.settle("w", *memory.accumulate_and_select("w", g, dr.TopK(1)))
    corrected, selected = memory.accumulate_and_select("w", g, lambda x: dr.TopK(2)(x))
    np.testing.assert_array_equal(corrected, [1.0, -2.0, 2.0])
    assert selected.indices.tolist() == [1, 2]


@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_accumulate_and_select_keeps_the_sum_when_selection_fails(beta):
    memory = dr.ResidualMemory(beta)
    g = np.arange(3 * dr.TopK.SAMPLE, dtype=np.float32)
    memory.settle("w", *memory.accumulate_and_select("w", g, dr.TopK(1)))
    owed = beta * memory.residual("w") + g
    with pytest.raises(ValueError, match="larger than the tensor"):
        memory.accumulate_and_select("w", g, dr.TopK(k=g.size + 1))
    np.testing.assert_array_equal(memory.residual("w"), owed)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # inf - inf, on purpose
@pytest.mark.parametrize("value", ["raw", "fp16", "bf16"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_settle_with_the_selection_has_the_same_bits(value, dtype):
    rng = np.random.default_rng(5)
    pipe = dr.Pipeline(None, "auto", value)
    given, plain = dr.ResidualMemory(), dr.ResidualMemory()
    for step in range(3):
        g = rng.standard_normal(3 * dr.TopK.SAMPLE).astype(dtype)
        g[[7, 70, 700]] = [np.inf, -np.inf, np.nan]  # inf - inf: the residual keeps NaN
        g[[8, 80]] = [-0.0, 6e4 * (step + 1)]          # fp16 rounds 6e4 and overflows 1.2e5
        corrected, selected = given.accumulate_and_select("w", g, dr.TopK(0.02))
        expected, twin = plain.accumulate_and_select("w", g, dr.TopK(0.02))
        _, received = pipe.encode_sparse(selected)
        assert received.indices is selected.indices
        given.settle("w", corrected, received, selected)
        plain.settle("w", expected, received)
        np.testing.assert_array_equal(given.residual("w").view(np.uint8),
                                      plain.residual("w").view(np.uint8))


def test_a_bundle_whose_coding_fails_keeps_every_residual_owed(monkeypatch):
    # the exchange codes a bundle's tensors after all their selections and settles the
    # residuals after all codings: a failure sends nothing, so nothing may be settled
    from deepreduce.exchange.gathering import SHARED_BELOW
    from deepreduce.exchange import GradientExchange

    ex = GradientExchange(sparsifier=dr.TopK(0.01), value="fp16")
    rng = np.random.default_rng(3)
    # two that share a payload, then two with their own: the last one's coding fails
    names = ["s1", "s2", "a", "b"]
    grads = [rng.standard_normal(size).astype(np.float32)
             for size in (2048, 4096, SHARED_BELOW, SHARED_BELOW)]
    ex.encode_bundle(names, grads)
    owed = [g + ex.selector.memory.residual(name) for name, g in zip(names, grads)]

    def failing(selected, dense=None):
        raise RuntimeError("codec failed")

    monkeypatch.setattr(ex.selector.pipeline_of("b"), "encode_sparse", failing)
    with pytest.raises(RuntimeError, match="codec failed"):
        ex.encode_bundle(names, grads)
    for name, expected in zip(names, owed):
        np.testing.assert_array_equal(ex.selector.memory.residual(name), expected)


@pytest.mark.parametrize("error_feedback", [True, False])
def test_fp16_beyond_its_range_is_carried_by_error_feedback_and_lost_without(error_feedback):
    """fp16 saturates at +-65504: with error feedback the rest arrives in later steps,
    without it the rest is lost (bf16, which has float32's range, loses nothing)."""
    from deepreduce.exchange import GradientExchange

    exchange = GradientExchange(sparsifier=dr.TopK(1), value="fp16", min_size=0,
                                error_feedback=error_feedback)
    gradient = np.zeros(4, np.float32)
    gradient[2] = 200_000.0
    delivered = 0.0
    for step in range(5):
        bundle = exchange.encode_bundle(["w"], [gradient if step == 0 else 0 * gradient])
        (out,) = exchange.decode_bundles(bundle, ranks=1, rank=0)
        delivered += float(out[2])
        if step == 0:
            assert out[2] == 65504.0
    assert delivered == (200_000.0 if error_feedback else 65504.0)
    bf16 = GradientExchange(sparsifier=dr.TopK(1), value="bf16", min_size=0, error_feedback=False)
    (out,) = bf16.decode_bundles(bf16.encode_bundle(["w"], [gradient]), ranks=1, rank=0)
    assert out[2] == 199_680.0   # bf16's nearest to 200,000: rounded, not saturated
