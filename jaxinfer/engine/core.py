"""Engine core: requests in, one device step at a time, outputs out.

Owns the loaded model, the KV page pool, the scheduler and the per-request host state
(detokenizer, stop checks, metrics: ``jaxinfer.engine.request_output``). ``LLM`` (``jaxinfer.llm``)
is
the user-facing API over it.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

import jaxinfer.compile.buckets as bucket_reuse
import jaxinfer.engine.prompt_logprobs as plp
from jaxinfer.engine.batch import (
    build_step_batch,
    decode_bucket,
    exact_buckets,
    next_pow2,
    row_index,
)
from jaxinfer.engine.config import (  # noqa: F401 - re-exported: jaxinfer.engine.core's public names
    KV_CACHE_DTYPES,
    EngineConfig,
    default_num_pages,
    default_page_size,
    kv_cache_dtype,
    scan_from_tokens,
)
from jaxinfer.engine.host_memory import keep_freed_host_memory
from jaxinfer.engine.kv_manager import make_kv_manager
from jaxinfer.engine.request_output import RequestState, advance, build_output
from jaxinfer.engine.resume import ResumeState, check_resume
from jaxinfer.engine.scheduler import Scheduler, SeqStatus, Sequence
from jaxinfer.engine.step import LogitsControls, jitted_forward_step, jitted_sample_step
from jaxinfer.engine.step_controls import has_penalties, logits_controls, needs_controls
from jaxinfer.errors import RequestError
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.kv_cache import init_kv_cache
from jaxinfer.models.paged_attention import XLA_IMPLS, check_attn_impl, engine_attn_impl
from jaxinfer.models.params import Params, out_in_projections, unstack_layers
from jaxinfer.models.sharding import to_host
from jaxinfer.outputs import RequestOutput, TokenLogprob
from jaxinfer.sampling.sampler import (
    GREEDY_FLAGS,
    MAX_LOGPROBS,
    SamplingParams,
    SamplingTensors,
    draw_seed,
    sample_flags,
)
from jaxinfer.tokenizers import IncrementalDetokenizer, Tokenizer
from jaxinfer.tokenizers.ids_only import no_tokenizer_message


@dataclasses.dataclass(eq=False)
class _InFlight:
    """A dispatched step whose sampled tokens are still on device."""

    out: object  # SampleOutput (device arrays)
    next_tokens: jax.Array  # i32[R] the sampled tokens padded, the next step's prev_tokens
    sampled: list[tuple[Sequence, int]]  # (sequence, row) of each row that sampled a token
    num_logprobs: int
    prompt_lp: tuple | None = None  # (plp.StepPlan, device PromptLogprobsOut) when asked


MAX_STEP_FAILURES = 2
"""A request in this many failed steps fails (``Engine.step``'s recovery)."""


class Engine:
    """Continuous-batching engine over one model.

    Raises:
        ValueError: at construction when the pool cannot hold one sequence of ``max_model_len``
            tokens (the message says how many pages are needed), or ``attn_impl`` is unknown,
            unavailable on this backend, or cannot tile this model (the message says why), or
            ``batch_invariant`` is asked with a Pallas ``attn_impl`` or a mesh.
        RuntimeError: ``attn_impl="cpu_kernel"`` whose build fails.

    ``attn_impl`` is the implementation it runs (``paged_attention.engine_attn_impl``: "auto"
    resolved, e.g. "cpu_kernel" or "xla" on CPU), ``attn_impl_reason`` why; ``ecfg.attn_impl``
    is that resolved name too (the static argument of every jitted step).
    """

    def __init__(
        self, cfg: ModelConfig, params: Params, tokenizer: Tokenizer, ecfg: EngineConfig, mesh=None
    ):
        impl = check_attn_impl(
            cfg, ecfg.attn_impl, ecfg.page_size, ecfg.num_pages, ecfg.max_pages_per_seq
        )
        page_major = ecfg.kv_page_major
        if page_major is None:
            page_major = jax.default_backend() == "cpu" and impl in XLA_IMPLS and mesh is None
        elif page_major and impl not in XLA_IMPLS:
            raise ValueError(
                f"kv_page_major=True needs attn_impl resolving to 'xla' (got {impl!r}): "
                "the Pallas kernels read the head-major pool"
            )
        elif page_major and mesh is not None:
            raise ValueError(
                "kv_page_major=True is not supported with a mesh: sharded KV pools are head-major"
            )
        self.kv_page_major = page_major
        if ecfg.batch_invariant and (impl != "xla" or mesh is not None):
            raise ValueError(
                "batch_invariant=True runs its own XLA attention on one device: "
                + (
                    f"attn_impl={ecfg.attn_impl!r} (resolved {impl!r}) is not supported with it; "
                    "use 'xla' or 'auto'"
                    if impl != "xla"
                    else "tensor/data parallel engines are not supported with it yet"
                )
            )
        kv_dtype = kv_cache_dtype(ecfg, params)
        # Every jitted step's static attn_impl: "auto" resolved for this engine's pool.
        impl, self.attn_impl_reason = engine_attn_impl(
            ecfg.attn_impl,
            page_major=page_major,
            kv_dtype=kv_dtype,
            mesh=mesh,
            batch_invariant=ecfg.batch_invariant,
        )
        self.attn_impl, ecfg = impl, dataclasses.replace(ecfg, attn_impl=impl)
        if kv_dtype == np.int8 and mesh is not None:
            raise ValueError("kv_cache_dtype='int8' with a sharded engine is not supported yet")
        need = ecfg.max_pages_per_seq + 1
        if ecfg.num_pages < need:
            raise ValueError(
                f"KV pool too small: {ecfg.num_pages} pages of {ecfg.page_size} tokens cannot hold "
                f"one sequence of max_model_len={ecfg.max_model_len}; need at least {need} pages "
                f"({ecfg.max_pages_per_seq} + 1 reserved). Raise kv_pages or lower max_model_len."
            )
        if ecfg.max_num_batched_tokens < ecfg.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={ecfg.max_num_batched_tokens} must be >= "
                f"max_num_seqs={ecfg.max_num_seqs} (every running sequence decodes each step)"
            )
        keep = ecfg.keep_host_memory
        if keep if keep is not None else jax.default_backend() == "cpu":
            keep_freed_host_memory()
        unroll = ecfg.unroll_layers
        if unroll if unroll is not None else jax.default_backend() == "cpu":
            params = unstack_layers(params, scan_from_tokens(ecfg))
        out_in = ecfg.out_in_weights
        if out_in if out_in is not None else (jax.default_backend() == "cpu" and mesh is None):
            params = out_in_projections(params)
        self.cfg, self.params, self.tokenizer, self.ecfg = cfg, params, tokenizer, ecfg
        self.mesh = mesh  # a jax.sharding.Mesh the params are sharded over (None: one device)
        self._kv_dtype = kv_dtype
        self.kv = self._new_kv_cache()
        if mesh is None:
            self._forward = jitted_forward_step()
        else:
            from jaxinfer.models.sharding import step_out_shardings

            self._forward = jitted_forward_step(out_shardings=step_out_shardings(mesh))
        # What else decides a page's contents besides its tokens (one engine: one model).
        extra = (cfg.model_type, str(np.dtype(kv_dtype)), ecfg.page_size)
        self.kv_manager = make_kv_manager(ecfg, extra)
        self.scheduler = Scheduler(
            self.kv_manager,
            ecfg.max_num_seqs,
            ecfg.max_num_batched_tokens,
            ecfg.max_prefill_seqs,
        )
        self._rng = np.random.default_rng(ecfg.seed)
        self._requests: dict[str, RequestState] = {}
        self._sample = jitted_sample_step()
        # Rows of the widest step's sampling (``build_step_batch``): the prev_tokens length.
        self._num_slots = next_pow2(
            decode_bucket(ecfg.max_num_seqs) + next_pow2(ecfg.max_prefill_seqs)
        )
        self._no_prev = jax.numpy.zeros(self._num_slots, jax.numpy.int32)
        if mesh is not None:  # placed as the sampling step's output: one compile per forward shape
            self._no_prev = jax.device_put(
                self._no_prev, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            )
        self._async = ecfg.async_scheduling is not False
        self._inflight: _InFlight | None = None
        # Step-failure recovery (``step``): sequences the current attempt's device work covers,
        # sequences to run alone until they sample a token, failed steps per request.
        self._culprits: list[Sequence] = []
        self._isolate: list[Sequence] = []
        self._failures: dict[str, int] = {}
        self.num_step_failures = 0
        self.compile_keys: set[tuple] = set()
        self._wanted: dict[tuple, int] = {}  # uncompiled key -> steps padded past it (bucket_reuse)
        self._compiler = bucket_reuse.BackgroundCompiler(self) if mesh is None else None
        self.num_steps = 0
        self.stop_ids = set(tokenizer.eos_ids)
        if cfg.model_type == "llama2c" and tokenizer.bos_id is not None:
            # llama2.c's run.c ends a sample when the model emits BOS (the start of a new story).
            self.stop_ids.add(tokenizer.bos_id)

    def _new_kv_cache(self):
        """A fresh, zeroed KV page pool for this engine (sharded over the mesh if there is one)."""
        ecfg = self.ecfg
        if self.mesh is None:
            return init_kv_cache(
                self.cfg, ecfg.num_pages, ecfg.page_size, self._kv_dtype, self.kv_page_major
            )
        from jaxinfer.models.sharding import sharded_kv_cache

        return sharded_kv_cache(
            self.cfg, ecfg.num_pages, ecfg.page_size, self.params.embed.dtype, self.mesh
        )

    def prefix_cache_stats(self) -> dict:
        """Prefix-cache counters (``KVCacheManager.stats``: queried_tokens, hit_tokens,
        hit_rate, evictions, cached_pages); all zero with prefix caching off."""
        return self.kv_manager.stats()

    def cached_prefix_tokens(self, prompt_ids: list[int]) -> int:
        """Tokens of ``prompt_ids`` this engine's prefix cache holds now (0 with caching off);
        takes no references (data-parallel routing asks every replica)."""
        return self.kv_manager.cached_prefix_tokens(prompt_ids)

    @property
    def num_compilations(self) -> int:
        """Distinct device functions compiled so far by this engine: forward steps (one per bucket
        tuple) plus sampling steps (one per row count and option set); bounded by the buckets."""
        return len(self.compile_keys)

    # ---------------------------------------------------------------- requests

    def validate(
        self, prompt_ids: list[int], params: SamplingParams, resume: ResumeState | None = None
    ) -> None:
        """Raises RequestError when a request cannot run (or cannot resume from ``resume``: see
        ``add_request``)."""
        if len(prompt_ids) == 0:
            raise RequestError(
                "prompt has zero tokens (empty prompt on a tokenizer that adds no BOS)"
            )
        if len(prompt_ids) >= self.ecfg.max_model_len:
            raise RequestError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len={self.ecfg.max_model_len} "
                "leaves no room to generate (prompt must be shorter than max_model_len)"
            )
        bad = [t for t in prompt_ids if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise RequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.cfg.vocab_size})"
            )
        if params.logprobs is not None and params.logprobs > min(MAX_LOGPROBS, self.cfg.vocab_size):
            raise RequestError(
                f"logprobs={params.logprobs} > {MAX_LOGPROBS} or the vocabulary "
                f"size {self.cfg.vocab_size}"
            )
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(
                f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.cfg.vocab_size}) "
                "and could never be generated"
            )
        self._check_stop_strings(params)
        plp.check_request(
            params,
            self.cfg.vocab_size,
            self.ecfg.batch_invariant,
            type(self)._run_step is not Engine._run_step,
            len(prompt_ids),
        )
        if resume is not None:
            self._new_request("validate", prompt_ids, params, None, resume)

    def _check_stop_strings(self, params: SamplingParams) -> None:
        if params.stop and not getattr(self.tokenizer, "has_text", True):
            raise RequestError(no_tokenizer_message(self.tokenizer.path, "a stop string (stop)"))

    def draw_seed(self, params: SamplingParams) -> int:
        """The seed a request with ``params`` samples with: ``params.seed``, or one drawn from the
        engine's host RNG (advancing it), as ``add_request`` does for a request without one."""
        return draw_seed(params, self._rng)

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        resume: ResumeState | None = None,
    ) -> None:
        """Queues a validated request (call ``validate`` first). With ``resume`` it continues a
        partial output exactly (``jaxinfer.engine.resume``): seed ``resume.seed``, output so far
        ``resume.token_ids``, replayed through ``_advance``; its outputs hold the whole output
        (the first ``delta_text`` the replayed text too), timings count from this call.

        Raises RequestError for a duplicate id, stop strings on a model without a tokenizer
        (``tokenizer.has_text`` False: the request's outputs then have ``text`` None), a bad
        ``resume`` (``check_resume``) or one whose partial output has already finished."""
        if request_id in self._requests:
            raise RequestError(f"duplicate request id {request_id!r}")
        if params.n != 1:
            raise RequestError(
                f"n={params.n}: an engine request is one sequence; n > 1 is run as "
                "n requests by LLM / EngineLoop (jaxinfer.engine.parallel_sampling)"
            )
        self._check_stop_strings(params)
        req = self._new_request(request_id, prompt_ids, params, prompt, resume)
        self._requests[request_id] = req
        self.scheduler.add(req.seq)

    def _new_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        resume: ResumeState | None,
    ) -> RequestState:
        """A request's host state, with ``resume``'s tokens replayed. Raises RequestError."""
        if resume is not None:
            check_resume(resume, params, self.cfg.vocab_size)
        seed = self.draw_seed(params) if resume is None else resume.seed
        seq = Sequence(request_id, [int(t) for t in prompt_ids], params, seed)
        has_text = getattr(self.tokenizer, "has_text", True)  # duck-typed tokenizers have text
        detok = (
            IncrementalDetokenizer(self.tokenizer, seq.prompt_ids, params.skip_special_tokens)
            if has_text
            else None
        )
        req = RequestState(
            seq,
            prompt,
            detok,
            prompt_logprobs=None
            if params.prompt_logprobs is None
            else [None] * params.prompt_logprobs_from,
        )
        if resume is not None:
            lps = resume.logprobs or [None] * len(resume.token_ids)
            for i, (tok, lp) in enumerate(zip(resume.token_ids, lps, strict=True)):
                if (reason := self._advance(req, int(tok), lp)) is not None:
                    raise RequestError(
                        f"the partial output has already finished ({reason!r} at "
                        f"output token {i} of {len(resume.token_ids)})"
                    )
            req.resumed = len(resume.token_ids)
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    # ---------------------------------------------------------------- the step

    def _controls(self, rows, b: int) -> LogitsControls | None:
        return logits_controls(rows, b, self.cfg.vocab_size, self.stop_ids)

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled step; returns the outputs of requests that got new tokens or
        finished (their state so far, with ``delta_text``).

        With async scheduling the next step is dispatched before this one's tokens are read back,
        so a call returns the outputs of the step dispatched by the call before (or by itself,
        when none is in flight) while the next one runs.

        A step that raises (a device error, a host error while building or reading it) fails
        only the requests that caused it; the engine stays usable (``_recover``)."""
        self._culprits = []
        try:
            results = self._run_step()
        except Exception as e:  # noqa: BLE001 - every step failure is recovered from, see _recover
            return self._recover(e)
        if self._isolate:  # an isolated request that sampled a token is innocent
            got = {o.request_id for o in results}
            self._isolate = [
                s
                for s in self._isolate
                if s.status is not SeqStatus.FINISHED and s.request_id not in got
            ]
        return results

    def _schedule(self):
        """The next step's rows: the first sequence to isolate alone, if any, else the usual."""
        only = self._isolate[0] if self._isolate else None
        sched = self.scheduler.schedule(only=only)
        if not sched.rows:
            raise RuntimeError("scheduler produced an empty step while requests are pending")
        self._culprits = [row.seq for row in sched.rows]
        return sched

    def _run_step(self) -> list[RequestOutput]:
        if self._inflight is None:
            self._inflight = self._dispatch(self._schedule(), None)
        done, self._inflight = self._inflight, None
        if (
            self._async
            and not self._isolate
            and self.scheduler.has_work()
            and not any(has_penalties(seq.params) for seq, _ in done.sampled)
        ):
            # Penalties need the output tokens' counts on the host: those rows wait for them.
            sched = self.scheduler.schedule()
            if sched.rows and self._needs_compile(sched):
                return self._collect_then_dispatch(done, sched)
            if sched.rows:
                self._culprits = [row.seq for row in sched.rows]
                self._inflight = self._dispatch(sched, done)
        self._culprits = [seq for seq, _ in done.sampled]
        return self._collect(done)

    def _needs_compile(self, sched) -> bool:
        """Whether dispatching ``sched`` would compile a forward shape not seen yet."""
        return ("forward", self._buckets(sched).key) not in self.compile_keys

    def _buckets(self, sched):
        """The step's buckets: exact, or a compiled key one size up (``bucket_reuse``)."""
        need = exact_buckets(sched, self.ecfg.page_size, self.ecfg.max_pages_per_seq)
        usable = self.compile_keys
        if self._compiler is not None and self._compiler.pending:
            self.compile_keys.difference_update(self._compiler.poll())
            usable = self.compile_keys - self._compiler.pending  # counted, not ready yet
        if (
            ("forward", need.key) in usable
            or not self.ecfg.reuse_compiled_buckets
            or any(r.seq.params.prompt_logprobs is not None for r in sched.prefill)
        ):
            return need
        want_lp = any(r.seq.params.logprobs is not None for r in sched.rows)
        flags = sample_flags(
            (r.seq.params for r in sched.rows),
            any(needs_controls(r.seq) for r in sched.rows),
            min(MAX_LOGPROBS, self.cfg.vocab_size) if want_lp else 0,
        )
        chosen = bucket_reuse.choose_buckets(need, usable, flags)
        if chosen != need and self._wanted.get(need.key, 0) >= bucket_reuse.REUSE_STEPS:
            if self._compiler is None or need.key in self._compiler.failed:
                return need  # compiles inline, as any new shape
            # Padded steps go on meanwhile; the keys count as compiled from now on.
            self.compile_keys.update(self._compiler.submit(need, flags, self.compile_keys))
        return chosen

    def _collect_then_dispatch(self, done: _InFlight, sched) -> list[RequestOutput]:
        """Async scheduling when the next step compiles a new shape: reads the step in flight
        first, so its tokens (a cold run's first token) do not wait for the compile, then
        dispatches the next step without the rows that finished meanwhile."""
        self._culprits = [seq for seq, _ in done.sampled]
        results = self._collect(done)
        sched = dataclasses.replace(
            sched,
            decode=[r for r in sched.decode if r.seq.status is not SeqStatus.FINISHED],
            prefill=[r for r in sched.prefill if r.seq.status is not SeqStatus.FINISHED],
        )
        if sched.rows:
            self._culprits = [row.seq for row in sched.rows]
            try:
                self._inflight = self._dispatch(sched, None)
            except Exception as e:  # noqa: BLE001 - as step(): the collected tokens are kept
                return results + self._recover(e)
        return results

    def _reset_device_state(self) -> None:
        """After a failed step: a fresh KV pool when the failed call had consumed (donated) it."""
        if any(
            getattr(x, "is_deleted", lambda: False)() for x in jax.tree_util.tree_leaves(self.kv)
        ):
            self.kv = self._new_kv_cache()

    def _recover(self, exc: Exception) -> list[RequestOutput]:
        """Fails the requests that caused a failed step and leaves the engine usable.

        Every running sequence is preempted (its KV may be half written, or the pool was donated
        to the failed call); recomputation gives the same output, as sampling keys depend only on
        (seed, output index). A failed step of one request fails that request with the error. A
        failed step of several runs each of them alone, one step at a time, until it samples a
        token (innocent) or fails alone (guilty); a request in ``MAX_STEP_FAILURES`` failed steps
        fails. Returns the outputs of the failed requests (``finish_reason`` "error")."""
        culprits, self._culprits = list(dict.fromkeys(self._culprits)), []
        self._inflight = None
        self.num_step_failures += 1
        self._reset_device_state()
        for seq in reversed(list(self.scheduler.running)):  # newest first: oldest ends up first
            self.scheduler.preempt(seq)
        for seq in self.scheduler.waiting:  # the step in flight is dropped: its tokens with it
            seq.pending.clear()
            seq.pending_final = False
        self.kv_manager.clear_cache()  # pages the failed step was to write are not trusted
        msg = f"step failed: {type(exc).__name__}: {exc}"
        results = []
        for seq in culprits:
            if seq.status is SeqStatus.FINISHED:
                continue
            n = self._failures[seq.request_id] = self._failures.get(seq.request_id, 0) + 1
            if len(culprits) == 1 or n >= MAX_STEP_FAILURES:
                results.append(self.fail_request(seq.request_id, msg))
            elif all(seq is not s for s in self._isolate):
                self._isolate.append(seq)
        self._isolate = [s for s in self._isolate if s.status is not SeqStatus.FINISHED]
        return results

    def fail_request(self, request_id: str, error: str) -> RequestOutput:
        """Ends a queued or running request with ``finish_reason`` "error"; returns its output."""
        req = self._requests[request_id]
        req.error = error
        self.scheduler.finish(req.seq, "error")
        self._failures.pop(request_id, None)
        return self._output(req)

    def abort_request(self, request_id: str) -> None:
        """Drops a request (its consumer went away): its pages are freed, no output is made.
        Unknown or finished ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req.seq, "abort")
            self._failures.pop(request_id, None)
            self._isolate = [s for s in self._isolate if s is not req.seq]

    def _dispatch(self, sched, prev: _InFlight | None) -> _InFlight:
        """Builds and dispatches one step; advances ``num_computed`` and marks each sampled
        token pending. Returns without waiting for the device."""
        bk = self._buckets(sched)
        if self._compiler is not None:  # compiling in the background: wait, not compile twice
            self._compiler.wait_for(bk.key)
        need = exact_buckets(sched, self.ecfg.page_size, self.ecfg.max_pages_per_seq)
        if bk != need:  # padded past an uncompiled key: count it towards compiling it
            self._wanted[need.key] = self._wanted.get(need.key, 0) + 1
        batch, bk = build_step_batch(sched, self.ecfg.page_size, self.ecfg.max_pages_per_seq, bk)
        td, nd = bk.decode_rows, len(sched.decode)
        b = len(batch.logits_indices)
        rows = [(row, row_index(i, nd, td)) for i, row in enumerate(sched.rows)]
        params_rows = [SamplingParams(temperature=0.0)] * b
        seeds, steps = [0] * b, [0] * b
        for row, r in rows:
            params_rows[r] = row.seq.params
            seeds[r] = row.seq.seed
            steps[r] = len(row.seq.output_ids) + len(row.seq.pending)  # index of the token sampled
        st = SamplingTensors.from_params(params_rows, seeds, steps, pad_to=b)
        controls = self._controls(rows, b)
        want_lp = any(row.seq.params.logprobs is not None for row, _ in rows)
        num_lp = min(MAX_LOGPROBS, self.cfg.vocab_size) if want_lp else 0
        self.compile_keys.add(("forward", bk.key))
        flags = sample_flags((row.seq.params for row, _ in rows), controls is not None, num_lp)
        self.compile_keys.add(("sample", b, *flags))
        prev_tokens = prev.next_tokens if prev is not None else self._no_prev
        plan = plp.plan_step(rows, batch.logits_indices, len(batch.tokens))
        if plan is None:
            self.kv, logits = self._forward(
                self.params,
                self.kv,
                batch,
                prev_tokens,
                cfg=self.cfg,
                attn_impl=self.ecfg.attn_impl,
                batch_invariant=self.ecfg.batch_invariant,
            )
        else:
            k = plp.num_top(self.cfg.vocab_size)
            self.compile_keys.add(("forward_prompt_logprobs", bk.key, k))
            fwd = plp.jitted_forward_step_prompt_logprobs(
                None if self.mesh is None else self._forward_out_shardings()
            )
            self.kv, logits, plan_out = fwd(
                self.params,
                self.kv,
                batch,
                prev_tokens,
                plan.targets,
                cfg=self.cfg,
                attn_impl=self.ecfg.attn_impl,
                num_top=k,
            )
        out, next_tokens = self._sample(
            logits,
            st,
            controls,
            num_logprobs=num_lp,
            greedy=flags == GREEDY_FLAGS,
            num_slots=self._num_slots,
            batch_invariant=self.ecfg.batch_invariant,
        )
        sampled = []
        for row, r in rows:
            seq = row.seq
            seq.num_computed += row.num_new
            if seq.num_computed < seq.num_tokens:
                continue  # a prefill chunk that does not reach the end: nothing sampled
            seq.pending.append(-(r + 1))
            n_out = len(seq.output_ids) + len(seq.pending)
            p = seq.params
            if (
                p.max_tokens is not None and n_out >= p.max_tokens
            ) or seq.num_tokens >= self.ecfg.max_model_len:
                seq.pending_final = True  # finishes on this token whatever it is
            sampled.append((seq, r))
        return _InFlight(
            out, next_tokens, sampled, num_lp, None if plan is None else (plan, plan_out)
        )

    def _collect(self, done: _InFlight) -> list[RequestOutput]:
        """Reads a dispatched step's tokens back (waiting for the device) and appends them."""
        out, num_lp = done.out, done.num_logprobs
        tokens = to_host(out.tokens)
        lps = to_host(out.logprobs)
        top_ids, top_lps = (
            (to_host(out.top_ids), to_host(out.top_logprobs)) if num_lp else (None, None)
        )
        if done.prompt_lp is not None:  # before the sampled tokens: outputs hold them complete
            plan, plan_out = done.prompt_lp
            self._culprits += [seq for seq, _, _ in plan.entries]  # mid-prefill rows too
            plp.record(plan, jax.tree.map(to_host, plan_out), self._prompt_logprobs_of)
        now = time.perf_counter()
        self.num_steps += 1
        results = []
        for seq, r in done.sampled:
            if seq.status is SeqStatus.FINISHED:
                continue  # it stopped on an earlier token while this step was in flight
            seq.pending.pop(0)
            lp = None
            if seq.params.logprobs is not None:
                n = seq.params.logprobs
                lp = TokenLogprob(
                    int(tokens[r]),
                    float(lps[r]),
                    [
                        (int(i), float(x))
                        for i, x in zip(top_ids[r, :n], top_lps[r, :n], strict=False)
                    ],
                )
            results.append(self._append(seq, int(tokens[r]), lp, now))
        return results

    def _prompt_logprobs_of(self, request_id: str) -> list | None:
        req = self._requests.get(request_id)
        return None if req is None else req.prompt_logprobs

    def _forward_out_shardings(self):
        from jaxinfer.models.sharding import step_out_shardings

        return step_out_shardings(self.mesh)

    def _append(
        self, seq: Sequence, tok: int, lp: TokenLogprob | None, now: float
    ) -> RequestOutput:
        req = self._requests[seq.request_id]
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        reason = self._advance(req, tok, lp)
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return self._output(req)

    def _advance(self, req: RequestState, tok: int, lp: TokenLogprob | None) -> str | None:
        """``request_output.advance`` with this engine's stop ids and ``max_model_len``; also
        replays a resumed request's partial output (``_new_request``) through the same checks."""
        return advance(req, tok, lp, self.stop_ids, self.ecfg.max_model_len)

    def _output(self, req: RequestState) -> RequestOutput:
        """``request_output.build_output``; a finished request leaves ``_requests``."""
        out = build_output(req)
        if out.finish_reason is not None:
            del self._requests[req.seq.request_id]
        return out
