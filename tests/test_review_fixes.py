"""Inputs a fresh-user review found still breaking a job (issue 15), each now one request's error
or a correct result. References: llama2.c's outputs, transformers' logits, numpy's float32."""

import json
import os
import time

import numpy as np
import pytest
from conftest import stories_reference

from jaxinfer.errors import TokenizerError
from jaxinfer.models.config import check_float
from jaxinfer.sampling.sampler import SamplingParams
from jaxinfer.tokenizers.base import SideFiles
from jaxinfer.tokenizers.chat_template import ChatTemplateError, render_chat_template


@pytest.mark.parametrize(
    "source",
    [
        "{{ " + "(" * 300 + "1" + ")" * 300 + " }}",  # RecursionError in jinja's parser
        "{% for a in b %}" * 25 + "{% endfor %}" * 25,  # SyntaxError: too many nested blocks
        "{% if true %}" * 100 + "{% endif %}" * 100,  # IndentationError
    ],
)
def test_templates_that_break_python_compile_are_the_requests_error(source):
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template(source, {"messages": [{"role": "user", "content": "hi"}]}, where="t")
    assert time.perf_counter() - t0 < 30  # hang guard


@pytest.mark.parametrize(
    "value, words",
    [
        (["{{ 1 }}"], "list of"),
        (5, "must be a string"),
        ({}, "must be a string"),
    ],
)
def test_a_chat_template_that_is_not_a_string_names_the_file(tmp_path, value, words):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": value}))
    with pytest.raises(TokenizerError, match=words) as e:
        SideFiles(tmp_path)
    assert "tokenizer_config.json" in str(e.value)


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


def test_negative_seeds_resume_with_their_low_32_bits(stories_llm):
    from jaxinfer.engine.resume import ResumeState

    llm = stories_llm
    sp = SamplingParams(temperature=0.9, max_tokens=12, seed=-2)
    low = SamplingParams(temperature=0.9, max_tokens=12, seed=(-2) & 0xFFFFFFFF)
    a, b = llm.generate(["Once upon a time"] * 2, [sp, low])
    assert a.error is None and a.token_ids == b.token_ids
    ids = llm.encode_prompt("Once upon a time")[0]
    llm.engine.validate(ids, sp, ResumeState(-2, tuple(a.token_ids[:3])))
    resumed = list(
        llm.generate_stream(
            ["Once upon a time"], sp, resume=[ResumeState(-2, tuple(a.token_ids[:3]))]
        )
    )[-1]
    assert resumed.token_ids == a.token_ids


@pytest.mark.parametrize("value", [1e39, 1e300, 1e-300, 1e-39])
def test_config_floats_outside_float32_are_refused(value):
    with np.errstate(over="ignore"):
        f32 = np.float64(value).astype(np.float32)
    assert f32 == 0 or np.isinf(f32) or abs(f32) < np.finfo(np.float32).tiny  # the premise
    with pytest.raises(ValueError, match="float32"):
        check_float("rms_norm_eps", value, allow_zero=True)
    assert check_float("rms_norm_eps", 1e-6, allow_zero=True) == 1e-6


def test_resume_never_holds_an_overlong_output_line(tmp_path, monkeypatch):
    import jaxinfer.cli.output_file as outfile

    monkeypatch.setattr(outfile, "MAX_RECORD_BYTES", 64)
    out = tmp_path / "o.jsonl"
    out.write_bytes(
        b'{"id": "a"}\n'
        + b'{"id": "'
        + b"x" * 500
        + b'"}\n'
        + b'{"id": "b"}\n'
        + b'{"id": "c", "te'
    )
    warnings = []
    f = outfile.OutputFile.open(out)
    done = f.read_done(warnings.append)
    assert done.ids == {"a", "b"} and done.truncated
    assert any("line 2" in w for w in warnings)
    assert out.read_bytes().endswith(b'{"id": "b"}\n')  # the partial last line is cut


def test_a_partial_file_that_is_a_device_or_fifo_is_not_read(tmp_path):
    from jaxinfer.cli import partial

    fifo = tmp_path / "p.partial.json"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero"):
        warnings = []
        t0 = time.perf_counter()
        assert partial.load(type(fifo)(path), {}, warnings.append) == {}
        assert time.perf_counter() - t0 < 10 and "not a regular file" in warnings[0]


def test_logprobs_on_a_vocabulary_smaller_than_the_top_list(tmp_path):
    """vocab 8 < MAX_LOGPROBS (20): logprobs 0 and 8 work, values from transformers."""
    torch = pytest.importorskip("torch")
    import transformers

    from jaxinfer.llm import LLM

    cfg = transformers.LlamaConfig(
        vocab_size=8,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        eos_token_id=None,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    llm = LLM(
        tmp_path,
        skip_tokenizer_init=True,
        max_model_len=16,
        max_num_seqs=2,
        compilation_cache=False,
    )
    prompt = [1, 3, 5]
    outs = llm.generate(
        [prompt, prompt], [SamplingParams(temperature=0, max_tokens=3, logprobs=k) for k in (0, 8)]
    )
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    seq = prompt + outs[1].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].double(), -1).numpy()
    for out, k in zip(outs, (0, 8), strict=True):
        assert out.error is None, out.error
        for j, lp in enumerate(out.logprobs):
            row = ref[len(prompt) - 1 + j]
            assert lp.token_id == int(row.argmax()) and len(lp.top) == k
            np.testing.assert_allclose(lp.logprob, row[lp.token_id], atol=1e-4)
    bad = llm.generate([prompt], SamplingParams(max_tokens=2, logprobs=9))[0]
    assert bad.finish_reason == "error" and "vocabulary size 8" in bad.error


def test_wordwrap_of_a_huge_text_stops_at_once():
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="wordwrap"):
        render_chat_template(
            "{% for m in messages %}{{ m.content|wordwrap(1) }}{% endfor %}",
            {"messages": [{"role": "user", "content": "x" * 3_000_000}]},
            where="t",
        )
    assert time.perf_counter() - t0 < 30  # hang guard (it ran for minutes before)


def test_a_sigterm_swallowed_by_a_callback_still_ends_the_run():
    """The handler's raise can land in JAX's gc callback, which only prints it: the run loop
    then sees the flag (a review saw 2 of 30 SIGTERMs ignored, the run exiting 0)."""
    import signal

    from jaxinfer.cli import main as cli

    with cli._sigterm_as_interrupt():
        cli._check_terminated()  # nothing yet
        handler = signal.getsignal(signal.SIGTERM)
        try:
            handler(signal.SIGTERM, None)
        except cli.Terminated:
            pass  # what a callback that swallows exceptions does
        with pytest.raises(cli.Terminated):
            cli._check_terminated()
    with cli._sigterm_as_interrupt():
        cli._check_terminated()  # a new run starts clear
