"""``SpeculativeStrategy``: speculative rounds in place of an engine core's plain step (host side).

``EngineCore.step`` with a strategy is one round: the scheduler admits and chunks prefills as
usual; the strategy (``run_round``) makes every decode row a verify row of 1 + r query tokens
(r <= R drafts, fewer near max_tokens/max_model_len, when the pool is short, or when the n-gram
lookup finds less), for which pages are allocated up front; the jitted round
(``round.spec_round``) drafts, verifies and accepts over the runner's params and pool
(``ModelRunner.run_with_pool``); ``num_computed`` advances by 1 + accepted only, which rolls back
the KV length of rejected positions (their pages stay allocated and are overwritten by the next
round). The core then appends each row's emitted tokens one by one with the usual stop checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np

from jaxinfer.engine.batch import MIN_DECODE_ROWS, MIN_PAGES_PER_SEQ, MIN_PREFILL_TOKENS, next_pow2
from jaxinfer.engine.core import EngineCore
from jaxinfer.engine.kv_manager import KVCacheManager
from jaxinfer.engine.runner import Capabilities, ModelRunner
from jaxinfer.engine.scheduler import ScheduledRow, ScheduleOutput
from jaxinfer.engine.sequence import Sequence
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.kv_cache import NULL_PAGE, init_kv_cache
from jaxinfer.models.paged_attention import AttentionMetadata
from jaxinfer.models.params import Params
from jaxinfer.outputs import RequestOutput, TokenLogprob
from jaxinfer.sampling.sampler import MAX_LOGPROBS, SamplingParams, SamplingTensors
from jaxinfer.speculative.config import SpecConfig
from jaxinfer.speculative.drafters import DraftHeads, ngram_propose
from jaxinfer.speculative.round import SpecBatch, jitted_spec_round

MIN_ROWS = MIN_DECODE_ROWS


def build_spec_batch(
    verify: list[tuple[Sequence, list[int], int]],
    prefill: list[ScheduledRow],
    page_size: int,
    max_pages_per_seq: int,
    num_spec: int,
) -> SpecBatch:
    """numpy ``SpecBatch`` of the verify rows ``(seq, host drafts, num drafts)`` and prefill rows.

    Every row sits in the multi-token ("prefill") region of the attention (``num_decode = 0``).
    T, B and M are padded to powers of two (floors ``MIN_ROWS * (1 + R)`` capped at
    ``MIN_PREFILL_TOKENS``, ``MIN_ROWS``, ``MIN_PAGES_PER_SEQ``; a lone row: ``1 + R`` and 1); the
    pages of every row must already be allocated.
    """
    r_max = num_spec
    spans = [(seq, seq.num_computed, 1 + r) for seq, _, r in verify]
    spans += [(row.seq, row.seq.num_computed, row.num_new) for row in prefill]
    t_live = sum(n for _, _, n in spans)
    max_pages = max(-(-(start + n) // page_size) for _, start, n in spans)
    # T floor: the engine's decode floor (MIN_DECODE_ROWS rows) of 1 + R tokens each, capped at
    # the prefill floor; a decode-only round at batch 1 with R = 2 pads 3 tokens to 16, not 32.
    # A lone row (batch-1 decode) keeps its own bucket, as the engine's Td=1 (batch.decode_bucket).
    rows_floor = 1 if len(spans) == 1 else MIN_ROWS
    t = next_pow2(t_live, min(MIN_PREFILL_TOKENS, next_pow2(rows_floor * (1 + r_max))))
    b = next_pow2(len(spans), rows_floor)
    m = min(next_pow2(max_pages, MIN_PAGES_PER_SEQ), next_pow2(max_pages_per_seq))
    tokens = np.zeros(t, np.int32)
    positions = np.zeros(t, np.int32)
    slots = np.full(t, NULL_PAGE * page_size, np.int32)
    seq_ids = np.full(t, -1, np.int32)
    block_tables = np.full((b, m), NULL_PAGE, np.int32)
    kv_lens = np.zeros(b, np.int32)
    q_lens = np.zeros(b, np.int32)
    logits_indices = np.zeros((b, r_max + 1), np.int32)
    drafts = np.zeros((b, r_max), np.int32)
    draft_index = np.full((b, r_max), t, np.int32)
    num_drafts = np.zeros(b, np.int32)
    last_pos = np.zeros(b, np.int32)
    min_left = np.zeros(b, np.int32)
    tok = 0
    for i, (seq, start, n) in enumerate(spans):
        pos = np.arange(start, start + n, dtype=np.int32)
        pages = np.asarray(seq.pages, np.int32)
        if i < len(verify):
            host_drafts, r = verify[i][1], verify[i][2]
            tokens[tok] = seq.token_at(start)
            tokens[tok + 1 : tok + 1 + len(host_drafts[:r])] = host_drafts[:r]
            drafts[i, : len(host_drafts[:r])] = host_drafts[:r]
            draft_index[i, :r] = tok + 1 + np.arange(r)
            num_drafts[i] = r
            last_pos[i] = start
            min_left[i] = seq.params.min_tokens - len(seq.output_ids)
        else:
            tokens[tok : tok + n] = [seq.token_at(k) for k in range(start, start + n)]
            min_left[i] = seq.params.min_tokens - len(seq.output_ids)
        positions[tok : tok + n] = pos
        slots[tok : tok + n] = pages[pos // page_size] * page_size + pos % page_size
        seq_ids[tok : tok + n] = i
        block_tables[i, : len(pages)] = pages[:m]
        kv_lens[i] = start + n
        q_lens[i] = n
        if i < len(verify):  # query j of a verify row scores draft j + 1 (clamped past r)
            logits_indices[i] = tok + np.minimum(np.arange(r_max + 1), n - 1)
        else:  # a prefill row samples (at most) one token, after its last query token
            logits_indices[i] = tok + n - 1
        tok += n
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    md = AttentionMetadata(
        positions=positions,
        slot_mapping=slots,
        block_tables=block_tables,
        kv_lens=kv_lens,
        cu_q_lens=cu_q_lens,
        seq_ids=seq_ids,
        num_decode=0,
    )
    return SpecBatch(
        tokens=tokens,
        md=md,
        logits_indices=logits_indices,
        drafts=drafts,
        draft_index=draft_index,
        num_drafts=num_drafts,
        last_pos=last_pos,
        min_tokens_left=min_left,
    )


@dataclasses.dataclass(eq=False)
class RoundRow:
    """One row's result of a round.

    Attributes:
        seq: the row's sequence (``num_computed`` already advanced past what was emitted).
        tokens: the tokens it emits, in order (1 + accepted drafts; one for a prefill row that
            reached its prompt's end).
        logprobs: each token's ``TokenLogprob`` when the request asks for logprobs, else None.
        drafted: drafts the row verified this round (0 for a prefill row).
    """

    seq: Sequence
    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    drafted: int = 0


class SpeculativeStrategy:
    """Speculative rounds over a runner's model (module docstring).

    Args:
        runner: the target model's ``ModelRunner`` (its params and pool run the verify pass).
        spec: the drafter and R.
        draft_cfg, draft_params: the draft model (method "draft-model"); its vocabulary must be
            the target's. Its paged KV cache uses the target's page ids (one KV manager, two pools).
        heads: the Medusa heads (method "heads").

    Raises:
        ValueError: a missing or mismatched drafter for ``spec.method``, or a sharded runner.
    """

    capabilities = Capabilities(
        prompt_logprobs=False,  # the round makes logits at the verify positions only
        async_scheduling=False,  # a round reads its tokens back before the next is planned
        batch_invariant=False,  # the verify pass runs the batched attention
        background_compiles=False,
        precompile=False,  # its steps are rounds ("spec_round" keys), not the plain step's
    )

    def __init__(
        self,
        runner: ModelRunner,
        spec: SpecConfig,
        draft_cfg: ModelConfig | None = None,
        draft_params: Params | None = None,
        heads: DraftHeads | None = None,
    ):
        if runner.mesh is not None:
            raise ValueError("speculative decoding does not support sharded engines yet")
        cfg = runner.cfg
        self.runner, self.spec = runner, spec
        self.draft_cfg, self.draft_params, self.draft_kv = None, None, None
        if spec.method == "draft-model":
            if draft_params is None or draft_cfg is None:
                raise ValueError("speculative='draft-model' needs a draft model (draft_model=...)")
            if draft_cfg.vocab_size != cfg.vocab_size:
                raise ValueError(
                    f"draft vocab_size={draft_cfg.vocab_size} != target {cfg.vocab_size}"
                )
            self.draft_cfg, self.draft_params = draft_cfg, draft_params
            self.draft_kv = self._new_draft_kv()
        elif spec.method == "heads":
            if heads is None:
                raise ValueError("speculative='heads' needs draft heads (draft_heads=PATH)")
            self.draft_params = heads
        self._round = jitted_spec_round()
        self._stats: dict[str, list[int]] = {}  # request id -> [rounds, drafted, accepted]
        self._pending: dict[str, list[int]] = {}  # heads: next round's drafts per request

    def _new_draft_kv(self):
        ecfg = self.runner.ecfg
        return init_kv_cache(
            self.draft_cfg,
            ecfg.num_pages,
            ecfg.page_size,
            self.draft_params.embed.dtype,
            self.runner.kv_page_major,
        )

    # ---------------------------------------------------------------- drafts on the host

    def _budget(self, seq: Sequence) -> int:
        """Drafts this row may take: R, fewer near max_tokens / max_model_len."""
        r = self.spec.num_speculative_tokens
        p = seq.params
        if p.max_tokens is not None:
            r = min(r, p.max_tokens - len(seq.output_ids) - 1)
        r = min(r, self.runner.ecfg.max_model_len - seq.num_tokens)
        return max(r, 0)

    def _host_drafts(self, seq: Sequence, r: int) -> list[int]:
        if self.spec.method == "ngram":
            toks = np.asarray(seq.prompt_ids + seq.output_ids, np.int32)
            return ngram_propose(toks, r, self.spec.ngram_max, self.spec.ngram_min)
        if self.spec.method == "heads":
            return self._pending.get(seq.request_id, [])[:r]
        return []

    # ---------------------------------------------------------------- the round

    def run_round(
        self,
        sched: ScheduleOutput,
        kv_manager: KVCacheManager,
        controls: Callable[[list, int], object],
    ) -> list[RoundRow]:
        """Drafts, verifies and accepts for ``sched``'s decode rows (and runs its prefill rows),
        waiting for the device; advances each row's ``num_computed``.

        Args:
            sched: the scheduled rows (pages of their scheduled tokens allocated).
            kv_manager: the engine's KV-cache manager (pages for the drafts' slots).
            controls: ``EngineCore``'s logits controls of (row, index) pairs padded to B rows.

        Returns:
            A ``RoundRow`` per row that emits tokens (decode rows, and prefill rows that reach
            their prompt's end), in row order.
        """
        ecfg, cfg = self.runner.ecfg, self.runner.cfg
        verify = []
        for row in sched.decode:
            seq = row.seq
            r = self._budget(seq)
            drafts: list[int] = []
            if r and self.spec.method != "draft-model":
                drafts = self._host_drafts(seq, r)
                r = len(drafts)
            if r and not kv_manager.allocate(seq, 1 + r):  # False: nothing allocated
                r, drafts = 0, []
            verify.append((seq, drafts, r))
        batch = build_spec_batch(
            verify,
            sched.prefill,
            ecfg.page_size,
            ecfg.max_pages_per_seq,
            self.spec.num_speculative_tokens,
        )
        b = batch.num_drafts.shape[0]
        seqs = [s for s, _, _ in verify] + [row.seq for row in sched.prefill]
        params_rows = [SamplingParams(temperature=0.0)] * b
        seeds, steps = [0] * b, [0] * b
        for i, seq in enumerate(seqs):
            params_rows[i], seeds[i], steps[i] = seq.params, seq.seed, len(seq.output_ids)
        st = SamplingTensors.from_params(params_rows, seeds, steps, pad_to=b)
        ctl = controls([(ScheduledRow(seq, 0), i) for i, seq in enumerate(seqs)], b)
        want_lp = any(seq.params.logprobs is not None for seq in seqs)
        num_lp = min(MAX_LOGPROBS, cfg.vocab_size) if want_lp else 0
        key = (batch.tokens.shape[0], b, batch.md.block_tables.shape[1])
        self.runner.compile_keys.add(("spec_round", key, ctl is not None, num_lp))

        def round_fn(params, kv):
            kv, self.draft_kv, out = self._round(
                params,
                kv,
                self.draft_params,
                self.draft_kv,
                batch,
                st,
                ctl,
                cfg=cfg,
                dcfg=self.draft_cfg,
                method=self.spec.method,
                num_spec=self.spec.num_speculative_tokens,
                attn_impl=ecfg.attn_impl,
                num_logprobs=num_lp,
            )
            return kv, out

        out = self.runner.run_with_pool(round_fn)
        tokens, n_acc = np.asarray(out.tokens), np.asarray(out.num_accepted)
        lps = np.asarray(out.logprobs)
        top_ids, top_lps = (
            (np.asarray(out.top_ids), np.asarray(out.top_logprobs)) if num_lp else (None, None)
        )
        next_drafts = np.asarray(out.next_drafts)
        rows = []
        for i, seq in enumerate(seqs):
            r = 0
            if i < len(verify):
                r = verify[i][2]
                n_emit = int(n_acc[i]) + 1
                seq.num_computed += (
                    n_emit  # the last token + accepted drafts; rejected: rolled back
                )
                st_i = self._stats.setdefault(seq.request_id, [0, 0, 0])
                st_i[0] += 1
                st_i[1] += r
                st_i[2] += int(n_acc[i])
            else:
                seq.num_computed += sched.prefill[i - len(verify)].num_new
                if seq.num_computed < seq.num_tokens:
                    continue  # a prefill chunk that does not reach the end: nothing sampled
                n_emit = 1
            if self.spec.method == "heads":
                self._pending[seq.request_id] = [int(x) for x in next_drafts[i]]
            k = seq.params.logprobs
            logprobs = [
                None
                if k is None
                else TokenLogprob(
                    int(tokens[i, j]),
                    float(lps[i, j]),
                    [
                        (int(a), float(x))
                        for a, x in zip(top_ids[i, j, :k], top_lps[i, j, :k], strict=False)
                    ],
                )
                for j in range(n_emit)
            ]
            rows.append(RoundRow(seq, [int(t) for t in tokens[i, :n_emit]], logprobs, r))
        return rows

    def reset_after_failure(self) -> None:
        """After a failed round: a fresh draft pool when the failed call consumed it; the heads'
        drafts of the dropped round are forgotten."""
        leaves = jax.tree_util.tree_leaves(self.draft_kv)
        if any(getattr(x, "is_deleted", lambda: False)() for x in leaves):
            self.draft_kv = self._new_draft_kv()
        self._pending.clear()

    def fill_metrics(self, out: RequestOutput) -> None:
        """Puts the request's round statistics in ``out.metrics`` (rounds, acceptance rate, mean
        accepted tokens a round)."""
        s = self._stats.get(out.request_id)
        if s is None or s[0] == 0:
            return
        m = out.metrics
        m.spec_rounds = s[0]
        m.acceptance_rate = s[2] / s[1] if s[1] else 0.0
        m.mean_accepted_tokens = s[2] / s[0]

    def forget(self, request_id: str) -> None:
        """Drops a finished request's statistics and pending drafts."""
        self._stats.pop(request_id, None)
        self._pending.pop(request_id, None)


def make_spec_engine(
    engine: EngineCore,
    method: str,
    num_speculative_tokens: int,
    draft_model: str | None,
    draft_heads: str | None,
) -> EngineCore:
    """An ``EngineCore`` over a fresh runner of ``engine``'s model and sizes (its own KV pool)
    whose steps are speculative rounds (``LLM(speculative=...)``); ``engine`` is left as it was.

    Raises:
        ValueError: bad method or R, a missing drafter path, a sharded engine, a draft that does
            not fit the target.
    """
    from jaxinfer.speculative.drafters import load_draft_model, load_heads

    if engine.mesh is not None:
        raise ValueError("speculative decoding does not support sharded engines yet")
    spec = SpecConfig(method, num_speculative_tokens)
    kw = {}
    if method == "draft-model":
        if draft_model is None:
            raise ValueError(
                "speculative='draft-model' needs draft_model (a path, 'self' or 'layers:N')"
            )
        kw["draft_cfg"], kw["draft_params"] = load_draft_model(
            draft_model, engine.cfg, engine.params, engine.params.embed.dtype
        )
    elif method == "heads":
        if draft_heads is None:
            raise ValueError(
                "speculative='heads' needs draft_heads (a directory from train-draft-heads)"
            )
        kw["heads"] = load_heads(draft_heads, engine.cfg)
    runner = ModelRunner(engine.cfg, engine.params, engine.ecfg)
    strategy = SpeculativeStrategy(runner, spec, **kw)
    return EngineCore(runner, engine.tokenizer, speculative=strategy)
