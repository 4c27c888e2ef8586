"""ExchangeConfig: what the ranks agree on before the first step."""

from deepreduce.exchange import GradientExchange


def test_shared_settings_leave_out_seeds_and_encoder_options_and_keep_their_text():
    """The text is what checkpoints carry and compare (DeepReduceState.state_dict): it
    must read the same in every release."""
    ranks = [GradientExchange(sparsifier=f"randomk:0.05,seed={r}", value=f"qsgd:bits=4,seed={r}",
                              index=f"auto:link_gbits={r + 1}", seed=r) for r in range(2)]
    first, second = (ex.config.shared_settings(ex.pipeline) for ex in ranks)
    assert first == second == {
        "sparsifier": "RandomK(ratio=0.05)", "index": "AutoIndices()",
        "value": "QSGDValues(bits=4, bucket=512, norm='max')", "communicator": "allgather",
        "communicator_options": "{}", "use_error_feedback": True, "min_size": 1024}
    default = GradientExchange()
    assert default.config.shared_settings(default.pipeline)["sparsifier"] == \
        "TopK(ratio=0.01, exact=False)"
    other = GradientExchange(value="bf16", min_size=10)
    differ = {k for k, v in other.config.shared_settings(other.pipeline).items()
              if v != default.config.shared_settings(default.pipeline)[k]}
    assert differ == {"value", "min_size"}
