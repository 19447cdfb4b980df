"""The FastAPI application: routes, the engine thread's lifetime, and error handling.

Routes (OpenAI's and vLLM's): ``POST /v1/completions``, ``POST /v1/chat/completions``
(``serving``), ``GET /v1/models``, ``GET /health`` (200, or 503 once the engine thread has
stopped), ``GET /metrics`` (``metrics``), ``POST /tokenize``, ``POST /detokenize``.
``create_app`` takes a loaded ``LLM``; the engine thread starts with the app's lifespan and stops
(aborting what still runs) when the server shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import jaxinfer.server.serving as serving
from jaxinfer.errors import JaxinferError
from jaxinfer.server.constraints import ToolOptions
from jaxinfer.server.engine_thread import AsyncEngine
from jaxinfer.server.errors import APIError, install_error_handlers
from jaxinfer.server.metrics import ServerMetrics
from jaxinfer.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)


@dataclasses.dataclass
class ServerState:
    """What the handlers share: the model, its engine thread and metrics."""

    llm: object
    model_name: str
    engine: AsyncEngine
    metrics: ServerMetrics
    created: int
    tools: ToolOptions = ToolOptions()


def tool_options(args) -> ToolOptions:
    """The server's tool-calling options from an ``EngineArgs`` (``tool_call_parser``,
    ``enable_auto_tool_choice``, ``reasoning_parser``)."""
    from jaxinfer.server.reasoning_parsers import get_reasoning_parser
    from jaxinfer.server.tool_parsers import get_tool_parser

    parser, reasoning = args.tool_call_parser, args.reasoning_parser
    return ToolOptions(
        get_tool_parser(parser) if parser else None,
        bool(args.enable_auto_tool_choice),
        get_reasoning_parser(reasoning) if reasoning else None,
    )


def create_app(
    llm,
    model_name: str | None = None,
    max_queue: int | None = None,
    tools: ToolOptions | None = None,
) -> FastAPI:
    """The OpenAI-compatible app serving ``llm``.

    Args:
        llm: a loaded ``jaxinfer.LLM``.
        model_name: the name clients pass as ``model`` (default: the LLM's model path); another
            name is a 404.
        max_queue: most sequences waiting beyond ``max_num_seqs`` (per replica) before new
            requests get 503; None = no limit.
        tools: the tool-call and reasoning parsers (default: ``llm.args``' options,
            ``tool_options``).

    Raises:
        ValueError: ``max_queue`` is negative.
    """
    if max_queue is not None and max_queue < 0:
        raise ValueError(f"max_queue must be >= 0 or None, got {max_queue}")
    engine = AsyncEngine(llm, max_queue=max_queue)
    name = model_name or llm.model_path
    state = ServerState(
        llm,
        name,
        engine,
        ServerMetrics(llm, engine, name),
        int(time.time()),
        tools if tools is not None else tool_options(llm.args),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="jaxinfer", lifespan=lifespan)
    app.state.jaxinfer = state
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.handle(state, raw, req)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await serving.handle(state, raw, req)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "jaxinfer",
                    "root": llm.model_path,
                    "parent": None,
                    "max_model_len": llm.engine.ecfg.max_model_len,
                }
            ],
        }

    @app.get("/health")
    async def health():
        if not engine.alive:
            raise APIError("the engine is not running", status=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving.check_model(state, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of prompt and messages", param="prompt")
        tok = engine.loop.tokenizer  # the one prompts are encoded with
        try:
            if req.prompt is not None:
                add = True if req.add_special_tokens is None else req.add_special_tokens
                ids = tok.encode(req.prompt, add_special_tokens=add)
            else:
                text = tok.apply_chat_template(
                    [m.as_template_dict() for m in req.messages], req.add_generation_prompt
                )
                ids = tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
        except JaxinferError as e:
            where = "prompt" if req.prompt is not None else "messages"
            raise APIError(str(e), param=where) from None
        return {
            "count": len(ids),
            "max_model_len": llm.engine.ecfg.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(state, req.model)
        vocab = llm.config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(
                f"tokens: ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens"
            )
        tok = llm.tokenizer
        if tok is None:
            raise APIError("the model runs without a tokenizer: no text", param="tokens")
        return JSONResponse({"prompt": tok.decode(req.tokens)})

    return app
