"""``jaxinfer.__version__``: the installed package's version (``importlib.metadata``), which
``pyproject.toml`` sets; for a source tree that is not installed, read from that
``pyproject.toml`` itself."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path


def package_version() -> str:
    """The version of the installed ``jaxinfer`` distribution; in a source tree without one,
    ``pyproject.toml``'s ``[project] version``; "0+unknown" when neither is there."""
    try:
        return importlib.metadata.version("jaxinfer")
    except importlib.metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        return tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["version"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "0+unknown"
