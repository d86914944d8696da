"""The Kubernetes manifests (``deploy/kubernetes``): every kustomization renders with ``kubectl kustomize`` and every
object validates against the Kubernetes schemas (``kubernetes-validate``, strict: no unknown fields); the gateway's
probes, drain and hardening; the native sidecar beside an app that only changes its base URL; the shipped config
is valid."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from conftest import ROOT, lacking, need

DEPLOY = ROOT / "deploy" / "kubernetes"
KUSTOMIZATIONS = sorted(p.parent for p in DEPLOY.glob("*/kustomization.yaml"))
K8S_VERSION = "1.32.0"  # kubectl's own (its kustomize renders the files)
CRDS = {("monitoring.coreos.com/v1", "PodMonitor")}  # the Prometheus Operator's: no schema in the core set


def render(path: Path) -> list[dict[str, Any]]:
    kubectl = need("kubectl", "kubectl 1.27 or newer renders the kustomizations")
    version = subprocess.run([kubectl, "version", "--client"], capture_output=True, text=True, timeout=30).stdout
    if "Kustomize Version: v5" not in version:  # Debian's kubectl 1.20 has kustomize 2, which cannot render them
        lacking(f"kubectl 1.27 or newer (kustomize v5) renders the kustomizations; found: {version.strip()[:80]}")
    out = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr, out.stderr  # e.g. a deprecated field (bases, commonLabels): kustomize 5 syntax
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_there_are_a_base_a_sidecar_and_replicas() -> None:
    assert {p.name for p in KUSTOMIZATIONS} == {"base", "config", "sidecar", "replicas"}


@pytest.mark.parametrize("path", KUSTOMIZATIONS, ids=lambda p: p.name)
def test_each_kustomization_renders_and_validates(path: Path) -> None:
    docs = render(path)
    assert docs
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            assert doc["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises on any schema error


def _pod(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    deployment = next(d for d in docs if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] == name)
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()  # it selects its pods
    return deployment["spec"]["template"]["spec"]


def _hardened(pod: dict[str, Any], container: dict[str, Any]) -> None:
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
    assert "memory" in container["resources"]["limits"] and container["resources"]["requests"]["cpu"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/etc/tiergate", "/tmp"} <= mounts  # the config, and the writable places: metrics files, the keys' spend
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GATEWAY_STATE_DIR"] in mounts


def test_the_base_deploys_the_gateway_with_probes_drain_and_hardening() -> None:
    docs = render(DEPLOY / "base")
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "PodMonitor", "ConfigMap"} <= kinds
    assert not any(d["kind"] == "Secret" for d in docs)  # keys are the operator's Secret, never in the repository
    pod = _pod(docs, "tiergate")
    (gw,) = pod["containers"]
    _hardened(pod, gw)
    assert gw["readinessProbe"]["httpGet"]["path"] == "/readyz" and gw["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert gw["envFrom"] == [{"secretRef": {"name": "tiergate-keys"}}]
    env = {e["name"]: e["value"] for e in gw["env"]}
    pre_stop = int(gw["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop + int(env["GATEWAY_DRAIN_TIMEOUT"])  # the drain fits
    assert "--host" in gw["args"] and "0.0.0.0" in gw["args"]
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    volume = next(v for v in pod["volumes"] if v["name"] == "config")
    assert volume["configMap"]["name"] == config["metadata"]["name"]  # the generated (hashed) name, rolled on change
    pdb = next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == next(
        d for d in docs if d["kind"] == "Deployment")["spec"]["selector"]["matchLabels"]


def test_the_sidecar_is_native_and_the_app_only_changes_its_base_url() -> None:
    docs = render(DEPLOY / "sidecar")
    pod = _pod(docs, "example-app")
    (sidecar,) = pod["initContainers"]
    assert sidecar["name"] == "tiergate" and sidecar["restartPolicy"] == "Always"  # native sidecar (1.29+)
    # the app starts once the gateway is ready; probed on loopback, where it listens (an httpGet probe goes to the
    # pod's IP and would never pass)
    assert "http://127.0.0.1:8080/readyz" in " ".join(sidecar["startupProbe"]["exec"]["command"])
    assert "http://127.0.0.1:8080/healthz" in " ".join(sidecar["livenessProbe"]["exec"]["command"])
    assert not any("httpGet" in sidecar[p] for p in ("startupProbe", "readinessProbe", "livenessProbe"))
    assert sidecar["args"][sidecar["args"].index("--host") + 1] == "127.0.0.1"  # loopback only
    _hardened(pod, sidecar)
    (app,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in app["env"]}
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:8080/v1"
    assert "envFrom" not in app  # the app never holds an upstream key


def test_the_replicas_share_one_redis_that_only_the_gateway_reaches() -> None:
    docs = render(DEPLOY / "replicas")
    gateway = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "tiergate")
    assert gateway["spec"]["replicas"] == 3
    env = {e["name"]: e.get("value") for e in _pod(docs, "tiergate")["containers"][0]["env"]}
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "tiergate-redis")
    port = service["spec"]["ports"][0]["port"]
    assert env["GATEWAY_REDIS_URL"] == f"redis://tiergate-redis:{port}/0"  # the Service's name and port
    redis = _pod(docs, "tiergate-redis")
    store = next(d for d in docs if d["metadata"]["name"] == "tiergate-redis" and d["kind"] == "StatefulSet")
    assert service["spec"]["selector"].items() <= store["spec"]["template"]["metadata"]["labels"].items()
    container = redis["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True and redis["securityContext"]["runAsNonRoot"]
    args = container["args"]
    # the keys' budgets survive a restart of Redis: an append-only file on the StatefulSet's claim, mounted where
    # Redis writes it; bounded in memory, never evicting a budget before what expires sooner
    assert args[args.index("--appendonly") + 1] == "yes" and args[args.index("--dir") + 1] == "/data"
    assert args[args.index("--maxmemory-policy") + 1] == "volatile-ttl" and "--maxmemory" in args
    claim = store["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    assert {"name": claim, "mountPath": "/data"} in container["volumeMounts"]
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy")
    allowed = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert allowed.items() <= gateway["spec"]["template"]["metadata"]["labels"].items()  # the gateway's pods only


def test_the_shipped_kubernetes_config_is_valid() -> None:
    run = subprocess.run([sys.executable, "-m", "gateway", "check-config", str(DEPLOY / "config" / "gateway.yaml")],
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    assert "warnings:" not in run.stdout


def test_the_docs_kubernetes_facts_are_the_manifests() -> None:
    """What docs/operations.md states of the manifests (the termination grace, the drain, where the config is mounted)
    is what they render."""
    docs = (ROOT / "docs" / "operations.md").read_text()
    pod = next(d for d in render(DEPLOY / "base") if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    gateway = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in gateway["env"]}
    assert f"an {pod['terminationGracePeriodSeconds']} s termination grace" in docs
    assert f"the {env['GATEWAY_DRAIN_TIMEOUT']} s drain" in docs
    mount = next(m["mountPath"] for m in gateway["volumeMounts"] if m["name"] == "config")
    assert env["GATEWAY_CONFIG"] == f"{mount}/gateway.yaml" and f"`{env['GATEWAY_CONFIG']}`" in docs
    assert "`deploy/kubernetes/config/gateway.yaml`" in docs and (DEPLOY / "config" / "gateway.yaml").exists()
