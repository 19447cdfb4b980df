"""The paged engine end to end on stories260K: reference outputs, batch invariance, preemption,
chunked prefill, bounded compilations, per-request errors, streaming and stop conditions."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import stories_reference

from jaxinfer.errors import RequestError
from jaxinfer.sampling.sampler import SamplingParams

MIXED = [
    "Lily",
    "The cat sat on the mat and looked at the big red ball.",
    "Once",
    "Tom had a toy car.",
    "One day, a little bird flew into the garden and saw a shiny",
    "Sam and Ben",
    "The sun",
    "There was a big tree in the park. Every day, the children played under it. One day",
    "Mia liked to paint",
    "A dog",
    "Once upon a time, in a small town, there lived a kind old man",
    "The girl",
    "Ben saw a frog.",
    "Max wanted to fly",
    "It was a rainy day.",
    "Anna",
]


def reference_requests(tokenizer):
    """(prompt ids, params, expected text) of each greedy_reference.json case."""
    out = []
    for case in stories_reference():
        ids = tokenizer.encode(case["prompt"])
        sp = SamplingParams(
            temperature=0.0, max_tokens=case["max_steps"] - (len(ids) - 1), stop_token_ids=(1,)
        )
        out.append((ids, sp, case["expected"]))
    return out


def test_engine_reproduces_reference_alone_and_in_batch(stories_llm):
    llm = stories_llm
    refs = reference_requests(llm.tokenizer)
    for ids, sp, expected in refs:  # alone
        out = llm.generate([ids], sp)[0]
        assert llm.tokenizer.decode(ids + out.token_ids) == expected
    # inside a batch of 32 mixed-length prompts, greedy and sampled rows mixed
    prompts = [ids for ids, _, _ in refs] + [llm.tokenizer.encode(p) for p in MIXED * 2][:29]
    params = [sp for _, sp, _ in refs] + [
        SamplingParams(temperature=0.0 if i % 2 else 0.9, max_tokens=20 + 7 * (i % 5), seed=i)
        for i in range(29)
    ]
    outs = llm.generate(prompts, params)
    for (ids, _, expected), out in zip(refs, outs, strict=False):
        assert llm.tokenizer.decode(ids + out.token_ids) == expected
    # every row, greedy or seeded, is the same when run alone
    for i in (3, 4, 10, 31):
        alone = llm.generate([prompts[i]], params[i])[0]
        assert alone.token_ids == outs[i].token_ids, i


def test_seeded_sampling_is_batch_invariant(stories_llm):
    llm = stories_llm
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=40)
    alone = llm.generate(["Once upon a time"], sp)[0]
    batch = llm.generate(
        MIXED[:7] + ["Once upon a time"] + MIXED[7:],
        [SamplingParams(temperature=0.7, seed=i, max_tokens=30) for i in range(7)]
        + [sp]
        + [SamplingParams(temperature=0.0, max_tokens=25)] * 9,
    )
    assert batch[7].token_ids == alone.token_ids
    other = llm.generate(
        ["Once upon a time"],
        SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99, max_tokens=40),
    )[0]
    assert other.token_ids != alone.token_ids  # the seed matters


def test_preemption_gives_the_same_outputs(stories_dir, stories_llm):
    """Preempted and recomputed rows give the outputs of an ample pool: plain rows, and rows
    constrained by test_structured_outputs' JSON schema (the grammars advance only on collected
    tokens), in one run of the tight engine (one set of its step shapes to compile)."""
    from test_structured_outputs import SCHEMA

    from jaxinfer import StructuredOutputsParams
    from jaxinfer.llm import LLM

    prompts = MIXED[:10] + ["Once upon a time"] * 10
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=90, ignore_eos=True)
        for i in range(10)
    ] + [
        SamplingParams(
            temperature=0.8,
            seed=i,
            max_tokens=150,
            structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        )
        for i in range(10)
    ]
    ample = stories_llm.generate(prompts, params)
    # 14 pages of 16 tokens: one sequence fits (max_model_len 192 -> 12 pages + null page), ten
    # don't.
    small = LLM(
        stories_dir,
        max_model_len=192,
        kv_pages=14,
        page_size=16,
        max_num_seqs=32,
        compilation_cache=False,
    )
    tight = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in ample]
    assert sum(o.metrics.num_preemptions for o in tight) == small.engine.scheduler.num_preemptions
    assert sum(o.metrics.num_preemptions for o in tight[10:]) > 0  # constrained rows too
    assert all(o.finish_reason == "stop" for o in tight[10:])
    assert small.engine.kv_manager.num_free_pages == 13  # every page came back


def test_chunked_prefill_equals_one_shot(stories_llm):
    """Logits of every prompt position and the KV pages' contents, one-shot vs 3 chunks."""
    import jax

    from jaxinfer.models.forward import compute_logits, forward
    from jaxinfer.models.kv_cache import init_kv_cache
    from jaxinfer.models.paged_attention import AttentionMetadata, paged_attn_fn

    llm = stories_llm
    cfg, params = llm.config, llm.params
    ids = llm.tokenizer.encode(MIXED[7] + " " + MIXED[10])
    n, z = len(ids), 8
    pages = np.array([3, 9, 4, 7, 1, 6, 2, 8][: -(-n // z)], np.int32)

    @jax.jit
    def run(kv, tokens, md):
        h, kv = forward(params, cfg, tokens, md.positions, kv, paged_attn_fn(cfg, md))
        return kv, compute_logits(params, cfg, h)

    def chunk_md(start, end):
        pos = np.arange(start, end, dtype=np.int32)
        m = len(pages)
        return AttentionMetadata(
            positions=pos,
            slot_mapping=pages[pos // z] * z + pos % z,
            block_tables=pages[None, :m],
            kv_lens=np.array([end], np.int32),
            cu_q_lens=np.array([0, end - start], np.int32),
            seq_ids=np.zeros(end - start, np.int32),
            num_decode=0,
        )

    kv1, logits1 = run(
        init_kv_cache(cfg, 10, z, jnp.float32), jnp.asarray(ids, jnp.int32), chunk_md(0, n)
    )
    kv2, parts = init_kv_cache(cfg, 10, z, jnp.float32), []
    bounds = [0, 7, 7 + z, n]  # a chunk ending mid-page, one of exactly a page, the rest
    for a, b in zip(bounds[:-1], bounds[1:], strict=False):
        kv2, lg = run(kv2, jnp.asarray(ids[a:b], jnp.int32), chunk_md(a, b))
        parts.append(lg)
    logits2 = jnp.concatenate(parts)

    # float32: matmuls of different shapes round differently; compare at 1e-5 of the scale.
    def close(a, b):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())

    close(logits2, logits1)
    close(kv2.k_pages[:, :, pages], kv1.k_pages[:, :, pages])
    close(kv2.v_pages[:, :, pages], kv1.v_pages[:, :, pages])
    # and the engine with a 32-token budget (every prompt longer: chunked) gives the unchunked
    # outputs. Its sizes but the budget are stories_llm's (STORIES_ENGINE): it reuses the step
    # shapes compiled for that engine (the budget is no compile key, the steps' buckets are).
    from conftest import STORIES_ENGINE

    from jaxinfer.llm import LLM

    chunky = LLM(
        llm.model_path, **STORIES_ENGINE, max_num_batched_tokens=32, compilation_cache=False
    )
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = [MIXED[7], MIXED[4] + " " + MIXED[1], MIXED[10] + " " + MIXED[7]]
    assert all(len(chunky.tokenizer.encode(p)) > 32 for p in prompts)
    assert [o.token_ids for o in chunky.generate(prompts, sp)] == [
        o.token_ids for o in llm.generate(prompts, sp)
    ]


def _pow2_from(floor: int, n: int) -> list[int]:
    """floor, 2 floor, ... up to the first power of two >= n."""
    out = [floor]
    while out[-1] < n:
        out.append(out[-1] * 2)
    return out


def test_compilations_bounded_and_stop_growing(stories_llm):
    from jaxinfer.engine.step import jitted_forward_step, jitted_sample_step
    from jaxinfer.llm import LLM

    # A fresh engine counts only this workload's compilations; jax's jit caches are per process,
    # so the steps stories_llm compiled are reused, not compiled again. Prefix caching off: a
    # repeated workload would then hit the cache and take other prefill buckets (bounded too:
    # tests/test_prefix_cache.py checks that count stops growing).
    llm = LLM(
        stories_llm.model_path,
        max_num_seqs=32,
        compilation_cache=False,
        enable_prefix_caching=False,
    )
    ecfg = llm.engine.ecfg
    prompts = [llm.tokenizer.encode(p) for p in MIXED]
    params = [SamplingParams(temperature=0.0, max_tokens=10 + i) for i in range(len(MIXED))]
    # Upper bound from the documented buckets and the EngineConfig, not from engine state: the
    # prompts fit one step's budget together, so prefill takes ceil(n / max_prefill_seqs) steps,
    # each one forward and one sampling shape; every other step is decode only, with Td in
    # {1, 4, 8, ...} (a lone decode row keeps its own bucket, else powers of two from 4) up to the
    # live sequences, and M in powers of two from 4 up to the longest sequence's pages.
    # All rows are greedy without logprobs: one sampling variant per row count.
    n = len(prompts)
    assert sum(map(len, prompts)) + ecfg.max_num_seqs <= ecfg.max_num_batched_tokens
    prefill_steps = -(-n // ecfg.max_prefill_seqs)
    decode_buckets = [1] + _pow2_from(4, min(n, ecfg.max_num_seqs))
    longest = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params, strict=True))
    page_buckets = _pow2_from(4, -(-longest // ecfg.page_size))
    bound = (
        prefill_steps
        + len(decode_buckets) * len(page_buckets)  # forward steps
        + prefill_steps
        + len(decode_buckets)
    )  # sampling steps
    jax_before = jitted_forward_step()._cache_size() + jitted_sample_step()._cache_size()
    llm.generate(prompts, params)
    first = llm.num_compilations
    jax_grown = (
        jitted_forward_step()._cache_size() + jitted_sample_step()._cache_size() - jax_before
    )
    assert 0 < first <= bound, (first, bound)
    assert jax_grown <= bound, (jax_grown, bound)  # no compilation escapes the count per step
    llm.generate(prompts, params)
    assert llm.num_compilations == first
    # jax's own caches hold at least what we counted (they are shared by every engine)
    assert jitted_forward_step()._cache_size() + jitted_sample_step()._cache_size() >= first


def test_bad_requests_fail_alone(stories_llm):
    llm = stories_llm
    too_long = list(range(3, 3 + 600))
    outs = llm.generate(
        [
            "Once",
            {"prompt_token_ids": []},
            too_long,
            {"prompt_token_ids": [1, 99999]},
            "Tom",
        ],
        SamplingParams(temperature=0.0, max_tokens=5),
    )
    assert [o.finish_reason for o in outs] == [
        "length",
        "error",
        "error",
        "error",
        "length",
    ]
    assert "zero tokens" in outs[1].error
    assert "max_model_len=512" in outs[2].error and "600" in outs[2].error
    assert "99999" in outs[3].error and "vocabulary" in outs[3].error
    # a dict without a prompt key is a shape error: the whole call raises before anything is
    # queued (test_llm_args::test_prompts_of_the_wrong_type_raise_and_the_llm_stays_usable)
    with pytest.raises(RequestError, match="temperature"):
        SamplingParams(temperature=-1.0)


def test_pool_too_small_is_a_startup_error(stories_dir):
    from jaxinfer.llm import LLM

    with pytest.raises(ValueError, match=r"need at least 33 pages"):
        LLM(stories_dir, kv_pages=8, page_size=16, compilation_cache=False)


def test_empty_prompt_is_bos(stories_llm):
    out = stories_llm.generate([""], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert out.prompt_token_ids == [1] and out.text.startswith("Once upon a time")


def test_streaming_stop_strings_and_limits(stories_llm):
    llm = stories_llm
    sp = SamplingParams(temperature=0.0, max_tokens=64, stop=["Lily."])
    chunks, final = [], None
    for out in llm.generate_stream(["Once upon a time"], sp):
        chunks.append(out.delta_text)
        final = out
    full = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=64))[
        0
    ].text
    assert final.finish_reason == "stop" and final.stop_reason == "Lily."
    assert final.text == full[: full.index("Lily.")]
    assert "".join(chunks) == final.text
    inc = llm.generate(
        ["Once upon a time"],
        SamplingParams(
            temperature=0.0, max_tokens=64, stop=["Lily."], include_stop_str_in_output=True
        ),
    )[0]
    assert inc.text == full[: full.index("Lily.") + len("Lily.")]
    # max_tokens, min_tokens with an early EOS, ignore_eos
    out = llm.generate(["Once"], SamplingParams(temperature=0.0, max_tokens=7))[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    stop_tok = full_ids = llm.generate(
        ["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=12)
    )[0].token_ids
    stop_tok = full_ids[4]
    out = llm.generate(
        ["Once upon a time"],
        SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_tok]),
    )[0]
    assert out.token_ids[-1] == stop_tok and out.stop_reason == stop_tok and len(out.token_ids) == 5
    out = llm.generate(
        ["Once upon a time"],
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=8, stop_token_ids=[stop_tok]),
    )[0]
    assert len(out.token_ids) >= 8 and stop_tok not in out.token_ids[:7]


def test_logprobs(stories_llm):
    """Logprobs equal log_softmax of run.c's logits (test_llama2c's numpy port of llama2.c's
    forward, on the checkpoint read by its own reader), not the engine's other outputs."""
    from test_llama2c import read_legacy, runc_logits

    out = stories_llm.generate(
        ["Once upon"], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3)
    )[0]
    assert len(out.logprobs) == 5
    (heads, kv_heads), w = read_legacy(stories_llm.model_path + "/stories260K.bin")
    prompt = stories_llm.tokenizer.encode("Once upon")
    logits = runc_logits(w, heads, kv_heads, prompt + out.token_ids[:-1])[len(prompt) - 1 :]
    ref = logits - logits.max(-1, keepdims=True)
    ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))  # f64[5, V]
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        top = np.argsort(-ref[i])[:3]
        assert lp.token_id == tok == top[0]  # greedy takes run.c's most likely token
        assert abs(lp.logprob - ref[i, tok]) <= 1e-4, i  # f32 engine vs f64 reference
        assert [t for t, _ in lp.top] == top.tolist(), i
        np.testing.assert_allclose([v for _, v in lp.top], ref[i, top], rtol=0, atol=1e-4)
    metrics = out.metrics
    assert metrics.ttft_s > 0 and metrics.tpot_s >= 0 and metrics.completion_tokens == 5


def test_default_page_size(stories_llm):
    from jaxinfer.engine.config import default_page_size

    # 8 on CPU with the XLA attention (less last-page slack, same speed there), else 16
    assert default_page_size("auto", "cpu") == 8 and default_page_size("xla", "cpu") == 8
    assert default_page_size("pallas_tpu_interpret", "cpu") == 16
    assert stories_llm.engine.ecfg.page_size == default_page_size()
