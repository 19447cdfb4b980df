"""Issue 15, class 2: no single line of a prompts file ends a ``jaxinfer generate`` job.

Each nasty line is one error record naming its line and field, or a correct record; the other
lines' numbers, ids and records are unchanged (`jaxinfer.cli.prompts_file`, tested without a model,
plus a
hypothesis fuzz whose records are also written through `jaxinfer.cli.output_file`). One end-to-end
run
on stories260K checks that the good records of a file full of bad lines are the same bytes as a
run of the good records alone. Outputs (class 5) are in test_cli_outputs.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import STORIES_CLI_FLAGS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxinfer.cli import main as cli
from jaxinfer.cli import prompts_file as jobs
from jaxinfer.cli.output_file import OutputFile
from jaxinfer.cli.prompts_file import read_jobs

DEFAULTS = cli._sampling_defaults()
SHARED = Path(
    os.environ.get("JAXINFER_SHARED", Path(__file__).resolve().parents[1].parent / "shared")
)
STORIES = SHARED / "models" / "stories260K"
ENGINE = STORIES_CLI_FLAGS  # = test_cli's


def _jobs(tmp_path, lines: list[bytes], name="p.jsonl", **kw) -> list[jobs.Job]:
    """The jobs of a file of ``lines`` (bytes, joined by b"\\n"), ids assigned by `plan`."""
    path = tmp_path / name
    path.write_bytes(b"\n".join(lines) + b"\n")
    js, _ = read_jobs(path, DEFAULTS, **kw)
    jobs.plan(js, set())
    return js


def _by_line(js) -> dict[int, jobs.Job]:
    return {j.line: j for j in js}


def _rec(**kw) -> bytes:
    return json.dumps(kw).encode()


GOOD = _rec(id="ok", prompt="Once upon a time")


def _assert_error(job: jobs.Job, line: int, *words: str) -> None:
    assert job.error is not None and job.error.startswith(f"line {line}: "), job
    for w in words:
        assert w in job.error, (w, job.error)
    assert job.prompt is None and job.sampling is None


def _assert_good_neighbour(js, line: int) -> None:
    # The good record after a bad line keeps its line number, id and prompt.
    j = _by_line(js)[line]
    assert (j.id, j.error, j.prompt) == ("ok", None, "Once upon a time"), j


# ------------------------------------------------------------------------- class 2: input files


def test_a_misspelled_prompt_key_is_named(tmp_path):
    """A record without a prompt key (``promt`` for ``prompt``) fails alone, naming its fields."""
    js = _jobs(tmp_path, [_rec(id="typo", promt="Tom"), GOOD])
    _assert_error(_by_line(js)[1], 1, "exactly one of", "its fields besides id: promt")
    _assert_good_neighbour(js, 2)


def test_deeply_nested_line_is_one_error(tmp_path):
    deep = b'{"id": "d", "prompt": "x", "a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    nested = b'{"id": "n", "prompt": "x", "stop": ' + b"[" * 40 + b"]" * 40 + b"}"
    js = _jobs(tmp_path, [deep, nested, GOOD])
    d, n = _by_line(js)[1], _by_line(js)[2]
    _assert_error(d, 1, "nested too deeply")
    assert d.id == "line-1"  # the id could not be read: a generated one
    _assert_error(n, 2, "stop", "deeper than 32")
    assert n.id == "n"
    _assert_good_neighbour(js, 3)


def test_lone_surrogate_is_an_error_naming_the_field_and_the_record_writes(tmp_path):
    lines = [
        _rec(id="p", prompt="a\ud800b"),  # json.dumps writes the escape \ud800
        _rec(id="s", prompt="x", stop=["ok", "\udfff"]),
        _rec(id="m", messages=[{"role": "user", "content": "\udc00"}]),
        b'{"id": "k", "prompt": "x", "\\ud800": 1}',
        _rec(id="\ud83d", prompt="x"),
        GOOD,
    ]
    js = _jobs(tmp_path, lines)
    b = _by_line(js)
    _assert_error(b[1], 1, "prompt", "lone surrogate", "\\ud800")
    _assert_error(b[2], 2, "stop[1]", "lone surrogate")
    _assert_error(b[3], 3, "messages[0].content", "lone surrogate")
    _assert_error(b[4], 4, "key", "lone surrogate")
    _assert_error(b[5], 5, "id", "lone surrogate")
    assert [j.id for j in js[:5]] == ["p", "s", "m", "k", "line-5"]
    _assert_good_neighbour(js, 6)
    # Every error record is written as valid UTF-8 JSON.
    out = OutputFile.open(tmp_path / "out.jsonl")
    for j in js[:5]:
        out.write(cli._error_record(j))
    out.close()
    text = (tmp_path / "out.jsonl").read_bytes().decode("utf-8")  # strict
    assert [json.loads(x)["id"] for x in text.splitlines()] == ["p", "s", "m", "k", "line-5"]


def test_a_surrogate_that_reaches_the_writer_is_escaped_not_fatal(tmp_path):
    out = OutputFile.open(tmp_path / "out.jsonl")
    out.write({"id": "x", "text": "a\ud800é"})
    out.close()
    raw = (tmp_path / "out.jsonl").read_bytes()
    raw.decode("utf-8")  # strict: the line is valid UTF-8
    assert json.loads(raw) == {"id": "x", "text": "a\ud800é"}  # the same JSON value


def test_non_utf8_byte_fails_only_its_line(tmp_path):
    lines = [
        b'{"id": "a", "prompt": "caf\xe9"}',  # Latin-1 inside a string: the field is named
        b'{"id": "b\xff", "prompt": "x"}',  # inside the id: a generated id
        b'{"id": "c", "prompt": "x"}\xff',  # outside any string: the line
        GOOD,
    ]
    js = _jobs(tmp_path, lines, name="p.txt")  # still JSONL: every line starts with {
    b = _by_line(js)
    _assert_error(b[1], 1, "prompt", "0xe9", "not UTF-8")
    assert b[1].id == "a"
    _assert_error(b[2], 2, "id", "0xff")
    assert b[2].id == "line-2"
    _assert_error(b[3], 3, "not valid UTF-8", "0xff at byte 26")
    assert b[3].id == "line-3"
    _assert_good_neighbour(js, 4)

    # Plain text: the line with the byte is an error under its own line-number id.
    js = _jobs(tmp_path, [b"Once upon", b"caf\xe9 au lait", b"Tom"], name="p.txt")
    assert [(j.id, j.prompt) for j in js] == [("0", "Once upon"), ("1", None), ("2", "Tom")]
    _assert_error(js[1], 2, "not valid UTF-8", "0xe9 at byte 3")


SPLITLINES_ONLY = "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"  # str.splitlines splits, JSON need not


def test_lines_split_on_newline_only(tmp_path):
    # JSON strings may hold U+0085, U+2028 and U+2029 raw; the C0 ones only escaped.
    raw = '{"id": "u", "prompt": "a\x85b\u2028c\u2029d", "stop": ["\\u000b\\u001c"]}'
    lines = [raw.encode(), b'{"prompt": "no id"}', GOOD]
    js = _jobs(tmp_path, lines)
    assert [(j.line, j.id, j.error) for j in js] == [
        (1, "u", None),
        (2, "1", None),
        (3, "ok", None),
    ]
    assert js[0].prompt == "a\x85b\u2028c\u2029d"
    # Plain text: every character str.splitlines splits on (and a lone \r) stays in its line.
    text = "".join(f"p{i}{c}q" for i, c in enumerate(SPLITLINES_ONLY + "\r")).encode()
    js = _jobs(tmp_path, [text, b"last"], name="p.txt")
    assert [(j.id, j.prompt) for j in js] == [("0", text.decode()), ("1", "last")]


def test_crlf_bom_and_nul(tmp_path):
    lines = [
        b"\xef\xbb\xbf" + _rec(id="first", prompt="x") + b"\r",  # BOM, CRLF
        b'{"id": "nul", "prompt": "a\x00b"}\r',  # a raw NUL: not JSON
        _rec(id="esc", prompt="a\x00b") + b"\r",  # the escape \u0000: a correct record
        GOOD + b"\r",
    ]
    js = _jobs(tmp_path, lines, name="p.txt")  # the BOM does not stop JSONL detection
    b = _by_line(js)
    assert (b[1].id, b[1].prompt, b[1].error) == ("first", "x", None)
    _assert_error(b[2], 2, "not valid JSON", "control character")
    assert b[2].id == "line-2"
    assert (b[3].id, b[3].prompt) == ("esc", "a\x00b")
    _assert_good_neighbour(js, 4)
    # Plain text: the \r of a CRLF is not part of the prompt.
    js = _jobs(tmp_path, [b"a\r", b"b \r"], name="p.txt")
    assert [j.prompt for j in js] == ["a", "b "]
    # A BOM anywhere else is text.
    js = _jobs(tmp_path, [b"a", b"\xef\xbb\xbfb"], name="p.txt")
    assert [j.prompt for j in js] == ["a", "\ufeffb"]


def test_overlong_line_is_skipped_over(tmp_path):
    long = _rec(id="long", prompt="x" * 5000)
    js = _jobs(tmp_path, [GOOD.replace(b"ok", b"a"), long, GOOD], max_line_bytes=1000)
    _assert_error(_by_line(js)[2], 2, "longer than 1000 bytes", f"({len(long) + 1} bytes)")
    assert _by_line(js)[2].id == "line-2"
    _assert_good_neighbour(js, 3)
    # Exactly at the limit is read (with and without \r); one byte more is not.
    at = _rec(id="at", prompt="y" * 200)
    for extra, ok in [(b"", True), (b"\r", True), (b" ", False)]:
        js = _jobs(tmp_path, [at + extra, GOOD], max_line_bytes=len(at))
        assert (js[0].error is None) == ok, (extra, js[0].error)
        _assert_good_neighbour(js, 2)


def test_huge_integers(tmp_path):
    lines = [
        b'{"id": ' + b"9" * 5000 + b', "prompt": "x"}',  # an id: a correct record
        b'{"id": "t", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"id": "s", "prompt": "x", "seed": -' + b"1" * 100 + b"}",
        _rec(id="p", prompt_token_ids=[1, 2**40]),
        GOOD,
    ]
    js = _jobs(tmp_path, lines)
    b = _by_line(js)
    assert (b[1].id, b[1].error) == ("9" * 5000, None)
    _assert_error(b[2], 2, "max_tokens", "5000 digits")
    _assert_error(b[3], 3, "seed", "100 digits")
    _assert_error(b[4], 4, "prompt_token_ids[1]", str(2**40))
    _assert_good_neighbour(js, 5)


def test_nan_and_infinity_literals(tmp_path):
    lines = [
        b'{"id": "n", "prompt": "x", "temperature": NaN}',
        b'{"id": "i", "prompt": "x", "top_p": Infinity}',
        b'{"id": "m", "prompt": "x", "presence_penalty": -Infinity}',
        b'{"id": "e", "prompt": "x", "min_p": 1e999}',  # overflows to inf in Python's json
        b'{"id": "s", "prompt": "x", "stop": [NaN]}',
        b'{"id": NaN, "prompt": "x"}',
        GOOD,
    ]
    js = _jobs(tmp_path, lines)
    b = _by_line(js)
    _assert_error(b[1], 1, "temperature is NaN")
    _assert_error(b[2], 2, "top_p is Infinity")
    _assert_error(b[3], 3, "presence_penalty is -Infinity")
    _assert_error(b[4], 4, "min_p is Infinity")
    _assert_error(b[5], 5, "stop[0] is NaN")
    _assert_error(b[6], 6, "id must be a string or an integer", "NaN")
    assert b[6].id == "line-6"
    _assert_good_neighbour(js, 7)


def test_duplicate_keys(tmp_path):
    lines = [
        b'{"id": "p", "prompt": "x", "prompt": "y"}',
        b'{"id": "t", "prompt": "x", "temperature": 0, "temperature": 1}',
        b'{"id": "a", "id": "b", "prompt": "x"}',
        b'{"id": "m", "messages": [{"role": "user", "role": "system", "content": "c"}]}',
        GOOD,
    ]
    js = _jobs(tmp_path, lines)
    b = _by_line(js)
    _assert_error(b[1], 1, 'key "prompt" appears twice')
    _assert_error(b[2], 2, 'key "temperature" appears twice')
    _assert_error(b[3], 3, 'key "id" appears twice')
    assert b[3].id == "line-3"  # which id is meant is unknown
    _assert_error(b[4], 4, 'key "role" appears twice in messages[0]')
    _assert_good_neighbour(js, 5)


@pytest.mark.parametrize("bad", [1.5, 2.0, True, False, None, [1], {"a": 1}])
def test_ids_of_other_types_get_a_generated_id(tmp_path, bad):
    js = _jobs(tmp_path, [_rec(id=bad, prompt="x"), GOOD])
    _assert_error(js[0], 1, "id must be a string or an integer", jobs._type(bad))
    assert js[0].id == "line-1"
    _assert_good_neighbour(js, 2)


def test_integer_ids_are_their_decimal_text(tmp_path):
    js = _jobs(tmp_path, [_rec(id=-7, prompt="x"), _rec(id=0, prompt="y"), _rec(prompt="z")])
    assert [(j.id, j.error) for j in js] == [("-7", None), ("0", None), ("2", None)]


@pytest.mark.parametrize(
    "ids, words",
    [
        ([1, True], ["prompt_token_ids[1]", "boolean true"]),
        ([1, 2.0], ["prompt_token_ids[1]", "number 2.0"]),
        ([-1], ["prompt_token_ids[0] = -1", "outside"]),
        ([1, 2**31], ["prompt_token_ids[1]", "outside"]),
        ([1, "2"], ["prompt_token_ids[1]", 'string "2"']),
        ([[1]], ["prompt_token_ids[0]", "array"]),
        ([], ["empty prompt_token_ids"]),
        ("1 2", ["prompt_token_ids must be an array", "string"]),
    ],
)
def test_prompt_token_ids_must_be_integers_in_range(tmp_path, ids, words):
    js = _jobs(tmp_path, [_rec(id="p", prompt_token_ids=ids), GOOD])
    _assert_error(js[0], 1, *words)
    _assert_good_neighbour(js, 2)


@pytest.mark.parametrize(
    "messages, words",
    [
        ("hi", ["messages must be an array", "string"]),
        ([], ["empty messages"]),
        (["hi"], ["messages[0] must be an object", 'string "hi"']),
        ([{"content": "hi"}], ["messages[0].role must be a non-empty string", "null"]),
        ([{"role": 1, "content": "hi"}], ["messages[0].role", "integer 1"]),
        ([{"role": "user"}], ["messages[0] has no content"]),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": 5}],
            ["messages[1].content"],
        ),
        ([{"role": "user", "content": ["text"]}], ["messages[0].content", "content-part"]),
    ],
)
def test_messages_must_be_role_content_objects(tmp_path, messages, words):
    js = _jobs(tmp_path, [_rec(id="m", messages=messages), GOOD])
    _assert_error(js[0], 1, *words)
    _assert_good_neighbour(js, 2)


def test_valid_messages_are_accepted(tmp_path):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]},
        {"role": "assistant", "tool_calls": []},
    ]
    js = _jobs(tmp_path, [_rec(id="m", messages=messages)])
    assert js[0].error is None and js[0].prompt == {"messages": messages}


def test_generated_ids_never_collide_with_a_records_id(tmp_path):
    lines = [
        _rec(id="a", prompt="x"),  # 1
        b"not json",  # 2: would be line-2
        _rec(id="a", prompt="y"),  # 3: repeat, would be a@line-3
        _rec(id="line-2", prompt="z"),  # 4: a record owns line-2
        _rec(id="a@line-3", prompt="w"),  # 5: ... and a@line-3
        _rec(id="line-2~1", prompt="v"),  # 6: ... and line-2~1
        b"[1]",  # 7: line-7, owned by nobody
        _rec(prompt="default id 7"),  # 8: own id "7"
        _rec(id=7, prompt="the same id"),  # 9: repeat of "7"
    ]
    js = _jobs(tmp_path, lines)
    ids = [j.id for j in js]
    assert ids == [
        "a",
        "line-2~2",
        "a@line-3~1",
        "line-2",
        "a@line-3",
        "line-2~1",
        "line-7",
        "7",
        "7@line-9",
    ]
    assert len(set(ids)) == len(ids)
    _assert_error(js[2], 3, "duplicate id 'a'", "first on line 1")
    _assert_error(js[8], 9, "duplicate id '7'", "first on line 8")
    assert [j.error is None for j in js] == [
        True,
        False,
        False,
        True,
        True,
        True,
        False,
        True,
        False,
    ]
    # The ids are a function of the file: the same on every rerun (resume skips them all).
    js2 = _jobs(tmp_path, lines)
    assert [j.id for j in js2] == ids
    run, errors, skipped = jobs.plan(js2, set(ids))
    assert (run, errors, skipped) == ([], [], len(ids))


def test_jsonl_detection_survives_one_bad_line(tmp_path):
    # A .json file of records with one broken line is still JSONL (the broken line is an error);
    # plain text whose lines are not all "{..." stays plain text.
    js = _jobs(tmp_path, [GOOD, b'{"id": "x", "prompt": ', b'{"a": ' + b"[" * 5000], name="p.json")
    assert [j.error is None for j in js] == [True, False, False]
    js = _jobs(tmp_path, [b"{curly} start", b"and text"], name="p.txt")
    assert [j.prompt for j in js] == ["{curly} start", "and text"]


# A fuzz over lines: random bytes, and random JSON values in the fields of a record (every type,
# nesting, NaN/Infinity, huge integers, surrogates). read_jobs never raises, one job per
# non-blank line, every error names its line, ids are unique, every record can be written.
NASTY_CHARS = ["\ud800", "\udfff", "\udcff", "\x00", "\x85", "\u2028", "\ufeff", "\U0001f600"]
_text = st.text(alphabet=st.sampled_from(NASTY_CHARS) | st.characters(), max_size=8)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | _text
)
_values = st.recursive(
    _scalars,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
    max_leaves=8,
)
_fields = st.sampled_from(
    [
        "id",
        "prompt",
        "messages",
        "prompt_token_ids",
        "temperature",
        "top_p",
        "top_k",
        "max_tokens",
        "stop",
        "stop_token_ids",
        "seed",
        "logprobs",
        "ignore_eos",
        "other",
    ]
)
_any_record = st.dictionaries(_fields, _values, max_size=4)
_plausible_record = st.fixed_dictionaries(  # right keys and types, text with nasty characters
    {"prompt": _text},
    optional={
        "id": _text | st.integers(),
        "temperature": st.floats(0, 2),
        "stop": st.lists(_text, max_size=2),
        "max_tokens": st.integers(1, 100),
    },
)
_records = (_any_record | _plausible_record).map(lambda d: json.dumps(d, allow_nan=True).encode())
_lines = st.lists(
    _records
    | st.binary(max_size=40).map(lambda b: b.replace(b"\n", b""))
    | st.builds(
        lambda r, i, b: r[:i] + b + r[i:],
        _records,
        st.integers(0, 50),
        st.sampled_from(
            [b"\xff", b"\x00", b"\xed\xa0\x80", b"\r", b"\xe2\x80\xa8", b"[" * 3000, b"\\ud800"]
        ),
    ),
    min_size=1,
    max_size=8,
)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(lines=_lines, suffix=st.sampled_from([".jsonl", ".txt"]))
def test_fuzz_every_line_is_one_job_and_every_record_writes(tmp_path, lines, suffix):
    js = _jobs(tmp_path, lines, name="p" + suffix)
    lines_text = [ln.removesuffix(b"\r").decode("utf-8", "replace") for ln in lines]
    lines_text[0] = lines_text[0].removeprefix("\ufeff")  # a byte order mark
    nonblank = [i + 1 for i, t in enumerate(lines_text) if t.strip()]
    assert [j.line for j in js] == nonblank
    assert len({j.id for j in js}) == len(js)
    out_path = tmp_path / "out.jsonl"
    out_path.unlink(missing_ok=True)
    out = OutputFile.open(out_path)
    for j in js:
        if j.error is not None:
            assert j.error.startswith(f"line {j.line}: ") and len(j.error) <= 1000, j.error
            rec = cli._error_record(j)
        else:
            assert isinstance(j.prompt, str | dict) and isinstance(j.sampling, dict)
            rec = {"id": j.id, "prompt": j.prompt, "sampling": j.sampling}
        json.dumps(rec, ensure_ascii=False, allow_nan=False).encode("utf-8")  # no surrogate, NaN
        out.write(rec)
    out.close()
    text = out_path.read_bytes().decode("utf-8")  # strict
    assert [json.loads(x)["id"] for x in text.split("\n")[:-1]] == [j.id for j in js]


# ------------------------------------------------------------------------- end to end


def _main(tmp_path, prompts: Path, out: Path | str, *flags: str) -> int:
    return cli.main(
        [
            "generate",
            "--model",
            str(STORIES),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            *ENGINE,
            *flags,
        ]
    )


@pytest.mark.skipif(not STORIES.is_dir(), reason=f"stories260K directory {STORIES} is absent")
def test_good_records_are_the_same_bytes_without_the_bad_lines(tmp_path, capsys):
    good = [
        _rec(id="g0", prompt="Once upon a time", max_tokens=6),
        b'{"id": "g1", "prompt": "Tom\xe2\x80\xa8and Lily", "max_tokens": 5}',  # raw U+2028
        _rec(id="g2", prompt="Lily", max_tokens=7, temperature=0.8, seed=3),
        _rec(id="g3", prompt_token_ids=[1, 300, 301], max_tokens=4),
    ]
    bad = [
        b'{"id": "b0", "prompt": "x", "a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        _rec(id="b1", prompt="\ud800"),
        b'{"id": "b2", "prompt": "caf\xe9"}',
        b"\xff\xfe",
        b'{"id": "b3", "prompt": "x", "top_p": NaN}',
        b'{"id": "b4", "prompt": "x", "prompt": "y"}',
        b'{"id": "b5", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        _rec(id=1.5, prompt="x"),
        _rec(id="b6", prompt_token_ids=[1, True]),
        _rec(id="b7", messages=[{"role": "user"}]),
        b'{"id": "b8", "prompt": "a\x00b"}',
    ]
    mixed = [
        b"\xef\xbb\xbf" + bad[0],
        good[0],
        *bad[1:5],
        good[1] + b"\r",
        *bad[5:8],
        good[2],
        *bad[8:],
        good[3],
        _rec(prompt="default id", max_tokens=3),
    ]
    n_lines = len(mixed)
    clean = [*good, _rec(id=str(n_lines - 1), prompt="default id", max_tokens=3)]
    outs = {}
    for name, lines in [("mixed", mixed), ("clean", clean)]:
        prompts = tmp_path / f"{name}.jsonl"
        prompts.write_bytes(b"\n".join(lines) + b"\n")
        outs[name] = tmp_path / f"{name}.out.jsonl"
        assert _main(tmp_path, prompts, outs[name], "--temperature", "0") == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["completed"] == len(clean) and "error" not in summary

    def good_lines(path):  # the bytes of each good record, timings (metrics) aside
        recs = {}
        for line in path.read_bytes().decode("utf-8").splitlines():
            r = json.loads(line)
            if "error" not in r:
                for k in ("ttft_s", "tpot_s", "e2e_s"):
                    r["metrics"].pop(k)
                recs[r["id"]] = json.dumps(r, ensure_ascii=False, sort_keys=True)
        return recs

    assert good_lines(outs["mixed"]) == good_lines(outs["clean"])
    errs = [json.loads(x) for x in outs["mixed"].read_text().splitlines()]
    errs = [r for r in errs if "error" in r]
    assert len(errs) == len(bad) and summary["prompts"] == len(clean)
    assert sorted(r["id"] for r in errs) == sorted(
        ["line-1", "b1", "b2", "line-5", "b3", "b4", "b5", "line-10", "b6", "b7", "line-14"]
    )
    assert all(r["error"].startswith("line ") for r in errs)
