"""`slora up`: the whole stack on this machine, in the foreground, until Ctrl-C.

Control plane on SQLite, one gateway and one CPU worker on the generated demo assets; the demo
adapters are registered and promoted, and a tenant key is written where `slora generate`
finds it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from services.commands.generate import CONNECTION_FILE

STATE_DIR = Path(".slora/up")
ADMIN_KEY_FILE = "admin.key"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run control plane, gateway and a CPU worker on demo assets")
    p.add_argument("--state-dir", default=str(STATE_DIR), help="logs, database, caches")
    p.add_argument("--demo-dir", default="", help="demo assets (default: STATE_DIR/demo)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--gateway-processes", type=int, default=1,
                   help="gateway processes sharing its ports (slora gateway --processes)")
    p.add_argument("--tls", action="store_true",
                   help="every hop (gRPC and the HTTP API) runs TLS with a throwaway CA written "
                        "under STATE_DIR/tls; clients find it in the connection file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from devtools.demo_assets import write_demo_assets
    from devtools.demo_stack import (
        Stack,
        StackConfig,
        publish_demo_adapters,
        wait_until_routable,
    )
    from services.common.processes import StopOnSignal, wait_serving
    from services.common.tls import CA_ENV
    from services.control_plane.api.client import AdminClient

    state = Path(args.state_dir).resolve()
    demo = Path(args.demo_dir).resolve() if args.demo_dir else state / "demo"
    if not (demo / "manifest.json").exists():
        say(f"writing demo assets to {demo}")
        write_demo_assets(demo)
    stack = Stack(StackConfig(demo_dir=demo, state_dir=state, tls=args.tls))
    tls_line = ""
    if args.tls:  # this process's own clients trust the throwaway CA too
        ca = str(stack.client_ca())
        os.environ[CA_ENV] = ca
        tls_line = f"{CA_ENV}={ca}\n"
    stop = StopOnSignal()
    try:
        say("starting the control plane (SQLite)")
        stack.start_control_plane()
        say("starting the gateway and the worker (model load takes a few seconds)")
        for i in range(args.workers):
            stack.start_worker(f"worker-{i}", wait=False)
        stack.start_gateway(wait=False, processes=args.gateway_processes)
        admin = AdminClient.connect(stack.cp_address, stack.admin_token)
        token = publish_demo_adapters(admin, demo)
        for child in stack.children():
            address = {**stack.worker_addresses, **stack.gateway_addresses}.get(child.name)
            if address:
                wait_serving(address, child, timeout_s=180)
        gateway = stack.gateway_addresses["gateway"]
        wait_until_routable(gateway, token, [])
        key_file = state / ADMIN_KEY_FILE
        write_private(key_file, stack.admin_token + "\n")
        http = stack.http_urls["gateway"]
        # `slora generate` and `slora admin` read this file when no flag or env says otherwise;
        # OPENAI_BASE_URL and OPENAI_API_KEY are the names the `openai` client reads.
        write_private(state / CONNECTION_FILE, (
            f"SLORA_GATEWAY={gateway}\nSLORA_API_KEY={token}\n"
            f"SLORA_TARGET={stack.cp_address}\nSLORA_KEY_FILE={key_file}\n"
            f"OPENAI_BASE_URL={http}\nOPENAI_API_KEY={token}\n{tls_line}"))
        print_howto(gateway, http, stack.cp_address, state, demo)
        return stop.watch(stack.children, say)
    except RuntimeError as e:
        say(f"start-up failed: {e}")
        return 1
    finally:
        say("stopping")
        stack.stop()


def print_howto(gateway: str, http: str, control_plane: str, state: Path, demo: Path) -> None:
    adapters = sorted(p.name for p in (demo / "adapters").iterdir())
    slora = sys.argv[0] if Path(sys.argv[0]).name == "slora" else "slora"
    sys.stdout.write(
        f"\nslora is up.\n"
        f"  gateway        {gateway}  (InferenceService.Generate, gRPC)\n"
        f"  OpenAI API     {http}  (model = adapter id, or 'demo' for the base model)\n"
        f"  control plane  {control_plane}  (admin API)\n"
        f"  admin key      {state / ADMIN_KEY_FILE}  (mode 0600)\n"
        f"  connection     {state / CONNECTION_FILE}  (mode 0600; read by `slora generate` "
        f"and `slora admin` run from this folder)\n"
        f"  logs           {state / 'logs'}\n"
        f"  adapters       {', '.join(adapters)} (version v1, tenant demo)\n\n"
        f"Try, in another terminal in this folder:\n"
        f"  {slora} generate --adapter {adapters[0]} \"The quick brown fox\"\n"
        f"  {slora} generate \"The quick brown fox\"          # base model only\n"
        f"  {slora} admin list\n"
        f"  env $(cat {state / CONNECTION_FILE}) {sys.executable} -c "
        f"'from openai import OpenAI; "
        f"print(OpenAI().completions.create(model=\"{adapters[0]}\", "
        f"prompt=\"The quick brown fox\", max_tokens=16).choices[0].text)'\n\n"
        f"Ctrl-C stops everything.\n")
    sys.stdout.flush()


def write_private(path: Path, text: str) -> None:
    """Write `text` to a file only its owner can read, created with mode 0600 (no window in
    which a secret sits in a world-readable file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its old mode otherwise
    with os.fdopen(fd, "w") as f:
        f.write(text)


def say(msg: str) -> None:
    sys.stdout.write(f"slora up: {msg}\n")
    sys.stdout.flush()
