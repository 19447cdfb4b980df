"""EngineCore: an engine's host side (nano-vllm's ``LLMEngine``, vLLM v1's ``EngineCore``).

Requests in, one step at a time, outputs out. A step reads: schedule (``Scheduler``: which rows
run, chunked prefill, preemption), prepare the host inputs (buckets, chosen once per dispatch by
bucket reuse; the numpy batch, sampling tensors, logits controls), ``ModelRunner.run`` (the
device step, not waited for), postprocess (read the sampled tokens back, append them with the
stop checks: ``jaxinfer.engine.request_output``). With async scheduling the next step is
dispatched before the previous one is read back. With speculative decoding a
``SpeculativeStrategy`` (``jaxinfer.speculative.strategy``) runs a draft-verify-accept round in
place of the dispatch. A step that fails fails only the requests that caused it (``_recover``).
The device side (params, KV pool, jitted functions, compile keys) is ``jaxinfer.engine.runner``;
``LLM`` (``jaxinfer.llm``) is the user-facing API over one or more cores.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

import jaxinfer.engine.prompt_logprobs as plp
from jaxinfer.compile.buckets import BackgroundCompiler, BucketReuse
from jaxinfer.engine.batch import (
    build_step_batch,
    exact_buckets,
    row_index,
    sampling_tensors,
)
from jaxinfer.engine.inflight import InFlightStep, LaunchedStep, ScheduledStep
from jaxinfer.engine.intake import check_request, check_stop_strings, new_request_state, replay
from jaxinfer.engine.kv_manager import make_kv_manager
from jaxinfer.engine.recovery import StepRecovery
from jaxinfer.engine.request_output import RequestState, advance, build_output
from jaxinfer.engine.resume import ResumeState, check_resume
from jaxinfer.engine.runner import Capabilities, ModelRunner, StepInputs
from jaxinfer.engine.scheduler import ScheduleOutput, Scheduler
from jaxinfer.engine.sequence import SeqStatus, Sequence
from jaxinfer.engine.step import LogitsControls
from jaxinfer.engine.step_controls import has_penalties, logits_controls, needs_controls
from jaxinfer.errors import RequestError
from jaxinfer.models.sharding import to_host
from jaxinfer.outputs import RequestOutput, TokenLogprob
from jaxinfer.sampling.sampler import MASKED, MAX_LOGPROBS, SamplingParams, draw_seed, sample_flags
from jaxinfer.sampling.structured import Grammars, GrammarViolation, full_bitmask
from jaxinfer.tokenizers import Tokenizer


def _from_runner(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.runner, name), doc=f"{doc} (``ModelRunner.{name}``)")


class EngineCore:
    """Continuous-batching engine core over one ``ModelRunner`` (module docstring).

    Args:
        runner: the device side (``ModelRunner``; the job plan passes a stub with its API).
        tokenizer: the model's tokenizer (EOS ids, detokenization; ``IdsOnlyTokenizer`` without
            one).
        speculative: a ``SpeculativeStrategy`` whose rounds replace the plain step, or None.
        compiler: bucket reuse's ``BackgroundCompiler``; default one over ``runner`` when the
            runner supports background compiles, else None.
        grammars: the structured-outputs compiler (``structured.Grammars``); default one over
            ``tokenizer`` and the model's vocabulary (its llguidance tokenizer is built on the
            first constrained request).

    The runner's ``ecfg`` is a resolved config (``jaxinfer.engine.config.resolve``: sizes
    checked, backend defaults applied), which the core only reads.

    Raises:
        ValueError: ``batch_invariant`` on an engine that cannot honour it (speculative
            decoding; ``EngineArgs`` refuses the pair before).
    """

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        *,
        speculative=None,
        compiler: BackgroundCompiler | None = None,
        grammars: Grammars | None = None,
    ):
        ecfg, cfg = runner.ecfg, runner.cfg
        self.runner, self.speculative = runner, speculative
        self.cfg, self.tokenizer, self.ecfg = cfg, tokenizer, ecfg
        caps = self.capabilities
        if ecfg.batch_invariant and not caps.batch_invariant:
            raise ValueError("batch_invariant=True is not supported with speculative decoding")
        # What else decides a page's contents besides its tokens (one engine: one model).
        extra = (cfg.model_type, str(np.dtype(runner.kv_dtype)), ecfg.page_size)
        self.kv_manager = make_kv_manager(ecfg, extra)
        self.scheduler = Scheduler(
            self.kv_manager,
            ecfg.max_num_seqs,
            ecfg.max_num_batched_tokens,
            ecfg.max_prefill_seqs,
        )
        self._rng = np.random.default_rng(ecfg.seed)
        self._requests: dict[str, RequestState] = {}
        self.grammars = grammars if grammars is not None else Grammars(tokenizer, cfg.vocab_size)
        if compiler is None and caps.background_compiles:
            compiler = BackgroundCompiler(runner)
        self.buckets = BucketReuse(runner, ecfg.reuse_compiled_buckets, compiler)
        # Whether a step is dispatched before the previous one's tokens are read back.
        self.async_scheduling = ecfg.async_scheduling and caps.async_scheduling
        self._inflight: InFlightStep | None = None
        self.recovery = StepRecovery()  # step-failure recovery (``step``, ``_recover``)
        self.num_steps = 0
        self.stop_ids = set(tokenizer.eos_ids)
        if cfg.model_type == "llama2c" and tokenizer.bos_id is not None:
            # llama2.c's run.c ends a sample when the model emits BOS (the start of a new story).
            self.stop_ids.add(tokenizer.bos_id)

    # ---------------------------------------------------------------- the runner's side

    @property
    def capabilities(self) -> Capabilities:
        """What this engine supports: its runner's, and its speculative strategy's."""
        caps = self.runner.capabilities
        return caps if self.speculative is None else caps & self.speculative.capabilities

    # The runner's public state, read through the core (``ModelRunner``'s attributes).
    params = _from_runner("params", "the params in the runner's layout")
    mesh = _from_runner("mesh", "the jax.sharding.Mesh of the params (None: one device)")
    kv = _from_runner("kv", "the KV page pool")
    kv_page_major = _from_runner("kv_page_major", "the pool's layout")
    attn_impl = _from_runner("attn_impl", "the attention implementation ('auto' resolved)")
    attn_impl_reason = _from_runner("attn_impl_reason", "why that implementation")
    compile_keys = _from_runner("compile_keys", "the compile keys met so far")

    @property
    def num_step_failures(self) -> int:
        """Steps that failed so far (each recovered from: ``step``)."""
        return self.recovery.num_step_failures

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

    def _prompt_logprobs_refused_by(self) -> str | None:
        """What keeps this engine from computing prompt logprobs, or None."""
        if self.capabilities.prompt_logprobs:
            return None
        return "batch_invariant=True" if self.ecfg.batch_invariant else "speculative decoding"

    # ---------------------------------------------------------------- requests

    def validate(
        self, prompt_ids: list[int], params: SamplingParams, resume: ResumeState | None = None
    ) -> None:
        """Raises RequestError when a request cannot run (or cannot resume from ``resume``: see
        ``add_request``)."""
        check_request(
            prompt_ids,
            params,
            vocab_size=self.cfg.vocab_size,
            max_model_len=self.ecfg.max_model_len,
            tokenizer=self.tokenizer,
            prompt_logprobs_refused_by=self._prompt_logprobs_refused_by(),
            check_grammar=self.grammars.check,
            structured_refused_by=None if self.speculative is None else "speculative decoding",
        )
        if resume is not None:
            self.validate_resume(prompt_ids, params, resume)

    def validate_resume(
        self, prompt_ids: list[int], params: SamplingParams, resume: ResumeState
    ) -> None:
        """The part of ``validate`` that concerns ``resume`` alone, for a request already
        validated: raises RequestError when it cannot continue from ``resume`` (``check_resume``,
        or a partial output that has already finished or outgrows ``max_model_len``)."""
        self._new_request("validate", prompt_ids, params, None, resume)

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
        check_stop_strings(params, self.tokenizer)
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
        req = new_request_state(request_id, prompt_ids, params, prompt, seed, self.tokenizer)
        if params.structured_outputs is not None:
            req.grammar = self.grammars.matcher(params.structured_outputs)
        if resume is not None:
            replay(req, resume, self._advance)
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
        self.recovery.culprits = []
        try:
            results = self._run_step()
        except Exception as e:  # noqa: BLE001 - every step failure is recovered from, see _recover
            return self._recover(e)
        self.recovery.cleared({o.request_id for o in results})
        return results

    def _schedule(self) -> ScheduleOutput:
        """The next step's rows: the first sequence to isolate alone, if any, else the usual."""
        sched = self.scheduler.schedule(only=self.recovery.only())
        if not sched.rows:
            raise RuntimeError("scheduler produced an empty step while requests are pending")
        self.recovery.culprits = [row.seq for row in sched.rows]
        return sched

    def _run_step(self) -> list[RequestOutput]:
        """Schedule, dispatch (``ModelRunner.run``), postprocess (``_collect``)."""
        if self.speculative is not None:
            return self._speculative_step()
        if self._inflight is None:
            self._inflight = self._dispatch(self._prepare(self._schedule()), None)
        done, self._inflight = self._inflight, None
        if (
            self.async_scheduling
            and not self.recovery.isolate
            and self.scheduler.has_work()
            and not any(has_penalties(seq.params) for seq, _ in done.sampled)
        ):
            # Penalties need the output tokens' counts on the host: those rows wait for them.
            sched = self.scheduler.schedule()
            if sched.rows:
                nxt = self._prepare(sched)
                if nxt.forward_key not in self.compile_keys:  # a new shape compiles
                    return self._collect_then_dispatch(done, nxt)
                self.recovery.culprits = [row.seq for row in sched.rows]
                if nxt.flags[-1] == MASKED:  # masks need the tokens of the step in flight
                    return self._launch_collect_sample(done, nxt)
                self._inflight = self._dispatch(nxt, done)
        self.recovery.culprits = [seq for seq, _ in done.sampled]
        return self._collect(done)

    def _prepare(self, sched: ScheduleOutput) -> ScheduledStep:
        """The step's buckets (exact, or a compiled key one size up: ``BucketReuse``) and its
        sampling variant."""
        rows = sched.rows
        need = exact_buckets(sched, self.ecfg.page_size, self.ecfg.max_pages_per_seq)
        want_lp = any(r.seq.params.logprobs is not None for r in rows)
        flags = sample_flags(
            (r.seq.params for r in rows),
            any(needs_controls(r.seq) for r in rows),
            min(MAX_LOGPROBS, self.cfg.vocab_size) if want_lp else 0,
            masked=any(r.seq.params.structured_outputs is not None for r in rows),
        )
        want_plp = any(r.seq.params.prompt_logprobs is not None for r in sched.prefill)
        bk = self.buckets.choose(need, flags, exact=want_plp)
        return ScheduledStep(sched, need, bk, flags, self.runner.step_keys(bk, flags, want_plp)[0])

    def _collect_then_dispatch(self, done: InFlightStep, nxt: ScheduledStep) -> list[RequestOutput]:
        """Async scheduling when the next step compiles a new shape: reads the step in flight
        first, so its tokens (a cold run's first token) do not wait for the compile, then
        dispatches the next step without the rows that finished meanwhile."""
        self.recovery.culprits = [seq for seq, _ in done.sampled]
        results = self._collect(done)
        sched = nxt.sched
        live = dataclasses.replace(
            sched,
            decode=[r for r in sched.decode if r.seq.status is not SeqStatus.FINISHED],
            prefill=[r for r in sched.prefill if r.seq.status is not SeqStatus.FINISHED],
        )
        if live.rows:
            self.recovery.culprits = [row.seq for row in live.rows]
            try:
                if len(live.rows) != len(sched.rows):  # rows left: buckets and flags anew
                    nxt = self._prepare(live)
                self._inflight = self._dispatch(nxt, None)
            except Exception as e:  # noqa: BLE001 - as step(): the collected tokens are kept
                return results + self._recover(e)
        return results

    def _launch_collect_sample(self, done: InFlightStep, nxt: ScheduledStep) -> list[RequestOutput]:
        """Async scheduling when the next step has constrained rows (structured outputs): their
        masks depend on the tokens of the step in flight. Dispatches the next step's forward
        (it reads those tokens on device), reads the step in flight back while the forward runs
        (advancing each grammar), computes the masks, then dispatches the sampling."""
        launched = self._launch(nxt, done)
        self.recovery.culprits = [seq for seq, _ in done.sampled]
        results = self._collect(done)
        self.recovery.culprits = [row.seq for row in nxt.sched.rows]
        try:
            self._inflight = self._sample(launched)
        except Exception as e:  # noqa: BLE001 - as step(): the collected tokens are kept
            return results + self._recover(e)
        return results

    def _dispatch(self, step: ScheduledStep, prev: InFlightStep | None) -> InFlightStep:
        """Builds the step's host inputs and dispatches them (``_launch``, then ``_sample``).
        Returns without waiting for the device."""
        return self._sample(self._launch(step, prev))

    def _launch(self, step: ScheduledStep, prev: InFlightStep | None) -> LaunchedStep:
        """Builds the step's host inputs and dispatches them: a constrained step its forward only
        (``ModelRunner.run_forward``), another the whole step (``ModelRunner.run``); advances
        ``num_computed`` and marks each sampled token pending."""
        sched, bk = step.sched, step.buckets
        self.buckets.dispatching(step.need, bk)
        batch, bk = build_step_batch(sched, self.ecfg.page_size, self.ecfg.max_pages_per_seq, bk)
        td, nd = bk.decode_rows, len(sched.decode)
        b = len(batch.logits_indices)
        rows = [(row, row_index(i, nd, td)) for i, row in enumerate(sched.rows)]
        plan = plp.plan_step(rows, batch.logits_indices, len(batch.tokens))
        inputs = StepInputs(
            batch,
            bk,
            sampling_tensors(rows, b),
            self._controls(rows, b),
            step.flags,
            None if plan is None else plan.targets,
        )
        prev_tokens = None if prev is None else prev.out.next_tokens
        if step.flags[-1] == MASKED:
            fwd, out = self.runner.run_forward(inputs, prev_tokens), None
        else:
            fwd, out = None, self.runner.run(inputs, prev_tokens)
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
        return LaunchedStep(fwd, out, sampled, step.flags[1], plan)

    def _sample(self, launched: LaunchedStep) -> InFlightStep:
        """Dispatches a launched step's sampling (``ModelRunner.run_sample``), with the token
        bitmask of its constrained rows when its flags end in ``MASKED``: each such row's
        grammar has accepted every token before the one sampled now (all read back)."""
        out, fwd = launched.out, launched.fwd
        if out is None:
            b = len(fwd.inputs.batch.logits_indices)
            bitmask = full_bitmask(b, self.cfg.vocab_size)
            rows = []
            for seq, r in launched.sampled:
                req = self._requests.get(seq.request_id)
                if seq.status is SeqStatus.FINISHED or req is None or req.grammar is None:
                    continue  # finished meanwhile: its token is dropped
                if len(seq.pending) != 1:
                    raise RuntimeError(
                        f"structured outputs: request {seq.request_id} has {len(seq.pending)} "
                        "tokens pending; its mask would be stale"
                    )
                rows.append((req.grammar, r))
            self.grammars.fill_bitmask(rows, bitmask)
            out = self.runner.run_sample(fwd, bitmask)
        return InFlightStep(out, launched.sampled, launched.num_logprobs, launched.prompt_lp)

    def _collect(self, done: InFlightStep) -> list[RequestOutput]:
        """Reads a dispatched step's tokens back (waiting for the device) and appends them."""
        out, num_lp = done.out.sampled, done.num_logprobs
        tokens = to_host(out.tokens)
        lps = to_host(out.logprobs)
        top_ids, top_lps = (
            (to_host(out.top_ids), to_host(out.top_logprobs)) if num_lp else (None, None)
        )
        if done.prompt_lp is not None:  # before the sampled tokens: outputs hold them complete
            plan = done.prompt_lp
            self.recovery.culprits += [seq for seq, _, _ in plan.entries]  # mid-prefill rows too
            host = jax.tree.map(to_host, done.out.prompt_logprobs)
            plp.record(plan, host, self._prompt_logprobs_of)
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

    def _speculative_step(self) -> list[RequestOutput]:
        """One speculative round (``SpeculativeStrategy.run_round``) over the scheduled rows;
        each row's emitted tokens are appended one by one with the usual stop checks (a request
        may appear once per emitted token, each with its ``delta_text``)."""
        rows = self.speculative.run_round(self._schedule(), self.kv_manager, self._controls)
        now = time.perf_counter()
        self.num_steps += 1
        results = []
        for row in rows:
            for tok, lp in zip(row.tokens, row.logprobs, strict=True):
                out = self._append(row.seq, tok, lp, now)
                self.speculative.fill_metrics(out)
                results.append(out)
                if row.seq.finish_reason is not None:
                    self.speculative.forget(row.seq.request_id)
                    break
        return results

    def _recover(self, exc: Exception) -> list[RequestOutput]:
        """Fails the requests that caused a failed step and leaves the engine usable
        (``jaxinfer.engine.recovery``): every running sequence is preempted, the device state a
        failed call consumed is rebuilt, the step in flight is dropped with its tokens. Returns
        the outputs of the failed requests (``finish_reason`` "error")."""
        self._inflight = None
        self.runner.reset_after_failure()
        if self.speculative is not None:
            self.speculative.reset_after_failure()
        for seq in reversed(list(self.scheduler.running)):  # newest first: oldest ends up first
            self.scheduler.preempt(seq)
        for seq in self.scheduler.waiting:  # the step in flight is dropped: its tokens with it
            seq.pending.clear()
            seq.pending_final = False
        self.kv_manager.clear_cache()  # pages the failed step was to write are not trusted
        msg = f"step failed: {type(exc).__name__}: {exc}"
        results = [self.fail_request(seq.request_id, msg) for seq in self.recovery.blame()]
        self.recovery.cleared(set())  # the failed ones leave the isolated
        return results

    def fail_request(self, request_id: str, error: str) -> RequestOutput:
        """Ends a queued or running request with ``finish_reason`` "error"; returns its output."""
        req = self._requests[request_id]
        req.error = error
        self.scheduler.finish(req.seq, "error")
        self.recovery.forget(request_id)
        return self._output(req)

    def abort_request(self, request_id: str) -> None:
        """Drops a request (its consumer went away): its pages are freed, no output is made.
        Unknown or finished ids are ignored."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req.seq, "abort")
            self.recovery.forget(request_id)

    def _prompt_logprobs_of(self, request_id: str) -> list | None:
        req = self._requests.get(request_id)
        return None if req is None else req.prompt_logprobs

    def _append(
        self, seq: Sequence, tok: int, lp: TokenLogprob | None, now: float
    ) -> RequestOutput:
        req = self._requests[seq.request_id]
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        try:
            reason = self._advance(req, tok, lp)
        except GrammarViolation as e:  # a bug, never the model's choice: fail loudly
            return self.fail_request(seq.request_id, str(e))
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
