"""The jitted speculative round: draft R tokens, verify R+1 positions, accept (device side).

What is jitted (``jitted_spec_round``, one XLA program per round and bucket tuple):

1. the drafter's R autoregressive draft steps as a ``lax.scan`` (draft-model method: each step is
   one single-token decode of the draft model over its own paged KV cache, sampled from q_j
   with the request's transforms; n-gram and heads drafts arrive ready from the host);
2. the drafts are scattered into the verify batch, and the target runs one ragged forward over
   it: rows of R+1 query tokens ``[last token, d_1..d_R]`` beside the prefill chunks of newly
   admitted sequences, writing K/V into the donated page pool; logits are taken at every query
   position (``forward_step_at``, indices i32[B, R+1]);
3. the draft model mirrors the same forward over its own cache (so its KV holds exactly the
   tokens the target's does, prompts included);
4. penalties per position, ``rejection_sample``, raw logprobs of the emitted tokens, and for the
   heads method the next round's drafts from the Medusa heads at the hidden state of the last
   accepted position.

The host (``EngineCore`` with a ``SpeculativeStrategy``) runs between rounds: admission, chunked
prefill, page allocation for R+1 more slots, appending the emitted tokens with stop checks, and
rolling back the KV lengths of rejected positions (``num_computed`` counts only accepted tokens;
the pages are kept).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxinfer.engine.step import LogitsControls
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.forward import compute_logits, forward
from jaxinfer.models.kv_cache import NULL_PAGE, KVCache
from jaxinfer.models.paged_attention import AttentionMetadata, paged_attn_fn
from jaxinfer.models.params import Params
from jaxinfer.sampling.sampler import (
    SAMPLING_EPS,
    SamplingTensors,
    apply_penalties,
    processed_logits,
)
from jaxinfer.speculative.drafters import DraftHeads, heads_logits
from jaxinfer.speculative.rejection import (
    SALT_DRAFT,
    index_keys,
    penalize_positions,
    rejection_sample,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecBatch:
    """Device inputs of one round, B rows (verify rows first, then prefill rows, then padding).

    Attributes:
        tokens: i32[T] query tokens; a verify row's draft slots hold the host's drafts (or 0 for
            the draft-model method, filled on device from ``draft_index``).
        md: attention metadata of the verify forward (every row in the multi-token region).
        logits_indices: i32[B, R+1] index into T of each row's query position j (clamped to the
            row's last query token).
        drafts: i32[B, R] host drafts (n-gram, heads); zeros for the draft-model method.
        draft_index: i32[B, R] index into T of draft j of row b; T (dropped) beyond num_drafts.
        num_drafts: i32[B] drafts of each row this round (0 for prefill and padding rows).
        last_pos: i32[B] position of the row's last (pending) token, the draft scan's start.
        min_tokens_left: i32[B] positions at whose start stop tokens are still banned.
    """

    tokens: jax.Array
    md: AttentionMetadata
    logits_indices: jax.Array
    drafts: jax.Array
    draft_index: jax.Array
    num_drafts: jax.Array
    last_pos: jax.Array
    min_tokens_left: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecOutput:
    """What a round returns.

    Attributes:
        tokens: i32[B, R+1]; row b emits ``tokens[b, :num_accepted[b] + 1]``.
        num_accepted: i32[B] accepted drafts.
        logprobs: f32[B, R+1] raw logprob of each emitted token; top_ids / top_logprobs
            i32/f32[B, R+1, n] the n most likely (n = num_logprobs).
        next_drafts: i32[B, K] the heads' drafts for the next round (heads method; else [B, 0]).
    """

    tokens: jax.Array
    num_accepted: jax.Array
    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    next_drafts: jax.Array


def forward_step_at(
    params: Params,
    kv: KVCache,
    tokens: jax.Array,  # i32[T]
    md: AttentionMetadata,
    logits_indices: jax.Array,  # i32[B, J]
    *,
    cfg: ModelConfig,
    attn_impl: str = "xla",
) -> tuple[KVCache, jax.Array, jax.Array]:
    """``step.forward_step`` with logits at several query tokens per row.

    Returns:
        (updated KV cache, logits f32[B, J, V], hidden states [B, J, D] after the final norm).
    """
    hidden, kv = forward(params, cfg, tokens, md.positions, kv, paged_attn_fn(cfg, md, attn_impl))
    b, j = logits_indices.shape
    h = hidden[logits_indices.reshape(-1)]
    return kv, compute_logits(params, cfg, h).reshape(b, j, -1), h.reshape(b, j, -1)


def draft_scan(
    dparams: Params,
    dkv: KVCache,
    batch: SpecBatch,
    st: SamplingTensors,
    controls: LogitsControls | None,
    *,
    dcfg: ModelConfig,
    num_spec: int,
    attn_impl: str,
) -> tuple[KVCache, jax.Array, jax.Array]:
    """R autoregressive single-token steps of the draft model (``lax.scan``).

    Step j feeds the row's token at position ``last_pos + j`` (the pending last token, then
    d_1, ...) and draws d_{j+1} from q_j = softmax(processed_logits(penalised draft logits)) with
    key (seed, output index + j, SALT_DRAFT); greedy rows take the argmax. Rows with
    ``num_drafts <= j`` write to the null page and attend nothing.

    Returns:
        (updated draft KV cache, drafts i32[B, R], q f32[B, R, V]).
    """
    bt = batch.md.block_tables  # i32[B, M]
    b, m = bt.shape
    z = dkv.page_size
    rows = jnp.arange(b, dtype=jnp.int32)
    last_tok = batch.tokens[batch.logits_indices[:, 0]]  # i32[B]
    is_greedy = st.temperature < SAMPLING_EPS
    all_greedy = jnp.all(is_greedy)
    v = dcfg.vocab_size
    counts0 = controls.output_counts if controls is not None else jnp.zeros((b, 0), jnp.int32)

    def step(carry, j):
        dkv, tok, counts = carry
        pos = batch.last_pos + j
        valid = j < batch.num_drafts
        page = bt[rows, jnp.clip(pos // z, 0, m - 1)]
        md = AttentionMetadata(
            positions=pos,
            slot_mapping=jnp.where(valid, page * z + pos % z, NULL_PAGE * z),
            block_tables=bt,
            kv_lens=jnp.where(valid, pos + 1, 0),
            cu_q_lens=jnp.arange(b + 1, dtype=jnp.int32),
            seq_ids=rows,
            num_decode=b,
        )
        h, dkv = forward(dparams, dcfg, tok, pos, dkv, paged_attn_fn(dcfg, md, attn_impl))
        logits = compute_logits(dparams, dcfg, h)  # f32[B, V]
        if controls is not None:
            logits = apply_penalties(logits, controls.prompt_mask, counts, st)
            ban = controls.banned & (j < batch.min_tokens_left)[:, None]
            logits = jnp.where(ban, -jnp.inf, logits)
        greedy_tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)

        def sampled(_):
            st_j = dataclasses.replace(st, steps=st.steps + j)
            x = processed_logits(logits, st_j)
            g = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(
                index_keys(st_j, 0, SALT_DRAFT)
            )
            tok = jnp.argmax(x + g, axis=-1).astype(jnp.int32)
            return jnp.where(is_greedy, greedy_tok, tok), jax.nn.softmax(x, axis=-1)

        d, q = jax.lax.cond(
            all_greedy, lambda _: (greedy_tok, jnp.zeros((b, v), jnp.float32)), sampled, None
        )
        if controls is not None:
            counts = counts + jax.nn.one_hot(d, v, dtype=jnp.int32)
        return (dkv, d, counts), (d, q)

    (dkv, _, _), (drafts, q) = jax.lax.scan(
        step, (dkv, last_tok, counts0), jnp.arange(num_spec, dtype=jnp.int32)
    )
    return dkv, drafts.T, q.transpose(1, 0, 2)


def spec_round(
    params: Params,
    kv: KVCache,
    draft_params: Params | DraftHeads | None,
    draft_kv: KVCache | None,
    batch: SpecBatch,
    st: SamplingTensors,
    controls: LogitsControls | None,
    *,
    cfg: ModelConfig,
    dcfg: ModelConfig | None,
    method: str,
    num_spec: int,
    attn_impl: str = "xla",
    num_logprobs: int = 0,
) -> tuple[KVCache, KVCache | None, SpecOutput]:
    """One draft + verify + accept round (see the module docstring for what runs here).

    Args:
        params, kv: the target's weights and page pool (donated).
        draft_params: the draft model (draft-model), the Medusa heads (heads) or None (ngram).
        draft_kv: the draft model's page pool (donated; same page ids as the target's), or None.
        batch: the round's rows, see ``SpecBatch``.
        st: sampling tensors of the B rows, ``steps`` = output index of each row's first token.
        controls: penalty inputs and banned tokens, or None when no row needs them.
        cfg, dcfg: target and draft-model architectures (static).
        method: one of ``SPECULATIVE_METHODS`` (static). num_spec: R (static).
        num_logprobs: top logprobs per emitted token (static, 0 = none).

    Returns:
        (target KV cache, draft KV cache, ``SpecOutput``).
    """
    r = num_spec
    drafts, q = batch.drafts, None
    tokens = batch.tokens
    if method == "draft-model":
        draft_kv, drafts, q = draft_scan(
            draft_params, draft_kv, batch, st, controls, dcfg=dcfg, num_spec=r, attn_impl=attn_impl
        )
        tokens = tokens.at[batch.draft_index.reshape(-1)].set(drafts.reshape(-1), mode="drop")
    kv, logits, hidden = forward_step_at(
        params, kv, tokens, batch.md, batch.logits_indices, cfg=cfg, attn_impl=attn_impl
    )
    if method == "draft-model":  # mirror: the draft's cache gets the same tokens' K/V
        _, draft_kv = forward(
            draft_params,
            dcfg,
            tokens,
            batch.md.positions,
            draft_kv,
            paged_attn_fn(dcfg, batch.md, attn_impl),
        )
    pen = logits
    if controls is not None:
        pen = penalize_positions(
            logits,
            drafts,
            st,
            controls.prompt_mask,
            controls.output_counts,
            controls.banned,
            batch.min_tokens_left,
        )
    out_tokens, n_acc = rejection_sample(pen, drafts, batch.num_drafts, q, st)
    b, j, _ = logits.shape
    lp = jax.nn.log_softmax(logits, axis=-1)  # raw logprobs, as sample()
    token_lp = jnp.take_along_axis(lp, out_tokens[..., None], axis=-1)[..., 0]
    if num_logprobs:
        top_lp, top_ids = jax.lax.top_k(lp, num_logprobs)
    else:
        top_lp, top_ids = jnp.zeros((b, j, 0), jnp.float32), jnp.zeros((b, j, 0), jnp.int32)
    if method == "heads":
        h_last = hidden[jnp.arange(b), n_acc]  # [B, D] at the position that drew the new token
        next_drafts = jnp.argmax(heads_logits(draft_params, h_last), axis=-1).astype(jnp.int32)
    else:
        next_drafts = jnp.zeros((b, 0), jnp.int32)
    return (
        kv,
        draft_kv,
        SpecOutput(out_tokens, n_acc, token_lp, top_ids.astype(jnp.int32), top_lp, next_drafts),
    )


@functools.cache
def jitted_spec_round():
    """The jitted ``spec_round`` (one per process; compilations keyed by shapes and statics)."""
    return jax.jit(
        spec_round,
        static_argnames=("cfg", "dcfg", "method", "num_spec", "attn_impl", "num_logprobs"),
        donate_argnames=("kv", "draft_kv"),
    )
