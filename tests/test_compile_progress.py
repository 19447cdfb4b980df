"""`jaxinfer generate`'s progress line says "compiling (k)" while a step compiles
(jaxinfer/compile_progress.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from jaxinfer import cli
from jaxinfer.compile_progress import CompileWatch

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


@pytest.mark.skipif(not STORIES.is_dir(), reason=f"stories260K directory {STORIES} is absent")
def test_new_engine_shape_shows_compiling_on_the_progress_line(tmp_path, capsys, monkeypatch):
    # test_cli.py's engine shape (compiled once per process). A fresh engine's first steps add
    # new compile keys; with XLA's executables already cached (in memory or on disk) the
    # "compile" can be shorter than the 0.1 s poll, so a dispatch that adds keys is held 0.4 s,
    # standing in for a cold compilation.
    from jaxinfer import engine as engine_mod

    dispatch = engine_mod.Engine._dispatch

    def slow_when_new(self, *a, **kw):
        before = len(self.compile_keys)
        out = dispatch(self, *a, **kw)
        if len(self.compile_keys) > before:
            time.sleep(0.4)
        return out

    monkeypatch.setattr(engine_mod.Engine, "_dispatch", slow_when_new)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "Once upon a time"}) + "\n")
    rc = cli.main(["generate", "--model", str(STORIES), "--prompts", str(prompts),
                   "--out", str(tmp_path / "o.jsonl"), "--max-model-len", "256",
                   "--max-num-seqs", "8", "--temperature", "0", "--max-tokens", "4"])
    assert rc == 0
    cap = capsys.readouterr()
    # The first step dispatches a forward and a sampling key: 2.
    assert "compiling (2)" in cap.err, cap.err
    assert json.loads(cap.out.strip().splitlines()[-1])["completed"] == 1
