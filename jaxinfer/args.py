"""``EngineArgs``: every engine and model-loading option, defined once.

Each option is one field of the frozen dataclass ``EngineArgs``; its metadata (an ``Option``,
``jaxinfer.options``) holds
the help text, the command-line flag (and the negative flag of a switch), the choices and the
check. From the fields come:

- ``LLM(model, **kwargs)``'s keyword arguments and its signature (``llm_signature``);
- the flags of ``jaxinfer generate`` and ``jaxinfer serve`` (``EngineArgs.add_cli_args``), and the
  args of a parsed command line (``EngineArgs.from_cli_args``);
- the checks, run once when an ``EngineArgs`` is made: a bad value is a ValueError naming the
  setting as the user wrote it, ``--max-model-len 0`` on the command line and ``max_model_len=0``
  in Python (``EngineArgs.name`` / ``EngineArgs.spell``, from the field's flag and ``origin``);
- which settings change outputs (``OUTPUT_SETTINGS``, for ``jaxinfer.cli.partial``).

``resolve(args, cfg, param_dtype, mesh=..., tp=..., backend=...)`` (``jaxinfer.engine.config``)
turns an ``EngineArgs`` into the concrete ``EngineConfig`` the engine runs: every backend default
applied, every combination checked.

Adding an option: one field here (default, help, check, flag); the code that uses it reads
``args.<name>`` (model loading, ``LLM``) or, for the engine, an ``EngineConfig`` field of the same
name, which ``resolve`` fills from it.

Environment variables (conventions for caches, not options):

- ``JAXINFER_CACHE_DIR``: where jaxinfer keeps its caches (default ``~/.cache/jaxinfer``): XLA's
  persistent compilation cache in ``xla/``, the native CPU kernel's builds in ``cpu_kernels/``.
- ``JAXINFER_COMPILATION_CACHE=0``: no persistent compilation cache (as ``compilation_cache=False``
  / ``--no-compilation-cache``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import os
import textwrap

from jaxinfer.engine.config import KV_CACHE_DTYPES, resolve  # noqa: F401 - resolve: see above
from jaxinfer.models.attn_dispatch import ATTN_IMPLS
from jaxinfer.options import (
    ChatTemplate,
    Choice,
    Dtype,
    Gib,
    Int,
    Option,
    PathArg,
    Switch,
    add_flag,
    chat_template_text,
    default_text,
    option,
    render,
)
from jaxinfer.quant.tensor import MODES
from jaxinfer.server.reasoning_parsers import REASONING_PARSERS
from jaxinfer.server.tool_parsers import TOOL_PARSERS
from jaxinfer.speculative.config import SPECULATIVE_METHODS

SEED_MAX = 2**63 - 1
QUANTIZATIONS = (None, "none", *MODES)


# ------------------------------------------------------------------------- options


MODEL, ENGINE, TUNING, PARALLEL, SPEC, SERVING = (
    "model",
    "engine",
    "engine tuning (same outputs; defaults chosen per backend)",
    "parallelism",
    "speculative decoding",
    "serving: tool calls and reasoning",
)
SERVE_ONLY = ("tool_call_parser", "enable_auto_tool_choice", "reasoning_parser")
"""Options only the server reads (``jaxinfer.server``: how replies are parsed); ``jaxinfer
generate`` has no flag for them."""


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """Every engine and model-loading option (module docstring). Fields are ``LLM``'s arguments;
    ``origin`` ("python" or "cli") says how errors name them.

    Raises:
        ValueError: at construction, a value of the wrong type or out of range, or options that
            do not go together (``draft_model`` without ``speculative="draft-model"``,
            ``page_size`` > ``max_model_len``, ...); the
            message names the argument (or flag) and what is allowed.
    """

    model: str | os.PathLike = option(
        dataclasses.MISSING,
        "a Hugging Face model directory or a llama2.c checkpoint (file or directory)",
        PathArg(),
        group=MODEL,
        changes_outputs=True,
    )
    tokenizer: str | None = option(
        None,
        "tokenizer file overriding the one found beside the model",
        PathArg(optional=True),
        group=MODEL,
        default_text="the one beside the model",
        changes_outputs=True,
    )
    skip_tokenizer_init: bool = option(
        False,
        "load no tokenizer (vLLM's option): prompts are token ids, outputs have token ids and "
        "no text, and a request that needs text fails alone; a model with no tokenizer beside "
        "it runs this way too, with a warning. EOS comes from the checkpoint's config",
        Switch(),
        group=MODEL,
        changes_outputs=True,
    )
    chat_template: str | None = option(
        None,
        "chat template for chat requests ('messages'): a Jinja file, or the template text "
        "itself; replaces the tokenizer's (examples/chat_template.jinja suits models trained "
        "without one, such as stories260K)",
        ChatTemplate(),
        group=MODEL,
        default_text="the tokenizer's",
        changes_outputs=True,
    )
    dtype: str = option(
        "float32",
        "weight dtype: float32 (the fast dtype on CPU) or bfloat16 (the usual choice on "
        "TPU/GPU); the KV pool follows it unless {kv_cache_dtype} is int8",
        Dtype(),
        group=MODEL,
        changes_outputs=True,
    )
    quantization: str | None = option(
        None,
        "int8 weights: int8 (weight-only, w8a16) or w8a8 (int8 activations too); a checkpoint "
        "from `jaxinfer quantize` loads int8 without it",
        Choice(QUANTIZATIONS, cli=("none", *MODES)),
        group=MODEL,
        default_text="none",
        changes_outputs=True,
    )
    max_model_len: int | None = option(
        None,
        "longest prompt + output, tokens",
        Int(2, optional=True),
        default_text="the model's context length",
        changes_outputs=True,
    )
    max_num_seqs: int = option(64, "most sequences decoded together", Int(1))
    max_num_batched_tokens: int | None = option(
        None,
        "token budget of one step",
        Int(1, optional=True),
        default_text="max(512, {max_num_seqs})",
    )
    max_prefill_seqs: int = option(8, "most prompt chunks in one step", Int(1))
    page_size: int | None = option(
        None,
        "tokens per KV page",
        Int(1, optional=True),
        default_text="8 on CPU with the XLA attention, else 16",
    )
    kv_pages: int | None = option(
        None,
        "pages in the KV pool",
        Int(2, optional=True),
        default_text="every sequence at full length, within {kv_cache_memory_gb}",
    )
    kv_cache_memory_gb: float = option(
        2.0, "memory budget of the default KV pool, in GiB (2**30 bytes) per device", Gib()
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV pages: auto (the weights' float dtype) or int8 (per-token, per-head scales)",
        Choice(KV_CACHE_DTYPES),
        changes_outputs=True,
    )
    attn_impl: str = option(
        "auto",
        "attention implementation: auto (on CPU cpu_kernel where the KV pool allows, else xla; "
        "the Pallas kernel where verified), xla, pallas (this backend's kernel), pallas_tpu, "
        "pallas_gpu, pallas_tpu_interpret / pallas_gpu_interpret (the kernels run on CPU, for "
        "tests), cpu_kernel (XLA with a native CPU decode kernel built by the C++ compiler)",
        Choice(ATTN_IMPLS),
        metavar="IMPL",
    )
    enable_prefix_caching: bool = option(
        True,
        "reuse the KV pages of prompt prefixes that earlier requests computed (same outputs)",
        Switch(),
        flag="--enable-prefix-caching",
        negative="--no-prefix-caching",
    )
    async_scheduling: bool | None = option(
        None,
        "dispatch each step before the previous one's tokens are read back, so host work "
        "overlaps the device (same outputs up to float near-ties; not with {speculative})",
        Switch(optional=True),
        default_text="on, off with {speculative}",
    )
    batch_invariant: bool = option(
        False,
        "every request's logits, tokens and logprobs bitwise the same whatever else is in the "
        "batch (its size, chunking, preemption); slower. Not with {speculative}, a Pallas "
        "{attn_impl} or tensor/data parallelism",
        Switch(),
        changes_outputs=True,
    )
    seed: int = option(
        0,
        "engine seed: seeds the RNG that draws a sampling seed for each request without one "
        "of its own (SamplingParams.seed, which generate's --sampling-seed sets); the same "
        "engine seed and requests give the same draws",
        Int(0, high=SEED_MAX),
    )
    reuse_compiled_buckets: bool = option(
        True,
        "run a step of a shape not compiled yet padded to a compiled one at most one bucket "
        "larger, instead of compiling it first: fewer compilations",
        Switch(),
        group=TUNING,
    )
    unroll_layers: bool | None = option(
        None,
        "run the layers as an unrolled loop over per-layer weights (faster decode, longer "
        "compiles) instead of a lax.scan over stacked ones",
        Switch(optional=True),
        group=TUNING,
        default_text="on CPU",
    )
    scan_layers_from_tokens: int | None = option(
        None,
        "with unrolled layers, steps of at least this many tokens run their layers as a "
        "lax.scan all the same (much less compile for those steps); 0 = never",
        Int(0, optional=True),
        group=TUNING,
        default_text="128, 0 with {batch_invariant}",
    )
    out_in_weights: bool | None = option(
        None,
        "store the layer projections output-first, q/k/v and gate/up fused (the layout XLA "
        "CPU's GEMM runs fastest for a few rows)",
        Switch(optional=True),
        group=TUNING,
        default_text="on CPU without tensor/data parallelism",
    )
    kv_page_major: bool | None = option(
        None,
        "lay the KV pool out page-major [L, P, K, Z, H], so the XLA attention's page gathers "
        "read whole pages (XLA attention on one device only)",
        Switch(optional=True),
        group=TUNING,
        default_text="on CPU with the XLA attention on one device",
    )
    keep_host_memory: bool | None = option(
        None,
        "keep freed host memory in the process instead of returning large buffers to the OS "
        "each step (glibc mallopt; process-wide): spares each step's page faults",
        Switch(optional=True),
        group=TUNING,
        default_text="on CPU",
    )
    compilation_cache: bool = option(
        True,
        "use JAX's persistent compilation cache in $JAXINFER_CACHE_DIR/xla "
        "(JAXINFER_COMPILATION_CACHE=0 turns it off as well)",
        Switch(),
        group=TUNING,
    )
    tensor_parallel_size: int | None = option(
        None,
        "devices each model copy is split over (heads, MLP width, vocabulary)",
        Int(1, optional=True),
        group=PARALLEL,
        default_text="all devices when the weights do not fit one device, else 1",
    )
    data_parallel_size: int | None = option(
        None,
        "engine replicas, each over its own {tensor_parallel_size} devices; requests are split "
        "between them",
        Int(1, optional=True),
        group=PARALLEL,
        default_text="1",
    )
    enable_expert_parallel: bool = option(
        False,
        "mixture-of-experts models: split the experts over each replica's "
        "{tensor_parallel_size} devices (expert parallel; num_experts must be divisible by it) "
        "instead of splitting every expert's width over them",
        Switch(),
        group=PARALLEL,
        negative="--no-expert-parallel",
    )
    multihost: bool | None = option(
        None,
        "call jax.distributed.initialize() first (one process per host; for jaxinfer generate, "
        "process 0 writes the output)",
        Switch(optional=True),
        group=PARALLEL,
        default_text="on TPU slices of several hosts",
    )
    speculative: str | None = option(
        None,
        "speculative decoding drafter: draft-model (a smaller model), ngram (prompt lookup) or "
        "heads (Medusa heads)",
        Choice((None, *SPECULATIVE_METHODS), cli=SPECULATIVE_METHODS),
        group=SPEC,
        default_text="off",
        changes_outputs=True,
    )
    num_speculative_tokens: int = option(
        4, "R, draft tokens proposed per sequence and round", Int(1), group=SPEC,
        changes_outputs=True,
    )  # fmt: skip
    draft_model: str | None = option(
        None,
        "the draft model of {speculative} draft-model: a checkpoint with the target's tokenizer, "
        "'self' or 'layers:N' (the target's first N layers)",
        PathArg(optional=True),
        group=SPEC,
        changes_outputs=True,
    )
    draft_heads: str | None = option(
        None,
        "directory of draft heads for {speculative} heads (jaxinfer train-draft-heads)",
        PathArg(optional=True),
        group=SPEC,
        changes_outputs=True,
    )
    tool_call_parser: str | None = option(
        None,
        "the model's tool-call format, read back as OpenAI's tool_calls when a chat request "
        "has tool_choice auto (vLLM's --tool-call-parser): hermes (Hermes, Qwen2.5, Qwen3: "
        "<tool_call>JSON</tool_call>), llama3_json (Llama 3.x JSON), mistral ([TOOL_CALLS])",
        Choice((None, *TOOL_PARSERS), cli=tuple(TOOL_PARSERS)),
        group=SERVING,
        default_text="none: tool_choice auto is refused",
        metavar="FORMAT",
    )
    enable_auto_tool_choice: bool = option(
        False,
        "let chat requests use tool_choice auto (the model decides; its calls are read with "
        "{tool_call_parser}, which it needs), as vLLM's --enable-auto-tool-choice",
        Switch(),
        group=SERVING,
        negative="--no-auto-tool-choice",
    )
    reasoning_parser: str | None = option(
        None,
        "the reasoning model's format: its <think>...</think> text returned as "
        "reasoning_content apart from the content (vLLM's --reasoning-parser): deepseek_r1 "
        "(the output starts inside the reasoning) or qwen3 (reasoning when the output starts "
        "with <think>)",
        Choice((None, *REASONING_PARSERS), cli=tuple(REASONING_PARSERS)),
        group=SERVING,
        default_text="none: the text is all content",
        metavar="FORMAT",
    )
    origin: str = dataclasses.field(default="python", kw_only=True, compare=False, repr=False)

    def __post_init__(self):
        if self.origin not in ("python", "cli"):
            raise ValueError(f"origin must be 'python' or 'cli', got {self.origin!r}")
        for f in option_fields():
            f.metadata["option"].check(self, f.name, getattr(self, f.name))
        spec = self.speculative
        for name, method in (("draft_model", "draft-model"), ("draft_heads", "heads")):
            if getattr(self, name) is not None and spec != method:
                raise ValueError(
                    f"{self.name(name)} is used only with {self.spell('speculative', method)} "
                    f"({self.spell('speculative')})"
                )
            if spec == method and getattr(self, name) is None:
                raise ValueError(f"{self.spell('speculative')} needs {self.name(name)}")
        if self.batch_invariant and spec is not None:
            raise ValueError(
                f"{self.spell('batch_invariant')} is not supported with speculative decoding "
                f"({self.spell('speculative')}): its verify pass runs the batched attention"
            )
        if self.async_scheduling and spec is not None:
            raise ValueError(
                f"{self.spell('async_scheduling')} is not supported with speculative decoding "
                "(its rounds run synchronously)"
            )
        if self.page_size is not None and self.max_model_len is not None:
            if self.page_size > self.max_model_len:
                raise ValueError(
                    f"{self.spell('page_size')} is larger than {self.spell('max_model_len')}: a "
                    f"KV page holds tokens of one sequence; give a {self.name('page_size')} of "
                    f"at most {self.name('max_model_len')} (8 or 16 usually)"
                )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                f"{self.spell('enable_auto_tool_choice')} needs {self.name('tool_call_parser')} "
                "(the model's tool-call format: " + ", ".join(TOOL_PARSERS) + ")"
            )
        if self.scan_layers_from_tokens and self.batch_invariant:
            raise ValueError(
                f"{self.spell('scan_layers_from_tokens')} with {self.spell('batch_invariant')}: a "
                "step's loop form would follow its token count, and a row's bits with it; use 0"
            )

    # ---------------------------------------------------------------- naming

    def name(self, field: str) -> str:
        """How the user names option ``field``: its flag from the command line, else itself."""
        return flag_of(field) if self.origin == "cli" else field

    def spell(self, field: str, value=dataclasses.MISSING) -> str:
        """Option ``field`` set to ``value`` (default: its value here) as the user writes it:
        ``max_model_len=0`` in Python, ``--max-model-len 0`` on the command line (a switch: its
        flag or its negative flag; None: ``--flag not given``)."""
        v = getattr(self, field) if value is dataclasses.MISSING else value
        if self.origin != "cli":
            return f"{field}={v!r}"
        opt = option_of(field)
        if isinstance(opt.check, Switch) and isinstance(v, bool):
            return flag_of(field) if v else negative_of(field)
        if v is None:
            return f"{flag_of(field)} not given"
        return f"{flag_of(field)} {v}"

    # ---------------------------------------------------------------- the command line

    @staticmethod
    def add_cli_args(parser, exclude=()) -> None:
        """Adds a flag for every option but ``exclude`` (field names) to ``parser`` (in groups
        by topic) or to one argument group; each flag's help states its default."""
        groups: dict[str, object] = {}
        for f in option_fields():
            if f.name in exclude:
                continue
            opt = f.metadata["option"]
            if isinstance(parser, argparse.ArgumentParser):
                if opt.group not in groups:
                    groups[opt.group] = parser.add_argument_group(opt.group)
                target = groups[opt.group]
            else:
                target = parser
            add_flag(target, f, flag_of)

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace, **overrides) -> EngineArgs:
        """The args of a parsed command line (flags ``add_cli_args`` added; absent ones take
        their defaults), ``overrides`` on top; errors name flags. Raises ValueError."""
        given = {
            f.name: getattr(namespace, f.name) for f in option_fields() if f.name in vars(namespace)
        }
        given |= overrides
        return cls(**given, origin="cli")

    def read_chat_template(self) -> str | None:
        """The chat template's text (``chat_template``'s file read; checked when these args
        were made), or None. Raises OSError for a file gone since."""
        return None if self.chat_template is None else chat_template_text(self.chat_template)


# ------------------------------------------------------------------------- from the fields


def option_fields() -> list[dataclasses.Field]:
    """The option fields of ``EngineArgs`` in order (``origin`` is not one)."""
    return [f for f in dataclasses.fields(EngineArgs) if "option" in f.metadata]


def option_of(field: str) -> Option:
    """The ``Option`` of field ``field``. Raises KeyError for a name that is not an option."""
    return _FIELDS[field].metadata["option"]


def flag_of(field: str) -> str:
    """The command-line flag of option ``field``: ``max_model_len`` -> ``--max-model-len``."""
    return option_of(field).flag_of(field)


def negative_of(field: str) -> str:
    """The flag that sets switch ``field`` False: ``--no-batch-invariant``."""
    return option_of(field).negative_of(field)


_FIELDS = {f.name: f for f in option_fields()}

OUTPUT_SETTINGS = tuple(f.name for f in option_fields() if f.metadata["option"].changes_outputs)
"""Options a different value of which can change the tokens (``Option.changes_outputs``)."""


def check_keywords(names, caller: str = "LLM") -> None:
    """Raises TypeError naming the first of ``names`` that is not an option keyword of
    ``caller`` (every option but ``model``), with the close matches."""
    known = [n for n in _FIELDS if n != "model"]
    for n in names:
        if n not in known:
            close = difflib.get_close_matches(n, known, n=3)
            hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
            raise TypeError(f"{caller}() got an unexpected keyword argument {n!r}{hint}")


def llm_signature() -> inspect.Signature:
    """``LLM.__init__``'s signature: ``(self, model, *, <every other option>=<default>)``."""
    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_OR_KEYWORD), P("model", P.POSITIONAL_OR_KEYWORD)]
    params[1] = params[1].replace(annotation=_FIELDS["model"].type)
    for f in option_fields()[1:]:
        params.append(P(f.name, P.KEYWORD_ONLY, default=f.default, annotation=f.type))
    return inspect.Signature(params, return_annotation=None)


def describe(indent: int = 8, width: int = 100) -> str:
    """The options as a docstring ``Args:`` list (name: help, default), for ``LLM.__doc__``."""
    lines = []
    for f in option_fields()[1:]:
        opt = f.metadata["option"]
        default = default_text(f, str)
        text = (
            f"{f.name}: {render(opt.help, str)}"
            + (f" (default: {default})" if default else "")
            + "."
        )
        lines += textwrap.wrap(
            text,
            width,
            initial_indent=" " * indent,
            subsequent_indent=" " * (indent + 4),
            break_on_hyphens=False,
        )
    return "\n".join(lines)
