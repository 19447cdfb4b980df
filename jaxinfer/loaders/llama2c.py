"""Loader of llama2.c checkpoints (``run.c``'s ``.bin`` files): versions 0, 1 and 2.

Formats, as written by llama2.c's ``export.py`` (``legacy_export``, ``version1_export``,
``version2_export``); all little-endian:

- version 0 (legacy): 7 int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size,
  seq_len; a negative vocab_size means an untied classifier follows), then float32 token
  embedding, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, freq_cis real and imag
  (seq_len * head_size / 2 each, skipped), then wcls when untied.
- version 1: a 256-byte header (uint32 magic 0x616b3432 "ak42", int32 version, the 7 int32, a
  uint8 shared-classifier flag, zero padding), then float32 rms_att, rms_ffn, rms_final,
  embedding, wq, wk, wv, wo, w1, w2, w3, [wcls].
- version 2 (Q8_0): the version-1 header plus an int32 group size after the flag; float32
  rms_att, rms_ffn, rms_final; then int8 values of embedding, wq, wk, wv, wo, w1, w2, w3, [wcls];
  then the float32 scales of each of those, one per group of ``group_size`` consecutive values.
  Dequantized to float at load (``value = int8 * scale``).

llama2.c applies RoPE to interleaved pairs ``(x[2i], x[2i+1])`` of each head, while
``jaxinfer.models.forward`` uses the "rotate_half" pairs ``(x[i], x[i + H/2])``. The output rows of
wq and
wk are therefore permuted within each head to ``[0, 2, 4, ..., 1, 3, 5, ...]`` (the inverse of
transformers' ``convert_llama_weights_to_hf`` permute). Scores are unchanged since q.k is invariant
to the same permutation of q's and k's head dimensions.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct

import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import CheckpointError
from jaxinfer.loaders.checks import check_cast, check_finite, check_fits, param_bytes
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.params import Params, param_shapes, params_from_flat

MAGIC = 0x616B3432  # "ak42" read as a little-endian uint32
HEADER_V1_BYTES = 256
_HEADER_FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len")


@dataclasses.dataclass(frozen=True)
class Llama2cHeader:
    """The hyperparameters of a llama2.c checkpoint header.

    Attributes:
        version: 0 (legacy), 1 (float32) or 2 (Q8_0).
        dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len: as in ``run.c``'s
            ``Config``; ``vocab_size`` is the absolute value.
        shared_classifier: the classifier is the token embedding.
        group_size: Q8_0 group size in values (version 2), else 0.
        header_bytes: bytes before the first tensor.
    """

    version: int
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool
    group_size: int
    header_bytes: int

    @property
    def head_size(self) -> int:
        return self.dim // self.n_heads


def read_header(path: str | os.PathLike) -> Llama2cHeader:
    """Reads and validates the header of a llama2.c checkpoint.

    Raises:
        CheckpointError: the file is missing, shorter than its header, or a header value is
            invalid (non-positive sizes, n_heads not a multiple of n_kv_heads, dim not a
            multiple of n_heads, odd head size, unknown version, bad group size).
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_V1_BYTES)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read llama2.c checkpoint: {e}") from e
    if len(head) >= 4 and struct.unpack("<I", head[:4])[0] == MAGIC:
        if len(head) < HEADER_V1_BYTES:
            raise CheckpointError(
                f"{path}: truncated llama2.c header: expected {HEADER_V1_BYTES} bytes, "
                f"found {len(head)}"
            )
        (version,) = struct.unpack("<i", head[4:8])
        if version not in (1, 2):
            raise CheckpointError(
                f"{path}: llama2.c checkpoint version {version} is not supported; "
                "supported: 0 (legacy), 1 (float32), 2 (Q8_0)"
            )
        values = struct.unpack("<7i", head[8:36])
        shared = bool(head[36])
        group_size = struct.unpack("<i", head[37:41])[0] if version == 2 else 0
        header_bytes = HEADER_V1_BYTES
    else:
        version = 0
        if len(head) < 28:
            raise CheckpointError(
                f"{path}: truncated llama2.c header: expected 28 bytes (7 int32), found {len(head)}"
            )
        values = struct.unpack("<7i", head[:28])
        shared = values[5] > 0
        group_size = 0
        header_bytes = 28
    fields = dict(zip(_HEADER_FIELDS, values, strict=True))
    fields["vocab_size"] = abs(fields["vocab_size"])  # v0: the sign is the tied flag
    bad = [f"{k}={v}" for k, v in fields.items() if v <= 0]
    if bad:
        raise CheckpointError(
            f"{path}: bad llama2.c header (version {version}): {', '.join(bad)}; expected every "
            f"value positive; header: {_fmt(fields)}"
        )
    if fields["n_heads"] % fields["n_kv_heads"]:
        raise CheckpointError(
            f"{path}: bad llama2.c header: n_heads={fields['n_heads']} is not a multiple of "
            f"n_kv_heads={fields['n_kv_heads']}; header: {_fmt(fields)}"
        )
    if fields["dim"] % fields["n_heads"] or (fields["dim"] // fields["n_heads"]) % 2:
        raise CheckpointError(
            f"{path}: bad llama2.c header: dim={fields['dim']} must be n_heads="
            f"{fields['n_heads']} times an even head size; header: {_fmt(fields)}"
        )
    if version == 2 and (group_size <= 0 or fields["dim"] % group_size):
        raise CheckpointError(
            f"{path}: bad llama2.c Q8_0 header: group_size={group_size}, expected a positive "
            f"divisor of dim={fields['dim']}"
        )
    return Llama2cHeader(
        version=version,
        shared_classifier=shared,
        group_size=group_size,
        header_bytes=header_bytes,
        **fields,
    )


def _fmt(fields: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in fields.items())


def tensor_shapes(h: Llama2cHeader) -> dict[str, tuple[int, ...]]:
    """Shapes of the tensors of a checkpoint, llama2.c names, PyTorch (out, in) layout."""
    L, D, F, V = h.n_layers, h.dim, h.hidden_dim, h.vocab_size
    kv_dim = h.n_kv_heads * h.head_size
    shapes = {
        "token_embedding": (V, D),
        "rms_att": (L, D),
        "wq": (L, D, D),
        "wk": (L, kv_dim, D),
        "wv": (L, kv_dim, D),
        "wo": (L, D, D),
        "rms_ffn": (L, D),
        "w1": (L, F, D),
        "w2": (L, D, F),
        "w3": (L, F, D),
        "rms_final": (D,),
        "freq_cis_real": (h.seq_len, h.head_size // 2),
        "freq_cis_imag": (h.seq_len, h.head_size // 2),
    }
    if not h.shared_classifier:
        shapes["wcls"] = (V, D)
    return shapes


def _layout(h: Llama2cHeader) -> list[tuple[str, str]]:
    """(tensor name, storage) in file order; storage is "f32", "i8" (Q8_0 values) or
    "scale" (Q8_0 float32 scales of that tensor)."""
    cls = [] if h.shared_classifier else ["wcls"]
    if h.version == 0:
        names = [
            "token_embedding",
            "rms_att",
            "wq",
            "wk",
            "wv",
            "wo",
            "rms_ffn",
            "w1",
            "w2",
            "w3",
            "rms_final",
            "freq_cis_real",
            "freq_cis_imag",
            *cls,
        ]
        return [(n, "f32") for n in names]
    norms = ["rms_att", "rms_ffn", "rms_final"]
    mats = ["token_embedding", "wq", "wk", "wv", "wo", "w1", "w2", "w3", *cls]
    if h.version == 1:
        return [(n, "f32") for n in norms + mats]
    return [(n, "f32") for n in norms] + [(n, "i8") for n in mats] + [(n, "scale") for n in mats]


def _nbytes(shape: tuple[int, ...], storage: str, group_size: int) -> int:
    n = math.prod(shape)  # Python ints: a header's absurd sizes must not overflow
    if storage == "i8":
        return n
    if storage == "scale":
        return 4 * (n // group_size)
    return 4 * n


def expected_size(h: Llama2cHeader) -> int:
    """Total file size in bytes implied by the header."""
    shapes = tensor_shapes(h)
    return h.header_bytes + sum(_nbytes(shapes[n], s, h.group_size) for n, s in _layout(h))


_STORAGE = {"f32": "float32", "i8": "Q8_0 int8 values", "scale": "Q8_0 float32 scales"}


def check_file_size(path: str | os.PathLike, h: Llama2cHeader) -> list[tuple[str, str, int, int]]:
    """Checks the file holds exactly the tensors its header implies, before any is read.

    Returns:
        (name, storage, offset, bytes) of each tensor in file order (see ``_layout``).

    Raises:
        CheckpointError: a tensor runs past the end of the file (naming it, with the bytes it
            needs and the bytes left, and the expected and actual file sizes); bytes left over
            after the last tensor.
    """
    path = os.fspath(path)
    shapes = tensor_shapes(h)
    size = os.path.getsize(path)
    offset = h.header_bytes
    plan = []
    for name, storage in _layout(h):
        nbytes = _nbytes(shapes[name], storage, h.group_size)
        if offset + nbytes > size:
            raise CheckpointError(
                f"{path}: truncated llama2.c checkpoint (version {h.version}): tensor {name!r} "
                f"({_STORAGE[storage]}, shape {shapes[name]}) needs {nbytes} bytes at offset "
                f"{offset}, found {max(size - offset, 0)}; expected file size "
                f"{expected_size(h)} bytes, found {size} (header: {_fmt(_fields(h))})"
            )
        plan.append((name, storage, offset, nbytes))
        offset += nbytes
    if size != offset:
        raise CheckpointError(
            f"{path}: llama2.c checkpoint (version {h.version}) has {size - offset} trailing "
            f"bytes after the last tensor: expected file size {offset} bytes, found {size} "
            f"(header: {_fmt(_fields(h))}, shared_classifier={h.shared_classifier})"
        )
    return plan


def _fields(h: Llama2cHeader) -> dict[str, int]:
    return {k: getattr(h, k) for k in _HEADER_FIELDS}


def read_tensors(path: str | os.PathLike, h: Llama2cHeader | None = None) -> dict[str, np.ndarray]:
    """Reads every tensor of a checkpoint as float32 numpy arrays in the file's own layout.

    Q8_0 tensors are dequantized. The keys and shapes are those of ``tensor_shapes``, without
    the freq_cis tables (``run.c`` recomputes RoPE). The arrays are llama2.c's interleaved-RoPE
    weights, unpermuted: useful for reference implementations of ``run.c``.

    Raises:
        CheckpointError: bad header; the file's size differs from the one its header implies
            (``check_file_size``, before anything is read); a tensor holding NaN or Inf (naming
            it).
    """
    path = os.fspath(path)
    if h is None:
        h = read_header(path)
    shapes = tensor_shapes(h)
    plan = check_file_size(path, h)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    f32: dict[str, np.ndarray] = {}
    q8: dict[str, np.ndarray] = {}
    for name, storage, offset, nbytes in plan:
        chunk = raw[offset : offset + nbytes]
        if name.startswith("freq_cis"):
            continue
        if storage == "f32":
            f32[name] = chunk.view("<f4").astype(np.float32).reshape(shapes[name])
            check_finite(f32[name], path, name)
        elif storage == "i8":
            q8[name] = chunk.view(np.int8)
        else:
            scales = chunk.view("<f4").astype(np.float32)
            check_finite(scales, path, f"{name} (Q8_0 scales)")
            vals = q8.pop(name).astype(np.float32).reshape(-1, h.group_size)
            f32[name] = (vals * scales[:, None]).reshape(shapes[name])
            check_finite(f32[name], path, name)  # int8 * a huge finite scale can overflow
    return f32


def interleaved_to_half(w: np.ndarray, heads: int, head_size: int) -> np.ndarray:
    """Permutes the output rows of a [..., heads * head_size, D] projection from llama2.c's
    interleaved RoPE pairs to the rotate_half layout: within each head, rows
    ``[0, 2, 4, ..., 1, 3, 5, ...]``."""
    perm = np.concatenate([np.arange(0, head_size, 2), np.arange(1, head_size, 2)])
    lead = w.shape[:-2]
    w = w.reshape(*lead, heads, head_size, w.shape[-1])
    return w[..., perm, :].reshape(*lead, heads * head_size, -1)


def config_from_header(h: Llama2cHeader) -> ModelConfig:
    """The ModelConfig of a llama2.c checkpoint (RMSNorm eps 1e-5 and RoPE theta 10000, as
    hard-coded in ``run.c``). Check the file's size first (``check_file_size``): an absurd
    header is cheap to read but its config is not (a tuple of L layer windows)."""
    return ModelConfig(
        model_type="llama2c",
        vocab_size=h.vocab_size,
        hidden_size=h.dim,
        intermediate_size=h.hidden_dim,
        num_layers=h.n_layers,
        num_heads=h.n_heads,
        num_kv_heads=h.n_kv_heads,
        head_dim=h.head_size,
        max_position_embeddings=h.seq_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=h.shared_classifier,
    )


def load_llama2c(
    path: str | os.PathLike, dtype=jnp.float32, place=None
) -> tuple[ModelConfig, Params]:
    """Loads a llama2.c checkpoint (version 0, 1 or 2) into the engine's layout.

    Args:
        path: the ``.bin`` checkpoint file.
        dtype: dtype of the returned weights (Q8_0 weights are dequantized first).
        place: optional ``place(cfg, field, x: np.ndarray) -> jax.Array`` hook, as in ``load_hf``.

    Returns:
        (config, params): wq f32[L, D, N, H], wk/wv [L, D, K, H] (wq, wk rows permuted to the
        rotate_half RoPE layout), wo [L, N, H, D], w_gate/w_up [L, D, F] (llama2.c w1/w3),
        w_down [L, F, D] (w2), embed [V, D], lm_head [D, V] when untied.

    Raises:
        CheckpointError: bad header; truncated file or trailing bytes (``check_file_size``,
            before anything is allocated); weights that do not fit in memory; a tensor holding
            NaN or Inf, or overflowing ``dtype`` (naming it).
    """
    h = read_header(path)
    check_file_size(path, h)
    cfg = config_from_header(h)
    np_dtype = np.dtype(dtype)
    shapes = param_shapes(cfg)
    f32_bytes = param_bytes(
        (s for n, s in tensor_shapes(h).items() if "freq_cis" not in n), np.float32
    )  # read_tensors' float32 copies, then the layout changes
    check_fits(
        path, param_bytes(shapes.values(), np_dtype), 2 * f32_bytes, f"the weights in {np_dtype}"
    )
    t = read_tensors(path, h)
    L, D, N, K, H = h.n_layers, h.dim, h.n_heads, h.n_kv_heads, h.head_size
    wq = interleaved_to_half(t["wq"], N, H)  # [L, N*H, D]
    wk = interleaved_to_half(t["wk"], K, H)  # [L, K*H, D]
    flat = {
        "embed": t["token_embedding"],
        "final_norm": t["rms_final"],
        "layers.attn_norm": t["rms_att"],
        "layers.mlp_norm": t["rms_ffn"],
        "layers.wq": wq.reshape(L, N, H, D).transpose(0, 3, 1, 2),
        "layers.wk": wk.reshape(L, K, H, D).transpose(0, 3, 1, 2),
        "layers.wv": t["wv"].reshape(L, K, H, D).transpose(0, 3, 1, 2),
        "layers.wo": t["wo"].transpose(0, 2, 1).reshape(L, N, H, D),
        "layers.w_gate": t["w1"].transpose(0, 2, 1),
        "layers.w_up": t["w3"].transpose(0, 2, 1),
        "layers.w_down": t["w2"].transpose(0, 2, 1),
    }
    if not h.shared_classifier:
        flat["lm_head"] = t["wcls"].T
    out = {}
    for k, v in flat.items():
        with np.errstate(over="ignore"):  # overflow is reported by check_cast
            x = np.ascontiguousarray(v, np_dtype)
        if np_dtype != np.float32:
            check_cast(x, path, _SOURCE[k])
        out[k] = place(cfg, k, x) if place is not None else jnp.asarray(x)
        del x
    return cfg, params_from_flat(out)


# Params field -> the llama2.c tensor it comes from (named in errors).
_SOURCE = {
    "embed": "token_embedding",
    "final_norm": "rms_final",
    "layers.attn_norm": "rms_att",
    "layers.mlp_norm": "rms_ffn",
    "layers.wq": "wq",
    "layers.wk": "wk",
    "layers.wv": "wv",
    "layers.wo": "wo",
    "layers.w_gate": "w1",
    "layers.w_up": "w3",
    "layers.w_down": "w2",
    "lm_head": "wcls",
}


def is_llama2c_tokenizer_file(path: str | os.PathLike) -> bool:
    """True when ``path`` parses completely as a llama2.c tokenizer file (int32
    max_token_length, then per token: float32 score, int32 length, bytes)."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 24)
    except OSError:
        return False
    if len(data) < 4 or os.path.getsize(path) > len(data):
        return False
    (max_len,) = struct.unpack_from("<i", data, 0)
    if not 0 < max_len <= 4096:
        return False
    off, n = 4, 0
    while off < len(data):
        if off + 8 > len(data):
            return False
        (n_bytes,) = struct.unpack_from("<i", data, off + 4)
        if not 0 <= n_bytes <= max_len:
            return False
        off += 8 + n_bytes
        n += 1
    return off == len(data) and n > 0


def is_llama2c_checkpoint_file(path: str | os.PathLike) -> bool:
    """True when ``path`` starts like a llama2.c checkpoint: the "ak42" magic, or a legacy
    header of plausible values, and it is not a llama2.c tokenizer file. The file may still be
    truncated or otherwise damaged: ``load_llama2c`` reports that precisely."""
    try:
        with open(path, "rb") as f:
            head = f.read(28)
    except OSError:
        return False
    if len(head) >= 4 and struct.unpack("<I", head[:4])[0] == MAGIC:
        return True
    if len(head) < 28 or is_llama2c_tokenizer_file(path):
        return False
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = struct.unpack("<7i", head)
    return all(v > 0 for v in (dim, hidden, layers, heads, kv_heads, abs(vocab), seq_len))
