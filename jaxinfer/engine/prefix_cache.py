"""Automatic prefix caching: full KV pages shared between requests by content (host side).

A full page (Z tokens) is named by a hash of its token ids chained with its parent page's hash
and its extra keys (the pool's engine-wide keys, then the request's own: see
``jaxinfer.engine.kv_manager``), so equal hashes mean equal prefixes up to and including the
page. ``PrefixCachePool`` keeps, beside the plain pool's free list, a map hash -> page and an LRU
queue of cached pages no sequence holds: a new or recomputed sequence takes references to the
pages of its longest cached prefix (``match_prefix`` + ``acquire``) and prefills from the first
uncached token; the pages of finished and preempted sequences stay cached and are evicted
least-recently-used only when ``allocate`` runs out of never-cached free pages.

Why hashed pages and not a radix tree (sglang's RadixAttention): sharing is per full page in
either (a page is the unit of the pool and of the block table), and a hash per page maps 1:1
onto the pool's refcounts, makes a lookup O(1) per page, and lets data-parallel routing
ask every replica how much of a prompt it holds with the same hashes. Source: vLLM's automatic
prefix caching (``BlockPool`` / ``KVCacheManager``: chained block hashes, refcounts, an LRU
free queue of cached blocks whose tail blocks are evicted first).

Hash collisions: hashes are SHA-256 (256 bits) and a hit is also checked against the page's
stored token ids, parent hash and request keys, so a collision can cost a miss but never a wrong
page.

Invariants (``check_invariants``): every page but the null page is exactly one of free,
evictable (cached, refcount 0) or held (refcount > 0); a cached page's hash maps back to it.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

from jaxinfer.engine.page_pool import OutOfPagesError, PagePool
from jaxinfer.models.kv_cache import NULL_PAGE

PageHash = bytes


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, np.int64).tobytes()


def page_hash(parent: PageHash | None, tokens: Sequence[int], extra_keys: tuple = ()) -> PageHash:
    """SHA-256 of a full page: its parent's hash (None for the first page), its token ids (as
    int64) and ``extra_keys`` (their ``repr``). 32 bytes."""
    h = hashlib.sha256()
    h.update(parent if parent is not None else b"root")
    h.update(_token_bytes(tokens))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


class PrefixCachePool(PagePool):
    """A ``PagePool`` whose freed full pages stay cached by content until evicted.

    Args:
        num_pages: P, pages in the pool (page 0 is the null page).
        page_size: Z, tokens per page.
        engine_keys: mixed into every page hash before a request's own ``extra_keys`` (what else
            decides a page's contents in this engine: model, KV dtype, page size).

    Counters (``stats``): tokens looked up and found at each admission, pages evicted.
    """

    def __init__(self, num_pages: int, page_size: int, engine_keys: tuple = ()):
        super().__init__(num_pages)
        self.page_size = page_size
        self.engine_keys = tuple(engine_keys)
        self._by_hash: dict[PageHash, int] = {}
        # page -> (its hash, its parent's hash, its token ids as int64 bytes, its request's extra
        # keys): checked on a hit
        self._page_key: dict[int, tuple[PageHash, PageHash | None, bytes, tuple]] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Pages ``allocate`` can hand out: never-cached free pages plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        return len(self._page_key)

    def allocate(self, n: int) -> list[int]:
        """``n`` pages (refcount 1): free pages first, then the least recently used evictable
        cached pages (dropped from the cache). Raises OutOfPagesError, allocating nothing."""
        if n > self.num_free:
            raise OutOfPagesError(f"asked for {n} pages, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                pages.append(self._free.pop())
            else:
                p, _ = self._evictable.popitem(last=False)
                self._uncache(p)
                self.num_evictions += 1
                pages.append(p)
        self.refcounts[pages] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        """Drops one reference from each page. A page reaching zero becomes evictable if cached
        (a sequence's last pages first in the LRU order, so they are evicted first), else free."""
        for p in reversed(pages):
            if p == NULL_PAGE or self.refcounts[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self.refcounts[p] -= 1
            if self.refcounts[p] == 0:
                if p in self._page_key:
                    self._evictable[p] = None
                else:
                    self._free.append(p)

    # ---------------------------------------------------------------- the cache

    def hash_pages(
        self,
        tokens: Sequence[int],
        num_pages: int,
        parent: PageHash | None = None,
        start_page: int = 0,
        extra_keys: tuple = (),
    ) -> list[PageHash]:
        """Hashes of full pages ``start_page .. num_pages - 1`` of ``tokens`` (the chain
        continues from ``parent``, the hash of page ``start_page - 1``) of a request with
        ``extra_keys``."""
        z, out, keys = self.page_size, [], self.engine_keys + tuple(extra_keys)
        for i in range(start_page, num_pages):
            parent = page_hash(parent, tokens[i * z : (i + 1) * z], keys)
            out.append(parent)
        return out

    def match_prefix(
        self,
        tokens: Sequence[int],
        max_pages: int,
        hashes: list[PageHash] | None = None,
        extra_keys: tuple = (),
    ) -> tuple[list[int], list[PageHash]]:
        """The cached pages of the longest prefix of ``tokens`` in full pages (at most
        ``max_pages``) for a request with ``extra_keys``, with their hashes (``hashes``: those
        of ``tokens``' pages, if known). Takes no references (see ``acquire``)."""
        z, pages, found = self.page_size, [], []
        parent, extra_keys = None, tuple(extra_keys)
        keys = self.engine_keys + extra_keys
        for i in range(max_pages):
            h = (
                hashes[i]
                if hashes is not None and i < len(hashes)
                else page_hash(parent, tokens[i * z : (i + 1) * z], keys)
            )
            p = self._by_hash.get(h)
            if p is None:
                break
            _, stored_parent, stored_tokens, stored_keys = self._page_key[p]
            if stored_keys != extra_keys:
                break  # a hash collision between requests' keys: a miss
            if stored_parent != parent or stored_tokens != _token_bytes(
                tokens[i * z : (i + 1) * z]
            ):
                break  # a hash collision: a miss, never a wrong page
            pages.append(p)
            found.append(h)
            parent = h
        return pages, found

    def acquire(self, pages: list[int]) -> None:
        """Takes a reference to each cached page of a prefix hit (out of the LRU queue)."""
        for p in pages:
            if self.refcounts[p] == 0:
                del self._evictable[p]
            self.refcounts[p] += 1

    def touch(self, pages: list[int]) -> None:
        """Marks the evictable ones of a prefix hit's ``pages`` most recently used, the first page
        most recent (the order ``acquire`` and then ``free`` would leave them in)."""
        for p in pages[::-1]:
            if p in self._evictable:
                self._evictable.move_to_end(p)

    def cache_page(
        self,
        page: int,
        h: PageHash,
        parent: PageHash | None,
        tokens: Sequence[int],
        extra_keys: tuple = (),
    ) -> None:
        """Registers a held, fully written (or being written by a dispatched step) page under
        hash ``h`` (its ``tokens`` and request ``extra_keys`` are kept to check hits). A hash
        already cached keeps its page (this one stays private); a page already cached keeps its
        first hash. Raises ValueError for a page nobody holds."""
        if h in self._by_hash or page in self._page_key:
            return
        if self.refcounts[page] <= 0:
            raise ValueError(f"page {page} is not held: only a held page can be cached")
        self._by_hash[h] = page
        self._page_key[page] = (h, parent, _token_bytes(tokens), tuple(extra_keys))

    def _uncache(self, page: int) -> None:
        h = self._page_key.pop(page)[0]
        del self._by_hash[h]

    def clear_cache(self) -> None:
        """Forgets every cached page (after a failed step the pool's contents are not trusted):
        evictable pages become free, held pages stay held but uncached."""
        self._by_hash.clear()
        self._page_key.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()

    def record_lookup(self, queried: int, hit: int) -> None:
        self.num_queried_tokens += queried
        self.num_hit_tokens += hit

    def stats(self) -> dict:
        """Prefix-cache counters: ``queried_tokens`` (tokens looked up at admissions),
        ``hit_tokens`` (of them found cached), ``hit_rate`` (hit / queried, 0.0 when none),
        ``evictions`` (cached pages reused for other contents), ``cached_pages`` (now)."""
        q = self.num_queried_tokens
        return {
            "queried_tokens": q,
            "hit_tokens": self.num_hit_tokens,
            "hit_rate": self.num_hit_tokens / q if q else 0.0,
            "evictions": self.num_evictions,
            "cached_pages": self.num_cached_pages,
        }

    def check_invariants(self) -> None:
        """Raises AssertionError if the pool's bookkeeping is inconsistent (tests)."""
        free, evictable = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a page is twice in the free list"
        assert len(evictable) == len(self._evictable)
        assert not free & evictable, "a page is both free and evictable"
        assert NULL_PAGE not in free | evictable, "the null page was freed"
        assert (self.refcounts >= 0).all(), "a negative refcount"
        held = {p for p in range(1, self.num_pages) if self.refcounts[p] > 0}
        assert not held & (free | evictable), "a held page is on a free list"
        assert len(held) + len(free) + len(evictable) == self.num_pages - 1, "a page leaked"
        assert evictable <= set(self._page_key), "an evictable page is not cached"
        assert not free & set(self._page_key), "a free page is still cached"
        for h, p in self._by_hash.items():
            assert self._page_key[p][0] == h, "hash map and page keys disagree"
        assert len(self._by_hash) == len(self._page_key)
