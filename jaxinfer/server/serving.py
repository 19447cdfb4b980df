"""``/v1/completions`` and ``/v1/chat/completions``: process, submit, stream or collect.

A request is checked completely before anything reaches the engine: the model name (404) and the
body (400, ``protocol``) here, then each prompt through ``EngineLoop.process`` (encoded and
validated once, there: a refusal is a 400 naming the field). It runs as one engine request per
prompt, whose ``n`` completions the loop fans out; choice ``prompt_index * n + j`` is completion
j of prompt ``prompt_index``, as vLLM. Outputs come back on one ``OutputStream``
(``engine_thread``: what arrived since the last read, merged per completion, so a stream that
falls behind sends one chunk per choice with the joined text, and one write per read of the
stream); a client that disconnects (a watcher reads ``http.disconnect``) or stops reading has its
unfinished requests aborted at once. A request that fails inside the engine is a 500 for this
request alone (in a stream: an error event, then ``[DONE]``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

import jaxinfer.server.formatting as fmt
from jaxinfer.engine import inputs
from jaxinfer.errors import JaxinferError
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling.params import SamplingParams
from jaxinfer.server.chat_output import ChoiceReader, needs_reading
from jaxinfer.server.constraints import plan_output
from jaxinfer.server.engine_thread import (
    OutputStream,
    Overloaded,
    ShuttingDown,
    completion_key,
)
from jaxinfer.server.errors import APIError, error_body
from jaxinfer.server.protocol import ChatCompletionRequest, CompletionRequest, to_sampling_params


@dataclasses.dataclass
class _Choice:
    index: int
    request_id: str
    prompt_ids: list[int]
    first_of_prompt: bool  # counts the prompt in usage (one choice per prompt does)
    echo: str = ""
    lp_sent: int = 0  # logprobs entries already sent (streaming)
    tok_sent: int = 0  # generated tokens already streamed
    text_offset: int = 0
    final: RequestOutput | None = None
    echo_sent: bool = False
    completion: int = 0  # its completion of the engine request (choice index % n)
    reader: ChoiceReader | None = None  # chat: reasoning and tool calls read from the text


class _SSEResponse(StreamingResponse):
    """A stream whose body generator is always closed when the response ends, so its cleanup
    (aborting unfinished sequences) runs at once even when a write to a gone client fails."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


def check_model(state, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(f"The model `{model}` does not exist.", param="model", status=404)


def _validate_param(msg: str, kind: str, constraint: str | None = None) -> str | None:
    """The request field an ``EngineLoop.process`` error is about (``constraint``: the field
    the output constraint came from)."""
    if msg.startswith("structured_outputs") and constraint is not None:
        return constraint
    if msg.startswith("logprobs"):
        return "top_logprobs" if kind == "chat" else "logprobs"
    if msg.startswith("stop_token_ids"):
        return "stop_token_ids"
    if "stop string" in msg:
        return "stop"
    return "messages" if kind == "chat" else "prompt"


def _prompts(req: CompletionRequest) -> list:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError("prompt must not be empty", param="prompt")
    if isinstance(p[0], int):
        return [p]
    if any(isinstance(x, list) and not x for x in p):
        raise APIError("prompt must not hold an empty list of token ids", param="prompt")
    return list(p)


def _process_all(
    loop, base: str, prompts: list, sp: SamplingParams, kind: str, constraint: str | None = None
) -> list[inputs.ProcessedRequest]:
    """Each prompt as an engine request ``<base>-<i>``, encoded and validated by the engine
    loop (runs in a worker thread). Raises APIError (400) naming the field a refusal is about
    (``constraint``: the field an output-constraint refusal names)."""
    procs = []
    for i, p in enumerate(prompts):
        where = "" if len(prompts) == 1 else f" (prompt {i})"
        head = "messages: " if kind == "chat" else ""
        problem = inputs.unicode_problem(p) if isinstance(p, str) else None
        if problem:  # a JSON "\\ud800" escape: the body's text, not the engine's concern
            raise APIError(f"{head}prompt{where} {problem}", param=_validate_param("", kind))
        prompt = {"prompt_token_ids": p} if isinstance(p, list) else p
        try:
            procs.append(loop.process(inputs.Request(f"{base}-{i}", prompt, sp)))
        except JaxinferError as e:
            param = _validate_param(str(e), kind, constraint)
            if param == constraint:
                raise APIError(f"{param}: {e}{where}", param=param) from None
            raise APIError(f"{head}{e}{where}", param=param) from None
    return procs


def _as_choice(out: RequestOutput) -> RequestOutput:
    """An output of one completion as its choice's own output: ``finish_reason`` is the
    completion's (a request with n > 1 has None there until all n finished)."""
    reason = out.outputs[0].finish_reason
    return out if reason == out.finish_reason else dataclasses.replace(out, finish_reason=reason)


async def _watch_disconnect(raw: Request, stream: OutputStream) -> None:
    while True:
        msg = await raw.receive()
        if msg["type"] == "http.disconnect":
            stream.disconnect()
            return


async def handle(state, raw: Request, req: CompletionRequest | ChatCompletionRequest):
    """Answers one completions or chat request (JSON, or an SSE stream)."""
    kind = "chat" if isinstance(req, ChatCompletionRequest) else "completion"
    check_model(state, req.model)
    plan = plan_output(req, state.tools, getattr(state.llm, "tokenizer", None))
    sp = to_sampling_params(req, plan)
    if kind == "chat":
        prompt = {"messages": req.template_messages()}
        if plan.template_tools:
            prompt["tools"] = plan.template_tools
        prompts = [prompt]
    else:
        prompts = _prompts(req)
    base = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    procs = await asyncio.to_thread(
        _process_all, state.engine.loop, base, prompts, sp, kind, plan.param
    )
    reading = kind == "chat" and needs_reading(plan, state.tools.reasoning)
    choices = []
    for i, proc in enumerate(procs):
        echo = (proc.prompt_text or "") if kind == "completion" and req.echo else ""
        for j in range(proc.n):  # completion j of prompt i (the loop seeds it seed + j)
            choices.append(
                _Choice(
                    i * req.n + j,
                    proc.request_id,
                    proc.prompt_ids,
                    j == 0,
                    echo,
                    text_offset=len(echo),
                    completion=j,
                    reader=ChoiceReader(plan, state.tools.reasoning) if reading else None,
                )
            )
    cap = state.engine.capacity
    if cap is not None and len(choices) > cap:  # never fits: not worth a retry
        param = "n" if req.n > 1 else "prompt"
        raise APIError(
            f"the request asks for {len(choices)} sequences ({len(procs)} prompts x "
            f"n={req.n}); the server takes at most {cap} at once (max_num_seqs + "
            "--max-queue)",
            param=param,
        )
    stream = OutputStream()
    try:
        state.engine.submit(procs, stream)
    except (Overloaded, ShuttingDown) as e:
        raise APIError(str(e), status=503) from None
    run = _Run(state, raw, req, kind, base, choices, stream)
    if req.stream:
        return _SSEResponse(
            run.stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    return await run.collect()


class _Run:
    """The choices of one HTTP request while they run."""

    def __init__(self, state, raw, req, kind, base, choices, stream):
        self.state, self.raw, self.req, self.kind = state, raw, req, kind
        self.id, self.created = base, int(time.time())
        self.choices = choices
        self.by_key = {(c.request_id, c.completion): c for c in choices}
        self.outputs = stream
        self.released = False
        self.tok = state.llm.tokenizer
        # completions with echo and logprobs: the echoed prompt carries its logprobs
        self.echo_lp = kind == "completion" and req.echo and req.logprobs is not None

    def _cleanup(self) -> None:
        """Aborts the unfinished requests and gives their places back (once)."""
        if self.released:
            return
        self.released = True
        left = list(dict.fromkeys(c.request_id for c in self.choices if c.final is None))
        if left:
            self.state.engine.abort(left)
        self.state.engine.release(len(self.choices))

    async def _outputs(self) -> AsyncIterator[list[tuple[_Choice | None, RequestOutput]] | None]:
        """(choice, its output) pairs, a read of the stream at a time (merged per completion),
        until every choice finished; None when the client went away. A failed request's error
        output comes with choice None (the caller fails the whole HTTP request)."""
        watcher = asyncio.create_task(_watch_disconnect(self.raw, self.outputs))
        try:
            remaining = len(self.choices)
            while remaining:
                got = await self.outputs.get()
                if got is None:
                    yield None
                    return
                outs = []
                for out in got:
                    if out.error is not None:
                        outs.append((None, out))
                        continue
                    c = self.by_key.get(completion_key(out))
                    if c is None or c.final is not None:
                        continue  # the final output of n > 1: every choice finished before it
                    out = _as_choice(out)
                    if out.finished:
                        c.final = out
                        remaining -= 1
                        self.state.metrics.finished(out, count_prompt=c.first_of_prompt)
                    outs.append((c, out))
                if outs:
                    yield outs
        finally:
            watcher.cancel()

    # ---------------------------------------------------------------- non-streaming

    async def collect(self) -> JSONResponse:
        try:
            async for outs in self._outputs():
                if outs is None:  # nobody to answer: abort (finally) and send nothing useful
                    return JSONResponse(error_body("client disconnected", 499), status_code=499)
                for _, out in outs:
                    if out.error is not None:
                        raise APIError(f"the engine failed this request: {out.error}", status=500)
        finally:
            self._cleanup()
        finals = [c.final for c in self.choices]
        body = {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": [self._choice(c) for c in self.choices],
            "usage": fmt.usage([c.final for c in self.choices if c.first_of_prompt], finals),
        }
        return JSONResponse(body)

    def _choice(self, c: _Choice) -> dict:
        out = c.final
        text = out.text or ""
        if self.kind == "chat":
            lps = (
                fmt.chat_logprobs(self.tok, c.prompt_ids, out.logprobs)
                if out.logprobs is not None
                else None
            )
            if c.reader is not None:
                message = c.reader.message(text)
                reason = c.reader.finish_reason(out.finish_reason)
            else:
                message, reason = {"role": "assistant", "content": text}, out.finish_reason
            return {
                "index": c.index,
                "message": message,
                "logprobs": lps,
                "finish_reason": reason,
                "stop_reason": out.stop_reason,
            }
        lps = (
            fmt.completion_logprobs(self.tok, c.prompt_ids, out.logprobs, len(c.echo))[0]
            if out.logprobs is not None
            else None
        )
        if self.echo_lp and out.prompt_logprobs is not None and lps is not None:
            lps = fmt.join_logprobs(self._echo_lps(c, out), lps)
        return {
            "index": c.index,
            "text": c.echo + text,
            "logprobs": lps,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
            "prompt_logprobs": fmt.prompt_logprobs(self.tok, c.prompt_ids, out.prompt_logprobs),
        }

    def _echo_lps(self, c: _Choice, out: RequestOutput) -> dict:
        return fmt.echo_logprobs(self.tok, c.prompt_ids, out.prompt_logprobs)

    # ---------------------------------------------------------------- streaming

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        obj = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.state.model_name,
            "choices": choices,
        }
        if self.req.include_usage:
            obj["usage"] = usage
        return fmt.sse(obj)

    def _running_usage(self, c: _Choice) -> dict | None:
        """The usage so far of choice ``c`` (vLLM's ``continuous_usage_stats``), else None."""
        if not self.req.continuous_usage:
            return None
        n_prompt = len(c.prompt_ids)
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": c.tok_sent,
            "total_tokens": n_prompt + c.tok_sent,
        }

    def _delta(self, c: _Choice, out: RequestOutput) -> dict | None:
        """The stream choice of one output, or None when it adds nothing. An output with new
        tokens is sent even when they add no text (text held back, or ids the tokenizer
        decodes to nothing), as vLLM: a client counting chunks sees every step."""
        lps = None
        if out.logprobs is not None:
            new = out.logprobs[c.lp_sent :]
            ctx = c.prompt_ids + out.token_ids[: c.lp_sent]
            if new:
                if self.kind == "chat":
                    lps = fmt.chat_logprobs(self.tok, ctx, new)
                else:
                    lps, c.text_offset = fmt.completion_logprobs(self.tok, ctx, new, c.text_offset)
                c.lp_sent = len(out.logprobs)
        new_tokens = len(out.token_ids) > c.tok_sent
        c.tok_sent = max(c.tok_sent, len(out.token_ids))
        text = out.delta_text or ""
        reason = out.finish_reason if out.finished else None
        if c.reader is not None:  # reasoning and tool calls: only what is new, if anything
            delta = c.reader.delta(text, out.finished)
            if not delta and lps is None and not out.finished:
                return None
            return {
                "index": c.index,
                "delta": delta,
                "logprobs": lps,
                "finish_reason": c.reader.finish_reason(reason),
                "stop_reason": out.stop_reason if out.finished else None,
            }
        if not text and lps is None and not new_tokens and not out.finished:
            return None
        if self.kind == "chat":
            return {
                "index": c.index,
                "delta": {"content": text} if text or new_tokens else {},
                "logprobs": lps,
                "finish_reason": reason,
                "stop_reason": out.stop_reason if out.finished else None,
            }
        return {
            "index": c.index,
            "text": text,
            "logprobs": lps,
            "finish_reason": reason,
            "stop_reason": out.stop_reason if out.finished else None,
        }

    async def stream(self) -> AsyncIterator[str]:
        try:
            for c in self.choices:  # chat: the role first; completions with echo: the prompt
                if self.kind == "chat":
                    yield self._chunk(
                        [
                            {
                                "index": c.index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                        self._running_usage(c),
                    )
                elif c.echo and not self.echo_lp:
                    yield self._chunk(
                        [
                            {
                                "index": c.index,
                                "text": c.echo,
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                        self._running_usage(c),
                    )
                    c.echo_sent = True
            async for outs in self._outputs():
                if outs is None:
                    return
                parts = []  # one write per read of the stream
                for c, out in outs:
                    if out.error is not None:
                        parts += [
                            fmt.sse(
                                error_body(f"the engine failed this request: {out.error}", 500)
                            ),
                            fmt.SSE_DONE,
                        ]
                        yield "".join(parts)
                        return
                    if c.echo and not c.echo_sent and out.prompt_logprobs is not None:
                        c.echo_sent = True  # the prompt logprobs come with the first output
                        parts.append(
                            self._chunk(
                                [
                                    {
                                        "index": c.index,
                                        "text": c.echo,
                                        "logprobs": self._echo_lps(c, out),
                                        "finish_reason": None,
                                    }
                                ],
                                self._running_usage(c),
                            )
                        )
                    d = self._delta(c, out)
                    if d is not None:
                        parts.append(self._chunk([d], self._running_usage(c)))
                if parts:
                    yield "".join(parts)
            if self.req.include_usage:
                finals = [c.final for c in self.choices]
                yield self._chunk(
                    [], fmt.usage([c.final for c in self.choices if c.first_of_prompt], finals)
                )
            yield fmt.SSE_DONE
        finally:
            self._cleanup()
