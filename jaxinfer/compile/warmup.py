"""Compiling an engine's step shapes ahead of use (``jaxinfer serve --warmup``).

Every step's shapes are padded to buckets (``jaxinfer.engine.batch``): the forward step compiles
once per bucket tuple ``("forward", (Td, Tp, Bp, M))`` and the sampling step once per
``("sample", B', controls, num_logprobs)``, or ``("sample", B', False, 0, "greedy")`` for an
all-greedy step without controls or logprobs (``sampling.sample_flags``; the compile keys of
``jaxinfer.engine.runner``). A key met for the first time mid-serving compiles while every
running request waits (2-4 CPU-seconds a key for stories260K on CPU, docs/server.md).
``precompile`` runs a dummy all-padding step of each key through the engine's runner
(``ModelRunner.run_padding``, the jitted functions and static arguments of a real step), so the
jit caches hold them before the first request; with several workers it first compiles the
forward keys ahead of time (``ModelRunner.compile``) on threads. The padding tokens write only
into the null page (``kv_cache.NULL_PAGE``), which no sequence owns, so the pool's other pages
are untouched.

``all_keys`` enumerates every key the buckets allow under an ``EngineConfig`` (590 forward keys
for the server's defaults on stories260K: max_model_len 512, page size 8, 64 sequences, 512
tokens a step, 8 prefill rows); ``serving_keys``, the default, those with at most one prefill
row (135 of them): every decode-only step, and every prefill-only or decode-plus-one-prefill step
at each Tp and M. Why: bench_serve's workload run in-process (60 requests, rates inf, 8, 2)
reached 29 forward keys cold; the ones met at low rates had one prefill row, and after
precompiling ``serving_keys`` the 2 requests/s run compiled nothing (TTFT p50 0.007 s against
6.8 s cold); the keys still met at rates 8 and inf (beyond what the machine sustained) all had
several prefill rows (a queue of waiting requests), where a compile adds to a wait already long.
Source: tpu-inference compiles its token buckets at start-up the same way.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

from jaxinfer.engine.batch import Buckets, holds_within_one_bucket, sample_rows, step_buckets
from jaxinfer.engine.config import EngineConfig
from jaxinfer.sampling.sampler import GREEDY_FLAGS

Key = tuple
"""A compile key as in ``ModelRunner.compile_keys``: ``("forward", (Td, Tp, Bp, M))``,
``("sample", B', controls, num_logprobs)`` or ``("sample", B', False, 0, "greedy")``."""

PLAIN_SAMPLE_FLAGS = ((False, 0), GREEDY_FLAGS)
"""The sampling variants every B' gets (``with_sample_keys``, ``precompile``): the general one
without controls or logprobs (any row sampling at a temperature) and the all-greedy one."""


@dataclasses.dataclass(frozen=True)
class PrecompileReport:
    """What ``precompile`` did.

    Attributes:
        keys: the keys dispatched, in order (forward keys each followed by their plain
            sampling keys, ``PLAIN_SAMPLE_FLAGS``, as the engine pairs them).
        new_keys: how many of them were not in ``engine.compile_keys`` before.
        seconds: wall time of the whole call, seconds.
    """

    keys: tuple[Key, ...]
    new_keys: int
    seconds: float


def _first_live(bucket_of: Callable[[int], int], top: int) -> dict[int, int]:
    """{bucket: the smallest live count n in [0, top] that ``bucket_of`` maps to it}."""
    out: dict[int, int] = {}
    for n in range(top + 1):
        out.setdefault(bucket_of(n), n)
    return out


def all_keys(ecfg: EngineConfig) -> list[Key]:
    """Every forward key ``build_step_batch`` can give under ``ecfg``'s limits, each followed by
    its plain sampling keys (the first time its B' occurs).

    Each dimension's buckets are ``batch.step_buckets`` of the live counts up to the limits; a
    bucket tuple is kept when its smallest live counts fit the limits (decode rows plus
    prefill rows <= ``max_num_seqs``, prefill rows <= ``max_prefill_seqs``, decode plus prefill
    tokens <= ``max_num_batched_tokens``), and M ranges over the block-table widths of a longest
    row from the longest prefill chunk those counts allow up to ``max_pages_per_seq``. So the
    list may hold keys the scheduler never makes; it omits none (tests/test_precompile.py runs
    the real scheduler against it). Hundreds of keys for the server's defaults."""
    z, per_seq = ecfg.page_size, ecfg.max_pages_per_seq
    rows_max = min(ecfg.max_prefill_seqs, ecfg.max_num_seqs)

    def bucket(nd=0, nt=0, nb=0, pages=1) -> tuple[int, int, int, int]:
        return step_buckets(nd, nt, nb, pages, per_seq).key

    td_min = _first_live(lambda n: bucket(nd=n)[0], ecfg.max_num_seqs)
    tp_min = _first_live(lambda n: bucket(nt=n)[1], ecfg.max_num_batched_tokens)
    bp_min = _first_live(lambda n: bucket(nb=n)[2], rows_max)
    fwd: list[tuple[int, int, int, int]] = []
    for td, nd in td_min.items():
        if td:
            fwd += sorted({bucket(nd, 0, 0, p) for p in range(1, per_seq + 1)})
        for tp, nt in tp_min.items():
            for bp, nb in bp_min.items():
                if not (tp and bp) or nd + nb > ecfg.max_num_seqs:
                    continue
                tokens = max(nt, nb)  # each prefill row has at least one token
                if nd + tokens > ecfg.max_num_batched_tokens:
                    continue
                longest = -(-tokens // min(bp, rows_max, ecfg.max_num_seqs - nd))
                if longest <= ecfg.max_model_len:
                    fwd += sorted(
                        {bucket(nd, tokens, nb, p) for p in range(-(-longest // z), per_seq + 1)}
                    )
    return with_sample_keys(fwd)


def with_sample_keys(forward: Iterable[tuple[int, int, int, int]]) -> list[Key]:
    """("forward", key) for each bucket tuple, each followed by its plain sampling keys
    ("sample", B', False, 0) and ("sample", B', False, 0, "greedy") (``PLAIN_SAMPLE_FLAGS``) the
    first time its B' occurs: the engine runs one of them after it."""
    out: list[Key] = []
    seen: set[int] = set()
    for bk in forward:
        out.append(("forward", tuple(bk)))
        b = sample_rows(bk[0], bk[2])
        if b not in seen:
            seen.add(b)
            out += [("sample", b, *flags) for flags in PLAIN_SAMPLE_FLAGS]
    return out


def precompile(
    engine,
    keys: Iterable[Key] | None = None,
    progress: Callable[[int, int, Key], None] | None = None,
    workers: int = 1,
) -> PrecompileReport:
    """Compiles ``keys`` (default ``serving_keys(engine.ecfg)``) into the engine's jit caches.

    Each forward key runs one dummy all-padding step through the engine's runner
    (``ModelRunner.run_padding``), then its B' sampled rows with the plain options (no controls,
    no logprobs: ``PLAIN_SAMPLE_FLAGS``, the general variant and the all-greedy one), and with
    the options of every sampling key in ``keys`` of the same B', each with the static arguments
    a real step passes. Every key run goes into ``engine.compile_keys``. The KV pool is donated
    and replaced as in a real step; only the null page is written. Call it while no other
    thread steps the engine (before serving); a request already running is unaffected.

    The jit caches also key on whether each input is committed to a device: the first forward
    runs with no previous tokens (as a step dispatched with none in flight), the others with the
    previous sampling output (as a pipelined step). Both are placed alike, so they share one
    compilation. Prompt-logprobs forwards are not covered.

    With ``workers`` > 1 the forward keys are first compiled ahead of time
    (``ModelRunner.compile``) by that many threads at once (XLA compiles outside the GIL); the
    dispatches that follow find the executables in jax's compilation cache and compile nothing.

    Args:
        engine: an ``EngineCore`` whose ``capabilities.precompile`` holds (not a speculative one).
        keys: compile keys as in ``ModelRunner.compile_keys``, "forward" and "sample" kinds.
        progress: called as each forward key is compiled (with its sampling keys, when
            ``workers`` is 1) as ``progress(k, n, key)``: k of n forward keys done.
        workers: threads compiling forward keys at once (>= 1).

    Returns:
        ``PrecompileReport``.

    Raises:
        ValueError: a key of another kind or a malformed one (the message names it); a
            sampling key whose B' no forward key in ``keys`` gives; a speculative engine;
            ``workers`` < 1.
    """
    t0 = time.perf_counter()
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"precompile: workers must be an integer >= 1, got {workers!r}")
    if not engine.capabilities.precompile:
        raise ValueError(
            "precompile: a speculative engine steps through its own round function "
            "('spec_round' keys); precompile supports plain engine steps only"
        )
    fwd, smp = _split_keys(list(serving_keys(engine.ecfg) if keys is None else keys))
    rows = {sample_rows(bk[0], bk[2]) for bk in fwd}
    orphans = sorted(k for k in smp if k[1] not in rows)
    if orphans:
        raise ValueError(
            f"precompile: sampling keys {orphans} have no forward key of the same "
            "row count B' in keys (their logits come from one)"
        )
    runner = engine.runner
    before = set(runner.compile_keys)
    done: list[Key] = []
    if workers > 1:
        _compile_on_threads(runner, fwd, workers, progress)
        progress = None
    prev = None
    for k, bk in enumerate(fwd, 1):
        b = sample_rows(bk[0], bk[2])
        plain = [("sample", b, *flags) for flags in PLAIN_SAMPLE_FLAGS]
        todo = [sk for sk in dict.fromkeys(plain + [s for s in smp if s[1] == b]) if sk not in done]
        prev = runner.run_padding(Buckets(*bk), [sk[2:] for sk in todo], prev)
        done += [("forward", bk), *todo]
        if progress is not None:
            progress(k, len(fwd), ("forward", bk))
    return PrecompileReport(tuple(done), len(set(done) - before), time.perf_counter() - t0)


def _compile_on_threads(
    runner, fwd: list[tuple[int, int, int, int]], workers: int, progress
) -> None:
    """Compiles each forward bucket tuple ahead of time on ``workers`` threads (nothing runs)."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    def compile_one(bk):
        runner.compile(("forward", bk))
        return bk

    with ThreadPoolExecutor(workers, thread_name_prefix="jaxinfer-precompile") as pool:
        futures = [pool.submit(compile_one, bk) for bk in fwd]
        for k, fut in enumerate(as_completed(futures), 1):
            bk = fut.result()
            if progress is not None:
                progress(k, len(fwd), ("forward", bk))


def _split_keys(keys: list) -> tuple[list[tuple[int, int, int, int]], list[Key]]:
    """(forward bucket tuples, sampling keys) of ``keys``, each deduplicated in order.
    Raises ValueError naming a malformed key."""
    fwd, smp = [], []
    for k in keys:
        ints = lambda xs: all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0  # noqa: E731
            for x in xs
        )
        if (
            isinstance(k, tuple)
            and len(k) == 2
            and k[0] == "forward"
            and isinstance(k[1], tuple)
            and len(k[1]) == 4
            and ints(k[1])
            and (k[1][1] == 0) == (k[1][2] == 0)
            and k[1][0] + k[1][1] > 0
            and k[1][3] > 0
        ):
            fwd.append(k[1])
        elif (
            isinstance(k, tuple)
            and len(k) == 4
            and k[0] == "sample"
            and ints(k[1:2] + k[3:])
            and k[1] > 0
            and isinstance(k[2], bool)
        ):
            smp.append(k)
        elif (
            isinstance(k, tuple)
            and len(k) == 5
            and k[0] == "sample"
            and ints(k[1:2])
            and k[1] > 0
            and k[2:] == GREEDY_FLAGS
            and isinstance(k[2], bool)
        ):
            smp.append(k)
        else:
            raise ValueError(
                f"precompile: cannot compile key {k!r}: expected ('forward', (Td, "
                "Tp, Bp, M)) with Td + Tp > 0, M > 0 and Tp == 0 exactly when "
                "Bp == 0, ('sample', B', controls: bool, num_logprobs) or "
                "('sample', B', False, 0, 'greedy')"
            )
    return list(dict.fromkeys(fwd)), list(dict.fromkeys(smp))


def serving_keys(
    ecfg: EngineConfig, *, max_prefill_rows: int = 1, max_prefill_tokens: int | None = None
) -> list[Key]:
    """The keys ``precompile`` compiles by default: those of ``all_keys`` with at most
    ``max_prefill_rows`` prefill rows (Bp) and ``max_prefill_tokens`` prefill tokens (Tp bucket;
    None: no limit), with their plain sampling keys (``with_sample_keys``)."""
    fwd = [
        k[1]
        for k in all_keys(ecfg)
        if k[0] == "forward"
        and k[1][2] <= max_prefill_rows
        and (max_prefill_tokens is None or k[1][1] <= max_prefill_tokens)
    ]
    return with_sample_keys(fwd)


def cover_keys(keys: Iterable[Key], candidates: Iterable[Key] | None = None) -> list[Key]:
    """A small set of forward keys (with their plain sampling keys) such that every forward key
    of ``keys`` is, in every dimension, at most one bucket below one of them: with bucket reuse
    (``jaxinfer.compile.buckets``) a step of any key of ``keys`` then runs padded to a compiled
    key at once, and one that persists compiles in the background, so no step waits for a
    compile. Greedy set cover (each pick covers the most keys still uncovered, ties to the
    cheaper: fewer tokens, then smaller) over ``candidates`` (default: ``keys`` themselves).

    Source: the classic greedy approximation of set cover (Chvatal 1979)."""
    need = list(dict.fromkeys(k[1] for k in keys if k[0] == "forward"))
    pool = (
        need
        if candidates is None
        else list(dict.fromkeys(k[1] for k in candidates if k[0] == "forward"))
    )
    covers = {c: {n for n in need if holds_within_one_bucket(n, c)} for c in pool}
    left, picked = set(need), []
    while left:
        best = max(
            pool, key=lambda c: (len(covers[c] & left), -(c[0] + c[1]), tuple(-x for x in c))
        )
        got = covers[best] & left
        if not got:
            raise ValueError(f"cover_keys: keys {sorted(left)} are covered by no candidate")
        picked.append(best)
        left -= got
    return with_sample_keys(sorted(picked))
