"""Scoring with the engine: ``LLM.score`` (lm-evaluation-harness's ``loglikelihood``) and
``LLM.perplexity`` (its ``loglikelihood_rolling``), batched as prompt-logprob requests.

Each scored sequence runs as one engine request: prompt = context + continuation,
``SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)`` (the one sampled token is
dropped); the continuation's logprobs are read from ``RequestOutput.prompt_logprobs`` and a
continuation is greedy when every token of it is the top-1 token of its distribution (lm-eval:
``(logits.argmax(-1) == cont_toks).all()``; ties go to the lowest id in both). The requests share
the engine's continuous batch, chunked prefill and KV pages; as prompt-logprob requests they do
not read the prefix cache (a cached prefix has no logits).

Tokenization follows lm-eval's ``HFLM`` (lm_eval/api/model.py ``TemplateLM._encode_pair`` and
``loglikelihood``, version 0.4.13): trailing whitespace of the context moves to the front of the
continuation; ``whole = encode(context + continuation)``, ``context_ids = encode(context)``,
``continuation_ids = whole[len(context_ids):]`` (``encode`` with the tokenizer's special tokens,
so BOS first where the tokenizer adds one); an empty context becomes ``[prefix]`` (BOS, else the
first EOS id) with ``continuation_ids = encode(continuation, add_special_tokens=False)`` (or, when
that starts with the prefix token, its first token as context). Token-id pairs are used as given.

Length limit: the engine's prompts are shorter than ``max_model_len`` (it samples one token), so
context + continuation may hold at most ``max_model_len - 1`` tokens; lm-eval's HFLM instead
left-truncates the context to fit, which a caller can do before calling ``score``.

Rolling windows (``rolling_windows``) are lm-eval's ``get_rolling_token_windows`` +
``make_disjoint_window`` with ``max_seq_len = max_model_len - 2`` (a window's context +
continuation is then ``max_model_len - 1`` tokens) and ``context_len = max_seq_len - stride + 1``
(``stride`` None: ``max_seq_len``, lm-eval's ``context_len=1``): every token is scored exactly
once; the first window conditions on the prefix token alone, each later one on up to
``max_seq_len + 1 - (tokens it scores)`` tokens before it. ``perplexity`` encodes a text with
``add_special_tokens=False`` (the text's own tokens: lm-eval 0.4.13's ``tok_encode`` default also
puts a tokenizer's BOS into the scored tokens).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jaxinfer.errors import RequestError
from jaxinfer.sampling.sampler import SamplingParams

SCORE_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)


@dataclasses.dataclass
class ScoreResult:
    """One (context, continuation) pair's score (lm-eval's ``(logprob, is_greedy)``).

    Attributes:
        logprob: sum of the continuation tokens' logprobs given the context (None on error).
        num_tokens: continuation tokens scored (0 on error).
        is_greedy: every continuation token is the most likely one given what precedes it.
        token_logprobs: each continuation token's logprob, in order.
        context_ids, continuation_ids: the token ids scored (after tokenization).
        error: why this pair could not be scored (the other fields are then empty), else None.
    """

    logprob: float | None
    num_tokens: int
    is_greedy: bool | None
    token_logprobs: list[float] | None = None
    context_ids: list[int] | None = None
    continuation_ids: list[int] | None = None
    error: str | None = None


@dataclasses.dataclass
class PerplexityResult:
    """One text's rolling log-likelihood (lm-eval's ``loglikelihood_rolling``).

    Attributes:
        logprob: total logprob of the text's tokens (None on error).
        num_tokens: tokens scored, each once (= the text's token count).
        perplexity: ``exp(-logprob / num_tokens)``.
        num_windows: windows (engine requests) the text was split into.
        error: why this text could not be scored, else None.
    """

    logprob: float | None
    num_tokens: int
    perplexity: float | None
    num_windows: int = 0
    error: str | None = None


def prefix_token(tokenizer) -> int:
    """lm-eval's ``prefix_token_id``: BOS, else the first EOS id. Raises RequestError when the
    tokenizer has neither."""
    if tokenizer.bos_id is not None:
        return tokenizer.bos_id
    if tokenizer.eos_ids:
        return tokenizer.eos_ids[0]
    raise RequestError("the tokenizer has no BOS or EOS id to condition the first token on")


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) of a text pair, as lm-eval's HFLM (module docstring)."""
    if context == "":
        cont = tokenizer.encode(continuation, add_special_tokens=False)
        pre = prefix_token(tokenizer)
        if cont and cont[0] == pre:
            return cont[:1], cont[1:]
        return [pre], cont
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces > 0:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole = tokenizer.encode(context + continuation)
    ctx = tokenizer.encode(context)
    return ctx, whole[len(ctx) :]


def rolling_windows(
    tokens: Sequence[int], prefix: int, max_seq_len: int, stride: int | None = None
) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) windows scoring every token of ``tokens`` exactly once
    (lm-eval's ``get_rolling_token_windows`` + ``make_disjoint_window``). ``stride``: tokens
    scored per window after the first, in [1, max_seq_len] (None = max_seq_len). Raises
    ValueError for a stride out of range."""
    stride = max_seq_len if stride is None else stride
    if not 1 <= stride <= max_seq_len:
        raise ValueError(f"stride must be in [1, {max_seq_len}], got {stride}")
    tokens = list(tokens)
    out: list[tuple[list[int], list[int]]] = []
    if not tokens:
        return out
    first = min(max_seq_len, len(tokens))
    out.append(([prefix], tokens[:first]))
    done = first
    while done < len(tokens):
        n = min(len(tokens) - done, stride)
        end = done + n
        ctx = tokens[max(0, end - max_seq_len - 1) : end - 1]
        out.append((ctx[: len(ctx) - (n - 1)], tokens[end - n : end]))
        done = end
    return out


def _as_ids(x, what: str) -> list[int] | None:
    if (
        isinstance(x, Sequence)
        and not isinstance(x, str)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
    ):
        return [int(t) for t in x]
    return None


def _prepare_pair(llm, pair) -> tuple[list[int], list[int]]:
    """Token ids of one pair; raises RequestError naming what is wrong."""
    if not isinstance(pair, Sequence) or isinstance(pair, str) or len(pair) != 2:
        raise RequestError("a pair must be (context, continuation)")
    context, continuation = pair
    if isinstance(context, str) and isinstance(continuation, str):
        if llm.tokenizer is None:
            raise RequestError("text pairs need a tokenizer (this model has none): give token ids")
        ctx, cont = encode_pair(llm.tokenizer, context, continuation)
    else:
        ctx, cont = _as_ids(context, "context"), _as_ids(continuation, "continuation")
        if ctx is None or cont is None:
            raise RequestError(
                "context and continuation must both be strings or both be lists of token ids"
            )
    if not ctx:
        raise RequestError(
            "context has zero tokens (nothing to condition the first "
            "continuation token on; give a BOS id)"
        )
    if not cont:
        raise RequestError("continuation has zero tokens")
    limit = llm.engine.ecfg.max_model_len - 1
    if len(ctx) + len(cont) > limit:
        raise RequestError(
            f"context + continuation has {len(ctx) + len(cont)} tokens ({len(ctx)} "
            f"+ {len(cont)}); scoring takes at most max_model_len - 1 = {limit}"
        )
    return ctx, cont


def _run(llm, seqs: list[tuple[list[int], list[int]]]) -> list[tuple[list[float], bool] | str]:
    """Scores (context, continuation) id pairs through the engine: per pair (the continuation's
    token logprobs, greedy) or the request's error."""
    n = llm.engine_loop.next_id()
    ids = [f"score-{n}-{i}" for i in range(len(seqs))]
    done = {}
    # Logprobs from the continuation's first token: the context's full pages may then be read
    # from the prefix cache (pairs sharing a context compute it once).
    params = [dataclasses.replace(SCORE_PARAMS, prompt_logprobs_from=len(c)) for c, _ in seqs]
    for out in llm.generate_stream([c + x for c, x in seqs], params, request_ids=ids):
        if out.finished:
            done[out.request_id] = out
    results = []
    for rid, (ctx, _) in zip(ids, seqs, strict=True):
        out = done[rid]
        if out.error is not None:
            results.append(out.error)
            continue
        entries = out.prompt_logprobs[len(ctx) :]
        results.append(
            ([e.logprob for e in entries], all(e.top[0][0] == e.token_id for e in entries))
        )
    return results


def score(llm, pairs) -> list[ScoreResult]:
    """``LLM.score``: see its docstring."""
    prepared: list[tuple[list[int], list[int]] | str] = []
    for pair in pairs:
        try:
            prepared.append(_prepare_pair(llm, pair))
        except RequestError as e:
            prepared.append(str(e))
    ok = [p for p in prepared if not isinstance(p, str)]
    runs = iter(_run(llm, ok))
    results = []
    for p in prepared:
        r = p if isinstance(p, str) else next(runs)
        if isinstance(r, str):
            results.append(ScoreResult(None, 0, None, error=r))
        else:
            lps, greedy = r
            results.append(ScoreResult(float(math.fsum(lps)), len(lps), greedy, lps, p[0], p[1]))
    return results


def perplexity(llm, texts, stride: int | None = None) -> list[PerplexityResult]:
    """``LLM.perplexity``: see its docstring."""
    max_seq_len = llm.engine.ecfg.max_model_len - 2
    if max_seq_len < 1:
        raise ValueError("perplexity needs max_model_len >= 3")
    if stride is not None and (
        not isinstance(stride, int) or isinstance(stride, bool) or not 1 <= stride <= max_seq_len
    ):
        raise ValueError(
            f"stride must be an integer in [1, {max_seq_len}] (max_model_len - 2) "
            f"or None, got {stride!r}"
        )
    plans: list[list[tuple[list[int], list[int]]] | str] = []
    for text in texts:
        try:
            if isinstance(text, str):
                if llm.tokenizer is None:
                    raise RequestError("text needs a tokenizer (this model has none): give ids")
                toks = llm.tokenizer.encode(text, add_special_tokens=False)
                pre = prefix_token(llm.tokenizer)
            elif (toks := _as_ids(text, "text")) is not None:
                pre = prefix_token(llm.engine_loop.tokenizer)
            else:
                raise RequestError("a text must be a string or a list of token ids")
            if not toks:
                raise RequestError("text has zero tokens")
            plans.append(rolling_windows(toks, pre, max_seq_len, stride))
        except RequestError as e:
            plans.append(str(e))
    flat = [w for p in plans if not isinstance(p, str) for w in p]
    runs = iter(_run(llm, flat))
    results = []
    for p in plans:
        if isinstance(p, str):
            results.append(PerplexityResult(None, 0, None, error=p))
            continue
        got = [next(runs) for _ in p]
        errs = [g for g in got if isinstance(g, str)]
        if errs:
            results.append(PerplexityResult(None, 0, None, len(p), error=errs[0]))
            continue
        lps = [x for g in got for x in g[0]]
        total = float(math.fsum(lps))
        results.append(PerplexityResult(total, len(lps), math.exp(-total / len(lps)), len(p)))
    return results
