"""Speculative decoding: drafters (draft model, n-gram lookup, Medusa heads), the jitted
draft/verify/accept round with exact rejection sampling, and the strategy an engine core runs it
through between host scheduling steps (``strategy.SpeculativeStrategy``)."""

from jaxinfer.speculative.config import SPECULATIVE_METHODS, SpecConfig

__all__ = ["SPECULATIVE_METHODS", "SpecConfig"]
