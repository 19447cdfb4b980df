"""Step-failure recovery's bookkeeping (host only): which requests a failed step blames.

A step that raises (a device error, a host error while building or reading it) fails only the
requests that caused it. ``EngineCore`` tells ``StepRecovery`` which sequences each attempt's
device work covers (``culprits``); after a failure it preempts every running sequence (their KV
may be half written, or the pool was donated to the failed call; recomputation gives the same
output, as sampling keys depend only on (seed, output index)) and asks ``blame`` whom to fail. A
failed step of one request fails that request. A failed step of several runs each of them alone,
one step at a time (``only``), until it samples a token (innocent: ``cleared``) or fails alone
(guilty); a request in ``MAX_STEP_FAILURES`` failed steps fails.
"""

from __future__ import annotations

from jaxinfer.engine.sequence import SeqStatus, Sequence

MAX_STEP_FAILURES = 2
"""A request in this many failed steps fails."""


class StepRecovery:
    """The recovery state of one engine core (module docstring).

    Attributes:
        culprits: the sequences the current attempt's device work covers.
        isolate: sequences to run alone, oldest first, until they sample a token.
        num_step_failures: steps that failed so far.
    """

    def __init__(self) -> None:
        self.culprits: list[Sequence] = []
        self.isolate: list[Sequence] = []
        self.num_step_failures = 0
        self._failures: dict[str, int] = {}  # request id -> failed steps it was in

    def only(self) -> Sequence | None:
        """The sequence the next step runs alone, or None."""
        return self.isolate[0] if self.isolate else None

    def cleared(self, request_ids: set[str]) -> None:
        """After a step that succeeded: isolated sequences that got a token (``request_ids``)
        are innocent, finished ones leave."""
        self.isolate = [
            s
            for s in self.isolate
            if s.status is not SeqStatus.FINISHED and s.request_id not in request_ids
        ]

    def blame(self) -> list[Sequence]:
        """After a failed step: the culprits that fail now (the caller fails them); the others
        are isolated. Clears ``culprits``."""
        culprits, self.culprits = list(dict.fromkeys(self.culprits)), []
        self.num_step_failures += 1
        guilty = []
        for seq in culprits:
            if seq.status is SeqStatus.FINISHED:
                continue
            n = self._failures[seq.request_id] = self._failures.get(seq.request_id, 0) + 1
            if len(culprits) == 1 or n >= MAX_STEP_FAILURES:
                guilty.append(seq)
            elif all(seq is not s for s in self.isolate):
                self.isolate.append(seq)
        return guilty

    def forget(self, request_id: str) -> None:
        """A request that ended (failed or aborted) leaves the counts and the isolated."""
        self._failures.pop(request_id, None)
        self.isolate = [s for s in self.isolate if s.request_id != request_id]
