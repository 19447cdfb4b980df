"""Continuous-batching scheduler (host side): waiting queue, running set, token budget, chunked
prefill, page allocation and preemption by recomputation.

Each call to ``schedule`` picks the rows of the next step: every running sequence in decode gets
one token; unfinished prefills continue in chunks; waiting sequences join while the token budget,
the row limit and the free pages allow (keeping one free page per running sequence in reserve).
When a running sequence needs a page and none is free, the newest running sequence is preempted:
its pages are freed and it goes back to the front of the waiting queue, to be recomputed
(prompt + output so far) later. Sampling keys depend only on
(seed, output index), so a preempted sequence's output is the same as if it had never been.

With a ``PrefixCachingAllocator`` (``jaxinfer.engine.prefix_cache``), a sequence admitted with
nothing
computed (new, or preempted) first takes the cached pages of its longest known prefix in full
pages, at most ``num_tokens - 1`` tokens so its last token is computed and sampled from, and
starts there; every full page whose tokens are known is cached as soon as a scheduled step
covers it (so requests admitted in the same step already share it: each layer writes the step's
K/V before any row attends), and when its sequence finishes or is preempted. A sequence writes
only at positions >= its ``num_computed``, never inside a shared full page.

Source: vLLM's scheduler (recompute preemption, chunked prefill, token budget).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import time

from jaxinfer.engine.prefix_cache import PrefixCachingAllocator
from jaxinfer.models.kv_cache import OutOfPagesError, PageAllocator
from jaxinfer.sampling.sampler import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request's state. ``all_ids = prompt_ids + output_ids + pending``; ``num_computed`` of
    them have their K/V in the cache (or are being written by a step in flight).

    ``pending``: placeholders of tokens sampled by a dispatched step whose result the host has not
    read yet (async scheduling, ``Engine``): ``-(r + 1)`` stands for row ``r`` of that step's
    sampled tokens, which the next step reads on device. ``pending_final``: the pending token is
    this sequence's last (it reaches ``max_tokens`` or ``max_model_len``), so it is not scheduled
    again."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    logprobs: list = dataclasses.field(default_factory=list)
    pending: list[int] = dataclasses.field(default_factory=list)
    pending_final: bool = False
    # Prefix caching: hashes of the full pages of the known tokens (computed lazily, kept across
    # preemption: the known tokens only grow), and how many of ``pages`` were offered to the cache.
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_cached_pages: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at the first admission

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + len(self.pending)

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host knows (prompt + collected output; not ``pending``)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        n, o = len(self.prompt_ids), len(self.output_ids)
        if i < n:
            return self.prompt_ids[i]
        return self.output_ids[i - n] if i < n + o else self.pending[i - n - o]


@dataclasses.dataclass
class ScheduledRow:
    seq: Sequence
    num_new: int  # query tokens of this row in the step (1 for decode)


@dataclasses.dataclass
class ScheduleOutput:
    decode: list[ScheduledRow]
    prefill: list[ScheduledRow]
    preempted: list[Sequence]

    @property
    def rows(self) -> list[ScheduledRow]:
        return self.decode + self.prefill

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new for r in self.rows)


class Scheduler:
    """Host scheduler over a ``PageAllocator``.

    Args:
        allocator: the page pool's allocator.
        page_size: Z, tokens per page.
        max_num_seqs: most rows in one step.
        max_num_batched_tokens: token budget of one step (decode tokens count one each).
        max_prefill_seqs: most prefill rows in one step (bounds the prefill attention's width).
    """

    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_prefill_seqs: int = 8,
    ):
        self.allocator = allocator
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_seqs = max_prefill_seqs
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.cache = allocator if isinstance(allocator, PrefixCachingAllocator) else None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        need = -(-num_tokens // self.page_size)
        return max(0, need - len(seq.pages))

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Gives ``seq`` pages for ``num_tokens`` tokens; False (nothing allocated) if short."""
        n = self._pages_needed(seq, num_tokens)
        if n == 0:
            return True
        try:
            seq.pages.extend(self.allocator.allocate(n))
        except OutOfPagesError:
            return False
        return True

    def _block_hashes(self, seq: Sequence, num_pages: int) -> list[bytes]:
        """``seq.block_hashes`` extended to at least ``num_pages`` full pages of known tokens."""
        have = len(seq.block_hashes)
        if have < num_pages:
            z = self.page_size
            tokens = (seq.prompt_ids + seq.output_ids)[have * z : num_pages * z]
            parent = seq.block_hashes[-1] if have else None
            seq.block_hashes += self.cache.hash_pages(tokens, num_pages - have, parent)
        return seq.block_hashes

    def cache_full_pages(self, seq: Sequence, num_computed: int) -> None:
        """Caches ``seq``'s full pages among its first ``num_computed`` tokens (computed, or
        written by a step already scheduled) whose token ids are known."""
        if self.cache is None:
            return
        z = self.page_size
        limit = min(num_computed, seq.num_known, len(seq.pages) * z) // z
        start = seq.num_cached_pages
        if limit <= start:
            return
        hashes = self._block_hashes(seq, limit)
        known = seq.prompt_ids
        if limit * z > len(known):  # the list is built once, not once per page
            known = known + seq.output_ids
        for i in range(start, limit):
            self.cache.cache_page(
                seq.pages[i], hashes[i], hashes[i - 1] if i else None, known[i * z : (i + 1) * z]
            )
        seq.num_cached_pages = limit

    def _take_cached_prefix(self, seq: Sequence) -> None:
        """Gives a sequence with nothing computed the cached pages of its longest known prefix
        (at most ``num_tokens - 1`` tokens) and starts it after them."""
        if self.cache is None or seq.num_computed or seq.pages:
            return
        max_tokens = min(seq.num_tokens - 1, seq.num_known)
        if seq.params.prompt_logprobs is not None:  # cached positions have no logits: read only
            max_tokens = min(max_tokens, seq.params.prompt_logprobs_from - 1)  # those not wanted
        max_pages = max_tokens // self.page_size
        pages, _ = self.cache.match_prefix(
            seq.prompt_ids + seq.output_ids, max_pages, self._block_hashes(seq, max_pages)
        )
        self.cache.acquire(pages)
        seq.pages, seq.num_cached_pages = pages, len(pages)
        seq.num_computed = len(pages) * self.page_size

    def _drop_pages(self, seq: Sequence) -> None:
        """Caches what ``seq`` computed, then frees its pages."""
        self.cache_full_pages(seq, seq.num_computed)
        if seq.pages:
            self.allocator.free(seq.pages)
        seq.pages, seq.num_cached_pages = [], 0

    def preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's pages and puts it at the front of the waiting queue, to be
        recomputed (prompt + output so far). A token it has in flight is still collected."""
        self._drop_pages(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(seq)
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Marks ``seq`` finished and frees its pages at once. A step still in flight may write
        into them; the device runs steps in order, so a later owner's writes come after."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.pending.clear()
        self._drop_pages(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:  # preempted while its last token was in flight
            self.waiting.remove(seq)

    def schedule(self, only: Sequence | None = None) -> ScheduleOutput:
        """Chooses the rows of the next step (decode rows first). With ``only``, the step holds
        that sequence alone (running, or admitted from wherever it waits): the engine isolates a
        request this way after a failed step."""
        budget = self.max_num_batched_tokens
        decode, prefill, preempted = [], [], []
        scheduled: set[int] = set()
        for seq in list(self.running):  # oldest first
            if seq.status is not SeqStatus.RUNNING or seq.pending_final:
                continue  # preempted earlier in this loop, or its last token is in flight
            if only is not None and seq is not only:
                continue
            remaining = seq.num_tokens - seq.num_computed
            is_prefill = remaining > 1
            if budget <= 0 or (is_prefill and len(prefill) >= self.max_prefill_seqs):
                continue
            n = min(remaining, budget)
            while not self._grow(seq, seq.num_computed + n):
                victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            scheduled.add(id(seq))
            (prefill if is_prefill else decode).append(ScheduledRow(seq, n))
            self.cache_full_pages(seq, seq.num_computed + n)
            budget -= n
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and len(prefill) < self.max_prefill_seqs
        ):
            seq = self.waiting[0] if only is None else only
            if only is not None and (only.status is not SeqStatus.WAITING or id(only) in scheduled):
                break
            fresh = seq.num_computed == 0
            self._take_cached_prefix(seq)
            remaining = seq.num_tokens - seq.num_computed
            n = min(remaining, budget)
            # Admission keeps one free page per running sequence in reserve (each may need a new
            # page soon): admitting into a full pool only causes preemption churn.
            reserve = len(self.running)
            if (
                (
                    preempted
                    or self._pages_needed(seq, seq.num_computed + n) + reserve
                    > self.allocator.num_free
                )
                and self.running
            ) or not self._grow(seq, seq.num_computed + n):
                if fresh and seq.pages:  # give the prefix hit back: admit nobody for now
                    self.allocator.free(seq.pages)
                    seq.pages, seq.num_cached_pages, seq.num_computed = [], 0, 0
                break
            if fresh and self.cache is not None:
                self.cache.record_lookup(seq.num_tokens, seq.num_computed)
                if seq.num_cached_tokens is None:
                    seq.num_cached_tokens = seq.num_computed
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.add(id(seq))
            (prefill if n > 1 else decode).append(ScheduledRow(seq, n))
            self.cache_full_pages(seq, seq.num_computed + n)
            budget -= n
        return ScheduleOutput(decode, prefill, preempted)
