"""``jaxinfer generate`` (interrupted, then resumed) and ``jaxinfer serve``'s chat completions on a
mixture-of-experts checkpoint directory: the tiny Qwen2-MoE of ``moe_fixtures`` (a dense middle
layer, a gated shared expert) saved with a word-level tokenizer of its 256 ids ("w0" .. "w255",
transformers' ``PreTrainedTokenizerFast``) and a chat template.

Judges: the batch CLI's uninterrupted run of the same records (``test_resume_partial``'s
helpers: SIGTERM at a step, then a resume, must give the same records), and transformers'
greedy ``generate`` on the ids of transformers' own chat-template rendering for the server.
"""

from __future__ import annotations

import json
import threading
import time

import hf_fixtures as H
import moe_fixtures as M
import pytest
from test_resume_partial import _assert_same_records, _by_id, _Hook, _sigterm

from jaxinfer.cli import main as cli
from jaxinfer.cli import partial as partial_mod

uvicorn = pytest.importorskip("uvicorn")

CLI_ENGINE = ["--max-model-len", "64", "--max-num-seqs", "2", "--no-progress"]
TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The checkpoint directory with its tokenizer (module docstring)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = M.build_checkpoint("qwen2_moe", str(tmp_path_factory.mktemp("moe") / "qwen2_moe"))
    vocab = {f"w{i}": i for i in range(256)}
    vocab.update({"<pad>": 0, "<s>": 1, "</s>": 2})
    del vocab["w0"], vocab["w1"], vocab["w2"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return path


def _records() -> list[dict]:
    ids = H.random_ids(30, seed=5)
    return [
        {"id": "a", "prompt_token_ids": ids[:9], "temperature": 0, "max_tokens": 12},
        {"id": "b", "prompt_token_ids": ids[9:14], "temperature": 0.8, "seed": 4, "max_tokens": 12},
        {"id": "c", "prompt": "w17 w40 w99 w3", "temperature": 0, "max_tokens": 10},
        {"id": "d", "prompt_token_ids": ids[14:30], "temperature": 0.9, "seed": 8, "max_tokens": 9},
    ]


def _main(ckpt, prompts, out, capsys) -> tuple[int, dict, str]:
    rc = cli.main(
        ["generate", "--model", ckpt, "--prompts", str(prompts), "--out", str(out), *CLI_ENGINE]
    )
    cap = capsys.readouterr()
    return rc, json.loads(cap.out.strip().splitlines()[-1]), cap.err


def test_generate_interrupted_and_resumed_equals_uninterrupted(ckpt, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    ref_out, out = tmp_path / "ref.jsonl", tmp_path / "out.jsonl"
    rc, _, err = _main(ckpt, prompts, ref_out, capsys)
    assert rc == 0, err
    reference = _by_id(ref_out)
    assert all("error" not in r for r in reference.values()), reference
    with monkeypatch.context() as m:
        _Hook(m, {8: _sigterm})
        rc, summary, err = _main(ckpt, prompts, out, capsys)
    assert rc == 143 and summary["interrupted"], err
    saved = json.loads(partial_mod.partial_path(out).read_text())["requests"]
    assert sum(len(r["token_ids"]) for r in saved) > 0  # resumed mid-request
    rc, summary, err = _main(ckpt, prompts, out, capsys)
    assert rc == 0 and summary["resumed"] >= 1, err
    _assert_same_records(_by_id(out), reference)


def test_server_chat_completion_equals_transformers(ckpt):
    import openai
    import torch
    from transformers import AutoTokenizer

    from jaxinfer.llm import LLM
    from jaxinfer.server.app import create_app
    from jaxinfer.server.command import bind_socket

    llm = LLM(ckpt, max_model_len=64, max_num_seqs=2, compilation_cache=False)
    app = create_app(llm, model_name="moe")
    sock = bind_socket("127.0.0.1", 0)
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert th.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "w17 w40 w99"}, {"role": "user", "content": "w5"}]
        resp = client.chat.completions.create(
            model="moe", messages=messages, max_tokens=8, temperature=0
        )
    finally:
        srv.should_exit = True
        th.join(30)
    hf_tok = AutoTokenizer.from_pretrained(ckpt)
    text = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = hf_tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and 0 not in ids  # BOS, no unknown word
    model = H.hf_model(ckpt, "float32")
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
            do_sample=False,
            max_new_tokens=8,
            pad_token_id=0,
            eos_token_id=2,
        )
    want = out[0, len(ids) :].tolist()
    if 2 in want:
        want = want[: want.index(2)]
    assert len(want) >= 4, want  # a continuation to compare, not an immediate EOS
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.choices[0].message.content.split() == hf_tok.decode(want).split()
    assert resp.usage.completion_tokens == len(want) + (resp.choices[0].finish_reason == "stop")
