"""The Kubernetes manifests (no cluster here): well-formed objects, every container command is a
`slora` command line our CLI accepts, services select existing pods, probes and claims point at
things that exist, secrets use the documented keys."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.cli import build_parser

MANIFEST = Path(__file__).resolve().parent.parent / "deploy" / "k8s" / "slora.yaml"
SECRET_KEYS = {"db-url", "admin-key", "cluster-token", "gateway-token"}  # the header creates them


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def pod_specs(docs: list[dict[str, Any]]) -> list[tuple[dict, dict]]:
    """(workload, pod template) for every object that runs pods."""
    return [(d, d["spec"]["template"]) for d in docs
            if d["kind"] in ("Deployment", "StatefulSet", "Job")]


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
    for _, tpl in pod_specs(docs):
        for c in tpl["spec"]["containers"]:
            ports = {p["containerPort"] for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe in c:
                    assert c[probe]["grpc"]["port"] in ports, (c["name"], probe)


def test_claims_and_secrets_exist(docs):
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
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == "slora" and ref["key"] in SECRET_KEYS, env


def test_the_header_creates_every_secret_key_used():
    created = set(re.findall(r"--from-literal=([\w-]+)=", MANIFEST.read_text()))
    assert created == SECRET_KEYS


def env_names(container: dict[str, Any]) -> set[str]:
    return {e["name"] for e in container.get("env", [])}


def test_workers_can_authenticate_and_gateways_reach_them(docs):
    containers = {c["name"]: c for _, tpl in pod_specs(docs) for c in tpl["spec"]["containers"]}
    cp, worker, gateway = containers["control-plane"], containers["worker"], containers["gateway"]
    args = build_parser().parse_args(cp["command"][1:])
    if args.worker_auth == "credential":  # each worker needs its own credential
        assert "SLORA_WORKER_CREDENTIAL" in env_names(worker)
    else:
        assert {"SLORA_CLUSTER_TOKEN"} <= env_names(worker) & env_names(cp)
    # Workers serve only callers with the gateway token: both sides have it, from one key.
    refs = [{e["valueFrom"]["secretKeyRef"]["key"] for e in c["env"]
             if e["name"] == "SLORA_GATEWAY_TOKEN"} for c in (worker, gateway)]
    assert refs[0] == refs[1] == {"gateway-token"}
