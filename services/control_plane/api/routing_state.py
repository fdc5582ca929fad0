"""The routing table gateways receive, as protobuf values keyed for diffing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.common.versions import VersionKey
from services.control_plane.store.catalog import Catalog
from slora.v1 import admin_pb2
from slora.v1 import placement_pb2 as ppb


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    address: str
    up: bool
    load: float
    draining: bool
    resident: frozenset[VersionKey]
    heartbeat: ppb.Heartbeat | None = None  # the latest; its load figures go to gateways


@dataclass
class RoutingState:
    adapters: dict[str, ppb.RoutedAdapter] = field(default_factory=dict)
    workers: dict[str, ppb.WorkerEndpoint] = field(default_factory=dict)
    keys: dict[str, ppb.KeyGrant] = field(default_factory=dict)

    def snapshot(self, revision: int) -> ppb.RoutingUpdate:
        return ppb.RoutingUpdate(revision=revision, snapshot=True,
                                 adapters=list(self.adapters.values()),
                                 workers=list(self.workers.values()), keys=list(self.keys.values()))


def build_routing_state(catalog: Catalog, plan: Mapping[str, Mapping[VersionKey, str]],
                        workers: Sequence[WorkerView]) -> RoutingState:
    """Routes from the registry; a version's workers are those the plan assigns it (only
    workers that are up). A worker's own claims of warmth are not counted: a compromised
    worker reporting every version warm would otherwise draw their traffic."""
    up = {w.worker_id for w in workers if w.up}
    holders: dict[VersionKey, set[str]] = {}
    for worker_id, versions in plan.items():
        for key in versions:
            holders.setdefault(key, set()).add(worker_id)
    state = RoutingState()
    for a in catalog.adapters:
        routed = [
            ppb.RoutedVersion(
                version=v.version,
                state=admin_pb2.VersionState.Value(f"VERSION_STATE_{v.state.name}"),
                worker_ids=sorted(holders.get((a.adapter_id, v.version), set()) & up),
            )
            for v in a.versions
        ]
        state.adapters[a.adapter_id] = ppb.RoutedAdapter(
            adapter_id=a.adapter_id, tenant=a.tenant, stable_version=a.stable or "",
            canary_version=a.canary or "", traffic_ratio=a.traffic_ratio,
            fallback_version=a.fallback or "", versions=routed)
    for w in workers:
        state.workers[w.worker_id] = worker_endpoint(w)
    for k in catalog.keys:
        state.keys[k.token_sha256] = ppb.KeyGrant(token_sha256=k.token_sha256, key_id=k.key_id,
                                                  admin=k.admin, tenant=k.tenant)
    return state


def worker_endpoint(w: WorkerView) -> ppb.WorkerEndpoint:
    """What gateways know of a worker: where it is, whether to use it, and the load figures
    of its latest heartbeat."""
    endpoint = ppb.WorkerEndpoint(worker_id=w.worker_id, address=w.address, up=w.up,
                                  load=round(w.load, 2), draining=w.draining)
    hb = w.heartbeat
    if hb is not None:
        endpoint.running, endpoint.waiting, endpoint.max_num_seqs = (
            hb.running, hb.waiting, hb.max_num_seqs)
        endpoint.kv_pages, endpoint.adapter_pages, endpoint.free_pages = (
            hb.kv_pages, hb.adapter_pages, hb.free_pages)
        endpoint.running_adapters.extend(hb.running_adapters)
        endpoint.waiting_adapters.extend(hb.waiting_adapters)
    return endpoint


def routing_delta(old: RoutingState, new: RoutingState) -> ppb.RoutingUpdate | None:
    """The delta from `old` to `new` (revision unset), or None when nothing changed."""
    def diff(a: Mapping[str, object], b: Mapping[str, object]) -> tuple[list, list[str]]:
        return [v for k, v in b.items() if a.get(k) != v], [k for k in a if k not in b]

    adapters, gone_adapters = diff(old.adapters, new.adapters)
    workers, gone_workers = diff(old.workers, new.workers)
    keys, gone_keys = diff(old.keys, new.keys)
    if not (adapters or gone_adapters or workers or gone_workers or keys or gone_keys):
        return None
    return ppb.RoutingUpdate(snapshot=False, adapters=adapters, removed_adapters=gone_adapters,
                             workers=workers, removed_workers=gone_workers, keys=keys,
                             removed_keys=gone_keys)
