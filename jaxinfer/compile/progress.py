"""``jaxinfer generate``'s progress bar: prompts finished, output tokens generated so far and their
rate ("1234 tok, 98.7 tok/s"), and "compiling (k/n)" while a step compiles.

The bar's count is finished prompts, which in a batch whose requests all run at once stays at 0
until the first ones end; the token count moves with every step (``TokenCount``: the tokens this
run generated, from the streamed outputs, tokens carried over from a partial file not counted).

A cold run spends its first seconds compiling one step function per new bucket shape (the
forward step per ``Buckets.key``, the sampling step per row count and option set); without a
word on screen the bar would sit at 0/N. ``EngineCore.compile_keys`` grows when a step with a new
key is dispatched, and the jitted call compiles before it returns; the engine's ``num_steps``
only counts a step when its tokens are read back, which (async scheduling or not) comes after the
dispatch that grew the keys has returned. So "keys grew, and no step was counted since" means
"compiling".

k is the number of distinct step functions (keys, over all engines) dispatched so far, the one being
compiled included. n is the number of keys the job is predicted to meet (``jaxinfer.compile.plan``:
the whole workload run through an engine core over a stub runner, each output to its
``max_tokens``), given by ``CompileProgressBar.expect``; without a prediction (several engines,
speculative decoding...) only "compiling (k)" is shown, since the buckets bound the keys only
loosely (hundreds, where a job meets 5-20). The prediction is exact when no output stops early;
outputs that stop early (EOS, stop strings) skip some tail shapes, so a run may end with k < n. When
a run meets more keys than predicted (the job changed under it, an engine setting the plan does not
model), n grows with k ("k/k": the count is honest, the total is not known). A key whose executable
comes from JAX's in-memory or persistent cache, or was compiled on bucket reuse's background thread,
shows "compiling" only for the moment it takes to fetch it.
"""

from __future__ import annotations

import threading
import time


class CompileWatch:
    """The compile state from (number of compile keys, number of steps counted) observations:
    ``observe`` returns the text to show, "compiling (k/n)" (n = ``expected``, at least k) or
    "compiling (k)" when ``expected`` is None, or None when not compiling."""

    def __init__(self) -> None:
        self._keys = 0
        self._steps_at_growth: int | None = None  # num_steps when the keys last grew
        self.expected: int | None = None  # n: the keys predicted for the job (None: unknown)

    def observe(self, num_keys: int, num_steps: int) -> str | None:
        """``num_keys``: int, compile keys now; ``num_steps``: int, steps counted now."""
        if num_keys > self._keys:
            self._keys = num_keys
            self._steps_at_growth = num_steps
        elif self._steps_at_growth is not None and num_steps > self._steps_at_growth:
            self._steps_at_growth = None  # a step was counted after the growth: compiled
        if self._steps_at_growth is None:
            return None
        if self.expected is None:
            return f"compiling ({self._keys})"
        return f"compiling ({self._keys}/{max(self.expected, self._keys)})"


class TokenCount:
    """Output tokens generated in this run, from the outputs of ``LLM.generate_stream``.

    Each output holds a request's (or, for n > 1, one completion's) tokens so far in
    ``metrics.completion_tokens``, of which ``metrics.resumed_tokens`` were carried over from a
    partial file; the count adds what each output has beyond the last one seen for the same
    completion. A final output of an n > 1 request (all its completions, metrics summed) is
    compared with the sum of its completions' last counts."""

    def __init__(self) -> None:
        self.total = 0
        self._seen: dict[tuple[str, int], int] = {}  # (request id, completion index) -> tokens

    def add(self, out) -> int:
        """Counts ``out`` (a ``RequestOutput``); returns the tokens it added (int, >= 0)."""
        indices = [c.index for c in out.outputs] or [0]
        keys = [(out.request_id, i) for i in indices]
        now = out.metrics.completion_tokens - out.metrics.resumed_tokens
        new = max(0, now - sum(self._seen.get(k, 0) for k in keys))
        if out.finished or len(keys) > 1:
            for k in keys:
                self._seen.pop(k, None)
        else:
            self._seen[keys[0]] = now
        self.total += new
        return new


class CompileProgressBar:
    """Wraps a tqdm bar (``update``, ``set_postfix_str``, ``close``) for the engines of ``llm``
    (``llm.engines``): a daemon thread polls their ``compile_keys`` and ``num_steps`` every
    ``interval`` seconds and puts "compiling (k/n)" (n: ``expect``) or "compiling (k)" before the
    caller's postfix while a step compiles. Engines without ``compile_keys`` or ``num_steps`` are
    not watched. ``add_output`` counts generated tokens and shows "N tok, R tok/s" as the postfix
    (redrawn at most every ``interval`` seconds; R over the seconds since the bar was made)."""

    def __init__(self, bar, llm, interval: float = 0.1) -> None:
        self.bar = bar
        self._tokens = TokenCount()
        self._interval = interval
        self._t0 = time.perf_counter()
        self._last_shown = float("-inf")  # when the token postfix was last drawn
        engines = list(getattr(llm, "engines", []) or [])
        self._engines = [
            e for e in engines if hasattr(e, "compile_keys") and hasattr(e, "num_steps")
        ]
        self._watch = CompileWatch()
        self._postfix = ""
        self._shown: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if self._engines:
            self._thread = threading.Thread(
                target=self._poll, args=(interval,), daemon=True, name="jaxinfer-compile-progress"
            )
            self._thread.start()

    def _poll(self, interval: float) -> None:
        while not self._stop.is_set():
            with self._lock:
                self._tick()
            self._stop.wait(interval)

    def _tick(self) -> None:
        """Observes the engines; refreshes the line when the compile text changed (holds _lock)."""
        if not self._engines:
            return
        keys = sum(len(e.compile_keys) for e in self._engines)
        steps = sum(e.num_steps for e in self._engines)
        text = self._watch.observe(keys, steps)
        if text != self._shown:
            self._shown = text
            self._refresh()

    def _refresh(self) -> None:
        parts = [p for p in (self._shown, self._postfix) if p]
        self.bar.set_postfix_str(", ".join(parts))

    def expect(self, n: int) -> None:
        """Shows "compiling (k/n)" from now on: ``n``, int, the keys predicted for the job."""
        with self._lock:
            self._watch.expected = int(n)
            self._tick()

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.bar.update(n)

    @property
    def tokens(self) -> int:
        """Output tokens counted so far (``add_output``)."""
        return self._tokens.total

    def add_output(self, out) -> None:
        """Counts the new tokens of ``out`` (a streamed ``RequestOutput``); redraws the postfix
        "N tok, R tok/s" when ``interval`` seconds have passed since it was last drawn, or when
        ``out`` is a finished request."""
        self._tokens.add(out)
        now = time.perf_counter()
        if out.finished or now - self._last_shown >= self._interval:
            self._last_shown = now
            self.set_postfix_str(self._token_text(now))

    def _token_text(self, now: float) -> str:
        rate = self._tokens.total / max(now - self._t0, 1e-9)
        return f"{self._tokens.total} tok, {rate:.1f} tok/s"

    def set_postfix_str(self, s: str) -> None:
        with self._lock:
            self._postfix = s
            self._tick()  # a step was just counted: the line need not wait for the next poll
            self._refresh()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        with self._lock:
            if self._tokens.total:  # the final count, whatever the last redraw showed
                self._postfix = self._token_text(time.perf_counter())
            if self._shown is not None or self._tokens.total:  # nothing compiles any more
                self._shown = None
                self._refresh()
            self.bar.close()
