"""Speculative decoding: exactness of the acceptance rule (chi-square tests that reject wrong
rules), greedy speculative == greedy decoding for every drafter (alone, in mixed batches, with
penalties) on stories260K and tiny random models, the n-gram proposer and the heads checkpoint."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import engine_config
from scipy import stats

from jaxinfer.engine.core import EngineCore
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.params import init_random, param_shapes, params_from_flat
from jaxinfer.sampling.sampler import SamplingParams, SamplingTensors, processed_logits
from jaxinfer.speculative.config import SpecConfig
from jaxinfer.speculative.drafters import (
    init_heads,
    load_draft_model,
    load_heads,
    ngram_propose,
    save_heads,
    truncated_draft,
)
from jaxinfer.speculative.rejection import rejection_sample
from jaxinfer.speculative.strategy import SpeculativeStrategy

# ------------------------------------------------------------------ the rule on synthetic p / q

# N: exact power (scripts in the commit message / report): on the FIRST token alone, with cells
# pooled as in _chi2_pvalue, the wrong rules at N = 3000 have noncentrality >= 276 (df <= 8), so
# P(p-value > 1e-6) <= 1e-25 (residual_from_p, the weakest); accept_always emits tokens of
# probability 0 under top-k/min-p (P(no such token in 3000) ~ 1e-38) or has lambda ~ 2000.
V, R, N = 8, 2, 3000
ALPHA = 1e-3  # a correct rule fails one test in a thousand; wrong rules give p-values ~ 0


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Pearson chi-square p-value of ``counts`` against ``probs``.

    Cells whose expected count is below ``min_expected`` are pooled into one bin (merged into
    the smallest other cell while the pool itself is still below it): the chi-square law of the
    statistic only holds for expected counts of about 5 and up. Without pooling, ONE sample in
    a cell of expected count 0.01 adds ~100 to the statistic, so a correct sampler fails at a
    rate far above the nominal alpha (this is what made the end-to-end test fail: a cell of
    expected count 0.012 out of 3000 samples got one hit, contribution 82, p = 4e-10).
    A token of probability 0 that is emitted still means the law is certainly wrong.
    """
    probs = np.asarray(probs, np.float64) / np.sum(probs, dtype=np.float64)
    counts = np.asarray(counts, np.float64)
    if counts[probs <= 0].sum():
        return 0.0
    expected = probs * counts.sum()
    small = expected < min_expected
    obs, exp = list(counts[~small]), list(expected[~small])
    if small.any():
        pool_o, pool_e = counts[small].sum(), expected[small].sum()
        if pool_e < min_expected and exp:
            k = int(np.argmin(exp))
            obs[k] += pool_o
            exp[k] += pool_e
        else:
            obs.append(pool_o)
            exp.append(pool_e)
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)


@functools.partial(jax.jit, static_argnames=("residual_from_p", "accept_always"))
def one_round(q_r, tl_r, key, st_s, residual_from_p=False, accept_always=False):
    """N rows: R drafts from q_r f32[R, V], target logits tl_r f32[R+1, V] (same for all)."""
    d = jax.random.categorical(key, jnp.log(q_r), shape=(N, R))
    probs = jnp.broadcast_to(q_r, (N, R, V))
    logits = jnp.broadcast_to(tl_r, (N, R + 1, V))
    return rejection_sample(
        logits,
        d.astype(jnp.int32),
        jnp.full((N,), R, jnp.int32),
        probs,
        st_s,
        residual_from_p=residual_from_p,
        accept_always=accept_always,
    )


def _synthetic(rule: dict, st_kw: dict):
    """Two rounds of R=2 drafts over a position-independent 'model': p_j, q_j fixed per output
    index. Returns (first tokens, 2-token ids x1 * V + x2, exact p(x1), exact p(x1, x2))."""
    rng = np.random.default_rng(0)
    tl = rng.normal(size=(R + 2, V)).astype(np.float32) * 1.5  # target logits per output index
    dl = tl + rng.normal(size=(R + 2, V)).astype(np.float32) * 1.5  # a clearly different draft
    st = SamplingTensors.from_params([SamplingParams(**st_kw)] * N, list(range(N)), [0] * N, N)
    st = jax.tree.map(jnp.asarray, st)

    def dist(logits, offset):  # softmax(processed_logits) of a [J, V] table at output index offset
        s1 = jax.tree.map(lambda x: x[:1], st)
        s1 = dataclasses.replace(s1, steps=s1.steps + offset)
        return jax.nn.softmax(
            processed_logits(
                jnp.asarray(logits), jax.tree.map(lambda x: jnp.repeat(x, logits.shape[0]), s1)
            ),
            -1,
        )

    p = np.asarray(dist(tl, 0))
    q = np.asarray(dist(dl, 0))

    def at(start):  # a round whose rows begin at output index `start`
        st_s = dataclasses.replace(st, steps=st.steps + start)
        return map(
            np.asarray,
            one_round(
                jnp.asarray(q[start : start + R]),
                jnp.asarray(tl[start : start + R + 1]),
                jax.random.key(start + 100),
                st_s,
                **rule,
            ),
        )

    t1, n1 = at(0)
    t2, _ = at(1)
    second = np.where(n1 >= 1, t1[:, 1], t2[:, 0])  # a 1-token round 1 continues in round 2
    pair = t1[:, 0] * V + second
    return t1[:, 0], pair, p[0], (p[0][:, None] * p[1][None, :]).reshape(-1)


RULES = {
    "correct": {},
    "accept_always": {"accept_always": True},
    "residual_from_p": {"residual_from_p": True},
}
SAMPLING = [dict(temperature=1.0), dict(temperature=0.8, top_k=5, min_p=0.02)]


@pytest.mark.parametrize("st_kw", SAMPLING, ids=["t1", "t0.8_topk5_minp"])
@pytest.mark.parametrize("rule", list(RULES))
def test_rejection_sampling_matches_target_distribution(rule, st_kw):
    first, pair, p1, p12 = _synthetic(RULES[rule], st_kw)
    pv1 = _chi2_pvalue(np.bincount(first, minlength=V), p1)
    pv2 = _chi2_pvalue(np.bincount(pair, minlength=V * V), p12)
    if rule == "correct":
        assert pv1 > ALPHA and pv2 > ALPHA, (pv1, pv2)
    else:  # the same test rejects a wrong rule (on the first token or on the pair)
        assert min(pv1, pv2) < 1e-6, (rule, pv1, pv2)


def test_greedy_rows_accept_while_draft_is_argmax():
    logits = jnp.asarray([[[0, 5, 1], [3, 0, 1], [0, 0, 9]]] * 3, jnp.float32)  # argmax 1, 0, 2
    # row 2: the first draft is wrong, the second right: only a prefix counts (0 accepted)
    drafts = jnp.asarray([[1, 0], [1, 2], [2, 0]], jnp.int32)
    st = jax.tree.map(
        jnp.asarray,
        SamplingTensors.from_params([SamplingParams(temperature=0.0)] * 3, [0] * 3, [0] * 3, 3),
    )
    toks, n = rejection_sample(logits, drafts, jnp.asarray([2, 2, 2]), None, st)
    assert n.tolist() == [2, 1, 0]
    assert toks[0].tolist() == [1, 0, 2] and toks[1, :2].tolist() == [1, 0] and toks[2, 0] == 1


def test_bonus_token_is_drawn_from_the_last_target_distribution():
    """All R drafts accepted (the target puts all its mass on them, the drafter too): the emitted
    tokens are the drafts, then a bonus token distributed as softmax(target logits at position R
    / T), written out here in numpy (Leviathan et al. 2023, Algorithm 1), chi-square against it.
    (Greedy rows' bonus, the argmax at position R: test_greedy_rows_accept_while_draft_is_argmax.)
    """
    rng = np.random.default_rng(11)
    drafts = np.asarray([3, 5])
    tl = np.full((R + 1, V), -30.0, np.float32)
    tl[np.arange(R), drafts] = 30.0  # p_j(d_j) = 1: every draft accepted
    tl[R] = rng.normal(size=V).astype(np.float32) * 1.2
    q = np.eye(V, dtype=np.float32)[drafts]  # the drafter always proposes 3, 5
    temp = 0.9
    st = jax.tree.map(
        jnp.asarray,
        SamplingTensors.from_params(
            [SamplingParams(temperature=temp)] * N, list(range(N)), [0] * N, N
        ),
    )
    toks, n = map(np.asarray, one_round(jnp.asarray(q), jnp.asarray(tl), jax.random.key(5), st))
    assert (n == R).all() and (toks[:, :R] == drafts).all()
    x = tl.astype(np.float64) / temp
    p_r = np.exp(x[R] - x[R].max())
    counts = np.bincount(toks[:, R], minlength=V)
    assert _chi2_pvalue(counts, p_r / p_r.sum()) > ALPHA
    # every token really drawn (a bonus from position R - 1 is always 5; one from the residual
    # p_R - q_{R-1} never is)
    assert counts.min() > 50


# ------------------------------------------------------------------ end to end, tiny vocabulary


class _IdTokenizer:
    """Stand-in tokenizer of the tiny models: text is the ids."""

    eos_ids = ()
    bos_id = None

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def _tiny(vocab: int, seed: int, layers: int = 2, scale: float = 0.6):
    cfg = ModelConfig(
        model_type="llama",
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    return cfg, init_random(cfg, jax.random.key(seed), scale=scale)


def _ecfg(max_num_seqs=64, max_model_len=32, **kw):
    """The engine config of ``_tiny``'s models (resolved as ``LLM`` does: CPU defaults)."""
    cfg = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8, max_position_embeddings=64)
    sizes = dict(
        max_model_len=max_model_len,
        page_size=8,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(256, max_num_seqs),
        kv_pages=max_num_seqs * (max_model_len // 8 + 1) + 1,
    )
    return engine_config(cfg, **{**sizes, **kw})


def _engine(cfg, params, tokenizer, ecfg):
    return EngineCore(ModelRunner(cfg, params, ecfg), tokenizer)


def _spec_engine(cfg, params, tokenizer, ecfg, spec, **drafter):
    """An engine core over a fresh runner whose steps are ``spec``'s speculative rounds."""
    runner = ModelRunner(cfg, params, ecfg)
    return EngineCore(runner, tokenizer, speculative=SpeculativeStrategy(runner, spec, **drafter))


def _run(engine, prompts, params):
    for i, (p, sp) in enumerate(zip(prompts, params, strict=False)):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return [done[str(i)] for i in range(len(prompts))]


def test_end_to_end_sampling_distribution_with_a_different_draft_model():
    """Tokens 2 and 3 of each request come from speculative rounds (token 1 from the prefill);
    their joint distribution must be the target's, computed exactly by enumeration.

    The draft is the target's first layer alone (acceptance ~0.56 after this prompt, so accepted
    drafts, residual draws and bonus tokens all occur often). Power: had the engine emitted the
    draft's law, the pooled chi-square at n = 400 has noncentrality ~8700 (df >= 6); had it
    accepted every draft (accept-always, then the target's bonus token), ~2500."""
    from jaxinfer.models.dense import dense_logits

    v, n = 8, 400
    cfg, params = _tiny(v, 0)
    dcfg, dparams = truncated_draft(cfg, params, 1)
    prompt = [2, 3]
    seqs = np.asarray([[*prompt, a, b] for a in range(v) for b in range(v)], np.int32)
    probs = np.asarray(jax.nn.softmax(dense_logits(params, cfg, jnp.asarray(seqs)), -1), np.float64)
    k = len(prompt)
    p1 = probs[::v, k - 1]  # p(x1 | prompt)           [V, V] by x1
    p2 = probs[::v, k]  # p(x2 | prompt, x1)        [V(x1), V]
    p3 = probs[:, k + 1].reshape(v, v, v)  # p(x3 | prompt, x1, x2)
    joint = np.einsum("a,ab,abc->bc", p1[0], p2, p3).reshape(-1)  # p(x2, x3)
    q = np.asarray(jax.nn.softmax(dense_logits(dparams, dcfg, jnp.asarray(seqs)), -1))
    assert np.abs(q - probs).max() > 0.3  # the draft is really different
    # All n rows run together and their prefills share one step (max_prefill_seqs = n); a
    # 2-token prompt makes the prefill round (n rows of 2 prompt tokens) and the first verify
    # round (n rows of the last token + 1 draft) the same shape, so the rounds compile twice
    # (that one, and the second round of the rows whose draft was rejected) instead of once per
    # power-of-two row count on the way up. Layers under lax.scan (unroll_layers=False): each
    # round compiles ~2x faster, and the law of the emitted tokens does not depend on the
    # layers' form (the unrolled form: the tiny greedy tests below, CPU default).
    ecfg = _ecfg(
        max_num_seqs=n,
        max_prefill_seqs=n,
        max_num_batched_tokens=n * len(prompt),
        unroll_layers=False,
    )
    eng = _spec_engine(
        cfg,
        params,
        _IdTokenizer(),
        ecfg,
        SpecConfig("draft-model", 2),
        draft_cfg=dcfg,
        draft_params=dparams,
    )
    outs = _run(
        eng, [prompt] * n, [SamplingParams(temperature=1.0, seed=i, max_tokens=3) for i in range(n)]
    )
    toks = np.asarray([o.token_ids for o in outs])
    pv = _chi2_pvalue(np.bincount(toks[:, 1] * v + toks[:, 2], minlength=v * v), joint)
    assert pv > ALPHA, pv
    rates = [o.metrics.acceptance_rate for o in outs]
    assert all(r is not None for r in rates) and 0.3 < np.mean(rates) < 0.85


# ------------------------------------------------------------------ greedy == greedy


def _spec_kwargs(method, cfg, params, tmp_path=None):
    if method == "draft-model:self":
        return "draft-model", dict(
            zip(
                ("draft_cfg", "draft_params"),
                load_draft_model("self", cfg, params, jnp.float32),
                strict=False,
            )
        )
    if method == "draft-model:layers":
        return "draft-model", dict(
            zip(
                ("draft_cfg", "draft_params"),
                truncated_draft(cfg, params, max(1, cfg.num_layers // 2)),
                strict=False,
            )
        )
    if method == "heads":  # random heads: any proposal must leave greedy output unchanged
        h = init_heads(params, 4)
        h = dataclasses.replace(h, w=0.3 * jax.random.normal(jax.random.key(0), h.w.shape))
        return "heads", dict(heads=h)
    return method, {}


METHODS = ["ngram", "draft-model:layers", "draft-model:self", "heads"]


@functools.cache
def _tiny_greedy_case():
    """The tiny random model, its prompts and plain greedy reference outputs (shared by the
    four drafters: one reference run, one plain-engine compilation).

    The prompts hold 16 tokens in all, and the one also run alone 4 (= 1 + R): the mixed
    batch's prefill round has the shape of its verify rounds (16 tokens, 4 rows) and the lone
    prefill that of the lone verify rounds (4 tokens, 1 row), so each drafter compiles two
    rounds. (Rows still cross pages as they decode: 8-token pages, 13 to 20 tokens a row.)"""
    cfg, params = _tiny(64, 3, layers=2, scale=0.4)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, 64, size=k))) for k in (3, 4, 1, 3)]
    # a repetitive prompt gives the n-gram drafter something to find
    prompts[2] = [7, 8, 9, 7, 8, 9]
    params_rows = [SamplingParams(temperature=0.0, max_tokens=10 + 2 * i) for i in range(4)]
    ecfg = _ecfg(max_num_seqs=4)
    ref = _run(_engine(cfg, params, _IdTokenizer(), ecfg), prompts, params_rows)
    return cfg, params, prompts, params_rows, ecfg, [o.token_ids for o in ref]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_speculative_equals_greedy_tiny_random(method):
    cfg, params, prompts, params_rows, ecfg, ref = _tiny_greedy_case()
    m, kw = _spec_kwargs(method, cfg, params)
    eng = _spec_engine(cfg, params, _IdTokenizer(), ecfg, SpecConfig(m, 3), **kw)
    got = _run(eng, prompts, params_rows)
    assert [o.token_ids for o in got] == ref
    alone = _run(eng, [prompts[1]], [params_rows[1]])[0]
    assert alone.token_ids == ref[1]
    if method == "draft-model:self":
        assert all(o.metrics.acceptance_rate == 1.0 for o in got)


STORY_PROMPTS = [
    "Once upon a time",
    "Lily",
    "The cat sat on the mat and looked at the big red ball.",
    "Tom had a toy car.",
    "Sam and Ben",
    "One day, a little bird",
]


@pytest.fixture(scope="module")
def stories(stories_dir):
    """The plain engine and its reference outputs of the mixed batch (computed once, shared by
    the four drafters: the plain engine's outputs do not depend on the drafter)."""
    from jaxinfer.llm import LLM

    # Layers under lax.scan (unroll_layers=False; the CPU default unrolls them): each compiled
    # step (plain, verify round, draft) compiles ~2-3x faster, and what is checked here, the
    # speculative engine against the plain one on the same config, does not depend on the
    # layers' form. The unrolled form is checked by the tiny-model tests above (CPU default)
    # and on stories260K by test_readme_claims' draft-model run.
    # Pages of 16 tokens: a row's block table is at most 4 pages (the floor), so every round of
    # a drafter has the same page dimension instead of 4 while rows are short, 8 after.
    llm = LLM(
        stories_dir,
        max_num_seqs=8,
        max_model_len=64,
        page_size=16,
        compilation_cache=False,
        unroll_layers=False,
    )
    prompts = [llm.tokenizer.encode(p) for p in STORY_PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    pen = SamplingParams(
        temperature=0.0, max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.2, min_tokens=5
    )
    mixed = [
        greedy,
        greedy,
        SamplingParams(temperature=0.9, seed=1, max_tokens=25),
        pen,
        SamplingParams(temperature=0.7, top_p=0.9, seed=2, max_tokens=20),
        greedy,
    ]
    ref = _run(llm.engines[0], prompts, mixed)
    return llm, prompts, greedy, mixed, ref


@pytest.mark.parametrize("method", METHODS)
def test_greedy_speculative_equals_greedy_stories(stories, method):
    llm, prompts, greedy, mixed, ref = stories
    base = llm.engines[0]
    m, kw = _spec_kwargs(method, base.cfg, base.params)
    eng = _spec_engine(base.cfg, base.params, llm.tokenizer, base.ecfg, SpecConfig(m, 4), **kw)
    got = _run(eng, prompts, mixed)
    for i in (0, 1, 3, 5):  # greedy rows (one with penalties and min_tokens) inside the mix
        assert got[i].token_ids == ref[i].token_ids, (method, i)
        assert got[i].text == ref[i].text
    alone = _run(eng, prompts[:1], [greedy])[0]  # and alone
    assert alone.token_ids == ref[0].token_ids
    # seeded sampled rows are batch invariant under speculation too
    alone_s = _run(eng, prompts[2:3], mixed[2:3])[0]
    assert alone_s.token_ids == got[2].token_ids
    assert got[0].metrics.spec_rounds > 0 and got[0].metrics.acceptance_rate is not None


def _staircase_bigram(v: int = 32, d: int = 32):
    """A llama whose next-token logits depend only on the last token t: 1.0 for t itself, 0.5
    for t + 1, 0 elsewhere (one-hot embeddings, zero layer weights: the residual stream is the
    embedding; the LM head undoes the final RMSNorm's sqrt(d) scale). Host-built: no compiles."""
    cfg = ModelConfig(
        model_type="llama",
        vocab_size=v,
        hidden_size=d,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    flat = {
        name: (np.ones if name.endswith("norm") else np.zeros)(shape, np.float32)
        for name, shape in param_shapes(cfg).items()
    }
    flat["embed"] = np.eye(v, d, dtype=np.float32)
    flat["lm_head"][:v] = (np.eye(v) + 0.5 * np.roll(np.eye(v), 1, axis=1)) / np.sqrt(d)
    return cfg, params_from_flat({k: jnp.asarray(a) for k, a in flat.items()})


def test_ngram_penalties_count_the_drafts_accepted_within_a_round():
    """Penalties at a round's position j count the drafts d_1..d_j accepted before it.

    The model's greedy choice repeats the last token (logit 1.0) unless a penalty of more than
    0.5 pushes it under t + 1; presence + frequency penalties (0.5 + 0.25 per occurrence) do, so
    greedy decoding walks 0, 1, 2, ... (the reference: that formula; the plain engine gives it
    too, checked when this test was written, not rerun here to save its compiles). The
    prompt holds that staircase, so the n-gram drafter proposes it and every draft is accepted;
    a round that did not count its accepted drafts would repeat d_j at position j."""
    cfg, params = _staircase_bigram()
    prompt = [*range(12), 0]  # ends in 0: the first output repeats it (no penalty on the prompt)
    sp = SamplingParams(
        temperature=0.0, max_tokens=10, presence_penalty=0.5, frequency_penalty=0.25
    )
    want = [0, *range(1, 10)]  # 0 (last prompt token, unpenalised), then each next t + 1
    eng = _spec_engine(cfg, params, _IdTokenizer(), _ecfg(max_num_seqs=2), SpecConfig("ngram", 4))
    got = _run(eng, [prompt], [sp])[0]
    assert got.token_ids == want
    # the rounds really accepted drafts mid-round: [0] rejected, then 2..5 and 7, 8 accepted (6/7)
    assert got.metrics.acceptance_rate > 0.5, got.metrics


# ------------------------------------------------------------------ pieces


def test_ngram_propose():
    toks = np.asarray([1, 2, 3, 4, 9, 2, 3, 4, 5, 6, 2, 3], np.int32)
    assert ngram_propose(toks, 3, ngram_max=3) == [4, 5, 6]  # latest match of [2, 3]
    assert ngram_propose(toks, 2, ngram_max=1) == [4, 5]
    assert ngram_propose(np.asarray([1, 2, 3], np.int32), 3) == []


def test_heads_save_load_roundtrip(tmp_path):
    cfg, params = _tiny(16, 0)
    h = init_heads(params, 3)
    save_heads(h, tmp_path / "heads", meta={"x": 1})
    g = load_heads(tmp_path / "heads", cfg)
    assert all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(h), jax.tree.leaves(g), strict=False)
    )
    with pytest.raises(ValueError, match="D, V"):
        load_heads(tmp_path / "heads", dataclasses.replace(cfg, vocab_size=32))


def test_bad_configs():
    with pytest.raises(ValueError, match="supported"):
        SpecConfig("medusa")
    with pytest.raises(ValueError, match=">= 1"):
        SpecConfig("ngram", 0)
    cfg, params = _tiny(16, 0)
    with pytest.raises(ValueError, match="draft model"):
        _spec_engine(cfg, params, _IdTokenizer(), _ecfg(8), SpecConfig("draft-model", 2))


def test_what_a_speculative_engine_refuses():
    """A speculative engine's capabilities: no prompt logprobs (its rounds make logits at the
    verify positions only: the request is refused, naming why), no async scheduling, no
    precompiled step shapes (its steps are rounds) and no batch invariance."""
    from jaxinfer.compile.warmup import precompile
    from jaxinfer.errors import RequestError

    cfg, params = _tiny(16, 0)
    eng = _spec_engine(cfg, params, _IdTokenizer(), _ecfg(8), SpecConfig("ngram", 2))
    caps = eng.capabilities
    assert not (caps.prompt_logprobs or caps.async_scheduling or caps.precompile)
    assert not eng.async_scheduling
    with pytest.raises(RequestError, match="prompt_logprobs is not supported with speculative"):
        eng.validate([1, 2, 3], SamplingParams(prompt_logprobs=1))
    eng.validate([1, 2, 3], SamplingParams(logprobs=1))  # sampled-token logprobs are fine
    with pytest.raises(ValueError, match="speculative engine"):
        precompile(eng, [("forward", (4, 0, 0, 4))])
    with pytest.raises(ValueError, match="batch_invariant=True is not supported with spec"):
        _spec_engine(
            cfg,
            params,
            _IdTokenizer(),
            dataclasses.replace(_ecfg(8), batch_invariant=True, attn_impl="xla"),
            SpecConfig("ngram", 2),
        )
