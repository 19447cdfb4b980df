"""Prometheus metrics of the server (``GET /metrics``), named in vLLM's style (``jaxinfer:...``).

Engine state is read when scraped (a collector): ``num_requests_running``,
``num_requests_waiting`` (engine queues plus requests not yet handed to the engine),
``num_kv_pages_used`` / ``num_kv_pages_total`` / ``kv_cache_usage_perc`` (pages held by
sequences over the pool, page 0 reserved; cached pages no sequence holds are free, as vLLM),
``num_kv_pages_cached``, ``num_preemptions_total``, ``num_compilations`` (step shapes compiled so
far: flat once the server is warm), and the prefix cache's
``prefix_cache_queries_total`` / ``prefix_cache_hits_total`` (prompt tokens) and
``prefix_cache_hit_rate`` (from ``LLM.prefix_cache_stats()``; 0 when the LLM has none).
Per-request figures are counted as each request finishes: ``prompt_tokens_total``,
``generation_tokens_total``, ``request_success_total{finished_reason}``, and the histograms
``time_to_first_token_seconds``, ``time_per_output_token_seconds``,
``e2e_request_latency_seconds`` (the engine's ``RequestMetrics``). Every metric has the
``model_name`` label. One registry per app, so several servers can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxinfer.outputs import RequestOutput

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
E2E_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


class _EngineCollector:
    """Reads the engines' state at each scrape."""

    def __init__(self, llm, engine_thread, model_name: str):
        self.llm, self.thread, self.labels = llm, engine_thread, [model_name]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric(self.labels, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric(self.labels, value)
        return c

    def collect(self):
        engines = self.thread.engines
        running = sum(len(e.scheduler.running) for e in engines)
        waiting = sum(len(e.scheduler.waiting) for e in engines) + self.thread.num_queued()
        total = sum(e.kv_manager.num_pages - 1 for e in engines)  # page 0 is never handed out
        used = total - sum(e.kv_manager.num_free_pages for e in engines)
        yield self._gauge(
            "jaxinfer:num_requests_running", "Sequences in the running batch.", running
        )
        yield self._gauge("jaxinfer:num_requests_waiting", "Sequences waiting to run.", waiting)
        yield self._gauge(
            "jaxinfer:num_kv_pages_used",
            "KV pages held by sequences (cached pages no sequence holds count as free, as vLLM).",
            used,
        )
        yield self._gauge(
            "jaxinfer:num_kv_pages_total", "KV pages in the pool (less page 0).", total
        )
        yield self._gauge(
            "jaxinfer:kv_cache_usage_perc",
            "Fraction of KV pages held (0 to 1).",
            used / total if total else 0.0,
        )
        yield self._counter(
            "jaxinfer:num_preemptions",
            "Preemptions (sequences recomputed).",
            sum(e.scheduler.num_preemptions for e in engines),
        )
        yield self._gauge(
            "jaxinfer:num_compilations",
            "Device functions compiled so far (step "
            "shapes met, EngineCore.num_compilations; flat once warm).",
            sum(e.num_compilations for e in engines),
        )
        stats = prefix_cache_stats(self.llm)
        yield self._counter(
            "jaxinfer:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats["queried_tokens"],
        )
        yield self._counter(
            "jaxinfer:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            stats["hit_tokens"],
        )
        yield self._gauge(
            "jaxinfer:num_kv_pages_cached", "KV pages in the prefix cache.", stats["cached_pages"]
        )
        yield self._gauge(
            "jaxinfer:prefix_cache_hit_rate",
            "Prefix cache hits / queries (tokens) since start.",
            stats["hit_rate"],
        )


def prefix_cache_stats(llm) -> dict:
    """``llm.prefix_cache_stats()``, or zeros when this LLM has none."""
    zero = {
        "queried_tokens": 0,
        "hit_tokens": 0,
        "hit_rate": 0.0,
        "evictions": 0,
        "cached_pages": 0,
    }
    fn = getattr(llm, "prefix_cache_stats", None)
    return {**zero, **fn()} if fn is not None else zero


class ServerMetrics:
    """The app's registry: engine state read at scrape, request figures counted by ``finished``.

    Args:
        llm: the served ``LLM``.
        engine_thread: its ``AsyncEngine``.
        model_name: the served model name (``model_name`` label).
    """

    def __init__(self, llm, engine_thread, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(llm, engine_thread, model_name))
        lab = ["model_name"]
        self.prompt_tokens = Counter(
            "jaxinfer:prompt_tokens",
            "Prompt tokens of finished requests.",
            lab,
            registry=self.registry,
        ).labels(model_name)
        self.generation_tokens = Counter(
            "jaxinfer:generation_tokens",
            "Generated tokens of finished requests.",
            lab,
            registry=self.registry,
        ).labels(model_name)
        self._success = Counter(
            "jaxinfer:request_success",
            "Finished requests by finish reason.",
            lab + ["finished_reason"],
            registry=self.registry,
        )
        self.model_name = model_name
        self.ttft = Histogram(
            "jaxinfer:time_to_first_token_seconds",
            "Time to first token.",
            lab,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.tpot = Histogram(
            "jaxinfer:time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            lab,
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            "jaxinfer:e2e_request_latency_seconds",
            "Arrival to finish.",
            lab,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)

    def finished(self, out: RequestOutput, count_prompt: bool = True) -> None:
        """Counts one finished sequence (not an error); its prompt tokens only with
        ``count_prompt`` (one choice per prompt of a request with ``n`` > 1)."""
        m = out.metrics
        if count_prompt:
            self.prompt_tokens.inc(m.prompt_tokens)
        self.generation_tokens.inc(m.completion_tokens)
        self._success.labels(self.model_name, out.finish_reason).inc()
        if m.ttft_s is not None:
            self.ttft.observe(m.ttft_s)
        if m.tpot_s is not None and m.completion_tokens > 1:
            self.tpot.observe(m.tpot_s)
        if m.e2e_s is not None:
            self.e2e.observe(m.e2e_s)
