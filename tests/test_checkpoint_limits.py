"""Checkpoints and configs that would break a job are refused with a clear error before anything
of their size is allocated (issue 15, class 4; LLM arguments: tests/test_llm_args.py).

Each case builds a tiny checkpoint (transformers ``save_pretrained`` of a random config, then
edited; a quantized stories260K) and checks the error type, that it names the file and the
tensor/field, and (for absurd sizes) that loading allocated almost nothing (tracemalloc). All are
host-only but the last, which constructs ``LLM`` on a tiny checkpoint and fails before the pool.
Config floats that float32 cannot hold (overflow, underflow to 0 or to a subnormal) are refused.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tracemalloc

import hf_fixtures as H
import numpy as np
import pytest
from conftest import peak_alloc_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file, save_file

from jaxinfer import memory_limits
from jaxinfer.errors import CheckpointError
from jaxinfer.loaders.checks import CheckpointWarning
from jaxinfer.loaders.hf import config_from_hf, load_hf
from jaxinfer.models.checks import check_float
from jaxinfer.models.config import ModelConfig

MiB = 2**20


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A valid tiny Qwen3 (untied head, f32, one file): V=256, D=64, N=4, K=2, H=32, F=128."""
    return H.build_checkpoint("qwen3", str(tmp_path_factory.mktemp("good") / "qwen3"))


@pytest.fixture(scope="module")
def good_config(good):
    """Its config.json in the transformers 4 layout (rope_theta, rope_scaling at the top)."""
    with open(os.path.join(good, "config.json")) as f:
        c = json.load(f)
    c["rope_theta"] = c.pop("rope_parameters")["rope_theta"]
    return c


def _copy(src, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _edit_config(path, edit):
    file = os.path.join(path, "config.json")
    with open(file) as f:
        c = json.load(f)
    c = edit(c) or c
    with open(file, "w") as f:
        json.dump(c, f)  # NaN and Infinity are written as JSON's non-standard literals
    return file


def _edit_tensors(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)
    return file


# ------------------------------------------------------------------ config.json


def test_config_that_is_a_json_list(good, tmp_path):
    path = _copy(good, tmp_path / "ck")
    file = _edit_config(path, lambda c: [c])
    with pytest.raises(CheckpointError, match="is a JSON list; expected an object") as e:
        load_hf(path)
    assert file in str(e.value)


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"[" * 100_000 + b"]" * 100_000, r"cannot be read: RecursionError"),
        (b'{"model_type": "llama\xff"}', r"not valid JSON: 'utf-8' codec can't decode byte 0xff"),
        (b'{"model_type": ', r"not valid JSON: Expecting value"),
    ],
    ids=["deep", "not-utf8", "truncated"],
)
def test_config_file_unreadable(good, tmp_path, raw, match):
    path = _copy(good, tmp_path / "ck")
    file = os.path.join(path, "config.json")
    open(file, "wb").write(raw)
    with pytest.raises(CheckpointError, match=match) as e:
        load_hf(path)
    assert str(e.value).startswith(file)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("hidden_size", 1e9, r"'hidden_size' is 1000000000.0 \(float\); expected an integer"),
        ("hidden_size", "64", r"'hidden_size' is '64' \(str\); expected an integer"),
        ("num_attention_heads", True, r"'num_attention_heads' is True \(bool\)"),
        ("intermediate_size", 128.0, r"'intermediate_size' is 128.0 \(float\)"),
        ("num_hidden_layers", -2, r"'num_hidden_layers' is -2; expected an integer in \[1, "),
        ("vocab_size", 10**12, r"'vocab_size' is 1000000000000; expected an integer in \[1, 2147"),
        ("max_position_embeddings", 0, r"'max_position_embeddings' is 0"),
        ("head_dim", 0, r"'head_dim' is 0"),
        ("num_key_value_heads", 3, r"'num_attention_heads' is 4, not a multiple of num_key_val"),
        ("rms_norm_eps", math.nan, r"'rms_norm_eps' is nan; expected a finite number >= 0"),
        ("rms_norm_eps", -1e-6, r"'rms_norm_eps' is -1e-06; expected a finite number >= 0"),
        ("rope_theta", math.inf, r"'rope_theta' is inf; expected a finite number > 0"),
        ("rope_theta", 0, r"'rope_theta' is 0; expected a finite number > 0"),
        ("tie_word_embeddings", "false", r"'tie_word_embeddings' is 'false' \(str\); expected tr"),
        ("hidden_act", ["silu"], r"'hidden_act' is \['silu'\]; supported: silu"),
        ("attention_bias", "no", r"'attention_bias' is 'no' \(str\); expected true or false"),
        ("rope_scaling", [1, 2], r"'rope_scaling' is a JSON list; expected an object"),
        ("layer_types", "full_attention", r"'layer_types' is a JSON string; expected a list"),
        ("sliding_window", -8, r"'sliding_window' is -8"),
    ],
)
def test_config_field_of_wrong_type_or_range(good_config, field, value, match):
    c = {**good_config, field: value}
    if field == "sliding_window":
        c["use_sliding_window"] = True
    with pytest.raises(CheckpointError, match=match) as e:
        config_from_hf(c, "dir/config.json")
    assert str(e.value).startswith("dir/config.json: ")


@pytest.mark.parametrize(
    "rope, match",
    [
        ({"rope_type": "linear", "factor": math.nan}, r"'rope_scaling.factor' is nan"),
        ({"rope_type": "linear", "factor": -2.0}, r"'rope_scaling.factor' is -2.0"),
        ({"rope_type": "linear"}, r"'rope_scaling' of rope_type 'linear' lacks 'factor'"),
        (
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0},
            r"'rope_scaling.low_freq_factor' is 4.0; expected below high_freq_factor=4.0",
        ),
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192.5,
            },
            r"'rope_scaling.original_max_position_embeddings' is 8192.5",
        ),
    ],
)
def test_rope_scaling_fields(good_config, rope, match):
    with pytest.raises(CheckpointError, match=match):
        config_from_hf({**good_config, "rope_scaling": rope}, "c.json")


def test_gemma3_pattern_zero_and_text_config_type(good_config):
    c = {**good_config, "model_type": "gemma3_text", "sliding_window_pattern": 0}
    c.pop("layer_types", None)
    with pytest.raises(CheckpointError, match=r"'sliding_window_pattern' is 0"):
        config_from_hf(c, "c.json")
    with pytest.raises(CheckpointError, match=r"'text_config' is a JSON list"):
        config_from_hf({"model_type": "gemma3", "text_config": [1]}, "c.json")


@pytest.mark.parametrize(
    "field, value",
    [("num_hidden_layers", 2**30), ("hidden_size", 10**9), ("vocab_size", 2**31 - 1)],
)
def test_absurd_sizes_refused_against_the_files_without_allocating(good, tmp_path, field, value):
    """Sizes within int32 but far beyond what the weight files hold: refused from the files'
    bytes before anything per layer (or any tensor) is built."""
    path = _copy(good, tmp_path / "ck")
    _edit_config(path, lambda c: c.__setitem__(field, value))
    ckpt_bytes = os.path.getsize(os.path.join(path, "model.safetensors"))

    def load_it():
        with pytest.raises(CheckpointError) as e:
            load_hf(path)
        msg = str(e.value)
        assert os.path.join(path, "config.json") in msg and f"{field}={value}" in msg
        assert f"the checkpoint's weight files hold {ckpt_bytes} bytes" in msg

    assert peak_alloc_bytes(load_it) < 16 * MiB


def test_head_dim_times_heads_mismatch_names_the_tensor(good, tmp_path):
    path = _copy(good, tmp_path / "ck")
    _edit_config(path, lambda c: c.__setitem__("head_dim", 16))  # stored q_proj: 4 * 32 rows
    with pytest.raises(CheckpointError) as e:
        load_hf(path)
    msg = str(e.value)
    assert "model.layers.0.self_attn.q_proj.weight" in msg
    assert "[128, 64]" in msg and "expected [64, 64]" in msg


def test_nan_rms_norm_eps_in_the_file(good, tmp_path):
    path = _copy(good, tmp_path / "ck")
    file = _edit_config(path, lambda c: c.__setitem__("rms_norm_eps", math.nan))
    assert "NaN" in open(file).read()  # Python's json writes (and reads) the NaN literal
    with pytest.raises(CheckpointError, match=r"config\.json: field 'rms_norm_eps' is nan"):
        load_hf(path)


# ------------------------------------------------------------------ tensors


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_non_finite_weight_is_named(good, tmp_path, value, dtype):
    path = _copy(good, tmp_path / "ck")
    name = "model.layers.1.mlp.down_proj.weight"

    def edit(t):
        for k in t:
            t[k] = t[k].astype(dtype)
        t[name][5, 7] = value

    file = _edit_tensors(path, edit)
    with pytest.raises(CheckpointError) as e:
        load_hf(path)
    msg = str(e.value)
    assert file in msg and name in msg and "1 non-finite value(s)" in msg and "[5, 7]" in msg


def test_float16_overflow_on_cast_is_named(good, tmp_path):
    import jax.numpy as jnp

    path = _copy(good, tmp_path / "ck")
    name = "model.embed_tokens.weight"
    _edit_tensors(path, lambda t: t[name].__setitem__((3, 4), 1e5))
    load_hf(path, jnp.bfloat16)
    with pytest.raises(CheckpointError, match=rf"{name}' has 1 value\(s\) beyond float16's range"):
        load_hf(path, jnp.float16)


def test_unexpected_o_proj_bias_in_qwen2(tmp_path):
    """Qwen2 has q/k/v biases but no o_proj bias: a stored one is an error, not ignored."""
    import torch
    from safetensors.torch import load_file as tload
    from safetensors.torch import save_file as tsave

    path = H.build_checkpoint("qwen2", str(tmp_path / "qwen2"))
    load_hf(path)
    file = os.path.join(path, "model.safetensors")
    t = tload(file)
    name = "model.layers.0.self_attn.o_proj.bias"
    t[name] = torch.zeros(64, dtype=torch.bfloat16)
    tsave(t, file)
    with pytest.raises(CheckpointError) as e:
        load_hf(path)
    msg = str(e.value)
    assert file in msg and repr(name) in msg and "1 unexpected tensor(s)" in msg


def test_allowlisted_tensors_warn_and_load(good, tmp_path):
    path = _copy(good, tmp_path / "ck")
    inv = "model.layers.0.self_attn.rotary_emb.inv_freq"
    _edit_tensors(path, lambda t: t.__setitem__(inv, np.ones(16, np.float32)))
    with pytest.warns(CheckpointWarning, match=r"1 tensor\(s\) not loaded .*rotary_emb.inv_freq"):
        load_hf(path)
    _edit_tensors(path, lambda t: t.pop(inv))
    _edit_config(path, lambda c: c.__setitem__("tie_word_embeddings", True))
    with pytest.warns(CheckpointWarning, match=r"lm_head\.weight.*ties the head"):
        cfg, params = load_hf(path)
    assert cfg.tie_word_embeddings and params.lm_head is None


def test_untied_config_without_a_head(good, tmp_path):
    path = _copy(good, tmp_path / "ck")
    file = _edit_tensors(path, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError) as e:
        load_hf(path)
    msg = str(e.value)
    assert file in msg and "'lm_head.weight' is missing" in msg
    assert "tie_word_embeddings" in msg and "is false" in msg
    _edit_config(path, lambda c: c.pop("tie_word_embeddings"))  # absent: Qwen3's default, false
    with pytest.raises(CheckpointError, match=r"is absent \(false by default for model_type 'qw"):
        load_hf(path)


def test_weights_beyond_free_memory_are_refused(good, monkeypatch):
    load_hf(good)
    monkeypatch.setattr(memory_limits, "available_host_bytes", lambda: 100_000)
    with pytest.raises(CheckpointError) as e:
        load_hf(good)
    msg = str(e.value)
    assert "model.safetensors" in msg and "the weights in float32 do not fit in memory" in msg
    assert "host memory available: 100000 bytes" in msg


# ------------------------------------------------------------------ safetensors files


def _rewrite_header(file, edit):
    data = open(file, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


@pytest.mark.parametrize(
    "lie",
    [
        lambda h: h["model.norm.weight"].__setitem__("shape", [10**9, 64]),  # shape vs offsets
        lambda h: h["model.norm.weight"].__setitem__("dtype", "F16"),  # dtype vs offsets
        lambda h: h["model.norm.weight"].__setitem__("data_offsets", [0, 2**40]),  # past the end
    ],
    ids=["shape", "dtype", "offsets"],
)
def test_safetensors_header_that_lies(good, tmp_path, lie):
    path = _copy(good, tmp_path / "ck")
    file = os.path.join(path, "model.safetensors")
    _rewrite_header(file, lie)

    def load_it():
        with pytest.raises(CheckpointError) as e:
            load_hf(path)
        assert file in str(e.value) and "not a readable safetensors file" in str(e.value)

    assert peak_alloc_bytes(load_it) < 16 * MiB


def test_safetensors_header_length_that_lies(good, tmp_path):
    path = _copy(good, tmp_path / "ck")
    file = os.path.join(path, "model.safetensors")
    data = open(file, "rb").read()
    open(file, "wb").write(struct.pack("<Q", 2**62) + data[8:])
    assert peak_alloc_bytes(lambda: pytest.raises(CheckpointError, load_hf, path)) < 16 * MiB


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return H.build_checkpoint("llama2", str(tmp_path_factory.mktemp("sh") / "llama2"))


def _edit_index(path, edit):
    file = os.path.join(path, "model.safetensors.index.json")
    with open(file) as f:
        idx = json.load(f)
    edit(idx["weight_map"])
    with open(file, "w") as f:
        json.dump(idx, f)
    return file


def test_index_naming_a_file_that_does_not_exist(sharded, tmp_path):
    path = _copy(sharded, tmp_path / "ck")
    name = "model.layers.1.mlp.up_proj.weight"
    _edit_index(path, lambda wm: wm.__setitem__(name, "model-00099-of-00099.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_hf(path)
    msg = str(e.value)
    assert "model-00099-of-00099.safetensors: shard file is missing" in msg and name in msg


def test_index_naming_the_wrong_shard(sharded, tmp_path):
    path = _copy(sharded, tmp_path / "ck")
    name = "model.layers.1.mlp.up_proj.weight"
    wm = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    other = next(v for v in wm.values() if v != wm[name])
    index = _edit_index(path, lambda wm: wm.__setitem__(name, other))
    with pytest.raises(CheckpointError) as e:
        load_hf(path)
    msg = str(e.value)
    assert index in msg and repr(name) in msg and f"listed in {other}, which does not hold" in msg


def test_index_naming_a_file_outside_the_directory(sharded, tmp_path):
    path = _copy(sharded, tmp_path / "ck")
    index = _edit_index(path, lambda wm: wm.__setitem__("model.norm.weight", "../x.safetensors"))
    with pytest.raises(CheckpointError, match=r"shard files must lie in the checkpoint dir") as e:
        load_hf(path)
    assert index in str(e.value)


def test_index_nested_too_deep(sharded, tmp_path):
    path = _copy(sharded, tmp_path / "ck")
    index = os.path.join(path, "model.safetensors.index.json")
    open(index, "wb").write(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(CheckpointError, match=r"unreadable index.*RecursionError") as e:
        load_hf(path)
    assert str(e.value).startswith(index)


def test_index_weight_map_of_wrong_type(sharded, tmp_path):
    path = _copy(sharded, tmp_path / "ck")
    _edit_index(path, lambda wm: wm.__setitem__("model.norm.weight", 3))
    with pytest.raises(CheckpointError, match=r"'weight_map' must map tensor names to shard"):
        load_hf(path)


# ------------------------------------------------------------------ property test


_JSON_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.lists(st.integers(0, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_FIELDS = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
    "hidden_act",
    "rope_scaling",
    "rope_parameters",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
    "layer_types",
    "attention_bias",
    "model_type",
    "query_pre_attn_scalar",
    "final_logit_softcapping",
    "sliding_window_pattern",
    "text_config",
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family=st.sampled_from(["llama", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3"]),
    edits=st.dictionaries(st.sampled_from(_FIELDS), _JSON_VALUES, min_size=1, max_size=3),
)
def test_config_fuzz_gives_a_config_or_a_checkpoint_error(good_config, family, edits):
    """Any config.json edit yields a valid ModelConfig or a CheckpointError naming the file,
    never another exception and never a large allocation (the weight files hold 1 MB)."""
    c = {**good_config, "model_type": family, "num_key_value_heads": 2, "head_dim": 16, **edits}
    tracemalloc.start()
    try:
        cfg = config_from_hf(c, "f/config.json", checkpoint_bytes=10**6)
    except CheckpointError as e:
        assert str(e).startswith("f/config.json: ")
        return
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 16 * MiB
    assert isinstance(cfg, ModelConfig) and len(cfg.layer_windows) == cfg.num_layers
    assert all(math.isfinite(x) for x in (cfg.rms_norm_eps, cfg.rope_theta))


# ------------------------------------------------------------------ quantized checkpoints


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, stories_dir):
    from jaxinfer.loaders import load
    from jaxinfer.quant.checkpoint import save_quantized
    from jaxinfer.quant.tensor import quantize

    m = load(stories_dir)
    out = tmp_path_factory.mktemp("q") / "q"
    save_quantized(out, m.config, quantize(m.params, "int8"), stories_dir)
    return out


def _edit_meta(path, edit):
    file = path / "jaxinfer_quant.json"
    meta = json.loads(file.read_text())
    edit(meta)
    file.write_text(json.dumps(meta))
    return file


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda m: m["config"].__setitem__("vocab_size", 10**9),
            r"array 'embed' has shape \[512, 64\], the config implies \[1000000000, 64\]",
        ),
        (
            lambda m: m["config"].__setitem__("num_layers", 2**30),
            r"bad config: layer_windows has 5 entries, expected num_layers=1073741824",
        ),
        (lambda m: m["config"].pop("layer_windows"), r"bad config: layer_windows must be a list"),
        (lambda m: m["config"].__setitem__("rms_norm_eps", math.inf), r"rms_norm_eps=inf must be"),
        (
            lambda m: m["arrays"].__setitem__(
                "layers.o_bias", {"shape": [5, 64], "dtype": "float32"}
            ),
            r"array 'layers.o_bias' is not used by the model",
        ),
        (lambda m: m["arrays"].pop("final_norm"), r"array 'final_norm' is missing"),
        (lambda m: m.__setitem__("config", [1]), r"bad config: expected a JSON object"),
    ],
    ids=["vocab", "layers", "windows", "eps", "extra", "missing", "list"],
)
def test_quantized_metadata_checked_before_restoring(quantized, tmp_path, edit, match):
    from jaxinfer.quant.checkpoint import load_quantized

    path = tmp_path / "q"
    shutil.copytree(quantized, path)
    file = _edit_meta(path, edit)

    def load_it():
        with pytest.raises(CheckpointError, match=match) as e:
            load_quantized(path)
        assert str(file) in str(e.value)

    assert peak_alloc_bytes(load_it) < 16 * MiB


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"[1, 2]", r"expected a JSON object, found list"),
        (b"[" * 100_000 + b"]" * 100_000, r"cannot read quantized-checkpoint metadata: Recursion"),
        (b'{"format": "\xff"}', r"cannot read quantized-checkpoint metadata: UnicodeDecodeError"),
    ],
    ids=["list", "deep", "not-utf8"],
)
def test_quantized_metadata_unreadable(quantized, tmp_path, raw, match):
    from jaxinfer.quant.checkpoint import load_quantized

    path = tmp_path / "q"
    shutil.copytree(quantized, path)
    (path / "jaxinfer_quant.json").write_bytes(raw)
    with pytest.raises(CheckpointError, match=match):
        load_quantized(path)


def test_quantized_zarray_shape_that_lies(quantized, tmp_path):
    from jaxinfer.quant.checkpoint import load_quantized

    path = tmp_path / "q"
    shutil.copytree(quantized, path)
    za = path / "params" / "embed" / ".zarray"
    z = json.loads(za.read_text())
    z["shape"] = [10**9, 64]
    za.write_text(json.dumps(z))
    with pytest.raises(CheckpointError, match=r"shape \[1000000000, 64\], metadata says \[512, 64"):
        load_quantized(path)


def test_quantized_non_finite_array(stories_dir, tmp_path):
    import dataclasses

    from jaxinfer.loaders import load
    from jaxinfer.quant.checkpoint import load_quantized, save_quantized
    from jaxinfer.quant.tensor import quantize

    m = load(stories_dir)
    bad = dataclasses.replace(m.params, final_norm=m.params.final_norm.at[3].set(np.nan))
    save_quantized(tmp_path / "q", m.config, quantize(bad, "int8"))
    with pytest.raises(CheckpointError, match=r"array 'final_norm' holds 1 non-finite"):
        load_quantized(tmp_path / "q")


# ------------------------------------------------------------------ KV pool sizing


def test_huge_context_with_default_pool_sizing(good, tmp_path):
    """max_position_embeddings = 2**31 - 1: the default pool (capped at kv_cache_memory_gb) is
    too small for one sequence, said plainly; a budget beyond memory is refused in bytes."""
    from jaxinfer.llm import LLM

    path = _copy(good, tmp_path / "ck")
    _edit_config(path, lambda c: c.__setitem__("max_position_embeddings", 2**31 - 1))
    with pytest.raises(ValueError, match=r"KV pool too small: .*needs 268435457 pages"):
        LLM(path, skip_tokenizer_init=True, compilation_cache=False)
    with pytest.raises(ValueError, match=r"the KV pool does not fit in memory: .*bytes"):
        LLM(path, skip_tokenizer_init=True, kv_cache_memory_gb=1e6, compilation_cache=False)


@pytest.mark.parametrize("value", [1e39, 1e300, 1e-300, 1e-39])
def test_config_floats_outside_float32_are_refused(value):
    with np.errstate(over="ignore"):
        f32 = np.float64(value).astype(np.float32)
    assert f32 == 0 or np.isinf(f32) or abs(f32) < np.finfo(np.float32).tiny  # the premise
    with pytest.raises(ValueError, match="float32"):
        check_float("rms_norm_eps", value, allow_zero=True)
    assert check_float("rms_norm_eps", 1e-6, allow_zero=True) == 1e-6
