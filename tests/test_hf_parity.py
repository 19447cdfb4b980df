"""Parity of jaxinfer with Hugging Face transformers on tiny random checkpoints of every family.

Each case of ``hf_fixtures.CASES`` is saved by transformers, loaded by ``load_hf`` and compared with
transformers' own forward (eager attention, eval mode) on a 2 x 24-token batch, and greedy decoding
is
compared with ``generate(do_sample=False)``.

Metrics: ``max_abs = max|jax - hf|`` over all logits; ``max_rel = max_abs / max|hf_f32|``.

Tolerances, keyed by dtype:

- float32: ``max_rel <= 1e-4``. Both sides compute in f32 with different summation orders; f32's
  unit roundoff is 6e-8, and a 2-3 layer model stays within ~3e-6 (measured), so 1e-4 leaves 30x
  room while catching any real difference (a mask off by one, a missing ``1 + w``, a wrong RoPE
  base all give >= 1e-2, see ``test_parity_detects_wrong_config``).
- bfloat16: both sides load the same checkpoint rounded to bf16 (unit roundoff u = 2^-8 = 3.9e-3)
  and round activations at different points (transformers rounds RoPE, softmax probabilities and
  soft-caps to bf16; jaxinfer keeps them in f32), so each deviates from the exact (f32) result by
  bf16 noise amplified by the model, and they deviate from each other by up to the sum of the two.
  No fixed number bounds that: the amplification depends on the random model's conditioning
  (transformers' own bf16 error ``e_hf = max|hf_bf16 - hf_f32| / max|hf_f32|`` is 1.5e-2 at weight
  std 0.1 and 2-7e-2 at the std 0.2-0.3 used here). The bound is therefore stated against e_hf
  measured on the same model and tokens:
  ``max_rel(jax_bf16, hf_bf16) <= 2 e_hf`` (triangle inequality, for a bf16 path no less accurate
  than transformers'), and jaxinfer's own bf16 error must not exceed transformers' (RMS over all
  logits, the stable statistic): ``rms(jax_bf16 - hf_f32) <= 1.25 rms(hf_bf16 - hf_f32)``.
"""

from __future__ import annotations

import dataclasses
import json
import os

import hf_fixtures as H
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.loaders.hf import load_hf
from jaxinfer.models.dense import dense_greedy, dense_logits

F32_MAX_REL = 1e-4
BF16_VS_HF_ERROR = 2.0  # x transformers' own bf16 max error
BF16_RMS_RATIO = 1.25

CASES = list(H.CASES)
FIGURES: dict[str, dict] = {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> directory of the saved checkpoint (built once per module)."""
    root = tmp_path_factory.mktemp("hf_ckpts")
    built: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in built:
            built[name] = H.build_checkpoint(name, str(root / name))
        return built[name]

    return get


class _Shared:
    """Per module, per checkpoint: transformers' f32 model, its logits on ``H.sample_tokens()``
    and jaxinfer's f32 load (``load_hf``), each computed once and shared by the tests that use
    them (the f32, bf16, greedy and wrong-config tests of one family read the same reference)."""

    def __init__(self):
        self.models, self.logits, self.loaded = {}, {}, {}

    def hf_f32(self, path):
        if path not in self.models:
            self.models[path] = H.hf_model(path, "float32")
        return self.models[path]

    def hf_f32_logits(self, path):
        if path not in self.logits:
            self.logits[path] = H.hf_logits(self.hf_f32(path), H.sample_tokens())
        return self.logits[path]

    def load(self, path):
        if path not in self.loaded:
            self.loaded[path] = load_hf(path)
        return self.loaded[path]


@pytest.fixture(scope="module")
def shared():
    return _Shared()


@pytest.fixture(scope="module", autouse=True)
def _print_figures():
    yield
    if FIGURES:
        print("\nHF parity figures:\n" + json.dumps(FIGURES, indent=1))


@pytest.mark.parametrize("name", CASES)
def test_logits_f32(checkpoint, shared, name, record_property):
    path = checkpoint(name)
    tokens = H.sample_tokens()
    ref = shared.hf_f32_logits(path)
    cfg, params = shared.load(path)  # as H.jax_logits(path, "float32", tokens)
    got = np.asarray(dense_logits(params, cfg, jnp.asarray(tokens)))
    assert np.abs(ref).max() > 1.0 and ref.std() > 0.3, "logits too small to be a meaningful test"
    err = H.errors(got, ref)
    FIGURES.setdefault(name, {})["f32"] = err
    record_property("f32", err)
    assert err["max_rel"] <= F32_MAX_REL, (name, err)
    assert (got.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("name", CASES)
def test_logits_bf16(checkpoint, shared, name, record_property):
    path = checkpoint(name)
    tokens = H.sample_tokens()
    ref32 = shared.hf_f32_logits(path)
    ref16 = H.hf_logits(H.hf_model(path, "bfloat16"), tokens)
    got16, _, params = H.jax_logits(path, "bfloat16", tokens)
    assert params.embed.dtype == jnp.bfloat16
    err = H.errors(got16, ref16, ref32)
    e_hf = H.errors(ref16, ref32)
    e_jax = H.errors(got16, ref32)
    FIGURES.setdefault(name, {})["bf16"] = err
    FIGURES[name]["hf_bf16_vs_f32"] = e_hf
    FIGURES[name]["jax_bf16_vs_f32"] = e_jax
    record_property("bf16", err)
    assert err["max_rel"] <= BF16_VS_HF_ERROR * e_hf["max_rel"], (name, err, e_hf)
    assert e_jax["rms_rel"] <= BF16_RMS_RATIO * e_hf["rms_rel"], (name, e_jax, e_hf)


@pytest.mark.parametrize("name", CASES)
def test_greedy_matches_generate(checkpoint, shared, name):
    import torch

    path = checkpoint(name)
    model = shared.hf_f32(path)
    prompt = H.sample_tokens(seed=1)[0, : H.PROMPT_LEN]
    with torch.no_grad():
        out = model.generate(
            torch.tensor(prompt[None], dtype=torch.long),
            attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
            do_sample=False,
            max_new_tokens=H.NEW_TOKENS,
            min_new_tokens=H.NEW_TOKENS,
            pad_token_id=0,
        )
    ref = out[0, len(prompt) :].tolist()
    cfg, params = shared.load(path)
    got = dense_greedy(params, cfg, prompt.tolist(), H.NEW_TOKENS)
    assert len(ref) == H.NEW_TOKENS
    assert got == ref
    assert len(set(ref)) >= 8, "degenerate continuation, not a meaningful test"


def test_cases_cover_the_matrix(checkpoint, shared):
    """The families and variants the parity tests are meant to cover really occur."""
    cfgs = {n: shared.load(checkpoint(n))[0] for n in CASES}
    assert {c.model_type for c in cfgs.values()} >= {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma",
        "gemma2",
        "gemma3_text",
    }
    assert any(c.num_kv_heads == 1 for c in cfgs.values())  # MQA
    assert any(1 < c.num_kv_heads < c.num_heads for c in cfgs.values())  # GQA
    assert any(c.num_kv_heads == c.num_heads for c in cfgs.values())  # MHA
    assert any(c.tie_word_embeddings for c in cfgs.values())
    assert any(not c.tie_word_embeddings for c in cfgs.values())
    assert any(c.head_dim != c.hidden_size // c.num_heads for c in cfgs.values())
    assert cfgs["llama3"].rope_scaling.rope_type == "llama3"
    assert cfgs["llama_linear_hd24"].rope_scaling.rope_type == "linear"
    assert cfgs["mistral"].layer_windows == (8, 8)
    assert cfgs["gemma2"].layer_windows == (8, 0, 8)
    assert cfgs["gemma3"].layer_windows == (8, 0, 8)
    assert cfgs["gemma3"].rope_local_theta == 10000.0 and cfg_rope(cfgs["gemma3"]) == "linear"
    assert cfgs["qwen2"].attention_bias and cfgs["qwen3"].qk_norm
    assert all(max(c.layer_windows) < H.SEQ_LEN for c in cfgs.values())
    assert os.path.exists(os.path.join(checkpoint("llama2"), "model.safetensors.index.json"))


def cfg_rope(cfg):
    return cfg.rope_scaling.rope_type if cfg.rope_scaling else None


@pytest.mark.parametrize(
    "name, change",
    [
        ("mistral", dict(layer_windows=(0, 0))),  # sliding window ignored
        ("gemma2", dict(layer_windows=(0, 0, 0))),
        ("gemma2", dict(layer_windows=(0, 8, 0))),  # odd instead of even layers slide
        ("gemma2", dict(attn_logit_softcap=None)),
        ("gemma3", dict(rope_local_theta=None)),  # global RoPE on local layers
        ("gemma3", dict(layer_windows=(9, 0, 9))),  # window off by one
        ("gemma3", dict(rope_scaling=None)),
        ("llama3", dict(rope_scaling=None)),
        ("gemma", dict(embed_scale=False)),
        ("qwen3", dict(rms_norm_eps=1e-1)),
    ],
)
def test_parity_detects_wrong_config(checkpoint, shared, name, change):
    """The f32 comparison fails by a wide margin when one family detail is wrong."""
    path = checkpoint(name)
    tokens = H.sample_tokens()
    ref = shared.hf_f32_logits(path)
    cfg, params = shared.load(path)
    wrong = dataclasses.replace(cfg, **change)
    got = np.asarray(dense_logits(params, wrong, jnp.asarray(tokens)))
    assert H.errors(got, ref)["max_rel"] > 100 * F32_MAX_REL


@pytest.mark.parametrize("layout", ["model.language_model.", "language_model.model."])
def test_gemma3_multimodal_checkpoint(checkpoint, shared, tmp_path, layout):
    """A ``gemma3`` (multimodal) checkpoint loads its text tower: nested text_config, prefixed
    tensor names (transformers 5 and 4 layouts), vision tensors ignored."""
    from safetensors.numpy import load_file, save_file

    src = checkpoint("gemma3")
    with open(os.path.join(src, "config.json")) as f:
        text = json.load(f)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    head = "lm_head.weight" if layout.startswith("model.") else "language_model.lm_head.weight"
    renamed = {
        (layout + k[len("model.") :] if k.startswith("model.") else head): v
        for k, v in tensors.items()
    }
    assert head in renamed  # the gemma3 case is untied
    renamed["vision_tower.vision_model.post_layernorm.weight"] = np.ones(8, np.float32)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    tie = text.pop("tie_word_embeddings")  # the top-level flag governs gemma3
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "gemma3", "text_config": text, "tie_word_embeddings": tie}, f)
    cfg_a, params_a = shared.load(src)
    cfg_b, params_b = load_hf(tmp_path)
    assert cfg_b == cfg_a
    tokens = jnp.asarray(H.sample_tokens())
    np.testing.assert_array_equal(
        dense_logits(params_b, cfg_b, tokens), dense_logits(params_a, cfg_a, tokens)
    )
