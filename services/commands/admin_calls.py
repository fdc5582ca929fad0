"""What every `slora admin` subcommand shares: where the control plane is and with which key,
one call with its output as a table or JSON, and the table renderers the rollout commands reuse.
(Kept apart from admin.py, which registers admin_rollout's and admin_demo's commands, so that
those import this module rather than admin.py back.)"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

DEFAULT_TARGET = "127.0.0.1:50051"


def call_command(action: Callable[[Any, argparse.Namespace], Any],
                 render: Callable[[Any], str]) -> Callable[[argparse.Namespace], int]:
    """A subcommand body: connect, run `action`, print JSON or `render`'s text; gRPC errors
    become 'error: CODE: message' on stderr and exit status 1."""

    def run(args: argparse.Namespace) -> int:
        import grpc

        from services.commands.generate import connection_settings
        from services.common.tls import saved_client_tls
        from services.control_plane.api.client import AdminClient

        target, key = resolve_target_and_key(args)
        saved_tls = saved_client_tls(connection_settings(), target, "SLORA_TARGET")
        client = AdminClient.connect(target, key, args.timeout, saved_tls)
        try:
            result = action(client, args)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
        print(_to_json(result) if args.json else render(result))
        return 0

    return run


def resolve_target_and_key(args: argparse.Namespace) -> tuple[str, str]:
    """Flags, then env, then what `slora up` wrote under .slora/up/; the saved admin key is
    only sent to the control plane saved with it, never to another target."""
    from services.commands.generate import connection_settings

    saved = connection_settings()
    target = args.target or os.environ.get("SLORA_TARGET") or saved.get("SLORA_TARGET", "")
    key = args.key or os.environ.get("SLORA_KEY", "")
    key_file = args.key_file or os.environ.get("SLORA_KEY_FILE", "")
    if not key and not key_file and target in ("", saved.get("SLORA_TARGET")):
        key_file = saved.get("SLORA_KEY_FILE", "")
    if not key and key_file:
        try:
            key = Path(key_file).read_text().strip()
        except OSError as e:
            raise SystemExit(f"error: cannot read the key file {key_file}: {e.strerror}") from None
    return target or DEFAULT_TARGET, key


def _to_json(result: Any) -> str:
    from google.protobuf.json_format import MessageToDict

    def one(m: Any) -> Any:
        return MessageToDict(m, preserving_proto_field_name=True)

    data = [one(m) for m in result] if isinstance(result, list) else one(result)
    return json.dumps(data, indent=2, sort_keys=True)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns separated by two spaces."""
    cells = [[str(h) for h in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in cells)


def _state(number: int) -> str:
    from slora.v1 import admin_pb2 as pb

    return pb.VersionState.Name(number).removeprefix("VERSION_STATE_").lower()


def versions_table(versions: Sequence[Any]) -> str:
    return table(("VERSION", "STATE", "RANK", "ALPHA", "MODULES", "BYTES", "SHA256", "URI"),
                 [(v.version, _state(v.state), v.rank, f"{v.lora_alpha:g}",
                   ",".join(v.target_modules), v.num_bytes, v.sha256[:12], v.storage_uri)
                  for v in versions])


def adapter_text(a: Any, versions: bool = True) -> str:
    r = a.route
    canary = f"{r.canary_version} ({r.traffic_ratio:.1%})" if r.canary_version else "-"
    head = (f"adapter {a.adapter_id}  tenant {a.tenant}  base {a.base_model}  etag {r.etag}\n"
            f"stable {r.stable_version or '-'}  canary {canary}  fallback {r.fallback_version or '-'}")
    return f"{head}\n\n{versions_table(a.versions)}" if versions else head
