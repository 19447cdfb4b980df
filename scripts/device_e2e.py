"""Device stage 2: stories260K greedy through the engine equals llama2.c's references.

    python scripts/device_e2e.py --attn-impls auto,pallas_gpu       # on the GPU
    python scripts/device_e2e.py --attn-impls xla,pallas_gpu_interpret --max-cases 2  # CPU smoke

For each ``attn_impl``: ``LLM(stories260K, attn_impl=...)`` runs every case of
``greedy_reference.json`` (llama2.c run.c's greedy text; prompt with BOS, ``max_steps`` forward
steps, stop on BOS) in one batch, and the decoded prompt + output is compared with the expected
text exactly. The model folder is ``$JAXINFER_SHARED/models/stories260K`` (default ../shared).
Prints one JSON object: {"backend", "impls": {impl: {"resolved", "cases", "matched",
"mismatches": [...], "seconds"} | {"error"}}}. Exit status 1 when any impl fails or mismatches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attn-impls", default="auto,pallas_gpu")
    ap.add_argument("--max-cases", type=int, default=0, help="first N cases only (0: all)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import jax

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.models.attn_dispatch import resolve_attn_impl

    shared = Path(os.environ.get("JAXINFER_SHARED", ROOT.parent / "shared"))
    stories = shared / "models" / "stories260K"
    ref_file = stories / "greedy_reference.json"
    report = {"backend": jax.default_backend(), "model": str(stories), "impls": {}}
    if not ref_file.is_file():
        report["error"] = f"{ref_file} not found (set JAXINFER_SHARED)"
        print(json.dumps(report, indent=1))
        return 1
    cases = json.loads(ref_file.read_text())
    if args.max_cases:
        cases = cases[: args.max_cases]
    ok = True
    for impl in [i for i in args.attn_impls.split(",") if i]:
        t0 = time.time()
        try:
            res = {"resolved": resolve_attn_impl(impl)}
            llm = LLM(stories, attn_impl=impl, max_num_seqs=16)
            tok = llm.tokenizer
            prompts, params = [], []
            for c in cases:
                ids = tok.encode(c["prompt"])
                prompts.append(ids)
                params.append(
                    SamplingParams(
                        temperature=0.0,
                        stop_token_ids=(1,),
                        max_tokens=c["max_steps"] - (len(ids) - 1),
                    )
                )
            outs = llm.generate(prompts, params)
            mism = []
            for c, ids, o in zip(cases, prompts, outs, strict=True):
                got = tok.decode(ids + o.token_ids)
                if got != c["expected"]:
                    m = min(len(got), len(c["expected"]))
                    n = next((i for i in range(m) if got[i] != c["expected"][i]), m)
                    mism.append(
                        {
                            "prompt": c["prompt"],
                            "first_diff_char": n,
                            "got": got[max(0, n - 20) : n + 40],
                            "expected": c["expected"][max(0, n - 20) : n + 40],
                        }
                    )
            res.update(
                cases=len(cases),
                matched=len(cases) - len(mism),
                mismatches=mism,
                compilations=llm.num_compilations,
            )
            ok &= not mism
            del llm
        except Exception as e:  # reported, the next impl still runs
            res = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            ok = False
        res["seconds"] = round(time.time() - t0, 1)
        report["impls"][impl] = res
    print(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
