"""Checks of ``LLM``'s constructor arguments: every argument's type and range before the model
loads (``check_llm_args``), and the KV pool the sizes imply against free memory and int32 slot
ids once the model's config is known (``check_kv_pool``), before anything is allocated.

Each failure is a ValueError naming the argument, the value and what is allowed.
"""

from __future__ import annotations

import math
import numbers
import os

from jaxinfer.engine.batch import decode_bucket, next_pow2
from jaxinfer.engine.core import KV_CACHE_DTYPES, EngineConfig
from jaxinfer.loaders import WEIGHT_DTYPES
from jaxinfer.memory_limits import fmt_bytes, shortfall
from jaxinfer.models.config import INT32_MAX, ModelConfig
from jaxinfer.models.kv_cache import kv_bytes_per_token
from jaxinfer.models.paged_attention import ATTN_IMPLS
from jaxinfer.quant.tensor import MODES
from jaxinfer.speculative.config import SPECULATIVE_METHODS

QUANTIZATIONS = (None, "none", *MODES)
SEED_MAX = 2**63 - 1
# Host bytes of the page allocator per page: an int32 refcount, a free-list slot and its int.
ALLOCATOR_BYTES_PER_PAGE = 44


def _int(name, v, low, optional=False, high=INT32_MAX):
    if v is None and optional:
        return
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        none = " or None" if optional else ""
        raise ValueError(f"{name} must be an integer{none}, got {v!r} ({type(v).__name__})")
    if not low <= v <= high:
        raise ValueError(f"{name}={v} is out of range: expected an integer in [{low}, {high}]")


def _choice(name, v, allowed):
    if not any(v is a or (isinstance(v, str) and v == a) for a in allowed):
        raise ValueError(
            f"{name}={v!r} is not supported; supported: {', '.join(repr(a) for a in allowed)}"
        )


def _flag(name, v, optional=False):
    if not (isinstance(v, bool) or (optional and v is None)):
        allowed = "True, False or None" if optional else "True or False"
        raise ValueError(f"{name} must be {allowed}, got {v!r}")


def _path(name, v, optional=False):
    if v is None and optional:
        return
    if isinstance(v, bytes) or not isinstance(v, str | os.PathLike) or not os.fspath(v):
        raise ValueError(f"{name} must be a non-empty path (str or os.PathLike), got {v!r}")


def _dtype(v):
    import jax.numpy as jnp

    try:
        ok = not isinstance(v, bool) and v is not None and jnp.dtype(v).name in WEIGHT_DTYPES
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(
            f"dtype={v!r} is not supported; supported: "
            f"{', '.join(WEIGHT_DTYPES)} (int8 weights: quantization='int8')"
        )


def _gib(v):
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"kv_cache_memory_gb must be a number, got {v!r} ({type(v).__name__})")
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"kv_cache_memory_gb={v!r} must be a finite number > 0 (GiB)")


# Argument -> check. A test asserts every parameter of LLM.__init__ has one.
RULES = {
    "model": lambda v: _path("model", v),
    "dtype": _dtype,
    "max_model_len": lambda v: _int("max_model_len", v, 2, optional=True),
    "kv_pages": lambda v: _int("kv_pages", v, 2, optional=True),
    "page_size": lambda v: _int("page_size", v, 1, optional=True),
    "max_num_seqs": lambda v: _int("max_num_seqs", v, 1),
    "max_num_batched_tokens": lambda v: _int("max_num_batched_tokens", v, 1, optional=True),
    "attn_impl": lambda v: _choice("attn_impl", v, ATTN_IMPLS),
    "kv_cache_memory_gb": _gib,
    "tokenizer": lambda v: _path("tokenizer", v, optional=True),
    "seed": lambda v: _int("seed", v, 0, high=SEED_MAX),
    "compilation_cache": lambda v: _flag("compilation_cache", v),
    "tensor_parallel_size": lambda v: _int("tensor_parallel_size", v, 1, optional=True),
    "data_parallel_size": lambda v: _int("data_parallel_size", v, 1, optional=True),
    "speculative": lambda v: _choice("speculative", v, (None, *SPECULATIVE_METHODS)),
    "num_speculative_tokens": lambda v: _int("num_speculative_tokens", v, 1),
    "draft_model": lambda v: _path("draft_model", v, optional=True),
    "draft_heads": lambda v: _path("draft_heads", v, optional=True),
    "quantization": lambda v: _choice("quantization", v, QUANTIZATIONS),
    "kv_cache_dtype": lambda v: _choice("kv_cache_dtype", v, KV_CACHE_DTYPES),
    "unroll_layers": lambda v: _flag("unroll_layers", v, optional=True),
    "async_scheduling": lambda v: _flag("async_scheduling", v, optional=True),
    "skip_tokenizer_init": lambda v: _flag("skip_tokenizer_init", v),
    "batch_invariant": lambda v: _flag("batch_invariant", v),
    "enable_prefix_caching": lambda v: _flag("enable_prefix_caching", v),
    "reuse_compiled_buckets": lambda v: _flag("reuse_compiled_buckets", v),
}


def check_llm_args(args: dict) -> None:
    """Checks ``LLM``'s arguments before anything loads.

    Args:
        args: the constructor's arguments by name (``locals()``; ``self`` is skipped).

    Raises:
        ValueError: an argument of the wrong type or out of range (sizes are integers, not
            bools, within int32; ``kv_cache_memory_gb`` finite and > 0; strings one of the
            supported values, which the message lists); ``draft_model`` / ``draft_heads`` given
            without the ``speculative`` method that uses them; ``batch_invariant`` with
            ``speculative``.
    """
    for name, value in args.items():
        if name in RULES:  # every LLM argument has a rule (tests/test_checkpoint_limits.py)
            RULES[name](value)
    spec = args.get("speculative")
    if args.get("draft_model") is not None and spec != "draft-model":
        raise ValueError(
            f"draft_model is used only with speculative='draft-model' (speculative={spec!r})"
        )
    if args.get("draft_heads") is not None and spec != "heads":
        raise ValueError(
            f"draft_heads is used only with speculative='heads' (speculative={spec!r})"
        )
    if args.get("batch_invariant") and spec is not None:
        raise ValueError(
            f"batch_invariant=True is not supported with speculative decoding "
            f"(speculative={spec!r}): its verify pass runs the batched attention"
        )


def check_kv_pool(
    cfg: ModelConfig, ecfg: EngineConfig, kv_dtype, tp: int = 1, devices=None
) -> None:
    """Checks the engine's sized buffers fit before they are allocated: the KV pool
    (``num_pages`` pages of ``page_size`` tokens), its page allocator, and the per-row sampling
    buffers of ``max_num_seqs`` rows (``ModelRunner``'s ``num_slots``, mirrored here).

    Args:
        cfg: the config the engine runs (with any KV heads replicated for tensor parallelism).
        ecfg: the engine's sizes, ``num_pages`` resolved.
        kv_dtype: dtype of the pages (``engine.kv_cache_dtype``).
        tp: devices each pool is split over (its heads).
        devices: the devices holding the pools, every replica's (default: jax's first device).

    Raises:
        ValueError: they need more bytes than are free (the message gives both, and the sizes
            that set them), or the pool has more token slots, or the rows more sampling slots,
            than int32 ids address.
    """
    per_token = kv_bytes_per_token(cfg, kv_dtype)
    slots = ecfg.num_pages * ecfg.page_size
    pool = slots * per_token
    num_slots = next_pow2(decode_bucket(ecfg.max_num_seqs) + next_pow2(ecfg.max_prefill_seqs))
    rows = 2 * 4 * num_slots  # int32 tokens: the idle prev-token buffer and a step's padded ones
    need = -(-pool // tp) + ALLOCATOR_BYTES_PER_PAGE * ecfg.num_pages + rows
    short = shortfall(need, devices)
    if short is not None:
        raise ValueError(
            f"the KV pool does not fit in memory: {ecfg.num_pages} pages x {ecfg.page_size} "
            f"tokens x {per_token} bytes a token ({cfg.num_layers} layers, {cfg.num_kv_heads} KV "
            f"heads of {cfg.head_dim}, K and V) = {fmt_bytes(pool)}"
            + (f" over {tp} devices" if tp > 1 else "")
            + f"; with the page allocator and the buffers of max_num_seqs={ecfg.max_num_seqs} "
            f"rows ({fmt_bytes(rows)}) it {short}. Lower kv_pages or max_num_seqs (or "
            "kv_cache_memory_gb or max_model_len when kv_pages is not given)"
        )
    if slots > INT32_MAX:
        raise ValueError(
            f"the KV pool has {ecfg.num_pages} pages x {ecfg.page_size} tokens = {slots} slots, "
            f"more than int32 slot ids address ({INT32_MAX}); lower kv_pages or page_size"
        )
    if num_slots > INT32_MAX:
        raise ValueError(
            f"max_num_seqs={ecfg.max_num_seqs} gives {num_slots} sampling rows, more than int32 "
            f"row ids address ({INT32_MAX}); lower max_num_seqs"
        )
