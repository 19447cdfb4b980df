"""A chat template given by the user (``LLM(chat_template=...)``, ``--chat-template`` for generate
and serve, vLLM's option): a Jinja file or the template text. ``examples/chat_template.jinja``
makes stories260K (which has none) chat: a one-message conversation renders as BOS and the
message, so the greedy reply must continue it exactly as llama2.c's reference does
(``greedy_reference.json``), through ``chat()``, a ``{"messages": ...}`` record of ``jaxinfer
generate`` and the server's chat route. Bad templates are errors naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import stories_reference

from jaxinfer.sampling.params import SamplingParams

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "chat_template.jinja"
N = 24  # greedy tokens compared with the reference


@pytest.fixture(scope="module")
def reference():
    """llama2.c's greedy text for "Once upon a time", past the prompt, and the message."""
    (case,) = [c for c in stories_reference() if c["prompt"] == "Once upon a time"]
    return case["prompt"], case["expected"][len(case["prompt"]) :]


@pytest.fixture(scope="module")
def chat_llm(stories_dir):
    from jaxinfer.llm import LLM

    return LLM(stories_dir, max_num_seqs=4, chat_template=EXAMPLE, compilation_cache=False)


def test_chat_with_the_example_template_continues_like_llama2c(chat_llm, reference):
    prompt, want = reference
    messages = [{"role": "user", "content": prompt}]
    (out,) = chat_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=N))
    text = out.outputs[0].text
    assert len(out.outputs[0].token_ids) == N and want.startswith(text) and len(text) > 40, text
    assert chat_llm.tokenizer.chat_template == EXAMPLE.read_text()
    # two turns: one line each, the model continuing the last
    two = chat_llm.tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": "there was"}], add_generation_prompt=True
    )
    assert two == "<s> Once upon a time\nthere was"


def test_template_text_instead_of_a_file(stories_dir, chat_llm):
    from jaxinfer.args import EngineArgs

    text = "{{ bos_token }}{% for m in messages %} {{ m['content'] }}{% endfor %}"
    args = EngineArgs(stories_dir, chat_template=text)
    assert args.read_chat_template() == text
    ids, _ = chat_llm.encode_prompt({"messages": [{"role": "user", "content": "Tom"}]})
    assert ids == chat_llm.tokenizer.encode("Tom")  # the example: BOS, then the text


def test_generate_messages_record_with_chat_template(stories_dir, tmp_path, capsys, reference):
    from jaxinfer.cli import main as cli

    prompt, want = reference
    prompts, out = tmp_path / "chat.jsonl", tmp_path / "out.jsonl"
    record = {"id": "c", "messages": [{"role": "user", "content": prompt}], "max_tokens": N}
    prompts.write_text(json.dumps(record) + "\n")
    argv = ["generate", "--model", str(stories_dir), "--prompts", str(prompts), "--out", str(out)]
    argv += ["--temperature", "0", "--no-progress", "--no-compilation-cache"]
    assert cli.main([*argv, "--chat-template", str(EXAMPLE)]) == 0
    (got,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert got["id"] == "c" and "error" not in got, got
    assert want.startswith(got["text"]) and len(got["text"]) > 40, got
    # without it, the record fails alone, saying how to give one
    out.unlink()
    capsys.readouterr()
    assert cli.main(argv) == 0
    (got,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert "has no chat template" in got["error"] and "--chat-template FILE" in got["error"]


def test_bad_template_files_are_errors_naming_the_file(stories_dir, tmp_path, capsys):
    from jaxinfer.cli import main as cli
    from jaxinfer.llm import LLM

    missing = tmp_path / "nope.jinja"
    broken = tmp_path / "broken.jinja"
    broken.write_text("{{ bos_token }}\n{% for m in messages %}{{ m['content'] }}\n")  # no endfor
    with pytest.raises(ValueError, match=rf"^chat_template='{missing}': no such file"):
        LLM("/nonexistent/model", chat_template=str(missing))  # before the model is looked at
    with pytest.raises(ValueError, match=rf"^chat_template='{broken}': the chat template does no"):
        LLM("/nonexistent/model", chat_template=str(broken))
    with pytest.raises(ValueError, match=r"chat_template \(the template text given\): .*compile"):
        LLM("/nonexistent/model", chat_template="{% if %}")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once"}\n')
    argv = ["generate", "--model", str(stories_dir), "--prompts", str(prompts)]
    argv += ["--out", str(tmp_path / "o.jsonl"), "--no-progress"]
    for path, why in ((missing, "no such file"), (broken, "does not compile")):
        assert cli.main([*argv, "--chat-template", str(path)]) == cli.EXIT_USAGE
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(
            f"jaxinfer: error: invalid engine setting: --chat-template {path}: "
        ), err
        assert why in err[0] and ("template line 2" in err[0]) == (path == broken)
    assert not (tmp_path / "o.jsonl").exists()


def test_chat_without_a_template_says_how_to_give_one(stories_llm):
    from jaxinfer.errors import TokenizerError

    with pytest.raises(TokenizerError, match=r"chat_template=FILE\) \(examples/chat_template"):
        stories_llm.chat([{"role": "user", "content": "hi"}])


def test_server_chat_route_uses_the_template(chat_llm, reference):
    fastapi = pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from jaxinfer.server.app import create_app

    del fastapi
    prompt, want = reference
    body = {
        "model": "stories",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": N,
        "temperature": 0,
    }
    with TestClient(create_app(chat_llm, model_name="stories")) as client:
        r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert want.startswith(text) and len(text) > 40, text


def test_version_is_the_package_metadata(capsys):
    import importlib.metadata

    import jaxinfer
    from jaxinfer.cli import main as cli

    assert jaxinfer.__version__ == importlib.metadata.version("jaxinfer")
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"jaxinfer {jaxinfer.__version__}"


def test_version_of_a_source_tree_without_metadata(monkeypatch):
    import importlib.metadata
    import tomllib

    from jaxinfer import version

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    want = tomllib.loads(pyproject.read_text())["project"]["version"]
    assert version.package_version() == want
