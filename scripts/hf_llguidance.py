"""The peer of ``bench_structured.py``: transformers ``generate`` with an llguidance logits
processor, on the same weights, prompts, schema and ``max_tokens`` as jaxinfer.

llguidance ships no transformers ``LogitsProcessor`` (its ``llguidance.hf`` builds the tokenizer,
``llguidance.torch`` fills and applies bitmasks), so ``LLGuidanceLogitsProcessor`` is the usual
one built from those pieces, as guidance and vLLM's llguidance backend use them: one
``LLMatcher`` per row, advanced by the token sampled last; the rows' packed bitmasks
(int32[B, ceil(V / 32)]) filled together by an ``LLExecutor`` (``fill_next_token_bitmask_par``,
llguidance's threads); the scores of forbidden tokens set to -inf. Its llguidance tokenizer comes
from the model's own tokenizer through transformers (``AutoTokenizer`` on the SentencePiece
``tokenizer.model``, then ``llguidance.hf.from_tokenizer``), as a transformers user would build
it. The mask is computed in line with the forward (transformers has no overlap), which is what
such a peer is.

    python scripts/hf_llguidance.py '{"hf_dir": ..., "tokenizer_model": ..., "prompt_ids": [...],
        "schema": {...}, "n": 64, "max_tokens": 128, "threads": 2}'

prints ``run_peer``'s result as one JSON line (``bench_structured.py`` runs it so, as a child).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


class LLGuidanceLogitsProcessor:
    """A transformers logits processor constraining each row of a batch to one llguidance grammar.

    Args:
        ll_tokenizer: llguidance's ``LLTokenizer`` of the model's tokenizer (``n_vocab`` = V).
        grammar: llguidance grammar text (``LLMatcher.grammar_from_json_schema``).
        rows: B, the batch's rows.
        vocab_size: V, the logits' width.

    Timings (seconds, summed over calls): ``fill_s`` (the bitmask fill, llguidance only),
    ``apply_s`` (unpacking it, numpy's ``unpackbits``, and setting the scores), ``accept_s``
    (advancing the matchers); ``rows`` counts the rows filled (a row stops once its grammar
    consumed EOS), ``accepted`` the tokens the matchers consumed.
    """

    def __init__(self, ll_tokenizer, grammar: str, rows: int, vocab_size: int):
        import llguidance
        import llguidance.torch as llt
        import torch

        self._llt, self._torch = llt, torch
        self.matchers = [
            llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0) for _ in range(rows)
        ]
        for m in self.matchers:
            if m.is_error():
                raise ValueError(f"llguidance grammar: {m.get_error()[:300]}")
        self.executor = llguidance.LLExecutor()
        self.bitmask = llt.allocate_token_bitmask(rows, vocab_size)  # int32[B, W]
        self.vocab_size = vocab_size
        self.live = [True] * rows
        self.started = False
        self.fill_s = self.apply_s = self.accept_s = 0.0
        self.rows = self.calls = self.accepted = 0

    def __call__(self, input_ids, scores):
        """float32[B, V] ``scores`` with the tokens each row's grammar forbids at -inf."""
        if self.started:  # advance by the token sampled at the previous step
            t = time.perf_counter()
            for i, tok in enumerate(input_ids[:, -1].tolist()):
                if not self.live[i]:
                    continue
                m = self.matchers[i]
                if not m.consume_token(tok):
                    raise RuntimeError(f"row {i}: token {tok} not allowed: {m.get_error()[:200]}")
                self.accepted += 1
                if m.is_stopped():  # EOS consumed: transformers pads this row from now on
                    self.live[i] = False
                    self.bitmask[i] = -1
            self.accept_s += time.perf_counter() - t
        self.started = True
        rows = [(m, i) for i, m in enumerate(self.matchers) if self.live[i]]
        t = time.perf_counter()
        if rows:
            self._llt.fill_next_token_bitmask_par(self.executor, rows, self.bitmask)
        self.fill_s += time.perf_counter() - t
        self.rows += len(rows)
        self.calls += 1
        t = time.perf_counter()
        words = self.bitmask.numpy().view(np.uint8)  # bit t % 32 of word t // 32, little-endian
        allowed = np.unpackbits(words, axis=-1, bitorder="little")[:, : scores.shape[1]]
        out = scores.masked_fill(self._torch.from_numpy(allowed) == 0, float("-inf"))
        self.apply_s += time.perf_counter() - t
        return out


def hf_tokenizer(model_dir: Path, tokenizer_model: Path):
    """The model's tokenizer as transformers loads it: ``AutoTokenizer`` on a directory holding
    the SentencePiece ``tokenizer.model`` (a fast Llama tokenizer, converted by transformers)."""
    from transformers import AutoTokenizer

    if (model_dir / "tokenizer.model").exists():
        return AutoTokenizer.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as d:
        shutil.copy(tokenizer_model, Path(d) / "tokenizer.model")
        (Path(d) / "tokenizer_config.json").write_text(
            json.dumps({"tokenizer_class": "LlamaTokenizer"})
        )
        return AutoTokenizer.from_pretrained(d)


def run_peer(
    hf_dir: str | Path,
    tokenizer_model: str | Path,
    prompt_ids: list[int],
    schema: dict,
    n: int,
    max_tokens: int,
    threads: int,
    repeats: int = 1,
) -> dict:
    """transformers ``generate`` (float32, sampled at temperature 1.0, top-k off, seeded) of
    ``n`` copies of ``prompt_ids``: constrained by ``schema`` (no whitespace, EOS where the
    grammar can end), then unconstrained (EOS ignored), ``repeats`` times in turn. Returns tok/s
    of each (``throughput``), the slowdown and the processor's timings per token per row over
    every constrained run; the constrained outputs that ended are parsed."""
    import llguidance
    import llguidance.hf
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    tok = hf_tokenizer(Path(hf_dir), Path(tokenizer_model))
    eos = tok.eos_token_id
    t = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    tok_build_s = time.perf_counter() - t
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema), overrides={"whitespace_flexible": False}
    )
    ids = torch.tensor([prompt_ids] * n)

    def generate(rows: int, new: int, proc=None):
        torch.manual_seed(0)
        kw = dict(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new, pad_token_id=0
        )
        # EOS ignored unconstrained (no EOS id at all), allowed where the grammar ends otherwise
        model.generation_config.eos_token_id = None if proc is None else eos
        if proc is not None:
            kw["logits_processor"] = LogitsProcessorList([proc])
        gc.collect()  # as bench_structured's jaxinfer runs
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids[:rows], attention_mask=torch.ones_like(ids[:rows]), **kw)
        return time.perf_counter() - t, out[:, ids.shape[1] :].tolist()

    generate(4, 4)  # warm-up (no compilation in eager transformers; first-call allocations)
    generate(4, 4, LLGuidanceLogitsProcessor(ll_tok, grammar, 4, vocab))

    def length(row):  # tokens up to and including the first EOS (transformers pads after it)
        return row.index(eos) + 1 if eos in row else len(row)

    procs, runs_c, runs_f = [], [], []
    for _ in range(repeats):
        procs.append(LLGuidanceLogitsProcessor(ll_tok, grammar, n, vocab))
        wall_c, outs_c = generate(n, max_tokens, procs[-1])
        wall_f, outs_f = generate(n, max_tokens)
        runs_c.append((sum(map(length, outs_c)), wall_c))
        runs_f.append((sum(len(r) for r in outs_f), wall_f))
    stopped = [r[: length(r) - 1] for r in outs_c if eos in r]
    for r in stopped:
        json.loads(tok.decode(r))

    def total(attr):
        return sum(getattr(p, attr) for p in procs)

    return {
        "engine": "transformers generate + llguidance logits processor",
        "torch_threads": threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        **throughput(runs_c, runs_f),
        "constrained_finished_stop": len(stopped),
        "mask_us_per_token_row": round(total("fill_s") / max(total("rows"), 1) * 1e6, 2),
        "mask_ms_per_step": round(total("fill_s") / max(total("calls"), 1) * 1e3, 3),
        "apply_ms_per_step": round(total("apply_s") / max(total("calls"), 1) * 1e3, 3),
        "accept_us_per_token": round(total("accept_s") / max(total("accepted"), 1) * 1e6, 2),
        "ll_tokenizer_build_ms": round(tok_build_s * 1e3, 2),
    }


def throughput(runs_c: list[tuple[int, float]], runs_f: list[tuple[int, float]]) -> dict:
    """Output tok/s of constrained and unconstrained runs run in turn ((tokens, seconds) each):
    the median of each, the slowdown of the medians (%), every run's tok/s and each pair's
    slowdown (a shared machine's bursts hit single runs), and the last runs' token counts."""
    tps_c = [t / w for t, w in runs_c]
    tps_f = [t / w for t, w in runs_f]
    med_c, med_f = float(np.median(tps_c)), float(np.median(tps_f))
    return {
        "constrained_tok_s": round(med_c, 1),
        "unconstrained_tok_s": round(med_f, 1),
        "slowdown_pct": round((1 - med_c / med_f) * 100, 1),
        "constrained_tok_s_runs": [round(x, 1) for x in tps_c],
        "unconstrained_tok_s_runs": [round(x, 1) for x in tps_f],
        "slowdown_pct_pairs": [
            round((1 - c / f) * 100, 1) for c, f in zip(tps_c, tps_f, strict=True)
        ],
        "constrained_tokens": runs_c[-1][0],
        "unconstrained_tokens": runs_f[-1][0],
    }


if __name__ == "__main__":
    print(json.dumps(run_peer(**json.loads(sys.argv[1]))), flush=True)
