"""Prefix caching on every path the engine has (issue 18 point 3): chunked prefill, preemption
and recompute, async scheduling on and off, the XLA attention over the page-major and the
head-major pool, both Pallas kernels (interpret mode), int8 KV pages, speculative decoding
(n-gram and draft model), batch-invariant mode, a failed step and an aborted request; tensor and
data parallel (with prefix-aware routing) run in tests/prefix_cache_sharded_check.py (8 fake CPU
devices, one subprocess). No combination is refused: every one works with caching on.

Reference: the same workload with ``enable_prefix_caching=False`` (the engine the rest of the
suite ties to llama2.c and transformers). Each path shows sharing happened (cache hits, per-output
``num_cached_tokens``), outputs token-identical to the reference, the pool's invariants after
every step, and at the end every page free or cached (``num_free`` = pool - 1).

Sizes are shared by most engines here (max_model_len 32, 8-token pages, 12 pages, 4 rows) so
their steps compile once per layout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import engine_config

from jaxinfer.engine.core import EngineCore
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.sampling.sampler import SamplingParams

Z = 8
SIZES = dict(
    max_model_len=32,
    page_size=Z,
    kv_pages=12,
    max_num_seqs=4,
    max_num_batched_tokens=32,
    max_prefill_seqs=4,
    unroll_layers=False,
)  # lax.scan: compiles ~2x faster
TEXT = "Once upon a time, in a small town, there lived a kind old man who"


@pytest.fixture(scope="module")
def stories(stories_dir):
    from jaxinfer.loaders import load

    return load(stories_dir, dtype="float32")


@pytest.fixture(scope="module")
def base_ids(stories):
    ids = stories.tokenizer.encode(TEXT)
    assert len(ids) >= 28
    return ids


def make_engine(model, caching: bool, **kw) -> EngineCore:
    ecfg = engine_config(
        model.config, model.params.embed.dtype, **{**SIZES, **kw, "enable_prefix_caching": caching}
    )
    return EngineCore(ModelRunner(model.config, model.params, ecfg), model.tokenizer)


def run_waves(eng: EngineCore, waves) -> list:
    """Runs each wave of (prompt ids, params) to completion, in order; returns the final outputs
    in order. A wave may be a function of the outputs so far. Checks the pool's invariants after
    every step and that every page ends free or cached."""
    outs = []
    for w, wave in enumerate(waves):
        if callable(wave):
            wave = wave(outs)
        for i, (ids, sp) in enumerate(wave):
            eng.validate(ids, sp)
            eng.add_request(f"w{w}-{i}", ids, sp)
        done = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
            eng.kv_manager.check_invariants()
        outs += [done[f"w{w}-{i}"] for i in range(len(wave))]
    assert eng.kv_manager.num_free_pages == eng.ecfg.num_pages - 1  # free + cached = the pool
    assert int(eng.kv_manager.pool.refcounts[1:].sum()) == 0  # nobody holds a page
    return outs


def assert_same(on, off):
    """Tokens equal; raw logprobs (float32) to 1e-5 relative + 1e-5 absolute: a cached prefix
    changes a row's chunking and batch, so its float sums run in another order (last bits,
    README 'Reproducibility'); a K/V slot of the wrong token moves them by orders more."""
    for a, b in zip(on, off, strict=True):
        assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), a.request_id
        if b.logprobs is not None:
            assert [lp.token_id for lp in a.logprobs] == a.token_ids
            np.testing.assert_allclose(
                [lp.logprob for lp in a.logprobs],
                [lp.logprob for lp in b.logprobs],
                rtol=1e-5,
                atol=1e-5,
            )


def cached_tokens_formula(prompt, earlier) -> int:
    """Tokens of ``prompt`` a request admitted after ``earlier`` finished (nothing evicted) reads
    from the cache: the longest run of leading full pages equal to the computed tokens of one
    earlier sequence (its prompt + output but the last token, never computed), at most
    ``len(prompt) - 1`` tokens (the last prompt token is always computed)."""
    best = 0
    for ids, out in earlier:
        computed = (list(ids) + list(out.token_ids))[:-1]
        n = 0
        while (n + 1) * Z <= min(len(computed), len(prompt) - 1) and computed[
            n * Z : (n + 1) * Z
        ] == list(prompt[n * Z : (n + 1) * Z]):
            n += 1
        best = max(best, n * Z)
    return best


def waves_for(base, max_tokens=3, logprobs=2):
    """Two waves sharing prefixes: wave 2 runs after wave 1 has finished (cached pages of finished
    sequences) and its own requests share pages admitted in the same step. Prefixes page-aligned
    (16) and not (19), a prompt equal to an earlier one, one a token longer than a page (9),
    greedy and seeded rows."""

    def sp(i):
        return SamplingParams(
            temperature=0.0 if i % 2 else 0.8,
            seed=i,
            max_tokens=max_tokens,
            ignore_eos=True,
            logprobs=logprobs,
        )

    p19, p16 = base[:19], base[:16]
    wave1 = [(p19 + [37, 81, 5], sp(0)), (p16 + [9, 11, 400, 2, 70], sp(1))]

    def wave2(outs):
        a, b = (ids + o.token_ids for (ids, _), o in zip(wave1, outs[:2], strict=True))
        assert len(a) == 25 and len(b) == 24
        return [
            (a[:24] + [7], sp(7)),  # 24 computed tokens of w0-0: a page its decode filled
            # 24 known tokens of w0-1, its last (sampled, never computed): 16 cached
            (b + [7], sp(8)),
            (p19 + [37, 81, 5], sp(2)),  # whole prompt cached but its last token's page
            (p19 + [300, 301], sp(3)),  # 19-token prefix: two full pages
            (p19 + [302, 303, 304], sp(4)),  # the same, admitted in the same step
            (p16 + [9, 11, 400, 2, 70, 71], sp(5)),  # aligned prefix + more
            (base[:9], sp(6)),
        ]  # one token longer than a page

    return [wave1, wave2]


def check_hits(eng, waves, outs):
    """The first two requests of wave 2 (admitted first: nothing evicted yet) read what the
    formula says from the cache: 24 and 16 tokens."""
    stats = eng.prefix_cache_stats()
    n1 = len(waves[0])
    earlier = [(ids, o) for (ids, _), o in zip(waves[0], outs[:n1], strict=True)]
    firsts = [ids for ids, _ in waves[1](outs[:n1])[:2]]
    want = [cached_tokens_formula(ids, earlier) for ids in firsts]
    assert want == [24, 16]
    assert [o.metrics.num_cached_tokens for o in outs[n1 : n1 + 2]] == want
    assert sum(o.metrics.num_cached_tokens for o in outs) == stats["hit_tokens"]
    return stats


# ---------------------------------------------------------------- XLA paths


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("budget", [32, 5], ids=["one-step-prefill", "chunked"])
def test_page_major_pool(stories, base_ids, async_scheduling, budget):
    """The CPU pool layout (page-major); async on and off; prompts prefilled in one step or
    chunked over several (budget 5 < every prompt: each is split, and cached prefixes start
    chunks mid-prompt). Unrolled layers (the CPU default) run with caching in
    tests/test_prefix_cache.py."""
    kw = dict(async_scheduling=async_scheduling, max_num_batched_tokens=budget, kv_page_major=True)
    waves = waves_for(base_ids)
    on = make_engine(stories, True, **kw)
    outs_on = run_waves(on, waves)
    outs_off = run_waves(make_engine(stories, False, **kw), waves)
    assert_same(outs_on, outs_off)
    check_hits(on, waves, outs_on)


def test_request_aborted_mid_prefill(stories, base_ids):
    """A request aborted after two prefill chunks of 5 tokens leaves only its written full pages
    cached: the same prompt again reads 8 tokens (one page) from the cache, not the half-written
    second page, and gives the caching-off output."""
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)
    prompt = base_ids[:22]
    kw = dict(max_num_batched_tokens=5, async_scheduling=False)
    on = make_engine(stories, True, **kw)
    on.add_request("gone", prompt, sp)
    on.step(), on.step()  # two chunks of 5 tokens: page 0 written, page 1 half
    on.abort_request("gone")
    outs_on = run_waves(on, [[(prompt, sp)]])
    assert outs_on[0].metrics.num_cached_tokens == 8
    assert_same(outs_on, run_waves(make_engine(stories, False, **kw), [[(prompt, sp)]]))


def test_head_major_pool_int8_pages(stories, base_ids):
    """The XLA attention over the head-major pool [L, K, P, Z, H] (the TPU/GPU layout) with int8
    pages and their per-token, per-head scales: a shared page's scales come with it. (Float
    head-major pools run cached in the tensor-parallel test.)"""
    kw = dict(kv_page_major=False, kv_cache_dtype="int8")
    waves = waves_for(base_ids)
    on = make_engine(stories, True, **kw)
    outs_on = run_waves(on, waves)
    assert_same(outs_on, run_waves(make_engine(stories, False, **kw), waves))
    check_hits(on, waves, outs_on)
    assert not on.kv_page_major and on.kv.k_scales is not None


def test_preemption_and_recompute(stories, base_ids):
    """A pool too small for the rows (11 pages for 4 rows of up to 4): sequences are preempted
    and recomputed (from the cache: their own pages stay cached when freed), cached pages are
    evicted."""
    sp = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=12, ignore_eos=True, logprobs=2
        )
        for i in range(6)
    ]  # logprobs: the sampling steps compiled
    prompts = [base_ids[:17] + [40 + i] for i in range(3)]
    prompts += [[1] + base_ids[5 + 3 * i : 21 + 3 * i] for i in range(3)]
    waves = [list(zip(prompts, sp, strict=True))]
    on = make_engine(stories, True)
    outs_on = run_waves(on, waves)
    off = make_engine(stories, False)
    assert_same(outs_on, run_waves(off, waves))
    assert on.scheduler.num_preemptions > 0 and off.scheduler.num_preemptions > 0
    assert any(o.metrics.num_preemptions for o in outs_on)
    stats = on.prefix_cache_stats()
    assert [o.metrics.num_cached_tokens for o in outs_on[:3]] == [0, 16, 16]
    assert stats["evictions"] > 0, stats
    # a preempted sequence recomputes from its own cached pages: hits beyond the first admissions
    assert stats["hit_tokens"] > sum(o.metrics.num_cached_tokens for o in outs_on), stats


def test_failed_step_leaves_no_stale_cached_page(stories, base_ids):
    """A step that fails after consuming the (donated) pool: the pool is rebuilt, so no page the
    cache held before is valid any more. Wave 2, after the failure, must equal the caching-off
    run (it would read zeros from pages of wave 1 otherwise)."""
    marker = 497  # a token id whose step fails
    waves = waves_for(base_ids)
    on = make_engine(stories, True)
    real = on.runner.run

    def faulty(inputs, prev=None):
        if marker in np.asarray(inputs.batch.tokens):
            for leaf in jax.tree_util.tree_leaves(on.runner.kv):
                leaf.delete()  # what a failed donated call leaves behind
            raise RuntimeError("INTERNAL: simulated device fault")
        return real(inputs, prev)

    on.runner.run = faulty
    bad = [(base_ids[:16] + [marker], SamplingParams(temperature=0.0, max_tokens=2))]
    outs_on = run_waves(on, [waves[0], bad, waves[1]])
    assert outs_on[2].finish_reason == "error" and "simulated device fault" in outs_on[2].error
    del outs_on[2]
    outs_off = run_waves(make_engine(stories, False), waves)
    assert all(marker not in o.prompt_token_ids + o.token_ids for o in outs_off)
    assert_same(outs_on, outs_off)
    assert on.prefix_cache_stats()["hit_tokens"] > 0


def test_batch_invariant_bitwise(stories, base_ids):
    """batch_invariant=True: tokens and logprobs bitwise equal with caching on and off (a cached
    prefix changes a row's chunking, which batch-invariant mode makes irrelevant)."""
    kw = dict(batch_invariant=True)
    waves = waves_for(base_ids)
    on = make_engine(stories, True, **kw)
    outs_on = run_waves(on, waves)
    outs_off = run_waves(make_engine(stories, False, **kw), waves)
    for a, b in zip(outs_on, outs_off, strict=True):
        assert a.token_ids == b.token_ids
        assert [(lp.token_id, lp.logprob, lp.top) for lp in a.logprobs] == [
            (lp.token_id, lp.logprob, lp.top) for lp in b.logprobs
        ]
    check_hits(on, waves, outs_on)


# ---------------------------------------------------------------- Pallas kernels (interpret mode)


class _IdsOnly:
    """Token ids in and out (a random model has no tokenizer)."""

    eos_ids = ()
    bos_id = None
    has_text = False


def _pallas_waves(prefix, max_tokens=2):
    """One request, then one sharing its first 16-token page (two steps each: interpreted
    kernels are slow)."""
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [[(prefix[:17] + [30], sp)], [(prefix[:17] + [31, 32], sp)]]


def _pallas_check(cfg, params, tokenizer, attn_impl, waves):
    kw = dict(
        max_model_len=32,
        page_size=16,
        kv_pages=6,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        max_prefill_seqs=2,
        unroll_layers=False,
    )
    engines = {
        c: EngineCore(
            ModelRunner(
                cfg,
                params,
                engine_config(
                    cfg, params.embed.dtype, **kw, attn_impl=attn_impl, enable_prefix_caching=c
                ),
            ),
            tokenizer,
        )
        for c in (True, False)
    }
    outs = {c: run_waves(e, waves) for c, e in engines.items()}
    assert_same(outs[True], outs[False])
    assert outs[True][1].metrics.num_cached_tokens == 16
    assert engines[True].prefix_cache_stats()["hit_tokens"] == 16


def test_pallas_tpu_kernel_interpret(stories, base_ids):
    _pallas_check(
        stories.config,
        stories.params,
        stories.tokenizer,
        "pallas_tpu_interpret",
        _pallas_waves(base_ids),
    )


def test_pallas_gpu_kernel_interpret():
    """The GPU kernel cannot tile stories260K (head_dim 8): a tiny random model with head_dim 16
    and two query heads per KV head."""
    from jaxinfer.models.config import ModelConfig
    from jaxinfer.models.params import init_random

    cfg = ModelConfig(
        "llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )
    # jitted whole: one compilation, not one per weight shape (eager, 34 small ones)
    params = jax.jit(init_random, static_argnums=0, static_argnames="scale")(
        cfg, jax.random.key(0), scale=0.3
    )
    prefix = np.random.default_rng(0).integers(3, 64, 20).tolist()
    _pallas_check(cfg, params, _IdsOnly(), "pallas_gpu_interpret", _pallas_waves(prefix))


# ---------------------------------------------------------------- speculative decoding


def _spec_engine(model, caching, method, draft):
    from jaxinfer.speculative.strategy import make_spec_engine

    eng = make_engine(model, caching, async_scheduling=False)
    return make_spec_engine(eng, method, 3, draft, None)


def _abort_at_page_end(eng, ids, sp, mate) -> list[int]:
    """Runs a request beside ``mate`` (prompt ids, params) round by round until its tokens
    (prompt + output) fill whole pages, aborts it there, runs the mate to its end; returns the
    aborted request's tokens."""
    eng.add_request("cut", ids, sp)
    eng.add_request("mate", *mate)
    known = list(ids)
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == "cut":
                known = list(ids) + o.token_ids
        if len(known) % Z == 0 and len(known) > len(ids):
            eng.abort_request("cut")
            while eng.has_unfinished():
                eng.step()
            return known
    raise AssertionError(f"{len(known)} tokens: never stopped at a page end")


@pytest.mark.parametrize("method, draft", [("ngram", None), ("draft-model", "layers:1")])
def test_speculative_rejected_drafts_never_poison_shared_pages(stories, base_ids, method, draft):
    """Rounds write K/V for drafts past a sequence's known tokens and roll rejected ones back;
    only pages of known, computed tokens may be cached. Wave 1 decodes A over three pages with
    rejections; wave 2 reads A's pages written during its decode rounds (prompts = A's tokens up
    to each page boundary + one more), while two new sequences sharing their prefix pages with
    each other decode with rejections of their own. Logprobs are compared too: a rejected draft's
    K/V in a cached slot shows in them even where the greedy token survives."""
    sp = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=2)
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    a = base_ids[:10]
    # Each request below that would run alone runs beside a mate that outlives it (a prompt
    # sharing no page with the others): its prefill and verify rounds then have the two-row
    # buckets of wave 2 (a lone row has buckets of its own), and the mate's lone tail rounds
    # share one bucket: 3 compiled round shapes per method instead of 5.
    mate = (
        [1, 450, 451, 452],
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2),
    )
    assert base_ids[1] != 450
    engines = {c: _spec_engine(stories, c, method, draft) for c in (True, False)}
    first = {c: run_waves(e, [[(a, sp), mate]]) for c, e in engines.items()}
    assert_same(first[True], first[False])
    known = a + first[False][0].token_ids
    assert len(known) == 24  # its last token (position 23) is sampled, never computed
    wave2 = [(known[:n] + [7], short) for n in (16, 24)]
    wave2 += [(base_ids[:18] + [40], short), (base_ids[:18] + [41, 42], short)]
    outs = {c: run_waves(e, [wave2]) for c, e in engines.items()}
    assert_same(outs[True], outs[False])
    # A's pages but the one of its last token (and its first page is base_ids[:8]), then the
    # pages of the third admitted in this step
    assert [o.metrics.num_cached_tokens for o in outs[True]] == [16, 16, 8, 16]
    # A sequence aborted between rounds when its last token (sampled, its K/V not computed: the
    # slot holds a rejected draft's) ends a page: that page must not be cached.
    cut = {c: _abort_at_page_end(e, base_ids[2:11], sp, mate) for c, e in engines.items()}
    assert cut[True] == cut[False]
    after = {c: run_waves(e, [[(cut[c] + [7], short), mate]]) for c, e in engines.items()}
    assert_same(after[True], after[False])
    assert after[True][0].metrics.num_cached_tokens == len(cut[True]) - Z
    rates = {c: [o.metrics.acceptance_rate for o in first[c] + outs[c]] for c in (True, False)}
    assert min(rates[True]) < 1.0, rates  # drafts were rejected
    # the drafts too are the same (the draft model's pool shares the target's page ids, so a
    # cached page must hold the draft model's K/V of its tokens as well)
    assert rates[True] == rates[False]


# ---------------------------------------------------------------- tensor and data parallel


def test_tensor_and_data_parallel_with_prefix_aware_routing():
    """tp=2 x dp=2 on 8 fake CPU devices (tests/prefix_cache_sharded_check.py): the same tokens
    (and logprobs within f32 tolerance) with caching on and off; wave 2's requests land on the
    replica holding their prefix (i % 2 would send the first two to the other one) and read it
    from the cache; a prompt no replica holds goes to i % 2; seeds follow replica i % 2's draws
    (``draw_seeds``), not the routing, so seedless sampled rows equal the caching-off run's."""
    script = Path(__file__).with_name("prefix_cache_sharded_check.py")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    on, off = report["on"], report["off"]
    assert on["devices_per_replica"] == [2, 2]
    assert on["tokens"] == off["tokens"]
    for a, b in zip(on["logprobs"], off["logprobs"], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    # wave 1: P on replica 0, Q on replica 1; wave 2: Q, P, Q go where they are cached
    assert on["replicas"] == [1, 0, 1, 1] and off["replicas"] == [0, 1, 0, 1]
    assert on["cached"] == [0, 0, 16, 16, 16, 0] and off["cached"] == [0] * 6
    assert [s["hit_tokens"] for s in on["stats"]] == [16, 32]
    assert on["predicted_seeds"] == off["predicted_seeds"]
    # rerouted requests (0, 1, 2) carry the seed replica i % 2 draws (request 1: its own)
    assert on["resume_seeds"][:3] == on["predicted_seeds"][:3]
    assert on["pool_free"] == [True, True] and off["pool_free"] == [True, True]
