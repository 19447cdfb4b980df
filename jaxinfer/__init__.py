"""jaxinfer: a JAX/XLA inference engine for large language models."""

from jaxinfer.args import EngineArgs
from jaxinfer.llm import LLM
from jaxinfer.loaders import LoadedModel, load
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.sampling.params import SamplingParams
from jaxinfer.version import package_version

__version__ = package_version()

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LoadedModel",
    "RequestOutput",
    "SamplingParams",
    "__version__",
    "load",
]
