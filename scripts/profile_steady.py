"""Where a WARM run's time goes: one ``jaxinfer generate`` job (compilations cached) split into
device phases, host phases and gaps, measured. Results: docs/performance_cold_start.md, section
"Steady state: where the warm run goes".

    python scripts/profile_steady.py --runs async,sync --micro
    python scripts/profile_steady.py --runs async,async@0,async,async@0
    python scripts/profile_steady.py --micro-only --micro-repeats 7

The job is ``profile_compile``'s ``llama110m`` job (``benchlib``'s random ~110M Llama, f32, greedy,
``ignore_eos``, ``benchlib.make_workload`` prompts; default 64 prompts, mean output 96) run
through ``jaxinfer.cli.main.main`` in this process, once per entry of ``--runs``. Public names
are wrapped from here (``EngineCore.step``, ``ModelRunner.__init__``, the jitted functions
``jitted_forward_step`` / ``jitted_sample_step`` give the runner, ``Scheduler.schedule``,
``build_step_batch`` and ``to_host`` as the core calls them, ``IncrementalDetokenizer.add``);
jaxinfer itself is not changed.

- ``async``: the engine as shipped (async scheduling). Timed: wall, and per ``EngineCore.step``
  the time the read-back (``to_host``) waited for the device against the host's own time.
- ``sync``: ``--no-async-scheduling``, and each forward and sampling call is waited for
  (``block_until_ready``), so every phase is timed alone: forward steps by kind (decode-only by
  Td, prefill-only, mixed) and by bucket key, sampling, scheduling, ``build_step_batch``,
  read-back, detokenization, the rest of the host's step, and everything outside
  ``EngineCore.step`` (load, engine set-up, the LLM loop, the output file).
- ``MODE@N``: that run with ``bucket_reuse.REUSE_STEPS = N`` (0: every step runs its exact
  bucket).
Every run also counts the live rows (kv_len > 0) of each decode-only step per Td bucket.

The persistent compilation cache (``--cache-dir``) is filled by a first cold run when it is empty
(reported as ``fill``); the first run in a process with it filled is a "warm process" run (the
issue's warm run: tracing, lowering and executable loads still happen, timed from
``jax.monitoring`` events); later runs reuse the in-memory executables (pure steady state).

``--micro`` saves the sync runs' last decode-only batch of each Td in (8, 16, 32, 64) and the last
mixed (64, 512, ...) batch to ``--batches``. ``--micro-only`` (no job) times one step's pieces
at those batches, on a fresh engine (``jaxinfer.LLM``): the whole forward, the forward with
attention replaced by a pass-through (the difference: attention and the KV write), each layer
projection chain alone (fused QKV, out, fused gate/up, down over the 12 layers), the LM head; the
same GEMMs in torch (``x [T, I] @ W [I, O]``, 2 threads); the read bandwidth
(``bench_roofline.measure_bandwidth``) and each piece's floor (weight or live-KV bytes /
bandwidth). ``--decode-dots``, ``--decode-items-per-group``, ``--decode-pages-per-chunk`` try
variants of the decode attention there. One JSON line on stdout (``benchlib.emit``), progress on
stderr.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchlib import REPO, emit, host_info, log, make_workload, resolve_model


def checkout() -> dict:
    """The commit this run's code came from and the jaxinfer files changed since (the working tree
    is shared: its engine may change between runs)."""
    import subprocess

    def git(*a):
        try:
            return subprocess.run(
                ["git", "-C", str(REPO), *a], capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    dirty = git("status", "--short", "--", "jaxinfer")
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "uncommitted_jaxinfer": dirty.splitlines() if dirty else [],
    }


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Timers:
    """Seconds and counts per label."""

    def __init__(self):
        self.s = collections.defaultdict(float)
        self.n = collections.defaultdict(int)

    def add(self, label: str, dt: float) -> None:
        self.s[label] += dt
        self.n[label] += 1

    def table(self) -> dict:
        return {k: {"s": round(v, 3), "n": self.n[k]} for k, v in sorted(self.s.items())}


def step_kind(key) -> str:
    td, tp, _bp, _m = key
    if tp == 0:
        return f"decode Td={td}"
    if td == 0:
        return "prefill"
    return "mixed"


def install_hooks(state: dict) -> None:
    """Wraps public names as the engine uses them (jaxinfer's files are not edited)."""
    import jax
    import numpy as np

    from jaxinfer.engine import core as em
    from jaxinfer.engine import runner as rm
    from jaxinfer.engine import scheduler as sm
    from jaxinfer.tokenizers import detokenizer as dm

    orig = {
        "step": em.EngineCore.step,
        "schedule": sm.Scheduler.schedule,
        "bsb": em.build_step_batch,
        "to_host": em.to_host,
        "detok": dm.IncrementalDetokenizer.add,
        "init": rm.ModelRunner.__init__,
        "jit_forward": rm.jitted_forward_step,
        "jit_sample": rm.jitted_sample_step,
    }

    def timed(label, fn):
        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                state["t"].add(label, time.perf_counter() - t)

        return call

    def init(self, *a, **kw):
        t = time.perf_counter()
        orig["init"](self, *a, **kw)
        state["t"].add("engine_init", time.perf_counter() - t)
        state["runner"] = self

    def jit_forward(*a, **kw):
        fwd = orig["jit_forward"](*a, **kw)

        def forward(*fa, **fkw):
            t = time.perf_counter()
            out = fwd(*fa, **fkw)
            if state["sync"]:
                jax.block_until_ready(out)
            dt = time.perf_counter() - t
            key = state["key"]
            state["t"].add("forward", dt)
            state["t"].add("forward " + step_kind(key), dt)
            state["fwd_keys"].add(repr(key), dt)
            if key[1] == 0:  # decode-only: live rows (kv_len > 0) of the Td bucket
                live = int(np.count_nonzero(np.asarray(fa[2].md.kv_lens)[: key[0]]))
                state["live_rows"][f"Td={key[0]}"][live] += 1
            if state["capture"] and (
                key[1] == 0 and key[0] in (8, 16, 32, 64) or key[:2] == (64, 512)
            ):
                state["captured"][step_kind(key)] = (fa[2], fa[3], key)
            return out

        forward.lower = fwd.lower  # the runner's ahead-of-time compiles (bucket reuse)
        return forward

    def jit_sample(*a, **kw):
        smp = orig["jit_sample"](*a, **kw)

        def sample(*sa, **skw):
            t = time.perf_counter()
            out = smp(*sa, **skw)
            if state["sync"]:
                jax.block_until_ready(out)
            state["t"].add("sample", time.perf_counter() - t)
            return out

        sample.lower = smp.lower
        return sample

    def bsb(sched, *a, **kw):
        t = time.perf_counter()
        batch, bk = orig["bsb"](sched, *a, **kw)
        state["t"].add("build_step_batch", time.perf_counter() - t)
        state["key"] = bk.key
        return batch, bk

    rm.ModelRunner.__init__ = init
    rm.jitted_forward_step, rm.jitted_sample_step = jit_forward, jit_sample
    timed_step = timed("engine_step", orig["step"])

    def step(self):  # the job plan's core (a stub runner, on a thread) is not timed
        return (timed_step if isinstance(self.runner, rm.ModelRunner) else orig["step"])(self)

    em.EngineCore.step = step
    sm.Scheduler.schedule = timed("schedule", orig["schedule"])
    em.build_step_batch = bsb
    em.to_host = timed("to_host", orig["to_host"])
    dm.IncrementalDetokenizer.add = timed("detokenize", orig["detok"])


def run_job(args, path, prompts: Path, out: Path, mode: str, state: dict) -> dict:
    from jaxinfer.cli import main as cli

    state["t"] = Timers()
    state["fwd_keys"] = Timers()
    state["live_rows"] = collections.defaultdict(collections.Counter)
    state["sync"] = mode == "sync"
    mon = Timers()
    state["mon"] = mon
    argv = [
        "generate",
        "--model",
        str(path),
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--temperature",
        "0",
        "--no-progress",
        "--max-model-len",
        str(args.max_model_len),
    ]
    if mode == "sync":
        argv.append("--no-async-scheduling")
    argv += args.cli_args.split()
    buf = io.StringIO()
    load0 = load_avg()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(argv)
    wall = time.perf_counter() - t0
    load1 = load_avg()
    out.unlink(missing_ok=True)
    summ = json.loads(buf.getvalue().strip().splitlines()[-1]) if buf.getvalue() else {}
    t = state["t"]
    s = lambda k: t.s.get(k, 0.0)  # noqa: E731
    step = s("engine_step")
    dev = s("forward") + s("sample")
    host_in_step = step - (dev if mode == "sync" else 0.0)
    r = {
        "mode": mode,
        "rc": rc,
        "wall_s": round(wall, 2),
        "load_before": load0,
        "load_after": load1,
        "cli_generate_s": summ.get("generate_s"),
        "completion_tokens": summ.get("completion_tokens"),
        "steps": t.n.get("engine_step", 0),
        "engine_step_s": round(step, 2),
        "outside_step_s": round(wall - step, 2),
        "engine_init_s": round(s("engine_init"), 2),
        "trace_s": round(mon.s.get("trace", 0.0), 2),
        "lower_s": round(mon.s.get("lower", 0.0), 2),
        "compile_or_cache_load_s": round(mon.s.get("compile", 0.0), 2),
        "xla_compiles": mon.n.get("compile", 0),
        "timers": t.table(),
        "decode_live_rows": {k: dict(sorted(v.items())) for k, v in state["live_rows"].items()},
    }
    if mode == "sync":
        phases = {k: round(v, 2) for k, v in t.s.items() if k.startswith("forward ")}
        phases["sample"] = round(s("sample"), 2)
        phases["schedule"] = round(s("schedule"), 2)
        phases["build_step_batch"] = round(s("build_step_batch"), 2)
        phases["collect_detokenize"] = round(s("detokenize"), 2)
        phases["collect_to_host"] = round(s("to_host"), 2)
        known = ("forward", "sample", "schedule", "build_step_batch", "detokenize", "to_host")
        phases["step_other_host"] = round(step - sum(s(k) for k in known), 2)
        phases["outside_step"] = round(wall - step, 2)
        r["phases"] = phases
        r["device_busy_s"] = round(dev, 2)
        r["host_in_step_s"] = round(host_in_step, 2)
        r["forward_by_key"] = {
            k: v for k, v in sorted(state["fwd_keys"].table().items(), key=lambda kv: -kv[1]["s"])
        }
    else:
        r["readback_wait_s"] = round(s("to_host"), 2)
        r["host_in_step_s"] = round(step - s("to_host"), 2)
    return r


# ---------------------------------------------------------------- micro benchmark


def rss_guard(limit_gb: float) -> None:
    """A daemon thread that ends the process (exit 3) when its RSS passes ``limit_gb``: the
    machine is shared, and a runaway piece must not take others' memory."""
    import threading

    def watch():
        while True:
            with open("/proc/self/status") as f:
                kb = int(next(ln for ln in f if ln.startswith("VmRSS")).split()[1])
            if kb / 2**20 > limit_gb:
                log(
                    f"[micro] RSS {kb / 2**20:.1f} GiB > {limit_gb} GiB at stage {STAGE[0]!r}: "
                    "exiting"
                )
                os._exit(3)
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()


STAGE = ["start"]


class ElementwiseDecodeDots:
    """Stands in for ``jax.numpy`` inside ``jaxinfer.models.paged_attention`` (``--decode-dots
    elementwise``): its decode attention's two einsums become a broadcast multiply and a sum
    (one fused loop each, no batched dot of [1, H] x [H, S] per head and row); everything else
    is ``jax.numpy`` itself."""

    def __init__(self, jnp):
        self._jnp = jnp

    def __getattr__(self, name):
        return getattr(self._jnp, name)

    def einsum(self, spec, a, b, **kw):
        jnp = self._jnp
        f32 = jnp.float32
        if spec == "KTGH,KTSH->KTGS":  # scores: sum over H
            return (a.astype(f32)[:, :, :, None, :] * b.astype(f32)[:, :, None, :, :]).sum(-1)
        if spec == "KTGS,KTSH->KTGH":  # p @ v: sum over S
            return (a.astype(f32)[..., None] * b.astype(f32)[:, :, None, :, :]).sum(-2)
        return jnp.einsum(spec, a, b, **kw)


def micro(engine, captured: dict, repeats: int, full_pieces: bool = True) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench_roofline import measure_bandwidth

    from jaxinfer.engine.step import forward_step, resolve_tokens
    from jaxinfer.models.forward import compute_logits, forward, linear, linear_parts

    cfg, params = engine.cfg, engine.params
    layers = params.layers
    bw = measure_bandwidth(256, 5)
    log(f"[micro] bandwidth {bw['gb_s']} GB/s")

    def best(f, *a):
        STAGE[0] = getattr(f, "__name__", "?")
        ts = []
        jax.block_until_ready(f(*a))
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(f(*a))
            ts.append(time.perf_counter() - t)
        return {"p50_ms": round(float(np.median(ts)) * 1e3, 3), "best_ms": round(min(ts) * 1e3, 3)}

    def nbytes(tree):
        return sum(int(x.nbytes) for x in jax.tree.leaves(tree))

    def wpart(name):
        return [getattr(lp, name) for lp in layers]

    out = {"bandwidth_gb_s": bw["gb_s"], "by_td": {}}
    engine.runner.kv = None  # the engine's own pool is not used here: free it first
    box = [engine.runner.new_kv_cache()]  # one pool, donated and threaded through every call
    log(f"[micro] KV pool {nbytes(box[0]) / 2**20:.0f} MiB")
    kv_token_bytes = nbytes(box[0]) / (engine.ecfg.num_pages * engine.ecfg.page_size)

    def one(td, batch, prev, key) -> dict:  # td: the step's kind, "decode Td=16" or "mixed"
        md = batch.md
        rows = int(batch.logits_indices.shape[0])
        T = int(batch.tokens.shape[0])

        fwd_full = jax.jit(
            lambda p, kv, b, pv: forward_step(
                p, kv, b, pv, cfg=cfg, attn_impl=engine.ecfg.attn_impl
            ),
            donate_argnums=1,
        )

        def forward_full():
            box[0], lg = fwd_full(params, box[0], batch, prev)
            return lg

        def noattn_fn(p, kv, b, pv):
            toks = resolve_tokens(b.tokens, pv)
            h, kv = forward(p, cfg, toks, b.md.positions, kv, lambda q, k, v, c, l, w: (q, c))
            return compute_logits(p, cfg, h[b.logits_indices])

        noattn = jax.jit(noattn_fn)

        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

        def chain(name, parts: bool, width_in: int):
            ws = wpart(name)

            @jax.jit
            def f(ws, h):
                acc = 0.0
                for w in ws:
                    if parts:
                        ys = linear_parts(h, w)
                    elif name == "wo":
                        ys = (linear(h.reshape(T, N, H), w, "TNH,NHD->TD"),)
                    else:
                        ys = (linear(h, w, "TF,FD->TD"),)
                    acc = acc + sum(part.sum() for part in ys) * 1e-9
                    h = h + acc
                return h

            h = jnp.full((T, width_in), 0.01, jnp.float32)
            f.__name__ = f"gemm_{name}"
            return best(f, ws, h), nbytes([w.values if hasattr(w, "values") else w for w in ws])

        live = int(np.asarray(md.kv_lens).sum())
        kv_mb = live * kv_token_bytes / 2**20
        res = {
            "key": list(key),
            "T": T,
            "rows": rows,
            "kv_live_tokens": live,
            "kv_read_mb": round(kv_mb, 1),
            "kv_roofline_ms": round(kv_mb * 2**20 / bw["bytes_s"] * 1e3, 3),
        }
        STAGE[0] = f"Td={td}"
        res["forward_full"] = best(forward_full)
        res["forward_no_attention"] = best(lambda: noattn(params, box[0], batch, prev))
        res["attention_and_kv_write_ms"] = round(
            res["forward_full"]["p50_ms"] - res["forward_no_attention"]["p50_ms"], 3
        )
        if not full_pieces:
            return res
        F = cfg.intermediate_size
        for name, parts, win in (
            ("wqkv", True, cfg.hidden_size),
            ("wo", False, N * H),
            ("w_gate_up", True, cfg.hidden_size),
            ("w_down", False, F),
        ):
            tm, wb = chain(name, parts, win)
            res[f"gemm_{name}"] = {
                **tm,
                "weight_mb": round(wb / 2**20, 1),
                "roofline_ms": round(wb / bw["bytes_s"] * 1e3, 3),
            }
        lm = jax.jit(lambda p, h: compute_logits(p, cfg, h))
        hb = jnp.full((rows, cfg.hidden_size), 0.01, jnp.float32)
        lm_bytes = nbytes(params.embed if params.lm_head is None else params.lm_head)
        res["lm_head"] = {
            **best(lm, params, hb),
            "weight_mb": round(lm_bytes / 2**20, 1),
            "roofline_ms": round(lm_bytes / bw["bytes_s"] * 1e3, 3),
        }
        # torch (2 threads) on the same GEMM shapes: x [T, I] @ W [I, O], 12 layers
        import torch

        torch.set_num_threads(min(2, os.cpu_count() or 1))
        tres = {}
        D = cfg.hidden_size
        for name, (i, o) in {
            "wqkv": (D, (N + 2 * K) * H),
            "wo": (N * H, D),
            "w_gate_up": (D, 2 * F),
            "w_down": (F, D),
        }.items():
            ws = [torch.randn(i, o) for _ in range(cfg.num_layers)]
            xa = torch.randn(T, i)
            ts = []
            for _ in range(repeats + 1):
                t = time.perf_counter()
                for w in ws:
                    xa @ w
                ts.append(time.perf_counter() - t)
            ts = ts[1:]
            tres[name] = {
                "p50_ms": round(float(np.median(ts)) * 1e3, 3),
                "best_ms": round(min(ts) * 1e3, 3),
            }
        res["torch_gemm_12_layers"] = tres
        flops = 2 * T * cfg.num_layers * (D * (N + 2 * K) * H + N * H * D + 3 * D * F)
        res["layer_gemm_gflop"] = round(flops / 1e9, 3)
        return res

    for td in sorted(captured):
        out["by_td"][td] = res = one(td, *captured[td])
        log(f"[micro] {td}: {json.dumps(res)}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--mean-input", type=float, default=64.0)
    ap.add_argument("--mean-output", type=float, default=96.0)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--runs",
        default="async,sync",
        help="comma list of async / sync, each optionally @N: bucket_reuse.REUSE_STEPS "
        "for that run (0: never pad a step up to a compiled bucket)",
    )
    ap.add_argument(
        "--micro",
        action="store_true",
        help="save the sync runs' last decode batches of Td 8/16/32/64 and the last "
        "mixed one to --batches (for --micro-only)",
    )
    ap.add_argument("--micro-repeats", type=int, default=7)
    ap.add_argument(
        "--batches",
        default="/tmp/profile_steady_batches.pkl",
        help="where --micro saves the captured decode batches (pickle)",
    )
    ap.add_argument(
        "--cli-args",
        default="",
        help="more `jaxinfer generate` flags for every run, e.g. '--kv-cache-dtype int8'",
    )
    ap.add_argument("--kv-cache-dtype", default="auto", help="--micro-only: the engine's KV dtype")
    ap.add_argument(
        "--decode-pages-per-chunk",
        type=int,
        default=None,
        help="--micro-only: paged_attention.DECODE_PAGES_PER_CHUNK for the pieces",
    )
    ap.add_argument(
        "--decode-items-per-group",
        type=int,
        default=None,
        help="--micro-only: paged_attention.DECODE_ITEMS_PER_GROUP for the pieces",
    )
    ap.add_argument(
        "--decode-dots",
        choices=("einsum", "elementwise"),
        default="einsum",
        help="--micro-only: 'elementwise' computes the decode attention's two tiny "
        "batched dots (KTGH,KTSH->KTGS and KTGS,KTSH->KTGH) as a broadcast "
        "multiply and sum instead of dot ops (an experiment; the library is "
        "not changed: paged_attention's jnp is proxied in this process)",
    )
    ap.add_argument(
        "--forward-only",
        action="store_true",
        help="--micro-only: the whole forward and the one without attention only",
    )
    ap.add_argument(
        "--only",
        default=None,
        help="--micro-only: comma list of batch kinds to time (e.g. 'decode Td=64')",
    )
    ap.add_argument(
        "--rss-limit-gb",
        type=float,
        default=9.0,
        help="--micro-only exits when its RSS passes this",
    )
    ap.add_argument(
        "--micro-only",
        action="store_true",
        help="no job: time the pieces on the batches saved in --batches by an "
        "earlier --micro run (a fresh engine through jaxinfer.LLM)",
    )
    ap.add_argument(
        "--cache-dir",
        default="/tmp/jaxcache_steady",
        help="persistent compilation cache (JAXINFER_CACHE_DIR) for the job",
    )
    ap.add_argument(
        "--results-dir", default=os.environ.get("JAXINFER_RESULTS_DIR", str(REPO / "results"))
    )
    args = ap.parse_args()

    path, vocab, _ = resolve_model("llama110m")  # its build cache: the caller's JAXINFER_CACHE_DIR
    os.environ["JAXINFER_CACHE_DIR"] = args.cache_dir
    cache = Path(args.cache_dir)
    was_filled = cache.exists() and any(cache.rglob("jit_forward_step-*-cache"))

    from jax import monitoring

    state = {
        "runner": None,
        "key": None,
        "capture": args.micro,
        "captured": {},
        "t": Timers(),
        "fwd_keys": Timers(),
        "sync": False,
        "live_rows": collections.defaultdict(collections.Counter),
    }
    kinds = {
        "/jax/core/compile/jaxpr_trace_duration": "trace",
        "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
        "/jax/core/compile/backend_compile_duration": "compile",
    }

    def on_duration(event, duration, **kw):
        if event in kinds and "mon" in state:
            state["mon"].add(kinds[event], duration)

    monitoring.register_event_duration_secs_listener(on_duration)
    install_hooks(state)
    code = checkout()  # at the start: what this process imported
    if args.micro_only:
        import pickle

        import jaxinfer
        from jaxinfer.models import paged_attention as pa

        with open(args.batches, "rb") as f:
            captured = pickle.load(f)
        if args.only:
            captured = {k: v for k, v in captured.items() if str(k) in args.only.split(",")}
        if args.decode_pages_per_chunk:
            pa.DECODE_PAGES_PER_CHUNK = args.decode_pages_per_chunk
        if args.decode_items_per_group:
            pa.DECODE_ITEMS_PER_GROUP = args.decode_items_per_group
        if args.decode_dots == "elementwise":
            pa.jnp = ElementwiseDecodeDots(pa.jnp)
        rss_guard(args.rss_limit_gb)
        llm = jaxinfer.LLM(
            str(path), max_model_len=args.max_model_len, kv_cache_dtype=args.kv_cache_dtype
        )
        load0 = load_avg()
        res = micro(llm.engine, captured, args.micro_repeats, not args.forward_only)
        res["load_before"], res["load_after"] = load0, load_avg()
        emit(
            {
                "bench": "profile_steady",
                **host_info(),
                **code,
                "model": str(path),
                "kv_cache_dtype": args.kv_cache_dtype,
                "decode_pages_per_chunk": pa.DECODE_PAGES_PER_CHUNK,
                "decode_items_per_group": pa.DECODE_ITEMS_PER_GROUP,
                "decode_dots": args.decode_dots,
                "micro": res,
            },
            "profile_steady",
            args.results_dir,
        )
        return

    tmp = Path(tempfile.mkdtemp(prefix="profile_steady_"))
    reqs = make_workload(
        args.num_prompts,
        max_model_len=args.max_model_len,
        vocab=vocab,
        seed=args.seed,
        mean_input=args.mean_input,
        mean_output=args.mean_output,
    )
    prompts = tmp / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i, (ids, n) in enumerate(reqs):
            f.write(
                json.dumps(
                    {"id": f"p{i}", "prompt_token_ids": ids, "max_tokens": n, "ignore_eos": True}
                )
                + "\n"
            )
    runs = []
    modes = [m.strip() for m in args.runs.split(",") if m.strip()]
    if not was_filled:
        log(f"[steady] filling the persistent cache {cache} (cold run)")
        r = run_job(args, path, prompts, tmp / "out.jsonl", "async", state)
        r["mode"] = "fill"
        runs.append(r)
    from jaxinfer.compile import buckets as bucket_reuse

    default_reuse = bucket_reuse.REUSE_STEPS
    for i, spec in enumerate(modes):
        mode, _, reuse = spec.partition("@")
        bucket_reuse.REUSE_STEPS = int(reuse) if reuse else default_reuse
        state["capture"] = args.micro and mode == "sync"
        r = run_job(args, path, prompts, tmp / "out.jsonl", mode, state)
        r["reuse_steps"] = bucket_reuse.REUSE_STEPS
        r["warm_kind"] = "warm process" if i == 0 and was_filled else "in-memory"
        runs.append(r)
        brief = {k: v for k, v in r.items() if k not in ("timers", "forward_by_key")}
        log(
            f"[steady] {mode}: wall {r['wall_s']} s, load {r['load_before']} -> "
            f"{r['load_after']}; {json.dumps(brief)}"
        )
    summary = {
        "bench": "profile_steady",
        **host_info(),
        **code,
        "model": str(path),
        "num_prompts": args.num_prompts,
        "mean_input": args.mean_input,
        "mean_output": args.mean_output,
        "cache_dir": args.cache_dir,
        "cli_args": args.cli_args,
        "cache_was_filled": was_filled,
        "runs": runs,
    }
    if args.micro and state["captured"]:
        import pickle

        import jax
        import numpy as np

        with open(args.batches, "wb") as f:
            pickle.dump(
                {
                    td: (jax.tree.map(np.asarray, b), np.asarray(p), k)
                    for td, (b, p, k) in state["captured"].items()
                },
                f,
            )
        log(f"[steady] decode batches Td {sorted(state['captured'])} saved to {args.batches}")
    emit(summary, "profile_steady", args.results_dir)


if __name__ == "__main__":
    sys.exit(main())
