"""KV-cache manager: the pages each sequence holds and, with prefix caching, the pages a new
sequence can take from the cache (host side).

The scheduler asks one object, in the shape of vLLM v1's ``KVCacheManager`` (nano-vllm's
``BlockManager``):

- ``get_computed_pages(seq)``: the cached pages of the longest prefix a sequence with nothing
  computed can start from, and the tokens they cover (``ComputedPages``). Takes no reference;
  the hit pages become the most recently used (a refused admission asks again soon).
- ``allocate(seq, num_new_tokens, computed, num_reserved)``: takes the hit's pages and new pages
  for the next ``num_new_tokens`` tokens, or refuses (False, nothing changed) when the pool is
  short; the scheduler turns a refusal into preemption (a running sequence) or waiting (an
  admission).
- ``commit_full_pages(seq, num_computed)``: publishes the pages that became full among the first
  ``num_computed`` tokens (computed, or written by a step already scheduled) to the cache.
- ``free(seq)``: commits what ``seq`` computed and drops its references.

and, for the engine: ``stats()``, ``cached_prefix_tokens(ids)`` (data-parallel routing),
``clear_cache()`` (after a failed step), ``num_free_pages``, ``check_invariants()``.

Two variants, chosen once by ``make_kv_manager``: ``KVCacheManager`` (prefix caching off: a plain
``PagePool``; nothing is ever found or published, the counters stay zero) and
``PrefixCachingKVCacheManager`` (a ``PrefixCachePool``). Callers never ask which one they have.

Page hashes and the adapter key: page i of a sequence is named by
``SHA-256(hash of page i - 1 | token ids of page i | engine keys + request keys)``
(``prefix_cache.page_hash``). The engine keys (``extra_keys`` here: model type, KV dtype, page
size) say what else decides a page's contents in this engine; the request keys
(``Sequence.extra_keys``) what decides them for one request: empty today, a LoRA adapter's id
when adapters come, so requests under different adapters never share a page while requests under
the same one do, with no other change here. A hit is also checked against the page's stored
token ids, parent hash and request keys, so a hash collision costs a miss, never a wrong page.

A sequence writes only at positions >= its ``num_computed``, never inside a shared full page.
"""

from __future__ import annotations

from typing import NamedTuple

from jaxinfer.engine.page_pool import PagePool
from jaxinfer.engine.prefix_cache import PrefixCachePool
from jaxinfer.engine.sequence import Sequence


class ComputedPages(NamedTuple):
    """A prefix-cache hit: ``pages`` (cached, full, in order) cover the first ``num_tokens``
    tokens (``len(pages) * Z``)."""

    pages: list[int]
    num_tokens: int


class KVCacheManager:
    """Pages of every sequence over a plain ``PagePool``: prefix caching off.

    Args:
        num_pages: P, pages in the pool (page 0, the null page, included).
        page_size: Z, tokens per page.

    Raises:
        ValueError: ``num_pages`` < 2 or ``page_size`` < 1.
    """

    def __init__(self, num_pages: int, page_size: int):
        if page_size < 1:
            raise ValueError(f"page_size={page_size}: must be >= 1")
        self.page_size = page_size
        self.pool: PagePool = PagePool(num_pages)

    @property
    def num_pages(self) -> int:
        """P, pages in the pool (the null page included: P - 1 can be handed out)."""
        return self.pool.num_pages

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take now (with caching: evictable cached pages included)."""
        return self.pool.num_free

    def get_computed_pages(self, seq: Sequence) -> ComputedPages:
        """The cached prefix ``seq`` can start from: none without caching."""
        return ComputedPages([], 0)

    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        computed: ComputedPages | None = None,
        num_reserved: int = 0,
    ) -> bool:
        """Gives ``seq`` the pages for its next ``num_new_tokens`` tokens.

        Args:
            seq: the sequence; its ``pages`` grow (and, at admission, ``num_computed``).
            num_new_tokens: tokens after ``num_computed`` (and after ``computed``'s) to hold.
            computed: at admission, ``get_computed_pages(seq)``: ``seq`` takes a reference to
                each of its pages and starts after them; the lookup is counted in ``stats``.
            num_reserved: pages that must stay free afterwards.

        Returns:
            False, changing nothing, if the pool has too few free pages; else True.

        Raises:
            ValueError: ``computed`` has pages but ``seq`` already holds pages or computed tokens.
        """
        hit = computed if computed is not None else ComputedPages([], 0)
        if hit.pages and (seq.pages or seq.num_computed):
            raise ValueError(
                f"request {seq.request_id!r}: cached pages go to a sequence with nothing computed"
            )
        need = max(
            0,
            -(-(seq.num_computed + hit.num_tokens + num_new_tokens) // self.page_size)
            - len(seq.pages)
            - len(hit.pages),
        )
        # Hit pages nobody holds are evictable, counted free until taken.
        taken = sum(1 for p in hit.pages if self.pool.refcounts[p] == 0)
        if need + num_reserved > self.num_free_pages - taken:
            return False
        if hit.pages:
            self.pool.acquire(hit.pages)
            seq.pages.extend(hit.pages)
        seq.pages.extend(self.pool.allocate(need))  # cannot raise after the check above
        if computed is not None:
            seq.num_computed += hit.num_tokens
            self._admitted(seq, hit)
        return True

    def _admitted(self, seq: Sequence, hit: ComputedPages) -> None:
        """Bookkeeping of an admission that took ``hit``."""
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = hit.num_tokens

    def commit_full_pages(self, seq: Sequence, num_computed: int) -> None:
        """Publishes ``seq``'s full pages among its first ``num_computed`` tokens to the cache:
        nothing without caching."""

    def free(self, seq: Sequence) -> None:
        """Drops ``seq``'s references to its pages (``seq.pages`` becomes empty)."""
        if seq.pages:
            self.pool.free(seq.pages)
        seq.pages = []

    def cached_prefix_tokens(self, prompt_ids: list[int], extra_keys: tuple = ()) -> int:
        """Tokens of ``prompt_ids`` the cache holds now for a request with ``extra_keys``:
        0 without caching."""
        return 0

    def clear_cache(self) -> None:
        """Forgets every cached page (after a failed step): nothing to forget without caching."""

    def stats(self) -> dict:
        """Prefix-cache counters (see ``PrefixCachePool.stats``): all zero without caching."""
        return {
            "queried_tokens": 0,
            "hit_tokens": 0,
            "hit_rate": 0.0,
            "evictions": 0,
            "cached_pages": 0,
        }

    def check_invariants(self) -> None:
        """Raises AssertionError if the pool's bookkeeping is inconsistent (tests)."""
        self.pool.check_invariants()


class PrefixCachingKVCacheManager(KVCacheManager):
    """Pages of every sequence over a ``PrefixCachePool``: automatic prefix caching.

    A sequence admitted with nothing computed (new, or preempted) first takes the cached pages
    of its longest known prefix in full pages, at most ``num_tokens - 1`` tokens so its last
    token is computed and sampled from (and none at positions whose prompt logprobs it wants:
    cached positions have no logits), and starts there. Every full page whose tokens are known is
    published as soon as a scheduled step covers it (so requests admitted in the same step
    already share it: each layer writes the step's K/V before any row attends), and when its
    sequence finishes or is preempted.

    Args:
        num_pages: P, pages in the pool (page 0, the null page, included).
        page_size: Z, tokens per page.
        extra_keys: the engine's keys, mixed into every page hash (see the module docstring).
    """

    pool: PrefixCachePool

    def __init__(self, num_pages: int, page_size: int, extra_keys: tuple = ()):
        super().__init__(num_pages, page_size)
        self.pool = PrefixCachePool(num_pages, page_size, extra_keys)

    def _page_hashes(self, seq: Sequence, num_pages: int) -> list[bytes]:
        """``seq.page_hashes`` extended to at least ``num_pages`` full pages of known tokens."""
        have = len(seq.page_hashes)
        if have < num_pages:
            z = self.page_size
            tokens = (seq.prompt_ids + seq.output_ids)[have * z : num_pages * z]
            parent = seq.page_hashes[-1] if have else None
            seq.page_hashes += self.pool.hash_pages(
                tokens, num_pages - have, parent, extra_keys=seq.extra_keys
            )
        return seq.page_hashes

    def get_computed_pages(self, seq: Sequence) -> ComputedPages:
        """The cached pages of ``seq``'s longest known prefix in full pages (at most
        ``num_tokens - 1`` tokens, and none from ``prompt_logprobs_from`` on); none for a
        sequence that holds pages or computed tokens. Takes no reference; marks the pages most
        recently used."""
        if seq.num_computed or seq.pages:
            return ComputedPages([], 0)
        max_tokens = min(seq.num_tokens - 1, seq.num_known)
        if seq.params.prompt_logprobs is not None:  # cached positions have no logits: read only
            max_tokens = min(max_tokens, seq.params.prompt_logprobs_from - 1)  # those not wanted
        max_pages = max_tokens // self.page_size
        pages, _ = self.pool.match_prefix(
            seq.prompt_ids + seq.output_ids,
            max_pages,
            self._page_hashes(seq, max_pages),
            seq.extra_keys,
        )
        self.pool.touch(pages)
        return ComputedPages(pages, len(pages) * self.page_size)

    def _admitted(self, seq: Sequence, hit: ComputedPages) -> None:
        seq.num_cached_pages = len(hit.pages)
        self.pool.record_lookup(seq.num_tokens, seq.num_computed)
        super()._admitted(seq, hit)

    def commit_full_pages(self, seq: Sequence, num_computed: int) -> None:
        """Publishes ``seq``'s full pages among its first ``num_computed`` tokens (computed, or
        written by a step already scheduled) whose token ids are known."""
        z = self.page_size
        limit = min(num_computed, seq.num_known, len(seq.pages) * z) // z
        start = seq.num_cached_pages
        if limit <= start:
            return
        hashes = self._page_hashes(seq, limit)
        known = seq.prompt_ids
        if limit * z > len(known):  # the list is built once, not once per page
            known = known + seq.output_ids
        for i in range(start, limit):
            self.pool.cache_page(
                seq.pages[i],
                hashes[i],
                hashes[i - 1] if i else None,
                known[i * z : (i + 1) * z],
                seq.extra_keys,
            )
        seq.num_cached_pages = limit

    def free(self, seq: Sequence) -> None:
        """Publishes what ``seq`` computed, then drops its references (its full pages stay
        cached, evictable once nobody holds them)."""
        self.commit_full_pages(seq, seq.num_computed)
        super().free(seq)
        seq.num_cached_pages = 0

    def cached_prefix_tokens(self, prompt_ids: list[int], extra_keys: tuple = ()) -> int:
        """Tokens of ``prompt_ids`` the cache holds now in full pages (at most
        ``len(prompt_ids) - 1``) for a request with ``extra_keys``; takes no references and
        changes no LRU order (data-parallel routing asks every replica)."""
        max_pages = (len(prompt_ids) - 1) // self.page_size
        pages, _ = self.pool.match_prefix(prompt_ids, max_pages, extra_keys=extra_keys)
        return len(pages) * self.page_size

    def clear_cache(self) -> None:
        """Forgets every cached page (after a failed step the pool's contents are not trusted):
        evictable pages become free, held pages stay held but unpublished."""
        self.pool.clear_cache()

    def stats(self) -> dict:
        """``PrefixCachePool.stats``: queried_tokens, hit_tokens, hit_rate, evictions,
        cached_pages."""
        return self.pool.stats()


def make_kv_manager(ecfg, extra_keys: tuple = ()) -> KVCacheManager:
    """The KV manager an engine config asks for: ``PrefixCachingKVCacheManager`` (with the
    engine's ``extra_keys``) if ``ecfg.enable_prefix_caching``, else ``KVCacheManager``, over
    ``ecfg.num_pages`` pages of ``ecfg.page_size`` tokens."""
    if ecfg.enable_prefix_caching:
        return PrefixCachingKVCacheManager(ecfg.num_pages, ecfg.page_size, extra_keys)
    return KVCacheManager(ecfg.num_pages, ecfg.page_size)
