"""The Helm chart, with a real helm binary: lint, render each mode and value set,
validate the manifests offline against Kubernetes 1.30's schemas, and check that the
config the chart renders is one qosd accepts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "qosd"
GATEWAY = ROOT / "helm" / "examples" / "gateway"
VALUE_SETS = sorted((CHART / "ci").glob("*.yaml"))
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def helm() -> str:
    """.tools/helm, fetched by scripts/get_helm.sh when missing."""
    binary = ROOT / ".tools" / "helm"
    if not binary.exists():
        subprocess.run([str(ROOT / "scripts" / "get_helm.sh")], check=True)
    return str(binary)


def run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def render(helm: str, chart: Path, *options: str) -> list[dict[str, Any]]:
    rendered = run(helm, "template", "rel", str(chart), *options)
    assert rendered.returncode == 0, rendered.stderr
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]


def by_kind(documents: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in documents if doc["kind"] == kind]


def validate(documents: list[dict[str, Any]], tmp_path: Path) -> None:
    manifests = tmp_path / "manifests.yaml"
    manifests.write_text(yaml.safe_dump_all(documents))
    checked = run(str(BIN / "kubernetes-validate"), "-k", "1.30.0", "--strict", "--quiet",
                  str(manifests))  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


def check_config_with_qosd(documents: list[dict[str, Any]], tmp_path: Path) -> dict[str, Any]:
    (config_map,) = [doc for doc in by_kind(documents, "ConfigMap") if "qosd.yaml" in doc["data"]]
    path = tmp_path / "qosd.yaml"
    path.write_text(config_map["data"]["qosd.yaml"])
    checked = run(str(BIN / "qosd"), "config", "check", str(path))
    assert checked.returncode == 0, checked.stderr
    config: dict[str, Any] = yaml.safe_load(path.read_text())
    return config


def qosd_containers(documents: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for deployment in by_kind(documents, "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            if container["name"] == "qosd":
                yield container


def assert_hardened(container: dict[str, Any], readiness: str = "/readyz") -> None:
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert security["runAsNonRoot"] is True
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == readiness
    assert container["resources"]["limits"]["memory"]


@pytest.mark.parametrize("values", [None, *VALUE_SETS], ids=lambda v: v.stem if v else "defaults")
def test_lint_render_validate(helm: str, values: Path | None, tmp_path: Path) -> None:
    options = ["-f", str(values)] if values else []
    linted = run(helm, "lint", "--strict", str(CHART), *options)
    assert linted.returncode == 0, linted.stdout + linted.stderr
    documents = render(helm, CHART, *options)
    validate(documents, tmp_path)
    config = check_config_with_qosd(documents, tmp_path)
    assert config["logging"]["format"] == "json"
    assert config["server"]["http_listen"] == "0.0.0.0:9464"
    for container in qosd_containers(documents):
        assert_hardened(container)


def test_standalone_with_redis_and_otel(helm: str, tmp_path: Path) -> None:
    documents = render(helm, CHART, "-f", str(CHART / "ci" / "standalone-redis.yaml"))
    config = check_config_with_qosd(documents, tmp_path)
    assert config["redis"] == {"url": "redis://redis-cluster.data:6379/0", "mode": "cluster"}
    assert config["tracing"] == {
        "enabled": True,
        "endpoint": "http://otel-collector.observability:4317",
        "sample_ratio": 0.05,
        "service_name": "qosd",
        "resource_attributes": {"deployment.environment": "prod"},
    }
    assert config["envoy_rls"]["default_class"] == "P1"
    (deployment,) = by_kind(documents, "Deployment")
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]
    # configChange: reload (the default): a config change reaches the pods' volumes and
    # qosd reloads it, so no checksum rolls them.
    assert "checksum/config" not in pod["metadata"].get("annotations", {})
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["spec"]["containers"]
    env = {item["name"]: item["valueFrom"]["secretKeyRef"] for item in container["env"]}
    assert env["QOSD_REDIS_PASSWORD"] == {"name": "qosd-redis", "key": "password"}
    assert env["OTEL_EXPORTER_OTLP_HEADERS"]["name"] == "qosd-otel"
    assert "password" not in yaml.safe_dump(config)  # the Secret, not the ConfigMap
    (service,) = by_kind(documents, "Service")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"grpc": 50051, "http": 9464}
    (pdb,) = by_kind(documents, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    (monitor,) = by_kind(documents, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "http"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"


def test_workers_in_standalone_mode_only_and_on_redis(helm: str, tmp_path: Path) -> None:
    """Standalone on Redis: the workers value (auto: one per CPU of the container's
    limit); on the embedded store and in the sidecar: one, whatever it says."""
    for options, workers in [
        (["-f", str(CHART / "ci" / "standalone-redis.yaml")], "auto"),
        (["-f", str(CHART / "ci" / "standalone-trial.yaml"), "--set", "workers=3"], 3),
        (["--set", "workers=1"], 1),
        ([], 1),
        (["-f", str(CHART / "ci" / "sidecar-socket.yaml"), "--set", "workers=3"], 1),
    ]:
        config = check_config_with_qosd(render(helm, CHART, *options), tmp_path)
        assert config["server"]["workers"] == workers, options


def test_config_change_restart_rolls_the_pods_on_every_change(helm: str) -> None:
    def checksum(*options: str) -> str:
        (deployment,) = by_kind(render(helm, CHART, "--set", "configChange=restart", *options),
                                "Deployment")  # fmt: skip
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["team"] == "inference"  # podAnnotations kept beside it
        return str(annotations["checksum/config"])

    first = checksum("--set", "podAnnotations.team=inference")
    again = checksum("--set", "podAnnotations.team=inference")
    changed = checksum("--set", "podAnnotations.team=inference", "--set", "config.fail_mode=open")
    assert first == again != changed


def test_tls_auth_and_the_admin_socket(helm: str, tmp_path: Path) -> None:
    documents = render(
        helm, CHART, "--set", "tls.secretName=qosd-tls", "--set", "tls.requireClientCert=true",
        "--set", "auth.control.tokenSecret=qosd-operators",
        "--set", "auth.qos.identities={spiffe://cluster.local/ns/llm/sa/gateway}",
        "--set", "serviceMonitor.enabled=true",
    )  # fmt: skip
    validate(documents, tmp_path)
    (config_map,) = by_kind(documents, "ConfigMap")
    # qosd checks the files the config names, so give it the pod's files, here.
    pod_files = "/var/run/secrets/qosd"
    for name in ("tls/tls.crt", "tls/tls.key", "tls/ca.crt", "control-token/token"):
        (tmp_path / "secrets" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "secrets" / name).write_text("from the Secret\n")
    here = config_map["data"]["qosd.yaml"].replace(pod_files, str(tmp_path / "secrets"))
    config_map["data"]["qosd.yaml"] = here
    config = check_config_with_qosd(documents, tmp_path)
    assert config["server"]["admin_listen"] == ["unix:/var/run/qosd-admin/admin.sock"]
    assert set(config["server"]["tls"]) == {"cert_file", "key_file", "client_ca_file"}
    assert config["auth"]["control"] == {"token_file": f"{tmp_path}/secrets/control-token/token"}
    assert config["auth"]["qos"] == {"identities": ["spiffe://cluster.local/ns/llm/sa/gateway"]}
    (deployment,) = by_kind(documents, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["qosd-tls"] == f"{pod_files}/tls"
    assert mounts["qosd-control-token"] == f"{pod_files}/control-token"
    assert mounts["qosd-admin"] == "/var/run/qosd-admin"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["qosd-tls"]["secret"] == {"secretName": "qosd-tls"}
    assert volumes["qosd-admin"] == {"name": "qosd-admin", "emptyDir": {}}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["scheme"] == "HTTPS"
    (monitor,) = by_kind(documents, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["scheme"] == "https"


def test_trial_redis(helm: str, tmp_path: Path) -> None:
    documents = render(helm, CHART, "-f", str(CHART / "ci" / "standalone-trial.yaml"))
    config = check_config_with_qosd(documents, tmp_path)
    assert config["redis"]["url"] == "redis://rel-qosd-redis:6379/0"
    names = {doc["metadata"]["name"] for doc in by_kind(documents, "Service")}
    assert names == {"rel-qosd", "rel-qosd-redis"}
    # qosd's selectors (Deployment, Service, PDB) never match the Redis pods.
    deployments = {d["metadata"]["name"]: d for d in by_kind(documents, "Deployment")}
    redis_labels = deployments["rel-qosd-redis"]["spec"]["template"]["metadata"]["labels"]
    (pdb,) = by_kind(documents, "PodDisruptionBudget")
    for selector in (
        deployments["rel-qosd"]["spec"]["selector"]["matchLabels"],
        pdb["spec"]["selector"]["matchLabels"],
        next(s for s in by_kind(documents, "Service") if s["metadata"]["name"] == "rel-qosd")[
            "spec"
        ]["selector"],
    ):
        assert not set(selector.items()) <= set(redis_labels.items())


def test_sidecar_mode_renders_only_the_config(helm: str, tmp_path: Path) -> None:
    documents = render(helm, CHART, "-f", str(CHART / "ci" / "sidecar-socket.yaml"))
    assert sorted(doc["kind"] for doc in documents) == ["ConfigMap", "PodMonitor"]
    config = check_config_with_qosd(documents, tmp_path)
    assert config["server"]["listen"] == ["unix:///var/run/qosd/qosd.sock"]
    (monitor,) = by_kind(documents, "PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "gateway"}


def test_the_sidecar_template_in_a_gateway_chart(helm: str, tmp_path: Path) -> None:
    """An example gateway chart with qosd as a dependency includes the sidecar."""
    work = tmp_path / "gateway"
    shutil.copytree(GATEWAY, work, ignore=shutil.ignore_patterns("charts", "Chart.lock"))
    (work / "Chart.yaml").write_text(
        (work / "Chart.yaml").read_text().replace("file://../../qosd", f"file://{CHART}")
    )
    built = run(helm, "dependency", "build", str(work))
    assert built.returncode == 0, built.stderr
    linted = run(helm, "lint", "--strict", str(work))
    assert linted.returncode == 0, linted.stdout
    documents = render(helm, work)
    validate(documents, tmp_path)
    check_config_with_qosd(documents, tmp_path)
    (deployment,) = by_kind(documents, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    gateway, qosd = pod["containers"]
    assert (gateway["name"], qosd["name"]) == ("gateway", "qosd")
    # Readiness gates the gateway pod: a Redis outage must not take every gateway out.
    assert_hardened(qosd, readiness="/healthz")
    # Both mount the socket directory; the ConfigMap is the subchart's.
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["qosd-socket"] == {"name": "qosd-socket", "emptyDir": {}}
    assert volumes["qosd-config"]["configMap"]["name"] == "rel-qosd"
    for container in (gateway, qosd):
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts["qosd-socket"] == "/var/run/qosd"
    # No gRPC port on the pod: the sidecar listens on the socket only.
    assert [p["name"] for p in qosd["ports"]] == ["qosd-http"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["checksum/qosd-config"]


def test_proxy_mode_serves_the_openai_api_in_front_of_vllm(helm: str, tmp_path: Path) -> None:
    """The example values: a Deployment running ``qosd proxy`` with one --upstream per
    server, and a Service with the OpenAI port beside gRPC and HTTP."""
    documents = render(helm, CHART, "-f", str(CHART / "ci" / "proxy-vllm.yaml"))
    validate(documents, tmp_path)
    (container,) = qosd_containers(documents)
    args = container["args"]
    assert args[:3] == ["proxy", "--config", "/etc/qosd/qosd.yaml"]
    assert args[args.index("--upstream") + 1] == "llama-3-8b=http://vllm.inference:8000"
    assert "--priority-upstreams" in args and args[args.index("--listen") + 1] == "0.0.0.0:8080"
    assert_hardened(container)
    (service,) = by_kind(documents, "Service")
    ports = {port["name"]: port["port"] for port in service["spec"]["ports"]}
    assert ports == {"grpc": 50051, "http": 9464, "openai": 8080}
    config = check_config_with_qosd(documents, tmp_path)
    assert config["redis"]["url"] == "redis://redis.data:6379/0"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--set", "replicaCount=3"], "replicaCount > 1 needs redis.url"),
        (["--set", "redis.url=redis://r:6379/0", "--set", "redis.trial.enabled=true"],
         "not both"),
        (["--set", "mode=daemonset"], "mode"),
        (["--set", "redis.url=http://redis:6379"], "/redis/url"),
        (["--set", "mode=sidecar", "--set", "serviceMonitor.enabled=true"], "podSelector"),
        (["--set", "otel.sampleRatio=2"], "sampleRatio"),
        (["--set", "redis.trial.enabled=true", "--set", "redis.existingSecret=s"], "no password"),
        (["--set", "tls.requireClientCert=true"], "needs tls.secretName"),
        (["--set", "workers=2"], "workers > 1 needs redis.url"),
        (["--set", "workers=0"], "/workers"),
        (["--set", "tls.secretName=t", "--set", "auth.control.identities={spiffe://a/b}"],
         "set tls.requireClientCert"),
        (["--set", "mode=proxy"], "proxy mode needs proxy.upstreams"),
        (["--set", "mode=proxy", "--set", "proxy.upstreams.llm={vllm:8000}"], "/proxy/upstreams"),
        (["--set", "mode=proxy", "--set", "proxy.upstreams.llm={http://vllm:8000}",
          "--set", "workers=2", "--set", "redis.url=redis://r:6379/0"], "one process per pod"),
    ],
)  # fmt: skip
def test_values_that_cannot_work_are_refused(helm: str, options: list[str], message: str) -> None:
    rendered = run(helm, "template", "rel", str(CHART), *options)
    assert rendered.returncode != 0
    assert message in rendered.stderr


def test_monitoring_renders_the_rules_and_the_dashboard(helm: str, tmp_path: Path) -> None:
    """The PrometheusRule carries rules/qosd-alerts.yaml with the SLO targets of the
    values, and the dashboard ConfigMap dashboards/qosd.json with the sidecar's label.
    kubernetes-validate checks the ConfigMap against Kubernetes's schema; it has none
    for a CRD (it warns and passes a PrometheusRule), so promtool checks the rule's
    groups."""
    documents = render(helm, CHART, "-f", str(CHART / "ci" / "standalone-monitoring.yaml"))
    (rule,) = by_kind(documents, "PrometheusRule")
    (dashboards,) = [doc for doc in by_kind(documents, "ConfigMap") if "qosd.json" in doc["data"]]
    validate([rule, dashboards], tmp_path)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    groups = rule["spec"]["groups"]
    rules_file = tmp_path / "rendered-rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": groups}))
    promtool = shutil.which("promtool")
    assert promtool, "promtool is needed (scripts/system_packages.sh installs it)"
    checked = run(promtool, "check", "rules", str(rules_file))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    shipped = yaml.safe_load((CHART / "rules" / "qosd-alerts.yaml").read_text())["groups"]
    assert groups[1:] == shipped[1:]  # all but the targets, as the file has them
    (target,) = groups[0]["rules"]
    assert target["expr"] == (
        'label_replace(vector(0.999), "class", "P0", "", "") or '
        "0 * max by (class) (qosd_slo_samples_total) + 0.99"
    )
    assert dashboards["metadata"]["namespace"] == "monitoring"
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboards["metadata"]["annotations"] == {"grafana_folder": "qosd"}
    shipped_json = (CHART / "dashboards" / "qosd.json").read_text()
    assert json.loads(dashboards["data"]["qosd.json"]) == json.loads(shipped_json)


def test_the_default_targets_are_those_of_the_rules_file(helm: str) -> None:
    """Rendered with the default values, the rule is the file, group for group."""
    documents = render(helm, CHART, "--set", "monitoring.prometheusRule.enabled=true")
    (rule,) = by_kind(documents, "PrometheusRule")
    shipped = yaml.safe_load((CHART / "rules" / "qosd-alerts.yaml").read_text())["groups"]
    shipped[0]["rules"][0]["expr"] = shipped[0]["rules"][0]["expr"].strip()
    assert rule["spec"]["groups"] == shipped
    assert rule["metadata"]["namespace"] == "default"
    assert not by_kind(render(helm, CHART), "PrometheusRule")  # off by default
    assert [doc["data"].keys() for doc in by_kind(render(helm, CHART), "ConfigMap")] == [
        {"qosd.yaml"}
    ]
