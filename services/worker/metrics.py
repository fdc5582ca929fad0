"""The worker's Prometheus metrics and the per-version counters its heartbeats carry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.registry import Collector

from services.common.metrics import LATENCY_BUCKETS
from services.common.versions import Evidence, VersionKey


class WorkerMetrics:
    """All metrics of one worker in its own registry (names prefixed `slora_`).

    Latency histograms carry no adapter label: with thousands of adapters that would explode
    the series count; per-version requests and errors are counters with labels."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("slora_time_to_first_token_seconds", "Time to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("slora_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("slora_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("slora_queue_time_seconds",
                                    "Time from arrival until first scheduled",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("slora_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("slora_requests_waiting", "Requests waiting to be scheduled",
                             registry=r)
        self.pages = Gauge("slora_arena_pages", "Arena pages by use", ["kind"], registry=r)
        self.adapter_loads = Counter("slora_adapter_loads", "Adapters written into arena pages",
                                     registry=r)
        self.adapter_evictions = Counter("slora_adapter_evictions",
                                         "Adapters evicted from arena pages", registry=r)
        self.adapter_merges = Counter(
            "slora_adapter_merges", "Sole adapters folded into the base weights "
            "(merge_sole_adapter)", registry=r)
        self.merged_steps = Counter("slora_merged_steps",
                                    "Engine steps run with a sole adapter merged", registry=r)
        self.adapter_downloads = Counter("slora_adapter_downloads",
                                         "Adapter versions fetched into the disk cache",
                                         registry=r)
        self.requests = Counter("slora_adapter_requests", "Requests per adapter version",
                                ["adapter_id", "version"], registry=r)
        self.errors = Counter("slora_adapter_errors", "Failed requests per adapter version",
                              ["adapter_id", "version"], registry=r)
        self.aborts = Counter("slora_requests_aborted", "Requests aborted by cancel or deadline",
                              registry=r)
        # vLLM's names for the same latencies (its Grafana dashboards read these); the gauges
        # routers read come from `add_vllm_gauges`.
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.vllm_e2e = Histogram("vllm:e2e_request_latency_seconds",
                                  "End-to-end request latency", buckets=LATENCY_BUCKETS,
                                  registry=r)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds",
                                  "Time between output tokens (one observation per request: "
                                  "its mean)", buckets=LATENCY_BUCKETS, registry=r)
        self.vllm_generation_tokens = Counter("vllm:generation_tokens", "Tokens generated",
                                              registry=r)
        self.vllm_success = Counter("vllm:request_success", "Requests finished",
                                    registry=r)
        # Prefix caching in prompt tokens, as vLLM counts it (hit rate = hits / queries).
        self.vllm_prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
            registry=r)
        self.vllm_prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        # Per-version evidence, cumulative since the worker started (the control plane takes
        # differences); ("", "") is the base model.
        self.counters: dict[VersionKey, Evidence] = {}
        # Late admission (EngineConfig.admission_lead_ms, on by default): what pacing the
        # engine's steps costs the GPU, and what it takes.
        self.admission_waits = Counter(
            "slora_admission_waits", "Waits of the serving loop for new requests before a "
            "step (late admission)", registry=r)
        self.admission_wait_seconds = Counter(
            "slora_admission_wait_seconds", "Time the serving loop waited for new requests "
            "while the GPU ran a step", registry=r)
        self.admission_taken = Counter(
            "slora_admission_requests_taken", "Requests taken inside a wait: each joins the "
            "next step instead of the one after", registry=r)
        self.admission_paced_steps = Counter(
            "slora_admission_paced_steps", "Steps launched after a wait", registry=r)
        self.admission_gpu_idle = Counter(
            "slora_admission_gpu_idle_seconds", "GPU idle time before paced steps (a wait "
            "that overran the step under way)", registry=r)
        # The core's totals last seen, per counter: a counter takes what is new each step.
        self._totals: dict[Counter, float] = {}

    def add_vllm_gauges(self, collector: Collector) -> None:
        """Serve vLLM's router-facing gauges (`vllm_metrics.VllmCollector`) here too."""
        self.registry.register(collector)

    def version(self, key: VersionKey) -> Evidence:
        return self.counters.setdefault(key, Evidence())

    def record_request(self, key: VersionKey) -> None:
        self.requests.labels(*key).inc()
        self.version(key).requests += 1

    def record_error(self, key: VersionKey, code: str) -> None:
        """A failed request; `code` is the gRPC status code name the caller got."""
        self.errors.labels(*key).inc()
        self.version(key).count_error(code)

    def record_nonfinite_failure(self, key: VersionKey) -> None:
        """A request the engine ended because its logits were NaN or inf (finish_reason "error",
        `slora_core.outputs.is_nonfinite_failure`). Counted as a non-finite output, which canary
        evidence already counts as a failure, and not again under `errors`, so the failure rate
        counts it once."""
        self.errors.labels(*key).inc()
        self.version(key).nonfinite += 1

    def record_finish(self, key: VersionKey, ttft: float | None, e2e: float, tokens: int,
                      nonfinite: bool = False) -> None:
        """A finished request: `nonfinite` when a generated token's logprob was NaN/inf."""
        c = self.version(key)
        c.completion_tokens += tokens
        c.nonfinite += int(nonfinite)
        c.empty += int(tokens == 0)
        self.e2e.observe(e2e)
        self.vllm_e2e.observe(e2e)
        self.vllm_success.inc()
        self.vllm_generation_tokens.inc(tokens)
        if ttft is None:
            return
        c.ttft.observe(ttft)
        self.vllm_ttft.observe(ttft)
        if tokens > 1:
            tpot = (e2e - ttft) / (tokens - 1)
            self.tpot.observe(tpot)
            self.vllm_itl.observe(tpot)
            c.tpot.observe(tpot)

    def set_engine_state(self, running: int, waiting: int, kv_pages: int, adapter_pages: int,
                         free_pages: int, loads: int, evictions: int, merges: int = 0,
                         merged_steps: int = 0, prefix_queries: int = 0,
                         prefix_hits: int = 0) -> None:
        """Called from the engine thread after each step (prometheus metrics are thread-safe)."""
        self.running.set(running)
        self.waiting.set(waiting)
        self.pages.labels("kv").set(kv_pages)
        self.pages.labels("adapter").set(adapter_pages)
        self.pages.labels("free").set(free_pages)
        self.advance(self.adapter_loads, loads)
        self.advance(self.adapter_evictions, evictions)
        self.advance(self.adapter_merges, merges)
        self.advance(self.merged_steps, merged_steps)
        self.advance(self.vllm_prefix_queries, prefix_queries)
        self.advance(self.vllm_prefix_hits, prefix_hits)

    def advance(self, counter: Counter, total: float) -> None:
        """`counter` follows `total`, the core's count since it started (a total below the
        last one seen counts from 0 again: a counter never goes down, and a step's state must
        never fail its delivery)."""
        last = self._totals.get(counter, 0)
        counter.inc(total - last if total >= last else total)
        self._totals[counter] = total
