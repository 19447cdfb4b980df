"""Damaged or unsupported mixture-of-experts checkpoints are refused with an error naming the file
and the tensor or config field, found from the config and the safetensors headers before any
tensor is read (``_read`` is made to fail if called); and the engine modes MoE does not support
yet are refused at construction.
"""

from __future__ import annotations

import json
import os
import shutil

import moe_fixtures as M
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxinfer.loaders.hf as hf
from jaxinfer.errors import CheckpointError
from jaxinfer.loaders.hf import config_from_hf, load_hf


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return M.build_checkpoint("mixtral", str(tmp_path_factory.mktemp("moe_err") / "mixtral"))


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    return M.build_checkpoint("qwen2_moe", str(tmp_path_factory.mktemp("moe_err") / "qwen2_moe"))


def _edited(src: str, dst, edit_tensors=None, edit_config=None) -> str:
    dst = str(dst)
    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    if edit_tensors is not None:
        t = load_file(file)
        edit_tensors(t)
        save_file(t, file)
    if edit_config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            c = json.load(f)
        edit_config(c)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(c, f)
    return dst


@pytest.fixture
def no_reads(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("a tensor was read before the checkpoint was checked")

    monkeypatch.setattr(hf, "_read", fail)


MIX = "model.layers.1.block_sparse_moe."


def _drop(name):
    return lambda t: t.pop(name)


def _grow_router(t):
    t[MIX + "gate.weight"] = np.zeros((5, 64), np.float32)


def _fifth_expert(t):
    for w in ("w1", "w2", "w3"):
        t[MIX + f"experts.4.{w}.weight"] = t[MIX + f"experts.0.{w}.weight"]


@pytest.mark.parametrize(
    "edit, match",
    [
        (_drop(MIX + "experts.3.w2.weight"), f"tensor '{MIX}experts.3.w2.weight' is missing"),
        (_drop(MIX + "gate.weight"), f"tensor '{MIX}gate.weight' is missing"),
        (_grow_router, f"tensor '{MIX}gate.weight' .* has shape \\[5, 64\\], expected \\[4, 64\\]"),
        (_fifth_expert, f"tensor '{MIX}experts.4.w1.weight' is not used"),
    ],
    ids=["missing_expert", "missing_router", "router_shape", "extra_expert"],
)
def test_bad_expert_tensors(mixtral, tmp_path, no_reads, edit, match):
    path = _edited(mixtral, tmp_path / "bad", edit_tensors=edit)
    with pytest.raises(CheckpointError, match=match) as e:
        load_hf(path)
    assert os.path.join(path, "model.safetensors") in str(e.value)


def test_wrong_expert_count_in_config(mixtral, tmp_path, no_reads):
    """The config says 5 experts, the files hold 4: the router's shape gives it away; with the
    router grown too, the first absent expert is named."""
    path = _edited(mixtral, tmp_path / "bad", edit_config=lambda c: c.update(num_local_experts=5))
    router = "model.layers.0.block_sparse_moe.gate.weight"
    with pytest.raises(
        CheckpointError, match=f"'{router}' .* has shape \\[4, 64\\], expected \\[5"
    ):
        load_hf(path)

    def grow(t):
        for i in range(2):
            t[f"model.layers.{i}.block_sparse_moe.gate.weight"] = np.zeros((5, 64), np.float32)

    path = _edited(path, tmp_path / "bad2", edit_tensors=grow)
    with pytest.raises(
        CheckpointError, match="layers.0.block_sparse_moe.experts.4.w1.weight' is mis"
    ):
        load_hf(path)


def test_expert_count_beyond_the_files(mixtral, tmp_path, no_reads):
    """An expert count the weight files cannot hold is refused from the config alone."""
    path = _edited(
        mixtral, tmp_path / "bad", edit_config=lambda c: c.update(num_local_experts=4000)
    )
    with pytest.raises(
        CheckpointError, match="config.json: the config's sizes \\(num_local_experts=4000"
    ):
        load_hf(path)


def test_fused_expert_shape(mixtral, tmp_path, no_reads):
    path = M.fused_copy(mixtral, str(tmp_path / "fused"))
    file = os.path.join(path, "model.safetensors")
    t = load_file(file)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    t[name] = t[name][:3]
    save_file(t, file)
    with pytest.raises(
        CheckpointError, match=f"{file}: tensor '{name}' .* expected \\[4, 64, 64\\]"
    ):
        load_hf(path)


def test_shared_expert_missing(qwen2_moe, tmp_path, no_reads):
    name = "model.layers.2.mlp.shared_expert_gate.weight"
    path = _edited(qwen2_moe, tmp_path / "bad", edit_tensors=_drop(name))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is missing"):
        load_hf(path)


def test_dense_layer_needs_its_mlp(qwen2_moe, tmp_path, no_reads):
    """Layer 1 is dense (mlp_only_layers): its dense MLP must be stored."""
    name = "model.layers.1.mlp.gate_proj.weight"
    path = _edited(qwen2_moe, tmp_path / "bad", edit_tensors=_drop(name))
    with pytest.raises(CheckpointError, match=f"tensor '{name}' is missing"):
        load_hf(path)


def _config(path) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


@pytest.mark.parametrize(
    "family, change, match",
    [
        ("olmoe", dict(clip_qkv=8.0), "field 'clip_qkv' is 8.0; q/k/v clipping is not supported"),
        ("qwen3_moe", dict(use_sliding_window=True), "field 'use_sliding_window' is true"),
        ("qwen2_moe", dict(num_experts_per_tok=9), "field 'num_experts_per_tok' is 9, more than"),
        ("qwen2_moe", dict(num_experts=0), "field 'num_experts' is 0"),
        ("qwen3_moe", dict(mlp_only_layers=[3]), "field 'mlp_only_layers' names layer 3"),
        ("qwen3_moe", dict(decoder_sparse_step="2"), "field 'decoder_sparse_step' is '2'"),
        ("mixtral", dict(num_local_experts=True), "field 'num_local_experts' is True"),
        ("olmoe", dict(attention_bias=True), "field 'attention_bias' is true"),
    ],
)
def test_config_fields_refused(family, change, match):
    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    with pytest.raises(CheckpointError, match=match) as e:
        config_from_hf({"model_type": family, **base, **change}, "ckpt/config.json")
    assert "ckpt/config.json" in str(e.value)


def test_unknown_model_type_lists_moe_families():
    with pytest.raises(CheckpointError, match="supported: llama, .*mixtral, qwen2_moe"):
        config_from_hf({"model_type": "deepseek_v3"}, "c.json")


@pytest.mark.parametrize(
    "option, match",
    [
        (dict(enable_expert_parallel=True), "tensor_parallel_size=1: give tensor_parallel_size"),
    ],
)
def test_engine_refuses_unsupported_modes(mixtral, option, match):
    from jaxinfer.llm import LLM

    with pytest.raises(ValueError, match=match):
        LLM(mixtral, skip_tokenizer_init=True, compilation_cache=False, **option)


def test_batch_invariant_moe_runs_on_cpu_only(mixtral):
    """Refused off CPU; on CPU a request's output logprobs are bitwise the same alone and
    among others (test_batch_invariant checks the logits of every position)."""
    from jaxinfer.llm import LLM
    from jaxinfer.sampling.sampler import SamplingParams

    cfg, _ = load_hf(mixtral)
    kw = dict(max_model_len=32, kv_pages=8, page_size=8, batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant=True for mixture-of-experts .* CPU only"):
        _resolve_on(cfg, "gpu", kw)
    llm = LLM(mixtral, skip_tokenizer_init=True, compilation_cache=False, **kw)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    alone = llm.generate([[5, 6, 7, 9, 40]], sp)[0]
    among = llm.generate([[81, 3, 200], [5, 6, 7, 9, 40], list(range(10, 31))], sp)[1]
    assert among.token_ids == alone.token_ids
    assert [e.logprob for e in among.logprobs] == [e.logprob for e in alone.logprobs]  # bitwise


def _resolve_on(cfg, backend, kw):
    from jaxinfer.args import EngineArgs
    from jaxinfer.engine.config import resolve

    return resolve(EngineArgs("m", **kw), cfg, "float32", backend=backend)
