"""``jaxinfer generate`` end to end on stories260K: greedy outputs equal llama2.c's reference, bad
records become error records while the rest complete, a killed run resumes with every id exactly
once, plain-text input, ``--help`` and usage errors; SIGTERM ends a run with status 143, even
when a callback swallows the handler's exception.

Runs ``jaxinfer.cli.main.main`` in-process (sharing compiled steps) with one set of engine flags;
only the kill test uses a subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import STORIES_CLI_FLAGS

from jaxinfer.cli import main as cli

SHARED = Path(
    os.environ.get("JAXINFER_SHARED", Path(__file__).resolve().parents[1].parent / "shared")
)
STORIES = SHARED / "models" / "stories260K"
needs_model = pytest.mark.skipif(
    not STORIES.is_dir(), reason=f"stories260K directory {STORIES} is absent (set JAXINFER_SHARED)"
)
BOS = 1
# One engine shape for every test, the stories_llm fixture's, so the compiled steps are shared.
ENGINE = STORIES_CLI_FLAGS


def _run(tmp_path, prompts: Path, out: Path, *flags: str, capsys=None) -> tuple[int, dict | None]:
    rc = cli.main(
        [
            "generate",
            "--model",
            str(STORIES),
            "--prompts",
            str(prompts),
            "--out",
            str(out),
            *ENGINE,
            *flags,
        ]
    )
    summary = None
    if capsys is not None:
        stdout = capsys.readouterr().out.strip().splitlines()
        assert len(stdout) == 1, stdout  # stdout is the summary object alone
        summary = json.loads(stdout[0])
    return rc, summary


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@needs_model
def test_greedy_matches_llama2c_reference(tmp_path, capsys):
    from jaxinfer.tokenizers import load_tokenizer

    tok = load_tokenizer(STORIES / "tok512.model", vocab_size=512)
    cases = json.loads((STORIES / "greedy_reference.json").read_text())
    records, prompt_ids = [], {}
    for i, c in enumerate(cases):
        ids = tok.encode(c["prompt"])  # BOS first
        # Empty prompt text is BOS alone on this tokenizer (run.c's unconditional start).
        rec = {"prompt": c["prompt"]}
        rec.update(id=f"ref{i}", max_tokens=c["max_steps"] - (len(ids) - 1), stop_token_ids=[BOS])
        records.append(rec)
        prompt_ids[f"ref{i}"] = ids
    prompts = _write_jsonl(tmp_path / "ref.jsonl", records)
    out = tmp_path / "out.jsonl"
    rc, summary = _run(tmp_path, prompts, out, "--temperature", "0", capsys=capsys)
    assert rc == 0
    assert summary["completed"] == len(cases) and summary["errors"] == 0
    assert summary["compilations"] >= 1 and summary["preemptions"] == 0
    got = {r["id"]: r for r in _records(out)}
    assert sorted(got) == sorted(prompt_ids)
    for i, c in enumerate(cases):
        r = got[f"ref{i}"]
        text = tok.decode(prompt_ids[f"ref{i}"] + r["token_ids"], skip_special_tokens=True)
        assert text == c["expected"], (c["prompt"], text)
        assert r["usage"]["prompt_tokens"] == len(prompt_ids[f"ref{i}"])
        assert r["usage"]["completion_tokens"] == len(r["token_ids"])


@needs_model
def test_bad_records_become_error_records_and_the_rest_complete(tmp_path, capsys):
    lines = [
        {"id": "a", "prompt": "Once upon a time", "max_tokens": 4},
        "{not json",
        {"id": "b", "prompt": "Tom", "temprature": 0.5},  # unknown sampling key
        {"id": "c", "prompt": "Tom", "top_p": 2.0},
        {"id": "d", "prompt_token_ids": []},
        {"id": "e", "prompt_token_ids": [BOS] + [300] * 600},  # longer than max_model_len
        {"id": "a", "prompt": "Lily"},  # duplicate id
        {"prompt": "Lily wanted to", "max_tokens": 3},  # id = 0-based line number
        [1, 2],
        {"id": "f", "prompt": "x", "messages": []},
        {"id": "g", "messages": [{"role": "user", "content": "hi"}]},  # no chat template
    ]
    prompts = _write_jsonl(tmp_path / "p.jsonl", lines)
    out = tmp_path / "out.jsonl"
    rc, summary = _run(tmp_path, prompts, out, "--temperature", "0", capsys=capsys)
    assert rc == 0
    recs = _records(out)
    ok = {r["id"]: r for r in recs if "error" not in r}
    errs = [r for r in recs if "error" in r]
    assert sorted(ok) == ["7", "a"]
    assert ok["a"]["finish_reason"] == "length" and len(ok["a"]["token_ids"]) == 4
    assert len(ok["7"]["token_ids"]) == 3
    assert all(
        r["finish_reason"] == "error" and set(r) == {"id", "error", "finish_reason"} for r in errs
    )
    by_id = {r["id"]: r["error"] for r in errs}
    assert "line 2" in by_id["line-2"] and "JSON" in by_id["line-2"]
    assert "line 3" in by_id["b"] and "temprature" in by_id["b"]
    assert "line 4" in by_id["c"] and "top_p" in by_id["c"]
    assert "line 5" in by_id["d"] and "empty" in by_id["d"]
    assert "line 6" in by_id["e"] and "max_model_len" in by_id["e"]
    assert "line 7" in by_id["a@line-7"] and "duplicate" in by_id["a@line-7"]
    assert len({r["id"] for r in recs}) == len(recs)  # every id exactly once
    assert "line 9" in by_id["line-9"]
    assert "line 10" in by_id["f"]
    assert "line 11" in by_id["g"] and "chat template" in by_id["g"]
    assert summary["errors"] == len(errs) == 9 and summary["completed"] == 2
    assert summary["prompts"] == len(lines)

    # A rerun writes nothing new (the duplicate's error record included).
    rc, summary = _run(tmp_path, prompts, out, capsys=capsys)
    assert rc == 0 and summary["skipped"] == len(lines) and summary["completed"] == 0
    assert _records(out) == recs


@needs_model
def test_plain_text_prompts(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Once upon a time\n\nTom and his dog\n")
    out = tmp_path / "out.jsonl"
    rc, summary = _run(
        tmp_path, prompts, out, "--temperature", "0", "--max-tokens", "5", capsys=capsys
    )
    assert rc == 0 and summary["completed"] == 2
    recs = {r["id"]: r for r in _records(out)}
    assert sorted(recs) == ["0", "2"]
    assert all(len(r["token_ids"]) == 5 for r in recs.values())
    assert recs["0"]["text"].startswith(", there was")


@needs_model
def test_killed_run_resumes_with_every_id_exactly_once(tmp_path, capsys):
    # Two quick prompts finish first; the long ones keep the run going until the kill.
    lines = [{"id": f"q{i}", "prompt": "Once upon a time", "max_tokens": 2} for i in range(2)]
    lines += [
        {
            "id": f"l{i}",
            "prompt": "Tom and his dog",
            "max_tokens": 120,
            "ignore_eos": True,
            "seed": i,
        }
        for i in range(6)
    ]
    prompts = _write_jsonl(tmp_path / "p.jsonl", lines)
    out = tmp_path / "out.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "jaxinfer",
        "generate",
        "--model",
        str(STORIES),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        *ENGINE,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and out.read_text().count("\n") >= 1):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no record within 120 s"
            time.sleep(0.05)
        assert proc.poll() is None, "the run finished before it could be killed"
        # A second run given the same --out meanwhile is refused (it holds no lock to write).
        rc, _ = _run(tmp_path, prompts, out)
        err = capsys.readouterr().err
        assert rc == 2 and "being written by another jaxinfer run" in err, err
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate()
    before = out.read_text().splitlines(keepends=True)
    done_before = [json.loads(x)["id"] for x in before if x.endswith("\n")]
    assert 1 <= len(done_before) < len(lines)
    with open(out, "a") as f:  # a write cut short by the crash
        f.write('{"id": "l5", "text": "half a rec')

    rc, summary = _run(tmp_path, prompts, out, capsys=capsys)
    assert rc == 0
    assert summary["skipped"] == len(done_before)
    assert summary["completed"] == len(lines) - len(done_before)
    after = out.read_text().splitlines(keepends=True)
    assert after[: len(done_before)] == before[: len(done_before)]  # not regenerated
    ids = [json.loads(x)["id"] for x in after]
    assert sorted(ids) == sorted(r["id"] for r in lines)  # every id exactly once
    assert all("error" not in json.loads(x) for x in after)


def test_help_lists_every_flag_with_its_default(capsys):
    assert cli.main(["generate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in [
        "--model",
        "--prompts",
        "--out",
        "--tokenizer",
        "--dtype",
        "--max-model-len",
        "--kv-pages",
        "--page-size",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--attn-impl",
        "--seed",
        "--temperature",
        "--top-p",
        "--top-k",
        "--min-p",
        "--repetition-penalty",
        "--presence-penalty",
        "--frequency-penalty",
        "--max-tokens",
        "--min-tokens",
        "--stop",
        "--stop-token-ids",
        "--ignore-eos",
        "--logprobs",
        "--sampling-seed",
        "--no-progress",
        "--quiet",
        "--skip-tokenizer-init",
        "--quantization",
        "--kv-cache-dtype",
        "--async-scheduling",
        "--tensor-parallel-size",
        "--data-parallel-size",
        "--multihost",
        "--speculative",
        "--num-speculative-tokens",
        "--draft-model",
        "--draft-heads",
        "--checkpoint-interval",
        "--batch-invariant",
    ]:
        assert flag in text, flag
    for default in [
        "(default: float32)",
        "(default: 16)",
        "(default: 64)",
        "(default: auto)",
        "(default: 1.0)",
    ]:
        assert default in text, default
    assert "bfloat16" in text and "--temperature 0 for greedy" in text


def test_usage_lines_are_short_and_help_says_what_logprobs_and_the_seeds_are(capsys):
    """Each command's usage line names its required flags and "[options]" (argparse's own listed
    every flag: 35 lines for generate); the help of --logprobs, --seed / --sampling-seed and
    --kv-cache-memory-gb says what they are (issue 29's new-user trial)."""
    for command, required in [
        ("generate", "--model PATH --prompts FILE --out FILE"),
        ("serve", "--model PATH"),
        ("quantize", "--model PATH --out DIR"),
        ("train-draft-heads", "--model PATH --out DIR"),
    ]:
        assert cli.main([command, "--help"]) == 0
        usage = capsys.readouterr().out.split("\n\n")[0]
        assert usage == f"usage: jaxinfer {command} {required} [options]", usage
    assert cli.main(["generate", "--prompts", "p.jsonl"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "usage: jaxinfer generate --model PATH --prompts FILE --out FILE [options]",
        "jaxinfer generate: error: the following arguments are required: --out, --model",
    ]
    assert cli.main(["generate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--logprobs N number of top logprobs returned per generated token" in text
    assert "--sampling-seed SEED sampling seed (SamplingParams.seed" in text
    assert "drawn from the engine's RNG, which --seed seeds" in text
    assert "--seed N engine seed: seeds the RNG that draws a sampling seed" in text
    assert "which generate's --sampling-seed sets" in text
    assert "default KV pool, in GiB (2**30 bytes) per device" in text


def test_usage_errors_exit_2_with_one_line(tmp_path, capsys):
    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    cases = [
        ["--model", str(tmp_path / "nope"), "--prompts", str(prompts)],
        ["--model", str(tmp_path), "--prompts", str(tmp_path / "missing.jsonl")],
        ["--model", str(prompts), "--prompts", str(prompts)],  # not a checkpoint
        ["--model", str(tmp_path), "--prompts", str(prompts), "--top-p", "2"],
        ["--model", str(STORIES), "--prompts", str(prompts), "--draft-model", "layers:2"],
        ["--model", str(STORIES), "--prompts", str(prompts), "--draft-heads", str(tmp_path)],
        [
            "--model",
            str(STORIES),
            "--prompts",
            str(prompts),
            "--speculative",
            "draft-model",
            "--draft-model",
            "layers:abc",
        ],
        [
            "--model",
            str(STORIES),
            "--prompts",
            str(prompts),
            "--speculative",
            "draft-model",
            "--draft-model",
            str(tmp_path / "nope"),
        ],
    ]
    for args in cases:
        rc = cli.main(["generate", *args, "--out", str(tmp_path / "o.jsonl"), "--no-progress"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2, args
        assert len(err) == 1 and err[0].startswith("jaxinfer: error:"), err
    assert not (tmp_path / "o.jsonl").exists()


def test_sigterm_is_an_interrupt_with_status_143():
    # SIGTERM inside the run raises like Ctrl-C (so the run finishes its line and can resume),
    # but the exit status tells the two apart: 128 + 15 vs 130.
    received = []

    def previous(signum, frame):  # stands in for whatever handler the caller had installed
        received.append(signum)

    outer = signal.signal(signal.SIGTERM, previous)
    try:
        with pytest.raises(cli.Terminated):
            with cli._sigterm_as_interrupt():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)
        assert received == []  # the signal inside went to the run's handler only
        # On leaving, exactly the caller's handler is back (not SIG_DFL, not the run's handler),
        # and a later SIGTERM reaches it instead of raising.
        assert signal.getsignal(signal.SIGTERM) is previous
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(500):
            if received:
                break
            time.sleep(0.01)
        assert received == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, outer)
    assert cli._interrupt_status(cli.Terminated()) == 143
    assert cli._interrupt_status(KeyboardInterrupt()) == 130


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


def test_an_interrupt_swallowed_by_a_gc_callback_comes_back():
    """A Ctrl-C whose KeyboardInterrupt is raised inside a garbage-collection callback (as jax's
    ``_xla_gc_callback``) is only printed by Python and lost; inside
    ``interrupts_not_swallowed`` it is raised again in the main thread, unprinted."""
    import gc

    from jaxinfer.cli.interrupts import interrupts_not_swallowed

    def callback(phase, info):
        if phase == "start":
            gc.callbacks.remove(callback)
            raise KeyboardInterrupt

    outer = signal.signal(signal.SIGINT, signal.default_int_handler)  # xdist workers may not
    try:
        with pytest.raises(KeyboardInterrupt), interrupts_not_swallowed():
            gc.callbacks.append(callback)
            gc.collect()
            for _ in range(500):  # bounded: 5 s
                time.sleep(0.01)
    finally:
        signal.signal(signal.SIGINT, outer)
        if callback in gc.callbacks:
            gc.callbacks.remove(callback)


# The command run with a SIGINT sent to itself as it first imports ``module``: jax (while the
# command's modules import) or a module LLM imports as it loads the model. At a normal exit it
# says whether the command's modules were all imported (an interrupt while they import is held
# until they are: raised inside jax's native start-up code, it aborted the process).
_SIGINT_AT_IMPORT = """
import atexit, importlib.abc, os, runpy, signal, sys

atexit.register(lambda: print("cli imported:", "jaxinfer.cli.main" in sys.modules))

class SigintAt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, SigintAt())
sys.argv = ["jaxinfer", *{argv!r}]
runpy.run_module("jaxinfer", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(
    "module, message",
    [
        ("jax", "jaxinfer: interrupted"),
        ("jaxinfer.models.host_layout", "jaxinfer: interrupted before writing anything"),
    ],
)
def test_ctrl_c_while_importing_or_loading_is_one_line_and_status_130(tmp_path, module, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once upon a time"}\n')
    argv = ["generate", "--model", str(STORIES), "--prompts", str(prompts)]
    argv += ["--out", str(tmp_path / "o.jsonl"), "--no-progress"]
    code = _SIGINT_AT_IMPORT.format(module=module, argv=argv)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines() == [message], proc.stderr
    assert not (tmp_path / "o.jsonl").exists()
    if module == "jax":
        assert proc.stdout == "cli imported: True\n"
