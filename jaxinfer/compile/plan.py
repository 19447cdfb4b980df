"""Predicting a whole job's compile keys before it runs (issue 21's cold start).

A ``jaxinfer generate`` job knows its whole workload up front: every prompt's token ids and
``max_tokens``. ``plan_job`` runs that workload through a real ``EngineCore`` (the real
``Scheduler``, ``exact_buckets`` / ``build_step_batch``, bucket reuse's ``choose_buckets`` and
``REUSE_STEPS`` counting, async scheduling's collect-before-a-new-shape) over a stub runner
(``PlanRunner``: the ``ModelRunner`` API without a model) that counts each step's compile keys
and "samples" a token no request stops on, so each output runs to its ``max_tokens`` (or
``max_model_len``). The compile keys it records, in the order the real engine would count them
(``ModelRunner.compile_keys``), are the prediction: equal to a real run's when no output stops
early (EOS, stop ids or strings), and a superset of the keys such a run needs up to the shapes
its shorter tail skips.

What the prediction assumes: one engine (no data parallelism), no speculative decoding, no prompt
logprobs (planned as without them), and the engine's configuration as given (``EngineConfig``:
limits, pool size, prefix caching, bucket reuse, async scheduling). Background compiles that bucket
reuse starts count when submitted, as in the engine, and are ready by the next step (the stub's
compiler runs inline); their finishing time does not change the key set (a padded step only ever
uses a key already compiled).

Use (``start_job``): the progress line's "compiling (k/n)" (n = the number of predicted keys,
``jaxinfer.compile.progress``).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Sequence

import numpy as np

from jaxinfer.compile.buckets import BackgroundCompiler
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.core import EngineCore
from jaxinfer.engine.resume import ResumeState
from jaxinfer.engine.runner import Capabilities, Forwarded, StepInputs, StepOutput, step_keys
from jaxinfer.outputs import TokenLogprob
from jaxinfer.sampling.sampler import SampleOutput, SamplingParams

Key = tuple
"""A compile key as in ``ModelRunner.compile_keys``."""


class _OrderedKeys(set):
    """A set that also records the order in which keys first entered it."""

    def __init__(self):
        super().__init__()
        self.order: list[Key] = []

    def add(self, key) -> None:
        if key not in self:
            self.order.append(key)
        super().add(key)

    def update(self, *others) -> None:
        for keys in others:
            for key in keys:
                self.add(key)


class PlanRunner:
    """The ``ModelRunner`` API without a model, for ``EngineCore`` to plan a job over: ``run``
    counts the step's compile keys (``first_step``: the index of the step that first counted
    each) and returns ``token`` for every sampled row; ``compile`` compiles nothing.

    Args:
        ecfg: the engine's configuration (as the real runner resolved it).
        vocab_size: the model's vocabulary size (logprob counts, prompt-logprob keys).
        token: the token every step "samples" (one no request stops on).
    """

    capabilities = Capabilities()  # a one-device plain engine's: what the plan models

    def __init__(self, ecfg: EngineConfig, vocab_size: int, token: int):
        self.ecfg, self.token = ecfg, token
        self.cfg = types.SimpleNamespace(vocab_size=vocab_size, model_type="plan")
        self.params = self.mesh = self.kv = None
        self.kv_dtype, self.kv_page_major = np.float32, False
        self.attn_impl, self.attn_impl_reason = ecfg.attn_impl, "job plan: no model runs"
        self.compile_keys = _OrderedKeys()
        self.first_step: dict[Key, int] = {}  # key -> index of the step that first counted it
        self.num_runs = 0

    def step_keys(self, buckets, flags: tuple, prompt_logprobs: bool = False) -> list[Key]:
        from jaxinfer.engine.prompt_logprobs import num_top

        return step_keys(buckets, flags, num_top(self.cfg.vocab_size) if prompt_logprobs else 0)

    def run(self, inputs: StepInputs, prev_tokens=None, bitmask=None) -> StepOutput:
        return self.run_sample(self.run_forward(inputs, prev_tokens), bitmask)

    def run_forward(self, inputs: StepInputs, prev_tokens=None) -> Forwarded:
        self.compile_keys.update(
            self.step_keys(inputs.buckets, inputs.flags, inputs.prompt_targets is not None)
        )
        for k in self.compile_keys.order[len(self.first_step) :]:  # background ones too
            self.first_step[k] = self.num_runs
        self.num_runs += 1
        return Forwarded(inputs, None)

    def run_sample(self, fwd: Forwarded, bitmask=None) -> StepOutput:
        inputs = fwd.inputs
        b, n = len(inputs.batch.logits_indices), inputs.flags[1]
        out = SampleOutput(
            tokens=np.full(b, self.token, np.int32),
            logprobs=np.zeros(b, np.float32),
            top_ids=np.zeros((b, n), np.int32),
            top_logprobs=np.zeros((b, n), np.float32),
        )
        return StepOutput(out, None)

    def compile(self, key: Key) -> None:
        pass

    def reset_after_failure(self) -> None:
        pass


_PLAN_TOKENIZER = types.SimpleNamespace(has_text=False, eos_ids=(), bos_id=None, path="<job plan>")


class _AnyToken:
    """A grammar state that accepts every token and never completes (a planned constrained
    request runs to its ``max_tokens``, as the plan's other requests)."""

    done = False

    def accept(self, token: int) -> None:
        pass


class _PlanGrammars:
    """``structured.Grammars``'s API for the plan: constrained requests take the masked
    sampling keys, but no grammar is compiled and every mask allows everything."""

    def check(self, so) -> None:
        pass

    def matcher(self, so) -> _AnyToken:
        return _AnyToken()

    def fill_bitmask(self, rows, bitmask) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """What ``plan_job`` predicts.

    Attributes:
        keys: the distinct compile keys in order of first use (kinds of
            ``ModelRunner.compile_keys``).
        first_step: for each key of ``keys``, the index of the step that first counts it.
        steps: steps the job takes.
    """

    keys: tuple[Key, ...]
    first_step: tuple[int, ...]
    steps: int

    @property
    def forward_keys(self) -> list[tuple[int, int, int, int]]:
        """The forward bucket tuples (Td, Tp, Bp, M), in order of first use."""
        return [k[1] for k in self.keys if k[0] == "forward"]


def plan_job(
    ecfg: EngineConfig,
    prompt_lens: Sequence[int],
    max_tokens: int | None | Sequence[int | None],
    *,
    vocab_size: int,
    params: SamplingParams | Sequence[SamplingParams] | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    output_so_far: Sequence[int] | None = None,
    max_steps: int = 1_000_000,
) -> JobPlan:
    """Runs the job's requests through an ``EngineCore`` over a ``PlanRunner`` (module
    docstring) and returns the compile keys it meets.

    Args:
        ecfg: the engine's configuration (``EngineCore.ecfg``, with its resolved ``num_pages``).
        prompt_lens: each request's prompt length, tokens (>= 1, < ``max_model_len``).
        max_tokens: each request's ``max_tokens`` (None: up to ``max_model_len``), or one for all.
        vocab_size: the model's vocabulary size (the fake sampled token and logprob counts).
        params: sampling parameters of each request (or one for all; default greedy): their
            logits controls, logprobs and penalties choose the sampling keys and async
            scheduling's path; their ``max_tokens``, stop conditions and prompt logprobs are
            replaced (outputs run to ``max_tokens``).
        prompt_ids: each request's prompt token ids (prefix-cache hits as in the real run);
            default: distinct random ids of ``prompt_lens`` tokens (no hits).
        output_so_far: output tokens each request already has (a resumed request), default 0.
        max_steps: a bound on the simulated steps (a safety net; raises past it).

    Returns:
        ``JobPlan``.

    Raises:
        ValueError: lengths that do not match ``prompt_lens``, a prompt length outside
            [1, max_model_len), or a job longer than ``max_steps`` steps.
        RequestError: a request the engine refuses (``EngineCore.add_request``).
        RuntimeError: a step of the plan failed (a request ended with an error).
    """
    n = len(prompt_lens)
    per = lambda x, name: list(x) if isinstance(x, Sequence) else [x] * n  # noqa: E731
    maxes = per(max_tokens, "max_tokens")
    plist = per(params if params is not None else SamplingParams(temperature=0.0), "params")
    done = per(output_so_far if output_so_far is not None else 0, "output_so_far")
    for name, xs in (
        ("max_tokens", maxes),
        ("params", plist),
        ("output_so_far", done),
        ("prompt_ids", prompt_ids if prompt_ids is not None else prompt_lens),
    ):
        if len(xs) != n:
            raise ValueError(f"plan_job: {len(xs)} {name} for {n} prompts")
    bad = [i for i, t in enumerate(prompt_lens) if not 1 <= t < ecfg.max_model_len]
    if bad:
        raise ValueError(
            f"plan_job: prompt {bad[0]} has {prompt_lens[bad[0]]} tokens; expected "
            f"1 to max_model_len - 1 = {ecfg.max_model_len - 1}"
        )
    banned = {t for p in plist for t in p.stop_token_ids}
    token = next(t for t in range(vocab_size) if t not in banned)
    runner = PlanRunner(ecfg, vocab_size, token)
    eng = EngineCore(
        runner,
        _PLAN_TOKENIZER,
        compiler=BackgroundCompiler(runner, inline=True),
        grammars=_PlanGrammars(),
    )
    rng = np.random.default_rng(0)
    for i in range(n):
        ids = (
            list(prompt_ids[i])
            if prompt_ids is not None
            else rng.integers(0, vocab_size, prompt_lens[i]).tolist()
        )
        p = dataclasses.replace(
            plist[i], max_tokens=maxes[i], stop=(), ignore_eos=True, prompt_logprobs=None, n=1
        )
        resume = None
        if done[i]:  # a resumed request: its output so far replayed as the engine does
            lps = None if p.logprobs is None else (TokenLogprob(token, 0.0, []),) * done[i]
            resume = ResumeState(0, (token,) * done[i], lps)
        eng.add_request(str(i), ids, p, resume=resume)
    while eng.has_unfinished():
        if eng.num_steps >= max_steps:
            raise ValueError(f"plan_job: the job takes more than max_steps={max_steps} steps")
        failed = [o for o in eng.step() if o.error is not None]
        if failed:
            raise RuntimeError(f"plan_job: request {failed[0].request_id}: {failed[0].error}")
    keys = tuple(runner.compile_keys.order)
    return JobPlan(keys, tuple(runner.first_step[k] for k in keys), eng.num_steps)


def plan_keys(
    ecfg: EngineConfig,
    prompt_lens: Sequence[int],
    max_tokens: int | None | Sequence[int | None],
    **kwargs,
) -> list[Key]:
    """The distinct compile keys (forward and sampling) of the job, in order of first use:
    ``plan_job(...).keys`` (same arguments)."""
    return list(plan_job(ecfg, prompt_lens, max_tokens, **kwargs).keys)


def start_job(
    llm,
    prompt_ids: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    resume: Sequence | None = None,
    bar=None,
    background: bool = False,
) -> JobPlan | None:
    """At the start of a generate job on ``llm``: predicts its compile keys (``plan_job``, each
    output to its ``max_tokens``) and gives their number to ``bar``
    (``CompileProgressBar.expect``).

    With ``background`` it does that on a daemon thread and returns None at once: the plan (a
    host loop over the whole job, ~0.1-0.6 s for 64 prompts) then overlaps the first step's
    compile, which releases the GIL. A plan that raises is reported as a RuntimeWarning and the
    job goes on without it (the line shows "compiling (k)").

    Returns the plan, or None where it does not apply (several engines, an engine whose steps are
    not plain ones: ``capabilities.precompile`` False, as speculative decoding; n > 1 or
    prompt-logprob requests, a request that would fail validation): nothing is shown then.
    """
    if background:
        import threading

        threading.Thread(
            target=start_job,
            args=(llm, prompt_ids, params, resume, bar),
            daemon=True,
            name="jaxinfer-job-plan",
        ).start()
        return None
    try:
        return _start_job(llm, prompt_ids, params, resume, bar)
    except Exception as e:  # noqa: BLE001 - the plan only informs; the job itself goes on
        import warnings

        warnings.warn(
            f"jaxinfer: could not plan the job's compilations ({type(e).__name__}: "
            f"{e}); the progress line shows no total",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def _start_job(llm, prompt_ids, params, resume, bar) -> JobPlan | None:
    engines = list(llm.engines)
    if len(engines) != 1 or not engines[0].capabilities.precompile or not prompt_ids:
        return None
    eng = engines[0]
    if any(p.n != 1 or p.prompt_logprobs is not None for p in params):
        return None
    ecfg = eng.ecfg
    done = [
        len(getattr(r, "token_ids", ()) or ()) if r is not None else 0
        for r in (resume or [None] * len(prompt_ids))
    ]
    rows = [
        (ids, p, d)
        for ids, p, d in zip(prompt_ids, params, done, strict=True)
        if 1 <= len(ids) < ecfg.max_model_len and (p.max_tokens is None or d < p.max_tokens)
    ]
    if len(rows) != len(prompt_ids):
        return None
    plan = plan_job(
        ecfg,
        [len(ids) for ids, _, _ in rows],
        [p.max_tokens for _, p, _ in rows],
        vocab_size=eng.cfg.vocab_size,
        params=[p for _, p, _ in rows],
        prompt_ids=[ids for ids, _, _ in rows],
        output_so_far=[d for _, _, d in rows],
    )
    if bar is not None and hasattr(bar, "expect"):
        bar.expect(len(plan.keys))
    return plan
