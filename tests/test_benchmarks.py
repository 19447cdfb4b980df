"""Smoke tests of the benchmark scripts: each runs with ``--quick`` in a subprocess and emits one
well-formed JSON summary with its expected keys (speed is never asserted here)."""

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


def test_plot(results_dir):
    """Runs after the others (file order): draws whatever results the quick runs left."""
    s = run_script("plot_bench", results_dir)
    assert "written" in s
    for f in s["written"]:
        assert Path(f).stat().st_size > 0
