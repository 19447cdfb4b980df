"""A request on its way in: its prompt encoded, its ``n`` completions laid out, every one validated.

``process`` is the one place a request is checked before it reaches an engine (the shape of vLLM
v1's ``Processor.process_inputs``, which turns a prompt and its params into an
``EngineCoreRequest``). ``EngineLoop.add`` runs it for a plain ``Request``; a caller that must
answer a bad request before queueing it (the HTTP server: a 400 at once) runs
``EngineLoop.process`` itself and hands the ``ProcessedRequest`` to ``add``, which then checks only
what depends on the requests already running (duplicate ids). A caller that learns a request's
resume states only once it is encoded (``jaxinfer generate``: the partial-state file is keyed by
the prompt's token ids) gives them with ``with_resume``, which checks the states alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from jaxinfer.engine.parallel_sampling import child_params, child_resume
from jaxinfer.engine.resume import ResumeState
from jaxinfer.errors import JaxinferError, RequestError
from jaxinfer.sampling.params import SamplingParams

PromptLike = str | Sequence[int] | dict
"""A prompt: text, token ids, or a dict with ``"prompt"``, ``"prompt_token_ids"`` or
``"messages"`` (a chat, rendered with the tokenizer's chat template; ``"tools"`` beside it: the
functions the template offers the model)."""
ResumeLike = ResumeState | Sequence[ResumeState | None] | None
"""A request's resume state; a sequence of n states for a request with ``n`` > 1."""


@dataclasses.dataclass(frozen=True)
class Request:
    """One request as a caller gives it.

    Attributes:
        request_id: the caller's id; unique among the requests running in one ``EngineLoop``
            (a request with ``n`` > 1 also takes the ids ``"<index>_<request_id>"`` of its
            completions, vLLM's scheme).
        prompt: text, token ids or a dict (``PromptLike``).
        params: its sampling parameters (``n`` > 1: ``jaxinfer.engine.parallel_sampling``).
        resume: continue from a partial output (``jaxinfer.engine.resume``); for ``n`` > 1 a
            sequence of n states (or None), one per completion.
    """

    request_id: str
    prompt: PromptLike
    params: SamplingParams
    resume: ResumeLike = None


@dataclasses.dataclass(frozen=True)
class ProcessedRequest:
    """A request encoded and validated by ``process``: what an engine runs, one child per
    completion (one for ``n`` = 1).

    Attributes:
        request_id: the caller's id.
        prompt_ids: int[S] the prompt's token ids.
        prompt_text: the prompt's text (the rendered chat for messages), None for token ids.
        params: the caller's params (``n`` as given).
        children: (params with ``n`` = 1, resume state or None) of each completion, index order.
    """

    request_id: str
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    children: tuple[tuple[SamplingParams, ResumeState | None], ...]

    @property
    def n(self) -> int:
        return len(self.children)


def unicode_problem(s: str, bad_utf8: bool = False) -> str | None:
    """Why ``s`` cannot be written as UTF-8 (a lone surrogate), if it cannot: what JSON's
    ``"\\ud800"`` escapes let into a string, which the front ends (prompts file, HTTP) refuse
    with this reason. ``bad_utf8``: read surrogates U+DC80..U+DCFF as bytes of a file that were
    not UTF-8 (Python's surrogateescape)."""
    if s.isascii():
        return None
    try:
        s.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        c = ord(s[e.start])
        if bad_utf8 and 0xDC80 <= c <= 0xDCFF:
            return f"holds byte 0x{c - 0xDC00:02x}, which is not UTF-8"
        return f"holds a lone surrogate \\u{c:04x} (half of a UTF-16 pair), not valid Unicode"


def encode_prompt(tok, prompt: PromptLike) -> tuple[list[int], str | None]:
    """Token ids and text of ``prompt`` with tokenizer ``tok`` (an ``IdsOnlyTokenizer`` raises
    RequestError for text).

    Raises:
        RequestError: a prompt of an unsupported type or shape.
        JaxinferError: the tokenizer refuses it (no chat template for messages, ...); a
            tokenizer's own exception passes through (``process`` names it).
    """
    if isinstance(prompt, str):
        return tok.encode(prompt), prompt
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise RequestError("prompt_token_ids must be a list of integers")
            return list(ids), None
        if "messages" in prompt:
            tools = {"tools": prompt["tools"]} if prompt.get("tools") else {}
            text = tok.apply_chat_template(prompt["messages"], add_generation_prompt=True, **tools)
            return tok.encode(text, add_special_tokens=False), text
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise RequestError("prompt must be a string")
            return tok.encode(prompt["prompt"]), prompt["prompt"]
        raise RequestError("a request needs one of 'prompt', 'prompt_token_ids', 'messages'")
    if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        return list(prompt), None
    raise RequestError(f"unsupported prompt type {type(prompt).__name__}")


ACCEPTED_PROMPTS = (
    "a prompt (a string, a list of token ids, or a dict with 'prompt', 'prompt_token_ids' or "
    "'messages') or a list of prompts"
)
_PROMPT_KEYS = ("prompt_token_ids", "messages", "prompt")


def _type_name(x) -> str:
    return "None" if x is None else type(x).__name__


def _is_token_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _check_prompt(prompt, where: str) -> None:
    """Raises TypeError / ValueError when ``prompt`` is not of a ``PromptLike`` shape."""
    if isinstance(prompt, str):
        return
    if isinstance(prompt, dict):
        key = next((k for k in _PROMPT_KEYS if k in prompt), None)  # encode_prompt's order
        if key is None:
            raise ValueError(
                f"{where} is a dict with keys {sorted(map(str, prompt))}: a prompt dict needs "
                "'prompt' (a string), 'prompt_token_ids' (a list of token ids) or 'messages' "
                "(a chat)"
            )
        value = prompt[key]
        if key == "prompt" and not isinstance(value, str):
            raise TypeError(f"{where}['prompt'] must be a string, not {_type_name(value)}")
        if key == "prompt_token_ids" and not (
            isinstance(value, list) and all(_is_token_id(t) for t in value)
        ):
            raise TypeError(f"{where}['prompt_token_ids'] must be a list of integer token ids")
        return
    if isinstance(prompt, list | tuple) and all(_is_token_id(t) for t in prompt):
        return
    raise TypeError(f"{where} has type {_type_name(prompt)}; accepted: {ACCEPTED_PROMPTS}")


def prompt_list(prompts) -> list[PromptLike]:
    """The prompts of one ``LLM.generate`` call as a list (vLLM's forms): one prompt (a string,
    a list of token ids, a dict) is a list of one; an iterable of prompts is listed.

    Only the shape is checked here; what depends on the model (token ids in the vocabulary, the
    prompt's length, the chat template) fails that request alone (``process``).

    Raises:
        TypeError: ``prompts`` or one of its prompts is of no accepted type (None, a number,
            bytes, a list mixing token ids and other values, ...); the message lists the
            accepted ones.
        ValueError: a dict prompt with none of ``"prompt"``, ``"prompt_token_ids"``,
            ``"messages"``.
    """
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    elif isinstance(prompts, bytes | bytearray) or not isinstance(prompts, Iterable):
        raise TypeError(f"prompts has type {_type_name(prompts)}; accepted: {ACCEPTED_PROMPTS}")
    prompts = list(prompts)
    if prompts and all(_is_token_id(t) for t in prompts):
        return [prompts]  # one prompt of token ids
    for i, prompt in enumerate(prompts):
        _check_prompt(prompt, f"prompts[{i}]")
    return prompts


def conversation_list(messages) -> list[list[dict]]:
    """The conversations of one ``LLM.chat`` call: one conversation (a non-empty list of
    ``{"role", "content"}`` dicts) is a list of one; a list of conversations is kept. The
    messages' contents are checked by the chat template (that request fails alone).

    Raises:
        TypeError: ``messages`` is not a list of dicts or a list of lists of dicts.
        ValueError: an empty list, or an empty conversation.
    """
    accepted = (
        "chat() takes a conversation (a list of {'role', 'content'} dicts) or a list of "
        "conversations; use generate() for plain text prompts"
    )
    if not isinstance(messages, list | tuple):
        raise TypeError(f"{accepted}; got {_type_name(messages)}")
    if not messages:
        raise ValueError(f"{accepted}: got an empty list")
    if all(isinstance(m, dict) for m in messages):
        return [list(messages)]
    for i, conv in enumerate(messages):
        if not isinstance(conv, list | tuple):
            raise TypeError(f"{accepted}; messages[{i}] has type {_type_name(conv)}")
        for j, m in enumerate(conv):
            if not isinstance(m, dict):
                raise TypeError(f"{accepted}; messages[{i}][{j}] has type {_type_name(m)}")
        if not conv:
            raise ValueError(f"{accepted}: conversation {i} is empty")
    return [list(c) for c in messages]


def process(engine, request: Request) -> ProcessedRequest:
    """Encodes ``request``'s prompt with ``engine.tokenizer``, lays out its completions
    (``parallel_sampling.child_params`` / ``child_resume``) and validates each one with
    ``engine.validate`` (prompt length and ids, logprobs, stop ids and strings, prompt logprobs,
    the resume state). Needs no lock: it reads the engine's config and tokenizer only.

    Raises:
        RequestError: params not a ``SamplingParams``; the prompt cannot be encoded (a
            tokenizer's own exception is named in the message); the request cannot run.
        JaxinferError: the tokenizer refuses the prompt (``TokenizerError``: no chat template).
    """
    params = request.params
    if not isinstance(params, SamplingParams):
        raise RequestError(f"sampling params must be a SamplingParams, not {type(params).__name__}")
    try:
        ids, text = encode_prompt(engine.tokenizer, request.prompt)
    except JaxinferError:
        raise
    except Exception as e:  # noqa: BLE001 - a tokenizer's own error on this prompt
        raise RequestError(
            f"cannot encode the prompt: {type(e).__name__}: {str(e)[:500]}"
        ) from None
    children = tuple(zip(child_params(params), child_resume(params, request.resume), strict=True))
    for csp, crs in children:
        engine.validate(ids, csp, crs)
    return ProcessedRequest(str(request.request_id), ids, text, params, children)


def with_resume(engine, request: ProcessedRequest, states) -> ProcessedRequest:
    """``request`` (``process``'s result, trusted) continuing its completions from ``states``
    (one ``ResumeState`` per completion, index order): checks the states alone with
    ``engine.validate_resume`` (seed, token ids, logprobs, a partial output that already
    finished), not the request again. Needs no lock.

    Raises:
        RequestError: not one state per completion, or a state the engine refuses.
    """
    states = list(states)
    if len(states) != request.n or not all(isinstance(st, ResumeState) for st in states):
        raise RequestError(
            f"{len(states)} resume states for n={request.n}: one ResumeState per completion"
        )
    for (csp, _), st in zip(request.children, states, strict=True):
        engine.validate_resume(request.prompt_ids, csp, st)
    children = tuple((csp, st) for (csp, _), st in zip(request.children, states, strict=True))
    return dataclasses.replace(request, children=children)
