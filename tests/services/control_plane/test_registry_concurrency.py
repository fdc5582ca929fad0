"""32 admin clients race canary/promote/rollback/retire on the same adapters: every change
either wins or is ABORTED, nothing is lost, and replaying the audit log gives the stored routes.
PostgreSQL is the production case; SQLite runs the same race."""

from __future__ import annotations

import random
import threading
from collections import Counter
from pathlib import Path

import grpc
import pytest

from services.control_plane.api.client import AdminClient
from services.control_plane.domain.lifecycle import AdapterState
from services.control_plane.domain.principal import SYSTEM
from services.control_plane.store.records import EventRecord
from services.control_plane.store.replay import ReplayError, replay
from slora.v1 import admin_pb2 as pb
from slora_core.adapters import digest_adapter_dir
from tests.services.control_plane.cp_support import ADMIN_TOKEN, BASE, RunningPlane, file_uri

NUM_CLIENTS = 32
OPS_PER_CLIENT = 12
ADAPTERS = ("race/a", "race/b", "race/c")
VERSIONS = tuple(f"v{i}" for i in range(1, 7))


def legal_moves(info: pb.AdapterInfo, rng: random.Random) -> list[tuple[str, tuple]]:
    """Changes the lifecycle allows from the state just read (so only a race can refuse them)."""
    route = info.route
    states = {v.version: v.state for v in info.versions}
    validated = [v for v, s in states.items() if s == pb.VERSION_STATE_VALIDATED]
    idle = [v for v, s in states.items()
            if s in (pb.VERSION_STATE_VALIDATED, pb.VERSION_STATE_ROLLED_BACK)]
    ratio = rng.choice((0.05, 0.1, 0.25, 0.5))
    moves: list[tuple[str, tuple]] = []
    if route.canary_version:
        moves += [("promote", (route.canary_version,)), ("rollback", ()),
                  ("canary", (route.canary_version, ratio))]
    else:
        moves += [("canary", (v, ratio)) for v in validated] + [("promote", (v,)) for v in validated]
        if route.fallback_version:
            moves.append(("rollback", ()))
    moves += [("retire", (v,)) for v in idle if v not in validated[:1]]
    return moves


def race(client: AdminClient, seed: int, wins: list[tuple[str, str]], aborted: list[str],
         errors: list[str]) -> None:
    rng = random.Random(seed)
    for _ in range(OPS_PER_CLIENT):
        adapter_id = rng.choice(ADAPTERS)
        info = client.get(adapter_id)
        moves = legal_moves(info, rng)
        if not moves:
            continue
        action, args = rng.choice(moves)
        etag = info.route.etag
        try:
            if action == "canary":
                result = client.canary(adapter_id, *args, etag=etag, reason=f"client {seed}")
            elif action == "promote":
                result = client.promote(adapter_id, *args, etag=etag, reason=f"client {seed}")
            elif action == "retire":
                result = client.retire(adapter_id, *args, etag=etag, reason=f"client {seed}")
            else:
                result = client.rollback(adapter_id, reason=f"client {seed}", etag=etag)
            wins.append((adapter_id, result.route.etag))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.ABORTED:
                aborted.append(adapter_id)
            else:
                errors.append(f"{action}{args} on {adapter_id}: {e.code().name} {e.details()}")


def all_events(plane: RunningPlane) -> list[EventRecord]:
    events, token = [], ""
    while True:
        page, token = plane.plane.registry.list_events(SYSTEM, page_size=500, page_token=token)
        events += page
        if not token:
            return events


def stored_states(plane: RunningPlane) -> dict[str, AdapterState]:
    records, _ = plane.plane.registry.list_adapters(SYSTEM, page_size=500)
    return {r.adapter_id: r.state() for r in records if r.adapter_id in ADAPTERS}


def test_racing_clients_lose_no_update(plane: RunningPlane, adapter_root: Path) -> None:
    for adapter_id in ADAPTERS:
        for i, version in enumerate(VERSIONS):
            path = adapter_root / "good" / f"v{i % 3 + 1}"
            plane.admin.register(adapter_id, version, file_uri(path), digest_adapter_dir(path),
                                 BASE, "acme")
        plane.admin.promote(adapter_id, "v1")
    wins: list[tuple[str, str]] = []
    aborted: list[str] = []
    errors: list[str] = []
    channels = [grpc.insecure_channel(plane.target) for _ in range(NUM_CLIENTS)]
    threads = [
        threading.Thread(target=race, args=(AdminClient(ch, ADMIN_TOKEN), seed, wins, aborted, errors))
        for seed, ch in enumerate(channels)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for ch in channels:
        ch.close()

    assert errors == []  # a legal move is only ever refused because someone else moved first
    assert len(wins) == len(set(wins))  # no two winners were handed the same new etag
    events = all_events(plane)
    route_events = [e for e in events if e.adapter_id in ADAPTERS and e.action != "register"]
    assert Counter(e.adapter_id for e in route_events) == Counter(
        a for a, _ in wins) + Counter(ADAPTERS)  # + the set-up promote of each adapter
    assert len(wins) >= 16 and aborted  # the race made progress, and clients did collide
    replayed = {a: s for a, s in replay(events).items() if a in ADAPTERS}
    assert replayed == stored_states(plane)


def test_replay_detects_a_lost_update(plane: RunningPlane) -> None:
    """The replay check is not vacuous: dropping one change from the log breaks the chain."""
    events = [e for e in all_events(plane) if e.adapter_id == "race/a"]
    changes = [i for i, e in enumerate(events) if e.action != "register"]
    if len(changes) < 2:
        pytest.skip("the race left too few changes on race/a")
    with pytest.raises(ReplayError, match="revision"):
        replay(events[: changes[0]] + events[changes[0] + 1:])


def test_concurrent_registrations(plane: RunningPlane, adapter_root: Path) -> None:
    """Racing registrations of one new adapter: the same version from 8 clients is recorded
    once (everyone gets that record); different versions all land."""
    path = adapter_root / "good" / "v1"
    sha = digest_adapter_dir(path)
    results: list[pb.AdapterVersionInfo] = []
    errors: list[str] = []

    def register(version: str) -> None:
        with grpc.insecure_channel(plane.target) as channel:
            try:
                results.append(AdminClient(channel, ADMIN_TOKEN).register(
                    "race/new", version, file_uri(path), sha, BASE, "acme"))
            except grpc.RpcError as e:
                errors.append(f"{version}: {e.code().name} {e.details()}")

    versions = ["same"] * 8 + [f"d{i}" for i in range(4)]
    threads = [threading.Thread(target=register, args=(v,)) for v in versions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    same = [r for r in results if r.version == "same"]
    assert len(same) == 8 and all(r == same[0] for r in same)
    info = plane.admin.get("race/new")
    assert sorted(v.version for v in info.versions) == ["d0", "d1", "d2", "d3", "same"]
    registered = [e for e in plane.admin.events(adapter_id="race/new") if e.action == "register"]
    assert sorted(e.version for e in registered) == ["d0", "d1", "d2", "d3", "same"]
