"""Request bodies of the OpenAI-compatible server (pydantic), and their sampling parameters.

Field names and meanings are OpenAI's (``/v1/completions``, ``/v1/chat/completions``) plus
vLLM's extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``, ``prompt_logprobs``),
and the bodies of
vLLM's ``/tokenize`` and ``/detokenize``. Bodies are strict: an unknown field, a value of the
wrong type (``"1"`` for a number) or an OpenAI field this server does not implement with a
non-default value is a 400 naming the field (``errors.APIError``), never ignored.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxinfer.errors import RequestError
from jaxinfer.sampling.params import SamplingParams
from jaxinfer.server.errors import APIError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk (with the above)


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` accepted: the
    schema is always enforced)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON valid against a
    schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Strict):
    """The sampling fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user tag: accepted, not used
    logit_bias: dict[str, float] | None = None  # not implemented: only null or {} accepted
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    # the output constraint (``structured``): OpenAI's, vLLM's, and vLLM's older names
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None

    def _common(self) -> dict[str, Any]:
        if self.logit_bias:
            raise APIError("logit_bias is not supported by this server", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        d = {
            name: getattr(self, name)
            for name in (
                "temperature",
                "top_p",
                "stop",
                "seed",
                "presence_penalty",
                "frequency_penalty",
                "top_k",
                "min_p",
                "repetition_penalty",
                "min_tokens",
                "ignore_eos",
                "stop_token_ids",
                "include_stop_str_in_output",
                "skip_special_tokens",
                "n",
                "prompt_logprobs",
            )
        }
        return {k: v for k, v in d.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``continuous_usage_stats``: every chunk carries the usage so far (only
        together with ``include_usage``, as vLLM)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids or
    a list of lists of token ids (one choice group per prompt)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None  # not implemented: only null or n accepted
    suffix: str | None = None  # not implemented: only null accepted

    def sampling_fields(self) -> tuple[dict[str, Any], dict[str, str]]:
        """(SamplingParams fields, SamplingParams name -> request field where they differ)."""
        if self.suffix is not None:
            raise APIError("suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(
                f"best_of={self.best_of} is not supported (only best_of == n)", param="best_of"
            )
        d = self._common()
        d["max_tokens"] = self.max_tokens
        rename = {}
        if self.logprobs is not None:
            d["logprobs"] = self.logprobs
            if self.echo and self.prompt_logprobs is None:  # the echoed prompt's logprobs too
                d["prompt_logprobs"] = self.logprobs
                rename["prompt_logprobs"] = "logprobs"
        return d, rename


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Strict):
    name: str
    arguments: str


class ToolCallIn(_Strict):
    """A call of an earlier assistant turn (OpenAI's ``message.tool_calls[i]``)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a "tool" message: the call it answers
    reasoning_content: str | None = None  # an assistant turn's reasoning (Qwen3's templates)

    def as_template_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it: content as one string (text parts joined
        by newlines, as vLLM's "string" content format); a call's ``arguments`` as the object
        its JSON holds (what Hugging Face tool templates iterate or ``tojson``, as vLLM passes
        them), the string itself when it is not a JSON object."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(p.text for p in content)
        d: dict[str, Any] = {"role": self.role, "content": content if content is not None else ""}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": _args(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            d["reasoning_content"] = self.reasoning_content
        return d


def _args(text: str):
    try:
        v = json.loads(text)
    except ValueError:
        return text
    return v if isinstance(v, dict) else text


class FunctionDefinition(_Strict):
    """A tool's function: ``parameters`` is the JSON schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: ``messages`` rendered with the tokenizer's chat template
    (``add_generation_prompt``), ``logprobs`` a bool and ``top_logprobs`` the count."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def sampling_fields(self) -> tuple[dict[str, Any], dict[str, str]]:
        d = self._common()
        rename = {"logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            d["max_tokens"] = self.max_completion_tokens
            rename["max_tokens"] = "max_completion_tokens"
        else:
            d["max_tokens"] = self.max_tokens  # None: up to the model's context length
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.logprobs:
            d["logprobs"] = self.top_logprobs if self.top_logprobs is not None else 0
        return d, rename

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_dict() for m in self.messages]


class TokenizeRequest(_Strict):
    """vLLM's ``POST /tokenize``: ``prompt`` (BOS added with ``add_special_tokens``) or
    ``messages`` (rendered with the chat template; no BOS added by default)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


_FIELD = re.compile(r"^SamplingParams: (\w+)")


def to_sampling_params(req: CompletionRequest | ChatCompletionRequest, plan=None) -> SamplingParams:
    """The request's ``SamplingParams`` (fields it leaves null keep SamplingParams' defaults;
    ``temperature`` 1.0 as OpenAI's), with ``plan``'s output constraint and
    ``skip_special_tokens`` (a ``constraints.OutputPlan``) when given.

    Raises:
        APIError: 400 naming the request field whose value SamplingParams refuses.
    """
    fields, rename = req.sampling_fields()
    if plan is not None:
        if plan.structured is not None:
            fields["structured_outputs"] = plan.structured
        if plan.skip_special_tokens is not None:
            fields["skip_special_tokens"] = plan.skip_special_tokens
    try:
        return SamplingParams(**fields)
    except RequestError as e:
        msg = str(e)
        m = _FIELD.match(msg)
        name = m.group(1) if m else None
        param = rename.get(name, name)
        if param != name:  # say it with the request's field name
            msg = f"{param}: {msg[m.end() :].lstrip()}"
        raise APIError(msg, param=param) from None
