"""Scanning JSON text that may still be growing (a model's output, token by token).

The tool-call parsers read JSON that arrives a few characters at a time: these functions find
where a value ends, or say that the text ends first (``None``), without building Python objects.
They check only what they need to find the ends; a finished value is checked with ``json.loads``
by the caller.
"""

from __future__ import annotations

import json

WHITESPACE = " \t\n\r"
_SCALAR_END = ",}]" + WHITESPACE


def skip_ws(s: str, i: int) -> int:
    """The index of the first non-whitespace character of ``s`` at or after ``i`` (``len(s)``
    when there is none)."""
    n = len(s)
    while i < n and s[i] in WHITESPACE:
        i += 1
    return i


def value_end(s: str, i: int) -> int | None:
    """The end (exclusive) of the JSON value that starts at ``s[i]``, or None when ``s`` ends
    before it does (a scalar that runs to the end of ``s`` counts as unfinished: ``12`` may
    become ``123``).

    Raises:
        ValueError: ``s[i]`` cannot start a JSON value, or a bracket closes the wrong kind.
    """
    n = len(s)
    if i >= n:
        return None
    c = s[i]
    if c == '"':
        j = i + 1
        while j < n:
            if s[j] == "\\":
                j += 2
            elif s[j] == '"':
                return j + 1
            else:
                j += 1
        return None
    if c in "{[":
        stack, j = [], i
        while j < n:
            ch = s[j]
            if ch == '"':
                e = value_end(s, j)
                if e is None:
                    return None
                j = e
                continue
            if ch in "{[":
                stack.append("}" if ch == "{" else "]")
            elif ch in "}]":
                if not stack or stack.pop() != ch:
                    raise ValueError(f"unbalanced {ch!r} at {j}")
                if not stack:
                    return j + 1
            j += 1
        return None
    if c in "-0123456789tfn":
        j = i
        while j < n and s[j] not in _SCALAR_END:
            j += 1
        return None if j == n else j
    raise ValueError(f"{c!r} at {i} does not start a JSON value")


def scan_object(s: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The members of the JSON object starting at ``s[i]`` (``"{"``) found so far: key ->
    (start of its value, end of its value or None while unfinished), and the object's end
    (exclusive), None while it is unfinished. A key whose value has not started is absent.

    Raises:
        ValueError: the text is not a JSON object (a member without a quoted key or a colon,
            a bad value).
    """
    if s[i] != "{":
        raise ValueError(f"expected '{{' at {i}")
    members: dict[str, tuple[int, int | None]] = {}
    n, j = len(s), skip_ws(s, i + 1)
    while True:
        if j >= n:
            return members, None
        if s[j] == "}":
            return members, j + 1
        if s[j] == ",":
            j = skip_ws(s, j + 1)
            continue
        if s[j] != '"':
            raise ValueError(f"expected a key at {j}")
        kend = value_end(s, j)
        if kend is None:
            return members, None
        key = json.loads(s[j:kend])
        j = skip_ws(s, kend)
        if j >= n:
            return members, None
        if s[j] != ":":
            raise ValueError(f"expected ':' at {j}")
        j = skip_ws(s, j + 1)
        if j >= n:
            return members, None
        vend = value_end(s, j)
        members[key] = (j, vend)
        if vend is None:
            return members, None
        j = skip_ws(s, vend)


def held_prefix(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``marker``: the
    characters a stream holds back because they may be the start of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
