"""Grammar sources for llguidance: a request's ``StructuredOutputsParams`` as llguidance grammar
text (JSON schema, regex, choice, Lark, vLLM's structural tags), byte forcing turned off for
grammars that force without end, and the llguidance tokenizer of an engine's vocabulary. The
matchers and masks that use them live in ``jaxinfer.sampling.structured``."""

from __future__ import annotations

import json

from jaxinfer.errors import RequestError, TokenizerError
from jaxinfer.sampling.structured_params import StructuredOutputsParams

FORCING_LIMIT = ("Too many items", "ff_tokens")
"""Words of llguidance's error when forcing bytes runs into the parser's item limit
(``step_max_items``; llguidance 1.x: "Too many items (limit 50000; ff_tokens)")."""

NO_FORCING = '%llguidance {"no_forcing": true}\n'
"""The Lark option that turns llguidance's byte forcing off for a whole grammar."""


def is_forcing_limit(error: str) -> bool:
    """Whether an llguidance error is the forcing limit (``FORCING_LIMIT``): a grammar forcing
    bytes without end, not a token the grammar forbids."""
    return all(w in error for w in FORCING_LIMIT)


def without_forcing(source: str) -> str:
    """``source`` (llguidance grammar text: Lark, or its JSON of ``{"grammars": [...]}``) with
    byte forcing off in every grammar: Lark text gets ``NO_FORCING`` in front, a JSON-schema
    grammar becomes the Lark grammar ``start: %json {schema}`` with it (the schema keeps its
    ``x-guidance`` options)."""
    if not source.lstrip().startswith("{"):
        return NO_FORCING + source
    top = json.loads(source)
    for g in top["grammars"]:
        if g.get("lark_grammar") is not None:
            g["lark_grammar"] = NO_FORCING + g["lark_grammar"]
        elif g.get("json_schema") is not None:
            g["lark_grammar"] = NO_FORCING + "start: %json " + json.dumps(g["json_schema"])
            g["json_schema"] = None
    return json.dumps(top)


def llguidance_module():
    """The ``llguidance`` module, imported on first use (only constrained requests need it)."""
    import llguidance

    return llguidance


def _no_additional_properties(schema):
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say
    otherwise (vLLM's ``disable_additional_properties``)."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _json_options(so: StructuredOutputsParams) -> dict:
    opts: dict = {"whitespace_flexible": not so.disable_any_whitespace}
    if so.whitespace_pattern is not None:
        opts["whitespace_pattern"] = so.whitespace_pattern
    return opts


def grammar_source(so: StructuredOutputsParams) -> str:
    """llguidance's grammar text for ``so`` (what vLLM's llguidance backend builds: a JSON schema
    with flexible whitespace unless ``disable_any_whitespace``; ``json_object`` as the schema
    ``{"type": "object"}``; a choice as a Lark alternation of the literal strings; a structural
    tag as llguidance's ``StructTag`` grammar). Checks nothing; ``Grammars.compile`` does.

    Raises:
        RequestError: a structural tag that is not vLLM's ``{"structures": [...], "triggers":
            [...]}`` shape.
    """
    llg = llguidance_module()
    kind = so.kind
    if kind in ("json", "json_object"):
        schema = json.loads(so.json) if kind == "json" else {"type": "object"}
        if so.disable_additional_properties:
            schema = _no_additional_properties(schema)
        return llg.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), overrides=_json_options(so)
        )
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, so.choice)))
    if kind == "grammar":
        return llg.grammar_from("grammar", so.grammar)  # Lark, or GBNF converted to Lark
    return _struct_tag_grammar(so.structural_tag)


def _struct_tag_grammar(spec: str) -> str:
    """vLLM's structural tag (``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``)
    as llguidance's ``StructTag`` grammar, as vLLM's llguidance backend builds it."""
    llg = llguidance_module()

    def fail(msg: str):
        raise RequestError(f"structured_outputs.structural_tag: {msg}")

    try:
        tag = json.loads(spec)
    except ValueError as e:
        fail(f"not valid JSON: {e}")
    if not isinstance(tag, dict) or not isinstance(tag.get("structures"), list):
        fail('expected {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}')
    triggers = tag.get("triggers")
    if not isinstance(triggers, list) or not all(isinstance(t, str) and t for t in triggers):
        fail("triggers must be a list of non-empty strings")
    tags = []
    for i, s in enumerate(tag["structures"]):
        if not isinstance(s, dict) or not all(isinstance(s.get(k), str) for k in ("begin", "end")):
            fail(f"structures[{i}] must have string begin and end")
        trig = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trig is None:
            fail(f"structures[{i}].begin {s['begin']!r} starts with none of the triggers")
        schema = s.get("schema", {})
        if not isinstance(schema, dict | bool):
            fail(f"structures[{i}].schema must be a JSON schema")
        tags.append(llg.StructTag(trigger=trig, begin=s["begin"], grammar=schema, end=s["end"]))
    if not tags:
        fail("structures is empty")
    return llg.StructTag.to_grammar(tags)


def ll_tokenizer(tokenizer, vocab_size: int):
    """llguidance's ``LLTokenizer`` of ``tokenizer`` (``Tokenizer.grammar_vocabulary``) over a
    model vocabulary of ``vocab_size`` ids (ids past the tokenizer's are never allowed); EOS are
    the tokenizer's ``eos_ids``, allowed only where the grammar can end.

    Raises:
        RequestError: the tokenizer cannot describe its tokens (no tokenizer, a duck-typed one).
    """
    llg = llguidance_module()
    get = getattr(tokenizer, "grammar_vocabulary", None)
    try:
        if get is None:
            raise TokenizerError(f"{type(tokenizer).__name__} has no grammar_vocabulary()")
        voc = get()
    except TokenizerError as e:
        raise RequestError(f"structured_outputs needs the model's tokenizer: {e}") from None
    eos = [int(i) for i in tokenizer.eos_ids]
    if not eos:
        raise RequestError(
            "structured_outputs: the tokenizer names no EOS id, so a constrained output could "
            "never end"
        )
    if voc.tokenizer_json is not None:
        return llg.LLTokenizer(voc.tokenizer_json, n_vocab=vocab_size, eos_token=eos)
    tokens = list(voc.token_bytes) + [b""] * max(0, vocab_size - len(voc.token_bytes))
    greedy = _GreedyEncoder(tokens)

    class _Vocab:  # what llguidance's TokenizerWrapper reads
        eos_token_id = eos[0]
        bos_token_id = tokenizer.bos_id
        special_token_ids = list(voc.special_ids)

        def __init__(self):
            self.tokens = tokens

        def __call__(self, text):
            # llguidance tokenizes the bytes a grammar forces with this: it must give back
            # exactly those bytes. SentencePiece's normaliser drops or merges spaces (" " ->
            # no ids), so such texts take a lossless greedy encoding instead.
            data = text if isinstance(text, bytes) else text.encode("utf-8")
            try:
                ids = voc.encode(data.decode("utf-8"))
            except UnicodeDecodeError:
                ids = None
            if ids is None or b"".join(tokens[i] for i in ids) != data:
                ids = greedy.encode(data)
            return ids

    return llg.LLTokenizer(llg.TokenizerWrapper(_Vocab()), n_vocab=vocab_size, eos_token=eos)


class _GreedyEncoder:
    """Longest-match encoding of bytes over a vocabulary's token bytes (lossless where every byte
    has a token: SentencePiece byte fallback, byte-level BPE); bytes without one are skipped."""

    def __init__(self, tokens: list[bytes]):
        self._ids: dict[bytes, int] = {}
        for i, t in enumerate(tokens):
            if t:
                self._ids.setdefault(t, i)
        self._longest = max((len(t) for t in self._ids), default=1)

    def encode(self, data: bytes) -> list[int]:
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                tid = self._ids.get(data[i : i + n])
                if tid is not None:
                    out.append(tid)
                    i += n
                    break
            else:
                i += 1
        return out
