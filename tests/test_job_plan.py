"""Predicting a job's compile keys (jaxinfer/compile/plan.py, issue 21's cold start). Pure host: the
plan runs no device function. The check against real stories260K engine runs is folded into
tests/test_bucket_reuse.py's engine tests (their runs, no extra compilations)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.compile.plan import plan_job, plan_keys, start_job
from jaxinfer.compile.warmup import all_keys
from jaxinfer.engine.config import EngineConfig
from jaxinfer.sampling.sampler import GREEDY_FLAGS, SamplingParams


def ecfg(**kw):
    base = dict(
        max_model_len=512,
        page_size=8,
        num_pages=600,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        max_prefill_seqs=8,
    )
    return EngineConfig(**{**base, **kw})


F = lambda *k: ("forward", k)  # noqa: E731
S = lambda b: ("sample", b, *GREEDY_FLAGS)  # noqa: E731  (greedy rows: the all-greedy variant)


@pytest.mark.parametrize("asynchronous", [True, False])
def test_one_prompt_hand_worked(asynchronous):
    # 10 prompt tokens: one prefill step of Tp = 32 (the floor), 1 row, 2 pages -> M = 4 (the
    # floor); it samples output 1; outputs 2 and 3 come from two decode steps of one row.
    plan = plan_job(ecfg(async_scheduling=asynchronous), [10], 3, vocab_size=512)
    assert plan.keys == (F(0, 32, 1, 4), S(1), F(1, 0, 0, 4))
    assert plan.first_step == (0, 0, 1)
    assert plan.steps == 3


def test_runs_to_max_model_len_and_the_block_table_widens():
    # max_model_len 80, pages of 8: at most 10 pages a row, M capped at 16. The 60-token prompt
    # fills 8 pages (M = 8); decode step j (j >= 1) computes position 59 + j; position 64 is the
    # 65th token, page 9, so from step 5 on M = 16. Outputs stop at 80 - 60 = 20 tokens: the
    # prefill step and 19 decode steps.
    plan = plan_job(ecfg(max_model_len=80), [60], None, vocab_size=512)
    assert plan.keys == (F(0, 64, 1, 8), S(1), F(1, 0, 0, 8), F(1, 0, 0, 16))
    assert plan.first_step == (0, 0, 1, 5)
    assert plan.steps == 20


def test_bucket_reuse_pads_the_tail_and_compiles_it_after_reuse_steps(monkeypatch):
    import jaxinfer.compile.buckets as bucket_reuse

    # Two 10-token prompts prefilled together (20 tokens, 2 rows: Tp 32, Bp 2), then decode of 2
    # rows (Td 4, the floor). The first stops at 2 outputs; the second decodes alone from step 2
    # to step 5 (6 outputs): Td 1, which bucket reuse pads to the compiled 4 rows.
    reuse, plain = (
        plan_job(ecfg(reuse_compiled_buckets=r), [10, 10], [2, 6], vocab_size=512)
        for r in (True, False)
    )
    head = (F(0, 32, 2, 4), S(2), F(4, 0, 0, 4), S(4))
    assert reuse.keys == head and reuse.steps == 6
    assert plain.keys == head + (F(1, 0, 0, 4), S(1)) and plain.first_step[-1] == 2
    # Wanted 2 times (steps 2 and 3, padded), the exact key is submitted at step 4's choice.
    monkeypatch.setattr(bucket_reuse, "REUSE_STEPS", 2)
    later = plan_job(ecfg(), [10, 10], [2, 6], vocab_size=512)
    assert later.keys == head + (F(1, 0, 0, 4), S(1)) and later.first_step[-2:] == (4, 4)


def test_sampling_options_choose_the_sampling_keys():
    # min_tokens bans stop ids while outputs are few: logits controls for the first 2 tokens;
    # logprobs ask for the top-k variant (min(MAX_LOGPROBS, vocab) = 20 here).
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(0,), logprobs=1)
    keys = plan_keys(ecfg(), [10], 4, vocab_size=512, params=p)
    assert keys == [
        F(0, 32, 1, 4),
        ("sample", 1, True, 20),
        F(1, 0, 0, 4),
        ("sample", 1, False, 20),
    ]


def test_the_greedy_variant_only_when_every_row_is_greedy_without_controls_or_logprobs():
    # Two prompts prefilled together (B' = 2), then decoded together (Td 4, B' = 4). One row
    # sampling at a temperature, with a penalty or asking for logprobs: the general variant.
    greedy = SamplingParams(temperature=0.0)
    for other, flags in (
        (greedy, GREEDY_FLAGS),
        (SamplingParams(temperature=0.7), (False, 0)),
        (SamplingParams(temperature=1e-6), GREEDY_FLAGS),  # < SAMPLING_EPS
        (SamplingParams(temperature=0.0, presence_penalty=0.5), (True, 0)),
        (SamplingParams(temperature=0.0, logprobs=0), (False, 20)),
    ):
        keys = plan_keys(ecfg(), [10, 10], 3, vocab_size=512, params=[greedy, other])
        assert keys == [
            F(0, 32, 2, 4),
            ("sample", 2, *flags),
            F(4, 0, 0, 4),
            ("sample", 4, *flags),
        ], other


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.integers(1, 120), min_size=1, max_size=12),
    maxes=st.lists(st.integers(1, 40), min_size=12, max_size=12),
    budget=st.sampled_from([16, 64, 512]),
    seqs=st.sampled_from([2, 8]),
    reuse=st.booleans(),
    asynchronous=st.sampled_from([True, False]),
)
def test_every_planned_key_is_one_the_buckets_allow(lens, maxes, budget, seqs, reuse, asynchronous):
    """precompile.all_keys enumerates every key the bucket rules allow (tested against the
    scheduler in test_precompile): the plan's keys are among them, each forward key followed by
    a sampling key of its sampled rows B' = next_pow2(Td + Bp) when that B' is new."""
    c = ecfg(
        max_model_len=128,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        max_prefill_seqs=min(seqs, 4),
        reuse_compiled_buckets=reuse,
        async_scheduling=asynchronous,
    )
    plan = plan_job(c, lens, maxes[: len(lens)], vocab_size=64)
    allowed = set(all_keys(c))
    assert set(plan.keys) <= allowed, set(plan.keys) - allowed
    assert len(set(plan.keys)) == len(plan.keys)
    assert list(plan.first_step) == sorted(plan.first_step)
    outputs = sum(min(m, 128 - n) for n, m in zip(lens, maxes, strict=False))
    assert plan.steps <= outputs + sum(math.ceil(n / budget) for n in lens)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), m=st.integers(1, 300), budget=st.sampled_from([16, 100, 512]))
def test_one_prompt_takes_its_prefill_chunks_then_one_step_per_output(n, m, budget):
    # Independent count: ceil(n / budget) chunks (the last samples output 1), then one decode
    # step per further output, outputs capped at max_model_len - n.
    plan = (
        plan_job(ecfg(max_model_len=320, max_num_batched_tokens=budget), [n], m, vocab_size=64)
        if n < 320
        else None
    )
    if plan is not None:
        assert plan.steps == math.ceil(n / budget) + min(m, 320 - n) - 1


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="prompt 1 has 512 tokens"):
        plan_job(ecfg(), [4, 512], 3, vocab_size=64)
    with pytest.raises(ValueError, match="2 max_tokens for 3 prompts"):
        plan_job(ecfg(), [4, 5, 6], [3, 3], vocab_size=64)


def test_start_job_skips_what_it_cannot_plan():
    from types import SimpleNamespace

    from jaxinfer.engine.runner import Capabilities

    eng = SimpleNamespace(
        ecfg=ecfg(), cfg=SimpleNamespace(vocab_size=64), capabilities=Capabilities()
    )
    llm = SimpleNamespace(engines=[eng])
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    bar = SimpleNamespace(expect=lambda n: shown.append(n))
    shown = []
    assert start_job(llm, [[1] * 10], [greedy], None, bar).steps == 3
    assert shown == [3]
    assert start_job(SimpleNamespace(engines=[eng, eng]), [[1]], [greedy], None, bar) is None
    assert start_job(llm, [[1]], [SamplingParams(n=2, max_tokens=3)], None, bar) is None
    assert start_job(llm, [[1] * 600], [greedy], None, bar) is None  # fails validation
    spec = SimpleNamespace(ecfg=eng.ecfg, cfg=eng.cfg, capabilities=Capabilities(precompile=False))
    assert start_job(SimpleNamespace(engines=[spec]), [[1]], [greedy], None, bar) is None
    assert shown == [3]
