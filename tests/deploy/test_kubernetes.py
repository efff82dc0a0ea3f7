"""deploy/kubernetes: rendered by kustomize (kubectl kustomize), validated offline against the
Kubernetes JSON schemas (kubernetes-validate), and checked against each other and the server:
probes, drain timing, settings keys, GPU overlay, HPA <- adapter rules, InferencePool <- EPP."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from server.settings import Settings
from tests.deploy.tooling import DEPLOY, missing, promql_metric_names, require_tool, run

K8S = DEPLOY / "kubernetes"
KUSTOMIZATIONS = ["base", "overlays/gpu", "prometheus-adapter", "inferencepool"]
# Custom resources: no schema ships with Kubernetes; checked structurally below instead.
CRD_KINDS = {"InferencePool", "HTTPRoute"}
# The Gateway API Inference Extension protocol gauges the server exports under vLLM's names.
PROTOCOL_GAUGES = {"vllm:num_requests_waiting", "vllm:num_requests_running"}
PROTOCOL_GAUGES |= {"vllm:kv_cache_usage_perc"}  # not the deprecated gpu_cache_usage_perc
_RENDERED: dict[str, list[dict]] = {}


def render(kustomization: str) -> list[dict]:
    if kustomization not in _RENDERED:
        kubectl = require_tool("kubectl")
        result = run([kubectl, "kustomize", str(K8S / kustomization)])
        assert result.returncode == 0, result.stderr
        _RENDERED[kustomization] = [d for d in yaml.safe_load_all(result.stdout) if d]
    return _RENDERED[kustomization]


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    matches = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(matches) == 1, (kind, name, [d["metadata"]["name"] for d in matches])
    return matches[0]


def container(docs: list[dict], deployment: str = "cellserve") -> dict:
    return dict(find(docs, "Deployment", deployment)["spec"]["template"]["spec"]["containers"][0])


def kubernetes_validate():  # type: ignore[no-untyped-def]
    try:
        import kubernetes_validate as kv
    except ImportError:
        missing("kubernetes-validate not installed; pip install kubernetes-validate (test extra)")
    return kv


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
@pytest.mark.parametrize("version", ["1.30.0", "latest"])
def test_manifests_validate_against_the_kubernetes_schemas(
    kustomization: str, version: str
) -> None:
    kv = kubernetes_validate()
    version = kv.latest_version() if version == "latest" else version
    docs = render(kustomization)
    checked = 0
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        kv.validate(doc, version, strict=True)
        checked += 1
    assert checked >= 1


def test_the_validator_rejects_a_misspelt_field() -> None:
    kv = kubernetes_validate()
    deployment = yaml.safe_load(yaml.safe_dump(find(render("base"), "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, kv.latest_version(), strict=True)


def test_kustomize_rejects_a_missing_resource(tmp_path: Path) -> None:
    kubectl = require_tool("kubectl")
    (tmp_path / "kustomization.yaml").write_text("resources:\n  - nothere.yaml\n")
    assert run([kubectl, "kustomize", str(tmp_path)]).returncode != 0


def test_probes_hit_health_on_the_container_port() -> None:
    c = container(render("base"))
    (port,) = c["ports"]
    assert port["containerPort"] == 8000
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": port["name"]}
    service = find(render("base"), "Service", "cellserve")
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]


def test_grace_period_covers_prestop_and_drain() -> None:
    docs = render("base")
    pod = find(docs, "Deployment")["spec"]["template"]["spec"]
    c = pod["containers"][0]
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop_s = float(command[1])
    assert 2 <= pre_stop_s <= 15
    drain_s = float(find(docs, "ConfigMap", "cellserve-config")["data"]["CELLSERVE_DRAIN_TIMEOUT"])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + drain_s + 5
    liveness = c["livenessProbe"]
    # A draining pod answers 503; liveness must not restart it before the drain ends.
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > pre_stop_s + drain_s
    assert c["readinessProbe"]["failureThreshold"] == 1


def test_configmap_keys_are_server_settings() -> None:
    for kustomization in ("base", "overlays/gpu"):
        data = find(render(kustomization), "ConfigMap", "cellserve-config")["data"]
        assert data
        for key in data:
            assert key.startswith("CELLSERVE_"), key
            field = key.removeprefix("CELLSERVE_").lower()
            assert field in Settings.model_fields, key
        Settings(**{k.removeprefix("CELLSERVE_").lower(): v for k, v in data.items()})


def test_resources_are_bounded() -> None:
    resources = container(render("base"))["resources"]
    assert set(resources) == {"requests", "limits"}
    assert {"cpu", "memory"} <= set(resources["requests"]) <= set(resources["limits"])


def test_gpu_overlay_runs_the_cuda_image_on_one_gpu_in_bfloat16() -> None:
    docs = render("overlays/gpu")
    c = container(docs)
    assert c["image"].endswith(":cuda")
    assert container(render("base"))["image"] == "cellserve:latest"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    data = find(docs, "ConfigMap", "cellserve-config")["data"]
    assert data["CELLSERVE_DEVICE"] == "cuda" and data["CELLSERVE_DTYPE"] == "bfloat16"
    # The overlay patches; the probes and drain settings of the base stay.
    assert c["readinessProbe"] == container(render("base"))["readinessProbe"]


def adapter_rules() -> list[dict]:
    cm = find(render("prometheus-adapter"), "ConfigMap")
    assert cm["metadata"]["namespace"] == "monitoring"
    return list(yaml.safe_load(cm["data"]["config.yaml"])["rules"])


def test_hpa_metrics_are_served_by_the_adapter_rules() -> None:
    hpa = find(render("base"), "HorizontalPodAutoscaler")
    assert (
        hpa["spec"]["scaleTargetRef"]["name"]
        == find(render("base"), "Deployment")["metadata"]["name"]
    )
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert wanted == {"cellserve_requests_waiting", "cellserve_kv_cache_usage_ratio"}
    served = set()
    for rule in adapter_rules():
        (series,) = promql_metric_names(rule["seriesQuery"])
        served.add(re.sub(rule["name"]["matches"], rule["name"]["as"], series))
        assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
        assert "<<.Series>>" in rule["metricsQuery"]
    assert wanted <= served


def epp_metric_flags() -> dict[str, str]:
    args = container(render("inferencepool"), "cellserve-epp")["args"]
    flags = dict(a.removeprefix("--").split("=", 1) for a in args)
    return {k: v for k, v in flags.items() if k.endswith("-metric") and v}


def test_inference_pool_selects_the_cellserve_pods_and_names_the_epp() -> None:
    docs = render("inferencepool")
    pool = find(docs, "InferencePool", "cellserve")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    pod_labels = find(render("base"), "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    assert [p["number"] for p in spec["targetPorts"]] == [8000]
    ref = spec["endpointPickerRef"]
    assert ref["kind"] == "Service" and ref["failureMode"] in {"FailOpen", "FailClose"}
    epp_service = find(docs, "Service", ref["name"])
    assert ref["port"]["number"] in {p["port"] for p in epp_service["spec"]["ports"]}
    epp = container(docs, "cellserve-epp")
    assert "--pool-name=" + pool["metadata"]["name"] in epp["args"]
    route = find(docs, "HTTPRoute")
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])
    config = yaml.safe_load(
        find(docs, "ConfigMap", "cellserve-epp-config")["data"]["epp-config.yaml"]
    )
    assert config["kind"] == "EndpointPickerConfig"
    declared = {p["type"] for p in config["plugins"]}
    assert {r["pluginRef"] for r in config["schedulingProfiles"][0]["plugins"]} <= declared
    assert "--config-file=/config/epp-config.yaml" in epp["args"]


def test_epp_reads_the_protocol_gauges() -> None:
    flags = epp_metric_flags()
    assert set(flags) == {
        "total-queued-requests-metric",
        "total-running-requests-metric",
        "kv-cache-usage-percentage-metric",
    }
    assert set(flags.values()) == PROTOCOL_GAUGES


def test_adapter_and_epp_metrics_are_exported_by_the_live_server(
    live_metric_names: set[str],
) -> None:
    adapter = {name for r in adapter_rules() for name in promql_metric_names(r["seriesQuery"])}
    assert adapter - live_metric_names == set()
    assert set(epp_metric_flags().values()) - live_metric_names == set()
