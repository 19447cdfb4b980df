"""``EngineArgs``: every engine and model-loading option, defined once.

Each option is one field of the frozen dataclass ``EngineArgs``; its metadata (an ``Option``) holds
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
import math
import numbers
import os
import textwrap
from pathlib import Path

from jaxinfer.engine.config import KV_CACHE_DTYPES, resolve  # noqa: F401 - resolve: see above
from jaxinfer.loaders import WEIGHT_DTYPES
from jaxinfer.models.config import INT32_MAX
from jaxinfer.models.paged_attention import ATTN_IMPLS
from jaxinfer.quant.tensor import MODES
from jaxinfer.speculative.config import SPECULATIVE_METHODS

SEED_MAX = 2**63 - 1
QUANTIZATIONS = (None, "none", *MODES)


# ------------------------------------------------------------------------- checks


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class Int:
    """An integer in [low, high] (None too when ``optional``)."""

    low: int
    high: int = INT32_MAX
    optional: bool = False
    metavar = "N"
    cli_type = int

    def __call__(self, args: EngineArgs, name: str, v) -> None:
        if v is None and self.optional:
            return
        if not _is_int(v):
            none = " or None" if self.optional else ""
            raise ValueError(
                f"{args.name(name)} must be an integer{none}, got {v!r} ({type(v).__name__})"
            )
        if not self.low <= v <= self.high:
            raise ValueError(
                f"{args.spell(name)} is out of range: expected an integer in "
                f"[{self.low}, {self.high}]"
            )


@dataclasses.dataclass(frozen=True)
class Choice:
    """One of ``values`` (``cli``: the ones the command line offers, default ``values``)."""

    values: tuple
    cli: tuple | None = None
    metavar = None
    cli_type = str

    def __call__(self, args: EngineArgs, name: str, v) -> None:
        if not any(v is a or (isinstance(v, str) and v == a) for a in self.values):
            raise ValueError(
                f"{args.spell(name)} is not supported; supported: "
                + ", ".join(repr(a) for a in self.values)
            )


@dataclasses.dataclass(frozen=True)
class Switch:
    """True or False (None too when ``optional``: the backend's default)."""

    optional: bool = False
    metavar = None
    cli_type = None

    def __call__(self, args: EngineArgs, name: str, v) -> None:
        if not (isinstance(v, bool) or (self.optional and v is None)):
            allowed = "True, False or None" if self.optional else "True or False"
            raise ValueError(f"{args.name(name)} must be {allowed}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class PathArg:
    """A non-empty path, str or os.PathLike (None too when ``optional``)."""

    optional: bool = False
    metavar = "PATH"
    cli_type = str

    def __call__(self, args: EngineArgs, name: str, v) -> None:
        if v is None and self.optional:
            return
        if isinstance(v, bytes) or not isinstance(v, str | os.PathLike) or not os.fspath(v):
            raise ValueError(
                f"{args.name(name)} must be a non-empty path (str or os.PathLike), got {v!r}"
            )


class Dtype:
    """A weight dtype name (or numpy/jax dtype) of ``WEIGHT_DTYPES``."""

    metavar = None
    cli_type = str
    cli = WEIGHT_DTYPES

    def __call__(self, args: EngineArgs, name: str, v) -> None:
        import jax.numpy as jnp

        try:
            ok = not isinstance(v, bool) and v is not None and jnp.dtype(v).name in WEIGHT_DTYPES
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(
                f"{args.spell(name)} is not supported; supported: {', '.join(WEIGHT_DTYPES)} "
                f"(int8 weights: {args.spell('quantization', 'int8')})"
            )


class Gib:
    """A finite number of GiB > 0."""

    metavar = "GIB"
    cli_type = float

    def __call__(self, args: EngineArgs, name: str, v) -> None:
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ValueError(f"{args.name(name)} must be a number, got {v!r} ({type(v).__name__})")
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{args.spell(name)} must be a finite number > 0 (GiB)")


class ChatTemplate:
    """A Jinja chat template: a file, or the template text itself (vLLM's ``--chat-template``:
    text when it holds a ``{`` or a newline), or None. The file must exist and the template
    compile."""

    metavar = "FILE"
    cli_type = str

    def __call__(self, args: EngineArgs, name: str, v) -> None:
        PathArg(optional=True)(args, name, v)
        if v is not None:
            read_chat_template(args, name, v)


def is_template_text(v) -> bool:
    """Whether a ``chat_template`` value is the template itself rather than a file name."""
    return isinstance(v, str) and ("{" in v or "\n" in v)


def read_chat_template(args: EngineArgs, name: str, v) -> str:
    """The template text of ``chat_template`` value ``v`` (a file's contents, or ``v``).

    Raises:
        ValueError: the file does not exist or cannot be read, or the template does not compile;
            the message names the file (or says it is the text given).
    """
    from jinja2 import TemplateSyntaxError

    from jaxinfer.tokenizers.chat_template import compile_chat_template

    if is_template_text(v):
        text, where = v, f"{args.name(name)} (the template text given)"
    else:
        where = args.spell(name, os.fspath(v))
        try:
            text = Path(v).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(
                f"{where}: no such file (a chat template is a Jinja file, or the template text "
                "itself)"
            ) from None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{where}: cannot read the chat template: {e}") from None
    try:
        compile_chat_template(text)
    except TemplateSyntaxError as e:
        raise ValueError(
            f"{where}: the chat template does not compile: {e} (template line {e.lineno})"
        ) from None
    except Exception as e:  # noqa: BLE001 - RecursionError from nesting, and the like
        raise ValueError(f"{where}: the chat template does not compile: {e!r}") from None
    return text


# ------------------------------------------------------------------------- options


@dataclasses.dataclass(frozen=True)
class Option:
    """An ``EngineArgs`` field's metadata.

    Attributes:
        help: what the option does, for ``--help`` and ``LLM``'s docstring; ``{field}`` names
            another option (its flag in ``--help``).
        check: ``check(args, name, value)`` raises ValueError for a bad value.
        group: the ``--help`` group.
        flag: the command-line flag (default ``--`` + the name with dashes); for a switch, the
            flag that sets True.
        negative: a switch's flag that sets False (default ``--no-`` + ``flag``'s stem).
        default_text: the default in words (default: the value; "on"/"off"), ``{field}`` as
            in ``help``.
        changes_outputs: a different value can give different tokens (``jaxinfer.cli.partial``
            keeps partial outputs only across runs with the same values).
        metavar: the value's name in ``--help``.
    """

    help: str
    check: object
    group: str = "engine"
    flag: str | None = None
    negative: str | None = None
    default_text: str | None = None
    changes_outputs: bool = False
    metavar: str | None = None


def option(default, help: str, check, **kw):
    """An ``EngineArgs`` field: ``default`` and its ``Option`` (``help``, ``check``, ``kw``)."""
    return dataclasses.field(default=default, metadata={"option": Option(help, check, **kw)})


MODEL, ENGINE, TUNING, PARALLEL, SPEC = (
    "model",
    "engine",
    "engine tuning (same outputs; defaults chosen per backend)",
    "parallelism",
    "speculative decoding",
)


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """Every engine and model-loading option (module docstring). Fields are ``LLM``'s arguments;
    ``origin`` ("python" or "cli") says how errors name them.

    Raises:
        ValueError: at construction, a value of the wrong type or out of range, or options that
            do not go together (``draft_model`` without ``speculative="draft-model"``, ...); the
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
        2.0, "memory budget of the default KV pool, GiB per device", Gib()
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
        0, "engine seed: draws the seeds of requests that have none", Int(0, high=SEED_MAX)
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
            _add_flag(target, f, opt)

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
        """The chat template's text (``chat_template``'s file read), or None. Raises
        ValueError as the check does."""
        if self.chat_template is None:
            return None
        return read_chat_template(self, "chat_template", self.chat_template)


# ------------------------------------------------------------------------- from the fields


def option_fields() -> list[dataclasses.Field]:
    """The option fields of ``EngineArgs`` in order (``origin`` is not one)."""
    return [f for f in dataclasses.fields(EngineArgs) if "option" in f.metadata]


def option_of(field: str) -> Option:
    """The ``Option`` of field ``field``. Raises KeyError for a name that is not an option."""
    return _FIELDS[field].metadata["option"]


def flag_of(field: str) -> str:
    """The command-line flag of option ``field``: ``max_model_len`` -> ``--max-model-len``."""
    return option_of(field).flag or "--" + field.replace("_", "-")


def negative_of(field: str) -> str:
    """The flag that sets switch ``field`` False: ``--no-batch-invariant``."""
    return option_of(field).negative or "--no-" + flag_of(field).removeprefix("--")


class _SwitchAction(argparse.Action):
    """A switch with a flag for True and one for False (argparse's BooleanOptionalAction with
    a negative flag of our choosing)."""

    def __init__(self, option_strings, dest, negative, **kw):
        super().__init__([*option_strings, negative], dest, nargs=0, **kw)
        self.negative = negative

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string != self.negative)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


class _Names(dict):
    """``{field}`` in help texts: the option's flag for ``--help``, its name for docstrings."""

    def __init__(self, cli: bool):
        super().__init__()
        self.cli = cli

    def __missing__(self, field: str) -> str:
        return flag_of(field) if self.cli else field


def _render(text: str, cli: bool) -> str:
    return text.format_map(_Names(cli))


def _default_text(f: dataclasses.Field, opt: Option, cli: bool) -> str | None:
    if opt.default_text is not None:
        return _render(opt.default_text, cli)
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    return None if f.default in (None, dataclasses.MISSING) else str(f.default)


def _add_flag(target, f: dataclasses.Field, opt: Option) -> None:
    help = _render(opt.help, cli=True)
    default = _default_text(f, opt, cli=True)
    if default is not None:
        help += f" (default: {default})"
    help = help.replace("%", "%%")
    check = opt.check
    kw = dict(dest=f.name, help=help)
    if f.default is dataclasses.MISSING:
        kw["required"] = True
    else:
        kw["default"] = f.default
    if isinstance(check, Switch):
        target.add_argument(
            flag_of(f.name), action=_SwitchAction, negative=negative_of(f.name), **kw
        )
        return
    choices = getattr(check, "cli", None) or getattr(check, "values", None)
    if choices is not None:
        kw["choices"] = choices
    target.add_argument(
        flag_of(f.name), type=check.cli_type, metavar=opt.metavar or check.metavar, **kw
    )


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
        default = _default_text(f, opt, cli=False)
        text = (
            f"{f.name}: {_render(opt.help, cli=False)}"
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
