"""The engine against transformers on a tiny random Llama (untied head, sharded checkpoint) with a
chat-template tokenizer (issue 16): ``LLM.chat()`` and ``messages`` records of ``jaxinfer generate``
render as transformers' ``apply_chat_template`` and generate its greedy tokens and text;
presence penalty, ``min_p`` and ``skip_special_tokens=False`` through the engine, judged against
transformers' logits of the generated sequences and its tokenizer's decode.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxinfer.cli import main as cli
from jaxinfer.sampling.sampler import SamplingParams
from tests.conftest import stories_reference

# A Llama-3-style chat template (as in tests/test_tokenizer.py).
TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
# ids 0-2 are the checkpoint config's pad/bos/eos (tests/hf_fixtures.py _BASE).
SPECIALS = ["<pad>", "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
CORPUS = [
    "Once upon a time there was a little girl named Lily who loved the park.",
    "You are a helpful assistant. What is two plus two? It is four.",
    "The quick brown fox jumps over the lazy dog, and the cat sat on the mat.",
] * 20
CONVERSATIONS = [
    [{"role": "user", "content": "Hi! What is the park like?"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "It is four."},
        {"role": "user", "content": "And the fox?"},
    ],
]
NEW = 12  # greedy tokens compared with transformers


def _tokenizer_files(d: Path) -> None:
    """A SentencePiece-like BPE tokenizer.json of exactly 256 ids (the checkpoint's vocabulary)
    that adds BOS to plain text as Llama 3's does (the chat template writes its own BOS, so a
    rendered conversation must be encoded without special tokens), with the chat template in
    tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=256,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=[chr(c) for c in range(32, 127)],
    )
    tok.train_from_iterator(CORPUS + [c["expected"] for c in stories_reference()], trainer)
    assert tok.get_vocab_size() == 256
    assert [tok.token_to_id(s) for s in SPECIALS] == list(range(len(SPECIALS)))
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 1)]
    )
    tok.save(str(d / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<pad>",
        "clean_up_tokenization_spaces": False,
        "chat_template": TEMPLATE,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """(path, our LLM, transformers' tokenizer, transformers' model): tests/hf_fixtures.py's tiny
    random "llama2" checkpoint (untied LM head, sharded) with a chat-template tokenizer."""
    from transformers import AutoTokenizer

    from jaxinfer.llm import LLM
    from tests.hf_fixtures import build_checkpoint, hf_model

    d = tmp_path_factory.mktemp("chat")
    build_checkpoint("llama2", str(d))
    _tokenizer_files(d)
    # test_no_tokenizer's sizes for the same tiny Llama (shared compiled steps)
    llm = LLM(d, max_model_len=128, max_num_seqs=8, compilation_cache=False)
    return d, llm, AutoTokenizer.from_pretrained(str(d)), hf_model(str(d))


def _hf_greedy(model, ids: list[int], new: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=new,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
    return out[0, len(ids) :].tolist()


def _hf_text(hf_tok, prompt: list[int], ids: list[int], **kw) -> str:
    """transformers' text of output ``ids`` after ``prompt`` (vLLM's rule: the output decoded in
    the prompt's context, less the prompt's text)."""
    full, head = hf_tok.decode(prompt + ids, **kw), hf_tok.decode(prompt, **kw)
    assert full.startswith(head), (full, head)
    return full[len(head) :]


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    """f32[S, V] transformers' logits of one sequence."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def test_chat_and_messages_records_render_and_generate_as_transformers(
    chat_model, tmp_path, monkeypatch, capsys
):
    path, llm, hf_tok, model = chat_model
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outs = llm.chat(CONVERSATIONS, sp)
    for conv, out in zip(CONVERSATIONS, outs, strict=True):
        want = hf_tok.apply_chat_template(
            conv, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert out.error is None and out.prompt_token_ids == want
        assert out.token_ids == _hf_greedy(model, want, NEW)
        assert out.text == _hf_text(hf_tok, want, out.token_ids, skip_special_tokens=True)
    # One conversation (a list of messages) is one request, as the README's example.
    seen = []
    monkeypatch.setattr(llm, "generate", lambda prompts, *a, **k: seen.append(prompts))
    llm.chat(CONVERSATIONS[0], sp)
    assert seen == [[{"messages": CONVERSATIONS[0]}]]
    monkeypatch.undo()

    # The same conversations as `messages` records of `jaxinfer generate` (the CLI's model is this
    # LLM: the record path, not the loading, is under test here).
    monkeypatch.setattr(cli, "_load_llm", lambda args: llm)
    prompts, out = tmp_path / "chat.jsonl", tmp_path / "out.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"c{i}", "messages": c}) + "\n" for i, c in enumerate(CONVERSATIONS)
        )
    )
    rc = cli.main(
        [
            "generate",
            "--model",
            str(path),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            "--no-progress",
            "--temperature",
            "0",
            "--max-tokens",
            str(NEW),
            "--ignore-eos",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    summary = json.loads(captured.out)
    assert summary["completed"] == 2 and summary["errors"] == 0, summary
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for i, ref in enumerate(outs):
        r = records[f"c{i}"]
        assert r["token_ids"] == ref.token_ids and r["text"] == ref.text
        assert r["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)


def test_presence_penalty_min_p_and_special_tokens_through_the_engine(chat_model):
    """One batch: greedy rows with and without presence_penalty, sampled rows with and without
    min_p (same seed), and a greedy row whose output holds special tokens, decoded with and
    without them; judged against transformers' logits of the generated sequences
    (teacher-forced) and its tokenizer."""
    _, llm, hf_tok, model = chat_model
    # Greedy repeats itself after this prompt, and the prompt's tokens compete with the output's.
    lily = hf_tok.encode("Lily loved the park", add_special_tokens=False)
    fox = hf_tok.encode("the fox", add_special_tokens=False)  # greedy emits <|eot_id|> first
    n, min_p, temp = 16, 0.3, 2.0
    penalties = {"presence": 2.0, "presence_neg": -1.0}
    rows = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
        **{
            k: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, presence_penalty=v)
            for k, v in penalties.items()
        },
        "min_p": SamplingParams(
            temperature=temp, min_p=min_p, seed=0, max_tokens=n, ignore_eos=True
        ),
        "plain": SamplingParams(temperature=temp, seed=0, max_tokens=n, ignore_eos=True),
        "specials": SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True, skip_special_tokens=False
        ),
        "skipped": SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
    }
    prompts = {k: fox if k in ("specials", "skipped") else lily for k in rows}
    outs = dict(zip(rows, llm.generate(list(prompts.values()), list(rows.values())), strict=True))
    logits = {}  # f64[n, V]: the distribution each generated token was drawn from
    for k, o in outs.items():
        p = prompts[k]
        logits[k] = _hf_logits(model, p + o.token_ids)[len(p) - 1 : -1].astype(np.float64)
    for k in ("greedy", "specials"):
        assert outs[k].token_ids == [int(np.argmax(x)) for x in logits[k]], k

    # Presence penalty (vLLM, OpenAI): logit -= presence_penalty once for each token already
    # generated; the prompt's tokens are not counted. Each greedy choice is the argmax of that.
    # Power: along the same outputs, no penalty, counting the prompt's tokens too, or
    # subtracting presence_penalty per occurrence would each have chosen differently somewhere.
    differs = {"none": 0, "prompt counted": 0, "per occurrence": 0}
    vocab = np.arange(256)
    for k, pen in penalties.items():
        toks = outs[k].token_ids
        for i, tok in enumerate(toks):
            seen = np.isin(vocab, toks[:i])
            want = logits[k][i] - pen * seen
            top2 = np.sort(want)[-2:]
            assert top2[1] - top2[0] > 1e-4, (k, i)  # clear of f32 noise (~1e-5 here)
            assert tok == int(np.argmax(want)), (k, i, toks)
            alt = {
                "none": logits[k][i],
                "prompt counted": logits[k][i] - pen * (seen | np.isin(vocab, prompts[k])),
                "per occurrence": logits[k][i] - pen * np.bincount(toks[:i], minlength=256),
            }
            for name, x in alt.items():
                differs[name] += tok != int(np.argmax(x))
    assert min(differs.values()) >= 1, differs

    # min_p (vLLM v1 order: temperature, then keep p >= min_p * max p). The row without min_p
    # (same seed) draws tokens below the cut; the min_p row draws tokens that a cut before the
    # temperature (on softmax(logits)) would have removed.
    def ratios(k, t):  # f64[n]: p(drawn) / max p at temperature t
        z = logits[k] / t
        return np.exp(z[np.arange(n), outs[k].token_ids] - z.max(axis=1))

    assert np.all(ratios("min_p", temp) >= min_p * (1 - 1e-4)), ratios("min_p", temp)
    assert np.sum(ratios("plain", temp) < min_p) >= 2
    assert np.sum(ratios("min_p", 1.0) < min_p) >= 1

    # skip_special_tokens=False: the text is the tokenizer's own decode with the specials in.
    ids = outs["specials"].token_ids
    assert outs["skipped"].token_ids == ids
    assert set(ids) & set(range(len(SPECIALS))), ids  # special tokens were generated
    assert outs["specials"].text == _hf_text(hf_tok, fox, ids, skip_special_tokens=False)
    assert outs["skipped"].text == _hf_text(hf_tok, fox, ids, skip_special_tokens=True)
    assert "<|eot_id|>" in outs["specials"].text and "<|eot_id|>" not in outs["skipped"].text
    assert outs["specials"].text != outs["skipped"].text
