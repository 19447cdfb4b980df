"""Tests of jaxinfer.sampling.sampler and jaxinfer.sampling.params: support of the filters,
penalties,
seeding, sampling frequencies, logprobs, validation and stop strings."""

from __future__ import annotations

import functools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.errors import RequestError
from jaxinfer.sampling.sampler import (
    MAX_LOGPROBS,
    SAMPLING_EPS,
    SamplingParams,
    SamplingTensors,
    apply_penalties,
    find_stop_string,
    processed_logits,
    sample,
)

sample_jit = jax.jit(sample, static_argnames="num_logprobs")
processed_jit = jax.jit(processed_logits)

N_FREQ = 20000  # draws per frequency test (one shape, one compilation)
B_SEED = 8  # batch size (padded) of the seed and greedy tests
V_SEED = 50

# Upper 0.1% points of the chi-square distribution (scipy.stats.chi2.ppf(0.999, df)).
CHI2_999 = {3: 16.266, 5: 20.515}


def tensors(params, seeds=None, steps=None, pad_to=None):
    n = len(params)
    seeds = list(range(n)) if seeds is None else seeds
    steps = [0] * n if steps is None else steps
    return SamplingTensors.from_params(params, seeds, steps, pad_to or n)


V_FILTER = 6  # every filter case is padded to this vocabulary, so they share one compilation


def log_probs(*probs):
    """Logits with the given probabilities, padded with -inf (never sampled) to V_FILTER."""
    out = np.full(V_FILTER, -np.inf, np.float32)
    out[: len(probs)] = np.log(np.asarray(probs, np.float64))
    return out


def support(logits, params):
    """Tokens with finite processed logits (what can ever be sampled)."""
    x = processed_jit(jnp.asarray(logits)[None], tensors([params]))[0]
    return set(np.flatnonzero(np.isfinite(np.asarray(x))).tolist())


def sampled_set(logits, params, n=2000):
    """Tokens drawn over n different seeds (same logits in every row)."""
    rows = jnp.broadcast_to(jnp.asarray(logits), (n, len(logits)))
    out = sample_jit(rows, tensors([params] * n))
    return set(np.asarray(out.tokens).tolist())


# ---------------------------------------------------------------- filters: exact support

FILTER_CASES = [
    # top-k keeps every token tied with the k-th largest value (as vLLM).
    ([5.0, 4.0, 4.0, 3.0, 1.0, 0.0], dict(top_k=1), {0}),
    ([5.0, 4.0, 4.0, 3.0, 1.0, 0.0], dict(top_k=2), {0, 1, 2}),
    ([5.0, 4.0, 4.0, 3.0, 1.0, 0.0], dict(top_k=4), {0, 1, 2, 3}),
    ([5.0, 4.0, 4.0, 3.0, 1.0, 0.0], dict(top_k=-1), {0, 1, 2, 3, 4, 5}),
    ([5.0, 4.0, 4.0, 3.0, 1.0, 0.0], dict(top_k=100), {0, 1, 2, 3, 4, 5}),
    # top-p: smallest most-likely-first prefix with mass >= p; tokens in shuffled id order.
    (log_probs(0.15, 0.5, 0.1, 0.25), dict(top_p=0.3), {1}),
    (log_probs(0.15, 0.5, 0.1, 0.25), dict(top_p=0.6), {1, 3}),
    (log_probs(0.15, 0.5, 0.1, 0.25), dict(top_p=0.8), {0, 1, 3}),
    (log_probs(0.15, 0.5, 0.1, 0.25), dict(top_p=0.95), {0, 1, 2, 3}),
    (log_probs(0.15, 0.5, 0.1, 0.25), dict(top_p=1e-6), {1}),
    # top-p ties at the boundary are all kept.
    (log_probs(0.3, 0.4, 0.3), dict(top_p=0.5), {0, 1, 2}),
    # a prefix whose mass equals top_p exactly (powers of two: exact in float32) is enough.
    (log_probs(0.5, 0.25, 0.25), dict(top_p=0.5), {0}),
    (log_probs(0.5, 0.25, 0.125, 0.125), dict(top_p=0.75), {0, 1}),
    # min-p keeps p == min_p * max p exactly.
    (log_probs(0.5, 0.25, 0.125, 0.125), dict(min_p=0.5), {0, 1}),
    # min-p: p >= min_p * max p.
    (log_probs(0.05, 0.3, 0.5, 0.15), dict(min_p=0.5), {1, 2}),
    (log_probs(0.05, 0.3, 0.5, 0.15), dict(min_p=0.2), {1, 2, 3}),
    (log_probs(0.05, 0.3, 0.5, 0.15), dict(min_p=1.0), {2}),
    # min-p sees the temperature-scaled distribution: T=0.5 squares the ratios, 0.15/0.5 -> 0.09.
    (log_probs(0.05, 0.3, 0.5, 0.15), dict(min_p=0.2, temperature=0.5), {1, 2}),
    # top-p is computed after top-k, on the renormalised distribution: 0.4/0.7 >= 0.5.
    (log_probs(0.4, 0.3, 0.2, 0.1), dict(top_p=0.5), {0, 1}),
    (log_probs(0.4, 0.3, 0.2, 0.1), dict(top_p=0.5, top_k=2), {0}),
    # min-p comes before top-p (vLLM v1): after min-p, {0: 0.625, 1: 0.375}, so top_p=0.6 -> {0}.
    (log_probs(0.5, 0.3, 0.2), dict(top_p=0.6), {0, 1}),
    (log_probs(0.5, 0.3, 0.2), dict(top_p=0.6, min_p=0.5), {0}),
    # temperature changes top-p's support: T=2 flattens (0.5, 0.3, 0.2) to ~(0.41, 0.32, 0.26).
    (log_probs(0.5, 0.3, 0.2), dict(top_p=0.7, temperature=2.0), {0, 1}),
    (log_probs(0.5, 0.3, 0.2), dict(top_p=0.75, temperature=2.0), {0, 1, 2}),
]


@pytest.mark.parametrize("logits,kwargs,expected", FILTER_CASES)
def test_filter_support(logits, kwargs, expected):
    params = SamplingParams(**kwargs)
    assert support(logits, params) == expected
    assert sampled_set(logits, params) == expected


def test_filters_batch_rows_independent():
    """Rows with different filters in one batch each get their own support."""
    logits = jnp.asarray(np.stack([log_probs(0.4, 0.3, 0.2, 0.1)] * 3))
    st = tensors([SamplingParams(top_k=1), SamplingParams(top_p=0.5), SamplingParams()])
    x = np.asarray(processed_jit(logits, st))
    assert [set(np.flatnonzero(np.isfinite(r))) for r in x] == [{0}, {0, 1}, {0, 1, 2, 3}]
    # The same rows padded into a bigger batch, in another order.
    st = tensors([SamplingParams(), SamplingParams(top_p=0.5), SamplingParams(top_k=1)], pad_to=4)
    x = np.asarray(processed_jit(jnp.concatenate([logits, logits[:1]]), st))
    assert [set(np.flatnonzero(np.isfinite(r))) for r in x[:3]] == [{0, 1, 2, 3}, {0, 1}, {0}]


def _processed_logits_sorted(logits, st):
    """Reference: the former sort-based `processed_logits` (one descending sort per row)."""
    logits = logits.astype(jnp.float32)
    V = logits.shape[-1]
    neg_inf = jnp.float32(-jnp.inf)
    temp = jnp.where(st.temperature < SAMPLING_EPS, 1.0, st.temperature)  # f32[B]
    x = logits / temp[:, None]  # f32[B, V]

    # min-p, relative to the most likely token.
    probs = jax.nn.softmax(x, axis=-1)
    p_max = jnp.max(probs, axis=-1, keepdims=True)
    x = jnp.where(probs < st.min_p[:, None] * p_max, neg_inf, x)

    # top-k: threshold at the k-th largest value.
    s = -jnp.sort(-x, axis=-1)  # f32[B, V] descending
    k = jnp.where((st.top_k <= 0) | (st.top_k > V), V, st.top_k)  # i32[B]
    thr_k = jnp.take_along_axis(s, (k - 1)[:, None], axis=-1)  # f32[B, 1]
    s = jnp.where(s >= thr_k, s, neg_inf)

    # top-p: a token is kept when the mass of the tokens sorted before it is < top_p.
    ps = jax.nn.softmax(s, axis=-1)
    mass_before = jnp.concatenate(  # f32[B, V], exclusive cumulative sum
        [jnp.zeros_like(ps[:, :1]), jnp.cumsum(ps, axis=-1)[:, :-1]], axis=-1
    )
    keep = (mass_before < st.top_p[:, None]) | (st.top_p[:, None] >= 1.0)
    n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)  # i32[B], a prefix since mass_before rises
    thr_p = jnp.take_along_axis(s, (n_keep - 1)[:, None], axis=-1)  # f32[B, 1]

    return jnp.where(x >= jnp.maximum(thr_k, thr_p), x, neg_inf)


sorted_jit = jax.jit(_processed_logits_sorted)


def random_filter_batch(rng, B, V):
    """Logits and per-row params stressing the filters: ties, -inf, extreme temperatures."""
    kind = rng.integers(0, 4, size=B)
    logits = rng.normal(size=(B, V)) * rng.choice([0.1, 1.0, 5.0, 30.0], size=(B, 1))
    small_set = rng.choice([-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0], size=(B, V))
    logits = np.where((kind == 1)[:, None], small_set, logits)  # many ties
    logits = np.where((kind == 2)[:, None], rng.integers(0, 3, size=(B, V)), logits)  # 3 values
    logits = np.where((kind == 3)[:, None], 0.0, logits)  # all tied (then some -inf)
    n_inf = rng.integers(0, V, size=B) * (rng.random(B) < 0.5)
    for b in range(B):
        logits[b, rng.permutation(V)[: n_inf[b]]] = -np.inf
    ks = [0, 0, 1, 2, 3, V // 2, V - 1, V, V + 5]
    params = [
        SamplingParams(
            temperature=float(rng.choice([1e-4, 1e-2, 0.3, 1.0, 2.0, 100.0, 1e4])),
            top_k=int(rng.choice(ks)),
            top_p=float(rng.choice([1e-6, 0.5, 0.9, 0.999, 1.0, 1.0])),
            min_p=float(rng.choice([0.0, 0.0, 0.0, 1e-3, 0.2])),
        )
        for _ in range(B)
    ]
    return jnp.asarray(logits.astype(np.float32)), tensors(params)


@pytest.mark.parametrize("V", [2, 7, 64, 512])
def test_processed_logits_matches_sort_reference(V):
    """The sort-free filters keep exactly the support of the former sort-based implementation."""
    rng = np.random.default_rng(V)
    B = 64
    for _ in range(30):
        logits, st = random_filter_batch(rng, B, V)
        new = np.asarray(processed_jit(logits, st))
        ref = np.asarray(sorted_jit(logits, st))
        np.testing.assert_array_equal(np.isfinite(new), np.isfinite(ref))
        np.testing.assert_array_equal(new[np.isfinite(new)], ref[np.isfinite(ref)])
    # Batches where no row uses a filter take the skip branches.
    off = tensors([SamplingParams(temperature=0.7)] * B)
    np.testing.assert_array_equal(processed_jit(logits, off), sorted_jit(logits, off))


def test_filtered_frequencies_match_renormalised_distribution():
    """top-k with temperature: draws follow softmax(logits / T) restricted to the top k."""
    logits = np.array([1.0, 0.2, -0.5, 0.8, -2.0, 0.0], np.float32)
    params = SamplingParams(temperature=0.8, top_k=4)
    n = N_FREQ
    rows = jnp.broadcast_to(jnp.asarray(logits), (n, 6))
    tokens = np.asarray(sample_jit(rows, tensors([params] * n)).tokens)
    keep = [0, 1, 3, 5]
    assert set(np.unique(tokens)) <= set(keep)
    z = np.exp(logits[keep] / 0.8)
    expected = n * z / z.sum()
    observed = np.array([(tokens == t).sum() for t in keep])
    assert ((observed - expected) ** 2 / expected).sum() < CHI2_999[3]


# ---------------------------------------------------------------- penalties


def test_penalties_match_vllm_formula():
    logits = jnp.array([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]] * 2, jnp.float32)
    prompt_mask = jnp.array([[True, True, False, False, False, True]] * 2)
    counts = jnp.array([[0, 0, 2, 1, 0, 3]] * 2, jnp.int32)
    st = tensors(
        [
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            SamplingParams(),
        ]
    )
    out = np.asarray(jax.jit(apply_penalties)(logits, prompt_mask, counts, st))
    expected = [
        2.0 / 2.0,  # in prompt, positive: divided
        -1.0 * 2.0,  # in prompt, negative: multiplied
        0.5 / 2.0 - 0.5 * 2 - 0.25,  # in output twice
        -0.5 * 2.0 - 0.5 * 1 - 0.25,  # in output once
        3.0,  # unseen: untouched
        0.0 * 2.0 - 0.5 * 3 - 0.25,  # zero logit is multiplied (stays 0), then penalised
    ]
    np.testing.assert_allclose(out[0], expected, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(out[1], np.asarray(logits[1]))  # neutral row unchanged


def test_repetition_penalty_below_one_encourages():
    logits = jnp.array([[2.0, -2.0]], jnp.float32)
    st = tensors([SamplingParams(repetition_penalty=0.5)])
    out = np.asarray(apply_penalties(logits, jnp.array([[True, True]]), jnp.zeros((1, 2), int), st))
    np.testing.assert_allclose(out, [[4.0, -1.0]])


# ---------------------------------------------------------------- greedy, seeds


def test_greedy_is_argmax_of_logits():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(B_SEED, V_SEED)).astype(np.float32)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1e-6, top_k=3, top_p=0.5),  # < eps: greedy
        SamplingParams(temperature=0.0, seed=7),
    ] * 2
    out = sample_jit(jnp.asarray(logits), tensors(params, pad_to=B_SEED))
    np.testing.assert_array_equal(np.asarray(out.tokens), logits.argmax(-1))
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy


def seeded_stream(seed, row, batch, steps=12):
    """Tokens of a request with `seed` at `row` of `batch` live rows (padded to B_SEED), the
    other rows being different requests with random logits, params, seeds and steps."""
    rng = np.random.default_rng(1000 + row + 7 * batch)
    base = np.random.default_rng(5).normal(size=V_SEED).astype(np.float32)
    tokens = []
    for step in range(steps):
        logits = rng.normal(size=(B_SEED, V_SEED)).astype(np.float32)
        logits[row] = base + 0.1 * step
        params = [SamplingParams(temperature=float(rng.uniform(0.5, 2))) for _ in range(batch)]
        params[row] = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
        seeds = rng.integers(0, 2**31, size=batch).tolist()
        seeds[row] = seed
        steps_ = rng.integers(0, 100, size=batch).tolist()
        steps_[row] = step
        out = sample_jit(jnp.asarray(logits), tensors(params, seeds, steps_, pad_to=B_SEED))
        tokens.append(int(out.tokens[row]))
    return tokens


def test_same_seed_same_tokens_anywhere_in_any_batch():
    ref = seeded_stream(1234, row=0, batch=1)
    assert seeded_stream(1234, row=0, batch=4) == ref
    assert seeded_stream(1234, row=3, batch=4) == ref
    assert seeded_stream(1234, row=7, batch=8) == ref
    assert len(set(ref)) > 1  # the stream is actually random


def test_different_seeds_differ():
    streams = {tuple(seeded_stream(seed, row=0, batch=2)) for seed in (1, 2, 3, 2**32 + 7)}
    assert len(streams) == 4


def test_seed_reduced_to_32_bits_and_padding_neutral():
    st = SamplingTensors.from_params([SamplingParams()], [2**32 + 5], [3], pad_to=4)
    assert st.seeds.dtype == np.uint32 and st.seeds.tolist() == [5, 0, 0, 0]
    assert st.temperature.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert st.top_p.tolist() == [1.0] * 4 and st.repetition_penalty.tolist() == [1.0] * 4
    with pytest.raises(ValueError, match="pad_to"):
        SamplingTensors.from_params([SamplingParams()] * 3, [0] * 3, [0] * 3, pad_to=2)


# ---------------------------------------------------------------- frequencies


def chi2_stat(tokens, probs):
    n = len(tokens)
    observed = np.bincount(tokens, minlength=len(probs))
    expected = n * np.asarray(probs)
    return float(((observed - expected) ** 2 / expected).sum())


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_temperature_frequencies_chi_square():
    logits = np.array([0.5, -0.3, 1.2, 0.0, -1.0, 0.8], np.float64)
    temp = 0.7
    n = N_FREQ
    params = [SamplingParams(temperature=temp)] * n
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, 6))
    tokens = np.asarray(sample_jit(rows, tensors(params, seeds=list(range(n)))).tokens)
    assert chi2_stat(tokens, softmax(logits / temp)) < CHI2_999[5]
    # The test can fail: the same draws are rejected against a wrong temperature's distribution.
    for wrong in (0.6, 0.85, 1.0):
        assert chi2_stat(tokens, softmax(logits / wrong)) > CHI2_999[5], wrong
    # Draws over steps of one seed (the per-request stream) follow the same distribution.
    st = tensors(params, seeds=[42] * n, steps=list(range(n)))
    tokens = np.asarray(sample_jit(rows, st).tokens)
    assert chi2_stat(tokens, softmax(logits / temp)) < CHI2_999[5]


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_and_top_n_sorted():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(B_SEED, V_SEED)).astype(np.float32) * 3
    params = [SamplingParams(temperature=0.5, top_k=5), SamplingParams(temperature=0.0)] * 4
    out = sample_jit(jnp.asarray(logits), tensors(params), num_logprobs=5)
    lp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))  # raw, not / T
    toks = np.asarray(out.tokens)
    np.testing.assert_allclose(np.asarray(out.logprobs), lp[np.arange(B_SEED), toks], atol=1e-6)
    top_ids, top_lp = np.asarray(out.top_ids), np.asarray(out.top_logprobs)
    assert top_ids.shape == (B_SEED, 5) and top_ids.dtype == np.int32
    np.testing.assert_array_equal(top_ids, np.argsort(-lp, axis=-1)[:, :5])
    np.testing.assert_allclose(top_lp, np.take_along_axis(lp, top_ids, -1), atol=1e-6)
    assert (np.diff(top_lp, axis=-1) <= 0).all()

    none = sample_jit(jnp.asarray(logits), tensors(params), num_logprobs=0)
    assert none.top_ids.shape == (B_SEED, 0) and none.top_logprobs.shape == (B_SEED, 0)
    np.testing.assert_array_equal(np.asarray(none.tokens), toks)

    # logprob_logits: the logprobs of other (e.g. unpenalised) logits; tokens unchanged.
    other = rng.normal(size=(B_SEED, V_SEED)).astype(np.float32)
    out2 = sample_jit(
        jnp.asarray(logits), tensors(params), num_logprobs=5, logprob_logits=jnp.asarray(other)
    )
    lp2 = np.asarray(jax.nn.log_softmax(jnp.asarray(other), axis=-1))
    np.testing.assert_array_equal(np.asarray(out2.tokens), toks)
    np.testing.assert_allclose(np.asarray(out2.logprobs), lp2[np.arange(B_SEED), toks], atol=1e-6)


# ---------------------------------------------------------------- host-side validation

BAD = [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(min_p=-0.01), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(seed=1.5), "seed"),
    (dict(seed="1"), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop=[1]), "stop"),
    (dict(stop_token_ids=[1, -2]), "stop_token_ids"),
    (dict(ignore_eos="yes"), "ignore_eos"),
]


@pytest.mark.parametrize("kwargs,field", BAD)
def test_validation_names_field(kwargs, field):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**kwargs)


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[7, 7, 3], top_k=-1, seed=-1, temperature=1)
    assert p.stop == ("###",) and p.stop_token_ids == (7, 3)
    assert p.top_k == 0 and p.seed is None and isinstance(p.temperature, float)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2) == SamplingParams(
        temperature=0
    )
    assert SamplingParams(min_tokens=3, max_tokens=None).max_tokens is None
    assert SamplingParams(logprobs=0).logprobs == 0
    assert hash(SamplingParams(stop=["x"])) == hash(SamplingParams(stop=("x",)))
    assert SamplingParams(stop=["ab", "cdef"]).stop_buffer_length == 3
    assert SamplingParams(stop=["abc"], include_stop_str_in_output=True).stop_buffer_length == 0


def test_from_dict():
    p = SamplingParams.from_dict({"temperature": 0.3, "stop": ["\n"], "max_tokens": 8})
    assert p == SamplingParams(temperature=0.3, stop=("\n",), max_tokens=8)
    with pytest.raises(RequestError, match="best_of.*top_q|top_q.*best_of") as e:
        SamplingParams.from_dict({"top_q": 0.5, "best_of": 2, "top_p": 0.5})
    assert "top_p" in str(e.value)  # the allowed fields are listed
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams.from_dict({"top_p": 2})
    with pytest.raises(RequestError, match="JSON object"):
        SamplingParams.from_dict([("top_p", 0.5)])


# ---------------------------------------------------------------- stop strings


def test_stop_at_chunk_boundary():
    # Previous chunk "hello ", new chunk "STOP": the stop begins exactly at the boundary.
    assert find_stop_string("hello STOP", 6, ("STOP",), include=False) == 6
    assert find_stop_string("hello STOP", 6, ("STOP",), include=True) == 10
    # Stop ends exactly at the end of the previous chunk: found then, not again now.
    assert find_stop_string("hello", 0, ("lo",), include=False) == 3
    assert find_stop_string("hello world", 5, ("lo",), include=False) is None
    assert find_stop_string("", 0, ("x",), include=False) is None
    assert find_stop_string("abc", 0, (), include=False) is None


def test_stop_spanning_two_chunks():
    assert find_stop_string("abc ST", 0, ("STOP",), include=False) is None
    assert find_stop_string("abc STOP more", 6, ("STOP",), include=False) == 4
    assert find_stop_string("abc STOP more", 6, ("STOP",), include=True) == 8
    # Three chunks: "S" | "TO" | "P".
    assert find_stop_string("xS", 0, ("STOP",), include=False) is None
    assert find_stop_string("xSTO", 2, ("STOP",), include=False) is None
    assert find_stop_string("xSTOP", 4, ("STOP",), include=False) == 1


def test_multiple_stops_earliest_wins():
    text = "one two three"
    assert find_stop_string(text, 0, ("three", "two"), include=False) == 4
    assert find_stop_string(text, 0, ("three", "two"), include=True) == 7
    # Nested: "b" completes before "abc", so it wins (as in a token-by-token stream).
    assert find_stop_string("xabc", 0, ("abc", "b"), include=False) == 2
    # Same end: the longer one, so no piece of a stop string remains.
    assert find_stop_string("xabc", 0, ("bc", "abc"), include=False) == 1
    assert find_stop_string("xabc", 0, ("bc", "abc"), include=True) == 4


def test_stop_multibyte_characters():
    text = "día→fin😀 ok"
    cut = find_stop_string(text, 0, ("→",), include=False)
    assert text[:cut] == "día" and text[:cut].encode("utf-8").decode("utf-8") == "día"
    cut = find_stop_string(text, 0, ("→",), include=True)
    assert text[:cut] == "día→"
    cut = find_stop_string(text, 4, ("fin😀",), include=True)
    assert text[:cut] == "día→fin😀"
    assert find_stop_string(text, 8, ("😀 ",), include=False) == 7


def stream_cut(text, chunks, stops, include):
    """Feeds `text` in the given chunk sizes; the first cut any call reports."""
    pos = 0
    for size in chunks:
        new = pos + size
        cut = find_stop_string(text[:new], pos, stops, include)
        if cut is not None:
            return cut
        pos = new
    return None


def test_stop_result_independent_of_chunking():
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice("abc→") for _ in range(rng.randint(0, 14)))
        stops = tuple(
            "".join(rng.choice("abc→") for _ in range(rng.randint(1, 3)))
            for _ in range(rng.randint(1, 3))
        )
        include = rng.random() < 0.5
        one_char = stream_cut(text, [1] * len(text), stops, include)
        chunks, left = [], len(text)
        while left:
            chunks.append(min(left, rng.randint(1, 5)))
            left -= chunks[-1]
        assert stream_cut(text, chunks, stops, include) == one_char, (text, stops, chunks)
        assert find_stop_string(text, 0, stops, include) == one_char
        if one_char is not None and not include:
            assert not any(s in text[:one_char] for s in stops)


def test_functools_partial_jit_friendly():
    """`sample` composes with jit/partial; a second call with new values does not recompile."""
    f = jax.jit(functools.partial(sample, num_logprobs=2))
    logits = jnp.zeros((4, 8), jnp.float32)
    f(logits, tensors([SamplingParams()] * 4))
    f(logits, tensors([SamplingParams(top_k=2, temperature=0.3)] * 4, seeds=[9, 8, 7, 6]))
    assert f._cache_size() == 1
