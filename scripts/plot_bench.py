"""Draws the benchmark results as PNG: decode throughput vs batch size, and latency percentiles.

    python scripts/plot_bench.py                   # reads results/*.jsonl, writes results/*.png
    python scripts/plot_bench.py --results-dir /tmp/results

- ``throughput_vs_batch.png``: from the latest ``bench_roofline.jsonl`` record of each
  (model, quantization): decode tokens/s per batch size (log-log), measured (solid) and the
  roofline (dashed). Run ``bench_roofline.py --sweep`` for batch sizes 1, 2, 4, ..., 64.
- ``latency_percentiles.png``: from the latest ``bench_serving.jsonl`` record: TTFT and TPOT
  (mean, p50, p99) of the engine and of transformers per model (log scale).
- ``--serve-png PATH``: from ``bench_serve.jsonl``, the latest record with measured rates of each
  model (``--serve-models``): TTFT p50 and p99 vs request rate (log scale, ``inf`` last) and
  output tokens/s vs rate, one line per server, one row per model.

Prints one JSON line (the files written) and appends it to ``results/plot_bench.jsonl``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchlib import add_common_args, emit


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by an interrupted run
    return out


def plot_throughput(records: list[dict], out: Path, plt) -> bool:
    """Latest record per (model, dtype, quantization); True if something was drawn."""
    latest: dict[tuple, dict] = {}
    for rec in records:
        for r in rec.get("results", []):
            latest[(r["model"], r.get("dtype"), r.get("quantization"))] = r
    if not latest:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (model, dtype, quant), r in sorted(latest.items(), key=lambda kv: str(kv[0])):
        rows = sorted(r["decode"], key=lambda x: x["batch"])
        xs = [x["batch"] for x in rows]
        label = f"{model} {quant or dtype}"
        (line,) = ax.plot(xs, [x["tok_s"] for x in rows], marker="o", label=label)
        ax.plot(
            xs,
            [x["roofline_tok_s"] for x in rows],
            ls="--",
            color=line.get_color(),
            alpha=0.6,
            label=f"{label} roofline",
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="decode batch size (sequences)",
        ylabel="decode tokens/s",
        title="Decode throughput vs batch size",
    )
    ax.set_xscale("log", base=2)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return True


def plot_latency(records: list[dict], out: Path, plt) -> bool:
    if not records or not records[-1].get("results"):
        return False
    rec = records[-1]
    systems = []  # (label, ttft stats, tpot stats)
    for r in rec["results"]:
        systems.append(
            (
                f"{r['model']}\nengine {r['engine']['dtype']}",
                r["engine"]["ttft_s"],
                r["engine"]["tpot_s"],
            )
        )
        for dt, h in r.get("hf", {}).items():
            systems.append((f"{r['model']}\nHF {dt}", h["ttft_s"], h["tpot_s"]))
    fig, axes = plt.subplots(1, 2, figsize=(max(7, 1.3 * len(systems) + 3), 4.5))
    width = 0.27
    for ax, idx, name in ((axes[0], 1, "TTFT"), (axes[1], 2, "TPOT")):
        for k, stat in enumerate(("mean", "p50", "p99")):
            xs = [i + (k - 1) * width for i in range(len(systems))]
            ax.bar(xs, [s[idx][stat] or 0 for s in systems], width, label=stat)
        ax.set_xticks(range(len(systems)), [s[0] for s in systems], fontsize=7)
        ax.set(yscale="log", ylabel="seconds", title=f"{name} (all requests arrive at t=0)")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return True


def _rate_key(rate) -> float:
    return float("inf") if rate == "inf" else float(rate)


def latest_serve_records(records: list[dict], models: list[str] | None = None) -> list[dict]:
    """The latest ``bench_serve`` record with measured rates per model (in ``models`` order, or
    first-seen order), skipping ``--quick`` smoke runs (fewer than 30 prompts)."""
    latest: dict[str, dict] = {}
    for rec in records:
        if rec.get("num_prompts", 0) < 30:
            continue
        if any(srv.get("rates") for srv in rec.get("servers", {}).values()):
            latest[rec.get("model", "stories260K")] = rec
    order = models or list(latest)
    return [latest[m] for m in order if m in latest]


def plot_serve(records: list[dict], out: Path, plt) -> bool:
    """Latency and throughput vs request rate (``bench_serve``); True if something was drawn."""
    if not records:
        return False
    fig, axes = plt.subplots(len(records), 2, figsize=(8.5, 2.9 * len(records)), squeeze=False)
    for row, rec in zip(axes, records, strict=True):
        model = rec.get("model", "stories260K")
        for k, (name, srv) in enumerate(sorted(rec["servers"].items())):
            rates = sorted(srv.get("rates", []), key=lambda r: _rate_key(r["rate"]))
            if not rates:
                continue
            xs = list(range(len(rates)))
            color = f"C{k}"
            row[0].plot(
                xs,
                [r["ttft_s"]["p50"] for r in rates],
                marker="o",
                color=color,
                label=f"{name} p50",
            )
            row[0].plot(
                xs,
                [r["ttft_s"]["p99"] for r in rates],
                marker="^",
                ls="--",
                color=color,
                label=f"{name} p99",
            )
            row[1].plot(xs, [r["output_tok_s"] for r in rates], marker="o", color=color, label=name)
            for ax in row:
                ax.set_xticks(xs, [str(r["rate"]).removesuffix(".0") for r in rates])
        row[0].axhline(1.0, color="grey", lw=0.8, ls=":")
        row[0].set(
            yscale="log",
            xlabel="request rate (req/s)",
            ylabel="TTFT (s)",
            title=f"{model}: time to first token",
        )
        row[1].set(
            xlabel="request rate (req/s)",
            ylabel="output tokens/s",
            title=f"{model}: output throughput",
        )
        for ax in row:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(ap)
    ap.add_argument(
        "--serve-png",
        default=None,
        metavar="PATH",
        help="also draw bench_serve's latency-vs-rate figure to PATH",
    )
    ap.add_argument(
        "--serve-models",
        default=None,
        help="comma list of models for --serve-png (default: every model measured)",
    )
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = Path(args.results_dir)
    d.mkdir(parents=True, exist_ok=True)
    written = []
    if plot_throughput(read_jsonl(d / "bench_roofline.jsonl"), d / "throughput_vs_batch.png", plt):
        written.append(str(d / "throughput_vs_batch.png"))
    if plot_latency(read_jsonl(d / "bench_serving.jsonl"), d / "latency_percentiles.png", plt):
        written.append(str(d / "latency_percentiles.png"))
    if args.serve_png:
        models = args.serve_models.split(",") if args.serve_models else None
        recs = latest_serve_records(read_jsonl(d / "bench_serve.jsonl"), models)
        if plot_serve(recs, Path(args.serve_png), plt):
            written.append(args.serve_png)
    emit({"bench": "plot", "written": written}, "plot_bench", args.results_dir)


if __name__ == "__main__":
    main()
