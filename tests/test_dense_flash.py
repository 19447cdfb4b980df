"""The dense (cache-less, whole-sequence) forward with the FlashAttention kernel wired in
(``dense_logits(..., attn_impl="pallas_*_interpret")``, the kernel interpreted on CPU) against
transformers' logits on the same weights and against the XLA dense path, and the choice of
``attn_impl`` (resolution per backend, errors naming what is supported).

Tolerances, keyed by dtype, as in tests/test_hf_parity.py (whose docstring derives them):
float32 ``max_rel <= 1e-4`` against transformers; bfloat16 against transformers' own bf16 error on
the same model and tokens. Against the XLA dense path in float32 the kernel differs only in
summation order (online softmax over tiles): ``max_rel <= 1e-5``.

Cases: Gemma 2 (attention soft-cap, query_pre_attn_scalar's scale, sliding and global layers
alternating: the kernel's window is picked per layer under ``lax.scan``, GQA N=4 K=2, 24 tokens
padded to a 32-token tile); Mistral packed (MQA, every layer sliding with window 8, two sequences
and a padding run packed in one row by segment ids); stories260K against llama2.c's greedy
reference (201 tokens: two tiles).
"""

from __future__ import annotations

import os

import hf_fixtures as H
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import stories_reference

from jaxinfer.loaders.hf import load_hf
from jaxinfer.models import dense
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.dense import DENSE_ATTN_IMPLS, dense_logits, resolve_dense_attn_impl

F32_MAX_REL = 1e-4  # against transformers (tests/test_hf_parity.py)
F32_VS_XLA_MAX_REL = 1e-5  # against the XLA dense path: summation order only
BF16_VS_HF_ERROR = 2.0  # x transformers' own bf16 max error (tests/test_hf_parity.py)
BF16_RMS_RATIO = 1.25
# JAXINFER_KERNEL_DEVICE=<tpu|gpu> (a device check) runs the kernel compiled for that device; by
# default both variants run interpreted on CPU (the TPU one with Mosaic semantics).
DEVICE = os.environ.get("JAXINFER_KERNEL_DEVICE")
KERNELS = (f"pallas_{DEVICE}",) if DEVICE else ("pallas_gpu_interpret", "pallas_tpu_interpret")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> (path, transformers' f32 logits of ``H.sample_tokens()``), built once."""
    root = tmp_path_factory.mktemp("hf_ckpts")
    built: dict[str, tuple[str, np.ndarray]] = {}

    def get(name: str):
        if name not in built:
            path = H.build_checkpoint(name, str(root / name))
            built[name] = path, H.hf_logits(H.hf_model(path, "float32"), H.sample_tokens())
        return built[name]

    return get


@pytest.mark.parametrize("attn_impl", KERNELS)
def test_gemma2_f32_matches_transformers_and_xla(checkpoint, attn_impl):
    path, ref = checkpoint("gemma2")
    cfg, params = load_hf(path)
    assert cfg.layer_windows == (8, 0, 8) and cfg.attn_logit_softcap is not None
    assert cfg.attn_scale != cfg.head_dim**-0.5  # query_pre_attn_scalar
    tokens = jnp.asarray(H.sample_tokens())
    got = np.asarray(dense_logits(params, cfg, tokens, attn_impl))
    assert H.errors(got, ref)["max_rel"] <= F32_MAX_REL
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    xla = np.asarray(dense_logits(params, cfg, tokens, "xla"))
    assert H.errors(got, xla)["max_rel"] <= F32_VS_XLA_MAX_REL


def test_gemma2_bf16_matches_transformers(checkpoint):
    path, ref32 = checkpoint("gemma2")
    tokens = H.sample_tokens()
    ref16 = H.hf_logits(H.hf_model(path, "bfloat16"), tokens)
    cfg, params = load_hf(path, jnp.bfloat16)
    got16 = np.asarray(dense_logits(params, cfg, jnp.asarray(tokens), KERNELS[0]))
    e_hf = H.errors(ref16, ref32)
    assert H.errors(got16, ref16, ref32)["max_rel"] <= BF16_VS_HF_ERROR * e_hf["max_rel"]
    assert H.errors(got16, ref32)["rms_rel"] <= BF16_RMS_RATIO * e_hf["rms_rel"]


@pytest.mark.parametrize("attn_impl", ["xla", KERNELS[0]])
def test_packed_sequences_match_transformers(checkpoint, attn_impl):
    """Two sequences and a padding run packed in one row: each run's logits are transformers'
    logits of that sequence alone (positions restart at each run, no attention across runs)."""
    path, ref = checkpoint("mistral")
    cfg, params = load_hf(path)
    assert cfg.num_kv_heads == 1 and cfg.layer_windows == (8, 8)
    a, b = 11, 10  # both longer than the window
    toks = H.sample_tokens()
    row = np.concatenate([toks[0, :a], toks[1, :b], np.zeros(3, np.int32)])[None]
    ids = np.array([[7] * a + [3] * b + [7] * 3], np.int32)  # 7 again: a new run (padding)
    got = np.asarray(dense_logits(params, cfg, jnp.asarray(row), attn_impl, jnp.asarray(ids)))[0]
    want = np.concatenate([ref[0, :a], ref[1, :b]])
    assert H.errors(got[: a + b], want)["max_rel"] <= F32_MAX_REL
    assert (got[: a + b].argmax(-1) == want.argmax(-1)).all()


def test_stories260k_matches_llama2c(stories_dir):
    """stories260K (a real llama2.c model: GQA N=8 K=4, head_dim 8) over llama2.c's 200-step
    greedy reference, teacher-forced in one call: every generated token is the argmax after the
    tokens before it (so greedy decoding reproduces the reference). 201 tokens: two 128-token
    tiles, the second mostly padding."""
    from jaxinfer.loaders.llama2c import load_llama2c
    from jaxinfer.tokenizers import load_tokenizer

    cfg, params = load_llama2c(stories_dir / "stories260K.bin")
    tok = load_tokenizer(stories_dir / "tok512.model", vocab_size=cfg.vocab_size)
    case = max(stories_reference(), key=lambda c: c["max_steps"])
    ids = tok.encode(case["expected"], add_special_tokens=True)
    assert len(ids) == case["max_steps"] + 1 > 128  # as generated: BOS + max_steps tokens
    assert tok.decode(ids[1:], skip_special_tokens=True) == case["expected"]
    n = len(tok.encode(case["prompt"], add_special_tokens=True))
    logits = np.asarray(dense_logits(params, cfg, jnp.asarray([ids]), KERNELS[0]))[0]
    np.testing.assert_array_equal(logits[n - 1 : -1].argmax(-1), ids[n:])


def _cfg(**change):
    base = dict(
        model_type="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    return ModelConfig(**{**base, **change})


def test_resolve_dense_attn_impl(monkeypatch):
    cfg, f32 = _cfg(), jnp.float32
    assert resolve_dense_attn_impl("auto", cfg, f32, "cpu") == "xla"
    assert resolve_dense_attn_impl("auto", cfg, f32, "gpu") == "xla"  # not verified yet
    assert resolve_dense_attn_impl("pallas", cfg, f32, "gpu") == "pallas_gpu"
    assert resolve_dense_attn_impl("pallas_tpu", cfg, f32, "tpu") == "pallas_tpu"
    assert resolve_dense_attn_impl("pallas_tpu_interpret", cfg, f32, "cpu") == (
        "pallas_tpu_interpret"
    )
    monkeypatch.setattr(dense, "FLASH_VERIFIED_BACKENDS", ("gpu",))
    assert resolve_dense_attn_impl("auto", cfg, f32, "gpu") == "pallas_gpu"
    assert resolve_dense_attn_impl("auto", cfg, jnp.float16, "gpu") == "xla"  # by rule
    assert resolve_dense_attn_impl("auto", _cfg(head_dim=12), f32, "gpu") == "xla"


@pytest.mark.parametrize(
    "attn_impl, cfg_change, dtype, backend, match",
    [
        ("flash", {}, jnp.float32, "cpu", r"attn_impl='flash' is not available .*'xla'"),
        ("cpu_kernel", {}, jnp.float32, "cpu", r"'cpu_kernel' is not available"),
        ("pallas", {}, jnp.float32, "cpu", r"'pallas' needs a TPU or GPU"),
        ("pallas_gpu", {}, jnp.float32, "cpu", r"'pallas_gpu' cannot run on jax backend 'cpu'"),
        ("pallas_gpu_interpret", {}, jnp.float16, "cpu", r"does not serve float16 activations"),
        ("pallas", {"head_dim": 12}, jnp.float32, "tpu", r"'pallas'.*head_dim=12"),
    ],
)
def test_unsupported_attn_impl_raises(attn_impl, cfg_change, dtype, backend, match):
    with pytest.raises(ValueError, match=match):
        resolve_dense_attn_impl(attn_impl, _cfg(**cfg_change), dtype, backend)


def test_dense_logits_raises_before_running(checkpoint):
    """The choice is checked when dense_logits is traced: float16 params with a kernel asked by
    name raise, naming the dtype (no silent XLA)."""
    path, _ = checkpoint("mistral")
    cfg, params = load_hf(path, jnp.float16)
    with pytest.raises(ValueError, match="pallas_gpu_interpret.*float16"):
        dense_logits(params, cfg, jnp.zeros((1, 8), jnp.int32), "pallas_gpu_interpret")
    with pytest.raises(ValueError, match="segment_ids has shape"):
        dense_logits(params, cfg, jnp.zeros((1, 8), jnp.int32), "xla", jnp.zeros((1, 7)))


def test_attn_impl_names_are_the_engines():
    """The dense forward's names are the engine's (``attn_dispatch.ATTN_IMPLS``) less its
    native CPU decode kernel, which has no dense counterpart."""
    from jaxinfer.models.attn_dispatch import ATTN_IMPLS

    assert DENSE_ATTN_IMPLS == tuple(a for a in ATTN_IMPLS if a != "cpu_kernel")
