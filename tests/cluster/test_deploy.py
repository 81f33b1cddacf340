"""Deployment files: the Kubernetes manifests pass kubernetes-validate (the InferencePool example, a CRD it has no
schema for, is checked by hand) and name both doors' ports, their probes, preStop drain and resources; the HAProxy
configs (the cluster's rendered template, the one in the ConfigMap) hash x-tandem-prefix on both doors and pass
`haproxy -c`."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from service.cluster import Cluster, ClusterConfig, Replica

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"


CRD_KINDS = {"InferencePool", "HTTPRoute"}  # Gateway API (Inference Extension) kinds: no schema in kubernetes-validate


def _docs() -> dict[tuple[str, str], dict]:
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[(doc["kind"], doc["metadata"]["name"])] = doc
    return docs


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_tandem_deployment_has_grpc_probes_prestop_drain_and_requests():
    docs = _docs()
    deployment = docs[("Deployment", "tandem")]
    c = _container(deployment)
    assert c["command"][:2] == ["tandem", "serve"]
    grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
    assert c["args"][c["args"].index("--port") + 1] == str(grpc_port)
    for probe in ("readinessProbe", "startupProbe"):
        assert c[probe]["grpc"]["port"] == grpc_port, probe  # native gRPC probes on grpc.health.v1
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}  # stays 200 while draining
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["args"][c["args"].index("--http-port") + 1] == str(ports["http"])
    assert c["args"][c["args"].index("--metrics-port") + 1] == str(ports["metrics"])
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert "kill -TERM 1" in " ".join(pre_stop)  # the drain starts in preStop
    drain = float(c["args"][c["args"].index("--drain-grace") + 1]) + \
        float(c["args"][c["args"].index("--drain-timeout") + 1])
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain
    assert {"cpu", "memory"} <= set(c["resources"]["requests"])
    assert {"name": "TANDEM_REPLICA", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in c["env"]

    service = docs[("Service", "tandem")]
    assert service["spec"]["clusterIP"] == "None"  # headless: HAProxy sees every replica
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert {p["port"] for p in service["spec"]["ports"]} >= {grpc_port, ports["http"], ports["metrics"]}


def test_manifests_pass_kubernetes_validate():
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["kind"] not in CRD_KINDS:
                kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_inference_pool_example_selects_the_replicas_on_their_http_port():
    docs = _docs()
    pool = docs[("InferencePool", "tandem")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    tandem = docs[("Deployment", "tandem")]
    assert pool["spec"]["selector"]["matchLabels"] == tandem["spec"]["selector"]["matchLabels"]
    http_port = next(p["containerPort"] for p in _container(tandem)["ports"] if p["name"] == "http")
    assert pool["spec"]["targetPorts"] == [{"number": http_port}]
    assert pool["spec"]["endpointPickerRef"]["name"] and pool["spec"]["endpointPickerRef"]["port"]["number"]
    (rule,) = docs[("HTTPRoute", "tandem")]["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "tandem"}]


def test_haproxy_in_kubernetes_hashes_the_prefix_header_over_h2():
    docs = _docs()
    cfg = docs[("ConfigMap", "tandem-haproxy")]["data"]["haproxy.cfg"]
    assert "balance hdr(x-tandem-prefix)" in cfg and "hash-type consistent" in cfg
    assert "bind :50051 proto h2" in cfg and "proto h2" in cfg.split("server-template", 1)[1]
    assert "option httpchk GET /healthz" in cfg
    http = cfg.split("backend tandem_http", 1)[1]
    assert "bind :8000\n" in cfg and "balance hdr(x-tandem-prefix)" in http and "hash-type consistent" in http
    assert "json_query('$.user')" in cfg and "tandem.default.svc.cluster.local:8000 port 9464" in http
    haproxy = docs[("Deployment", "tandem-haproxy")]
    assert _container(haproxy)["volumeMounts"][0]["mountPath"] == "/usr/local/etc/haproxy"
    lb = docs[("Service", "tandem-lb")]["spec"]
    assert lb["selector"] == haproxy["spec"]["selector"]["matchLabels"]
    assert {p["port"] for p in lb["ports"]} == {50051, 8000}


def _haproxy_check(text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "haproxy.cfg"
    path.write_text(text)
    return subprocess.run(["haproxy", "-c", "-f", str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="HAProxy is not installed (apt-get install -y haproxy)")
def test_haproxy_accepts_both_configs(tmp_path):
    cfg = ClusterConfig(replicas=2, port=18080, http_port=18082, roundrobin_port=18081, run_dir=tmp_path)
    cluster = Cluster(cfg)
    cluster.replicas = [Replica(f"r{i}", 5000 + i, 9000 + i, 8000 + i, cfg, print) for i in range(2)]
    rendered = cluster.render()
    assert "server r1 127.0.0.1:5001 proto h2 port 9001 check-proto h1" in rendered
    assert "server r1 127.0.0.1:8001 track tandem/r1" in rendered and "bind 127.0.0.1:18082\n" in rendered
    assert "balance roundrobin" in rendered and "track tandem/r0" in rendered
    checked = _haproxy_check(rendered, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    k8s = _docs()[("ConfigMap", "tandem-haproxy")]["data"]["haproxy.cfg"]
    checked = _haproxy_check(k8s, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
