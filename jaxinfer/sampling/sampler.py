"""Device side of sampling: per-row penalties, temperature, min-p / top-k / top-p, seeded draws.

Pure JAX with static shapes, meant to run inside the jitted engine step. Semantics follow vLLM's v1
sampler (``vllm/v1/sample/sampler.py``, ``vllm/v1/sample/ops/topk_topp_sampler.py``, the min-p
logits processor in ``vllm/v1/sample/logits_processor/builtin.py`` and ``apply_penalties`` in
``vllm/model_executor/layers/utils.py``). The host side (`SamplingParams`, stop strings) is in
`jaxinfer.sampling.params`; its public names are re-exported here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.sampling.params import (
    MAX_LOGPROBS,
    SAMPLING_EPS,
    SamplingParams,
    draw_seed,
    find_stop_string,
)

__all__ = [
    "GREEDY_FLAGS",
    "MAX_LOGPROBS",
    "SAMPLING_EPS",
    "SampleOutput",
    "SamplingParams",
    "SamplingTensors",
    "MASKED",
    "apply_penalties",
    "apply_token_bitmask",
    "argmax_lowest",
    "draw_seed",
    "find_stop_string",
    "processed_logits",
    "row_keys",
    "sample",
    "sample_flags",
    "sample_greedy",
]

GREEDY_FLAGS = (False, 0, "greedy")
"""The greedy-only sampling variant's flags, the tail of its compile key
``("sample", B', False, 0, "greedy")`` (`sample_flags`, `sample_greedy`)."""


MASKED = "masked"
"""The last flag of a sampling variant that applies a token bitmask (structured outputs): the
key ``("sample", B', *flags, "masked")`` (`sample_flags`, `apply_token_bitmask`)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters of a batch of B rows, padded to a bucket size.

    Attributes:
        temperature: f32[B]; 0 = greedy (the host normalises < `SAMPLING_EPS` to 0).
        top_k: i32[B]; 0 = off.
        top_p: f32[B]; 1 = off.
        min_p: f32[B]; 0 = off.
        repetition_penalty: f32[B]; 1 = off.
        presence_penalty: f32[B]; 0 = off.
        frequency_penalty: f32[B]; 0 = off.
        seeds: u32[B] the request's seed (low 32 bits).
        steps: i32[B] index, within the request's output, of the token being sampled; the
            counter folded into the row's PRNG key (see `row_keys`).
    """

    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B]
    top_p: jax.Array  # f32[B]
    min_p: jax.Array  # f32[B]
    repetition_penalty: jax.Array  # f32[B]
    presence_penalty: jax.Array  # f32[B]
    frequency_penalty: jax.Array  # f32[B]
    seeds: jax.Array  # u32[B]
    steps: jax.Array  # i32[B]

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        steps: Sequence[int],
        pad_to: int,
    ) -> SamplingTensors:
        """Host-side (numpy) tensors for `params`, padded to B = `pad_to` rows.

        Padding rows are neutral: greedy, every filter and penalty off, seed 0, step 0.

        Args:
            params: one `SamplingParams` per live row, in row order.
            seeds: the seed of each row: its request's `seed`, or one the engine drew for it
                (`draw_seed`); reduced modulo 2**32.
            steps: for each row, how many output tokens its request already has.
            pad_to: B, the bucket size; >= len(params).

        Raises:
            ValueError: if the three sequences differ in length or do not fit in `pad_to`.
        """
        n = len(params)
        if len(seeds) != n or len(steps) != n:
            raise ValueError(
                f"from_params: got {n} params, {len(seeds)} seeds and {len(steps)} steps; "
                "expected one of each per row"
            )
        if n > pad_to:
            raise ValueError(f"from_params: {n} rows do not fit in pad_to={pad_to}")

        def col(values, neutral, dtype):
            out = np.full((pad_to,), neutral, dtype=dtype)
            out[:n] = np.asarray(list(values), dtype=dtype) if n else out[:0]
            return out

        return cls(
            temperature=col((p.temperature for p in params), 0.0, np.float32),
            top_k=col((p.top_k for p in params), 0, np.int32),
            top_p=col((p.top_p for p in params), 1.0, np.float32),
            min_p=col((p.min_p for p in params), 0.0, np.float32),
            repetition_penalty=col((p.repetition_penalty for p in params), 1.0, np.float32),
            presence_penalty=col((p.presence_penalty for p in params), 0.0, np.float32),
            frequency_penalty=col((p.frequency_penalty for p in params), 0.0, np.float32),
            seeds=col((int(s) & 0xFFFFFFFF for s in seeds), 0, np.uint32),
            steps=col((int(s) for s in steps), 0, np.int32),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """What `sample` returns for B rows.

    Attributes:
        tokens: i32[B] sampled token ids.
        logprobs: f32[B] logprob of each sampled token.
        top_ids: i32[B, n] ids of the n most likely tokens, most likely first (n = num_logprobs).
        top_logprobs: f32[B, n] their logprobs, descending.
    """

    tokens: jax.Array  # i32[B]
    logprobs: jax.Array  # f32[B]
    top_ids: jax.Array  # i32[B, n]
    top_logprobs: jax.Array  # f32[B, n]


def apply_penalties(
    logits: jax.Array, prompt_mask: jax.Array, output_counts: jax.Array, st: SamplingTensors
) -> jax.Array:
    """Repetition, frequency and presence penalties, as vLLM's ``apply_penalties``.

    For each row: a token seen in the prompt or the output has its logit divided by
    repetition_penalty when positive, multiplied by it otherwise (CTRL, Keskar et al. 2019); then
    ``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` over output tokens
    (OpenAI API semantics). Neutral values (1, 0, 0) leave the logits unchanged.

    Args:
        logits: f32[B, V].
        prompt_mask: bool[B, V] tokens present in the row's prompt.
        output_counts: i32[B, V] occurrences of each token in the row's output so far.
        st: the batch's sampling tensors.

    Returns:
        f32[B, V] penalised logits.
    """
    logits = logits.astype(jnp.float32)
    in_output = output_counts > 0  # bool[B, V]
    rep = jnp.where(prompt_mask | in_output, st.repetition_penalty[:, None], 1.0)  # f32[B, V]
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - st.frequency_penalty[:, None] * output_counts.astype(jnp.float32)
    logits = logits - st.presence_penalty[:, None] * in_output.astype(jnp.float32)
    return logits


def _sortable_keys(x: jax.Array) -> jax.Array:
    """i32 keys whose order is the float order of `x` (-0.0 and +0.0 share a key).

    A float's bits read as int32 are ordered for non-negative floats and reversed for negative
    ones, so negative bit patterns get their 31 low bits flipped: ``key(a) >= key(b)`` iff
    ``a >= b`` for non-NaN `a`, `b` (-inf is the smallest key but one).
    """
    x = jnp.where(x == 0, jnp.float32(0), x)  # -0.0 == +0.0 as floats: one key
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


_NO_CUT = np.iinfo(np.int32).min  # the smallest key: every key is >= it


def _largest_key(pred, batch: int) -> jax.Array:
    """i32[B]: per row, the largest key t with pred(t) true, found bit by bit in 32 steps.

    `pred` maps i32[B] candidate keys to bool[B] and must be monotone (true up to some t, false
    above). A row whose pred is false for every key gets `_NO_CUT` (nothing is cut). The search
    builds t + 2**31 as a u32 from the top bit down (no overflow), so it is exact in 32 steps.
    """

    def to_key(u):
        return jax.lax.bitcast_convert_type(u ^ jnp.uint32(0x80000000), jnp.int32)

    def step(i, u):
        cand = u | jnp.left_shift(jnp.uint32(1), (31 - i).astype(jnp.uint32))
        return jnp.where(pred(to_key(cand)), cand, u)

    return to_key(jax.lax.fori_loop(0, 32, step, jnp.zeros((batch,), jnp.uint32)))


def processed_logits(logits: jax.Array, st: SamplingTensors) -> jax.Array:
    """Temperature-scaled logits with the tokens min-p, top-k and top-p exclude set to -inf.

    The order is vLLM v1's: temperature, then min-p (keep p >= min_p * max p, p = softmax of the
    scaled logits), then top-k, then top-p over the distribution renormalised after top-k. Both
    top-k and top-p cut by *value*, so every token whose logit equals the boundary one is kept:
    top-k keeps all ties of the k-th largest value (as vLLM, which masks ``logits < kth``), and
    top-p keeps the smallest most-likely-first prefix whose probability sums to >= top_p plus
    any token tied with its last one. The kept set thus never depends on token ids (vLLM's
    unstable sort breaks top-p ties arbitrarily). The most likely token is always kept; top_k
    <= 0 or >= V, top_p >= 1 and min_p = 0 are off. Greedy rows (temperature 0) are scaled by 1;
    `sample` takes their argmax from the unscaled logits anyway.

    Method (no sort): each scaled logit gets an i32 key ordered as the floats (`_sortable_keys`),
    and each cut is a threshold key found by a 32-step bitwise bisection (`_largest_key`), each
    step one masked reduction over [B, V]:
      * top-k: the largest key t with ``count(key >= t) >= k``, i.e. the k-th largest value.
      * top-p: the largest key t with ``sum(p[key >= t]) >= top_p`` (p: the softmax after top-k),
        i.e. the value of the first most-likely-first group of tied tokens at which the mass
        reaches top_p, which is the prefix rule above. If rounding leaves the total mass
        below top_p, nothing is cut (as the prefix rule). The masked sums replace the former
        sorted cumulative sum; they are plain f32 reductions, so a top_p within a few ulps of a
        prefix mass may fall on the other side than a cumsum would have put it.
    Each filter is skipped (`lax.cond`) when no row of the batch uses it.

    Args:
        logits: f32[B, V] (penalties already applied).
        st: the batch's sampling tensors.

    Returns:
        f32[B, V]; softmax of it is the distribution `sample` draws from for non-greedy rows.
    """
    logits = logits.astype(jnp.float32)
    B, V = logits.shape
    neg_inf = jnp.float32(-jnp.inf)
    temp = jnp.where(st.temperature < SAMPLING_EPS, 1.0, st.temperature)  # f32[B]
    x = logits / temp[:, None]  # f32[B, V]

    # min-p, relative to the most likely token.
    def min_p(x):
        probs = jax.nn.softmax(x, axis=-1)
        p_max = jnp.max(probs, axis=-1, keepdims=True)
        return jnp.where(probs < st.min_p[:, None] * p_max, neg_inf, x)

    x = jax.lax.cond(jnp.any(st.min_p > 0), min_p, lambda x: x, x)
    keys = _sortable_keys(x)  # i32[B, V]
    no_cut = jnp.full((B,), _NO_CUT, jnp.int32)

    # top-k: the largest key t with at least k keys >= t is the k-th largest value.
    # Counted in f32 (exact below 2**24 tokens), which XLA CPU reduces faster than int32.
    k = jnp.where((st.top_k <= 0) | (st.top_k > V), V, st.top_k)  # i32[B]

    def top_k(_):
        def enough(t):
            return jnp.sum((keys >= t[:, None]).astype(jnp.float32), axis=-1) >= k

        return _largest_key(enough, B)

    thr_k = jax.lax.cond(jnp.any(k < V), top_k, lambda _: no_cut, None)  # i32[B]

    # top-p: the largest key t whose tokens at or above it hold >= top_p of the mass.
    def top_p(_):
        ps = jax.nn.softmax(jnp.where(keys >= thr_k[:, None], x, neg_inf), axis=-1)

        def enough(t):
            return jnp.sum(jnp.where(keys >= t[:, None], ps, 0.0), axis=-1) >= st.top_p

        return jnp.where(st.top_p >= 1.0, no_cut, _largest_key(enough, B))

    thr_p = jax.lax.cond(jnp.any(st.top_p < 1.0), top_p, lambda _: no_cut, None)  # i32[B]

    return jnp.where(keys >= jnp.maximum(thr_k, thr_p)[:, None], x, neg_inf)


def row_keys(st: SamplingTensors) -> jax.Array:
    """key[B]: row b's PRNG key, ``fold_in(key(seeds[b]), steps[b])``.

    A row's draw depends only on its own seed and step, never on its position in the batch or
    the other rows, so a seeded request gives the same tokens alone or in any batch.
    """
    return jax.vmap(lambda seed, step: jax.random.fold_in(jax.random.key(seed), step))(
        st.seeds, st.steps
    )


def sample(
    logits: jax.Array,
    st: SamplingTensors,
    *,
    num_logprobs: int = 0,
    logprob_logits: jax.Array | None = None,
    token_logprobs: bool = True,
) -> SampleOutput:
    """Samples one token per row.

    Non-greedy rows draw from softmax(`processed_logits`) by the Gumbel-max trick, with Gumbel
    noise from the row's own key (`row_keys`); vLLM draws the equivalent ``argmax(p / q)``,
    q ~ Exp(1). Greedy rows (temperature 0) take the argmax of `logits` (lowest id on ties).

    Returned logprobs are ``log_softmax(logits)`` of the logits given here, before temperature
    and filtering (vLLM's default ``logprobs_mode="raw_logprobs"``). vLLM computes them before
    the penalties; a caller that applies `apply_penalties` first and wants exactly that passes
    the unpenalised logits as `logprob_logits`.

    Args:
        logits: f32[B, V] (bf16 is upcast), penalties already applied.
        st: the batch's sampling tensors.
        num_logprobs: static; n, how many top logprobs to return per row (0 = none). Use the
            batch's largest `SamplingParams.logprobs` and slice per row on the host.
        logprob_logits: optional f32[B, V] to compute the returned logprobs from instead.
        token_logprobs: static; False skips the log-softmax over [B, V] when ``num_logprobs``
            is 0 (the sampled tokens' logprobs are then NaN): the engine passes False when no
            row asked for logprobs, as nothing reads them then.

    Returns:
        `SampleOutput` with tokens i32[B], logprobs f32[B], top_ids i32[B, n],
        top_logprobs f32[B, n].

    Raises:
        ValueError: if num_logprobs is negative or larger than V.
    """
    logits = logits.astype(jnp.float32)
    B, V = logits.shape
    if not 0 <= num_logprobs <= V:
        raise ValueError(f"sample: num_logprobs must be in [0, {V}], got {num_logprobs}")

    greedy_tokens = argmax_lowest(logits)  # jnp.argmax's result, faster on CPU

    def random_rows(_):
        x = processed_logits(logits, st)  # f32[B, V]
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, (V,), jnp.float32))(row_keys(st))
        random_tokens = argmax_lowest(x + gumbel)
        return jnp.where(st.temperature < SAMPLING_EPS, greedy_tokens, random_tokens)

    # An all-greedy batch (the common batch job) skips the sort and the random draws.
    all_greedy = jnp.all(st.temperature < SAMPLING_EPS)
    tokens = jax.lax.cond(all_greedy, lambda _: greedy_tokens, random_rows, None)  # i32[B]

    if num_logprobs == 0 and not token_logprobs:
        return SampleOutput(
            tokens=tokens,
            logprobs=jnp.full((B,), jnp.nan, jnp.float32),
            top_ids=jnp.zeros((B, 0), jnp.int32),
            top_logprobs=jnp.zeros((B, 0), jnp.float32),
        )
    lp_src = logits if logprob_logits is None else logprob_logits.astype(jnp.float32)
    lp = jax.nn.log_softmax(lp_src, axis=-1)  # f32[B, V]
    token_lp = jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
    if num_logprobs > 0:
        top_lp, top_ids = jax.lax.top_k(lp, num_logprobs)
    else:
        top_lp = jnp.zeros((B, 0), jnp.float32)
        top_ids = jnp.zeros((B, 0), jnp.int32)
    return SampleOutput(
        tokens=tokens,
        logprobs=token_lp,
        top_ids=top_ids.astype(jnp.int32),
        top_logprobs=top_lp,
    )


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """f32[B, V] ``logits`` with every token whose bit is clear in ``bitmask`` set to -inf.

    Args:
        logits: f32[B, V].
        bitmask: i32[B, W], W = ceil(V / 32): token t is allowed when bit ``t % 32`` (least
            significant first) of word ``t // 32`` is set (llguidance's and xgrammar's packed
            layout; an unconstrained row is all ones, -1, and keeps its logits bit for bit).

    Raises:
        ValueError: ``bitmask`` is not [B, ceil(V / 32)].
    """
    B, V = logits.shape
    W = -(-V // 32)
    if bitmask.shape != (B, W):
        raise ValueError(f"apply_token_bitmask: bitmask {bitmask.shape} != ({B}, {W})")
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = jnp.right_shift(bitmask[:, :, None], shifts) & 1  # i32[B, W, 32]
    allowed = bits.reshape(B, W * 32)[:, :V] != 0  # bool[B, V]
    return jnp.where(allowed, logits, -jnp.inf)


def sample_flags(
    params: Iterable[SamplingParams], controls: bool, num_logprobs: int, masked: bool = False
) -> tuple:
    """The flags of a step's sampling variant: the tail of its key ``("sample", B', *flags)``.

    `GREEDY_FLAGS` when every row is greedy (`SamplingParams.greedy`: temperature <
    `SAMPLING_EPS`, normalised to 0, which `sample` also takes as greedy), no row has logits
    controls and none asks for logprobs: the step then runs `sample_greedy`, whose tokens equal
    `sample`'s for such rows. Otherwise ``(controls, num_logprobs)``: `sample` (through
    ``step.sample_step``).

    Args:
        params: the sampling parameters of the step's live rows (padding rows are greedy).
        controls: whether the step passes logits controls (penalties, banned tokens).
        num_logprobs: the step's static number of top logprobs (0: no row asked for logprobs).
        masked: some row is constrained (structured outputs): `MASKED` is appended, and the
            step applies a token bitmask before sampling (`apply_token_bitmask`). A step without
            constrained rows compiles and runs without it.
    """
    if not controls and num_logprobs == 0 and all(p.greedy for p in params):
        flags = GREEDY_FLAGS
    else:
        flags = (bool(controls), int(num_logprobs))
    return (*flags, MASKED) if masked else flags


def argmax_lowest(x: jax.Array) -> jax.Array:
    """i32[B]: per row of f32[B, V] `x`, ``jnp.argmax``'s index (the lowest id among the largest
    values; the first NaN when the row has one), by two plain reductions: the row maximum, then
    the smallest index holding it (or holding a NaN, whose maximum is NaN). XLA on CPU runs
    these vectorised, several times faster than ``argmax``'s (value, index) pair reduction
    (scripts/bench_sample_step.py; docs/performance.md)."""
    m = jnp.max(x, axis=-1, keepdims=True)  # NaN when the row has a NaN
    hit = (x == m) | jnp.isnan(x)  # a NaN only occurs in a row whose m is NaN
    ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, ids, x.shape[-1]), axis=-1)


def sample_greedy(logits: jax.Array) -> SampleOutput:
    """`sample` for a batch whose rows are all greedy, with no logprobs asked: argmax only.

    The tokens are `sample`'s for greedy rows (`argmax_lowest` of `logits`: ``argmax``, lowest
    id on ties). The sampled tokens' logprobs are not computed (no log-softmax over [B, V]):
    nothing reads them when no row asked for logprobs (`jaxinfer.engine.core` reads ``logprobs``
    only
    for rows with ``SamplingParams.logprobs`` set), so they are NaN; the top-n arrays are empty.

    Args:
        logits: f32[B, V] (bf16 is upcast), no penalties or banned tokens to apply.

    Returns:
        `SampleOutput` with tokens i32[B], logprobs f32[B] all NaN, top_ids i32[B, 0],
        top_logprobs f32[B, 0].
    """
    B = logits.shape[0]
    return SampleOutput(
        tokens=argmax_lowest(logits.astype(jnp.float32)),
        logprobs=jnp.full((B,), jnp.nan, jnp.float32),
        top_ids=jnp.zeros((B, 0), jnp.int32),
        top_logprobs=jnp.zeros((B, 0), jnp.float32),
    )
