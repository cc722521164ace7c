"""Fused speculative decoding's options, acceptance and what a step yields (trnsim.workload.speculation)."""

import pytest

from trnsim.config import ConfigError
from trnsim.workload.speculation import Speculation, load_acceptance, tokens_per_step


def test_a_step_yields_the_accepted_prefix_and_the_targets_token():
    # k = 3: the target sees the last token and 2 drafts; 1 token always, the 2nd with a, the 3rd with a^2
    assert tokens_per_step(0.0, 3) == 1.0
    assert tokens_per_step(1.0, 3) == 3.0
    assert tokens_per_step(0.5, 3) == pytest.approx(1 + 0.5 + 0.25)
    assert tokens_per_step(0.971, 7) == pytest.approx((1 - 0.971 ** 7) / (1 - 0.971))


def test_the_speculative_tpot_is_the_step_over_its_tokens():
    pytest.importorskip("torch")
    from torch_bridge.timing.estimate_kernels import speculative_tpot

    # 100 output positions in one bucket, steps of 30 ms yielding 3 tokens, the first step 40 ms
    assert speculative_tpot([(512, 30.0, 100)], 40.0, 3.0) == pytest.approx((30.0 * 100 / 3 - 30.0 + 40.0) / 100)
    # two buckets: each bucket's positions at its own step time
    assert speculative_tpot([(512, 30.0, 60), (1024, 36.0, 40)], 30.0, 2.0) == pytest.approx(
        (30.0 * 30 + 36.0 * 20) / 100)


def test_a_named_acceptance_quotes_its_calibration_row():
    a, source = load_acceptance("llmperf-sonnet.llama-3.2-1b-draft")
    assert 0.0 < a < 1.0
    assert "calibrated on inf.trn2.llama-3.3-70b.tp64.fused-spec.tpot" in source
    assert load_acceptance("0.5") == (0.5, "--acceptance 0.5 as given")


@pytest.mark.parametrize("args,message", [
    ((None, 7, None), "--speculation-length: speculation needs a draft model (--draft-model)"),
    (("llama-3.2-1b", None, 0.9), "--draft-model: give --speculation-length (NxDI's speculation_length: draft steps "
                                  "and target tokens per fused step)"),
    (("llama-3.2-1b", 1, 0.9), "--speculation-length 1: expected a whole number >= 2 (the draft steps and target "
                               "tokens of a fused step)"),
    (("llama-3.2-1b", 7, None), "--draft-model: give --acceptance (the rate at which the target accepts a draft "
                                "token: a property of the models and prompts, not of the chip; a number in [0, 1] or "
                                "a name from configs/speculation/acceptance.yaml)"),
    (("llama-3.2-1b", 7, 1.5), "--acceptance 1.5: expected a rate in [0, 1] (each draft token accepted with this "
                               "probability) or a name from acceptance.yaml"),
    (("llama-3.2-1b", 7, "sonnets"), "--acceptance sonnets: expected a rate in [0, 1] or one of "
                                     "llmperf-sonnet.llama-3.2-1b-draft (acceptance.yaml)"),
])
def test_speculation_options_are_refused_in_one_line(args, message):
    with pytest.raises(ConfigError) as info:
        Speculation.of(*args)
    assert str(info.value) == message
