"""``LLM``: the Python API (pleasant in a notebook), in the shape of vLLM's ``LLM`` class.

llm = LLM("../shared/models/stories260K")
outs = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32))
print(outs[0].text)
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import jax

from jaxinfer.engine.core import EngineConfig, EngineCore, default_num_pages, default_page_size
from jaxinfer.engine.core import kv_cache_dtype as resolve_kv_dtype
from jaxinfer.engine.inputs import (  # noqa: F401 - encode_prompt re-exported: LLM's module
    PromptLike,
    Request,
    encode_prompt,
)
from jaxinfer.engine.loop import EngineLoop
from jaxinfer.engine.resume import ResumeState
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.errors import RequestError, TokenizerError
from jaxinfer.llm_args import check_kv_pool, check_llm_args
from jaxinfer.outputs import RequestOutput
from jaxinfer.sampling.sampler import SamplingParams
from jaxinfer.tokenizers.ids_only import IdsOnlyTokenizer, NoTokenizerWarning, no_tokenizer_message


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str | None:
    """Turns on JAX's persistent compilation cache (default ``~/.cache/jaxinfer/xla``, or
    ``$JAXINFER_CACHE_DIR``); ``JAXINFER_COMPILATION_CACHE=0`` disables it. Returns the path."""
    if os.environ.get("JAXINFER_COMPILATION_CACHE", "1") == "0":
        return None
    if path is None:
        base = os.environ.get("JAXINFER_CACHE_DIR") or Path.home() / ".cache" / "jaxinfer"
        path = Path(base) / "xla"
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return str(path)


class LLM:
    """A loaded model with its engine.

    Args:
        model: a Hugging Face model directory, a llama2.c checkpoint (file or directory), see
            ``jaxinfer.load``.
        dtype: "float32" (default; the fast dtype on CPU, where bfloat16 matmuls convert weights
            every step) or "bfloat16" (the usual choice on TPU/GPU).
        max_model_len: longest prompt + output in tokens (default: the model's context length).
        kv_pages: pages in the KV pool (default: every row at full length, capped by
            ``kv_cache_memory_gb``).
        page_size: Z, tokens per KV page (default: ``engine.default_page_size``, 8 on CPU with
            the XLA attention, 16 elsewhere).
        max_num_seqs: most sequences decoded together.
        max_num_batched_tokens: token budget per step (default max(512, max_num_seqs)).
        attn_impl: attention implementation, see ``paged_attention.ATTN_IMPLS`` ("auto", "xla",
            "pallas", "pallas_tpu_interpret", "cpu_kernel": XLA with the native CPU decode kernel
            of ``jaxinfer.models.cpu_decode_kernel``, what "auto" runs on CPU where the pool allows,
            ``paged_attention.engine_attn_impl``; ``engine.attn_impl`` says which ran, ...).
        kv_cache_memory_gb: memory budget of the default pool, GiB.
        tokenizer: tokenizer path overriding the one found beside the model.
        seed: seeds the draws of per-request seeds for requests without one.
        tensor_parallel_size: devices each model copy is split over (heads, MLP width,
            vocabulary; see ``jaxinfer.models.sharding``). Default: all devices when the weights do
            not
            fit one device's memory, else 1.
        data_parallel_size: engine replicas (each over its own ``tensor_parallel_size`` devices);
            ``generate`` splits the prompts between them and merges the outputs in order.
            Default 1.
        speculative: speculative decoding drafter, "draft-model", "ngram" or "heads" (None: off);
            see ``jaxinfer.speculative``.
        num_speculative_tokens: R, draft tokens per round.
        draft_model: the draft model of "draft-model": a checkpoint path with the target's
            tokenizer, "self" or "layers:N" (the target's first N layers).
        draft_heads: directory of Medusa heads for "heads" (``jaxinfer train-draft-heads``).
        unroll_layers: layers as an unrolled loop over per-layer weights (faster decode, longer
            compiles) or ``lax.scan`` over stacked ones; None = unrolled on CPU only.
        async_scheduling: dispatch each step before the previous one's tokens are read back, so
            host work overlaps the device (same outputs up to float near-ties, see
            ``batch_invariant``); None = on, except with ``speculative``
            (its rounds run synchronously; True with it raises ValueError). See ``EngineConfig``.
        skip_tokenizer_init: load no tokenizer, as vLLM's option: prompts are token ids (a list,
            or {"prompt_token_ids": [...]}), outputs have ``token_ids`` and ``text`` None, and a
            request that needs text (a str prompt, "prompt", "messages", ``stop`` strings) fails
            alone with a RequestError. EOS comes from the checkpoint's config
            (``tokenizers.ids_only.config_special_ids``). A model with no tokenizer beside it
            (and no ``tokenizer``) runs this way too, with a ``NoTokenizerWarning``; then
            ``self.tokenizer`` is None.
        batch_invariant: every request's logits (hence its greedy or seeded tokens and its
            logprobs) bitwise the same whatever else is in the batch: batch size and
            composition, prefill chunking, async scheduling, preemption
            (``jaxinfer.models.batch_invariant``; slower, see the README). Not with ``speculative``,
            a Pallas ``attn_impl``, or tensor/data parallel (ValueError).
        enable_prefix_caching: reuse the KV pages of prompt prefixes (full pages) that earlier
            requests computed (``jaxinfer.engine.prefix_cache``); outputs are the same with it off.
            Each output's ``metrics.num_cached_tokens`` counts its prompt tokens read from the
            cache; ``LLM.prefix_cache_stats()`` gives the hit rate and evictions.
        reuse_compiled_buckets: run a step of a shape not compiled yet padded to a compiled one
            at most one bucket larger (``jaxinfer.compile.buckets``): fewer compilations.

    Raises:
        CheckpointError / TokenizerError: the model cannot be loaded (message names the file):
            a damaged or inconsistent checkpoint, or weights beyond free memory.
        ValueError: an argument of the wrong type or out of range, checked before loading
            (``jaxinfer.llm_args``: unknown strings list what is supported); the KV pool and the
            buffers of ``max_num_seqs`` rows need more memory than is free (the message gives
            both in bytes); the KV pool cannot hold one sequence of ``max_model_len`` tokens.
        ShardingError: the model cannot be split over ``tensor_parallel_size`` devices, or there
            are fewer than tensor x data parallel devices (the message names the numbers).

    Quantization (``jaxinfer.quant``): ``quantization`` None / "none" (weights as loaded),
    "int8" (weight-only int8, w8a16) or "w8a8" (int8 weights and per-token int8 activations);
    a quantized checkpoint (``jaxinfer quantize``) loads int8 without it. ``kv_cache_dtype``
    "auto" (the weights' float dtype) or "int8" (per-token, per-head scales).
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        dtype: str = "float32",
        max_model_len: int | None = None,
        kv_pages: int | None = None,
        page_size: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        attn_impl: str = "auto",
        kv_cache_memory_gb: float = 2.0,
        tokenizer: str | None = None,
        seed: int = 0,
        compilation_cache: bool = True,
        tensor_parallel_size: int | None = None,
        data_parallel_size: int | None = None,
        speculative: str | None = None,
        num_speculative_tokens: int = 4,
        draft_model: str | None = None,
        draft_heads: str | None = None,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        unroll_layers: bool | None = None,
        async_scheduling: bool | None = None,
        skip_tokenizer_init: bool = False,
        batch_invariant: bool = False,
        enable_prefix_caching: bool = True,
        reuse_compiled_buckets: bool = True,
    ):
        check_llm_args(locals())  # first: locals() is the arguments alone
        from jaxinfer.loaders import load
        from jaxinfer.models.sharding import ShardedPlacer, replica_meshes, replica_view

        if speculative is not None and async_scheduling:
            raise ValueError(
                "async_scheduling=True is not supported with speculative decoding "
                "(its rounds run synchronously); leave it None or pass False"
            )
        if compilation_cache:
            enable_compilation_cache()
        placer = ShardedPlacer(tensor_parallel_size, data_parallel_size)
        loaded = load(
            model,
            dtype=dtype,
            tokenizer=tokenizer,
            place=placer,
            skip_tokenizer_init=skip_tokenizer_init,
        )
        self.model_path = str(model)
        self.config, self.params, self.tokenizer = loaded.config, loaded.params, loaded.tokenizer
        if quantization not in (None, "none"):
            from jaxinfer.quant.tensor import apply_quantization

            if placer.mesh is not None:
                raise ValueError("quantization with tensor/data parallel is not supported yet")
            self.params = apply_quantization(self.params, quantization)
        # Without a tokenizer the engine gets a stand-in holding the config's special ids.
        self._engine_tokenizer = self.tokenizer or IdsOnlyTokenizer(self.config, loaded.path)
        if self.tokenizer is None:
            _warn_no_tokenizer(model, self._engine_tokenizer.eos_ids, skip_tokenizer_init)
        if (
            max_model_len is not None
            and not 2 <= max_model_len <= self.config.max_position_embeddings
        ):
            raise ValueError(
                f"max_model_len={max_model_len} must be in "
                f"[2, {self.config.max_position_embeddings}] "
                "(the model's context length, max_position_embeddings)"
            )
        self.mesh, self.sharding_plan = placer.mesh, placer.plan
        run_cfg = placer.plan.cfg  # the config with replicated KV heads / padded MLP width
        ecfg = engine_config(
            run_cfg,
            self.params,
            placer.plan.tp,
            max_model_len=max_model_len,
            page_size=page_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            attn_impl=attn_impl,
            seed=seed,
            kv_cache_dtype=kv_cache_dtype,
            unroll_layers=unroll_layers,
            async_scheduling=async_scheduling,
            batch_invariant=batch_invariant,
            enable_prefix_caching=enable_prefix_caching,
            reuse_compiled_buckets=reuse_compiled_buckets,
            kv_pages=kv_pages,
            kv_cache_memory_gb=kv_cache_memory_gb,
        )
        check_kv_pool(
            run_cfg,
            ecfg,
            resolve_kv_dtype(ecfg, self.params),
            placer.plan.tp,
            None if self.mesh is None else list(self.mesh.devices.flat),
        )
        if self.mesh is None:
            from jaxinfer.models.host_layout import engine_layout_on_host

            # The engine's weight layout built with numpy on CPU: no XLA compiles (host_layout).
            self.params = engine_layout_on_host(self.params, ecfg)
            runners = [ModelRunner(run_cfg, self.params, ecfg)]
        else:
            runners = [
                ModelRunner(run_cfg, replica_view(self.params, m), ecfg, mesh=m)
                for m in replica_meshes(self.mesh)
            ]
        self.engines = [EngineCore(r, self._engine_tokenizer) for r in runners]
        if speculative is not None:
            from jaxinfer.speculative.strategy import make_spec_engine

            self.engines = [
                make_spec_engine(e, speculative, num_speculative_tokens, draft_model, draft_heads)
                for e in self.engines
            ]
        self.engine = self.engines[0]
        # The engines may hold the weights unstacked: drop the stacked copy (with a mesh,
        # ``params`` is then replica 0's).
        self.params = self.engine.params
        self._loop = EngineLoop(self.engines)

    def prefix_cache_stats(self) -> dict:
        """Prefix-cache counters summed over the engines (data-parallel replicas):
        ``queried_tokens`` (tokens looked up at admissions, recomputation included),
        ``hit_tokens`` (of them read from cached pages), ``hit_rate`` (hit / queried, 0.0 when
        nothing was queried), ``evictions`` (cached pages reused for other contents),
        ``cached_pages`` (cached now). All zero with ``enable_prefix_caching=False``."""
        keys = ("queried_tokens", "hit_tokens", "evictions", "cached_pages")
        per = [e.prefix_cache_stats() for e in self.engines]
        out = {k: sum(s[k] for s in per) for k in keys}
        out["hit_rate"] = (
            out["hit_tokens"] / out["queried_tokens"] if out["queried_tokens"] else 0.0
        )
        return out

    @property
    def num_compilations(self) -> int:
        return sum(e.num_compilations for e in self.engines)

    # ---------------------------------------------------------------- prompts

    @property
    def engine_loop(self) -> EngineLoop:
        """The front door of this LLM's engines (``jaxinfer.engine.loop``): ``add``, ``abort``,
        ``step``; the server's engine thread and every ``generate`` call share it."""
        return self._loop

    def encode_prompt(self, prompt: PromptLike) -> tuple[list[int], str | None]:
        """Token ids (and text) of a prompt: a string, a list of token ids, or a dict with
        ``"prompt"``, ``"prompt_token_ids"`` or ``"messages"`` (chat). Raises RequestError (also
        for a text prompt when the model runs without a tokenizer)."""
        return self._loop.encode(prompt)

    # ---------------------------------------------------------------- generation

    def generate_stream(
        self,
        prompts: PromptLike | Iterable[PromptLike],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        request_ids: Sequence[str] | None = None,
        resume: Sequence[ResumeState | None] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yields a ``RequestOutput`` each time a request gets new tokens (``delta_text`` holds the
        new text) and once when it finishes. A request that fails validation yields one output
        with ``error`` set; the others go on. A request with ``SamplingParams.n`` > 1 yields one
        output per new-token output of each completion (its ``outputs`` holds that completion,
        with its ``index``), then one final output with all n
        (``jaxinfer.engine.parallel_sampling``).

        ``resume[i]``, when not None, continues prompt i from a partial output: its seed and
        output tokens so far (``jaxinfer.engine.resume.ResumeState``; for n > 1 a sequence of n,
        one per
        completion; ``EngineCore.add_request`` says what is rebuilt); the result equals an
        uninterrupted run's. A partial output that has already finished, or does not fit the
        request, makes that request's error output.

        Thread-safe: concurrent calls (several threads, or interleaved streams) share one engine
        loop and continuous batch (``jaxinfer.engine.loop``). Closing the iterator before it
        ends aborts its unfinished requests.

        Raises:
            ValueError: ``sampling_params``, ``request_ids`` or ``resume`` do not match the
                prompts in length.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts")
        if request_ids is None:
            n = self._loop.next_id()
            request_ids = [f"{n}-{i}" for i in range(len(prompts))]
        if len(request_ids) != len(prompts):
            raise ValueError(f"{len(request_ids)} request_ids for {len(prompts)} prompts")
        if resume is None:
            resume = [None] * len(prompts)
        if len(resume) != len(prompts):
            raise ValueError(f"{len(resume)} resume states for {len(prompts)} prompts")
        rows = zip(request_ids, prompts, sampling_params, resume, strict=True)
        return self._loop.stream([Request(*row) for row in rows])

    def draw_seeds(self, sampling_params: Sequence[SamplingParams]) -> list[int]:
        """The seeds ``generate_stream`` would give these requests (in this order) if called now:
        each one's own ``seed``, or one drawn from the engine's host RNG (``LLM(seed=...)``),
        which this call advances. Pin them (``ResumeState(seed)``) to keep the draws of requests
        without a seed when a job is resumed (``jaxinfer generate`` does)."""
        return self._loop.draw_seeds(sampling_params)

    def generate(
        self,
        prompts: PromptLike | Iterable[PromptLike],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns the finished outputs in the prompts' order, one
        per prompt: with ``SamplingParams.n`` > 1 its ``outputs`` holds the n completions in
        index order (``jaxinfer.engine.parallel_sampling``)."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        n = self._loop.next_id()
        ids = [f"gen-{n}-{i}" for i in range(len(prompts))]
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc="prompts", unit="req")
        t0, n_tok = time.perf_counter(), 0
        for out in self.generate_stream(prompts, sampling_params, request_ids=ids):
            if out.finished:
                done[out.request_id] = out
                n_tok += sum(len(c.token_ids) for c in out.outputs)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{n_tok / max(time.perf_counter() - t0, 1e-9):.1f}")
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]

    def score(self, pairs: Sequence[tuple[str, str] | tuple[Sequence[int], Sequence[int]]]) -> list:
        """Log-likelihood of each continuation given its context (lm-evaluation-harness's
        ``loglikelihood``), batched through the engine as prompt-logprob requests.

        Args:
            pairs: (context, continuation) pairs, both strings (tokenized as lm-eval's HFLM:
                ``jaxinfer.scoring``) or both lists of token ids (used as given).

        Returns:
            One ``scoring.ScoreResult`` per pair, in order: ``logprob`` (sum over the
            continuation's tokens), ``num_tokens``, ``is_greedy``, ``token_logprobs``, the ids;
            or ``error`` set (a pair whose continuation has zero tokens, an empty context of
            ids, more than ``max_model_len - 1`` tokens in all, ids outside the vocabulary,
            text without a tokenizer, or an engine that refuses ``prompt_logprobs``:
            speculative decoding, ``batch_invariant``); the other pairs are scored.
        """
        from jaxinfer.scoring import score

        return score(self, pairs)

    def perplexity(self, texts: Sequence[str | Sequence[int]], stride: int | None = None) -> list:
        """Rolling log-likelihood of whole texts (lm-eval's ``loglikelihood_rolling``) over
        windows of ``max_model_len - 2`` tokens (``scoring.rolling_windows``: every token scored
        exactly once; ``stride`` = tokens scored per window after the first, None = a full
        window, so later windows see at least ``max_model_len - 1 - stride`` tokens of context).

        Returns:
            One ``scoring.PerplexityResult`` per text: ``logprob`` (total), ``num_tokens``,
            ``perplexity`` = exp(-logprob / num_tokens), ``num_windows``; or ``error`` set (a
            text of zero tokens, text without a tokenizer, a window the engine refused).

        Raises:
            ValueError: ``stride`` not an integer in [1, max_model_len - 2].
        """
        from jaxinfer.scoring import perplexity

        return perplexity(self, texts, stride)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation (a list of {"role", "content"} messages) or to a
        list of conversations, through the tokenizer's chat template.

        Raises RequestError when the model runs without a tokenizer, TokenizerError when its
        tokenizer has no chat template."""
        if self.tokenizer is None:
            raise RequestError(no_tokenizer_message(self.model_path, "chat()"))
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise TokenizerError(
                f"the tokenizer of {self.model_path} has no chat template; use generate() with "
                "plain prompts"
            )
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([{"messages": c} for c in convs], sampling_params, use_tqdm=use_tqdm)


def engine_config(
    run_cfg,
    params,
    tp: int = 1,
    *,
    max_model_len: int | None,
    page_size: int | None,
    max_num_seqs: int,
    max_num_batched_tokens: int | None,
    attn_impl: str,
    seed: int,
    kv_cache_dtype: str,
    unroll_layers: bool | None,
    async_scheduling: bool | None,
    batch_invariant: bool,
    enable_prefix_caching: bool,
    reuse_compiled_buckets: bool,
    kv_pages: int | None,
    kv_cache_memory_gb: float,
) -> EngineConfig:
    """The ``EngineConfig`` ``LLM`` gives its engines for these arguments (``LLM``'s of the same
    names, defaults resolved): ``run_cfg`` the model config the engines run (after sharding's
    changes), ``params`` the weights (real or ``jax.ShapeDtypeStruct`` leaves: only
    ``params.embed.dtype`` is read, for the KV dtype), ``tp`` the devices of one model copy (the
    default pool's memory budget is per device).

    Raises:
        ValueError: ``kv_cache_dtype`` or ``attn_impl`` unknown, a size out of range
            (``EngineConfig``'s checks)."""
    max_model_len = max_model_len or run_cfg.max_position_embeddings
    if page_size is None:
        page_size = default_page_size(attn_impl)
    ecfg = EngineConfig(
        max_model_len=max_model_len,
        page_size=page_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens or max(512, max_num_seqs),
        attn_impl=attn_impl,
        seed=seed,
        kv_cache_dtype=kv_cache_dtype,
        unroll_layers=unroll_layers,
        async_scheduling=async_scheduling,
        batch_invariant=batch_invariant,
        enable_prefix_caching=enable_prefix_caching,
        reuse_compiled_buckets=reuse_compiled_buckets,
    )
    if kv_pages is None:  # the budget is per device; each holds K' / tp heads of the pool
        kv_pages = default_num_pages(
            run_cfg, ecfg, resolve_kv_dtype(ecfg, params), int(kv_cache_memory_gb * 2**30) * tp
        )
    return EngineConfig(**{**ecfg.__dict__, "num_pages": kv_pages})


def _warn_no_tokenizer(model, eos_ids: tuple[int, ...], asked: bool) -> None:
    """Warns that ``model`` runs on token ids only (always when no tokenizer was found; with
    ``skip_tokenizer_init`` only when the config names no EOS id)."""
    if asked and eos_ids:
        return
    stop = (
        f"generation stops at EOS id(s) {list(eos_ids)} from the checkpoint's config"
        if eos_ids
        else "the checkpoint's config names no EOS id, so generation stops only at "
        "max_tokens, max_model_len or stop_token_ids"
    )
    why = (
        "skip_tokenizer_init=True"
        if asked
        else f"no tokenizer found for {model} (looked for tokenizer.json, *.model and a llama2.c "
        "tokenizer .bin beside it; pass tokenizer=PATH for text)"
    )
    warnings.warn(
        f"{why}: running on token ids only, as vLLM's skip_tokenizer_init: prompts must "
        "be token ids (prompt_token_ids), outputs have no text, and requests that need "
        f"text fail alone; {stop}",
        NoTokenizerWarning,
        stacklevel=3,
    )
