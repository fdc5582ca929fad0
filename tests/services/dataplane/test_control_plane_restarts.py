"""A control plane restarted again 1-2 s after each start while the route changes (SQLite and
PostgreSQL): once it stays up, every gateway serves the latest route within a heartbeat
(gateways get a full snapshot as soon as their routing stream opens; no start-up grace holds
it back). A start itself takes 3-7 s on a 2-core CI host."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from devtools.demo_stack import (
    Stack,
    StackConfig,
    publish_demo_adapters,
    wait_until_routable,
)
from services.control_plane.api.client import AdminClient
from slora_core.adapters import digest_adapter_dir
from tests.services.control_plane.cp_support import (
    create_pg_schema,
    drop_pg_schema,
    start_postgres,
)
from tests.services.dataplane.dp_support import generate, request

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ADAPTER = "qv-r4"
HEARTBEAT_S = 1.0
VERSIONS = [f"v{i}" for i in range(1, 8)]  # v2..v6 during restarts, v7 at the end


@dataclass
class Running:
    stack: Stack
    token: str

    def admin(self) -> AdminClient:
        return AdminClient.connect(self.stack.cp_address, self.stack.admin_token)

    def restart_control_plane(self, kill: bool) -> None:
        cp = self.stack.control_plane
        assert cp is not None
        if kill:
            cp.kill()
        else:
            cp.popen.send_signal(signal.SIGTERM)
            cp.popen.wait(15)
        self.stack.start_control_plane()


@pytest.fixture(scope="module", params=("sqlite", "postgresql"))
def running(request: pytest.FixtureRequest, demo_dir: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    state = tmp_path_factory.mktemp("restarts")
    schema, db_url = "", ""
    if request.param == "postgresql":
        if not start_postgres():
            pytest.skip("PostgreSQL on 127.0.0.1:5432 is not reachable")
        schema, db_url = create_pg_schema()
    stack = Stack(StackConfig(demo_dir=demo_dir, state_dir=state, heartbeat_s=HEARTBEAT_S,
                              db_url=db_url))
    try:
        stack.start_control_plane()
        stack.start_worker("w1")
        for name in ("g1", "g2"):
            stack.start_gateway(name)
        admin = AdminClient.connect(stack.cp_address, stack.admin_token)
        token = publish_demo_adapters(admin, demo_dir, names=[ADAPTER])
        path = demo_dir / "adapters" / ADAPTER
        for version in VERSIONS[1:]:
            admin.register(ADAPTER, version, path.resolve().as_uri(), digest_adapter_dir(path),
                           "demo", "demo")
        for address in stack.gateway_addresses.values():
            wait_until_routable(address, token, [ADAPTER])
        yield Running(stack, token)
    finally:
        stack.stop()
        if schema:
            drop_pg_schema(schema)


def served_version(gateway: str, token: str) -> str:
    res = generate(gateway, request(adapter=ADAPTER, max_new_tokens=1, temperature=0),
                   token=token, timeout=10)
    if res.complete is None:
        return f"{res.error}: {res.details}"
    return res.complete.served_by.adapter_version


def test_after_restarts_every_gateway_serves_the_latest_route_within_a_heartbeat(
        running: Running) -> None:
    rng = random.Random(0)
    latest = "v1"
    for i, version in enumerate(VERSIONS[1:-1]):
        running.restart_control_plane(kill=i % 2 == 0)
        running.admin().promote(ADAPTER, version, reason="restart test")
        latest = version
        time.sleep(rng.uniform(1.0, 2.0))  # up 1-2 s, then the next restart
    running.restart_control_plane(kill=True)
    # One more route change on the control plane that now stays up, timed from its commit.
    final = VERSIONS[-1]
    running.admin().promote(ADAPTER, final, reason="restart test: final")
    changed = time.monotonic()
    assert latest != final
    waits: dict[str, float] = {}
    seen: dict[str, list[str]] = {}

    def watch(name: str, gateway: str) -> None:
        """Poll one gateway (all at once: each is timed from the change, not after another)."""
        seen[name] = []
        while (version := served_version(gateway, running.token)) != final:
            if time.monotonic() - changed > 10:
                return
            if version not in seen[name]:
                seen[name].append(version)
            time.sleep(0.02)
        waits[name] = time.monotonic() - changed

    pollers = [threading.Thread(target=watch, args=item)
               for item in running.stack.gateway_addresses.items()]
    for t in pollers:
        t.start()
    for t in pollers:
        t.join()
    assert set(waits) == set(running.stack.gateway_addresses), (waits, seen)
    print(f"seconds from the route change to each gateway serving it: {waits}")
    # Nobody logged an ERROR across the restarts (abandoned watch tasks and generators did,
    # on every restart, in gateways and workers).
    for child in (*running.stack.gateways.values(), *running.stack.workers.values()):
        errors = [line for line in child.log_path.read_text().splitlines()
                  if " ERROR " in line or "Traceback" in line]
        assert not errors, (child.log_path.name, errors[:5])
    # "Within a heartbeat" of the control plane being up and the change made: the registry
    # poll (0.2 s) and a gateway's reconnect backoff (at most 0.5 s) fit in it; the margin is
    # for a 2-core host running five processes.
    assert max(waits.values()) <= HEARTBEAT_S + 0.5, (waits, seen)
