"""What the engine returns per request: text, token ids, finish reason, logprobs and metrics;
one `CompletionOutput` per completion (``SamplingParams.n``), as vLLM's ``vllm/outputs.py``."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RequestMetrics:
    """Per-request timings (seconds) and token counts.

    Attributes:
        ttft_s: time to first token, from the request's arrival.
        tpot_s: mean time per output token after the first (0 with one token).
        e2e_s: arrival to finish.
        prompt_tokens, completion_tokens: token counts.
        num_cached_tokens: prompt tokens whose KV was read from the prefix cache instead of
            computed, at the request's first admission, as vLLM (0 with prefix caching off).
        num_preemptions: times the sequence was preempted and recomputed.
        spec_rounds: speculative rounds the request took part in (0 without speculation).
        acceptance_rate: accepted / proposed draft tokens (None without speculation).
        mean_accepted_tokens: accepted draft tokens per round (None without speculation); each
            round also emits one token of the target's own.
        resumed_tokens: output tokens carried over from a partial output (``ResumeState``,
            ``jaxinfer generate``'s partial file), not computed by this run. They count in
            ``completion_tokens``; the timings cover this run only: ``ttft_s`` from the resumed
            request's admission to its first new token, ``tpot_s`` over the new tokens.
    """

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    spec_rounds: int = 0
    acceptance_rate: float | None = None
    mean_accepted_tokens: float | None = None
    resumed_tokens: int = 0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class TokenLogprob:
    """Log-probability of a generated token under the model's raw distribution, with the top-n
    alternatives (``top``: list of (token id, logprob), best first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a request (vLLM's ``CompletionOutput``; an OpenAI ``choice``).

    Attributes:
        index: the completion's place among the request's ``n``, 0-based (the choice index).
        text: generated text so far (stop string removed unless asked to include it); None
            when the model runs without a tokenizer.
        token_ids: generated token ids so far (a stop token id included).
        finish_reason: "stop", "length", "error", "abort" (a sibling completion failed, so this
            one was stopped: see `jaxinfer.engine.parallel_sampling`), or None while running.
        stop_reason: the stop string or stop token id that ended it, if any.
        logprobs: one ``TokenLogprob`` per generated token when requested, else None.
        delta_text: text added since this completion's previous streamed output (streaming;
            "" in a final output of an n > 1 request, whose text was all streamed before); None
            without a tokenizer.
    """

    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    delta_text: str | None = ""

    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """Sum of the generated tokens' logprobs when logprobs were requested (vLLM fills it
        only then too), else None."""
        return None if self.logprobs is None else float(sum(lp.logprob for lp in self.logprobs))

    def to_record(self) -> dict:
        """This completion in an n > 1 output record (``RequestOutput.to_record``)."""
        rec = {
            "index": self.index,
            **({} if self.text is None else {"text": self.text}),
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }
        if self.logprobs is not None:
            rec["logprobs"] = [dataclasses.asdict(lp) for lp in self.logprobs]
        return rec


@dataclasses.dataclass
class RequestOutput:
    """Result of one request (or, when streaming, its state so far).

    Attributes:
        request_id: the caller's id (or its index in the batch as a string).
        prompt: the prompt text when one was given.
        prompt_token_ids: the tokens the model saw.
        text: generated text (stop string removed unless asked to include it); None when the
            model runs without a tokenizer (``LLM(skip_tokenizer_init=True)`` or none found).
        token_ids: generated token ids (a stop token id included).
        finish_reason: "stop", "length", "error", or None while running.
        stop_reason: the stop string or stop token id that ended it, if any.
        logprobs: one ``TokenLogprob`` per generated token when requested, else None.
        metrics: timings and counts.
        error: why the request failed (finish_reason "error"), else None.
        delta_text: text added since the previous streamed output (streaming only); None
            without a tokenizer.
        outputs: the request's completions (vLLM's ``RequestOutput.outputs``). When not given
            (every n = 1 output) it is built from the fields above: one `CompletionOutput`,
            index 0, so ``out.outputs[0].text == out.text`` for any request.
        prompt_logprobs: with ``SamplingParams.prompt_logprobs`` = k, a list aligned with
            ``prompt_token_ids``: None first, then per prompt token a ``TokenLogprob`` (the
            token, its logprob given the tokens before it, the top k (id, logprob) pairs of that
            distribution, best first); complete from the request's first output with a token on
            (`jaxinfer.engine.prompt_logprobs`). None when not asked.

    With ``SamplingParams.n`` > 1 (`jaxinfer.engine.parallel_sampling` makes these outputs): the
    final
    output holds the n completions in ``outputs``, in index order; ``text``, ``token_ids``,
    ``stop_reason``, ``logprobs`` and ``delta_text`` are those of ``outputs[0]`` (so code written
    for n = 1 reads completion 0); ``finish_reason`` is the request's: None until all n
    completions finished, then ``outputs[0]``'s, or "error" when one failed (``error`` names
    it); ``metrics`` count the prompt once and sum the completions' tokens. A streamed output of
    one completion holds that completion alone in ``outputs`` (its ``index`` tells which).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str | None = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    metrics: RequestMetrics = dataclasses.field(default_factory=RequestMetrics)
    error: str | None = None
    delta_text: str | None = ""
    outputs: list[CompletionOutput] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def __post_init__(self) -> None:
        if self.outputs is None:
            self.outputs = [
                CompletionOutput(
                    0,
                    self.text,
                    self.token_ids,
                    self.finish_reason,
                    self.stop_reason,
                    self.logprobs,
                    self.delta_text,
                )
            ]

    @property
    def finished(self) -> bool:
        """Whether the whole request finished (all of its completions)."""
        return self.finish_reason is not None

    def to_record(self) -> dict:
        """The JSONL record the CLI writes (no "text" key when ``text`` is None). A request with
        several completions (n > 1) has ``"outputs"``: one ``CompletionOutput.to_record`` each,
        in index order, in place of the top-level text, token_ids, finish_reason, stop_reason
        and logprobs; ``usage`` counts the prompt once and sums the completions. With prompt
        logprobs, ``"prompt_logprobs"``: None, then one {token_id, logprob, top} per prompt
        token."""
        if self.error is not None:
            return {"id": self.request_id, "error": self.error, "finish_reason": "error"}
        plp = (
            {}
            if self.prompt_logprobs is None
            else {
                "prompt_logprobs": [
                    None if lp is None else dataclasses.asdict(lp) for lp in self.prompt_logprobs
                ]
            }
        )
        if len(self.outputs) > 1:
            return {
                "id": self.request_id,
                "outputs": [c.to_record() for c in self.outputs],
                **plp,
                **self._usage_record(),
            }
        rec = {
            "id": self.request_id,
            **({} if self.text is None else {"text": self.text}),
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            **self._usage_record(),
        }
        if self.logprobs is not None:
            rec["logprobs"] = [dataclasses.asdict(lp) for lp in self.logprobs]
        rec.update(plp)
        return rec

    def _usage_record(self) -> dict:
        return {
            "usage": {
                "prompt_tokens": self.metrics.prompt_tokens,
                "completion_tokens": self.metrics.completion_tokens,
            },
            "metrics": self.metrics.to_dict(),
        }
