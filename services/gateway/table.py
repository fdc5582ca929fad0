"""The gateway's copy of the routing table, and the decisions made from it (no I/O)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

from services.common import errors as e
from slora.v1 import admin_pb2
from slora.v1 import placement_pb2 as ppb

UNSERVABLE_STATES = (admin_pb2.VERSION_STATE_FAILED, admin_pb2.VERSION_STATE_REGISTERED)
# How long a worker of the previous table that a snapshot does not list stays a candidate (of
# last resort). A restarted control plane sends its snapshot before its workers are back (they
# reconnect within a heartbeat or two); without this, the gateway would have nowhere to send
# requests meanwhile. A worker that really left fails fast, and the call moves on.
CARRY_S = 10.0


def canary_share(adapter_id: str, routing_key: str) -> float:
    """A routing key's fixed point in [0, 1): the key goes to the canary when this is below the
    traffic ratio, so it keeps its version while the ratio is unchanged, and raising the ratio
    only moves keys from stable to canary."""
    digest = hashlib.sha256(f"{adapter_id}\0{routing_key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Resolution:
    adapter_id: str
    version: str
    fallback: str  # "" when there is none, or when the version was asked for explicitly


@dataclass
class RoutingTable:
    revision: int = 0
    synced: bool = False
    adapters: dict[str, ppb.RoutedAdapter] = field(default_factory=dict)
    workers: dict[str, ppb.WorkerEndpoint] = field(default_factory=dict)
    keys: dict[str, ppb.KeyGrant] = field(default_factory=dict)
    updated_at: dict[str, float] = field(default_factory=dict)  # worker_id -> time.time()
    # Workers of the previous table missing from the latest snapshot -> until when (monotonic)
    # they stay candidates of last resort (CARRY_S).
    carried: dict[str, tuple[ppb.WorkerEndpoint, float]] = field(default_factory=dict)

    def apply(self, update: ppb.RoutingUpdate) -> None:
        """Apply a snapshot (replaces everything but the workers it lacks, which are carried
        for CARRY_S) or a delta."""
        if update.snapshot:
            until = time.monotonic() + CARRY_S
            listed = {w.worker_id for w in update.workers}
            for w in self.workers.values():
                # Marked down too: a control plane about to die often marks its workers down
                # first (their heartbeats wait on a starved host), and they are still there.
                if w.worker_id not in listed and not w.draining:
                    self.carried[w.worker_id] = (w, until)
            self.adapters, self.workers, self.keys = {}, {}, {}
        for a in update.adapters:
            self.adapters[a.adapter_id] = a
        for name in update.removed_adapters:
            self.adapters.pop(name, None)
        now = time.time()
        for w in update.workers:
            self.workers[w.worker_id] = w
            self.updated_at[w.worker_id] = now
            self.carried.pop(w.worker_id, None)
        for name in update.removed_workers:
            self.workers.pop(name, None)
            self.carried.pop(name, None)
        for k in update.keys:
            self.keys[k.token_sha256] = k
        for name in update.removed_keys:
            self.keys.pop(name, None)
        self.revision = update.revision
        self.synced = True

    def authenticate(self, token: str) -> ppb.KeyGrant:
        if not token:
            raise e.Unauthenticated("missing bearer token in the 'authorization' metadata")
        grant = self.keys.get(token_sha256(token))
        if grant is None:
            raise e.Unauthenticated("unknown or revoked API key")
        return grant

    def resolve(self, grant: ppb.KeyGrant, adapter_id: str, version: str | None,
                routing_key: str) -> Resolution:
        """Which version serves the call. Raises NotFound or PermissionDenied."""
        route = self.adapters.get(adapter_id)
        if route is None:
            raise e.NotFound(f"unknown adapter {adapter_id!r}")
        if not grant.admin and grant.tenant != route.tenant:
            raise e.PermissionDenied(f"key {grant.key_id} may not call adapter {adapter_id!r}")
        if version is not None:
            if not any(v.version == version and v.state not in UNSERVABLE_STATES
                       for v in route.versions):
                raise e.NotFound(f"adapter {adapter_id!r} has no servable version {version!r}")
            return Resolution(adapter_id, version, "")
        if not route.stable_version:
            raise e.NotFound(f"adapter {adapter_id!r} has no stable version yet")
        chosen = route.stable_version
        if route.canary_version and canary_share(adapter_id, routing_key) < route.traffic_ratio:
            chosen = route.canary_version
        fallback = route.fallback_version if route.fallback_version != chosen else ""
        if chosen == route.canary_version and not fallback:
            # A canary that cannot load falls back to the stable version.
            fallback = route.stable_version
        return Resolution(adapter_id, chosen, fallback)

    def candidates(self, adapter_id: str, version: str,
                   inflight: dict[str, int]) -> list[ppb.WorkerEndpoint]:
        """Workers able to serve, best first: those the control plane assigned the version,
        then by this gateway's in-flight calls to each. Nothing a worker claims about itself
        orders them (a compromised worker reporting load 0 would draw every call): its
        share follows the assignment and how fast it really finishes calls. Draining
        workers never; workers marked down only when none is up."""
        holders: set[str] = set()
        route = self.adapters.get(adapter_id)
        if route is not None:
            for v in route.versions:
                if v.version == version:
                    holders = set(v.worker_ids)
        serving = [w for w in self.workers.values() if not w.draining]
        # Workers whose heartbeats are late (marked down, their stream still open) come only
        # when no worker is up: on a starved host a try beats a certain UNAVAILABLE, and a
        # dead one fails fast, so the next is tried. Carried workers (a restarted control
        # plane does not list them yet) come after those.
        live = [w for w in serving if w.up] or serving or self._carried_now()
        return sorted(live, key=lambda w: (w.worker_id not in holders,
                                           inflight.get(w.worker_id, 0), w.worker_id))

    def _carried_now(self) -> list[ppb.WorkerEndpoint]:
        now = time.monotonic()
        for worker_id in [k for k, (_, until) in self.carried.items() if until <= now]:
            del self.carried[worker_id]
        return [w for w, _ in self.carried.values()]
