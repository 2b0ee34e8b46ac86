"""Factories for MoEDeployment bodies and nodes, and (for tests marked `cluster`, on the session's control
plane from tests/conftest.py) the chart installed and the operator running as a subprocess under the
chart's ServiceAccount."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import yaml

from kubemoe.operator.plan import NodeInfo
from kubemoe.operator.spec import API_VERSION, KIND, MoEDeployment

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kubemoe"
SAMPLES = REPO / "manifests" / "samples"
SYSTEM_NAMESPACE = "kubemoe-system"
RELEASE = "kubemoe"

# A small layout: 2 MoE layers x 4 experts of 128 MiB, two experts per bundle -> 4 bundles.
SMALL_SPEC = {
    "model": {"uri": "pvc://models/tiny", "layout": {"moeLayers": [0, 1], "expertsPerLayer": 4,
                                                     "expertBytes": "128Mi"}},
    "frontend": {"replicas": 1, "gpus": 0},
    "experts": {"runtime": "pods", "bundleBytes": "256Mi"},
    "cost": {"gpuHourPrice": 2.0},
}


def moed_body(name: str = "tiny", namespace: str = "default", uid: str = "uid-1", **overrides) -> dict:
    """A MoEDeployment body; overrides are merged into spec section by section."""
    spec = copy.deepcopy(SMALL_SPEC)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": name, "namespace": namespace, "uid": uid, "generation": 1}, "spec": spec}


@pytest.fixture
def make_deployment():
    def make(**overrides) -> MoEDeployment:
        return MoEDeployment.from_body(moed_body(**overrides))
    return make


def gpu_nodes(count: int, gpus: int = 8, memory_gib: int = 80, **kwargs) -> list[NodeInfo]:
    return [NodeInfo(f"node-{i}", gpus, memory_gib * 2**30, **kwargs) for i in range(count)]


def sample(name: str) -> dict:
    return yaml.safe_load((SAMPLES / f"{name}.yaml").read_text())


# -- cluster --------------------------------------------------------------------------------------------

def install_chart(cluster) -> str:
    """The chart installed as users install it: CRDs, ServiceAccount, RBAC, operator Deployment."""
    cluster.kubectl("create", "namespace", SYSTEM_NAMESPACE)
    cluster.helm("install", RELEASE, str(CHART), f"--namespace={SYSTEM_NAMESPACE}", "--set=operator.loadsInterval=1")
    cluster.kubectl("wait", "--for=condition=Established", "crd/moedeployments.kubemoe.io", "--timeout=60s")
    return RELEASE


@pytest.fixture(scope="session")
def chart(cluster):
    return install_chart(cluster)


class OperatorProcess:
    """`python -m kubemoe.operator.cli` with the chart's ServiceAccount token: RBAC is tested too."""

    def __init__(self, cluster, kubeconfig: Path, log: Path):
        self.cluster, self.kubeconfig, self.log = cluster, kubeconfig, log
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> "OperatorProcess":
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "KUBEMOE_OPERATOR_LOADS_INTERVAL_S": "1",
               "KUBEMOE_OPERATOR_LOADS_TIMEOUT_S": "0.5", "NO_PROXY": "*"}
        # Each start outranks the ones before: a killed operator's peering record lives on for 60s and
        # a lower-priority newcomer would (rightly) pause until it expires.
        self.starts += 1
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kubemoe.operator.cli", "--all-namespaces", "--peering", "kubemoe",
                 "--liveness", "", "--priority", str(1000 + self.starts)],
                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        return self

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""


def start_operator(cluster, folder: Path) -> OperatorProcess:
    """The operator process on `cluster` (chart installed) with the chart's ServiceAccount token."""
    sa = f"{RELEASE}"  # the chart's fullname when the release is named like the chart
    kubeconfig = cluster.service_account_kubeconfig(sa, SYSTEM_NAMESPACE, folder / "kubeconfig")
    return OperatorProcess(cluster, kubeconfig, folder / "operator.log").start()


@pytest.fixture(scope="session")
def operator(cluster, chart, tmp_path_factory):
    running = start_operator(cluster, tmp_path_factory.mktemp("operator"))
    yield running
    running.kill(signal.SIGTERM)


def wait(check, timeout: float, what: str, operator: OperatorProcess | None = None):
    from kubemoe.devcluster import wait_for
    return wait_for(check, timeout, what, detail=lambda: operator.tail() if operator else "")


def apply(cluster, body: dict) -> None:
    path = Path(f"/tmp/kubemoe-test-{uuid.uuid4().hex}.json")
    path.write_text(json.dumps(body))
    try:
        cluster.kubectl("apply", "-f", str(path))
    finally:
        path.unlink()


MOED = dict(group="kubemoe.io", version="v1alpha1", plural="moedeployments")


def moed(api, namespace: str, name: str) -> dict:
    from kubernetes import client
    return client.CustomObjectsApi(api).get_namespaced_custom_object(namespace=namespace, name=name, **MOED)


def condition(obj: dict, kind: str) -> dict:
    """The status condition of type `kind`, or {}."""
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == kind), {})


def routing_table(api, namespace: str, name: str) -> dict:
    from kubernetes import client
    cm = client.CoreV1Api(api).read_namespaced_config_map(f"{name}-routing", namespace)
    return json.loads(cm.data["routing.json"])


class LoadServer:
    """Serves a LoadReport (JSON, as a frontend's /loads answers) on a frontend pod's IP and port 8000:
    kwok pod IPs are loopback addresses, so the operator reaches it where it would reach the frontend."""

    def __init__(self, ip: str, report: dict):
        self.report = report  # replace it to change what the next GET sees
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/loads" else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps(outer.report).encode())

            def log_message(self, *args):
                pass

        self.server = HTTPServer((ip, 8000), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class Factories:
    """Helpers for test modules (conftest is not importable under --import-mode=importlib)."""

    moed_body = staticmethod(moed_body)
    gpu_nodes = staticmethod(gpu_nodes)
    sample = staticmethod(sample)
    apply = staticmethod(apply)
    install_chart = staticmethod(install_chart)
    start_operator = staticmethod(start_operator)
    wait = staticmethod(wait)
    LoadServer = LoadServer
    moed = staticmethod(moed)
    condition = staticmethod(condition)
    routing_table = staticmethod(routing_table)
    repo = REPO
    chart = CHART
    samples = SAMPLES


@pytest.fixture(scope="session")
def f() -> type[Factories]:
    return Factories
