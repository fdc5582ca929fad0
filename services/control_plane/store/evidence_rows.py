"""Durable canary evidence: each analysis window's evidence per version (`canary_evidence`) and
the workers' cumulative counters it was taken up to (`evidence_checkpoints`), written together
in one transaction by the analyzer (rollout/analyzer.py).

Why both: the window rows alone would lose what workers counted between the last write and a
restart (a restarted control plane takes a worker's first heartbeat as a baseline); with the
checkpoint, that heartbeat is diffed against the counters the window rows already hold, so the
window misses nothing a worker counted. Gateway reports are deltas: those received after the
last write (at most one analyzer tick) die with the process. Two control planes on one
database each add what they received to the same window rows (workers and gateways report to
one of them at a time); a worker that moves from one to the other between checkpoints can have
an interval counted twice after a restart: exact only with one control plane.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from services.common.histogram import Histogram
from services.common.versions import Evidence
from services.control_plane.domain.evidence import WorkerBase
from services.control_plane.store.models import (
    CanaryEvidenceRow,
    EvidenceCheckpointRow,
    utcnow,
)


def evidence_to_json(ev: Evidence) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(ev):
        value = getattr(ev, f.name)
        if isinstance(value, Histogram):
            value = {"bounds": list(value.bounds), "counts": list(value.counts),
                     "sum": value.sum, "count": value.count}
        elif isinstance(value, dict):
            value = dict(value)
        out[f.name] = value
    return out


def evidence_from_json(data: Mapping[str, Any]) -> Evidence:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(Evidence):
        if f.name not in data:
            continue  # a field added later: its default
        value = data[f.name]
        if f.name in ("ttft", "tpot"):
            value = Histogram(tuple(value["bounds"]), list(value["counts"]), value["sum"],
                              value["count"])
        kwargs[f.name] = value
    return Evidence(**kwargs)


def load_window(session: Session, adapter_id: str, route_revision: int,
                versions: Iterable[str]) -> dict[str, Evidence]:
    """The window's evidence per version (empty Evidence for a version with no row yet)."""
    wanted = list(versions)
    rows = session.scalars(select(CanaryEvidenceRow).where(
        CanaryEvidenceRow.adapter_id == adapter_id,
        CanaryEvidenceRow.route_revision == route_revision,
        CanaryEvidenceRow.version.in_(wanted)))
    found = {r.version: evidence_from_json(r.evidence) for r in rows}
    return {v: found.get(v, Evidence()) for v in wanted}


def add_to_window(session: Session, adapter_id: str, route_revision: int,
                  deltas: Mapping[str, Evidence]) -> None:
    """Add each version's delta to its row of the window (created when missing); rows of the
    adapter's earlier windows are removed."""
    session.execute(delete(CanaryEvidenceRow).where(
        CanaryEvidenceRow.adapter_id == adapter_id,
        CanaryEvidenceRow.route_revision != route_revision))
    for version, delta in deltas.items():
        row = session.get(CanaryEvidenceRow, (adapter_id, route_revision, version))
        if row is None:
            row = CanaryEvidenceRow(adapter_id=adapter_id, route_revision=route_revision,
                                    version=version, evidence=evidence_to_json(Evidence()))
            session.add(row)
        total = evidence_from_json(row.evidence)
        total.add(delta)
        row.evidence, row.updated_at = evidence_to_json(total), utcnow()


def save_checkpoint(session: Session, bases: Mapping[str, WorkerBase]) -> None:
    """Store the counters of the workers in `bases`; rows of other workers stay (another
    control plane on the same database may hold them)."""
    for worker_id, (started_at_ms, counters) in bases.items():
        row = session.get(EvidenceCheckpointRow, worker_id)
        if row is None:
            row = EvidenceCheckpointRow(worker_id=worker_id)
            session.add(row)
        row.started_at_ms = started_at_ms
        row.counters = [[a, v, evidence_to_json(ev)] for (a, v), ev in counters.items()]


def load_checkpoint(session: Session) -> dict[str, WorkerBase]:
    out: dict[str, WorkerBase] = {}
    for row in session.scalars(select(EvidenceCheckpointRow)):
        out[row.worker_id] = (row.started_at_ms, {
            (a, v): evidence_from_json(ev) for a, v, ev in row.counters})
    return out
