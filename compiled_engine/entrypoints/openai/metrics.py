"""`/metrics`: Prometheus metrics of one served engine (names follow vLLM's, prefixed
`compiled_engine:`).

Two sources. Request timing arrives from the engine thread through AsyncLLM's stats-listener
calls (prometheus_client's metrics are thread-safe). Engine state — running and waiting
requests, KV cache usage, preemptions, prefix-cache hits and speculative decoding's acceptance when
the engine reports them — is read
from `AsyncLLM.stats()` at scrape time by a custom collector, so it is never stale.
Each app gets its own registry: several servers in one process (tests) do not collide.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from compiled_engine.engine.async_llm import AsyncLLM, FinishedRequestStats

PREFIX = "compiled_engine:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds. TTFT spans a queued prefill; inter-token latency is one decode step.
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)

# Prefix-cache counters of EngineStats when the cache is on (tokens, like vLLM's).
_PREFIX_CACHE_COUNTERS = {
    "prefix_cache_queries": "Tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Tokens found in the prefix cache.",
}


class ServerMetrics:
    """A RequestStatsListener plus the engine-state collector, in one registry."""

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(PREFIX + name, doc, list(labels), buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.").labels(**labels)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(**labels)
        self._request_success = counter(
            "request_success", "Requests finished, by reason.", ("finished_reason",)
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS).labels(
            **labels
        )
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.", _ITL_BUCKETS).labels(
            **labels
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency.", _E2E_BUCKETS).labels(**labels)
        replicas = engine.replicas()
        if len(replicas) == 1:
            self.registry.register(_EngineStateCollector(partial(_replica, engine, 0), labels))
        else:
            # Data parallel: each replica's state under its `engine` label (vLLM's), read from
            # whichever process serves as that replica now (a restart replaces it).
            for index in range(len(replicas)):
                self.registry.register(
                    _EngineStateCollector(partial(_replica, engine, index), {**labels, "engine": str(index)})
                )

    # RequestStatsListener (called on the engine thread)
    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_new_tokens(self, num_tokens: int, inter_token_s: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        if inter_token_s is not None:
            self.itl.observe(inter_token_s)

    def on_finished(self, stats: FinishedRequestStats) -> None:
        self._request_success.labels(**self._labels, finished_reason=stats.finish_reason).inc()
        self.e2e.observe(stats.total_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _replica(engine: AsyncLLM, index: int) -> AsyncLLM | None:
    return engine.replicas()[index]


class _EngineStateCollector:
    def __init__(self, engine: Callable[[], AsyncLLM | None], labels: dict[str, str]) -> None:
        self._engine = engine
        self._labels = labels

    def collect(self):
        engine = self._engine()
        names, values = list(self._labels), list(self._labels.values())
        if engine is None:  # a data-parallel replica being restarted
            doc = "1 while the engine loop runs, 0 once it failed."
            family = GaugeMetricFamily(PREFIX + "engine_healthy", doc, labels=names)
            family.add_metric(values, 0)
            yield family
            return
        stats = engine.stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=names)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=names)
            family.add_metric(values, value)
            return family

        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting)
        used = stats.num_kv_blocks - stats.num_free_kv_blocks
        yield gauge(
            "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", used / stats.num_kv_blocks
        )
        yield gauge("num_kv_blocks", "KV cache blocks in all.", stats.num_kv_blocks)
        yield counter("num_preemptions", "Requests preempted (recomputed later).", stats.num_preemptions)
        yield gauge(
            "engine_healthy",
            "1 while the engine loop runs, 0 once it failed.",
            0 if engine.errored else 1,
        )
        graphs = engine.graph_status()
        family = GaugeMetricFamily(
            PREFIX + "graphs",
            "Compiled step graphs by state: ready, compiled (loaded on first use), compiling, queued, "
            "failed, on_demand (built by the first step that needs it).",
            labels=[*names, "state"],
        )
        for state in ("ready", "compiled", "compiling", "queued", "failed", "on_demand"):
            family.add_metric([*values, state], getattr(graphs, state))
        yield family
        yield counter(
            "graph_wait_steps",
            "Steps that waited on the request path for their graph to compile or load.",
            len(stats.graph_waits),
        )
        yield counter(
            "graph_wait_seconds",
            "Seconds steps waited on the request path for their graphs to compile or load.",
            sum(w.seconds for w in stats.graph_waits),
        )
        yield counter(
            "graph_fallback_steps",
            "Steps run on a fallback graph while theirs compiled in the background.",
            stats.num_fallback_steps,
        )
        if stats.prefix_caching:  # an engine run without the cache reports none
            for field, doc in _PREFIX_CACHE_COUNTERS.items():
                yield counter(field, doc, getattr(stats, field))
            yield gauge(
                "prefix_cache_hit_rate",
                "Share of looked-up prompt tokens found cached, over the engine's life.",
                stats.prefix_cache_hit_rate,
            )
        if stats.speculative:  # an engine run without speculative decoding reports none
            yield counter(
                "spec_decode_num_drafts", "Request-steps that verified proposed tokens.", stats.num_spec_steps
            )
            yield counter("spec_decode_num_draft_tokens", "Proposed tokens verified.", stats.num_draft_tokens)
            yield counter(
                "spec_decode_num_accepted_tokens",
                "Proposed tokens accepted.",
                stats.num_accepted_draft_tokens,
            )
            yield gauge(
                "spec_decode_acceptance_rate",
                "Share of proposed tokens accepted, over the engine's life.",
                stats.spec_acceptance_rate,
            )
            yield gauge(
                "spec_decode_mean_accepted_length",
                "Tokens emitted per request-step with proposals (accepted ones plus the target's own).",
                stats.spec_mean_accepted_length,
            )
