"""Speculative decoding: drafters (draft model, n-gram lookup, Medusa heads), the jitted
draft/verify/accept round with exact rejection sampling, and the engine that runs it between
host scheduling steps."""

from jaxinfer.speculative.config import SPECULATIVE_METHODS, SpecConfig

__all__ = ["SPECULATIVE_METHODS", "SpecConfig"]
