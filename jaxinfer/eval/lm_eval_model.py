"""jaxinfer as an lm-evaluation-harness model: ``JaxInferLM``, registered as ``"jaxinfer"``.

``loglikelihood`` goes through ``LLM.score`` (token-id pairs), ``loglikelihood_rolling`` through
``LLM.perplexity`` (its rolling windows, token ids), ``generate_until`` through ``LLM.generate``
(``until`` as stop strings). Every call hands all its requests to the engine at once (its
continuous batch orders and packs them); results come back in request order. The semantics follow
lm-eval 0.4.13's own ``vllm`` model (``lm_eval/models/vllm_causallms.py``) and ``hf`` model
(``huggingface.py``):

- Tokenization is lm-eval's: ``TemplateLM._encode_pair`` (trailing context spaces move to the
  continuation; whole minus context) with ``tok_encode`` adding the tokenizer's special tokens
  (BOS for Llama-style tokenizers) unless ``add_bos_token=False`` or the text already starts with
  the BOS string; an empty context is the prefix token (BOS, else EOS).
- ``loglikelihood``: context + continuation left-truncated to ``max_length - 1`` tokens (the
  engine samples one token after a prompt, as vLLM); ``is_greedy``: every continuation token is
  the argmax of its distribution.
- ``loglikelihood_rolling``: a document's tokens are ``tok_encode(text)`` (so BOS is scored too,
  as both lm-eval backends do); windows of ``max_length - 2`` tokens (vLLM's), every token scored
  once; the value is the document's total logprob. A document of zero tokens is 0.0 (lm-eval:
  a sum over no windows).
- ``generate_until``: lm-eval's ``normalize_gen_kwargs`` (``max_gen_toks`` and aliases,
  ``do_sample``/``temperature``), ``until`` plus the EOS string as stop strings, the context
  left-truncated to leave ``max_gen_toks`` (``maybe_truncate``), the text cut at the first stop
  string afterwards (``postprocess_generated_text``). Other generation kwargs must be
  ``SamplingParams`` fields (``top_p``, ``top_k``, ``min_p``, ``seed``, penalties, ...).

A request the engine refuses (e.g. a continuation longer than ``max_length - 2`` tokens, ids
outside the vocabulary) makes the call raise ``RuntimeError`` naming every failed request, after
the others are done: an evaluation with a missing score would be a wrong number, not a partial one.

lm-eval 0.4.13 discovers models only from its own table or from modules already imported, so
``lm_eval --model jaxinfer`` needs this module imported first: run ``python -m jaxinfer.eval``
(the ``lm_eval`` command line with ``jaxinfer`` registered) or ``import jaxinfer.eval`` before
``lm_eval.simple_evaluate(model="jaxinfer", ...)``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    maybe_truncate,
    normalize_gen_kwargs,
    postprocess_generated_text,
)

from jaxinfer.llm import LLM
from jaxinfer.sampling.sampler import SamplingParams

log = logging.getLogger(__name__)

_LLM_ARGS = frozenset(inspect.signature(LLM.__init__).parameters) - {"self", "model"}
_SAMPLING_ARGS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - {
    "max_tokens",
    "stop",
    "n",
    "logprobs",
    "prompt_logprobs",
}
# lm-eval passes these to every model; they mean nothing to a continuous-batching engine.
_HARNESS_ARGS = ("max_batch_size", "device")


@register_model("jaxinfer")
class JaxInferLM(TemplateLM):
    """lm-evaluation-harness model running on a jaxinfer ``LLM``.

    Args:
        pretrained: a checkpoint path (anything ``LLM`` loads), or an ``LLM`` already built
            (then no engine argument may be given).
        dtype: weight dtype (``LLM``'s; lm-eval's "auto" means the default, float32).
        max_model_len: context length in tokens; ``max_length`` is lm-eval's alias (not both).
        max_gen_toks: default ``max_gen_toks`` of ``generate_until`` (256, as lm-eval's).
        add_bos_token: None (the tokenizer's default: Llama tokenizers add BOS), True or False.
        batch_size: "auto", "auto:N" or an int, checked and otherwise unused: lm-eval passes it (its
            command line defaults to 1), but every call hands all its requests to the engine,
            whose continuous batch holds up to ``max_num_seqs`` sequences.
        **llm_kwargs: other ``LLM`` arguments (``max_num_seqs``, ``attn_impl``, ``kv_pages``,
            ``tensor_parallel_size``, ``quantization``, ``enable_prefix_caching``, ...).

    Raises:
        ValueError: an argument ``LLM`` does not take (naming it and the ones it takes), engine
            arguments given with a built ``LLM``, both ``max_length`` and ``max_model_len``, a
            ``batch_size`` that is not "auto" or a positive int; and whatever ``LLM`` raises for
            a bad value.
    """

    def __init__(
        self,
        pretrained: str | LLM,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        batch_size: str | int = "auto",
        **llm_kwargs,
    ):
        super().__init__()
        for k in _HARNESS_ARGS:
            v = llm_kwargs.pop(k, None)
            if v is not None and k == "device":
                log.info(
                    "device=%r is ignored: jaxinfer runs on JAX's default backend "
                    "(install jaxinfer[tpu] or jaxinfer[cuda] to change it)",
                    v,
                )
        unknown = sorted(set(llm_kwargs) - _LLM_ARGS)
        if unknown:
            raise ValueError(
                f"jaxinfer model_args: unknown argument(s) {unknown}; LLM takes "
                f"{sorted(_LLM_ARGS | {'pretrained', 'max_length', 'max_gen_toks'})}"
            )
        if max_length is not None and max_model_len is not None:
            raise ValueError("jaxinfer model_args: give max_model_len or max_length, not both")
        if max_length is not None:
            max_model_len = max_length
        if not (
            (isinstance(batch_size, str) and batch_size.startswith("auto"))
            or (isinstance(batch_size, int) and batch_size > 0 and not isinstance(batch_size, bool))
        ):
            raise ValueError(
                f"jaxinfer model_args: batch_size must be 'auto', 'auto:N' or a "
                f"positive integer, got {batch_size!r}"
            )
        if not isinstance(max_gen_toks, int) or isinstance(max_gen_toks, bool) or max_gen_toks < 1:
            raise ValueError(
                f"jaxinfer model_args: max_gen_toks must be a positive integer, "
                f"got {max_gen_toks!r}"
            )
        if add_bos_token not in (None, True, False):
            raise ValueError(
                f"jaxinfer model_args: add_bos_token must be true, false or none, "
                f"got {add_bos_token!r}"
            )
        if isinstance(pretrained, LLM):
            given = dict(llm_kwargs, **({"max_model_len": max_model_len} if max_model_len else {}))
            if dtype != "auto":
                given["dtype"] = dtype
            if given:
                raise ValueError(
                    f"jaxinfer: engine arguments {sorted(given)} given with an "
                    "LLM already built; pass them to LLM instead"
                )
            self.llm = pretrained
        else:
            if dtype != "auto":
                llm_kwargs["dtype"] = dtype
            self.llm = LLM(pretrained, max_model_len=max_model_len, **llm_kwargs)
        if self.llm.tokenizer is None:
            raise ValueError(
                f"jaxinfer: {self.llm.model_path} has no tokenizer; lm-eval tasks are text"
            )
        self.tokenizer = self.llm.tokenizer
        self.add_bos_token = add_bos_token
        self._max_gen_toks = max_gen_toks

    # ------------------------------------------------------------------ tokenizer and sizes

    @property
    def eot_token_id(self) -> int:
        if not self.tokenizer.eos_ids:
            raise ValueError(f"{self.llm.model_path}: the tokenizer has no EOS id")
        return self.tokenizer.eos_ids[0]

    @property
    def prefix_token_id(self) -> int:
        """BOS, else EOS (lm-eval's rule): what an empty context and the first rolling window
        condition on."""
        bos = self.tokenizer.bos_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.llm.engine.ecfg.max_model_len

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.path).replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        """lm-eval's ``tok_encode`` (HFLM): the tokenizer's special tokens unless
        ``add_special_tokens``/``add_bos_token`` say otherwise or the text starts with BOS."""
        if not string:
            return []
        if add_special_tokens is None:
            add_special_tokens = True if self.add_bos_token is None else self.add_bos_token
            bos = self.tokenizer.decode([self.prefix_token_id], skip_special_tokens=False)
            if has_bos_prefix(string, bos):
                add_special_tokens = False
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def tok_decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, add_generation_prompt=add_generation_prompt
        )

    # ------------------------------------------------------------------ requests

    @staticmethod
    def _raise_failed(kind: str, failed: list[tuple[int, str]]) -> None:
        if failed:
            shown = "; ".join(f"request {i}: {e}" for i, e in failed[:10])
            more = f" (and {len(failed) - 10} more)" if len(failed) > 10 else ""
            raise RuntimeError(f"jaxinfer {kind}: {len(failed)} request(s) failed: {shown}{more}")

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        """(logprob, is_greedy) of each (cache key, context ids, continuation ids), in order;
        context + continuation left-truncated to ``max_length - 1`` tokens (vLLM's rule)."""
        limit = self.max_length - 1
        pairs = []
        for _, ctx, cont in requests:
            whole = (list(ctx) + list(cont))[-limit:]
            n_ctx = len(whole) - len(cont)
            if len(whole) < len(ctx) + len(cont):
                log.warning(
                    "context + continuation (%d tokens) exceeds max_length - 1 = %d: "
                    "context truncated from the left",
                    len(ctx) + len(cont),
                    limit,
                )
            # No context left (a continuation of max_length - 1 tokens or more): LLM.score
            # refuses the untruncated pair with its length error.
            pairs.append((whole[:n_ctx], whole[n_ctx:]) if n_ctx > 0 else (list(ctx), list(cont)))
        out, failed = [], []
        for i, r in enumerate(self.llm.score(pairs)):
            if r.error is not None:
                failed.append((i, r.error))
            out.append((r.logprob, bool(r.is_greedy)))
        self._raise_failed("loglikelihood", failed)
        for (key, _, _), ans in zip(requests, out, strict=True):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, ans)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Total logprob of each document (``Instance.args == (text,)``) over rolling windows."""
        docs = [self.tok_encode(req.args[0]) for req in requests]
        out: list[float | None] = [0.0 if not d else None for d in docs]
        todo = [i for i, d in enumerate(docs) if d]
        failed = []
        for i, r in zip(todo, self.llm.perplexity([docs[i] for i in todo]), strict=True):
            if r.error is not None:
                failed.append((i, r.error))
            out[i] = r.logprob
        self._raise_failed("loglikelihood_rolling", failed)
        for req, ans in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", tuple(req.args), ans)
        return out

    def _sampling(self, gen_kwargs: dict[str, Any], eos: str) -> tuple[SamplingParams, list[str]]:
        """(SamplingParams, until) of one request's generation kwargs."""
        if not isinstance(gen_kwargs, dict):
            raise ValueError(f"generation kwargs must be a dict, got {type(gen_kwargs).__name__}")
        kw = dict(normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=self.max_gen_toks))
        until = handle_stop_sequences(kw.pop("until", None), eos=eos)
        max_gen_toks = int(kw.pop("max_gen_toks"))
        kw.pop("do_sample", None)
        unknown = sorted(set(kw) - _SAMPLING_ARGS)
        if unknown:
            raise ValueError(
                f"jaxinfer generate_until: generation kwargs {unknown} are not "
                f"supported; supported: until, max_gen_toks (and aliases), do_sample, "
                f"{', '.join(sorted(_SAMPLING_ARGS))}"
            )
        kw["temperature"] = float(kw.get("temperature", 0.0))
        return SamplingParams(max_tokens=max_gen_toks, stop=[s for s in until if s], **kw), until

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Generated text of each request (``Instance.args == (context, gen_kwargs)``), in order."""
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        prompts, params, untils = [], [], []
        for req in requests:
            context, gen_kwargs = req.args
            sp, until = self._sampling(gen_kwargs, eos)
            if sp.max_tokens >= self.max_length:
                raise ValueError(
                    f"jaxinfer generate_until: max_gen_toks={sp.max_tokens} leaves "
                    f"no room for a prompt in max_length={self.max_length}"
                )
            toks, max_new = maybe_truncate(
                self.tok_encode(context),
                max_gen_toks=sp.max_tokens,
                max_model_len=self.max_length,
                side="left",
            )
            prompts.append(toks)
            params.append(sp)
            untils.append(until)
        texts, failed = [], []
        for i, o in enumerate(self.llm.generate(prompts, params)):
            if o.error is not None:
                failed.append((i, o.error))
            texts.append(postprocess_generated_text(o.text or "", untils[i], None))
        self._raise_failed("generate_until", failed)
        for req, text in zip(requests, texts, strict=True):
            self.cache_hook.add_partial("generate_until", tuple(req.args), text)
        return texts
