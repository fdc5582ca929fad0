"""The gateway's Prometheus metrics (gRPC and HTTP calls share the routing counters)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("slora_gateway_requests", "Generate calls routed", registry=r)
        self.errors = Counter("slora_gateway_errors", "Generate calls failed, by code", ["code"],
                              registry=r)
        self.retries = Counter("slora_gateway_retries",
                               "Calls retried on another worker before the first token",
                               registry=r)
        self.resumed = Counter("slora_gateway_resumed",
                               "Streams resumed on another worker after theirs failed "
                               "mid-generation (docs/failover.md)", registry=r)
        self.fallbacks = Counter("slora_gateway_fallbacks",
                                 "Calls served by the fallback version", registry=r)
        self.revision = Gauge("slora_gateway_routing_revision",
                              "Revision of the routing table applied", registry=r)
        self.http_requests = Counter("slora_gateway_http_requests",
                                     "HTTP API requests answered, by route and status",
                                     ["route", "status"], registry=r)
        self.http_disconnects = Counter("slora_gateway_http_disconnects",
                                        "HTTP generation requests whose client went away before "
                                        "the end (their worker calls were cancelled)",
                                        registry=r)
