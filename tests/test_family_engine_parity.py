"""The paged engine (through ``LLM``) against transformers on the non-Llama families: greedy token
ids and logprobs equal transformers' greedy ``generate`` and ``log_softmax`` of its logits.

Families (tiny random checkpoints of ``hf_fixtures.CASES``, saved by transformers): Mistral with
a sliding window (8) shorter than the sequences, Gemma 2 with attention and final logit
soft-caps and alternating windows, Gemma 3 with a local RoPE base on its sliding layers, q/k
norms and a window pattern, Qwen3 with q/k norms. ``test_hf_parity`` checks the dense forward of
the same checkpoints; here the engine's own path runs: KV pages of 8 tokens (each sequence
crosses 2 or 3 page boundaries, in prefill chunks and in decode), an 8-token step budget that
chunks both prompts' prefill (8 + 6 and 8 + 1 tokens), the decode rows reading the pages written
by the chunks. Cheap by design: one sequence at a time and one block-table bucket
(``max_model_len`` = 4 pages) make two forward compilations per family (a prefill chunk, a decode
row); mixed prefill/decode steps, which hold no family-specific code (window, soft-cap and RoPE
choice go by token position in both attention paths), are covered on stories260K
(``test_engine``, ``test_async_scheduling``).
"""

from __future__ import annotations

import hf_fixtures as H
import numpy as np
import pytest

from jaxinfer.llm import LLM
from jaxinfer.sampling.sampler import SamplingParams

FAMILIES = ["mistral", "gemma2", "gemma3", "qwen3"]
# The decode rows' attention: the CPU default ("auto": the native decode kernel on this f32
# page-major pool) for two families, the XLA attention for the other two; each path meets a
# sliding window (gemma2 adds the soft-caps, gemma3 the window pattern and local RoPE).
ATTN_IMPL = {"mistral": "xla", "gemma2": "auto", "gemma3": "xla", "qwen3": "auto"}
NEW = 16
PROMPT_LENS = (14, 9)  # 23 tokens: chunked by the 8-token budget
PAGE = 8
ENGINE = dict(
    max_model_len=32,
    page_size=PAGE,
    max_num_seqs=1,
    max_num_batched_tokens=8,
    compilation_cache=False,
    skip_tokenizer_init=True,
)
TOP = 3
LOGPROB_ATOL = 1e-4  # f32 against transformers f32 (logits agree to max_rel 1e-4, test_hf_parity)
GAP = 1e-3  # top-k ids are compared where neighbouring logprobs differ by more than this


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _prompts() -> list[list[int]]:
    toks = H.sample_tokens(seed=5)  # i32[2, 24]
    flat = np.concatenate([toks[0], toks[1]]).tolist()
    out, at = [], 0
    for n in PROMPT_LENS:
        out.append(flat[at : at + n])
        at += n
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(name, LLM, prompts, transformers' greedy ids per prompt, its logits f32[NEW, V] per
    prompt), built once per family."""
    import torch

    name = request.param
    path = H.build_checkpoint(name, str(tmp_path_factory.mktemp("family") / name))
    model = H.hf_model(path, "float32")
    prompts = _prompts()
    ref_ids, ref_logits = [], []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([p], dtype=torch.long),
                attention_mask=torch.ones((1, len(p)), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NEW,
                min_new_tokens=NEW,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        ref_ids.append(out.sequences[0, len(p) :].tolist())
        ref_logits.append(np.stack([x[0].float().numpy() for x in out.logits]))
    llm = LLM(path, attn_impl=ATTN_IMPL[name], **ENGINE)
    assert llm.engine.attn_impl == {"auto": "cpu_kernel", "xla": "xla"}[ATTN_IMPL[name]]
    return name, llm, prompts, ref_ids, ref_logits


def test_engine_greedy_and_logprobs_equal_transformers(family):
    name, llm, prompts, ref_ids, ref_logits = family
    cfg = llm.engine.cfg
    # The features under test are really exercised by these sizes.
    longest = max(PROMPT_LENS) + NEW
    assert 0 < max(cfg.layer_windows) < longest or name == "qwen3"
    assert min(PROMPT_LENS) > ENGINE["max_num_batched_tokens"] and longest > 3 * PAGE
    assert longest <= ENGINE["max_model_len"]
    assert {
        "gemma2": cfg.attn_logit_softcap and cfg.final_logit_softcap,
        "gemma3": cfg.qk_norm and cfg.rope_local_theta,
        "qwen3": cfg.qk_norm,
        "mistral": True,
    }[name]
    for ids in ref_ids:
        assert len(set(ids)) >= 6, (name, ids)  # a varied continuation, not one repeated token

    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=TOP)
    outs = llm.generate(prompts, sp)
    for i, (out, want, logits) in enumerate(zip(outs, ref_ids, ref_logits, strict=True)):
        assert out.error is None, (name, out.error)
        assert out.token_ids == want, (name, i)
        ref_lp = _log_softmax(logits)  # f64[NEW, V]
        got = np.array([lp.logprob for lp in out.logprobs])
        np.testing.assert_allclose(
            got,
            ref_lp[np.arange(NEW), want],
            rtol=0,
            atol=LOGPROB_ATOL,
            err_msg=f"{name} prompt {i}",
        )
        for j, lp in enumerate(out.logprobs):
            order = np.argsort(-ref_lp[j])[: TOP + 1]
            vals = ref_lp[j, order]
            np.testing.assert_allclose(
                [v for _, v in lp.top],
                vals[:TOP],
                rtol=0,
                atol=LOGPROB_ATOL,
                err_msg=f"{name} prompt {i} step {j}",
            )
            for k in range(TOP):
                if vals[k] - vals[k + 1] > GAP and (k == 0 or vals[k - 1] - vals[k] > GAP):
                    assert lp.top[k][0] == order[k], (name, i, j, k)
