"""`jaxinfer serve` stopped by SIGTERM while it warms up (issue 19): exit status 0 with a message
naming the signal, as a drain, not death by the signal (143). Subprocess on 127.0.0.1; every wait
is bounded in time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import STORIES

pytest.importorskip("uvicorn")


def test_sigterm_during_warmup_exits_0_with_a_message():
    # --warmup all compiles hundreds of step shapes: the SIGTERM lands in the middle of it
    proc = subprocess.Popen([sys.executable, "-m", "jaxinfer.cli", "serve", "--model",
                             str(STORIES), "--port", "0", "--warmup", "all"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ})
    try:
        deadline = time.monotonic() + 180
        seen = []
        while not any("warming up" in ln for ln in seen):
            assert time.monotonic() < deadline, "no warm-up line"
            ln = proc.stderr.readline()
            assert ln, f"the server exited early: {''.join(seen)}"
            seen.append(ln)
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()  # EOF once the process has exited
        assert proc.wait(120) == 0, "".join(seen) + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert "SIGTERM: stopped during start-up, before serving" in rest
    assert "Traceback" not in rest and "on http://" not in rest
