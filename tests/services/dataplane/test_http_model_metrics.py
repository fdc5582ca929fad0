"""The model-server metrics a gateway exposes for the Gateway API Inference Extension, from a
worker's heartbeat as the control plane turns it into a routing-table entry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from services.control_plane.api.routing_state import WorkerView, worker_endpoint
from services.gateway.model_server_metrics import ModelServerCollector
from services.gateway.table import RoutingTable
from slora.v1 import placement_pb2 as ppb


def heartbeat() -> ppb.Heartbeat:
    key = ppb.VersionKey
    return ppb.Heartbeat(
        running=3, waiting=2, load=0.3, kv_pages=30, adapter_pages=10, free_pages=60,
        max_num_seqs=16,
        running_adapters=[key(adapter_id="sql", version="v1"), key(adapter_id="sql", version="v2"),
                          key(adapter_id="chat", version="v1"), key()],
        waiting_adapters=[key(adapter_id="summ", version="v3")])


def test_worker_endpoint_carries_the_heartbeat_figures() -> None:
    view = WorkerView("w1", "a:1", True, 0.312, False, frozenset(), heartbeat())
    e = worker_endpoint(view)
    assert (e.running, e.waiting, e.kv_pages, e.adapter_pages, e.free_pages, e.max_num_seqs) == (
        3, 2, 30, 10, 60, 16)
    assert e.load == 0.31 and len(e.running_adapters) == 4
    bare = worker_endpoint(WorkerView("w2", "a:2", True, 0.0, False, frozenset()))
    assert (bare.running, bare.waiting, list(bare.running_adapters)) == (0, 0, [])


def scrape(table: RoutingTable, inflight: dict[str, int]) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(ModelServerCollector(table, inflight))
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_collector_names_and_values() -> None:
    table = RoutingTable()
    up = worker_endpoint(WorkerView("w1", "a:1", True, 0.3, False, frozenset(), heartbeat()))
    down = ppb.WorkerEndpoint(worker_id="w9", address="a:9", up=False, running=7)
    table.apply(ppb.RoutingUpdate(revision=1, snapshot=True, workers=[up, down]))
    m = scrape(table, {"w1": 4})
    w = '{worker="w1"}'
    assert m[f"vllm:num_requests_running{w}"] == 3
    assert m[f"vllm:num_requests_waiting{w}"] == 2
    assert m[f"vllm:gpu_cache_usage_perc{w}"] == 0.3  # 30 KV pages of 100
    assert m[f"vllm:kv_cache_usage_perc{w}"] == 0.3
    assert m[f"slora_gateway_inflight{w}"] == 4
    info = 'vllm:lora_requests_info{running_lora_adapters="sql,chat",' \
           'waiting_lora_adapters="summ",worker="w1"}'
    assert m[info] == table.updated_at["w1"] > 0
    assert not any('worker="w9"' in name for name in m)  # a down worker is not offered
