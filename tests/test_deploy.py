"""deploy/ (kustomize) checked without a cluster or the network: every resource the kustomization
lists is valid against the Kubernetes JSON schemas that kubernetes-validate ships (strict: unknown
fields are errors), and the pieces agree with each other and with the code: probes on the routes
that exist, the grace period longer than the drain, the journal on the per-pod volume, the HPA and
the PodDisruptionBudget on the StatefulSet's pods, the scrape job's token from the Secret the gateways
read, every setting one gateway/config.py reads."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from engines.registry import parse_models
from gateway.http.drain import CUT_WAIT_SECONDS

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S_VERSIONS = ("1.32.0", "1.37.0")  # persistentVolumeClaimRetentionPolicy is GA from 1.32
CLUSTER_SCOPED = {"Namespace"}


def render(kustomization: Path = DEPLOY / "kustomization.yaml") -> list[dict[str, Any]]:
    """What `kubectl kustomize deploy/` gives for this kustomization: its resources in order, with
    its namespace set on the namespaced ones (the only transformer it uses; anything else fails here)."""
    spec = yaml.safe_load(kustomization.read_text())
    assert set(spec) <= {"apiVersion", "kind", "namespace", "resources"}, f"render() does not know {set(spec)}"
    out = []
    for name in spec["resources"]:
        for doc in yaml.safe_load_all((kustomization.parent / name).read_text()):
            if doc is None:
                continue
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = spec["namespace"]
            out.append(doc)
    return out


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def validation_errors(doc: dict[str, Any], version: str) -> str | None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return f"{doc['kind']} {doc['metadata']['name']}: {exc.message} at {'.'.join(map(str, exc.path))}"
    return None


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_resource_is_valid_against_the_kubernetes_schemas(version: str) -> None:
    docs = render()
    assert {d["kind"] for d in docs} == {"Namespace", "ConfigMap", "Service", "StatefulSet", "HorizontalPodAutoscaler",
                                         "PodDisruptionBudget"}
    errors = [e for d in docs if (e := validation_errors(d, version))]
    assert not errors, errors


def test_the_validator_catches_what_a_cluster_would_refuse() -> None:
    """The check above is not vacuous: a misspelt field and a wrong type are errors."""
    sts = copy.deepcopy(one(render(), "StatefulSet"))
    sts["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = sts["spec"]["template"]["spec"]["containers"][0].pop("readinessProbe")
    assert "readinessProbes" in (validation_errors(sts, K8S_VERSIONS[-1]) or "")
    sts = copy.deepcopy(one(render(), "StatefulSet"))
    sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "180"
    assert validation_errors(sts, K8S_VERSIONS[-1]) is not None


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [gateway] = one(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"]
    return gateway


def settings(docs: list[dict[str, Any]]) -> dict[str, str]:
    return one(docs, "ConfigMap", "tollgate-config")["data"]


def test_probes_drain_and_grace_period() -> None:
    docs = render()
    gw = container(docs)
    pod = one(docs, "StatefulSet")["spec"]["template"]["spec"]
    assert gw["readinessProbe"]["httpGet"]["path"] == "/readyz"  # 503 from the SIGTERM on (gateway/http/drain.py)
    assert gw["livenessProbe"]["httpGet"]["path"] == "/healthz"  # 200 while draining
    from gateway.app import create_app
    from gateway.config import Settings

    paths = {getattr(r, "path", None) for r in create_app(Settings()).routes}
    assert {"/readyz", "/healthz", "/metrics"} <= paths
    pre_stop = gw["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    drain = float(settings(docs)["TOLLGATE_DRAIN_SECONDS"])
    needed = float(pre_stop[1]) + drain + CUT_WAIT_SECONDS + 15  # + the ledger flush and shutdown
    assert pod["terminationGracePeriodSeconds"] >= needed, (pod["terminationGracePeriodSeconds"], needed)
    # The liveness probe never fails a pod that drains for the whole window (it answers; this is the bound).
    live = gw["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 10


def test_journal_on_the_pods_own_volume() -> None:
    docs = render()
    sts = one(docs, "StatefulSet")
    [claim] = sts["spec"]["volumeClaimTemplates"]
    mount = next(m for m in container(docs)["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    assert mount["mountPath"] == settings(docs)["TOLLGATE_DATA_DIR"]  # the journal lives in data_dir/journal
    assert settings(docs)["TOLLGATE_LEDGER_JOURNAL"] == "1"
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"]["whenScaled"] == "Retain"
    assert sts["spec"]["serviceName"] == one(docs, "Service", "tollgate-headless")["metadata"]["name"]


def test_hpa_pdb_and_services_select_the_gateway_pods() -> None:
    docs = render()
    sts = one(docs, "StatefulSet")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    hpa = one(docs, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"], target["apiVersion"]) == ("StatefulSet", sts["metadata"]["name"], sts["apiVersion"])
    assert container(docs)["resources"]["requests"]["cpu"]  # CPU utilisation needs a request
    assert one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for svc in by_kind(docs, "Service"):
        assert svc["spec"]["selector"].items() <= labels.items()
        assert all(p["targetPort"] == "http" for p in svc["spec"]["ports"])
    assert any(p["name"] == "http" for p in container(docs)["ports"])


def test_prometheus_scrapes_with_the_metrics_token_the_gateways_read() -> None:
    docs = render()
    env = {e["name"]: e for e in container(docs)["env"]}
    ref = env["TOLLGATE_METRICS_TOKEN"]["valueFrom"]["secretKeyRef"]
    [job] = yaml.safe_load(one(docs, "ConfigMap", "tollgate-prometheus-scrape")["data"]["scrape-config.yaml"])
    assert job["metrics_path"] == "/metrics" and job["authorization"]["type"] == "Bearer"
    assert job["authorization"]["credentials_file"] == f"/etc/prometheus/secrets/{ref['name']}/{ref['key']}"
    keep = job["relabel_configs"][0]
    label = keep["source_labels"][0].removeprefix("__meta_kubernetes_service_label_")
    scraped = [s for s in by_kind(docs, "Service")
               if any(k.replace(".", "_").replace("/", "_") == label and v == keep["regex"] for k, v in s["metadata"]["labels"].items())]
    assert [s["metadata"]["name"] for s in scraped] == ["tollgate-headless"]
    assert scraped[0]["spec"]["publishNotReadyAddresses"] is True  # a draining pod is still scraped
    assert job["kubernetes_sd_configs"][0]["namespaces"]["names"] == [docs[0]["metadata"]["name"]]


def test_every_setting_is_one_the_gateway_reads() -> None:
    docs = render()
    config_source = (ROOT / "gateway" / "config.py").read_text()
    names = [k for k in settings(docs) if k.isupper()] + [e["name"] for e in container(docs)["env"]]
    for name in names:
        assert f'"{name}"' in config_source, f"{name} is not read by gateway/config.py"
    parse_models(settings(docs)["models.yaml"], "deploy/configmap.yaml")
    secret_keys = {line.split("=", 1)[0] for line in (DEPLOY / "secret.example.env").read_text().splitlines()
                   if line and not line.startswith("#")}
    wanted = {e["valueFrom"]["secretKeyRef"]["key"] for e in container(docs)["env"]
              if e["valueFrom"]["secretKeyRef"]["name"] == "tollgate" and not e["valueFrom"]["secretKeyRef"].get("optional")}
    assert wanted <= secret_keys
