"""Host-side construction of a step's device inputs from the scheduler's rows (numpy only).

Shapes are padded to power-of-two buckets: decode rows Td, prefill tokens Tp, prefill rows Bp and
block-table width M. The bucket tuple is the compilation key, so the number of compilations is at
most the product of the bucket counts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxinfer.engine.scheduler import ScheduleOutput
from jaxinfer.engine.step import StepBatch
from jaxinfer.models.kv_cache import NULL_PAGE
from jaxinfer.models.paged_attention import AttentionMetadata
from jaxinfer.sampling.sampler import SamplingParams, SamplingTensors


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum); 0 stays 0."""
    if n <= 0:
        return 0
    return max(minimum, 1 << (n - 1).bit_length())


def bucket_sizes(maximum: int, minimum: int = 1) -> list[int]:
    """All bucket values up to ``next_pow2(maximum)``, 0 included."""
    out, b = [0], minimum
    while b < next_pow2(maximum, minimum):
        out.append(b)
        b *= 2
    out.append(next_pow2(maximum, minimum))
    return out


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Padding buckets of a step. ``key`` is its compilation key."""

    decode_rows: int  # Td
    prefill_tokens: int  # Tp
    prefill_rows: int  # Bp
    pages_per_seq: int  # M

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.decode_rows, self.prefill_tokens, self.prefill_rows, self.pages_per_seq)


# Bucket floors: tiny buckets save little padding but each costs a compilation.
MIN_DECODE_ROWS = 4  # above one row: a lone decode row (batch-1 decode) gets its own bucket
MIN_PREFILL_TOKENS = 32
MIN_PAGES_PER_SEQ = 4


def decode_bucket(num_decode: int) -> int:
    """Td for ``num_decode`` decode rows: 0, 1, or a power of two >= ``MIN_DECODE_ROWS``.

    Batch-1 decode is bandwidth-bound and latency-critical: padding it to 4 rows costs about
    twice the time per token on CPU, so it keeps a bucket of its own."""
    return 1 if num_decode == 1 else next_pow2(num_decode, MIN_DECODE_ROWS)


def step_buckets(
    num_decode: int,
    num_prefill_tokens: int,
    num_prefill_rows: int,
    max_pages: int,
    max_pages_per_seq: int,
) -> Buckets:
    """The buckets of a step of ``num_decode`` decode rows and ``num_prefill_rows`` prefill rows
    of ``num_prefill_tokens`` tokens in all, whose longest row spans ``max_pages`` pages."""
    return Buckets(
        decode_rows=decode_bucket(num_decode),
        prefill_tokens=next_pow2(num_prefill_tokens, MIN_PREFILL_TOKENS),
        prefill_rows=next_pow2(num_prefill_rows),
        pages_per_seq=min(next_pow2(max_pages, MIN_PAGES_PER_SEQ), next_pow2(max_pages_per_seq)),
    )


def _one_up(value: int, decode_rows: bool) -> int:
    """The next bucket of a dimension: decode rows go 1 -> 4 (``batch.decode_bucket``'s floor),
    every other value doubles; 0 (an absent region) stays 0."""
    return 0 if value == 0 else 4 if (decode_rows and value == 1) else 2 * value


def holds_within_one_bucket(need: tuple, key: tuple) -> bool:
    """Whether bucket tuple ``key`` holds a step of exact buckets ``need`` and is at most one
    bucket larger in every dimension (an absent region, 0, stays absent)."""
    return all(n <= k <= _one_up(n, d == 0) for d, (n, k) in enumerate(zip(need, key, strict=True)))


def exact_buckets(sched: ScheduleOutput, page_size: int, max_pages_per_seq: int) -> Buckets:
    """The smallest buckets holding the scheduled rows (``step_buckets``)."""
    pf = sched.prefill
    return step_buckets(
        len(sched.decode),
        sum(r.num_new for r in pf),
        len(pf),
        max(-(-(r.seq.num_computed + r.num_new) // page_size) for r in sched.rows),
        max_pages_per_seq,
    )


def build_step_batch(
    sched: ScheduleOutput, page_size: int, max_pages_per_seq: int, buckets: Buckets | None = None
) -> tuple[StepBatch, Buckets]:
    """numpy StepBatch of the scheduled rows (each row's pages must already be allocated),
    padded to ``buckets`` (default: ``exact_buckets``; larger ones pad further).

    Raises:
        ValueError: ``buckets`` is smaller than the rows need in some dimension.
    """
    nd = len(sched.decode)
    need = exact_buckets(sched, page_size, max_pages_per_seq)
    bk = need if buckets is None else buckets
    if not all(n <= b and (n == 0) == (b == 0) for n, b in zip(need.key, bk.key, strict=True)):
        raise ValueError(f"buckets {bk.key} cannot hold a step that needs {need.key}")
    td, tp, bp, m = bk.key
    t, b = td + tp, td + bp
    # Sampled rows are padded to a power of two so sampling compiles once per size.
    tokens = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    slots = np.full(t, NULL_PAGE * page_size, np.int32)
    seq_ids = np.full(t, -1, np.int32)
    block_tables = np.full((b, m), NULL_PAGE, np.int32)
    kv_lens = np.zeros(b, np.int32)
    q_lens = np.zeros(b, np.int32)
    q_lens[:td] = 1
    logits_indices = np.zeros(next_pow2(b), np.int32)
    tok = 0
    for i, row in enumerate(sched.rows):
        r = row_index(i, nd, td)
        if i == nd:
            tok = td
        seq, n = row.seq, row.num_new
        start = seq.num_computed
        pos = np.arange(start, start + n, dtype=np.int32)
        pages = np.asarray(seq.pages, np.int32)
        tokens[tok : tok + n] = [seq.token_at(j) for j in range(start, start + n)]
        positions[tok : tok + n] = pos
        slots[tok : tok + n] = pages[pos // page_size] * page_size + pos % page_size
        seq_ids[tok : tok + n] = r
        block_tables[r, : len(pages)] = pages
        kv_lens[r] = start + n
        q_lens[r] = n
        logits_indices[r] = tok + n - 1
        tok += n
    seq_ids[:td] = np.arange(td, dtype=np.int32)  # decode padding rows own their padding token
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    md = AttentionMetadata(
        positions=positions,
        slot_mapping=slots,
        block_tables=block_tables,
        kv_lens=kv_lens,
        cu_q_lens=cu_q_lens,
        seq_ids=seq_ids,
        num_decode=td,
    )
    return StepBatch(tokens=tokens, md=md, logits_indices=logits_indices), bk


def sample_rows(td: int, bp: int) -> int:
    """B', the sampled rows of a step with Td decode and Bp prefill rows (``logits_indices``)."""
    return next_pow2(td + bp)


def dummy_step_batch(key: tuple[int, int, int, int], page_size: int) -> StepBatch:
    """A numpy StepBatch of bucket ``key`` = (Td, Tp, Bp, M) holding only padding, laid out as
    ``build_step_batch`` pads: tokens i32[Td + Tp] all writing into the null page (slot mapping
    ``NULL_PAGE * page_size``), block tables i32[Td + Bp, M] all the null page, kv_lens 0 (decode
    padding rows one query token each), logits_indices i32[next_pow2(Td + Bp)]."""
    td, tp, bp, m = key
    t, b = td + tp, td + bp
    seq_ids = np.full(t, -1, np.int32)
    seq_ids[:td] = np.arange(td, dtype=np.int32)
    q_lens = np.zeros(b, np.int32)
    q_lens[:td] = 1
    md = AttentionMetadata(
        positions=np.zeros(t, np.int32),
        slot_mapping=np.full(t, NULL_PAGE * page_size, np.int32),
        block_tables=np.full((b, m), NULL_PAGE, np.int32),
        kv_lens=np.zeros(b, np.int32),
        cu_q_lens=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        seq_ids=seq_ids,
        num_decode=td,
    )
    return StepBatch(
        tokens=np.zeros(t, np.int32), md=md, logits_indices=np.zeros(sample_rows(td, bp), np.int32)
    )


def sampling_tensors(rows, b: int) -> SamplingTensors:
    """The sampling tensors of a step's rows ((``ScheduledRow``, padded row index) pairs), B' =
    ``b`` rows, padding rows greedy. A row's step index is the output index of the token it
    samples, its pending tokens (async scheduling) counted: its key is (seed, that index)."""
    params_rows = [SamplingParams(temperature=0.0)] * b
    seeds, steps = [0] * b, [0] * b
    for row, r in rows:
        params_rows[r] = row.seq.params
        seeds[r] = row.seq.seed
        steps[r] = len(row.seq.output_ids) + len(row.seq.pending)  # index of the token sampled
    return SamplingTensors.from_params(params_rows, seeds, steps, pad_to=b)


def row_index(i: int, num_decode_live: int, td: int) -> int:
    """Row of the i-th scheduled row in the padded batch (decode rows, then prefill rows)."""
    return i if i < num_decode_live else td + (i - num_decode_live)
