"""Smoke tests of the benchmark scripts: each runs with ``--quick`` in a subprocess and emits one
well-formed JSON summary with its expected keys (speed is never asserted here); plot_bench draws
records written by the test, checked in its figures' data and its PNGs' pixels."""

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
}


def run_script(name: str, results_dir: Path, *extra: str) -> dict:
    p = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / f"{name}.py"),
            "--quick",
            "--results-dir",
            str(results_dir),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [x for x in p.stdout.splitlines() if x.strip()]
    assert len(lines) == 1, p.stdout  # one JSON line on stdout, nothing else
    summary = json.loads(lines[0])
    recorded = (results_dir / f"{name}.jsonl").read_text().splitlines()
    assert json.loads(recorded[-1]) == summary
    return summary


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("results")


@pytest.mark.parametrize("name", list(CASES))
def test_quick_emits_json(name, results_dir):
    s = run_script(name, results_dir)
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


# Records shaped as bench_roofline.py and bench_serving.py write them (keys checked above), with
# numbers chosen here, so the plot is checked against known data whatever ran on this worker.
ROOFLINE = {"bench": "roofline", "results": [
    {"model": "tiny", "dtype": "float32", "quantization": q,
     "decode": [{"batch": b, "tok_s": k * 100.0 * b**0.7, "roofline_tok_s": k * 400.0 * b}
                for b in (8, 1, 4, 2)]}  # unsorted: the plot sorts by batch
    for q, k in ((None, 1.0), ("int8", 2.0))]}
STATS = lambda m: {"mean": m, "p50": 0.8 * m, "p99": 3.0 * m}  # noqa: E731
SERVING = {"bench": "serving", "results": [
    {"model": "tiny", "engine": {"dtype": "float32", "ttft_s": STATS(0.02), "tpot_s": STATS(0.004)},
     "hf": {"float32": {"ttft_s": STATS(0.5), "tpot_s": STATS(0.03)}}}]}


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


def test_plot(tmp_path, monkeypatch):
    """plot_bench on records written here: both PNGs, the lines and bars carry the records'
    numbers, and the images hold the drawn series, not only axes and legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (tmp_path / "bench_roofline.jsonl").write_text(json.dumps(ROOFLINE) + "\n{\"cut")
    (tmp_path / "bench_serving.jsonl").write_text(json.dumps({"results": []}) + "\n"
                                                    + json.dumps(SERVING) + "\n")
    s = run_script("plot_bench", tmp_path)
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
    assert plot_bench.plot_throughput(plot_bench.read_jsonl(tmp_path / "bench_roofline.jsonl"),
                                      tmp_path / "t.png", keep)
    assert plot_bench.plot_latency(plot_bench.read_jsonl(tmp_path / "bench_serving.jsonl"),
                                   tmp_path / "l.png", keep)
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
        assert heights == [[res["engine"][key][st], res["hf"]["float32"][key][st]]
                           for st in ("mean", "p50", "p99")]
    for fig in keep.figures:
        plt.close(fig)
