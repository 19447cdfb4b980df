"""The engine's device step: one jitted function over a ragged batch of prefill and decode tokens.

``forward_step`` embeds the flat token axis, runs every layer (writing K/V into the donated page
pool and attending through the paged attention) and computes logits only at each row's last
token; ``sample_step`` applies penalties and samples on device (the logits never leave it). Host
code (``jaxinfer.engine.batch``) builds the ``StepBatch``; shapes
are padded to power-of-two buckets so the number of compilations is bounded.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxinfer.models.attn_dispatch import resolve_attn_impl
from jaxinfer.models.batch_invariant import invariant_forward_logits, map_token_tiles
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.forward import compute_logits, forward
from jaxinfer.models.kv_cache import KVCache
from jaxinfer.models.paged_attention import AttentionMetadata, paged_attn_fn
from jaxinfer.models.params import Params
from jaxinfer.sampling.sampler import (
    SampleOutput,
    SamplingTensors,
    apply_penalties,
    apply_token_bitmask,
    sample,
    sample_greedy,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """Device inputs of one step.

    Attributes:
        tokens: i32[T] input token ids, decode tokens first, then prefill chunks, then padding.
        md: attention metadata (positions, slot mapping, block tables, lengths).
        logits_indices: i32[B'] index into T of each row's last token (its logits are sampled);
            B' >= B is the row count rounded up to a power of two (extra entries are padding).
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


def resolve_tokens(tokens: jax.Array, prev_tokens: jax.Array | None) -> jax.Array:
    """i32[T] ``tokens`` with each placeholder ``-(r + 1)`` replaced by ``prev_tokens[r]``."""
    if prev_tokens is None:
        return tokens
    from_prev = prev_tokens[jnp.clip(-tokens - 1, 0, prev_tokens.shape[0] - 1)]
    return jnp.where(tokens < 0, from_prev, tokens)


def forward_step(
    params: Params,
    kv: KVCache,
    batch: StepBatch,
    prev_tokens: jax.Array | None = None,
    *,
    cfg: ModelConfig,
    attn_impl: str = "xla",
    batch_invariant: bool = False,
) -> tuple[KVCache, jax.Array]:
    """The model part of a step: forward over the ragged batch, logits of each row's last token.

    Args:
        params: model weights.
        kv: the page pool; donated and returned updated.
        batch: tokens and metadata, see ``StepBatch``. A token id ``-(r + 1)`` stands for
            ``prev_tokens[r]`` (async scheduling: a token the previous step sampled, still on
            device).
        prev_tokens: i32[R] the previous step's sampled tokens (``sample_step_padded``), or None
            when ``batch.tokens`` holds no placeholder.
        cfg: architecture (static).
        attn_impl: attention implementation (static), see ``attn_dispatch.ATTN_IMPLS``.
        batch_invariant: (static) run ``batch_invariant.invariant_forward_logits``: each row's
            logits bitwise the same whatever else is in the batch. Needs ``attn_impl``
            resolving to "xla".

    Returns:
        (updated KV cache, logits f32[B, V]).

    Raises:
        ValueError: ``batch_invariant`` with an ``attn_impl`` other than "xla".
    """
    tokens = resolve_tokens(batch.tokens, prev_tokens)
    if batch_invariant:
        if resolve_attn_impl(attn_impl) != "xla":
            raise ValueError(
                f"batch_invariant=True runs its own XLA attention; attn_impl="
                f"{attn_impl!r} is not supported with it (use 'xla' or 'auto')"
            )
        return invariant_forward_logits(params, cfg, kv, tokens, batch.md, batch.logits_indices)
    hidden, kv = forward(
        params, cfg, tokens, batch.md.positions, kv, paged_attn_fn(cfg, batch.md, attn_impl)
    )
    return kv, compute_logits(params, cfg, hidden[batch.logits_indices])


def sample_step(
    logits: jax.Array,
    sampling: SamplingTensors,
    controls: LogitsControls | None,
    *,
    num_logprobs: int = 0,
) -> SampleOutput:
    """The sampling part of a step: penalties, banned tokens, then ``sampling.sample``.

    Compiled apart from ``forward_step`` so its compilations depend only on B (and on whether
    controls/logprobs are present), not on the token and page buckets.

    Args:
        logits: f32[B, V] raw logits.
        sampling: per-row sampling parameters, B rows.
        controls: penalty inputs and banned tokens, or None when no row needs them.
        num_logprobs: top-n logprobs to return per row (static; 0 = none, and then the
            sampled tokens' logprobs are not computed either: NaN).

    Returns:
        Sampled tokens i32[B] with logprobs of the raw distribution (vLLM's raw logprobs).
    """
    raw_logits = logits
    if controls is not None:
        logits = apply_penalties(logits, controls.prompt_mask, controls.output_counts, sampling)
        logits = jnp.where(controls.banned, -jnp.inf, logits)
    # No row asked for logprobs when num_logprobs is 0 (a row's logprobs=0 makes it
    # MAX_LOGPROBS): the sampled tokens' logprobs are then never read.
    return sample(
        logits,
        sampling,
        num_logprobs=num_logprobs,
        logprob_logits=raw_logits,
        token_logprobs=num_logprobs > 0,
    )


def sample_step_padded(
    logits: jax.Array,
    sampling: SamplingTensors,
    controls: LogitsControls | None,
    bitmask: jax.Array | None = None,
    *,
    num_logprobs: int = 0,
    num_slots: int,
    batch_invariant: bool = False,
    greedy: bool = False,
) -> tuple[SampleOutput, jax.Array]:
    """``sample_step``, plus the sampled tokens zero-padded to i32[num_slots] (static), the
    ``prev_tokens`` of the next ``forward_step`` (one shape for every B, so the forward compiles
    once per bucket tuple). ``batch_invariant`` (static): run it over fixed tiles of rows
    (``batch_invariant.map_token_tiles``), so a row's results do not depend on B. ``greedy``
    (static): the host found every row greedy with no controls and no logprobs
    (``sampling.sample_flags``): run ``sampling.sample_greedy`` (an argmax, the same tokens; no
    log-softmax, logprobs NaN; an argmax of one row never depends on B, so no tiles either).
    ``bitmask``: i32[B, ceil(V / 32)] the allowed tokens of each row (structured outputs,
    ``sampling.apply_token_bitmask``), applied to the logits before anything else, so every
    sampler and the returned logprobs see the masked logits (vLLM applies the grammar bitmask
    before its sampler too); None (a step without constrained rows): nothing is applied, and the
    variant compiles without it.
    Raises ValueError when B > num_slots, or ``greedy`` with controls or num_logprobs > 0."""
    if bitmask is not None:
        logits = apply_token_bitmask(logits.astype(jnp.float32), bitmask)
    if greedy:
        if controls is not None or num_logprobs:
            raise ValueError(
                "sample_step_padded: greedy=True takes no controls and num_logprobs=0, got "
                f"controls={'set' if controls is not None else None}, "
                f"num_logprobs={num_logprobs}"
            )
        out = sample_greedy(logits)
    elif batch_invariant:
        out = map_token_tiles(
            lambda lg, st, ctl: sample_step(lg, st, ctl, num_logprobs=num_logprobs),
            logits,
            sampling,
            controls,
        )
    else:
        out = sample_step(logits, sampling, controls, num_logprobs=num_logprobs)
    b = out.tokens.shape[0]
    if b > num_slots:
        raise ValueError(f"{b} sampled rows do not fit num_slots={num_slots}")
    return out, jnp.zeros(num_slots, jnp.int32).at[:b].set(out.tokens)


@functools.cache
def jitted_forward_step(out_shardings=None):
    """The jitted ``forward_step`` (one per process and ``out_shardings``; compilations keyed by
    shapes). Under a mesh, ``out_shardings`` = (KV pool sharding, replicated logits sharding), see
    ``sharding.step_out_shardings``; the params' own (committed) shardings fix the inputs'."""
    static = ("cfg", "attn_impl", "batch_invariant")
    if out_shardings is None:
        return jax.jit(forward_step, static_argnames=static, donate_argnames=("kv",))
    return jax.jit(
        forward_step, static_argnames=static, donate_argnames=("kv",), out_shardings=out_shardings
    )


@functools.cache
def jitted_sample_step():
    """The jitted ``sample_step_padded``."""
    return jax.jit(
        sample_step_padded,
        static_argnames=("num_logprobs", "num_slots", "batch_invariant", "greedy"),
    )
