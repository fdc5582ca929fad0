"""`slora admin ...`: operate the adapter registry through the control plane's admin API.

Human tables by default, `--json` for scripts. `--target` (env SLORA_TARGET) and `--key` or
`--key-file` (env SLORA_KEY, SLORA_KEY_FILE) say where and as whom; without them, the stack
`slora up` started from this folder (.slora/up/connection.env and its 0600 admin key file).
Route changes read the adapter's etag first unless
`--etag` is given, so a change made by someone else in between fails with ABORTED.
Canary policies and `status` live in admin_rollout.py, what every command shares in
admin_calls.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from services.commands.admin_calls import (
    DEFAULT_TARGET,
    adapter_text,
    call_command,
    table,
    versions_table,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("admin", help="publish, canary, promote, roll back adapters; keys")
    p.add_argument("--target", default="", help=f"control plane HOST:PORT; env SLORA_TARGET, "
                                                  f"else slora up's, else {DEFAULT_TARGET}")
    p.add_argument("--key", default="", help="API token; env SLORA_KEY")
    p.add_argument("--key-file", default="", help="a file holding the API token; env "
                                                   "SLORA_KEY_FILE, else slora up's admin key")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per call")
    cmds = p.add_subparsers(dest="admin_command", required=True)
    _add_route_commands(cmds)
    _add_read_commands(cmds)
    _add_key_commands(cmds)
    from services.commands.admin_demo import add_demo_commands
    from services.commands.admin_rollout import add_rollout_commands

    add_rollout_commands(cmds)
    add_demo_commands(cmds)
    d = cmds.add_parser("digest", help="print an adapter directory's sha256 (no server needed)")
    d.add_argument("path")
    d.set_defaults(func=_digest)


def _add_route_commands(cmds: argparse._SubParsersAction) -> None:
    r = cmds.add_parser("register", help="fetch, verify, validate and record a version")
    r.add_argument("adapter_id")
    r.add_argument("version")
    r.add_argument("storage_uri", help="file:///... or s3://bucket/prefix")
    r.add_argument("--sha256", required=True, help="from `slora admin digest DIR`")
    r.add_argument("--base-model", required=True)
    r.add_argument("--tenant", required=True)
    r.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    r.set_defaults(func=call_command(lambda c, a: c.register(
        a.adapter_id, a.version, a.storage_uri, a.sha256, a.base_model, a.tenant,
        _labels(a.label)), lambda m: versions_table([m])))
    for name, helptext in (("canary", "send a share of traffic to a validated version"),
                           ("promote", "make a version stable (the old stable becomes fallback)"),
                           ("retire", "retire a version that takes no traffic")):
        c = cmds.add_parser(name, help=helptext)
        c.add_argument("adapter_id")
        c.add_argument("version")
        if name == "canary":
            c.add_argument("--ratio", type=float, required=True, help="share in (0, 1]")
        c.add_argument("--etag", default=None)
        c.add_argument("--reason", default="")
    cmds.choices["canary"].set_defaults(func=call_command(lambda c, a: c.canary(
        a.adapter_id, a.version, a.ratio, a.etag, a.reason), adapter_text))
    cmds.choices["promote"].set_defaults(func=call_command(lambda c, a: c.promote(
        a.adapter_id, a.version, a.etag, a.reason), adapter_text))
    cmds.choices["retire"].set_defaults(func=call_command(lambda c, a: c.retire(
        a.adapter_id, a.version, a.etag, a.reason), adapter_text))
    rb = cmds.add_parser("rollback", help="send all traffic back to the stable/fallback version")
    rb.add_argument("adapter_id")
    rb.add_argument("--reason", required=True)
    rb.add_argument("--etag", default=None)
    rb.set_defaults(func=call_command(lambda c, a: c.rollback(a.adapter_id, a.reason, a.etag),
                                      adapter_text))


def _add_read_commands(cmds: argparse._SubParsersAction) -> None:
    from slora.v1 import admin_pb2 as pb

    g = cmds.add_parser("get", help="one adapter: route, etag and versions")
    g.add_argument("adapter_id")
    g.set_defaults(func=call_command(lambda c, a: c.get(a.adapter_id), adapter_text))
    states = [n.removeprefix("VERSION_STATE_").lower() for n in pb.VersionState.keys()[1:]]
    ls = cmds.add_parser("list", help="adapters, filtered by tenant, state and base model")
    ls.add_argument("--tenant", default="")
    ls.add_argument("--state", default="", choices=["", *states])
    ls.add_argument("--base-model", default="")
    ls.set_defaults(func=call_command(lambda c, a: c.list_all(
        a.tenant, pb.VersionState.Value(f"VERSION_STATE_{a.state.upper()}") if a.state
        else pb.VERSION_STATE_UNSPECIFIED,
        a.base_model), _adapters_table))
    ev = cmds.add_parser("events", help="the audit log, oldest first")
    ev.add_argument("--adapter", default="")
    ev.add_argument("--tenant", default="")
    ev.add_argument("--limit", type=int, default=0, help="only the last N events")
    ev.set_defaults(func=call_command(lambda c, a: c.events(a.adapter, a.tenant, a.limit),
                                      _events_table))


def _add_key_commands(cmds: argparse._SubParsersAction) -> None:
    from slora.v1 import admin_pb2 as pb

    keys = cmds.add_parser("keys", help="API keys").add_subparsers(dest="keys_command", required=True)
    kc = keys.add_parser("create", help="create a key; its token is printed once")
    kc.add_argument("--scope", choices=["admin", "tenant"], required=True)
    kc.add_argument("--tenant", default="")
    kc.add_argument("--name", default="")
    kc.set_defaults(func=call_command(lambda c, a: c.call("CreateApiKey", pb.CreateApiKeyRequest(
        scope=pb.KeyScope.Value(f"KEY_SCOPE_{a.scope.upper()}"), tenant=a.tenant, name=a.name)),
        lambda m: _keys_table([m.key]) + f"\ntoken (shown once): {m.token}"))
    kl = keys.add_parser("list")
    kl.add_argument("--tenant", default="")
    kl.set_defaults(func=call_command(lambda c, a: c.call(
        "ListApiKeys", pb.ListApiKeysRequest(tenant=a.tenant)), lambda m: _keys_table(m.keys)))
    kr = keys.add_parser("revoke")
    kr.add_argument("key_id")
    kr.set_defaults(func=call_command(lambda c, a: c.call(
        "RevokeApiKey", pb.RevokeApiKeyRequest(key_id=a.key_id)), lambda m: _keys_table([m])))
    tenants = cmds.add_parser("tenants", help="tenants").add_subparsers(
        dest="tenants_command", required=True)
    tc = tenants.add_parser("create")
    tc.add_argument("name")
    tc.set_defaults(func=call_command(lambda c, a: c.call(
        "CreateTenant", pb.CreateTenantRequest(name=a.name)), lambda m: _tenants_table([m])))
    tl = tenants.add_parser("list")
    tl.set_defaults(func=call_command(lambda c, a: c.call(
        "ListTenants", pb.ListTenantsRequest()), lambda m: _tenants_table(m.tenants)))


def _digest(args: argparse.Namespace) -> int:
    from slora_core.adapters import AdapterError, digest_adapter_dir

    try:
        digest = digest_adapter_dir(args.path)
    except AdapterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"path": args.path, "sha256": digest}) if args.json else digest)
    return 0


def _labels(specs: Sequence[str]) -> dict[str, str]:
    labels = {}
    for spec in specs:
        key, sep, value = spec.partition("=")
        if not sep or not key:
            raise SystemExit(f"--label {spec!r}: expected KEY=VALUE")
        labels[key] = value
    return labels


def _adapters_table(adapters: Sequence[Any]) -> str:
    return table(("ADAPTER", "TENANT", "BASE", "STABLE", "CANARY", "RATIO", "FALLBACK", "VERSIONS"),
                 [(a.adapter_id, a.tenant, a.base_model, a.route.stable_version or "-",
                   a.route.canary_version or "-", f"{a.route.traffic_ratio:g}",
                   a.route.fallback_version or "-", len(a.versions)) for a in adapters])


def _events_table(events: Sequence[Any]) -> str:
    return table(("ID", "AT", "ACTOR", "ACTION", "ADAPTER", "VERSION", "ETAG", "REASON"),
                 [(e.id, e.at.ToDatetime().strftime("%Y-%m-%d %H:%M:%S"), e.actor, e.action,
                   e.adapter_id or "-", e.version or "-",
                   f"{e.etag_before}->{e.etag_after}" if e.etag_after != e.etag_before else "-",
                   e.reason) for e in events])


def _keys_table(keys: Sequence[Any]) -> str:
    return table(("KEY_ID", "SCOPE", "TENANT", "NAME", "CREATED_BY", "REVOKED"),
                 [(k.key_id, "admin" if k.scope == 1 else "tenant", k.tenant or "-", k.name or "-",
                   k.created_by, "yes" if k.HasField("revoked_at") else "no") for k in keys])


def _tenants_table(tenants: Sequence[Any]) -> str:
    return table(("TENANT", "CREATED_BY", "CREATED_AT"),
                 [(t.name, t.created_by, t.created_at.ToDatetime().strftime("%Y-%m-%d %H:%M:%S"))
                  for t in tenants])
