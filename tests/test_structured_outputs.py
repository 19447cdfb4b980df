"""Structured outputs (issue 31) on stories260K, a model that knows nothing of JSON: only the mask
makes its outputs valid. Outputs are judged by outside parsers (``jsonschema``, ``re``, ``lark``),
the engine's masks by llguidance's own mask computation over a vocabulary built here from the
SentencePiece model, and unconstrained rows by a run without any constraint."""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import llguidance
import llguidance.numpy as llnp
import numpy as np
import pytest
from json_text import whitespace_outside_strings

from jaxinfer import SamplingParams, StructuredOutputsParams
from jaxinfer.engine.intake import check_structured
from jaxinfer.engine.resume import ResumeState
from jaxinfer.errors import RequestError

PROMPT = "Once upon a time"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5, "multipleOf": 0.25},
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
            "minItems": 1,
            "maxItems": 3,
        },
        "pos": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -5, "maximum": 5},
                "ok": {"type": "boolean"},
            },
            "required": ["x", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "color", "tags", "pos"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,6}( [A-Z][a-z]{0,4}){0,2}"
CHOICES = ["yes", "no", "maybe so"]
LARK = r"""
start: greeting " " name "!" (" " greeting)?
greeting: "hi" | "hello" | "good day"
name: WORD ("-" WORD)?
WORD: /[a-z]{1,6}/
"""


def _json(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True, **kw)


def test_200_json_samples_validate(stories_llm):
    """Temperature 1.0, 200 seeds (the issue's count; the engine runs 32 sequences at a time, so
    rows are admitted while constrained rows decode): every output parses and validates against
    the nested schema with ``jsonschema``, finishing "stop", keys in the schema's order."""
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=300, structured_outputs=_json())
        for i in range(200)
    ]
    outs = stories_llm.generate([PROMPT] * len(params), params)
    for o in outs:
        assert o.error is None and o.finish_reason == "stop", (o.finish_reason, o.text)
        obj = json.loads(o.text)
        jsonschema.validate(obj, SCHEMA)
        assert list(obj) == [k for k in SCHEMA["properties"] if k in obj]  # the schema's order


SPACED = {  # strings may hold spaces: only the whitespace between JSON tokens is banned
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,8}$"},
        "n": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "maxItems": 3,
        },
    },
    "required": ["name", "n"],
    "additionalProperties": False,
}


def test_disable_any_whitespace_leaves_none_outside_strings(stories_llm):
    """With disable_any_whitespace every output validates and holds no whitespace outside its
    strings (a scanner of its own judges, beside ``json`` and ``jsonschema``); the same seeds
    without it pad with whitespace (the check sees it)."""
    seeds = range(8)
    params = [
        SamplingParams(
            temperature=1.0,
            seed=s,
            max_tokens=60,
            structured_outputs=StructuredOutputsParams(json=SPACED, disable_any_whitespace=off),
        )
        for off in (True, False)
        for s in seeds
    ]
    outs = stories_llm.generate([PROMPT] * len(params), params)
    compact, loose = outs[: len(seeds)], outs[len(seeds) :]
    for o in compact:
        assert o.finish_reason == "stop", o.text
        assert whitespace_outside_strings(o.text) == [], o.text
        jsonschema.validate(json.loads(o.text), SPACED)
    assert any(whitespace_outside_strings(o.text) for o in loose), [o.text for o in loose]
    assert whitespace_outside_strings('{"a b": [1, "c\\" d"]}') == [7, 11]  # the scanner


def test_regex_choice_and_lark_outputs_parse(stories_llm):
    kinds = [
        StructuredOutputsParams(regex=REGEX),
        StructuredOutputsParams(choice=CHOICES),
        StructuredOutputsParams(grammar=LARK),
        # whitespace between JSON tokens as a pattern says (the default, any whitespace, lets
        # this model pad without end)
        StructuredOutputsParams(
            json={"type": "array", "items": {"enum": [1, 2]}, "maxItems": 3},
            whitespace_pattern="[ ]{0,2}",
        ),
    ]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_outputs=k)
        for k in kinds
        for i in range(24)
    ]
    outs = stories_llm.generate([PROMPT] * len(params), params)
    parser = lark.Lark(LARK)
    for p, o in zip(params, outs, strict=True):
        assert o.error is None and o.finish_reason == "stop", (o.finish_reason, o.text)
        kind = p.structured_outputs.kind
        if kind == "regex":
            assert re.fullmatch(REGEX, o.text), o.text
        elif kind == "choice":
            assert o.text in CHOICES
        elif kind == "grammar":
            parser.parse(o.text)
        else:
            assert set(json.loads(o.text)) <= {1, 2} and "  " * 2 not in o.text
    assert len({o.text for o in outs[:24]}) > 5  # the model still chooses


def test_unconstrained_rows_are_untouched(stories_llm):
    """Seeded and greedy unconstrained rows (one with logprobs) beside constrained ones give the
    tokens of the same batch run with every constraint removed."""
    free = [
        SamplingParams(temperature=0.9, seed=7, max_tokens=40),
        SamplingParams(temperature=0.0, max_tokens=40),
        SamplingParams(temperature=0.7, seed=8, top_k=20, logprobs=2, max_tokens=40),
    ]
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=150, structured_outputs=_json())
        for i in range(3)
    ] + [SamplingParams(temperature=0.0, max_tokens=150, structured_outputs=_json())]
    prompts = [PROMPT, "Lily saw", "The dog"] + [PROMPT] * 4
    mixed = stories_llm.generate(prompts, free + constrained)
    plain = stories_llm.generate(
        prompts,
        free + [SamplingParams(**{**_fields(p), "structured_outputs": None}) for p in constrained],
    )
    for a, b in zip(mixed[:3], plain[:3], strict=True):
        assert a.token_ids == b.token_ids
    assert all(o.finish_reason == "stop" for o in mixed[3:]), [o.text for o in mixed[3:]]
    assert [o.token_ids for o in mixed[3:]] != [o.token_ids for o in plain[3:]]


def _fields(p: SamplingParams) -> dict:
    import dataclasses

    return {
        f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name != "guided_decoding"
    }


def _reference_tokenizer(tok_model) -> llguidance.LLTokenizer:
    """llguidance's tokenizer of tok512.model, from the SentencePiece model alone."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(tok_model))
    unk = len(sp.encode("<unk>"))

    class Vocab:
        eos_token_id, bos_token_id = sp.eos_id(), sp.bos_id()
        special_token_ids = [sp.unk_id(), sp.bos_id(), sp.eos_id()]
        tokens = [
            b""
            if sp.is_control(i) or sp.is_unknown(i)
            else bytes([int(sp.id_to_piece(i)[3:5], 16)])
            if sp.is_byte(i)
            else sp.id_to_piece(i).replace("\u2581", " ").encode()
            for i in range(sp.get_piece_size())
        ]

        def __call__(self, s):
            # SentencePiece drops spaces (" " -> []); llguidance needs a lossless encoding
            data = s if isinstance(s, bytes) else s.encode()
            ids = sp.encode("<unk>" + data.decode("utf-8", "replace"))[unk:]
            if b"".join(self.tokens[i] for i in ids) == data:
                return ids
            out, i = [], 0  # else longest match over the pieces' bytes
            while i < len(data):
                n = max(n for n in range(1, len(data) - i + 1) if data[i : i + n] in ids_of)
                out.append(ids_of[data[i : i + n]])
                i += n
            return out

    ids_of: dict[bytes, int] = {}
    for i, t in enumerate(Vocab.tokens):
        if t:
            ids_of.setdefault(t, i)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab()), n_vocab=512)


def test_engine_masks_equal_llguidances(stories_llm, stories_dir, monkeypatch):
    """Every mask the engine ships equals llguidance's own mask of the same state (the output's
    first k tokens), computed here with the library's API alone; EOS only where it can end."""
    eng = stories_llm.engine
    seen: list[tuple[object, int, np.ndarray]] = []
    made = []
    matcher, fill = eng.grammars.matcher, eng.grammars.fill_bitmask

    def spy_matcher(so):
        made.append(matcher(so))
        return made[-1]

    def spy_fill(rows, bitmask):
        fill(rows, bitmask)
        seen.extend((m, m.num_accepted, bitmask[r].copy()) for m, r in rows)

    monkeypatch.setattr(eng.grammars, "matcher", spy_matcher)
    monkeypatch.setattr(eng.grammars, "fill_bitmask", spy_fill)
    kinds = [
        ("json", json.dumps(SCHEMA), _json()),
        ("regex", REGEX, StructuredOutputsParams(regex=REGEX)),
        ("lark", LARK, StructuredOutputsParams(grammar=LARK)),
    ]
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured_outputs=so)
        for _, _, so in kinds
        for s in range(2)
    ]
    outs = stories_llm.generate([PROMPT] * len(params), params)
    llt = _reference_tokenizer(stories_dir / "tok512.model")
    checked = 0
    for i, o in enumerate(outs):
        fmt, text, _ = kinds[i // 2]
        if fmt == "json":  # disable_any_whitespace: no whitespace between JSON tokens
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                text, overrides={"whitespace_flexible": False}
            )
        else:
            grammar = llguidance.grammar_from(fmt, text)
        ref = llguidance.LLMatcher(llt, grammar)
        masks = {k: m for g, k, m in seen if g is made[i]}
        assert sorted(masks) == list(range(len(o.token_ids))), (o.token_ids, sorted(masks))
        want = llnp.allocate_token_bitmask(1, 512)
        for k, tok in enumerate(o.token_ids):
            llnp.fill_next_token_bitmask(ref, want)
            assert np.array_equal(masks[k], want[0]), (fmt, k)
            eos_ok = bool((want[0][2 // 32] >> 2) & 1)
            assert eos_ok == ref.is_accepting()
            assert ref.consume_token(tok)
            checked += 1
        assert ref.is_stopped() or ref.is_accepting()
    assert checked > 100


@pytest.mark.parametrize(
    "so, field, words",
    [
        (dict(json={"type": "strin"}), "structured_outputs.json", "strin"),
        (
            dict(json={"type": "object", "unevaluatedProperties": False}),
            "structured_outputs.json",
            "unevaluatedProperties",
        ),
        (dict(regex="a(b"), "structured_outputs.regex", "unclosed group"),
        (dict(grammar="start: foo"), "structured_outputs.grammar", "foo"),
    ],
)
def test_bad_constraints_fail_their_request_only(stories_llm, so, field, words):
    bad = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(**so))
    good = SamplingParams(temperature=0.0, max_tokens=5)
    outs = stories_llm.generate([PROMPT, PROMPT], [bad, good])
    assert outs[0].error is not None and field in outs[0].error and words in outs[0].error
    assert outs[1].error is None and len(outs[1].token_ids) == 5
    with pytest.raises(RequestError, match=re.escape(field)):
        stories_llm.engine.validate([1, 2], bad)


def test_refused_combinations():
    p = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"))
    with pytest.raises(RequestError, match="speculative decoding"):
        check_structured(p, lambda so: None, "speculative decoding")
    q = SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(RequestError, match="min_tokens"):
        check_structured(q, lambda so: None, None)


def test_endless_grammar_finishes_length_and_ends_early_when_complete(stories_llm):
    endless = StructuredOutputsParams(grammar='start: x\nx: ("a" | "b") x')
    done = StructuredOutputsParams(choice=["yes"])
    outs = stories_llm.generate(
        [PROMPT, PROMPT],
        [
            SamplingParams(temperature=1.0, seed=1, max_tokens=12, structured_outputs=endless),
            SamplingParams(temperature=1.0, seed=1, max_tokens=12, structured_outputs=done),
        ],
    )
    assert outs[0].finish_reason == "length" and set(outs[0].text) <= {"a", "b"}
    assert outs[1].finish_reason == "stop" and outs[1].text == "yes"
    assert 2 not in outs[1].token_ids  # the complete grammar ends it: no EOS sampled


RECURSIVE = {  # every object must hold another: {"a":{"a":... without end
    "type": "object",
    "properties": {"a": {"$ref": "#"}},
    "required": ["a"],
    "additionalProperties": False,
}


def test_forced_endless_grammars_finish_length(stories_llm, stories_dir):
    """Grammars that force their bytes without end (llguidance's forcing runs into its item
    limit) run to max_tokens ("length"), every token allowed: the text is a prefix of the only
    sentence, lark's parser takes it, and llguidance's own matcher (byte forcing off, built here)
    consumes the tokens. Grammars with no sentence are refused up front, or fail their request
    with a message where the output reaches a dead end; the engine serves the next request."""
    grammars = [
        ('start: "a" "b" start', lambda t: "ab" * 64, True),
        ('start: "x" b\nb: "yz" b', lambda t: "x" + "yz" * 64, False),
        (None, lambda t: '{"a":' * 64, False),
    ]
    params = [
        SamplingParams(
            temperature=1.0,
            seed=s,
            max_tokens=12,
            structured_outputs=StructuredOutputsParams(grammar=g)
            if g
            else StructuredOutputsParams(json=RECURSIVE, disable_any_whitespace=True),
        )
        for g, _, _ in grammars
        for s in range(2)
    ]
    dead_end = StructuredOutputsParams(grammar='start: "a" b\nb: b "c"')  # nothing after "a"
    params.append(SamplingParams(max_tokens=12, structured_outputs=dead_end))
    *outs, stuck = stories_llm.generate([PROMPT] * len(params), params)
    assert stuck.finish_reason == "error" and stuck.text == "a"
    assert "allows no token at output index 1, not even EOS" in stuck.error
    llt = _reference_tokenizer(stories_dir / "tok512.model")
    for i, o in enumerate(outs):
        g, sentence, single_chars = grammars[i // 2]
        assert o.error is None and o.finish_reason == "length", (o.error, o.text)
        assert len(o.token_ids) == 12 and 2 not in o.token_ids
        assert sentence(o.text).startswith(o.text) and len(o.text) >= 12, o.text
        if single_chars:  # every lark terminal one character: any prefix lexes whole
            lark.Lark(g, parser="lalr").parse_interactive(o.text).exhaust_lexer()
        grammar = (
            llguidance.grammar_from("grammar", g)
            if g
            else "start: %json "
            + json.dumps({**RECURSIVE, "x-guidance": {"whitespace_flexible": False}})
        )
        ref = llguidance.LLMatcher(llt, '%llguidance {"no_forcing": true}\n' + grammar)
        assert ref.consume_tokens(o.token_ids), ref.get_error()
        assert not ref.is_accepting()
    for kind, spec in (("grammar", 'start: start "a"'), ("regex", r"[^\s\S]")):
        so = StructuredOutputsParams(**{kind: spec})
        bad = SamplingParams(max_tokens=5, structured_outputs=so)
        with pytest.raises(RequestError, match=rf"structured_outputs.{kind}: .*matches no output"):
            stories_llm.engine.validate([1, 2], bad)
    nxt = stories_llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert nxt.error is None and len(nxt.token_ids) == 5


def test_n_and_resume_replay_the_grammar(stories_llm):
    sp = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=300, structured_outputs=_json())
    ref = stories_llm.generate([PROMPT], sp)[0]
    for c in ref.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)
    a, b = ref.outputs
    states = [ResumeState(5, tuple(a.token_ids[:9])), ResumeState(6, tuple(b.token_ids[:3]))]
    got = [o for o in stories_llm.generate_stream([PROMPT], sp, resume=[states]) if o.finished]
    assert [c.token_ids for c in got[0].outputs] == [a.token_ids, b.token_ids]
    broken = [ResumeState(5, (400, 401)), ResumeState(6)]
    bad = list(stories_llm.generate_stream([PROMPT], sp, resume=[broken]))
    assert "does not match the request's structured_outputs" in bad[0].error


def test_cli_records_and_json_schema_flag(tmp_path, capsys):
    from conftest import STORIES, STORIES_CLI_FLAGS

    from jaxinfer.cli import main as cli

    schema = tmp_path / "schema.json"
    default = {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 1, "maxItems": 3}
    schema.write_text(json.dumps(default))
    recs = [
        {"id": "default", "prompt": PROMPT},
        {
            "id": "obj",
            "prompt": PROMPT,
            "response_format": {"type": "json_object"},
            "max_tokens": 40,
        },
        {
            "id": "rf",
            "prompt": PROMPT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "c", "strict": True, "schema": {"enum": ["x", "y"]}},
            },
        },
        {"id": "so", "prompt": PROMPT, "structured_outputs": {"regex": "[0-9]{2}"}},
        {"id": "text", "prompt": PROMPT, "response_format": {"type": "text"}, "max_tokens": 3},
        {"id": "bad", "prompt": PROMPT, "response_format": {"type": "xml"}},
        {"id": "badschema", "prompt": PROMPT, "structured_outputs": {"json": {"type": 3}}},
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "out.jsonl"
    rc = cli.main(
        [
            "generate",
            "--model",
            str(STORIES),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--json-schema",
            str(schema),
            "--disable-any-whitespace",
            "--temperature",
            "1",
            "--max-tokens",
            "60",
            *STORIES_CLI_FLAGS,
        ]
    )
    assert rc == 0, capsys.readouterr().err
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    jsonschema.validate(json.loads(got["default"]["text"]), default)
    assert whitespace_outside_strings(got["default"]["text"]) == [], got["default"]["text"]
    assert got["obj"]["finish_reason"] == "length" or isinstance(
        json.loads(got["obj"]["text"]), dict
    )
    assert json.loads(got["rf"]["text"]) in ("x", "y")
    assert re.fullmatch("[0-9]{2}", got["so"]["text"])
    assert len(got["text"]["token_ids"]) == 3
    assert "response_format" in got["bad"]["error"]
    assert "structured_outputs.json" in got["badschema"]["error"]
    assert (
        cli.main(
            [
                "generate",
                "--model",
                str(STORIES),
                "--prompts",
                str(prompts),
                "--out",
                str(tmp_path / "o2.jsonl"),
                "--json-schema",
                str(tmp_path / "none.json"),
                *STORIES_CLI_FLAGS,
            ]
        )
        == 2
    )
    assert "--json-schema" in capsys.readouterr().err
    alone = ["--prompts", str(prompts), "--out", str(tmp_path / "o3.jsonl")]
    assert cli.main(["generate", "--model", str(STORIES), *alone, "--disable-any-whitespace"]) == 2
    assert "--disable-any-whitespace applies to --json-schema" in capsys.readouterr().err
