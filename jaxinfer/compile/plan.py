"""Predicting a whole job's compile keys before it runs (issue 21's cold start).

A ``jaxinfer generate`` job knows its whole workload up front: every prompt's token ids and
``max_tokens``. ``plan_keys`` runs that workload through the engine's own host-side step loop
(``Engine._run_step``: the real ``Scheduler``, ``exact_buckets`` / ``build_step_batch``, bucket
reuse's ``choose_buckets`` and ``REUSE_STEPS`` counting, async scheduling's collect-before-a-new-
shape) with the device functions replaced by stubs that "sample" a token no request stops on, so
each output runs to its ``max_tokens`` (or ``max_model_len``). The compile keys that loop records,
in the order the real engine would count them (``Engine.compile_keys``), are the prediction: equal
to a real run's when no output stops early (EOS, stop ids or strings), and a superset of the keys
such a run needs up to the shapes its shorter tail skips.

What the prediction assumes: one engine (no data parallelism), no speculative decoding, no prompt
logprobs (planned as without them), and the engine's configuration as given (``EngineConfig``:
limits, pool size, prefix caching, bucket reuse, async scheduling). Background compiles that bucket
reuse starts count when submitted, as in the engine; their finishing time does not change the key
set (a padded step only ever uses a key already compiled).

Uses (``start_job``): the progress line's "compiling (k/n)" (n = the number of predicted keys,
``compile_progress``), and compiling the predicted forward keys ahead of use on bucket reuse's
background thread (``BackgroundCompiler.submit_ahead``), in the order of first use, skipping the
first (the first step compiles it inline meanwhile).
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Sequence

import numpy as np

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.core import Engine
from jaxinfer.engine.kv_manager import make_kv_manager
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.sampling.sampler import SamplingParams

Key = tuple
"""A compile key as in ``Engine.compile_keys``."""

COMPILE_AHEAD_ENV = "JAXINFER_COMPILE_AHEAD"
"""Environment variable: "1" compiles a generate job's predicted keys in the background, "0"
(the default) does not; see ``compile_ahead_enabled``."""


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


class _PlanCompiler:
    """Bucket reuse's background compiler as the plan sees it: a submitted key is counted at
    once (as ``BackgroundCompiler.submit`` returns it) and ready by the next step."""

    def __init__(self):
        self.pending: set = set()
        self.failed: dict = {}

    def submit(self, need, flags, compiled) -> list:
        from jaxinfer.compile.warmup import sample_rows

        b = sample_rows(need.decode_rows, need.prefill_rows)
        return [k for k in (("forward", need.key), ("sample", b, *flags)) if k not in compiled]

    def poll(self) -> list:
        return []

    def wait_for(self, key) -> None:
        pass


class _PlanEngine(Engine):
    """``Engine``'s host step loop over stub device functions (no model, no KV pool)."""

    def __init__(self, ecfg: EngineConfig, vocab_size: int, token: int):
        # The attributes Engine.__init__ sets that the step loop reads (tests/test_job_plan.py
        # checks the plan against real engine runs, so a drift here shows there).
        self.cfg = types.SimpleNamespace(vocab_size=vocab_size, model_type="plan")
        self.ecfg, self.mesh, self.params, self.kv = ecfg, None, None, None
        self.tokenizer = types.SimpleNamespace(
            has_text=False, eos_ids=(), bos_id=None, path="<job plan>"
        )
        self.kv_manager = make_kv_manager(ecfg, ("plan",))
        self.scheduler = Scheduler(
            self.kv_manager,
            ecfg.max_num_seqs,
            ecfg.max_num_batched_tokens,
            ecfg.max_prefill_seqs,
        )
        self._rng = np.random.default_rng(0)
        self._requests = {}
        self._num_slots = 1
        self._no_prev = None
        self._async = ecfg.async_scheduling is not False
        self._inflight = None
        self._culprits, self._isolate, self._failures = [], [], {}
        self.num_step_failures = 0
        self.compile_keys = _OrderedKeys()
        self._wanted = {}
        self._compiler = _PlanCompiler()
        self.num_steps = 0
        self.stop_ids = set()  # outputs run to max_tokens: no EOS
        self._token = token

        def forward(params, kv, batch, prev, **_):
            return None, len(batch.logits_indices)  # "logits": the sampled rows B'

        def sample(b, st, controls, num_logprobs, **_):
            out = types.SimpleNamespace(
                tokens=np.full(b, token, np.int32),
                logprobs=np.zeros(b, np.float32),
                top_ids=np.zeros((b, num_logprobs), np.int32),
                top_logprobs=np.zeros((b, num_logprobs), np.float32),
            )
            return out, None

        self._forward, self._sample = forward, sample
        self.first_step: dict[Key, int] = {}  # key -> index of the step that first counted it

    def _output(self, req):
        """What Engine._output does to the engine's state (a finished request leaves
        ``_requests``), without building the output the plan does not read."""
        if req.seq.finish_reason is not None:
            del self._requests[req.seq.request_id]

    def _dispatch(self, sched, prev):
        out = _ENGINE_DISPATCH(self, sched, prev)
        step = self.num_dispatched = getattr(self, "num_dispatched", 0) + 1
        for k in self.compile_keys.order[len(self.first_step) :]:
            self.first_step[k] = step - 1
        return out


# Engine's methods as they are when this module is imported (``jaxinfer.cli.main`` imports it at
# once): a later class-level wrap of an Engine method (a test's spy, scripts/profile_compile.py's
# timers) must not see the plan's stub steps.
_ENGINE_DISPATCH = Engine._dispatch
for _name, _fn in vars(Engine).items():
    if callable(_fn) and not _name.startswith("__") and _name not in vars(_PlanEngine):
        setattr(_PlanEngine, _name, _fn)


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """What ``plan_job`` predicts.

    Attributes:
        keys: the distinct compile keys in order of first use (``Engine.compile_keys``'s kinds).
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
    """Runs the job's requests through ``Engine``'s host step loop (module docstring) and returns
    the compile keys it meets.

    Args:
        ecfg: the engine's configuration (``Engine.ecfg``, with its resolved ``num_pages``).
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
    eng = _PlanEngine(ecfg, vocab_size, token)
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
        eng.add_request(str(i), ids, p, resume=None)
        seq = eng._requests[str(i)].seq
        seq.output_ids.extend([token] * done[i])
    while eng.has_unfinished():
        if eng.num_steps >= max_steps:
            raise ValueError(f"plan_job: the job takes more than max_steps={max_steps} steps")
        eng._culprits = []
        eng._run_step()  # errors propagate: the loop is the engine's own
    keys = tuple(eng.compile_keys.order)
    return JobPlan(keys, tuple(eng.first_step[k] for k in keys), eng.num_steps)


def plan_keys(
    ecfg: EngineConfig,
    prompt_lens: Sequence[int],
    max_tokens: int | None | Sequence[int | None],
    **kwargs,
) -> list[Key]:
    """The distinct compile keys (forward and sampling) of the job, in order of first use:
    ``plan_job(...).keys`` (same arguments)."""
    return list(plan_job(ecfg, prompt_lens, max_tokens, **kwargs).keys)


def compile_ahead_enabled() -> bool:
    """Whether ``start_job`` compiles the predicted keys in the background: environment variable
    ``JAXINFER_COMPILE_AHEAD`` "1" (on) or "0"/unset (off; see docs/performance_cold_start.md
    for why off is the default on a 2-core CPU). Raises ValueError for another value."""
    v = os.environ.get(COMPILE_AHEAD_ENV, "0")
    if v not in ("0", "1"):
        raise ValueError(f"{COMPILE_AHEAD_ENV} must be 0 or 1, got {v!r}")
    return v == "1"


def start_job(
    llm,
    prompt_ids: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    resume: Sequence | None = None,
    bar=None,
    compile_ahead: bool | None = None,
    background: bool = False,
) -> JobPlan | None:
    """At the start of a generate job on ``llm``: predicts its compile keys (``plan_job``, each
    output to its ``max_tokens``), gives their number to ``bar`` (``CompileProgressBar.expect``),
    and with ``compile_ahead`` (default ``compile_ahead_enabled()``) submits the predicted
    forward keys after the first to the engine's background compiler, in order of first use.

    With ``background`` it does that on a daemon thread and returns None at once: the plan (a
    host loop over the whole job, ~0.1-0.6 s for 64 prompts) then overlaps the first step's
    compile, which releases the GIL. A plan that raises is reported as a RuntimeWarning and the
    job goes on without it (the line shows "compiling (k)").

    Returns the plan, or None where it does not apply (several engines, a speculative engine,
    n > 1 or prompt-logprob requests, a request that would fail validation): nothing is shown
    or compiled then.
    """
    if background:
        import threading

        threading.Thread(
            target=start_job,
            args=(llm, prompt_ids, params, resume, bar, compile_ahead),
            daemon=True,
            name="jaxinfer-job-plan",
        ).start()
        return None
    try:
        return _start_job(llm, prompt_ids, params, resume, bar, compile_ahead)
    except Exception as e:  # noqa: BLE001 - the plan only informs; the job itself goes on
        import warnings

        warnings.warn(
            f"jaxinfer: could not plan the job's compilations ({type(e).__name__}: "
            f"{e}); the progress line shows no total",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def _start_job(llm, prompt_ids, params, resume, bar, compile_ahead) -> JobPlan | None:
    engines = list(getattr(llm, "engines", []) or [])
    if len(engines) != 1 or hasattr(engines[0], "spec") or not prompt_ids:
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
    if compile_ahead is None:
        compile_ahead = compile_ahead_enabled()
    compiler = getattr(eng, "_compiler", None)
    if compile_ahead and compiler is not None:
        flags = {}
        for k in plan.keys:
            if k[0] == "sample":
                flags.setdefault(k[1], []).append(tuple(k[2:]))
        compiler.submit_ahead(plan.forward_keys[1:], flags)
    return plan
