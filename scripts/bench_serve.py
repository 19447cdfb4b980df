"""Online serving benchmark in the shape of vLLM's ``benchmark_serving``: `jaxinfer serve` beside
peers on the same weights, one run.

    python scripts/bench_serve.py                                   # stories260K, rates 1,4,16,inf
    python scripts/bench_serve.py --request-rates 2,inf --num-prompts 200 --max-concurrency 32
    python scripts/bench_serve.py --request-rates 1,2,4,8,16,32,inf --num-prompts 100  # sweep
    python scripts/bench_serve.py --request-rates none --soak 1000  # 1,000 requests at rate inf
    python scripts/bench_serve.py --model llama110m --num-prompts 32 --request-rates 1,4,inf
    python scripts/bench_serve.py --quick                           # smoke test
    python scripts/bench_serve.py --base-url http://127.0.0.1:8000 --served-model NAME  # running

Workload (``benchlib.make_workload``, seeded): ShareGPT-like log-normal prompt and output lengths;
the prompts are random token ids decoded to text (every server gets the same text), greedy, each
request asking for its own ``max_tokens`` (``ignore_eos`` where the server has vLLM's field).
Arrivals: a Poisson process at each ``--request-rates`` value (requests/s; ``inf`` = all at once),
at most ``--max-concurrency`` requests in flight. Every request streams (``/v1/completions``,
``stream_options.include_usage``) and is timed by tokens, not text (``request_timings``): to the
servers that honour it (jaxinfer, vLLM) it also sends vLLM's ``continuous_usage_stats``, so each
chunk's usage says how many tokens it carries, text or not; ``transformers serve`` ignores it and
sends a chunk only for a token that adds text, so its tokens are seen by text chunks (each
server's ``token_signal`` says which). TTFT = first chunk with a token - send, ITL = gaps
between chunks with tokens, TPOT = (last such chunk - first) / (output tokens - 1), output
tokens from the usage. A request that errors, or whose stream ends with neither ``[DONE]`` nor
a ``finish_reason`` (``transformers serve`` sends no ``[DONE]``), is a failure.

Servers, each started as a subprocess on a free loopback port (SIGTERM after):

- ``jaxinfer``: ``jaxinfer serve --warmup`` (float32 on CPU).
- ``transformers``: ``transformers serve <dir> --continuous-batching`` on the same weights
  converted to a Hugging Face directory (``benchlib.stories_hf_dir`` plus the SentencePiece
  tokenizer.model and a LlamaTokenizer config, as tests/test_lm_eval.py); it needs
  ``accelerate`` (the ``dev`` extra) for its device map; skipped with the reason when it cannot
  start. Its KV cache holds as many token slots as jaxinfer's (``--max-num-seqs`` x
  ``--max-model-len``, in pages of 32; ``--transformers-args`` replaces that): by default it
  takes 90% of the free memory (14 GB of RSS for stories260K, killed by the kernel's OOM killer
  on a shared 23 GB machine).
- ``llamacpp``: ``python -m llama_cpp.server`` when ``llama_cpp`` is installed and ``--gguf``
  names the same weights as GGUF; skipped cleanly otherwise (its source build takes most of an
  hour on 2 cores).

Models (``--model``): ``stories260K`` (default), ``llama110m`` (benchlib's random ~110M Llama,
float32, the same directory for both servers) or a path; the peers load the same weights as a
Hugging Face directory with stories260K's SentencePiece tokenizer (both models use it). A random
Llama samples ids across its 32,000-id vocabulary, past the tokenizer's 512 pieces, and those
decode to no text: by default both servers get the tokenizer extended to the vocabulary (each
added id one piece of text, prompts tokenized as before; ``bench_serve_models``), so that
``transformers serve`` streams every token too; ``--tok512`` keeps the 512 pieces.

Before the measured rates, one pass of the workload at rate inf compiles jaxinfer's step
shapes (reported as ``cold_pass``; ``--no-warm-pass`` skips it). Reported per server and rate:
completed, failures, duration, request throughput, output tok/s, TTFT / TPOT / ITL (mean, p50,
p99, seconds), the load average before and after, the server's RSS at start, after the cold
pass and at the end (``/proc``), and the jaxinfer / peer ratios (output tok/s, TTFT p50 and
p99). Per server, ``ttft_p99_rates``: the highest tested rate up to which every tested rate kept
TTFT p99 under 1 s, and under 5 s (None: not even the lowest).

Soak (``--soak N``): after the rates, N more requests (their own seeded workload) at rate inf,
at most ``--max-concurrency`` in flight; reported: completed, failures, output tok/s, and the
server's RSS before, after every ``--soak-sample-every`` completed requests and after, with
jaxinfer's ``jaxinfer:num_compilations`` at each sample (RSS that grows with it is compiled
executables; RSS that grows without it would be a leak) and its ``/metrics`` once idle again
(running, waiting, KV pages used: all 0 when nothing leaked).

One JSON line on stdout, appended to ``results/bench_serve.jsonl``; ``scripts/plot_bench.py
--serve-png PATH`` draws its latency-vs-rate figure.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from bench_generate import RANDOM_LLAMAS
from bench_serve_models import full_vocab_dir, hf_serve_dir
from benchlib import (
    STORIES,
    add_common_args,
    emit,
    host_info,
    log,
    make_workload,
    ratio,
    resolve_model,
    stats,
)

TTFT_P99_LIMITS = (1.0, 5.0)  # seconds: the ttft_p99_rates thresholds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def _cpu_s(pid: int | None) -> tuple[float, float] | None:
    """(CPU seconds of the whole process, of its main thread) from ``/proc`` (user + system)."""
    if pid is None:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    try:

        def read(path):
            f = Path(path).read_text().rsplit(")", 1)[1].split()
            return (int(f[11]) + int(f[12])) / tick  # utime, stime (fields 14, 15)

        return read(f"/proc/{pid}/stat"), read(f"/proc/{pid}/task/{pid}/stat")
    except (OSError, IndexError, ValueError):
        return None


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


async def _scrape(client, url: str, names: tuple[str, ...]) -> dict:
    """Values of ``names`` in a Prometheus text page (summed over labels); {} if unreachable."""
    try:
        text = (await client.get(url + "/metrics", timeout=30)).text
    except Exception:  # noqa: BLE001 - a peer without /metrics
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in names:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


JAX_GAUGES = (
    "jaxinfer:num_compilations",
    "jaxinfer:num_requests_running",
    "jaxinfer:num_requests_waiting",
    "jaxinfer:num_kv_pages_used",
)


class Server:
    """A server subprocess (or an external URL) and what to send it."""

    def __init__(
        self,
        name: str,
        cmd: list[str] | None,
        url: str,
        model: str,
        vllm_extras: bool,
        start_timeout: float = 600.0,
        env: dict | None = None,
        continuous_usage: bool = True,
    ):
        self.name, self.cmd, self.url, self.model = name, cmd, url, model
        self.vllm_extras, self.start_timeout, self.env = vllm_extras, start_timeout, env
        self.continuous_usage = continuous_usage
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None  # of a server started elsewhere (--base-url --server-pid)
        self.log_path: Path | None = None

    def start(self, log_dir: Path) -> str | None:
        """Starts and waits for ``/health``; returns why it could not, or None."""
        import httpx

        if self.cmd is None:
            return None
        self.log_path = log_dir / f"{self.name}.log"
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=open(self.log_path, "w"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            env=self.env or dict(os.environ),
        )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text()[-600:]
                return f"exited with status {self.proc.returncode}: {tail}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return None
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        return f"not up after {self.start_timeout:.0f} s"

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(30)


def request_timings(
    t0: float, end: float, events: list[tuple[float, dict]], continuous: bool
) -> dict:
    """TTFT, ITL and TPOT of one streamed completion from its chunks ``(arrival time, chunk)``,
    timed by tokens, not text.

    A chunk with choices carries ``k`` >= 0 generated tokens. From a server that honours vLLM's
    ``continuous_usage_stats`` (``continuous``), ``k`` is the growth of the chunk's
    ``usage.completion_tokens`` (signal ``"usage"``); otherwise, and for a chunk without usage,
    1 if a choice has text, else 0 (signal ``"text"``: a token that decodes to no text is
    invisible; the usage that ``transformers serve`` puts in its last chunk is the final
    count, not a step). TTFT = first chunk with
    ``k`` >= 1 - ``t0``; ITL = the gaps between chunks with ``k`` >= 1 (a chunk of several
    tokens is one gap, as vLLM's ``benchmark_serving``); TPOT = (last such chunk - first) /
    (output tokens - 1); output tokens from the final usage (a chunk without choices; else the
    last running count, else the tokens counted). ``ttft`` None: no chunk carried a token."""
    times, count, n_seen, usage, signal = [], 0, 0, None, "text"
    for t, chunk in events:
        u = chunk.get("usage")
        if not chunk.get("choices"):
            usage = u or usage
            continue
        if continuous and u and u.get("completion_tokens") is not None:
            signal = "usage"
            k = u["completion_tokens"] - count
            count = u["completion_tokens"]
        else:
            usage = u or usage
            k = int(
                any(
                    c.get("text") or (c.get("delta") or {}).get("content") for c in chunk["choices"]
                )
            )
        if k > 0:
            times.append(t)
            n_seen += k
    n_out = usage["completion_tokens"] if usage else (count or n_seen)
    if not times:
        return {
            "ttft": None,
            "e2e": end - t0,
            "out": n_out,
            "tpot": None,
            "itl": [],
            "signal": signal,
            "token_chunks": 0,
        }
    return {
        "ttft": times[0] - t0,
        "e2e": end - t0,
        "out": n_out,
        "tpot": (times[-1] - times[0]) / (n_out - 1) if n_out > 1 else None,
        "itl": list(np.diff(times)),
        "signal": signal,
        "token_chunks": len(times),
    }


async def _one(client, server: Server, prompt: str, max_tokens: int) -> dict:
    # continuous_usage_stats (vLLM's, and jaxinfer's): every chunk says how many tokens so far,
    # so a token that decodes to no text is still timed; asked of the servers that honour it.
    opts = {
        "include_usage": True,
        **({"continuous_usage_stats": True} if server.continuous_usage else {}),
    }
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": opts,
    }
    if server.vllm_extras:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    events, usage, done, finished, err = [], None, False, False, None
    try:
        async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    err = str(chunk["error"])[:200]
                    continue
                events.append((time.perf_counter(), chunk))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if any(c.get("finish_reason") for c in chunk.get("choices") or []):
                    finished = True
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        return {"ok": False, "error": f"{type(e).__name__}: {e}"[:200]}
    end = time.perf_counter()
    res = request_timings(t0, end, events, server.continuous_usage)
    # A request none of whose chunks showed a token (with the text signal: tokens that decode
    # to no text) completed if the usage counts tokens; it has no TTFT, TPOT or ITL.
    if (
        err
        or not (done or finished)
        or not (res["ttft"] is not None or (usage and usage["completion_tokens"]))
    ):
        return {
            "ok": False,
            "error": err
            or ("no tokens" if (done or finished) else "neither [DONE] nor a finish_reason"),
        }
    return {"ok": True, **res}


async def _run_rate(
    server: Server,
    work: list[tuple[str, int]],
    rate: float,
    concurrency: int,
    seed: int,
    probe=None,
    probe_every: int = 0,
) -> dict:
    """One pass of ``work`` at ``rate``. ``probe(client, completed, t)`` (async) runs before,
    after every ``probe_every`` finished requests and after; its results are ``samples``.
    ``server_cpu_ms_per_token``: the server process's CPU time (all threads, and its main
    thread: uvicorn's event loop for jaxinfer) over the pass per output token, a figure of its
    own work that other jobs on the machine disturb less than wall time."""
    import httpx

    pid = server.proc.pid if server.proc else server.pid
    cpu0 = _cpu_s(pid)

    rng = np.random.default_rng(seed)
    gaps = np.zeros(len(work)) if math.isinf(rate) else rng.exponential(1.0 / rate, len(work))
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    load0, samples, probes, finished = _load(), [], [], 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def go(prompt, max_tokens):
            nonlocal finished
            async with sem:
                res = await _one(client, server, prompt, max_tokens)
            finished += 1
            if (
                probe is not None
                and probe_every
                and finished % probe_every == 0
                and finished < len(work)
            ):
                probes.append(
                    asyncio.create_task(probe(client, finished, time.perf_counter() - t0))
                )
            return res

        comp = "jaxinfer:num_compilations"
        comp0 = (
            (await _scrape(client, server.url, (comp,))).get(comp)
            if server.name == "jaxinfer"
            else None
        )
        t0 = time.perf_counter()
        if probe is not None:
            samples.append(await probe(client, 0, 0.0))
        tasks = []
        for (prompt, max_tokens), gap in zip(work, gaps, strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(go(prompt, max_tokens)))
        results = await asyncio.gather(*tasks)
        dur = time.perf_counter() - t0
        if probe is not None:
            samples += await asyncio.gather(*probes)
            samples.append(await probe(client, len(work), dur))
        if comp0 is not None:  # step shapes compiled during the pass (they stall every request)
            extra0 = {
                "compilations": [comp0, (await _scrape(client, server.url, (comp,))).get(comp)]
            }
        else:
            extra0 = {}
    ok = [r for r in results if r["ok"]]
    out_tokens = sum(r["out"] for r in ok)
    extra = {**extra0, **({"samples": samples} if probe is not None else {})}
    cpu1 = _cpu_s(pid)
    if cpu0 and cpu1 and out_tokens:
        extra["server_cpu_ms_per_token"] = {
            "all_threads": round(1e3 * (cpu1[0] - cpu0[0]) / out_tokens, 4),
            "main_thread": round(1e3 * (cpu1[1] - cpu0[1]) / out_tokens, 4),
        }
    return {
        "rate": "inf" if math.isinf(rate) else rate,
        "load_before": load0,
        "load_after": _load(),
        **extra,
        "completed": len(ok),
        "failures": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:3],
        "duration_s": round(dur, 3),
        "request_throughput": round(len(ok) / dur, 3),
        "output_tok_s": round(out_tokens / dur, 2),
        "output_tokens": out_tokens,
        "ttft_s": stats([r["ttft"] for r in ok]),
        "tpot_s": stats([r["tpot"] for r in ok]),
        "itl_s": stats([x for r in ok for x in r["itl"]]),
        "e2e_s": stats([r["e2e"] for r in ok]),
        "no_token_chunk": sum(r["ttft"] is None for r in ok),  # completed, no token seen
        # how the tokens were seen ("usage": continuous usage counts; "text": text chunks)
        "token_signal": {s: sum(r["signal"] == s for r in ok) for s in ("usage", "text")},
        # token-bearing chunks per output token (< 1: chunks of several tokens)
        "chunks_per_token": round(sum(r["token_chunks"] for r in ok) / out_tokens, 4)
        if out_tokens
        else None,
    }


def _servers(args) -> tuple[list[Server], dict]:
    skipped: dict[str, str] = {}
    if args.base_url:
        srv = Server(
            "jaxinfer",
            None,
            args.base_url.rstrip("/"),
            args.served_model,
            True,
            continuous_usage=not args.no_continuous_usage,
        )
        srv.pid = args.server_pid
        return [srv], {}
    servers = []
    port = _free_port()
    engine_path, _, _ = resolve_model(args.model)
    full_vocab = args.model in RANDOM_LLAMAS and not args.tok512
    if full_vocab:  # the same directory, tokenizer included, for every server
        engine_path = full_vocab_dir(args.model)
    cmd = [
        sys.executable,
        "-m",
        "jaxinfer.cli.main",
        "serve",
        "--model",
        str(engine_path),
        "--port",
        str(port),
        "--warmup",
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--log-level",
        "warning",
        "--served-model-name",
        "bench",
        "--max-model-len",
        str(args.max_model_len),
    ] + args.jaxinfer_args.split()
    servers.append(Server("jaxinfer", cmd, f"http://127.0.0.1:{port}", "bench", True))
    if "transformers" in args.peers:
        exe = shutil.which("transformers")
        if exe is None or importlib.util.find_spec("transformers") is None:
            skipped["transformers"] = "the transformers CLI is not installed"
        else:
            try:
                hf = engine_path if full_vocab else hf_serve_dir(args.model)
                port = _free_port()
                env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
                servers.append(
                    Server(
                        "transformers",
                        [
                            exe,
                            "serve",
                            str(hf),
                            "--port",
                            str(port),
                            "--continuous-batching",
                            "--device",
                            "cpu",
                            "--dtype",
                            "float32",
                        ]
                        + (
                            args.transformers_args.split()
                            if args.transformers_args is not None
                            else [
                                "--cb-block-size",
                                "32",
                                "--cb-num-blocks",
                                str(-(-args.max_num_seqs * args.max_model_len // 32)),
                            ]
                        ),
                        f"http://127.0.0.1:{port}",
                        str(hf),
                        False,
                        env=env,
                        continuous_usage=False,
                    )
                )
            except Exception as e:  # noqa: BLE001 - the peer is optional
                skipped["transformers"] = f"cannot prepare the HF directory: {e}"[:300]
    if "llamacpp" in args.peers:
        if importlib.util.find_spec("llama_cpp") is None:
            skipped["llamacpp"] = "llama-cpp-python is not installed"
        elif not args.gguf:
            skipped["llamacpp"] = "no --gguf file of the same weights"
        else:
            port = _free_port()
            servers.append(
                Server(
                    "llamacpp",
                    [
                        sys.executable,
                        "-m",
                        "llama_cpp.server",
                        "--model",
                        args.gguf,
                        "--port",
                        str(port),
                        "--host",
                        "127.0.0.1",
                    ],
                    f"http://127.0.0.1:{port}",
                    args.gguf,
                    False,
                    continuous_usage=False,
                )
            )
    return servers, skipped


def ttft_p99_rates(rates: list[dict], limits=TTFT_P99_LIMITS) -> dict:
    """Per limit, the highest tested rate up to which every tested rate (in increasing order,
    ``inf`` last) had TTFT p99 under it and no failures; None if the lowest did not."""
    order = sorted(rates, key=lambda r: math.inf if r["rate"] == "inf" else r["rate"])
    out = {}
    for lim in limits:
        best = None
        for r in order:
            p99 = r["ttft_s"]["p99"]
            if r["failures"] or p99 is None or p99 >= lim:
                break
            best = r["rate"]
        out[f"under_{lim:g}s"] = best
    return out


def _probe_for(srv: Server):
    pid = srv.proc.pid if srv.proc else srv.pid

    async def probe(client, completed: int, t: float) -> dict:
        row = {"completed": completed, "t_s": round(t, 2), "rss_mb": _rss_mb(pid) if pid else None}
        if srv.name == "jaxinfer":
            got = await _scrape(client, srv.url, ("jaxinfer:num_compilations",))
            row["compilations"] = got.get("jaxinfer:num_compilations")
        return row

    return probe


async def _idle_metrics(srv: Server, timeout: float = 30.0) -> dict:
    """jaxinfer's gauges once the server is idle (running and waiting 0, or the timeout)."""
    import httpx

    async with httpx.AsyncClient() as client:
        deadline = time.monotonic() + timeout
        while True:
            got = await _scrape(client, srv.url, JAX_GAUGES)
            busy = got.get("jaxinfer:num_requests_running", 0) + got.get(
                "jaxinfer:num_requests_waiting", 0
            )
            if not got or not busy or time.monotonic() > deadline:
                return {k.split(":")[1]: v for k, v in got.items()}
            await asyncio.sleep(0.2)


def _texts(model: str, n: int, seed: int, args) -> list[tuple[str, int]]:
    from jaxinfer.tokenizers import load_tokenizer

    tok = load_tokenizer(STORIES / "tok512.model", vocab_size=512)
    _, vocab, _ = resolve_model(model)
    return [
        (tok.decode(ids[1:]), mt)
        for ids, mt in make_workload(
            n,
            max_model_len=args.max_model_len,
            vocab=vocab,
            seed=seed,
            mean_input=args.mean_input,
            mean_output=args.mean_output,
        )
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap)
    ap.add_argument(
        "--model",
        default="stories260K",
        help="stories260K, llama110m (random ~110M Llama) or a checkpoint path",
    )
    ap.add_argument("--base-url", default=None, help="benchmark a server already running")
    ap.add_argument("--served-model", default=None, help="its model name (with --base-url)")
    ap.add_argument(
        "--no-continuous-usage",
        action="store_true",
        help="with --base-url: the server lacks vLLM's stream_options."
        "continuous_usage_stats (tokens then timed by text chunks)",
    )
    ap.add_argument(
        "--server-pid",
        type=int,
        default=None,
        help="its process id (with --base-url): CPU time and RSS from /proc",
    )
    ap.add_argument(
        "--peers",
        default="transformers,llamacpp",
        help="comma list: transformers, llamacpp ('' for none)",
    )
    ap.add_argument("--gguf", default=None, help="the same weights as GGUF, for llama.cpp")
    ap.add_argument(
        "--request-rates",
        default="1,4,16,inf",
        help="comma list of requests/s ('inf': all at once; 'none': no rates)",
    )
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=512,
        help="jaxinfer's --max-model-len; lengths are drawn up to half of it",
    )
    ap.add_argument(
        "--tok512",
        action="store_true",
        help="random Llamas (llama110m): serve them with the 512-piece tokenizer "
        "alone (their sampled ids then decode to almost no text) instead of one "
        "extended to their vocabulary",
    )
    ap.add_argument(
        "--jaxinfer-args",
        default="",
        help="more flags for jaxinfer serve (one string, split on spaces)",
    )
    ap.add_argument(
        "--transformers-args",
        default=None,
        help="flags for transformers serve in place of the KV sizing (one string, "
        "e.g. '--cb-max-memory-percent 0.2')",
    )
    ap.add_argument("--mean-input", type=float, default=48)
    ap.add_argument("--mean-output", type=float, default=64)
    ap.add_argument(
        "--soak",
        type=int,
        default=0,
        metavar="N",
        help="after the rates, N requests at rate inf with RSS samples (0: none)",
    )
    ap.add_argument(
        "--soak-sample-every",
        type=int,
        default=100,
        metavar="K",
        help="RSS sampled every K finished soak requests",
    )
    ap.add_argument(
        "--no-warm-pass",
        action="store_true",
        help="measure from a cold server (by default one pass of the workload at "
        "rate inf runs first, so step shapes are compiled; reported as cold_pass)",
    )
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.request_rates, args.mean_output = 16, "8,inf", 24
        args.soak = min(args.soak, 24)
        args.soak_sample_every = min(args.soak_sample_every, 8)
    try:
        rates = (
            []
            if args.request_rates.strip() in ("", "none")
            else [float(r) for r in args.request_rates.split(",")]
        )
    except ValueError:
        ap.error(
            f"--request-rates: expected comma-separated numbers, inf or none, got "
            f"{args.request_rates!r}"
        )
    if any(not r > 0 for r in rates):  # NaN, 0 and negatives: no Poisson process
        ap.error(f"--request-rates: every rate must be > 0 (or inf), got {args.request_rates!r}")
    args.peers = [p for p in args.peers.split(",") if p]

    work = _texts(args.model, args.num_prompts, args.seed, args)
    soak_work = _texts(args.model, args.soak, args.seed + 1000, args) if args.soak else []
    servers, skipped = _servers(args)
    log_dir = Path(args.results_dir) / "bench_serve_logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    for srv in servers:
        log(f"starting {srv.name}")
        t_start = time.perf_counter()
        why = srv.start(log_dir)
        if why is not None:
            skipped[srv.name] = why
            log(f"{srv.name} skipped: {why}")
            continue
        pid = srv.proc.pid if srv.proc else srv.pid
        entry = {
            "startup_s": round(time.perf_counter() - t_start, 2),
            "rss_mb_start": _rss_mb(pid) if pid else None,
            "rates": [],
        }
        if not args.no_warm_pass:  # compiles (jaxinfer) and first-use costs, reported apart
            cold = asyncio.run(_run_rate(srv, work, math.inf, args.max_concurrency, args.seed))
            entry["cold_pass"] = {
                k: cold[k]
                for k in ("duration_s", "failures", "output_tok_s", "load_before", "load_after")
            }
            entry["rss_mb_after_cold"] = _rss_mb(pid) if pid else None
        for i, rate in enumerate(rates):
            r = asyncio.run(_run_rate(srv, work, rate, args.max_concurrency, args.seed + i))
            log(
                f"{srv.name} rate {r['rate']}: {r['output_tok_s']} tok/s, TTFT p50 "
                f"{r['ttft_s']['p50']} p99 {r['ttft_s']['p99']} s, {r['failures']} failures, "
                f"load {r['load_before']} -> {r['load_after']}, server CPU ms/token "
                f"{r.get('server_cpu_ms_per_token')}, compilations {r.get('compilations')}"
            )
            entry["rates"].append(r)
        if rates:
            entry["ttft_p99_rates"] = ttft_p99_rates(entry["rates"])
        if args.soak:
            r = asyncio.run(
                _run_rate(
                    srv,
                    soak_work,
                    math.inf,
                    args.max_concurrency,
                    args.seed + 1000,
                    probe=_probe_for(srv),
                    probe_every=args.soak_sample_every,
                )
            )
            r.pop("rate")
            r["idle_metrics"] = asyncio.run(_idle_metrics(srv)) if srv.name == "jaxinfer" else None
            rss = [x["rss_mb"] for x in r["samples"]]
            log(
                f"{srv.name} soak: {r['completed']} done, {r['failures']} failures, "
                f"{r['output_tok_s']} tok/s, RSS {rss[0]} -> {rss[-1]} MB, "
                f"idle {r['idle_metrics']}"
            )
            entry["soak"] = r
        entry["rss_mb_end"] = _rss_mb(pid) if pid else None
        entry["exit_status"] = srv.stop()
        results[srv.name] = entry
    ratios = {}
    base = results.get("jaxinfer")
    for peer, res in results.items():
        if peer == "jaxinfer" or base is None:
            continue
        ratios[peer] = [
            {
                "rate": a["rate"],
                "output_tok_s": ratio(a["output_tok_s"], b["output_tok_s"]),
                "ttft_p50": ratio(a["ttft_s"]["p50"], b["ttft_s"]["p50"]),
                "ttft_p99": ratio(a["ttft_s"]["p99"], b["ttft_s"]["p99"]),
            }
            for a, b in zip(base["rates"], res["rates"], strict=True)
        ]
        if "soak" in base and "soak" in res:
            ratios[peer].append(
                {
                    "rate": "soak",
                    "output_tok_s": ratio(
                        base["soak"]["output_tok_s"], res["soak"]["output_tok_s"]
                    ),
                }
            )
    emit(
        {
            "bench": "bench_serve",
            **host_info(),
            "model": args.model,
            "num_prompts": args.num_prompts,
            "soak": args.soak,
            "max_concurrency": args.max_concurrency,
            "max_num_seqs": args.max_num_seqs,
            "mean_input": args.mean_input,
            "mean_output": args.mean_output,
            "jaxinfer_args": args.jaxinfer_args,
            "transformers_args": args.transformers_args,
            "servers": results,
            "skipped": skipped,
            "jaxinfer_over_peer": ratios,
        },
        "bench_serve",
        args.results_dir,
    )


if __name__ == "__main__":
    main()
