"""A request's way into an engine core (host only): the checks ``EngineCore.validate`` runs and
the host state ``EngineCore.add_request`` builds for it."""

from __future__ import annotations

from collections.abc import Callable

from jaxinfer.engine.prompt_logprobs import check_request as check_prompt_logprobs
from jaxinfer.engine.request_output import RequestState
from jaxinfer.engine.resume import ResumeState
from jaxinfer.engine.sequence import Sequence
from jaxinfer.errors import RequestError
from jaxinfer.outputs import TokenLogprob
from jaxinfer.sampling.sampler import MAX_LOGPROBS, SamplingParams
from jaxinfer.sampling.structured import GrammarViolation
from jaxinfer.sampling.structured_params import StructuredOutputsParams
from jaxinfer.tokenizers import IncrementalDetokenizer, Tokenizer
from jaxinfer.tokenizers.ids_only import no_tokenizer_message


def check_request(
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
    tokenizer: Tokenizer,
    prompt_logprobs_refused_by: str | None,
    check_grammar: Callable[[StructuredOutputsParams], None] | None = None,
    structured_refused_by: str | None = None,
) -> None:
    """Raises RequestError when a request of ``prompt_ids`` (int[n]) with ``params`` cannot run
    on an engine of this vocabulary and ``max_model_len`` (tokens): an empty or too long prompt,
    ids outside the vocabulary, too many logprobs, stop ids that could never be generated, stop
    strings without a tokenizer, prompt logprobs the engine cannot give
    (``prompt_logprobs_refused_by``: what refuses them, e.g. "speculative decoding", or None),
    a constraint (``params.structured_outputs``) the engine refuses (``structured_refused_by``),
    combined with ``min_tokens``, or that does not compile (``check_grammar``: the engine's
    ``structured.Grammars.check``, raising RequestError naming the field)."""
    if len(prompt_ids) == 0:
        raise RequestError("prompt has zero tokens (empty prompt on a tokenizer that adds no BOS)")
    if len(prompt_ids) >= max_model_len:
        raise RequestError(
            f"prompt has {len(prompt_ids)} tokens; max_model_len={max_model_len} "
            "leaves no room to generate (prompt must be shorter than max_model_len)"
        )
    bad = [t for t in prompt_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise RequestError(
            f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )
    if params.logprobs is not None and params.logprobs > min(MAX_LOGPROBS, vocab_size):
        raise RequestError(
            f"logprobs={params.logprobs} > {MAX_LOGPROBS} or the vocabulary size {vocab_size}"
        )
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(
            f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size}) "
            "and could never be generated"
        )
    if params.structured_outputs is not None:
        check_structured(params, check_grammar, structured_refused_by)
    check_stop_strings(params, tokenizer)
    check_prompt_logprobs(params, vocab_size, prompt_logprobs_refused_by, len(prompt_ids))


def check_structured(
    params: SamplingParams,
    check_grammar: Callable[[StructuredOutputsParams], None] | None,
    refused_by: str | None,
) -> None:
    """Raises RequestError when ``params.structured_outputs`` cannot run here: the engine refuses
    constraints (``refused_by``, e.g. "speculative decoding"), ``min_tokens`` is set (its EOS ban
    could leave a complete grammar no token to sample), or the constraint does not compile
    (``check_grammar``; None: the engine cannot compile grammars)."""
    so = params.structured_outputs
    if refused_by is not None:
        raise RequestError(
            f"structured_outputs ({so.kind}) is not supported with {refused_by}: the drafts "
            "are not checked against the grammar; run the request on an engine without it"
        )
    if params.min_tokens:
        raise RequestError(
            f"structured_outputs with min_tokens={params.min_tokens} is not supported (the "
            "grammar decides where the output may end); send min_tokens=0"
        )
    if check_grammar is None:
        raise RequestError("structured_outputs: this engine cannot compile grammars")
    check_grammar(so)


def check_stop_strings(params: SamplingParams, tokenizer: Tokenizer) -> None:
    """Raises RequestError for stop strings on a model without a tokenizer (``has_text`` False)."""
    if params.stop and not getattr(tokenizer, "has_text", True):
        raise RequestError(no_tokenizer_message(tokenizer.path, "a stop string (stop)"))


def new_request_state(
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    prompt: str | None,
    seed: int,
    tokenizer: Tokenizer,
) -> RequestState:
    """A fresh request's host state: its scheduler ``Sequence`` (sampling with ``seed``), an
    incremental detokenizer when the tokenizer has text, and the prompt-logprobs list (``None``
    up to ``prompt_logprobs_from``) when asked."""
    seq = Sequence(request_id, [int(t) for t in prompt_ids], params, seed)
    has_text = getattr(tokenizer, "has_text", True)  # duck-typed tokenizers have text
    detok = (
        IncrementalDetokenizer(tokenizer, seq.prompt_ids, params.skip_special_tokens)
        if has_text
        else None
    )
    plps = None if params.prompt_logprobs is None else [None] * params.prompt_logprobs_from
    return RequestState(seq, prompt, detok, prompt_logprobs=plps)


def replay(
    req: RequestState,
    resume: ResumeState,
    advance: Callable[[RequestState, int, TokenLogprob | None], str | None],
) -> None:
    """Replays a partial output's tokens (``resume.token_ids``, with their logprobs) through
    ``advance`` (the engine's ``request_output.advance``: the same checks that appended them the
    first time; a constrained request's grammar is replayed over them too), rebuilding ``req``'s
    host state. Raises RequestError when the partial output has already finished or breaks the
    request's grammar."""
    lps = resume.logprobs or [None] * len(resume.token_ids)
    for i, (tok, lp) in enumerate(zip(resume.token_ids, lps, strict=True)):
        try:
            reason = advance(req, int(tok), lp)
        except GrammarViolation as e:
            raise RequestError(
                f"the partial output does not match the request's structured_outputs: {e}"
            ) from None
        if reason is not None:
            raise RequestError(
                f"the partial output has already finished ({reason!r} at "
                f"output token {i} of {len(resume.token_ids)})"
            )
    req.resumed = len(resume.token_ids)
