"""Chat-template rendering: transformers' jinja2 sandbox, with limits on time, size and depth.

A chat template is code from the model's files and its inputs come from the request, so one
template and one request can divide by zero, loop ``range(100000)`` inside ``range(100000)``,
recurse without end or build ``'x' * 200000000``. transformers' ``apply_chat_template`` (which
vLLM calls) renders in jinja2's ``ImmutableSandboxedEnvironment``: that stops attribute escapes
and caps one ``range`` at 100,000 items, but bounds neither time nor size (jinja declined a
render time limit, pallets/jinja#1691), and lets any Python error out. Here every render has a
budget (``template_limits.py``), and any failure is that request's ``ChatTemplateError``:

- time: ``MAX_RENDER_SECONDS`` (2 s) of wall time, checked at every call (macros, methods,
  globals, ``loop()``), filter, intercepted operator, loop iteration, output and long walk;
- size: no string, list, tuple or dict the template makes, no total of its ``{{ }}`` outputs
  (macro bodies and ``{% set %}`` blocks included) and not the prompt may pass
  ``MAX_TEMPLATE_CHARS`` (1 Mi) plus ``INPUT_CHARS_FACTOR`` (4) times the characters of the
  inputs. Sizes are checked *before* the operations that grow a value in one step (``*``,
  ``+``, ``~``, ``%`` and ``str.format`` with their widths, ``ljust``/``center``/``indent``,
  ``replace``, ``join``, ``wordwrap``, ``batch``, ``slice``, ``sum``, ``tojson(indent)``,
  ``lipsum``) and before a container becomes text; containers count a shared sub-list once
  per place it appears (``[x, x]`` forty times over is 2**40 items to compare, hash or print);
  integers stay under ``MAX_INT_BITS`` (65,536) bits;
- depth: ``MAX_CALL_DEPTH`` (64) nested calls (recursive macros).

Real templates (Llama 3.x, ChatML, Mistral, Gemma, DeepSeek, Qwen and Hermes tool templates)
render in milliseconds, nest under 10 calls and stay near the size of their messages. Not
bounded: the wall time of one C-level step on values that passed the size checks (for example
sorting a list of a million items), which is well under a second at these sizes.
"""

from __future__ import annotations

import datetime
import functools
import json
import time

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

import jaxinfer.tokenizers.template_limits as lim
from jaxinfer.errors import TokenizerError
from jaxinfer.tokenizers.template_limits import (  # noqa: F401  (re-exported)
    INPUT_CHARS_FACTOR,
    MAX_CALL_DEPTH,
    MAX_INT_BITS,
    MAX_RENDER_SECONDS,
    MAX_TEMPLATE_CHARS,
)


class ChatTemplateError(TokenizerError):
    """A chat template failed for one request: it does not compile, raised (``raise_exception``
    or any Python error), or went past a rendering limit. The message names the tokenizer, the
    problem and, where known, the template line."""


# ------------------------------------------------------------------ environment


class _LimitedCodeGenerator(CodeGenerator):
    """Compiles every ``{% for %}`` to iterate through ``lim.bounded_iter`` (nested loops stop at
    the deadline) and every ``~`` to ``_LimitedEnvironment.limited_join`` (sized before the
    join)."""

    def visit_For(self, node, frame):
        if not getattr(node, "_bounded", False):
            node._bounded = True
            node.iter = nodes.Call(
                nodes.EnvironmentAttribute("bounded_iter"),
                [node.iter],
                [],
                None,
                None,
                lineno=node.iter.lineno,
            )
        super().visit_For(node, frame)

    def _limited_literal(self, visit, node, frame):
        if getattr(node, "ctx", "load") != "load":  # an assignment target: (a, b) = ...
            return visit(node, frame)
        self.write("environment.limited_literal(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node, frame):
        self._limited_literal(super().visit_List, node, frame)

    def visit_Tuple(self, node, frame):
        self._limited_literal(super().visit_Tuple, node, frame)

    def visit_Dict(self, node, frame):
        self._limited_literal(super().visit_Dict, node, frame)

    def visit_Concat(self, node, frame):
        self.write("environment.limited_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _LimitedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with every operation that can take time or grow a value
    checked against the render's ``_Budget``."""

    code_generator_class = _LimitedCodeGenerator
    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, finalize=self._finalize, **kwargs)
        self.concat = self._concat  # joins the buffers of macros, {% set %} and {% filter %}
        self.bounded_iter = lim.bounded_iter

    @staticmethod
    @jinja2.pass_context
    def _finalize(context, value):
        """Every ``{{ expression }}`` output, buffered or not, before ``str()``."""
        b = lim.current_budget()
        b.tick()
        if isinstance(value, str):
            b.produced += len(value)
        elif isinstance(value, lim.CONTAINERS):
            b.produced += lim.text_size(value, b.max_chars, b)
        b.size(b.produced, "the template's expression output")
        return value

    @staticmethod
    def _concat(parts) -> str:
        b, out, total = lim.current_budget(), [], 0
        for p in parts:
            total += len(p)
            b.size(total, "a block's output")
            out.append(p)
        return "".join(out)

    @staticmethod
    def limited_literal(value):
        """``[a, b]``, ``(a, b)``, ``{a: b}``: the items counting repeats are within the limit."""
        b = lim.current_budget()
        b.tick()
        return lim.check_result(value, b, "a list, tuple or dict literal")

    @staticmethod
    def limited_join(values) -> str:
        """``a ~ b ~ ...``: jinja's ``str_join``, sized first."""
        b, out, total = lim.current_budget(), [], 0
        b.tick()
        for v in values:
            lim.check_text(v, b, "a ~ concatenation")
            s = str(v)
            total += len(s)
            b.size(total, "a ~ concatenation")
            out.append(s)
        return "".join(out)

    def call_binop(self, context, operator, left, right):
        b = lim.current_budget()
        b.tick()
        count = lim.check_binop(operator, left, right, b)
        result = super().call_binop(context, operator, left, right)
        if count is None:
            return lim.check_result(result, b, f"a {operator} operation")
        lim.remember(b, result, count)  # `acc = acc + [x]` in a loop: no walk of acc
        return result

    def call(self, context, obj, /, *args, **kwargs):
        b = lim.current_budget()
        b.tick()
        if isinstance(obj, LoopContext) and args:  # loop(children) in a recursive for
            args = (lim.bounded_iter(args[0]), *args[1:])
        args = lim.check_call(obj, args, kwargs, b)
        if b.depth >= lim.MAX_CALL_DEPTH:
            raise lim.LimitExceeded(f"calls nest deeper than {lim.MAX_CALL_DEPTH} (MAX_CALL_DEPTH)")
        b.depth += 1
        try:
            result = super().call(context, obj, *args, **kwargs)
        finally:
            b.depth -= 1
        return lim.check_result(result, b, f"the result of {getattr(obj, '__name__', 'a call')}")


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compiles ``source`` in the jinja2 environment of transformers' ``_compile_jinja_template``
    (``transformers/utils/chat_template_utils.py``, 5.x), with the limits of this module.

    Raises:
        jinja2.TemplateSyntaxError: ``source`` is not a valid template.
    """

    class GenerationTag(jinja2.ext.Extension):
        # transformers' AssistantTracker: `{% generation %}...{% endgeneration %}` renders its body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    class TemplateDict:  # transformers 5: `dict` without the type's attributes
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(Namespace):  # transformers 5: no underscore attributes
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    "chat templates cannot store underscore-prefixed attributes on a namespace, "
                    f"but got {name!r}"
                )

    env = _LimitedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.filters = {name: lim.limited_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


def _template_line(exc: BaseException) -> str:
    """`` (template line N)`` for the innermost template frame of ``exc``'s traceback."""
    line, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return f" (template line {line})" if line else ""


def render_chat_template(
    source: str,
    variables: dict,
    where: str = "chat template",
    *,
    max_seconds: float | None = None,
    max_chars: int | None = None,
) -> str:
    """Renders the template ``source`` with ``variables`` (``messages``, ``bos_token``, ...)
    within the limits of ``template_limits``: ``max_seconds`` defaults to
    ``MAX_RENDER_SECONDS``, ``max_chars`` to ``MAX_TEMPLATE_CHARS`` plus ``INPUT_CHARS_FACTOR``
    times the characters of ``variables``.

    Raises:
        ChatTemplateError: ``source`` does not compile, the template raised
            (``raise_exception``, ``1/0``, a type error, ...), or it went past a limit; the
            message starts with ``where`` and names the problem.
    """
    try:
        template = compile_chat_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"{where}: chat template does not compile: {e} (template line {e.lineno})"
        ) from e
    except Exception as e:  # RecursionError, SyntaxError from nesting, a non-string source...
        raise ChatTemplateError(
            f"{where}: chat template does not compile: {type(e).__name__}: {str(e)[:500]}"
        ) from e
    seconds = lim.MAX_RENDER_SECONDS if max_seconds is None else max_seconds
    b = lim.Budget(seconds, max_chars or 0)
    token = lim.BUDGET.set(b)
    chunks = None
    try:
        lim.count(variables, b, inputs=True)  # walks the inputs once (and refuses a cycle)
        if max_chars is None:
            inputs = lim.text_size(variables, float("inf"))
            b.max_chars = lim.MAX_TEMPLATE_CHARS + lim.INPUT_CHARS_FACTOR * inputs
        b.deadline = time.monotonic() + seconds
        chunks = template.generate(**variables)
        out, total = [], 0
        for chunk in chunks:
            total += len(chunk)
            b.size(total, "the rendered prompt")
            b.tick()
            out.append(chunk)
        return "".join(out)
    except lim.LimitExceeded as e:
        raise ChatTemplateError(f"{where}: chat template stopped: {e}{_template_line(e)}") from None
    except jinja2.TemplateError as e:
        detail = str(e) if type(e) is jinja2.TemplateError else f"{type(e).__name__}: {e}"
        raise ChatTemplateError(f"{where}: chat template error: {detail}{_template_line(e)}") from e
    except Exception as e:  # any Python error in the template is this request's error
        raise ChatTemplateError(
            f"{where}: chat template error: {type(e).__name__}: {e}{_template_line(e)}"
        ) from e
    finally:
        if chunks is not None:
            chunks.close()
        lim.BUDGET.reset(token)
