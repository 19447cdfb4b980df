"""Unstacked layers run as a ``lax.scan`` for many-token steps (``Params.scan_from_tokens``,
``EngineConfig.scan_layers_from_tokens``): the same logits as the unrolled loop and as the scan
over stacked weights (both checked against Hugging Face in test_hf_parity / test_family_engine
_parity), the threshold picks the loop form, bad values are refused naming the field. The engine's
greedy output with the scan path against llama2.c's reference is in test_engine (the CPU default
runs it) and below with every step a scan."""

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.engine.config import EngineConfig, scan_from_tokens
from jaxinfer.models.attention import dense_attn_fn
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.forward import compute_logits, forward
from jaxinfer.models.params import init_random, out_in_projections, unstack_layers

TOL = dict(rtol=1e-5, atol=1e-5)  # float32, as test_weight_layout

# Gemma-2-like: sandwich norms, softcaps, alternating sliding-window (2 tokens) / global layers,
# so a layer run with another layer's weights or window changes the logits.
CFG = ModelConfig(
    "gemma2",
    97,
    32,
    48,
    4,
    4,
    2,
    8,
    norm_weight_offset=1.0,
    hidden_act="gelu_tanh",
    post_norms=True,
    embed_scale=True,
    attn_logit_softcap=50.0,
    final_logit_softcap=30.0,
    layer_windows=(2, 0, 2, 0),
    tie_word_embeddings=True,
)
TOKENS = jnp.asarray([5, 17, 3, 9, 40, 2, 61, 7, 11, 90], jnp.int32)
POS = jnp.asarray([0, 1, 2, 3, 4, 5, 0, 1, 2, 3], jnp.int32)
SEG = jnp.asarray([0, 0, 0, 0, 0, 0, 1, 1, 1, 1], jnp.int32)


@pytest.fixture(scope="module")
def stacked():
    return init_random(CFG, jax.random.PRNGKey(3), scale=0.3)


def logits(params):
    h, _ = forward(params, CFG, TOKENS, POS, None, dense_attn_fn(CFG, SEG, POS))
    return np.asarray(compute_logits(params, CFG, h), np.float64)


def loop_ops(params) -> set[str]:
    """Names of the control-flow primitives in the forward's jaxpr."""
    jaxpr = jax.make_jaxpr(
        lambda p: forward(p, CFG, TOKENS, POS, None, dense_attn_fn(CFG, SEG, POS))[0]
    )(params)
    names = set()

    def walk(j):
        for e in j.eqns:
            names.add(e.primitive.name)
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return names & {"scan", "cond", "while"}


@pytest.mark.parametrize("out_in", [False, True])
def test_scan_over_unstacked_layers_matches_both_loops(stacked, out_in):
    conv = out_in_projections if out_in else (lambda p: p)
    t = len(TOKENS)
    unrolled = conv(unstack_layers(stacked))
    scanned = conv(unstack_layers(stacked, scan_from_tokens=t))  # exactly at the threshold
    assert loop_ops(unrolled) == set() and loop_ops(scanned) == {"scan", "cond"}
    ref = logits(unrolled)
    np.testing.assert_allclose(logits(scanned), ref, **TOL)
    np.testing.assert_allclose(logits(conv(stacked)), ref, **TOL)
    # below the threshold the loop stays unrolled
    assert loop_ops(conv(unstack_layers(stacked, scan_from_tokens=t + 1))) == set()


def test_scan_from_tokens_values():
    assert EngineConfig(64).scan_layers_from_tokens is None
    assert scan_from_tokens(EngineConfig(64, scan_layers_from_tokens=0)) is None  # never
    assert scan_from_tokens(EngineConfig(64, scan_layers_from_tokens=16)) == 16
    for bad in (-1, True, 2.0, "32"):
        with pytest.raises(ValueError, match="scan_layers_from_tokens"):
            EngineConfig(64, scan_layers_from_tokens=bad)
    # batch-invariant engines never switch loop form with the step's size
    assert scan_from_tokens(EngineConfig(64, batch_invariant=True)) is None
    assert (
        scan_from_tokens(EngineConfig(64, batch_invariant=True, scan_layers_from_tokens=0)) is None
    )
    with pytest.raises(ValueError, match="scan_layers_from_tokens=8 with batch_invariant"):
        EngineConfig(64, batch_invariant=True, scan_layers_from_tokens=8)
    params = init_random(CFG, jax.random.PRNGKey(0))
    for bad in (0, -3, False, 1.5):
        with pytest.raises(ValueError, match="scan_from_tokens"):
            unstack_layers(params, scan_from_tokens=bad)
    # already unstacked params only get the threshold (the buffers stay the same)
    un = unstack_layers(params)
    again = unstack_layers(un, scan_from_tokens=8)
    assert again.scan_from_tokens == 8 and again.layers is un.layers


def test_engine_every_step_a_scan_reproduces_llama2c(stories_dir):
    """The engine with unrolled layers and every step run as the scan over them
    (scan_layers_from_tokens=1): llama2.c's greedy reference, its cases in one batch."""
    from conftest import assert_reproduces_stories_reference

    from jaxinfer.engine.runner import ModelRunner
    from jaxinfer.llm import LLM

    orig = ModelRunner.__init__

    def init(self, cfg, params, ecfg, *a, **kw):
        ecfg = dataclasses.replace(ecfg, unroll_layers=True, scan_layers_from_tokens=1)
        orig(self, cfg, params, ecfg, *a, **kw)

    ModelRunner.__init__ = init
    try:
        llm = LLM(stories_dir, max_model_len=256, max_num_seqs=4, compilation_cache=False)
    finally:
        ModelRunner.__init__ = orig
    assert isinstance(llm.engine.params.layers, tuple) and llm.engine.params.scan_from_tokens == 1
    assert_reproduces_stories_reference(llm)
