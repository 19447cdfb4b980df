"""``EngineArgs`` (jaxinfer.args): one field per option makes the CLI flags, LLM's keyword
arguments and their checks; errors name the setting as the user wrote it, by construction: the
flag from the command line, the argument from Python. Checked against the argparse parser itself
(every option is a flag with its field as dest, and a spelled ``--flag value`` parses back to the
value) and end to end through generate and serve."""

import argparse
import re

import pytest

from jaxinfer.args import SERVE_ONLY, EngineArgs, flag_of, negative_of, option_fields
from jaxinfer.cli import main as cli

BASE = ["generate", "--model", "m", "--prompts", "p", "--out", "o"]


def _actions(command="generate"):
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    return {opt: a for a in sub.choices[command]._actions for opt in a.option_strings}


def _parse(*argv, command="generate"):
    base = BASE if command == "generate" else ["serve", "--model", "m"]
    return cli.build_parser().parse_args([*base, *argv])


def test_every_option_is_a_flag_of_its_field_and_defaults_round_trip():
    actions, serve = _actions(), _actions("serve")
    for f in option_fields():
        if f.name in SERVE_ONLY:  # how the server reads replies: serve's flags alone
            assert flag_of(f.name) not in actions and serve[flag_of(f.name)].dest == f.name
            continue
        a = actions[flag_of(f.name)]
        assert a.dest == f.name, f.name
        if isinstance(f.default, bool) or f.name in ("async_scheduling", "multihost"):
            assert actions[negative_of(f.name)] is a  # a switch: both spellings, one action
    assert EngineArgs.from_cli_args(_parse()) == EngineArgs("m")  # CLI defaults = LLM defaults
    assert flag_of("enable_prefix_caching") == "--enable-prefix-caching"
    assert negative_of("enable_prefix_caching") == "--no-prefix-caching"


FLAGS = [
    (["--no-prefix-caching"], dict(enable_prefix_caching=False)),
    (["--no-prefix-caching", "--enable-prefix-caching"], dict(enable_prefix_caching=True)),
    (["--no-reuse-compiled-buckets"], dict(reuse_compiled_buckets=False)),
    (["--async-scheduling"], dict(async_scheduling=True)),
    (["--no-async-scheduling"], dict(async_scheduling=False)),
    (
        ["--no-kv-page-major", "--keep-host-memory"],
        dict(kv_page_major=False, keep_host_memory=True),
    ),
    (["--max-prefill-seqs", "3"], dict(max_prefill_seqs=3)),
    (["--kv-cache-memory-gb", "0.5"], dict(kv_cache_memory_gb=0.5)),
    (
        ["--quantization", "int8", "--dtype", "bfloat16"],
        dict(quantization="int8", dtype="bfloat16"),
    ),
    (["--speculative", "ngram", "--num-speculative-tokens", "2"], dict(num_speculative_tokens=2)),
    (["--no-multihost"], dict(multihost=False)),
    (
        ["--enable-expert-parallel", "--tensor-parallel-size", "4"],
        dict(enable_expert_parallel=True),
    ),
]


@pytest.mark.parametrize("argv, want", FLAGS)
def test_flags_reach_engine_args(argv, want):
    args = EngineArgs.from_cli_args(_parse(*argv))
    assert {k: getattr(args, k) for k in want} == want and args.origin == "cli"


ERRORS = [
    (dict(max_model_len=0), "max_model_len=0 is out of range", "--max-model-len 0 is out of range"),
    (dict(page_size=0), "page_size=0 is out of range", "--page-size 0 is out of range"),
    (dict(seed=-1), "seed=-1 is out of range", "--seed -1 is out of range"),
    (
        dict(kv_cache_memory_gb=-1.0),
        "kv_cache_memory_gb=-1.0 must",
        "--kv-cache-memory-gb -1.0 must",
    ),
    (
        dict(draft_model="self"),
        "draft_model is used only with speculative='draft-model' (speculative=None)",
        "--draft-model is used only with --speculative draft-model (--speculative not given)",
    ),
    (
        dict(speculative="heads"),
        "speculative='heads' needs draft_heads",
        "--speculative heads needs --draft-heads",
    ),
    (
        dict(speculative="ngram", batch_invariant=True),
        "batch_invariant=True is not supported with speculative decoding (speculative='ngram')",
        "--batch-invariant is not supported with speculative decoding (--speculative ngram)",
    ),
    (
        dict(speculative="ngram", async_scheduling=True),
        "async_scheduling=True is not supported with speculative",
        "--async-scheduling is not supported with speculative",
    ),
    (
        dict(page_size=64, max_model_len=32),
        "page_size=64 is larger than max_model_len=32: a KV page",
        "--page-size 64 is larger than --max-model-len 32: a KV page",
    ),
    (
        dict(batch_invariant=True, scan_layers_from_tokens=8),
        "scan_layers_from_tokens=8 with batch_invariant=True",
        "--scan-layers-from-tokens 8 with --batch-invariant",
    ),
]


@pytest.mark.parametrize("kwargs, python, cli_message", ERRORS)
def test_errors_name_the_argument_from_python_and_the_flag_from_the_command_line(
    kwargs, python, cli_message
):
    with pytest.raises(ValueError) as e:
        EngineArgs("m", **kwargs)
    assert str(e.value).startswith(python), str(e.value)
    with pytest.raises(ValueError) as e:
        EngineArgs.from_cli_args(argparse.Namespace(model="m", **kwargs))
    assert str(e.value).startswith(cli_message), str(e.value)
    assert not any(f"{k}=" in str(e.value) for k in kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_num_batched_tokens=4, max_num_seqs=8),
        dict(attn_impl="pallas_tpu"),
        dict(batch_invariant=True, seed=7),
        dict(enable_prefix_caching=False, kv_page_major=True, async_scheduling=False),
        dict(draft_model="layers:2", speculative="draft-model"),
    ],
)
def test_spelled_flags_parse_back_to_the_values(kwargs):
    """What ``spell`` writes is what the user types: parsed by the real parser, each spelled
    setting gives its value back."""
    args = EngineArgs("m", **kwargs, origin="cli")
    argv = [w for k in kwargs for w in args.spell(k).split()]
    parsed = _parse(*argv)
    assert {k: getattr(parsed, k) for k in kwargs} == kwargs
    assert args.name("max_num_seqs") == "--max-num-seqs"
    assert EngineArgs("m").spell("attn_impl", "xla") == "attn_impl='xla'"


def test_serve_has_every_engine_flag_but_multihost():
    gen, serve = _actions("generate"), _actions("serve")
    engine = {flag for f in option_fields() for flag in (flag_of(f.name), negative_of(f.name))}
    assert engine & set(gen) - {"--multihost", "--no-multihost"} <= set(serve)
    assert "--multihost" in gen and "--multihost" not in serve
    args = EngineArgs.from_cli_args(_parse("--no-prefix-caching", command="serve"), multihost=False)
    assert not args.enable_prefix_caching and args.multihost is False


def test_help_reads_well():
    """No "(default: True)" on a negative flag, no doubled or None defaults, no underscores
    for other options in help texts (they name flags)."""
    for command in ("generate", "serve"):
        sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
        text = sub.choices[command].format_help()
        flat = " ".join(text.split())
        assert "(default: True)" not in flat and "(default: False)" not in flat, command
        assert "(default: None)" not in flat, command
        assert re.search(r"\(default:[^()]*\) \(default:", flat) is None, command  # doubled
        assert "--enable-prefix-caching, --no-prefix-caching" in text
        assert "(default: max(512, --max-num-seqs))" in flat
        assert "max_num_seqs" not in flat and "kv_cache_dtype" not in flat
    serve = " ".join(sub.choices["serve"].format_help().split())
    assert "clients pass as 'model' (default: --model as given) --max-queue" in serve


def test_generate_error_names_the_flag(stories_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once upon a time"}\n')
    base = [
        "generate",
        "--model",
        str(stories_dir),
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "o.jsonl"),
        "--no-progress",
    ]
    assert cli.main([*base, "--max-model-len", "0"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "jaxinfer: error: invalid engine setting: --max-model-len 0 is out of range"
    ), err
    assert cli.main([*base, "--kv-pages", "3"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert "Raise --kv-pages or lower --max-model-len." in err and "_" not in err.split(": ", 2)[2]
    assert cli.main([*base, "--max-model-len", "600"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert "--max-model-len 600 must be in [2, 512]" in err, err
    assert cli.main([*base, "--max-num-seqs", "8", "--max-num-batched-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--max-num-batched-tokens 4 must be >= --max-num-seqs 8" in err, err
    assert not (tmp_path / "o.jsonl").exists()


def test_python_errors_of_resolve_name_arguments(stories_dir):
    from jaxinfer.llm import LLM

    with pytest.raises(ValueError, match=r"^max_model_len=600 must be in \[2, 512\]"):
        LLM(stories_dir, max_model_len=600, compilation_cache=False)
    with pytest.raises(ValueError, match=r"Raise kv_pages or lower max_model_len\.$"):
        LLM(stories_dir, kv_pages=3, compilation_cache=False)
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens=4 must be >= max_num_seqs=8"):
        LLM(stories_dir, max_num_seqs=8, max_num_batched_tokens=4, compilation_cache=False)


def test_resolve_applies_each_backend_default():
    """resolve leaves no None or "auto": the documented defaults (EngineArgs' help) on CPU and,
    for the switches that follow the backend, elsewhere; a mesh turns off what one device
    needs; explicit values win."""
    import jax
    import numpy as np

    from jaxinfer.engine.config import EngineConfig, resolve
    from jaxinfer.models.config import ModelConfig

    cfg = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8, max_position_embeddings=96)

    def resolved(backend="cpu", mesh=None, **kw):
        return resolve(EngineArgs("m", **kw), cfg, np.float32, mesh=mesh, backend=backend)

    cpu = resolved(attn_impl="xla")
    assert (cpu.max_model_len, cpu.page_size, cpu.max_num_batched_tokens) == (96, 8, 512)
    assert cpu.num_pages == 64 * 12 + 1  # every row at full length: 64 x 96 / 8 pages + null
    assert cpu.unroll_layers and cpu.out_in_weights and cpu.kv_page_major and cpu.keep_host_memory
    assert cpu.scan_layers_from_tokens == 128 and cpu.async_scheduling
    assert (cpu.attn_impl, cpu.kv_cache_dtype) == ("xla", "float32")
    assert cpu.attn_impl_reason == "attn_impl='xla' asked"
    tpu = resolved("tpu", attn_impl="xla")
    assert tpu.page_size == 16 and not (tpu.unroll_layers or tpu.out_in_weights)
    assert not (tpu.kv_page_major or tpu.keep_host_memory)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))  # resolve reads its devices
    sharded = resolved(mesh=mesh, attn_impl="xla")
    assert not (sharded.kv_page_major or sharded.out_in_weights) and sharded.unroll_layers
    assert not resolved(speculative="ngram").async_scheduling  # its rounds run synchronously
    assert resolved(batch_invariant=True).scan_layers_from_tokens == 0
    assert resolved(attn_impl="pallas_tpu_interpret").kv_page_major is False
    assert resolved(kv_cache_dtype="int8").kv_cache_dtype == "int8"
    assert resolve(EngineArgs("m"), cfg, "bfloat16").kv_cache_dtype == "bfloat16"
    explicit = resolved(
        page_size=4, kv_pages=50, max_num_batched_tokens=64, max_prefill_seqs=2, unroll_layers=False
    )
    assert (explicit.page_size, explicit.num_pages, explicit.max_num_batched_tokens) == (4, 50, 64)
    assert explicit.max_prefill_seqs == 2 and not explicit.unroll_layers
    assert all(v is not None and v != "auto" for v in vars(cpu).values())
    with pytest.raises(TypeError, match="attn_impl='auto'"):
        EngineConfig(64, attn_impl="auto")


def test_page_size_beyond_the_context_and_a_budget_below_one_sequence_are_refused():
    """Where the model sets ``max_model_len`` (not given), a larger page is refused naming both
    options; the default pool stays within ``kv_cache_memory_gb`` (it once kept a floor of 2
    pages beyond the budget), and a budget below one sequence is refused naming it."""
    import numpy as np

    from jaxinfer.engine.config import resolve
    from jaxinfer.models.config import ModelConfig

    # L=2, K=2, H=8, f32: 2 (K, V) x 2 x 2 x 8 x 4 = 256 bytes a token; a 96-token context.
    cfg = ModelConfig("llama", 64, 32, 64, 2, 4, 2, 8, max_position_embeddings=96)

    def resolved(origin="python", **kw):
        return resolve(EngineArgs("m", **kw, origin=origin), cfg, np.float32, backend="cpu")

    for origin, want in (
        ("python", r"^page_size=128 is larger than max_model_len \(96 tokens when not given"),
        ("cli", r"^--page-size 128 is larger than --max-model-len \(96 tokens when not given"),
    ):
        with pytest.raises(ValueError, match=want):
            resolved(origin, page_size=128)
    assert resolved(page_size=96).page_size == 96
    page = 96 * 256
    for pages in (2, 3, 7):
        gib = (pages * page + page // 2) / 2**30
        ecfg = resolved(page_size=96, max_num_seqs=8, kv_cache_memory_gb=gib)
        assert ecfg.num_pages == pages and ecfg.num_pages * page <= gib * 2**30
    with pytest.raises(ValueError) as e:
        resolved("cli", page_size=96, kv_cache_memory_gb=1.5 * page / 2**30)
    assert str(e.value).startswith("KV pool too small: --kv-cache-memory-gb ")
    assert "GiB per device holds 1 pages of 96 tokens x 256 bytes a token; one sequence of " in (
        str(e.value)
    )
    assert "--max-model-len 96 needs 2 pages (1 + 1 reserved), 49152 bytes" in str(e.value)
    assert str(e.value).endswith(
        "Raise --kv-cache-memory-gb or lower --max-model-len or --page-size."
    )


def test_partial_settings_are_the_options_that_change_outputs():
    """The options a partial-state file depends on (cli.partial.SETTINGS) come from
    ``changes_outputs``: the hand-kept list they replaced, and the chat template."""
    from jaxinfer.cli.partial import SETTINGS

    before = {
        "model",
        "tokenizer",
        "skip_tokenizer_init",
        "dtype",
        "quantization",
        "kv_cache_dtype",
        "max_model_len",
        "speculative",
        "num_speculative_tokens",
        "draft_model",
        "draft_heads",
        "batch_invariant",
    }
    assert set(SETTINGS) == before | {"chat_template"}


def test_environment_switches_are_options_now(monkeypatch):
    """keep_host_memory and multihost were environment variables (JAXINFER_KEEP_HOST_MEMORY,
    JAXINFER_MULTIHOST); now options: an engine applies the allocator setting only when its
    config says so, and multi-host runs when asked, or by default on a TPU slice of several
    hosts, whatever those variables say."""
    import jax
    import numpy as np

    import jaxinfer.engine.runner as runner
    from jaxinfer.engine.config import EngineConfig
    from jaxinfer.models.config import ModelConfig
    from jaxinfer.models.params import init_random
    from jaxinfer.models.sharding import multihost_requested

    monkeypatch.setenv("JAXINFER_KEEP_HOST_MEMORY", "0")
    monkeypatch.setenv("JAXINFER_MULTIHOST", "1")
    calls = []
    monkeypatch.setattr(runner, "keep_freed_host_memory", lambda: calls.append(1))
    cfg = ModelConfig("llama", 64, 32, 64, 1, 4, 2, 8, max_position_embeddings=32)
    params = init_random(cfg, jax.random.key(0))

    for keep in (False, True):
        ecfg = EngineConfig(32, page_size=8, num_pages=5, max_num_seqs=1, keep_host_memory=keep)
        runner.ModelRunner(cfg, params, ecfg)
        assert len(calls) == keep
    assert np.dtype(ecfg.kv_cache_dtype) == np.float32
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    monkeypatch.delenv("MEGASCALE_COORDINATOR_ADDRESS", raising=False)
    assert not multihost_requested(None) and multihost_requested(True)
    monkeypatch.setenv("TPU_WORKER_HOSTNAMES", "host-a,host-b")
    assert multihost_requested(None) and not multihost_requested(False)


def test_tool_call_and_reasoning_parser_flags():
    args = EngineArgs.from_cli_args(
        _parse(
            "--tool-call-parser",
            "hermes",
            "--enable-auto-tool-choice",
            "--reasoning-parser",
            "qwen3",
            command="serve",
        ),
        multihost=False,
    )
    assert (args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser) == (
        "hermes",
        True,
        "qwen3",
    )
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        EngineArgs.from_cli_args(_parse("--enable-auto-tool-choice", command="serve"))
    with pytest.raises(ValueError, match="enable_auto_tool_choice=True needs tool_call_parser"):
        EngineArgs("m", enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser='qwen' is not supported; supported"):
        EngineArgs("m", tool_call_parser="qwen")
    with pytest.raises(SystemExit):
        _parse("--tool-call-parser", "hermes")  # generate has no such flag
    from jaxinfer.server.app import tool_options

    opts = tool_options(args)
    assert opts.parser.name == "hermes" and opts.auto and opts.reasoning.name == "qwen3"
    assert tool_options(EngineArgs("m")) == type(opts)()
