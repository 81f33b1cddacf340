"""Deployment files: the Kubernetes manifests parse and name their probes, preStop drain and resources; the
HAProxy configs (the cluster's rendered template, the one in the ConfigMap) hash x-tandem-prefix and pass
`haproxy -c`."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from service.cluster import Cluster, ClusterConfig, Replica

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"


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
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["grpc"]["port"] == grpc_port, probe  # native gRPC probes on grpc.health.v1
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
    assert {p["port"] for p in service["spec"]["ports"]} >= {grpc_port, 9464}


def test_haproxy_in_kubernetes_hashes_the_prefix_header_over_h2():
    docs = _docs()
    cfg = docs[("ConfigMap", "tandem-haproxy")]["data"]["haproxy.cfg"]
    assert "balance hdr(x-tandem-prefix)" in cfg and "hash-type consistent" in cfg
    assert "bind :50051 proto h2" in cfg and "proto h2" in cfg.split("server-template", 1)[1]
    assert "option httpchk GET /healthz" in cfg
    haproxy = docs[("Deployment", "tandem-haproxy")]
    assert _container(haproxy)["volumeMounts"][0]["mountPath"] == "/usr/local/etc/haproxy"
    assert docs[("Service", "tandem-lb")]["spec"]["selector"] == haproxy["spec"]["selector"]["matchLabels"]


def _haproxy_check(text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "haproxy.cfg"
    path.write_text(text)
    return subprocess.run(["haproxy", "-c", "-f", str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="HAProxy is not installed (apt-get install -y haproxy)")
def test_haproxy_accepts_both_configs(tmp_path):
    cfg = ClusterConfig(replicas=2, port=18080, roundrobin_port=18081, run_dir=tmp_path)
    cluster = Cluster(cfg)
    cluster.replicas = [Replica(f"r{i}", 5000 + i, 9000 + i, cfg, print) for i in range(2)]
    rendered = cluster.render()
    assert "server r1 127.0.0.1:5001 proto h2 port 9001 check-proto h1" in rendered
    assert "balance roundrobin" in rendered and "track tandem/r0" in rendered
    checked = _haproxy_check(rendered, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    k8s = _docs()[("ConfigMap", "tandem-haproxy")]["data"]["haproxy.cfg"]
    checked = _haproxy_check(k8s, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
