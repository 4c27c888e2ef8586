"""ExchangeConfig: what the ranks agree on before the first step, its presets and checks."""

import pytest

import deepreduce as dr
from deepreduce.config import ExchangeConfig
from deepreduce.exchange import GradientExchange
from deepreduce.exchange.integration import Integration, upgraded_settings


def shared(exchange):
    return exchange.config.shared_settings(exchange.selector.pipeline)


def test_shared_settings_leave_out_seeds_and_encoder_options_and_keep_their_text():
    """The text is what checkpoints carry and compare (DeepReduceState.state_dict): it
    must read the same in every release (0.1's ``use_error_feedback`` is upgraded)."""
    ranks = [GradientExchange(sparsifier=f"randomk:0.05,seed={r}", value=f"qsgd:bits=4,seed={r}",
                              index=f"auto:link_gbits={r + 1}", seed=r) for r in range(2)]
    first, second = (shared(ex) for ex in ranks)
    assert first == second == {
        "sparsifier": "RandomK(ratio=0.05)", "index": "AutoIndices()",
        "value": "QSGDValues(bits=4, bucket=512, norm='max')", "communicator": "allgather",
        "communicator_options": "{}", "error_feedback": 1.0, "min_size": 1024}
    default = GradientExchange()
    assert shared(default)["sparsifier"] == "TopK(ratio=0.01, exact=False)"
    other = GradientExchange(value="bf16", min_size=10, error_feedback=0.9)
    differ = {k for k, v in shared(other).items() if v != shared(default)[k]}
    assert differ == {"value", "min_size", "error_feedback"}
    assert shared(GradientExchange(error_feedback=False))["error_feedback"] == "off"


def test_checkpoints_of_0_1_read_their_error_feedback_as_the_decay():
    old = {"sparsifier": "TopK(ratio=0.01, exact=False)", "use_error_feedback": True}
    assert upgraded_settings(old) == {"sparsifier": "TopK(ratio=0.01, exact=False)",
                                      "error_feedback": 1.0, "check_finite": True}
    assert upgraded_settings({"use_error_feedback": False})["error_feedback"] == "off"
    frame = Integration(ExchangeConfig(), {})
    frame.check_settings({**{k: v for k, v in frame.settings.items() if k != "error_feedback"},
                          "use_error_feedback": True})
    with pytest.raises(ValueError, match="error_feedback 'off' there, 1.0 here"):
        frame.check_settings({**frame.settings, "error_feedback": "off"})


def test_presets():
    sparseloco = ExchangeConfig.sparseloco()
    assert (sparseloco.sparsifier, sparseloco.index, sparseloco.value, sparseloco.min_size,
            sparseloco.error_feedback) == ("chunktopk:k=64,chunk=4096", "chunked",
                                           "statq:bits=2,sigmas=6", 0, 0.95)
    assert ExchangeConfig.sparseloco(error_feedback=False).error_feedback is None
    dense = ExchangeConfig.diloco()
    assert (dense.sparsifier, dense.value, dense.error_feedback) == (None, "raw", None)
    # a pipeline that loses anything feeds its error back, unless told otherwise
    assert ExchangeConfig.diloco(value="bf16").error_feedback == 1.0
    assert ExchangeConfig.diloco(sparsifier=dr.TopK(0.1)).error_feedback == 1.0
    assert ExchangeConfig.diloco(value="bf16", error_feedback=0.5).error_feedback == 0.5


@pytest.mark.parametrize("settings, message", [
    ({"error_feedback": 1.5}, "error_feedback must be a decay in"),
    ({"error_feedback": "yes"}, "error_feedback must be a decay in"),
    ({"min_size": -1}, "min_size must be an integer >= 0"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"codec_threads": 0}, "codec_threads must be None .automatic. or an integer >= 1"),
])
def test_bad_settings_name_the_argument(settings, message):
    with pytest.raises(ValueError, match=message):
        ExchangeConfig(**settings)


def test_the_frame_checks_its_own_settings():
    with pytest.raises(ValueError, match="check_finite must be True or False, got 'no'"):
        Integration(ExchangeConfig(), {}, check_finite="no")
