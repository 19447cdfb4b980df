"""A request's host state as the scheduler and the KV manager see it: its token ids, how many of
them are computed, its pages (block table) and its status."""

from __future__ import annotations

import dataclasses
import enum
import time

from jaxinfer.sampling.sampler import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request's state. ``all_ids = prompt_ids + output_ids + pending``; ``num_computed`` of
    them have their K/V in the cache (or are being written by a step in flight).

    ``pending``: placeholders of tokens sampled by a dispatched step whose result the host has not
    read yet (async scheduling, ``EngineCore``): ``-(r + 1)`` stands for row ``r`` of that step's
    sampled tokens, which the next step reads on device. ``pending_final``: the pending token is
    this sequence's last (it reaches ``max_tokens`` or ``max_model_len``), so it is not scheduled
    again."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    logprobs: list = dataclasses.field(default_factory=list)
    pending: list[int] = dataclasses.field(default_factory=list)
    pending_final: bool = False
    # Prefix caching (``jaxinfer.engine.kv_manager``): keys besides the token ids that decide
    # this request's K/V, mixed into each of its page hashes (empty today; a LoRA adapter's id
    # goes here); hashes of the full pages of the known tokens (computed lazily, kept across
    # preemption: the known tokens only grow); how many of ``pages`` were offered to the cache.
    extra_keys: tuple = ()
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_cached_pages: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at the first admission

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + len(self.pending)

    @property
    def num_known(self) -> int:
        """Tokens whose ids the host knows (prompt + collected output; not ``pending``)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        n, o = len(self.prompt_ids), len(self.output_ids)
        if i < n:
            return self.prompt_ids[i]
        return self.output_ids[i - n] if i < n + o else self.pending[i - n - o]
