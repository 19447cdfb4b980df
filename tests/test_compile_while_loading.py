"""Compiling the first step while the weights load (``jaxinfer.compile.while_loading``).

Judges: jax.monitoring's lowering events, with the thread each ran on (whether the engine's first
step compiled again), and the llama2.c outputs in ``greedy_reference.json``."""

import threading

import jax
import pytest
from conftest import STORIES, stories_reference

from jaxinfer.compile import while_loading as cwl
from jaxinfer.sampling.sampler import SamplingParams


@pytest.fixture(autouse=True)
def switched_on(monkeypatch):
    """The optimisation is off by default (module docstring): these tests turn it on."""
    monkeypatch.setenv(cwl.ENV, "1")


# An LLM configuration no other test uses (the pool's page count is in the KV shapes), so the
# jit caches hold none of this test's step shapes before it runs.
KW = dict(max_num_seqs=8, kv_pages=227, compilation_cache=False)
CUT = 1  # output tokens: the job is its first step (compiled in the background) alone


def reference_requests(max_tokens: int | None = None):
    """(prompt text, params) of the two 64-step greedy_reference.json cases (``max_tokens``:
    their outputs cut to that many tokens), and their expected texts (prompt + output, as
    llama2.c's run.c prints them)."""
    from jaxinfer.tokenizers import load_tokenizer

    tok = load_tokenizer(STORIES, vocab_size=512)
    cases = [c for c in stories_reference() if c["max_steps"] <= 64]
    assert len(cases) == 2
    reqs = [
        (
            c["prompt"],
            SamplingParams(
                temperature=0.0,
                stop_token_ids=(1,),
                max_tokens=max_tokens or c["max_steps"] - (len(tok.encode(c["prompt"])) - 1),
            ),
        )
        for c in cases
    ]
    return reqs, [c["expected"] for c in cases]


def test_first_step_is_compiled_during_loading_and_not_again(monkeypatch):
    """The background compile is held until the first step wants its key: the case where the
    dispatch must wait for a compile in flight rather than start its own, made certain."""
    from jax import monitoring

    from jaxinfer.compile.buckets import BackgroundCompiler
    from jaxinfer.llm import LLM

    # Steps an earlier test of this process compiled (e.g. the same greedy sampling variant)
    # would be found in jax's in-memory caches, with no lowering on either thread to count.
    jax.clear_caches()
    gate = threading.Event()
    compile_fn = BackgroundCompiler._compile_fn

    def held_compile_fn(self, *args, **kwargs):
        fn = compile_fn(self, *args, **kwargs)
        return lambda: (gate.wait(120), fn())

    monkeypatch.setattr(BackgroundCompiler, "_compile_fn", held_compile_fn)
    reqs, expected = reference_requests(CUT)
    events = []

    def listener(name, secs, **kw):  # lowerings, and compiles (persistent cache hits too)
        if name.endswith(("jaxpr_to_mlir_module_duration", "backend_compile_duration")):
            events.append((threading.current_thread().name, kw.get("fun_name", "")))

    monitoring.register_event_duration_secs_listener(listener)
    try:
        warm = cwl.FirstStepCompile.start(STORIES, KW, [p for p, _ in reqs], [s for _, s in reqs])
        assert warm.reason is None
        # Not a daemon: a process that ended while a daemon thread compiled aborted ("terminate
        # called ...", status 134: 2 of 3 runs of a script exiting 1.5-2.5 s after the start).
        [thread] = [t for t in threading.enumerate() if t.name == cwl.THREAD_NAME]
        assert not thread.daemon
        llm = LLM(STORIES, **KW)
        wait_for = llm.engine._compiler.wait_for
        # Released 0.3 s after the first step asks: a dispatch that does not wait would have
        # started its own compile by then.
        monkeypatch.setattr(
            llm.engine._compiler,
            "wait_for",
            lambda key: (threading.Timer(0.3, gate.set).start(), wait_for(key)),
        )
        ids = [llm.encode_prompt(p)[0] for p, _ in reqs]
        assert warm.adopt(llm, ids, [s for _, s in reqs]), warm.reason
        outs = list(
            llm.generate_stream(
                [{"prompt_token_ids": x} for x in ids], [s for _, s in reqs], request_ids=["0", "1"]
            )
        )
    finally:
        monitoring.unregister_event_duration_listener(listener)
    done = {o.request_id: o for o in outs if o.finished}
    for i, x, want in zip("01", ids, expected, strict=True):
        text = llm.tokenizer.decode(x + done[i].token_ids)
        assert len(done[i].token_ids) == CUT and want.startswith(text), text
    engine = llm.engine
    assert warm.used and warm.keys[0] == ("forward", warm._mine["forward"])
    assert warm.keys[0] in engine.compile_keys and warm.keys[1] in engine.compile_keys
    bg = [f for t, f in events if t == cwl.THREAD_NAME]
    main = [f for t, f in events if t != cwl.THREAD_NAME]
    assert sorted(bg) == ["jit(forward_step)"] * 2 + ["jit(sample_step_padded)"] * 2
    # The job's keys were lowered and compiled once, in the background: none on the main thread.
    assert sorted(engine.compile_keys) == sorted(warm.keys)
    assert "jit(forward_step)" not in main and "jit(sample_step_padded)" not in main, main


@pytest.fixture(scope="module")
def planned():
    """A FirstStepCompile planned for the stories_llm fixture's configuration (no compile)."""
    reqs, _ = reference_requests()

    def plan(**kw):
        warm = cwl.FirstStepCompile()
        args = cwl.llm_arguments({"max_num_seqs": 32, **kw})
        warm._plan(STORIES, args, [p for p, _ in reqs], [s for _, s in reqs])
        return warm

    return plan, reqs


def test_a_prediction_that_does_not_hold_is_not_used(stories_llm, planned):
    plan, reqs = planned
    ids = [stories_llm.encode_prompt(p)[0] for p, _ in reqs]
    params = [s for _, s in reqs]
    assert plan().reason is None and plan()._mismatch(stories_llm, ids, params) is None
    pages = stories_llm.engine.ecfg.num_pages
    cases = [
        (dict(kv_pages=pages + 8), "ecfg"),
        # A bfloat16 pool runs "auto" as the XLA attention, not the CPU kernel: ecfg.attn_impl.
        (dict(kv_pages=pages, dtype="bfloat16"), "ecfg"),
        (dict(kv_pages=pages, page_size=16), "ecfg"),
    ]
    for kw, what in cases:
        warm = plan(**kw)
        assert warm.reason is None
        assert f"engine's {what} differs" in warm._mismatch(stories_llm, ids, params), kw
    # Other first prompts: other first-step keys.
    why = plan()._mismatch(stories_llm, [ids[0] * 12, ids[1]], params)
    assert "first step's keys" in why
    warm = plan()
    warm._mine["params"][1][0] = ((512, 64), "bfloat16", False, False)  # a wrong leaf
    assert "params differs" in warm._mismatch(stories_llm, ids, params)


@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(quantization="int8"), "quantization"),
        (dict(speculative="ngram"), "speculative"),
        (dict(tensor_parallel_size=2), "parallelism"),
        (dict(attn_impl="pallas_tpu_interpret"), "XLA attention"),
    ],
)
def test_what_cannot_be_derived_is_skipped_without_a_thread(kw, why):
    before = threading.active_count()
    warm = cwl.FirstStepCompile.start(STORIES, kw, ["Once"], [SamplingParams()])
    assert why in warm.reason and warm.future.done() and threading.active_count() == before
    assert not warm.adopt(None, [[1]], [SamplingParams()])


def test_switch_and_bad_arguments(monkeypatch):
    monkeypatch.delenv(cwl.ENV)
    assert not cwl.enabled()  # off by default
    assert cwl.FirstStepCompile.start(STORIES, {}, ["Once"], [SamplingParams()]).reason
    monkeypatch.setenv(cwl.ENV, "0")
    warm = cwl.FirstStepCompile.start(STORIES, {}, ["Once"], [SamplingParams()])
    assert warm.reason == f"{cwl.ENV}=0" and not cwl.enabled()
    monkeypatch.setenv(cwl.ENV, "yes")
    with pytest.raises(ValueError, match=cwl.ENV):
        cwl.enabled()
    assert cwl.ENV in cwl.FirstStepCompile.start(STORIES, {}, ["x"], [SamplingParams()]).reason
    monkeypatch.setenv(cwl.ENV, "1")
    assert "max_num_seq" in cwl.FirstStepCompile.start(STORIES, {"max_num_seq": 3}, [], []).reason


def test_a_pool_beyond_memory_is_not_planned(monkeypatch):
    """--kv-pages 10^9 (10 TB): the engine refuses the pool; the compile thread must give up
    before planning the first step (job_plan's page allocator would list 10^9 pages: it once
    took ~24 GB here and the OOM killer ended the test worker)."""
    monkeypatch.setenv(cwl.ENV, "1")
    warm = cwl.FirstStepCompile.start(STORIES, {"kv_pages": 10**9}, ["Once"], [SamplingParams()])
    warm.future.result(timeout=120)
    assert warm.reason == "KV pool beyond memory"
    assert not warm.adopt(None, [[1]], [SamplingParams()])
