"""The Kubernetes manifests (no cluster here): well-formed objects, every container command is a
`slora` command line our CLI accepts, services select existing pods, probes and claims point at
things that exist, every secret a pod uses is one the header creates, each role gets only the
secrets it needs, and the TLS and credential files the env names lie in mounted Secrets."""

from __future__ import annotations

import ast
import re
import shutil
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.cli import build_parser
from services.common import healthcheck
from services.common.tls import CA_ENV, CERT_ENV, KEY_ENV, TlsConfig

MANIFEST = Path(__file__).resolve().parent.parent / "deploy" / "k8s" / "slora.yaml"
WHOLE = "*"  # a Secret mounted as a volume: every key of it
# What each container may hold, (secret, key): the admin key only on the control plane, the
# cluster token not on workers (their own credential makes them workers).
ROLE_SECRETS = {
    "migrate": {("slora", "db-url")},
    "control-plane": {("slora", "db-url"), ("slora", "admin-key"), ("slora", "cluster-token"),
                      ("slora-tls", WHOLE)},
    "gateway": {("slora", "cluster-token"), ("slora", "gateway-token"), ("slora-tls", WHOLE)},
    "worker": {("slora", "gateway-token"), ("slora-tls", WHOLE),
               ("slora-worker-credentials", WHOLE)},
}
FILE_ENVS = {CERT_ENV, KEY_ENV, CA_ENV, "SLORA_WORKER_CREDENTIAL_FILE"}


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def header() -> str:
    """The manifest's leading comment, `#` removed and `\\`-continued lines joined."""
    lines = []
    for line in MANIFEST.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[1:].strip())
    return re.sub(r"\\\n\s*", "", "\n".join(lines))


def header_secrets() -> dict[str, set[str]]:
    """Secret name -> the keys the header's `kubectl create secret generic` commands give it (a
    `--from-file=DIR/` takes the files the header writes into DIR)."""
    text, secrets = header(), {}
    for name, flags in re.findall(r"create secret generic ([\w-]+) (.*)", text):
        keys = set(re.findall(r"--from-(?:literal|file)=([\w.-]+)=", flags))
        for folder in re.findall(r"--from-file=([\w-]+)/(?:\s|$)", flags):
            loop = re.search(r"for i in ([\d ]+); do", text)
            assert loop, "a folder of keys needs the loop that writes them"
            for stem in re.findall(rf">\s*{folder}/([\w-]+)\$i", text):
                keys |= {f"{stem}{i}" for i in loop.group(1).split()}
        secrets[name] = keys
    return secrets


def certificate_names() -> list[str]:
    """The names the header's certificate command puts in the certificate."""
    found = re.search(r"write_throwaway_certs as w; w\(Path\(\"tls\"\), (\[[^\]]*\])", header())
    assert found, "the header makes the TLS certificate"
    return list(ast.literal_eval(found.group(1)))


def pod_specs(docs: list[dict[str, Any]]) -> list[tuple[dict, dict]]:
    """(workload, pod template) for every object that runs pods."""
    return [(d, d["spec"]["template"]) for d in docs
            if d["kind"] in ("Deployment", "StatefulSet", "Job")]


def containers(docs: list[dict[str, Any]]) -> dict[str, tuple[dict, dict, dict]]:
    """container name -> (workload, pod spec, container)."""
    return {c["name"]: (w, tpl["spec"], c) for w, tpl in pod_specs(docs)
            for c in tpl["spec"]["containers"]}


def env_names(container: dict[str, Any]) -> set[str]:
    return {e["name"] for e in container.get("env", [])}


def mounted_secrets(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, dict]:
    """mount path -> (the secret volume source, the mount) for the container's secret mounts."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return {m["mountPath"]: {"secret": volumes[m["name"]]["secret"], "mount": m}
            for m in container.get("volumeMounts", []) if "secret" in volumes.get(m["name"], {})}


def test_objects_are_well_formed(docs):
    assert {d["kind"] for d in docs} >= {"Deployment", "StatefulSet", "Service", "Job"}
    for d in docs:
        assert d.get("apiVersion") and d.get("kind") and d["metadata"].get("name"), d


def test_every_container_runs_a_command_line_the_cli_accepts(docs):
    parser = build_parser()
    seen = set()
    for _, tpl in pod_specs(docs):
        for c in tpl["spec"]["containers"]:
            cmd = c["command"]
            assert cmd[0] == "slora", cmd
            args = parser.parse_args(cmd[1:])  # SystemExit on an unknown flag or subcommand
            seen.add(args.command)
    assert seen == {"control-plane", "gateway", "worker"}


def test_services_select_pods_and_probes_use_declared_ports(docs):
    labels = [tpl.get("metadata", {}).get("labels", {}) for _, tpl in pod_specs(docs)]
    for svc in (d for d in docs if d["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        assert any(selector.items() <= lab.items() for lab in labels), svc["metadata"]["name"]
    names = certificate_names()
    for _, _, c in containers(docs).values():
        ports = {p["containerPort"] for p in c.get("ports", [])}
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = c.get(kind)
            if probe is None:
                continue
            # kubelet's grpc probes cannot speak TLS, which every slora server does here.
            assert "grpc" not in probe, (c["name"], kind)
            if "httpGet" in probe:
                assert probe["httpGet"]["scheme"] == "HTTPS", (c["name"], kind)
                assert probe["httpGet"]["port"] in ports, (c["name"], kind)
                continue
            cmd = probe["exec"]["command"]
            assert cmd[:3] == ["python", "-m", "services.common.healthcheck"], cmd
            host, port = cmd[3].rsplit(":", 1)
            assert int(port) in ports and host in names, (c["name"], kind, cmd)
            assert probe.get("timeoutSeconds", 1) >= 3, "a python start takes more than 1 s"


def test_claims_exist(docs):
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    for workload, tpl in pod_specs(docs):
        templates = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        volumes = {v["name"] for v in tpl["spec"].get("volumes", [])} | templates
        for v in tpl["spec"].get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims
        for c in tpl["spec"]["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, (c["name"], m)


def test_every_secret_used_is_one_the_header_creates(docs):
    created = header_secrets()
    assert set(created) == {"slora", "slora-tls", "slora-worker-credentials"}
    for _, pod, c in containers(docs).values():
        assert "envFrom" not in c, "whole Secrets in the env would hand out every key"
        for env in c.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in created.get(ref["name"], set()), (c["name"], env)
        for mounted in mounted_secrets(pod, c).values():
            assert mounted["secret"]["secretName"] in created, (c["name"], mounted)
            assert mounted["mount"].get("readOnly") is True, (c["name"], mounted)


def test_each_role_gets_only_the_secrets_it_needs(docs):
    for name, (_, pod, c) in containers(docs).items():
        held = {(r["name"], r["key"]) for e in c.get("env", [])
                if (r := e.get("valueFrom", {}).get("secretKeyRef"))}
        held |= {(m["secret"]["secretName"], WHOLE) for m in mounted_secrets(pod, c).values()}
        assert held == ROLE_SECRETS[name], name


def secret_file(pod: dict, container: dict, path: str) -> tuple[str, str]:
    """(secret name, key) of the mounted Secret file `path` names; fails when none does."""
    folder, _, key = path.rpartition("/")
    mounted = mounted_secrets(pod, container).get(folder)
    assert mounted is not None, (container["name"], path, "is not in a mounted Secret")
    return mounted["secret"]["secretName"], key


def test_file_variables_name_keys_of_mounted_secrets(docs):
    created = header_secrets()
    for name, (workload, pod, c) in containers(docs).items():
        env = {e["name"]: e for e in c.get("env", [])}
        if name != "migrate":  # every slora server serves and verifies TLS
            assert {CERT_ENV, KEY_ENV, CA_ENV} <= set(env), name
        for var in FILE_ENVS & set(env):
            secret, key = secret_file(pod, c, env[var]["value"])
            if key != "$(POD_NAME)":
                assert key in created[secret], (name, var)
                continue
            # One key per pod of the StatefulSet, chosen through the downward API.
            assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            assert workload["kind"] == "StatefulSet", name
            stem = workload["metadata"]["name"]
            pods = {f"{stem}-{i}" for i in range(workload["spec"]["replicas"])}
            assert created[secret] == pods, (name, var)


def test_workers_authenticate_with_their_own_credential_and_gateways_reach_them(docs):
    found = containers(docs)
    cp, worker, gateway = (found[n][2] for n in ("control-plane", "worker", "gateway"))
    assert build_parser().parse_args(cp["command"][1:]).worker_auth == "credential"
    assert "SLORA_WORKER_CREDENTIAL_FILE" in env_names(worker)
    assert "SLORA_WORKER_CREDENTIAL" not in env_names(worker)  # the file, not a shared value
    # Workers serve only callers with the gateway token: both sides have it, from one key.
    refs = [{e["valueFrom"]["secretKeyRef"]["key"] for e in c["env"]
             if e["name"] == "SLORA_GATEWAY_TOKEN"} for c in (worker, gateway)]
    assert refs[0] == refs[1] == {"gateway-token"}


def test_the_certificate_names_every_address_dialled(docs):
    names = set(certificate_names())
    parser = build_parser()
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    assert {"control-plane", "gateway"} <= names & services
    for workload, _, c in containers(docs).values():
        args = parser.parse_args(c["command"][1:])
        if getattr(args, "control_plane", None):
            assert args.control_plane.rsplit(":", 1)[0] in names, c["name"]
        if getattr(args, "advertise", ""):  # gateways dial each worker at its advertised name
            for i in range(workload["spec"]["replicas"]):
                pod = f"{workload['metadata']['name']}-{i}"
                host = args.advertise.replace("$(POD_NAME)", pod).rsplit(":", 1)[0]
                assert host in names, (host, "missing from the certificate")


def make_header_certificate(folder: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Run the header's certificate command in `folder`; slora-tls key -> the file it maps to."""
    code = re.search(r"python -c '([^']*write_throwaway_certs[^']*)'", header())
    assert code, "the header makes the TLS certificate with python -c"
    monkeypatch.chdir(folder)
    exec(code.group(1), {})  # noqa: S102 - the operator's own command, from our manifest
    files = re.findall(r"--from-file=([\w.-]+)=(\S+)", header())
    return {key: folder / path for key, path in files}


def test_the_exec_probe_passes_against_a_tls_only_server(docs, tmp_path, monkeypatch):
    """What the pods do: a server with the header's certificate serving TLS only, and the
    probe command with the container's env (mount paths pointed at the same files)."""
    keys = make_header_certificate(tmp_path, monkeypatch)
    mount = tmp_path / "mount"
    mount.mkdir()
    for key, path in keys.items():
        shutil.copy(path, mount / key)
    _, pod, worker = containers(docs)["worker"]
    env = {e["name"]: e["value"] for e in worker["env"] if e["name"] in (CERT_ENV, KEY_ENV, CA_ENV)}
    for var, path in env.items():
        monkeypatch.setenv(var, str(mount / secret_file(pod, worker, path)[1]))
    tls = TlsConfig.from_env()
    assert tls is not None and tls.serves_tls
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    status = health.HealthServicer()
    status.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(status, server)
    port = server.add_secure_port("localhost:0", tls.server_credentials())
    server.start()
    try:
        assert healthcheck.main([f"localhost:{port}"]) == 0
        for var in env:  # a plaintext probe (what kubelet's grpc probe is) gets nothing
            monkeypatch.delenv(var)
        assert healthcheck.main([f"localhost:{port}"]) == 1
    finally:
        server.stop(grace=None)
