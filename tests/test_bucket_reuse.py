"""Reusing a compiled bucket one size up (jaxinfer/compile/buckets.py, issue 21's cold start)."""

import dataclasses

import pytest
from test_engine import reference_requests

from jaxinfer.compile.buckets import BucketReuse, choose_buckets
from jaxinfer.compile.plan import plan_job
from jaxinfer.engine.batch import Buckets
from jaxinfer.sampling.sampler import GREEDY_FLAGS, SamplingParams

PLAIN = (False, 0)  # sampling flags of the general variant: no logits controls, no logprobs


def keys(*forward, samples=()):
    return {("forward", k) for k in forward} | {("sample", b, False, 0) for b in samples}


@pytest.mark.parametrize(
    "need, compiled, expected",
    [
        # compiled exactly: itself
        ((4, 0, 0, 8), keys((4, 0, 0, 8), (8, 0, 0, 8), samples=(4, 8)), (4, 0, 0, 8)),
        # one bucket up in rows (4 -> 8), its sampling variant compiled: reused
        ((4, 0, 0, 8), keys((8, 0, 0, 8), samples=(8,)), (8, 0, 0, 8)),
        # a lone decode row's next bucket is 4 rows (batch.decode_bucket's floor)
        ((1, 0, 0, 8), keys((4, 0, 0, 8), samples=(4,)), (4, 0, 0, 8)),
        # one up in rows and in pages at once
        ((4, 0, 0, 8), keys((8, 0, 0, 16), samples=(8,)), (8, 0, 0, 16)),
        # two buckets up (4 -> 16 rows, or 8 -> 32 pages): too costly, compile the exact key
        ((4, 0, 0, 8), keys((16, 0, 0, 8), (4, 0, 0, 32), samples=(4, 16)), (4, 0, 0, 8)),
        # smaller in any dimension cannot hold the step
        ((4, 0, 0, 8), keys((8, 0, 0, 4), samples=(8,)), (4, 0, 0, 8)),
        # a decode-only step never takes a key with a prefill region, nor the reverse
        ((4, 0, 0, 8), keys((4, 32, 1, 8), samples=(8,)), (4, 0, 0, 8)),
        ((0, 32, 1, 4), keys((4, 32, 1, 4), samples=(8,)), (0, 32, 1, 4)),
        # the padded rows' sampling variant not compiled: still padded (a sampling compile is far
        # cheaper than a forward one) ...
        ((4, 0, 0, 8), keys((8, 0, 0, 8), samples=(4,)), (8, 0, 0, 8)),
        # ... but a holder whose sampling variant is compiled wins over a cheaper one without
        ((4, 0, 0, 8), keys((8, 0, 0, 8), (4, 0, 0, 16), samples=(8,)), (8, 0, 0, 8)),
        # one prefill row's next bucket is 2 rows (the 1 -> 4 floor is the decode rows' only)
        ((0, 32, 1, 4), keys((0, 32, 4, 4), samples=(4,)), (0, 32, 1, 4)),
        ((0, 32, 1, 4), keys((0, 32, 2, 4), samples=(2,)), (0, 32, 2, 4)),
        # mixed steps: prefill tokens and rows one up each
        ((4, 32, 1, 8), keys((4, 64, 2, 8), samples=(8,)), (4, 64, 2, 8)),
        # the cheapest holder (fewest tokens) wins
        ((4, 32, 1, 8), keys((8, 64, 1, 8), (8, 32, 1, 16), samples=(16,)), (8, 32, 1, 16)),
    ],
)
def test_choice_against_hand_worked_cases(need, compiled, expected):
    assert choose_buckets(Buckets(*need), compiled, PLAIN).key == expected


def test_sampling_flags_select_the_variant():
    # two holders; only (8, 0, 0, 16)'s rows (8) have the controls variant and the all-greedy
    # one, only (4, 0, 0, 16)'s rows (4) the plain one and the logprobs one
    compiled = keys((8, 0, 0, 16), (4, 0, 0, 16)) | {
        ("sample", 8, True, 0),
        ("sample", 8, *GREEDY_FLAGS),
        ("sample", 4, False, 0),
        ("sample", 4, False, 20),
    }
    need = Buckets(4, 0, 0, 8)
    assert choose_buckets(need, compiled, PLAIN).key == (4, 0, 0, 16)
    assert choose_buckets(need, compiled, GREEDY_FLAGS).key == (8, 0, 0, 16)
    assert choose_buckets(need, compiled, (True, 0)).key == (8, 0, 0, 16)
    assert choose_buckets(need, compiled, (False, 20)).key == (4, 0, 0, 16)
    assert choose_buckets(need, compiled, (True, 20)).key == (4, 0, 0, 16)  # none: cheapest


def _dispatched_shapes(eng, run, monkeypatch):
    """(Td, Tp, Bp, M) of every step dispatched, read from the arrays the runner gets."""
    shapes = []

    def spy(inputs, prev=None):
        md = inputs.batch.md
        td = int(md.num_decode)
        t, (b, m) = len(inputs.batch.tokens), md.block_tables.shape
        shapes.append((td, t - td, b - td, m))
        return run(inputs, prev)

    monkeypatch.setattr(eng.runner, "run", spy)
    return shapes


def test_tail_of_a_batch_compiles_fewer_shapes_same_outputs(stories_llm, monkeypatch):
    """A batch whose rows finish one by one (decode rows 8 -> 4 -> 1 while the block tables grow)
    runs on fewer distinct shapes with reuse than without, and its greedy outputs are still the
    llama2.c references; every padded step's shape holds the step (build_step_batch checks)."""
    eng, tok = stories_llm.engine, stories_llm.tokenizer
    refs = [r for r in reference_requests(tok) if r[1].max_tokens <= 64]  # a short tail
    assert refs
    prompts = [ids for ids, _, _ in refs] + [tok.encode("Tom had a red ball")] * 4
    params = [sp for _, sp, _ in refs] + [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 12, 30, 66)
    ]
    runs, run, sample = {}, eng.runner.run, eng.runner._sample
    # (reuse, async): the third run, synchronous, meets the second's shapes (compiles nothing)
    for reuse, asynchronous in ((False, True), (True, True), (True, False)):
        eng.kv_manager.clear_cache()  # the same steps both times: no prefix cache hits
        ecfg = dataclasses.replace(
            eng.ecfg, reuse_compiled_buckets=reuse, async_scheduling=asynchronous
        )
        monkeypatch.setattr(eng, "buckets", BucketReuse(eng.runner, reuse, eng.buckets.compiler))
        monkeypatch.setattr(eng, "async_scheduling", asynchronous)
        monkeypatch.setattr(eng.runner, "compile_keys", set())  # as a fresh engine
        shapes = _dispatched_shapes(eng, run, monkeypatch)
        greedy_calls = []

        def sample_spy(*a, calls=greedy_calls, **kw):
            calls.append(kw.get("greedy"))
            return sample(*a, **kw)

        sample_spy.lower = sample.lower
        monkeypatch.setattr(eng.runner, "_sample", sample_spy)  # the jitted sampling call
        outs = stories_llm.generate(prompts, params)
        for (ids, _, expected), out in zip(refs, outs, strict=False):
            assert tok.decode(ids + out.token_ids) == expected
        # All rows greedy without logprobs or controls: every step ran the all-greedy variant.
        assert greedy_calls == [True] * len(shapes)
        assert {k[2:] for k in eng.compile_keys if k[0] == "sample"} == {GREEDY_FLAGS}
        # Every output ran to max_tokens, so the job's plan (jaxinfer.compile.plan: pure host)
        # predicts exactly the keys the engine counted.
        assert all(o.finish_reason == "length" for o in outs), [o.finish_reason for o in outs]
        plan = plan_job(
            ecfg,
            [len(p) for p in prompts],
            [p.max_tokens for p in params],
            vocab_size=eng.cfg.vocab_size,
            params=params,
            prompt_ids=prompts,
        )
        assert set(plan.keys) == eng.compile_keys, (plan.keys, eng.compile_keys)
        assert plan.steps == len(shapes)
        runs[reuse, asynchronous] = (shapes, [o.token_ids for o in outs])
    (plain, toks_plain), (reused, toks_reused) = runs[False, True], runs[True, True]
    assert runs[True, False][1] == toks_reused
    assert len(set(reused)) < len(set(plain)), (sorted(set(plain)), sorted(set(reused)))
    assert len(reused) == len(plain)  # the same steps, some of them padded
    assert toks_reused == toks_plain


def test_a_persistent_padded_shape_compiles_in_the_background(stories_llm, monkeypatch):
    """A lone decode row padded to 4 rows for ``REUSE_STEPS`` steps gets its exact shape compiled
    on the background thread; the padded steps go on meanwhile, and the exact shape runs only
    once that compile is done. Its text is still llama2.c's reference."""
    import jaxinfer.compile.buckets as bucket_reuse

    eng, tok = stories_llm.engine, stories_llm.tokenizer
    ((ids, sp, expected),) = [
        r
        for r in reference_requests(tok)
        if r[2].startswith("Once upon a time") and r[1].max_tokens < 100
    ]
    monkeypatch.setattr(bucket_reuse, "REUSE_STEPS", 3)
    monkeypatch.setattr(eng.runner, "compile_keys", set())
    compiler = bucket_reuse.BackgroundCompiler(eng.runner)
    submit = compiler.submit

    def submit_and_wait(need, flags, compiled):  # deterministic: done by the next step
        keys = submit(need, flags, compiled)
        compiler.wait()
        return keys

    monkeypatch.setattr(compiler, "submit", submit_and_wait)
    waited, wait_for = [], compiler.wait_for
    monkeypatch.setattr(compiler, "wait_for", lambda key: (waited.append(key), wait_for(key)))
    reuse = BucketReuse(eng.runner, True, compiler)
    monkeypatch.setattr(eng, "buckets", reuse)
    eng.kv_manager.clear_cache()
    seen, run = [], eng.runner.run

    def spy(inputs, prev=None):
        key = inputs.buckets.key
        seen.append((key, key in compiler.compiled))
        return run(inputs, prev)

    monkeypatch.setattr(eng.runner, "run", spy)
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = stories_llm.generate([ids] + [tok.encode("Tom had a red ball")] * 3, [sp] + [short] * 3)
    assert tok.decode(ids + outs[0].token_ids) == expected
    # The lone row (M = 4 pages while under 64 tokens): padded to 4 rows for REUSE_STEPS steps;
    # the next step's choice (its buckets are chosen once) starts the compile and still runs
    # padded; the compile is done at once here, so the step after runs exact.
    lone = [(key, ready) for key, ready in seen if key in ((1, 0, 0, 4), (4, 0, 0, 4))]
    first_exact = next(i for i, (key, _) in enumerate(lone) if key == (1, 0, 0, 4))
    assert reuse.wanted[(1, 0, 0, 4)] == 3 + 1
    assert [key for key, _ in lone[first_exact - 4 : first_exact]] == [(4, 0, 0, 4)] * 4
    assert all(ready for key, ready in lone[first_exact:]), lone
    assert compiler.compiled == [(1, 0, 0, 4)] and not compiler.pending
    # Each dispatch first waits for a background compile of the key it runs (none pending here).
    assert waited == [key for key, _ in seen]
    # The plan (jaxinfer.compile.plan) predicts the keys, the background one included (every
    # output ran to max_tokens: the reference too).
    assert [o.finish_reason for o in outs] == ["length"] * 4
    prompts = [ids] + [tok.encode("Tom had a red ball")] * 3
    plan = plan_job(
        eng.ecfg,
        [len(p) for p in prompts],
        [sp.max_tokens] + [4] * 3,
        vocab_size=eng.cfg.vocab_size,
        params=[sp] + [short] * 3,
        prompt_ids=prompts,
    )
    assert set(plan.keys) == eng.compile_keys
    assert ("forward", (1, 0, 0, 4)) in eng.compile_keys  # counted once submitted
    # greedy rows: the background compile's sampling variant is the all-greedy one too
    assert {k[2:] for k in eng.compile_keys if k[0] == "sample"} == {GREEDY_FLAGS}
    assert not compiler.failed


class _FakeRunner:
    """``ModelRunner.compile`` that records each key, each held until ``gate`` is set."""

    def __init__(self):
        import threading

        self.gate, self.compiles, self._lock = threading.Event(), [], threading.Lock()

    def compile(self, key):
        self.gate.wait(10)
        with self._lock:
            self.compiles.append(key)


def test_a_key_compiling_in_the_background_is_waited_for_and_never_compiled_twice():
    """submit counts a key's forward and sampling keys at once (pending until done) and
    compiles them once on the thread; a step that needs the key waits for that compile
    (wait_for) instead of compiling it again; a key nobody submitted is not waited for."""
    import threading

    from jaxinfer.compile.buckets import BackgroundCompiler

    runner = _FakeRunner()
    c = BackgroundCompiler(runner)
    keys = c.submit(Buckets(4, 0, 0, 8), (False, 20), {("sample", 4, False, 20)})
    assert keys == [("forward", (4, 0, 0, 8))] and c.pending == set(keys)  # sample one counted
    assert c.submit(Buckets(4, 0, 0, 8), (False, 20), set()) == []  # again: ignored
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (c.wait_for((4, 0, 0, 8)), done.set()))
    waiter.start()
    assert not done.wait(0.3)  # held: still compiling
    c.wait_for((8, 0, 0, 8))  # nothing submitted for it: returns at once
    assert c.poll() == [] and c.pending == set(keys)  # not finished: still pending
    runner.gate.set()
    assert done.wait(10)
    waiter.join()
    c.wait()
    assert c.poll() == [] and not c.pending and c.compiled == [(4, 0, 0, 8)]
    assert runner.compiles == [("forward", (4, 0, 0, 8)), ("sample", 4, False, 20)]
    assert c.waited_s > 0.2


def test_a_failed_background_compile_is_forgotten_and_compiled_inline():
    """A compile that raises: poll returns its keys (the engine forgets them) and ``choose``
    then runs the exact key (compiled inline, meeting the error itself) instead of padding."""
    import types

    from jaxinfer.compile.buckets import BackgroundCompiler

    class Failing:
        def compile(self, key):
            raise RuntimeError("no memory")

    c = BackgroundCompiler(Failing(), inline=True)
    runner = types.SimpleNamespace(
        compile_keys={("forward", (4, 0, 0, 8)), ("sample", 4, False, 0)}
    )
    reuse = BucketReuse(runner, True, c)
    need = Buckets(1, 0, 0, 8)
    reuse.wanted[need.key] = 10**6  # wanted long enough: submitted at this choice
    assert reuse.choose(need, PLAIN) == Buckets(4, 0, 0, 8)
    assert ("forward", need.key) in runner.compile_keys  # counted at once
    assert reuse.choose(need, PLAIN) == need  # polled: failed, forgotten, compiled inline
    assert ("forward", need.key) not in runner.compile_keys
    assert "no memory" in c.failed[need.key]
