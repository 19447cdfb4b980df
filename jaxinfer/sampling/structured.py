"""Structured outputs on the host: grammars compiled by llguidance, one matcher per request, and
the packed allowed-token bitmask of each constrained row (issue 31). The grammar text of a
request and the llguidance tokenizer come from ``jaxinfer.sampling.grammar_source``.

The grammar library is llguidance (the Rust engine behind ``guidance``, one of vLLM's structured
output backends), rather than xgrammar, for three reasons:

- mask cost on CPU: llguidance computes a mask lazily, walking the token trie with the lexer's
  DFA and the Earley parser, without precomputing per-state token tables; on stories260K a mask
  costs about 10 µs per token per row (docs/structured_output.md has the figures), so the host
  finishes the next step's masks well inside a decode step;
- coverage: JSON schema (with ``$ref``, ``anyOf`` / ``oneOf``, ``pattern``, numeric bounds,
  ``minItems`` / ``maxItems``, ``additionalProperties``; an unsupported keyword is an error, not
  silently ignored), regex, Lark grammars (with embedded JSON schemas and lazy lexemes, on which
  vLLM's structural tags are built) and choices in one grammar language;
- weight: one wheel (a Rust extension and a few Python files) with no Python dependencies (no
  torch, no transformers), imported by the engine for any tokenizer (its own
  ``TokenizerWrapper`` takes our token bytes; a Hugging Face ``tokenizer.json`` is read
  directly).

What lives here: ``Grammars`` (an engine's compiler: the llguidance tokenizer of its vocabulary
and an LRU cache of compiled grammars keyed by the request's ``StructuredOutputsParams``, which
holds the kind and the spec; one ``Grammars`` per tokenizer), ``GrammarMatcher`` (a request's
parser state: ``accept`` each sampled token, ``done`` when the grammar is complete) and
``Grammars.fill_bitmask`` (the step's masks, int32[B, W], W = ceil(V / 32): bit ``t % 32`` of word
``t // 32`` set when token t is allowed, llguidance's and xgrammar's layout). The device applies
the mask before sampling (``jaxinfer.sampling.sampler.apply_token_bitmask``).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import numpy as np

from jaxinfer.errors import RequestError
from jaxinfer.sampling.grammar_source import (
    grammar_source,
    is_forcing_limit,
    ll_tokenizer,
    llguidance_module,
    without_forcing,
)
from jaxinfer.sampling.structured_params import StructuredOutputsParams

WORD_BITS = 32
"""Tokens per word of the packed bitmask."""

CACHE_SIZE = 256
"""Compiled grammars an engine keeps (least recently used dropped first)."""


def bitmask_words(vocab_size: int) -> int:
    """W, the int32 words of one row's bitmask: ceil(vocab_size / 32)."""
    return -(-vocab_size // WORD_BITS)


def full_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """int32[rows, W] with every bit set: every token allowed (an unconstrained row's mask)."""
    return np.full((rows, bitmask_words(vocab_size)), -1, np.int32)


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """bool[B, V] of an int32[B, W] bitmask (numpy; tests and checks)."""
    words = np.ascontiguousarray(bitmask, np.int32).view(np.uint8)
    bits = np.unpackbits(words, axis=-1, bitorder="little")
    return bits[:, :vocab_size].astype(bool)


class GrammarViolation(RuntimeError):
    """A token the request's grammar does not allow reached its matcher. The device mask forbids
    such tokens, so this is a bug (a stale or misapplied mask), never a model's choice."""


class GrammarMatcher:
    """One request's grammar state (an llguidance ``LLMatcher``).

    llguidance forces the bytes a grammar allows alone (the one way on: a JSON key, a literal)
    and tokenizes them canonically. A grammar that forces bytes without end (Lark ``start: "a"
    start``, a schema whose required property is the schema itself) runs its forcing into the
    parser's item limit, and the matcher then fails on the next token though the mask allowed it.
    On that failure, and only on it (``is_forcing_limit``), the request goes on with the same
    grammar compiled without forcing (``%llguidance {"no_forcing": true}``: every tokenization
    of the allowed bytes is allowed), replaying the tokens accepted so far; such a grammar then
    runs to ``max_tokens`` ("length"), every token allowed by it.

    With ``start_after`` (``StructuredOutputsParams.start_after``: a reasoning model's
    end-of-reasoning marker) the grammar is dormant, its row unmasked, until the output ends
    with those ids, and then starts at its beginning; with ``reasoning_start`` too, the first
    output token decides: that id opens the reasoning (dormant), any other is the grammar's
    first token (the first mask allows both).

    Attributes:
        field: the constraint's field (``structured_outputs.json``, ...) for messages.
        num_accepted: tokens the grammar accepted (0 while it is dormant).
        num_seen: output tokens seen, the dormant ones included.
        unforced: True once the request runs its grammar without forcing.
        active: the grammar applies (False while it waits for ``start_after``).
    """

    def __init__(
        self,
        matcher,
        field: str,
        unforced: Callable[[], object] | None = None,
        start_after: tuple[int, ...] | None = None,
        reasoning_start: int | None = None,
    ):
        self._m = matcher
        self.field = field
        self.num_accepted = 0
        self.num_seen = 0
        self._tokens: list[int] = []  # accepted by _m (replayed into an unforced matcher)
        self._make_unforced = unforced
        self.unforced = False
        self._marker = tuple(start_after) if start_after else None
        self._opener = reasoning_start
        self._tail: list[int] = []  # dormant: the last output ids, up to len(_marker)
        self.active = self._marker is None

    @property
    def needs_mask(self) -> bool:
        """The next token is masked: the grammar is active, or the first token decides."""
        return self.active or (self._opener is not None and self.num_seen == 0)

    @property
    def opener(self) -> int | None:
        """The id the next mask also allows (``reasoning_start`` before the first token)."""
        return self._opener if not self.active and self.num_seen == 0 else None

    def _wait(self, token: int) -> bool:
        """Dormant: notes an output token; True when the grammar stays dormant for it (the
        first token is ``reasoning_start`` or, with none, anything; the marker starts the
        grammar after it)."""
        first, self.num_seen = self.num_seen == 0, self.num_seen + 1
        if first and self._opener is not None and token != self._opener:
            self.active = True  # no reasoning: this token is the grammar's first
            return False
        self._tail = (self._tail + [token])[-len(self._marker) :]
        self.active = tuple(self._tail) == self._marker
        return True

    @property
    def llmatcher(self):
        """The llguidance ``LLMatcher`` (tests compare masks against the library's own)."""
        return self._m

    def _go_unforced(self) -> bool:
        """Replaces a matcher stopped by the forcing limit with the grammar without forcing,
        replaying the accepted tokens. False: not that failure (or no unforced grammar)."""
        if self.unforced or self._make_unforced is None:
            return False
        if not is_forcing_limit(self._m.get_error()):
            return False
        m = self._make_unforced()
        if self._tokens and not m.consume_tokens(self._tokens):
            return False  # cannot happen: the same bytes, any tokenization allowed
        self._m, self.unforced = m, True
        return True

    def accept(self, token: int) -> None:
        """Advances the state by one sampled token.

        Raises:
            GrammarViolation: the grammar does not allow ``token`` here, or llguidance gave up
                on the grammar before it (a limit of its parser: the message says which).
        """
        if not self.active:
            if self._wait(int(token)):
                return
        else:
            self.num_seen += 1
        at = self.num_seen - 1  # the token's output index
        if self._m.is_error() and not self._go_unforced():
            error = self._m.get_error()
            if error.startswith("NoExtensionBias"):  # its last mask allowed nothing
                raise GrammarViolation(
                    f"{self.field}: the grammar allows no token at output index {at}, not "
                    "even EOS: no sentence of it starts with the output so far (a rule that "
                    "never ends)"
                )
            raise GrammarViolation(
                f"{self.field}: the grammar engine (llguidance) failed at output index "
                f"{at}: {_first_lines(error, 2)}"
            )
        if not self._m.consume_token(int(token)) and not (
            self._go_unforced() and self._m.consume_token(int(token))
        ):
            raise GrammarViolation(
                f"{self.field}: token {int(token)} at output index {at} is not "
                f"allowed by the grammar (the device mask should have forbidden it): "
                f"{self._m.get_error().splitlines()[0] if self._m.get_error() else ''}"
            )
        self._tokens.append(int(token))
        self.num_accepted += 1

    def check_mask(self) -> bool:
        """After a mask computation: True when it stopped the matcher on the forcing limit and
        the matcher now runs unforced (its mask must be computed again)."""
        return self._m.is_error() and self._go_unforced()

    @property
    def done(self) -> bool:
        """The grammar is complete: no token but EOS may follow (the request finishes "stop")."""
        return self.active and self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """The output so far is a complete match (EOS is allowed now)."""
        return self.active and self._m.is_accepting()


class Grammars:
    """An engine's grammar compiler (module docstring): the llguidance tokenizer of its
    vocabulary, built on first use, and compiled grammars cached by constraint.

    Args:
        tokenizer: the engine's ``Tokenizer``.
        vocab_size: V, the model's vocabulary (logits width).
        cache_size: compiled grammars kept.
        num_threads: llguidance's mask threads (``LLExecutor``; None: its default, 80% of the
            CPUs up to 32).
    """

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE, num_threads=None):
        self.tokenizer, self.vocab_size, self.cache_size = tokenizer, vocab_size, cache_size
        self._num_threads = num_threads
        self._ll_tok = None
        self._executor = None
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()  # validation may run on a server thread
        self.num_compiled = 0  # grammars compiled (cache misses)

    @property
    def ll_tokenizer(self):
        """The llguidance ``LLTokenizer`` (built once). Raises RequestError (``ll_tokenizer``)."""
        if self._ll_tok is None:
            self._ll_tok = ll_tokenizer(self.tokenizer, self.vocab_size)
        return self._ll_tok

    def compile(self, so: StructuredOutputsParams, *, forcing: bool = True):
        """A fresh llguidance matcher of ``so``'s grammar, from the cache or compiled;
        ``forcing=False``: the grammar without byte forcing (``without_forcing``).

        Raises:
            RequestError: the schema, regex or grammar is invalid or uses what llguidance does
                not support (an unknown JSON-schema keyword, a bad regex, an undefined Lark
                rule); the message names the field (``structured_outputs.json``, ...).
        """
        field = f"structured_outputs.{so.kind}"
        so = so.grammar_only
        key = so if forcing else ("no_forcing", so)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit.deep_copy()
        llg = llguidance_module()
        source = grammar_source(so)
        if not forcing:
            source = without_forcing(source)
        matcher = llg.LLMatcher(self.ll_tokenizer, source, log_level=0)
        if matcher.is_error():
            raise RequestError(f"{field}: {_first_lines(matcher.get_error())}")
        probe = matcher.deep_copy()  # the first mask: does any output start?
        probe.compute_bitmask()
        if probe.is_error() and not is_forcing_limit(probe.get_error()):
            raise RequestError(
                f"{field}: the grammar matches no output: no token may start it, not even EOS "
                f"(a rule that never ends, an empty language): {_first_lines(probe.get_error(), 1)}"
            )
        with self._lock:
            self.num_compiled += 1
            self._cache[key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher.deep_copy()

    def check(self, so: StructuredOutputsParams) -> None:
        """Compiles ``so`` (cached) and checks its token ids against the vocabulary.

        Raises:
            RequestError: as ``compile``; a ``start_after`` or ``reasoning_start`` id outside
                the model's vocabulary [0, V).
        """
        ids = {"start_after": so.start_after or (), "reasoning_start": (so.reasoning_start,)}
        for name, vals in ids.items():
            bad = [i for i in vals if i is not None and i >= self.vocab_size]
            if bad:
                raise RequestError(
                    f"structured_outputs.{name}: token id {bad[0]} is outside the model's "
                    f"vocabulary (ids 0 to {self.vocab_size - 1})"
                )
        self.compile(so)

    def matcher(self, so: StructuredOutputsParams) -> GrammarMatcher:
        """A new request's matcher at the grammar's start (dormant with ``start_after``).
        Raises RequestError as ``compile``."""
        return GrammarMatcher(
            self.compile(so),
            f"structured_outputs.{so.kind}",
            unforced=lambda: self.compile(so, forcing=False),
            start_after=so.start_after,
            reasoning_start=so.reasoning_start,
        )

    def fill_bitmask(self, rows: list[tuple[GrammarMatcher, int]], bitmask: np.ndarray) -> None:
        """Writes each matcher's allowed tokens into row r of ``bitmask`` (int32[B, W], C
        contiguous; the other rows, and those of dormant grammars (``start_after``), are left
        as they are), on llguidance's threads.

        Raises:
            ValueError: ``bitmask`` of the wrong dtype, shape or layout, or a row out of range.
        """
        b, w = bitmask.shape
        if bitmask.dtype != np.int32 or w != bitmask_words(self.vocab_size):
            raise ValueError(
                f"fill_bitmask: expected int32[B, {bitmask_words(self.vocab_size)}], got "
                f"{bitmask.dtype}{list(bitmask.shape)}"
            )
        if not bitmask.flags["C_CONTIGUOUS"]:
            raise ValueError("fill_bitmask: the bitmask must be C contiguous")
        if any(not 0 <= r < b for _, r in rows):
            raise ValueError(f"fill_bitmask: a row outside [0, {b})")
        rows = [(m, r) for m, r in rows if m.needs_mask]  # a dormant grammar: row left free
        if not rows:
            return
        if len(rows) == 1:
            m, r = rows[0]
            row = bitmask[r]
            m.llmatcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        else:
            if self._executor is None:
                self._executor = llguidance_module().LLExecutor(num_threads=self._num_threads)
            self._executor.unsafe_compute_mask_ptr(
                [(m.llmatcher, r) for m, r in rows], bitmask.ctypes.data, w * 4, b
            )
        for m, r in rows:  # a mask that hit the forcing limit: again, unforced
            if m.check_mask():
                row = bitmask[r]
                m.llmatcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            if m.opener is not None:  # the first token may open the reasoning instead
                bitmask[r].view(np.uint32)[m.opener // WORD_BITS] |= np.uint32(
                    1 << (m.opener % WORD_BITS)
                )


def _first_lines(msg: str, n: int = 5) -> str:
    """The first ``n`` lines of an llguidance error (it appends the parser state and grammar)."""
    lines = [ln for ln in msg.strip().splitlines() if ln.strip()]
    return " ".join(lines[:n]) if lines else "invalid grammar"
