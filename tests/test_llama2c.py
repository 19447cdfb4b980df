"""llama2.c checkpoint loading: synthetic v0/v1/v2 files round trip, the RoPE permutation is
checked against a numpy reimplementation of run.c's forward, real checkpoints load, damaged
files raise errors that name the file, the tensor and the sizes; ``jaxinfer.load`` detection."""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import peak_alloc_bytes

import jaxinfer
from jaxinfer.errors import CheckpointError
from jaxinfer.loaders import LoadedModel, detect_format, load
from jaxinfer.loaders.llama2c import load_llama2c
from jaxinfer.models.dense import dense_logits

SHARED = Path(
    os.environ.get("JAXINFER_SHARED", Path(__file__).resolve().parents[1].parent / "shared")
)
MODELS = SHARED / "models"
needs_shared = pytest.mark.skipif(
    not MODELS.is_dir(), reason=f"shared models directory {MODELS} is absent"
)

MAGIC = 0x616B3432
# llama2.c per-layer tensors, in legacy (v0) file order; w1 = gate, w2 = down, w3 = up.
LAYER_NAMES = ("rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w2", "w3")
MATS = ("token_embedding", "wq", "wk", "wv", "wo", "w1", "w2", "w3")


# ------------------------------------------------------------------ a small export.py in numpy


def random_weights(dim, hidden, layers, heads, kv_heads, vocab, seed, shared=True):
    """Random float32 weights in llama2.c's layout (PyTorch out x in), stacked over layers."""
    rng = np.random.default_rng(seed)
    hs = dim // heads
    kv_dim = kv_heads * hs

    def mat(*shape, scale=0.3):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    w = {
        "token_embedding": mat(vocab, dim, scale=1.0),
        "rms_att": (1 + 0.2 * rng.standard_normal((layers, dim))).astype(np.float32),
        "wq": mat(layers, dim, dim),
        "wk": mat(layers, kv_dim, dim),
        "wv": mat(layers, kv_dim, dim),
        "wo": mat(layers, dim, dim),
        "rms_ffn": (1 + 0.2 * rng.standard_normal((layers, dim))).astype(np.float32),
        "w1": mat(layers, hidden, dim),
        "w2": mat(layers, dim, hidden),
        "w3": mat(layers, hidden, dim),
        "rms_final": (1 + 0.2 * rng.standard_normal(dim)).astype(np.float32),
    }
    w["wcls"] = w["token_embedding"] if shared else mat(vocab, dim)
    return w


def quantize_q80(x, group_size):
    """Q8_0 as export.py's quantize_q80: symmetric int8 per group, scale = max|x| / 127."""
    g = x.astype(np.float32).reshape(-1, group_size)
    scale = (np.abs(g).max(axis=1) / 127.0).astype(np.float32)
    q = np.round(g / scale[:, None]).astype(np.int8)
    return q, scale


def write_checkpoint(path, w, version, seq_len, heads, kv_heads, shared=True, group_size=16):
    """Writes ``w`` as export.py's legacy_export / version1_export / version2_export would.

    Returns the weights as run.c sees them (dequantized for version 2).
    """
    layers, _, dim = w["wq"].shape
    hidden, vocab = w["w1"].shape[1], w["token_embedding"].shape[0]
    ints = [dim, hidden, layers, heads, kv_heads, vocab, seq_len]
    seen = dict(w)
    mats = [*MATS] + ([] if shared else ["wcls"])
    with open(path, "wb") as f:
        if version == 0:
            ints[5] = vocab if shared else -vocab
            f.write(struct.pack("<7i", *ints))
            for name in ("token_embedding", *LAYER_NAMES, "rms_final"):
                f.write(w[name].astype("<f4").tobytes())
            hs = dim // heads
            pos = np.arange(seq_len)[:, None] * (10000.0 ** (-np.arange(0, hs, 2) / hs))[None]
            f.write(np.cos(pos).astype("<f4").tobytes())
            f.write(np.sin(pos).astype("<f4").tobytes())
            if not shared:
                f.write(w["wcls"].astype("<f4").tobytes())
            return seen
        f.write(struct.pack("<Ii", MAGIC, version))
        f.write(struct.pack("<7i", *ints))
        f.write(struct.pack("<B", int(shared)))
        if version == 2:
            f.write(struct.pack("<i", group_size))
        f.write(b"\0" * (256 - f.tell()))
        for name in ("rms_att", "rms_ffn", "rms_final"):
            f.write(w[name].astype("<f4").tobytes())
        if version == 1:
            for name in mats:
                f.write(w[name].astype("<f4").tobytes())
            return seen
        scales = []
        for name in mats:
            q, s = quantize_q80(w[name], group_size)
            f.write(q.tobytes())
            scales.append(s)
            seen[name] = (q.astype(np.float32) * s[:, None]).reshape(w[name].shape)
        if shared:
            seen["wcls"] = seen["token_embedding"]
        for s in scales:
            f.write(s.astype("<f4").tobytes())
    return seen


def read_legacy(path):
    """Independent reader of a legacy (v0) checkpoint: (header ints, weights in run.c layout)."""
    data = Path(path).read_bytes()
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = struct.unpack("<7i", data[:28])
    shared, vocab = vocab > 0, abs(vocab)
    kv_dim = dim // heads * kv_heads
    hs = dim // heads
    shapes = [
        ("token_embedding", (vocab, dim)),
        ("rms_att", (layers, dim)),
        ("wq", (layers, dim, dim)),
        ("wk", (layers, kv_dim, dim)),
        ("wv", (layers, kv_dim, dim)),
        ("wo", (layers, dim, dim)),
        ("rms_ffn", (layers, dim)),
        ("w1", (layers, hidden, dim)),
        ("w2", (layers, dim, hidden)),
        ("w3", (layers, hidden, dim)),
        ("rms_final", (dim,)),
        ("freq_real", (seq_len, hs // 2)),
        ("freq_imag", (seq_len, hs // 2)),
    ]
    if not shared:
        shapes.append(("wcls", (vocab, dim)))
    flat = np.frombuffer(data, "<f4", offset=28)
    w, off = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        w[name] = flat[off : off + n].reshape(shape).astype(np.float32)
        off += n
    assert off == flat.size
    if shared:
        w["wcls"] = w["token_embedding"]
    return (heads, kv_heads), w


# ------------------------------------------------------------------ run.c's forward in numpy


def runc_logits(w, heads, kv_heads, tokens):
    """Logits f64[T, V] of run.c's ``forward`` over ``tokens`` at positions 0..T-1.

    A line-by-line numpy port of llama2.c run.c (RMSNorm eps 1e-5, RoPE on interleaved pairs
    (x[2i], x[2i+1]) with freq 10000^(-(i % head_size) / head_size), GQA head h reads KV head
    h // (n_heads / n_kv_heads), SwiGLU), in float64 so it is the exact reference.
    """
    w = {k: v.astype(np.float64) for k, v in w.items()}
    layers, dim = w["rms_att"].shape
    hs = dim // heads
    kv_dim = kv_heads * hs
    kv_mul = heads // kv_heads

    def rmsnorm(x, g):
        return g * (x / np.sqrt(np.mean(x * x) + 1e-5))

    def rope(vec, pos):
        i = np.arange(0, vec.size, 2)
        freq = 1.0 / 10000.0 ** ((i % hs) / hs)
        c, s = np.cos(pos * freq), np.sin(pos * freq)
        v0, v1 = vec[0::2].copy(), vec[1::2].copy()
        out = np.empty_like(vec)
        out[0::2], out[1::2] = v0 * c - v1 * s, v0 * s + v1 * c
        return out

    key_cache = np.zeros((layers, len(tokens), kv_dim))
    value_cache = np.zeros((layers, len(tokens), kv_dim))
    logits = []
    for pos, tok in enumerate(tokens):
        x = w["token_embedding"][tok].copy()
        for l in range(layers):
            xb = rmsnorm(x, w["rms_att"][l])
            q = rope(w["wq"][l] @ xb, pos)
            key_cache[l, pos] = rope(w["wk"][l] @ xb, pos)
            value_cache[l, pos] = w["wv"][l] @ xb
            out = np.empty(dim)
            for h in range(heads):
                kh = (h // kv_mul) * hs
                k = key_cache[l, : pos + 1, kh : kh + hs]
                v = value_cache[l, : pos + 1, kh : kh + hs]
                att = k @ q[h * hs : (h + 1) * hs] / np.sqrt(hs)
                att = np.exp(att - att.max())
                out[h * hs : (h + 1) * hs] = (att / att.sum()) @ v
            x = x + w["wo"][l] @ out
            xb = rmsnorm(x, w["rms_ffn"][l])
            hb = w["w1"][l] @ xb
            hb = hb / (1.0 + np.exp(-hb)) * (w["w3"][l] @ xb)
            x = x + w["w2"][l] @ hb
        logits.append(w["wcls"] @ rmsnorm(x, w["rms_final"]))
    return np.stack(logits)


def assert_logits_match(params, cfg, w, heads, kv_heads, tokens):
    want = runc_logits(w, heads, kv_heads, tokens)
    got = np.asarray(dense_logits(params, cfg, jnp.asarray([tokens], jnp.int32))[0])
    # float32 tolerance, relative to the logits' scale.
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# ------------------------------------------------------------------ synthetic checkpoints

# dim 32, 4 query heads, 2 KV heads (GQA), head size 8.
SMALL = dict(dim=32, hidden=48, layers=2, heads=4, kv_heads=2, vocab=64)
SEQ_LEN = 24


def _write_small(tmp_path, version, shared, name="model.bin", seed=0, group_size=16):
    w = random_weights(**SMALL, seed=seed, shared=shared)
    path = tmp_path / name
    seen = write_checkpoint(
        path,
        w,
        version,
        SEQ_LEN,
        SMALL["heads"],
        SMALL["kv_heads"],
        shared=shared,
        group_size=group_size,
    )
    return path, w, seen


@pytest.mark.parametrize("shared", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("version", [0, 1, 2])
def test_synthetic_roundtrip(tmp_path, version, shared):
    path, w, seen = _write_small(tmp_path, version, shared)
    cfg, params = load_llama2c(path)
    d, n, k = SMALL["dim"], SMALL["heads"], SMALL["kv_heads"]
    h = d // n
    assert (cfg.model_type, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        "llama2c",
        d,
        SMALL["hidden"],
        SMALL["layers"],
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (n, k, h, 64)
    assert cfg.max_position_embeddings == SEQ_LEN
    assert cfg.tie_word_embeddings == shared and (params.lm_head is None) == shared
    assert (cfg.rms_norm_eps, cfg.rope_theta) == (1e-5, 10000.0)

    # The rotate_half layout: output dim j of a head is llama2.c's dim perm[j].
    perm = np.r_[0:h:2, 1:h:2]
    got = {
        "token_embedding": params.embed,
        "rms_att": params.layers.attn_norm,
        "rms_ffn": params.layers.mlp_norm,
        "rms_final": params.final_norm,
        "wq": np.asarray(params.layers.wq)[..., np.argsort(perm)]
        .reshape(-1, d, n * h)
        .transpose(0, 2, 1),
        "wk": np.asarray(params.layers.wk)[..., np.argsort(perm)]
        .reshape(-1, d, k * h)
        .transpose(0, 2, 1),
        "wv": np.asarray(params.layers.wv).reshape(-1, d, k * h).transpose(0, 2, 1),
        "wo": np.asarray(params.layers.wo).reshape(-1, n * h, d).transpose(0, 2, 1),
        "w1": np.asarray(params.layers.w_gate).transpose(0, 2, 1),
        "w3": np.asarray(params.layers.w_up).transpose(0, 2, 1),
        "w2": np.asarray(params.layers.w_down).transpose(0, 2, 1),
    }
    if not shared:
        got["wcls"] = np.asarray(params.lm_head).T
    for name, value in got.items():
        value = np.asarray(value)
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, seen[name], err_msg=name)  # exact vs the file
        if version == 2 and name in (*MATS, "wcls"):
            # Q8_0 bound: half a quantization step, max|group| / 127 / 2, per group.
            g = w[name].reshape(-1, 16)
            bound = np.abs(g).max(axis=1, keepdims=True) / 127 / 2 * (1 + 1e-5)
            assert np.all(np.abs(value.reshape(-1, 16) - g) <= bound), name
        else:
            np.testing.assert_array_equal(value, w[name], err_msg=name)


@pytest.mark.parametrize("shared", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("version", [0, 1, 2])
def test_synthetic_matches_runc(tmp_path, version, shared):
    path, _, seen = _write_small(tmp_path, version, shared, seed=1)
    cfg, params = load_llama2c(path)
    tokens = list(np.random.default_rng(2).integers(0, SMALL["vocab"], size=SEQ_LEN))
    assert_logits_match(params, cfg, seen, SMALL["heads"], SMALL["kv_heads"], tokens)


def test_permutation_matters(tmp_path):
    """The run.c comparison detects a loader that skips the RoPE permutation."""
    path, _, seen = _write_small(tmp_path, 0, True, seed=3)
    cfg, params = load_llama2c(path)
    unpermuted = np.asarray(params.layers.wq)[..., np.argsort(np.r_[0:8:2, 1:8:2])]
    bad = dataclasses.replace(
        params, layers=dataclasses.replace(params.layers, wq=jnp.asarray(unpermuted))
    )
    with pytest.raises(AssertionError):
        assert_logits_match(bad, cfg, seen, SMALL["heads"], SMALL["kv_heads"], list(range(12)))


def test_dtype_bfloat16(tmp_path):
    path, _, _ = _write_small(tmp_path, 1, False)
    _, params = load_llama2c(path, dtype=jnp.bfloat16)
    assert params.embed.dtype == jnp.bfloat16 and params.layers.wq.dtype == jnp.bfloat16
    assert params.lm_head.dtype == jnp.bfloat16


# ------------------------------------------------------------------ real checkpoints


@needs_shared
@pytest.mark.parametrize(
    "rel, header",
    [
        ("stories260K/stories260K.bin", (64, 172, 5, 8, 4, 512, 512)),
        ("aidreams260K/aidreams260K.bin", (64, 172, 4, 4, 4, 512, 128)),
    ],
)
def test_real_checkpoint_matches_runc(rel, header):
    path = MODELS / rel
    cfg, params = load_llama2c(path)
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = header
    assert (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_layers,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.vocab_size,
        cfg.max_position_embeddings,
    ) == header
    assert cfg.head_dim == dim // heads and cfg.tie_word_embeddings
    (h, k), w = read_legacy(path)
    # BOS, "Once upon a time", then ids spread over the vocabulary: 20 positions of RoPE.
    tokens = [1, 403, 407, 261, 378, *range(5, 512, 34)]
    assert_logits_match(params, cfg, w, h, k, tokens)


# ------------------------------------------------------------------ damaged files


def test_truncated_names_tensor_and_sizes(tmp_path):
    path, _, _ = _write_small(tmp_path, 0, False)
    size = path.stat().st_size
    data = path.read_bytes()
    # Cut in the untied classifier (the last tensor).
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError) as e:
        load_llama2c(path)
    msg = str(e.value)
    assert str(path) in msg and "truncated" in msg and "'wcls'" in msg
    assert f"expected file size {size} bytes, found {size - 10}" in msg
    assert f"needs {64 * 32 * 4} bytes" in msg and f"found {64 * 32 * 4 - 10}" in msg
    # Cut inside wq (right after the embedding and the attention norms).
    cut = 28 + 4 * (64 * 32 + 2 * 32) + 100
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match=r"tensor 'wq' .*needs 8192 bytes.*found 100"):
        load_llama2c(path)


def test_truncated_q80_names_scales(tmp_path):
    path, _, _ = _write_small(tmp_path, 2, True)
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(CheckpointError, match=r"tensor 'w3' \(Q8_0 float32 scales"):
        load_llama2c(path)


def test_truncated_header(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(struct.pack("<Ii", MAGIC, 1) + b"\0" * 20)
    with pytest.raises(CheckpointError, match=r"truncated llama2.c header: expected 256 bytes"):
        load_llama2c(path)


def test_trailing_bytes(tmp_path):
    path, _, _ = _write_small(tmp_path, 1, True)
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(b"garbage!")
    with pytest.raises(CheckpointError) as e:
        load_llama2c(path)
    msg = str(e.value)
    assert str(path) in msg and "8 trailing bytes" in msg
    assert f"expected file size {size} bytes, found {size + 8}" in msg


@pytest.mark.parametrize(
    "ints, match",
    [
        ((0, 48, 2, 4, 2, 64, 24), r"dim=0"),
        ((32, 48, -2, 4, 2, 64, 24), r"n_layers=-2"),
        ((32, 48, 2, 4, 2, 64, 0), r"seq_len=0"),
        ((32, 48, 2, 4, 3, 64, 24), r"n_heads=4 is not a multiple of n_kv_heads=3"),
        ((30, 48, 2, 4, 2, 64, 24), r"dim=30 must be n_heads=4 times an even head size"),
    ],
)
@pytest.mark.parametrize("version", [0, 1])
def test_bad_header(tmp_path, ints, match, version):
    path = tmp_path / "bad.bin"
    if version == 0:
        header = struct.pack("<7i", *ints)
    else:
        header = struct.pack("<Ii7iB", MAGIC, 1, *ints, 1).ljust(256, b"\0")
    path.write_bytes(header + b"\0" * 4096)
    with pytest.raises(CheckpointError, match=match) as e:
        load_llama2c(path)
    assert str(path) in str(e.value) and "bad llama2.c header" in str(e.value)


def test_bad_version_and_group_size(tmp_path):
    path = tmp_path / "v9.bin"
    path.write_bytes(struct.pack("<Ii7iB", MAGIC, 9, 32, 48, 2, 4, 2, 64, 24, 1).ljust(256, b"\0"))
    with pytest.raises(CheckpointError, match=r"version 9 is not supported"):
        load_llama2c(path)
    path.write_bytes(
        struct.pack("<Ii7iBi", MAGIC, 2, 32, 48, 2, 4, 2, 64, 24, 1, 12).ljust(256, b"\0")
    )
    with pytest.raises(CheckpointError, match=r"group_size=12, expected a positive divisor"):
        load_llama2c(path)


@pytest.mark.parametrize("version", [0, 1])
def test_header_implying_more_than_the_file_is_refused_before_allocating(tmp_path, version):
    """2**30 layers on a small file: refused from the file's size, before the config (whose
    layer windows alone would be 8 GiB) or any tensor exists."""
    path = tmp_path / "huge.bin"
    ints = (32, 48, 2**30, 4, 2, 64, 24)
    if version == 0:
        header = struct.pack("<7i", *ints)
    else:
        header = struct.pack("<Ii7iB", MAGIC, 1, *ints, 1).ljust(256, b"\0")
    path.write_bytes(header + b"\0" * 65536)

    def load_it():
        with pytest.raises(CheckpointError) as e:
            load_llama2c(path)
        msg = str(e.value)
        assert str(path) in msg and f"found {len(header) + 65536}" in msg
        assert "n_layers=1073741824" in msg and "expected file size" in msg

    assert peak_alloc_bytes(load_it) < 16 * 2**20


@pytest.mark.parametrize("version, shared", [(0, False), (1, True)])
def test_nan_weight_is_named(tmp_path, version, shared):
    w = random_weights(**SMALL, seed=0, shared=shared)
    w["wo"][1, 2, 3] = np.nan
    path = tmp_path / "nan.bin"
    write_checkpoint(path, w, version, SEQ_LEN, SMALL["heads"], SMALL["kv_heads"], shared=shared)
    with pytest.raises(CheckpointError) as e:
        load_llama2c(path)
    msg = str(e.value)
    assert str(path) in msg and "'wo'" in msg and "1 non-finite" in msg and "[1, 2, 3]" in msg


def test_inf_q80_scale_is_named(tmp_path):
    path, _, _ = _write_small(tmp_path, 2, True)
    data = bytearray(path.read_bytes())
    data[-4:] = struct.pack("<f", np.inf)  # the last float32 scale: w3's (shared classifier)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensor 'w3 \(Q8_0 scales\)' holds 1 non-finite"):
        load_llama2c(path)


def test_float16_overflow_is_named(tmp_path):
    w = random_weights(**SMALL, seed=0, shared=True)
    w["w2"][0, 0, 0] = 1e5  # float16's largest is 65504
    path = tmp_path / "big.bin"
    write_checkpoint(path, w, 1, SEQ_LEN, SMALL["heads"], SMALL["kv_heads"])
    load_llama2c(path, jnp.bfloat16)  # within bfloat16's range
    with pytest.raises(CheckpointError, match=r"'w2' has 1 value\(s\) beyond float16's range"):
        load_llama2c(path, jnp.float16)


def test_weights_beyond_free_memory_are_refused(tmp_path, monkeypatch):
    from jaxinfer import memory_limits

    path, _, _ = _write_small(tmp_path, 1, False)
    load_llama2c(path)
    monkeypatch.setattr(memory_limits, "available_host_bytes", lambda: 10_000)
    with pytest.raises(CheckpointError) as e:
        load_llama2c(path)
    msg = str(e.value)
    assert str(path) in msg and "do not fit in memory" in msg
    assert "host memory available: 10000 bytes" in msg


# ------------------------------------------------------------------ jaxinfer.load


def test_load_file_and_directory(tmp_path):
    path, w, _ = _write_small(tmp_path, 0, True)
    (tmp_path / "notes.txt").write_text("not a model")
    for target in (path, tmp_path):
        assert detect_format(target) == ("llama2c", path)
        m = load(target, dtype="bfloat16")
        assert isinstance(m, LoadedModel)
        assert m.path == Path(target) and m.tokenizer is None
        assert m.config.hidden_size == 32 and m.params.embed.dtype == jnp.bfloat16
    m = load(path, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(m.params.embed), w["token_embedding"])


def test_load_exported_at_top_level():
    # Fails when jaxinfer was pip-installed (editable) before jaxinfer/__init__.py existed: the
    # editable finder then imports it as a namespace package; reinstall with `pip install -e .`.
    assert jaxinfer.load is load and jaxinfer.LoadedModel is LoadedModel


def test_load_unrecognised(tmp_path):
    with pytest.raises(CheckpointError, match=r"no such file or directory; supported: "):
        load(tmp_path / "missing")
    (tmp_path / "readme.txt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"no checkpoint found.*readme.txt.*supported: "):
        load(tmp_path)
    with pytest.raises(CheckpointError, match=r"unrecognised file \(5 bytes.*supported: "):
        load(tmp_path / "readme.txt")
    # Any text's first 28 bytes read as 7 positive int32s, a "plausible" legacy header: a file
    # that is no .bin is then not a checkpoint (was: "bad llama2.c header: n_heads=...").
    (tmp_path / "p.json").write_text('{"prompt": "Once upon a time"}\n')
    with pytest.raises(CheckpointError, match=r"p.json: unrecognised file \(31 bytes.*supported: "):
        load(tmp_path / "p.json")
    (tmp_path / "model.bin").write_bytes(b"\0" * 10)  # a corrupt checkpoint is named as such
    with pytest.raises(
        CheckpointError, match=r"model.bin \(10 bytes\): not a valid llama2.c check"
    ):
        load(tmp_path)
    (tmp_path / "model.bin").unlink()
    _write_small(tmp_path, 0, True, name="a.bin")
    _write_small(tmp_path, 1, True, name="b.bin")
    with pytest.raises(CheckpointError, match=r"2 llama2.c checkpoints \(a.bin, b.bin\)"):
        load(tmp_path)


def test_damaged_checkpoint_in_directory_is_reported(tmp_path):
    """A truncated checkpoint is still recognised, so the error says what is wrong with it."""
    path, _, _ = _write_small(tmp_path, 0, True)
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"truncated llama2.c checkpoint"):
        load(tmp_path)


@needs_shared
def test_load_tokenizer_file_is_not_a_checkpoint():
    with pytest.raises(CheckpointError, match=r"llama2.c tokenizer file, not a checkpoint"):
        load(MODELS / "stories260K" / "tok512.bin")


@needs_shared
@pytest.mark.parametrize("name", ["stories260K", "aidreams260K"])
def test_load_real_directory_with_tokenizer(name):
    d = MODELS / name
    m = load(d)
    assert m.config.model_type == "llama2c" and m.path == d
    assert m.tokenizer is not None and m.tokenizer.vocab_size == 512
    m2 = load(d / f"{name}.bin", tokenizer=d / "tok512.bin")
    assert m2.tokenizer is not None and m2.tokenizer.bos_id == 1
    if name == "stories260K":
        assert m.tokenizer.encode("Once upon a time", add_special_tokens=False) == [
            403,
            407,
            261,
            378,
        ]
