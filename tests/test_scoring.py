"""``LLM.score`` and ``LLM.perplexity`` against sums of transformers' f32 log-softmax, on a tiny
Llama 2 checkpoint (``hf_fixtures``); rolling windows cover every token exactly once (a text 2.5x
``max_model_len``); text pairs tokenize as lm-evaluation-harness's HFLM; bad items fail alone."""

from __future__ import annotations

import math
from types import SimpleNamespace

import hf_fixtures as H
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.llm import LLM
from jaxinfer.scoring import encode_pair, rolling_windows

ENGINE = dict(
    max_model_len=32,
    page_size=8,
    max_num_seqs=8,
    max_num_batched_tokens=16,
    compilation_cache=False,
    skip_tokenizer_init=True,
)
LOGPROB_ATOL = 1e-4  # per token, f32 vs transformers f32 (test_family_engine_parity)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(LLM, transformers' log_softmax f64[S, V] of a list of ids)."""
    path = H.build_checkpoint("llama2", str(tmp_path_factory.mktemp("score") / "llama2"))
    return LLM(path, **ENGINE), H.hf_logprob_ref(path)


def test_score_equals_transformers(setup):
    llm, ref = setup
    pairs = [(H.random_ids(3 + i, 10 + i), H.random_ids(1 + i, 20 + i)) for i in range(6)]
    ctx = H.random_ids(6, 30)  # a greedy continuation of 5 tokens, from transformers' argmax
    cont = []
    for _ in range(5):
        cont.append(int(ref(ctx + cont)[-1].argmax()))
    pairs += [(ctx, cont), (ctx, cont[:4] + [int(np.argsort(ref(ctx + cont[:4])[-1])[-2])])]
    cases = (
        [(p, None) for p in pairs[:4]]
        + [
            ((ctx, []), "continuation has zero tokens"),
            (
                (H.random_ids(20, 1), H.random_ids(12, 2)),
                "context + continuation has 32 tokens (20 + 12); scoring takes at most "
                "max_model_len - 1 = 31",
            ),
            ((ctx, cont), None),  # a good pair between bad ones
            (([], [5]), "context has zero tokens"),
            (([5, 10**6], [7]), "outside the vocabulary"),
            (("text", [5]), "both be strings or both be lists"),
        ]
        + [(p, None) for p in pairs[4:]]
    )
    pairs = [p for p, _ in cases]
    bad = {i: e for i, (_, e) in enumerate(cases) if e is not None}
    res = llm.score(pairs)
    assert len(res) == len(pairs)
    greedy_seen = set()
    for i, ((c, x), r) in enumerate(zip(pairs, res, strict=True)):
        if i in bad:
            assert r.error is not None and bad[i] in r.error, (i, r.error)
            assert r.logprob is None and r.num_tokens == 0
            continue
        assert r.error is None, (i, r.error)
        lp = ref(c + x)
        rows = lp[len(c) - 1 : len(c) - 1 + len(x)]
        want = [rows[j, t] for j, t in enumerate(x)]
        assert r.num_tokens == len(x) and r.continuation_ids == x and r.context_ids == c
        np.testing.assert_allclose(r.token_logprobs, want, rtol=0, atol=LOGPROB_ATOL)
        np.testing.assert_allclose(r.logprob, sum(want), rtol=0, atol=LOGPROB_ATOL * len(x))
        greedy = bool((rows.argmax(-1) == np.asarray(x)).all())
        assert r.is_greedy == greedy, i
        greedy_seen.add(greedy)
    assert greedy_seen == {True, False}


def _reference_rolling(ref, tokens, prefix, max_len, stride):
    """Total logprob of ``tokens`` where token i < max_len is conditioned on [prefix] + tokens[:i]
    and the later tokens come in groups of ``stride``, the group ending at e conditioned on
    tokens[e - max_len - 1:i] (written out from lm-eval's description, not from scoring.py)."""
    total, n = 0.0, len(tokens)
    first = min(max_len, n)
    lp = ref([prefix] + tokens[: first - 1])
    total += sum(lp[i, tokens[i]] for i in range(first))
    e = first
    while e < n:
        start, e = e, min(e + stride, n)
        lo = max(0, e - max_len - 1)
        lp = ref(tokens[lo : e - 1])
        total += sum(lp[i - 1 - lo, tokens[i]] for i in range(start, e))
    return total


def test_perplexity_rolling_equals_transformers(setup):
    llm, ref = setup
    text = H.random_ids(80, 40)  # 2.5x max_model_len
    prefix = llm._engine_tokenizer.bos_id
    res = llm.perplexity([text, [], text[:5], "no tokenizer"])
    r = res[0]
    assert r.error is None and r.num_tokens == 80 and r.num_windows == 3
    want = _reference_rolling(ref, text, prefix, 30, 30)
    np.testing.assert_allclose(r.logprob, want, rtol=0, atol=LOGPROB_ATOL * 80)
    assert math.isclose(r.perplexity, math.exp(-r.logprob / 80))
    assert res[1].error == "text has zero tokens"
    assert res[2].error is None and res[2].num_windows == 1
    np.testing.assert_allclose(
        res[2].logprob,
        _reference_rolling(ref, text[:5], prefix, 30, 30),
        rtol=0,
        atol=LOGPROB_ATOL * 5,
    )
    assert "tokenizer" in res[3].error
    r = llm.perplexity([text], stride=12)[0]
    assert r.num_tokens == 80 and r.num_windows == 1 + math.ceil(50 / 12)
    np.testing.assert_allclose(
        r.logprob, _reference_rolling(ref, text, prefix, 30, 12), rtol=0, atol=LOGPROB_ATOL * 80
    )
    with pytest.raises(ValueError, match="stride"):
        llm.perplexity([text], stride=31)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 120), max_len=st.integers(1, 40), data=st.data())
def test_rolling_windows_score_every_token_once(n, max_len, data):
    stride = data.draw(st.integers(1, max_len))
    tokens = list(range(100, 100 + n))
    wins = rolling_windows(tokens, -1, max_len, stride)
    assert [t for _, c in wins for t in c] == tokens  # each token once, in order
    assert wins[0][0] == [-1] and len(wins[0][1]) == min(n, max_len)
    for ctx, cont in wins[1:]:
        assert 1 <= len(cont) <= stride and len(ctx) + len(cont) == max_len + 1
        start = tokens.index(cont[0])
        assert ctx == tokens[start - len(ctx) : start]  # the tokens right before the window


def test_rolling_windows_equal_lm_eval():
    utils = pytest.importorskip("lm_eval.utils")
    tokens = list(range(3, 203))
    for max_len in (1, 7, 30):
        for context_len in sorted({1, max_len // 2 or 1, max_len}):
            want = [
                utils.make_disjoint_window(w)
                for w in utils.get_rolling_token_windows(
                    tokens, prefix_token=1, max_seq_len=max_len, context_len=context_len
                )
            ]
            got = rolling_windows(tokens, 1, max_len, max_len - context_len + 1)
            assert [tuple(map(list, w)) for w in want] == got


def test_text_pairs_tokenized_as_lm_eval(stories_dir):
    from jaxinfer.tokenizers.loader import load_tokenizer

    tok = load_tokenizer(stories_dir)
    pairs = [
        ("Once upon a time", " there was a girl"),
        ("Tom and  ", "his dog"),
        ("She said: ", '"hi"'),
        ("x", "y"),
    ]
    model = pytest.importorskip("lm_eval.api.model")
    fake = SimpleNamespace(
        backend="causal",
        tok_encode=lambda s, **kw: tok.encode(
            s, add_special_tokens=kw.get("add_special_tokens", True)
        ),
    )
    for c, x in pairs:
        assert encode_pair(tok, c, x) == tuple(model.TemplateLM._encode_pair(fake, c, x))
    # lm-eval's empty-context rule (TemplateLM.loglikelihood): [BOS] + the continuation alone.
    assert encode_pair(tok, "", " there") == ([tok.bos_id], tok.encode(" there", False))


class _CharTokenizer:
    """One id per character (BOS = 1 first): whitespace is never dropped, so where the pair is
    split shows in the ids."""

    bos_id, eos_ids = 1, (2,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]


def test_trailing_context_spaces_move_to_the_continuation():
    tok = _CharTokenizer()
    ords = lambda s: [ord(c) for c in s]  # noqa: E731
    assert encode_pair(tok, "Tom and  ", "his") == ([1, *ords("Tom and")], ords("  his"))
    assert encode_pair(tok, "Q: ", "\nA") == ([1, *ords("Q:")], ords(" \nA"))
    assert encode_pair(tok, "", "2") == ([1], ords("2"))
    model = pytest.importorskip("lm_eval.api.model")
    fake = SimpleNamespace(
        backend="causal",
        tok_encode=lambda s, **kw: tok.encode(
            s, add_special_tokens=kw.get("add_special_tokens", True)
        ),
    )
    for c, x in [("Tom and  ", "his"), ("Q: ", "\nA"), ("a\t", " b"), ("x", "y")]:
        assert encode_pair(tok, c, x) == tuple(model.TemplateLM._encode_pair(fake, c, x))


def test_pairs_sharing_a_context_read_its_pages_from_the_prefix_cache(setup):
    # Scoring asks logprobs from the continuation on (prompt_logprobs_from), so the context's
    # full pages may come from the prefix cache: the values stay transformers'.
    llm, ref = setup
    ctx = H.random_ids(20, 40)  # 2 full pages of 8 and a partial one
    pairs = [(ctx, H.random_ids(2 + i, 50 + i)) for i in range(4)]

    def check(res):
        for (c, x), r in zip(pairs, res, strict=True):
            assert r.error is None, r.error
            lp = ref(c + x)
            want = [lp[len(c) - 1 + j, t] for j, t in enumerate(x)]
            np.testing.assert_allclose(r.token_logprobs, want, rtol=0, atol=LOGPROB_ATOL)

    before = llm.prefix_cache_stats()["hit_tokens"]
    check(llm.score(pairs))
    mid = llm.prefix_cache_stats()["hit_tokens"]
    assert mid > before  # the later pairs found the first one's context pages
    check(llm.score(pairs))
    # Each pair may read min(prompt - 1, prompt_logprobs_from - 1 = 19) tokens: 2 full pages.
    assert llm.prefix_cache_stats()["hit_tokens"] - mid == 4 * 16
