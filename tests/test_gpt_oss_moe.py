"""gpt-oss end to end against transformers 5's ``GptOssForCausalLM`` on tiny random checkpoints
(``gpt_oss_fixtures``: a sliding and a full layer, YaRN, nonzero sinks, 4 experts top-2, router
and expert biases, gate_up values beyond the clamp).

- The cache-less forward's logits == transformers' f32 logits at ``test_hf_parity``'s bound
  (max_rel 1e-4), and the clamp matters on these weights (transformers without it differs).
- Through the paged engine (``LLM``, ``test_moe_parity``'s engine: KV pages of 8, an 8-token step
  budget, so the 13- and 19-token prompts are prefilled in chunks beside decoding rows): greedy
  tokens == transformers' greedy ``generate``, and the logprob of every prompt position and every
  generated token == ``log_softmax`` of transformers' f32 logits within 1e-4.
- MXFP4-stored experts (``*_blocks`` / ``*_scales``, dequantized at load): the same weights as
  transformers gets from ``convert_moe_packed_tensors``, and the engine's greedy tokens ==
  transformers' on those dequantized weights.
- The clamped SwiGLU == an independent numpy formula, on values beyond the clamp; and ==
  transformers' ``GptOssExperts._apply_gate`` on the interleaved layout after the loader's
  de-interleave.
- Bad expert tensors are refused naming the file and the tensor.
- bfloat16 logits within ``test_hf_parity``'s bf16 bounds (against transformers' own bf16 error).
"""

from __future__ import annotations

import json
import os
import shutil

import gpt_oss_fixtures as G
import hf_fixtures as H
import jax.numpy as jnp
import numpy as np
import pytest
from test_moe_parity import ENGINE, F32_MAX_REL, LOGPROB_ATOL, NEW, PROMPT_LENS

from jaxinfer.errors import CheckpointError
from jaxinfer.llm import LLM
from jaxinfer.loaders.hf import load_hf
from jaxinfer.loaders.hf_gpt_oss_weights import deinterleave_gate_up
from jaxinfer.models.dense import dense_logits
from jaxinfer.models.moe import gpt_oss_clamped_glu
from jaxinfer.sampling.sampler import SamplingParams

torch = pytest.importorskip("torch")


def _prompts() -> list[list[int]]:
    ids = H.random_ids(sum(PROMPT_LENS), seed=7)
    out, at = [], 0
    for n in PROMPT_LENS:
        out.append(ids[at : at + n])
        at += n
    return out


def _reference(model, prompts):
    """Per prompt: transformers' greedy tokens and f64[S, V] log_softmax of its f32 logits of the
    whole sequence."""
    ids, lps = [], []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([p], dtype=torch.long),
                attention_mask=torch.ones((1, len(p)), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                pad_token_id=0,
            )
        seq = out[0].tolist()
        ids.append(seq[len(p) :])
        lps.append(H.log_softmax(H.hf_logits(model, [seq])[0]))
    return ids, lps


def _check_engine(path, model, tag):
    prompts = _prompts()
    ref_ids, ref_lp = _reference(model, prompts)
    assert len({tuple(t) for t in ref_ids}) == len(prompts)
    assert all(len(set(t)) >= 4 for t in ref_ids), ref_ids  # varied continuations
    llm = LLM(path, **ENGINE)
    assert llm.engine.cfg.expert_glu == "gpt_oss_clamped"
    assert min(PROMPT_LENS) < ENGINE["max_num_batched_tokens"] < max(PROMPT_LENS)
    sp = SamplingParams(
        temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    outs = llm.generate(prompts, sp)
    for i, (out, p, want, lp) in enumerate(zip(outs, prompts, ref_ids, ref_lp, strict=True)):
        assert out.error is None, (tag, out.error)
        assert out.token_ids == want, (tag, i)
        got_prompt = [e.logprob for e in out.prompt_logprobs[1:]]
        np.testing.assert_allclose(
            got_prompt,
            lp[np.arange(len(p) - 1), p[1:]],
            rtol=0,
            atol=LOGPROB_ATOL,
            err_msg=f"{tag} prompt {i}",
        )
        pos = np.arange(len(p) - 1, len(p) - 1 + NEW)
        np.testing.assert_allclose(
            [e.logprob for e in out.logprobs],
            lp[pos, want],
            rtol=0,
            atol=LOGPROB_ATOL,
            err_msg=f"{tag} output {i}",
        )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(path, transformers f32 model) of the float checkpoint."""
    path = G.build_checkpoint(str(tmp_path_factory.mktemp("gpt_oss") / "float"))
    return path, H.hf_model(path, "float32")


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """(float dir, mxfp4 dir, transformers f32 model of the float dir)."""
    float_dir, mxfp4_dir = G.build_mxfp4_checkpoint(str(tmp_path_factory.mktemp("gpt_oss_mx")))
    return float_dir, mxfp4_dir, H.hf_model(float_dir, "float32")


def test_forward_logits_equal_transformers(checkpoint):
    path, model = checkpoint
    tokens = H.sample_tokens()
    ref = H.hf_logits(model, tokens)
    cfg, params = load_hf(path)
    assert cfg.model_type == "gpt_oss" and cfg.layer_windows == (8, 0)
    assert cfg.router_bias and cfg.expert_bias and params.layers.expert_down_bias is not None
    got = np.asarray(dense_logits(params, cfg, jnp.asarray(tokens)))
    err = H.errors(got, ref)
    assert np.abs(ref).max() > 1.0 and ref.std() > 0.3
    assert err["max_rel"] <= F32_MAX_REL, err
    # the clamp acts on these weights: without it transformers' logits move far off
    limits = [layer.mlp.experts.limit for layer in model.model.layers]
    try:
        for layer in model.model.layers:
            layer.mlp.experts.limit = float("inf")
        unclamped = H.hf_logits(model, tokens)
    finally:
        for layer, limit in zip(model.model.layers, limits, strict=True):
            layer.mlp.experts.limit = limit
    assert H.errors(unclamped, ref)["max_rel"] > 100 * F32_MAX_REL


def test_engine_greedy_and_logprobs_equal_transformers(checkpoint):
    path, model = checkpoint
    _check_engine(path, model, "float")


def test_mxfp4_experts_equal_transformers(mxfp4_checkpoint):
    """The MXFP4 checkpoint loads to the float checkpoint's weights exactly (the dequantized
    values are representable), and the engine's greedy tokens and logprobs == transformers' on
    the dequantized weights."""
    float_dir, mxfp4_dir, model = mxfp4_checkpoint
    cfg_f, params_f = load_hf(float_dir)
    cfg_q, params_q = load_hf(mxfp4_dir)
    assert cfg_q == cfg_f
    for name in ("expert_gate_up", "expert_down", "expert_gate_up_bias", "router"):
        np.testing.assert_array_equal(
            np.asarray(getattr(params_q.layers, name)), np.asarray(getattr(params_f.layers, name))
        )
    _, params_16 = load_hf(mxfp4_dir, jnp.bfloat16)
    assert params_16.layers.expert_gate_up.dtype == jnp.bfloat16
    _check_engine(mxfp4_dir, model, "mxfp4")


LIMIT, ALPHA = 7.0, 1.702


def _numpy_clamped_swiglu(gate, up):
    g = np.minimum(gate.astype(np.float64), LIMIT)
    u = np.clip(up.astype(np.float64), -LIMIT, LIMIT)
    return (u + 1.0) * g / (1.0 + np.exp(-ALPHA * g))


def test_clamped_swiglu_equals_numpy_beyond_the_clamp():
    rng = np.random.default_rng(0)
    gate = rng.uniform(-20, 20, (16, 24)).astype(np.float32)
    up = rng.uniform(-20, 20, (16, 24)).astype(np.float32)
    gate[0, :4], up[0, :4] = [7.0, 7.5, -30.0, 100.0], [-7.5, 7.0, 8.0, -100.0]
    assert (gate > LIMIT).mean() > 0.2 and (np.abs(up) > LIMIT).mean() > 0.4
    got = np.asarray(gpt_oss_clamped_glu(jnp.asarray(np.concatenate([gate, up], -1)), 7.0, 1.702))
    np.testing.assert_allclose(got, _numpy_clamped_swiglu(gate, up), rtol=1e-6, atol=1e-5)


def test_deinterleaved_glu_equals_transformers_apply_gate():
    """transformers' ``_apply_gate`` on the interleaved gate_up == ours on the loader's
    de-interleaved copy."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(GptOssConfig(**G.CONFIG))
    x = np.random.default_rng(1).normal(0, 8, (10, 2 * 32)).astype(np.float32)
    ref = experts._apply_gate(torch.from_numpy(x)).numpy()
    got = np.asarray(gpt_oss_clamped_glu(jnp.asarray(deinterleave_gate_up(x)), 7.0, 1.702))
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


def _rewrite(src: str, dst: str, change) -> str:
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    change(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


P = "model.layers.1.mlp.experts."


@pytest.mark.parametrize(
    "case,change,message",
    [
        (
            "scales_shape",
            lambda t: t.update({P + "down_proj_scales": t[P + "down_proj_scales"][:, :, :0]}),
            rf"tensor '{P}down_proj_scales' \(for layers.expert_down\) has shape",
        ),
        (
            "blocks_dtype",
            lambda t: t.update({P + "gate_up_proj_blocks": t[P + "gate_up_proj_blocks"] * 1.0}),
            rf"tensor '{P}gate_up_proj_blocks' has dtype F64; supported: U8",
        ),
        (
            "scale_overflow",
            lambda t: t[P + "down_proj_scales"].__setitem__((0, 0, 0), 255),
            rf"{P}down_proj_blocks",
        ),
        (
            "missing_bias",
            lambda t: t.pop(P + "gate_up_proj_bias"),
            rf"tensor '{P}gate_up_proj_bias' is missing",
        ),
        (
            "router_bias_shape",
            lambda t: t.update({"model.layers.0.mlp.router.bias": np.zeros(5, np.float32)}),
            r"tensor 'model.layers.0.mlp.router.bias' \(for layers.router_bias\) has shape",
        ),
    ],
)
def test_bad_expert_tensors_are_named(mxfp4_checkpoint, tmp_path, case, change, message):
    _, mxfp4_dir, _ = mxfp4_checkpoint
    path = _rewrite(mxfp4_dir, str(tmp_path / case), change)
    with pytest.raises(CheckpointError, match=message) as e:
        load_hf(path)
    assert "model.safetensors" in str(e.value)


def test_mxfp4_size_check_and_odd_width(mxfp4_checkpoint, tmp_path):
    """The size check counts MXFP4 experts at 17/32 of a byte (this checkpoint loads), and a
    config whose expert input width is not a multiple of 32 is refused naming the tensor."""
    _, mxfp4_dir, _ = mxfp4_checkpoint
    path = shutil.copytree(mxfp4_dir, str(tmp_path / "odd"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["intermediate_size"] = 24
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match=r"down_proj_blocks'.*multiple of 32"):
        load_hf(path)


BF16_VS_HF_ERROR = 2.0  # as test_hf_parity: x transformers' own bf16 max error
BF16_RMS_RATIO = 1.25


def test_forward_logits_bf16(checkpoint):
    """bfloat16 weights against transformers in bfloat16, at test_hf_parity's bounds (stated
    against transformers' own bf16 error on the same model and tokens)."""
    path, model = checkpoint
    tokens = H.sample_tokens()
    ref32 = H.hf_logits(model, tokens)
    ref16 = H.hf_logits(H.hf_model(path, "bfloat16"), tokens)
    got16, _, params = H.jax_logits(path, "bfloat16", tokens)
    assert params.layers.expert_down_bias.dtype == jnp.bfloat16
    err, e_hf, e_jax = H.errors(got16, ref16, ref32), H.errors(ref16, ref32), H.errors(got16, ref32)
    assert err["max_rel"] <= BF16_VS_HF_ERROR * e_hf["max_rel"], (err, e_hf)
    assert e_jax["rms_rel"] <= BF16_RMS_RATIO * e_hf["rms_rel"], (e_jax, e_hf)
