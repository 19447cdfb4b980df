"""Mutation check: plants small realistic bugs in core code, one at a time, and runs only the
tests meant to catch each; prints which bugs survive (issue 16). Too slow for CI: run it by hand
before closing work on a feature, and add a mutation for every new feature (prefix caching, the
server, ...).

Each ``Mutation`` is (name, file, exact old text, new text, test files, optional ``-k``). The
working tree is snapshotted once (without .git, .venv, results; others may go on editing it), and
every old text must occur exactly once in its file there (the script fails loudly at start when
the code has moved). For each mutation a copy of the snapshot gets the old text replaced, and
``python -m pytest -x -q`` runs the mutation's tests there with ``PYTHONPATH`` set to the copy and
``JAXINFER_SHARED`` to the shared models. Exit status 1 (a test failed) counts as caught, 0 as
survived; anything else (collection error, no test selected, timeout) is reported as an error,
never as caught.

Usage::

    python scripts/mutation_check.py              # every mutation, one at a time
    python scripts/mutation_check.py --list       # names, files and tests; checks the old texts
    python scripts/mutation_check.py --only kv_scale_63 --only preempt_oldest
    python scripts/mutation_check.py --jobs 2 --baseline   # 2 at once; unmutated runs first

One JSON summary (tried, caught, survived with names, per-mutation seconds) goes to stdout and is
appended to ``results/mutation_check.jsonl`` (``--results-dir``); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("JAXINFER_SHARED", REPO.parent / "shared"))
COPY_IGNORE = shutil.ignore_patterns(
    ".git",
    ".venv",
    "venv",
    "results",
    ".cache",
    "__pycache__",
    ".hypothesis",
    ".pytest_cache",
    ".ruff_cache",
    "*.egg-info",
    "out*.jsonl",
    "build",
    "dist",
)


@dataclasses.dataclass(frozen=True)
class Mutation:
    """One planted bug: ``old`` (exactly once in ``file``) becomes ``new``; ``tests`` (paths from
    the repository root) with ``-k k`` must fail."""

    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    k: str | None = None


M = Mutation
OUT_REF = "tests/test_outside_references.py"
LME, LME_MODEL = "tests/test_lm_eval.py", "jaxinfer/eval/lm_eval_model.py"
PCP = "tests/test_prefix_cache_paths.py"
PS = "tests/test_parallel_sampling.py"
PC = "tests/test_prefix_cache.py"
EA = "tests/test_engine_args.py"
CTO = "tests/test_chat_template_option.py"
LOOP = "tests/test_engine_loop.py"
KV = "tests/test_kv_manager.py"
SO = "tests/test_structured_outputs.py"
SOR = "tests/test_structured_reasoning.py"
GPT_OSS_MOE = "tests/test_gpt_oss_moe.py"
GMM = "tests/test_grouped_matmul.py"
EXPERT_SHARDING = "jaxinfer/models/expert_sharding.py"
MOE_PARALLEL = "tests/test_moe_parallel.py"
MUTATIONS: list[Mutation] = [
    # ---- quantization scales
    M(
        "kv_scale_63",
        "jaxinfer/quant/kv.py",
        "s = jnp.max(jnp.abs(xf), axis=-1) / 127.0",
        "s = jnp.max(jnp.abs(xf), axis=-1) / 63.0",
        ("tests/test_quant.py",),
        "kv",
    ),
    M(
        "weight_scale_63",
        "jaxinfer/quant/tensor.py",
        "scales = jnp.max(jnp.abs(wt), axis=red) / 127.0",
        "scales = jnp.max(jnp.abs(wt), axis=red) / 63.0",
        ("tests/test_quant.py",),
        "scales",
    ),
    M(
        "activation_scale_63",
        "jaxinfer/quant/matmul.py",
        "sx = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / 127.0",
        "sx = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / 63.0",
        ("tests/test_quant.py",),
        "activation_bound or integer_dot_bound",
    ),
    # ---- KV writes
    M(
        "int8_v_scales_from_k",
        "jaxinfer/models/kv_cache.py",
        "v_scales=cache.v_scales.at[at].set(vs)",
        "v_scales=cache.v_scales.at[at].set(ks)",
        ("tests/test_quant.py",),
        "kv_scales",
    ),
    M(
        "float_v_written_from_k",
        "jaxinfer/models/kv_cache.py",
        "v_pages=cache.v_pages.at[at].set(v.astype(cache.v_pages.dtype))",
        "v_pages=cache.v_pages.at[at].set(k.astype(cache.v_pages.dtype))",
        ("tests/test_quant.py",),
        "kv_float",
    ),
    # ---- scheduler, pages
    M(
        "preempt_oldest",
        "jaxinfer/engine/scheduler.py",
        "victim = next(s for s in reversed(self.running) if id(s) not in scheduled)",
        "victim = next(s for s in self.running if id(s) not in scheduled)",
        ("tests/test_scheduler.py",),
    ),
    M(
        "admission_without_reserve",
        "jaxinfer/engine/scheduler.py",
        "reserve = len(self.running)",
        "reserve = 0",
        ("tests/test_scheduler.py",),
    ),
    M(
        "admitted_prefill_ignores_budget",
        "jaxinfer/engine/scheduler.py",
        "            n = min(remaining, budget)\n            # Admission",
        "            n = remaining\n            # Admission",
        ("tests/test_scheduler.py",),
    ),
    M(
        "free_drops_every_reference",
        "jaxinfer/engine/page_pool.py",
        "self.refcounts[p] -= 1",
        "self.refcounts[p] = 0",
        ("tests/test_scheduler.py",),
    ),
    M(
        "allocate_off_by_one",
        "jaxinfer/engine/page_pool.py",
        "if n > len(self._free):",
        "if n >= len(self._free):",
        ("tests/test_scheduler.py",),
    ),
    # ---- attention, RoPE, norms, logits
    M(
        "window_off_by_one",
        "jaxinfer/models/attention.py",
        "q_pos - kv_pos < window)",
        "q_pos - kv_pos <= window)",
        ("tests/test_paged_attention.py",),
        "paged_equals_dense",
    ),
    M(
        "dense_flash_scale_dropped",
        "jaxinfer/models/dense.py",
        "sm_scale=cfg.attn_scale,",
        "sm_scale=cfg.head_dim**-0.5,",
        ("tests/test_dense_flash.py",),
        "gemma2_f32",
    ),
    M(
        "dense_flash_not_causal",
        "jaxinfer/models/dense.py",
        "causal=True,",
        "causal=False,",
        ("tests/test_dense_flash.py",),
        "gemma2_f32",
    ),
    M(
        "dense_flash_window_dropped",
        "jaxinfer/models/dense.py",
        "sliding_window=window or None,",
        "sliding_window=None,",
        ("tests/test_dense_flash.py",),
        "packed",
    ),
    M(
        "dense_flash_windows_swapped",
        "jaxinfer/models/dense.py",
        "[functools.partial(kernel, w) for w in windows]",
        "[functools.partial(kernel, w) for w in windows[::-1]]",
        ("tests/test_dense_flash.py",),
        "gemma2_f32",
    ),
    M(
        "dense_flash_segments_dropped",
        "jaxinfer/models/dense.py",
        "segment_ids=ids,",
        "segment_ids=None,",
        ("tests/test_dense_flash.py",),
        "packed",
    ),
    M(
        "dense_packed_runs_merged",
        "jaxinfer/models/dense.py",
        "runs = jnp.cumsum(start.reshape(-1), dtype=jnp.int32).reshape(b, s)",
        "runs = jnp.zeros((b, s), jnp.int32)",
        ("tests/test_dense_flash.py",),
        "packed",
    ),
    M(
        "decode_chunk_offset_in_pages",
        "jaxinfer/models/paged_attention.py",
        "chunks[rows, cks], cks * (chunk * z), lens,",
        "chunks[rows, cks], cks * chunk, lens,",
        ("tests/test_paged_attention.py",),
        "walk_pages_in_chunks",
    ),
    M(
        "rope_sign",
        "jaxinfer/models/forward.py",
        "x2 * c + x1 * s",
        "x2 * c - x1 * s",
        ("tests/test_greedy_reference.py",),
        "tok512.bin",
    ),
    M(
        "local_rope_global_theta",
        "jaxinfer/models/forward.py",
        "inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_local_theta, None)",
        "inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)",
        ("tests/test_hf_parity.py",),
        "logits_f32 and gemma3",
    ),
    M(
        "k_norm_uses_q_norm",
        "jaxinfer/models/forward.py",
        "k = rms_norm(k, lp.k_norm, eps, off)",
        "k = rms_norm(k, lp.q_norm, eps, off)",
        ("tests/test_hf_parity.py",),
        "logits_f32 and qwen3",
    ),
    M(
        "gemma_norm_offset_dropped",
        "jaxinfer/models/forward.py",
        "return (xf * (offset + w.astype(jnp.float32))).astype(x.dtype)",
        "return (xf * w.astype(jnp.float32)).astype(x.dtype)",
        ("tests/test_hf_parity.py",),
        "logits_f32 and gemma2",
    ),
    M(
        "final_softcap_unscaled",
        "jaxinfer/models/forward.py",
        "logits = jnp.tanh(logits / cap) * cap",
        "logits = jnp.tanh(logits) * cap",
        ("tests/test_hf_parity.py",),
        "logits_f32 and gemma2",
    ),
    # ---- sampling
    M(
        "top_k_keeps_one_more",
        "jaxinfer/sampling/sampler.py",
        "return jnp.sum((keys >= t[:, None]).astype(jnp.float32), axis=-1) >= k",
        "return jnp.sum((keys >= t[:, None]).astype(jnp.float32), axis=-1) > k",
        ("tests/test_sampling.py",),
        "filter_support",
    ),
    M(
        "top_p_strict",
        "jaxinfer/sampling/sampler.py",
        "return jnp.sum(jnp.where(keys >= t[:, None], ps, 0.0), axis=-1) >= st.top_p",
        "return jnp.sum(jnp.where(keys >= t[:, None], ps, 0.0), axis=-1) > st.top_p",
        ("tests/test_sampling.py",),
        "filter_support",
    ),
    M(
        "min_p_absolute",
        "jaxinfer/sampling/sampler.py",
        "return jnp.where(probs < st.min_p[:, None] * p_max, neg_inf, x)",
        "return jnp.where(probs < st.min_p[:, None], neg_inf, x)",
        ("tests/test_sampling.py",),
        "filter_support",
    ),
    M(
        "min_p_drops_boundary",
        "jaxinfer/sampling/sampler.py",
        "return jnp.where(probs < st.min_p[:, None] * p_max, neg_inf, x)",
        "return jnp.where(probs <= st.min_p[:, None] * p_max, neg_inf, x)",
        ("tests/test_sampling.py",),
        "filter_support",
    ),
    M(
        "seed_step_ignores_pending",
        "jaxinfer/engine/batch.py",
        "steps[r] = len(row.seq.output_ids) + len(row.seq.pending)",
        "steps[r] = len(row.seq.output_ids)",
        ("tests/test_async_scheduling.py",),
        "equal_sync",
    ),
    # ---- penalties, min_tokens, stop strings, logprobs
    M(
        "repetition_ignores_prompt",
        "jaxinfer/sampling/sampler.py",
        "rep = jnp.where(prompt_mask | in_output,",
        "rep = jnp.where(in_output,",
        ("tests/test_sampling.py",),
        "penalties",
    ),
    M(
        "repetition_inverted",
        "jaxinfer/sampling/sampler.py",
        "logits = jnp.where(logits > 0, logits / rep, logits * rep)",
        "logits = jnp.where(logits > 0, logits * rep, logits / rep)",
        ("tests/test_sampling.py",),
        "penalties or repetition",
    ),
    M(
        "presence_scaled_by_count",
        "jaxinfer/sampling/sampler.py",
        "logits = logits - st.presence_penalty[:, None] * in_output.astype(jnp.float32)",
        "logits = logits - st.presence_penalty[:, None] * output_counts.astype(jnp.float32)",
        ("tests/test_sampling.py",),
        "penalties",
    ),
    M(
        "penalties_count_prompt",
        "jaxinfer/engine/step_controls.py",
        "np.add.at(counts[r], np.asarray(seq.output_ids, np.int64), 1)",
        "np.add.at(counts[r], np.asarray(seq.prompt_ids + seq.output_ids, np.int64), 1)",
        (OUT_REF,),
        "logprobs or controls",
    ),
    M(
        "min_tokens_ban_ends_early",
        "jaxinfer/engine/step_controls.py",
        "        if len(seq.output_ids) + len(seq.pending) < seq.params.min_tokens:",
        "        if len(seq.output_ids) + len(seq.pending) < seq.params.min_tokens - 1:",
        (OUT_REF,),
        "min_tokens",
    ),
    M(
        "min_tokens_ignores_pending",
        "jaxinfer/engine/step_controls.py",
        "        if len(seq.output_ids) + len(seq.pending) < seq.params.min_tokens:",
        "        if len(seq.output_ids) < seq.params.min_tokens:",
        (OUT_REF,),
        "controls",
    ),
    M(
        "eos_not_banned",
        "jaxinfer/engine/step_controls.py",
        "            if not seq.params.ignore_eos:\n                stops += list(stop_ids)",
        "            if seq.params.ignore_eos:\n                stops += list(stop_ids)",
        (OUT_REF,),
        "min_tokens",
    ),
    M(
        "spec_min_tokens_ends_early",
        "jaxinfer/speculative/strategy.py",
        "            last_pos[i] = start\n"
        "            min_left[i] = seq.params.min_tokens - len(seq.output_ids)",
        "            last_pos[i] = start\n"
        "            min_left[i] = seq.params.min_tokens - len(seq.output_ids) - 1",
        (OUT_REF,),
        "min_tokens_boundary and ngram",
    ),
    M(
        "stop_string_after_min_tokens",
        "jaxinfer/engine/request_output.py",
        "if p.stop and len(seq.output_ids) >= p.min_tokens:",
        "if p.stop and len(seq.output_ids) > p.min_tokens:",
        (OUT_REF,),
        "stop_string",
    ),
    M(
        "stream_ignores_stop_buffer",
        "jaxinfer/engine/request_output.py",
        "max(req.emitted, len(req.text) - held)",
        "max(req.emitted, len(req.text))",
        ("tests/test_engine.py",),
        "streaming",
    ),
    M(
        "logprobs_from_penalised",
        "jaxinfer/engine/step.py",
        "logprob_logits=raw_logits,",
        "logprob_logits=logits,",
        (OUT_REF,),
        "logprobs",
    ),
    # ---- the all-greedy sampling variant (issue 21)
    M(
        "greedy_tie_highest_id",
        "jaxinfer/sampling/sampler.py",
        "return jnp.min(jnp.where(hit, ids, x.shape[-1]), axis=-1)",
        "return jnp.max(jnp.where(hit, ids, -1), axis=-1)",
        ("tests/test_sample_variants.py",),
    ),
    M(
        "greedy_variant_if_any_row_greedy",
        "jaxinfer/sampling/sampler.py",
        "and all(p.greedy for p in params):",
        "and any(p.greedy for p in params):",
        ("tests/test_engine.py",),
        "reference_alone_and_in_batch",
    ),
    M(
        "greedy_variant_ignores_controls",
        "jaxinfer/sampling/sampler.py",
        "if not controls and num_logprobs == 0 and all(",
        "if num_logprobs == 0 and all(",
        ("tests/test_engine.py",),
        "streaming_stop_strings",
    ),
    M(
        "greedy_variant_never_run",
        "jaxinfer/engine/runner.py",
        "greedy=flags[:3] == GREEDY_FLAGS,",
        "greedy=False,",
        ("tests/test_bucket_reuse.py",),
        "tail",
    ),
    M(
        "spec_logprobs_from_penalised",
        "jaxinfer/speculative/round.py",
        "lp = jax.nn.log_softmax(logits, axis=-1)",
        "lp = jax.nn.log_softmax(pen, axis=-1)",
        (OUT_REF,),
        "logprobs and ngram",
    ),
    # ---- speculative decoding
    M(
        "accept_ratio_inverted",
        "jaxinfer/speculative/rejection.py",
        "accept = (u * q_d < p_d) | accept_always",
        "accept = (u * p_d < q_d) | accept_always",
        ("tests/test_speculative.py",),
        "rejection_sampling_matches",
    ),
    M(
        "bonus_from_residual",
        "jaxinfer/speculative/rejection.py",
        "use_p = (n >= num_drafts) | (jnp.sum(resid, axis=-1) <= 0)",
        "use_p = jnp.sum(resid, axis=-1) <= 0",
        ("tests/test_speculative.py",),
        "bonus",
    ),
    M(
        "bonus_from_previous_position",
        "jaxinfer/speculative/rejection.py",
        "p_n = p[rows, n]",
        "p_n = p[rows, jnp.minimum(n, r - 1)]",
        ("tests/test_speculative.py",),
        "bonus",
    ),
    M(
        "greedy_accept_not_a_prefix",
        "jaxinfer/speculative/rejection.py",
        "n_greedy = jnp.sum(jnp.cumprod(valid & (drafts == greedy_tok[:, :r]), axis=1), axis=1)",
        "n_greedy = jnp.sum(valid & (drafts == greedy_tok[:, :r]), axis=1)",
        ("tests/test_speculative.py",),
        "greedy_rows",
    ),
    # ---- detokenizer, resume, recovery
    M(
        "detok_no_utf8_hold_back",
        "jaxinfer/tokenizers/detokenizer.py",
        "        end = len(text) - held\n",
        "        end = len(text)\n",
        ("tests/test_detokenizer_stream.py", "tests/test_tokenizer.py"),
        "incremental or stream",
    ),
    M(
        "detok_no_prompt_context",
        "jaxinfer/tokenizers/detokenizer.py",
        "self._window = [int(i) for i in prompt_ids if not self._drops(i)][-_KEEP:]",
        "self._window = []",
        ("tests/test_detokenizer_stream.py", "tests/test_tokenizer.py"),
        "incremental or stream",
    ),
    M(
        "resume_rewrites_error_records",
        "jaxinfer/cli/prompts_file.py",
        "        if job.id in done_ids:\n",
        "        if job.id in done_ids and job.error is None:\n",
        ("tests/test_cli_inputs.py",),
        "collide",
    ),
    M(
        "resume_keeps_partial_line",
        "jaxinfer/cli/output_file.py",
        "os.ftruncate(self.fd, start)",
        "os.ftruncate(self.fd, start + len(raw))",
        ("tests/test_cli_outputs.py",),
        "resume",
    ),
    M(
        "recover_keeps_consumed_pool",
        "jaxinfer/engine/core.py",
        "        self.runner.reset_after_failure()\n",
        "",
        ("tests/test_step_recovery.py",),
        "consumed_the_pool",
    ),
    M(
        "recover_keeps_pending_tokens",
        "jaxinfer/engine/core.py",
        "            seq.pending.clear()\n            seq.pending_final = False",
        "            seq.pending_final = False",
        ("tests/test_recovery_in_flight.py",),
    ),
    M(
        "abandoned_stream_not_aborted",
        "jaxinfer/engine/loop.py",
        "            running.engine.abort_request(eid)",
        "            pass",
        ("tests/test_step_recovery.py",),
        "abandoned",
    ),
    # Parallel sampling (SamplingParams.n, jaxinfer.engine.parallel_sampling).
    M(
        "n_child_seed_not_offset",
        "jaxinfer/engine/parallel_sampling.py",
        "            seed += i\n",
        "            seed += 0\n",
        (PS,),
        "seed_plus",
    ),
    M(
        "n_last_child_dropped",
        "jaxinfer/engine/parallel_sampling.py",
        "self.running = set(range(n))",
        "self.running = set(range(n - 1))",
        (PS,),
        "greedy_n3 or seed_plus",
    ),
    M(
        "n_final_index_order",
        "jaxinfer/engine/parallel_sampling.py",
        "for i, o in enumerate(self.latest):",
        "for i, o in enumerate(reversed(self.latest)):",
        (PS,),
        "seed_plus",
    ),
    M(
        "n_streamed_index_0",
        "jaxinfer/engine/parallel_sampling.py",
        "outputs=[_completion(index, out)]",
        "outputs=[_completion(0, out)]",
        (PS,),
        "streaming",
    ),
    M(
        "n_last_child_stream_dropped",
        "jaxinfer/engine/parallel_sampling.py",
        "[streamed, self._final()]",
        "[self._final()]",
        (PS,),
        "streaming",
    ),
    M(
        "n_siblings_not_aborted",
        "jaxinfer/engine/parallel_sampling.py",
        "abort, self.running = sorted(self.running), set()",
        "abort, self.running = [], set()",
        (PS,),
        "failed_completion",
    ),
    M(
        "n_completion_tokens_not_summed",
        "jaxinfer/engine/parallel_sampling.py",
        "completion_tokens=sum(m.completion_tokens for m in parts)",
        "completion_tokens=parts[0].completion_tokens",
        (PS,),
        "seed_plus",
    ),
    M(
        "n_close_aborts_one_child",
        "jaxinfer/engine/loop.py",
        "        for eid in running.engine_ids:\n",
        "        for eid in running.engine_ids[:1]:\n",
        (PS,),
        "closing",
    ),
    M(
        "n_child_ids_not_checked",
        "jaxinfer/engine/loop.py",
        "taken = [e for e in eids + [rid] if",
        "taken = [e for e in [rid] if",
        (PS,),
        "colliding",
    ),
    M(
        "n_record_flat",
        "jaxinfer/outputs.py",
        "if len(self.outputs) > 1:",
        "if len(self.outputs) > 2:",
        (PS,),
        "cli_records",
    ),
    M(
        "n_cached_tokens_summed",
        "jaxinfer/engine/parallel_sampling.py",
        "num_cached_tokens=min(m.num_cached_tokens for m in parts)",
        "num_cached_tokens=sum(m.num_cached_tokens for m in parts)",
        (PS,),
        "parent_output",
    ),
    M(
        "n_record_drops_logprobs",
        "jaxinfer/outputs.py",
        '            "stop_reason": self.stop_reason,\n        }\n'
        "        if self.logprobs is not None:",
        '            "stop_reason": self.stop_reason,\n        }\n        if False:',
        (PS,),
        "parent_output",
    ),
    M(
        "n_resume_children_share_a_seed",
        "jaxinfer/cli/partial.py",
        "states = [ResumeState(next(flat)) for _ in req.children]",
        "states = [ResumeState(next(flat))] * req.n",
        (PS,),
        "cli_records",
    ),
    M(
        "n_partial_keeps_finished_last_token",
        "jaxinfer/cli/partial.py",
        "toks, lps = toks[:-1], None if lps is None else lps[:-1]",
        "pass",
        (PS,),
        "cli_records",
    ),
    # Prefix caching (jaxinfer.engine.prefix_cache, the scheduler's use of it).
    M(
        "pc_no_token_check_on_hit",
        "jaxinfer/engine/prefix_cache.py",
        "if stored_parent != parent or stored_tokens != _token_bytes(",
        "if False and _token_bytes(",
        (PC,),
        "collision",
    ),
    M(
        "pc_evicted_page_stays_cached",
        "jaxinfer/engine/prefix_cache.py",
        "                self._uncache(p)\n",
        "",
        (PC,),
        "host_pool",
    ),
    M(
        "pc_head_pages_evicted_first",
        "jaxinfer/engine/prefix_cache.py",
        "for p in reversed(pages):",
        "for p in pages:",
        (PC,),
        "host_pool_shares",
    ),
    M(
        "pc_last_token_not_computed",
        "jaxinfer/engine/kv_manager.py",
        "max_tokens = min(seq.num_tokens - 1, seq.num_known)",
        "max_tokens = seq.num_known",
        (PC,),
        "host_pool or logprobs",
    ),
    M(
        "pc_pending_tokens_cached",
        "jaxinfer/engine/kv_manager.py",
        "limit = min(num_computed, seq.num_known, len(seq.pages) * z) // z",
        "limit = min(num_computed, len(seq.pages) * z) // z",
        (PC,),
        "host_pool or shared or tiny",
    ),
    M(
        "pc_not_cached_at_admission",
        "jaxinfer/engine/scheduler.py",
        "            (prefill if n > 1 else decode).append(ScheduledRow(seq, n))\n"
        "            self.kv_manager.commit_full_pages(seq, seq.num_computed + n)",
        "            (prefill if n > 1 else decode).append(ScheduledRow(seq, n))",
        (PC,),
        "n_samples or shared",
    ),
    # Prefix caching on every engine path and data-parallel routing (test_prefix_cache_paths).
    M(
        "pc_recover_keeps_cache",
        "jaxinfer/engine/core.py",
        "self.kv_manager.clear_cache()  # pages",
        "pass  # pages",
        (PCP,),
        "failed_step",
    ),
    M(
        "pc_acquire_leaves_page_evictable",
        "jaxinfer/engine/prefix_cache.py",
        "            if self.refcounts[p] == 0:\n                del self._evictable[p]\n",
        "",
        (PCP,),
        "preemption or page_major",
    ),
    M(
        "pc_cached_before_written",
        "jaxinfer/engine/scheduler.py",
        "            (prefill if is_prefill else decode).append(ScheduledRow(seq, n))\n"
        "            self.kv_manager.commit_full_pages(seq, seq.num_computed + n)",
        "            (prefill if is_prefill else decode).append(ScheduledRow(seq, n))\n"
        "            self.kv_manager.commit_full_pages(seq, seq.num_tokens)",
        (PCP,),
        "abort",
    ),
    M(
        "pc_last_token_page_cached",
        "jaxinfer/engine/kv_manager.py",
        "        self.commit_full_pages(seq, seq.num_computed)\n",
        "        self.commit_full_pages(seq, seq.num_computed + 1)\n",
        (PCP,),
        "page_major",
    ),
    # The KV manager's interface alone (tests/test_kv_manager.py).
    M(
        "kv_reserve_ignored",
        "jaxinfer/engine/kv_manager.py",
        "if need + num_reserved > self.num_free_pages - taken:",
        "if need > self.num_free_pages - taken:",
        (KV,),
        "formula",
    ),
    M(
        "kv_hit_pages_counted_free",
        "jaxinfer/engine/kv_manager.py",
        "taken = sum(1 for p in hit.pages if self.pool.refcounts[p] == 0)",
        "taken = 0",
        (KV,),
        "nobody_holds",
    ),
    M(
        "kv_hit_not_a_use",
        "jaxinfer/engine/kv_manager.py",
        "        self.pool.touch(pages)\n",
        "",
        (KV,),
        "refused",
    ),
    M(
        "kv_routing_lookup_is_a_use",
        "jaxinfer/engine/kv_manager.py",
        "pages, _ = self.pool.match_prefix(prompt_ids, max_pages, extra_keys=extra_keys)\n",
        "pages, _ = self.pool.match_prefix(prompt_ids, max_pages, extra_keys=extra_keys)\n"
        "        self.pool.touch(pages)\n",
        (KV,),
        "refused",
    ),
    M(
        "kv_request_keys_not_hashed",
        "jaxinfer/engine/kv_manager.py",
        "tokens, num_pages - have, parent, extra_keys=seq.extra_keys",
        "tokens, num_pages - have, parent",
        (KV,),
        "request_keys",
    ),
    M(
        "pc_spec_rejected_slot_cached",
        "jaxinfer/engine/core.py",
        "                    break\n        return results\n\n    def _recover",
        "                    break\n"
        "        for row in rows:  # old num_computed + 1 + drafted\n"
        "            if row.drafted and row.seq.finish_reason is None:\n"
        "                n = row.seq.num_computed - len(row.tokens) + 1 + row.drafted\n"
        "                self.kv_manager.commit_full_pages(row.seq, n)\n"
        "        return results\n\n    def _recover",
        (PCP,),
        "speculative",
    ),
    M(
        "dp_route_ignores_cache",
        "jaxinfer/engine/loop.py",
        "return order[hits.index(best)] if best > 0 else home",
        "return home",
        (PCP,),
        "parallel",
    ),
    M(
        "dp_seed_follows_route",
        "jaxinfer/engine/loop.py",
        "                crs = ResumeState(home.draw_seed(csp))",
        "                pass",
        (PCP,),
        "parallel",
    ),
    # ---- prompt logprobs and scoring (issue 20)
    M(
        "plp_slot_off_by_one",
        "jaxinfer/engine/prompt_logprobs.py",
        "int(logits_indices[r]) - row.num_new + 1",
        "int(logits_indices[r]) - row.num_new",
        ("tests/test_prompt_logprobs.py",),
        "equal_transformers",
    ),
    M(
        "plp_chunk_last_dropped",
        "jaxinfer/engine/prompt_logprobs.py",
        "min(start + row.num_new, len(seq.prompt_ids) - 1)",
        "min(start + row.num_new - 1, len(seq.prompt_ids) - 1)",
        ("tests/test_prompt_logprobs.py",),
        "equal_transformers",
    ),
    M(
        "plp_reads_prefix_cache",
        "jaxinfer/engine/kv_manager.py",
        "max_tokens = min(max_tokens, seq.params.prompt_logprobs_from - 1)",
        "max_tokens = max_tokens",
        ("tests/test_prompt_logprobs.py",),
        "equal_transformers",
    ),
    M(
        "plp_recompute_duplicates",
        "jaxinfer/engine/prompt_logprobs.py",
        "if lst is None or i < len(lst):",
        "if lst is None:",
        ("tests/test_prompt_logprobs.py",),
        "preempted",
    ),
    M(
        "plp_tile_targets_shifted",
        "jaxinfer/engine/prompt_logprobs.py",
        "tg = jnp.pad(targets, (0, pad)).reshape(-1, tile)",
        "tg = jnp.pad(targets, (pad, 0)).reshape(-1, tile)",
        ("tests/test_prompt_logprobs.py",),
        "tiles",
    ),
    M(
        "score_greedy_inverted",
        "jaxinfer/scoring.py",
        "all(e.top[0][0] == e.token_id for e in entries)",
        "not all(e.top[0][0] == e.token_id for e in entries)",
        ("tests/test_scoring.py",),
        "score_equals",
    ),
    M(
        "score_context_position_off_by_one",
        "jaxinfer/scoring.py",
        "entries = out.prompt_logprobs[len(ctx) :]",
        "entries = out.prompt_logprobs[len(ctx) - 1 :][: len(cont)]",
        ("tests/test_scoring.py",),
        "score_equals",
    ),
    M(
        "rolling_stride_overlap",
        "jaxinfer/scoring.py",
        "ctx = tokens[max(0, end - max_seq_len - 1) : end - 1]",
        "ctx = tokens[max(0, end - max_seq_len) : end - 1]",
        ("tests/test_scoring.py",),
        "rolling",
    ),
    M(
        "encode_pair_spaces_kept",
        "jaxinfer/scoring.py",
        "    if n_spaces > 0:\n        continuation",
        "    if n_spaces < 0:\n        continuation",
        ("tests/test_scoring.py",),
        "lm_eval or spaces",
    ),
    # ---- the lm-eval model and the notebook (issue 20)
    M(
        "lm_eval_greedy_inverted",
        LME_MODEL,
        "out.append((r.logprob, bool(r.is_greedy)))",
        "out.append((r.logprob, not bool(r.is_greedy)))",
        (LME,),
        "multiple_choice",
    ),
    M(
        "lm_eval_loglikelihood_reordered",
        LME_MODEL,
        "for i, r in enumerate(self.llm.score(pairs)):",
        "for i, r in enumerate(self.llm.score(sorted(pairs, key=lambda p: len(p[0]) + len(p[1])))):",  # noqa: E501
        (LME,),
        "multiple_choice",
    ),
    M(
        "lm_eval_rolling_drops_last_window",
        "jaxinfer/scoring.py",
        "    while done < len(tokens):",
        "    while done + stride < len(tokens):",
        (LME,),
        "rolling",
    ),
    M(
        "lm_eval_rolling_without_bos",
        LME_MODEL,
        "docs = [self.tok_encode(req.args[0]) for req in requests]",
        "docs = [self.tok_encode(req.args[0], add_special_tokens=False) for req in requests]",
        (LME,),
        "rolling",
    ),
    M(
        "lm_eval_until_ignored",
        LME_MODEL,
        "return SamplingParams(max_tokens=max_gen_toks, stop=[s for s in until if s], **kw), until",
        "return SamplingParams(max_tokens=max_gen_toks, **kw), []",
        (LME,),
        "generate_until",
    ),
    M(
        "lm_eval_generate_samples",
        LME_MODEL,
        'kw["temperature"] = float(kw.get("temperature", 0.0))',
        'kw["temperature"] = float(kw.get("temperature", 1.0)) or 1.0',
        (LME,),
        "generate_until",
    ),
    M(
        "notebook_score_context_off_by_one",
        "jaxinfer/scoring.py",
        "entries = out.prompt_logprobs[len(ctx) :]",
        "entries = out.prompt_logprobs[len(ctx) - 1 : -1] if len(ctx) > 1 else "
        "out.prompt_logprobs[len(ctx) :]",
        ("tests/test_notebook.py",),
    ),
    M(
        "score_context_not_from_cache",
        "jaxinfer/scoring.py",
        "prompt_logprobs_from=len(c)",
        "prompt_logprobs_from=1",
        ("tests/test_scoring.py",),
        "sharing",
    ),
    # Issue 21: async scheduling reads the step in flight before dispatching a new shape.
    M(
        "collect_first_keeps_finished_rows",
        "jaxinfer/engine/core.py",
        "decode=[r for r in sched.decode if r.seq.status is not SeqStatus.FINISHED]",
        "decode=list(sched.decode)",
        ("tests/test_async_scheduling.py",),
        "collect_first",
    ),
    M(
        "new_shape_dispatched_before_collect",
        "jaxinfer/engine/core.py",
        "if nxt.forward_key not in self.compile_keys:",
        "if False:",
        ("tests/test_async_scheduling.py",),
        "first_token",
    ),
    M(
        "always_collect_before_dispatch",
        "jaxinfer/engine/core.py",
        "if nxt.forward_key not in self.compile_keys:",
        "if True:",
        ("tests/test_async_scheduling.py",),
        "first_token",
    ),
    # Issue 21: a step of an uncompiled shape runs padded to a compiled one one bucket up.
    M(
        "reuse_two_buckets_up",
        "jaxinfer/engine/batch.py",
        "else 2 * value",
        "else 4 * value",
        ("tests/test_bucket_reuse.py",),
        "hand_worked",
    ),
    M(
        "reuse_ignores_sampling_variant",
        "jaxinfer/compile/buckets.py",
        'sample_missing = ("sample", next_pow2(td + bp), *sample_flags) not in compiled',
        "sample_missing = False",
        ("tests/test_bucket_reuse.py",),
        "hand_worked or flags",
    ),
    M(
        "reuse_never",
        "jaxinfer/compile/buckets.py",
        "chosen = choose_buckets(need, usable, flags)",
        "chosen = need",
        ("tests/test_bucket_reuse.py",),
        "tail",
    ),
    M(
        "batch_ignores_chosen_buckets",
        "jaxinfer/engine/batch.py",
        "bk = need if buckets is None else buckets",
        "bk = need",
        ("tests/test_bucket_reuse.py",),
        "tail",
    ),
    M(
        "background_compile_never_ready",
        "jaxinfer/compile/buckets.py",
        "self.pending.difference_update(keys)",
        "pass",
        ("tests/test_bucket_reuse.py",),
        "background",
    ),
    # The renovation (issue 29): the runner's compile API and the engine's capabilities.
    M(
        "runner_lowers_sampling_on_other_logits",
        "jaxinfer/engine/runner.py",
        "(b, self.cfg.vocab_size), jnp.float32, sharding=self._replicated",
        "(b, self.cfg.vocab_size), jnp.bfloat16, sharding=self._replicated",
        ("tests/test_precompile.py",),
        "runner_compile",
    ),
    M(
        "spec_claims_prompt_logprobs",
        "jaxinfer/speculative/strategy.py",
        "        prompt_logprobs=False,  # the round",
        "        prompt_logprobs=True,  # the round",
        ("tests/test_speculative.py",),
        "refuses",
    ),
    M(
        "background_compile_never_started",
        "jaxinfer/compile/buckets.py",
        "keys.update(self.compiler.submit(need, flags, keys))",
        "pass",
        ("tests/test_bucket_reuse.py",),
        "background",
    ),
    # Issue 29: EngineArgs (one source of truth for options), resolve, the chat-template option.
    M(
        "cli_error_names_python_argument",
        "jaxinfer/args.py",
        'return flag_of(field) if self.origin == "cli" else field',
        "return field",
        (EA,),
        "errors_name or generate_error",
    ),
    M(
        "spell_python_form_on_cli",
        "jaxinfer/args.py",
        'if self.origin != "cli":\n            return f"{field}={v!r}"',
        'if True:\n            return f"{field}={v!r}"',
        (EA,),
        "errors_name or spelled",
    ),
    M(
        "negative_switch_sets_true",
        "jaxinfer/options.py",
        "setattr(namespace, self.dest, option_string != self.negative)",
        "setattr(namespace, self.dest, True)",
        (EA,),
        "flags_reach",
    ),
    M(
        "unknown_llm_keyword_accepted",
        "jaxinfer/args.py",
        'raise TypeError(f"{caller}() got an unexpected keyword argument {n!r}{hint}")',
        "pass",
        ("tests/test_llm_args.py",),
        "unknown_keyword",
    ),
    M(
        "bytes_prompt_read_as_token_ids",
        "jaxinfer/engine/inputs.py",
        "elif isinstance(prompts, bytes | bytearray) or not isinstance(prompts, Iterable):",
        "elif not isinstance(prompts, Iterable):",
        ("tests/test_llm_args.py",),
        "wrong_type",
    ),
    M(
        "chat_string_read_as_conversations",
        "jaxinfer/engine/inputs.py",
        "    if not isinstance(messages, list | tuple):\n",
        "    if not isinstance(messages, list | tuple | str):\n",
        ("tests/test_llm_args.py",),
        "wrong_type",
    ),
    M(
        "page_size_beyond_max_model_len_accepted",
        "jaxinfer/args.py",
        "            if self.page_size > self.max_model_len:",
        "            if self.page_size > 2 * self.max_model_len:",
        (EA,),
        "errors_name_the_argument",
    ),
    M(
        "default_kv_pool_floor_beyond_budget",
        "jaxinfer/engine/config.py",
        "    return int(min(wanted, budget // page_bytes))",
        "    return int(max(2, min(wanted, budget // page_bytes)))",
        (EA,),
        "budget_below_one_sequence",
    ),
    M(
        "empty_out_read_as_the_current_directory",
        "jaxinfer/cli/main.py",
        "        if not str(getattr(args, flag)).strip():",
        "        if False:",
        ("tests/test_cli_outputs.py",),
        "empty_or_missing",
    ),
    M(
        "out_not_creatable_retried_as_replaced",
        "jaxinfer/cli/output_file.py",
        "0o666), True\n                except FileExistsError:",
        "0o666), True\n                except (FileExistsError, FileNotFoundError):",
        ("tests/test_cli_outputs.py",),
        "empty_or_missing",
    ),
    M(
        "swallowed_interrupt_not_delivered_again",
        "jaxinfer/cli/interrupts.py",
        "            timer.start()",
        "            pass",
        ("tests/test_cli.py",),
        "swallowed_by_a_gc_callback",
    ),
    M(
        "interrupt_raised_while_importing",
        "jaxinfer/__main__.py",
        "        if self.count > 1:",
        "        if self.count > 0:",
        ("tests/test_cli.py",),
        "ctrl_c_while_importing",
    ),
    M(
        "text_file_read_as_llama2c_checkpoint",
        "jaxinfer/loaders/detect.py",
        'if p.suffix != ".bin":',
        "if False:",
        ("tests/test_llama2c.py",),
        "load_unrecognised",
    ),
    M(
        "generate_usage_lists_every_flag",
        "jaxinfer/cli/main.py",
        '        usage="%(prog)s --model PATH --prompts FILE --out FILE [options]",\n',
        "",
        ("tests/test_cli.py",),
        "usage_lines",
    ),
    M(
        "output_setting_dropped",
        "jaxinfer/args.py",
        '"{attn_impl} or tensor/data parallelism",\n        Switch(),\n'
        "        changes_outputs=True,",
        '"{attn_impl} or tensor/data parallelism",\n        Switch(),',
        (EA,),
        "partial_settings",
    ),
    M(
        "chat_template_not_applied",
        "jaxinfer/llm.py",
        "self.tokenizer.chat_template = chat_template",
        "pass",
        (CTO,),
        "continues_like_llama2c or generate_messages",
    ),
    M(
        "chat_template_file_unchecked",
        "jaxinfer/options.py",
        "        if v is not None:\n            check_chat_template(args, name, v)",
        "        pass",
        (CTO,),
        "bad_template",
    ),
    M(
        "page_major_default_off_on_cpu",
        "jaxinfer/engine/config.py",
        "page_major = cpu and impl in XLA_IMPLS and mesh is None",
        "page_major = False",
        (EA,),
        "resolve_applies",
    ),
    M(
        "async_on_with_speculative",
        "jaxinfer/engine/config.py",
        "args.speculative is None if args.async_scheduling is None",
        "True if args.async_scheduling is None",
        (EA,),
        "resolve_applies",
    ),
    M(
        "pool_too_small_unchecked",
        "jaxinfer/engine/config.py",
        "    if num_pages < need:",
        "    if False:",
        (EA,),
        "python_errors_of_resolve",  # the CLI run would hang on a 3-page pool
    ),
    M(
        "keep_host_memory_always",
        "jaxinfer/engine/runner.py",
        "        if ecfg.keep_host_memory:\n            keep_freed_host_memory()",
        "        keep_freed_host_memory()",
        (EA,),
        "environment",
    ),
    M(
        "multihost_option_ignored",
        "jaxinfer/models/sharding.py",
        "    if multihost is not None:\n        return multihost\n",
        "",
        (EA,),
        "environment",
    ),
    # ---- the front door (EngineLoop: add, abort, step) and the server over it
    M(
        "loop_validates_twice",
        "jaxinfer/engine/loop.py",
        "                eng.add_request(eid, req.prompt_ids, csp, prompt=req.prompt_text, resume=crs)",  # noqa: E501
        "                eng.validate(req.prompt_ids, csp, crs)\n"
        "                eng.add_request(eid, req.prompt_ids, csp, prompt=req.prompt_text, resume=crs)",  # noqa: E501
        (LOOP,),
        "fans_out or trusts",
    ),
    M(
        "with_resume_revalidates_request",
        "jaxinfer/engine/inputs.py",
        "engine.validate_resume(request.prompt_ids, csp, st)",
        "engine.validate(request.prompt_ids, csp, st)",
        ("tests/test_resume_partial.py",),
        "each_record_once",
    ),
    M(
        "cli_validates_record_twice",
        "jaxinfer/cli/generate.py",
        "        return llm.engine_loop.process(Request(job.id, job.prompt, params))",
        "        request = llm.engine_loop.process(Request(job.id, job.prompt, params))\n"
        "        llm.engine.validate(request.prompt_ids, params)\n"
        "        return request",
        ("tests/test_resume_partial.py",),
        "each_record_once",
    ),
    M(
        "loop_n_validates_first_completion_only",
        "jaxinfer/engine/inputs.py",
        "    for csp, crs in children:\n        engine.validate",
        "    for csp, crs in children[:1]:\n        engine.validate",
        (LOOP,),
        "fans_out",
    ),
    M(
        "loop_duplicate_id_unchecked",
        "jaxinfer/engine/loop.py",
        "        if taken:\n            raise RequestError",
        "        if False:\n            raise RequestError",
        (LOOP,),
        "refused",
    ),
    M(
        "loop_abort_keeps_route",
        "jaxinfer/engine/loop.py",
        "            self._routes.pop(eid, None)\n            running.engine.abort_request(eid)",
        "            running.engine.abort_request(eid)",
        (LOOP,),
        "abort",
    ),
    M(
        "loop_finished_request_kept",
        "jaxinfer/engine/loop.py",
        "                    if out.finished:\n                        del self._requests[",
        "                    if False:\n                        del self._requests[",
        (LOOP,),
        "route",
    ),
    M(
        "serve_completions_share_a_key",
        "jaxinfer/server/engine_thread.py",
        "return out.request_id, (out.outputs[0].index if len(out.outputs) == 1 else None)",
        "return out.request_id, (0 if len(out.outputs) == 1 else None)",
        ("tests/test_server.py",),
        "n_as_llm_generate",
    ),
    M(
        "serve_echo_offset_counts_as_tokens",
        "jaxinfer/server/serving.py",
        "text_offset=len(echo),",
        "tok_sent=len(echo),",
        ("tests/test_server.py",),
        "echo_logprobs",
    ),
    # ---- structured output and tool calling in the server (issue 31)
    M(
        "tools_parser_drops_last_call",
        "jaxinfer/server/tool_parsers/base.py",
        "    out = []\n    for c in parsed.calls:",
        "    out = []\n    for c in parsed.calls[:-1]:",
        ("tests/test_tool_parsers.py",),
        "extract_reads",
    ),
    M(
        "tools_stream_resends_arguments",
        "jaxinfer/server/tool_parsers/stream.py",
        "new = call.arguments[self.args_sent[k] :]",
        "new = call.arguments",
        ("tests/test_tool_parsers.py",),
        "split_point",
    ),
    M(
        "tools_content_sends_a_marker_start",
        "jaxinfer/server/tool_parsers/base.py",
        "return text[: len(text) - held_prefix(text, marker)].rstrip(WHITESPACE), -1",
        "return text.rstrip(WHITESPACE), -1",
        ("tests/test_tool_parsers.py",),
        "split_point",
    ),
    M(
        "tools_required_without_min_items",
        "jaxinfer/server/constraints.py",
        '"minItems": 1,',
        '"minItems": 0,',
        ("tests/test_tool_parsers.py",),
        "required_schema",
    ),
    M(
        "tools_finish_reason_stays_stop",
        "jaxinfer/server/chat_output.py",
        'return "tool_calls" if reason == "stop" and self.called else reason',
        "return reason",
        ("tests/test_server_tools.py",),
        "required",
    ),
    M(
        "tools_named_choice_unconstrained_arguments",
        "jaxinfer/server/constraints.py",
        'schema = f.get("parameters") or EMPTY_PARAMETERS',
        "schema = EMPTY_PARAMETERS",
        ("tests/test_server_tools.py",),
        "named",
    ),
    M(
        "tools_not_given_to_the_template",
        "jaxinfer/server/serving.py",
        'prompt["tools"] = plan.template_tools',
        "pass",
        ("tests/test_server_tools.py",),
        "tool_turns",
    ),
    M(
        "tools_call_arguments_stay_a_string_in_the_template",
        "jaxinfer/server/protocol.py",
        '"arguments": _args(c.function.arguments)',
        '"arguments": c.function.arguments',
        ("tests/test_server_tools.py",),
        "tool_turns",
    ),
    M(
        "reasoning_end_marker_in_the_content",
        "jaxinfer/server/reasoning_parsers.py",
        "return text[body:e], text[e + len(self.end) :]",
        "return text[body:e], text[e:]",
        ("tests/test_tool_parsers.py",),
        "reasoning",
    ),
    # ---- generate's progress line: tokens of this run
    M(
        "progress_counts_resumed_tokens",
        "jaxinfer/compile/progress.py",
        "now = out.metrics.completion_tokens - out.metrics.resumed_tokens",
        "now = out.metrics.completion_tokens",
        ("tests/test_compile_progress.py",),
        "token_count",
    ),
    # ---- orbax warnings on jaxinfer quantize's output
    M(
        "quant_restore_without_sharding",
        "jaxinfer/quant/checkpoint.py",
        'args=ocp.args.PyTreeRestore(restore_args=_restore_args(meta["arrays"])),',
        "",
        ("tests/test_quant.py",),
        "warn_of_nothing",
    ),
    # ---- mixture of experts (models/moe.py, loaders/hf_moe.py)
    M(
        "attention_sink_dropped_from_denominator",
        "jaxinfer/models/attention.py",
        "denom = denom + jnp.exp(sink - mx)",
        "denom = denom",
        ("tests/test_attention_sinks.py", "tests/test_gpt_oss_attention.py"),
        "dense",
    ),
    M(
        "split_kv_decode_sinks_dropped",
        "jaxinfer/models/paged_attention.py",
        "_, l_row, acc_row = add_sinks(row_max[:td], l_row, acc_row, sinks)",
        "",
        ("tests/test_attention_sinks.py",),
        "paged_xla",
    ),
    M(
        "cpu_kernel_sink_dropped",
        "jaxinfer/models/cpu_decode_kernel.cc",
        "l[st] = l[st] * corr + std::exp(a.sinks[st] - nm);",
        "l[st] = l[st] * corr;",
        ("tests/test_attention_sinks.py",),
        "cpu_kernel",
    ),
    M(
        "batch_invariant_sinks_dropped",
        "jaxinfer/models/batch_invariant.py",
        "m, l, acc = add_sinks(m, l, acc, None if sinks is None else sinks.reshape(kh, g))",
        "",
        ("tests/test_attention_sinks.py",),
        "batch_invariant",
    ),
    M(
        "yarn_beta_swapped",
        "jaxinfer/models/rope.py",
        "low = correction_dim(scaling.beta_fast)\n    high = correction_dim(scaling.beta_slow)",
        "low = correction_dim(scaling.beta_slow)\n    high = correction_dim(scaling.beta_fast)",
        ("tests/test_gpt_oss_config.py",),
        "yarn",
    ),
    M(
        "yarn_attention_factor_dropped",
        "jaxinfer/models/forward.py",
        "mul = 1.0 if local else rope_attention_scaling(cfg.rope_scaling)",
        "mul = 1.0",
        ("tests/test_gpt_oss_attention.py",),
        "dense",
    ),
    M(
        "o_proj_bias_dropped",
        "jaxinfer/models/forward.py",
        "out = out + lp.bo",
        "out = out",
        ("tests/test_gpt_oss_attention.py",),
        "dense",
    ),
    M(
        "mxfp4_nibble_order_swapped",
        "jaxinfer/loaders/mxfp4.py",
        "out[..., 0::2] = FP4_VALUES[blocks & 0x0F]",
        "out[..., 0::2] = FP4_VALUES[blocks >> 4]",
        ("tests/test_mxfp4.py",),
    ),
    M(
        "mxfp4_scale_bias_off_by_one",
        "jaxinfer/loaders/mxfp4.py",
        "SCALE_BIAS = 127",
        "SCALE_BIAS = 128",
        ("tests/test_mxfp4.py",),
    ),
    # ---- gpt-oss experts (models/moe.py, loaders/hf_gpt_oss_weights.py)
    M(
        "gpt_oss_interleave_read_as_halves",
        "jaxinfer/loaders/hf_gpt_oss_weights.py",
        "return np.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)",
        "return x",
        (GPT_OSS_MOE,),
        "forward_logits",
    ),
    M(
        "gpt_oss_clamp_dropped",
        "jaxinfer/models/moe.py",
        "    gate = jnp.minimum(gate, limit)\n    up = jnp.clip(up, -limit, limit)\n",
        "",
        (GPT_OSS_MOE,),
        "forward_logits",
    ),
    M(
        "gpt_oss_expert_bias_by_pair_not_sorted_row",
        "jaxinfer/models/moe.py",
        "row_experts = flat[order]",
        "row_experts = flat",
        (GPT_OSS_MOE,),
        "forward_logits",
    ),
    M(
        "gpt_oss_router_bias_dropped",
        "jaxinfer/models/moe.py",
        "logits = logits + router_bias.astype(jnp.float32)",
        "logits = logits",
        (GPT_OSS_MOE,),
        "forward_logits",
    ),
    M(
        "forward_drops_layer_sinks",
        "jaxinfer/models/forward.py",
        "attn, cache = attn_fn(q, k, v, cache, layer, window, lp.sinks)",
        "attn, cache = attn_fn(q, k, v, cache, layer, window, None)",
        ("tests/test_gpt_oss_attention.py",),
        "whole_model",
    ),
    M(
        "rpa_gpu_kernel_sink_dropped",
        "kernels_pallas/ragged_paged_attention/gpu.py",
        "l = alpha * l + jnp.exp(sinks - m_new)",
        "l = alpha * l",
        ("tests/test_ragged_paged_attention.py",),
        "attention_sinks and gpu",
    ),
    M(
        "rpa_tpu_kernel_sink_dropped",
        "kernels_pallas/ragged_paged_attention/tpu.py",
        "l = alpha * l + jnp.exp(sink - m_new)",
        "l = alpha * l",
        ("tests/test_ragged_paged_attention.py",),
        "attention_sinks and tpu",
    ),
    M(
        "rpa_reference_sink_dropped",
        "kernels_pallas/ragged_paged_attention/reference.py",
        "denom = denom + jnp.exp(sink - s_max)",
        "denom = denom",
        ("tests/test_attention_sinks.py",),
        "kernel_reference",
    ),
    M(
        "flash_sink_dropped_from_denominator",
        "kernels_pallas/flash_attention/common.py",
        "return m_next, alpha * l + jnp.exp(sinks - m_next), _col(alpha) * acc",
        "return m_next, alpha * l, _col(alpha) * acc",
        ("tests/test_flash_attention.py",),
        "sinks",
    ),
    M(
        "flash_sink_gradient_sign",
        "kernels_pallas/flash_attention/kernel.py",
        "dsinks = (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks.dtype)",
        "dsinks = jnp.sum(p_sink * delta, axis=(0, 2)).astype(sinks.dtype)",
        ("tests/test_flash_attention.py",),
        "sinks",
    ),
    # ---- grouped matmul (kernels_pallas/grouped_matmul: MoE expert matmuls)
    M(
        "moe_router_order_swapped",
        "jaxinfer/models/moe.py",
        'if cfg.router_order == "softmax_topk":',
        'if cfg.router_order != "softmax_topk":',
        ("tests/test_moe_routing.py",),
        "random_routing",
    ),
    M(
        "moe_unsort_by_sort_order",
        "jaxinfer/models/moe.py",
        "pairs = out[inverse].reshape(t, a, -1)",
        "pairs = out[order].reshape(t, a, -1)",
        ("tests/test_moe_routing.py",),
        "random_routing",
    ),
    M(
        "moe_norm_topk_prob_ignored",
        "jaxinfer/models/moe.py",
        "if cfg.norm_topk_prob:",
        "if False:",
        ("tests/test_moe_routing.py",),
        "random_routing",
    ),
    M(
        "moe_shared_expert_gate_not_applied",
        "jaxinfer/models/moe.py",
        "shared = jax.nn.sigmoid(g)[:, None] * shared",
        "shared = shared",
        ("tests/test_moe_routing.py",),
        "shared_expert_gate",
    ),
    M(
        "moe_gate_up_halves_swapped",
        "jaxinfer/models/moe.py",
        "gate, up = jnp.split(gate_up, 2, axis=-1)",
        "up, gate = jnp.split(gate_up, 2, axis=-1)",
        ("tests/test_moe_parity.py",),
        "forward and olmoe",
    ),
    M(
        "moe_mixtral_w1_w3_swapped",
        "jaxinfer/loaders/hf_moe.py",
        'g, u, dn = ("w1", "w3", "w2") if mixtral',
        'g, u, dn = ("w3", "w1", "w2") if mixtral',
        ("tests/test_moe_parity.py",),
        "forward and mixtral",
    ),
    M(
        "moe_mlp_only_layers_ignored",
        "jaxinfer/loaders/hf_moe.py",
        "return tuple(i not in only and (i + 1) % step == 0 for i in range(n_layers))",
        "return tuple((i + 1) % step == 0 for i in range(n_layers))",
        ("tests/test_moe_parity.py",),
        "forward and qwen3_moe",
    ),
    M(
        "olmoe_qk_norm_per_head",
        "jaxinfer/models/forward.py",
        "if lp.q_norm is not None and cfg.qk_norm_flat:",
        "if False:",
        ("tests/test_moe_parity.py",),
        "forward and olmoe",
    ),
    M(
        "gmm_tpu_straddling_tile_unmasked",
        "kernels_pallas/grouped_matmul/tpu.py",
        "mine = (row >= lo) & (row < hi)",
        "mine = row < hi",
        (GMM,),
        "tpu",
    ),
    M(
        "gmm_tpu_d_edge_unmasked",
        "kernels_pallas/grouped_matmul/tpu.py",
        "if d % block_d:",
        "if False:",
        (GMM,),
        "tpu",
    ),
    M(
        "gmm_group_offset_ignored",
        "kernels_pallas/grouped_matmul/metadata.py",
        "idx = group_offset + jnp.arange(num_local + 1, dtype=jnp.int32)",
        "idx = jnp.arange(num_local + 1, dtype=jnp.int32)",
        (GMM,),
        "local",
    ),
    M(
        "gmm_tile_table_rounded_down",
        "kernels_pallas/grouped_matmul/metadata.py",
        "tiles = (hi - lo + block_t - 1) // block_t",
        "tiles = (hi - lo) // block_t",
        (GMM,),
        "gpu or xla_tiled",
    ),
    M(
        "gmm_gpu_store_unmasked",
        "kernels_pallas/grouped_matmul/gpu.py",
        "mask=jnp.broadcast_to(mine[:, None], acc.shape),",
        "mask=None,",
        (GMM,),
        "gpu",
    ),
    M(
        "gmm_xla_local_rows_not_rolled_back",
        "kernels_pallas/grouped_matmul/xla.py",
        "out = jnp.roll(out, first, axis=0)",
        "out = out",
        (GMM,),
        "xla",
    ),
    M(
        "gmm_xla_tiled_row_mask_dropped",
        "kernels_pallas/grouped_matmul/xla.py",
        "jnp.where(mine, y.astype(out.dtype), old)",
        "y.astype(out.dtype)",
        (GMM,),
        "xla_tiled",
    ),
    M(
        "gmm_xla_tiled_loop_misses_last_tile",
        "kernels_pallas/grouped_matmul/xla.py",
        "jax.lax.fori_loop(0, num_real, tile,",
        "jax.lax.fori_loop(0, num_real - 1, tile,",
        (GMM,),
        "xla_tiled",
    ),
    M(
        "gmm_auto_picks_unverified_kernel",
        "kernels_pallas/grouped_matmul/__init__.py",
        "if platform in VERIFIED_BACKENDS:",
        "if platform in KERNEL_BACKENDS:",
        (GMM,),
        "auto",
    ),
    M(
        "moe_fused_gate_up_reshaped_not_transposed",
        "jaxinfer/loaders/hf_moe.py",
        "return np.swapaxes(xs[0], 1, 2)",
        "return xs[0].reshape(np.swapaxes(xs[0], 1, 2).shape)",
        ("tests/test_moe_parity.py",),
        "forward_logits_equal and mixtral",
    ),
    M(
        "moe_scan_layer_kind_inverted",
        "jaxinfer/models/forward.py",
        "return jax.lax.cond(sparse, lambda h: moe(cfg",
        "return jax.lax.cond(~sparse, lambda h: moe(cfg",
        ("tests/test_moe_parity.py",),
        "speculative",
    ),
    # ---- expert parallelism (models/expert_sharding.py)
    M(
        "ep_group_offset_is_shard_index",
        EXPERT_SHARDING,
        "first = jax.lax.axis_index(AXIS) * gate_up.shape[0] if by_experts else 0",
        "first = jax.lax.axis_index(AXIS) if by_experts else 0",
        (MOE_PARALLEL,),
        "eight_devices",
    ),
    M(
        "ep_experts_per_shard_off_by_one",
        EXPERT_SHARDING,
        "first = jax.lax.axis_index(AXIS) * gate_up.shape[0] if by_experts else 0",
        "first = jax.lax.axis_index(AXIS) * (gate_up.shape[0] + 1) if by_experts else 0",
        (MOE_PARALLEL,),
        "eight_devices",
    ),
    M(
        "ep_partials_not_summed",
        EXPERT_SHARDING,
        "return jax.lax.psum(y, AXIS)",
        "return y",
        (MOE_PARALLEL,),
        "eight_devices",
    ),
    M(
        "ep_expert_down_split_on_width",
        EXPERT_SHARDING,
        '"expert_down": P(None, AXIS, None, None),',
        '"expert_down": P(None, None, AXIS, None),',
        (MOE_PARALLEL,),
        "eight_devices",
    ),
    M(
        "ep_gate_up_bias_by_global_expert",
        "jaxinfer/models/moe.py",
        "local = row_experts - first_expert",
        "local = row_experts",
        (MOE_PARALLEL,),
        "eight_devices",
    ),
    M(
        "width_split_gate_up_not_per_shard",
        EXPERT_SHARDING,
        "both = np.stack([gate.reshape(*lead, tp, per), up.reshape(*lead, tp, per)], axis=-2)",
        "both = np.concatenate([gate, up], axis=-1)",
        (MOE_PARALLEL,),
        "width_split or eight_devices",
    ),
    # ---- int8 mixture of experts (quant/grouped.py, quant/tensor.py)
    M(
        "moe_int8_scale_of_next_expert",
        "jaxinfer/quant/grouped.py",
        "scales = w.scales[row_groups]  # f32[M, N], each row's own expert's",
        "scales = w.scales[(row_groups + 1) % w.scales.shape[0]]",
        ("tests/test_moe_quant.py",),
        "numpy or (round_tripped and mixtral)",
    ),
    M(
        "moe_int8_router_quantized",
        "jaxinfer/quant/tensor.py",
        "        return dataclasses.replace(lp, **qs)\n",
        "        if lp.router is not None:\n"
        "            rq = quantize_tensor(lp.router, lead, 1, act)\n"
        "            qs['router'] = jnp.swapaxes(dequantize(rq), -1, -2)\n"
        "        return dataclasses.replace(lp, **qs)\n",
        ("tests/test_moe_quant.py",),
        "round_tripped",
    ),
    M(
        "moe_w8a8_row_scale_dropped",
        "jaxinfer/quant/grouped.py",
        "out = acc.astype(jnp.float32) * scales * sx",
        "out = acc.astype(jnp.float32) * scales",
        ("tests/test_moe_quant.py",),
        "numpy",
    ),
    M(
        "moe_int8_shared_expert_left_float",
        "jaxinfer/quant/tensor.py",
        '"shared_w_gate": 1, "shared_w_up": 1, "shared_w_down": 1}',
        "}",
        ("tests/test_moe_quant.py",),
        "round_tripped and qwen2",
    ),
    M(
        "moe_int8_checkpoint_expert_scales_without_e",
        "jaxinfer/quant/checkpoint.py",
        "lead = 2  # [L, E, *in, *out]",
        "lead = 1  # [L, E, *in, *out]",
        ("tests/test_moe_quant.py",),
        "checkpoint",
    ),
    # ---- structured outputs (issue 31)
    M(
        "so_mask_off_by_one_word",
        "jaxinfer/sampling/sampler.py",
        "    bits = jnp.right_shift(bitmask[:, :, None], shifts) & 1  # i32[B, W, 32]",
        "    bits = jnp.right_shift(jnp.roll(bitmask, 1, axis=1)[:, :, None], shifts) & 1",
        (SO,),
    ),
    M(
        "so_eos_always_allowed",
        "jaxinfer/engine/core.py",
        "            self.grammars.fill_bitmask(rows, bitmask)\n",
        "            self.grammars.fill_bitmask(rows, bitmask)\n"
        "            bitmask[:, 0] |= 1 << 2  # EOS (id 2 on stories260K)\n",
        (SO,),
    ),
    M(
        "so_mask_after_sampling",
        "jaxinfer/engine/step.py",
        "    if bitmask is not None:\n"
        "        logits = apply_token_bitmask(logits.astype(jnp.float32), bitmask)\n",
        "",
        (SO,),
    ),
    M(
        "so_stale_mask",
        "jaxinfer/engine/core.py",
        "        results = self._collect(done)\n"
        "        self.recovery.culprits = [row.seq for row in nxt.sched.rows]\n"
        "        try:\n"
        "            self._inflight = self._sample(launched)\n",
        "        self.recovery.culprits = [row.seq for row in nxt.sched.rows]\n"
        "        try:\n"
        "            self._inflight = self._sample(launched)  # before the tokens in flight\n"
        "            results = self._collect(done)\n",
        (SO,),
    ),
    M(
        "so_forcing_limit_fails_request",
        "jaxinfer/sampling/structured.py",
        "        if not is_forcing_limit(self._m.get_error()):\n            return False\n",
        "        return False\n",
        (SO,),
        "forced_endless",
    ),
    M(
        "so_cli_whitespace_flag_dropped",
        "jaxinfer/cli/main.py",
        '            d["structured_outputs"]["disable_any_whitespace"] = True\n',
        "            pass\n",
        (SO,),
        "cli",
    ),
    M(
        "so_server_options_dropped",
        "jaxinfer/server/constraints.py",
        "        return _params(src, json=rf.json_schema.schema_, **options), src\n",
        "        return _params(src, json=rf.json_schema.schema_), src\n",
        ("tests/test_server_tools.py",),
        "options_apply",
    ),
    # ---- structured outputs after a reasoning (start_after, reasoning_start)
    M(
        "so_reasoning_grammar_from_the_start",
        "jaxinfer/sampling/structured.py",
        "        self.active = self._marker is None\n",
        "        self.active = True\n",
        (SOR,),
        "free_until_the_marker",
    ),
    M(
        "so_reasoning_marker_matched_on_the_prompt",
        "jaxinfer/engine/core.py",
        "            req.grammar = self.grammars.matcher(params.structured_outputs)\n",
        "            req.grammar = self.grammars.matcher(params.structured_outputs)\n"
        "            if params.structured_outputs.start_after:  # the prompt ends it?\n"
        "                for t in prompt_ids:\n"
        "                    req.grammar.accept(t)\n",
        (SOR,),
        "prompt_starts_nothing",
    ),
    M(
        "so_reasoning_opener_masked_out",
        "jaxinfer/sampling/structured.py",
        "            if m.opener is not None:  # the first token may open the reasoning instead\n",
        "            if False:\n",
        (SOR,),
        "reasoning_start",
    ),
    M(
        "so_reasoning_ids_unchecked",
        "jaxinfer/sampling/structured.py",
        "            bad = [i for i in vals if i is not None and i >= self.vocab_size]\n",
        "            bad = []\n",
        (SOR,),
        "vocabulary",
    ),
    M(
        "so_server_reasoning_markers_dropped",
        "jaxinfer/server/constraints.py",
        "        structured = dataclasses.replace(structured, **fields)\n",
        "",
        (SOR,),
        "server",
    ),
]


def check_list(mutations=MUTATIONS, root: Path = REPO) -> list[str]:
    """Problems with the list against the tree at ``root``: an old text not found exactly once,
    a duplicate name, a missing test file, a no-op mutation."""
    problems, names = [], set()
    for m in mutations:
        if m.name in names:
            problems.append(f"{m.name}: duplicate name")
        names.add(m.name)
        path = root / m.file
        if not path.is_file():
            problems.append(f"{m.name}: {m.file} not found")
            continue
        n = path.read_text().count(m.old)
        if n != 1:
            problems.append(
                f"{m.name}: old text found {n} times in {m.file} (the code moved: "
                "update the mutation)"
            )
        if m.old == m.new:
            problems.append(f"{m.name}: old == new")
        problems += [
            f"{m.name}: test file {t} not found" for t in m.tests if not (root / t).is_file()
        ]
    return problems


def make_copy(dest: Path, src: Path = REPO) -> Path:
    """The tree at ``src`` (without .git, virtual environments, caches and results) at ``dest``."""
    shutil.copytree(src, dest, ignore=COPY_IGNORE)
    return dest


def env_for(root: Path) -> dict:
    env = dict(os.environ)
    extra = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(root) + (os.pathsep + extra if extra else "")
    env["JAXINFER_SHARED"] = str(SHARED)
    env.setdefault("JAXINFER_CACHE_DIR", str(REPO / ".cache"))
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_imports_from_copy(root: Path) -> None:
    """Raises SystemExit when the copy's ``jaxinfer`` is not the one imported there (an editable
    install shadowing PYTHONPATH would make every mutation survive)."""
    code = (
        "import jaxinfer, kernels_pallas; print(jaxinfer.__file__); print(kernels_pallas.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        env=env_for(root),
        capture_output=True,
        text=True,
        timeout=300,
    )
    files = out.stdout.split()
    if (
        out.returncode
        or len(files) != 2
        or not all(Path(f).resolve().is_relative_to(root.resolve()) for f in files)
    ):
        raise SystemExit(f"the copy's modules are not the ones imported: {out.stdout}{out.stderr}")


def pytest_cmd(m: Mutation) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests]
    return cmd + (["-k", m.k] if m.k else [])


def run_one(m: Mutation, timeout: float, snapshot: Path, mutate: bool = True) -> dict:
    """Applies ``m`` (unless ``mutate`` is False: the baseline) in a fresh copy of ``snapshot``
    and runs its tests. Returns {name, result, rc, seconds, tail}."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"mut-{m.name}-") as tmp:
        root = make_copy(Path(tmp) / "repo", snapshot)
        path = root / m.file
        text = path.read_text()
        if text.count(m.old) != 1:  # checked at start: cannot happen in the snapshot
            raise SystemExit(f"{m.name}: old text found {text.count(m.old)} times in {m.file}")
        if mutate:
            path.write_text(text.replace(m.old, m.new))
        try:
            p = subprocess.run(
                pytest_cmd(m),
                cwd=root,
                env=env_for(root),
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            rc, tail = p.returncode, (p.stdout + p.stderr)[-1500:]
        except subprocess.TimeoutExpired as e:
            rc, tail = None, f"timeout after {timeout:.0f} s: {str(e.stdout or '')[-500:]}"
    result = {0: "survived", 1: "caught"}.get(rc, "timeout" if rc is None else "error")
    return {
        "name": m.name,
        "result": result,
        "rc": rc,
        "seconds": round(time.perf_counter() - t0, 1),
        "tail": tail,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--list",
        action="store_true",
        help="list the mutations, check their old texts against the tree, run nothing",
    )
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only this mutation (repeatable, or comma-separated)",
    )
    ap.add_argument("--jobs", type=int, default=1, help="mutations run at once (default 1)")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per mutation's tests")
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="first run each selected mutation's tests unmutated: they must pass",
    )
    ap.add_argument(
        "--results-dir", default=os.environ.get("JAXINFER_RESULTS_DIR", str(REPO / "results"))
    )
    args = ap.parse_args(argv)

    problems = check_list()
    if args.list:
        for m in MUTATIONS:
            k = f" -k '{m.k}'" if m.k else ""
            print(f"{m.name:34s} {m.file:38s} {' '.join(m.tests)}{k}")
        for p in problems:
            print("PROBLEM:", p, file=sys.stderr)
        return 1 if problems else 0
    only = {n for o in args.only for n in o.split(",") if n}
    unknown = only - {m.name for m in MUTATIONS}
    if unknown:
        raise SystemExit(f"unknown mutation(s): {sorted(unknown)}; see --list")
    chosen = [m for m in MUTATIONS if not only or m.name in only]
    if not SHARED.is_dir():
        raise SystemExit(f"{SHARED} not found: set JAXINFER_SHARED")
    with tempfile.TemporaryDirectory(prefix="mut-check-") as tmp:
        # One snapshot of the working tree for the whole run (others may edit it meanwhile).
        snapshot = make_copy(Path(tmp) / "snapshot")
        problems = check_list(root=snapshot)
        if problems:
            raise SystemExit("mutation list does not match the tree:\n" + "\n".join(problems))
        check_imports_from_copy(snapshot)
        return run(args, chosen, snapshot)


def run(args, chosen: list[Mutation], snapshot: Path) -> int:
    t0 = time.perf_counter()
    baseline_failed = []
    if args.baseline:
        groups = {}
        for m in chosen:
            groups.setdefault((m.tests, m.k), m)
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as ex:
            for r in ex.map(
                lambda m: run_one(m, args.timeout, snapshot, mutate=False), groups.values()
            ):
                ok = r["result"] == "survived"  # unmutated: the tests pass
                print(
                    f"baseline {r['name']:34s} {'ok' if ok else r['result']:9s} "
                    f"{r['seconds']:7.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
                if not ok:
                    baseline_failed.append({k: r[k] for k in ("name", "result", "rc", "tail")})
        bad = {(m.tests, m.k) for m in chosen if m.name in {b["name"] for b in baseline_failed}}
        chosen = [m for m in chosen if (m.tests, m.k) not in bad]

    results = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as ex:
        for r in ex.map(lambda m: run_one(m, args.timeout, snapshot), chosen):
            print(
                f"{r['name']:34s} {r['result']:9s} {r['seconds']:7.1f} s",
                file=sys.stderr,
                flush=True,
            )
            results.append(r)

    def names(kind):
        return [r["name"] for r in results if r["result"] == kind]

    sys.path.insert(0, str(REPO / "scripts"))
    from benchlib import emit, host_info

    summary = {
        "script": "mutation_check",
        **host_info(),
        "tried": len(results),
        "caught": len(names("caught")),
        "survived": names("survived"),
        "errors": names("error"),
        "timeouts": names("timeout"),
        "baseline_failed": baseline_failed,
        "seconds": round(time.perf_counter() - t0, 1),
        "results": [
            {k: r[k] for k in ("name", "result", "rc", "seconds")}
            | ({"tail": r["tail"]} if r["result"] not in ("caught",) else {})
            for r in results
        ],
    }
    emit(summary, "mutation_check", args.results_dir)
    return 0 if len(names("caught")) == len(results) and not baseline_failed else 1


if __name__ == "__main__":
    sys.exit(main())
