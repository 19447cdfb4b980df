"""The host scheduler and page pool alone, on a tiny pool (no model, no device).

The expectations are the README's and vLLM's rules written out by hand: the newest running
sequence is preempted when pages run out (its pages freed, back to the front of the waiting
queue, recomputed from scratch), decode rows come first, prefills are chunked to the token budget,
admission keeps one free page per running sequence in reserve, and pages are reference counted.
"""

from __future__ import annotations

import pytest

from jaxinfer.engine.kv_manager import KVCacheManager
from jaxinfer.engine.page_pool import OutOfPagesError, PagePool
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import SeqStatus, Sequence
from jaxinfer.sampling.sampler import SamplingParams

Z = 4  # tokens per page


def _seq(rid: str, prompt_len: int) -> Sequence:
    return Sequence(rid, list(range(3, 3 + prompt_len)), SamplingParams(temperature=0.0), seed=0)


def _sampled(sched, tok: int = 7) -> None:
    """What the engine does after a step: each row that reached its end got one new token."""
    for row in sched.rows:
        if row.seq.num_computed + row.num_new == row.seq.num_tokens:
            row.seq.num_computed += row.num_new
            row.seq.output_ids.append(tok)
        else:
            row.seq.num_computed += row.num_new


def test_newest_running_sequence_is_preempted():
    kv = KVCacheManager(1 + 6, Z)  # six usable pages
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = _seq("a", 4), _seq("b", 4), _seq("c", 4)
    for q in (a, b, c):
        s.add(q)
    first = s.schedule()  # three one-page prefills
    assert [r.seq for r in first.prefill] == [a, b, c] and not first.preempted
    _sampled(first)
    for _ in range(4):  # tokens 5..8: each sequence takes a second page at token 5
        out = s.schedule()
        assert [r.seq for r in out.decode] == [a, b, c] and not out.preempted
        _sampled(out)
    assert kv.num_free_pages == 0 and all(len(q.pages) == 2 for q in (a, b, c))
    out = s.schedule()  # token 9 needs a third page each: none is free
    assert out.preempted == [c]  # the newest, never the oldest
    assert [r.seq for r in out.decode] == [a, b]
    assert c.status is SeqStatus.WAITING and s.waiting[0] is c and s.running == [a, b]
    assert c.pages == [] and c.num_computed == 0 and c.num_preemptions == 1
    assert s.num_preemptions == 1
    assert sorted(a.pages + b.pages) == list(range(1, 7)) and kv.num_free_pages == 0


def test_a_sequence_that_is_newest_preempts_itself():
    """Sequences already scheduled in this step are never victims: the newest one that needs a
    page, with no one newer to preempt, preempts itself."""
    kv = KVCacheManager(1 + 5, Z)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = _seq("a", 6), _seq("b", 4)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [r.seq for r in out.prefill] == [a, b] and (len(a.pages), len(b.pages)) == (2, 1)
    _sampled(out)
    for _ in range(4):  # a reaches 10 tokens (3 pages), b 8 (2 pages): the pool is full
        _sampled(s.schedule())
    assert kv.num_free_pages == 0
    out = s.schedule()  # a's 11th token fits; b's 9th needs a page: b goes, a keeps running
    assert out.preempted == [b] and [r.seq for r in out.decode] == [a]
    assert s.waiting[0] is b and kv.num_free_pages == 2


def test_admission_keeps_a_page_per_running_sequence_and_prefill_is_chunked():
    kv = KVCacheManager(1 + 6, Z)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=6)
    seqs = [_seq(str(i), 4) for i in range(4)]
    for q in seqs:
        s.add(q)
    out = s.schedule()  # budget 6: one whole prompt, then a 2-token chunk of the next
    assert [(r.seq, r.num_new) for r in out.prefill] == [(seqs[0], 4), (seqs[1], 2)]
    _sampled(out)
    out = s.schedule()  # decode first, then the chunk's rest, then a new prompt's first token
    assert [(r.seq, r.num_new) for r in out.decode] == [(seqs[0], 1)]
    assert [(r.seq, r.num_new) for r in out.prefill] == [(seqs[1], 2), (seqs[2], 3)]
    assert sum(r.num_new for r in out.rows) == 6
    _sampled(out)
    # 3 running, 3 pages left: the fourth needs 1 page + 3 in reserve, so it is not admitted
    assert kv.num_free_pages == 3 - 1 and all(len(q.pages) for q in seqs[:3])
    out = s.schedule()
    assert seqs[3] not in [r.seq for r in out.rows] and seqs[3].status is SeqStatus.WAITING


def test_page_refcounts():
    pool = PagePool(4)
    assert pool.num_free == 3
    pages = pool.allocate(3)  # exactly all free pages
    assert sorted(pages) == [1, 2, 3] and pool.num_free == 0  # page 0 is never handed out
    with pytest.raises(OutOfPagesError):
        pool.allocate(1)
    pool.acquire([pages[0]])  # a second owner
    pool.free([pages[0]])
    assert pool.num_free == 0  # still held by the other owner
    pool.free([pages[0], pages[1]])
    assert pool.num_free == 2 and pool.refcounts[pages[0]] == 0
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([pages[1]])
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([0])
    assert pool.allocate(1) == [pages[1]]  # freed last, reused first
    with pytest.raises(OutOfPagesError):
        pool.allocate(2)
    assert pool.num_free == 1  # a failed allocation takes nothing
