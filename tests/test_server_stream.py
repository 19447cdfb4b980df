"""The server's stream chunks on hand-made engine outputs (pure host: no engine, no HTTP)."""

from __future__ import annotations

MODEL = "stories260K"


def test_a_chunk_per_output_with_new_tokens_even_without_text():
    """Pure host: ``_Run._delta`` gives a chunk for an output whose new token decodes to no
    text (llama110m's random ids past its 512-piece tokenizer), none for an output with
    nothing new; chat's delta then has an empty content, as vLLM's ``DeltaMessage``."""
    from types import SimpleNamespace

    from jaxinfer.outputs import RequestOutput
    from jaxinfer.server.protocol import ChatCompletionRequest, CompletionRequest
    from jaxinfer.server.serving import _Choice, _Run

    opts = {
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    for kind, req in (
        ("completion", CompletionRequest(model=MODEL, prompt="x", **opts)),
        (
            "chat",
            ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "x"}], **opts),
        ),
    ):
        run = _Run(
            SimpleNamespace(llm=SimpleNamespace(tokenizer=None)), None, req, kind, "id", [], None
        )
        c = _Choice(0, "r", [1, 2, 3], True)
        out = RequestOutput("r", None, [1, 2, 3], text="", token_ids=[7000], delta_text="")
        d = run._delta(c, out)
        assert d is not None and d["finish_reason"] is None
        assert (d["delta"] == {"content": ""}) if kind == "chat" else (d["text"] == "")
        assert run._running_usage(c) == {
            "prompt_tokens": 3,
            "completion_tokens": 1,
            "total_tokens": 4,
        }
        assert run._delta(c, out) is None  # the same state again: nothing new
