"""The model-server metrics of the Gateway API Inference Extension's protocol, for every worker
in the gateway's routing table, under vLLM's names (the reference the protocol cites), labelled
by `worker`.

The figures are the workers' own, from their latest heartbeat as the control plane passed it on
(a heartbeat interval old at most); the gateway adds nothing of its own to them. vLLM's
`max_lora` label (the adapters one batch may hold) is left out: heartbeats do not carry the
worker's max_adapters_per_batch.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.gateway.table import RoutingTable
from slora.v1 import placement_pb2 as ppb


def kv_cache_usage(w: ppb.WorkerEndpoint) -> float:
    """KV pages over all arena pages, 0..1 (vLLM's *_usage_perc is a fraction too). Adapter
    pages count as room: idle adapters are evicted when KV needs pages."""
    total = w.kv_pages + w.adapter_pages + w.free_pages
    return w.kv_pages / total if total else 0.0


def adapter_names(keys: list[ppb.VersionKey]) -> str:
    """Comma-separated adapter ids (what a request's `model` names), each once, in order."""
    return ",".join(dict.fromkeys(k.adapter_id for k in keys if k.adapter_id))


class ModelServerCollector(Collector):
    def __init__(self, table: RoutingTable, inflight: dict[str, int]) -> None:
        self.table, self.inflight = table, inflight

    def collect(self) -> Iterator[GaugeMetricFamily]:
        waiting = GaugeMetricFamily("vllm:num_requests_waiting",
                                    "Requests waiting in the worker's queue", labels=["worker"])
        running = GaugeMetricFamily("vllm:num_requests_running",
                                    "Requests in the worker's running batch", labels=["worker"])
        usage = [GaugeMetricFamily(name, "KV-cache pages in use over all arena pages (0..1)",
                                   labels=["worker"])
                 for name in ("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc")]
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info", "Adapters of running and waiting requests; the value is "
            "when the figures were received (Unix seconds)",
            labels=["worker", "running_lora_adapters", "waiting_lora_adapters"])
        mine = GaugeMetricFamily("slora_gateway_inflight",
                                 "This gateway's calls in flight to each worker",
                                 labels=["worker"])
        for w in sorted(self.table.workers.values(), key=lambda w: w.worker_id):
            if not w.up:
                continue
            wid = [w.worker_id]
            waiting.add_metric(wid, w.waiting)
            running.add_metric(wid, w.running)
            for family in usage:
                family.add_metric(wid, kv_cache_usage(w))
            lora.add_metric([w.worker_id, adapter_names(list(w.running_adapters)),
                             adapter_names(list(w.waiting_adapters))],
                            self.table.updated_at.get(w.worker_id, 0.0))
            mine.add_metric(wid, self.inflight.get(w.worker_id, 0))
        yield from (waiting, running, *usage, lora, mine)
