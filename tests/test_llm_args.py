"""LLM's constructor arguments are checked before the model loads (``jaxinfer.args.EngineArgs``),
and the KV pool and row buffers they imply before they are allocated (issue 15, class 4;
``jaxinfer.engine.config.check_kv_pool``).

Bad arguments are given with a missing model path: a ValueError naming the argument (not the
CheckpointError of the path) shows the argument was checked first. The memory cases construct
``LLM`` on stories260K and fail before the pool; tracemalloc shows nothing large was allocated.
"""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest
from conftest import peak_alloc_bytes

from jaxinfer import memory_limits
from jaxinfer.errors import CheckpointError
from jaxinfer.models.config import ModelConfig

MiB = 2**20


BAD_ARGS = [
    (dict(dtype="int4"), r"dtype='int4' is not supported; supported: float32, bfloat16, float16"),
    (dict(dtype=True), r"dtype=True is not supported"),
    (dict(max_model_len=1), r"max_model_len=1 is out of range"),
    (dict(max_model_len=2**31), r"max_model_len=2147483648 is out of range"),
    (dict(max_model_len=16.0), r"max_model_len must be an integer or None, got 16.0"),
    (dict(kv_pages=-5), r"kv_pages=-5 is out of range"),
    (dict(kv_pages=True), r"kv_pages must be an integer or None, got True"),
    (dict(kv_pages=1e9), r"kv_pages must be an integer or None, got 1000000000.0"),
    (dict(page_size=0), r"page_size=0 is out of range"),
    (dict(page_size="16"), r"page_size must be an integer or None, got '16'"),
    (dict(max_num_seqs=0), r"max_num_seqs=0 is out of range"),
    (dict(max_num_seqs=None), r"max_num_seqs must be an integer, got None"),
    (dict(max_num_batched_tokens=0), r"max_num_batched_tokens=0 is out of range"),
    (dict(attn_impl="flash"), r"attn_impl='flash' is not supported; supported: 'auto', 'xla'"),
    (dict(kv_cache_memory_gb=math.nan), r"kv_cache_memory_gb=nan must be a finite number > 0"),
    (dict(kv_cache_memory_gb=math.inf), r"kv_cache_memory_gb=inf must be a finite number > 0"),
    (dict(kv_cache_memory_gb=-1), r"kv_cache_memory_gb=-1 must be a finite number > 0"),
    (dict(kv_cache_memory_gb="2"), r"kv_cache_memory_gb must be a number, got '2'"),
    (dict(tokenizer=5), r"tokenizer must be a non-empty path"),
    (dict(tokenizer=""), r"tokenizer must be a non-empty path"),
    (dict(seed=-1), r"seed=-1 is out of range"),
    (dict(seed=1.5), r"seed must be an integer, got 1.5"),
    (dict(compilation_cache="yes"), r"compilation_cache must be True or False, got 'yes'"),
    (dict(tensor_parallel_size=0), r"tensor_parallel_size=0 is out of range"),
    (dict(data_parallel_size=-1), r"data_parallel_size=-1 is out of range"),
    (dict(speculative="medusa"), r"speculative='medusa' is not supported; supported: None, 'dr"),
    (dict(num_speculative_tokens=0), r"num_speculative_tokens=0 is out of range"),
    (dict(draft_model="x"), r"draft_model is used only with speculative='draft-model'"),
    (dict(draft_model=3, speculative="draft-model"), r"draft_model must be a non-empty path"),
    (dict(draft_heads="x", speculative="ngram"), r"draft_heads is used only with speculative='h"),
    (dict(quantization="int4"), r"quantization='int4' is not supported; supported: None, 'none'"),
    (dict(kv_cache_dtype="fp8"), r"kv_cache_dtype='fp8' is not supported; supported: 'auto', 'i"),
    (dict(unroll_layers="no"), r"unroll_layers must be True, False or None, got 'no'"),
    (dict(async_scheduling=1), r"async_scheduling must be True, False or None, got 1"),
    (dict(skip_tokenizer_init=None), r"skip_tokenizer_init must be True or False, got None"),
]


@pytest.mark.parametrize("kwargs, match", BAD_ARGS, ids=[next(iter(k)) for k, _ in BAD_ARGS])
def test_llm_argument_checked_before_loading(kwargs, match):
    """Refused with a ValueError naming the argument before the (missing) model is looked at:
    a CheckpointError here would mean the argument was not checked first."""
    from jaxinfer.llm import LLM

    with pytest.raises(ValueError, match=match) as e:
        LLM("/nonexistent/model", **kwargs)
    assert not isinstance(e.value, CheckpointError)


def test_llm_model_argument_type():
    from jaxinfer.llm import LLM

    with pytest.raises(ValueError, match=r"model must be a non-empty path .*got None"):
        LLM(None)


def test_every_llm_argument_is_an_option_with_a_check_and_its_default_passes():
    """LLM's signature is EngineArgs' fields (help(LLM), notebooks and IDEs show them all), each
    with a check and help; the defaults pass their checks."""
    from jaxinfer.args import EngineArgs, option_fields
    from jaxinfer.llm import LLM

    params = dict(inspect.signature(LLM.__init__).parameters)
    params.pop("self")
    fields = {f.name: f for f in option_fields()}
    assert list(params) == list(fields)
    assert params["model"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    for name, p in list(params.items())[1:]:
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default == fields[name].default
        opt = fields[name].metadata["option"]
        assert callable(opt.check) and opt.help, name
        assert f"        {name}: " in LLM.__doc__, name  # documented in LLM's docstring
    args = EngineArgs(model="m", **{n: p.default for n, p in list(params.items())[1:]})
    assert args == EngineArgs("m")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_seq_len=3), r"unexpected keyword argument 'max_seq_len'; did you mean 'max_mod"),
        (dict(page_sizes=8), r"unexpected keyword argument 'page_sizes'; did you mean 'page_size'"),
        (dict(origin="cli"), r"unexpected keyword argument 'origin'$"),
        (dict(zzz=1), r"LLM\(\) got an unexpected keyword argument 'zzz'$"),
    ],
)
def test_unknown_keyword_is_a_type_error_with_close_matches(kwargs, match):
    from jaxinfer.llm import LLM

    with pytest.raises(TypeError, match=match):
        LLM("/nonexistent/model", **kwargs)


def test_kv_pool_beyond_memory_is_refused_with_bytes(stories_dir):
    from jaxinfer.llm import LLM

    def build():
        with pytest.raises(ValueError) as e:
            LLM(stories_dir, kv_pages=1_000_000_000, compilation_cache=False)
        msg = str(e.value)
        # stories260K: 5 layers x 4 KV heads x 8 x 2 (K, V) x 4 bytes = 1280 bytes a token.
        assert "1000000000 pages x 8 tokens x 1280 bytes a token" in msg
        assert f"= {10**9 * 8 * 1280} bytes" in msg and "host memory available:" in msg

    assert peak_alloc_bytes(build) < 64 * MiB


def test_huge_page_size_is_refused_before_the_pool(stories_dir):
    """page_size 2**30 on stories260K (512-token context): refused as larger than max_model_len
    before any pool is sized (the default sizing once kept a floor of 2 such pages, 2.7 TB)."""
    from jaxinfer.llm import LLM

    def build():
        with pytest.raises(
            ValueError,
            match=r"^page_size=1073741824 is larger than max_model_len \(512 tokens when not",
        ):
            LLM(stories_dir, page_size=2**30, compilation_cache=False)

    assert peak_alloc_bytes(build) < 64 * MiB


def test_kv_pool_slots_beyond_int32(stories_dir, monkeypatch):
    from jaxinfer.llm import LLM

    monkeypatch.setattr(memory_limits, "available_host_bytes", lambda: 2**60)
    with pytest.raises(ValueError, match=r"268435456 pages x 16 tokens = 4294967296 slots, more"):
        LLM(stories_dir, kv_pages=2**28, page_size=16, compilation_cache=False)


def test_huge_max_num_seqs(stories_dir, monkeypatch):
    """2**31 - 1 rows: 2**32 int32 sampling slots (ModelRunner's num_slots) twice = 32 GiB; refused
    against memory (8 GiB here), and against int32 row ids where memory would allow it."""
    from jaxinfer.engine.config import EngineConfig, check_kv_pool
    from jaxinfer.llm import LLM

    rows = 2**31 - 1
    monkeypatch.setattr(memory_limits, "available_host_bytes", lambda: 2**33)
    with pytest.raises(ValueError, match=r"buffers of max_num_seqs=2147483647 rows \(34359738368"):
        LLM(stories_dir, max_num_seqs=rows, compilation_cache=False)
    monkeypatch.setattr(memory_limits, "available_host_bytes", lambda: 2**60)
    cfg = ModelConfig("llama", 512, 64, 172, 5, 8, 4, 8)
    ecfg = EngineConfig(512, 8, 100, max_num_seqs=rows, max_num_batched_tokens=rows)
    with pytest.raises(ValueError, match=r"max_num_seqs=2147483647 gives 4294967296 sampling rows"):
        check_kv_pool(cfg, ecfg, np.float32)


def test_cli_kv_pages_beyond_memory_is_one_line_and_exit_2(stories_dir, tmp_path, capsys):
    from jaxinfer.cli import main as cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once upon a time"}\n')
    rc = cli.main(
        [
            "generate",
            "--model",
            str(stories_dir),
            "--prompts",
            str(prompts),
            "--out",
            str(tmp_path / "o.jsonl"),
            "--kv-pages",
            "1000000000",
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("jaxinfer: error: invalid engine setting: the KV")
    assert "10240000000000 bytes" in err[0] and "host memory available" in err[0]


BAD_PROMPTS = [
    ("generate", {"a": 1}, ValueError, r"prompts\[0\] is a dict with keys \['a'\]: a prompt dict"),
    ("generate", 5, TypeError, r"prompts has type int; accepted: a prompt \(a string, a list of"),
    ("generate", None, TypeError, r"prompts has type None; accepted: a prompt"),
    ("generate", b"Once", TypeError, r"prompts has type bytes; accepted"),
    ("generate", [True, 2], TypeError, r"prompts\[0\] has type bool; accepted"),
    ("generate", [1, "a"], TypeError, r"prompts\[0\] has type int; accepted"),
    ("generate", ["a", None], TypeError, r"prompts\[1\] has type None; accepted"),
    ("generate", {"prompt": 5}, TypeError, r"prompts\[0\]\['prompt'\] must be a string, not int"),
    ("generate", {"prompt_token_ids": "ab"}, TypeError, r"\['prompt_token_ids'\] must be a list"),
    ("chat", [], ValueError, r"chat\(\) takes a conversation .*: got an empty list"),
    ("chat", "hello", TypeError, r"chat\(\) takes a conversation .*use generate\(\) .*got str"),
    ("chat", [[]], ValueError, r"conversation 0 is empty"),
    ("chat", [["hi"]], TypeError, r"messages\[0\]\[0\] has type str"),
]


def test_prompts_of_the_wrong_type_raise_and_the_llm_stays_usable(stories_llm):
    """Prompts of a shape the Python API does not take (vLLM's: a string, token ids, a prompt
    dict, a list of these; chat: a conversation or a list of them) raise at once with what is
    accepted, before any request is queued; then the LLM still reproduces llama2.c's greedy
    outputs."""
    from conftest import assert_reproduces_stories_reference

    for method, prompts, error, match in BAD_PROMPTS:
        with pytest.raises(error, match=match):
            getattr(stories_llm, method)(prompts)
    for params, got in (({"max_tokens": 3}, "dict"), ("bogus", "str")):  # not a list of 5 chars
        with pytest.raises(TypeError, match=f"a SamplingParams or a list of them, not {got}$"):
            stories_llm.generate("Once", params)
    assert_reproduces_stories_reference(stories_llm)
