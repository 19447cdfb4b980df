"""`jaxinfer serve` (issue 19): a port in use fails before the model loads (in process: the exit
status ``main`` returns), and, as a process, SIGTERM drains (the listening socket closes, the
running request finishes, exit status 0).

A subprocess on 127.0.0.1; every wait is bounded in time."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import STORIES

pytest.importorskip("uvicorn")


def _serve(*args: str, **kw) -> list[str]:
    return [sys.executable, "-m", "jaxinfer.cli.main", "serve", "--model", str(STORIES), *args]


def test_port_in_use_is_a_clear_error_before_loading(monkeypatch, capsys):
    import jaxinfer.cli.llm_from_args
    from jaxinfer.cli import main as cli

    def load(args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(jaxinfer.cli.llm_from_args, "load_llm", load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc = cli.main(_serve("--port", str(port))[3:])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"cannot listen on 127.0.0.1:{port}: the address is already in use" in err
    assert "serving" not in err  # it stopped before loading the model


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_the_running_request_and_exits_0(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 - read after the process ends
    # 32-token pages: 255 tokens need 8 pages, so decode compiles two page buckets (4, 8)
    # (--warmup requests: two small jobs; the default --warmup would compile ~40 step shapes)
    proc = subprocess.Popen(
        _serve(
            "--port",
            str(port),
            "--warmup",
            "requests",
            "--max-num-seqs",
            "4",
            "--page-size",
            "32",
            "--log-level",
            "info",
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ},
    )
    try:
        deadline = time.monotonic() + 240
        while True:  # the port listens only once the model is loaded and warmed up
            assert proc.poll() is None, "the server exited"
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {
            "prompt": "Once upon a time",
            "max_tokens": 250,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        lines: list[str] = []
        first = threading.Event()

        def read():
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for ln in r.iter_lines():
                    if ln:
                        lines.append(ln)
                        first.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert first.wait(60), "no first chunk"
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(url + "/health", timeout=5)
        reader.join(120)
        assert not reader.is_alive()
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][6:])["usage"]
    assert usage["completion_tokens"] == 250  # the request in flight finished whole
    log.seek(0)
    text = log.read()
    assert "Waiting for connections to close" in text  # it was in flight at the SIGTERM
    assert "jaxinfer: stopped" in text


def test_serve_takes_every_engine_flag_of_generate():
    from jaxinfer.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    gen, serve = sub["generate"], sub["serve"]

    def flags(p, titles):
        return {
            s
            for g in p._action_groups
            if g.title in titles
            for a in g._group_actions
            for s in a.option_strings
        }

    from jaxinfer.args import option_fields, option_of

    titles = {option_of(f.name).group for f in option_fields()}  # model, engine, parallelism, ...
    engine = flags(gen, titles) - {"--multihost", "--no-multihost"}
    serving = {"--tool-call-parser", "--enable-auto-tool-choice", "--no-auto-tool-choice"}
    serving |= {"--reasoning-parser"}  # serve's alone: how the server reads replies
    assert "--kv-cache-dtype" in engine and "--no-prefix-caching" in engine
    assert engine | serving == flags(serve, titles) and not serving & engine
    assert {
        "--model",
        "--tokenizer",
        "--skip-tokenizer-init",
        "--host",
        "--port",
        "--max-queue",
        "--warmup",
        "--drain-timeout",
    } <= flags(serve, ("model", "server"))
    args = parser.parse_args(
        [
            "serve",
            "--model",
            "m",
            "--dtype",
            "bfloat16",
            "--port",
            "9",
            "--no-prefix-caching",
            "--speculative",
            "ngram",
            "--max-queue",
            "5",
            "--kv-cache-dtype",
            "int8",
        ]
    )
    assert (
        args.dtype,
        args.port,
        args.enable_prefix_caching,
        args.speculative,
        args.max_queue,
        args.kv_cache_dtype,
        args.host,
    ) == ("bfloat16", 9, False, "ngram", 5, "int8", "127.0.0.1")
