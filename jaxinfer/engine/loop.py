"""The one front door for requests: an ``LLM``'s engines behind one lock, shared by every caller.

``EngineLoop`` is what every way in uses (``LLM.generate`` / ``generate_stream`` / ``chat``,
scoring, the HTTP server's engine thread): ``add(request, sink)`` encodes and validates a request
once (``jaxinfer.engine.inputs``), refuses an id already running, expands ``n`` > 1 into its
completions once (``jaxinfer.engine.parallel_sampling``), routes it to a data-parallel replica
and queues it; ``step()`` runs one step of every replica with work and hands each output to its
request's sink; ``abort(ids)`` drops requests. The shape of vLLM v1's ``LLMEngine`` /
``AsyncLLM`` over an engine-core client, with per-request output collectors.

Threads: ``add``, ``abort`` and ``step`` take the loop's lock; sinks are called under it, on the
thread that steps. ``stream`` (``LLM.generate_stream``) adds a call's requests and then, until
they finish, either takes the outputs routed to it or, when it has none, steps the engines itself.
So two threads calling ``LLM.generate`` at once share the continuous batch (neither waits for the
other's whole job), the server's engine thread and ``LLM.generate`` in the same process share it
too, and a stream whose consumer stops early (``close()``, garbage collection, an exception in
the consumer) aborts its unfinished requests so they cost nothing more. Outputs are yielded
outside the lock.

Data-parallel routing: a request whose home is replica h (request i of a ``stream`` call: i % n;
``add``: its ``replica`` argument, else the next in turn) goes to the replica whose prefix cache
holds the longest prefix of its prompt now (``EngineCore.cached_prefix_tokens``; ties to the first
from h on), or to h when none holds any (or caching is off). Seeds do not follow the routing: a
completion without one samples with the seed replica h's host RNG draws for it (``draw_seeds``),
wherever it runs. Requests of one call that share a prefix not yet cached are not grouped (the
cache fills as they run). Source: the prefix-aware routing of vLLM's and sglang's data-parallel
load balancers, reduced to longest cached prefix.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence

from jaxinfer.engine.core import EngineCore
from jaxinfer.engine.inputs import (
    ProcessedRequest,
    PromptLike,
    Request,
    encode_prompt,
    process,
    with_resume,
)
from jaxinfer.engine.parallel_sampling import ParentRequest, child_id, error_output
from jaxinfer.engine.resume import ResumeState
from jaxinfer.errors import JaxinferError, RequestError
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling.params import SamplingParams

Sink = Callable[[RequestOutput], None]
"""Where a request's outputs go (``collections.deque.append``, ...): called under the loop's
lock, on the thread that steps; it must not call back into the loop."""


@dataclasses.dataclass(eq=False)
class _Running:
    """A request added and not yet finished or aborted."""

    request: ProcessedRequest
    sink: Sink
    engine: EngineCore
    parent: ParentRequest | None  # n > 1
    engine_ids: list[str]  # its engine requests: [request_id], or one per completion


class EngineLoop:
    """The engines of one ``LLM`` (data-parallel replicas step in turn) behind one lock.

    Args:
        engines: the replicas (same model and config); prompts are encoded with the first
            one's ``tokenizer`` and validated with its ``validate``.
    """

    def __init__(self, engines: Sequence[EngineCore]):
        self.engines = list(engines)
        self._lock = threading.Lock()
        self._requests: dict[str, _Running] = {}  # caller's request id -> its state
        self._routes: dict[str, tuple[_Running, int]] = {}  # engine request id -> (its, index)
        self._ids = itertools.count()
        self._turn = itertools.count()  # home replicas of ``add`` without ``replica``

    # ---------------------------------------------------------------- queries

    @property
    def tokenizer(self):
        """The tokenizer prompts are encoded with (a stand-in holding the special ids when the
        model runs on token ids only)."""
        return self.engines[0].tokenizer

    def next_id(self) -> int:
        """A process-unique number for default request ids (thread-safe)."""
        return next(self._ids)

    def has_work(self) -> bool:
        """Whether a replica has unfinished requests (read without the lock: a hint for a
        stepping thread deciding whether to wait)."""
        return any(e.has_unfinished() for e in self.engines)

    @property
    def num_requests(self) -> int:
        """Requests added and not yet finished or aborted (a request with n > 1 counts once)."""
        return len(self._requests)

    def draw_seeds(self, sampling_params: Sequence[SamplingParams]) -> list[int]:
        """The seeds requests with these params would sample with if ``stream`` got them now in
        this order: each one's own, or one drawn from the host RNG of replica i % n (advancing
        it, so ``stream`` then draws other seeds), wherever the routing then runs request i.

        Raises:
            ValueError: params with ``n`` > 1 (draw the seeds of their completions:
                ``parallel_sampling.child_params``).
        """
        bad = [i for i, sp in enumerate(sampling_params) if sp.n != 1]
        if bad:
            raise ValueError(
                f"draw_seeds: params {bad[:5]} have n > 1; pass the params of "
                "their completions (parallel_sampling.child_params)"
            )
        with self._lock:
            return [
                self.engines[i % len(self.engines)].draw_seed(sp)
                for i, sp in enumerate(sampling_params)
            ]

    # ---------------------------------------------------------------- requests in

    def encode(self, prompt: PromptLike) -> tuple[list[int], str | None]:
        """Token ids and text of a prompt (``inputs.encode_prompt``). Raises RequestError (also
        for text when the model runs without a tokenizer)."""
        return encode_prompt(self.tokenizer, prompt)

    def process(self, request: Request) -> ProcessedRequest:
        """``request`` encoded, its completions laid out and validated (``inputs.process``),
        without the lock: for a caller that must refuse a bad request before it queues it.

        Raises:
            JaxinferError: the request cannot run (the message says why).
        """
        return process(self.engines[0], request)

    def with_resume(self, request: ProcessedRequest, states) -> ProcessedRequest:
        """``request`` (``process``'s result) continuing its completions from ``states``, one
        ``ResumeState`` per completion; only the states are checked (``inputs.with_resume``).
        Without the lock.

        Raises:
            RequestError: not one state per completion, or a state the engine refuses.
        """
        return with_resume(self.engines[0], request, states)

    def add(
        self,
        request: Request | ProcessedRequest,
        sink: Sink,
        *,
        replica: int | None = None,
    ) -> None:
        """Queues ``request``; its outputs go to ``sink`` (every new-token output, then the
        final one; for ``n`` > 1 as ``jaxinfer.engine.parallel_sampling`` describes). A
        ``Request`` is processed first (``process``); a ``ProcessedRequest`` is not checked
        again.

        Args:
            replica: the request's home replica (``replica % len(engines)``: where routing
                starts and where a completion without a seed draws one); None: the next in turn.

        Raises:
            JaxinferError: the request cannot run (``process``), or its id (or one of its
                completions' ids) is in use by a running request; nothing was queued.
        """
        if isinstance(request, Request):
            request = self.process(request)
        home = next(self._turn) if replica is None else replica
        with self._lock:
            self._add_locked(request, sink, home)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drops requests (every completion of one with n > 1): their pages are freed and their
        sinks get nothing more. Unknown or finished ids are ignored."""
        with self._lock:
            for rid in request_ids:
                self._abort_locked(rid)

    def step(self) -> None:
        """One step of every replica with work; each output goes to its request's sink. An
        exception from an engine's step propagates (its requests stay queued: the engine
        recovers on its next step, or the caller aborts them)."""
        with self._lock:
            self._step_locked()

    # ---------------------------------------------------------------- streams

    def stream(self, requests: Sequence[Request | ProcessedRequest]) -> Iterator[RequestOutput]:
        """Adds ``requests`` (request i with home replica i) and yields their outputs until
        every one finished. A ``Request`` is processed first (``process``); a
        ``ProcessedRequest`` is not checked again (as ``add``). A request that cannot be
        processed, or whose id is already running, yields one output with ``error`` set, first;
        the others go on. Closing the iterator early aborts its requests that have not
        finished."""
        mine: collections.deque[RequestOutput] = collections.deque()
        errors, ready = [], []
        for i, req in enumerate(requests):
            if isinstance(req, ProcessedRequest):
                ready.append((i, req))
                continue
            try:
                ready.append((i, self.process(req)))
            except JaxinferError as e:
                errors.append(_failed(req.request_id, req.prompt, req.params, e))
        pending: set[str] = set()
        with self._lock:
            for i, proc in ready:
                try:
                    self._add_locked(proc, mine.append, i)
                except JaxinferError as e:
                    errors.append(error_output(proc.request_id, proc.prompt_text, str(e), proc.n))
                    continue
                pending.add(proc.request_id)
        yield from errors
        try:
            while pending:
                while mine:
                    out = mine.popleft()
                    if out.finished:
                        pending.discard(out.request_id)
                    yield out
                if not pending:
                    break
                with self._lock:
                    if not mine:  # nobody stepped for us while we waited for the lock
                        self._step_locked()
        finally:
            if pending:  # the consumer stopped early: drop what it will never read
                self.abort(pending)

    # ---------------------------------------------------------------- under the lock

    def _add_locked(self, req: ProcessedRequest, sink: Sink, home_index: int) -> None:
        rid = req.request_id
        parent = None if req.n == 1 else ParentRequest(rid, req.prompt_text, req.prompt_ids, req.n)
        eids = [rid] if parent is None else parent.child_ids()
        taken = [e for e in eids + [rid] if e in self._routes or e in self._requests]
        if taken:
            raise RequestError(self._duplicate_message(rid, taken[0]))
        home = self.engines[home_index % len(self.engines)]
        eng = self._route(req.prompt_ids, home)
        for k, (eid, (csp, crs)) in enumerate(zip(eids, req.children, strict=True)):
            if eng is not home and crs is None:  # the seed replica i % n draws
                crs = ResumeState(home.draw_seed(csp))
            try:
                eng.add_request(eid, req.prompt_ids, csp, prompt=req.prompt_text, resume=crs)
            except JaxinferError:
                for e in eids[:k]:
                    eng.abort_request(e)
                raise
        running = _Running(req, sink, eng, parent, eids)
        self._requests[rid] = running
        for k, eid in enumerate(eids):
            self._routes[eid] = (running, k)

    def _abort_locked(self, rid: str) -> None:
        running = self._requests.pop(rid, None)
        if running is None:
            return
        for eid in running.engine_ids:
            self._routes.pop(eid, None)
            running.engine.abort_request(eid)

    def _route(self, ids: list[int], home: EngineCore) -> EngineCore:
        """The replica a prompt runs on: the one whose prefix cache holds the most of ``ids``
        (ties to the first from ``home`` on), ``home`` when none holds any."""
        if len(self.engines) == 1:
            return home
        start = self.engines.index(home)
        order = self.engines[start:] + self.engines[:start]
        hits = [e.cached_prefix_tokens(ids) for e in order]
        best = max(hits)
        return order[hits.index(best)] if best > 0 else home

    def _duplicate_message(self, rid: str, taken: str) -> str:
        """Why request ``rid`` cannot run: id ``taken`` (its own or one of its completions') is
        in use."""
        route = self._routes.get(taken)
        if route is not None and route[0].parent is not None:
            return (
                f"duplicate request id {rid!r}: {taken!r} is the id of completion {route[1]} "
                f"of the running request {route[0].request.request_id!r} (a request with n > 1 "
                "runs its completions as '<index>_<id>', vLLM's scheme)"
            )
        if taken == rid:
            return f"duplicate request id {rid!r}: a request with this id is still running"
        return (
            f"duplicate request id {rid!r}: its completion id {taken!r} ('<index>_<id>', "
            "vLLM's scheme for n > 1) is the id of a running request"
        )

    def _step_locked(self) -> None:
        for eng in self.engines:
            if not eng.has_unfinished():
                continue
            for out in eng.step():
                route = self._routes.get(out.request_id)
                if route is None:
                    continue  # aborted, or added to the engine by someone else
                running, index = route
                if out.finished:
                    del self._routes[out.request_id]
                if running.parent is None:
                    if out.finished:
                        del self._requests[running.request.request_id]
                    running.sink(out)
                    continue
                parent = running.parent
                outs, abort = parent.on_child(index, out)
                for k in abort:  # a sibling failed: the whole request fails (vLLM)
                    eid = child_id(parent.request_id, k)
                    self._routes.pop(eid, None)
                    eng.abort_request(eid)
                if parent.done:
                    self._requests.pop(parent.request_id, None)
                for o in outs:
                    running.sink(o)


def _failed(request_id, prompt, params, error: Exception) -> RequestOutput:
    """The error output of a request ``process`` refused."""
    n = params.n if isinstance(params, SamplingParams) else 1
    text = prompt if isinstance(prompt, str) else None
    return error_output(str(request_id), text, str(error), n)
