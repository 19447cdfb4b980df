"""Engine flags of `jaxinfer generate` / `serve` reach ``LLM`` (pure host: ``LLM`` replaced)."""

from __future__ import annotations

import jaxinfer.llm


def test_no_reuse_compiled_buckets_flag_reaches_llm(monkeypatch, tmp_path):
    from jaxinfer.cli.main import _load_llm, build_parser

    got = []
    monkeypatch.setattr(jaxinfer.llm, "LLM", lambda *a, **kw: got.append(kw))
    base = ["generate", "--model", "m", "--prompts", "p", "--out", str(tmp_path / "o")]
    for extra, want in (([], True), (["--no-reuse-compiled-buckets"], False)):
        _load_llm(build_parser().parse_args(base + extra))
        assert got.pop()["reuse_compiled_buckets"] is want
    serve = ["serve", "--model", "m", "--no-reuse-compiled-buckets"]
    _load_llm(build_parser().parse_args(serve))
    assert got.pop()["reuse_compiled_buckets"] is False
