"""The control plane's Prometheus metrics: per-version evidence (the same figures as
`slora admin status`) and the canary analyzer's windows and decisions, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from services.common.histogram import Histogram
from services.control_plane.domain.evidence import EvidenceStore
from services.control_plane.rollout.analyzer import Analyzer

VERSION = ["adapter_id", "version"]


def _buckets(h: Histogram) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    running = 0
    for bound, n in zip((*map(str, h.bounds), "+Inf"), h.counts, strict=True):
        running += n
        out.append((bound, running))
    return out


class RolloutCollector(Collector):
    def __init__(self, evidence: EvidenceStore, analyzer: Analyzer) -> None:
        self.evidence = evidence
        self.analyzer = analyzer

    def collect(self) -> Iterator[Metric]:
        yield from self._evidence()
        yield from self._analysis()

    def _evidence(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("slora_version_requests",
                                       "Requests workers served, per version", labels=VERSION)
        errors = CounterMetricFamily("slora_version_errors", "Requests failed on workers",
                                     labels=[*VERSION, "code"])
        bad = CounterMetricFamily("slora_version_bad_outputs",
                                  "Outputs that were non-finite or empty", labels=[*VERSION, "kind"])
        routed = CounterMetricFamily("slora_version_routed", "Gateway calls routed to the version",
                                     labels=VERSION)
        fallbacks = CounterMetricFamily("slora_version_fallbacks",
                                        "Routed calls served by the fallback instead",
                                        labels=VERSION)
        feedback = CounterMetricFamily("slora_version_feedback", "Client feedback scores",
                                       labels=VERSION)
        score = CounterMetricFamily("slora_version_feedback_score_sum",
                                    "Sum of client feedback scores", labels=VERSION)
        ttft = HistogramMetricFamily("slora_version_time_to_first_token_seconds",
                                     "Time to first token per version", labels=VERSION)
        tpot = HistogramMetricFamily("slora_version_time_per_output_token_seconds",
                                     "Time per output token per version", labels=VERSION)
        for (adapter_id, version), e in sorted(self.evidence.snapshot().items()):
            key = [adapter_id, version]
            requests.add_metric(key, e.requests)
            for code, n in sorted(e.errors_by_code.items()):
                errors.add_metric([*key, code], n)
            bad.add_metric([*key, "nonfinite"], e.nonfinite)
            bad.add_metric([*key, "empty"], e.empty)
            routed.add_metric(key, e.routed)
            fallbacks.add_metric(key, e.fallbacks)
            feedback.add_metric(key, e.feedback_count)
            score.add_metric(key, e.feedback_sum)
            ttft.add_metric(key, _buckets(e.ttft), e.ttft.sum)
            tpot.add_metric(key, _buckets(e.tpot), e.tpot.sum)
        yield from (requests, errors, bad, routed, fallbacks, feedback, score, ttft, tpot)

    def _analysis(self) -> Iterator[Metric]:
        ratio = GaugeMetricFamily("slora_canary_traffic_ratio",
                                  "Traffic share of the analyzed canary", labels=VERSION)
        elapsed = GaugeMetricFamily("slora_canary_window_elapsed_seconds",
                                    "Age of the current analysis window", labels=VERSION)
        labels = [*VERSION, "role"]
        failure = GaugeMetricFamily("slora_canary_window_failure_rate",
                                    "Failure rate in the current window", labels=labels)
        ttft = GaugeMetricFamily("slora_canary_window_ttft_mean_seconds",
                                 "Mean time to first token in the current window", labels=labels)
        tpot = GaugeMetricFamily("slora_canary_window_tpot_mean_seconds",
                                 "Mean time per output token in the current window", labels=labels)
        score = GaugeMetricFamily("slora_canary_window_feedback_mean",
                                  "Mean feedback score in the current window", labels=labels)
        # dict() copies in one step under the GIL while the analyzer's thread may write.
        for adapter_id, live in sorted(dict(self.analyzer.live).items()):
            run = live.run
            ratio.add_metric([adapter_id, run.canary], run.traffic_ratio)
            elapsed.add_metric([adapter_id, run.canary], live.elapsed_s)
            for role, version in (("canary", run.canary), ("stable", run.stable)):
                e = live.evidence[version]
                key = [adapter_id, version, role]
                for family, value in ((failure, e.failure_rate), (ttft, e.ttft.mean()),
                                      (tpot, e.tpot.mean()), (score, e.feedback_mean)):
                    if value is not None:
                        family.add_metric(key, value)
        decisions = CounterMetricFamily("slora_canary_decisions",
                                        "Decisions this control plane's analyzer applied",
                                        labels=["adapter_id", "decision"])
        for (adapter_id, decision), n in sorted(dict(self.analyzer.decisions).items()):
            decisions.add_metric([adapter_id, decision], n)
        yield from (ratio, elapsed, failure, ttft, tpot, score, decisions)


def rollout_registry(evidence: EvidenceStore, analyzer: Analyzer) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(RolloutCollector(evidence, analyzer))
    return registry
