"""Smoke tests of the benchmark scripts: each runs with ``--quick`` and emits one well-formed JSON
summary with its expected keys (speed is never asserted here); plot_bench draws records written by
the test, checked in its figures' data and its PNGs' pixels.

The scripts' ``main()`` run in this process (``sys.argv`` set, stdout read at the file descriptor),
so their engines share this worker's compiled steps and no interpreter starts per script; only
bench_serve's usage errors run as commands (their exit status; the script imports no jax before
parsing), and bench_compile's own children measure a process's time to first token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STORIES = Path(os.environ.get("JAXINFER_SHARED", REPO.parent / "shared")) / "models" / "stories260K"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not STORIES.exists(), reason=f"stories260K not found at {STORIES}"),
]

CASES = {
    "bench_serving": ["results", "engine_dtype", "workload"],
    "bench_roofline": ["bandwidth_gb_s", "results"],
    "bench_kv_memory": ["paged", "contiguous", "budget_tokens", "concurrency_ratio"],
    "bench_compile": ["results"],
    "bench_prefix_cache": ["results", "cpu", "loadavg_start", "repeats"],
    "bench_grouped_matmul": ["results", "cpu", "commit", "auto_backend"],
    "bench_moe": ["layer", "grouped_matmul", "cpu", "commit", "loadavg_before", "shape"],
    "bench_structured": ["results", "mask_vocab", "cpu", "commit", "loadavg_start"],
}


def run_script(name: str, results_dir: Path, capfd, *extra: str) -> dict:
    """``scripts/NAME.py --quick --results-dir RESULTS_DIR *extra`` in this process: its summary,
    checked to be the only line on stdout (file descriptor 1, C-level writes included) and the
    last line of its results file."""
    import importlib

    scripts = str(REPO / "scripts")
    argv, path = sys.argv, list(sys.path)
    sys.argv = [f"{name}.py", "--quick", "--results-dir", str(results_dir), *extra]
    sys.path.insert(0, scripts)
    capfd.readouterr()
    try:
        importlib.import_module(name).main()
    except SystemExit as e:
        assert e.code in (None, 0), capfd.readouterr().err[-3000:]
    finally:
        sys.argv, sys.path[:] = argv, path
    out = capfd.readouterr().out
    lines = [x for x in out.splitlines() if x.strip()]
    assert len(lines) == 1, out  # one JSON line on stdout, nothing else
    summary = json.loads(lines[0])
    recorded = (results_dir / f"{name}.jsonl").read_text().splitlines()
    assert json.loads(recorded[-1]) == summary
    return summary


@pytest.fixture
def torch_threads():
    """Restores torch's thread count, which the transformers peers of the scripts set."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("results")


@pytest.mark.parametrize("name", list(CASES))
def test_quick_emits_json(name, results_dir, capfd, torch_threads):
    s = run_script(name, results_dir, capfd)
    for key in CASES[name]:
        assert key in s, (key, s)
    assert s["quick"] is True
    if name == "bench_serving":
        r = s["results"][0]
        assert r["model"] == "stories260K"
        for key in ("requests_s", "output_tok_s", "ttft_s", "tpot_s"):
            assert key in r["engine"] and key in r["hf"]["float32"]
        assert set(r["engine"]["ttft_s"]) == {"mean", "p50", "p99"}
        assert "output_tok_s" in r["ratio"]["float32"]
    elif name == "bench_roofline":
        row = s["results"][0]["decode"][0]
        for key in ("batch", "tok_s", "roofline_tok_s", "pct_of_roofline", "bytes_per_step"):
            assert key in row
    elif name == "bench_kv_memory":
        for key in ("max_concurrent", "live_fraction"):
            assert key in s["paged"] and key in s["contiguous"]
    elif name == "bench_compile":
        r = s["results"][0]
        assert set(r) >= {"disabled", "cold", "warm", "compilations_stop_growing"}
        assert "ttft_process_s" in r["warm"]
    elif name == "bench_prefix_cache":
        check_prefix_cache(s["results"][0])
    elif name == "bench_moe":
        check_moe(s)
    elif name == "bench_structured":
        check_structured(s)


def check_moe(s: dict) -> None:
    """bench_moe's quick run (qwen3moe_tiny's layer: D 64, 8 experts of width 32, top-2; T = 1
    and 8): every figure present and positive, the ratios the quotients of their figures, the
    FLOPs of each side counted from the shape, and every grouped-matmul formulation agreeing
    with the engine's within f32 rounding."""
    assert s["shape"] == {"name": "qwen3moe_tiny", "D": 64, "E": 8, "A": 2, "I": 32, "dense_F": 64}
    assert set(s["layer"]) == {"T1", "T8"}
    for t, row in ((1, s["layer"]["T1"]), (8, s["layer"]["T8"])):
        for name in ("moe", "dense", "dense_input_first", "route"):
            f = row[name]
            assert 0 < f["ms_min"] <= f["ms_median"] and f["calls"] >= 3, (t, name)
        assert row["moe_over_dense"] == pytest.approx(
            row["moe"]["ms_median"] / row["dense"]["ms_median"], rel=1e-2, abs=1e-3
        )
        assert row["flops"] == {"moe": t * (6 * 64 * 2 * 32 + 2 * 64 * 8), "dense": t * 6 * 64 * 64}
        assert 1 <= row["experts_used"] <= min(8, 2 * t) and row["max_rows_per_expert"] <= t
    assert set(s["grouped_matmul"]) == {"T1/gate_up", "T1/down", "T8/gate_up", "T8/down"}
    for key, row in s["grouped_matmul"].items():
        t = int(key[1 : key.index("/")])
        assert row["rows"] == 2 * t
        for name in ("gmm_auto", "ragged_dot", "dense_masked", "pallas_tpu_interpret"):
            assert row[name]["ms_median"] > 0 and row[name]["max_abs_diff_vs_gmm_auto"] < 1e-5
        assert row["gmm_auto"]["x_gmm_auto"] == 1.0


def check_structured(s: dict) -> None:
    """bench_structured's quick run (8 requests of 16 tokens, stories260K, one vocabulary): both
    engines' keys, unconstrained runs of exactly 8 x 16 tokens (EOS ignored), constrained ones
    of at most that, and the mask figures at the trained vocabulary."""
    (r,) = s["results"]
    assert r["model"] == "stories260K" and r["requests"] == 8 and r["max_tokens"] == 16
    keys = {"constrained_tok_s", "unconstrained_tok_s", "slowdown_pct", "mask_us_per_token_row"}
    for side in ("jaxinfer", "peer"):
        assert set(r[side]) >= keys | {"ll_tokenizer_build_ms"}, (side, r[side])
        assert r[side]["unconstrained_tokens"] == 8 * 16, side
        assert 0 < r[side]["constrained_tokens"] <= 8 * 16, side
    assert set(r["jaxinfer"]) >= {"schema_first_compile_ms", "schema_cached_ms"}
    assert r["jaxinfer"]["compilations_in_measured_runs"] == 0
    assert set(r["jaxinfer_over_peer"]) == {
        "constrained_tok_s",
        "unconstrained_tok_s",
        "mask_us_per_token_row",
    }
    (v,) = s["mask_vocab"]
    assert v["vocab"] == 1000
    for key in ("ll_tokenizer_build_ms", "schema_first_compile_ms", "schema_cached_ms"):
        assert v[key] > 0, key
    assert v["mask_us_per_token_1_row"] > 0 and v["mask_us_per_row_8_rows"] > 0
    assert 0 < v["mean_allowed_tokens_1_row"] < 1000


def check_prefix_cache(r: dict) -> None:
    """Token counts of bench_prefix_cache's quick run against its sizes (page size 8): each
    pass starts with an empty cache, so in (a) the first request computes the 3 system-prompt
    pages and at most the other R - 1 read them; nothing is read with caching off or in (d)."""
    z, n = r["sizes"], r["sizes"]["requests"]
    assert r["page_size"] == 8 and z["system"] == 24 and z["header"] == 20
    assert r["compilations_in_measured_passes"] == 0
    assert set(r["aims"]) == {
        "system_prompt_ttft_p50_3x",
        "system_prompt_throughput_2x",
        "no_prefix_at_most_3pct_slower",
    }
    first, later = z["first_message"], z["user_message"] + z["chat_answer"]
    prompt = {
        "system_prompt": n * (z["system"] + z["question"]),
        "chat": z["users"] * sum(first + k * later for k in range(z["turns"])),
        "few_shot": n * (z["header"] + z["shot_question"]),
        "no_prefix": n * (z["system"] + z["question"]),
    }
    out = {
        "system_prompt": n * z["answer"],
        "chat": z["users"] * z["turns"] * z["chat_answer"],
        "few_shot": n * z["shot_answer"],
        "no_prefix": n * z["answer"],
    }
    for w, res in r["workloads"].items():
        assert res["same_tokens"] is True, w
        for setting in ("on", "off"):
            f = res[setting]
            for key in ("ttft_p50_s", "ttft_p99_s", "output_tok_s", "wall_s", "evictions"):
                assert key in f, (w, setting, key)
            assert f["prompt_tokens"] == prompt[w] and f["output_tokens"] == out[w], (w, setting)
            assert f["prefill_tokens_computed"] == f["prompt_tokens"] - f["cached_tokens"]
            assert f["hit_rate"] == round(f["cached_tokens"] / f["prompt_tokens"], 4)
            assert f["output_tok_s"] == pytest.approx(f["output_tokens"] / f["wall_s"], rel=1e-3)
        assert res["off"]["cached_tokens"] == 0, w
        assert set(res["ratio_on_vs_off"]) >= {"ttft_p50_off_over_on", "output_tok_s_on_over_off"}
    cached = {w: res["on"]["cached_tokens"] for w, res in r["workloads"].items()}
    assert 0 < cached["system_prompt"] <= (n - 1) * 24, cached  # 3 full pages of 8
    assert 0 < cached["few_shot"] <= (n - 1) * 16, cached  # 20 // 8 = 2 full pages
    assert cached["chat"] > 0 and cached["no_prefix"] == 0, cached


def test_bench_peers_skip_and_ratios(results_dir, monkeypatch, capfd, torch_threads):
    """bench_peers in seconds: with only llama.cpp asked for and llama-cpp-python absent, one
    JSON line whose llama.cpp entry says why it was skipped, with host and load fields; then its
    rate and ratio arithmetic on hand-made runs (500 tokens in 100 s and in 40 s: 5 and 12.5
    tok/s, 2.5x; 400 of 500 tokens in 50 s flagged short, 1.6x), a failed run left without
    figures."""
    import importlib.util

    s = run_script("bench_peers", results_dir, capfd, "--engines", "llama_cpp")
    assert s["quick"] is True and s["model"] == "stories260K" and s["engines"] == {}
    assert s["cpu_model"] and len(s["loadavg_before"]) == 3 and len(s["loadavg_after"]) == 3
    assert s["workload"]["num_prompts"] == 8 and s["decode_batch1"] is None
    if importlib.util.find_spec("llama_cpp") is None:
        assert "not importable" in s["skipped"]["llama_cpp"]
    else:  # installed but no --gguf given
        assert "--gguf" in s["skipped"]["llama_cpp"]

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import bench_peers

    runs = {
        "hf_generate": {"wall_s": 100.0, "output_tokens": 500},
        "jaxinfer_cold": {"wall_s": 40.0, "output_tokens": 500},
        "llama_cpp": {"wall_s": 50.0, "output_tokens": 400},  # 100 tokens short
        "hf_generate_batch": {"error": "exit code 1", "output_tokens": None},
    }
    bench_peers.finish(runs, 500)
    assert runs["hf_generate"]["output_tok_s"] == 5.0
    assert runs["hf_generate"]["vs_hf_generate"] == 1.0
    assert runs["jaxinfer_cold"]["output_tok_s"] == 12.5
    assert runs["jaxinfer_cold"]["vs_hf_generate"] == 2.5
    assert runs["jaxinfer_cold"]["same_tokens_as_requested"] is True
    assert runs["llama_cpp"]["same_tokens_as_requested"] is False
    assert runs["llama_cpp"]["vs_hf_generate"] == 1.6  # 8 tok/s over 5
    assert "output_tok_s" not in runs["hf_generate_batch"]
    monkeypatch.setattr(sys, "argv", ["bench_peers.py", "--engines", "jaxinfer,vllm"])
    with pytest.raises(SystemExit) as e:  # an unknown engine is refused, by name, before any run
        bench_peers.main()
    assert e.value.code == 2 and "'vllm'" in capfd.readouterr().err


def test_random_moe_checkpoint(tmp_path, monkeypatch, torch_threads):
    """The benchmarks' random Qwen3-MoE (``qwen3moe_tiny`` through ``benchlib.resolve_model``):
    transformers loads it as Qwen3-MoE with the declared shape and counts as many parameters as
    ``moe_models.param_counts`` works out from the shapes; its routing is decisive (the gap
    between each token's A-th and (A+1)-th router logit, from transformers' own router, well
    above f32 rounding); and the engine's greedy tokens equal transformers' ``generate``."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import benchlib
    import moe_models

    monkeypatch.setattr(benchlib, "CACHE", tmp_path)
    path, vocab, hf_dir = benchlib.resolve_model("qwen3moe_tiny", hf=True)
    assert path == hf_dir == tmp_path / "bench" / "qwen3moe_tiny" and vocab == 512
    spec = moe_models.RANDOM_QWEN3_MOES["qwen3moe_tiny"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    c = model.config
    assert c.model_type == "qwen3_moe" and c.num_experts == spec["E"] and not c.mlp_only_layers
    assert c.num_experts_per_tok == spec["A"] and c.moe_intermediate_size == spec["I"]
    assert model.num_parameters() == moe_models.param_counts("qwen3moe_tiny")["total"]
    prompt = [1, 17, 301, 44, 5, 260, 99, 410, 7, 23]
    with torch.no_grad():
        out = model(torch.tensor([prompt]), output_router_logits=True)
    for logits in out.router_logits:  # [T, E] per layer
        top = np.sort(logits.float().numpy(), axis=-1)[:, ::-1]
        assert 1.0 < top.std(axis=-1).mean() < 4.0  # ROUTER_SPREAD 2
        assert (top[:, spec["A"] - 1] - top[:, spec["A"]]).min() > 1e-3
    want = model.generate(  # min_new_tokens: EOS (2) suppressed, as ignore_eos
        torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()

    from jaxinfer import LLM, SamplingParams

    # layers in lax.scan (compiles faster; the unrolled CPU default runs MoE models elsewhere)
    llm = LLM(str(path), dtype="float32", max_model_len=64, unroll_layers=False)
    got = llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    )
    assert got[0].outputs[0].token_ids == want


# Records shaped as bench_roofline.py and bench_serving.py write them (keys checked above), with
# numbers chosen here, so the plot is checked against known data whatever ran on this worker.
ROOFLINE = {
    "bench": "roofline",
    "results": [
        {
            "model": "tiny",
            "dtype": "float32",
            "quantization": q,
            "decode": [
                {"batch": b, "tok_s": k * 100.0 * b**0.7, "roofline_tok_s": k * 400.0 * b}
                for b in (8, 1, 4, 2)
            ],
        }  # unsorted: the plot sorts by batch
        for q, k in ((None, 1.0), ("int8", 2.0))
    ],
}
STATS = lambda m: {"mean": m, "p50": 0.8 * m, "p99": 3.0 * m}  # noqa: E731
SERVING = {
    "bench": "serving",
    "results": [
        {
            "model": "tiny",
            "engine": {"dtype": "float32", "ttft_s": STATS(0.02), "tpot_s": STATS(0.004)},
            "hf": {"float32": {"ttft_s": STATS(0.5), "tpot_s": STATS(0.03)}},
        }
    ],
}


class _KeepFigures:
    """``pyplot`` for plot_bench's functions, keeping each figure open to be inspected."""

    def __init__(self, plt):
        self.plt, self.figures = plt, []

    def subplots(self, *args, **kwargs):
        fig, axes = self.plt.subplots(*args, **kwargs)
        self.figures.append(fig)
        return fig, axes

    def close(self, fig):
        pass


def _color_pixels(png: Path, color: str) -> int:
    """Pixels of ``png`` within 0.02 of ``color`` in every RGB channel."""
    import matplotlib.colors
    import matplotlib.image
    import numpy as np

    img = matplotlib.image.imread(png)[..., :3]
    return int(np.all(np.abs(img - np.asarray(matplotlib.colors.to_rgb(color))) < 0.02, -1).sum())


def test_plot(tmp_path, monkeypatch, capfd):
    """plot_bench on records written here: both PNGs, the lines and bars carry the records'
    numbers, and the images hold the drawn series, not only axes and legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (tmp_path / "bench_roofline.jsonl").write_text(json.dumps(ROOFLINE) + '\n{"cut')
    (tmp_path / "bench_serving.jsonl").write_text(
        json.dumps({"results": []}) + "\n" + json.dumps(SERVING) + "\n"
    )
    s = run_script("plot_bench", tmp_path, capfd)
    pngs = [tmp_path / "throughput_vs_batch.png", tmp_path / "latency_percentiles.png"]
    assert s["written"] == [str(p) for p in pngs]
    # The first series' colour (C0: the float32 throughput line, the mean bars) covers far more
    # than legend swatches and markers alone: measured 1457 and 26899 pixels drawn, 102 and 368
    # with the line's data or the bars' heights left out.
    assert _color_pixels(pngs[0], "C0") > 700
    assert _color_pixels(pngs[1], "C0") > 5000

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import plot_bench

    keep = _KeepFigures(plt)
    assert plot_bench.plot_throughput(
        plot_bench.read_jsonl(tmp_path / "bench_roofline.jsonl"), tmp_path / "t.png", keep
    )
    assert plot_bench.plot_latency(
        plot_bench.read_jsonl(tmp_path / "bench_serving.jsonl"), tmp_path / "l.png", keep
    )
    (ax,), axes = keep.figures[0].axes, keep.figures[1].axes
    drawn = {line.get_label(): line.get_xydata().tolist() for line in ax.lines}
    want = {}
    for r in ROOFLINE["results"]:
        label = f"tiny {r['quantization'] or 'float32'}"
        rows = sorted(r["decode"], key=lambda x: x["batch"])
        want[label] = [[x["batch"], x["tok_s"]] for x in rows]
        want[f"{label} roofline"] = [[x["batch"], x["roofline_tok_s"]] for x in rows]
    assert drawn == want
    # Bars: per panel (TTFT, TPOT), per statistic, the engine's then transformers' value.
    res = SERVING["results"][0]
    for panel, key in zip(axes, ("ttft_s", "tpot_s"), strict=True):
        heights = [[b.get_height() for b in c] for c in panel.containers]
        assert heights == [
            [res["engine"][key][st], res["hf"]["float32"][key][st]] for st in ("mean", "p50", "p99")
        ]
    for fig in keep.figures:
        plt.close(fig)


def _serve_rates(ttft_p99: dict, tok_s: float) -> list[dict]:
    return [
        {
            "rate": r,
            "failures": 0,
            "output_tok_s": tok_s * (i + 1),
            "ttft_s": {"p50": p99 / 4, "p99": p99},
        }
        for i, (r, p99) in enumerate(ttft_p99.items())
    ]


def test_serve_ttft_rates_and_plot(tmp_path, monkeypatch):
    """bench_serve's TTFT-p99 rates on hand-made passes (a pass over the limit, or with a
    failure, ends the run of rates that count), and plot_bench's latency-vs-rate figure: one
    row per model, its lines the records' numbers in rate order (``inf`` last)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import bench_serve
    import plot_bench

    rates = _serve_rates({"inf": 9.0, 8.0: 0.5, 1.0: 0.2, 4.0: 3.0, 2.0: 0.8}, 100.0)
    assert bench_serve.ttft_p99_rates(rates) == {"under_1s": 2.0, "under_5s": 8.0}
    rates[3]["failures"] = 1  # rate 4: a failure ends the run for both limits
    assert bench_serve.ttft_p99_rates(rates) == {"under_1s": 2.0, "under_5s": 2.0}
    assert bench_serve.ttft_p99_rates(_serve_rates({1.0: 2.0}, 1.0))["under_1s"] is None

    def record(model, n):
        return {
            "bench": "bench_serve",
            "model": model,
            "num_prompts": n,
            "servers": {
                "jaxinfer": {"rates": _serve_rates({"inf": 2.0, 1.0: 0.1, 4.0: 0.4}, 300.0)},
                "transformers": {"rates": _serve_rates({"inf": 3.0, 1.0: 0.02, 4.0: 0.05}, 100.0)},
            },
        }

    lines = [record("stories260K", 100), record("llama110m", 32), record("stories260K", 16)]
    (tmp_path / "bench_serve.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    recs = plot_bench.latest_serve_records(plot_bench.read_jsonl(tmp_path / "bench_serve.jsonl"))
    assert recs == lines[:2]  # the --quick record (16 prompts) is skipped
    keep = _KeepFigures(plt)
    assert plot_bench.plot_serve(recs, tmp_path / "s.png", keep)
    axes = keep.figures[0].axes
    assert len(axes) == 4
    for row, rec in enumerate(recs):
        ttft, tput = axes[2 * row], axes[2 * row + 1]
        for name, srv in rec["servers"].items():
            by = sorted(srv["rates"], key=lambda r: float(r["rate"]))  # "inf" sorts last
            got = {x.get_label(): x.get_xydata().tolist() for x in ttft.lines}
            assert got[f"{name} p99"] == [[i, r["ttft_s"]["p99"]] for i, r in enumerate(by)]
            assert got[f"{name} p50"] == [[i, r["ttft_s"]["p50"]] for i, r in enumerate(by)]
            got = {x.get_label(): x.get_xydata().tolist() for x in tput.lines}
            assert got[name] == [[i, r["output_tok_s"]] for i, r in enumerate(by)]
        assert [t.get_text() for t in ttft.get_xticklabels()] == ["1", "4", "inf"]
    plt.close(keep.figures[0])
    monkeypatch.setattr(
        sys,
        "argv",
        ["plot_bench", "--results-dir", str(tmp_path), "--serve-png", str(tmp_path / "serve.png")],
    )
    plot_bench.main()  # in-process: the CLI path without a second interpreter's imports
    rec = json.loads((tmp_path / "plot_bench.jsonl").read_text().splitlines()[-1])
    assert rec["written"] == [str(tmp_path / "serve.png")]
    assert (tmp_path / "serve.png").stat().st_size < 100_000
    assert _color_pixels(tmp_path / "serve.png", "C1") > 300


@pytest.mark.parametrize(
    "rates, why",
    [("abc", "comma-separated numbers"), ("1,-2", "> 0"), ("0", "> 0"), ("nan", "> 0")],
)
def test_bench_serve_refuses_bad_request_rates(rates, why):
    """A bad --request-rates is a usage error (exit 2, naming the flag), not a traceback."""
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_serve.py"
    r = subprocess.run(
        [sys.executable, str(script), "--request-rates", rates],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--request-rates" in r.stderr and why in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_bench_serve_times_tokens_not_text(monkeypatch):
    """bench_serve's per-request timings from hand-made chunk arrivals: with continuous usage
    a chunk whose tokens add no text is a step; without it (transformers serve) only text
    chunks are, and the usage in its last chunk is the final count, not a step."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import bench_serve

    def ch(text, usage=None, finish=None):
        return {"choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": usage}

    def u(n):
        return {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n}

    ev = [
        (1.0, ch("", u(1))),
        (1.5, ch("ab", u(3))),
        (2.0, ch("", u(3), "length")),
        (2.1, {"choices": [], "usage": u(3)}),
    ]
    got = bench_serve.request_timings(0.5, 2.5, ev, continuous=True)
    assert got == {
        "ttft": 0.5,
        "e2e": 2.0,
        "out": 3,
        "tpot": 0.25,
        "itl": [0.5],
        "signal": "usage",
        "token_chunks": 2,
    }
    got = bench_serve.request_timings(0.5, 2.5, ev, continuous=False)  # text chunks only
    assert got == {
        "ttft": 1.0,
        "e2e": 2.0,
        "out": 3,
        "tpot": 0.0,
        "itl": [],
        "signal": "text",
        "token_chunks": 1,
    }
    ev = [(1.0, ch("x")), (1.25, ch("")), (1.5, ch("y")), (3.0, ch("", u(5), "length"))]
    got = bench_serve.request_timings(0.0, 3.0, ev, continuous=False)
    assert got == {
        "ttft": 1.0,
        "e2e": 3.0,
        "out": 5,
        "tpot": 0.125,
        "itl": [0.5],
        "signal": "text",
        "token_chunks": 2,
    }
    got = bench_serve.request_timings(0.0, 3.0, ev[-1:], continuous=False)
    assert got["ttft"] is None and got["out"] == 5 and got["token_chunks"] == 0


def test_bench_serve_full_vocab_tokenizer(tmp_path, monkeypatch):
    """The 512-piece tokenizer extended to a random Llama's vocabulary: every added id decodes
    to its own non-empty text, the original ids and prompt tokenizations are unchanged (judged
    by SentencePiece on the original model), and a vocabulary below the model is refused."""
    import sentencepiece

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import bench_serve_models

    src = bench_serve_models.STORIES / "tok512.model"
    bench_serve_models.full_vocab_tokenizer(src, 1000, tmp_path / "t.model")
    a = sentencepiece.SentencePieceProcessor(model_file=str(src))
    f = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "t.model"))
    assert f.get_piece_size() == 1000
    assert [f.decode([i]) for i in (512, 999)] == ["\u27e8512\u27e9", "\u27e8999\u27e9"]
    assert [f.id_to_piece(i) for i in range(512)] == [a.id_to_piece(i) for i in range(512)]
    text = a.decode(list(range(3, 512)))
    assert f.encode(text) == a.encode(text)
    with pytest.raises(ValueError, match="512 pieces"):
        bench_serve_models.full_vocab_tokenizer(src, 300, tmp_path / "u.model")
