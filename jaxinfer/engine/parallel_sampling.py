"""Parallel sampling (``SamplingParams.n`` > 1): n engine requests per prompt, one result.

Source: vLLM v1's ``vllm/v1/engine/parallel_sampling.py`` (``ParentRequest``) and the shape of
``AsyncLLM``'s outputs with ``RequestOutputKind.DELTA``.

- **Children.** A request with ``n`` > 1 becomes n engine requests over the same prompt token
  ids (so with prefix caching they share the prompt's pages), ids ``"<index>_<request id>"``
  (vLLM's ``ParentRequest.get_child_info``), params ``n=1``. With ``seed`` set, child i samples
  with ``seed + i`` (vLLM's ``_get_child_sampling_params``), so completion i equals a separate
  request with that seed; a sum of -1 (which ``SamplingParams`` reads as "no seed") is stored as
  2**32 - 1, the same low 32 bits, the only ones the device uses. Without a seed each child
  draws its own from the engine's host RNG. A request with n = 1 is not changed at all: its id,
  params and outputs are what they were before ``n`` existed.
- **Streaming** (``LLM.generate_stream``): for each engine output of child i, one output with
  the parent's ``request_id`` and ``outputs == [that completion]`` (``index`` i, text so far,
  ``delta_text``; its ``finish_reason`` is set in the child's last one), ``finished`` False;
  then, once all n children finished, one final output (``finished`` True) with all n
  completions in index order, each with ``delta_text`` "" (everything was streamed before), and
  the parent's metrics. An OpenAI server maps each non-final output to a chunk with one choice
  ``{index, text: delta_text, finish_reason}`` and the final one to the usage (n = 1 streams as
  before: its final output also carries the last delta and the finish reason).
- **Metrics** of the final output: prompt tokens once, completion tokens, preemptions, resumed
  tokens and speculative rounds summed; TTFT the earliest completion's, e2e the latest's, TPOT
  the mean over completions with one; ``num_cached_tokens`` the least over the completions (prompt
  tokens no completion had to compute); acceptance rate the rounds-weighted mean.
- **Failure.** When one child fails (``finish_reason`` "error"), the whole request fails, as in
  vLLM: its running siblings are aborted (their completions get ``finish_reason`` "abort") and
  the final output has ``finish_reason`` "error" with ``error`` naming the completion. A request
  that cannot be admitted (bad prompt, duplicate id, ...) fails before any child runs; its n
  completions are then empty with ``finish_reason`` "error".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxinfer.engine.resume import ResumeState
from jaxinfer.errors import RequestError
from jaxinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxinfer.sampling.params import SamplingParams

SEED_MODULUS = 2**32
"""The device uses a seed's low 32 bits (``SamplingTensors``)."""


def child_id(request_id: str, index: int) -> str:
    """The engine request id of completion ``index`` of ``request_id`` (vLLM's scheme)."""
    return f"{index}_{request_id}"


def child_params(params: SamplingParams) -> list[SamplingParams]:
    """The params of each of the ``params.n`` engine requests, index order (``[params]`` when
    n = 1): ``n=1``, and ``seed + i`` for child i when ``seed`` is set (see the module)."""
    if params.n == 1:
        return [params]
    out = []
    for i in range(params.n):
        seed = params.seed
        if seed is not None:
            seed += i
            if seed == -1:  # -1 means "no seed" to SamplingParams; same low 32 bits
                seed = SEED_MODULUS - 1
        out.append(dataclasses.replace(params, n=1, seed=seed))
    return out


def child_resume(params: SamplingParams, resume) -> list[ResumeState | None]:
    """The resume state of each child of a request: ``resume`` itself when n = 1, else None for
    all (``resume`` None) or ``resume``'s n states (a sequence of n ``ResumeState`` or None).
    A completion that had already finished cannot be resumed as it is (the engine refuses a
    finished partial output, and then the whole request fails): give it without its last token,
    which is sampled again, the same (``jaxinfer.cli.partial`` does so).

    Raises:
        RequestError: ``resume`` is not None and not a sequence of ``params.n`` states.
    """
    if params.n == 1:
        return [resume]
    if resume is None:
        return [None] * params.n
    if (
        isinstance(resume, ResumeState)
        or not isinstance(resume, Sequence)
        or len(resume) != params.n
        or not all(r is None or isinstance(r, ResumeState) for r in resume)
    ):
        raise RequestError(
            f"resume of a request with n={params.n} must be a sequence of "
            f"{params.n} ResumeState (or None), one per completion"
        )
    return list(resume)


def _completion(
    index: int, out: RequestOutput, *, delta: str | None = None, finish_reason: str | None = None
) -> CompletionOutput:
    """Completion ``index`` as engine output ``out`` has it (``delta`` / ``finish_reason``
    replace its own when given)."""
    return CompletionOutput(
        index,
        out.text,
        out.token_ids,
        finish_reason or out.finish_reason,
        out.stop_reason,
        out.logprobs,
        out.delta_text if delta is None else delta,
    )


def merge_metrics(parts: Sequence[RequestMetrics]) -> RequestMetrics:
    """The metrics of a request from its completions' (see the module docstring)."""
    if not parts:
        return RequestMetrics()
    ttft = [m.ttft_s for m in parts if m.ttft_s is not None]
    tpot = [m.tpot_s for m in parts if m.tpot_s is not None]
    e2e = [m.e2e_s for m in parts if m.e2e_s is not None]
    rounds = sum(m.spec_rounds for m in parts)
    spec = [m for m in parts if m.acceptance_rate is not None]
    rate = mean_acc = None
    if spec:
        w = sum(m.spec_rounds for m in spec)
        rate = sum(m.acceptance_rate * m.spec_rounds for m in spec) / w if w else 0.0
        mean_acc = sum(m.mean_accepted_tokens * m.spec_rounds for m in spec) / w if w else 0.0
    return RequestMetrics(
        ttft_s=min(ttft) if ttft else None,
        tpot_s=sum(tpot) / len(tpot) if tpot else None,
        e2e_s=max(e2e) if e2e else None,
        prompt_tokens=parts[0].prompt_tokens,
        completion_tokens=sum(m.completion_tokens for m in parts),
        num_cached_tokens=min(m.num_cached_tokens for m in parts),
        num_preemptions=sum(m.num_preemptions for m in parts),
        spec_rounds=rounds,
        acceptance_rate=rate,
        mean_accepted_tokens=mean_acc,
        resumed_tokens=sum(m.resumed_tokens for m in parts),
    )


class ParentRequest:
    """The state of one request with n > 1 while its children run: their latest outputs, which
    are still running, and the outputs to give the caller (`on_child`).

    Args:
        request_id: the caller's id of the request.
        prompt: its prompt text, if any; prompt_ids: int[S] its prompt token ids.
        n: completions.
    """

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], n: int):
        self.request_id, self.prompt, self.prompt_ids, self.n = request_id, prompt, prompt_ids, n
        self.latest: list[RequestOutput | None] = [None] * n
        self.running = set(range(n))
        self.done = False

    def child_ids(self) -> list[str]:
        return [child_id(self.request_id, i) for i in range(self.n)]

    def on_child(self, index: int, out: RequestOutput) -> tuple[list[RequestOutput], list[int]]:
        """Takes engine output ``out`` of child ``index``; returns (outputs for the caller, the
        indices of children to abort now)."""
        if self.done or index not in self.running:
            return [], []
        self.latest[index] = out
        if out.error is not None:
            self.running.discard(index)
            abort, self.running = sorted(self.running), set()
            return [self._final(failed=(index, out.error), aborted=abort)], abort
        streamed = self._streamed(index, out)
        if not out.finished:
            return [streamed], []
        self.running.discard(index)
        return ([streamed] if self.running else [streamed, self._final()]), []

    def _streamed(self, index: int, out: RequestOutput) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            text=out.text,
            token_ids=out.token_ids,
            finish_reason=None,
            stop_reason=out.stop_reason,
            logprobs=out.logprobs,
            metrics=out.metrics,
            delta_text=out.delta_text,
            outputs=[_completion(index, out)],
            prompt_logprobs=out.prompt_logprobs,
        )

    def _final(
        self, failed: tuple[int, str] | None = None, aborted: Sequence[int] = ()
    ) -> RequestOutput:
        self.done = True
        has_text = all(o is None or o.text is not None for o in self.latest)
        comps = []
        for i, o in enumerate(self.latest):
            if o is None:  # aborted before its first token
                comps.append(
                    CompletionOutput(
                        i,
                        "" if has_text else None,
                        [],
                        "abort",
                        delta_text="" if has_text else None,
                    )
                )
            else:
                comps.append(
                    _completion(
                        i,
                        o,
                        delta="" if has_text else None,
                        finish_reason="abort" if i in aborted else None,
                    )
                )
        first = comps[0]
        metrics = merge_metrics([o.metrics for o in self.latest if o is not None])
        error = None if failed is None else f"completion {failed[0]} of {self.n}: {failed[1]}"
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            text=first.text,
            token_ids=first.token_ids,
            finish_reason="error" if failed else first.finish_reason,
            stop_reason=first.stop_reason,
            logprobs=first.logprobs,
            metrics=metrics,
            error=error,
            delta_text=first.delta_text,
            outputs=comps,
            prompt_logprobs=next((o.prompt_logprobs for o in self.latest if o is not None), None),
        )


def error_output(request_id: str, prompt: str | None, error: str, n: int) -> RequestOutput:
    """The output of a request that failed before it ran: ``finish_reason`` "error" and, for
    n > 1, n empty completions with ``finish_reason`` "error"."""
    comps = [CompletionOutput(i, "", [], "error") for i in range(n)] if n > 1 else None
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=[],
        finish_reason="error",
        error=error,
        outputs=comps,
    )
