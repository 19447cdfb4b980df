"""ModelRunner: an engine's device side (nano-vllm's ``ModelRunner``, vLLM v1's model runner).

It owns the params in their run layout, the KV page pool, the mesh, the jitted step functions and
the compile keys they have met; nothing here schedules. ``EngineCore`` (``jaxinfer.engine.core``)
builds each step's host inputs (``StepInputs``) and ``run`` dispatches them, forward then
sampling, without waiting for the device.

A compile key names one XLA program a step runs:

- ``("forward", (Td, Tp, Bp, M))``: ``step.forward_step`` of a bucket tuple (``batch.Buckets``);
- ``("forward_prompt_logprobs", (Td, Tp, Bp, M), K)``: the same with prompt logprobs (top K);
- ``("sample", B', controls, num_logprobs)``: ``step.sample_step_padded``'s general variant, or
  ``("sample", B', False, 0, "greedy")`` its all-greedy one (``sampling.sample_flags``); either
  with ``"masked"`` appended when a row is constrained (structured outputs: a token bitmask is
  applied before sampling);
- ``("spec_round", (T, B, M), controls, num_logprobs)``: a speculative round
  (``jaxinfer.speculative``).

``step_keys`` derives a step's keys from its buckets and sampling flags; ``lower`` / ``compile``
build a forward or sampling key ahead of time from abstract arguments (warm-up, bucket reuse's
background compiler); ``compile_keys`` holds the keys of every step dispatched, and those bucket
reuse counts when it starts a background compile.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jaxinfer.engine.prompt_logprobs as plp
from jaxinfer.engine.batch import Buckets, decode_bucket, dummy_step_batch, next_pow2, sample_rows
from jaxinfer.engine.config import EngineConfig, kv_cache_dtype, scan_from_tokens
from jaxinfer.engine.host_memory import keep_freed_host_memory
from jaxinfer.engine.step import (
    LogitsControls,
    StepBatch,
    jitted_forward_step,
    jitted_sample_step,
)
from jaxinfer.models.config import ModelConfig
from jaxinfer.models.kv_cache import KVCache, init_kv_cache
from jaxinfer.models.params import Params, out_in_projections, unstack_layers
from jaxinfer.sampling.sampler import (
    GREEDY_FLAGS,
    MASKED,
    SampleOutput,
    SamplingParams,
    SamplingTensors,
)

Key = tuple
"""A compile key (module docstring)."""


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What an engine supports (``EngineCore.capabilities``: its runner's and, with speculative
    decoding, its strategy's, both needed).

    Attributes:
        prompt_logprobs: requests may ask for ``SamplingParams.prompt_logprobs``.
        async_scheduling: a step may be dispatched before the previous one's tokens are read.
        batch_invariant: ``EngineConfig.batch_invariant`` can be honoured.
        background_compiles: bucket reuse may compile keys on a background thread.
        precompile: its steps run the plain step's keys (``step_keys``), so warm-up
            (``jaxinfer.compile.warmup``) and the job plan (``jaxinfer.compile.plan``) apply.
    """

    prompt_logprobs: bool = True
    async_scheduling: bool = True
    batch_invariant: bool = True
    background_compiles: bool = True
    precompile: bool = True

    def __and__(self, other: Capabilities) -> Capabilities:
        """Supported by both."""
        both = zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)
        return Capabilities(*(a and b for a, b in both))


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The host inputs of one step (numpy), padded to its buckets.

    Attributes:
        batch: tokens and attention metadata (``batch.build_step_batch``); a token id
            ``-(r + 1)`` stands for row r of the previous step's sampled tokens.
        buckets: the buckets ``batch`` is padded to (its forward compile key).
        sampling: per-row sampling parameters of the B' sampled rows.
        controls: penalty inputs and banned tokens, or None when no row needs them.
        flags: the step's ``sampling.sample_flags`` (the tail of its sampling key).
        prompt_targets: i32[T] next prompt token of each slot whose prompt logprob is wanted
            (``prompt_logprobs.plan_step``), or None when no row wants any.
    """

    batch: StepBatch
    buckets: Buckets
    sampling: SamplingTensors
    controls: LogitsControls | None
    flags: tuple
    prompt_targets: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What ``run`` returns: device arrays, not waited for.

    Attributes:
        sampled: the B' rows' sampled tokens and logprobs (``sampling.SampleOutput``).
        next_tokens: i32[num_slots] the sampled tokens zero-padded, the next step's
            ``prev_tokens``.
        prompt_logprobs: ``prompt_logprobs.PromptLogprobsOut`` when ``prompt_targets`` was given.
    """

    sampled: SampleOutput
    next_tokens: jax.Array | None
    prompt_logprobs: plp.PromptLogprobsOut | None = None


@dataclasses.dataclass(frozen=True)
class Forwarded:
    """A step whose forward is dispatched and whose sampling is not (``ModelRunner.run_forward``):
    structured outputs compute the masks between the two.

    Attributes:
        inputs: the step's host inputs.
        logits: f32[B', V] device logits of each sampled row (not waited for).
        prompt_logprobs: ``prompt_logprobs.PromptLogprobsOut`` or None.
    """

    inputs: StepInputs
    logits: jax.Array
    prompt_logprobs: plp.PromptLogprobsOut | None = None


def _masked(flags: tuple) -> bool:
    return bool(flags) and flags[-1] == MASKED


def step_keys(buckets: Buckets, flags: tuple, prompt_logprobs_top: int = 0) -> list[Key]:
    """The compile keys of a step padded to ``buckets`` whose sampling variant is ``flags``
    (``sampling.sample_flags``): its forward key (``"forward_prompt_logprobs"`` with top
    ``prompt_logprobs_top`` > 0), then its sampling key."""
    if prompt_logprobs_top:
        fwd = ("forward_prompt_logprobs", buckets.key, prompt_logprobs_top)
    else:
        fwd = ("forward", buckets.key)
    return [fwd, ("sample", sample_rows(buckets.decode_rows, buckets.prefill_rows), *flags)]


def _is_deleted(tree) -> bool:
    return any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree_util.tree_leaves(tree))


class ModelRunner:
    """The device side of an engine over one model (module docstring).

    Args:
        cfg: the model's architecture.
        params: its weights, put in this runner's layout (unstacked layers, out-in projections)
            as ``ecfg`` asks.
        ecfg: the engine's resolved configuration (``jaxinfer.engine.config.resolve``: every
            default applied and every combination checked there), which the runner only reads.
        mesh: a ``jax.sharding.Mesh`` the params are sharded over (None: one device).

    Attributes:
        cfg, params, ecfg, mesh: as given (params in the run layout).
        attn_impl: ``ecfg.attn_impl``, the static argument of every jitted step (e.g.
            "cpu_kernel" or "xla" on CPU); ``attn_impl_reason`` why
            (``attn_dispatch.engine_attn_impl``).
        kv: the KV page pool (``KVCache``), donated to each step and replaced by its result.
        kv_dtype: the pool's dtype; ``kv_page_major`` its layout.
        num_slots: rows of the widest step's sampling, the length of ``prev_tokens``.
        compile_keys: the keys met so far (module docstring).
        capabilities: ``Capabilities`` of this runner.
    """

    def __init__(self, cfg: ModelConfig, params: Params, ecfg: EngineConfig, mesh=None):
        # ecfg is resolved (``engine.config.resolve``): every choice is made, every check done.
        impl = ecfg.attn_impl
        self.attn_impl, self.attn_impl_reason = impl, ecfg.attn_impl_reason
        self.kv_page_major = ecfg.kv_page_major
        kv_dtype = kv_cache_dtype(ecfg)
        if ecfg.keep_host_memory:
            keep_freed_host_memory()
        if ecfg.unroll_layers:
            params = unstack_layers(params, scan_from_tokens(ecfg))
        if ecfg.out_in_weights:
            params = out_in_projections(params)
        self.cfg, self.params, self.ecfg, self.mesh = cfg, params, ecfg, mesh
        self.kv_dtype = kv_dtype
        self.kv: KVCache = self.new_kv_cache()
        shard = (lambda x: x.sharding) if mesh is not None else (lambda x: None)
        self._kv_spec = jax.tree.map(  # the pool as shapes, for lowering (it is donated)
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shard(x)), self.kv
        )
        if mesh is None:
            self._replicated = None
            self._forward = jitted_forward_step()
            self._forward_plp = plp.jitted_forward_step_prompt_logprobs(None)
        else:
            from jaxinfer.models.sharding import step_out_shardings

            self._replicated = step_out_shardings(mesh)[1]
            self._forward = jitted_forward_step(out_shardings=step_out_shardings(mesh))
            self._forward_plp = plp.jitted_forward_step_prompt_logprobs(step_out_shardings(mesh))
        self._sample = jitted_sample_step()
        self._static = dict(cfg=cfg, attn_impl=impl, batch_invariant=ecfg.batch_invariant)
        # Rows of the widest step's sampling (``build_step_batch``): the prev_tokens length.
        self.num_slots = next_pow2(
            decode_bucket(ecfg.max_num_seqs) + next_pow2(ecfg.max_prefill_seqs)
        )
        self._no_prev = jnp.zeros(self.num_slots, jnp.int32)
        if mesh is not None:  # placed as the sampling step's output: one compile per forward shape
            self._no_prev = jax.device_put(self._no_prev, self._replicated)
        self.compile_keys: set[Key] = set()
        self.capabilities = Capabilities(
            prompt_logprobs=not ecfg.batch_invariant,  # its forward makes last-token logits only
            batch_invariant=impl == "xla" and mesh is None,
            background_compiles=mesh is None,
        )

    def new_kv_cache(self) -> KVCache:
        """A fresh, zeroed KV page pool (sharded over the mesh if there is one)."""
        ecfg = self.ecfg
        if self.mesh is None:
            return init_kv_cache(
                self.cfg, ecfg.num_pages, ecfg.page_size, self.kv_dtype, self.kv_page_major
            )
        from jaxinfer.models.sharding import sharded_kv_cache

        return sharded_kv_cache(
            self.cfg, ecfg.num_pages, ecfg.page_size, self.params.embed.dtype, self.mesh
        )

    def reset_after_failure(self) -> None:
        """After a failed step: a fresh pool when the failed call had consumed (donated) it."""
        if _is_deleted(self.kv):
            self.kv = self.new_kv_cache()

    # ---------------------------------------------------------------- compile keys

    def step_keys(self, buckets: Buckets, flags: tuple, prompt_logprobs: bool = False) -> list:
        """The compile keys of a step (``step_keys``; a prompt-logprobs forward computes the top
        ``prompt_logprobs.num_top`` of this vocabulary)."""
        return step_keys(buckets, flags, plp.num_top(self.cfg.vocab_size) if prompt_logprobs else 0)

    def lower(self, key: Key) -> jax.stages.Lowered:
        """Lowers compile key ``key`` from abstract arguments, with the static arguments a step
        passes: a forward key over the pool's shapes and an all-padding batch of its buckets
        (``batch.dummy_step_batch``), a sampling key over logits f32[B', V]. Safe from another
        thread (reads nothing a step changes). Raises ValueError for a key of another kind."""
        kind = key[0] if isinstance(key, tuple) and key else None
        if kind in ("forward", "forward_prompt_logprobs"):
            batch = dummy_step_batch(key[1], self.ecfg.page_size)
            if kind == "forward":
                args = (self.params, self._kv_spec, batch, self._no_prev)
                return self._forward.lower(*args, **self._static)
            static = dict(cfg=self.cfg, attn_impl=self.attn_impl, num_top=key[2])
            targets = np.zeros(len(batch.tokens), np.int32)
            args = (self.params, self._kv_spec, batch, self._no_prev, targets)
            return self._forward_plp.lower(*args, **static)
        if kind == "sample":
            b, flags = key[1], tuple(key[2:])
            logits = jax.ShapeDtypeStruct(  # compute_logits: f32, replicated on a mesh
                (b, self.cfg.vocab_size), jnp.float32, sharding=self._replicated
            )
            st = SamplingTensors.from_params(
                [SamplingParams(temperature=0.0)] * b, [0] * b, [0] * b, pad_to=b
            )
            return self._sample.lower(
                logits,
                st,
                self._dummy_controls(b, flags),
                self._dummy_bitmask(b, flags),
                **self._sample_static(flags),
            )
        raise ValueError(
            f"ModelRunner.lower: cannot lower key {key!r}: expected a 'forward', "
            "'forward_prompt_logprobs' or 'sample' key"
        )

    def compile(self, key: Key) -> jax.stages.Compiled:
        """``lower(key).compile()``: fills jax's caches, so a step dispatching ``key`` then
        compiles nothing. Does not count ``key`` in ``compile_keys`` (a dispatch does)."""
        return self.lower(key).compile()

    # ---------------------------------------------------------------- running

    def run(
        self,
        inputs: StepInputs,
        prev_tokens: jax.Array | None = None,
        bitmask: np.ndarray | None = None,
    ) -> StepOutput:
        """Dispatches one step, forward then sampling (``run_forward``, ``run_sample``), and
        counts its keys; returns without waiting for the device.

        Args:
            inputs: the step's host inputs.
            prev_tokens: i32[num_slots] the previous step's ``StepOutput.next_tokens`` when
                ``inputs.batch`` holds placeholders for them (async scheduling), else None.
            bitmask: i32[B', ceil(V / 32)] allowed tokens per row when ``inputs.flags`` ends in
                ``sampling.MASKED`` (structured outputs), else None.
        """
        return self.run_sample(self.run_forward(inputs, prev_tokens), bitmask)

    def run_forward(self, inputs: StepInputs, prev_tokens: jax.Array | None = None) -> Forwarded:
        """The forward half of ``run``: dispatches the model over the step's tokens and counts
        the step's keys; the pool is donated to it and replaced by its result. Returns without
        waiting (``run_sample`` then samples from its logits)."""
        plp_on = inputs.prompt_targets is not None
        self.compile_keys.update(self.step_keys(inputs.buckets, inputs.flags, plp_on))
        prev = self._no_prev if prev_tokens is None else prev_tokens
        plp_out = None
        if not plp_on:
            self.kv, logits = self._forward(
                self.params, self.kv, inputs.batch, prev, **self._static
            )
        else:
            static = dict(cfg=self.cfg, attn_impl=self.attn_impl)
            self.kv, logits, plp_out = self._forward_plp(
                self.params,
                self.kv,
                inputs.batch,
                prev,
                inputs.prompt_targets,
                num_top=plp.num_top(self.cfg.vocab_size),
                **static,
            )
        return Forwarded(inputs, logits, plp_out)

    def run_sample(self, fwd: Forwarded, bitmask: np.ndarray | None = None) -> StepOutput:
        """The sampling half of ``run``: dispatches the sampling of ``fwd``'s logits, with the
        token ``bitmask`` (i32[B', ceil(V / 32)]) applied first when the step's flags end in
        ``sampling.MASKED``. Returns without waiting.

        Raises:
            ValueError: a bitmask given to an unmasked variant, or none to a masked one.
        """
        inputs = fwd.inputs
        if (bitmask is not None) != _masked(inputs.flags):
            raise ValueError(
                f"run_sample: flags {inputs.flags} and bitmask "
                f"{'given' if bitmask is not None else 'None'} disagree"
            )
        sampled, next_tokens = self._sample_call(
            fwd.logits, inputs.sampling, inputs.controls, inputs.flags, bitmask
        )
        return StepOutput(sampled, next_tokens, fwd.prompt_logprobs)

    def run_padding(
        self, buckets: Buckets, flags: Sequence[tuple], prev_tokens: jax.Array | None = None
    ) -> jax.Array:
        """Dispatches an all-padding step of ``buckets`` (``batch.dummy_step_batch``: its tokens
        write only the null page, which no sequence owns) and its sampling once per variant in
        ``flags``, counts their keys, and waits for the device (warm-up). Returns the next
        tokens of the last sampling (``prev_tokens`` when ``flags`` is empty), the next call's
        ``prev_tokens``."""
        batch = dummy_step_batch(buckets.key, self.ecfg.page_size)
        prev = self._no_prev if prev_tokens is None else prev_tokens
        self.compile_keys.add(("forward", buckets.key))
        self.kv, logits = self._forward(self.params, self.kv, batch, prev, **self._static)
        b = sample_rows(buckets.decode_rows, buckets.prefill_rows)
        st = SamplingTensors.from_params(
            [SamplingParams(temperature=0.0)] * b, [0] * b, [0] * b, pad_to=b
        )
        for f in flags:
            self.compile_keys.add(("sample", b, *f))
            f = tuple(f)
            bm = self._dummy_bitmask(b, f)
            _, prev = self._sample_call(logits, st, self._dummy_controls(b, f), f, bm)
        jax.block_until_ready((logits, prev))
        return prev

    def run_with_pool(self, fn: Callable[[Params, KVCache], tuple[KVCache, object]]):
        """Calls ``fn(params, kv)`` -> (new pool, out) with this runner's params and pool (the
        pool donated to it, as to a step: a failed call may leave it consumed, see
        ``reset_after_failure``), keeps the new pool and returns ``out``. For device functions of
        their own (speculative rounds); the caller counts their compile keys."""
        self.kv, out = fn(self.params, self.kv)
        return out

    # ---------------------------------------------------------------- helpers

    def _sample_static(self, flags: tuple) -> dict:
        return dict(
            num_logprobs=flags[1],
            greedy=flags[:3] == GREEDY_FLAGS,
            num_slots=self.num_slots,
            batch_invariant=self.ecfg.batch_invariant,
        )

    def _sample_call(self, logits, st, controls, flags: tuple, bitmask=None):
        return self._sample(logits, st, controls, bitmask, **self._sample_static(flags))

    def _dummy_bitmask(self, b: int, flags: tuple) -> np.ndarray | None:
        if not _masked(flags):
            return None
        return np.full((b, -(-self.cfg.vocab_size // 32)), -1, np.int32)

    def _dummy_controls(self, b: int, flags: tuple) -> LogitsControls | None:
        if not flags[0]:
            return None
        v = self.cfg.vocab_size
        return LogitsControls(
            np.zeros((b, v), bool), np.zeros((b, v), np.int32), np.zeros((b, v), bool)
        )
