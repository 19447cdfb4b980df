"""An ``LLM`` from the command line's model and engine flags (``jaxinfer generate`` and
``jaxinfer serve`` share them: ``EngineArgs.add_cli_args``)."""

from __future__ import annotations

import argparse

from jaxinfer.args import EngineArgs
from jaxinfer.cli.prompts_file import UsageError
from jaxinfer.errors import JaxinferError, KernelBuildError


def engine_args(args: argparse.Namespace, **overrides) -> EngineArgs:
    """The ``EngineArgs`` of a parsed command line (``overrides`` on top). Raises UsageError
    naming the flag of a bad value or combination."""
    try:
        return EngineArgs.from_cli_args(args, **overrides)
    except ValueError as e:
        raise UsageError(f"invalid engine setting: {e}") from None


def load_llm(args: EngineArgs | argparse.Namespace):
    """Loads the model of ``args`` (``engine_args``' result, or the parsed command line).
    Raises UsageError with a message for the user (an invalid engine setting, named by its flag,
    or a model that cannot load)."""
    from jaxinfer.llm import LLM

    if not isinstance(args, EngineArgs):
        args = engine_args(args)
    try:
        return LLM.from_engine_args(args)
    except KernelBuildError as e:  # --attn-impl cpu_kernel asked for a kernel that cannot build
        raise UsageError(f"{args.spell('attn_impl')}: {e}") from None
    except (JaxinferError, OSError) as e:
        msg = str(e)
        raise UsageError(
            msg if msg.startswith("draft model") else f"cannot load model {args.model}: {msg}"
        ) from None
    except ValueError as e:  # an engine setting (sizes, pool, attention implementation)
        raise UsageError(f"invalid engine setting: {e}") from None
