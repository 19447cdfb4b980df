"""A scanner of JSON text for the structured-output tests, written apart from the `json` module
and the grammar library: where whitespace stands outside strings."""

from __future__ import annotations

JSON_WHITESPACE = " \t\n\r"
"""RFC 8259's insignificant whitespace."""


def whitespace_outside_strings(text: str) -> list[int]:
    """Indices of the whitespace characters of ``text`` that are not inside a JSON string
    (between quotes, with backslash escapes skipped); [] for compact JSON."""
    found, in_string, i = [], False, 0
    while i < len(text):
        c = text[i]
        if in_string:
            if c == "\\":
                i += 1  # the escaped character, a quote included
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in JSON_WHITESPACE:
            found.append(i)
        i += 1
    return found
