"""Host side of sampling: per-request `SamplingParams` (validated) and stop-string detection.

Field names and meanings follow vLLM's ``vllm/sampling_params.py`` (``SamplingParams`` and its
``_verify_args``); the device side that consumes them is `jaxinfer.sampling.sampler`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from jaxinfer.errors import RequestError
from jaxinfer.sampling.structured_params import StructuredOutputsParams

MAX_LOGPROBS = 20
"""Most top-n logprobs a request may ask for (vLLM's default ``max_logprobs``)."""

SAMPLING_EPS = 1e-5
"""Temperatures below this mean greedy sampling (vLLM's ``_SAMPLING_EPS``)."""

F32_TINY = float(np.finfo(np.float32).tiny)
"""Smallest normal float32 (1.1754944e-38): a non-zero float field below it in magnitude would be
0 (or a flushed denormal) on device, so it is refused."""
F32_MAX = float(np.finfo(np.float32).max)
"""Largest float32 (3.4028235e38): a float field above it would be inf on device."""
I32_MAX = int(np.iinfo(np.int32).max)
"""Largest int32: integer fields the device reads (``top_k``) must not exceed it."""
MAX_N = 128
"""Most completions one request may ask for (``n``): the OpenAI API's own limit on ``n``. Each
completion is a sequence of its own in the batch (`jaxinfer.engine.parallel_sampling`)."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, int | float | np.integer | np.floating) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples its output tokens and when it stops; same meaning as vLLM's.

    Attributes:
        temperature: logits are divided by it before sampling; < 1e-5 (`SAMPLING_EPS`) means
            greedy (argmax), normalised to 0.0 with top_p, top_k and min_p reset to off, as vLLM.
        top_p: keep the smallest set of most likely tokens whose probability sums to >= top_p;
            in (0, 1], 1 = off.
        top_k: keep the k most likely tokens; 0 or -1 = off (normalised to 0).
        min_p: keep tokens whose probability is >= min_p * the top token's; in [0, 1], 0 = off.
        repetition_penalty: > 0; divides positive logits (multiplies negative ones) of every token
            seen in the prompt or the output so far; 1 = off (CTRL, Keskar et al. 2019).
        presence_penalty: in [-2, 2]; subtracted from the logit of every token already in the
            output (OpenAI API semantics).
        frequency_penalty: in [-2, 2]; subtracted once per occurrence of a token in the output.
        seed: per-request random seed; the same seed, prompt and params give the same output
            whatever else is in the batch. None = the engine draws one (-1 is read as None, as
            vLLM). Only the low 32 bits are used on device.
        max_tokens: most tokens to generate, >= 1; None = up to the model's context length.
        min_tokens: EOS and stop_token_ids cannot end the request before this many tokens.
        stop: strings that end generation; the output text is cut before them (after them when
            include_stop_str_in_output). A str or list is accepted and stored as a tuple.
        stop_token_ids: token ids that end generation (the token is kept in the output ids).
        ignore_eos: keep generating after the EOS token.
        logprobs: None = no logprobs; n in [0, MAX_LOGPROBS] = the n most likely tokens' logprobs
            plus the sampled token's (OpenAI API semantics, so up to n + 1 entries).
        skip_special_tokens: leave special tokens out of the output text.
        include_stop_str_in_output: keep the matched stop string in the output text.
        n: completions to generate for the prompt, in [1, `MAX_N`] (vLLM's parallel sampling,
            `jaxinfer.engine.parallel_sampling`): n sequences over the same prompt, completion i
            sampling with seed + i when ``seed`` is set, each with a seed of its own otherwise.
        prompt_logprobs: None = none; k in [0, MAX_LOGPROBS] = for every prompt position after
            the first, the prompt token's logprob under the raw model distribution and the k
            most likely tokens' (vLLM semantics; ``RequestOutput.prompt_logprobs``,
            `jaxinfer.engine.prompt_logprobs`). Such a request reads the prefix cache only for
            positions before ``prompt_logprobs_from - 1`` (cached positions have no logits).
        prompt_logprobs_from: the first prompt index whose logprob ``prompt_logprobs`` returns
            (>= 1; default 1: every position after the first, vLLM's); earlier entries are
            None. Scoring (``LLM.score``) sets it to the continuation's start, so pairs sharing
            a context read its pages from the prefix cache. Must be < the prompt's length.
        structured_outputs: None = free output; a `StructuredOutputsParams` (or a mapping of its
            fields) constrains the output to a JSON schema, regex, choice or grammar (vLLM's
            ``structured_outputs``).
        guided_decoding: vLLM's older name for ``structured_outputs``; moved there (set one).

    Raises:
        RequestError: on a value out of range or of the wrong type; the message names the field
            and the allowed range.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    prompt_logprobs: int | None = None
    prompt_logprobs_from: int = 1
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        def fail(msg: str) -> None:
            raise RequestError(f"SamplingParams: {msg}")

        def setf(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        # Types first, so the range checks below compare numbers.
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v):
                fail(f"{name} must be a finite number, got {v!r}")
            setf(name, float(v))
        for name in ("top_k", "min_tokens", "n", "prompt_logprobs_from"):
            v = getattr(self, name)
            if not _is_int(v):
                fail(f"{name} must be an integer, got {v!r}")
            setf(name, int(v))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not _is_int(v):
                fail(f"{name} must be an integer or None, got {v!r}")
            if v is not None:
                setf(name, int(v))
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            v = getattr(self, name)
            if not isinstance(v, bool | np.bool_):
                fail(f"{name} must be a bool, got {v!r}")
            setf(name, bool(v))

        # stop: str | list | tuple -> tuple[str, ...]
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, Iterable) and not isinstance(stop, Mapping | bytes):
            stop = tuple(stop)
        else:
            fail(f"stop must be a string or a list of strings, got {stop!r}")
        if not all(isinstance(s, str) for s in stop):
            fail(f"stop must contain only strings, got {stop!r}")
        if any(s == "" for s in stop):
            fail("stop cannot contain an empty string")
        setf("stop", tuple(dict.fromkeys(stop)))

        ids = self.stop_token_ids
        if ids is None:
            ids = ()
        elif _is_int(ids) or not isinstance(ids, Iterable):
            fail(f"stop_token_ids must be a list of integers, got {ids!r}")
        ids = tuple(ids)
        if not all(_is_int(i) and i >= 0 for i in ids):
            fail(f"stop_token_ids must contain only integers >= 0, got {ids!r}")
        setf("stop_token_ids", tuple(dict.fromkeys(int(i) for i in ids)))

        # Ranges, as vLLM's _verify_args.
        if self.temperature < 0.0:
            fail(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            fail(f"top_k must be 0 or -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            fail(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if self.min_tokens < 0:
            fail(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if not 1 <= self.n <= MAX_N:
            fail(f"n must be in [1, {MAX_N}] (completions per prompt), got {self.n}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            fail(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            fail(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] or None, got "
                f"{self.prompt_logprobs}"
            )
        if self.prompt_logprobs_from < 1:
            fail(f"prompt_logprobs_from must be >= 1, got {self.prompt_logprobs_from}")
        if self.top_k > I32_MAX:
            fail(
                f"top_k must be <= {I32_MAX} (int32 on device; any k >= the vocabulary size "
                f"keeps every token), got {self.top_k}"
            )
        # What the device can represent: sampling runs in float32.
        for name in (
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ) + (("temperature",) if self.temperature >= SAMPLING_EPS else ()):
            v = getattr(self, name)
            if v != 0.0 and not F32_TINY <= abs(v) <= F32_MAX:
                fail(
                    f"{name}={v!r} cannot be represented in float32 on device (non-zero "
                    f"magnitudes must be in [{F32_TINY:.8g}, {F32_MAX:.8g}])"
                )

        so, gd = self.structured_outputs, self.guided_decoding
        if so is not None and gd is not None:
            fail("set structured_outputs or its older name guided_decoding, not both")
        so = gd if so is None else so
        if so is not None:
            try:
                so = StructuredOutputsParams.from_dict(so)
            except RequestError as e:
                fail(str(e))
        setf("structured_outputs", so)
        setf("guided_decoding", None)

        # Normalisations, as vLLM's __post_init__.
        if self.top_k == -1:
            setf("top_k", 0)
        if self.seed == -1:
            setf("seed", None)
        if self.temperature < SAMPLING_EPS:
            setf("temperature", 0.0)
            setf("top_p", 1.0)
            setf("top_k", 0)
            setf("min_p", 0.0)

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token (temperature < `SAMPLING_EPS`)."""
        return self.temperature == 0.0

    @property
    def stop_buffer_length(self) -> int:
        """Characters of output text to hold back while streaming (vLLM's
        ``output_text_buffer_length``): a stop string may still complete over them and they
        would then be cut. 0 when there are no stop strings or they are kept in the output."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Builds params from a JSON-like mapping (the CLI's request records).

        Raises:
            RequestError: if `d` is not a mapping, has keys that are not fields (all of them
                are named, with the allowed ones), or a value is invalid.
        """
        if not isinstance(d, Mapping):
            raise RequestError(f"SamplingParams: expected a JSON object, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in d if k not in names)
        if unknown:
            raise RequestError(
                f"SamplingParams: unknown field(s) {', '.join(unknown)}; "
                f"allowed: {', '.join(names)}"
            )
        return cls(**d)


def draw_seed(params: SamplingParams, rng: np.random.Generator) -> int:
    """The seed a request samples with: its own, or a fresh one from the engine's host `rng`."""
    if params.seed is not None:
        return params.seed
    return int(rng.integers(0, 2**32, dtype=np.uint64))


def find_stop_string(
    text: str, new_text_start: int, stops: tuple[str, ...], include: bool
) -> int | None:
    """Where the output text must be cut because a stop string appeared in it, if one did.

    Only matches that end inside the new text ``text[new_text_start:]`` are looked for (earlier
    ones were found by earlier calls), so the search starts ``max(len(stop)) - 1`` characters
    before the new text. When several stop strings match, the one that *ends* first wins (it is
    the one a token-by-token stream would have met first, so the answer does not depend on how
    the text was chunked); among those ending at the same place, the longest, so no piece of a
    matched stop string remains. (vLLM's ``check_stop_strings`` instead takes the first match in
    list order.)

    The text comes from the incremental detokenizer, which never emits a partial UTF-8 character
    (it holds back bytes until they decode), and Python strings index whole code points, so a cut
    never falls inside a multi-byte character.

    Args:
        text: the request's whole output text so far.
        new_text_start: index in `text` where the text added by the latest step begins.
        stops: the request's stop strings (`SamplingParams.stop`).
        include: `SamplingParams.include_stop_str_in_output`.

    Returns:
        The index to cut at (the output text becomes ``text[:cut]``): the start of the stop
        string, or its end when `include`; None when no stop string ends in the new text.
    """
    if not stops:
        return None
    longest = max(len(s) for s in stops)
    search_from = max(0, new_text_start - (longest - 1))
    best: tuple[int, int] | None = None  # (end, start) of the winning match
    for stop in stops:
        # A match must end after new_text_start, so start >= new_text_start - len(stop) + 1.
        i = text.find(stop, max(search_from, new_text_start - len(stop) + 1))
        if i < 0:
            continue
        cand = (i + len(stop), i)
        if best is None or cand < best:
            best = cand
    if best is None:
        return None
    end, start = best
    return end if include else start
