"""Prompt logprobs (vLLM's ``SamplingParams.prompt_logprobs``), computed inside the engine's step.

The forward of a step already produces a hidden state for every token of the ragged batch; the
usual step turns only each row's last one into logits. When some row of a step wants prompt
logprobs, the engine runs ``forward_step_prompt_logprobs`` instead: the same forward, the same
sampled-row logits, plus, for every token slot t of the step, the logprob of ``targets[t]`` (the
next prompt token, known on the host) and the top-K tokens of the raw distribution after token t.
Logits are made tile by tile (``TILE`` tokens at a time), so the device never holds more than
[TILE, V] of them and only [T] / [T, K] arrays come back to the host.

Host side: ``plan_step`` picks, for the rows that want prompt logprobs, the slots whose position j
is before the prompt's last token and sets ``targets[slot] = prompt_ids[j + 1]``; ``record``
appends each result to the request's list at prompt index j + 1 unless that index is already
there (a prompt recomputed after a preemption adds nothing twice, and chunked prefill adds each
chunk's positions in order). Positions a prefix-cache hit would skip have no hidden states, so
the scheduler does not give such a request cached pages (as vLLM v1).

Output shape (``RequestOutput.prompt_logprobs``): a list aligned with ``prompt_token_ids``:
``None`` at index 0 (no distribution precedes the first token), then one ``TokenLogprob`` per
prompt token: ``token_id`` the prompt token, ``logprob`` its log-probability given the tokens
before it, ``top`` the k most likely (token id, logprob) pairs, best first (k = the request's
``prompt_logprobs``; the prompt token is not added to ``top`` when it is not among them, unlike
vLLM's dict, which always holds it: its value is ``logprob``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.engine.step import StepBatch, resolve_tokens
from jaxinfer.errors import RequestError
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.forward import compute_logits, forward
from jaxinfer.models.kv_cache import KVCache
from jaxinfer.models.paged_attention import paged_attn_fn
from jaxinfer.models.params import Params
from jaxinfer.outputs import TokenLogprob
from jaxinfer.sampling.sampler import MAX_LOGPROBS, SamplingParams

TILE = 512
"""Token slots turned into logits at once (bounds the device's [TILE, V] logits)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobsOut:
    """Per token slot t of a step: the distribution after token t.

    Attributes:
        logprobs: f32[T] log-probability of ``targets[t]``.
        top_ids: i32[T, K] the K most likely next tokens, best first.
        top_logprobs: f32[T, K] their log-probabilities.
    """

    logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def token_logprobs(
    params: Params, cfg: ModelConfig, hidden: jax.Array, targets: jax.Array, num_top: int
) -> PromptLogprobsOut:
    """``log_softmax`` of the logits of hidden states [T, D] (``model.compute_logits``, the raw
    distribution), read at i32[T] ``targets``, with the top ``num_top`` (static, >= 1); computed
    ``TILE`` rows at a time."""
    t = hidden.shape[0]
    tile = min(TILE, t)
    pad = -t % tile
    h = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, tile, hidden.shape[-1])
    tg = jnp.pad(targets, (0, pad)).reshape(-1, tile)

    def one(args):
        hs, ts = args
        lp = jax.nn.log_softmax(compute_logits(params, cfg, hs), axis=-1)  # f32[tile, V]
        top_lp, top_ids = jax.lax.top_k(lp, num_top)
        return jnp.take_along_axis(lp, ts[:, None], axis=1)[:, 0], top_ids, top_lp

    lps, ids, tops = jax.lax.map(one, (h, tg))
    return PromptLogprobsOut(
        lps.reshape(-1)[:t], ids.reshape(-1, num_top)[:t], tops.reshape(-1, num_top)[:t]
    )


def forward_step_prompt_logprobs(
    params: Params,
    kv: KVCache,
    batch: StepBatch,
    prev_tokens: jax.Array | None,
    targets: jax.Array,
    *,
    cfg: ModelConfig,
    attn_impl: str = "xla",
    num_top: int,
) -> tuple[KVCache, jax.Array, PromptLogprobsOut]:
    """``step.forward_step`` (not batch-invariant) plus ``token_logprobs`` of every token slot.

    Args:
        params, kv, batch, prev_tokens, cfg, attn_impl: as ``step.forward_step``.
        targets: i32[T] the token whose logprob is read after each slot (any valid id where
            nothing is wanted: those results are not read).
        num_top: K (static), the top tokens returned per slot.

    Returns:
        (updated KV cache, logits f32[B, V] of each row's last token, ``PromptLogprobsOut``).
    """
    tokens = resolve_tokens(batch.tokens, prev_tokens)
    hidden, kv = forward(
        params, cfg, tokens, batch.md.positions, kv, paged_attn_fn(cfg, batch.md, attn_impl)
    )
    logits = compute_logits(params, cfg, hidden[batch.logits_indices])
    return kv, logits, token_logprobs(params, cfg, hidden, targets, num_top)


@functools.cache
def jitted_forward_step_prompt_logprobs(out_shardings=None):
    """The jitted ``forward_step_prompt_logprobs``; under a mesh ``out_shardings`` is
    ``sharding.step_out_shardings``'s pair (the prompt-logprob arrays are replicated like the
    logits)."""
    kw = dict(static_argnames=("cfg", "attn_impl", "num_top"), donate_argnames=("kv",))
    if out_shardings is not None:
        kv_sharding, replicated = out_shardings
        kw["out_shardings"] = (kv_sharding, replicated, replicated)
    return jax.jit(forward_step_prompt_logprobs, **kw)


def num_top(vocab_size: int) -> int:
    """K computed on device whenever a step wants prompt logprobs (one compilation per bucket,
    whatever k the requests ask): ``min(MAX_LOGPROBS, V)``."""
    return min(MAX_LOGPROBS, vocab_size)


def check_request(
    params: SamplingParams,
    vocab_size: int,
    refused_by: str | None,
    prompt_len: int | None = None,
) -> None:
    """Raises RequestError when this engine cannot give ``params.prompt_logprobs``: above
    ``min(MAX_LOGPROBS, vocab_size)``, ``prompt_logprobs_from`` not inside a prompt of
    ``prompt_len`` tokens, or an engine that computes none (``refused_by``, what keeps it from
    them: "batch_invariant=True", whose forward makes logits of the last tokens only, or
    "speculative decoding"; None when it can: ``EngineCore.capabilities.prompt_logprobs``)."""
    k = params.prompt_logprobs
    if k is None:
        return
    if prompt_len is not None and params.prompt_logprobs_from >= prompt_len:
        raise RequestError(
            f"prompt_logprobs_from={params.prompt_logprobs_from} must be < the "
            f"prompt's {prompt_len} tokens"
        )
    if k > num_top(vocab_size):
        raise RequestError(
            f"prompt_logprobs={k} > {MAX_LOGPROBS} or the vocabulary size {vocab_size}"
        )
    if refused_by is not None:
        raise RequestError(f"prompt_logprobs is not supported with {refused_by}")


@dataclasses.dataclass
class StepPlan:
    """The host side of one step's prompt logprobs.

    Attributes:
        targets: i32[T] next prompt token of each wanted slot (0 elsewhere).
        entries: (sequence, slot, prompt index j + 1) of each wanted slot, in slot order.
    """

    targets: np.ndarray
    entries: list[tuple[object, int, int]]


def plan_step(rows, logits_indices: np.ndarray, num_slots: int) -> StepPlan | None:
    """The prompt-logprob slots of a step, or None when no row wants any.

    Args:
        rows: (``ScheduledRow``, padded row index r) of each scheduled row, before the step
            advances ``num_computed``.
        logits_indices: i32[B'] the step's ``StepBatch.logits_indices`` (row r's last slot).
        num_slots: T, the step's token slots.
    """
    targets = np.zeros(num_slots, np.int32)
    entries = []
    for row, r in rows:
        seq = row.seq
        if seq.params.prompt_logprobs is None:
            continue
        start, first_slot = seq.num_computed, int(logits_indices[r]) - row.num_new + 1
        first = max(start, seq.params.prompt_logprobs_from - 1)  # position j scores token j + 1
        for j in range(first, min(start + row.num_new, len(seq.prompt_ids) - 1)):
            slot = first_slot + j - start
            targets[slot] = seq.prompt_ids[j + 1]
            entries.append((seq, slot, j + 1))
    return StepPlan(targets, entries) if entries else None


def record(plan: StepPlan, out: PromptLogprobsOut, list_of) -> None:
    """Appends a collected step's prompt logprobs (host arrays in ``out``) to each request's
    list (``list_of(request_id)``: the list, starting ``[None]``, or None for a request that
    finished meanwhile, whose entries are skipped); indices already there are skipped.

    Raises:
        RuntimeError: an entry past the list's end (a position was skipped: a bug).
    """
    for seq, slot, i in plan.entries:
        lst = list_of(seq.request_id)
        if lst is None or i < len(lst):
            continue
        if i > len(lst):
            raise RuntimeError(
                f"prompt logprobs of {seq.request_id!r}: index {i} computed before index {len(lst)}"
            )
        k = seq.params.prompt_logprobs
        lst.append(
            TokenLogprob(
                int(plan.targets[slot]),
                float(out.logprobs[slot]),
                [
                    (int(a), float(b))
                    for a, b in zip(out.top_ids[slot, :k], out.top_logprobs[slot, :k], strict=True)
                ],
            )
        )
