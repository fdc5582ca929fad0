"""A worker's vLLM-named families as routers read them: parsed with prometheus_client's own
text parser, with the names and labels the Gateway API Inference Extension's endpoint picker
and vLLM's dashboards use."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.worker import core_protocol as m
from services.worker.metrics import WorkerMetrics
from services.worker.vllm_metrics import ServerShape, VllmCollector

ROUTER_FAMILIES = {"vllm:num_requests_waiting", "vllm:num_requests_running",
                   "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                   "vllm:lora_requests_info", "vllm:cache_config_info",
                   "vllm:lora_adapter_loaded", "vllm:num_gpu_loaded_lora_adapters",
                   "vllm:max_gpu_lora_adapters"}
HISTOGRAMS = {"vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:inter_token_latency_seconds"}


def parse(registry: CollectorRegistry) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(
        generate_latest(registry).decode())}


def test_the_router_families_and_labels() -> None:
    metrics = WorkerMetrics()
    state = m.EngineState(running=3, waiting=2, kv_pages=30, adapter_pages=10, free_pages=60,
                          running_adapters=["sql@v1", "sql@v2", "chat@v1"],
                          waiting_adapters=["summ@v3"], warm_adapters=["sql@v1", "old@v9"])
    metrics.add_vllm_gauges(VllmCollector(ServerShape(max_lora=4, block_size=16,
                                                      num_gpu_blocks=100),
                                          lambda: state, lambda: ["old@v9"]))
    metrics.record_finish(("", ""), ttft=0.05, e2e=0.5, tokens=10)
    families = parse(metrics.registry)
    assert set(families) >= ROUTER_FAMILIES | HISTOGRAMS
    value = {name: families[name][0].value for name in ROUTER_FAMILIES}
    assert (value["vllm:num_requests_running"], value["vllm:num_requests_waiting"]) == (3, 2)
    assert value["vllm:kv_cache_usage_perc"] == value["vllm:gpu_cache_usage_perc"] == 0.3
    assert families["vllm:num_requests_running"][0].labels == {}  # per pod, unlabelled
    info = families["vllm:lora_requests_info"][0]
    assert info.labels == {"max_lora": "4", "running_lora_adapters": "sql,chat",
                           "waiting_lora_adapters": "summ"}
    assert info.value > 1.7e9  # a Unix time: the picker keeps the newest sample
    assert families["vllm:cache_config_info"][0].labels == {"block_size": "16",
                                                           "num_gpu_blocks": "100"}
    loaded = {(s.labels["adapter_name"], s.labels["level"], s.labels["pinned"])
              for s in families["vllm:lora_adapter_loaded"]}
    assert loaded == {("sql", "gpu", "false"), ("chat", "gpu", "false"),
                      ("old", "cpu", "true")}
    assert value["vllm:num_gpu_loaded_lora_adapters"] == 2
    assert value["vllm:max_gpu_lora_adapters"] == 4
    ttft = {s.name: s.value for s in families["vllm:time_to_first_token_seconds"]}
    assert ttft["vllm:time_to_first_token_seconds_count"] == 1
    assert ttft["vllm:time_to_first_token_seconds_sum"] == 0.05
    itl = {s.name: s.value for s in families["vllm:inter_token_latency_seconds"]}
    assert abs(itl["vllm:inter_token_latency_seconds_sum"] - 0.45 / 9) < 1e-12


def test_an_idle_worker_reports_zeros_and_empty_adapter_lists() -> None:
    registry = CollectorRegistry()
    registry.register(VllmCollector(ServerShape(8, 32, 256), m.EngineState))
    families = parse(registry)
    assert families["vllm:kv_cache_usage_perc"][0].value == 0.0
    info = families["vllm:lora_requests_info"][0].labels
    assert info["running_lora_adapters"] == info["waiting_lora_adapters"] == ""
    assert families["vllm:lora_adapter_loaded"] == []
