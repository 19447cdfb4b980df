"""``jaxinfer serve``: an OpenAI-compatible HTTP server on the ``LLM`` engine (issue 19).

Modules, one concern each: ``command`` (the CLI subcommand; imports no server library until it
runs), ``app`` (FastAPI routes and lifespan), ``serving`` (completions and chat: validate,
submit, stream or collect), ``protocol`` (pydantic request bodies -> ``SamplingParams``),
``engine_thread`` (the background thread that steps the engine for every client),
``formatting`` (logprobs, usage, SSE), ``metrics`` (Prometheus), ``errors`` (OpenAI error bodies),
``constraints`` (``response_format`` / ``tools`` -> ``StructuredOutputsParams``), ``chat_output``
(tool calls and reasoning read from a chat reply), ``tool_parsers`` and ``reasoning_parsers``
(the models' formats, pure text).
Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client).
"""

__all__ = ["create_app"]


def create_app(*args, **kwargs):
    """``jaxinfer.server.app.create_app`` (imported on first use)."""
    from jaxinfer.server.app import create_app as _create_app

    return _create_app(*args, **kwargs)
