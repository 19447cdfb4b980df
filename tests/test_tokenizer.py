"""Tests of the tokenizer layer against SentencePiece, llama2.c's run.c rules and transformers."""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import pytest
from conftest import stories_reference

from jaxinfer.errors import TokenizerError
from jaxinfer.sampling.params import SamplingParams
from jaxinfer.tokenizers import (
    IncrementalDetokenizer,
    Llama2cTokenizer,
    SentencePieceTokenizer,
    load_tokenizer,
)

MODELS = Path(__file__).resolve().parents[2] / "shared" / "models"
if not MODELS.is_dir():
    MODELS = Path("/work/shared/models")
STORIES = MODELS / "stories260K"
AIDREAMS = MODELS / "aidreams260K"

MULTILINGUAL = "Hello wörld — 你好, мир! 🎉🚀 naïve café ☕"

# Ordinary text: single spaces (tok512.model's normalizer collapses runs of spaces, run.c does not).
SENTENCES = [
    "Once upon a time",
    "Tom and his dog",
    "Lily's mom said, \"Lily, let's go to the park.\"",
    "She was 3 years old. He had 12 apples and 405 pears!",
    "One day, a bird flew in.\nThe end.\n\nA new story: (yes) [no] {maybe}; 50% off?",
    "naïve café — 你好 🎉 Ünïcödé",
    "\ttabbed\tline",
    "a",
]

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# Block tags on their own, indented lines: exercises trim_blocks and lstrip_blocks.
CHATML_TEMPLATE = """{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unsupported role: ' + message['role']) }}
    {% endif %}
    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' -}}
{% endif %}
"""

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant. 🤖"},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "  It is 4.  "},
    {"role": "user", "content": "And in Chinese — 中文?"},
]


# --- llama2.c tok512: SentencePiece model vs run.c tokenizer.bin --------------------------------


@pytest.fixture(scope="module")
def sp512():
    return load_tokenizer(STORIES / "tok512.model")


@pytest.fixture(scope="module")
def bin512():
    return load_tokenizer(STORIES / "tok512.bin")


def test_tok512_known_ids(sp512, bin512):
    assert isinstance(sp512, SentencePieceTokenizer)
    assert isinstance(bin512, Llama2cTokenizer)
    for tok in (sp512, bin512):
        assert tok.vocab_size == 512
        assert tok.bos_id == 1 and tok.eos_ids == (2,) and tok.add_bos
        assert tok.encode("Once upon a time") == [1, 403, 407, 261, 378]
        assert tok.encode("Once upon a time", add_special_tokens=False) == [403, 407, 261, 378]
        assert tok.encode("") == [1]  # llama2.c's unconditional start
        assert tok.is_special(1) and tok.is_special(2) and not tok.is_special(403)


@pytest.mark.parametrize("text", SENTENCES)
def test_tok512_model_and_bin_agree(sp512, bin512, text):
    ids = sp512.encode(text)
    assert bin512.encode(text) == ids
    assert sp512.decode(ids) == text
    assert bin512.decode(ids) == text


def test_tok512_byte_fallback(sp512, bin512):
    ids = sp512.encode("你好 🎉", add_special_tokens=False)
    assert bin512.encode("你好 🎉", add_special_tokens=False) == ids
    utf8 = " 你好 🎉".encode()  # dummy prefix: the space itself is a vocabulary piece
    byte_ids = [b + 3 for b in utf8[1:4]]  # 你 is not in the vocabulary: three byte tokens
    assert ids[1:4] == byte_ids
    assert bin512.decode(byte_ids) == "你"


def test_tok512_llama2c_printing(sp512, bin512):
    # run.c: the leading space of the piece after BOS is dropped, <0xNN> pieces print the byte.
    ids = [1, 403, 407, 261, 378, 13]  # 13 = <0x0A>
    for tok in (sp512, bin512):
        assert tok.decode(ids) == "Once upon a time\n"
        assert tok.decode(ids, skip_special_tokens=False).startswith("<s>")
        assert tok.decode([1, 1000]) == ""  # ids past the vocabulary (padded embedding) dropped
    reference = json.loads((STORIES / "greedy_reference.json").read_text())
    for case in reference:
        ids = bin512.encode(case["expected"])
        assert sp512.encode(case["expected"]) == ids
        det = IncrementalDetokenizer(bin512, ids[:1])
        assert "".join(det.add(i) for i in ids[1:]) == case["expected"] == det.text


def _run_c_merge(tok: Llama2cTokenizer, ids: list[int]) -> list[int]:
    """run.c's merge loop as written: rescan all pairs, merge the best (leftmost on ties)."""
    ids = list(ids)
    while True:
        best = (-1e10, -1, -1)
        for i in range(len(ids) - 1):
            merged = tok._ids.get(tok._pieces[ids[i]] + tok._pieces[ids[i + 1]])
            if merged is not None and tok._scores[merged] > best[0]:
                best = (tok._scores[merged], merged, i)
        if best[2] < 0:
            return ids
        ids[best[2] : best[2] + 2] = [best[1]]


@pytest.mark.parametrize("path", [STORIES / "tok512.bin", AIDREAMS / "tok512.bin"])
def test_llama2c_heap_merge_equals_run_c_loop(path):
    tok = load_tokenizer(path)
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz  ,.!'\"\nTOLS0123é你"
    for _ in range(40):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        chars = [c.encode() for c in " " + text]
        unmerged = []
        for c in chars:
            i = tok._ids.get(c)
            unmerged += [i] if i is not None else [b + 3 for b in c]
        assert tok.encode(text, add_special_tokens=False) == _run_c_merge(tok, unmerged)
        assert tok.decode(tok.encode(text)) == text


def test_llama2c_directories():
    assert isinstance(load_tokenizer(STORIES), SentencePieceTokenizer)  # .model preferred
    tok = load_tokenizer(AIDREAMS)  # the checkpoint .bin beside it is skipped
    assert isinstance(tok, Llama2cTokenizer) and tok.path.name == "tok512.bin"
    text = "Once upon a time, a robot dreamed of stars."
    assert tok.decode(tok.encode(text)) == text


# --- Hugging Face: tokenizer.json (byte-level BPE) and SentencePiece with byte fallback ----------


def _corpus() -> list[str]:
    lines = [
        "The quick brown fox jumps over the lazy dog.",
        "Once upon a time, there was a little girl named Lily who loved the park.",
        "She said: \"It's 42 degrees, isn't it?\" (1234567890) [a] {b}.",
        "What is 2 + 2? It is 4. You are a helpful assistant.",
    ]
    return lines * 40 + [MULTILINGUAL, "Привет мир, 中文 😀"]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer.json (Llama 3 layout) with a Llama-3-style chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>"]
    specials += ["<|end_header_id|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    d = tmp_path_factory.mktemp("bpe")
    tok.save(str(d / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "clean_up_tokenization_spaces": False,
        "chat_template": LLAMA3_TEMPLATE,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    eos = [tok.token_to_id("<|end_of_text|>"), tok.token_to_id("<|eot_id|>")]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return d


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory) -> Path:
    """A SentencePiece BPE model with byte fallback (Llama 2 layout) and a ChatML template."""
    import sentencepiece

    d = tmp_path_factory.mktemp("sp")
    (d / "corpus.txt").write_text("\n".join(_corpus()) + "\n", encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"),
        model_prefix=str(d / "sp"),
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        character_coverage=0.995,  # rare characters (CJK, emoji) fall back to bytes
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    (d / "corpus.txt").unlink()
    shutil.move(d / "sp.model", d / "tokenizer.model")
    (d / "sp.vocab").unlink()
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "chat_template": CHATML_TEMPLATE,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.fixture(scope="module", params=["bpe", "sp"])
def hf_pair(request, bpe_dir, sp_dir):
    """(ours, transformers') loaded from the same directory."""
    from transformers import AutoTokenizer

    d = bpe_dir if request.param == "bpe" else sp_dir
    return load_tokenizer(d), AutoTokenizer.from_pretrained(str(d))


def test_hf_loads_expected_backend(bpe_dir, sp_dir):
    bpe, sp = load_tokenizer(bpe_dir), load_tokenizer(sp_dir)
    assert type(bpe).__name__ == "HFTokenizer" and isinstance(sp, SentencePieceTokenizer)
    assert bpe.add_bos and bpe.bos_id == 0  # first special token; from the post-processor
    assert bpe.eos_ids == (4, 1)  # eos_token first, then generation_config's
    assert bpe.is_special(2) and not bpe.is_special(300)
    assert sp.bos_id == 1 and sp.eos_ids == (2,) and sp.add_bos


@pytest.mark.parametrize(
    "text", [MULTILINGUAL, "Once upon a time,\n\nthere was Lily. 123", "", "two  spaces  "]
)
def test_hf_encode_decode_match_transformers(hf_pair, text):
    ours, theirs = hf_pair
    ids = ours.encode(text)
    assert ids == theirs.encode(text)
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(
        text, add_special_tokens=False
    )
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == text
    assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(
        ids, skip_special_tokens=False
    )


def test_add_bos_token_from_config_overrides(bpe_dir, sp_dir, tmp_path):
    for src in (bpe_dir, sp_dir):
        d = tmp_path / src.name
        shutil.copytree(src, d)
        config = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps(config | {"add_bos_token": False}))
        with_bos, without = load_tokenizer(src), load_tokenizer(d)
        assert with_bos.add_bos and not without.add_bos
        assert with_bos.encode("Once upon") == [with_bos.bos_id, *without.encode("Once upon")]
        assert without.encode("") == []


def test_sentencepiece_leading_space_follows_sentencepiece(sp_dir):
    # transformers' converted Llama tokenizer adds no dummy prefix to text that already starts with
    # a space; SentencePiece (and llama2.c's run.c) always add it. We follow SentencePiece.
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    ours = load_tokenizer(sp_dir)
    for text in ("  two  spaces ", " x", "\n y"):
        assert ours.encode(text) == [1, *sp.encode(text)]
        assert ours.decode(ours.encode(text)) == text


def test_hf_incremental_decode_never_splits_a_character(hf_pair):
    ours, theirs = hf_pair
    text = MULTILINGUAL + "\n" + MULTILINGUAL
    ids = ours.encode(text)
    # The test means something only if some tokens are parts of a UTF-8 character.
    assert any("\ufffd" in ours.decode([i]) for i in ids)
    for prompt_len in (1, 3, 9):
        det = IncrementalDetokenizer(ours, ids[:prompt_len])
        pieces = [det.add(i) for i in ids[prompt_len:]]
        assert not any("\ufffd" in p for p in pieces)
        # A character the prompt cuts belongs to the output (README): the prompt's text is
        # that of its whole characters (valid text, so every U+FFFD is the cut character's).
        prompt_text = theirs.decode(ids[:prompt_len], skip_special_tokens=True).rstrip("\ufffd")
        expected = theirs.decode(ids, skip_special_tokens=True)[len(prompt_text) :]
        assert "".join(pieces) == det.text == expected
    det = IncrementalDetokenizer(ours, [])
    assert "".join(det.add(i) for i in ids) == ours.decode(ids) == text


# --- chat templates ------------------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(hf_pair, add_generation_prompt):
    ours, theirs = hf_pair
    expected = theirs.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt) == expected
    assert expected.count("<|start_header_id|>assistant") + expected.count("im_start|>assistant")


def test_chat_template_helpers_match_transformers(sp_dir, tmp_path):
    from transformers import AutoTokenizer

    d = tmp_path / "helpers"
    shutil.copytree(sp_dir, d)
    (d / "chat_template.jinja").write_text(  # a .jinja file beside the config wins
        "{{ bos_token }}{{ strftime_now('%Y') }} {{ messages | tojson }}"
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}{{ eos_token }}"
    )
    expected = AutoTokenizer.from_pretrained(str(d)).apply_chat_template(MESSAGES, tokenize=False)
    assert load_tokenizer(d).apply_chat_template(MESSAGES, add_generation_prompt=False) == expected


def test_chat_template_errors(sp_dir, sp512):
    with pytest.raises(TokenizerError, match="Unsupported role: tool"):
        load_tokenizer(sp_dir).apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(TokenizerError, match=r"tok512\.model.*no chat template"):
        sp512.apply_chat_template(MESSAGES)


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tok512.model", "tok512.bin"])
def test_vocab_size_mismatch(name):
    path = STORIES / name
    assert load_tokenizer(path, vocab_size=512).vocab_size == 512
    assert load_tokenizer(path, vocab_size=640).vocab_size == 512  # models pad their vocabulary
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(path, vocab_size=500)
    assert str(path) in str(e.value) and "512" in str(e.value) and "500" in str(e.value)


def test_vocab_size_mismatch_tokenizer_json(bpe_dir):
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(bpe_dir, vocab_size=256)
    message = str(e.value)
    assert str(bpe_dir / "tokenizer.json") in message and "400" in message and "256" in message


def test_missing_and_bad_files(tmp_path):
    for missing in (tmp_path / "nope", tmp_path / "nope" / "tokenizer.json"):
        with pytest.raises(TokenizerError, match=str(missing)):
            load_tokenizer(missing)
    with pytest.raises(TokenizerError, match=f"no tokenizer in {tmp_path}"):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="checkpoint, not a tokenizer"):
        load_tokenizer(STORIES / "stories260K.bin")
    for name, data in [("bad.model", b"not a model"), ("bad.json", b"{"), ("bad.bin", b"\1\0")]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(TokenizerError, match=str(tmp_path / name)):
            load_tokenizer(tmp_path / name)
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(struct.pack("<ifi", 7, 0.0, 5) + b"<un")
    with pytest.raises(TokenizerError, match="not a llama2.c tokenizer"):
        load_tokenizer(truncated)
    # cut between two records: well formed, but too few tokens for the byte fallback (ids 3..258)
    whole = (STORIES / "tok512.bin").read_bytes()
    (tmp_path / "short.bin").write_bytes(whole[:100])
    with pytest.raises(TokenizerError, match="holds 7 tokens.*truncated"):
        load_tokenizer(tmp_path / "short.bin")


def test_a_prompt_the_tokenizer_rejects_fails_alone(stories_llm):
    llm = stories_llm
    case = stories_reference()[1]
    ids = llm.tokenizer.encode(case["prompt"])
    sp = SamplingParams(
        temperature=0.0, max_tokens=case["max_steps"] - (len(ids) - 1), stop_token_ids=(1,)
    )
    good, bad = llm.generate([case["prompt"], "Once \ud800"], sp)
    assert llm.tokenizer.decode(ids + good.token_ids) == case["expected"]
    assert bad.finish_reason == "error" and "cannot encode the prompt" in bad.error
