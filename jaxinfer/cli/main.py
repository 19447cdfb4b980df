"""The command line: ``jaxinfer generate`` runs a file of prompts through a model into a JSONL file.

    jaxinfer generate --model ../shared/models/stories260K --prompts examples/prompts.jsonl \\
        --out out.jsonl --temperature 0

Input: JSONL records ``{"id": ..., "prompt" | "messages" | "prompt_token_ids": ..., <sampling
fields>}`` or plain text, one prompt per line. Output: one JSONL record per prompt
(``RequestOutput.to_record()`` or an error record), written and flushed as each prompt finishes.
A rerun with the same ``--out`` skips the ids already there (resume after a crash or Ctrl-C)
and continues the requests that were in flight from ``<out>.partial.json`` (`jaxinfer.cli.partial`).
stdout carries one JSON summary object; progress, messages and errors go to stderr.

Reading the prompts file (`jaxinfer.cli.prompts_file`: every bad line is one error record, ids) and
the
output file (`jaxinfer.cli.output_file`: one locked writer, regular files only) live in their own
modules,
as does the run once the output file is open (`jaxinfer.cli.generate`: generate, summary).
Exit status: 0 done, 1 the output file could not be written (the summary has an "error"),
2 usage error, 130/143 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

from jaxinfer.args import SERVE_ONLY, EngineArgs
from jaxinfer.cli.generate import EXIT_INTERRUPTED, EXIT_WRITE_FAILED, Terminated, run_jobs
from jaxinfer.cli.generate import check_terminated as _check_terminated  # noqa: F401 - tests
from jaxinfer.cli.generate import error_record as _error_record  # noqa: F401 - tests
from jaxinfer.cli.generate import interrupt_status as _interrupt_status
from jaxinfer.cli.generate import sigterm_as_interrupt as _sigterm_as_interrupt
from jaxinfer.cli.interrupts import interrupts_not_swallowed
from jaxinfer.cli.llm_from_args import engine_args
from jaxinfer.cli.llm_from_args import load_llm as _load_llm
from jaxinfer.cli.output_file import Done, OutputFile
from jaxinfer.cli.partial import Checkpointer, partial_path, run_settings
from jaxinfer.cli.prompts_file import (
    DUPLICATE_PREFIX,
    PROMPT_KEYS,
    Job,
    UsageError,
    plan,
    read_jobs,
)
from jaxinfer.errors import JaxinferError, RequestError
from jaxinfer.sampling.params import SamplingParams

EXIT_USAGE = 2
__all__ = [
    "DUPLICATE_PREFIX",
    "EXIT_INTERRUPTED",
    "EXIT_WRITE_FAILED",
    "PROMPT_KEYS",
    "Done",
    "Job",
    "Terminated",
    "UsageError",
    "main",
    "plan",
    "read_jobs",
]


# ------------------------------------------------------------------------- arguments


def _sampling_defaults() -> dict:
    return {f.name: f.default for f in dataclasses.fields(SamplingParams)}


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` with each flag's default where it says something: " (default: X)" is added
    unless the help states the default itself, or it is None or a switch's (whose help says
    what it means)."""

    def _get_help_string(self, action):
        text, default = action.help or "", action.default
        if (
            "(default" in text
            or default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
            or not action.option_strings
        ):
            return text
        return text + " (default: %(default)s)"

    def _split_lines(self, text, width):  # never break a flag at its dashes
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    from jaxinfer.version import package_version

    fmt = HelpFormatter
    parser = argparse.ArgumentParser(
        prog="jaxinfer", description="jaxinfer: LLM inference in JAX.", formatter_class=fmt
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    g = sub.add_parser(
        "generate",
        formatter_class=fmt,
        usage="%(prog)s --model PATH --prompts FILE --out FILE [options]",
        help="generate completions for a file of prompts into a JSONL file",
        description=(
            "Generate a completion for every prompt in --prompts and write one JSONL record per "
            "prompt to --out as it finishes. Rerunning with the same --out resumes: ids already "
            "in the file (results and error records alike) are skipped."
        ),
    )
    io = g.add_argument_group("input and output")
    io.add_argument(
        "--prompts",
        required=True,
        metavar="FILE",
        help=(
            "prompts file: JSONL ({'id', 'prompt'|'messages'|'prompt_token_ids', sampling "
            "fields}; read as JSONL when it ends in .jsonl or every non-blank line starts with "
            "'{' and one at least is a JSON object) or plain UTF-8 text, one prompt per line; "
            "lines end at \\n only. Ids default to the 0-based line number; a bad line gets an "
            "error record (id line-N when its own id cannot be read)."
        ),
    )
    io.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="output JSONL file (a regular file); appended to, ids already present are "
        "skipped; locked while a run writes it, so a second run on it is refused",
    )
    io.add_argument(
        "--checkpoint-interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="rewrite the partial-state file <out>.partial.json (the tokens of requests in "
        "flight) this often, and on SIGTERM/Ctrl-C, so a rerun continues them; 0 = only on "
        "SIGTERM/Ctrl-C. Removed when the job completes",
    )
    EngineArgs.add_cli_args(g, exclude=SERVE_ONLY)

    d = _sampling_defaults()
    s = g.add_argument_group(
        "sampling defaults (SamplingParams fields; a JSONL record's own fields override them)"
    )
    s.add_argument(
        "--temperature",
        type=float,
        default=d["temperature"],
        help="sampling temperature (1.0 as vLLM); --temperature 0 for greedy",
    )
    s.add_argument("--top-p", type=float, default=d["top_p"], help="nucleus mass; 1 = off")
    s.add_argument("--top-k", type=int, default=d["top_k"], help="top-k; 0 or -1 = off")
    s.add_argument("--min-p", type=float, default=d["min_p"], help="min-p; 0 = off")
    s.add_argument(
        "--repetition-penalty",
        type=float,
        default=d["repetition_penalty"],
        help="repetition penalty; 1 = off",
    )
    s.add_argument(
        "--presence-penalty",
        type=float,
        default=d["presence_penalty"],
        help="presence penalty in [-2, 2]",
    )
    s.add_argument(
        "--frequency-penalty",
        type=float,
        default=d["frequency_penalty"],
        help="frequency penalty in [-2, 2]",
    )
    s.add_argument(
        "--max-tokens", type=int, default=d["max_tokens"], help="most tokens generated per prompt"
    )
    s.add_argument(
        "--min-tokens",
        type=int,
        default=d["min_tokens"],
        help="EOS and stop token ids cannot end a prompt before this many tokens",
    )
    s.add_argument(
        "--stop",
        action="append",
        default=None,
        help="stop string (repeatable); the text is cut before it",
    )
    s.add_argument(
        "--stop-token-ids",
        type=int,
        nargs="+",
        action="extend",
        default=None,
        metavar="ID",
        help="token ids that end generation (repeatable)",
    )
    s.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    s.add_argument(
        "--logprobs",
        type=int,
        default=d["logprobs"],
        metavar="N",
        help="number of top logprobs returned per generated token (0..20, vLLM's logprobs): "
        "the N most likely tokens' logprobs plus the sampled token's; 0 = the sampled token's "
        "only (default: none)",
    )
    s.add_argument(
        "--n",
        type=int,
        default=d["n"],
        help="completions per prompt (1..128; vLLM's n: completion i samples with "
        "seed + i when a seed is set); records with n > 1 hold them in 'outputs'",
    )
    s.add_argument(
        "--prompt-logprobs",
        type=int,
        default=d["prompt_logprobs"],
        metavar="K",
        help="also return each prompt token's logprob and the top K (0..20) of its "
        "position ('prompt_logprobs' in the record: null, then one per prompt token)",
    )
    s.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE",
        help="a JSON schema file every output must match (structured_outputs.json: the "
        "output is one JSON value valid against it, constrained while it is generated); a "
        "record's own structured_outputs or response_format replaces it",
    )
    s.add_argument(
        "--disable-any-whitespace",
        action="store_true",
        help="--json-schema's JSON without whitespace between its tokens "
        "(structured_outputs.disable_any_whitespace; whitespace inside strings stays): a model "
        "that knows no JSON otherwise may pad with whitespace until --max-tokens; a record's "
        "own constraint sets its own",
    )
    s.add_argument(
        "--sampling-seed",
        type=int,
        default=d["seed"],
        metavar="SEED",
        help="sampling seed (SamplingParams.seed, reduced modulo 2**32) of every prompt without "
        "its own 'seed'; without it, each such prompt gets a seed drawn from the engine's RNG, "
        "which --seed seeds (default: drawn)",
    )

    o = g.add_argument_group("display")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    o.add_argument(
        "--quiet",
        action="store_true",
        help="no progress bar and no messages on stderr except errors",
    )
    from jaxinfer.speculative.train_heads import add_parser as add_train_draft_heads

    add_train_draft_heads(sub, fmt)
    from jaxinfer.quant.command import add_quantize_parser

    add_quantize_parser(sub)
    from jaxinfer.server.command import add_serve_parser

    add_serve_parser(sub, fmt)
    return parser


def read_json_schema(path: str) -> str:
    """The text of ``--json-schema FILE`` (raises UsageError when it cannot be read or is not a
    JSON object or boolean; whether the grammar library accepts it is checked per request)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--json-schema: cannot read {path}: {e}") from None
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise UsageError(f"--json-schema: {path} is not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise UsageError(f"--json-schema: {path} holds a {type(schema).__name__}, not a schema")
    return text


def sampling_defaults_from_args(args: argparse.Namespace) -> dict:
    """The command line's sampling defaults as a SamplingParams dict (raises UsageError)."""
    d = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "max_tokens": args.max_tokens,
        "min_tokens": args.min_tokens,
        "stop": list(args.stop or []),
        "stop_token_ids": list(args.stop_token_ids or []),
        "ignore_eos": args.ignore_eos,
        "logprobs": args.logprobs,
        "seed": args.sampling_seed,
        "n": args.n,
        "prompt_logprobs": args.prompt_logprobs,
    }
    if args.json_schema is not None:
        d["structured_outputs"] = {"json": read_json_schema(args.json_schema)}
        if args.disable_any_whitespace:
            d["structured_outputs"]["disable_any_whitespace"] = True
    elif args.disable_any_whitespace:
        raise UsageError(
            "--disable-any-whitespace applies to --json-schema's constraint: give --json-schema "
            "FILE too (a record's own constraint sets structured_outputs.disable_any_whitespace)"
        )
    try:
        SamplingParams.from_dict(d)
    except RequestError as e:
        raise UsageError(f"invalid sampling flags: {e}") from None
    return d


# ------------------------------------------------------------------------- the run


def cmd_generate(args: argparse.Namespace) -> int:
    quiet = args.quiet

    def say(msg: str) -> None:
        if not quiet:
            print(f"jaxinfer: {msg}", file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    defaults = sampling_defaults_from_args(args)
    if not (args.checkpoint_interval >= 0 and args.checkpoint_interval != float("inf")):
        raise UsageError(
            f"--checkpoint-interval must be a number of seconds >= 0, got "
            f"{args.checkpoint_interval}"
        )
    for flag in ("prompts", "out"):  # "" would be Path("."): the current directory
        if not str(getattr(args, flag)).strip():
            raise UsageError(f"--{flag} is empty: give the path of a file")
        setattr(args, flag, Path(getattr(args, flag)))
    if not args.prompts.is_file():
        raise UsageError(f"prompts file {args.prompts} does not exist or is not a file")
    if not Path(args.model).exists():
        raise UsageError(f"model {args.model} does not exist")
    if args.tokenizer is not None and not Path(args.tokenizer).is_file():
        raise UsageError(f"tokenizer {args.tokenizer} does not exist or is not a file")
    eargs = engine_args(args)  # every engine flag checked before the output file opens
    out_path: Path = args.out
    jobs, _ = read_jobs(args.prompts, defaults)
    if not jobs:
        say(f"warning: {args.prompts} holds no prompts")

    from jaxinfer.models.sharding import initialize_multihost, is_output_host

    multihost = initialize_multihost(eargs.multihost)
    if multihost and not is_output_host():
        out = OutputFile.reader(out_path)  # every host computes; process 0 writes
    else:
        out = OutputFile.open(out_path, args.prompts)  # locked, before the model loads
    # Partial states are off across hosts: every host must resume from the same state, and
    # process 0 rewrites the file while the others may still be reading it.
    ckpt = Checkpointer(
        partial_path(out_path),
        run_settings(args),
        args.checkpoint_interval,
        say,
        enabled=not multihost,
    )
    try:
        return run_jobs(args, jobs, out, say, t_start, ckpt, lambda _: _load_llm(eargs))
    except BaseException:
        out.close(discard=out.written == 0)  # a failed command leaves no empty file behind
        raise
    finally:
        out.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``jaxinfer`` console script; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2), already printed by argparse
        return int(e.code or 0)
    try:
        with interrupts_not_swallowed():  # a Ctrl-C lost in jax's gc callback comes back
            return _run_command(parser, args)
    except UsageError as e:
        print(f"jaxinfer: error: {e}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt as e:  # before any output was opened (loading, compiling)
        print("jaxinfer: interrupted before writing anything", file=sys.stderr, flush=True)
        return _interrupt_status(e)


def _run_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "generate":
        with _sigterm_as_interrupt():
            return cmd_generate(args)
    if args.command == "train-draft-heads":
        from jaxinfer.speculative.train_heads import cmd_train_draft_heads

        return cmd_train_draft_heads(args)
    if args.command == "serve":
        from jaxinfer.server.command import cmd_serve

        return cmd_serve(args)
    if args.command == "quantize":
        from jaxinfer.quant.command import cmd_quantize

        try:
            return cmd_quantize(args)
        except (JaxinferError, OSError, ValueError) as e:
            raise UsageError(f"cannot quantize {args.model}: {e}") from None
    parser.error(f"unknown command {args.command!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
