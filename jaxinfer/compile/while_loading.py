"""Compiling a generate job's first step while its weights load (issue 21's cold start).

A cold ``jaxinfer generate`` first loads the weights (file reads, layout transforms: seconds for
a ~110M model) and only then compiles its first step's forward function and sampling variant
(seconds more), one after the other. Neither needs the other: a compile needs only the shapes and
dtypes of its arguments. ``FirstStepCompile.start``, called before the model loads, starts a
thread that reads the checkpoint's config and tokenizer (not its weights), encodes the
first prompts, predicts the first step's compile keys (``jaxinfer.compile.plan``'s host step loop
over the engine's own scheduler and buckets, for one step) and compiles them from abstract
arguments: ``jax.ShapeDtypeStruct`` params of the checkpoint's ``param_shapes`` put through the
engine's layout transforms under ``jax.eval_shape`` (``params.unstack_layers``,
``params.out_in_projections``), the KV pool of ``init_kv_cache`` likewise, lowered and compiled
by ``bucket_reuse.BackgroundCompiler``'s compile function (``jit(...).lower(...).compile()``,
which fills jax's in-memory caches). Meanwhile the main thread loads the model as usual.

Before the first step, ``FirstStepCompile.adopt`` checks the prediction against the loaded engine
(model config, ``EngineConfig``, the first step's keys from the real prompt ids, and the params'
and KV pool's shapes, dtypes, weak types and placement: uncommitted one-device arrays lower as
shape structs without a sharding do) and, when all agree, hands the compile's future to the
engine's background compiler as a key compiled ahead (``BackgroundCompiler._ahead``): the first
dispatch waits for it (``wait_for``) instead of compiling a second time, then finds the
executables in jax's caches. When anything differs the compile is not used (``reason`` says why;
the engine compiles as without this) and outputs are the same either way: only where the
compile runs changes.

Off by default: environment variable ``JAXINFER_COMPILE_WHILE_LOADING=1`` turns it on (see
"Measured" below for why). Skipped, with ``reason`` set and no thread (the derivation would be a
guess there, and this is an optimisation, not a mode): the variable unset or "0";
quantization (``--quantization`` or a quantized checkpoint), tensor or data parallelism or more
than one device, speculative decoding, an ``attn_impl`` resolving to a Pallas kernel, several
hosts ("auto", "xla" and "cpu_kernel" compile with the implementation the engine will resolve,
``paged_attention.engine_attn_impl``, which builds the CPU kernel on the thread). Also unused
(``adopt`` returns False) for ``n > 1`` or prompt-logprob requests in the first step, resumed
requests whose first step differs, and any mismatch above.

The thread is not a daemon: the interpreter waits for it at exit (a process that ended while a
daemon thread compiled aborted with "terminate called ...", status 134).

Measured (2-core Xeon shared with other jobs, load 4-9; tests/test_compile_while_loading.py checks
correctness, not speed): no reliable gain, so it is off by default. First token of a 64-prompt
~110M job (first step only, in-process, alternated pairs): with the load's layout transforms as
eager jax ops, 3 of 6 pairs 0.8-3.2 s sooner and 3 pairs 1.8-2.1 s later (load 3.6-4.6); with
them in numpy (``host_layout``, now the default), 15.7 / 14.7, 15.9 / 13.4, 15.1 / 15.3,
17.1 / 16.0 s with / without (load 7.9-9.9); the README demo (``scripts/profile_compile.py --job
demo``, eager layout, 4 pairs) 15.1 / 9.5, 14.6 / 12.1, 9.0 / 10.8, 9.9 / 9.6 s. Why: XLA CPU
compiles in one process largely serialize (a 0.05 s compile issued 1.8 s into a 3 s compile on
another thread took 1.0 s, ending with it), the load still compiles (4 small computations: the
KV pool's and the engine's zeros), the background thread's tracing shares the GIL with the load,
and on a busy machine there is no idle core to overlap on. What it can hide at best is the load's
compile-free part (file reads, ~1-2 s for 110M against a 4-6 s first-step compile).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp

THREAD_NAME = "jaxinfer-compile-while-loading"

ENV = "JAXINFER_COMPILE_WHILE_LOADING"
"""Environment variable: "1" compiles the first step while the weights load, "0" (the default)
not; see the module docstring's "Measured"."""


def enabled() -> bool:
    """Whether ``JAXINFER_COMPILE_WHILE_LOADING`` is on: "1" (on), "0" or unset (off).
    Raises ValueError for another value."""
    v = os.environ.get(ENV, "0")
    if v not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {v!r}")
    return v == "1"


def llm_arguments(kwargs: dict) -> dict:
    """``kwargs`` (``LLM``'s keyword arguments, the model path apart) completed with ``LLM``'s
    defaults. Raises TypeError for a name ``LLM`` does not take."""
    from jaxinfer.args import check_keywords, option_fields

    check_keywords(kwargs, "LLM")
    return {f.name: kwargs.get(f.name, f.default) for f in option_fields() if f.name != "model"}


def unsupported(kwargs: dict) -> str | None:
    """Why the first step's shapes cannot be derived before loading for ``LLM`` arguments
    ``kwargs`` (complete, ``llm_arguments``), or None when they can (module docstring)."""
    from jaxinfer.models.paged_attention import XLA_IMPLS, resolve_attn_impl

    if kwargs["quantization"] not in (None, "none"):
        return f"quantization={kwargs['quantization']!r} (weights transformed after loading)"
    if kwargs["speculative"] is not None:
        return f"speculative={kwargs['speculative']!r} (a draft model's steps)"
    if (kwargs["tensor_parallel_size"] or 1) != 1 or (kwargs["data_parallel_size"] or 1) != 1:
        return "tensor or data parallelism (sharded params and KV pool)"
    if jax.device_count() != 1 or jax.process_count() != 1:
        return f"{jax.device_count()} devices over {jax.process_count()} process(es)"
    try:
        impl = resolve_attn_impl(kwargs["attn_impl"])
    except ValueError as e:
        return f"attn_impl: {e}"
    if impl not in XLA_IMPLS:
        return f"attn_impl={kwargs['attn_impl']!r} resolves to {impl!r} (only the XLA attention)"
    return None


def read_model_config(model: str | os.PathLike, tokenizer: str | None, skip_tokenizer: bool):
    """(ModelConfig, tokenizer) of a checkpoint without reading its weights: a llama2.c header
    or a Hugging Face ``config.json``, and the tokenizer ``jaxinfer.load`` would find
    (``IdsOnlyTokenizer`` when there is none). Returns (None, why) for a quantized checkpoint.
    Raises what the loaders raise for a bad checkpoint (the main thread's load reports it)."""
    from jaxinfer.loaders import _load_tokenizer
    from jaxinfer.loaders.detect import detect_format
    from jaxinfer.tokenizers.ids_only import IdsOnlyTokenizer

    fmt, ckpt = detect_format(model)
    if fmt == "hf":
        from jaxinfer.loaders.hf_config import config_from_hf

        cfg_file = Path(ckpt) / "config.json"
        cfg = config_from_hf(json.loads(cfg_file.read_text()), cfg_file)
        tok_dir = Path(ckpt)
    elif fmt == "llama2c":
        from jaxinfer.loaders.llama2c import check_file_size, config_from_header, read_header

        header = read_header(ckpt)
        check_file_size(ckpt, header)
        cfg = config_from_header(header)
        tok_dir = Path(ckpt).parent
    else:
        return None, f"a {fmt} checkpoint"
    tok = None if skip_tokenizer else _load_tokenizer(tokenizer, tok_dir, cfg)
    return cfg, tok or IdsOnlyTokenizer(cfg, Path(model))


def abstract_params(cfg, dtype, ecfg):
    """The engine's params as ``jax.ShapeDtypeStruct`` leaves: ``param_shapes(cfg)`` in weight
    dtype ``dtype`` (what the llama2.c and Hugging Face loaders return), put through the layout
    transforms ``Engine.__init__`` applies on one device (``unroll_layers`` / ``out_in_weights``
    of ``ecfg``, default on CPU) under ``jax.eval_shape``."""
    from jaxinfer.engine.config import scan_from_tokens
    from jaxinfer.models.params import (
        out_in_projections,
        param_shapes,
        params_from_flat,
        unstack_layers,
    )

    flat = {k: jax.ShapeDtypeStruct(s, dtype) for k, s in param_shapes(cfg).items()}
    cpu = jax.default_backend() == "cpu"

    def layout(params):
        if ecfg.unroll_layers if ecfg.unroll_layers is not None else cpu:
            params = unstack_layers(params, scan_from_tokens(ecfg))
        if ecfg.out_in_weights if ecfg.out_in_weights is not None else cpu:
            params = out_in_projections(params)
        return params

    return jax.eval_shape(layout, params_from_flat(flat))


def abstract_kv(cfg, ecfg, kv_dtype):
    """The engine's one-device KV pool (``init_kv_cache``, page-major as ``Engine.__init__``
    chooses for the XLA attention on CPU) as ``jax.ShapeDtypeStruct`` leaves."""
    from jaxinfer.models.kv_cache import init_kv_cache

    page_major = ecfg.kv_page_major
    if page_major is None:
        page_major = jax.default_backend() == "cpu"  # XLA attention, one device (``unsupported``)
    return jax.eval_shape(
        lambda: init_kv_cache(cfg, ecfg.num_pages, ecfg.page_size, kv_dtype, page_major)
    )


def first_step_keys(ecfg, vocab_size: int, prompt_ids, params, output_so_far=None) -> list[tuple]:
    """The compile keys (``Engine.compile_keys``'s) the engine's first step counts for these
    requests: ``job_plan``'s host step loop (the engine's scheduler, buckets and sampling
    variants over stub device functions) run until it dispatches one step."""
    from jaxinfer.compile.plan import _PlanEngine

    banned = {t for p in params for t in p.stop_token_ids}
    token = next(t for t in range(vocab_size) if t not in banned)
    eng = _PlanEngine(ecfg, vocab_size, token)
    done = list(output_so_far) if output_so_far is not None else [0] * len(params)
    for i, (ids, p) in enumerate(zip(prompt_ids, params, strict=True)):
        eng.add_request(
            str(i), list(ids), dataclasses.replace(p, stop=(), ignore_eos=True), resume=None
        )
        eng._requests[str(i)].seq.output_ids.extend([token] * done[i])
    while eng.has_unfinished() and getattr(eng, "num_dispatched", 0) == 0:
        eng._run_step()
    return [k for k in eng.compile_keys.order if eng.first_step[k] == 0]


def _abstract_of(tree) -> list:
    """(treedef, per leaf (shape, dtype, weak_type, committed)) of params or a KV pool."""
    leaves, treedef = jax.tree.flatten(tree)
    return [
        treedef,
        [
            (
                tuple(x.shape),
                jnp.dtype(x.dtype),
                bool(getattr(x, "weak_type", False)),
                bool(getattr(x, "committed", False)),
            )
            for x in leaves
        ],
    ]


def start_for_jobs(args, jobs) -> FirstStepCompile:
    """``FirstStepCompile.start`` for ``jaxinfer generate``: the model and engine flags of
    ``args`` (``EngineArgs.add_cli_args``'s), the prompts and sampling dicts of ``jobs``
    (``jobs.Job``, in the order they run)."""
    from jaxinfer.args import option_fields

    kwargs = {f.name: getattr(args, f.name) for f in option_fields()[1:] if hasattr(args, f.name)}
    return FirstStepCompile.start(
        args.model, kwargs, [j.prompt for j in jobs], [j.sampling for j in jobs]
    )


class FirstStepCompile:
    """The first step's compile, started before the model loads (module docstring).

    Attributes:
        reason: why the compile is not (or will not be) used, None while it may be.
        keys: the first step's predicted compile keys (``Engine.compile_keys``'s), once planned.
        used: whether ``adopt`` handed the compile to the engine.
        seconds: wall seconds of the background work (config to compiled), once done.
    """

    def __init__(self, reason: str | None = None):
        self.reason = reason
        self.keys: list[tuple] = []
        self.used = False
        self.seconds: float | None = None
        self.future: Future = Future()  # the compile; result None
        self._planned = threading.Event()  # keys and abstract shapes known (or reason set)
        self._mine: dict[str, Any] = {}
        if reason is not None:
            self.future.set_result(None)
            self._planned.set()

    @classmethod
    def start(
        cls, model: str | os.PathLike, llm_kwargs: dict, prompts, sampling
    ) -> FirstStepCompile:
        """Starts the background compile for a job of ``prompts`` (``LLM.encode_prompt``'s
        forms) with ``sampling`` (``SamplingParams`` or their dicts, one per prompt) on ``LLM(model,
        **llm_kwargs)``. Never raises for the job's sake: a bad argument or checkpoint gives an
        object whose ``reason`` says so (the load then reports the error itself)."""
        try:
            if not enabled():
                return cls(f"{ENV}=0")
            kwargs = llm_arguments(llm_kwargs)
        except (ValueError, TypeError) as e:
            return cls(str(e))
        why = unsupported(kwargs)
        if why is not None:
            return cls(why)
        self = cls()
        # Not a daemon: the interpreter waits for it at exit (a process that ends while XLA
        # compiles on a daemon thread aborts, "terminate called ...", status 134).
        threading.Thread(
            target=self._run,
            args=(model, kwargs, list(prompts), list(sampling)),
            daemon=False,
            name=THREAD_NAME,
        ).start()
        return self

    def _run(self, model, kwargs: dict, prompts: list, sampling: list) -> None:
        t0 = time.perf_counter()
        try:
            fn = self._plan(model, kwargs, prompts, sampling)
        except Exception as e:  # noqa: BLE001 - an optimisation: the load reports real errors
            fn, self.reason = None, f"could not plan the first step: {type(e).__name__}: {e}"
        finally:
            self._planned.set()
        try:
            if fn is not None:
                fn()
            self.future.set_result(None)
        except Exception as e:  # noqa: BLE001 - the dispatch then compiles inline
            self.reason = f"compile failed: {type(e).__name__}: {e}"
            self.future.set_exception(e)
        self.seconds = time.perf_counter() - t0

    def _plan(self, model, kwargs: dict, prompts: list, sampling: list):
        """Config, tokenizer, the first prompts' ids, ``EngineConfig``, the first step's keys
        and the abstract arguments; returns the compile function (None when skipped)."""
        from jaxinfer.args import EngineArgs
        from jaxinfer.compile.buckets import BackgroundCompiler
        from jaxinfer.engine.batch import decode_bucket, next_pow2
        from jaxinfer.engine.config import kv_cache_dtype, resolve
        from jaxinfer.engine.step import jitted_forward_step, jitted_sample_step
        from jaxinfer.llm import encode_prompt
        from jaxinfer.loaders import _resolve_dtype
        from jaxinfer.models.sharding import plan_sharding
        from jaxinfer.sampling.sampler import SamplingParams

        cfg, tok = read_model_config(model, kwargs["tokenizer"], kwargs["skip_tokenizer_init"])
        if cfg is None:
            self.reason = tok
            return None
        run_cfg = plan_sharding(cfg, 1).cfg
        dtype = _resolve_dtype(kwargs["dtype"])
        ecfg = resolve(EngineArgs(model, **kwargs), run_cfg, dtype)
        aparams = abstract_params(run_cfg, dtype, ecfg)
        akv = abstract_kv(run_cfg, ecfg, kv_cache_dtype(ecfg))
        from jaxinfer.memory_limits import shortfall

        if shortfall(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(akv))) is not None:
            # The engine refuses such a pool; planning its first step would not end well either
            # (job_plan's page allocator holds a list of every page: ~24 GB for 10^9 pages).
            self.reason = "KV pool beyond memory"
            return None
        ids, params = [], []
        for prompt, p in zip(prompts, sampling, strict=True):  # the first step's candidates
            if len(ids) >= ecfg.max_num_seqs:
                break
            try:
                x = encode_prompt(tok, prompt)[0]
                p = p if isinstance(p, SamplingParams) else SamplingParams.from_dict(p)
            except Exception:  # noqa: BLE001 - the job records this prompt's error
                continue
            if 1 <= len(x) < ecfg.max_model_len and all(0 <= t < cfg.vocab_size for t in x):
                ids.append(x)
                params.append(p)
        if not ids:
            self.reason = "no valid prompt"
            return None
        if any(p.n != 1 or p.prompt_logprobs is not None for p in params):
            self.reason = "n > 1 or prompt logprobs"
            return None
        keys = first_step_keys(ecfg, cfg.vocab_size, ids, params)
        fwd = [k[1] for k in keys if k[0] == "forward"]
        flags = [tuple(k[2:]) for k in keys if k[0] == "sample"]
        if len(fwd) != 1 or len(keys) != 1 + len(flags):
            self.reason = f"first step keys {keys} (one forward key and its sampling expected)"
            return None
        num_slots = next_pow2(decode_bucket(ecfg.max_num_seqs) + next_pow2(ecfg.max_prefill_seqs))
        stand_in = SimpleNamespace(  # what BackgroundCompiler's compile function reads
            cfg=run_cfg,
            ecfg=ecfg,
            params=aparams,
            kv=akv,
            _forward=jitted_forward_step(),
            _sample=jitted_sample_step(),
            _num_slots=num_slots,
            num_steps=0,
            _no_prev=jax.ShapeDtypeStruct((num_slots,), jnp.int32),
        )
        self.keys = keys
        self._mine = dict(
            cfg=run_cfg,
            ecfg=ecfg,
            num_slots=num_slots,
            params=_abstract_of(aparams),
            kv=_abstract_of(akv),
            forward=fwd[0],
        )
        return BackgroundCompiler(stand_in)._compile_fn(fwd[0], flags or [(False, 0)])

    def adopt(self, llm, prompt_ids, params, resume=None) -> bool:
        """Hands the compile to ``llm``'s engine when the prediction holds for this run's
        requests (``prompt_ids``: each request's token ids, ``params``: its ``SamplingParams``,
        ``resume``: its ``ResumeState`` or None, as passed to ``generate_stream``); call it
        before the first step. Returns whether it did; otherwise ``reason`` says why. Waits for
        the background planning (config and tokenizer reads, well under a second), not for the
        compile."""
        if self.reason is None:
            self._planned.wait()
        try:
            if self.reason is None and llm.engines[0].compile_keys:
                self.reason = "the engine has run steps already"
            if self.reason is None:
                self.reason = self._mismatch(llm, prompt_ids, params, resume)
        except Exception as e:  # noqa: BLE001 - an optimisation: the job goes on without it
            self.reason = f"could not check the prediction: {type(e).__name__}: {e}"
        if self.reason is not None:
            return False
        compiler = llm.engines[0]._compiler
        with compiler._lock:  # a key compiled ahead: the first dispatch waits, not compiles
            compiler._ahead.setdefault(self._mine["forward"], self.future)
        self.used = True
        return True

    def _mismatch(self, llm, prompt_ids, params, resume=None) -> str | None:
        """Why the prediction does not hold for ``llm``'s engine and these requests, or None."""
        engines = list(getattr(llm, "engines", []) or [])
        if len(engines) != 1 or getattr(engines[0], "_compiler", None) is None:
            return "not one one-device engine"
        e, mine = engines[0], self._mine
        if hasattr(e, "spec") or e.mesh is not None:
            return "a speculative or sharded engine"
        for name, real in (
            ("cfg", e.cfg),
            ("ecfg", e.ecfg),
            ("num_slots", e._num_slots),
            ("params", _abstract_of(e.params)),
            ("kv", _abstract_of(e.kv)),
        ):
            if mine[name] != real:
                return f"the loaded engine's {name} differs from the one derived before loading"
        if any(p.n != 1 or p.prompt_logprobs is not None for p in params):
            return "n > 1 or prompt logprobs"
        done = [
            len(getattr(r, "token_ids", ()) or ()) if r is not None else 0
            for r in (resume or [None] * len(prompt_ids))
        ]
        keys = first_step_keys(e.ecfg, e.cfg.vocab_size, prompt_ids, params, done)
        if keys != self.keys:
            return f"the first step's keys are {keys}, not the predicted {self.keys}"
        return None
