"""jaxinfer: a JAX/XLA inference engine for large language models."""

from jaxinfer.llm import LLM
from jaxinfer.loaders import LoadedModel, load
from jaxinfer.outputs import CompletionOutput, RequestOutput
from jaxinfer.sampling.params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "LoadedModel", "RequestOutput", "SamplingParams", "load"]
