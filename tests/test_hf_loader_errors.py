"""Bad HF checkpoints raise CheckpointError naming the file, tensor/field and expectation."""

from __future__ import annotations

import json
import os
import shutil

import hf_fixtures as H
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxinfer.errors import CheckpointError
from jaxinfer.loaders.hf import config_from_hf, load_hf


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A valid tiny Llama checkpoint (single file)."""
    return H.build_checkpoint("qwen3", str(tmp_path_factory.mktemp("good") / "qwen3"))


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _rewrite(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)
    return file


def test_good_checkpoint_loads(good):
    cfg, params = load_hf(good)
    assert params.layers.wq.shape == (cfg.num_layers, 64, 4, 32)


def test_missing_tensor(good, tmp_path):
    path = _copy(good, tmp_path / "ck")
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError) as e:
        load_hf(path)
    msg = str(e.value)
    assert "model.safetensors" in msg and "model.layers.1.mlp.up_proj.weight" in msg
    assert "missing" in msg and "[128, 64]" in msg  # expected HF shape [F, D]


def test_shape_mismatch(good, tmp_path):
    path = _copy(good, tmp_path / "ck")
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite(path, lambda t: t.__setitem__(name, np.zeros((48, 64), np.float32)))
    with pytest.raises(CheckpointError) as e:
        load_hf(path)
    msg = str(e.value)
    assert "model.safetensors" in msg and name in msg
    assert "[48, 64]" in msg and "expected [64, 64]" in msg  # found vs K*H=2*32 rows


def test_unsupported_dtype(good, tmp_path):
    path = _copy(good, tmp_path / "ck")
    name = "model.norm.weight"
    _rewrite(path, lambda t: t.__setitem__(name, np.zeros((64,), np.int32)))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*I32.*F32, F16, BF16"):
        load_hf(path)


def test_unknown_model_type(good, tmp_path):
    path = _copy(good, tmp_path / "ck")
    cfg_file = os.path.join(path, "config.json")
    with open(cfg_file) as f:
        c = json.load(f)
    c["model_type"] = "falcon"
    with open(cfg_file, "w") as f:
        json.dump(c, f)
    with pytest.raises(CheckpointError) as e:
        load_hf(path)
    msg = str(e.value)
    assert cfg_file in msg and "model_type" in msg and "'falcon'" in msg
    for t in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"):
        assert t in msg


@pytest.mark.parametrize("keep", [0.5, 0.999, 20])
def test_truncated_safetensors(good, tmp_path, keep):
    """Truncated in the data (most of it, or the last bytes) or inside the header."""
    path = _copy(good, tmp_path / "ck")
    file = os.path.join(path, "model.safetensors")
    size = os.path.getsize(file)
    with open(file, "r+b") as f:
        f.truncate(int(size * keep) if keep < 1 else keep)
    with pytest.raises(CheckpointError) as e:
        load_hf(path)
    msg = str(e.value)
    assert file in msg and ("truncated" in msg or "corrupt" in msg)


def test_missing_config(good, tmp_path):
    path = _copy(good, tmp_path / "ck")
    os.remove(os.path.join(path, "config.json"))
    with pytest.raises(CheckpointError, match=r"config\.json.*missing"):
        load_hf(path)


def test_missing_weights_file(good, tmp_path):
    path = _copy(good, tmp_path / "ck")
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"no model\.safetensors or model\.safetensors\.index"
    ):
        load_hf(path)


def test_missing_shard(tmp_path):
    path = H.build_checkpoint("llama2", str(tmp_path / "ck"))  # sharded
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        wm = json.load(f)["weight_map"]
    shard = wm["model.layers.1.self_attn.o_proj.weight"]
    os.remove(os.path.join(path, shard))
    with pytest.raises(CheckpointError) as e:
        load_hf(path)
    assert shard in str(e.value) and "missing" in str(e.value)


def test_missing_config_field():
    with pytest.raises(CheckpointError, match=r"x/config\.json.*'hidden_size'.*missing"):
        config_from_hf({"model_type": "llama", "vocab_size": 8}, "x/config.json")


def test_unsupported_rope_type():
    c = {
        "model_type": "llama",
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_scaling": {"rope_type": "longrope", "factor": 4.0},
    }
    with pytest.raises(
        CheckpointError, match=r"c\.json.*'rope_scaling\.rope_type'.*'longrope'.*llama3.*yarn"
    ):
        config_from_hf(c, "c.json")


def test_unsupported_layer_type():
    c = {
        "model_type": "gemma2",
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,  # Gemma 2's default (4) does not divide 2 heads
        "head_dim": 4,
        "layer_types": ["full_attention", "chunked_attention"],
    }
    with pytest.raises(CheckpointError, match=r"layer_types\[1\].*'chunked_attention'"):
        config_from_hf(c, "c.json")


def test_legacy_configs_map():
    """transformers 4 configs as found on the Hub (fields abridged) map to the right fields."""
    llama31 = {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    }
    cfg = config_from_hf(llama31)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.rope_theta) == (128, 8, 500000.0)
    assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_scaling.factor == 8.0
    gemma2 = {
        "model_type": "gemma2",
        "vocab_size": 256000,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 4096,
        "query_pre_attn_scalar": 256,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    cfg = config_from_hf(gemma2)
    assert cfg.layer_windows == (4096, 0, 4096, 0)  # even layers slide
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (50.0, 30.0)  # class defaults
    assert cfg.tie_word_embeddings and cfg.embed_scale and cfg.norm_weight_offset == 1.0
    gemma3 = {
        "model_type": "gemma3",
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "num_hidden_layers": 12,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "vocab_size": 262208,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
    }
    cfg = config_from_hf(gemma3)
    assert cfg.layer_windows == (1024,) * 5 + (0,) + (1024,) * 5 + (0,)  # pattern 6
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.head_dim) == (1e6, 1e4, 256)
    assert cfg.rope_scaling.factor == 8.0 and cfg.qk_norm and cfg.post_norms
    qwen2 = {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "max_window_layers": 21,
        "tie_word_embeddings": True,
        "rope_theta": 1e6,
    }
    cfg = config_from_hf(qwen2)
    assert cfg.layer_windows == (0,) * 24 and cfg.head_dim == 64 and cfg.attention_bias
    mistral = {
        "model_type": "mistral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "sliding_window": None,
    }
    assert config_from_hf(mistral).layer_windows == (0, 0)
