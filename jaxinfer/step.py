"""The engine's device step: one jitted function over a ragged batch of prefill and decode tokens.

``step`` embeds the flat token axis, runs every layer (writing K/V into the donated page pool and
attending through the paged attention), computes logits only at each row's last token, applies
penalties and samples on device. Host code (``jaxinfer.batch``) builds the ``StepBatch``; shapes
are padded to power-of-two buckets so the number of compilations is bounded.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxinfer.config import ModelConfig
from jaxinfer.kv_cache import KVCache
from jaxinfer.model import compute_logits, forward
from jaxinfer.paged_attention import AttentionMetadata, paged_attn_fn
from jaxinfer.params import Params
from jaxinfer.sampling import SampleOutput, SamplingTensors, apply_penalties, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """Device inputs of one step.

    Attributes:
        tokens: i32[T] input token ids, decode tokens first, then prefill chunks, then padding.
        md: attention metadata (positions, slot mapping, block tables, lengths).
        logits_indices: i32[B] index into T of each row's last token (its logits are sampled).
    """

    tokens: jax.Array
    md: AttentionMetadata
    logits_indices: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LogitsControls:
    """Optional per-row vocabulary-sized inputs, passed only when some row needs them.

    Attributes:
        prompt_mask: bool[B, V] token occurs in the prompt (repetition penalty).
        output_counts: i32[B, V] occurrences in the output so far (all three penalties).
        banned: bool[B, V] tokens that must not be sampled (stop tokens before ``min_tokens``).
    """

    prompt_mask: jax.Array
    output_counts: jax.Array
    banned: jax.Array


def step(
    params: Params,
    kv: KVCache,
    batch: StepBatch,
    sampling: SamplingTensors,
    controls: LogitsControls | None,
    *,
    cfg: ModelConfig,
    num_logprobs: int = 0,
    attn_impl: str = "xla",
) -> tuple[KVCache, SampleOutput]:
    """One forward + sampling step.

    Args:
        params: model weights.
        kv: the page pool; donated and returned updated.
        batch: tokens and metadata, see ``StepBatch``.
        sampling: per-row sampling parameters, B rows.
        controls: penalty inputs and banned tokens, or None when no row needs them.
        cfg: architecture (static).
        num_logprobs: top-n logprobs to return per row (static; 0 = none).
        attn_impl: attention implementation (static), see ``paged_attention.ATTN_IMPLS``.

    Returns:
        (updated KV cache, sampled tokens i32[B] with their logprobs).
    """
    hidden, kv = forward(
        params, cfg, batch.tokens, batch.md.positions, kv, paged_attn_fn(cfg, batch.md, attn_impl)
    )
    logits = compute_logits(params, cfg, hidden[batch.logits_indices])
    raw_logits = logits
    if controls is not None:
        logits = apply_penalties(logits, controls.prompt_mask, controls.output_counts, sampling)
        logits = jnp.where(controls.banned, -jnp.inf, logits)
    return kv, sample(logits, sampling, num_logprobs=num_logprobs, logprob_logits=raw_logits)


@functools.cache
def jitted_step():
    """The jitted ``step`` (one per process; its compilation cache is keyed by shapes)."""
    return jax.jit(step, static_argnames=("cfg", "num_logprobs", "attn_impl"),
                   donate_argnames=("kv",))
