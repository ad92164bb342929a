"""Prometheus metrics of one server (own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, stats_fn, cluster_fn=None):
        """stats_fn: -> LLMEngine.stats()-shaped dict; cluster_fn: -> {"instances": registry state, "links":
        {name: link snapshot}, "kv_bytes_transferred", "retries", "routes": {route: requests}, "policy": {key:
        number}, "index", "prefix_moves" and "store_puts": {"done", "failed", "bytes"}} when serving a cluster
        (router/cluster.py metrics_state)."""
        self.registry = r = CollectorRegistry()
        self.stats_fn = stats_fn
        self.cluster_fn = cluster_fn
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
                          ("preemptions", "requests preempted for recompute so far"),
                          ("kernel_fallbacks", "Pallas kernels running as their jnp references after failing the "
                           "start-up self-test on this device")]:
            g[name] = Gauge(f"jaxserve_{name}", doc, registry=r)
        self.gauges = g
        self.cluster = {
            "up": Gauge("jaxserve_instance_up", "1 while the router counts the instance up", ["instance", "role"],
                        registry=r),
            "inflight": Gauge("jaxserve_instance_inflight", "requests the router has on the instance", ["instance"],
                              registry=r),
            "kv_bytes": Gauge("jaxserve_kv_bytes_transferred", "KV bytes acknowledged by decode instances so far",
                              registry=r),
            "retries": Gauge("jaxserve_router_retries", "requests placed again after a worker or transfer failure",
                             registry=r),
            "routes": Gauge("jaxserve_route_requests", "requests finished per route (colocated, pd, prfaas)",
                            ["route"], registry=r),
            "prefix_moves": Gauge("jaxserve_prefix_moves", "cached prefixes moved between instances so far "
                                  "(outcome done / failed)", ["outcome"], registry=r),
            "prefix_move_bytes": Gauge("jaxserve_prefix_move_bytes", "KV bytes of the cached prefixes moved so far",
                                       registry=r),
            "store_puts": Gauge("jaxserve_store_puts", "prompts written to the global KV store so far (outcome done "
                                "/ failed; streamed: those done as the prefill computed them)", ["outcome"],
                                registry=r),
            "store_put_bytes": Gauge("jaxserve_store_put_bytes", "KV bytes written to the global KV store so far",
                                     registry=r),
            "index": Gauge("jaxserve_kv_index", "the global KV index: instances synced, blocks, snapshots, "
                           "resyncs so far", ["what"], registry=r)}
        self.policy: dict[str, Gauge] = {}  # jaxserve_policy_<key>, made as the policy reports keys
        self.links = {k: Gauge(f"jaxserve_link_{k}", doc, ["link"], registry=r) for k, doc in [
            ("bytes_sent", "KV bytes sent on a link so far"), ("throughput_bytes_s", "recent KV throughput of a link"),
            ("bandwidth_bytes_s", "the link's emulated bandwidth (bytes/s)"), ("utilisation", "throughput / bandwidth"),
            ("queue_depth", "frames waiting to be sent"),
            ("queued_bytes", "payload bytes of the frames waiting to be sent"),
            ("in_flight_bytes", "bytes sent, not yet acknowledged"),
            ("resends", "frames sent again"), ("tcp_retransmits", "TCP retransmits (TCP_INFO)")]}

    def observe(self, reason: str | None, prompt: int, cached: int, generated: int, ttft_s: float | None,
                e2e_s: float | None) -> None:
        self.requests.labels(reason or "unknown").inc()
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.generation_tokens.inc(generated)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if e2e_s is not None and generated > 1:
                self.tpot.observe((e2e_s - ttft_s) / (generated - 1))
        if e2e_s is not None:
            self.e2e.observe(e2e_s)

    def observe_finished(self, seq) -> None:
        """Called on the engine thread for every finished sequence."""
        first = None if seq.first_token_time is None else seq.first_token_time - seq.arrival
        e2e = None if seq.finish_time is None else seq.finish_time - seq.arrival
        self.observe(seq.finish_reason, len(seq.prompt), seq.num_cached, len(seq.output), first, e2e)

    def observe_update(self, u, e2e_s: float) -> None:
        """A request's final Update as the router saw it (cluster serving)."""
        self.observe(u.finish_reason, u.prompt_tokens, u.cached_tokens, len(u.token_ids), u.ttft_s, e2e_s)

    def render(self) -> bytes:
        # gauges read plain ints / floats the engine thread writes; a scrape may be one step stale
        for k, v in self.stats_fn().items():
            if k in self.gauges:
                self.gauges[k].set(v)
        if self.cluster_fn is not None:
            c = self.cluster_fn()
            for name, st in c["instances"].items():
                self.cluster["up"].labels(name, st["role"]).set(1 if st["up"] else 0)
                self.cluster["inflight"].labels(name).set(st["inflight"])
            self.cluster["kv_bytes"].set(c["kv_bytes_transferred"])
            self.cluster["retries"].set(c["retries"])
            for what, n in c.get("index", {}).items():
                self.cluster["index"].labels(what).set(n)
            for key, bytes_key in (("prefix_moves", "prefix_move_bytes"), ("store_puts", "store_put_bytes")):
                got = c.get(key, {})
                for outcome in ("done", "failed", "streamed"):
                    if outcome in got:
                        self.cluster[key].labels(outcome).set(got[outcome])
                if "bytes" in got:
                    self.cluster[bytes_key].set(got["bytes"])
            for route, n in c.get("routes", {}).items():
                self.cluster["routes"].labels(route).set(n)
            for k, v in c.get("policy", {}).items():
                if k not in self.policy:
                    self.policy[k] = Gauge(f"jaxserve_policy_{k}", f"the placement policy's {k}",
                                           registry=self.registry)
                self.policy[k].set(v)
            for link, snap in c["links"].items():
                for k, gauge in self.links.items():
                    if snap.get(k) is not None:
                        gauge.labels(link).set(snap[k])
        return generate_latest(self.registry)
