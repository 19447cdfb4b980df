"""Engine-level checks against references from outside the code under test (issue 16).

- Logprobs and penalties: the engine's logprobs equal ``log_softmax`` of transformers' logits on
  the same weights (raw, before penalties, vLLM's ``raw_logprobs``) while repetition, frequency
  and presence penalties are on; each greedy token is the argmax of those logits penalised by the
  formula written out here in numpy (vLLM's ``apply_penalties``: repetition over prompt and output
  tokens, frequency and presence over output tokens only). The plain engine and a speculative
  (n-gram) one are both judged.
- ``min_tokens``: stop tokens are banned for exactly the first ``min_tokens`` outputs (vLLM's
  ``MinTokensLogitsProcessor``: banned while ``len(output) < min_tokens``); a stop string counts
  once the output has ``>= min_tokens`` tokens (vLLM's ``StopChecker``). The reference is
  transformers' unconstrained greedy run: where the stop token would have been chosen, the
  banned run must take transformers' runner-up (plain and speculative engines; EOS and
  ``stop_token_ids``); stop strings are judged on stories260K's own greedy text.
- The host-side logits controls (``step_controls.logits_controls``) against masks written out
  here.
- A vocabulary (8) smaller than the largest top-logprobs list: ``logprobs`` 0 and 8 are
  transformers' values, 9 is that request's error.
"""

from __future__ import annotations

import hf_fixtures as H
import numpy as np
import pytest

from jaxinfer.engine.scheduler import ScheduledRow
from jaxinfer.engine.sequence import Sequence
from jaxinfer.sampling.sampler import SamplingParams

LOGPROB_ATOL = 1e-4  # f32 engine vs transformers f32 (logits agree to ~1e-4 relative)
MARGIN = 1e-3  # penalised top-2 gap below which a float difference could flip the argmax
REP, FREQ, PRES = 1.5, 0.4, 0.6
NEW = 12


class _NoText:
    """The tiny checkpoint has no tokenizer: ids only (``decode`` gives no text)."""

    eos_ids = ()
    bos_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _penalised(raw, prompt, outputs, rep, freq, pres, *, count_prompt=False):
    """vLLM's penalties in numpy for one step: ``raw`` f64[V], ``outputs`` the tokens so far."""
    v = raw.shape[0]
    counts = np.bincount(
        np.asarray(list(outputs) + (list(prompt) if count_prompt else []), np.int64), minlength=v
    )
    seen = counts > 0
    seen[list(prompt)] = True
    x = np.where(seen, np.where(raw > 0, raw / rep, raw * rep), raw)
    return x - freq * counts - pres * (counts > 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama saved by transformers, its loaded params and transformers' model."""
    from jaxinfer.loaders import load

    path = str(tmp_path_factory.mktemp("outside") / "llama")
    H.build_checkpoint("llama2", path)
    m = load(path)
    return m.config, m.params, H.hf_model(path)


def _run(engine, prompts, params):
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return [done[str(i)] for i in range(len(prompts))]


def _prompt_predicting_itself(model, freq_pres: float):
    """A prompt whose raw greedy next token t occurs in it (as its first token) and leads by less
    than ``freq_pres``: frequency/presence penalties that counted prompt tokens would flip the
    first output token. Searched over seeded random prompts."""
    for seed in range(40):
        p = H.sample_tokens(seed=seed)[1, :8].tolist()
        t = int(np.argmax(H.hf_logits(model, [p])[0, -1]))
        p = [t] + p[1:]
        raw = H.hf_logits(model, [p])[0, -1]
        top2 = np.sort(raw)[-2:]
        if int(np.argmax(raw)) == t and 10 * MARGIN < top2[1] - top2[0] < freq_pres - 0.1:
            return p
    raise AssertionError("no prompt found")


@pytest.fixture(scope="module")
def engines(tiny):
    """The plain engine and an n-gram speculative one (R = 2) over the tiny model."""
    from conftest import engine_config

    from jaxinfer.engine.core import EngineCore
    from jaxinfer.engine.runner import ModelRunner
    from jaxinfer.speculative.config import SpecConfig
    from jaxinfer.speculative.strategy import SpeculativeStrategy

    cfg, params, _ = tiny
    ecfg = engine_config(
        cfg,
        params.embed.dtype,
        max_model_len=48,
        page_size=8,
        kv_pages=32,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        attn_impl="xla",
    )
    spec_runner = ModelRunner(cfg, params, ecfg)
    ngram = SpeculativeStrategy(spec_runner, SpecConfig("ngram", 2))
    return {
        None: EngineCore(ModelRunner(cfg, params, ecfg), _NoText()),
        "ngram": EngineCore(spec_runner, _NoText(), speculative=ngram),
    }


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_logprobs_are_raw_and_penalties_count_outputs_vs_transformers(tiny, engines, spec):
    model, eng = tiny[2], engines[spec]
    # Row 0: all three penalties. Row 1: frequency and presence only, on a prompt whose first
    # output would be its own first token (so counting prompt tokens shows, and the n-gram
    # drafter finds a match).
    prompts = [
        H.sample_tokens(seed=3)[0, :8].tolist(),
        _prompt_predicting_itself(model, FREQ + PRES),
    ]
    pen = dict(repetition_penalty=REP, frequency_penalty=FREQ, presence_penalty=PRES)
    rows = [pen, dict(pen, repetition_penalty=1.0)]
    params_rows = [
        SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=4, **kw)
        for kw in rows
    ]
    outs = _run(eng, prompts, params_rows)
    checked = changed = wrong_rule_differs = 0
    for prompt, kw, out in zip(prompts, rows, outs, strict=True):
        got = out.token_ids
        assert len(got) == NEW and len(out.logprobs) == NEW
        raw = H.hf_logits(model, [prompt + got[:-1]])[0, len(prompt) - 1 :].astype(np.float64)
        ref_lp = _log_softmax(raw)  # [NEW, V] raw logprobs of each step
        rule = (kw["repetition_penalty"], FREQ, PRES)
        for i, (tok, lp) in enumerate(zip(got, out.logprobs, strict=True)):
            assert lp.token_id == tok
            assert abs(lp.logprob - ref_lp[i, tok]) <= LOGPROB_ATOL, (spec, i)
            top = np.argsort(-ref_lp[i])[:4]
            assert [t for t, _ in lp.top] == top.tolist(), (spec, i)
            np.testing.assert_allclose([x for _, x in lp.top], ref_lp[i, top], atol=LOGPROB_ATOL)
            want = _penalised(raw[i], prompt, got[:i], *rule)
            a, b = np.sort(want)[-2:][::-1]
            if a - b > MARGIN:
                assert tok == int(np.argmax(want)), (spec, i, tok, int(np.argmax(want)))
                checked += 1
            changed += tok != int(np.argmax(raw[i]))
            wrong = _penalised(raw[i], prompt, got[:i], *rule, count_prompt=True)
            wrong_rule_differs += int(np.argmax(wrong)) != tok
    assert checked >= 2 * NEW - 2
    assert changed >= 2  # the penalties changed greedy choices (the test sees them)
    assert wrong_rule_differs >= 1  # counting prompt tokens in frequency/presence would show


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_min_tokens_boundary_vs_transformers_greedy(tiny, engines, spec):
    """transformers' greedy token at index j (new there, clearly ahead), made a stop token: with
    min_tokens = j + 1 it is banned at j and the run takes transformers' runner-up; with
    min_tokens = j the run stops there. Both as a ``stop_token_ids`` entry and as the engine's EOS
    (with ``ignore_eos`` the EOS path is off and only ``stop_token_ids`` bans). The speculative
    engine bans it at every draft position that decides output j (``min_tokens_left``)."""
    model, eng = tiny[2], engines[spec]
    prompt = H.sample_tokens(seed=3)[0, :8].tolist()
    seq = list(prompt)
    for _ in range(NEW):
        seq.append(int(np.argmax(H.hf_logits(model, [seq])[0, -1])))
    ref = seq[len(prompt) :]
    raw = H.hf_logits(model, [seq[:-1]])[0, len(prompt) - 1 :]
    top2 = np.argsort(-raw, -1)[:, :2]
    gap = np.take_along_axis(raw, top2, -1) @ np.array([1.0, -1.0])
    j = next(i for i in range(3, NEW - 1) if ref[i] not in ref[:i] and gap[i] > 0.1)
    for eos in (False, True):  # ref[j] a stop_token_ids entry, or the engine's EOS
        kw = dict(temperature=0.0, max_tokens=NEW, logprobs=4)
        kw.update(
            dict(stop_token_ids=[]) if eos else dict(stop_token_ids=[ref[j]], ignore_eos=True)
        )
        saved = set(eng.stop_ids)
        eng.stop_ids.clear()
        eng.stop_ids.update({ref[j]} if eos else set())
        try:
            banned, allowed = _run(
                eng,
                [prompt, prompt],
                [SamplingParams(min_tokens=j + 1, **kw), SamplingParams(min_tokens=j, **kw)],
            )
        finally:
            eng.stop_ids.clear()
            eng.stop_ids.update(saved)
        assert allowed.token_ids == ref[: j + 1] and allowed.finish_reason == "stop", eos
        assert allowed.stop_reason == (None if eos else ref[j])
        assert banned.token_ids[: j + 1] == ref[:j] + [int(top2[j, 1])], eos
        assert len(banned.token_ids) > j + 1


def test_logits_controls_ban_for_exactly_min_tokens_and_count_outputs_only():
    """``step_controls.logits_controls`` (the engine's host-side controls): prompt mask = prompt
    tokens, counts = output tokens only (pending tokens excluded: rows with penalties wait for
    them), stop ids and EOS banned while ``len(output) + len(pending) < min_tokens``, EOS not
    banned with ``ignore_eos``."""
    from jaxinfer.engine.step_controls import logits_controls

    v = 16

    def seq(outputs, pending, **kw):
        s = Sequence("r", [5, 6, 5, 9], SamplingParams(temperature=0.0, **kw), seed=0)
        s.output_ids, s.pending = list(outputs), list(pending)
        return s

    rows = [
        (seq([7, 7, 3], [], min_tokens=4, stop_token_ids=[11]), 0),  # 3 < 4: banned
        (seq([7, 7, 3, 8], [], min_tokens=4, stop_token_ids=[11]), 1),  # 4 outputs: free
        (seq([7, 3], [-1], min_tokens=4, stop_token_ids=[11]), 2),  # 2 + 1 pending < 4
        (seq([7, 3], [-1, -2], min_tokens=4, stop_token_ids=[11]), 3),  # 2 + 2: free
        (seq([7], [], min_tokens=3, stop_token_ids=[11], ignore_eos=True), 4),
        (seq([4, 4, 4], [], frequency_penalty=0.5), 5),
    ]
    c = logits_controls([(ScheduledRow(s, 1), r) for s, r in rows], 8, v, {2})
    banned = [set(np.flatnonzero(np.asarray(c.banned[r])).tolist()) for r in range(6)]
    assert banned == [{2, 11}, set(), {2, 11}, set(), {11}, set()]
    for s, r in rows:
        assert set(np.flatnonzero(np.asarray(c.prompt_mask[r]))) == {5, 6, 9}
        np.testing.assert_array_equal(
            np.asarray(c.output_counts[r]), np.bincount(s.output_ids, minlength=v)
        )
    assert not np.asarray(c.banned[6:]).any() and not np.asarray(c.output_counts[6:]).any()


def test_stop_string_counts_from_exactly_min_tokens(stories_llm):
    """A stop string completed by output token j stops the run when min_tokens <= j + 1 and is
    ignored when min_tokens = j + 2 (vLLM checks stop strings once len(output) >= min_tokens)."""
    ids = stories_llm.generate(
        ["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=24)
    )[0].token_ids
    j = 5
    text = stories_llm.generate(
        ["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=j + 1)
    )[0].text
    assert text and stories_llm.tokenizer.decode(ids[: j + 1]).strip() in text
    outs = stories_llm.generate(
        ["Once upon a time"] * 3,
        [
            SamplingParams(temperature=0.0, max_tokens=24, min_tokens=m, stop=[text])
            for m in (j, j + 1, j + 2)
        ],
    )
    for out in outs[:2]:
        assert out.token_ids == ids[: j + 1] and out.finish_reason == "stop"
        assert out.stop_reason == text and out.text == ""
    assert outs[2].token_ids == ids and outs[2].finish_reason == "length"


def test_logprobs_on_a_vocabulary_smaller_than_the_top_list(tmp_path):
    """vocab 8 < MAX_LOGPROBS (20): logprobs 0 and 8 work, values from transformers."""
    torch = pytest.importorskip("torch")
    import transformers

    from jaxinfer.llm import LLM

    cfg = transformers.LlamaConfig(
        vocab_size=8,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    llm = LLM(
        tmp_path,
        skip_tokenizer_init=True,
        max_model_len=16,
        max_num_seqs=2,
        compilation_cache=False,
    )
    prompt = [1, 3, 5]
    outs = llm.generate(
        [prompt, prompt], [SamplingParams(temperature=0, max_tokens=3, logprobs=k) for k in (0, 8)]
    )
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    seq = prompt + outs[1].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].double(), -1).numpy()
    for out, k in zip(outs, (0, 8), strict=True):
        assert out.error is None, out.error
        for j, lp in enumerate(out.logprobs):
            row = ref[len(prompt) - 1 + j]
            assert lp.token_id == int(row.argmax()) and len(lp.top) == k
            np.testing.assert_allclose(lp.logprob, row[lp.token_id], atol=1e-4)
    bad = llm.generate([prompt], SamplingParams(max_tokens=2, logprobs=9))[0]
    assert bad.finish_reason == "error" and "vocabulary size 8" in bad.error
