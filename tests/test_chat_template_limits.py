"""Chat templates render within limits (``jaxinfer/tokenizers/chat_template.py``): every nasty
template (1/0, type errors, huge ranges, nested loops, recursion, huge strings, growing loops,
``raise_exception``, templates that break Python's compiler, ``wordwrap`` of a huge text) is a
clean ``ChatTemplateError`` within the time bound and without growing
memory, real templates render as transformers renders them, and in ``LLM.generate`` and
``jaxinfer generate`` one failing request fails alone while the others complete; a
``chat_template`` in tokenizer_config.json that is not a string is refused naming the file.

The outside references are transformers' own jinja environment (``_compile_jinja_template``),
``tracemalloc``'s peak and the wall clock.
"""

from __future__ import annotations

import json
import time
import tracemalloc

import pytest
from conftest import STORIES_CLI_FLAGS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxinfer.errors import JaxinferError, TokenizerError
from jaxinfer.tokenizers import template_limits
from jaxinfer.tokenizers.base import SideFiles
from jaxinfer.tokenizers.chat_template import ChatTemplateError, render_chat_template

HANG_GUARD_S = 30.0  # generous: only a hang (or a limit that never fires) passes it
FAST_DEADLINE_S = 0.25  # MAX_RENDER_SECONDS while testing the deadline, to keep the suite fast
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi ünï 你好 🎉"},
    {"role": "assistant", "content": " Hello! "},
    {"role": "user", "content": "Weather?"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city ",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "the city", "enum": ["a", "b"]},
                    "days": {"type": "integer", "description": "days ahead"},
                },
                "required": ["city"],
            },
        },
    }
]
TOOL_CALLS = [
    {"role": "user", "content": "Weather in a?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_123456789",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "a", "days": 3}},
            }
        ],
    },
    {"role": "tool", "name": "get_weather", "tool_call_id": "call_123456789", "content": "sun"},
]


def _vars(messages=MESSAGES, tools=None) -> dict:
    return dict(
        messages=messages,
        tools=tools,
        documents=None,
        add_generation_prompt=True,
        bos_token="<s>",
        eos_token="</s>",
    )


def _reference(source: str, variables: dict) -> str:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(source).render(**variables)


@pytest.fixture
def fast_deadline(monkeypatch):
    monkeypatch.setattr(template_limits, "MAX_RENDER_SECONDS", FAST_DEADLINE_S)


# --- real templates render as transformers renders them --------------------------------------

# Hermes / Qwen / Mistral / DeepSeek / Gemma style constructs, each hooked by the limits: macros
# (recursive), `~`, `+` on strings and lists, `*`, `%`, str.format, every size-checked filter,
# namespaces, loop variables, recursive loops, call / set / filter blocks, literals, unpacking.
REAL_TEMPLATES = {
    "chatml_tools": (
        "{%- macro py_type(spec) %}{%- set m = {'string': 'str', 'integer': 'int'} %}"
        "{%- if m[spec.type] is defined %}{{- m[spec.type] }}{%- elif spec.type == 'array' %}"
        "{{- 'list[' + py_type(spec['items']) + ']' }}{%- else %}{{- 'Any' }}{%- endif %}"
        "{%- endmacro %}"
        "{{- bos_token }}{%- if tools is iterable and tools | length > 0 %}{{- '<tools>' }}"
        "{%- for tool in tools %}{%- set tool = tool.function %}"
        "{{- '\\n' ~ tool.name ~ '(' }}{%- for name, f in tool.parameters.properties|items %}"
        "{{- name + ': ' + py_type(f) }}{%- if not loop.last %}{{- ', ' }}{%- endif %}"
        "{%- endfor %}{{- ') - ' + tool.description|trim }}"
        "{{- '\\n' + tool.parameters|tojson(indent=2) }}{%- endfor %}{{- '</tools>' }}{%- endif %}"
        "{%- for message in messages %}"
        "{%- if message.tool_calls is defined %}{{- '<|im_start|>assistant' }}"
        "{%- for call in message.tool_calls %}{%- set call = call.function %}"
        '{{- \'\\n<tool_call>{"name": "\' + call.name + \'", "arguments": \' '
        "+ call.arguments|tojson + '}</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
        "{%- elif message.role == 'tool' %}"
        "{%- if loop.previtem and loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}"
        "{%- endif %}{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
        "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content|trim "
        "+ '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ),
    "mistral_like": (
        "{%- set today = strftime_now('%Y') %}{{- bos_token }}"
        "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
        "{%- set loop_messages = messages[1:] %}{%- else %}{%- set system = 'default ' ~ today %}"
        "{%- set loop_messages = messages %}{%- endif %}"
        "{%- set users = loop_messages | selectattr('role', 'equalto', 'user') | list %}"
        "{%- set kept = [] %}{%- for m in loop_messages %}"
        "{%- if m['role'] not in ['tool', 'tool_results'] and not m.get('tool_calls') %}"
        "{%- set kept = kept + [m] %}{%- endif %}{%- endfor %}"
        "{%- for m in kept %}{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{- raise_exception('roles must alternate') }}{%- endif %}{%- endfor %}"
        "{%- for m in loop_messages %}{%- if m['role'] == 'user' %}"
        "{%- if m == users[-1] %}{{- '[SYS]' + system + '[/SYS]' }}{%- endif %}"
        "{{- '[INST]' + m['content'] + '[/INST]' }}{%- else %}{{- m['content'] + eos_token }}"
        "{%- endif %}{%- endfor %}"
    ),
    "deepseek_like": (
        "{%- set ns = namespace(sys='', first=true, last_user=false) %}"
        "{%- for m in messages if m.role == 'system' %}{%- if ns.first %}"
        "{%- set ns.sys = ns.sys + m.content %}{%- set ns.first = false %}{%- else %}"
        "{%- set ns.sys = ns.sys + '\\n\\n' + m.content %}{%- endif %}{%- endfor %}"
        "{{ bos_token }}{{ ns.sys }}"
        "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = true %}"
        "{{ '<User>' + m.content + '<Assistant>' }}{%- elif m.role == 'assistant' %}"
        "{%- set ns.last_user = false %}{{ m.content + '<end>' }}{%- endif %}{%- endfor %}"
        "{% if add_generation_prompt and not ns.last_user %}{{ '<Assistant>' }}{% endif %}"
    ),
    "helpers": (
        "{% macro box(x) %}[{{ caller() }}:{{ x }}]{% endmacro %}"
        "{% call box(3) %}in{% endcall %}{% set block %}{{ messages|length }} msgs{% endset %}"
        "{{ block|upper }}{% filter title %}{{ 'one two' }}{% endfilter %}"
        "{{ '%s=%03d|%-4s|' % ('n', 7, 'ab') }}{{ '{0:>6}|{1:.2f}|{0!r}'.format('ab', 1.5) }}"
        "{{ 'ab' * 3 }}{{ [1, 2] * 2 }}{{ (1, 2) + (3,) }}{{ 2 ** 10 }}{{ 7 * 6 }}"
        "{{ 'x'|center(9) }}{{ 'a\\nb'|indent(2, true) }}{{ 'aaa bbb ccc'|wordwrap(4) }}"
        "{{ 'abcabc'|replace('b', 'XY') }}{{ 'abc'|replace('', '-') }}{{ 'ab'.ljust(5, '.') }}"
        "{{ 'a\\tb'.expandtabs(4) }}{{ ', '.join(['p', 'q']) }}{{ [3, 1, 2]|sort|join('-') }}"
        "{{ [[1], [2, 3]]|sum(start=[]) }}{{ range(7)|batch(3, 0)|list }}"
        "{{ range(7)|slice(3)|list }}"
        "{{ messages|map(attribute='role')|unique|list }}{{ {'b': 1, 'a': 2}|dictsort }}"
        "{{ messages|groupby('role')|map(attribute='grouper')|join(',') }}"
        "{{ messages[:2]|tojson }}{{ dict(a=1, b=[2])|tojson(indent=1) }}{{ '%d%%'|format(5) }}"
        "{% for a, b in [(1, 2), (3, 4)] %}{{ a + b }}{% endfor %}{% set p, q = 'PQ' %}{{ q ~ p }}"
        "{% for x in [[1, [2]], [3]] recursive %}{% if x is iterable %}{{ loop(x) }}"
        "{% else %}{{ x }}{{ loop.depth }}{% endif %}{% endfor %}"
        "{% for m in messages %}{{ loop.index }}{{ loop.cycle('a', 'b') }}{% if loop.last %}"
        "{% break %}{% endif %}{% endfor %}{{ messages[1].content|wordcount }}"
    ),
}


@pytest.mark.parametrize(
    "name, conversation",
    [(name, "chat") for name in sorted(REAL_TEMPLATES)]
    + [("chatml_tools", "tools"), ("helpers", "tools")],
)
def test_real_templates_render_as_transformers(name, conversation):
    variables = _vars() if conversation == "chat" else _vars(TOOL_CALLS, TOOLS)
    source = REAL_TEMPLATES[name]
    expected = _reference(source, variables)
    assert render_chat_template(source, variables) == expected
    assert template_limits.BUDGET.get() is None  # the budget does not outlive the render


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "user", "assistant", "tool"]),
                "content": st.text(max_size=40),
            }
        ),
        max_size=6,
    ),
    st.booleans(),
)
def test_any_conversation_renders_as_transformers(messages, add_generation_prompt):
    variables = _vars(messages) | {"add_generation_prompt": add_generation_prompt}
    for source in (REAL_TEMPLATES["deepseek_like"], REAL_TEMPLATES["chatml_tools"]):
        assert render_chat_template(source, variables) == _reference(source, variables)


def test_large_inputs_are_not_refused():
    # The size limit grows with the inputs: a 3 MB message (past MAX_TEMPLATE_CHARS alone)
    # rendered twice, once through ~ and once through +, still fits.
    content = "word " * 600_000
    source = "{% for m in messages %}{{ m.content ~ '|' }}{{ m.content + '|' }}{% endfor %}"
    variables = _vars([{"role": "user", "content": content}])
    assert len(content) > template_limits.MAX_TEMPLATE_CHARS
    assert render_chat_template(source, variables) == _reference(source, variables)


# --- nasty templates: one clean error each, in time, without growing memory -------------------

LIMIT = "over the limit of"
NASTY = {
    # Python errors inside the template.
    "divide_by_zero": ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),
    "type_error": ("{{ messages[0].content + 1 }}", "TypeError: can only concatenate str"),
    "raise_exception": ("{{ raise_exception('nope') }}", "chat template error: nope"),
    "undefined": ("{{ nothing.here }}", "UndefinedError: 'nothing' is undefined"),
    "sandbox": ("{{ ''.__class__.__mro__ }}", "SecurityError: access to attribute '__class__'"),
    "namespace_underscore": ("{% set ns = namespace(_x=1) %}", "underscore-prefixed"),
    "syntax": ("{% for %}", "chat template does not compile"),
    "huge_range": ("{{ range(10**12)|list|length }}", "OverflowError: Range too big"),
    # Time.
    "nested_range_loops": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "longer than",
    ),
    "nested_loops_over_a_string": (
        "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        "longer than",
    ),
    "doubling_macro": (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
        "{{ f(60) }}",
        "longer than",
    ),
    "doubling_macro_silent": (  # no output, no loop: only the calls see the clock
        "{% macro f(n) %}{% if n %}{% set a = f(n - 1) %}{% set b = f(n - 1) %}{% endif %}"
        "{% endmacro %}{{ f(60) }}",
        "longer than",
    ),
    "slow_string_append": (
        "{% set ns = namespace(s='') %}{% for i in range(100000) %}{% for j in range(100000) %}"
        "{% set ns.s = ns.s + 'x' %}{% endfor %}{% endfor %}",
        "longer than",
    ),
    "quadratic_sum_of_lists": ("{{ ([[1] * 5] * 100000)|sum(start=[])|length }}", "longer than"),
    "constant_text_in_a_set_block": (
        "{% set x %}{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx"
        "{% endfor %}{% endfor %}{% endset %}",
        "longer than",
    ),
    # Depth.
    "recursive_macro": (
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "calls nest deeper than 64",
    ),
    "recursive_loop": (
        "{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}",
        "calls nest deeper than 64",
    ),
    # Size, each before the big value exists.
    "string_times_200M": ("{{ 'x' * 200000000 }}", "* operation would have 200,000,000 "),
    "list_times": ("{{ ([1] * 100000) * 100000 }}", "* operation would have 10,000,000,000"),
    "doubling_concat_loop": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}",
        "~ concatenation would have 2,097,152",
    ),
    "doubling_plus_loop": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}",
        "+ operation would have 2,097,152",
    ),
    "join_filter": ("{{ (['x' * 1000000] * 1000)|join }}", "join filter's result"),
    "str_join": ("{{ ''.join(['x' * 1000000] * 1000) }}", "str.join would have"),
    "center": ("{{ 'x'|center(10**10) }}", "center filter would have 10,000,000,000"),
    "ljust": ("{{ 'x'.ljust(10**10) }}", "str.ljust would have 10,000,000,000"),
    "indent": ("{{ ('a\\n' * 1000)|indent(10**7) }}", "indent filter would have"),
    "expandtabs": ("{{ ('\\t' * 1000).expandtabs(10**7) }}", "str.expandtabs would have"),
    "replace_empty": ("{{ ('x' * 100000)|replace('', 'y' * 1000) }}", "replace filter would have"),
    "wordwrap": ("{{ ('x ' * 100000)|wordwrap(1, wrapstring='y' * 1000) }}", "wordwrap filter"),
    "printf_width": ("{{ '%999999999s' % 'x' }}", "a width in a % formatting"),
    "printf_star": ("{{ '%*s' % (10**10, 'x') }}", "a width in a % formatting"),
    "format_filter": ("{{ '%*s'|format(10**10, 'x') }}", "a width in a % formatting"),
    "str_format_width": ("{{ '{:>9999999999}'.format('x') }}", "a width in a str.format"),
    "str_format_nested": ("{{ '{:>{}}'.format('x', 10**10) }}", "a width in a str.format"),
    "str_format_fields": ("{{ ('{0}' * 100000).format('x' * 1000) }}", "str.format would have"),
    "tojson_indent": ("{{ messages|tojson(indent=10**8) }}", "tojson filter would have"),
    "batch_fill": ("{{ [1]|batch(10**10, 'x')|list }}", "batch filter with 10,000,000,000"),
    "slice": ("{{ [1]|slice(10**10)|list }}", "slice filter with 10,000,000,000"),
    "lipsum": ("{{ lipsum(10**7) }}", "lipsum would have"),
    "int_power": ("{{ 10 ** (10 ** 10) }}", "integer over 65536 bits"),
    "int_squaring": (
        "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}"
        "{% endfor %}",
        "integer over 65536 bits",
    ),
    "shared_list_printed": (
        "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = [ns.l, ns.l] %}"
        "{% endfor %}{{ ns.l }}",
        "items counting repeats",
    ),
    "shared_list_compared": (
        "{% set ns = namespace(a=[1], b=[1]) %}{% for i in range(64) %}"
        "{% set ns.a = [ns.a, ns.a] %}{% set ns.b = [ns.b, ns.b] %}{% endfor %}{{ ns.a == ns.b }}",
        "items counting repeats",
    ),
    "shared_tuple_hashed_via_batch": (
        "{% set ns = namespace(a=[1]) %}{% for i in range(64) %}"
        "{% for pair in ([ns.a] * 2)|batch(2) %}{% set ns.a = pair %}{% endfor %}{% endfor %}"
        "{{ {ns.a|string: 1} }}",
        "items counting repeats",
    ),
    "set_block_output": (
        "{% set x %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endset %}",
        "expression output would have",
    ),
    "macro_output": (
        "{% macro m() %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endmacro %}"
        "{{ m() }}",
        "expression output would have",
    ),
    "constant_output": (
        "{% for i in range(100000) %}" + "y" * 1000 + "{% endfor %}",
        "the rendered prompt would have",
    ),
}


@pytest.mark.parametrize("name", sorted(NASTY))
def test_nasty_template_is_a_clean_error_in_time(name, fast_deadline):
    source, message = NASTY[name]
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(ChatTemplateError) as info:
            render_chat_template(source, _vars(), where="tok/x")
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    text = str(info.value)
    assert text.startswith("tok/x: chat template ") and message in text, text
    assert isinstance(info.value, TokenizerError) and isinstance(info.value, JaxinferError)
    if LIMIT in text:  # names the constants that set the limit
        assert "MAX_TEMPLATE_CHARS + INPUT_CHARS_FACTOR" in text
    if "longer than" in text:  # MAX_RENDER_SECONDS, read at each render (patched here)
        assert f"longer than {FAST_DEADLINE_S:g} s (MAX_RENDER_SECONDS)" in text
        assert FAST_DEADLINE_S <= elapsed
    assert elapsed < HANG_GUARD_S, f"{name} took {elapsed:.1f} s"
    # Values stay under the size limit (1 Mi characters + 4 x the inputs, at most 4 bytes per
    # character); the 8-byte references of a time-bounded loop come on top.
    assert peak < 96 * 2**20, f"{name} peaked at {peak / 2**20:.0f} MiB"
    assert template_limits.BUDGET.get() is None


# Random templates built from the operations that take time or grow values (every expression a
# string, so that they grow rather than stop at a type error), sizes from tiny to 10**12: each
# render returns a string within the size limit or raises ChatTemplateError for a limit, never
# anything else, never runs long past the deadline, never allocates much.
_SIZES = st.one_of(st.integers(0, 40), st.sampled_from([1000, 10**5, 10**6, 10**9, 10**12]))
_LOOPS = st.sampled_from([0, 1, 2, 30, 1000, 100000])
_LEAVES = st.sampled_from(["'x'", "'ab\\n'", "messages[0].content", "ns.v"])


def _grow(e):
    pair, sized = st.tuples(e, e), st.tuples(e, _SIZES)
    return st.one_of(
        sized.map(lambda t: f"({t[0]} * {t[1]})"),
        pair.map(lambda t: f"({t[0]} + {t[1]})"),
        pair.map(lambda t: f"({t[0]} ~ {t[1]})"),
        sized.map(lambda t: f"({t[0]}).ljust({t[1]})"),
        sized.map(lambda t: f"({t[0]}|center({t[1]}))"),
        sized.map(lambda t: f"({t[0]}|indent({t[1]}))"),
        sized.map(lambda t: f"('%*s' % ({t[1]}, {t[0]}))"),
        sized.map(lambda t: f"('{{:>{{}}}}'.format({t[0]}, {t[1]}))"),
        pair.map(lambda t: f"({t[0]}|replace('', {t[1]}))"),
        pair.map(lambda t: f"({t[0]}|wordwrap(1, wrapstring={t[1]}))"),
        st.tuples(e, e, e).map(lambda t: f"([{t[0]}, {t[1]}]|join({t[2]}))"),
        sized.map(lambda t: f"({t[0]}|batch({t[1]}, 'y')|map('join')|join)"),
        e.map(lambda x: f"({x}|tojson)"),
    )


_EXPR = st.recursive(_LEAVES, _grow, max_leaves=5)
_STATEMENT = st.recursive(
    st.one_of(
        _EXPR.map(lambda e: "{% set ns.v = " + e + " %}"),
        _EXPR.map(lambda e: "{{ " + e + " }}"),
        st.sampled_from(
            [
                "{{ f(ns.d) }}",
                "{% set ns.d = ns.d + 1 %}",
                "{% set ns.l = [ns.l, ns.l] %}{% set ns.m = [ns.m, ns.m] %}",
            ]
        ),
    ),
    lambda s: st.one_of(
        st.tuples(_LOOPS, st.lists(s, min_size=1, max_size=3)).map(
            lambda t: "{% for i in range(" + str(t[0]) + ") %}" + "".join(t[1]) + "{% endfor %}"
        ),
        st.lists(s, min_size=1, max_size=2).map(
            lambda b: "{% set blk %}" + "".join(b) + "{% endset %}{{ blk|length }}"
        ),
    ),
    max_leaves=5,
)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(_STATEMENT, min_size=1, max_size=4))
def test_random_growing_templates_stay_within_limits(body):
    source = (
        "{% set ns = namespace(v='x', d=0, l=[1], m=[1]) %}{% macro f(n) %}{% if n > 0 %}"
        "{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
        + "".join(body)
        + "{{ ns.l == ns.m }}"
    )
    max_chars, t0 = 1 << 17, time.perf_counter()
    tracemalloc.start()
    try:
        out = render_chat_template(source, _vars(), max_seconds=0.1, max_chars=max_chars)
        assert len(out) <= max_chars
    except ChatTemplateError as e:  # only a limit: every expression is a well-typed string
        assert "chat template stopped: " in str(e), str(e)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert time.perf_counter() - t0 < HANG_GUARD_S
    assert peak < 32 * 2**20, f"peaked at {peak / 2**20:.0f} MiB"


def test_error_names_the_template_line():
    source = "{{ bos_token }}\n{% for m in messages %}\n{{ m.content }}\n{{ 1 // 0 }}\n{% endfor %}"
    with pytest.raises(ChatTemplateError, match=r"ZeroDivisionError.*\(template line 4\)"):
        render_chat_template(source, _vars())


@pytest.mark.parametrize(
    "messages, message",
    [
        ("hello", r"messages must be a list .* not str"),
        ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be a dict, not str"),
        ([{"content": "a"}], r"messages\[0\]\['role'\] must be a string, not NoneType"),
    ],
)
def test_apply_chat_template_checks_messages(messages, message, stories_llm, monkeypatch):
    monkeypatch.setattr(stories_llm.tokenizer, "chat_template", "{{ messages }}")
    with pytest.raises(ChatTemplateError, match=message):
        stories_llm.tokenizer.apply_chat_template(messages)


# --- one bad request fails alone: LLM and CLI ------------------------------------------------

# A template that misbehaves on some requests only (by role), as a real template fails on the
# request whose messages it does not expect.
ENGINE_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'divide' %}{{ 1 / 0 }}"
    "{% elif m.role == 'spin' %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{% elif m.role == 'grow' %}{{ 'x' * 200000000 }}"
    "{% elif m.role == 'refuse' %}{{ raise_exception('no ' + m.content) }}"
    "{% else %}{{ m.content }}{% endif %}{% endfor %}"
)
BAD = {
    "divide": "ZeroDivisionError",
    "spin": "longer than",
    "grow": "* operation would have 200,000,000",
    "refuse": "chat template error: no way",
}
GOOD = ["Once upon a time", "The little dog", "Lily went to the park"]


def _conversation(role: str, content: str = "way") -> list[dict]:
    return [{"role": role, "content": content}]


def test_bad_template_request_fails_alone_in_generate(stories_llm, monkeypatch, fast_deadline):
    from jaxinfer.sampling.sampler import SamplingParams

    monkeypatch.setattr(stories_llm.tokenizer, "chat_template", ENGINE_TEMPLATE)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    labels = ["good0", "divide", "spin", "good1", "grow", "refuse", "good2"]
    good = {f"good{i}": _conversation("user", text) for i, text in enumerate(GOOD)}
    prompts = [{"messages": good.get(label) or _conversation(label)} for label in labels]
    outs = dict(zip(labels, stories_llm.generate(prompts, params), strict=True))
    # The reference: the good requests by themselves, after the failures (the engine goes on).
    alone = stories_llm.generate([{"messages": m} for m in good.values()], params)
    for role, fragment in BAD.items():
        out = outs[role]
        assert out.finish_reason == "error" and out.token_ids == []
        assert "chat template" in out.error and fragment in out.error, out.error
    for label, ref in zip(good, alone, strict=True):
        out = outs[label]
        assert out.error is None and out.finish_reason in ("stop", "length")
        assert out.token_ids == ref.token_ids and len(ref.token_ids) > 0
        assert out.prompt_token_ids == ref.prompt_token_ids
        assert out.prompt_token_ids == stories_llm.tokenizer.encode(
            good[label][0]["content"], add_special_tokens=False
        )


def test_bad_template_record_fails_alone_in_cli(
    stories_dir, tmp_path, monkeypatch, capsys, fast_deadline
):
    from jaxinfer.cli import main as cli

    load = cli._load_llm

    def load_with_template(args):
        llm = load(args)
        llm.tokenizer.chat_template = ENGINE_TEMPLATE
        return llm

    monkeypatch.setattr(cli, "_load_llm", load_with_template)
    records = [{"id": "good0", "messages": _conversation("user", GOOD[0])}]
    records += [{"id": role, "messages": _conversation(role)} for role in BAD]
    records += [{"id": "good1", "messages": _conversation("user", GOOD[1])}]
    prompts, out = tmp_path / "chat.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    rc = cli.main(
        [
            "generate",
            "--model",
            str(stories_dir),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            *STORIES_CLI_FLAGS,
            "--max-tokens",
            "8",
            "--temperature",
            "0",
        ]
    )
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0, summary
    written = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(written) == sorted(r["id"] for r in records)
    for role, fragment in BAD.items():
        error = written[role]["error"]
        assert error.startswith("line ") and "chat template" in error and fragment in error
    for rid in ("good0", "good1"):
        assert written[rid].get("error") is None and written[rid]["finish_reason"] != "error"
        assert written[rid]["token_ids"]


# ------------------------------------------- templates that break Python's compiler, huge texts


@pytest.mark.parametrize(
    "source",
    [
        "{{ " + "(" * 300 + "1" + ")" * 300 + " }}",  # RecursionError in jinja's parser
        "{% for a in b %}" * 25 + "{% endfor %}" * 25,  # SyntaxError: too many nested blocks
        "{% if true %}" * 100 + "{% endif %}" * 100,  # IndentationError
    ],
)
def test_templates_that_break_python_compile_are_the_requests_error(source):
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template(source, {"messages": [{"role": "user", "content": "hi"}]}, where="t")
    assert time.perf_counter() - t0 < 30  # hang guard


def test_wordwrap_of_a_huge_text_stops_at_once():
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="wordwrap"):
        render_chat_template(
            "{% for m in messages %}{{ m.content|wordwrap(1) }}{% endfor %}",
            {"messages": [{"role": "user", "content": "x" * 3_000_000}]},
            where="t",
        )
    assert time.perf_counter() - t0 < 30  # hang guard (it ran for minutes before)


@pytest.mark.parametrize(
    "value, words",
    [
        (["{{ 1 }}"], "list of"),
        (5, "must be a string"),
        ({}, "must be a string"),
    ],
)
def test_a_chat_template_that_is_not_a_string_names_the_file(tmp_path, value, words):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": value}))
    with pytest.raises(TokenizerError, match=words) as e:
        SideFiles(tmp_path)
    assert "tokenizer_config.json" in str(e.value)
