"""The paged engine on a tiny random model with gpt-oss's attention (sinks, q/k/v/o biases, YaRN
RoPE, a sliding-window layer and a full one; a dense MLP, as the MoE layer is not there yet):
greedy tokens == the dense forward's (``dense_greedy``, the cache-less XLA attention, itself
checked against transformers' GptOssAttention in test_gpt_oss_attention.py), through chunked
prefill and a mixed batch, with the CPU decode kernel (``auto`` on CPU: page-major pool,
unrolled output-first layers) and with the XLA attention on a head-major pool."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from conftest import engine_config

from jaxinfer.engine.core import EngineCore
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.dense import dense_greedy
from jaxinfer.models.params import init_random
from jaxinfer.models.rope import RopeScaling
from jaxinfer.sampling.sampler import SamplingParams

CFG = ModelConfig(
    "gpt_oss",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rope_theta=500.0,
    rope_scaling=RopeScaling(
        "yarn", factor=8.0, original_max_position_embeddings=8, beta_fast=8.0, truncate=False
    ),
    attention_bias=True,
    attention_out_bias=True,
    attention_sinks=True,
    layer_windows=(5, 0),
)
PROMPTS = [list(range(3, 24)), [7, 40, 9], [60, 2, 33, 81, 5, 17, 28, 90, 11, 4, 66]]
MAX_TOKENS = 8


class _NoTokenizer:
    eos_ids = ()
    bos_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""


@pytest.fixture(scope="module")
def params():
    p = init_random(CFG, jax.random.PRNGKey(0), scale=0.3)
    sinks = 2.0 * jax.random.normal(jax.random.PRNGKey(1), p.layers.sinks.shape)
    return dataclasses.replace(p, layers=dataclasses.replace(p.layers, sinks=sinks))


@pytest.fixture(scope="module")
def dense_tokens(params):
    return [dense_greedy(params, CFG, p, MAX_TOKENS, attn_impl="xla") for p in PROMPTS]


@pytest.mark.parametrize(
    "options",
    [dict(attn_impl="auto"), dict(attn_impl="xla", kv_page_major=False)],
    ids=["auto", "xla-head-major"],
)
def test_engine_greedy_equals_dense(params, dense_tokens, options):
    ecfg = engine_config(
        CFG,
        jnp.float32,
        max_model_len=64,
        page_size=4,
        kv_pages=48,
        max_num_seqs=4,
        max_num_batched_tokens=8,  # the 21-token prompt is prefilled in chunks
        **options,
    )
    eng = EngineCore(ModelRunner(CFG, params, ecfg), _NoTokenizer())
    if options["attn_impl"] == "auto":
        assert eng.runner.attn_impl == "cpu_kernel", eng.runner.attn_impl_reason
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, sp)
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = list(o.token_ids)
    assert [done[str(i)] for i in range(len(PROMPTS))] == dense_tokens
    assert len({tuple(t) for t in dense_tokens}) == len(PROMPTS)  # not one degenerate answer
    assert any(len(set(t)) > 2 for t in dense_tokens)
