"""The speculative decoding configuration (a frozen, hashable dataclass)."""

from __future__ import annotations

import dataclasses

SPECULATIVE_METHODS = ("draft-model", "ngram", "heads")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """How drafts are proposed.

    Attributes:
        method: "draft-model" (a smaller model with the same tokenizer and its own paged KV
            cache), "ngram" (prompt lookup on the host) or "heads" (Medusa heads on the target's
            last hidden state).
        num_speculative_tokens: R, draft tokens proposed per sequence and round.
        ngram_max: longest suffix n-gram looked up (ngram method), tokens.
        ngram_min: shortest suffix n-gram looked up (ngram method), tokens.

    Raises:
        ValueError: unknown method, R < 1 or a bad n-gram range.
    """

    method: str
    num_speculative_tokens: int = 4
    ngram_max: int = 3
    ngram_min: int = 1

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative={self.method!r} is not available; supported: {SPECULATIVE_METHODS}"
            )
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}"
            )
