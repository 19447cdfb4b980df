"""The pieces of ``jaxinfer.args.EngineArgs``' options: ``Option`` (a field's metadata), the
checks (one kind per class) and a field's command-line flag (``add_flag``).

A check is called as ``check(args, name, value)`` with the ``EngineArgs`` being made, the field's
name and its value, and raises ValueError naming the setting as the user wrote it
(``args.name(name)`` / ``args.spell(name)``: the flag from the command line, the argument from
Python). ``cli_type``, ``cli`` (choices) and ``metavar`` tell ``EngineArgs.add_cli_args`` how to
parse the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import os
from collections.abc import Callable
from pathlib import Path

from jaxinfer.loaders import WEIGHT_DTYPES
from jaxinfer.models.checks import INT32_MAX


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

    def __call__(self, args, name: str, v) -> None:
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

    def __call__(self, args, name: str, v) -> None:
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

    def __call__(self, args, name: str, v) -> None:
        if not (isinstance(v, bool) or (self.optional and v is None)):
            allowed = "True, False or None" if self.optional else "True or False"
            raise ValueError(f"{args.name(name)} must be {allowed}, got {v!r}")


@dataclasses.dataclass(frozen=True)
class PathArg:
    """A non-empty path, str or os.PathLike (None too when ``optional``)."""

    optional: bool = False
    metavar = "PATH"
    cli_type = str

    def __call__(self, args, name: str, v) -> None:
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

    def __call__(self, args, name: str, v) -> None:
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

    def __call__(self, args, name: str, v) -> None:
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

    def __call__(self, args, name: str, v) -> None:
        PathArg(optional=True)(args, name, v)
        if v is not None:
            check_chat_template(args, name, v)


def is_template_text(v) -> bool:
    """Whether a ``chat_template`` value is the template itself rather than a file name."""
    return isinstance(v, str) and ("{" in v or "\n" in v)


def chat_template_text(v) -> str:
    """The template of ``chat_template`` value ``v``: ``v`` itself (``is_template_text``) or the
    file's contents. Raises OSError or UnicodeDecodeError for a file that cannot be read."""
    return v if is_template_text(v) else Path(v).read_text(encoding="utf-8")


def check_chat_template(args, name: str, v) -> None:
    """Checks ``chat_template`` value ``v``: the file reads and the template compiles.

    Raises:
        ValueError: the file does not exist or cannot be read, or the template does not compile;
            the message names the file (or says it is the text given).
    """
    from jinja2 import TemplateSyntaxError

    from jaxinfer.tokenizers.chat_template import compile_chat_template

    if is_template_text(v):
        where = f"{args.name(name)} (the template text given)"
    else:
        where = args.spell(name, os.fspath(v))
    try:
        text = chat_template_text(v)
    except FileNotFoundError:
        raise ValueError(
            f"{where}: no such file (a chat template is a Jinja file, or the template text itself)"
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

    def flag_of(self, name: str) -> str:
        """The flag of this option, field ``name``: ``max_model_len`` -> ``--max-model-len``."""
        return self.flag or "--" + name.replace("_", "-")

    def negative_of(self, name: str) -> str:
        """The flag that sets this switch False: ``--no-`` + the flag's stem by default."""
        return self.negative or "--no-" + self.flag_of(name).removeprefix("--")


def option(default, help: str, check, **kw):
    """An ``EngineArgs`` field: ``default`` and its ``Option`` (``help``, ``check``, ``kw``)."""
    return dataclasses.field(default=default, metadata={"option": Option(help, check, **kw)})


Names = Callable[[str], str]
"""How help texts name another option (``{field}``): by its flag, or by its field name."""


class _Names(dict):
    def __init__(self, names: Names):
        super().__init__()
        self.names = names

    def __missing__(self, field: str) -> str:
        return self.names(field)


def render(text: str, names: Names) -> str:
    """``text`` with each ``{field}`` named by ``names``."""
    return text.format_map(_Names(names))


def default_text(f: dataclasses.Field, names: Names) -> str | None:
    """Field ``f``'s default in words (its ``Option.default_text``, "on"/"off", or the value),
    None when there is nothing to say."""
    opt = f.metadata["option"]
    if opt.default_text is not None:
        return render(opt.default_text, names)
    if isinstance(f.default, bool):
        return "on" if f.default else "off"
    return None if f.default in (None, dataclasses.MISSING) else str(f.default)


class SwitchAction(argparse.Action):
    """A switch with a flag for True and one for False (argparse's BooleanOptionalAction with
    a negative flag of our choosing)."""

    def __init__(self, option_strings, dest, negative, **kw):
        super().__init__([*option_strings, negative], dest, nargs=0, **kw)
        self.negative = negative

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, option_string != self.negative)

    def format_usage(self) -> str:
        return " | ".join(self.option_strings)


def add_flag(target, f: dataclasses.Field, flags: Names) -> None:
    """Adds option field ``f``'s flag to ``target`` (a parser or argument group): its help with
    other options named by ``flags`` and the default stated, its type, choices and default (a
    switch: its flag and negative flag, ``SwitchAction``)."""
    opt = f.metadata["option"]
    help = render(opt.help, flags)
    default = default_text(f, flags)
    if default is not None:
        help += f" (default: {default})"
    kw = dict(dest=f.name, help=help.replace("%", "%%"))
    if f.default is dataclasses.MISSING:
        kw["required"] = True
    else:
        kw["default"] = f.default
    check, flag = opt.check, opt.flag_of(f.name)
    if isinstance(check, Switch):
        target.add_argument(flag, action=SwitchAction, negative=opt.negative_of(f.name), **kw)
        return
    choices = getattr(check, "cli", None) or getattr(check, "values", None)
    if choices is not None:
        kw["choices"] = choices
    target.add_argument(flag, type=check.cli_type, metavar=opt.metavar or check.metavar, **kw)
