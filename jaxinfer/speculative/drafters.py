"""The three drafters: a smaller draft model (or a truncated copy of the target), n-gram prompt
lookup (host side) and Medusa heads on the target's last hidden state.

Sources: prompt lookup decoding (Saxena 2023, and vLLM's ``ngram`` proposer); Medusa (Cai et al.
2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads"): head k
is a residual block ``h + SiLU(W_k h + b_k)`` followed by its own LM head, and predicts the token
k + 1 places after the one the base LM head predicts.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.models.config import ModelConfig
from jaxinfer.models.params import Params

# ------------------------------------------------------------------------------ draft model


def truncated_draft(
    cfg: ModelConfig, params: Params, num_layers: int
) -> tuple[ModelConfig, Params]:
    """A self-speculative draft: the target's first ``num_layers`` layers, its final norm and LM
    head (LayerSkip-style early exit without training). Raises ValueError on a bad layer count."""
    if not 1 <= num_layers <= cfg.num_layers:
        raise ValueError(f"draft layers must be in [1, {cfg.num_layers}], got {num_layers}")
    dcfg = dataclasses.replace(
        cfg,
        num_layers=num_layers,
        layer_windows=tuple(cfg.layer_windows[:num_layers]),
        sparse_layers=tuple(cfg.sparse_layers[:num_layers]),
    )
    if isinstance(params.layers, tuple):  # unstacked layers (params.unstack_layers)
        layers = params.layers[:num_layers]
    else:
        layers = jax.tree.map(lambda x: x[:num_layers], params.layers)
    return dcfg, dataclasses.replace(params, layers=layers)


def load_draft_model(
    spec: str | os.PathLike, cfg: ModelConfig, params: Params, dtype
) -> tuple[ModelConfig, Params]:
    """The draft model named by ``spec``: ``"self"`` (the target itself), ``"layers:N"`` (the
    target's first N layers, ``truncated_draft``) or a checkpoint path (``jaxinfer.load``).

    Raises:
        ValueError: the draft's vocabulary differs from the target's.
        CheckpointError: the path cannot be loaded.
    """
    s = str(spec)
    if s == "self":
        return cfg, params
    if s.startswith("layers:"):
        n = s.split(":", 1)[1]
        if not n.isdigit():
            raise ValueError(f"draft model {s!r}: 'layers:N' needs a whole number of layers N")
        return truncated_draft(cfg, params, int(n))
    from jaxinfer.loaders import CheckpointError, load

    try:
        loaded = load(spec, dtype=dtype)
    except CheckpointError as e:
        raise CheckpointError(f"draft model: {e}") from None
    if loaded.config.vocab_size != cfg.vocab_size:
        raise ValueError(
            f"draft model {s} has vocab_size={loaded.config.vocab_size}, the target "
            f"{cfg.vocab_size}: a draft model must share the target's tokenizer"
        )
    return loaded.config, loaded.params


# ------------------------------------------------------------------------------ n-gram lookup


def ngram_propose(
    tokens: np.ndarray, num_drafts: int, ngram_max: int = 3, ngram_min: int = 1
) -> list[int]:
    """Prompt lookup: the continuation of the latest earlier occurrence of the sequence's suffix.

    Tries suffix lengths ``ngram_max`` down to ``ngram_min``; the first that occurs earlier in
    ``tokens`` (i32[S], prompt + output so far) proposes the up to ``num_drafts`` tokens that
    followed its latest occurrence. Returns [] when no suffix recurs.
    """
    s = len(tokens)
    for n in range(min(ngram_max, s - 1), ngram_min - 1, -1):
        suffix = tokens[s - n :]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: s - 1], n)  # starts < s - n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in tokens[start : start + num_drafts]]
    return []


# ------------------------------------------------------------------------------ Medusa heads


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftHeads:
    """K Medusa heads.

    Attributes:
        w: f32[K, D, D] residual block weights; b: f32[K, D] its bias.
        lm_head: f32[K, D, V] each head's LM head (initialised from the target's).
    """

    w: jax.Array
    b: jax.Array
    lm_head: jax.Array

    @property
    def num_heads(self) -> int:
        return self.w.shape[0]


def init_heads(params: Params, num_heads: int) -> DraftHeads:
    """Zero residual blocks (each head starts as the target's own LM head), Medusa's init."""
    lm = params.embed.T if params.lm_head is None else params.lm_head  # [D, V]
    d = lm.shape[0]
    return DraftHeads(
        w=jnp.zeros((num_heads, d, d), jnp.float32),
        b=jnp.zeros((num_heads, d), jnp.float32),
        lm_head=jnp.broadcast_to(lm.astype(jnp.float32), (num_heads, *lm.shape)).copy(),
    )


def heads_logits(heads: DraftHeads, hidden: jax.Array) -> jax.Array:
    """Logits f32[B, K, V] of the K heads at final-normed hidden states [B, D]."""
    h = hidden.astype(jnp.float32)
    hk = h[:, None, :] + jax.nn.silu(jnp.einsum("BD,KDE->BKE", h, heads.w) + heads.b)
    return jnp.einsum("BKD,KDV->BKV", hk, heads.lm_head)


def save_heads(heads: DraftHeads, path: str | os.PathLike, meta: dict | None = None) -> None:
    """Writes the heads as an orbax-checkpoint (a directory; replaced if it exists)."""
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    tree = {
        "w": np.asarray(heads.w),
        "b": np.asarray(heads.b),
        "lm_head": np.asarray(heads.lm_head),
    }
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "heads", tree, force=True)
    if meta is not None:
        import json

        (path / "meta.json").write_text(json.dumps(meta, indent=2))


def load_heads(path: str | os.PathLike, cfg: ModelConfig) -> DraftHeads:
    """Reads heads written by ``save_heads``. Raises ValueError if they do not fit ``cfg``."""
    import orbax.checkpoint as ocp

    path = Path(path).resolve()
    if not (path / "heads").exists():
        raise ValueError(
            f"{path} holds no draft heads (expected an orbax checkpoint at {path / 'heads'})"
        )
    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.restore(path / "heads")
    heads = DraftHeads(**{k: jnp.asarray(tree[k]) for k in ("w", "b", "lm_head")})
    if heads.lm_head.shape[1:] != (cfg.hidden_size, cfg.vocab_size):
        raise ValueError(
            f"draft heads at {path} have D, V = {heads.lm_head.shape[1:]}, the model "
            f"({cfg.hidden_size}, {cfg.vocab_size})"
        )
    return heads
