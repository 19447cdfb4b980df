"""``SamplingParams.prompt_logprobs`` against transformers: every prompt position's logprob and
top-k equal ``log_softmax`` of transformers' f32 logits on the same checkpoint.

Two families (``hf_fixtures``: Llama 2 untied, Gemma 2 with a final logit soft-cap), each in one
engine with KV pages of 8 tokens and a 7-token step budget, so prompts are prefilled in uneven
chunks (a 21-token prompt as 2 + 6 + 6 + 6 + 1 beside a decoding request) in batches mixed with
decoding requests; then a prompt sharing two full cached pages with an earlier one (prefix caching
on: a request without prompt logprobs reads them, one with them must not), and a prompt whose
sequence is preempted mid-prefill and recomputed (no entry lost or doubled).
"""

from __future__ import annotations

import hf_fixtures as H
import numpy as np
import pytest
from conftest import STORIES_CLI_FLAGS

from jaxinfer.errors import RequestError
from jaxinfer.llm import LLM
from jaxinfer.sampling.sampler import MAX_LOGPROBS, SamplingParams

FAMILIES = ["llama2", "gemma2"]
ENGINE = dict(
    max_model_len=32,
    page_size=8,
    max_num_seqs=4,
    max_num_batched_tokens=7,
    compilation_cache=False,
    skip_tokenizer_init=True,
)
LOGPROB_ATOL = 1e-4  # f32 vs transformers f32, as test_family_engine_parity (logits max_rel 1e-4)
GAP = 1e-3  # top ids are compared where neighbouring logprobs differ by more than this


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(LLM, reference function: token ids -> log_softmax f64[S, V] of transformers' logits)."""
    name = request.param
    path = H.build_checkpoint(name, str(tmp_path_factory.mktemp("plp") / name))
    return LLM(path, **ENGINE), H.hf_logprob_ref(path)


def check_against(ref_lp, prompt: list[int], got, k: int) -> None:
    """``got`` (RequestOutput.prompt_logprobs) equals the reference at every position."""
    assert got is not None and len(got) == len(prompt), None if got is None else len(got)
    assert got[0] is None
    for i in range(1, len(prompt)):
        e, row = got[i], ref_lp[i - 1]
        assert e.token_id == prompt[i], i
        np.testing.assert_allclose(
            e.logprob, row[prompt[i]], rtol=0, atol=LOGPROB_ATOL, err_msg=f"position {i}"
        )
        assert len(e.top) == k
        order = np.argsort(-row, kind="stable")[:k]
        np.testing.assert_allclose([v for _, v in e.top], row[order], rtol=0, atol=LOGPROB_ATOL)
        srt = np.sort(row)[::-1]
        for j, (tid, _) in enumerate(e.top):
            if (j == 0 or srt[j - 1] - srt[j] > GAP) and (srt[j] - srt[j + 1] > GAP):
                assert tid == order[j], (i, j)


def test_prompt_logprobs_equal_transformers(family):
    llm, ref = family
    decode = H.random_ids(5, 1)
    a = H.random_ids(21, 2)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(
        [decode, a],
        [greedy, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=5, ignore_eos=True)],
    )
    assert outs[0].prompt_logprobs is None and len(outs[0].token_ids) == 12
    assert all(o.error is None for o in outs)
    check_against(ref(a), a, outs[1].prompt_logprobs, 5)
    rec = outs[1].to_record()["prompt_logprobs"]
    assert rec[0] is None and rec[1]["token_id"] == a[1] and len(rec) == len(a)

    # Prefix caching: a's first two pages (16 tokens) are cached now.
    b = a[:16] + H.random_ids(6, 3)
    outs = llm.generate(
        [list(b), list(b), decode],
        [
            SamplingParams(temperature=0, max_tokens=1),
            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
            greedy,
        ],
    )
    assert outs[0].metrics.num_cached_tokens == 16  # the cache holds b's prefix
    assert outs[1].metrics.num_cached_tokens == 0  # ... which prompt logprobs must not read
    check_against(ref(b), b, outs[1].prompt_logprobs, 0)
    assert outs[1].token_ids == outs[0].token_ids


def test_preempted_prompt_recomputed_without_duplicates(family):
    llm, ref = family
    eng, p = llm.engine, H.random_ids(24, 4)
    eng.add_request(
        "pre", p, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, ignore_eos=True)
    )
    outs, steps = [], 0
    while eng.has_unfinished():
        outs += eng.step()
        steps += 1
        seq = eng._requests["pre"].seq if "pre" in eng._requests else None
        if steps == 3 and seq is not None and seq in eng.scheduler.running:
            eng.scheduler.preempt(seq)  # mid-prefill: chunks 0..2 already recorded
    final = outs[-1]
    assert final.finished and final.metrics.num_preemptions == 1
    check_against(ref(p), p, final.prompt_logprobs, 2)


def test_bad_prompt_logprobs_fail_alone(family):
    from jaxinfer.engine.prompt_logprobs import check_request

    llm, _ = family
    with pytest.raises(RequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=MAX_LOGPROBS + 1)
    with pytest.raises(RequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(RequestError, match="prompt_logprobs"):
        SamplingParams.from_dict({"prompt_logprobs": "3"})
    sp = SamplingParams(prompt_logprobs=15)
    with pytest.raises(RequestError, match="prompt_logprobs=15 > 20 or the vocabulary size 10"):
        check_request(sp, 10, None)
    with pytest.raises(RequestError, match="not supported with batch_invariant=True"):
        check_request(sp, 256, "batch_invariant=True")
    check_request(sp, 256, None)
    assert llm.engine.capabilities.prompt_logprobs  # a plain engine computes them
    # A request the engine refuses fails alone; the others in the batch complete.
    p = H.random_ids(6, 5)
    outs = llm.generate(
        [p, p + [10**6], p],
        [
            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3),
            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3),
            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20),
        ],
    )
    assert outs[0].error is None and len(outs[0].prompt_logprobs) == 6
    assert "outside the vocabulary" in outs[1].error
    assert outs[2].error is None and len(outs[2].prompt_logprobs[1].top) == 20


def test_tiles_cover_every_slot(family, monkeypatch):
    """``token_logprobs`` made tile by tile (a tile of 8 over 21 slots: a padded last tile) equals
    numpy's log-softmax of the whole [T, V] logits."""
    import jax.numpy as jnp

    from jaxinfer.engine import prompt_logprobs as plp
    from jaxinfer.models.forward import compute_logits

    llm, _ = family
    eng = llm.engine
    monkeypatch.setattr(plp, "TILE", 8)
    hidden = jnp.asarray(
        np.random.default_rng(0).normal(size=(21, eng.cfg.hidden_size)), jnp.float32
    )
    targets = jnp.asarray(H.random_ids(21, 6), jnp.int32)
    out = plp.token_logprobs(eng.params, eng.cfg, hidden, targets, 4)
    full = H.log_softmax(np.asarray(compute_logits(eng.params, eng.cfg, hidden)))
    np.testing.assert_allclose(
        out.logprobs, full[np.arange(21), np.asarray(targets)], rtol=0, atol=1e-5
    )
    np.testing.assert_allclose(out.top_logprobs, -np.sort(-full, -1)[:, :4], rtol=0, atol=1e-5)


def test_cli_records_prompt_logprobs(tmp_path, stories_dir):
    """``jaxinfer generate``: a record's ``prompt_logprobs`` and ``--prompt-logprobs``. The prompt
    is llama2.c's greedy story from BOS (greedy_reference.json), so at every position its token is
    the top-1 of the distribution before it; a bad value is that record's error alone."""
    import json

    from jaxinfer.cli import main as cli

    story = json.loads((stories_dir / "greedy_reference.json").read_text())[0]
    assert story["prompt"] == ""
    recs = [
        {"id": "story", "prompt": story["expected"][:120], "prompt_logprobs": 2},
        {"id": "bad", "prompt": "Tom", "prompt_logprobs": MAX_LOGPROBS + 1},
        {"id": "flag", "prompt": "Tom"},
        {"id": "off", "prompt": "Tom", "prompt_logprobs": None},
    ]
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rc = cli.main(
        [
            "generate",
            "--model",
            str(stories_dir),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            *STORIES_CLI_FLAGS,  # conftest's shared engine sizes
            "--quiet",
            "--temperature",
            "0",
            "--max-tokens",
            "1",
            "--prompt-logprobs",
            "0",
        ]
    )
    assert rc == 0
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    plp = got["story"]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == got["story"]["usage"]["prompt_tokens"] == 42
    assert all(e["top"][0][0] == e["token_id"] and len(e["top"]) == 2 for e in plp[1:])
    assert "prompt_logprobs must be in [0, 20]" in got["bad"]["error"]
    assert [len(e["top"]) for e in got["flag"]["prompt_logprobs"][1:]] == [0, 0]
    assert "prompt_logprobs" not in got["off"]
