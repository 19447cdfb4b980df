"""Reading ``jaxinfer generate``'s prompts file into jobs: one job per non-blank line, a bad line
becomes one error job naming its line and field, never the end of the run.

Lines are split on ``b"\\n"`` alone (a trailing ``"\\r"`` is dropped), so characters that
``str.splitlines`` also splits on (U+2028, U+0085, U+000B, ...) stay inside their record. Each
line is decoded on its own: a byte that is not UTF-8 fails that line only. A UTF-8 byte order
mark at the start of the file is skipped.

Values. Besides each field's own checks (`SamplingParams`, prompt types), a record is refused,
naming the field, when a string or key holds a lone surrogate (a ``"\\ud800"`` escape, or a byte
that is not UTF-8: it could not be written back as UTF-8), a number is NaN or +-Infinity (which
Python's json accepts, like ``1e999``), an integer has more than `MAX_INT_DIGITS` digits, a key is
given twice, or arrays and objects nest deeper than `MAX_DEPTH`. ``messages`` must be a non-empty
array of objects with a non-empty string ``role`` and a ``content`` that is a string, null or an
array of content-part objects (absent only beside ``tool_calls``); ``prompt_token_ids`` a
non-empty array of integers in [0, `MAX_TOKEN_ID`] (booleans and 1.0 are not integers).

Ids. A record's own id is its ``"id"`` (a string, or an integer written in decimal) or, without
one, its 0-based line number; plain-text lines always use the line number. A line whose id
cannot be read (not JSON, not an object, a bad or repeated ``"id"`` key, ...) and a record that
repeats an earlier record's id get an error record under a generated id: ``"line-<n>"`` and
``"<id>@line-<n>"`` (n the 1-based line). A generated id never equals any record's own id in
the file nor another generated id: when it would, ``"~<k>"`` is appended with the smallest
k >= 1 that makes it unique. Generated ids depend on the whole file, so they are the same on
every rerun of an unchanged file (resume relies on that).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, BinaryIO

from jaxinfer.engine.inputs import unicode_problem
from jaxinfer.errors import RequestError
from jaxinfer.sampling.params import SamplingParams

PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
CONSTRAINT_KEYS = ("structured_outputs", "guided_decoding", "response_format")
"""A record's output constraint (one of them; it replaces ``--json-schema``'s)."""
DUPLICATE_PREFIX = "duplicate id"
"""The error of a repeated input id says this after its line number."""
MAX_LINE_BYTES = 64 * 2**20
"""Longest line read, in bytes (without its newline); a longer one is skipped over without
being held in memory and becomes an error record."""
MAX_DEPTH = 32
"""Deepest nesting of arrays and objects in a record (a chat message with content parts is 4)."""
MAX_INT_DIGITS = 64
"""Longest integer literal kept as a number; a longer one is an error in any field but ``id``."""
MAX_TOKEN_ID = 2**31 - 1
"""Largest prompt token id a record may hold (int32 on device); the vocabulary check is later."""
MAX_MESSAGE_CHARS = 1000
"""Error messages longer than this are cut (a message may quote a record's value)."""


class UsageError(Exception):
    """A bad command line or unreadable file: one line on stderr, exit code 2."""


@dataclasses.dataclass
class Job:
    """One input line: ``prompt`` (for ``LLM.encode_prompt``) and its merged sampling fields,
    or ``error`` (the message of its error record).

    ``id`` is the record's own id, or None until `plan` gives the line a generated one (its
    id could not be read)."""

    id: str | None
    line: int  # 1-based line number in the prompts file
    prompt: str | dict | None = None
    sampling: dict | None = None
    error: str | None = None


@dataclasses.dataclass
class _Line:
    n: int  # 1-based line number
    text: str | None  # decoded (bytes that are not UTF-8 as U+DC80..U+DCFF); None: too long
    bad_byte: tuple[int, int] | None = None  # (byte, offset) of the first byte that is not UTF-8
    length: int = 0  # bytes

    @property
    def blank(self) -> bool:
        return self.text is not None and not self.text.strip()


# ------------------------------------------------------------------------- lines


def _read_lines(f: BinaryIO, max_line_bytes: int) -> list[_Line]:
    lines = []
    n = 0
    while raw := f.readline(max_line_bytes + 2):  # room for "\r\n"
        n += 1
        length = len(raw)
        too_long = len(raw) == max_line_bytes + 2 and not raw.endswith(b"\n")
        rest = raw
        while too_long and rest and not rest.endswith(b"\n"):  # skip it without holding it
            rest = f.readline(1 << 20)
            length += len(rest)
        body = raw.removesuffix(b"\n").removesuffix(b"\r")
        if n == 1:
            body = body.removeprefix(b"\xef\xbb\xbf")  # UTF-8 byte order mark
        if too_long or len(body) > max_line_bytes:
            lines.append(_Line(n, None, length=length))
            continue
        try:
            lines.append(_Line(n, body.decode("utf-8"), length=length))
        except UnicodeDecodeError as e:
            text = body.decode("utf-8", errors="surrogateescape")
            lines.append(_Line(n, text, (body[e.start], e.start), length))
    return lines


def _try_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def _looks_like_jsonl(lines: list[_Line]) -> bool:
    texts = [ln.text.lstrip() for ln in lines if ln.text is not None]
    return all(t.startswith("{") for t in texts) and any(_try_object(t) for t in texts)


def read_jobs(
    path: Path, defaults: dict, *, max_line_bytes: int = MAX_LINE_BYTES
) -> tuple[list[Job], bool]:
    """The prompts file as jobs, one per non-blank line (a bad line becomes a job with
    ``error``); also whether it was read as JSONL: when it ends in ``.jsonl``, or every
    non-blank line starts with ``{`` and one at least is a JSON object.

    Raises:
        UsageError: the file cannot be opened or read.
    """
    try:
        with open(path, "rb") as f:
            lines = [ln for ln in _read_lines(f, max_line_bytes) if not ln.blank]
    except OSError as e:
        raise UsageError(f"cannot read prompts file {path}: {e}") from None
    is_jsonl = path.suffix == ".jsonl" or _looks_like_jsonl(lines)
    parse = _parse_record if is_jsonl else _plain_job
    return [parse(ln, defaults, max_line_bytes) for ln in lines], is_jsonl


def _line_problem(ln: _Line, max_line_bytes: int) -> str | None:
    if ln.text is None:
        return f"line {ln.n}: longer than {max_line_bytes} bytes ({ln.length} bytes); not read"
    if ln.bad_byte is not None:
        byte, offset = ln.bad_byte
        return f"line {ln.n}: not valid UTF-8 (byte 0x{byte:02x} at byte {offset})"
    return None


def _plain_job(ln: _Line, defaults: dict, max_line_bytes: int) -> Job:
    job = Job(id=str(ln.n - 1), line=ln.n)
    job.error = _line_problem(ln, max_line_bytes)
    if job.error is None:
        job.prompt, job.sampling = ln.text, defaults
    return job


# ------------------------------------------------------------------------- records


class _Object(dict):
    """A JSON object; ``repeated`` names the keys given more than once (the last value is kept)."""

    repeated: tuple[str, ...] = ()


def _object(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object()
    repeated = []
    for k, v in pairs:
        if k in obj:
            repeated.append(k)
        obj[k] = v
    if repeated:
        obj.repeated = tuple(dict.fromkeys(repeated))
    return obj


@dataclasses.dataclass(frozen=True)
class _BigInt:
    """An integer literal of more than `MAX_INT_DIGITS` digits, kept as its text."""

    digits: str


def _parse_int(s: str) -> int | _BigInt:
    return _BigInt(s) if len(s.lstrip("-")) > MAX_INT_DIGITS else int(s)


def _type(v: Any) -> str:
    """The JSON name of a parsed value's type."""
    if isinstance(v, bool):
        return "boolean"
    for t, name in (
        (str, "string"),
        (int, "integer"),
        (_BigInt, "integer"),
        (float, "number"),
        (dict, "object"),
        (list, "array"),
    ):
        if isinstance(v, t):
            return name
    return "null" if v is None else type(v).__name__


def _show(v: Any, limit: int = 60) -> str:
    """A short JSON-like rendering of a parsed value, for messages."""
    if isinstance(v, _BigInt):
        return f"an integer of {len(v.digits.lstrip('-'))} digits"
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, list | dict):
        return f"an {_type(v)}"
    s = json.dumps(v)  # ASCII: lone surrogates become \u escapes
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _got(v: Any) -> str:
    """``v`` for a "got ..." message: its JSON type and a short rendering."""
    shown = _show(v)
    return shown if v is None or isinstance(v, list | dict) else f"{_type(v)} {shown}"


def _at(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    name = key if key.isidentifier() else json.dumps(key)
    return f"{path}.{name}" if path else name


def _value_problem(value: Any, path: str, bad_utf8: bool) -> str | None:
    """The first value in document order that no field accepts: a lone surrogate in a string or
    a key, a key given twice, NaN or +-Infinity, an integer of more than `MAX_INT_DIGITS` digits,
    or nesting deeper than `MAX_DEPTH`. Iterative, so any depth json accepted is safe."""
    stack = [(value, path, 1)]
    while stack:
        v, p, depth = stack.pop()
        if isinstance(v, str):
            why = unicode_problem(v, bad_utf8)
            if why:
                return f"{p or 'value'} {why}"
        elif isinstance(v, float) and not math.isfinite(v):
            return f"{p or 'value'} is {_show(v)}; JSON numbers must be finite"
        elif isinstance(v, _BigInt):
            return f"{p or 'value'} is {_show(v)}, out of range"
        elif isinstance(v, list | dict):
            if depth > MAX_DEPTH:
                return f"{p or 'value'} is nested deeper than {MAX_DEPTH} levels"
            if isinstance(v, dict):
                for k in v:
                    why = unicode_problem(k, bad_utf8)
                    if why:
                        return f"a key of {p or 'the record'} {why}"
                if getattr(v, "repeated", ()):
                    return f"key {json.dumps(v.repeated[0])} appears twice in {p or 'the record'}"
                items = [(_at(p, k), x) for k, x in v.items()]
            else:
                items = [(_at(p, i), x) for i, x in enumerate(v)]
            stack.extend((x, q, depth + 1) for q, x in reversed(items))
    return None


def _id_of(rid: Any, bad_utf8: bool) -> tuple[str | None, str | None]:
    """(own id, None) or (None, why the id cannot be used)."""
    if isinstance(rid, str):
        why = unicode_problem(rid, bad_utf8)
        return (None, f"id {why}") if why else (rid, None)
    if isinstance(rid, int) and not isinstance(rid, bool):
        return str(rid), None
    if isinstance(rid, _BigInt):
        return rid.digits, None
    return None, f"id must be a string or an integer, got {_got(rid)}"


def _messages_problem(messages: list) -> str | None:
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            return f"{p} must be an object with role and content, got {_got(m)}"
        role = m.get("role")
        if not isinstance(role, str) or not role:
            return f"{p}.role must be a non-empty string, got {_got(role)}"
        if "content" in m:
            c = m["content"]
            if not (
                c is None
                or isinstance(c, str)
                or (isinstance(c, list) and all(isinstance(x, dict) for x in c))
            ):
                return (
                    f"{p}.content must be a string, null or an array of content-part "
                    f"objects, got {_got(c)}"
                )
        elif "tool_calls" not in m:
            return f"{p} has no content"
    return None


def _token_ids_problem(ids: list) -> str | None:
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            return f"prompt_token_ids[{i}] must be an integer, got {_got(t)}"
        if not 0 <= t <= MAX_TOKEN_ID:
            return f"prompt_token_ids[{i}] = {t} is outside [0, {MAX_TOKEN_ID}]"
    return None


def _clip(msg: str) -> str:
    return msg if len(msg) <= MAX_MESSAGE_CHARS else msg[: MAX_MESSAGE_CHARS - 3] + "..."


def _parse_record(ln: _Line, defaults: dict, max_line_bytes: int = MAX_LINE_BYTES) -> Job:
    """One JSONL line as a job; every problem is the job's error, naming the line and field."""
    n = ln.n
    job = Job(id=None, line=n)  # the id stays None (a generated one) until it has been read
    if ln.text is None:
        job.error = _line_problem(ln, max_line_bytes)
        return job
    bad_utf8 = ln.bad_byte is not None
    try:
        rec = json.loads(ln.text, object_pairs_hook=_object, parse_int=_parse_int)
    except RecursionError:
        job.error = f"line {n}: not valid JSON (nested too deeply to parse)"
        return job
    except ValueError as e:
        job.error = _line_problem(ln, max_line_bytes) or f"line {n}: not valid JSON ({e})"
        return job
    if not isinstance(rec, dict):
        job.error = f"line {n}: expected a JSON object, got {_type(rec)}"
        return job
    if "id" in rec.repeated:
        job.error = f'line {n}: key "id" appears twice'
        return job
    if "id" in rec:
        job.id, why = _id_of(rec.pop("id"), bad_utf8)
        if why:
            job.error = f"line {n}: {why}"
            return job
    else:
        job.id = str(n - 1)
    job.error = _record_problem(rec, bad_utf8)
    if job.error is not None:
        job.error = _clip(f"line {n}: {job.error}")
        return job
    key = next(k for k in PROMPT_KEYS if k in rec)
    value = rec.pop(key)
    job.prompt = value if key == "prompt" else {key: value}
    if any(k in rec for k in CONSTRAINT_KEYS):  # the record's constraint replaces the default
        defaults = {k: v for k, v in defaults.items() if k not in CONSTRAINT_KEYS}
    if "response_format" in rec:
        try:
            so = structured_outputs_of(rec.pop("response_format"))
        except RequestError as e:
            job.error, job.prompt = _clip(f"line {n}: {e}"), None
            return job
        if so is not None:
            if "structured_outputs" in rec or "guided_decoding" in rec:
                job.error, job.prompt = (
                    _clip(f"line {n}: set response_format or structured_outputs, not both"),
                    None,
                )
                return job
            rec["structured_outputs"] = so
    merged = {**defaults, **rec}
    try:
        SamplingParams.from_dict(merged)
    except RequestError as e:
        job.error, job.prompt = _clip(f"line {n}: {e}"), None
        return job
    job.sampling = merged
    return job


def structured_outputs_of(response_format: Any) -> dict | None:
    """OpenAI's ``response_format`` as ``structured_outputs`` fields: ``{"type": "text"}`` ->
    None (no constraint), ``{"type": "json_object"}`` -> ``{"json_object": True}``,
    ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`` ->
    ``{"json": schema}`` (the output always follows the schema: ``strict`` false is not looser).

    Raises:
        RequestError: any other shape, naming the field.
    """

    def fail(msg: str):
        raise RequestError(f"response_format: {msg}")

    if not isinstance(response_format, dict):
        fail(f"expected an object, got {_got(response_format)}")
    kind = response_format.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        fail(f'type must be "text", "json_object" or "json_schema", got {_got(kind)}')
    extra = sorted(set(response_format) - allowed[kind])
    if extra:
        fail(f"unknown field(s) {', '.join(extra)} for type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    js = response_format.get("json_schema")
    if not isinstance(js, dict):
        fail(f"json_schema must be an object with a schema, got {_got(js)}")
    extra = sorted(set(js) - {"name", "schema", "strict", "description"})
    if extra:
        fail(f"json_schema: unknown field(s) {', '.join(extra)}")
    if "name" in js and not isinstance(js["name"], str):
        fail(f"json_schema.name must be a string, got {_got(js['name'])}")
    if "strict" in js and not isinstance(js["strict"], bool | None):
        fail(f"json_schema.strict must be a boolean, got {_got(js['strict'])}")
    schema = js.get("schema")
    if not isinstance(schema, dict | bool):
        fail(f"json_schema.schema must be a JSON schema object, got {_got(schema)}")
    return {"json": schema}


def _record_problem(rec: dict, bad_utf8: bool) -> str | None:
    """What is wrong with a record's fields other than its id, if anything."""
    why = _value_problem(rec, "", bad_utf8)
    if why:
        return why
    given = [k for k in PROMPT_KEYS if k in rec]
    if len(given) != 1:
        return f"a record needs exactly one of {', '.join(PROMPT_KEYS)}" + (
            f", got {', '.join(given)}"
            if given
            else f"; its fields besides id: {', '.join(map(str, rec)) or 'none'}"
        )
    key = given[0]
    value = rec[key]
    if key == "prompt":
        # Empty prompt *text* is valid when the tokenizer adds BOS (llama2.c's unconditional
        # start); the engine rejects a request that ends up with zero tokens.
        return None if isinstance(value, str) else f"prompt must be a string, got {_type(value)}"
    if not isinstance(value, list):
        return f"{key} must be an array, got {_type(value)}"
    if not value:
        return f"empty {key}"
    return _messages_problem(value) if key == "messages" else _token_ids_problem(value)


# ------------------------------------------------------------------------- ids


def _fresh(base: str, taken: set[str]) -> str:
    candidate, k = base, 0
    while candidate in taken:
        k += 1
        candidate = f"{base}~{k}"
    taken.add(candidate)
    return candidate


def plan(jobs: list[Job], done_ids: set[str]) -> tuple[list[Job], list[Job], int]:
    """(jobs to generate, error jobs to write, number skipped as already in the output file).

    Gives each job whose id could not be read the id ``"line-<n>"``, and makes a repeated id an
    error job with the id ``"<id>@line-<n>"``; either gets ``"~<k>"`` appended if another record
    owns that id (see the module docstring). Error jobs whose id is in ``done_ids`` are skipped
    like the others."""
    taken = {j.id for j in jobs if j.id is not None}
    seen: dict[str, int] = {}
    run, errors, skipped = [], [], 0
    for job in jobs:
        if job.id is None:
            job.id = _fresh(f"line-{job.line}", taken)
        elif job.id in seen:
            first = seen[job.id]
            job.error = _clip(
                f"line {job.line}: {DUPLICATE_PREFIX} {job.id!r} (first on line {first})"
            )
            job.prompt = job.sampling = None
            # The error record gets its own id, so every id in the output occurs exactly once.
            job.id = _fresh(f"{job.id}@line-{job.line}", taken)
        else:
            seen[job.id] = job.line
        if job.id in done_ids:
            skipped += 1
        elif job.error is not None:
            errors.append(job)
        else:
            run.append(job)
    return run, errors, skipped
