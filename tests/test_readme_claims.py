"""README claims checked end to end against outside references (issue 16): ``LLM.chat()`` and
``messages`` records, ``skip_special_tokens=False``, presence penalty and ``min_p`` through the
engine (against transformers on the same tiny checkpoint and tokenizer); ``jaxinfer quantize`` then
``generate`` from the saved directory, the quantized untied LM head (numpy reference);
``train-draft-heads`` and draft heads / a draft model loaded from a path (llama2.c's greedy
outputs). The multi-device and persistent-cache claims run in subprocesses:
``tests/test_readme_claims_parallel.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.cli import main as cli
from jaxinfer.sampling.sampler import SamplingParams
from tests.conftest import STORIES, stories_reference

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
# XLA computes max|w| / 127 as a product with the reciprocal: within one float32 ulp of numpy's.
F32_EPS = float(np.finfo(np.float32).eps)


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


def test_quantized_untied_lm_head(chat_model, tmp_path, capsys, monkeypatch):
    """``jaxinfer quantize --lm-head`` on an untied model: the saved head is int8 with
    max|w| / 127 scales per vocabulary row (numpy, from the safetensors), bit for bit what
    quantizing in memory gives, and the logits are the final hidden states times the
    numpy-dequantized head."""
    from safetensors import safe_open

    from jaxinfer.loaders import load
    from jaxinfer.models.attention import dense_attn_fn
    from jaxinfer.models.forward import compute_logits, forward
    from jaxinfer.quant import QTensor, quantize

    path = chat_model[0]
    qdir = tmp_path / "q"
    assert cli.main(["quantize", "--model", str(path), "--out", str(qdir), "--lm-head"]) == 0
    capsys.readouterr()
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(path / index["lm_head.weight"], "np") as f:
        w = f.get_tensor("lm_head.weight").astype(np.float32)  # [V, D]
    scales = np.abs(w).max(axis=1) / np.float32(127)
    values = np.clip(np.round(w / scales[:, None]), -127, 127)

    m = load(qdir)
    head = m.params.lm_head
    assert isinstance(head, QTensor) and head.values.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(head.values), values)
    np.testing.assert_allclose(np.asarray(head.scales), scales, rtol=F32_EPS, atol=0)  # 1 ulp
    mem = quantize(load(path).params, "int8", lm_head=True)
    assert jax.tree.structure(mem) == jax.tree.structure(m.params)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(mem), jax.tree.leaves(m.params), strict=True)
    )

    @jax.jit
    def hidden_and_logits(params, tokens):  # i32[S] -> final-normed f32[S, D], f32[S, V]
        pos = jnp.arange(tokens.shape[0], dtype=jnp.int32)
        attn = dense_attn_fn(m.config, jnp.zeros_like(pos), pos)
        h, _ = forward(params, m.config, tokens, pos, None, attn)
        return h, compute_logits(params, m.config, h)

    tokens = jnp.asarray(np.random.default_rng(0).integers(3, 256, 12), jnp.int32)
    h, got = (np.asarray(x, np.float64) for x in hidden_and_logits(m.params, tokens))
    w_deq = values * scales[:, None].astype(np.float64)
    ref = h @ w_deq.T
    # Bound: the activations may be written as two int8 digits (int_dot2, relative error
    # 1 / (2 * 127 * 254) of max|h| per row) plus float32 rounding of the sums.
    act = np.abs(h).max(axis=1, keepdims=True) / 127 / 254 / 2 * scales * np.abs(values).sum(1)
    rounding = 2 * h.shape[1] * F32_EPS * (np.abs(h) @ np.abs(w_deq).T)
    assert np.all(np.abs(got - ref) <= act + rounding + 1e-30)


def test_compilation_cache_is_on_by_default_in_the_documented_place(monkeypatch, tmp_path):
    """README: on by default in ~/.cache/jaxinfer/xla, JAXINFER_COMPILATION_CACHE=0 turns it off
    (that it is written and reused: tests/test_readme_claims_parallel.py)."""
    from jaxinfer import llm as llm_module

    calls = []
    monkeypatch.setattr(llm_module.jax.config, "update", lambda k, v: calls.append((k, v)))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("JAXINFER_CACHE_DIR", raising=False)
    monkeypatch.delenv("JAXINFER_COMPILATION_CACHE", raising=False)
    want = tmp_path / ".cache" / "jaxinfer" / "xla"
    assert llm_module.enable_compilation_cache() == str(want) and want.is_dir()
    assert ("jax_compilation_cache_dir", str(want)) in calls
    calls.clear()
    monkeypatch.setenv("JAXINFER_COMPILATION_CACHE", "0")
    assert llm_module.enable_compilation_cache() is None and calls == []


# ------------------------------------------------------------------ stories260K: llama2.c outputs

BOS = 1
AIDREAMS = STORIES.parent / "aidreams260K" / "aidreams260K.bin"
# One engine shape for every stories260K engine below (pages of 64 tokens: one block-table bucket).
STORY_ENGINE = dict(max_model_len=256, page_size=64, max_num_seqs=4, compilation_cache=False)


@pytest.fixture(scope="module")
def reference():
    """llama2.c's two 64-step greedy cases as requests (prompt ids with BOS, run.c's step count,
    stop on BOS) and a check that outputs reproduce run.c's text. (Equal lengths: the rows finish
    together, so no batch-1 decode shape is compiled.)"""
    from jaxinfer.tokenizers import load_tokenizer

    tok = load_tokenizer(STORIES / "tok512.model", vocab_size=512)
    cases = [c for c in stories_reference() if c["max_steps"] == 64]
    assert len(cases) == 2
    prompts = [tok.encode(c["prompt"]) for c in cases]
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=c["max_steps"] - (len(p) - 1), stop_token_ids=[BOS]
        )
        for c, p in zip(cases, prompts, strict=True)
    ]

    def check(token_ids, what):
        for c, p, ids in zip(cases, prompts, token_ids, strict=True):
            text = tok.decode(p + list(ids), skip_special_tokens=True)
            assert text == c["expected"], (what, c["prompt"], text)

    return prompts, params, check


def test_quantize_and_train_draft_heads_then_generate_from_both_directories(
    tmp_path, capsys, monkeypatch, reference
):
    """The README's workflow on stories260K: ``jaxinfer quantize`` writes int8 weights (numpy
    scales, bit for bit what quantizing in memory gives); a few steps of ``jaxinfer
    train-draft-heads`` write a heads directory; ``jaxinfer generate --model DIR --speculative
    heads --draft-heads HEADS`` loads both and its greedy output is llama2.c's (int8 keeps the
    reference text on these cases, README: agreement 1.0; greedy speculative == greedy)."""
    from jaxinfer.loaders import load
    from jaxinfer.quant import QTensor, quantize

    monkeypatch.setenv("JAXINFER_COMPILATION_CACHE", "0")  # the CLI's LLMs would turn it on
    prompts, params, check = reference
    qdir = tmp_path / "int8"
    assert cli.main(["quantize", "--model", str(STORIES), "--out", str(qdir)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["quantized_bytes"] < summary["float_bytes"] / 2
    float_params = load(STORIES).params
    saved = load(qdir)
    w = np.asarray(float_params.layers.w_gate)  # [L, D, F]
    q = saved.params.layers.w_gate  # values [L, F, D]
    assert isinstance(q, QTensor) and q.values.dtype == jnp.int8
    scales = np.abs(w).max(axis=1) / np.float32(127)
    np.testing.assert_allclose(np.asarray(q.scales), scales, rtol=F32_EPS, atol=0)  # 1 ulp
    np.testing.assert_array_equal(
        np.asarray(q.values), np.round(np.swapaxes(w, 1, 2) / scales[..., None])
    )
    mem = quantize(float_params, "int8")
    assert jax.tree.structure(mem) == jax.tree.structure(saved.params)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(mem), jax.tree.leaves(saved.params), strict=True)
    )

    heads = tmp_path / "heads"
    rc = cli.main(
        [
            "train-draft-heads",
            "--model",
            str(STORIES),
            "--out",
            str(heads),
            "--num-heads",
            "2",
            "--num-sequences",
            "8",
            "--gen-tokens",
            "16",
            "--steps",
            "3",
            "--batch-size",
            "32",
            "--held-out",
            "0.25",
        ]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 3 and len(summary["held_out_top1_agreement"]) == 2
    assert (heads / "heads").is_dir() and (heads / "meta.json").is_file()
    assert (heads / "loss.png").stat().st_size > 0

    recs = tmp_path / "p.jsonl"
    lines = [
        {
            "id": str(i),
            "prompt_token_ids": p,
            "max_tokens": params[i].max_tokens,
            "stop_token_ids": [BOS],
        }
        for i, p in enumerate(prompts)
    ]
    recs.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "out.jsonl"
    rc = cli.main(
        [
            "generate",
            "--model",
            str(qdir),
            "--prompts",
            str(recs),
            "--out",
            str(out),
            "--max-model-len",
            "256",
            "--page-size",
            "64",
            "--max-num-seqs",
            "4",
            "--no-progress",
            "--temperature",
            "0",
            "--speculative",
            "heads",
            "--draft-heads",
            str(heads),
            "--num-speculative-tokens",
            "2",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    check([got[str(i)]["token_ids"] for i in range(len(prompts))], "int8 dir + heads dir")
    assert all(r["metrics"]["spec_rounds"] > 0 for r in got.values())


def test_draft_model_from_a_checkpoint_path(reference):
    """``draft_model=PATH``: aidreams260K (another trained llama2.c model with 512 ids; 4 layers,
    4 heads of 16 dims to the target's 5 layers, 8 heads of 8) drafts for stories260K. Most
    drafts are rejected, and greedy output is still llama2.c's."""
    from jaxinfer.llm import LLM

    prompts, params, check = reference
    llm = LLM(
        STORIES,
        speculative="draft-model",
        draft_model=str(AIDREAMS),
        num_speculative_tokens=2,
        **STORY_ENGINE,
    )
    dcfg = llm.engine.speculative.draft_cfg
    assert (dcfg.num_layers, dcfg.num_heads, dcfg.head_dim) == (4, 4, 16)
    outs = llm.generate(prompts, params)
    check([o.token_ids for o in outs], "draft model from a path")
    assert all(o.metrics.spec_rounds > 0 and o.metrics.acceptance_rate < 0.9 for o in outs)
