"""The all-greedy sampling variant (``sampling.sample_greedy``, ``step.sample_step_padded``'s
``greedy``; issue 21): chosen on the host only when every row is greedy with no logits controls
and no logprobs (``sampling.sample_flags``), and its tokens are numpy's argmax (lowest id on
ties). Engine-level: tests/test_bucket_reuse.py's llama2.c reference runs go through it (they
assert so), and tests/test_engine.py's mixed greedy/seeded batch through the general one."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.step import LogitsControls, jitted_sample_step, sample_step_padded
from jaxinfer.sampling.sampler import (
    GREEDY_FLAGS,
    SAMPLING_EPS,
    SamplingParams,
    SamplingTensors,
    sample_flags,
)

B, V, SLOTS = 8, 50, 16


def tie_logits() -> np.ndarray:
    """f32[B, V] with many ties at the row maximum: small integers, plus edge rows."""
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, size=(B, V)).astype(np.float32)
    x[0] = 1.5  # every token tied
    x[1] = -np.inf
    x[1, [7, 30]] = -2.0  # two finite tokens among -inf, tied
    x[2, [11, 40]] = np.inf  # two +inf tokens
    x[3, 0], x[3, V - 1] = 9.0, 9.0  # the first and the last id tied
    x[4, [5, 9]] = np.nan  # NaN logits (a broken model): argmax's first NaN
    x[5, [2, 6]] = -0.0, 0.0  # -0.0 == 0.0: a tie at the maximum
    x[5, x[5] > 0] = -1.0
    return x


def test_greedy_variant_is_numpy_argmax_lowest_id_on_ties():
    logits = tie_logits()
    expected = logits.argmax(-1)  # numpy: the first (lowest) index of the maximum
    assert expected[4] == 5 and expected[5] == 2
    tied = (logits == logits.max(-1, keepdims=True)).sum(-1)
    assert (np.delete(tied, 4) >= 2).all()  # every row but the NaN one has a tie
    st = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * B, [0] * B, [0] * B, B)
    out, padded = jitted_sample_step()(jnp.asarray(logits), st, None, num_slots=SLOTS, greedy=True)
    np.testing.assert_array_equal(np.asarray(out.tokens), expected)
    np.testing.assert_array_equal(np.asarray(padded), np.concatenate([expected, [0] * (SLOTS - B)]))
    assert np.isnan(np.asarray(out.logprobs)).all()  # not computed: nothing asked for them
    assert out.top_ids.shape == (B, 0) and out.top_logprobs.shape == (B, 0)
    # the general variant's greedy rows: the same rule
    out, _ = jitted_sample_step()(jnp.asarray(logits), st, None, num_slots=SLOTS)
    np.testing.assert_array_equal(np.asarray(out.tokens), expected)


@pytest.mark.parametrize(
    "temps", [[0.0], [0.0, 1e-6, 0.0], [0.0, 0.7], [SAMPLING_EPS], [0.7, 0.0], []]
)
@pytest.mark.parametrize("controls", [False, True])
@pytest.mark.parametrize("num_logprobs", [0, 1, 20])
def test_flags_pick_the_greedy_variant_only_for_all_greedy_plain_rows(
    temps, controls, num_logprobs
):
    params = [SamplingParams(temperature=t) for t in temps]
    # greedy iff every temperature < 1e-5 (vLLM's _SAMPLING_EPS), no controls, no logprobs
    greedy = all(t < 1e-5 for t in temps) and not controls and num_logprobs == 0
    expected = (False, 0, "greedy") if greedy else (controls, num_logprobs)
    assert sample_flags(params, controls, num_logprobs) == expected
    assert (expected == GREEDY_FLAGS) == greedy


def test_greedy_variant_refuses_controls_and_logprobs():
    logits = jnp.zeros((2, 4), jnp.float32)
    st = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * 2, [0, 0], [0, 0], 2)
    ctl = LogitsControls(np.zeros((2, 4), bool), np.zeros((2, 4), np.int32), np.zeros((2, 4), bool))
    with pytest.raises(ValueError, match="greedy=True takes no controls.*controls=set"):
        sample_step_padded(logits, st, ctl, num_slots=4, greedy=True)
    with pytest.raises(ValueError, match="num_logprobs=3"):
        sample_step_padded(logits, st, None, num_logprobs=3, num_slots=4, greedy=True)
