"""Engine flags of `jaxinfer generate` / `serve` reach ``LLM`` (pure host: ``LLM`` replaced)."""

from __future__ import annotations

import jaxinfer.llm


def test_no_reuse_compiled_buckets_flag_reaches_llm(monkeypatch, tmp_path):
    from jaxinfer.cli.main import _load_llm, build_parser

    got = []
    monkeypatch.setattr(jaxinfer.llm.LLM, "from_engine_args", got.append)
    base = ["generate", "--model", "m", "--prompts", "p", "--out", str(tmp_path / "o")]
    for extra, want in (([], True), (["--no-reuse-compiled-buckets"], False)):
        _load_llm(build_parser().parse_args(base + extra))
        args = got.pop()
        assert args.reuse_compiled_buckets is want and args.origin == "cli"
    serve = ["serve", "--model", "m", "--no-reuse-compiled-buckets", "--max-prefill-seqs", "2"]
    _load_llm(build_parser().parse_args(serve))
    args = got.pop()
    assert args.reuse_compiled_buckets is False and args.max_prefill_seqs == 2
