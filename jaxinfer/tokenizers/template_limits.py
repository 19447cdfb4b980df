"""Budget and size checks for chat-template rendering (``chat_template.py`` uses them).

One ``Budget`` per render, in the context variable ``BUDGET``; the sandbox's hooks call
``current_budget()`` and these checks. Each check raises ``LimitExceeded`` naming the limit.
"""

from __future__ import annotations

import collections
import contextvars
import functools
import inspect
import re
import string
import time
import types

import jinja2
from jinja2.sandbox import MAX_RANGE
from jinja2.utils import Namespace, generate_lorem_ipsum

MAX_RENDER_SECONDS = 2.0  # wall time of one render; real templates take a tiny part of it
MAX_TEMPLATE_CHARS = 1 << 20  # 1 Mi characters, plus INPUT_CHARS_FACTOR x the messages' text
INPUT_CHARS_FACTOR = 4
MAX_CALL_DEPTH = 64  # nested calls; recursive tool-schema macros nest about as deep as the JSON
MAX_INT_BITS = 1 << 16  # 65,536 bits (19,729 digits), past Python's 4,300-digit str() limit

SEQUENCES = (str, bytes, list, tuple)
CONTAINERS = (list, tuple, dict, set, frozenset, Namespace)
NESTED = (list, tuple, dict, set, frozenset)


class LimitExceeded(Exception):
    """Raised inside a render that went past a limit; becomes a ChatTemplateError."""


class Budget:
    """What one render may still use; lives in ``BUDGET`` while the render runs."""

    def __init__(self, max_seconds: float, max_chars: int):
        self.seconds = max_seconds
        self.deadline = time.monotonic() + max_seconds
        self.max_chars = max_chars
        self.depth = 0
        self.produced = 0  # characters of every {{ expression }} output so far
        self.known: dict[int, int] = {}  # id -> count() of the inputs' containers
        self.memo: collections.OrderedDict[int, tuple] = collections.OrderedDict()

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise LimitExceeded(
                f"rendering took longer than {self.seconds:g} s (MAX_RENDER_SECONDS)"
            )

    def size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise LimitExceeded(
                f"{what} would have {n:,} characters or items, over the limit of "
                f"{self.max_chars:,} (MAX_TEMPLATE_CHARS + INPUT_CHARS_FACTOR x the messages)"
            )


BUDGET: contextvars.ContextVar[Budget | None] = contextvars.ContextVar("chat_budget", default=None)


def current_budget() -> Budget:
    """The running render's budget. Raises RuntimeError outside ``render_chat_template``."""
    b = BUDGET.get()
    if b is None:
        raise RuntimeError("chat templates must be rendered through render_chat_template")
    return b


def text_size(obj, limit: int, budget: Budget | None = None, indent: int = 0) -> int:
    """An upper estimate of ``len(str(obj))`` (or of ``json.dumps(obj, indent=indent)``),
    walking nested containers; stops as soon as it passes ``limit`` (so the walk is bounded even
    for a list that holds itself, or one list shared 2**40 times)."""
    total, stack, visits = 0, [(obj, 0)], 0
    while stack:
        x, depth = stack.pop()
        visits += 1
        if budget is not None and visits % 4096 == 0:
            budget.tick()
        if isinstance(x, str | bytes):
            total += len(x) + 2
        elif isinstance(x, bool) or x is None:
            total += 5
        elif isinstance(x, int):
            total += x.bit_length() // 3 + 2
        elif isinstance(x, float):
            total += 24
        elif isinstance(x, CONTAINERS):
            if isinstance(x, Namespace):
                x = object.__getattribute__(x, "_Namespace__attrs")
                total += 12
            items = x.items() if isinstance(x, dict) else ((i,) for i in x)
            per_item = 4 + (indent * (depth + 1) + 1 if indent else 0)
            total += 2
            for pair in items:
                total += per_item
                stack.extend((y, depth + 1) for y in pair)
                if total > limit:
                    return total
        else:
            total += 32  # Undefined, macros, loop objects: short reprs
        if total > limit:
            return total
    return total


def check_text(value, b: Budget, what: str) -> None:
    """Before ``value`` becomes text: its estimated text size is within the limit."""
    if isinstance(value, str):
        b.size(len(value), what)
    elif isinstance(value, CONTAINERS):
        b.size(text_size(value, b.max_chars, b), what)


def _children(x):
    return [y for pair in x.items() for y in pair] if isinstance(x, dict) else x


_MEMO_SIZE = 16  # recent containers whose counts are kept (with the containers, so ids stay valid)


def count(root, b: Budget, inputs: bool = False) -> int:
    """Items in ``root`` counting a shared sub-list once per place it appears: what comparing,
    hashing or printing it costs (a list nested 40 deep, each level holding the one below twice,
    has 2**40). Walks each distinct container once, not again for the render's inputs
    (``inputs=True`` records them; the sandbox keeps them unchanged) or the last
    ``_MEMO_SIZE`` containers counted."""
    if not isinstance(root, NESTED):
        return 1
    known, memo = b.known, b.memo

    def counted(x):
        n = known.get(id(x))
        if n is None and id(x) in memo:
            memo.move_to_end(id(x))
            n = memo[id(x)][1]
        return n

    n = counted(root)
    if n is not None:
        return n
    counts: dict[int, int] = {}
    limit = float("inf") if inputs else b.max_chars
    stack, visits = [(root, False)], 0
    while stack:
        x, children_done = stack.pop()
        if id(x) in counts or counted(x) is not None:
            continue
        visits += 1
        if visits % 4096 == 0:
            b.tick()
        if not children_done:
            if ~id(x) in counts:  # on the path from the root: a cycle
                raise LimitExceeded("a value contains itself")
            counts[~id(x)] = 0
            stack.append((x, True))
            stack.extend((y, False) for y in _children(x) if isinstance(y, NESTED))
            continue
        del counts[~id(x)]
        n = 1
        for y in _children(x):
            n += (counts.get(id(y)) or counted(y) or 1) if isinstance(y, NESTED) else 1
        if n > limit:
            check_count(n, b)
        counts[id(x)] = n
    if inputs:
        known.update(counts)
    else:
        remember(b, root, counts[id(root)])
    return counts[id(root)]


def check_count(n: int, b: Budget) -> int:
    if n > b.max_chars:
        raise LimitExceeded(
            f"a value would hold {n:,} items counting repeats, over the limit "
            f"of {b.max_chars:,} (MAX_TEMPLATE_CHARS + INPUT_CHARS_FACTOR x the "
            "messages)"
        )
    return n


def remember(b: Budget, value, n: int) -> None:
    b.memo[id(value)] = (value, n)
    b.memo.move_to_end(id(value))
    if len(b.memo) > _MEMO_SIZE:
        b.memo.popitem(last=False)


def check_result(value, b: Budget, what: str):
    """After an operation: a string, bytes or container result is within the limit."""
    if isinstance(value, str | bytes | list | tuple | dict | set | frozenset):
        b.size(len(value), what)
        if isinstance(value, NESTED):
            count(value, b)
    elif isinstance(value, types.GeneratorType):  # map, select, batch...: items checked lazily
        return bounded_iter(value)
    elif isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise _int_limit(what)
    return value


def bounded_iter(iterable):
    """Yields the items of ``iterable``, checking the deadline before each one."""
    b = current_budget()
    for item in iterable:
        b.tick()
        if isinstance(item, NESTED):  # a list made by batch, slice, groupby...
            count(item, b)
        yield item


def _materialize(iterable, b: Budget) -> list | tuple:
    if isinstance(iterable, list | tuple):
        return iterable
    out = []
    for item in iterable:
        b.tick()
        out.append(item)
        b.size(len(out), "a sequence")
    return out


def _int_limit(what: str):
    return LimitExceeded(f"{what} would give an integer over {MAX_INT_BITS} bits (MAX_INT_BITS)")


def check_binop(operator: str, left, right, b: Budget) -> int | None:
    """Before ``left <operator> right`` (``*``, ``+``, ``**``, ``%``); returns the result's
    ``count`` when it is a list or tuple made of the operands."""
    what = f"a {operator} operation"
    if operator == "*":
        seq, n = (right, left) if isinstance(right, SEQUENCES) else (left, right)
        if isinstance(seq, SEQUENCES) and isinstance(n, int):
            b.size(len(seq) * n, what)
            if isinstance(seq, list | tuple):
                return check_count((count(seq, b) - 1) * max(n, 0) + 1, b)
        elif isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise _int_limit(what)
    elif operator == "+":
        if isinstance(left, SEQUENCES) and isinstance(right, SEQUENCES):
            b.size(len(left) + len(right), what)
            if isinstance(left, list | tuple) and isinstance(right, list | tuple):
                return check_count(count(left, b) + count(right, b) - 1, b)
    elif operator == "**":
        if (
            isinstance(left, int)
            and isinstance(right, int)
            and right > 0
            and abs(left) > 1
            and right * left.bit_length() > MAX_INT_BITS
        ):
            raise _int_limit(what)
    elif operator == "%":
        check_printf(left, right, b)
    return None


# ------------------------------------------------------------------ formatting (%, str.format)

_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?")


def _check_format_sizes(
    fmt: str, n_fields: int, widths: list[str], args, b: Budget, what: str
) -> None:
    """Result of formatting: at most ``len(fmt)`` + each field at its widest argument or width."""
    star = any(w == "*" or "{" in w for w in widths)
    for w in widths:
        for digits in re.findall(r"\d+", w):
            b.size(int(digits) if len(digits) < 12 else 1 << 62, f"a width in {what}")
    values = list(args.values()) if isinstance(args, dict) else list(args)
    widest = 0
    for v in values:
        if star and isinstance(v, int) and not isinstance(v, bool):
            b.size(abs(v), f"a width in {what}")
        widest = max(widest, text_size(v, b.max_chars, b))
        b.size(widest, what)
    longest_width = max((int(d) for w in widths for d in re.findall(r"\d+", w)), default=0)
    b.size(len(fmt) + n_fields * (widest + longest_width), what)


def check_printf(fmt, args, b: Budget) -> None:
    """Before ``fmt % args``."""
    if not isinstance(fmt, str):
        return
    specs = _PRINTF_SPEC.findall(fmt)
    widths = [w for spec in specs for w in spec if w]
    args = args if isinstance(args, tuple | dict) else (args,)
    _check_format_sizes(fmt, len(specs), widths, args, b, "a % formatting")


def _check_str_format(fmt: str, args, kwargs, b: Budget) -> None:
    """Before ``fmt.format(*args, **kwargs)``; nested ``{}`` widths are checked in the args."""
    fields = [f for f in string.Formatter().parse(fmt) if f[1] is not None]
    values = list(args) + list(kwargs.values())
    for v in kwargs.values():
        if isinstance(v, dict):  # format_map's mapping
            values += list(v.values())
    _check_format_sizes(
        fmt, len(fields), [f[2] or "" for f in fields], tuple(values), b, "a str.format"
    )


# ------------------------------------------------------------------ calls and filters

_WIDTH_METHODS = {"ljust", "rjust", "center", "zfill"}


def _replace_size(s, old, new, count) -> int:
    if not (isinstance(s, str | bytes) and type(old) is type(s) and type(new) is type(s)):
        return 0
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(len(new) - len(old), 0)


def check_call(obj, args: tuple, kwargs: dict, b: Budget) -> tuple:
    """Size checks before a call that can grow a string in one step; returns the args to use."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if isinstance(owner, str | bytes) and isinstance(obj, types.BuiltinMethodType):
        what = f"str.{name}"
        if name in _WIDTH_METHODS:
            width = args[0] if args else kwargs.get("width", 0)
            if isinstance(width, int):
                b.size(width, what)
        elif name == "expandtabs":
            tab = args[0] if args else kwargs.get("tabsize", 8)
            if isinstance(tab, int):
                b.size(
                    len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") * tab, what
                )
        elif name == "replace" and len(args) >= 2:
            b.size(
                _replace_size(
                    owner, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count", -1)
                ),
                what,
            )
        elif name == "join" and args:
            items = _materialize(args[0], b)
            b.size(
                sum(len(x) if isinstance(x, str | bytes) else 0 for x in items)
                + len(owner) * len(items),
                what,
            )
            args = (items, *args[1:])
    wrapped = getattr(obj, "__wrapped__", None)  # the sandbox's str.format / format_map
    if isinstance(getattr(wrapped, "__self__", None), str) and name in ("format", "format_map"):
        _check_str_format(wrapped.__self__, args, kwargs, b)
    if obj is generate_lorem_ipsum:
        bound = inspect.signature(obj).bind(*args, **kwargs).arguments
        b.size(int(bound.get("n", 5)) * int(bound.get("max", 100)) * 16, "lipsum")
    return args


MAX_WORDWRAP_CHARS = 100_000
"""Longest text the wordwrap filter takes (a fraction of MAX_RENDER_SECONDS at width 1,
docs/performance.md; textwrap's time grows quadratically within one call, where the deadline
cannot interrupt it)."""


def _filter_checks(name: str, bound: dict, env, b: Budget) -> None:
    """Size checks before filter ``name`` (arguments by parameter name)."""
    what = f"the {name} filter"
    if name == "center":
        width = bound.get("width", 80)
        if isinstance(width, int):
            b.size(width, what)
    elif name == "indent":
        s, width = str(bound.get("s", "")), bound.get("width", 4)
        pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        b.size(len(s) + pad * (s.count("\n") + 1), what)
    elif name == "wordwrap":
        s, wrap = bound.get("s", ""), bound.get("wrapstring") or env.newline_sequence
        if isinstance(s, str) and isinstance(wrap, str):
            b.size(len(s) * max(len(wrap), 1), what)  # at most one break per character
            if len(s) > MAX_WORDWRAP_CHARS:  # textwrap is quadratic in one call: no deadline
                raise LimitExceeded(
                    f"{what} on {len(s):,} characters is over "
                    f"{MAX_WORDWRAP_CHARS:,} (its time grows quadratically)"
                )
    elif name == "replace":
        s = bound.get("s")
        b.size(
            _replace_size(
                s if isinstance(s, str) else str(s),
                str(bound.get("old", "")),
                str(bound.get("new", "")),
                bound.get("count"),
            ),
            what,
        )
    elif name in ("batch", "slice"):
        n = bound.get("linecount", bound.get("slices"))
        if isinstance(n, int) and n > MAX_RANGE:
            raise LimitExceeded(f"{what} with {n:,} parts is over jinja's MAX_RANGE ({MAX_RANGE})")
    elif name == "format":
        check_printf(bound.get("value"), bound.get("kwargs") or bound.get("args") or (), b)
    elif name == "tojson":
        indent = bound.get("indent")
        if not isinstance(indent, int | str):
            indent = 0
        indent = len(indent) if isinstance(indent, str) else indent
        b.size(text_size(bound.get("x"), b.max_chars, b, indent=max(indent, 0)), what)


# Filters that never turn their value into text; every other filter's value is size-checked as
# text first (a list nested 40 deep, each level holding the one below twice, prints 2**40 items).
_NON_TEXT_FILTERS = frozenset(
    "attr batch count default d dictsort first groupby items last length list map max min random "
    "reject rejectattr reverse select selectattr slice sort sum unique int float abs round bool "
    "join tojson".split()
)


def limited_filter(name: str, func):
    """``func`` with the budget's checks around it; takes the context, so jinja never runs it
    at compile time (constant folding) outside a budget."""
    kind = getattr(getattr(func, "jinja_pass_arg", None), "name", None)
    try:  # jinja's async-variant filters take the eval context but their signature omits it
        signature = inspect.signature(func)
        signature_has_lead = getattr(inspect.unwrap(func), "jinja_pass_arg", None) is not None
    except (TypeError, ValueError):
        signature = None

    @jinja2.pass_context
    @functools.wraps(func)
    def limited(context, *args, **kwargs):
        b = current_budget()
        b.tick()
        env = context.environment
        lead = {
            "context": (context,),
            "eval_context": (context.eval_ctx,),
            "environment": (env,),
        }.get(kind, ())
        if name not in _NON_TEXT_FILTERS and args:
            check_text(args[0], b, f"the value of the {name} filter")
        if name in ("sum", "join") and args:  # the items' sizes first, then the clock
            attr_at = 1 if name == "sum" else 2
            attribute = args[attr_at] if len(args) > attr_at else kwargs.pop("attribute", None)
            items = args[0]
            if attribute is not None:
                items = map(jinja2.filters.make_attrgetter(env, attribute), items)
            if name == "sum":
                args = (_bounded_sum_items(items, b), None, *args[2:])
            else:
                items = _materialize(items, b)
                sep = args[1] if len(args) > 1 else kwargs.get("d", "")
                size = len(str(sep)) * len(items)
                for item in items:
                    size += text_size(item, b.max_chars, b) - 2
                    b.size(size, "the join filter's result")
                args = (items, sep, None, *args[3:])
                kwargs.pop("d", None)
        elif signature is not None:
            try:
                bound = signature.bind(
                    *(lead if signature_has_lead else ()), *args, **kwargs
                ).arguments
            except TypeError:
                bound = None  # the call itself reports the bad arguments
            if bound is not None:
                _filter_checks(name, bound | bound.get("kwargs", {}), env, b)
        return check_result(func(*lead, *args, **kwargs), b, f"the {name} filter's result")

    return limited


def _bounded_sum_items(items, b: Budget):
    total = 0
    for item in items:
        b.tick()
        if isinstance(item, SEQUENCES):
            total += len(item)
            b.size(total, "the sum filter's result")
        yield item
