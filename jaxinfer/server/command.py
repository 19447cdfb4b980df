"""``jaxinfer serve``: the command line of the OpenAI-compatible server.

    jaxinfer serve --model ../shared/models/stories260K --port 8000

Takes the model and engine flags of ``jaxinfer generate`` (both come from
``jaxinfer.args.EngineArgs.add_cli_args``; ``--multihost`` apart: one process serves) plus
``--host``, ``--port``, ``--served-model-name``,
``--max-queue``, ``--warmup`` and ``--drain-timeout``. Start-up order: the port is bound first (a
port in use fails at once, exit status 2, before the model loads), then the model is loaded and
optionally warmed up, and only then does the socket listen: no client connects to a server
without a model. SIGTERM (or Ctrl-C) drains: the socket stops accepting, running requests finish
(up to ``--drain-timeout`` seconds, then they are aborted), the exit status is 0; one that
arrives while the model loads or warms up stops the start-up, also with exit status 0.

This module imports no server library until ``cmd_serve`` runs, so ``jaxinfer --help`` works
without the ``serve`` extra.
"""

from __future__ import annotations

import argparse
import errno
import signal
import socket
import sys

NOT_SERVED = ("multihost",)
"""Engine options ``serve`` has no flag for: one process serves (no multi-host serving yet)."""


def add_serve_parser(sub, fmt) -> argparse.ArgumentParser:
    """Registers ``serve`` on ``sub`` with the model and engine flags (``EngineArgs``)."""
    from jaxinfer.args import EngineArgs

    p = sub.add_parser(
        "serve",
        formatter_class=fmt,
        usage="%(prog)s --model PATH [options]",
        help="serve a model over HTTP with OpenAI's API (completions, chat, streaming)",
        description="An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics, /tokenize, /detokenize) on one engine: every "
        "connected client shares the continuous batch. Needs the serve extra: "
        "pip install -e '.[serve]'.",
    )
    EngineArgs.add_cli_args(p, exclude=NOT_SERVED)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    s.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients pass as 'model' (default: --model as given)",
    )
    s.add_argument(
        "--max-queue",
        type=int,
        default=None,
        metavar="N",
        help="most sequences waiting beyond --max-num-seqs; more get HTTP 503 (default: no limit)",
    )
    s.add_argument(
        "--warmup",
        nargs="?",
        const="cover",
        default=None,
        choices=("cover", "serving", "all", "requests"),
        help="compile step shapes before the port opens. cover (what --warmup alone means): "
        "a set of shapes one bucket above every shape the buckets allow, so every step runs "
        "padded to a compiled one at once (jaxinfer.compile.warmup.cover_keys, "
        "jaxinfer.compile.buckets); serving: every step with at most one prefill row "
        "(jaxinfer.compile.warmup.serving_keys, ~2x cover's shapes); all: every step shape "
        "(~9x); requests: run one request and a batch of eight (default: none, each step "
        "shape compiles when first used)",
    )
    s.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long running requests may take to finish",
    )
    s.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level",
    )
    return p


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket; raises UsageError naming the address."""
    from jaxinfer.cli.prompts_file import UsageError

    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UsageError(f"--host {host!r} cannot be resolved: {e}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        why = (
            "the address is already in use (is another server running there?)"
            if e.errno == errno.EADDRINUSE
            else e.strerror or str(e)
        )
        raise UsageError(f"cannot listen on {host}:{port}: {why}") from None
    sock.set_inheritable(True)
    return sock


def warmup(llm, mode: str = "cover", say=None, check=None) -> None:
    """Compiles step shapes before serving. ``mode`` "cover", "serving" or "all": every
    engine's ``precompile.cover_keys(all_keys)``, ``precompile.serving_keys`` or
    ``precompile.all_keys`` (``precompile_engines``);
    "requests": one short request and a batch of eight, greedy and sampled (``warmup_requests``).
    ``say(msg)`` logs progress; ``check()`` is called after each step shape (or warm-up request)
    and may raise to stop. Raises UsageError for "serving" or "all" on a speculative engine (its
    rounds compile other functions; use "requests")."""
    check = check or (lambda: None)
    if mode == "requests":
        warmup_requests(llm, check)
    else:
        precompile_engines(llm, mode, say or (lambda msg: None), check=check)


def precompile_engines(llm, mode: str, say, interval: float = 2.0, check=None) -> None:
    """``precompile.precompile`` on every engine of ``llm`` with the keys of ``mode``
    ("cover", "serving" or "all"); ``say`` gets "compiling k/n" at most every ``interval``
    seconds and the total time at the end; ``check()`` runs after each compiled shape."""
    import time

    from jaxinfer.cli.prompts_file import UsageError
    from jaxinfer.compile.warmup import all_keys, cover_keys, precompile, serving_keys
    from jaxinfer.sampling.sampler import MAX_LOGPROBS

    if not all(e.capabilities.precompile for e in llm.engines):
        raise UsageError(
            f"--warmup {mode} does not support speculative decoding (its rounds "
            "compile their own functions); use --warmup requests"
        )

    def keys_of(engine):
        if mode != "cover":
            return (all_keys if mode == "all" else serving_keys)(engine.ecfg)
        keys = cover_keys(all_keys(engine.ecfg))
        # Sampling with logits controls (penalties, min_tokens) and with logprobs, at every row
        # count: a request asking for them then finds its variant compiled too.
        lp = min(MAX_LOGPROBS, engine.cfg.vocab_size)
        rows = sorted({k[1] for k in keys if k[0] == "sample"})
        return keys + [
            ("sample", b, c, n) for b in rows for c, n in ((True, 0), (False, lp), (True, lp))
        ]

    keys = [keys_of(e) for e in llm.engines]
    total = sum(sum(k[0] == "forward" for k in ks) for ks in keys)
    t0 = last = time.perf_counter()
    done = 0

    def progress(k, n, key):
        nonlocal last
        if check is not None:
            check()
        now = time.perf_counter()
        if now - last >= interval or done + k in (1, total):
            last = now
            say(
                f"compiling {done + k}/{total} step shapes ({now - t0:.0f} s), last "
                f"(Td, Tp, Bp, M) = {key[1]}"
            )

    for engine, ks in zip(llm.engines, keys, strict=True):
        precompile(engine, ks, progress)
        done += sum(k[0] == "forward" for k in ks)
    say(f"compiled {total} step shapes ({mode}) in {time.perf_counter() - t0:.1f} s")


def warmup_requests(llm, check=lambda: None) -> None:
    """Compiles the step shapes most requests use: one short request, a batch of eight, greedy
    and sampled (a bucket seen later still compiles on first use)."""
    from jaxinfer.sampling.params import SamplingParams

    ids = [[llm.engine.tokenizer.bos_id or 0, 1 % llm.config.vocab_size]] * 8
    llm.generate(ids[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    check()
    llm.generate(
        ids,
        [
            SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=3, ignore_eos=True)
            for i in range(8)
        ],
    )


def cmd_serve(args: argparse.Namespace) -> int:
    """Runs the server until SIGTERM / Ctrl-C; returns the exit status (0 after a drain).

    Raises:
        UsageError: the serve extra is missing, the port cannot be bound, or the model cannot
            be loaded (exit status 2).
    """
    from pathlib import Path

    from jaxinfer.cli.prompts_file import UsageError

    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise UsageError(
            f"jaxinfer serve needs the serve extra ({e.name} is missing): pip install -e '.[serve]'"
        ) from None
    if args.max_queue is not None and args.max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not args.drain_timeout >= 0:
        raise UsageError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if not Path(args.model).exists():
        raise UsageError(f"model {args.model} does not exist")
    from jaxinfer.cli.llm_from_args import engine_args
    from jaxinfer.cli.llm_from_args import load_llm as _load_llm

    eargs = engine_args(args, multihost=False)  # every engine flag checked before the port
    sock = bind_socket(args.host, args.port)
    try:
        from jaxinfer.server.app import create_app

        say = lambda msg: print(f"jaxinfer: {msg}", file=sys.stderr, flush=True)
        try:
            with _stop_on_signal() as stop:
                llm = _load_llm(eargs)
                stop.check()
                if args.warmup:
                    say(f"warming up ({args.warmup}): compiling step shapes before the port opens")
                    warmup(llm, args.warmup, say, check=stop.check)
                stop.check()
        except _StartupStopped as e:
            say(f"{e}: stopped during start-up, before serving (no request was accepted)")
            return 0
        app = create_app(
            llm, model_name=args.served_model_name or args.model, max_queue=args.max_queue
        )
        config = uvicorn.Config(
            app,
            log_level=args.log_level,
            lifespan="on",
            timeout_graceful_shutdown=args.drain_timeout,
            timeout_keep_alive=5,
        )
        server = uvicorn.Server(config)
        host, port = sock.getsockname()[:2]
        say(f"serving {args.served_model_name or args.model} on http://{host}:{port}")
        _run_until_signal(server, sock)
        say("stopped")
        return 0
    finally:
        sock.close()


class _StartupStopped(Exception):
    """SIGTERM or SIGINT arrived while the model loaded or warmed up (the message names it)."""


class _stop_on_signal:
    """Within the block, SIGTERM and SIGINT are recorded, and ``check()`` (called after loading
    and after each warm-up step shape) raises ``_StartupStopped`` naming the first one, so a server
    stopped while it starts exits 0 with a message, as a drain does, not by the signal (143) or a
    KeyboardInterrupt traceback. The handler itself only records: an exception raised from a
    signal handler lands wherever Python happens to be, and jax swallows it there (a GC callback,
    a persistent-cache read), which lost the signal (found by a new-user check)."""

    def __init__(self) -> None:
        self.signal: str | None = None

    def __enter__(self):
        def record(signum, frame):
            self.signal = self.signal or signal.Signals(signum).name

        self._old = {sig: signal.signal(sig, record) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def check(self) -> None:
        """Raises ``_StartupStopped`` once a signal was recorded."""
        if self.signal is not None:
            raise _StartupStopped(self.signal)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def _run_until_signal(server, sock: socket.socket) -> None:
    """``server.run`` with SIGTERM/SIGINT handled by uvicorn (a graceful drain). uvicorn
    re-raises the signal once it has stopped, to the handler that was there before: ours
    ignores it, so the drained server exits 0 instead of dying by the signal."""
    drained = lambda signum, frame: None  # noqa: E731
    old = {sig: signal.signal(sig, drained) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
