"""Exact acceptance of R draft tokens against the target's R+1 distributions (device side).

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling"): draft token x_j, drawn from the draft distribution q_j, is accepted with probability
min(1, p_j(x_j) / q_j(x_j)); at the first rejection a token is drawn from
norm(max(0, p_j - q_j)); when all drafts are accepted a bonus token is drawn from p_R. The emitted
tokens are then distributed exactly as the target's own samples. A deterministic drafter (n-gram,
Medusa argmax) has q_j = one_hot(x_j). Greedy rows (temperature 0) accept while the draft equals
the target's argmax, which reproduces greedy decoding token for token.

p and q are both ``softmax(processed_logits(...))`` of the penalised logits, i.e. the request's
temperature, min-p, top-k, top-p and penalties apply to both alike. Every random draw of row b
deciding output index i uses a key from (seed_b, i) only (``index_keys``), so results do not
depend on the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.sampling.sampler import (
    SAMPLING_EPS,
    SamplingTensors,
    apply_penalties,
    processed_logits,
)

SALT_ACCEPT = 1  # the uniform of the accept test
SALT_RESIDUAL = 2  # the draw from the residual (or, for the bonus token, from p)
SALT_DRAFT = 3  # the draft model's own draw


def index_keys(st: SamplingTensors, offset: jax.Array, salt: int) -> jax.Array:
    """key[B]: ``fold_in(fold_in(key(seed_b), steps_b + offset_b), salt)``.

    offset: i32[B] or i32[] — output index of the decided token relative to ``st.steps``.
    """
    offset = jnp.broadcast_to(jnp.asarray(offset, jnp.int32), st.steps.shape)
    return jax.vmap(
        lambda s, i: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), i), salt)
    )(st.seeds, st.steps + offset)


def expand_rows(st: SamplingTensors, j: int) -> SamplingTensors:
    """Row b of ``st`` repeated for its j positions (row-major, b * j + pos); steps + pos."""
    rep = jax.tree.map(lambda x: jnp.repeat(x, j, axis=0), st)
    pos = jnp.tile(jnp.arange(j, dtype=jnp.int32), st.steps.shape[0])
    return dataclasses.replace(rep, steps=rep.steps + pos)


def penalize_positions(
    logits: jax.Array,  # f32[B, J, V]
    drafts: jax.Array,  # i32[B, R], R >= J - 1
    st: SamplingTensors,
    prompt_mask: jax.Array,  # bool[B, V]
    output_counts: jax.Array,  # i32[B, V]
    banned: jax.Array,  # bool[B, V]
    min_tokens_left: jax.Array,  # i32[B]
) -> jax.Array:
    """Penalties and banned tokens at each of J positions of a row.

    Position j follows drafts d_1..d_j, so its output counts include them; stop tokens are banned
    at j while ``j < min_tokens_left``. Returns f32[B, J, V].
    """
    b, j, v = logits.shape
    oh = jax.nn.one_hot(drafts[:, : j - 1], v, dtype=jnp.int32)  # i32[B, J-1, V]
    prefix = jnp.concatenate([jnp.zeros((b, 1, v), jnp.int32), jnp.cumsum(oh, axis=1)], axis=1)
    counts = (output_counts[:, None] + prefix).reshape(b * j, v)
    out = apply_penalties(
        logits.reshape(b * j, v), jnp.repeat(prompt_mask, j, axis=0), counts, expand_rows(st, j)
    ).reshape(b, j, v)
    ban = banned[:, None, :] & (jnp.arange(j)[None, :, None] < min_tokens_left[:, None, None])
    return jnp.where(ban, -jnp.inf, out)


def rejection_sample(
    target_logits: jax.Array,  # f32[B, R+1, V]
    drafts: jax.Array,  # i32[B, R]
    num_drafts: jax.Array,  # i32[B]
    draft_probs: jax.Array | None,  # f32[B, R, V] or None (deterministic drafts)
    st: SamplingTensors,
    *,
    residual_from_p: bool = False,
    accept_always: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Accepts a prefix of each row's drafts and draws the token after it.

    Args:
        target_logits: f32[B, R+1, V] the target's logits at [last token, d_1..d_R], penalties
            and banned tokens already applied (``penalize_positions``).
        drafts: i32[B, R] draft tokens; only the first ``num_drafts[b]`` of row b count.
        num_drafts: i32[B] in [0, R]; 0 = plain sampling of one token from p_0.
        draft_probs: f32[B, R, V] q_j (softmax of the drafter's processed logits), or None when
            the drafter is deterministic (q_j = one_hot(d_j)).
        st: per-row sampling tensors; ``steps`` = output index of the row's first new token.
        residual_from_p, accept_always: deliberately WRONG rules, for the statistical test only
            (resample from p instead of norm(max(0, p - q)); accept every draft).

    Returns:
        (tokens i32[B, R+1], num_accepted i32[B]): row b emits ``tokens[b, :num_accepted[b] + 1]``
        (accepted drafts, then the correction or bonus token).
    """
    b, j, v = target_logits.shape
    r = j - 1
    pos = jnp.arange(r, dtype=jnp.int32)[None, :]
    valid = pos < num_drafts[:, None]  # bool[B, R]
    greedy_tok = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # i32[B, J]
    n_greedy = jnp.sum(jnp.cumprod(valid & (drafts == greedy_tok[:, :r]), axis=1), axis=1)
    padded = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)  # i32[B, J]

    def random_rows(_):
        x = processed_logits(target_logits.reshape(b * j, v), expand_rows(st, j)).reshape(b, j, v)
        p = jax.nn.softmax(x, axis=-1)  # f32[B, J, V]
        q = jax.nn.one_hot(drafts, v, dtype=jnp.float32) if draft_probs is None else draft_probs
        p_d = jnp.take_along_axis(p[:, :r], drafts[..., None], axis=-1)[..., 0]  # f32[B, R]
        q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
        u = jax.vmap(
            lambda o: jax.vmap(jax.random.uniform)(index_keys(st, o, SALT_ACCEPT)), out_axes=1
        )(jnp.arange(r, dtype=jnp.int32))  # f32[B, R]
        accept = (u * q_d < p_d) | accept_always
        n = jnp.sum(jnp.cumprod(valid & accept, axis=1), axis=1).astype(jnp.int32)  # i32[B]
        rows = jnp.arange(b)
        p_n = p[rows, n]  # f32[B, V]
        q_n = q[rows, jnp.minimum(n, r - 1)] if r > 0 else jnp.zeros_like(p_n)
        resid = p_n if residual_from_p else jnp.maximum(p_n - q_n, 0.0)
        # After all drafts (n == num_drafts) the bonus comes from p; an all-zero residual
        # (p == q to rounding, rejection of probability ~0) falls back to p as well.
        use_p = (n >= num_drafts) | (jnp.sum(resid, axis=-1) <= 0)
        dist = jnp.where(use_p[:, None], p_n, resid)
        g = jax.vmap(lambda k: jax.random.gumbel(k, (v,), jnp.float32))(
            index_keys(st, n, SALT_RESIDUAL)
        )
        corr = jnp.argmax(jnp.log(dist) + g, axis=-1).astype(jnp.int32)  # i32[B]
        toks = jnp.where(jnp.arange(j)[None, :] < n[:, None], padded, corr[:, None])
        return toks, n

    def greedy_rows(_):
        return greedy_tok, n_greedy.astype(jnp.int32)

    is_greedy = st.temperature < SAMPLING_EPS
    all_greedy = jnp.all(is_greedy)

    def mixed(_):
        toks, n = random_rows(None)
        return (
            jnp.where(is_greedy[:, None], greedy_tok, toks),
            jnp.where(is_greedy, n_greedy.astype(jnp.int32), n),
        )

    return jax.lax.cond(all_greedy, greedy_rows, mixed, None)
