"""Reusing a compiled bucket one size up instead of compiling a new one (cold start, issue 21).

A step's exact buckets (``batch.step_buckets``) are its compilation key; a key not seen yet costs
a full XLA compile (about 1 s for stories260K, 3-5 s for a ~110M model on a 2-core CPU), and a
batch job's tail meets new keys (fewer decode rows over longer block tables) for only a few steps
each. ``choose_buckets`` pads such a step up to an already compiled key that is at most one bucket
larger in every dimension (so the step costs at most about twice its exact shape). Once
``REUSE_STEPS`` steps have wanted the exact key (a shape that persists is worth its compile),
``BackgroundCompiler`` compiles it on a background thread while the padded steps go on, and the
engine switches to it when it is ready: no step waits for that compile (one-device engines; a
sharded one compiles it inline). Padding changes no row's values: padded rows and tokens write
only to the null page and are never sampled. Outputs of ``EngineConfig.batch_invariant`` engines
are bitwise the same either way; otherwise a row's floating point may differ in the last bits
with the batch's shape, as it does between any two batch compositions.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np

from jaxinfer.engine.batch import Buckets, holds_within_one_bucket, next_pow2

REUSE_STEPS = 64
"""Steps that want an uncompiled key, padded to a compiled one, before that key is compiled. A
padded step costs up to ~2x (batch-1 decode of a ~110M model on 2 cores: ~25 ms more), a compile
~1-5 s: 64 padded steps cost less than the compile they may save."""


def choose_buckets(need: Buckets, compiled: set, sample_flags: tuple) -> Buckets:
    """The buckets to run a step whose exact buckets are ``need``: ``need`` itself when it is
    compiled, else the cheapest (fewest tokens) compiled forward key with every dimension in
    [need, one bucket up], preferring those whose sampling variant is compiled too (else that
    variant compiles, far cheaper than a forward step), else ``need`` (it compiles).

    Args:
        need: the step's exact buckets.
        compiled: ``Engine.compile_keys`` (``("forward", key)``, ``("sample", rows, *flags)``...).
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


class BackgroundCompiler:
    """Compiles an engine's step shapes (forward and its sampling variant) on one background
    thread, ahead of time (``jit(...).lower(...).compile()`` fills jax's caches, so the first
    dispatch of the shape then compiles nothing). One-device engines only: the KV pool is
    lowered as shapes without shardings (it is donated step by step), as the dispatches see it.
    """

    def __init__(self, engine):
        self._engine = engine
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[tuple, tuple[tuple, Future]] = {}
        self.failed: dict[tuple, str] = {}  # key -> why its compile failed (compiles inline then)
        self.compiled: list[tuple] = []  # keys compiled here, in order (observability, tests)
        self.pending: set = set()  # compile keys counted by the engine, compiling here still
        # Keys submitted ahead of use (``submit_ahead``), not counted by the engine until a step
        # dispatches them: bucket tuple -> its compile's future.
        self._ahead: dict[tuple, Future] = {}
        self._lock = threading.Lock()  # submit_ahead may run on another thread (job_plan)
        self.waited_s = 0.0  # seconds steps spent waiting for a compile here (``wait_for``)

    def _compile_fn(self, key: tuple, sample_flags: list[tuple], after_first_step: bool = False):
        """A function compiling forward bucket tuple ``key`` and its sampling variants of each
        flags in ``sample_flags`` (``sampling.sample_flags``: (controls, num_logprobs) or
        ``sampling.GREEDY_FLAGS``), with the engine's static arguments; with
        ``after_first_step`` it first waits until the engine has read a step's tokens back (its
        ``num_steps``), so it does not compete with the first step's own compile."""
        from jaxinfer.compile.warmup import dummy_step_batch, sample_rows

        e = self._engine
        kv = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), e.kv)
        batch = dummy_step_batch(key, e.ecfg.page_size)
        static = dict(cfg=e.cfg, attn_impl=e.ecfg.attn_impl, batch_invariant=e.ecfg.batch_invariant)
        b = sample_rows(key[0], key[2])

        def compile_both():
            from jaxinfer.engine.step import LogitsControls
            from jaxinfer.sampling.sampler import GREEDY_FLAGS, SamplingParams, SamplingTensors

            while after_first_step and getattr(e, "num_steps", 1) == 0:
                time.sleep(0.02)
            lowered = e._forward.lower(e.params, kv, batch, e._no_prev, **static)
            logits = jax.ShapeDtypeStruct(lowered.out_info[1].shape, lowered.out_info[1].dtype)
            lowered.compile()
            st = SamplingTensors.from_params(
                [SamplingParams(temperature=0.0)] * b, [0] * b, [0] * b, pad_to=b
            )
            v = e.cfg.vocab_size
            for flags in sample_flags:
                controls_on, num_lp = flags[:2]
                controls = (
                    None
                    if not controls_on
                    else LogitsControls(
                        np.zeros((b, v), bool), np.zeros((b, v), np.int32), np.zeros((b, v), bool)
                    )
                )
                e._sample.lower(
                    logits,
                    st,
                    controls,
                    num_logprobs=num_lp,
                    num_slots=e._num_slots,
                    batch_invariant=e.ecfg.batch_invariant,
                    greedy=tuple(flags) == GREEDY_FLAGS,
                ).compile()

        return compile_both

    def _submit(self, fn) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-compile")
        return self._pool.submit(fn)

    def submit(self, need: Buckets, sample_flags: tuple, compiled: set) -> list:
        """Starts compiling ``need`` and its sampling variant (idempotent). Returns their compile
        keys not in ``compiled`` yet: the engine counts them now (so its compile count depends on
        its steps only, not on when the thread finishes) and ``pending`` holds them until done.
        A key already submitted ahead (``submit_ahead``) is not compiled again: its compile's
        future stands for this one.
        """
        from jaxinfer.compile.warmup import sample_rows

        with self._lock:
            if need.key in self._futures or need.key in self.failed:
                return []
            b = sample_rows(need.decode_rows, need.prefill_rows)
            fut = self._ahead.get(need.key)
            if fut is None:
                fut = self._submit(self._compile_fn(need.key, [sample_flags]))
            keys = [
                k
                for k in (("forward", need.key), ("sample", b, *sample_flags))
                if k not in compiled
            ]
            self._futures[need.key] = (keys, fut)
            self.pending.update(keys)
            return keys

    def submit_ahead(self, keys: list[tuple], sample_flags: dict[int, list[tuple]]) -> None:
        """Queues forward bucket tuples ``keys`` (in this order) for compiling, each with the
        sampling variants ``sample_flags[B']`` of its sampled rows B' (default: the plain one,
        (False, 0)).
        Nothing is counted in the engine's ``compile_keys``: a step counts its key when it
        dispatches it, as without this (so the steps chosen are the same), and waits for a key
        still compiling here (``wait_for``) instead of compiling it a second time. The compiles
        start once the engine's first step has been read back (the first token is not delayed
        by them)."""
        from jaxinfer.compile.warmup import sample_rows

        for key in keys:
            key = tuple(key)
            b = sample_rows(key[0], key[2])
            flags = list(dict.fromkeys(sample_flags.get(b) or [(False, 0)]))
            with self._lock:
                if key in self._ahead or key in self._futures or key in self.failed:
                    continue
                self._ahead[key] = self._submit(self._compile_fn(key, flags, True))

    def wait_for(self, key: tuple) -> None:
        """Blocks until a compile of forward bucket tuple ``key`` submitted here (either way)
        has finished (a failed one: the dispatch then compiles it inline and meets the error);
        returns at once when none is in progress."""
        with self._lock:
            fut = self._futures[key][1] if key in self._futures else self._ahead.get(key)
        if fut is not None and not fut.done():
            t0 = time.perf_counter()
            fut.exception()
            self.waited_s += time.perf_counter() - t0

    def poll(self) -> list[tuple]:
        """Retires the compiles finished since the last poll (their keys leave ``pending``;
        a finished forward key goes to ``compiled``). Returns the keys of failed ones (they go
        to ``failed``; the engine forgets them and compiles them inline)."""
        failed = []
        with self._lock:
            done = [(key, keys, fut) for key, (keys, fut) in self._futures.items() if fut.done()]
            for key, _, _ in done:
                del self._futures[key]
        for key, keys, fut in done:
            self.pending.difference_update(keys)
            exc = fut.exception()
            if exc is not None:
                self.failed[key] = f"{type(exc).__name__}: {exc}"
                failed += keys
            else:
                self.compiled.append(key)
        return failed

    def busy(self) -> bool:
        """Whether a compile is in progress."""
        return bool(self._futures)

    def wait(self) -> None:
        """Blocks until every submitted compile has finished (or failed), ahead ones included."""
        with self._lock:
            futs = [f for _, f in self._futures.values()] + list(self._ahead.values())
        for fut in futs:
            fut.exception()
