"""jaxinfer: a JAX/XLA inference engine for large language models.

The public names below are imported on first use (PEP 562 ``__getattr__``): ``import jaxinfer``
loads no jax, so ``python -m jaxinfer`` / the ``jaxinfer`` command can set up Ctrl-C handling
before jax loads (``jaxinfer.__main__``). ``from jaxinfer import LLM`` works as before.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing
if TYPE_CHECKING:
    from jaxinfer.args import EngineArgs
    from jaxinfer.llm import LLM
    from jaxinfer.loaders import LoadedModel, load
    from jaxinfer.outputs import CompletionOutput, RequestOutput
    from jaxinfer.sampling.params import SamplingParams
    from jaxinfer.sampling.structured_params import GuidedDecodingParams, StructuredOutputsParams

_PUBLIC = {
    "LLM": "jaxinfer.llm",
    "CompletionOutput": "jaxinfer.outputs",
    "EngineArgs": "jaxinfer.args",
    "LoadedModel": "jaxinfer.loaders",
    "RequestOutput": "jaxinfer.outputs",
    "SamplingParams": "jaxinfer.sampling.params",
    "StructuredOutputsParams": "jaxinfer.sampling.structured_params",
    "GuidedDecodingParams": "jaxinfer.sampling.structured_params",
    "load": "jaxinfer.loaders",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LoadedModel",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "__version__",
    "load",
]


def __getattr__(name: str):
    if name == "__version__":  # importlib.metadata is slow to import: on first use too
        from jaxinfer.version import package_version

        globals()[name] = package_version()
        return globals()[name]
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, "__version__"})
