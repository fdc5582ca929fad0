"""`slora admin publish-demo DIR`: publish the demo adapters written by `slora demo-assets DIR`
on a running stack, wait until the gateway serves them, and print how to call it. The compose
stack's one-shot `publish-demo` service runs this."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_demo_commands(cmds: argparse._SubParsersAction) -> None:
    p = cmds.add_parser("publish-demo", help="register and promote the demo adapters (tenant "
                                             "demo), create a tenant key, print how to call it")
    p.add_argument("demo_dir", help="folder written by `slora demo-assets`")
    p.add_argument("--gateway", default="", help="gRPC gateway HOST:PORT to wait for: a base "
                                                 "model Generate call must succeed there")
    p.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the gateway")
    p.add_argument("--public-gateway", default="127.0.0.1:50071",
                   help="the gateway's gRPC address as callers reach it (printed)")
    p.add_argument("--public-http", default="",
                   help="the gateway's OpenAI-compatible base URL as callers reach it (printed)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import grpc

    from devtools.demo_stack import publish_demo_adapters, wait_until_routable
    from services.commands.admin_calls import resolve_target_and_key
    from services.control_plane.api.client import AdminClient

    target, key = resolve_target_and_key(args)
    demo = Path(args.demo_dir)
    if not (demo / "adapters").is_dir():
        print(f"error: {demo} holds no adapters/: run `slora demo-assets {demo}`", file=sys.stderr)
        return 1
    try:
        token = publish_demo_adapters(AdminClient.connect(target, key, args.timeout), demo)
        if args.gateway:
            wait_until_routable(args.gateway, token, [], timeout_s=args.wait)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    adapters = sorted(p.name for p in (demo / "adapters").iterdir() if p.is_dir())
    sys.stdout.write(howto(adapters, token, args.public_gateway, args.public_http))
    return 0


def howto(adapters: list[str], token: str, gateway: str, http: str) -> str:
    """What a caller runs next, with the new tenant key filled in."""
    text = (f"published {len(adapters)} demo adapters (tenant demo, version v1): "
            f"{', '.join(adapters)}\n"
            f"tenant API key (shown once): {token}\n\n"
            f"gRPC (InferenceService.Generate) at {gateway}:\n"
            f"  SLORA_API_KEY={token} slora generate --gateway {gateway} "
            f"--adapter {adapters[0]} \"The quick brown fox\"\n")
    if http:
        text += (f"\nHTTP (OpenAI-compatible) at {http}:\n"
                 f"  curl {http}/completions -H 'Authorization: Bearer {token}' "
                 f"-H 'Content-Type: application/json' "
                 f"-d '{{\"model\": \"{adapters[0]}\", \"prompt\": \"The quick brown fox\", "
                 f"\"max_tokens\": 16}}'\n")
    return text
