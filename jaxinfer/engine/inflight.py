"""The steps an ``EngineCore`` has scheduled and dispatched: a scheduled step with its chosen
buckets, a launched one (a constrained step's sampling waits for its grammar masks) and one in
flight (its sampled tokens still on device, read back by the next ``EngineCore.step`` under async
scheduling)."""

from __future__ import annotations

import dataclasses

import jaxinfer.engine.prompt_logprobs as plp
from jaxinfer.engine.batch import Buckets
from jaxinfer.engine.runner import Forwarded, StepOutput
from jaxinfer.engine.scheduler import ScheduleOutput
from jaxinfer.engine.sequence import Sequence


@dataclasses.dataclass(eq=False)
class ScheduledStep:
    """A scheduled step with its buckets and sampling variant, chosen once per dispatch."""

    sched: ScheduleOutput
    need: Buckets  # exact buckets (``batch.exact_buckets``)
    buckets: Buckets  # the buckets it runs padded to (bucket reuse)
    flags: tuple  # ``sampling.sample_flags``
    forward_key: tuple  # its forward compile key (``ModelRunner.step_keys``)


@dataclasses.dataclass(eq=False)
class LaunchedStep:
    """A dispatched step: a constrained one (flags ending in ``MASKED``) has only
    its forward dispatched (``fwd``), its sampling waits for the masks; another is dispatched
    whole (``out``)."""

    fwd: Forwarded | None
    out: StepOutput | None
    sampled: list[tuple[Sequence, int]]  # (sequence, row) of each row that samples a token
    num_logprobs: int
    prompt_lp: plp.StepPlan | None


@dataclasses.dataclass(eq=False)
class InFlightStep:
    """A dispatched step whose sampled tokens are still on device."""

    out: StepOutput
    sampled: list[tuple[Sequence, int]]  # (sequence, row) of each row that sampled a token
    num_logprobs: int
    prompt_lp: plp.StepPlan | None = None  # when some row wants prompt logprobs
