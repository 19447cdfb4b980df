"""One engine loop shared by every caller of an ``LLM``: threads and interleaved streams.

Each call to ``EngineLoop.stream`` adds its requests to the engines and then, until they finish,
either takes outputs routed to it or, when it has none, steps the engines itself under the loop's
lock and routes every output to the call that owns the request. So two threads calling
``LLM.generate`` at once share the continuous batch (neither waits for the other's whole job),
and a stream whose consumer stops early (``close()``, garbage collection, an exception in the
consumer) aborts its unfinished requests so they cost nothing more. Outputs are yielded outside
the lock. Source: the shape of vLLM's ``LLMEngine`` with per-request output queues
(``AsyncLLM``'s output handler).
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence

from jaxinfer.engine import Engine
from jaxinfer.errors import JaxinferError, RequestError
from jaxinfer.outputs import RequestOutput
from jaxinfer.resume import ResumeState
from jaxinfer.sampling import SamplingParams

Encoder = Callable[[object], tuple[list[int], str | None]]


class EngineLoop:
    """The engines of one ``LLM`` (data-parallel replicas step in turn) behind one lock.

    Args:
        engines: the replicas; request i of a call goes to replica i % len(engines).
    """

    def __init__(self, engines: Sequence[Engine]):
        self.engines = list(engines)
        self._lock = threading.Lock()
        self._routes: dict[str, collections.deque] = {}  # request id -> its caller's outputs
        self._ids = itertools.count()

    def next_id(self) -> int:
        """A process-unique number for default request ids (thread-safe)."""
        return next(self._ids)

    def stream(self, request_ids: Sequence[str], prompts: Sequence[object],
               sampling_params: Sequence[SamplingParams], encode: Encoder,
               resume: Sequence[ResumeState | None] | None = None) -> Iterator[RequestOutput]:
        """Adds the requests and yields their outputs (every new-token output, then the final one).

        A request that cannot be encoded or validated, or whose id is already running, yields
        one output with ``error`` set, first; the others go on. Closing the iterator early
        aborts its requests that have not finished. ``resume[i]`` (if given) continues request i
        from a partial output (``Engine.add_request``).
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
            try:
                ids, text = encode(prompt)
                eng.validate(ids, sp, rs)
                admitted.append((eng, rid, ids, sp, text, rs))
            except JaxinferError as e:
                errors.append(_error_output(rid, text, str(e)))
            except Exception as e:  # noqa: BLE001 - a tokenizer's own error on this prompt
                errors.append(_error_output(rid, text, f"cannot encode the prompt: "
                                                       f"{type(e).__name__}: {str(e)[:500]}"))
        pending: set[str] = set()
        with self._lock:
            for eng, rid, ids, sp, text, rs in admitted:
                try:
                    if rid in self._routes:
                        raise RequestError(f"duplicate request id {rid!r}: a request with this "
                                           "id is still running")
                    eng.add_request(rid, ids, sp, prompt=text, resume=rs)
                except JaxinferError as e:
                    errors.append(_error_output(rid, text, str(e)))
                    continue
                self._routes[rid] = mine
                pending.add(rid)
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
                        self._step_all()
        finally:
            if pending:  # the consumer stopped early: drop what it will never read
                with self._lock:
                    for rid in pending:
                        self._routes.pop(rid, None)
                        for eng in self.engines:
                            eng.abort_request(rid)

    def draw_seeds(self, sampling_params: Sequence[SamplingParams]) -> list[int]:
        """The seeds requests with these params would sample with if ``stream`` got them now in
        this order (request i on replica i % n): each one's own, or one drawn from its replica's
        host RNG (advancing it, so ``stream`` then draws other seeds)."""
        with self._lock:
            return [self.engines[i % len(self.engines)].draw_seed(sp)
                    for i, sp in enumerate(sampling_params)]

    def _step_all(self) -> None:
        """One step of every replica with work; routes each output to its caller (lock held)."""
        for eng in self.engines:
            if not eng.has_unfinished():
                continue
            for out in eng.step():
                q = self._routes.get(out.request_id)
                if q is None:
                    continue  # its caller went away
                q.append(out)
                if out.finished:
                    del self._routes[out.request_id]


def _error_output(request_id: str, prompt: str | None, error: str) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=[],
                         finish_reason="error", error=error)
