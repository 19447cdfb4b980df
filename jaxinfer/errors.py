"""Exceptions raised on bad input. Messages name the file, tensor or field and what was expected."""


class JaxinferError(Exception):
    """Base class of the engine's input errors."""


class CheckpointError(JaxinferError, ValueError):
    """A checkpoint or config file is missing, truncated, or does not match the architecture."""


class TokenizerError(JaxinferError, ValueError):
    """A tokenizer file is missing, unreadable, or does not match the model's vocabulary."""


class RequestError(JaxinferError, ValueError):
    """A generation request is invalid (empty prompt, too long, bad sampling value)."""


class KernelBuildError(JaxinferError, RuntimeError):
    """A native kernel asked for by name cannot be built or loaded here (no C++ compiler, a failed
    build, an unloadable library); the message says why and which implementation needs none."""


class ShardingError(JaxinferError, ValueError):
    """A model cannot be split as asked (the message names the sizes) or the mesh is impossible."""
