"""One engine loop shared by every caller of an ``LLM``: threads and interleaved streams.

Each call to ``EngineLoop.stream`` adds its requests to the engines and then, until they finish,
either takes outputs routed to it or, when it has none, steps the engines itself under the loop's
lock and routes every output to the call that owns the request. So two threads calling
``LLM.generate`` at once share the continuous batch (neither waits for the other's whole job),
and a stream whose consumer stops early (``close()``, garbage collection, an exception in the
consumer) aborts its unfinished requests so they cost nothing more. Outputs are yielded outside
the lock. Source: the shape of vLLM's ``LLMEngine`` with per-request output queues
(``AsyncLLM``'s output handler).

Data-parallel routing: request i of a call goes to the replica whose prefix cache holds the
longest prefix of its prompt now (``Engine.cached_prefix_tokens``; ties to the first from
replica i % n on), or to replica i % n when none holds any (or caching is off). Seeds do not
follow the routing: a request without one samples with the seed replica i % n's host RNG draws
for it (``draw_seeds``), wherever it runs. Requests of one call that share a prefix not yet
cached are not grouped (the cache fills as they run). Source: the prefix-aware routing of
vLLM's and sglang's data-parallel load balancers, reduced to longest cached prefix.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence

from jaxinfer.engine.core import Engine
from jaxinfer.engine.parallel_sampling import (
    ParentRequest,
    child_id,
    child_params,
    child_resume,
    error_output,
)
from jaxinfer.engine.resume import ResumeState
from jaxinfer.errors import JaxinferError, RequestError
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling.sampler import SamplingParams

Encoder = Callable[[object], tuple[list[int], str | None]]
ResumeLike = ResumeState | Sequence[ResumeState | None] | None
"""A request's resume state; a sequence of n states for a request with ``n`` > 1."""


class EngineLoop:
    """The engines of one ``LLM`` (data-parallel replicas step in turn) behind one lock.

    Args:
        engines: the replicas; request i of a call goes to the replica holding the longest
            cached prefix of its prompt, else to replica i % len(engines) (module docstring).
    """

    def __init__(self, engines: Sequence[Engine]):
        self.engines = list(engines)
        self._lock = threading.Lock()
        # engine request id -> (its caller's outputs, its ParentRequest when n > 1, its index)
        self._routes: dict[str, tuple[collections.deque, ParentRequest | None, int]] = {}
        self._parents: set[str] = set()  # ids of running requests with n > 1
        self._ids = itertools.count()

    def next_id(self) -> int:
        """A process-unique number for default request ids (thread-safe)."""
        return next(self._ids)

    def stream(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[object],
        sampling_params: Sequence[SamplingParams],
        encode: Encoder,
        resume: Sequence[ResumeLike] | None = None,
    ) -> Iterator[RequestOutput]:
        """Adds the requests and yields their outputs (every new-token output, then the final one).

        A request that cannot be encoded or validated, or whose id is already running, yields
        one output with ``error`` set, first; the others go on. Closing the iterator early
        aborts its requests that have not finished. ``resume[i]`` (if given) continues request i
        from a partial output (``Engine.add_request``); for a request with ``n`` > 1 it is a
        sequence of n states, one per completion. A request with ``n`` > 1 runs as n engine
        requests and streams as `jaxinfer.engine.parallel_sampling` describes.
        """
        mine: collections.deque[RequestOutput] = collections.deque()
        errors, admitted = [], []
        if resume is None:
            resume = [None] * len(request_ids)
        rows = zip(request_ids, prompts, sampling_params, resume, strict=True)
        for i, (rid, prompt, sp, rs) in enumerate(rows):
            rid = str(rid)
            eng = self.engines[i % len(self.engines)]
            text = prompt if isinstance(prompt, str) else None
            n = sp.n if isinstance(sp, SamplingParams) else 1
            try:
                ids, text = encode(prompt)
                children = list(zip(child_params(sp), child_resume(sp, rs), strict=True))
                for csp, crs in children:
                    eng.validate(ids, csp, crs)
                admitted.append((eng, rid, ids, sp, text, children))
            except JaxinferError as e:
                errors.append(error_output(rid, text, str(e), n))
            except Exception as e:  # noqa: BLE001 - a tokenizer's own error on this prompt
                errors.append(
                    error_output(
                        rid,
                        text,
                        f"cannot encode the prompt: {type(e).__name__}: {str(e)[:500]}",
                        n,
                    )
                )
        pending: dict[str, list[str]] = {}  # request id -> its engine request ids
        with self._lock:
            for eng, rid, ids, sp, text, children in admitted:
                parent = None if sp.n == 1 else ParentRequest(rid, text, ids, sp.n)
                eids = [rid] if parent is None else parent.child_ids()
                try:
                    taken = [e for e in eids + [rid] if e in self._routes or e in self._parents]
                    if taken:
                        raise RequestError(self._duplicate_message(rid, taken[0]))
                    home, eng = eng, self._route(ids, eng)
                    for k, (eid, (csp, crs)) in enumerate(zip(eids, children, strict=True)):
                        if eng is not home and crs is None:  # the seed replica i % n draws
                            crs = ResumeState(home.draw_seed(csp))
                        try:
                            eng.add_request(eid, ids, csp, prompt=text, resume=crs)
                        except JaxinferError:
                            for e in eids[:k]:
                                eng.abort_request(e)
                            raise
                except JaxinferError as e:
                    errors.append(error_output(rid, text, str(e), sp.n))
                    continue
                for k, eid in enumerate(eids):
                    self._routes[eid] = (mine, parent, k)
                if parent is not None:
                    self._parents.add(rid)
                pending[rid] = eids
        yield from errors
        try:
            while pending:
                while mine:
                    out = mine.popleft()
                    if out.finished:
                        pending.pop(out.request_id, None)
                    yield out
                if not pending:
                    break
                with self._lock:
                    if not mine:  # nobody stepped for us while we waited for the lock
                        self._step_all()
        finally:
            if pending:  # the consumer stopped early: drop what it will never read
                with self._lock:
                    for rid, eids in pending.items():
                        self._parents.discard(rid)
                        for eid in eids:
                            self._routes.pop(eid, None)
                            for eng in self.engines:
                                eng.abort_request(eid)

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

    def _route(self, ids: list[int], home: Engine) -> Engine:
        """The replica a prompt runs on: the one whose prefix cache holds the most of ``ids``
        (ties to the first from ``home`` on), ``home`` (replica i % n) when none holds any
        (lock held)."""
        if len(self.engines) == 1:
            return home
        start = self.engines.index(home)
        order = self.engines[start:] + self.engines[:start]
        hits = [e.cached_prefix_tokens(ids) for e in order]
        best = max(hits)
        return order[hits.index(best)] if best > 0 else home

    def _duplicate_message(self, rid: str, taken: str) -> str:
        """Why request ``rid`` cannot run: id ``taken`` (its own or one of its completions') is
        in use (lock held)."""
        route = self._routes.get(taken)
        if route is not None and route[1] is not None:
            return (
                f"duplicate request id {rid!r}: {taken!r} is the id of completion {route[2]} "
                f"of the running request {route[1].request_id!r} (a request with n > 1 runs "
                "its completions as '<index>_<id>', vLLM's scheme)"
            )
        if taken == rid:
            return f"duplicate request id {rid!r}: a request with this id is still running"
        return (
            f"duplicate request id {rid!r}: its completion id {taken!r} ('<index>_<id>', "
            "vLLM's scheme for n > 1) is the id of a running request"
        )

    def _step_all(self) -> None:
        """One step of every replica with work; routes each output to its caller (lock held)."""
        for eng in self.engines:
            if not eng.has_unfinished():
                continue
            for out in eng.step():
                route = self._routes.get(out.request_id)
                if route is None:
                    continue  # its caller went away
                q, parent, index = route
                if out.finished:
                    del self._routes[out.request_id]
                if parent is None:
                    q.append(out)
                    continue
                outs, abort = parent.on_child(index, out)
                for k in abort:  # a sibling failed: the whole request fails (vLLM)
                    eid = child_id(parent.request_id, k)
                    self._routes.pop(eid, None)
                    eng.abort_request(eid)
                if parent.done:
                    self._parents.discard(parent.request_id)
                q.extend(outs)
