"""An ``LLM`` from the command line's model and engine flags (``jaxinfer generate`` and
``jaxinfer serve`` share them)."""

from __future__ import annotations

import argparse

from jaxinfer.cli.flag_names import as_flags
from jaxinfer.cli.prompts_file import UsageError
from jaxinfer.errors import JaxinferError, KernelBuildError


def llm_kwargs(args: argparse.Namespace) -> dict:
    """``LLM``'s keyword arguments (all but the model path) from the command line's flags."""
    return dict(
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        kv_pages=args.kv_pages,
        page_size=args.page_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attn_impl=args.attn_impl,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        async_scheduling=args.async_scheduling,
        batch_invariant=args.batch_invariant,
        enable_prefix_caching=args.enable_prefix_caching,
        reuse_compiled_buckets=args.reuse_compiled_buckets,
        tokenizer=args.tokenizer,
        skip_tokenizer_init=args.skip_tokenizer_init,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_size=args.data_parallel_size,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        draft_model=args.draft_model,
        draft_heads=args.draft_heads,
    )


def load_llm(args: argparse.Namespace):
    """Loads the model with the engine flags in ``args``. Raises UsageError with a message
    for the user (a bad flag combination, a model that cannot load, an invalid engine setting)."""
    from jaxinfer.llm import LLM

    if args.draft_model is not None and args.speculative != "draft-model":
        raise UsageError("--draft-model is used only with --speculative draft-model")
    if args.draft_heads is not None and args.speculative != "heads":
        raise UsageError("--draft-heads is used only with --speculative heads")
    try:
        llm = LLM(args.model, **llm_kwargs(args))
    except KernelBuildError as e:  # --attn-impl cpu_kernel asked for a kernel that cannot build
        raise UsageError(f"--attn-impl cpu_kernel: {e}") from None
    except (JaxinferError, OSError) as e:
        msg = str(e)
        raise UsageError(
            msg if msg.startswith("draft model") else f"cannot load model {args.model}: {msg}"
        ) from None
    except ValueError as e:  # an engine setting (sizes, pool, attention implementation)
        raise UsageError(f"invalid engine setting: {as_flags(str(e))}") from None
    return llm
