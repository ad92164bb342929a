"""Prometheus metrics of one server (own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, stats_fn):
        self.registry = r = CollectorRegistry()
        self.stats_fn = stats_fn  # -> LLMEngine.stats() dict
        self.requests = Counter("jaxserve_requests", "finished requests", ["finish_reason"], registry=r)
        self.errors = Counter("jaxserve_request_errors", "requests refused with an error", ["status"], registry=r)
        self.prompt_tokens = Counter("jaxserve_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("jaxserve_cached_prompt_tokens", "prompt tokens served from the prefix cache",
                                     registry=r)
        self.generation_tokens = Counter("jaxserve_generation_tokens", "generated tokens", registry=r)
        self.ttft = Histogram("jaxserve_time_to_first_token_seconds", "time to first token", buckets=_LAT, registry=r)
        self.tpot = Histogram("jaxserve_time_per_output_token_seconds", "time per output token after the first",
                              buckets=_LAT, registry=r)
        self.e2e = Histogram("jaxserve_e2e_request_latency_seconds", "request latency", buckets=_LAT, registry=r)
        g = {}
        for name, doc in [("waiting", "requests queued"), ("running", "requests holding a decode slot"),
                          ("blocks_total", "cache blocks in the pool"), ("blocks_used", "cache blocks referenced"),
                          ("blocks_free", "cache blocks free or evictable"),
                          ("prefix_hit_rate", "prompt tokens served from the prefix cache / prompt tokens"),
                          ("compiled_programs", "distinct step programs compiled (bucketed shapes)"),
                          ("preemptions", "requests preempted for recompute so far")]:
            g[name] = Gauge(f"jaxserve_{name}", doc, registry=r)
        self.gauges = g

    def observe_finished(self, seq) -> None:
        """Called on the engine thread for every finished sequence."""
        self.requests.labels(seq.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(seq.prompt))
        self.cached_tokens.inc(seq.num_cached)
        self.generation_tokens.inc(len(seq.output))
        if seq.first_token_time is not None:
            self.ttft.observe(seq.first_token_time - seq.arrival)
            if seq.finish_time is not None and len(seq.output) > 1:
                self.tpot.observe((seq.finish_time - seq.first_token_time) / (len(seq.output) - 1))
        if seq.finish_time is not None:
            self.e2e.observe(seq.finish_time - seq.arrival)

    def render(self) -> bytes:
        # gauges read plain ints / floats the engine thread writes; a scrape may be one step stale
        for k, v in self.stats_fn().items():
            if k in self.gauges:
                self.gauges[k].set(v)
        return generate_latest(self.registry)
