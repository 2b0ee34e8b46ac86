"""Rendered objects run as rendered: the frontend and expert-function containers the operator created on
the control plane are started as local `kubemoe` processes with exactly their rendered arguments and
environment, and a completion is served through them.

What the kubelet and the cluster network would do, done here on one machine:
- command: the image's ENTRYPOINT (`kubemoe`, Dockerfile) with the container's args; env as the kubelet
  builds it (`value` with $(VAR) expanded from the entries before it, `fieldRef` from the pod: its name,
  namespace, and an IP of its own, 127.0.0.x); $(VAR) in args expanded from that env.
- volumes: every mountPath in an argument or env value is mapped to a folder (the hostPath model volume
  to a generated tiny checkpoint, the hostPath of the node's /dev/shm (spec.dataPath.sameNode hostShm)
  to one sticky folder all pods share, as pods on one node do, emptyDirs to fresh folders). With
  sameNode tcp the rendered --shm-dir is '' and tensors travel the TCP lanes the rendered --data-port
  and --data-host $(POD_IP) offer; with hostShm, shared memory and Unix lanes in the deployment's folder,
  which the processes create. Every process runs as this test's user, as the rendered pods all run as
  spec.dataPath.runAsUser.
- ports: every pod binds the rendered ports (8080, 9095, 9096; 8000, 50051) on all addresses, so two
  expert functions would collide on one machine: the values of the port flags (and nothing else) are
  mapped to free ports, and every container port must be among them.
- cluster DNS and Services: the frontend dials the routing table's addresses
  (<service>.<namespace>.svc.cluster.local:<port>) through an HTTP CONNECT proxy (gRPC's grpc_proxy),
  which sends each address where the rendered Service (or Knative Service) routes it: its targetPort,
  by name, to the container port, that is to the mapped port of the pod's process.
- a pod's ServiceAccount token: a kubeconfig with a token of the rendered ServiceAccount, so the
  rendered Role is what lets the frontend and the expert functions watch the routing ConfigMap.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from dataclasses import fields
from pathlib import Path

import pytest
from kubernetes import client

from kubemoe.adapters import MoEAdapter
from kubemoe.checkpoint import Checkpoint
from kubemoe.devcluster import ClusterError, wait_for
from kubemoe.net import free_port
from kubemoe.pod_args import ExpertFnArgs, FrontendArgs

pytestmark = pytest.mark.cluster

MOED = dict(group="kubemoe.io", version="v1alpha1", plural="moedeployments")
KSVC = dict(group="serving.knative.dev", version="v1", plural="services")
HOSTPATH = "/models/tiny"  # the spec's model; the test maps it to the generated checkpoint
PORT_FLAGS = {f"--{f.name.replace('_', '-')}" for args in (ExpertFnArgs, FrontendArgs) for f in fields(args)
              if f.name.endswith("port")}
ENTRYPOINT = ["kubemoe"]  # of the frontend and expert-fn images (Dockerfile)


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: defined variables are replaced, $$ is a literal $, the rest stays."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


class ServiceNetwork:
    """Cluster DNS and Services for local processes: an HTTP CONNECT proxy that sends
    `<host>:<port>` to the local port `routes` names, and remembers what was dialled."""

    def __init__(self):
        self.routes: dict[tuple[str, int], int] = {}
        self.dialled: list[str] = []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(conn,), daemon=True).start()

    def _connect(self, conn: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(4096)
            if not chunk:
                return conn.close()
            head += chunk
        target = head.split()[1].decode()
        self.dialled.append(target)
        host, _, port = target.rpartition(":")
        local = self.routes.get((host, int(port)))
        if local is None:  # no such Service: what a cluster's DNS would answer
            conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\n\r\n")
            return conn.close()
        upstream = socket.create_connection(("127.0.0.1", local))
        conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n" + head.partition(b"\r\n\r\n")[2])
        for a, b in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


class Pod:
    """One rendered pod's only container, run as a local process the way the kubelet would run it."""

    def __init__(self, name: str, namespace: str, ip: str, pod_spec: dict, folder: Path, host_paths: dict[str, Path],
                 extra_env: dict[str, str] | None = None):
        self.name, self.folder = name, folder
        folder.mkdir(parents=True)
        (container,) = pod_spec["containers"]  # one container (Knative allows no more)
        assert "command" not in container, "the image's ENTRYPOINT runs: kubemoe"
        self.container = container
        self.mounts = self._mounts(pod_spec, container, host_paths)
        fields_of_pod = {"metadata.name": name, "metadata.namespace": namespace, "status.podIP": ip}
        env: dict[str, str] = {}
        for entry in container.get("env", []):
            if "valueFrom" in entry:
                env[entry["name"]] = fields_of_pod[entry["valueFrom"]["fieldRef"]["fieldPath"]]
            else:
                env[entry["name"]] = self._local(expand(entry["value"], env))
        self.env = env
        args = [self._local(expand(a, env)) for a in container["args"]]
        # Ports: the value after each port flag, mapped to a free port.
        self.ports: dict[int, int] = {}
        for i, arg in enumerate(args[:-1]):
            if arg in PORT_FLAGS:
                rendered = int(args[i + 1])
                self.ports[rendered] = free_port()
                args[i + 1] = str(self.ports[rendered])
        for port in container.get("ports", []):
            assert port["containerPort"] in self.ports, f"container port {port} is not among the ports the args bind"
        self.args = args
        self.process_env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
                            **env, **(extra_env or {})}
        self.proc: subprocess.Popen | None = None

    def _mounts(self, pod_spec: dict, container: dict, host_paths: dict[str, Path]) -> dict[str, Path]:
        volumes = {v["name"]: v for v in pod_spec["volumes"]}
        mounts = {}
        for mount in container["volumeMounts"]:
            volume = volumes[mount["name"]]
            if "hostPath" in volume:
                mounts[mount["mountPath"]] = host_paths[volume["hostPath"]["path"]]
            elif "projected" in volume and volume["name"].startswith("kube-api-access-"):
                continue  # the ServiceAccount token admission added to a pod: service_account_env stands for it
            else:
                assert "emptyDir" in volume, volume
                mounts[mount["mountPath"]] = self.folder / mount["name"]
                mounts[mount["mountPath"]].mkdir()
        return mounts

    def _local(self, text: str) -> str:
        for path in sorted(self.mounts, key=len, reverse=True):
            if text == path or text.startswith(path + "/"):
                return str(self.mounts[path]) + text[len(path):]
        return text

    def port(self, name: str) -> int:
        """The local port of a container port, by its name."""
        return self.ports[next(p["containerPort"] for p in self.container["ports"] if p["name"] == name)]

    def start(self) -> "Pod":
        with open(self.folder / "log", "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kubemoe.cli", *self.args], env=self.process_env,
                                         cwd=self.folder, stdout=log, stderr=subprocess.STDOUT)
        return self

    def log(self, lines: int = 30) -> str:
        text = (self.folder / "log").read_text(errors="replace") if (self.folder / "log").exists() else ""
        return f"--- {self.name}: " + "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def layout_of(checkpoint: Path) -> dict:
    adapter = MoEAdapter(Checkpoint(checkpoint).config)
    import torch
    return {"moeLayers": list(adapter.moe_layers), "expertsPerLayer": adapter.num_experts,
            "expertBytes": adapter.expert_bytes(torch.float32), "expertsPerToken": adapter.top_k}


def apply_and_wait(cluster, api, operator, f, body: dict) -> dict:
    """`body` applied; its status once the operator applied a plan."""
    del body["metadata"]["uid"], body["metadata"]["generation"]
    f.apply(cluster, body)
    objects = client.CustomObjectsApi(api)
    meta = body["metadata"]

    def status() -> dict:
        return objects.get_namespaced_custom_object(namespace=meta["namespace"], name=meta["name"], **MOED).get(
            "status") or {}
    f.wait(lambda: any(c["type"] == "PlanApplied" and c["status"] == "True" for c in status().get("conditions", [])),
           60, "PlanApplied=True", operator)
    return status()


def workloads(api, namespace: str, instance: str) -> tuple[dict, dict[str, dict]]:
    """The frontend Deployment the operator created and the expert functions' pods (runtime pods), by name;
    and that it created no other Deployment."""
    selector = f"app.kubernetes.io/instance={instance},app.kubernetes.io/managed-by=kubemoe-operator"
    [frontend] = [api.sanitize_for_serialization(x) for x in client.AppsV1Api(api).list_namespaced_deployment(
        namespace, label_selector=selector).items]
    assert frontend["metadata"]["name"] == f"{instance}-frontend"
    pods = {p["metadata"]["name"]: p for p in (api.sanitize_for_serialization(x) for x in client.CoreV1Api(
        api).list_namespaced_pod(namespace, label_selector=f"{selector},app.kubernetes.io/component=expert").items)}
    return frontend, pods


def service_account_env(cluster, namespace: str, folder: Path, pod_spec: dict) -> dict[str, str]:
    """The pod's ServiceAccount token, as the kubelet mounts it: what its RBAC lets it read."""
    account = pod_spec.get("serviceAccountName")
    if not account or pod_spec.get("automountServiceAccountToken") is False:
        return {}
    return {"KUBECONFIG": str(cluster.service_account_kubeconfig(account, namespace, folder / f"kubeconfig-{account}"))}


def wait_until_ready(url: str, pods: list[Pod]) -> None:
    def ready():
        for pod in pods:
            if pod.proc.poll() is not None:  # waiting longer cannot help
                raise ClusterError(f"{pod.name} exited with {pod.proc.returncode}\n{pod.log()}")
        return http(f"{url}/readyz", timeout=5)[0] == 200
    wait_for(ready, 180, "the frontend to be ready", detail=lambda: "\n".join(p.log() for p in pods))


def complete(url: str, model: str) -> dict:
    status, text = http(f"{url}/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 4,
                                                   "temperature": 0})
    assert status == 200, text
    completion = json.loads(text)
    assert completion["model"] == model and completion["usage"]["completion_tokens"] >= 1
    return completion


def http(url: str, body: dict | None = None, timeout: float = 60) -> tuple[int, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json"})
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_the_dockerfiles_serving_images_run_kubemoe(f):
    dockerfile = (f.repo / "Dockerfile").read_text()
    for stage in ("frontend", "expert-fn", "frontend-cpu", "expert-fn-cpu"):
        section = dockerfile.split(f" AS {stage}\n")[1].split("\nFROM ")[0]
        assert f"ENTRYPOINT {json.dumps(ENTRYPOINT)}" in section, stage


@pytest.mark.parametrize("runtime, same_node", [("pods", "tcp"), ("knative", "tcp"), ("pods", "hostShm")])
def test_the_rendered_frontend_and_expert_functions_serve_a_completion(cluster, api, operator, namespace, f,
                                                                        tiny_checkpoint, tmp_path, runtime, same_node):
    checkpoint = tiny_checkpoint("mixtral")
    node_shm = tmp_path / "node-dev-shm"  # the node's /dev/shm: sticky, writable by every user
    node_shm.mkdir()
    node_shm.chmod(0o1777)
    host_paths = {HOSTPATH: checkpoint, "/dev/shm": node_shm}
    layout = layout_of(checkpoint)
    layer_bytes = layout["expertsPerLayer"] * layout["expertBytes"]  # one bundle per MoE layer
    body = f.moed_body(name="run", namespace=namespace, model={"uri": f"hostpath://{HOSTPATH}", "dtype": "float32",
                                                                "layout": layout},
                       frontend={"replicas": 1, "gpus": 0}, experts={"runtime": runtime, "bundleBytes": layer_bytes},
                       dataPath={"sameNode": same_node})
    assert apply_and_wait(cluster, api, operator, f, body)["mode"] == "distributed"

    # What the operator created: the frontend Deployment, one expert function per bundle (a Knative Service,
    # or a pod under the headless Service), and their Services.
    selector = "app.kubernetes.io/instance=run,app.kubernetes.io/managed-by=kubemoe-operator"
    objects, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    frontend, expert_pods = workloads(api, namespace, "run")
    if runtime == "knative":
        experts = objects.list_namespaced_custom_object(namespace=namespace, label_selector=selector, **KSVC)["items"]
        assert not expert_pods  # Knative makes them (no controller runs here)
    else:
        experts = list(expert_pods.values())
    assert len(experts) == len(layout["moeLayers"])
    services = [api.sanitize_for_serialization(s) for s in
                core.list_namespaced_service(namespace, label_selector=selector).items]

    network = ServiceNetwork()
    pods: list[Pod] = []
    try:
        def token(pod_spec: dict) -> dict[str, str]:
            return service_account_env(cluster, namespace, tmp_path, pod_spec)

        for i, expert in enumerate(experts):
            pod_spec = expert["spec"] if runtime == "pods" else expert["spec"]["template"]["spec"]
            pods.append(Pod(f"{expert['metadata']['name']}-0", namespace, f"127.0.0.{10 + i}", pod_spec,
                            tmp_path / f"expert-{i}", host_paths, extra_env=token(pod_spec)).start())
            # Knative's cluster-local address (port 80) reaches the pod's only container port; a pod under
            # a headless Service is <hostname>.<subdomain>, the container port its targetPort names.
            name = pod_spec.get("hostname") or expert["metadata"]["name"]  # the function's
            if runtime == "knative":
                network.routes[(f"{name}.{namespace}.svc.cluster.local", 80)] = pods[-1].port("h2c")
            else:
                service = next(s for s in services if s["metadata"]["name"] == pod_spec["subdomain"])
                assert service["spec"]["clusterIP"] == "None" and pod_spec["hostname"] == name
                for port in service["spec"]["ports"]:
                    network.routes[(f"{name}.{service['metadata']['name']}.{namespace}.svc.cluster.local",
                                    port["port"])] = pods[-1].port(port["targetPort"])
        pod_spec = frontend["spec"]["template"]["spec"]
        assert token(pod_spec), "the frontend watches the routing ConfigMap with its ServiceAccount's token"
        pods.append(Pod("run-frontend-0", namespace, "127.0.0.2", pod_spec, tmp_path / "frontend", host_paths,
                        extra_env={**token(pod_spec), "grpc_proxy": network.url}).start())
        front = pods[-1]
        url = f"http://127.0.0.1:{front.port('http')}"
        wait_until_ready(url, pods)
        complete(url, "run")

        # The request went through every expert function, at the routing table's addresses, over TCP lanes
        # (tcp) or shared memory and Unix lanes in the deployment's folder of the node's /dev/shm (hostShm).
        table = json.loads(core.read_namespaced_config_map("run-routing", namespace).data["routing.json"])
        addresses = {e["address"] for r in table["routes"] for e in r["endpoints"]}
        assert set(network.dialled) == addresses
        shm, tcp = ("kubemoe_expert_fn_shared_memory_streams_total", 'result="attached"'), (
            "kubemoe_expert_fn_tcp_lane_streams_total", 'result="opened"')
        used, unused = (shm, tcp) if same_node == "hostShm" else (tcp, shm)
        for pod in pods[:-1]:
            _, metrics = http(f"http://127.0.0.1:{pod.ports[ExpertFnArgs.metrics_port]}/metrics")
            values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                      if line.startswith("kubemoe_expert_fn_")}
            tokens = sum(v for k, v in values.items() if k.startswith("kubemoe_expert_fn_tokens_total"))
            assert tokens > 0, metrics[:2000]
            streams = {name: sum(v for k, v in values.items() if k.startswith(name + "{") and result in k)
                       for name, result in (used, unused)}
            assert streams[used[0]] >= 1 and streams[unused[0]] == 0, (streams, pod.log(100))
        folders = [p.name for p in node_shm.iterdir()]
        if same_node == "hostShm":  # made by the first process, for this user alone; segments already unlinked
            uid = objects.get_namespaced_custom_object(namespace=namespace, name="run", **MOED)["metadata"]["uid"]
            assert folders == [f"kubemoe-{uid}"] and (node_shm / folders[0]).stat().st_mode & 0o777 == 0o700
        else:
            assert not folders  # tcp: no process offers a segment anywhere
        assert "travel inline" not in front.log(400)
    finally:
        for pod in reversed(pods):
            pod.stop()
        network.close()


def test_the_rendered_offload_frontend_serves_a_completion_with_a_cpu_resident_gpu_budget(
        cluster, api, operator, namespace, f, tiny_checkpoint, tmp_path):
    """mode offload as rendered: the frontend alone holds every expert in host memory, a "GPU" budget (on the
    CPU stand-in device) for the working set and two resident experts, and the LLaPor file the spec names."""
    from kubemoe.frontend.model_shape import ModelShape
    from kubemoe.frontend.offload.llapor import LayerArch, LLaPor

    checkpoint = shutil.copytree(tiny_checkpoint("mixtral"), tmp_path / "checkpoint")  # the predictor goes in it
    adapter = MoEAdapter(Checkpoint(checkpoint).config)
    shape = ModelShape.of(adapter)
    LLaPor.build(shape, {s: LayerArch("middle", 8, 16, 0, 0.0) for s in shape.moe_layers[:-1]}).save(
        checkpoint / "predictors" / "llapor.safetensors")
    layout = layout_of(checkpoint)
    budget = (2 + 2 * layout["expertsPerToken"] + 2) * layout["expertBytes"]  # the working set and 2 hot experts
    assert budget < len(layout["moeLayers"]) * layout["expertsPerLayer"] * layout["expertBytes"]
    # The session's single-GPU node is tainted: the offload frontend tolerates it.
    toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    body = f.moed_body(name="off", namespace=namespace, mode="offload",
                       model={"uri": f"hostpath://{HOSTPATH}", "dtype": "float32", "layout": layout},
                       frontend={"replicas": 1, "gpus": 0, "placement": {"tolerations": [toleration]}},
                       experts={"runtime": "pods"},
                       offload={"gpuMemoryBudget": budget, "predictorFile": "predictors/llapor.safetensors"})
    status = apply_and_wait(cluster, api, operator, f, body)
    assert (status["mode"], status["offload"]) == ("offload", {"gpuMemoryBudget": budget})
    frontend, experts = workloads(api, namespace, "off")
    assert not experts  # no expert functions: the frontend holds them

    pod_spec = frontend["spec"]["template"]["spec"]
    front = Pod("off-frontend-0", namespace, "127.0.0.3", pod_spec, tmp_path / "frontend", {HOSTPATH: checkpoint},
                extra_env=service_account_env(cluster, namespace, tmp_path, pod_spec)).start()
    try:
        url = f"http://127.0.0.1:{front.port('http')}"
        wait_until_ready(url, [front])
        complete(url, "off")
        _, ready = http(f"{url}/readyz")
        offload = json.loads(ready)["offload"]
        predictor = checkpoint / "predictors" / "llapor.safetensors"
        assert offload["lookahead"] == "llapor" and offload["lookahead_source"].startswith(f"the file {predictor}")
        assert 0 < offload["resident_experts"] <= 2 and offload["pinned"] is False  # the CPU stand-in
        assert f"offload predictor: llapor, the file {predictor}" in front.log(400)
        _, metrics = http(f"{url}/metrics")
        activated = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith("kubemoe_offload_experts_total"))
        assert activated > 0, metrics[:2000]
    finally:
        front.stop()
