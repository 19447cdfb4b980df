"""The server's engine thread: one thread steps the engines for every connected client.

HTTP handlers run on the asyncio event loop and never step the engine. They process a request
through the ``LLM``'s ``EngineLoop`` (encoded and validated there, once: a bad one is refused
before it is queued), hand it to ``AsyncEngine.submit`` and read its outputs from an
``OutputStream``. The engine thread adds the submitted requests between steps
(``EngineLoop.add``, whose sink is the request's stream), steps while there is work
(``EngineLoop.step``) and, once per step, wakes the streams that got outputs (one
``loop.call_soon_threadsafe`` per step, not one per output). A handler that falls behind gets its
backlog merged per completion (latest state, ``delta_text`` joined: vLLM's
``RequestOutputCollector``), so it sends fewer, larger chunks instead of falling further behind.
``abort`` (a client that went away) is applied before the next step, so an aborted request's
pages are free within one step.

The thread uses only ``EngineLoop``'s public methods, the same ones ``LLM.generate`` uses, so
``LLM.generate`` called in the same process while the server runs joins the same continuous
batch. Source: the shape of vLLM's ``AsyncLLM`` (engine core in its own loop, per-request output
collectors).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import threading
from collections.abc import Sequence

from jaxinfer.engine.inputs import ProcessedRequest
from jaxinfer.engine.parallel_sampling import error_output
from jaxinfer.errors import JaxinferError
from jaxinfer.outputs import RequestOutput

log = logging.getLogger("jaxinfer.server")


class Overloaded(Exception):
    """More sequences than ``max_num_seqs`` (times replicas) plus ``max_queue`` would be waiting."""


class ShuttingDown(Exception):
    """The engine thread has stopped (or died): no request can be added."""


def completion_key(out: RequestOutput) -> tuple[str, int | None]:
    """Which stream of a request's outputs ``out`` continues: (request id, completion index) for
    an output of one completion (every output of a request with n = 1, the streamed outputs of one
    with n > 1), (request id, None) for the final output of a request with n > 1."""
    return out.request_id, (out.outputs[0].index if len(out.outputs) == 1 else None)


class OutputStream:
    """The outputs of one HTTP request, from the engine thread to its handler.

    The engine thread calls ``put``; the handler awaits ``get``, which returns every output that
    arrived since its last call, merged per completion (``completion_key``): consecutive outputs
    of one completion become the latest of them with their ``delta_text`` joined (the other
    fields of an output are cumulative: text, token_ids, logprobs). Outputs of different
    completions keep their order. ``disconnect`` (the client went away) makes the pending and
    every later ``get`` return None. Create it on the event loop that reads it.
    """

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self._items: collections.deque[RequestOutput] = collections.deque()  # thread-safe ends
        self._event = asyncio.Event()
        self.disconnected = False

    def put(self, out: RequestOutput) -> None:
        """Appends an output (any thread); ``wake`` makes ``get`` see it."""
        self._items.append(out)

    def wake(self) -> None:
        """Wakes a pending ``get`` (event loop only)."""
        self._event.set()

    def disconnect(self) -> None:
        """The client went away (event loop only)."""
        self.disconnected = True
        self._event.set()

    async def get(self) -> list[RequestOutput] | None:
        """Waits for outputs; returns them merged per completion, or None once disconnected."""
        while not self._items and not self.disconnected:
            self._event.clear()
            if self._items:  # appended before the clear: its wake-up may already have run
                break
            await self._event.wait()
        if self.disconnected:
            return None
        merged: dict[tuple[str, int | None], RequestOutput] = {}
        while self._items:
            out = self._items.popleft()
            key = completion_key(out)
            prev = merged.pop(key, None)  # re-inserted: ordered by its latest output
            if prev is not None and prev.delta_text and out.error is None:
                delta = prev.delta_text + (out.delta_text or "")
                comp = dataclasses.replace(out.outputs[0], delta_text=delta)
                out = dataclasses.replace(out, delta_text=delta, outputs=[comp])
            merged[key] = out
        return list(merged.values())


def _wake_all(streams: list[OutputStream]) -> None:
    for s in streams:
        s.wake()


class AsyncEngine:
    """Background stepping of an ``LLM``'s engines for asyncio handlers.

    Args:
        llm: the loaded ``LLM`` (its ``engine_loop`` is stepped).
        max_queue: most sequences accepted beyond the running capacity (``max_num_seqs`` per
            replica); ``submit`` raises ``Overloaded`` past it. None: no limit.
    """

    def __init__(self, llm, max_queue: int | None = None):
        self.llm = llm
        self.loop = llm.engine_loop
        self.engines = list(self.loop.engines)
        self.capacity = (
            None
            if max_queue is None
            else (sum(e.ecfg.max_num_seqs for e in self.engines) + max_queue)
        )
        self.outstanding = 0  # sequences submitted and not yet finished or aborted
        self._cv = threading.Condition()
        self._adds: list[tuple[ProcessedRequest, OutputStream]] = []
        self._aborts: list[str] = []
        # request id -> (its stream, n): added and not finished (engine thread only)
        self._mine: dict[str, tuple[OutputStream, int]] = {}
        self._dirty: dict[int, OutputStream] = {}  # streams with outputs to wake (engine thread)
        self._stop = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # why the thread died, if it did

    # ------------------------------------------------------------------ asyncio side

    def submit(self, requests: Sequence[ProcessedRequest], stream: OutputStream) -> None:
        """Queues processed requests (``EngineLoop.process``) for the engine thread; their
        outputs go to ``stream``.

        Raises:
            Overloaded: accepting them would exceed ``max_queue``.
            ShuttingDown: the engine thread is not running.
        """
        if not self.alive:
            raise ShuttingDown(
                "the engine is not running"
                + (f" (it failed: {type(self.error).__name__}: {self.error})" if self.error else "")
            )
        seqs = sum(r.n for r in requests)
        if self.capacity is not None and self.outstanding + seqs > self.capacity:
            raise Overloaded(
                f"{self.outstanding} sequences are running or queued; the server "
                f"takes at most {self.capacity} (max_num_seqs + --max-queue)"
            )
        self.outstanding += seqs
        with self._cv:
            self._adds.extend((r, stream) for r in requests)
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
        return sum(r.n for r, _ in list(self._adds))

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

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._adds or self._aborts or self._stop or self.loop.has_work()):
                        self._cv.wait(0.5)
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                    stop = self._stop
                if stop:
                    self.loop.abort(list(self._mine))
                    self._mine.clear()
                    return
                self._apply_aborts(aborts)
                for req, stream in adds:
                    self._add(req, stream)
                self._step()
                self._flush()
        except BaseException as e:  # noqa: BLE001 - reported by /health and every later submit
            self.error = e
            log.exception("the engine thread stopped")
            self._fail_mine(f"the engine stopped: {type(e).__name__}: {e}")
            self._flush()
            raise

    def _deliver(self, stream: OutputStream, out: RequestOutput) -> None:
        """The sink of this thread's requests (``EngineLoop`` calls it as it routes outputs)."""
        stream.put(out)
        self._dirty[id(stream)] = stream
        if out.finished:
            self._mine.pop(out.request_id, None)

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

    def _apply_aborts(self, request_ids: list[str]) -> None:
        self.loop.abort(request_ids)
        for rid in request_ids:
            self._mine.pop(rid, None)

    def _add(self, req: ProcessedRequest, stream: OutputStream) -> None:
        try:
            self.loop.add(req, functools.partial(self._deliver, stream))
        except JaxinferError as e:  # a duplicate id
            self._deliver(stream, error_output(req.request_id, req.prompt_text, str(e), req.n))
            return
        self._mine[req.request_id] = (stream, req.n)

    def _step(self) -> None:
        """One step of every replica with work. An exception that escapes the engine's own
        recovery fails this thread's requests (500s) and leaves the engines to recover on the
        next step."""
        try:
            self.loop.step()
        except Exception as e:  # noqa: BLE001
            log.exception("engine step failed")
            self._fail_mine(f"engine step failed: {type(e).__name__}: {e}")

    def _fail_mine(self, message: str) -> None:
        mine, self._mine = self._mine, {}
        self.loop.abort(list(mine))
        for rid, (stream, n) in mine.items():
            self._deliver(stream, error_output(rid, None, message, n))
