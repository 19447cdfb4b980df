"""Reusing a compiled bucket one size up instead of compiling a new one (cold start, issue 21).

A step's exact buckets (``batch.step_buckets``) are its compilation key; a key not seen yet costs
a full XLA compile (about 1 s for stories260K, 3-5 s for a ~110M model on a 2-core CPU), and a
batch job's tail meets new keys (fewer decode rows over longer block tables) for only a few steps
each. ``choose_buckets`` pads such a step up to an already compiled key that is at most one bucket
larger in every dimension (so the step costs at most about twice its exact shape). Once
``REUSE_STEPS`` steps have wanted the exact key (a shape that persists is worth its compile),
``BackgroundCompiler`` compiles it on a background thread while the padded steps go on, and the
engine switches to it when it is ready: no step waits for that compile (one-device engines; a
sharded one compiles it inline). ``BucketReuse`` is that policy, which ``EngineCore`` asks once
per dispatch; both work through the runner's public compile API (``ModelRunner.compile_keys``,
``compile``). Padding changes no row's values: padded rows and tokens write
only to the null page and are never sampled. Outputs of ``EngineConfig.batch_invariant`` engines
are bitwise the same either way; otherwise a row's floating point may differ in the last bits
with the batch's shape, as it does between any two batch compositions.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

from jaxinfer.engine.batch import Buckets, holds_within_one_bucket, next_pow2, sample_rows

REUSE_STEPS = 64
"""Steps that want an uncompiled key, padded to a compiled one, before that key is compiled. A
padded step costs up to twice its exact step, a compile seconds: 64 padded steps cost less than
the compile they may save (figures: docs/performance.md, "Design measurements")."""


def choose_buckets(need: Buckets, compiled: set, sample_flags: tuple) -> Buckets:
    """The buckets to run a step whose exact buckets are ``need``: ``need`` itself when it is
    compiled, else the cheapest (fewest tokens) compiled forward key with every dimension in
    [need, one bucket up], preferring those whose sampling variant is compiled too (else that
    variant compiles, far cheaper than a forward step), else ``need`` (it compiles).

    Args:
        need: the step's exact buckets.
        compiled: compile keys (``ModelRunner.compile_keys``: ``("forward", key)``,
            ``("sample", rows, *flags)``...).
        sample_flags: the step's ``sampling.sample_flags``, (logits controls, number of logprobs)
            or ``sampling.GREEDY_FLAGS``: the tail of the sampling key.
    """
    if ("forward", need.key) in compiled:
        return need
    best = None
    for kind, *rest in compiled:
        if kind != "forward":
            continue
        key = rest[0]
        if not holds_within_one_bucket(need.key, key):
            continue
        td, tp, bp, _ = key
        sample_missing = ("sample", next_pow2(td + bp), *sample_flags) not in compiled
        cost = (sample_missing, td + tp, key)
        if best is None or cost < best[0]:
            best = (cost, key)
    return need if best is None else Buckets(*best[1])


class BucketReuse:
    """Chooses each step's buckets over a runner's compile keys (module docstring).

    Args:
        runner: the ``ModelRunner`` (or a stand-in with ``compile_keys``) whose keys are reused.
        enabled: ``EngineConfig.reuse_compiled_buckets``; False: every step runs its exact buckets.
        compiler: the ``BackgroundCompiler`` that compiles a persistent key, or None (such a key
            then compiles inline, as any new shape).

    Attributes:
        wanted: uncompiled exact bucket tuple -> steps padded past it so far.
    """

    def __init__(self, runner, enabled: bool, compiler: BackgroundCompiler | None):
        self.runner, self.enabled, self.compiler = runner, enabled, compiler
        self.wanted: dict[tuple, int] = {}

    def choose(self, need: Buckets, flags: tuple, exact: bool = False) -> Buckets:
        """The buckets to run a step of exact buckets ``need`` and sampling flags ``flags``
        (``sampling.sample_flags``) with: ``need`` when it is compiled, reuse is off or
        ``exact`` (a step with prompt logprobs), else ``choose_buckets`` over the compiled keys
        ready now. Once ``REUSE_STEPS`` steps have wanted ``need`` padded, starts compiling it in
        the background (its keys count as compiled from then on) and pads meanwhile."""
        keys = self.runner.compile_keys
        usable = keys
        if self.compiler is not None and self.compiler.pending:
            keys.difference_update(self.compiler.poll())
            usable = keys - self.compiler.pending  # counted, not ready yet
        if ("forward", need.key) in usable or not self.enabled or exact:
            return need
        chosen = choose_buckets(need, usable, flags)
        if chosen != need and self.wanted.get(need.key, 0) >= REUSE_STEPS:
            if self.compiler is None or need.key in self.compiler.failed:
                return need  # compiles inline, as any new shape
            # Padded steps go on meanwhile; the keys count as compiled from now on.
            keys.update(self.compiler.submit(need, flags, keys))
        return chosen

    def dispatching(self, need: Buckets, chosen: Buckets) -> None:
        """Called as a step of exact buckets ``need`` is dispatched padded to ``chosen``: waits for
        a background compile of ``chosen`` (not compile it twice), and counts a padded step
        towards compiling ``need``."""
        if self.compiler is not None:
            self.compiler.wait_for(chosen.key)
        if chosen != need:
            self.wanted[need.key] = self.wanted.get(need.key, 0) + 1


class BackgroundCompiler:
    """Compiles a runner's step shapes (a forward key and its sampling variants) on one
    background thread, ahead of time (``ModelRunner.compile``: ``jit(...).lower(...).compile()``
    fills jax's caches, so the first dispatch of the shape then compiles nothing). One-device
    runners only: the KV pool is lowered as shapes without shardings (it is donated step by
    step), as the dispatches see it. Used from the engine's thread only.

    Args:
        runner: the ``ModelRunner`` (its ``compile``).
        inline: compile at ``submit``, on the caller's thread (the job plan's stub runner, whose
            compile does nothing: a submitted key is ready by the next step).
    """

    def __init__(self, runner, inline: bool = False):
        self._runner = runner
        self._inline = inline
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[tuple, tuple[list, Future]] = {}
        self.failed: dict[tuple, str] = {}  # key -> why its compile failed (compiles inline then)
        self.compiled: list[tuple] = []  # keys compiled here, in order (observability, tests)
        self.pending: set = set()  # compile keys counted by the engine, compiling here still
        self.waited_s = 0.0  # seconds steps spent waiting for a compile here (``wait_for``)

    def _compile_fn(self, key: tuple, flags: tuple):
        """A function compiling forward bucket tuple ``key`` and its sampling variant ``flags``
        (``sampling.sample_flags``)."""
        runner, b = self._runner, sample_rows(key[0], key[2])

        def compile_both():
            runner.compile(("forward", key))
            runner.compile(("sample", b, *flags))

        return compile_both

    def _submit(self, fn) -> Future:
        if self._inline:
            fut = Future()
            try:
                fut.set_result(fn())
            except Exception as e:  # noqa: BLE001 - reported by poll, as a thread's would be
                fut.set_exception(e)
            return fut
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-compile")
        return self._pool.submit(fn)

    def submit(self, need: Buckets, sample_flags: tuple, compiled: set) -> list:
        """Starts compiling ``need`` and its sampling variant (idempotent). Returns their compile
        keys not in ``compiled`` yet: the engine counts them now (so its compile count depends on
        its steps only, not on when the thread finishes) and ``pending`` holds them until done.
        """
        if need.key in self._futures or need.key in self.failed:
            return []
        b = sample_rows(need.decode_rows, need.prefill_rows)
        keys = [
            k for k in (("forward", need.key), ("sample", b, *sample_flags)) if k not in compiled
        ]
        self._futures[need.key] = (keys, self._submit(self._compile_fn(need.key, sample_flags)))
        self.pending.update(keys)
        return keys

    def wait_for(self, key: tuple) -> None:
        """Blocks until a compile of forward bucket tuple ``key`` submitted here has finished (a
        failed one: the dispatch then compiles it inline and meets the error); returns at once
        when none is in progress."""
        fut = self._futures[key][1] if key in self._futures else None
        if fut is not None and not fut.done():
            t0 = time.perf_counter()
            fut.exception()
            self.waited_s += time.perf_counter() - t0

    def poll(self) -> list[tuple]:
        """Retires the compiles finished since the last poll (their keys leave ``pending``;
        a finished forward key goes to ``compiled``). Returns the keys of failed ones (they go
        to ``failed``; the engine forgets them and compiles them inline)."""
        failed = []
        done = [(key, keys, fut) for key, (keys, fut) in self._futures.items() if fut.done()]
        for key, keys, fut in done:
            del self._futures[key]
            self.pending.difference_update(keys)
            exc = fut.exception()
            if exc is not None:
                self.failed[key] = f"{type(exc).__name__}: {exc}"
                failed += keys
            else:
                self.compiled.append(key)
        return failed

    def wait(self) -> None:
        """Blocks until every submitted compile has finished (or failed)."""
        for _, fut in list(self._futures.values()):
            fut.exception()
