"""Continuous-batching scheduler (host side): waiting queue, running set, token budget, chunked
prefill, page allocation and preemption by recomputation.

Each call to ``schedule`` picks the rows of the next step: every running sequence in decode gets
one token; unfinished prefills continue in chunks; waiting sequences join while the token budget,
the row limit and the free pages allow (keeping one free page per running sequence in reserve).
When a running sequence needs a page and none is free, the newest running sequence is preempted:
its pages are freed and it goes back to the front of the waiting queue, to be recomputed
(prompt + output so far) later. Sampling keys depend only on
(seed, output index), so a preempted sequence's output is the same as if it had never been.

Pages come from a ``KVCacheManager`` (``jaxinfer.engine.kv_manager``), the same calls with
prefix caching on or off: a sequence admitted with nothing computed starts after the cached pages
of its longest known prefix (``get_computed_pages``, none with caching off), and every scheduled
row publishes the pages it fills (``commit_full_pages``) so that requests admitted in the same
step already share them.

Source: vLLM's scheduler (recompute preemption, chunked prefill, token budget).
"""

from __future__ import annotations

import collections
import dataclasses

from jaxinfer.engine.kv_manager import KVCacheManager
from jaxinfer.engine.sequence import SeqStatus, Sequence

__all__ = ["ScheduleOutput", "ScheduledRow", "Scheduler"]


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
    """Host scheduler over a ``KVCacheManager``.

    Args:
        kv_manager: the pages of the pool (with or without prefix caching).
        max_num_seqs: most rows in one step.
        max_num_batched_tokens: token budget of one step (decode tokens count one each).
        max_prefill_seqs: most prefill rows in one step (bounds the prefill attention's width).
    """

    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_prefill_seqs: int = 8,
    ):
        self.kv_manager = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_seqs = max_prefill_seqs
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's pages and puts it at the front of the waiting queue, to be
        recomputed (prompt + output so far). A token it has in flight is still collected."""
        self.kv_manager.free(seq)
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
        self.kv_manager.free(seq)
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
            while not self.kv_manager.allocate(seq, n):
                victim = next(s for s in reversed(self.running) if id(s) not in scheduled)
                self.preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            scheduled.add(id(seq))
            (prefill if is_prefill else decode).append(ScheduledRow(seq, n))
            self.kv_manager.commit_full_pages(seq, seq.num_computed + n)
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
            hit = self.kv_manager.get_computed_pages(seq)
            remaining = seq.num_tokens - seq.num_computed - hit.num_tokens
            n = min(remaining, budget)
            # Admission keeps one free page per running sequence in reserve (each may need a new
            # page soon): admitting into a full pool only causes preemption churn. After a
            # preemption in this step nobody is admitted while others run.
            reserve = len(self.running)
            if (preempted and self.running) or not self.kv_manager.allocate(seq, n, hit, reserve):
                break
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.add(id(seq))
            (prefill if n > 1 else decode).append(ScheduledRow(seq, n))
            self.kv_manager.commit_full_pages(seq, seq.num_computed + n)
            budget -= n
        return ScheduleOutput(decode, prefill, preempted)
