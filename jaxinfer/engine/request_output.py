"""A request's host state (ids, text, stop checks) and the ``RequestOutput`` built from it.

Plain functions the ``EngineCore`` calls for each sampled token (``advance``) and each output it
returns (``build_output``); the speculative engine appends its accepted drafts through the same.
"""

from __future__ import annotations

import dataclasses

from jaxinfer.engine.sequence import Sequence
from jaxinfer.outputs import RequestMetrics, RequestOutput, TokenLogprob
from jaxinfer.sampling.sampler import find_stop_string
from jaxinfer.tokenizers import IncrementalDetokenizer


@dataclasses.dataclass(eq=False)
class RequestState:
    """One request's host state beside its scheduler ``Sequence``."""

    seq: Sequence
    prompt: str | None
    detok: IncrementalDetokenizer | None  # None without a tokenizer: token ids only, no text
    text: str = ""  # visible output text (after stop-string cuts)
    emitted: int = 0  # characters of text already streamed
    error: str | None = None  # why the request failed (finish_reason "error")
    resumed: int = 0  # output tokens carried over from a partial output (``add_request``)
    prompt_logprobs: list | None = None  # [None, TokenLogprob...] when asked (prompt_logprobs)
    # structured outputs: the request's ``structured.GrammarMatcher`` (None: unconstrained)
    grammar: object | None = None


def advance(
    req: RequestState, tok: int, lp: TokenLogprob | None, stop_ids: set[int], max_model_len: int
) -> str | None:
    """Appends one sampled token to a request's host state (ids, logprobs, text, stop checks).

    Args:
        req: the request; its ``seq.output_ids``, ``seq.logprobs``, ``seq.stop_reason`` and
            ``text`` are updated in place.
        tok: the sampled token id.
        lp: its logprobs, or None when the request asked for none.
        stop_ids: the engine's EOS ids (ignored with ``ignore_eos``).
        max_model_len: prompt + output tokens at which a request ends ("length").

    A constrained request (``req.grammar``) advances its grammar first; a token that completes
    the grammar (no token but EOS may follow) finishes it "stop", the EOS not sampled (vLLM
    samples it one step later).

    Returns:
        The finish reason the token causes ("stop", "length") or None.

    Raises:
        GrammarViolation: (``jaxinfer.sampling.structured``) the grammar does not allow ``tok``;
            the token is not appended.
    """
    seq = req.seq
    p = seq.params
    if req.grammar is not None:
        req.grammar.accept(tok)
    seq.output_ids.append(tok)
    if lp is not None:
        seq.logprobs.append(lp)
    reason = None
    if tok in stop_ids and not p.ignore_eos:
        reason, seq.stop_reason = "stop", None
    elif tok in p.stop_token_ids:
        reason, seq.stop_reason = "stop", tok
    elif req.detok is not None:
        new_start = len(req.text)
        req.text += req.detok.add(tok)
        if p.stop and len(seq.output_ids) >= p.min_tokens:
            cut = find_stop_string(req.text, new_start, p.stop, p.include_stop_str_in_output)
            if cut is not None:
                if p.include_stop_str_in_output:
                    stop = max((s for s in p.stop if req.text[:cut].endswith(s)), key=len)
                else:
                    stop = max((s for s in p.stop if req.text.startswith(s, cut)), key=len)
                req.text = req.text[:cut]
                reason, seq.stop_reason = "stop", stop
    if reason is None and req.grammar is not None and req.grammar.done:
        reason, seq.stop_reason = "stop", None
    if reason is None:
        if p.max_tokens is not None and len(seq.output_ids) >= p.max_tokens:
            reason = "length"
        elif len(seq.prompt_ids) + len(seq.output_ids) >= max_model_len:
            reason = "length"
    if reason is not None and req.detok is not None and not isinstance(seq.stop_reason, str):
        req.text += req.detok.finish()  # the held bytes of an unfinished character: U+FFFD
    return reason


def build_output(req: RequestState) -> RequestOutput:
    """The request's output so far: all its tokens, the text not yet streamed as ``delta_text``
    (held back by ``stop_buffer_length`` until it finishes), metrics. Marks that text streamed."""
    seq = req.seq
    finished = seq.finish_reason is not None
    held = seq.params.stop_buffer_length
    visible = len(req.text) if finished else max(req.emitted, len(req.text) - held)
    delta = req.text[req.emitted : visible]
    req.emitted = visible
    n_out = len(seq.output_ids)
    m = RequestMetrics(
        prompt_tokens=len(seq.prompt_ids),
        completion_tokens=n_out,
        num_preemptions=seq.num_preemptions,
        resumed_tokens=req.resumed,
        num_cached_tokens=seq.num_cached_tokens or 0,
    )
    if seq.first_token_time is not None:  # timings of this run's tokens (``add_request``)
        n_new = n_out - req.resumed
        m.ttft_s = seq.first_token_time - seq.arrival_time
        m.tpot_s = (seq.last_token_time - seq.first_token_time) / (n_new - 1) if n_new > 1 else 0.0
        m.e2e_s = seq.last_token_time - seq.arrival_time
    has_text = req.detok is not None
    return RequestOutput(
        request_id=seq.request_id,
        prompt=req.prompt,
        prompt_token_ids=seq.prompt_ids,
        text=req.text[:visible] if has_text else None,
        token_ids=list(seq.output_ids),
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
        metrics=m,
        delta_text=delta if has_text else None,
        error=req.error,
        prompt_logprobs=req.prompt_logprobs,
    )
