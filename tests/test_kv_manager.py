"""The KV-cache manager's interface alone (both variants, no scheduler, no device).

Expectations are written out by hand, not read from the code: a sequence of t tokens holds
ceil(t / Z) pages; an allocation is refused, changing nothing, when the pages it needs plus the
reserve exceed the free pages; a new sequence shares the full pages of its longest prefix that
another sequence computed (at most its length - 1 tokens), and nothing with caching off; freed
cached pages are evicted least recently used first, a sequence's tail page before its head
(vLLM's order); a hit marks its pages recently used; requests with other ``extra_keys`` (a LoRA
adapter's id, later) never share a page.
"""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.engine.kv_manager import (
    KVCacheManager,
    PrefixCachingKVCacheManager,
    make_kv_manager,
)
from jaxinfer.engine.sequence import Sequence
from jaxinfer.sampling.sampler import SamplingParams

Z = 4  # tokens per page

VARIANTS = {
    "no_cache": lambda p: KVCacheManager(p, Z),
    "prefix_cache": lambda p: PrefixCachingKVCacheManager(p, Z, ("test",)),
}


def _seq(rid: str, ids: list[int], extra_keys: tuple = ()) -> Sequence:
    return Sequence(rid, list(ids), SamplingParams(temperature=0.0), 0, extra_keys=extra_keys)


def _admit(kv, seq: Sequence, reserve: int = 0) -> tuple[int, bool]:
    """What the scheduler does at admission: look up, then allocate the rest of the prompt.
    Returns (cached tokens, admitted)."""
    hit = kv.get_computed_pages(seq)
    ok = kv.allocate(seq, seq.num_tokens - hit.num_tokens, hit, reserve)
    return hit.num_tokens, ok


def _compute(kv, seq: Sequence) -> None:
    """A step computed every token of ``seq``; its full pages are published."""
    seq.num_computed = seq.num_tokens
    kv.commit_full_pages(seq, seq.num_computed)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------- page counts (both variants)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 11), st.integers(0, 3), st.booleans()),
        min_size=1,
        max_size=30,
    ),
    num_pages=st.integers(2, 14),
)
def test_pages_follow_the_formula_and_refusals_change_nothing(variant, ops, num_pages):
    # Each op: sequence k grows by n tokens with `reserve` pages kept free, or is freed. Token
    # ids are unique per sequence, so nothing is shared and the pool is a plain count.
    kv = VARIANTS[variant](num_pages)
    seqs = [_seq(str(k), [1000 * (k + 1) + i for i in range(40)]) for k in range(4)]
    tokens = [0] * 4  # tokens each sequence holds pages for, by the formula
    for k, n, reserve, free in ops:
        s = seqs[k]
        if free:
            kv.free(s)
            s.num_computed, tokens[k] = 0, 0
        else:
            held = sum(_cdiv(t, Z) for t in tokens)
            need = _cdiv(tokens[k] + n, Z) - _cdiv(tokens[k], Z)
            before = list(s.pages)
            ok = kv.allocate(s, n, num_reserved=reserve)
            assert ok == (need + reserve <= num_pages - 1 - held)
            if ok:
                tokens[k] += n
                s.num_computed = tokens[k]  # the step ran
                assert s.pages[: len(before)] == before
            else:
                assert s.pages == before
        assert [len(q.pages) for q in seqs] == [_cdiv(t, Z) for t in tokens]
        held = sum(_cdiv(t, Z) for t in tokens)
        assert kv.num_free_pages == num_pages - 1 - held
        live = [p for q in seqs for p in q.pages]
        assert len(set(live)) == len(live) and 0 not in live  # distinct, never the null page
        kv.check_invariants()


# ---------------------------------------------------------------- sharing


def test_a_prefix_is_shared_by_full_pages_with_caching_and_never_without():
    a = list(range(1, 3 * Z + 2))  # 3 full pages + 1 token
    b = a[: 2 * Z] + [99, 98, 97]  # shares a's first 2 pages, then differs
    c = a[: 3 * Z]  # a's first 3 pages exactly: its last token must be computed
    for variant in VARIANTS:
        kv = VARIANTS[variant](20)
        sa, sb, sc = _seq("a", a), _seq("b", b), _seq("c", c)
        assert _admit(kv, sa) == (0, True)
        _compute(kv, sa)
        hit_b, ok_b = _admit(kv, sb)
        hit_c, ok_c = _admit(kv, sc)
        assert ok_b and ok_c
        if variant == "no_cache":
            assert (hit_b, hit_c) == (0, 0) and sb.num_computed == sc.num_computed == 0
            assert not set(sa.pages) & set(sb.pages + sc.pages)
            assert kv.stats() == {
                "queried_tokens": 0,
                "hit_tokens": 0,
                "hit_rate": 0.0,
                "evictions": 0,
                "cached_pages": 0,
            }
            assert kv.cached_prefix_tokens(a) == 0
        else:
            # b: 2 full pages in common; c: 3 in common, capped at (3Z - 1) // Z = 2 pages
            assert (hit_b, hit_c) == (2 * Z, 2 * Z)
            assert sb.pages[:2] == sa.pages[:2] == sc.pages[:2]
            assert sb.num_computed == sc.num_computed == 2 * Z
            assert sb.num_cached_tokens == sc.num_cached_tokens == 2 * Z
            assert not set(sb.pages[2:]) & set(sa.pages + sc.pages[2:])
            assert [int(kv.pool.refcounts[p]) for p in sa.pages] == [3, 3, 1, 1]
            st_ = kv.stats()
            assert (st_["queried_tokens"], st_["hit_tokens"]) == (len(a) + len(b) + len(c), 4 * Z)
            assert st_["cached_pages"] == 3  # a's full pages; b's and c's are not computed yet
            assert kv.cached_prefix_tokens(a) == 3 * Z
            assert kv.cached_prefix_tokens(b) == 2 * Z
        # pages: a 4, b 3 (2 shared with caching), c 3 (2 shared)
        held = len(set(sa.pages + sb.pages + sc.pages))
        assert held == (4 + 1 + 1 if variant == "prefix_cache" else 4 + 3 + 3)
        assert kv.num_free_pages == 19 - held
        for s in (sa, sb, sc):
            kv.free(s)
        assert kv.num_free_pages == 19 and (kv.pool.refcounts[1:] == 0).all()
        kv.check_invariants()


def test_free_publishes_what_was_computed():
    kv = VARIANTS["prefix_cache"](20)
    s = _seq("a", list(range(1, 3 * Z + 1)))
    assert kv.allocate(s, s.num_tokens)
    s.num_computed = 2 * Z + 1  # a step wrote 2 full pages and one token of the third
    kv.free(s)
    assert s.pages == []
    assert kv.cached_prefix_tokens(list(range(1, 4 * Z))) == 2 * Z


def test_request_keys_separate_pages_of_equal_tokens():
    kv = VARIANTS["prefix_cache"](30)
    ids = list(range(1, 3 * Z + 2))
    first = _seq("a1", ids, ("adapter-1",))
    _admit(kv, first)
    _compute(kv, first)
    other = _seq("a2", ids, ("adapter-2",))
    assert _admit(kv, other) == (0, True)  # same tokens, another adapter: nothing shared
    _compute(kv, other)
    assert not set(first.pages) & set(other.pages)
    for keys, owner in ((("adapter-1",), first), (("adapter-2",), other)):
        again = _seq("again", ids, keys)
        assert _admit(kv, again) == (3 * Z, True)
        assert again.pages[:3] == owner.pages[:3]
        assert kv.cached_prefix_tokens(ids, keys) == 3 * Z
    assert _admit(kv, _seq("plain", ids)) == (0, True)  # no adapter: shares with neither
    assert kv.cached_prefix_tokens(ids) == 0
    kv.check_invariants()


# ---------------------------------------------------------------- eviction order


def _two_cached_sequences(kv):
    """Sequences a and b of 2 full pages + 1 token each, computed and freed in that order: the
    LRU queue is then a's tail, a's head, b's tail, b's head (b's extra token's page is free)."""
    a, b = list(range(1, 2 * Z + 2)), list(range(101, 2 * Z + 102))
    sa, sb = _seq("a", a), _seq("b", b)
    for s in (sa, sb):
        _admit(kv, s)
        _compute(kv, s)
    pages = {"a": list(sa.pages), "b": list(sb.pages)}
    kv.free(sa)
    kv.free(sb)
    return a, b, pages


def test_eviction_takes_free_pages_first_then_lru_tail_first():
    # 7 usable pages: a and b hold 3 each; 1 never used. After both are freed, 4 pages are cached.
    kv = VARIANTS["prefix_cache"](8)
    a, b, pages = _two_cached_sequences(kv)
    assert kv.stats()["cached_pages"] == 4 and kv.num_free_pages == 7
    new = _seq("new", list(range(201, 201 + 3 * Z)))  # 3 pages: the 3 uncached pages first
    assert kv.allocate(new, 3 * Z)
    new.num_computed = 3 * Z
    assert kv.stats()["evictions"] == 0
    assert (kv.cached_prefix_tokens(a + [0]), kv.cached_prefix_tokens(b + [0])) == (2 * Z, 2 * Z)
    expect = [  # each further page evicts: a's tail, a's head, b's tail, b's head
        (pages["a"][1], Z, 2 * Z),
        (pages["a"][0], 0, 2 * Z),
        (pages["b"][1], 0, Z),
        (pages["b"][0], 0, 0),
    ]
    for i, (page, left_a, left_b) in enumerate(expect):
        assert kv.allocate(new, Z)
        new.num_computed += Z
        assert new.pages[-1] == page
        assert kv.stats()["evictions"] == i + 1
        assert kv.cached_prefix_tokens(a + [0]) == left_a
        assert kv.cached_prefix_tokens(b + [0]) == left_b
    assert kv.num_free_pages == 0 and not kv.allocate(new, 1)
    kv.check_invariants()


def test_a_lookup_hit_is_a_use_even_when_the_admission_is_refused():
    kv = VARIANTS["prefix_cache"](8)
    a, b, pages = _two_cached_sequences(kv)
    # a comes back but is refused (the reserve cannot be met): its pages are still the most
    # recently used, so b's go first: b's tail, b's head, then a's tail.
    again = _seq("again", a)
    hit = kv.get_computed_pages(again)
    assert hit.num_tokens == 2 * Z and hit.pages == pages["a"][:2]
    assert not kv.allocate(again, again.num_tokens - hit.num_tokens, hit, num_reserved=7)
    assert again.pages == [] and again.num_computed == 0
    assert kv.stats()["queried_tokens"] == 2 * (2 * Z + 1)  # a refusal is not counted
    assert kv.num_free_pages == 7 and (kv.pool.refcounts[1:] == 0).all()
    # data-parallel routing's look-up is not a use: b's pages keep their place
    assert kv.cached_prefix_tokens(b + [0]) == 2 * Z
    new = _seq("new", list(range(201, 201 + 6 * Z)))
    assert kv.allocate(new, 6 * Z)  # 3 uncached + b's tail, b's head, a's tail
    assert new.pages[3:] == [pages["b"][1], pages["b"][0], pages["a"][1]]
    assert kv.cached_prefix_tokens(a + [0]) == Z and kv.cached_prefix_tokens(b + [0]) == 0
    kv.check_invariants()


def test_hit_pages_nobody_holds_count_as_free_until_taken():
    # 3 usable pages: a's 2 full pages cached and unheld, 1 free. A sequence with a's prefix and
    # 2 more pages needs 3 pages in all but only 1 is left once its 2 hit pages are taken.
    kv = VARIANTS["prefix_cache"](4)
    a = list(range(1, 2 * Z + 1))
    sa = _seq("a", a)
    _admit(kv, sa)
    _compute(kv, sa)
    kv.free(sa)
    assert kv.num_free_pages == 3
    s = _seq("b", a + list(range(50, 50 + 2 * Z)))
    hit = kv.get_computed_pages(s)
    assert hit.num_tokens == 2 * Z
    assert not kv.allocate(s, 2 * Z, hit)  # 2 new pages, 1 left after taking the hit
    assert kv.num_free_pages == 3 and s.pages == []
    assert kv.allocate(s, Z, hit)  # 1 new page fits
    assert s.pages[:2] == hit.pages and kv.num_free_pages == 0
    kv.check_invariants()


def test_clear_cache_forgets_every_page_and_keeps_held_ones():
    kv = VARIANTS["prefix_cache"](10)
    a = list(range(1, 2 * Z + 2))
    sa, sb = _seq("a", a), _seq("b", a)
    _admit(kv, sa)
    _compute(kv, sa)
    assert _admit(kv, sb)[0] == 2 * Z
    kv.free(sa)
    kv.clear_cache()
    assert kv.cached_prefix_tokens(a) == 0 and kv.stats()["cached_pages"] == 0
    assert kv.num_free_pages == 9 - len(sb.pages)  # b still holds its pages
    kv.free(sb)
    assert kv.num_free_pages == 9 and kv.stats()["cached_pages"] == 0
    kv.check_invariants()


def test_make_kv_manager_follows_the_config():
    ids = list(range(1, 2 * Z + 2))
    for caching, want in ((True, 2 * Z), (False, 0)):
        ecfg = types.SimpleNamespace(enable_prefix_caching=caching, num_pages=9, page_size=Z)
        kv = make_kv_manager(ecfg, ("m",))
        assert (kv.num_pages, kv.page_size, kv.num_free_pages) == (9, Z, 8)
        s = _seq("a", ids)
        _admit(kv, s)
        _compute(kv, s)
        kv.free(s)
        assert _admit(kv, _seq("b", ids))[0] == want
