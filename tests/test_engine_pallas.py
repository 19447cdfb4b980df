"""The engine with the Pallas ragged paged attention kernel (interpret mode on CPU) == with XLA,
with a float and with an int8 KV cache, and the attn_impl choices: resolution per backend, errors
at engine construction."""

import pytest

from jaxinfer.models.attn_dispatch import ATTN_IMPLS, resolve_attn_impl
from jaxinfer.sampling.sampler import SamplingParams

PROMPTS = ["Once upon a time", "The cat sat"]


def _generate(stories_dir, attn_impl, *, max_model_len=32, max_tokens=4, kv_cache_dtype="auto"):
    from jaxinfer.llm import LLM

    # Layers under lax.scan: the interpreted kernel is compiled once, not once per layer.
    llm = LLM(
        stories_dir,
        max_model_len=max_model_len,
        max_num_seqs=2,
        page_size=16,
        attn_impl=attn_impl,
        compilation_cache=False,
        unroll_layers=False,
        kv_cache_dtype=kv_cache_dtype,
    )
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    # A prefill step of two rows, then decode steps within one page: two compilations, as each
    # interprets the kernel in every layer (mixed decode + prefill batches: the kernel tests).
    # max_model_len=32: two 16-token pages per sequence, so the kernel's KV block is two pages
    # (the second null), a multi-page block at half the interpretation of 64's four pages. Later
    # decode steps repeat the same program on the same page, hence 4 tokens (prefill + 3 decode
    # steps).
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * 2
    return [o.token_ids for o in llm.generate(ids, params)]


def test_engine_greedy_pallas_tpu_interpret_equals_xla(stories_dir):
    assert _generate(stories_dir, "pallas_tpu_interpret") == _generate(stories_dir, "xla")


def test_engine_greedy_int8_kv_pallas_tpu_interpret_equals_xla(stories_dir):
    # int8 pages + per-token, per-head scales read by the kernel == the XLA path's dequantized
    # gather. One 16-token page per sequence (prompts of 5 and 6 tokens + 3): one page per KV
    # block, the cheapest interpretation (~1/4 the time of max_model_len=64); a prefill step and
    # two decode steps. (The GPU kernel cannot tile stories260K's head_dim 8; its int8 path is
    # checked in the kernel tests.)
    kw = dict(max_model_len=16, max_tokens=3, kv_cache_dtype="int8")
    got = _generate(stories_dir, "pallas_tpu_interpret", **kw)
    assert got == _generate(stories_dir, "xla", **kw)
    assert all(len(t) == 3 for t in got)


def test_resolve_attn_impl():
    assert resolve_attn_impl("auto", "cpu") == "xla"
    assert resolve_attn_impl("pallas", "tpu") == "pallas_tpu"
    assert resolve_attn_impl("pallas", "gpu") == "pallas_gpu"
    assert resolve_attn_impl("pallas_gpu_interpret", "cpu") == "pallas_gpu_interpret"
    with pytest.raises(ValueError, match="needs a TPU or GPU.*pallas_tpu_interpret"):
        resolve_attn_impl("pallas", "cpu")
    with pytest.raises(ValueError, match="'pallas_tpu' cannot run on jax backend 'cpu'"):
        resolve_attn_impl("pallas_tpu", "cpu")
    with pytest.raises(ValueError, match="'triton' is not available; supported"):
        resolve_attn_impl("triton", "cpu")


def test_cli_choices_match_attn_impls():
    from jaxinfer.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for command in ("generate", "serve"):
        (action,) = [a for a in sub.choices[command]._actions if a.dest == "attn_impl"]
        assert tuple(action.choices) == ATTN_IMPLS


def test_engine_rejects_unsupported_combination(stories_dir):
    from jaxinfer.llm import LLM

    # stories260K has head_dim 8; the GPU kernel tiles powers of two from 16
    with pytest.raises(ValueError, match="pallas_gpu .*head_dim=8 .*powers of two"):
        LLM(
            stories_dir,
            max_model_len=64,
            max_num_seqs=4,
            attn_impl="pallas_gpu_interpret",
            compilation_cache=False,
        )
    with pytest.raises(ValueError, match="needs a TPU or GPU"):
        LLM(
            stories_dir,
            max_model_len=64,
            max_num_seqs=4,
            attn_impl="pallas",
            compilation_cache=False,
        )
