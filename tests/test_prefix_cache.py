"""Automatic prefix caching (issue 18): shared pages never change an output.

References: llama2.c's greedy outputs (greedy_reference.json) for the cached engine; the same
workload with caching off (itself checked against llama2.c and transformers elsewhere) for
seeded and mixed batches; an independent host model of the page pool (every slot remembers the
exact token prefix whose K/V was written there) for the scheduler's sharing, eviction and
preemption; the number of cached tokens from a longest-common-prefix formula.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine import reference_requests

from jaxinfer.engine import prefix_cache
from jaxinfer.engine.kv_manager import PrefixCachingKVCacheManager
from jaxinfer.engine.prefix_cache import PrefixCachePool
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import SeqStatus, Sequence
from jaxinfer.sampling.sampler import SamplingParams

Z = 8  # page size of every engine here (the CPU default)


# ---------------------------------------------------------------- host model of the pool


def _run_host_workload(prompts, max_tokens, num_pages, budget, max_seqs):
    """Runs prompts through a Scheduler over a PrefixCachingKVCacheManager with a fake device
    step.

    The fake pool maps each slot to the exact token prefix whose K/V a real step would write
    there (K/V at position p depends on tokens[: p + 1]). Each step first writes every row's
    new slots, then checks that every row reads, through its block table, exactly its own
    prefixes at every position it attends to: a shared page written by another sequence, or an
    evicted page reused, would show a foreign prefix. Generated tokens are a function of the
    sequence's tokens, so a preempted sequence recomputes the same output."""
    kv = PrefixCachingKVCacheManager(num_pages, Z, ("test",))
    sched = Scheduler(kv, max_seqs, budget, max_prefill_seqs=4)
    pool: dict[tuple[int, int], tuple[int, ...]] = {}
    seqs = [
        Sequence(f"r{i}", list(p), SamplingParams(max_tokens=max_tokens), 0)
        for i, p in enumerate(prompts)
    ]
    for s in seqs:
        sched.add(s)
    for _ in range(10_000):
        if not sched.has_work():
            break
        out = sched.schedule()
        assert out.rows, "an empty step while requests wait"
        assert all(r.num_new >= 1 for r in out.rows), "a row that computes nothing samples nothing"
        toks = {id(r.seq): r.seq.prompt_ids + r.seq.output_ids for r in out.rows}
        for r in out.rows:  # writes first (each layer writes before any row attends)
            t = toks[id(r.seq)]
            for p in range(r.seq.num_computed, r.seq.num_computed + r.num_new):
                pool[(r.seq.pages[p // Z], p % Z)] = tuple(t[: p + 1])
        for r in out.rows:
            t, end = toks[id(r.seq)], r.seq.num_computed + r.num_new
            for p in range(end):
                assert pool.get((r.seq.pages[p // Z], p % Z)) == tuple(t[: p + 1]), (
                    r.seq.request_id,
                    p,
                )
        for r in out.rows:
            seq = r.seq
            seq.num_computed += r.num_new
            if seq.num_computed == seq.num_tokens:
                seq.output_ids.append(hash(tuple(seq.prompt_ids + seq.output_ids)) % 50)
                if len(seq.output_ids) >= max_tokens:
                    sched.finish(seq, "length")
        kv.check_invariants()
    else:
        raise AssertionError("workload did not finish")
    return seqs, kv, sched


def _expected_output(prompt, max_tokens):
    t = list(prompt)
    for _ in range(max_tokens):
        t.append(hash(tuple(t)) % 50)
    return t[len(prompt) :]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    cuts=st.lists(
        st.tuples(st.integers(0, 40), st.lists(st.integers(0, 3), max_size=12)),
        min_size=1,
        max_size=10,
    ),
    max_tokens=st.integers(1, 12),
    num_pages=st.integers(8, 40),
    budget=st.sampled_from([8, 16, 64]),
)
def test_host_pool_never_serves_a_foreign_or_evicted_page(
    base, cuts, max_tokens, num_pages, budget
):
    # Prompts share prefixes of random lengths (page-aligned or not, whole prompts, none) over a
    # 4-token alphabet, so many pages collide in content; small pools force eviction and
    # preemption. Sequences fit the pool alone (the engine checks this at construction).
    prompts = [base[:c] + tail or [0] for c, tail in cuts]
    need = max(-(-(len(p) + max_tokens) // Z) for p in prompts) + 1
    num_pages = max(num_pages, need + 1)
    seqs, kv, sched = _run_host_workload(prompts, max_tokens, num_pages, budget, max_seqs=4)
    for s, p in zip(seqs, prompts, strict=True):
        assert s.status is SeqStatus.FINISHED and s.output_ids == _expected_output(p, max_tokens)
    # Every page is free or cached once all are done: nothing leaked, no reference left.
    assert (kv.pool.refcounts[1:] == 0).all()
    assert kv.num_free_pages == num_pages - 1


def test_host_pool_shares_and_evicts_lru():
    a, b = list(range(20)), list(range(16)) + [99] * 4
    seqs, kv, _ = _run_host_workload([a], 1, 6, 64, 4)
    assert kv.stats()["cached_pages"] == 2  # pages of tokens 0..15 (position 20 never written)
    seqs, kv, sched = _run_host_workload([a, b, a], 1, 6, 64, 1)
    # b hits both full pages of a's prefix, the second a all that may be cached (19 tokens: 2 pages)
    assert [s.num_cached_tokens for s in seqs] == [0, 16, 16]
    st_ = kv.stats()
    assert (st_["queried_tokens"], st_["hit_tokens"]) == (60, 32)
    # 4 usable pages, 3 per sequence: the second sequence evicts one of a's cached pages, the
    # tail one (vLLM's order: a sequence's last pages are evicted first), so a finds its first
    # page again; it then evicts the second sequence's tail page.
    seqs, kv, _ = _run_host_workload([a, [7] * 20, a], 1, 5, 64, 1)
    assert seqs[2].num_cached_tokens == Z and kv.stats()["evictions"] == 2


def test_hash_collisions_cost_a_miss_not_a_wrong_page(monkeypatch):
    # Every page hashes alike: only the stored token ids (and parent) tell pages apart.
    monkeypatch.setattr(prefix_cache, "page_hash", lambda parent, tokens, extra=(): b"same")
    pool = PrefixCachePool(10, Z)
    p1 = pool.allocate(1)
    pool.cache_page(p1[0], b"same", None, list(range(8)))
    assert pool.match_prefix(list(range(1, 9)) + [0], 1) == ([], [])
    assert pool.match_prefix(list(range(8)) + [0], 1) == (p1, [b"same"])
    # the same tokens under another request key (a LoRA adapter's, later): a miss too
    assert pool.match_prefix(list(range(8)) + [0], 1, extra_keys=("adapter-1",)) == ([], [])
    prompts = [list(range(1, 30)), list(range(2, 31)), list(range(1, 20)) + [5] * 9]
    seqs, _, _ = _run_host_workload(prompts, 4, 20, 64, 4)
    for s, p in zip(seqs, prompts, strict=True):
        assert s.output_ids == _expected_output(p, 4)


# ---------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def cached_llm(stories_dir):
    from jaxinfer.llm import LLM

    # The session's engine sizes (max_num_seqs=32), so jax's compiled steps are shared.
    return LLM(stories_dir, max_num_seqs=32, compilation_cache=False)


@pytest.fixture(scope="module")
def plain_llm(stories_dir):
    from jaxinfer.llm import LLM

    return LLM(stories_dir, max_num_seqs=32, compilation_cache=False, enable_prefix_caching=False)


def _lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_llama2c_references_reproduced_from_shared_pages(cached_llm):
    # The reference prompts are shorter than a page, so the cached pages are those of their
    # outputs: a prompt of the reference prompt plus the first k reference tokens continues
    # greedily into the rest of the reference, with its first 3 pages read from the cache.
    import dataclasses

    llm = cached_llm
    refs = reference_requests(llm.tokenizer)
    outs = llm.generate([ids for ids, _, _ in refs] * 2, [sp for _, sp, _ in refs] * 2)
    for (ids, _, expected), out in zip(refs * 2, outs, strict=True):
        assert llm.tokenizer.decode(ids + out.token_ids) == expected
    before = llm.engine.prefix_cache_stats()["hit_tokens"]
    prompts, params = [], []
    for (ids, sp, _), out in zip(refs, outs, strict=False):
        k = 3 * Z + 1 - len(ids)
        assert len(out.token_ids) > k + 4
        prompts.append(ids + out.token_ids[:k])
        params.append(dataclasses.replace(sp, max_tokens=sp.max_tokens - k))
    for (_ids, _, expected), p, sp in zip(refs, prompts, params, strict=True):  # alone
        out = llm.generate([p], sp)[0]
        assert llm.tokenizer.decode(p + out.token_ids) == expected
        assert out.metrics.num_cached_tokens == 3 * Z
    assert llm.engine.prefix_cache_stats()["hit_tokens"] == before + 3 * 3 * Z


def _shared_prefix_batch(tok):
    """Prompts sharing prefixes of many lengths with a base prompt: page-aligned (16), not
    (13), one token longer than a page (9), the whole base, the base plus one token, none."""
    rng = np.random.default_rng(0)
    base = tok.encode(
        "Once upon a time, there was a little girl named Lily. She loved to play "
        "with her toys in the big garden behind the house."
    )
    assert len(base) > 24

    def tail(n):
        return [int(x) for x in rng.integers(3, 500, n)]

    prompts = [
        base,
        base[:16] + tail(7),
        base[:13] + tail(11),
        base[:9] + tail(5),
        list(base),
        base + tail(1),
        tail(20),
        base[:16] + tail(7),
        base[:8],
        base[:2] + tail(3),
    ]
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=100 + i, max_tokens=12 + i)
        for i in range(len(prompts))
    ]
    return prompts, params


def test_shared_prefixes_token_identical_and_cached_as_the_formula_says(cached_llm, plain_llm):
    prompts, params = _shared_prefix_batch(cached_llm.tokenizer)
    want = plain_llm.generate(prompts, params)
    cached_llm.engine.kv_manager.clear_cache()  # this test counts its own hits from a cold cache
    got = cached_llm.generate(prompts, params)
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids and g.text == w.text
    # Admission is in order, and each admitted prompt's full pages are cached at once, so prompt
    # i finds the longest full-page prefix it shares with an earlier prompt, capped so its last
    # token is computed.
    for i, (p, g) in enumerate(zip(prompts, got, strict=True)):
        best = max((_lcp(p, q) for q in prompts[:i]), default=0)
        assert g.metrics.num_cached_tokens == min(best // Z, (len(p) - 1) // Z) * Z, i
    assert sum(g.metrics.num_cached_tokens for g in got) > 0
    # Run again: every prompt now starts from its own cached pages, outputs unchanged.
    again = cached_llm.generate(prompts, params)
    for w, g, p in zip(want, again, prompts, strict=True):
        assert g.token_ids == w.token_ids
        assert g.metrics.num_cached_tokens == (len(p) - 1) // Z * Z
    cached_llm.engine.kv_manager.check_invariants()
    assert (cached_llm.engine.kv_manager.pool.refcounts[1:] == 0).all()


@pytest.mark.parametrize("length", [3 * Z + 1, 3 * Z])
def test_first_token_logprobs_of_a_fully_cached_prompt(cached_llm, plain_llm, length):
    # 3Z + 1: all but the last token sit in full pages; 3Z: the whole prompt does, and its last
    # page is computed again so the last token has logits.
    ids = cached_llm.tokenizer.encode("The cat sat on the mat and looked at the big red ball.")
    ids = (ids * 3)[:length]
    sp = SamplingParams(temperature=0.0, max_tokens=3, logprobs=4)
    want = plain_llm.generate([ids], sp)[0]
    cached_llm.generate([ids], sp)
    got = cached_llm.generate([ids], sp)[0]
    assert got.metrics.num_cached_tokens == (length - 1) // Z * Z
    assert got.token_ids == want.token_ids
    for w, g in zip(want.logprobs, got.logprobs, strict=True):
        np.testing.assert_allclose(g.logprob, w.logprob, rtol=1e-5, atol=1e-5)  # f32
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        np.testing.assert_allclose(
            [x for _, x in g.top], [x for _, x in w.top], rtol=1e-5, atol=1e-5
        )


def test_tiny_pool_evicts_and_preempts_with_identical_outputs(stories_dir):
    from jaxinfer.llm import LLM

    # max_num_seqs as the session's engines (the sampling steps' shapes are shared); the pool
    # holds 19 pages of 8 tokens for up to 10 sequences of ~90 tokens. Its forward steps are its
    # own (the pool's size): layers in lax.scan, which compiles ~2x faster (the unrolled CPU
    # default runs with caching in the tests above).
    kw = dict(
        max_num_seqs=32,
        max_model_len=96,
        kv_pages=20,
        unroll_layers=False,
        compilation_cache=False,
    )
    cached, plain = LLM(stories_dir, **kw), LLM(stories_dir, enable_prefix_caching=False, **kw)
    tok = cached.tokenizer
    heads = [
        tok.encode("Once upon a time, there was a little dog named Max."),
        tok.encode("Tom and his dog went to the park to play ball."),
    ]
    prompts = [
        heads[i % 2] + tok.encode(w)
        for i, w in enumerate(
            [
                "He",
                "She ran",
                "It was fun",
                "They",
                "The sun",
                "A bird",
                "Mom",
                "Then",
                "One day",
                "Later",
            ]
        )
    ]
    params = [
        SamplingParams(temperature=0.0 if i % 3 else 0.7, seed=i, max_tokens=32)
        for i in range(len(prompts))
    ]
    want = plain.generate(prompts, params)
    got = cached.generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    stats = cached.engine.prefix_cache_stats()
    assert stats["evictions"] > 0 and stats["hit_tokens"] > 0, stats
    assert sum(g.metrics.num_preemptions for g in got) > 0
    kv = cached.engine.kv_manager
    kv.check_invariants()
    assert (kv.pool.refcounts[1:] == 0).all() and kv.num_free_pages == kv.num_pages - 1


def test_compilations_stop_growing_with_cache_hits(cached_llm):
    prompts, params = _shared_prefix_batch(cached_llm.tokenizer)
    cached_llm.generate(prompts, params)
    cached_llm.generate(prompts, params)  # every prompt now hits: other prefill buckets
    n = cached_llm.num_compilations
    cached_llm.generate(prompts, params)
    assert cached_llm.num_compilations == n


def test_cli_summary_hit_rate_and_no_prefix_caching(tmp_path, capsys):
    from test_cli import _records, _run, _write_jsonl

    header = "Once upon a time, there was a little girl named Lily. She loved to play outside. "
    recs = [
        {"id": f"q{i}", "prompt": header + q, "max_tokens": 5}
        for i, q in enumerate(["Tom", "One day", "The sun was", "She"])
    ]
    prompts = _write_jsonl(tmp_path / "p.jsonl", recs)
    rc_on, on = _run(tmp_path, prompts, tmp_path / "on.jsonl", "--temperature", "0", capsys=capsys)
    rc_off, off = _run(
        tmp_path,
        prompts,
        tmp_path / "off.jsonl",
        "--temperature",
        "0",
        "--no-prefix-caching",
        capsys=capsys,
    )
    assert rc_on == rc_off == 0
    got_on, got_off = _records(tmp_path / "on.jsonl"), _records(tmp_path / "off.jsonl")
    assert [r["token_ids"] for r in got_on] == [r["token_ids"] for r in got_off]
    cached = sum(r["metrics"]["num_cached_tokens"] for r in got_on)
    assert cached > 0 and on["prefix_cached_tokens"] == cached
    # Every record was admitted once: the rate is cached / prompt tokens.
    assert on["prefix_cache_hit_rate"] == round(cached / on["prompt_tokens"], 4)
    assert off["prefix_cache_hit_rate"] == 0 and off["prefix_cached_tokens"] == 0
    assert all(r["metrics"]["num_cached_tokens"] == 0 for r in got_off)


def test_n_samples_prefill_the_prompt_once(cached_llm):
    # The n completions are admitted together: the first computes the prompt's full pages, the
    # others read them (cached as soon as the step that writes them is scheduled).
    ids = cached_llm.tokenizer.encode(
        "Once upon a time, there was a little dog named Max. "
        "He liked to run in the park with his friend."
    )
    ids = ids + [ids[-1]] * (4 * Z + 3 - len(ids)) if len(ids) < 4 * Z + 3 else ids[: 4 * Z + 3]
    cached_llm.engine.kv_manager.clear_cache()  # earlier tests cached prompts with this start
    before = cached_llm.prefix_cache_stats()
    out = cached_llm.generate([ids], SamplingParams(n=4, temperature=0.8, seed=7, max_tokens=6))[0]
    after = cached_llm.prefix_cache_stats()
    assert len(out.outputs) == 4
    assert after["queried_tokens"] - before["queried_tokens"] == 4 * len(ids)
    assert after["hit_tokens"] - before["hit_tokens"] == 3 * 4 * Z  # 3 siblings x 4 full pages
