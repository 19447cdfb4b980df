"""mkdocs hook: replaces ``<!-- help: COMMAND -->`` in a page with what ``jaxinfer COMMAND --help``
prints, taken from the command line of the repository being built, so the option lists in the
manual are the ones the code has (docs/configuration.md)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from pathlib import Path

MARKER = re.compile(r"<!-- help: ([a-z-]+) -->")


def _help(command: str) -> str:
    from jaxinfer.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main([command, "--help"])
    if rc != 0 or not out.getvalue().strip():
        raise RuntimeError(f"`jaxinfer {command} --help` printed nothing (exit status {rc})")
    return out.getvalue().rstrip()


def on_config(config, **kwargs):
    # the jaxinfer of this checkout, whatever else is installed; help wrapped at 100 columns
    sys.path.insert(0, str(Path(config.config_file_path).resolve().parent))
    os.environ["COLUMNS"] = "100"
    return config


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    return MARKER.sub(lambda m: "```text\n" + _help(m.group(1)) + "\n```", markdown)
