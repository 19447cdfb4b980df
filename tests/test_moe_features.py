"""Engine features on a mixture-of-experts model (the tiny Qwen3-MoE of ``moe_fixtures``: a dense
first layer, then sparse ones), each against transformers on the same checkpoint:

- speculative decoding with a draft model: a separate tiny dense Llama (``hf_fixtures``, the
  same 256-token vocabulary) and the target's own first two layers (``draft_model="layers:2"``:
  a dense and a sparse one, an MoE drafter): greedy tokens equal transformers' greedy
  ``generate`` of the target.
- scoring (``LLM.score``): each continuation token's logprob equals ``log_softmax`` of
  transformers' f32 logits within 1e-4 (``test_family_engine_parity``'s f32 tolerance); a
  second pair sharing the first's context reads its full pages from the prefix cache and is
  held to the same reference.
- the prefix cache, n-gram drafting and prompt logprobs on MoE: ``test_moe_parity``.
"""

from __future__ import annotations

import hf_fixtures as H
import moe_fixtures as M
import numpy as np
import pytest

from jaxinfer.llm import LLM
from jaxinfer.sampling.sampler import SamplingParams

LOGPROB_ATOL = 1e-4  # as test_family_engine_parity / test_moe_parity
NEW = 10
ENGINE = dict(
    max_model_len=48,
    page_size=8,
    max_num_seqs=3,
    max_num_batched_tokens=16,
    compilation_cache=False,
    skip_tokenizer_init=True,
    # Layers under lax.scan (the CPU default unrolls them): each step and speculative round
    # compiles faster, and the values checked against transformers do not depend on the layers'
    # form (MoE with unrolled layers, the CPU default: test_moe_parity).
    unroll_layers=False,
)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(checkpoint path, transformers f32 model) of the tiny Qwen3-MoE."""
    path = M.build_checkpoint("qwen3_moe", str(tmp_path_factory.mktemp("moe") / "qwen3_moe"))
    return path, H.hf_model(path, "float32")


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], dtype=torch.long),
            attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("draft", ["dense_llama", "layers:2"])
def test_draft_model_speculative_equals_transformers(target, draft, tmp_path):
    path, model = target
    if draft == "dense_llama":
        draft = H.build_checkpoint("llama2", str(tmp_path / "draft"))
    a, b = H.random_ids(5, seed=9), H.random_ids(7, seed=10)
    prompts = [a + a + a[:3], b + b[:4]]
    llm = LLM(
        path,
        speculative="draft-model",
        draft_model=draft,
        num_speculative_tokens=3,
        **ENGINE,
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    for out, p in zip(outs, prompts, strict=True):
        assert out.error is None, out.error
        assert out.token_ids == _hf_greedy(model, p), draft
    assert any(o.metrics.acceptance_rate is not None for o in outs)  # rounds ran with drafts


def test_score_equals_transformers(target):
    path, model = target
    ids = H.random_ids(40, seed=11)
    ctx, cont, cont2 = ids[:17], ids[17:26], ids[26:40]  # the context spans two full pages
    llm = LLM(path, **ENGINE)
    results = llm.score([(ctx, cont), (ctx, cont2)])
    for r, c in zip(results, (cont, cont2), strict=True):
        assert r.error is None, r.error
        seq = ctx + c
        lp = H.log_softmax(H.hf_logits(model, [seq])[0])  # f64[S, V]
        want = lp[np.arange(len(ctx) - 1, len(seq) - 1), c]
        np.testing.assert_allclose(r.token_logprobs, want, rtol=0, atol=LOGPROB_ATOL)
        assert abs(r.logprob - want.sum()) <= LOGPROB_ATOL * len(c)
        rows = lp[len(ctx) - 1 : len(seq) - 1]
        greedy = all(row[t] == row.max() for row, t in zip(rows, c, strict=True))
        assert r.is_greedy == greedy
