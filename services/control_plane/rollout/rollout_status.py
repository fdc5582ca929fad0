"""An adapter's rollout as operators see it: route, each version's evidence, the analyzer's
state and last decision (`slora admin status`, GetRolloutStatus)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from services.common.versions import Evidence
from services.control_plane.domain.evidence import EvidenceStore
from services.control_plane.domain.lifecycle import VersionState
from services.control_plane.domain.principal import Principal
from services.control_plane.rollout.analyzer import Analyzer, LiveWindow
from services.control_plane.store.records import AdapterRecord
from services.control_plane.store.registry import Registry
from services.control_plane.store.rollout_rows import AnalysisRecord, load_analysis


@dataclass(frozen=True)
class VersionFigures:
    version: str
    state: VersionState
    role: str                 # "stable", "canary", "fallback" or ""
    window: Evidence | None   # the running analysis window (canary and stable only)
    total: Evidence           # since this control plane started


@dataclass(frozen=True)
class RolloutStatus:
    adapter: AdapterRecord
    figures: tuple[VersionFigures, ...]
    analysis: AnalysisRecord | None
    live: LiveWindow | None   # the analyzer's latest look at the running canary


class RolloutView:
    def __init__(self, sessions: sessionmaker[Session], registry: Registry,
                 evidence: EvidenceStore, analyzer: Analyzer) -> None:
        self.sessions = sessions
        self.registry = registry
        self.evidence = evidence
        self.analyzer = analyzer

    def status(self, adapter_id: str, viewer: Principal) -> RolloutStatus:
        """Raises NotFound for an unknown adapter, PermissionDenied for another tenant's."""
        adapter = self.registry.get_adapter(adapter_id, viewer)
        with self.sessions() as s:
            analysis = load_analysis(s, adapter_id)
        live = self.analyzer.live.get(adapter_id)
        if live is not None and live.run.route_revision != adapter.route.revision:
            live = None  # the route moved on since the analyzer's last tick
        return RolloutStatus(adapter, self._figures(adapter, live), analysis, live)

    def _figures(self, adapter: AdapterRecord, live: LiveWindow | None
                 ) -> tuple[VersionFigures, ...]:
        r = adapter.route
        roles = {v: role for role, v in (("fallback", r.fallback_version),
                                         ("canary", r.canary_version),
                                         ("stable", r.stable_version)) if v}
        rows = []
        for v in adapter.versions:
            total = self.evidence.total((adapter.adapter_id, v.version))
            role = roles.get(v.version, "")
            if not role and not (total.requests or total.routed or total.feedback_count):
                continue
            window = live.evidence.get(v.version) if live is not None else None
            rows.append(VersionFigures(v.version, v.state, role, window, total))
        order = {"stable": 0, "canary": 1, "fallback": 2, "": 3}
        return tuple(sorted(rows, key=lambda f: order[f.role]))
