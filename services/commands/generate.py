"""`slora generate`: stream one completion from a gateway to the terminal."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

CONNECTION_FILE = "connection.env"
DEFAULT_CONNECTION = Path(".slora/up") / CONNECTION_FILE
DEFAULT_GATEWAY = "127.0.0.1:50071"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a completion through the gateway")
    p.add_argument("prompt")
    p.add_argument("--adapter", default="", help="adapter id (default: the base model)")
    p.add_argument("--version", default=None, help="a version (default: routed)")
    p.add_argument("--routing-key", default="", help="sticky canary split key")
    p.add_argument("--gateway", default="", help=f"host:port; env SLORA_GATEWAY, else "
                                                 f"{DEFAULT_CONNECTION}, else {DEFAULT_GATEWAY}")
    p.add_argument("--api-key", default="", help=f"env SLORA_API_KEY, else {DEFAULT_CONNECTION}")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--timeout", type=float, default=120.0)
    p.set_defaults(func=run)


def connection_settings(path: Path = DEFAULT_CONNECTION) -> dict[str, str]:
    """KEY=VALUE lines written by `slora up`; empty when there is no such file."""
    if not path.exists():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs}


def run(args: argparse.Namespace) -> int:
    import grpc

    from services.common.tls import open_sync_channel, saved_client_tls
    from slora.v1 import inference_pb2 as pb
    from slora.v1 import inference_pb2_grpc as pb_grpc

    saved = connection_settings()
    gateway = args.gateway or os.environ.get("SLORA_GATEWAY") or saved.get(
        "SLORA_GATEWAY", DEFAULT_GATEWAY)
    token = args.api_key or os.environ.get("SLORA_API_KEY") or saved.get("SLORA_API_KEY", "")
    adapter = pb.AdapterRef(adapter_id=args.adapter)
    if args.version is not None:
        adapter.version = args.version
    sampling = pb.SamplingOptions(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    if args.seed is not None:
        sampling.seed = args.seed
    request = pb.GenerateRequest(text=args.prompt, adapter=adapter, sampling=sampling,
                                 routing_key=args.routing_key)
    with open_sync_channel(gateway, saved_client_tls(saved, gateway, "SLORA_GATEWAY")) as channel:
        stub = pb_grpc.InferenceServiceStub(channel)
        try:
            for response in stub.Generate(request, timeout=args.timeout,
                                          metadata=(("authorization", f"Bearer {token}"),)):
                if response.HasField("chunk"):
                    sys.stdout.write(response.chunk.text)
                    sys.stdout.flush()
                else:
                    c = response.complete
                    s = c.served_by
                    version = f"{s.adapter_id}@{s.adapter_version}" if s.adapter_id else "base"
                    sys.stderr.write(
                        f"\n[{c.finish_reason}; {c.usage.prompt_tokens}+"
                        f"{c.usage.completion_tokens} tokens; {version}"
                        f"{' (fallback)' if s.is_fallback else ''} on {s.worker_id}]\n")
        except grpc.RpcError as e:
            sys.stderr.write(f"\nslora generate: {e.code().name}: {e.details()}\n")
            return 1
    return 0
