"""Host-side page pool: the free list and reference counts of the KV pool's pages.

The device pool (``jaxinfer.models.kv_cache.KVCache``) holds P pages of Z tokens; this module only
counts who holds which page id. Page 0 (``NULL_PAGE``) is never handed out: padding tokens write
there and padded block-table entries point there. ``PrefixCachePool``
(``jaxinfer.engine.prefix_cache``) extends the pool with pages that stay cached by content after
their last holder lets go; ``jaxinfer.engine.kv_manager`` puts both behind one interface.
"""

from __future__ import annotations

import numpy as np

from jaxinfer.models.kv_cache import NULL_PAGE


class OutOfPagesError(RuntimeError):
    """The pool has fewer free pages than asked for."""


class PagePool:
    """Free list of pages with per-page reference counts.

    Reference counts let a page be shared (a prefix two sequences hold); a page returns to the
    free list when its count drops to zero. Page 0 is never handed out.

    Args:
        num_pages: P, pages in the pool (page 0 included).

    Raises:
        ValueError: ``num_pages`` < 2.
    """

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is reserved)")
        self.num_pages = num_pages
        self.refcounts = np.zeros(num_pages, np.int32)
        self.refcounts[NULL_PAGE] = 1
        # A stack: pages freed last are reused first (their contents are warm in cache).
        self._free = list(range(num_pages - 1, 0, -1))

    @property
    def num_free(self) -> int:
        """Pages ``allocate`` can hand out now."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Hands out ``n`` pages (refcount 1). Raises OutOfPagesError, allocating nothing, if
        fewer than ``n`` are free."""
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        self.refcounts[pages] = 1
        return pages

    def acquire(self, pages: list[int]) -> None:
        """Adds a reference to each of ``pages`` (a second owner of a shared prefix). Raises
        ValueError, changing nothing, for a page nobody holds."""
        for p in pages:
            if p == NULL_PAGE or self.refcounts[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
        self.refcounts[pages] += 1

    def free(self, pages: list[int]) -> None:
        """Drops one reference from each of ``pages``; pages reaching zero become free. Raises
        ValueError for a page nobody holds (the pages before it are freed)."""
        for p in pages:
            if p == NULL_PAGE or self.refcounts[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self.refcounts[p] -= 1
            if self.refcounts[p] == 0:
                self._free.append(p)

    def check_invariants(self) -> None:
        """Raises AssertionError if the pool's bookkeeping is inconsistent (tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is twice in the free list"
        assert NULL_PAGE not in free, "the null page was freed"
        assert (self.refcounts >= 0).all(), "a negative refcount"
        held = {p for p in range(1, self.num_pages) if self.refcounts[p] > 0}
        assert not held & free, "a held page is on the free list"
        assert len(held) + len(free) == self.num_pages - 1, "a page leaked"
