"""Decode attention alone (``paged_attention._decode_attention``, the XLA path the CPU engine runs)
at the ~110M Llama's shapes, against the live KV's read floor. One JSON line on stdout.

    python scripts/bench_decode_attention.py                      # the working tree's version
    python scripts/bench_decode_attention.py --variants rev:HEAD,tree --repeats 9
    python scripts/bench_decode_attention.py --variants tree:gs=32:ch=4,tree:gs=64:ch=2

Shapes: 12 layers (one jitted call runs the 12 layers' attention in a chain, each layer's query
depending on the previous layer's output, as in a forward), 12 heads of 64 (no GQA), f32, a
page-major pool (the CPU engine's default) of 8-token pages (the CPU default page size). Scenarios
(``--scenarios``; Td rows, live rows, KV lengths uniform in [lo, hi], M pages per table):
``td8`` 8 live of 8, 16-512, M 64; ``td16`` 16 of 16, 16-512, M 64; ``td64`` 41 of 64 (the job's
mean live rows at Td=64), 16-256, M 32; ``td64cap`` 17 of 64 with the KV lengths of the decode
batch captured from the 64-prompt job (140-212). Pages of all rows are shuffled over the pool.

Variants (``--variants``, comma list, timed alternately in one process, medians over
``--repeats``): ``tree`` the working tree's ``jaxinfer.models.paged_attention``; ``rev:REV`` that
module
as of git revision REV (``git show``); ``file:PATH`` a module file. Each may end in
``:gs=N`` / ``:ch=N`` to set its ``DECODE_ITEMS_PER_GROUP`` / ``DECODE_PAGES_PER_CHUNK``, and
``:kernel=1`` to send the decode rows to the native CPU kernel (``decode_kernel=True``, what
``attn_impl="cpu_kernel"`` runs; ``jaxinfer/models/cpu_decode_kernel.py``). Every
variant's output is checked against the first one's (max abs difference reported).

Per variant and scenario: wall ms per call (median and best), the process's CPU ms per call
(user + system, all threads; steadier than wall on a loaded machine), minor page faults per call
(fresh memory XLA's per-call temporaries touch), the compiled call's temporary bytes, and
``x_floor`` = median wall / floor, floor = bytes of live K and V (12 layers) / the read bandwidth
measured in the same run (``bench_roofline.measure_bandwidth``). ``uptime`` before and after.

``--forward``: instead, the whole decode forward of the 64-prompt llama110m job
(``profile_steady``'s model and the decode batches its ``--micro`` saved to ``--batches``) with the
XLA decode attention, with the CPU kernel, and with attention replaced by a pass-through (as
``profile_steady --micro-only``), timed alternately in one process: the attention share of a
decode step, with and without the kernel, in wall and CPU time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

L, K, H, Z = 12, 12, 64, 8
SCENARIOS = {  # name: (Td, live rows, min len, max len, M pages per table, fixed lens or None)
    "td8": (8, 8, 16, 512, 64, None),
    "td16": (16, 16, 16, 512, 64, None),
    "td64": (64, 41, 16, 256, 32, None),
    "td64cap": (
        64,
        17,
        0,
        0,
        32,
        [212, 185, 160, 162, 173, 158, 193, 182, 154, 170, 172, 146, 173, 143, 190, 192, 208],
    ),
}


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def scenario(name: str, seed: int = 0):
    """(kv_lens i32[Td], block_tables i32[Td, M], pool pages P) of a scenario."""
    import numpy as np

    td, live, lo, hi, m, fixed = SCENARIOS[name]
    rng = np.random.default_rng(seed)
    lens = np.zeros(td, np.int32)
    lens[:live] = fixed if fixed is not None else rng.integers(lo, hi + 1, live)
    npg = -(-lens // Z)
    total = int(npg.sum())
    pool = total + 1 + 64
    perm = rng.permutation(np.arange(1, pool))[:total]
    bt = np.zeros((td, m), np.int32)
    at = 0
    for r in range(td):
        bt[r, : npg[r]] = perm[at : at + npg[r]]
        at += npg[r]
    return lens, bt, pool


def load_variant(spec: str, tmp: Path):
    """(label, module, knobs) of a ``--variants`` entry."""
    parts = spec.split(":")
    kind, rest = parts[0], parts[1:]
    knobs = {}
    while rest and "=" in rest[-1]:
        k, v = rest.pop().split("=")
        knobs[
            {
                "gs": "DECODE_ITEMS_PER_GROUP",
                "ch": "DECODE_PAGES_PER_CHUNK",
                "kernel": "BENCH_DECODE_KERNEL",
            }[k]
        ] = int(v)
    if kind == "tree":
        path = ROOT / "jaxinfer" / "paged_attention.py"
    elif kind == "rev":
        src = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rest[0]}:jaxinfer/models/paged_attention.py"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        path = tmp / f"pa_{rest[0].replace('/', '_')}.py"
        path.write_text(src)
    elif kind == "file":
        path = Path(rest[0])
    else:
        raise SystemExit(
            f"--variants: unknown kind {kind!r} in {spec!r} (tree, rev:REV, file:PATH)"
        )
    mod_name = f"pa_variant_{abs(hash(spec))}"
    mspec = importlib.util.spec_from_file_location(mod_name, path)
    mod = importlib.util.module_from_spec(mspec)
    sys.modules[mod_name] = mod  # dataclasses look their module up
    mspec.loader.exec_module(mod)
    for k, v in knobs.items():
        setattr(mod, k, v)
    return spec, mod


def chain(mod):
    """A jitted call of the 12 layers' decode attention, each query fed by the previous output."""
    import jax
    import jax.numpy as jnp

    kernel = {"decode_kernel": True} if getattr(mod, "BENCH_DECODE_KERNEL", 0) else {}

    def run(q, kp, vp, bt, lens, pos):
        outs = []
        for layer in range(L):
            o = mod._decode_attention(
                q,
                kp,
                vp,
                bt,
                lens,
                pos,
                jnp.int32(0),
                scale=0.125,
                softcap=None,
                layer=layer,
                k_scales=None,
                v_scales=None,
                page_major=True,
                **kernel,
            )
            outs.append(o)
            q = q + 1e-3 * o
        return jnp.stack(outs)

    return jax.jit(run)


def forward_mode(args) -> dict:
    """``--forward``: whole decode forwards, XLA attention vs the kernel vs no attention."""
    import pickle

    import jax
    import numpy as np
    from benchlib import resolve_model

    import jaxinfer
    from jaxinfer.engine.step import forward_step, resolve_tokens
    from jaxinfer.models.forward import compute_logits, forward

    path, _, _ = resolve_model("llama110m")
    with open(args.batches, "rb") as f:
        captured = {k: v for k, v in pickle.load(f).items() if k.startswith("decode")}
    llm = jaxinfer.LLM(str(path), max_model_len=512)
    eng = llm.engine
    cfg, params = eng.cfg, eng.params
    eng.runner.kv = None
    box = [eng.runner.new_kv_cache()]
    out = {}
    for kind, (batch, prev, *_) in sorted(captured.items()):
        fns = {}
        for label, impl in (("xla", "xla"), ("kernel", "cpu_kernel")):
            f = jax.jit(
                lambda p, kv, b, pv, impl=impl: forward_step(p, kv, b, pv, cfg=cfg, attn_impl=impl),
                donate_argnums=1,
            )
            box[0], lg = f(params, box[0], batch, prev)
            fns[label] = f

        def noattn(p, kv, b, pv):
            h, kv = forward(
                p,
                cfg,
                resolve_tokens(b.tokens, pv),
                b.md.positions,
                kv,
                lambda q, k, v, cache, layer, window, sinks: (q, cache),
            )
            return kv, compute_logits(p, cfg, h[b.logits_indices])

        fns["no_attention"] = jax.jit(noattn, donate_argnums=1)
        box[0], _ = fns["no_attention"](params, box[0], batch, prev)
        ts = {k: ([], []) for k in fns}
        for _ in range(args.repeats):
            for label, f in fns.items():
                c0, t0 = time.process_time(), time.perf_counter()
                box[0], lg = f(params, box[0], batch, prev)
                jax.block_until_ready(lg)
                ts[label][0].append(time.perf_counter() - t0)
                ts[label][1].append(time.process_time() - c0)
        res = {
            k: {
                "wall_p50_ms": round(float(np.median(w)) * 1e3, 1),
                "wall_best_ms": round(min(w) * 1e3, 1),
                "cpu_p50_ms": round(float(np.median(c)) * 1e3, 1),
            }
            for k, (w, c) in ts.items()
        }
        md = batch.md
        res["live_rows"] = int((np.asarray(md.kv_lens) > 0).sum())
        res["kv_tokens"] = int(np.asarray(md.kv_lens).sum())
        for label in ("xla", "kernel"):
            for m in ("wall_p50_ms", "cpu_p50_ms"):
                a, n = res[label][m], res["no_attention"][m]
                res[label][m.replace("_p50_ms", "_attention_share")] = round((a - n) / a, 3)
        out[kind] = res
        print(f"[{kind}] {json.dumps(res)}", file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--variants", default="tree")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--forward", action="store_true", help="whole decode forwards of the 110M job (see above)"
    )
    ap.add_argument(
        "--batches",
        default="/tmp/profile_steady_batches.pkl",
        help="--forward: decode batches saved by profile_steady.py --micro",
    )
    args = ap.parse_args()
    if args.forward:
        up0 = uptime()
        res = forward_mode(args)
        print(
            json.dumps(
                {
                    "bench": "decode_attention_forward",
                    "uptime_before": up0,
                    "uptime_after": uptime(),
                    "repeats": args.repeats,
                    "forward": res,
                }
            )
        )
        return

    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench_roofline import measure_bandwidth

    up0 = uptime()
    tmp = Path(tempfile.mkdtemp())
    variants = [load_variant(s.strip(), tmp) for s in args.variants.split(",")]
    bw = measure_bandwidth(256, 5)["bytes_s"]
    out = {
        "bench": "decode_attention",
        "uptime_before": up0,
        "bandwidth_gb_s": round(bw / 1e9, 2),
        "variants": [v[0] for v in variants],
        "repeats": args.repeats,
        "scenarios": {},
    }
    for name in args.scenarios.split(","):
        lens, bt, pool = scenario(name)
        td = len(lens)
        rng = np.random.default_rng(1)
        kp = jnp.asarray(rng.standard_normal((L, pool, K, Z, H), np.float32))
        vp = jnp.asarray(rng.standard_normal((L, pool, K, Z, H), np.float32))
        q = jnp.asarray(rng.standard_normal((td, K, 1, H), np.float32))
        call = (q, kp, vp, jnp.asarray(bt), jnp.asarray(lens), jnp.asarray(np.maximum(lens - 1, 0)))
        fns, res, ref = {}, {}, None
        for label, mod in variants:
            f = chain(mod)
            temp = f.lower(*call).compile().memory_analysis().temp_size_in_bytes
            o = np.asarray(f(*call))
            diff = 0.0 if ref is None else float(np.abs(o - ref).max())
            ref = o if ref is None else ref
            fns[label] = f
            res[label] = {
                "temp_mb": round(temp / 1e6, 2),
                "max_abs_diff": diff,
                "wall": [],
                "cpu": [],
                "faults": [],
            }
        for _ in range(args.repeats):
            for label, f in fns.items():
                r0 = resource.getrusage(resource.RUSAGE_SELF)
                c0, t0 = time.process_time(), time.perf_counter()
                jax.block_until_ready(f(*call))
                t1, c1 = time.perf_counter(), time.process_time()
                r1 = resource.getrusage(resource.RUSAGE_SELF)
                res[label]["wall"].append(t1 - t0)
                res[label]["cpu"].append(c1 - c0)
                res[label]["faults"].append(r1.ru_minflt - r0.ru_minflt)
        live_bytes = int(lens.sum()) * L * 2 * K * H * 4
        floor = live_bytes / bw
        sc = {
            "td": td,
            "live_rows": int((lens > 0).sum()),
            "kv_tokens": int(lens.sum()),
            "pages_per_table": int(bt.shape[1]),
            "floor_ms": round(floor * 1e3, 2),
        }
        for label, r in res.items():
            w = float(np.median(r["wall"]))
            sc[label] = {
                "wall_p50_ms": round(w * 1e3, 2),
                "wall_best_ms": round(min(r["wall"]) * 1e3, 2),
                "cpu_p50_ms": round(float(np.median(r["cpu"])) * 1e3, 2),
                "faults_p50": int(np.median(r["faults"])),
                "temp_mb": r["temp_mb"],
                "x_floor": round(w / floor, 1),
                "max_abs_diff": r["max_abs_diff"],
            }
        out["scenarios"][name] = sc
        print(f"[{name}] {json.dumps(sc)}", file=sys.stderr, flush=True)
    out["uptime_after"] = uptime()
    out["malloc_env"] = os.environ.get("GLIBC_TUNABLES", "")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
