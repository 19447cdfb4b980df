"""stories260K greedy generation reproduces llama2.c run.c's output (greedy_reference.json) exactly,
with the tokenizer loaded from the SentencePiece model and from llama2.c's tokenizer file.

Semantics (shared/models/stories260K/README.md): the prompt is encoded with BOS prepended;
``max_steps`` counts forward steps from BOS, so ``max_steps - len(prompt tokens)`` tokens are
generated; generation stops early when the model emits BOS (id 1); the expected text is the
decoded prompt pieces and generated pieces, the first piece's leading space dropped.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest

from jaxinfer.loaders.llama2c import load_llama2c
from jaxinfer.models.dense import dense_greedy

SHARED = Path(
    os.environ.get("JAXINFER_SHARED", Path(__file__).resolve().parents[1].parent / "shared")
)
STORIES = SHARED / "models" / "stories260K"
pytestmark = pytest.mark.skipif(
    not STORIES.is_dir(), reason=f"stories260K directory {STORIES} is absent (set JAXINFER_SHARED)"
)
BOS = 1


def _cases():
    if not STORIES.is_dir():
        return []
    return json.loads((STORIES / "greedy_reference.json").read_text())


@functools.cache
def _model():
    return load_llama2c(STORIES / "stories260K.bin")


@functools.cache
def _generate(prompt_ids: tuple[int, ...], max_steps: int) -> tuple[tuple[int, ...], bool]:
    """(greedy tokens after the prompt, stopped on BOS), run.c style. Cached: both tokenizers
    give the same ids."""
    cfg, params = _model()
    out = dense_greedy(
        params, cfg, list(prompt_ids), max_steps - len(prompt_ids) + 1, stop_ids=(BOS,)
    )
    if out and out[-1] == BOS:  # run.c stops on BOS without printing it
        return tuple(out[:-1]), True
    return tuple(out), False


@pytest.mark.parametrize("tok_file", ["tok512.model", "tok512.bin"])
@pytest.mark.parametrize(
    "case", _cases(), ids=lambda c: f"{c['prompt'] or 'BOS'}-{c['max_steps']}".replace(" ", "_")
)
def test_stories260k_greedy_matches_llama2c(case, tok_file):
    from jaxinfer.tokenizers import load_tokenizer

    cfg, _ = _model()
    tok = load_tokenizer(STORIES / tok_file, vocab_size=cfg.vocab_size)
    assert tok.bos_id == BOS
    ids = tok.encode(case["prompt"], add_special_tokens=True)
    assert ids[0] == BOS and BOS not in ids[1:], ids
    generated, stopped = _generate(tuple(ids), case["max_steps"])
    n_tokens = len(ids) - 1 + len(generated)
    assert n_tokens < case["max_steps"] if stopped else n_tokens == case["max_steps"]
    text = tok.decode(list(ids[1:]) + list(generated), skip_special_tokens=True)
    assert text == case["expected"]
