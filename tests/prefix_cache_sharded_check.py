"""Prefix caching on tensor- and data-parallel engines (8 fake CPU devices); prints one JSON
report for tests/test_prefix_cache_paths.py.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/prefix_cache_sharded_check.py

One LLM per setting on a tp=2 x dp=2 mesh (each replica split over two devices), caching on and
off, the same two waves: wave 1 puts prefix P on replica 0 and prefix Q on replica 1 (request i
on replica i % 2); wave 2 asks Q first and P second (so i % 2 would send each to the replica
without it) plus a prompt sharing nothing, with greedy, seeded and seedless sampled rows. The
report gives each wave-2 request's cached tokens and replica, the outputs of both settings, the
seeds ``draw_seeds`` predicted, and each replica's pool state.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

from jaxinfer.llm import LLM  # noqa: E402
from jaxinfer.sampling.params import SamplingParams  # noqa: E402

SHARED = Path(os.environ.get("JAXINFER_SHARED", Path(__file__).resolve().parents[2] / "shared"))
STORIES = SHARED / "models" / "stories260K"


def run(caching: bool) -> dict:
    llm = LLM(
        STORIES,
        max_model_len=32,
        kv_pages=12,
        page_size=8,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        tensor_parallel_size=2,
        data_parallel_size=2,
        unroll_layers=False,
        enable_prefix_caching=caching,
        compilation_cache=False,
    )
    tok = llm.tokenizer
    p = tok.encode("Once upon a time, in a small town, there lived")[:17]
    q = tok.encode("The little dog ran to the park and saw a big red ball")[:17]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    wave1 = llm.generate([p + [20], q + [21]], greedy)
    # Seedless sampled rows draw from replica i % 2's host RNG whatever replica runs them.
    params = [
        SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=5, max_tokens=4, ignore_eos=True),
        greedy,
        SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True),
    ]
    prompts = [q + [30, 31], p + [32], q + [33], tok.encode("A dog")]
    state = [e._rng.bit_generator.state for e in llm.engines]
    seeds = llm.draw_seeds(params)
    for e, s in zip(llm.engines, state, strict=True):
        e._rng.bit_generator.state = s  # draw_seeds advanced them: rewind to predict
    placed = {}
    for i, e in enumerate(llm.engines):
        add = e.add_request

        def spy(rid, *a, _add=add, _i=i, **k):
            placed[rid] = (_i, k.get("resume").seed if k.get("resume") else None)
            return _add(rid, *a, **k)

        e.add_request = spy
    wave2 = llm.generate(prompts, params)
    replicas = [placed[k] for k in sorted(placed)]
    for e in llm.engines:
        e.kv_manager.check_invariants()
    return {
        "tokens": [o.token_ids for o in wave1 + wave2],
        "logprobs": [[lp.logprob for lp in o.logprobs] for o in wave1 + wave2 if o.logprobs],
        "cached": [o.metrics.num_cached_tokens for o in wave1 + wave2],
        "replicas": [r for r, _ in replicas],
        "resume_seeds": [s for _, s in replicas],
        "predicted_seeds": seeds,
        "stats": [e.prefix_cache_stats() for e in llm.engines],
        "pool_free": [e.kv_manager.num_free_pages == e.ecfg.num_pages - 1 for e in llm.engines],
        "devices_per_replica": [len(e.mesh.devices.flat) for e in llm.engines],
    }


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    print(json.dumps({"on": run(True), "off": run(False)}))


if __name__ == "__main__":
    sys.exit(main())
