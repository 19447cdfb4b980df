"""Device check of the Pallas kernels on a GPU or TPU: un-interpreted kernel tests, then timings.

1. Runs the kernel tests compiled for this device (``JAXINFER_KERNEL_DEVICE=<backend>`` makes
   tests/test_ragged_paged_attention.py and tests/test_grouped_matmul.py run their cases for this
   backend with interpret=False, and the FlashAttention tests' device path) in pytest
   subprocesses.
2. Times, for a few realistic shapes (Llama-3-8B heads: N=32, K=8, H=128, bf16, page size 16),
   our ragged paged attention kernel, the XLA reference (``ragged_paged_attention_xla``), jax's
   shipped Pallas ops (``jax.experimental.pallas.ops``: TPU ``paged_attention`` /
   ``ragged_paged_attention``, GPU ``paged_attention`` / ``attention.mha``) and our FlashAttention
   kernel (``kernels_pallas.flash_attention``, when present) on the prefill shape; each entry
   reports the median milliseconds and the max abs difference from the XLA reference.

On the GPU the dense 4k prefill is also timed with PyTorch's ``scaled_dot_product_attention``
restricted to its flash backend (K/V heads repeated to the query heads) and with
``jax.nn.dot_product_attention(implementation="cudnn")``, and ``flash_fwd_bwd`` runs our
FlashAttention forward and backward compiled for the device against ``mha_reference`` (max abs
differences of the output and of dq, dk, dv). Every timing entry carries ``hbm_tb_s`` / ``frac_hbm``
(bytes: Q, the output and the K/V of every live token, once; of ``PEAK_HBM_TB_S``) and
``tflop_s`` / ``frac_peak_tflop_s`` (4 x heads x head_dim per attended query/key pair; of
``PEAK_BF16_TFLOP_S``): the H200's figures, so fractions are meaningful on an H200 only.

Prints one JSON object: {"device", "tests": {...}, "timings": [...], "flash_fwd_bwd": {...}}.
Designed to finish in under 8 minutes (tests capped at 315 s; each timing a few iterations).
Usage: ``python scripts/device_check_kernels.py [--skip-tests] [--iters N] [--quick]``;
``--cpu-smoke`` runs the same code paths on CPU in seconds (kernels interpreted, tiny shapes, no
tests, torch SDPA's math backend; figures meaningless) to check the script before a device run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST_TIMEOUT_S = 270
GMM_TEST_TIMEOUT_S = 45  # tests/test_grouped_matmul.py's cases of one backend, compiled
PEAK_HBM_TB_S = 4.8  # H200 HBM3e
PEAK_BF16_TFLOP_S = 790.0  # H200 dense bf16, measured (the figure)


def run_tests(backend: str) -> list[dict]:
    """Kernel tests compiled for ``backend``, in subprocesses (before this process takes the
    device): ours whole, FlashAttention's device tests (``-k device``) when that folder exists,
    the grouped matmul's cases of this backend (``-k <backend>``)."""
    env = {
        **os.environ,
        "JAXINFER_KERNEL_DEVICE": backend,
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    }
    runs = [(["tests/test_ragged_paged_attention.py"], 200)]
    fa = "tests/test_flash_attention.py"
    if (ROOT / fa).exists():
        runs.append(([fa, "-k", "device"], TEST_TIMEOUT_S - 200))
    runs.append((["tests/test_grouped_matmul.py", "-k", backend], GMM_TEST_TIMEOUT_S))
    results = []
    for files, timeout in runs:
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            *files,
        ]
        t0 = time.time()
        try:
            p = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
            )
            out, rc = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            rc = "timeout"
        counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", out)}
        res = {"files": files, "rc": rc, "seconds": round(time.time() - t0, 1), **counts}
        if rc != 0:
            res["tail"] = out[-3000:]
        results.append(res)
    return results


def bench(fn, args, iters: int) -> float:
    """Median wall milliseconds of ``fn(*args)`` (jitted, compiled first)."""
    import jax
    import numpy as np

    out = jax.block_until_ready(fn(*args))
    del out
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(ts))


def make_case(rng, rows, *, n=32, kh=8, h=128, z=16, dtype="bfloat16"):
    """rows: [(kv_len, q_len)], decode rows (q_len 1) first. A pool with exactly the pages needed
    (random page order), metadata as the engine builds it."""
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.models.paged_attention import AttentionMetadata

    m = max(-(-kl // z) for kl, _ in rows)
    num_pages = sum(-(-kl // z) for kl, _ in rows) + 1
    perm = rng.permutation(np.arange(1, num_pages))
    bt = np.zeros((len(rows), m), np.int32)
    pos, seq, off = [], [], 0
    for r, (kl, ql) in enumerate(rows):
        np_ = -(-kl // z)
        bt[r, :np_] = perm[off : off + np_]
        off += np_
        pos += list(range(kl - ql, kl))
        seq += [r] * ql
    kv_lens = np.array([kl for kl, _ in rows], np.int32)
    cu = np.concatenate([[0], np.cumsum([ql for _, ql in rows])]).astype(np.int32)
    t = int(cu[-1])
    nd = sum(1 for _, ql in rows if ql == 1)
    md = AttentionMetadata(
        jnp.asarray(pos, jnp.int32),
        jnp.zeros(t, jnp.int32),
        jnp.asarray(bt),
        jnp.asarray(kv_lens),
        jnp.asarray(cu),
        jnp.asarray(seq, jnp.int32),
        num_decode=nd,
    )
    dt = jnp.dtype(dtype)
    kp = jnp.asarray(rng.standard_normal((kh, num_pages, z, h), np.float32), dt)
    vp = jnp.asarray(rng.standard_normal((kh, num_pages, z, h), np.float32), dt)
    q = jnp.asarray(rng.standard_normal((t, n, h), np.float32), dt)
    return q, kp, vp, md


def timings(backend: str, iters: int, quick: bool, smoke: bool = False) -> list[dict]:
    """Timing table; ``smoke``: CPU, kernels interpreted, tiny shapes (checks the code paths)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.models.paged_attention import ragged_paged_attention_xla
    from kernels_pallas.ragged_paged_attention import ragged_paged_attention

    rng = np.random.default_rng(0)
    heads = dict(n=8, kh=2, h=64) if smoke else dict(n=32, kh=8, h=128)
    scale = heads["h"] ** -0.5
    ctx = 64 if smoke else 256 if quick else 4096
    nb = 4 if smoke else 64
    shapes = {
        f"decode_b{nb}_ctx{ctx}": [(ctx - int(rng.integers(0, 16)), 1) for _ in range(nb)],
        f"mixed_d{nb // 2}_ctx{ctx // 2}_p4x{ctx // 16}": [(ctx // 2, 1)] * (nb // 2)
        + [(ctx // 4, ctx // 16)] * 4,
        f"prefill_1x{ctx}": [(ctx, ctx)],
    }
    results = []
    for name, rows in shapes.items():
        q, kp, vp, md = make_case(rng, rows, **heads)
        impls = {
            "xla": jax.jit(
                lambda q, kp, vp, md: ragged_paged_attention_xla(
                    q, kp, vp, md, jnp.int32(0), scale=scale
                )
            ),
            f"ours_pallas_{backend}" + ("_interpret" if smoke else ""): jax.jit(
                lambda q, kp, vp, md: ragged_paged_attention(
                    q,
                    kp,
                    vp,
                    md.kv_lens,
                    md.block_tables,
                    md.cu_q_lens,
                    jnp.int32(0),
                    jnp.int32(0),
                    num_decode=md.num_decode,
                    scale=scale,
                    backend=backend,
                    interpret=smoke,
                )
            ),
        }
        if not smoke:
            impls.update(shipped_ops(backend, name, q, kp, vp, md, scale))
        elif name.startswith("prefill"):
            impls["jax_gpu_mha"] = _raiser(RuntimeError("skipped: --cpu-smoke (GPU only)"))
        if name.startswith("prefill"):
            impls.update(dense_prefill_peers(backend, q, kp, vp, md, scale, smoke))
        ref = None
        pairs = sum(kl * ql - ql * (ql - 1) // 2 for kl, ql in rows)  # causal query/key pairs
        n, h, kh = q.shape[1], q.shape[2], kp.shape[0]
        isz = q.dtype.itemsize
        nbytes = 2 * q.size * isz + 2 * int(np.asarray(md.kv_lens).sum()) * kh * h * isz
        for impl, fn in impls.items():
            entry = {
                "shape": name,
                "impl": impl,
                "tokens": int(q.shape[0]),
                "kv_tokens": int(np.asarray(md.kv_lens).sum()),
            }
            try:
                if getattr(fn, "torch_ms", None):  # PyTorch: timed with CUDA events
                    out, ms = fn.torch_ms(iters)
                    entry["ms"] = round(ms, 4)
                else:
                    args = (q, kp, vp, md)
                    out = np.asarray(jax.block_until_ready(fn(*args)), np.float32)
                    entry["ms"] = round(bench(fn, args, iters), 4)
                if impl == "xla":
                    ref = out
                if ref is not None:
                    entry["max_abs_diff_vs_xla"] = float(np.abs(out - ref).max())
                sec = entry["ms"] / 1e3
                entry["hbm_tb_s"] = round(nbytes / sec / 1e12, 4)
                entry["frac_hbm"] = round(nbytes / sec / 1e12 / PEAK_HBM_TB_S, 4)
                entry["tflop_s"] = round(4 * n * h * pairs / sec / 1e12, 3)
                entry["frac_peak_tflop_s"] = round(entry["tflop_s"] / PEAK_BF16_TFLOP_S, 4)
            except Exception as e:  # reported in the table, never replaced by another impl
                entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            results.append(entry)
    return results


def dense_prefill_peers(backend, q, kp, vp, md, scale, smoke) -> dict:
    """The one-sequence prefill as dense attention by cuDNN (jax) and PyTorch SDPA's flash backend;
    outputs f32[T, N, H] like ours. The page gather to a dense K/V is done outside the timing."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    n, kh = q.shape[1], kp.shape[0]
    kd = kp[:, md.block_tables[0]].reshape(kh, -1, kp.shape[-1])[:, : q.shape[0]]  # [K, S, H]
    vd = vp[:, md.block_tables[0]].reshape(kh, -1, vp.shape[-1])[:, : q.shape[0]]
    out = {}
    if backend == "gpu" and not smoke:
        kb, vb = kd.transpose(1, 0, 2)[None], vd.transpose(1, 0, 2)[None]  # [1, S, K, H]
        f = jax.jit(
            lambda q: jax.nn.dot_product_attention(
                q[None], kb, vb, scale=scale, is_causal=True, implementation="cudnn"
            )[0]
        )
        out["jax_cudnn_dot_product_attention(dense)"] = lambda q, kp, vp, md: f(q)
    else:
        out["jax_cudnn_dot_product_attention(dense)"] = _raiser(
            RuntimeError(f"skipped: cuDNN needs a GPU (backend {backend!r}, smoke={smoke})")
        )
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        out["torch_sdpa_flash(dense)"] = _raiser(RuntimeError(f"skipped: no PyTorch ({e})"))
        return out
    cuda = torch.cuda.is_available() and not smoke
    if not cuda and not smoke:
        out["torch_sdpa_flash(dense)"] = _raiser(RuntimeError("skipped: torch.cuda unavailable"))
        return out
    dev, kind = ("cuda", SDPBackend.FLASH_ATTENTION) if cuda else ("cpu", SDPBackend.MATH)
    dt = torch.bfloat16 if q.dtype == jnp.bfloat16 else torch.float32
    t = lambda a: torch.from_numpy(np.asarray(a, np.float32)).to(dev, dt)
    tq = t(q).transpose(0, 1)[None]  # [1, N, T, H]
    tk = t(kd).repeat_interleave(n // kh, 0)[None]  # [1, N, S, H]: flash has no GQA here
    tv = t(vd).repeat_interleave(n // kh, 0)[None]

    class TorchSdpa:
        def torch_ms(self, iters):
            import torch.nn.functional as F

            def run():
                with sdpa_kernel(kind):
                    return F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, scale=scale)

            o = run()
            ts = []
            for _ in range(iters):
                if cuda:
                    s = torch.cuda.Event(enable_timing=True)
                    e = torch.cuda.Event(enable_timing=True)
                    s.record()
                    run()
                    e.record()
                    torch.cuda.synchronize()
                    ts.append(s.elapsed_time(e))
                else:
                    t0 = time.perf_counter()
                    run()
                    ts.append((time.perf_counter() - t0) * 1e3)
            return o[0].transpose(0, 1).float().cpu().numpy(), float(np.median(ts))

    out["torch_sdpa_flash(dense)" if cuda else "torch_sdpa_math_cpu(dense)"] = TorchSdpa()
    return out


def flash_fwd_bwd(backend: str, iters: int, smoke: bool) -> dict:
    """Our FlashAttention forward and backward (compiled for ``backend``, interpreted when
    ``smoke``) against ``mha_reference`` in float32: max abs differences and median ms."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    try:
        from kernels_pallas.flash_attention import BlockSizes, flash_attention, mha_reference
    except ImportError as e:
        return {"error": f"skipped: {e}"}
    b, n, kh, t, h = (1, 4, 2, 128, 64) if smoke else (1, 32, 8, 2048, 128)
    rng = np.random.default_rng(1)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32), jnp.bfloat16)
    q, k, v, ct = mk(b, n, t, h), mk(b, kh, t, h), mk(b, kh, t, h), mk(b, n, t, h)
    scale = h**-0.5
    ours = lambda q, k, v: flash_attention(
        q,
        k,
        v,
        causal=True,
        sm_scale=scale,
        backend=backend,
        block_sizes=BlockSizes(block_q=64, block_k=64),
        interpret=smoke,
    )
    ref = lambda q, k, v: mha_reference(
        q.astype(jnp.float32),
        k.astype(jnp.float32),
        v.astype(jnp.float32),
        causal=True,
        sm_scale=scale,
    )

    def fwd_bwd(f):
        return jax.jit(
            lambda q, k, v: (lambda o, vjp: (o, *vjp(ct.astype(o.dtype))))(*jax.vjp(f, q, k, v))
        )

    res = {"shape": {"B": b, "N": n, "K": kh, "T": t, "H": h, "dtype": "bfloat16"}}
    try:
        got = [np.asarray(x, np.float32) for x in fwd_bwd(ours)(q, k, v)]
        want = [np.asarray(x, np.float32) for x in fwd_bwd(ref)(q, k, v)]
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            res[f"max_abs_diff_{name}"] = float(np.abs(g - w).max())
            res[f"max_abs_{name}_ref"] = float(np.abs(w).max())
        res["fwd_ms"] = round(bench(jax.jit(ours), (q, k, v), iters), 4)
        res["fwd_bwd_ms"] = round(bench(fwd_bwd(ours), (q, k, v), iters), 4)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return res


def shipped_ops(backend, name, q, kp, vp, md, scale) -> dict:
    """jax's own Pallas ops (and our FlashAttention) on the same inputs, as f(q, kp, vp, md)."""
    import jax
    import jax.numpy as jnp

    out = {}
    n, kh = q.shape[1], kp.shape[0]
    g = n // kh
    if name.startswith("decode"):
        if backend == "tpu":
            from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

            out["jax_tpu_paged_attention"] = jax.jit(
                lambda q, kp, vp, md: paged_attention(
                    q * scale, kp, vp, md.kv_lens, md.block_tables, pages_per_compute_block=8
                )
            )
        else:
            from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

            out["jax_gpu_paged_attention"] = jax.jit(
                lambda q, kp, vp, md: paged_attention(
                    q * scale, kp, vp, md.block_tables, md.kv_lens, pages_per_compute_block=8
                )
            )
    if backend == "tpu":
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

        def rpa(q, kp, vp, md):
            # jax's layout: [P, Z, 2K, H], K and V interleaved per head (built outside timing
            # would be fairer; the interleave is a copy of the live pool, reported as is).
            kv = jnp.stack([kp, vp], axis=1).reshape(2 * kh, *kp.shape[1:]).transpose(1, 2, 0, 3)
            return ragged_paged_attention(
                q,
                kv,
                md.kv_lens,
                md.block_tables,
                md.cu_q_lens,
                jnp.array([md.kv_lens.shape[0]], jnp.int32),
                sm_scale=scale,
            )

        out["jax_tpu_ragged_paged_attention(incl_kv_interleave)"] = jax.jit(rpa)
    if name.startswith("prefill"):

        def dense_kv(kp, md):  # [K, P, Z, H] -> [1, K, S, H], one sequence
            return kp[:, md.block_tables[0]].reshape(kh, -1, kp.shape[-1])[None]

        try:
            from kernels_pallas.flash_attention import flash_attention

            out["ours_flash_attention(incl_page_gather)"] = jax.jit(
                lambda q, kp, vp, md: flash_attention(
                    q.transpose(1, 0, 2)[None],
                    dense_kv(kp, md),
                    dense_kv(vp, md),
                    causal=True,
                    sm_scale=scale,
                    backend=backend,
                )[0].transpose(1, 0, 2)
            )
        except ImportError as e:
            out["ours_flash_attention"] = _raiser(e)
        if backend == "gpu":
            from jax.experimental.pallas.ops.gpu.attention import mha

            out["jax_gpu_mha(incl_page_gather)"] = jax.jit(
                lambda q, kp, vp, md: mha(
                    q[None],
                    jnp.repeat(dense_kv(kp, md)[0].transpose(1, 0, 2), g, axis=1)[None],
                    jnp.repeat(dense_kv(vp, md)[0].transpose(1, 0, 2), g, axis=1)[None],
                    None,
                    sm_scale=scale,
                    causal=True,
                )[0]
            )
        else:
            from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention as tfa

            out["jax_tpu_flash_attention(incl_page_gather)"] = jax.jit(
                lambda q, kp, vp, md: tfa(
                    q.transpose(1, 0, 2)[None],
                    jnp.repeat(dense_kv(kp, md), g, axis=1),
                    jnp.repeat(dense_kv(vp, md), g, axis=1),
                    causal=True,
                    sm_scale=scale,
                )[0].transpose(1, 0, 2)
            )
    return out


def _raiser(e):
    def f(*_):
        raise e

    return f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="short contexts (smoke run)")
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="CPU: interpreted kernels, tiny shapes, no tests (checks the script)",
    )
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    t0 = time.time()
    import jax  # noqa: F401  (backend query only; the tests run in a subprocess first)

    backend = "gpu" if args.cpu_smoke else _backend()
    report = {
        "device": backend,
        "cpu_smoke": args.cpu_smoke,
        "tests": None,
        "timings": [],
        "peak_hbm_tb_s": PEAK_HBM_TB_S,
        "peak_bf16_tflop_s": PEAK_BF16_TFLOP_S,
    }
    if backend not in ("tpu", "gpu"):
        report["error"] = f"jax backend is {backend!r}: this script needs a TPU or GPU"
        print(json.dumps(report, indent=1))
        return 2
    if args.cpu_smoke:
        report["device"] = f"cpu (smoke: {jax.default_backend()}, kernels interpreted)"
    elif not args.skip_tests:
        report["tests"] = run_tests(backend)
    iters = 2 if args.cpu_smoke else args.iters
    report["timings"] = timings(backend, iters, args.quick, smoke=args.cpu_smoke)
    report["flash_fwd_bwd"] = flash_fwd_bwd(backend, iters, args.cpu_smoke)
    report["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(report, indent=1))
    ok = args.skip_tests or args.cpu_smoke or all(r["rc"] == 0 for r in report["tests"])
    bad = [
        t
        for t in report["timings"]
        if "error" in t and not t["error"].startswith("RuntimeError: skipped")
    ]
    return 0 if ok and not bad and "error" not in report["flash_fwd_bwd"] else 1


def _backend() -> str:
    # Ask in a subprocess so this process does not take the device before the tests run.
    p = subprocess.run(
        [sys.executable, "-c", "import jax; print(jax.default_backend())"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "unknown"


if __name__ == "__main__":
    sys.exit(main())
