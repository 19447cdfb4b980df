"""The server's engine thread: one loop steps the engines for every connected client.

HTTP handlers run on the asyncio event loop and never step the engine. They hand requests to
``AsyncEngine.submit`` (validated already) and read outputs from an ``OutputStream``; the engine
thread adds the requests between steps, steps every replica while there is work, appends each
output to its request's stream and, once per step, wakes the streams that got outputs (one
``loop.call_soon_threadsafe`` per step, not one per output). A handler that falls behind gets its
backlog merged per sequence (latest state, ``delta_text`` joined: vLLM's
``RequestOutputCollector``), so it sends fewer, larger chunks instead of falling further behind.
``abort`` (a client that went away) is applied before the next step, so an aborted request's
pages are free within one step.

The thread shares the ``LLM``'s ``EngineLoop`` (its lock and its output routes), so ``LLM.generate``
called in the same process while the server runs joins the same continuous batch. Source: the
shape of vLLM's ``AsyncLLM`` (engine core in its own loop, per-request output queues).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from jaxinfer.errors import JaxinferError
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling.params import SamplingParams

log = logging.getLogger("jaxinfer.server")


class Overloaded(Exception):
    """More sequences than ``max_num_seqs`` (times replicas) plus ``max_queue`` would be waiting."""


class ShuttingDown(Exception):
    """The engine thread has stopped (or died): no request can be added."""


@dataclass
class EngineRequest:
    """One engine sequence: a validated prompt (token ids) and its params (``n`` = 1; a
    request with ``n`` > 1 is n of them, ``parallel_sampling.child_params``)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None


class OutputStream:
    """The outputs of one HTTP request's sequences, from the engine thread to its handler.

    The engine thread appends (``_Sink``); the handler awaits ``get``, which returns every output
    that arrived since its last call, merged per sequence: consecutive outputs of one sequence
    become the latest of them with their ``delta_text`` joined (the other fields of an output
    are cumulative: text, token_ids, logprobs). Outputs of different sequences keep their order.
    ``disconnect`` (the client went away) makes the pending and every later ``get`` return None.
    Create it on the event loop that reads it.
    """

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self._items: collections.deque[RequestOutput] = collections.deque()  # thread-safe ends
        self._event = asyncio.Event()
        self.disconnected = False

    def _wake(self) -> None:  # event loop only
        self._event.set()

    def disconnect(self) -> None:
        """The client went away (event loop only)."""
        self.disconnected = True
        self._event.set()

    async def get(self) -> list[RequestOutput] | None:
        """Waits for outputs; returns them merged per sequence, or None once disconnected."""
        while not self._items and not self.disconnected:
            self._event.clear()
            if self._items:  # appended before the clear: its wake-up may already have run
                break
            await self._event.wait()
        if self.disconnected:
            return None
        merged: dict[str, RequestOutput] = {}
        while self._items:
            out = self._items.popleft()
            prev = merged.pop(out.request_id, None)  # re-inserted: ordered by its latest output
            if prev is not None and prev.delta_text and out.error is None:
                out = dataclasses.replace(
                    out, delta_text=prev.delta_text + (out.delta_text or ""), outputs=None
                )
            merged[out.request_id] = out
        return list(merged.values())


class _Sink:
    """Route of one HTTP request's outputs into its ``OutputStream`` (EngineLoop calls
    ``append`` under its lock, on the engine thread); the stream is woken by ``AsyncEngine``
    once the step's outputs are all in."""

    def __init__(self, engine: AsyncEngine, stream: OutputStream):
        self.engine, self.stream = engine, stream

    def append(self, out: RequestOutput) -> None:
        self.stream._items.append(out)
        self.engine._dirty[id(self.stream)] = self.stream

    def extend(self, outs) -> None:
        for out in outs:
            self.append(out)


def _wake_all(streams: list[OutputStream]) -> None:
    for s in streams:
        s._wake()


class AsyncEngine:
    """Background stepping of an ``LLM``'s engines for asyncio handlers.

    Args:
        llm: the loaded ``LLM``.
        max_queue: most sequences accepted beyond the running capacity (``max_num_seqs`` per
            replica); ``submit`` raises ``Overloaded`` past it. None: no limit.
    """

    def __init__(self, llm, max_queue: int | None = None):
        self.llm = llm
        self._eloop = llm._loop  # the LLM's EngineLoop: its lock, routes and _step_all
        self.engines = list(self._eloop.engines)
        self.capacity = (
            None
            if max_queue is None
            else (sum(e.ecfg.max_num_seqs for e in self.engines) + max_queue)
        )
        self.outstanding = 0  # sequences submitted and not yet finished or aborted
        self._cv = threading.Condition()
        self._adds: list[tuple[EngineRequest, _Sink]] = []
        self._aborts: list[str] = []
        self._mine: set[str] = set()  # request ids routed to a sink (engine thread only)
        self._dirty: dict[int, OutputStream] = {}  # streams with outputs to wake (engine thread)
        self._replica = itertools.count()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # why the thread died, if it did

    # ------------------------------------------------------------------ asyncio side

    def submit(self, requests: Sequence[EngineRequest], stream: OutputStream) -> None:
        """Queues ``requests`` for the engine thread; their outputs go to ``stream``.

        Raises:
            Overloaded: accepting them would exceed ``max_queue``.
            ShuttingDown: the engine thread is not running.
        """
        if not self.alive:
            raise ShuttingDown(
                "the engine is not running"
                + (f" (it failed: {type(self.error).__name__}: {self.error})" if self.error else "")
            )
        if self.capacity is not None and self.outstanding + len(requests) > self.capacity:
            raise Overloaded(
                f"{self.outstanding} sequences are running or queued; the server "
                f"takes at most {self.capacity} (max_num_seqs + --max-queue)"
            )
        sink = _Sink(self, stream)
        self.outstanding += len(requests)
        with self._cv:
            self._adds.extend((r, sink) for r in requests)
            self._cv.notify()

    def release(self, n: int) -> None:
        """``n`` submitted sequences finished or were aborted (asyncio side)."""
        self.outstanding -= n

    def abort(self, request_ids: Sequence[str]) -> None:
        """Drops requests whose client went away; applied before the next step."""
        with self._cv:
            self._aborts.extend(request_ids)
            self._cv.notify()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    def num_queued(self) -> int:
        """Sequences submitted but not yet handed to an engine."""
        return len(self._adds)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="jaxinfer-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the thread; requests still running are aborted."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ engine thread

    def _has_work(self) -> bool:
        return any(e.has_unfinished() for e in self.engines)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._adds or self._aborts or self._stop or self._has_work()):
                        self._cv.wait(0.5)
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                    stop = self._stop
                with self._eloop._lock:
                    if stop:
                        self._abort_locked(list(self._mine) + [r.request_id for r, _ in adds])
                        return
                    self._abort_locked(aborts)
                    for req, sink in adds:
                        self._add_locked(req, sink)
                    if self._has_work():
                        self._step_locked()
                self._flush()
        except BaseException as e:  # noqa: BLE001 - reported by /health and every later submit
            self.error = e
            log.exception("the engine thread stopped")
            with self._eloop._lock:
                self._fail_mine_locked(f"the engine stopped: {type(e).__name__}: {e}")
            self._flush()
            raise

    def _flush(self) -> None:
        """Wakes the streams that got outputs: one ``call_soon_threadsafe`` per event loop."""
        if not self._dirty:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[OutputStream]] = {}
        for s in self._dirty.values():
            by_loop.setdefault(s.loop, []).append(s)
        self._dirty = {}
        for loop, streams in by_loop.items():
            try:
                loop.call_soon_threadsafe(_wake_all, streams)
            except RuntimeError:  # the event loop is closed: nobody will read them
                pass

    def _abort_locked(self, request_ids) -> None:
        for rid in request_ids:
            self._eloop._routes.pop(rid, None)
            self._mine.discard(rid)
            for eng in self.engines:
                eng.abort_request(rid)

    def _add_locked(self, req: EngineRequest, sink: _Sink) -> None:
        # Round robin, unless a replica's prefix cache holds part of the prompt (EngineLoop's rule).
        home = self.engines[next(self._replica) % len(self.engines)]
        eng = self._eloop._route(req.prompt_ids, home)
        try:
            if req.request_id in self._eloop._routes:
                raise JaxinferError(f"duplicate request id {req.request_id!r}")
            eng.add_request(req.request_id, req.prompt_ids, req.params, prompt=req.prompt_text)
        except JaxinferError as e:
            sink.append(_error_output(req.request_id, req.prompt_text, str(e)))
            return
        self._eloop._routes[req.request_id] = (sink, None, 0)  # EngineLoop's (queue, parent, i)
        self._mine.add(req.request_id)

    def _step_locked(self) -> None:
        """One step of every replica with work (``EngineLoop._step_all`` routes the outputs).
        An exception that escapes the engine's own recovery fails this thread's requests (500s)
        and leaves the engines to recover on the next step."""
        try:
            self._eloop._step_all()
        except Exception as e:  # noqa: BLE001
            log.exception("engine step failed")
            self._fail_mine_locked(f"engine step failed: {type(e).__name__}: {e}")
        self._mine = {rid for rid in self._mine if rid in self._eloop._routes}

    def _fail_mine_locked(self, message: str) -> None:
        for rid in list(self._mine):
            route = self._eloop._routes.pop(rid, None)
            for eng in self.engines:
                eng.abort_request(rid)
            if route is not None:
                route[0].append(_error_output(rid, None, message))
        self._mine.clear()


def _error_output(request_id: str, prompt: str | None, error: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=[],
        finish_reason="error",
        error=error,
    )
