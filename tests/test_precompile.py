"""``jaxinfer.compile.warmup``: the keys it enumerates cover every step the real scheduler makes,
and
after it a workload inside its keys compiles nothing, leaves the KV pool's pages alone and gives
llama2.c's greedy reference outputs.

Judges from outside the code under test: ``build_step_batch`` on the real ``Scheduler``'s steps
(which keys exist), the jitted functions' own cache sizes and ``jax.monitoring``'s compile events
(whether anything compiled), ``greedy_reference.json`` (outputs)."""

import dataclasses

import numpy as np
import pytest
from conftest import STORIES, stories_reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxinfer.compile.warmup import all_keys, precompile, serving_keys, with_sample_keys
from jaxinfer.engine.batch import Buckets, build_step_batch, next_pow2
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.kv_manager import KVCacheManager, PrefixCachingKVCacheManager
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import Sequence
from jaxinfer.models.kv_cache import NULL_PAGE
from jaxinfer.sampling.sampler import GREEDY_FLAGS, SamplingParams


@st.composite
def serving_runs(draw):
    """An engine config and requests (prompt ids, max_tokens, arrival step)."""
    page_size = draw(st.sampled_from([4, 8, 16]))
    max_model_len = draw(st.integers(16, 160))
    max_num_seqs = draw(st.integers(1, 10))
    ecfg = EngineConfig(
        max_model_len=max_model_len,
        page_size=page_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max_num_seqs, 160)),
        max_prefill_seqs=draw(st.integers(1, 6)),
        num_pages=0,
        enable_prefix_caching=draw(st.booleans()),
    )
    per_seq = ecfg.max_pages_per_seq
    num_pages = draw(st.integers(per_seq + 1, max_num_seqs * per_seq + 1))  # small: preemption
    shared = draw(st.lists(st.integers(3, 30), min_size=0, max_size=2 * page_size))
    reqs = []
    for _ in range(draw(st.integers(1, 14))):
        n = draw(st.integers(1, max_model_len - 1))
        k = draw(st.integers(0, min(len(shared), n)))
        prompt = shared[:k] + draw(st.lists(st.integers(3, 30), min_size=n - k, max_size=n - k))
        reqs.append((prompt, draw(st.integers(1, max_model_len - n)), draw(st.integers(0, 40))))
    return ecfg, num_pages, reqs


def scheduled_keys(ecfg: EngineConfig, num_pages: int, reqs) -> list[tuple[tuple, int]]:
    """(bucket key, prefill rows) of every step the real scheduler makes for ``reqs`` (each
    sampled token appended at once, as the engine without async scheduling does)."""
    kv = (
        PrefixCachingKVCacheManager(num_pages, ecfg.page_size, ("t",))
        if ecfg.enable_prefix_caching
        else KVCacheManager(num_pages, ecfg.page_size)
    )
    sched = Scheduler(kv, ecfg.max_num_seqs, ecfg.max_num_batched_tokens, ecfg.max_prefill_seqs)
    out, step = [], 0
    while step <= 40 or sched.has_work():
        for i, (prompt, max_tokens, at) in enumerate(reqs):
            if at == step:
                sched.add(
                    Sequence(
                        str(i),
                        list(prompt),
                        SamplingParams(temperature=0.0, max_tokens=max_tokens),
                        0,
                    )
                )
        step += 1
        s = sched.schedule()
        if not s.rows:
            continue
        _, bk = build_step_batch(s, ecfg.page_size, ecfg.max_pages_per_seq)
        out.append((bk.key, len(s.prefill)))
        for row in s.rows:
            seq = row.seq
            seq.num_computed += row.num_new
            if seq.num_computed == seq.num_tokens:
                seq.output_ids.append(3 + len(seq.output_ids) % 20)
                if (
                    len(seq.output_ids) >= seq.params.max_tokens
                    or seq.num_tokens >= ecfg.max_model_len
                ):
                    sched.finish(seq, "length")
        assert step < 2000, "the scheduler made no progress"
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(serving_runs())
def test_enumerated_keys_cover_every_scheduled_step(run):
    ecfg, num_pages, reqs = run
    every = {k[1] for k in all_keys(ecfg) if k[0] == "forward"}
    served = {k[1] for k in serving_keys(ecfg) if k[0] == "forward"}
    for key, prefill_rows in scheduled_keys(ecfg, num_pages, reqs):
        assert key in every, (key, ecfg)
        if prefill_rows <= 1:
            assert key in served, (key, ecfg)


@pytest.mark.parametrize("budget", [32, 33, 64, 65])
@pytest.mark.parametrize("page_size,max_model_len", [(4, 64), (8, 65), (16, 128)])
def test_enumerated_keys_cover_the_limits_edges(budget, page_size, max_model_len):
    """Chunks that fill the token budget exactly, rows at max_model_len, one page over a
    power of two: the edges a random draw rarely reaches."""
    ecfg = EngineConfig(
        max_model_len=max_model_len,
        page_size=page_size,
        max_num_seqs=5,
        max_num_batched_tokens=budget,
        max_prefill_seqs=2,
        num_pages=0,
        enable_prefix_caching=False,
    )
    n = max_model_len - 1
    reqs = [
        (list(range(3, 3 + n)), 1, 0),
        ([3] * (page_size + 1), n - page_size, 0),
        ([4] * (budget - 1), 2, 1),
        ([5] * 2, 3, 2),
        ([6] * budget, 1, 3),
    ]
    reqs = [(p[:n], min(t, max_model_len - len(p[:n])), at) for p, t, at in reqs]
    every = {k[1] for k in all_keys(ecfg) if k[0] == "forward"}
    got = scheduled_keys(ecfg, 5 * ecfg.max_pages_per_seq + 1, reqs)
    assert {k for k, _ in got} <= every
    assert any(k[1] == next_pow2(budget, 32) for k, _ in got)  # the budget-filling chunk ran


def test_sample_keys_follow_each_new_row_count():
    # each new B' gets the general variant without controls or logprobs and the all-greedy one
    keys = with_sample_keys([(4, 0, 0, 8), (0, 32, 1, 4), (8, 0, 0, 4), (1, 32, 1, 4)])
    G = "greedy"
    assert keys == [
        ("forward", (4, 0, 0, 8)),
        ("sample", 4, False, 0),
        ("sample", 4, False, 0, G),
        ("forward", (0, 32, 1, 4)),
        ("sample", 1, False, 0),
        ("sample", 1, False, 0, G),
        ("forward", (8, 0, 0, 4)),
        ("sample", 8, False, 0),
        ("sample", 8, False, 0, G),
        ("forward", (1, 32, 1, 4)),
        ("sample", 2, False, 0),
        ("sample", 2, False, 0, G),
    ]


# ---------------------------------------------------------------- on a real engine

# Shapes no other test uses (a pool of 11 pages of 32 tokens), so the jit caches start without
# them in any test process. Block-table width M is 4 for every step (128 / 32 = 4 pages). Layers
# as a scan: a third less compile time than unrolled, the same precompile path.
ENGINE = dict(
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=128,
    page_size=32,
    kv_pages=11,
    compilation_cache=False,
    unroll_layers=False,
)
# The steps of ``run_staggered`` (async scheduling): A's prefill, A's decode, A's last decode
# beside B's prefill, B's decode alone; each forward followed by its sampling step of
# B' = next_pow2(Td + Bp) rows; every row greedy, so the all-greedy sampling variant.
WORKLOAD_KEYS = [
    ("forward", (0, 32, 1, 4)),
    ("sample", 1, *GREEDY_FLAGS),
    ("forward", (1, 0, 0, 4)),
    ("forward", (1, 32, 1, 4)),
    ("sample", 2, *GREEDY_FLAGS),
]
# What precompile(WORKLOAD_KEYS) compiles: each B' also gets its general sampling variant.
PRECOMPILED = WORKLOAD_KEYS + [("sample", 1, False, 0), ("sample", 2, False, 0)]
A_TOKENS = 4  # A's output: the first tokens of its reference, still decoding when B arrives


@pytest.fixture(scope="module")
def llm():
    from jaxinfer.llm import LLM

    return LLM(STORIES, **ENGINE)


def reference_cases(llm):
    """(prompt ids, params, expected text) of the two 64-step greedy_reference.json cases."""
    out = []
    for case in stories_reference():
        if case["max_steps"] <= 64:
            ids = llm.tokenizer.encode(case["prompt"])
            out.append(
                (
                    ids,
                    SamplingParams(
                        temperature=0.0,
                        stop_token_ids=(1,),
                        max_tokens=case["max_steps"] - (len(ids) - 1),
                    ),
                    case["expected"],
                )
            )
    assert len(out) == 2
    return out


def run_staggered(engine, cases, on_step=None) -> tuple[str, str]:
    """Case A cut to ``A_TOKENS`` output tokens, then case B added after A's second step;
    returns both texts (prompt + output)."""
    (a_ids, a_sp, _), (b_ids, b_sp, _) = cases
    engine.add_request("A", a_ids, dataclasses.replace(a_sp, max_tokens=A_TOKENS))
    outs, steps = {}, 0
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id] = o
        steps += 1
        if steps == 2:
            engine.add_request("B", b_ids, b_sp)
        if on_step is not None:
            on_step(steps)
    assert len(outs["A"].token_ids) == A_TOKENS
    tok = engine.tokenizer
    return tok.decode(a_ids + outs["A"].token_ids), tok.decode(b_ids + outs["B"].token_ids)


def check_texts(texts, cases):
    a, b = texts
    assert len(a) > len(cases[0][0]) and cases[0][2].startswith(a), a
    assert b == cases[1][2]


def test_precompiled_workload_compiles_nothing_and_keeps_the_pool(llm):
    """One test, one engine: the jit caches start cold only once per process."""
    from jax import monitoring

    engine = llm.engine
    cases = reference_cases(llm)
    events = []
    listener = lambda name, secs, **kw: events.append((name, kw.get("fun_name", "")))  # noqa: E731
    monitoring.register_event_duration_secs_listener(listener)
    try:
        # Two keys compiled ahead of time by two threads, then the rest one by one.
        seen = []
        first = precompile(engine, WORKLOAD_KEYS[:3], lambda k, n, key: seen.append((k, n)), 2)
        # Lowerings, not backend compiles: those a persistent compilation cache would skip.
        lowered = [f for e, f in events if e.endswith("jaxpr_to_mlir_module_duration")]
        assert sorted(seen) == [(1, 2), (2, 2)] and first.new_keys == 4
        assert sum("forward_step" in f for f in lowered) == 2  # the dispatches reused them
        seen = []
        report = precompile(engine, WORKLOAD_KEYS, progress=lambda k, n, key: seen.append((k, n)))
        assert seen == [(1, 3), (2, 3), (3, 3)]
        assert set(report.keys) == set(PRECOMPILED) and report.new_keys == 3
        sizes = engine.runner._forward._cache_size(), engine.runner._sample._cache_size()
        events.clear()
        check_texts(run_staggered(engine, cases), cases)
    finally:
        monitoring.unregister_event_duration_listener(listener)
    assert (engine.runner._forward._cache_size(), engine.runner._sample._cache_size()) == sizes
    assert [e for e in events if "compile" in e[0] or "jaxpr" in e[0]] == []
    assert engine.compile_keys == set(PRECOMPILED)  # the workload stayed inside them

    # Again, with precompile run mid-way: by step 10 B's pages (and A's, freed) hold K/V.
    checked = []

    def precompile_mid_run(step):
        if step == 10:
            kv = engine.kv
            axis = 1 if kv.page_major else 2
            real = [p for p in range(kv.k_pages.shape[axis]) if p != NULL_PAGE]
            before = [np.take(np.array(x), real, axis) for x in (kv.k_pages, kv.v_pages)]
            assert np.abs(before[0]).sum() > 0  # the running requests have written their pages
            precompile(engine, WORKLOAD_KEYS)
            kv = engine.kv
            for b, x in zip(before, (kv.k_pages, kv.v_pages), strict=True):
                np.testing.assert_array_equal(np.take(np.array(x), real, axis), b)
            checked.append(step)

    check_texts(run_staggered(engine, cases, precompile_mid_run), cases)
    assert checked == [10]
    assert (engine.runner._forward._cache_size(), engine.runner._sample._cache_size()) == sizes


def test_runner_compile_builds_what_a_step_dispatches(llm):
    """``ModelRunner.compile`` (ahead of time, from abstract arguments) builds the executables a
    real step of the same keys runs: a prompt-logprobs prefill (its own forward key) with a
    penalty (the sampling variant with logits controls), then a decode step, compile nothing when
    they run (``jax.monitoring``'s lowering and backend-compile events), and the keys the steps
    count are the ones given. Its output is llama2.c's greedy continuation."""
    from jax import monitoring

    from jaxinfer.engine.runner import step_keys

    engine, runner = llm.engine, llm.engine.runner
    (ids, _, expected), _ = reference_cases(llm)
    ids = ids[:9]  # one prefill of Tp = 32 (the floor), one row, M = 4: (0, 32, 1, 4)
    k = min(20, llm.config.vocab_size)
    prefill, decode = Buckets(0, 32, 1, 4), Buckets(1, 0, 0, 4)
    keys = step_keys(prefill, (True, 0), k) + step_keys(decode, (True, 0))
    assert keys[0] == ("forward_prompt_logprobs", (0, 32, 1, 4), k)
    for key in keys:
        runner.compile(key)
    assert not set(keys[:2]) & runner.compile_keys  # compiling does not count a key
    events = []
    listener = lambda name, secs, **kw: events.append(name)  # noqa: E731
    monitoring.register_event_duration_secs_listener(listener)
    try:
        sp = SamplingParams(
            temperature=0.0, max_tokens=2, repetition_penalty=1.0 + 1e-6, prompt_logprobs=1
        )
        engine.add_request("aot", ids, sp)
        while engine.has_unfinished():
            outs = engine.step()
    finally:
        monitoring.unregister_event_duration_listener(listener)
    assert [e for e in events if "backend_compile" in e or "mlir_module" in e] == [], events
    assert set(keys) <= runner.compile_keys
    assert expected.startswith(llm.tokenizer.decode(ids + outs[-1].token_ids))
    assert len(outs[-1].prompt_logprobs) == len(ids)
    with pytest.raises(ValueError, match="cannot lower key .'spec_round'"):
        runner.lower(("spec_round", (16, 4, 4), False, 0))


def test_bad_keys_are_errors_naming_them(llm):
    keys = set(llm.engine.compile_keys)
    with pytest.raises(ValueError, match=r"\(0, 0, 0, 4\)"):
        precompile(llm.engine, [("forward", (0, 0, 0, 4))])
    with pytest.raises(ValueError, match="'prompt_logprobs'"):
        precompile(llm.engine, [("prompt_logprobs", (1, 0, 0, 4))])
    with pytest.raises(ValueError, match=r"\('sample', 16, False, 0\)"):
        precompile(llm.engine, [("forward", (4, 0, 0, 4)), ("sample", 16, False, 0)])
    with pytest.raises(ValueError, match=r"\('sample', 4, True, 0, 'greedy'\)"):
        precompile(llm.engine, [("forward", (4, 0, 0, 4)), ("sample", 4, True, 0, "greedy")])
    with pytest.raises(ValueError, match="workers must be an integer >= 1, got 0"):
        precompile(llm.engine, [("forward", (4, 0, 0, 4))], workers=0)
    assert llm.engine.compile_keys == keys  # nothing ran


def test_serve_warmup_logs_progress_and_total(monkeypatch):
    """``jaxinfer serve --warmup``'s path: every engine's keys precompiled, "compiling k/n" over
    all engines, then the total (``precompile`` itself replaced: tested above)."""
    import types

    import jaxinfer.compile.warmup
    from jaxinfer.cli.prompts_file import UsageError
    from jaxinfer.server.command import precompile_engines

    calls = []

    def fake_precompile(engine, keys, progress):
        fwd = [k for k in keys if k[0] == "forward"]
        calls.append((engine.name, len(fwd)))
        for i, k in enumerate(fwd, 1):
            progress(i, len(fwd), k)

    monkeypatch.setattr(jaxinfer.compile.warmup, "precompile", fake_precompile)
    ecfg = EngineConfig(max_model_len=128, page_size=32, max_num_seqs=4, max_num_batched_tokens=64)
    n = sum(k[0] == "forward" for k in serving_keys(ecfg))
    from jaxinfer.engine.runner import Capabilities

    llm = types.SimpleNamespace(
        engines=[
            types.SimpleNamespace(ecfg=ecfg, name=i, capabilities=Capabilities()) for i in (0, 1)
        ]
    )
    said = []
    precompile_engines(llm, "serving", said.append, interval=0.0)
    assert calls == [(0, n), (1, n)]
    assert [m.split(" step")[0] for m in said] == (
        [f"compiling {k}/{2 * n}" for k in range(1, 2 * n + 1)] + [f"compiled {2 * n}"]
    )
    assert said[-1].startswith(f"compiled {2 * n} step shapes (serving) in ")
    # cover (the default): a cover of all_keys, and at every sampled-row count the sampling
    # variants with logits controls and with logprobs (penalties, min_tokens, logprobs requests)
    got = []
    monkeypatch.setattr(
        jaxinfer.compile.warmup, "precompile", lambda engine, keys, progress: got.append(keys)
    )
    for e in llm.engines:
        e.cfg = types.SimpleNamespace(vocab_size=512)
    precompile_engines(llm, "cover", said.append)
    rows = {k[1] for k in got[0] if k[0] == "sample" and k[2:] == (False, 0)}
    assert rows == {k[1] for k in got[0] if k[0] == "sample" and k[2:] == GREEDY_FLAGS}
    assert rows and {
        k for k in got[0] if k[0] == "sample" and k[2:] not in ((False, 0), GREEDY_FLAGS)
    } == {("sample", b, c, n) for b in rows for c, n in ((True, 0), (False, 20), (True, 20))}
    llm.engines[1].capabilities = Capabilities(precompile=False)  # a speculative engine
    with pytest.raises(UsageError, match="--warmup requests"):
        precompile_engines(llm, "serving", said.append)


@pytest.mark.parametrize(
    "ecfg",
    [
        EngineConfig(max_model_len=512, page_size=8),  # the server's defaults on stories260K
        EngineConfig(
            max_model_len=256,
            page_size=16,
            max_num_seqs=16,
            max_num_batched_tokens=128,
            max_prefill_seqs=4,
        ),
    ],
)
def test_cover_keys_cover_every_step_shape_within_one_bucket(ecfg):
    """Every key of all_keys has a cover key at most one bucket up in each dimension (worked
    out here from the bucket rules: decode rows 1 -> 4, else x2; 0 stays 0), and the cover is
    far smaller than what it covers."""
    from jaxinfer.compile.warmup import cover_keys

    def up(v, dim):
        return 0 if v == 0 else (4 if (dim == 0 and v == 1) else 2 * v)

    every = [k[1] for k in all_keys(ecfg) if k[0] == "forward"]
    cover = cover_keys(all_keys(ecfg))
    fwd = [k[1] for k in cover if k[0] == "forward"]
    for k in every:
        assert any(all(k[d] <= c[d] <= up(k[d], d) for d in range(4)) for c in fwd), k
    assert 0 < len(fwd) * 4 < len(every), (len(fwd), len(every))
    # each cover key comes with its plain sampling variants (general and all-greedy)
    assert {
        ("sample", next_pow2(c[0] + c[2]), *f) for c in fwd for f in ((False, 0), GREEDY_FLAGS)
    } <= set(cover)
