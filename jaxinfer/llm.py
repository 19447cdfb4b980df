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

from jaxinfer.args import EngineArgs, check_keywords, describe, llm_signature
from jaxinfer.engine.config import resolve
from jaxinfer.engine.core import EngineCore
from jaxinfer.engine.inputs import (  # noqa: F401 - encode_prompt re-exported: LLM's module
    PromptLike,
    Request,
    conversation_list,
    encode_prompt,
    prompt_list,
)
from jaxinfer.engine.loop import EngineLoop
from jaxinfer.engine.resume import ResumeState
from jaxinfer.engine.runner import ModelRunner
from jaxinfer.errors import RequestError, TokenizerError
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
    """A loaded model with its engine: ``LLM(model, **options)``.

        Args:
            model: a Hugging Face model directory, a llama2.c checkpoint (file or directory), see
                ``jaxinfer.load``.
            **options: keyword arguments, the options of ``jaxinfer.args.EngineArgs`` (listed under
                "Options" below with their defaults; ``inspect.signature(LLM)`` gives them too).
                ``engine.attn_impl`` says which attention implementation runs, ``attn_impl_reason``
                why; ``self.args`` holds the ``EngineArgs``.

        Raises:
            TypeError: a keyword that is not an option (the message names the close matches).
            ValueError: an option of the wrong type or out of range, or options that do not go
                together, checked before loading (``EngineArgs``); then, once the model's config is
                known, options this backend and model cannot run (``engine.config.resolve``): the KV
                pool and the buffers of ``max_num_seqs`` rows need more memory than is free (the
                message gives both in bytes), the KV pool cannot hold one sequence of
                ``max_model_len`` tokens, ``max_model_len`` beyond the model's context, ...
            CheckpointError / TokenizerError: the model cannot be loaded (message names the file):
                a damaged or inconsistent checkpoint, or weights beyond free memory.
            ShardingError: the model cannot be split over ``tensor_parallel_size`` devices, or there
                are fewer than tensor x data parallel devices (the message names the numbers).

        Options:
    {options}
    """

    def __init__(self, model: str | os.PathLike, **options):
        check_keywords(options, "LLM")
        self._start(EngineArgs(model, **options))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        """The ``LLM`` of ``args`` (errors name the options as ``args.origin`` says: flags for
        ``EngineArgs.from_cli_args``). Raises as ``LLM``."""
        llm = cls.__new__(cls)
        llm._start(args)
        return llm

    def _start(self, args: EngineArgs) -> None:
        from jaxinfer.loaders import load
        from jaxinfer.models.sharding import (
            ShardedPlacer,
            initialize_multihost,
            replica_meshes,
            replica_view,
        )

        self.args = args
        initialize_multihost(args.multihost)
        if args.compilation_cache:
            enable_compilation_cache()
        chat_template = args.read_chat_template()
        placer = ShardedPlacer(
            args.tensor_parallel_size,
            args.data_parallel_size,
            enable_expert_parallel=args.enable_expert_parallel,
        )
        loaded = load(
            args.model,
            dtype=args.dtype,
            tokenizer=args.tokenizer,
            place=placer,
            skip_tokenizer_init=args.skip_tokenizer_init,
        )
        self.model_path = str(args.model)
        self.config, self.params, self.tokenizer = loaded.config, loaded.params, loaded.tokenizer
        if chat_template is not None and self.tokenizer is not None:
            self.tokenizer.chat_template = chat_template
        self.mesh, self.sharding_plan = placer.mesh, placer.plan
        run_cfg = placer.plan.cfg  # the config with replicated KV heads / padded MLP width
        # Every default applied and every check done, the KV pool's memory included.
        ecfg = resolve(args, run_cfg, self.params.embed.dtype, mesh=self.mesh, tp=placer.plan.tp)
        if args.quantization not in (None, "none"):
            from jaxinfer.quant.tensor import apply_quantization

            self.params = apply_quantization(self.params, args.quantization)
        # Without a tokenizer the engine gets a stand-in holding the config's special ids.
        self._engine_tokenizer = self.tokenizer or IdsOnlyTokenizer(self.config, loaded.path)
        if self.tokenizer is None:
            _warn_no_tokenizer(args.model, self._engine_tokenizer.eos_ids, args.skip_tokenizer_init)
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
        if args.speculative is not None:
            from jaxinfer.speculative.strategy import make_spec_engine

            self.engines = [
                make_spec_engine(
                    e,
                    args.speculative,
                    args.num_speculative_tokens,
                    args.draft_model,
                    args.draft_heads,
                )
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
            TypeError: ``prompts`` or one of them is of no accepted type (``inputs.prompt_list``:
                a string, a list of token ids, a dict, or a list of these); ``sampling_params``
                neither a ``SamplingParams`` nor a list.
            ValueError: ``sampling_params``, ``request_ids`` or ``resume`` do not match the
                prompts in length; a dict prompt with none of ``"prompt"``,
                ``"prompt_token_ids"``, ``"messages"``.
        """
        prompts = prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, list | tuple):
            raise TypeError(
                "sampling_params must be a SamplingParams or a list of them, not "
                f"{type(sampling_params).__name__}"
            )
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
        index order (``jaxinfer.engine.parallel_sampling``). A request that cannot run (too
        long, ids outside the vocabulary, ...) gets an output with ``error`` set.

        Raises:
            TypeError, ValueError: as ``generate_stream`` (prompts of no accepted shape), before
                any request is added: the LLM stays usable.
        """
        prompts = prompt_list(prompts)
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
        list of conversations, through the chat template (``chat_template``'s, else the
        tokenizer's).

        Raises TypeError / ValueError when ``messages`` is not of these shapes
        (``inputs.conversation_list``), RequestError when the model runs without a tokenizer,
        TokenizerError when its tokenizer has no chat template."""
        convs = conversation_list(messages)
        if self.tokenizer is None:
            raise RequestError(no_tokenizer_message(self.model_path, "chat()"))
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise TokenizerError(
                f"the tokenizer of {self.model_path} has no chat template; give one with "
                "LLM(..., chat_template=FILE) (examples/chat_template.jinja suits story models "
                "such as stories260K), or use generate() with plain prompts"
            )
        return self.generate([{"messages": c} for c in convs], sampling_params, use_tqdm=use_tqdm)


LLM.__doc__ = LLM.__doc__.replace("{options}", describe(indent=8))
LLM.__init__.__signature__ = llm_signature()


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
        stacklevel=4,  # the caller of LLM() or LLM.from_engine_args()
    )
