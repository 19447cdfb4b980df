"""Structured outputs' cost (issue 31), beside a peer; prints one JSON summary.

    python scripts/bench_structured.py                       # stories260K and the ~110M Llama
    python scripts/bench_structured.py --models stories260K --mask-vocab 32000 128000
    python scripts/bench_structured.py --models --mask-vocab 32000 128000   # masks only
    python scripts/bench_structured.py --quick               # a smoke test, seconds

Per model (``--models``): a batch of N requests (default 64, one prompt each, temperature 1.0,
seeded) run on one warm ``LLM``: every request constrained by a JSON schema (an array of at
least ten small objects, no whitespace: outputs reach ``max_tokens`` as the unconstrained ones
do), then the same requests unconstrained (``ignore_eos``), ``--repeats`` times in turn.
Reported: the median output tokens/s of each (the slowdown of the medians in %; every run's
figure and each pair's slowdown beside them), the host's mask time per token per row (µs:
``Grammars.fill_bitmask`` timed around each call, divided by the rows it filled), the matcher's
advance time per token, the first-request cost of a schema (the llguidance tokenizer, then the
grammar compiled) and the same with the schema cached. Both configurations run once before they
are timed (compilations excluded; ``compilations_in_measured_runs`` shows it); every run starts
after ``gc.collect()`` (without it, stories260K's unconstrained runs on one ``LLM`` varied from
4,400 to 9,900 tok/s on an idle machine; with it, 6,900 to 9,600: the cyclic collector's passes
over earlier runs' garbage fell inside the timing). Then the peer (``hf_llguidance.py``):
transformers ``generate`` on the same weights (stories260K converted to a Hugging Face Llama,
``benchlib.stories_hf_dir``; the random Llama's own directory), the same prompt ids, schema and
``max_tokens``, constrained by an llguidance logits processor built from the model's tokenizer
through transformers, then unconstrained: its tok/s both ways, slowdown and mask µs per token
per row, beside jaxinfer's (``--no-peer`` skips it). The peer runs in a child process (no JAX
threads or engine beside it), torch on ``--threads`` threads (default: every core) with
``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it: torch's OpenMP threads spin-wait
between ops by default, and on a shared, loaded machine (load 7 on 2 cores) transformers then
ran stories260K 10-20x slower with 2 threads than with 1; waiting passively gives it its
1-thread speed or better.

``--mask-vocab V ...``: the mask's cost at a realistic vocabulary, which the models above lack
(stories260K's tokenizer has 512 tokens; the random Llama's logits are 32,000 wide but its
tokenizer names 512). A byte-level BPE tokenizer of V tokens (as Llama 3's and GPT's) is trained
locally with the ``tokenizers`` library on generated text (pseudo-words drawn Zipf-like, sentences,
numbers, JSON records and code lines; cached under ``$JAXINFER_CACHE_DIR/bench``) and loaded
through jaxinfer's tokenizer loader. Reported: the llguidance tokenizer's build time
(``Grammars.ll_tokenizer``: jaxinfer's ``grammar_vocabulary`` then llguidance's), the schema's
first compile and a cached one, and the mask per token for 1 row and per row at ``--num-requests``
rows (``Grammars.fill_bitmask``), over ``--mask-steps`` steps of matchers that each advance by a
token drawn uniformly from its allowed ones (EOS excluded), as a model that knows nothing of the
schema would.

The summary gives the CPU model, the core count, the commit and the load average around each
entry (the machine may be shared: compare figures of the same run); it is appended to
``<results dir>/bench_structured.jsonl``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO))

from benchlib import CACHE, STORIES, add_common_args, emit, host_info, log  # noqa: E402
from hf_llguidance import throughput  # noqa: E402

SCHEMA = {  # at least 10 items (> 128 tokens): constrained outputs as long as the others
    "type": "array",
    "minItems": 10,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "color": {"enum": ["red", "green", "blue"]},
        },
        "required": ["name", "age", "color"],
        "additionalProperties": False,
    },
}
PROMPT = "Once upon a time"


def grammar_costs(tokenizer, vocab: int, so):
    """A fresh ``Grammars`` and its first-request costs in seconds: building llguidance's
    tokenizer, compiling ``so``'s schema (a StructuredOutputsParams), then fetching it cached
    (mean of 100)."""
    from jaxinfer.sampling.structured import Grammars

    g = Grammars(tokenizer, vocab)
    t = time.perf_counter()
    _ = g.ll_tokenizer
    t_tok = time.perf_counter() - t
    t = time.perf_counter()
    g.check(so)
    t_first = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(100):
        g.matcher(so)
    return g, t_tok, t_first, (time.perf_counter() - t) / 100


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# ---------------------------------------------------------------- jaxinfer and the peer


def bench_model(
    name: str,
    n: int,
    max_tokens: int,
    peer: bool,
    threads: int,
    repeats: int,
    max_model_len: int = 512,
    collect: bool = True,
) -> dict:
    """jaxinfer's constrained and unconstrained runs of ``name``, then the peer's (module
    docstring). ``collect``: ``gc.collect()`` before every run (``--quick`` skips it: a smoke
    test, and a full collection takes ~1 s in a process holding many compiled programs)."""
    from benchlib import resolve_model

    from jaxinfer import SamplingParams, StructuredOutputsParams
    from jaxinfer.llm import LLM

    load0 = loadavg()
    path, _, hf_dir = resolve_model(name, hf=peer)
    llm = LLM(path, max_num_seqs=n, max_model_len=max_model_len)
    eng = llm.engine
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)

    # first-request cost: the llguidance tokenizer, then the schema; then the schema cached
    g, t_tok, t_first, t_cached = grammar_costs(llm.tokenizer, eng.cfg.vocab_size, so)

    timing = {"fill_s": 0.0, "rows": 0, "calls": 0}
    fill = eng.grammars.fill_bitmask

    def timed_fill(rows, bitmask):
        t = time.perf_counter()
        fill(rows, bitmask)
        timing["fill_s"] += time.perf_counter() - t
        timing["rows"] += len(rows)
        timing["calls"] += 1

    eng.grammars.fill_bitmask = timed_fill
    prompts = [PROMPT] * n
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, structured_outputs=so)
        for i in range(n)
    ]
    free = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True)
        for i in range(n)
    ]

    def run(params) -> tuple[float, int, list]:
        if collect:  # no collection of the previous run's garbage inside this one's timing
            gc.collect()
        t = time.perf_counter()
        outs = llm.generate(prompts[: len(params)], params)
        wall = time.perf_counter() - t
        return wall, sum(len(o.token_ids) for o in outs), outs

    log(f"{name}: jaxinfer warm-up")
    run(constrained), run(free)  # compile the shapes of both (warm-up)
    compiled = llm.num_compilations
    log(f"{name}: jaxinfer timed runs")
    mask = {"fill_s": 0.0, "rows": 0, "calls": 0}
    runs_c, runs_f = [], []
    for _ in range(repeats):  # in turn: a burst of load on the shared machine hits one run
        timing.update(fill_s=0.0, rows=0, calls=0)
        wall_c, tok_c, outs = run(constrained)
        mask = {k: mask[k] + timing[k] for k in mask}
        wall_f, tok_f, _ = run(free)
        runs_c.append((tok_c, wall_c))
        runs_f.append((tok_f, wall_f))
    for o in outs:
        if o.finish_reason == "stop":
            json.loads(o.text)
    # the matcher's advance per token, timed apart (replayed on fresh matchers)
    t0, k = time.perf_counter(), 0
    for o in outs[:16]:
        m = eng.grammars.matcher(so)
        for tok in o.token_ids:
            m.accept(tok)
            k += 1
    accept_us = (time.perf_counter() - t0) / max(k, 1) * 1e6
    res = {
        "model": name,
        "vocab_size": eng.cfg.vocab_size,
        "tokenizer_vocab": llm.tokenizer.vocab_size,
        "requests": n,
        "max_tokens": max_tokens,
        "jaxinfer": {
            **throughput(runs_c, runs_f),
            "constrained_finished_stop": sum(o.finish_reason == "stop" for o in outs),
            "mask_us_per_token_row": round(mask["fill_s"] / max(mask["rows"], 1) * 1e6, 2),
            "mask_ms_per_step": round(mask["fill_s"] / max(mask["calls"], 1) * 1e3, 3),
            "accept_us_per_token": round(accept_us, 2),
            "ll_tokenizer_build_ms": round(t_tok * 1e3, 2),
            "schema_first_compile_ms": round(t_first * 1e3, 2),
            "schema_cached_ms": round(t_cached * 1e3, 4),
            "compilations_in_measured_runs": llm.num_compilations - compiled,
        },
        "loadavg_jaxinfer": [load0, loadavg()],
    }
    if peer:
        log(f"{name}: transformers + llguidance")
        tok_model = path / "tokenizer.model" if name != "stories260K" else STORIES / "tok512.model"
        p = run_peer_child(
            hf_dir=str(hf_dir),
            tokenizer_model=str(tok_model),
            prompt_ids=list(outs[0].prompt_token_ids),
            schema=SCHEMA,
            n=n,
            max_tokens=max_tokens,
            threads=threads,
            repeats=repeats,
        )
        j = res["jaxinfer"]
        res["peer"] = p
        res["jaxinfer_over_peer"] = {
            "constrained_tok_s": round(j["constrained_tok_s"] / p["constrained_tok_s"], 2),
            "unconstrained_tok_s": round(j["unconstrained_tok_s"] / p["unconstrained_tok_s"], 2),
            "mask_us_per_token_row": round(
                j["mask_us_per_token_row"] / max(p["mask_us_per_token_row"], 1e-9), 2
            ),
        }
        res["loadavg_peer"] = loadavg()
    return res


def run_peer_child(**spec) -> dict:
    """``hf_llguidance.run_peer(**spec)`` in a child process (module docstring); its stderr
    passes through, its stdout is the result as one JSON line."""
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    script = REPO / "scripts" / "hf_llguidance.py"
    p = subprocess.run(
        [sys.executable, str(script), json.dumps(spec)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    if p.returncode != 0:
        raise RuntimeError(f"the transformers peer failed (exit status {p.returncode})")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- masks at a real vocabulary

ONSETS = [*"bcdfghjklmnprstvwz", "ch", "sh", "th", "st", "tr", "pl", "gr", "br", "qu", "sp"]
VOWELS = [*"aeiouy", "ai", "ea", "ou", "io"]
CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "ng", "ck", "nd", "st"]


def synthetic_corpus(lines: int, seed: int = 0, lexicon: int = 200_000) -> list[str]:
    """``lines`` lines of generated text to train a BPE tokenizer on: a lexicon of pseudo-words
    (1 to 4 syllables), drawn with Zipf-like frequencies (p ~ 1 / rank^1.05) into sentences with
    numbers (60 %), JSON arrays of small records, compact or spaced (25 %), and Python lines
    (15 %)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    syl = np.array([a + b + c for a in ONSETS for b in VOWELS for c in CODAS])
    parts = syl[rng.integers(0, len(syl), (lexicon, 4))]
    counts = rng.integers(1, 5, lexicon)
    words = np.unique(["".join(p[:k]) for p, k in zip(parts, counts, strict=True)])
    rng.shuffle(words)
    p = 1.0 / np.arange(1, len(words) + 1) ** 1.05
    sizes = rng.integers(6, 20, lines)
    stream = words[rng.choice(len(words), int(sizes.sum()), p=p / p.sum())].tolist()
    kinds, nums = rng.random(lines), rng.integers(0, 100_000, (lines, 4)).tolist()
    colors, ends = ["red", "green", "blue"], [".", "!", "?", ",", ";"]
    out, at = [], 0
    for i in range(lines):
        ws, at = stream[at : at + sizes[i]], at + sizes[i]
        x = nums[i]
        if kinds[i] < 0.6:
            text = " ".join(ws)
            out.append(f"{text[0].upper()}{text[1:]}{ends[x[0] % 5]} {x[1] % 10 ** (x[2] % 6)}")
        elif kinds[i] < 0.85:
            recs = [
                {"name": w[:8], "age": x[j] % 121, "color": colors[x[j] % 3]}
                for j, w in enumerate(ws[:3])
            ]
            sep = (",", ":") if x[3] % 2 else (", ", ": ")
            out.append(json.dumps(recs, separators=sep))
        else:
            out.append(
                f"def {ws[0]}_{ws[1]}({ws[2]}, {ws[3]}=None):\n"
                f"    return {ws[2]}.{ws[4]}({ws[3]} or {x[0] % 100})"
            )
    return out


def bpe_tokenizer_dir(vocab: int, lines: int, seed: int = 0) -> tuple[Path, float | None]:
    """A directory holding a byte-level BPE ``tokenizer.json`` of ``vocab`` tokens (``<s>``,
    ``</s>``, ``<unk>`` first) trained on ``synthetic_corpus(lines, seed)``, built once and
    cached; and the seconds it took to build (None when cached)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = CACHE / "bench" / f"bpe{vocab}-{lines}-{seed}"
    if (path / "tokenizer.json").exists():
        return path, None
    t = time.perf_counter()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(lines, seed), trainer)
    if tok.get_vocab_size() != vocab:
        raise RuntimeError(
            f"BPE training reached {tok.get_vocab_size()} tokens, not {vocab}: give more text "
            "(--mask-corpus-lines)"
        )
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    tmp.rename(path)  # atomic: a concurrent run never sees half a directory
    return path, time.perf_counter() - t


def bench_mask_vocab(vocab: int, rows: int, steps: int, lines: int, seed: int) -> dict:
    """The mask's cost with a trained ``vocab``-token tokenizer (module docstring)."""
    import numpy as np

    from jaxinfer import StructuredOutputsParams
    from jaxinfer.sampling.structured import bitmask_words, unpack_bitmask
    from jaxinfer.tokenizers import load_tokenizer

    load0 = loadavg()
    path, train_s = bpe_tokenizer_dir(vocab, lines, seed)
    tok = load_tokenizer(path)
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    g, t_tok, t_first, t_cached = grammar_costs(tok, vocab, so)
    eos = np.array(sorted(tok.eos_ids))
    res = {
        "vocab": vocab,
        "tokenizer": f"byte-level BPE trained on {lines} generated lines (seed {seed})",
        "train_s": None if train_s is None else round(train_s, 2),
        "ll_tokenizer_build_ms": round(t_tok * 1e3, 2),
        "schema_first_compile_ms": round(t_first * 1e3, 2),
        "schema_cached_ms": round(t_cached * 1e3, 4),
        "steps": steps,
    }
    rng = np.random.default_rng(seed)
    for b in (1, rows):
        matchers = [g.matcher(so) for _ in range(b)]
        bitmask = np.zeros((b, bitmask_words(vocab)), np.int32)
        fill_s, allowed_sum = 0.0, 0
        for _ in range(steps):
            t = time.perf_counter()
            g.fill_bitmask([(m, i) for i, m in enumerate(matchers)], bitmask)
            fill_s += time.perf_counter() - t
            allowed = unpack_bitmask(bitmask, vocab)
            allowed[:, eos] = False
            for i, m in enumerate(matchers):
                ids = np.flatnonzero(allowed[i])
                allowed_sum += len(ids)
                m.accept(int(rng.choice(ids)))
        key = "1_row" if b == 1 else f"{b}_rows"
        res[f"mask_us_per_token_{key}" if b == 1 else f"mask_us_per_row_{key}"] = round(
            fill_s / (steps * b) * 1e6, 2
        )
        res[f"mean_allowed_tokens_{key}"] = round(allowed_sum / (steps * b), 1)
    res["loadavg"] = [load0, loadavg()]
    return res


# ---------------------------------------------------------------- main

# --quick: the engine's sizes those of the other scripts' quick runs (max_model_len 64, 8 rows),
# so that in one process (tests/test_benchmarks.py) they share compiled steps.
QUICK = {
    "models": ["stories260K"],
    "n": 8,
    "max_tokens": 16,
    "max_model_len": 64,
    "vocab": [1000],
    "lines": 3000,
}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--models", nargs="*", default=None, help="default: stories260K llama110m")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=512, help="the engine's max_model_len")
    ap.add_argument(
        "--repeats", type=int, default=3, help="timed constrained/unconstrained pairs per engine"
    )
    ap.add_argument("--no-peer", action="store_true", help="skip transformers + llguidance")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (peer)")
    ap.add_argument("--mask-vocab", nargs="*", type=int, default=None, metavar="V")
    ap.add_argument("--mask-steps", type=int, default=128)
    ap.add_argument("--mask-corpus-lines", type=int, default=200_000)
    add_common_args(ap)
    args = ap.parse_args()
    models = args.models if args.models is not None else ["stories260K", "llama110m"]
    vocabs, lines = args.mask_vocab or [], args.mask_corpus_lines
    n, max_tokens, steps = args.num_requests, args.max_tokens, args.mask_steps
    repeats, max_model_len, collect = args.repeats, args.max_model_len, True
    if args.quick:
        models, n, max_tokens, repeats = QUICK["models"], QUICK["n"], QUICK["max_tokens"], 1
        max_model_len, collect = QUICK["max_model_len"], False
        vocabs, lines, steps = QUICK["vocab"], QUICK["lines"], 8
    summary = {
        "bench": "bench_structured",
        "quick": args.quick,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "commit": commit(),
        **host_info(),
        "schema": SCHEMA,
        "prompt": PROMPT,
        "repeats": repeats,
        "loadavg_start": loadavg(),
        "results": [],
        "mask_vocab": [],
    }
    for name in models:
        res = bench_model(
            name, n, max_tokens, not args.no_peer, args.threads, repeats, max_model_len, collect
        )
        summary["results"].append(res)
    for v in vocabs:
        log(f"masks at V = {v}")
        summary["mask_vocab"].append(bench_mask_vocab(v, n, steps, lines, args.seed))
    summary["loadavg_end"] = loadavg()
    emit(summary, "bench_structured", args.results_dir)


if __name__ == "__main__":
    main()
