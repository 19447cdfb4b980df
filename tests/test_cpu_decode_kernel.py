"""The native CPU decode-attention kernel (jaxinfer/models/cpu_decode_kernel.py; what
attn_impl="auto"
runs on CPU where it can, or asked by name with attn_impl="cpu_kernel") == numpy float64
attention; the engine with it, and with attn_impl="xla", reproduces llama2.c's greedy
stories260K outputs; "auto" resolves per engine by the documented rule, a build failure under
"auto" warns and runs XLA, and engines an explicit "cpu_kernel" cannot serve refuse it."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_reproduces_stories_reference
from test_paged_attention import TOL, dense_reference, make_batch

from jaxinfer.models import attn_dispatch, cpu_decode_kernel
from jaxinfer.models.paged_attention import ragged_paged_attention_xla


@pytest.fixture(scope="module")
def kernel_on():
    cpu_decode_kernel.load()  # builds once per cache dir (a few seconds)


@pytest.mark.parametrize(
    "gqa,window,softcap,layered",
    [(1, 0, None, False), (2, 0, None, True), (2, 9, None, True), (4, 0, 30.0, False)],
)
def test_kernel_equals_dense_reference(kernel_on, gqa, window, softcap, layered):
    """Decode rows of lengths 1, a page, a page + 1, many pages (a table wider than a work-item
    chunk) and a padding row, over a shuffled page-major pool, optionally at layer 1 of a 2-layer
    pool; the prefill rows of the same batch go through the XLA path."""
    rng = np.random.default_rng(gqa * 10 + window)
    z, kh, h = 4, 2, 16
    seqs = [(1, 1), (z, 1), (z + 1, 1), (z * 13 + 3, 1), (2 * z + 1, 1), (z + 3, 5)]
    k_pages, v_pages, md, rows, t = make_batch(rng, z, kh, h, seqs, num_pages=48)
    assert md.num_decode == 8  # 5 decode rows padded to 8
    q = rng.standard_normal((t, kh * gqa, h)).astype(np.float32)
    kp, vp = (jnp.asarray(x.swapaxes(0, 1)) for x in (k_pages, v_pages))  # [P, K, Z, H]
    layer = None
    if layered:
        kp, vp = (jnp.stack([jnp.full_like(x, 7.0), x]) for x in (kp, vp))
        layer = jnp.int32(1)
    fn = jax.jit(
        lambda q, kp, vp, md: ragged_paged_attention_xla(
            q,
            kp,
            vp,
            md,
            jnp.int32(window),
            scale=h**-0.5,
            softcap=softcap,
            layer=layer,
            page_major=True,
            decode_kernel=True,
        )
    )
    assert "jaxinfer_cpu_decode_attention" in fn.lower(q, kp, vp, md).as_text()
    out = np.asarray(fn(q, kp, vp, md), np.float64)
    assert np.isfinite(out).all() and not out[5:8].any()  # padding rows: 0
    for tok, ql, pos, fk, fv in rows:
        ref = dense_reference(
            q[tok : tok + ql].astype(np.float64),
            fk.astype(np.float64),
            fv.astype(np.float64),
            pos,
            h**-0.5,
            window,
            softcap,
        )
        np.testing.assert_allclose(out[tok : tok + ql], ref, **TOL[jnp.float32])


def test_page_id_outside_the_pool_is_an_error(kernel_on):
    qd = jnp.ones((2, 2, 1, 8), jnp.float32)
    pages = jnp.ones((1, 4, 2, 4, 8), jnp.float32)
    bt = jnp.asarray([[1, 2], [3, 4]], jnp.int32)  # page 4 of a 4-page pool
    with pytest.raises(Exception, match="row 1 holds a page id outside the pool"):
        jax.block_until_ready(
            cpu_decode_kernel.decode_attention(
                qd,
                pages,
                pages,
                bt,
                jnp.asarray([8, 8]),
                jnp.asarray([7, 7]),
                jnp.int32(0),
                scale=1.0,
                softcap=None,
                layer=0,
            )
        )
    with pytest.raises(Exception, match="layer 1 outside the pool's 1 layers"):
        jax.block_until_ready(
            cpu_decode_kernel.decode_attention(
                qd,
                pages,
                pages,
                bt[:, :1],
                jnp.asarray([4, 4]),
                jnp.asarray([3, 3]),
                jnp.int32(0),
                scale=1.0,
                softcap=None,
                layer=1,
            )
        )


def test_build_and_input_errors(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler"):
        cpu_decode_kernel.build(tmp_path)
    with pytest.raises(ValueError, match="must be float32"):
        cpu_decode_kernel.decode_attention(
            jnp.ones((1, 1, 1, 8)),
            jnp.ones((1, 2, 1, 4, 8), jnp.bfloat16),
            jnp.ones((1, 2, 1, 4, 8), jnp.bfloat16),
            jnp.ones((1, 1), jnp.int32),
            jnp.ones(1, jnp.int32),
            jnp.zeros(1, jnp.int32),
            jnp.int32(0),
            scale=1.0,
            softcap=None,
            layer=0,
        )


def test_concurrent_builders_build_once(monkeypatch, tmp_path):
    """Builders racing on one cache dir (xdist workers) compile once: the others wait on the lock
    and find the library. A stand-in compiler counts its runs and takes 0.5 s."""
    import os
    import stat
    import threading

    cxx = tmp_path / "fake-cxx"
    cxx.write_text(
        f"#!/bin/sh\necho run >> {tmp_path}/runs\nsleep 0.5\n"
        'for last; do :; done\necho library > "$last"\n'
    )
    cxx.chmod(cxx.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CXX", str(cxx))
    libs = []
    threads = [
        threading.Thread(target=lambda: libs.append(cpu_decode_kernel.build(tmp_path)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (tmp_path / "runs").read_text() == "run\n"
    assert len(set(libs)) == 1 and libs[0].read_text() == "library\n" and len(libs) == 3
    assert sorted(os.listdir(tmp_path / "cpu_kernels")) == [".build.lock", libs[0].name]


def _decode_step_traces_the_kernel(llm, monkeypatch) -> bool:
    """Whether the engine's forward step, traced again (jit's trace, nothing compiled) with the
    shapes and static arguments of one of its own decode steps, calls
    ``cpu_decode_kernel.decode_attention``: an answer that does not depend on what this process
    compiled before (a shared engine's steps are usually compiled already)."""
    from jaxinfer.engine.step import forward_step
    from jaxinfer.sampling.params import SamplingParams

    runner, captured = llm.engine.runner, []
    forward = runner._forward

    def record(*args, **kw):  # args: params, kv, batch, prev_tokens
        if not captured and args[2].md.num_decode:
            spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
            captured.append((jax.tree.map(spec, args), kw))
        return forward(*args, **kw)

    with monkeypatch.context() as m:
        m.setattr(runner, "_forward", record)
        llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=3))
    (args, kw), traced = captured[0], []
    real = cpu_decode_kernel.decode_attention
    with monkeypatch.context() as m:
        m.setattr(
            cpu_decode_kernel, "decode_attention", lambda *a, **k: traced.append(1) or real(*a, **k)
        )
        # A new function object: jit objects of one function share their traces.
        jax.jit(lambda *a: forward_step(*a, **kw)).trace(*args)
    return bool(traced)


@pytest.mark.parametrize("attn_impl", ["auto", "xla"])
def test_engine_reproduces_llama2c(kernel_on, stories_llm, stories_llm_xla, monkeypatch, attn_impl):
    """Every greedy_reference.json case in one batch through the paged engine (page-major f32
    pool, the CPU default; conftest's shared engines): "auto" serves the decode steps with the
    kernel (traced into the engine's step function), "xla" with the XLA attention (the kernel
    never traced)."""
    llm = stories_llm if attn_impl == "auto" else stories_llm_xla
    want = "cpu_kernel" if attn_impl == "auto" else "xla"
    assert llm.engine.kv_page_major
    assert llm.engine.attn_impl == llm.engine.ecfg.attn_impl == want
    assert_reproduces_stories_reference(llm)
    assert _decode_step_traces_the_kernel(llm, monkeypatch) == (want == "cpu_kernel")


def test_auto_resolves_per_engine(kernel_on):
    """The documented rule, host only: the kernel for a page-major float32 pool on one CPU
    device without batch_invariant; XLA for every other pool, a mesh, batch_invariant, another
    backend, or attn_impl="xla"; 8-token default pages either way."""
    from jaxinfer.engine.config import default_page_size

    kw = dict(page_major=True, kv_dtype=np.float32, mesh=None, backend="cpu")
    resolve = attn_dispatch.engine_attn_impl
    assert resolve("auto", **kw)[0] == "cpu_kernel"
    assert resolve("cpu_kernel", **kw)[0] == "cpu_kernel"
    for change, why in (
        (dict(kv_dtype=np.int8), "a KV pool of int8"),
        (dict(kv_dtype=jnp.bfloat16), "a KV pool of bfloat16"),
        (dict(page_major=False), "kv_page_major=False"),
        (dict(mesh=object()), "a sharded engine"),
        (dict(batch_invariant=True), "batch_invariant=True"),
    ):
        impl, reason = resolve("auto", **{**kw, **change})
        assert impl == "xla" and why in reason, change
    assert resolve("xla", **kw)[0] == "xla"
    assert resolve("auto", **{**kw, "backend": "tpu"})[0] == "xla"
    with pytest.raises(ValueError, match="not a KV pool of int8; use attn_impl='xla'"):
        resolve("cpu_kernel", **{**kw, "kv_dtype": np.int8})
    assert [default_page_size(i, "cpu") for i in ("auto", "xla", "cpu_kernel")] == [8, 8, 8]


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """A process where the kernel was never built or loaded, and $CXX names no program."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("JAXINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_decode_kernel, "_loaded", [])
    monkeypatch.setattr(cpu_decode_kernel, "_failure", [])
    return tmp_path


def test_auto_without_a_compiler_warns_and_runs_xla(no_compiler, stories_dir, caplog):
    from jaxinfer.llm import LLM

    caplog.set_level(logging.INFO, logger="jaxinfer.models.attn_dispatch")
    llm = LLM(stories_dir, max_num_seqs=4, compilation_cache=False)
    assert llm.engine.attn_impl == llm.engine.ecfg.attn_impl == "xla"
    [warning] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    msg = warning.getMessage()
    assert "needs a C++ compiler" in msg and "no-such-compiler" in msg
    assert "the XLA attention runs instead" in msg and "--attn-impl xla" in msg
    assert llm.engine.attn_impl_reason == msg
    # Remembered: a second engine neither rebuilds nor warns again (INFO), and runs XLA.
    caplog.clear()
    impl, _ = attn_dispatch.engine_attn_impl("auto", page_major=True, kv_dtype=np.float32)
    assert impl == "xla" and caplog.records
    assert all(r.levelno == logging.INFO for r in caplog.records)


def test_explicit_kernel_without_a_compiler_raises(no_compiler, stories_dir, monkeypatch):
    """No fallback for a kernel asked by name: a missing compiler, or a build that fails (a
    stand-in compiler writes half a library, prints an error and exits 1), is a RuntimeError at
    construction naming the cause, and the failed build leaves no library or temp file."""
    from jaxinfer.llm import LLM

    with pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler: .*no-such-compiler"):
        LLM(stories_dir, attn_impl="cpu_kernel", compilation_cache=False)
    monkeypatch.setattr(cpu_decode_kernel, "_failure", [])
    cxx = no_compiler / "failing-cxx"
    cxx.write_text(
        '#!/bin/sh\nfor last; do :; done\necho half > "$last"\n'
        'echo "error: no AVX here" >&2\nexit 1\n'
    )
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    with pytest.raises(RuntimeError, match="(?s)building cpu_decode_kernel.cc failed .*no AVX"):
        LLM(stories_dir, attn_impl="cpu_kernel", compilation_cache=False)
    assert [f.name for f in (no_compiler / "cpu_kernels").iterdir()] == [".build.lock"]


def test_cli_explicit_kernel_that_cannot_build_is_one_line(
    no_compiler, stories_dir, tmp_path, monkeypatch, capsys
):
    """`jaxinfer generate --attn-impl cpu_kernel` without a compiler: one error line naming the
    flag and the cause, exit 2 (was a traceback); a compiler given with arguments (CXX="ccache
    g++") is run with them (was "not found": the whole string was looked up)."""
    from jaxinfer.cli import main as cli

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Once upon a time"}\n')
    argv = [
        "generate",
        "--model",
        str(stories_dir),
        "--prompts",
        str(prompts),
        "--out",
        str(tmp_path / "o.jsonl"),
        "--attn-impl",
        "cpu_kernel",
        "--no-progress",
    ]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxinfer: error: --attn-impl cpu_kernel: "), err
    assert "needs a C++ compiler" in err[0] and "no-such-compiler" in err[0]
    cxx = tmp_path / "stand-in-cxx"  # writes its output file (the last argument), exits 0
    cxx.write_text(
        '#!/bin/sh\n[ "$1" = "--wrapped" ] || exit 3\nfor last; do :; done\necho lib > "$last"\n'
    )
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", f"{cxx} --wrapped")
    assert cpu_decode_kernel.build(tmp_path / "c").read_text() == "lib\n"


def test_engines_the_kernel_cannot_serve_refuse_it(stories_dir):
    """No silent fallback: an int8, bfloat16 or head-major pool is refused, naming what runs."""
    from jaxinfer.llm import LLM

    for kw, why in (
        (dict(kv_cache_dtype="int8"), r"not a KV pool of int8 \(kv_cache_dtype='int8'\)"),
        (dict(dtype="bfloat16"), r"not a KV pool of bfloat16 \(dtype='bfloat16'\)"),
        (dict(kv_page_major=False), r"not kv_page_major=False"),
    ):
        with pytest.raises(
            ValueError,
            match=f"page-major float32 KV pool on one device, {why}; use attn_impl='xla'",
        ):
            LLM(stories_dir, attn_impl="cpu_kernel", compilation_cache=False, **kw)
    rng = np.random.default_rng(0)
    k_pages, v_pages, md, _, t = make_batch(rng, 4, 2, 8, [(5, 1), (3, 2)], num_pages=8)
    with pytest.raises(ValueError, match="this one is head-major: use attn_impl='xla'"):
        ragged_paged_attention_xla(
            jnp.ones((t, 2, 8)), k_pages, v_pages, md, jnp.int32(0), scale=1.0, decode_kernel=True
        )
    with pytest.raises(ValueError, match="'cpu_kernel' is a native kernel for XLA's CPU backend"):
        attn_dispatch.resolve_attn_impl("cpu_kernel", "tpu")
