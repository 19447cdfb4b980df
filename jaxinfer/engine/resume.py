"""Continuing a request from a partial output (``EngineCore.add_request(..., resume=...)``).

Sampling keys depend only on (seed, output index), so a request given its seed and the first k
output tokens (with their logprobs, when requested) continues exactly as if it had never stopped:
the prefill covers prompt + the k tokens, the next token sampled is output index k, and the host
state (output text, stop-string search, ``min_tokens`` / ``max_tokens`` / penalty counts) is
rebuilt by replaying the k tokens through the same code that appended them the first time.
``jaxinfer generate`` keeps these states in a partial file beside ``--out``
(``jaxinfer.cli.partial``).
"""

from __future__ import annotations

import dataclasses

from jaxinfer.errors import RequestError
from jaxinfer.outputs import TokenLogprob
from jaxinfer.sampling.params import SamplingParams


@dataclasses.dataclass(frozen=True)
class ResumeState:
    """Where a request stopped: the seed it sampled with and the output it had.

    Attributes:
        seed: the seed the request sampled with (its own ``SamplingParams.seed``, or the one the
            engine drew for it: ``EngineCore.draw_seed``).
        token_ids: the output token ids so far, int[k] (k may be 0: a fresh request with this seed).
        logprobs: one ``TokenLogprob`` per token of ``token_ids`` when the request's
            ``SamplingParams.logprobs`` is set (None is accepted for k = 0), else None.
    """

    seed: int
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None


def check_resume(resume: ResumeState, params: SamplingParams, vocab_size: int) -> None:
    """Checks a resume state against its request's params (the replay checks the rest: a partial
    output that already finished, one longer than ``max_model_len``).

    Raises:
        RequestError: the seed is not an integer, a token id is outside [0, vocab_size), or the
            logprobs are missing, present without ``params.logprobs``, or not one per token.
    """
    if not isinstance(resume.seed, int) or isinstance(resume.seed, bool):
        # Any integer, as SamplingParams.seed: only its low 32 bits reach the device.
        raise RequestError(f"resume seed must be an integer, got {resume.seed!r}")
    bad = [
        t
        for t in resume.token_ids
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size
    ]
    if bad:
        raise RequestError(
            f"resume token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )
    if params.logprobs is None:
        if resume.logprobs is not None:
            raise RequestError("resume logprobs given for a request without logprobs")
        return
    if resume.logprobs is None and not resume.token_ids:
        return  # nothing to carry over
    if resume.logprobs is None or len(resume.logprobs) != len(resume.token_ids):
        got = "none" if resume.logprobs is None else len(resume.logprobs)
        raise RequestError(
            f"resume logprobs: {got} for {len(resume.token_ids)} tokens (the "
            "request asks for logprobs: one per token is needed)"
        )
    for i, (tok, lp) in enumerate(zip(resume.token_ids, resume.logprobs, strict=True)):
        if not isinstance(lp, TokenLogprob) or lp.token_id != tok:
            raise RequestError(f"resume logprobs[{i}] is not the logprob of token {tok}")
