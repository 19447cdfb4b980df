"""Reusing a compiled bucket one size up instead of compiling a new one (cold start, issue 21).

A step's exact buckets (``batch.step_buckets``) are its compilation key; a key not seen yet costs
a full XLA compile (about 1 s for stories260K, 3-5 s for a ~110M model on a 2-core CPU), and a
batch job's tail meets new keys (fewer decode rows over longer block tables) for only a few steps
each. ``choose_buckets`` pads such a step up to an already compiled key that is at most one bucket
larger in every dimension (so the step costs at most about twice its exact shape), and compiles
the exact key only once ``REUSE_STEPS`` steps have wanted it (a shape that persists is worth its
compile). Padding changes no row's values: padded rows and tokens write only to the null page and
are never sampled. Outputs of ``EngineConfig.batch_invariant`` engines are bitwise the same either
way; otherwise a row's floating point may differ in the last bits with the batch's shape, as it
does between any two batch compositions.
"""

from __future__ import annotations

from jaxinfer.batch import Buckets, next_pow2

REUSE_STEPS = 64
"""Steps that want an uncompiled key, padded to a compiled one, before that key is compiled. A
padded step costs up to ~2x (batch-1 decode of a ~110M model on 2 cores: ~25 ms more), a compile
~1-5 s: 64 padded steps cost less than the compile they may save."""


def _one_up(value: int) -> int:
    """The next bucket of a dimension: decode rows go 1 -> 4 (``batch.decode_bucket``'s floor),
    every other value doubles; 0 (an absent region) stays 0."""
    return 0 if value == 0 else 4 if value == 1 else 2 * value


def choose_buckets(need: Buckets, compiled: set, wanted: dict, sample_flags: tuple[bool, int]
                   ) -> Buckets:
    """The buckets to run a step whose exact buckets are ``need``: ``need`` itself when it is
    compiled (or has been wanted ``REUSE_STEPS`` times), else the cheapest compiled forward key
    with every dimension in [need, one bucket up] whose sampling variant is compiled too.

    Args:
        need: the step's exact buckets.
        compiled: ``Engine.compile_keys`` (``("forward", key)``, ``("sample", rows, controls,
            num_logprobs)``...).
        wanted: exact key -> steps that wanted it while it was not compiled (read only here).
        sample_flags: (the step has logits controls, its number of logprobs): the sampling key.
    """
    if ("forward", need.key) in compiled or wanted.get(need.key, 0) >= REUSE_STEPS:
        return need
    best = None
    for kind, *rest in compiled:
        if kind != "forward":
            continue
        key = rest[0]
        if not all(n <= k <= _one_up(n) for n, k in zip(need.key, key, strict=True)):
            continue
        td, tp, bp, _ = key
        if ("sample", next_pow2(td + bp), *sample_flags) not in compiled:
            continue
        cost = (td + tp, key)
        if best is None or cost < best[0]:
            best = (cost, key)
    return need if best is None else Buckets(*best[1])
