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

from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np

from jaxinfer.batch import Buckets, holds_within_one_bucket, next_pow2

REUSE_STEPS = 64
"""Steps that want an uncompiled key, padded to a compiled one, before that key is compiled. A
padded step costs up to ~2x (batch-1 decode of a ~110M model on 2 cores: ~25 ms more), a compile
~1-5 s: 64 padded steps cost less than the compile they may save."""


def choose_buckets(need: Buckets, compiled: set, sample_flags: tuple[bool, int]) -> Buckets:
    """The buckets to run a step whose exact buckets are ``need``: ``need`` itself when it is
    compiled, else the cheapest (fewest tokens) compiled forward key with every dimension in
    [need, one bucket up], preferring those whose sampling variant is compiled too (else that
    variant compiles, far cheaper than a forward step), else ``need`` (it compiles).

    Args:
        need: the step's exact buckets.
        compiled: ``Engine.compile_keys`` (``("forward", key)``, ``("sample", rows, controls,
            num_logprobs)``...).
        sample_flags: (the step has logits controls, its number of logprobs): the sampling key.
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

    def submit(self, need: Buckets, sample_flags: tuple[bool, int], compiled: set) -> list:
        """Starts compiling ``need`` and its sampling variant (idempotent). Returns their compile
        keys not in ``compiled`` yet: the engine counts them now (so its compile count depends on
        its steps only, not on when the thread finishes) and ``pending`` holds them until done.
        """
        from jaxinfer.precompile import dummy_step_batch, sample_rows

        if need.key in self._futures or need.key in self.failed:
            return []
        e = self._engine
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="jaxinfer-compile")
        kv = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), e.kv)
        batch = dummy_step_batch(need.key, e.ecfg.page_size)
        static = dict(cfg=e.cfg, attn_impl=e.ecfg.attn_impl, batch_invariant=e.ecfg.batch_invariant)
        b = sample_rows(need.decode_rows, need.prefill_rows)

        def compile_both():
            from jaxinfer.sampling import SamplingParams, SamplingTensors
            from jaxinfer.step import LogitsControls

            lowered = e._forward.lower(e.params, kv, batch, e._no_prev, **static)
            logits = jax.ShapeDtypeStruct(lowered.out_info[1].shape, lowered.out_info[1].dtype)
            lowered.compile()
            st = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * b, [0] * b,
                                             [0] * b, pad_to=b)
            v = e.cfg.vocab_size
            controls = None if not sample_flags[0] else LogitsControls(
                np.zeros((b, v), bool), np.zeros((b, v), np.int32), np.zeros((b, v), bool))
            e._sample.lower(logits, st, controls, num_logprobs=sample_flags[1],
                            num_slots=e._num_slots,
                            batch_invariant=e.ecfg.batch_invariant).compile()

        keys = [k for k in (("forward", need.key), ("sample", b, *sample_flags))
                if k not in compiled]
        self._futures[need.key] = (keys, self._pool.submit(compile_both))
        self.pending.update(keys)
        return keys

    def poll(self) -> list[tuple]:
        """Retires the compiles finished since the last poll (their keys leave ``pending``;
        a finished forward key goes to ``compiled``). Returns the keys of failed ones (they go
        to ``failed``; the engine forgets them and compiles them inline)."""
        failed = []
        for key, (keys, fut) in list(self._futures.items()):
            if not fut.done():
                continue
            del self._futures[key]
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
        """Blocks until every submitted compile has finished (or failed)."""
        for _, fut in list(self._futures.values()):
            fut.exception()
