"""`jaxinfer generate`'s progress line says "compiling (k/n)" while a step compiles
(jaxinfer/compile/progress.py)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from jaxinfer.cli import main as cli
from jaxinfer.compile.progress import CompileProgressBar, CompileWatch

SHARED = Path(
    os.environ.get("JAXINFER_SHARED", Path(__file__).resolve().parents[1].parent / "shared")
)
STORIES = SHARED / "models" / "stories260K"


def test_watch_shows_compiling_from_key_growth_until_a_step_is_counted():
    w = CompileWatch()
    assert w.observe(0, 0) is None  # nothing dispatched yet
    assert w.observe(2, 0) == "compiling (2)"  # first step's forward + sample keys
    assert w.observe(2, 0) == "compiling (2)"  # still inside the dispatch
    assert w.observe(2, 1) is None  # its tokens were read back: compiled
    assert w.observe(2, 5) is None  # steps on known shapes
    assert w.observe(3, 5) == "compiling (3)"  # a new decode bucket
    assert w.observe(4, 5) == "compiling (4)"  # and its sampling variant, same dispatch
    assert w.observe(4, 6) is None


def test_watch_shows_k_of_the_predicted_n_and_n_grows_past_a_short_prediction():
    w = CompileWatch()
    w.expected = 5
    assert w.observe(2, 0) == "compiling (2/5)"
    assert w.observe(2, 1) is None
    assert w.observe(5, 1) == "compiling (5/5)"
    assert w.observe(6, 2) == "compiling (6/6)"  # more keys than predicted: n is k
    assert w.observe(6, 3) is None


def test_bar_expect_turns_k_into_k_of_n_on_the_line():
    engine = SimpleNamespace(compile_keys={("forward", 1), ("sample", 1)}, num_steps=0)
    bar = _Bar()
    pbar = CompileProgressBar(bar, SimpleNamespace(engines=[engine]), interval=60.0)
    pbar.expect(7)
    assert bar.postfixes[-1] == "compiling (2/7)"
    engine.num_steps = 1
    pbar.set_postfix_str("1.0 tok/s")
    assert bar.postfixes[-1] == "1.0 tok/s"
    pbar.close()


class _Bar:
    """A tqdm stand-in that records the postfixes set."""

    def __init__(self):
        self.postfixes, self.n, self.closed = [], 0, False

    def set_postfix_str(self, s):
        self.postfixes.append(s)

    def update(self, n=1):
        self.n += n

    def close(self):
        self.closed = True


def test_bar_shows_compiling_beside_the_postfix_and_clears_it_on_close():
    engine = SimpleNamespace(compile_keys={("forward", 1), ("sample", 1)}, num_steps=0)
    bar = _Bar()
    pbar = CompileProgressBar(bar, SimpleNamespace(engines=[engine]), interval=60.0)
    deadline = time.monotonic() + 5
    while not bar.postfixes and time.monotonic() < deadline:  # the poller's first look
        time.sleep(0.01)
    assert bar.postfixes[-1] == "compiling (2)"
    pbar.set_postfix_str("3.0 tok/s")  # no step counted yet: still compiling
    assert bar.postfixes[-1] == "compiling (2), 3.0 tok/s"
    pbar.close()  # a job ending while the line says compiling
    assert bar.postfixes[-1] == "3.0 tok/s" and bar.closed


@pytest.mark.skipif(not STORIES.is_dir(), reason=f"stories260K directory {STORIES} is absent")
def test_new_engine_shape_shows_compiling_on_the_progress_line(tmp_path, capsys, monkeypatch):
    # test_cli.py's engine shape (compiled once per process). A fresh engine's first steps add
    # new compile keys; with XLA's executables already cached (in memory or on disk) the
    # "compile" can be shorter than the 0.1 s poll, so a dispatch that adds keys is held 0.4 s,
    # standing in for a cold compilation.
    from jaxinfer.engine.runner import ModelRunner

    run = ModelRunner.run

    def slow_when_new(self, *a, **kw):
        before = len(self.compile_keys)
        out = run(self, *a, **kw)
        if len(self.compile_keys) > before:
            time.sleep(0.4)
        return out

    monkeypatch.setattr(ModelRunner, "run", slow_when_new)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "Once upon a time"}) + "\n")
    rc = cli.main(
        [
            "generate",
            "--model",
            str(STORIES),
            "--prompts",
            str(prompts),
            "--out",
            str(tmp_path / "o.jsonl"),
            "--max-model-len",
            "256",
            "--max-num-seqs",
            "8",
            "--temperature",
            "0",
            "--max-tokens",
            "4",
        ]
    )
    assert rc == 0
    cap = capsys.readouterr()
    # k counts the keys dispatched so far (2 after the first step: forward + sampling); n the
    # job's predicted keys (jaxinfer.compile.plan): one prompt of under 32 tokens and 4 outputs is
    # a prefill step (Tp 32, 1 row, M 4), decode steps of 1 row (M 4) and 1-row sampling: 3.
    assert re.search(r"compiling \((2|3)/3\)", cap.err), cap.err
    bar_lines = [ln for ln in cap.err.replace("\r", "\n").splitlines() if ln.startswith("prompts")]
    assert "compiling" not in bar_lines[-1], bar_lines  # the finished bar says nothing compiles
    summary = json.loads(cap.out.strip().splitlines()[-1])
    assert summary["completed"] == 1
    # the bar's token count is the tokens the record holds (4: --max-tokens)
    n = summary["completion_tokens"]
    assert n == 4 and re.search(rf"\b{n} tok, [0-9.]+ tok/s", bar_lines[-1]), bar_lines


def test_token_count_adds_this_runs_tokens_of_every_completion(stories_llm):
    """The bar's token count over real streamed outputs equals the tokens asked for, counted by
    hand: EOS ignored, so every completion runs to its max_tokens; n > 1 streams per completion
    then one final output of all n; a resumed request's carried-over tokens are not this run's."""
    from jaxinfer.compile.progress import TokenCount
    from jaxinfer.engine.resume import ResumeState
    from jaxinfer.sampling.params import SamplingParams

    params = [
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
    ]
    greedy = stories_llm.generate("Lily saw a", params[2])[0].token_ids
    resume = [None, None, ResumeState(0, tuple(greedy[:4]))]  # 4 of its 9 tokens carried over
    count, seen_mid_run = TokenCount(), []
    for out in stories_llm.generate_stream(
        ["Once upon a time", "Tom and his dog", "Lily saw a"], params, resume=resume
    ):
        count.add(out)
        if not out.finished:
            seen_mid_run.append(count.total)
    assert count.total == 7 + 3 * 5 + (9 - 4)
    assert seen_mid_run and seen_mid_run[0] >= 1  # counted before any request finished


def test_bar_shows_tokens_before_any_prompt_finishes_and_the_total_at_the_end():
    from jaxinfer.outputs import RequestMetrics, RequestOutput

    bar = _Bar()
    pbar = CompileProgressBar(bar, SimpleNamespace(engines=[]), interval=0.0)

    def out(rid, n, finish=None):
        return RequestOutput(
            rid, None, [1], token_ids=[5] * n, finish_reason=finish,
            metrics=RequestMetrics(completion_tokens=n),
        )  # fmt: skip

    pbar.add_output(out("a", 1))
    pbar.add_output(out("b", 1))
    pbar.add_output(out("a", 2))
    assert bar.n == 0 and re.fullmatch(r"3 tok, [0-9.]+ tok/s", bar.postfixes[-1])
    pbar.add_output(out("a", 3, "length"))
    pbar.update(1)
    pbar.close()
    assert bar.n == 1 and re.fullmatch(r"4 tok, [0-9.]+ tok/s", bar.postfixes[-1]) and bar.closed
