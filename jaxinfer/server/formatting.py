"""Response pieces in OpenAI's shapes: logprobs (completions and chat), usage, SSE lines.

Token strings of logprobs are the text each token adds after the tokens before it (decoded in a
window of the preceding ids, special tokens shown), as vLLM's detokenized logprob tokens; so the
completion ``tokens`` add up to the text. ``-inf`` logprobs are sent as -9999.0, as vLLM does
(JSON has no infinity).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

from jaxinfer.outputs import RequestOutput, TokenLogprob

_WINDOW = 4  # preceding ids decoded with a token to get its text (spaces, byte runs)
NEG_INF_LOGPROB = -9999.0


def sse(obj) -> str:
    """One server-sent event carrying ``obj`` as JSON (``data: ...`` and a blank line)."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _lp(x: float) -> float:
    return x if math.isfinite(x) else NEG_INF_LOGPROB


def token_text(tok, context: Sequence[int], token_id: int, skip_special: bool = False) -> str:
    """The text ``token_id`` adds after ``context`` (its last few ids are decoded with it)."""
    if tok is None or not getattr(tok, "has_text", True):
        return f"token_id:{token_id}"
    win = list(context[-_WINDOW:])
    before = tok.decode(win, skip_special_tokens=skip_special) if win else ""
    after = tok.decode(win + [int(token_id)], skip_special_tokens=skip_special)
    if win and after.startswith(before):
        return after[len(before) :]
    return tok.decode([int(token_id)], skip_special_tokens=skip_special)


def echo_logprobs(tok, prompt_ids: list[int], plps: Sequence[TokenLogprob | None]) -> dict:
    """The completions ``logprobs`` object of an echoed prompt (``RequestOutput.prompt_logprobs``,
    None first): the first token has no logprob (null, as vLLM), the token strings are the text
    each prompt token adds (special tokens as nothing, so they add up to the prompt's text)."""
    tokens, token_lps, tops, offsets, off = [], [], [], [], 0
    for i, (tid, lp) in enumerate(zip(prompt_ids, plps, strict=True)):
        text = token_text(tok, prompt_ids[:i], tid, skip_special=True)
        tokens.append(text)
        offsets.append(off)
        off += len(text)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        top = {token_text(tok, prompt_ids[:i], t, skip_special=True): _lp(v) for t, v in lp.top}
        top.setdefault(text, _lp(lp.logprob))
        token_lps.append(_lp(lp.logprob))
        tops.append(top)
    return {
        "text_offset": offsets,
        "token_logprobs": token_lps,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def join_logprobs(a: dict, b: dict) -> dict:
    """Two completions ``logprobs`` objects one after the other."""
    return {k: a[k] + b[k] for k in ("text_offset", "token_logprobs", "tokens", "top_logprobs")}


def prompt_logprobs(tok, prompt_ids: list[int], plps) -> list | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token None (the first) or
    ``{token_id: {"logprob", "decoded_token"}}`` for the token and the top k."""
    if plps is None:
        return None
    out = []
    for i, lp in enumerate(plps):
        if lp is None:
            out.append(None)
            continue
        ctx = prompt_ids[:i]
        d = {
            str(t): {"logprob": _lp(v), "decoded_token": token_text(tok, ctx, t)} for t, v in lp.top
        }
        d.setdefault(
            str(lp.token_id),
            {"logprob": _lp(lp.logprob), "decoded_token": token_text(tok, ctx, lp.token_id)},
        )
        out.append(d)
    return out


def _entries(tok, context: list[int], lps: Sequence[TokenLogprob]):
    """(token text, logprob, [(alt text, alt logprob)]) per token, contexts advancing."""
    ctx = list(context[-_WINDOW:])
    for lp in lps:
        text = token_text(tok, ctx, lp.token_id)
        alts = [(token_text(tok, ctx, t), _lp(v)) for t, v in lp.top]
        yield text, _lp(lp.logprob), alts
        ctx = (ctx + [lp.token_id])[-_WINDOW:]


def completion_logprobs(
    tok, context: list[int], lps: Sequence[TokenLogprob], text_offset: int
) -> tuple[dict, int]:
    """The completions ``logprobs`` object of ``lps`` (tokens after ``context``), with offsets
    from ``text_offset``; returns it and the offset after its last token. ``top_logprobs`` holds
    the top-n alternatives and the sampled token (so n or n + 1 entries, as vLLM)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for text, value, alts in _entries(tok, context, lps):
        tokens.append(text)
        token_lps.append(value)
        top = dict(alts)
        top.setdefault(text, value)
        tops.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return (
        {
            "text_offset": offsets,
            "token_logprobs": token_lps,
            "tokens": tokens,
            "top_logprobs": tops,
        },
        text_offset,
    )


def chat_logprobs(tok, context: list[int], lps: Sequence[TokenLogprob]) -> dict:
    """The chat ``logprobs`` object ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""

    def item(text, value):
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**item(text, value), "top_logprobs": [item(t, v) for t, v in alts]}
            for text, value, alts in _entries(tok, context, lps)
        ]
    }


def usage(prompt_outputs: Sequence[RequestOutput], all_outputs: Sequence[RequestOutput]) -> dict:
    """OpenAI usage: prompt tokens once per prompt (``prompt_outputs``: one output of each),
    completion tokens of every choice, cached prompt tokens as
    ``prompt_tokens_details.cached_tokens``."""
    prompt = sum(o.metrics.prompt_tokens for o in prompt_outputs)
    completion = sum(o.metrics.completion_tokens for o in all_outputs)
    cached = sum(o.metrics.num_cached_tokens for o in prompt_outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
