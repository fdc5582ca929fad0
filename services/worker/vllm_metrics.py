"""The model-server families routers and dashboards read from a vLLM pod, served by each worker
under vLLM's names, unlabelled (one worker a scrape target, as one vLLM server is).

What reads them: the Gateway API Inference Extension's endpoint picker (llm-d, KServe's
LLMInferenceService) takes `vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc` (older releases `vllm:gpu_cache_usage_perc`), `vllm:lora_requests_info`
(labels `max_lora`, `running_lora_adapters`, `waiting_lora_adapters`; the value is when the
figures were taken, so it keeps the newest) and `vllm:cache_config_info` (`block_size`,
`num_gpu_blocks`) for prefix-aware scoring; vLLM's Grafana dashboards read the latency
histograms, which `WorkerMetrics` fills. Adapters are named by adapter id, what a request's
`model` names.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.convert import engine_adapter_name
from services.worker import core_protocol as m
from services.worker.adapters import AdapterManager
from slora.v1 import placement_pb2 as ppb
from slora_core.config import EngineConfig, ModelConfig


@dataclass(frozen=True)
class ServerShape:
    """What does not change while a worker runs."""

    max_lora: int        # adapters one batch may hold (max_adapters_per_batch)
    block_size: int      # tokens per KV block
    num_gpu_blocks: int  # arena pages (KV blocks and adapter pages share them)


def adapter_ids(engine_names: Iterable[str]) -> list[str]:
    """Adapter ids of engine names (`id@version`), each once, in order."""
    return list(dict.fromkeys(n.rpartition("@")[0] or n for n in engine_names))


def kv_usage(state: m.EngineState) -> float:
    """KV pages over all arena pages, 0..1; adapter pages count as room (idle adapters are
    evicted when KV needs pages)."""
    total = state.kv_pages + state.adapter_pages + state.free_pages
    return state.kv_pages / total if total else 0.0


class VllmCollector(Collector):
    """Gauges read from the engine core's latest state at scrape time."""

    def __init__(self, shape: ServerShape, state: Callable[[], m.EngineState],
                 pinned: Callable[[], Iterable[str]] = tuple) -> None:
        self.shape, self.state, self.pinned = shape, state, pinned

    def collect(self) -> Iterator[GaugeMetricFamily]:
        st = self.state()
        yield _gauge("vllm:num_requests_running", "Requests in the running batch", st.running)
        yield _gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled",
                     st.waiting)
        usage = kv_usage(st)
        yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage (0..1)", usage)
        yield _gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (0..1; the name before "
                     "vLLM 0.10)", usage)
        running, waiting = adapter_ids(st.running_adapters), adapter_ids(st.waiting_adapters)
        info = GaugeMetricFamily(
            "vllm:lora_requests_info", "Adapters of running and waiting requests; the value "
            "is when the figures were taken (Unix seconds)",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([str(self.shape.max_lora), ",".join(running), ",".join(waiting)],
                        time.time())
        yield info
        yield from self._loaded(st, running)
        cache = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's shape",
                                  labels=["block_size", "num_gpu_blocks"])
        cache.add_metric([str(self.shape.block_size), str(self.shape.num_gpu_blocks)], 1)
        yield cache

    def _loaded(self, st: m.EngineState, running: list[str]) -> Iterator[GaugeMetricFamily]:
        """Adapters in use (`gpu`: in a running batch's arena pages) or warm (`cpu`: host
        memory or idle pages), and whether placement pinned them."""
        pinned = set(adapter_ids(self.pinned()))
        warm = adapter_ids(st.warm_adapters or ())
        loaded = GaugeMetricFamily("vllm:lora_adapter_loaded", "Adapters loaded, by level",
                                   labels=["adapter_name", "level", "pinned"])
        for name in running:
            loaded.add_metric([name, "gpu", str(name in pinned).lower()], 1)
        for name in warm:
            if name not in running:
                loaded.add_metric([name, "cpu", str(name in pinned).lower()], 1)
        yield loaded
        yield _gauge("vllm:num_gpu_loaded_lora_adapters", "Adapters in a running batch",
                     len(running))
        yield _gauge("vllm:max_gpu_lora_adapters", "Adapters one batch may hold",
                     self.shape.max_lora)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def server_shape(config: EngineConfig, model: ModelConfig) -> ServerShape:
    return ServerShape(max_lora=config.adapter_cap, block_size=config.resolve_block_size(model),
                       num_gpu_blocks=config.num_pages)


def pinned_names(adapters: AdapterManager) -> list[str]:
    """Engine names of the versions placement pinned on this worker."""
    return [engine_adapter_name(*key) for key, kv in adapters.known.items()
            if kv.residency == ppb.RESIDENCY_PIN]
